"""Node by node: every intermediate value of a lowered graph against the FX node it was lowered from.

For one FX graph (a forward or backward graph, whole; the fallback may have split it into several ONNX
models) and the inputs one compiled call received:

- eager: the FX graph is interpreted with PyTorch's kernels, node after node, from those inputs;
- compiled: each ONNX model runs once more with every value named after an FX node added to its outputs
  (one session and one run per model), from the inputs that model received in the compiled call;
- each FX node's ONNX value is compared with eager's value of the node (the error along the graph, which
  carries what came before it), and with the node itself run by PyTorch on the compiled values of its
  inputs: the node's own error. A node whose own error is beyond tolerance is divergent; one that only
  carries an upstream error is not, since its inputs are the compiled ones.
"""

from __future__ import annotations

import dataclasses
import operator
import pathlib
import re
import types
from collections.abc import Mapping, Sequence
from typing import Any

import onnx
import torch
import torch.fx

import aot2onnx
from aot2onnx.capture._torch_compat import tree_leaves
from aot2onnx.lower.translate import user_source_line
from aot2onnx.options import Options
from aot2onnx.runtime.session import OrtGraph
from aot2onnx.signature import GraphKind, GraphSignature, InputKind, InputSpec, OutputKind, OutputSpec
from aot2onnx.tools.parity.errors import ErrorStats, magnitude, measure, slack
from aot2onnx.tools.parity.repro import Reproducer, make_reproducer

__all__ = ["GraphParity", "NodeParity", "OnnxRun", "analyse", "interpret", "run_intermediates", "target_name"]

_FX_NODE = "pkg.torch.onnx.fx_node"
_STACK = "pkg.torch.onnx.stack_trace"
_NODE_NAME = re.compile(r"^%([A-Za-z_][A-Za-z0-9_]*) :")


@dataclasses.dataclass
class NodeParity:
    """One FX node of a compiled graph: its ONNX value against eager's, and its own error."""

    graph: str  # the compiled graph (ONNX model) it was lowered into
    kind: str  # forward, backward, inference
    index: int  # position among the FX graph's call nodes
    fx_name: str
    target: str  # the ATen overload, "aten.gelu.default"
    onnx_nodes: list[str]  # the ONNX nodes lowered from it, "node_Erf_4 (Erf)"
    source: str  # the user's source line
    shape: list[int]
    dtype: str
    error: ErrorStats | None  # the ONNX value against eager's value of the node (what came before included)
    own: ErrorStats | None  # the ONNX value against the node run by PyTorch on the compiled inputs
    slack: float  # the widening of the own error's tolerance (errors.SLACK_ULPS)
    divergent: bool
    note: str = ""  # why something was not compared
    fx_text: str = ""  # node.format_node()
    eager_inputs: list[str] = dataclasses.field(default_factory=list)  # inputs whose compiled value is unknown

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["error"] = self.error.to_dict() if self.error else None
        d["own"] = self.own.to_dict() if self.own else None
        return d

    def describe(self) -> str:
        """Several lines for an error message or a report: what, where, how far."""
        lines = [f"{self.target} (FX node {self.fx_name!r} of {self.kind} graph {self.graph!r})",
                 f"  at {self.source}"]
        if self.onnx_nodes:
            shown = ", ".join(self.onnx_nodes[:8]) + (f" and {len(self.onnx_nodes) - 8} more" if len(self.onnx_nodes) > 8 else "")
            lines.append(f"  lowered to {shown}")
        if self.own is not None:
            lines.append(f"  own error (same inputs as ONNX Runtime): {_stats_line(self.own)}")
        if self.error is not None:
            lines.append(f"  error against eager: {_stats_line(self.error)}")
        if self.eager_inputs:
            lines.append(f"  (inputs taken from eager, their compiled values unknown: {', '.join(self.eager_inputs)})")
        return "\n".join(lines)


def _stats_line(s: ErrorStats) -> str:
    if s.mismatch:
        return s.mismatch
    text = f"max |diff| {s.max_abs:.3g}, max rel {s.max_rel:.3g}, {100 * s.beyond:.3g}% beyond tolerance"
    if s.nan_mismatch or s.inf_mismatch:
        text += f", NaN mismatches {s.nan_mismatch}, inf mismatches {s.inf_mismatch}"
    return text


@dataclasses.dataclass
class GraphParity:
    """One compiled graph (a whole forward or backward graph, or one partition of a split one)."""

    name: str
    kind: str
    whole: str  # the graph it is a partition of, or its own name
    order: int  # when its graph ran first in the compiled step
    onnx_node_count: int
    fx_node_count: int  # call nodes lowered into this model
    nodes: list[NodeParity]  # those with an ONNX value, in graph order
    unobserved: int  # lowered nodes without a value of their own in the model (folded, renamed by cleanup)
    in_torch: list[str] = dataclasses.field(default_factory=list)  # nodes of the whole graph run in PyTorch
    note: str = ""
    reproducer: Reproducer | None = dataclasses.field(default=None, repr=False)  # of the first divergent node

    @property
    def first_divergence(self) -> NodeParity | None:
        return next((n for n in self.nodes if n.divergent), None)

    def to_dict(self) -> dict[str, Any]:
        first = self.first_divergence
        return {
            "name": self.name, "kind": self.kind, "whole": self.whole, "onnx_node_count": self.onnx_node_count,
            "fx_node_count": self.fx_node_count, "compared": len(self.nodes), "unobserved": self.unobserved,
            "in_torch": self.in_torch, "note": self.note,
            "first_divergence": first.fx_name if first else None,
            "nodes": [n.to_dict() for n in self.nodes],
        }


def target_name(target: Any) -> str:
    """``aten.gelu.default`` for an OpOverload; the qualified name of anything else called."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    return value


def interpret(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> dict[str, Any]:
    """Every node's value with PyTorch's kernels, from ``inputs`` (copied first: a graph may mutate its inputs)."""
    env: dict[str, Any] = {}
    it = iter(_detached(list(inputs)))
    with torch.no_grad():
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node.name] = next(it)
            elif node.op == "get_attr":
                env[node.name] = operator.attrgetter(node.target)(gm)
            elif node.op == "call_function":
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name])
                env[node.name] = node.target(*args, **kwargs)
            elif node.op == "call_module":
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name])
                env[node.name] = gm.get_submodule(node.target)(*args, **kwargs)
    return env


# ----------------------------------------------------------------------------------------------------------
# The ONNX side: one run with every FX-named value as an output


@dataclasses.dataclass
class OnnxRun:
    """An ONNX model and the values of its run with every intermediate exposed."""

    name: str
    model: onnx.ModelProto
    values: dict[str, torch.Tensor]  # ONNX value name -> value (its inputs, the exposed values, its outputs)
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)  # FX name -> ONNX name, where they differ
    order: int = 0

    def __post_init__(self) -> None:
        self.lowered: dict[str, list[str]] = {}  # FX node name -> the ONNX nodes lowered from it (provenance)
        self.last: dict[str, str] = {}  # FX node name -> the first output of the last ONNX node lowered from it
        for node in self.model.graph.node:
            props = {p.key: p.value for p in node.metadata_props}
            match = _NODE_NAME.match(props.get(_FX_NODE, ""))
            if match:
                self.lowered.setdefault(match.group(1), []).append(f"{node.name} ({node.op_type})")
                if node.output and node.output[0]:
                    self.last[match.group(1)] = node.output[0]


def exposable(gm: torch.fx.GraphModule) -> dict[str, torch.dtype]:
    """The ONNX value names the nodes of ``gm`` lower to, with their dtypes, for tensors ONNX can hand back (no
    complex values, no sequences): ``name`` for a node with one tensor, ``name__i`` for the i-th output of a
    node with several."""
    names = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and not val.is_complex():
            names[node.name] = val.dtype
        elif isinstance(val, (list, tuple)):
            names.update({f"{node.name}__{i}": v.dtype for i, v in enumerate(val)
                          if isinstance(v, torch.Tensor) and not v.is_complex()})
    return names


def run_intermediates(
    model: onnx.ModelProto,
    inputs: Sequence[InputSpec],
    args: Sequence[Any],
    *,
    wanted: Mapping[str, torch.dtype | None],
    name: str,
    kind: GraphKind,
    device: torch.device,
    options: Options,
) -> dict[str, torch.Tensor]:
    """Runs ``model`` once on ``args`` (positional, as ``inputs`` describe them) with every value in
    ``wanted`` that a node of its main graph produces added to its outputs; returns them and the inputs.

    The session is made as the compiled graph's was (an OrtGraph with the same options): where a value an
    ONNX Runtime fusion would have consumed is now an output, that fusion does not happen.
    """
    produced = [out for node in model.graph.node for out in node.output if out and out in wanted]
    outputs = [o.name for o in model.graph.output]
    exposed = list(dict.fromkeys([*outputs, *produced]))
    extended = onnx.ModelProto()
    extended.CopyFrom(model)
    typed = {v.name: v for v in model.graph.value_info}
    for value in exposed[len(outputs):]:
        # Untyped where the model holds no type for the value: ONNX Runtime infers it.
        extended.graph.output.append(typed[value] if value in typed else onnx.ValueInfoProto(name=value))
    signature = GraphSignature(tuple(inputs), tuple(OutputSpec(OutputKind.TENSOR, v) for v in exposed))
    runner = OrtGraph(extended, signature, name=f"{name}_parity", device=device, options=options, kind=kind)
    results = runner(list(args))
    values = {}
    for value, result in zip(exposed, results):
        if result.dtype == torch.uint8 and wanted.get(value) == torch.bool:  # DLPack's bool, untyped output
            result = result.view(torch.bool)
        values[value] = result
    for spec, arg in zip(inputs, args):
        if spec.kind is InputKind.TENSOR:
            values.setdefault(spec.onnx_name, arg)
        elif spec.kind is InputKind.SYMINT:
            values.setdefault(spec.onnx_name, torch.tensor(int(arg), dtype=torch.int64))
    return values


# ----------------------------------------------------------------------------------------------------------
# The comparison


def _is_random(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def _is_uninitialised(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target._schema.name.split("::")[-1] in (
        "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted")


# Ops returning indices of values (-> the position of that output, None for the only one; whether it reduces
# over the dim). Where values tie, ONNX Runtime and PyTorch may pick different positions: both are right.
_aten = torch.ops.aten
_INDEX_OPS = {
    _aten.sort.default: (1, False), _aten.topk.default: (1, False), _aten.argsort.default: (None, False),
    _aten.max.dim: (1, True), _aten.min.dim: (1, True), _aten.argmax.default: (None, True),
    _aten.argmin.default: (None, True), _aten.kthvalue.default: (1, True), _aten.mode.default: (1, True),
    _aten.median.dim: (1, True), _aten.nanmedian.dim: (1, True),
}


def _ties_resolved(node: torch.fx.Node, args: tuple, kwargs: dict, reference: Any, got: Any) -> tuple[Any, bool]:
    """``reference`` with its index output replaced by ``got``'s where the two point at equal values of the
    input (ties ordered differently), and whether that was so."""
    if node.target not in _INDEX_OPS:
        return reference, False
    position, reduces = _INDEX_OPS[node.target]
    ref_idx = reference if position is None else reference[position]
    got_idx = got if position is None else (got[position] if len(got) > position else None)
    if not isinstance(got_idx, torch.Tensor) or not isinstance(ref_idx, torch.Tensor) or torch.equal(ref_idx, got_idx):
        return reference, False
    if ref_idx.shape != got_idx.shape or got_idx.dtype != ref_idx.dtype:
        return reference, False
    bound = torch.fx.operator_schemas.normalize_function(node.target, args, kwargs, normalize_to_only_use_kwargs=True)
    if bound is None:
        return reference, False
    named = bound.kwargs
    x, dim = named.get("self", named.get("input")), named.get("dim", -1)
    if not isinstance(x, torch.Tensor) or got_idx.numel() and (int(got_idx.min()) < 0 or int(got_idx.max()) >= max(x.numel(), 1)):
        return reference, False
    if dim is None:
        picked = [x.reshape(-1)[i.reshape(-1)] for i in (ref_idx, got_idx)]
    else:
        keep = not reduces or named.get("keepdim", False)
        ref_i, got_i = (i if keep or x.dim() == 0 else i.unsqueeze(dim) for i in (ref_idx, got_idx))
        if x.dim() == 0:
            return reference, False
        picked = [torch.gather(x, dim, i) for i in (ref_i, got_i)]
    if not torch.equal(picked[0], picked[1]) and not (picked[0].is_floating_point() and torch.allclose(
            picked[0], picked[1], rtol=0, atol=0, equal_nan=True)):
        return reference, False
    if position is None:
        return got_idx, True
    return tuple(got_idx if i == position else r for i, r in enumerate(reference)), True


def _skipped(node: torch.fx.Node) -> bool:
    """Nodes that are not computations of their own: a getitem of a node's outputs, size arithmetic, asserts."""
    if node.op != "call_function" or node.target is operator.getitem:
        return True
    val = node.meta.get("val")
    return not isinstance(val, (torch.Tensor, list, tuple)) or (
        isinstance(val, (list, tuple)) and not any(isinstance(v, torch.Tensor) for v in val))


def _onnx_names(node: torch.fx.Node, aliases: Mapping[str, str]) -> list[str | None]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [aliases.get(node.name, node.name)]
    if not isinstance(val, (list, tuple)):
        return []
    return [f"{node.name}__{i}" if isinstance(v, torch.Tensor) else None for i, v in enumerate(val)]


def _locate(node: torch.fx.Node, run: OnnxRun) -> list[str | None]:
    """The ONNX name of each tensor the node returns, where the run holds a value of it (else None)."""
    names = _onnx_names(node, run.aliases)
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return [n if n in run.values else None for n in names]
    if names[0] in run.values:
        return names
    # The model's cleanup drops nodes that compute nothing (an Identity for a detach, a transpose of a
    # transpose) and gives their output's name to the value before them: this node's value may live under
    # the name of an alias of it, the output of the last ONNX node lowered from it.
    renamed = run.last.get(node.name)
    value = run.values.get(renamed) if renamed else None
    if value is not None and value.dim() == val.dim() and all(
        not isinstance(d, int) or d == e for d, e in zip(val.shape, value.shape)
    ):
        return [renamed]
    return [None]


def _value_of(node: torch.fx.Node, run: OnnxRun) -> Any:
    """The node's value in the run: a tensor, a list of them (None where missing), or None."""
    names = _locate(node, run)
    if isinstance(node.meta.get("val"), torch.Tensor):
        return run.values[names[0]] if names[0] else None
    values = [run.values[n] if n else None for n in names]
    return values if any(v is not None for v in values) else None


def _pairs(ref: Any, got: Any) -> list[tuple[Any, Any]]:
    if isinstance(got, list):
        ref = list(ref) if isinstance(ref, (list, tuple)) else [ref]
        return [(r, g) for r, g in zip(ref, got) if g is not None]
    return [(ref, got)]


def _compiled_values(gm: torch.fx.GraphModule, inputs: Sequence[Any], runs: Sequence[OnnxRun],
                     lowered: Mapping[str, Mapping[str, list[str]]]) -> dict[str, Any]:
    """The compiled call's value of each FX node that a run holds: the lowered values, and the inputs of
    a partition, named after the nodes of the whole graph they receive (some of those run by PyTorch)."""
    compiled: dict[str, Any] = {}
    for node, value in zip((n for n in gm.graph.nodes if n.op == "placeholder"), inputs):
        compiled[node.name] = value
    for run in runs:
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.name in compiled:
                continue
            value = None
            if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
                value = run.values.get(f"{node.args[0].name}__{node.args[1]}")
            elif node.name in lowered[run.name]:
                value = _value_of(node, run)
            if value is None:
                value = run.values.get(node.name)
            if value is not None:
                compiled[node.name] = value
    return compiled


def analyse(
    gm: torch.fx.GraphModule,
    inputs: Sequence[Any],
    runs: Sequence[OnnxRun],
    *,
    kind: str,
    whole: str,
    rtol: float,
    atol: float,
) -> list[GraphParity]:
    """Compares every FX node of ``gm`` lowered into one of ``runs`` (one run: a whole graph; several: the
    partitions of a split graph), from the graph's ``inputs`` in the compiled call."""
    eager = interpret(gm, inputs)
    lowered = {run.name: run.lowered for run in runs}
    owner: dict[str, OnnxRun] = {}
    for run in runs:
        for fx_name in lowered[run.name]:
            owner.setdefault(fx_name, run)
    compiled = _compiled_values(gm, inputs, runs, lowered)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    results = {
        run.name: GraphParity(run.name, kind, whole, run.order, len(run.model.graph.node), len(lowered[run.name]), [], 0)
        for run in runs
    }
    in_torch = []
    for index, node in enumerate(calls):
        if node.name not in compiled:
            _derive(node, compiled)
        if _skipped(node):
            continue
        run = owner.get(node.name)
        if run is None:
            in_torch.append(f"{node.name} ({target_name(node.target)})")
            continue
        graph = results[run.name]
        got = _value_of(node, run)
        if got is None:
            graph.unobserved += 1
            continue
        example = next(v for v in _as_list(got) if v is not None)  # the value itself: its sizes are known
        entry = NodeParity(
            run.name, kind, index, node.name, target_name(node.target), lowered[run.name][node.name],
            _source(node, run), list(example.shape), str(example.dtype).removeprefix("torch."), None, None, 0.0, False,
            fx_text=node.format_node(),
        )
        graph.nodes.append(entry)
        if _is_random(node.target):
            entry.note = "random op: ONNX Runtime draws other numbers than PyTorch; not compared"
            continue
        if _is_uninitialised(node.target):
            entry.note = "uninitialised memory: not compared"
            continue
        entry.error = ErrorStats.combine([measure(r, g, rtol=rtol, atol=atol) for r, g in _pairs(eager[node.name], got)])
        entry.eager_inputs = [a.name for a in node.all_input_nodes if a.name not in compiled]
        args, kwargs = torch.fx.node.map_arg(
            (node.args, node.kwargs), lambda a: _detached(compiled[a.name] if a.name in compiled else eager[a.name])
        )
        try:
            with torch.no_grad():
                reference = node.target(*args, **kwargs)
        except Exception as e:  # PyTorch refuses the compiled values (a dtype ONNX Runtime changed): reported
            entry.own = ErrorStats.missing(f"PyTorch's kernel failed on the compiled inputs: {type(e).__name__}: {e}")
            entry.divergent = True
            continue
        reference, tied = _ties_resolved(node, args, kwargs, reference, got)
        if tied:
            entry.note = "indices of tied values ordered differently from PyTorch (they point at equal values)"
            eager_args, eager_kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: eager[a.name])
            eager_value, _ = _ties_resolved(node, eager_args, eager_kwargs, eager[node.name], got)
            entry.error = ErrorStats.combine([measure(r, g, rtol=rtol, atol=atol) for r, g in _pairs(eager_value, got)])
        pairs = _pairs(reference, got)
        scale = magnitude([*tree_leaves((args, kwargs)), *(r for r, _ in pairs)])
        entry.slack = slack(example.dtype, scale)
        entry.own = ErrorStats.combine([measure(r, g, rtol=rtol, atol=atol, slack=entry.slack) for r, g in pairs])
        entry.divergent = not entry.own.ok
        if entry.divergent and graph.reproducer is None:
            names = [n for n in _locate(node, run) if n]
            expected = {n: r for n, (r, _) in zip(names, pairs) if isinstance(r, torch.Tensor)}
            graph.reproducer = make_reproducer(run.model, expected, run.values, entry)
    for graph in results.values():
        graph.in_torch = in_torch
    return sorted(results.values(), key=lambda g: g.order)


def _derive(node: torch.fx.Node, compiled: dict[str, Any]) -> None:
    """The compiled call's value of a node the runs hold no value of (a view or a detach the model's cleanup
    folded away, a node PyTorch ran between partitions): the node run by PyTorch on the compiled values of
    its inputs, as the compiled call computed (or, folded, would have computed) it. Left unknown where an
    input is unknown."""
    if any(a.name not in compiled for a in node.all_input_nodes):
        return
    if _is_random(node.target) or _is_uninitialised(node.target):
        return
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: _detached(compiled[a.name]))
    try:
        with torch.no_grad():
            compiled[node.name] = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - only a value for later comparisons; its users then take eager's inputs
        return


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


# Frames of these packages are not the user's: a stack trace recorded outside Dynamo (the artifact's trace)
# ends in torch.nn's modules and in the export's wrapper.
_LIBRARY_DIRS = tuple(str(pathlib.Path(m.__file__).parent) for m in (torch, aot2onnx))
_FRAME = re.compile(r'^File "([^"]+)", line \d+')


def _user_line(stack_trace: str) -> str:
    """The innermost frame of ``stack_trace`` outside torch and aot2onnx, with its code line."""
    line = user_source_line(types.SimpleNamespace(meta={"stack_trace": stack_trace}))
    frame = _FRAME.match(line)
    if frame is None or not frame.group(1).startswith(_LIBRARY_DIRS):
        return line
    lines = [text.strip() for text in stack_trace.strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        frame = _FRAME.match(lines[i])
        if frame is not None and not frame.group(1).startswith(_LIBRARY_DIRS):
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            return f"{lines[i]}: {code}" if code else lines[i]
    return line


def _source(node: torch.fx.Node, run: OnnxRun) -> str:
    """The user's source line of the node: from its stack trace, else from the one its ONNX nodes keep."""
    if node.meta.get("stack_trace"):
        return _user_line(node.meta["stack_trace"])
    for onnx_node in run.model.graph.node:
        props = {p.key: p.value for p in onnx_node.metadata_props}
        match = _NODE_NAME.match(props.get(_FX_NODE, ""))
        if match and match.group(1) == node.name and props.get(_STACK):
            return _user_line(props[_STACK])
    return user_source_line(node)
