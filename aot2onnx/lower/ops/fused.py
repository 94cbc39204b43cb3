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

from aot2onnx.lower.ops._common import opmath
from aot2onnx.lower.registry import project_rule

aten, prims = torch.ops.aten, torch.ops.prims

__all__ = ["aten_addcdiv", "aten_addcmul", "aten_lerp_scalar", "prims_fma"]

_FLOAT32_64 = (ir.DataType.FLOAT, ir.DataType.DOUBLE)
# ATen's 16-bit lerp, addcmul and addcdiv compute in float32, the scalar unrounded, and round once: each rule
# runs its float32 branch on the inputs cast up (rounding the scalar to bfloat16 first put 33-43% of bfloat16
# lerp and addcmul results off eager's).
_HALVES = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _scalar(value: float, like: ir.Value) -> ir.Value:
    """``value`` as a constant of ``like``'s dtype: ATen rounds a Python scalar to the tensor's dtype first."""
    return op.Constant(value=ir.tensor(np.array(value, dtype=like.dtype.numpy())))


@project_rule(prims.fma.default)
def prims_fma(a, b, c):
    """fma(Tensor a, Tensor b, Tensor c) -> Tensor"""
    # b is a Python number where Dynamo wrote the rewrite with a scalar value (addcmul_'s value=1 - beta2).
    b = _scalar(b, a) if isinstance(b, (int, float)) else b
    c = _scalar(c, a) if isinstance(c, (int, float)) else c
    return op.Add(op.Mul(a, b), c)


@project_rule(aten.lerp.Scalar)
def aten_lerp_scalar(self, end, weight: float):
    """lerp.Scalar(Tensor self, Tensor end, Scalar weight) -> Tensor"""
    if self.dtype in _HALVES and isinstance(weight, (int, float)):
        return opmath(lambda a, b: aten_lerp_scalar(a, b, weight), self, end)
    if self.dtype not in _FLOAT32_64 or not isinstance(weight, (int, float)):
        return torchlib_core.aten_lerp(self, end, weight)
    # ATen's formula (ATen/native/Lerp.h) in the tensor's dtype, with its branch chosen here: the weight is
    # a constant. torch_lib computed both branches and a Where per element, and picked by weight < 0.5
    # where ATen takes |weight| < 0.5.
    w = np.array(weight, dtype=self.dtype.numpy())
    diff = op.Sub(end, self)
    if abs(w) < 0.5:
        return op.Add(self, op.Mul(_scalar(w, self), diff))
    return op.Sub(end, op.Mul(diff, _scalar(np.array(1, dtype=w.dtype) - w, self)))


@project_rule(aten.addcmul.default)
def aten_addcmul(self, tensor1, tensor2, value: float = 1.0):
    """addcmul(Tensor self, Tensor tensor1, Tensor tensor2, *, Scalar value=1) -> Tensor"""
    if self.dtype in _HALVES and isinstance(value, (int, float)):
        return opmath(lambda a, t1, t2: aten_addcmul(a, t1, t2, value), self, tensor1, tensor2)
    if self.dtype not in _FLOAT32_64 or not isinstance(value, (int, float)):
        return torchlib_core.aten_addcmul(self, tensor1, tensor2, value)
    # ATen: self + value * tensor1 * tensor2 (PointwiseOpsKernel.cpp), the product left to right.
    scaled = tensor1 if value == 1 else op.Mul(_scalar(value, self), tensor1)
    return op.Add(self, op.Mul(scaled, tensor2))


@project_rule(aten.addcdiv.default)
def aten_addcdiv(self, tensor1, tensor2, value: float = 1.0):
    """addcdiv(Tensor self, Tensor tensor1, Tensor tensor2, *, Scalar value=1) -> Tensor"""
    if self.dtype in _HALVES and isinstance(value, (int, float)):
        return opmath(lambda a, t1, t2: aten_addcdiv(a, t1, t2, value), self, tensor1, tensor2)
    if self.dtype not in _FLOAT32_64 or not isinstance(value, (int, float)):
        return torchlib_core.aten_addcdiv(self, tensor1, tensor2, value)
    # ATen: self + value * tensor1 / tensor2, the value applied before the division (torch_lib divided
    # first, which rounds differently where value is not a power of two).
    scaled = tensor1 if value == 1 else op.Mul(_scalar(value, self), tensor1)
    return op.Add(self, op.Div(scaled, tensor2))
