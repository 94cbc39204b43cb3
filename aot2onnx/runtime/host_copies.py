"""Where ONNX Runtime's CUDA provider would copy a device value to the host in the middle of a run.

Some inputs of the CUDA provider's kernels live in host memory (a Reshape's target shape, a Slice's starts,
an If's condition: ``InputMemoryType(OrtMemTypeCPUInput, i)`` in its kernel registrations). A value computed
on the device that feeds one makes ONNX Runtime insert a ``MemcpyToHost``, and every such copy is a wait for
the GPU to drain its stream before the run can go on. Values that are on the host already cost nothing:
initializers and constants, the outputs of ``Shape`` and ``Size`` (host outputs on CUDA), graph inputs bound in
host memory, and what ONNX Runtime computes from those alone, which it places on the CPU provider (its
``GetCpuPreferredNodes``).

:func:`host_round_trips` finds the copies a model would make, from the model alone, so that a test can hold
every lowered graph to none without a GPU at hand. On a GPU, the session's optimized graph says the same
(``MemcpyToHost`` nodes: the GPU check counts them).

A node the CUDA provider has no kernel for (no kernel for its op at the model's opset, or none for its element
types) runs on the CPU provider: ONNX Runtime copies its device inputs to the host and its outputs back (a max
pool's gradient lowered to MaxUnpool did so on an H100). :func:`cpu_fallbacks` finds those nodes, from the
table of the CUDA provider's kernels in ``opset_tables/ort_cuda_kernels.json`` (generated from ONNX Runtime's
``docs/OperatorKernels.md`` by ``python -m aot2onnx ort-kernels``). aot2onnx's own fused kernels
(``signature.FUSED_DOMAIN``) are CPU only.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable
from pathlib import Path

import onnx

from aot2onnx.signature import FUSED_DOMAIN

__all__ = ["CUDA_KERNELS_PATH", "HOST_INPUTS", "CpuFallback", "HostRoundTrip", "cpu_fallbacks", "cuda_kernels",
           "host_round_trips"]

# The CUDA provider's kernels: domain -> op type -> formal inputs' and outputs' type constraints, and per kernel
# the opset versions it covers and the element types of each constraint it checks (aot2onnx.tools.ort_kernels).
CUDA_KERNELS_PATH = Path(__file__).resolve().parents[2] / "opset_tables" / "ort_cuda_kernels.json"

# The inputs the CUDA provider's kernels take in host memory, per op type (positions), for the opsets the
# lowering targets (18 and later). From onnxruntime/core/providers/cuda: the kernels' InputMemoryType. Ops the
# CUDA provider has no kernel for (MaxUnpool, DFT, STFT, Col2Im) run on the CPU provider whole, all their
# device inputs copied: cpu_fallbacks reports them.
HOST_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,),
    "Expand": (1,),
    "Tile": (1,),
    "Slice": (1, 2, 3, 4),
    "Squeeze": (1,),
    "Unsqueeze": (1,),
    "ConstantOfShape": (0,),
    "Range": (0, 1, 2),
    "TopK": (1,),
    "Pad": (1, 2, 3),
    "Resize": (1, 2, 3),
    "Upsample": (1,),
    "OneHot": (1,),
    "Split": (1,),
    "Trilu": (1,),
    "CumSum": (1,),
    "Clip": (1, 2),
    "Dropout": (1, 2),
    "Compress": (1,),
    "If": (0,),
    "Loop": (0, 1),
    "ReduceSum": (1,),
    "ReduceMean": (1,),
    "ReduceMax": (1,),
    "ReduceMin": (1,),
    "ReduceProd": (1,),
    "ReduceL1": (1,),
    "ReduceL2": (1,),
    "ReduceLogSum": (1,),
    "ReduceLogSumExp": (1,),
    "ReduceSumSquare": (1,),
}

# Ops whose outputs the CUDA provider writes to host memory whatever their input.
_HOST_OUTPUTS = frozenset({"Shape", "Size"})

# Ops ONNX Runtime moves to the CPU provider when all their inputs are on the host: the small integer
# arithmetic of shape computations (GetCpuPreferredNodes keeps a node on the host when its inputs are, and
# the CPU provider has a kernel for it).
_HOST_COMPUTABLE = frozenset({
    "Add", "Sub", "Mul", "Div", "Mod", "Neg", "Abs", "Max", "Min", "Cast", "Concat", "Gather", "Unsqueeze",
    "Squeeze", "Reshape", "Slice", "Identity", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual",
    "Not", "And", "Or", "Where", "ReduceProd", "ReduceSum", "ReduceMax", "ReduceMin", "Range", "ConstantOfShape",
    "Expand", "Tile", "Floor", "Ceil", "Sign", "Sqrt", "Shape", "Size", "Constant", "Flatten", "Transpose",
})


@dataclasses.dataclass(frozen=True)
class HostRoundTrip:
    """One device value a node needs on the host: a wait for the GPU inside the run."""

    node: str  # the ONNX node's name
    op_type: str
    input_index: int
    value: str  # the value copied
    fx_node: str  # the ATen node the ONNX node was lowered from, where its metadata says

    def __str__(self) -> str:
        origin = f" (lowered from {self.fx_node})" if self.fx_node else ""
        return f"{self.op_type} {self.node!r} input {self.input_index} ({self.value!r}){origin}"


@dataclasses.dataclass(frozen=True)
class CpuFallback:
    """A node the CUDA provider has no kernel for: it runs on the CPU provider, its device inputs copied to the
    host and its outputs back."""

    node: str  # the ONNX node's name
    op_type: str
    domain: str
    reason: str
    fx_node: str  # the ATen node the ONNX node was lowered from, where its metadata says

    def __str__(self) -> str:
        origin = f" (lowered from {self.fx_node})" if self.fx_node else ""
        op = f"{self.domain}::{self.op_type}" if self.domain not in ("", "ai.onnx") else self.op_type
        return f"{op} {self.node!r}: {self.reason}{origin}"


@functools.cache
def cuda_kernels() -> dict:
    """The table of the CUDA provider's kernels (``opset_tables/ort_cuda_kernels.json``)."""
    if not CUDA_KERNELS_PATH.exists():
        raise FileNotFoundError(f"{CUDA_KERNELS_PATH} is missing: the CUDA kernel table comes with a source "
                                "checkout (python -m aot2onnx ort-kernels writes it)")
    return json.loads(CUDA_KERNELS_PATH.read_text())


def _fx_node(node: onnx.NodeProto) -> str:
    return next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.fx_node"), "")


def host_round_trips(model: onnx.ModelProto, host_inputs: Iterable[str] = ()) -> list[HostRoundTrip]:
    """The device-to-host copies ONNX Runtime's CUDA provider would make running ``model``, in graph order.

    ``host_inputs`` names the graph inputs bound in host memory (the runtime binds symbolic sizes there).
    Functions are inlined first, as ONNX Runtime does; subgraphs (If and Loop bodies) are searched too, a
    value of the enclosing graph being on the host where it is there. Nodes with no CUDA kernel are
    :func:`cpu_fallbacks`' to report.
    """
    return _analyse(model, host_inputs, None)[0]


def cpu_fallbacks(model: onnx.ModelProto, host_inputs: Iterable[str] = (),
                  kernels: dict | None = None) -> list[CpuFallback]:
    """The nodes of ``model`` (and of its subgraphs) that ONNX Runtime's CUDA provider has no kernel for, in
    graph order, each with copies of its device inputs to the host and its outputs back.

    A node has a kernel where one is registered for its domain and op type over the version of the op the
    model's opset selects, and for the element types of its inputs and outputs where their types are known
    (graph inputs and outputs, initializers, value_info, Constant nodes). A node whose inputs are all on the
    host runs on the CPU provider with no copy in: one computed from shapes (see :func:`host_round_trips`), or
    from the outputs of nodes reported already. It is not reported, nor is a node of an op that no provider
    has a kernel for and ONNX defines as a function (CastLike, Mish): ONNX Runtime runs the function's body in
    its place. ``kernels`` is the table (:func:`cuda_kernels` by default).
    """
    return _analyse(model, host_inputs, cuda_kernels() if kernels is None else kernels)[1]


def _analyse(model: onnx.ModelProto, host_inputs: Iterable[str], kernels: dict | None,
             ) -> tuple[list[HostRoundTrip], list[CpuFallback]]:
    """The host round trips and, given the table of CUDA kernels, the CPU fallbacks of ``model``."""
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    opsets = {("ai.onnx" if o.domain == "" else o.domain): o.version for o in model.opset_import}
    checker = None if kernels is None else _KernelCheck(kernels, opsets)
    host = {t.name for t in model.graph.initializer} | set(host_inputs)
    trips: list[HostRoundTrip] = []
    fallbacks: list[CpuFallback] = []
    _scan(model.graph, host, {}, checker, trips, fallbacks)
    return trips, fallbacks


def _element_types(graph: onnx.GraphProto, outer: dict[str, int]) -> dict[str, int]:
    """Value name -> ONNX element type, where the graph declares it."""
    types = dict(outer)
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
            types[value.name] = value.type.tensor_type.elem_type
    types.update((t.name, t.data_type) for t in graph.initializer)
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output:
            for attribute in node.attribute:
                if attribute.name == "value":
                    types[node.output[0]] = attribute.t.data_type
    return types


class _KernelCheck:
    """Whether the CUDA provider has a kernel for a node, at the model's opsets."""

    def __init__(self, kernels: dict, opsets: dict[str, int]) -> None:
        self.domains: dict[str, dict] = kernels["domains"]
        self.cpu_ops: dict[str, list[str]] = kernels.get("cpu_ops", {})
        self.opsets = opsets

    def _schema(self, op_type: str, domain: str) -> onnx.defs.OpSchema | None:
        """The schema of the op the model's opset for ``domain`` selects."""
        try:
            return onnx.defs.get_schema(op_type, self.opsets.get(domain, 1), "" if domain == "ai.onnx" else domain)
        except onnx.defs.SchemaError:
            return None

    def missing(self, node: onnx.NodeProto, types: dict[str, int]) -> str | None:
        """Why ``node`` runs on the CPU provider for want of a CUDA kernel, or None where it does not."""
        domain = "ai.onnx" if node.domain == "" else node.domain
        if domain == FUSED_DOMAIN:
            return "aot2onnx's fused kernels run on the CPU only"
        schema = self._schema(node.op_type, domain)
        reason = self._no_kernel(node, types, domain, schema.since_version if schema else self.opsets.get(domain, 1))
        if reason and schema and (schema.has_function or schema.has_context_dependent_function) and (
                node.op_type not in self.cpu_ops.get(domain, ())):
            return None  # no provider takes it: ONNX Runtime replaces it with its function's body (CastLike: Cast)
        return reason

    def _no_kernel(self, node: onnx.NodeProto, types: dict[str, int], domain: str, version: int) -> str | None:
        """Why the CUDA provider has no kernel for ``node``, whose op has ``version`` (ONNX Runtime matches
        kernels by it), or None where it has one."""
        entry = self.domains.get(domain, {}).get(node.op_type)
        if entry is None:
            return "no CUDA kernel for this op"
        in_range = [k for k in entry["kernels"]
                    if k["versions"][0] <= version and (k["versions"][1] is None or version <= k["versions"][1])]
        if not in_range:
            ranges = ", ".join(_range(k["versions"]) for k in entry["kernels"])
            return f"no CUDA kernel for version {version} (opset {self.opsets.get(domain, 1)}); kernels: {ranges}"
        named = [*zip(entry["inputs"], node.input), *zip(entry["outputs"], node.output)]
        bound = [(c, types.get(name)) for c, name in named if c is not None and name]
        rejected = []
        for kernel in in_range:
            wrong = [(c, t) for c, t in bound
                     if t is not None and c in kernel["types"] and _type_name(t) not in kernel["types"][c]]
            if not wrong:
                return None
            rejected.extend(f"{c}={_type_name(t)}" for c, t in wrong if f"{c}={_type_name(t)}" not in rejected)
        return f"no CUDA kernel for {', '.join(rejected)} at version {version}"


def _range(versions: list[int | None]) -> str:
    first, last = versions
    return f"{first}+" if last is None else str(first) if first == last else f"{first}-{last}"


def _type_name(elem_type: int) -> str:
    """ONNX element type -> OperatorKernels.md's name for it: FLOAT -> float, BFLOAT16 -> bfloat16."""
    return onnx.TensorProto.DataType.Name(elem_type).lower()


def _scan(graph: onnx.GraphProto, host: set[str], outer_types: dict[str, int], checker: _KernelCheck | None,
          trips: list[HostRoundTrip], fallbacks: list[CpuFallback]) -> None:
    host = host | {t.name for t in graph.initializer}
    types = _element_types(graph, outer_types)
    for node in graph.node:
        for index in HOST_INPUTS.get(node.op_type, ()) if node.domain in ("", "ai.onnx") else ():
            if index < len(node.input) and node.input[index] and node.input[index] not in host:
                trips.append(HostRoundTrip(node.name, node.op_type, index, node.input[index], _fx_node(node)))
        inputs = [name for name in node.input if name]
        on_host = (node.domain in ("", "ai.onnx") and (
            node.op_type in _HOST_OUTPUTS
            or node.op_type == "Constant"
            or (node.op_type in _HOST_COMPUTABLE and inputs and all(name in host for name in inputs))
        ))
        if not on_host and checker is not None and (reason := checker.missing(node, types)) is not None:
            # On the CPU provider, its outputs are on the host.
            if not (inputs and all(name in host for name in inputs)):
                fallbacks.append(CpuFallback(node.name, node.op_type, node.domain, reason, _fx_node(node)))
            on_host = True
        if on_host:
            host.update(name for name in node.output if name)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _scan(attribute.g, host, types, checker, trips, fallbacks)
            for subgraph in attribute.graphs:
                _scan(subgraph, host, types, checker, trips, fallbacks)
