"""Pairwise distances (cdist, pdist) and _trilinear (what nn.functional.bilinear decomposes to)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op

from aot2onnx.lower.registry import project_rule

aten = torch.ops.aten


def _norm_last(diff, p: float):
    """The p-norm over the last axis, as ATen's cdist defines it (p = 0 counts nonzeros)."""
    last = op.Constant(value_ints=[-1])
    magnitude = op.Abs(diff)
    if p == 0:
        return op.ReduceSum(op.CastLike(op.Not(op.Equal(diff, op.CastLike(0.0, diff))), diff), last, keepdims=0)
    if math.isinf(p):
        return op.ReduceMax(magnitude, last, keepdims=0)
    if p == 1:
        return op.ReduceSum(magnitude, last, keepdims=0)
    if p == 2:
        return op.Sqrt(op.ReduceSum(op.Mul(diff, diff), last, keepdims=0))
    total = op.ReduceSum(op.Pow(magnitude, op.CastLike(p, diff)), last, keepdims=0)
    return op.Pow(total, op.CastLike(1.0 / p, diff))


def _pairwise(x1, x2, p: float):
    # x1 [..., P, M], x2 [..., R, M] -> [..., P, R]
    diff = op.Sub(op.Unsqueeze(x1, op.Constant(value_ints=[-2])), op.Unsqueeze(x2, op.Constant(value_ints=[-3])))
    return _norm_last(diff, p)


@project_rule(aten._cdist_forward.default)
def aten__cdist_forward(x1, x2, p: float, compute_mode: int | None = None):
    """_cdist_forward(Tensor x1, Tensor x2, float p, int? compute_mode) -> Tensor"""
    return _pairwise(x1, x2, p)


@project_rule(aten._pdist_forward.default)
def aten__pdist_forward(self, p: float = 2.0):
    """_pdist_forward(Tensor self, float p=2.) -> Tensor"""
    n = self.shape[0]
    if not isinstance(n, int):
        raise NotImplementedError("pdist needs a static number of rows")
    # The distances of rows i < j, in row-major order of (i, j).
    rows, cols = np.triu_indices(n, 1)
    flat = op.Reshape(_pairwise(self, self, p), op.Constant(value_ints=[-1]))
    return op.Gather(flat, op.Constant(value=ir.tensor((rows * n + cols).astype(np.int64))), axis=0)


@project_rule(aten._trilinear.default)
def aten__trilinear(i1, i2, i3, expand1: Sequence[int], expand2: Sequence[int], expand3: Sequence[int],
                    sumdim: Sequence[int], unroll_dim: int = 1):
    """_trilinear(Tensor i1, Tensor i2, Tensor i3, int[] expand1, int[] expand2, int[] expand3, int[] sumdim, int unroll_dim=1) -> Tensor"""
    # Each input gets size-1 dims at its expand positions; the product is summed over sumdim.
    def expanded(x, dims):
        return op.Unsqueeze(x, op.Constant(value_ints=sorted(dims))) if dims else x

    product = op.Mul(op.Mul(expanded(i1, expand1), expanded(i2, expand2)), expanded(i3, expand3))
    if not sumdim:
        return product
    return op.ReduceSum(product, op.Constant(value_ints=list(sumdim)), keepdims=0)


def _distance_gradient(diff, dist, p: float):
    """d dist / d x1 for diff = x1 - x2, as ATen's cdist backward (zero where the distance is zero)."""
    zero = op.CastLike(0.0, diff)
    sign = op.Sign(diff)
    if p == 0:
        return op.Mul(diff, zero)
    if p == 1:
        return sign
    if math.isinf(p):
        return op.Mul(sign, op.CastLike(op.Equal(op.Abs(diff), dist), diff))
    at_zero = op.Equal(dist, zero)
    safe = op.Where(at_zero, op.CastLike(1.0, dist), dist)
    if p == 2:
        gradient = op.Div(diff, safe)
    elif p < 2:
        gradient = op.Div(op.Mul(sign, op.Pow(op.Abs(diff), op.CastLike(p - 1, diff))), op.Pow(safe, op.CastLike(p - 1, diff)))
        gradient = op.Where(op.Equal(diff, zero), zero, gradient)
    else:
        gradient = op.Div(op.Mul(diff, op.Pow(op.Abs(diff), op.CastLike(p - 2, diff))), op.Pow(safe, op.CastLike(p - 1, diff)))
    return op.Where(at_zero, zero, gradient)


def _cdist_grad(grad, x1, x2, p: float, dist):
    diff = op.Sub(op.Unsqueeze(x1, op.Constant(value_ints=[-2])), op.Unsqueeze(x2, op.Constant(value_ints=[-3])))
    last = op.Constant(value_ints=[-1])
    terms = op.Mul(op.Unsqueeze(grad, last), _distance_gradient(diff, op.Unsqueeze(dist, last), p))
    return op.ReduceSum(terms, op.Constant(value_ints=[-2]), keepdims=0)


@project_rule(aten._cdist_backward.default)
def aten__cdist_backward(grad, x1, x2, p: float, cdist):
    """_cdist_backward(Tensor grad, Tensor x1, Tensor x2, float p, Tensor cdist) -> Tensor"""
    return _cdist_grad(grad, x1, x2, p, cdist)


@project_rule(aten._pdist_backward.default)
def aten__pdist_backward(grad, self, p: float, pdist):
    """_pdist_backward(Tensor grad, Tensor self, float p, Tensor pdist) -> Tensor"""
    n = self.shape[0]
    if not isinstance(n, int):
        raise NotImplementedError("pdist needs a static number of rows")
    rows, cols = np.triu_indices(n, 1)
    # Both (i, j) and (j, i) of the full distance matrix get the pair's gradient and distance.
    positions = op.Constant(value=ir.tensor(np.concatenate([rows * n + cols, cols * n + rows]).astype(np.int64)))
    square = op.Constant(value_ints=[n, n])

    def full(pairs):
        zeros = op.CastLike(op.ConstantOfShape(op.Constant(value_ints=[n * n])), pairs)
        return op.Reshape(op.ScatterElements(zeros, positions, op.Concat(pairs, pairs, axis=0), axis=0), square)

    return _cdist_grad(full(grad), self, self, p, full(pdist))
