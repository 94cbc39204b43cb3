"""``python -m aot2onnx.tools.bench``, the same as ``python -m aot2onnx bench``."""

from __future__ import annotations

import sys

from aot2onnx.tools.bench import main

sys.exit(main())
