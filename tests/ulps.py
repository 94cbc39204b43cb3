"""Tolerances for float16 and bfloat16 stated in that dtype's units in the last place (ULPs), at the magnitude of
the value compared: one rounding to a 16-bit dtype is off by up to half an ULP, so a tolerance of N ULPs says how
many roundings (or ties tipped the other way) it allows, whatever the value's size. A fraction of a tensor's
largest value does not: it is one ULP at a largest value of 2.01 and two at 3.99, and eager's kernels differ
by one ULP between CPUs (bfloat16 convolutions on AVX2 and AVX-512).
"""

from __future__ import annotations

import torch

__all__ = ["assert_within_ulps", "ulp", "ulps_apart"]


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype``'s values in the binade of each ``|x|`` (float64): eps * 2**floor(log2|x|), and the
    subnormal spacing below the smallest normal. (The neighbour just below a power of two is half that apart.)"""
    info = torch.finfo(dtype)
    a = x.detach().double().abs()
    _, exponent = torch.frexp(a)  # a = m * 2**exponent, 0.5 <= m < 1
    spacing = info.eps * torch.exp2((exponent - 1).double())
    return torch.where(a < info.tiny, torch.full_like(a, info.eps * info.tiny), spacing)


def ulps_apart(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|actual - expected| in ULPs of ``dtype`` at each expected value's magnitude (float64)."""
    return (actual.detach().double() - expected.detach().double()).abs() / ulp(expected, dtype)


def assert_within_ulps(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, ulps: float, what: str) -> None:
    """Every element of ``actual`` within ``ulps`` of ``dtype``'s ULPs of ``expected``'s (both finite)."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert bool(torch.isfinite(actual).all() and torch.isfinite(expected).all()), what
    distance = ulps_apart(actual, expected, dtype)
    worst = int(distance.argmax())
    assert distance.max().item() <= ulps, (
        f"{what}: {int((distance > ulps).sum())} of {distance.numel()} elements more than {ulps} {dtype} ULPs "
        f"apart; worst {distance.flatten()[worst].item():.3g} ULPs: {actual.flatten()[worst].item()!r} against "
        f"{expected.flatten()[worst].item()!r}"
    )
