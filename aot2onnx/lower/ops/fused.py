"""A multiply fused with an add: ``prims.fma``, ``lerp`` with a scalar weight, ``addcmul``, ``addcdiv``.

They reach the graphs of a compiled optimizer step (``torch.compile(opt.step)``): Dynamo rewrites
``addcmul_``, ``addcdiv_`` with a value and ``add_`` with a tensor alpha into ``prims.fma``, Adam's first
moment is ``lerp_(grad, 1 - beta1)`` and its update ``param.addcdiv_(exp_avg, denom)``. Each rule follows
ATen's CPU kernel's order of operations, with a scalar of 1 left out (exact, and one pass over the
tensor fewer: the optimizer step is memory-bound).

ONNX has no fused multiply-add, so these round the product and then the sum, as ``prims.fma``'s own
implementation in PyTorch does (``(a * b) + c``, what ``aot_eager`` runs). ATen's AVX2/AVX-512 kernels for
``lerp``, ``addcmul`` and ``add`` with an alpha round once (``vec::fmadd``): a result here can be one ulp
from eager's. The exact product-then-sum exists in ONNX Runtime only inside MLAS's Gemm (a [1, 1] x [1, n]
Gemm with the addend as C is a correctly rounded fma per element), at about twice the cost of Mul and Add
on an SGD step, so it is not used.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops import core as torchlib_core

from aot2onnx.lower.registry import project_rule

aten, prims = torch.ops.aten, torch.ops.prims

__all__ = ["aten_addcdiv", "aten_addcmul", "aten_lerp_scalar", "prims_fma"]

_FLOAT32_64 = (ir.DataType.FLOAT, ir.DataType.DOUBLE)
_HALVES = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _constant(value, dtype: ir.DataType) -> ir.Value:
    return op.Constant(value=ir.tensor(np.array(value, dtype=dtype.numpy())))


def _scalar(value: float, like: ir.Value) -> ir.Value:
    """``value`` as a constant of ``like``'s dtype: ATen rounds a Python scalar to the tensor's dtype first."""
    return _constant(value, like.dtype)


@project_rule(prims.fma.default)
def prims_fma(a, b, c):
    """fma(Tensor a, Tensor b, Tensor c) -> Tensor"""
    # b is a Python number where Dynamo wrote the rewrite with a scalar value (addcmul_'s value=1 - beta2).
    b = _scalar(b, a) if isinstance(b, (int, float)) else b
    c = _scalar(c, a) if isinstance(c, (int, float)) else c
    return op.Add(op.Mul(a, b), c)


def _opmath(self, *others):
    """The tensors in the dtype ATen's kernel computes in (float32 for 16-bit floats: their lerp, addcmul and
    addcdiv kernels compute in float32, the scalar unrounded, and round once), and the dtype to round to after,
    or None. Rounding the scalar to bfloat16 first put 33-43% of bfloat16 lerp and addcmul results off."""
    if self.dtype in _HALVES:
        return (*(op.Cast(v, to=ir.DataType.FLOAT) for v in (self, *others)), ir.DataType.FLOAT), self.dtype
    return (self, *others, self.dtype), None


def _rounded(result, dtype):
    return result if dtype is None else op.Cast(result, to=dtype)


@project_rule(aten.lerp.Scalar)
def aten_lerp_scalar(self, end, weight: float):
    """lerp.Scalar(Tensor self, Tensor end, Scalar weight) -> Tensor"""
    if self.dtype not in (*_FLOAT32_64, *_HALVES) or not isinstance(weight, (int, float)):
        return torchlib_core.aten_lerp(self, end, weight)
    # ATen's formula (ATen/native/Lerp.h) in the tensor's dtype, with its branch chosen here: the weight is
    # a constant. torch_lib computed both branches and a Where per element, and picked by weight < 0.5
    # where ATen takes |weight| < 0.5.
    (a, b, dtype), out = _opmath(self, end)
    w = np.array(weight, dtype=dtype.numpy())
    diff = op.Sub(b, a)
    if abs(w) < 0.5:
        return _rounded(op.Add(a, op.Mul(_constant(w, dtype), diff)), out)
    return _rounded(op.Sub(b, op.Mul(diff, _constant(np.array(1, dtype=w.dtype) - w, dtype))), out)


@project_rule(aten.addcmul.default)
def aten_addcmul(self, tensor1, tensor2, value: float = 1.0):
    """addcmul(Tensor self, Tensor tensor1, Tensor tensor2, *, Scalar value=1) -> Tensor"""
    if self.dtype not in (*_FLOAT32_64, *_HALVES) or not isinstance(value, (int, float)):
        return torchlib_core.aten_addcmul(self, tensor1, tensor2, value)
    # ATen: self + value * tensor1 * tensor2 (PointwiseOpsKernel.cpp), the product left to right.
    (a, t1, t2, dtype), out = _opmath(self, tensor1, tensor2)
    scaled = t1 if value == 1 else op.Mul(_constant(value, dtype), t1)
    return _rounded(op.Add(a, op.Mul(scaled, t2)), out)


@project_rule(aten.addcdiv.default)
def aten_addcdiv(self, tensor1, tensor2, value: float = 1.0):
    """addcdiv(Tensor self, Tensor tensor1, Tensor tensor2, *, Scalar value=1) -> Tensor"""
    if self.dtype not in (*_FLOAT32_64, *_HALVES) or not isinstance(value, (int, float)):
        return torchlib_core.aten_addcdiv(self, tensor1, tensor2, value)
    # ATen: self + value * tensor1 / tensor2, the value applied before the division (torch_lib divided
    # first, which rounds differently where value is not a power of two).
    (a, t1, t2, dtype), out = _opmath(self, tensor1, tensor2)
    scaled = t1 if value == 1 else op.Mul(_constant(value, dtype), t1)
    return _rounded(op.Add(a, op.Div(scaled, t2)), out)
