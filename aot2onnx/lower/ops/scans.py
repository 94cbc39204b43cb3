"""Scans: ops whose element i depends on the elements before it along an axis, computed step by step in an
ONNX Loop where ATen's kernel accumulates in order (cummax, cummin and cumprod, written as masked
reductions, are with the reductions)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op

from aot2onnx.lower.ops._control import loop
from aot2onnx.lower.ops.pointwise import _HALVES, _log1p
from aot2onnx.lower.registry import project_rule

aten = torch.ops.aten


def _log_add_exp_step(x, total):
    # ATen's _log_add_exp_helper(x, total), one step of its logcumsumexp scan: log1p(exp(min - max)) + max,
    # or x where min and max are the same infinity; a NaN total is carried on (std::min(x, nan) is x: its
    # Where(total < x, total, x) form; the isnan check makes it the NaN).
    nan_total = op.IsNaN(total)
    low = op.Where(nan_total, total, op.Where(op.Less(total, x), total, x))
    high = op.Where(nan_total, total, op.Where(op.Less(x, total), total, x))
    general = op.Add(_log1p(op.Exp(op.Sub(low, high))), high)  # never -0.0: Where's first operand
    usable = op.Or(op.Not(op.Equal(low, high)), op.Not(op.Or(op.IsInf(low), op.IsNaN(low))))
    return op.Where(usable, general, x)


@project_rule(aten.logcumsumexp.default)
def aten_logcumsumexp(self, dim: int):
    """logcumsumexp(Tensor self, int dim) -> Tensor

    ATen's CPU kernel: a scan along ``dim`` from -inf, each step ``_log_add_exp_helper`` in the accumulation
    type (double for float32, float32 for 16-bit floats), here one ONNX Loop over the axis. torch_lib's
    ``log(cumsum(exp(x - max))) + max`` with the whole axis's max underflowed every element far below the
    max: ``logcumsumexp([-200, 0])`` began with -inf (eager -200), and +inf or an all -inf row gave NaN.
    """
    rank = len(self.shape)
    if rank == 0:
        return op.Identity(self)
    acc = ir.DataType.FLOAT if self.dtype in _HALVES else ir.DataType.DOUBLE
    dim %= rank
    perm = [dim, *(i for i in range(rank) if i != dim)]
    x = op.Transpose(op.Cast(self, to=acc), perm=perm)
    start = op.ConstantOfShape(op.Shape(x, start=1), value=ir.tensor(np.array([-np.inf], dtype=acc.numpy())))
    start.dtype = acc

    def body(i, total):
        step = _log_add_exp_step(op.Gather(x, i, axis=0), total)
        return [step, op.Identity(step)]

    length = op.Squeeze(op.Shape(x, start=0, end=1), op.Constant(value_ints=[0]))
    _, steps = loop(length, [start], body, iteration=True, scanned=1)
    inverse = [perm.index(i) for i in range(rank)]
    return op.CastLike(op.Transpose(steps, perm=inverse), self)
