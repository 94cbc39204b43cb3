"""Scatter into a strided view: what AOTAutograd emits for a mutated input that aliases another input.

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
