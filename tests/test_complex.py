"""Complex tensors on ONNX Runtime: the FFT family forward and backward, complex values at graph boundaries and
between fallback partitions, and a spectral-convolution model that trains fully on ONNX Runtime, against eager.

A lowered graph carries a complex tensor as a real one with a trailing axis of 2 (``aot2onnx.signature``).
FFTs are not bit-exact against pocketfft (ONNX Runtime's DFT sums in another order): results and gradients are
compared with a tolerance relative to the largest magnitude of eager's result, ``_RELATIVE`` (measured: 1.4e-6
in float32 and 1.5e-15 in float64 over these cases).
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.fx

import aot2onnx
from aot2onnx.compile.cache import _signature_from_json, _signature_to_json
from aot2onnx.compile.fallback import fallback_graphs, reset_fallback_graphs
from aot2onnx.errors import CaptureError
from aot2onnx.lower.dispatch import dispatch
from aot2onnx.lower.registry import default_registry
from aot2onnx.runtime.session import compiled_graphs, reset_compiled_graphs

aten = torch.ops.aten

# The largest error allowed, relative to the largest magnitude of eager's value (README: exactness).
_RELATIVE = {torch.float32: 1e-5, torch.complex64: 1e-5, torch.float64: 1e-13, torch.complex128: 1e-13}


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), what
    if expected.numel() == 0:
        return
    scale = max(expected.abs().max().item(), 1e-30)
    error = (actual - expected).abs().max().item()
    assert error <= _RELATIVE[expected.dtype] * scale, f"{what}: off by {error:.3g}, {error / scale:.3g} of the largest"


def _compiled(fn, **options):
    torch._dynamo.reset()  # each case its own compilation (not a recompilation of the last one)
    return torch.compile(fn, backend=aot2onnx.backend(fallback=False, cache=False, **options), fullgraph=True)


def _check(fn, *inputs: torch.Tensor) -> None:
    """fn's outputs (a tensor or a tuple of them) and its gradients for random cotangents, compiled with
    fallback=False, against eager. Each output is compared on its own scale."""
    eager_in = [x.detach().clone().requires_grad_(x.is_floating_point() or x.is_complex()) for x in inputs]
    compiled_in = [x.detach().clone().requires_grad_(x.is_floating_point() or x.is_complex()) for x in inputs]
    reset_compiled_graphs()
    actual, expected = _compiled(fn)(*compiled_in), fn(*eager_in)
    if isinstance(expected, torch.Tensor):
        actual, expected = (actual,), (expected,)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        _close(a, e, f"output {i}")
    generator = torch.Generator().manual_seed(0)
    cotangents = [torch.randn(e.shape, dtype=e.dtype, generator=generator) for e in expected]
    grads_c = torch.autograd.grad(actual, compiled_in, cotangents)
    grads_e = torch.autograd.grad(expected, eager_in, cotangents)
    for i, (c, e) in enumerate(zip(grads_c, grads_e)):
        _close(c, e, f"gradient of input {i}")
    kinds = {g.kind for g in compiled_graphs() if g.runs}
    assert kinds == {"forward", "backward"}, kinds  # both ran on ONNX Runtime


_NORMS = ("backward", "forward", "ortho")  # one compilation checks the three: an output each


def _signal(dtype: torch.dtype, is_complex: bool, shape=(3, 6, 7)) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(shape, dtype=dtype, generator=generator)
    return torch.complex(x, torch.randn(shape, dtype=dtype, generator=generator)) if is_complex else x


# --------------------------------------------------------------------------------------------- the FFTs

_ONE_DIM = {"fft": True, "ifft": True, "rfft": False, "irfft": True, "hfft": True, "ihfft": False}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("n", [None, 5, 12, 4], ids=lambda n: f"n={n}")  # the odd length 7, odd, padded, trimmed
@pytest.mark.parametrize("name", sorted(_ONE_DIM))
def test_one_dimensional_fft_matches_eager(name, n, dtype):
    fn = getattr(torch.fft, name)
    _check(lambda x: tuple(fn(x, n=n, dim=1, norm=norm) for norm in _NORMS), _signal(dtype, _ONE_DIM[name]))


_N_DIM = {"fft2": True, "ifft2": True, "rfft2": False, "irfft2": True, "fftn": True, "ifftn": True,
          "rfftn": False, "irfftn": True, "hfft2": True, "ihfft2": False}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(("s", "dim"), [(None, (-2, -1)), ((4, 9), (0, 2)), ((6, 8), (2, 1))],
                         ids=["last-two", "first-and-last-resized", "reversed-dims"])
@pytest.mark.parametrize("name", sorted(_N_DIM))
def test_multi_dimensional_fft_matches_eager(name, s, dim, dtype):
    fn = getattr(torch.fft, name)
    _check(lambda x: tuple(fn(x, s=s, dim=dim, norm=norm) for norm in _NORMS), _signal(dtype, _N_DIM[name]))


def test_irfft_output_length_follows_n_and_ignores_the_edge_imaginary_parts():
    # irfft reads the imaginary parts of the zero and (for an even n) the Nyquist frequency as zero.
    x = _signal(torch.float64, True, (2, 5))
    for n in (8, 9):
        actual, expected = _compiled(lambda x, n=n: torch.fft.irfft(x, n=n))(x), torch.fft.irfft(x, n=n)
        assert actual.shape == (2, n)
        _close(actual, expected, f"irfft n={n}")


# ------------------------------------------------------------------------------------------ boundaries

@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_complex_inputs_and_outputs_cross_the_boundary(dtype):
    z = torch.randn(4, 6, dtype=dtype)
    w = torch.randn(6, 4, dtype=dtype).t()  # not contiguous
    fn = lambda z, w: z * w + z  # noqa: E731
    _check(fn, z, w)
    # A conjugate view has its conjugate bit set: resolved before ONNX Runtime reads it.
    conj = z.conj()
    assert conj.is_conj()
    _close(_compiled(fn)(conj, w), fn(conj, w), "conjugate input")


def test_gradients_flow_through_view_as_real_and_view_as_complex():
    z = torch.randn(5, 3, dtype=torch.complex64)
    _check(lambda z: torch.view_as_real(torch.fft.fft(z) * z).square().sum(-1), z)
    x = torch.randn(5, 3, 2)
    _check(lambda x: (torch.view_as_complex(x * 2) * torch.view_as_complex(x)).imag + torch.view_as_complex(x).real, x)


def test_complex_values_are_made_from_real_inputs():
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    _check(lambda a, b: torch.complex(a, b) * torch.complex(b, a), a, b)
    _check(lambda a: a.to(torch.complex64) * (a + 1), a)  # the cast, and a complex by real product
    _check(torch.polar, a.abs() + 0.1, b)  # its backward divides complex tensors


def test_a_real_operand_of_a_complex_op_is_promoted_as_eager_promotes_it():
    z = torch.complex(torch.tensor([1.0, -0.0, float("inf")]), torch.tensor([-0.0, 2.0, 1.0]))
    r = torch.tensor([2.0, 3.0, 0.5])
    for fn in (lambda z, r: z * r, lambda z, r: z + r, lambda z, r: z - r, lambda z, r: r - z):
        actual, expected = _compiled(fn)(z, r), fn(z, r)
        torch.testing.assert_close(torch.view_as_real(actual), torch.view_as_real(expected), rtol=0, atol=0,
                                   equal_nan=True)


def test_torch_libs_complex_rules_refuse_mixed_real_and_complex_operands():
    # torch_lib's complex rules read every float operand as [..., 2] pairs: a real one would be sliced along its
    # own last axis. dispatch refuses the node instead.
    graph = torch.fx.Graph()
    c, r = graph.placeholder("c"), graph.placeholder("r")
    c.meta["val"], r.meta["val"] = torch.zeros(2, 3, dtype=torch.complex64), torch.zeros(2, 3)
    node = graph.call_function(aten.cat.default, ([c, r],))
    node.meta["val"] = torch.zeros(4, 3, dtype=torch.complex64)
    rule, reason = dispatch(node, default_registry(), 18)
    assert rule is None and "mixes real and complex" in reason


def test_complex_values_cross_fallback_partitions():
    # exp has no complex lowering: it runs in PyTorch between two partitions that hand complex values over.
    fn = lambda x: torch.fft.irfft(torch.exp(torch.fft.rfft(x) * 0.1), n=8)  # noqa: E731
    x = torch.randn(3, 8)
    reset_fallback_graphs()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=aot2onnx.backend(fallback=True, cache=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        actual = compiled(x)
    _close(actual, fn(x), "output")
    graph = next(g for g in fallback_graphs())
    assert graph.fallen_back == {"aten.exp.default": 1} and len(graph.subgraphs) == 2


def test_the_cache_keeps_which_tensors_are_complex(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="aot2onnx")
    fn = lambda z: torch.fft.ifft(z) * 2  # noqa: E731
    z = torch.randn(4, 6, dtype=torch.complex64)
    results = []
    for _ in range(2):
        torch._dynamo.reset()
        results.append(torch.compile(fn, backend=aot2onnx.backend(cache_dir=str(tmp_path)))(z))
    assert "(cache hit" in caplog.text
    assert results[1].dtype == torch.complex64
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)
    graph = next(g for g in compiled_graphs() if g.signature.has_complex)
    assert _signature_from_json(_signature_to_json(graph.signature)) == graph.signature


# ---------------------------------------------------------------------------- a model with an FFT layer

class SpectralConv2d(torch.nn.Module):
    """An FNO layer: rfft2 -> the lowest modes times complex weights -> irfft2, beside a 1x1 convolution."""

    def __init__(self, channels: int = 3, modes: int = 4) -> None:
        super().__init__()
        self.modes = modes
        scale = 1 / channels
        self.weight = torch.nn.Parameter(scale * torch.randn(channels, channels, modes, modes, dtype=torch.cfloat))
        self.skip = torch.nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft2(x, norm="ortho")
        mixed = torch.zeros(*x.shape[:-1], x.shape[-1] // 2 + 1, dtype=spectrum.dtype)
        m = self.modes
        mixed[..., :m, :m] = torch.einsum("bixy,ioxy->boxy", spectrum[..., :m, :m], self.weight)
        return torch.nn.functional.gelu(torch.fft.irfft2(mixed, s=x.shape[-2:], norm="ortho") + self.skip(x))


def test_a_spectral_convolution_trains_fully_on_onnx_runtime():
    torch.manual_seed(0)
    eager = SpectralConv2d()
    model = SpectralConv2d()
    model.load_state_dict(eager.state_dict())
    compiled = _compiled(model)
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (eager, model)]
    generator = torch.Generator().manual_seed(2)
    reset_compiled_graphs()
    for _ in range(4):
        x, target = torch.randn(2, 3, 8, 8, generator=generator), torch.randn(2, 3, 8, 8, generator=generator)
        for module, optimizer in zip((eager, compiled), optimizers):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(module(x), target)
            loss.backward()
            optimizer.step()
    assert {g.kind for g in compiled_graphs() if g.runs} == {"forward", "backward"}  # fallback=False: all on ORT
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        # Adam's steps are lr-sized whatever the gradient's scale, so the parameters agree to within float32
        # rounding of the FFTs' error over four steps.
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_export_refuses_complex_parameters_clearly(tmp_path):
    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = SpectralConv2d()

        def forward(self, x):
            return self.layer(x).square().mean()

    with pytest.raises(CaptureError, match="complex tensors cannot be exported.*'layer.weight'"):
        aot2onnx.export_training(Loss(), (torch.randn(2, 3, 8, 8),), tmp_path / "artifact")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_stft_and_istft_match_eager(dtype):
    window = torch.hann_window(16, dtype=dtype)

    def roundtrip(x):
        spectrum = torch.stft(x, 16, hop_length=4, window=window, return_complex=True)
        return torch.view_as_real(spectrum).square().sum(), torch.istft(spectrum * 2, 16, hop_length=4, window=window, length=96)

    _check(roundtrip, _signal(dtype, False, (2, 96)))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_tensors_with_python_numbers(dtype):
    """A complex tensor times, plus or minus a Python number, and add/sub with a complex alpha: the number is
    rounded once to the tensor's precision (a float32 attribute would cost complex128 its digits) and the
    products are ATen's (a + bi)(c + di), eager's bits here."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, dtype=dtype, generator=g), torch.randn(8, dtype=dtype, generator=g)

    def f(a, b):
        return (a * (0.1 + 0.3j), torch.add(a, b, alpha=0.7 - 0.2j), a + (1.1 - 2.3j), torch.sub(a, b, alpha=2j),
                a * 0.1, a - 0.5j)

    compiled = torch.compile(f, backend="aot2onnx", options={"fallback": False})
    for e, c in zip(f(x, y), compiled(x, y)):
        assert torch.equal(torch.view_as_real(c), torch.view_as_real(e))


_INF, _NAN = float("inf"), float("nan")
# Numerators and divisors, element by element: ordinary values, z / 0 (eager: a complex infinity, or NaN for
# 0 / 0), divisors whose c^2 + d^2 overflows float32, tiny divisors, infinite and NaN parts, signed zeros, each
# branch of the scaling (|c| >= |d| and |c| < |d|).
_NUMERATORS = [1 + 2j, 3 - 4j, 1 + 1j, 0j, 1e-30 + 1e-30j, 1e30 + 1e30j, 1 + 1j, complex(_INF, 1), complex(_NAN, 0),
               2 + 0j, complex(-0.0, 0), 5 + 5j, 1 - 1j, 2 - 1j, -3 + 0.5j]
_DIVISORS = [3 - 1j, 0j, 0j, 0j, 1e30 + 1e30j, 1e30 - 2e30j, 1e-30 + 1e-30j, 1 + 1j, 1 + 1j, complex(-0.0, 0), 0j,
             2e19 + 3e19j, complex(_INF, 0), 0.5 + 0.25j, 0.25 - 4j]


def _bits_or_close(actual: torch.Tensor, expected: torch.Tensor, ulps: int) -> None:
    """The same NaN and infinite parts as eager's and every finite part within ``ulps`` units in the last place of
    eager's (0: bit for bit)."""
    a, e = torch.view_as_real(actual), torch.view_as_real(expected)
    assert torch.equal(a.isnan(), e.isnan()) and torch.equal(a.isinf(), e.isinf()), (actual, expected)
    assert torch.equal(a[a.isinf()], e[e.isinf()])
    finite = e.isfinite()
    ulp = torch.finfo(e.dtype).eps * e[finite].abs().clamp_min(torch.finfo(e.dtype).tiny)
    assert ((a[finite] - e[finite]).abs() <= ulps * ulp).all(), (actual, expected)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_division_is_atens(dtype):
    """Complex division and reciprocal are ATen's (c10::complex's, numpy's scaled division): z / 0 is a complex
    infinity or NaN part by part, a divisor whose c^2 + d^2 overflows does not flush the quotient to 0 (torch_lib's
    formula gave NaN and 0 there), by a tensor, a real tensor, a Python number: the same infinite and NaN parts,
    finite parts within 2 ulps of eager's (ATen's CPU kernels are compiled with FMA contraction, which rounds
    d + c * rat once: measured 1 ulp off on 2e19 + 3e19j in complex128; exact elsewhere here)."""
    a, b = (torch.tensor(v, dtype=dtype) for v in (_NUMERATORS, _DIVISORS))
    r = torch.tensor([2.0, 0.0, -1.0, 3.0, 0.5, 1.0, 2.0, 1.0, 4.0, -0.0, 7.0, 1e-3, 2.5, -2.0, 0.125],
                     dtype=torch.float64 if dtype == torch.complex128 else torch.float32)

    def f(x, y, real):
        return x / y, y.reciprocal(), x / 3.0, x / (2 - 1j), x / real, real / y, x / 0.0, torch.true_divide(x, y)

    compiled = torch.compile(f, backend="aot2onnx", options={"fallback": False, "cache": False})
    for c, e in zip(compiled(a, b, r), f(a, b, r), strict=True):
        _bits_or_close(c, e, 2)


def test_complex_division_gradients_match_eager():
    """Through complex division and reciprocal (and polar, whose backward divides), gradients as eager's."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, dtype=torch.complex64, generator=g)
    y = torch.randn(6, dtype=torch.complex64, generator=g)
    _check(lambda x, y: (x / y, y.reciprocal() * x), x, y)
    absolute, angle = torch.rand(6, generator=g) + 0.5, torch.randn(6, generator=g)
    _check(lambda r, t: torch.polar(r, t) / (1 + 2j), absolute, angle)
