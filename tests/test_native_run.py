"""The native run (runtime/native_run.py, native_run.cc): a CPU graph's session opened again through ONNX
Runtime's C API and run by one torch operator call. It must be the same session: the same optimized graph,
the same bits as the Python session it twins, the options aot2onnx sets (disabled optimizers included)
carried over; its outputs own their memory past the session; a graph that cannot have one keeps the Python
run. Speed is not tested here: the benchmark reports it."""

from __future__ import annotations

import copy
import gc
import pathlib
import re
import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import helper

import aot2onnx
from aot2onnx.errors import RuntimeSessionError
from aot2onnx.options import Options
from aot2onnx.runtime import fused, native_run
from aot2onnx.runtime.session import OrtGraph, session_options

pytestmark = pytest.mark.skipif(fused.library() is None, reason=f"{fused.missing_reason()}")


def _graphs() -> list[OrtGraph]:
    return [g for g in aot2onnx.compiled_graphs() if g.session is not None]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _model(nodes, inputs, outputs, initializers=()) -> bytes:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def test_every_session_config_entry_aot2onnx_sets_is_carried_over():
    # A key set somewhere in the package but not in CONFIG_KEYS would make a twin that differs from its session.
    package = pathlib.Path(aot2onnx.__file__).parent
    keys = set()
    for path in package.rglob("*.py"):
        keys |= set(re.findall(r'add_session_config_entry\(\s*"([^"]+)"', path.read_text()))
    assert keys and keys <= set(native_run.CONFIG_KEYS), keys - set(native_run.CONFIG_KEYS)


def test_the_recipe_reads_the_sessions_options():
    so = session_options(Options(), intra_op_threads=1, fused_kernels=True)
    recipe = native_run.recipe(so, ["NoopElimination", "ExpandElimination"])
    assert recipe["intra"] == 1 and recipe["mem_pattern"] is False
    assert recipe["level"] == int(so.graph_optimization_level)
    config = dict(zip(recipe["config"][::2], recipe["config"][1::2]))
    assert config["session.intra_op.allow_spinning"] == so.get_session_config_entry("session.intra_op.allow_spinning")
    assert config["session.use_env_allocators"] == "1"
    assert config["optimization.disable_specified_optimizers"] == "NoopElimination;ExpandElimination"
    so.enable_profiling = True
    assert native_run.recipe(so, []) is None  # a profiled session's trace must hold every run


def test_disabled_optimizers_reach_the_native_session():
    # Both rewrites aot2onnx turns off, at once. NoopElimination: (-x + 0.0) * 3 at x = 0 is +0.0 in eager, -0.0
    # with the Add dropped. ExpandElimination: Expand([1, 4] -> [0, 4]) taken for a no-op gives [1, 4]. The twin
    # must disable both as the Python session does (a list ONNX Runtime misreads disables neither), and only
    # where asked.
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Add", ["n", "zero"], ["s"]),
             helper.make_node("Mul", ["s", "three"], ["y"]), helper.make_node("Unsqueeze", ["t", "axis"], ["u"]),
             helper.make_node("Expand", ["u", "empty"], ["e"]), helper.make_node("Mul", ["e", "three"], ["z"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2]),
                           helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, [4])],
                   [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in ("y", "z")],
                   [onnx.numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
                    onnx.numpy_helper.from_array(np.array(3.0, np.float32), "three"),
                    onnx.numpy_helper.from_array(np.array([0], np.int64), "axis"),
                    onnx.numpy_helper.from_array(np.array([0, 4], np.int64), "empty")])
    x, t = torch.tensor([0.0, 1.0]), torch.randn(4)
    so = session_options(Options())
    disabled = ["NoopElimination", "ExpandElimination"]
    python = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"], disabled_optimizers=disabled)
    y, z = (torch.from_numpy(a) for a in python.run(None, {"x": x.numpy(), "t": t.numpy()}))
    assert torch.equal(_bits(y), _bits(torch.tensor([0.0, -3.0]))) and z.shape == (0, 4)
    for names in (disabled, disabled[::-1]):
        twin = native_run.NativeSession(model, native_run.recipe(so, names), False, ["x", "t"], ["y", "z"])
        native_y, native_z = twin.run([x, t])
        assert torch.equal(_bits(native_y), _bits(y)) and native_z.shape == (0, 4)
    plain_y, plain_z = native_run.NativeSession(model, native_run.recipe(so, []), False, ["x", "t"],
                                                ["y", "z"]).run([x, t])
    # the test tells the two apart
    assert torch.equal(_bits(plain_y), _bits(torch.tensor([-0.0, -3.0]))) and plain_z.shape == (1, 4)


def test_the_twin_plans_the_same_optimized_graph(tmp_path):
    # A transformer block's forward graph, fused kernels and all: ONNX Runtime's optimized model is the same
    # node for node through either API.
    aot2onnx.reset_compiled_graphs()
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    compiled = torch.compile(layer, backend="aot2onnx", options={"fallback": False})
    compiled(torch.randn(2, 8, 32)).sum().backward()
    for g in _graphs():
        model_bytes, so, disabled = g.session._aot2onnx_made_of
        python_path, native_path = tmp_path / f"{g.kind.value}_python.onnx", tmp_path / f"{g.kind.value}_native.onnx"
        saving = session_options(Options(), intra_op_threads=so.intra_op_num_threads, fused_kernels=g.fused_kernels)
        saving.optimized_model_filepath = str(python_path)
        ort.InferenceSession(model_bytes, saving, providers=["CPUExecutionProvider"], disabled_optimizers=disabled)
        native_run.NativeSession(model_bytes, native_run.recipe(so, disabled), g.fused_kernels, g._one_call.names,
                                 g._one_call.output_names, optimized_path=str(native_path))
        python, native = onnx.load(python_path), onnx.load(native_path)
        assert [(n.domain, n.op_type, list(n.input), list(n.output)) for n in python.graph.node] == [
            (n.domain, n.op_type, list(n.input), list(n.output)) for n in native.graph.node]
        assert any(n.domain == "aot2onnx.fused" for n in native.graph.node)


def _sgd_steps(fn, model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The losses and gradients of ``steps`` SGD steps of ``model`` run through ``fn``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(fn(x), y)
        loss.backward()
        seen += [loss.detach(), *(p.grad.clone() for p in model.parameters())]
        opt.step()
    return seen


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int,
           **options) -> tuple[list[torch.Tensor], dict[str, bool]]:
    """The losses and gradients of ``steps`` compiled SGD steps, and whether each graph ran natively."""
    compiled = torch.compile(model, backend="aot2onnx", options={"fallback": False, **options})
    return _sgd_steps(compiled, model, x, y, steps), {g.kind.value: g.native for g in _graphs()}


def test_training_runs_natively_with_the_python_sessions_bits_and_eagers_numbers(monkeypatch):
    # One thread (no thread trial): every call native, the same bits as with the switch off, eager's numbers.
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 5))
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    runs = {}
    for enabled in (True, False):
        monkeypatch.setattr(native_run, "ENABLED", enabled)
        torch.compiler.reset()  # else Dynamo's cache hands the second run the first one's graphs
        aot2onnx.reset_compiled_graphs()
        runs[enabled], native = _train(copy.deepcopy(base), x, y, 4, intra_op_num_threads=1)
        assert native == {"forward": enabled, "backward": enabled}
    assert len(runs[True]) == len(runs[False])
    for a, b in zip(runs[True], runs[False]):
        assert torch.equal(_bits(a), _bits(b))
    eager_model = copy.deepcopy(base)
    eager = _sgd_steps(eager_model, eager_model, x, y, 4)
    for a, b in zip(runs[True], eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_session_a_thread_trial_keeps_runs_natively_with_its_bits():
    # Default options: the first calls run natively, the trial's on the Python sessions (their timings compare
    # like with like), then the kept session's twin; a step through it has the kept Python session's bits.
    aot2onnx.reset_compiled_graphs()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 5))
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    compiled = torch.compile(model, backend="aot2onnx", options={"fallback": False})
    assert native_run.ENABLED
    first = True
    while first or any(g.trial_pending for g in _graphs()):
        F.cross_entropy(compiled(x), y).backward()
        if first:
            assert all(g.native for g in _graphs())
            first = False
    graphs = _graphs()
    assert all(g.thread_trial is not None for g in graphs)

    def step() -> list[torch.Tensor]:
        model.zero_grad()
        loss = F.cross_entropy(compiled(x), y)
        loss.backward()
        return [loss.detach(), *(p.grad.clone() for p in model.parameters())]

    step()  # the first call after the trial opens the kept session's twin
    assert all(g.native for g in graphs)
    native = step()
    twins = {g: g._native for g in graphs}
    for g in graphs:
        g._native = False
    python = step()
    for g in graphs:
        g._native = twins[g]
    for a, b in zip(native, python):
        assert torch.equal(_bits(a), _bits(b))


def test_outputs_outlive_the_native_session_and_keep_their_values():
    nodes = [helper.make_node("Neg", ["x"], ["y"]), helper.make_node("Greater", ["x", "zero"], ["b"]),
             helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Slice", ["x", "zero_i", "zero_i"], ["e"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [64, 64])],
                   [helper.make_tensor_value_info(o, t, None) for o, t in
                    (("y", onnx.TensorProto.FLOAT), ("b", onnx.TensorProto.BOOL), ("s", onnx.TensorProto.INT64),
                     ("e", onnx.TensorProto.FLOAT))],
                   [onnx.numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
                    onnx.numpy_helper.from_array(np.array([0], np.int64), "zero_i")])
    session = native_run.NativeSession(model, native_run.recipe(session_options(Options()), []), False, ["x"],
                                       ["y", "b", "s", "e"])
    x = torch.randn(64, 64)
    y, b, s, e = session.run([x])
    del session
    gc.collect()
    _ = [torch.randn(64, 64) * 2 for _ in range(50)]  # reuse freed memory, were the outputs' freed
    assert torch.equal(y, -x) and torch.equal(b, x > 0) and b.dtype == torch.bool
    assert s.dtype == torch.int64 and s.tolist() == [64, 64]
    assert e.shape == (0, 64)
    y.add_(1)  # writable, as torch's own tensors
    assert torch.equal(y, 1 - x)


def test_a_failing_run_raises_onnx_runtimes_error():
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n"]),
                           helper.make_tensor_value_info("shape", onnx.TensorProto.INT64, [1])],
                   [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    session = native_run.NativeSession(model, native_run.recipe(session_options(Options()), []), False,
                                       ["x", "shape"], ["y"])
    assert torch.equal(session.run([torch.arange(6.0), torch.tensor([6])])[0], torch.arange(6.0))
    with pytest.raises(RuntimeError, match="Reshape"):
        session.run([torch.arange(6.0), torch.tensor([5])])
    with pytest.raises(RuntimeError, match="1 inputs for a session of 2"):
        session.run([torch.arange(6.0)])
    # A strided input is copied to a contiguous one before the run (the caller need not look at every tensor).
    strided = torch.arange(12.0)[::2]
    assert torch.equal(session.run([strided, torch.tensor([6])])[0], strided)
    assert torch.equal(session.run([torch.arange(12.0).reshape(2, 6).t()[0], torch.tensor([2])])[0],
                       torch.tensor([0.0, 6.0]))
    with pytest.raises(RuntimeError, match="input x is on meta, the session's are on the CPU"):
        session.run([torch.empty(6, device="meta"), torch.tensor([6])])


def test_a_compiled_graphs_failing_native_run_says_which_graph():
    aot2onnx.reset_compiled_graphs()
    compiled = torch.compile(lambda a: (a * 2).relu(), backend="aot2onnx", options={"fallback": False})
    a = torch.randn(12)
    assert torch.equal(compiled(a), (a * 2).relu())
    [graph] = _graphs()
    assert graph.native

    class Failing:
        def run(self, tensors):
            raise RuntimeError("the C API said no")

    graph._native = Failing()
    with pytest.raises(RuntimeSessionError, match=f"failed running graph '{graph.name}': the C API said no"):
        compiled(a)


def test_a_static_graph_looks_at_input_shapes_once_and_onnx_runtime_refuses_another():
    """A graph whose inputs all have static shapes has them checked at its first run only: ONNX Runtime refuses
    any other shape, so a later run cannot return outputs of shapes the graph does not declare. A strided input
    reaches the twin as it is and is copied there."""
    aot2onnx.reset_compiled_graphs()
    compiled = torch.compile(lambda a, b: a @ b + 1, backend="aot2onnx", options={"fallback": False})
    a, b = torch.randn(4, 3), torch.randn(3, 5)
    assert torch.equal(compiled(a, b), a @ b + 1)
    [graph] = _graphs()
    assert graph.native and graph._static_inputs
    strided = torch.randn(5, 3).t()  # [3, 5], not contiguous
    [out] = graph([a, strided])
    assert torch.equal(out, graph([a, strided.contiguous()])[0])
    torch.testing.assert_close(out, a @ strided + 1)
    with pytest.raises(RuntimeSessionError, match="dimensions"):
        graph([torch.randn(4, 3), torch.randn(3, 6)])
    # A tensor on another device, not a scalar, is refused before the run (by the twin, or by Python on a
    # thread trial's turn), naming the graph.
    with pytest.raises(RuntimeSessionError, match=f"graph '{graph.name}'.*on meta"):
        graph([a, torch.empty(3, 5, device="meta")])


def test_runs_from_two_threads_at_once():
    aot2onnx.reset_compiled_graphs()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    compiled = torch.compile(model, backend="aot2onnx", options={"fallback": False, "intra_op_num_threads": 1})
    xs = [torch.randn(16, 32) for _ in range(4)]
    with torch.no_grad():
        expected = [compiled(x) for x in xs]
    assert all(g.native for g in _graphs())
    results: dict[int, list[torch.Tensor]] = {}

    def work(k: int) -> None:
        with torch.no_grad():
            results[k] = [compiled(x) for x in xs for _ in range(20)]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(3):
        for j, out in enumerate(results[k]):
            assert torch.equal(out, expected[j // 20])


def test_a_second_copy_of_the_library_says_it_cannot_register_and_does_not_end_the_process(tmp_path):
    # The operators are registered when Python asks, not when the library loads: a copy loaded beside the one in
    # use finds the namespace taken and returns the error.
    import ctypes
    import shutil

    assert native_run.available()
    copy_path = tmp_path / "libaot2onnx_fused_copy.so"
    shutil.copy(fused.library(), copy_path)
    register = ctypes.CDLL(str(copy_path)).aot2onnx_register_native_ops
    register.restype = ctypes.c_char_p
    error = register()
    assert error is not None and b"aot2onnx_native" in error
    assert native_run.available()  # the first copy's operators still run



def test_profiled_calls_draw_dropout_from_the_same_session():
    # Each session's random ops start from the seeds in the model: were profiled calls run on the Python session
    # and the others on the twin, the profiled ones would repeat the twin's first masks. Calls profiled in turn
    # draw the same masks as calls that are not.
    from aot2onnx.runtime.session import profiling

    def masks(profiled_calls: set[int]) -> list[torch.Tensor]:
        torch.compiler.reset()
        aot2onnx.reset_compiled_graphs()
        torch.manual_seed(0)  # the seeds lowering draws
        compiled = torch.compile(lambda x: F.dropout(x, 0.5, training=True), backend="aot2onnx",
                                 options={"fallback": False})
        x = torch.ones(4096)
        out = []
        for call in range(4):
            if call in profiled_calls:
                with profiling():
                    out.append(compiled(x))
            else:
                out.append(compiled(x))
        assert all(g.native for g in _graphs())
        return out

    plain, profiled = masks(set()), masks({1, 3})
    assert not torch.equal(plain[0], plain[1])  # the masks differ from call to call
    for a, b in zip(plain, profiled):
        assert torch.equal(a, b)
