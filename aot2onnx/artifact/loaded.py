"""``aot2onnx.load``: an exported training artifact as an ``nn.Module`` that trains with any torch optimizer.

The module's parameters and buffers come from ``state.safetensors``, under the names they had when exported.
Its forward runs ``forward.onnx`` and its backward ``backward.onnx``, each through an :class:`OrtGraph`, inside
a ``torch.autograd.Function`` of this module; the buffer updates the forward returns are copied into the
buffers afterwards, as AOTAutograd's epilogue does for a compiled model. Nothing is traced again.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import torch
import torch.nn as nn

from aot2onnx.errors import ArtifactError, RuntimeSessionError
from aot2onnx.options import Options
from aot2onnx.runtime.session import OrtGraph
from aot2onnx.signature import GraphKind, GraphSignature, InputKind, InputSpec, OutputKind, OutputSpec

if TYPE_CHECKING:
    from aot2onnx.artifact import edge

__all__ = ["LoadedModule", "load"]


def load(out_dir: str | os.PathLike, **options: Any) -> LoadedModule:
    """The artifact in ``out_dir`` (written by ``aot2onnx.export_training``) as a trainable ``nn.Module``.

    ``loaded(*inputs)`` returns what the exported module returned: the loss, or ``(loss, *outputs)``.
    ``options`` are backend options for the ONNX Runtime sessions (``intra_op_num_threads``,
    ``graph_optimization_level``, ...; see :class:`aot2onnx.Options`). Only CPU tensors are supported.

    Raises:
        ArtifactError: a missing file, an unknown format, a signature that disagrees with a model's inputs or
            outputs (names, dtypes, ranks) or with itself, a state file missing a tensor or holding one of the
            wrong dtype or shape, or a file (the signature, the state, a model or ONNX external data) that is or
            resolves outside the artifact directory.
    """
    # Imported here: `import aot2onnx` must not import edge, or `python -m aot2onnx.artifact.edge` would find it
    # imported already and runpy would warn.
    from aot2onnx.artifact import edge

    opts = Options.from_mapping(options)
    try:
        # The one validator, shared with the torch-free trainer: everything is checked before any session.
        artifact = edge.open_artifact(out_dir)
        state = edge.read_state(artifact)
    except edge.ArtifactError as e:
        raise ArtifactError(str(e)) from e
    module = LoadedModule(artifact, state)  # refuses names a module cannot hold, still before any session
    module._aot2onnx = _Step(artifact.signature, _ort_graph(artifact, "forward", opts),
                             _ort_graph(artifact, "backward", opts))
    return module


def _ort_graph(artifact: edge.Artifact, graph: str, options: Options) -> OrtGraph:
    path = artifact.models[graph]
    try:
        # External data, if any, lies inside the artifact directory: open_artifact checked every location.
        model = onnx.load(str(path))
    except Exception as e:  # protobuf's DecodeError, onnx's errors for unreadable external data
        raise ArtifactError(f"{path}: not a readable ONNX model: {e}") from e
    section = artifact.signature[graph]
    signature = GraphSignature(
        tuple(InputSpec(InputKind.TENSOR, e["name"]) for e in section["inputs"]),
        tuple(OutputSpec(OutputKind.TENSOR, e["name"]) for e in section["outputs"]),
    )
    try:
        runner = OrtGraph(model, signature, name=f"{artifact.root.name}_{graph}", device=torch.device("cpu"),
                          options=options, kind=GraphKind(graph), fx_node_count=0)
    except RuntimeSessionError as e:
        raise ArtifactError(f"{path}: ONNX Runtime cannot load it: {e}") from e
    return runner


def _set(root: nn.Module, name: str, make: Any, where: str) -> None:
    """Creates ``name`` (dotted) under ``root``, with empty modules for the path, so names match the export."""
    *path, leaf = name.split(".")
    module = root
    try:
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = nn.Module()
                module.add_module(part, child)
            module = child
        make(module, leaf)
    except KeyError as e:  # an empty name, or one a parameter, buffer, submodule or nn.Module attribute has
        raise ArtifactError(f"{where}: {name!r} cannot be a name in a module: {e.args[0]}") from e


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A copy of ``array`` as a tensor. torch.from_numpy does not know ml_dtypes' bfloat16, in which the state
    file's bfloat16 tensors are read: their bits go through int16."""
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


class LoadedModule(nn.Module):
    """A training artifact as a module: parameters and buffers by their exported names; forward and backward
    on ONNX Runtime. Its forward always runs the exported training graph (``.eval()`` does not change it)."""

    def __init__(self, artifact: edge.Artifact, state: dict) -> None:
        """Registers the state; ``load`` then sets ``_aot2onnx``, the graphs (a plain attribute, not a submodule)."""
        from aot2onnx.artifact import edge  # imported late, as in load

        super().__init__()
        where = artifact.root / edge.SIGNATURE_FILE
        registered: dict[str, torch.Tensor] = {}
        for entry in artifact.state_entries("parameter"):
            tensor = nn.Parameter(_tensor(state[entry["name"]]), requires_grad=entry.get("requires_grad", True))
            _set(self, entry["name"], lambda m, leaf, p=tensor: m.register_parameter(leaf, p), f"{where}: state")
            registered[entry["name"]] = tensor
        for entry in artifact.state_entries("buffer"):
            tensor, persistent = _tensor(state[entry["name"]]), entry.get("persistent", True)
            _set(self, entry["name"], lambda m, leaf, t=tensor, p=persistent: m.register_buffer(leaf, t, persistent=p),
                 f"{where}: state")
            registered[entry["name"]] = tensor
        for entry in artifact.signature.get("tied", []):  # the same Parameter (or buffer) under its other names
            shared = registered[entry["state"]]
            if isinstance(shared, nn.Parameter):
                _set(self, entry["name"], lambda m, leaf, p=shared: m.register_parameter(leaf, p), f"{where}: tied")
            else:
                _set(self, entry["name"], lambda m, leaf, t=shared: m.register_buffer(leaf, t), f"{where}: tied")

    @property
    def signature(self) -> dict:
        return self._aot2onnx.signature

    def forward(self, *inputs: torch.Tensor) -> Any:
        step = self._aot2onnx
        step.check_inputs(inputs)
        parameters = [self.get_parameter(name) for name in step.trained]
        outputs = _TrainingStep.apply(self, step, len(parameters), *parameters, *inputs)
        if step.signature["module"]["returns"] == "loss":
            return outputs[0] if isinstance(outputs, tuple) else outputs
        return outputs if isinstance(outputs, tuple) else (outputs,)


class _Step:
    """The two graphs and where each of their inputs comes from and each output goes."""

    def __init__(self, signature: dict, forward: OrtGraph, backward: OrtGraph) -> None:
        self.signature = signature
        self.forward, self.backward = forward, backward
        self.forward_inputs = signature["forward"]["inputs"]
        self.forward_outputs = signature["forward"]["outputs"]
        self.backward_inputs = signature["backward"]["inputs"]
        self.backward_outputs = signature["backward"]["outputs"]
        self.trained = [e["target"] for e in self.backward_outputs]  # parameters the backward gives gradients of
        self.user_inputs = signature["user_inputs"]
        # Buffers the forward updates and the backward reads: the backward must see the value from before.
        updated = {e["target"] for e in self.forward_outputs if e["role"] == "buffer_update"}
        self.snapshot = {e["source"] for e in self.backward_inputs if e["role"] == "buffer"} & updated

    def check_inputs(self, inputs: Sequence[Any]) -> None:
        if len(inputs) != len(self.user_inputs):
            names = ", ".join(u["name"] for u in self.user_inputs)
            raise TypeError(f"the loaded module takes {len(self.user_inputs)} inputs ({names}), got {len(inputs)}")
        for x, spec in zip(inputs, self.user_inputs):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input {spec['name']!r} must be a tensor, got {type(x).__name__}")
            dtype = str(x.dtype).removeprefix("torch.")
            if dtype != spec["dtype"] or x.dim() != len(spec["shape"]):
                raise TypeError(f"input {spec['name']!r} must be {spec['dtype']} with shape {spec['shape']}, got "
                                f"{dtype}{list(x.shape)}")
            for size, dim in zip(x.shape, spec["shape"]):
                if isinstance(dim, int) and size != dim:
                    raise TypeError(f"input {spec['name']!r} must have shape {spec['shape']}, got {list(x.shape)}")


class _TrainingStep(torch.autograd.Function):
    """forward.onnx as the forward, backward.onnx as the backward; buffer updates written back after the forward."""

    @staticmethod
    def forward(ctx: Any, module: LoadedModule, step: _Step, n_params: int, *args: torch.Tensor) -> Any:
        params = dict(zip(step.trained, args[:n_params]))
        inputs = args[n_params:]

        def value(entry: dict) -> torch.Tensor:
            role, source = entry["role"], entry.get("source")
            if role == "parameter":
                return params[source] if source in params else module.get_parameter(source)
            if role == "buffer":
                return module.get_buffer(source)
            return inputs[source]  # user_input

        results = step.forward([value(e).detach() for e in step.forward_inputs])
        by_name = {e["name"]: r for e, r in zip(step.forward_outputs, results)}

        saved_buffers = {name: module.get_buffer(name).clone() for name in step.snapshot}
        with torch.no_grad():  # the epilogue: the forward's buffer updates, copied into the buffers
            for e in step.forward_outputs:
                if e["role"] == "buffer_update":
                    module.get_buffer(e["target"]).copy_(by_name[e["name"]])

        saved = []
        for e in step.backward_inputs:
            role, source = e["role"], e.get("source")
            if role == "saved":
                saved.append(by_name[source])
            elif role == "buffer":
                saved.append(saved_buffers[source] if source in saved_buffers else module.get_buffer(source))
            elif role in ("parameter", "user_input"):
                saved.append(value(e))
        ctx.save_for_backward(*saved)
        ctx.step, ctx.n_params, ctx.n_inputs = step, n_params, len(inputs)

        loss = next(by_name[e["name"]] for e in step.forward_outputs if e["role"] == "loss")
        user_outputs = [by_name[e["name"]] for e in sorted(
            (e for e in step.forward_outputs if e["role"] == "user_output"), key=lambda e: e["index"])]
        if user_outputs:
            ctx.mark_non_differentiable(*user_outputs)
            return (loss, *user_outputs)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, *_: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        step = ctx.step
        saved = iter(ctx.saved_tensors)
        args = [grad_loss.contiguous() if e["role"] == "grad_of_loss" else next(saved) for e in step.backward_inputs]
        grads = dict(zip((e["target"] for e in step.backward_outputs), step.backward(args)))
        return (None, None, None, *(grads[name] for name in step.trained), *([None] * ctx.n_inputs))
