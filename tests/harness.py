"""The comparison harness of the numerics tests: a function run eagerly and through
``torch.compile(backend="aot2onnx")`` on equal copies of its inputs, its outputs and gradients compared under a
tolerance object.

A tolerance says how close a compiled value must be to eager's, element by element:

- :class:`Exact`: equal values, bit for bit.
- :class:`Ulps`: within a number of units in the last place of eager's value (its dtype's spacing at that
  magnitude, or another dtype's: a float32 result held to bfloat16's rounding), plus, for sums across
  elements, a number of epsilons of the tensor's largest finite value.
- :class:`RelAbs`: ``|compiled - eager| <= atol + rtol * |eager|`` (``torch.isclose``, in the values' dtype).

Every tolerance also says where NaN and infinities must be: NaN where eager has NaN (with ``equal_nan``, the
default; without it, as ``torch.testing.assert_close`` by default, a NaN fails even against NaN), an infinity
where eager has the same one; and, with ``zero_sign``, a zero with eager's sign. Integer and bool values are
always compared exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "Exact",
    "Pair",
    "RelAbs",
    "Tolerance",
    "Ulps",
    "arange_cotangents",
    "assert_close",
    "assert_gradients",
    "assert_outputs",
    "assert_within_ulps",
    "check",
    "incomplete_gamma_terms",
    "leaves",
    "linspace_cotangents",
    "randn_cotangents",
    "run_both",
    "ulp",
    "ulps_apart",
]


# ---------------------------------------------------------------------------------------------------------
# Units in the last place


def ulp(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The spacing of ``dtype``'s values (default: ``x``'s) in the binade of each ``|x|``, as float64:
    eps * 2**floor(log2|x|), and the subnormal spacing below the smallest normal (at 0 too). (The neighbour just
    below a power of two is half that apart.)"""
    info = torch.finfo(dtype or x.dtype)
    a = x.detach().double().abs()
    _, exponent = torch.frexp(a)  # a = m * 2**exponent, 0.5 <= m < 1
    spacing = info.eps * torch.exp2((exponent - 1).double())
    return torch.where(a < info.tiny, torch.full_like(a, info.eps * info.tiny), spacing)


def ulps_apart(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|actual - expected| in ULPs of ``dtype`` at each expected value's magnitude (float64)."""
    return (actual.detach().double() - expected.detach().double()).abs() / ulp(expected, dtype)


# ---------------------------------------------------------------------------------------------------------
# Tolerances


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tolerance:
    """Where NaN, infinities and signed zeros must be; subclasses say how close finite values must be."""

    zero_sign: bool = False  # a zero must have eager's sign
    equal_nan: bool = True  # NaN against eager's NaN passes

    def finite_close(self, actual: torch.Tensor, expected: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        """Which elements are close enough, where ``finite`` (both values finite) holds."""
        raise NotImplementedError

    def check(self, name: str, actual: torch.Tensor, expected: torch.Tensor, *, where: torch.Tensor | None = None,
              inputs: Sequence[torch.Tensor] = ()) -> None:
        """Raises AssertionError naming ``name`` and the first elements that differ. ``where``: only these
        elements are compared. ``inputs``: tensors of ``expected``'s shape whose values at a differing element
        the message shows (an elementwise op's arguments)."""
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, (name, actual, expected)
        a, e = actual.detach(), expected.detach()
        if not e.is_floating_point():
            bad = a != e
        else:
            nan_a, nan_e = torch.isnan(a), torch.isnan(e)
            bad = nan_a != nan_e
            if not self.equal_nan:
                bad |= nan_a & nan_e
            finite = torch.isfinite(e) & torch.isfinite(a)
            bad |= ~nan_e & ~finite & (a != e)  # an infinity of the wrong sign, or a finite value for one
            bad |= finite & ~self.finite_close(a, e, finite)
            if self.zero_sign:
                bad |= (e == 0) & (a == 0) & (torch.signbit(a) != torch.signbit(e))
        if where is not None:
            bad &= where
        if bad.any():
            rows = []
            for i in bad.nonzero().tolist()[:8]:
                at = tuple(float(x[tuple(i)]) for x in inputs) if inputs else i
                rows.append(f"  at {at}: eager {e[tuple(i)].item()!r}, compiled {a[tuple(i)].item()!r}")
            raise AssertionError(f"{name}: {int(bad.sum())} of {e.numel()} elements differ under {self}\n"
                                 + "\n".join(rows))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Exact(Tolerance):
    """Equal values: bit for bit, with ``zero_sign`` (the default here) the sign of zero too."""

    zero_sign: bool = True

    def finite_close(self, actual: torch.Tensor, expected: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        return actual == expected


@dataclasses.dataclass(frozen=True)
class Ulps(Tolerance):
    """Within ``ulps`` of eager's value's spacing (in ``dtype``'s units; default: the values' own dtype), plus
    ``shared`` epsilons of the tensor's largest finite value (for sums across elements, rounded in an order of
    their own: gradients)."""

    ulps: float = 0
    shared: float = 0
    dtype: torch.dtype | None = None
    # per element, the least spacing an ULP counts (float64, ``expected``'s shape): for results whose terms are
    # larger than they are, rounded apart at the terms' size
    at_least: torch.Tensor | None = dataclasses.field(default=None, compare=False, repr=False)

    def finite_close(self, actual: torch.Tensor, expected: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        spacing = ulp(expected, self.dtype)
        if self.at_least is not None:
            spacing = torch.maximum(spacing, self.at_least)
        tolerance = self.ulps * spacing
        if self.shared:
            largest = float(expected[finite].abs().max()) if finite.any() else 0.0
            tolerance = tolerance + self.shared * torch.finfo(expected.dtype).eps * largest
        return (actual.double() - expected.double()).abs() <= tolerance


def incomplete_gamma_terms(a: torch.Tensor, x: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """For :class:`Ulps`' ``at_least``: the spacing at the size of the terms ATen's calc_igamma/calc_igammac round
    for (a, x), relative to ``expected`` (their result). exp(a log(x) - x - lgamma(a)) makes an ulp of its
    exponent's largest term (the terms' sum, M) that many ulps of the result relative to the result, and the
    asymptotic series' log1p(s) - s cancels about sqrt(a) ulps' worth (M = sqrt(a) there): eager's libm and the
    lowering's, each within an ulp or two of the correctly rounded terms, part the results by a few eps M."""
    a, x = a.detach().double(), x.detach().double()
    ratio = (x - a).abs() / a
    asymptotic = ((a > 20) & (a < 200) & (ratio < 0.3)) | ((a > 200) & (ratio < 4.5 / a.sqrt()))
    terms = torch.where(asymptotic, a.sqrt(), (a * x.log()).abs() + x + torch.lgamma(a).abs())
    terms = torch.where(torch.isfinite(terms), terms.clamp(min=1.0), 1.0)
    return expected.detach().double().abs() * torch.finfo(expected.dtype).eps * terms


@dataclasses.dataclass(frozen=True)
class RelAbs(Tolerance):
    """``|actual - expected| <= atol + rtol * |expected|``, as ``torch.isclose`` computes it (in the values'
    dtype). With ``equal_nan=False`` and no ``zero_sign``, this is ``torch.testing.assert_close(rtol=, atol=)``
    on a tensor."""

    rtol: float = 0.0
    atol: float = 0.0

    def finite_close(self, actual: torch.Tensor, expected: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        return torch.isclose(actual, expected, rtol=self.rtol, atol=self.atol)


def assert_close(name: str, actual: Any, expected: Any, tol: Tolerance) -> None:
    """Every tensor of ``actual`` (a tensor or a pytree of them) against ``expected``'s, under ``tol``."""
    outs_a, outs_e = leaves(actual), leaves(expected)
    assert len(outs_a) == len(outs_e), f"{name}: {len(outs_a)} tensors compiled, {len(outs_e)} eager"
    for i, (a, e) in enumerate(zip(outs_a, outs_e)):
        tol.check(name if len(outs_e) == 1 and isinstance(expected, torch.Tensor) else f"{name} {i}", a, e)


def assert_within_ulps(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, ulps: float, what: str) -> None:
    """Every element of ``actual`` within ``ulps`` of ``dtype``'s ULPs of ``expected``'s (both finite): for
    float16 and bfloat16 results stated in that dtype's units at the magnitude of the value compared. One
    rounding to a 16-bit dtype is off by up to half an ULP, so a tolerance of N ULPs says how many roundings (or
    ties tipped the other way) it allows, whatever the value's size; a fraction of a tensor's largest value does
    not (it is one ULP at a largest value of 2.01 and two at 3.99), and eager's kernels differ by one ULP
    between CPUs (bfloat16 convolutions on AVX2 and AVX-512)."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert bool(torch.isfinite(actual).all() and torch.isfinite(expected).all()), what
    distance = ulps_apart(actual, expected, dtype)
    worst = int(distance.argmax())
    assert distance.max().item() <= ulps, (
        f"{what}: {int((distance > ulps).sum())} of {distance.numel()} elements more than {ulps} {dtype} ULPs "
        f"apart; worst {distance.flatten()[worst].item():.3g} ULPs: {actual.flatten()[worst].item()!r} against "
        f"{expected.flatten()[worst].item()!r}"
    )


# ---------------------------------------------------------------------------------------------------------
# Eager against compiled


def leaves(out: Any) -> list[torch.Tensor]:
    return [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]


# Cotangents: the gradients of the outputs that backward passes start from, the same for eager and compiled.
Cotangents = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]


def linspace_cotangents(outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """-2 to 3, evenly: signed, and different at every element."""
    return [torch.linspace(-2.0, 3.0, o.numel(), dtype=o.dtype).reshape(o.shape) for o in outputs]


def arange_cotangents(outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """1, 2, 3, ...: exact in every float dtype, so exact ops keep exact gradients."""
    return [torch.arange(1, o.numel() + 1, dtype=o.dtype).reshape(o.shape) for o in outputs]


def randn_cotangents(outputs: Sequence[torch.Tensor], seed: int = 7) -> list[torch.Tensor]:
    """Normal samples from one generator seeded with ``seed``, output after output."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outputs]


@dataclasses.dataclass
class Pair:
    """One function run eagerly and compiled, on equal copies of its inputs."""

    eager_inputs: list[torch.Tensor]
    compiled_inputs: list[torch.Tensor]
    eager: Any  # the eager outputs
    compiled: Any


def run_both(fn: Callable, *inputs: torch.Tensor, dtype: torch.dtype | None = None, grad: bool = True,
             dynamic: bool | None = None, no_grad: bool = False) -> Pair:
    """``fn`` eagerly and through ``torch.compile(fn, backend="aot2onnx", dynamic=dynamic)`` on equal copies of
    ``inputs``: cast to ``dtype``, requiring gradients with ``grad``; or, without ``dtype``, cloned, with float
    inputs requiring gradients (with ``grad``). With ``no_grad``, both run under ``torch.no_grad()``."""

    def copies() -> list[torch.Tensor]:
        if dtype is not None:
            return [x.detach().to(dtype, copy=True).requires_grad_(grad) for x in inputs]
        return [x.detach().clone().requires_grad_(grad and x.is_floating_point()) for x in inputs]

    eager_in, compiled_in = copies(), copies()
    compiled_fn = torch.compile(fn, backend="aot2onnx", dynamic=dynamic)
    if no_grad:
        with torch.no_grad():
            return Pair(eager_in, compiled_in, fn(*eager_in), compiled_fn(*compiled_in))
    return Pair(eager_in, compiled_in, fn(*eager_in), compiled_fn(*compiled_in))


def assert_outputs(pair: Pair, tol: Tolerance, name: str = "output") -> None:
    """Every tensor output, ``name i`` in order, under ``tol``; any other output (a number, None) equal."""
    outs_e, outs_c = torch.utils._pytree.tree_leaves(pair.eager), torch.utils._pytree.tree_leaves(pair.compiled)
    assert len(outs_e) == len(outs_c), f"{len(outs_c)} outputs compiled, {len(outs_e)} eager"
    tensors = 0
    for c, e in zip(outs_c, outs_e):
        if isinstance(e, torch.Tensor):
            assert isinstance(c, torch.Tensor), f"{name} {tensors}: compiled {c!r}, eager a tensor"
            tol.check(f"{name} {tensors}", c, e)
            tensors += 1
        else:
            assert c == e, f"{name}: compiled {c!r}, eager {e!r}"


def assert_gradients(pair: Pair, tol: Tolerance | Callable[[torch.Tensor], Tolerance], *,
                     cotangents: Cotangents = linspace_cotangents, unused_may_be_zero: bool = True,
                     name: str = "gradient") -> None:
    """The gradient of every input that requires one, from every output that requires one under the same
    ``cotangents``, under ``tol`` (or the tolerance ``tol(eager's gradient)`` gives). Where eager's input gets
    no gradient (unused), the compiled one gets none, or with ``unused_may_be_zero`` one of zeros."""
    pairs = [(c, e) for c, e in zip(leaves(pair.compiled), leaves(pair.eager)) if e.requires_grad]
    wrt = [i for i, x in enumerate(pair.eager_inputs) if x.requires_grad]
    if not pairs or not wrt:  # nothing to differentiate: integer inputs, or outputs that do not depend on them
        return
    start = cotangents([e for _, e in pairs])
    grads_e = torch.autograd.grad([e for _, e in pairs], [pair.eager_inputs[i] for i in wrt], start, allow_unused=True)
    grads_c = torch.autograd.grad([c for c, _ in pairs], [pair.compiled_inputs[i] for i in wrt], start,
                                  allow_unused=True)
    for i, c, e in zip(wrt, grads_c, grads_e):
        if e is None:
            assert c is None or (unused_may_be_zero and not c.any()), f"{name} {i}: eager has none"
            continue
        assert c is not None, f"{name} {i}: compiled has none"
        (tol if isinstance(tol, Tolerance) else tol(e)).check(f"{name} {i}", c, e)


def check(fn: Callable, *inputs: torch.Tensor, tol: Tolerance,
          grad_tol: Tolerance | Callable[[torch.Tensor], Tolerance] | None = None,
          dtype: torch.dtype | None = None, grad: bool = True, dynamic: bool | None = None,
          cotangents: Cotangents = linspace_cotangents, unused_may_be_zero: bool = True) -> Pair:
    """:func:`run_both`, then every output under ``tol`` and, with ``grad``, every input's gradient under
    ``grad_tol`` (default ``tol``)."""
    pair = run_both(fn, *inputs, dtype=dtype, grad=grad, dynamic=dynamic)
    assert_outputs(pair, tol)
    if grad:
        assert_gradients(pair, tol if grad_tol is None else grad_tol, cotangents=cotangents,
                         unused_may_be_zero=unused_may_be_zero)
    return pair
