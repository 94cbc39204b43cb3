"""The optimizer step compiled through aot2onnx: ``torch.compile(opt.step, backend="aot2onnx")``.

Dynamo traces torch.optim's single-tensor implementation (the one CPU tensors take) into one graph for all
parameters; AOTAutograd makes it an inference graph that keeps its writes to the parameters and the state
as ``copy_`` (capture/aot.py), and the runtime has ONNX Runtime write them straight into the tensors'
memory where that is safe (runtime/inplace.py). Every test trains against eager PyTorch with the same
optimizer and compares every parameter, buffer and state tensor, step counts included, after every step;
and nothing may run in PyTorch instead of ONNX Runtime.

Tolerances, and why they are what they are:

- Against ``aot_eager`` (the same graph, run by ATen's kernels): ATen's CPU kernels for ``lerp`` and ``add``
  with an alpha (SGD's ``param.add_(grad, alpha=-lr)``) round the multiply-add once (fma); ONNX has no fused
  multiply-add and rounds twice (lower/ops/fused.py), so an update can differ by one ulp. Over ten steps
  these add up (momentum carries them on), and the gradients of the next steps see them: a few ulps.
  RTOL 1e-5 (about 80 float32 ulps), ATOL 1e-6.
- Against eager, SGD: the compiled graph computes eager's formula, so as against ``aot_eager``.
- Against eager, Adam and AdamW: Dynamo traces the formulation with a tensor step (bias corrections, step
  size and the ``eps`` term computed as float32 tensors, ``addcmul_`` with a value rewritten as
  ``prims.fma``), eager the one with Python floats: the update rounds differently by a few ulps of lr in
  every step, and ``aot_eager`` is as far from eager as aot2onnx is (measured worst 7.7e-7 for both).
  RTOL 1e-5, ATOL lr / 1000 = 1e-5. Adam divides by the square root of the second moment, so a coordinate
  whose gradient is only rounding noise (one that nearly cancels) gets a full-size update from it, and a
  one-ulp change there moves it by up to lr per step (tests/test_export.py compares those at lr x steps);
  these models have no such coordinate.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import TensorProto, helper

import aot2onnx
from aot2onnx.compile.fallback import fallback_graphs, reset_fallback_graphs
from aot2onnx.runtime import inplace, session
from aot2onnx.signature import GraphSignature, InputKind, InputSpec, MutationSpec

STEPS = 10

OPTIMIZERS: dict[str, Callable] = {
    "sgd": lambda params, lr=0.05: torch.optim.SGD(params, lr=lr),
    "sgd-momentum": lambda params, lr=0.05: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "sgd-nesterov-wd": lambda params, lr=0.05: torch.optim.SGD(
        params, lr=lr, momentum=0.9, nesterov=True, weight_decay=1e-2
    ),
    "adamw": lambda params, lr=1e-2: torch.optim.AdamW(params, lr=lr),
    "adamw-amsgrad": lambda params, lr=1e-2: torch.optim.AdamW(params, lr=lr, amsgrad=True),
    "adam": lambda params, lr=1e-2: torch.optim.Adam(params, lr=lr, weight_decay=1e-2),
    # The other torch.optim optimizers with a single-tensor CPU step. Rprop's clamp(x, 1e-06, 50) (a float and
    # an int bound) failed the compile in the exporter's type promotion pass.
    "rprop": lambda params, lr=1e-2: torch.optim.Rprop(params, lr=lr),
    "rmsprop": lambda params, lr=1e-2: torch.optim.RMSprop(params, lr=lr, momentum=0.9, weight_decay=1e-3),
    "adagrad": lambda params, lr=0.1: torch.optim.Adagrad(params, lr=lr, lr_decay=1e-3, weight_decay=1e-3),
    "adamax": lambda params, lr=1e-2: torch.optim.Adamax(params, lr=lr),
    "nadam": lambda params, lr=1e-2: torch.optim.NAdam(params, lr=lr),
    "radam": lambda params, lr=1e-2: torch.optim.RAdam(params, lr=lr),
    "adadelta": lambda params, lr=1.0: torch.optim.Adadelta(params, lr=lr),
}

# (rtol, atol) against aot_eager and against eager; see the module's docstring.
AGAINST_AOT_EAGER = (1e-5, 1e-6)
# RMSprop's momentum buffer adds grad / sqrt(square_avg), about lr-free terms of size 10 here, which cancel
# (-10, -5.8, 0.43, -0.0496 on one coordinate): a one-ulp difference of those terms is 1e-6 absolute.
AGAINST_AOT_EAGER_FOR = {"rmsprop": (1e-5, 1e-5)}
AGAINST_EAGER = {
    "sgd": (1e-5, 1e-6),
    "sgd-momentum": (1e-5, 1e-6),
    "sgd-nesterov-wd": (1e-5, 1e-6),
    "adamw": (1e-5, 1e-5),
    "adamw-amsgrad": (1e-5, 1e-5),
    "adam": (1e-5, 1e-5),
    # Tensor-step formulations, as Adam's (aot_eager is as far from eager as aot2onnx is).
    **{name: (1e-5, 1e-5) for name in ("rprop", "rmsprop", "adagrad", "adamax", "nadam", "radam", "adadelta")},
}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batchnorm_frozen() -> nn.Module:
    """A BatchNorm (running statistics: buffers the compiled forward updates) and a frozen parameter (no
    gradient: the optimizer leaves it and keeps no state for it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    model[0].bias.requires_grad_(False)
    return model


def _data(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)) for _ in range(steps)]


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {p: n for n, p in model.named_parameters()}
    values = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    values.update({f"buffer {n}": b.clone() for n, b in model.named_buffers()})
    for p, state in opt.state.items():
        for key, value in state.items():
            values[f"state {names[p]} {key}"] = value.clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
    return values


def _train(
    make_model: Callable[[], nn.Module],
    make_opt: Callable,
    backend: str | None,
    *,
    compile_model: bool = False,
    lr=None,
    schedule: bool = False,
    data=None,
) -> tuple[list[dict[str, torch.Tensor]], list[session.OrtGraph]]:
    """Trains with the step compiled by ``backend`` (eager for ``None``): a snapshot after each step, and
    the step's ONNX Runtime graphs (taken while the compiled step holds them)."""
    aot2onnx.reset_compiled_graphs()
    model = make_model()
    opt = make_opt(model.parameters()) if lr is None else make_opt(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if schedule else None
    forward = torch.compile(model, backend=backend) if backend and compile_model else model
    step = torch.compile(opt.step, backend=backend) if backend else opt.step
    snapshots = []
    for x, y in data or _data():
        opt.zero_grad(set_to_none=True)
        F.mse_loss(forward(x), y).backward()
        step()
        if scheduler is not None:
            scheduler.step()
        snapshots.append(_snapshot(model, opt))
    return snapshots, [g for g in aot2onnx.compiled_graphs() if g.kind == "inference"]


def _assert_close(
    compiled: list[dict[str, torch.Tensor]], reference: list[dict[str, torch.Tensor]], rtol: float, atol: float, what: str
) -> None:
    assert len(compiled) == len(reference)
    for step, (c, r) in enumerate(zip(compiled, reference)):
        assert c.keys() == r.keys(), f"step {step}: {sorted(c.keys() ^ r.keys())}"
        for name in r:
            exact = not r[name].is_floating_point() or name.endswith(" step")
            torch.testing.assert_close(
                c[name], r[name], rtol=0 if exact else rtol, atol=0 if exact else atol,
                msg=lambda m, name=name, step=step: f"{what}, step {step}, {name}: {m}",
            )


def _assert_on_onnx_runtime(graphs: list[session.OrtGraph], caught: list[warnings.WarningMessage]) -> None:
    """Every step ran on ONNX Runtime (not in Dynamo's eager fallback), nothing of it fell back to PyTorch,
    and every write of the step went straight into its tensor."""
    assert fallback_graphs() == []
    assert [str(w.message) for w in caught if str(w.message).startswith("aot2onnx")] == []
    assert sum(g.runs for g in graphs) == STEPS, graphs
    for graph in graphs:
        assert graph.signature.mutations, graph
        assert graph.written_in_place == {m.onnx_name for m in graph.signature.mutations}, graph


# Every optimizer on the MLP; the BatchNorm model (slower: its forward and backward compile too) with one of
# each family.
CASES = [(name, "mlp") for name in OPTIMIZERS] + [
    (name, "batchnorm-frozen") for name in ("sgd-momentum", "sgd-nesterov-wd", "adamw-amsgrad")
]
# The default run takes one of each family and the BatchNorm model once (about 15 of the 40 s); -m slow the rest.
DEFAULT_CASES = {("sgd", "mlp"), ("sgd-momentum", "mlp"), ("adamw", "mlp"), ("adamw-amsgrad", "batchnorm-frozen"),
                 ("rprop", "mlp")}


@pytest.mark.parametrize("optimizer, model", [
    pytest.param(o, m, id=f"{o}-{m}", marks=[] if (o, m) in DEFAULT_CASES else [pytest.mark.slow]) for o, m in CASES
])
def test_step_matches_eager(optimizer, model, cache_off):
    make_model = {"mlp": _mlp, "batchnorm-frozen": _batchnorm_frozen}[model]
    # The BatchNorm model's forward and backward are compiled too (its buffers' writes go through
    # AOTAutograd's epilogue, the step's through copy_); the MLP's run eagerly, so that only the step differs.
    compile_model = model != "mlp"
    make_opt = OPTIMIZERS[optimizer]
    eager, _ = _train(make_model, make_opt, None)
    reference, _ = _train(make_model, make_opt, "aot_eager", compile_model=compile_model)
    reset_fallback_graphs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled, graphs = _train(make_model, make_opt, "aot2onnx", compile_model=compile_model)
    _assert_on_onnx_runtime(graphs, caught)
    _assert_close(compiled, reference, *AGAINST_AOT_EAGER_FOR.get(optimizer, AGAINST_AOT_EAGER), "against aot_eager")
    _assert_close(compiled, eager, *AGAINST_EAGER[optimizer], "against eager")
    if model != "mlp":  # the frozen parameter has neither state nor an update
        assert not any(k.startswith("state 0.bias") for k in compiled[-1])
        torch.testing.assert_close(compiled[-1]["param 0.bias"], make_model()[0].bias.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adamw-amsgrad"])
def test_in_place_writes_match_copies_bit_for_bit(optimizer, monkeypatch, cache_off):
    # ONNX Runtime writing parameters and state in place must compute exactly what it computes into fresh
    # outputs copied in afterwards.
    make_opt = OPTIMIZERS[optimizer]
    in_place, graphs = _train(_mlp, make_opt, "aot2onnx")
    assert graphs and all(g.written_in_place for g in graphs)
    torch._dynamo.reset()
    monkeypatch.setattr(session, "writable_in_place", lambda model, signature: frozenset())
    copied, graphs = _train(_mlp, make_opt, "aot2onnx")
    assert graphs and not any(g.written_in_place for g in graphs)
    _assert_close(in_place, copied, 0.0, 0.0, "in place against copies")


def test_step_served_by_the_caches(tmp_path):
    # A second process (here: Dynamo reset) gets the step from AOTAutograd's cache and the graph cache, the
    # parameters' and state's writes with it, and trains exactly as the first did.
    from torch._dynamo.utils import counters

    backend = aot2onnx.backend(cache_dir=str(tmp_path))
    runs = []
    for _ in range(2):
        torch._dynamo.reset()
        model = _mlp()
        opt = OPTIMIZERS["adamw"](model.parameters())
        step = torch.compile(opt.step, backend=backend)
        hits = counters["aot_autograd"]["autograd_cache_hit"]
        aot2onnx.reset_compiled_graphs()
        for x, y in _data(3):
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            step()
        graphs = [g for g in aot2onnx.compiled_graphs() if g.kind == "inference"]
        assert graphs and all(g.written_in_place == {m.onnx_name for m in g.signature.mutations} for g in graphs)
        runs.append((_snapshot(model, opt), counters["aot_autograd"]["autograd_cache_hit"] - hits))
    (first, first_hits), (second, second_hits) = runs
    assert first_hits == 0 and second_hits >= 1
    _assert_close([second], [first], 0.0, 0.0, "served by the caches")


# A learning-rate schedule: StepLR halves lr every two steps. A float lr is a constant of the graph that
# Dynamo guards on: SGD's add_(grad, alpha=-lr) specializes it, so every new value compiles a new graph
# (past torch._dynamo.config.recompile_limit, 8, Dynamo runs the step eagerly); Adam's graph takes it as an
# input after its first change. A tensor lr is an input from the start: one graph. Either way the step uses
# the new lr, which the comparison with eager's schedule shows.
@pytest.mark.parametrize(
    "optimizer, lr, graphs",
    [
        # the first step (no momentum buffer yet), then lr 0.05, 0.025, 0.0125
        pytest.param("sgd-momentum", 0.05, 4, id="sgd-float"),
        pytest.param("sgd-momentum", "tensor", 2, id="sgd-tensor", marks=pytest.mark.slow),  # the first, then every other
        pytest.param("adamw", 1e-2, 2, id="adamw-float", marks=pytest.mark.slow),  # lr 0.01, then lr as an input
        pytest.param("adamw", "tensor", 1, id="adamw-tensor"),
    ],
)
def test_learning_rate_schedule(optimizer, lr, graphs, cache_off):
    make_opt = OPTIMIZERS[optimizer]
    value = 0.05 if optimizer.startswith("sgd") else 1e-2
    data = _data(6)

    def lr_for_run():  # each optimizer gets its own tensor: the scheduler writes it in place
        return torch.tensor(value) if lr == "tensor" else lr

    eager, _ = _train(_mlp, make_opt, None, lr=lr_for_run(), schedule=True, data=data)
    compiled, step_graphs = _train(_mlp, make_opt, "aot2onnx", lr=lr_for_run(), schedule=True, data=data)
    _assert_close(compiled, eager, *AGAINST_EAGER[optimizer], "against eager, with a schedule")
    assert len({g.name for g in step_graphs}) == graphs
    # The schedule changed the update: without it the parameters end elsewhere.
    unscheduled, _ = _train(_mlp, make_opt, None, lr=lr_for_run(), data=data)
    assert not torch.allclose(unscheduled[-1]["param 0.weight"], eager[-1]["param 0.weight"], rtol=1e-3, atol=1e-4)


# --------------------------------------------------------------------------- which writes may go in place


def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    def info(name, shape):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    graph = helper.make_graph(nodes, "g", [info(*i) for i in inputs], [info(*o) for o in outputs], list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _signature(inputs: list[str], written: dict[int, str]) -> GraphSignature:
    return GraphSignature(
        tuple(InputSpec(InputKind.TENSOR, n) for n in inputs), (), tuple(MutationSpec(i, n) for i, n in written.items())
    )


def test_in_place_when_every_read_comes_first():
    # p_new = p * 2 + g: the Add that writes p reads only values made from p before it.
    model = _model(
        [helper.make_node("Mul", ["p", "two"], ["m"]), helper.make_node("Add", ["m", "g"], ["p_new"])],
        [("p", [4]), ("g", [4])], [("p_new", [4])], [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])],
    )
    assert inplace.writable_in_place(model, _signature(["p", "g"], {0: "p_new"})) == {"p_new"}


def test_in_place_when_the_writer_reads_elementwise():
    model = _model([helper.make_node("Add", ["p", "g"], ["p_new"])], [("p", [4]), ("g", [4])], [("p_new", [4])])
    assert inplace.writable_in_place(model, _signature(["p", "g"], {0: "p_new"})) == {"p_new"}


def test_not_in_place_when_a_read_may_come_after_the_write():
    # q = p * g does not feed the Add that writes p: ONNX Runtime may run it after the write.
    model = _model(
        [helper.make_node("Add", ["p", "g"], ["p_new"]), helper.make_node("Mul", ["p", "g"], ["q"])],
        [("p", [4]), ("g", [4])], [("p_new", [4]), ("q", [4])],
    )
    assert inplace.writable_in_place(model, _signature(["p", "g"], {0: "p_new"})) == frozenset()


def test_not_in_place_when_a_reshape_of_the_input_is_read_after_the_write():
    # ONNX Runtime may give r = Reshape(p) p's own memory: r is p.
    model = _model(
        [
            helper.make_node("Reshape", ["p", "shape"], ["r"]),
            helper.make_node("Add", ["g", "one"], ["p_new"]),
            helper.make_node("Mul", ["r", "r"], ["q"]),
        ],
        [("p", [4]), ("g", [4])], [("p_new", [4]), ("q", [2, 2])],
        [helper.make_tensor("shape", TensorProto.INT64, [2], [2, 2]), helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])],
    )
    assert inplace.writable_in_place(model, _signature(["p", "g"], {0: "p_new"})) == frozenset()


def test_not_in_place_when_the_writer_reads_across_elements():
    # MatMul reads a row of p for every output element.
    model = _model([helper.make_node("MatMul", ["p", "g"], ["p_new"])], [("p", [2, 2]), ("g", [2, 2])], [("p_new", [2, 2])])
    assert inplace.writable_in_place(model, _signature(["p", "g"], {0: "p_new"})) == frozenset()


def test_not_in_place_when_an_alias_of_the_input_is_returned():
    model = _model(
        [helper.make_node("Identity", ["p"], ["same"]), helper.make_node("Add", ["g", "g"], ["p_new"])],
        [("p", [4]), ("g", [4])], [("p_new", [4]), ("same", [4])],
    )
    assert inplace.writable_in_place(model, _signature(["p", "g"], {0: "p_new"})) == frozenset()
