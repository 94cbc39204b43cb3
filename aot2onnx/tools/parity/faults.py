"""Faults planted in lowered graphs, to measure the parity report itself.

A fault is one FX node's ONNX value made wrong: the ONNX value is renamed, and a Mul by a factor (and an Add of
a few ulps of the value's largest magnitude) computes the node's value from it under its old name, with the
node's provenance. Every ONNX node that read the value
reads the wrong one, and the compiled step runs it, as it would run a lowering rule off by that much::

    clean = aot2onnx.parity.compare(model, inputs)
    site = sites(clean)[0]
    with planted([(site, RELATIVE)]) as where:
        report = aot2onnx.parity.compare(model, inputs)
    outcome = score(report, site, RELATIVE, where)   # outcome.named_first: the report named it first

A relative 1e-3 (``RELATIVE``) must be named as the first divergent node of its graph; four float32 ulps of each
element plus four of the output's largest magnitude (``ULPS``: what two correct kernels may differ by, an element
near zero included), must not be blamed at all.

``replanted(report, faults)`` plants faults in the models a report compared (``compare(..., keep_graphs=True)``)
and compares those graphs node by node again, without training again: each graph is judged on the inputs its
calls received, as in the compiled step, which is what the comparison of nodes reads; only the tensors (and a
later graph's inputs, which a fault upstream would have changed) are the clean run's. Many times faster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections import Counter
from collections.abc import Iterator, Sequence

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from aot2onnx.lower import translate
from aot2onnx.lower.plan import build_opset
from aot2onnx.lower.registry import default_registry, fused_registry
from aot2onnx.options import DEFAULT_OPSET
from aot2onnx.runtime import fused
from aot2onnx.tools.parity.errors import ErrorStats
from aot2onnx.tools.parity.nodes import NodeParity
from aot2onnx.tools.parity.report import ParityReport

__all__ = ["RELATIVE", "ULPS", "Fault", "Outcome", "Site", "graph_key", "plant", "planted", "replanted", "score",
           "sites"]


@dataclasses.dataclass(frozen=True)
class Fault:
    """``value * scale + offset_ulps * eps * max|value|`` (eps of the value's dtype)."""

    scale: float
    offset_ulps: float = 0.0
    name: str = ""

    def __str__(self) -> str:
        return self.name or f"x{self.scale!r} + {self.offset_ulps:g} ulps of the largest"


RELATIVE = Fault(1 + 1e-3, 0.0, "relative 1e-3")
ULPS = Fault(1 + 4 * 2.0**-23, 4.0, "4 ulps of each element and of the largest")

_FLOATS = {"float32": np.float32, "float64": np.float64, "float16": np.float16}


@dataclasses.dataclass(frozen=True)
class Site:
    """Where a fault can go: one floating-point output of one compared node."""

    graph: str  # the compiled graph's name without its gNNN_ prefix: "GPT2LMHeadModel_backward"
    occurrence: int  # among the compiled graphs of that name, in the order they were lowered
    kind: str  # forward, backward, inference
    index: int  # the node's position among its graph's call nodes
    fx_name: str
    target: str
    output: int  # which output of the node
    outputs: int  # how many tensor outputs the node has
    value: str  # the output's ONNX value
    dtype: str
    origin: str  # the rule that lowered the node: aot2onnx, torch_lib, user (or "?")

    @property
    def several(self) -> bool:
        return self.outputs > 1

    def describe(self) -> str:
        return (f"{self.kind} {self.fx_name} ({self.target}, output {self.output} of {self.outputs}, "
                f"{self.origin} rule)")


def graph_key(name: str) -> str:
    """A compiled graph's name without the number the backend gives every graph of a process."""
    return re.sub(r"^g\d+_", "", name)


def _overload(target: str) -> torch._ops.OpOverload | None:
    namespace, _, rest = target.partition(".")
    packet, _, overload = rest.rpartition(".")
    try:
        found = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except AttributeError:
        return None
    return found if isinstance(found, torch._ops.OpOverload) else None


def _origin(target: str, opset: int) -> str:
    overload = _overload(target)
    # The compile backend's CPU graphs lower with the fused kernels' rules where they are built.
    registry = fused_registry() if fused.library() is not None else default_registry()
    rule = registry.lookup(overload, build_opset(opset))[0] if overload is not None else None
    return rule.origin if rule is not None else "?"


def sites(report: ParityReport, *, opset: int = DEFAULT_OPSET) -> list[Site]:
    """Every place a fault can go in the graphs ``report`` compared: each floating-point output of a node
    compared and within tolerance, held by an ONNX value no other node of the graph is located at (a value two
    FX nodes share, as a clone's, would make either the right answer)."""
    found: list[Site] = []
    occurrences = _occurrences(report)
    for graph in report.graphs:
        if graph.step != 1:
            continue
        key, occurrence = occurrences[graph.name]
        shared = Counter(v for n in graph.nodes for v in n.onnx_values if v)
        for node in graph.nodes:
            if not node.compared or node.divergent or node.note:
                continue
            outputs = sum(v is not None for v in node.onnx_values)
            for i, (value, dtype) in enumerate(zip(node.onnx_values, node.output_dtypes)):
                if value and shared[value] == 1 and dtype in _FLOATS and not value.startswith(("primals", "tangents")):
                    found.append(Site(key, occurrence, node.kind, node.index, node.fx_name, node.target, i, outputs,
                                      value, dtype, _origin(node.target, opset)))
    return found


def _occurrences(report: ParityReport) -> dict[str, tuple[str, int]]:
    """Each compiled graph's name -> its name without the gNNN_ prefix and its occurrence among graphs of that
    name, in the order they ran."""
    seen: Counter[str] = Counter()
    found: dict[str, tuple[str, int]] = {}
    for graph in sorted(report.graphs, key=lambda g: (g.step, g.order)):
        if graph.name not in found:
            key = graph_key(graph.name)
            found[graph.name] = (key, seen[key])
            seen[key] += 1
    return found


def plant(model: onnx.ModelProto, value: str, fault: Fault, dtype: str = "float32") -> None:
    """Makes ``value`` of ``model`` what ``fault`` makes of what its producer computes (in place)."""
    graph = model.graph
    position, producer = next(((i, n) for i, n in enumerate(graph.node) if value in n.output), (None, None))
    if producer is None:
        raise ValueError(f"no node of {graph.name!r} computes {value!r}")
    hidden = f"{value}__unplanted"
    producer.output[list(producer.output).index(value)] = hidden
    numpy_dtype = _FLOATS[dtype]

    def constant(suffix: str, number: float) -> str:
        tensor = numpy_helper.from_array(np.array(number, dtype=numpy_dtype), name=f"{value}__fault_{suffix}")
        graph.initializer.append(tensor)
        return tensor.name

    nodes = []
    scaled = value if not fault.offset_ulps else f"{value}__scaled"
    nodes.append(helper.make_node("Mul", [hidden, constant("scale", fault.scale)], [scaled], name=f"{value}__fault_Mul"))
    if fault.offset_ulps:
        # Over a scalar, ReduceMax with no axes reduces every axis: the offset is the same for every element.
        nodes += [
            helper.make_node("Abs", [hidden], [f"{value}__abs"], name=f"{value}__fault_Abs"),
            helper.make_node("ReduceMax", [f"{value}__abs"], [f"{value}__largest"], keepdims=0,
                             name=f"{value}__fault_ReduceMax"),
            helper.make_node("Mul", [f"{value}__largest", constant("offset", fault.offset_ulps * np.finfo(numpy_dtype).eps)],
                             [f"{value}__offset"], name=f"{value}__fault_Offset"),
            helper.make_node("Add", [scaled, f"{value}__offset"], [value], name=f"{value}__fault_Add"),
        ]
    for k, node in enumerate(nodes):
        node.metadata_props.extend(producer.metadata_props)  # the node's own provenance: part of its lowering
        graph.node.insert(position + 1 + k, node)


@contextlib.contextmanager
def planted(faults: Sequence[tuple[Site, Fault]]) -> Iterator[dict[Site, str]]:
    """Within the block, every graph lowered whose name and occurrence match a site gets its fault; yields
    site -> the name of the compiled graph it went into."""
    real = translate.lower_graph
    lowered_names: Counter[str] = Counter()
    where: dict[Site, str] = {}

    def lower_graph(gm: torch.fx.GraphModule, *, name: str, **kwargs: object) -> translate.LoweredGraph:
        lowered = real(gm, name=name, **kwargs)
        key = graph_key(name)
        occurrence = lowered_names[key]
        lowered_names[key] += 1
        for site, fault in faults:
            if site.graph == key and site.occurrence == occurrence:
                plant(lowered.model, site.value, fault, site.dtype)
                where[site] = name
        return lowered

    # The backend imports lower_graph from its module at each compilation (compile/backend.py): swapping the
    # module's attribute is seen by the next one.
    translate.lower_graph = lower_graph
    try:
        yield where
    finally:
        translate.lower_graph = real


def replanted(report: ParityReport, faults: Sequence[tuple[Site, Fault]]) -> tuple[ParityReport, dict[Site, str]]:
    """``report`` (of ``compare(..., keep_graphs=True)``) with the graphs that get a fault compared node by node
    again, their models planted; and site -> the graph it went into. Its tensors are the clean run's."""
    if report.recompare is None:
        raise ValueError("replanted needs the report of compare(..., keep_graphs=True)")
    names = {place: name for name, place in _occurrences(report).items()}
    where = {site: names[(site.graph, site.occurrence)] for site, _ in faults if (site.graph, site.occurrence) in names}

    def transform(name: str, model: onnx.ModelProto) -> onnx.ModelProto:
        mine = [(site, fault) for site, fault in faults if where.get(site) == name]
        if not mine:
            return model
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        for site, fault in mine:
            plant(copy, site.value, fault, site.dtype)
        return copy

    graphs = report.recompare(transform, only=set(where.values()))
    return dataclasses.replace(report, graphs=graphs, recompare=None), where


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What the report said about one planted fault."""

    site: Site
    fault: Fault
    named: NodeParity | None  # the first divergent node of the graph the fault went into
    planted_node: NodeParity | None  # the report's entry for the node the fault was planted at
    why: str  # for a miss (or a blamed ulp): what happened

    @property
    def named_first(self) -> bool:
        return self.named is not None and self.named.fx_name == self.site.fx_name

    @property
    def blamed(self) -> bool:
        """Whether anything in the fault's graph was blamed (what an ulp-scale fault must not be)."""
        return self.named is not None

    @property
    def no_effect(self) -> bool:
        """The fault changed nothing the report could see (the value is all zeros)."""
        own = self.planted_node.own if self.planted_node else None
        return own is not None and own.max_abs == 0 and not self.named_first


def score(report: ParityReport, site: Site, fault: Fault, where: dict[Site, str]) -> Outcome:
    if site not in where:
        return Outcome(site, fault, None, None, "not planted: no graph of that name and occurrence was lowered")
    graph = next((g for g in report.graphs if g.name == where[site]), None)
    if graph is None:
        return Outcome(site, fault, None, None, f"graph {where[site]} was not compared")
    named = graph.first_divergence
    node = next((n for n in graph.nodes if n.fx_name == site.fx_name), None)
    if named is not None and named.fx_name == site.fx_name:
        return Outcome(site, fault, named, node, "")
    if node is None:
        why = "the planted node has no value of its own in the report"
    elif not node.compared:
        why = f"the planted node was not compared: {node.note}"
    elif node.own is not None and node.own.max_abs == 0:
        why = "no effect: the planted value is all zeros"
    elif not node.divergent and node.own is not None and node.own.worst_diff * 10 < node.own.worst_tolerance:
        why = (f"the planted value is rounding noise: the fault moved it by {node.own.worst_diff:.3g}, its "
               f"rounding on these inputs allows {node.own.worst_tolerance:.3g}")
    elif not node.divergent:
        why = f"the planted node is within its tolerance: {_stats(node.own)}"
    else:
        why = "the planted node is divergent but not first"
    if named is not None:
        why += f"; {named.fx_name} ({named.target}) named first: {_stats(named.own)}"
    return Outcome(site, fault, named, node, why)


def _stats(stats: ErrorStats | None) -> str:
    if stats is None:
        return "not compared"
    return f"worst |diff| {stats.against_tolerance()}, {100 * stats.beyond:.3g}% of elements beyond"
