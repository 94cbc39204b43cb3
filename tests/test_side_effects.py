"""Side effects that AOTAutograd reproduces around a functional graph, checked on ONNX Runtime.

Each case runs eagerly and through aot2onnx on equal inputs and compares outputs, gradients, the inputs'
contents/shapes/strides after the call, which outputs alias what, and the inputs again after the returned
outputs are mutated (``aot2onnx.testing.assert_same_effects``). The numbers in the section titles follow
the semantics table in the README.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch_behaviour

import aot2onnx
from aot2onnx.compile.fallback import fallback_graphs, reset_fallback_graphs
from aot2onnx.testing import assert_parity, assert_same_effects


def _randn(*shape, requires_grad=False, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad)


def _leaf_clone(*shape, dtype=torch.float32):
    """A non-leaf tensor requiring grad (so it may be mutated in place) computed from a leaf."""
    return torch.randn(*shape, dtype=dtype).requires_grad_(True).clone()


# 1. Data mutations of inputs -------------------------------------------------------------------------------


def _mul_then_use(x):
    x.mul_(2)
    return x * 3


def _mul_then_use_with_w(x, w):
    x.mul_(2)
    return (x * 3) @ w


def _mutate_slice(x, w):
    x[0].add_(1)
    return x * w


def _mutate_view(x, w):
    x.view(-1).add_(1)
    return (x * w).sum(0)


@pytest.mark.parametrize(
    "fn, make_inputs",
    [
        (_mul_then_use, lambda: (_randn(3, 4),)),
        (_mul_then_use, lambda: (_leaf_clone(3, 4),)),
        (_mul_then_use_with_w, lambda: (_randn(3, 4), _randn(4, 5, requires_grad=True))),
        (_mul_then_use_with_w, lambda: (_leaf_clone(3, 4), _randn(4, 5, requires_grad=True))),
        (_mutate_slice, lambda: (_randn(3, 4), _randn(3, 4, requires_grad=True))),
        (_mutate_slice, lambda: (_leaf_clone(3, 4), _randn(3, 4, requires_grad=True))),
        (_mutate_view, lambda: (_randn(3, 4), _randn(3, 4, requires_grad=True))),
        (_mutate_view, lambda: (_leaf_clone(3, 4), _randn(3, 4, requires_grad=True))),
    ],
    ids=["mul_", "mul_-x-requires-grad", "mul_-w-requires-grad", "mul_-both-require-grad",
         "slice", "slice-requires-grad", "view", "view-requires-grad"],
)
def test_input_data_mutation(fn, make_inputs):
    assert_same_effects(fn, make_inputs)


def test_input_data_mutation_without_graph_output():
    # The mutation is the only effect: the graph returns nothing but the new value of x.
    def fn(x):
        x.add_(1)

    assert_same_effects(fn, lambda: (_randn(5),))


# 2. Metadata mutations --------------------------------------------------------------------------------------


def _t_(x):
    x.t_()
    return x * 2


def _unsqueeze_(x):
    x.unsqueeze_(0)
    return x + 1


def _t_and_mul_(x):
    x.t_()
    x.mul_(3)
    return x.sum(0)


@pytest.mark.parametrize("fn", [_t_, _unsqueeze_, _t_and_mul_], ids=["t_", "unsqueeze_", "t_+mul_"])
@pytest.mark.parametrize("requires_grad", [False, True], ids=["no-grad", "grad"])
def test_input_metadata_mutation(fn, requires_grad):
    make = (lambda: (_leaf_clone(3, 4),)) if requires_grad else (lambda: (_randn(3, 4),))
    assert_same_effects(fn, make)


# 3. Outputs that alias inputs or intermediates --------------------------------------------------------------


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, w: (x.view(-1), x * w),
        lambda x, w: (x.t(), x @ w.t()),
        lambda x, w: (x, x * w),
        lambda x, w: (x[1:], x.view(-1), x.t(), x * w),
    ],
    ids=["view", "t", "input-itself", "several-views-of-one-input"],
)
@pytest.mark.parametrize("requires_grad", [False, True], ids=["no-grad", "grad"])
def test_output_aliases_input(fn, requires_grad):
    assert_same_effects(fn, lambda: (_randn(3, 4, requires_grad=requires_grad), _randn(3, 4, requires_grad=True)))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: ((y := x * 2).view(-1), y),
        lambda x: ((y := x * 2).view(-1), y.t(), y[0]),
        lambda x: ((y := x * 2).view(-1), y.t(), y),
        lambda x: ((y := x.sin()).view(-1), y.unsqueeze(0), (y * 3).t()),
    ],
    ids=["view-and-base", "views-without-base", "views-and-base", "two-intermediates"],
)
def test_output_aliases_intermediate(fn):
    assert_same_effects(fn, lambda: (_randn(3, 4, requires_grad=True),))


# 4. Inputs that alias each other (synthetic bases) ----------------------------------------------------------


def _make_aliased_pair():
    a = _leaf_clone(3, 4)
    return a, a.view(-1)


def _make_overlapping_slices():
    base = _leaf_clone(6, 4)
    return base[0:4], base[2:6]


def test_aliased_inputs_one_mutated():
    def fn(a, b):
        a.mul_(2)
        return a.sum(0) + b.sum()

    assert_same_effects(fn, _make_aliased_pair)


def test_overlapping_slices_one_mutated():
    def fn(a, b):
        a.mul_(2)
        return a * 3 + b

    assert_same_effects(fn, _make_overlapping_slices)


def _both_mutated(a, b):
    b.add_(1)
    a.mul_(2)
    return (a * b).sum()


def test_overlapping_slices_both_mutated():
    def make():
        base = torch.randn(6, 4)
        return base[0:4], base[2:6]

    assert_same_effects(_both_mutated, make)


@pytest.mark.parametrize("backend", ["aot_eager", "aot2onnx"])
def test_overlapping_slices_both_mutated_with_grad_fails_at_compile_time(backend):
    # AOTAutograd itself (torch 2.13, any backend) cannot build the backward when two aliased inputs that
    # require grad are both mutated. It fails while compiling, never with a wrong answer; if a torch
    # release fixes it, this test fails and the README's table should be updated.
    a, b = _make_overlapping_slices()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="outs_to_grad length"):
        torch.compile(_both_mutated, backend=backend)(a, b)


# 5. Duplicate inputs and tied parameters --------------------------------------------------------------------


def test_duplicate_inputs():
    def fn(x, y):
        return x * y.sin(), (x @ y.t()).relu()

    def make():
        x = _randn(4, 4, requires_grad=True)
        return x, x

    assert_same_effects(fn, make)


def test_duplicate_inputs_one_mutated():
    def fn(x, y):
        x.mul_(2)
        return x + y

    def make():
        x = _leaf_clone(4, 4)
        return x, x

    assert_same_effects(fn, make)


class _TiedLM(torch.nn.Module):
    def __init__(self, vocab=17, dim=8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens):
        return self.head(torch.tanh(self.proj(self.embed(tokens))))


def test_tied_parameters():
    model = _TiedLM()
    assert_same_effects(model, lambda: (torch.randint(0, 17, (3, 5)),), rtol=1e-4, atol=1e-5)
    assert_parity(_TiedLM, (torch.randint(0, 17, (3, 5)),), loss_fn=lambda out: out.logsumexp(-1).mean())


# 6. Module buffers -------------------------------------------------------------------------------------------


class _Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        self.steps += 1
        y = self.lin(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * y.mean(0))
        return y * self.steps


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_batchnorm_running_stats(train):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    model.train(train)
    assert_same_effects(model, lambda: (_randn(2, 3, 8, 8),), rtol=1e-4, atol=1e-5)


def test_buffers_counter_and_no_grad_update():
    assert_same_effects(_Counter(), lambda: (_randn(3, 4),))
    report = assert_parity(_Counter, (torch.randn(3, 4),), loss_fn=lambda y: y.square().mean(), steps=5)
    assert report.ort_runs >= 10


# 7. Inference ---------------------------------------------------------------------------------------------------


def _small_model():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 5)
    )


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_inference_is_one_forward_graph(mode, train):
    torch.manual_seed(0)
    eager = _small_model().train(train)
    compiled_model = __import__("copy").deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot2onnx")
    aot2onnx.reset_compiled_graphs()
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    x = torch.randn(2, 3, 8, 8)
    with context():
        for _ in range(3):
            out_e, out_c = eager(x), compiled(x)
            torch.testing.assert_close(out_c, out_e, rtol=1e-4, atol=1e-5)
            assert not out_c.requires_grad
    for (name, b_e), (_, b_c) in zip(eager.named_buffers(), compiled_model.named_buffers()):
        torch.testing.assert_close(b_c, b_e, rtol=1e-5, atol=1e-6, msg=name)
    graphs = aot2onnx.compiled_graphs()
    assert [g.kind for g in graphs] == ["inference"], graphs
    assert graphs[0].runs == 3


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
@pytest.mark.parametrize("masks", ["none", "padding", "causal", "both"])
def test_eval_transformer_fast_path_under_no_grad(norm_first, masks):
    # In eval mode under no_grad, TransformerEncoderLayer calls torch's fused _transformer_encoder_layer_fwd,
    # which aot2onnx decomposes (aot2onnx/capture/fastpath.py) instead of failing on it.
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, norm_first=norm_first, activation="gelu")
    layer.eval()
    compiled = torch.compile(__import__("copy").deepcopy(layer), backend="aot2onnx")
    aot2onnx.reset_compiled_graphs()
    x = torch.randn(3, 7, 32)
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[0, 5:] = True
    causal = torch.nn.Transformer.generate_square_subsequent_mask(7)
    kwargs = {"none": {}, "padding": {"src_key_padding_mask": padding}, "causal": {"src_mask": causal},
              "both": {"src_mask": causal != 0, "src_key_padding_mask": padding}}[masks]
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, **kwargs), layer(x, **kwargs), rtol=1e-4, atol=1e-5)
    assert [g.kind for g in aot2onnx.compiled_graphs()] == ["inference"]


@pytest.mark.parametrize("need_weights, average", [(True, True), (True, False), (False, True)])
def test_eval_multihead_attention_fast_path_under_no_grad(need_weights, average):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    compiled = torch.compile(__import__("copy").deepcopy(mha), backend="aot2onnx")
    aot2onnx.reset_compiled_graphs()
    x = torch.randn(3, 7, 32)
    with torch.no_grad():
        out_e, w_e = mha(x, x, x, need_weights=need_weights, average_attn_weights=average)
        out_c, w_c = compiled(x, x, x, need_weights=need_weights, average_attn_weights=average)
    torch.testing.assert_close(out_c, out_e, rtol=1e-4, atol=1e-5)
    if need_weights:
        torch.testing.assert_close(w_c, w_e, rtol=1e-4, atol=1e-6)
    else:
        assert w_e is None and w_c is None
    assert [g.kind for g in aot2onnx.compiled_graphs()] == ["inference"]


# 8. Randomness ---------------------------------------------------------------------------------------------------


def test_dropout_mask_is_used_by_backward():
    p = 0.5
    dropout = torch.compile(torch.nn.Dropout(p), backend="aot2onnx")
    aot2onnx.reset_compiled_graphs()
    x = (torch.rand(100_000) + 0.5).requires_grad_()
    y = dropout(x)
    y.backward(torch.ones_like(y))
    kept = y != 0
    assert abs(kept.float().mean().item() - (1 - p)) < 0.01
    torch.testing.assert_close(y[kept], x.detach()[kept] / (1 - p))
    # The backward reuses the forward's mask: zero exactly where the output is zero, 1/(1-p) elsewhere.
    torch.testing.assert_close(x.grad, kept.float() / (1 - p), rtol=0, atol=0)
    y2 = dropout(x)
    assert not torch.equal(y2 != 0, kept), "two calls drew the same mask"
    assert {g.kind for g in aot2onnx.compiled_graphs()} == {"forward", "backward"}


class _ScaledDropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.dropout(x * 3) + 1


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no-grad", "grad"])
def test_dropout_in_eval_is_identity(requires_grad):
    # Exactly eager's result: dropout is the identity in eval mode, and x * 3 + 1 rounds the same way.
    model = _ScaledDropout().eval()
    assert_same_effects(model, lambda: (_randn(64, 8, requires_grad=requires_grad),), rtol=0, atol=0)


def test_dropout_seeds_come_from_torch_generator():
    # Seeds are drawn when a graph is compiled, from torch's generator: the same torch.manual_seed gives the
    # same masks in a fresh compile, another seed gives others.
    def masks(seed):
        torch._dynamo.reset()
        torch.manual_seed(seed)
        dropout = torch.compile(torch.nn.Dropout(0.5), backend="aot2onnx")
        x = torch.ones(1000)
        return [dropout(x) != 0 for _ in range(2)]

    first, again, other = masks(0), masks(0), masks(1)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], first[1])
    assert not torch.equal(first[0], other[0])


# 9. Dynamic shapes -----------------------------------------------------------------------------------------------


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))


def _symbolic_dims(graph) -> list[str]:
    inputs = graph.session.get_inputs()
    return [d for i in inputs for d in i.shape if isinstance(d, str)]


@pytest.mark.parametrize("how", ["dynamic=True", "mark_dynamic"])
def test_dynamic_batch_one_lowering(how):
    torch.manual_seed(0)
    eager = _mlp()
    compiled_model = __import__("copy").deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot2onnx", dynamic=True if how == "dynamic=True" else None)
    aot2onnx.reset_compiled_graphs()
    for batch in (4, 7, 16):
        x = torch.randn(batch, 8)
        x_e = x.clone().requires_grad_()
        x_c = x.clone().requires_grad_()
        if how == "mark_dynamic":
            torch._dynamo.mark_dynamic(x_c, 0)
        out_e, out_c = eager(x_e), compiled(x_c)
        torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
        cot = torch.randn_like(out_e)
        out_e.backward(cot)
        out_c.backward(cot)
        torch.testing.assert_close(x_c.grad, x_e.grad, rtol=1e-5, atol=1e-6)
        for (name, p_e), (_, p_c) in zip(eager.named_parameters(), compiled_model.named_parameters()):
            torch.testing.assert_close(p_c.grad, p_e.grad, rtol=1e-5, atol=1e-6, msg=name)
            p_e.grad = p_c.grad = None
    graphs = aot2onnx.compiled_graphs()
    assert sorted(g.kind for g in graphs) == ["backward", "forward"], graphs  # one lowering per graph
    assert all(g.runs == 3 for g in graphs)
    assert _symbolic_dims(next(g for g in graphs if g.kind == "forward"))


def test_dynamic_batch_and_sequence_transformer():
    torch.manual_seed(0)
    eager = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    compiled_model = __import__("copy").deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot2onnx", dynamic=True)
    aot2onnx.reset_compiled_graphs()
    for batch, seq in ((4, 8), (7, 5), (16, 12)):
        x = torch.randn(batch, seq, 32)
        out_e, out_c = eager(x), compiled(x)
        torch.testing.assert_close(out_c, out_e, rtol=1e-4, atol=1e-5)
        cot = torch.randn_like(out_e)
        out_e.backward(cot)
        out_c.backward(cot)
        for (name, p_e), (_, p_c) in zip(eager.named_parameters(), compiled_model.named_parameters()):
            torch.testing.assert_close(p_c.grad, p_e.grad, rtol=1e-4, atol=1e-5, msg=name)
            p_e.grad = p_c.grad = None
    graphs = aot2onnx.compiled_graphs()
    assert sorted(g.kind for g in graphs) == ["backward", "forward"], graphs
    assert all(g.runs == 3 for g in graphs)
    assert len(set(_symbolic_dims(next(g for g in graphs if g.kind == "forward")))) >= 2


# 9b. A graph's backward run twice (retain_graph=True) --------------------------------------------------------


@pytest.mark.parametrize("cache", ["on", "off"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_retain_graph_backward_twice(cache, dynamic, monkeypatch):
    # Two losses through one forward, as GANs and multi-task training do: the first backward keeps the
    # graph. With the cache on (the default), or sizes saved for the backward (dynamic), AOTAutograd compiles
    # the backward during the capture; it refused the second backward ("compiled with non-empty donated
    # buffers") where eager, aot_eager and inductor run it.
    if cache == "off":
        monkeypatch.setenv("AOT2ONNX_CACHE_DIR", "off")
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    compiled_model = __import__("copy").deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot2onnx", dynamic=dynamic)
    aot2onnx.reset_compiled_graphs()
    for batch in (5, 7):
        x = torch.randn(batch, 6)
        x_e, x_c = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_e, out_c = eager(x_e), compiled(x_c)
        for out in (out_e, out_c):
            out[:, 0].sum().backward(retain_graph=True)
            out[:, 1:].square().sum().backward(retain_graph=True)
            out.mean().backward()  # and the graph is freed after the third
        torch.testing.assert_close(x_c.grad, x_e.grad, rtol=1e-5, atol=1e-6)
        for (name, p_e), (_, p_c) in zip(eager.named_parameters(), compiled_model.named_parameters()):
            torch.testing.assert_close(p_c.grad, p_e.grad, rtol=1e-5, atol=1e-6, msg=name)
            p_e.grad = p_c.grad = None
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            out_c.sum().backward()
    graphs = aot2onnx.compiled_graphs()
    assert {g.kind for g in graphs} == {"forward", "backward"}
    assert sum(g.runs for g in graphs if g.kind == "backward") == 6


def test_double_backward_raises_torch_error():
    # create_graph=True through a compiled graph is AOTAutograd's limit, for every backend, and its error says
    # so (where the backward kept donated buffers, the error named them instead, suggesting a setting that
    # would not have helped).
    compiled = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh()), backend="aot2onnx")
    x = torch.randn(3, 4, requires_grad=True)
    (g,) = torch.autograd.grad(compiled(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="does not currently support double backward"):
        g.square().sum().backward()


# 10. Graph breaks ------------------------------------------------------------------------------------------------


class _Breaks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 6)
        self.c = torch.nn.Linear(6, 2)

    def forward(self, x):
        h = torch.relu(self.a(x))
        print("aot2onnx test: a graph break", end="\r")
        h = torch.tanh(self.b(h))
        scale = h.abs().max().item()  # a data-dependent Python float
        return self.c(h / (1.0 + scale))


def test_graph_breaks_train_like_eager():
    # Where Dynamo compiles the frame after .item() again at every step, the step that checks what torch ran
    # compiles too, and a compile runs ATen ops (tracing): that check then says nothing about the steps.
    check = not torch_behaviour.aot_autograd_recompiles_for_new_floats()
    report = assert_parity(_Breaks, (torch.randn(5, 6),), loss_fn=lambda y: y.square().mean(), steps=5,
                           check_torch_ops=check)
    # Three subgraphs around the two breaks, each with a forward and a backward graph. The one after
    # .item() is compiled again once Dynamo treats the float as dynamic; every graph ran on ONNX Runtime.
    kinds = [g.kind for g in report.graphs]
    assert kinds.count("forward") >= 3 and kinds.count("backward") >= 3, report.graphs
    assert all(g.runs >= 1 for g in report.graphs), report.graphs


# 11. A custom autograd.Function -----------------------------------------------------------------------------


class _ClippedSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, limit):
        ctx.save_for_backward(x)
        ctx.limit = limit
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        # Deliberately not the true derivative, so that using autograd's formula would show.
        return (2 * x * grad).clamp(-ctx.limit, ctx.limit), None


class _WithCustomFunction(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x):
        return _ClippedSquare.apply(self.lin(x), 0.5).sum(-1)


def test_custom_autograd_function():
    assert_same_effects(_WithCustomFunction(), lambda: (_randn(4, 6, requires_grad=True),))
    assert_parity(_WithCustomFunction, (torch.randn(4, 6),), loss_fn=lambda y: y.mean(), steps=5)


# 12. Dtypes ---------------------------------------------------------------------------------------------------


class _Float64Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.lin = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, tokens, x):
        h = torch.tanh(self.lin(self.embed(tokens) + x))
        h = F.gelu(self.norm(h), approximate="tanh") + F.silu(h)
        return F.log_softmax(self.head(h), -1)


def test_float64_model():
    # Every value stays double, including layer norm's saved statistics (ONNX Runtime's fused kernel
    # keeps them in float, so aot2onnx spells double layer norm out), hence a double-precision tolerance.
    tokens = torch.randint(0, 11, (4, 6))
    x = torch.randn(4, 6, 8, dtype=torch.float64, requires_grad=True)
    assert_parity(lambda: _Float64Net().double(), (tokens, x), loss_fn=lambda y: -y[..., 0].mean(),
                  rtol=1e-10, atol=1e-12)


def test_float64_without_kernel_fails_at_compile_time():
    # ONNX Runtime's CPU provider has no double Erf (exact GELU) and no double Conv: with fallback=False,
    # compilation fails and says which op, which dtype and which ATen node, before any step runs (by default
    # those nodes run in PyTorch, tests/test_fallback.py). The fused kernels' GELU (ATen's) takes double: the
    # standard operators here.
    model = torch.compile(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()).double(),
        backend=aot2onnx.backend(fallback=False, fused_kernels=False),
    )
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=r"no Erf kernel for inputs of type \(double\)"):
        model(torch.randn(2, 4, dtype=torch.float64))


class _Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, tokens, mask):
        h = self.lin(self.embed(tokens))  # int64 indices into float32 weights
        h = h.masked_fill(~mask[..., None], 0.0)  # bool mask
        count = mask.sum(-1, keepdim=True).clamp_min(1)  # int64 arithmetic
        return h.sum(1) / count, count


def test_mixed_dtypes():
    def make():
        return torch.randint(0, 11, (3, 5)), torch.rand(3, 5) > 0.3

    assert_same_effects(_Mixed(), make)
    tokens, mask = make()
    assert_parity(_Mixed, (tokens, mask), loss_fn=lambda out: out[0].square().mean())


# torch.linalg.inv, cholesky, solve, lu_factor... raise on a singular (or non positive-definite) input: ATen's
# _linalg_check_errors on the factorization's info, which AOTAutograd keeps as an effectful op. Its rule had
# dropped it, so the compiled call returned inf or NaN where eager raised. The runtime now runs eager's check
# on the info the graph returns, with the persistent cache too (the signature carries the check).
_SINGULAR = torch.tensor([[1.0, 2.0], [2.0, 4.0]])
_LINALG_CHECKS = {
    "inv": (torch.linalg.inv, _SINGULAR),
    "inverse": (torch.inverse, _SINGULAR),
    "inv in a batch": (lambda a: torch.linalg.inv(a) * 2, torch.stack([torch.eye(2), _SINGULAR])),
    "cholesky": (torch.linalg.cholesky, torch.tensor([[1.0, 2.0], [2.0, 1.0]])),
    "solve": (lambda a: torch.linalg.solve(a, torch.ones(2, 1)), _SINGULAR),
    "lu_factor": (lambda a: torch.linalg.lu_factor(a)[0], torch.zeros(2, 2)),
}


@pytest.mark.parametrize("case", list(_LINALG_CHECKS))
def test_linalg_errors_on_singular_input_are_eagers(case, tmp_path, monkeypatch):
    monkeypatch.setenv("AOT2ONNX_CACHE_DIR", str(tmp_path / "cache"))
    fn, a = _LINALG_CHECKS[case]
    with pytest.raises(RuntimeError) as eager:
        fn(a)
    for attempt in ("lowered", "from the cache"):
        torch._dynamo.reset()
        aot2onnx.reset_compiled_graphs()
        compiled = torch.compile(fn, backend="aot2onnx")
        with pytest.raises(type(eager.value)) as got:
            compiled(a)
        assert str(got.value) == str(eager.value), attempt
        assert aot2onnx.compiled_graphs(), "the factorization ran on ONNX Runtime"
        # A regular input still gets its values.
        regular = a + 3 * torch.eye(2)
        torch.testing.assert_close(compiled(regular), fn(regular), rtol=1e-5, atol=1e-6)


def test_effectful_graphs_train_like_eager_when_loaded_from_the_cache(tmp_path, monkeypatch):
    # A graph with an effect token (the check behind cholesky) failed its run when AOTAutograd's cache gave it
    # back, in every process after the first: the cache rebuilds no wrapper for lifted tokens, so the inputs
    # came shifted by one. Tokens are now unlifted (capture/aot.py), as for inductor.
    monkeypatch.setenv("AOT2ONNX_CACHE_DIR", str(tmp_path / "cache"))
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(3, 3, generator=g)
    weights = torch.arange(9.0).reshape(3, 3)

    def loss(w):
        return (torch.linalg.cholesky(w @ w.T + torch.eye(3)) * weights).sum() + torch.linalg.inv(w + 3 * torch.eye(3)).sum()

    w_e = w0.clone().requires_grad_(True)
    loss(w_e).backward()
    for attempt in ("lowered", "from the cache"):
        torch._dynamo.reset()
        aot2onnx.reset_compiled_graphs()
        reset_fallback_graphs()
        w_c = w0.clone().requires_grad_(True)
        out = torch.compile(loss, backend="aot2onnx")(w_c)
        out.backward()
        torch.testing.assert_close(out, loss(w0), rtol=1e-5, atol=1e-5, msg=attempt)
        torch.testing.assert_close(w_c.grad, w_e.grad, rtol=1e-4, atol=1e-5, msg=attempt)
        assert {g_.kind for g_ in aot2onnx.compiled_graphs()} == {"forward", "backward"}, attempt
        assert fallback_graphs() == [], attempt  # all on ONNX Runtime


# ATen's embedding, index_select, gather and scatters refuse a negative index (a padding id of -1 fed to an
# Embedding, a label of -1 fed to cross_entropy, which torch decomposes into a gather); ONNX's Gather,
# GatherElements and ScatterElements read it from the end, so the compiled step trained on the last row where
# eager raises. The runtime now raises IndexError there (lower/checks.py); indices past the end already
# failed ONNX Runtime's run.
_X = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
_SRC = torch.randn(2, 5, generator=torch.Generator().manual_seed(1))
_ROWS, _ROWS_NEGATIVE = torch.tensor([[0, 3, 1, 0, 2], [1, 1, 2, 3, 3]]), torch.tensor([[0, 3, 1, 0, 2], [1, -1, 2, 3, 3]])
_NEGATIVE_INDEX = {
    "embedding": (lambda i: F.embedding(i, _X), torch.tensor([[0, 3], [-1, 2]]), torch.tensor([[0, 3], [1, 2]])),
    "index_select": (lambda i: torch.index_select(_X, 1, i), torch.tensor([0, -2]), torch.tensor([0, 3])),
    "gather": (lambda i: torch.gather(_X, 0, i), _ROWS_NEGATIVE, _ROWS),
    "cross_entropy": (lambda y: F.cross_entropy(_X, y), torch.tensor([1, -1, 0, 4]), torch.tensor([1, -100, 0, 4])),
    "nll_loss": (lambda y: F.nll_loss(_X, y, ignore_index=2), torch.tensor([1, 2, -3, 4]), torch.tensor([1, 2, 3, 4])),
    "scatter": (lambda i: _X.scatter(0, i, _SRC), _ROWS_NEGATIVE, _ROWS),
    "scatter value": (lambda i: _X.scatter(0, i, 2.5), _ROWS_NEGATIVE, _ROWS),
    "scatter reduce=add": (lambda i: _X.scatter(0, i, _SRC, reduce="add"), _ROWS_NEGATIVE, _ROWS),
    "scatter_add": (lambda i: _X.scatter_add(0, i, _SRC), _ROWS_NEGATIVE, _ROWS),
    "scatter_reduce": (lambda i: _X.scatter_reduce(0, i, _SRC, "mean", include_self=False), _ROWS_NEGATIVE, _ROWS),
    "index_add": (lambda i: _X.index_add(0, i, _SRC, alpha=2), torch.tensor([3, -1]), torch.tensor([3, 3])),
    "index_copy": (lambda i: _X.index_copy(1, i, _X[:, :2]), torch.tensor([-4, 1]), torch.tensor([4, 1])),
    "index_reduce": (lambda i: _X.index_reduce(0, i, _SRC, "amax"), torch.tensor([0, -2]), torch.tensor([0, 2])),
    "embedding_bag": (lambda i: F.embedding_bag(i, _X, torch.tensor([0, 2]), mode="max"), torch.tensor([0, 3, -1]),
                      torch.tensor([0, 3, 1])),
}


@pytest.mark.parametrize("case", list(_NEGATIVE_INDEX))
def test_negative_indices_raise_where_eager_raises(case):
    fn, negative, valid = _NEGATIVE_INDEX[case]
    with pytest.raises((IndexError, RuntimeError)):
        fn(negative)
    torch._dynamo.reset()
    aot2onnx.reset_compiled_graphs()
    reset_fallback_graphs()
    compiled = torch.compile(fn, backend="aot2onnx")
    torch.testing.assert_close(compiled(valid), fn(valid), rtol=1e-6, atol=1e-6)
    with pytest.raises(IndexError, match="index -[0-9]+ is out of range"):
        compiled(negative)
    torch.testing.assert_close(compiled(valid), fn(valid), rtol=1e-6, atol=1e-6)  # and the graph still runs after
    assert aot2onnx.compiled_graphs() and fallback_graphs() == []


def test_a_padding_id_of_minus_one_fails_the_training_step_as_in_eager():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Flatten(), torch.nn.Linear(24, 5))
    tokens, labels = torch.tensor([[1, 2, 3], [4, -1, 6]]), torch.tensor([3, 1])  # -1: a padding id
    with pytest.raises(IndexError):
        F.cross_entropy(model(tokens), labels).backward()
    torch._dynamo.reset()
    step = torch.compile(lambda t, y: F.cross_entropy(model(t), y), backend="aot2onnx")
    with pytest.raises(IndexError, match="index -1 is out of range"):
        step(tokens, labels).backward()
    step(torch.tensor([[1, 2, 3], [4, 5, 6]]), labels).backward()  # valid batches train
    assert all(p.grad is not None for p in model.parameters())


# An output that is a view of an input, taken with a symbolic argument (a size Dynamo made dynamic on the
# second shape, with default options; a .item() under capture_scalar_outputs), is rebuilt by AOTAutograd with
# as_strided from what the compiled graph returned. ONNX Runtime returns a copy at offset 0: the caller got
# the view from the input's first element. Those view nodes now run in PyTorch.
_VIEWS = {
    "narrow by a dynamic size": lambda x, n: x.narrow(1, 1, x.shape[1] - 2),
    "second half": lambda x, n: x[:, x.shape[1] // 2:],
    "chunk": lambda x, n: x.chunk(2, dim=1)[1],
    "slice at a tensor's value": lambda x, n: x[:, n.item():n.item() + 2],
}


@pytest.mark.parametrize("case", list(_VIEWS))
@torch._dynamo.config.patch(capture_scalar_outputs=True)
def test_views_of_inputs_with_runtime_sizes_are_eagers(case):
    fn = _VIEWS[case]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot2onnx")
    for rows, cols, n in ((4, 6, 1), (5, 8, 3), (6, 10, 2)):
        x = torch.arange(float(rows * cols)).reshape(rows, cols)
        out = compiled(x, torch.tensor(n))
        torch.testing.assert_close(out, fn(x, torch.tensor(n)), rtol=0, atol=0)
        assert out.data_ptr() == fn(x, torch.tensor(n)).data_ptr()  # a view of x, as in eager
