"""The error hierarchy: each class names the stage that failed."""

from __future__ import annotations

__all__ = [
    "Aot2OnnxError",
    "ArtifactError",
    "CaptureError",
    "LoweringError",
    "RuntimeSessionError",
    "UnsupportedOpError",
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
