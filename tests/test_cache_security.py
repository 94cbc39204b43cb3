"""The persistent cache's trust: entries authenticated with the user's secret (forged graphs and planted
pickles are not served), directories and secret files others could write or read are refused, and user
lowering rules keyed by every value they read (a changed global or closure variable is seen in the next
process)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import pickle
import subprocess
import sys
import textwrap
import types
import warnings

import pytest
import torch
from onnxscript import opset18 as op
from torch._dynamo.utils import counters

import aot2onnx
from aot2onnx.compile.cache import GraphCache, cache_secret, function_fingerprint
from aot2onnx.lower import registry

_CACHE_OFF = "aot2onnx: the persistent cache is off"


@pytest.fixture(autouse=True)
def _own_secret(tmp_path, monkeypatch):
    """A secret of the test's own: the user's is left alone, and subprocesses inherit the variable."""
    monkeypatch.setenv("AOT2ONNX_CACHE_SECRET_FILE", str(tmp_path / "config" / "cache-secret"))


@pytest.fixture
def fresh_user_rules(monkeypatch):
    """``register_lowering`` within a test: its rules go to a list of the test's own, gone after it."""
    monkeypatch.setattr(registry, "_USER_RULES", [])
    registry.default_registry.cache_clear()
    registry.fused_registry.cache_clear()
    yield
    # Rebuilt from the restored list on next use: both, or where the fused kernels are built, the next test
    # lowers with this test's rules in place of the module-level rules of the others (test_fallback's).
    registry.default_registry.cache_clear()
    registry.fused_registry.cache_clear()


def _entries(directory) -> list[pathlib.Path]:
    return sorted(pathlib.Path(directory).rglob("*.onnxentry"))


def _aot_entries(directory) -> list[pathlib.Path]:
    aot = pathlib.Path(directory) / "aot"
    return sorted(p for p in aot.rglob("*") if p.is_file() and not p.name.startswith("."))


def _compile(fn, directory, **options):
    return torch.compile(fn, backend=aot2onnx.backend(cache_dir=str(directory), **options))


def _twice_sin(x):
    return torch.sin(x) * 2


def _twice_cos(x):
    return torch.cos(x) * 2


def _cache_off_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if _CACHE_OFF in str(w.message)]


# --- Authenticated entries ----------------------------------------------------------------------------------


def test_a_forged_graph_entry_is_not_served(tmp_path, caplog):
    # Someone who can write to the cache directory replaces a lowered model with another one, and fixes up
    # the header's key and SHA-256 as the format says: without the user's secret, the HMAC cannot follow.
    x = torch.randn(3, 4)
    _compile(_twice_sin, tmp_path / "cache")(x)
    torch._dynamo.reset()
    _compile(_twice_cos, tmp_path / "other")(x)
    [entry], [other] = _entries(tmp_path / "cache"), _entries(tmp_path / "other")
    header = json.loads(entry.read_bytes().partition(b"\n")[0])
    forged_model = other.read_bytes().partition(b"\n")[2]
    header["model_sha256"] = hashlib.sha256(forged_model).hexdigest()
    entry.write_bytes(json.dumps(header, sort_keys=True).encode() + b"\n" + forged_model)

    torch._dynamo.reset()
    caplog.set_level(logging.INFO, logger="aot2onnx")
    out = _compile(_twice_sin, tmp_path / "cache")(x)
    torch.testing.assert_close(out, _twice_sin(x))
    assert "does not verify (its HMAC does not match" in caplog.text and "(lowered)" in caplog.text
    assert GraphCache(tmp_path / "cache").load(entry.stem) is not None  # lowered again and replaced


class _Planted:
    """Unpickling this creates ``marker``: what a planted pickle could do, it would do at the next compile."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def test_a_planted_pickle_under_aot_is_not_unpickled(tmp_path, caplog):
    x = torch.randn(3, 4, requires_grad=True)
    _compile(_twice_sin, tmp_path / "cache")(x).sum().backward()
    [written] = _aot_entries(tmp_path / "cache")
    marker = tmp_path / "planted-pickle-ran"
    payload = pickle.dumps(_Planted(marker))
    written.write_bytes(payload)  # in place of AOTAutograd's entry
    (written.parent / "0-planted").write_bytes(payload)  # and beside it, read first

    torch._dynamo.reset()
    caplog.set_level(logging.INFO, logger="aot2onnx")
    hits = counters["aot_autograd"]["autograd_cache_hit"]
    out = _compile(_twice_sin, tmp_path / "cache")(x)
    assert not marker.exists()
    assert caplog.text.count("does not authenticate") == 2
    assert counters["aot_autograd"]["autograd_cache_hit"] == hits  # a miss: captured again
    torch.testing.assert_close(out, _twice_sin(x))
    out.sum().backward()  # and the backward graph it compiled works


def test_a_directory_others_can_write_is_refused(tmp_path):
    directory = tmp_path / "cache"
    directory.mkdir()
    directory.chmod(0o777)
    x = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _compile(_twice_sin, directory)(x)
        torch._dynamo.reset()
        _compile(_twice_cos, directory)(x)  # the cache stays off, without a second warning
    [message] = _cache_off_warnings(caught)
    assert f"its directory {directory}" in message and "mode 0o777" in message and "chmod 700" in message
    torch.testing.assert_close(out, _twice_sin(x))
    assert list(directory.iterdir()) == []


@pytest.mark.parametrize(
    "mode, trusted",
    [(0o700, True), (0o755, True), (0o775, False), (0o757, False), (0o1777, True)],
    ids=["private", "readable", "group-writable", "world-writable", "sticky"],
)
def test_directory_modes(tmp_path, mode, trusted):
    # Sticky and ours: others could add files, not replace or remove ours, and what they add does not
    # authenticate.
    directory = tmp_path / "cache"
    directory.mkdir()
    directory.chmod(mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = GraphCache.open(directory)
    assert (cache is not None) == trusted
    assert len(_cache_off_warnings(caught)) == (0 if trusted else 1)


_needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")


@_needs_root
def test_a_directory_of_another_user_is_refused(tmp_path):
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)
    with pytest.warns(UserWarning, match="owned by another user"):
        assert GraphCache.open(directory) is None


# --- The secret ---------------------------------------------------------------------------------------------


def test_the_secret_is_made_once_readable_by_the_user_alone(tmp_path):
    path = tmp_path / "config" / "cache-secret"
    secret = cache_secret()
    assert len(secret) == 32 and path.read_bytes() == secret
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    _compile(_twice_sin, tmp_path / "cache")(torch.randn(3, 4))
    assert path.read_bytes() == secret and not list((tmp_path / "cache").rglob("*secret*"))


def test_a_secret_others_can_read_turns_the_cache_off(tmp_path):
    path = tmp_path / "config" / "cache-secret"
    path.parent.mkdir()
    path.write_bytes(os.urandom(32))
    path.chmod(0o640)
    x = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _compile(_twice_sin, tmp_path / "cache")(x)
    [message] = _cache_off_warnings(caught)
    assert str(path) in message and "mode 0o640" in message and "chmod 600" in message
    torch.testing.assert_close(out, _twice_sin(x))
    assert _entries(tmp_path / "cache") == [] and _aot_entries(tmp_path / "cache") == []


@_needs_root
def test_a_secret_of_another_user_turns_the_cache_off(tmp_path):
    path = tmp_path / "config" / "cache-secret"
    path.parent.mkdir()
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    os.chown(path, 65534, 65534)
    with pytest.warns(UserWarning, match="owned by another user"):
        assert GraphCache.open(tmp_path / "cache") is None


# --- User rules: keyed by what they read --------------------------------------------------------------------

# The script registers two rules: one reads a module global, the other is made by a factory and reads its
# argument from its closure. Each process takes the values from its command line.
_RULES_SCRIPT = """
import json, logging, sys
import torch
from onnxscript import opset18 as op
import aot2onnx

logging.basicConfig(level=logging.INFO, format="%(message)s")
SCALE, ALPHA, CACHE_DIR = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]


@torch.library.custom_op("stale_rules::scale", mutates_args=())
def scale(x: torch.Tensor) -> torch.Tensor:
    return x * SCALE


@torch.library.custom_op("stale_rules::shift", mutates_args=())
def shift(x: torch.Tensor) -> torch.Tensor:
    return x + ALPHA


scale.register_fake(lambda x: torch.empty_like(x))
shift.register_fake(lambda x: torch.empty_like(x))


@aot2onnx.register_lowering(torch.ops.stale_rules.scale.default)
def lower_scale(x):
    return op.Mul(x, op.CastLike(SCALE, x))


def make_lower_shift(alpha):
    def lower_shift(x):
        return op.Add(x, op.CastLike(alpha, x))

    return lower_shift


aot2onnx.register_lowering(torch.ops.stale_rules.shift.default)(make_lower_shift(ALPHA))


def f(x):
    return torch.ops.stale_rules.shift(torch.ops.stale_rules.scale(x))


x = torch.ones(3)
compiled = torch.compile(f, backend=aot2onnx.backend(cache_dir=CACHE_DIR, fallback=False))
print(json.dumps({"compiled": compiled(x).tolist(), "eager": f(x).tolist()}))
"""


def test_rules_reading_a_changed_global_or_closure_are_lowered_again_in_the_next_process(tmp_path):
    script = tmp_path / "rules.py"
    script.write_text(_RULES_SCRIPT)
    runs = []
    # The global changes, then the factory's argument, then both come back: that one hits the graph cache
    # (graphs with custom ops have no entry in AOTAutograd's layer; the next test covers that layer).
    for scale, alpha in [(2, 5), (3, 5), (3, 7), (2, 5)]:
        run = subprocess.run(
            [sys.executable, str(script), str(scale), str(alpha), str(tmp_path / "cache")],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        result = json.loads(run.stdout.strip().splitlines()[-1])
        assert result["eager"] == [scale + alpha] * 3
        assert result["compiled"] == result["eager"], f"SCALE={scale}, ALPHA={alpha}: a stale lowering was served"
        runs.append(run.stderr)
    assert all("(lowered)" in stderr for stderr in runs[:3])
    assert "(cache hit)" in runs[3] and "(lowered)" not in runs[3]


_SIN_SCALE = 2.0


def test_aot_entries_follow_a_changed_global_of_a_rule(tmp_path, fresh_user_rules, monkeypatch):
    # A rule that overrides an ATen op (not a custom op: AOTAutograd's layer caches the capture) and reads a
    # global. AOTAutograd's entry names the lowered graphs by key: its directory must change with the global
    # too, or the entry would name the graph lowered with the old value.
    @aot2onnx.register_lowering(torch.ops.aten.sin.default)
    def scaled_sin(x):
        return op.Mul(op.Sin(x), op.CastLike(_SIN_SCALE, x))

    x = torch.randn(3, 4)
    hits, saved = counters["aot_autograd"]["autograd_cache_hit"], counters["aot_autograd"]["autograd_cache_saved"]
    for scale in (2.0, 3.0, 2.0):
        monkeypatch.setattr(sys.modules[__name__], "_SIN_SCALE", scale)
        torch._dynamo.reset()
        out = _compile(torch.sin, tmp_path / "cache")(x)
        torch.testing.assert_close(out, torch.sin(x) * scale)
    # Two entries written; the third compilation, with the first value again, hit the first.
    assert counters["aot_autograd"]["autograd_cache_saved"] == saved + 2
    assert counters["aot_autograd"]["autograd_cache_hit"] == hits + 1


class _Settings:
    factor = 2.0


_SETTINGS = _Settings()  # an instance of a class of the user's: no reliable fingerprint


@torch.library.custom_op("aot2onnx_cache_security::scale", mutates_args=())
def _scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0


_scale.register_fake(lambda x: torch.empty_like(x))


def test_a_rule_reading_what_has_no_fingerprint_leaves_its_graphs_uncached(tmp_path, caplog, fresh_user_rules):
    @aot2onnx.register_lowering(torch.ops.aot2onnx_cache_security.scale.default)
    def lower_scale(x):
        return op.Mul(x, op.CastLike(_SETTINGS.factor, x))

    assert function_fingerprint(lower_scale) is None
    caplog.set_level(logging.DEBUG, logger="aot2onnx")

    def uses_the_rule(x):
        return torch.ops.aot2onnx_cache_security.scale(x) + 1

    x = torch.randn(3, 4)
    for _ in range(2):
        torch._dynamo.reset()
        out = _compile(uses_the_rule, tmp_path / "cache", fallback=False)(x)
        torch.testing.assert_close(out, uses_the_rule(x))
    assert _entries(tmp_path / "cache") == [] and _aot_entries(tmp_path / "cache") == []
    assert caplog.text.count("(lowered)") == 2
    assert "the lowering rule " in caplog.text and "'_SETTINGS'" in caplog.text and "_Settings" in caplog.text
    # A graph that does not use the rule is cached as before.
    torch._dynamo.reset()
    _compile(_twice_sin, tmp_path / "cache")(x)
    assert len(_entries(tmp_path / "cache")) == 1


# --- What a fingerprint covers ------------------------------------------------------------------------------

_FACTOR = 2.0
_SETTINGS_MODULE = types.ModuleType("aot2onnx_test_settings")  # the user's own module: followed by attribute
_SETTINGS_MODULE.FACTOR = 2.0


def _reads_a_global(x):
    return op.Mul(x, op.CastLike(_FACTOR, x))


def _factor():
    return _FACTOR


def _calls_a_helper(x):
    return op.Mul(x, op.CastLike(_factor(), x))


def _reads_a_module_attribute(x):
    return op.Mul(x, op.CastLike(_SETTINGS_MODULE.FACTOR, x))


def _with_defaults(x, factor=2.0, *, offset=1.0):
    return op.Add(op.Mul(x, op.CastLike(factor, x)), op.CastLike(offset, x))


def _make(alpha):
    def rule(x):
        return op.Add(x, op.CastLike(alpha, x))

    return rule


def _nested_two():
    return (lambda: 2.0)()


def _nested_three():
    return (lambda: 3.0)()


def _recursive(n):
    return _recursive(n - 1) if n else _FACTOR


@pytest.mark.parametrize(
    "rule, change",
    [
        (_reads_a_global, lambda mp: mp.setattr(sys.modules[__name__], "_FACTOR", 3.0)),
        (_calls_a_helper, lambda mp: mp.setattr(sys.modules[__name__], "_FACTOR", 3.0)),
        (_recursive, lambda mp: mp.setattr(sys.modules[__name__], "_FACTOR", 3.0)),
        (_reads_a_module_attribute, lambda mp: mp.setattr(_SETTINGS_MODULE, "FACTOR", 3.0)),
        (_with_defaults, lambda mp: mp.setattr(_with_defaults, "__defaults__", (3.0,))),
        (_with_defaults, lambda mp: mp.setattr(_with_defaults, "__kwdefaults__", {"offset": 0.0})),
    ],
    ids=[
        "global",
        "global-of-a-called-function",
        "recursive-function",
        "module-attribute",
        "default",
        "keyword-default",
    ],
)
def test_the_fingerprint_follows_what_a_rule_reads(monkeypatch, rule, change):
    before = function_fingerprint(rule)
    assert before is not None and function_fingerprint(rule) == before
    change(monkeypatch)
    assert function_fingerprint(rule) not in (None, before)
    monkeypatch.undo()
    assert function_fingerprint(rule) == before


def test_the_fingerprint_covers_closures_and_nested_code():
    assert function_fingerprint(_make(2.0)) == function_fingerprint(_make(2.0))
    assert function_fingerprint(_make(2.0)) != function_fingerprint(_make(3.0))
    # Same outer bytecode; only the constant of the nested lambda differs.
    assert function_fingerprint(_nested_two) != function_fingerprint(_nested_three)


def test_the_fingerprint_is_the_same_in_every_process():
    # A set constant is a frozenset, whose order (and so its repr) changes with the string hash seed.
    script = textwrap.dedent(
        """
        from aot2onnx.compile.cache import function_fingerprint
        def rule(x, mode):
            return x if mode in {"nearest", "linear", "cubic", "area", "bilinear"} else (lambda: None)
        print(function_fingerprint(rule))
        """
    )
    fingerprints = set()
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        fingerprints.add(run.stdout.strip())
    assert len(fingerprints) == 1 and "None" not in fingerprints
