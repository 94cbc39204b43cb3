"""Rules for ATen's FFT primitives (``_fft_r2c``, ``_fft_c2c``, ``_fft_c2r``), on ONNX's forward DFT.

Complex tensors are real [..., 2] pairs (``aot2onnx.signature``). ``normalization`` is ATen's fft_norm_mode:
0 none, 1 by 1/sqrt(n), 2 by 1/n, n the product of the transformed sizes (the signal's: the output's for c2r);
ATen (pocketfft) multiplies by that factor computed in the tensor's dtype (``compute_fct``), and so do these.

Only the forward DFT is used: an inverse transform is conj(DFT(conj(x))), unnormalized. ONNX Runtime's inverse
DFT divides by n itself, with a float32 factor (a float64 ifft came back 4e-8 off, relatively), which the
inverse would then have to multiply back. The DFT's axis is negative (from the pair axis), which opset 17's DFT
accepts for every axis of the tensor, the first included.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op

from aot2onnx.errors import LoweringError
from aot2onnx.lower.registry import project_rule

aten = torch.ops.aten

_NUMPY = {ir.DataType.FLOAT: np.float32, ir.DataType.DOUBLE: np.float64}


def _axes(dim: Sequence[int], rank: int) -> list[int]:
    """ATen's dims (of a tensor of ``rank`` axes) as DFT axes of its pairs, counted from the end."""
    return [d % rank - rank - 1 for d in dim]


def _conj(x: ir.Value) -> ir.Value:
    return op.Mul(x, op.CastLike(op.Constant(value_floats=[1.0, -1.0]), x))


def _normalized(x: ir.Value, sizes: list, normalization: int, parts: ir.DataType) -> ir.Value:
    """``x`` times ATen's factor for a signal of ``sizes`` (static) elements; ``parts``: x's dtype."""
    if normalization == 0:
        return x
    dtype = _NUMPY.get(parts)
    if dtype is None:
        raise LoweringError(f"no FFT lowering for {parts} tensors (float32 and float64 only, as ONNX Runtime's DFT)")
    if not all(isinstance(s, int) for s in sizes):
        raise LoweringError("an FFT over an axis of symbolic size: no lowering (its normalization needs the size)")
    n = dtype(math.prod(sizes))
    factor = dtype(1) / (np.sqrt(n) if normalization == 1 else n)  # compute_fct<T>, in T
    return op.Mul(x, op.Constant(value=ir.tensor(np.array(factor, dtype=dtype))))


def _dft(x: ir.Value, axes: list[int], onesided_last: bool = False) -> ir.Value:
    """Forward DFTs of ``x`` along ``axes``, the last of them first (one-sided there, if asked)."""
    for i, axis in enumerate(reversed(axes)):
        x = op.DFT(x, axis=axis, inverse=0, onesided=int(onesided_last and i == 0))
    return x


@project_rule(aten._fft_r2c.default, is_complex=True)
def aten__fft_r2c(self, dim: Sequence[int], normalization: int, onesided: bool):
    """_fft_r2c(Tensor self, int[] dim, int normalization, bool onesided) -> Tensor"""
    rank = len(self.shape)
    axes = _axes(dim, rank)
    transformed = _dft(op.Unsqueeze(self, axes=[-1]), axes, onesided_last=onesided)  # a real signal: [..., 1]
    return _normalized(transformed, [self.shape[d % rank] for d in dim], normalization, self.dtype)


@project_rule(aten._fft_c2c.default, is_complex=True)
def aten__fft_c2c(self, dim: Sequence[int], normalization: int, forward: bool):
    """_fft_c2c(Tensor self, SymInt[] dim, int normalization, bool forward) -> Tensor"""
    rank = len(self.shape) - 1
    axes = _axes(dim, rank)
    transformed = _dft(self, axes) if forward else _conj(_dft(_conj(self), axes))
    return _normalized(transformed, [self.shape[d % rank] for d in dim], normalization, self.dtype)


@project_rule(aten._fft_c2r.default, is_complex=True)
def aten__fft_c2r(self, dim: Sequence[int], normalization: int, last_dim_size: int):
    """_fft_c2r(Tensor self, int[] dim, int normalization, SymInt last_dim_size) -> Tensor"""
    # The inverse along the other axes, then along the last one the real signal of length n whose one-sided
    # spectrum the input holds: its full spectrum is X[k] for k <= n // 2 and conj(X[n - k]) above. The
    # result is the real part, so the imaginary parts of X[0] (and X[n / 2]), which make only imaginary terms,
    # are ignored, as pocketfft's c2r ignores them. With g = conj(X): out = Re(DFT(g extended)).
    rank = len(self.shape) - 1
    n = last_dim_size
    last = dim[-1] % rank
    half = self.shape[last]
    if not isinstance(n, int) or not isinstance(half, int):
        raise LoweringError("_fft_c2r with a symbolic signal size: no lowering")
    if half < n // 2 + 1:
        raise LoweringError(f"_fft_c2r of {half} frequencies into a signal of {n}: fewer than n // 2 + 1")
    axes = _axes(dim, rank)
    g = _dft(_conj(self), axes[:-1])
    axis = axes[-1]
    lower = op.Slice(g, [0], [n // 2 + 1], [axis])
    mirrored = op.Slice(g, [n - n // 2 - 1], [0], [axis], [-1])  # g[n - n//2 - 1], ..., g[1]
    full = op.Concat(lower, _conj(mirrored), axis=axis)
    real = op.Squeeze(op.Slice(_dft(full, [axis]), [0], [1], [-1]), axes=[-1])
    sizes = [n if d % rank == last else self.shape[d % rank] for d in dim]
    return _normalized(real, sizes, normalization, self.dtype)
