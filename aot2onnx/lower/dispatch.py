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


def _reads_output(node: torch.fx.Node, index: int) -> bool:
    """Whether the graph reads output ``index`` of the multi-output ``node`` (through a getitem)."""
    return any(user.target is operator.getitem and user.args[1] == index and (user.users or user.op == "output")
               for user in node.users)


aten = torch.ops.aten
# Fused kernels that pay only where the graph reads what they add: ATen's max pooling computes indices, which
# ONNX Runtime's MaxPool skips where nothing reads them (a training forward saves them for the backward; an
# inference graph does not): 16 x 16 x 32 x 32, 2 threads, ONNX Runtime's MaxPool without indices 168 us,
# ATen's 733-802 us.
_FUSED_ONLY_WHEN = {
    aten.max_pool2d_with_indices.default: lambda node: _reads_output(node, 1),
    aten.max_pool3d_with_indices.default: lambda node: _reads_output(node, 1),
}


def dispatch(node: torch.fx.Node, registry: Registry, opset: int) -> tuple[Rule | None, str]:
    """The rule that lowers the call_function ``node`` at ``opset``, or ``None`` and the reason."""
    is_complex = is_complex_node(node)
    rule, reason = registry.lookup(node.target, opset, is_complex=is_complex)
    pays = _FUSED_ONLY_WHEN.get(node.target)
    if rule is not None and rule.origin == Origin.FUSED and pays is not None and not pays(node):
        rule, reason = registry.lookup(node.target, opset, is_complex=is_complex, passing_over=Origin.FUSED)
    if rule is not None and is_complex and rule.origin == Origin.TORCHLIB:
        # (torch_lib's complex division and reciprocal, (ac + bd, bc - ad) / (c^2 + d^2), gave NaN for eager's inf
        # at z / 0 and 0 where c^2 + d^2 overflows: aot2onnx's rules in lower/ops/complex.py take precedence.)
        tensors = _tensor_args(node)
        if any(v.is_complex() for v in tensors) and any(v.is_floating_point() for v in tensors):
            # torch_lib's complex rules read every float operand as a [..., 2] pair: a real one (complex * real
            # weight) would be sliced along its own last axis, a wrong number rather than an error.
            return None, (f"{rule.origin} rule {rule.name} reads every float operand as complex, and this node "
                          "mixes real and complex ones")
    return rule, reason
