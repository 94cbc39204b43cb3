"""Cross-runtime parity: where ONNX Runtime and eager PyTorch part, forward and backward, down to the node.

The public entry is :mod:`aot2onnx.parity`; ``python -m aot2onnx parity`` is :func:`aot2onnx.tools.parity.cli.main`.
"""

from __future__ import annotations

from aot2onnx.tools.parity.cli import main
from aot2onnx.tools.parity.compare import compare, compare_artifact
from aot2onnx.tools.parity.errors import NOISE_FACTOR, SLACK_ULPS, ErrorStats
from aot2onnx.tools.parity.nodes import GraphParity, NodeParity
from aot2onnx.tools.parity.report import ParityReport, TensorParity
from aot2onnx.tools.parity.repro import Reproducer

__all__ = [
    "NOISE_FACTOR",
    "SLACK_ULPS",
    "ErrorStats",
    "GraphParity",
    "NodeParity",
    "ParityReport",
    "Reproducer",
    "TensorParity",
    "compare",
    "compare_artifact",
    "main",
]
