"""Normalization: batch norm in training mode, layer norm in double.

torch_lib lowers ``_native_batch_norm_legit_functional`` with inference semantics whatever ``training``
says (it normalizes with the running statistics and returns them unchanged), which is wrong for training.
These rules compute the batch statistics and the running-statistics update as ATen does.

Constants (eps, momentum) are made in the input's dtype: a Python float through ``CastLike`` goes through
float32, and ONNX's ``epsilon`` attributes are float32, so a float64 model would add eps rounded to float32
(``layer_norm(eps=0.1)`` was 2e-9 relative off). Float64 batch norm adds eps to the variance itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops import core as torchlib_core

from aot2onnx.lower.registry import project_rule

aten = torch.ops.aten


def _scalar(value: float, like):
    """``value`` as a scalar of ``like``'s dtype, exact in float64."""
    if like.dtype == ir.DataType.DOUBLE:
        return op.Constant(value=ir.tensor(np.float64(value)))
    return op.CastLike(op.Constant(value_float=value), like)


def _cast(value, dtype: ir.DataType):
    """``value`` in ``dtype``, its shape and dtype recorded (the rules read ranks from ``.shape``)."""
    if value.dtype == dtype:
        return value
    cast = op.Cast(value, to=dtype)
    cast.shape, cast.dtype = value.shape, dtype
    return cast


def _per_channel(value, rank: int):
    """Reshapes a (C,) value to broadcast against an (N, C, *spatial) input."""
    return op.Reshape(value, op.Constant(value_ints=[1, -1] + [1] * (rank - 2)))


def _batch_norm_training(input, weight, bias, eps: float):
    """Normalizes ``input`` with its batch statistics: (output, batch mean, batch inverse std, biased batch
    variance), the last three per channel, in ``input``'s dtype."""
    rank = len(input.shape)
    axes = op.Constant(value_ints=[0, *range(2, rank)])
    mean = op.ReduceMean(input, axes, keepdims=1)
    centered = op.Sub(input, mean)
    var = op.ReduceMean(op.Mul(centered, centered), axes, keepdims=1)  # biased, as normalization uses
    var_eps = op.Add(var, _scalar(eps, input))
    rstd = op.Reciprocal(op.Sqrt(var_eps))
    flat = op.Constant(value_ints=[-1])
    save_mean, save_rstd, batch_var = op.Reshape(mean, flat), op.Reshape(rstd, flat), op.Reshape(var, flat)
    if input.dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE):
        # Normalization and the affine map in one pass over the input: ONNX Runtime's inference-mode
        # BatchNormalization with the batch statistics (on 32 x 32 x 64 x 64: 3.5 against 4.1 ms for
        # the whole op spelled as Mul, Mul, Add). Its epsilon is a float32 attribute: in float64 the
        # variance comes with eps added already.
        channels = op.Shape(input, start=1, end=2)
        scale = weight if weight is not None else op.CastLike(op.ConstantOfShape(channels, value=ir.tensor([1.0])), input)
        shift = bias if bias is not None else op.CastLike(op.ConstantOfShape(channels), input)
        if input.dtype == ir.DataType.DOUBLE:
            out = op.BatchNormalization(input, scale, shift, save_mean, op.Reshape(var_eps, flat), epsilon=0.0)
        else:
            out = op.BatchNormalization(input, scale, shift, save_mean, batch_var, epsilon=eps)
    else:
        out = _affine(op.Mul(centered, rstd), weight, bias, rank)
    return out, save_mean, save_rstd, batch_var


def _affine(out, weight, bias, rank: int):
    if weight is not None:
        out = op.Mul(out, _per_channel(weight, rank))
    if bias is not None:
        out = op.Add(out, _per_channel(bias, rank))
    return out


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
    given, input = input, _cast(input, dtype)
    if not training:
        mean = _per_channel(running_mean, rank)
        rstd = op.Reciprocal(op.Sqrt(op.Add(_per_channel(running_var, rank), _scalar(eps, input))))
        out = _affine(op.Mul(op.Sub(input, mean), rstd), weight, bias, rank)
        empty = op.CastLike(op.ConstantOfShape(op.Constant(value_ints=[0])), input)
        save_mean, save_rstd = empty, op.Identity(empty)
        new_mean, new_var = op.Identity(running_mean), op.Identity(running_var)
    else:
        out, save_mean, save_rstd, batch_var = _batch_norm_training(input, weight, bias, eps)
        # The running variance is updated with the unbiased estimate: var * n / (n - 1).
        channels = op.Shape(input, start=1, end=2)
        n = op.CastLike(op.Div(op.Size(input), channels), input)
        unbiased = op.Mul(batch_var, op.Div(n, op.Sub(n, _scalar(1.0, input))))
        keep, step = _scalar(1.0 - momentum, input), _scalar(momentum, input)
        new_mean = op.Add(op.Mul(running_mean, keep), op.Mul(save_mean, step))
        new_var = op.Add(op.Mul(running_var, keep), op.Mul(unbiased, step))
    if given is not input:
        out, save_mean, save_rstd = (op.CastLike(v, given) for v in (out, save_mean, save_rstd))
    return out, save_mean, save_rstd, new_mean, new_var


@project_rule(aten._native_batch_norm_legit.no_stats)
def aten__native_batch_norm_legit_no_stats(
    input, weight=None, bias=None, training: bool = True, momentum: float = 0.1, eps: float = 1e-5
):
    """_native_batch_norm_legit.no_stats(Tensor input, Tensor? weight, Tensor? bias, bool training, float momentum, float eps) -> (Tensor, Tensor, Tensor)"""
    # Without running statistics ATen normalizes with the batch's whatever ``training`` says. torch_lib's rule
    # mixed a float32 constant into float64 statistics (ONNX Runtime refused the model).
    given, input = input, input if weight is None else _cast(input, weight.dtype)
    out, save_mean, save_rstd, _ = _batch_norm_training(input, weight, bias, eps)
    if given is not input:
        out, save_mean, save_rstd = (op.CastLike(v, given) for v in (out, save_mean, save_rstd))
    return out, save_mean, save_rstd


@project_rule(aten._native_batch_norm_legit_no_training.default)
def aten__native_batch_norm_legit_no_training(
    input, weight=None, bias=None, running_mean=None, running_var=None, momentum: float = 0.1, eps: float = 1e-5
):
    """_native_batch_norm_legit_no_training(Tensor input, Tensor? weight, Tensor? bias, Tensor running_mean, Tensor running_var, float momentum, float eps) -> (Tensor, Tensor, Tensor)"""
    if input.dtype != ir.DataType.DOUBLE:
        return torchlib_core.aten__native_batch_norm_no_training(input, weight, bias, running_mean, running_var,
                                                                 momentum, eps)
    # BatchNormalization's epsilon is a float32 attribute: in float64 it is added to the variance here.
    channels = op.Shape(input, start=1, end=2)
    scale = weight if weight is not None else op.CastLike(op.ConstantOfShape(channels, value=ir.tensor([1.0])), input)
    shift = bias if bias is not None else op.CastLike(op.ConstantOfShape(channels), input)
    out = op.BatchNormalization(input, scale, shift, running_mean, op.Add(running_var, _scalar(eps, input)),
                                epsilon=0.0)
    empty = op.CastLike(op.ConstantOfShape(op.Constant(value_ints=[0])), input)  # ATen's CPU kernel saves none
    return out, empty, op.Identity(empty)


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
    rstd = op.Reciprocal(op.Sqrt(op.Add(var, _scalar(eps, input))))
    out = op.Mul(centered, rstd)
    if weight is not None:
        out = op.Mul(out, weight)
    if bias is not None:
        out = op.Add(out, bias)
    return out, mean, rstd
