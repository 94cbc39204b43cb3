"""The comparison harness's tolerances (tests/harness.py) pass and fail where they say they do."""

from __future__ import annotations

import pytest
import torch
from harness import Exact, RelAbs, Ulps, ulp

NAN, INF = float("nan"), float("inf")


def _passes(tol, actual, expected) -> bool:
    try:
        tol.check("t", torch.tensor(actual), torch.tensor(expected))
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("tol", [Exact(), Ulps(4), RelAbs(rtol=1e-3)])
def test_nan_and_infinities_must_be_where_eager_has_them(tol):
    assert _passes(tol, [NAN, INF, -INF, 1.0], [NAN, INF, -INF, 1.0])
    assert not _passes(tol, [1.0], [NAN])
    assert not _passes(tol, [NAN], [1.0])
    assert not _passes(tol, [INF], [-INF])
    assert not _passes(tol, [3e38], [INF])
    assert not _passes(tol, [INF], [3e38])


def test_without_equal_nan_nan_fails_even_against_nan():
    assert not _passes(RelAbs(rtol=1.0, equal_nan=False), [NAN], [NAN])


def test_exact_is_bit_for_bit_and_keeps_the_sign_of_zero():
    assert not _passes(Exact(), [1.0 + 2**-23], [1.0])
    assert not _passes(Exact(), [0.0], [-0.0])
    assert _passes(Exact(zero_sign=False), [0.0], [-0.0])
    assert not _passes(Exact(zero_sign=False), [2**-149], [0.0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ulps_counts_eager_s_spacing(dtype):
    e = torch.tensor([1.0, 3.0, 1e-40 if dtype == torch.float32 else 1e-310, 0.0], dtype=dtype)
    spacing = torch.nextafter(e.abs(), torch.full_like(e, INF)) - e.abs()  # the next value up, less the value
    assert torch.equal(ulp(e), spacing.double())
    Ulps(2).check("t", e + 2 * spacing, e)
    with pytest.raises(AssertionError, match="4 of 4 elements differ"):
        Ulps(2).check("t", e + 3 * spacing, e)
    with pytest.raises(AssertionError):
        Ulps(0).check("t", e + spacing, e)


def test_ulps_of_another_dtype_and_shared_epsilons():
    e = torch.tensor([1.0, 100.0])
    Ulps(1, dtype=torch.bfloat16).check("t", e + torch.tensor([2**-7, 0.0]), e)
    with pytest.raises(AssertionError):
        Ulps(1, dtype=torch.bfloat16).check("t", e + torch.tensor([2**-6, 0.0]), e)
    # shared: epsilons of the largest finite value (100), for every element
    eps = torch.finfo(torch.float32).eps
    Ulps(0, shared=1).check("t", e + torch.tensor([100 * eps, 0.0]), e)
    with pytest.raises(AssertionError):
        Ulps(0, shared=1).check("t", e + torch.tensor([200 * eps, 0.0]), e)


def test_rel_abs_is_torch_isclose_and_assert_close():
    g = torch.Generator().manual_seed(0)
    e = torch.randn(1000, generator=g)
    a = e * (1 + 1e-4 * torch.randn(1000, generator=g)) + 1e-5 * torch.randn(1000, generator=g)
    for rtol, atol in ((1e-4, 1e-5), (1e-5, 0.0), (0.0, 1e-5)):
        expected_pass = bool(torch.isclose(a, e, rtol=rtol, atol=atol).all())
        assert _passes(RelAbs(rtol=rtol, atol=atol, equal_nan=False), a.tolist(), e.tolist()) == expected_pass
        try:
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol)
            assert expected_pass
        except AssertionError:
            assert not expected_pass


def test_integers_are_exact_and_dtypes_and_shapes_must_agree():
    with pytest.raises(AssertionError):
        RelAbs(rtol=1.0).check("t", torch.tensor([10001]), torch.tensor([10000]))
    with pytest.raises(AssertionError):
        Ulps(4).check("t", torch.zeros(2, dtype=torch.float64), torch.zeros(2))
    with pytest.raises(AssertionError):
        Ulps(4).check("t", torch.zeros(2, 1), torch.zeros(2))
