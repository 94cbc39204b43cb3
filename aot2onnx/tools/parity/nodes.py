"""Node by node: every intermediate value of a lowered graph against the FX node it was lowered from.

For one FX graph (a forward or backward graph, whole; the fallback may have split it into several ONNX
models) and the inputs one compiled call received:

- eager: the FX graph is interpreted with PyTorch's kernels, node after node, from those inputs;
- compiled: each ONNX model runs once more with every value named after an FX node added to its outputs
  (one session and one run per model), from the inputs that model received in the compiled call;
- each FX node's ONNX value is compared with eager's value of the node (the error along the graph, which
  carries what came before it), and with the node itself run by PyTorch on the compiled values of its
  inputs: the node's own error. A node whose own error is beyond tolerance is divergent; one that only
  carries an upstream error is not, since its inputs are the compiled ones. Its tolerance is relative to its
  own values and to the rounding it makes on these inputs (own_error), not to the model's outputs;
- a node whose reference PyTorch cannot compute is "not compared", with the reason.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import pathlib
import re
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import onnx
import torch
import torch.fx

import aot2onnx
from aot2onnx.capture._torch_compat import tree_leaves
from aot2onnx.lower.translate import VALUE_NAMES_KEY, user_source_line
from aot2onnx.options import Options
from aot2onnx.runtime.session import OrtGraph
from aot2onnx.signature import GraphKind, GraphSignature, InputKind, InputSpec, OutputKind, OutputSpec
from aot2onnx.tools.parity.errors import NOISE_FACTOR, ErrorStats, magnitude, measure, slack
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
    onnx_values: list[str | None] = dataclasses.field(default_factory=list)  # per output, None where not held
    output_dtypes: list[str | None] = dataclasses.field(default_factory=list)  # per output, where held

    @property
    def compared(self) -> bool:
        """Whether its own error was measured (else ``note`` says why not)."""
        return self.own is not None

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
        if self.note:
            lines.append(f"  {self.note}")
        return "\n".join(lines)


def _stats_line(s: ErrorStats) -> str:
    if s.mismatch:
        return s.mismatch
    text = (f"worst element |diff| {s.against_tolerance()} (its tolerance), max |diff| {s.max_abs:.3g}, "
            f"{100 * s.beyond:.3g}% of elements beyond tolerance")
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
    step: int = 1  # the training step of compare(..., steps=N) whose call of the graph this is
    reproducer: Reproducer | None = dataclasses.field(default=None, repr=False)  # of the first divergent node

    @property
    def first_divergence(self) -> NodeParity | None:
        return next((n for n in self.nodes if n.divergent), None)

    def to_dict(self) -> dict[str, Any]:
        first = self.first_divergence
        return {
            "name": self.name, "kind": self.kind, "step": self.step, "whole": self.whole,
            "onnx_node_count": self.onnx_node_count,
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


def interpret(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Every node's value with PyTorch's kernels, from ``inputs`` (copied first: a graph may mutate its
    inputs), and for each node without one (its kernel failed, or an input of it has none) why."""
    env: dict[str, Any] = {}
    failures: dict[str, str] = {}
    it = iter(_detached(list(inputs)))
    with torch.no_grad():
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node.name] = next(it)
            elif node.op == "get_attr":
                env[node.name] = operator.attrgetter(node.target)(gm)
            elif node.op in ("call_function", "call_module"):
                missing = [a.name for a in node.all_input_nodes if a.name not in env]
                if missing:
                    failures[node.name] = failures.get(missing[0], f"{missing[0]} has no value")
                    continue
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name])
                call = node.target if node.op == "call_function" else gm.get_submodule(node.target)
                try:
                    env[node.name] = call(*args, **kwargs)
                except Exception as e:  # noqa: BLE001 - its users are then not compared, saying why
                    failures[node.name] = f"PyTorch's kernel of {node.name} failed: {type(e).__name__}: {e}"
    return env, failures


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
        # The lowering records the FX values its cleanup renamed (lower.translate.VALUE_NAMES_KEY); a model
        # without the entry (an artifact exported by an older version) leaves them to a guess (_locate).
        recorded = next((p.value for p in self.model.metadata_props if p.key == VALUE_NAMES_KEY), None)
        self.provenance = recorded is not None
        self.renamed: dict[str, str] = json.loads(recorded) if recorded else {}

    def onnx_name(self, fx_value: str) -> str:
        """The ONNX name of an FX value: ``node`` or, for the i-th output of a node with several, ``node__i``;
        renamed by the lowering's cleanup, then by whoever named the model's values after it (``aliases``)."""
        name = self.renamed.get(fx_value, fx_value)
        return self.aliases.get(name, name)


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


def _is_random(node: torch.fx.Node) -> bool:
    """Whether the node draws random numbers: an op tagged so, unless its dropout probability is 0 (attention
    kernels are tagged for their dropout)."""
    target = node.target
    if not (isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags):
        return False
    named = torch.fx.operator_schemas.normalize_function(target, node.args, node.kwargs,
                                                         normalize_to_only_use_kwargs=True)
    p = named.kwargs.get("dropout_p") if named is not None else None
    return not (isinstance(p, (int, float)) and p == 0)


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


def _fx_values(node: torch.fx.Node) -> list[str | None]:
    """The FX value names of the tensors ``node`` returns: ``[node]`` for one tensor; ``node__i`` for the i-th
    of several (None for an output that is not a tensor)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [node.name]
    if not isinstance(val, (list, tuple)):
        return []
    return [f"{node.name}__{i}" if isinstance(v, torch.Tensor) else None for i, v in enumerate(val)]


def _locate(node: torch.fx.Node, run: OnnxRun) -> list[str | None]:
    """The ONNX name of each tensor the node returns, where the run holds a value of it (else None)."""
    names = [None if v is None else run.onnx_name(v) for v in _fx_values(node)]
    found = [n if n is not None and n in run.values else None for n in names]
    val = node.meta.get("val")
    if run.provenance or not isinstance(val, torch.Tensor) or found[0] is not None:
        return found
    # A model without the lowering's record of renamed values: the cleanup drops nodes that compute nothing
    # (an Identity for a detach, a transpose of a transpose) and gives their output's name to the value before
    # them, so this node's value may live under the name of the output of the last ONNX node lowered from it.
    renamed = run.last.get(node.name)
    value = run.values.get(renamed) if renamed else None
    if value is not None and value.dim() == val.dim() and all(
        not isinstance(d, int) or d == e for d, e in zip(val.shape, value.shape)
    ):
        return [renamed]
    return [None]


def _value_of(node: torch.fx.Node, run: OnnxRun) -> Any:
    """The node's value in the run: a tensor; for a node with several outputs a tuple with None for each
    output the run holds no value of (an unused output the cleanup removed); None where it holds none."""
    names = _locate(node, run)
    if isinstance(node.meta.get("val"), torch.Tensor):
        return run.values[names[0]] if names[0] else None
    values = tuple(run.values[n] if n else None for n in names)
    return values if any(v is not None for v in values) else None


def _pairs(ref: Any, got: Any) -> list[tuple[int, Any, Any]]:
    """(output position, reference, value) for each output the run holds."""
    if isinstance(got, tuple):
        ref = list(ref) if isinstance(ref, (list, tuple)) else [ref]
        return [(i, r, g) for i, (r, g) in enumerate(zip(ref, got)) if g is not None]
    return [(0, ref, got)]


def _compiled_values(gm: torch.fx.GraphModule, inputs: Sequence[Any], runs: Sequence[OnnxRun],
                     lowered: Mapping[str, Mapping[str, list[str]]]) -> dict[str, Any]:
    """The compiled call's value of each FX node that a run holds: the lowered values, and the inputs of
    a partition, named after the nodes of the whole graph they receive (some of those run by PyTorch).
    A node with several outputs has a tuple, None for an output no run holds."""
    compiled: dict[str, Any] = {}
    for node, value in zip((n for n in gm.graph.nodes if n.op == "placeholder"), inputs):
        compiled[node.name] = value
    for run in runs:
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.name in compiled:
                continue
            value = None
            if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
                value = run.values.get(run.onnx_name(f"{node.args[0].name}__{node.args[1]}"))
            elif node.name in lowered[run.name]:
                value = _value_of(node, run)
            if value is None:  # a partition's input, named after the node of the whole graph it receives
                value = run.values.get(node.name)
            if value is not None:
                compiled[node.name] = value
    return compiled


Arguments = Callable[[torch.dtype, "torch.Generator | None"], tuple[tuple, dict]]
_RECOMPUTED_DEPTH = 32  # how far back a recomputed input is computed again (chains of folded views are short)


def _moved(value: Any, precise: Any, generator: torch.Generator) -> Any:
    """``precise`` (``value`` at a higher precision) with each floating-point element moved by one unit of
    ``value``'s precision, up or down at random: what rounding does to a value."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
        sign = torch.randint(0, 2, value.shape, generator=generator).to(precise.dtype) * 2 - 1
        return precise * (1 + sign * torch.finfo(value.dtype).eps)
    if isinstance(value, (list, tuple)):
        return type(value)(_moved(v, p, generator) for v, p in zip(value, precise))
    return precise


def _upcast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64:
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_upcast(v, dtype) for v in value)
    return value


def _largest_difference(a: Any, b: Any) -> float:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.is_floating_point() and b.is_floating_point() and a.numel()):
        return 0.0
    diff = (a.detach().to(torch.float64) - b.detach().to(torch.float64)).abs()
    diff = diff[torch.isfinite(diff)]
    return float(diff.max()) if diff.numel() else 0.0


def _rounding_scale(target: Any, arguments: Arguments, pairs: list[tuple[int, Any, Any]]) -> tuple[list[float], list[float]] | None:
    """How much rounding moves the node's outputs, per output: PyTorch's own rounding error (its kernel at the
    node's precision, float32 for a 16-bit result, against the same kernel in float64 on the same inputs), and
    the node's conditioning (how far its float64 result moves when every input element moves by one ulp of its
    dtype, the largest of two draws: a correct kernel's rounding inside a sum or a product of matrices is as an
    error of that size in its inputs). None where the kernel has no float64 version."""
    try:
        with torch.no_grad():
            args, kwargs = arguments(torch.float64, None)
            exact = _as_tuple(target(*args, **kwargs))
            low = any(r.dtype in (torch.float16, torch.bfloat16) for _, r, _ in pairs if isinstance(r, torch.Tensor))
            near = None
            if low:
                args, kwargs = arguments(torch.float32, None)
                near = _as_tuple(target(*args, **kwargs))
            generator = torch.Generator().manual_seed(0)
            moved = []
            for _ in range(2):
                args, kwargs = arguments(torch.float64, generator)
                moved.append(_as_tuple(target(*args, **kwargs)))
    except Exception:  # noqa: BLE001 - no float64 kernel: the caller says so and widens the tolerance otherwise
        return None
    noise, conditioning = [], []
    for i, ref, _ in pairs:
        hi = exact[i] if len(exact) > i else None
        noise.append(_largest_difference(near[i] if near is not None and len(near) > i else ref, hi))
        conditioning.append(max(_largest_difference(m[i], hi) if len(m) > i else 0.0 for m in moved))
    return noise, conditioning


def own_error(target: Any, inputs: tuple[tuple, dict], arguments: Arguments, pairs: list[tuple[int, Any, Any]], *,
              rtol: float) -> tuple[ErrorStats, float, str]:
    """A node's own error: its ONNX value against its kernel run by PyTorch on the same inputs (``inputs``:
    args and kwargs; ``pairs``: position, reference and value per output; ``arguments(dtype, generator)`` the
    node's inputs at another precision, moved by an ulp where a generator is given), the largest slack used,
    and a note where the tolerance had to be chosen otherwise than usual.

    An element is beyond where ``|value - reference| > rtol * |reference| + slack``. The slack is SLACK_ULPS
    ulps of the output's largest magnitude, or where that is not enough, NOISE_FACTOR times what rounding
    makes of this node on these inputs: PyTorch's own rounding error, or the move of its result when its inputs
    move by one ulp, the larger (errors.py says why). The user's atol is not used: it is in the units of the
    model's outputs, and a backward node's values (gradients of a mean loss) are often far below it, so that a
    rule 0.3% off hid under it.
    """
    def measured(slacks: Sequence[float]) -> ErrorStats:
        return ErrorStats.combine([measure(r, g, rtol=rtol, atol=0.0, slack=w) for (_, r, g), w in zip(pairs, slacks)])

    slacks = [slack(r.dtype, magnitude([r])) if isinstance(r, torch.Tensor) else 0.0 for _, r, _ in pairs]
    stats = measured(slacks)
    if stats.ok or stats.mismatch or not any(isinstance(r, torch.Tensor) and r.is_floating_point() for _, r, _ in pairs):
        return stats, max(slacks, default=0.0), ""
    scales = _rounding_scale(target, arguments, pairs)
    if scales is None:
        # Without PyTorch's own rounding to go by: the largest magnitude among the inputs and outputs, which a
        # sum whose terms cancel rounds at (and which may hide a fault in a node of small values).
        scale = magnitude([*tree_leaves(inputs), *(r for _, r, _ in pairs)])
        slacks = [max(w, slack(r.dtype, scale)) if isinstance(r, torch.Tensor) else 0.0
                  for (_, r, _), w in zip(pairs, slacks)]
        return measured(slacks), max(slacks, default=0.0), ("PyTorch's kernel has no float64 version here: the own "
                                                            "tolerance is scaled to the inputs' magnitude")
    noise, conditioning = scales
    slacks = [max(w, NOISE_FACTOR * max(n, c)) for w, n, c in zip(slacks, noise, conditioning)]
    return measured(slacks), max(slacks, default=0.0), ""


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
    eager, eager_failures = interpret(gm, inputs)
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
    recomputed: dict[str, torch.fx.Node] = {}  # nodes the runs hold no value of, run by PyTorch (_derive)

    def arguments(node: torch.fx.Node) -> Arguments:
        """The node's inputs at another precision; a value PyTorch recomputed (_derive) is computed again from
        the values it came from, up to _RECOMPUTED_DEPTH nodes back, at that precision. Every value read from
        a run (or eager's) is moved by an ulp of its own dtype where a generator is given."""
        def at(dtype: torch.dtype, generator: torch.Generator | None) -> tuple[tuple, dict]:
            memo: dict[str, Any] = {}

            def value(a: torch.fx.Node, depth: int = 0) -> Any:
                if a.name not in memo:
                    source = recomputed.get(a.name)
                    if source is not None and depth < _RECOMPUTED_DEPTH:
                        args, kwargs = torch.fx.node.map_arg((source.args, source.kwargs),
                                                             lambda b: value(b, depth + 1))
                        memo[a.name] = source.target(*args, **kwargs)
                    else:
                        known = compiled[a.name] if a.name in compiled else eager[a.name]
                        precise = _upcast(_detached(known), dtype)
                        memo[a.name] = precise if generator is None else _moved(known, precise, generator)
                return memo[a.name]

            return torch.fx.node.map_arg((node.args, node.kwargs), value)

        return at

    for index, node in enumerate(calls):
        if node.name not in compiled and _derive(node, compiled):
            recomputed[node.name] = node
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
        example = next(v for v in _as_tuple(got) if v is not None)  # the value itself: its sizes are known
        entry = NodeParity(
            run.name, kind, index, node.name, target_name(node.target), lowered[run.name][node.name],
            _source(node, run), list(example.shape), str(example.dtype).removeprefix("torch."), None, None, 0.0, False,
            fx_text=node.format_node(), onnx_values=_locate(node, run),
            output_dtypes=[None if v is None else str(v.dtype).removeprefix("torch.") for v in _as_tuple(got)],
        )
        graph.nodes.append(entry)
        if _is_random(node):
            entry.note = "random op: ONNX Runtime draws other numbers than PyTorch; not compared"
            continue
        if _is_uninitialised(node.target):
            entry.note = "uninitialised memory: not compared"
            continue
        if node.name in eager:
            entry.error = ErrorStats.combine([measure(r, g, rtol=rtol, atol=atol) for _, r, g in _pairs(eager[node.name], got)])
        entry.eager_inputs = [a.name for a in node.all_input_nodes if a.name not in compiled]
        unknown = [a.name for a in node.all_input_nodes if a.name not in compiled and a.name not in eager]
        if unknown:
            entry.note = (f"not compared, because the value of its input(s) {', '.join(unknown)} is unknown on both "
                          f"sides ({eager_failures.get(unknown[0], 'PyTorch could not compute it')})")
            continue
        args, kwargs = torch.fx.node.map_arg(
            (node.args, node.kwargs), lambda a: _detached(compiled[a.name] if a.name in compiled else eager[a.name])
        )
        try:
            with torch.no_grad():
                reference = node.target(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - said in the report; the node's ONNX value is not blamed for it
            # The compiled values are ones PyTorch cannot take (a dtype ONNX Runtime changed: then the node that
            # produced it is the divergent one), or the kernel cannot run again (a custom op's): nothing to
            # compare with, which is not a fault of this node.
            entry.note = f"not compared, because PyTorch's kernel failed on the compiled inputs: {type(e).__name__}: {e}"
            continue
        reference, tied = _ties_resolved(node, args, kwargs, reference, got)
        if tied:
            entry.note = "indices of tied values ordered differently from PyTorch (they point at equal values)"
            if node.name in eager:
                eager_args, eager_kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: eager.get(a.name))
                eager_value, _ = _ties_resolved(node, eager_args, eager_kwargs, eager[node.name], got)
                entry.error = ErrorStats.combine([measure(r, g, rtol=rtol, atol=atol)
                                                  for _, r, g in _pairs(eager_value, got)])
        pairs = _pairs(reference, got)
        entry.own, entry.slack, how = own_error(node.target, (args, kwargs), arguments(node), pairs, rtol=rtol)
        if how:
            entry.note = "; ".join(n for n in (entry.note, how) if n)
        entry.divergent = not entry.own.ok
        if entry.divergent and graph.reproducer is None:
            names = [n for n in _locate(node, run) if n]
            expected = {n: r for n, (_, r, _) in zip(names, pairs) if isinstance(r, torch.Tensor)}
            graph.reproducer = make_reproducer(run.model, expected, run.values, entry)
    for graph in results.values():
        graph.in_torch = in_torch
    return sorted(results.values(), key=lambda g: g.order)


def _derive(node: torch.fx.Node, compiled: dict[str, Any]) -> bool:
    """The compiled call's value of a node the runs hold no value of (a view or a detach the model's cleanup
    folded away, a node PyTorch ran between partitions, one output of a node with several): the node run by
    PyTorch on the compiled values of its inputs, as the compiled call computed (or, folded, would have
    computed) it. Left unknown where an input is unknown, or is an output no run holds. Returns whether
    PyTorch computed a value (a getitem of outputs the runs hold is no computation)."""
    if any(a.name not in compiled for a in node.all_input_nodes):
        return False
    if _is_random(node) or _is_uninitialised(node.target):
        return False
    if node.target is operator.getitem and isinstance(compiled[node.args[0].name], tuple):
        value = compiled[node.args[0].name][node.args[1]]
        if value is not None:
            compiled[node.name] = value
        return False
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: _detached(compiled[a.name]))
    try:
        with torch.no_grad():
            compiled[node.name] = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - only a value for later comparisons; its users then take eager's inputs
        return False
    return True


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


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
