"""Core ops where torch_lib's rule loses what ATen keeps."""

from __future__ import annotations

import numbers

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops import core as torchlib_core

from aot2onnx.lower.ops._common import FLOATS, INTEGERS, float64_constant, linspace, rounded_to, static_dim
from aot2onnx.lower.registry import project_rule

aten = torch.ops.aten


@project_rule(aten.scalar_tensor.default)
def aten_scalar_tensor(s, dtype: int = -1, layout: str = "", device: str = "", pin_memory: bool = False):
    """scalar_tensor(Scalar s, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor"""
    # torch_lib makes a float32 constant and casts it, so 0.3 in a double graph becomes 0.30000001. Every
    # Python scalar of a mixed-dtype ATen op reaches ONNX through here (the exporter's type promotion pass
    # rewrites them into scalar_tensor), so the constant is made in its own dtype.
    if not isinstance(s, numbers.Number) or isinstance(s, complex):
        return torchlib_core.aten_scalar_tensor(s, dtype, layout, device, pin_memory)
    data_type = ir.DataType.FLOAT if dtype == -1 else ir.DataType(dtype)
    return op.Constant(value=ir.tensor(np.array(s, dtype=data_type.numpy())))


@project_rule(torch.ops.prims.scalar_tensor.default)
def prims_scalar_tensor(s, dtype: int = -1, device: str = ""):
    """scalar_tensor(Scalar s, *, ScalarType? dtype=None, Device? device=None) -> Tensor"""
    # What torch's refs make of a Python scalar beside a tensor (copysign(x, -1.0)). Without a dtype the prim
    # takes the scalar's own type: int64 for an int, bool for a bool, the default float dtype for a float.
    if dtype == -1 and isinstance(s, int):  # bool is an int too
        dtype = int(ir.DataType.BOOL if isinstance(s, bool) else ir.DataType.INT64)
    return aten_scalar_tensor(s, dtype)


def _linspace(start, end, steps: int, dtype: int, fallback):
    """ATen's linspace bit for bit (torch_lib's, like torch's own decomposition, is an ulp off at most steps,
    and an integer one off by 1 after truncation): the bounds ``start`` and ``end`` (numbers, or 0-d tensors,
    whose item() ATen takes) in the dtype, truncated for an integer one, the step in that dtype (double for
    an integer one), each value an fma. ``fallback()`` is torch_lib's rule, for the other dtypes."""
    data_type = ir.DataType.FLOAT if dtype in (-1, None) else ir.DataType(dtype)
    exact = data_type in (ir.DataType.FLOAT, ir.DataType.DOUBLE) or data_type.is_integer()
    sixteen_bit = data_type in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
    if not (exact or sixteen_bit) or steps < 2 or any(isinstance(v, (bool, complex)) for v in (start, end)):
        return fallback()
    if sixteen_bit:
        return _linspace_16bit(start, end, steps, data_type)
    integer = data_type.is_integer()
    step_dtype = ir.DataType.DOUBLE if integer else data_type

    def bound(v):
        if isinstance(v, ir.Value):
            return op.Cast(op.Cast(v, to=ir.DataType.INT64) if integer else v, to=step_dtype)
        return op.Constant(value=ir.tensor(np.asarray(int(v) if integer else v, dtype=step_dtype.numpy())))

    first, last = bound(start), bound(end)
    step = op.Div(op.Sub(last, first), op.Constant(value=ir.tensor(np.asarray(steps - 1, dtype=step_dtype.numpy()))))
    return op.Cast(linspace(first, last, step, steps), to=data_type)


def _linspace_16bit(start, end, steps: int, data_type: ir.DataType):
    """A float16 or bfloat16 linspace as ATen's serial CPU kernel computes it in c10's 16-bit arithmetic: every
    operation in float32 rounded to the dtype, an integer operand converted to the dtype first (through float,
    as c10 converts an int64). step = (end - start) / (steps - 1); value k is start + step * k before halfway,
    end - step * (steps - 1 - k) from there. torch_lib's rule (float32 throughout) was an ulp off in most
    ranges; this one matched torch.linspace on 600 random (start, end, steps) in both dtypes."""
    f32 = ir.DataType.FLOAT

    def bound(v):  # a Scalar's double (or a 0-d tensor's item()) to the dtype, through float as c10 does
        value = op.Cast(v, to=f32) if isinstance(v, ir.Value) else op.Constant(
            value=ir.tensor(np.asarray(v, dtype=np.float32)))
        return rounded_to(value, data_type)

    first, last = bound(start), bound(end)
    divisor = rounded_to(op.Constant(value=ir.tensor(np.asarray(steps - 1, dtype=np.float32))), data_type)
    step = rounded_to(op.Div(rounded_to(op.Sub(last, first), data_type), divisor), data_type)
    k = op.Range(op.Constant(value_int=0), op.Constant(value_int=steps), op.Constant(value_int=1))
    before_halfway = op.Less(k, op.Constant(value_int=steps // 2))
    count = op.Where(before_halfway, k, op.Sub(op.Constant(value_int=steps - 1), k))
    offset = rounded_to(op.Mul(step, rounded_to(op.Cast(count, to=f32), data_type)), data_type)
    return op.Cast(op.Where(before_halfway, op.Add(first, offset), op.Sub(last, offset)), to=data_type)


@project_rule(aten.linspace.default)
@project_rule(aten.linspace.Tensor_Tensor)
@project_rule(aten.linspace.Tensor_Scalar)
@project_rule(aten.linspace.Scalar_Tensor)
def aten_linspace(start, end, steps: int, dtype: int = -1, layout: str = "", device: str = "",
                  pin_memory: bool = False):
    """linspace(Scalar start, Scalar end, int steps, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor

    Also linspace.Tensor_Tensor, Tensor_Scalar and Scalar_Tensor: either bound a 0-d tensor."""
    return _linspace(start, end, steps, dtype,
                     lambda: torchlib_core.aten_linspace(start, end, steps, dtype, layout, device, pin_memory))


@project_rule(aten.logspace.default)
@project_rule(aten.logspace.Tensor_Tensor)
@project_rule(aten.logspace.Tensor_Scalar)
@project_rule(aten.logspace.Scalar_Tensor)
def aten_logspace(start, end, steps: int, base: float = 10.0, dtype: int = -1, layout: str = "", device: str = "",
                  pin_memory: bool = False):
    """logspace(Scalar start, Scalar end, int steps, float base=10.0, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor

    Also logspace.Tensor_Tensor, Tensor_Scalar and Scalar_Tensor: either bound a 0-d tensor.

    ATen's CPU kernel, which torch's decomposition (a float64 linspace, then pow) is not: the bounds are first
    rounded to the dtype (truncated for an integer one), their difference is taken in the dtype, and the
    exponents are ``start + step * k`` up to halfway and ``end - step * (steps - 1 - k)`` after, in double,
    then ``pow(base, exponent)`` in double, rounded once to the dtype. A bfloat16 logspace from 4.3 starts at
    10^4.3125 (20480), not 10^4.3 (19968). One step is ``pow(base, start)``, start unrounded. Matched
    torch.logspace bit for bit on 1,350 random (start, end, steps, base) in float32, float64, float16 and
    bfloat16."""
    data_type = ir.DataType.FLOAT if dtype in (-1, None) else ir.DataType(dtype)
    if data_type not in (*FLOATS, *INTEGERS) or any(isinstance(v, (bool, complex)) for v in (start, end)):
        raise NotImplementedError(f"aot2onnx lowers logspace to real dtypes; got {data_type} ({start!r}, {end!r})")
    double = ir.DataType.DOUBLE

    def exact(v):  # the bound as ATen's Scalar holds it
        return op.Cast(v, to=double) if isinstance(v, ir.Value) else float64_constant(float(v))

    base_value = float64_constant(float(base))
    if steps <= 1:
        values = op.Pow(base_value, op.Reshape(exact(start), op.Constant(value_ints=[1]))) if steps == 1 else (
            op.Constant(value=ir.tensor(np.zeros(0, dtype=np.float64))))
        return op.Cast(values, to=data_type)
    integer = data_type.is_integer()
    # The dtype's arithmetic: int64 for integers, float32 for 16-bit floats (c10's Half and BFloat16 compute in
    # float and round), the dtype itself otherwise.
    arithmetic = ir.DataType.INT64 if integer else (double if data_type == double else ir.DataType.FLOAT)

    def rounded(v):
        return op.Cast(op.Cast(v, to=ir.DataType.INT64 if integer else data_type), to=arithmetic)

    first, last = rounded(exact(start)), rounded(exact(end))
    difference = op.Sub(last, first)  # C++ promotes a small integer type's difference to int
    difference = op.Cast(difference if integer else op.Cast(difference, to=data_type), to=double)
    step = op.Div(difference, float64_constant(float(steps - 1)))
    k = op.Cast(op.Range(op.Constant(value_int=0), op.Constant(value_int=steps), op.Constant(value_int=1)), to=double)
    before_halfway = op.Less(k, float64_constant(float(steps // 2)))
    exponent = op.Where(before_halfway, op.Add(op.Cast(first, to=double), op.Mul(step, k)),
                        op.Sub(op.Cast(last, to=double), op.Mul(step, op.Sub(float64_constant(float(steps - 1)), k))))
    return op.Cast(op.Pow(base_value, exponent), to=data_type)


@project_rule(aten.fill.Scalar)
def aten_fill_scalar(self, value):
    """fill.Scalar(Tensor self, Scalar value) -> Tensor"""
    # torch_lib types the value apart from self, so a Python float became a float32 constant cast to self's
    # dtype: a double tensor filled with 8.396163642458497 held 8.396163940429688 (hinge_embedding_loss's
    # margin reaches ONNX this way). The constant is made in self's dtype, rounded once as ATen does.
    if not isinstance(value, numbers.Number) or isinstance(value, complex) or self.dtype is None:
        return torchlib_core.aten_fill(self, value)
    constant = op.Constant(value=ir.tensor(np.array(value, dtype=self.dtype.numpy())))
    return op.Expand(constant, op.Shape(self))


@project_rule(aten.copy.default)
def aten_copy(self, src, non_blocking: bool = False):
    """copy(Tensor self, Tensor src, bool non_blocking=False) -> Tensor"""
    # The result is self's shape and dtype, with src broadcast into it. torch_lib only casts, keeping src's
    # shape: the backward of affine_grid copies a [W] linspace into an [N, H, W] slice of its base grid, and
    # the select_scatter that puts the slice back then failed in ONNX Runtime (Unsqueeze axis out of range).
    copied = op.CastLike(src, self)
    same = self.shape is not None and src.shape is not None and len(self.shape) == len(src.shape)
    if same and all(isinstance(a, int) and a == b for a, b in zip(self.shape, src.shape)):
        return copied
    return op.Expand(copied, op.Shape(self))


@project_rule(aten.copy_.default)
def aten_copy_(self, src, non_blocking: bool = False):
    """copy_(Tensor(a!) self, Tensor src, bool non_blocking=False) -> Tensor(a!)"""
    # AOTAutograd keeps a data mutation of a graph input in the graph as this copy_ (the backend captures
    # with keep_inference_input_mutations): the value is copy's, and the lowering records it as the input's
    # new value (MutationSpec), which the runtime writes into the input.
    return aten_copy(self, src, non_blocking)


def _split(self, sizes, dim: int):
    """The pieces as plain values, or ``None`` when the sizes are not all static.

    Equal pieces are one Split node; other sizes are one Slice per piece (the recorder can only give a
    Split its outputs through ``num_outputs``, which ONNX does not allow beside explicit sizes).
    """
    if not all(isinstance(s, int) for s in sizes):
        return None
    if len(set(sizes)) == 1 and len(sizes) > 1:
        return list(op.Split(self, axis=dim, num_outputs=len(sizes)))
    pieces, start = [], 0
    for size in sizes:
        pieces.append(op.Slice(self, op.Constant(value_ints=[start]), op.Constant(value_ints=[start + size]),
                               op.Constant(value_ints=[dim])))
        start += size
    return pieces


# torch_lib splits into an ONNX sequence (SplitToSequence + SequenceAt), which ONNX Runtime runs by copying
# every piece. With static sizes, one Split node gives the pieces as plain outputs.


@project_rule(aten.split.Tensor)
def aten_split(self, split_size, dim: int = 0):
    """split.Tensor(Tensor(a -> *) self, SymInt split_size, int dim=0) -> Tensor(a)[]"""
    length = static_dim(self, dim)
    if length is not None and isinstance(split_size, int) and split_size > 0:
        sizes = [split_size] * (length // split_size) + ([length % split_size] if length % split_size else [])
        pieces = _split(self, sizes, dim)
        if pieces is not None:
            return pieces
    return torchlib_core.aten_split(self, split_size, dim)


@project_rule(aten.split_with_sizes.default)
def aten_split_with_sizes(self, split_sizes, dim: int = 0):
    """split_with_sizes(Tensor(a -> *) self, SymInt[] split_sizes, int dim=0) -> Tensor(a)[]"""
    pieces = _split(self, split_sizes, dim)
    return pieces if pieces is not None else torchlib_core.aten_split_with_sizes(self, split_sizes, dim)


@project_rule(aten.unbind.int)
def aten_unbind(self, dim: int = 0):
    """unbind.int(Tensor(a -> *) self, int dim=0) -> Tensor(a)[]"""
    length = static_dim(self, dim)
    if length is None:
        return torchlib_core.aten_unbind(self, dim)
    axes = op.Constant(value_ints=[dim])
    return [op.Squeeze(piece, axes) for piece in _split(self, [1] * length, dim)]
