"""Elementwise prims that PyTorch's decompositions produce and torch_lib does not lower, and elementwise ops
whose torch_lib rule answers differently from ATen: sign and clamp with NaN, hardtanh's gradient at its bounds,
signed zeros through selections, extrema and clamps, float64 scalars, the tails of sigmoid, tanh and log1p,
and pow with the exponents ATen computes without pow."""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops import core as torchlib_core
from onnxscript.function_libs.torch_lib.ops import nn as torchlib_nn

from aot2onnx.lower.ops._common import INTEGERS, cast, rounded_to, static_dims
from aot2onnx.lower.ops._common import opmath as _opmath
from aot2onnx.lower.ops._control import cond, loop, on_device
from aot2onnx.lower.registry import project_rule

aten, prims = torch.ops.aten, torch.ops.prims

_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _of_bools(extremum):
    """Max or Min, or for bools (which ONNX Runtime's Max and Min refuse) Or or And."""
    return (lambda a, b: op.Or(a, b)) if extremum == op.Max else (lambda a, b: op.And(a, b))


def _nan_ignoring(extremum, self, other):
    # fmax/fmin: a NaN loses to a number; NaN only when both are NaN.
    if self.dtype == ir.DataType.BOOL:
        return _of_bools(extremum)(self, other)
    result = extremum(self, other)
    if self.dtype not in _FLOATS:
        return result
    return op.Where(op.IsNaN(self), other, op.Where(op.IsNaN(other), self, result))


@project_rule(prims.fmax.default)
def prims_fmax(self, other):
    """fmax(Tensor self, Tensor other) -> Tensor"""
    return _nan_ignoring(op.Max, self, other)


@project_rule(prims.fmin.default)
def prims_fmin(self, other):
    """fmin(Tensor self, Tensor other) -> Tensor"""
    return _nan_ignoring(op.Min, self, other)


@project_rule(aten.sign.default)
def aten_sign(self):
    """sign(Tensor self) -> Tensor"""
    if self.dtype == ir.DataType.BOOL:
        return op.Identity(self)
    # ATen's sign is (0 < x) - (x < 0): 0 for NaN (ONNX's Sign gives NaN) and +0 for -0.
    zero = op.CastLike(0, self)
    return op.Sub(op.CastLike(op.Less(zero, self), self), op.CastLike(op.Less(self, zero), self))


# ---------------------------------------------------------------------------------------------------------
# Selections, extrema and clamps that keep the sign of zero.
#
# ONNX Runtime's CPU Where (where_op.cc) selects in two passes, x where the condition holds (+0.0 elsewhere)
# and y where it does not (+0.0 elsewhere), and merges them as `x_part != 0 ? x_part : y_part`: a -0.0 taken
# from x equals 0 and comes out as y_part's +0.0 (where(x == 0, x, 1.0) of -0.0 was 0.0). A -0.0 from y comes
# through. Its Max and Min return either zero of a tie, by the element's place in their vector loop
# (maximum(-x, x) of zeros(4) was 0.0, of zeros(7) 0.0 four times and -0.0 three times).


# ONNX Runtime's NotWhereFusion rewrites Where(Not(c), a, b) as Where(c, b, a), which puts first the operand
# that may hold -0.0 (masked_fill(x != x, -0.7) of -0.0 was 0.0: ne is Not(Equal)). A Where here never reads a
# Not: its input negated with Xor instead.


def _not_input(condition):
    producer = condition.producer()
    if producer is not None and producer.op_type == "Not" and producer.domain in ("", "ai.onnx"):
        return producer.inputs[0]
    return None


def _negation(condition):
    negated = _not_input(condition)
    if negated is not None:
        return _condition(negated)
    return op.Xor(condition, op.Constant(value=ir.tensor(True)))


def _condition(condition):
    negated = _not_input(condition)
    return condition if negated is None else op.Xor(negated, op.Constant(value=ir.tensor(True)))


def _constant(value) -> np.ndarray | None:
    if value.const_value is not None:
        return value.const_value.numpy()
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
        return producer.attributes["value"].as_tensor().numpy()
    return None


def _may_hold_negative_zero(value) -> bool:
    if value.dtype is not None and value.dtype not in _FLOATS:
        return False
    data = _constant(value)
    return data is None or bool(np.any((data == 0) & np.signbit(data)))


# ONNX Runtime's CPU Where also branches on every element: where the condition is unpredictable it is slow
# (ReLU's gradient, where(x <= 0, 0, g) on 8 x 64 x 512 random values: 1.35 ms, a Mul 0.05 ms), where it
# almost always goes one way (a mask, a guard) it is about as fast as two elementwise ops. A selection of a
# constant (a gradient masked to 0, a fill) on a large tensor is arithmetic instead, with a mask m of 0 and 1:
#   c ? v : y  =  y * (1 - m) + w,  w = v where c holds and -0.0 where it does not,
# which is bitwise y where c does not hold (y * 1 + -0.0 is y, -0.0 and +0.0 included) and v where it does
# (+-0 + v; for v = +0.0, +-0 + +0.0 is +0.0), for finite y. w comes from m alone: m * v for v < 0, (m - 1/2)
# * 0.0 for v = +0.0; for v > 0 the sum is written as a difference with 0 - m * v, which is +0.0 where c
# does not hold. A NaN or inf in y would come out NaN where c holds (inf * 0): the sum of y, which is not
# finite then, picks the Where instead, in an If. On that ReLU gradient: 0.33 ms, guard included.
_ARITHMETIC_SELECT_ELEMENTS = 8192


def _elements(value) -> int | None:
    dims = static_dims(value)
    return None if dims is None else math.prod(dims)


def _broadcasts_into(inner: list, outer: list) -> bool:
    """Whether dims ``inner`` broadcast into ``outer`` without growing it (aligned from the right, each 1 or
    the same size, known or symbolic)."""
    return len(inner) <= len(outer) and all(a == 1 or a == b for a, b in zip(reversed(inner), reversed(outer)))


def _negative_zero(fill: float) -> bool:
    return fill == 0 and math.copysign(1.0, fill) < 0


def _arithmetic_select(condition, fill: float, y, fill_where: bool = True):
    """``condition ? fill : y`` (``condition ? y : fill`` with ``fill_where`` False) for a finite Python float
    ``fill`` (not -0.0) and a float32/64 tensor y; None where the Where is as good (a small or 16-bit tensor)."""
    if y.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE) or not math.isfinite(fill) or on_device():
        return None  # on a device the Where is one kernel, and the guard below a wait for the GPU
    if _negative_zero(fill):
        return None  # +-0 + w is +0.0 for a +0.0 product whatever w: no sum gives -0.0 there
    if all(n is not None and n < _ARITHMETIC_SELECT_ELEMENTS for n in (_elements(condition), _elements(y))):
        return None

    def fast():
        c = op.Cast(condition, to=y.dtype)
        m, keep = (c, op.Sub(_scalar(1.0, y.dtype), c)) if fill_where else (op.Sub(_scalar(1.0, y.dtype), c), c)
        kept = op.Mul(y, keep)
        if fill == 0:
            result = op.Add(kept, op.Mul(op.Sub(m, _scalar(0.5, y.dtype)), _scalar(0.0, y.dtype)))
        elif fill < 0:
            result = op.Add(kept, op.Mul(m, _scalar(fill, y.dtype)))
        else:
            result = op.Sub(kept, op.Sub(_scalar(0.0, y.dtype), op.Mul(m, _scalar(fill, y.dtype))))
        result.dtype = y.dtype
        return [result]

    def exact():
        fill_value = _scalar(fill, y.dtype)
        result = (op.Where(_condition(condition), fill_value, y) if fill_where
                  else op.Where(_negation(condition), fill_value, y))
        result.dtype = y.dtype
        return [result]

    total = op.ReduceSum(y, keepdims=0)
    not_finite = op.IsNaN(op.Sub(total, total))
    (result,) = cond(not_finite, exact, fast)
    if y.shape is not None and condition.shape is not None and _broadcasts_into(list(condition.shape), list(y.shape)):
        result.shape = ir.Shape(list(y.shape))  # as Where's result would say (an If's says nothing)
    return result


def _cast_constant(value) -> np.ndarray | None:
    """A constant, or a Cast or CastLike of one (torch_lib's zeros_like casts its 0 to the tensor's type),
    in ``value``'s dtype."""
    data, dtype = _constant(value), value.dtype
    producer = value.producer()
    if data is None and producer is not None and producer.op_type in ("Cast", "CastLike") and producer.domain in ("", "ai.onnx"):
        data = _constant(producer.inputs[0])
        if dtype is None:  # a value in a rule's trace has none yet
            dtype = (producer.inputs[1].dtype if producer.op_type == "CastLike"
                     else ir.DataType(producer.attributes["to"].as_int()))
    if data is None or dtype not in _FLOATS:
        return None
    return data.astype(dtype.numpy())


def _fill(value, other) -> float | None:
    """The one float ``value`` holds everywhere, if it is a constant (a scalar, or one expanded as full and
    zeros_like make it) whose shape broadcasts into ``other``'s: the selection's shape is then the other
    operand's and the condition's."""
    data = _cast_constant(value)
    dims = list(data.shape) if data is not None else None
    producer = value.producer()
    if data is None and producer is not None and producer.op_type == "Expand" and producer.domain in ("", "ai.onnx"):
        data = _cast_constant(producer.inputs[0])
    if data is None and producer is not None and producer.op_type == "ConstantOfShape" and "value" in producer.attributes:
        data = producer.attributes["value"].as_tensor().numpy()
    if data is None or data.size != 1 or data.dtype.kind != "f":
        return None
    mine = list(value.shape.dims) if value.shape is not None else dims
    if mine is None or other.shape is None:
        return None
    if not _broadcasts_into(mine, list(other.shape)):
        return None
    return float(data.reshape(()))


def _per_element(condition, other) -> bool:
    """Whether the condition has the operand's own shape: one truth value per element, which may change from
    element to element (a ReLU mask), where a condition broadcast along axes (a row mask) changes in runs."""
    if condition.shape is None or other.shape is None:
        return True
    return list(condition.shape.dims) == list(other.shape.dims)


def select(condition, x, y):
    """``Where(condition, x, y)``, keeping the sign of every zero it selects."""
    if x.dtype == ir.DataType.BOOL and y.dtype == ir.DataType.BOOL:  # ONNX Runtime has no bool Where kernel
        uint8 = ir.DataType.UINT8
        return op.Cast(op.Where(_condition(condition), op.Cast(x, to=uint8), op.Cast(y, to=uint8)), to=ir.DataType.BOOL)
    if condition.dtype == ir.DataType.BOOL:
        for fill, other, fill_where in ((_fill(x, y), y, True), (_fill(y, x), x, False)):
            if fill is None or other.dtype not in _FLOATS:
                continue
            if _per_element(condition, other):
                result = _arithmetic_select(condition, fill, other, fill_where)
                if result is not None:
                    return result
            if not _negative_zero(fill):
                # The fill as a scalar Where broadcasts, first: it holds no -0.0 for Where to lose, and the
                # other operand's -0.0 comes through. (A broadcast condition, constant along rows, is
                # cheap for Where's branches.)
                return op.Where(_condition(condition) if fill_where else _negation(condition),
                                _scalar(fill, other.dtype), other)
    if not _may_hold_negative_zero(x):
        return op.Where(_condition(condition), x, y)
    if not _may_hold_negative_zero(y):
        return op.Where(_negation(condition), y, x)
    # Each operand where the other is selected is -inf (taken from Where's first operand: not a zero), which
    # Max returns the other operand over exactly, NaN and -inf included.
    lowest = op.CastLike(float("-inf"), x)
    return op.Max(op.Where(_negation(condition), lowest, x), op.Where(_condition(condition), lowest, y))


def _scalar(value, dtype: ir.DataType):
    # In the tensor's dtype from the start: a Python float through CastLike is made a float32 constant first.
    if isinstance(value, ir.Value):  # a symbolic scalar
        return op.Cast(value, to=dtype)
    return op.Constant(value=ir.tensor(np.array(value, dtype=dtype.numpy())))


def _scalar_like(value, like):
    return _scalar(value, like.dtype)


@project_rule(aten.where.self)
def aten_where(condition, self, other):
    """where.self(Tensor condition, Tensor self, Tensor other) -> Tensor"""
    return select(condition, self, other)


@project_rule(aten.masked_fill.Scalar)
def aten_masked_fill(self, mask, value):
    """masked_fill.Scalar(Tensor self, Tensor mask, Scalar value) -> Tensor"""
    # The value in self's dtype: torch_lib's float32 constant cast to float64 made 0.1 0.10000000149011612 and
    # 1e-310 0.
    return select(mask, _scalar_like(value, self), self)


@project_rule(aten.masked_fill.Tensor)
def aten_masked_fill_tensor(self, mask, value):
    """masked_fill.Tensor(Tensor self, Tensor mask, Tensor value) -> Tensor"""
    return select(mask, op.CastLike(value, self), self)


def _extremum(extremum, loser: float, self, other, dtype: ir.DataType):
    # ATen's maximum (minimum) is NaN where either operand is, else the larger (smaller) one, and on a tie
    # (0.0 and -0.0) self in its scalar loop, other in its vector loop: eager's answer for a tie of zeros
    # depends on the element's place too. Here it is always self, as in ATen's scalar code. Where the two
    # are equal, other becomes -inf (inf), which extremum passes over for self.
    if dtype == ir.DataType.BOOL:
        return _of_bools(extremum)(self, op.Cast(other, to=ir.DataType.BOOL))
    if dtype not in _FLOATS:
        return extremum(self, other)
    return extremum(self, op.Where(op.Equal(self, other), op.CastLike(loser, other), other))


@project_rule(aten.add.Tensor)
def aten_add(self, other, alpha=1):
    """add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor"""
    if self.dtype == ir.DataType.BOOL and other.dtype == ir.DataType.BOOL and alpha:
        return op.Or(self, other)  # as ATen's bool add; ONNX Runtime's Add refuses bools
    return torchlib_core.aten_add(self, other, alpha)


@project_rule(aten.maximum.default)
def aten_maximum(self, other):
    """maximum(Tensor self, Tensor other) -> Tensor"""
    if self.dtype == ir.DataType.BOOL:
        return op.Or(self, other)
    return _extremum(op.Max, float("-inf"), self, other, self.dtype)


@project_rule(aten.minimum.default)
def aten_minimum(self, other):
    """minimum(Tensor self, Tensor other) -> Tensor"""
    if self.dtype == ir.DataType.BOOL:
        return op.And(self, other)
    return _extremum(op.Min, float("inf"), self, other, self.dtype)


def _clamp(self, low, high):
    if any(isinstance(bound, float) and math.isnan(bound) for bound in (low, high)):
        # Every element is NaN in ATen; ONNX Runtime's float32 Clip ignores a NaN bound.
        return op.Expand(op.CastLike(float("nan"), self), op.Shape(self))
    dtype = self.dtype
    if dtype not in _FLOATS:
        if low is not None:
            self = _extremum(op.Max, None, self, op.CastLike(low, self), dtype)
        if high is not None:
            self = _extremum(op.Min, None, self, op.CastLike(high, self), dtype)
        return self
    if isinstance(low, float) and _negative_zero(low):
        # ONNX Runtime's ReluClipFusion drops a Relu before a Clip whose min is >= 0, and -0.0 is: relu(-1)
        # then clamp(min=-0.0) gave -0.0 (eager relu(-1) is 0.0, and clamp keeps it). Max is not fused.
        self = _extremum(op.Max, float("-inf"), self, _scalar(low, dtype), dtype)
        if high is None:
            return self
        low = None
    # ONNX Runtime's Clip stands in the dtype's largest finite value for a missing bound (clamp(min=0) of
    # inf gave 3.4e38); with that bound infinite it is exact: x on a tie (clamp(-0.0, min=0.0) is -0.0, as in
    # ATen), NaN for NaN.
    low = float("-inf") if low is None else low
    high = float("inf") if high is None else high
    return op.Clip(self, _scalar(low, dtype), _scalar(high, dtype))


@project_rule(aten.clamp.default)
def aten_clamp(self, min=None, max=None):
    """clamp(Tensor self, Scalar? min=None, Scalar? max=None) -> Tensor"""
    return _clamp(self, min, max)


@project_rule(aten.clamp.Tensor)
def aten_clamp_tensor(self, min=None, max=None):
    """clamp.Tensor(Tensor self, Tensor? min=None, Tensor? max=None) -> Tensor"""
    # Also clamp with a Python bound in a float64 graph: the exporter's type promotion makes the bound a
    # float64 scalar_tensor. NaN in a bound is NaN, as in ATen (Max and Min propagate it).
    dtype = self.dtype  # (the values a rule makes have no dtype yet)
    if min is not None:
        self = _extremum(op.Max, float("-inf"), self, min, dtype)
    if max is not None:
        self = _extremum(op.Min, float("inf"), self, max, dtype)
    return self


@project_rule(aten.clamp_min.default)
def aten_clamp_min(self, min):
    """clamp_min(Tensor self, Scalar min) -> Tensor"""
    return _clamp(self, min, None)


@project_rule(aten.clamp_min.Tensor)
def aten_clamp_min_tensor(self, min):
    """clamp_min.Tensor(Tensor self, Tensor min) -> Tensor"""
    return _extremum(op.Max, float("-inf"), self, min, self.dtype)


@project_rule(aten.clamp_max.default)
def aten_clamp_max(self, max):
    """clamp_max(Tensor self, Scalar max) -> Tensor"""
    return _clamp(self, None, max)


@project_rule(aten.clamp_max.Tensor)
def aten_clamp_max_tensor(self, max):
    """clamp_max.Tensor(Tensor self, Tensor max) -> Tensor"""
    return _extremum(op.Min, float("inf"), self, max, self.dtype)


@project_rule(aten.hardtanh.default)
def aten_hardtanh(self, min_val=-1, max_val=1):
    """hardtanh(Tensor self, Scalar min_val=-1, Scalar max_val=1) -> Tensor"""
    # torch_lib's Clip takes the bounds as float32 constants: float64 hardtanh(x, 0.1, 0.3) clipped at
    # 0.10000000149011612.
    return _clamp(self, min_val, max_val)


@project_rule(aten.hardtanh_backward.default)
def aten_hardtanh_backward(grad_output, self, min_val, max_val):
    """hardtanh_backward(Tensor grad_output, Tensor self, Scalar min_val, Scalar max_val) -> Tensor"""
    # ATen passes the gradient only strictly inside (min_val, max_val) (and at NaN): zero at the bounds,
    # where relu6's input is 0. torch_lib's rule passes it at the bounds and multiplies by a 0/1 mask, which
    # makes an infinite gradient NaN where it should be 0 (and a float32 mask fails float64). The bounds are
    # made in self's dtype (CastLike of a float64 bound rounded it through float32).
    clipped = op.Or(op.LessOrEqual(self, _scalar_like(min_val, self)),
                    op.GreaterOrEqual(self, _scalar_like(max_val, self)))
    return select(clipped, _scalar_like(0, grad_output), grad_output)


def _hardswish(self):
    # As ATen computes it, x * min(max(x + 3, 0), 6) / 6 (Clip passes NaN, and keeps its bounds' +0.0). ONNX
    # Runtime's HardSwish, x * clip(x / 6 + 1/2), loses the digits of x + 3 near -3: 2% relative off at
    # -2.9999969 (-1.520e-6 for eager's -1.550e-6), 1.9e-7 |x| at most elsewhere. Two passes more.
    three, six = op.CastLike(3.0, self), op.CastLike(6.0, self)
    return op.Div(op.Mul(self, op.Clip(op.Add(self, three), op.CastLike(0.0, self), six)), six)


@project_rule(aten.hardswish.default)
def aten_hardswish(self):
    """hardswish(Tensor self) -> Tensor"""
    return _opmath(_hardswish, self)


def _hardswish_backward(grad_output, self):
    # ATen (torch 2.13, its decomposition too): 0 up to -3, grad * (x / 3 + 1/2) below 3, grad from 3 on and,
    # in its scalar loop, at NaN (its vector loop makes NaN there; this follows the scalar loop). PyTorch's
    # decomposition is two selections between tensors, which cost ONNX Runtime ~15 passes with the
    # zero-sign guards (MobileNet's backward). Here the slope is selected first: grad * 1 is grad, a NaN and
    # a -0.0 included, and x / 3 + 1/2 is never -0.0 (-1/2 + 1/2 is +0.0), so Where loses no zero's sign;
    # the +0.0 up to -3 is Where's first operand, the product (which may be -0.0) its second, which Where
    # passes as it is. Both conditions go the same way for most elements of a normalized input, where ONNX
    # Runtime's Where is about as fast as an Add. 7 passes. (The constants are exact in float32, so
    # CastLike keeps them.)
    slope = op.Where(op.Less(self, op.CastLike(3.0, self)),
                     op.Add(op.Div(self, op.CastLike(3.0, self)), op.CastLike(0.5, self)), op.CastLike(1.0, self))
    return op.Where(op.LessOrEqual(self, op.CastLike(-3.0, self)), op.CastLike(0.0, self),
                    op.Mul(grad_output, slope))


@project_rule(aten.hardswish_backward.default)
def aten_hardswish_backward(grad_output, self):
    """hardswish_backward(Tensor grad_output, Tensor self) -> Tensor"""
    return _opmath(_hardswish_backward, grad_output, self)


# ---------------------------------------------------------------------------------------------------------
# sigmoid and the ops built on it, computed as ATen's CPU kernels compute them (1 / (1 + exp(-x)), in the
# input's dtype; float32 for 16-bit floats). ONNX Runtime's Sigmoid (MLAS's rational approximation) is
# accurate in absolute terms only: float32 sigmoid(-17) was 8.9e-8 (eager 4.1e-8) and 0 below -18.5, float64
# 0 below -36.7 and hundreds of ULPs off at -7. ONNX Runtime's Exp is within an ULP of eager's, and the
# addition and the division round once each, so the tail keeps its relative accuracy down to where exp(-x)
# overflows, as eager's does.

_HALVES = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _one_plus_exp_neg(x):
    return op.Add(op.CastLike(1.0, x), op.Exp(op.Neg(x)))


def _sigmoid(x):
    return op.Div(op.CastLike(1.0, x), _one_plus_exp_neg(x))


@project_rule(aten.sigmoid.default)
def aten_sigmoid(self):
    """sigmoid(Tensor self) -> Tensor"""
    return _opmath(_sigmoid, self)


@project_rule(aten.silu.default)
def aten_silu(self):
    """silu(Tensor self) -> Tensor"""
    # x / (1 + exp(-x)), one division as in ATen's kernel (x * sigmoid(x) rounds twice).
    return _opmath(lambda x: op.Div(x, _one_plus_exp_neg(x)), self)


@project_rule(aten.glu.default)
def aten_glu(self, dim: int = -1):
    """glu(Tensor self, int dim=-1) -> Tensor"""
    def glu(x):
        a, b = op.Split(x, axis=dim, num_outputs=2)
        return op.Mul(a, _sigmoid(b))

    return _opmath(glu, self)


@project_rule(aten.sigmoid_backward.default)
def aten_sigmoid_backward(grad_output, output):
    """sigmoid_backward(Tensor grad_output, Tensor output) -> Tensor"""
    # g * (1 - y) * y, in ATen's order (the decomposition's g * (y * (1 - y)) rounds differently). ATen's
    # float16 kernel rounds after every operation (its vector arithmetic in float16; bfloat16 has a float32
    # path): computed once in float32, 30% of float16 gradients were off.
    if output.dtype == ir.DataType.FLOAT16:
        g, y = cast(grad_output, ir.DataType.FLOAT), cast(output, ir.DataType.FLOAT)
        complement = rounded_to(op.Sub(op.Constant(value_float=1.0), y), output.dtype)
        return op.Cast(op.Mul(rounded_to(op.Mul(g, complement), output.dtype), y), to=output.dtype)
    return _opmath(lambda g, y: op.Mul(op.Mul(g, op.Sub(op.CastLike(1.0, y), y)), y), grad_output, output)


def _log1p(x):
    # log(1 + x) loses the digits of x below 1's last place (float32 log1p(1e-8) was 0, log1p(2e-6) 1.3%
    # off). With u = 1 + x rounded, log(u) * (x / (u - 1)) is within a few ULPs of log1p(x) (Goldberg,
    # "What every computer scientist should know about floating-point arithmetic", theorem 4): u - 1 is
    # exact, and x / (u - 1) scales log(u) back for the rounding of u. That fails where u is 1 (then
    # log1p(x) is x: x^2 / 2 is below its last place) and where u is +inf (inf / inf; log1p(inf) is inf).
    one = op.CastLike(1.0, x)
    u = op.Add(one, x)
    scaled = op.Mul(op.Log(u), op.Div(x, op.Sub(u, one)))
    # u == 1 and u == +inf never hold together, so "neither" is their Equal. x goes to Where's second
    # operand, the one that keeps -0.0 (see select); the first, scaled, is never zero.
    neither = op.Equal(op.Equal(u, one), op.IsInf(u, detect_negative=0))
    return op.Where(neither, scaled, x)


@project_rule(aten.log1p.default)
def aten_log1p(self):
    """log1p(Tensor self) -> Tensor"""
    return _opmath(_log1p, self)


def _expm1(x):
    # exp(x) - 1 loses x's digits near 0, as 1 + x does in log1p (float32 expm1(1e-6) was 9.54e-7, 5% off, and
    # expm1(-1e-8) 0; elu, celu and selu near 0 with them). With u = exp(x) rounded, (u - 1) * x / log(u) is
    # within a few ULPs of expm1(x) (Kahan's trick: u - 1 is exact, x / log(u) scales it back for the
    # rounding of u). That fails where u is 1 (then expm1(x) is x, as ATen gives for tiny x and -0.0), where u
    # - 1 is -1 (x below about -17 in float32: expm1 is -1; -inf: u is 0), and where u is +inf (inf * x /
    # inf; expm1 is +inf there, and NaN stays NaN through the product).
    one = op.CastLike(1.0, x)
    u = op.Exp(x)
    u_minus_1 = op.Sub(u, one)
    scaled = op.Mul(u_minus_1, op.Div(x, op.Log(u)))  # x / log(u) first: (u - 1) * x overflows near exp's limit
    # x goes to Where's second operand, the one that keeps -0.0 (see select); scaled is never zero. (u != 1
    # as |u - 1| > 0: ONNX Runtime turns Where(Not(c), a, b) into Where(c, b, a), which loses x's -0.0.)
    kept = op.Where(op.Greater(op.Abs(u_minus_1), op.CastLike(0.0, x)), scaled, x)
    saturated = op.Or(op.Equal(u_minus_1, op.Neg(one)), op.IsInf(u, detect_negative=0))
    return op.Where(saturated, u_minus_1, kept)


@project_rule(aten.expm1.default)
def aten_expm1(self):
    """expm1(Tensor self) -> Tensor"""
    return _opmath(_expm1, self)


def _opmath_scalar(value: float, dtype: ir.DataType) -> np.ndarray:
    """A scalar as ATen's CPU kernels hold it: float32 for float32 and 16-bit floats, float64 for float64."""
    return np.array(value, dtype=np.float64 if dtype == ir.DataType.DOUBLE else np.float32)


@project_rule(aten.elu.default)
def aten_elu(self, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0):
    """elu(Tensor self, Scalar alpha=1, Scalar scale=1, Scalar input_scale=1) -> Tensor"""
    if self.dtype not in _FLOATS:
        return torchlib_nn.aten_elu(self, alpha, scale, input_scale)
    # ATen (Activation.cpp): x <= 0 ? expm1(x * input_scale) * (alpha * scale) : x * scale, its coefficients
    # multiplied in the op's compute type. ONNX Runtime's Elu is alpha * (exp(x) - 1): 0.14% off at -1e-5 in
    # float32, and its alpha an attribute, float32 in a float64 graph.
    negative_coefficient = _opmath_scalar(alpha, self.dtype) * _opmath_scalar(scale, self.dtype)

    def elu(x):
        negative = op.Mul(_expm1(op.Mul(x, _scalar_like(_opmath_scalar(input_scale, x.dtype), x))),
                          _scalar_like(negative_coefficient, x))
        # x > 0 rather than ATen's x <= 0 (the same for NaN: expm1 keeps it), so that the negative side, -0.0
        # for -0.0, is Where's second operand, the one that keeps -0.0 (see select).
        return op.Where(op.Greater(x, _scalar_like(0.0, x)), op.Mul(x, _scalar_like(_opmath_scalar(scale, x.dtype), x)),
                        negative)

    return _opmath(elu, self)


@project_rule(aten.celu.default)
def aten_celu(self, alpha: float = 1.0):
    """celu(Tensor self, Scalar alpha=1.0) -> Tensor"""
    # ATen's celu is elu(x, alpha, 1, 1 / alpha), 1 / alpha in double. (torch_lib computed it in float32, a
    # float64 input included, with exp(x) - 1.)
    return aten_elu(self, alpha, 1.0, 1.0 / alpha)


# ONNX Runtime's float64 Softplus and Mish are log(1 + exp(x)): softplus(-50) was 0 (eager 1.9e-22) and
# softplus(-20) 3e-8 relatively off. ATen computes log1p(exp(x)) in double. Its float32 kernels are MLAS's
# and match eager within a few ULPs, so float32 and 16-bit floats keep torch_lib's.


@project_rule(aten.softplus.default)
def aten_softplus(self, beta: float = 1.0, threshold: float = 20.0):
    """softplus(Tensor self, Scalar beta=1, Scalar threshold=20) -> Tensor"""
    if self.dtype in _HALVES:
        return _opmath(lambda x: torchlib_nn.aten_softplus(x, beta, threshold), self)
    if self.dtype != ir.DataType.DOUBLE:
        return torchlib_nn.aten_softplus(self, beta, threshold)
    # ATen: x * beta > threshold ? x : log1p(exp(x * beta)) / beta. The x side is Where's first operand: it is
    # above threshold / beta there, never -0.0 (Where's first operand loses it; see select).
    beta_ = _scalar_like(beta, self)
    scaled = op.Mul(self, beta_)
    return op.Where(op.Greater(scaled, _scalar_like(threshold, self)), self, op.Div(_log1p(op.Exp(scaled)), beta_))


@project_rule(aten.mish.default)
def aten_mish(self):
    """mish(Tensor self) -> Tensor"""
    if self.dtype != ir.DataType.DOUBLE:
        return torchlib_nn.aten_mish(self)
    return op.Mul(self, op.Tanh(_log1p(op.Exp(self))))  # ATen: x * tanh(log1p(exp(x)))


@project_rule(aten.tanh.default)
def aten_tanh(self):
    """tanh(Tensor self) -> Tensor"""
    if self.dtype != ir.DataType.FLOAT:
        return op.Tanh(self)
    # ONNX Runtime's float32 Tanh (MLAS's rational approximation) is up to 104 ULPs off below |x| = 7.5e-37
    # (tanh(1e-40) was 9.99392e-41) and 1-2 ULPs off for other small x. Below 2^-12, tanh(x) rounds to x
    # (x^3 / 3 is under half of x's last place; eager returns x up to 3.5e-4). x goes to Where's second
    # operand, which keeps -0.0 (see select); Tanh of the rest is never zero.
    large = op.GreaterOrEqual(op.Abs(self), op.CastLike(2.0**-12, self))
    return op.Where(large, op.Tanh(self), self)


def _reciprocal(x):
    return op.Div(op.CastLike(1.0, x), x)


# ATen's CPU pow with a float32 or float64 tensor and these scalar exponents does not call pow
# (Pow.cpp, PowKernel.cpp): 1 is a copy (the gradient of x ** 2 is 2 * x ** 1; ONNX Runtime's Pow took 0.76
# ms on 16 x 32 x 16 x 16, 6 ns per element), 0.5 is sqrt, -0.5 is 1 / sqrt, -1 is 1 / x, 2 is x * x, 3 is x * x * x, -2 is 1 / (x * x).
# Their signed zeros, infinities and NaNs differ from IEEE pow (pow(-inf, 0.5) is inf, sqrt(-inf) NaN;
# pow(-0.0, -0.5) is +inf, 1 / sqrt(-0.0) -inf), and so do overflowing squares (1 / (x * x) of 1e20 is 0,
# pow(1e20, -2) 1e-40).
_POW_AS_ATEN = {
    1.0: op.Identity,
    0.5: op.Sqrt,
    -0.5: lambda x: _reciprocal(op.Sqrt(x)),
    -1.0: _reciprocal,
    2.0: lambda x: op.Mul(x, x),
    3.0: lambda x: op.Mul(op.Mul(x, x), x),
    -2.0: lambda x: _reciprocal(op.Mul(x, x)),
}


@project_rule(aten.pow.Tensor_Scalar)
def aten_pow_tensor_scalar(self, exponent):
    """pow.Tensor_Scalar(Tensor self, Scalar exponent) -> Tensor"""
    if self.dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE) and not isinstance(exponent, bool):
        kernel = _POW_AS_ATEN.get(exponent)
        if kernel is not None:
            return kernel(self)
    if self.dtype in _HALVES and not isinstance(exponent, bool) and exponent in _POW_AS_ATEN:
        # ATen's 16-bit kernels for these exponents: float16 computes in float32 and rounds once; bfloat16's
        # vectorized loop rounds after every operation (x * x * x is rounded twice). Through ONNX Runtime's Pow
        # in float32, 22% of bfloat16 cubes (the gradient of rsqrt reads one) were off eager's.
        if self.dtype == ir.DataType.BFLOAT16 and exponent in (3.0, -2.0):
            x = cast(self, ir.DataType.FLOAT)
            square = rounded_to(op.Mul(x, x), self.dtype)
            return op.Cast(op.Mul(square, x) if exponent == 3.0 else _reciprocal(square), to=self.dtype)
        return _opmath(_POW_AS_ATEN[exponent], self)
    if self.dtype in INTEGERS and isinstance(exponent, int) and not isinstance(exponent, bool):
        # ATen casts the exponent to the tensor's dtype (wrapping), then squares and multiplies.
        exponent = int(np.array(exponent).astype(self.dtype.numpy()))
        return _integer_power(self, op.Constant(value=ir.tensor(np.array(exponent, dtype=self.dtype.numpy()))),
                              self.dtype, max_exponent=exponent)
    return torchlib_core.aten_pow_tensor_scalar(self, exponent)


@project_rule(aten.pow.Tensor_Tensor)
def aten_pow_tensor_tensor(self, exponent):
    """pow.Tensor_Tensor(Tensor self, Tensor exponent) -> Tensor"""
    if self.dtype in INTEGERS and exponent.dtype == self.dtype:
        return _integer_power(self, exponent, self.dtype)
    return torchlib_core.aten_pow(self, exponent)


@project_rule(aten.pow.Scalar)
def aten_pow_scalar(self, exponent):
    """pow.Scalar(Scalar self, Tensor exponent) -> Tensor"""
    if exponent.dtype in INTEGERS and isinstance(self, int) and not isinstance(self, bool):
        base = op.Constant(value=ir.tensor(np.array(self).astype(exponent.dtype.numpy())))
        return _integer_power(base, exponent, exponent.dtype)
    return torchlib_core.aten_pow_scalar(self, exponent)




def _integer_power(base: ir.Value, exponent: ir.Value, dtype: ir.DataType, max_exponent: int | None = None):
    """ATen's integer pow (``powi``): base ** exponent by squaring and multiplying, wrapping around as C++'s
    integer products do; a negative exponent gives 1 for a base of 1, 1 or -1 for -1, 0 otherwise. ONNX
    Runtime's Pow goes through double: 3 ** 39 came out 4052555153018976256 for 4052555153018976267, and
    overflowing powers as INT64_MIN instead of eager's wrapped values.

    The products are int64 (wrapping modulo 2^64, which a narrower dtype's wrap divides), cast back at the
    end. The squarings run once per bit of the largest exponent: unrolled for a known exponent, else in a
    Loop. A known exponent needs no broadcast."""
    int64 = ir.DataType.INT64
    a, b = op.Cast(base, to=int64), op.Cast(exponent, to=int64)
    one, two = op.Constant(value_int=1), op.Constant(value_int=2)
    if max_exponent is None or max_exponent < 0:  # both to the result's shape
        a, b = op.Add(a, op.Mul(b, op.Constant(value_int=0))), op.Add(b, op.Mul(a, op.Constant(value_int=0)))

    def square_and_multiply(result, a, b):
        odd = op.Equal(op.Mod(b, two), one)
        return op.Where(odd, op.Mul(result, a), result), op.Mul(a, a), op.Div(b, two)

    if max_exponent is not None and max_exponent >= 0:
        result, power = None, a
        for k in range(max_exponent.bit_length()):
            if max_exponent >> k & 1:
                result = power if result is None else op.Mul(result, power)
            if k + 1 < max_exponent.bit_length():
                power = op.Mul(power, power)
        return op.Cast(op.Expand(one, op.Shape(a)) if result is None else result, to=dtype)
    result, positive = op.Expand(one, op.Shape(a)), op.Max(b, op.Constant(value_int=0))
    largest = op.ReduceMax(op.Concat(op.Reshape(positive, op.Constant(value_ints=[-1])), op.Constant(value_ints=[0]),
                                     axis=0), keepdims=0)
    powers = op.Constant(value=ir.tensor(np.array([1 << k for k in range(63)], dtype=np.int64)))
    bits = op.ReduceSum(op.Cast(op.GreaterOrEqual(largest, powers), to=int64), keepdims=0)
    for v in (result, a, positive):
        v.dtype = int64
    result, _, _ = loop(bits, [result, a, positive], square_and_multiply)
    if dtype != ir.DataType.UINT8:
        parity = op.Mod(op.Neg(b), two)
        of_negative = op.Where(op.Equal(a, one), one, op.Where(op.Equal(a, op.Constant(value_int=-1)),
                                                                 op.Where(op.Equal(parity, one), op.Constant(value_int=-1), one),
                                                                 op.Constant(value_int=0)))
        result = op.Where(op.Less(b, op.Constant(value_int=0)), of_negative, result)
    return op.Cast(result, to=dtype)


@project_rule(prims.hypot.default)
def prims_hypot(self, other):
    """hypot(Tensor self, Tensor other) -> Tensor"""
    # Scaled as std::hypot is, so that squares of large values do not overflow.
    a, b = op.Abs(self), op.Abs(other)
    big, small = op.Max(a, b), op.Min(a, b)
    zero = op.CastLike(0.0, big)
    ratio = op.Div(small, op.Where(op.Equal(big, zero), op.CastLike(1.0, big), big))
    result = op.Mul(big, op.Sqrt(op.Add(op.CastLike(1.0, big), op.Mul(ratio, ratio))))
    inf = op.CastLike(float("inf"), big)
    # hypot(inf, nan) is inf.
    return op.Where(op.Or(op.IsInf(a), op.IsInf(b)), inf, result)


def _negative_sign(x):
    """Whether ``x``'s sign bit is set, -0.0 included (1 / -0.0 is -inf; False for NaN)."""
    zero = _scalar_like(0.0, x)
    return op.Or(op.Less(x, zero), op.Less(op.Div(_scalar_like(1.0, x), x), zero))


@project_rule(aten.signbit.default)
@project_rule(prims.signbit.default)
def prims_signbit(self):
    """signbit(Tensor self) -> Tensor"""
    # (torch_lib's aten.signbit is x < 0, False for -0.0.)
    if self.dtype == ir.DataType.BOOL:
        return op.Expand(op.Constant(value=ir.tensor(False)), op.Shape(self))
    if self.dtype not in _FLOATS:
        return op.Less(self, op.CastLike(0, self))
    # (A NaN's sign bit is not visible without a bit cast.)
    return _negative_sign(self)


def _atan2(y, x):
    # C's atan2 (ATen's kernels: Sleef's and std::atan2): the first quadrant's angle of (|x|, |y|), reflected
    # to pi - angle where x's sign bit is set (-0.0 included) and given y's sign, a zero's included:
    # atan2(+0, -1) = pi, atan2(-0, -1) = -pi, atan2(0, -0) = pi, atan2(-0, +0) = -0, atan2(+-inf, +-inf) =
    # +-pi/4 or +-3pi/4, NaN where either is NaN. torch_lib's is atan(y / x) plus or minus pi by y > 0 (-pi at
    # y = +0, x < 0), with every NaN replaced by 0 (atan2(nan, 1) was 0, atan2(inf, inf) 0).
    ay, ax = op.Abs(y), op.Abs(x)
    zero = _scalar_like(0.0, y)
    angle = op.Atan(op.Div(ay, ax))
    angle = op.Where(op.And(op.IsInf(ay), op.IsInf(ax)), _scalar_like(math.pi / 4, y), angle)
    angle = op.Where(op.And(op.Equal(ay, zero), op.Equal(ax, zero)), zero, angle)
    # pi - angle is never -0.0 (angle <= pi/2), so Where keeps every zero's sign.
    angle = op.Where(_negative_sign(x), op.Sub(_scalar_like(math.pi, y), angle), angle)
    # The sign as a product, so that a zero angle becomes -0.0 (Where's first operand would lose it).
    return op.Mul(angle, _sign_of(y))


@project_rule(aten.atan2.default)
def aten_atan2(self, other):
    """atan2(Tensor self, Tensor other) -> Tensor"""
    return _opmath(_atan2, _as_float(self), _as_float(other))


@project_rule(aten.angle.default)
def aten_angle(self):
    """angle(Tensor self) -> Tensor"""
    # ATen for real inputs: pi below 0, 0 from -0.0 up, NaN at NaN (torch_lib's gave 0 there); integers and
    # bools give the default float dtype.
    if self.dtype not in _FLOATS:
        self = op.Cast(self, to=ir.DataType.FLOAT)
        self.dtype = ir.DataType.FLOAT
    return _opmath(lambda x: op.Where(op.IsNaN(x), x, op.Where(op.Less(x, _scalar_like(0.0, x)),
                                                                _scalar_like(math.pi, x), _scalar_like(0.0, x))),
                   self)


@project_rule(aten.angle.default, is_complex=True)
def aten_angle_complex(self):
    """angle(Tensor self) -> Tensor (complex input: [..., 2], real and imaginary parts)"""
    real = op.Squeeze(op.Slice(self, [0], [1], axes=[-1]), axes=[-1])
    imag = op.Squeeze(op.Slice(self, [1], [2], axes=[-1]), axes=[-1])
    return _atan2(imag, real)


def _integer_identity(self, float_rule):
    # Rounding an integer (or bool) is a copy in ATen; ONNX's Ceil, Floor and Round refuse integers.
    return op.Identity(self) if self.dtype not in _FLOATS else float_rule(self)


@project_rule(aten.ceil.default)
def aten_ceil(self):
    """ceil(Tensor self) -> Tensor"""
    return _integer_identity(self, torchlib_core.aten_ceil)


@project_rule(aten.floor.default)
def aten_floor(self):
    """floor(Tensor self) -> Tensor"""
    return _integer_identity(self, torchlib_core.aten_floor)


@project_rule(aten.round.default)
def aten_round(self):
    """round(Tensor self) -> Tensor"""
    return _integer_identity(self, torchlib_core.aten_round)


@project_rule(aten.isnan.default)
def aten_isnan(self):
    """isnan(Tensor self) -> Tensor"""
    # No integer is NaN (ONNX's IsNaN refuses integers: nansum of an int64 tensor failed to load).
    if self.dtype in _FLOATS:
        return op.IsNaN(self)
    return op.Expand(op.Constant(value=ir.tensor(False)), op.Shape(self))


def _infinite(self, negative: bool = True, positive: bool = True):
    """IsInf of the value itself. torch_lib casts to float32 first, where a float64 number beyond float32's
    range overflows: isinf(1e300) was True, isneginf(-1e300) too. 16-bit values widen to float32 exactly
    (ONNX Runtime's IsInf takes float and double at opset 18); no integer is infinite."""
    if self.dtype not in _FLOATS:
        return op.Expand(op.Constant(value=ir.tensor(False)), op.Shape(self))
    x = self if self.dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE) else op.Cast(self, to=ir.DataType.FLOAT)
    return op.IsInf(x, detect_negative=int(negative), detect_positive=int(positive))


@project_rule(aten.isinf.default)
def aten_isinf(self):
    """isinf(Tensor self) -> Tensor"""
    return _infinite(self)


@project_rule(aten.isneginf.default)
def aten_isneginf(self):
    """isneginf(Tensor self) -> Tensor"""
    return _infinite(self, positive=False)


@project_rule(aten.isposinf.default)
def aten_isposinf(self):
    """isposinf(Tensor self) -> Tensor"""
    return _infinite(self, negative=False)


@project_rule(aten.isfinite.default)
def aten_isfinite(self):
    """isfinite(Tensor self) -> Tensor"""
    if self.dtype in _FLOATS:
        return torchlib_core.aten_isfinite(self)
    return op.Expand(op.Constant(value=ir.tensor(True)), op.Shape(self))


def _sign_of(x):
    """+1 or -1 by ``x``'s sign bit (-0.0 gives -1): a zero times it keeps the sign (Where would not)."""
    return op.Where(_negative_sign(x), _scalar_like(-1.0, x), _scalar_like(1.0, x))


def _trunc(x):
    # torch_lib's is floor(|x|) * sign(x), and ONNX's Sign of -0.0 is 0: trunc(-0.0) was +0.0.
    return op.Mul(op.Floor(op.Abs(x)), _sign_of(x))


@project_rule(aten.trunc.default)
def aten_trunc(self):
    """trunc(Tensor self) -> Tensor"""
    if self.dtype not in _FLOATS:
        return op.Identity(self)
    return _trunc(self)


def _div_floor(a, b):
    # ATen's div_floor_floating (c10/util/generic_math.h), which its vector loop follows too: the quotient
    # of a - fmod(a, b), so that 1 // 0.1 is 9 as in Python (floor(1 / 0.1) is 10: the quotient rounds up
    # to 10), NaN where fmod is (inf // 1), a / b for b == 0, a zero with the sign of a / b.
    zero, one = _scalar_like(0.0, a), _scalar_like(1.0, a)
    mod = op.Mod(a, b, fmod=1)
    div = op.Div(op.Sub(a, mod), b)
    wrong_side = op.And(op.Not(op.Equal(mod, zero)), op.Xor(op.Less(b, zero), op.Less(mod, zero)))
    div = op.Where(wrong_side, op.Sub(div, one), div)  # div - 1 is never -0.0
    floor = op.Floor(div)
    floor = op.Where(op.Greater(op.Sub(div, floor), _scalar_like(0.5, a)), op.Add(floor, one), floor)
    quotient = op.Div(a, b)
    # The zero takes a / b's sign as a product: Where would lose a -0.0 in its first operand, and ONNX
    # Runtime's optimizer swaps Where(Not(c), x, y) into Where(c, y, x).
    is_zero = op.Equal(div, zero)
    result = op.Mul(op.Where(is_zero, zero, floor), op.Where(is_zero, _sign_of(quotient), one))
    return op.Where(op.Equal(b, zero), quotient, result)  # a / 0 is never a zero


def _remainder(a, b):
    # ATen: fmod(a, b), plus b where it is nonzero and its sign is not b's. |mod| < |b|, so mod + b is never
    # a zero (Where's first operand); a -0.0 mod is passed as it is. torch_lib's a - floor(a / b) * b gave
    # NaN for a finite a and an infinite b, and +0.0 for -0.0 % 1.
    zero = _scalar_like(0.0, a)
    mod = op.Mod(a, b, fmod=1)
    wrong_side = op.And(op.Not(op.Equal(mod, zero)), op.Xor(op.Less(b, zero), op.Less(mod, zero)))
    return op.Where(wrong_side, op.Add(mod, b), mod)


def _promoted_float(*dtypes: ir.DataType) -> ir.DataType:
    floats = [d for d in dtypes if d in _FLOATS]
    if ir.DataType.DOUBLE in floats:
        return ir.DataType.DOUBLE
    return floats[0] if len(set(floats)) == 1 else ir.DataType.FLOAT


@project_rule(aten.div.Tensor_mode)
def aten_div_tensor_mode(self, other, rounding_mode: str | None = None):
    """div.Tensor_mode(Tensor self, Tensor other, *, str? rounding_mode) -> Tensor

    Integers are divided as integers, as ATen does: torch_lib's rule divided them in float32, so that
    ``torch.div(2**25 + 1, 1, rounding_mode="floor")`` was 2**25 and a zero divisor gave -2**63 (eager raises;
    ONNX Runtime's integer Div fails the run, which aot2onnx raises).
    """
    if isinstance(other, (int, float)):  # a Python number, as Dynamo passes a literal divisor
        return aten_div_scalar_mode(self, other, rounding_mode=rounding_mode)
    if rounding_mode is None:
        return torchlib_core.aten_div_mode(self, other, rounding_mode=rounding_mode)
    if self.dtype not in _FLOATS and other.dtype not in _FLOATS:
        if rounding_mode == "trunc":
            return op.Div(self, other)  # ONNX's integer Div truncates toward zero, as C's
        return torchlib_core.aten_floor_divide(self, other)  # integer Div, minus 1 where the signs differ
    dtype = _promoted_float(self.dtype, other.dtype)
    self, other = (v if v.dtype == dtype else op.Cast(v, to=dtype) for v in (self, other))
    if rounding_mode == "trunc":  # ATen: trunc(a / b)
        return _opmath(lambda a, b: _trunc(op.Div(a, b)), self, other)
    return _opmath(_div_floor, self, other)


@project_rule(aten.floor_divide.default)
def aten_floor_divide(self, other):
    """floor_divide(Tensor self, Tensor other) -> Tensor"""
    if self.dtype not in _FLOATS:
        return torchlib_core.aten_floor_divide(self, other)
    return _opmath(_div_floor, self, other)


@project_rule(aten.remainder.Tensor)
def aten_remainder(self, other):
    """remainder.Tensor(Tensor self, Tensor other) -> Tensor"""
    if self.dtype not in _FLOATS:
        return torchlib_core.aten_remainder(self, other)
    return _opmath(_remainder, self, other)


@project_rule(aten.remainder.Scalar)
def aten_remainder_scalar(self, other):
    """remainder.Scalar(Tensor self, Scalar other) -> Tensor"""
    if self.dtype not in _FLOATS:
        return torchlib_core.aten_remainder_scalar(self, other)
    return _opmath(_remainder, self, _scalar_like(other, self))


@project_rule(aten.div.Scalar_mode)
def aten_div_scalar_mode(self, other, rounding_mode: str | None = None):
    """div.Scalar_mode(Tensor self, Scalar other, *, str? rounding_mode) -> Tensor"""
    if isinstance(other, float) and self.dtype not in _FLOATS:  # an integer tensor by a float: a float result
        self = op.Cast(self, to=ir.DataType.FLOAT)
    divisor = _scalar_like(other if self.dtype in _FLOATS else int(other), self)
    if rounding_mode is None:
        return torchlib_core.aten_div_mode(self, divisor, rounding_mode=None)
    return aten_div_tensor_mode(self, divisor, rounding_mode=rounding_mode)


def _logaddexp(a, b, base_two: bool):
    # ATen: a where both are the same infinity, else max(a, b) + log1p(exp(-|a - b|)) (exp2, and the log1p
    # times 1 / ln 2, for base 2). torch_lib's log(exp(a) + exp(b)) overflowed: logaddexp(0, 100) was inf.
    # A NaN on either side makes |a - b| NaN, and so the result, whichever Max picks.
    d = op.Neg(op.Abs(op.Sub(a, b)))
    if base_two:
        term = op.Mul(_log1p(op.Pow(_scalar_like(2.0, a), d)), _scalar_like(1.0 / math.log(2.0), a))
    else:
        term = _log1p(op.Exp(d))
    result = op.Add(op.Max(a, b), term)
    return op.Where(op.And(op.IsInf(a), op.Equal(a, b)), a, result)  # a is an infinity there, not a zero


@project_rule(aten.logaddexp.default)
def aten_logaddexp(self, other):
    """logaddexp(Tensor self, Tensor other) -> Tensor"""
    return _opmath(lambda a, b: _logaddexp(a, b, base_two=False), self, other)


@project_rule(aten.logaddexp2.default)
def aten_logaddexp2(self, other):
    """logaddexp2(Tensor self, Tensor other) -> Tensor"""
    return _opmath(lambda a, b: _logaddexp(a, b, base_two=True), self, other)


@project_rule(aten.xlogy.Tensor)
def aten_xlogy(self, other):
    """xlogy.Tensor(Tensor self, Tensor other) -> Tensor"""
    # ATen: NaN where y is NaN (x == 0 included; torch_lib's gave 0 there), 0 where x == 0, else x * log(y).
    def xlogy(x, y):
        product = op.Where(op.Equal(x, _scalar_like(0.0, x)), _scalar_like(0.0, x), op.Mul(x, op.Log(y)))
        return op.Where(op.IsNaN(y), _scalar_like(float("nan"), x), product)
    return _opmath(xlogy, _as_float(self), _as_float(other))


@project_rule(aten.copysign.Tensor)
def aten_copysign(self, other):
    """copysign.Tensor(Tensor self, Tensor other) -> Tensor"""
    # |a| with b's sign bit, -0.0's included (copysign(0, -0.0) and copysign(0, -1) were +0.0).
    return _opmath(lambda a, b: op.Mul(op.Abs(a), _sign_of(b)), _as_float(self), _as_float(other))


@project_rule(aten.heaviside.default)
def aten_heaviside(self, values):
    """heaviside(Tensor self, Tensor values) -> Tensor"""
    # ATen: values where self == 0, else self > 0 as 0 or 1: 0 at NaN (torch_lib's gave 1), and a -0.0 of
    # values kept (select, not Where).
    step = op.CastLike(op.Greater(self, op.CastLike(0, self)), self)
    return select(op.Equal(self, op.CastLike(0, self)), op.CastLike(values, self), step)


def _as_float(x):
    """An integer or bool input as float32, the dtype ATen gives these ops' results for it."""
    return x if x.dtype in _FLOATS else op.Cast(x, to=ir.DataType.FLOAT)


# log2, log10, sinc with their constants in the input's dtype: torch_lib's Log(2.0) and x * pi are float32
# constants, so float64 log2(0.5) was -0.9999999972521647 and log10(100) 1.9999999722264887 (1e-8 off).
def _log_in_base(x, base: float):
    return _opmath(lambda v: op.Div(op.Log(v), _scalar_like(math.log(base), v)), _as_float(x))


@project_rule(aten.log2.default)
def aten_log2(self):
    """log2(Tensor self) -> Tensor"""
    return _log_in_base(self, 2.0)


@project_rule(aten.log10.default)
def aten_log10(self):
    """log10(Tensor self) -> Tensor"""
    return _log_in_base(self, 10.0)


@project_rule(aten.sinc.default)
def aten_sinc(self):
    """sinc(Tensor self) -> Tensor"""
    # ATen: 1 at 0, else sin(pi * x) / (pi * x) with pi in x's dtype (float64 sinc(0.5) was 2.8e-8 off).
    def sinc(x):
        product = op.Mul(x, _scalar_like(math.pi, x))
        return op.Where(op.Equal(x, _scalar_like(0.0, x)), _scalar_like(1.0, x), op.Div(op.Sin(product), product))
    return _opmath(sinc, _as_float(self))


def _double(value: float):
    return op.Constant(value=ir.tensor(np.array(value, dtype=np.float64)))


@project_rule(prims.frexp.default)
def prims_frexp(self):
    """frexp(Tensor self) -> (Tensor mantissa, Tensor exponent)"""
    # x = m * 2**e with 0.5 <= |m| < 1. log2 of a float is exact enough to start from; the exponent is then
    # corrected by one where rounding put |m| just outside [0.5, 1). Zero, inf and NaN give (x, 0).
    x = op.Cast(self, to=ir.DataType.DOUBLE)
    a = op.Abs(x)
    finite = op.And(op.Not(op.IsInf(x)), op.Not(op.IsNaN(x)))
    usable = op.And(finite, op.Greater(a, _double(0.0)))
    safe = op.Where(usable, a, _double(1.0))
    two = _double(2.0)
    e = op.Add(op.Floor(op.Div(op.Log(safe), _double(0.6931471805599453))), _double(1.0))
    m = op.Div(safe, op.Pow(two, e))
    too_big = op.GreaterOrEqual(m, _double(1.0))
    e = op.Where(too_big, op.Add(e, _double(1.0)), e)
    too_small = op.Less(op.Div(safe, op.Pow(two, e)), _double(0.5))
    e = op.Where(too_small, op.Sub(e, _double(1.0)), e)
    e = op.Where(usable, e, _double(0.0))
    mantissa = op.Where(usable, op.Div(x, op.Pow(two, e)), x)
    return op.CastLike(mantissa, self), op.Cast(e, to=ir.DataType.INT32)


@project_rule(prims.view_of.default)
def prims_view_of(a):
    """view_of(Tensor(a) a) -> Tensor(a)"""
    return op.Identity(a)


_MANTISSA_BITS = {ir.DataType.FLOAT: 23, ir.DataType.DOUBLE: 52}
_MIN_EXPONENT = {ir.DataType.FLOAT: -126, ir.DataType.DOUBLE: -1022}


@project_rule(prims.nextafter.default)
def prims_nextafter(self, other):
    """nextafter(Tensor self, Tensor other) -> Tensor"""
    # The next representable number after x toward y, from the spacing of x's binade: 2**(e - mantissa
    # bits), halved when stepping down from an exact power of two toward zero; the smallest subnormal
    # below the normal range. Computed in float64, where every step of float32 is exact.
    if self.dtype not in _MANTISSA_BITS:
        raise NotImplementedError(f"nextafter for {self.dtype}")
    bits, min_exponent = _MANTISSA_BITS[self.dtype], _MIN_EXPONENT[self.dtype]
    x, y = op.Cast(self, to=ir.DataType.DOUBLE), op.Cast(other, to=ir.DataType.DOUBLE)
    a = op.Abs(x)
    two = _double(2.0)
    safe = op.Where(op.Greater(a, _double(0.0)), a, _double(1.0))
    e = op.Floor(op.Div(op.Log(safe), _double(0.6931471805599453)))
    e = op.Where(op.Greater(op.Pow(two, e), safe), op.Sub(e, _double(1.0)), e)
    e = op.Where(op.LessOrEqual(op.Pow(two, op.Add(e, _double(1.0))), safe), op.Add(e, _double(1.0)), e)
    e = op.Max(e, _double(float(min_exponent)))  # subnormals share the smallest normal binade's spacing
    spacing = op.Pow(two, op.Sub(e, _double(float(bits))))
    toward_zero = op.Less(op.Mul(x, op.Sub(y, x)), _double(0.0))
    power_of_two = op.And(op.Equal(a, op.Pow(two, e)), op.Greater(e, _double(float(min_exponent))))
    spacing = op.Where(op.And(toward_zero, power_of_two), op.Div(spacing, two), spacing)
    step = op.Where(op.Greater(y, x), spacing, op.Neg(spacing))
    smallest = op.Pow(two, _double(float(min_exponent - bits)))
    result = op.Where(op.Equal(x, _double(0.0)), op.Where(op.Greater(y, x), smallest, op.Neg(smallest)), op.Add(x, step))
    # From an infinity toward anything else: the largest finite number of that sign (x + step was NaN).
    largest = _double(float(np.finfo(np.float32 if self.dtype == ir.DataType.FLOAT else np.float64).max))
    result = op.Where(op.IsInf(x), op.Mul(largest, op.Sign(x)), result)
    # A step from a nonzero x keeps x's sign, onto zero too (nextafter(-2**-149, 0.0) is -0.0, not x + step).
    result = op.Where(op.Equal(x, _double(0.0)), result, op.Mul(op.Abs(result), _sign_of(x)))
    # y where x == y, a -0.0 included (nextafter(0.0, -0.0) is -0.0; Where would lose it).
    result = select(op.Equal(x, y), y, result)
    result = op.Where(op.Or(op.IsNaN(x), op.IsNaN(y)), op.Add(x, y), result)
    return op.CastLike(result, self)


@project_rule(aten.gelu.default)
def aten_gelu(self, approximate: str = "none"):
    """gelu(Tensor self, *, str approximate='none') -> Tensor"""
    # 16-bit: in float32 with float32 constants (torch_lib's made 1/sqrt(2) in the input's dtype: 5% of bfloat16
    # GELUs, 30% of tanh ones, were off eager's).
    return _opmath(lambda x: torchlib_nn.aten_gelu(x, approximate), self)


@project_rule(aten.reciprocal.default)
def aten_reciprocal(self):
    """reciprocal(Tensor self) -> Tensor"""
    # ONNX Runtime's float16 Reciprocal is off eager's correctly rounded 1 / x in a quarter of the values.
    return _opmath(op.Reciprocal, self)
