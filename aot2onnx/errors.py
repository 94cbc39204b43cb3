"""The error hierarchy: each class names the stage that failed."""

from __future__ import annotations

__all__ = [
    "Aot2OnnxError",
    "ArtifactError",
    "CaptureError",
    "LoweringError",
    "RuntimeSessionError",
    "UnsupportedOpError",
    "source_line",
    "user_source_line",
]


class Aot2OnnxError(RuntimeError):
    """Base class of every error aot2onnx raises on purpose."""


class CaptureError(Aot2OnnxError):
    """AOTAutograd could not capture the graph."""


class LoweringError(Aot2OnnxError):
    """An FX ATen graph could not be turned into an ONNX model."""


class UnsupportedOpError(LoweringError):
    """The graph holds ops that have no lowering; the message lists all of them."""


class RuntimeSessionError(Aot2OnnxError):
    """ONNX Runtime could not create or run a session for a lowered graph."""


class ArtifactError(Aot2OnnxError, ValueError):
    """An exported training artifact is missing, malformed or inconsistent.

    Also a ValueError, like ``aot2onnx.artifact.edge.ArtifactError``, which the torch-free trainer raises for the
    same problems (it cannot import this module without importing torch).
    """


def source_line(stack_trace: str | None) -> str | None:
    """The innermost frame of a stack trace as FX records it (``node.meta["stack_trace"]``, and the exporter's
    ``pkg.torch.onnx.stack_trace`` in an ONNX node), with its code: ``File "model.py", line 12, in forward:
    y = x @ w``; ``None`` where there is no frame. Every message that points at the user's code uses this."""
    lines = [line.strip() for line in (stack_trace or "").strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            return f"{lines[i]}: {code}" if code else lines[i]
    return None


def user_source_line(node: object) -> str:
    """The innermost user frame of an FX node's stack trace, e.g. ``model.py:12 in forward: y = x @ w``."""
    return source_line(getattr(node, "meta", {}).get("stack_trace")) or "(no source line recorded)"
