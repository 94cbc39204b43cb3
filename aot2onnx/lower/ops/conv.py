"""Convolutions: the forward where ONNX Runtime needs help, and the backward."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops import core as torchlib_core

from aot2onnx.lower.ops._common import rounded_to, static_dims
from aot2onnx.lower.ops._control import cond, on_device
from aot2onnx.lower.registry import project_rule

aten = torch.ops.aten


def _static_spatial(value: ir.Value) -> list[int] | None:
    """The spatial sizes (after batch and channels) where they are known, whatever the batch is."""
    if value.shape is None or not all(isinstance(d, int) for d in list(value.shape)[2:]):
        return None
    return list(value.shape)[2:]


# Where the input gradient of a stride-1 convolution runs as a convolution rather than a transposed one:
# at least this many input channels and input positions. ONNX Runtime's Conv beat its ConvTranspose by
# 7-30% on such shapes here (batch 32, 3x3: 64->32 channels at 32x32 8.2 against 8.8 ms, 64->64 at 32x32
# 13.9 against 18.5, 32->32 at 64x64 15.3 against 19.2, 16->16 at 64x64 5.4 against 7.8) and lost on
# small images and few input channels (256->256 at 14x14: 14.6 against 12.0; 64->3 at 64x64: 11.0
# against 6.0).
_CONV_GRAD_MIN_CHANNELS = 8
_CONV_GRAD_MIN_POSITIONS = 32 * 32


def _grad_input_as_conv(grad_output, weight, w_dims, padding, dilation, depthwise: bool = False):
    """dX of a stride-1 convolution, ungrouped or depthwise: dY convolved with the weight flipped in space and
    with its channel axes swapped (a depthwise weight's are (C, 1): it stays depthwise), padded by
    ``dilation * (k - 1) - padding`` on each side (which gives the input's size back exactly)."""
    spatial = len(w_dims) - 2
    pads = [dilation[i] * (w_dims[2 + i] - 1) - padding[i] for i in range(spatial)]
    axes = list(range(2, 2 + spatial))
    flipped = op.Slice(
        weight if depthwise else op.Transpose(weight, perm=[1, 0, *axes]),
        op.Constant(value_ints=[-1] * spatial), op.Constant(value_ints=[-(1 << 62)] * spatial),
        op.Constant(value_ints=axes), op.Constant(value_ints=[-1] * spatial),
    )
    return op.Conv(grad_output, flipped, pads=pads * 2, dilations=dilation, group=w_dims[0] if depthwise else 1)


# A depthwise convolution's input gradient, where it is stride 1, is the depthwise convolution of dY with the
# flipped weight, which ONNX Runtime runs in its blocked layout where the channels fit the block (nchwc.py):
# MobileNet's 32-channel 3x3 at 16x16, batch 16, ConvTranspose 0.54 ms.
_DEPTHWISE_GRAD_MIN_CHANNELS = 16


def _grad_input(grad_output, input, weight, stride, padding, dilation, groups):
    # The input gradient is the transposed convolution of grad_output with the same weight; torch's
    # (C_out, C_in/groups, *k) layout is exactly ConvTranspose's (C, M/group, *k) with C = C_out.
    spatial = len(stride)
    in_dims, w_dims = static_dims(input), static_dims(weight)
    if (
        w_dims is not None
        and groups == 1
        and all(k == 1 for k in w_dims[2:])
        and all(s == 1 for s in stride)
        and not any(padding)
    ):
        # A pointwise (1x1) convolution's: W^T (C_in, C_out) @ dY (N, C_out, positions), the same sums in the
        # same order as ConvTranspose's, 10-40% faster (MobileNet's projections, batch 16: 48 -> 24 channels
        # at 8x8, 71 against 117 us).
        w_t = op.Transpose(op.Reshape(weight, op.Constant(value_ints=w_dims[:2])), perm=[1, 0])
        # (N, C_out, positions) spelled out: -1 beside an empty batch is ambiguous, and refused
        positions = op.ReduceProd(op.Shape(grad_output, start=2), keepdims=1)
        dy = op.Reshape(grad_output, op.Concat(op.Shape(grad_output, start=0, end=2), positions, axis=0), allowzero=1)
        return op.Reshape(op.MatMul(w_t, dy), op.Shape(input))
    if (
        in_dims is not None
        and w_dims is not None
        and groups == 1
        and all(s == 1 for s in stride)
        and all(padding[i] <= dilation[i] * (w_dims[2 + i] - 1) for i in range(spatial))
        and in_dims[1] >= _CONV_GRAD_MIN_CHANNELS
        and math.prod(in_dims[2:]) >= _CONV_GRAD_MIN_POSITIONS
    ):
        return _grad_input_as_conv(grad_output, weight, w_dims, padding, dilation)
    if (
        in_dims is not None
        and w_dims is not None
        and len(w_dims) == 4
        and groups > 1
        and groups == in_dims[1] == w_dims[0]
        and w_dims[1] == 1
        and groups % _DEPTHWISE_GRAD_MIN_CHANNELS == 0
        and all(s == 1 for s in stride)
        and all(padding[i] <= dilation[i] * (w_dims[2 + i] - 1) for i in range(spatial))
    ):
        return _grad_input_as_conv(grad_output, weight, w_dims, padding, dilation, depthwise=True)
    in_sp, go_sp, w_sp = _static_spatial(input), _static_spatial(grad_output), _static_spatial(weight)
    if in_sp is not None and go_sp is not None and w_sp is not None:
        # The forward's windows stop short of the padded input's end by up to stride - 1 rows; output_padding
        # gives them back. Those rows can still be read by the last window (a padded input of even size at
        # stride 2), so they are ConvTranspose's to compute, not zeros. Only spatial sizes matter: the batch
        # may be symbolic.
        output_padding = [
            in_sp[i] - ((go_sp[i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (w_sp[i] - 1) + 1)
            for i in range(spatial)
        ]
        return op.ConvTranspose(
            grad_output, weight, strides=stride, pads=list(padding) * 2, dilations=dilation,
            group=groups, output_padding=output_padding,
        )
    # Symbolic spatial sizes: the unpadded transposed convolution is the gradient of the padded input, whose
    # rows [padding, padding + size) are the input's. Rows past its end are read by no window: zeros.
    full = op.ConvTranspose(grad_output, weight, strides=stride, dilations=dilation, group=groups)
    starts = op.Constant(value_ints=list(padding))
    size = op.Shape(input, start=2)
    grad = op.Slice(full, starts, op.Add(starts, size), op.Constant(value_ints=list(range(2, 2 + spatial))))
    missing = op.Sub(size, op.Shape(grad, start=2))
    # Pad's pads are all begins, then all ends: nothing at the beginning, the missing rows at the end.
    zeros = op.Constant(value_ints=[0] * (spatial + 2))
    pads = op.Concat(zeros, op.Constant(value_ints=[0, 0]), missing, axis=0)
    return op.Pad(grad, pads)


# The largest unfolded input (elements) the weight gradient builds as one tensor; beyond it, the grouped
# convolution below, which needs no extra memory.
_UNFOLD_LIMIT = 1 << 26


def _grad_weight(grad_output, input, weight, stride, padding, dilation, groups):
    depthwise = _grad_weight_depthwise(grad_output, input, weight, stride, padding, dilation, groups)
    if depthwise is not None:
        return depthwise
    unfolded = _grad_weight_unfolded(grad_output, input, weight, stride, padding, dilation, groups)
    if unfolded is not None:
        return unfolded
    return _grad_weight_as_conv(grad_output, input, weight, stride, padding, dilation, groups)


def _grad_weight_depthwise(grad_output, input, weight, stride, padding, dilation, groups):
    """dW of a 2-D depthwise convolution (one input and one output channel per group) on images narrow
    enough, as one matrix product per kernel row; None elsewhere.

    dW[c, kh, kw] = sum_{n, h, w} dY[n, c, h, w] * X[n, c, s*h + d*kh - p, s'*w + d'*kw - p']. For one kernel
    row kh, the rows h of dY whose input row is inside the image and those input rows are sliced out, with
    the channels first, and multiplied per channel over (n, h): M[c, w, x] = sum_{n, h} dY[.., w] * X[.., x]
    (Wo x W per channel). dW[c, kh, kw] is the sum over w of M[c, w, s'*w + d'*kw - p'], a strided diagonal:
    M flattened, shifted by p' and read as rows of W + s' elements holds it in its first columns. Entries
    that fall outside the image are not read from M (a Where on the small result). No input is unfolded:
    the one-hot convolution that unfolds it costs taps^2 multiply-adds per input element, this kh * W
    (MobileNet's 32-channel 3x3 at 16x16, batch 16: 0.5 against 1.2 ms)."""
    in_dims, go_dims, w_dims = static_dims(input), static_dims(grad_output), static_dims(weight)
    if in_dims is None or go_dims is None or w_dims is None or len(in_dims) != 4:
        return None
    n, c, height, width = in_dims
    (k_h, k_w), (out_h, out_w) = w_dims[2:], go_dims[2:]
    if not (groups == c == go_dims[1] > 1 and w_dims[:2] == [c, 1] and n > 0 and out_h > 0 and out_w > 0):
        return None
    (s_h, s_w), (p_h, p_w), (d_h, d_w) = stride, padding, dilation
    if k_h * width >= (k_h * k_w) ** 2 or d_w * (k_w - 1) + 1 > width + s_w:
        return None  # wide images: the unfolding does fewer multiply-adds
    dy = op.Transpose(grad_output, perm=[1, 0, 2, 3])  # (C, N, Ho, Wo)
    x = op.Transpose(input, perm=[1, 0, 2, 3])  # (C, N, H, W)
    zero = op.CastLike(op.Constant(value_float=0.0), input)
    # Where each (w, kw) reads the image: s'*w + d'*kw - p' in [0, W).
    cols = np.arange(out_w)[:, None] * s_w + np.arange(k_w)[None, :] * d_w - p_w
    inside = (cols >= 0) & (cols < width)
    row_taps = []
    for kh in range(k_h):
        offset = d_h * kh - p_h  # input row of output row h: s*h + offset
        first = max(0, -(offset // s_h))  # the first output row whose input row is inside the image
        last = min(out_h, max(0, (height - 1 - offset) // s_h + 1))  # one past the last
        if last <= first:  # this kernel row reads only padding
            row_taps.append(op.CastLike(op.Constant(value=ir.tensor(np.zeros((c, 1, k_w), np.float32))), input))
            continue
        rows = last - first
        a = dy if rows == out_h else op.Slice(dy, op.Constant(value_ints=[first]), op.Constant(value_ints=[last]),
                                              op.Constant(value_ints=[2]))
        b = op.Slice(x, op.Constant(value_ints=[s_h * first + offset]),
                     op.Constant(value_ints=[s_h * (last - 1) + offset + 1]), op.Constant(value_ints=[2]),
                     op.Constant(value_ints=[s_h]))
        a = op.Reshape(a, op.Constant(value_ints=[c, n * rows, out_w]))
        b = op.Reshape(b, op.Constant(value_ints=[c, n * rows, width]))
        m = op.MatMul(op.Transpose(a, perm=[0, 2, 1]), b)  # (C, Wo, W)
        # Element (w, s'*w + d'*kw - p') of M is flat element w*(W + s') + d'*kw after p' leading zeros.
        length = out_w * (width + s_w)
        flat = op.Reshape(m, op.Constant(value_ints=[c, out_w * width]))
        back = length - out_w * width - p_w
        if back < 0:
            flat = op.Slice(flat, op.Constant(value_ints=[0]), op.Constant(value_ints=[out_w * width + back]),
                            op.Constant(value_ints=[1]))
        flat = op.Pad(flat, op.Constant(value_ints=[0, p_w, 0, max(back, 0)]))
        diagonals = op.Slice(op.Reshape(flat, op.Constant(value_ints=[c, out_w, width + s_w])),
                             op.Constant(value_ints=[0]), op.Constant(value_ints=[d_w * (k_w - 1) + 1]),
                             op.Constant(value_ints=[2]), op.Constant(value_ints=[d_w]))  # (C, Wo, kW)
        if not inside.all():
            diagonals = op.Where(op.Constant(value=ir.tensor(inside)), diagonals, zero)
        row_taps.append(op.ReduceSum(diagonals, op.Constant(value_ints=[1]), keepdims=1))  # (C, 1, kW)
    return op.Reshape(op.Concat(*row_taps, axis=1), op.Constant(value_ints=w_dims))


def _grad_weight_unfolded(grad_output, input, weight, stride, padding, dilation, groups):
    """dW as matrix products over the unfolded input (im2col), or None where that does not fit.

    dW[o, i, k] = sum_{n, p} dY[n, o, p] * X[n, i, p*stride - pad + k*dilation]: the input unfolded to
    (N, g, Cin/g * K, P), one row per input channel and kernel offset, multiplied per sample with dY
    (N, g, Cout/g, P) and summed over N. ONNX Runtime's convolution computes the same sum as a
    convolution with a kernel as large as the image, which runs several times slower.
    """
    in_dims, go_dims, w_dims = static_dims(input), static_dims(grad_output), static_dims(weight)
    if in_dims is None or go_dims is None or w_dims is None:
        return None
    n, c_in, c_out = in_dims[0], in_dims[1], go_dims[1]
    kernel, out = w_dims[2:], go_dims[2:]
    taps, positions = math.prod(kernel), math.prod(out)
    # The unfolded input and the one-hot kernel below must both stay small.
    if n * c_in * taps * positions > _UNFOLD_LIMIT or c_in * taps**2 > 1 << 22:
        return None
    rows = op.Constant(value_ints=[n, groups, c_in // groups * taps, positions])

    def one_hot():
        return _as_rows(_unfolded_by_one_hot(input, c_in, kernel, taps, stride, padding, dilation), rows, input.dtype)

    def sliced():
        return _as_rows(_unfolded_by_slices(input, kernel, out, stride, padding, dilation), rows, input.dtype)

    if taps > _SLICED_UNFOLD_TAPS:
        cols = one_hot()
    elif on_device():
        cols = sliced()
    else:
        # On the CPU the one-hot convolution is 10-45% faster than the slices, but it multiplies every element
        # by the zeros of the other offsets too: an infinite input would make NaN where eager's gradient is
        # inf. It runs where the input is finite (its sum is: one pass), the slices elsewhere.
        total = op.ReduceSum(input, keepdims=0)
        finite = op.Not(op.Or(op.IsNaN(total), op.IsInf(total)))
        cols = cond(finite, lambda: [one_hot()], lambda: [sliced()], exact_then=True)[0]
    # The product is taken transposed, (Cin/g * K, P) @ (P, Cout/g) per sample, and the sum over N
    # transposed back: ONNX Runtime packs the product's right operand, and dY is the smaller one.
    # Alone, on 6 convolutions (3-128 channels, 16x16 to 64x64): 2-27% faster than dY @ cols^T.
    if c_out == groups:
        # One output channel per group (depthwise): dY^T is a reshape of dY, and the MatMul reads it as it is
        # (MobileNet's 32-channel 3x3 at 16x16, batch 16: 0.30 ms, against 0.56 ms for the MatMul that
        # takes the transpose in, as ONNX Runtime fuses it).
        dy_t = op.Reshape(grad_output, op.Constant(value_ints=[n, groups, positions, 1]))
    else:
        dy = op.Reshape(grad_output, op.Constant(value_ints=[n, groups, c_out // groups, positions]))
        dy_t = op.Transpose(dy, perm=[0, 1, 3, 2])
    per_sample = op.MatMul(cols, dy_t)  # (N, g, Cin/g * K, Cout/g)
    total = op.ReduceSum(per_sample, op.Constant(value_ints=[0]), keepdims=0)
    return op.Reshape(op.Transpose(total, perm=[0, 2, 1]), op.Constant(value_ints=w_dims))


# On CUDA the unfolding is Slices of the padded input where the kernel has at most this many offsets.
_SLICED_UNFOLD_TAPS = 64


def _as_rows(unfolded, rows, dtype):
    """The unfolded input reshaped to ``rows`` (N, groups, Cin/g * K, positions), typed (an If's branch must be)."""
    value = op.Reshape(unfolded, rows)
    value.dtype = dtype
    return value


def _unfolded_by_one_hot(input, c_in, kernel, taps, stride, padding, dilation):
    """The input unfolded for the weight gradient, (N, Cin * K, *out), by a convolution: group i has one output
    channel per kernel offset, whose kernel is 1 at that offset, so output channel i*K + k is input channel i
    shifted by k (with the forward's padding, stride and dilation), the order of the weight's flattened
    (Cin/g, *k). Exact only for finite inputs (inf * 0 is NaN)."""
    one_hot = np.tile(np.eye(taps, dtype=np.float32).reshape(taps, 1, *kernel), (c_in, 1, *[1] * len(kernel)))
    shifts = op.CastLike(op.Constant(value=ir.tensor(one_hot)), input)
    return op.Conv(input, shifts, strides=stride, pads=list(padding) * 2, dilations=dilation, group=c_in)


def _unfolded_by_slices(input, kernel, out, stride, padding, dilation):
    """The input unfolded for the weight gradient, (N, Cin, K, *out) with channel-major rows as the one-hot
    convolution orders them, as one strided Slice of the zero-padded input per kernel offset. For ONNX
    Runtime's CUDA provider, where cuDNN ran the one-hot grouped convolution as a direct convolution: on an
    H200 (scripts/cuda_wgrad_probe.py, the whole weight gradient), 32x32x32x32 -> 64 channels 283 -> 177 us,
    16x64x56x56 -> 64 795 -> 390 (torch 99 and 176). The slices copy the input's values, so the result is the
    one-hot convolution's wherever that is exact (every finite input)."""
    spatial = len(kernel)
    axes = op.Constant(value_ints=list(range(2, 2 + spatial)))
    padded = input
    if any(padding):
        padded = op.Pad(input, op.Constant(value_ints=[0, 0, *padding, 0, 0, *padding]))
    taps = []
    for offset in np.ndindex(*kernel):
        starts = [k * d for k, d in zip(offset, dilation)]
        ends = [b + s * (o - 1) + 1 for b, s, o in zip(starts, stride, out)]
        taps.append(op.Unsqueeze(op.Slice(padded, op.Constant(value_ints=starts), op.Constant(value_ints=ends), axes,
                                          op.Constant(value_ints=list(stride))), op.Constant(value_ints=[2])))
    return taps[0] if len(taps) == 1 else op.Concat(*taps, axis=2)


def _grad_weight_as_conv(grad_output, input, weight, stride, padding, dilation, groups):
    # dW[o, i, k] = sum_{n, p} dY[n, o, p] * X[n, g(o)*Cg + i, p*stride - pad + k*dilation]: a grouped
    # convolution in which the batch becomes the channel axis. X is rearranged to
    # (Cin/g, g*N, *spatial) and dY to (Cout, N, *spatial_out); stride and dilation swap roles.
    spatial = len(stride)
    rest = list(range(3, 3 + spatial))
    # Channel counts are spelled out, not -1: with an empty batch, -1 beside a 0 is ambiguous and refused.
    batch = op.Shape(input, start=0, end=1)
    c_out_g, c_in_g = op.Shape(weight, start=0, end=1), op.Shape(weight, start=1, end=2)
    c_out_g = op.Div(c_out_g, op.Constant(value_ints=[groups]))
    g = op.Constant(value_ints=[groups])
    spatial_in = op.Shape(input, start=2)
    x = op.Reshape(input, op.Concat(batch, g, c_in_g, spatial_in, axis=0), allowzero=1)
    x = op.Transpose(x, perm=[2, 1, 0, *rest])  # (Cin/g, g, N, *spatial)
    x = op.Reshape(x, op.Concat(c_in_g, op.Mul(g, batch), spatial_in, axis=0), allowzero=1)
    spatial_out = op.Shape(grad_output, start=2)
    dy = op.Reshape(grad_output, op.Concat(batch, g, c_out_g, spatial_out, axis=0), allowzero=1)
    dy = op.Transpose(dy, perm=[1, 2, 0, *rest])  # (g, Cout/g, N, *spatial_out)
    dy = op.Reshape(dy, op.Concat(op.Shape(weight, start=0, end=1), batch, spatial_out, axis=0), allowzero=1)
    gw = op.Conv(x, dy, strides=dilation, dilations=stride, pads=list(padding) * 2, group=groups)
    # The result can be larger than the kernel (a stride that does not divide the input): crop.
    gw = op.Slice(gw, op.Constant(value_ints=[0] * spatial), op.Shape(weight, start=2),
                  op.Constant(value_ints=list(range(2, 2 + spatial))))
    return op.Transpose(gw, perm=[1, 0, *range(2, 2 + spatial)])  # (Cout, Cin/g, *k)


def _ints(values: Sequence[int], spatial: int) -> list[int]:
    """aten allows one-element lists for every spatial dim."""
    return [*values] * spatial if len(values) == 1 else list(values)


@project_rule(aten.convolution.default)
def aten_convolution(input, weight, bias=None, stride=(1,), padding=(0,), dilation=(1,), transposed=False,
                     output_padding=(0,), groups=1):
    """convolution(Tensor input, Tensor weight, Tensor? bias, SymInt[] stride, SymInt[] padding, SymInt[] dilation, bool transposed, SymInt[] output_padding, SymInt groups) -> Tensor"""
    spatial = len(weight.shape) - 2
    stride, padding, extra = (_ints(v, spatial) for v in (stride, padding, output_padding))
    if not transposed or all(e < s for e, s in zip(extra, stride)):
        return torchlib_core.aten_convolution(input, weight, bias, stride, padding, dilation, transposed,
                                              output_padding, groups)
    # torch allows output_padding up to max(stride, dilation) - 1; ONNX Runtime's ConvTranspose fails the run
    # from output_padding == stride on (it derives the input size back from the output's). The unpadded
    # transposed convolution, zero-extended where output_padding reaches past it, cut to
    # [padding, size - padding + output_padding), is the same.
    full = op.ConvTranspose(input, weight, strides=stride, dilations=_ints(dilation, spatial), group=groups)
    grow = [max(0, e - p) for e, p in zip(extra, padding)]
    full = op.Pad(full, op.Constant(value_ints=[0] * (spatial + 2) + [0, 0] + grow))
    ends = [-(p - e) if p > e else np.iinfo(np.int64).max for e, p in zip(extra, padding)]
    axes = list(range(2, 2 + spatial))
    result = op.Slice(full, op.Constant(value_ints=padding), op.Constant(value_ints=ends), op.Constant(value_ints=axes))
    if bias is None:
        return result
    return op.Add(result, op.Reshape(bias, op.Constant(value_ints=[-1] + [1] * spatial)))


@project_rule(aten.convolution_backward.default)
def aten_convolution_backward(
    grad_output,
    input,
    weight,
    bias_sizes: Sequence[int] | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
    output_mask: Sequence[bool],
):
    """convolution_backward(Tensor grad_output, Tensor input, Tensor weight, SymInt[]? bias_sizes, SymInt[] stride, SymInt[] padding, SymInt[] dilation, bool transposed, SymInt[] output_padding, SymInt groups, bool[3] output_mask) -> (Tensor, Tensor, Tensor)"""
    spatial = len(weight.shape) - 2
    stride, padding, dilation = (_ints(v, spatial) for v in (stride, padding, dilation))
    grad_input = grad_weight = grad_bias = None
    if transposed:
        # y = conv_transpose(x, W) is the input gradient of conv(., W), so its gradients are the same
        # two pieces with roles swapped: dx = conv(dy, W), and dW is the weight gradient of a convolution
        # whose input is dy and whose output gradient is x. W's (C_in, C_out/groups, *k) layout is
        # Conv's weight layout for that convolution.
        dy = grad_output
        if any(e >= s for e, s in zip(_ints(output_padding, spatial), stride)):
            # output_padding of a stride or more (torch allows it below the dilation) gives that convolution
            # one more window than x has positions. Its padded dy, cut after the last window x has, has
            # exactly one window per position.
            padded = op.Pad(dy, op.Constant(value_ints=[0, 0, *padding, 0, 0, *padding]))
            kernel = (static_dims(weight) or [None] * (spatial + 2))[2:]
            if None in kernel:
                raise NotImplementedError("a transposed convolution's output_padding >= stride needs a static kernel")
            reach = [d * (k - 1) + 1 for d, k in zip(dilation, kernel)]
            last = op.Mul(op.Sub(op.Shape(input, start=2), op.Constant(value_ints=[1])), op.Constant(value_ints=stride))
            dy = op.Slice(padded, op.Constant(value_ints=[0] * spatial), op.Add(last, op.Constant(value_ints=reach)),
                          op.Constant(value_ints=list(range(2, 2 + spatial))))
            padding = [0] * spatial
        if output_mask[0]:
            grad_input = op.Conv(dy, weight, strides=stride, pads=list(padding) * 2, dilations=dilation, group=groups)
        if output_mask[1]:
            grad_weight = _grad_weight(input, dy, weight, stride, padding, dilation, groups)
    else:
        if output_mask[0]:
            grad_input = _grad_input(grad_output, input, weight, stride, padding, dilation, groups)
        if output_mask[1]:
            grad_weight = _grad_weight(grad_output, input, weight, stride, padding, dilation, groups)
    if output_mask[2]:
        axes = op.Constant(value_ints=[0, *range(2, 2 + spatial)])
        grad_bias = op.ReduceSum(grad_output, axes, keepdims=0)
    return grad_input, grad_weight, grad_bias


@project_rule(aten.im2col.default)
def aten_im2col(self, kernel_size: Sequence[int], dilation: Sequence[int], padding: Sequence[int], stride: Sequence[int]):
    """im2col(Tensor self, int[2] kernel_size, int[2] dilation, int[2] padding, int[2] stride) -> Tensor"""
    # out[..., (c, i, j), (oh, ow)] = padded[..., c, oh * sh + i * dh, ow * sw + j * dw]: two Gathers with
    # [k, out] index grids. torch_lib's rule reshapes with a -1 beside the batch, which ONNX Runtime refuses
    # for an empty batch; here every size of the result comes from the input's shape or is static.
    h, w = list(self.shape)[-2:]
    if not (isinstance(h, int) and isinstance(w, int)):
        raise NotImplementedError("im2col needs static spatial sizes")
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = (_ints(v, 2) for v in (kernel_size, dilation, padding, stride))
    out_h, out_w = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    rank = len(self.shape)
    padded = self
    if ph or pw:
        pads = [0] * (rank - 2) + [ph, pw] + [0] * (rank - 2) + [ph, pw]
        padded = op.Pad(self, op.Constant(value_ints=pads), op.CastLike(0.0, self))
    rows = np.arange(kh)[:, None] * dh + np.arange(out_h)[None, :] * sh
    cols = np.arange(kw)[:, None] * dw + np.arange(out_w)[None, :] * sw
    blocks = op.Gather(padded, op.Constant(value=ir.tensor(rows.astype(np.int64))), axis=rank - 2)  # [.., C, kh, oh, W]
    blocks = op.Gather(blocks, op.Constant(value=ir.tensor(cols.astype(np.int64))), axis=rank)  # [.., C, kh, oh, kw, ow]
    lead = list(range(rank - 2))
    blocks = op.Transpose(blocks, perm=[*lead, rank - 2, rank, rank - 1, rank + 1])  # [.., C, kh, kw, oh, ow]
    channels = op.Shape(self, start=rank - 3, end=rank - 2)
    shape = op.Concat(op.Shape(self, end=rank - 3), op.Mul(channels, op.Constant(value_ints=[kh * kw])),
                      op.Constant(value_ints=[out_h * out_w]), axis=0)
    return op.Reshape(blocks, shape)



@project_rule(aten.col2im.default)
def aten_col2im(self, output_size: Sequence[int], kernel_size: Sequence[int], dilation: Sequence[int],
                padding: Sequence[int], stride: Sequence[int]):
    """col2im(Tensor self, SymInt[2] output_size, int[2] kernel_size, int[2] dilation, int[2] padding, int[2] stride) -> Tensor"""
    # ATen adds each column into the image in the order of the kernel offsets (i, j), rounding after each add
    # in the image's dtype (a 16-bit float too). Here each offset's columns land on distinct positions of the
    # padded image: one scatter per offset, added in ATen's order, which gives eager's bits. ONNX's Col2Im
    # has no float64 kernel in ONNX Runtime and sums 16-bit values in another order.
    h, w = (int(d) for d in output_size)
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = (_ints(v, 2) for v in (kernel_size, dilation, padding, stride))
    hp, wp = h + 2 * ph, w + 2 * pw
    out_h, out_w = (hp - dh * (kh - 1) - 1) // sh + 1, (wp - dw * (kw - 1) - 1) // sw + 1
    batched = len(self.shape) == 3
    cols = self if batched else op.Unsqueeze(self, op.Constant(value_ints=[0]))
    half = self.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
    if half:
        cols = op.Cast(cols, to=ir.DataType.FLOAT)
    batch = op.Shape(cols, end=1)
    # [N, C * kh * kw, L] -> [N, C, kh * kw, L]
    channels = op.Div(op.Shape(cols, start=1, end=2), op.Constant(value_ints=[kh * kw]))  # no -1: a batch may be empty
    cols = op.Reshape(cols, op.Concat(batch, channels, op.Constant(value_ints=[kh * kw, out_h * out_w]), axis=0))
    planes = op.Concat(op.Shape(cols, end=2), op.Constant(value_ints=[hp * wp]), axis=0)
    image = op.CastLike(op.ConstantOfShape(planes), cols)
    oh, ow = np.meshgrid(np.arange(out_h), np.arange(out_w), indexing="ij")
    for i in range(kh):
        for j in range(kw):
            where = ((oh * sh + i * dh) * wp + ow * sw + j * dw).reshape(1, 1, -1).astype(np.int64)
            part = op.Squeeze(op.Slice(cols, op.Constant(value_ints=[i * kw + j]), op.Constant(value_ints=[i * kw + j + 1]),
                                       op.Constant(value_ints=[2])), op.Constant(value_ints=[2]))
            placed = op.ScatterElements(op.CastLike(op.ConstantOfShape(planes), cols),
                                        op.Expand(op.Constant(value=ir.tensor(where)), op.Shape(part)), part, axis=2)
            image = op.Add(image, placed)
            if half:
                image = rounded_to(image, self.dtype)
    image = op.Reshape(image, op.Concat(op.Shape(cols, end=2), op.Constant(value_ints=[hp, wp]), axis=0))
    image = op.Slice(image, op.Constant(value_ints=[ph, pw]), op.Constant(value_ints=[ph + h, pw + w]),
                     op.Constant(value_ints=[2, 3]))
    if half:
        image = op.Cast(image, to=self.dtype)
    return image if batched else op.Squeeze(image, op.Constant(value_ints=[0]))
