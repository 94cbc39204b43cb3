"""Model code that Dynamo leaves to eager PyTorch before aot2onnx sees it, told once per process.

Three kinds of module that users often bring never reach a backend, whole, in torch 2.13's default
configuration. They still train, as eager PyTorch, and nothing of aot2onnx's is printed:

- ``nn.RNN``, ``nn.GRU``, ``nn.LSTM``: while ``torch._dynamo.config.allow_rnn`` is False (its default), Dynamo
  breaks the graph where the module is wrapped ("Attempted to wrap RNN, GRU, or LSTM", variables/builder.py).
- ``nn.BatchNorm*d(momentum=None)`` in training: torch.nn computes the cumulative average's factor as
  ``1.0 / float(self.num_batches_tracked)``, and Dynamo breaks the graph at that ``Tensor.item()``
  (pytorch/pytorch#194504). With ``capture_scalar_outputs=True`` it breaks one line later instead, in
  ``F.batch_norm``, which needs the momentum as a number.

The backend cannot see either: where the break leaves nothing to compile (``self.rnn(self.embed(x))`` breaks at
loading ``self.rnn``, before any op; a break inside the loop of ``nn.Sequential.forward`` gives up the whole
frame), Dynamo never calls it. Dynamo does expose its compile callbacks, run when it starts and ends compiling a
frame (``torch._dynamo.callback_handler``), and its records of why it broke graphs (``counters`` and
``graph_break_reasons`` in ``torch._dynamo.utils``). When a frame compiled for aot2onnx ends, the records added
since it started are checked for the two causes, and the first of each kind is a ``UserWarning``.

The callback's arguments do not say which backend the frame is compiled for: that is the backend of the
``ConvertFrameAssert`` running the compilation, found on the Python stack and unwrapped with Dynamo's own
``innermost_backend``. Frames compiled for other backends are not reported.

:func:`install` registers the callbacks when aot2onnx is imported (which ``torch.compile(backend="aot2onnx")``
does the first time), when :func:`aot2onnx.backend` makes a backend and whenever aot2onnx compiles a graph.
``torch._dynamo.reset()`` removes every callback: :func:`install` runs again right after it
(``after_dynamo_reset``), so a frame compiled after a reset is checked even if it never reaches the backend.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import re
import sys
import sysconfig
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from aot2onnx.capture._torch_compat import (
    GRAPH_BREAK_NOTES,
    CallbackArgs,
    CallbackTrigger,
    ConvertFrameAssert,
    after_dynamo_reset,
    callback_handler,
    counters,
    graph_break_reasons,
    innermost_backend,
)

logger = logging.getLogger("aot2onnx")

# Dynamo's private names: a torch that moves them turns these notes off (said in the log), never compiling.
_UNAVAILABLE: str | None = GRAPH_BREAK_NOTES

__all__ = ["install", "mark_backend"]

_MARK = "_aot2onnx_backend"
_RNN_BREAK = "Attempted to wrap RNN, GRU, or LSTM"  # the gb_type Dynamo records
_RNN_MODULE = re.compile(r"Developer debug context: (\w+)\(")  # the module's repr follows
_BATCHNORM_FILE = os.path.join("torch", "nn", "modules", "batchnorm.py")
_TRANSFORMER_FILE = os.path.join("torch", "nn", "modules", "transformer.py")
# the frame that compiles a frame, and knows for which backend
_CONVERT_FRAME = ConvertFrameAssert.__call__.__code__ if _UNAVAILABLE is None else None
# Not the user's code: torch, aot2onnx, and the standard library (not its site-packages, where it holds them).
_PACKAGES = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep

_RNN_WARNING = (
    "aot2onnx: torch.compile leaves {module} to eager PyTorch: it runs in PyTorch, not on ONNX Runtime, and so does "
    "whatever Dynamo could not compile around it. Dynamo does not trace nn.RNN, nn.GRU or nn.LSTM modules while "
    "torch._dynamo.config.allow_rnn is False (its default). To train them on ONNX Runtime, set "
    "`torch._dynamo.config.allow_rnn = True` before the compiled model first runs. (Said once per process.)"
)
_BATCHNORM_WARNING = (
    "aot2onnx: torch.compile leaves a BatchNorm with momentum=None (a cumulative moving average) to eager "
    "PyTorch: torch.nn computes the average's factor as 1.0 / float(self.num_batches_tracked), which Dynamo does "
    "not trace, so it breaks the graph there and the BatchNorm runs in PyTorch, not on ONNX Runtime "
    "(pytorch/pytorch#194504; torch._dynamo.config.capture_scalar_outputs = True does not help: the break moves "
    "to F.batch_norm, which needs the momentum as a number). It trains as in eager PyTorch. To run it on ONNX "
    "Runtime, give the BatchNorm a momentum (an exponential moving average). (Said once per process.)"
)
_CAUSAL_MASK_WARNING = (
    "aot2onnx: torch.compile leaves part of an nn.Transformer, nn.TransformerEncoder or nn.TransformerDecoder to "
    "eager PyTorch: given a mask but not whether it is causal, torch.nn compares the mask with a causal one and "
    "takes bool() of the result (_detect_is_causal_mask), which Dynamo does not trace, so it breaks the graph "
    "there and the module's layers after it run in PyTorch, not on ONNX Runtime. They train as in eager "
    "PyTorch. To run them on ONNX Runtime, pass the is_causal argument beside each mask (tgt_is_causal= and "
    "src_is_causal= for nn.Transformer and its decoder, is_causal= for the encoder): True if the mask is "
    "nn.Transformer.generate_square_subsequent_mask's, False otherwise. (Said once per process.)"
)


@dataclasses.dataclass(frozen=True)
class _Records:
    """How far Dynamo's graph-break records reached at one moment."""

    rnn: collections.Counter  # message -> times recorded, for RNN breaks
    reasons: int  # len(graph_break_reasons)

    @staticmethod
    def now() -> _Records:
        rnn: collections.Counter = collections.Counter()
        # A break Dynamo compiles around moves from "unimplemented" to "graph_break": the sum stays put.
        for category in ("unimplemented", "graph_break"):
            rnn.update({msg: n for msg, n in counters[category].items() if _RNN_BREAK in msg})
        return _Records(rnn, len(graph_break_reasons))


_installed: _Records | None = None  # when the callbacks were registered: the baseline of a compile they joined late
_started: _Records | None = None  # when the compile now in progress started
_KINDS = frozenset({"rnn", "batchnorm", "causal_mask"})  # each told once per process
_told: set[str] = set()

_F = TypeVar("_F", bound=Callable)


def mark_backend(fn: _F) -> _F:
    """Marks ``fn`` as an aot2onnx backend: frames compiled for it are checked."""
    setattr(fn, _MARK, True)
    return fn


def install() -> None:
    """Registers the callbacks with Dynamo, unless they are registered (``torch._dynamo.reset()`` removes them)."""
    global _installed, _started
    if _UNAVAILABLE is not None:
        logger.debug("aot2onnx: graph-break notes are off: this torch lacks %s", _UNAVAILABLE)
        return
    handler = callback_handler
    if _on_end in handler.end_callbacks:
        return
    _installed, _started = _Records.now(), None
    handler.register_start_callback(_on_start)
    handler.register_end_callback(_on_end)
    after_dynamo_reset(install)


def _on_start(args: CallbackArgs) -> None:
    global _started
    _started = _Records.now() if args.callback_trigger is CallbackTrigger.DYNAMO else None


def _on_end(args: CallbackArgs) -> None:
    global _started
    before, _started = _started or _installed, None
    if args.callback_trigger is not CallbackTrigger.DYNAMO or before is None or _told >= _KINDS:
        return
    if not _compiling_for_aot2onnx():
        return
    now = _Records.now()
    new_rnn = [msg for msg, n in now.rnn.items() if n > before.rnn.get(msg, 0)]
    if new_rnn and "rnn" not in _told:
        _told.add("rnn")
        found = _RNN_MODULE.search(new_rnn[0])
        module = f"the {found.group(1)} module" if found else "an RNN, GRU or LSTM module"
        warnings.warn(_RNN_WARNING.format(module=module), UserWarning, stacklevel=_user_stacklevel())
    # The list is cleared by torch._dynamo.reset(); shorter than before means all of it is new.
    reasons = (
        graph_break_reasons[before.reasons :] if len(graph_break_reasons) >= before.reasons else graph_break_reasons
    )
    if "batchnorm" not in _told and any(_in_cumulative_batchnorm(r.user_stack) for r in reasons):
        _told.add("batchnorm")
        warnings.warn(_BATCHNORM_WARNING, UserWarning, stacklevel=_user_stacklevel())
    if "causal_mask" not in _told and any(_in_causal_mask_detection(r.user_stack) for r in reasons):
        _told.add("causal_mask")
        warnings.warn(_CAUSAL_MASK_WARNING, UserWarning, stacklevel=_user_stacklevel())


def _in_cumulative_batchnorm(stack: list[Any]) -> bool:
    return any(f.filename.endswith(_BATCHNORM_FILE) and "num_batches_tracked" in (f.line or "") for f in stack)


def _in_causal_mask_detection(stack: list[Any]) -> bool:
    return any(f.filename.endswith(_TRANSFORMER_FILE) and f.name == "_detect_is_causal_mask" for f in stack)


def _compiling_for_aot2onnx() -> bool:
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not _CONVERT_FRAME:
        frame = frame.f_back
    if frame is None:
        return False
    backend = innermost_backend(frame.f_locals["self"])
    # torch.compile wraps a backend in a _TorchCompileWrapper, which holds it as compiler_fn.
    return bool(getattr(getattr(backend, "compiler_fn", backend), _MARK, False))


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning of the caller at the first frame outside torch, aot2onnx and the
    standard library: the user's line that called the compiled model, or the model's line Dynamo resumed at."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_code.co_filename
        stdlib = name.startswith(_STDLIB) and "-packages" not in name[len(_STDLIB) :]
        if not (name.startswith(_PACKAGES) or stdlib or name.startswith("<")):
            return level
        frame, level = frame.f_back, level + 1
    return 1
