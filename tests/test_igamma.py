"""The regularized incomplete gamma functions (torch.special.gammainc and gammaincc, torch.igamma and igammac)
against eager, in float32 and float64: ATen's boundary values (NaN, 0, 1) exactly, and finite values in every
branch of calc_igamma and calc_igammac.

How close a finite value can be: ATen's formulas magnify a rounding of their terms. exp(a log(x) - x -
lgamma(a)) turns an ulp of its exponent's largest term into that many ulps of the result (an ulp of 360,
lgamma(100) in float32, is 2^8 ulps of the result), and the asymptotic series' log1p(s) - s cancels about
sqrt(a) ulps' worth. Where eager's libm and the lowering round a term apart (this machine's glibc 2.36 lgammaf
is up to 2 ulps off the correctly rounded value, its log1pf 1; ONNX Runtime's float64 Exp and Log 1), the
results part by that much. So a value must be within 8 ulps counted at the terms' size, 8 eps |eager| M
(``harness.incomplete_gamma_terms``), and at least 8 of its own ulps. Measured on
8192 samples per branch: at most 5.5 eps |eager| M; in the result's own ulps, medians of 0 or 1 (17 for float64
gammaincc with x > a, x > 1.1), maxima of 0 to 8129 (float32) and 44267 (float64), the largest where a is in
the thousands and M near 1e5. A float32 emulation of ATen's float instantiation with correctly rounded libm
calls agrees with the lowering to 3 ulps everywhere: the differences are libm's.
"""

from __future__ import annotations

import pytest
import torch
from harness import Ulps, incomplete_gamma_terms

import aot2onnx  # noqa: F401  (registers the backend)

NAN, INF = float("nan"), float("inf")
DTYPES = [torch.float32, torch.float64]
FUNCTIONS = {
    "gammainc": torch.special.gammainc,
    "gammaincc": torch.special.gammaincc,
}


def _compiled(fn):
    return torch.compile(fn, backend="aot2onnx", options={"cache": False, "fallback": False})


def _tolerance(a: torch.Tensor, x: torch.Tensor, expected: torch.Tensor) -> Ulps:
    return Ulps(ulps=8, at_least=incomplete_gamma_terms(a, x, expected))


def _check(name: str, a: torch.Tensor, x: torch.Tensor) -> None:
    fn = FUNCTIONS[name]
    expected, actual = fn(a, x), _compiled(fn)(a, x)
    _tolerance(a, x, expected).check(name, actual, expected, inputs=(a, x))


def _uniform(generator: torch.Generator, n: int, low: float, high: float) -> torch.Tensor:
    return low + (high - low) * torch.rand(n, generator=generator, dtype=torch.float64)


def _domain(name: str, n: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, x) in one of calc_igamma's and calc_igammac's branches."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    u = lambda low, high: _uniform(g, n, low, high)
    if name == "a < 1":
        return u(0.0, 1.0), u(0.0, 5.0)
    if name == "ordinary":
        return u(0.0, 10.0), u(0.0, 10.0)
    if name == "20 < a < 200, x near a":  # the asymptotic series
        a = u(20.0, 200.0)
        return a, a * u(0.7, 1.3)
    if name == "a > 200, x near a":  # the asymptotic series, its window 4.5 / sqrt(a)
        a = u(200.0, 1e4)
        return a, a * (1.0 + u(-2.25, 2.25) / a.sqrt())
    if name == "a > 200, x out of the window":  # the power series at up to hundreds of steps, the continued fraction
        a = u(200.0, 1e4)
        return a, a * (1.0 + torch.where(u(0, 1) < 0.5, -1.0, 1.0) * u(5.0, 20.0) / a.sqrt())
    if name == "x > a, x > 1.1":  # the continued fraction (igamma: 1 - igammac)
        a = u(0.0, 50.0)
        return a, a + 1.1 + u(0.0, 50.0)
    if name == "1 < x <= 1.1, x > a":  # igamma: 1 - igammac's small-x series
        return u(0.0, 1.0), u(1.0, 1.1)
    if name == "x <= 0.5":  # igammac: 1 - the power series or the small-x series, by -0.4 / log(x) < a
        return u(0.0, 3.0), u(0.0, 0.5)
    if name == "tiny x":
        return u(0.0, 5.0), u(0.0, 1e-6)
    if name == "huge x":
        return u(0.0, 50.0), u(1e3, 1e6)
    if name == "far":
        a = u(0.0, 300.0)
        return a, a * u(0.0, 3.0)
    raise ValueError(name)


DOMAINS = ["a < 1", "ordinary", "20 < a < 200, x near a", "a > 200, x near a", "a > 200, x out of the window",
           "x > a, x > 1.1", "1 < x <= 1.1, x > a", "x <= 0.5", "tiny x", "huge x", "far"]


def _all_domains(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [_domain(name, n) for name in DOMAINS]
    # The power series at about 350 steps in float64 (a = 1e5, x = 0.9 a): dozens of the Loop's iterations.
    pairs.append((torch.tensor([5e3, 9e3, 2e4, 1e5], dtype=torch.float64),
                  torch.tensor([4.5e3, 8.1e3, 1.8e4, 9e4], dtype=torch.float64)))
    return torch.cat([a for a, _ in pairs]), torch.cat([x for _, x in pairs])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_every_branch_against_eager(name, dtype):
    a, x = _all_domains(4096)  # one graph for all: each compilation takes seconds
    _check(name, a.to(dtype), x.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_boundary_values_are_atens(name, dtype):
    """ATen's checks in its order: x < 0 or a < 0 NaN, a == 0 (1 or 0 for x > 0, else NaN), x == 0, a infinite
    (NaN with x infinite), x infinite; NaN elsewhere gives NaN (gammainc(nan, inf) is 1, gammainc(inf, nan) 0)."""
    tiny = torch.finfo(dtype).tiny / 4  # subnormal
    values = [NAN, INF, -INF, 0.0, -0.0, -1.0, -1e-30, tiny, 1e-30, 0.5, 1.0, 25.0, 1e30]
    a = torch.tensor([v for v in values for _ in values], dtype=dtype)
    x = torch.tensor([w for _ in values for w in values], dtype=dtype)
    fn = FUNCTIONS[name]
    expected, actual = fn(a, x), _compiled(fn)(a, x)
    decided = (a < 0) | (x < 0) | (a == 0) | (x == 0) | a.isinf() | x.isinf() | a.isnan() | x.isnan()
    Ulps(ulps=0, zero_sign=True).check(f"{name} at ATen's boundaries", actual, expected, where=decided, inputs=(a, x))
    _tolerance(a, x, expected).check(name, actual, expected, inputs=(a, x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_16_bit_floats_compute_in_float(name, dtype):
    # ATen's calc_igamma<Half> and <BFloat16> call calc_igamma<float> and round the result once.
    a, x = _domain("ordinary", 2048)
    a, x = a.to(dtype), x.to(dtype)
    fn = FUNCTIONS[name]
    expected, actual = fn(a, x), _compiled(fn)(a, x)
    Ulps(ulps=1).check(name, actual, expected, inputs=(a, x))


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_broadcast_mixed_dtypes_and_empty_tensors(name):
    """Broadcasting, type promotion (a 0-d float64 operand does not promote a float32 tensor) and empty
    tensors, in one graph."""
    fn = FUNCTIONS[name]
    g = torch.Generator().manual_seed(0)
    a = _uniform(g, 12, 0.1, 10.0).reshape(3, 4, 1).float()
    x = _uniform(g, 5, 0.1, 10.0).float()
    cases = [(a, x), (a, torch.tensor(2.5, dtype=torch.float64)), (a[:0], x)]

    def all_cases(*tensors):
        return [fn(tensors[i], tensors[i + 1]) for i in range(0, len(tensors), 2)]

    flat = [t for case in cases for t in case]
    for (args, expected, actual) in zip(cases, all_cases(*flat), _compiled(all_cases)(*flat)):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, (args, actual, expected)
        _tolerance(*torch.broadcast_tensors(*args), expected).check(name, actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_with_respect_to_x(dtype):
    """derivatives.yaml: d igamma / dx = exp((a - 1) log(x) - x - lgamma(a)), igammac's its negative; AOTAutograd
    writes it with exp, log and lgamma, which the backward graph lowers like any other."""
    a, x = _domain("ordinary", 512)
    a, x = a.to(dtype) + 0.1, x.to(dtype) + 0.1

    def loss(a, x):
        return (3.0 * torch.special.gammainc(a, x) + torch.special.gammaincc(a, x) ** 2).sum()

    x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, actual = loss(a, x_eager), _compiled(loss)(a, x_compiled)
    expected.backward()
    actual.backward()
    eps = torch.finfo(dtype).eps
    terms = ((a - 1) * x.log()).abs() + x + torch.lgamma(a).abs()
    Ulps(ulps=8, at_least=x_eager.grad.double().abs() * eps * terms.double()).check(
        "d/dx", x_compiled.grad, x_eager.grad, inputs=(a, x))
    Ulps(ulps=8, shared=8 * terms.max().item()).check("loss", actual, expected)


def test_gradient_with_respect_to_a_is_not_implemented_as_in_eager():
    a, x = torch.rand(4) + 0.5, torch.rand(4)
    with pytest.raises(NotImplementedError, match="derivative for 'igamma: input' is not implemented"):
        torch.special.gammainc(a.clone().requires_grad_(), x).sum().backward()
    with pytest.raises(Exception, match="derivative for 'igamma: input' is not implemented"):
        _compiled(lambda a, x: torch.special.gammainc(a, x).sum())(a.clone().requires_grad_(), x).backward()
