"""Helpers the rule families share: static shapes, constants and reshapes that several families need.

A helper lives here once a second family needs it; one family's own helpers stay in its file.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript import opset18 as op

__all__ = ["FLOATS", "flat", "float64_constant", "static_dim", "static_dims"]

FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def static_dim(value: ir.Value, dim: int) -> int | None:
    """The size of ``value``'s dimension ``dim`` where it is known while lowering, else ``None``."""
    size = value.shape[dim] if value.shape is not None else None
    return size if isinstance(size, int) else None


def static_dims(value: ir.Value) -> list[int] | None:
    """``value``'s shape where every size is known while lowering, else ``None``."""
    if value.shape is None or not all(isinstance(d, int) for d in value.shape):
        return None
    return list(value.shape)


def flat(x: ir.Value) -> ir.Value:
    """``x`` as a 1-D tensor (its elements in row-major order), with its dtype known to later rules."""
    flattened = op.Reshape(x, op.Constant(value_ints=[-1]))
    flattened.dtype, flattened.shape = x.dtype, ir.Shape([None])
    return flattened


def float64_constant(value) -> ir.Value:
    """A float64 Constant of ``value`` (a number or an array): exact for any float32 or float64 number."""
    return op.Constant(value=ir.tensor(np.asarray(value, dtype=np.float64)))
