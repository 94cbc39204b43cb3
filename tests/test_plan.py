"""One plan per graph (lower/plan.py): canonicalized on a copy, each node dispatched once at the opset the model is
built at, every unsupported op reported at once, and what compiles reads that one decision."""

from __future__ import annotations

import collections
import copy
import sys
import warnings

import pytest
import torch
from onnxscript import opset18 as op
from torch.fx.experimental.proxy_tensor import make_fx

import aot2onnx
from aot2onnx.errors import UnsupportedOpError
from aot2onnx.lower import registry as registry_module
from aot2onnx.lower.plan import analyse, canonicalize, plan_graph
from aot2onnx.lower.registry import default_registry
from aot2onnx.lower.translate import lower_graph
from aot2onnx.options import BASE_OPSET

aten = torch.ops.aten


@torch.library.custom_op("aot2onnx_plan::halve", mutates_args=())
def halve(x: torch.Tensor) -> torch.Tensor:
    return x / 2


@halve.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("aot2onnx_plan::third", mutates_args=())
def third(x: torch.Tensor) -> torch.Tensor:
    return x / 3


@third.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _traced(f, *args) -> torch.fx.GraphModule:
    return make_fx(f, tracing_mode="fake")(*args)


def _graph_text(gm: torch.fx.GraphModule) -> list[str]:
    return [f"{n.op} {n.name} {n.target} {n.args} {n.kwargs}" for n in gm.graph.nodes]


@pytest.fixture
def lookups(monkeypatch):
    """Registry lookups for nodes, by target: not those of ``Registry.supports``, which the decomposition table
    asks once per registered target, whatever the graph."""
    counted: collections.Counter = collections.Counter()
    real = registry_module.Registry.lookup

    def lookup(self, target, opset, *, is_complex=False):
        if sys._getframe(1).f_code.co_name != "supports":
            counted[str(target)] += 1
        return real(self, target, opset, is_complex=is_complex)

    monkeypatch.setattr(registry_module.Registry, "lookup", lookup)
    return counted


def test_a_rule_for_a_newer_opset_is_reported_by_the_analysis_not_found_missing_while_emitting():
    # The check used to dispatch at the target opset (21: the user's rule for 20 fits) and the lowering at the
    # opset the model is built at (18: it does not), so the check passed and lowering failed on its "this is a
    # bug" path. Both are one decision now, at the build opset, where the rule does not fit: the graph is
    # refused before anything is built, with the reason.
    built = []

    @aot2onnx.register_lowering(torch.ops.aot2onnx_plan.halve.default, opset=20)
    def halve_rule(x):
        built.append(x)
        return op.Div(x, op.CastLike(2.0, x))

    gm = _traced(lambda x: torch.ops.aot2onnx_plan.halve(x) + 1, torch.randn(3))
    plan = plan_graph(gm, default_registry(), 21)
    (decision,) = plan.unsupported()["aot2onnx_plan.halve.default"]
    assert "needs opset 20" in decision.reason
    with pytest.raises(UnsupportedOpError) as raised:
        lower_graph(gm, name="g", opset=21)
    message = str(raised.value)
    assert message.startswith("1 op(s) in graph 'g' have no ONNX lowering")
    assert "needs opset 20" in message and f"built at opset {BASE_OPSET}" in message
    assert not built  # refused before any rule ran


def test_canonicalize_and_lowering_leave_the_callers_graph_as_it_was():
    def f(x, ids):
        # clamp's int bounds on a float result, bfloat16 mul by a scalar and an implicit promotion: each is
        # rewritten by canonicalize, on its copy.
        return (x.clamp(0, 1) * 0.3).float() + ids

    gm = _traced(f, torch.randn(4, dtype=torch.bfloat16), torch.arange(4))
    before = _graph_text(gm)
    canonical = canonicalize(gm)
    assert _graph_text(gm) == before
    assert canonical is not gm and _graph_text(canonical) != before
    assert any(n.target is torch.ops.prims.convert_element_type.default for n in canonical.graph.nodes)
    lower_graph(gm, name="g", opset=BASE_OPSET)
    assert _graph_text(gm) == before


def test_each_node_is_dispatched_once_while_a_graph_is_lowered(lookups):
    def f(x, w):
        values, indices = torch.max(x @ w, dim=1)  # a multi-output op and its getitems
        return torch.relu(values) * 2, indices, x.clamp(0, 1)

    gm = _traced(f, torch.randn(4, 3), torch.randn(3, 5))
    plan = plan_graph(gm, default_registry(), BASE_OPSET)
    calls = [d for d in plan.nodes.values() if not d.passthrough]
    getitems = [d for d in plan.nodes.values() if d.passthrough]
    # One lookup per op, and one for all of the graph's getitems (of a rule that returns a sequence).
    assert calls and len(getitems) == 2
    assert lookups.pop("<built-in function getitem>") == 1
    assert sum(lookups.values()) == len(calls) and set(lookups.values()) == {1}
    lookups.clear()
    lower_graph(gm, name="g", opset=BASE_OPSET, plan=plan)
    assert not lookups  # emitting reads the plan
    lower_graph(gm, name="g", opset=BASE_OPSET)
    assert sum(lookups.values()) == len(calls) + 1


def test_compiling_with_fallback_dispatches_each_node_once(lookups):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)) * 0.5).clamp(-1, 1)

    nodes = []
    real_analyse = analyse

    def counting(gm, registry, opset):
        plan = real_analyse(gm, registry, opset)
        nodes.append(sum(not d.passthrough for d in plan.nodes.values()))
        return plan

    with pytest.MonkeyPatch.context() as m:
        m.setattr("aot2onnx.lower.plan.analyse", counting)
        compiled = torch.compile(Net(), backend=aot2onnx.backend(fallback=True, cache=False))
        compiled(torch.randn(4, 8)).sum().backward()
    # The forward and the backward graph, each dispatched once per node (and once for its getitems, if any):
    # before the plan, the fallback's check, its partitioner and the lowering each dispatched every node.
    assert len(nodes) == 2 and sum(nodes) <= sum(lookups.values()) <= sum(nodes) + len(nodes)


def test_the_analysis_reports_every_unsupported_op_at_once():
    gm = _traced(lambda x: torch.ops.aot2onnx_plan.third(torch.ops.aot2onnx_plan.halve(x)) * 2, torch.randn(3))
    plan = plan_graph(gm, default_registry(), BASE_OPSET)
    assert sorted(plan.unsupported()) == ["aot2onnx_plan.halve.default", "aot2onnx_plan.third.default"]
    with pytest.raises(UnsupportedOpError) as raised:
        lower_graph(gm, name="g", opset=BASE_OPSET)
    message = str(raised.value)
    assert message.startswith("2 op(s) in graph 'g' have no ONNX lowering")
    assert "aot2onnx_plan.halve.default" in message and "aot2onnx_plan.third.default" in message


def test_the_fallback_splits_where_the_plan_found_no_rule():
    class Net(torch.nn.Module):
        def forward(self, x):
            return torch.ops.aot2onnx_plan.halve(torch.sin(x)) + 1

    x = torch.randn(5, generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(Net(), backend=aot2onnx.backend(fallback=True, cache=False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(x)
    # ONNX Runtime's sin is not ATen's bit for bit (within float32's rounding: the README's exactness table).
    torch.testing.assert_close(out, Net()(x))
    assert any("aot2onnx_plan.halve.default (1 node)" in str(w.message) for w in caught)


def test_the_plan_records_complex_nodes():
    gm = _traced(lambda x: torch.view_as_real(x * 2), torch.randn(3, dtype=torch.complex64))
    plan = plan_graph(gm, default_registry(), BASE_OPSET)
    mul = next(d for d in plan.nodes.values() if d.node.target is aten.mul.Tensor)
    assert mul.is_complex and mul.complex_output
    real = next(d for d in plan.nodes.values() if d.node.target is aten.view_as_real.default)
    assert real.is_complex and not real.complex_output


def test_canonicalize_copies_the_subgraphs_of_higher_order_ops():
    outer = _traced(lambda x: x + 1, torch.randn(2))
    inner = _traced(lambda x: x.clamp(0, 1), torch.randn(2))
    outer.add_submodule("branch", inner)
    with outer.graph.inserting_before(next(iter(outer.graph.nodes))):
        outer.graph.get_attr("branch")  # as a higher-order op (cond, with_effects) reads its subgraph
    before = _graph_text(inner)
    copied = canonicalize(outer)
    assert copied.get_submodule("branch") is not inner
    assert _graph_text(inner) == before


def _select_scatter_sum(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    # The backward graph of a tensor whose slices are each read once: one zero tensor per slice's gradient.
    shape = (3, *a.shape)
    return (torch.select_scatter(a.new_zeros(shape), a, 0, 2) + torch.select_scatter(b.new_zeros(shape), b, 0, 1)
            + torch.select_scatter(c.new_zeros(shape), c, 0, 0))


def test_a_sum_of_select_scatters_into_zeros_is_one_stack_with_the_same_bits():
    a, b, c = (torch.randn(4, 5) for _ in range(3))
    a[0, 0], b[1, 1], c[2, 2] = -0.0, float("nan"), float("-inf")  # -0.0 + 0.0 is 0.0: the sum's, kept
    gm = make_fx(_select_scatter_sum, tracing_mode="fake")(a, b, c)
    canonical = canonicalize(gm)
    targets = [n.target for n in canonical.graph.nodes if n.op == "call_function"]
    assert aten.select_scatter.default not in targets and aten.new_zeros.default not in targets
    assert targets.count(aten.stack.default) == 1 and targets.count(aten.add.Tensor) == 1
    expected = _select_scatter_sum(a, b, c)
    aot2onnx.reset_compiled_graphs()
    got = torch.compile(_select_scatter_sum, backend="aot2onnx", options={"fallback": False, "cache": False})(a, b, c)
    assert [g.op_counts["Concat"] for g in aot2onnx.compiled_graphs()] == [1]  # three without the rewrite
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    assert not torch.equal(torch.stack([c, b, a]).view(torch.int32), expected.view(torch.int32))  # the -0.0

    # Left as it is: a slice set twice, one left at zero, a non-zero base, or another dim.
    def partial(a, b):
        return torch.select_scatter(a.new_zeros((3, 4, 5)), a, 0, 2) + torch.select_scatter(b.new_zeros((3, 4, 5)), b, 0, 1)

    def twice(a, b):
        return torch.select_scatter(a.new_zeros((2, 4, 5)), a, 0, 1) + torch.select_scatter(b.new_zeros((2, 4, 5)), b, 0, 1)

    def ones(a, b):
        return torch.select_scatter(a.new_ones((2, 4, 5)), a, 0, 0) + torch.select_scatter(b.new_zeros((2, 4, 5)), b, 0, 1)

    def dims(a, b):
        return torch.select_scatter(a.new_zeros((2, 4, 5)), a[0], 1, 0) + torch.select_scatter(b.new_zeros((2, 4, 5)), b, 0, 1)

    for fn in (partial, twice, ones, dims):
        targets = [n.target for n in canonicalize(make_fx(fn, tracing_mode="fake")(a, b)).graph.nodes]
        assert aten.stack.default not in targets and aten.select_scatter.default in targets, fn.__name__


def test_multihead_attentions_packed_projection_trains_with_the_select_scatters_bits(monkeypatch):
    # nn.MultiheadAttention's in-projection reads proj[0], proj[1] and proj[2]: its gradient is one stack.
    from aot2onnx.lower import plan

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    x = torch.randn(4, 16, 32)
    grads = []
    for stacked in (True, False):
        if not stacked:
            monkeypatch.setitem(plan.CANONICAL, aten.add.Tensor, lambda gm, node: False)
        aot2onnx.reset_compiled_graphs()
        torch._dynamo.reset()
        model = copy.deepcopy(layer)
        torch.compile(model, backend="aot2onnx", options={"fallback": False, "cache": False})(x).square().sum().backward()
        backward = next(g for g in aot2onnx.compiled_graphs() if g.kind.value == "backward")
        assert (backward.op_counts["Concat"] == 1) == stacked, dict(backward.op_counts)
        grads.append([p.grad for p in model.parameters()])
    for got, expected in zip(*grads):
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
