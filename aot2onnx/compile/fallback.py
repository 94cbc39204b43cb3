"""Per-node fallback: the parts of a graph that lower run on ONNX Runtime, the rest in PyTorch.

With ``fallback=True``, an AOTAutograd graph (forward, backward or inference) that holds ops without a
lowering is split, as PyTorch's removed ``onnxrt`` backend did, with ``CapabilityBasedPartitioner``: every
maximal group of lowerable nodes becomes one ONNX model and session, and the other nodes stay in the FX
graph, which runs them with PyTorch's kernels. The split happens inside each of AOTAutograd's functional
graphs, so the autograd.Function, the mutation epilogue and the gradients are those of the whole graph.

A partition is compiled (lowered, and its ONNX Runtime session created) when the graph is. Where that
fails, for a partition or for a whole graph that has no unsupported op, the nodes the error names (a
lowering rule's node; the node ONNX Runtime found no kernel for, or failed to infer a shape of) run in
PyTorch too and the rest is split again; an error that names no node sends its whole partition to PyTorch.
Compiling with ``fallback=True`` does not fail on what ONNX Runtime refuses: it warns and runs it in PyTorch.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
import re
import warnings
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from aot2onnx.errors import LoweringError, RuntimeSessionError

if TYPE_CHECKING:
    from aot2onnx.lower.plan import GraphPlan

__all__ = [
    "FallbackGraph",
    "Refusal",
    "blamed_nodes",
    "refused_nodes",
    "fallback_graphs",
    "reset_fallback_graphs",
    "split_unsupported",
    "unsupported_targets",
]

_FALLBACKS: list[weakref.ref[FallbackGraph]] = []


def fallback_graphs() -> list[FallbackGraph]:
    """Every split graph compiled in this process (since the last reset) that is still alive."""
    return [g for ref in _FALLBACKS if (g := ref()) is not None]


def reset_fallback_graphs() -> None:
    _FALLBACKS.clear()


class _Lowerable(OperatorSupportBase):
    """The plan's decisions as the partitioner asks for them: a node lowers where the plan found it a rule. The
    partitioner also asks about the nodes of a partition being split again, copies with the same names."""

    def __init__(self, plan: GraphPlan, refused: Collection[str] = ()) -> None:
        self._plan = plan
        self._refused = frozenset(refused)  # names of nodes whose lowering or session failed: PyTorch runs them

    def is_node_supported(self, submodules: Mapping[str, torch.nn.Module], node: torch.fx.Node) -> bool:
        if node.op != "call_function" or node.name in self._refused:
            return False
        if node.target is operator.getitem:
            source = node.args[0]
            return isinstance(source, torch.fx.Node) and self.is_node_supported(submodules, source)
        decision = self._plan.nodes.get(node.name)
        if decision is None or decision.node.target != node.target:
            return False
        return decision.rule is not None


def unsupported_targets(plan: GraphPlan) -> collections.Counter:
    """How many nodes of each target of the plan's graph run in PyTorch for want of a lowering (empty when the
    whole graph lowers)."""
    support = _Lowerable(plan)
    return collections.Counter(
        str(node.target)
        for node in plan.gm.graph.nodes
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


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Nodes that have a lowering but run in PyTorch: their lowering failed, or ONNX Runtime refused the
    model of their partition (no kernel for a dtype, a failed shape inference). ``why`` is the first line
    of that error."""

    graph: str  # the partition whose compilation failed
    nodes: tuple[str, ...]  # the FX nodes that now run in PyTorch, as ``name (target)``
    why: str


class FallbackGraph:
    """A split graph in AOTAutograd's boxed calling convention. ``subgraphs`` are the compiled partitions.

    ``fallen_back`` counts the nodes that run in PyTorch by target; ``refusals`` says why those that have a
    lowering do.
    """

    _boxed_call = True

    def __init__(
        self,
        split: torch.fx.GraphModule,
        subgraphs: list[Any],
        fallen_back: collections.Counter,
        refusals: Sequence[Refusal] = (),
    ) -> None:
        self.split = split
        self.subgraphs = subgraphs
        self.fallen_back = fallen_back
        self.refusals = list(refusals)
        _FALLBACKS.append(weakref.ref(self))

    def __call__(self, args: list[Any]) -> Any:
        inputs = list(args)
        args.clear()
        return self.split(*inputs)


# Compiling a partition fails with these when its lowering fails or ONNX Runtime refuses its model: the
# partition then runs in PyTorch instead (compile_partition has raised PyTorch's own error already where
# PyTorch refuses a node as well).
_PARTITION_ERRORS = (LoweringError, RuntimeSessionError)

# How aot2onnx's errors name an FX node: its format_node() text, which starts "%name : [num_users=".
_NODE_TEXT = re.compile(r"%([A-Za-z_][A-Za-z0-9_]*) : \[num_users=")


def blamed_nodes(gm: torch.fx.GraphModule, error: BaseException) -> list[torch.fx.Node]:
    """The call nodes of ``gm`` that ``error`` (from lowering or from creating the session of ``gm``'s model)
    names: a lowering rule's failure names its node, and ONNX Runtime's errors about one ONNX node are
    given the FX node it was lowered from (``runtime.session``)."""
    names = set()
    while error is not None:
        names.update(_NODE_TEXT.findall(str(error)))
        error = error.__cause__
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.name in names]


def refused_nodes(gm: torch.fx.GraphModule, error: BaseException) -> list[torch.fx.Node]:
    """The call nodes of ``gm`` to run in PyTorch because compiling ``gm`` failed with ``error``.

    A lowering rule that failed, or a missing ONNX Runtime kernel, is the named node's own. Any other error
    ONNX Runtime raises about a node (shape or type inference) may come from a value made before it: a rule
    that gives a value of the wrong shape is found only where the value is read (the select_scatter that
    read torch_lib's copy, which did not broadcast, failed as an Unsqueeze). There the named nodes and
    every node of ``gm`` they depend on run in PyTorch.
    """
    named = blamed_nodes(gm, error)
    if not named or isinstance(error, LoweringError) or "Could not find an implementation" in str(error):
        return named
    closure: set[torch.fx.Node] = set()
    stack = list(named)
    while stack:
        node = stack.pop()
        if node not in closure:
            closure.add(node)
            stack.extend(n for n in node.all_input_nodes if n.op == "call_function")
    return [n for n in gm.graph.nodes if n in closure]


def _first_line(error: BaseException) -> str:
    def first(e: BaseException) -> str:
        return next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)

    line = first(error)
    if isinstance(error, LoweringError) and error.__cause__ is not None:  # "the rule ... failed on": why
        line += f" ({type(error.__cause__).__name__}: {first(error.__cause__)})"
    return line if len(line) <= 400 else line[:400] + " ..."


def _calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]


def _describe(nodes: Sequence[torch.fx.Node]) -> tuple[str, ...]:
    return tuple(f"{n.name} ({n.target})" for n in nodes if n.target is not operator.getitem)


def _split(
    gm: torch.fx.GraphModule,
    name: str,
    support: Callable[[Collection[str]], _Lowerable],
    refused: Collection[str],
    compile_partition: Callable[[torch.fx.GraphModule, str], Callable],
    subgraphs: list[Any],
    in_torch: list[torch.fx.Node],
    refusals: list[Refusal],
) -> torch.fx.GraphModule:
    """``gm`` split into partitions of the nodes ``support(refused)`` accepts, each compiled; the returned
    module runs the rest with PyTorch's kernels. A partition that fails to compile is split again without the
    nodes its error names, or, where it names none (or all), runs in PyTorch as it is."""
    partitioner = CapabilityBasedPartitioner(gm, support(refused), allows_single_node_partition=True)
    split = partitioner.fuse_partitions(partitioner.propose_partitions())
    for node in list(split.graph.nodes):
        if node.op == "call_function" and node.target is not operator.getitem:
            in_torch.append(node)
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
        partition_name = f"{name}_{node.target}"
        try:
            compiled = compile_partition(submodule, partition_name)
        except _PARTITION_ERRORS as e:
            calls = _calls(submodule)
            blamed = [n for n in refused_nodes(submodule, e) if n.target is not operator.getitem]
            if blamed and len(blamed) < len(calls):
                refusals.append(Refusal(partition_name, _describe(blamed), _first_line(e)))
                resplit = _split(
                    submodule, partition_name, support, {n.name for n in blamed}, compile_partition, subgraphs,
                    in_torch, refusals,
                )
                setattr(split, node.target, resplit)
            else:
                # The submodule stays as it is: an FX GraphModule, run by PyTorch.
                refusals.append(Refusal(partition_name, _describe(calls), _first_line(e)))
                in_torch.extend(calls)
            continue
        subgraphs.append(compiled)
        setattr(split, node.target, _OrtSubgraph(compiled, single_output))
    split.recompile()
    return split


_SHOWN = 4  # refusals the warning spells out


def split_unsupported(
    plan: GraphPlan,
    *,
    name: str,
    compile_partition: Callable[[torch.fx.GraphModule, str], Callable],
    failure: Exception | None = None,
) -> FallbackGraph:
    """Splits the plan's graph ``plan.gm`` (canonicalized) into lowerable partitions, each compiled by
    ``compile_partition(module, name)``.

    Nodes the plan found no rule for, or complex, run in PyTorch. ``failure``: the error with which compiling ``gm`` whole
    failed; the nodes it names run in PyTorch too (all of them, where it names none). A partition whose
    compilation fails with a ``LoweringError`` or ``RuntimeSessionError`` is split again without the nodes
    the error names, or run in PyTorch whole. Warns once, naming what runs in PyTorch and why.
    """
    gm = plan.gm
    refused: list[torch.fx.Node] = []
    refusals = []
    if failure is not None:
        refused = refused_nodes(gm, failure) or _calls(gm)
        refusals.append(Refusal(name, _describe(refused), _first_line(failure)))
    unlowered = unsupported_targets(plan)  # before the split, which rewrites gm in place
    subgraphs: list[Any] = []
    in_torch: list[torch.fx.Node] = []
    split = _split(
        gm, name, lambda names: _Lowerable(plan, names), {n.name for n in refused}, compile_partition,
        subgraphs, in_torch, refusals,
    )
    fallen_back = collections.Counter(str(n.target) for n in in_torch)
    lines = []
    if unlowered:
        summary = ", ".join(f"{t} ({c} node{'s' if c > 1 else ''})" for t, c in sorted(unlowered.items()))
        lines.append(f"{sum(unlowered.values())} node(s) without an ONNX lowering run in PyTorch: {summary};")
    for refusal in refusals[:_SHOWN]:
        shown = ", ".join(refusal.nodes[:6]) + (f" and {len(refusal.nodes) - 6} more" if len(refusal.nodes) > 6 else "")
        lines.append(
            f"{len(refusal.nodes)} node(s) run in PyTorch because compiling {refusal.graph!r} for ONNX Runtime "
            f"failed on them: {shown}. Why: {refusal.why};"
        )
    if len(refusals) > _SHOWN:
        lines.append(f"and {len(refusals) - _SHOWN} more failed partition(s), listed in FallbackGraph.refusals;")
    warnings.warn(
        f"aot2onnx: graph {name!r}: " + " ".join(lines)
        + f" the rest runs on ONNX Runtime in {len(subgraphs)} partition(s). "
        "Pass fallback=False to fail instead, or add a lowering with @aot2onnx.register_lowering.",
        stacklevel=2,
    )
    return FallbackGraph(split, subgraphs, fallen_back, refusals)
