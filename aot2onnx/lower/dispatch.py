"""Which rule lowers an FX node, or why none does. ``lower/plan.analyse`` asks it once per node of a graph;
lowering, the fallback's split and the unsupported-op report read that plan instead of asking again."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from aot2onnx.lower.registry import Origin, Registry, Rule

__all__ = ["dispatch", "is_complex_node", "is_passthrough_getitem"]


def _complex(val: Any) -> bool:
    if isinstance(val, (list, tuple)):
        return any(_complex(v) for v in val)
    return isinstance(val, torch.Tensor) and val.is_complex()


def _tensor_args(node: torch.fx.Node) -> list[torch.Tensor]:
    def vals(arg: Any) -> list[torch.Tensor]:
        if isinstance(arg, torch.fx.Node):
            val = arg.meta.get("val")
            return [val] if isinstance(val, torch.Tensor) else []
        if isinstance(arg, (list, tuple)):
            return [v for a in arg for v in vals(a)]
        return []

    return [v for a in (*node.args, *node.kwargs.values()) for v in vals(a)]


def is_complex_node(node: torch.fx.Node) -> bool:
    """Whether ``node`` reads or makes a complex tensor: complex rules, registered apart, lower it.

    A lowered graph carries a complex tensor as a real one with a trailing axis of 2, so a rule that makes one
    from real inputs (``view_as_complex``, ``_fft_r2c``, a cast to a complex dtype) must know it does: a real
    rule would make a value without that axis (a Cast to ONNX's COMPLEX64, which nothing computes with)."""
    return any(v.is_complex() for v in _tensor_args(node)) or _complex(node.meta.get("val"))


def is_passthrough_getitem(node: torch.fx.Node) -> bool:
    """getitem on a multi-output op picks one of its outputs; it is not an op of its own."""
    if node.target is not operator.getitem:
        return False
    source = node.args[0]
    return isinstance(source, torch.fx.Node) and isinstance(source.meta.get("val"), (list, tuple))


# torch_lib's complex rules that give other numbers than ATen's, refused (the node runs in PyTorch): its
# division is (a c + b d, b c - a d) / (c^2 + d^2), where ATen scales by the larger part of the divisor, so that
# z / 0 is NaN for ATen's inf and c^2 + d^2 overflows (|divisor| > 1.8e19 in float32: a quotient of 0 for
# eager's 2.4e-31); its reciprocal is the same formula.
_DIVISION = "torch_lib's complex division overflows and divides by zero otherwise than ATen"
_TORCHLIB_COMPLEX_REFUSED = {
    "aten::div.Tensor": _DIVISION,
    "aten::div.Scalar": _DIVISION,
    "aten::div.Tensor_mode": _DIVISION,
    "aten::reciprocal": "torch_lib's complex reciprocal overflows and divides by zero otherwise than ATen",
}


def dispatch(node: torch.fx.Node, registry: Registry, opset: int) -> tuple[Rule | None, str]:
    """The rule that lowers the call_function ``node`` at ``opset``, or ``None`` and the reason."""
    is_complex = is_complex_node(node)
    rule, reason = registry.lookup(node.target, opset, is_complex=is_complex)
    if rule is not None and is_complex and rule.origin == Origin.TORCHLIB:
        name = node.target.name() if isinstance(node.target, torch._ops.OpOverload) else ""
        refused = _TORCHLIB_COMPLEX_REFUSED.get(name)
        if refused is not None:
            return None, f"{rule.origin} rule {rule.name}: {refused}"
        tensors = _tensor_args(node)
        if any(v.is_complex() for v in tensors) and any(v.is_floating_point() for v in tensors):
            # torch_lib's complex rules read every float operand as a [..., 2] pair: a real one (complex * real
            # weight) would be sliced along its own last axis, a wrong number rather than an error.
            return None, (f"{rule.origin} rule {rule.name} reads every float operand as complex, and this node "
                          "mixes real and complex ones")
    return rule, reason
