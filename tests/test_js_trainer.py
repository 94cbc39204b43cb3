"""The JavaScript reader/trainer (js/): the same artifacts and data trained by ``node js/cli.mjs`` and by the
Python reader (aot2onnx/artifact/edge.py) match torch.optim's eager run at the Python reader's tolerances
(tests/test_export.py's RTOL/ATOL), and each other; the JavaScript reader refuses the hostile artifacts the
Python reader refuses (tests/artifact_refusals.py, one list for both). The browser tests (``-m slow``) run the
same training and refusals in headless Chromium with onnxruntime-web (WebAssembly).

The JavaScript tests need ``node`` and ``js/node_modules`` (``npm ci --prefix js``, which ``make test`` runs where
npm exists); the browser tests also need Chromium (Debian's ``chromium``). Without them they skip and say which
is missing; the Python reader's half of the refusal list runs everywhere.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import os
import pathlib
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
import safetensors
import safetensors.numpy
import torch
import torch.nn as nn
import torch.nn.functional as F

import aot2onnx
from aot2onnx.artifact import edge
from aot2onnx.artifact.optim import WarmupLinear

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from artifact_refusals import ACCEPTED, REFUSALS, prepare  # noqa: E402
from test_export import ATOL, RTOL, WithLoss, set_metadata  # noqa: E402  (the Python reader's tolerances)
from test_training_parity import SmallCNN  # noqa: E402

ROOT = pathlib.Path(__file__).parents[1]
JS = ROOT / "js"
NODE = shutil.which("node")
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
STEPS, EXPORT_BATCH, TRAIN_BATCH = 20, 6, 8


def _js_missing() -> str | None:
    if NODE is None:
        return "node is not installed: the JavaScript trainer's tests need node 20+ and `npm ci --prefix js`"
    if not (JS / "node_modules" / "onnxruntime-node").is_dir():
        return ("js/node_modules is not installed: run `npm ci --prefix js` (`make test` does, where npm is "
                "installed)")
    return None


def _browser_missing() -> str | None:
    if _js_missing():
        return _js_missing()
    if CHROMIUM is None:
        return "no Chromium: install Debian's chromium (apt-get install chromium) or name one in $CHROMIUM"
    if not (JS / "node_modules" / "playwright-core").is_dir():
        return "js/node_modules/playwright-core is not installed: run `npm ci --prefix js`"
    return None


needs_node = pytest.mark.skipif(_js_missing() is not None, reason=str(_js_missing()))
browser = pytest.mark.skipif(_browser_missing() is not None, reason=str(_browser_missing()))


def _node(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([NODE, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "CHROMIUM": CHROMIUM or ""})


# ---------------------------------------------------------------------------------------------------------
# The artifacts: an MLP with cross-entropy, a conv net with BatchNorm, a tied-weight LM, AdamW with a warm-up


class TiedLM(nn.Module):
    """A small language model whose output projection is its token embedding (one state entry, two names)."""

    def __init__(self, vocab: int = 61, dim: int = 32, context: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(context, dim)
        self.mix = nn.Linear(dim, dim)
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        return self.head(self.ln(h + torch.tanh(self.mix(h))))


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@dataclasses.dataclass(frozen=True)
class Case:
    make: Callable[[], nn.Module]
    data: Callable[[torch.Generator, int], tuple[torch.Tensor, ...]]
    optimizer: Callable[[], object]  # the exported optimizer (aot2onnx.optim)
    torch_optimizer: Callable[[object], torch.optim.Optimizer]  # the same, for the eager run
    schedule: object = None  # aot2onnx.optim schedule, applied to the eager run with LambdaLR
    max_grad_norm: float | None = None


def _mlp() -> nn.Module:
    # tests/test_export.py's "mlp" layers (the names tests/artifact_refusals.py edits), with cross-entropy.
    return WithLoss(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)),
                    F.cross_entropy)


WARMUP = WarmupLinear(5, STEPS)
CASES = {
    "mlp_cross_entropy": Case(
        _mlp, lambda g, b: (torch.randn(b, 32, generator=g), torch.randint(0, 8, (b,), generator=g)),
        lambda: aot2onnx.optim.SGD(0.05, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    "cnn_batchnorm": Case(
        lambda: WithLoss(SmallCNN(), F.cross_entropy),
        lambda g, b: (torch.randn(b, 3, 32, 32, generator=g), torch.randint(0, 10, (b,), generator=g)),
        lambda: aot2onnx.optim.SGD(0.01, momentum=0.9, weight_decay=1e-4),
        lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, weight_decay=1e-4)),
    "tied_lm": Case(
        lambda: WithLoss(TiedLM(), _lm_loss),
        lambda g, b: (torch.randint(0, 61, (b, 16), generator=g), torch.randint(0, 61, (b, 16), generator=g)),
        lambda: aot2onnx.optim.AdamW(1e-3, weight_decay=0.01),
        lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01)),
    "adamw_warmup_clipped": Case(
        lambda: WithLoss(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)), F.mse_loss),
        # Targets far from the outputs: the gradients are large, so the clipping at 1.0 engages.
        lambda g, b: (torch.randn(b, 16, generator=g), 3 * torch.randn(b, 4, generator=g)),
        lambda: aot2onnx.optim.AdamW(1e-2, weight_decay=0.1, schedule=WARMUP, max_grad_norm=1.0),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1), WARMUP, 1.0),
}


@dataclasses.dataclass
class Trained:
    losses: list[float]
    state: dict[str, np.ndarray]


@dataclasses.dataclass
class Exported:
    out_dir: pathlib.Path
    data: pathlib.Path  # batches.npz: [STEPS, *input shape] per input
    signature: dict
    eager: Trained  # torch.optim's run, by the artifact's state names
    python: Trained  # edge.py's command line, in this process


def _eager(case: Case, module: nn.Module, batches: list[tuple[torch.Tensor, ...]], signature: dict) -> Trained:
    module = copy.deepcopy(module)
    opt = case.torch_optimizer(module.parameters())
    scheduler = case.schedule.torch(opt) if case.schedule is not None else None
    losses = []
    for batch in batches:
        loss = module(*batch)
        opt.zero_grad()
        loss.backward()
        if case.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), case.max_grad_norm)
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    tied = {t["name"] for t in signature.get("tied", [])}  # the module's second names of a shared tensor
    state = {k: v.detach().numpy() for k, v in module.state_dict().items() if k not in tied}
    for name, p in module.named_parameters():  # one name per tensor: the state entry's
        for slot, value in opt.state[p].items():
            key = "optimizer:step" if slot == "step" else f"{name}:{slot}"
            state[key] = np.asarray(int(value)) if slot == "step" else value.numpy()
    return Trained(losses, state)


def _read_lines(stdout: str) -> list[float]:
    lines = stdout.splitlines()
    assert [line.split()[:3] for line in lines] == [["step", str(i + 1), "loss"] for i in range(len(lines))], stdout
    return [float(line.split()[3]) for line in lines]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Callable[[str], Exported]:
    done: dict[str, Exported] = {}

    def export(name: str) -> Exported:
        if name not in done:
            case = CASES[name]
            torch.manual_seed(0)
            module = case.make()
            g = torch.Generator().manual_seed(1)
            example = case.data(g, EXPORT_BATCH)
            batches = [case.data(g, TRAIN_BATCH) for _ in range(STEPS)]
            root = tmp_path_factory.mktemp(name)
            aot2onnx.export_training(copy.deepcopy(module), example, root / "artifact", optimizer=case.optimizer())
            signature = json.loads((root / "artifact" / "signature.json").read_text())
            names = [u["name"] for u in signature["user_inputs"]]
            np.savez(root / "batches.npz", **{n: np.stack([b[i].numpy() for b in batches]) for i, n in enumerate(names)})
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                code = edge.main([str(root / "artifact"), "--data", str(root / "batches.npz"), "--steps", str(STEPS),
                                  "--out", str(root / "python.safetensors"), "--threads", "2"])
            assert code == 0
            python = Trained(_read_lines(out.getvalue()), safetensors.numpy.load_file(str(root / "python.safetensors")))
            done[name] = Exported(root / "artifact", root / "batches.npz", signature,
                                  _eager(case, module, batches, signature), python)
        return done[name]

    return export


def _differences(a: Trained, b: Trained) -> tuple[float, float]:
    """The largest absolute difference of the losses, and of any state element."""
    losses = float(np.max(np.abs(np.subtract(a.losses, b.losses))))
    state = max(float(np.max(np.abs(a.state[k].astype(np.float64) - b.state[k].astype(np.float64)), initial=0))
                for k in b.state)
    return losses, state


def _assert_matches(actual: Trained, expected: Trained, what: str) -> None:
    np.testing.assert_allclose(actual.losses, expected.losses, rtol=RTOL, atol=ATOL, err_msg=f"{what}: losses")
    for name, value in expected.state.items():
        got = actual.state[name]
        assert got.shape == value.shape and got.dtype == value.dtype, (what, name, got.dtype, value.dtype)
        if name == "optimizer:step":
            assert int(got) == int(value) == STEPS, (what, name)
        else:
            np.testing.assert_allclose(got, value, rtol=RTOL, atol=ATOL, err_msg=f"{what}: {name}")


def _check_state_file(path: pathlib.Path, signature: dict) -> Trained:
    """The JavaScript trainer's state file: what Python's safetensors reads, in the artifact's layout."""
    with safetensors.safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"format": "aot2onnx.training/2"}
    state = safetensors.numpy.load_file(str(path))
    assert {k: (v.dtype.name, list(v.shape)) for k, v in state.items()} == {
        e["name"]: (e["dtype"], e["shape"]) for e in signature["state"]}
    return state


def _report(name: str, runtime: str, trained: Trained, art: Exported) -> None:
    eager_loss, eager_state = _differences(trained, art.eager)
    python_loss, python_state = _differences(trained, art.python)
    print(f"\n{name} {runtime}: max |diff| vs eager: loss {eager_loss:.3g}, state {eager_state:.3g}; "
          f"vs edge.py: loss {python_loss:.3g}, state {python_state:.3g}")


# ---------------------------------------------------------------------------------------------------------
# Node


@needs_node
@pytest.mark.parametrize("name", list(CASES))
def test_node_cli_trains_like_eager_and_the_python_reader(name, exported, tmp_path):
    art = exported(name)
    out = tmp_path / "node.safetensors"
    run = _node("js/cli.mjs", str(art.out_dir), "--data", str(art.data), "--steps", str(STEPS), "--out", str(out),
                "--threads", "2")
    assert run.returncode == 0, run.stderr
    assert run.stderr.strip() == f"wrote {out}"
    trained = Trained(_read_lines(run.stdout), _check_state_file(out, art.signature))
    _assert_matches(trained, art.eager, "node vs eager")
    _assert_matches(trained, art.python, "node vs edge.py")
    _report(name, "node", trained, art)


@needs_node
def test_node_cli_resumes_from_its_saved_state(exported, tmp_path):
    """Half the steps, the state written and made the artifact's, the other half: the warm-up goes on from the
    saved optimizer:step, as with one run of all the steps."""
    art = exported("adamw_warmup_clipped")
    resumed = tmp_path / "artifact"
    shutil.copytree(art.out_dir, resumed)
    with np.load(art.data) as data:
        halves = [{k: v[i * STEPS // 2:(i + 1) * STEPS // 2] for k, v in data.items()} for i in range(2)]
    losses = []
    for i, half in enumerate(halves):
        np.savez(tmp_path / f"half{i}.npz", **half)
        run = _node("js/cli.mjs", str(resumed), "--data", str(tmp_path / f"half{i}.npz"), "--steps", str(STEPS // 2),
                    "--out", str(resumed / "state.safetensors"))
        assert run.returncode == 0, run.stderr
        losses += _read_lines(run.stdout)
    trained = Trained(losses, safetensors.numpy.load_file(str(resumed / "state.safetensors")))
    _assert_matches(trained, art.eager, "node, resumed, vs eager")


@needs_node
def test_node_turns_off_the_rewrites_each_model_names(exported, tmp_path):
    """A model without the entry (exported before it existed) runs with both rewrites off and trains as with it;
    an entry that is not a list of names is refused."""
    art = exported("mlp_cross_entropy")
    legacy = tmp_path / "legacy"
    shutil.copytree(art.out_dir, legacy)
    for graph in ("forward", "backward", "optimizer"):
        set_metadata(legacy / f"{graph}.onnx", edge.DISABLED_OPTIMIZERS_KEY, None)
    run = _node("js/cli.mjs", str(legacy), "--data", str(art.data), "--steps", "2", "--out", str(tmp_path / "s"))
    assert run.returncode == 0, run.stderr
    assert _read_lines(run.stdout) == pytest.approx(art.python.losses[:2], rel=RTOL, abs=ATOL)
    set_metadata(legacy / "forward.onnx", edge.DISABLED_OPTIMIZERS_KEY, "NoopElimination;x")
    run = _node("js/cli.mjs", str(legacy), "--data", str(art.data), "--steps", "1", "--out", str(tmp_path / "s"))
    assert run.returncode == 1 and "not a comma-separated list of ONNX Runtime rewrite names" in run.stderr


@needs_node
@pytest.mark.parametrize("args, code, message", [
    (["--steps", "0"], 2, "--steps must be at least 1, got 0"),
    (["--steps", "x"], 2, "argument --steps: invalid int value: 'x'"),
    (["--threads", "-1"], 2, "--threads must be 0 (ONNX Runtime's default) or more, got -1"),
    (["--out", "{tmp}"], 1, "error: --out '{tmp}' is a directory; name the state file to write"),
    (["--out", "{tmp}/no/such/state.safetensors"], 1, "the directory {tmp}/no/such does not exist"),
    (["--data", "{tmp}/wrong.npz"], 1, "wrong.npz has no array 'x' (or arr_0); it holds ['a']"),
    (["--data", "{tmp}/pickled.npz"], 1, "which only pickle can read; refused, as numpy refuses it with allow_pickle=False"),
], ids=["zero steps", "steps not an int", "negative threads", "out is a directory", "out in no directory",
        "data without the inputs", "data pickled"])
def test_node_cli_refuses_bad_arguments_before_training(args, code, message, exported, tmp_path):
    art = exported("mlp_cross_entropy")
    np.savez(tmp_path / "wrong.npz", a=np.zeros((1, 8, 32), np.float32))
    np.savez(tmp_path / "pickled.npz", x=np.array([{"a": 1}], dtype=object), y=np.zeros((1, 8), np.int64))
    given = {"--data": str(art.data), "--steps": "2", "--out": str(tmp_path / "s.safetensors")}
    for flag, value in zip(args[::2], args[1::2]):
        given[flag] = value.format(tmp=tmp_path)
    run = _node("js/cli.mjs", str(art.out_dir), *(x for kv in given.items() for x in kv))
    assert run.returncode == code and message.format(tmp=tmp_path) in run.stderr, run.stderr
    assert run.stdout == "" and not (tmp_path / "s.safetensors").exists()


# ---------------------------------------------------------------------------------------------------------
# Refusals: every case of tests/artifact_refusals.py, by both readers


@pytest.fixture(scope="module")
def hostile(exported, tmp_path_factory) -> dict[str, pathlib.Path]:
    base = exported("mlp_cross_entropy").out_dir
    root = tmp_path_factory.mktemp("hostile")
    cases = {**{name: r.change for name, r in REFUSALS.items()}, **ACCEPTED}
    return {name: prepare(base, root / f"case{i}", change) for i, (name, change) in enumerate(cases.items())}


@pytest.fixture(scope="module")
def node_opened(hostile) -> dict[str, dict]:
    """What the Node reader says of each case: one node process opens them all."""
    run = _node("js/test/open-artifacts.mjs", *map(str, hostile.values()))
    assert run.returncode == 0, run.stderr
    results = {r["dir"]: r for r in map(json.loads, run.stdout.splitlines())}
    return {name: results[str(path)] for name, path in hostile.items()}


@needs_node
@pytest.mark.parametrize("case", list(REFUSALS))
def test_node_reader_refuses(case, node_opened):
    result = node_opened[case]
    assert not result["ok"], f"the JavaScript reader opened it ({case})"
    assert result["error"] == "ArtifactError" and re.search(REFUSALS[case].match, result["message"]), result


@pytest.mark.parametrize("case", list(REFUSALS))
def test_python_reader_refuses_the_same(case, hostile):
    """The shared list holds for the Python reader too (the cases come from its own tests)."""
    with pytest.raises(edge.ArtifactError, match=REFUSALS[case].match):
        edge.Trainer(hostile[case])


@needs_node
@pytest.mark.parametrize("case", list(ACCEPTED))
def test_node_reader_accepts(case, hostile, node_opened):
    assert node_opened[case] == {"dir": str(hostile[case]), "ok": True}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_python_reader_accepts_the_same(case, hostile):
    edge.Trainer(hostile[case])


# ---------------------------------------------------------------------------------------------------------
# The pieces against Python's own: float printing, schedules, numpy files in, safetensors out


def _node_eval(code: str) -> str:
    run = _node("--input-type=module", "-e", code)
    assert run.returncode == 0, run.stderr
    return run.stdout


@needs_node
def test_losses_print_as_python_repr():
    values = [0.1, 1.0, -2.5, 1e-4, 9.999e-5, 1e-5, 123456789.0, 1e16, 9.99e15, 1.5e300, 5e-324, 2.0 ** -126,
              float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 3.4028234663852886e38]
    values += [float(v) for v in np.random.default_rng(0).standard_normal(200).astype(np.float32) * 10.0 ** np.arange(-10, 10).repeat(10)]
    bits = [struct.unpack("<q", struct.pack("<d", v))[0] for v in values]
    out = _node_eval(f"""
        import {{ formatFloat }} from {json.dumps((JS / "src" / "format.mjs").as_uri())};
        const view = new DataView(new ArrayBuffer(8));
        for (const b of {json.dumps([str(b) for b in bits])}) {{
          view.setBigInt64(0, BigInt(b), true);
          console.log(formatFloat(view.getFloat64(0, true)));
        }}""")
    assert out.splitlines() == [repr(v) for v in values]


@needs_node
def test_schedules_match_the_python_reader():
    schedules = [None, {"name": "constant"}, {"name": "linear", "warmup_steps": 3, "total_steps": 12},
                 {"name": "cosine", "warmup_steps": 4, "total_steps": 12}, {"name": "linear", "warmup_steps": 0,
                 "total_steps": 7}, {"name": "cosine", "warmup_steps": 2, "total_steps": 9, "num_cycles": 1.5}]
    expected = [[edge.lr_factor(s, k) for k in range(16)] for s in schedules]
    out = _node_eval(f"""
        import {{ lrFactor }} from {json.dumps((JS / "src" / "format.mjs").as_uri())};
        console.log(JSON.stringify({json.dumps(schedules)}.map((s) => [...Array(16).keys()].map((k) => lrFactor(s, k)))));""")
    assert json.loads(out) == expected  # exactly: the same operations in double precision


@needs_node
def test_npz_in_safetensors_out(tmp_path):
    """Every dtype --data can hold, in C and Fortran order, big-endian, compressed or not, read by the .npy/.npz
    reader and written back by the safetensors writer: Python reads the same arrays back."""
    rng = np.random.default_rng(0)
    arrays = {f"{d}": (rng.standard_normal((2, 3, 4)) * 50).astype(d)
              for d in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")}
    arrays["bool"] = rng.standard_normal((3, 5)) > 0
    arrays["fortran"] = np.asfortranarray(np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    arrays["big_endian"] = np.arange(6, dtype=">i8").reshape(2, 3)
    arrays["scalar"] = np.array(7.5, np.float64)
    arrays["empty"] = np.zeros((0, 3), np.float32)
    np.savez(tmp_path / "plain.npz", **arrays)
    np.savez_compressed(tmp_path / "deflated.npz", **arrays)
    for name in ("plain", "deflated"):
        out = tmp_path / f"{name}.safetensors"
        _node_eval(f"""
            import fs from "node:fs";
            import {{ readNpz, writeSafetensors }} from {json.dumps((JS / "src" / "index.mjs").as_uri())};
            const arrays = readNpz(fs.readFileSync({json.dumps(str(tmp_path / f"{name}.npz"))}));
            fs.writeFileSync({json.dumps(str(out))}, writeSafetensors(arrays, {{ format: "test" }}));""")
        back = safetensors.numpy.load_file(str(out))
        assert set(back) == set(arrays)
        for key, value in arrays.items():
            expected = value.astype(value.dtype.newbyteorder("="))
            assert back[key].dtype == expected.dtype and back[key].shape == expected.shape, key
            np.testing.assert_array_equal(back[key], expected, err_msg=key)


@needs_node
def test_safetensors_reader_refuses_what_safetensors_refuses(tmp_path):
    """Offsets that overlap, leave a gap or run past the file; a header longer than the file."""
    def file(header: dict, data: bytes) -> bytes:
        text = json.dumps(header).encode()
        return struct.pack("<Q", len(text)) + text + data

    good = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "I64", "shape": [], "data_offsets": [8, 16]}}
    cases = {
        "good": file(good, bytes(16)),
        "overlap": file({**good, "b": {"dtype": "I64", "shape": [], "data_offsets": [4, 12]}}, bytes(16)),
        "gap": file({**good, "b": {"dtype": "I64", "shape": [], "data_offsets": [9, 17]}}, bytes(17)),
        "past the end": file(good, bytes(12)),
        "size of the dtype": file({**good, "a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(16)),
        "header past the end": struct.pack("<Q", 1000) + b"{}",
    }
    for name, data in cases.items():
        (tmp_path / f"{name}.safetensors").write_bytes(data)
    out = _node_eval(f"""
        import fs from "node:fs";
        import {{ readSafetensors }} from {json.dumps((JS / "src" / "index.mjs").as_uri())};
        for (const name of {json.dumps(list(cases))}) {{
          try {{ readSafetensors(fs.readFileSync({json.dumps(str(tmp_path))} + "/" + name + ".safetensors")); console.log("read"); }}
          catch (e) {{ console.log("refused"); }}
        }}""")
    assert out.split() == ["read"] + ["refused"] * (len(cases) - 1)
    for name in cases:  # the safetensors library agrees on every case
        try:
            safetensors.numpy.load_file(str(tmp_path / f"{name}.safetensors"))
            verdict = "read"
        except Exception:
            verdict = "refused"
        assert verdict == ("read" if name == "good" else "refused"), name


# ---------------------------------------------------------------------------------------------------------
# The browser: headless Chromium, onnxruntime-web (WebAssembly)


@browser
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_browser_trains_like_eager_and_the_python_reader(name, exported, tmp_path):
    art = exported(name)
    out = tmp_path / "browser.safetensors"
    run = _node("js/test/browser-train.mjs", str(art.out_dir), "--data", str(art.data), "--steps", str(STEPS),
                "--out", str(out))
    assert run.returncode == 0, run.stderr
    trained = Trained(_read_lines(run.stdout), _check_state_file(out, art.signature))
    _assert_matches(trained, art.eager, "browser vs eager")
    _assert_matches(trained, art.python, "browser vs edge.py")
    _report(name, "browser", trained, art)


@browser
@pytest.mark.slow
def test_browser_reader_refuses(hostile):
    """Every case a URL can carry (symbolic links are the server's to resolve), in one browser session."""
    cases = {name: hostile[name] for name, r in REFUSALS.items() if r.over_http}
    cases.update({name: hostile[name] for name in ACCEPTED})
    run = _node("js/test/browser-open.mjs", *map(str, cases.values()))
    assert run.returncode == 0, run.stderr
    results = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(results) == len(cases)
    for (name, path), result in zip(cases.items(), results):
        assert result["dir"] == str(path)
        if name in ACCEPTED:
            assert result["ok"], (name, result)
        else:
            assert not result["ok"] and result["error"] == "ArtifactError", (name, result)
            assert re.search(REFUSALS[name].match, result["message"]), (name, result)
