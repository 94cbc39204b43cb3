"""The decomposition table handed to AOTAutograd: the one answer to "which ops are decomposed", which the
``torch.compile`` backend, the training export and the coverage tables all use."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch

from aot2onnx.capture._torch_compat import decomposition_table as torch_decomposition_table
from aot2onnx.capture.fastpath import FASTPATH_DECOMPOSITIONS

__all__ = ["decomposition_table", "lowerable_names", "target_name"]

# Ops whose decompositions must not run inside AOTAutograd's trace. lift_fresh is how the tracer turns a
# constant tensor made during tracing (x[[1, 2]] builds one) into a fake tensor; decomposing it first
# hands the real constant to fake-tensor ops, which refuse it.
_NEVER_DECOMPOSED = frozenset({"aten::lift_fresh", "aten::lift"})

# Decomposed although a rule lowers them whole, because the whole lowering is wrong for training. torch_lib's
# nll_loss_forward returns a placeholder total_weight (the loss's element count, 1 for a mean), and
# nll_loss_backward divides by it: with the loss inside an exported training graph, every gradient came out
# N times too large (N the number of targets). PyTorch's decomposition computes the real total weight.
_DECOMPOSED_FOR_TRAINING = frozenset({"aten::nll_loss_forward"})


def target_name(target: Any) -> Any:
    """An FX node's target as names are compared: ``aten::add.Tensor`` for an overload, the target itself else."""
    return target.name() if isinstance(target, torch._ops.OpOverload) else target


class _Lowers(Protocol):
    def targets(self) -> Iterable[Any]: ...
    def supports(self, target: Any, opset: int) -> bool: ...


def lowerable_names(registry: _Lowers, opset: int) -> list[str]:
    """The ops ``registry`` lowers at ``opset``: what :func:`decomposition_table` takes. The backend keeps this
    list in its disk cache, so it is the registry's answer alone; the choices of this module (what is
    decomposed for training anyway) are applied by :func:`decomposition_table`, fresh in every process."""
    return sorted({str(target_name(t)) for t in registry.targets() if registry.supports(t, opset)})


def _transpose_as_permute(x: torch.Tensor, dim0: int, dim1: int) -> torch.Tensor:
    if x.dim() == 0:
        return torch.ops.aten.permute.default(x, [])
    perm = list(range(x.dim()))
    dim0, dim1 = dim0 % x.dim(), dim1 % x.dim()
    perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
    return torch.ops.aten.permute.default(x, perm)


def _mixed_norm_in_float32(op: torch._ops.OpOverload) -> Callable:
    """A normalization of a bfloat16 or float16 input with float32 weights or running statistics (what autocast
    leaves a LayerNorm after a Linear, a BatchNorm or GroupNorm after a Conv) as ATen's mixed-type CPU kernels
    compute it: in float32, the output rounded once to the input's dtype, the saved mean and rstd kept in
    float32 for the backward. ATen's meta functions declare those statistics in the input's dtype, so the op
    traced whole saved them rounded to bfloat16 for the backward (and ONNX's LayerNormalization, which takes
    one type, refused the mixed op). Traced as the same op on the input in float32, the graphs hold float32
    statistics and the backward reads them as eager's does. Other calls are traced as they are
    (NotImplemented)."""

    def decomposition(input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        others = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()]
        if input.dtype not in (torch.bfloat16, torch.float16) or all(t.dtype == input.dtype for t in others):
            return NotImplemented
        out, *rest = op(input.to(torch.float32), *args, **kwargs)
        return (out.to(input.dtype), *rest)

    return decomposition


def _factor_transposed_like_aten(op: torch._ops.OpOverload) -> Callable:
    """ATen's _linalg_det and _linalg_slogdet factor A^T, not A, when A is real and contiguous (LAPACK reads
    column-major), and return that LU; the backward, traced with the same test, solves with it as A^T's
    (linalg_lu_solve without adjoint). The lowering factors what it is given, so such a call is traced on
    the transposed view, whose LU is eager's; ``A.mT`` is not contiguous, so that call is traced as it is.
    Factoring A instead gave det's and slogdet's gradients A^-1 where eager's is A^-T."""

    def decomposition(A: torch.Tensor) -> Any:
        if A.is_complex() or A.shape[-1] <= 1 or not A.is_contiguous():
            return NotImplemented
        return op(A.mT)

    return decomposition


# Decomposed although they lower. aten.transpose.int -> permute: the min-cut partitioner knows permute as
# a view (its list of views has permute and t, not transpose), so with ``recompute_views`` it saves a
# transpose's input and transposes again in the backward graph, where ONNX Runtime folds the Transpose into
# the MatMul that reads it, rather than having the forward graph write a transposed copy as an output.
# Normalizations, only with a low-precision input beside float32 weights or statistics: see _mixed_norm_in_float32.
# Determinants of a contiguous real matrix, traced on its transpose: see _factor_transposed_like_aten.
_ALWAYS_DECOMPOSED: dict[torch._ops.OpOverload, Callable] = {
    torch.ops.aten.transpose.int: _transpose_as_permute,
    torch.ops.aten._linalg_det.default: _factor_transposed_like_aten(torch.ops.aten._linalg_det.default),
    torch.ops.aten._linalg_slogdet.default: _factor_transposed_like_aten(torch.ops.aten._linalg_slogdet.default),
    **{
        op: _mixed_norm_in_float32(op)
        for op in (
            torch.ops.aten.native_layer_norm.default,
            torch.ops.aten.native_group_norm.default,
            torch.ops.aten._native_batch_norm_legit_functional.default,
            torch.ops.aten._native_batch_norm_legit_no_training.default,
            torch.ops.aten._native_batch_norm_legit.default,
            torch.ops.aten._native_batch_norm_legit.no_stats,
            torch.ops.aten.native_batch_norm.default,
        )
    },
}


def _unless(keep: Callable[..., bool], decomposition: Callable) -> Callable:
    """``decomposition``, except for calls ``keep`` accepts, which stay whole (NotImplemented)."""

    def conditional(*args: Any, **kwargs: Any) -> Any:
        return NotImplemented if keep(*args, **kwargs) else decomposition(*args, **kwargs)

    return conditional


def decomposition_table(
    lowerable: Iterable[Any], kept_when: Mapping[torch._ops.OpOverload, Callable[..., bool]] | None = None
) -> dict[torch._ops.OpOverload, Callable]:
    """PyTorch's decompositions, minus those of ops that have a lowering rule (except the ops decomposed for
    training anyway, ``_DECOMPOSED_FOR_TRAINING``). An op of ``kept_when`` stays whole in the calls its
    predicate accepts (its arguments: fake tensors and Python values), and is decomposed in the others: how the
    compile backend keeps the ops of its fused kernels whole where the kernels take the call's dtypes.

    An op with a rule stays whole, because one ONNX op (LayerNormalization, Gelu, Conv) runs faster than
    its pieces. An op without one is decomposed, which is how most backward ops (``native_layer_norm_backward``,
    ``gelu_backward``, ``embedding_dense_backward``, ...) reach ops that lower. This is the same choice as
    PyTorch's ONNX exporter (``create_onnx_friendly_decomposition_table``), applied to AOTAutograd's joint
    graph rather than to an inference graph.
    """
    keep = {str(target_name(op)) for op in lowerable} - _DECOMPOSED_FOR_TRAINING
    table: dict[torch._ops.OpOverload, Callable] = dict(_ALWAYS_DECOMPOSED)
    for op, fn in itertools.chain(
        torch.export.default_decompositions().items(), torch_decomposition_table.items()
    ):
        if not isinstance(op, torch._ops.OpOverload) or op.name() in keep or op in table:
            continue
        if op.name() in _NEVER_DECOMPOSED:
            continue
        table[op] = _unless(kept_when[op], fn) if kept_when and op in kept_when else fn
    # The fused inference fast paths (nn.MultiheadAttention, TransformerEncoderLayer) always: see fastpath.py
    return {**table, **FASTPATH_DECOMPOSITIONS}
