"""The decomposition table handed to AOTAutograd."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["decomposition_table"]

# Ops whose decompositions must not run inside AOTAutograd's trace. lift_fresh is how the tracer turns a
# constant tensor made during tracing (x[[1, 2]] builds one) into a fake tensor; decomposing it first
# hands the real constant to fake-tensor ops, which refuse it.
_NEVER_DECOMPOSED = frozenset({"aten::lift_fresh", "aten::lift"})


def _transpose_as_permute(x: torch.Tensor, dim0: int, dim1: int) -> torch.Tensor:
    if x.dim() == 0:
        return torch.ops.aten.permute.default(x, [])
    perm = list(range(x.dim()))
    dim0, dim1 = dim0 % x.dim(), dim1 % x.dim()
    perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
    return torch.ops.aten.permute.default(x, perm)


# Decomposed although they lower. aten.transpose.int -> permute: the min-cut partitioner knows permute as
# a view (its list of views has permute and t, not transpose), so with ``recompute_views`` it saves a
# transpose's input and transposes again in the backward graph, where ONNX Runtime folds the Transpose into
# the MatMul that reads it, rather than having the forward graph write a transposed copy as an output.
_ALWAYS_DECOMPOSED: dict[torch._ops.OpOverload, Callable] = {torch.ops.aten.transpose.int: _transpose_as_permute}


def decomposition_table(lowerable: Iterable[Any]) -> dict[torch._ops.OpOverload, Callable]:
    """PyTorch's decompositions, minus those of ops that have a lowering rule.

    An op with a rule stays whole, because one ONNX op (LayerNormalization, Gelu, Conv) runs faster than
    its pieces. An op without one is decomposed, which is how most backward ops (``native_layer_norm_backward``,
    ``gelu_backward``, ``embedding_dense_backward``, ...) reach ops that lower. This is the same choice as
    PyTorch's ONNX exporter (``create_onnx_friendly_decomposition_table``), applied to AOTAutograd's joint
    graph rather than to an inference graph.
    """
    keep = {op.name() if isinstance(op, torch._ops.OpOverload) else op for op in lowerable}
    table: dict[torch._ops.OpOverload, Callable] = dict(_ALWAYS_DECOMPOSED)
    for op, fn in itertools.chain(
        torch.export.default_decompositions().items(), torch._decomp.decomposition_table.items()
    ):
        if not isinstance(op, torch._ops.OpOverload) or op.name() in keep or op in table:
            continue
        if op.name() in _NEVER_DECOMPOSED:
            continue
        table[op] = fn
    return table
