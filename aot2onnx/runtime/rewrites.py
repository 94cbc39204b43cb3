"""What ONNX Runtime would compute wrongly in a model, and what aot2onnx does about it: the graph rewrites it
turns off (:func:`disabled_optimizers`) and the nodes that make a session run on one thread
(:func:`serial_nodes`); the one place this is decided.

The compile backend's sessions (runtime/session.py) and ``aot2onnx.load`` ask :func:`disabled_optimizers` of
each model they open. The torch-free trainer (artifact/edge.py) is copied to devices alone and imports nothing
of aot2onnx, so it cannot ask: the exporter asks for it, for each model of the artifact, and records the answer
in the model (metadata ``aot2onnx.ort_disabled_optimizers``, docs/artifact-format.md), which the trainer passes
to ONNX Runtime as it is; likewise :func:`serial_nodes` (``aot2onnx.ort_one_thread_nodes``).
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx
import onnx.numpy_helper

from aot2onnx.signature import FUSED_DOMAIN

__all__ = ["disabled_optimizers", "fused_selects", "model_nodes", "serial_nodes"]


def model_nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    """Every node of ``model``: its graph's, its functions', and those of their subgraphs (If and Loop
    bodies)."""
    graphs: list = [model.graph, *model.functions]
    while graphs:
        graph = graphs.pop()
        for node in graph.node:
            yield node
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    graphs.append(attribute.g)
                graphs.extend(attribute.graphs)


def serial_nodes(model: onnx.ModelProto) -> list[str]:
    """The nodes of ``model`` that ONNX Runtime's CPU provider computes wrongly on more than one thread:
    ScatterND with a reduction, whose kernel splits the updates among the pool's threads, so that two threads
    adding to one index lose one's update when indices repeat (an embedding's or index_add's gradient; measured
    with onnxruntime 1.32 on 2 threads: 2.8 off in a sum of 8192 x 768 updates into 4096 rows, a different
    result from run to run; onnxruntime#18048). A session of such a graph runs on one thread."""
    return [
        node.name or node.output[0] for node in model_nodes(model)
        if node.domain in ("", "ai.onnx") and node.op_type == "ScatterND"
        and any(a.name == "reduction" and a.s not in (b"", b"none") for a in node.attribute)
    ]


def disabled_optimizers(model: onnx.ModelProto) -> list[str]:
    """ONNX Runtime's graph rewrites that would compute a wrong result in ``model``.

    NoopElimination, always: it removes ``Add(x, 0.0)``, which is not a no-op for ``x = -0.0`` (eager's
    ``(-x + 0.0) * 3`` at ``x = 0`` is 0.0; with the Add removed, -0.0). The lowering's own passes remove
    only exact no-ops (lower/translate.py), so nothing is lost.

    ExpandElimination removes an Expand whose constant target sizes are each at most 1 where they differ
    from the input's, taking it for a no-op; but expanding a size-1 dimension to size 0 empties it (the
    gradient of a sum over an empty batch is such an Expand: with it removed, ONNX Runtime 1.32 returns a
    [1, n] gradient for a [0, n] input). Only models with an empty dimension go without the rewrite.
    """
    return ["NoopElimination", *_expand_elimination(model)]


def _expand_elimination(model: onnx.ModelProto) -> list[str]:
    nodes = [*model.graph.node, *(node for function in model.functions for node in function.node)]
    if not any(node.op_type == "Expand" for node in nodes):
        return []
    values = (*model.graph.input, *model.graph.output, *model.graph.value_info)
    if any(
        dim.HasField("dim_value") and dim.dim_value == 0 for value in values for dim in value.type.tensor_type.shape.dim
    ):
        return ["ExpandElimination"]
    constants = {t.name: t for t in model.graph.initializer}
    constants.update(
        {n.output[0]: a.t for n in nodes if n.op_type == "Constant" for a in n.attribute if a.name == "value"}
    )
    for node in nodes:
        if node.op_type == "Expand" and node.input[1] in constants:
            if 0 in onnx.numpy_helper.to_array(constants[node.input[1]]).reshape(-1):
                return ["ExpandElimination"]
    return []


def fused_selects(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """``model`` with the ONNX ``Where`` nodes of its graph run by aot2onnx's fused ``Where``
    (``runtime/fused_ops.cc``: ATen's where on the operands' bytes, the same choice of values), and how many.
    ONNX Runtime's CPU Where took 463 us on 65536 float32 elements (7 ns an element), ATen's 31 (2 threads);
    Where is how the exact lowerings guard their edge cases, a few to a few dozen per graph. For the compile
    backend's CPU sessions where the kernels are built; a model without such a node comes back as it is.

    Only nodes whose three operands have a known rank in the model (graph inputs, initializers, Constant
    outputs, value_info with a shape): ONNX Runtime hands a custom op's shape inference an operand of unknown
    rank as a scalar, and the output shape inferred from it would be wrong (a Loop's outputs, say). Subgraphs'
    nodes (If and Loop bodies) and functions' are left for the same reason."""
    graph = model.graph
    ranked = {v.name for v in (*graph.input, *graph.value_info, *graph.output) if v.type.tensor_type.HasField("shape")}
    ranked |= {i.name for i in graph.initializer}
    ranked |= {o for n in graph.node if n.op_type == "Constant" and n.domain in ("", "ai.onnx") for o in n.output}
    positions = [k for k, n in enumerate(graph.node)
                 if n.op_type == "Where" and n.domain in ("", "ai.onnx") and all(i in ranked for i in n.input)]
    if not positions:
        return model, 0
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    for k in positions:
        rewritten.graph.node[k].domain = FUSED_DOMAIN
    if not any(o.domain == FUSED_DOMAIN for o in rewritten.opset_import):
        rewritten.opset_import.append(onnx.helper.make_opsetid(FUSED_DOMAIN, 1))
    return rewritten, len(positions)
