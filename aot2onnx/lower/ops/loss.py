"""Losses: those whose torch_lib rule returns a wrong auxiliary output that the backward reads, and the chunked
linear cross-entropy."""

from __future__ import annotations

import importlib
import importlib.util

import onnx_ir as ir
import torch
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops import nn as torchlib_nn

from aot2onnx.capture import chunked_loss
from aot2onnx.lower.ops._common import cast, static_dim, static_dims
from aot2onnx.lower.ops._control import loop
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


# --- torch.nn.functional.linear_cross_entropy with options (torch 2.13 on): its chunked custom ops.
#
# The point of the op is that the [N, V] logits never exist at once: the batch is processed B rows at a time.
# Here the chunks are one ONNX Loop (one iteration's [B, V] values live at a time). The batch is padded with
# rows of weight 0 up to a multiple of B (zero rows have finite logits, so they add exactly 0), and the
# per-row weights follow ATen's _ChunkContext.neg_weight_target: -w[t] / sum(w[t]) for "mean" (NaN when that
# sum is 0), -w[t] for "sum", w[t] for "none"; 0 where the target is ignore_index.

_torch_nn_ops = None
if importlib.util.find_spec("torch.nn.modules.linear_cross_entropy") is not None:
    importlib.import_module("torch.nn.modules.linear_cross_entropy")  # registers the torch_nn ops
    _torch_nn_ops = torch.ops.torch_nn


def _lce_setup(input, linear_weight, target, weight, reduction: str, ignore_index: int, batch_chunk_size: int,
               grad_output=None):
    """The padded, chunked operands: (x [C, B, H], t [C, B], w [C, B], W, compute dtype, N, B, C). With
    ``grad_output`` (reduction="none"'s backward), the weights are -w[t] * grad_output, as ATen folds the
    upstream gradient in."""
    n, h = static_dims(input) or (None, None)
    v = static_dim(linear_weight, 0)
    if n is None or h is None or v is None:
        raise NotImplementedError("linear_cross_entropy's chunked op needs static sizes")
    compute = input.dtype
    if compute in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        compute = ir.DataType.FLOAT  # ATen's acc_dtype for 16-bit inputs
    x, lw = cast(input, compute), cast(linear_weight, compute)
    ignored = op.Equal(target, op.Constant(value_int=ignore_index))
    t = target
    if ignore_index < 0 or ignore_index >= v:  # an ignored row reads class 0 instead, as ATen's corrected_target
        t = op.Where(ignored, op.Constant(value_int=0), target)
    zero = op.CastLike(op.Constant(value_float=0.0), x)
    if weight is None:
        w = op.Where(ignored, zero, op.CastLike(op.Constant(value_float=1.0), x))
    else:
        w = op.Where(ignored, zero, op.Gather(cast(weight, compute), t, axis=0))
    if reduction == "mean":
        d = op.ReduceSum(w, keepdims=0)
        w = op.Div(w, op.Where(op.Equal(d, zero), op.CastLike(op.Constant(value_float=float("nan")), x), op.Neg(d)))
    elif reduction == "sum":
        w = op.Neg(w)
    elif grad_output is not None:
        w = op.Mul(op.Neg(w), cast(grad_output, compute))
    b = max(1, min(batch_chunk_size, n))
    chunks = -(-n // b)
    extra = chunks * b - n
    if extra:
        x = op.Pad(x, op.Constant(value_ints=[0, 0, extra, 0]), zero)
        t = op.Pad(t, op.Constant(value_ints=[0, extra]), op.Constant(value_int=0))
        w = op.Pad(w, op.Constant(value_ints=[0, extra]), zero)
    x = op.Reshape(x, op.Constant(value_ints=[chunks, b, h]))
    t = op.Reshape(t, op.Constant(value_ints=[chunks, b]))
    w = op.Reshape(w, op.Constant(value_ints=[chunks, b]))
    return x, t, w, lw, compute, n, b, chunks


def _lce_chunk(x, t, w, lw, bias, i):
    """Chunk i's rows, targets, weights, its logits shifted by each row's max, and their exp and row sums."""
    xc, tc, wc = (op.Gather(a, i, axis=0) for a in (x, t, w))
    logits = op.MatMul(xc, op.Transpose(lw, perm=[1, 0]))
    if bias is not None:
        logits = op.Add(logits, op.CastLike(bias, logits))
    shifted = op.Sub(logits, op.ReduceMax(logits, op.Constant(value_ints=[1]), keepdims=1))
    at_target = op.Squeeze(op.GatherElements(shifted, op.Unsqueeze(tc, op.Constant(value_ints=[1])), axis=1),
                           op.Constant(value_ints=[1]))
    exp = op.Exp(shifted)
    denominator = op.ReduceSum(exp, op.Constant(value_ints=[1]), keepdims=0)
    return xc, tc, wc, at_target, exp, denominator


def _typed(value, dtype):
    value.dtype = dtype
    return value


def _lce_grads(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, batch_chunk_size,
               compute_input_grad, compute_linear_weight_grad, compute_linear_bias_grad, grad_output=None):
    """(loss, grad_input, grad_linear_weight, grad_linear_bias) as ATen's chunked accumulator's grad loop
    (with ``grad_output``: reduction="none"'s backward, whose loss is meaningless)."""
    x, t, w, lw, compute, n, b, chunks = _lce_setup(
        input, linear_weight, target, weight, reduction, ignore_index, batch_chunk_size, grad_output)
    v, h = static_dims(linear_weight)
    zeros = lambda shape: _typed(op.CastLike(op.ConstantOfShape(op.Constant(value_ints=shape)), lw), compute)

    def body(i, loss, grad_weight, grad_bias):
        xc, tc, wc, at_target, exp, denominator = _lce_chunk(x, t, w, lw, linear_bias, i)
        loss = op.Sub(op.Add(loss, op.ReduceSum(op.Mul(wc, at_target), keepdims=0)),
                      op.ReduceSum(op.Mul(wc, op.Log(denominator)), keepdims=0))
        # The logits' gradient: softmax * w less w at the target (w is -1/d for a mean). ATen adds the target
        # term to each gradient after the softmax term (index_add); here it is folded into the [B, V] chunk, so
        # each gradient is one product: grad_weight -= g^T x (a Gemm accumulating into the carried value),
        # grad_input = -g W, grad_bias -= sum(g).
        probs = op.Mul(exp, op.Unsqueeze(op.Div(wc, denominator), op.Constant(value_ints=[1])))
        rows = op.Unsqueeze(tc, op.Constant(value_ints=[1]))
        at_rows = op.Sub(op.GatherElements(probs, rows, axis=1), op.Unsqueeze(wc, op.Constant(value_ints=[1])))
        g = op.ScatterElements(probs, rows, at_rows, axis=1)
        grad_weight = op.Gemm(g, xc, grad_weight, alpha=-1.0, beta=1.0, transA=1)
        grad_bias = op.Sub(grad_bias, op.ReduceSum(g, op.Constant(value_ints=[0]), keepdims=0))
        grad_input = op.Gemm(g, lw, alpha=-1.0)
        return [_typed(loss, compute), _typed(grad_weight, compute), _typed(grad_bias, compute),
                _typed(grad_input, compute)]

    start = _typed(op.CastLike(op.Constant(value_float=0.0), lw), compute)
    loss, grad_weight, grad_bias, grad_input = loop(
        chunks, [start, zeros([v, h]), zeros([v])], body, iteration=True, scanned=1)
    if n == 0 and reduction == "mean":
        loss = op.CastLike(op.Constant(value_float=float("nan")), lw)
    grad_input = op.Slice(op.Reshape(grad_input, op.Constant(value_ints=[chunks * b, h])),
                          op.Constant(value_ints=[0]), op.Constant(value_ints=[n]), op.Constant(value_ints=[0]))
    empty = lambda rank: op.CastLike(op.ConstantOfShape(op.Constant(value_ints=[0] * rank)), input)
    return (op.CastLike(loss, input),
            op.CastLike(grad_input, input) if compute_input_grad else empty(2),
            op.CastLike(grad_weight, input) if compute_linear_weight_grad else empty(2),
            op.CastLike(grad_bias, input) if compute_linear_bias_grad else empty(1))


if _torch_nn_ops is not None:

    @project_rule(_torch_nn_ops._linear_cross_entropy_batch_chunked.default)
    def torch_nn_linear_cross_entropy_batch_chunked(
            input, linear_weight, target, linear_bias, weight, reduction: str, ignore_index: int,
            label_smoothing: float, batch_chunk_size: int, acc_policy: str, acc_dtype, allow_retain_graph: bool,
            compute_input_grad: bool, compute_linear_weight_grad: bool, compute_linear_bias_grad: bool):
        """_linear_cross_entropy_batch_chunked(Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias, Tensor? weight, str reduction, SymInt ignore_index, float label_smoothing, SymInt batch_chunk_size, str acc_policy, ScalarType acc_dtype, bool allow_retain_graph, bool compute_input_grad, bool compute_linear_weight_grad, bool compute_linear_bias_grad) -> (Tensor, Tensor, Tensor, Tensor)"""
        # The forward computes the loss and every gradient in one pass over the chunks; the backward graph
        # only scales the gradients by the loss's cotangent.
        if label_smoothing != 0.0 or reduction not in ("mean", "sum"):
            raise NotImplementedError(f"the chunked op takes no label smoothing and reduction mean or sum, got "
                                      f"{label_smoothing=}, {reduction=}")
        return _lce_grads(input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
                          batch_chunk_size, compute_input_grad, compute_linear_weight_grad,
                          compute_linear_bias_grad)

    @project_rule(_torch_nn_ops._linear_cross_entropy_batch_chunked_no_reduction.default)
    def torch_nn_linear_cross_entropy_batch_chunked_no_reduction(
            input, linear_weight, target, linear_bias, weight, ignore_index: int, batch_chunk_size: int,
            acc_policy: str, acc_dtype):
        """_linear_cross_entropy_batch_chunked_no_reduction(Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias, Tensor? weight, SymInt ignore_index, SymInt batch_chunk_size, str acc_policy, ScalarType acc_dtype) -> Tensor"""
        # The per-row loss w[t] * (log(sum(exp(shifted))) - shifted[t]); the backward graph recomputes the
        # chunks in a Loop of its own (capture/chunked_loss.py's op, below).
        x, t, w, lw, compute, n, b, chunks = _lce_setup(
            input, linear_weight, target, weight, "none", ignore_index, batch_chunk_size)

        def body(i, carried):
            _, _, wc, at_target, _, denominator = _lce_chunk(x, t, w, lw, linear_bias, i)
            return [op.Identity(carried), _typed(op.Mul(op.Sub(op.Log(denominator), at_target), wc), compute)]

        start = _typed(op.CastLike(op.Constant(value_float=0.0), lw), compute)
        _, losses = loop(chunks, [start], body, iteration=True, scanned=1)
        losses = op.Slice(op.Reshape(losses, op.Constant(value_ints=[-1])), op.Constant(value_ints=[0]),
                          op.Constant(value_ints=[n]), op.Constant(value_ints=[0]))
        return op.CastLike(losses, input)


if chunked_loss.NONE_BACKWARD is not None:

    @project_rule(chunked_loss.NONE_BACKWARD)
    def aot2onnx_linear_cross_entropy_none_backward(
            input, linear_weight, target, linear_bias, weight, grad_output, ignore_index: int, batch_chunk_size: int,
            acc_policy: str, acc_dtype, compute_input_grad: bool, compute_linear_weight_grad: bool,
            compute_linear_bias_grad: bool):
        """aot2onnx::linear_cross_entropy_none_backward(Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias, Tensor? weight, Tensor grad_output, SymInt ignore_index, SymInt batch_chunk_size, str acc_policy, ScalarType acc_dtype, bool compute_input_grad, bool compute_linear_weight_grad, bool compute_linear_bias_grad) -> (Tensor, Tensor, Tensor, Tensor)"""
        # reduction="none"'s backward as one Loop over the chunks, as the scalar reductions' forward.
        return _lce_grads(input, linear_weight, target, linear_bias, weight, "none", ignore_index, batch_chunk_size,
                          compute_input_grad, compute_linear_weight_grad, compute_linear_bias_grad,
                          grad_output=grad_output)

