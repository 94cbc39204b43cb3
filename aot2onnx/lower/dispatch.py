"""Which rule lowers an FX node, or why none does. ``lower/plan.analyse`` asks it once per node of a graph;
lowering, the fallback's split and the unsupported-op report read that plan instead of asking again."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from aot2onnx.lower.registry import Registry, Rule

__all__ = ["dispatch", "is_complex_node", "is_passthrough_getitem"]


def is_complex_node(node: torch.fx.Node) -> bool:
    """Whether any tensor argument of ``node`` is complex (complex rules are registered apart)."""

    def complex_arg(arg: Any) -> bool:
        if isinstance(arg, torch.fx.Node):
            val = arg.meta.get("val")
            return isinstance(val, torch.Tensor) and val.is_complex()
        if isinstance(arg, (list, tuple)):
            return any(complex_arg(a) for a in arg)
        return False

    return any(complex_arg(a) for a in (*node.args, *node.kwargs.values()))


def is_passthrough_getitem(node: torch.fx.Node) -> bool:
    """getitem on a multi-output op picks one of its outputs; it is not an op of its own."""
    if node.target is not operator.getitem:
        return False
    source = node.args[0]
    return isinstance(source, torch.fx.Node) and isinstance(source.meta.get("val"), (list, tuple))


def dispatch(node: torch.fx.Node, registry: Registry, opset: int) -> tuple[Rule | None, str]:
    """The rule that lowers the call_function ``node`` at ``opset``, or ``None`` and the reason."""
    return registry.lookup(node.target, opset, is_complex=is_complex_node(node))
