"""``python -m aot2onnx.tools.bench``, the same as ``python -m aot2onnx bench``."""

from __future__ import annotations

import sys

from aot2onnx.tools.bench import main

if __name__ == "__main__":  # as aot2onnx/__main__.py: importing the module runs nothing
    sys.exit(main())
