"""A persistent on-disk cache of lowered graphs.

An entry holds one lowered ONNX model and its :class:`~aot2onnx.signature.GraphSignature`. Its key covers
everything that decides the lowering: the FX graph (ops, arguments, every node's dtype and shape, constant
tensors' bytes), the options that change the model (opset), the lowering rules the graph uses (user rules
by their code), the source of aot2onnx itself, and the versions of torch, onnx, onnxscript, onnx_ir,
onnxruntime and aot2onnx.

Entries are written atomically: the file is written under a temporary name in the same directory and then
renamed, so a process killed mid-write leaves at most a temporary file, never an entry. Each entry also
stores a digest of its model bytes and its own key, and an entry that does not verify is ignored. Nothing
in an entry is unpickled: the header is JSON, the model is ONNX protobuf.

The directory's ``aot/`` part is AOTAutograd's own cache, one level up (see ``aot2onnx.capture.aot``);
its entries are torch's pickles, which name graphs of this cache by key.

``AOT2ONNX_CACHE_DIR`` sets the directory (default ``$XDG_CACHE_HOME/aot2onnx`` or ``~/.cache/aot2onnx``);
setting it to an empty string, ``0`` or ``off`` turns the cache off, as does the ``cache=False`` option.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import pathlib
import tempfile
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from aot2onnx.signature import GraphSignature, InputKind, InputSpec, OutputKind, OutputSpec

__all__ = [
    "CachedGraph",
    "GraphCache",
    "default_cache_dir",
    "environment_key",
    "function_fingerprint",
    "graph_key",
    "package_fingerprint",
]

logger = logging.getLogger("aot2onnx")

_FORMAT = "aot2onnx.cache/1"
_OFF = ("", "0", "off", "false", "no")


def default_cache_dir() -> pathlib.Path | None:
    """The cache directory from ``AOT2ONNX_CACHE_DIR``, or the user cache directory; ``None`` when off."""
    configured = os.environ.get("AOT2ONNX_CACHE_DIR")
    if configured is not None:
        return None if configured.strip().lower() in _OFF else pathlib.Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "aot2onnx"


_PACKAGE_ROOT = pathlib.Path(__file__).parent


def _hash_sources(digest: Any, paths: list[pathlib.Path]) -> None:
    """Adds each file's path (relative to the package) and contents to ``digest``, in path order."""
    for path in sorted(paths):
        digest.update(str(path.relative_to(_PACKAGE_ROOT)).encode())
        digest.update(path.read_bytes())


@functools.cache
def _environment_fingerprint() -> str:
    """Versions of everything the lowering depends on, and a digest of aot2onnx's own source."""
    digest = hashlib.sha256()
    for package in ("torch", "onnx", "onnxscript", "onnx_ir", "onnxruntime", "aot2onnx"):
        try:
            version = importlib.metadata.version(package.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            version = "?"
        digest.update(f"{package}={version};".encode())
    # The package version does not change with every edit of a rule; the source of the lowering does.
    root = _PACKAGE_ROOT
    _hash_sources(digest, [*root.joinpath("lower").rglob("*.py"), root / "signature.py", root / "cache.py"])
    return digest.hexdigest()


@functools.cache
def package_fingerprint() -> str:
    """A digest of all of aot2onnx's source: AOTAutograd-level entries also depend on the capture (the
    decomposition table, the partitioner's settings) and on the backend's glue."""
    digest = hashlib.sha256()
    _hash_sources(digest, list(_PACKAGE_ROOT.rglob("*.py")))
    return digest.hexdigest()


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"T({value.dtype},{tuple(str(s) for s in value.shape)},{tuple(str(s) for s in value.stride())})"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_describe_value(v) for v in value) + "]"
    return type(value).__name__ + ":" + str(value)


def function_fingerprint(function: Any) -> str:
    code = getattr(function, "__code__", None)
    if code is None:  # an onnxscript OnnxFunction or another callable object
        proto = getattr(function, "to_function_proto", None)
        return proto().SerializeToString().hex() if proto else repr(function)
    digest = hashlib.sha256(code.co_code)
    digest.update(repr(code.co_consts).encode())
    digest.update(repr(code.co_names).encode())
    return digest.hexdigest()


def environment_key(*parts: Any) -> str:
    """A key that depends only on the environment (versions, aot2onnx's source) and ``parts``."""
    return hashlib.sha256(f"{_FORMAT};{_environment_fingerprint()};{parts!r}".encode()).hexdigest()


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A constant's data. The key is made inside AOTAutograd's fake mode, which refuses any op on a real
    tensor (the graph's constants are real): reading them needs the mode lifted for the read."""
    with unset_fake_temporarily():
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def graph_key(gm: torch.fx.GraphModule, *, opset: int, rules: list[Any]) -> str:
    """The cache key of lowering ``gm`` at ``opset``; ``rules`` are the user's lowering rules.

    aot2onnx's own rules and torch_lib's are covered by the source digest and the versions; a user's rule
    is keyed by its code, so editing it invalidates what it lowered.
    """
    digest = hashlib.sha256()
    digest.update(f"{_FORMAT};{_environment_fingerprint()};opset={opset};".encode())
    for node in gm.graph.nodes:
        digest.update(f"{node.op}|{node.name}|{node.target}|{node.args}|{node.kwargs}|".encode())
        digest.update(_describe_value(node.meta.get("val")).encode())
        if node.op == "get_attr":
            tensor = getattr(gm, node.target)
            if isinstance(tensor, torch.Tensor):
                digest.update(_tensor_bytes(tensor))
    for rule in rules:
        digest.update(f"{rule.origin}:{rule.name}:{function_fingerprint(rule.function)}".encode())
    return digest.hexdigest()


def _signature_to_json(signature: GraphSignature) -> dict[str, Any] | None:
    outputs = []
    for spec in signature.outputs:
        if spec.value is not None and not isinstance(spec.value, (bool, int, float, str)):
            return None  # a constant JSON cannot hold: not cached
        outputs.append({"kind": spec.kind.value, "onnx_name": spec.onnx_name, "index": spec.index, "value": spec.value})
    inputs = [{"kind": spec.kind.value, "onnx_name": spec.onnx_name} for spec in signature.inputs]
    return {"inputs": inputs, "outputs": outputs}


def _signature_from_json(data: dict[str, Any]) -> GraphSignature:
    inputs = tuple(InputSpec(InputKind(i["kind"]), i["onnx_name"]) for i in data["inputs"])
    outputs = tuple(
        OutputSpec(OutputKind(o["kind"]), o["onnx_name"], o["index"], o["value"]) for o in data["outputs"]
    )
    return GraphSignature(inputs, outputs)


@dataclasses.dataclass(frozen=True)
class CachedGraph:
    model_bytes: bytes
    signature: GraphSignature
    fx_node_count: int


class GraphCache:
    """Lowered graphs on disk, one file per key: a JSON header line, then the serialized ONNX model."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = pathlib.Path(directory)

    def _path(self, key: str) -> pathlib.Path:
        return self.directory / key[:2] / f"{key}.onnxentry"

    def load(self, key: str) -> CachedGraph | None:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        header_line, _, model_bytes = data.partition(b"\n")
        try:
            header = json.loads(header_line)
            valid = (
                header.get("format") == _FORMAT
                and header.get("key") == key
                and header.get("model_sha256") == hashlib.sha256(model_bytes).hexdigest()
            )
            entry = CachedGraph(model_bytes, _signature_from_json(header["signature"]), int(header["fx_node_count"]))
        except (ValueError, KeyError, TypeError):
            valid = False
        if not valid:
            logger.warning("aot2onnx: ignoring the cache entry %s: it does not verify", path)
            return None
        return entry

    def load_json(self, key: str) -> Any:
        """A small JSON entry (e.g. the list of lowerable ops), or ``None``."""
        try:
            data = json.loads(self._path(key).with_suffix(".json").read_text())
        except (OSError, ValueError):
            return None
        return data.get("value") if isinstance(data, dict) and data.get("key") == key else None

    def store_json(self, key: str, value: Any) -> None:
        self._write(self._path(key).with_suffix(".json"), json.dumps({"key": key, "value": value}).encode())

    def store(self, key: str, model_bytes: bytes, signature: GraphSignature, fx_node_count: int) -> bool:
        signature_json = _signature_to_json(signature)
        if signature_json is None:
            return False
        header = {
            "format": _FORMAT,
            "key": key,
            "model_sha256": hashlib.sha256(model_bytes).hexdigest(),
            "fx_node_count": fx_node_count,
            "signature": signature_json,
        }
        return self._write(self._path(key), json.dumps(header, sort_keys=True).encode() + b"\n" + model_bytes)

    def _write(self, path: pathlib.Path, data: bytes) -> bool:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Written under a temporary name in the same directory, then renamed: readers see the whole
            # entry or none.
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as e:
            logger.warning("aot2onnx: could not write the cache entry %s: %s", path, e)
            return False
        return True
