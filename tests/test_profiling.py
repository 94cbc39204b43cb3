"""The runtime's profiling hook: off by default, one timed entry per compiled-graph call inside a block."""

from __future__ import annotations

import json
import math

import pytest
import torch

import aot2onnx
from aot2onnx.runtime import session
from aot2onnx.runtime.session import profiling
from aot2onnx.signature import GraphKind


def _compiled_step():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    compiled = torch.compile(model, backend="aot2onnx")
    x = torch.randn(4, 8)

    def step() -> None:
        compiled(x).sum().backward()

    return step


def _graphs_and_runs() -> dict[str, int]:
    return {g.name: g.runs for g in aot2onnx.compiled_graphs()}


def test_profiling_records_one_timed_entry_per_graph_call():
    aot2onnx.reset_compiled_graphs()
    step = _compiled_step()
    step()  # compiles outside the block
    runs_before = _graphs_and_runs()
    assert len(runs_before) == 2
    with profiling() as profile:
        for _ in range(3):
            step()
    runs = {name: n - runs_before[name] for name, n in _graphs_and_runs().items()}
    assert runs == {name: 3 for name in runs_before}
    assert len(profile.calls) == 6
    assert [c.kind for c in profile.calls] == [GraphKind.FORWARD, GraphKind.BACKWARD] * 3
    assert {c.graph for c in profile.calls} == set(runs_before)
    for call in profile.calls:
        assert 0 < call.call_s < 60 and math.isfinite(call.call_s), call
        assert call.run_s is not None and 0 < call.run_s <= call.call_s, call  # the run is inside the call


def test_profiling_is_off_by_default_and_after_a_block():
    assert session._profile is None
    step = _compiled_step()
    step()
    with profiling() as profile:
        step()
    assert len(profile.calls) == 2
    step()  # after the block: recorded nowhere
    assert len(profile.calls) == 2 and session._profile is None
    with pytest.raises(RuntimeError, match="inside"):
        with profiling():
            raise RuntimeError("inside")
    assert session._profile is None


def test_a_nested_block_records_into_itself_and_the_outer_one_resumes():
    step = _compiled_step()
    step()
    with profiling() as outer:
        step()
        with profiling() as inner:
            step()
            step()
        step()
    assert len(inner.calls) == 4 and len(outer.calls) == 4


def test_ort_profiling_only_for_sessions_created_inside_a_block_that_asks(tmp_path):
    aot2onnx.reset_compiled_graphs()
    _compiled_step()()
    plain = aot2onnx.compiled_graphs()
    torch._dynamo.reset()  # or Dynamo serves the same graphs to the same code with new parameters
    with profiling(ort_profile_prefix=str(tmp_path / "ort")):
        step = _compiled_step()
        step()
    step()
    profiled = [g for g in aot2onnx.compiled_graphs() if g not in plain]
    assert len(plain) == len(profiled) == 2
    assert not any(g.session.get_session_options().enable_profiling for g in plain)
    for graph in profiled:
        assert graph.session.get_session_options().enable_profiling
        path = graph.session.end_profiling()
        assert path.startswith(str(tmp_path / "ort"))
        with open(path) as f:
            runs = [e for e in json.load(f) if e.get("cat") == "Session" and e.get("name") == "model_run"]
        assert len(runs) == graph.runs == 2
