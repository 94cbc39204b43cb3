"""Train an exported aot2onnx artifact with ONNX Runtime alone: no torch.

This file imports the standard library, numpy, onnxruntime and safetensors, and nothing else: not torch, not
the rest of aot2onnx. On a device without torch, copy this one file and run it (``python edge.py ARTIFACT_DIR
--data batches.npz --steps N --out state.safetensors``), or import its :class:`Trainer`. Where aot2onnx is
installed, ``python -m aot2onnx.artifact.edge`` runs the same code (the package itself imports torch).

The artifact's layout and its signature are specified in ``docs/artifact-format.md``; this file is a reference
reader of that document. Reading refuses, with :class:`ArtifactError`, anything that does not match it. Nothing
in an artifact is unpickled or executed as code: the signature is JSON, the state is safetensors, the models
are ONNX, and ``--data`` is read with ``allow_pickle=False``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import re
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnxruntime as ort
import safetensors
import safetensors.numpy

__all__ = ["FORMAT", "ArtifactError", "Artifact", "Trainer", "open_artifact", "read_state", "check_model_io",
           "check_embedded_signature", "main"]

FORMAT = "aot2onnx.training/2"
# /1: the learning rate and AdamW's weight decay were constants of optimizer.onnx. /2 makes them inputs (roles
# "lr" and "weight_decay") and adds the optional schedule and gradient clipping. /1 artifacts read as before.
READABLE_FORMATS = ("aot2onnx.training/1", FORMAT)
SIGNATURE_FILE = "signature.json"
STATE_FILE = "state.safetensors"
SIGNATURE_KEY = "aot2onnx.signature"  # each model's metadata_props entry holding the signature
GRAPH_KEY = "aot2onnx.graph"  # each model's metadata_props entry naming it: forward, backward, optimizer


class ArtifactError(ValueError):
    """The artifact is missing, malformed or inconsistent; the message names the file and the problem.

    ``aot2onnx.load`` raises ``aot2onnx.errors.ArtifactError`` (also a ValueError) for the same problems.
    This class is defined here rather than imported, so that this file runs without torch and without aot2onnx.
    """


# Which roles each model's inputs and outputs may have, and what their "source" / "target" refers to.
_ROLES = {
    ("forward", "inputs"): {"parameter": "parameter", "buffer": "buffer", "user_input": "user_input"},
    ("forward", "outputs"): {"loss": None, "user_output": None, "buffer_update": "buffer", "saved": None},
    ("backward", "inputs"): {"saved": "forward_output", "grad_of_loss": None, "parameter": "parameter",
                             "buffer": "buffer", "user_input": "user_input"},
    ("backward", "outputs"): {"grad": "parameter"},
    ("optimizer", "inputs"): {"parameter": "parameter", "grad": "gradient", "optimizer_state": "optimizer_state",
                              "step": "optimizer_state", "lr": None, "weight_decay": None},
    ("optimizer", "outputs"): {"parameter_update": "parameter", "optimizer_state_update": "optimizer_state"},
}
_STATE_KINDS = ("parameter", "buffer", "optimizer_state")
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "uint16",
           "uint32", "uint64", "bool")
_ORT_DTYPES = {f"tensor({t})": d for t, d in (
    ("float", "float32"), ("double", "float64"), ("float16", "float16"), ("bfloat16", "bfloat16"),
    ("int64", "int64"), ("int32", "int32"), ("int16", "int16"), ("int8", "int8"), ("uint8", "uint8"),
    ("uint16", "uint16"), ("uint32", "uint32"), ("uint64", "uint64"), ("bool", "bool"))}
_SAFETENSORS_DTYPES = {"F32": "float32", "F64": "float64", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32",
                       "U64": "uint64", "BOOL": "bool"}


STEP_STATE = "optimizer:step"  # aot2onnx.optim's step counter, where the optimizer keeps one


def lr_factor(schedule: Mapping[str, Any] | None, step: int) -> float:
    """The learning-rate multiplier of ``schedule`` (the signature's ``optimizer.hyperparameters.schedule``)
    for the optimizer step that follows ``step`` completed ones, as ``torch.optim.lr_scheduler.LambdaLR``
    applies it, with the lambdas of transformers' ``get_linear_schedule_with_warmup`` and
    ``get_cosine_schedule_with_warmup``. Computed in double precision, as torch computes a learning rate."""
    if schedule is None or schedule.get("name") == "constant":
        return 1.0
    name, warmup, total = schedule["name"], int(schedule["warmup_steps"]), int(schedule["total_steps"])
    if step < warmup:
        return float(step) / float(max(1, warmup))
    progress = float(step - warmup) / float(max(1, total - warmup))
    if name == "linear":
        return max(0.0, 1.0 - progress)
    if name == "cosine":
        cycles = float(schedule.get("num_cycles", 0.5))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * cycles * 2.0 * progress)))
    raise ArtifactError(f"unknown learning-rate schedule {name!r}")


# ---------------------------------------------------------------------------------------------------------
# Reading and checking an artifact


@dataclasses.dataclass(frozen=True)
class Artifact:
    """An artifact directory whose signature and files passed the checks that need no session."""

    root: pathlib.Path
    signature: dict
    models: dict[str, pathlib.Path]  # "forward", "backward", "optimizer" (if exported) -> model file

    def entries(self, graph: str, direction: str) -> list[dict]:
        return self.signature[graph][direction]

    def state_entries(self, kind: str | None = None) -> list[dict]:
        return [s for s in self.signature["state"] if kind is None or s["kind"] == kind]


def open_artifact(out_dir: str | os.PathLike) -> Artifact:
    """Reads ``signature.json`` and checks it and the files it names, before any model is loaded.

    Raises:
        ArtifactError: a missing file, an unknown format, a signature that contradicts itself, a file (the
            signature, the state, a model or ONNX external data) that is or resolves outside the artifact
            directory.
    """
    root = pathlib.Path(out_dir)
    if not root.is_dir():
        raise ArtifactError(f"{root} is not a directory: an aot2onnx training artifact is a directory")
    # Every file read from the artifact passes _inside, as the models and their external data do: a symbolic
    # link inside the directory must not make a reader open a file elsewhere.
    path = _inside(root, SIGNATURE_FILE, f"{root}: the signature file")
    if not path.is_file():
        raise ArtifactError(f"{path} is missing: {root} is not an aot2onnx training artifact (or is incomplete)")
    try:
        signature = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path} is not valid JSON: {e}") from e
    _check_signature(signature, path)
    models = {}
    for graph in ("forward", "backward", "optimizer"):
        if signature.get(graph) is not None:
            model = _inside(root, signature[graph]["model"], f"{path}: {graph}.model")
            if not model.is_file():
                raise ArtifactError(f"{model} is missing (the signature's {graph} model)")
            check_external_data(model)
            models[graph] = model
    if not _inside(root, STATE_FILE, f"{root}: the state file").is_file():
        raise ArtifactError(f"{root / STATE_FILE} is missing: the artifact has no state")
    return Artifact(root, signature, models)


def _inside(root: pathlib.Path, relative: Any, what: str) -> pathlib.Path:
    """``root / relative``, refused unless it stays inside ``root`` (after following symbolic links)."""
    if not isinstance(relative, str) or not relative:
        raise ArtifactError(f"{what} must be a file name inside the artifact directory, got {relative!r}")
    parts = re.split(r"[\\/]", relative)
    if relative.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", relative) or ".." in parts:
        raise ArtifactError(f"{what} is {relative!r}, which points outside the artifact directory {root}")
    path = root / relative
    resolved, base = path.resolve(), root.resolve()
    if resolved != base and base not in resolved.parents:
        raise ArtifactError(f"{what} is {relative!r}, which resolves to {resolved}, outside the artifact directory {base}")
    return path


def _fail(path: pathlib.Path, message: str) -> ArtifactError:
    return ArtifactError(f"{path}: {message}")


def _check_signature(sig: Any, path: pathlib.Path) -> None:
    """Checks the signature's structure and that every name it refers to exists."""
    if not isinstance(sig, dict):
        raise _fail(path, "the signature must be a JSON object")
    if sig.get("format") not in READABLE_FORMATS:
        raise _fail(path, f"unknown format {sig.get('format')!r}; this reader understands {READABLE_FORMATS}")
    for key, kind in (("state", list), ("user_inputs", list), ("forward", dict), ("backward", dict)):
        if not isinstance(sig.get(key), kind):
            raise _fail(path, f"{key!r} must be a JSON {'array' if kind is list else 'object'}")
    if sig.get("optimizer") is not None and not isinstance(sig["optimizer"], dict):
        raise _fail(path, "'optimizer' must be a JSON object or null")
    schedule = ((sig.get("optimizer") or {}).get("hyperparameters") or {}).get("schedule")
    if schedule is not None:
        known = {"constant": (), "linear": ("warmup_steps", "total_steps"), "cosine": ("warmup_steps", "total_steps")}
        if not isinstance(schedule, dict) or schedule.get("name") not in known or not all(
            isinstance(schedule.get(k), int) and schedule[k] >= 0 for k in known[schedule["name"]]
        ):
            raise _fail(path, f"optimizer schedule {schedule!r} is not one this reader knows ({sorted(known)})")
    if not isinstance(sig.get("dims", {}), dict):
        raise _fail(path, "'dims' must be a JSON object")
    for dim, limits in sig.get("dims", {}).items():
        bounds = (limits.get("min"), limits.get("max")) if isinstance(limits, dict) else (None, "x")
        if not isinstance(bounds[0], int) or not (bounds[1] is None or isinstance(bounds[1], int)):
            raise _fail(path, f"dim {dim!r} needs an integer 'min' and an integer or null 'max', got {limits!r}")

    state: dict[str, dict] = {}
    for entry in sig["state"]:
        _check_tensor_entry(entry, path, "state", static=True)
        if entry.get("kind") not in _STATE_KINDS:
            raise _fail(path, f"state {entry['name']!r} has kind {entry.get('kind')!r}, not one of {_STATE_KINDS}")
        if entry["name"] in state:
            raise _fail(path, f"state {entry['name']!r} is listed twice")
        state[entry["name"]] = entry
    tied = sig.get("tied", [])
    if not isinstance(tied, list):
        raise _fail(path, "'tied' must be a JSON array")
    for entry in tied:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or entry.get("state") not in state:
            raise _fail(path, f"tied entry {entry!r} must name itself and a state entry")
        if entry["name"] in state or sum(e.get("name") == entry["name"] for e in tied) > 1:
            raise _fail(path, f"tied name {entry['name']!r} is listed twice")
    for i, entry in enumerate(sig["user_inputs"]):
        _check_tensor_entry(entry, path, "user_inputs", static=False)
        if entry.get("position") != i:
            raise _fail(path, f"user input {entry['name']!r} has position {entry.get('position')!r}, expected {i}")

    forward_outputs = {e.get("name") for e in sig["forward"].get("outputs", []) if isinstance(e, dict)}
    gradients = {e.get("target") for e in sig["backward"].get("outputs", []) if isinstance(e, dict)}
    referents = {
        "parameter": lambda v: v in state and state[v]["kind"] == "parameter",
        "buffer": lambda v: v in state and state[v]["kind"] == "buffer",
        "optimizer_state": lambda v: v in state and state[v]["kind"] == "optimizer_state",
        "user_input": lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < len(sig["user_inputs"]),
        "forward_output": lambda v: v in forward_outputs,
        "gradient": lambda v: v in gradients,
    }
    for graph in ("forward", "backward", "optimizer"):
        section = sig.get(graph)
        if section is None:
            continue
        if not isinstance(section.get("model"), str):
            raise _fail(path, f"{graph}.model must be a file name")
        for direction in ("inputs", "outputs"):
            entries = section.get(direction)
            if not isinstance(entries, list):
                raise _fail(path, f"{graph}.{direction} must be a JSON array")
            roles = _ROLES[(graph, direction)]
            names = set()
            for entry in entries:
                _check_tensor_entry(entry, path, f"{graph}.{direction}", static=False)
                if entry["name"] in names:
                    raise _fail(path, f"{graph}.{direction} lists {entry['name']!r} twice")
                names.add(entry["name"])
                role = entry.get("role")
                if role not in roles:
                    raise _fail(path, f"{graph}.{direction} {entry['name']!r} has role {role!r}, not one of {sorted(roles)}")
                refers_to = roles[role]
                if refers_to is not None:
                    key = "source" if direction == "inputs" else "target"
                    if not referents[refers_to](entry.get(key)):
                        raise _fail(path, f"{graph}.{direction} {entry['name']!r} ({role}) has {key} "
                                          f"{entry.get(key)!r}, which names no {refers_to.replace('_', ' ')}")
    losses = [e for e in sig["forward"]["outputs"] if e["role"] == "loss"]
    if len(losses) != 1:
        raise _fail(path, f"the forward model must have exactly one loss output, the signature lists {len(losses)}")


def _check_tensor_entry(entry: Any, path: pathlib.Path, where: str, *, static: bool) -> None:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
        raise _fail(path, f"every entry of {where} needs a non-empty 'name', got {entry!r}")
    if entry.get("dtype") not in _DTYPES:
        raise _fail(path, f"{where} {entry['name']!r} has dtype {entry.get('dtype')!r}, not one of {_DTYPES}")
    shape = entry.get("shape")
    dim_ok = (lambda d: isinstance(d, int) and d >= 0) if static else (lambda d: isinstance(d, (int, str)))
    if not isinstance(shape, list) or not all(dim_ok(d) and not isinstance(d, bool) for d in shape):
        raise _fail(path, f"{where} {entry['name']!r} has shape {shape!r}; expected a list of "
                          f"{'sizes' if static else 'sizes and dim names'}")


# ONNX external data, read from the protobuf wire format (the onnx package is not a dependency here). The
# field numbers are onnx.proto's: each path leads from ModelProto to every TensorProto in it.
_MESSAGES = {
    "model": {7: "graph", 20: "training_info", 25: "function"},
    "training_info": {1: "graph", 2: "graph"},
    "graph": {1: "node", 5: "tensor", 15: "sparse_tensor"},
    "function": {7: "node", 11: "attribute"},  # 11: the default values of the function's attributes
    "node": {5: "attribute"},
    "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse_tensor", 23: "sparse_tensor"},
    "sparse_tensor": {1: "tensor", 2: "tensor"},
}
_TENSOR_NAME, _TENSOR_EXTERNAL_DATA = 8, 13


class _Malformed(Exception):
    pass


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise _Malformed
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf: memoryview) -> Iterator[tuple[int, memoryview | None]]:
    """(field number, bytes of a length-delimited field or None) for each field of one message."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        wire = key & 7
        if wire == 0:
            _, pos = _varint(buf, pos)
            value = None
        elif wire == 1 or wire == 5:
            pos += 8 if wire == 1 else 4
            value = None
        elif wire == 2:
            length, pos = _varint(buf, pos)
            value = buf[pos:pos + length]
            pos += length
        else:
            raise _Malformed
        if pos > len(buf):
            raise _Malformed
        yield key >> 3, value


def _external_locations(buf: memoryview, message: str = "model") -> Iterator[tuple[str, str]]:
    """(tensor name, location) of every tensor stored as external data."""
    if message == "tensor":
        name, location = "", None
        for number, value in _fields(buf):
            if value is None:
                continue
            if number == _TENSOR_NAME:
                name = bytes(value).decode("utf-8", "replace")
            elif number == _TENSOR_EXTERNAL_DATA:
                key, text = _string_entry(value)
                if key == "location":
                    location = text
        if location is not None:
            yield name, location
        return
    children = _MESSAGES[message]
    for number, value in _fields(buf):
        if value is not None and number in children:
            yield from _external_locations(value, children[number])


def _string_entry(buf: memoryview) -> tuple[str | None, str]:
    """The key and value of a StringStringEntryProto."""
    key, value = None, ""
    for number, field in _fields(buf):
        if field is not None and number in (1, 2):
            text = bytes(field).decode("utf-8", "replace")
            key, value = (text, value) if number == 1 else (key, text)
    return key, value


def check_external_data(model: pathlib.Path) -> None:
    """Refuses external-data locations outside the model's directory, or naming missing files, before ONNX
    Runtime reads any."""
    try:
        locations = list(_external_locations(memoryview(model.read_bytes())))
    except _Malformed:
        raise ArtifactError(f"{model} is not a valid ONNX model (malformed protobuf)") from None
    except RecursionError:
        raise ArtifactError(f"{model} nests graphs too deeply to be checked") from None
    for tensor, location in locations:
        # Locations are relative to the model's directory, which open_artifact checked is inside ``root``.
        path = _inside(model.parent, location, f"{model}: the external data of tensor {tensor!r}")
        if not path.is_file():
            raise ArtifactError(f"{model}: the external data of tensor {tensor!r} is in {location!r}, which is missing")


def _model_io(session: ort.InferenceSession) -> tuple[dict[str, tuple[str, list]], dict[str, tuple[str, list]]]:
    def describe(args: Sequence[Any]) -> dict[str, tuple[str, list]]:
        return {a.name: (_ORT_DTYPES.get(a.type, a.type), list(a.shape) if a.shape is not None else None) for a in args}

    return describe(session.get_inputs()), describe(session.get_outputs())


def check_model_io(artifact: Artifact, graph: str, session: ort.InferenceSession) -> None:
    """Refuses a model whose inputs or outputs differ from the signature's in names, dtypes or ranks."""
    path = artifact.models[graph]
    model_io = _model_io(session)
    for direction, actual in zip(("inputs", "outputs"), model_io):
        expected = {e["name"]: e for e in artifact.entries(graph, direction)}
        for name in expected.keys() - actual.keys():
            raise ArtifactError(
                f"{path}: the signature lists {direction[:-1]} {name!r} ({expected[name]['role']}), which the model "
                f"does not have; the model's {direction}: {sorted(actual)}"
            )
        for name in actual.keys() - expected.keys():
            raise ArtifactError(f"{path}: the model has {direction[:-1]} {name!r}, which the signature does not list")
        for name, entry in expected.items():
            dtype, shape = actual[name]
            if dtype != entry["dtype"]:
                raise ArtifactError(f"{path}: {direction[:-1]} {name!r} is {dtype} in the model but {entry['dtype']} "
                                    "in the signature")
            if shape is not None and len(shape) != len(entry["shape"]):
                raise ArtifactError(f"{path}: {direction[:-1]} {name!r} has rank {len(shape)} in the model but "
                                    f"{len(entry['shape'])} in the signature ({entry['shape']})")
            for got, want in zip(shape or (), entry["shape"]):
                if isinstance(got, int) and isinstance(want, int) and got != want:
                    raise ArtifactError(f"{path}: {direction[:-1]} {name!r} has shape {shape} in the model but "
                                        f"{entry['shape']} in the signature")


def check_embedded_signature(artifact: Artifact, graph: str, session: ort.InferenceSession) -> None:
    """Refuses a model whose embedded signature (metadata ``aot2onnx.signature``) differs from signature.json:
    models and signature from different exports. A model without one (a tool dropped it) passes."""
    embedded = session.get_modelmeta().custom_metadata_map.get(SIGNATURE_KEY)
    if embedded is None:
        return
    try:
        same = json.loads(embedded) == artifact.signature
    except json.JSONDecodeError:
        same = False
    if not same:
        raise ArtifactError(f"{artifact.models[graph]} carries a different signature than "
                            f"{artifact.root / SIGNATURE_FILE}: the files come from different exports")


def read_state(artifact: Artifact) -> dict[str, np.ndarray]:
    """The state tensors, each checked against the signature (present, dtype, shape)."""
    path = _inside(artifact.root, STATE_FILE, f"{artifact.root}: the state file")
    tensors = {}
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            names = set(f.keys())
            for entry in artifact.signature["state"]:
                name = entry["name"]
                if name not in names:
                    raise ArtifactError(f"{path} has no tensor {name!r} ({entry['kind']} in the signature)")
                piece = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype(), piece.get_dtype())
                shape = list(piece.get_shape())
                if dtype != entry["dtype"] or shape != entry["shape"]:
                    raise ArtifactError(f"{path}: tensor {name!r} is {dtype}{shape}, the signature says "
                                        f"{entry['dtype']}{entry['shape']}")
                tensors[name] = f.get_tensor(name)
    except ArtifactError:
        raise
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        raise ArtifactError(f"{path} is not a readable safetensors file: {e}") from e
    return tensors


# ---------------------------------------------------------------------------------------------------------
# Training


# ONNX Runtime's rewrites that change results: NoopElimination removes Add(x, 0.0), which turns -0.0 into x's
# -0.0 where the model computes 0.0 (aot2onnx's own sessions turn it off too: runtime/session.py).
DISABLED_OPTIMIZERS = ["NoopElimination"]


def session_options(intra_op_num_threads: int = 0) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_num_threads
    # Between runs the trainer works in numpy; spinning threads would hold the cores meanwhile.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


class Trainer:
    """Trains an artifact: ``Trainer(out_dir).step(*inputs)`` runs forward, backward and the optimizer.

    Args:
        out_dir: the artifact directory (``export_training(..., optimizer=...)`` wrote it).
        providers: ONNX Runtime execution providers (default: CPU).
        intra_op_num_threads: ONNX Runtime's threads per session (0: ONNX Runtime's default).
    """

    def __init__(self, out_dir: str | os.PathLike, *, providers: Sequence[Any] | None = None,
                 intra_op_num_threads: int = 0) -> None:
        self.artifact = artifact = open_artifact(out_dir)
        if "optimizer" not in artifact.models:
            raise ArtifactError(f"{artifact.root} was exported without an optimizer; export it with "
                                "optimizer=aot2onnx.optim.SGD(...) or AdamW(...) to train it here")
        options = session_options(intra_op_num_threads)
        self._sessions = {}
        for graph, path in artifact.models.items():
            try:
                session = ort.InferenceSession(str(path), sess_options=options,
                                               providers=list(providers or ["CPUExecutionProvider"]),
                                               disabled_optimizers=DISABLED_OPTIMIZERS)
            except Exception as e:  # onnxruntime raises several unrelated types for an unloadable model
                raise ArtifactError(f"{path}: ONNX Runtime cannot load it: {e}") from e
            self._sessions[graph] = session
        # Every model's inputs and outputs first: a disagreement there says more than a differing copy.
        for graph, session in self._sessions.items():
            check_model_io(artifact, graph, session)
        for graph, session in self._sessions.items():
            check_embedded_signature(artifact, graph, session)
        self.state: dict[str, np.ndarray] = read_state(artifact)
        self.steps = 0
        sig = artifact.signature
        self._user_inputs = sig["user_inputs"]
        self._dims = sig.get("dims") or {}
        self._loss = next(e["name"] for e in sig["forward"]["outputs"] if e["role"] == "loss")

    def _run(self, graph: str, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        entries = self.artifact.entries(graph, "outputs")
        names = [e["name"] for e in entries]
        return dict(zip(names, self._sessions[graph].run(names, dict(feeds))))

    def _check_inputs(self, inputs: Sequence[Any]) -> list[np.ndarray]:
        if len(inputs) != len(self._user_inputs):
            raise ValueError(f"step() takes {len(self._user_inputs)} inputs "
                             f"({', '.join(u['name'] for u in self._user_inputs)}), got {len(inputs)}")
        arrays, bound = [], {}
        for x, spec in zip(inputs, self._user_inputs):
            array = x if isinstance(x, np.ndarray) else np.asarray(x, dtype=spec["dtype"])
            if array.dtype.name != spec["dtype"]:
                raise ValueError(f"input {spec['name']!r} must be {spec['dtype']}, got {array.dtype}")
            if array.ndim != len(spec["shape"]):
                raise ValueError(f"input {spec['name']!r} must have shape {spec['shape']}, got {list(array.shape)}")
            for size, dim in zip(array.shape, spec["shape"]):
                if isinstance(dim, int) and size != dim:
                    raise ValueError(f"input {spec['name']!r} must have shape {spec['shape']}, got {list(array.shape)}")
                if isinstance(dim, str):
                    if bound.setdefault(dim, size) != size:
                        raise ValueError(f"inputs disagree on dim {dim!r}: {bound[dim]} and {size}")
                    limits = self._dims.get(dim, {})
                    if size < limits.get("min", 0) or (limits.get("max") is not None and size > limits["max"]):
                        raise ValueError(f"input {spec['name']!r}: dim {dim!r} is {size}, outside the exported "
                                         f"range [{limits.get('min')}, {limits.get('max')}]")
            arrays.append(np.asarray(array, order="C"))  # not ascontiguousarray: it makes 0-d arrays 1-d
        return arrays

    @property
    def completed_steps(self) -> int:
        """Optimizer steps taken since export: the artifact's step counter where it keeps one (it survives
        ``save`` and a new Trainer on the saved state), else this Trainer's count."""
        if STEP_STATE in self.state:
            return int(self.state[STEP_STATE])
        return self.steps

    def hyperparameter(self, name: str) -> float:
        """The learning rate (``"lr"``, scheduled) or weight decay the next step uses."""
        hyper = self.artifact.signature["optimizer"]["hyperparameters"]
        if name == "lr":
            return hyper["lr"] * lr_factor(hyper.get("schedule"), self.completed_steps)
        return hyper[name]

    def step(self, *inputs: Any) -> float:
        """One training step on one batch; returns the loss (computed before the update)."""
        inputs = self._check_inputs(inputs)
        state = self.state

        def feed(entry: dict, forward: Mapping[str, np.ndarray] | None = None,
                 grads: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
            role, source = entry["role"], entry.get("source")
            if role in ("parameter", "buffer", "optimizer_state", "step"):
                return state[source]
            if role == "user_input":
                return inputs[source]
            if role == "saved":
                return forward[source]
            if role == "grad_of_loss":
                return np.ones(entry["shape"], dtype=entry["dtype"])
            if role == "grad":
                return grads[source]
            if role in ("lr", "weight_decay"):
                return np.array(self.hyperparameter(role), dtype=np.float64)
            raise AssertionError(role)  # _check_signature admits no other role

        forward = self._run("forward", {e["name"]: feed(e) for e in self.artifact.entries("forward", "inputs")})
        backward = self._run("backward", {e["name"]: feed(e, forward)
                                          for e in self.artifact.entries("backward", "inputs")})
        grads = {e["target"]: backward[e["name"]] for e in self.artifact.entries("backward", "outputs")}
        updates = self._run("optimizer", {e["name"]: feed(e, grads=grads)
                                          for e in self.artifact.entries("optimizer", "inputs")})
        # State changes last: the backward model reads the buffers' values from before the forward's updates.
        for e in self.artifact.entries("forward", "outputs"):
            if e["role"] == "buffer_update":
                state[e["target"]] = forward[e["name"]]
        for e in self.artifact.entries("optimizer", "outputs"):
            state[e["target"]] = updates[e["name"]]
        self.steps += 1
        return float(forward[self._loss])

    def save(self, path: str | os.PathLike) -> None:
        """Writes the state (parameters, buffers, optimizer state) in the artifact's ``state.safetensors`` layout."""
        tensors = {name: np.asarray(value, order="C") for name, value in self.state.items()}
        safetensors.numpy.save_file(tensors, str(path), metadata={"format": FORMAT})


# ---------------------------------------------------------------------------------------------------------
# Command line


def read_batches(path: str | os.PathLike, user_inputs: Sequence[dict]) -> list[np.ndarray]:
    """The arrays of ``--data``: one per user input, named after it (or ``arr_<position>``), batches stacked on a
    leading axis."""
    with np.load(path, allow_pickle=False) as data:
        arrays = dict(data.items())
    ordered = []
    for spec in user_inputs:
        for key in (spec["name"], f"arr_{spec['position']}"):
            if key in arrays:
                ordered.append(arrays[key])
                break
        else:
            raise ValueError(f"{path} has no array {spec['name']!r} (or arr_{spec['position']}); it holds {sorted(arrays)}")
    counts = {a.shape[0] if a.ndim else None for a in ordered}
    if len(counts) != 1 or None in counts:
        raise ValueError(f"{path}: every array needs the same leading (batch index) axis, got shapes "
                         f"{[list(a.shape) for a in ordered]}")
    return ordered


def _check_writable(path: str) -> None:
    """Raises ``OSError`` unless a file can be written at ``path`` (a probe file is created and removed)."""
    target = os.path.abspath(path)
    if os.path.isdir(target):
        raise OSError(f"--out {path!r} is a directory; name the state file to write")
    directory = os.path.dirname(target)
    if not os.path.isdir(directory):
        raise OSError(f"--out {path!r}: the directory {directory} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=".aot2onnx-probe-", dir=directory)
    except OSError as e:
        raise OSError(f"--out {path!r}: cannot write in {directory}: {e.strerror}") from e
    os.close(fd)
    os.unlink(probe)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m aot2onnx.artifact.edge",
        description="Train an aot2onnx training artifact with ONNX Runtime (no torch); prints the loss per step.",
    )
    parser.add_argument("artifact", metavar="ARTIFACT_DIR")
    parser.add_argument("--data", required=True, metavar="batches.npz",
                        help="one array per model input, named as in signature.json's user_inputs (or arr_0, "
                        "arr_1, ...), each of shape [num_batches, *input shape]; step i uses batch i mod num_batches")
    parser.add_argument("--steps", type=int, required=True, metavar="N")
    parser.add_argument("--out", required=True, metavar="state.safetensors", help="where to write the final state")
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: its default)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.threads < 0:
        parser.error(f"--threads must be 0 (ONNX Runtime's default) or more, got {args.threads}")
    try:
        _check_writable(args.out)  # before training, not after it
        trainer = Trainer(args.artifact, intra_op_num_threads=args.threads)
        batches = read_batches(args.data, trainer.artifact.signature["user_inputs"])
        for step in range(args.steps):
            index = step % batches[0].shape[0]
            loss = trainer.step(*(b[index] for b in batches))
            print(f"step {step + 1} loss {loss!r}", flush=True)
            if not math.isfinite(loss):
                print(f"the loss is {loss} at step {step + 1}", file=sys.stderr)
        trainer.save(args.out)
    except (ArtifactError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
