"""Rules for ops the OpInfo sweep missed (issue 41): im2col/col2im (unfold, fold), the chunked
linear_cross_entropy, replication padding with negative pads, nonzero_static, segment_reduce. Each is compared
with eager, outputs and gradients; the chunked loss is also checked for what it promises: no [N, vocab]
intermediate in the lowered graphs."""

from __future__ import annotations

import contextlib
import importlib
import math
from unittest import mock

import onnx
import pytest
import torch
import torch.nn.functional as F

import aot2onnx  # noqa: F401  (the "aot2onnx" backend)

_translate = importlib.import_module("aot2onnx.lower.translate")
_backend = importlib.import_module("aot2onnx.compile.backend")


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot2onnx", dynamic=False, options={"fallback": False, "cache": False})


@contextlib.contextmanager
def _lowered_models():
    """The ONNX models lowered inside the block, in order."""
    models, lower = [], _translate.lower_graph

    def recording(gm, **kwargs):
        lowered = lower(gm, **kwargs)
        models.append(lowered.model)
        return lowered

    with contextlib.ExitStack() as stack:
        for module in (_translate, _backend):
            if hasattr(module, "lower_graph"):
                stack.enter_context(mock.patch.object(module, "lower_graph", recording))
        yield models


def _grads(fn, inputs, cotangent_seed=3):
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*leaves)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(cotangent_seed)).to(out.dtype)
    grads = torch.autograd.grad(out, [x for x in leaves if x.requires_grad], cot)
    return out.detach(), grads


_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize(("shape", "args"), [
    ((2, 3, 7, 6), ((2, 3), (1, 2), (1, 0), (2, 1))),
    ((3, 7, 6), (3, 1, 1, 2)),  # unbatched
    ((0, 1, 5, 5), (2, 1, 0, 1)),  # an empty batch
])
def test_unfold_and_fold_are_eagers_bits(dtype, shape, args):
    # im2col gathers and col2im adds in ATen's order (rounding each add for 16-bit floats): bit for bit.
    x = torch.randn(shape).to(dtype)
    unfold = lambda x: F.unfold(x, *args)
    expected, expected_grads = _grads(unfold, [x])
    actual, actual_grads = _grads(_compiled(unfold), [x])
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    torch.testing.assert_close(actual_grads, expected_grads, rtol=0, atol=0)
    cols = torch.randn(expected.shape).to(dtype)
    fold = lambda c: F.fold(c, shape[-2:], *args)
    expected, expected_grads = _grads(fold, [cols])
    actual, actual_grads = _grads(_compiled(fold), [cols])
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    torch.testing.assert_close(actual_grads, expected_grads, rtol=0, atol=0)


def _options(chunk: int):
    from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions

    return LinearCrossEntropyOptions(batch_chunk_size=chunk, allow_retain_graph=True)


def _value_shapes(graph: onnx.GraphProto):
    """The static shapes of every value of ``graph`` and of its subgraphs (Loop bodies)."""
    for value in [*graph.input, *graph.output, *graph.value_info]:
        dims = value.type.tensor_type.shape.dim
        if value.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            yield value.name, [d.dim_value for d in dims]
    for tensor in graph.initializer:
        yield tensor.name, list(tensor.dims)
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _value_shapes(attribute.g)


@pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"), reason="torch.nn.functional.linear_cross_entropy is new in torch 2.13")
@pytest.mark.parametrize(("reduction", "bias", "class_weight", "ignore_index"), [
    ("mean", False, False, None),
    ("mean", True, True, 3),  # an ignored class inside the vocabulary
    ("sum", True, False, -100),
    ("none", False, True, None),
    ("none", True, False, 3),
])
def test_chunked_linear_cross_entropy(reduction, bias, class_weight, ignore_index):
    n, hidden, vocab, chunk = 70, 8, 50, 16  # 5 chunks, the last one short
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(n, hidden, generator=g), torch.randn(vocab, hidden, generator=g)
    b = torch.randn(vocab, generator=g) if bias else None
    weight = torch.rand(vocab, generator=g) + 0.5 if class_weight else None
    target = torch.randint(0, vocab, (n,), generator=g)
    target[::7] = 3
    kwargs = {"reduction": reduction, "weight": weight, "options": _options(chunk)}
    if ignore_index is not None:
        kwargs["ignore_index"] = ignore_index

    def loss(x, w, *b):
        return F.linear_cross_entropy(x, w, target, linear_bias=b[0] if b else None, **kwargs)

    inputs = [x, w] + ([b] if bias else [])
    expected, expected_grads = _grads(loss, inputs)
    with _lowered_models() as models:
        actual, actual_grads = _grads(_compiled(loss), inputs)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(actual_grads, expected_grads, rtol=1e-5, atol=1e-6)

    # The chunking survives lowering: a Loop over the chunks, and no value as large as the [N, vocab] logits;
    # reduction="none"'s backward recomputes the chunks in a Loop of its own (capture/chunked_loss.py), where
    # AOTAutograd's trace of torch's backward unrolled them (890 MiB of peak RSS against 474 with the Loop on a
    # 4096 x 32000 loss in chunks of 512; eager 188).
    assert len(models) == 2, "one forward and one backward graph"
    assert any(node.op_type == "Loop" for node in models[0].graph.node)
    if reduction == "none":
        assert any(node.op_type == "Loop" for node in models[1].graph.node)
        assert not any(node.op_type in ("MatMul", "Gemm") for node in models[1].graph.node), "unrolled chunks"
    shapes = [(name, shape) for model in models
              for name, shape in _value_shapes(onnx.shape_inference.infer_shapes(model).graph)]
    chunk_logits = [name for name, shape in shapes if shape == [chunk, vocab]]
    assert chunk_logits, "the chunks' [B, vocab] logits have static shapes"
    largest = max(shapes, key=lambda s: math.prod(s[1]))
    assert math.prod(largest[1]) < n * vocab, f"{largest} is as large as the full logits [{n}, {vocab}]"


@pytest.mark.parametrize(("shape", "pad"), [
    ((2, 3, 4), (-4, 5)),  # cropped to nothing, then padded: every position copies the last element
    ((1, 2, 4, 5), (-1, 2, 3, -5)),
    ((1, 1, 3, 4, 5), (-2, 1, 0, -3, 2, -1)),
])
def test_replication_pad_with_negative_pads(shape, pad):
    x = torch.randn(shape)
    fn = lambda x: F.pad(x, pad, mode="replicate")
    expected, expected_grads = _grads(fn, [x])
    actual, actual_grads = _grads(_compiled(fn), [x])
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    # the gradient of an edge copied many times is a sum, in ONNX Runtime's order
    torch.testing.assert_close(actual_grads, expected_grads, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("size", [0, 3, 8])
def test_nonzero_static_cuts_or_fills(size):
    x = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 3.0]])
    fn = lambda x: torch.nonzero_static(x, size=size, fill_value=-7)
    torch.testing.assert_close(_compiled(fn)(x), fn(x), rtol=0, atol=0)


@pytest.mark.parametrize("reduce", ["sum", "mean", "prod", "max", "min"])
@pytest.mark.parametrize("initial", [None, 2.0])
def test_segment_reduce_with_ties_zeros_and_empty_segments(reduce, initial):
    # The cotangent has both signs: ATen's CPU kernel shares a positive gradient among tied maxima and gives
    # a negative one whole to each.
    data = torch.tensor([[1.0, 3.0, 3.0, 0.0, 2.0, 5.0, 0.0, 0.0, 4.0]] * 2).T.contiguous()  # axis 0, a column of 2
    lengths = torch.tensor([3, 2, 0, 1, 2])  # the last position is in no segment
    kwargs = {"lengths": lengths, "axis": 0, "unsafe": True}
    if initial is not None:
        kwargs["initial"] = initial
    fn = lambda d: torch.segment_reduce(d, reduce, **kwargs)
    expected, expected_grads = _grads(fn, [data])
    actual, actual_grads = _grads(_compiled(fn), [data])
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0, equal_nan=True)
    torch.testing.assert_close(actual_grads, expected_grads, rtol=1e-6, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(("length", "keys", "causal", "mask"), [
    (3, 4, False, False), (4, 3, False, False),  # a query shorter and longer than the key
    (5, 5, True, False), (6, 4, True, False),
    (4, 6, False, True),  # a float mask with a row of -inf: the kernel's output and logsumexp are 0 there
])
def test_fused_cpu_attention_and_its_logsumexp(dtype, length, keys, causal, mask):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g).to(dtype) for n in (length, keys, keys))
    attn_mask = None
    if mask:
        attn_mask = torch.randn(2, 1, length, keys, generator=g).to(dtype)
        attn_mask[0, 0, 1] = float("-inf")
    fn = lambda q, k, v: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal,
                                                                                    attn_mask=attn_mask)

    def run(f):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, logsumexp = f(*leaves)
        cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        return out.detach(), logsumexp.detach(), torch.autograd.grad(out, leaves, cot)

    expected, actual = run(fn), run(_compiled(fn))
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-14}
    torch.testing.assert_close(actual, expected, **tol)


@pytest.mark.parametrize(("mode", "kwargs"), [
    ("sum", {}),
    ("sum", {"per_sample_weights": True, "padding_idx": 2}),
    ("sum", {"include_last_offset": True}),
    ("mean", {"padding_idx": 2, "scale_grad_by_freq": True}),
    ("max", {}),
])
def test_embedding_bag_backward(mode, kwargs):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 4, generator=g, dtype=torch.float64)
    indices = torch.tensor([2, 0, 2, 5, 1, 2, 3, 3])
    offsets = torch.tensor([0, 3, 3, 6])  # an empty bag
    kwargs = dict(kwargs)
    inputs = [weight]
    if kwargs.pop("per_sample_weights", False):
        inputs.append(torch.rand(len(indices), generator=g, dtype=torch.float64))

    def fn(weight, *psw):
        return F.embedding_bag(indices, weight, offsets, mode=mode, per_sample_weights=psw[0] if psw else None, **kwargs)

    expected, expected_grads = _grads(fn, inputs)
    actual, actual_grads = _grads(_compiled(fn), inputs)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(actual_grads, expected_grads, rtol=1e-12, atol=1e-14)
