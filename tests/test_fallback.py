"""Per-node fallback, and users' own lowerings for their custom ops (forward and backward)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from onnxscript import opset18 as op

import aot2onnx
from aot2onnx.compile.fallback import fallback_graphs, reset_fallback_graphs
from aot2onnx.runtime.session import compiled_graphs, reset_compiled_graphs
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


# ---------------------------------------------------------------------------------------------------------
# What ONNX Runtime refuses runs in PyTorch: a partition (or a whole graph) whose lowering or session fails
# is split again without the nodes the error names, at compile time, with a warning that says why.


class _AffineSampler(torch.nn.Module):
    # theta comes from a Linear, so the backward reaches it through grid_sample and affine_grid. It stays near
    # a fixed transform whose sampling points are off the pixel grid: bilinear sampling's gradient jumps where
    # a point crosses a pixel, and float32 rounding (ONNX Runtime's or eager's) decides which side it is on.
    def __init__(self):
        super().__init__()
        self.loc = torch.nn.Linear(3 * 8 * 8, 6)
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.register_buffer("base", torch.tensor([[0.83, -0.11, 0.05], [0.13, 0.79, -0.04]]))

    def forward(self, x):
        theta = self.base + 0.05 * torch.tanh(self.loc(x.flatten(1))).view(-1, 2, 3)
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return self.conv(F.grid_sample(x, grid, align_corners=False))


def test_grid_sample_with_a_learned_affine_grid_trains_like_eager():
    # grid_sampler_2d_backward has no lowering and runs in PyTorch; everything else runs on ONNX Runtime,
    # affine_grid's backward included (its base grid copies a [W] linspace into [N, H, W] slices: torch_lib's
    # copy did not broadcast, and the partition's model did not load).
    with pytest.warns(UserWarning, match=r"aten\.grid_sampler_2d_backward\.default \(1 node\)"):
        report = assert_parity(_AffineSampler, (torch.randn(2, 3, 8, 8),), loss_fn=lambda y: y.square().mean(),
                               steps=5, allow_fallback=True)
    assert {t for g in fallback_graphs() for t in g.fallen_back} == {"aten.grid_sampler_2d_backward.default"}
    assert [r for g in fallback_graphs() for r in g.refusals] == []
    assert sorted(g.kind for g in report.graphs) == ["backward", "backward", "forward"], report.graphs
    assert all(g.runs >= 5 for g in report.graphs), report.graphs


class _WobblyGelu(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.ops.aot2onnx_fallback.wobble(F.gelu(self.a(x))))


def _refused_nodes() -> list[str]:
    return sorted(node.split(" ")[0] for g in fallback_graphs() for r in g.refusals for node in r.nodes)


@pytest.mark.parametrize("model", [_WobblyGelu, lambda: torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.GELU())],
                         ids=["in a partition", "in a whole graph"])
def test_a_node_without_an_onnx_runtime_kernel_for_its_dtype_runs_in_pytorch(model):
    # ONNX Runtime's CPU provider has no double Erf: the model holding the exact GELU (forward) or its erf
    # (backward) does not load. That node then runs in PyTorch; the rest of its graph on ONNX Runtime.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Without the fused kernels, whose gelu_backward (ATen's) takes double: the backward's erf is the
        # second node ONNX Runtime has no kernel for.
        report = assert_parity(lambda: model().double(), (torch.randn(6, 8, dtype=torch.float64),),
                               loss_fn=lambda y: y.square().mean(), rtol=1e-10, atol=1e-12, allow_fallback=True,
                               check_torch_ops=False, backend=aot2onnx.backend(fused_kernels=False))
    messages = [str(w.message) for w in caught if "failed on them" in str(w.message)]
    assert len(messages) == 2, messages
    assert all("Could not find an implementation for Erf" in m for m in messages), messages
    assert _refused_nodes() == ["erf", "gelu"]
    assert all(g.runs >= 10 for g in report.graphs), report.graphs


# A custom op whose user lowering forgets to broadcast: the model it is in fails ONNX Runtime's shape
# inference only where a later node reads the value (select_scatter's Unsqueeze), not at the faulty node.
@torch.library.custom_op("aot2onnx_fallback::spread", mutates_args=())
def spread(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return x.expand_as(like).clone()


spread.register_fake(lambda x, like: torch.empty_like(like))


@aot2onnx.register_lowering(torch.ops.aot2onnx_fallback.spread.default)
def wrong_spread(x, like):
    """spread(Tensor x, Tensor like) -> Tensor"""
    return op.Identity(x)  # wrong on purpose: x keeps its shape


class _Spreader(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, base, v):
        column = torch.ops.aot2onnx_fallback.spread(v, base[..., 0])
        return self.lin(torch.select_scatter(base, column, -1, 0))


def test_a_shape_error_sends_the_node_and_what_it_reads_to_pytorch():
    reset_compiled_graphs()
    reset_fallback_graphs()
    model, base, v = _Spreader(), torch.randn(2, 4, 3), torch.randn(4)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"Unexpected axis value"):
        out = torch.compile(model, backend="aot2onnx")(base, v)
        expected = model(base, v)
    torch.testing.assert_close(out, expected)
    refused = _refused_nodes()
    assert "select_scatter" in refused and any(name.startswith("spread") for name in refused), refused
    # The Linear after them still runs on ONNX Runtime.
    assert [g.runs for g in compiled_graphs()] == [1]
