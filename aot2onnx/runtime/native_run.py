"""A CPU graph's run with no Python per tensor: its session opened and run through ONNX Runtime's C API by the
fused kernels' library (``runtime/native_run.cc``), one torch operator call a run.

The one-call run (``runtime/one_call.py``) still paid Python for each tensor: an ``OrtValueVector`` filled from
lists of addresses, dtypes and shapes, and a DLPack capsule and a torch tensor per output. Here
``torch.ops.aot2onnx_native.run`` takes the list of tensors, wraps each in an OrtValue on its own memory, runs the
session and returns each output as a tensor on ONNX Runtime's memory, which the tensor keeps alive. A graph of 45
inputs and 45 outputs (a Neg each, one thread, 2026-11-28): 87 us a call through the one-call run, 58 us here;
bert-s's calls about 40 us less each.

A native session is the twin of the Python session a graph runs on: the same model bytes, opened with the same
options (threads, optimization level, execution mode, deterministic compute, config entries, disabled
optimizers, the fused kernels' ops), so ONNX Runtime plans the same graph and computes the same values;
:func:`recipe` reads them off the Python session's ``SessionOptions``. The graph keeps its Python sessions for
the thread trial's timed turns, for sessions with ONNX Runtime's profiler on, and for the binding path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import weakref
from collections.abc import Sequence
from typing import Any

import onnxruntime as ort
import torch

from aot2onnx.runtime import fused

__all__ = ["CONFIG_KEYS", "ENABLED", "NativeSession", "available", "recipe"]

logger = logging.getLogger(__name__)

# Graphs settled on a session run natively where they can; False keeps the Python one-call run (for measuring
# the one against the other, and for tests).
ENABLED = True

# Every session config entry aot2onnx sets (runtime/session.py's session_options): a native session copies
# those the Python session has. tests/test_native_run.py checks that the package sets no other.
CONFIG_KEYS = (
    "session.intra_op.allow_spinning",
    "session.inter_op.allow_spinning",
    "session.force_spinning_stop",
    "session.use_env_allocators",
)
_DISABLED_OPTIMIZERS = "optimization.disable_specified_optimizers"


@functools.cache
def _ops() -> Any:
    """The library's torch operators; None where the library is not built or has none."""
    path = fused.library()
    if path is None:
        return None
    try:
        # A registration hands the library ONNX Runtime's API (RegisterCustomOps), which its sessions use.
        ort.SessionOptions().register_custom_ops_library(path)
        register = ctypes.CDLL(path).aot2onnx_register_native_ops
        register.restype = ctypes.c_char_p
        error = register()
        if error is not None:
            raise RuntimeError(error.decode(errors="replace"))
        return torch.ops.aot2onnx_native
    except (OSError, RuntimeError, AttributeError) as e:
        logger.debug("aot2onnx: the fused kernels' library gives no native run: %s", e)
        return None


def available() -> bool:
    """Whether this process can run graphs natively: the fused kernels' library is built and loads."""
    return _ops() is not None


def recipe(so: ort.SessionOptions, disabled: Sequence[str]) -> dict[str, Any] | None:
    """What a native twin of a session made with ``so`` and ``disabled`` optimizers is opened with; None where
    there should be none: a session with ONNX Runtime's profiler on (its trace must hold every run), one that
    writes its optimized model.
    Only runtime/session.py's own sessions are twinned: a custom op library other than the fused kernels', for
    one, cannot be read back from ``so``."""
    if so.enable_profiling or so.optimized_model_filepath:
        return None
    config: list[str] = []
    for key in CONFIG_KEYS:
        try:
            value = so.get_session_config_entry(key)
        except RuntimeError:  # not set
            continue
        config += [key, value]
    if disabled:
        # Separated by ";": ONNX Runtime 1.32 reads "a,b" as one name and so disables neither (its header says
        # commas); tests/test_native_run.py checks two at once.
        config += [_DISABLED_OPTIMIZERS, ";".join(disabled)]
    return {
        "intra": so.intra_op_num_threads, "inter": so.inter_op_num_threads,
        "level": int(so.graph_optimization_level), "mode": int(so.execution_mode),
        "deterministic": bool(so.use_deterministic_compute), "mem_pattern": bool(so.enable_mem_pattern),
        "config": config,
    }


class NativeSession:
    """A session opened through the C API from ``model_bytes`` and a :func:`recipe`, run on tensors given in
    ``input_names``' order, returning ``output_names``' values."""

    def __init__(self, model_bytes: bytes, recipe: dict[str, Any], fused_kernels: bool, input_names: Sequence[str],
                 output_names: Sequence[str], optimized_path: str = "") -> None:
        ops = _ops()
        if ops is None:
            raise RuntimeError("the fused kernels' library is not available")
        if recipe["mem_pattern"]:
            raise RuntimeError("a native session runs without memory patterns, as aot2onnx's sessions do")
        model = torch.frombuffer(bytearray(model_bytes), dtype=torch.uint8)
        self.handle = ops.open(model, recipe["intra"], recipe["inter"], recipe["level"], recipe["mode"],
                               recipe["deterministic"], recipe["config"], fused_kernels, list(input_names),
                               list(output_names), optimized_path)
        self._run = ops.run.default
        weakref.finalize(self, ops.close, self.handle)

    def run(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The outputs, for ``tensors`` in the input names' order (contiguous CPU tensors)."""
        return self._run(self.handle, tensors)
