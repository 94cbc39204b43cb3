"""Reductions and scans torch_lib does not lower (or lowers only in part): amax/amin and max/min with NaN,
median, nanmedian, mode, kthvalue, cummax/cummin, cumprod, prod as a prim; var and std (and var_mean,
std_mean) accumulated in double as ATen does; means that are NaN over no elements; and sums over leading axes
as a matrix product (bias gradients), which ONNX Runtime runs faster than its ReduceSum.

Scans along a dim of size n are computed from an (n, n) mask of "j <= i": memory grows as n**2 per row,
which is fine for the sizes these ops see, and every element is computed the way ATen defines it
(including NaN propagation and which index wins a tie).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops import core as torchlib_core
from onnxscript.function_libs.torch_lib.ops import linalg as torchlib_linalg
from onnxscript.function_libs.torch_lib.ops import prims as torchlib_prims

from aot2onnx.lower.ops._common import cast, float64_constant, linspace, opmath, rounded_to, truth_dtype
from aot2onnx.lower.ops._control import loop
from aot2onnx.lower.registry import project_rule

aten, prims = torch.ops.aten, torch.ops.prims

_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _axes(dims: Sequence[int] | None, rank: int) -> list[int]:
    return list(range(rank)) if not dims else [d % rank for d in dims]


def _nan(like):
    return op.CastLike(op.Constant(value_float=float("nan")), like)


def _any_nan(x, axes: list[int], keepdims: int):
    return op.Cast(op.ReduceMax(op.Cast(op.IsNaN(x), to=ir.DataType.INT32), op.Constant(value_ints=axes), keepdims=keepdims),
                   to=ir.DataType.BOOL)


def _extremum(reduce, self, dim: Sequence[int], keepdim: bool):
    rank = len(self.shape)
    if rank == 0:
        return op.Identity(self)
    axes = _axes(dim, rank)
    keep = 1 if keepdim else 0
    if self.dtype == ir.DataType.BOOL:
        return op.Cast(reduce(op.Cast(self, to=truth_dtype()), op.Constant(value_ints=axes), keepdims=keep),
                       to=ir.DataType.BOOL)
    result = reduce(self, op.Constant(value_ints=axes), keepdims=keep)
    if self.dtype in _FLOATS:
        # ATen propagates NaN; ONNX Runtime's ReduceMax/ReduceMin do not say what they do with it.
        result = op.Where(_any_nan(self, axes, keep), _nan(self), result)
    return result


@project_rule(aten.sum.dim_IntList)
def aten_sum_dim_intlist(self, dim: Sequence[int] | None = None, keepdim: bool = False, dtype: int = -1):
    """sum.dim_IntList(Tensor self, int[1]? dim, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor

    A float sum over the leading axes of a static shape (the bias gradient of a linear layer, the
    weight gradient of a LayerNorm) is ``ones(1, n) @ x.reshape(n, -1)``: ONNX Runtime's CPU ReduceSum
    over a leading axis is 1.4-3x slower than that product (measured alone: 90 against 45 us for
    1024 x 256, 514 against 171 us for 8192 x 256). Every other sum is torch_lib's ReduceSum.
    """
    shape = self.shape
    rank = 0 if shape is None else len(shape)
    axes = sorted(set(_axes(dim, rank))) if rank else []  # no dims means every axis, as in ATen
    lead = len(axes)
    if (
        self.dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE)
        and dtype in (-1, None, self.dtype)
        and 0 < lead < rank
        and axes == list(range(lead))
        and all(isinstance(d, int) for d in shape)
    ):
        rows = math.prod(shape[:lead])
        rest = list(shape[lead:])
        ones = op.ConstantOfShape(op.Constant(value_ints=[1, rows]), value=ir.tensor([1], dtype=self.dtype))
        total = op.MatMul(ones, op.Reshape(self, op.Constant(value_ints=[rows, math.prod(rest)]), allowzero=1))
        return op.Reshape(total, op.Constant(value_ints=[1] * lead + rest if keepdim else rest), allowzero=1)
    if shape is not None and _int64_accumulated(self, dtype):
        return _integer_sum(op.Cast(self, to=ir.DataType.INT64), axes, keepdim, rank)
    return torchlib_core.aten_sum_dim_IntList(self, dim, keepdim, dtype)


@project_rule(aten.sum.default)
def aten_sum(self, dtype: int = -1):
    """sum(Tensor self, *, ScalarType? dtype=None) -> Tensor"""
    if self.shape is not None and _int64_accumulated(self, dtype):
        rank = len(self.shape)
        return _integer_sum(op.Cast(self, to=ir.DataType.INT64), list(range(rank)), False, rank)
    return torchlib_core.aten_sum(self, dtype)


def _int64_accumulated(self, dtype: int) -> bool:
    """Whether ATen sums or multiplies ``self`` in int64: an integer or bool tensor without a dtype (ATen
    widens them), or any tensor with dtype=int64."""
    if dtype in (-1, None):
        return self.dtype is not None and (self.dtype.is_integer() or self.dtype == ir.DataType.BOOL)
    return dtype == ir.DataType.INT64


def _integer_sum(x, axes: list[int], keepdim: bool, rank: int):
    """An int64 sum over ``axes``, exact and wrapping on overflow as ATen's: the last of a CumSum along the
    reduced elements laid out last. ONNX Runtime's int64 ReduceSum goes through double: a sum past 2^53 lost
    its low bits (2^60 + 1 + 2^60 + 3 + 7 gave ...952, eager ...963), with no warning."""
    if rank == 0 or not axes:
        return op.Identity(x)
    kept = [d for d in range(rank) if d not in axes]
    laid_out = op.Transpose(x, perm=kept + axes)
    kept_shape = op.Shape(laid_out, end=len(kept))
    count = op.ReduceProd(op.Shape(laid_out, start=len(kept)), keepdims=1)
    rows = op.Reshape(laid_out, op.Concat(kept_shape, count, axis=0), allowzero=1)
    # A 0 in front: an empty sum is 0, and the last running total is the sum.
    zero = op.ConstantOfShape(op.Concat(kept_shape, op.Constant(value_ints=[1]), axis=0),
                              value=ir.tensor([0], dtype=ir.DataType.INT64))
    running = op.CumSum(op.Concat(zero, rows, axis=-1), op.Constant(value_int=-1))
    total = op.Gather(running, op.Constant(value_int=-1), axis=-1)
    if not keepdim:
        return total
    one = op.Constant(value_ints=[1])
    target = op.Concat(*[one if d in axes else op.Shape(x, start=d, end=d + 1) for d in range(rank)], axis=0)
    return op.Reshape(total, target, allowzero=1)


def _all_or_any(reduce, self, dim: Sequence[int] | None, keepdim: bool):
    """all/any as ReduceMin/ReduceMax over one-byte truth values.

    torch_lib widens the truth values to int64 before reducing: on the attention probabilities of
    ``_safe_softmax`` (8 x 4 x 128 x 128) the Cast and ReduceMin took 0.47 ms of that op's 0.76, against
    0.13 ms over uint8 (int32 on CUDA: :func:`truth_dtype`). Like ATen, a uint8 input gives a uint8 result;
    every other input gives bool.
    """
    rank = 0 if self.shape is None else len(self.shape)
    out_type = ir.DataType.UINT8 if self.dtype == ir.DataType.UINT8 else ir.DataType.BOOL
    truth = self if self.dtype == ir.DataType.BOOL else op.Cast(self, to=ir.DataType.BOOL)
    if rank == 0:
        return op.Cast(truth, to=out_type)
    axes = sorted(set(_axes(dim, rank)))
    reduced = reduce(op.Cast(truth, to=truth_dtype()), op.Constant(value_ints=axes), keepdims=1 if keepdim else 0)
    return op.Cast(reduced, to=out_type)


@project_rule(aten.linalg_vector_norm.default)
def aten_linalg_vector_norm(self, ord: float = 2.0, dim: Sequence[int] | None = None, keepdim: bool = False,
                            dtype: int = -1):
    """linalg_vector_norm(Tensor self, Scalar ord=2, int[1]? dim=None, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor

    torch_lib's rule flattens the input for ``dim=None`` and drops ``keepdim`` there: ``vector_norm(x,
    keepdim=True)`` came back as a scalar where ATen keeps every axis as size 1 (the run was refused by the
    output shape check). Its result reshaped to that. A 0-d input reduced over dim 0 or -1 (ATen's wrap) is
    reduced as flattened: torch_lib's axes were out of range for ONNX."""
    rank = len(self.shape)
    if rank == 0:
        dim = None
    if math.isinf(ord) or ord in (0, 1, 2):
        result = torchlib_linalg.aten_linalg_vector_norm(self, ord, dim, keepdim, dtype)
    else:
        # torch_lib raises to ord and 1/ord as float32 constants, also for a double input (relative errors of
        # 3e-8 forward and 2e-7 backward at ord=8.396163642458497): the exponents are made in the input's dtype.
        x = self if dtype == -1 else op.Cast(self, to=dtype)
        low = (dtype if dtype != -1 else self.dtype) in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
        if low:  # in float32, as ATen's half kernels do (an exponent of 1/3 is not a float16 number)
            result_type, x = ir.DataType(dtype) if dtype != -1 else self.dtype, op.Cast(x, to=ir.DataType.FLOAT)
        if ord < 0 or ord % 2 != 0:
            x = op.Abs(x)
        axes = op.Constant(value_ints=[-1] if dim is None else list(dim))
        if dim is None:
            x = op.Reshape(x, op.Constant(value_ints=[-1]))
        total = op.ReduceSum(op.Pow(x, op.CastLike(float64_constant(ord), x)), axes,
                             keepdims=1 if keepdim and dim is not None else 0)
        result = op.Pow(total, op.CastLike(float64_constant(1 / ord), x))
        if low:
            result = op.Cast(result, to=result_type)
    if dim is None and keepdim and rank:
        return op.Reshape(result, op.Constant(value_ints=[1] * rank))
    return result


@project_rule(aten.all.default)
def aten_all(self):
    """all(Tensor self) -> Tensor"""
    return _all_or_any(op.ReduceMin, self, None, False)


@project_rule(aten.all.dim)
def aten_all_dim(self, dim: int, keepdim: bool = False):
    """all.dim(Tensor self, int dim, bool keepdim=False) -> Tensor"""
    return _all_or_any(op.ReduceMin, self, [dim], keepdim)


@project_rule(aten.all.dims)
def aten_all_dims(self, dim: Sequence[int] | None = None, keepdim: bool = False):
    """all.dims(Tensor self, int[]? dim=None, bool keepdim=False) -> Tensor"""
    return _all_or_any(op.ReduceMin, self, dim, keepdim)


@project_rule(aten.any.default)
def aten_any(self):
    """any(Tensor self) -> Tensor"""
    return _all_or_any(op.ReduceMax, self, None, False)


@project_rule(aten.any.dim)
def aten_any_dim(self, dim: int, keepdim: bool = False):
    """any.dim(Tensor self, int dim, bool keepdim=False) -> Tensor"""
    return _all_or_any(op.ReduceMax, self, [dim], keepdim)


@project_rule(aten.any.dims)
def aten_any_dims(self, dim: Sequence[int] | None = None, keepdim: bool = False):
    """any.dims(Tensor self, int[]? dim=None, bool keepdim=False) -> Tensor"""
    return _all_or_any(op.ReduceMax, self, dim, keepdim)


@project_rule(aten.amax.default)
def aten_amax(self, dim: Sequence[int] = (), keepdim: bool = False):
    """amax(Tensor self, int[1] dim=[], bool keepdim=False) -> Tensor"""
    return _extremum(op.ReduceMax, self, dim, keepdim)


@project_rule(aten.logsumexp.default)
def aten_logsumexp(self, dim: Sequence[int], keepdim: bool = False):
    """logsumexp(Tensor self, int[1] dim, bool keepdim=False) -> Tensor"""
    # ATen's formula: m = amax (NaN wins), log(sum(exp(x - m'))) + m with m' = 0 where m is infinite.
    # ONNX Runtime's ReduceLogSumExp took a max that passes over NaN: [inf, nan] gave inf, eager NaN.
    if len(self.shape) == 0:
        return self
    maximum = _extremum(op.ReduceMax, self, dim, True)
    shift = op.Where(op.IsInf(maximum), op.CastLike(0.0, maximum), maximum)
    axes = op.Constant(value_ints=_axes(dim, len(self.shape)))
    total = op.ReduceSum(op.Exp(op.Sub(self, shift)), axes, keepdims=1 if keepdim else 0)
    return op.Add(op.Log(total), shift if keepdim else op.Squeeze(shift, axes))


@project_rule(aten.amin.default)
def aten_amin(self, dim: Sequence[int] = (), keepdim: bool = False):
    """amin(Tensor self, int[1] dim=[], bool keepdim=False) -> Tensor"""
    return _extremum(op.ReduceMin, self, dim, keepdim)


@project_rule(aten.max.default)
def aten_max(self):
    """max(Tensor self) -> Tensor"""
    return _extremum(op.ReduceMax, self, (), False)


@project_rule(aten.min.default)
def aten_min(self):
    """min(Tensor self) -> Tensor"""
    return _extremum(op.ReduceMin, self, (), False)


@project_rule(prims.prod.default)
def prims_prod(inp, dims: Sequence[int] | None, output_dtype: int = -1):
    """prod(Tensor inp, int[]? dims, *, ScalarType? output_dtype=None) -> Tensor"""
    if output_dtype not in (-1, None):
        cast = op.Cast(inp, to=output_dtype)
        cast.shape, cast.dtype = inp.shape, ir.DataType(output_dtype)
        inp = cast
    if len(inp.shape) == 0:
        return op.Identity(inp)
    return op.ReduceProd(inp, op.Constant(value_ints=_axes(dims, len(inp.shape))), keepdims=0)


def _to_last(x, dim: int):
    """x with ``dim`` moved last, and the permutation that undoes it (or None)."""
    rank = len(x.shape)
    dim %= rank
    if dim == rank - 1:
        return x, None
    perm = [d for d in range(rank) if d != dim] + [dim]
    inverse = [perm.index(d) for d in range(rank)]
    return op.Transpose(x, perm=perm), inverse


def _from_last(x, inverse):
    return x if inverse is None else op.Transpose(x, perm=inverse)


def _positions(x):
    """0..n-1 for the last axis of x, as int64."""
    n = op.Shape(x, start=-1)
    return op.Range(op.Constant(value_int=0), op.Squeeze(n, op.Constant(value_ints=[0])), op.Constant(value_int=1))


def _prefix_mask(x):
    """(n, n) bool, True where j <= i (row i, column j), for the last axis of x."""
    positions = _positions(x)
    return op.LessOrEqual(op.Unsqueeze(positions, op.Constant(value_ints=[0])),
                          op.Unsqueeze(positions, op.Constant(value_ints=[1])))


def _cumulative_extremum(self, dim: int, largest: bool):
    if len(self.shape) == 0:
        return op.Identity(self), op.Constant(value_int=0)
    x, inverse = _to_last(self, dim)
    mask = _prefix_mask(x)
    rows = op.Unsqueeze(x, op.Constant(value_ints=[-2]))  # [..., 1, n]: element j of row i
    last = op.Constant(value_ints=[-1])
    floating = self.dtype in _FLOATS
    if floating:
        fill = op.CastLike(op.Constant(value_float=float("-inf") if largest else float("inf")), x)
    else:
        # For integers, fill with the row's first element: it is in every prefix, so it changes nothing.
        fill = op.Unsqueeze(op.Gather(x, op.Constant(value_int=0), axis=-1), op.Constant(value_ints=[-1, -2]))
    masked = op.Where(mask, rows, fill)
    reduce = op.ReduceMax if largest else op.ReduceMin
    values = reduce(masked, last, keepdims=0)
    positions = _positions(x)
    # ATen keeps the latest index among equal extrema (it compares with >= / <=).
    hits = op.And(mask, op.Equal(rows, op.Unsqueeze(values, last)))
    minus_one = op.Constant(value_int=-1)
    indices = op.ReduceMax(op.Where(hits, positions, minus_one), last, keepdims=0)
    if floating:
        # Once a NaN is seen, the value is NaN and the index is the latest NaN's.
        nans = op.And(mask, op.IsNaN(rows))
        any_nan = op.Cast(op.ReduceMax(op.Cast(nans, to=ir.DataType.INT32), last, keepdims=0), to=ir.DataType.BOOL)
        values = op.Where(any_nan, _nan(x), values)
        indices = op.Where(any_nan, op.ReduceMax(op.Where(nans, positions, minus_one), last, keepdims=0), indices)
    return _from_last(values, inverse), _from_last(indices, inverse)


@project_rule(aten.cummax.default)
def aten_cummax(self, dim: int):
    """cummax(Tensor self, int dim) -> (Tensor values, Tensor indices)"""
    return _cumulative_extremum(self, dim, largest=True)


@project_rule(aten.cummin.default)
def aten_cummin(self, dim: int):
    """cummin(Tensor self, int dim) -> (Tensor values, Tensor indices)"""
    return _cumulative_extremum(self, dim, largest=False)


@project_rule(aten.cumprod.default)
def aten_cumprod(self, dim: int, dtype: int = -1):
    """cumprod(Tensor self, int dim, *, ScalarType? dtype=None) -> Tensor"""
    if dtype not in (-1, None):
        cast = op.Cast(self, to=dtype)
        cast.shape, cast.dtype = self.shape, ir.DataType(dtype)
        self = cast
    if len(self.shape) == 0:
        return op.Identity(self)
    x, inverse = _to_last(self, dim)
    n = self.shape[dim]
    if self.dtype == ir.DataType.INT64 and isinstance(n, int):
        # Exact and wrapping as ATen's (ReduceProd's int64 kernel goes through double and saturates): a scan
        # of products over doubling spans, each element times the one `span` before it.
        last = op.Constant(value_ints=[-1])
        span = 1
        while span < n:
            ones = op.Expand(op.CastLike(1, x), op.Concat(op.Shape(x, end=-1), op.Constant(value_ints=[span]), axis=0))
            before = op.Slice(x, op.Constant(value_ints=[0]), op.Constant(value_ints=[n - span]), last)
            x = op.Mul(x, op.Concat(ones, before, axis=-1))
            span *= 2
        return _from_last(x, inverse)
    rows = op.Unsqueeze(x, op.Constant(value_ints=[-2]))
    masked = op.Where(_prefix_mask(x), rows, op.CastLike(1, x))
    return _from_last(op.ReduceProd(masked, op.Constant(value_ints=[-1]), keepdims=0), inverse)


def _sort(self, dim: int, descending: bool):
    # ONNX Runtime's TopK orders equal values by index, ascending and descending (checked against ATen's stable
    # sort with 4 distinct values over 5 to 70000 elements, both axes, full and partial k): a stable sort.
    # It has no bool kernel; bools sort as int32.
    if self.dtype == ir.DataType.BOOL:
        values, indices = torchlib_core.aten_sort(cast(self, ir.DataType.INT32), dim, descending)
        return op.Cast(values, to=ir.DataType.BOOL), indices
    return torchlib_core.aten_sort(self, dim, descending)


@project_rule(aten.sort.default)
def aten_sort(self, dim: int = -1, descending: bool = False):
    """sort(Tensor self, int dim=-1, bool descending=False) -> (Tensor values, Tensor indices)"""
    return _sort(self, dim, descending)


@project_rule(aten.sort.stable)
def aten_sort_stable(self, *, stable: bool | None = None, dim: int = -1, descending: bool = False):
    """sort.stable(Tensor self, *, bool? stable, int dim=-1, bool descending=False) -> (Tensor values, Tensor indices)"""
    # ATen's unstable sort leaves the order of equal values unspecified: the stable one is a valid answer.
    return _sort(self, dim, descending)


def _sorted_indices(x):
    """The positions that sort x's last axis ascending, NaN after every number as in ATen."""
    if x.dtype in _FLOATS:
        x = op.Where(op.IsNaN(x), op.CastLike(op.Constant(value_float=float("inf")), x), x)
    _, indices = op.TopK(x, op.Shape(x, start=-1), axis=-1, largest=0, sorted=1)
    return indices


def _take(x, sorted_indices, position):
    """(x[..., i], i) where i = sorted_indices[..., position], for a per-row or scalar int64 position."""
    last = op.Constant(value_ints=[-1])
    position = op.Unsqueeze(op.Expand(position, op.Shape(x, end=-1)), last)
    index = op.GatherElements(sorted_indices, position, axis=-1)
    return op.Squeeze(op.GatherElements(x, index, axis=-1), last), op.Squeeze(index, last)


def _keep(value, keepdim: bool, dim: int, rank: int):
    return op.Unsqueeze(value, op.Constant(value_ints=[dim % rank])) if keepdim else value


def _flat(x):
    flat = op.Reshape(x, op.Constant(value_ints=[-1]))
    flat.dtype, flat.shape = x.dtype, ir.Shape([None])
    return flat


def _median(self, dim: int, keepdim: bool, ignore_nan: bool):
    rank = len(self.shape)
    if rank == 0:
        return op.Identity(self), op.Constant(value_int=0)
    x, _ = _to_last(self, dim)
    last = op.Constant(value_ints=[-1])
    one, two = op.Constant(value_int=1), op.Constant(value_int=2)
    floating = x.dtype in _FLOATS
    if ignore_nan and floating:
        count = op.ReduceSum(op.Cast(op.Not(op.IsNaN(x)), to=ir.DataType.INT64), last, keepdims=0)
    else:
        count = op.Squeeze(op.Shape(x, start=-1), op.Constant(value_ints=[0]))
    # The lower median: position (count - 1) // 2 of the sorted row (NaNs sort last).
    position = op.Max(op.Div(op.Sub(count, one), two), op.Constant(value_int=0))
    value, index = _take(x, _sorted_indices(x), position)
    if floating and not ignore_nan:
        # A row holding NaN has median NaN, found at its first NaN.
        nans = op.IsNaN(x)
        any_nan = op.Cast(op.ReduceMax(op.Cast(nans, to=ir.DataType.INT32), last, keepdims=0), to=ir.DataType.BOOL)
        first_nan = op.ReduceMin(op.Where(nans, _positions(x), op.Constant(value_int=2**62)), last, keepdims=0)
        value = op.Where(any_nan, _nan(x), value)
        index = op.Where(any_nan, first_nan, index)
    return _keep(value, keepdim, dim, rank), _keep(index, keepdim, dim, rank)


@project_rule(aten.median.default)
def aten_median(self):
    """median(Tensor self) -> Tensor"""
    return _median(_flat(self), 0, False, ignore_nan=False)[0]


@project_rule(aten.median.dim)
def aten_median_dim(self, dim: int, keepdim: bool = False):
    """median.dim(Tensor self, int dim, bool keepdim=False) -> (Tensor values, Tensor indices)"""
    return _median(self, dim, keepdim, ignore_nan=False)


@project_rule(aten.nanmedian.default)
def aten_nanmedian(self):
    """nanmedian(Tensor self) -> Tensor"""
    return _median(_flat(self), 0, False, ignore_nan=True)[0]


@project_rule(aten.nanmedian.dim)
def aten_nanmedian_dim(self, dim: int, keepdim: bool = False):
    """nanmedian.dim(Tensor self, int dim, bool keepdim=False) -> (Tensor values, Tensor indices)"""
    return _median(self, dim, keepdim, ignore_nan=True)


@project_rule(aten.kthvalue.default)
def aten_kthvalue(self, k: int, dim: int = -1, keepdim: bool = False):
    """kthvalue(Tensor self, SymInt k, int dim=-1, bool keepdim=False) -> (Tensor values, Tensor indices)"""
    rank = len(self.shape)
    if rank == 0:
        return op.Identity(self), op.Constant(value_int=0)
    x, _ = _to_last(self, dim)
    position = op.Sub(op.Cast(k, to=ir.DataType.INT64), op.Constant(value_int=1))
    value, index = _take(x, _sorted_indices(x), position)
    return _keep(value, keepdim, dim, rank), _keep(index, keepdim, dim, rank)


@project_rule(aten.mode.default)
def aten_mode(self, dim: int = -1, keepdim: bool = False):
    """mode(Tensor self, int dim=-1, bool keepdim=False) -> (Tensor values, Tensor indices)"""
    rank = len(self.shape)
    if rank == 0:
        return op.Identity(self), op.Constant(value_int=0)
    x, _ = _to_last(self, dim)
    last = op.Constant(value_ints=[-1])
    # counts[i] = how many elements of the row equal element i.
    same = op.Equal(op.Unsqueeze(x, op.Constant(value_ints=[-1])), op.Unsqueeze(x, op.Constant(value_ints=[-2])))
    counts = op.ReduceSum(op.Cast(same, to=ir.DataType.INT64), last, keepdims=0)
    most = op.ReduceMax(counts, last, keepdims=1)
    # Among the most frequent values the smallest wins; its index is its last occurrence.
    candidates = op.Equal(counts, most)
    if x.dtype == ir.DataType.BOOL:
        x = op.Cast(x, to=ir.DataType.UINT8)
    high = op.ReduceMax(x, last, keepdims=1)
    value = op.ReduceMin(op.Where(candidates, x, high), last, keepdims=1)
    hits = op.And(candidates, op.Equal(x, value))
    index = op.ReduceMax(op.Where(hits, _positions(x), op.Constant(value_int=-1)), last, keepdims=0)
    value = op.Squeeze(value, last)
    if self.dtype == ir.DataType.BOOL:
        value = op.Cast(value, to=ir.DataType.BOOL)
    return _keep(value, keepdim, dim, rank), _keep(index, keepdim, dim, rank)


def _with_shape(value, like):
    """``value`` with the static shape of ``like`` recorded (rules read ranks from ``.shape``)."""
    value.shape = like.shape
    return value


def _arg_extremum(torchlib_rule, self, dim: int | None, keepdim: bool):
    if self.dtype == ir.DataType.BOOL:
        self = _with_shape(op.Cast(self, to=ir.DataType.UINT8), self)  # ONNX Runtime's ArgMax takes no bool
    result = torchlib_rule(self, dim, keepdim)
    if self.dtype not in _FLOATS:
        return result
    # ATen counts NaN as the extremum (the first NaN wins); ONNX Runtime does not say what NaN does.
    nans = _with_shape(op.Cast(op.IsNaN(self), to=ir.DataType.UINT8), self)
    first_nan = torchlib_core.aten_argmax(nans, dim, keepdim)
    rank = len(self.shape)
    axes = list(range(rank)) if dim is None else [dim % max(rank, 1)]
    keep = 1 if keepdim and dim is not None else 0
    any_nan = op.Cast(op.ReduceMax(nans, op.Constant(value_ints=axes), keepdims=keep), to=ir.DataType.BOOL) if rank else (
        op.Cast(nans, to=ir.DataType.BOOL))
    return op.Where(any_nan, first_nan, result)


@project_rule(aten.argmax.default)
def aten_argmax(self, dim: int | None = None, keepdim: bool = False):
    """argmax(Tensor self, int? dim=None, bool keepdim=False) -> Tensor"""
    return _arg_extremum(torchlib_core.aten_argmax, self, dim, keepdim)


@project_rule(aten.argmin.default)
def aten_argmin(self, dim: int | None = None, keepdim: bool = False):
    """argmin(Tensor self, int? dim=None, bool keepdim=False) -> Tensor"""
    return _arg_extremum(torchlib_core.aten_argmin, self, dim, keepdim)


@project_rule(aten.max.dim)
def aten_max_dim(self, dim: int, keepdim: bool = False):
    """max.dim(Tensor self, int dim, bool keepdim=False) -> (Tensor values, Tensor indices)"""
    if len(self.shape) == 0:
        return op.Identity(self), op.Constant(value_int=0)
    return _extremum(op.ReduceMax, self, [dim], keepdim), _arg_extremum(torchlib_core.aten_argmax, self, dim, keepdim)


@project_rule(aten.min.dim)
def aten_min_dim(self, dim: int, keepdim: bool = False):
    """min.dim(Tensor self, int dim, bool keepdim=False) -> (Tensor values, Tensor indices)"""
    if len(self.shape) == 0:
        return op.Identity(self), op.Constant(value_int=0)
    return _extremum(op.ReduceMin, self, [dim], keepdim), _arg_extremum(torchlib_core.aten_argmin, self, dim, keepdim)


def _histogram_counts(x, position, edges, bins: int, weight, density: bool):
    """The histogram of the flat values x, given each one's bin (``bins`` for values outside every bin):
    per-bin counts or weight sums, divided by total and bin width for a density."""
    counts = op.CastLike(op.Expand(op.Constant(value_float=1.0), op.Shape(x)), x) if weight is None else op.Reshape(
        weight, op.Constant(value_ints=[-1]))
    hist = op.ScatterElements(op.CastLike(op.ConstantOfShape(op.Constant(value_ints=[bins + 1])), x), position, counts,
                              axis=0, reduction="add")
    hist = op.Slice(hist, op.Constant(value_ints=[0]), op.Constant(value_ints=[bins]), op.Constant(value_ints=[0]))
    if density:
        widths = op.Sub(op.Slice(edges, op.Constant(value_ints=[1]), op.Constant(value_ints=[bins + 1])),
                        op.Slice(edges, op.Constant(value_ints=[0]), op.Constant(value_ints=[bins])))
        hist = op.Div(hist, op.Mul(op.ReduceSum(hist, keepdims=0), widths))
    return hist


def _linear_bin(x, left, right, bins: int, dtype: ir.DataType | None):
    """ATen's first guess at the bin of each value of x in [left, right] (0-d, x's dtype) split in ``bins``
    equal bins: int64((x - left) * bins / (right - left)), each step rounded to x's dtype (float16 and
    bfloat16 too, as c10::Half's operators do), the right edge in the last bin. Only valid for x in
    [left, right]."""
    count = op.CastLike(float(bins), x)
    if dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        x, left, right, count = (op.Cast(v, to=ir.DataType.FLOAT) for v in (x, left, right, count))
        rounded = lambda v: op.Cast(op.Cast(v, to=dtype), to=ir.DataType.FLOAT)  # noqa: E731
    else:
        rounded = lambda v: v  # noqa: E731
    scaled = rounded(op.Mul(rounded(op.Sub(x, left)), count))
    position = op.Cast(rounded(op.Div(scaled, rounded(op.Sub(right, left)))), to=ir.DataType.INT64)
    return op.Min(op.Max(position, op.Constant(value_int=0)), op.Constant(value_int=bins - 1))


@project_rule(aten.histc.default)
def aten_histc(self, bins: int = 100, min: float = 0, max: float = 0):
    """histc(Tensor self, int bins=100, Scalar min=0, Scalar max=0) -> Tensor"""
    # As ATen counts: each value's bin from _linear_bin alone (no look at the edges, unlike histogram), over
    # [min, max], or the values' own range where min == max (the default), widened by 1 each side where that
    # is empty. torch_lib's rule compares values with edges, which puts some values lying near an edge in the
    # other bin, and refuses min == max.
    x = op.Reshape(self, op.Constant(value_ints=[-1]))
    double = ir.DataType.DOUBLE
    left, right = float64_constant(float(min)), float64_constant(float(max))
    if min == max:
        some = op.Greater(op.Size(x), op.Constant(value_int=0))
        left = op.Where(some, op.Cast(op.ReduceMin(x, keepdims=0), to=double), left)
        right = op.Where(some, op.Cast(op.ReduceMax(x, keepdims=0), to=double), right)
        same = op.Equal(left, right)
        left = op.Where(same, op.Sub(left, float64_constant(1.0)), left)
        right = op.Where(same, op.Add(right, float64_constant(1.0)), right)
    left, right = op.CastLike(left, x), op.CastLike(right, x)
    inside = op.And(op.GreaterOrEqual(x, left), op.LessOrEqual(x, right))
    position = op.Where(inside, _linear_bin(x, left, right, bins, self.dtype), op.Constant(value_int=bins))
    return _histogram_counts(x, position, None, bins, None, False)


@project_rule(aten.histogram.bin_ct)
def aten_histogram_bin_ct(self, bins: int = 100, range: Sequence[float] | None = None, weight=None,
                          density: bool = False):
    """histogram.bin_ct(Tensor self, int bins=100, *, float[]? range=None, Tensor? weight=None, bool density=False) -> (Tensor hist, Tensor bin_edges)"""
    x = op.Reshape(self, op.Constant(value_ints=[-1]))
    if range:
        # float64 constants: a float32 one rounds the bounds of a double histogram (0.1 to 0.10000000149).
        left, right = op.CastLike(float64_constant(range[0]), x), op.CastLike(float64_constant(range[1]), x)
    else:
        left, right = op.ReduceMin(x, keepdims=0), op.ReduceMax(x, keepdims=0)
        # No values: the range is [0, 1], as numpy and ATen take it (ReduceMin's identity is +inf).
        empty = op.Equal(op.Size(x), op.Constant(value_int=0))
        left = op.Where(empty, op.CastLike(0.0, x), left)
        right = op.Where(empty, op.CastLike(1.0, x), right)
    # An empty range is widened by 0.5 on each side, in double, as numpy and ATen do.
    same = op.Equal(left, right)
    half = float64_constant(0.5)
    left = op.Where(same, op.CastLike(op.Sub(op.Cast(left, to=ir.DataType.DOUBLE), half), x), left)
    right = op.Where(same, op.CastLike(op.Add(op.Cast(right, to=ir.DataType.DOUBLE), half), x), right)
    edges = op.CastLike(linspace(left, right, op.Div(op.Sub(right, left), op.CastLike(float(bins), x)), bins + 1), x)
    # ATen's bin (its histogram looks one edge either side of it): the right edge belongs to the last bin;
    # values outside [left, right] are not counted.
    position = _linear_bin(x, left, right, bins, self.dtype)
    lower = op.Gather(edges, position, axis=0)
    upper = op.Gather(edges, op.Add(position, op.Constant(value_int=1)), axis=0)
    position = op.Where(op.Less(x, lower), op.Sub(position, op.Constant(value_int=1)), position)
    position = op.Where(op.And(op.GreaterOrEqual(x, upper), op.Less(position, op.Constant(value_int=bins - 1))),
                        op.Add(position, op.Constant(value_int=1)), position)
    inside = op.And(op.GreaterOrEqual(x, left), op.LessOrEqual(x, right))
    position = op.Where(inside, position, op.Constant(value_int=bins))  # an extra bin, dropped below
    return _histogram_counts(x, position, edges, bins, weight, density), edges


@project_rule(aten.histogram.bins_tensor)
def aten_histogram_bins_tensor(self, bins, weight=None, density: bool = False):
    """histogram.bins_tensor(Tensor self, Tensor bins, *, Tensor? weight=None, bool density=False) -> (Tensor hist, Tensor bin_edges)"""
    x = op.Reshape(self, op.Constant(value_ints=[-1]))
    count = bins.shape[0] - 1 if bins.shape is not None and isinstance(bins.shape[0], int) else None
    if count is None:
        raise NotImplementedError("histogram with a symbolic number of bins")
    # A value's bin is the last edge at or below it; the last edge itself belongs to the last bin.
    at_or_below = op.LessOrEqual(op.Unsqueeze(bins, op.Constant(value_ints=[0])), op.Unsqueeze(x, op.Constant(value_ints=[1])))
    position = op.Sub(op.ReduceSum(op.Cast(at_or_below, to=ir.DataType.INT64), op.Constant(value_ints=[1]), keepdims=0),
                      op.Constant(value_int=1))
    position = op.Min(position, op.Constant(value_int=count - 1))
    first = op.Gather(bins, op.Constant(value_int=0), axis=0)
    last = op.Gather(bins, op.Constant(value_int=count), axis=0)
    inside = op.And(op.GreaterOrEqual(x, first), op.LessOrEqual(x, last))
    position = op.Where(inside, position, op.Constant(value_int=count))  # an extra bin, dropped below
    return _histogram_counts(x, position, bins, count, weight, density), op.Identity(bins)


def _constant(value: float, like):
    """A scalar constant of ``like``'s dtype, exact in double (a CastLike of a Python float goes through
    float32)."""
    if like.dtype == ir.DataType.DOUBLE:
        return op.Constant(value=ir.tensor(np.float64(value)))
    return op.CastLike(op.Constant(value_float=value), like)


def _count(x, axes: list[int], like):
    """How many elements of ``x`` a reduction over ``axes`` reads per output, as a scalar of ``like``'s
    dtype: a constant where those sizes are static, else from the shape at run time (it may be 0 then)."""
    sizes = [x.shape[a] for a in axes]
    if all(isinstance(s, int) for s in sizes):
        return _constant(float(math.prod(sizes)), like)
    gathered = op.Gather(op.Shape(x), op.Constant(value_ints=axes), axis=0)
    return op.CastLike(op.ReduceProd(gathered, op.Constant(value_ints=[0]), keepdims=0), like)


def _moments(self, dims: Sequence[int] | None, correction: float | None, keepdim: bool):
    """(variance, mean) of ``self`` over ``dims``, in double, as ATen's Welford reduction keeps them.

    ATen accumulates in double whatever the float dtype and rounds once at the end (after the square root,
    for std): in float32 the squared deviations overflow once |x - mean| > 1.8e19, and the sum behind the
    mean at 3.4e38, where ATen's do not; a std of 1e30 has a variance of 1e60, which only double holds.
    """
    rank = len(self.shape)
    axes = _axes(dims, rank) if rank else []
    x = self if self.dtype == ir.DataType.DOUBLE else op.Cast(self, to=ir.DataType.DOUBLE)
    reduce_axes = op.Constant(value_ints=axes)
    n = _count(self, axes, x)
    mean = op.Div(op.ReduceSum(x, reduce_axes, keepdims=1), n)  # over no elements 0 / 0 = NaN, as in ATen
    centered = op.Sub(x, mean)
    # ATen divides by max(n - correction, 0): NaN (0 / 0) or inf where there are no more than `correction`.
    divisor = op.Max(op.Sub(n, _constant(1.0 if correction is None else float(correction), x)), _constant(0.0, x))
    var = op.Div(op.ReduceSum(op.Mul(centered, centered), reduce_axes, keepdims=1 if keepdim else 0), divisor)
    if not keepdim:
        mean = op.Squeeze(mean, reduce_axes) if axes else mean
    return var, mean


def _rounded(value, like):
    """A double ``value`` in ``like``'s dtype."""
    return value if like.dtype == ir.DataType.DOUBLE else op.Cast(value, to=like.dtype)


@project_rule(prims.var.default)
def prims_var(inp, dims: Sequence[int] | None, correction: float | None = 1, output_dtype: int = -1):
    """var(Tensor inp, int[]? dims, float? correction=1, *, ScalarType? output_dtype=None) -> Tensor"""
    if inp.dtype not in _FLOATS:
        return torchlib_prims.prims_var(inp, dims, correction, output_dtype)
    var, _ = _moments(inp, dims, correction, keepdim=False)
    return op.Cast(var, to=output_dtype) if output_dtype not in (-1, None) else _rounded(var, inp)


@project_rule(aten.var.correction)
def aten_var_correction(self, dim: Sequence[int] | None = None, correction: float | None = None,
                        keepdim: bool = False):
    """var.correction(Tensor self, int[1]? dim=None, *, Scalar? correction=None, bool keepdim=False) -> Tensor"""
    var, _ = _moments(self, dim, correction, keepdim)
    return _rounded(var, self)


@project_rule(aten.std.correction)
def aten_std_correction(self, dim: Sequence[int] | None = None, correction: float | None = None,
                        keepdim: bool = False):
    """std.correction(Tensor self, int[1]? dim=None, *, Scalar? correction=None, bool keepdim=False) -> Tensor"""
    # Kept whole (not decomposed to sqrt(prims.var)): the square root is taken in double, before rounding.
    var, _ = _moments(self, dim, correction, keepdim)
    return _rounded(op.Sqrt(var), self)


@project_rule(aten.var_mean.correction)
def aten_var_mean_correction(self, dim: Sequence[int] | None = None, correction: float | None = None,
                             keepdim: bool = False):
    """var_mean.correction(Tensor self, int[1]? dim=None, *, Scalar? correction=None, bool keepdim=False) -> (Tensor, Tensor)"""
    var, mean = _moments(self, dim, correction, keepdim)
    return _rounded(var, self), _rounded(mean, self)


@project_rule(aten.std_mean.correction)
def aten_std_mean_correction(self, dim: Sequence[int] | None = None, correction: float | None = None,
                             keepdim: bool = False):
    """std_mean.correction(Tensor self, int[1]? dim=None, *, Scalar? correction=None, bool keepdim=False) -> (Tensor, Tensor)"""
    var, mean = _moments(self, dim, correction, keepdim)
    return _rounded(op.Sqrt(var), self), _rounded(mean, self)


def _mean_by_count(self, axes: list[int], keepdim: bool, dtype: int):
    """sum / count: a mean that is NaN (0 / 0) over no elements, as in ATen, where ONNX Runtime's
    ReduceMean gives 0. For reduced sizes that are 0, or symbolic (0 at run time, perhaps)."""
    if dtype not in (-1, None):
        self = _with_shape(op.Cast(self, to=dtype), self)
    total = op.ReduceSum(self, op.Constant(value_ints=axes), keepdims=1 if keepdim else 0)
    return op.Div(total, _count(self, axes, total))


def _maybe_empty(self, axes: list[int]) -> bool:
    """Whether a reduction over ``axes`` may read no elements: a reduced size is 0 or not static."""
    return any(not isinstance(self.shape[a], int) or self.shape[a] == 0 for a in axes)


@project_rule(aten.mean.dim)
def aten_mean_dim(self, dim: Sequence[int] | None = None, keepdim: bool = False, dtype: int = -1):
    """mean.dim(Tensor self, int[1]? dim, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor"""
    rank = 0 if self.shape is None else len(self.shape)
    axes = _axes(dim, rank) if rank else []
    if axes and _maybe_empty(self, axes):
        return _mean_by_count(self, axes, keepdim, dtype)
    return torchlib_core.aten_mean_dim(self, dim, keepdim, dtype)


@project_rule(aten.mean.default)
def aten_mean(self, dtype: int = -1):
    """mean(Tensor self, *, ScalarType? dtype=None) -> Tensor"""
    rank = 0 if self.shape is None else len(self.shape)
    if rank and _maybe_empty(self, list(range(rank))):
        return _mean_by_count(self, list(range(rank)), False, dtype)
    return torchlib_core.aten_mean(self, dtype)



def _softmax_axes(self, dim: int):
    return op.Constant(value_ints=[dim % len(self.shape)])


@project_rule(aten._softmax.default)
def aten__softmax(self, dim: int, half_to_float: bool):
    """_softmax(Tensor self, int dim, bool half_to_float) -> Tensor"""
    if self.dtype != ir.DataType.FLOAT or len(self.shape) == 0:
        return torchlib_core.aten__softmax(self, dim, half_to_float)
    # ATen's exp(x - max) / sum, spelled out: ONNX Runtime's float32 Softmax flushes results below about 2**-127
    # to 0, where eager keeps the denormal (softmax([0, -90]) is [1, 8.2e-40]), and its Exp keeps them. It costs
    # 2.3x the fused kernel alone (CPU, one thread, [8, 12, 512, 512]: 32 against 14 ms), 2-7% of a causal
    # attention block's training step (d 256, 8 heads, T 256). A guard cannot spare the common case: a causal
    # mask's -inf already spreads a row past the 87 below its maximum where the flush begins.
    axes = _softmax_axes(self, dim)
    e = op.Exp(op.Sub(self, op.ReduceMax(self, axes, keepdims=1)))
    return op.Div(e, op.ReduceSum(e, axes, keepdims=1))


@project_rule(aten._log_softmax.default)
def aten__log_softmax(self, dim: int, half_to_float: bool):
    """_log_softmax(Tensor self, int dim, bool half_to_float) -> Tensor"""
    if self.dtype != ir.DataType.DOUBLE or len(self.shape) == 0:
        return torchlib_core.aten__log_softmax(self, dim, half_to_float)
    # ATen's x - max - log(sum(exp(x - max))), spelled out: ONNX Runtime's float64 LogSoftmax of a row holding
    # +inf gives -inf at its finite entries, where ATen's max makes every entry NaN (its float32 kernel agrees).
    axes = _softmax_axes(self, dim)
    shifted = op.Sub(self, op.ReduceMax(self, axes, keepdims=1))
    return op.Sub(shifted, op.Log(op.ReduceSum(op.Exp(shifted), axes, keepdims=1)))


def _sequential_product(x, axis: int, n: int, keepdim: bool):
    """x's elements along ``axis`` multiplied one after the other, first to last."""
    index = [op.Constant(value_int=i) for i in range(n)]
    product = op.Gather(x, index[0], axis=axis)
    for i in range(1, n):
        product = op.Mul(product, op.Gather(x, index[i], axis=axis))
    return op.Unsqueeze(product, op.Constant(value_ints=[axis])) if keepdim else product


def _in_eager_order(self, axis: int, keepdim: bool):
    """The product over ``axis`` in the order ATen's CPU kernel multiplies, where that order is one after the
    other; else None.

    The order decides what overflow gives: prod([3e38, 3e38, 1, 0]) is inf * 0 = NaN one after the other, 0 in
    ONNX Runtime's ReduceProd, and no rule free of the order exists (eager's [1e-38, 1e-38, 3e38, 3e38] is 0,
    its reverse inf). ATen multiplies one after the other along an axis that is not innermost (its vectors run
    across the outputs), and along an innermost one shorter than 32 (four 8-lane accumulators above). Unrolled,
    so only for static lengths, up to 64."""
    if self.dtype not in _FLOATS or self.shape is None or len(self.shape) == 0:
        return None
    shape = self.shape
    n = shape[axis]
    inner = all(isinstance(d, int) and d == 1 for d in shape[axis + 1:])
    if not isinstance(n, int) or n < 2 or n > (31 if inner else 64):
        return None
    return _sequential_product(self, axis, n, keepdim)


def _integer_product(x, axis: int, keepdim: bool):
    """An int64 product along ``axis`` of static length, exact and wrapping on overflow as ATen's: halves
    multiplied pairwise (a product modulo 2^64 does not depend on the order). ONNX Runtime's int64 ReduceProd
    goes through double and saturates: prod([3, -7, 11, 2, 2^60 + 9, 5]) was -2^63, eager
    -6917529027641102646. None for a symbolic length."""
    n = x.shape[axis] if x.shape is not None else None
    if not isinstance(n, int):
        return None
    axes = op.Constant(value_ints=[axis])
    if n == 0:  # the empty product
        middle = [op.Constant(value_ints=[1])] if keepdim else []
        shape = op.Concat(op.Shape(x, end=axis), *middle, op.Shape(x, start=axis + 1), axis=0)
        return op.Expand(op.CastLike(1, x), shape)
    while n > 1:
        if n % 2:  # a 1 at the end
            last = op.Slice(x, op.Constant(value_ints=[0]), op.Constant(value_ints=[1]), axes)
            x = op.Concat(x, op.Expand(op.CastLike(1, x), op.Shape(last)), axis=axis)
            n += 1
        half = n // 2
        x = op.Mul(op.Slice(x, op.Constant(value_ints=[0]), op.Constant(value_ints=[half]), axes),
                   op.Slice(x, op.Constant(value_ints=[half]), op.Constant(value_ints=[n]), axes))
        n = half
    return x if keepdim else op.Squeeze(x, axes)


@project_rule(aten.prod.dim_int)
def aten_prod_dim_int(self, dim: int, keepdim: bool = False, dtype: int = -1):
    """prod.dim_int(Tensor self, int dim, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor"""
    if _int64_accumulated(self, dtype):
        dtype = ir.DataType.INT64  # ATen's product of integers (and bools) is int64
    if dtype not in (-1, None):
        self = _with_shape(op.Cast(self, to=dtype), self)
        self.dtype = ir.DataType(dtype)
    if self.dtype == ir.DataType.BOOL:  # ReduceProd has no bool kernel: the product of 0s and 1s
        return op.Cast(aten_prod_dim_int(self, dim, keepdim, ir.DataType.INT64), to=ir.DataType.BOOL)
    if self.shape is not None and len(self.shape) == 0:
        return op.Identity(self)  # a 0-d tensor is its own product over dim 0 or -1 (ReduceProd refuses the axis)
    axis = dim % max(len(self.shape), 1) if self.shape else 0
    if self.dtype == ir.DataType.INT64 and self.shape:
        product = _integer_product(self, axis, keepdim)
    else:
        product = _in_eager_order(self, axis, keepdim) if self.shape else None
    return product if product is not None else torchlib_core.aten_prod_dim_int(self, dim, keepdim)


@project_rule(aten.prod.default)
def aten_prod(self, dtype: int = -1):
    """prod(Tensor self, *, ScalarType? dtype=None) -> Tensor"""
    if _int64_accumulated(self, dtype):
        dtype = ir.DataType.INT64  # ATen's product of integers (and bools) is int64
    if dtype not in (-1, None):
        self = _with_shape(op.Cast(self, to=dtype), self)
        self.dtype = ir.DataType(dtype)
    if self.dtype == ir.DataType.BOOL:  # ReduceProd has no bool kernel: the product of 0s and 1s
        return op.Cast(aten_prod(self, ir.DataType.INT64), to=ir.DataType.BOOL)
    integer = self.dtype == ir.DataType.INT64
    if (integer or self.dtype in _FLOATS) and self.shape is not None and len(self.shape) > 0 and all(
            isinstance(d, int) for d in self.shape):
        flat = op.Reshape(self, op.Constant(value_ints=[-1]))
        flat.dtype, flat.shape = self.dtype, ir.Shape([math.prod(self.shape)])
        product = _integer_product(flat, 0, False) if integer else _in_eager_order(flat, 0, False)
        if product is not None:
            return product
    return torchlib_core.aten_prod(self)


@project_rule(aten.topk.default)
def aten_topk(self, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """topk(Tensor self, int k, int dim=-1, bool largest=True, bool sorted=True) -> (Tensor values, Tensor indices)"""
    # ATen treats a 0-d tensor as one element: topk gives it back with index 0 (k 0 or 1). ONNX's TopK needs an
    # axis, and the graph failed to load (it ran in PyTorch).
    if self.shape is not None and len(self.shape) == 0:
        return op.Identity(self), op.Constant(value=ir.tensor(np.array(0, dtype=np.int64)))
    return torchlib_core.aten_topk(self, k, dim, largest, sorted)


# --- segment_reduce: data reduced along ``axis`` in consecutive segments whose lengths (or offsets) are tensor
# data. With K segments over the D positions of the axis, a [outer..., K, D] mask says which positions each
# segment holds, and each reduction is a masked reduction over D (positions past the last segment belong to
# none). ATen's kernel starts each segment's accumulator at ``initial`` (else the reduction's identity): sum,
# prod, max and min fold it in; a mean is (initial + sum) / length, and an empty segment's is initial (NaN
# without one).


def _segments(data, lengths, offsets, axis: int):
    """(mask [outer..., K, D]: whether position d lies in segment k, lengths [outer..., K])."""
    if lengths is not None:
        ends = op.CumSum(lengths, op.Constant(value_int=-1))
        starts = op.Sub(ends, lengths)
    else:
        last = op.Constant(value_ints=[-1])
        starts = op.Slice(offsets, op.Constant(value_ints=[0]), op.Constant(value_ints=[-1]), last)
        ends = op.Slice(offsets, op.Constant(value_ints=[1]), op.Constant(value_ints=[2**62]), last)
        lengths = op.Sub(ends, starts)
    size = op.Squeeze(op.Shape(data, start=axis, end=axis + 1), op.Constant(value_ints=[0]))
    positions = op.Range(op.Constant(value_int=0), size, op.Constant(value_int=1))
    last = op.Constant(value_ints=[-1])
    mask = op.And(op.LessOrEqual(op.Unsqueeze(starts, last), positions), op.Less(positions, op.Unsqueeze(ends, last)))
    return mask, lengths


def _trailing(x, count: int):
    """``x`` with ``count`` axes of size 1 appended (to broadcast over the axes after the segment axis)."""
    if count == 0:
        return x
    return op.Unsqueeze(x, op.Constant(value_ints=list(range(-count, 0))))


def _segment_reduce(data, reduce: str, lengths, offsets, axis: int, initial, rounding):
    rank = len(data.shape)
    axis %= rank
    inner = rank - axis - 1
    mask, lengths = _segments(data, lengths, offsets, axis)
    held = _trailing(mask, inner)  # [outer..., K, D, 1...]
    x = op.Unsqueeze(data, op.Constant(value_ints=[axis]))  # [outer..., 1, D, inner...]
    over = op.Constant(value_ints=[axis + 1])
    like = lambda value: op.CastLike(op.Constant(value_float=float(value)), data)
    if reduce in ("sum", "mean", "prod"):
        # ATen's kernel adds (multiplies) each segment's values in order onto initial, rounding every step in
        # the data's dtype: one Loop over the D positions, each adding its value to the segments holding it.
        combine = op.Mul if reduce == "prod" else op.Add
        start = like((1.0 if reduce == "prod" else 0.0) if initial is None else initial)
        acc = op.Expand(start, op.Concat(op.Shape(lengths), op.Shape(data, start=axis + 1), axis=0))
        acc.dtype = data.dtype

        def step(i, acc):
            value = op.Unsqueeze(op.Gather(data, i, axis=axis), op.Constant(value_ints=[axis]))
            held_here = _trailing(op.Gather(mask, i, axis=-1), inner)
            updated = combine(acc, value)
            if rounding is not None:
                updated = rounded_to(updated, rounding)
            result = op.Where(held_here, updated, acc)
            result.dtype = data.dtype
            return [result]

        size = op.Squeeze(op.Shape(data, start=axis, end=axis + 1), op.Constant(value_ints=[0]))
        (result,) = loop(size, [acc], step, iteration=True)
        if reduce == "mean":
            count = _trailing(op.CastLike(lengths, data), inner)
            empty = like(float("nan") if initial is None else initial)
            mean = op.Div(result, count)
            if rounding is not None:
                mean = rounded_to(mean, rounding)
            result = op.Where(op.Greater(count, like(0.0)), mean, empty)
        return result
    if reduce not in ("max", "min"):
        raise NotImplementedError(f"segment_reduce: no reduction {reduce!r}")
    if initial is not None and math.isnan(initial):
        return op.Expand(like(float("nan")), op.Shape(op.ReduceMax(op.Cast(held, to=ir.DataType.INT32), over, keepdims=0)))
    bound = float("-inf") if reduce == "max" else float("inf")
    reducer, beyond = (op.ReduceMax, op.Greater) if reduce == "max" else (op.ReduceMin, op.Less)
    result = reducer(op.Where(held, x, like(bound)), over, keepdims=0)
    if initial is not None:  # a NaN result stays (the comparison is false)
        result = op.Where(beyond(like(initial), result), like(initial), result)
    # A NaN in a segment is its result, as in ATen's kernel.
    has_nan = op.ReduceMax(op.Cast(op.And(held, op.IsNaN(x)), to=ir.DataType.INT32), over, keepdims=0)
    return op.Where(op.Cast(has_nan, to=ir.DataType.BOOL), like(float("nan")), result)


def _segment_reduce_backward(grad, output, data, reduce: str, lengths, offsets, axis: int, initial, rounding):
    rank = len(data.shape)
    axis %= rank
    inner = rank - axis - 1
    mask, lengths = _segments(data, lengths, offsets, axis)
    as_int = op.Cast(mask, to=ir.DataType.INT32)
    covered = _trailing(op.Cast(op.ReduceMax(as_int, op.Constant(value_ints=[axis]), keepdims=0), to=ir.DataType.BOOL),
                        inner)  # [outer..., D, 1...]
    segment = _trailing(op.ArgMax(as_int, axis=axis, keepdims=0), inner)  # each position's segment (0 if none)
    index = op.Expand(segment, op.Shape(data))

    def at_positions(per_segment):  # [outer..., K, inner...] -> [outer..., D, inner...]: each position's segment's
        return op.GatherElements(per_segment, index, axis=axis)

    like = lambda value: op.CastLike(op.Constant(value_float=float(value)), data)
    g = at_positions(grad)
    if reduce == "mean":
        g = op.Div(g, at_positions(op.Expand(_trailing(op.CastLike(lengths, grad), inner), op.Shape(grad))))
    elif reduce in ("max", "min"):
        # The positions equal to the result, or NaN, take the gradient. ATen's CPU kernel then divides it by
        # their count where there are several, but only where it is positive (it tests grad_input > 0): a
        # negative gradient goes whole to each of the tied positions. That is eager's number, so it is ours.
        result = at_positions(output)
        chosen = op.Or(op.Equal(data, result), op.IsNaN(data))
        held = _trailing(mask, inner)
        counts = at_positions(op.ReduceSum(op.Where(op.And(held, op.Unsqueeze(chosen, op.Constant(value_ints=[axis]))),
                                                    like(1.0), like(0.0)), op.Constant(value_ints=[axis + 1]), keepdims=0))
        shared = op.And(op.Greater(counts, like(1.0)), op.Greater(g, like(0.0)))
        g = op.Where(chosen, op.Where(shared, op.Div(g, counts), g), like(0.0))
    elif reduce == "prod":
        # grad * output / x, except where x is 0 or NaN: there grad times the product of the segment's other
        # values (and initial), as ATen's kernel computes it.
        result = at_positions(output)
        plain = op.Or(op.Equal(data, like(0.0)), op.IsNaN(data))
        segment_of = op.ArgMax(as_int, axis=axis, keepdims=1)  # [outer..., 1, D]
        position = op.Range(op.Constant(value_int=0), op.Squeeze(op.Shape(data, start=axis, end=axis + 1)),
                            op.Constant(value_int=1))
        others = op.And(op.Equal(op.Transpose(segment_of, perm=[*range(axis), axis + 1, axis]), segment_of),
                        op.Not(op.Equal(op.Unsqueeze(position, op.Constant(value_ints=[-1])), position)))
        # others[..., i, j]: position i is another position of j's segment; rows reduced over i
        values = op.Unsqueeze(data, op.Constant(value_ints=[axis + 1]))  # [outer..., D(i), 1, inner...]
        exclusive = op.ReduceProd(op.Where(_trailing(others, inner), values, like(1.0)),
                                  op.Constant(value_ints=[axis]), keepdims=0)
        if initial is not None:
            exclusive = op.Mul(exclusive, like(initial))
        rounded = (lambda v: v) if rounding is None else (lambda v: rounded_to(v, rounding))  # ATen's 16-bit steps
        g = op.Where(plain, rounded(op.Mul(g, exclusive)), rounded(op.Div(rounded(op.Mul(g, result)), data)))
    elif reduce != "sum":
        raise NotImplementedError(f"segment_reduce backward: no reduction {reduce!r}")
    return op.Where(covered, g, like(0.0))


@project_rule(aten.segment_reduce.default)
def aten_segment_reduce(data, reduce: str, *, lengths=None, indices=None, offsets=None, axis: int = 0,
                        unsafe: bool = False, initial=None):
    """segment_reduce(Tensor data, str reduce, *, Tensor? lengths=None, Tensor? indices=None, Tensor? offsets=None, int axis=0, bool unsafe=False, Scalar? initial=None) -> Tensor"""
    if indices is not None or (lengths is None) == (offsets is None):
        raise NotImplementedError("segment_reduce takes lengths or offsets (ATen does not implement indices)")
    rounding = data.dtype if data.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16) else None  # computed in float32
    return opmath(lambda d: _segment_reduce(d, reduce, lengths, offsets, axis, initial, rounding), data)


@project_rule(aten._segment_reduce_backward.default)
def aten__segment_reduce_backward(grad, output, data, reduce: str, *, lengths=None, offsets=None, axis: int = 0,
                                  initial=None):
    """_segment_reduce_backward(Tensor grad, Tensor output, Tensor data, str reduce, *, Tensor? lengths=None, Tensor? offsets=None, int axis=0, Scalar? initial=None) -> Tensor"""
    rounding = data.dtype if data.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16) else None  # computed in float32
    return opmath(lambda g, o, d: _segment_reduce_backward(g, o, d, reduce, lengths, offsets, axis, initial, rounding),
                  grad, output, data)

