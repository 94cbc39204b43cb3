"""Indexing, selection and scatter ops torch_lib does not lower (or lowers wrongly for some shapes)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops import core as torchlib_core

from aot2onnx.lower.checks import CHECK_NEGATIVE_INDEX, runtime_check
from aot2onnx.lower.ops._common import FLOATS, cast, flat, static_dim
from aot2onnx.lower.registry import project_rule

aten = torch.ops.aten



@project_rule(aten.nonzero.default)
def aten_nonzero(self):
    """nonzero(Tensor self) -> Tensor"""
    if len(self.shape) == 0:
        # One row per nonzero element (0 or 1 of them) and no columns, as ATen gives a 0-d input.
        rows = op.Transpose(op.NonZero(op.Reshape(self, op.Constant(value_ints=[1]))), perm=[1, 0])
        return op.Slice(rows, op.Constant(value_ints=[0]), op.Constant(value_ints=[0]), op.Constant(value_ints=[1]))
    return op.Transpose(op.NonZero(self), perm=[1, 0])


@project_rule(aten.masked_select.default)
def aten_masked_select(self, mask):
    """masked_select(Tensor self, Tensor mask) -> Tensor"""
    # Expand broadcasts both ways, so self and mask take their common shape.
    self = op.Expand(self, op.Shape(mask))
    mask = op.Expand(mask, op.Shape(self))
    return op.Compress(flat(self), flat(mask), axis=0)


@project_rule(aten.masked_scatter_backward.default)
def aten_masked_scatter_backward(grad_output, mask, sizes):
    """masked_scatter_backward(Tensor grad_output, Tensor mask, SymInt[] sizes) -> Tensor"""
    # The gradient of masked_scatter's source: the masked elements of grad_output, in order, padded with
    # zeros to the source's size.
    mask = op.Expand(mask, op.Shape(grad_output))
    selected = op.Compress(flat(grad_output), flat(mask), axis=0)
    total = 1
    for size in sizes:
        total *= size
    missing = op.Sub(op.Constant(value_ints=[total]), op.Shape(selected))
    padded = op.Pad(selected, op.Concat(op.Constant(value_ints=[0]), missing, axis=0))
    return op.Reshape(padded, op.Constant(value_ints=list(sizes)))


def _wrapped(index, numel):
    """Negative flat indices counted from the end, as ATen allows."""
    return op.Where(op.Less(index, op.Constant(value_int=0)), op.Add(index, numel), index)


@project_rule(aten.put.default)
def aten_put(self, index, source, accumulate: bool = False):
    """put(Tensor self, Tensor index, Tensor source, bool accumulate=False) -> Tensor"""
    index = _wrapped(flat(op.Cast(index, to=ir.DataType.INT64)), op.Size(self))
    updated = op.ScatterElements(
        flat(self), index, flat(source), axis=0, reduction="add" if accumulate else "none"
    )
    return op.Reshape(updated, op.Shape(self))


def _mean(total, count, floating: bool):
    """total / count (count >= 1) as ATen's scatter and index reductions take a mean: integers divided with
    floor, where ONNX's Div truncates toward zero."""
    quotient = op.Div(total, count)
    if floating:
        return quotient
    remainder = op.Sub(total, op.Mul(quotient, count))
    return op.Sub(quotient, op.CastLike(op.Less(remainder, op.CastLike(0, remainder)), quotient))


@project_rule(aten.index_reduce.default)
def aten_index_reduce(self, dim: int, index, source, reduce: str, include_self: bool = True):
    """index_reduce(Tensor self, int dim, Tensor index, Tensor source, str reduce, *, bool include_self=True) -> Tensor"""
    # scatter_reduce with index naming, for each slice of source along dim, the slice of self it reduces into.
    rank = len(self.shape)
    if rank:
        dim %= rank
        index_shape = [1] * rank
        index_shape[dim] = -1
        index = op.Expand(op.Reshape(index, op.Constant(value_ints=index_shape)), op.Shape(source))
    return _scatter(self, dim, index, source, reduce, "index_reduce", include_self)


def _searchsorted(sorted_sequence, values, out_int32: bool, right: bool, side: str | None, sorter, scalar: bool):
    right = right or side == "right"
    rank = len(sorted_sequence.shape)
    if sorter is not None:
        sorted_sequence = op.GatherElements(sorted_sequence, sorter, axis=-1)
    if rank == 1 or scalar:
        boundaries = sorted_sequence  # [n] broadcasts against values[..., None]
    else:
        boundaries = op.Unsqueeze(sorted_sequence, op.Constant(value_ints=[-2]))  # [..., 1, n]
    probes = op.Unsqueeze(values, op.Constant(value_ints=[-1]))  # [..., m, 1]
    # The insertion point is how many boundaries sort before the value (left) or not after it (right).
    before = op.LessOrEqual(boundaries, probes) if right else op.Less(boundaries, probes)
    if values.dtype in FLOATS:
        # ATen sorts NaN after every number: a NaN value goes after every non-NaN boundary (and, for right,
        # after NaN boundaries too).
        nan_probe = op.IsNaN(probes)
        before = op.Or(before, op.And(nan_probe, op.Not(op.IsNaN(boundaries))) if not right else nan_probe)
    before = op.Cast(before, to=ir.DataType.INT64)
    # One more column of zeros: ONNX Runtime's ReduceSum mis-shapes a reduction over an empty axis.
    before = op.Concat(before, op.Expand(op.Constant(value_ints=[0]), op.Concat(op.Shape(before, end=-1), op.Constant(value_ints=[1]), axis=0)), axis=-1)
    positions = op.ReduceSum(before, op.Constant(value_ints=[-1]), keepdims=0)
    return op.Cast(positions, to=ir.DataType.INT32) if out_int32 else positions


@project_rule(aten.searchsorted.Tensor)
def aten_searchsorted_tensor(sorted_sequence, self, out_int32: bool = False, right: bool = False,
                             side: str | None = None, sorter=None):
    """searchsorted.Tensor(Tensor sorted_sequence, Tensor self, *, bool out_int32=False, bool right=False, str? side=None, Tensor? sorter=None) -> Tensor"""
    return _searchsorted(sorted_sequence, self, out_int32, right, side, sorter, scalar=False)


@project_rule(aten.searchsorted.Scalar)
def aten_searchsorted_scalar(sorted_sequence, self, out_int32: bool = False, right: bool = False,
                             side: str | None = None, sorter=None):
    """searchsorted.Scalar(Tensor sorted_sequence, Scalar self, *, bool out_int32=False, bool right=False, str? side=None, Tensor? sorter=None) -> Tensor"""
    value = op.CastLike(self, sorted_sequence)
    value.dtype = sorted_sequence.dtype
    positions = _searchsorted(sorted_sequence, value, out_int32, right, side, sorter, scalar=True)
    # One position per row of a batched sequence, none for a 1-D one.
    return positions


@project_rule(aten.diagonal.default)
@project_rule(aten.diagonal_copy.default)
def aten_diagonal(self, offset: int = 0, dim1: int = 0, dim2: int = 1):
    """diagonal(Tensor(a) self, int offset=0, int dim1=0, int dim2=1) -> Tensor(a)

    The diagonal gathered from the two dims laid out last. torch_lib's rule multiplied the matrix by an
    identity mask and summed each row: any inf or NaN off the diagonal made the diagonal NaN (torch.diag and
    trace of [[1, inf], [nan, 3]] were NaN, eager [1, 3] and 4), a -0.0 on it became 0.0, and int64 entries
    past 2^53 lost their low bits (ONNX Runtime's int64 ReduceSum goes through double)."""
    rank = len(self.shape)
    dim1, dim2 = dim1 % rank, dim2 % rank
    x = op.Transpose(self, perm=[d for d in range(rank) if d not in (dim1, dim2)] + [dim1, dim2])  # [..., R, C]
    rows, cols = op.Shape(x, start=-2, end=-1), op.Shape(x, start=-1)
    first_row, first_col = op.Constant(value_ints=[max(-offset, 0)]), op.Constant(value_ints=[max(offset, 0)])
    length = op.Max(op.Min(op.Sub(rows, first_row), op.Sub(cols, first_col)), op.Constant(value_ints=[0]))
    k = op.Range(op.Constant(value_int=0), op.Squeeze(length), op.Constant(value_int=1))
    index = op.Add(op.Mul(op.Add(k, first_row), cols), op.Add(k, first_col))  # into the flattened R x C
    matrices = op.Reshape(x, op.Concat(op.Shape(x, end=-2), op.Mul(rows, cols), axis=0), allowzero=1)
    return op.Gather(matrices, index, axis=-1)


@project_rule(aten.diagonal_scatter.default)
def aten_diagonal_scatter(self, src, offset: int = 0, dim1: int = 0, dim2: int = 1):
    """diagonal_scatter(Tensor self, Tensor src, int offset=0, int dim1=0, int dim2=1) -> Tensor"""
    # PyTorch's decomposition writes into a view (prims.copy_to), which AOTAutograd rejects in a
    # functional graph. Here: the two dims first, then one ScatterND at the diagonal's positions.
    rank = len(self.shape)
    dim1, dim2 = dim1 % rank, dim2 % rank
    n1, n2 = self.shape[dim1], self.shape[dim2]
    if not isinstance(n1, int) or not isinstance(n2, int):
        raise NotImplementedError("diagonal_scatter needs static sizes of the two dims")
    length = min(n1, n2 - offset) if offset >= 0 else min(n1 + offset, n2)
    if length <= 0:
        return op.Identity(self)
    perm = [dim1, dim2] + [d for d in range(rank) if d not in (dim1, dim2)]
    inverse = [perm.index(d) for d in range(rank)]
    positions = [[k + max(-offset, 0), k + max(offset, 0)] for k in range(length)]
    updates = op.Transpose(src, perm=[rank - 2] + list(range(rank - 2)))  # the diagonal's axis first
    scattered = op.ScatterND(op.Transpose(self, perm=perm), op.Constant(value=ir.tensor(positions, dtype=ir.DataType.INT64)), updates)
    return op.Transpose(scattered, perm=inverse)


@project_rule(aten.unique_consecutive.default)
def aten_unique_consecutive(self, return_inverse: bool = False, return_counts: bool = False, dim: int | None = None):
    """unique_consecutive(Tensor self, bool return_inverse=False, bool return_counts=False, int? dim=None) -> (Tensor, Tensor, Tensor)"""
    if dim is not None:
        raise NotImplementedError("unique_consecutive along a dim")
    values_in = flat(self)
    n = op.Shape(values_in)
    zero, one = op.Constant(value_ints=[0]), op.Constant(value_ints=[1])
    # An element starts a run where it differs from the one before it (the first always does).
    previous = op.Slice(values_in, zero, op.Sub(n, one))
    current = op.Slice(values_in, one, n)
    starts = op.Concat(op.Constant(value=ir.tensor([True])), op.Not(op.Equal(current, previous)), axis=0)
    starts = op.Slice(starts, zero, n)  # an empty input has no first element
    values = op.Compress(values_in, starts, axis=0)
    empty = op.Constant(value=ir.tensor(np.zeros((0,), dtype=np.int64)))
    inverse = op.Reshape(op.Sub(op.CumSum(op.Cast(starts, to=ir.DataType.INT64), op.Constant(value_int=0)), op.Constant(
        value_int=1)), op.Shape(self)) if return_inverse else empty
    if return_counts:
        first = op.Reshape(op.NonZero(starts), op.Constant(value_ints=[-1]))
        ends = op.Concat(op.Slice(first, one, op.Constant(value_ints=[2**62])), n, axis=0)
        counts = op.Sub(ends, first)
    else:
        counts = op.Identity(empty)
    return values, inverse, counts


_SUM, _MEAN, _MAX = 0, 1, 2  # embedding_bag's modes


@project_rule(aten._embedding_bag.default)
def aten_embedding_bag(weight, indices, offsets, scale_grad_by_freq: bool = False, mode: int = 0, sparse: bool = False,
                       per_sample_weights=None, include_last_offset: bool = False, padding_idx: int = -1):
    """_embedding_bag(Tensor weight, Tensor indices, Tensor offsets, bool scale_grad_by_freq=False, int mode=0, bool sparse=False, Tensor? per_sample_weights=None, bool include_last_offset=False, int padding_idx=-1) -> (Tensor, Tensor, Tensor, Tensor)"""
    # torch_lib computes the bags and returns zeros for offset2bag, bag_size and max_indices. The backward,
    # _embedding_bag_backward (PyTorch's kernel, behind the fallback), reads them: every mean and max
    # gradient, and every gradient with a padding_idx, came out wrong. The bags stay torch_lib's; the other
    # three are ATen's CPU values, in the shapes of its meta function.
    _refuse_negative(indices, "embedding_bag")
    double = weight.dtype == ir.DataType.DOUBLE
    if not double:
        output = torchlib_core.aten_embedding_bag_padding_idx(
            weight, indices, offsets, scale_grad_by_freq, mode, sparse, per_sample_weights, include_last_offset,
            padding_idx if padding_idx >= 0 else None,
        )[0]
    i64 = ir.DataType.INT64
    zero, one = op.Constant(value_ints=[0]), op.Constant(value_ints=[1])
    index, bounds = op.Cast(indices, to=i64), op.Cast(offsets, to=i64)
    n = op.Shape(index)
    starts = op.Slice(bounds, zero, op.Constant(value_ints=[-1])) if include_last_offset else bounds
    ends = op.Concat(op.Slice(starts, one, op.Constant(value_ints=[2**62])), n, axis=0)
    # offset2bag[i] is the bag of index i: a 1 where each bag starts (an empty bag's start is shared with the
    # next), summed up. One slot more, for bags that start at the end.
    marks = op.ScatterElements(op.Expand(zero, op.Add(n, one)), starts, op.Expand(one, op.Shape(starts)),
                               reduction="add")
    offset2bag = op.Sub(op.CumSum(op.Slice(marks, zero, n), op.Constant(value_int=0)), one)
    # A bag's size counts its indices other than padding_idx.
    kept = op.Not(op.Equal(index, op.Constant(value_int=padding_idx))) if padding_idx >= 0 else None
    if kept is None:
        bag_size = op.Sub(ends, starts)
    else:
        before = op.Concat(zero, op.CumSum(op.Cast(kept, to=i64), op.Constant(value_int=0)), axis=0)
        bag_size = op.Sub(op.Gather(before, ends), op.Gather(before, starts))
    position = None
    if double:
        output, position = _bags(weight, index, offset2bag, kept, bag_size, mode, per_sample_weights)
    if mode == _MAX and position is not None:
        max_indices = op.Gather(op.Concat(index, zero, axis=0), position, axis=0)
    elif mode == _MAX:
        # The first index in the bag (a padding index never) whose row holds the bag's maximum, per column;
        # 0 for an empty bag. Positions are compared, n stands for none.
        rows = op.Gather(weight, index, axis=0)
        hit = op.Equal(rows, op.Gather(output, offset2bag, axis=0))
        if kept is not None:
            hit = op.And(hit, op.Unsqueeze(kept, one))
        positions = op.Range(op.Constant(value_int=0), op.Squeeze(n), op.Constant(value_int=1))
        position = op.Where(hit, op.Unsqueeze(positions, one), n)
        first = op.ScatterND(op.Expand(n, op.Shape(output)), op.Unsqueeze(offset2bag, one), position, reduction="min")
        max_indices = op.Gather(op.Concat(index, zero, axis=0), first, axis=0)
    elif mode == _MEAN:
        max_indices = bag_size  # ATen hands bag_size out twice for means
    else:
        # Sums need neither: ATen leaves both zero.
        bag_size = max_indices = op.Expand(zero, op.Shape(starts))
        fast_path = weight.dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16) and padding_idx < 0
        if fast_path:
            # ATen's fast path for sums leaves offset2bag empty (its backward makes its own).
            offset2bag = op.Slice(offset2bag, zero, zero)
    return (output, *(op.CastLike(x, offsets) for x in (offset2bag, bag_size, max_indices)))


def _bags(weight, index, offset2bag, kept, bag_size, mode: int, per_sample_weights):
    """embedding_bag's bags [B, D] as ATen's CPU loop computes them, in weight's dtype, and for a max the
    position (into index, n for an empty bag) each element came from. torch_lib's rule computes in float32
    (its Loop's sequence, for an ONNX Runtime bug), which rounded every float64 bag: this is for float64.

    Sums add each bag's rows (times their per_sample_weights) in index order onto zeros; a mean divides by
    max(bag size, 1). A max starts from the bag's first row and takes a strictly greater value: a NaN first
    stays, a later NaN never counts, and of equal values (-0.0 and 0.0) the first stays. padding_idx's rows
    are left out; an empty bag is 0."""
    one, zero = op.Constant(value_ints=[1]), op.Constant(value_ints=[0])
    count = op.Shape(bag_size)  # [B]
    n = op.Shape(index)
    rows = op.Gather(weight, index, axis=0)  # [n, D]
    if per_sample_weights is not None:
        rows = op.Mul(rows, op.Unsqueeze(op.CastLike(per_sample_weights, weight), one))
    # Rows of padding_idx go to an extra bag B, dropped at the end.
    target = offset2bag if kept is None else op.Where(kept, offset2bag, op.Squeeze(count))
    slots = op.Concat(op.Add(count, one), op.Shape(weight, start=1), axis=0)  # [B + 1, D]
    if mode != _MAX:
        bags = op.ScatterND(op.CastLike(op.ConstantOfShape(slots), weight), op.Unsqueeze(target, one), rows,
                            reduction="add")
        bags = op.Slice(bags, zero, count)
        if mode == _MEAN:
            bags = op.Div(bags, op.CastLike(op.Unsqueeze(op.Max(bag_size, op.Constant(value_int=1)), one), weight))
        return bags, None
    positions = op.Range(op.Constant(value_int=0), op.Squeeze(n), op.Constant(value_int=1))
    zero_row = op.CastLike(op.ConstantOfShape(op.Concat(one, op.Shape(weight, start=1), axis=0)), weight)
    with_zeros = op.Concat(rows, zero_row, axis=0)  # row n: an empty bag's zeros
    first = op.ScatterElements(op.Expand(n, op.Add(count, one)), target, positions, reduction="min")  # [B + 1]
    # The largest value, NaN left out (ONNX Runtime's max takes a NaN update), from the first row on.
    comparable = op.Where(op.IsNaN(rows), op.CastLike(float("-inf"), weight), rows)
    start = op.Gather(op.Concat(comparable, zero_row, axis=0), first, axis=0)
    largest = op.ScatterND(start, op.Unsqueeze(target, one), comparable, reduction="max")
    # Where it first occurs, and its own value there (the sign of a zero).
    hit = op.Equal(comparable, op.Gather(largest, target, axis=0))
    where = op.Where(hit, op.Unsqueeze(positions, one), n)
    position = op.ScatterND(op.Expand(n, slots), op.Unsqueeze(target, one), where, reduction="min")
    first_row = op.Gather(with_zeros, first, axis=0)
    nan_first = op.IsNaN(first_row)
    position = op.Where(nan_first, op.Unsqueeze(first, one), position)
    bags = op.GatherElements(with_zeros, position, axis=0)
    return op.Slice(bags, zero, count), op.Slice(position, zero, count)


@project_rule(aten._embedding_bag_forward_only.default)
def aten_embedding_bag_forward_only(weight, indices, offsets, scale_grad_by_freq: bool = False, mode: int = 0,
                                    sparse: bool = False, per_sample_weights=None, include_last_offset: bool = False,
                                    padding_idx: int = -1):
    """_embedding_bag_forward_only(Tensor weight, Tensor indices, Tensor offsets, bool scale_grad_by_freq=False, int mode=0, bool sparse=False, Tensor? per_sample_weights=None, bool include_last_offset=False, int padding_idx=-1) -> (Tensor, Tensor, Tensor, Tensor)"""
    # What embedding_bag traces to without gradients: the same op (the bags are read; the rest rarely is).
    return aten_embedding_bag(weight, indices, offsets, scale_grad_by_freq, mode, sparse, per_sample_weights,
                              include_last_offset, padding_idx)


# --- ops that refuse a negative index ------------------------------------------------------------------
#
# ATen's embedding, index_select, gather and the scatters raise on an index below 0 ("index out of range in
# self", "index -1 is out of bounds"), where ONNX's Gather, GatherElements and ScatterElements read it from
# the end: an Embedding fed a padding id of -1, or a cross_entropy label of -1 (torch decomposes nll_loss into
# a gather), returned the last row or class and trained on it. Each rule below has the runtime raise where the
# smallest index is negative (lower/checks.py); indices past the end make ONNX Runtime fail the run already.
# (x[i], index_put, take and take_along_dim accept negative indices in ATen, and their decompositions wrap
# them before any gather: their rules are left alone.)


def _refuse_negative(index, api_name: str) -> None:
    smallest = op.ReduceMin(op.Concat(op.Cast(flat(index), to=ir.DataType.INT64), op.Constant(value_ints=[0]), axis=0),
                            keepdims=0)
    smallest.dtype, smallest.shape = ir.DataType.INT64, ir.Shape([])
    runtime_check(smallest, CHECK_NEGATIVE_INDEX, api_name)


def _is_empty(value) -> bool:
    return value.shape is not None and any(d == 0 for d in value.shape)


@project_rule(aten.embedding.default)
def aten_embedding(weight, indices, padding_idx: int = -1, scale_grad_by_freq: bool = False, sparse: bool = False):
    """embedding(Tensor weight, Tensor indices, SymInt padding_idx=-1, bool scale_grad_by_freq=False, bool sparse=False) -> Tensor"""
    _refuse_negative(indices, "embedding")
    return torchlib_core.aten_embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)


@project_rule(aten.index_select.default)
def aten_index_select(self, dim: int, index):
    """index_select(Tensor self, int dim, Tensor index) -> Tensor"""
    _refuse_negative(index, "index_select")
    return torchlib_core.aten_index_select(self, dim, index)


@project_rule(aten.gather.default)
def aten_gather(self, dim: int, index, sparse_grad: bool = False):
    """gather(Tensor self, int dim, Tensor index, *, bool sparse_grad=False) -> Tensor"""
    if _is_empty(index):
        # ATen accepts an empty index of any rank and integer dtype (GatherElements wants self's rank).
        return op.CastLike(op.ConstantOfShape(op.Shape(index)), self)
    _refuse_negative(index, "gather")
    if len(self.shape) == 0:
        return op.Expand(self, op.Shape(index))  # every index is 0 (a 0-d or one-element index)
    scalar_index = len(index.shape) == 0
    index = op.Cast(index, to=ir.DataType.INT64)
    if scalar_index:
        return op.Reshape(op.GatherElements(self, op.Reshape(index, op.Constant(value_ints=[1])), axis=dim),
                          op.Constant(value_ints=[]))
    return op.GatherElements(self, index, axis=dim)


# The scatters: one ScatterElements, with what ONNX Runtime's CPU kernel lacks around it. It has no float16 or
# bfloat16 add or mul, and no bool max or min: those reduce in float32 or int32 and cast back (max and min
# exactly; a float16 sum is rounded once, where ATen rounds at each add). A 0-d self (whose index and source
# are 0-d or one element) scatters as one element. amax and amin propagate NaN as ATen does, whatever order
# ONNX Runtime visits the duplicates in. mean is a sum and a count.
_ONNX_REDUCTION = {"sum": "add", "add": "add", "prod": "mul", "multiply": "mul", "amax": "max", "amin": "min",
                   "mean": "add"}


def _reduction_dtype(dtype: ir.DataType, reduction: str) -> ir.DataType:
    if reduction == "none":
        return dtype
    if dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        return ir.DataType.FLOAT
    if dtype == ir.DataType.BOOL:
        return ir.DataType.INT32
    return dtype


def _identity(reduce: str, dtype: ir.DataType):
    """The value that leaves ``reduce`` unchanged, in ``dtype``: what include_self=False puts in self first."""
    if reduce in ("sum", "mean"):
        value = 0
    elif reduce == "prod":
        value = 1
    else:
        numpy_dtype = dtype.numpy()
        if np.issubdtype(numpy_dtype, np.floating):
            value = -np.inf if reduce == "amax" else np.inf
        else:
            info = np.iinfo(numpy_dtype)
            value = info.min if reduce == "amax" else info.max
    return op.Constant(value=ir.tensor(np.asarray(value, dtype=dtype.numpy())))


def _scatter(self, dim: int, index, src, reduce: str | None, api_name: str, include_self: bool = True):
    """ATen's scatter (``reduce`` None) or scatter_reduce (sum, prod, mean, amax, amin)."""
    if _is_empty(index):
        return op.Identity(self)  # nothing to scatter; ATen accepts an empty index of any rank
    _refuse_negative(index, api_name)
    dtype = self.dtype
    rank, scalar_index = len(self.shape), index.shape is not None and len(index.shape) == 0
    index = op.Cast(index, to=ir.DataType.INT64)
    if rank == 0 or scalar_index:  # one element scattered: everything as [1] (or [1, ..., 1] into self)
        one = op.Constant(value_ints=[1] * max(rank, 1))
        index, src = op.Reshape(index, one), op.Reshape(src, one)
        if rank == 0:
            self, dim = op.Reshape(self, one), 0
    reduction = "none" if reduce is None else _ONNX_REDUCTION[reduce]
    compute = _reduction_dtype(dtype, reduction)
    if compute != dtype:
        self, src = op.Cast(self, to=compute), op.Cast(src, to=compute)
    else:
        src = op.CastLike(src, self)
    if reduce is None:
        result = op.ScatterElements(self, index, src, axis=dim)
    else:
        ones = op.CastLike(op.ConstantOfShape(op.Shape(index), value=ir.tensor([1], dtype=ir.DataType.INT64)), self)
        hits = None
        if not include_self or reduce == "mean":
            zeros = op.CastLike(op.ConstantOfShape(op.Shape(self)), self)
            hits = op.ScatterElements(zeros, index, ones, axis=dim, reduction="add")
        base = self
        if not include_self:
            base = op.Where(op.Greater(hits, op.CastLike(0, hits)), _identity(reduce, compute), self)
        result = op.ScatterElements(base, index, src, axis=dim, reduction=reduction)
        if reduce == "mean":
            count = op.Add(hits, op.CastLike(1, hits)) if include_self else op.Max(hits, op.CastLike(1, hits))
            result = _mean(result, count, compute in FLOATS)
        if reduce in ("amax", "amin") and compute in FLOATS:
            nan_src = op.CastLike(op.IsNaN(src), self)
            nan_base = op.CastLike(op.IsNaN(base), self)
            nans = op.ScatterElements(nan_base, index, nan_src, axis=dim, reduction="add")
            nan = op.CastLike(op.Constant(value_float=float("nan")), self)
            result = op.Where(op.Greater(nans, op.CastLike(0, nans)), nan, result)
    if compute != dtype:
        result = op.Cast(result, to=dtype)
    if rank == 0:
        result = op.Reshape(result, op.Constant(value_ints=[]))
    return result


@project_rule(aten.scatter.src)
def aten_scatter_src(self, dim: int, index, src):
    """scatter.src(Tensor self, int dim, Tensor index, Tensor src) -> Tensor"""
    return _scatter(self, dim, index, src, None, "scatter")


@project_rule(aten.scatter.value)
def aten_scatter_value(self, dim: int, index, value: float):
    """scatter.value(Tensor self, int dim, Tensor index, Scalar value) -> Tensor"""
    return _scatter(self, dim, index, op.Expand(op.CastLike(value, self), op.Shape(index)), None, "scatter")


@project_rule(aten.scatter.reduce)
def aten_scatter_reduce_(self, dim: int, index, src, reduce: str):
    """scatter.reduce(Tensor self, int dim, Tensor index, Tensor src, *, str reduce) -> Tensor"""
    return _scatter(self, dim, index, src, reduce, "scatter")


@project_rule(aten.scatter.value_reduce)
def aten_scatter_value_reduce(self, dim: int, index, value: float, reduce: str):
    """scatter.value_reduce(Tensor self, int dim, Tensor index, Scalar value, *, str reduce) -> Tensor"""
    return _scatter(self, dim, index, op.Expand(op.CastLike(value, self), op.Shape(index)), reduce, "scatter")


@project_rule(aten.scatter_add.default)
def aten_scatter_add(self, dim: int, index, src):
    """scatter_add(Tensor self, int dim, Tensor index, Tensor src) -> Tensor"""
    return _scatter(self, dim, index, src, "sum", "scatter_add")


@project_rule(aten.scatter_reduce.two)
def aten_scatter_reduce_two(self, dim: int, index, src, reduce: str, include_self: bool = True):
    """scatter_reduce.two(Tensor self, int dim, Tensor index, Tensor src, str reduce, *, bool include_self=True) -> Tensor"""
    return _scatter(self, dim, index, src, reduce, "scatter_reduce", include_self)


def _index_scatter(self, dim: int, index, source, reduction: str, api_name: str, alpha: float = 1):
    """index_add and index_copy: the slices of ``source`` along ``dim`` into those of ``self`` that ``index``
    names, as one ScatterND on ``dim`` moved to the front. (Lowered whole rather than through torch's
    decomposition, an index_put, which reads a negative index from the end where ATen refuses it.)"""
    _refuse_negative(index, api_name)
    dtype, rank = self.dtype, len(self.shape)
    compute = _reduction_dtype(dtype, reduction)
    if rank == 0:  # a 0-d self takes a one-element index and source
        self, source = op.Reshape(self, op.Constant(value_ints=[1])), op.Reshape(source, op.Constant(value_ints=[1]))
    elif source.shape is not None and len(source.shape) == 0:
        source = op.Reshape(source, op.Constant(value_ints=[1] * rank))
    dim %= max(rank, 1)
    perm = [dim, *(d for d in range(rank) if d != dim)]
    if dim:
        self, source = op.Transpose(self, perm=perm), op.Transpose(source, perm=perm)
    if compute != dtype:
        self, source = op.Cast(self, to=compute), op.Cast(source, to=compute)
    if alpha != 1:  # (bool: in int32, so a False alpha adds nothing)
        source = op.Mul(source, op.CastLike(alpha, source))
    positions = op.Reshape(op.Cast(index, to=ir.DataType.INT64), op.Constant(value_ints=[-1, 1]))
    result = op.ScatterND(self, positions, op.CastLike(source, self), reduction=reduction)
    if compute != dtype:
        result = op.Cast(result, to=dtype)
    if dim:
        result = op.Transpose(result, perm=[int(d) for d in np.argsort(perm)])
    if rank == 0:
        result = op.Reshape(result, op.Constant(value_ints=[]))
    return result


def _index(self, indices):
    # ONNX's GatherND takes int64 indices only, and torchlib's aten_index gathers with the index as given: an int32
    # index (ATen takes long, int, byte and bool) made a model ONNX Runtime refused to load. byte and bool are
    # masks, left to torchlib.
    indices = [cast(i, ir.DataType.INT64) if i is not None and i.dtype == ir.DataType.INT32 else i for i in indices]
    return torchlib_core.aten_index(self, indices)


@project_rule(aten.index.Tensor)
def aten_index(self, indices):
    """index.Tensor(Tensor self, Tensor?[] indices) -> Tensor"""
    return _index(self, indices)


@project_rule(aten._unsafe_index.Tensor)
def aten__unsafe_index(self, indices):
    """_unsafe_index.Tensor(Tensor self, Tensor?[] indices) -> Tensor"""
    return _index(self, indices)


def _index_put(self, indices, values, accumulate: bool):
    # ONNX's ScatterND takes int64 indices only; ATen takes int32 too (unfold's backward makes them).
    indices = [i if i is None or i.dtype in (ir.DataType.INT64, ir.DataType.BOOL) else cast(i, ir.DataType.INT64)
               for i in indices]
    return torchlib_core.aten_index_put(self, indices, values, accumulate)


@project_rule(aten.index_put.default)
def aten_index_put(self, indices, values, accumulate: bool = False):
    """index_put(Tensor self, Tensor?[] indices, Tensor values, bool accumulate=False) -> Tensor"""
    return _index_put(self, indices, values, accumulate)


@project_rule(aten._unsafe_index_put.default)
def aten__unsafe_index_put(self, indices, values, accumulate: bool = False):
    """_unsafe_index_put(Tensor self, Tensor?[] indices, Tensor values, bool accumulate=False) -> Tensor"""
    return _index_put(self, indices, values, accumulate)


@project_rule(aten.index_add.default)
def aten_index_add(self, dim: int, index, source, alpha: float = 1):
    """index_add(Tensor self, int dim, Tensor index, Tensor source, *, Scalar alpha=1) -> Tensor"""
    return _index_scatter(self, dim, index, source, "add", "index_add", alpha)


@project_rule(aten.index_copy.default)
def aten_index_copy(self, dim: int, index, source):
    """index_copy(Tensor self, int dim, Tensor index, Tensor source) -> Tensor"""
    return _index_scatter(self, dim, index, source, "none", "index_copy")


def _index_fill(self, dim: int, index, value):
    # ATen's index_fill reads a negative index from the end (torch's decomposition, an index_copy, would refuse
    # it): wrapped here once, so an index below -size is still refused.
    rank = len(self.shape)
    dim %= max(rank, 1)
    size = op.Shape(self, start=dim, end=dim + 1) if rank else op.Constant(value_ints=[1])
    index = op.Reshape(op.Cast(index, to=ir.DataType.INT64), op.Constant(value_ints=[-1]))
    index = _wrapped(index, size)
    if rank:
        shape = op.Concat(op.Shape(self, end=dim), op.Shape(index), op.Shape(self, start=dim + 1), axis=0)
    else:
        shape = op.Shape(index)
    source = op.Expand(op.CastLike(value, self), shape)
    return _index_scatter(self, dim, index, source, "none", "index_fill")


@project_rule(aten.index_fill.int_Scalar)
def aten_index_fill_int_scalar(self, dim: int, index, value: float):
    """index_fill.int_Scalar(Tensor self, int dim, Tensor index, Scalar value) -> Tensor"""
    return _index_fill(self, dim, index, value)


@project_rule(aten.index_fill.int_Tensor)
def aten_index_fill_int_tensor(self, dim: int, index, value):
    """index_fill.int_Tensor(Tensor self, int dim, Tensor index, Tensor value) -> Tensor"""
    return _index_fill(self, dim, index, value)


@project_rule(aten.nonzero_static.default)
def aten_nonzero_static(self, *, size: int, fill_value: int = -1):
    """nonzero_static(Tensor self, *, SymInt size, int fill_value=-1) -> Tensor"""
    # nonzero's [k, rank] indices, cut to ``size`` rows or filled up to it with rows of fill_value.
    rank = len(self.shape)
    fill = op.Expand(op.Constant(value_int=fill_value), op.Constant(value_ints=[size, rank]))
    if rank == 0:
        return fill  # [size, 0]
    # NonZero of a bool (ONNX Runtime has no float64 NonZero kernel); a NaN is nonzero, as in ATen
    held = self if self.dtype == ir.DataType.BOOL else op.Not(op.Equal(self, op.CastLike(op.Constant(value_int=0), self)))
    found = op.Transpose(op.NonZero(held), perm=[1, 0])
    return op.Slice(op.Concat(found, fill, axis=0), op.Constant(value_ints=[0]), op.Constant(value_ints=[size]),
                    op.Constant(value_ints=[0]))


# --- embedding_bag's backward (dense).


def _offset2bag(indices, offsets, offset2bag):
    """Each index's bag: the forward's offset2bag, or (ATen's fast path for sums leaves it empty) made from the
    offsets as the forward makes it. A last offset equal to the number of indices (include_last_offset) marks
    the extra slot, which is dropped."""
    if static_dim(offset2bag, 0) != 0 or static_dim(indices, 0) == 0:
        return op.Cast(offset2bag, to=ir.DataType.INT64)
    zero, one = op.Constant(value_ints=[0]), op.Constant(value_ints=[1])
    n, starts = op.Shape(indices), op.Cast(offsets, to=ir.DataType.INT64)
    marks = op.ScatterElements(op.Expand(zero, op.Add(n, one)), starts, op.Expand(one, op.Shape(starts)), reduction="add")
    return op.Sub(op.CumSum(op.Slice(marks, zero, n), op.Constant(value_int=0)), one)


@project_rule(aten._embedding_bag_backward.default)
def aten__embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights: int,
                                 scale_grad_by_freq: bool, mode: int, sparse: bool, per_sample_weights,
                                 padding_idx: int = -1):
    """_embedding_bag_backward(Tensor grad, Tensor indices, Tensor offsets, Tensor offset2bag, Tensor bag_size, Tensor maximum_indices, SymInt num_weights, bool scale_grad_by_freq, int mode, bool sparse, Tensor? per_sample_weights, int padding_idx=-1) -> Tensor"""
    if sparse:
        raise NotImplementedError("embedding_bag with sparse=True (a sparse gradient)")
    one = op.Constant(value_ints=[1])
    rows = op.Concat(op.Constant(value_ints=[num_weights]), op.Shape(grad, start=1), axis=0)
    zeros = op.CastLike(op.ConstantOfShape(rows), grad)
    if mode == _MAX:
        # Each column's gradient goes to the row its maximum came from; empty bags give nothing (ATen skips
        # them), here by adding 0 to row 0.
        nonempty = op.Unsqueeze(op.Greater(op.Cast(bag_size, to=ir.DataType.INT64), op.Constant(value_int=0)), one)
        where = op.Where(nonempty, op.Cast(maximum_indices, to=ir.DataType.INT64), op.Constant(value_int=0))
        updates = op.Where(nonempty, grad, op.CastLike(op.Constant(value_float=0.0), grad))
        return op.ScatterElements(zeros, where, updates, axis=0, reduction="add")
    index = op.Cast(indices, to=ir.DataType.INT64)
    bag = _offset2bag(indices, offsets, offset2bag)
    updates = op.Gather(grad, bag, axis=0)  # [n, D]: each index's bag's gradient
    scale = None
    if per_sample_weights is not None:
        scale = op.CastLike(per_sample_weights, grad)
    if mode == _MEAN:
        size = op.CastLike(op.Gather(op.Cast(bag_size, to=ir.DataType.INT64), bag, axis=0), grad)
        scale = op.Reciprocal(size) if scale is None else op.Div(scale, size)
    if scale_grad_by_freq:
        # ATen's CPU kernel walks the distinct indices in sorted order and divides the k-th distinct index's
        # gradient by counts[sorted[k]], the count of the k-th element of the sorted indices (where the k-th
        # group's first element was meant): right up to the first repeated index, another index's count after
        # it. Those are eager's numbers, so they are ours.
        counts = op.ScatterElements(op.Expand(op.Constant(value_int=0), op.Constant(value_ints=[num_weights])), index,
                                    op.Expand(op.Constant(value_int=1), op.Shape(index)), reduction="add")
        distinct_before = op.CumSum(op.Cast(op.Greater(counts, op.Constant(value_int=0)), to=ir.DataType.INT64),
                                    op.Constant(value_int=0), exclusive=1)
        ascending, _ = op.TopK(index, op.Shape(index), largest=0, sorted=1)
        group_start = op.Gather(ascending, op.Gather(distinct_before, index, axis=0), axis=0)
        frequency = op.CastLike(op.Gather(counts, group_start, axis=0), grad)
        scale = op.Reciprocal(frequency) if scale is None else op.Div(scale, frequency)
    if scale is not None:
        updates = op.Mul(updates, op.Unsqueeze(scale, one))
    if padding_idx >= 0:
        updates = op.Where(op.Unsqueeze(op.Equal(index, op.Constant(value_int=padding_idx)), one),
                           op.CastLike(op.Constant(value_float=0.0), grad), updates)
    return op.ScatterND(zeros, op.Unsqueeze(index, one), updates, reduction="add")


@project_rule(aten._embedding_bag_per_sample_weights_backward.default)
def aten__embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode: int,
                                                    padding_idx: int = -1):
    """_embedding_bag_per_sample_weights_backward(Tensor grad, Tensor weight, Tensor indices, Tensor offsets, Tensor offset2bag, int mode, int padding_idx=-1) -> Tensor"""
    # The gradient of index i's weight: its row of the table dotted with its bag's gradient (0 at padding_idx).
    if mode != _SUM:
        raise NotImplementedError("per_sample_weights are for mode='sum' only")
    index = op.Cast(indices, to=ir.DataType.INT64)
    bag = _offset2bag(indices, offsets, offset2bag)
    dots = op.ReduceSum(op.Mul(op.Gather(grad, bag, axis=0), op.Gather(op.CastLike(weight, grad), index, axis=0)),
                        op.Constant(value_ints=[1]), keepdims=0)
    if padding_idx >= 0:
        dots = op.Where(op.Equal(index, op.Constant(value_int=padding_idx)), op.CastLike(op.Constant(value_float=0.0), grad), dots)
    return dots
