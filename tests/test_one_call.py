"""The run in one call (runtime/one_call.py): a CPU graph's inputs go to ONNX Runtime as one OrtValueVector and
its outputs come back in one call. Each test runs the same compiled graph through the one call and through
the IOBinding path it replaces and asks for the same bits, and, where it says so, eager's numbers; graphs the
one call cannot run keep the binding and say why. Speed is not tested here: the benchmark reports it."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import aot2onnx
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
