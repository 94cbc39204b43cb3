"""Replication padding (negative pads crop): the forward where a pad is negative, and the backward."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops import nn as torchlib_nn

from aot2onnx.lower.registry import project_rule

aten = torch.ops.aten


def _copied_from(n: int, out: int, left: int) -> list[tuple[int, int] | None]:
    """For each input position i: the run [start, end) of output positions that copy it (None where none
    does). Output o copies input clamp(o - left, 0, n - 1), so the runs are consecutive."""
    runs: list[tuple[int, int] | None] = [None] * n
    for o in range(out):
        i = min(max(o - left, 0), n - 1)
        runs[i] = (runs[i][0], o + 1) if runs[i] else (o, o + 1)
    return runs


def _sum_runs(grad, rank: int, axis: int, runs: list[tuple[int, int] | None]):
    """grad_in[..., i, ...] = the sum of grad[..., start:end, ...] over i's run along ``axis``; 0 without one.

    Each input position adds only the outputs that copy it, so that an inf or NaN stays there (a product
    with a 0/1 matrix spread it as inf * 0 = NaN to every position). Positions copied once are one Slice,
    an edge copied many times a ReduceSum.
    """
    def piece(start: int, end: int):
        return op.Slice(grad, op.Constant(value_ints=[start]), op.Constant(value_ints=[end]), op.Constant(value_ints=[axis]))

    held = [i for i, run in enumerate(runs) if run]
    pieces, i = [], held[0]
    while i <= held[-1]:
        start, end = runs[i]
        if end - start > 1:
            pieces.append(op.ReduceSum(piece(start, end), op.Constant(value_ints=[axis]), keepdims=1))
            i += 1
            continue
        j = i  # a stretch of positions each copied once, by consecutive outputs
        while j + 1 <= held[-1] and runs[j + 1][1] - runs[j + 1][0] == 1:
            j += 1
        pieces.append(piece(start, runs[j][1]))
        i = j + 1
    grad_in = pieces[0] if len(pieces) == 1 else op.Concat(*pieces, axis=axis)
    before, after = held[0], len(runs) - 1 - held[-1]  # cropped positions receive nothing
    if before or after:
        pads = [0] * (2 * rank)
        pads[axis % rank], pads[rank + axis % rank] = before, after
        grad_in = op.Pad(grad_in, op.Constant(value_ints=pads), op.CastLike(0.0, grad))
    return grad_in


def _replication_pad_backward(grad_output, self, padding: Sequence[int]):
    # The gradient of input i sums the output positions that copy it, one spatial dim at a time (the last
    # dim's pads come first in ``padding``).
    spatial = len(padding) // 2
    sizes, outs = list(self.shape[-spatial:]), list(grad_output.shape[-spatial:])
    if not all(isinstance(d, int) for d in sizes + outs):
        raise NotImplementedError("replication_pad backward needs static spatial sizes")
    grad = grad_output
    for i in range(spatial):
        left = padding[2 * (spatial - 1 - i)]
        grad = _sum_runs(grad, len(self.shape), i - spatial, _copied_from(sizes[i], outs[i], left))
    # ATen adds each copy to zeros, so a gradient of -0.0 is 0.0.
    return op.Add(grad, op.CastLike(0.0, grad))


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


def _replication_pad(self, padding: Sequence[int], torchlib_rule):
    # ONNX Runtime's edge Pad crops first and refuses a dim cropped to nothing ("zero effective input
    # extent"), where ATen still copies the nearest input element. With a negative pad, each spatial dim is
    # a Gather of clamp(o - left, 0, n - 1), ATen's definition; otherwise torch_lib's edge Pad is right.
    if all(p >= 0 for p in padding):
        return torchlib_rule(self, padding)
    spatial = len(padding) // 2
    sizes = list(self.shape[-spatial:])
    if not all(isinstance(d, int) for d in sizes):
        raise NotImplementedError("replication_pad with a negative pad needs static spatial sizes")
    result = self
    for i in range(spatial):
        left, right = padding[2 * (spatial - 1 - i)], padding[2 * (spatial - 1 - i) + 1]
        n = sizes[i]
        source = np.clip(np.arange(n + left + right) - left, 0, n - 1).astype(np.int64)
        result = op.Gather(result, op.Constant(value=ir.tensor(source)), axis=i - spatial)
    return result


@project_rule(aten.replication_pad1d.default)
def aten_replication_pad1d(self, padding: Sequence[int]):
    """replication_pad1d(Tensor self, SymInt[2] padding) -> Tensor"""
    return _replication_pad(self, padding, torchlib_nn.aten_replication_pad1d)


@project_rule(aten.replication_pad2d.default)
def aten_replication_pad2d(self, padding: Sequence[int]):
    """replication_pad2d(Tensor self, SymInt[4] padding) -> Tensor"""
    return _replication_pad(self, padding, torchlib_nn.aten_replication_pad2d)


@project_rule(aten.replication_pad3d.default)
def aten_replication_pad3d(self, padding: Sequence[int]):
    """replication_pad3d(Tensor self, SymInt[6] padding) -> Tensor"""
    return _replication_pad(self, padding, torchlib_nn.aten_replication_pad3d)
