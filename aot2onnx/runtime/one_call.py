"""A CPU graph's run in one call: every input wrapped and every output returned by ONNX Runtime in one C++ call.

``IOBinding`` binds tensors one Python call at a time: per input a name lookup, an ``OrtValue`` and a
bookkeeping tuple, so a graph with 60 inputs paid 0.3-0.5 ms of Python a call (the Hugging Face GPT-2 of
the benchmark's device suite). Here the inputs go in as one ``OrtValueVector`` filled by ``push_back_batch``
(ONNX Runtime wraps each tensor's memory, no copy), the session runs with ``run_with_ortvaluevector``, and
the outputs, allocated by ONNX Runtime as before, come back as DLPack capsules from one ``to_dlpacks`` call.
What stays in Python is a list comprehension per attribute (contiguity, device, address, dtype, shape).

Not every graph can run this way; :func:`refusal` says why one cannot, and that graph keeps its
``IOBinding``:

- a graph on another device than the CPU (CUDA graphs and user streams need the binding);
- a graph that writes an input in place (``runtime.inplace``): its output must be bound on the input's
  memory, which this call has no way to ask for beside outputs ONNX Runtime allocates;
- an input of a dtype numpy has no type for (bfloat16, under autocast): ``push_back_batch`` takes numpy
  dtypes;
- a complex input or output: the binding hands it over as its real pairs.

A returned output that is a view of a value computed in the graph (``view``, ``reshape``, ``squeeze``,
``unsqueeze``, ``flatten``, ``clone``: a Reshape, Squeeze, Unsqueeze, Flatten or Identity node) costs a copy in
ONNX Runtime, which gives every graph output memory of its own: the Hugging Face GPT-2's and the benchmark GPT's
forward graphs return a dozen such views of their activations, saved for the backward pass (``x.view(-1, d)``
for a product's weight gradient). :func:`view_outputs` has the graph return the viewed value itself, and the
session gives it the output's shape on the same memory, without a copy (:func:`with_shape`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch.utils.dlpack import from_dlpack as _from_capsule

from aot2onnx.errors import RuntimeSessionError
from aot2onnx.runtime import _ort_compat
from aot2onnx.runtime.dtypes import TORCH_TO_ONNX
from aot2onnx.signature import GraphSignature, InputKind

__all__ = ["OneCallRun", "refusal", "view_outputs", "with_shape"]

# The dtypes push_back_batch takes (as numpy's), by torch dtype, and their ONNX element types.
_NUMPY = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}
_ONNX_TYPES = frozenset(TORCH_TO_ONNX[dtype] for dtype in _NUMPY)

# An address for a tensor with no elements, whose data_ptr() may be 0: push_back_batch refuses a null
# pointer, and ONNX Runtime never reads an empty tensor's memory.
_EMPTY = torch.zeros(1, dtype=torch.uint8)


def refusal(model: onnx.ModelProto, signature: GraphSignature, device: torch.device, providers: list[Any],
            in_place: frozenset[str]) -> str | None:
    """Why the graph cannot run in one call (module docstring), or None where it can."""
    if device.type != "cpu" or providers != ["CPUExecutionProvider"]:
        return "it runs on another provider than ONNX Runtime's CPU one"
    if signature.has_complex:
        return "a complex tensor crosses its boundary (bound as its real pairs, a view made per call)"
    if _ort_compat.ort_value_vector() is None:
        return "this onnxruntime has no OrtValueVector.push_back_batch or run_with_ortvaluevector"
    if in_place:
        return "it writes inputs in place"
    for value in model.graph.input:
        if value.type.tensor_type.elem_type not in _ONNX_TYPES:
            return f"input {value.name!r} has a dtype numpy has no type for"
    return None


# The nodes whose output is their first input's elements in the same order: a view in torch, a copy in ONNX
# Runtime where the output is the graph's.
_VIEWS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})

# The smallest output replaced: giving a tensor its shape back costs about 2 us of Python, the copy of 64 KiB
# about as much (2 cores, 2026-11-28); the device suite's 64 KiB views measured no faster, the main suite's
# 256 KiB to 1 MiB ones 3-5% on the GPT's and the transformer layer's step.
_VIEW_MIN_BYTES = 256 * 1024


def view_outputs(model: onnx.ModelProto,
                 returned: Sequence[str]) -> tuple[onnx.ModelProto, dict[int, tuple[str, tuple[int, ...]]]]:
    """``model`` with each returned output that views another value of the graph replaced by that value, and
    for each replaced output, by position in ``returned``, the value's name and the shape to give it back
    (module docstring); ``model`` itself where there is none.

    An output is replaced where it is made by a Reshape, Squeeze, Unsqueeze, Flatten or Identity node of the
    standard domain, its declared shape is static, it holds at least :data:`_VIEW_MIN_BYTES`, and the viewed
    value is computed by a node (not a graph input or a constant, whose memory is not the run's own) and
    neither returned by the graph itself nor viewed by another replaced output: the memory then belongs to
    that one output, as a copy's would, and no two outputs share it (a user's in-place write to one cannot
    reach a tensor saved for the backward pass).
    Outputs holding written inputs' new values or checks are left alone: ``returned`` names the returned ones.
    """
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    outputs = {o.name: o for o in graph.output}
    taken = {*outputs, *(i.name for i in graph.input), *(i.name for i in graph.initializer)}
    taken |= {out for node in graph.node if node.op_type == "Constant" for out in node.output}
    replaced: dict[int, tuple[str, tuple[int, ...]]] = {}
    for position, name in enumerate(returned):
        node, declared = producers.get(name), outputs.get(name)
        if node is None or declared is None or node.domain not in ("", "ai.onnx") or node.op_type not in _VIEWS:
            continue
        source = node.input[0]
        tensor_type = declared.type.tensor_type
        dims = tensor_type.shape.dim if tensor_type.HasField("shape") else None
        if not source or source in taken or dims is None or not all(d.HasField("dim_value") for d in dims):
            continue
        shape = tuple(d.dim_value for d in dims)
        if math.prod(shape) * onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type).itemsize < _VIEW_MIN_BYTES:
            continue
        taken.add(source)
        replaced[position] = (source, shape)
    if not replaced:
        return model, {}
    renamed = {returned[position]: source for position, (source, _) in replaced.items()}
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    for output in rewritten.graph.output:
        if output.name in renamed:
            output.name = renamed[output.name]
            output.type.tensor_type.ClearField("shape")  # the viewed value's shape, which ONNX Runtime infers
    return rewritten, replaced


class OneCallRun:
    """The names, devices and positions of one graph's run in one call; :meth:`run` runs it."""

    def __init__(self, signature: GraphSignature, output_names: Sequence[str]) -> None:
        inputs = [(i, spec) for i, spec in enumerate(signature.inputs) if spec.kind is not InputKind.UNUSED]
        self.positions = [i for i, _ in inputs]
        self.names = [spec.onnx_name for _, spec in inputs]
        self.symints = [k for k, (_, spec) in enumerate(inputs) if spec.kind is InputKind.SYMINT]
        self.output_names = list(output_names)
        cpu = _ort_compat.c_device("cpu")
        self.input_devices = [cpu] * len(self.names)
        self.output_devices = [cpu] * len(self.output_names)
        self.run_options = ort.RunOptions()

    def inputs(self, args: Sequence[Any]) -> list[torch.Tensor]:
        """The inputs in ``names``' order, sizes as 0-d int64 tensors; the native run (runtime.native_run) copies
        a tensor that is not contiguous or not on the CPU itself."""
        tensors = [args[i] for i in self.positions]
        for k in self.symints:
            tensors[k] = torch.tensor(int(tensors[k]), dtype=torch.int64)
        return tensors

    def tensors(self, args: Sequence[Any], graph_name: str) -> list[torch.Tensor]:
        """The inputs as ONNX Runtime takes them: contiguous CPU tensors, sizes as 0-d int64 tensors."""
        tensors = self.inputs(args)
        if not all([t.is_cpu and t.is_contiguous() for t in tensors]):
            tensors = [t if t.is_cpu and t.is_contiguous() else _fix(t, graph_name) for t in tensors]
        return tensors

    def run(self, sess_run: Any, tensors: list[torch.Tensor], shapes: list[torch.Size]) -> list[torch.Tensor]:
        """Runs the session (``run_with_ortvaluevector``, or a timed wrapper of it) on ``tensors`` of ``shapes``;
        the outputs in the order of ``output_names``. An input dtype numpy has no type for raises KeyError before
        the run."""
        feeds = _ort_compat.ort_value_vector()
        feeds.push_back_batch(
            tensors,
            [t.data_ptr() or _EMPTY.data_ptr() for t in tensors],
            [_NUMPY[t.dtype] for t in tensors],
            shapes,
            self.input_devices,
        )
        fetches = _ort_compat.ort_value_vector()
        sess_run(self.run_options, self.names, feeds, self.output_names, fetches, self.output_devices)
        return fetches.to_dlpacks(_from_capsule)


def with_shape(tensor: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    """``tensor``'s memory as a contiguous tensor of ``shape``, which it owns with ``tensor`` as torch's views do
    but is no view (``_base`` None): an in-place write to it is a plain tensor's, as to a copy."""
    if tensor.numel() != math.prod(shape):
        raise RuntimeSessionError(
            f"ONNX Runtime returned {name!r} with {tensor.numel()} elements, where the output it stands for has "
            f"shape {list(shape)}: a bug of aot2onnx's, please report it")
    return torch.empty(0, dtype=tensor.dtype).set_(tensor.untyped_storage(), tensor.storage_offset(), shape)


def _fix(tensor: Any, graph_name: str) -> torch.Tensor:
    """A tensor the one-call run can wrap: contiguous and on the CPU (a CPU scalar tensor as torch allows
    beside others; any other tensor on another device is an error, as in the binding path)."""
    if not tensor.is_cpu:
        if tensor.dim() != 0:
            raise RuntimeSessionError(f"graph {graph_name!r} was compiled for cpu but got a tensor on {tensor.device}")
        tensor = tensor.cpu()
    return tensor.contiguous()
