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

NAN, INF = float("nan"), float("inf")
DTYPES = [torch.float32, torch.float64]

# Every op here has a lowering that ONNX Runtime runs: a node falling back to PyTorch fails the test.
pytestmark = pytest.mark.filterwarnings("error:aot2onnx(?!.*_assert_scalar)")


def _ulps(x: torch.Tensor) -> torch.Tensor:
    """The spacing of floats at |x|: the smallest denormal at 0."""
    a = x.detach().abs()
    return torch.nextafter(a, torch.full_like(a, INF)) - a


def _assert_matches(name: str, actual: torch.Tensor, expected: torch.Tensor, ulps: float, shared: float = 0) -> None:
    """NaN and infinities where eager has them, finite values within ``ulps`` of eager's spacing, plus
    ``shared`` epsilons of the tensor's largest finite value (for sums across elements: gradients)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (name, actual, expected)
    a, e = actual.detach(), expected.detach()
    bad = torch.isnan(a) != torch.isnan(e)
    finite = torch.isfinite(e) & torch.isfinite(a)
    bad |= ~torch.isnan(e) & ~finite & (a != e)  # an infinity of the wrong sign, or a finite value for one
    largest = float(e[finite].abs().max()) if finite.any() else 0.0
    tolerance = ulps * _ulps(e).double() + shared * torch.finfo(e.dtype).eps * largest
    bad |= finite & ((a.double() - e.double()).abs() > tolerance)
    if bad.any():
        rows = [f"  at {i}: eager {float(e[tuple(i)])!r}, compiled {float(a[tuple(i)])!r}"
                for i in bad.nonzero().tolist()[:8]]
        raise AssertionError(f"{name}: {int(bad.sum())} of {e.numel()} elements differ\n" + "\n".join(rows))


def _check(fn, *inputs: torch.Tensor, dtype: torch.dtype, ulps: float = 4, grad: bool = True,
           grad_shared: float = 16) -> None:
    """``fn`` eagerly and through ``torch.compile(backend="aot2onnx")`` on equal copies of ``inputs`` (cast to
    ``dtype``): every output and, with ``grad``, the gradient of every input under the same cotangents (within
    ``ulps`` and ``grad_shared`` epsilons of the gradient's largest element: backward passes sum across
    elements, in an order of their own)."""
    eager_in = [x.detach().to(dtype, copy=True).requires_grad_(grad) for x in inputs]
    comp_in = [x.detach().to(dtype, copy=True).requires_grad_(grad) for x in inputs]
    out_e, out_c = fn(*eager_in), torch.compile(fn, backend="aot2onnx")(*comp_in)
    outs_e, outs_c = torch.utils._pytree.tree_leaves(out_e), torch.utils._pytree.tree_leaves(out_c)
    assert len(outs_e) == len(outs_c)
    for i, (c, e) in enumerate(zip(outs_c, outs_e)):
        _assert_matches(f"output {i}", c, e, ulps)
    if not grad:
        return
    pairs = [(c, e) for c, e in zip(outs_c, outs_e) if e.requires_grad]
    cotangents = [torch.linspace(-2.0, 3.0, e.numel(), dtype=dtype).reshape(e.shape) for _, e in pairs]
    grads_e = torch.autograd.grad([e for _, e in pairs], eager_in, cotangents, allow_unused=True)
    grads_c = torch.autograd.grad([c for c, _ in pairs], comp_in, cotangents, allow_unused=True)
    for i, (c, e) in enumerate(zip(grads_c, grads_e)):
        if e is None:
            assert c is None or not c.any(), f"gradient {i}"
            continue
        _assert_matches(f"gradient {i}", c, e, ulps, grad_shared)


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
            _assert_matches(f"{columns} columns, output {i}", c, e, ulps=2)


# ---------------------------------------------------------------------------------------------------------
# float64: eps and momentum as float64 constants, batch norm on ONNX Runtime


@pytest.mark.parametrize("eps", [0.1, 1e-5])
def test_float64_norms_add_eps_in_float64(eps):
    """eps = 0.1 rounded to float32 is 1.5e-9 relative off: 1e7 ULPs of a float64 result."""
    x = torch.tensor([[1.0, 2.0, 4.0, 7.0], [0.5, 0.25, -1.0, 3.0]])

    def fn(x):
        return F.layer_norm(x, (4,), eps=eps), F.batch_norm(x, None, None, training=True, eps=eps)

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
        _assert_matches(f"step {step} output", yc, ye, ulps, shared=4)
        _assert_matches(f"step {step} input gradient", xc.grad, xe.grad, ulps, shared=16)
        for name in ("weight", "bias"):
            _assert_matches(f"step {step} {name} gradient", getattr(ours, name).grad, getattr(eager, name).grad, ulps,
                            shared=16)
        for name in ("running_mean", "running_var"):
            _assert_matches(f"step {step} {name}", getattr(ours, name), getattr(eager, name), ulps)
        assert int(ours.num_batches_tracked) == int(eager.num_batches_tracked) == step + 1
    eager.eval()
    ours.eval()
    x = torch.randn(5, 3, 4, dtype=dtype)
    with torch.no_grad():
        _assert_matches("evaluation output", compiled(x), eager(x), ulps, shared=4)
