"""``python -m aot2onnx <command>``: see :mod:`aot2onnx.tools.cli`."""

import sys

from aot2onnx.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
