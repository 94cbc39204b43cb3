"""No silent wrong answers: values a rewrite could lose (small constants, multipliers near one), NaN through
max pooling and reductions, infinities through one-sided clamps, and the gradient at hardtanh's bounds, each
against eager PyTorch, forward and gradients, in float32 and float64.

Where the op is exact (additions, products, selections, pooling) the comparison is bit for bit, NaN for NaN;
where it is not (log), within each dtype's rounding.
"""

from __future__ import annotations

import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_behaviour
from harness import Exact, RelAbs, Tolerance, arange_cotangents, check

import aot2onnx
from aot2onnx.artifact import edge

NAN, INF = float("nan"), float("inf")
DTYPES = [torch.float32, torch.float64]
# Equal values, NaN for NaN (a zero's sign is not compared here: the pointwise and pooling tests compare it).
EXACT = Exact(zero_sign=False)
ROUNDING = {torch.float32: RelAbs(rtol=1e-6), torch.float64: RelAbs(rtol=1e-14)}


def _check(fn, *inputs, grad: bool = True, dtype: torch.dtype, tol: Tolerance = EXACT) -> None:
    """fn eagerly and compiled (tests/harness.py) on equal copies of ``inputs`` (cast to ``dtype``): outputs,
    and with ``grad`` the gradients of every input under the same cotangents (1, 2, 3, ...), under ``tol``."""
    check(fn, *inputs, dtype=dtype, grad=grad, tol=tol, cotangents=arange_cotangents, unused_may_be_zero=False)


# ---------------------------------------------------------------------------------------------------------
# Constants the optimizer took for no-ops (onnxscript's rules matched them within a tolerance)

# The smallest constants its rules dropped: |c| <= 1e-8 (float32 adds 1e-9 as nothing to these inputs).
SMALL = {torch.float32: 1e-8, torch.float64: 1e-9}


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_of_a_small_offset(dtype):
    # log(p + eps) at p = 0 is log(eps), its gradient 1 / eps: -inf and inf when eps was dropped.
    eps = SMALL[dtype]
    _check(lambda p: torch.log(p + eps).sum(), torch.tensor([0.0, 0.5, 1.0]), dtype=dtype, tol=ROUNDING[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_small_constant_added_and_subtracted(dtype):
    eps = SMALL[dtype]
    x = torch.tensor([0.0, -0.0, 1e-9, -3e-9, 2e-8])
    _check(lambda x: (x + eps, x - eps, eps + x), x, dtype=dtype)


@pytest.mark.parametrize("op", ["mul", "div"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_multiplier_near_one(op, dtype):
    c = 1.000005  # within onnxscript's rel_tol=1e-5 of 1
    fn = (lambda x: x * c) if op == "mul" else (lambda x: x / c)
    _check(fn, torch.tensor([1e6, -3.0, 7e5]), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_python_floats_keep_the_tensors_precision(dtype):
    # A margin or an exponent that float32 cannot hold: torch_lib made them float32 constants in fill
    # (hinge_embedding_loss's margin - x) and in vector_norm's Pow (ord and 1/ord), 2e-7 off in double.
    margin, ord_ = 8.396163642458497, 2.718281828459045
    x = torch.tensor([[-1.25, 0.5, 3.0], [7.75, -0.125, 2.0]])
    target = torch.tensor([[1.0, -1.0, -1.0], [-1.0, 1.0, -1.0]])
    _check(lambda x: F.hinge_embedding_loss(x, target, margin=margin, reduction="none"), x, dtype=dtype)
    _check(lambda x: torch.full_like(x, margin).fill_(margin / 3) * x, x, dtype=dtype)
    _check(lambda x: (torch.linalg.vector_norm(x, ord_), torch.linalg.vector_norm(x, -ord_, dim=1, keepdim=True),
                      torch.linalg.vector_norm(x, 3, dim=(0, 1))), x, dtype=dtype, tol=ROUNDING[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulating_index_put_over_every_row(dtype):
    # onnxscript's rule took a ScatterND whose indices cover every row for its updates, whatever its
    # reduction: index_put(accumulate=True) and index_add returned the updates alone.
    x, y = torch.ones(3, 2), torch.full((3, 2), 5.0)
    _check(lambda x, y: x.index_put((torch.arange(3),), y, accumulate=True), x, y, dtype=dtype)
    _check(lambda x, y: torch.index_add(x, 0, torch.arange(3), y), x, y, dtype=dtype)


class _SmallEpsLoss(nn.Module):
    """Cross-entropy against soft targets, with log's argument kept off zero by 1e-8."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return -(y * torch.log(F.relu(self.fc(x)) + 1e-8)).mean()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8, torch.uint8])
def test_integer_powers_are_atens(dtype):
    # ATen's integer pow squares and multiplies, wrapping as C++ products do; ONNX Runtime's Pow goes through
    # double: 3 ** 39 was 4052555153018976256 (eager 4052555153018976267), overflows INT64_MIN.
    base = torch.tensor([3, 3, 5, -7, 2, 2, 0, 1, -1, -2, 2, 7, 3, 10, 1, -1, 11, 0])
    exponent = torch.tensor([39, 40, 30, 23, 62, 63, 0, -3, -3, 63, 64, 100, -1, 19, -4, -4, 0, 5])
    if dtype == torch.uint8:
        base, exponent = base.abs(), exponent.abs()
    base, exponent = base.to(dtype), exponent.to(dtype)
    fn = lambda b, e: (b**e, 3**e, b**5, b.pow(39), b**0, b**2 * e, b[:0] ** e[:0],  # noqa: E731
                       b.view(-1, 1) ** e.view(1, -1))
    torch.testing.assert_close(torch.compile(fn, backend=aot2onnx.backend(fallback=False))(base, exponent),
                               fn(base, exponent), rtol=0, atol=0)


def test_training_artifact_keeps_a_small_offset(tmp_path):
    torch.manual_seed(0)
    module = _SmallEpsLoss()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.rand(8, 3, generator=g)
    aot2onnx.export_training(module, (x, y), tmp_path, optimizer=aot2onnx.optim.SGD(0.1))
    eager = _SmallEpsLoss()
    eager.load_state_dict(module.state_dict())
    loss = eager(x, y)
    assert (F.relu(eager.fc(x)) == 0).any() and torch.isfinite(loss)  # the offset is what keeps it finite
    loss.backward()

    loaded = aot2onnx.load(tmp_path)
    loaded_loss = loaded(x, y)
    loaded_loss.backward()
    torch.testing.assert_close(loaded_loss, loss, rtol=1e-6, atol=0.0)
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p.grad, eager.get_parameter(name).grad, rtol=1e-5, atol=1e-7)

    trainer = edge.Trainer(tmp_path)
    trained_loss = trainer.step(x.numpy(), y.numpy())
    assert trained_loss == pytest.approx(loss.item(), rel=1e-6)
    with torch.no_grad():
        for name, p in eager.named_parameters():
            torch.testing.assert_close(torch.from_numpy(trainer.state[name]), p - 0.1 * p.grad, rtol=1e-5,
                                       atol=1e-7)


# ---------------------------------------------------------------------------------------------------------
# NaN through max pooling: ATen's window of a NaN is NaN, and its index the window's last NaN

POOLS = {
    "max_pool2d, NaN last in its window": (lambda x: F.max_pool2d(x, 2, return_indices=True),
                                           torch.tensor([[[[1.0, 0.0], [2.0, NAN]]]])),
    "max_pool2d, two NaNs in a window": (lambda x: F.max_pool2d(x, 2, return_indices=True),
                                         torch.tensor([[[[NAN, 0.0, 5.0, 1.0], [2.0, NAN, NAN, 3.0]]]])),
    "max_pool2d, overlapping windows": (lambda x: F.max_pool2d(x, 2, stride=1, return_indices=True),
                                        torch.tensor([[[[NAN, 0.0, 5.0, 1.0], [2.0, NAN, NAN, 3.0]]]])),
    "max_pool2d, padded, ceil mode": (lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True, return_indices=True),
                                      torch.tensor([[[[NAN, 0.0, 5.0, 1.0, 4.0], [2.0, 1.0, NAN, 3.0, NAN]]]])),
    # A window that starts past the input as ceil mode's end padding would reach the kernel's size.
    "max_pool2d, dilated, ceil mode": (lambda x: F.max_pool2d(x, 2, 3, 0, 3, ceil_mode=True, return_indices=True),
                                       torch.tensor([[[[1.0, 0.0, 2.0, NAN, 9.0, 4.0, 5.0, 3.0]] * 2]])),
    "max_pool2d, infinities": (lambda x: F.max_pool2d(x, 2, return_indices=True),
                               torch.tensor([[[[-INF, -INF, INF, 1.0], [-INF, -INF, NAN, INF]]]])),
    "max_pool2d, unbatched": (lambda x: F.max_pool2d(x, 2, return_indices=True),
                              torch.tensor([[[3.0, NAN], [1.0, 2.0]]])),
    "max_pool1d, NaN first": (lambda x: F.max_pool1d(x, 2),
                              torch.tensor([[[NAN, 1.0, 3.0, 2.0, 5.0, NAN, NAN, 0.0]]])),
    "max_pool1d, indices": (lambda x: F.max_pool1d(x, 3, stride=1, return_indices=True),
                            torch.tensor([[[NAN, 1.0, 3.0, 2.0, 5.0, NAN, NAN, 0.0]]])),
    "max_pool3d": (lambda x: F.max_pool3d(x, 2, return_indices=True),
                   torch.tensor([1.0, 2.0, NAN, 4.0, 5.0, 6.0, 7.0, NAN]).reshape(1, 1, 2, 2, 2)),
    "adaptive_max_pool2d": (lambda x: F.adaptive_max_pool2d(x, (1, 2), return_indices=True),
                            torch.tensor([[[[NAN, 0.0, 5.0, 1.0], [2.0, NAN, NAN, 3.0]]]])),
    "adaptive_max_pool3d": (lambda x: F.adaptive_max_pool3d(x, 1, return_indices=True),
                            torch.tensor([1.0, 2.0, NAN, 4.0, 5.0, 6.0, 7.0, NAN]).reshape(1, 1, 2, 2, 2)),
}


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])  # ONNX Runtime's two MaxPool kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(POOLS))
def test_max_pool_nan(case, dtype, grad):
    fn, x = POOLS[case]
    _check(fn, x, dtype=dtype, grad=grad)


def test_max_pool_without_indices_read(tmp_path):
    # Where no FX node reads the indices, the lowered MaxPool has no indices output (ONNX Runtime's faster
    # kernel), and the NaN branch is an If that runs only where the input holds a NaN.
    x = torch.randn(2, 3, 8, 8)
    compiled = torch.compile(lambda x: F.max_pool2d(x, 2), backend=aot2onnx.backend(dump_dir=str(tmp_path)))
    RelAbs(equal_nan=False).check("max pool", compiled(x), F.max_pool2d(x, 2))
    (path,) = tmp_path.glob("*.onnx")
    nodes = onnx.load(path).graph.node
    assert [len(n.output) for n in nodes if n.op_type == "MaxPool"] == [1]
    assert [n.op_type for n in nodes].count("If") == 1


# ---------------------------------------------------------------------------------------------------------
# NaN and infinities through reductions and elementwise ops

ROWS = torch.tensor([[NAN, 1.0, 3.0], [4.0, NAN, 6.0], [7.0, 8.0, 2.0], [NAN, NAN, -1.0]])
SPECIALS = torch.tensor([1.0, NAN, -3.0, INF, -INF, 0.0, -0.0])
ELEMENTWISE = {
    "max": (torch.max, torch.tensor([[1.0, NAN, 3.0], [4.0, 5.0, 6.0]])),
    "min": (torch.min, torch.tensor([[1.0, NAN, 3.0], [4.0, 5.0, -6.0]])),
    "amax": (lambda x: x.amax(1), ROWS),
    "max.dim": (lambda x: x.max(1), ROWS),
    "min.dim": (lambda x: x.min(0), ROWS),
    "maximum": (lambda x: torch.maximum(x, x.flip(0)), SPECIALS),
    "minimum": (lambda x: torch.minimum(x, x.flip(0)), SPECIALS),
    "sign": (torch.sign, SPECIALS),
    "clamp, NaN min": (lambda x: x.clamp(min=NAN), SPECIALS),
    "clamp, NaN max": (lambda x: x.clamp(-1.0, NAN), SPECIALS),
    "clamp, min only": (lambda x: x.clamp(min=0.0), SPECIALS),
    "clamp, max only": (lambda x: x.clamp(max=0.0), SPECIALS),
    "clamp, both": (lambda x: x.clamp(-1.0, 2.0), SPECIALS),
    "clamp_min": (lambda x: torch.clamp_min(x, 0.5), SPECIALS),
    "clamp_max, NaN": (lambda x: torch.clamp_max(x, NAN), SPECIALS),
    "clamp_min, tensor": (lambda x: torch.clamp_min(x, torch.tensor(0.0, dtype=x.dtype)), SPECIALS),
    "clamp_max, tensor": (lambda x: torch.clamp_max(x, x.flip(0)), SPECIALS),
    # The gradient is zero at the bounds (relu6 at 0 and 6), and passes at NaN.
    "relu6": (F.relu6, torch.tensor([0.0, 6.0, 3.0, -0.0, NAN, 7.0, -1.0])),
    "hardtanh": (F.hardtanh, torch.tensor([-1.0, 1.0, 0.5, -2.0, 2.0, NAN])),
}


# Cases where eager's kernel at hand is off (tests/torch_behaviour.py): strict xfails there, ordinary tests elsewhere.
_EAGER_OFF = {
    "clamp, NaN min": (torch_behaviour.clamp_ignores_a_nan_number,
                       "torch 2.11's clamp(x, min=nan) is x; aot2onnx gives NaN, as torch 2.12 on"),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [
    pytest.param(c, marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=_EAGER_OFF[c][1]))
    if c in _EAGER_OFF and _EAGER_OFF[c][0]() else c for c in ELEMENTWISE
])
def test_nan_and_infinities(case, dtype):
    fn, x = ELEMENTWISE[case]
    _check(fn, x, dtype=dtype)
