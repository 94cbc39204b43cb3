"""Normalization: batch norm in training mode, layer and group norm as ATen computes them.

torch_lib lowers ``_native_batch_norm_legit_functional`` with inference semantics whatever ``training``
says (it normalizes with the running statistics and returns them unchanged), which is wrong for training.
These rules compute the batch statistics and the running-statistics update as ATen does.

Constants (eps, momentum) are made in the input's dtype: a Python float through ``CastLike`` goes through
float32, and ONNX's ``epsilon`` attributes are float32, so a float64 model would add eps rounded to float32
(``layer_norm(eps=0.1)`` was 2e-9 relative off). Float64 batch norm adds eps to the variance itself.

Layer and group norm rows are NaN where ATen's CPU kernel makes them NaN. Its Welford moments
(``RowwiseMoments``) fold the partial moments of the vector lanes (and of the scalar tail) together with a term
``delta * delta * c * m0`` that is ``inf * 0`` when a partial mean squared overflows against a count of 0: for a
row shorter than one vector (8 floats, 4 doubles, on AVX-512 CPUs too), when its mean squared
overflows; for a row a whole number of vectors long, when the mean of its first lane (elements 0, W, 2W, ...)
squared does; otherwise never (a variance past the range gives rstd 0 and the bias). ``layer_norm([1e30, 1, 2,
3])`` is NaN, ``layer_norm([2e19, -2e19, 0, 0])`` the bias. The vector is AVX2's on AVX-512 CPUs too
(``_vector_width``). Eager's mean is Welford's running mean, whose rounding leaves a
residue where huge values cancel (3.8e22 for ``[-1e30, 0.84, 1e30]``, a NaN row in eager); aot2onnx's is the
sum's (0.28, a number): that difference is left. Batch norm is left as it is: eager's contiguous kernel gives the bias there (rstd 0), as
BatchNormalization does (its kernel for other layouts computes in double and gives the exact value).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops import core as torchlib_core

from aot2onnx.lower.ops._common import truth_dtype
from aot2onnx.lower.ops._control import cond
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


def _per_channel_fill(input, value: float):
    """A (C,) vector of ``value`` in ``input``'s dtype, C being ``input``'s channel count (axis 1)."""
    return op.CastLike(op.ConstantOfShape(op.Shape(input, start=1, end=2), value=ir.tensor([value])), input)


def _vector_width(dtype: ir.DataType) -> int:
    """How many elements of ``dtype`` one vector of ATen's layer and group norm kernels holds.

    They are registered with ``REGISTER_DISPATCH``, which leaves the AVX-512 slot empty: on an AVX-512 CPU
    (``get_cpu_capability()`` says "AVX512") they run their AVX2 build, with 32-byte vectors, as on every
    other CPU (measured on a Xeon with AVX-512: ``layer_norm`` of 8 and 16 floats led by 1e30 is NaN, of 9
    the bias, as with AVX2)."""
    return 32 // (8 if dtype == ir.DataType.DOUBLE else 4)


def _squared_overflows(mean):
    return op.IsInf(op.Mul(mean, mean))


def _can_be_nan(n, dtype: ir.DataType) -> bool:
    """Whether ATen's Welford moments can be NaN for rows of ``n`` finite elements (module docstring)."""
    width = _vector_width(dtype)
    return not isinstance(n, int) or n < width or n % width == 0


def _welford_nan(rows, n, mean, dtype: ir.DataType):
    """Where ATen's Welford moments are NaN, shaped like ``mean`` (where ``_can_be_nan``). ``rows``: the input
    (of ``dtype``) with each row's ``n`` elements along its last axis (``n`` an int, or None where symbolic);
    ``mean``: their means."""
    width = _vector_width(dtype)
    short = _squared_overflows(mean)
    if isinstance(n, int) and n < width:
        return short
    lane = op.Slice(rows, op.Constant(value_ints=[0]), op.Constant(value_ints=[2**62]), op.Constant(value_ints=[-1]),
                    op.Constant(value_ints=[width]))
    first_lane = op.Reshape(_squared_overflows(op.ReduceMean(lane, op.Constant(value_ints=[-1]), keepdims=1)),
                            op.Shape(mean))
    if isinstance(n, int):
        return first_lane
    # A symbolic row length: which rule applies is decided at run time.
    length, vector = op.Shape(rows, start=-1), op.Constant(value_ints=[width])
    is_short = op.Less(length, vector)
    whole = op.And(op.Not(is_short), op.Equal(op.Mod(length, vector), op.Constant(value_ints=[0])))
    return op.Or(op.And(is_short, short), op.And(whole, first_lane))


def _rows(input, k: int):
    """``input`` with its last ``k`` axes as one, and that axis's size (an int where static)."""
    shape = list(input.shape)
    n = int(np.prod(shape[-k:], dtype=np.int64)) if all(isinstance(d, int) for d in shape[-k:]) else None
    if k == 1:
        return input, shape[-1]
    if n is None:
        return op.Reshape(input, op.Concat(op.Shape(input, end=-k), op.Constant(value_ints=[-1]), axis=0)), None
    rows = op.Reshape(input, op.Concat(op.Shape(input, end=-k), op.Constant(value_ints=[n]), axis=0), allowzero=1)
    rows.dtype = input.dtype
    return rows, n


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
        scale = weight if weight is not None else _per_channel_fill(input, 1.0)
        shift = bias if bias is not None else _per_channel_fill(input, 0.0)
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
    # ATen's CPU kernel saves no statistics in eval mode: its second and third outputs are empty, as the
    # captured graph says. torch_lib's rule returns the running mean (a float32 graph input, once its Cast
    # to float32 is dropped) and the inverse std there: with symbolic sizes the graph input took the
    # output's empty shape, and ONNX Runtime refused the model's first run (batch_norm(training=False) with
    # dynamic=True).
    if input.dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE) and all(
        v is None or v.dtype == input.dtype for v in (weight, bias, running_mean, running_var)
    ):
        scale = weight if weight is not None else _per_channel_fill(input, 1.0)
        shift = bias if bias is not None else _per_channel_fill(input, 0.0)
        if input.dtype == ir.DataType.DOUBLE:
            # BatchNormalization's epsilon is a float32 attribute: in float64 it is added to the variance here.
            out = op.BatchNormalization(input, scale, shift, running_mean, op.Add(running_var, _scalar(eps, input)),
                                        epsilon=0.0)
        else:
            out = op.BatchNormalization(input, scale, shift, running_mean, running_var, epsilon=eps)
    else:
        out, _, _ = torchlib_core.aten__native_batch_norm_no_training(input, weight, bias, running_mean, running_var,
                                                                    momentum, eps)
    empty = op.CastLike(op.ConstantOfShape(op.Constant(value_ints=[0])), input)
    return out, empty, op.Identity(empty)


_COMPUTED_IN_FLOAT = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


@project_rule(aten.native_batch_norm_backward.default)
def aten_native_batch_norm_backward(
    grad_out,
    input,
    weight,
    running_mean,
    running_var,
    save_mean,
    save_invstd,
    train: bool,
    eps: float,
    output_mask: Sequence[bool],
):
    """native_batch_norm_backward(Tensor grad_out, Tensor input, Tensor? weight, Tensor? running_mean, Tensor? running_var, Tensor? save_mean, Tensor? save_invstd, bool train, float eps, bool[3] output_mask) -> (Tensor, Tensor, Tensor)

    PyTorch's decomposition, with its sums and products in the same order, except where the input
    gradient is assembled: ``dx = (dy - (xc * k + grad_mean)) * grad_scale``, the per-channel affine map
    ``xc * k + grad_mean`` being one BatchNormalization pass (mean 0, variance 1, epsilon 0: ONNX Runtime
    scales by k / sqrt(1) = k exactly). The decomposition writes ``((dy - xc * k) - grad_mean) *
    grad_scale``, a pass more over the input's size on every batch norm of a CNN's backward graph; the two
    differ by the rounding of one addition. 16-bit floats are computed in float32, as the decomposition
    and ATen's CPU kernel compute them.
    """
    given_dtype = input.dtype
    dtype = ir.DataType.FLOAT if given_dtype in _COMPUTED_IN_FLOAT else given_dtype
    weight_dtype = weight.dtype if weight is not None else given_dtype
    dy, x = _cast(grad_out, dtype), _cast(input, dtype)
    rank = len(input.shape)
    axes = op.Constant(value_ints=[0, *range(2, rank)])
    if train:
        mean, invstd = _cast(save_mean, dtype), _cast(save_invstd, dtype)
    else:
        mean = _cast(running_mean, dtype)
        invstd = op.Reciprocal(op.Sqrt(op.Add(_cast(running_var, dtype), _scalar(eps, x))))
    grad_sum = op.ReduceSum(dy, axes, keepdims=0)
    centered = op.Sub(x, _per_channel(mean, rank))
    dot = op.ReduceSum(op.Mul(dy, centered), axes, keepdims=0)
    grad_scale = invstd if weight is None else op.Mul(invstd, _cast(weight, dtype))
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        if train:
            shape = list(input.shape)
            if all(isinstance(d, int) for d in shape):
                norm = _scalar(1.0 / (int(np.prod(shape, dtype=np.int64)) / shape[1]), x)
            else:
                norm = op.Reciprocal(op.CastLike(op.Div(op.Size(x), op.Shape(x, start=1, end=2)), x))
            proj_scale = op.Mul(op.Mul(dot, norm), op.Mul(invstd, invstd))
            grad_mean = op.Mul(grad_sum, norm)
            if rank > 2:
                projected = op.BatchNormalization(centered, proj_scale, grad_mean, _per_channel_fill(x, 0.0),
                                                  _per_channel_fill(x, 1.0), epsilon=0.0)
            else:
                projected = op.Add(op.Mul(centered, _per_channel(proj_scale, rank)), _per_channel(grad_mean, rank))
            grad_input = op.Mul(op.Sub(dy, projected), _per_channel(grad_scale, rank))
        else:
            grad_input = op.Mul(dy, _per_channel(grad_scale, rank))
        if given_dtype != dtype:
            grad_input = op.Cast(grad_input, to=given_dtype)
    if output_mask[1]:
        grad_weight = op.Mul(dot, invstd)
        if weight_dtype != dtype:
            grad_weight = op.Cast(grad_weight, to=weight_dtype)
    if output_mask[2]:
        grad_bias = grad_sum if weight_dtype == dtype else op.Cast(grad_sum, to=weight_dtype)
    return grad_input, grad_weight, grad_bias


def _layer_normalization(input, normalized_shape: Sequence[int], weight, bias, eps: float):
    """ONNX Runtime's LayerNormalization, with NaN in the rows where ATen's are NaN (module docstring).

    Only a row holding an element of magnitude 2**64 or more can be one, and then the input's sum of squares
    is inf (NaN with a NaN in it): one read of the input decides whether to run the rare case, inside an If
    whose branches each run the LayerNormalization (a branch that returned a value computed outside the If
    would copy it). On 64 x 512 x 768, one thread: 24 against 20 ms of CPU for the unguarded op, where a guard
    after the op (a copy) took 30 and a Where on every element 36."""
    rows, n = _rows(input, len(normalized_shape))
    if input.dtype != ir.DataType.FLOAT or not _can_be_nan(n, input.dtype):
        return torchlib_core.aten_native_layer_norm(input, normalized_shape, weight, bias, eps)

    def normalized(poison: bool):
        out, mean, rstd = torchlib_core.aten_native_layer_norm(input, normalized_shape, weight, bias, eps)
        if poison:
            nan = _welford_nan(rows, n, mean, input.dtype)
            out = op.Where(nan, _scalar(float("nan"), input), out)
            rstd = op.Where(nan, _scalar(float("nan"), rstd), rstd)
        # LayerNormalization's statistics are float32 (its stash_type).
        out.dtype, mean.dtype, rstd.dtype = input.dtype, ir.DataType.FLOAT, ir.DataType.FLOAT
        return [out, mean, rstd]

    squares = op.ReduceSumSquare(input, keepdims=0)
    suspect = op.Not(op.Less(squares, _scalar(float("inf"), squares)))  # inf or NaN
    return tuple(cond(suspect, lambda: normalized(True), lambda: normalized(False), exact_then=True))


@project_rule(aten.native_layer_norm.default)
def aten_native_layer_norm(input, normalized_shape: Sequence[int], weight=None, bias=None, eps: float = 1e-05):
    """native_layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)"""
    if input.dtype != ir.DataType.DOUBLE:
        return _layer_normalization(input, normalized_shape, weight, bias, eps)
    # ONNX Runtime's LayerNormalization keeps its mean and inverse std in float whatever the input; torch
    # keeps them in double for a double input, and the backward graph reads them. Spelled out in double.
    axes = op.Constant(value_ints=list(range(-len(normalized_shape), 0)))
    mean = op.ReduceMean(input, axes, keepdims=1)
    centered = op.Sub(input, mean)
    var = op.ReduceMean(op.Mul(centered, centered), axes, keepdims=1)
    rstd = op.Reciprocal(op.Sqrt(op.Add(var, _scalar(eps, input))))
    rows, n = _rows(input, len(normalized_shape))
    if _can_be_nan(n, input.dtype):
        rstd = op.Where(_welford_nan(rows, n, mean, input.dtype), _scalar(float("nan"), input), rstd)  # (..., 1): cheap
    out = op.Mul(centered, rstd)
    if weight is not None:
        out = op.Mul(out, weight)
    if bias is not None:
        out = op.Add(out, bias)
    return out, mean, rstd


def _group_affine(x, centered, mean, rstd, weight, bias, group: int):
    """The normalized output of a group norm with an affine map: ``centered * (rstd * w) + b`` per (sample,
    channel), ``centered`` being x - mean in x's shape.

    ATen's CPU kernel folds the map into ``y = fma(scale, x, shift)`` with ``scale = rstd * w`` and ``shift =
    fma(-scale, mean, b)``, which cancels (a group of variance 0 comes out a few thousandths off the bias);
    aot2onnx does not. Where that scale or shift is not finite (an infinite weight, or rstd * w past float32's
    range) the two orders give different infinities and NaN, so there, in an If's rare branch, eager's order is
    followed, its fused multiply-adds in double. Each branch computes the whole output (an If branch that
    returned a value computed outside it would copy it)."""
    rank = len(x.shape)
    zero = _scalar(0.0, x)
    samples, channels = op.Shape(x, start=0, end=1), op.Shape(x, start=1, end=2)
    by_group = op.Concat(samples, op.Constant(value_ints=[group]), op.Div(channels, op.Constant(value_ints=[group])),
                         axis=0)
    by_channel = op.Concat(samples, channels, *([op.Constant(value_ints=[1] * (rank - 2))] if rank > 2 else []), axis=0)
    rstd_c = op.Reshape(op.Expand(rstd, by_group), by_channel)  # (N, C, 1, ...)
    mean_c = op.Reshape(op.Expand(mean, by_group), by_channel)
    scale = op.Mul(rstd_c, _per_channel(weight, rank)) if weight is not None else rstd_c
    b = _per_channel(bias, rank) if bias is not None else zero
    wide = ir.DataType.DOUBLE
    shift = op.CastLike(op.Sub(op.Cast(b, to=wide), op.Mul(op.Cast(scale, to=wide), op.Cast(mean_c, to=wide))), x)
    odd = op.Or(op.Not(op.Equal(op.Sub(scale, scale), zero)), op.Not(op.Equal(op.Sub(shift, shift), zero)))
    any_odd = op.Cast(op.ReduceMax(op.Cast(odd, to=truth_dtype()), keepdims=0), to=ir.DataType.BOOL)

    def exact():
        out = op.Mul(centered, scale)
        out = op.Add(out, b) if bias is not None else out
        out.dtype = x.dtype
        return out

    def eager_order():
        fused = op.CastLike(op.Add(op.Mul(op.Cast(x, to=wide), op.Cast(scale, to=wide)), op.Cast(shift, to=wide)), x)
        result = op.Where(odd, fused, exact())
        result.dtype = x.dtype
        return [result]

    return cond(any_odd, eager_order, lambda: [exact()], exact_then=True)[0]


@project_rule(aten.native_group_norm.default)
def aten_native_group_norm(input, weight=None, bias=None, N=None, C=None, HxW=None, group: int = 1,
                           eps: float = 1e-05):
    """native_group_norm(Tensor input, Tensor? weight, Tensor? bias, SymInt N, SymInt C, SymInt HxW, int group, float eps) -> (Tensor, Tensor, Tensor)"""
    # torch_lib's rule normalizes with InstanceNormalization (no float64 kernel in ONNX Runtime, a float32
    # epsilon) and computes the statistics a second time for the outputs; here once, in the input's dtype
    # (float32 for half types, as ATen's opmath), with NaN where the group's mean squared overflows.
    given = input
    if input.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE):
        input = _cast(input, ir.DataType.FLOAT)
        weight, bias = (v if v is None else _cast(v, ir.DataType.FLOAT) for v in (weight, bias))
    shape = given.shape
    if all(isinstance(d, int) for d in shape):
        per_group = int(np.prod(shape[1:], dtype=np.int64)) // group
        grouped_shape = op.Constant(value_ints=[shape[0], group, per_group])
    else:
        per_group = op.Mul(op.Div(op.Shape(input, start=1, end=2), op.Constant(value_ints=[group])),
                           op.ReduceProd(op.Shape(input, start=2), keepdims=1))
        grouped_shape = op.Concat(op.Shape(input, start=0, end=1), op.Constant(value_ints=[group]), per_group, axis=0)
    grouped = op.Reshape(input, grouped_shape, allowzero=1)
    axes = op.Constant(value_ints=[2])
    mean = op.ReduceMean(grouped, axes, keepdims=1)
    centered = op.Sub(grouped, mean)
    var = op.ReduceMean(op.Mul(centered, centered), axes, keepdims=1)
    rstd = op.Reciprocal(op.Sqrt(op.Add(var, _scalar(eps, input))))
    if given.dtype == input.dtype and _can_be_nan(per_group, input.dtype):  # (ATen's half types: other lanes)
        nan = _welford_nan(grouped, per_group, mean, input.dtype)
        rstd = op.Where(nan, _scalar(float("nan"), input), rstd)  # (N, group, 1): cheap
    if weight is None and bias is None:
        out = op.Reshape(op.Mul(centered, rstd), op.Shape(input), allowzero=1)
    else:
        centered = op.Reshape(centered, op.Shape(input), allowzero=1)
        out = _group_affine(input, centered, mean, rstd, weight, bias, group)
    flat = op.Constant(value_ints=[0, group])
    mean, rstd = op.Reshape(mean, flat), op.Reshape(rstd, flat)
    if given is not input:
        out, mean, rstd = (op.CastLike(v, given) for v in (out, mean, rstd))
    return out, mean, rstd


def _weight_norm_axes(v, dim: int) -> list[int]:
    rank = len(v.shape)
    return [i for i in range(rank) if i != dim % rank] if rank else []


def _slice_norms(x, axes: list[int]):
    """``sqrt(sum(x * x))`` over ``axes`` (kept), as ATen's weight-norm kernel; elementwise ``sqrt(x * x)``
    when there are none."""
    squares = op.Mul(x, x)
    return op.Sqrt(op.ReduceSum(squares, op.Constant(value_ints=axes), keepdims=1) if axes else squares)


@project_rule(aten._weight_norm_interface.default)
def aten__weight_norm_interface(v, g, dim: int = 0):
    """_weight_norm_interface(Tensor v, Tensor g, int dim=0) -> (Tensor, Tensor)

    ``w = v * (g / norm)`` with ``norm`` the 2-norm of each slice of ``v`` along ``dim`` (over every other
    axis), as ATen's CPU kernel computes it: ``sqrt(sum(v * v))``, in float32 for 16-bit floats, the norms
    float32 for a bfloat16 ``g``. PyTorch's decomposition reduces over an empty list of axes for a 1-D ``v``,
    which ``norm`` takes as every axis: one norm for the whole vector where ATen's kernel has one per element
    (w was ``v * g / ||v||`` instead of ``sign(v) * g``). Here w is the kernel's; the norms output of a 1-D
    ``v`` keeps the one-element shape PyTorch's shape inference gives it (the whole vector's norm), and the
    backward rule recomputes the per-element norms from v.
    """
    given = v.dtype
    dtype = ir.DataType.FLOAT if given in _COMPUTED_IN_FLOAT else given
    x = _cast(v, dtype)
    axes = _weight_norm_axes(v, dim)
    norm = _slice_norms(x, axes)
    w = op.Mul(x, op.Div(op.Reshape(_cast(g, dtype), op.Shape(norm)), norm))
    if dtype != given:
        w = op.Cast(w, to=given)
    if not axes:
        norm = op.Sqrt(op.ReduceSum(op.Mul(x, x), keepdims=1))
    norm_dtype = ir.DataType.FLOAT if g.dtype == ir.DataType.BFLOAT16 else g.dtype
    norm = norm if norm_dtype == dtype else op.Cast(norm, to=norm_dtype)
    return w, norm if not axes else op.Reshape(norm, op.Shape(g))


@project_rule(aten._weight_norm_interface_backward.default)
def aten__weight_norm_interface_backward(grad_w, saved_v, saved_g, saved_norms, dim: int):
    """_weight_norm_interface_backward(Tensor grad_w, Tensor saved_v, Tensor saved_g, Tensor saved_norms, int dim) -> (Tensor, Tensor)

    The gradient of ``w = v * (g / ||v||)`` (``nn.utils.parametrizations.weight_norm``, norms over every axis
    but ``dim``, the first or the last), which PyTorch has no decomposition for. As ATen's CPU kernel
    (``WeightNormKernel.cpp``) computes it, per slice along ``dim``: ``s = sum(grad_w * v)``, ``a = g /
    norm``, ``b = a * s / (norm * norm)``, ``grad_v = a * grad_w - b * v``, ``grad_g = s / norm``; in float32
    for 16-bit floats, its accumulation type.
    """
    given = saved_v.dtype
    dtype = ir.DataType.FLOAT if given in _COMPUTED_IN_FLOAT else given
    dy, v = _cast(grad_w, dtype), _cast(saved_v, dtype)
    g = _cast(saved_g, dtype)
    axes = _weight_norm_axes(saved_v, dim)
    # A 1-D v's saved norms have PyTorch's one-element shape (see the forward rule): recomputed per element.
    norm = _cast(saved_norms, dtype) if axes else _slice_norms(v, axes)
    product = op.Mul(dy, v)
    # The norms have the keepdim shape of these sums (saved_g may be stored flat: its own shape is kept).
    sums = op.ReduceSum(product, op.Constant(value_ints=axes), keepdims=1) if axes else product
    norm = op.Reshape(norm, op.Shape(sums))
    a = op.Div(op.Reshape(g, op.Shape(sums)), norm)
    b = op.Div(op.Mul(a, sums), op.Mul(norm, norm))
    grad_v = op.Sub(op.Mul(a, dy), op.Mul(b, v))
    grad_g = op.Reshape(op.Div(sums, norm), op.Shape(saved_g))
    if dtype != given:
        grad_v, grad_g = op.Cast(grad_v, to=given), op.Cast(grad_g, to=saved_g.dtype)
    return grad_v, grad_g
