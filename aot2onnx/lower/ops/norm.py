"""Normalization: batch norm in training mode, layer norm in double.

torch_lib lowers ``_native_batch_norm_legit_functional`` with inference semantics whatever ``training``
says (it normalizes with the running statistics and returns them unchanged), which is wrong for training.
This rule computes the batch statistics and the running-statistics update as ATen does.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir
import torch
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops import core as torchlib_core

from aot2onnx.lower.registry import project_rule

aten = torch.ops.aten


def _per_channel(value, rank: int):
    """Reshapes a (C,) value to broadcast against an (N, C, *spatial) input."""
    return op.Reshape(value, op.Constant(value_ints=[1, -1] + [1] * (rank - 2)))


@project_rule(aten._native_batch_norm_legit_functional.default)
def aten__native_batch_norm_legit_functional(
    input,
    weight=None,
    bias=None,
    running_mean=None,
    running_var=None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
):
    """_native_batch_norm_legit_functional(Tensor input, Tensor? weight, Tensor? bias, Tensor running_mean, Tensor running_var, bool training, float momentum, float eps) -> (Tensor, Tensor, Tensor, Tensor running_mean_out, Tensor running_var_out)"""
    rank = len(input.shape)
    # Mixed precision (autocast): a bfloat16 input with float32 parameters and running statistics. ATen
    # computes in the parameters' dtype and returns the normalized input in the input's dtype, the running
    # statistics in the parameters'. The rule does the same (ONNX's Mul refuses a bfloat16 beside a float32
    # value). The saved mean and inverse std are float32 from ATen's CPU kernel but bfloat16 by its meta
    # function, which the captured graphs (the backward's inputs) are typed by: they follow the meta.
    reference = next((v for v in (running_mean, weight) if v is not None), None)
    dtype = reference.dtype if reference is not None else input.dtype
    given, input = input, input if dtype == input.dtype else op.Cast(input, to=dtype)
    if not training:
        mean = _per_channel(running_mean, rank)
        rstd = op.Reciprocal(op.Sqrt(op.Add(_per_channel(running_var, rank), op.CastLike(eps, input))))
        out = op.Mul(op.Sub(input, mean), rstd)
        empty = op.CastLike(op.ConstantOfShape(op.Constant(value_ints=[0])), input)
        save_mean, save_rstd = empty, op.Identity(empty)
        new_mean, new_var = op.Identity(running_mean), op.Identity(running_var)
    else:
        axes = op.Constant(value_ints=[0, *range(2, rank)])
        mean = op.ReduceMean(input, axes, keepdims=1)
        centered = op.Sub(input, mean)
        var = op.ReduceMean(op.Mul(centered, centered), axes, keepdims=1)  # biased, as normalization uses
        rstd = op.Reciprocal(op.Sqrt(op.Add(var, op.CastLike(eps, input))))
        flat = op.Constant(value_ints=[-1])
        save_mean, save_rstd, batch_var = op.Reshape(mean, flat), op.Reshape(rstd, flat), op.Reshape(var, flat)
        channels = op.Shape(input, start=1, end=2)
        if dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE):
            # Normalization and the affine map in one pass over the input: ONNX Runtime's inference-mode
            # BatchNormalization with the batch statistics (on 32 x 32 x 64 x 64: 3.5 against 4.1 ms for
            # the whole op spelled as Mul, Mul, Add).
            scale = weight if weight is not None else op.CastLike(op.ConstantOfShape(channels, value=ir.tensor([1.0])), input)
            shift = bias if bias is not None else op.CastLike(op.ConstantOfShape(channels), input)
            out = op.BatchNormalization(input, scale, shift, save_mean, batch_var, epsilon=eps)
            weight = bias = None  # applied already
        else:
            out = op.Mul(centered, rstd)
        # The running variance is updated with the unbiased estimate: var * n / (n - 1).
        n = op.CastLike(op.Div(op.Size(input), channels), input)
        unbiased = op.Mul(batch_var, op.Div(n, op.Sub(n, op.CastLike(1.0, input))))
        keep = op.CastLike(1.0 - momentum, input)
        step = op.CastLike(momentum, input)
        new_mean = op.Add(op.Mul(running_mean, keep), op.Mul(save_mean, step))
        new_var = op.Add(op.Mul(running_var, keep), op.Mul(unbiased, step))
    if weight is not None:
        out = op.Mul(out, _per_channel(weight, rank))
    if bias is not None:
        out = op.Add(out, _per_channel(bias, rank))
    if given is not input:
        out, save_mean, save_rstd = (op.CastLike(v, given) for v in (out, save_mean, save_rstd))
    return out, save_mean, save_rstd, new_mean, new_var


@project_rule(aten.native_layer_norm.default)
def aten_native_layer_norm(input, normalized_shape: Sequence[int], weight=None, bias=None, eps: float = 1e-05):
    """native_layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)"""
    if input.dtype != ir.DataType.DOUBLE:
        return torchlib_core.aten_native_layer_norm(input, normalized_shape, weight, bias, eps)
    # ONNX Runtime's LayerNormalization keeps its mean and inverse std in float whatever the input; torch
    # keeps them in double for a double input, and the backward graph reads them. Spelled out in double.
    axes = op.Constant(value_ints=list(range(-len(normalized_shape), 0)))
    mean = op.ReduceMean(input, axes, keepdims=1)
    centered = op.Sub(input, mean)
    var = op.ReduceMean(op.Mul(centered, centered), axes, keepdims=1)
    rstd = op.Reciprocal(op.Sqrt(op.Add(var, op.CastLike(eps, input))))
    out = op.Mul(centered, rstd)
    if weight is not None:
        out = op.Mul(out, weight)
    if bias is not None:
        out = op.Add(out, bias)
    return out, mean, rstd
