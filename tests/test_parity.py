"""aot2onnx.parity: the report names the node where ONNX Runtime and eager part, in the right graph, at the
user's source line; correct models and float32 rounding drift are not reported as faults.

Faults are injected as user lowerings (``register_lowering`` inside the autouse ``scoped_lowerings`` fixture
of conftest.py) that are subtly wrong: 1e-3 relative, for one op, one dtype or one shape.
"""

from __future__ import annotations

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
