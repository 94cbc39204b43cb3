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
import zipfile
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnxruntime as ort
import safetensors
import safetensors.numpy

__all__ = ["FORMAT", "ArtifactError", "Artifact", "StepError", "Trainer", "open_artifact", "read_state",
           "check_signature", "check_model_io", "check_embedded_signature", "parse_json", "main"]

FORMAT = "aot2onnx.training/2"
# /1: the learning rate and AdamW's weight decay were constants of optimizer.onnx. /2 makes them inputs (roles
# "lr" and "weight_decay") and adds the optional schedule and gradient clipping. /1 artifacts read as before.
READABLE_FORMATS = ("aot2onnx.training/1", FORMAT)
SIGNATURE_FILE = "signature.json"
STATE_FILE = "state.safetensors"
SIGNATURE_KEY = "aot2onnx.signature"  # each model's metadata_props entry holding the signature
GRAPH_KEY = "aot2onnx.graph"  # each model's metadata_props entry naming it: forward, backward, optimizer
# Each model's metadata_props entry naming ONNX Runtime's rewrites that would compute a wrong result in it,
# comma-separated: aot2onnx's runtime decides (aot2onnx/runtime/rewrites.py) and the exporter records its answer,
# as this file, copied alone, cannot ask.
DISABLED_OPTIMIZERS_KEY = "aot2onnx.ort_disabled_optimizers"
# Each model's metadata_props entry naming its nodes that ONNX Runtime's CPU provider computes wrongly on more
# than one thread (ScatterND with a reduction: threads adding to one row lose updates; aot2onnx/runtime/rewrites.py,
# serial_nodes), comma-separated; a model with any runs on one thread. A model exported before the entry
# existed runs on one thread too: nothing tells whether it has such a node.
ONE_THREAD_KEY = "aot2onnx.ort_one_thread_nodes"


class ArtifactError(ValueError):
    """The artifact is missing, malformed or inconsistent; the message names the file and the problem.

    ``aot2onnx.load`` raises ``aot2onnx.errors.ArtifactError`` (also a ValueError) for the same problems.
    This class is defined here rather than imported, so that this file runs without torch and without aot2onnx.
    """


class StepError(RuntimeError):
    """ONNX Runtime failed while running a model of an artifact that passed every check at open: the model's
    own computation or the batch's values (an index out of range) made it fail. The message names the model and
    the step."""


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
#
# open_artifact is the one validator: both readers (this file's Trainer and command line, and aot2onnx.load)
# open an artifact with it, and it refuses, before any ONNX Runtime session exists, what docs/artifact-format.md
# says a reader must refuse. It is here rather than in a module of its own because this file is what a device
# copies, alone, and it imports neither torch nor the rest of aot2onnx.

# What an artifact may declare. A reader builds the gradient of the loss from a declared shape and trusts the
# declared shapes to describe every tensor it feeds: a hostile shape must not become a 128 GiB allocation.
MAX_SIZE = 2**31 - 1  # one dimension
MAX_ELEMENTS = 2**32  # one tensor (its static dimensions): a 128k x 32k embedding fits
# The signature nests 5 deep. json recurses once per level and raises RecursionError near 1000; the depth is
# measured before json parses anything.
MAX_JSON_DEPTH = 32
MAX_SIGNATURE_BYTES = 64 << 20
GRAPHS = ("forward", "backward", "optimizer")
_FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Artifact:
    """An artifact directory whose signature, models and state file passed every check that needs no session."""

    root: pathlib.Path
    signature: dict
    models: dict[str, pathlib.Path]  # "forward", "backward", "optimizer" (if exported) -> model file
    # graph -> ONNX Runtime's rewrites to turn off in its session (the model's DISABLED_OPTIMIZERS_KEY)
    disabled_optimizers: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    # graph -> whether its session must run on one thread (the model's ONE_THREAD_KEY)
    one_thread: dict[str, bool] = dataclasses.field(default_factory=dict)

    def entries(self, graph: str, direction: str) -> list[dict]:
        return self.signature[graph][direction]

    def state_entries(self, kind: str | None = None) -> list[dict]:
        return [s for s in self.signature["state"] if kind is None or s["kind"] == kind]


def open_artifact(out_dir: str | os.PathLike) -> Artifact:
    """Reads ``signature.json`` and checks it, the models and the state file against it and against each other,
    before any model is loaded into ONNX Runtime.

    Raises:
        ArtifactError: naming the file, the entry and the problem: a missing file; an unknown format; a signature
            that is not JSON, nests too deeply, is malformed (a field of the wrong type, a size out of range,
            hyperparameters incomplete) or contradicts itself (two entries with one name, two writers of one
            state entry, a source or target that names nothing or does not fit what it names); a model whose
            inputs or outputs differ from the signature's, or that carries another signature; a state file
            missing a tensor or holding one of another dtype or shape; a file (the signature, the state, a
            model or ONNX external data) that is or resolves outside the artifact directory.
    """
    root = pathlib.Path(out_dir)
    if not root.is_dir():
        raise ArtifactError(f"{root} is not a directory: an aot2onnx training artifact is a directory")
    # Every file read from the artifact passes _inside, as the models and their external data do: a symbolic
    # link inside the directory must not make a reader open a file elsewhere.
    path = _inside(root, SIGNATURE_FILE, f"{root}: the signature file")
    if not path.is_file():
        raise ArtifactError(f"{path} is missing: {root} is not an aot2onnx training artifact (or is incomplete)")
    if path.stat().st_size > MAX_SIGNATURE_BYTES:
        raise ArtifactError(f"{path} is {path.stat().st_size} bytes; a signature is at most {MAX_SIGNATURE_BYTES}")
    signature = parse_json(path.read_bytes(), str(path))
    check_signature(signature, path)
    models, contents = {}, {}
    for graph in GRAPHS:
        if signature.get(graph) is not None:
            model = _inside(root, signature[graph]["model"], f"{path}: {graph}.model")
            if not model.is_file():
                raise ArtifactError(f"{model} is missing (the signature's {graph} model)")
            contents[graph] = _read_model(model)
            models[graph] = model
    # Every model's inputs and outputs first: a disagreement there says more than a differing copy.
    for graph, model in contents.items():
        check_model_io(models[graph], signature[graph], model)
    for graph, model in contents.items():
        check_embedded_signature(models[graph], model, signature, path)
    if not _inside(root, STATE_FILE, f"{root}: the state file").is_file():
        raise ArtifactError(f"{root / STATE_FILE} is missing: the artifact has no state")
    disabled = {graph: _disabled_optimizers(models[graph], model) for graph, model in contents.items()}
    one_thread = {graph: _one_thread(models[graph], model) for graph, model in contents.items()}
    artifact = Artifact(root, signature, models, disabled, one_thread)
    _state_file(artifact, load=False)
    return artifact


def _inside(root: pathlib.Path, relative: Any, what: str) -> pathlib.Path:
    """``root / relative``, refused unless it stays inside ``root`` (after following symbolic links)."""
    if not isinstance(relative, str) or not relative or "\0" in relative:
        raise ArtifactError(f"{what} must be a file name inside the artifact directory, got {relative!r}")
    parts = re.split(r"[\\/]", relative)
    if relative.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", relative) or ".." in parts:
        raise ArtifactError(f"{what} is {relative!r}, which points outside the artifact directory {root}")
    path = root / relative
    try:
        resolved, base = path.resolve(), root.resolve()
    except (OSError, RuntimeError) as e:  # a name too long, a symbolic-link loop
        raise ArtifactError(f"{what} is {relative!r}, which does not resolve: {e}") from e
    if resolved != base and base not in resolved.parents:
        raise ArtifactError(f"{what} is {relative!r}, which resolves to {resolved}, outside the artifact directory {base}")
    return path


# ---------------------------------------------------------------------------------------------------------
# JSON from an artifact: signature.json and the copies the models carry

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def parse_json(data: bytes, what: str) -> Any:
    """``json.loads`` of UTF-8 ``data``, refusing with ArtifactError (naming ``what``): text that is not JSON,
    nesting deeper than MAX_JSON_DEPTH (measured first, so that json never recurses that far), an object with a
    key twice (readers would disagree on which counts), and NaN or infinite numbers."""
    # The depth: brackets outside strings, counted up and down. An unterminated string leaves its brackets in,
    # which can only overstate the depth of text json would refuse anyway.
    codes = np.frombuffer(_JSON_STRING.sub(b"", data), dtype=np.uint8)
    depth = np.cumsum(np.isin(codes, (ord("["), ord("{"))), dtype=np.int64) - np.cumsum(
        np.isin(codes, (ord("]"), ord("}"))), dtype=np.int64)
    if depth.size and int(depth.max()) > MAX_JSON_DEPTH:
        raise ArtifactError(f"{what} nests {int(depth.max())} levels deep; a signature nests at most {MAX_JSON_DEPTH}")

    def unique_keys(pairs: list[tuple[str, Any]]) -> dict:
        result = dict(pairs)
        if len(result) != len(pairs):
            keys = [k for k, _ in pairs]
            raise ArtifactError(f"{what}: an object lists the key {next(k for k in keys if keys.count(k) > 1)!r} twice")
        return result

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ArtifactError(f"{what}: the number {text} is out of range")
        return value

    def constant(text: str) -> None:
        raise ArtifactError(f"{what}: {text} is not a JSON number")

    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=unique_keys, parse_float=finite,
                          parse_constant=constant)
    except UnicodeDecodeError as e:
        raise ArtifactError(f"{what} is not valid JSON: it is not UTF-8 ({e})") from e
    except ValueError as e:  # JSONDecodeError, and int() of a number with more than 4300 digits
        if isinstance(e, ArtifactError):
            raise
        raise ArtifactError(f"{what} is not valid JSON: {e}") from e


# ---------------------------------------------------------------------------------------------------------
# The signature


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _layout(entry: Mapping[str, Any]) -> str:
    return f"{entry['dtype']}{entry['shape']}"


def _same_layout(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """One value can flow from ``a`` to ``b``: the same dtype and rank, and at each dimension the same size, or
    dimension names on both sides (names are symbolic: ``batch`` on one side, ``16*batch`` may be on the other)."""
    return a["dtype"] == b["dtype"] and len(a["shape"]) == len(b["shape"]) and all(
        x == y if _is_int(x) or _is_int(y) else True for x, y in zip(a["shape"], b["shape"]))


# Each optimizer's hyperparameters: name -> {field: check}. Ranges as aot2onnx.optim's constructors check them.
_NON_NEGATIVE = (lambda v: _is_number(v) and v >= 0, "a number >= 0")
_HYPERPARAMETERS = {
    "sgd": {"lr": _NON_NEGATIVE, "momentum": _NON_NEGATIVE, "weight_decay": _NON_NEGATIVE},
    "adamw": {"lr": _NON_NEGATIVE, "eps": _NON_NEGATIVE, "weight_decay": _NON_NEGATIVE,
              "betas": (lambda v: isinstance(v, list) and len(v) == 2 and all(_is_number(b) and 0 <= b < 1 for b in v),
                        "two numbers in [0, 1)")},
}
_SCHEDULES = {"constant": (), "linear": ("warmup_steps", "total_steps"), "cosine": ("warmup_steps", "total_steps")}


def check_signature(sig: Any, path: pathlib.Path) -> None:
    """Refuses a signature that is malformed or contradicts itself (the checks that need only the JSON)."""
    _SignatureCheck(sig, path).run()


class _SignatureCheck:
    """One pass over a parsed signature. ``fail`` names the file; each message names the entry and the problem."""

    def __init__(self, sig: Any, path: pathlib.Path) -> None:
        self.sig, self.path = sig, path
        self.state: dict[str, dict] = {}
        self.sections: dict[str, dict] = {}  # present graphs
        # What sources name, by name, as the entries are checked: the forward's outputs (before the backward's
        # inputs are checked) and the gradients by parameter (before the optimizer's inputs are).
        self.forward_outputs: dict[str, dict] = {}
        self.gradients: dict[str, dict] = {}

    def fail(self, message: str) -> ArtifactError:
        return ArtifactError(f"{self.path}: {message}")

    def run(self) -> None:
        sig = self.sig
        if not isinstance(sig, dict):
            raise self.fail("the signature must be a JSON object")
        if sig.get("format") not in READABLE_FORMATS:
            raise self.fail(f"unknown format {sig.get('format')!r}; this reader understands {READABLE_FORMATS}")
        if not isinstance(sig.get("versions", {}), dict):
            raise self.fail(f"'versions' must be a JSON object, got {sig['versions']!r}")
        module = sig.get("module")
        if not isinstance(module, dict) or not isinstance(module.get("class"), str) \
                or module.get("returns") not in ("loss", "tuple"):
            raise self.fail(f"'module' must be an object with a 'class' and 'returns' \"loss\" or \"tuple\", got "
                            f"{module!r}")
        for key in ("state", "user_inputs"):
            if not isinstance(sig.get(key), list):
                raise self.fail(f"{key!r} must be a JSON array, got {sig.get(key)!r}")
        for graph in GRAPHS:
            section = sig.get(graph)
            if section is None and graph == "optimizer":
                continue
            if not isinstance(section, dict):
                raise self.fail(f"{graph!r} must be a JSON object{' or null' if graph == 'optimizer' else ''}, got "
                                f"{section!r}")
            if not isinstance(section.get("model"), str):
                raise self.fail(f"{graph}.model must be a file name, got {section.get('model')!r}")
            for direction in ("inputs", "outputs"):
                if not isinstance(section.get(direction), list):
                    raise self.fail(f"{graph}.{direction} must be a JSON array, got {section.get(direction)!r}")
            self.sections[graph] = section
        self.dims()
        self.user_inputs()
        self.state_entries()
        self.tied()
        self.module_paths()
        writers: dict[str, str] = {}  # state name -> the output that writes it
        for graph in self.sections:
            for direction in ("inputs", "outputs"):
                self.entries(graph, direction, writers)
        self.losses()
        if "optimizer" in self.sections:
            self.hyperparameters(self.sections["optimizer"])
        step = self.state.get(STEP_STATE)
        if step is not None and (step["dtype"], step["shape"]) != ("int64", []):
            raise self.fail(f"state {STEP_STATE!r} is the optimizer's step counter and must be int64[], got "
                            f"{_layout(step)}")

    def tensor(self, entry: Any, where: str, *, static: bool) -> str:
        """Checks a name, dtype and shape; returns how messages name the entry."""
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
            raise self.fail(f"{where} needs a non-empty 'name', got {entry!r}")
        label = f"{where.rsplit('[', 1)[0]} {entry['name']!r}"
        if entry.get("dtype") not in _DTYPES:
            raise self.fail(f"{label} has dtype {entry.get('dtype')!r}, not one of {_DTYPES}")
        shape = entry.get("shape")
        if not isinstance(shape, list) or not all(
                (_is_int(d) and d >= 0) or (not static and isinstance(d, str) and d) for d in shape):
            raise self.fail(f"{label} has shape {shape!r}; expected a list of "
                            f"{'sizes >= 0' if static else 'sizes >= 0 and dimension names'}")
        sizes = [d for d in shape if _is_int(d)]
        if any(d > MAX_SIZE for d in sizes) or math.prod(sizes) > MAX_ELEMENTS:
            raise self.fail(f"{label} has shape {shape}, beyond this reader's limits ({MAX_SIZE} per dimension, "
                            f"{MAX_ELEMENTS} elements)")
        return label

    def dims(self) -> None:
        dims = self.sig.get("dims", {})
        if not isinstance(dims, dict):
            raise self.fail(f"'dims' must be a JSON object, got {dims!r}")
        for name, limits in dims.items():
            ok = isinstance(limits, dict) and all(_is_int(limits.get(k)) for k in ("example", "min")) and (
                limits.get("max", "") is None or _is_int(limits.get("max")))
            if not ok or not 1 <= limits["min"] <= limits["example"] <= min(limits["max"] or MAX_SIZE, MAX_SIZE):
                raise self.fail(f"dim {name!r} needs integers 1 <= 'min' <= 'example' <= 'max' (or 'max' null) "
                                f"<= {MAX_SIZE}, got {limits!r}")

    def user_inputs(self) -> None:
        names = set()
        dims = self.sig.get("dims", {})
        for i, entry in enumerate(self.sig["user_inputs"]):
            label = self.tensor(entry, f"user_inputs[{i}]", static=False)
            if entry.get("position") != i or not _is_int(entry.get("position")):
                raise self.fail(f"{label} has position {entry.get('position')!r}, expected {i}")
            if entry["name"] in names:
                raise self.fail(f"{label} is listed twice")
            names.add(entry["name"])
            for dim in entry["shape"]:
                if isinstance(dim, str) and dim not in dims:
                    raise self.fail(f"{label} has dimension {dim!r}, which 'dims' does not list")

    def state_entries(self) -> None:
        for i, entry in enumerate(self.sig["state"]):
            label = self.tensor(entry, f"state[{i}]", static=True)
            if entry.get("kind") not in _STATE_KINDS:
                raise self.fail(f"{label} has kind {entry.get('kind')!r}, not one of {_STATE_KINDS}")
            for flag in ("requires_grad", "persistent"):
                if not isinstance(entry.get(flag, True), bool):
                    raise self.fail(f"{label} has {flag} {entry[flag]!r}; expected true or false")
            if entry["name"] in self.state:
                raise self.fail(f"{label} is listed twice")
            self.state[entry["name"]] = entry

    def tied(self) -> None:
        tied = self.sig.get("tied", [])
        if not isinstance(tied, list):
            raise self.fail(f"'tied' must be a JSON array, got {tied!r}")
        names = set()
        for entry in tied:
            well_formed = isinstance(entry, dict) and all(isinstance(entry.get(k), str) for k in ("name", "state"))
            stored = self.state.get(entry["state"]) if well_formed else None
            if stored is None or stored["kind"] == "optimizer_state" or not entry["name"]:
                raise self.fail(f"tied entry {entry!r} must have a 'name' and a 'state' naming a parameter or buffer")
            if entry["name"] in self.state or entry["name"] in names:
                raise self.fail(f"tied name {entry['name']!r} is listed twice")
            names.add(entry["name"])

    def module_paths(self) -> None:
        """Parameter, buffer and tied names are where aot2onnx.load registers the tensors in a module: no part
        between dots is empty, and no name is the path of a module holding another (``fc`` and ``fc.weight``)."""
        names = [n for n, e in self.state.items() if e["kind"] != "optimizer_state"]
        names += [e["name"] for e in self.sig.get("tied", [])]
        tensors = set(names)
        for name in names:
            parts = name.split(".")
            if "" in parts:
                raise self.fail(f"state {name!r} is not a module path: a part between its dots is empty")
            for end in range(1, len(parts)):
                if ".".join(parts[:end]) in tensors:
                    raise self.fail(f"state {name!r} lies in module {'.'.join(parts[:end])!r}, which is a tensor too")

    def referent(self, refers_to: str, value: Any) -> dict | None:
        """The entry a source or target names, or None."""
        if refers_to in _STATE_KINDS:
            entry = self.state.get(value) if isinstance(value, str) else None
            return entry if entry is not None and entry["kind"] == refers_to else None
        if refers_to == "user_input":
            inputs = self.sig["user_inputs"]
            return inputs[value] if _is_int(value) and 0 <= value < len(inputs) else None
        table = self.forward_outputs if refers_to == "forward_output" else self.gradients
        return table.get(value) if isinstance(value, str) else None

    def entries(self, graph: str, direction: str, writers: dict[str, str]) -> None:
        roles = _ROLES[(graph, direction)]
        key, other = ("source", "target") if direction == "inputs" else ("target", "source")
        names: set[str] = set()
        indices: set[int] = set()
        for i, entry in enumerate(self.sections[graph][direction]):
            label = self.tensor(entry, f"{graph}.{direction}[{i}]", static=False)
            if entry["name"] in names:
                raise self.fail(f"{graph}.{direction} lists {entry['name']!r} twice")
            names.add(entry["name"])
            role = entry.get("role")
            if not isinstance(role, str) or role not in roles:  # a list would not hash
                raise self.fail(f"{label} has role {role!r}, not one of {sorted(roles)}")
            label = f"{label} ({role})"
            if other in entry:
                raise self.fail(f"{label} has a {other!r}: {direction} name their {key!r}")
            refers_to = roles[role]
            if refers_to is None:
                if key in entry:
                    raise self.fail(f"{label} has a {key!r}, which its role does not take")
            else:
                referent = self.referent(refers_to, entry.get(key))
                if referent is None:
                    raise self.fail(f"{label} has {key} {entry.get(key)!r}, which names no "
                                    f"{refers_to.replace('_', ' ')}")
                if not _same_layout(entry, referent):
                    raise self.fail(f"{label} is {_layout(entry)}, but its {key} {entry[key]!r} is {_layout(referent)}")
                if direction == "outputs" and graph != "backward":  # a gradient's target is read, not written
                    if entry[key] in writers:
                        raise self.fail(f"{label} writes state {entry[key]!r}, which {writers[entry[key]]} writes "
                                        "too: a state entry has one writer")
                    writers[entry[key]] = f"{graph}.outputs {entry['name']!r}"
                if role == "grad" and direction == "outputs" and referent.get("requires_grad") is False:
                    raise self.fail(f"{label} is a gradient of {entry[key]!r}, which has requires_grad false")
            if role in ("lr", "weight_decay") and (entry["dtype"], entry["shape"]) != ("float64", []):
                raise self.fail(f"{label} is {_layout(entry)}; the {role} input is float64[]")
            if role == "user_output":
                index = entry.get("index")
                if not _is_int(index) or index < 1 or index in indices:
                    raise self.fail(f"{label} has index {index!r}; expected a position >= 1 in the module's "
                                    "returned tuple, one per output")
                indices.add(index)
            elif "index" in entry:
                raise self.fail(f"{label} has an 'index', which only a user_output takes")
            if graph == "forward" and direction == "outputs":
                self.forward_outputs[entry["name"]] = entry
            if role == "grad" and direction == "outputs":
                # one gradient per parameter: the optimizer reads "the backward output whose target is" it
                if entry[key] in self.gradients:
                    raise self.fail(f"backward.outputs lists two gradients of {entry[key]!r}")
                self.gradients[entry[key]] = entry

    def losses(self) -> None:
        forward, backward = self.sections["forward"], self.sections["backward"]
        losses = [e for e in forward["outputs"] if e["role"] == "loss"]
        if len(losses) != 1:
            raise self.fail(f"the forward model must have exactly one loss output, the signature lists {len(losses)}")
        loss = losses[0]
        if loss["shape"] != [] or loss["dtype"] not in _FLOAT_DTYPES:
            raise self.fail(f"forward.outputs {loss['name']!r} (loss) is {_layout(loss)}; a loss is a floating-point "
                            "scalar")
        for entry in backward["inputs"]:
            if entry["role"] == "grad_of_loss" and not _same_layout(entry, loss):
                raise self.fail(f"backward.inputs {entry['name']!r} (grad_of_loss) is {_layout(entry)}, but the "
                                f"loss is {_layout(loss)}")
        if sum(e["role"] == "grad_of_loss" for e in backward["inputs"]) > 1:
            raise self.fail("backward.inputs lists more than one grad_of_loss")
        for graph in self.sections:
            for role in ("lr", "weight_decay"):
                if sum(e["role"] == role for e in self.sections[graph]["inputs"]) > 1:
                    raise self.fail(f"{graph}.inputs lists more than one {role}")
        if self.sig["module"]["returns"] == "loss" and any(e["role"] == "user_output" for e in forward["outputs"]):
            raise self.fail("module.returns is \"loss\", but forward.outputs lists user_output entries")

    def hyperparameters(self, section: dict) -> None:
        hyper = section.get("hyperparameters")
        if not isinstance(hyper, dict):
            raise self.fail(f"optimizer.hyperparameters must be a JSON object, got {hyper!r}")
        fields = _HYPERPARAMETERS.get(hyper["name"]) if isinstance(hyper.get("name"), str) else None
        if fields is None:
            raise self.fail(f"optimizer.hyperparameters names optimizer {hyper.get('name')!r}, not one of "
                            f"{sorted(_HYPERPARAMETERS)}")
        for field, (ok, what) in fields.items():
            if field not in hyper:
                raise self.fail(f"optimizer.hyperparameters has no {field!r} (an {hyper['name']} needs "
                                f"{', '.join(fields)})")
            if not ok(hyper[field]):
                raise self.fail(f"optimizer.hyperparameters {field!r} is {hyper[field]!r}; expected {what}")
        schedule = hyper.get("schedule")
        if schedule is not None:
            name = schedule.get("name") if isinstance(schedule, dict) else None
            ok = isinstance(name, str) and name in _SCHEDULES and all(
                _is_int(schedule.get(k)) and schedule[k] >= 0 for k in _SCHEDULES[name]) and (
                _is_number(schedule.get("num_cycles", 0.5)))
            if not ok:
                raise self.fail(f"optimizer.hyperparameters schedule {schedule!r} is not one this reader knows "
                                f"({sorted(_SCHEDULES)}, with integer warmup_steps and total_steps)")
        clip = hyper.get("max_grad_norm")
        if clip is not None and not (_is_number(clip) and clip > 0):
            raise self.fail(f"optimizer.hyperparameters max_grad_norm is {clip!r}; expected a number > 0 or null")


# ---------------------------------------------------------------------------------------------------------
# The models, read from the protobuf wire format (the onnx package is not a dependency here): the tensors held as
# external data, the inputs and outputs, and the metadata. The field numbers are onnx.proto's.

# From ModelProto to every TensorProto in it, for external data.
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
# The inputs, outputs and metadata: ModelProto.graph and .metadata_props; GraphProto.initializer, .input,
# .output, .sparse_initializer; ValueInfoProto.name, .type; TypeProto.tensor_type (.denotation is the only
# other field a tensor's type may carry); TypeProto.Tensor.elem_type, .shape; TensorShapeProto.dim;
# Dimension.dim_value, .dim_param; SparseTensorProto.values.
_MODEL_GRAPH, _MODEL_METADATA = 7, 14
_GRAPH_INITIALIZER, _GRAPH_INPUT, _GRAPH_OUTPUT, _GRAPH_SPARSE_INITIALIZER = 5, 11, 12, 15
_VALUE_NAME, _VALUE_TYPE = 1, 2
_TYPE_TENSOR, _TYPE_DENOTATION = 1, 6
_TENSOR_ELEM_TYPE, _TENSOR_SHAPE = 1, 2
_SHAPE_DIM = 1
_DIM_VALUE, _DIM_PARAM = 1, 2
_SPARSE_VALUES = 1
# TensorProto.DataType -> the signature's dtype names
_ONNX_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64", 9: "bool",
                10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 16: "bfloat16"}


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


def _fields(buf: memoryview) -> Iterator[tuple[int, memoryview | int | None]]:
    """(field number, value) for each field of one message: the bytes of a length-delimited field, the integer
    of a varint, None for a fixed-width field."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        wire = key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
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


def _by_field(buf: memoryview | bytes) -> dict[int, list[memoryview | int | None]]:
    fields: dict[int, list] = {}
    for number, value in _fields(memoryview(buf)):
        fields.setdefault(number, []).append(value)
    return fields


def _message(fields: Mapping[int, list], number: int) -> memoryview | bytes | None:
    """A singular message field: protobuf merges its occurrences, which is parsing their concatenation."""
    values = _repeated(fields, number)
    if not values:
        return None
    return values[0] if len(values) == 1 else b"".join(bytes(v) for v in values)


def _repeated(fields: Mapping[int, list], number: int) -> list[memoryview]:
    values = fields.get(number, [])
    if not all(isinstance(v, memoryview) for v in values):
        raise _Malformed
    return values


def _string(fields: Mapping[int, list], number: int) -> str:
    values = _repeated(fields, number)
    return bytes(values[-1]).decode("utf-8", "replace") if values else ""  # a singular field: the last counts


def _external_locations(buf: memoryview, message: str = "model") -> Iterator[tuple[str, str]]:
    """(tensor name, location) of every tensor stored as external data."""
    if message == "tensor":
        name, location = "", None
        for number, value in _fields(buf):
            if not isinstance(value, memoryview):
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
        if isinstance(value, memoryview) and number in children:
            yield from _external_locations(value, children[number])


def _string_entry(buf: memoryview) -> tuple[str | None, str]:
    """The key and value of a StringStringEntryProto."""
    key, value = None, ""
    for number, field in _fields(buf):
        if isinstance(field, memoryview) and number in (1, 2):
            text = bytes(field).decode("utf-8", "replace")
            key, value = (text, value) if number == 1 else (key, text)
    return key, value


@dataclasses.dataclass(frozen=True)
class _Model:
    """What the readers check of a model before ONNX Runtime opens it."""

    inputs: dict[str, tuple[str, list | None]]  # name -> (dtype, shape: sizes, dim names and None, or None)
    outputs: dict[str, tuple[str, list | None]]
    metadata: dict[str, list[str]]  # key -> every value the model gives it


def _read_model(model: pathlib.Path) -> _Model:
    """Checks the model's external data (before ONNX Runtime reads any), then reads its inputs, outputs and
    metadata."""
    data = memoryview(model.read_bytes())
    try:
        locations = list(_external_locations(data))
        fields = _by_field(data)
        graph = _by_field(_message(fields, _MODEL_GRAPH) or b"")
        inputs, outputs = (_value_infos(model, graph, number, direction)
                           for number, direction in ((_GRAPH_INPUT, "input"), (_GRAPH_OUTPUT, "output")))
        initializers = {_string(_by_field(t), _TENSOR_NAME) for t in _repeated(graph, _GRAPH_INITIALIZER)} | {
            _string(_by_field(_message(_by_field(t), _SPARSE_VALUES) or b""), _TENSOR_NAME)
            for t in _repeated(graph, _GRAPH_SPARSE_INITIALIZER)}
        metadata: dict[str, list[str]] = {}
        for entry in _repeated(fields, _MODEL_METADATA):
            key, value = _string_entry(entry)
            metadata.setdefault(key, []).append(value)
    except _Malformed:
        raise ArtifactError(f"{model} is not a valid ONNX model (malformed protobuf)") from None
    except RecursionError:
        raise ArtifactError(f"{model} nests graphs too deeply to be checked") from None
    for tensor, location in locations:
        # Locations are relative to the model's directory, which open_artifact checked is inside ``root``.
        path = _inside(model.parent, location, f"{model}: the external data of tensor {tensor!r}")
        if not path.is_file():
            raise ArtifactError(f"{model}: the external data of tensor {tensor!r} is in {location!r}, which is missing")
    # An input with an initializer of its name has a default (ONNX IR 4): ONNX Runtime does not require it.
    inputs = {name: io for name, io in inputs.items() if name not in initializers}
    return _Model(inputs, outputs, metadata)


def _value_infos(model: pathlib.Path, graph: Mapping[int, list], number: int,
                 direction: str) -> dict[str, tuple[str, list | None]]:
    values: dict[str, tuple[str, list | None]] = {}
    for info in _repeated(graph, number):
        fields = _by_field(info)
        name = _string(fields, _VALUE_NAME)
        kind = _by_field(_message(fields, _VALUE_TYPE) or b"")
        if name in values:
            raise ArtifactError(f"{model}: the model lists {direction} {name!r} twice")
        if _TYPE_TENSOR not in kind or set(kind) - {_TYPE_TENSOR, _TYPE_DENOTATION}:
            raise ArtifactError(f"{model}: {direction} {name!r} is not a tensor in the model")
        tensor = _by_field(_message(kind, _TYPE_TENSOR))
        elem_type = tensor.get(_TENSOR_ELEM_TYPE, [0])[-1]
        dtype = _ONNX_DTYPES.get(elem_type, f"ONNX element type {elem_type}") if _is_int(elem_type) else "?"
        shape = None
        if _TENSOR_SHAPE in tensor:
            shape = []
            for dim in _repeated(_by_field(_message(tensor, _TENSOR_SHAPE)), _SHAPE_DIM):
                size = None
                for field, value in _fields(dim):  # a oneof: the last of dim_value and dim_param counts
                    if field == _DIM_VALUE and _is_int(value):
                        size = value - 2**64 if value >= 2**63 else value
                    elif field == _DIM_PARAM and isinstance(value, memoryview):
                        size = bytes(value).decode("utf-8", "replace")
                shape.append(size)
        values[name] = (dtype, shape)
    return values


def check_model_io(model: pathlib.Path, section: Mapping[str, Any], io: _Model) -> None:
    """Refuses a model whose inputs or outputs differ from its section of the signature: in names, dtypes, ranks,
    or a static size (the model's static size where the signature names a dimension counts: the reader would
    feed it other sizes)."""
    for direction, actual in (("inputs", io.inputs), ("outputs", io.outputs)):
        expected = {e["name"]: e for e in section[direction]}
        for name in expected.keys() - actual.keys():
            raise ArtifactError(
                f"{model}: the signature lists {direction[:-1]} {name!r} ({expected[name]['role']}), which the model "
                f"does not have; the model's {direction}: {sorted(actual)}"
            )
        for name in actual.keys() - expected.keys():
            raise ArtifactError(f"{model}: the model has {direction[:-1]} {name!r}, which the signature does not list")
        for name, entry in expected.items():
            dtype, shape = actual[name]
            if dtype != entry["dtype"]:
                raise ArtifactError(f"{model}: {direction[:-1]} {name!r} is {dtype} in the model but {entry['dtype']} "
                                    "in the signature")
            if shape is None:
                raise ArtifactError(f"{model}: {direction[:-1]} {name!r} has no shape in the model; the signature "
                                    f"says {entry['shape']}")
            if len(shape) != len(entry["shape"]):
                raise ArtifactError(f"{model}: {direction[:-1]} {name!r} has rank {len(shape)} in the model but "
                                    f"{len(entry['shape'])} in the signature ({entry['shape']})")
            for got, want in zip(shape, entry["shape"]):
                if _is_int(got) and (got < 0 or not _is_int(want) or got != want):
                    raise ArtifactError(f"{model}: {direction[:-1]} {name!r} has shape {shape} in the model but "
                                        f"{entry['shape']} in the signature")


def check_embedded_signature(model: pathlib.Path, io: _Model, signature: Any, path: pathlib.Path) -> None:
    """Refuses a model whose embedded signature (metadata ``aot2onnx.signature``) differs from signature.json:
    models and signature from different exports. A model without one (a tool dropped it) passes."""
    embedded = io.metadata.get(SIGNATURE_KEY, [])
    if len(embedded) > 1:
        raise ArtifactError(f"{model} carries {len(embedded)} signatures (metadata {SIGNATURE_KEY!r})")
    if not embedded:
        return
    try:
        same = parse_json(embedded[0].encode("utf-8"), f"{model}: the embedded signature") == signature
    except ArtifactError:
        same = False
    if not same:
        raise ArtifactError(f"{model} carries a different signature than {path}: the files come from different "
                            "exports")


# What a model exported before DISABLED_OPTIMIZERS_KEY existed is read with: every rewrite aot2onnx had turned
# off by then, whether or not the model needs it (ExpandElimination only for models with an empty dimension).
_DISABLED_BEFORE_THE_KEY = ("NoopElimination", "ExpandElimination")
_OPTIMIZER_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


def _disabled_optimizers(model: pathlib.Path, io: _Model) -> list[str]:
    recorded = io.metadata.get(DISABLED_OPTIMIZERS_KEY)
    if recorded is None:
        return list(_DISABLED_BEFORE_THE_KEY)
    if len(recorded) > 1:
        raise ArtifactError(f"{model} names ONNX Runtime's disabled rewrites {len(recorded)} times (metadata "
                            f"{DISABLED_OPTIMIZERS_KEY!r})")
    names = recorded[0].split(",") if recorded[0] else []
    for name in names:
        if not _OPTIMIZER_NAME.fullmatch(name):
            raise ArtifactError(f"{model}: metadata {DISABLED_OPTIMIZERS_KEY!r} is {recorded[0]!r}, not a "
                                "comma-separated list of ONNX Runtime rewrite names")
    return names


def _one_thread(model: pathlib.Path, io: _Model) -> bool:
    recorded = io.metadata.get(ONE_THREAD_KEY)
    if recorded is None:
        return True  # exported before the entry: it may hold such a node
    if len(recorded) > 1:
        raise ArtifactError(f"{model} names its one-thread nodes {len(recorded)} times (metadata {ONE_THREAD_KEY!r})")
    return bool(recorded[0])


def _state_file(artifact: Artifact, *, load: bool) -> dict[str, np.ndarray]:
    """Checks that the state file holds every tensor of ``state`` with its dtype and shape (reading the header
    only); with ``load``, returns them."""
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
                if load:
                    tensors[name] = f.get_tensor(name)
    except ArtifactError:
        raise
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        raise ArtifactError(f"{path} is not a readable safetensors file: {e}") from e
    return tensors


def read_state(artifact: Artifact) -> dict[str, np.ndarray]:
    """The state tensors, each checked against the signature (present, dtype, shape)."""
    return _state_file(artifact, load=True)


# ---------------------------------------------------------------------------------------------------------
# Training


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
        self._sessions = {}
        for graph, path in artifact.models.items():
            # A ScatterND with a reduction loses updates on more than one thread (ONE_THREAD_KEY).
            options = session_options(1 if artifact.one_thread.get(graph, True) else intra_op_num_threads)
            try:
                session = ort.InferenceSession(str(path), sess_options=options,
                                               providers=list(providers or ["CPUExecutionProvider"]),
                                               disabled_optimizers=artifact.disabled_optimizers[graph])
            except Exception as e:  # onnxruntime raises several unrelated types for an unloadable model
                raise ArtifactError(f"{path}: ONNX Runtime cannot load it: {e}") from e
            self._sessions[graph] = session
        self.state: dict[str, np.ndarray] = read_state(artifact)
        self.steps = 0
        sig = artifact.signature
        self._user_inputs = sig["user_inputs"]
        self._dims = sig.get("dims") or {}
        self._loss = next(e["name"] for e in sig["forward"]["outputs"] if e["role"] == "loss")

    def _run(self, graph: str, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        entries = self.artifact.entries(graph, "outputs")
        names = [e["name"] for e in entries]
        try:
            results = self._sessions[graph].run(names, dict(feeds))
        except Exception as e:  # onnxruntime's error types (Fail, InvalidArgument, ...) share no public base
            raise StepError(f"{self.artifact.models[graph]}: ONNX Runtime failed at step {self.steps + 1}: "
                            f"{' '.join(str(e).split())}") from e
        return dict(zip(names, results))

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
            raise AssertionError(role)  # check_signature admits no other role

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
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = dict(data.items()) if not isinstance(data, np.ndarray) else None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise ValueError(f"{path} is not an .npz file numpy reads with allow_pickle=False: {e}") from e
    except TypeError:  # np.load of a single .npy array returns the array, which is no context manager
        arrays = None
    if arrays is None:
        raise ValueError(f"{path} holds one array; --data takes an .npz (np.savez) with one array per user input")
    ordered = []
    for spec in user_inputs:
        for key in (spec["name"], f"arr_{spec['position']}"):
            if key in arrays:
                ordered.append(arrays[key])
                break
        else:
            raise ValueError(f"{path} has no array {spec['name']!r} (or arr_{spec['position']}); it holds {sorted(arrays)}")
    counts = {a.shape[0] if a.ndim else None for a in ordered}
    if len(counts) != 1 or None in counts or 0 in counts:
        raise ValueError(f"{path}: every array needs the same leading (batch index) axis, of one batch or more, got "
                         f"shapes {[list(a.shape) for a in ordered]}")
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
    except (ArtifactError, ValueError, OSError, StepError) as e:
        # Bad input, said in one line. Any other exception is a bug of this reader and keeps its traceback.
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
