"""Random ops PyTorch's decompositions produce and torch_lib does not lower.

The values come from ONNX Runtime's generator (seeded from torch's at lowering, see translate's
seed_random_ops), so they follow the op's distribution but are not the numbers eager PyTorch draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir
import torch
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops import core as torchlib_core

from aot2onnx.lower.registry import project_rule

aten, prims = torch.ops.aten, torch.ops.prims


@project_rule(prims.uniform.default)
def prims_uniform(shape: Sequence[int], low: float, high: float, dtype: int, device=None, stride=None, generator=None):
    """uniform(SymInt[] shape, *, Scalar low, Scalar high, ScalarType dtype, Device device, SymInt[] stride, Generator? generator=None) -> Tensor"""
    if not all(isinstance(d, int) for d in shape):
        raise NotImplementedError("prims.uniform with symbolic sizes")
    data_type = ir.DataType(dtype)
    if data_type in (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16):
        return op.RandomUniform(shape=list(shape), low=float(low), high=float(high), dtype=data_type)
    drawn = op.RandomUniform(shape=list(shape), low=float(low), high=float(high), dtype=ir.DataType.FLOAT)
    return op.Cast(drawn, to=data_type)


@project_rule(aten.rrelu_with_noise_functional.default)
def aten_rrelu_with_noise_functional(self, noise, lower: float = 0.125, upper: float = 1.0 / 3.0, training: bool = False,
                                     generator=None):
    """rrelu_with_noise_functional(Tensor self, Tensor noise, Scalar lower=0.125, Scalar upper=0.33333333333333331, bool training=False, Generator? generator=None) -> (Tensor, Tensor noise_out)"""
    negative = op.Less(self, op.CastLike(0.0, self))
    if not training:
        # Eval mode: a leaky ReLU with the mean slope; noise is returned unchanged.
        slope = op.CastLike((lower + upper) / 2.0, self)
        return op.Where(negative, op.Mul(self, slope), self), op.Identity(noise)
    # Training: a slope drawn from U(lower, upper) per negative element; noise records it (1 elsewhere).
    slopes = op.RandomUniformLike(self, low=float(lower), high=float(upper))
    noise_out = op.Where(negative, op.CastLike(slopes, self), op.CastLike(1.0, self))
    return op.Mul(self, noise_out), noise_out


@project_rule(aten.native_dropout.default)
def aten_native_dropout(input, p: float, train: bool | None = True):
    """native_dropout(Tensor input, float p, bool? train) -> (Tensor, Tensor)"""
    if train and p == 1:
        # ONNX Runtime's Dropout refuses a ratio of 1 (the run failed); ATen drops everything and scales by 0,
        # so NaN and inf stay NaN.
        mask = op.Expand(op.Constant(value=ir.tensor(False)), op.Shape(input))
        return op.Mul(input, op.CastLike(op.Constant(value_float=0.0), input)), mask
    return torchlib_core.aten_native_dropout(input, p, train)
