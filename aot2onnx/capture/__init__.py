"""Capture: PyTorch's AOTAutograd turns a Dynamo graph into functional forward/backward ATen graphs.

Nothing here knows about ONNX; the graph compiler passed in decides what happens to each graph.
"""

from aot2onnx.capture.aot import GraphKind, capture
from aot2onnx.capture.decompositions import decomposition_table, lowerable_names, target_name

__all__ = ["GraphKind", "capture", "decomposition_table", "lowerable_names", "target_name"]
