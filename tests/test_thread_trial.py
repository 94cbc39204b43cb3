"""Threads and products per graph, measured (runtime/session.py): with the thread count left to aot2onnx, a CPU
graph's first calls go in turn to its session and to each candidate (one thread or torch's; ONNX Runtime's own
products in place of the fused kernels' ATen ones, on either), and the graph keeps the fastest. A graph whose
heavy kernels are the fused kernels' starts on one thread, one with ONNX Runtime's convolutions or products on
torch's count.
Whichever it keeps, training matches eager; the trial stays out of graphs with random ops and of explicit
thread counts. Speed is not tested here: the benchmark reports what the trial gives."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import aot2onnx
from aot2onnx.runtime import fused, rewrites, session

# Past the trial's end: four candidates (the graph's own session among them), each run once untimed.
STEPS = session._TRIAL_WARMUP + 4 * (session._TRIAL_RUNS + 1) + 3


def fused_library_built() -> bool:
    return fused.library() is not None


def _train(model: nn.Module, compiled, steps: int, dropout_seed: int | None = None) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randn(32, 4, generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(compiled(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.LayerNorm(64), nn.Linear(64, 4))


@pytest.mark.parametrize("keeps", ["measured", "a candidate", "its own"])
def test_training_matches_eager_whichever_session_the_trial_keeps(keeps, two_threads, monkeypatch):
    # The margin decides: 0 keeps the first session whatever was measured, a huge one the fastest candidate.
    if keeps != "measured":
        monkeypatch.setattr(session, "_TRIAL_MARGIN", 1e9 if keeps == "a candidate" else 0.0)
    aot2onnx.reset_compiled_graphs()
    eager_model = _model()
    compiled_model = copy.deepcopy(eager_model)
    eager = _train(eager_model, eager_model, STEPS)
    compiled = _train(compiled_model, torch.compile(compiled_model, backend="aot2onnx"), STEPS)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    for a, b in zip(compiled_model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    graphs = [g for g in aot2onnx.compiled_graphs() if g.session is not None]
    assert len(graphs) == 2
    fused = fused_library_built()
    for g in graphs:
        trial = g.thread_trial
        assert trial is not None and not g.trial_pending, g  # settled
        assert trial["threads"] == (1 if fused else 2)  # the products and the norm are ATen's: one thread first
        assert trial["median_run_s"] > 0 and trial["one_thread_median_run_s"] > 0
        medians = trial["median_run_s_by_candidate"]
        own = next(iter(medians))
        assert list(medians)[:2] == (["1 thread, ATen's products", "2 threads, ATen's products"] if fused
                                     else ["2 threads", "1 thread"]), medians
        # With the fused kernels, the graphs' products are ATen's, and ONNX Runtime's own are candidates.
        assert len(medians) == (4 if fused else 2) and all(m > 0 for m in medians.values()), medians
        fastest = min(list(medians)[1:], key=medians.get)
        if keeps == "a candidate":
            assert trial["kept"] == fastest
        elif keeps == "its own":
            assert trial["kept"] == own
        else:
            assert trial["kept"] == (fastest if medians[fastest] < session._TRIAL_MARGIN * medians[own] else own)
        assert g.intra_op_threads == (1 if trial["kept"].startswith("1 thread") else 2)


def test_no_trial_for_an_explicit_thread_count_and_one_torch_thread_weighs_products_only(two_threads):
    aot2onnx.reset_compiled_graphs()
    model = _model()
    _train(model, torch.compile(model, backend="aot2onnx", options={"intra_op_num_threads": 2}), STEPS)
    explicit = [g for g in aot2onnx.compiled_graphs() if g.session is not None]
    assert len(explicit) == 2 and all(g.thread_trial is None and g.intra_op_threads == 2 for g in explicit)
    torch.set_num_threads(1)
    aot2onnx.reset_compiled_graphs()
    model = _model()
    _train(model, torch.compile(model, backend="aot2onnx"), STEPS)
    graphs = [g for g in aot2onnx.compiled_graphs() if g.session is not None]
    assert len(graphs) == 2 and all(g.intra_op_threads == 1 for g in graphs)
    if fused_library_built():  # one thread: ATen's products against ONNX Runtime's, nothing else
        assert all(list(g.thread_trial["median_run_s_by_candidate"]) == ["1 thread, ATen's products",
                                                                         "1 thread, MLAS's products"] for g in graphs)
    else:
        assert all(g.thread_trial is None for g in graphs)


@pytest.mark.skipif(not fused_library_built(), reason="the fused kernels are not built")
def test_graphs_start_on_one_thread_where_the_fused_kernels_do_the_heavy_work(two_threads):
    # Products, norms, activations and the convolution's gradient in the fused kernels (ATen's, on torch's
    # OpenMP threads): one intra-op thread. ONNX Runtime's convolution runs on its pool: torch's count. An
    # explicit count is kept.
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    for model, x, threads, options in ((mlp, torch.randn(32, 16), [1, 1], {}), (cnn, torch.randn(4, 3, 8, 8), [2, 1], {}),
                                       (mlp, torch.randn(32, 16), [2, 2], {"intra_op_num_threads": 2})):
        aot2onnx.reset_compiled_graphs()
        torch._dynamo.reset()
        torch.compile(model, backend="aot2onnx", options={"cache": False, **options})(x).sum().backward()
        graphs = [g for g in aot2onnx.compiled_graphs() if g.session is not None]
        assert [g.kind.value for g in graphs] == ["forward", "backward"]
        assert [g.intra_op_threads for g in graphs] == threads, [dict(g.op_counts) for g in graphs]


def test_no_trial_for_a_graph_with_random_ops(two_threads):
    # A second session would replay the first one's dropout masks from the start: its kernels keep their own
    # generators, seeded alike.
    aot2onnx.reset_compiled_graphs()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5), nn.Linear(64, 4))
    _train(model, torch.compile(model, backend="aot2onnx"), STEPS)
    forward = [g for g in aot2onnx.compiled_graphs() if g.kind == "forward"]
    assert len(forward) == 1 and forward[0].op_counts["Dropout"] == 1
    assert forward[0].thread_trial is None and forward[0].intra_op_threads == (1 if fused_library_built() else 2)


def test_no_trial_for_a_profiled_session(two_threads, tmp_path):
    # A session with ONNX Runtime's profiler on keeps every run in one trace (the benchmark reads it).
    from aot2onnx.runtime.session import profiling

    aot2onnx.reset_compiled_graphs()
    model = _model()
    compiled = torch.compile(model, backend="aot2onnx")
    with profiling(ort_profile_prefix=str(tmp_path / "ort")):
        _train(model, compiled, 1)
    _train(model, compiled, STEPS)
    graphs = [g for g in aot2onnx.compiled_graphs() if g.session is not None]
    threads = 1 if fused_library_built() else 2
    assert len(graphs) == 2 and all(g.thread_trial is None and g.intra_op_threads == threads for g in graphs)
    for g in graphs:
        g.session.end_profiling()


def test_spinning_during_runs_only(two_threads):
    """allow_spinning="run": the pool's threads spin between a run's operators and stop when it returns
    (ONNX Runtime's force_spinning_stop), read back from the session; training matches eager."""
    aot2onnx.reset_compiled_graphs()
    eager_model = _model()
    compiled_model = copy.deepcopy(eager_model)
    eager = _train(eager_model, eager_model, 4)
    compiled = _train(compiled_model, torch.compile(compiled_model, backend="aot2onnx",
                                                    options={"allow_spinning": "run"}), 4)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    graphs = [g for g in aot2onnx.compiled_graphs() if g.session is not None]
    assert graphs
    for g in graphs:
        so = g.session.get_session_options()
        assert so.get_session_config_entry("session.intra_op.allow_spinning") == "1"
        assert so.get_session_config_entry("session.force_spinning_stop") == "1"
    with pytest.raises(ValueError, match="allow_spinning"):
        aot2onnx.Options(allow_spinning="sometimes")


def test_a_scatter_with_a_reduction_runs_on_one_thread(two_threads):
    """ONNX Runtime's CPU ScatterND with a reduction splits its updates among threads, and two threads adding
    to one row lose one's update: an embedding's gradient over 8192 tokens of a 4096-word vocabulary came out
    up to 2.8 off on two threads. Its graph runs on one thread, and the gradient is eager's, bit for bit, on
    every step (the race gave a different result from run to run). Without aot2onnx's fused kernels: with them,
    the gradient is one fused node that keeps its threads (tests/test_fused_kernels.py)."""
    torch.manual_seed(0)
    embedding = nn.Embedding(4096, 768)
    tokens = torch.randint(0, 4096, (8, 1024))
    upstream = torch.randn(8, 1024, 768)
    compiled = torch.compile(embedding, backend="aot2onnx",
                             options={"cache": False, "fallback": False, "fused_kernels": False})
    expected = torch.ops.aten.embedding_dense_backward(upstream, tokens, 4096, -1, False)
    for _ in range(4):
        embedding.weight.grad = None
        compiled(tokens).backward(upstream)
        assert torch.equal(embedding.weight.grad, expected)
    backward = [g for g in session.compiled_graphs() if g.serial]
    assert backward and all(g.intra_op_threads == 1 and g.thread_trial is None for g in backward)


def test_serial_nodes_names_the_reducing_scatters_only():
    from onnx import TensorProto, helper

    def scatter(name, **reduction):
        return helper.make_node("ScatterND", ["data", "idx", "upd"], [name], name=name, **reduction)

    graph = helper.make_graph(
        [scatter("plain"), scatter("none", reduction="none"), scatter("adds", reduction="add"),
         scatter("maxes", reduction="max")], "g",
        [helper.make_tensor_value_info("data", TensorProto.FLOAT, [4, 2]),
         helper.make_tensor_value_info("idx", TensorProto.INT64, [3, 1]),
         helper.make_tensor_value_info("upd", TensorProto.FLOAT, [3, 2])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 2]) for n in ("plain", "none", "adds", "maxes")])
    assert sorted(rewrites.serial_nodes(helper.make_model(graph))) == ["adds", "maxes"]


def test_a_graph_reports_its_trial_under_way_until_it_settles(two_threads):
    aot2onnx.reset_compiled_graphs()
    model = _model()
    compiled = torch.compile(model, backend="aot2onnx")
    _train(model, compiled, 1)
    graphs = [g for g in aot2onnx.compiled_graphs() if g.session is not None]
    assert len(graphs) == 2 and all(g.trial_pending and g.thread_trial is None for g in graphs)
    _train(model, compiled, STEPS - 1)
    assert all(not g.trial_pending and g.thread_trial is not None for g in graphs)


def test_no_trial_where_torch_asks_for_deterministic_algorithms(two_threads):
    """The trial keeps ATen's or MLAS's products by timing them, so the values could differ from process to
    process; with torch.use_deterministic_algorithms(True) every graph keeps its own session, and two trainings
    give the same bits."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            torch._dynamo.reset()
            aot2onnx.reset_compiled_graphs()
            model = _model()
            losses = _train(model, torch.compile(model, backend="aot2onnx"), STEPS)
            graphs = [g for g in aot2onnx.compiled_graphs() if g.session is not None]
            assert len(graphs) == 2 and all(not g.trial_pending and g.thread_trial is None for g in graphs)
            runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    finally:
        torch.use_deterministic_algorithms(previous)
    (a, pa), (b, pb) = runs
    assert a == b and all(torch.equal(x, y) for x, y in zip(pa, pb))
