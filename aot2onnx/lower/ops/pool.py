"""Max pooling with torch's indices, and pooling backward."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops import nn as torchlib_nn

from aot2onnx.capture._torch_compat import unset_fake_temporarily
from aot2onnx.lower.ops._common import FLOATS, scatter_add_to_planes
from aot2onnx.lower.ops._control import cond, on_device
from aot2onnx.lower.registry import project_rule

aten = torch.ops.aten



def _max_pool_attributes(spatial: int, kernel_size, stride, padding, dilation):
    """kernel, strides, ONNX pads (begins then ends) and dilations, each with one entry per spatial dim."""
    return torchlib_nn._adjust_attributes_of_max_pool(spatial, kernel_size, stride, padding, dilation)


def _plane_offsets(x, spatial: int):
    """For x (N, C, *spatial): the flat position where each (n, c) plane starts, shaped (N, C, 1, ...)."""
    planes = op.ReduceProd(op.Shape(x, end=2), keepdims=0)
    plane_size = op.ReduceProd(op.Shape(x, start=2), keepdims=0)
    starts = op.Mul(op.Range(op.Constant(value_int=0), planes, op.Constant(value_int=1)), plane_size)
    return op.Reshape(starts, op.Concat(op.Shape(x, end=2), op.Constant(value_ints=[1] * spatial), axis=0))


def _window_marks(x, pool):
    """For each window of x (N, C, *spatial), pooled as float64: 1 + the position within its plane of its last
    NaN; else 0 where it holds an element above -inf; else -1 where all its elements are -inf; and less
    where it holds no element (ONNX Runtime pads with the most negative double). Exact up to 2**53."""
    plane = op.Shape(x, start=2)
    one, zero = op.Constant(value=ir.tensor(np.array(1.0))), op.Constant(value=ir.tensor(np.array(0.0)))
    positions = op.Range(one, op.Add(op.Cast(op.ReduceProd(plane, keepdims=0), to=ir.DataType.DOUBLE), one), one)
    others = op.Where(op.IsInf(x, detect_positive=0), op.Constant(value=ir.tensor(np.array(-1.0))), zero)
    return pool(op.Where(op.IsNaN(x), op.Reshape(positions, plane), others))[0]


def _empty_windows_possible(sizes, kernel, strides, pads, dilations) -> bool:
    """Whether a window might hold no element of the input: one that starts in the begin padding and whose
    dilation steps over the rest of the input (ATen asks for padding <= kernel // 2, so only with
    dilation > 1). True where a size is not static."""
    n = len(kernel)
    for size, k, s, p, d in zip(sizes, kernel, strides, pads[:n], dilations):
        for start in range(-p, 0, s):
            steps = -(start // d)  # ceil(-start / d): whole dilations to the first position >= 0
            if steps >= k or not isinstance(size, int) or start + steps * d >= size:
                return True
    return False


def _first_positions(x, out, spatial: int, kernel, strides, pads, dilations):
    """For the windows of a max pool of x (..., *spatial) into ``out`` (..., *pooled): whether each holds no
    element of x, and the position within its plane of its first element in every dim (ATen steps a
    window's start into the input by whole dilations). ATen's index is that position where no element beats
    -inf: in a window of -inf, and in one of nothing, where it lies outside the window (even outside the
    plane). Both are shaped [*pooled], to broadcast over the leading dims."""
    int64 = ir.DataType.INT64
    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    empty = index = None
    for i in range(spatial):
        k, s, p, d = kernel[i], strides[i], pads[i], dilations[i]
        dim = {"start": i - spatial, **({"end": i - spatial + 1} if i < spatial - 1 else {})}
        size, count = op.Shape(x, **dim), op.Squeeze(op.Shape(out, **dim))
        starts = op.Sub(op.Mul(op.Range(zero, count, one), op.Constant(value_int=s)), op.Constant(value_int=p))
        steps = op.Div(op.Add(op.Max(op.Neg(starts), zero), op.Constant(value_int=d - 1)), op.Constant(value_int=d))
        first = op.Add(starts, op.Mul(steps, op.Constant(value_int=d)))
        nothing = op.Or(op.GreaterOrEqual(first, size), op.GreaterOrEqual(steps, op.Constant(value_int=k)))
        if index is None:
            empty, index = nothing, first
        else:
            last = op.Constant(value_ints=[-1])
            empty = op.Or(op.Unsqueeze(empty, last), nothing)
            index = op.Add(op.Mul(op.Unsqueeze(index, last), size), first)
    return _typed(empty, ir.DataType.BOOL), _typed(index, int64)


def _ceil_as_padding(sizes, kernel, strides, pads, dilations) -> list[int] | None:
    """ONNX pads (begins, then ends) whose floor-mode windows are ATen's ceil-mode ones, or None.

    ATen's ceil mode drops a last window that would start in the end padding. ONNX Runtime's MaxPool does
    too, but ONNX's shape inference keeps it, and the shape it declares for a value that leaves an If branch
    is the one ONNX Runtime allocates (the run then fails). Padding the end instead gives the same windows
    and a shape every tool agrees on. None where a size is not static, or a pad would reach its kernel's
    size, which ONNX Runtime refuses.
    """
    n = len(kernel)
    ends = list(pads[n:])
    for i, size in enumerate(sizes):
        if not isinstance(size, int):
            return None
        k, s, d, begin = kernel[i], strides[i], dilations[i], pads[i]
        out = -(-(size + begin + ends[i] - d * (k - 1) - 1) // s) + 1
        if (out - 1) * s >= size + begin:
            out -= 1
        ends[i] = max(ends[i], (out - 1) * s + d * (k - 1) + 1 - size - begin)
        if ends[i] >= k:
            return None
    return [*pads[:n], *ends]


def _typed(value, dtype: ir.DataType):
    value.dtype = dtype
    return value


def _max_pool_with_indices(self, spatial: int, kernel_size, stride, padding, dilation, ceil_mode: bool):
    # ONNX's MaxPool numbers positions over the whole (N, C, *spatial) tensor, torch within each (n, c)
    # plane: subtract where each plane starts. (torch_lib runs a second MaxPool over the whole input to
    # find those starts, which costs as much as the pooling itself.) Ties pick the first position in both.
    kernel, strides, pads, dilations = _max_pool_attributes(spatial, kernel_size, stride, padding, dilation)
    if ceil_mode and (floor_pads := _ceil_as_padding(self.shape[-spatial:], kernel, strides, pads, dilations)):
        pads, ceil_mode = floor_pads, False
    unbatched = len(self.shape) == spatial + 1
    x = op.Unsqueeze(self, op.Constant(value_ints=[0])) if unbatched else self

    def pool(v):
        return op.MaxPool(v, ceil_mode=ceil_mode, dilations=dilations, kernel_shape=kernel, pads=pads,
                          strides=strides)

    values, flat = pool(x)
    values = _typed(values, self.dtype)
    indices = _typed(op.Sub(flat, _plane_offsets(x, spatial)), ir.DataType.INT64)
    if self.dtype in FLOATS:
        # ONNX Runtime starts each window at the most negative finite number, not -inf. Its kernel with
        # indices then takes a window's first element where all are -inf, as ATen does, but its kernel
        # without gives -3.4e38 (float32) there; and both give it, at a meaningless index, for a window
        # that holds no element at all.
        if _empty_windows_possible(self.shape[-spatial:], kernel, strides, pads, dilations):
            empty, start = _first_positions(x, values, spatial, kernel, strides, pads, dilations)
            values = _typed(op.Where(empty, op.CastLike(float("-inf"), values), values), self.dtype)
            indices = _typed(op.Where(empty, start, indices), ir.DataType.INT64)
        # ATen's window of a NaN is NaN, at its last NaN's position. ONNX Runtime's MaxPool lets a NaN win
        # only from some positions in a window (and its kernel without indices, used where the indices go
        # unread, from others). Windows are looked at again only where x holds a NaN or -inf, which makes
        # its sum NaN or -inf (as do +inf and -inf together, which only costs the slower branch): one
        # ReduceSum otherwise. Values and indices are mended apart, so that unread indices leave the fast
        # MaxPool.
        total = op.ReduceSum(x, keepdims=0)
        special = op.Or(op.IsNaN(total), op.IsInf(total, detect_positive=0))
        zero = op.Constant(value=ir.tensor(np.array(0.0)))

        def mended_values():
            marks = _window_marks(x, pool)
            values_ = op.Where(op.Less(marks, zero), op.CastLike(float("-inf"), values), values)
            return [_typed(op.Where(op.Greater(marks, zero), op.CastLike(float("nan"), values), values_), self.dtype)]

        def mended_indices():
            marks = _window_marks(x, pool)
            position = op.Sub(op.Cast(marks, to=ir.DataType.INT64), op.Constant(value_int=1))
            return [_typed(op.Where(op.Greater(marks, zero), position, indices), ir.DataType.INT64)]

        if ceil_mode:  # an If branch would return a shape ONNX declares wrong: see _ceil_as_padding
            values, indices = mended_values()[0], mended_indices()[0]
        else:
            values = cond(special, mended_values, lambda: [values], exact_then=True)[0]
            indices = cond(special, mended_indices, lambda: [indices], exact_then=True)[0]
    if unbatched:
        axis = op.Constant(value_ints=[0])
        return op.Squeeze(values, axis), op.Squeeze(indices, axis)
    return values, indices


@project_rule(aten.max_pool2d_with_indices.default)
def aten_max_pool2d_with_indices(self, kernel_size, stride=(), padding=(0, 0), dilation=(1, 1), ceil_mode=False):
    """max_pool2d_with_indices(Tensor self, int[2] kernel_size, int[2] stride=[], int[2] padding=0, int[2] dilation=1, bool ceil_mode=False) -> (Tensor, Tensor)"""
    return _max_pool_with_indices(self, 2, kernel_size, stride, padding, dilation, ceil_mode)


@project_rule(aten.max_pool3d_with_indices.default)
def aten_max_pool3d_with_indices(self, kernel_size, stride=(), padding=(0, 0, 0), dilation=(1, 1, 1),
                                 ceil_mode=False):
    """max_pool3d_with_indices(Tensor self, int[3] kernel_size, int[3] stride=[], int[3] padding=0, int[3] dilation=1, bool ceil_mode=False) -> (Tensor, Tensor)"""
    return _max_pool_with_indices(self, 3, kernel_size, stride, padding, dilation, ceil_mode)


def _max_pool_backward(grad_output, self, indices, spatial: int, kernel_size, stride, padding, dilation):
    kernel, strides, pads, dilations = _max_pool_attributes(spatial, kernel_size, stride, padding, dilation)
    if _empty_windows_possible(self.shape[-spatial:], kernel, strides, pads, dilations):
        # A window that holds no element of self has nowhere to send its gradient. ATen adds it at the
        # window's index all the same, outside the window: into the next row or plane, or past the end of
        # its buffer. Here it is dropped: zero added at position 0.
        empty, _ = _first_positions(self, grad_output, spatial, kernel, strides, pads, dilations)
        grad_output = op.Where(empty, op.CastLike(0.0, grad_output), grad_output)
        return scatter_add_to_planes(grad_output, self, op.Where(empty, op.Constant(value_int=0), indices), spatial)
    overlapping = any(s < d * (k - 1) + 1 for k, s, d in zip(kernel, strides, dilations))
    # ONNX Runtime's MaxUnpool is float32 only, and the CPU provider's alone: on CUDA it would run on the
    # host, its inputs copied there and its result back. Where windows do not overlap, no position is picked
    # twice, so the scatter-add adds each gradient to zero once: MaxUnpool's values (a -0.0 comes out +0.0,
    # as from ATen's kernel, which adds to zeros too).
    if overlapping or grad_output.dtype != ir.DataType.FLOAT or on_device():
        return scatter_add_to_planes(grad_output, self, indices, spatial)
    # Windows that do not overlap pick each position at most once, so MaxUnpool places the gradient
    # (about three times faster than the scatter-add on the CPU); it takes positions over the whole tensor.
    unbatched = len(self.shape) == spatial + 1
    if unbatched:
        axis = op.Constant(value_ints=[0])
        grad_output, self, indices = (op.Unsqueeze(v, axis) for v in (grad_output, self, indices))
    flat = op.Add(indices, _plane_offsets(self, spatial))
    # MaxUnpool checks output_shape against a size it infers from its attributes; with unit windows that
    # is the pooled size, never more than the input's.
    grad = op.MaxUnpool(grad_output, flat, op.Shape(self), kernel_shape=[1] * spatial, strides=[1] * spatial)
    return op.Squeeze(grad, op.Constant(value_ints=[0])) if unbatched else grad


@project_rule(aten.max_pool2d_with_indices_backward.default)
def aten_max_pool2d_with_indices_backward(
    grad_output,
    self,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
    indices,
):
    """max_pool2d_with_indices_backward(Tensor grad_output, Tensor self, int[2] kernel_size, int[2] stride, int[2] padding, int[2] dilation, bool ceil_mode, Tensor indices) -> Tensor"""
    return _max_pool_backward(grad_output, self, indices, 2, kernel_size, stride, padding, dilation)


@project_rule(aten.max_pool3d_with_indices_backward.default)
def aten_max_pool3d_with_indices_backward(
    grad_output,
    self,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
    indices,
):
    """max_pool3d_with_indices_backward(Tensor grad_output, Tensor self, int[3] kernel_size, int[3] stride, int[3] padding, int[3] dilation, bool ceil_mode, Tensor indices) -> Tensor"""
    return _max_pool_backward(grad_output, self, indices, 3, kernel_size, stride, padding, dilation)


def _avg_pool_divisor(self, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override) -> np.ndarray:
    """The divisor of every output position of an average pool, as torch computes it (float32).

    It depends on the padding, the ceil-mode overhang, count_include_pad and divisor_override. torch
    itself computes it, once, at lowering: pooling ones gives count/divisor, and sum-pooling them
    (divisor_override=1) gives count.
    """
    sizes = list(self.shape[2:])
    if not all(isinstance(d, int) for d in sizes):
        raise NotImplementedError("avg_pool with a divisor other than the window size needs static spatial sizes")
    pool = torch.nn.functional.avg_pool2d if len(sizes) == 2 else torch.nn.functional.avg_pool3d
    # Lowering runs inside AOTAutograd's fake mode; these are real tensors.
    with unset_fake_temporarily():
        ones = torch.ones(1, 1, *sizes, dtype=torch.float64)
        averaged = pool(ones, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
        counted = pool(ones, kernel, stride, padding, ceil_mode, count_include_pad, 1)
        return (counted / averaged)[0, 0].to(torch.float32).numpy()


def _pool_args(self, kernel_size, stride, padding):
    spatial = len(self.shape) - 2  # avg_pool1d reaches here as avg_pool2d
    kernel = list(kernel_size) * spatial if len(kernel_size) == 1 else list(kernel_size)
    stride = (list(stride) * spatial if len(stride) == 1 else list(stride)) if stride else kernel
    padding = list(padding) * spatial if len(padding) == 1 else list(padding)
    return spatial, kernel, stride, padding


def _avg_pool(torchlib_rule, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    # torch_lib's rules ignore divisor_override; rescale their result by default divisor / override.
    pooled = torchlib_rule(self, kernel_size, stride, padding, ceil_mode, count_include_pad)
    if not divisor_override:
        return pooled
    _, kernel, stride, padding = _pool_args(self, kernel_size, stride, padding)
    default = _avg_pool_divisor(self, kernel, stride, padding, ceil_mode, count_include_pad, None)
    scale = default / np.float32(divisor_override)
    return op.Mul(pooled, op.CastLike(op.Constant(value=ir.tensor(scale)), pooled))


@project_rule(aten.avg_pool2d.default)
def aten_avg_pool2d(self, kernel_size, stride=(), padding=(0, 0), ceil_mode=False, count_include_pad=True,
                    divisor_override=None):
    """avg_pool2d(Tensor self, int[2] kernel_size, int[2] stride=[], int[2] padding=0, bool ceil_mode=False, bool count_include_pad=True, int? divisor_override=None) -> Tensor"""
    return _avg_pool(torchlib_nn.aten_avg_pool2d, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override)


@project_rule(aten.avg_pool3d.default)
def aten_avg_pool3d(self, kernel_size, stride=(), padding=(0, 0, 0), ceil_mode=False, count_include_pad=True,
                    divisor_override=None):
    """avg_pool3d(Tensor self, int[3] kernel_size, int[3] stride=[], int[3] padding=0, bool ceil_mode=False, bool count_include_pad=True, int? divisor_override=None) -> Tensor"""
    return _avg_pool(torchlib_nn.aten_avg_pool3d, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override)


def _avg_pool_backward(
    grad_output,
    self,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
):
    spatial, kernel, stride, padding = _pool_args(self, kernel_size, stride, padding)
    divisor = _avg_pool_divisor(self, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
    grad = op.Div(grad_output, op.CastLike(op.Constant(value=ir.tensor(divisor)), grad_output))
    # Spread each position's share over its window: a depthwise transposed convolution with a kernel of
    # ones, computed unpadded and then cut to the input's extent (ceil mode can overhang the end).
    weight_shape = op.Concat(op.Shape(self, start=1, end=2), op.Constant(value_ints=[1, *kernel]), axis=0)
    weight = op.Expand(op.CastLike(1.0, grad_output), weight_shape)
    channels = self.shape[1]
    if not isinstance(channels, int):
        raise NotImplementedError("avg_pool backward needs a static channel count")
    full = op.ConvTranspose(grad, weight, strides=stride, group=channels)
    full = op.Pad(full, op.Constant(value_ints=[0] * (spatial + 2) + [0, 0] + list(stride)))
    axes = list(range(2, 2 + spatial))
    starts = op.Constant(value_ints=padding)
    ends = op.Add(starts, op.Shape(self, start=2))
    return op.Slice(full, starts, ends, op.Constant(value_ints=axes))


@project_rule(aten.avg_pool2d_backward.default)
def aten_avg_pool2d_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                             divisor_override=None):
    """avg_pool2d_backward(Tensor grad_output, Tensor self, int[2] kernel_size, int[2] stride, int[2] padding, bool ceil_mode, bool count_include_pad, int? divisor_override) -> Tensor"""
    return _avg_pool_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                              divisor_override)


@project_rule(aten.avg_pool3d_backward.default)
def aten_avg_pool3d_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                             divisor_override=None):
    """avg_pool3d_backward(Tensor grad_output, Tensor self, int[3] kernel_size, int[3] stride, int[3] padding, bool ceil_mode, bool count_include_pad, int? divisor_override) -> Tensor"""
    return _avg_pool_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                              divisor_override)
