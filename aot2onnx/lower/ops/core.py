"""Core ops where torch_lib's rule loses what ATen keeps."""

from __future__ import annotations

import numbers

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops import core as torchlib_core

from aot2onnx.lower.registry import project_rule

aten = torch.ops.aten


@project_rule(aten.scalar_tensor.default)
def aten_scalar_tensor(s, dtype: int = -1, layout: str = "", device: str = "", pin_memory: bool = False):
    """scalar_tensor(Scalar s, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor"""
    # torch_lib makes a float32 constant and casts it, so 0.3 in a double graph becomes 0.30000001. Every
    # Python scalar of a mixed-dtype ATen op reaches ONNX through here (the exporter's type promotion pass
    # rewrites them into scalar_tensor), so the constant is made in its own dtype.
    if not isinstance(s, numbers.Number) or isinstance(s, complex):
        return torchlib_core.aten_scalar_tensor(s, dtype, layout, device, pin_memory)
    data_type = ir.DataType.FLOAT if dtype == -1 else ir.DataType(dtype)
    return op.Constant(value=ir.tensor(np.array(s, dtype=data_type.numpy())))
