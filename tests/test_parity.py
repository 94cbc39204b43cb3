"""aot2onnx.parity: the report names the node where ONNX Runtime and eager part, in the right graph, at the
user's source line; correct models and float32 rounding drift are not reported as faults.

Faults are injected as user lowerings (``register_lowering`` inside the autouse ``scoped_lowerings`` fixture
of conftest.py) that are subtly wrong: 1e-3 relative, for one op, one dtype or one shape.
"""

from __future__ import annotations

import html as html_lib
import inspect
import json
import subprocess
import sys
import warnings

import numpy as np
import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F
from onnxscript import opset18 as op

import aot2onnx
import aot2onnx.parity
from aot2onnx.testing import assert_parity
from aot2onnx.tools.cli import main as cli_main

aten = torch.ops.aten


def _line(fn, text: str) -> str:
    """``File "...", line N`` of the line of ``fn``'s source holding ``text``: what the report must name."""
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, line in enumerate(lines) if text in line)
    return f'line {start + offset}, in {fn.__name__}'


def _gelu_off(x, approximate: str = "none"):
    """aten::gelu(Tensor self, *, str approximate='none') -> Tensor, 1e-3 too large."""
    half = op.Mul(x, op.CastLike(0.5, x))
    exact = op.Mul(half, op.Add(op.CastLike(1.0, x), op.Erf(op.Div(x, op.CastLike(2.0**0.5, x)))))
    return op.Mul(exact, op.CastLike(1.001, x))


def _tanh_backward_off(grad, y):
    """aten::tanh_backward(Tensor grad_output, Tensor output) -> Tensor, 2e-3 too large."""
    return op.Mul(op.Mul(grad, op.Sub(op.CastLike(1.0, y), op.Mul(y, y))), op.CastLike(1.002, y))


class _GeluMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = F.gelu(h * 2)  # the gelu line
        return self.b(h)


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def test_a_wrong_forward_rule_is_named_at_its_source_line_and_not_blamed_downstream(tmp_path):
    torch.manual_seed(0)
    model = _GeluMLP()
    assert aot2onnx.parity.compare(model, (_x(6, 8),)).ok  # correct lowering first: nothing to report
    aot2onnx.register_lowering(aten.gelu.default)(_gelu_off)
    report = aot2onnx.parity.compare(model, (_x(6, 8),))

    assert not report.ok
    node = report.first_divergence("forward")
    assert node is not None and node.target == "aten.gelu.default" and node.fx_name == "gelu"
    assert node.kind == "forward" and node.graph.endswith("_forward")
    assert _line(_GeluMLP.forward, "the gelu line") in node.source and "F.gelu(h * 2)" in node.source
    assert {"Erf", "Mul"} <= {name.split("(")[1].rstrip(")") for name in node.onnx_nodes}
    assert 5e-4 < node.own.max_rel < 2e-3 and node.own.beyond > 0.5
    # Downstream nodes carry the error (against eager) but are not at fault on their own, and the backward
    # graph, which reads the forward's wrong values, has no fault of its own either.
    forward = report.graph(node.graph)
    after = [n for n in forward.nodes if n.index > node.index and n.target == "aten.addmm.default"]
    assert after and after[0].error.max_abs > 1e-5 and not after[0].divergent
    assert report.first_divergence("backward") is None
    assert [n.fx_name for n in report.divergences] == ["gelu"]
    # The outputs and the last layer's gradients differ; the model's parameters were not touched.
    beyond = {(t.what, t.name) for t in report.tensors if not t.ok}
    assert ("output", "output 0") in beyond and ("grad", "b.weight") in beyond

    page = report.save(tmp_path / "report")
    assert page.read_text().count("aten.gelu.default") >= 2
    html = (tmp_path / "report" / "report.html").read_text()
    assert "<svg" in html and "first divergent: aten.gelu.default (gelu)" in html
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    assert data["ok"] is False and data["first_divergence"]["forward"]["fx_name"] == "gelu"
    assert data["first_divergence"]["backward"] is None
    # The reproducer prints ONNX Runtime's difference from PyTorch on the node's own inputs.
    repro = tmp_path / "report" / "repro_forward"
    assert {p.name for p in repro.iterdir()} == {"node.onnx", "inputs.npz", "expected.npz", "repro.py"}
    out = subprocess.run([sys.executable, str(repro / "repro.py")], capture_output=True, text=True, check=True).stdout
    assert out.startswith("gelu: shape [6, 16], max |onnxruntime - torch| = ")
    assert 5e-4 < float(out.split("max relative ")[1].split(",")[0]) < 2e-3


def test_the_pages_lead_with_the_verdict_and_the_first_divergent_node_and_rows_show_their_tolerance(tmp_path):
    torch.manual_seed(0)
    aot2onnx.register_lowering(aten.gelu.default)(_gelu_off)
    # Standard operators only: the fused kernels' exact tanh gradient leaves no ok row with the large relative
    # error of a tiny element that this page must not show as a failure.
    report = aot2onnx.parity.compare(_GeluMLP(), (_x(6, 8),), options={"fused_kernels": False})
    report.save(tmp_path)
    md = (tmp_path / "report.md").read_text().splitlines()
    assert md[2].startswith("**Parity NOT ok: ") and "1 divergent node(s)" in md[2]
    assert md[4].startswith("- **first divergent node of the forward graphs: aten.gelu.default (FX node gelu of graph ")
    assert "own error " in md[4] and " > " in md[4]
    assert md[5].startswith("  at `") and _line(_GeluMLP.forward, "the gelu line") in md[5]
    rows = [line for line in md if line.startswith("| output ") or line.startswith("| grad ")]
    assert rows and all((" <= " in r) == r.endswith("| ok |") and (" > " in r) != r.endswith("| ok |") for r in rows)
    # A small element's relative error past 1 (atol covers it) used to show as "max rel 6.5" on an ok row.
    ok_rows = [t for t in report.tensors if t.ok]
    assert any(t.stats.max_rel > 1e-4 for t in ok_rows)
    page = (tmp_path / "report.html").read_text()
    assert "max rel" not in page and "max rel" not in "\n".join(md)
    body = page[page.index("</h1>"):]
    assert body.index("id='verdict' class='verdict bad'") < body.index("aten.gelu.default") < body.index("<table>")
    assert html_lib.escape(_line(_GeluMLP.forward, "the gelu line")) in body[:body.index("<table>")]


def test_a_wrong_backward_only_rule_is_named_in_the_backward_graph():
    torch.manual_seed(0)
    aot2onnx.register_lowering(aten.tanh_backward.default)(_tanh_backward_off)
    report = aot2onnx.parity.compare(_GeluMLP(), (_x(6, 8),))
    assert report.first_divergence("forward") is None
    node = report.first_divergence("backward")
    assert node is not None and node.target == "aten.tanh_backward.default" and node.kind == "backward"
    assert node.graph.endswith("_backward")
    # A backward node's source line is the forward line it differentiates.
    assert "torch.tanh(self.a(x))" in node.source and _line(_GeluMLP.forward, "torch.tanh") in node.source
    assert {(t.what, t.name) for t in report.tensors if not t.ok} == {("grad", "a.weight"), ("grad", "a.bias")}


class _TwoSigmoids(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(8, 3)

    def forward(self, x):
        wide = torch.sigmoid(self.a(x))  # sixteen features
        narrow = torch.sigmoid(self.b(x))  # three features
        return wide.sum(-1, keepdim=True) * narrow


class _TwoExps(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        single = torch.exp(y)  # float32
        double = torch.exp(y.double()).float()  # float64
        return single - double * 0.5


def _sigmoid_off_for_three(x):
    """aten::sigmoid(Tensor self) -> Tensor, wrong only where the last dimension is 3."""
    y = op.Sigmoid(x)
    return op.Mul(y, op.CastLike(1.001, x)) if x.shape is not None and x.shape[-1] == 3 else y


def _exp_off_for_double(x):
    """aten::exp(Tensor self) -> Tensor, wrong only in float64."""
    y = op.Exp(x)
    return op.Mul(y, op.CastLike(1.001, x)) if x.dtype == ir.DataType.DOUBLE else y


@pytest.mark.parametrize(
    "module, target, rule, fx_name, marker",
    [
        (_TwoSigmoids, aten.sigmoid.default, _sigmoid_off_for_three, "sigmoid_1", "three features"),
        (_TwoExps, aten.exp.default, _exp_off_for_double, "exp_1", "# float64"),
    ],
    ids=["shape", "dtype"],
)
def test_a_rule_wrong_for_one_shape_or_dtype_names_that_node(module, target, rule, fx_name, marker):
    torch.manual_seed(0)
    aot2onnx.register_lowering(target)(rule)
    report = aot2onnx.parity.compare(module(), (_x(5, 8),))
    node = report.first_divergence("forward")
    assert node is not None and node.target == str(target) and node.fx_name == fx_name
    assert _line(module.forward, marker) in node.source
    assert [n.fx_name for n in report.divergences] == [fx_name]  # the other node of the same op is fine
    same_op = [n for g in report.graphs for n in g.nodes if n.target == str(target) and n.fx_name != fx_name]
    assert same_op and all(n.own.ok for n in same_op)


# A custom op without a lowering: the fallback splits the graph around it, and the gelu after it sits in
# another partition, fed by a value PyTorch computed.
@torch.library.custom_op("aot2onnx_parity::shiver", mutates_args=())
def shiver(x: torch.Tensor) -> torch.Tensor:
    return x + 0.1 * torch.sin(3 * x)


shiver.register_fake(lambda x: torch.empty_like(x))
shiver.register_autograd(  # in ATen ops: the backward graph is not split
    lambda ctx, grad: grad * (1 + 0.3 * torch.cos(3 * ctx.saved_tensors[0])),
    setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]),
)


class _Shivery(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.ops.aot2onnx_parity.shiver(torch.relu(self.a(x)))
        return self.b(F.gelu(h))  # after the op PyTorch runs


def test_a_split_graph_is_compared_partition_by_partition():
    torch.manual_seed(0)
    aot2onnx.register_lowering(aten.gelu.default)(_gelu_off)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = aot2onnx.parity.compare(_Shivery(), (_x(6, 8),))
    forward = [g for g in report.graphs if g.kind == "forward"]
    assert len(forward) == 2 and len({g.whole for g in forward}) == 1 and forward[0].whole != forward[0].name
    assert all(any("shiver" in t for t in g.in_torch) for g in forward)
    node = report.first_divergence("forward")
    assert node is not None and node.fx_name == "gelu" and node.graph == forward[1].name
    assert "after the op PyTorch runs" in node.source
    assert not forward[0].first_divergence
    assert any("run in PyTorch" in n for n in report.notes)


def test_float32_rounding_drift_through_30_layers_is_not_a_fault():
    torch.manual_seed(0)
    layers = []
    for _ in range(30):
        linear = torch.nn.Linear(32, 32)
        torch.nn.init.orthogonal_(linear.weight, gain=1.2)  # the signal neither dies nor saturates
        layers += [linear, torch.nn.Tanh()]
    # Tight enough that what rounding accumulates over 30 layers is beyond it at the outputs and gradients.
    report = aot2onnx.parity.compare(torch.nn.Sequential(*layers), (_x(8, 32) * 0.5,), rtol=1e-6, atol=1e-8)
    assert any(not t.ok for t in report.tensors), "no drift to tell apart: make the network deeper"
    assert report.first_divergence("forward") is None and report.first_divergence("backward") is None
    forward = next(g for g in report.graphs if g.kind == "forward")
    assert max(n.error.ratio for n in forward.nodes if n.error) > 1  # the error along the graph grew past it
    assert max(n.own.ratio for g in report.graphs for n in g.nodes if n.own) < 0.1  # no node near its own
    assert "no node is beyond tolerance on its own" in report.summary()


class _Router(torch.nn.Module):
    """Sorts integer expert ids, full of ties, as transformers' grouped-mm experts do: ONNX Runtime's TopK and
    PyTorch's sort order equal ids differently, and both are right."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x)
        ids = h.detach().argmax(-1).repeat(4)
        ordered, perm = torch.sort(ids)
        return h.repeat(4, 1)[perm] * (1 + ordered[:, None])


def test_tied_values_ordered_differently_are_not_a_fault():
    torch.manual_seed(0)
    report = aot2onnx.parity.compare(_Router(), (_x(16, 8),))
    assert report.divergences == [], report.summary()
    sort = next(n for g in report.graphs for n in g.nodes if n.target == "aten.sort.default")
    assert sort.own.ok and "tied values" in sort.note  # this seed has ties that ONNX Runtime orders otherwise
    assert "follows from tied values ordered differently (sort)" in report.summary()


# A custom op with its own backward op, each with a user lowering (registered in the tests), as a user writes
# a fused kernel: only the backward rule is wrong. The backward node's values are gradients of a mean loss
# (about 1e-2 here) beside the saved activation it reads (about 2): a tolerance with the user's atol, or one
# scaled to the largest input, hid its 0.3% (the report said "none divergent").
@torch.library.custom_op("aot2onnx_parity::wiggle", mutates_args=())
def wiggle(x: torch.Tensor) -> torch.Tensor:
    return x + 0.1 * torch.sin(3 * x)


@torch.library.custom_op("aot2onnx_parity::wiggle_backward", mutates_args=())
def wiggle_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return grad * (1 + 0.3 * torch.cos(3 * x))


wiggle.register_fake(lambda x: torch.empty_like(x))
wiggle_backward.register_fake(lambda grad, x: torch.empty_like(grad))
wiggle.register_autograd(lambda ctx, grad: wiggle_backward(grad, ctx.saved_tensors[0]),
                         setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))


def _wiggle_rule(x):
    """aot2onnx_parity::wiggle(Tensor x) -> Tensor"""
    return op.Add(x, op.Mul(op.CastLike(0.1, x), op.Sin(op.Mul(op.CastLike(3.0, x), x))))


def _wiggle_backward_off(grad, x):
    """aot2onnx_parity::wiggle_backward(Tensor grad, Tensor x) -> Tensor, 0.3% too large."""
    slope = op.Add(op.CastLike(1.0, x), op.Mul(op.CastLike(0.3, x), op.Cos(op.Mul(op.CastLike(3.0, x), x))))
    return op.Mul(op.Mul(grad, slope), op.CastLike(1.003, x))


class _Wiggly(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 32)
        self.b = torch.nn.Linear(32, 32)
        self.c = torch.nn.Linear(32, 4)

    def forward(self, x):
        h = torch.ops.aot2onnx_parity.wiggle(torch.relu(self.a(x)))  # the wiggle line
        return self.c(torch.relu(self.b(h)))


def test_a_wrong_backward_rule_of_a_custom_op_is_named_though_its_gradients_are_small():
    torch.manual_seed(0)
    aot2onnx.register_lowering(torch.ops.aot2onnx_parity.wiggle.default)(_wiggle_rule)
    aot2onnx.register_lowering(torch.ops.aot2onnx_parity.wiggle_backward.default)(_wiggle_backward_off)
    y = torch.randint(0, 4, (16,), generator=torch.Generator().manual_seed(2))
    report = aot2onnx.parity.compare(_Wiggly(), (_x(16, 8),), loss_fn=F.cross_entropy, targets=y)
    assert report.first_divergence("forward") is None, report.summary()
    node = report.first_divergence("backward")
    assert node is not None and node.fx_name == "wiggle_backward", report.summary()
    assert node.target == "aot2onnx_parity.wiggle_backward.default" and node.graph.endswith("_backward")
    assert [n.fx_name for n in report.divergences] == ["wiggle_backward"]
    assert node.own.max_abs < 1e-4 < node.own.beyond * 1e4  # below atol=1e-5 + rtol: it was hidden by atol
    assert _line(_Wiggly.forward, "the wiggle line") in node.source
    forward_rule = next(n for g in report.graphs for n in g.nodes if n.fx_name == "wiggle")
    assert forward_rule.own.ok and forward_rule.kind == "forward"


class _InPlaceAfterMultiOutput(torch.nn.Module):
    """Nodes with several outputs whose first output an in-place op reads: AOTAutograd clones it, the lowering's
    cleanup drops the Identity and gives the clone's name to the node's output (it is saved for the backward)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.ln = torch.nn.LayerNorm(8)
        self.out = torch.nn.Linear(8, 5)

    def forward(self, x):
        h = F.hardswish(self.bn(self.conv(x)), inplace=True)  # batch norm, then an in-place activation
        h = F.relu(F.max_pool2d(h, 2, return_indices=True)[0], inplace=True)
        t = F.hardswish(self.ln(h.flatten(2).transpose(1, 2)), inplace=True)
        return self.out(t.mean(1))


class _FlashAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)
        self.bn = torch.nn.BatchNorm1d(16)

    def forward(self, t):
        q, k, v = (x.contiguous() for x in self.qkv(t).view(t.shape[0], 16, 2, 12).transpose(1, 2).chunk(3, dim=-1))
        attention, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
        attention = F.relu(attention, inplace=True).transpose(1, 2).reshape(t.shape[0], 16, 8)
        return F.hardswish(self.bn(attention), inplace=True), logsumexp


def _flash_attention_rule(query, key, value, dropout_p: float = 0.0, is_causal: bool = False, attn_mask=None,
                          scale=None):
    """aten::_scaled_dot_product_flash_attention_for_cpu(Tensor query, Tensor key, Tensor value, float
    dropout_p=0.0, bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None) -> (Tensor output,
    Tensor logsumexp), for the cases here (no mask, not causal, no dropout)."""
    scores = op.Mul(op.MatMul(query, op.Transpose(key, perm=[0, 1, 3, 2])),
                    op.CastLike(scale or query.shape[-1] ** -0.5, query))
    logsumexp = op.ReduceLogSumExp(scores, op.Constant(value_ints=[-1]), keepdims=0)
    return op.MatMul(op.Softmax(scores, axis=-1), value), logsumexp


_MULTI_OUTPUT = {"aten._native_batch_norm_legit_functional.default", "aten.max_pool2d_with_indices.default",
                 "aten.native_layer_norm.default", "aten._native_batch_norm_legit_no_training.default",
                 "aten._scaled_dot_product_flash_attention_for_cpu.default", "aten.split.Tensor"}


@pytest.mark.parametrize("case", ["training", "flash_attention"])
def test_nodes_with_several_outputs_give_every_output_and_their_users_are_compared(case):
    torch.manual_seed(0)
    if case == "training":
        model, args = _InPlaceAfterMultiOutput(), (_x(4, 3, 8, 8),)
        y = torch.randint(0, 5, (4,), generator=torch.Generator().manual_seed(2))
        report = aot2onnx.parity.compare(model, args, loss_fn=F.cross_entropy, targets=y)
        expected = {"aten._native_batch_norm_legit_functional.default", "aten.max_pool2d_with_indices.default",
                    "aten.native_layer_norm.default"}
    else:
        aot2onnx.register_lowering(aten._scaled_dot_product_flash_attention_for_cpu.default)(_flash_attention_rule)
        model = _FlashAttention().eval().requires_grad_(False)
        report = aot2onnx.parity.compare(model, (_x(4, 16, 8),))
        expected = {"aten._scaled_dot_product_flash_attention_for_cpu.default", "aten.split.Tensor",
                    "aten._native_batch_norm_legit_no_training.default"}
    assert report.ok and report.divergences == [], report.summary()
    nodes = [n for g in report.graphs for n in g.nodes]
    several = [n for n in nodes if n.target in _MULTI_OUTPUT]
    assert {n.target for n in several} == expected
    for node in several:  # every output something reads found in the ONNX model (the first under a clone's name)
        used = node.onnx_values[:1] if "no_training" in node.target else node.onnx_values  # its others are empty
        assert used and None not in used, (node.fx_name, node.onnx_values)
        assert node.compared and node.own.ok
    # Every node compared, on the compiled values of its inputs (a hardswish reads batch norm's first output).
    assert [(n.fx_name, n.note) for n in nodes if not n.compared] == []
    assert [(n.fx_name, n.eager_inputs) for n in nodes if n.eager_inputs] == []
    assert any(n.target == "aten.hardswish.default" for n in nodes)


@torch.library.custom_op("aot2onnx_parity::read_sensor", mutates_args=())
def read_sensor(x: torch.Tensor) -> torch.Tensor:
    """A kernel that can run once: a device handle it opens is gone after the eager step."""
    _SENSOR["calls"] += 1
    if _SENSOR["calls"] > 1:
        raise RuntimeError("the sensor handle is closed")
    return x * 2


_SENSOR = {"calls": 0}
read_sensor.register_fake(lambda x: torch.empty_like(x))


class _Sensor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(torch.ops.aot2onnx_parity.read_sensor(self.a(x)))


def test_a_node_whose_reference_cannot_be_computed_is_not_compared_and_says_why():
    torch.manual_seed(0)
    aot2onnx.register_lowering(torch.ops.aot2onnx_parity.read_sensor.default)(
        lambda x: op.Mul(x, op.CastLike(2.0, x)))
    _SENSOR["calls"] = 0
    report = aot2onnx.parity.compare(_Sensor().requires_grad_(False), (_x(4, 8),))
    node = next(n for g in report.graphs for n in g.nodes if n.fx_name == "read_sensor")
    assert not node.divergent and not node.compared
    assert node.note == ("not compared, because PyTorch's kernel failed on the compiled inputs: RuntimeError: the "
                         "sensor handle is closed")
    tanh = next(n for g in report.graphs for n in g.nodes if n.target == "aten.tanh.default")
    assert tanh.compared and tanh.own.ok and tanh.eager_inputs == []  # its input is known from ONNX Runtime
    assert report.ok and "(1 not compared: see their notes)" in report.summary_line()


def _mul_off_for_momentum(self, other):
    """aten::mul.Tensor(Tensor self, Tensor other) -> Tensor, 1e-3 too large where other is the number 0.9: SGD's
    momentum, which multiplies the momentum buffer from the second step on (the first step creates it)."""
    if isinstance(other, float):
        product = op.Mul(self, op.CastLike(other, self))
        return op.Mul(product, op.CastLike(1.001, self)) if other == 0.9 else product
    return op.Mul(self, other)


def _sgd_momentum(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def test_several_steps_say_at_which_step_and_in_which_graph_the_two_first_part(tmp_path):
    torch.manual_seed(0)
    y = torch.randint(0, 4, (6,), generator=torch.Generator().manual_seed(2))
    args = dict(loss_fn=F.cross_entropy, targets=y, steps=3, optimizer=_sgd_momentum, compile_optimizer=True)
    clean = aot2onnx.parity.compare(_GeluMLP(), (_x(6, 8),), **args)
    assert clean.ok and clean.first_parting() is None, clean.summary()
    assert {(g.step, g.kind) for g in clean.graphs} == {(s, k) for s in (1, 2, 3) for k in ("forward", "backward", "optimizer")}
    assert {t.what for t in clean.tensors if t.step == 3} >= {"loss", "grad", "parameter", "optimizer state"}

    aot2onnx.register_lowering(aten.mul.Tensor)(_mul_off_for_momentum)
    report = aot2onnx.parity.compare(_GeluMLP(), (_x(6, 8),), **args)
    parting = report.first_parting()
    assert parting is not None and parting.step == 2, report.summary()
    assert parting.graph.kind == "optimizer" and parting.node.target == "aten.mul.Tensor"
    assert report.first_divergence("optimizer") is parting.node
    assert report.first_divergence("forward") is None and report.first_divergence("backward") is None
    assert all(t.ok for t in report.tensors if t.step == 1)  # the first step creates the buffers: no mul
    assert "optimizer state" in {t.what for t in parting.tensors}  # the momentum buffers
    assert "the two first part at step 2, in the optimizer graph" in report.summary_line()
    report.save(tmp_path)
    md = (tmp_path / "report.md").read_text().splitlines()
    assert md[4].startswith("**The two first part at step 2, in the optimizer graph ")
    assert (tmp_path / "repro_optimizer" / "repro.py").exists()
    assert json.loads((tmp_path / "report.json").read_text())["first_parting"]["step"] == 2


def _zoo(name):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    import zoo

    return next(m for m in zoo.MEMBERS if m.name == name)


@pytest.mark.parametrize("name", ["resnet", "unet_block", pytest.param("dlrm", marks=pytest.mark.slow),
                                  pytest.param("gpt2", marks=pytest.mark.slow),
                                  pytest.param("bert_seq_cls", marks=pytest.mark.slow),
                                  pytest.param("vit", marks=pytest.mark.slow),
                                  pytest.param("lstm_lm", marks=pytest.mark.slow)])
def test_correct_zoo_models_have_no_divergent_node(name):
    member = _zoo(name)
    torch.manual_seed(0)
    args, target = member.data(0)
    with member.context(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = aot2onnx.parity.compare(member.build(), args, loss_fn=member.loss_fn, targets=target,
                                         rtol=member.tol[0], atol=member.tol[1])
    assert report.graphs and report.divergences == [], report.summary()
    assert report.ok, report.summary()
    assert sum(len(g.nodes) for g in report.graphs) > 20


def test_assert_parity_names_the_first_divergent_node():
    aot2onnx.register_lowering(aten.gelu.default)(_gelu_off)
    with pytest.raises(AssertionError) as failure:
        assert_parity(_GeluMLP, (_x(6, 8),), loss_fn=lambda y: y.square().mean(), steps=2, check_torch_ops=False)
    message = str(failure.value)
    assert "differ from eager" in message  # the table as before, then where the runtimes part
    assert "first divergent node of the forward graphs: aten.gelu.default (FX node 'gelu'" in message
    assert _line(_GeluMLP.forward, "the gelu line") in message


def test_the_command_line_writes_the_report(tmp_path, capsys):
    (tmp_path / "models.py").write_text(
        "import torch\n\n"
        "def make():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))\n"
    )
    np.savez(tmp_path / "x.npz", np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32))
    np.savez(tmp_path / "y.npz", np.array([0, 1, 2, 0, 1, 2]))
    argv = ["parity", f"{tmp_path / 'models.py'}:make", "--example-inputs", str(tmp_path / "x.npz"),
            "--loss", "cross_entropy", "--targets", str(tmp_path / "y.npz"), "--out", str(tmp_path / "ok")]
    assert cli_main(argv) == 0
    out, err = capsys.readouterr()
    assert "[1/4] eager step" in err and "[4/4] parity ok" in err and "node by node" in err
    assert out.startswith("parity ok") and (tmp_path / "ok" / "report.html").exists()
    assert cli_main([*argv[:-1], str(tmp_path / "steps"), "--steps", "2", "--optimizer", "sgd-momentum"]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("parity ok over 2 training steps")
    assert json.loads((tmp_path / "steps" / "report.json").read_text())["steps"] == 2

    aot2onnx.register_lowering(aten.gelu.default)(_gelu_off)
    assert cli_main([*argv[:-1], str(tmp_path / "faulty")]) == 1
    out, _ = capsys.readouterr()
    assert "first divergent node of the forward graphs: aten.gelu.default" in out
    assert (tmp_path / "faulty" / "repro_forward" / "repro.py").exists()
    assert cli_main(["parity", "nowhere.py:make", "--example-inputs", "x.npz", "--out", "o"]) == 2


class _LossModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.b = torch.nn.Linear(16, 3)

    def forward(self, x, y):
        logits = self.b(F.gelu(self.norm(self.a(x))))  # the artifact's gelu
        return F.cross_entropy(logits, y), logits


def test_an_artifact_against_the_module_it_came_from(tmp_path):
    torch.manual_seed(0)
    module = _LossModel()
    inputs = (_x(6, 8), torch.tensor([0, 1, 2, 0, 1, 2]))
    aot2onnx.export_training(module, inputs, tmp_path / "good")
    report = aot2onnx.parity.compare_artifact(tmp_path / "good", module, inputs)
    assert report.ok, report.summary()
    assert {g.kind for g in report.graphs} == {"forward", "backward"}
    assert {t.what for t in report.tensors} == {"loss", "output", "grad", "buffer"}
    assert all(len(g.nodes) > 5 for g in report.graphs) and not report.notes

    aot2onnx.register_lowering(aten.gelu.default)(_gelu_off)
    aot2onnx.export_training(module, inputs, tmp_path / "faulty")
    aot2onnx.unregister_lowering(aten.gelu.default)
    report = aot2onnx.parity.compare_artifact(tmp_path / "faulty", module, inputs)
    node = report.first_divergence("forward")
    assert node is not None and node.target == "aten.gelu.default"
    assert _line(_LossModel.forward, "the artifact's gelu") in node.source
    assert report.first_divergence("backward") is None and not report.ok
