"""Adaptive pooling, forward and backward.

An adaptive pool's output cell o along a dim of size n (out cells m) covers [floor(o n / m), ceil((o+1) n / m)).
Average pooling is separable: a matrix per spatial dim, applied with MatMul. Max pooling compares each
cell's region at once through a static (cells x positions) membership mask. Max-pool backward scatters
the gradient to the recorded flat positions within each plane.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op

from aot2onnx.lower.ops.pool import _planes, _scatter_add_to_planes
from aot2onnx.lower.registry import project_rule

aten = torch.ops.aten

_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


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


def _average_matrix(size: int, out: int) -> np.ndarray:
    matrix = np.zeros((out, size))
    for o, (start, end) in enumerate(_regions(size, out)):
        matrix[o, start:end] = 1.0 / (end - start)
    return matrix


def _adaptive_avg(self, output_size: Sequence[int]):
    rank, spatial = len(self.shape), len(output_size)
    sizes = _static(self.shape[-spatial:], "input sizes")
    x = self
    for i, (size, out) in enumerate(zip(sizes, _static(output_size, "output sizes"))):
        x = along(x, rank, rank - spatial + i, _average_matrix(size, out), self)
    return x


def _adaptive_avg_backward(grad_output, self, spatial: int):
    rank = len(self.shape)
    sizes = _static(self.shape[-spatial:], "input sizes")
    outs = _static(grad_output.shape[-spatial:], "output sizes")
    grad = grad_output
    for i, (size, out) in enumerate(zip(sizes, outs)):
        grad = along(grad, rank, rank - spatial + i, _average_matrix(size, out).T, grad_output)
    return grad


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
    flat = op.Unsqueeze(_planes(self, spatial), op.Constant(value_ints=[-2]))  # [..., 1, positions]
    if self.dtype in _FLOATS:
        fill = op.CastLike(op.Constant(value_float=float("-inf")), self)
    else:
        fill = op.ReduceMin(self, keepdims=0)
    candidates = op.Where(mask, flat, fill)  # [..., cells, positions]
    last = op.Constant(value_ints=[-1])
    values = op.ReduceMax(candidates, last, keepdims=0)
    indices = op.ArgMax(candidates, axis=-1, keepdims=0)  # the first maximum, as ATen's row-major scan
    if self.dtype in _FLOATS:
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
    return _scatter_add_to_planes(grad_output, self, indices, 2)


@project_rule(aten.adaptive_max_pool3d_backward.default)
def aten_adaptive_max_pool3d_backward(grad_output, self, indices):
    """adaptive_max_pool3d_backward(Tensor grad_output, Tensor self, Tensor indices) -> Tensor"""
    return _scatter_add_to_planes(grad_output, self, indices, 3)
