"""Which calls of an op aot2onnx's fused kernels take (``runtime/fused_ops.cc``; lowered by
``lower/ops/fused_kernels.py``): the compile backend keeps those calls whole in the captured graphs and lets
AOTAutograd decompose the others, as without the kernels. Light on purpose: torch only, read at capture time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FUSED_WHEN"]

aten = torch.ops.aten

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _one_float_dtype(*tensors: Any) -> bool:
    dtypes = {t.dtype for t in tensors if isinstance(t, torch.Tensor)}
    return len(dtypes) == 1 and next(iter(dtypes)) in _FLOATS


def _elementwise(grad_output: Any, x: Any, *args: Any, **kwargs: Any) -> bool:
    return _one_float_dtype(grad_output, x)


def _softmax(grad_output: Any, output: Any, dim: int, input_dtype: torch.dtype) -> bool:
    return _one_float_dtype(grad_output, output) and input_dtype == grad_output.dtype


def _layer_norm(grad_out: Any, input: Any, normalized_shape: Any, mean: Any, rstd: Any, weight: Any, bias: Any,
                output_mask: Any) -> bool:
    return (
        isinstance(input, torch.Tensor) and input.dtype in (torch.float32, torch.float64)
        and _one_float_dtype(grad_out, input, mean, rstd, weight, bias)
        and not (weight is None and bias is not None)
        and all(isinstance(d, int) for d in normalized_shape)
    )


def _group_norm(grad_out: Any, input: Any, mean: Any, rstd: Any, weight: Any, N: Any, C: Any, HxW: Any, group: int,
                output_mask: Any) -> bool:
    return (
        isinstance(input, torch.Tensor) and input.dtype in (torch.float32, torch.float64)
        and _one_float_dtype(grad_out, input, mean, rstd, weight)
        and all(isinstance(v, int) for v in (N, C, HxW, group))
        and (weight is not None or not (output_mask[1] or output_mask[2]))
    )


def _safe_softmax(self: Any, dim: int, dtype: Any = None) -> bool:
    return (_one_float_dtype(self) and self.dim() > 0 and (dtype is None or dtype == self.dtype)
            and isinstance(dim, int))


def _embedding(grad_output: Any, indices: Any, num_weights: Any, padding_idx: Any, scale_grad_by_freq: Any) -> bool:
    # ATen's CPU kernel returns [num_weights, grad_output.size(-1)]: one embedding dimension after the indices'.
    return (
        isinstance(grad_output, torch.Tensor) and grad_output.dtype in _FLOATS
        and isinstance(indices, torch.Tensor) and indices.dtype in (torch.int64, torch.int32)
        and grad_output.dim() == indices.dim() + 1
        and all(isinstance(v, int) for v in (num_weights, padding_idx))
    )


# Per op: whether the fused kernel takes the call (its arguments as AOTAutograd traces them).
FUSED_WHEN: dict[torch._ops.OpOverload, Callable[..., bool]] = {
    aten.threshold_backward.default: _elementwise,
    aten.gelu_backward.default: _elementwise,
    aten.hardswish_backward.default: _elementwise,
    aten.silu_backward.default: _elementwise,
    aten.tanh_backward.default: _elementwise,
    aten.sigmoid_backward.default: _elementwise,
    aten.hardsigmoid_backward.default: _elementwise,
    aten._softmax_backward_data.default: _softmax,
    aten._log_softmax_backward_data.default: _softmax,
    aten.native_layer_norm_backward.default: _layer_norm,
    aten.native_group_norm_backward.default: _group_norm,
    aten.embedding_dense_backward.default: _embedding,
    aten._safe_softmax.default: _safe_softmax,
}
