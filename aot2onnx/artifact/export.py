"""Export a module's training step for devices: forward.onnx, backward.onnx, optimizer.onnx, state, signature.

``export_training`` traces the module's joint forward-backward graph with AOTAutograd
(``aot_export_joint_with_descriptors``), partitions it with the same min-cut partitioner as the backend,
lowers both halves with :func:`aot2onnx.lower.translate.lower_graph`, and writes the artifact described in
``docs/artifact-format.md``. ``python -m aot2onnx export`` is the command line (aot2onnx/tools/export.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import itertools
import json
import logging
import os
import pathlib
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime
import safetensors.torch
import torch
import torch.fx
import torch.nn as nn

from aot2onnx._version import __version__
from aot2onnx.artifact.optim import Optimizer, ParamInfo, grad_name, updated_name
from aot2onnx.capture._torch_compat import aot_descriptors as aot_desc
from aot2onnx.capture.joint import WRAPPER_PREFIX, trace_joint
from aot2onnx.errors import CaptureError
from aot2onnx.lower.plan import decompositions
from aot2onnx.lower.registry import default_registry
from aot2onnx.lower.translate import lower_graph
from aot2onnx.options import DEFAULT_OPSET
from aot2onnx.runtime.dtypes import TORCH_TO_ONNX
from aot2onnx.runtime.kernels import check_target_opset, require_runnable
from aot2onnx.runtime.rewrites import disabled_optimizers, serial_nodes
from aot2onnx.signature import GraphKind, InputKind, LoweredGraph, OutputKind

__all__ = ["TrainingArtifact", "export_training", "forward_input_names"]

logger = logging.getLogger("aot2onnx")

BATCH_DIM = "batch"
LOSS_NAME = "loss"
GRAD_OF_LOSS_NAME = grad_name(LOSS_NAME)


@dataclasses.dataclass(frozen=True)
class TrainingArtifact:
    """What :func:`export_training` wrote."""

    out_dir: pathlib.Path
    signature: dict
    files: dict[str, int]  # file name -> size in bytes
    onnx_nodes: dict[str, int]  # model file -> node count

    def summary(self) -> str:
        sig = self.signature
        kinds = {k: [s for s in sig["state"] if s["kind"] == k] for k in ("parameter", "buffer", "optimizer_state")}
        numel = {k: sum(int(np.prod(s["shape"], dtype=np.int64)) for s in v) for k, v in kinds.items()}
        trainable = sum(1 for s in kinds["parameter"] if s.get("requires_grad"))
        lines = [f"wrote {self.out_dir}/"]
        width = max(map(len, self.files))
        for name, size in self.files.items():
            nodes = f"  {self.onnx_nodes[name]} nodes" if name in self.onnx_nodes else ""
            lines.append(f"  {name.ljust(width)}  {_human_bytes(size):>9}{nodes}")
        lines.append(
            f"state: {len(kinds['parameter'])} parameters ({numel['parameter']:,} values, {trainable} trainable), "
            f"{len(kinds['buffer'])} buffers ({numel['buffer']:,} values), "
            f"{len(kinds['optimizer_state'])} optimizer state tensors ({numel['optimizer_state']:,} values)"
        )
        inputs = ", ".join(f"{u['name']}: {u['dtype']}{u['shape']}" for u in sig["user_inputs"])
        lines.append(f"inputs: {inputs}")
        if sig["dims"]:
            dims = ", ".join(f"{n} (example {d['example']}, min {d['min']}, max {d['max']})" for n, d in sig["dims"].items())
            lines.append(f"symbolic dims: {dims}")
        optimizer = sig["optimizer"]["hyperparameters"] if sig["optimizer"] else None
        lines.append(f"optimizer: {json.dumps(optimizer) if optimizer else 'none (no optimizer.onnx)'}")
        lines.append(f"opset {sig['versions']['opset']}, format {sig['format']}")
        return "\n".join(lines)


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


class _Progress:
    """Stage-by-stage progress: one line per stage; on a terminal, a live clock while a stage runs."""

    def __init__(self, stages: int, write: Callable[[str], None] | None, live: bool = False) -> None:
        self._stages, self._write, self._live = stages, write, live
        self._index = 0

    @contextlib.contextmanager
    def stage(self, what: str):
        self._index += 1
        label = f"[{self._index}/{self._stages}] {what}"
        start = time.perf_counter()
        stop = threading.Event()
        ticker = None
        if self._write and self._live:
            def tick() -> None:
                while not stop.wait(0.5):
                    self._write(f"\r{label} ... {time.perf_counter() - start:.0f}s")
            ticker = threading.Thread(target=tick, daemon=True)
            ticker.start()
        elif self._write:
            self._write(f"{label} ...\n")
        try:
            yield
        finally:
            stop.set()
            if ticker is not None:
                ticker.join()
            seconds = time.perf_counter() - start
            logger.info("aot2onnx export: %s: %.2fs", what, seconds)
            if self._write:
                self._write(f"\r{label} ... done in {seconds:.1f}s\n" if self._live else f"    done in {seconds:.1f}s\n")


@dataclasses.dataclass
class _Captured:
    """One graph of the partitioned joint graph, before and after lowering."""

    input_descs: list[Any]  # AOTInput per placeholder
    input_names: list[str]  # FX placeholder names
    output_descs: list[Any]  # AOTOutput per output position
    output_names: list[str | None]  # FX node name per output position (None for constants)
    lowered: LoweredGraph | None = None


# Tied names -> the state entry's name, for the export in progress: AOTAutograd lifts a tied tensor under one
# of its names, not necessarily the one named_parameters() lists first.
_TIED: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("aot2onnx_tied", default=None)


def _module_name(target: str) -> str:
    """The module's own name for a tensor AOTAutograd names ``target`` (under the loss-first wrapper)."""
    if not target.startswith(WRAPPER_PREFIX):
        raise AssertionError(f"unexpected state name {target!r}")
    return target[len(WRAPPER_PREFIX):]


def _strip(target: str) -> str:
    """The state entry of the tensor AOTAutograd names ``target``: a tied name maps to the entry it shares."""
    name = _module_name(target)
    return (_TIED.get() or {}).get(name, name)


def _describe(gm: torch.fx.GraphModule) -> _Captured:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    returned = output.args[0] if isinstance(output.args[0], (list, tuple)) else (output.args[0],)
    descs = output.meta.get("desc") or [None] * len(returned)
    return _Captured(
        [p.meta.get("desc") for p in placeholders],
        [p.name for p in placeholders],
        list(descs),
        [a.name if isinstance(a, torch.fx.Node) else None for a in returned],
    )


@dataclasses.dataclass
class _Trace:
    forward: _Captured
    backward: _Captured
    symbols: dict[str, str]  # tracing symbol -> artifact dim name
    dims: dict[str, dict]  # artifact dim name -> {"example", "min", "max"}
    dynamic: list[bool]  # per user input: is its first dim the batch?
    returns: str  # "loss" or "tuple"


def _capture(
    module: nn.Module, example_inputs: Sequence[torch.Tensor], *, dynamic_batch: bool, opset: int,
    progress: _Progress,
) -> _Trace:
    """Traces the joint graph (capture/joint.py), partitioned, and lowers both halves."""
    registry = default_registry()
    graphs: dict[GraphKind, _Captured] = {}

    def lower(kind: GraphKind, gm: torch.fx.GraphModule) -> None:
        graphs[kind] = captured = _describe(gm)
        nodes = sum(1 for n in gm.graph.nodes if n.op == "call_function")
        with progress.stage(f"lowering the {kind} graph ({nodes} FX nodes)"):
            captured.lowered = lower_graph(gm, name=f"{type(module).__name__}_{kind}", opset=opset, registry=registry)
            require_runnable(captured.lowered.model, opset, f"{type(module).__name__}_{kind}")

    joint = trace_joint(
        module, example_inputs, dynamic_batch=dynamic_batch,
        decompositions=decompositions(registry, opset),  # the backend's
        compile_graph=lower, stage=progress.stage,
    )
    dims: dict = {}
    symbols: dict[str, str] = {}
    if joint.batch is not None:
        dims[BATCH_DIM] = joint.batch
        symbols[joint.batch_symbol] = BATCH_DIM
    return _Trace(graphs[GraphKind.FORWARD], graphs[GraphKind.BACKWARD], symbols, dims, joint.dynamic, joint.returns)


# ---------------------------------------------------------------------------------------------------------
# Naming: the ONNX models' inputs and outputs are renamed after what they carry.


def _all_names(graph: ir.Graph) -> set[str]:
    names = {v.name for v in graph.inputs} | set(graph.initializers)
    for node in ir.traversal.RecursiveGraphIterator(graph):
        names.update(v.name for v in node.outputs if v.name)
    return names


class _Renamer:
    """Gives graph inputs and outputs their artifact names, moving any internal value out of the way."""

    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self.used = _all_names(graph)
        self.claimed: set[str] = set()
        self._fresh = itertools.count()

    def claim(self, value: ir.Value, name: str) -> str:
        if name in self.claimed:
            raise AssertionError(f"two graph inputs or outputs would be named {name!r}")
        if value.name != name and name in self.used:
            other = self._find(name)
            if other is not None:
                other.name = self._unused(f"{name}__internal")
        self.used.discard(value.name)
        value.name = name
        self.used.add(name)
        self.claimed.add(name)
        return name

    def _find(self, name: str) -> ir.Value | None:
        for v in self.graph.inputs:
            if v.name == name:
                return v
        for node in ir.traversal.RecursiveGraphIterator(self.graph):
            for v in node.outputs:
                if v.name == name:
                    return v
        return self.graph.initializers.get(name)

    def _unused(self, base: str) -> str:
        name = base
        while name in self.used:
            name = f"{base}{next(self._fresh)}"
        self.used.add(name)
        return name

    def expose(self, value: ir.Value, name: str) -> ir.Value:
        """A new graph output ``name`` holding ``value`` (an input, or a value already output under another name)."""
        node = ir.node("Identity", [value])
        self.graph.append(node)
        out = node.outputs[0]
        out.dtype, out.shape = value.dtype, value.shape
        self.claim(out, name)
        self.graph.outputs.append(out)
        return out


def _rename_dims(graph: ir.Graph, symbols: dict[str, str]) -> None:
    """Renames tracing symbols (``s26``) in every symbolic dim, including expressions such as ``16*s26``."""
    if not symbols:
        return
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, symbols)) + r")\b")

    def fix(value: ir.Value) -> None:
        if value.shape is None:
            return
        dims = [
            ir.SymbolicDim(pattern.sub(lambda m: symbols[m.group(1)], d.value))
            if isinstance(d, ir.SymbolicDim) and d.value else d
            for d in value.shape.dims
        ]
        value.shape = ir.Shape(dims)

    for value in graph.inputs:
        fix(value)
    for node in ir.traversal.RecursiveGraphIterator(graph):
        for value in node.outputs:
            fix(value)


def _io_entry(value: ir.Value, **fields: Any) -> dict:
    if value.shape is None or value.dtype is None:
        raise CaptureError(f"the lowered model does not know the dtype and shape of {value.name!r}; it cannot be "
                           "described in the signature")
    shape = [d if isinstance(d, int) else (d.value or "?") for d in value.shape.dims]
    return {"name": value.name, **fields, "dtype": value.dtype.numpy().name, "shape": shape}


def format_signature(signature: dict) -> str:
    """The signature as JSON for reading: one line per input, output and state entry."""

    def render(value: Any, indent: str) -> str:
        if isinstance(value, dict) and value and any(isinstance(v, (dict, list)) and v for v in value.values()):
            inner = indent + "  "
            items = [f"{inner}{json.dumps(k)}: {render(v, inner)}" for k, v in value.items()]
            return "{\n" + ",\n".join(items) + "\n" + indent + "}"
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            inner = indent + "  "
            return "[\n" + ",\n".join(inner + json.dumps(v) for v in value) + "\n" + indent + "]"
        return json.dumps(value)

    return render(signature, "") + "\n"


@dataclasses.dataclass(frozen=True)
class _Feed:
    """What feeds a backward input that the forward graph saved: a forward output or a forward input."""

    name: str  # the artifact name of that forward output or input
    role: str  # "saved", or the forward input's role ("parameter", "buffer", "user_input")
    source: Any  # the forward output's name (saved), or the input's state name / position


def _lowered_values(captured: _Captured, graph: ir.Graph) -> tuple[list[ir.Value | None], list[ir.Value | None]]:
    """The ONNX value of each FX placeholder and of each FX output position (None: unused input, constant)."""
    inputs = {v.name: v for v in graph.inputs}
    outputs = {v.name: v for v in graph.outputs}
    in_values = [inputs[s.onnx_name] if s.kind is not InputKind.UNUSED else None for s in captured.lowered.signature.inputs]
    out_values: list[ir.Value | None] = []
    for spec in captured.lowered.signature.outputs:
        if spec.kind in (OutputKind.TENSOR, OutputKind.SYMINT):
            out_values.append(outputs[spec.onnx_name])
        elif spec.kind is OutputKind.INPUT:
            out_values.append(in_values[spec.index])
        elif spec.kind is OutputKind.DUPLICATE:
            out_values.append(out_values[spec.index])
        else:
            out_values.append(None)
    return in_values, out_values


def _fx_input_role(desc: Any, input_names: Sequence[str]) -> tuple[str, Any, str]:
    """(role, source, artifact name) of a forward or backward input that AOTAutograd lifted from the module."""
    # A tied tensor is lifted once per name: each such input keeps its name and reads the one state entry.
    if isinstance(desc, aot_desc.ParamAOTInput):
        return "parameter", _strip(desc.target), _module_name(desc.target)
    if isinstance(desc, aot_desc.BufferAOTInput):
        return "buffer", _strip(desc.target), _module_name(desc.target)
    if isinstance(desc, aot_desc.PlainAOTInput):
        return "user_input", desc.idx, input_names[desc.idx]
    raise CaptureError(f"a graph takes an input AOTAutograd describes as {desc}; it cannot be exported")


def _output(renamer: _Renamer, value: ir.Value, name: str, inputs: set[int]) -> ir.Value:
    """``value`` as the graph output ``name``: renamed if it is a fresh value, else through an Identity."""
    if id(value) in inputs or value.name in renamer.claimed:
        return renamer.expose(value, name)
    renamer.claim(value, name)
    return value


def _finish(model: ir.Model, inputs: list[tuple[ir.Value, dict]], outputs: list[tuple[ir.Value, dict]],
            symbols: dict[str, str], file: str) -> dict:
    """Sets the graph's inputs and outputs to those given, in order; returns the signature section."""
    graph = model.graph
    graph.outputs.clear()
    graph.outputs.extend(v for v, _ in outputs)
    _rename_dims(graph, symbols)
    return {
        "model": file,
        "inputs": [_io_entry(v, **fields) for v, fields in inputs],
        "outputs": [_io_entry(v, **fields) for v, fields in outputs],
    }


def _forward_model(captured: _Captured, input_names: Sequence[str], symbols: dict[str, str]) -> tuple[ir.Model, dict, dict[str, _Feed]]:
    """The forward model with artifact names, its signature section, and what feeds each saved FX value."""
    model = ir.serde.deserialize_model(captured.lowered.model)
    renamer = _Renamer(model.graph)
    in_values, out_values = _lowered_values(captured, model.graph)
    inputs, input_ids = [], {id(v) for v in in_values if v is not None}
    roles = [_fx_input_role(desc, input_names) for desc in captured.input_descs]
    for value, (role, source, name) in zip(in_values, roles):
        if value is not None:
            renamer.claim(value, name)
            inputs.append((value, {"role": role, "source": source}))

    outputs, feeds = [], {}
    for position, (desc, value) in enumerate(zip(captured.output_descs, out_values)):
        spec = captured.lowered.signature.outputs[position]
        fx_name = captured.output_names[position]
        if isinstance(desc, (aot_desc.SavedForBackwardsAOTOutput, aot_desc.SavedForBackwardsNoVcCheckAOTOutput)):
            if spec.kind is OutputKind.INPUT:
                role, source, name = roles[spec.index]
                feeds[fx_name] = _Feed(name, role, source)
            elif value is None:
                raise CaptureError(f"the forward graph saves the constant {spec.value!r} for backward; it cannot be exported")
            elif value.name in renamer.claimed:  # already an output (a duplicate, or the loss itself)
                feeds[fx_name] = _Feed(value.name, "saved", value.name)
            else:
                name = renamer.claim(value, f"saved:{fx_name}")
                feeds[fx_name] = _Feed(name, "saved", name)
                outputs.append((value, {"role": "saved"}))
            continue
        if isinstance(desc, aot_desc.InputMutationAOTOutput):
            mutated = desc.mutated_input
            if not isinstance(mutated, aot_desc.BufferAOTInput):
                what = "a parameter" if isinstance(mutated, aot_desc.ParamAOTInput) else f"its input {mutated}"
                raise CaptureError(f"the module mutates {what} in place; of in-place updates, only buffers' can be exported")
            target = _strip(mutated.target)
            name, fields = updated_name(target), {"role": "buffer_update", "target": target}
        elif isinstance(desc, aot_desc.PlainAOTOutput) and desc.idx == 0:
            name, fields = LOSS_NAME, {"role": "loss"}
        elif isinstance(desc, aot_desc.PlainAOTOutput):
            name, fields = f"output_{desc.idx}", {"role": "user_output", "index": desc.idx}
        elif isinstance(desc, aot_desc.IntermediateBaseAOTOutput):
            continue  # the base of aliased outputs, for AOTAutograd's view replay; the outputs are returned too
        else:
            raise CaptureError(f"the forward graph returns an output AOTAutograd describes as {desc}; it cannot be exported")
        if value is None:
            raise CaptureError(f"forward output {fields['role']} is the Python constant {spec.value!r}; return a tensor")
        outputs.append((_output(renamer, value, name, input_ids), fields))
    return model, _finish(model, inputs, outputs, symbols, "forward.onnx"), feeds


def _backward_model(captured: _Captured, input_names: Sequence[str], feeds: dict[str, _Feed],
                    symbols: dict[str, str]) -> tuple[ir.Model, dict, list[str]]:
    """The backward model with artifact names, its signature section, and the parameters it gives gradients of."""
    model = ir.serde.deserialize_model(captured.lowered.model)
    renamer = _Renamer(model.graph)
    in_values, out_values = _lowered_values(captured, model.graph)
    inputs, input_ids = [], {id(v) for v in in_values if v is not None}
    for value, desc, fx_name in zip(in_values, captured.input_descs, captured.input_names):
        if value is None:
            continue
        if isinstance(desc, aot_desc.TangentAOTInput):
            if not (isinstance(desc.output, aot_desc.PlainAOTOutput) and desc.output.idx == 0):
                raise CaptureError(f"the backward graph takes a gradient of {desc.output}; only the loss is differentiated")
            name, fields = GRAD_OF_LOSS_NAME, {"role": "grad_of_loss"}
        elif desc is not None:
            role, source, name = _fx_input_role(desc, input_names)
            fields = {"role": role, "source": source}
        elif fx_name in feeds:
            feed = feeds[fx_name]
            name, fields = feed.name, {"role": feed.role, "source": feed.source}
        else:
            raise CaptureError(f"backward input {fx_name!r} is not among the forward graph's saved values")
        if name in renamer.claimed:  # two FX values that lowered to one ONNX value: each gets its own input
            name = f"{name}#{fx_name}"
        renamer.claim(value, name)
        inputs.append((value, fields))

    gradients: dict[str, list[ir.Value]] = {}
    for desc, value, spec in zip(captured.output_descs, out_values, captured.lowered.signature.outputs):
        if value is None and spec.kind is OutputKind.CONSTANT and spec.value is None:
            continue  # no gradient: a buffer, a user input, a frozen parameter
        if not (isinstance(desc, aot_desc.GradAOTOutput) and isinstance(desc.grad_of, aot_desc.ParamAOTInput)):
            raise CaptureError(f"the backward graph returns {desc}; only parameter gradients can be exported")
        param = _strip(desc.grad_of.target)
        if value is None:
            raise CaptureError(f"the gradient of {param} lowered to the constant {spec.value!r}; it cannot be exported")
        gradients.setdefault(param, []).append(value)
    outputs = []
    for param, values in gradients.items():
        total = values[0]
        for value in values[1:]:  # a tied parameter: the gradient is the sum over its names' uses
            add = ir.node("Add", [total, value])
            model.graph.append(add)
            total = add.outputs[0]
            total.dtype, total.shape = value.dtype, value.shape
        outputs.append((_output(renamer, total, grad_name(param), input_ids), {"role": "grad", "target": param}))
    return model, _finish(model, inputs, outputs, symbols, "backward.onnx"), list(gradients)


# ---------------------------------------------------------------------------------------------------------
# export_training


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def forward_input_names(module: nn.Module, count: int, taken: set[str]) -> list[str]:
    """The forward's parameter names for the user inputs (``input_<i>`` where there is none or it is taken)."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in itertools.takewhile(lambda p: p.kind in positional, parameters)][:count]
    names += [f"input_{i}" for i in range(len(names), count)]
    reserved = taken | {LOSS_NAME, GRAD_OF_LOSS_NAME}
    return [f"input_{i}" if name in reserved or ":" in name else name for i, name in enumerate(names)]


def _state(module: nn.Module) -> tuple[dict[str, torch.Tensor], list[dict], list[dict]]:
    """The module's parameters and buffers as state entries, and its tied ones.

    A tensor the module holds under several names (an LM head sharing the word embedding's weight) is one
    state entry, under the name ``named_parameters()`` lists first. AOTAutograd lifts it once per name: the
    forward and backward models take one input per name, each read from that entry, and the backward model
    returns one gradient for it, the sum over the names. Each further name is a ``tied`` entry naming the
    state entry it is.
    """
    tensors: dict[str, torch.Tensor] = {}
    entries: list[dict] = []
    tied: list[dict] = []
    seen: dict[int, str] = {}
    non_persistent = {f"{prefix}.{b}" if prefix else b for prefix, m in module.named_modules()
                      for b in m._non_persistent_buffers_set}
    named = [("parameter", n, t) for n, t in module.named_parameters(remove_duplicate=False)]
    named += [("buffer", n, t) for n, t in module.named_buffers(remove_duplicate=False)]
    for kind, name, tensor in named:
        if tensor is None:
            continue
        if id(tensor) in seen:
            tied.append({"name": name, "state": seen[id(tensor)]})
            continue
        seen[id(tensor)] = name
        entry = {"name": name, "kind": kind, "dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape)}
        if kind == "parameter":
            entry["requires_grad"] = tensor.requires_grad
        elif name in non_persistent:
            entry["persistent"] = False  # not in the module's state_dict, but the forward reads it
        entries.append(entry)
        tensors[name] = tensor.detach().to("cpu").contiguous()
    return tensors, entries, tied


def _attach_metadata(model: onnx.ModelProto, signature: dict, graph: str) -> onnx.ModelProto:
    from aot2onnx.artifact import edge  # see export_training

    disabled = ",".join(disabled_optimizers(model))  # what the runtime's sessions turn off for this model
    one_thread = ",".join(serial_nodes(model))  # what makes the runtime's session run on one thread
    for key, value in ((edge.SIGNATURE_KEY, json.dumps(signature, sort_keys=True)), (edge.GRAPH_KEY, graph),
                       (edge.DISABLED_OPTIMIZERS_KEY, disabled), (edge.ONE_THREAD_KEY, one_thread)):
        entry = next((p for p in model.metadata_props if p.key == key), None) or model.metadata_props.add()
        entry.key, entry.value = key, value
    return model


def _save_model(model: onnx.ModelProto, path: pathlib.Path) -> list[pathlib.Path]:
    """Writes the model; one over protobuf's 2 GiB limit keeps its large constants in ``<name>.data`` beside it."""
    if model.ByteSize() < 1_800_000_000:
        onnx.save_model(model, path)
        return [path]
    data = path.with_suffix(".onnx.data")
    onnx.save_model(model, path, save_as_external_data=True, location=data.name, size_threshold=1024)
    return [path, data]


def export_training(
    module: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    out_dir: str | os.PathLike,
    *,
    optimizer: Optimizer | None = None,
    dynamic_batch: bool = True,
    opset: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> TrainingArtifact:
    """Writes the training artifact of ``module`` into ``out_dir`` (format: ``docs/artifact-format.md``).

    Args:
        module: ``module(*example_inputs)`` returns the scalar loss, or a tuple whose first element is the loss
            and whose others are outputs the device wants to see (they are returned detached). The module is
            traced in its current mode (``train()`` for BatchNorm's batch statistics) and not modified. While
            it is traced, ``torch.compiler.is_compiling()`` and ``torch.compiler.is_exporting()`` are True, as
            under ``torch.export``: code that branches on them takes the path that holds for every input.
        example_inputs: Tensors, in the order ``module`` takes them. Their values are not used; their dtypes and
            shapes are.
        out_dir: Created if needed. ``forward.onnx``, ``backward.onnx``, ``optimizer.onnx`` (with an
            optimizer), ``state.safetensors`` and ``signature.json`` are written there.
        optimizer: ``aot2onnx.optim.SGD`` or ``aot2onnx.optim.AdamW``, or None for no optimizer model.
        dynamic_batch: Make the first dimension of every input whose first dimension equals the first input's a
            symbolic dimension named ``batch``. Otherwise every shape is the example's.
        opset: The ONNX opset of the models (default 18).
        progress: Called with progress text (stage lines), e.g. ``sys.stderr.write``.

    Raises:
        CaptureError: the module cannot be traced as one training step (see the message).
        UnsupportedOpError: ops without an ONNX lowering, all listed.
    """
    # The artifact's constants are edge.py's, the reference reader. Imported here: `import aot2onnx` must not
    # import edge, or `python -m aot2onnx.artifact.edge` would find it imported already and runpy would warn.

    if optimizer is not None and not isinstance(optimizer, Optimizer):
        raise TypeError(f"optimizer must be aot2onnx.optim.SGD, aot2onnx.optim.AdamW or None, got {optimizer!r}")
    example_inputs = tuple(example_inputs)
    if not all(isinstance(x, torch.Tensor) for x in example_inputs):
        raise TypeError("example_inputs must be tensors")
    example_inputs = tuple(x.detach() for x in example_inputs)
    opset = DEFAULT_OPSET if opset is None else int(opset)
    check_target_opset(opset)
    out_dir = pathlib.Path(out_dir)
    live = progress is not None and getattr(progress, "__self__", None) is not None and _isatty(progress.__self__)
    report = _Progress(6 if optimizer is not None else 5, progress, live=live)

    tensors, state, tied = _state(module)
    token = _TIED.set({t["name"]: t["state"] for t in tied})
    try:
        return _export(module, example_inputs, out_dir, optimizer, dynamic_batch, opset, report, tensors, state, tied)
    finally:
        _TIED.reset(token)


def _refuse_complex(tensors: dict[str, torch.Tensor], example_inputs: Sequence[Any]) -> None:
    """Complex tensors lower (as real pairs) and run in compiled graphs, but the artifact's signature, state file and
    torch-free trainers are real-valued: a complex parameter, buffer or input is refused before anything is traced."""
    named = [*((f"state {name!r}", t) for name, t in tensors.items()),
             *((f"input {i}", t) for i, t in enumerate(example_inputs))]
    found = [what for what, t in named if isinstance(t, torch.Tensor) and t.is_complex()]
    if found:
        raise CaptureError(
            f"complex tensors cannot be exported in a training artifact yet ({', '.join(found[:4])}"
            f"{' and more' if len(found) > 4 else ''} is complex): hold them as real tensors with a trailing axis of 2 "
            "(torch.view_as_real) and use torch.view_as_complex inside forward, or train with "
            "torch.compile(backend='aot2onnx'), which runs complex tensors"
        )


def _export(
    module: nn.Module, example_inputs: tuple[torch.Tensor, ...], out_dir: pathlib.Path, optimizer: Optimizer | None,
    dynamic_batch: bool, opset: int, report: _Progress, tensors: dict[str, torch.Tensor], state: list[dict],
    tied: list[dict],
) -> TrainingArtifact:
    from aot2onnx.artifact import edge  # see export_training

    input_names = forward_input_names(module, len(example_inputs), set(tensors))
    _refuse_complex(tensors, example_inputs)
    trace = _capture(module, example_inputs, dynamic_batch=dynamic_batch, opset=opset, progress=report)
    for kind, graph in (("forward", trace.forward), ("backward", trace.backward)):
        if graph.lowered.signature.has_complex:
            raise CaptureError(
                f"the {kind} graph takes or returns a complex tensor, which an "
                "artifact cannot describe yet (its signature, state file and trainers are real-valued); return "
                "torch.view_as_real(...) of it, or train with torch.compile(backend='aot2onnx'), which runs complex "
                "tensors"
            )
    with report.stage("naming the models' inputs and outputs"):
        forward_model, forward_section, feeds = _forward_model(trace.forward, input_names, trace.symbols)
        backward_model, backward_section, trained = _backward_model(trace.backward, input_names, feeds, trace.symbols)
        protos = {"forward": ir.serde.serialize_model(forward_model), "backward": ir.serde.serialize_model(backward_model)}
        for proto in protos.values():
            onnx.checker.check_model(proto)

    optimizer_section = None
    if optimizer is not None:
        with report.stage(f"building the {optimizer.name} step over {len(trained)} parameters"):
            infos = [ParamInfo(n, TORCH_TO_ONNX[tensors[n].dtype], tuple(tensors[n].shape)) for n in trained]
            step = optimizer.build(infos, opset=opset)
            protos["optimizer"] = step.model
            declared = {v.name: v for v in (*step.model.graph.input, *step.model.graph.output)}

            def entry(fields: dict) -> dict:
                t = declared[fields["name"]].type.tensor_type
                return {**fields, "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name,
                        "shape": [d.dim_value for d in t.shape.dim]}

            optimizer_section = {
                "model": "optimizer.onnx",
                "hyperparameters": optimizer.hyperparameters(),
                "inputs": [entry(f) for f in step.inputs],
                "outputs": [entry(f) for f in step.outputs],
            }
            for s in step.state:
                tensors[s["name"]] = torch.zeros(s["shape"], dtype=getattr(torch, s["dtype"]))
                state.append({k: v for k, v in s.items() if k != "init"})

    signature = {
        "format": edge.FORMAT,
        "versions": _versions(opset),
        "module": {"class": f"{type(module).__module__}.{type(module).__qualname__}", "returns": trace.returns},
        "dims": trace.dims,
        "user_inputs": [
            {"position": i, "name": name, "dtype": _dtype_name(x.dtype),
             "shape": [BATCH_DIM if d == 0 and dynamic else s for d, s in enumerate(x.shape)]}
            for i, (name, x, dynamic) in enumerate(zip(input_names, example_inputs, trace.dynamic))
        ],
        "state": state,
        **({"tied": tied} if tied else {}),
        "forward": forward_section,
        "backward": backward_section,
        "optimizer": optimizer_section,
    }

    with report.stage(f"writing {len(tensors)} state tensors and the models to {out_dir}"):
        out_dir.mkdir(parents=True, exist_ok=True)
        written: list[pathlib.Path] = []
        onnx_nodes = {}
        for graph, proto in protos.items():
            _attach_metadata(proto, signature, graph)
            written += _save_model(proto, out_dir / f"{graph}.onnx")
            onnx_nodes[f"{graph}.onnx"] = len(proto.graph.node)
        if optimizer is None:
            (out_dir / "optimizer.onnx").unlink(missing_ok=True)  # a stale one from an earlier export
        safetensors.torch.save_file(tensors, str(out_dir / "state.safetensors"), metadata={"format": edge.FORMAT})
        (out_dir / "signature.json").write_text(format_signature(signature))
        written += [out_dir / "state.safetensors", out_dir / "signature.json"]
    files = {p.name: p.stat().st_size for p in written}
    return TrainingArtifact(out_dir, signature, files, onnx_nodes)


def _isatty(stream: Any) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


def _versions(opset: int) -> dict:

    return {"aot2onnx": __version__, "torch": torch.__version__, "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__, "opset": opset}
