"""Helpers the rule families share: static shapes, constants and reshapes that several families need.

A helper lives here once a second family needs it; one family's own helpers stay in its file.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript import opset18 as op

from aot2onnx.lower.ops._control import on_device

__all__ = [
    "FLOATS", "INTEGERS", "cast", "is_complex_value", "mark_complex", "flat", "float64_constant", "fma", "linspace", "opmath", "planes", "rounded_to",
    "scatter_add_to_planes", "static_dim", "static_dims", "truth_dtype",
]

FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
INTEGERS = (ir.DataType.INT8, ir.DataType.INT16, ir.DataType.INT32, ir.DataType.INT64, ir.DataType.UINT8)


# The ir.Value meta key of a value that holds a complex tensor as real [..., 2] pairs (translate sets it from
# the FX value's dtype): a rule tells a complex operand from a real one of last size 2 by it.
_COMPLEX_KEY = "aot2onnx.complex"


def mark_complex(value: ir.Value) -> None:
    value.meta[_COMPLEX_KEY] = True


def is_complex_value(value: ir.Value) -> bool:
    return bool(value.meta.get(_COMPLEX_KEY))


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


def cast(x: ir.Value, dtype: ir.DataType) -> ir.Value:
    """``x`` cast to ``dtype``, with its dtype and shape known to later rules (torch_lib's read both)."""
    result = op.Cast(x, to=dtype)
    result.dtype, result.shape = dtype, x.shape
    return result


def float64_constant(value) -> ir.Value:
    """A float64 Constant of ``value`` (a number or an array): exact for any float32 or float64 number."""
    return op.Constant(value=ir.tensor(np.asarray(value, dtype=np.float64)))


def rounded_to(value: ir.Value, dtype: ir.DataType) -> ir.Value:
    """A float32 ``value`` rounded to the 16-bit ``dtype`` and read back as float32: a rounding step of ATen's
    16-bit arithmetic inside a rule that otherwise computes in float32."""
    return op.Cast(op.Cast(value, to=dtype), to=ir.DataType.FLOAT)


def opmath(fn, *xs):
    """``fn(*xs)`` in the dtype ATen's CPU kernels compute in: float32 for 16-bit floats, rounded once to
    ``xs[0]``'s dtype, with float32 constants (``fn`` may read its inputs' dtype, as torch_lib's rules do to
    make their constants)."""
    if xs[0].dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        return op.CastLike(fn(*(cast(x, ir.DataType.FLOAT) for x in xs)), xs[0])
    return fn(*xs)


def fma(a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """``a * b + c`` rounded once, for float64 values (ONNX has no fused multiply-add): Dekker's exact product
    and Knuth's exact sum, their errors added before the last rounding. It differs from a true fma only where
    the exact value lies within about 2^-100 of a rounding midpoint, or where a product overflows."""
    def split(x):  # x as hi + lo, two 26-bit halves whose products are exact
        spread = op.Mul(x, float64_constant(134217729.0))
        high = op.Sub(spread, op.Sub(spread, x))
        return high, op.Sub(x, high)

    (a_high, a_low), (b_high, b_low) = split(a), split(b)
    product = op.Mul(a, b)
    product_error = op.Add(op.Add(op.Add(op.Sub(op.Mul(a_high, b_high), product), op.Mul(a_high, b_low)),
                                  op.Mul(a_low, b_high)), op.Mul(a_low, b_low))
    total = op.Add(product, c)
    back = op.Sub(total, product)
    sum_error = op.Add(op.Sub(product, op.Sub(total, back)), op.Sub(c, back))
    return op.Add(total, op.Add(sum_error, product_error))


def linspace(start: ir.Value, end: ir.Value, step: ir.Value, steps: int) -> ir.Value:
    """ATen's CPU linspace of ``steps`` (at least 2) values from ``start`` to ``end``, 0-d values of one dtype,
    bit for bit, in double: value k is fma(step, k, start) before halfway and fma(-step, steps - 1 - k, end)
    from there (ATen's kernels are built with FMA contraction). ``step`` is the caller's, in the dtype ATen
    computes it in. An ulp off moves a value lying on a histogram edge into the next bin.

    ONNX has no fused multiply-add: it is done in double with Dekker's exact product (steps <= 2^26) and
    Knuth's exact sum, whose errors are added before the last rounding. That differs from the fma only where
    the exact value lies within about 2^-100 of a rounding midpoint (for a float32 result, which rounds again,
    only where a bound is over 2^29 steps from zero)."""
    double = ir.DataType.DOUBLE
    k = op.Cast(op.Range(op.Constant(value_int=0), op.Constant(value_int=steps), op.Constant(value_int=1)), to=double)
    before_halfway = op.Less(k, float64_constant(float(steps // 2)))
    base = op.Cast(op.Where(before_halfway, op.Expand(start, op.Shape(k)), op.Expand(end, op.Shape(k))), to=double)
    a = op.Cast(op.Where(before_halfway, step, op.Neg(step)), to=double)
    n = op.Where(before_halfway, k, op.Sub(float64_constant(float(steps - 1)), k))
    return fma(a, n, base)  # n < 2^26 splits into itself and 0: the product error is exact


def truth_dtype() -> ir.DataType:
    """The dtype ReduceMax and ReduceMin take truth values (0 and 1) in: one byte, but int32 on a device,
    the same results: ONNX Runtime's CUDA ReduceMax has no uint8 kernel (opset_tables/ort_cuda_kernels.json),
    and a node without one runs on the host."""
    return ir.DataType.INT32 if on_device() else ir.DataType.UINT8


def planes(x: ir.Value, spatial: int) -> ir.Value:
    """x [..., *spatial] as [..., positions]: one row per (n, c) plane, batched or not."""
    return op.Reshape(x, op.Concat(op.Shape(x, end=-spatial), op.Constant(value_ints=[-1]), axis=0))


def scatter_add_to_planes(grad_output: ir.Value, self: ir.Value, indices: ir.Value, spatial: int) -> ir.Value:
    """The gradient of a max pool (plain or adaptive) whose indices hold each window's flat position within
    its plane: scatter-added there, since windows that overlap can pick one position."""
    zeros = op.CastLike(op.ConstantOfShape(op.Shape(planes(self, spatial))), grad_output)
    grad = op.ScatterElements(zeros, planes(indices, spatial), planes(grad_output, spatial), axis=-1, reduction="add")
    return op.Reshape(grad, op.Shape(self))
