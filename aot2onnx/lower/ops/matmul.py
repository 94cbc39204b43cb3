"""Matrix-vector products, written so that ONNX Runtime's optimizer computes them right.

ONNX Runtime 1.31 fuses Transpose -> MatMul into a FusedMatMul with transA; when the right operand is a
vector, the fused kernel returns wrong values (measured here: mv(x.t(), v) off by up to 8 for a 5x10 x,
exact with graph optimizations disabled). ``mv(x.t(), v)`` is what the backward of mv, addmv and addr
computes. A matrix-matrix product with a one-column right operand is fused correctly.
"""

from __future__ import annotations

import onnx_ir as ir
import torch
from onnxscript import opset18 as op

from aot2onnx.lower.ops._common import fma, rounded_to
from aot2onnx.lower.registry import project_rule

aten = torch.ops.aten


@project_rule(aten.mv.default)
def aten_mv(self, vec):
    """mv(Tensor self, Tensor vec) -> Tensor"""
    last = op.Constant(value_ints=[-1])
    return op.Squeeze(op.MatMul(self, op.Unsqueeze(vec, last)), last)


@project_rule(aten.addmv.default)
def aten_addmv(self, mat, vec, beta: float = 1.0, alpha: float = 1.0):
    """addmv(Tensor self, Tensor mat, Tensor vec, *, Scalar beta=1, Scalar alpha=1) -> Tensor"""
    return _beta_self_plus_alpha(self, aten_mv(mat, vec), beta, alpha)


def _beta_self_plus_alpha(self, product, beta: float, alpha: float):
    """``beta * self + alpha * product``, the scalars in the operands' dtypes; with beta 0, ATen ignores self,
    NaN and inf included (torch_lib's ``self * 0`` made an inf NaN)."""
    if alpha != 1:
        product = op.Mul(product, op.CastLike(alpha, product))
    if beta == 0:
        return product
    return op.Add(op.Mul(self, op.CastLike(beta, self)) if beta != 1 else self, product)


_ADDBMM_UNROLLED = 64  # batches a 16-bit addbmm is unrolled for; beyond, torch_lib's single sum


@project_rule(aten.addbmm.default)
def aten_addbmm(self, batch1, batch2, beta: float = 1.0, alpha: float = 1.0):
    """addbmm(Tensor self, Tensor batch1, Tensor batch2, *, Scalar beta=1, Scalar alpha=1) -> Tensor

    ATen accumulates the batches into the result one ``addmm_`` at a time, so a float16 or bfloat16 result
    is rounded after every batch (each product accumulated in float32 and added to the result in float32
    first). torch_lib's rule sums all the products and rounds once: 1 to 3 bfloat16 elements in 50 were
    several ulps off eager where the batches nearly cancel. The 16-bit rule does what ATen does, unrolled
    over a static batch count; the other dtypes, which ATen rounds too but at float32's precision or
    finer, keep one reduction (a single MatMul, far fewer nodes)."""
    batches = batch1.shape[0] if batch1.shape is not None else None
    if self.dtype not in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16) or not isinstance(batches, int) or not (
            0 < batches <= _ADDBMM_UNROLLED):
        product = op.ReduceSum(op.MatMul(batch1, batch2), op.Constant(value_ints=[0]), keepdims=0)
        return _beta_self_plus_alpha(self, product, beta, alpha)
    dtype, f = self.dtype, ir.DataType.FLOAT
    a, b = op.Cast(batch1, to=f), op.Cast(batch2, to=f)
    result = None if beta == 0 else op.Cast(self, to=f)  # beta 0: ATen ignores self, NaN included
    for i in range(batches):
        index = op.Constant(value_int=i)
        product = op.MatMul(op.Gather(a, index, axis=0), op.Gather(b, index, axis=0))
        if alpha != 1:
            product = op.Mul(product, op.Constant(value_float=float(alpha)))
        if result is not None:
            scaled = op.Mul(result, op.Constant(value_float=float(beta))) if i == 0 and beta != 1 else result
            product = op.Add(scaled, product)
        result = rounded_to(product, dtype)
    return op.Cast(result, to=dtype)


@project_rule(aten.addr.default)
def aten_addr(self, vec1, vec2, beta: float = 1.0, alpha: float = 1.0):
    """addr(Tensor self, Tensor vec1, Tensor vec2, *, Scalar beta=1, Scalar alpha=1) -> Tensor

    Element (i, j) as ATen's CPU kernel computes it: ``self * beta + (alpha * vec1[i]) * vec2[j]``. Its 16-bit
    builds round after every operation (c10's Half and BFloat16 arithmetic, beta and alpha rounded to the
    dtype): matched bit for bit. Its float32 and float64 vector loop fuses the outer product into the sum,
    ``fma(alpha * vec1[i], vec2[j], self * beta)``, as here; the scalar loop that finishes a row whose length
    is not a multiple of the vector width (16 floats with AVX-512, 8 with AVX2) fuses the other product, so
    those last elements can be an ulp apart. With beta 0, self is ignored, NaN included. torch_lib's rule (one
    float32 rounding for it all, under mixed precision) was several bfloat16 ulps off eager, and an ulp off
    in a third of float32 elements; for bools ONNX Runtime has no Mul kernel (ATen: ``self and beta or alpha
    and vec1 and vec2``)."""
    rows = op.Unsqueeze(vec1, op.Constant(value_ints=[-1]))
    dtype = self.dtype
    if dtype == ir.DataType.BOOL:
        outer = op.And(rows, vec2)
        outer = outer if alpha else op.And(outer, op.Not(outer))
        return outer if not beta else op.Or(self, outer)
    if dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        f = ir.DataType.FLOAT

        def scalar(v):  # the Scalar as scalar_t, then float
            return rounded_to(op.Constant(value_float=float(v)), dtype)

        outer = rounded_to(op.Mul(rounded_to(op.Mul(scalar(alpha), op.Cast(rows, to=f)), dtype), op.Cast(vec2, to=f)), dtype)
        if beta != 0:
            outer = op.Add(rounded_to(op.Mul(op.Cast(self, to=f), scalar(beta)), dtype), outer)
        return op.Expand(op.Cast(outer, to=dtype), op.Shape(outer))
    scaled_rows = op.Mul(op.CastLike(alpha, rows), rows)
    if beta == 0:
        return op.Mul(scaled_rows, vec2)
    scaled_self = self if beta == 1 else op.Mul(self, op.CastLike(beta, self))
    if dtype == ir.DataType.FLOAT:  # the product is exact in double: one rounding to double, then float
        double = ir.DataType.DOUBLE
        return op.Cast(op.Add(op.Mul(op.Cast(scaled_rows, to=double), op.Cast(vec2, to=double)),
                              op.Cast(scaled_self, to=double)), to=dtype)
    if dtype == ir.DataType.DOUBLE:
        outer_shape = op.Shape(op.Add(rows, vec2))
        return fma(op.Expand(scaled_rows, outer_shape), op.Expand(vec2, outer_shape), scaled_self)
    return op.Add(scaled_self, op.Mul(scaled_rows, vec2))


@project_rule(aten.baddbmm.default)
def aten_baddbmm(self, batch1, batch2, beta: float = 1.0, alpha: float = 1.0):
    """baddbmm(Tensor self, Tensor batch1, Tensor batch2, *, Scalar beta=1, Scalar alpha=1) -> Tensor

    ``beta * self + alpha * (batch1 @ batch2)``. ATen's 16-bit kernel (oneDNN) accumulates the products in
    float32 and adds the scaled terms there, rounding once: so does this rule. torch_lib's rounded the product,
    each scaled term and the sum (under mixed precision): 45% of bfloat16 elements were an ulp or more off
    eager. With beta 0, self is ignored, NaN and inf included (torch_lib's self * 0 made an inf NaN)."""
    dtype = self.dtype
    half = dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
    if half:
        self, batch1, batch2 = (op.Cast(v, to=ir.DataType.FLOAT) for v in (self, batch1, batch2))
    result = _beta_self_plus_alpha(self, op.MatMul(batch1, batch2), beta, alpha)
    return op.Cast(result, to=dtype) if half else result
