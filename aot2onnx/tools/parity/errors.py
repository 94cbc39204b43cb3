"""How far one tensor is from another: the error statistics every table of a parity report shows."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["NOISE_FACTOR", "ErrorStats", "SENTINEL", "SLACK_ULPS", "magnitude", "measure", "slack"]

# A node's own error (torch and ONNX Runtime on the same inputs): |onnx - torch| <= rtol * |torch| + slack, for
# each element; the user's atol does not apply (it is in the units of the model's outputs: a backward node's
# gradients of a mean loss are often far below it, and a backward rule 0.3% off hid under it).
# The slack is SLACK_ULPS float32 ulps (float64 ulps for float64) of the output's largest magnitude: 128 ulps,
# 1.5e-5 of it in float32. A GELU off by 1e-3 relative is 67 times past that at its largest element.
SLACK_ULPS = 128
# Where an element is beyond that, it may be small beside the values it was computed from (a sum whose terms
# cancel, a bias gradient that is only rounding noise), where two correct kernels differ by a few ulps of those
# values, not of the result. Then what rounding makes of the node on these inputs decides, the larger of:
# PyTorch's own rounding error (its kernel against the same kernel in float64) and the node's conditioning
# (how far its float64 result moves when every input element moves by one ulp: a correct kernel's rounding
# inside a sum or a matrix product is as an error of that size in its inputs; PyTorch's CPU batch norm sums in
# double, so its own error says nothing of a float32 sum's). The slack is NOISE_FACTOR times it. Over the
# default zoo's clean models, the largest own error was 2.5 times that scale (a bias gradient of rounding
# noise); a rule off by 1e-3 is beyond it unless the node is that noise.
NOISE_FACTOR = 16
# Values beyond this are sentinels, not magnitudes: an attention mask's finfo.min must not widen the
# tolerance of the add that applies it (the elements it lands on are covered by rtol, being that large).
SENTINEL = 2.0**64


@dataclasses.dataclass(frozen=True)
class ErrorStats:
    """The difference of a tensor from its reference, element by element.

    An element is beyond tolerance where ``|got - ref| > atol + rtol * |ref| + slack`` (``slack`` is 0 for
    outputs and gradients; see SLACK_ULPS for a node's own error), or where NaN or an infinity is on one side
    only. ``ratio`` is the largest ``|got - ref| / tolerance``: past 1 is beyond; ``worst_diff`` and
    ``worst_tolerance`` are that element's difference and tolerance.
    """

    numel: int
    max_abs: float
    max_rel: float  # over elements whose reference is not 0
    ratio: float
    beyond: float  # share of elements beyond tolerance
    nan_mismatch: int  # elements NaN on one side only
    inf_mismatch: int  # elements infinite on one side only, or infinite with opposite signs
    mismatch: str = ""  # a shape or dtype that differs, a value missing on one side: nothing else is compared
    worst_diff: float = 0.0  # |got - ref| of the element furthest beyond (or nearest to) its tolerance
    worst_tolerance: float = 0.0  # that element's tolerance

    @property
    def ok(self) -> bool:
        return not self.mismatch and self.beyond == 0

    def to_dict(self) -> dict[str, Any]:
        return {k: _json_float(v) if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}

    @staticmethod
    def missing(why: str) -> ErrorStats:
        return ErrorStats(0, math.inf, math.inf, math.inf, 1.0, 0, 0, why, math.inf, 0.0)

    def against_tolerance(self) -> str:
        """The worst element against its tolerance, saying which side of it: ``3.1e-06 <= 1.2e-05``."""
        if self.mismatch:
            return self.mismatch
        if self.nan_mismatch or self.inf_mismatch:
            return f"NaN/inf on one side only ({self.nan_mismatch + self.inf_mismatch} elements)"
        if self.numel == 0:
            return "empty"
        side = "<=" if self.ratio <= 1 else ">"
        return f"{_g(self.worst_diff)} {side} {_g(self.worst_tolerance)}"

    @staticmethod
    def combine(parts: Sequence[ErrorStats]) -> ErrorStats:
        """The statistics of several outputs of one node taken together (the worst of each)."""
        if len(parts) == 1:
            return parts[0]
        numel = sum(p.numel for p in parts)
        beyond = sum(p.beyond * p.numel for p in parts) / numel if numel else max((p.beyond for p in parts), default=0.0)
        worst = max(parts, key=lambda p: p.ratio, default=None)
        return ErrorStats(
            numel,
            max((p.max_abs for p in parts), default=0.0),
            max((p.max_rel for p in parts), default=0.0),
            max((p.ratio for p in parts), default=0.0),
            beyond,
            sum(p.nan_mismatch for p in parts),
            sum(p.inf_mismatch for p in parts),
            "; ".join(p.mismatch for p in parts if p.mismatch),
            worst.worst_diff if worst else 0.0,
            worst.worst_tolerance if worst else 0.0,
        )


def _g(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else repr(x)  # JSON has no inf or nan


def _eps(dtype: torch.dtype) -> float:
    # Low-precision values are computed in float32 and rounded once (eager autocast and aot2onnx alike).
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def magnitude(values: Sequence[Any]) -> float:
    """The largest finite magnitude below SENTINEL among the floating-point tensors of ``values``."""
    largest = 0.0
    for value in values:
        if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()) and value.numel():
            x = (torch.view_as_real(value) if value.is_complex() else value).detach().cpu()
            x = np.abs(x.to(torch.float32 if x.dtype == torch.bfloat16 else x.dtype).numpy())
            x = x[np.isfinite(x) & (x < SENTINEL)]
            if x.size:
                largest = max(largest, float(x.max()))
    return largest


def slack(dtype: torch.dtype, scale: float) -> float:
    """The widening of a node's own tolerance for a result of ``dtype`` among values as large as ``scale``."""
    return SLACK_ULPS * _eps(dtype) * scale


def measure(ref: Any, got: Any, *, rtol: float, atol: float, slack: float = 0.0) -> ErrorStats:
    """``got`` against ``ref``. With ``slack``, a low-precision result is also allowed one ulp of its own
    dtype per element (the rounding of a float32 result, which two kernels may do on either side)."""
    if not isinstance(ref, torch.Tensor) or not isinstance(got, torch.Tensor):
        if isinstance(ref, torch.Tensor) or isinstance(got, torch.Tensor):
            return ErrorStats.missing(f"{type(got).__name__} vs {type(ref).__name__}")
        same = ref == got
        return ErrorStats(1, 0.0 if same else math.inf, 0.0 if same else math.inf, 0.0 if same else math.inf,
                          0.0 if same else 1.0, 0, 0, "" if same else f"{got!r} vs {ref!r}")
    ref, got = ref.detach(), got.detach()
    if ref.shape != got.shape:
        return ErrorStats.missing(f"shape {list(got.shape)} vs {list(ref.shape)}")
    if ref.dtype != got.dtype:
        return ErrorStats.missing(f"dtype {_name(got.dtype)} vs {_name(ref.dtype)}")
    numel = ref.numel()
    if numel == 0:
        return ErrorStats(0, 0.0, 0.0, 0.0, 0.0, 0, 0)
    if ref.is_complex():
        ref, got = torch.view_as_real(ref), torch.view_as_real(got)
    ref, got = ref.cpu(), got.cpu()
    if not ref.is_floating_point():  # integers and booleans: equal or not
        if torch.equal(ref, got):
            return ErrorStats(numel, 0.0, 0.0, 0.0, 0.0, 0, 0)
        r, g = ref.to(torch.float64).numpy(), got.to(torch.float64).numpy()
        diff, count = np.abs(g - r), int((r != g).sum())
        rel = diff[r != 0] / np.abs(r[r != 0])
        return ErrorStats(numel, float(diff.max()), float(rel.max()) if rel.size else math.inf, math.inf,
                          count / numel, 0, 0, "", float(diff.max()), 0.0)
    low = ref.dtype in (torch.float16, torch.bfloat16)
    per_element_eps = torch.finfo(ref.dtype).eps if low and slack else 0.0
    # In numpy, one thread: a parity run measures hundreds of small tensors, where torch's parallel kernels
    # cost more in hand-offs than they save (10x on a loaded 2-core machine).
    r = ref.to(torch.float64).numpy()
    g = got.to(torch.float64).numpy()
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(g - r)
        tolerance = np.maximum(atol + slack + (rtol + per_element_eps) * np.abs(r), 1e-300)
        finite = np.isfinite(diff)
        nan_mismatch = inf_mismatch = 0
        if not finite.all():  # NaN or infinities somewhere: compared apart, the rest as usual
            nan_r, nan_g = np.isnan(r), np.isnan(g)
            nan_mismatch = int((nan_r ^ nan_g).sum())
            inf_mismatch = int((~nan_r & ~nan_g & ~(np.isfinite(r) & np.isfinite(g)) & (r != g)).sum())
            diff = np.where(finite, diff, 0.0)
        ratio_el = diff / tolerance
        worst = int(np.argmax(ratio_el))
        worst_diff, worst_tolerance = float(diff.flat[worst]), float(tolerance.flat[worst])
        beyond = int((ratio_el > 1).sum()) + nan_mismatch + inf_mismatch
        nonzero = (r != 0) & finite
        rel = diff[nonzero] / np.abs(r[nonzero])
    max_rel = float(rel.max()) if rel.size else (math.inf if float(diff.max()) > 0 else 0.0)
    ratio = math.inf if nan_mismatch or inf_mismatch else float(ratio_el.max())
    return ErrorStats(numel, float(diff.max()), max_rel, ratio, beyond / numel, nan_mismatch, inf_mismatch, "",
                      worst_diff, worst_tolerance)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
