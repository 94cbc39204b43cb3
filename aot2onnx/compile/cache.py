"""A persistent on-disk cache of lowered graphs.

An entry holds one lowered ONNX model and its :class:`~aot2onnx.signature.GraphSignature`. Its key covers
everything that decides the lowering: the FX graph (ops, arguments, every node's dtype and shape, constant
tensors' bytes), the options that change the model (opset), the user's lowering rules (see
:func:`function_fingerprint`), the source of aot2onnx itself, and the versions of torch, onnx, onnxscript,
onnx_ir, onnxruntime and aot2onnx.

Entries are written atomically: the file is written under a temporary name in the same directory and then
renamed, so a process killed mid-write leaves at most a temporary file, never an entry; the first process to
open the cache after that file is an hour old removes it. Each entry also
stores a digest of its model bytes and its own key, and an entry that does not verify is ignored. Nothing
in an entry is unpickled: the header is JSON, the model is ONNX protobuf.

Every entry is authenticated: its header carries an HMAC-SHA256, keyed by a secret of this user's (32
random bytes, created on first use with mode 0600 outside the cache directory, see :func:`secret_path`).
Whoever can write to the cache directory but cannot read the secret cannot make an entry this process
serves: a forged model, or a pickle for AOTAutograd's part to load, is a miss with a warning. A directory
that others can write to or that another user owns, and a secret file that others can read or that another
user owns, turn the cache off for the process, with one warning that says what to fix.

The directory's ``aot/`` part is AOTAutograd's own cache, one level up (see ``aot2onnx.capture.aot``);
its entries are torch's pickles, which name graphs of this cache by key, each sealed with the same HMAC
(:class:`Authenticator`) and checked before torch unpickles it.

``AOT2ONNX_CACHE_DIR`` sets the directory (default ``$XDG_CACHE_HOME/aot2onnx`` or ``~/.cache/aot2onnx``);
setting it to an empty string, ``0`` or ``off`` turns the cache off, as does the ``cache=False`` option.
``AOT2ONNX_CACHE_SECRET_FILE`` sets the secret's file (default ``$XDG_CONFIG_HOME/aot2onnx/cache-secret``
or ``~/.config/aot2onnx/cache-secret``).

This module is the store (entries on disk, written atomically, read back verified); the keys are computed in
:mod:`aot2onnx.compile.cache_fingerprint` and the secret and the directory's checks are
:mod:`aot2onnx.compile.cache_trust`'s. Their public names are importable from here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import pathlib
import re
import stat
import tempfile
import time
import warnings
from typing import Any

from aot2onnx.authentication import Authenticator
from aot2onnx.compile.cache_fingerprint import (
    FORMAT,
    environment_key,
    function_fingerprint,
    graph_key,
    package_fingerprint,
    rule_key,
    unkeyed_rule,
)
from aot2onnx.compile.cache_trust import Untrusted, cache_secret, check_directory, secret_path
from aot2onnx.signature import CheckSpec, GraphSignature, InputKind, InputSpec, MutationSpec, OutputKind, OutputSpec

__all__ = [
    "Authenticator",
    "CachedGraph",
    "GraphCache",
    "cache_secret",
    "default_cache_dir",
    "environment_key",
    "function_fingerprint",
    "graph_key",
    "package_fingerprint",
    "rule_key",
    "secret_path",
    "unkeyed_rule",
]

logger = logging.getLogger("aot2onnx")

_OFF = ("", "0", "off", "false", "no")


def default_cache_dir() -> pathlib.Path | None:
    """The cache directory from ``AOT2ONNX_CACHE_DIR``, or the user cache directory; ``None`` when off."""
    configured = os.environ.get("AOT2ONNX_CACHE_DIR")
    if configured is not None:
        return None if configured.strip().lower() in _OFF else pathlib.Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "aot2onnx"


_REFUSED_DIRECTORIES: set[pathlib.Path] = set()
_SWEPT_DIRECTORIES: set[pathlib.Path] = set()

# A writer's temporary file lives for the seconds between its creation and the rename that publishes it (or its
# removal on an error). One older than this was left by a writer that was killed (SIGKILL, power loss): nothing
# else would ever remove it. A writer that is still alive past it fails its rename and logs a warning; nothing
# that was published is touched.
STALE_TEMPORARY_SECONDS = 3600
# GraphCache._write's mkstemp prefix; torch's write_atomic (AOTAutograd's entries, under aot/): ".<pid>.<thread>.tmp"
_TEMPORARY_NAME = re.compile(r"\.tmp-.*|\.\d+\.\d+\.tmp")


def _remove_stale_temporaries(directory: pathlib.Path) -> None:
    """Removes the temporary files that killed writers left under ``directory`` (once per process and directory,
    when the cache opens). Only regular files named as the writers name theirs and older than
    STALE_TEMPORARY_SECONDS; symbolic links are not followed."""
    cutoff = time.time() - STALE_TEMPORARY_SECONDS
    removed = 0
    for root, _, names in os.walk(directory):
        for name in names:
            if not _TEMPORARY_NAME.fullmatch(name):
                continue
            path = os.path.join(root, name)
            # Another process may remove or publish it meanwhile; a file of another user's (in a sticky
            # directory) is not ours to remove.
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff:
                    os.unlink(path)
                    removed += 1
    if removed:
        logger.info("aot2onnx: removed %d temporary files that writers killed mid-write left in %s", removed, directory)


def _signature_to_json(signature: GraphSignature) -> dict[str, Any] | None:
    outputs = []
    for spec in signature.outputs:
        if spec.value is not None and not isinstance(spec.value, (bool, int, float, str)):
            return None  # a constant JSON cannot hold: not cached
        outputs.append({"kind": spec.kind.value, "onnx_name": spec.onnx_name, "index": spec.index, "value": spec.value,
                        "is_complex": spec.is_complex})
    inputs = [{"kind": spec.kind.value, "onnx_name": spec.onnx_name, "is_complex": spec.is_complex}
              for spec in signature.inputs]
    mutations = [{"index": spec.index, "onnx_name": spec.onnx_name} for spec in signature.mutations]
    checks = [{"onnx_name": c.onnx_name, "api_name": c.api_name, "is_matrix": c.is_matrix, "kind": c.kind}
              for c in signature.checks]
    return {"inputs": inputs, "outputs": outputs, "mutations": mutations, "checks": checks}


def _signature_from_json(data: dict[str, Any]) -> GraphSignature:
    inputs = tuple(InputSpec(InputKind(i["kind"]), i["onnx_name"], i["is_complex"]) for i in data["inputs"])
    outputs = tuple(
        OutputSpec(OutputKind(o["kind"]), o["onnx_name"], o["index"], o["value"], o["is_complex"])
        for o in data["outputs"]
    )
    mutations = tuple(MutationSpec(m["index"], m["onnx_name"]) for m in data["mutations"])
    checks = tuple(CheckSpec(c["onnx_name"], c["api_name"], c["is_matrix"], c.get("kind", "linalg"))
                   for c in data.get("checks", ()))
    return GraphSignature(inputs, outputs, mutations, checks)


@dataclasses.dataclass(frozen=True)
class CachedGraph:
    model_bytes: bytes
    signature: GraphSignature
    fx_node_count: int


class GraphCache:
    """Lowered graphs on disk, one file per key: a JSON header line, then the serialized ONNX model.

    The header's ``hmac`` authenticates the rest of the header, which holds the key and the model's
    SHA-256: an entry verifies only if this user's aot2onnx wrote it under this key.
    """

    def __init__(self, directory: str | os.PathLike, secret: bytes | None = None) -> None:
        """``secret`` defaults to :func:`cache_secret`; prefer :meth:`open`, which also checks the directory."""
        self.directory = pathlib.Path(directory)
        secret = cache_secret() if secret is None else secret
        if secret is None:
            raise PermissionError("aot2onnx: the cache has no usable secret (see the warning above)")
        self.authenticator = Authenticator(secret)

    @classmethod
    def open(cls, directory: str | os.PathLike) -> GraphCache | None:
        """The cache in ``directory``, or ``None`` (after one warning per directory and process) when other
        users could write to the directory or own it, or when the secret cannot be trusted."""
        directory = pathlib.Path(directory)
        if directory in _REFUSED_DIRECTORIES:
            return None
        try:
            check_directory(directory)
        except Untrusted as e:
            _REFUSED_DIRECTORIES.add(directory)
            warnings.warn(
                f"aot2onnx: the persistent cache is off in this process: other users could write entries into "
                f"its directory {directory}: {e}. Use a directory that belongs to you and that only you can "
                f"write to (chmod 700 {directory}), or set AOT2ONNX_CACHE_DIR.",
                UserWarning,
                stacklevel=2,
            )
            return None
        secret = cache_secret()
        if secret is None:
            return None
        if directory not in _SWEPT_DIRECTORIES:
            _SWEPT_DIRECTORIES.add(directory)
            _remove_stale_temporaries(directory)
        return cls(directory, secret)

    def _path(self, key: str) -> pathlib.Path:
        return self.directory / key[:2] / f"{key}.onnxentry"

    def _header_mac(self, header: dict[str, Any]) -> str:
        return self.authenticator.mac(b"graph", json.dumps(header, sort_keys=True).encode()).hex()

    def load(self, key: str) -> CachedGraph | None:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        header_line, _, model_bytes = data.partition(b"\n")
        try:
            header = json.loads(header_line)
            mac = header.pop("hmac")
            authentic = isinstance(mac, str) and hmac.compare_digest(mac, self._header_mac(header))
            valid = (
                authentic
                and header.get("format") == FORMAT
                and header.get("key") == key
                and header.get("model_sha256") == hashlib.sha256(model_bytes).hexdigest()
            )
            entry = CachedGraph(model_bytes, _signature_from_json(header["signature"]), int(header["fx_node_count"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            authentic = valid = False
        if not valid:
            why = "" if authentic else " (its HMAC does not match: written by someone else, altered or truncated)"
            logger.warning("aot2onnx: ignoring the cache entry %s: it does not verify%s", path, why)
            return None
        return entry

    def load_json(self, key: str) -> Any:
        """A small JSON entry (e.g. the list of lowerable ops), or ``None``."""
        try:
            data = json.loads(self._path(key).with_suffix(".json").read_text())
            mac = data.pop("hmac")
            if data.get("key") == key and hmac.compare_digest(mac, self._header_mac(data)):
                return data.get("value")
        except (OSError, ValueError, AttributeError, KeyError, TypeError):
            pass
        return None

    def store_json(self, key: str, value: Any) -> None:
        data = {"key": key, "value": value}
        data["hmac"] = self._header_mac(data)
        self._write(self._path(key).with_suffix(".json"), json.dumps(data).encode())

    def store(self, key: str, model_bytes: bytes, signature: GraphSignature, fx_node_count: int) -> bool:
        signature_json = _signature_to_json(signature)
        if signature_json is None:
            return False
        header = {
            "format": FORMAT,
            "key": key,
            "model_sha256": hashlib.sha256(model_bytes).hexdigest(),
            "fx_node_count": fx_node_count,
            "signature": signature_json,
        }
        header["hmac"] = self._header_mac(header)
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
