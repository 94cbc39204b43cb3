"""Nodes ONNX Runtime has no low-precision kernel for, computed in float32 inside the model.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` the captured graphs compute in bfloat16, and ONNX
Runtime's CPU provider has no bfloat16 kernel for most arithmetic (Add, Mul, Div, MatMul, Gemm, Erf, ...:
onnxruntime 1.32, seen here), so such a model does not load. Before its session is created, every node of
the model that reads or writes bfloat16 (or float16) values is checked against ONNX Runtime, by the node's
exact signature (op, input and output element types, attributes) in a one-node model. A node without a
kernel is given float32 inputs (a Cast of each low-precision input) and computes in float32.

Where its result is rounded back mirrors eager autocast, which runs each ATen op in float32 internally and
rounds its output once. The nodes lowered from one ATen node (a GELU is Div, Erf, Add, Mul, Mul) pass float32
values between themselves unrounded; a value that leaves the ATen node (to another ATen node's nodes, to a
node that has a bfloat16 kernel, or as a graph output) is rounded to its declared low-precision type, and a
float32 node of another ATen node reads it back through a Cast, as eager's next kernel reads the rounded
tensor. The results can still differ from eager's in the last bit of bfloat16 (8 bits of mantissa): a sum
or a product inside one ATen op is accumulated by a different kernel, in a different order.

Models that hold no low-precision value are returned unchanged, and so are nodes that have a kernel.
Only for the CPU provider (the CUDA provider has bfloat16 kernels for what mixed precision uses).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

import onnx
from onnx import TensorProto

__all__ = ["compute_in_float"]

logger = logging.getLogger("aot2onnx")

LOW_PRECISION = frozenset({TensorProto.BFLOAT16, TensorProto.FLOAT16})
_FX_NODE = "pkg.torch.onnx.fx_node"


# Ops whose CPU kernel is registered for low-precision types but refuses some attributes when it runs
# ("BFloat16 data type is not supported with ScatterElements opset 16 when reduction is 'add'": onnxruntime
# 1.32, seen here, for reductions add, mul, max and min, in ScatterND too). A session is not enough to tell:
# these are run, on one-element inputs (indices 0), in the shapes given here.
_RUN_EXAMPLES = {
    "ScatterElements": ([1], [1], [1]),
    "ScatterND": ([1], [1, 1], [1]),
}


# How ONNX Runtime says that it has no kernel for a node's types, or that the op's schema does not admit one
# of them ("Type 'tensor(bfloat16)' of input parameter (x) of operator (Conv) in node () is invalid"). Other
# refusals are not about the element type alone: "Type parameter (T) of Optype (Gemm) bound to different
# types" is a float16 input beside a float32 one, which PyTorch refuses too; casting would hide that.
_NO_KERNEL = re.compile(r"Could not find an implementation|Type 'tensor\((?:bfloat16|float16)\)' of (?:input|output) parameter .* is invalid")


def _session(model: onnx.ModelProto, saved: str | None = None) -> tuple[Any, str | None]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if saved is not None:
        options.optimized_model_filepath = saved
    try:
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]), None
    except Exception as e:  # ORT raises one exception type per status code; the text says which
        return None, str(e)


def _more_casts(model: onnx.ModelProto, optimized_path: str) -> bool:
    """Whether the session's own model of the one-node ``model`` (with float16 values), saved at
    ``optimized_path``, runs the node by casting around it.

    ONNX Runtime's CPU provider has float16 kernels for few ops; for the others, a session inserts Casts to
    float32 and back (InsertCastTransformer), so the session loads. It then drops a Cast to float16 that the
    graph makes followed by one of its own back to float32 as a pair (RemoveDuplicateCastTransformer), so that
    rounding is lost: ``t * x`` for a float32 0-d ``t`` and a float16 ``x``, which ATen rounds ``t`` for,
    multiplied by the unrounded ``t`` (23% of the products off eager's). Such nodes are computed in float32
    here, with this module's explicit Casts, which ONNX Runtime keeps."""
    if not os.path.exists(optimized_path):
        return False
    casts = sum(n.op_type == "Cast" for n in model.graph.node)
    return sum(n.op_type == "Cast" for n in onnx.load(optimized_path).graph.node) > casts


@functools.cache
def _runs(signature: bytes, opset: tuple[tuple[str, int], ...]) -> str:
    """What ONNX Runtime's CPU provider does with the one-node model ``signature`` (a serialized GraphProto):
    ``"runs"`` (a session, and a run where ``_RUN_EXAMPLES`` says how), ``"no kernel"`` for its element
    types, or ``"refused"`` for another reason."""
    import numpy as np

    graph = onnx.GraphProto.FromString(signature)
    node = graph.node[0]
    shapes = _RUN_EXAMPLES.get(node.op_type) if node.domain in ("", "ai.onnx") else None
    if shapes is not None and len(shapes) != len(graph.input):
        shapes = None
    if shapes is not None:
        # The inputs come in as float32 or integers (numpy has no bfloat16) and are cast to their types.
        feeds, casts = {}, []
        for value, shape in zip(graph.input, shapes):
            elem = value.type.tensor_type.elem_type
            if elem in LOW_PRECISION:
                outer = f"{value.name}__in"
                casts.append(onnx.helper.make_node("Cast", [outer], [value.name], to=elem))
                feeds[outer] = np.ones(shape, np.float32)
                value.name = outer
                value.type.tensor_type.elem_type = TensorProto.FLOAT
            else:
                feeds[value.name] = np.zeros(shape, onnx.helper.tensor_dtype_to_np_dtype(elem))
        nodes = [*casts, *graph.node]
        del graph.node[:]
        graph.node.extend(nodes)
    model = onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opset], ir_version=10
    )
    float16 = any(v.type.tensor_type.elem_type == TensorProto.FLOAT16 for v in (*graph.input, *graph.output))
    with tempfile.TemporaryDirectory() as directory:
        optimized_path = os.path.join(directory, "optimized.onnx") if float16 else None
        session, error = _session(model, optimized_path)
        if session is None:
            return "no kernel" if _NO_KERNEL.search(error) else "refused"
        if float16 and _more_casts(model, optimized_path):
            return "no kernel"
    if shapes is not None:
        try:
            session.run(None, feeds)
        except Exception:  # "BFloat16 data type is not supported with ScatterElements ... reduction"
            return "no kernel"
    return "runs"


def _probe(node: onnx.NodeProto, types: dict[str, int], opset: tuple[tuple[str, int], ...], as_float: bool) -> str:
    """Runs ``node`` with its value types, or with float32 for every low-precision one (``as_float``)?"""

    def value(name: str, prefix: str, i: int) -> onnx.ValueInfoProto:
        elem = types[name]
        if as_float and elem in LOW_PRECISION:
            elem = TensorProto.FLOAT
        return onnx.helper.make_tensor_value_info(f"{prefix}{i}", elem, None)

    inputs = [value(n, "i", i) for i, n in enumerate(node.input) if n]
    outputs = [value(n, "o", i) for i, n in enumerate(node.output) if n]
    probe = onnx.NodeProto()
    probe.CopyFrom(node)
    probe.ClearField("metadata_props")
    probe.name = "probe"
    probe.ClearField("input")
    probe.ClearField("output")
    probe.input.extend(f"i{i}" if n else "" for i, n in enumerate(node.input))
    probe.output.extend(f"o{i}" if n else "" for i, n in enumerate(node.output))
    graph = onnx.helper.make_graph([probe], "probe", inputs, outputs)
    return _runs(graph.SerializeToString(deterministic=True), opset)


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    graphs = []
    for attribute in node.attribute:
        if attribute.type == attribute.GRAPH:
            graphs.append(attribute.g)
        elif attribute.type == attribute.GRAPHS:
            graphs.extend(attribute.graphs)
    return graphs


def _value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element types of the model's values, in every subgraph too (ONNX names are unique across scopes)."""
    try:
        typed = onnx.shape_inference.infer_shapes(model)
    except Exception:  # shape inference refuses the model: only the declared types are known
        typed = model
    types: dict[str, int] = {}

    def collect(graph: onnx.GraphProto) -> None:
        for v in (*graph.input, *graph.value_info, *graph.output):
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
                types[v.name] = v.type.tensor_type.elem_type
        types.update({t.name: t.data_type for t in graph.initializer})
        for node in graph.node:
            for subgraph in _subgraphs(node):
                collect(subgraph)

    collect(typed.graph)
    return types


def _has_low_precision(model: onnx.ModelProto) -> bool:
    values = (*model.graph.input, *model.graph.value_info, *model.graph.output)
    if any(v.type.tensor_type.elem_type in LOW_PRECISION for v in values):
        return True
    if any(t.data_type in LOW_PRECISION for t in model.graph.initializer):
        return True
    return any(
        a.name == "to" and a.i in LOW_PRECISION for n in model.graph.node if n.op_type == "Cast" for a in n.attribute
    )


def _cast(source: str, target: str, to: int, like: onnx.NodeProto) -> onnx.NodeProto:
    node = onnx.helper.make_node("Cast", [source], [target], name=f"{target}__cast", to=to)
    node.metadata_props.extend(like.metadata_props)  # provenance: the ATen node this cast serves
    return node


def _captured(node: onnx.NodeProto) -> set[str]:
    """Every value name the subgraphs of ``node`` read (their own values included)."""
    names: set[str] = set()
    for subgraph in _subgraphs(node):
        for inner in subgraph.node:
            names.update(inner.input)
            names.update(_captured(inner))
    return names


def _group(node: onnx.NodeProto) -> str | None:
    return next((p.value for p in node.metadata_props if p.key == _FX_NODE), None)


def _rewrite(
    graph: onnx.GraphProto, types: dict[str, int], opset: tuple[tuple[str, int], ...], fresh: Callable[[str], str]
) -> int:
    """Rewrites ``graph`` (and its nodes' subgraphs) in place; returns how many nodes now compute in float32.
    ``fresh(name)`` makes a value name used nowhere in the model (ONNX names are unique across scopes)."""

    def low(name: str) -> bool:
        return bool(name) and types.get(name) in LOW_PRECISION

    def eligible(node: onnx.NodeProto) -> bool:
        if node.op_type == "Constant" or _subgraphs(node):
            return False
        names = [n for n in (*node.input, *node.output) if n]
        if not any(low(n) for n in names) or not all(n in types for n in names):
            return False
        # No kernel for its types as it is, and one once its low-precision values are float32 (which also
        # says its output types follow its inputs': a dtype attribute would make the float probe fail).
        # Nodes refused for another reason are left as they are, for the session to report.
        return (
            _probe(node, types, opset, as_float=False) == "no kernel"
            and _probe(node, types, opset, as_float=True) == "runs"
        )

    count = sum(_rewrite(subgraph, types, opset, fresh) for node in graph.node for subgraph in _subgraphs(node))
    in_float = {i for i, node in enumerate(graph.node) if eligible(node)}
    if not in_float:
        return count
    consumers: dict[str, list[int]] = {}
    for i, node in enumerate(graph.node):
        for name in (*node.input, *_captured(node)):  # a subgraph (If's branches) reads outer values too
            consumers.setdefault(name, []).append(i)
    graph_outputs = {o.name for o in graph.output}

    unrounded: dict[str, tuple[str, str | None]] = {}  # low-precision value -> its float32 value, its group
    cast_up: dict[str, str] = {}  # low-precision value -> its Cast to float32
    nodes: list[onnx.NodeProto] = []
    for i, node in enumerate(graph.node):
        if i not in in_float:
            nodes.append(node)
            continue
        rewritten = onnx.NodeProto()
        rewritten.CopyFrom(node)
        mine = _group(node)
        for k, name in enumerate(node.input):
            if not low(name):
                continue
            source = unrounded.get(name)
            if source is not None and mine is not None and source[1] == mine:
                rewritten.input[k] = source[0]  # within one ATen node: unrounded, as eager's kernel keeps it
                continue
            if name not in cast_up:
                cast_up[name] = fresh(f"{name}__f32in")
                nodes.append(_cast(name, cast_up[name], TensorProto.FLOAT, node))
            rewritten.input[k] = cast_up[name]
        after = []
        for k, name in enumerate(node.output):
            if not low(name):
                continue
            rewritten.output[k] = fresh(f"{name}__f32")
            unrounded[name] = (rewritten.output[k], mine)
            users = consumers.get(name, [])
            leaves = name in graph_outputs or any(
                u not in in_float or mine is None or _group(graph.node[u]) != mine for u in users
            )
            if leaves:  # rounded where it leaves the ATen node, as eager's kernel rounds its output
                after.append(_cast(rewritten.output[k], name, types[name], node))
        nodes.append(rewritten)
        nodes.extend(after)
    produced = {name for node in nodes for name in node.output}
    del graph.node[:]
    graph.node.extend(nodes)
    # Values that now stay float32 inside their ATen node lose their declared low-precision type.
    kept = [v for v in graph.value_info if v.name in produced]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    return count + len(in_float)


def _names(graph: onnx.GraphProto) -> set[str]:
    names = {v.name for v in (*graph.input, *graph.output, *graph.initializer)}
    for node in graph.node:
        names.update(node.output)
        for subgraph in _subgraphs(node):
            names |= _names(subgraph)
    return names


def compute_in_float(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """``model`` with its low-precision nodes that ONNX Runtime's CPU provider cannot run computed in
    float32, and how many such nodes there were (0: the model itself is returned)."""
    if not _has_low_precision(model):
        return model, 0
    result = onnx.ModelProto()
    result.CopyFrom(model)
    opset = tuple(sorted((o.domain, o.version) for o in model.opset_import))
    taken = _names(model.graph)

    def fresh(name: str) -> str:
        candidate, n = name, 0
        while candidate in taken:
            n += 1
            candidate = f"{name}_{n}"
        taken.add(candidate)
        return candidate

    count = _rewrite(result.graph, _value_types(model), opset, fresh)
    if not count:
        return model, 0
    logger.debug("aot2onnx: %d node(s) of graph %s compute in float32 (no low-precision kernel)", count, model.graph.name)
    return result, count
