"""Models holding tensor constants train in the default configuration, cold and then warm from a second
process, matching eager (tests/constant_models.py has the models).

With the persistent cache on (the default), making a graph's cache key once read a constant's data inside
AOTAutograd's fake mode, and every model holding a tensor constant failed to compile.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from constant_models import _inputs

MODELS = sorted(_inputs(torch.Generator()))


def _run(cache_dir: pathlib.Path, scale: str = "2.0") -> dict[str, dict]:
    env = {**os.environ, "AOT2ONNX_CACHE_DIR": str(cache_dir), "CONST_SCALE": scale}
    script = pathlib.Path(__file__).with_name("constant_models.py")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line[len("RESULT "):]) for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    return {r["model"]: r for r in results}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict[str, dict]]:
    cache_dir = tmp_path_factory.mktemp("constants-cache")
    cold = _run(cache_dir)
    warm = _run(cache_dir)
    changed = _run(cache_dir, scale="3.0")  # the same graphs with one constant's value changed
    return [cold, warm, changed]


@pytest.mark.parametrize("model", MODELS)
def test_constants_train_cold_and_warm_like_eager(runs, model):
    cold, warm, _ = runs
    for when, run in (("cold", cold), ("warm", warm)):
        result = run[model]
        assert result["ok"], f"{when}: {result['error']}"
        assert result["ort_runs"] > 0
    assert cold[model]["lowered"] > 0, cold[model]
    # The second process lowers nothing: every graph comes from the cache.
    assert warm[model]["lowered"] == 0 and warm[model]["cache_hits"] > 0, warm[model]
    assert warm[model]["losses"] == cold[model]["losses"]


def test_a_changed_constant_is_not_served_from_the_cache(runs):
    cold, _, changed = runs
    result = changed["TensorConstant"]
    assert result["ok"], result["error"]  # matched eager with the new value
    assert result["lowered"] > 0, result
    assert result["losses"] != cold["TensorConstant"]["losses"]
