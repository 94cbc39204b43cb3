"""Which ONNX opsets the installed ONNX Runtime can *run*, probed per op.

Loading a model is not running it. ONNX Runtime accepts a model importing any opset it knows, and only at
session creation finds that a node has no kernel for its op's version at that opset
(``Could not find an implementation for RandomUniformLike(22)``, seen with onnxruntime 1.32, which loads
opset 28). aot2onnx lowers at opset 18 and reaches a newer target with ONNX's version converter, which
moves every node to its op's version at the target: the target is only safe where each op keeps, at its
newer version, every kernel it had at opset 18.

Two probes, each a one-node model per (op, model opset, element type) for which ONNX Runtime is asked
for a session:

- per opset (:func:`opset_support`): the target is refused where an op whose version changes between 18
  and the target loses a kernel it had (the random ops at 22, onnxruntime 1.32);
- per node (:func:`unrunnable_nodes`): a lowered model converted to the target is checked node by node.
  ONNX Runtime runs some op and type pairs with no kernel through the function body that the ONNX schema
  defines for one opset only: an int64 Relu runs in an opset-18 model, as Max, and not in an opset-21 one
  (onnxruntime 1.32, seen here). Such a node is reported with the FX node it came from.

The answers depend only on the installed onnx and onnxruntime, so they are computed once per process,
when an opset other than 18 is first asked for.

ONNX Runtime's kernel listing (``get_all_opkernel_def``) is no substitute: it lists RandomUniformLike for
versions 1 and up, yet has no kernel for version 22 (onnxruntime 1.32, checked here).
"""

from __future__ import annotations

import dataclasses
import functools

from aot2onnx.options import BASE_OPSET  # every lowering starts at it

__all__ = [
    "BASE_OPSET",
    "OpsetSupport",
    "check_target_opset",
    "newest_runnable_opset",
    "opset_support",
    "require_runnable",
    "unrunnable_nodes",
]


_PROBED_TYPES = (
    "tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)", "tensor(int64)", "tensor(int32)",
    "tensor(int8)", "tensor(uint8)", "tensor(bool)",
)


@dataclasses.dataclass(frozen=True)
class OpsetSupport:
    """What the installed ONNX Runtime does with one target opset.

    ``loads``: ORT accepts a model importing the opset at all. ``lost``: ``op(version)`` entries, each an
    op whose version at this opset has no kernel for an element type that its opset-18 version runs.
    """

    opset: int
    loads: bool
    lost: tuple[str, ...]

    @property
    def runnable(self) -> bool:
        return self.loads and not self.lost


def _session_error(model_bytes: bytes) -> str | None:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT raises one exception type per status code; the text says which
        return str(e)
    return None


def _loads(opset: int) -> bool:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    return _session_error(model.SerializeToString()) is None


def _default_attribute(attribute) -> object:
    from onnx import defs, helper

    kind = attribute.type
    if kind == defs.OpSchema.AttrType.INT:
        return 1
    if kind == defs.OpSchema.AttrType.FLOAT:
        return 1.0
    if kind == defs.OpSchema.AttrType.INTS:
        return [1]
    if kind == defs.OpSchema.AttrType.FLOATS:
        return [1.0]
    if kind == defs.OpSchema.AttrType.STRING:
        return ""
    if kind == defs.OpSchema.AttrType.STRINGS:
        return [""]
    if kind == defs.OpSchema.AttrType.TENSOR:
        return helper.make_tensor("t", 1, [1], [1.0])
    return None


@functools.cache
def _runs(op: str, opset: int, type_str: str) -> bool | None:
    """Whether ORT runs ``op`` in a model of ``opset`` with ``type_str`` in the op's first type constraint;
    ``None`` when the probe cannot tell (the one-node model fails before kernel lookup).

    The model's opset, not only the op's version, decides: where ORT has no kernel for a type, it may
    still run the op through the function body the ONNX schema defines for that opset (Relu on int64
    runs in an opset-18 model, as Max, and not in an opset-21 one: onnxruntime 1.32, seen here)."""
    from onnx import defs, helper

    schema = defs.get_schema(op, opset, "")
    if not schema.type_constraints:
        return None
    constrained = schema.type_constraints[0].type_param_str
    allowed = {c.type_param_str: list(c.allowed_type_strs) for c in schema.type_constraints}

    def value_type(type_str_of_param: str) -> int | None:
        chosen = type_str if type_str_of_param == constrained else None
        if chosen is None and type_str_of_param in allowed:
            candidates = allowed[type_str_of_param]
            chosen = "tensor(float)" if "tensor(float)" in candidates else candidates[0]
        elif chosen is None:
            chosen = type_str_of_param
        if not chosen.startswith("tensor("):
            return None
        return _elem_type(chosen[len("tensor("):-1])

    def declare(formals, prefix: str, first_optional: int) -> tuple[list, list[str]] | None:
        """Value infos for the formal parameters up to the first optional one at or after ``first_optional``."""
        infos, names = [], []
        for i, formal in enumerate(formals):
            if formal.option == defs.OpSchema.FormalParameterOption.Optional and i >= first_optional:
                break
            elem = value_type(formal.type_str)
            if elem is None:
                return None
            infos.append(helper.make_tensor_value_info(f"{prefix}{i}", elem, None))
            names.append(f"{prefix}{i}")
        return infos, names

    declared_inputs, declared_outputs = declare(schema.inputs, "i", 0), declare(schema.outputs, "o", 1)
    if declared_inputs is None or declared_outputs is None:
        return None
    (inputs, input_names), (outputs, output_names) = declared_inputs, declared_outputs
    if type_str not in allowed.get(constrained, []):
        return None
    attributes = {}
    for name, attribute in schema.attributes.items():
        if attribute.required:
            value = _default_attribute(attribute)
            if value is None:
                return None
            attributes[name] = value
    if op in ("RandomUniformLike", "RandomNormalLike", "Multinomial", "Bernoulli", "EyeLike"):
        # The output type follows a dtype attribute where the op has one; keep it equal to the output's.
        if "dtype" in schema.attributes and outputs:
            attributes["dtype"] = outputs[0].type.tensor_type.elem_type
    node = helper.make_node(op, input_names, output_names, **attributes)
    graph = helper.make_graph([node], "probe", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    error = _session_error(model.SerializeToString())
    if error is None:
        return True
    if "Could not find an implementation" in error:
        return False
    return None


_ELEM_TYPES = {  # ONNX type names (as in "tensor(float)") -> TensorProto element types
    "float": 1, "uint8": 2, "int8": 3, "uint16": 4, "int16": 5, "int32": 6, "int64": 7, "string": 8, "bool": 9,
    "float16": 10, "double": 11, "uint32": 12, "uint64": 13, "bfloat16": 16,
}


def _elem_type(name: str) -> int | None:
    return _ELEM_TYPES.get(name)


@functools.cache
def opset_support(opset: int) -> OpsetSupport:
    """Probes whether ONNX Runtime runs, at ``opset``, every op kernel it runs at opset 18."""
    from onnx import defs

    if opset == BASE_OPSET:
        return OpsetSupport(opset, True, ())
    if opset < BASE_OPSET or opset > defs.onnx_opset_version() or not _loads(opset):
        return OpsetSupport(opset, False, ())
    lost = []
    for schema in sorted(defs.get_all_schemas(), key=lambda s: s.name):
        if schema.domain != "" or schema.deprecated:
            continue
        try:
            before = defs.get_schema(schema.name, BASE_OPSET, "").since_version
            after = defs.get_schema(schema.name, opset, "").since_version
        except defs.SchemaError:
            continue
        if before == after:
            continue
        for type_str in _PROBED_TYPES:
            # Each version probed in a model of the opset that introduced it: what its kernels run.
            if _runs(schema.name, before, type_str) and _runs(schema.name, after, type_str) is False:
                lost.append(f"{schema.name}({after}) for {type_str[len('tensor('):-1]}")
    return OpsetSupport(opset, True, tuple(lost))


@functools.cache
def newest_runnable_opset() -> int:
    """The newest opset at which ONNX Runtime runs every op aot2onnx may emit that it runs at opset 18."""
    from onnx import defs

    newest = BASE_OPSET
    for opset in range(BASE_OPSET + 1, defs.onnx_opset_version() + 1):
        if not opset_support(opset).runnable:
            break
        newest = opset
    return newest


def check_target_opset(opset: int) -> None:
    """Raises ``ValueError`` naming what is missing when ``opset`` is not one ONNX Runtime can run."""
    if opset == BASE_OPSET:
        return
    if opset < BASE_OPSET:
        raise ValueError(f"opset must be >= {BASE_OPSET} (aot2onnx lowers at opset {BASE_OPSET}), got {opset}")
    import onnx
    import onnxruntime

    support = opset_support(opset)
    newest = newest_runnable_opset()
    if support.runnable and opset <= newest:
        return
    if not support.loads:
        why = (
            f"onnx {onnx.__version__} knows opsets up to {onnx.defs.onnx_opset_version()}"
            if opset > onnx.defs.onnx_opset_version()
            else f"onnxruntime {onnxruntime.__version__} does not load models of opset {opset}"
        )
    else:
        why = f"onnxruntime {onnxruntime.__version__} has no kernel for " + ", ".join(support.lost[:6])
        if len(support.lost) > 6:
            why += f" and {len(support.lost) - 6} more"
    raise ValueError(
        f"opset {opset} cannot be targeted: {why}. The newest opset this onnxruntime runs is {newest}; "
        f"pass opset={newest} or lower (the default is {BASE_OPSET})."
    )


_TYPE_NAMES = {elem: name for name, elem in _ELEM_TYPES.items()}


def unrunnable_nodes(model, opset: int) -> list:
    """The nodes of ``model`` (a ModelProto of ``opset``) that ONNX Runtime cannot run at ``opset`` although
    it runs them in an opset-18 model: ``(node, "Relu for int64")`` pairs. The element type checked is the
    node's first input's (or output's), as the op's first type constraint usually binds it."""
    import onnx

    if opset == BASE_OPSET:
        return []
    typed = onnx.shape_inference.infer_shapes(model)
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in (*typed.graph.input, *typed.graph.value_info, *typed.graph.output, *typed.graph.initializer)
        if hasattr(v, "type")
    }
    types.update({t.name: t.data_type for t in model.graph.initializer})
    found = []
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        names = [n for n in (*node.input, *node.output) if n]
        type_name = _TYPE_NAMES.get(types.get(names[0], 0)) if names else None
        if type_name is None:
            continue
        type_str = f"tensor({type_name})"
        if _runs(node.op_type, opset, type_str) is False and _runs(node.op_type, BASE_OPSET, type_str):
            found.append((node, f"{node.op_type} for {type_name}"))
    return found


def require_runnable(model, opset: int, graph_name: str) -> None:
    """Raises ``LoweringError`` naming every node of ``model`` that ONNX Runtime cannot run at ``opset``
    (see :func:`unrunnable_nodes`), with the FX node each was lowered from."""
    from aot2onnx.errors import LoweringError

    found = unrunnable_nodes(model, opset)
    if not found:
        return
    lines = [f"graph {graph_name!r} cannot run at opset {opset}: the installed onnxruntime runs these nodes only "
             f"in an opset-{BASE_OPSET} model (through the ONNX schema's function body, having no kernel):"]
    for node, what in found:
        meta = {p.key: p.value for p in node.metadata_props}
        lines.append(f"  {node.name}: {what}, lowered from {meta.get('pkg.torch.onnx.fx_node', '?')}")
    lines.append(f"Target opset {BASE_OPSET} (the default) for this model.")
    raise LoweringError("\n".join(lines))
