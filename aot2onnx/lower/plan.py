"""A graph is decided once: :func:`canonicalize`, then :func:`analyse`, then ``translate.emit``.

PyTorch's ONNX exporter filters its registry to the target opset once and dispatches each node once;
everything after (its report of unsupported ops, the graph it builds) reads that decision. The same here:

- :func:`canonicalize` rewrites a copy of the FX graph into what the rules lower (the caller's graph is left
  as it is): the runtime asserts dropped, the rewrites of :data:`CANONICAL` (one table, keyed by overload),
  then the exporter's type promotion pass;
- :func:`analyse` dispatches each node of that copy once, at the opset the model is built at
  (:data:`aot2onnx.options.BASE_OPSET`; a newer target is reached by converting the built model), and
  records the rule or the reasons every candidate was rejected, and whether the node is complex;
- ``translate.emit`` builds the ONNX model from the plan; the compile backend's fallback partitions from
  the plan's decisions, and the unsupported-op report lists them.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx

from aot2onnx.capture import decomposition_table, lowerable_names
from aot2onnx.errors import user_source_line
from aot2onnx.lower.dispatch import dispatch, is_complex_node, is_passthrough_getitem
from aot2onnx.lower.registry import Registry, Rule
from aot2onnx.options import BASE_OPSET

__all__ = [
    "CANONICAL",
    "GraphPlan",
    "NodePlan",
    "analyse",
    "build_opset",
    "canonicalize",
    "decompositions",
    "lowerable_ops",
    "plan_graph",
]

aten = torch.ops.aten
prims = torch.ops.prims


def build_opset(target_opset: int) -> int:
    """The opset a model for ``target_opset`` is built at: torch_lib's rules are written for
    :data:`~aot2onnx.options.BASE_OPSET`, and the model is converted to the target after it is built. A rule is
    chosen at this opset, whatever the target."""
    if target_opset < BASE_OPSET:
        raise ValueError(f"opset must be >= {BASE_OPSET} (aot2onnx lowers at opset {BASE_OPSET}), got {target_opset}")
    return BASE_OPSET


def lowerable_ops(registry: Registry, opset: int) -> list[str]:
    """The ops ``registry`` has a rule for in a model targeting ``opset`` (chosen at its build opset), by name:
    what AOTAutograd keeps whole instead of decomposing."""
    return lowerable_names(registry, build_opset(opset))


def decompositions(
    registry: Registry,
    opset: int,
    *,
    lowerable: list[str] | None = None,
    kept_when: Mapping[torch._ops.OpOverload, Callable[..., bool]] | None = None,
) -> dict[torch._ops.OpOverload, Callable]:
    """The decomposition table AOTAutograd traces with for graphs lowered by ``registry`` to ``opset``: the one
    answer the compile backend, export, coverage and parity use. ``lowerable``: :func:`lowerable_ops`'s answer
    where the caller kept it (the backend's disk cache); ``kept_when``: ops kept whole in some calls only (the
    fused kernels', ``capture.decomposition_table``)."""
    return decomposition_table(lowerable_ops(registry, opset) if lowerable is None else lowerable, kept_when)


# ------------------------------------------------------------------------------------------ canonicalize


def _float_scalar_bounds(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """``clamp(x, 1e-06, 50)`` with its bounds as floats where the result is a float tensor: the exporter's
    type promotion pass finds no clamp overload for a float and an int bound together, or for an integer
    tensor with a float bound, and failed the compile (torch.optim.Rprop's step; ``ids.clamp(0, 1.5)``).
    A float result is clamped in its own dtype either way; an integer input is converted to it first, as
    ATen's type promotion does."""
    def as_float(a: Any) -> Any:
        return float(a) if isinstance(a, int) and not isinstance(a, bool) else a

    out, x = node.meta.get("val"), getattr(node.args[0], "meta", {}).get("val")
    if not (isinstance(out, torch.Tensor) and out.is_floating_point() and isinstance(x, torch.Tensor)):
        return False
    source = node.args[0]
    if x.dtype != out.dtype:
        with gm.graph.inserting_before(node):
            source = gm.graph.call_function(prims.convert_element_type.default, (source, out.dtype))
        source.meta["val"] = x.to(out.dtype)
    node.args = (source, *map(as_float, node.args[1:]))
    node.kwargs = {k: as_float(v) for k, v in node.kwargs.items()}
    return True


_HALF_FLOATS = (torch.float16, torch.bfloat16)


def _opmath_scalar_operand(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """``x * s`` and ``x / s`` (true, floor or trunc) for a float16 or bfloat16 ``x`` and a scalar ``s`` (a
    Python number or a 0-d tensor of another dtype), computed in float32 with ``s`` as a float32 and rounded
    once, as ATen's CPU kernels do (BinaryOpsKernel.cpp): they take the second operand of a reduced-precision
    mul or div, when it is a scalar, as its original value in float32 (``iter.original_scalar_value<opmath_t>``).
    The type promotion pass would round ``s`` to x's dtype first: ``x * 0.3`` in bfloat16 multiplied by
    0.298828125, and 47% of the products (28% in float16) were an ulp off eager's. ``s * x``, with the scalar
    first, is rounded in ATen too, and so left alone."""
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.dtype not in _HALF_FLOATS or len(node.args) != 2:
        return False
    x, s = node.args
    x_val = getattr(x, "meta", {}).get("val")
    s_val = getattr(s, "meta", {}).get("val") if isinstance(s, torch.fx.Node) else None
    scalar = (isinstance(s, (int, float)) and not isinstance(s, bool)) or (
        isinstance(s_val, torch.Tensor) and s_val.dim() == 0 and s_val.dtype != out.dtype and s_val.dtype != torch.bool)
    if not scalar or not isinstance(x_val, torch.Tensor) or x_val.dtype != out.dtype:
        return False
    with gm.graph.inserting_before(node):
        x32 = gm.graph.call_function(prims.convert_element_type.default, (x, torch.float32))
        x32.meta["val"] = x_val.to(torch.float32)
        if isinstance(s, torch.fx.Node):  # a double or integer 0-d tensor: its value in float32
            s = gm.graph.call_function(prims.convert_element_type.default, (s, torch.float32))
            s.meta["val"] = s_val.to(torch.float32)
        else:
            s = float(s)
        computed = gm.graph.call_function(node.target, (x32, s), dict(node.kwargs))
        computed.meta["val"] = out.to(torch.float32)
        rounded = gm.graph.call_function(prims.convert_element_type.default, (computed, out.dtype))
        rounded.meta["val"] = out
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack", "original_aten"):
        if key in node.meta:
            for new in (x32, computed, rounded):
                new.meta[key] = node.meta[key]
    node.replace_all_uses_with(rounded)
    gm.graph.erase_node(node)
    return True


_ZEROS = {aten.new_zeros.default: None, aten.zeros.default: None, aten.zeros_like.default: None,
          aten.full.default: 1, aten.new_full.default: 2}  # and the position of the fill value


def _is_zeros(node: Any) -> bool:
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target not in _ZEROS:
        return False
    fill = _ZEROS[node.target]
    return fill is None or (len(node.args) > fill and node.args[fill] == 0)


def _select_scatter_slot(node: Any, val: torch.Tensor) -> tuple[torch.fx.Node, int, int] | None:
    """(source, dim, index) of ``select_scatter(zeros, source, dim, index)`` of ``val``'s shape and dtype."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and node.target is aten.select_scatter.default and len(node.users) == 1):
        return None
    base, source, dim, index = node.args
    out = node.meta.get("val")
    if not (_is_zeros(base) and isinstance(out, torch.Tensor) and out.shape == val.shape and out.dtype == val.dtype
            and isinstance(dim, int) and isinstance(index, int) and isinstance(source, torch.fx.Node)):
        return None
    size = out.shape[dim % out.dim()]
    if not isinstance(size, int):
        return None
    return source, dim % out.dim(), index % size


def _stacked_select_scatters(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """A sum of ``select_scatter(zeros, g_i, dim, i)`` that fills every index of ``dim`` once, as
    ``stack([g_0, g_1, ...], dim) + 0``: the gradient of a tensor whose slices were each read once
    (``nn.MultiheadAttention``'s packed in-projection reads ``proj[0]``, ``proj[1]``, ``proj[2]``; the backward
    graph adds three zero tensors with one slice set each). The same values bit for bit: each slice is its
    gradient plus zeros, which turns -0.0 into 0.0 and nothing else, hence the ``+ 0``. Three full-size
    tensors written and two added become one stack and one addition (the transformer layer's backward: three
    Concats and two Adds of [3, 64, 8, 128]). Floating tensors only; the sum is rewritten at its last addition."""
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.is_complex() or out.dim() == 0:
        return False
    if node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
        return False
    if any(u.op == "call_function" and u.target is aten.add.Tensor for u in node.users) and len(node.users) == 1:
        return False  # an inner addition of the sum: the last one rewrites it whole
    leaves, inner, pending = [], [], list(node.args)
    while pending:
        arg = pending.pop()
        if (isinstance(arg, torch.fx.Node) and arg.op == "call_function" and arg.target is aten.add.Tensor
                and len(arg.users) == 1 and len(arg.args) == 2 and arg.kwargs.get("alpha", 1) == 1):
            inner.append(arg)
            pending.extend(arg.args)
            continue
        leaves.append(arg)
    slots = [_select_scatter_slot(leaf, out) for leaf in leaves]
    if any(slot is None for slot in slots):
        return False
    dims = {slot[1] for slot in slots}
    if len(dims) != 1:
        return False
    dim = dims.pop()
    by_index = {slot[2]: slot[0] for slot in slots}
    if sorted(by_index) != list(range(out.shape[dim])) or len(slots) != len(by_index):
        return False
    if any(by_index[i].meta.get("val") is None or by_index[i].meta["val"].dtype != out.dtype for i in by_index):
        return False
    with gm.graph.inserting_before(node):
        stacked = gm.graph.call_function(aten.stack.default, ([by_index[i] for i in range(len(by_index))], dim))
        stacked.meta["val"] = out
        total = gm.graph.call_function(aten.add.Tensor, (stacked, 0.0))
        total.meta["val"] = out
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in node.meta:
            stacked.meta[key] = total.meta[key] = node.meta[key]
    node.replace_all_uses_with(total)
    gm.graph.erase_node(node)
    for dead in [*inner, *leaves]:  # each inner addition after the one that read it, then the select_scatters
        zeros = dead.args[0] if dead.target is aten.select_scatter.default else None
        gm.graph.erase_node(dead)
        if zeros is not None and not zeros.users:
            gm.graph.erase_node(zeros)
    return True


# Rewrites of one node into what the rules lower, by overload (torch-mlir's ``register_canonicalize``). Each
# returns whether it changed the graph; they run before the exporter's type promotion pass.
CANONICAL: dict[torch._ops.OpOverload, Callable[[torch.fx.GraphModule, torch.fx.Node], bool]] = {
    aten.clamp.default: _float_scalar_bounds,
    **dict.fromkeys(
        (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode),
        _opmath_scalar_operand,
    ),
    aten.add.Tensor: _stacked_select_scatters,
}

# Ops the exporter's type promotion pass is kept off (its table is keyed by packet name). The reductions' rules
# compute in double whatever the float dtype (reductions._moments), as ATen does; the pass would cast a 16-bit
# input to float32 and rebuild the node from its packet's default overload: std.correction became an
# std.default that nothing lowers, and std_mean (two outputs) made the pass raise. Both ran in PyTorch. lerp
# takes tensors of one dtype (ATen checks it); the pass made lerp.Scalar's weight a tensor of that dtype, so a
# bfloat16 lerp's weight 0.3 was rounded to 0.30078125 where ATen keeps it in float32 (41% of the results
# off), and lerp.Scalar's rule, which follows ATen's branch on |weight|, was never reached.
OWN_PROMOTION = ("aten.std", "aten.std_mean", "aten.var", "aten.var_mean", "aten.lerp")


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph: nodes and their meta dicts are new (the values in
    them, fake tensors, are shared), names are kept, constants are the same tensors. The subgraphs of
    higher-order ops (GraphModule attributes) are copied too: the passes rewrite every module they find."""
    copied = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    copied.meta = dict(getattr(gm, "meta", {}))
    done: list[str] = []
    for name, module in list(copied.named_modules()):
        if name and isinstance(module, torch.fx.GraphModule) and not any(name.startswith(f"{d}.") for d in done):
            copied.set_submodule(name, _copy(module))
            done.append(name)
    return copied


def canonicalize(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` rewritten for lowering; ``gm`` itself is not changed.

    Runtime asserts on symbolic sizes have nothing to lower and are dropped (the exporter's pass); the nodes
    :data:`CANONICAL` names are rewritten; then aten's implicit type promotion is made explicit (ONNX ops do
    not promote mixed dtypes) by the exporter's pass, except for :data:`OWN_PROMOTION`.
    """
    from aot2onnx.lower import _exporter_compat as exporter  # torch's exporter: imported where a graph is lowered

    gm = _copy(gm)
    exporter.remove_assertion_nodes(gm)
    changed = False
    for node in list(gm.graph.nodes):
        rewrite = CANONICAL.get(node.target) if node.op == "call_function" else None
        if rewrite is not None:
            changed = rewrite(gm, node) or changed
    if changed:
        gm.recompile()
    exporter.insert_type_promotion_nodes_except(gm, OWN_PROMOTION)
    return gm


# ------------------------------------------------------------------------------------------------ analyse


@dataclasses.dataclass(frozen=True)
class NodePlan:
    """The decision for one call_function node: its rule, or ``None`` and why every candidate was rejected."""

    node: torch.fx.Node
    rule: Rule | None
    reason: str  # "" where there is a rule
    is_complex: bool  # a complex tensor argument: dispatched to the complex rules
    complex_output: bool  # a complex tensor result (carried as a real [..., 2] tensor in ONNX)
    passthrough: bool = False  # getitem picking one output of a multi-output op: not an op of its own

    @property
    def source_line(self) -> str:
        return user_source_line(self.node)


@dataclasses.dataclass(frozen=True)
class GraphPlan:
    """A canonicalized graph and the one decision for each of its call_function nodes, by node name."""

    gm: torch.fx.GraphModule
    registry: Registry
    opset: int  # the target; rules are chosen at build_opset(opset)
    nodes: dict[str, NodePlan]

    def __getitem__(self, node: torch.fx.Node) -> NodePlan:
        return self.nodes[node.name]

    def part(self, gm: torch.fx.GraphModule) -> GraphPlan | None:
        """The plan of ``gm``, a graph made of copies of this plan's nodes under their names (a partition of the
        fallback's split, already canonicalized): the same decisions, not made again. ``None`` where a node of
        ``gm`` is not one of this plan's."""
        nodes = {}
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            decision = self.nodes.get(node.name)
            if decision is None or decision.node.target != node.target:
                return None
            nodes[node.name] = dataclasses.replace(decision, node=node)
        return GraphPlan(gm, self.registry, self.opset, nodes)

    def unsupported(self) -> dict[str, list[NodePlan]]:
        """Every op without a usable rule, grouped by target (a pass-through getitem is not an op)."""
        missing: dict[str, list[NodePlan]] = collections.defaultdict(list)
        for decision in self.nodes.values():
            if decision.rule is None and not decision.passthrough:
                missing[str(decision.node.target)].append(decision)
        return dict(missing)

    def format_unsupported(self, graph_name: str) -> str:
        missing = self.unsupported()
        lines = [f"{len(missing)} op(s) in graph {graph_name!r} have no ONNX lowering:"]
        for target, decisions in sorted(missing.items()):
            first = decisions[0]
            lines.append(f"  {target}  ({len(decisions)} node(s); {first.reason})")
            lines.append(f"      e.g. {first.node.format_node()}")
            lines.append(f"      from {first.source_line}")
        if self.opset != build_opset(self.opset):
            lines.append(f"  (models are built at opset {build_opset(self.opset)}, where the rules are chosen, and "
                         f"converted to opset {self.opset})")
        lines.append(
            "Add a lowering with @aot2onnx.register_lowering(<OpOverload>), or report the op so aot2onnx "
            "can cover it."
        )
        return "\n".join(lines)


def _complex_value(val: Any) -> bool:
    if isinstance(val, (list, tuple)):
        return any(_complex_value(v) for v in val)
    return isinstance(val, torch.Tensor) and val.is_complex()


def analyse(gm: torch.fx.GraphModule, registry: Registry, opset: int) -> GraphPlan:
    """Dispatches each call_function node of ``gm`` (canonicalized) once, at the opset the model is built at.

    A getitem that picks one output of a multi-output op lowers to that output; where the op's rule returned
    one ONNX sequence instead (torch_lib's split), it lowers with the getitem rule, looked up once per graph.
    """
    at = build_opset(opset)
    getitem: tuple[Rule | None, str] | None = None
    nodes: dict[str, NodePlan] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        complex_output = _complex_value(node.meta.get("val"))
        if is_passthrough_getitem(node):
            getitem = getitem or registry.lookup(operator.getitem, at)
            rule, reason = getitem
            nodes[node.name] = NodePlan(node, rule, reason, False, complex_output, passthrough=True)
            continue
        rule, reason = dispatch(node, registry, at)
        nodes[node.name] = NodePlan(node, rule, reason, is_complex_node(node), complex_output)
    return GraphPlan(gm, registry, opset, nodes)


def plan_graph(gm: torch.fx.GraphModule, registry: Registry, opset: int) -> GraphPlan:
    """:func:`canonicalize` then :func:`analyse`: the plan ``translate.emit`` builds the model from."""
    return analyse(canonicalize(gm), registry, opset)
