"""Per-node fallback: the parts of a graph that lower run on ONNX Runtime, the rest in PyTorch.

With ``fallback=True``, an AOTAutograd graph (forward, backward or inference) that holds ops without a
lowering is split, as PyTorch's removed ``onnxrt`` backend did, with ``CapabilityBasedPartitioner``: every
maximal group of lowerable nodes becomes one ONNX model and session, and the other nodes stay in the FX
graph, which runs them with PyTorch's kernels. The split happens inside each of AOTAutograd's functional
graphs, so the autograd.Function, the mutation epilogue and the gradients are those of the whole graph.
"""

from __future__ import annotations

import collections
import operator
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from aot2onnx.lower.dispatch import dispatch, is_complex_node
from aot2onnx.lower.registry import Registry

__all__ = ["FallbackGraph", "fallback_graphs", "reset_fallback_graphs", "split_unsupported", "unsupported_targets"]

_FALLBACKS: list[weakref.ref[FallbackGraph]] = []


def fallback_graphs() -> list[FallbackGraph]:
    """Every split graph compiled in this process (since the last reset) that is still alive."""
    return [g for ref in _FALLBACKS if (g := ref()) is not None]


def reset_fallback_graphs() -> None:
    _FALLBACKS.clear()


class _Lowerable(OperatorSupportBase):
    def __init__(self, registry: Registry, opset: int) -> None:
        self._registry = registry
        self._opset = opset

    def is_node_supported(self, submodules: Mapping[str, torch.nn.Module], node: torch.fx.Node) -> bool:
        if node.op != "call_function":
            return False
        if node.target is operator.getitem:
            source = node.args[0]
            return isinstance(source, torch.fx.Node) and self.is_node_supported(submodules, source)
        if is_complex_node(node) or _complex_value(node.meta.get("val")):
            # A partition's inputs and outputs are handed over as they are, and ONNX has no complex type (a
            # lowered graph carries complex values as real [..., 2] tensors): such nodes stay in PyTorch.
            return False
        rule, _ = dispatch(node, self._registry, self._opset)
        return rule is not None


def _complex_value(val: Any) -> bool:
    if isinstance(val, (list, tuple)):
        return any(_complex_value(v) for v in val)
    return isinstance(val, torch.Tensor) and val.is_complex()


def unsupported_targets(gm: torch.fx.GraphModule, registry: Registry, opset: int) -> collections.Counter:
    """How many nodes of each target have no lowering (empty when the whole graph lowers)."""
    support = _Lowerable(registry, opset)
    return collections.Counter(
        str(node.target)
        for node in gm.graph.nodes
        if node.op == "call_function" and node.target is not operator.getitem and not support.is_node_supported({}, node)
    )


class _OrtSubgraph(torch.nn.Module):
    """One lowered partition inside the split graph: calls its compiled graph (boxed) with plain args."""

    def __init__(self, compiled: Callable, single_output: bool) -> None:
        super().__init__()
        self.compiled = compiled
        self.single_output = single_output

    def forward(self, *args: Any) -> Any:
        outputs = self.compiled(list(args))
        return outputs[0] if self.single_output else tuple(outputs)


class FallbackGraph:
    """A split graph in AOTAutograd's boxed calling convention. ``subgraphs`` are the compiled partitions."""

    _boxed_call = True

    def __init__(self, split: torch.fx.GraphModule, subgraphs: list[Any], fallen_back: collections.Counter) -> None:
        self.split = split
        self.subgraphs = subgraphs
        self.fallen_back = fallen_back
        _FALLBACKS.append(weakref.ref(self))

    def __call__(self, args: list[Any]) -> Any:
        inputs = list(args)
        args.clear()
        return self.split(*inputs)


def split_unsupported(
    gm: torch.fx.GraphModule,
    *,
    name: str,
    registry: Registry,
    opset: int,
    compile_partition: Callable[[torch.fx.GraphModule, str], Callable],
) -> FallbackGraph:
    """Splits ``gm`` into lowerable partitions, each compiled by ``compile_partition(module, name)``.

    Warns once, naming the ops that run in PyTorch and how many nodes of each.
    """
    fallen_back = unsupported_targets(gm, registry, opset)
    partitioner = CapabilityBasedPartitioner(gm, _Lowerable(registry, opset), allows_single_node_partition=True)
    split = partitioner.fuse_partitions(partitioner.propose_partitions())
    subgraphs = []
    for node in list(split.graph.nodes):
        if node.op != "call_module":
            continue
        submodule = split.get_submodule(node.target)
        # The partition's placeholders take the meta of the values they receive in the outer graph,
        # which is what lowering reads their types and shapes from.
        placeholders = [n for n in submodule.graph.nodes if n.op == "placeholder"]
        for placeholder, arg in zip(placeholders, node.args):
            placeholder.meta.update({k: v for k, v in arg.meta.items() if k in ("val", "tensor_meta")})
        output = next(n for n in submodule.graph.nodes if n.op == "output")
        single_output = not isinstance(output.args[0], (tuple, list))
        compiled = compile_partition(submodule, f"{name}_{node.target}")
        subgraphs.append(compiled)
        setattr(split, node.target, _OrtSubgraph(compiled, single_output))
    split.recompile()
    summary = ", ".join(f"{target} ({count} node{'s' if count > 1 else ''})" for target, count in sorted(fallen_back.items()))
    warnings.warn(
        f"aot2onnx: graph {name!r}: {sum(fallen_back.values())} node(s) without an ONNX lowering run in PyTorch: "
        f"{summary}; the rest runs on ONNX Runtime in {len(subgraphs)} partition(s). "
        "Pass fallback=False to fail instead, or add a lowering with @aot2onnx.register_lowering.",
        stacklevel=2,
    )
    return FallbackGraph(split, subgraphs, fallen_back)
