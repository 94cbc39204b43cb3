"""Matrix-vector products, written so that ONNX Runtime's optimizer computes them right.

ONNX Runtime 1.31 fuses Transpose -> MatMul into a FusedMatMul with transA; when the right operand is a
vector, the fused kernel returns wrong values (measured here: mv(x.t(), v) off by up to 8 for a 5x10 x,
exact with graph optimizations disabled). ``mv(x.t(), v)`` is what the backward of mv, addmv and addr
computes. A matrix-matrix product with a one-column right operand is fused correctly.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op

from aot2onnx.lower.ops._common import cast, fma, rounded_to
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


# --- The fused CPU attention kernel, where a graph calls it directly (SDPA itself is traced through its math
# formulation and does not reach it). torch_lib's rule returned zeros of another shape for the logsumexp, which
# the backward reads. Computed here in float32 for 16-bit inputs, as the kernel accumulates; the logsumexp
# stays in that type, as ATen returns it.


def _attention_scores(query, key, is_causal: bool, attn_mask, scale):
    """(scores [B, H, L, S] with the mask applied, the scale)."""
    size = query.shape[-1] if query.shape is not None else None
    if scale is None and not isinstance(size, int):
        raise NotImplementedError("the fused attention needs a static head size (or a scale)")
    scale = 1.0 / math.sqrt(size) if scale is None else scale
    scores = op.Mul(op.MatMul(query, op.Transpose(key, perm=[0, 1, 3, 2])), op.CastLike(op.Constant(value_float=scale), query))
    minus_inf = op.CastLike(op.Constant(value_float=float("-inf")), query)
    if is_causal:  # top-left aligned: query i sees keys 0..i
        length, keys = query.shape[-2], key.shape[-2]
        if not (isinstance(length, int) and isinstance(keys, int)):
            raise NotImplementedError("causal fused attention needs static sequence lengths")
        visible = np.tril(np.ones((length, keys), dtype=bool))
        scores = op.Where(op.Constant(value=ir.tensor(visible)), scores, minus_inf)
    if attn_mask is not None:
        scores = (op.Where(attn_mask, scores, minus_inf) if attn_mask.dtype == ir.DataType.BOOL
                  else op.Add(scores, op.CastLike(attn_mask, scores)))
    return scores, scale


def _flash_attention(query, key, value, is_causal, attn_mask, scale):
    scores, _ = _attention_scores(query, key, is_causal, attn_mask, scale)
    last = op.Constant(value_ints=[-1])
    peak = op.ReduceMax(scores, last, keepdims=1)
    # A row whose every key is masked: the kernel's output is 0 there and its logsumexp 0 (seen on torch 2.13).
    masked = op.Equal(peak, op.CastLike(op.Constant(value_float=float("-inf")), peak))
    zero = op.CastLike(op.Constant(value_float=0.0), peak)
    peak = op.Where(masked, zero, peak)
    weights = op.Exp(op.Sub(scores, peak))
    total = op.ReduceSum(weights, last, keepdims=1)
    out = op.Where(masked, zero, op.Div(op.MatMul(weights, value), total))
    logsumexp = op.Squeeze(op.Where(masked, zero, op.Add(peak, op.Log(total))), last)
    return out, logsumexp


def _compute_type(x):
    return ir.DataType.FLOAT if x.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16) else x.dtype


@project_rule(aten._scaled_dot_product_flash_attention_for_cpu.default)
def aten__scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p: float = 0.0, is_causal: bool = False,
                                                     *, attn_mask=None, scale=None):
    """_scaled_dot_product_flash_attention_for_cpu(Tensor query, Tensor key, Tensor value, float dropout_p=0.0, bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None) -> (Tensor output, Tensor logsumexp)"""
    if dropout_p != 0.0:
        raise NotImplementedError("the fused CPU attention kernel with dropout (its mask comes from torch's generator)")
    compute = _compute_type(query)
    q, k, v = (cast(x, compute) for x in (query, key, value))
    out, logsumexp = _flash_attention(q, k, v, is_causal, attn_mask, scale)
    return op.CastLike(out, query), logsumexp


@project_rule(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def aten__scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query, key, value, out, logsumexp,
                                                              dropout_p: float, is_causal: bool, *, attn_mask=None,
                                                              scale=None):
    """_scaled_dot_product_flash_attention_for_cpu_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor logsumexp, float dropout_p, bool is_causal, *, Tensor? attn_mask=None, float? scale=None) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)"""
    # P = exp(S - logsumexp) (0 on masked keys and rows); dV = P^T dO; dS = P * (dO V^T - rowsum(dO * O));
    # dQ = scale * dS K; dK = scale * dS^T Q.
    if dropout_p != 0.0:
        raise NotImplementedError("the fused CPU attention kernel's backward with dropout")
    compute = _compute_type(query)
    g, q, k, v, o = (cast(x, compute) for x in (grad_out, query, key, value, out))
    scores, scale = _attention_scores(q, k, is_causal, attn_mask, scale)
    last = op.Constant(value_ints=[-1])
    lse = op.Unsqueeze(op.Cast(logsumexp, to=compute), last)
    peak = op.ReduceMax(scores, last, keepdims=1)
    masked = op.Equal(peak, op.CastLike(op.Constant(value_float=float("-inf")), peak))
    probs = op.Where(masked, op.CastLike(op.Constant(value_float=0.0), peak), op.Exp(op.Sub(scores, lse)))
    swap = [0, 1, 3, 2]
    grad_value = op.MatMul(op.Transpose(probs, perm=swap), g)
    row = op.ReduceSum(op.Mul(g, o), last, keepdims=1)
    grad_scores = op.Mul(probs, op.Sub(op.MatMul(g, op.Transpose(v, perm=swap)), row))
    factor = op.CastLike(op.Constant(value_float=scale), q)
    grad_query = op.Mul(op.MatMul(grad_scores, k), factor)
    grad_key = op.Mul(op.MatMul(op.Transpose(grad_scores, perm=swap), q), factor)
    return op.CastLike(grad_query, query), op.CastLike(grad_key, key), op.CastLike(grad_value, value)
