"""The torch dtypes a compiled graph or an artifact may take or return, and their ONNX element types.

The one place this question is answered: the runtime binds tensors with it, the exporter declares the
optimizer's parameters with it, and the parity tool writes reproducers with it.
"""

from __future__ import annotations

import onnx
import torch

__all__ = ["ONNX_TO_TORCH", "TORCH_TO_ONNX"]

_PAIRS = (
    (torch.float32, onnx.TensorProto.FLOAT),
    (torch.float64, onnx.TensorProto.DOUBLE),
    (torch.float16, onnx.TensorProto.FLOAT16),
    (torch.bfloat16, onnx.TensorProto.BFLOAT16),
    (torch.int64, onnx.TensorProto.INT64),
    (torch.int32, onnx.TensorProto.INT32),
    (torch.int16, onnx.TensorProto.INT16),
    (torch.int8, onnx.TensorProto.INT8),
    (torch.uint8, onnx.TensorProto.UINT8),
    (torch.bool, onnx.TensorProto.BOOL),
)

TORCH_TO_ONNX: dict[torch.dtype, int] = dict(_PAIRS)
ONNX_TO_TORCH: dict[int, torch.dtype] = {onnx_type: dtype for dtype, onnx_type in _PAIRS}
assert len(TORCH_TO_ONNX) == len(ONNX_TO_TORCH) == len(_PAIRS), "a dtype or an element type is listed twice"
