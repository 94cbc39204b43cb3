"""The op recorder rules are traced with: the exporter's (``OpRecorder``, through the fence), keeping Python
scalars exact in float64 graphs and giving recorded outputs their element types.

This is lowering's own numerics, not a compatibility shim: it lives here, and ``_exporter_compat`` only hands
over the exporter's class it extends.
"""

from __future__ import annotations

from typing import Any

import numpy as _np
import onnx_ir as _ir

from aot2onnx.lower._exporter_compat import OpRecorder

__all__ = ["Recorder"]


_PYTHON_SCALAR = "aot2onnx.python_scalar"  # value.meta key: a scalar Constant's Python value


def _attr_value(value: Any) -> Any:
    return value.value if isinstance(value, _ir.Attr) else value


def _set_dtypes(signature: Any, named_inputs: dict[str, Any], named_attrs: dict[str, Any], outputs: Any) -> None:
    """Gives a recorded node's outputs their element type where its schema says it (the recorder leaves them
    unset): a Cast's target, a Constant's tensor, LayerNormalization's statistics' stash type, else the type
    of an input under the output's type constraint, or the one type the constraint allows. A rule's later
    Python scalars beside those outputs are then made in that type, and a value FX declares in another dtype
    is cast to it (``translate._lower_call``)."""
    for param, output in zip(signature.outputs, outputs):
        if not isinstance(output, _ir.Value) or output.dtype is not None:
            continue
        dtype = None
        if signature.name == "Cast":
            dtype = _ir.DataType(_attr_value(named_attrs["to"]))
        elif signature.name == "Constant":
            value = _attr_value(named_attrs.get("value"))
            dtype = getattr(value, "dtype", None) or (
                _ir.DataType.FLOAT if "value_float" in named_attrs else
                _ir.DataType.INT64 if "value_int" in named_attrs else None)
        elif signature.name == "LayerNormalization" and param.name in ("Mean", "InvStdDev"):
            dtype = _ir.DataType(_attr_value(named_attrs.get("stash_type", 1)))  # U: float32 by default
        else:
            for name, arg in named_inputs.items():
                input_param = signature.params_map.get(name)
                if (isinstance(arg, _ir.Value) and arg.dtype is not None and input_param is not None
                        and input_param.type_constraint == param.type_constraint):
                    dtype = arg.dtype
                    break
            allowed = getattr(param.type_constraint, "allowed_types", ())
            if dtype is None and len(allowed) == 1:  # a fixed output type (IsNaN's bool, ArgMax's int64)
                dtype = getattr(next(iter(allowed)), "dtype", None)
        if dtype is not None:
            output.dtype = dtype


def _float32_exact(value: Any) -> bool:
    return isinstance(value, (int, float)) and float(_np.float32(value)) == value


class Recorder(OpRecorder):
    """The exporter's op recorder, keeping Python scalars exact in float64 graphs.

    ONNX has no float64 scalars where rules put them: the recorder makes a Python number it casts
    (``op.CastLike(0.1, x)``, ``op.Cast(0.1, to=DOUBLE)``, torch_lib's ways to put a scalar in a tensor's
    dtype) a float32 constant first, and float attributes (LeakyRelu's and Elu's alpha, HardSigmoid's, Gemm's
    alpha and beta) are float32. In a float64 graph 0.1 became 0.10000000149011612: an add's alpha, pow's
    scalar base, leaky_relu's slope or addmm's beta 1.000001 was 5e-8 off where eager uses the double. Here
    such a cast is the constant made in float64, and such an op, on float64 inputs, with an attribute
    float32 cannot hold, is the same arithmetic written with float64 constants. Other dtypes keep the
    exporter's way: for float16 and bfloat16 tensors eager itself computes with the scalar in float32.
    (Overrides the recorder's private ``_call_op``; ``tests/test_exporter_compat.py`` checks it is there.)
    """

    def _call_op(self, op_signature, named_inputs, named_attrs, num_outputs):
        if op_signature.domain not in ("", "ai.onnx"):
            return super()._call_op(op_signature, named_inputs, named_attrs, num_outputs)
        outputs = self._exact_in_double(op_signature.name, named_inputs, named_attrs)
        if outputs is None:
            outputs = super()._call_op(op_signature, named_inputs, named_attrs, num_outputs)
            if op_signature.name == "Constant" and len(named_attrs) == 1:
                # A scalar constant (an onnxscript function's attribute, made a float32 Constant): its Python
                # value, for a Cast of it to float64 (below).
                (key, value), = named_attrs.items()
                value = _attr_value(value)
                if key in ("value_float", "value_int") and isinstance(value, (int, float)):
                    outputs[0].meta[_PYTHON_SCALAR] = value
        _set_dtypes(op_signature, named_inputs, named_attrs, outputs)
        return outputs

    def _exact_in_double(self, name: str, named_inputs: dict[str, Any], named_attrs: dict[str, Any]) -> list | None:
        """The op's value made exact in float64 (see the class), or None where the exporter's way is exact."""
        if name in ("Cast", "CastLike"):
            scalar = named_inputs.get("input")
            if isinstance(scalar, _ir.Value):
                scalar = scalar.meta.get(_PYTHON_SCALAR)
            if name == "Cast":
                double = _attr_value(named_attrs.get("to")) == _ir.DataType.DOUBLE
            else:
                double = getattr(named_inputs.get("target_type"), "dtype", None) == _ir.DataType.DOUBLE
            if double and isinstance(scalar, (int, float)) and not isinstance(scalar, bool):
                return [self._double(scalar)]
        elif name in _FLOAT_ATTRIBUTE_OPS:
            x = named_inputs.get("X", named_inputs.get("A"))
            values = [_attr_value(named_attrs.get(a)) for a in _FLOAT_ATTRIBUTE_OPS[name]]
            if getattr(x, "dtype", None) == _ir.DataType.DOUBLE and not all(
                v is None or _float32_exact(v) for v in values
            ):
                return [self._in_double(name, named_inputs, {k: _attr_value(v) for k, v in named_attrs.items()})]
        return None

    def _double(self, scalar: float) -> Any:
        key = (float(scalar), _ir.DataType.DOUBLE)  # the exporter's key for the same constant
        constant = self.constant_farm.get(key)
        if constant is None:
            constant = self.opset.Constant(value=_ir.tensor(float(scalar), dtype=_ir.DataType.DOUBLE))
            self.constant_farm[key] = constant
        return constant

    def _in_double(self, name: str, inputs: dict[str, Any], attrs: dict[str, Any]) -> Any:
        """The op's arithmetic as ONNX Runtime's float64 kernels do it, with its attributes as float64 constants."""
        from onnxscript import opset18 as op

        def attr(key: str, default: float) -> Any:
            value = attrs.get(key)
            return self._double(default if value is None else value)

        zero, one = self._double(0.0), self._double(1.0)
        if name == "Gemm":
            a, b, c = inputs["A"], inputs["B"], inputs.get("C")
            if attrs.get("transA"):
                a = op.Transpose(a, perm=[1, 0])
            if attrs.get("transB"):
                b = op.Transpose(b, perm=[1, 0])
            y = op.Mul(op.MatMul(a, b), attr("alpha", 1.0))
            return y if c is None else op.Add(y, op.Mul(c, attr("beta", 1.0)))
        x = inputs["X"]
        if name == "LeakyRelu":  # x if x >= 0 else alpha * x
            return op.Where(op.Less(x, zero), op.Mul(x, attr("alpha", 0.01)), x)
        if name == "Elu":  # x if x >= 0 else alpha * (exp(x) - 1)
            return op.Where(op.Less(x, zero), op.Mul(attr("alpha", 1.0), op.Sub(op.Exp(x), one)), x)
        if name == "Celu":  # max(0, x) + min(0, alpha * (exp(x / alpha) - 1))
            alpha = attr("alpha", 1.0)
            return op.Add(op.Max(zero, x), op.Min(zero, op.Mul(alpha, op.Sub(op.Exp(op.Div(x, alpha)), one))))
        if name == "HardSigmoid":  # max(0, min(1, alpha * x + beta))
            return op.Max(zero, op.Min(one, op.Add(op.Mul(attr("alpha", 0.2), x), attr("beta", 0.5))))
        assert name == "ThresholdedRelu"  # x if x > alpha else 0
        return op.Where(op.Greater(x, attr("alpha", 1.0)), x, zero)


# ONNX ops with float attributes (float32 in ONNX) that _in_double writes in float64.
_FLOAT_ATTRIBUTE_OPS = {
    "Gemm": ("alpha", "beta"),
    "LeakyRelu": ("alpha",),
    "Elu": ("alpha",),
    "Celu": ("alpha",),
    "HardSigmoid": ("alpha", "beta"),
    "ThresholdedRelu": ("alpha",),
}
