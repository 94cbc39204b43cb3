"""Pooling at the values where runtimes differ: -inf, NaN, +inf and -0.0, padding that covers a whole window,
ceil-mode overhangs and dilations, against eager PyTorch, outputs (indices too) and gradients, bit for bit
(the sign of zero included; sums within rounding) in float32 and float64, with no node run in PyTorch.

ONNX Runtime's MaxPool starts each window at the most negative finite number, not -inf, and its kernel
without indices (used where no node reads them) also breaks ties between -0.0 and 0.0 its own way.
Adaptive average pooling and replication padding's backward must keep a non-finite element inside its own
windows; adaptive max pooling must index a region of only -inf inside the region.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import Exact, RelAbs, Tolerance, arange_cotangents, assert_outputs, leaves, run_both

from aot2onnx.compile.fallback import fallback_graphs, reset_fallback_graphs

NAN, INF = float("nan"), float("inf")
DTYPES = [torch.float32, torch.float64]
EXACT = Exact()  # bit for bit: equal values, NaN for NaN, the same sign of zero


def _check(fn, x: torch.Tensor, dtype: torch.dtype, *, grad: bool, cotangent=None, grad_expected=None,
           tol: Tolerance = EXACT) -> None:
    """fn eagerly and compiled (tests/harness.py), with no node run in PyTorch: every output, and with ``grad``
    the gradient of x under ``cotangent`` (1, 2, 3, ... by default) or against ``grad_expected`` (where eager's
    own backward is not to be run), under ``tol``: bit for bit, the sign of zero included, by default."""
    torch._dynamo.reset()
    reset_fallback_graphs()
    pair = run_both(fn, x, dtype=dtype, grad=grad, no_grad=not grad)
    assert not fallback_graphs(), "a node ran in PyTorch"
    assert_outputs(pair, tol)
    if not grad:
        return
    (xe,), (xc,) = pair.eager_inputs, pair.compiled_inputs
    (value_e,), (value_c,) = leaves(pair.eager)[:1], leaves(pair.compiled)[:1]
    if cotangent is None:
        (cotangent,) = arange_cotangents([value_e])
    cotangent = cotangent.to(dtype)
    value_c.backward(cotangent)
    assert not fallback_graphs(), "a node of the backward ran in PyTorch"
    if grad_expected is None:
        value_e.backward(cotangent)
        grad_expected = xe.grad
    tol.check("gradient", xc.grad, grad_expected.to(dtype))


# ---------------------------------------------------------------------------------------------------------
# Max pooling: windows of -inf and padding


def _x(values, shape) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).reshape(shape)


MAX_POOLS = {
    # the differential test's repro: padding beside -inf, a ceil-mode overhang beside -inf, dilated
    "1d, padding and -inf": (lambda x: F.max_pool1d(x, 2, stride=2, padding=1, return_indices=True),
                             _x([-INF, 1.0, -INF], (1, 1, 3))),
    "1d, ceil-mode overhang and -inf": (lambda x: F.max_pool1d(x, 2, stride=2, ceil_mode=True, return_indices=True),
                                        _x([-INF, 1.0, -INF], (1, 1, 3))),
    "1d, dilated, padded, ceil mode": (
        lambda x: F.max_pool1d(x, 2, stride=2, padding=1, dilation=2, ceil_mode=True, return_indices=True),
        _x([-INF, 1.0, -INF], (1, 1, 3))),
    "1d, all -inf": (lambda x: F.max_pool1d(x, 3, stride=1, padding=1, return_indices=True),
                     _x([-INF] * 4 + [2.0, -INF], (2, 1, 3))),
    "2d, -inf windows, padding": (lambda x: F.max_pool2d(x, 3, 2, 1, return_indices=True),
                                  _x([-INF] * 12 + [0.5] + [-INF] * 7, (1, 1, 4, 5))),
    "2d, ceil mode, dilation": (lambda x: F.max_pool2d(x, 2, 2, 1, 2, ceil_mode=True, return_indices=True),
                                _x([-INF, 3.0, -INF, -INF, -INF, -INF, 1.0, -INF, -INF] * 2, (2, 1, 3, 3))),
    "2d, unbatched": (lambda x: F.max_pool2d(x, 2, 1, 1, return_indices=True),
                      _x([-INF, -INF, -INF, 7.0], (1, 2, 2))),
    "3d, -inf and padding": (lambda x: F.max_pool3d(x, 2, 2, 1, return_indices=True),
                             _x([-INF] * 7 + [4.0] + [-INF] * 19, (1, 1, 3, 3, 3))),
    # -inf beside NaN, +inf and the most negative float32
    "2d, -inf, NaN, inf": (lambda x: F.max_pool2d(x, 2, 2, 1, return_indices=True),
                           _x([-INF, NAN, -INF, -INF, -INF, INF, -INF, -3.4028234663852886e38, -INF], (1, 1, 3, 3))),
    "2d, the most negative float32": (lambda x: F.max_pool2d(x, 2, 2, 1, return_indices=True),
                                      _x([-3.4028234663852886e38, -INF, -INF, 1.0], (1, 1, 2, 2))),
}


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(MAX_POOLS))
def test_max_pool_neg_inf(case, dtype, grad):
    fn, x = MAX_POOLS[case]
    _check(fn, x, dtype, grad=grad)
    _check(lambda x: fn(x)[0], x, dtype, grad=grad)  # the indices unread: ONNX Runtime's other kernel


# Windows that hold no element of the input: the dilation steps from the begin padding over the whole input.
# (With ATen's padding <= kernel // 2, then every window along that dim holds nothing.) Eager's value is -inf
# and its index the window's first position once its start is stepped into the input, which lies outside the
# window, often outside the plane: eager's backward adds the window's gradient there, into the next row or
# plane or past the end of its buffer (glibc may then abort: "double free or corruption"). aot2onnx drops
# such a window's gradient, so the gradient is zero; eager's backward is not run.
EMPTY_WINDOWS = {
    # the differential test's repro, F.max_pool1d(x0.reshape(1, -1, 1), ...) on a [1, 1] input
    "1d, one plane": (lambda x: F.max_pool1d(x.reshape(1, -1, 1), 2, stride=1, padding=1, dilation=2,
                                             return_indices=True), _x([[1.0]], (1, 1))),
    "1d, three planes": (lambda x: F.max_pool1d(x, 2, stride=1, padding=1, dilation=2, return_indices=True),
                         _x([5.0, -INF, NAN], (3, 1, 1))),
    "2d, empty along H": (lambda x: F.max_pool2d(x, 2, stride=2, padding=1, dilation=2, return_indices=True),
                          _x([1.0, 2.0, 3.0], (1, 1, 1, 3))),
    "2d, empty along W": (lambda x: F.max_pool2d(x, (1, 2), stride=1, padding=(0, 1), dilation=(1, 2),
                                                 return_indices=True), _x([1.0, 2.0, 3.0], (1, 1, 3, 1))),
    "2d, unbatched, ceil mode": (lambda x: F.max_pool2d(x, 2, stride=2, padding=1, dilation=2, ceil_mode=True,
                                                        return_indices=True), _x([1.0, -INF, 3.0], (1, 1, 3))),
    "3d": (lambda x: F.max_pool3d(x, (2, 1, 1), stride=1, padding=(1, 0, 0), dilation=(2, 1, 1),
                                  return_indices=True), _x([1.0, 2.0, 3.0, 4.0], (1, 1, 1, 2, 2))),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(EMPTY_WINDOWS))
def test_max_pool_window_of_nothing(case, dtype):
    fn, x = EMPTY_WINDOWS[case]
    with torch.no_grad():
        values, _ = fn(x.to(dtype))
    assert bool((values == -INF).all()), values  # eager's forward reads only the input: safe to run
    _check(fn, x, dtype, grad=False)
    _check(lambda x: fn(x)[0], x, dtype, grad=False)
    _check(fn, x, dtype, grad=True, grad_expected=torch.zeros_like(x))


# ---------------------------------------------------------------------------------------------------------
# Max pooling: NaN still wins its window beside -inf and padding (the differential test's "nan-max-pool")


NAN_POOLS = {
    "1d, NaN first and last": (lambda x: F.max_pool1d(x, 2, return_indices=True), _x([NAN, 1.0, 1.0, NAN], (1, 1, 4))),
    "2d, NaN beside -inf and padding": (lambda x: F.max_pool2d(x, 3, 2, 1, return_indices=True),
                                        _x([-INF, NAN, -INF, 2.0, -INF, -INF, NAN, -INF, -INF, -INF, 0.0, NAN,
                                            -INF, -INF, -INF, -INF], (1, 1, 4, 4))),
    "3d, ceil mode": (lambda x: F.max_pool3d(x, 2, 2, 0, ceil_mode=True, return_indices=True),
                      _x([NAN, -INF, -INF, -INF, 1.0, -INF, -INF, NAN], (1, 1, 2, 2, 2))),
}


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(NAN_POOLS))
def test_max_pool_nan_beside_neg_inf(case, dtype, grad):
    fn, x = NAN_POOLS[case]
    _check(fn, x, dtype, grad=grad)
    _check(lambda x: fn(x)[0], x, dtype, grad=grad)


# ---------------------------------------------------------------------------------------------------------
# Max pooling: -0.0 and 0.0 in one window. Eager keeps the first maximum. So does ONNX Runtime's MaxPool
# with indices (read where gradients are wanted) and its float64 kernel; its float32 kernel without indices
# keeps the last (on x86, its vector max returns the second of two equal operands). Matching eager there
# costs a pass over the input on every call (a Reciprocal and a ReduceMin to find a -0.0: +50% on
# max_pool2d(k=3, s=2, p=1) of [32, 64, 112, 112] without gradients), or the kernel with indices (12x
# slower): a documented difference instead.

ZEROS = _x([-0.0, 0.0, 0.0, -0.0, -1.0, -0.0], (1, 1, 6))


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_max_pool_signed_zeros(dtype, grad, request):
    if dtype == torch.float32 and not grad:
        request.applymarker(pytest.mark.xfail(strict=True, reason="float32 max pooling without gradients: a "
                                              "window of -0.0 and 0.0 gives the last zero (eager: the first)"))
    _check(lambda x: F.max_pool1d(x, 2, stride=1), ZEROS, dtype, grad=grad)


# ---------------------------------------------------------------------------------------------------------
# Adaptive average pooling: an inf or NaN stays in the windows that hold it, forward and backward. (The
# windows were a product with a 0/1 matrix, in which the inf of one window times the 0 of another made NaN.)

# Sums, which ONNX Runtime rounds in its own order: finite nonzero values within rounding, the rest bit for bit.
ROUNDING = {torch.float32: RelAbs(rtol=1e-6, zero_sign=True), torch.float64: RelAbs(rtol=1e-14, zero_sign=True)}
_SPECIALS = [INF, 1.0, 2.0, 3.0, -INF, 0.5, NAN, -2.0, 4.0, -0.0, 0.0, 1.5]


def _specials(*shape: int) -> torch.Tensor:
    count = torch.Size(shape).numel()
    return torch.tensor([_SPECIALS[i % len(_SPECIALS)] for i in range(count)], dtype=torch.float64).reshape(shape)


ADAPTIVE_AVG = {
    # the differential test's repro
    "2d, (1, 4) of 1x4": (lambda x: F.adaptive_avg_pool2d(x, (1, 4)), _x([INF, 1.0, 2.0, 3.0], (1, 1, 1, 4))),
    "2d, 1x1": (lambda x: F.adaptive_avg_pool2d(x, 1), _specials(2, 3, 3, 4)),  # as mean()
    "2d, windows that divide": (lambda x: F.adaptive_avg_pool2d(x, (2, 3)), _specials(1, 2, 4, 6)),
    "2d, uneven windows": (lambda x: F.adaptive_avg_pool2d(x, (3, 4)), _specials(2, 2, 5, 7)),
    "2d, uneven along one dim": (lambda x: F.adaptive_avg_pool2d(x, (3, 2)), _specials(1, 3, 5, 4)),
    "2d, more cells than positions": (lambda x: F.adaptive_avg_pool2d(x, (5, 3)), _specials(1, 2, 3, 2)),
    "2d, unbatched": (lambda x: F.adaptive_avg_pool2d(x, (2, 3)), _specials(3, 5, 5)),
    "3d, uneven windows": (lambda x: F.adaptive_avg_pool3d(x, (2, 3, 2)), _specials(1, 2, 3, 4, 5)),
    "3d, 1x1x1": (lambda x: F.adaptive_avg_pool3d(x, 1), _specials(2, 2, 2, 3, 2)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(ADAPTIVE_AVG))
def test_adaptive_avg_pool_nonfinite(case, dtype):
    fn, x = ADAPTIVE_AVG[case]
    _check(fn, x, dtype, grad=False, tol=ROUNDING[dtype])
    # Finite inputs (so that eager's gradient is defined everywhere), a non-finite cotangent.
    finite = torch.where(torch.isfinite(x), x, 1.0)
    shape = fn(finite).shape
    _check(fn, finite, dtype, grad=True, cotangent=_specials(*shape), tol=ROUNDING[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("out", [(2, 2), (3, 3), (6, 5)], ids=str)
def test_adaptive_avg_pool_zeros_are_positive(out, dtype):
    # ATen's sums start from +0.0: a window (and a gradient) of -0.0 is +0.0. (Output 1x1 is left out: it
    # reaches the lowering as mean(), whose ReduceMean keeps -0.0, a reduction's difference, not pooling's.)
    x = torch.full((1, 2, 4, 4), -0.0, dtype=torch.float64)
    fn = lambda x: F.adaptive_avg_pool2d(x, out)
    _check(fn, x, dtype, grad=True, cotangent=torch.full((1, 2, *out), -0.0))


# ---------------------------------------------------------------------------------------------------------
# Adaptive max pooling: a region of only -inf (its index was the plane's first position, which the region may
# not hold, and the gradient went there), and -0.0 before 0.0 (eager keeps the first maximum).

ADAPTIVE_MAX = {
    "2d, regions of -inf": (lambda x: F.adaptive_max_pool2d(x, (2, 1), return_indices=True),
                            _x([1.0, -INF, -INF, 2.0, -INF, -INF], (1, 2, 3, 1))),
    "2d, -inf, NaN, zeros": (lambda x: F.adaptive_max_pool2d(x, (2, 3), return_indices=True),
                             _x([-INF, -INF, NAN, 0.0, -0.0, -INF, -INF, -0.0, 0.0, 1.0, -INF, -INF, -0.0, -INF,
                                 -INF], (1, 3, 5))),
    "2d, signed zeros": (lambda x: F.adaptive_max_pool2d(x, (1, 2), return_indices=True),
                         _x([-0.0, 0.0, 0.0, -0.0], (1, 1, 1, 4))),
    "3d": (lambda x: F.adaptive_max_pool3d(x, (1, 2, 2), return_indices=True),
           _x([-INF] * 6 + [-0.0, 0.0] + [-INF] * 4 + [0.0, -0.0, 3.0, -INF], (1, 1, 2, 2, 4))),
}


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(ADAPTIVE_MAX))
def test_adaptive_max_pool_neg_inf_and_zeros(case, dtype, grad):
    fn, x = ADAPTIVE_MAX[case]
    _check(fn, x, dtype, grad=grad)
    _check(lambda x: fn(x)[0], x, dtype, grad=grad)


# ---------------------------------------------------------------------------------------------------------
# Replication padding's backward, which sums the gradient of every copy of an edge, had the same product
# with a 0/1 matrix: an inf in one output's gradient made NaN of every input's.

REPLICATION_PADS = {
    "1d": ((2, 3, 5), (2, 3)),
    "1d, cropped on the left": ((1, 2, 5), (-1, 2)),
    "2d": ((1, 2, 4, 5), (1, 2, 3, 0)),
    "2d, cropped": ((2, 1, 5, 4), (2, -1, -1, 1)),
    "2d, unbatched": ((2, 3, 3), (1, 1, 1, 1)),
    "3d": ((1, 1, 3, 2, 4), (1, 0, 2, 1, 0, 1)),
    "3d, one position": ((1, 2, 1, 1, 1), (2, 1, 1, 2, 0, 1)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(REPLICATION_PADS))
def test_replication_pad_backward_nonfinite(case, dtype):
    shape, pad = REPLICATION_PADS[case]
    fn = lambda x: F.pad(x, pad, mode="replicate")
    x = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape) / 4 - 1
    _check(fn, x, dtype, grad=True, cotangent=_specials(*fn(x).shape), tol=ROUNDING[dtype])
    _check(fn, x, dtype, grad=True, cotangent=torch.full(fn(x).shape, -0.0))  # eager adds to zeros: 0.0
