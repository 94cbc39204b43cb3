"""View ops: squeeze, and the scatters into a strided view.

``squeeze(dim)`` leaves a dimension whose size is not 1 in place (ONNX's Squeeze refuses it).

Scatter into a strided view is what AOTAutograd emits for a mutated input that aliases another input.

When two inputs share storage (a synthetic base), AOTAutograd's functionalized graph writes a mutation back
with ``as_strided_scatter(base, src, size, stride, offset)``. ONNX values have no storage, but a contiguous
base flattened to 1-D is its storage, so the strided view is a set of flat positions and the scatter is one
ScatterElements.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops import core as torchlib_core

from aot2onnx.lower.ops._common import static_dim
from aot2onnx.lower.registry import project_rule

aten, prims = torch.ops.aten, torch.ops.prims


def _as_strided_scatter(self, src, size: Sequence, stride: Sequence, storage_offset=None):
    flat = op.Constant(value_ints=[-1])
    # The flat position of every element of the view: as_strided applied to 0..numel-1.
    positions = op.Range(op.Constant(value_int=0), op.Size(self), op.Constant(value_int=1))
    indices = torchlib_core.aten_as_strided(positions, size, stride, storage_offset)
    updated = op.ScatterElements(op.Reshape(self, flat), op.Reshape(indices, flat), op.Reshape(src, flat), axis=0)
    return op.Reshape(updated, op.Shape(self))


@project_rule(aten.as_strided_scatter.default)
def aten_as_strided_scatter(self, src, size: Sequence, stride: Sequence, storage_offset=None):
    """as_strided_scatter(Tensor self, Tensor src, SymInt[] size, SymInt[] stride, SymInt? storage_offset=None) -> Tensor"""
    return _as_strided_scatter(self, src, size, stride, storage_offset)


@project_rule(prims.as_strided_scatter.default)
def prims_as_strided_scatter(self, src, size: Sequence, stride: Sequence, storage_offset):
    """as_strided_scatter(Tensor self, Tensor src, SymInt[] size, SymInt[] stride, SymInt storage_offset) -> Tensor"""
    return _as_strided_scatter(self, src, size, stride, storage_offset)


# select_scatter and slice_scatter are what the backward of indexing and slicing becomes (a gradient placed
# into zeros). torch_lib scatters with an index tensor as large as the update (ScatterElements/ScatterND),
# which ONNX Runtime runs element by element: in a transformer layer's backward the three select_scatter of
# the packed q/k/v projection took a quarter of the graph's kernel time. With static sizes along ``dim`` the
# result is a Concat of the untouched slices of ``self`` around the update.


def _around(self, update, dim: int, start: int, stop: int, length: int):
    axes = op.Constant(value_ints=[dim])
    pieces = []
    if start > 0:
        pieces.append(op.Slice(self, op.Constant(value_ints=[0]), op.Constant(value_ints=[start]), axes))
    pieces.append(update)
    if stop < length:
        pieces.append(op.Slice(self, op.Constant(value_ints=[stop]), op.Constant(value_ints=[length]), axes))
    return op.Concat(*pieces, axis=dim) if len(pieces) > 1 else op.Identity(update)


@project_rule(aten.select_scatter.default)
def aten_select_scatter(self, src, dim: int, index):
    """select_scatter(Tensor self, Tensor src, int dim, SymInt index) -> Tensor"""
    length = static_dim(self, dim)
    if length is None or not isinstance(index, int):
        return torchlib_core.aten_select_scatter(self, src, dim, index)
    dim = dim % len(self.shape)
    index = index % length
    return _around(self, op.Unsqueeze(src, op.Constant(value_ints=[dim])), dim, index, index + 1, length)


@project_rule(aten.slice_scatter.default)
def aten_slice_scatter(self, src, dim: int = 0, start=None, end=None, step=1):
    """slice_scatter(Tensor self, Tensor src, int dim=0, SymInt? start=None, SymInt? end=None, SymInt step=1) -> Tensor"""
    length = static_dim(self, dim)
    static = all(v is None or isinstance(v, int) for v in (start, end)) and step == 1
    if length is None or not static:
        return torchlib_core.aten_slice_scatter(self, src, dim, start, end, step)
    dim = dim % len(self.shape)
    # Python slice semantics: negative bounds count from the end, out-of-range bounds clamp.
    start, stop, _ = slice(start, end).indices(length)
    stop = max(stop, start)
    return _around(self, src, dim, start, stop, length)


def _squeeze(self, dims: Sequence[int]):
    rank = len(self.shape)
    if rank == 0:
        return op.Identity(self)
    # Dynamo specializes sizes 0 and 1, so a symbolic size is never 1: only a static 1 is squeezed.
    ones = sorted({d % rank for d in dims if static_dim(self, d % rank) == 1})
    return op.Squeeze(self, op.Constant(value_ints=ones)) if ones else op.Identity(self)


@project_rule(aten.squeeze.dim)
def aten_squeeze_dim(self, dim: int):
    """squeeze.dim(Tensor(a) self, int dim) -> Tensor(a)"""
    return _squeeze(self, [dim])


@project_rule(aten.squeeze.dims)
def aten_squeeze_dims(self, dim: Sequence[int]):
    """squeeze.dims(Tensor(a) self, int[] dim) -> Tensor(a)"""
    return _squeeze(self, dim)
