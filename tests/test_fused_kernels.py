"""aot2onnx's fused training kernels (runtime/fused_ops.cc) against eager: each fused backward op gives eager's
gradient bit for bit (ATen's own kernel runs inside ONNX Runtime), in every float dtype, at NaN, infinities and
signed zeros too; the compile backend's CPU graphs use them; exports and CUDA graphs never do; the cache keys on
the library's build; a process without the library trains on standard operators and says so once."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import aot2onnx
from aot2onnx.compile import backend as backend_module
from aot2onnx.runtime import compiled_graphs, fused
from aot2onnx.signature import FUSED_DOMAIN

NAN, INF = float("nan"), float("inf")

pytestmark = pytest.mark.skipif(fused.library() is None, reason=f"{fused.missing_reason()}")

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
aten = torch.ops.aten


def _values(dtype: torch.dtype, special: bool, seed: int, shape=(6, 5, 16)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 3
    if x.dim() == 3:
        x[0, 0, :4] = 0.0  # ReLU's and threshold's boundary
        x[0, 1, :4] = -0.0
        x[0, 2, 0] = 0.1  # threshold's own value
    if special and x.dim() == 3:
        x[1, 0, 3], x[2, 1, 5], x[3, 2, 7] = NAN, INF, -INF
    return x.to(dtype)


def _softmax_out(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    return (torch.log_softmax if log else torch.softmax)(x, dim)


def _layer_norm_args(dtype: torch.dtype, special: bool, affine: bool):
    x = _values(dtype, special, 1)
    w = _values(dtype, False, 2, (16,)) if affine else None
    b = _values(dtype, False, 3, (16,)) if affine else None
    _, mean, rstd = aten.native_layer_norm(x, [16], w, b, 1e-5)
    return x, mean, rstd, w, b


# (name, the fused node, dtypes, a function of (dtype, special) -> eager's call of the backward op on its
# arguments). Each is compiled as it is, so the node under test reads exactly eager's arguments.
CASES = [
    ("relu", "ThresholdBackward", DTYPES,
     lambda d, s: (lambda g, x: aten.threshold_backward(g, x, 0), _values(d, s, 0), _values(d, s, 1))),
    ("threshold", "ThresholdBackward", DTYPES,
     lambda d, s: (lambda g, x: aten.threshold_backward(g, x, 0.1), _values(d, s, 0), _values(d, s, 1))),
    ("gelu", "GeluBackward", DTYPES,
     lambda d, s: (lambda g, x: aten.gelu_backward(g, x), _values(d, s, 0), _values(d, s, 1))),
    ("gelu_tanh", "GeluBackward", DTYPES,
     lambda d, s: (lambda g, x: aten.gelu_backward(g, x, approximate="tanh"), _values(d, s, 0), _values(d, s, 1))),
    ("hardswish", "HardswishBackward", DTYPES,
     lambda d, s: (lambda g, x: aten.hardswish_backward(g, x), _values(d, s, 0), _values(d, s, 1))),
    ("hardsigmoid", "HardsigmoidBackward", DTYPES,
     lambda d, s: (lambda g, x: aten.hardsigmoid_backward(g, x), _values(d, s, 0), _edges(d, s, 1))),
    ("relu6", "HardtanhBackward", DTYPES,
     lambda d, s: (lambda g, x: aten.hardtanh_backward(g, x, 0.0, 6.0), _values(d, s, 0), _edges(d, s, 1) * 2)),
    ("hardtanh", "HardtanhBackward", DTYPES,
     lambda d, s: (lambda g, x: aten.hardtanh_backward(g, x, -0.3, 0.3), _values(d, s, 0), _edges(d, s, 1) / 10)),
    ("gelu_forward", "Gelu", DTYPES, lambda d, s: (lambda x: aten.gelu(x), _values(d, s, 0))),
    ("gelu_tanh_forward", "Gelu", DTYPES, lambda d, s: (lambda x: aten.gelu(x, approximate="tanh"), _values(d, s, 0))),
    ("hardswish_forward", "Hardswish", DTYPES, lambda d, s: (lambda x: aten.hardswish(x), _edges(d, s, 0))),
    ("hardsigmoid_forward", "Hardsigmoid", DTYPES, lambda d, s: (lambda x: aten.hardsigmoid(x), _edges(d, s, 0))),
    ("silu", "SiluBackward", DTYPES,
     lambda d, s: (lambda g, x: aten.silu_backward(g, x), _values(d, s, 0), _values(d, s, 1))),
    ("tanh", "TanhBackward", DTYPES,
     lambda d, s: (lambda g, y: aten.tanh_backward(g, y), _values(d, s, 0), torch.tanh(_values(d, s, 1)))),
    ("sigmoid", "SigmoidBackward", DTYPES,
     lambda d, s: (lambda g, y: aten.sigmoid_backward(g, y), _values(d, s, 0), torch.sigmoid(_values(d, s, 1)))),
    ("softmax", "SoftmaxBackward", DTYPES,
     lambda d, s: (lambda g, y: aten._softmax_backward_data(g, y, -1, d), _values(d, s, 0),
                   _softmax_out(_values(d, s, 1), -1, False))),
    ("softmax_dim1", "SoftmaxBackward", DTYPES,
     lambda d, s: (lambda g, y: aten._softmax_backward_data(g, y, 1, d), _values(d, s, 0),
                   _softmax_out(_values(d, s, 1), 1, False))),
    ("log_softmax", "LogSoftmaxBackward", DTYPES,
     lambda d, s: (lambda g, y: aten._log_softmax_backward_data(g, y, -1, d), _values(d, s, 0),
                   _softmax_out(_values(d, s, 1), -1, True))),
    ("layer_norm", "LayerNormBackward", [torch.float32, torch.float64],
     lambda d, s: (lambda g, x, m, r, w, b: aten.native_layer_norm_backward(g, x, [16], m, r, w, b, [True, True, True]),
                   _values(d, s, 0), *_layer_norm_args(d, s, True))),
    ("layer_norm_input_only", "LayerNormBackward", [torch.float32, torch.float64],
     lambda d, s: (lambda g, x, m, r: aten.native_layer_norm_backward(g, x, [16], m, r, None, None, [True, False, False])[0],
                   _values(d, s, 0), *_layer_norm_args(d, s, False)[:3])),
    ("batch_norm_training", "BatchNormTraining", [torch.float32, torch.float64],
     lambda d, s: (lambda x, w, b, rm, rv: aten._native_batch_norm_legit_functional(x, w, b, rm, rv, True, 0.1, 1e-5),
                   *_batch_norm_args(d, s))),
    ("batch_norm_training_no_affine", "BatchNormTraining", [torch.float32, torch.float64],
     lambda d, s: (lambda x, rm, rv: aten._native_batch_norm_legit_functional(x, None, None, rm, rv, True, 0.3, 1e-3),
                   *(_batch_norm_args(d, s)[i] for i in (0, 3, 4)))),
    ("batch_norm_backward", "BatchNormBackward", [torch.float32, torch.float64],
     lambda d, s: (lambda g, x, w, sm, si: aten.native_batch_norm_backward(g, x, w, None, None, sm, si, True, 1e-5,
                                                                           [True, True, True]),
                   _values(d, s, 0, (6, 5, 4, 4)), *_batch_norm_saved(d, s, True))),
    ("batch_norm_backward_no_affine", "BatchNormBackward", [torch.float32, torch.float64],
     lambda d, s: (lambda g, x, sm, si: aten.native_batch_norm_backward(g, x, None, None, None, sm, si, True, 1e-5,
                                                                        [True, False, False])[0],
                   _values(d, s, 0, (6, 5, 4, 4)), *(_batch_norm_saved(d, s, False)[i] for i in (0, 2, 3)))),
    ("batch_norm_backward_eval", "BatchNormBackward", [torch.float32, torch.float64],
     lambda d, s: (lambda g, x, w, rm, rv: aten.native_batch_norm_backward(g, x, w, rm, rv, None, None, False, 1e-5,
                                                                           [True, True, True]),
                   _values(d, s, 0, (6, 5, 4, 4)), *_batch_norm_args(d, s)[:2], *_batch_norm_args(d, s)[3:])),
    ("group_norm_backward", "GroupNormBackward", [torch.float32, torch.float64],
     lambda d, s: (lambda g, x, m, r, w: aten.native_group_norm_backward(g, x, m, r, w, 6, 6, 8, 3, [True, True, True]),
                   _values(d, s, 0, (6, 6, 8)), *_group_norm_args(d, s, True))),
    ("group_norm_backward_no_affine", "GroupNormBackward", [torch.float32, torch.float64],
     lambda d, s: (lambda g, x, m, r: aten.native_group_norm_backward(g, x, m, r, None, 6, 6, 8, 3,
                                                                      [True, False, False])[0],
                   _values(d, s, 0, (6, 6, 8)), *_group_norm_args(d, s, False)[:3])),
    ("softmax_forward", "Softmax", DTYPES, lambda d, s: (lambda x: aten._softmax(x, -1, False), _values(d, s, 0))),
    ("safe_softmax", "SafeSoftmax", DTYPES,
     lambda d, s: (lambda x: aten._safe_softmax(x, -1), _masked_rows(d, s, -1))),
    ("safe_softmax_dim1", "SafeSoftmax", DTYPES,
     lambda d, s: (lambda x: aten._safe_softmax(x, 1), _masked_rows(d, s, 1))),
    ("softmax_forward_dim0", "Softmax", DTYPES, lambda d, s: (lambda x: aten._softmax(x, 0, False), _values(d, s, 0))),
    ("log_softmax_forward", "LogSoftmax", DTYPES,
     lambda d, s: (lambda x: aten._log_softmax(x, -1, False), _values(d, s, 0))),
    ("layer_norm_forward", "LayerNorm", [torch.float32, torch.float64],
     lambda d, s: (lambda x, w, b: aten.native_layer_norm(x, [16], w, b, 1e-5),
                   *(_layer_norm_args(d, s, True)[i] for i in (0, 3, 4)))),
    ("layer_norm_forward_2d", "LayerNorm", [torch.float32, torch.float64],
     lambda d, s: (lambda x: aten.native_layer_norm(x, [5, 16], None, None, 1e-3), _values(d, s, 1))),
    *(
        (f"max_pool_{name}", "MaxPoolWithIndices", DTYPES,
         lambda d, s, shape=shape, args=args: (
             lambda x: (aten.max_pool3d_with_indices if len(args[0]) == 3 else aten.max_pool2d_with_indices)(x, *args),
             _pool_input(d, s, shape)))
        for name, shape, args in (
            ("2d", (2, 3, 8, 8), ([2, 2], [2, 2])),
            ("2d_default_stride", (2, 3, 8, 8), ([2, 2], [])),
            ("2d_overlapping_padded", (2, 3, 9, 7), ([3, 3], [2, 2], [1, 1])),
            ("2d_ceil_dilated", (2, 3, 9, 8), ([3, 2], [2, 3], [1, 0], [2, 1], True)),
            ("2d_unbatched", (3, 8, 8), ([2, 2], [2, 2])),
            ("3d", (2, 2, 4, 6, 6), ([2, 2, 2], [2, 2, 2])),
        )
    ),
    *(
        (f"convolution_backward_{name}", "ConvolutionBackward", DTYPES,
         lambda d, s, shapes=shapes, args=args: (
             lambda g, x, w: aten.convolution_backward(g, x, w, *args), *_convolution_args(d, s, shapes)))
        for name, shapes, args in (
            ("2d", ((2, 4, 6, 6), (2, 3, 6, 6), (4, 3, 3, 3)),
             ([4], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True])),
            ("2d_weight_only", ((2, 4, 6, 6), (2, 3, 6, 6), (4, 3, 3, 3)),
             (None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, False])),
            ("2d_strided_dilated_grouped", ((2, 6, 4, 2), (2, 4, 7, 6), (6, 2, 2, 3)),
             ([6], [2, 2], [1, 0], [2, 1], False, [0, 0], 2, [True, True, False])),
            ("1d", ((3, 5, 8), (3, 3, 10), (5, 3, 3)), ([5], [1], [0], [1], False, [0], 1, [True, True, True])),
            ("transposed_2d", ((2, 6, 11, 11), (2, 4, 5, 5), (4, 3, 3, 3)),
             ([6], [2, 2], [0, 0], [1, 1], True, [0, 0], 2, [True, True, True])),
        )
    ),
    # Matrix products: operands read transposed where the graph transposes them (as eager's views), an addend.
    ("mm", "Mm", DTYPES, lambda d, s: (lambda a, b: aten.mm(a, b), _operand(d, s, 0, (6, 16)), _operand(d, s, 1, (16, 5)))),
    ("mm_transposed", "Mm", DTYPES,
     lambda d, s: (lambda a, b: aten.mm(a.t(), b.t()), _operand(d, s, 0, (16, 6)), _operand(d, s, 1, (5, 16)))),
    ("addmm", "Mm", DTYPES,
     lambda d, s: (lambda c, a, b: aten.addmm(c, a, b.t()), _operand(d, s, 2, (5,)), _operand(d, s, 0, (6, 16)),
                   _operand(d, s, 1, (5, 16)))),
    ("addmm_scaled", "Mm", DTYPES,
     lambda d, s: (lambda c, a, b: aten.addmm(c, a, b, beta=0.5, alpha=-3.0), _operand(d, s, 2, (6, 5)),
                   _operand(d, s, 0, (6, 16)), _operand(d, s, 1, (16, 5)))),
    ("bmm", "Mm", DTYPES,
     lambda d, s: (lambda a, b: aten.bmm(a, b), _operand(d, s, 0, (3, 6, 16)), _operand(d, s, 1, (3, 16, 5)))),
    ("bmm_transposed", "Mm", DTYPES,
     lambda d, s: (lambda a, b: aten.bmm(a, b.transpose(1, 2)), _operand(d, s, 0, (3, 6, 16)),
                   _operand(d, s, 1, (3, 5, 16)))),
    ("baddbmm", "Mm", DTYPES,
     lambda d, s: (lambda c, a, b: aten.baddbmm(c, a, b, beta=2.0, alpha=0.25), _operand(d, s, 2, (3, 6, 5)),
                   _operand(d, s, 0, (3, 6, 16)), _operand(d, s, 1, (3, 16, 5)))),
    # Sums: a bias gradient (leading axes), a layer norm's weight gradient, every axis, keepdim, negative axes. A
    # 16-bit sum reaches the graph as a float32 sum between Casts (the decomposition's upcast): ONNX Runtime's
    # Cast writes a bfloat16 NaN with another sign bit than ATen's conversion, so float32 and float64 here.
    ("sum_leading", "Sum", [torch.float32, torch.float64], lambda d, s: (lambda x: aten.sum(x, [0, 1]), _values(d, s, 0))),
    ("sum_all", "Sum", [torch.float32, torch.float64], lambda d, s: (lambda x: aten.sum(x), _values(d, s, 0))),
    ("sum_all_listed", "Sum", [torch.float32, torch.float64], lambda d, s: (lambda x: aten.sum(x, [0, 1, 2]), _values(d, s, 0))),
    ("sum_keepdim_negative", "Sum", [torch.float32, torch.float64],
     lambda d, s: (lambda x: aten.sum(x, [-1, 0], keepdim=True), _values(d, s, 0))),
    ("sum_middle", "Sum", [torch.float32, torch.float64], lambda d, s: (lambda x: aten.sum(x, [1]), _values(d, s, 0))),
    ("mm_empty", "Mm", [torch.float32],
     lambda d, s: (lambda a, b: aten.mm(a, b), _operand(d, s, 0, (6, 0)), _operand(d, s, 1, (0, 5)))),
    *(
        (f"embedding_backward_{name}", "EmbeddingDenseBackward", DTYPES,
         lambda d, s, shape=shape, padding_idx=padding_idx, by_freq=by_freq, index_dtype=index_dtype: (
             lambda g, i: aten.embedding_dense_backward(g, i, 10, padding_idx, by_freq),
             _values(d, s, 0, (*shape, 16)), _indices(shape, index_dtype)))
        for name, shape, padding_idx, by_freq, index_dtype in (
            ("2d", (6, 5), -1, False, torch.int64),
            ("padding_idx", (6, 5), 3, False, torch.int64),
            ("scale_grad_by_freq", (6, 5), -1, True, torch.int64),
            ("padding_idx_scale_grad_by_freq", (6, 5), 3, True, torch.int64),
            ("1d", (30,), 0, True, torch.int64),
            ("3d", (2, 3, 5), 7, False, torch.int64),
            ("int32", (6, 5), 3, True, torch.int32),
        )
    ),
]


def _edges(dtype: torch.dtype, special: bool, seed: int) -> torch.Tensor:
    """Values with the hard activations' corners among them (-3, 3 and their neighbours, signed zeros)."""
    x = _values(dtype, special, seed).clone()
    corners = torch.tensor([-3.0, 3.0, -0.0, 0.0, -3.0001, 2.9999, 3.0001, -2.9999], dtype=dtype)
    x.view(-1)[-corners.numel():] = corners
    return x


def _masked_rows(dtype: torch.dtype, special: bool, dim: int) -> torch.Tensor:
    """Attention scores with rows (along ``dim``) of -inf alone, as a mask makes them, and one -inf among values."""
    x = _values(dtype, special, 0).clone()
    dim %= x.dim()
    for k in (1, 2, 4):  # rows of -inf alone
        x[tuple(slice(None) if d == dim else k for d in range(x.dim()))] = -INF
    x[tuple(slice(None) if d == dim else 3 for d in range(x.dim()))] = -INF
    x[(3,) * x.dim()] = 2.0  # a row of -inf and one value
    return x


def _pool_input(dtype: torch.dtype, special: bool, shape) -> torch.Tensor:
    """A pooling input with ties (equal values in one window); with ``special``, a NaN, infinities and a window of
    -inf alone."""
    x = _values(dtype, False, 0, shape).contiguous()
    flat = x.view(-1)
    flat[1] = flat[0]
    if special:
        flat[[5, 9, 20]] = torch.tensor([NAN, INF, NAN], dtype=dtype)
        flat[x.shape[-1] * 2: x.shape[-1] * 2 + 2] = -INF
        flat[x.shape[-1] * 3: x.shape[-1] * 3 + 2] = -INF
    return x


def _convolution_args(dtype: torch.dtype, special: bool, shapes) -> list[torch.Tensor]:
    """(grad_output, input, weight) of the given shapes; with ``special``, an infinity and a NaN in the input and
    an infinity in the gradient (the weight's gradient sums their products)."""
    g, x, w = (_values(dtype, False, seed, shape) for seed, shape in enumerate(shapes))
    if special:
        x.view(-1)[[3, 17]] = torch.tensor([INF, NAN], dtype=dtype)
        g.view(-1)[5] = -INF
    return [g, x, w]


def _operand(dtype: torch.dtype, special: bool, seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A product's or convolution's operand; with ``special``, an infinity, a -infinity and a NaN in it."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3
    if special and x.numel() >= 8:
        x.view(-1)[[1, 4, 7]] = torch.tensor([INF, -INF, NAN])
    return x.to(dtype)


def _indices(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Indices into 10 rows, each row repeated (more indices than rows), every row taken, 3 among them."""
    n = torch.Size(shape).numel()
    rows = torch.cat([torch.arange(10), torch.randint(0, 10, (n - 10,), generator=torch.Generator().manual_seed(4))])
    return rows[torch.randperm(n, generator=torch.Generator().manual_seed(5))].reshape(shape).to(dtype)


def _group_norm_args(dtype: torch.dtype, special: bool, affine: bool):
    """(input, mean, rstd, weight) of a group norm of 6 channels in 3 groups, from ATen's forward."""
    x = _values(dtype, special, 1, (6, 6, 8))
    w = _values(dtype, False, 2, (6,)) if affine else None
    _, mean, rstd = aten.native_group_norm(x, w, None, 6, 6, 8, 3, 1e-5)
    return x, mean, rstd, w


def _batch_norm_args(dtype: torch.dtype, special: bool):
    """(input, weight, bias, running_mean, running_var) of a batch norm over 5 channels."""
    x = _values(dtype, special, 1, (6, 5, 4, 4))
    if special:
        x[1, 2, 0, 0], x[2, 3, 1, 1] = NAN, INF
    w, b = _values(dtype, False, 2, (5,)), _values(dtype, False, 3, (5,))
    rm, rv = _values(dtype, False, 4, (5,)), _values(dtype, False, 5, (5,)).abs() + 0.5
    return x, w, b, rm, rv


def _batch_norm_saved(dtype: torch.dtype, special: bool, affine: bool):
    """(input, weight, save_mean, save_invstd) of a batch norm in training, from ATen's forward."""
    x, w, b, rm, rv = _batch_norm_args(dtype, special)
    _, sm, si, _, _ = aten._native_batch_norm_legit_functional(x, w if affine else None, b if affine else None,
                                                               rm, rv, True, 0.1, 1e-5)
    return x, w if affine else None, sm, si


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit: the same values, the same NaN, the signs of zeros."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan_inf"])
@pytest.mark.parametrize(("name", "node", "dtypes", "make"), CASES, ids=[c[0] for c in CASES])
def test_fused_op_is_eagers_bit_for_bit(name, node, dtypes, make, special):
    for dtype in dtypes:
        torch._dynamo.reset()
        fn, *args = make(dtype, special)
        expected = fn(*args)
        actual = torch.compile(fn, backend="aot2onnx", options={"cache": False, "fallback": False})(*args)
        graph = compiled_graphs()[-1]
        assert graph.op_counts.get(node, 0) == 1 and graph.fused_kernels, (dtype, dict(graph.op_counts))
        for a, e in zip(torch.utils._pytree.tree_leaves(actual), torch.utils._pytree.tree_leaves(expected), strict=True):
            if a is None and e is None:  # a gradient the mask does not ask for
                continue
            assert _same(a, e), (name, dtype, (a.double() - e.double()).abs().nan_to_num().max())


TRAINING = [
    ("relu", lambda x, w: F.relu(x) * w, "ThresholdBackward"),
    ("gelu", lambda x, w: F.gelu(x) * w, "GeluBackward"),
    ("hardsigmoid", lambda x, w: F.hardsigmoid(x * w), "HardsigmoidBackward"),
    ("relu6", lambda x, w: F.relu6(x * w), "HardtanhBackward"),
    ("softmax", lambda x, w: torch.softmax(x * w, -1), "SoftmaxBackward"),
    ("log_softmax", lambda x, w: torch.log_softmax(x * w, -1), "LogSoftmaxBackward"),
    ("layer_norm", lambda x, w: F.layer_norm(x, (16,), w, w * 0.5), "LayerNormBackward"),
    ("group_norm", lambda x, w: F.group_norm(x.reshape(6, 4, 20), 2, w[:4], w[4:8]).reshape(x.shape),
     "GroupNormBackward"),
    ("batch_norm", lambda x, w: F.batch_norm(x, torch.zeros(5), torch.ones(5), w[:5], w[5:10], training=True),
     "BatchNormBackward"),
]


@pytest.mark.parametrize(("name", "fn", "node"), TRAINING, ids=[t[0] for t in TRAINING])
def test_training_graphs_use_the_fused_ops_and_match_eager(name, fn, node):
    """In a training step the backward graph holds the fused node; gradients as eager's (the forward's values,
    which the backward reads, come from the standard lowering: within its tolerances)."""
    torch._dynamo.reset()
    x, w = _values(torch.float32, False, 0), _values(torch.float32, False, 1, (16,))
    grads = []
    for compiled in (False, True):
        xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
        f = torch.compile(fn, backend="aot2onnx", options={"cache": False, "fallback": False}) if compiled else fn
        f(xc, wc).mul(torch.linspace(-1, 1, x.numel()).reshape(x.shape)).sum().backward()
        grads.append((xc.grad, wc.grad))
    backward = [g for g in compiled_graphs() if g.kind.value == "backward"][-1]
    assert backward.op_counts.get(node, 0) >= 1 and backward.fused_kernels, dict(backward.op_counts)
    for e, a in zip(*grads):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def test_fused_kernels_only_in_cpu_training_graphs_of_the_backend(tmp_path):
    """An export stays standard ONNX: the artifact's backward model has no node of the fused domain."""
    import onnx

    class WithLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8),
                                           torch.nn.GELU(), torch.nn.LayerNorm(8))

        def forward(self, x):
            return torch.log_softmax(self.net(x), -1).mean()

    class EmbeddingLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = torch.nn.Embedding(16, 8)

        def forward(self, tokens):
            return self.embedding(tokens).square().mean()

    aot2onnx.export_training(WithLoss(), (torch.randn(4, 8),), str(tmp_path / "artifact"),
                             optimizer=aot2onnx.optim.SGD(0.1))
    aot2onnx.export_training(EmbeddingLoss(), (torch.randint(0, 16, (4, 5)),), str(tmp_path / "embedding"),
                             optimizer=aot2onnx.optim.SGD(0.1))
    for artifact in ("artifact", "embedding"):
        paths = list((tmp_path / artifact).rglob("*.onnx"))
        assert paths
        for path in paths:
            domains = {n.domain for n in onnx.load(str(path)).graph.node}
            assert "aot2onnx.fused" not in domains, path


def test_cache_keys_on_the_kernels_build(monkeypatch):
    """A cached lowering that uses the kernels is not served to a process with another build, or none."""
    from aot2onnx.compile.cache import graph_key

    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    keys = {graph_key(gm, opset=18, rules=[], kernels=k) for k in ("none", "a" * 64, "b" * 64)}
    assert len(keys) == 3


def test_without_the_library_training_uses_standard_operators_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(fused, "library", lambda: None)
    monkeypatch.setattr(fused, "missing_reason", lambda check_loadable=True: "no compiler here (test)")
    monkeypatch.setattr(fused, "_noted", type(fused._noted)())
    x = _values(torch.float32, True, 0)
    xe = x.clone().requires_grad_()
    F.relu(xe).sum().backward()
    with caplog.at_level(logging.WARNING, logger="aot2onnx"):
        for _ in range(2):
            torch._dynamo.reset()
            xc = x.clone().requires_grad_()
            torch.compile(F.relu, backend="aot2onnx", options={"cache": False, "fallback": False})(xc).sum().backward()
            assert _same(xc.grad, xe.grad)
    backward = [g for g in compiled_graphs() if g.kind.value == "backward"][-1]
    assert not backward.fused_kernels and "ThresholdBackward" not in backward.op_counts
    notes = [r for r in caplog.records if "no compiler here (test)" in r.getMessage()]
    assert len(notes) == 1 and "standard ONNX operators" in notes[0].getMessage()


def test_kernels_build_id_and_backend_registry():
    assert fused.build_id() != "none" and len(fused.build_id()) == 64
    options = aot2onnx.Options()
    assert backend_module._uses_fused_kernels(torch.device("cpu"), options)
    assert not backend_module._uses_fused_kernels(torch.device("cuda"), options)
    assert not backend_module._uses_fused_kernels(torch.device("cpu"), aot2onnx.Options(fused_kernels=False))


def test_a_compiler_without_openmp_builds_the_library_serial(tmp_path, monkeypatch):
    """The build asks for OpenMP (the library's own loops split by ATen's parallel_for); where the compiler
    refuses it, the same source builds without, and the stamp says which."""
    import json
    import pathlib
    import subprocess

    commands = []

    def run(command, **kwargs):
        commands.append(list(command))
        if "-fopenmp" in command:
            return subprocess.CompletedProcess(command, 1, "", "error: unsupported option '-fopenmp'")
        if "--version" in command:
            return subprocess.CompletedProcess(command, 0, "c++ 1.0\n", "")
        pathlib.Path(command[command.index("-o") + 1]).write_bytes(b"library")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(fused.subprocess, "run", run)
    monkeypatch.setattr(fused, "_OUT_DIR", tmp_path)
    monkeypatch.setattr(fused, "_LIBRARY", tmp_path / "lib.so")
    monkeypatch.setattr(fused, "_STAMP", tmp_path / "build.json")
    fused._compile(tmp_path)
    builds = [c for c in commands if "-o" in c]
    assert len(builds) == 2 and "-fopenmp" in builds[0] and "-fopenmp" not in builds[1]
    assert builds[0][:1] + builds[0][2:] == builds[1]
    assert json.loads((tmp_path / "build.json").read_text())["openmp"] is False
    assert (tmp_path / "lib.so").read_bytes() == b"library"


def _embedding_steps(embedding: torch.nn.Embedding, tokens: torch.Tensor, upstream: torch.Tensor, options: dict,
                     steps: int = 4) -> None:
    """``steps`` training steps' gradients, compiled with ``options``, each eager's bit for bit."""
    expected = aten.embedding_dense_backward(upstream, tokens, embedding.num_embeddings,
                                             -1 if embedding.padding_idx is None else embedding.padding_idx,
                                             embedding.scale_grad_by_freq)
    compiled = torch.compile(embedding, backend="aot2onnx", options={"cache": False, "fallback": False, **options})
    for step in range(steps):
        embedding.weight.grad = None
        compiled(tokens).backward(upstream)
        assert _same(embedding.weight.grad, expected), (step, (embedding.weight.grad - expected).abs().max())


def test_an_embeddings_gradient_is_fused_and_keeps_its_threads(two_threads):
    """An embedding's gradient over 8 x 1024 tokens of a 4096-word vocabulary, on two threads: the fused node
    (ATen's kernel) gives eager's bits on every step, and its graph is not held to one thread, as the standard
    lowering's ScatterND with a reduction is (tests/test_thread_trial.py, which tests that fallback)."""
    torch._dynamo.reset()
    aot2onnx.reset_compiled_graphs()
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(4096, 768)
    tokens = torch.randint(0, 4096, (8, 1024))
    _embedding_steps(embedding, tokens, torch.randn(8, 1024, 768), {})
    backward = [g for g in compiled_graphs() if g.kind.value == "backward"]
    assert len(backward) == 1, backward
    graph = backward[0]
    assert graph.op_counts.get("EmbeddingDenseBackward") == 1 and "ScatterND" not in graph.op_counts, graph.op_counts
    assert graph.fused_kernels and graph.serial == []
    # Its work is the fused kernel's, on torch's OpenMP threads: the session starts on one intra-op thread, and
    # the thread trial, which a serial graph has not, times torch's count against it (unsettled in 4 steps).
    assert graph.intra_op_threads == 1
    assert graph._trial is not None and {c.threads for c in graph._trial.candidates} == {1, 2}


@pytest.mark.parametrize(("padding_idx", "scale_grad_by_freq", "index_dtype"),
                         [(None, True, torch.int64), (3, False, torch.int64), (0, True, torch.int32)])
def test_an_embeddings_options_reach_the_fused_node(padding_idx, scale_grad_by_freq, index_dtype):
    torch._dynamo.reset()
    aot2onnx.reset_compiled_graphs()
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 16, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
    _embedding_steps(embedding, _indices((6, 5), index_dtype), torch.randn(6, 5, 16), {}, steps=2)
    backward = [g for g in compiled_graphs() if g.kind.value == "backward"][-1]
    assert backward.op_counts.get("EmbeddingDenseBackward") == 1, backward.op_counts


def test_without_the_kernels_an_embeddings_gradient_runs_on_one_thread(two_threads):
    """fused_kernels=False: the standard lowering (a ScatterND with a reduction), on one thread, still exact.
    Not with scale_grad_by_freq: PyTorch's decomposition divides each gradient by its index's count, where ATen's
    kernel multiplies it by the count's reciprocal (an ulp apart at times); the fused node is exact there too."""
    torch._dynamo.reset()
    aot2onnx.reset_compiled_graphs()
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(64, 16, padding_idx=3)
    tokens = torch.randint(0, 64, (8, 128))
    _embedding_steps(embedding, tokens, torch.randn(8, 128, 16), {"fused_kernels": False}, steps=2)
    graph = [g for g in compiled_graphs() if g.kind.value == "backward"][-1]
    assert not graph.fused_kernels and "EmbeddingDenseBackward" not in graph.op_counts
    assert graph.serial and graph.intra_op_threads == 1


WHERE_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
                torch.int8, torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", WHERE_DTYPES, ids=str)
def test_where_nodes_run_as_the_fused_select_bit_for_bit(dtype):
    """Every ONNX Where of a CPU graph (here torch.where's, broadcasting its three operands) runs as the fused
    select: eager's values bit for bit in every dtype, NaN payloads and signed zeros included."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 5, 16, generator=g) * 100).to(dtype)
    y = (torch.randn(6, 1, 16, generator=g) * 100).to(dtype)
    if dtype.is_floating_point:
        x[0, 0, :3] = torch.tensor([NAN, -0.0, -INF], dtype=dtype)
        y[1, 0, :2] = torch.tensor([-0.0, NAN], dtype=dtype)
    condition = torch.rand(6, 5, 1, generator=g) > 0.5

    def fn(c, a, b):
        return torch.where(c, a, b), torch.where(c[0], b, 3)

    torch._dynamo.reset()
    expected = fn(condition, x, y)
    actual = torch.compile(fn, backend="aot2onnx", options={"cache": False, "fallback": False})(condition, x, y)
    graph = compiled_graphs()[-1]
    if dtype not in (torch.float16, torch.bfloat16):
        # (16-bit graphs get float32 Casts, runtime/precision.py, after which the operands' ranks are not known)
        assert graph.fused_selects >= 2 and graph.fused_kernels, dict(graph.op_counts)
    for a, e in zip(actual, expected):
        assert _same(a, e), (dtype, a, e)


def test_where_only_with_known_ranks_and_without_the_option_stays_standard():
    """The graph's Where runs as the select where its operands' ranks are known; one in an If branch stays
    ONNX Runtime's (a custom op's shape inference would see an operand of unknown rank as a scalar), and so
    does every one with fused_kernels=False."""
    import onnx

    from aot2onnx.runtime.rewrites import fused_selects

    then = onnx.helper.make_graph([onnx.helper.make_node("Where", ["c", "x", "y"], ["t"])], "then", [],
                                  [onnx.helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, None)])
    other = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["e"])], "else", [],
                                   [onnx.helper.make_tensor_value_info("e", onnx.TensorProto.FLOAT, None)])
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("ReduceMax", ["c8"], ["any"], keepdims=0),
         onnx.helper.make_node("Cast", ["any"], ["flag"], to=onnx.TensorProto.BOOL),
         onnx.helper.make_node("If", ["flag"], ["out"], then_branch=then, else_branch=other),
         onnx.helper.make_node("Where", ["c", "out", "y"], ["z"])], "g",
        [onnx.helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [3]),
         onnx.helper.make_tensor_value_info("c8", onnx.TensorProto.INT32, [3]),
         onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3]),
         onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3])],
        [onnx.helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [3])])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    rewritten, count = fused_selects(model)
    assert count == 0 and rewritten is model  # "out", the If's output, has no known rank
    model.graph.value_info.append(onnx.helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [3]))
    rewritten, count = fused_selects(model)
    assert count == 1 and rewritten is not model
    assert [n.domain for n in rewritten.graph.node if n.op_type == "Where"] == ["aot2onnx.fused"]
    assert rewritten.graph.node[2].attribute[0].g.node[0].domain == ""  # the branch's Where stays
    assert [n.domain for n in model.graph.node if n.op_type == "Where"] == [""]  # the given model is untouched
    import numpy as np
    import onnxruntime as ort

    from aot2onnx.runtime.session import session_options

    feeds = {"c": np.array([True, False, True]), "c8": np.array([0, 1, 0], dtype=np.int32),
             "x": np.array([1.0, -0.0, np.nan], dtype=np.float32), "y": np.array([-0.0, 2.0, 3.0], dtype=np.float32)}
    so = session_options(aot2onnx.Options(), fused_kernels=True)
    got = ort.InferenceSession(rewritten.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert got.tobytes() == want.tobytes()

    torch._dynamo.reset()
    x = torch.randn(4, 3)
    torch.compile(lambda v: torch.where(v > 0, v, 0.0), backend="aot2onnx",
                  options={"cache": False, "fallback": False, "fused_kernels": False})(x)
    graph = compiled_graphs()[-1]
    assert graph.fused_selects == 0 and not graph.fused_kernels



def _cpu_session(model, fused_kernels=True):
    """An ONNX Runtime CPU session of ``model`` with aot2onnx's session options (the library registered)."""
    import onnxruntime as ort

    from aot2onnx.runtime.session import session_options

    so = session_options(aot2onnx.Options(), fused_kernels=fused_kernels)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _trains_as_without_the_rewrite(rewrite: str, make, at_least: int, loss_atol: float):
    """Trains ``make()``'s (model, input) one step compiled, with the session rewrite ``rewrite`` (a function of
    runtime/session.py) and with it replaced by one that leaves the model alone: each graph rewrote at least
    ``at_least`` nodes, the loss and gradients are the same bits either way, and within tolerance of eager's."""
    import aot2onnx.runtime.session as session

    def run(rewritten):
        torch._dynamo.reset()
        aot2onnx.reset_compiled_graphs()
        torch.manual_seed(0)
        model, x = make()
        original = getattr(session, rewrite)
        if not rewritten:
            setattr(session, rewrite, lambda m: (m, 0))
        try:
            loss = torch.compile(model, backend="aot2onnx", options={"cache": False, "fallback": False})(x)
            loss.backward()
        finally:
            setattr(session, rewrite, original)
        counts = [getattr(g, rewrite) for g in compiled_graphs() if g.session is not None]
        return loss, [p.grad for p in model.parameters()], counts, model, x

    loss, grads, counts, model, x = run(True)
    assert len(counts) == 2 and all(c >= at_least for c in counts), counts
    plain_loss, plain_grads, plain_counts, _, _ = run(False)
    assert plain_counts == [0, 0]
    assert _same(loss, plain_loss) and all(_same(a, b) for a, b in zip(grads, plain_grads))
    model.zero_grad()
    eager = model(x)
    eager.backward()
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=loss_atol)
    for a, p in zip(grads, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-6)


def _transpose_session(shape, perm, elem_type, domain):
    import onnx

    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Transpose", ["x"], ["y"], perm=perm, domain=domain)], "g",
        [onnx.helper.make_tensor_value_info("x", elem_type, shape)],
        [onnx.helper.make_tensor_value_info("y", elem_type, None)])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18),
                                                         onnx.helper.make_opsetid("aot2onnx.fused", 1)])
    return _cpu_session(model)


TRANSPOSES = [
    ([16, 32, 4, 8], [0, 2, 1, 3]),  # attention's head split: runs of 8
    ([16, 4, 32, 8], [0, 2, 1, 3]),  # and merge
    ([64, 32, 32], [1, 0, 2]),  # nn.MultiheadAttention's
    ([1, 64, 8, 3, 128], [3, 1, 2, 0, 4]),  # its packed projection's split: axes of size 1, merged neighbours
    ([2, 3, 5, 7], [2, 0, 1, 3]),
    ([3, 1, 4, 1, 6], [4, 2, 0, 1, 3]),  # the last axis moves: element by element
    ([4, 8, 16, 32, 8], [0, 3, 1, 2, 4]),
    ([64, 130, 9, 3], [1, 0, 2, 3]),  # 224640 elements: rows shared among threads
    ([5, 0, 3], [1, 0, 2]),  # no elements
    ([2, 3, 4], [0, 1, 2]),  # the identity
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape,perm", TRANSPOSES, ids=str)
def test_the_fused_transpose_copies_onnx_runtimes_bytes(shape, perm, threads):
    """The fused Transpose gives ONNX Runtime's own Transpose's bytes: every element type size (bool, 16-bit
    floats, float32 with NaN payloads and signed zeros, int64), any permutation, on one thread and two."""
    import numpy as np
    from onnx import TensorProto

    rng = np.random.default_rng(0)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for elem_type, values in (
            (TensorProto.FLOAT, rng.standard_normal(shape).astype(np.float32)),
            (TensorProto.BOOL, rng.random(shape) > 0.5),
            (TensorProto.FLOAT16, rng.standard_normal(shape).astype(np.float16)),
            (TensorProto.INT64, rng.integers(-2**62, 2**62, shape)),
            (TensorProto.UINT8, rng.integers(0, 255, shape).astype(np.uint8)),
        ):
            if elem_type == TensorProto.FLOAT and values.size >= 3:
                flat = values.reshape(-1)
                flat[:3] = [np.nan, -0.0, -np.inf]
                flat.view(np.uint32)[0] |= 0x12345  # a NaN payload
            got = _transpose_session(shape, perm, elem_type, "aot2onnx.fused").run(None, {"x": values})[0]
            want = _transpose_session(shape, perm, elem_type, "").run(None, {"x": values})[0]
            assert got.shape == want.shape == tuple(shape[p] for p in perm)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (elem_type, shape, perm)
    finally:
        torch.set_num_threads(previous)


def test_the_fused_transpose_refuses_a_perm_that_is_not_a_permutation():
    import numpy as np
    from onnx import TensorProto

    with pytest.raises(Exception, match="perm is not a permutation"):
        session = _transpose_session([2, 3, 4], [0, 0, 2], TensorProto.FLOAT, "aot2onnx.fused")
        session.run(None, {"x": np.zeros((2, 3, 4), np.float32)})


def test_transposes_that_keep_the_last_axis_run_fused():
    """Which Transposes the rewrite gives the fused kernel: a computed tensor's, of known rank and element type,
    rank 3 or more, the last axis in place. An initializer's (ONNX Runtime folds it), one that moves the last axis,
    one of unknown rank and a string tensor's stay ONNX Runtime's."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    from aot2onnx.runtime.rewrites import fused_transposes

    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Transpose", ["r"], ["a"], perm=[0, 2, 1, 3]),  # fused
        helper.make_node("Transpose", ["r"], ["b"], perm=[0, 1, 3, 2]),  # moves the last axis
        helper.make_node("Transpose", ["w"], ["c"], perm=[1, 0, 2]),  # an initializer's
        helper.make_node("Transpose", ["u"], ["d"], perm=[1, 0, 2]),  # unknown rank
        helper.make_node("Transpose", ["s"], ["e"], perm=[1, 0, 2]),  # strings
        helper.make_node("Transpose", ["x"], ["f"], perm=[2, 1, 0, 3]),  # a graph input's: fused
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 5]),
         helper.make_tensor_value_info("u", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("s", TensorProto.STRING, [1, 2, 3])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "abcdf"]
        + [helper.make_tensor_value_info("e", TensorProto.STRING, None)],
        [onnx.numpy_helper.from_array(np.ones((2, 3, 4), np.float32), "w")],
        value_info=[helper.make_tensor_value_info("r", TensorProto.FLOAT, [2, 3, 4, 5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    rewritten, count = fused_transposes(model)
    assert count == 2
    assert [n.output[0] for n in rewritten.graph.node if n.domain == "aot2onnx.fused"] == ["a", "f"]
    assert all(n.domain == "" for n in model.graph.node)  # the given model is untouched
    assert fused_transposes(rewritten)[1] == 0


def test_attention_trains_as_eager_with_its_transposes_fused():
    """A Hugging Face-style attention block (heads split and merged by permute) trains on the fused Transposes:
    forward and gradients bit for bit as with ONNX Runtime's own Transpose, and within tolerance of eager's."""
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out, self.heads = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32), 4

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (t.view(b, s, self.heads, 8).permute(0, 2, 1, 3) for t in self.qkv(x).chunk(3, dim=-1))
            attn = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, dim=-1) @ v
            return self.out(attn.permute(0, 2, 1, 3).reshape(b, s, 32)).pow(2).sum()

    _trains_as_without_the_rewrite("fused_transposes", lambda: (Attention(), torch.randn(3, 10, 32)), at_least=1,
                                   loss_atol=1e-5)


def _elementwise_model(nodes, inputs, outputs, initializers=(), value_info=()):
    from onnx import helper

    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers), value_info=list(value_info))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _ort_run(model, feeds, fused_kernels=True):
    return _cpu_session(model, fused_kernels).run(None, feeds)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_elementwise_chains_give_onnx_runtimes_bits(seed, threads):
    """Random chains of Add, Sub, Mul, Div and Neg over tensors and one-element constants, float32 and float64,
    with NaN, infinities, signed zeros and subnormals among the values: the fused Elementwise gives the nodes'
    own values bit for bit (where both operands of an operation are NaN, x86 lets either payload through: there
    NaN is NaN), on one thread and two (70000 elements: blocks shared among threads)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    from aot2onnx.runtime.rewrites import fused_elementwise

    rng = np.random.default_rng(seed)
    dtype, elem = [(np.float32, TensorProto.FLOAT), (np.float64, TensorProto.DOUBLE)][seed % 2]
    shape = [7, 10000] if seed % 3 == 0 else [3, 5, 4]
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, np.finfo(dtype).tiny / 4, 1e30, -1e-30], dtype)
    feeds = {}
    for name in ("x", "y", "z"):
        values = rng.standard_normal(shape).astype(dtype) * 10
        values.reshape(-1)[rng.integers(0, values.size, 12)] = rng.choice(special, 12)
        feeds[name] = values
    constants = [onnx.numpy_helper.from_array(np.array(v, dtype).reshape(r), f"c{k}")
                 for k, (v, r) in enumerate([(0.5, ()), (-3.0, (1,)), (0.044715, ()), (-0.0, ()), (1e-40, ())])]
    available, nodes = ["x", "y", "z"], []
    for k in range(int(rng.integers(3, 14))):
        op = str(rng.choice(["Add", "Sub", "Mul", "Div", "Neg"]))
        a = str(rng.choice(available))
        b = str(rng.choice(available + [c.name for c in constants]))
        if rng.random() < 0.3:
            a, b = b, a
        if a.startswith("c") and b.startswith("c"):
            b = "x"
        if op == "Neg" and a.startswith("c"):
            a = "y"
        nodes.append(helper.make_node(op, [a] if op == "Neg" else [a, b], [f"v{k}"]))
        available.append(f"v{k}")
    outputs = [helper.make_tensor_value_info(v, elem, None) for v in available[3:][-3:]]
    model = _elementwise_model(nodes, [helper.make_tensor_value_info(n, elem, shape) for n in "xyz"], outputs,
                               constants)
    rewritten, count = fused_elementwise(model)
    assert count >= 2 and sum(n.op_type == "Elementwise" for n in rewritten.graph.node) >= 1, nodes
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _ort_run(rewritten, feeds)
    finally:
        torch.set_num_threads(previous)
    want = _ort_run(model, feeds, fused_kernels=False)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert np.array_equal(np.isnan(g), np.isnan(w))
        both = ~np.isnan(w)
        assert g[both].tobytes() == w[both].tobytes(), seed


def test_fused_elementwise_keeps_a_nan_payload_as_the_nodes_do():
    import numpy as np
    from onnx import TensorProto, helper

    from aot2onnx.runtime.rewrites import fused_elementwise

    x = np.linspace(-3, 3, 64, dtype=np.float32)
    x.view(np.uint32)[5] = 0x7FC12345  # a quiet NaN with a payload
    x.view(np.uint32)[6] = 0xFFC00001
    nodes = [helper.make_node("Mul", ["x", "x"], ["a"]), helper.make_node("Add", ["a", "x"], ["b"]),
             helper.make_node("Neg", ["b"], ["c"])]
    model = _elementwise_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64])],
                               [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)])
    rewritten, count = fused_elementwise(model)
    assert count == 3
    assert _ort_run(rewritten, {"x": x})[0].tobytes() == _ort_run(model, {"x": x}, False)[0].tobytes()


def test_fused_elementwise_writes_an_output_into_its_inputs_memory_after_reading_it():
    """A compiled optimizer's step binds a parameter's new value to the parameter's memory (runtime/inplace.py).
    The fused chain computes ``a = p * 0.9`` (bound to p) and then ``b = p + g``, which reads p at the same
    positions: it must read the old p. Bound so, both outputs are the unbound run's bit for bit (70000 elements:
    blocks on two threads): ``a`` copied after the block's reads, ``b`` (memory of its own) written where the
    chain computes it."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    from aot2onnx.runtime.rewrites import fused_elementwise

    shape = [7, 10000]
    nodes = [helper.make_node("Mul", ["p", "c"], ["a"]), helper.make_node("Add", ["p", "g"], ["t"]),
             helper.make_node("Mul", ["t", "t"], ["b"])]
    model = _elementwise_model(
        nodes, [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("p", "g")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("a", "b")],
        [onnx.numpy_helper.from_array(np.array(0.9, np.float32), "c")])
    rewritten, count = fused_elementwise(model)
    assert count == 3
    rng = np.random.default_rng(0)
    p, g = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    want = _ort_run(model, {"p": p, "g": g}, False)
    session = _cpu_session(rewritten)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(2):
            memory, b = p.copy(), np.empty_like(p)
            binding = session.io_binding()
            binding.bind_input("p", "cpu", 0, np.float32, shape, memory.ctypes.data)
            binding.bind_input("g", "cpu", 0, np.float32, shape, g.ctypes.data)
            binding.bind_output("a", "cpu", 0, np.float32, shape, memory.ctypes.data)
            binding.bind_output("b", "cpu", 0, np.float32, shape, b.ctypes.data)
            session.run_with_iobinding(binding)
            assert memory.tobytes() == want[0].tobytes() and b.tobytes() == want[1].tobytes()
    finally:
        torch.set_num_threads(previous)


def test_fused_elementwise_regions_stay_in_order_and_keep_what_others_read():
    """Which nodes a region takes: a chain and a sibling reading the same tensor; not a node reading a value computed
    after the region's first node outside it (a Tanh of the region's result: fused, the graph would have a cycle),
    a broadcast operand, an integer tensor, a constant of higher rank. A region's value that another node, a
    subgraph or the graph's outputs read is an output of the fused node; the others stay inside."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    from aot2onnx.runtime.rewrites import fused_elementwise

    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Mul", ["x", "half"], ["m0"]),  # region A (sibling of the chain below: reads x)
        helper.make_node("Mul", ["x", "x"], ["sq"]),  # region A
        helper.make_node("Mul", ["sq", "x"], ["cube"]),  # region A
        helper.make_node("Add", ["cube", "x"], ["inner"]),  # region A; read by the Tanh: an output
        helper.make_node("Tanh", ["inner"], ["t"]),
        helper.make_node("Add", ["t", "one"], ["t1"]),  # reads t, computed after A began: region B
        helper.make_node("Mul", ["m0", "t1"], ["out"]),  # region B (m0 from A, before B)
        helper.make_node("Add", ["x", "col"], ["bcast"]),  # [2, 3] + [2, 1]: not fused
        helper.make_node("Add", ["bcast", "x"], ["b2"]),  # reads a broadcast result: alone, not fused
        helper.make_node("Mul", ["i", "i"], ["isq"]),  # int64: not fused
        helper.make_node("Mul", ["x", "wide"], ["w"]),  # a [1, 1, 1] constant: broadcasts x up a rank
    ]
    model = _elementwise_model(
        nodes,
        [helper.make_tensor_value_info("x", f, [2, 3]), helper.make_tensor_value_info("col", f, [2, 1]),
         helper.make_tensor_value_info("i", TensorProto.INT64, [2, 3])],
        [helper.make_tensor_value_info(n, TensorProto.INT64 if n == "isq" else f, None)
         for n in ("out", "b2", "isq", "w", "sq")],
        [onnx.numpy_helper.from_array(np.array(0.5, np.float32), "half"),
         onnx.numpy_helper.from_array(np.array([1.0], np.float32), "one"),
         onnx.numpy_helper.from_array(np.ones((1, 1, 1), np.float32), "wide")],
        [helper.make_tensor_value_info("bcast", f, [2, 3]), helper.make_tensor_value_info("t", f, [2, 3])])
    rewritten, count = fused_elementwise(model)
    fused = [n for n in rewritten.graph.node if n.op_type == "Elementwise"]
    assert count == 6 and len(fused) == 2
    a, b = fused
    assert list(a.output) == ["m0", "sq", "inner"]  # m0 (read by B), sq (a graph output), inner (read by Tanh)
    assert list(b.output) == ["out"]
    assert [n.op_type for n in rewritten.graph.node] == ["Elementwise", "Tanh", "Elementwise", "Add", "Add",
                                                        "Mul", "Mul"]
    feeds = {"x": np.array([[1.5, -2.0, 0.25], [3.0, -0.0, 7.0]], np.float32),
             "col": np.array([[1.0], [2.0]], np.float32), "i": np.arange(6).reshape(2, 3)}
    for g, w in zip(_ort_run(rewritten, feeds), _ort_run(model, feeds, False)):
        assert g.shape == w.shape and g.tobytes() == w.tobytes()
    known = {"x", "col", "i", "half", "one", "wide"}
    for node in rewritten.graph.node:  # in order: each node reads what earlier ones computed
        assert set(node.input) <= known, node
        known |= set(node.output)


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_elementwise_takes_tanhs_guard_with_onnx_runtimes_bits(threads):
    """The float32 tanh lowering's guard, Where(GreaterOrEqual(Abs(x), 2^-12), Tanh(x), x), joins the chain after it
    as one instruction and its Abs and GreaterOrEqual go: the same bits as the nodes at 2^-12 and its neighbours,
    signed zeros, subnormals, infinities and NaN payloads (70000 elements: blocks on two threads). A guard whose
    compare another node reads, or with another bound, stays as it is."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    from aot2onnx.runtime.rewrites import fused_elementwise

    def guard(x: str, out: str, bound: str = "small") -> list:
        return [helper.make_node("Tanh", [x], [f"{out}_t"]), helper.make_node("Abs", [x], [f"{out}_a"]),
                helper.make_node("GreaterOrEqual", [f"{out}_a", bound], [f"{out}_ge"]),
                helper.make_node("Where", [f"{out}_ge", f"{out}_t", x], [out])]

    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Mul", ["x", "c"], ["inner"]), *guard("inner", "g"),
        helper.make_node("Add", ["g", "one"], ["g1"]), helper.make_node("Mul", ["g1", "x"], ["out"]),
        *guard("x", "h"), helper.make_node("Add", ["h", "one"], ["h1"]),  # h_ge is also an output: stays
        *guard("x", "k", "other"), helper.make_node("Add", ["k", "one"], ["k1"]),  # another bound: stays
    ]
    shape = [7, 10000]
    model = _elementwise_model(
        nodes, [helper.make_tensor_value_info("x", f, shape)],
        [helper.make_tensor_value_info(n, TensorProto.BOOL if n == "h_ge" else f, None)
         for n in ("out", "h1", "h_ge", "k1")],
        [onnx.numpy_helper.from_array(np.array(v, np.float32), n)
         for n, v in (("c", 0.75), ("one", 1.0), ("small", 2.0**-12), ("other", 2.0**-11))],
        [helper.make_tensor_value_info(f"{g}_t", f, shape) for g in "ghk"])
    rewritten, count = fused_elementwise(model)
    ops = [n.op_type for n in rewritten.graph.node]
    assert ops.count("Abs") == 2 and ops.count("GreaterOrEqual") == 2 and ops.count("Where") == 2, ops
    first = next(n for n in rewritten.graph.node if n.op_type == "Elementwise" and "out" in n.output)
    assert 5 in list(onnx.helper.get_attribute_value(first.attribute[0]))[::3]  # the KeepSmall instruction
    read = {i for n in rewritten.graph.node for i in n.input}
    assert {i.name for i in rewritten.graph.initializer} <= read  # the bound went with the last compare reading it
    assert "small" in read and "other" in read  # the guards left standing still read theirs

    # A bound that is also a graph input is a default a caller may replace: that guard stays.
    overridable = onnx.ModelProto()
    overridable.CopyFrom(model)
    overridable.graph.input.append(helper.make_tensor_value_info("small", f, []))
    kept_ops = [n.op_type for n in fused_elementwise(overridable)[0].graph.node]
    assert kept_ops.count("Abs") == 3 and kept_ops.count("Where") == 3, kept_ops

    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    edge = np.float32(2.0**-12) / np.float32(0.75)  # inner = x * 0.75 lands on the bound
    special = np.array([2.0**-12, np.nextafter(np.float32(2.0**-12), np.float32(0)), np.nextafter(np.float32(2.0**-12), np.float32(1)),
                        -(2.0**-12), edge, -edge, np.nextafter(edge, np.float32(0)), 0.0, -0.0, 1e-40, -1e-40, np.inf,
                        -np.inf, 3.5e-4, -3e-4, 1e-5], np.float32)
    flat = x.reshape(-1)
    flat[: special.size] = special
    flat[-special.size:] = special
    flat.view(np.uint32)[100] = 0x7FC12345  # a quiet NaN with a payload
    flat.view(np.uint32)[101] = 0xFFC00001
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _ort_run(rewritten, {"x": x})
    finally:
        torch.set_num_threads(previous)
    want = _ort_run(model, {"x": x}, False)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and g.tobytes() == w.tobytes()


def test_gpt2s_gelu_trains_with_fused_chains_as_without():
    """Hugging Face's GPT-2 GELU written out (gelu_new): forward and gradients bit for bit with the chains fused
    and without, within tolerance of eager's."""
    import math

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(32, 128), torch.nn.Linear(128, 32)

        def forward(self, x):
            h = self.up(x)
            h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
            return self.down(h).pow(2).mean()

    _trains_as_without_the_rewrite("fused_elementwise", lambda: (Mlp(), torch.randn(4, 16, 32) * 3), at_least=6,
                                   loss_atol=1e-6)


def test_inferred_shapes_keep_symbolic_sizes():
    """The library's shape inference names a symbolic size (ONNX Runtime's C++ helper wrote it as -2, which
    ONNX Runtime 1.32 refuses, and the output was left without a shape): outputs of a select, a max pooling with
    indices and a layer norm on inputs of symbolic sizes have their rank, their known sizes and a symbol for each
    other."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from aot2onnx.signature import FUSED_DOMAIN

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "h", "w"])
    c = helper.make_tensor_value_info("c", TensorProto.BOOL, ["n", 1, 1, "w"])
    outputs = [helper.make_tensor_value_info(name, t, None) for name, t in (
        ("picked", TensorProto.FLOAT), ("pooled", TensorProto.FLOAT), ("indices", TensorProto.INT64),
        ("normed", TensorProto.FLOAT), ("mean", TensorProto.FLOAT), ("rstd", TensorProto.FLOAT))]
    nodes = [
        helper.make_node("Where", ["c", "x", "x"], ["picked"], domain=FUSED_DOMAIN),
        helper.make_node("MaxPoolWithIndices", ["x"], ["pooled", "indices"], domain=FUSED_DOMAIN, kernel_size=[2, 2],
                         stride=[2, 2], padding=[0, 0], dilation=[1, 1], ceil_mode=0),
        helper.make_node("LayerNorm", ["x"], ["normed", "mean", "rstd"], domain=FUSED_DOMAIN, normalized_shape=[4],
                         eps=(1e-5).hex()),
    ]
    model = helper.make_model(helper.make_graph(nodes, "g", [x, c], outputs),
                              opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(FUSED_DOMAIN, 1)],
                              ir_version=9)
    options = ort.SessionOptions()
    options.register_custom_ops_library(fused.library())
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    shapes = {o.name: o.shape for o in session.get_outputs()}
    assert shapes["picked"] == ["n", 3, "h", "w"]
    for name in ("pooled", "indices"):
        assert len(shapes[name]) == 4 and shapes[name][:2] == ["n", 3], shapes
        assert all(isinstance(d, str) and d for d in shapes[name][2:]), shapes
    assert shapes["mean"] == ["n", 3, "h", 1], shapes
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3, 6, 4)).astype(np.float32),
             "c": np.ones((2, 1, 1, 4), dtype=bool)}
    picked, pooled, indices, *_ = session.run(None, feeds)
    assert picked.shape == (2, 3, 6, 4) and pooled.shape == indices.shape == (2, 3, 3, 2)


def test_max_pooling_is_fused_where_its_indices_are_read():
    """A training forward saves the pooling's indices for its backward: it runs ATen's kernel (eager's values,
    its -0.0 then 0.0 window's -0.0 included, and eager's gradient). An inference graph reads no indices: it keeps
    ONNX Runtime's MaxPool without them, several times faster than ATen's kernel, which computes them."""
    x = torch.tensor([[[-0.0, 0.0, 0.0, -0.0, -1.0, -0.0, 3.0, NAN]]])
    fn = lambda t: F.max_pool1d(t, 2, stride=1) * 2  # noqa: E731
    compiled = torch.compile(fn, backend="aot2onnx", options={"cache": False, "fallback": False})
    torch._dynamo.reset()
    aot2onnx.reset_compiled_graphs()
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    ye, yc = fn(xe), compiled(xc)
    assert _same(yc, ye)
    ye.sum().backward()
    yc.sum().backward()
    assert _same(xc.grad, xe.grad)
    forward = next(g for g in compiled_graphs() if g.kind.value == "forward")
    assert forward.op_counts.get("MaxPoolWithIndices") == 1, dict(forward.op_counts)
    torch._dynamo.reset()
    with torch.no_grad():
        compiled(x)
    inference = compiled_graphs()[-1]
    assert inference.kind.value == "inference" and "MaxPoolWithIndices" not in inference.op_counts, dict(
        inference.op_counts)


def _product_model(nodes, inputs, output_rank: int, dtype=None):
    from onnx import TensorProto, helper

    elem = dtype or TensorProto.FLOAT
    graph = helper.make_graph(
        nodes, "products", [helper.make_tensor_value_info(n, elem, list(s)) for n, s in inputs],
        [helper.make_tensor_value_info("y", elem, [None] * output_rank)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(FUSED_DOMAIN, 1)],
                             ir_version=9)


def _mm(inputs, **attributes):
    from onnx import helper

    attributes = {"trans_a": 0, "trans_b": 0, "alpha": (1.0).hex(), "beta": (1.0).hex(), **attributes}
    return helper.make_node("Mm", inputs, ["y"], domain=FUSED_DOMAIN, **attributes)


@pytest.mark.parametrize(("case", "node", "inputs", "rank", "becomes"), [
    ("mm", _mm(["a", "b"]), [("a", (6, 16)), ("b", (16, 5))], 2, ["Gemm"]),
    ("addmm_transposed", _mm(["a", "b", "c"], trans_a=1, trans_b=1), [("a", (16, 6)), ("b", (5, 16)), ("c", (5,))], 2,
     ["Gemm"]),
    ("addmm_scaled", _mm(["a", "b", "c"], alpha=(-3.0).hex(), beta=(0.5).hex()),
     [("a", (6, 16)), ("b", (16, 5)), ("c", (6, 5))], 2, ["Gemm"]),
    ("bmm_transposed", _mm(["a", "b"], trans_b=1), [("a", (3, 6, 16)), ("b", (3, 5, 16))], 3, ["Transpose", "MatMul"]),
    # Not the same computation, or not known well enough: ATen's product stays.
    ("beta_zero", _mm(["a", "b", "c"], beta=(0.0).hex()), [("a", (6, 16)), ("b", (16, 5)), ("c", (5,))], 2, ["Mm"]),
    ("alpha_not_float32", _mm(["a", "b"], alpha=(0.1).hex()), [("a", (6, 16)), ("b", (16, 5))], 2, ["Mm"]),
    ("baddbmm", _mm(["a", "b", "c"]), [("a", (3, 6, 16)), ("b", (3, 16, 5)), ("c", (3, 6, 5))], 3, ["Mm"]),
])
def test_standard_products_compute_the_fused_products(case, node, inputs, rank, becomes):
    """The thread trial's candidate with ONNX Runtime's own products (rewrites.standard_products): each product it
    rewrites computes what ATen's does, in MLAS's summation order (within float32 rounding); the others stay."""
    import onnxruntime as ort

    from aot2onnx.runtime import fused, rewrites

    if fused.library() is None:
        pytest.skip("the fused kernels are not built on this machine")
    model = _product_model([node], inputs, rank)
    standard, count = rewrites.standard_products(model)
    assert [n.op_type for n in standard.graph.node] == becomes and count == (becomes != ["Mm"])
    feeds = {name: _operand(torch.float32, False, k, shape).numpy() for k, (name, shape) in enumerate(inputs)}
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(fused.library()))
    results = [ort.InferenceSession(m.SerializeToString(), so).run(None, feeds)[0] for m in (model, standard)]
    torch.testing.assert_close(torch.from_numpy(results[1]), torch.from_numpy(results[0]), rtol=1e-5, atol=1e-5)


def test_standard_products_leave_16_bit_products_to_aten():
    from onnx import TensorProto

    from aot2onnx.runtime import rewrites

    model = _product_model([_mm(["a", "b"])], [("a", (6, 16)), ("b", (16, 5))], 2, TensorProto.FLOAT16)
    assert rewrites.standard_products(model) == (model, 0)


def test_a_linear_layers_backward_reads_its_weight_as_eager_does():
    """The backward graph's ``t(t(w))`` (the forward's view of the weight recomputed, transposed again) is read
    as the weight itself, as eager's AddmmBackward passes it: no Transpose copied per step, eager's bits."""
    torch._dynamo.reset()
    layer = torch.nn.Linear(16, 8)
    x = _values(torch.float32, False, 0, (6, 16))
    grads = []
    for compiled in (False, True):
        layer.zero_grad(set_to_none=True)
        xc = x.clone().requires_grad_()
        f = torch.compile(layer, backend="aot2onnx", options={"cache": False, "fallback": False}) if compiled else layer
        f(xc).mul(torch.linspace(-1, 1, 48).reshape(6, 8)).sum().backward()
        grads.append((xc.grad, layer.weight.grad, layer.bias.grad))
    backward = [g for g in compiled_graphs() if g.kind.value == "backward"][-1]
    assert backward.op_counts.get("Mm", 0) == 2 and "Transpose" not in backward.op_counts, dict(backward.op_counts)
    for e, a in zip(*grads, strict=True):
        assert _same(a, e), (a - e).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_max_pooling_kernel_is_atens_over_random_windows(dtype):
    """The library's own 2-D max pooling (ATen's loop and rule without ATen's branch) against ATen's
    max_pool2d_with_indices, bit for bit in values and indices: windows of every kind (padded, dilated, strided
    past the kernel, ceil mode), over values drawn from a few integers, zeros of both signs, infinities and NaN,
    so that ties, all -inf windows and several NaN in one window are common."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    pool = np.array([-2.0, -1.0, -0.0, 0.0, 1.0, 2.0, np.inf, -np.inf, np.nan])
    elem = TensorProto.FLOAT if dtype == torch.float32 else TensorProto.DOUBLE
    cases = 0
    while cases < 40:
        kernel = rng.integers(1, 4, 2).tolist()
        dilation = rng.integers(1, 3, 2).tolist()
        stride = rng.integers(1, 4, 2).tolist()
        padding = [int(rng.integers(0, ((k - 1) * d + 1) // 2 + 1)) for k, d in zip(kernel, dilation)]
        ceil_mode = bool(rng.integers(0, 2))
        shape = (int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.integers(3, 9)), int(rng.integers(3, 21)))
        x = torch.from_numpy(rng.choice(pool, size=shape)).to(dtype)
        try:
            expected = aten.max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil_mode)
        except RuntimeError:  # an output size of 0: not a window eager computes
            continue
        node = helper.make_node("MaxPoolWithIndices", ["x"], ["v", "i"], domain=FUSED_DOMAIN, kernel_size=kernel,
                                stride=stride, padding=padding, dilation=dilation, ceil_mode=int(ceil_mode))
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", elem, list(shape))],
                                  [helper.make_tensor_value_info("v", elem, None),
                                   helper.make_tensor_value_info("i", TensorProto.INT64, None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                        helper.make_opsetid(FUSED_DOMAIN, 1)], ir_version=9)
        options = ort.SessionOptions()
        options.register_custom_ops_library(fused.library())
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        values, indices = (torch.from_numpy(a) for a in session.run(None, {"x": x.numpy()}))
        config = (shape, kernel, stride, padding, dilation, ceil_mode)
        assert _same(values, expected[0]), config
        assert torch.equal(indices, expected[1]), config
        cases += 1


def test_attention_with_masked_rows_runs_the_fused_safe_softmax():
    """scaled_dot_product_attention's math formulation (the capture's) keeps its _safe_softmax whole as one fused
    node: a query whose every key is masked gets 0 and a zero gradient, as in eager (compared with eager's math
    formulation: eager's fused CPU kernel rounds otherwise), not NaN."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch._dynamo.reset()
    q, k, v = (_values(torch.float32, False, seed, (2, 3, 5, 8)) for seed in range(3))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    mask[1] = False  # query 1 sees no key

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    results = []
    for compiled in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        f = torch.compile(attend, backend="aot2onnx", options={"cache": False, "fallback": False}) if compiled else attend
        with sdpa_kernel(SDPBackend.MATH):
            out = f(*leaves)
        out.mul(torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        results.append((out.detach(), *(t.grad for t in leaves)))
    forward = [g for g in compiled_graphs() if g.kind.value == "forward"][-1]
    assert forward.op_counts.get("SafeSoftmax", 0) == 1 and "ReduceMin" not in forward.op_counts, dict(forward.op_counts)
    for e, a in zip(*results, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
    assert (results[1][0][:, :, 1] == 0).all()


def _scatter_scale_model(data_shape, axis, index_shape, factor_shape, elem_type, factor_first, fused_node):
    """Mul(ScatterElements(zeros, indices, updates), factor), as the two standard nodes or as the fused one."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    dtype = np.float32 if elem_type == TensorProto.FLOAT else np.float64
    zeros = numpy_helper.from_array(np.zeros(data_shape, dtype), "zeros")
    inputs = [helper.make_tensor_value_info("indices", TensorProto.INT64, index_shape),
              helper.make_tensor_value_info("updates", elem_type, index_shape),
              helper.make_tensor_value_info("factor", elem_type, factor_shape)]
    if fused_node:
        nodes = [helper.make_node("ScatterScale", ["zeros", "indices", "updates", "factor"], ["y"], domain=FUSED_DOMAIN,
                                  axis=axis, factor_first=int(factor_first))]
    else:
        nodes = [helper.make_node("ScatterElements", ["zeros", "indices", "updates"], ["s"], axis=axis),
                 helper.make_node("Mul", ["factor", "s"] if factor_first else ["s", "factor"], ["y"])]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", elem_type, data_shape)], [zeros])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(FUSED_DOMAIN, 1)],
                             ir_version=9)


SCATTER_SCALES = [
    ([256, 1024], 1, [256, 1], [256, 1], False),  # nll_loss_backward's: one target a row, a weight a row
    ([256, 1024], 1, [256, 1], [], True),  # a scalar factor, first
    ([6, 5, 7], 2, [6, 5, 2], [6, 1, 1], False),  # two values a row, a factor per batch
    ([6, 5, 7], 1, [4, 3, 7], [5, 7], True),  # a middle axis, indices smaller than the data, a factor per element
    ([9, 4], 0, [3, 4], [1, 4], False),  # the first axis
    ([300, 130], 1, [300, 1], [300, 130], False),  # a factor of the data's shape: rows shared among threads
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("data_shape,axis,index_shape,factor_shape,factor_first", SCATTER_SCALES, ids=str)
def test_the_fused_scatter_scale_gives_onnx_runtimes_bits(data_shape, axis, index_shape, factor_shape, factor_first,
                                                           threads):
    """ScatterScale gives ScatterElements then Mul's bits: float32 and float64, negative indices, factors with
    NaN (a payload), infinities, signed zeros (0 times them is NaN, -0.0, +0.0 as in the Mul), scattered NaN and
    -0.0, on one thread and two. Duplicate indices are left out: ONNX leaves their result undefined."""
    import numpy as np
    from onnx import TensorProto

    rng = np.random.default_rng(0)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for elem_type, dtype in ((TensorProto.FLOAT, np.float32), (TensorProto.DOUBLE, np.float64)):
            size = data_shape[axis]
            full = list(index_shape)
            full[axis] = size
            indices = np.take(np.argsort(rng.random(full), axis=axis), range(index_shape[axis]), axis=axis)
            indices -= size * (rng.random(index_shape) < 0.5)  # negative ones count from the end
            updates = rng.standard_normal(index_shape).astype(dtype)
            factor = rng.standard_normal(factor_shape).astype(dtype)
            flat_u, flat_f = updates.reshape(-1), factor.reshape(-1)
            # A scattered NaN where the factor is not NaN (the last update, away from the factor's special values
            # first): where both operands are NaN, which one a product returns is the compiler's choice.
            flat_u[[0, -1]] = [-0.0, np.nan]
            specials = [np.nan, np.inf, -np.inf, -0.0, 0.0, -1.0] if flat_f.size > 1 else [-0.0]
            flat_f[:len(specials)] = specials[:flat_f.size]
            if dtype == np.float32 and flat_f.size > 1:
                flat_f.view(np.uint32)[0] |= 0x1234  # a NaN payload
            feeds = {"indices": indices, "updates": updates, "factor": factor}
            got = _cpu_session(_scatter_scale_model(data_shape, axis, index_shape, factor_shape, elem_type,
                                                    factor_first, True)).run(None, feeds)[0]
            want = _cpu_session(_scatter_scale_model(data_shape, axis, index_shape, factor_shape, elem_type,
                                                     factor_first, False)).run(None, feeds)[0]
            assert got.dtype == want.dtype and got.shape == want.shape == tuple(data_shape)
            assert got.tobytes() == want.tobytes(), (elem_type, data_shape, axis)
    finally:
        torch.set_num_threads(previous)


def test_the_fused_scatter_scale_refuses_an_index_out_of_range_and_data_that_is_not_zero():
    import numpy as np
    from onnx import TensorProto, numpy_helper

    model = _scatter_scale_model([4, 5], 1, [4, 1], [4, 1], TensorProto.FLOAT, False, True)
    feeds = {"indices": np.full((4, 1), 5), "updates": np.ones((4, 1), np.float32),
             "factor": np.ones((4, 1), np.float32)}
    with pytest.raises(Exception, match="index out of range"):
        _cpu_session(model).run(None, feeds)
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.full((4, 5), -0.0, np.float32), "zeros"))
    feeds["indices"] = np.zeros((4, 1), np.int64)
    with pytest.raises(Exception, match=r"not \+0.0 throughout"):
        _cpu_session(model).run(None, feeds)


def test_scatters_into_zeros_times_a_factor_are_fused_where_nothing_else_reads_them():
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from aot2onnx.runtime.rewrites import fused_scatter_scales

    model = _scatter_scale_model([8, 16], 1, [8, 1], [8, 1], TensorProto.FLOAT, True, False)
    rewritten, count = fused_scatter_scales(model)
    assert count == 1 and [(n.op_type, n.domain) for n in rewritten.graph.node] == [("ScatterScale", FUSED_DOMAIN)]
    fused_node = rewritten.graph.node[0]
    assert list(fused_node.input) == ["zeros", "indices", "updates", "factor"] and list(fused_node.output) == ["y"]
    assert {a.name: a.i for a in fused_node.attribute} == {"axis": 1, "factor_first": 1}
    # Left alone: the scatter read by another node too, returned, or its data not +0.0 throughout.
    shared = _scatter_scale_model([8, 16], 1, [8, 1], [8, 1], TensorProto.FLOAT, False, False)
    shared.graph.node.append(helper.make_node("Neg", ["s"], ["z"]))
    shared.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [8, 16]))
    returned = _scatter_scale_model([8, 16], 1, [8, 1], [8, 1], TensorProto.FLOAT, False, False)
    returned.graph.output.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, [8, 16]))
    negative_zeros = _scatter_scale_model([8, 16], 1, [8, 1], [8, 1], TensorProto.FLOAT, False, False)
    negative_zeros.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.full((8, 16), -0.0, np.float32), "zeros"))
    for model in (shared, returned, negative_zeros):
        assert fused_scatter_scales(model) == (model, 0)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_cross_entropy_loss_trains_with_its_gradient_fused_as_without(reduction):
    """A classifier's cross-entropy (ignored targets, class weights): the loss and gradients are the same bits with
    the nll gradient's scatter and Mul fused and without, within tolerance of eager's."""

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(16, 40)
            self.register_buffer("weight", torch.rand(40) + 0.5)

        def forward(self, x):
            logits = self.head(x[..., :16]).reshape(-1, 40)
            target = x[..., 16].reshape(-1).long()
            return F.cross_entropy(logits, target, weight=self.weight, ignore_index=3, reduction=reduction)

    def make():
        x = torch.randn(4, 24, 17)
        x[..., 16] = torch.randint(0, 40, (4, 24)).float()
        x[0, :5, 16] = 3  # ignored
        return Classifier(), x

    _trains_as_without_the_rewrite("fused_scatter_scales", make, at_least=0, loss_atol=1e-5)
    torch._dynamo.reset()
    aot2onnx.reset_compiled_graphs()
    model, x = make()
    torch.compile(model, backend="aot2onnx", options={"cache": False, "fallback": False})(x).backward()
    assert [g.fused_scatter_scales for g in compiled_graphs()] == [0, 1]  # the backward graph's
