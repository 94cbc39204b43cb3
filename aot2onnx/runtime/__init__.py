"""Runtime: ONNX models plus their signatures in, torch tensors out."""

from aot2onnx.runtime.session import OrtGraph, compiled_graphs, reset_compiled_graphs, session_options

__all__ = ["OrtGraph", "compiled_graphs", "reset_compiled_graphs", "session_options"]
