"""Factory ops: tensors made from sizes and Python numbers (full, arange, zeros of a size), in ATen's dtypes
and with ATen's values (a float64 fill kept in float64, arange's elements computed as ATen's kernel does)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import onnx_ir as ir
import torch
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops import core as torchlib_core

from aot2onnx.lower.ops.pointwise import _HALVES, _scalar
from aot2onnx.lower.registry import project_rule

aten = torch.ops.aten


@project_rule(aten._efficientzerotensor.default)
def aten__efficientzerotensor(
    size: Sequence[int], dtype: int = -1, layout: str = "", device: str = "", pin_memory: bool = False
):
    """_efficientzerotensor(SymInt[] size, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor"""
    # A zero tensor that ATen never materialises; in ONNX it is just zeros.
    data_type = ir.DataType.FLOAT if dtype in (-1, None) else ir.DataType(dtype)
    return op.ConstantOfShape(_shape(size), value=ir.tensor([0], dtype=data_type))


def _shape(size: Sequence[int]):
    """A SymInt[] argument as a 1-D INT64 tensor."""
    if all(isinstance(d, int) for d in size):
        return op.Constant(value_ints=list(size))
    one = op.Constant(value_ints=[1])
    return op.Concat(*[op.Reshape(op.Cast(d, to=ir.DataType.INT64), one) for d in size], axis=0)


def _fill_type(fill_value) -> ir.DataType:
    """The dtype ATen gives full() without one: bool, int64, or the default float dtype."""
    if isinstance(fill_value, bool):
        return ir.DataType.BOOL
    if isinstance(fill_value, int):
        return ir.DataType.INT64
    return ir.DataType.DOUBLE if torch.get_default_dtype() == torch.float64 else ir.DataType.FLOAT


@project_rule(aten.full.default)
def aten_full(size: Sequence[int], fill_value, dtype: int = -1, layout: str = "", device: str = "",
              pin_memory: bool = False):
    """full(SymInt[] size, Scalar fill_value, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor"""
    # The fill in the result's dtype from the start: torch_lib cast a float32 constant, so a float64
    # full(0.3) was 0.30000001192092896.
    data_type = _fill_type(fill_value) if dtype in (-1, None) else ir.DataType(dtype)
    return op.Expand(_scalar(fill_value, data_type), _shape(size))


def _arange(start, end, step, dtype: int):
    """ATen's arange where it gives floats from Python numbers; None where torch_lib's is exact."""
    numbers = (start, end, step)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
        return None  # symbolic bounds: integers, which Range makes exactly
    if dtype in (-1, None):
        data_type = ir.DataType.INT64 if all(isinstance(v, int) for v in numbers) else _fill_type(0.0)
    else:
        data_type = ir.DataType(dtype)
    if not data_type.is_floating_point():
        return None
    # torch_lib's is a float32 Range: ONNX Runtime's adds the step to a running value, so float32
    # arange(0, 1000, 0.1) ended at 999.8029 (eager 999.9), and float64 arange was float32's. ATen's CPU kernel
    # (RangeFactories.cpp): ceil((end - start) / step) elements, start + step * i in double (float for 16-bit
    # floats), rounded once to the dtype. The positions are an integer Range, exact.
    count = max(0, math.ceil((float(end) - float(start)) / float(step)))
    compute = ir.DataType.FLOAT if data_type in _HALVES else ir.DataType.DOUBLE
    positions = op.Cast(op.Range(op.Constant(value=ir.tensor(0, dtype=ir.DataType.INT64)),
                                 op.Constant(value=ir.tensor(count, dtype=ir.DataType.INT64)),
                                 op.Constant(value=ir.tensor(1, dtype=ir.DataType.INT64))), to=compute)
    values = op.Add(_scalar(float(start), compute), op.Mul(_scalar(float(step), compute), positions))
    return values if compute == data_type else op.Cast(values, to=data_type)


@project_rule(aten.arange.start_step)
def aten_arange_start_step(start, end, step=1, dtype: int = -1, layout: str = "", device: str = "",
                           pin_memory: bool = False):
    """arange.start_step(Scalar start, Scalar end, Scalar step=1, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor"""
    result = _arange(start, end, step, dtype)
    return torchlib_core.aten_arange_start_step(start, end, step, dtype) if result is None else result


@project_rule(aten.arange.start)
def aten_arange_start(start, end, dtype: int = -1, layout: str = "", device: str = "", pin_memory: bool = False):
    """arange.start(Scalar start, Scalar end, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor"""
    result = _arange(start, end, 1, dtype)
    return torchlib_core.aten_arange_start(start, end, dtype) if result is None else result


@project_rule(aten.arange.default)
def aten_arange(end, dtype: int = -1, layout: str = "", device: str = "", pin_memory: bool = False):
    """arange(Scalar end, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor"""
    result = _arange(0, end, 1, dtype)
    return torchlib_core.aten_arange(end, dtype) if result is None else result


@project_rule(aten.full_like.default)
def aten_full_like(self, fill_value, dtype: int = -1, layout: str = "", device: str = "", pin_memory: bool = False,
                   memory_format: str = ""):
    """full_like(Tensor self, Scalar fill_value, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None, MemoryFormat? memory_format=None) -> Tensor"""
    data_type = self.dtype if dtype in (-1, None) else ir.DataType(dtype)
    return op.Expand(_scalar(fill_value, data_type), op.Shape(self))


@project_rule(aten.empty_permuted.default)
def aten_empty_permuted(size: Sequence[int], physical_layout: Sequence[int], dtype: int = -1, layout: str = "",
                        device: str = "", pin_memory: bool = False):
    """empty_permuted(SymInt[] size, int[] physical_layout, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor"""
    # ONNX tensors have no memory layout, and empty's values are unspecified: zeros of the logical size.
    return aten__efficientzerotensor(size, dtype)
