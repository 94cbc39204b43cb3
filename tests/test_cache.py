"""The persistent caches: lowered graphs, and AOTAutograd's entries above them (hits across compilations and
processes, side effects kept on a hit, atomic writes, verification, off switch)."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._dynamo.utils import counters

import aot2onnx
from aot2onnx.compile import cache
from aot2onnx.compile.cache import GraphCache
from aot2onnx.testing import assert_same_effects


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


def _aot_counts() -> tuple[int, int]:
    """AOTAutogradCache's (hits, saved entries) so far in this process."""
    counts = counters["aot_autograd"]
    return counts["autograd_cache_hit"], counts["autograd_cache_saved"]


def _aot_entries(directory) -> list[str]:
    return sorted(
        os.path.join(root, name)
        for root, _, names in os.walk(os.path.join(directory, "aot"))
        for name in names
        if not name.startswith(".")
    )


def test_second_compilation_hits_the_cache_and_matches(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="aot2onnx")
    model = _model().eval()  # no dropout: outputs comparable between the two compilations
    hits, saved = _aot_counts()
    first = _step(model, {"cache_dir": str(tmp_path)})
    assert len(_entries(tmp_path)) == 2  # forward and backward
    assert len(_aot_entries(tmp_path)) == 1 and _aot_counts() == (hits, saved + 1)  # AOTAutograd's entry
    assert "(lowered)" in caplog.text and "(cache hit" not in caplog.text
    caplog.clear()
    torch._dynamo.reset()
    grads_before = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    second = _step(model, {"cache_dir": str(tmp_path)})
    # AOTAutograd's entry hit: no capture, and both graphs loaded from the graph cache.
    assert _aot_counts() == (hits + 1, saved + 1)
    assert caplog.text.count("(cache hit, no capture)") == 2 and "(lowered)" not in caplog.text
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
    hits, _ = _aot_counts()
    _step(_model(), {"cache_dir": str(tmp_path)})
    # AOTAutograd's entry is found, but the forward graph it names does not verify: the capture runs again,
    # finds both graphs unverifiable, lowers and stores them afresh.
    assert _aot_counts()[0] == hits
    assert caplog.text.count("does not verify") == 3 and caplog.text.count("(lowered)") == 2
    cache = GraphCache(tmp_path)
    for path in _entries(tmp_path):
        assert cache.load(os.path.basename(path).split(".")[0]) is not None
    caplog.clear()
    torch._dynamo.reset()
    _step(_model(), {"cache_dir": str(tmp_path)})  # and the next compilation hits at both levels
    assert _aot_counts()[0] == hits + 1 and caplog.text.count("(cache hit, no capture)") == 2


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
    leftovers = _temporaries(tmp_path)
    assert leftovers, "the writer should have died with its temporary file written"
    # Nothing published it and nothing else would remove it: the cache does, once the file is old enough that
    # no live writer can own it.
    GraphCache.open(tmp_path)
    assert _temporaries(tmp_path) == leftovers, "a recent temporary file may be a live writer's"
    _age(leftovers, cache.STALE_TEMPORARY_SECONDS + 60)
    cache._SWEPT_DIRECTORIES.discard(tmp_path)  # a new process
    GraphCache.open(tmp_path)
    assert _temporaries(tmp_path) == []


def _temporaries(directory) -> list[str]:
    return sorted(os.path.join(root, n) for root, _, names in os.walk(directory) for n in names
                  if n.startswith(".tmp-") or n.endswith(".tmp"))


def _age(paths, seconds: float) -> None:
    for path in paths:
        st = os.stat(path)
        os.utime(path, (st.st_atime - seconds, st.st_mtime - seconds))


def test_opening_the_cache_removes_only_stale_temporary_files(tmp_path):
    keep, stale = [], []
    for sub, name, old, removed in [
        ("ab", ".tmp-x1y2", True, True),  # GraphCache._write's, left by a killed writer
        ("aot/env/key", ".1234.5678.tmp", True, True),  # torch's write_atomic, under AOTAutograd's entries
        ("ab", ".tmp-z3", False, False),  # a live writer's
        ("ab", "abcd.onnxentry", True, False),  # entries, however old
        ("aot/env/key", "0f1e2d", True, False),
        ("ab", "tmp-no-dot", True, False),
    ]:
        path = tmp_path / sub / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
        if old:
            _age([path], cache.STALE_TEMPORARY_SECONDS + 60)
        (stale if removed else keep).append(str(path))
    outside = tmp_path.parent / f"{tmp_path.name}-outside.tmp"
    outside.write_bytes(b"x")
    _age([outside], cache.STALE_TEMPORARY_SECONDS + 60)
    (tmp_path / "ab" / ".tmp-link").symlink_to(outside)  # not followed, and not a regular file
    keep.append(str(tmp_path / "ab" / ".tmp-link"))
    tmp_path.chmod(0o700)
    assert GraphCache.open(tmp_path) is not None
    remaining = sorted(os.path.join(root, n) for root, _, names in os.walk(tmp_path) for n in names)
    assert remaining == sorted(keep) and outside.exists()


@pytest.mark.parametrize("value", ["", "0", "off"])
def test_env_switch_turns_the_cache_off(monkeypatch, value):
    from aot2onnx.compile.cache import default_cache_dir

    monkeypatch.setenv("AOT2ONNX_CACHE_DIR", value)
    assert default_cache_dir() is None


# AOTAutograd's entries: on a hit, AOTAutograd rebuilds its runtime wrappers from the entry, so the side
# effects they carry (input mutations, aliased outputs, synthetic bases, buffers) must come out as eager's.


def _mutate_and_alias(x, w):
    x.mul_(2)
    return x.view(-1), x * w


def _mutate_one_of_two_aliases(a, b):
    a.mul_(2)
    return a.sum(0) + b.sum()


def _aliased_pair():
    a = torch.randn(3, 4).requires_grad_(True).clone()
    return a, a.view(-1)


class _Buffers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.steps += 1
        return self.net(x) * self.steps


@pytest.mark.parametrize(
    "fn, make_inputs, dynamic",
    [
        (_mutate_and_alias, lambda: (torch.randn(3, 4), torch.randn(3, 4, requires_grad=True)), None),
        (_mutate_one_of_two_aliases, _aliased_pair, None),
        (lambda x: (x.t(), x.sin()), lambda: (torch.randn(3, 4, requires_grad=True),), None),
        (_Buffers, lambda: (torch.randn(2, 3, 8, 8),), None),  # a class: a new module for each comparison
        (_mutate_and_alias, lambda: (torch.randn(5, 4), torch.randn(5, 4, requires_grad=True)), True),
        (_mutate_and_alias, lambda: (torch.randn(3, 4), torch.randn(3, 4)), None),  # no grad: inference graph
    ],
    ids=["input-mutation-and-view-output", "synthetic-base", "output-view-of-input", "batchnorm-and-counter",
         "dynamic-shapes", "inference"],
)
def test_aot_cache_hit_keeps_side_effects(tmp_path, fn, make_inputs, dynamic):
    backend = aot2onnx.backend(cache_dir=str(tmp_path))
    hits, saved = _aot_counts()
    for expected in [(hits, saved + 1), (hits + 1, saved + 1)]:  # a miss that writes the entry, then a hit
        torch._dynamo.reset()
        subject = fn() if isinstance(fn, type) else fn
        assert_same_effects(subject, make_inputs, backend=backend, dynamic=dynamic, rtol=1e-4, atol=1e-5)
        assert _aot_counts() == expected


def test_aot_cache_hit_under_dynamic_shapes_serves_other_sizes(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    backend = aot2onnx.backend(cache_dir=str(tmp_path))
    torch.compile(model, backend=backend, dynamic=True)(torch.randn(5, 8)).sum().backward()
    torch._dynamo.reset()
    hits, _ = _aot_counts()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for batch in (3, 11):
        x = torch.randn(batch, 8)
        model.zero_grad()
        out = compiled(x)
        out.square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        expected = model(x)
        expected.square().sum().backward()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        for g, p in zip(grads, model.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)
    assert _aot_counts()[0] == hits + 1  # one entry served both sizes


def test_aot_entries_depend_on_the_options(tmp_path):
    model = _model()
    hits, saved = _aot_counts()
    _step(model, {"cache_dir": str(tmp_path)})
    torch._dynamo.reset()
    _step(model, {"cache_dir": str(tmp_path), "partitioner": "default"})  # another capture: another entry
    torch._dynamo.reset()
    _step(model, {"cache_dir": str(tmp_path), "graph_optimization_level": "basic"})  # options of the sessions
    assert _aot_counts() == (hits, saved + 3) and len(_aot_entries(tmp_path)) == 3


def test_aot_entries_depend_on_the_autocast_dtype(tmp_path):
    # torch 2.11 and 2.12 key AOTAutograd's entries by whether autocast is on, not by its dtype: the entry
    # captured under bfloat16 served the float16 compile, whose outputs were then bfloat16.
    model = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    hits, saved = _aot_counts()
    for dtype in (torch.bfloat16, torch.float16):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=aot2onnx.backend(cache_dir=str(tmp_path)))
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            out, expected = compiled(x), model(x)
        assert out.dtype == expected.dtype == dtype
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert _aot_counts() == (hits, saved + 2)


@torch.library.custom_op("aot2onnx_cache_test::wobble", mutates_args=())
def _wobble(x: torch.Tensor) -> torch.Tensor:  # no lowering: the fallback runs it in PyTorch
    return x + 0.1 * torch.sin(3 * x)


_wobble.register_fake(lambda x: torch.empty_like(x))
_wobble.register_autograd(
    lambda ctx, grad: grad * (1 + 0.3 * torch.cos(3 * ctx.saved_tensors[0])),
    setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]),
)


class _Wobbly(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)

    def forward(self, x):
        return self.b(torch.tanh(_wobble(self.a(x))))


def test_graphs_with_custom_ops_leave_no_aot_entry(tmp_path, caplog):
    # AOTAutograd's key would hold the op's name, not its Python kernels or autograd formula.
    hits, saved = _aot_counts()
    bypassed = counters["aot_autograd"]["autograd_cache_bypass"]
    with pytest.warns(UserWarning, match="run in PyTorch"):
        _step(_Wobbly(), {"cache_dir": str(tmp_path)})
    assert _aot_counts() == (hits, saved) and _aot_entries(tmp_path) == []
    assert counters["aot_autograd"]["autograd_cache_bypass"] == bypassed + 1
    assert len(_entries(tmp_path)) == 3  # the forward's ONNX partitions around the op, and the backward
    torch._dynamo.reset()
    caplog.set_level(logging.INFO, logger="aot2onnx")
    with pytest.warns(UserWarning, match="run in PyTorch"):
        _step(_Wobbly(), {"cache_dir": str(tmp_path)})
    assert caplog.text.count("(cache hit)") == 3 and "(lowered)" not in caplog.text  # the graph cache still serves


def test_a_graph_that_runs_partly_in_pytorch_is_not_pickled():
    from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache

    from aot2onnx.capture import GraphKind
    from aot2onnx.capture.aot import ReloadableGraph

    with pytest.raises(BypassAOTAutogradCache, match="partly in PyTorch"):
        ReloadableGraph(lambda args: args, None, GraphKind.FORWARD).prepare_for_serialization()
    graph = ReloadableGraph(lambda args: args, "k" * 64, GraphKind.BACKWARD)
    graph.prepare_for_serialization()
    restored = pickle.loads(pickle.dumps(graph))
    assert (restored.key, restored.kind, restored.runner, restored._boxed_call) == ("k" * 64, GraphKind.BACKWARD, None, True)


def test_a_second_process_skips_the_capture(tmp_path):
    script = textwrap.dedent(
        f"""
        import logging, torch, aot2onnx
        from torch._dynamo.utils import counters
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        x = torch.randn(2, 5, 32)
        out = torch.compile(layer, backend=aot2onnx.backend(cache_dir={str(tmp_path)!r}))(x)
        out.square().mean().backward()
        expected = layer(x)
        print("MAX_DIFF", (out - expected).abs().max().item())
        print("AOT_HITS", counters["aot_autograd"]["autograd_cache_hit"])
        """
    )
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
        assert float(run.stdout.split("MAX_DIFF ")[1].split()[0]) < 1e-5
    assert "AOT_HITS 0" in runs[0].stdout and "(lowered)" in runs[0].stderr
    assert "AOT_HITS 1" in runs[1].stdout
    assert runs[1].stderr.count("(cache hit, no capture)") == 2 and "(lowered)" not in runs[1].stderr


def test_the_cache_key_covers_the_cpu_vector_width(monkeypatch):
    # lower/ops/norm.py follows eager's kernels at the CPU's vector width: an AVX2 and an AVX-512 machine
    # sharing a cache directory must not be served each other's graphs.
    from aot2onnx.compile import cache_fingerprint

    keys = {}
    for capability in ("AVX2", "AVX512"):
        cache_fingerprint._environment_fingerprint.cache_clear()
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        keys[capability] = cache_fingerprint._environment_fingerprint()
    cache_fingerprint._environment_fingerprint.cache_clear()
    monkeypatch.undo()
    assert keys["AVX2"] != keys["AVX512"]
