"""The persistent cache's trust: this user's secret, which keys every entry's HMAC, and the checks that a cache
directory and a secret file are this user's alone (see :mod:`aot2onnx.compile.cache`)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import stat
import tempfile
import warnings

__all__ = ["Untrusted", "cache_secret", "check_directory", "secret_path"]


_SECRET_BYTES = 32


def secret_path() -> pathlib.Path:
    """Where the cache's secret lives: ``AOT2ONNX_CACHE_SECRET_FILE``, else the user configuration directory.

    Outside the cache directory, so that whoever may write cache entries (a shared CI cache, a directory
    restored from an archive) does not get the key with them.
    """
    configured = os.environ.get("AOT2ONNX_CACHE_SECRET_FILE")
    if configured:
        return pathlib.Path(configured).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return pathlib.Path(base) / "aot2onnx" / "cache-secret"


class Untrusted(Exception):
    """Why a cache directory or a secret file cannot be used (the message completes a sentence)."""


def _check_owner_and_mode(st: os.stat_result, what: str, forbidden: int) -> None:
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise Untrusted(f"{what} is owned by another user (uid {st.st_uid}, this process runs as {os.getuid()})")
    if st.st_mode & forbidden:
        raise Untrusted(f"{what} has mode {stat.S_IMODE(st.st_mode):#o}")


def _read_or_create_secret(path: pathlib.Path) -> bytes:
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Written whole under a temporary name (mkstemp's mode is 0600), then linked into place: a link does
        # not replace a secret another process published meanwhile, and no one reads a half-written one.
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(os.urandom(_SECRET_BYTES))
                out.flush()
                os.fsync(out.fileno())
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
        f = open(path, "rb")
    with f:
        # Checked on the open file: what is read is what was checked.
        _check_owner_and_mode(os.fstat(f.fileno()), "it", 0o077)
        secret = f.read()
    if len(secret) < 16:
        raise Untrusted(f"it holds {len(secret)} bytes, fewer than 16")
    return secret


_SECRETS: dict[pathlib.Path, bytes | None] = {}


def cache_secret() -> bytes | None:
    """This user's cache secret, created on first use; ``None`` (after one warning) when it cannot be trusted."""
    path = secret_path()
    if path not in _SECRETS:
        try:
            _SECRETS[path] = _read_or_create_secret(path)
        except (OSError, Untrusted) as e:
            _SECRETS[path] = None
            warnings.warn(
                f"aot2onnx: the persistent cache is off in this process: its secret file {path} cannot be "
                f"trusted: {e}. The file must belong to you and be readable by you alone (chmod 600 {path}); "
                f"delete it to have a new one made, or point AOT2ONNX_CACHE_SECRET_FILE elsewhere.",
                UserWarning,
                stacklevel=2,
            )
    return _SECRETS[path]


def check_directory(directory: pathlib.Path) -> None:
    """Raises ``Untrusted`` for a cache directory another user could write entries into."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = directory.stat()
    except OSError as e:
        raise Untrusted(f"it cannot be created or read ({e})") from e
    if not stat.S_ISDIR(st.st_mode):
        raise Untrusted("it is not a directory")
    # Writable by others is refused unless sticky: in a sticky directory of ours, others may add files but
    # not replace or remove ours, and what they add does not authenticate.
    _check_owner_and_mode(st, "it", 0 if st.st_mode & stat.S_ISVTX else 0o022)
