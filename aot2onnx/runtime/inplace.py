"""Which written inputs of a graph ONNX Runtime may write in place.

A graph that mutates an input (a compiled optimizer step: every parameter and state tensor; BatchNorm's
running statistics) has the input's new value as an output (``GraphSignature.mutations``). Bound to the
input's own memory, that output is written by the node that computes it, and no copy follows the run. That
is safe where nothing reads the input's old value after the write begins:

- ONNX Runtime runs a CPU graph's nodes one after another (sequential execution, the default), in an order
  that respects data dependencies and nothing else. So every node that reads the input must be an ancestor
  of the node that writes the output, whatever order ONNX Runtime picks.
- The writer itself may read the input only as an elementwise operand of the output's own shape: each output
  element is computed from the input element at the same position, which its kernel reads before it stores.
- ONNX Runtime may give the outputs of Reshape, Identity, Squeeze, Unsqueeze, Flatten and Dropout their input's
  buffer rather than a copy. Their outputs count as the input, and none of them may be a graph output (a
  returned tensor would then share the input's memory).

ONNX Runtime's graph rewrites keep these properties: a fusion replaces nodes by one that reads what they read
and is ordered after what they depended on. The fusions that replace an elementwise writer (MatMul and Add
into Gemm; the layer-norm and GELU patterns) read the input per element or per row, before writing there.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import onnx

from aot2onnx.signature import FUSED_DOMAIN, GraphSignature, InputKind

__all__ = ["subgraph_reads", "writable_in_place"]

# Ops whose output ONNX Runtime may place in their input's buffer (its CPU kernels declare the alias or reuse).
_MAY_ALIAS = frozenset({"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Dropout"})

# Ops that compute each output element from the input elements at its own position (no reduction, no
# movement), so that they may read and write one buffer.
_ELEMENTWISE = frozenset({
    "Abs", "Add", "And", "Cast", "Ceil", "Clip", "Div", "Equal", "Erf", "Exp", "Floor", "Greater",
    "GreaterOrEqual", "IsInf", "IsNaN", "Less", "LessOrEqual", "Log", "Max", "Min", "Mul", "Neg", "Not", "Or",
    "Pow", "Reciprocal", "Relu", "Round", "Sigmoid", "Sign", "Sqrt", "Sub", "Tanh", "Where", "Xor",
})


def subgraph_reads(node: onnx.NodeProto) -> Iterator[str]:
    """Names a node's subgraphs (If, Loop, Scan) read, their own values included: a superset of what
    they take from the enclosing graph."""
    stack = [a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH]
    stack += [g for a in node.attribute if a.type == onnx.AttributeProto.GRAPHS for g in a.graphs]
    while stack:
        graph = stack.pop()
        for inner in graph.node:
            yield from inner.input
            stack += [a.g for a in inner.attribute if a.type == onnx.AttributeProto.GRAPH]
            stack += [g for a in inner.attribute if a.type == onnx.AttributeProto.GRAPHS for g in a.graphs]


def _shapes(graph: onnx.GraphProto) -> dict[str, tuple]:
    """Static or symbolic shapes by value name, as declared in the model."""
    shapes = {}
    for value in (*graph.input, *graph.value_info, *graph.output):
        dims = value.type.tensor_type.shape.dim
        if value.type.tensor_type.HasField("shape"):
            shapes[value.name] = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in dims)
    return shapes


def writable_in_place(model: onnx.ModelProto, signature: GraphSignature) -> frozenset[str]:
    """The mutation outputs (``MutationSpec.onnx_name``) ONNX Runtime may write into their input's memory."""
    graph = model.graph
    nodes = list(graph.node)
    producer: dict[str, int] = {}
    readers: dict[str, set[int]] = collections.defaultdict(set)
    reads: list[set[str]] = []
    for i, node in enumerate(nodes):
        for name in node.output:
            producer[name] = i
        names = {n for n in node.input if n} | set(subgraph_reads(node))
        reads.append(names)
        for name in names:
            readers[name].add(i)
    outputs = [o.name for o in graph.output]
    shapes = _shapes(graph)

    def ancestors(index: int) -> set[int]:
        seen: set[int] = set()
        stack = [index]
        while stack:
            for name in reads[stack.pop()]:
                before = producer.get(name)
                if before is not None and before not in seen:
                    seen.add(before)
                    stack.append(before)
        return seen

    writable = set()
    for mutation in signature.mutations:
        name = mutation.onnx_name
        if outputs.count(name) != 1 or name not in producer:
            continue
        spec = signature.inputs[mutation.index]
        if spec.kind is not InputKind.TENSOR:  # the graph never reads the input's old value
            writable.add(name)
            continue
        # The input under every name ONNX Runtime may give its memory, and the nodes that read it.
        aliases, stack, touching = {spec.onnx_name}, [spec.onnx_name], set()
        while stack:
            for reader in readers[stack.pop()]:
                touching.add(reader)
                if nodes[reader].op_type in _MAY_ALIAS and nodes[reader].domain in ("", "ai.onnx"):
                    for alias in nodes[reader].output:
                        if alias and alias not in aliases:
                            aliases.add(alias)
                            stack.append(alias)
        if any(o in aliases for o in outputs):
            continue
        writer = producer[name]
        before = ancestors(writer)
        if all(r in before for r in touching - {writer}) and (
            writer not in touching or _reads_elementwise(nodes[writer], aliases, shapes.get(name), shapes)
        ):
            writable.add(name)
    return frozenset(writable)


def _reads_elementwise(node: onnx.NodeProto, aliases: set[str], shape: tuple | None, shapes: dict[str, tuple]) -> bool:
    """Whether ``node`` reads the input (``aliases``) only as elementwise operands of its output's shape."""
    # The fused kernels' chains of arithmetic (rewrites.fused_elementwise) write a block's outputs after every
    # read of its operands, at the same positions: as an elementwise node.
    fused_chain = node.op_type == "Elementwise" and node.domain == FUSED_DOMAIN
    if not (fused_chain or node.op_type in _ELEMENTWISE and node.domain in ("", "ai.onnx")):
        return False
    if shape is None or None in shape:
        return False
    if any(a in aliases for a in subgraph_reads(node)):
        return False
    return all(shapes.get(n) == shape for n in node.input if n in aliases)
