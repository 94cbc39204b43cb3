"""aot2onnx: train PyTorch models on ONNX Runtime.

``torch.compile(model, backend="aot2onnx")`` captures the model with AOTAutograd, lowers its forward and
backward ATen graphs to ONNX and runs them on ONNX Runtime.
"""

from __future__ import annotations

from aot2onnx._version import __version__ as __version__
from aot2onnx.artifact import optim
from aot2onnx.artifact.loaded import load
from aot2onnx.compile.backend import aot2onnx_backend, backend
from aot2onnx.errors import (
    Aot2OnnxError,
    ArtifactError,
    CaptureError,
    LoweringError,
    RuntimeSessionError,
    UnsupportedOpError,
)
from aot2onnx.lower.registry import register_lowering, scoped_lowerings, unregister_lowering
from aot2onnx.options import Options
from aot2onnx.runtime.session import compiled_graphs, reset_compiled_graphs


def __getattr__(name: str):
    # The exporter needs the lowering's imports (onnxscript, torch's ONNX exporter), which a process that
    # only runs cached graphs never loads; it is imported on first use.
    if name == "export_training":
        from aot2onnx.artifact.export import export_training

        return export_training
    raise AttributeError(f"module 'aot2onnx' has no attribute {name!r}")


__all__ = [
    "Aot2OnnxError",
    "ArtifactError",
    "CaptureError",
    "LoweringError",
    "Options",
    "RuntimeSessionError",
    "UnsupportedOpError",
    "aot2onnx_backend",
    "backend",
    "compiled_graphs",
    "export_training",
    "load",
    "optim",
    "register_lowering",
    "reset_compiled_graphs",
    "scoped_lowerings",
    "unregister_lowering",
]
