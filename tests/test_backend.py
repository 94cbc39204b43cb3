"""The backend's surface: registration, options, errors, dumps, logging."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn

import aot2onnx
from aot2onnx.errors import RuntimeSessionError, UnsupportedOpError
from aot2onnx.options import Options
from aot2onnx.runtime import fused
from aot2onnx.runtime.session import providers_for


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _train_step(model, compiled):
    x = torch.randn(5, 8)
    ref = model(x).pow(2).mean()
    ref.backward()
    return ref


def test_entry_point_works_without_import():
    # A fresh interpreter that never imports aot2onnx: torch finds the backend through the entry point.
    code = textwrap.dedent(
        """
        import torch
        assert "aot2onnx" in torch._dynamo.list_backends(), torch._dynamo.list_backends()
        m = torch.nn.Linear(3, 2)
        out = torch.compile(m, backend="aot2onnx")(torch.randn(4, 3))
        out.sum().backward()
        import aot2onnx  # only now, to read what ran
        assert [g.runs for g in aot2onnx.compiled_graphs()] == [1, 1], aot2onnx.compiled_graphs()
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


@pytest.mark.parametrize("how", ["backend()", "torch.compile(options=)"])
def test_options_reach_the_sessions(how):
    options = {"graph_optimization_level": "basic", "intra_op_num_threads": 1, "partitioner": "default"}
    model = _mlp()
    if how == "backend()":
        compiled = torch.compile(model, backend=aot2onnx.backend(**options))
    else:
        compiled = torch.compile(model, backend="aot2onnx", options=options)
    aot2onnx.reset_compiled_graphs()
    compiled(torch.randn(5, 8)).sum().backward()
    graphs = aot2onnx.compiled_graphs()
    assert len(graphs) == 2
    for graph in graphs:
        assert graph.options == Options(**options)
        so = graph.session.get_session_options()
        assert so.intra_op_num_threads == 1
        assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC


def test_unknown_option_is_rejected():
    with pytest.raises(TypeError, match="unknown aot2onnx option"):
        aot2onnx.backend(optimisation="max")
    with pytest.raises(ValueError, match="partitioner"):
        aot2onnx.backend(partitioner="greedy")


@pytest.mark.parametrize("opset", [18, 20, 21])
def test_target_opset(opset):
    model = _mlp()
    ref = _mlp()
    aot2onnx.reset_compiled_graphs()
    x = torch.randn(5, 8)
    out = torch.compile(model, backend=aot2onnx.backend(opset=opset))(x)
    out.pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    torch.testing.assert_close(out, ref(x), rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    for graph in aot2onnx.compiled_graphs():
        assert graph.opset == opset


# Two custom ops that have no lowering, to check that one error names both.
@torch.library.custom_op("aot2onnx_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


mystery.register_fake(lambda x: torch.empty_like(x))


@torch.library.custom_op("aot2onnx_test::enigma", mutates_args=())
def enigma(x: torch.Tensor) -> torch.Tensor:
    return x.cos()


enigma.register_fake(lambda x: torch.empty_like(x))


class Mysterious(nn.Module):
    def forward(self, x):
        y = torch.ops.aot2onnx_test.mystery(x) * 2
        z = torch.ops.aot2onnx_test.mystery(y)
        return torch.ops.aot2onnx_test.enigma(z) + 1


def test_unsupported_ops_fail_compilation_with_every_op_listed():
    compiled = torch.compile(Mysterious(), backend=aot2onnx.backend(fallback=False))
    with pytest.raises(Exception) as info:
        compiled(torch.randn(3))
    error = info.value
    while error is not None and not isinstance(error, UnsupportedOpError):
        error = getattr(error, "inner_exception", None) or error.__cause__
    assert isinstance(error, UnsupportedOpError), info.value
    message = str(error)
    assert "2 op(s)" in message
    assert "aot2onnx_test.mystery.default  (2 node(s)" in message
    assert "aot2onnx_test.enigma.default  (1 node(s)" in message
    # Each op comes with an example node and the user's source line.
    assert "e.g. %mystery" in message
    assert "test_backend.py" in message and "torch.ops.aot2onnx_test.enigma(z) + 1" in message


def test_dump_dir_and_logging(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("AOT2ONNX_DUMP_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, logger="aot2onnx")
    compiled = torch.compile(_mlp(), backend="aot2onnx")
    compiled(torch.randn(5, 8)).sum().backward()
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 2 and files[0].endswith("_Sequential_backward.onnx") and files[1].endswith("_Sequential_forward.onnx")
    for name in files:
        model = onnx.load(tmp_path / name)
        onnx.checker.check_model(model, full_check=True)
        # A dumped CPU graph may hold nodes of aot2onnx's fused kernels: a session outside aot2onnx loads them
        # from the library (README, "Fused training kernels").
        so = ort.SessionOptions()
        if fused.library() is not None and any(o.domain == "aot2onnx.fused" for o in model.opset_import):
            so.register_custom_ops_library(fused.library())
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        # Provenance: each ONNX node names the FX node it came from.
        assert all(any(p.key == "pkg.torch.onnx.fx_node" for p in node.metadata_props) for node in model.graph.node)
    records = [r.getMessage() for r in caplog.records if r.name == "aot2onnx" and "FX nodes" in r.getMessage()]
    assert len(records) == 2
    for message in records:
        assert "capture" in message and "lowering" in message and "session" in message


def test_cuda_inputs_without_cuda_provider_fail_clearly():
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider")
    with pytest.raises(RuntimeSessionError, match="onnxruntime-gpu"):
        providers_for(torch.device("cuda", 0), Options())


@pytest.mark.skipif(not torch.cuda.is_available() or "CUDAExecutionProvider" not in ort.get_available_providers(),
                    reason="needs a CUDA device and onnxruntime-gpu")
def test_cuda_training_step():
    from aot2onnx.testing import assert_parity

    report = assert_parity(lambda: _mlp().cuda(), (torch.randn(5, 8, device="cuda"),),
                           loss_fn=lambda o: o.pow(2).mean(), steps=3)
    assert all(g.device.type == "cuda" for g in report.graphs)


def test_outputs_of_earlier_calls_are_not_overwritten():
    # ONNX Runtime reuses bound output buffers unless they are bound afresh; earlier results must survive.
    compiled = torch.compile(lambda x: x * 2 + 1, backend="aot2onnx")
    a = compiled(torch.ones(4))
    b = compiled(torch.full((4,), 5.0))
    torch.testing.assert_close(a, torch.full((4,), 3.0))
    torch.testing.assert_close(b, torch.full((4,), 11.0))


def test_inputs_bound_at_the_same_address_read_their_current_contents():
    # An input whose address and shape did not change is not bound again: its new contents must count,
    # and another tensor of the same shape must be read from its own memory.
    compiled = torch.compile(lambda x, y: x * 2 + y, backend="aot2onnx")
    x, y = torch.ones(4), torch.zeros(4)
    torch.testing.assert_close(compiled(x, y), torch.full((4,), 2.0))
    x.fill_(3.0)
    torch.testing.assert_close(compiled(x, y), torch.full((4,), 6.0))
    torch.testing.assert_close(compiled(torch.full((4,), 5.0), y), torch.full((4,), 10.0))
    torch.testing.assert_close(compiled(x, torch.ones(4)), torch.full((4,), 7.0))


def test_sessions_share_one_cpu_arena():
    model = _mlp()
    aot2onnx.reset_compiled_graphs()
    torch.compile(model, backend="aot2onnx")(torch.randn(5, 8)).sum().backward()
    graphs = aot2onnx.compiled_graphs()
    assert len(graphs) == 2
    for graph in graphs:
        so = graph.session.get_session_options()
        assert so.get_session_config_entry("session.use_env_allocators") == "1"


@torch.library.custom_op("aot2onnx_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale


scaled_tanh.register_fake(lambda x, scale: torch.empty_like(x))


def test_user_lowering_for_a_custom_op():
    from onnxscript import opset18 as op

    @aot2onnx.register_lowering(torch.ops.aot2onnx_test.scaled_tanh.default)
    def lower_scaled_tanh(x, scale: float):
        return op.Mul(op.Tanh(x), op.CastLike(scale, x))

    with pytest.raises(TypeError, match=r"\.default"):
        aot2onnx.register_lowering(torch.ops.aot2onnx_test.scaled_tanh)
    x = torch.randn(4, 3)
    aot2onnx.reset_compiled_graphs()
    fn = lambda x: torch.ops.aot2onnx_test.scaled_tanh(x + 1, 2.5) * 3
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(fn, backend="aot2onnx")(x), fn(x), rtol=1e-5, atol=1e-6)
    assert [g.runs for g in aot2onnx.compiled_graphs()] == [1]


@torch.library.custom_op("aot2onnx_test::row_sums", mutates_args=())
def row_sums(x: torch.Tensor) -> torch.Tensor:
    return x.sum(-1, keepdim=True)


row_sums.register_fake(lambda x: x.new_empty((*x.shape[:-1], 1)))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_an_output_of_another_shape_than_the_aten_graph_s_is_an_error(dynamic):
    """A rule whose output has another shape than the op's (here keepdim dropped: (n,) for (n, 1)) must not
    reach the caller: ONNX Runtime only logs it, and eager code after the graph would broadcast it,
    x - (n,) giving an (n, n) matrix of wrong numbers."""
    from onnxscript import opset18 as op

    from aot2onnx.errors import RuntimeSessionError

    @aot2onnx.register_lowering(torch.ops.aot2onnx_test.row_sums.default)
    def lower_row_sums(x):
        return op.ReduceSum(x, op.Constant(value_ints=[-1]), keepdims=0)

    fn = lambda x: torch.ops.aot2onnx_test.row_sums(x * 2)
    compiled = torch.compile(fn, backend="aot2onnx", dynamic=dynamic)
    with torch.no_grad(), pytest.raises(RuntimeSessionError, match=r"of shape \[4\], where the graph declares \[4, 1\]|"
                                                                   r"of shape \[4\], where the graph declares \['s\w+', 1\]"):
        compiled(torch.randn(4, 3))

    # The right rule runs, on the same sizes and (dynamic) on new ones.
    aot2onnx.unregister_lowering(torch.ops.aot2onnx_test.row_sums.default)

    @aot2onnx.register_lowering(torch.ops.aot2onnx_test.row_sums.default)
    def lower_row_sums_keepdim(x):
        return op.ReduceSum(x, op.Constant(value_ints=[-1]), keepdims=1)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot2onnx", dynamic=dynamic)
    with torch.no_grad():
        for rows in (4, 6):
            x = torch.randn(rows, 3)
            torch.testing.assert_close(compiled(x), fn(x), rtol=1e-5, atol=1e-6)


def test_lowering_logs_no_warnings_for_normal_cases(caplog):
    """index_put indexing every axis (torch_lib makes an empty ints attribute for its list of unindexed axes,
    which onnx_ir logged as ambiguous on every lowering) lowers without a warning reaching the user's log."""
    def f(x, rows, cols, v):
        y = x.clone()
        y[rows, cols] = v
        return y

    x, rows, cols, v = torch.randn(5, 3), torch.tensor([0, 3]), torch.tensor([2, 1]), torch.randn(2)
    with caplog.at_level(logging.WARNING):
        torch.testing.assert_close(torch.compile(f, backend="aot2onnx")(x, rows, cols, v), f(x, rows, cols, v))
    assert not [r for r in caplog.records if r.name.startswith(("onnx_ir", "onnxscript", "torch.onnx"))], \
        [r.getMessage() for r in caplog.records]
