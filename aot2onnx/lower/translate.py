"""FX ATen graph -> ONNX model.

The traversal follows PyTorch's ONNX exporter (its private ``_core`` module) and reuses its
argument conversion and onnxscript op recorder, so torch_lib's rules run exactly as they do there. What
differs is what AOTAutograd's graphs need: Python ints (symbolic sizes) as inputs and outputs, ``None``
outputs, inputs returned as outputs, and one report of every unsupported op before anything is built.
"""

from __future__ import annotations

import json
import logging
import operator
from collections.abc import Sequence
from typing import Any

import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import onnx_ir.tensor_adapters
import onnxscript
import torch
import torch.fx
from onnxscript import rewriter
from onnxscript.rewriter.rules import common as rules

from aot2onnx.capture._torch_compat import unset_fake_temporarily
from aot2onnx.errors import LoweringError, UnsupportedOpError, user_source_line
from aot2onnx.lower import _exporter_compat as exporter
from aot2onnx.lower import _onnxscript_compat as onnxscript_compat
from aot2onnx.lower.checks import Check, collecting
from aot2onnx.lower.ops._common import mark_complex
from aot2onnx.lower.ops._control import for_device
from aot2onnx.lower.plan import GraphPlan, NodePlan, build_opset, plan_graph
from aot2onnx.lower.recorder import Recorder
from aot2onnx.lower.registry import Registry, default_registry
from aot2onnx.lower.seeds import seed_random_ops
from aot2onnx.signature import (
    RANDOM_OPS,
    CheckSpec,
    GraphSignature,
    InputKind,
    InputSpec,
    LoweredGraph,
    MutationSpec,
    OutputKind,
    OutputSpec,
)

__all__ = [
    "VALUE_NAMES_KEY",
    "LoweredGraph",
    "RANDOM_OPS",
    "emit",
    "lower_graph",
    "optimize_exactly",
    "user_source_line",
]

logger = logging.getLogger("aot2onnx")

# The model's metadata_props entry mapping the FX values whose ONNX value the cleanup renamed to its name now
# (JSON, ``{"getitem_3": "clone"}``): every other FX value that is still computed keeps its FX name (``node``,
# or ``node__i`` for the i-th output of a node with several). Removing an Identity whose output is a graph
# output gives that output's name to the value before it: batch norm's first output, cloned for an in-place
# activation and saved for the backward, is named ``clone``. Parity debugging reads a node's value by it.
VALUE_NAMES_KEY = "aot2onnx.value_names"


# Warnings from the libraries we build on that describe normal cases for aot2onnx, not problems:
# the exporter warns for every node outside an nn.Module (any torch.compile'd function; the node still gets
# its FX name and stack trace), and onnx_ir for a constant that is also a graph output, and for an empty
# list attribute, which it types as ints (torch_lib's index_put makes Constant(value_ints=[]): ints is right).
_EXPECTED_WARNINGS = {
    exporter.core_logger_name: "nn_module_stack not found",
    "onnx_ir.passes.common.initializer_deduplication": "Skipped deduplication of initializer",
    "onnx_ir._convenience": "Attribute type is ambiguous because it is an empty sequence",
}
for _logger_name, _prefix in _EXPECTED_WARNINGS.items():
    logging.getLogger(_logger_name).addFilter(lambda record, prefix=_prefix: not str(record.msg).startswith(prefix))


def _value_for_placeholder(node: torch.fx.Node, opset: onnxscript.values.Opset) -> ir.Value | None:
    val = node.meta.get("val")
    value = exporter.SymbolicTensor(opset, name=node.name)
    if isinstance(val, torch.Tensor):
        exporter.set_shape_type(value, val, complex_to_float=True)
        if val.is_complex():
            mark_complex(value)
    elif isinstance(val, (int, torch.SymInt)):
        value.dtype = ir.DataType.INT64
        value.shape = ir.Shape([])
    else:
        return None
    return value


def _lower_call(
    model: ir.Model,
    graph: ir.Graph,
    decision: NodePlan,
    values: dict[str, Any],
    opset: onnxscript.values.Opset,
    constant_farm: dict[Any, ir.Value],
) -> None:
    node, rule = decision.node, decision.rule
    if decision.passthrough and isinstance(values[node.args[0].name], list):
        # A rule that returned several values; a rule that returned one ONNX sequence (torch_lib's split
        # is SplitToSequence) goes on to the getitem rule, which emits SequenceAt.
        value = values[node.args[0].name][node.args[1]]
        if value is None:
            raise LoweringError(f"{node.format_node()} reads an output its op did not produce")
        values[node.name] = value
        return

    if rule is None:  # lower_graph() reported the graph's unsupported ops before emitting: a getitem's rule
        raise UnsupportedOpError(f"{node.format_node()}: {decision.reason}")

    def convert(arg: Any) -> Any:
        if isinstance(arg, torch.fx.Node):
            return values[arg.name]
        if isinstance(arg, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
            return arg  # an op passed to a higher-order op (with_effects); the exporter's converter rejects it
        if isinstance(arg, (list, tuple)):
            return [convert(a) for a in arg]
        return exporter.convert_fx_arg_to_onnx_arg(arg, values, {})

    args = [convert(a) for a in node.args]
    kwargs = {k: convert(v) for k, v in node.kwargs.items()}
    if kwargs.get("dtype", 0) is None:
        kwargs["dtype"] = -1  # torch_lib's spelling of "no dtype given"

    tracer = Recorder(opset, constant_farm)
    with onnxscript.evaluator.default_as(tracer):
        try:
            outputs = rule.function(*args, **kwargs)
        except Exception as e:
            raise LoweringError(
                f"the {rule.origin} rule {rule.name} failed on\n    {node.format_node()}\n"
                f"    from {user_source_line(node)}\n    {type(e).__name__}: {e}"
            ) from e
    for identifier, function in tracer.functions.items():
        if identifier not in model.functions:
            if not isinstance(function, ir.Function):
                function = ir.serde.deserialize_function(function.to_function_proto())
            model.functions[identifier] = function

    def own(value: ir.Value) -> ir.Value:
        # A rule may return one of its inputs unchanged (torch_lib's repeat with repeats of 1); naming that
        # value after this node would rename a graph input or initializer, so it gets an Identity.
        if value.producer() is not None:
            return value
        identity = ir.node("Identity", [value])
        tracer.nodes.append(identity)
        return identity.outputs[0]

    def declared(value: ir.Value, meta: Any) -> ir.Value:
        # The FX graph's dtype, where a rule returned another (torch_lib's LayerNormalization keeps a float16 or
        # bfloat16 input's mean and rstd in float32, where ATen's meta function says the input's dtype). Other
        # nodes and the backward graph read the value as FX declares it: a graph output of another dtype
        # failed the backward graph's run. Cast to the declared dtype, as ATen's kernel returns it.
        if not isinstance(meta, torch.Tensor) or meta.dtype.is_complex or value.dtype is None:
            return value
        dtype = onnx_ir.tensor_adapters.from_torch_dtype(meta.dtype)
        if value.dtype == dtype:
            return value
        logger.debug("aot2onnx: the rule for %s returned %s where FX declares %s: cast", node.name, value.dtype, dtype)
        cast = ir.node("Cast", [value], attributes={"to": dtype})
        tracer.nodes.append(cast)
        return cast.outputs[0]

    meta_val = node.meta.get("val")
    if isinstance(outputs, Sequence) and not isinstance(outputs, ir.Value):
        outputs = [None if output is None else own(output) for output in outputs]
        metas = meta_val if isinstance(meta_val, (list, tuple)) else [meta_val] * len(outputs)
        outputs = [None if output is None else declared(output, meta) for output, meta in zip(outputs, metas)]
        for i, (output, meta) in enumerate(zip(outputs, metas)):
            if output is None:
                continue
            _set_shape_type(output, meta)
            output.name = f"{node.name}__{i}"
        values[node.name] = outputs
    elif outputs is None:  # an op that returns nothing (prims._sink_tokens): no value, no node
        if node.users:
            raise LoweringError(f"the {rule.origin} rule {rule.name} returned nothing for {node.format_node()}")
    else:
        outputs = declared(own(outputs), meta_val)
        _set_shape_type(outputs, meta_val)
        outputs.name = node.name
        values[node.name] = outputs
    for ir_node in tracer.nodes:
        exporter.set_node_metadata(node, ir_node)  # the exporter's provenance keys: FX node, stack, scope
    graph.extend(tracer.nodes)


def _set_shape_type(value: ir.Value, meta: Any) -> None:
    """A rule output's type and shape, FX's. A complex tensor is carried as a real one with a last axis of 2,
    which the exporter adds only to a value without a dtype yet: the recorder gives its outputs theirs."""
    if isinstance(meta, torch.Tensor) and meta.dtype.is_complex:
        value.dtype = None
        mark_complex(value)
    exporter.set_shape_type(value, meta, complex_to_float=True)


def _exact_key(arg: Any) -> Any:
    """A Python constant as the key of the bits it becomes: -0.0 apart from 0.0 (they compare equal)."""
    if isinstance(arg, float):
        return float, arg.hex()
    if isinstance(arg, (tuple, list)):
        return tuple(_exact_key(a) for a in arg)
    return type(arg), arg


class _ConstantFarm(dict):
    """The exporter's cache of the Constant nodes it makes for Python scalars in rules, keyed by
    ``(value, dtype)``. Keyed by the Python value, -0.0 finds 0.0's constant (they are equal and hash alike), and
    ``-0.0 * x`` and ``0.0 * x`` in one graph would both get the sign of whichever came first."""

    def get(self, key: Any, default: Any = None) -> Any:
        arg, dtype = key
        return super().get((_exact_key(arg), dtype), default)

    def __setitem__(self, key: Any, value: Any) -> None:
        arg, dtype = key
        super().__setitem__((_exact_key(arg), dtype), value)


def lower_graph(
    gm: torch.fx.GraphModule,
    *,
    name: str,
    opset: int,
    registry: Registry | None = None,
    optimize: bool = True,
    device_type: str = "cpu",
    plan: GraphPlan | None = None,
) -> LoweredGraph:
    """Lowers an FX ATen graph (from AOTAutograd) to an ONNX model and its signature, for a session on
    ``device_type`` (``"cpu"``, or ``"cuda"``, where rules avoid values the host would have to read).

    The graph is decided once (``lower/plan.py``): canonicalized (a copy; ``gm`` is not changed), each node
    dispatched once, then emitted. ``plan``: that decision where the caller made it already (the compile
    backend, which reads it to split the graph); it must be ``gm``'s, for ``registry`` and ``opset``.

    Raises:
        UnsupportedOpError: listing every op of the graph that has no rule, before anything is built.
        LoweringError: when a rule fails on a node, naming the node and its source line.
    """
    if plan is None:
        plan = plan_graph(gm, registry or default_registry(), opset)
    elif plan.opset != opset or (registry is not None and plan.registry is not registry):
        raise ValueError(f"the plan of graph {name!r} was made for another opset or registry")
    if plan.unsupported():
        raise UnsupportedOpError(plan.format_unsupported(name))
    return emit(plan, name=name, optimize=optimize, device_type=device_type)


def emit(plan: GraphPlan, *, name: str, optimize: bool = True, device_type: str = "cpu") -> LoweredGraph:
    """The ONNX model of a plan whose every node has a rule: built at the plan's build opset with the rules it
    chose, cleaned up exactly, and converted to its target opset."""
    gm, opset = plan.gm, plan.opset
    built_at = build_opset(opset)  # torch_lib's rules are written for it
    onnx_opset = onnxscript.values.Opset("", built_at)
    graph = ir.Graph([], [], nodes=[], opset_imports={"": built_at}, name=name)
    model = ir.Model(graph, ir_version=10, producer_name="aot2onnx")
    values: dict[str, Any] = {}
    constant_farm: dict[Any, ir.Value] = _ConstantFarm()
    input_specs: list[InputSpec] = []
    placeholders: list[torch.fx.Node] = []
    output_specs: list[OutputSpec] = []
    written: list[tuple[int, ir.Value]] = []  # (input position, its new value): the graph's copy_ into inputs
    fx_nodes = 0

    with collecting() as rule_checks, for_device(device_type):  # rule_checks: aot2onnx.lower.checks
        for node in gm.graph.nodes:
            try:
                if node.op == "placeholder":
                    placeholders.append(node)
                    value = _value_for_placeholder(node, onnx_opset)
                    if value is None:
                        input_specs.append(InputSpec(InputKind.UNUSED))
                        continue
                    values[node.name] = value
                    graph.inputs.append(value)
                    val = node.meta.get("val")
                    kind = InputKind.TENSOR if isinstance(val, torch.Tensor) else InputKind.SYMINT
                    input_specs.append(InputSpec(kind, node.name, kind is InputKind.TENSOR and val.is_complex()))
                elif node.op == "get_attr":
                    tensor = getattr(gm, node.target)
                    is_complex = isinstance(tensor, torch.Tensor) and tensor.is_complex()
                    if is_complex:  # its bytes as the real pairs the graph computes with
                        tensor = torch.view_as_real(tensor.resolve_conj().resolve_neg())
                    value = ir.Value(name=node.name)
                    value.const_value = exporter.TorchTensor(tensor, name=node.name)
                    exporter.set_shape_type(value, tensor, complex_to_float=True)
                    if is_complex:
                        mark_complex(value)
                    graph.initializers[node.name] = value
                    values[node.name] = value
                elif node.op == "call_function":
                    fx_nodes += 1
                    _lower_call(model, graph, plan[node], values, onnx_opset, constant_farm)
                    if node.target is torch.ops.aten.copy_.default:
                        written.append(_written_input(node, values, placeholders))
                elif node.op == "output":
                    output_specs = _graph_outputs(node, graph, values, placeholders)
                else:
                    raise LoweringError(f"unexpected FX node kind {node.op!r}: {node.format_node()}")
            except (LoweringError, UnsupportedOpError):
                raise
            except Exception as e:
                raise LoweringError(f"could not lower {node.format_node()}\n    from {user_source_line(node)}") from e
    # The inputs' new values are outputs after the returned ones; their names are read back by position once
    # the passes have run (OutputFixPass gives an output that is an input, or a second use of one value, an
    # Identity of its own).
    written_at = _written_outputs(graph, written)
    checked_at = _checked_outputs(graph, rule_checks)

    # Inputs the ONNX graph never reads are not bound at run time.
    used = {v.name for v in graph.inputs if v.uses() or v in graph.outputs}
    input_specs = [
        spec if spec.kind is InputKind.UNUSED or spec.onnx_name in used else InputSpec(InputKind.UNUSED)
        for spec in input_specs
    ]
    for value in list(graph.inputs):
        if value.name not in used:
            graph.inputs.remove(value)

    exporter.add_opset_imports(model)
    seed_random_ops(model)
    # Constants of the graph (get_attr) are real tensors; lowering runs under AOTAutograd's fake mode,
    # which refuses them when the optimizer or the serializer reads their data.
    with unset_fake_temporarily():
        if optimize:
            optimize_exactly(model)
        if opset != built_at:
            # Exact too: onnxscript's converter rewrites only the ops whose signature changed (DFT's axis
            # becomes an input, GridSample's mode names, GroupNormalization's per-group scale repeated per
            # channel) and otherwise changes version numbers; its fallback, ONNX's C++ converter, is for
            # opsets past onnxscript's (25), beyond what Options admits.
            onnxscript.version_converter.convert_version(model, opset, fallback=True)
            if model.opset_imports.get("", built_at) != opset:  # the converter gives up without raising
                raise LoweringError(f"graph {name!r} could not be converted from opset {built_at} to opset {opset}")
        _record_renamed_values(model, {n.name: values[n.name] for n in gm.graph.nodes if n.op == "call_function"
                                       and n.target is not operator.getitem and n.name in values})
        proto = ir.serde.serialize_model(model)
    mutations = tuple(MutationSpec(index, proto.graph.output[position].name) for index, position in written_at)
    checks_ = tuple(CheckSpec(proto.graph.output[position].name, check.api_name, check.is_matrix, check.kind)
                    for position, check in checked_at)
    signature = GraphSignature(tuple(input_specs), tuple(output_specs), mutations, checks_)
    return LoweredGraph(proto, signature, fx_nodes, len(proto.graph.node))


def _record_renamed_values(model: ir.Model, values: dict[str, Any]) -> None:
    """Stores under VALUE_NAMES_KEY the name each FX value's ONNX value has after the passes, where it changed
    and the value is still computed by the graph."""
    graph = model.graph
    live = {id(v) for v in graph.inputs} | {id(v) for node in graph for v in node.outputs}
    renamed: dict[str, str] = {}
    for fx_name, value in values.items():
        named = ([(f"{fx_name}__{i}", v) for i, v in enumerate(value)] if isinstance(value, list)
                 else [(fx_name, value)])
        for name, v in named:
            if isinstance(v, ir.Value) and v.name != name and id(v) in live and v.name:
                renamed[name] = v.name
    if renamed:
        model.metadata_props[VALUE_NAMES_KEY] = json.dumps(renamed, sort_keys=True)


def _written_input(node: torch.fx.Node, values: dict[str, Any], placeholders: list[torch.fx.Node]) -> tuple[int, ir.Value]:
    """``copy_(input, src)``: the input's position and its new value (copy's, in the input's shape and dtype),
    which later nodes read in place of the input, as they read the input's memory in PyTorch."""
    destination = node.args[0]
    if not (isinstance(destination, torch.fx.Node) and destination.op == "placeholder"):
        raise LoweringError(
            f"{node.format_node()} writes into a value that is not an input of the graph; AOTAutograd's graphs "
            f"mutate only their inputs\n    from {user_source_line(node)}"
        )
    value = values[node.name]
    values[destination.name] = value
    return placeholders.index(destination), value


def _written_outputs(graph: ir.Graph, written: list[tuple[int, ir.Value]]) -> list[tuple[int, int]]:
    """Adds each written input's new value as a graph output: (input position, output position)."""
    last: dict[int, ir.Value] = {}
    for index, value in written:
        last[index] = value  # written twice: the second copy_ is the input's value after the graph
    positions = []
    for index, value in last.items():
        if value.producer() is None:  # an input or a constant: ONNX Runtime writes outputs that nodes make
            identity = ir.node("Identity", [value])
            graph.append(identity)
            value = identity.outputs[0]
            value.name = f"written__{index}"
        positions.append((index, len(graph.outputs)))
        graph.outputs.append(value)
    return positions


def _checked_outputs(graph: ir.Graph, checks: list[Check]) -> list[tuple[int, Check]]:
    """Adds each check's value as a graph output after the written inputs': (output position, check)."""
    positions = []
    for check in checks:
        value = check.value
        if value.producer() is None:  # an input or a constant: an output of its own, as for written values
            identity = ir.node("Identity", [value])
            graph.append(identity)
            value = identity.outputs[0]
        positions.append((len(graph.outputs), check))
        graph.outputs.append(value)
    return positions


# ------------------------------------------------------------------------------------------ exact cleanup
#
# A lowered graph is cleaned up by passes that change how it is written, never a number it computes: a
# backend may be slow or refuse, it may not answer differently from eager. onnxscript's optimize_ir does
# not qualify. Its rewrite rules match constants within a tolerance (math.isclose, rel 1e-5, abs 1e-8), so
# x + 1e-8, x - 1e-9 and x * 1.000005 became x (log(p + 1e-8) gave -inf at p = 0); Min/Max/Relu/Clip
# chains become one Clip, which treats NaN and infinities differently; Cast(Cast(x, float32), float16)
# drops the float32 rounding; a ScatterND whose constant indices cover its data became its updates
# whatever its reduction (index_put(..., accumulate=True) returned the updates alone); Split replaces two
# Slices with halves that differ from the Slices' for an odd size. ONNX Runtime folds and fuses the
# arithmetic again with its own kernels when it creates the session, so what is left out here costs no
# run time (the commit that wrote this list counted the nodes after ONNX Runtime's optimizer on the
# benchmark's models).

# Ops folded whatever their dtype: the result is the input's elements moved, copied or selected.
_MOVES_DATA = frozenset({
    "Concat", "Expand", "Flatten", "Gather", "GatherElements", "GatherND", "Identity", "Reshape", "Shape",
    "Size", "Slice", "Squeeze", "Tile", "Transpose", "Trilu", "Unsqueeze", "Where",
})
# Ops folded on integers and booleans (shape arithmetic): integer results are exact in numpy, which the
# folder runs, and in ONNX Runtime alike (ONNX's reference Div truncates in integer arithmetic, as C++ does).
_INTEGER_EXACT = frozenset({
    "Abs", "Add", "And", "Clip", "Div", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Max",
    "Min", "Mul", "Neg", "Not", "Or", "Range", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceSum", "Sign",
    "Sub", "Xor",
})
# Ops folded on float32 and float64: one IEEE operation per element, correctly rounded by numpy and by
# ONNX Runtime's kernels. Transcendental functions (each library has its own approximation), reductions
# and matrix products (summation order) and everything in 16 bits are left to ONNX Runtime's own folding.
_FLOAT_EXACT = frozenset({"Abs", "Add", "Div", "Mul", "Neg", "Sub"})
_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE})
# Cast is exact where the target holds every source value or both sides round to nearest even; a float
# cast to an integer is undefined for NaN and out-of-range values, and 8/16-bit floats are left to ORT.
_CAST_TARGETS = frozenset({
    ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.BOOL, ir.DataType.INT8, ir.DataType.INT16,
    ir.DataType.INT32, ir.DataType.INT64, ir.DataType.UINT8, ir.DataType.UINT16, ir.DataType.UINT32,
    ir.DataType.UINT64,
})


def _folds_exactly(node: ir.Node) -> bool | None:
    """The constant folder's ``should_fold``: ``None`` (fold by its size limits) where the folded value is
    the one ONNX Runtime would compute, ``False`` elsewhere."""
    if node.domain not in ("", "ai.onnx"):
        return False
    dtypes = {v.dtype for v in (*node.inputs, *node.outputs) if v is not None}
    if node.op_type in _MOVES_DATA:
        return None
    if node.op_type == "Cast":
        source, target = node.inputs[0].dtype, ir.DataType(node.attributes.get_int("to"))
        float_to_integer = source is None or (source.is_floating_point() and not target.is_floating_point())
        return None if target in _CAST_TARGETS and not float_to_integer else False
    if all(dtype is not None and (dtype.is_integer() or dtype == ir.DataType.BOOL) for dtype in dtypes):
        return None if node.op_type in _INTEGER_EXACT else False
    if node.op_type in _FLOAT_EXACT and dtypes <= _FLOATS:
        return None
    return False


# Rewrites that only restate data movement: each output holds the same elements, in the same order.
_EXACT_REWRITE_RULES = rewriter.RewriteRuleSet([
    rules.no_op_cast_rule,  # Cast to the input's own dtype
    rules.no_op_expand_rule,  # Expand to the input's own shape
    rules.no_op_transpose_rule,  # Transpose by the identity permutation
    rules.transpose_transpose_rule,  # two Transposes as one (or none)
    rules.reshape_reshape_rule,  # two Reshapes as one
    rules.unsqueeze_unsqueeze_rule,  # two Unsqueezes as one
    rules.squeeze_reshape_1d_rule,  # Reshape(Squeeze(x), [-1]) of a 1-D x is x
    rules.flatten_to_reshape_rule,  # Flatten as the Reshape it is
    rules.collapse_slice_rule,  # a Slice that keeps everything
    rules.collapse_slice2_rule,
    rules.materialize_reshape_shape_rule,  # a Reshape's computed shape as the constant it is
])


class _RemoveUnusedControlFlow(ir.passes.InPlacePass):
    """Removes If and Loop nodes whose outputs nothing reads, with everything their subgraphs read.

    RemoveUnusedNodesPass detaches a removed node's own inputs, not the values its subgraphs read from the
    enclosing graph, which then still look used (a max pool's unread indices kept their slower kernel).
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for graph in (model.graph, *model.functions.values()):
            for node in reversed(list(graph)):
                subgraphs = [g for attr in node.attributes.values()
                             for g in ([attr.as_graph()] if attr.type == ir.AttributeType.GRAPH
                                       else attr.as_graphs() if attr.type == ir.AttributeType.GRAPHS else [])]
                if not subgraphs or any(v.uses() or v.is_graph_output() for v in node.outputs):
                    continue
                for inner in (n for g in subgraphs for n in ir.traversal.RecursiveGraphIterator(g)):
                    inner.resize_inputs(0)
                graph.remove(node, safe=True)
                modified = True
        return ir.passes.PassResult(model, modified)


def optimize_exactly(model: ir.Model) -> None:
    """Cleans up a lowered model in place with passes that never change a value it computes.

    The passes, and why each is exact:

    - inlining: a function call replaced by its body, the same nodes;
    - constant folding restricted by :func:`_folds_exactly`, and the folder's own rules, which only
      restate structure (Shape and Size of a static shape; Cast, CastLike, Reshape and Expand to what the
      input already is; Dropout in inference or with ratio 0; Concat without empty operands; If on a
      constant condition; Identity forwarding);
    - :data:`_EXACT_REWRITE_RULES`, which restate data movement;
    - removal of unused nodes (control flow with what its subgraphs read), functions and opset imports;
    - Constant nodes lifted to initializers (the same tensor), initializers deduplicated by dtype, shape
      and bytes;
    - common subexpression elimination: nodes of the same op, inputs and attributes compute the same value
      (random ops are not merged: each has its own seed, see :func:`seed_random_ops`);
    - output and name fixes: names only.
    """
    fold = onnxscript_compat.FoldConstantsPass(
        shape_inference=True,
        input_size_limit=onnxscript_compat.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
        output_size_limit=onnxscript_compat.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
        should_fold=_folds_exactly,
    )
    passes = ir.passes.Sequential(
        common_passes.InlinePass(),
        ir.passes.PassManager(
            [
                # Before the rewrite rules too: a rule that leaves its matched nodes behind
                # (squeeze_reshape_1d) makes the rewriter sweep unused nodes itself.
                _RemoveUnusedControlFlow(),
                fold,
                rewriter.RewritePass(_EXACT_REWRITE_RULES),
                _RemoveUnusedControlFlow(),
                common_passes.RemoveUnusedNodesPass(),
                common_passes.RemoveUnusedFunctionsPass(),
                common_passes.RemoveUnusedOpsetsPass(),
            ],
            steps=2,
            early_stop=True,
        ),
        common_passes.RemoveUnusedNodesPass(),
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common_passes.LiftSubgraphInitializersToMainGraphPass(),
        common_passes.DeduplicateInitializersPass(),
        common_passes.CommonSubexpressionEliminationPass(),
        common_passes.OutputFixPass(),
        common_passes.NameFixPass(),
    )
    passes(model)


def _graph_outputs(
    node: torch.fx.Node, graph: ir.Graph, values: dict[str, Any], placeholders: list[torch.fx.Node]
) -> list[OutputSpec]:
    specs: list[OutputSpec] = []
    seen: dict[int, int] = {}  # id(ir.Value) -> output position
    returned = node.args[0] if isinstance(node.args[0], (list, tuple)) else (node.args[0],)
    for position, arg in enumerate(returned):
        if not isinstance(arg, torch.fx.Node):
            specs.append(OutputSpec(OutputKind.CONSTANT, value=arg))
            continue
        if arg.op == "placeholder":
            specs.append(OutputSpec(OutputKind.INPUT, index=placeholders.index(arg)))
            continue
        value = values[arg.name]
        if id(value) in seen:
            specs.append(OutputSpec(OutputKind.DUPLICATE, index=seen[id(value)]))
            continue
        seen[id(value)] = position
        if value in graph.inputs:
            # A value that is an input under another name (e.g. getitem of an alias): pass it through.
            specs.append(OutputSpec(OutputKind.INPUT, index=[p.name for p in placeholders].index(value.name)))
            continue
        if value.const_value is not None and value.producer() is None:
            # ONNX Runtime will not return an initializer as an output: add an Identity.
            ident = ir.node("Identity", [value])
            graph.append(ident)
            value = ident.outputs[0]
            value.name = f"{arg.name}__out"
        val = arg.meta.get("val")
        is_symint = not isinstance(val, torch.Tensor)
        graph.outputs.append(value)
        specs.append(OutputSpec(OutputKind.SYMINT if is_symint else OutputKind.TENSOR, onnx_name=value.name,
                                is_complex=not is_symint and val.is_complex()))
    return specs
