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

import numpy as np
import onnx
import onnx.numpy_helper

from aot2onnx.runtime.inplace import subgraph_reads
from aot2onnx.signature import FUSED_DOMAIN

__all__ = [
    "disabled_optimizers", "fused_elementwise", "fused_scatter_scales", "fused_selects", "fused_transposes",
    "model_nodes", "serial_nodes", "split_channel_reductions", "standard_products",
]


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
    constants = _constant_tensors(model.graph.initializer, nodes)
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
    ranked = {name for name, (_, rank) in _tensor_types(graph).items() if rank is not None}
    ranked |= _constant_outputs(graph)
    positions = [k for k, n in enumerate(graph.node)
                 if n.op_type == "Where" and n.domain in ("", "ai.onnx") and all(i in ranked for i in n.input)]
    return _to_fused_domain(model, positions)


def _constant_outputs(graph: onnx.GraphProto) -> set[str]:
    """The outputs of ``graph``'s ONNX Constant nodes."""
    return {o for n in graph.node if n.op_type == "Constant" and n.domain in ("", "ai.onnx") for o in n.output}


def _with_fused_opset(model: onnx.ModelProto) -> None:
    """Imports the fused kernels' domain into ``model`` where it does not yet."""
    if not any(o.domain == FUSED_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(FUSED_DOMAIN, 1))


def _to_fused_domain(model: onnx.ModelProto, positions: list[int]) -> tuple[onnx.ModelProto, int]:
    """``model`` with its graph's nodes at ``positions`` in the fused kernels' domain (an op of the library by
    the same name and attributes), and how many; ``model`` itself where there are none."""
    if not positions:
        return model, 0
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    for k in positions:
        rewritten.graph.node[k].domain = FUSED_DOMAIN
    _with_fused_opset(rewritten)
    return rewritten, len(positions)


# Element types of 1, 2, 4 or 8 bytes: the fused Transpose copies their bytes (fused_ops.cc's BytesOf).
_COPIED_DTYPES = frozenset({
    onnx.TensorProto.BOOL, onnx.TensorProto.UINT8, onnx.TensorProto.INT8, onnx.TensorProto.FLOAT16,
    onnx.TensorProto.BFLOAT16, onnx.TensorProto.INT16, onnx.TensorProto.UINT16, onnx.TensorProto.FLOAT,
    onnx.TensorProto.INT32, onnx.TensorProto.UINT32, onnx.TensorProto.DOUBLE, onnx.TensorProto.INT64,
    onnx.TensorProto.UINT64, onnx.TensorProto.COMPLEX64})


def fused_transposes(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """``model`` with the ONNX ``Transpose`` nodes of its graph that keep the last axis in place run by
    aot2onnx's fused ``Transpose`` (``runtime/fused_ops.cc``: the same bytes, copied as runs of the trailing
    axes), and how many. Attention's head split and merge ([B, S, H, D] <-> [B, H, S, D]): ONNX Runtime's CPU
    Transpose took 20 us for 16384 float32 elements so, the fused one 2. A Transpose that moves the last axis
    stays ONNX Runtime's (element by element in the fused kernel; ONNX Runtime's has blocked paths for it).

    As fused_selects: only nodes whose input has a known rank and element type, in the main graph; and not a
    Transpose of an initializer or a Constant, which ONNX Runtime folds at session creation."""
    graph = model.graph
    types = _tensor_types(graph)
    constants = {i.name for i in graph.initializer} | _constant_outputs(graph)
    positions = []
    for k, node in enumerate(graph.node):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or len(node.input) != 1:
            continue
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        dtype, rank = types.get(node.input[0], (None, None))
        if (perm is None or rank != len(perm) or rank < 3 or perm[-1] != rank - 1 or dtype not in _COPIED_DTYPES
                or node.input[0] in constants):
            continue
        positions.append(k)
    return _to_fused_domain(model, positions)


def fused_scatter_scales(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """``model`` with ``Mul(ScatterElements(zeros, indices, updates), factor)`` run as aot2onnx's fused
    ``ScatterScale`` (``runtime/fused_ops.cc``: each element computed as the Mul computes it, in one pass), and
    how many pairs. It is a negative log-likelihood loss's gradient (nll_loss_backward's decomposition: zeros of
    the logits' shape, -1 scattered in at each target, times the weight per row), one pass over a [tokens,
    vocabulary] tensor where ONNX Runtime made three (a copy of the zeros, the scatter, the Mul): 33 against 64 us
    at [256, 1024], 15 against 60 ms at [2048, 50257] (one session each, one thread).

    Only where the scatter's data is a float32 or float64 initializer or Constant of +0.0 throughout, without a
    reduction, read by that Mul alone (not a graph output), whose other operand has a known shape that broadcasts
    to the data's (the Mul's result in the data's shape); in the main graph."""
    graph = model.graph
    shapes = _shapes(graph)
    constants = _constant_tensors(graph.initializer, graph.node)
    zeros = {name: tuple(tensor.dims) for name, tensor in constants.items()
             if tensor.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE) and _all_zero_bytes(tensor)}
    readers, external = _readers(graph)
    replacement: dict[int, onnx.NodeProto] = {}  # at the Mul's position, the fused node
    dropped: set[int] = set()  # the scatters' positions
    for k, node in enumerate(graph.node):
        if node.op_type != "ScatterElements" or node.domain not in ("", "ai.onnx") or len(node.input) != 3:
            continue
        attributes = {a.name: a for a in node.attribute}
        if "reduction" in attributes and attributes["reduction"].s not in (b"", b"none"):
            continue
        data, scattered = node.input[0], node.output[0]
        users = readers.get(scattered, set())
        if data not in zeros or scattered in external or len(users) != 1:
            continue
        (at,) = users
        mul = graph.node[at]
        if mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx") or list(mul.input).count(scattered) != 1:
            continue
        factor = mul.input[1] if mul.input[0] == scattered else mul.input[0]
        data_shape = zeros[data]
        factor_shape = tuple(constants[factor].dims) if factor in constants else shapes.get(factor, (None, None))[1]
        if factor_shape is None or len(factor_shape) > len(data_shape) or not all(
                f in (1, d) for f, d in zip(reversed(factor_shape), reversed(data_shape))):
            continue
        axis = attributes["axis"].i if "axis" in attributes else 0
        fused = onnx.helper.make_node(
            "ScatterScale", [data, node.input[1], node.input[2], factor], [mul.output[0]],
            name=(mul.name or mul.output[0]) + "_scatter_scale", domain=FUSED_DOMAIN, axis=axis,
            factor_first=int(mul.input[0] == factor))
        replacement[at] = fused
        dropped.add(k)
    if not replacement:
        return model, 0
    return _with_nodes_replaced(model, replacement, dropped), len(replacement)


def _readers(graph: onnx.GraphProto) -> tuple[dict[str, set[int]], set[str]]:
    """Per value of ``graph``, the positions of the nodes that read it; and the values read other than by its
    nodes' inputs (the graph's outputs, and what If and Loop bodies read), which a rewrite must keep."""
    readers: dict[str, set[int]] = {}
    for k, node in enumerate(graph.node):
        for name in node.input:
            readers.setdefault(name, set()).add(k)
    external = {o.name for o in graph.output} | {name for node in graph.node for name in subgraph_reads(node)}
    return readers, external


def _with_nodes_replaced(model: onnx.ModelProto, replacement: dict[int, onnx.NodeProto],
                         dropped: set[int]) -> onnx.ModelProto:
    """A copy of ``model`` whose graph has the node ``replacement[k]`` at each position k, without the nodes at
    ``dropped``, importing the fused kernels' domain."""
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    del rewritten.graph.node[:]
    rewritten.graph.node.extend(replacement.get(k, node) for k, node in enumerate(model.graph.node) if k not in dropped)
    _with_fused_opset(rewritten)
    return rewritten


def _all_zero_bytes(tensor: onnx.TensorProto) -> bool:
    """Whether every element of ``tensor`` is +0.0 (all its bytes zero)."""
    values = onnx.numpy_helper.to_array(tensor)
    return not np.ascontiguousarray(values).view(np.uint8).any()


# The fused Elementwise's instructions (fused_ops.cc's ElementwiseOp), by ONNX op; KeepSmall stands for the float32
# tanh lowering's guard, Where(GreaterOrEqual(Abs(a), 2^-12), b, a) (_tanh_guards).
_ARITHMETIC = {"Add": 0, "Sub": 1, "Mul": 2, "Div": 3, "Neg": 4, "KeepSmall": 5}
_TANH_SMALL = 2.0**-12  # lower/ops/pointwise.py's aten_tanh: below it, tanh(x) rounds to x


def _tanh_guards(graph: onnx.GraphProto, readers: dict[str, set[int]],
                 external: set[str]) -> dict[int, tuple[list[str], tuple[int, int]]]:
    """The float32 tanh lowering's guards in ``graph``: per Where node computing ``Where(GreaterOrEqual(Abs(a),
    2^-12), b, a)``, the operands (a, b) of the KeepSmall instruction that does the same, and the positions of its
    Abs and GreaterOrEqual, which nothing else reads. The Where may be the fused kernels' (fused_selects)."""
    producer = {o: k for k, node in enumerate(graph.node) for o in node.output}
    constants = _constant_tensors(graph.initializer, graph.node)
    graph_inputs = {value.name for value in graph.input}

    def only_reader(value: str, k: int) -> bool:
        return readers.get(value, set()) == {k} and value not in external

    guards: dict[int, tuple[list[str], tuple[int, int]]] = {}
    for k, node in enumerate(graph.node):
        if node.op_type != "Where" or node.domain not in ("", "ai.onnx", FUSED_DOMAIN) or len(node.input) != 3:
            continue
        condition, large, small = node.input
        ge = producer.get(condition)
        if ge is None or not only_reader(condition, k):
            continue
        compare = graph.node[ge]
        if compare.op_type != "GreaterOrEqual" or compare.domain not in ("", "ai.onnx") or len(compare.input) != 2:
            continue
        absolute, threshold = compare.input
        ab = producer.get(absolute)
        if ab is None or not only_reader(absolute, ge):
            continue
        abs_node = graph.node[ab]
        if abs_node.op_type != "Abs" or abs_node.domain not in ("", "ai.onnx") or list(abs_node.input) != [small]:
            continue
        bound = constants.get(threshold)
        if bound is None or bound.data_type != onnx.TensorProto.FLOAT or int(np.prod(bound.dims)) != 1:
            continue
        if threshold in graph_inputs:  # an initializer that is also an input: a default a caller may replace
            continue
        if float(onnx.numpy_helper.to_array(bound).reshape(-1)[0]) != _TANH_SMALL:
            continue
        guards[k] = ([small, large], (ab, ge))
    return guards


def _shapes(graph: onnx.GraphProto) -> dict[str, tuple[int, tuple | None]]:
    """The element type and dimensions (ints and symbols; None where the shape or a dimension is unknown) of
    ``graph``'s inputs, outputs, value_info and initializers."""
    shapes: dict[str, tuple[int, tuple | None]] = {}
    for value in (*graph.input, *graph.value_info, *graph.output):
        tensor = value.type.tensor_type
        dims = None
        if tensor.HasField("shape"):
            dims = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in tensor.shape.dim)
            dims = None if None in dims else dims
        shapes[value.name] = (tensor.elem_type, dims)
    for init in graph.initializer:
        shapes[init.name] = (init.data_type, tuple(init.dims))
    return shapes


def fused_elementwise(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """``model`` with chains of ONNX ``Add``, ``Sub``, ``Mul``, ``Div`` and ``Neg`` run as aot2onnx's fused
    ``Elementwise`` (``runtime/fused_ops.cc``: the same operations in one pass, block by block), and how many
    nodes it replaced. Hugging Face's GPT-2 GELU ("gelu_new", written out) is 13 such nodes in the forward graph
    and 15 in the backward, each a pass over memory on ONNX Runtime's one thread. The float32 tanh lowering's
    guard (Abs, GreaterOrEqual, Where: :func:`_tanh_guards`) joins a region as one instruction, its Abs and
    GreaterOrEqual dropped with it.

    A region: two or more such nodes of one float32 or float64 type and one shape, each reading the region's
    results, tensors of its shape, or constants of one element (initializers and Constant outputs). A node joins
    the region of a node it reads, or of one that reads the same tensor, where everything else it reads comes
    from before the region's first node: the fused node takes that node's place, and the graph stays in order
    without a cycle. Its outputs are the region's values that other nodes or the graph's outputs read."""
    graph = model.graph
    shapes = _shapes(graph)
    readers, external = _readers(graph)
    guards = _tanh_guards(graph, readers, external)
    # Each node's op and operands as a region sees them: a tanh guard's Where as its KeepSmall instruction.
    ops = [("KeepSmall", guards[k][0]) if k in guards else (node.op_type, list(node.input))
           for k, node in enumerate(graph.node)]
    constants: dict[str, int] = {}  # one-element constants: their rank
    for init in graph.initializer:
        if int(np.prod(init.dims)) == 1:
            constants[init.name] = len(init.dims)
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.attribute) == 1:
            attribute = node.attribute[0]
            if attribute.name == "value" and int(np.prod(attribute.t.dims)) == 1:
                constants[node.output[0]] = len(attribute.t.dims)
                shapes[node.output[0]] = (attribute.t.data_type, tuple(attribute.t.dims))

    def region_shape(k: int) -> tuple[int, tuple] | None:
        """The node's type and shape where it can join a region: the shape of its tensor operands (one), every
        other operand a constant of one element, of no higher rank, of the type."""
        node = graph.node[k]
        op_type, operands = ops[k]
        if k not in guards and (node.domain not in ("", "ai.onnx") or op_type not in _ARITHMETIC):
            return None
        if len(node.output) != 1 or len(operands) != (1 if op_type == "Neg" else 2) or not all(operands):
            return None
        found = {shapes.get(i, (None, None)) for i in operands if i not in constants}
        if len(found) != 1:
            return None
        dtype, dims = next(iter(found))
        if dtype not in _PRODUCT_DTYPES or dims is None or (k in guards and dtype != onnx.TensorProto.FLOAT):
            return None
        if any(shapes.get(i, (None, None))[0] != dtype or constants[i] > len(dims) for i in operands if i in constants):
            return None
        declared_type, declared_dims = shapes.get(node.output[0], (None, None))
        if declared_type not in (None, 0, dtype) or declared_dims not in (None, dims):
            return None
        return dtype, dims

    position: dict[str, int] = {}  # where each value is computed: its node's index, its region's first node's
    regions: list[dict] = []
    region_of: dict[str, int] = {}
    for k, node in enumerate(graph.node):
        kind = region_shape(k)
        if kind is None:
            for o in node.output:
                position[o] = k
            continue
        shapes[node.output[0]] = kind
        operands = ops[k][1]
        reads = [i for i in operands if i not in constants]
        candidates = sorted({region_of[i] for i in reads if i in region_of}, key=lambda r: -regions[r]["first"])
        if regions and regions[-1]["kind"] == kind and set(reads) & regions[-1]["reads"]:
            candidates.append(len(regions) - 1)  # a sibling: reads a tensor the last region reads
        chosen = None
        for r in candidates:
            region = regions[r]
            if region["kind"] == kind and all(
                    region_of.get(i) == r or position.get(i, -1) < region["first"] for i in operands):
                chosen = r
                break
        if chosen is None:
            regions.append({"first": k, "kind": kind, "members": [], "reads": set()})
            chosen = len(regions) - 1
        region = regions[chosen]
        region["members"].append(k)
        region["reads"] |= set(reads)
        region_of[node.output[0]] = chosen
        position[node.output[0]] = region["first"]

    fused = [r for r in regions if len(r["members"]) > 1]
    if not fused:
        return model, 0
    replacement: dict[int, onnx.NodeProto] = {}
    dropped: set[int] = set()
    replaced = 0
    for number, region in enumerate(fused):
        members = region["members"]
        produced = {graph.node[k].output[0]: k for k in members}
        # Outputs: values a node outside the region reads, or the graph's outputs.
        inside = set(members)
        used = {v for v in produced if v in external or readers.get(v, set()) - inside}
        operands: dict[str, int] = {}
        inputs: list[str] = []
        for k in members:
            for i in ops[k][1]:
                if i not in produced and i not in operands:
                    operands[i] = len(inputs)
                    inputs.append(i)
        program: list[int] = []
        for step, k in enumerate(members):
            op_type, read = ops[k]
            a = operands[read[0]]
            b = operands[read[1]] if len(read) > 1 else -1
            program += [_ARITHMETIC[op_type], a, b]
            operands[graph.node[k].output[0]] = len(inputs) + step
        outputs = [graph.node[k].output[0] for k in members if graph.node[k].output[0] in used]
        if not outputs:  # nothing reads the region: its nodes are left to the removal of unused nodes
            continue
        replaced += len(members)
        replacement[members[0]] = onnx.helper.make_node(
            "Elementwise", inputs, outputs, name=f"aot2onnx_elementwise_{number}", domain=FUSED_DOMAIN,
            program=program, results=[operands[o] for o in outputs])
        dropped |= set(members[1:])
        for k in members:  # a guard's Abs and GreaterOrEqual, which only it read
            if k in guards:
                dropped |= set(guards[k][1])
                replaced += 2
    if not replaced:
        return model, 0
    rewritten = _with_nodes_replaced(model, replacement, dropped)
    _drop_unread_constants(rewritten.graph, {graph.node[k].input[1] for k in dropped
                                             if graph.node[k].op_type == "GreaterOrEqual"})
    return rewritten, replaced


def _drop_unread_constants(graph: onnx.GraphProto, names: set[str]) -> None:
    """Removes from ``graph`` the initializers and Constant nodes among ``names`` that nothing reads any more
    (ONNX Runtime warns of an unused initializer at every session it opens)."""
    readers, external = _readers(graph)
    inputs = {value.name for value in graph.input}  # an initializer that is also an input stays: a default
    unread = {name for name in names if name not in readers and name not in external and name not in inputs}
    if not unread:
        return
    kept = [init for init in graph.initializer if init.name not in unread]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    nodes = [n for n in graph.node if not (n.op_type == "Constant" and set(n.output) <= unread)]
    del graph.node[:]
    graph.node.extend(nodes)


_PRODUCT_DTYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)


def standard_products(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """``model`` with the fused kernels' matrix products (``Mm``: ATen's mm, addmm, bmm) as ONNX Runtime's own
    (MLAS's), and how many: a product of matrices as a Gemm with the same transposes, alpha, beta and addend; a
    product of batches without an addend as a MatMul, a transposed operand through a Transpose (which ONNX
    Runtime folds into the product). The same sums in MLAS's order.

    The thread trial (runtime/session.py) runs it as one of the graph's candidates: ATen's products run on
    torch's OpenMP threads and MLAS's on ONNX Runtime's pool, and which is faster depends on the machine, the
    shapes and the thread count (2026-11-28, 2 cores: ATen's 0.72-0.92 of MLAS's step on the transformer
    models at 2 threads, MLAS's 0.87 of ATen's on the device-scale MLP and BERT at one).

    A product stays ATen's where the rewrite would not be the same computation or its operands are not known
    well enough: a dtype other than float32 or float64, an unknown rank, an alpha or beta that a float32
    attribute does not hold exactly, beta = 0 (ATen ignores the addend, NaN included; Gemm would multiply it),
    a batched product with an addend (baddbmm)."""
    types = _tensor_types(model.graph)
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    nodes, count = [], 0
    for node in rewritten.graph.node:
        replacement = _standard_product(node, types) if node.op_type == "Mm" and node.domain == FUSED_DOMAIN else None
        if replacement is None:
            nodes.append(node)
        else:
            nodes.extend(replacement)
            count += 1
    if not count:
        return model, 0
    del rewritten.graph.node[:]
    rewritten.graph.node.extend(nodes)
    return rewritten, count


def _standard_product(node: onnx.NodeProto, types: dict[str, tuple[int, int | None]]) -> list[onnx.NodeProto] | None:
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    a, b = node.input[0], node.input[1]
    c = node.input[2] if len(node.input) > 2 and node.input[2] else None
    (dtype, rank_a), (_, rank_b) = types.get(a, (None, None)), types.get(b, (None, None))
    if dtype not in _PRODUCT_DTYPES:
        return None
    trans_a, trans_b = int(attributes.get("trans_a", 0)), int(attributes.get("trans_b", 0))
    alpha, beta = (float.fromhex(attributes[k].decode()) for k in ("alpha", "beta"))  # exact, as float.hex()
    name = node.name or node.output[0]
    if rank_a == 2 and rank_b == 2:
        if any(float(np.float32(v)) != v for v in (alpha, beta)) or (c is not None and beta == 0.0):
            return None
        gemm = onnx.helper.make_node("Gemm", [a, b, *([c] if c is not None else [])], list(node.output), name=name,
                                     transA=trans_a, transB=trans_b, alpha=alpha, beta=beta)
        return [gemm]
    if rank_a == 3 and rank_b == 3 and c is None:
        out, operands = [], []
        for operand, transposed in ((a, trans_a), (b, trans_b)):
            if transposed:
                t_out = f"{name}_{operand}_t"
                out.append(onnx.helper.make_node("Transpose", [operand], [t_out], name=t_out, perm=[0, 2, 1]))
                operand = t_out
            operands.append(operand)
        out.append(onnx.helper.make_node("MatMul", operands, list(node.output), name=name))
        return out
    return None


def _tensor_types(graph: onnx.GraphProto) -> dict[str, tuple[int, int | None]]:
    """The element type and rank (None where unknown) of ``graph``'s inputs, outputs, value_info and initializers."""
    types: dict[str, tuple[int, int | None]] = {}
    for value in (*graph.input, *graph.value_info, *graph.output):
        tensor = value.type.tensor_type
        types[value.name] = (tensor.elem_type, len(tensor.shape.dim) if tensor.HasField("shape") else None)
    for init in graph.initializer:
        types[init.name] = (init.data_type, len(init.dims))
    return types


def _static_shapes(graph: onnx.GraphProto) -> dict[str, list[int]]:
    """The values of ``graph`` whose every size is a known number."""
    shapes = {}
    for value in (*graph.input, *graph.value_info, *graph.output):
        tensor = value.type.tensor_type
        if tensor.HasField("shape") and all(d.HasField("dim_value") for d in tensor.shape.dim):
            shapes[value.name] = [d.dim_value for d in tensor.shape.dim]
    for init in graph.initializer:
        shapes[init.name] = list(init.dims)
    return shapes


def _constant_tensors(initializers, nodes) -> dict[str, onnx.TensorProto]:
    """The constant tensors among ``initializers`` and the outputs of ONNX Constant nodes among ``nodes`` (a
    ``value`` or ``value_ints`` attribute), by name."""
    found = {t.name: t for t in initializers}
    for node in nodes:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for a in node.attribute:
                if a.name == "value":
                    found[node.output[0]] = a.t
                elif a.name == "value_ints":
                    found[node.output[0]] = onnx.helper.make_tensor("", onnx.TensorProto.INT64, [len(a.ints)], a.ints)
    return found


def _constant_ints(graph: onnx.GraphProto) -> dict[str, list[int]]:
    """The int64 constants of ``graph`` (initializers and Constant nodes), as lists."""
    return {name: [int(v) for v in onnx.numpy_helper.to_array(t).reshape(-1)]
            for name, t in _constant_tensors(graph.initializer, graph.node).items()
            if t.data_type == onnx.TensorProto.INT64}


_SPLIT_REDUCTIONS = ("ReduceSum", "ReduceMean")
_SPLIT_DTYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)


def split_channel_reductions(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """``model`` with its per-channel sums and means (ReduceSum or ReduceMean of an (N, C, ...) tensor over
    every axis but 1: a batch norm's statistics and its backward's sums, a convolution's bias gradient) taken
    in two steps, the contiguous inner axes first: Reshape to (N, C, S), reduce axis 2, then axis 0; and how
    many. For CUDA sessions: ONNX Runtime's CUDA provider hands the one-step reduction to cuDNN, which took
    157 us on a 32 x 32 x 64 x 64 float32 tensor on an H200 against 55 us in two steps (torch's 35; on
    128 x 64 x 56 x 56: 625 against 132). The two steps add the same numbers in another order, as cuDNN's own
    order is not ATen's either: float32 and float64 only (a 16-bit tensor's partial sums would be rounded to
    16 bits between the steps), main-graph nodes with constant axes, on inputs whose sizes are all known and
    none zero."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 18:  # the reductions' axes are an input from opset 18 on
        return model, 0
    graph = model.graph
    shapes, constants = _static_shapes(graph), _constant_ints(graph)
    types = _tensor_types(graph)

    def splits(node: onnx.NodeProto) -> bool:
        if node.op_type not in _SPLIT_REDUCTIONS or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            return False
        shape, axes = shapes.get(node.input[0]), constants.get(node.input[1])
        dtype = types.get(node.input[0], (None, None))[0]
        if shape is None or axes is None or len(shape) < 3 or 0 in shape or dtype not in _SPLIT_DTYPES:
            return False
        return sorted(a % len(shape) for a in axes) == [0, *range(2, len(shape))]

    chosen = {k for k, n in enumerate(graph.node) if splits(n)}
    if not chosen:
        return model, 0
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    nodes: list[onnx.NodeProto] = []
    for k, node in enumerate(rewritten.graph.node):
        if k in chosen:
            nodes.extend(_two_step_reduction(node, shapes[node.input[0]]))
        else:
            nodes.append(node)
    del rewritten.graph.node[:]
    rewritten.graph.node.extend(nodes)
    return rewritten, len(chosen)


def _two_step_reduction(node: onnx.NodeProto, shape: list[int]) -> list[onnx.NodeProto]:
    """The nodes that take ``node``'s reduction of an (N, C, ...) tensor of ``shape`` over every axis but 1 in
    two steps, writing its output."""
    make = onnx.helper.make_node
    stem = f"{node.name or node.output[0]}_split"
    n, c, s = shape[0], shape[1], int(np.prod(shape[2:]))
    keepdims = next((a.i for a in node.attribute if a.name == "keepdims"), 1)

    def ints(name: str, values: list[int]) -> onnx.NodeProto:
        return make("Constant", [], [name], name=name,
                    value=onnx.helper.make_tensor(name, onnx.TensorProto.INT64, [len(values)], values))

    nodes = [
        ints(f"{stem}_ncs", [n, c, s]),
        ints(f"{stem}_inner", [2]),
        ints(f"{stem}_batch", [0]),
        make("Reshape", [node.input[0], f"{stem}_ncs"], [f"{stem}_rows"], name=f"{stem}_reshape"),
        make(node.op_type, [f"{stem}_rows", f"{stem}_inner"], [f"{stem}_partial"], name=f"{stem}_inner_step", keepdims=0),
    ]
    total = f"{stem}_total" if keepdims else node.output[0]
    nodes.append(make(node.op_type, [f"{stem}_partial", f"{stem}_batch"], [total], name=f"{stem}_batch_step", keepdims=0))
    if keepdims:
        nodes.append(ints(f"{stem}_kept", [1, c, *([1] * (len(shape) - 2))]))
        nodes.append(make("Reshape", [total, f"{stem}_kept"], [node.output[0]], name=f"{stem}_keep"))
    return nodes
