"""Pointwise ops at the values where implementations part ways, against eager PyTorch: signed zeros, denormals,
infinities, NaN and the tails of sigmoid, tanh and log1p, forward and gradients, in float32 and float64.

Exact ops (selections, maximum and minimum, clamp, products by a constant, pow with the exponents ATen
computes with sqrt, rsqrt, reciprocal or products) must match bit for bit: the same NaNs and infinities, the
same finite values, the same sign of every zero. Transcendental ops must be within a few units in the last
place (ULPs) of eager, everywhere, the tails and denormals included.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import Ulps, check, ulp

import aot2onnx

NAN, INF = float("nan"), float("inf")
DTYPES = [torch.float32, torch.float64]
DENORMAL = {torch.float32: 1e-40, torch.float64: 1e-310}


def _check(fn, *inputs: torch.Tensor, dtype: torch.dtype, ulps: float = 0, grad: bool = True,
           grad_ulps: float | None = None, zero_sign: bool = True) -> None:
    """``fn`` eagerly and compiled (tests/harness.py): every output within ``ulps`` (0: equal), with
    ``zero_sign`` every zero with eager's sign; with ``grad`` the gradient of every input within ``grad_ulps``
    (default ``ulps``), values only: autograd itself does not keep the sign of a zero gradient."""
    check(fn, *inputs, dtype=dtype, grad=grad, tol=Ulps(ulps, zero_sign=zero_sign),
          grad_tol=Ulps(ulps if grad_ulps is None else grad_ulps))


# ---------------------------------------------------------------------------------------------------------
# Constants: 0.0 and -0.0 are different constants


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_and_negative_zero_constants_stay_apart(dtype):
    # The exporter's cache of Python scalars made into constants took -0.0 for 0.0 (equal, and equal hashes).
    x = torch.tensor([1.0, -2.0, 0.0, INF])
    _check(lambda x: (-0.0 * x, 0.0 * x, x * -0.0, x + 0.0, x + -0.0), x, dtype=dtype, grad=False)
    _check(lambda x: (0.0 * x, -0.0 * x), x, dtype=dtype, grad=False)


# ---------------------------------------------------------------------------------------------------------
# sigmoid and what is built on it: relative accuracy down the negative tail (ONNX Runtime's Sigmoid is
# accurate in absolute terms only: float32 sigmoid(-17) was 8.9e-8, eager 4.1e-8, and 0 below -18.5)

TAIL = [-7.0, -17.0, -18.5, -20.0, -36.7, -50.0, -87.0, -88.5, -89.0, -100.0, -700.0, -744.0, -746.0, -1000.0]
SPECIAL = [0.0, -0.0, 1.0, -1.0, 3.0, 17.0, 40.0, INF, -INF, NAN]


def _values(dtype: torch.dtype, *extra: list[float]) -> torch.Tensor:
    values = TAIL + SPECIAL + [DENORMAL[dtype], -DENORMAL[dtype]] + [v for e in extra for v in e]
    return torch.tensor(values, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_tail(dtype):
    _check(torch.sigmoid, _values(dtype), dtype=dtype, ulps=4, grad_ulps=8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_tail(dtype):
    _check(F.silu, _values(dtype), dtype=dtype, ulps=4, grad_ulps=8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_glu_tail(dtype):
    b = _values(dtype)
    a = torch.linspace(-3.0, 3.0, b.numel(), dtype=dtype)
    _check(lambda x: F.glu(x, 0), torch.stack([a, b]), dtype=dtype, ulps=4, grad_ulps=8)


# ---------------------------------------------------------------------------------------------------------
# log1p of small x (log(1 + x) drops x's digits below 1's last place: log1p(1e-8) was 0 in float32)

SMALL = [1e-8, -1e-8, 2e-6, -1e-7, 1e-12, 1e-17, -3e-17, 1e-30, 0.014, 0.5, -0.5, -0.999, -1.0, -2.0, 1.0, 1e6,
         3e38]


@pytest.mark.parametrize("dtype", DTYPES)
def test_log1p_small_and_special(dtype):
    _check(torch.log1p, _values(dtype, SMALL), dtype=dtype, ulps=4, grad_ulps=4)


@pytest.mark.parametrize("fn", [torch.expm1, F.elu, F.celu, F.selu, lambda x: F.elu(x, 0.5), lambda x: F.celu(x, 2.5)],
                         ids=["expm1", "elu", "celu", "selu", "elu alpha 0.5", "celu alpha 2.5"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_expm1_and_the_elus_near_zero(fn, dtype):
    # exp(x) - 1 (ONNX Runtime's Elu, and torch_lib's expm1) loses x's digits near 0: float32 expm1(1e-6) was
    # 9.54e-7 and elu(-1e-8) 0; eager computes expm1. Also 88.5 (float32 exp's edge) and -0.0.
    x = _values(dtype, SMALL, [-1e-5, 1e-6, -3e-4, 88.5, -0.3, 0.3])
    _check(fn, x, dtype=dtype, ulps=4, grad=False)
    # Gradients away from two places where eager itself is not one function: NaN, which its elu backward's
    # vector loop sends down the negative side and its scalar loop the positive; and float32 expm1 at -17
    # and below, where eager's expm1 is -1.0 (1 ULP off) and its gradient, grad * (result + 1), 0.
    x = x[~torch.isnan(x) & ((x > -17) if dtype == torch.float32 else True)]
    _check(fn, x, dtype=dtype, ulps=4, grad_ulps=8)


@pytest.mark.parametrize("fn", [F.softplus, lambda x: F.softplus(x, beta=2.0, threshold=10.0), F.mish],
                         ids=["softplus", "softplus beta 2", "mish"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_softplus_and_mish_tails(fn, dtype):
    # ONNX Runtime's float64 Softplus and Mish are log(1 + exp(x)): softplus(-50) was 0 (eager 1.9e-22). The
    # float32 kernels are close to eager's but not within a few ULPs where the result is denormal.
    # (The gradients are torch's decompositions, some ULPs from eager's kernels: mish's up to 23 in float64, at
    # x = 17, where tanh(softplus(x)) is 1 less 3.4e-15.)
    values = [-20.0, -50.0, -1e-3, 5.0, 19.0, 25.0] if dtype == torch.float32 else _values(dtype, SMALL).tolist()
    _check(fn, torch.tensor(values + [0.0, -0.0, INF, -INF, NAN], dtype=dtype), dtype=dtype, ulps=4, grad_ulps=32)


C = 1.000001  # a scale float32 cannot hold: 5e-8 off there, 2e8 ULPs of float64


@pytest.mark.parametrize("fn", [
    lambda x, y: torch.pow(C, x), lambda x, y: torch.add(x, y, alpha=C), lambda x, y: torch.sub(x, y, alpha=C),
    lambda x, y: torch.rsub(x, y, alpha=C), lambda x, y: torch.add(x, 1 / 3, alpha=C),
    lambda x, y: F.leaky_relu(x - 1, C), lambda x, y: F.elu(x - 1, alpha=C), lambda x, y: F.celu(x - 1, alpha=C),
    lambda x, y: F.hardsigmoid(x.detach() * C), lambda x, y: F.softplus(x, beta=C, threshold=1.3000001),
    lambda x, y: F.rrelu(x - 1, C / 2, C, training=False), lambda x, y: F.threshold(x, C, 2.0000001),
    lambda x, y: torch.addmm(x.reshape(7, 1), x.reshape(7, 1), y.reshape(1, 7), beta=C, alpha=1 / 3),
    lambda x, y: torch.baddbmm(x.reshape(1, 7, 1), x.reshape(1, 7, 1), y.reshape(1, 1, 7), beta=C, alpha=1 / 3),
    lambda x, y: x + torch.linspace(0, C, 7, dtype=torch.float64),
    lambda x, y: torch.addcmul(x, x, y, value=C), lambda x, y: torch.lerp(x, y, C),
], ids=["pow scalar base", "add alpha", "sub alpha", "rsub alpha", "add scalar alpha", "leaky_relu", "elu",
        "celu", "hardsigmoid", "softplus", "rrelu eval", "threshold", "addmm", "baddbmm", "linspace", "addcmul",
        "lerp"])
def test_python_scalars_stay_float64(fn):
    # ONNX has no float64 scalars where torch_lib puts them: a Python number cast to a tensor's dtype was a
    # float32 constant first, and float attributes (LeakyRelu's alpha, Gemm's beta, HardSigmoid's) are float32.
    # eager uses the double; a rounding of the result's own (an FMA against a Mul and an Add) is all that may
    # differ. (hardsigmoid's gradient is left out: eager's float64 kernel multiplies by float32's 1/6.)
    x = torch.linspace(0.5, 2.0, 7, dtype=torch.float64)
    y = torch.linspace(1.5, 3.0, 7, dtype=torch.float64)
    _check(fn, x, y, dtype=torch.float64, ulps=4, grad_ulps=8)


@pytest.mark.parametrize("args", [(0.0, 1000.0, 0.1), (0.1, 0.8, 0.1), (-3.0, 3.0, 0.37), (1.5, -2.0, -0.25),
                                  (0.0, 1e-3, 1e-7), (0, 17, 3), (16777210, 16777230, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_arange_of_floats(args, dtype):
    # torch_lib's float arange was a float32 Range, which ONNX Runtime runs by adding the step to a running
    # value: float32 arange(0, 1000, 0.1) ended at 999.8029 (eager 999.9), and float64's was float32's. Now
    # start + step * i in double, as ATen's scalar loop; its vector loop adds i * step to a rounded base, so
    # elements may be an ULP of the bounds apart (more ULPs of an element near 0, after the cancellation).
    fn = lambda x: torch.arange(*args, dtype=dtype) + x
    eager, compiled = fn(torch.zeros((), dtype=dtype)), torch.compile(fn, backend="aot2onnx")(torch.zeros((), dtype=dtype))
    assert compiled.shape == eager.shape and compiled.dtype == eager.dtype
    bound = torch.tensor(float(max(abs(a) for a in args[:2])), dtype=dtype)
    tolerance = float(ulp(bound)) * 2
    torch.testing.assert_close(compiled, eager, rtol=0, atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_sigmoid_tail(dtype):
    # log_sigmoid decomposes to min(x, 0) - log1p(exp(-|x|)): the tail for positive x is log1p of tiny values.
    _check(F.logsigmoid, _values(dtype, [20.0, 50.0, 100.0, 800.0]), dtype=dtype, ulps=4, grad_ulps=8)


# ---------------------------------------------------------------------------------------------------------
# tanh of small and denormal x (float32 tanh(1e-40) was 9.99392e-41, 43 ULPs off)

TINY = [1e-40, -1e-40, 1e-45, 1e-38, 1e-37, -7e-37, 1e-30, 1e-20, 1e-10, 2.4e-4, -3e-4, 3.6e-4, 1e-3]


@pytest.mark.parametrize("dtype", DTYPES)
def test_tanh_small_and_denormal(dtype):
    _check(torch.tanh, _values(dtype, TINY), dtype=dtype, ulps=4, grad=False)
    # The gradient, g (1 - y^2), where y is the tanh above; away from |y| near 1, where 1 - y^2 cancels and
    # amplifies any last-place difference of y.
    small = torch.tensor(TINY + [DENORMAL[dtype], 0.0, -0.0, 0.5, -1.0], dtype=torch.float64).to(dtype)
    _check(torch.tanh, small, dtype=dtype, ulps=4, grad_ulps=8)


# ---------------------------------------------------------------------------------------------------------
# pow with the exponents ATen computes without pow: 0.5 sqrt, -0.5 1 / sqrt, -1 1 / x, 2 x * x, 3 x * x * x,
# -2 1 / (x * x) (pow(-inf, 0.5) was inf, sqrt(-inf) is NaN; pow(-0.0, -0.5) +inf, 1 / sqrt(-0.0) -inf;
# pow(1e20, -2) 1e-40, 1 / (1e20 * 1e20) 0)

BASES = [0.0, -0.0, 1.0, -1.0, 0.25, 7.0, -3.0, 2e-19, 3e-20, 1e13, 1e20, -1e20, 3e38, INF, -INF, NAN]


@pytest.mark.parametrize("exponent", [1.0, 0.5, -0.5, -1.0, 2.0, 3.0, -2.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pow_exponents_computed_without_pow(exponent, dtype):
    x = torch.tensor(BASES + [DENORMAL[dtype], -DENORMAL[dtype], 1e200, 1e-160], dtype=torch.float64).to(dtype)
    # Eager's vectorized sqrt is not correctly rounded (float32 1 ULP off on AVX2; float64 on AVX-512, where
    # torch.sqrt of 1e13 was 3162277.660168379 and math.sqrt 3162277.6601683795); ONNX Runtime's is.
    ulps = 2 if abs(exponent) == 0.5 else 0
    _check(lambda x: torch.pow(x, exponent), x, dtype=dtype, ulps=ulps, grad=False)
    _check(lambda x: torch.pow(x, exponent), torch.tensor([0.25, 7.0, 3.0, 1e-3]), dtype=dtype, ulps=ulps,
           grad_ulps=4)


# ---------------------------------------------------------------------------------------------------------
# Selections keep -0.0 (ONNX Runtime's Where returned +0.0 for a -0.0 taken from its first operand)

ZEROS = torch.tensor([-0.0, 0.0, -0.0, 2.0, -0.0, 0.0, NAN, -INF, -0.0, 1.0, 0.0, -0.0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_where_keeps_negative_zero(dtype):
    x = ZEROS
    y = torch.tensor([0.0, -0.0, -0.0, -0.0, 3.0, 0.0, 0.0, -0.0, INF, -0.0, -0.0, 5.0])
    _check(lambda x: torch.where(x == 0, x, 1.0), x, dtype=dtype)
    _check(lambda x: torch.where(x < 1, x, 10.0), x, dtype=dtype)
    _check(lambda x: torch.where(x == 0, -0.0, x), x, dtype=dtype)
    _check(lambda x: torch.where(x != 0, 0.0, x), x, dtype=dtype)
    _check(lambda x, y: torch.where(x.isnan() | (x < y), x, y), x, y, dtype=dtype)
    _check(lambda x, y: torch.where(1 / y < 0, x, y), x, y, dtype=dtype)  # where y has its sign bit set
    # broadcast: a [4, 1] condition, [4, 3] and [3] operands
    c = torch.tensor([[True], [False], [True], [False]])
    _check(lambda x, y: torch.where(c, x, y), x.reshape(4, 3), y[:3], dtype=dtype)


def _large(dtype: torch.dtype, special: bool) -> torch.Tensor:
    """64 x 512 random values (large enough for the arithmetic selection), the first row's head with signed
    zeros, and with ``special`` also NaN and infinities (which send it to its exact Where)."""
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(7), dtype=dtype)
    head = [-0.0, 0.0, -1.0, 2.0] + ([NAN, INF, -INF] if special else [])
    x[0, :len(head)] = torch.tensor(head, dtype=dtype)
    x[1, :len(head)] = -x[0, :len(head)]
    return x


@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan-inf"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_selections_of_a_constant_on_large_tensors(dtype, special):
    # On a large tensor a selection of a constant is arithmetic (pointwise.select): bitwise the Where's
    # answer, gradients of ReLU, hardtanh and masked_fill included, whose conditions are random here.
    y, x = _large(dtype, special), torch.randn(64, 512, generator=torch.Generator().manual_seed(8), dtype=dtype)
    x[0, :8] = torch.tensor([-1.0, 1.0, -1.0, 1.0, -1.0, -1.0, 1.0, 0.0], dtype=dtype)
    cases = {
        "relu": lambda y, x: torch.relu(x * y),
        "threshold_backward": lambda y, x: torch.ops.aten.threshold_backward(y, x, 0.0),
        "fill +0.0": lambda y, x: torch.where(x > 0.3, 0.0, y),
        "fill positive": lambda y, x: torch.where(x > 0.3, 2.5, y),
        "fill negative, kept where true": lambda y, x: torch.where(x > 0.3, y, -1.5),
        "masked_fill": lambda y, x: y.masked_fill(x < 0, 1e-3),
        # relu6's input finite: eager's own hardtanh_backward passes a gradient at NaN in its scalar loop and
        # not in its vector loop
        "relu6": lambda y, x: F.relu6(x * 4) * y,
        "broadcast condition": lambda y, x: torch.where(x[:, :1] > 0, 0.0, y),
        "zeros_like": lambda y, x: torch.where(x[:, :1] > 0, torch.zeros_like(y), y),
        "full_like": lambda y, x: torch.where(x > 0, y, torch.full_like(y, -2.0)),
    }
    # softmax itself is within some ULPs of eager's (exp and a sum of 512 round; its gradient cancels): the
    # forward only, where the rows that are all -inf are 0
    softmax = {"safe softmax": lambda y, x: torch.ops.aten._safe_softmax(torch.where(x[:, :1] > 1.5, -INF, y), -1)}
    for name, fn in [*cases.items(), *softmax.items()]:
        try:
            _check(fn, y, x, dtype=dtype, ulps=16 if name in softmax else 0, grad=name not in softmax)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.parametrize("fn", [
    lambda x, g: torch.ops.aten.threshold_backward(g, x, 0.0),
    lambda x, g: torch.where(x > 0, torch.zeros_like(g), g),  # torch_lib's zeros_like: Expand(CastLike(0))
    lambda x, g: torch.ops.aten._safe_softmax(x, -1),
], ids=["threshold_backward", "zeros_like", "_safe_softmax"])
def test_a_selection_of_a_constant_on_a_large_tensor_is_arithmetic(fn, request, tmp_path, monkeypatch):
    # The test above exercises the arithmetic path only if it is taken: no Where outside the If that guards
    # it (nor the Max of two Wheres that selects between two tensors). _safe_softmax's condition is one
    # value per row, broadcast: a single Where with the scalar 0, Where's branches being cheap on runs.
    import onnx

    monkeypatch.setenv("AOT2ONNX_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("AOT2ONNX_CACHE_DIR", str(tmp_path / "cache"))
    x = torch.randn(64, 512)
    # The standard lowering's path (exports, and CPU graphs without the fused kernels, which run ATen's
    # threshold_backward instead: test_fused_kernels.py).
    torch.compile(fn, backend=aot2onnx.backend(fused_kernels=False))(x, x + 1)
    (path,) = tmp_path.glob("*.onnx")
    ops = [n.op_type for n in onnx.load(path).graph.node]
    assert "Max" not in ops, ops
    if "_safe_softmax" in request.node.name:
        assert ops.count("Where") == 1 and "If" not in ops, ops
    else:
        assert "If" in ops and "Where" not in ops, ops


@pytest.mark.parametrize("dtype", DTYPES)
def test_hardswish_and_its_gradient(dtype):
    # pointwise.aten_hardswish_backward: bit for bit, the sign of every zero included, at and around -3 and 3.
    # Tensors of 7 elements run ATen's scalar loop, which passes the gradient at a NaN input (its vector loop
    # makes NaN there); the large tensor has no NaN input.
    def hardswish_backward(g, x):
        return torch.ops.aten.hardswish_backward(g, x)

    x = torch.tensor([-3.5, -3.0, -1.5, 3.0, NAN, -2.9999998, 2.9999998])
    for g in ([INF, -0.0, -2.0, -0.0, 5.0, NAN, -INF], [-0.0, INF, NAN, INF, -INF, -0.0, 0.0]):
        _check(hardswish_backward, torch.tensor(g), x, dtype=dtype, grad=False)
    big_x = torch.randn(64, 512, generator=torch.Generator().manual_seed(5)) * 3
    big_x[0, :8] = torch.tensor([-4.0, -3.0, -1.5, -1.5, 2.0, -5.0, 3.0, -0.0])
    _check(hardswish_backward, _large(dtype, special=True), big_x, dtype=dtype, grad=False)
    # The forward as ATen computes it (ONNX Runtime's HardSwish was 2% off at -2.9999969), and its gradient
    # through autograd, near -3 and 3 and at the specials.
    near = torch.linspace(-3.001, -2.999, 4001)
    specials = torch.tensor([NAN, INF, -INF, -0.0, 0.0, -3.0, 3.0, -5.0, 1e30, -1e30])
    _check(F.hardswish, torch.cat([big_x.reshape(-1), near, torch.linspace(2.999, 3.001, 4001), specials]),
           dtype=dtype, grad=False)
    _check(F.hardswish, torch.cat([big_x.reshape(-1), near]), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_fill_keeps_negative_zero(dtype):
    x = ZEROS
    _check(lambda x: x.masked_fill(x > 0, -0.0), x, dtype=dtype)
    _check(lambda x: x.masked_fill(x.isnan(), 0.0), x, dtype=dtype)
    _check(lambda x: x.masked_fill(x == 0, 4.0), x, dtype=dtype)
    _check(lambda x: x.masked_fill(x.isinf(), torch.tensor(-0.0, dtype=dtype)), x, dtype=dtype)
    # A condition that is Not(...) in ONNX, read by that Where alone (without gradients: no backward graph
    # reads it too): ONNX Runtime's NotWhereFusion swapped Where's operands back.
    _check(lambda x: x.masked_fill(x != x, -0.7), x, dtype=dtype, grad=False)
    _check(lambda x: torch.where(x != x, 1.0, x), x, dtype=dtype, grad=False)
    _check(lambda x: torch.where(~(x > 1), x, 2.0), x, dtype=dtype, grad=False)


@pytest.mark.parametrize("value", [0.1, 1e-310, 1 / 3, -1e300, 2.0**-1074])
def test_masked_fill_value_in_float64(value):
    # float64 masked_fill rounded its value to float32: 0.1 was 0.10000000149011612, 1e-310 was 0.
    x = torch.tensor([1.0, -1.0, 0.5, -0.0])
    _check(lambda x: x.masked_fill(x > 0, value), x, dtype=torch.float64)
    _check(lambda x: (torch.where(x > 0, x, value), torch.where(x > 0, value, x)), x, dtype=torch.float64)


def test_hardtanh_bounds_in_float64():
    # torch_lib's hardtanh (and its backward here) made the bounds float32 constants: float64 hardtanh(x, 0.1,
    # 0.3) clipped at 0.10000000149011612, and passed no gradient to x = 0.1000000001.
    x = torch.tensor([0.1000000001, 0.05, 0.1, 0.29999999999, 0.3, 0.3000000001, -0.0, 0.0, INF, -INF])
    _check(lambda x: F.hardtanh(x, 0.1, 0.3), x, dtype=torch.float64)
    _check(lambda x: F.hardtanh(x, -1 / 3, 1 / 3), x - 0.4, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------------------
# maximum, minimum and clamp on ties of 0.0 and -0.0 (ONNX Runtime's Max and Min returned either zero by
# the element's place in their vector loop). Eager's clamp with a scalar bound returns self on a tie;
# eager's maximum and minimum return self in their scalar loop (tensors under 16 float32 or 8 float64
# elements, and the tail of larger ones) and other in their vector loop, so only small tensors are compared
# with eager; aot2onnx returns self on a tie at every size.


@pytest.mark.parametrize("size", [4, 7, 17, 40])
@pytest.mark.parametrize("dtype", DTYPES)
def test_clamp_keeps_self_on_a_tie(size, dtype):
    x = torch.zeros(size)
    x[1::3] = -0.0
    x[2::5] = NAN
    x[3::7] = -INF
    _check(lambda x: (torch.clamp(x, min=-0.0), torch.clamp(x, max=0.0), torch.clamp(-x, min=0.0),
                      torch.clamp(-x, max=-0.0), torch.clamp(x, -0.0, 0.0), torch.clamp(x, min=0.5),
                      torch.clamp(x, max=-0.5)), x, dtype=dtype)
    # ONNX Runtime's ReluClipFusion dropped the Relu before a Clip with min -0.0: relu(-1) then clamp(min=-0.0)
    # gave -0.0, eager 0.0 (without gradients: the backward graph does not read the Relu's output then).
    _check(lambda x: torch.clamp(torch.relu(x - 1.0), min=-0.0), x, dtype=dtype, grad=False)
    _check(lambda x: torch.clamp(torch.relu(x - 1.0), -0.0, 0.5), x, dtype=dtype, grad=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_maximum_and_minimum_of_small_tensors(dtype):
    x = torch.tensor([0.0, -0.0, 0.0, NAN, 1.0, -INF])
    y = torch.tensor([-0.0, 0.0, 0.0, 1.0, NAN, -0.0])
    _check(lambda x: (torch.maximum(-x, x), torch.minimum(-x, x), torch.maximum(x, -x), torch.minimum(x, -x)),
           x, dtype=dtype, grad=False)
    _check(lambda x, y: (torch.maximum(x, y), torch.minimum(x, y), torch.clamp_min(x, y), torch.clamp_max(x, y),
                         torch.maximum(y, x), torch.minimum(y, x)), x, y, dtype=dtype, grad=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_maximum_and_minimum_return_self_on_a_tie_at_every_size(dtype):
    import aot2onnx  # noqa: F401  (registers the backend)

    x = torch.zeros(40, dtype=dtype)
    x[::3] = -0.0
    fn = torch.compile(lambda a, b: (torch.maximum(a, b), torch.minimum(a, b)), backend="aot2onnx")
    for a, b in ((x, -x), (-x, x)):
        for out in fn(a, b):
            assert torch.equal(torch.signbit(out), torch.signbit(a)), (a, out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_signbit(dtype):
    # torch_lib's signbit was x < 0: False for -0.0.
    x = torch.tensor([0.0, -0.0, 1.0, -1.0, INF, -INF, NAN, DENORMAL[dtype], -DENORMAL[dtype]], dtype=torch.float64)
    _check(torch.signbit, x.to(dtype), dtype=dtype, grad=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_adding_positive_zero_makes_negative_zero_positive(dtype):
    # ONNX Runtime's NoopElimination removed Add(x, 0.0), which is not a no-op at x = -0.0 (slow seed 10458):
    # the sessions turn it off (runtime/session.py, and the torch-free trainer).
    x = torch.tensor([0.0, -0.0, 1.0, -1.0, INF, NAN])
    _check(lambda x: (-x + 0.0) * 3.0, x.to(dtype), dtype=dtype, grad=False)
    _check(lambda x: (x + 0.0) * 3.0, -x.to(dtype), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_and_full_like_fill_in_their_dtype(dtype):
    # torch_lib made the fill a float32 constant and cast it: float64 full(0.3) was 0.30000001192092896.
    x = torch.tensor([0.0, -0.0, 1.0])
    _check(lambda x: (x + torch.full((3,), 0.3, dtype=x.dtype), torch.full_like(x, 1e-310) + x,
                      x * torch.full((3,), 1 / 3, dtype=x.dtype), torch.full((2,), 3), torch.full((2,), True)),
           x, dtype=dtype)


# ---------------------------------------------------------------------------------------------------------
# atan2 and angle: C's quadrants, signed zeros, infinities and NaN

_ATAN2_VALUES = [0.0, -0.0, 1.0, -1.0, 2.5, -3e-3, 1e-30, -1e-30, 1e30, -3e38, INF, -INF, NAN, 1e-40, -1e-45]


def test_atan2_at_signed_zeros_infinities_and_nan():
    """torch_lib's atan2 gave -pi for atan2(+0, -1) (2 pi off), 0 for atan2(nan, 1) and atan2(inf, inf), and
    lost the sign of -0.0 results. Every pair of the values above, and 4000 random pairs, within 4 ULPs (atan of
    the rounded ratio, reflected: eager's Sleef kernel is within 1), every
    zero with eager's sign; gradients where they are finite in eager (float32: ONNX Runtime has no float64 Atan,
    so float64 atan2 runs in PyTorch)."""
    pairs = torch.cartesian_prod(torch.arange(len(_ATAN2_VALUES)), torch.arange(len(_ATAN2_VALUES)))
    values = torch.tensor(_ATAN2_VALUES, dtype=torch.float64)
    y, x = values[pairs[:, 0]], values[pairs[:, 1]]
    _check(torch.atan2, y, x, dtype=torch.float32, ulps=4, grad=False)
    finite = (y.abs() < 1e20) & (x.abs() < 1e20) & ((y != 0) | (x != 0))
    _check(torch.atan2, y[finite], x[finite], dtype=torch.float32, ulps=4, grad_ulps=4)
    generator = torch.Generator().manual_seed(0)
    _check(torch.atan2, torch.randn(4000, generator=generator), torch.randn(4000, generator=generator),
           dtype=torch.float32, ulps=4, grad_ulps=4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_angle_of_reals(dtype):
    # torch_lib's angle gave 0 at NaN.
    x = torch.tensor([-2.0, -0.0, 0.0, 3.0, NAN, -INF, INF, -DENORMAL[dtype]], dtype=torch.float64)
    _check(torch.angle, x.to(dtype), dtype=dtype, grad=False)


# ---------------------------------------------------------------------------------------------------------
# Division with rounding, remainder, logaddexp, xlogy, copysign, trunc: ATen's formulas at the special values

# Pairs whose quotient overflows float32 are left out (denormal or tiny divisors: 1 % 1e-40, 1e30 % 1e-30):
# there eager's vector loop (fmod as a - trunc(a / b) * b) gives NaN where its scalar loop, and aot2onnx,
# give the exact fmod.
_GRID = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.5, -3e-3, 0.1, -0.3, 1e30, -1e30, 7.0, -7.0, 100.0, -104.0, INF, -INF,
         NAN]
_GRID_OPS = {
    "floor_divide": torch.floor_divide,
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "remainder": torch.remainder,
    "python_operators": lambda a, b: (a // b, a % b),
    "scalar_divisor": lambda a, b: (a // 0.1, a % 0.3, torch.div(a, -0.3, rounding_mode="trunc"), b),
    "logaddexp": torch.logaddexp,
    "logaddexp2": torch.logaddexp2,
    "xlogy": torch.xlogy,
    "copysign": torch.copysign,
    "trunc": lambda a, b: (torch.trunc(a), b),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(_GRID_OPS))
def test_binary_ops_at_special_values(name, dtype):
    """Every pair of the grid's values. Before these rules (torch_lib's): 1 // 0.1 was 10 (eager 9: the
    quotient of 1 - fmod(1, 0.1)), inf // 1 inf (eager NaN), remainder(0, inf) NaN (eager 0),
    logaddexp(0, 100) inf (eager 100), xlogy(0, nan) 0 (eager NaN), and trunc(-0.0), 0 // -1,
    copysign(0, -1) +0.0 (eager -0.0). Exact ops bit for bit; logaddexp and xlogy (a log) within 4 ULPs.
    logaddexp2 of two equal finite values is left out: the result cancels to about 0, where eager's
    log1p(1) / ln 2 rounds to 0.99999999 (logaddexp2(-1, -1) is -1e-8 in eager, 0 here)."""
    pairs = torch.cartesian_prod(torch.arange(len(_GRID)), torch.arange(len(_GRID)))
    if name == "logaddexp2":
        pairs = pairs[(pairs[:, 0] != pairs[:, 1]) | ~torch.isfinite(torch.tensor(_GRID)[pairs[:, 0]])]
    values = torch.tensor(_GRID, dtype=torch.float64)
    ulps = 4 if name.startswith("logaddexp") or name == "xlogy" else 0
    _check(_GRID_OPS[name], values[pairs[:, 0]], values[pairs[:, 1]], dtype=dtype, ulps=ulps, grad=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_floor_division_by_a_float_that_rounds_the_quotient_up(dtype):
    x = torch.tensor([1.0, 2.0, -1.0, 0.7, 3.0], dtype=dtype)
    compiled = torch.compile(lambda x: (x // 0.1, x % 0.1, torch.floor_divide(x, torch.full_like(x, 0.1))),
                             backend="aot2onnx")(x)
    assert compiled[0].tolist() == (x // 0.1).tolist() and compiled[0][0] == 9.0
    assert torch.equal(compiled[1], x % 0.1) and torch.equal(compiled[2], x // 0.1)


def test_logaddexp_of_large_values_and_its_gradient():
    """log(exp(a) + exp(b)) overflowed from 89 on in float32; ATen's max + log1p(exp(-|a - b|)) does not."""
    a = torch.tensor([0.0, 100.0, 1e30, -200.0, 88.0, 5.0])
    b = torch.tensor([100.0, 100.0, 1e30, -201.0, 89.0, -INF])
    for dtype in DTYPES:
        _check(torch.logaddexp, a, b, dtype=dtype, ulps=4, grad_ulps=8)
        _check(torch.logaddexp2, a, b, dtype=dtype, ulps=4, grad_ulps=8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lgamma_of_tiny_negative_values(dtype):
    # The reflection lost x against 1 (x - floor(x)): float32 lgamma(-1e-30) was inf, eager 69.08.
    x = torch.tensor([-1e-30, -1e-20, -1e-8, -0.25, -1.5, 1e-30, -DENORMAL[dtype]], dtype=torch.float64)
    _check(torch.lgamma, x.to(dtype), dtype=dtype, ulps=8, grad=False)


def test_float64_lgamma_of_subnormal_values():
    # pi * x lost the bits a subnormal x lacks: lgamma(5e-324) was 744.486, eager 744.440.
    x = torch.tensor([5e-324, -5e-324, 1e-323, 1e-320, -1e-318, 1e-315, 2.2e-308, 1e-9, -1e-9], dtype=torch.float64)
    _check(torch.lgamma, x, dtype=torch.float64, ulps=8, grad=False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_isinf_of_values_beyond_float32(dtype):
    # torch_lib cast to float32 first: float64 isinf(1e300) and isneginf(-1e300) were True.
    values = [1e300, -1e300, 3.5e38, -3.5e38, INF, -INF, NAN, 1.0, -0.0] if dtype.is_floating_point else [1, -5, 0]
    x = torch.tensor(values, dtype=torch.float64).to(dtype)
    for fn in (torch.isinf, torch.isposinf, torch.isneginf):
        torch._dynamo.reset()
        assert torch.equal(torch.compile(fn, backend="aot2onnx", fullgraph=True)(x), fn(x)), (fn.__name__, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zeta_where_aten_decides_without_summing(dtype):
    """zeta(x, q) in ATen's order of checks (zeta(0, 0) is NaN: x < 1 before q's pole), beside a q of -3e38,
    which asked for 2**20 summed terms for every element of the batch (a 441-pair scan was killed for memory)."""
    x = torch.tensor([0.0, 0.5, 1.0, 2.0, 2.0, 3.0, 2.5, 2.0, 4.0, NAN, 2.0], dtype=torch.float64)
    q = torch.tensor([0.0, 1.0, 1.0, -3e38, -2.0, -0.5, -0.5, 1.5, 0.25, 1.0, NAN], dtype=torch.float64)
    _check(torch.special.zeta, x.to(dtype), q.to(dtype), dtype=dtype, ulps=8, grad=False)


# ---------------------------------------------------------------------------------------------------------
# Integer division with a rounding mode: integer arithmetic, not float32


_INT_DIVISIONS = {
    "floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "operators": lambda a, b: (a // b, a % b),
    "scalar": lambda a, b: (torch.div(a, 3, rounding_mode="floor"), torch.div(a, -3, rounding_mode="trunc"), a // 7,
                            torch.div(a, 2.5, rounding_mode="floor"), b),
}


@pytest.mark.filterwarnings("error:aot2onnx")  # a node left to PyTorch would pass the comparison
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("name", list(_INT_DIVISIONS))
def test_integer_division_is_exact(name, dtype):
    """torch_lib divided integers in float32 for a rounding mode: div(2**25 + 1, 1, rounding_mode="floor") was
    2**25, and 123456789012 // 10 was 12345678848."""
    big = 123456789012 if dtype == torch.int64 else 2**31 - 5
    a = torch.tensor([2**25 + 1, -(2**25 + 1), 2**24 + 3, 7, -7, 0, big, -big], dtype=dtype)
    b = torch.tensor([1, 2, 3, -2, 2, 5, 10, 7], dtype=dtype)
    fn = _INT_DIVISIONS[name]
    expected, actual = fn(a, b), torch.compile(fn, backend="aot2onnx")(a, b)
    for e, c in zip(torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(actual)):
        assert c.dtype == e.dtype and torch.equal(c, e), (e.tolist(), c.tolist())


def test_integer_division_by_zero_raises():
    """Eager raises ZeroDivisionError; torch_lib's float32 path returned -2**63. ONNX Runtime's integer Div and
    Mod fail the run, which aot2onnx raises."""
    from aot2onnx.errors import RuntimeSessionError

    a, b = torch.tensor([7, 5]), torch.tensor([2, 0])
    for fn in (lambda a, b: torch.div(a, b, rounding_mode="trunc"), lambda a, b: torch.div(a, b, rounding_mode="floor"),
               lambda a, b: a % b):
        torch._dynamo.reset()
        with pytest.raises(RuntimeSessionError, match="Div|Mod"):
            torch.compile(fn, backend="aot2onnx")(a, b)


@pytest.mark.filterwarnings("error:aot2onnx")
@pytest.mark.parametrize("fn", [
    lambda x, i: x.clamp(1e-06, 50), lambda x, i: x.clamp(-1, 0.5), lambda x, i: i.clamp(0, 1.5) * x,
    lambda x, i: i.clamp(-1, 2.5) + x, lambda x, i: i.clamp(0, 2) + x,
], ids=["float-int", "int-float", "int-tensor-floats", "int-tensor-mixed", "int-tensor-ints"])
def test_clamp_with_mixed_bounds(fn):
    """A float and an int bound, or an integer tensor with a float bound, failed the compile in the exporter's
    type promotion pass (torch.optim.Rprop's step clamps with 1e-06 and 50)."""
    x, i = torch.linspace(-3.0, 3.0, 8), torch.tensor([1, -2, 3, 0, 5, -7, 2, 1])
    expected, actual = fn(x, i), torch.compile(fn, backend="aot2onnx")(x, i)
    assert actual.dtype == expected.dtype and torch.equal(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nextafter_at_infinities_zeros_and_the_smallest_subnormal(dtype):
    """nextafter(inf, 0) was NaN (eager: the largest finite number), nextafter(0.0, -0.0) +0.0 and
    nextafter(-2**-149, 0.0) +0.0 (eager: -0.0)."""
    tiny = float(torch.finfo(dtype).smallest_normal) * float(torch.finfo(dtype).eps)  # the smallest subnormal
    values = [0.0, -0.0, 1.0, -1.0, 0.5, tiny, -tiny, 1e30, INF, -INF, NAN]
    pairs = torch.cartesian_prod(torch.arange(len(values)), torch.arange(len(values)))
    grid = torch.tensor(values, dtype=torch.float64)
    _check(torch.nextafter, grid[pairs[:, 0]], grid[pairs[:, 1]], dtype=dtype, grad=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_log2_log10_sinc_erfc_heaviside_lgamma_of_exact_values(dtype):
    """torch_lib's constants were float32: float64 log2(0.5) was -0.9999999972521647, log10(100)
    1.9999999722264887, sinc(0.5) 2.8e-8 off; its erfc was 1 - erf(x) (float32 erfc(3) 1e-3 relatively off);
    its heaviside gave 1 at NaN (eager 0); lgamma(1) and lgamma(2) were 1e-15 instead of 0."""
    x = torch.tensor([0.5, 2.0, 8.0, 100.0, 1e-30, 3.0, 1024.0, 0.1], dtype=torch.float64)
    _check(torch.log2, x.to(dtype), dtype=dtype, ulps=2, grad=False)
    _check(torch.log10, x.to(dtype), dtype=dtype, ulps=2, grad=False)
    _check(torch.sinc, torch.tensor([0.5, -0.5, 2.5, 0.0, 1e-3, 0.25], dtype=dtype), dtype=dtype, ulps=4, grad=False)
    _check(torch.erfc, torch.tensor([2.5, 3.0, 5.0, 9.0, -1.0, 0.5, 0.0, 26.0], dtype=dtype), dtype=dtype, ulps=8,
           grad=False)
    # (the Lanczos series is within about 1e-15 absolutely: 16 ULPs at ln 2)
    _check(torch.lgamma, torch.tensor([1.0, 2.0, 3.0, 0.5], dtype=dtype), dtype=dtype, ulps=16, grad=False)
    values = torch.tensor([0.5, -0.0, 2.0, 0.0, 7.0], dtype=dtype)
    _check(torch.heaviside, torch.tensor([NAN, 0.0, -1.0, 0.0, INF], dtype=dtype), values, dtype=dtype, grad=False)


@pytest.mark.filterwarnings("error:aot2onnx")
def test_integer_inputs_of_float_valued_binary_ops():
    # atan2, xlogy and copysign of integer tensors give float32 results in ATen; the rules compute in float32.
    a, b = torch.tensor([3, -2, 0, 5]), torch.tensor([-1, 2, 0, 4])
    for fn in (torch.atan2, torch.xlogy, torch.copysign, torch.heaviside):
        torch._dynamo.reset()
        expected, actual = fn(a, b), torch.compile(fn, backend="aot2onnx")(a, b)
        assert actual.dtype == expected.dtype and torch.allclose(actual, expected, equal_nan=True), fn
