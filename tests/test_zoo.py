"""The model zoo (``tests/zoo.py``): every member trains through aot2onnx like eager PyTorch, and what falls
back to PyTorch is exactly its entry in ``zoo.FALLBACKS``."""

from __future__ import annotations

import pytest
import zoo
from torch._dynamo.utils import counters


def _param(member: zoo.Member):
    return pytest.param(member, id=member.name, marks=[pytest.mark.slow] if member.slow else [])


@pytest.mark.parametrize("member", [_param(m) for m in zoo.MEMBERS])
def test_member_trains_like_eager(member: zoo.Member):
    counters.clear()
    if member.xfail:
        # Strict: a pass fails here, and so does an error other than the one expected.
        with pytest.raises(Exception, match=member.xfail_match):
            zoo.check(member)
        pytest.xfail(member.xfail)
    fallen_back = zoo.check(member)
    assert fallen_back == zoo.FALLBACKS[member.name], (
        f"ops that fell back to PyTorch changed: {sorted(fallen_back)}; the table says "
        f"{sorted(zoo.FALLBACKS[member.name])} (update tests/zoo.py FALLBACKS if this is intended)"
    )
    # One Dynamo graph per model: a graph break would leave model code between graphs to Python.
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_the_zoo_covers_the_architectures_it_promises():
    assert len(zoo.MEMBERS) >= 12
    assert len({m.family for m in zoo.MEMBERS}) >= 5
    assert set(zoo.FALLBACKS) == {m.name for m in zoo.MEMBERS}
    assert any(not m.slow for m in zoo.MEMBERS if m.allow_rnn)
    for m in zoo.MEMBERS:
        assert m.tol == (1e-4, 1e-5) or m.tol_reason, f"{m.name}: a looser tolerance says why"
        assert not m.torch_compute or zoo.FALLBACKS[m.name], f"{m.name}: only a fallback runs model compute in torch"
        assert bool(m.xfail) == bool(m.xfail_match), f"{m.name}: an expected failure has a reason and a match"


def test_report_row():
    row = zoo.report_row(next(m for m in zoo.MEMBERS if m.name == "dlrm"), steps=3)
    assert row["member"] == "dlrm" and row["fallbacks"] == []
    assert row["loss_diff"] < 1e-5 and row["grad_diff"] < 1e-5
    assert row["loss_floor"] is not None and row["grad_floor"] is not None
    assert row["eager_ms"] > 0 and row["compiled_ms"] > 0  # reported, never asserted on
