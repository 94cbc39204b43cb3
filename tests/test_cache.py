"""The persistent cache of lowered graphs: hits across compilations, atomic writes, verification, off switch."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import aot2onnx
from aot2onnx.cache import GraphCache


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.GELU(), torch.nn.Linear(16, 2))


def _step(model, options):
    compiled = torch.compile(model, backend=aot2onnx.backend(**options))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    out = compiled(x)
    out.sum().backward()
    return out


def _entries(directory) -> list[str]:
    return sorted(
        os.path.join(root, name) for root, _, names in os.walk(directory) for name in names if name.endswith(".onnxentry")
    )


def test_second_compilation_hits_the_cache_and_matches(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="aot2onnx")
    model = _model().eval()  # no dropout: outputs comparable between the two compilations
    first = _step(model, {"cache_dir": str(tmp_path)})
    assert len(_entries(tmp_path)) == 2  # forward and backward
    assert "(lowered)" in caplog.text and "(cache hit)" not in caplog.text
    caplog.clear()
    torch._dynamo.reset()
    grads_before = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    second = _step(model, {"cache_dir": str(tmp_path)})
    assert caplog.text.count("(cache hit)") == 2 and "(lowered)" not in caplog.text
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    for g, p in zip(grads_before, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    torch.testing.assert_close(second, model(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))))


def test_other_shapes_options_or_rules_miss(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="aot2onnx")
    model = _model()
    _step(model, {"cache_dir": str(tmp_path)})
    torch._dynamo.reset()
    _step(model, {"cache_dir": str(tmp_path), "opset": 20})  # another opset: another model
    assert len(_entries(tmp_path)) == 4
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=aot2onnx.backend(cache_dir=str(tmp_path)))
    compiled(torch.randn(6, 8)).sum().backward()  # another batch size
    assert len(_entries(tmp_path)) == 6


def test_cache_off(tmp_path, monkeypatch):
    _step(_model(), {"cache_dir": str(tmp_path), "cache": False})
    assert _entries(tmp_path) == []
    torch._dynamo.reset()
    monkeypatch.setenv("AOT2ONNX_CACHE_DIR", "off")
    _step(_model(), {})
    assert _entries(tmp_path) == []


def test_a_corrupt_entry_is_ignored_and_replaced(tmp_path, caplog):
    _step(_model(), {"cache_dir": str(tmp_path)})
    for path in _entries(tmp_path):
        data = open(path, "rb").read()
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])  # truncated, as a crash without atomic writes would leave it
    torch._dynamo.reset()
    caplog.set_level(logging.INFO, logger="aot2onnx")
    _step(_model(), {"cache_dir": str(tmp_path)})
    assert caplog.text.count("does not verify") == 2 and caplog.text.count("(lowered)") == 2
    cache = GraphCache(tmp_path)
    for path in _entries(tmp_path):
        assert cache.load(os.path.basename(path).split(".")[0]) is not None


def test_a_writer_killed_mid_write_leaves_no_entry(tmp_path):
    # The writer dies after writing the temporary file and before the rename that would publish it.
    script = textwrap.dedent(
        f"""
        import os, torch, aot2onnx
        publish = os.replace
        def die(src, dst):
            if str(dst).endswith(".onnxentry"):
                os._exit(9)
            publish(src, dst)
        os.replace = die
        model = torch.nn.Linear(4, 4)
        torch.compile(model, backend=aot2onnx.backend(cache_dir={str(tmp_path)!r}))(torch.randn(2, 4)).sum().backward()
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 9, result.stderr[-2000:]
    assert _entries(tmp_path) == []
    leftovers = [n for _, _, names in os.walk(tmp_path) for n in names if n.startswith(".tmp-")]
    assert leftovers, "the writer should have died with its temporary file written"


@pytest.mark.parametrize("value", ["", "0", "off"])
def test_env_switch_turns_the_cache_off(monkeypatch, value):
    from aot2onnx.cache import default_cache_dir

    monkeypatch.setenv("AOT2ONNX_CACHE_DIR", value)
    assert default_cache_dir() is None
