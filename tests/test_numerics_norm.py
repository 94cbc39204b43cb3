"""Reductions and normalizations at the values where implementations part ways, against eager PyTorch:
variances past float32's range, means over axes that are empty at run time, rows whose variance overflows,
float64 constants (eps, momentum), softmax results below float32's normal range, infinities in softmax rows
and products whose partial results overflow. Outputs, gradients and running statistics, float32 and float64.

NaN and infinities must be where eager has them; finite values within a few units in the last place (ULPs) of
eager's, or, where eager itself rounds differently from run to run of the same math (sums in another order),
within an explicit relative tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import Ulps, check

NAN, INF = float("nan"), float("inf")
DTYPES = [torch.float32, torch.float64]

# Every op here has a lowering that ONNX Runtime runs: a node falling back to PyTorch fails the test.
pytestmark = pytest.mark.filterwarnings("error:aot2onnx(?!.*_assert_scalar)")


def _check(fn, *inputs: torch.Tensor, dtype: torch.dtype, ulps: float = 4, grad: bool = True,
           grad_shared: float = 16, dynamic: bool | None = None) -> None:
    """``fn`` eagerly and compiled (tests/harness.py): every output within ``ulps`` and, with ``grad``, every
    input's gradient within ``ulps`` and ``grad_shared`` epsilons of the gradient's largest element (backward
    passes sum across elements, in an order of their own)."""
    check(fn, *inputs, dtype=dtype, grad=grad, dynamic=dynamic, tol=Ulps(ulps),
          grad_tol=Ulps(ulps, shared=grad_shared))


# ---------------------------------------------------------------------------------------------------------
# std and var: ATen accumulates in double, whatever the float dtype


# Rows whose means do not cancel (a mean of 1e30 - 1e30 + 5 depends on the order of the sum, in eager too)
HUGE_ROWS = torch.tensor([[1e30, -1e30, 0.0, 0.0], [3e19, -3e19, 3e19, -2e19], [1e20, 2e20, 3e20, 4e20],
                          [1.0, 2.0, 3.0, 4.0]])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("correction", [0, 1])
def test_std_and_var_of_deviations_whose_squares_overflow_float32(dtype, correction):
    """std([1e30, -1e30, 0, 0]) is 8e29 in eager, whose double accumulators hold the squares (1e60); a
    float32 sum of squares overflowed to inf."""

    def fn(x):
        return (torch.std(x, dim=1, correction=correction), torch.var(x, dim=1, correction=correction),
                torch.std(x, correction=correction), *torch.std_mean(x, dim=1, correction=correction, keepdim=True),
                *torch.var_mean(x, dim=0, correction=correction))

    _check(fn, HUGE_ROWS, dtype=dtype)


def test_std_and_var_past_float32_range_are_inf_as_in_eager():
    """A variance of 1e60 is inf in float32 (eager too); its square root 1e30 is not."""
    x = torch.tensor([[1e30, -1e30, 0.0], [3e38, 3e38, -3e38]])
    _check(lambda x: (torch.var(x, dim=1), torch.std(x, dim=1)), x, dtype=torch.float32, grad=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_var_of_no_more_elements_than_the_correction(dtype):
    """ATen divides by max(n - correction, 0): NaN (0 / 0) for one element with correction 1, inf beyond."""
    x = torch.tensor([[1.0, 3.0], [2.0, 2.0]])
    _check(lambda x: (torch.var(x[:, :1], dim=1), torch.var(x, dim=1, correction=2), torch.std(x[0, 0])),
           x, dtype=dtype, grad=False)


# ---------------------------------------------------------------------------------------------------------
# mean over an axis that is empty at run time


@pytest.mark.filterwarnings("ignore:aot2onnx.*_assert_scalar")  # the unbacked size's range check runs in PyTorch
@pytest.mark.parametrize("dtype", DTYPES)
def test_mean_over_an_axis_that_is_empty_at_run_time_is_nan(dtype):
    """ONNX Runtime's ReduceMean over no elements gives 0; ATen's mean is 0 / 0 = NaN. With an unbacked size
    the graph cannot know the axis is empty."""

    def fn(x):
        return x.mean(dim=1), x.mean(), x.mean(dim=1, keepdim=True), torch.var(x, dim=1)

    compiled = torch.compile(fn, backend="aot2onnx")
    for columns in (3, 0):
        x = torch.arange(2.0 * columns, dtype=dtype).reshape(2, columns)
        torch._dynamo.decorators.mark_unbacked(x, 1)
        for i, (c, e) in enumerate(zip(compiled(x), fn(x))):
            Ulps(2).check(f"{columns} columns, output {i}", c, e)


# ---------------------------------------------------------------------------------------------------------
# layer and group norm of rows whose mean squared overflows: NaN, as ATen's Welford moments give


def _layer_norm(x, w, b):
    return torch.ops.aten.native_layer_norm(x, [x.shape[-1]], w, b, 1e-5)  # output, mean, rstd


def _group_norm(x, w, b):
    # Output and rstd: the mean of a group of -3e38 is -3e38 in eager's running mean, -inf in a float32 sum.
    n, c = x.shape[0], x.shape[1]
    out, _, rstd = torch.ops.aten.native_group_norm(x, w, b, n, c, x[0, 0].numel(), 2, 1e-5)
    return out, rstd


# Rows shorter than a vector (8 floats with AVX2): a mean past 2**64 is NaN in eager (the first three), a
# variance past float32's range alone is not (the bias: the next two), an ordinary row is a number.
OVERFLOW_ROWS = torch.tensor([[1e30, 1.0, 2.0, 3.0], [-3e38, -3e38, -3e38, -3e38], [1e25, -1e20, 0.0, 7.0],
                              [2e19, -2e19, 0.0, 0.0], [1e30, 0.0, 0.0, -1e30], [1e19, 1.0, 2.0, 3.0],
                              [0.5, -1.0, 2.0, 0.25]])


@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
@pytest.mark.parametrize("norm", [_layer_norm, _group_norm], ids=["layer_norm", "group_norm"])
def test_rows_whose_mean_squared_overflows_are_nan_as_in_eager(norm, affine):
    x = OVERFLOW_ROWS if norm is _layer_norm else OVERFLOW_ROWS.reshape(7, 2, 2, 1)
    w = torch.tensor([1.5, -2.0, 0.5, 3.0][: x.shape[1]]) if affine else None
    b = torch.tensor([0.25, 1.0, -0.5, 2.0][: x.shape[1]]) if affine else None
    _check(norm, x, *([w, b] if affine else []), dtype=torch.float32, ulps=16, grad=False) if affine else _check(
        lambda x: norm(x, None, None), x, dtype=torch.float32, ulps=16, grad=False)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("norm", ["layer_norm", "group_norm"])
def test_rows_longer_than_a_vector_are_nan_where_eager_s_are(norm, dynamic):
    """A row a whole number of vectors long is NaN where its first lane's mean squared overflows, one with a
    scalar tail never (the bias): in eager [1e30, 1, ...] of 16 floats is NaN and [1, 1e30, 1, ...] the bias;
    of 9 or 17 floats both are the bias (AVX2's 8-float vectors, which these kernels use on AVX-512 CPUs too).
    With symbolic sizes the rule is chosen at run time."""
    rows = []
    for n in (9, 16, 17, 32):
        for position in (0, 1, 8):
            row = [0.5] * 64
            row[position] = 1e30
            rows.append(row[:n])
    for row in rows:
        x = torch.tensor([row, [0.25] * len(row)])
        if norm == "layer_norm":
            _check(lambda x: _layer_norm(x, None, None), x, dtype=torch.float32, ulps=16, grad=False, dynamic=dynamic)
        else:
            _check(lambda x: _group_norm(x.reshape(1, 2, -1), None, None), x, dtype=torch.float32, ulps=16,
                   grad=False, dynamic=dynamic)


def test_float64_rows_whose_mean_squared_overflows_are_nan_as_in_eager():
    """The same in double, past 1.3e154 (rows shorter than 4 doubles)."""
    x = torch.tensor([[1e160, 1.0, 2.0], [1e100, -1e100, 0.0], [1.0, 2.0, 4.0]], dtype=torch.float64)
    _check(lambda x: _layer_norm(x, None, None), x, dtype=torch.float64, ulps=16, grad=False)
    _check(lambda x: torch.ops.aten.native_group_norm(x, None, None, 3, 3, 1, 1, 1e-5)[::2], x,
           dtype=torch.float64, ulps=16, grad=False)


def test_layer_norm_gradients_of_ordinary_rows_beside_an_overflowing_one():
    """The overflowing row's gradients are NaN (its saved rstd is); the other rows' are eager's."""
    x = torch.tensor([[1e30, 1.0, 2.0, 3.0], [0.5, -1.0, 2.0, 0.25], [1.0, 2.0, 3.0, 5.0]])
    _check(lambda x, w, b: F.layer_norm(x, (4,), w, b), x, torch.tensor([1.5, -2.0, 0.5, 3.0]),
           torch.tensor([0.25, 1.0, -0.5, 2.0]), dtype=torch.float32, ulps=16)


@pytest.mark.parametrize("weight", [[INF, 1.0], [3e38, 1.0], [1.0, -INF]], ids=["inf", "huge", "-inf"])
def test_group_norm_with_weights_whose_scale_overflows_follows_eager(weight):
    """ATen folds the affine map into scale = rstd * w and shift = b - scale * mean: where those are not finite
    (an infinite weight, rstd * 3e38), the infinities and NaN are those of its order of operations."""
    x = torch.tensor([[[1.0, -0.5, 0.25]], [[0.0, -1.0, -1.0]]]).expand(2, 2, 3).contiguous()
    w = torch.tensor(weight)
    b = torch.tensor([3e38, -2.0])
    _check(lambda x, w, b: F.group_norm(x, 1, w, b), x, w, b, dtype=torch.float32, ulps=16, grad=False)


# ---------------------------------------------------------------------------------------------------------
# float64: eps and momentum as float64 constants, batch norm on ONNX Runtime


@pytest.mark.parametrize("eps", [0.1, 1e-5])
def test_float64_norms_add_eps_in_float64(eps):
    """eps = 0.1 rounded to float32 is 1.5e-9 relative off: 1e7 ULPs of a float64 result."""
    x = torch.tensor([[1.0, 2.0, 4.0, 7.0], [0.5, 0.25, -1.0, 3.0]])

    def fn(x):
        return (F.layer_norm(x, (4,), eps=eps), F.group_norm(x.reshape(2, 4, 1), 2, eps=eps),
                F.batch_norm(x, None, None, training=True, eps=eps))

    _check(fn, x, dtype=torch.float64, ulps=8)
    running = torch.tensor([0.5, -1.0, 0.0, 2.0]), torch.tensor([0.3, 1.0, 0.1, 2.5])
    _check(lambda x, mean, var: F.batch_norm(x, mean, var, eps=eps), x, *running, dtype=torch.float64, ulps=8,
           grad=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_norm_without_running_statistics_trains_on_onnx_runtime(dtype):
    """ONNX Runtime refused the float64 model (an Add of double and float); it ran in PyTorch."""
    x = torch.tensor([[1.0, 2.0, -1.0], [3.0, 5.0, 0.5], [-2.0, 0.25, 4.0], [0.5, 1.5, 2.5]])
    _check(lambda x: F.batch_norm(x, None, None, training=True), x, dtype=dtype, ulps=8)
    _check(lambda x, w, b: F.batch_norm(x.reshape(2, 3, 2), None, None, w, b, training=True), x,
           torch.tensor([1.5, -2.0, 0.5]), torch.tensor([0.25, 1.0, -0.5]), dtype=dtype, ulps=8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_norm_module_trains_and_evaluates_like_eager(dtype):
    """nn.BatchNorm1d for three steps: outputs, input and parameter gradients, running statistics (updated
    with momentum 0.1, which float32 does not hold), then the evaluation-mode output."""
    torch.manual_seed(0)
    eager = torch.nn.BatchNorm1d(3, momentum=0.1).to(dtype)
    ours = torch.nn.BatchNorm1d(3, momentum=0.1).to(dtype)
    compiled = torch.compile(ours, backend="aot2onnx")
    ulps = 16
    for step in range(3):
        x = torch.randn(5, 3, 4, dtype=dtype) * 3 + step
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye, yc = eager(xe), compiled(xc)
        cotangent = torch.linspace(-2.0, 3.0, ye.numel(), dtype=dtype).reshape(ye.shape)
        (ye * cotangent).sum().backward()
        (yc * cotangent).sum().backward()
        # eager's output is x * alpha + beta, which cancels near the mean: a few epsilons of the largest output
        Ulps(ulps, shared=4).check(f"step {step} output", yc, ye)
        Ulps(ulps, shared=16).check(f"step {step} input gradient", xc.grad, xe.grad)
        for name in ("weight", "bias"):
            Ulps(ulps, shared=16).check(f"step {step} {name} gradient", getattr(ours, name).grad,
                                        getattr(eager, name).grad)
        for name in ("running_mean", "running_var"):
            Ulps(ulps).check(f"step {step} {name}", getattr(ours, name), getattr(eager, name))
        assert int(ours.num_batches_tracked) == int(eager.num_batches_tracked) == step + 1
    eager.eval()
    ours.eval()
    x = torch.randn(5, 3, 4, dtype=dtype)
    with torch.no_grad():
        Ulps(ulps, shared=4).check("evaluation output", compiled(x), eager(x))


# ---------------------------------------------------------------------------------------------------------
# softmax and log_softmax: denormal results, infinities


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_keeps_denormal_results(dtype):
    """ONNX Runtime's float32 Softmax flushed results below about 2**-127 to 0: softmax([0, -90, -100]) is
    [1, 8.2e-40, 3.8e-44] in eager. Gradients through them too (the backward reads the output)."""
    tail = [-90.0, -100.0, -103.0, -110.0] if dtype == torch.float32 else [-709.0, -720.0, -744.0, -750.0]
    x = torch.tensor([[0.0, *tail], [1.0, 2.0, 3.0, tail[0], 0.5]], dtype=dtype)
    _check(lambda x: (torch.softmax(x, dim=1), torch.softmax(x, dim=0)), x, dtype=dtype, ulps=8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_and_log_softmax_of_rows_holding_infinities_and_nan(dtype):
    """A row holding +inf is NaN (inf - inf), -inf entries are 0 (-inf for log_softmax), a row of only -inf is
    NaN. ONNX Runtime's float64 LogSoftmax gave -inf at the finite entries of a row holding +inf."""
    x = torch.tensor([[INF, 1.0, 1.0], [-INF, 1.0, 2.0], [-INF, -INF, -INF], [NAN, 1.0, 0.0], [1.0, 2.0, 3.0]],
                     dtype=dtype)
    _check(lambda x: (torch.softmax(x, dim=1), torch.log_softmax(x, dim=1)), x, dtype=dtype, ulps=8, grad=False)


# ---------------------------------------------------------------------------------------------------------
# prod: partial products that overflow, in eager's order


@pytest.mark.parametrize("dtype", DTYPES)
def test_prod_overflows_in_eager_order(dtype):
    """prod([3e38, 3e38, 1, 0]) is inf * 0 = NaN in eager, which multiplies one after the other (along an axis
    that is not innermost, and along an innermost one shorter than 32); [1e-38, 1e-38, 3e38, 3e38] is 0 and
    its reverse inf (float32), so no rule free of the order exists."""
    big, tiny = (3e38, 1e-38) if dtype == torch.float32 else (1e300, 1e-300)
    rows = [[big, big, 1.0, 0.0], [tiny, tiny, big, big], [big, big, tiny, tiny], [0.0, big, big, -1.0],
            [INF, 2.0, 0.0, 1.0], [-0.0, 2.0, -3.0, 0.5], [1.5, -2.0, 0.25, 3.0]]
    x = torch.tensor(rows, dtype=dtype)

    def fn(x):
        return (torch.prod(x, dim=1), torch.prod(x.t().contiguous(), dim=0, keepdim=True), torch.prod(x[0]),
                torch.prod(x[1]), torch.prod(x.reshape(7, 2, 2), dim=1))

    _check(fn, x, dtype=dtype, ulps=8, grad=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_logsumexp_of_rows_holding_nan_and_inf(dtype):
    # ONNX Runtime's ReduceLogSumExp gave inf for [inf, nan, 1] (its max passes over NaN); ATen's is NaN
    # (slow differential seed 10036).
    x = torch.tensor([[INF, NAN, 1.0], [NAN, 1.0, 2.0], [-INF, -INF, -INF], [INF, 1.0, -INF], [1.0, 2.0, 3.0]])
    _check(lambda x: (torch.logsumexp(x, dim=1), torch.logsumexp(x, dim=-1, keepdim=True),
                      torch.logsumexp(x, dim=(0, 1))), x, dtype=dtype, grad=False)
    _check(lambda x: torch.logsumexp(x, dim=0), torch.randn(4, 5) * 30, dtype=dtype)


# ---------------------------------------------------------------------------------------------------------
# weight norm: its backward op has no PyTorch decomposition (it ran in PyTorch before it had a rule)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, dim", [((6, 5), 0), ((6, 5), 1), ((4, 3, 3, 2), 0), ((4, 3, 3, 2), 3)],
                         ids=["linear-0", "linear-last", "conv-0", "conv-last"])
def test_weight_norm_gradients(dtype, shape, dim):
    """``torch._weight_norm`` (what ``nn.utils.parametrizations.weight_norm`` calls) over the first or last
    axis: the weight, and the gradients of v and g, against ATen's CPU kernel."""
    torch.manual_seed(0)
    v = torch.randn(shape) * 2
    keep = [s if i == dim else 1 for i, s in enumerate(shape)]
    g = torch.rand(keep) + 0.5
    _check(lambda v, g: torch._weight_norm(v, g, dim), v, g, dtype=dtype, ulps=8)


def test_weight_norm_parametrization_trains_like_eager():
    """A weight-normed Conv1d and Linear (WaveNet/HiFi-GAN style) for three SGD steps: losses, gradients and
    the parametrization's original0 (g) and original1 (v) after the steps. (float32: ONNX Runtime has no
    float64 Conv.)"""
    from aot2onnx.testing import assert_parity

    def make():
        wn = torch.nn.utils.parametrizations.weight_norm
        return torch.nn.Sequential(wn(torch.nn.Conv1d(3, 4, 3)), torch.nn.Tanh(), torch.nn.Flatten(),
                                   wn(torch.nn.Linear(24, 2), dim=1))

    assert_parity(make, (torch.randn(5, 3, 8),), loss_fn=lambda o: o.square().mean(), steps=3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_norm_of_a_vector_has_one_norm_per_element(dtype):
    """A 1-D v has one norm per element in ATen's kernel: w = sign(v) * g, whose gradient in v is 0 up to the
    rounding of ``a * grad - b * v`` (eager's is rounding noise too). PyTorch's decomposition took the whole
    vector's norm."""
    torch.manual_seed(0)
    v, g = (torch.randn(7) * 2).to(dtype), (torch.rand(7) + 0.5).to(dtype)
    ve, vc = v.clone().requires_grad_(), v.clone().requires_grad_()
    ge, gc = g.clone().requires_grad_(), g.clone().requires_grad_()
    we = torch._weight_norm(ve, ge, 0)
    wc = torch.compile(lambda v, g: torch._weight_norm(v, g, 0), backend="aot2onnx")(vc, gc)
    Ulps(2).check("w", wc, we)
    cotangent = torch.linspace(-2.0, 3.0, 7, dtype=dtype)
    (we * cotangent).sum().backward()
    (wc * cotangent).sum().backward()
    Ulps(2).check("gradient of g", gc.grad, ge.grad)
    scale = float((g / v.abs() * cotangent).abs().max())  # the size of the terms that cancel
    assert float((vc.grad - ve.grad).abs().max()) <= 4 * torch.finfo(dtype).eps * scale


# ---------------------------------------------------------------------------------------------------------
# logcumsumexp: ATen's scan, not one max for the whole axis


@pytest.mark.parametrize("dtype", DTYPES)
def test_logcumsumexp_of_rows_far_below_their_max_and_infinities(dtype):
    """torch_lib's log(cumsum(exp(x - max))) + max: logcumsumexp([-200, 0]) began with -inf (eager -200),
    1.9e-22 became 0, and +inf or an all -inf row gave NaN, values and gradients."""
    rows = torch.tensor([[-200.0, 0.0, -50.0, 30.0], [1.0, 2.0, 3.0, 4.0], [INF, 1.0, -2.0, 0.5],
                         [-INF, -INF, 1.0, 2.0], [-INF, -INF, -INF, -INF], [NAN, 1.0, 2.0, 3.0],
                         [-88.0, -104.0, -1e30, 0.0], [3e38, 3e38, 1.0, 1.0]])
    _check(lambda x: torch.logcumsumexp(x, -1), rows, dtype=dtype, ulps=4, grad_shared=4)
    _check(lambda x: torch.logcumsumexp(x, 0), rows[:4].T.contiguous(), dtype=dtype, ulps=4, grad_shared=4)
    generator = torch.Generator().manual_seed(0)
    batch = torch.randn(3, 5, 7, generator=generator) * 30
    _check(lambda x: torch.logcumsumexp(x, 1), batch, dtype=dtype, ulps=4, grad_shared=16)
