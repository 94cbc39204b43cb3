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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import onnx

__all__ = ["HOST_INPUTS", "HostRoundTrip", "host_round_trips"]

# The inputs the CUDA provider's kernels take in host memory, per op type (positions), for the opsets the
# lowering targets (18 and later). From onnxruntime/core/providers/cuda: the kernels' InputMemoryType.
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
    "DFT": (1, 2),
    "STFT": (1, 3),
    "Compress": (1,),
    "Col2Im": (1, 2),
    "MaxUnpool": (2,),
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


def _fx_node(node: onnx.NodeProto) -> str:
    return next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.fx_node"), "")


def host_round_trips(model: onnx.ModelProto, host_inputs: Iterable[str] = ()) -> list[HostRoundTrip]:
    """The device-to-host copies ONNX Runtime's CUDA provider would make running ``model``, in graph order.

    ``host_inputs`` names the graph inputs bound in host memory (the runtime binds symbolic sizes there).
    Functions are inlined first, as ONNX Runtime does; subgraphs (If and Loop bodies) are searched too, a
    value of the enclosing graph being on the host where it is there.
    """
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    host = {t.name for t in model.graph.initializer} | set(host_inputs)
    found: list[HostRoundTrip] = []
    _scan(model.graph, host, found)
    return found


def _scan(graph: onnx.GraphProto, host: set[str], found: list[HostRoundTrip]) -> None:
    host = host | {t.name for t in graph.initializer}
    for node in graph.node:
        for index in HOST_INPUTS.get(node.op_type, ()) if node.domain in ("", "ai.onnx") else ():
            if index < len(node.input) and node.input[index] and node.input[index] not in host:
                found.append(HostRoundTrip(node.name, node.op_type, index, node.input[index], _fx_node(node)))
        inputs = [name for name in node.input if name]
        if node.domain in ("", "ai.onnx") and (
            node.op_type in _HOST_OUTPUTS
            or node.op_type == "Constant"
            or (node.op_type in _HOST_COMPUTABLE and inputs and all(name in host for name in inputs))
        ):
            host.update(name for name in node.output if name)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _scan(attribute.g, host, found)
            for subgraph in attribute.graphs:
                _scan(subgraph, host, found)
