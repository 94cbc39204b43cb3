"""Losses whose torch_lib rule returns a wrong auxiliary output that the backward reads."""

from __future__ import annotations

import torch
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops import nn as torchlib_nn

from aot2onnx.lower.registry import project_rule

aten = torch.ops.aten

_NONE = 0  # torch's Reduction.NONE


@project_rule(aten.nll_loss_forward.default)
def aten_nll_loss_forward(self, target, weight, reduction: int, ignore_index: int):
    """nll_loss_forward(Tensor self, Tensor target, Tensor? weight, int reduction, SymInt ignore_index) -> (Tensor output, Tensor total_weight)"""
    # torch_lib fakes total_weight as the number of targets. nll_loss_backward divides the gradient of a
    # mean by total_weight, and AOTAutograd feeds it the forward's value, so with the fake one every
    # gradient of a mean cross-entropy came out N times too large. total_weight is the sum of the weights
    # of the targets that are not ignored (their count without weights), 0 for reduction='none' on a batch.
    output = torchlib_nn.aten_nll_loss(self, target, weight, reduction, ignore_index)
    batched = len(self.shape) > 1
    if reduction == _NONE and batched:
        return output, op.CastLike(op.Constant(value_float=0.0), self)
    kept = op.Not(op.Equal(target, op.CastLike(ignore_index, target)))
    if weight is None:
        return output, op.CastLike(op.ReduceSum(op.Cast(kept, to=1), keepdims=0), self)
    safe_target = op.Where(kept, target, op.CastLike(0, target))
    picked = op.Gather(weight, safe_target, axis=0)
    return output, op.ReduceSum(op.Where(kept, picked, op.CastLike(0.0, weight)), keepdims=0)
