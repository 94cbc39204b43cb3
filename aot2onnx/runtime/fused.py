"""aot2onnx's fused training kernels (``fused_ops.cc``): built at set-up, loaded into the compile backend's CPU
sessions, said to be missing once.

The library is ONNX Runtime custom ops (domain ``signature.FUSED_DOMAIN``) that run ATen's own CPU kernels on
ONNX Runtime's buffers, so a fused gradient computes eager's values bit for bit. ``python -m
aot2onnx kernels build`` (run by ``make demo`` and ``make test``) builds it with the machine's C++
compiler against:

- ONNX Runtime's C/C++ API headers, which no PyPI package ships: they come from the npm package named in
  ``_HEADERS`` (an ONNX Runtime build for Unity, MIT, which carries the official headers), fetched with
  ``npm pack`` at a pinned version and checked against its pinned SHA-512 before anything is read from it;
- torch's own headers and libraries, from the installed torch wheel.

A machine without a compiler or npm still installs and trains, on standard ONNX operators; the first compile
says so once. The library is tied to the torch it was built against: a torch upgraded since is told the same
way, and ``build`` makes it again. Its build id (:func:`build_id`) is part of every cache key that depends on
it.
"""

from __future__ import annotations

import base64
import ctypes
import functools
import hashlib
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading

import torch

__all__ = ["build", "build_id", "library", "missing_reason", "note_missing_once"]

logger = logging.getLogger(__name__)

# The kernels, and the run of a CPU graph with no Python per tensor (native_run.cc, runtime/native_run.py).
_SOURCES = (pathlib.Path(__file__).with_name("fused_ops.cc"), pathlib.Path(__file__).with_name("native_run.cc"))
_OUT_DIR = pathlib.Path(__file__).with_name("_fused")
_LIBRARY = _OUT_DIR / "libaot2onnx_fused.so"
_STAMP = _OUT_DIR / "build.json"

# The npm package carrying ONNX Runtime's C/C++ API headers (ORT_API_VERSION 29; a newer ONNX Runtime accepts
# a library built against an older API version), its version and the SHA-512 of its tarball as the registry
# publishes it (dist.integrity).
_HEADERS = {
    "package": "com.github.asus4.onnxruntime",
    "version": "0.4.9",
    "sha512": "BkzxduSZ9IkeDP6Q8lz2TFU2ie7hSSvS7ZIfzMooExoq0CNzJnuuGaUJ7IsojBgqO4ouD1jXah8OYyJbCN29Fg==",
    "directory": "package/Plugins/iOS~/onnxruntime.xcframework/ios-arm64_x86_64-simulator/onnxruntime.framework/Headers/",
}


def _torch_fingerprint() -> str:
    return f"{torch.__version__};abi={int(torch.compiled_with_cxx11_abi())}"


# How _compile builds the library: a change of it rebuilds an installed library as a change of the source does.
_RECIPE = b"3: OpenMP where the compiler has it; no contracted multiply-add"


def _source_digest() -> str:
    return hashlib.sha256(b"".join(source.read_bytes() for source in _SOURCES) + _RECIPE).hexdigest()


# ---------------------------------------------------------------------------------------------------------
# Building


def _fetch_headers(into: pathlib.Path) -> pathlib.Path:
    """ONNX Runtime's headers, from the pinned npm package, checked against its pinned SHA-512."""
    headers = into / f"ort-headers-{_HEADERS['version']}"
    if (headers / "onnxruntime_cxx_api.h").exists():
        return headers
    npm = shutil.which("npm")
    if npm is None:
        raise _NotBuilt("npm is not installed (it fetches ONNX Runtime's C API headers)")
    with tempfile.TemporaryDirectory() as work:
        spec = f"{_HEADERS['package']}@{_HEADERS['version']}"
        done = subprocess.run([npm, "pack", spec, "--silent", "--pack-destination", work], capture_output=True,
                              text=True, timeout=900)
        if done.returncode != 0:
            raise _NotBuilt(f"npm pack {spec} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        tarball = next(pathlib.Path(work).glob("*.tgz"))
        digest = base64.b64encode(hashlib.sha512(tarball.read_bytes()).digest()).decode()
        if digest != _HEADERS["sha512"]:
            raise RuntimeError(f"{tarball.name}: SHA-512 {digest} is not the pinned {_HEADERS['sha512']}; not used")
        staging = into / f".ort-headers-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        with tarfile.open(tarball) as archive:
            for member in archive.getmembers():
                name = member.name[len(_HEADERS["directory"]):]
                if member.isfile() and member.name.startswith(_HEADERS["directory"]) and "/" not in name and name.endswith(".h"):
                    source = archive.extractfile(member)
                    assert source is not None
                    (staging / name).write_bytes(source.read())
        shutil.rmtree(headers, ignore_errors=True)
        staging.rename(headers)
    return headers


def _compile(headers: pathlib.Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        raise _NotBuilt("no C++ compiler (g++, c++ or clang++) is installed")
    torch_dir = pathlib.Path(torch.__file__).parent
    _OUT_DIR.mkdir(exist_ok=True)
    staging = _OUT_DIR / f".{_LIBRARY.name}.{os.getpid()}"
    base = [
        # -ffp-contract=off: a multiply and an add stay two roundings, as in the nodes the fused Elementwise replaces.
        compiler, "-std=c++20", "-O2", "-ffp-contract=off", "-fPIC", "-shared", "-fvisibility=hidden",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
        f"-I{headers}", f"-I{torch_dir / 'include'}", *map(str, _SOURCES), "-o", str(staging),
        f"-L{torch_dir / 'lib'}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}",
    ]
    # OpenMP: the library's own loops split by ATen's parallel_for, an OpenMP region in ATen's headers (torch's
    # libgomp.so.1 serves it, loaded already). A compiler without OpenMP builds them serial: the same values.
    failures = []
    for openmp in (["-fopenmp"], []):
        command = base[:1] + openmp + base[1:]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        if done.returncode == 0:
            break
        failures.append(f"{' '.join(command)}\n{done.stderr[-4000:]}")
    else:
        raise RuntimeError("building the fused kernels failed:\n" + "\n".join(failures))
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    staging.replace(_LIBRARY)
    _STAMP.write_text(json.dumps({
        "source": _source_digest(), "torch": _torch_fingerprint(), "headers": _HEADERS["version"],
        "compiler": version[0] if version else compiler, "openmp": bool(openmp),
        "library": hashlib.sha256(_LIBRARY.read_bytes()).hexdigest(),
    }, indent=1))


class _NotBuilt(Exception):
    """What the machine lacks to build the library: set-up goes on without it."""


def build(cache_dir: pathlib.Path | None = None) -> str | None:
    """Builds the library where it is missing or stale; returns None, or why it was not built (a missing
    compiler or npm). A build that fails for another reason raises."""
    if missing_reason(check_loadable=False) is None:
        return None
    cache_dir = cache_dir or pathlib.Path(__file__).resolve().parents[2] / "build"
    try:
        _compile(_fetch_headers(cache_dir))
    except _NotBuilt as e:
        return str(e)
    library.cache_clear()
    missing_reason.cache_clear()
    return None


# ---------------------------------------------------------------------------------------------------------
# Using


@functools.cache
def missing_reason(check_loadable: bool = True) -> str | None:
    """Why the library cannot be used in this process, or None."""
    if not _LIBRARY.exists() or not _STAMP.exists():
        return ("aot2onnx's fused training kernels are not built (set-up found no C++ compiler or npm, or did "
                "not run: `python -m aot2onnx kernels build`)")
    stamp = json.loads(_STAMP.read_text())
    if stamp.get("torch") != _torch_fingerprint() or stamp.get("source") != _source_digest():
        return ("aot2onnx's fused training kernels were built for another torch or source "
                f"({stamp.get('torch')}); rebuild them: `python -m aot2onnx kernels build`")
    if check_loadable:
        try:
            ctypes.CDLL(str(_LIBRARY))
        except OSError as e:
            return f"aot2onnx's fused training kernels do not load: {e}"
    return None


@functools.cache
def library() -> str | None:
    """The library's path where this process can use it, else None."""
    return str(_LIBRARY) if missing_reason() is None else None


@functools.cache
def build_id() -> str:
    """What the library in use is, for cache keys: its build's digest, or "none"."""
    if library() is None:
        return "none"
    return json.loads(_STAMP.read_text())["library"]


_noted = threading.Event()


def note_missing_once() -> None:
    """Says once per process, at the first compile, that training runs without the fused kernels, and why."""
    if _noted.is_set():
        return
    _noted.set()
    reason = missing_reason()
    if reason is not None:
        logger.warning("%s; training runs on standard ONNX operators", reason)


def main(argv: list[str]) -> int:
    if argv[:1] != ["build"]:
        print("usage: python -m aot2onnx kernels build", file=sys.stderr)
        return 2
    try:
        reason = build()
    except Exception as e:  # a failed build leaves aot2onnx working on standard operators: say so, loudly
        print(f"aot2onnx: building the fused training kernels FAILED; aot2onnx trains without them, on standard "
              f"ONNX operators.\n{e}", file=sys.stderr)
        return 0
    if reason is not None:
        print(f"aot2onnx: fused training kernels not built: {reason}. aot2onnx installs and trains without "
              "them, on standard ONNX operators.")
    else:
        print(f"aot2onnx: fused training kernels ready: {_LIBRARY}")
    return 0

