"""The lowering registry and dispatch: priority, opsets, duplicate registrations, scoping, reasons."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from onnxscript import opset18 as op

import aot2onnx
from aot2onnx.lower.dispatch import dispatch
from aot2onnx.lower.registry import Origin, Registry, Rule, default_registry, user_rules

aten = torch.ops.aten


def _rule(target, origin, opset=18, is_complex=False):
    return Rule(target, lambda *a: None, opset, origin, is_complex)


def test_user_before_project_before_torchlib_and_newest_opset_first():
    registry = Registry()
    torchlib, project, user = _rule(aten.sin.default, Origin.TORCHLIB), _rule(aten.sin.default, Origin.PROJECT), \
        _rule(aten.sin.default, Origin.USER)
    newer = _rule(aten.sin.default, Origin.PROJECT, opset=20)
    for rule in (torchlib, project, newer, user):
        registry.add(rule)
    assert registry.lookup(aten.sin.default, 18)[0] is user
    registry = Registry()
    for rule in (torchlib, project, newer):
        registry.add(rule)
    assert registry.lookup(aten.sin.default, 21)[0] is newer
    assert registry.lookup(aten.sin.default, 18)[0] is project


def test_lookup_says_why_no_rule_fits():
    registry = Registry()
    registry.add(_rule(aten.cos.default, Origin.PROJECT, opset=20))
    registry.add(_rule(aten.cos.default, Origin.TORCHLIB, is_complex=True))
    rule, reason = registry.lookup(aten.cos.default, 18)
    assert rule is None and "needs opset 20" in reason and "is for complex inputs" in reason
    assert registry.lookup(aten.tan.default, 18) == (None, "no lowering rule is registered for this op")


def test_dispatch_reads_complex_inputs_from_the_node():
    gm = torch.fx.symbolic_trace(lambda x: torch.sin(x))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.target = aten.sin.default
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    registry = default_registry()
    placeholder.meta["val"] = torch.empty(2)
    assert dispatch(node, registry, 18)[0] is not None
    placeholder.meta["val"] = torch.empty(2, dtype=torch.complex64)
    rule, reason = dispatch(node, registry, 18)
    assert rule is None and "real inputs" in reason


def test_a_packet_is_refused_with_the_overload_to_use():
    with pytest.raises(TypeError, match=r"use aten.relu.default"):
        aot2onnx.register_lowering(aten.relu)


def test_a_second_user_rule_is_refused_unless_it_overrides():
    def first(x):
        return op.Relu(x)

    def second(x):
        return op.Max(x, op.CastLike(0.0, x))

    with aot2onnx.scoped_lowerings():
        aot2onnx.register_lowering(aten.relu.default)(first)
        with pytest.raises(ValueError, match="already has the user lowering .*first.*override=True"):
            aot2onnx.register_lowering(aten.relu.default)(second)
        aot2onnx.register_lowering(aten.relu.default, override=True)(second)
        assert [r.function for r in user_rules() if r.target == aten.relu.default] == [second]
        assert default_registry().lookup(aten.relu.default, 18)[0].function is second
        assert aot2onnx.unregister_lowering(aten.relu.default) == 1
        assert default_registry().lookup(aten.relu.default, 18)[0].origin != Origin.USER


def test_scoped_lowerings_remove_what_the_block_registered():
    before = user_rules()
    with aot2onnx.scoped_lowerings():
        aot2onnx.register_lowering(aten.relu.default)(lambda x: op.Relu(x))
        assert len(user_rules()) == len(before) + 1
    assert user_rules() == before
    assert default_registry().lookup(aten.relu.default, 18)[0].origin != Origin.USER


def test_a_user_rule_changes_what_compiles_and_goes_away_with_its_scope():
    f = lambda x: torch.relu(x)  # noqa: E731
    x = torch.tensor([-1.0, 2.0])
    with aot2onnx.scoped_lowerings():
        aot2onnx.register_lowering(aten.relu.default)(lambda x: op.Mul(x, op.CastLike(3.0, x)))
        torch._dynamo.reset()
        assert torch.compile(f, backend="aot2onnx")(x).tolist() == [-3.0, 6.0]  # the user's (odd) rule ran
    torch._dynamo.reset()
    assert torch.compile(f, backend="aot2onnx")(x).tolist() == [0.0, 2.0]


def test_a_real_and_a_complex_project_rule_share_an_overload():
    """angle has a project rule for real inputs and one for complex ones: each input kind finds its own."""
    from aot2onnx.lower.registry import default_registry

    real, _ = default_registry().lookup(torch.ops.aten.angle.default, 18)
    complex_, _ = default_registry().lookup(torch.ops.aten.angle.default, 18, is_complex=True)
    assert (real.origin, real.is_complex, real.name) == ("aot2onnx", False, "aten_angle")
    assert (complex_.origin, complex_.is_complex, complex_.name) == ("aot2onnx", True, "aten_angle_complex")
