"""Rules for complex tensors, which a lowered graph carries as real tensors with a trailing axis of 2 (real and
imaginary parts, ``torch.view_as_real``'s layout; see ``aot2onnx.signature``).

A complex rule (``is_complex=True``) lowers a node that reads or makes a complex tensor. The pair axis is the
last one, so an op that moves data along the tensor's own axes is its real rule with every axis counted from
the front (a negative ``dim`` would name the pair axis); arithmetic on the pairs is spelled out. A complex
value is never made by a real rule: ``dispatch`` sends a node with a complex output here even where its inputs
are real (``view_as_complex``, ``complex``, a cast to a complex dtype).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops import core as torchlib_core

from aot2onnx.errors import LoweringError
from aot2onnx.lower.ops import views
from aot2onnx.lower.ops._common import is_complex_value, mark_complex
from aot2onnx.lower.ops.core import aten_copy
from aot2onnx.lower.registry import project_rule

aten = torch.ops.aten

# The real dtype of each complex one: its parts' (``torch.view_as_real``).
_PARTS = {ir.DataType.COMPLEX64: ir.DataType.FLOAT, ir.DataType.COMPLEX128: ir.DataType.DOUBLE}


def _rank(x: ir.Value) -> int:
    """The complex tensor's own rank (the pair axis not counted)."""
    return len(x.shape) - 1


def _axis(dim: int, x: ir.Value) -> int:
    return dim % _rank(x)


def real_part(x: ir.Value) -> ir.Value:
    return op.Squeeze(op.Slice(x, [0], [1], axes=[-1]), axes=[-1])


def imag_part(x: ir.Value) -> ir.Value:
    return op.Squeeze(op.Slice(x, [1], [2], axes=[-1]), axes=[-1])


def pairs(real: ir.Value, imag: ir.Value) -> ir.Value:
    """The complex tensor of parts ``real`` and ``imag`` (one shape)."""
    return op.Concat(op.Unsqueeze(real, axes=[-1]), op.Unsqueeze(imag, axes=[-1]), axis=-1)


def _parts_dtype(dtype) -> ir.DataType:
    """The real dtype of a complex dtype's parts (``dtype`` as the exporter passes it: ONNX's number)."""
    parts = _PARTS.get(ir.DataType(dtype))
    if parts is None:
        raise LoweringError(f"no lowering of {ir.DataType(dtype)} tensors: ONNX Runtime computes with complex64 and "
                            "complex128 only, as float32 and float64 pairs")
    return parts


def _zeros_like(x: ir.Value) -> ir.Value:
    # Not x * 0, which is NaN where x is infinite.
    return op.Expand(op.CastLike(op.Constant(value_float=0.0), x), op.Shape(x))


# ----------------------------------------------------------------------------------------- data movement

@project_rule(aten.unsqueeze.default, is_complex=True)
def aten_unsqueeze_complex(self, dim: int):
    """unsqueeze(Tensor(a) self, int dim) -> Tensor(a)"""
    return op.Unsqueeze(self, axes=[dim % (_rank(self) + 1)])


@project_rule(aten.squeeze.dim, is_complex=True)
def aten_squeeze_dim_complex(self, dim: int):
    """squeeze.dim(Tensor(a) self, int dim) -> Tensor(a)"""
    return aten_squeeze_dims_complex(self, [dim])


@project_rule(aten.squeeze.dims, is_complex=True)
def aten_squeeze_dims_complex(self, dim: Sequence[int]):
    """squeeze.dims(Tensor(a) self, int[] dim) -> Tensor(a)"""
    if _rank(self) == 0:
        return op.Identity(self)
    axes = sorted({_axis(d, self) for d in dim if self.shape[_axis(d, self)] == 1})
    if any(not isinstance(self.shape[_axis(d, self)], int) for d in dim):
        raise LoweringError("squeeze of a complex tensor along a symbolic size")
    return op.Squeeze(self, axes=axes) if axes else op.Identity(self)


@project_rule(aten.select.int, is_complex=True)
def aten_select_complex(self, dim: int, index):
    """select.int(Tensor(a) self, int dim, SymInt index) -> Tensor(a)"""
    return torchlib_core.aten_select(self, _axis(dim, self), index)


@project_rule(aten.expand.default, is_complex=True)
def aten_expand_complex(self, size: Sequence[int], implicit: bool = False):
    """expand(Tensor(a) self, SymInt[] size, *, bool implicit=False) -> Tensor(a)"""
    if not all(isinstance(s, int) for s in size):
        raise LoweringError("expand of a complex tensor to symbolic sizes")
    # -1 keeps the size there; Expand broadcasts a size of 1 to the tensor's own.
    return op.Expand(self, op.Constant(value_ints=[1 if s == -1 else s for s in size] + [2]))


@project_rule(aten.alias.default, is_complex=True)
def aten_alias_complex(self):
    """alias(Tensor(a) self) -> Tensor(a)"""
    return op.Identity(self)


@project_rule(aten.copy.default, is_complex=True)
def aten_copy_complex(self, src, non_blocking: bool = False):
    """copy(Tensor self, Tensor src, bool non_blocking=False) -> Tensor"""
    # Both complex, of one precision: the pairs are copied as the real rule copies (a cast between real and
    # complex, or between precisions, is not a plain copy of the pairs).
    if is_complex_value(self) and is_complex_value(src) and src.dtype == self.dtype:
        return aten_copy(self, src, non_blocking)
    raise LoweringError("copy between a complex tensor and a real one, or complex tensors of two precisions: no "
                        "lowering yet")


@project_rule(aten.slice_scatter.default, is_complex=True)
def aten_slice_scatter_complex(self, src, dim: int = 0, start=None, end=None, step=1):
    """slice_scatter(Tensor self, Tensor src, int dim=0, SymInt? start=None, SymInt? end=None, SymInt step=1) -> Tensor"""
    return views.aten_slice_scatter(self, src, _axis(dim, self), start, end, step)


@project_rule(aten.select_scatter.default, is_complex=True)
def aten_select_scatter_complex(self, src, dim: int, index):
    """select_scatter(Tensor self, Tensor src, int dim, SymInt index) -> Tensor"""
    return views.aten_select_scatter(self, src, _axis(dim, self), index)


@project_rule(aten.constant_pad_nd.default, is_complex=True)
def aten_constant_pad_nd_complex(self, pad: Sequence[int], value: float = 0):
    """constant_pad_nd(Tensor self, SymInt[] pad, Scalar value=0) -> Tensor"""
    if value != 0:
        raise LoweringError("constant_pad_nd of a complex tensor with a nonzero value: no lowering yet")
    if not all(isinstance(p, int) for p in pad):
        raise LoweringError("constant_pad_nd of a complex tensor by symbolic sizes")
    rank = _rank(self)
    begins, ends = [0] * (rank + 1), [0] * (rank + 1)
    for i in range(len(pad) // 2):  # pad names the last axes first: (before, after) of axis -1, then of -2
        begins[rank - 1 - i], ends[rank - 1 - i] = pad[2 * i], pad[2 * i + 1]
    if all(p >= 0 for p in pad):
        return op.Pad(self, op.Constant(value_ints=begins + ends), mode="constant")
    # A negative pad crops: as ATen, crop then pad.
    starts = [max(-b, 0) for b in begins]
    stops = [(s if isinstance(s, int) else 2**62) - max(-e, 0) for s, e in zip(self.shape, ends)]
    cropped = op.Slice(self, op.Constant(value_ints=starts), op.Constant(value_ints=stops))
    return op.Pad(cropped, op.Constant(value_ints=[max(b, 0) for b in begins] + [max(e, 0) for e in ends]),
                  mode="constant")


@project_rule(aten.zeros.default, is_complex=True)
def aten_zeros_complex(size: Sequence[int], dtype=None, layout=None, device=None, pin_memory=None):
    """zeros(SymInt[] size, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor"""
    parts = _parts_dtype(dtype)
    shape = op.Concat(*[op.Reshape(s, [1]) if isinstance(s, ir.Value) else op.Constant(value_ints=[s])
                        for s in size], op.Constant(value_ints=[2]), axis=0)
    return op.ConstantOfShape(shape, value=ir.tensor([0], dtype=parts))


# ------------------------------------------------------------------------------------- making and casting

@project_rule(aten.view_as_complex.default, is_complex=True)
def aten_view_as_complex(self):
    """view_as_complex(Tensor(a) self) -> Tensor(a)"""
    return op.Identity(self)  # already the pairs


@project_rule(aten.complex.default, is_complex=True)
def aten_complex(real, imag):
    """complex(Tensor real, Tensor imag) -> Tensor"""
    return torchlib_core.aten_complex(real, imag)


@project_rule(aten.polar.default, is_complex=True)
def aten_polar(abs, angle):
    """polar(Tensor abs, Tensor angle) -> Tensor"""
    return torchlib_core.aten_complex(op.Mul(abs, op.Cos(angle)), op.Mul(abs, op.Sin(angle)))


def _cast(self, dtype):
    """``self`` cast to ``dtype``, as ATen casts: a complex tensor to a complex dtype part by part, a real tensor to a
    complex one with zero imaginary parts, a complex tensor to a real dtype by its real parts (ATen warns that it
    discards the imaginary ones)."""
    to = ir.DataType(dtype)
    if is_complex_value(self):
        if to == ir.DataType.BOOL:  # nonzero real or imaginary part, not the real part's truth
            raise LoweringError("a complex tensor cast to bool: no lowering yet")
        return op.Cast(self, to=_PARTS[to]) if to in _PARTS else op.Cast(real_part(self), to=to)
    if to not in _PARTS:
        raise LoweringError(f"a real cast to {to} reached a complex rule")
    real = op.Cast(self, to=_PARTS[to])
    return pairs(real, _zeros_like(real))


@project_rule(torch.ops.prims.convert_element_type.default, is_complex=True)
def prims_convert_element_type_complex(a, dtype):
    """convert_element_type(Tensor a, ScalarType dtype) -> Tensor"""
    return _cast(a, dtype)


@project_rule(aten._to_copy.default, is_complex=True)
def aten__to_copy_complex(self, dtype=-1, layout=None, device=None, pin_memory=None, non_blocking=False,
                          memory_format=None):
    """_to_copy(Tensor self, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None, bool non_blocking=False, MemoryFormat? memory_format=None) -> Tensor"""
    return op.Identity(self) if dtype == -1 else _cast(self, dtype)


@project_rule(aten.conj_physical.default, is_complex=True)
def aten_conj_physical_complex(self):
    """conj_physical(Tensor self) -> Tensor"""
    return pairs(real_part(self), op.Neg(imag_part(self)))


@project_rule(aten._conj_physical.default, is_complex=True)
def aten__conj_physical_complex(self):
    """_conj_physical(Tensor self) -> Tensor"""
    return aten_conj_physical_complex(self)


# -------------------------------------------------------------------------------------- matrix products

def _product(a, b):
    """a @ b of complex matrices (batched alike) in one real MatMul: [ar, ai] @ [[br, bi], [-bi, br]]."""
    if not (is_complex_value(a) and is_complex_value(b)):
        raise LoweringError("a matrix product of a complex matrix and a real one (ATen refuses mixed dtypes)")
    ar, ai, br, bi = real_part(a), imag_part(a), real_part(b), imag_part(b)
    left = op.Concat(ar, ai, axis=-1)
    right = op.Concat(op.Concat(br, bi, axis=-1), op.Concat(op.Neg(bi), br, axis=-1), axis=-2)
    product = op.MatMul(left, right)  # [..., m, 2n]: the real parts, then the imaginary ones
    real, imag = op.Split(product, num_outputs=2, axis=-1)
    return pairs(real, imag)


@project_rule(aten.bmm.default, is_complex=True)
def aten_bmm_complex(self, mat2):
    """bmm(Tensor self, Tensor mat2) -> Tensor"""
    return _product(self, mat2)


@project_rule(aten.mm.default, is_complex=True)
def aten_mm_complex(self, mat2):
    """mm(Tensor self, Tensor mat2) -> Tensor"""
    return _product(self, mat2)


@project_rule(aten.new_zeros.default, is_complex=True)
def aten_new_zeros_complex(self, size: Sequence[int], dtype=-1, layout=None, device=None, pin_memory=None):
    """new_zeros(Tensor self, SymInt[] size, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor"""
    if dtype == -1:
        if not is_complex_value(self):
            raise LoweringError("new_zeros of a real tensor reached a complex rule without a complex dtype")
        dtype = ir.DataType.COMPLEX64 if self.dtype == ir.DataType.FLOAT else ir.DataType.COMPLEX128
    return aten_zeros_complex(size, dtype)


@project_rule(aten.mul.Scalar, is_complex=True)
def aten_mul_scalar_complex(self, other: float):
    """mul.Scalar(Tensor self, Scalar other) -> Tensor"""
    # ATen multiplies by the complex number other + 0j: (inf + 1j) * 2 is inf + nanj.
    return _times_alpha(self, other)


@project_rule(aten.scalar_tensor.default, is_complex=True)
def aten_scalar_tensor_complex(s, dtype=-1, layout=None, device=None, pin_memory=None):
    """scalar_tensor(Scalar s, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor"""
    # A 0-d complex tensor: the pair [s.real, s.imag] (torch_lib's complex rule gives a 0-d real tensor, which
    # its own complex mul then slices along an axis it does not have).
    if dtype == -1:
        raise LoweringError("scalar_tensor without a dtype reached a complex rule")
    number = complex(s)
    parts = _parts_dtype(dtype)
    return op.Constant(value=ir.tensor([number.real, number.imag], dtype=parts))


@project_rule(aten.new_empty_strided.default, is_complex=True)
def aten_new_empty_strided_complex(self, size: Sequence[int], stride: Sequence[int], dtype=-1, layout=None,
                                   device=None, pin_memory=None):
    """new_empty_strided(Tensor self, SymInt[] size, SymInt[] stride, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor"""
    # Uninitialized memory in ATen (strides do not exist in ONNX): zeros, as torch_lib's real rule gives.
    return aten_new_zeros_complex(self, size, dtype)


@project_rule(aten.empty.memory_format, is_complex=True)
def aten_empty_complex(size: Sequence[int], dtype=None, layout=None, device=None, pin_memory=None,
                       memory_format=None):
    """empty.memory_format(SymInt[] size, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None, MemoryFormat? memory_format=None) -> Tensor"""
    return aten_zeros_complex(size, dtype)


# ------------------------------------------------------------------------------ arithmetic with real operands
#
# ATen promotes a real operand of a complex op to complex (imaginary part +0) and computes in complex: so do
# these, which keeps eager's signed zeros and NaNs (b + 0 is +0 for b = -0; b * 0 is NaN for b = inf). torch_lib's
# complex rules would read a real operand as pairs along its own last axis (dispatch refuses that).

def _promoted(x, like):
    if is_complex_value(x):
        return x
    real = op.CastLike(x, like)
    return pairs(real, _zeros_like(real))


@project_rule(aten.mul.Tensor, is_complex=True)
def aten_mul_complex(self, other):
    """mul.Tensor(Tensor self, Tensor other) -> Tensor"""
    if isinstance(other, (bool, int, float, complex)):  # a Python number (FX keeps it as it is): times a + bi
        return _times_alpha(self, other)
    if isinstance(self, (bool, int, float, complex)):
        return _times_alpha(other, self)
    like = self if is_complex_value(self) else other
    return torchlib_core.aten_mul_complex(_promoted(self, like), _promoted(other, like))


@project_rule(aten.add.Tensor, is_complex=True)
def aten_add_complex(self, other, alpha: float = 1.0):
    """add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor"""
    if isinstance(other, (bool, int, float, complex)):  # a Python number (FX keeps it as it is): as a pair
        number = complex(other)
        other = op.CastLike(op.Constant(value=ir.tensor([number.real, number.imag], dtype=ir.DataType.DOUBLE)), self)
        mark_complex(other)
    like = self if is_complex_value(self) else other
    return op.Add(_promoted(self, like), _times_alpha(_promoted(other, like), alpha))


def _times_alpha(other, alpha):
    """other * alpha (a real number) as ATen's add kernel computes it, ``a + alpha * b`` with alpha a complex number even when it
    is 1: (re * alpha - im * 0) + (re * 0 + im * alpha)i, so that an infinite part makes a NaN (z + z of
    z = inf + 1j is inf + nanj in eager)."""
    number = complex(alpha)
    re, im = real_part(other), imag_part(other)
    # The Python number as a double, rounded once to the tensor's dtype (a float attribute would be float32).
    a = op.CastLike(op.Constant(value=ir.tensor(number.real, dtype=ir.DataType.DOUBLE)), re)
    b = op.CastLike(op.Constant(value=ir.tensor(number.imag, dtype=ir.DataType.DOUBLE)), re)
    # (re + im i)(a + b i) = (re a - im b) + (re b + im a) i
    return pairs(op.Sub(op.Mul(re, a), op.Mul(im, b)), op.Add(op.Mul(re, b), op.Mul(im, a)))


@project_rule(aten.add.Scalar, is_complex=True)
def aten_add_scalar_complex(self, other, alpha: float = 1.0):
    """add.Scalar(Tensor self, Scalar other, Scalar alpha=1) -> Tensor"""
    # The number is complex: torch_lib's complex rule added a real one to both parts.
    number = complex(other)
    pair = op.CastLike(op.Constant(value=ir.tensor([number.real, number.imag], dtype=ir.DataType.DOUBLE)), self)
    mark_complex(pair)
    return aten_add_complex(self, pair, alpha)


@project_rule(aten.sub.Tensor, is_complex=True)
def aten_sub_complex(self, other, alpha: float = 1.0):
    """sub.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor"""
    # ATen's sub is add with -alpha.
    return aten_add_complex(self, other, -alpha)


@project_rule(aten.detach.default, is_complex=True)
def aten_detach_complex(self):
    """detach(Tensor(a) self) -> Tensor(a)"""
    return op.Identity(self)


# ------------------------------------------------------------------------------------------ reductions

def _complex_axes(self, dim) -> list[int]:
    """ATen's reduction dims (None or [] for all) as axes of the pairs: never the pair axis. torch_lib's complex
    sum and mean passed an empty list on to ONNX, whose reductions then reduce every axis, the pairs' too (the
    sum of a 0-d complex tensor came back 0-d)."""
    rank = _rank(self)
    if rank == 0:  # ATen takes dim 0 or -1 of a 0-d tensor: nothing to reduce
        return []
    if dim is None or (not isinstance(dim, int) and len(dim) == 0):
        return list(range(rank))
    return sorted({d % rank for d in ([dim] if isinstance(dim, int) else dim)})


def _reduce(reduction, self, dim, keepdim: bool, dtype):
    if dtype not in (-1, None) and _PARTS.get(ir.DataType(dtype)) != self.dtype:
        raise LoweringError("a complex reduction into another dtype: no lowering yet")
    axes = _complex_axes(self, dim)
    if not axes:  # a 0-d complex tensor
        return op.Identity(self)
    return reduction(self, op.Constant(value_ints=axes), keepdims=int(keepdim))


@project_rule(aten.sum.default, is_complex=True)
def aten_sum_complex(self, dtype=-1):
    """sum(Tensor self, *, ScalarType? dtype=None) -> Tensor"""
    return _reduce(op.ReduceSum, self, None, False, dtype)


@project_rule(aten.sum.dim_IntList, is_complex=True)
def aten_sum_dim_complex(self, dim=None, keepdim: bool = False, dtype=-1):
    """sum.dim_IntList(Tensor self, int[1]? dim, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor"""
    return _reduce(op.ReduceSum, self, dim, keepdim, dtype)


@project_rule(aten.mean.default, is_complex=True)
def aten_mean_complex(self, dtype=-1):
    """mean(Tensor self, *, ScalarType? dtype=None) -> Tensor"""
    return _reduce(op.ReduceMean, self, None, False, dtype)


@project_rule(aten.mean.dim, is_complex=True)
def aten_mean_dim_complex(self, dim=None, keepdim: bool = False, dtype=-1):
    """mean.dim(Tensor self, int[1]? dim, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor"""
    return _reduce(op.ReduceMean, self, dim, keepdim, dtype)


@project_rule(aten.squeeze.default, is_complex=True)
def aten_squeeze_complex(self):
    """squeeze(Tensor(a) self) -> Tensor(a)"""
    return aten_squeeze_dims_complex(self, list(range(_rank(self))))


@project_rule(aten.abs.default, is_complex=True)
def aten_abs_complex(self):
    """abs(Tensor self) -> Tensor (complex input: its magnitude, a real tensor)"""
    # hypot(re, im), as ATen's kernel (Sleef's hypot): scaled by the larger part, so that it does not overflow
    # where re * re does (torch_lib's ReduceL2 gave inf for |re| > 1.8e19 in float32). Infinite beats NaN.
    a, b = op.Abs(real_part(self)), op.Abs(imag_part(self))
    larger, smaller = op.Max(a, b), op.Min(a, b)
    ratio = op.Div(smaller, larger)
    one = op.CastLike(op.Constant(value_float=1.0), a)
    magnitude = op.Mul(larger, op.Sqrt(op.Add(one, op.Mul(ratio, ratio))))
    zero = op.CastLike(op.Constant(value_float=0.0), a)
    magnitude = op.Where(op.Equal(larger, zero), zero, magnitude)
    nan = op.CastLike(op.Constant(value_float=float("nan")), a)
    magnitude = op.Where(op.Or(op.IsNaN(a), op.IsNaN(b)), nan, magnitude)
    inf = op.CastLike(op.Constant(value_float=float("inf")), a)
    return op.Where(op.Or(op.IsInf(a), op.IsInf(b)), inf, magnitude)


@project_rule(aten.where.self, is_complex=True)
def aten_where_complex(condition, self, other):
    """where.self(Tensor condition, Tensor self, Tensor other) -> Tensor"""
    like = self if is_complex_value(self) else other
    return op.Where(op.Unsqueeze(condition, axes=[-1]), _promoted(self, like), _promoted(other, like))


@project_rule(aten.copy_.default, is_complex=True)
def aten_copy__complex(self, src, non_blocking: bool = False):
    """copy_(Tensor(a!) self, Tensor src, bool non_blocking=False) -> Tensor(a!)"""
    # A written complex input (AOTAutograd's mutation epilogue): the runtime copies the pairs into its memory.
    return aten_copy_complex(self, src, non_blocking)


# ------------------------------------------------------------------------------------------------- division
#
# ATen divides complex numbers as numpy does (c10::complex's operator/=, which its CPU kernels call per element):
# scaled by the divisor's larger part, so that |divisor| up to the dtype's maximum does not overflow, and z / 0
# is a complex infinity or NaN part by part. Each branch is computed everywhere and the element's own taken
# (a branch's inf or NaN elsewhere is not read). These rules take precedence over torch_lib's, (ac + bd, bc - ad)
# / (c^2 + d^2), which gave NaN for eager's inf at z / 0 and 0 for eager's 2.4e-31 where c^2 + d^2 overflows.

def _scaled(a, b, rat, scl, real_major: bool):
    """(re, im) of (a + bi) / (c + di) given c10::complex's ratio and scale: rat = d / c and scl = 1 / (c + d rat)
    where |c| >= |d| (``real_major``), else rat = c / d and scl = 1 / (d + c rat)."""
    if real_major:
        return op.Mul(op.Add(a, op.Mul(b, rat)), scl), op.Mul(op.Sub(b, op.Mul(a, rat)), scl)
    return op.Mul(op.Add(op.Mul(a, rat), b), scl), op.Mul(op.Sub(op.Mul(b, rat), a), scl)


def _divided(numerator, divisor):
    """``numerator / divisor``, both complex pairs (broadcast), as c10::complex divides."""
    a, b = real_part(numerator), imag_part(numerator)
    c, d = real_part(divisor), imag_part(divisor)
    one = op.CastLike(op.Constant(value=ir.tensor(1.0, dtype=ir.DataType.DOUBLE)), c)
    zero = op.CastLike(op.Constant(value=ir.tensor(0.0, dtype=ir.DataType.DOUBLE)), c)
    abs_c, abs_d = op.Abs(c), op.Abs(d)
    real_major = op.GreaterOrEqual(abs_c, abs_d)  # False where either part is NaN: ATen's else branch
    both_zero = op.And(op.Equal(abs_c, zero), op.Equal(abs_d, zero))
    rat = op.Div(d, c)  # |c| >= |d| (and not both zero)
    re_1, im_1 = _scaled(a, b, rat, op.Div(one, op.Add(c, op.Mul(d, rat))), True)
    rat_2 = op.Div(c, d)  # |c| < |d|
    re_2, im_2 = _scaled(a, b, rat_2, op.Div(one, op.Add(d, op.Mul(c, rat_2))), False)
    # both zero: a / |c|, b / |d| (inf or NaN, as IEEE divides)
    re_0, im_0 = op.Div(a, abs_c), op.Div(b, abs_d)
    re = op.Where(real_major, op.Where(both_zero, re_0, re_1), re_2)
    im = op.Where(real_major, op.Where(both_zero, im_0, im_1), im_2)
    return pairs(re, im)


def _complex_number(number, like):
    """A Python number as a complex pair in ``like``'s dtype (rounded once from the double)."""
    number = complex(number)
    value = op.CastLike(op.Constant(value=ir.tensor([number.real, number.imag], dtype=ir.DataType.DOUBLE)), like)
    mark_complex(value)
    return value


@project_rule(aten.div.Tensor, is_complex=True)
def aten_div_complex(self, other):
    """div.Tensor(Tensor self, Tensor other) -> Tensor"""
    if isinstance(other, (bool, int, float, complex)):  # a Python number (FX keeps it as it is)
        return _divided_by_number(self, other)
    like = next(v for v in (self, other) if isinstance(v, ir.Value) and is_complex_value(v))
    self, other = (_complex_number(v, like) if isinstance(v, (bool, int, float, complex)) else _promoted(v, like)
                   for v in (self, other))
    return _divided(self, other)


def _divided_by_number(numerator, number):
    """``numerator / number`` for a Python number: c10::complex's division with the branch chosen here and its
    constants rat and scl computed in the tensor's dtype, as ATen computes them per element (no constant branch
    left for the graph to fold, whose divisions by zero numpy warns about)."""
    real = np.float64 if numerator.dtype == ir.DataType.DOUBLE else np.float32  # the pairs' parts
    number = complex(number)
    c, d = real(number.real), real(number.imag)
    a, b = real_part(numerator), imag_part(numerator)

    def constant(value):
        return op.CastLike(op.Constant(value=ir.tensor(np.array(value, dtype=real))), a)

    with np.errstate(divide="ignore", invalid="ignore"):
        real_major = abs(c) >= abs(d)
        if real_major and c == 0 and d == 0:
            return pairs(op.Div(a, constant(abs(c))), op.Div(b, constant(abs(d))))
        rat = d / c if real_major else c / d
        scl = real(1) / (c + d * rat if real_major else d + c * rat)
    return pairs(*_scaled(a, b, constant(rat), constant(scl), real_major))


@project_rule(aten.div.Scalar, is_complex=True)
def aten_div_scalar_complex(self, other):
    """div.Scalar(Tensor self, Scalar other) -> Tensor"""
    return _divided_by_number(self, other)


@project_rule(aten.reciprocal.default, is_complex=True)
def aten_reciprocal_complex(self):
    """reciprocal(Tensor self) -> Tensor"""
    # ATen's complex reciprocal is complex(1) / z, the same division.
    return _divided(_complex_number(1.0, self), self)
