"""``python -m aot2onnx <command>``: coverage, export, bench, parity, kernels, ort-kernels.

Each command lives in its own module, imported only when run, with a ``main(argv) -> int`` entry point.
"""

from __future__ import annotations

import importlib
import sys

_COMMANDS = {
    "coverage": ("aot2onnx.tools.coverage", "regenerate opset_tables/ from the OpInfo sweep"),
    "export": ("aot2onnx.tools.export", "export forward/backward/optimizer ONNX models for on-device training"),
    "bench": ("aot2onnx.tools.bench", "time training steps: eager, inductor and aot2onnx side by side"),
    "parity": ("aot2onnx.tools.parity", "where ONNX Runtime and eager part in one training step, down to the node"),
    "kernels": ("aot2onnx.runtime.fused", "build aot2onnx's fused training kernels (make demo and make test do)"),
    "ort-kernels": ("aot2onnx.tools.ort_kernels",
                    "write opset_tables/ort_cuda_kernels.json from ONNX Runtime's docs/OperatorKernels.md"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        width = max(map(len, _COMMANDS))
        lines = [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in _COMMANDS.items()]
        print("usage: python -m aot2onnx {" + ",".join(_COMMANDS) + "} ...\n\ncommands:\n" + "\n".join(lines))
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(_COMMANDS[argv[0]][0])
    return module.main(argv[1:])

