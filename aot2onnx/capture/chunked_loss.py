"""``torch.nn.functional.linear_cross_entropy(reduction="none")`` keeps its promise in the backward too: the
[N, vocab] logits never exist at once.

The op's autograd formula (``torch/nn/modules/linear_cross_entropy.py``) recomputes the gradients by calling
the chunked accumulator in Python, which AOTAutograd traces into one unrolled block of ATen ops per chunk.
ONNX Runtime ran those blocks with every chunk's [B, vocab] values planned at once: 755 MiB of peak memory
against eager's 113 in the benchmark of issue 41. During aot2onnx's captures (:func:`backward_as_one_op`) that
call is :func:`none_backward` instead, an op of aot2onnx's that stays whole in the graph and that
``lower/ops/loss.py`` lowers as one ONNX Loop over the chunks, as it does the forward. Run eagerly (a fallback,
or outside a capture), the op is torch's accumulator itself.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

from aot2onnx.capture import _torch_compat

__all__ = ["NONE_BACKWARD", "backward_as_one_op"]

_module, _accumulator = _torch_compat.chunked_loss_accumulator()
NONE_BACKWARD: Any = None  # the op's overload, where this torch has the chunked loss

if _accumulator is not None:
    _signature = inspect.signature(_accumulator)

    def _none_backward(
        input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, linear_bias: torch.Tensor | None,
        weight: torch.Tensor | None, grad_output: torch.Tensor, ignore_index: int, batch_chunk_size: int,
        acc_policy: str, acc_dtype: torch.dtype, compute_input_grad: bool, compute_linear_weight_grad: bool,
        compute_linear_bias_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reduction="none" op's backward, as torch computes it: (a meaningless scalar, grad_input,
        grad_linear_weight, grad_linear_bias), a gradient not asked for empty."""
        results = _accumulator(input, linear_weight, target, linear_bias, weight, "none", ignore_index, 0.0,
                               batch_chunk_size, acc_policy, acc_dtype, compute_input_grad,
                               compute_linear_weight_grad, compute_linear_bias_grad, loss_grad_output=grad_output)
        operands = (input, linear_weight, linear_bias, weight, grad_output)
        return tuple(r.clone() if any(r is a for a in operands) else r for r in results)  # no alias of an input

    none_backward = torch.library.custom_op("aot2onnx::linear_cross_entropy_none_backward",
                                            mutates_args=())(_none_backward)
    none_backward.register_fake(_none_backward)  # torch's own loop, on fake tensors: the shapes and dtypes

    NONE_BACKWARD = torch.ops.aot2onnx.linear_cross_entropy_none_backward.default

    def _routed(*args: Any, **kwargs: Any) -> Any:
        """torch's accumulator, except for the reduction="none" backward without label smoothing, which is
        the op."""
        a = _signature.bind(*args, **kwargs).arguments
        if a.get("reduction") != "none" or a.get("loss_grad_output") is None or a.get("label_smoothing", 0.0) != 0.0:
            return _accumulator(*args, **kwargs)
        return none_backward(
            a["input"], a["linear_weight"], a["target"], a["linear_bias"], a["weight"], a["loss_grad_output"],
            int(a["ignore_index"]), int(a["batch_chunk_size"]), a["acc_policy"], a["acc_dtype"],
            bool(a["compute_input_grad"]), bool(a["compute_linear_weight_grad"]), bool(a["compute_linear_bias_grad"]))


@contextlib.contextmanager
def backward_as_one_op() -> Iterator[None]:
    """A block (a capture) in which the reduction="none" chunked loss's backward is one op (module docstring)."""
    if _accumulator is None:
        yield
        return
    with mock.patch.object(_module, _torch_compat.CHUNKED_LOSS[1], _routed):
        yield
