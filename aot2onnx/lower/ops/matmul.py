"""Matrix-vector products, written so that ONNX Runtime's optimizer computes them right.

ONNX Runtime 1.31 fuses Transpose -> MatMul into a FusedMatMul with transA; when the right operand is a
vector, the fused kernel returns wrong values (measured here: mv(x.t(), v) off by up to 8 for a 5x10 x,
exact with graph optimizations disabled). ``mv(x.t(), v)`` is what the backward of mv, addmv and addr
computes. A matrix-matrix product with a one-column right operand is fused correctly.
"""

from __future__ import annotations

import torch
from onnxscript import opset18 as op

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
    product = aten_mv(mat, vec)
    if alpha != 1:
        product = op.Mul(product, op.CastLike(alpha, product))
    if beta == 0:  # ATen ignores self then, NaN included
        return product
    return op.Add(op.Mul(self, op.CastLike(beta, self)) if beta != 1 else self, product)
