"""Per-node fallback, and users' own lowerings for their custom ops (forward and backward)."""

from __future__ import annotations

import warnings

import pytest
import torch
from onnxscript import opset18 as op

import aot2onnx
from aot2onnx.fallback import fallback_graphs
from aot2onnx.testing import assert_parity


# A custom op with a backward formula and no lowering: the fallback runs it (and its backward) in torch.
@torch.library.custom_op("aot2onnx_fallback::wobble", mutates_args=())
def wobble(x: torch.Tensor) -> torch.Tensor:
    return x + 0.1 * torch.sin(3 * x)


wobble.register_fake(lambda x: torch.empty_like(x))


@torch.library.custom_op("aot2onnx_fallback::wobble_backward", mutates_args=())
def wobble_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return grad * (1 + 0.3 * torch.cos(3 * x))


wobble_backward.register_fake(lambda grad, x: torch.empty_like(x))
wobble.register_autograd(
    lambda ctx, grad: torch.ops.aot2onnx_fallback.wobble_backward(grad, ctx.saved_tensors[0]),
    setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]),
)


class _Wobbly(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = torch.ops.aot2onnx_fallback.wobble(self.b(h))
        return self.c(torch.tanh(h))


def test_fallback_trains_like_eager_and_the_rest_runs_on_ort():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = assert_parity(_Wobbly, (torch.randn(6, 8),), loss_fn=lambda y: y.square().mean(),
                               backend=aot2onnx.backend(fallback=True), allow_fallback=True)
    messages = [str(w.message) for w in caught if "run in PyTorch" in str(w.message)]
    # Once per graph: the forward falls back for wobble, the backward for wobble_backward.
    assert len(messages) == 2, messages
    assert any("aot2onnx_fallback.wobble.default (1 node)" in m for m in messages)
    assert any("aot2onnx_fallback.wobble_backward.default (1 node)" in m for m in messages)
    # Around the op, everything ran on ONNX Runtime: two partitions per graph, each run at every step.
    assert len(report.graphs) == 4 and all(g.runs >= 10 for g in report.graphs), report.graphs
    split_graphs = fallback_graphs()
    assert len(split_graphs) == 2
    for graph in split_graphs:
        in_torch = [n.target for n in graph.split.graph.nodes if n.op == "call_function"]
        assert [str(t) for t in in_torch if "getitem" not in str(t)] in (
            ["aot2onnx_fallback.wobble.default"], ["aot2onnx_fallback.wobble_backward.default"]
        ), in_torch


def test_without_fallback_compilation_fails_listing_the_ops():
    compiled = torch.compile(_Wobbly(), backend=aot2onnx.backend(fallback=False))
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=r"aot2onnx_fallback\.wobble\.default"):
        compiled(torch.randn(2, 8))


@pytest.mark.filterwarnings("ignore:aot2onnx")
def test_assert_parity_refuses_a_silent_fallback():
    with pytest.raises(AssertionError, match="ran in PyTorch"):
        assert_parity(_Wobbly, (torch.randn(6, 8),), loss_fn=lambda y: y.square().mean(), steps=2)


# A custom op whose forward and backward both get user lowerings: trains with every node on ONNX Runtime.
@torch.library.custom_op("aot2onnx_user::softclip", mutates_args=())
def softclip(x: torch.Tensor, limit: float) -> torch.Tensor:
    return limit * torch.tanh(x / limit)


softclip.register_fake(lambda x, limit: torch.empty_like(x))


@torch.library.custom_op("aot2onnx_user::softclip_backward", mutates_args=())
def softclip_backward(grad: torch.Tensor, x: torch.Tensor, limit: float) -> torch.Tensor:
    return grad * (1 - torch.tanh(x / limit) ** 2)


softclip_backward.register_fake(lambda grad, x, limit: torch.empty_like(x))


def _softclip_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.limit = inputs[1]


softclip.register_autograd(
    lambda ctx, grad: (torch.ops.aot2onnx_user.softclip_backward(grad, ctx.saved_tensors[0], ctx.limit), None),
    setup_context=_softclip_setup,
)


@aot2onnx.register_lowering(torch.ops.aot2onnx_user.softclip.default)
def aten_softclip(x, limit: float):
    """softclip(Tensor x, float limit) -> Tensor"""
    scale = op.CastLike(limit, x)
    return op.Mul(scale, op.Tanh(op.Div(x, scale)))


@aot2onnx.register_lowering(torch.ops.aot2onnx_user.softclip_backward.default)
def aten_softclip_backward(grad, x, limit: float):
    """softclip_backward(Tensor grad, Tensor x, float limit) -> Tensor"""
    t = op.Tanh(op.Div(x, op.CastLike(limit, x)))
    return op.Mul(grad, op.Sub(op.CastLike(1.0, x), op.Mul(t, t)))


class _SoftClipped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.ops.aot2onnx_user.softclip(self.a(x) * 3, 1.5))


def test_user_lowerings_for_a_custom_op_and_its_backward_train():
    report = assert_parity(_SoftClipped, (torch.randn(6, 8),), loss_fn=lambda y: y.square().mean(),
                           backend=aot2onnx.backend(fallback=False))
    assert sorted(g.kind for g in report.graphs) == ["backward", "forward"]
    assert all(g.runs >= 10 for g in report.graphs)


def test_complex_tensors_fall_back_and_match_eager():
    # The fallback's answer to "can this node be lowered" is lowering's (dispatch): complex sin has no rule,
    # and complex values never cross a partition boundary (ONNX has no complex type).
    def f(x, y):
        return (torch.sin(x) * 2).abs() + y.exp()

    x, y = torch.randn(4, dtype=torch.complex64), torch.randn(4)
    with pytest.warns(UserWarning, match="aten.sin.default"):
        out = torch.compile(f, backend="aot2onnx")(x, y)
    torch.testing.assert_close(out, f(x, y))
