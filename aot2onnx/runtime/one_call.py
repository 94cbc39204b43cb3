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
"""

from __future__ import annotations

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

__all__ = ["OneCallRun", "refusal"]

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

    def tensors(self, args: Sequence[Any], graph_name: str) -> list[torch.Tensor]:
        """The inputs as ONNX Runtime takes them: contiguous CPU tensors, sizes as 0-d int64 tensors."""
        tensors = [args[i] for i in self.positions]
        for k in self.symints:
            tensors[k] = torch.tensor(int(tensors[k]), dtype=torch.int64)
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


def _fix(tensor: Any, graph_name: str) -> torch.Tensor:
    """A tensor the one-call run can wrap: contiguous and on the CPU (a CPU scalar tensor as torch allows
    beside others; any other tensor on another device is an error, as in the binding path)."""
    if not tensor.is_cpu:
        if tensor.dim() != 0:
            raise RuntimeSessionError(f"graph {graph_name!r} was compiled for cpu but got a tensor on {tensor.device}")
        tensor = tensor.cpu()
    return tensor.contiguous()
