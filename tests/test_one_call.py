"""The run in one call (runtime/one_call.py): a CPU graph's inputs go to ONNX Runtime as one OrtValueVector and
its outputs come back in one call. Each test runs the same compiled graph through the one call and through
the IOBinding path it replaces and asks for the same bits, and, where it says so, eager's numbers; graphs the
one call cannot run keep the binding and say why. Speed is not tested here: the benchmark reports it."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnx.numpy_helper
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import helper

import aot2onnx
from aot2onnx.errors import RuntimeSessionError
from aot2onnx.runtime.one_call import view_outputs, with_shape
from aot2onnx.runtime.session import OrtGraph


def _graphs() -> list[OrtGraph]:
    return [g for g in aot2onnx.compiled_graphs() if g.session is not None]


def _both_ways(fn, *inputs: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``fn``'s outputs and its inputs' gradients, with the graphs in one call and then through IOBinding."""
    runs = []
    for one_call in (True, False):
        for g in _graphs():
            if not one_call:
                g._one_call = None
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        out = fn(*leaves)
        out.sum().backward()
        runs.append([out.detach(), *(t.grad for t in leaves if t.grad is not None)])
    return runs[0], runs[1]


def _assert_same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(_bits(x), _bits(y))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_a_training_step_runs_in_one_call_with_the_bindings_bits_and_eagers_numbers():
    aot2onnx.reset_compiled_graphs()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    eager_model = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot2onnx", options={"fallback": False})
    x = torch.randn(8, 16)
    one_call, binding = _both_ways(compiled, x)
    assert {g.kind.value for g in _graphs()} == {"forward", "backward"}
    _assert_same_bits(one_call, binding)
    xe = x.clone().requires_grad_()
    expected = eager_model(xe)
    expected.sum().backward()
    torch.testing.assert_close(one_call[0], expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(one_call[1], xe.grad, rtol=1e-5, atol=1e-6)


def test_graphs_say_whether_they_run_in_one_call():
    aot2onnx.reset_compiled_graphs()
    compiled = torch.compile(nn.Linear(4, 3), backend="aot2onnx", options={"fallback": False})
    compiled(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert [g.one_call_refusal for g in _graphs()] == [None, None]

    # BatchNorm's running statistics are written in place: those graphs keep the binding, which can ask
    # ONNX Runtime to write into the input's memory.
    aot2onnx.reset_compiled_graphs()
    bn = nn.BatchNorm1d(4)
    compiled = torch.compile(bn, backend="aot2onnx", options={"fallback": False})
    expected_mean = bn.running_mean.clone()
    x = torch.randn(8, 4)
    compiled(x)
    expected_mean = 0.9 * expected_mean + 0.1 * x.mean(0)
    torch.testing.assert_close(bn.running_mean, expected_mean)
    refusals = [g.one_call_refusal for g in _graphs()]
    assert refusals and all(r is None or "in place" in r for r in refusals)


def test_empty_non_contiguous_and_dynamic_inputs():
    aot2onnx.reset_compiled_graphs()

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a @ b).relu() * 2.0 + a.sum()

    compiled = torch.compile(fn, backend="aot2onnx", options={"fallback": False}, dynamic=True)
    for rows in (5, 0, 7):  # an empty batch: a tensor with no memory (data_ptr() may be 0)
        a = torch.randn(3, rows).t()  # not contiguous
        b = torch.randn(3, 2)
        one_call, binding = _both_ways(compiled, a, b)
        _assert_same_bits(one_call, binding)
        ae, be = a.clone().requires_grad_(), b.clone().requires_grad_()
        expected = fn(ae, be)
        expected.sum().backward()
        torch.testing.assert_close(one_call[0], expected.detach())
        torch.testing.assert_close(one_call[1], ae.grad)
        torch.testing.assert_close(one_call[2], be.grad)
    assert all(g.one_call_refusal is None for g in _graphs())


def test_bool_outputs_and_written_inputs_copied_after_the_run():
    aot2onnx.reset_compiled_graphs()

    def fn(x: torch.Tensor, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        buf.add_(x[:2])  # a graph input written: copied in after the run where not in place
        return x > 0, F.softmax(x, dim=-1)

    compiled = torch.compile(fn, backend="aot2onnx", options={"fallback": False})
    x = torch.randn(4, 3)
    buf_c, buf_e = torch.zeros(2, 3), torch.zeros(2, 3)
    mask, soft = compiled(x, buf_c)
    mask_e, soft_e = fn(x, buf_e)
    assert mask.dtype == torch.bool and torch.equal(mask, mask_e)
    torch.testing.assert_close(soft, soft_e)
    assert torch.equal(buf_c, buf_e)


def test_bfloat16_inputs_keep_the_binding():
    aot2onnx.reset_compiled_graphs()
    compiled = torch.compile(lambda a: (a * 2).sum(), backend="aot2onnx", options={"fallback": False})
    a = torch.randn(4, dtype=torch.bfloat16)
    assert torch.equal(compiled(a), (a * 2).sum())
    refusals = [g.one_call_refusal for g in _graphs()]
    assert refusals and all("numpy" in r for r in refusals)


def _view_model(outputs: list[str], nodes: list, dims: dict[str, list]) -> onnx.ModelProto:
    """A float32 graph of ``nodes`` over input ``x`` [256, 256] returning ``outputs`` of declared ``dims``."""
    graph = helper.make_graph(
        nodes, "views", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [256, 256])],
        [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, dims[o]) for o in outputs],
        initializer=[onnx.numpy_helper.from_array(np.array([64, 1024], np.int64), "shape")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_returned_views_of_computed_values_are_handed_over_without_a_copy():
    # A Reshape of a computed value is returned as that value; of a graph input, of a value also returned, of
    # a value another output already views, of less than 256 KiB or to a symbolic shape, it stays.
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Reshape", ["r", "shape"], ["r_view"]),
        helper.make_node("Reshape", ["r", "shape"], ["r_view2"]),
        helper.make_node("Reshape", ["x", "shape"], ["x_view"]),
        helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Identity", ["n"], ["n_copy"]),
        helper.make_node("Exp", ["x"], ["e"]), helper.make_node("Reshape", ["e", "shape"], ["e_view"]),
        helper.make_node("Abs", ["x"], ["a"]), helper.make_node("Reshape", ["a", "shape"], ["a_view"]),
        helper.make_node("Sin", ["x"], ["s"]), helper.make_node("Slice", ["s", "zero", "two"], ["s_small"]),
        helper.make_node("Identity", ["s_small"], ["s_small_copy"]),
    ]
    nodes[10:10] = [helper.make_node("Constant", [], ["zero"], value_ints=[0]),
                    helper.make_node("Constant", [], ["two"], value_ints=[2])]
    outputs = ["r_view", "r_view2", "x_view", "n_copy", "e", "e_view", "a_view", "s_small_copy"]
    dims = {o: [64, 1024] for o in outputs}
    dims.update(n_copy=[256, 256], e=[256, 256], a_view=["b", 1024], s_small_copy=[2, 256])
    model = _view_model(outputs, nodes, dims)
    rewritten, replaced = view_outputs(model, outputs)
    assert replaced == {0: ("r", (64, 1024)), 3: ("n", (256, 256))}
    assert [o.name for o in rewritten.graph.output] == ["r", *outputs[1:3], "n", *outputs[4:]]
    assert [o.name for o in model.graph.output] == outputs  # the caller's model is left as it is

    # The session runs the rewritten graph and gives each replaced output its shape back on the same memory.
    session = ort.InferenceSession(rewritten.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    results = [torch.from_numpy(a) for a in session.run(None, {"x": x})]
    shaped = with_shape(results[0], (64, 1024), "r_view")
    assert shaped.shape == (64, 1024) and shaped._base is None and shaped.data_ptr() == results[0].data_ptr()
    assert torch.equal(shaped, torch.from_numpy(np.maximum(x, 0).reshape(64, 1024)))
    with pytest.raises(RuntimeSessionError, match="65536 elements"):
        with_shape(results[0], (64, 1000), "r_view")


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, dim=-1))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = self.proj(att.transpose(1, 2).reshape(b, t, d))
        return y.flatten(1), y.sum()


def test_saved_and_returned_views_train_with_the_copies_bits_and_eagers_numbers(monkeypatch):
    # The forward graph saves views of the attention's operands for the backward pass (clone + _unsafe_view of
    # a transposed tensor) and returns the user's y.flatten(1): handed over without a copy, the same bits as
    # with the copies, eager's numbers.
    torch.manual_seed(0)
    model = _Attention(128, 4)
    x = torch.randn(8, 128, 128)
    runs = []
    for views in (True, False):
        if not views:
            monkeypatch.setattr("aot2onnx.runtime.session.view_outputs", lambda model, returned: (model, {}))
        aot2onnx.reset_compiled_graphs()
        torch._dynamo.reset()
        copied = copy.deepcopy(model)
        flat, total = torch.compile(copied, backend="aot2onnx", options={"fallback": False, "cache": False})(x)
        forward = next(g for g in _graphs() if g.kind.value == "forward")
        assert (forward.view_outputs >= 3) == views, forward.view_outputs
        (flat.square().sum() + total).backward()
        runs.append([flat.detach(), total.detach(), *(p.grad for p in copied.parameters())])
        if views:
            assert flat._base is None  # the caller's own tensor, not a view of another
    _assert_same_bits(runs[0], runs[1])
    eager = copy.deepcopy(model)
    flat, total = eager(x)
    (flat.square().sum() + total).backward()
    for got, expected in zip(runs[0], [flat.detach(), total.detach(), *(p.grad for p in eager.parameters())]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_returned_view_written_in_place_leaves_the_next_runs_alone():
    aot2onnx.reset_compiled_graphs()
    compiled = torch.compile(lambda x: (x.exp() * 2).view(128, 1024), backend="aot2onnx", options={"fallback": False})
    x = torch.randn(512, 256)
    first = compiled(x)
    assert sum(g.view_outputs for g in _graphs()) == 1 and first._base is None
    expected = first.clone()
    first.add_(1.0)
    assert torch.equal(compiled(x), expected)


def test_the_output_plan_picks_what_the_per_output_loop_picks():
    """A call's outputs come from one list of results, constants and inputs (session._output_plan): the same
    objects, in the same order, as the loop over output kinds that complex and size outputs still take."""
    from aot2onnx.runtime.session import _output_plan
    from aot2onnx.signature import GraphSignature, InputKind, InputSpec, OutputKind, OutputSpec

    inputs = tuple(InputSpec(InputKind.TENSOR, f"in{k}") for k in range(3))
    outputs = (
        OutputSpec(OutputKind.TENSOR, "a"), OutputSpec(OutputKind.INPUT, index=2),
        OutputSpec(OutputKind.CONSTANT, value=None), OutputSpec(OutputKind.TENSOR, "b"),
        OutputSpec(OutputKind.DUPLICATE, index=1), OutputSpec(OutputKind.CONSTANT, value=7),
        OutputSpec(OutputKind.INPUT, index=0), OutputSpec(OutputKind.DUPLICATE, index=3),
    )
    constants, positions = _output_plan(GraphSignature(inputs, outputs))
    results, args = [torch.zeros(1), torch.ones(1)], [torch.full((1,), 5.0), "unused", torch.full((1,), 6.0)]
    picked = [[*results, *constants, *args][p] for p in positions]
    expected = [results[0], args[2], None, results[1], args[2], 7, args[0], results[1]]
    assert len(picked) == len(expected) and all(p is e for p, e in zip(picked, expected))
    # A size output (an int made from a result) and a complex one keep the loop.
    assert _output_plan(GraphSignature(inputs, (OutputSpec(OutputKind.SYMINT, "n"),))) is None
    assert _output_plan(GraphSignature(inputs, (OutputSpec(OutputKind.TENSOR, "c", is_complex=True),))) is None
