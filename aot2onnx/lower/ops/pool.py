"""Pooling backward."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from onnxscript import opset18 as op

from aot2onnx.lower.registry import project_rule

aten = torch.ops.aten


def _planes(x):
    """The shape (-1, C, H*W) of x (N, C, H, W) or (C, H, W) seen as one row per (n, c) plane."""
    plane_size = op.ReduceProd(op.Shape(x, start=-2), keepdims=1)
    return op.Concat(op.Constant(value_ints=[-1]), op.Shape(x, start=-3, end=-2), plane_size, axis=0)


@project_rule(aten.max_pool2d_with_indices_backward.default)
def aten_max_pool2d_with_indices_backward(
    grad_output,
    self,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
    indices,
):
    """max_pool2d_with_indices_backward(Tensor grad_output, Tensor self, int[2] kernel_size, int[2] stride, int[2] padding, int[2] dilation, bool ceil_mode, Tensor indices) -> Tensor"""
    # indices hold, per (n, c) plane, the flat position of each window's maximum: scatter-add the
    # gradient there. Overlapping windows can pick the same position, hence the reduction. Batched
    # (N, C, H, W) and unbatched (C, H, W) inputs are both viewed as (-1, C, H*W).
    shape = op.Shape(self)
    zeros = op.CastLike(op.ConstantOfShape(op.Shape(op.Reshape(self, _planes(self)))), grad_output)
    grad = op.ScatterElements(
        zeros, op.Reshape(indices, _planes(indices)), op.Reshape(grad_output, _planes(grad_output)),
        axis=2, reduction="add",
    )
    return op.Reshape(grad, shape)
