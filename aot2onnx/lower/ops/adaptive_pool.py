"""Adaptive pooling, forward and backward.

An adaptive pool's output cell o along a dim of size n (out cells m) covers [floor(o n / m), ceil((o+1) n / m)).
Average pooling sums each cell's region and divides, as ATen: where the cells divide the input evenly by a
reshape and a ReduceSum, otherwise by a product with a 0/1 matrix per spatial dim, and where that meets an
inf or NaN (which it would spread to every cell as inf * 0) by gathering each region. Max pooling compares
each cell's region at once through a static (cells x positions) membership mask. Max-pool backward scatters
the gradient to the recorded flat positions within each plane.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op

from aot2onnx.lower.ops._common import FLOATS, planes, scatter_add_to_planes
from aot2onnx.lower.ops._control import cond
from aot2onnx.lower.registry import project_rule

aten = torch.ops.aten



def _regions(size: int, out: int) -> list[tuple[int, int]]:
    return [(math.floor(o * size / out), math.ceil((o + 1) * size / out)) for o in range(out)]


def _static(sizes, what: str) -> list[int]:
    sizes = list(sizes)
    if not all(isinstance(s, int) for s in sizes):
        raise NotImplementedError(f"adaptive pooling needs static {what}")
    return sizes


def along(x, rank: int, dim: int, matrix: np.ndarray, like):
    """Multiplies x's ``dim`` axis by ``matrix`` [new, old]: y[..., o, ...] = sum_i matrix[o, i] x[..., i, ...]."""
    # x as [before, old, after], so that matrix @ x broadcasts over ``before`` with no transposes.
    one = op.Constant(value_ints=[1])
    before = op.ReduceProd(op.Concat(one, op.Shape(x, end=dim), axis=0), keepdims=1)
    after = op.ReduceProd(op.Concat(one, op.Shape(x, start=dim + 1), axis=0), keepdims=1)
    x3 = op.Reshape(x, op.Concat(before, op.Constant(value_ints=[matrix.shape[1]]), after, axis=0))
    weights = op.CastLike(op.Constant(value=ir.tensor(matrix.astype(np.float64))), like)
    # Expanded to [before, new, old]: ONNX Runtime's MatMul cannot broadcast a 2-D operand over an empty batch.
    weights = op.Expand(weights, op.Concat(before, op.Constant(value_ints=list(matrix.shape)), axis=0))
    y3 = op.MatMul(weights, x3)
    shape = op.Concat(op.Shape(x, end=dim), op.Constant(value_ints=[matrix.shape[0]]), op.Shape(x, start=dim + 1), axis=0)
    return op.Reshape(y3, shape)


def _sum_windows(x, windows: list[list[list[int]]]):
    """y[..., o_1, .., o_s] = the sum of x over the positions windows[0][o_1] x .. x windows[s-1][o_s] of
    its last s dims: each output adds only its own elements, so that an inf or NaN stays in its windows.

    A dim cut into equal consecutive windows is only reshaped ([n] as [m, n / m]); any other is gathered
    ([n] as [m, slots], a window shorter than slots filled out by its first position, masked to 0). Then
    one ReduceSum over the slot axes.
    """
    spatial = len(windows)
    lead = op.Shape(x, end=-spatial)
    split, axes, mask = [], [], np.ones([], dtype=bool)
    for i, dim_windows in enumerate(windows):
        m, slots = len(dim_windows), max(len(w) for w in dim_windows)
        if dim_windows != [list(range(o * slots, (o + 1) * slots)) for o in range(m)]:
            index = np.array([[w[j] if j < len(w) else w[0] for j in range(slots)] for w in dim_windows])
            x = op.Gather(x, op.Constant(value=ir.tensor(index.reshape(-1))), axis=i - spatial)
        mask = np.multiply.outer(mask, np.array([[j < len(w) for j in range(slots)] for w in dim_windows]))
        # Axes of size 1 left out: ONNX Runtime reduces [N, C, 7, 7] over its last two axes about six times
        # faster than [N, C, 1, 7, 1, 7] over two of its axes.
        split += [m] if m > 1 else []
        if slots > 1:
            axes.append(len(split))
            split.append(slots)
    if not axes:  # every window a single position: the gathers were all
        return x
    x = op.Reshape(x, op.Concat(lead, op.Constant(value_ints=split), axis=0))
    if not mask.all():
        x = op.Where(op.Constant(value=ir.tensor(mask.reshape(split))), x, op.CastLike(0.0, x))
    x = op.ReduceSum(x, op.Constant(value_ints=[a - len(split) for a in axes]), keepdims=0)
    return op.Reshape(x, op.Concat(lead, op.Constant(value_ints=[len(w) for w in windows]), axis=0))


def _spread_evenly(x, outs: list[int], sizes: list[int]):
    """x [..., m_1, .., m_s] repeated n_i / m_i times along each of its last s dims, into [..., n_1, .., n_s]."""
    spatial = len(sizes)
    lead = op.Shape(x, end=-spatial)
    split = [d for m, n in zip(outs, sizes) for d in (m, n // m)]
    x = op.Reshape(x, op.Concat(lead, op.Constant(value_ints=[d for m in outs for d in (m, 1)]), axis=0))
    x = op.Expand(x, op.Concat(lead, op.Constant(value_ints=split), axis=0))
    return op.Reshape(x, op.Concat(lead, op.Constant(value_ints=sizes), axis=0))


def _divide_by_counts(x, counts: list[list[int]]):
    """x [..., m_1, .., m_s] / counts[0][o_1] / .. / counts[s-1][o_s], in that order, as ATen's sum / kh / kw.
    Adding 0.0 first makes a zero +0.0, as ATen's sums, which start from 0, give."""
    x = op.Add(x, op.CastLike(0.0, x))
    spatial = len(counts)
    for i, dim_counts in enumerate(counts):
        if any(c != 1 for c in dim_counts):
            divisor = np.array(dim_counts, dtype=np.float64).reshape([len(dim_counts)] + [1] * (spatial - 1 - i))
            x = op.Div(x, op.CastLike(op.Constant(value=ir.tensor(divisor)), x))
    return x


def _membership(size: int, out: int) -> np.ndarray:
    """[out, size]: 1 where input position i lies in output cell o's region."""
    matrix = np.zeros((out, size))
    for o, (start, end) in enumerate(_regions(size, out)):
        matrix[o, start:end] = 1.0
    return matrix


def _exact_where_nonfinite(check, fast, exact, dtype: ir.DataType):
    """``fast`` where ``check`` is finite, else ``exact()``, which runs only then.

    ``fast`` is a product with 0/1 matrices: right for finite values, but an inf or NaN times the 0 of
    another window is NaN, and it reaches every output. So ``check`` can be that product itself, or its
    (smaller) finite input.
    """
    total = op.ReduceSum(check, keepdims=0)
    nonfinite = op.Or(op.IsNaN(total), op.IsInf(total))

    def exact_():
        value = exact()
        value.dtype = dtype
        return [value]

    fast.dtype = dtype
    return cond(nonfinite, exact_, lambda: [fast], exact_then=True)[0]


def _adaptive_avg(self, output_size: Sequence[int]):
    # ATen: each cell's sum, in row-major order, / kh / kw.
    rank, spatial = len(self.shape), len(output_size)
    sizes = _static(self.shape[-spatial:], "input sizes")
    outs = _static(output_size, "output sizes")
    regions = [_regions(size, out) for size, out in zip(sizes, outs)]
    counts = [[end - start for start, end in dim] for dim in regions]

    def exact():
        return _divide_by_counts(_sum_windows(self, [[list(range(*r)) for r in dim] for dim in regions]), counts)

    if all(size % out == 0 for size, out in zip(sizes, outs)):  # a reshape and a ReduceSum
        return exact()
    # Uneven windows: a Gather along the last axis, which ONNX Runtime copies element by element, would
    # make the exact sums many times slower than a product with 0/1 matrices (72 ms against 1.2 ms for
    # [8, 64, 56, 56] to 5x7), which is right unless a value is not finite.
    total = self
    for i, (size, out) in enumerate(zip(sizes, outs)):
        total = along(total, rank, rank - spatial + i, _membership(size, out), self)
    average = _divide_by_counts(total, counts)
    return _exact_where_nonfinite(average, average, exact, self.dtype)


def _adaptive_avg_backward(grad_output, self, spatial: int):
    # ATen adds grad_output / kh / kw at every position of the cell's region: each input position sums the
    # shares of the cells whose regions hold it.
    rank = len(self.shape)
    sizes = _static(self.shape[-spatial:], "input sizes")
    outs = _static(grad_output.shape[-spatial:], "output sizes")
    regions = [_regions(size, out) for size, out in zip(sizes, outs)]
    share = _divide_by_counts(grad_output, [[end - start for start, end in dim] for dim in regions])
    if all(size % out == 0 for size, out in zip(sizes, outs)):
        return _spread_evenly(share, outs, sizes)

    def exact():
        return _sum_windows(share, [[[o for o, (start, end) in enumerate(dim) if start <= i < end]
                                     for i in range(size)] for size, dim in zip(sizes, regions)])

    grad = share
    for i, (size, out) in enumerate(zip(sizes, outs)):
        grad = along(grad, rank, rank - spatial + i, _membership(size, out).T, grad_output)
    return _exact_where_nonfinite(grad_output, grad, exact, grad_output.dtype)


@project_rule(aten._adaptive_avg_pool2d.default)
def aten__adaptive_avg_pool2d(self, output_size: Sequence[int]):
    """_adaptive_avg_pool2d(Tensor self, SymInt[2] output_size) -> Tensor"""
    return _adaptive_avg(self, output_size)


@project_rule(aten._adaptive_avg_pool3d.default)
def aten__adaptive_avg_pool3d(self, output_size: Sequence[int]):
    """_adaptive_avg_pool3d(Tensor self, SymInt[3] output_size) -> Tensor"""
    return _adaptive_avg(self, output_size)


@project_rule(aten._adaptive_avg_pool2d_backward.default)
def aten__adaptive_avg_pool2d_backward(grad_output, self):
    """_adaptive_avg_pool2d_backward(Tensor grad_output, Tensor self) -> Tensor"""
    return _adaptive_avg_backward(grad_output, self, 2)


@project_rule(aten._adaptive_avg_pool3d_backward.default)
def aten__adaptive_avg_pool3d_backward(grad_output, self):
    """_adaptive_avg_pool3d_backward(Tensor grad_output, Tensor self) -> Tensor"""
    return _adaptive_avg_backward(grad_output, self, 3)


def _adaptive_max(self, output_size: Sequence[int]):
    spatial = len(output_size)
    sizes = _static(self.shape[-spatial:], "input sizes")
    outs = _static(output_size, "output sizes")
    # membership[o, i]: input position i (row-major) lies in output cell o's region.
    axes = [np.zeros((out, size), dtype=bool) for size, out in zip(sizes, outs)]
    for axis, size, out in zip(axes, sizes, outs):
        for o, (start, end) in enumerate(_regions(size, out)):
            axis[o, start:end] = True
    membership = axes[0]
    for axis in axes[1:]:
        membership = (membership[:, None, :, None] & axis[None, :, None, :]).reshape(
            membership.shape[0] * axis.shape[0], membership.shape[1] * axis.shape[1]
        )
    mask = op.Constant(value=ir.tensor(membership))
    flat = op.Unsqueeze(planes(self, spatial), op.Constant(value_ints=[-2]))  # [..., 1, positions]
    if self.dtype in FLOATS:
        fill = op.CastLike(op.Constant(value_float=float("-inf")), self)
    else:
        fill = op.ReduceMin(self, keepdims=0)
    candidates = op.Where(mask, flat, fill)  # [..., cells, positions]
    last = op.Constant(value_ints=[-1])
    indices = op.ArgMax(candidates, axis=-1, keepdims=0)  # the first maximum, as ATen's row-major scan
    if self.dtype in FLOATS:
        # A region of only -inf ties with the fill outside it; ATen's index is then the region's first.
        best = op.Squeeze(op.GatherElements(candidates, op.Unsqueeze(indices, last), axis=-1), last)
        first = op.Constant(value=ir.tensor(membership.argmax(axis=1).astype(np.int64)))
        indices = op.Where(op.Equal(best, fill), first, indices)
    # The value at that index, not ReduceMax's: of -0.0 and 0.0 in a region that may give either, ATen the first.
    values = op.GatherElements(planes(self, spatial), indices, axis=-1)
    if self.dtype in FLOATS:
        # A NaN wins its region (ATen keeps the last NaN it meets).
        nans = op.And(mask, op.IsNaN(flat))
        positions = op.Range(op.Constant(value_int=0), op.Constant(value_int=membership.shape[1]), op.Constant(value_int=1))
        last_nan = op.ReduceMax(op.Where(nans, positions, op.Constant(value_int=-1)), last, keepdims=0)
        has_nan = op.GreaterOrEqual(last_nan, op.Constant(value_int=0))
        values = op.Where(has_nan, op.CastLike(op.Constant(value_float=float("nan")), self), values)
        indices = op.Where(has_nan, last_nan, indices)
    shape = op.Concat(op.Shape(self, end=-spatial), op.Constant(value_ints=outs), axis=0)
    return op.Reshape(values, shape), op.Reshape(indices, shape)


@project_rule(aten.adaptive_max_pool2d.default)
def aten_adaptive_max_pool2d(self, output_size: Sequence[int]):
    """adaptive_max_pool2d(Tensor self, int[2] output_size) -> (Tensor, Tensor)"""
    return _adaptive_max(self, output_size)


@project_rule(aten.adaptive_max_pool3d.default)
def aten_adaptive_max_pool3d(self, output_size: Sequence[int]):
    """adaptive_max_pool3d(Tensor self, int[3] output_size) -> (Tensor, Tensor)"""
    return _adaptive_max(self, output_size)


@project_rule(aten.adaptive_max_pool2d_backward.default)
def aten_adaptive_max_pool2d_backward(grad_output, self, indices):
    """adaptive_max_pool2d_backward(Tensor grad_output, Tensor self, Tensor indices) -> Tensor"""
    return scatter_add_to_planes(grad_output, self, indices, 2)


@project_rule(aten.adaptive_max_pool3d_backward.default)
def aten_adaptive_max_pool3d_backward(grad_output, self, indices):
    """adaptive_max_pool3d_backward(Tensor grad_output, Tensor self, Tensor indices) -> Tensor"""
    return scatter_add_to_planes(grad_output, self, indices, 3)
