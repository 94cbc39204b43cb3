"""Padding backward: replication padding (negative pads crop)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from aot2onnx.lower.ops.adaptive_pool import along
from aot2onnx.lower.registry import project_rule

aten = torch.ops.aten


def _replication_pad_backward(grad_output, self, padding: Sequence[int]):
    # Output position o along a dim copies input position clamp(o - left, 0, n - 1): the gradient of input
    # i sums the output positions that copy it. One 0/1 matrix per spatial dim (the last dim's pads first).
    spatial = len(padding) // 2
    rank = len(self.shape)
    sizes, outs = list(self.shape[-spatial:]), list(grad_output.shape[-spatial:])
    if not all(isinstance(d, int) for d in sizes + outs):
        raise NotImplementedError("replication_pad backward needs static spatial sizes")
    grad = grad_output
    for i in range(spatial):
        left = padding[2 * (spatial - 1 - i)]
        n, out = sizes[i], outs[i]
        matrix = np.zeros((n, out))
        for o in range(out):
            matrix[min(max(o - left, 0), n - 1), o] = 1.0
        grad = along(grad, rank, rank - spatial + i, matrix, grad_output)
    return grad


@project_rule(aten.replication_pad1d_backward.default)
def aten_replication_pad1d_backward(grad_output, self, padding: Sequence[int]):
    """replication_pad1d_backward(Tensor grad_output, Tensor self, SymInt[2] padding) -> Tensor"""
    return _replication_pad_backward(grad_output, self, padding)


@project_rule(aten.replication_pad2d_backward.default)
def aten_replication_pad2d_backward(grad_output, self, padding: Sequence[int]):
    """replication_pad2d_backward(Tensor grad_output, Tensor self, SymInt[4] padding) -> Tensor"""
    return _replication_pad_backward(grad_output, self, padding)


@project_rule(aten.replication_pad3d_backward.default)
def aten_replication_pad3d_backward(grad_output, self, padding: Sequence[int]):
    """replication_pad3d_backward(Tensor grad_output, Tensor self, SymInt[6] padding) -> Tensor"""
    return _replication_pad_backward(grad_output, self, padding)
