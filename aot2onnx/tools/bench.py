"""``python -m aot2onnx bench``: training steps timed side by side, eager vs inductor vs aot2onnx.

Every contender trains the same model from the same initial state (a deep copy) on the same batch, with
plain SGD, in one process. Rounds alternate the order of the contenders, and a contender's ratio to eager
is the median of its per-round ratios, with their range. First-step time (compilation included) and peak
RSS come from a fresh process per (model, contender). For aot2onnx, one step is then split into ONNX
Runtime's kernel time (from ONNX Runtime's profiler, in a separate run), ONNX Runtime's own overhead, the
hand-off between torch and ONNX Runtime, AOTAutograd's wrappers and the optimizer step, with timers that
exist only during that run. The results go to ``BENCHMARKS.md`` and a bar chart.

Run ``python -m aot2onnx bench --help`` for the options; ``make bench`` runs the full suite.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["CONTENDERS", "MODELS", "main", "render_markdown", "run_suite"]

CONTENDERS = ("eager", "inductor", "aot2onnx")
LEARNING_RATE = 1e-3
# The pause before each contender's block, so that any thread pool the previous contender woke has gone
# back to sleep (ONNX Runtime's with spinning off, torch's OpenMP workers after their spin time).
SETTLE_S = 0.1


# ----------------------------------------------------------------------------------------------- models


class _Block(nn.Module):
    """A pre-norm causal attention block, as in ``examples/tiny_gpt.py``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """A GPT-style language model: the architecture of ``examples/tiny_gpt.py``, self-contained here."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _mlp(width: int, layers: int) -> nn.Module:
    modules: list[nn.Module] = []
    for i in range(layers):
        modules.append(nn.Linear(width, width))
        if i < layers - 1:
            modules.append(nn.ReLU())
    return nn.Sequential(*modules)


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(64, 10),
    )


Batch = tuple[nn.Module, torch.Tensor, torch.Tensor, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    title: str
    build: Callable[[torch.Generator], Batch]
    in_suite: bool = True


def _build_mlp(g: torch.Generator) -> Batch:
    return _mlp(1024, 4), torch.randn(64, 1024, generator=g), torch.randn(64, 1024, generator=g), F.mse_loss


def _build_encoder(dropout: float) -> Callable[[torch.Generator], Batch]:
    def build(g: torch.Generator) -> Batch:
        layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, dropout=dropout,
                                           batch_first=True)
        return layer, torch.randn(8, 128, 256, generator=g), torch.randn(8, 128, 256, generator=g), F.mse_loss
    return build


def _build_cnn(g: torch.Generator) -> Batch:
    return _cnn(), torch.randn(32, 3, 64, 64, generator=g), torch.randint(0, 10, (32,), generator=g), F.cross_entropy


def _build_gpt(g: torch.Generator) -> Batch:
    model = GPT(vocab=512, dim=256, heads=4, layers=4, context=128)
    tokens = torch.randint(0, 512, (8, 129), generator=g)
    return model, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), _lm_loss


def _build_tiny(g: torch.Generator) -> Batch:
    return _mlp(64, 2), torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g), F.mse_loss


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("mlp", "MLP: 4 x Linear(1024, 1024) + ReLU, batch 64, MSE", _build_mlp),
        ModelSpec("encoder", "TransformerEncoderLayer d=256, 4 heads, ff 1024, batch 8 x 128, dropout 0.0, MSE",
                  _build_encoder(0.0)),
        ModelSpec("encoder-dropout",
                  "TransformerEncoderLayer d=256, 4 heads, ff 1024, batch 8 x 128, dropout 0.1, MSE",
                  _build_encoder(0.1)),
        ModelSpec("cnn", "CNN: 2 x (Conv3x3-BatchNorm-ReLU), max/avg pooling, Linear; batch 32 x 3x64x64, "
                  "cross-entropy", _build_cnn),
        ModelSpec("gpt", "GPT LM: 4 layers, d=256, 4 heads, sequence 128, vocabulary 512, batch 8, cross-entropy",
                  _build_gpt),
        ModelSpec("tiny", "tiny MLP: 2 x Linear(64, 64), batch 8, MSE (for tests)", _build_tiny, in_suite=False),
    )
}
assert len(MODELS) == 6, "model names must be unique"


def _make_batch(name: str) -> Batch:
    """The model in its initial state and its batch: the same in every process for a given name."""
    torch.manual_seed(0)
    return MODELS[name].build(torch.Generator().manual_seed(0))


# ---------------------------------------------------------------------------------------------- stepping


def _loss_function(model: nn.Module, loss_fn: Callable, tag: str) -> Callable:
    """``loss_fn(model(x), y)`` as a function with a code object of its own.

    Dynamo caches compiled frames per code object: two backends compiling one function would share one
    cache (and its recompile limit), and each call would check the other backend's guards first.
    """

    def step_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(model(x), y)

    code = step_loss.__code__.replace(co_name=f"step_loss_{tag}")
    return types.FunctionType(code, step_loss.__globals__, code.co_name, None, step_loss.__closure__)


class Runner:
    """One contender training one model: compiles lazily, on the first step, as torch.compile does."""

    def __init__(self, contender: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                 tag: str = "") -> None:
        self.contender = contender
        self.model = model.train()
        self.x, self.y = x, y
        fn = _loss_function(model, loss_fn, tag or contender.replace("-", "_"))
        if contender == "eager":
            self.fn = fn
        elif contender == "inductor":
            self.fn = torch.compile(fn, backend="inductor")
        elif contender == "aot2onnx":
            self.fn = torch.compile(fn, backend="aot2onnx")
        else:
            raise ValueError(f"unknown contender {contender!r}; known: {CONTENDERS}")
        self.opt = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.fn(self.x, self.y).backward()
        self.opt.step()

    def timed_step(self) -> tuple[float, float, float, float, float]:
        """Seconds for (the whole step, zero_grad, forward with the loss, backward, optimizer step)."""
        clock = time.perf_counter
        t0 = clock()
        self.opt.zero_grad(set_to_none=True)
        t1 = clock()
        loss = self.fn(self.x, self.y)
        t2 = clock()
        loss.backward()
        t3 = clock()
        self.opt.step()
        t4 = clock()
        return t4 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3


def _timed_block(runner: Runner, warmup: int, steps: int) -> list[tuple[float, ...]]:
    """Warm-up steps, then ``steps`` timed ones, with the garbage collector held off while timing."""
    gc.collect()
    time.sleep(SETTLE_S)
    for _ in range(warmup):
        runner.step()
    gc.disable()
    try:
        return [runner.timed_step() for _ in range(steps)]
    finally:
        gc.enable()


def _failure(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    reason = (f"{type(e).__name__}: {first}" if first else type(e).__name__).replace("|", "/")
    return reason if len(reason) <= 160 else reason[:157] + "..."


# ---------------------------------------------------------------------------------- fresh-process runs


def _worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: the first step (compilation included), ``steps`` more, and how RSS grew."""
    torch.set_num_threads(cfg["threads"])
    model, x, y, loss_fn = _make_batch(cfg["model"])
    result: dict[str, Any] = {"rss_start_mib": _rss_mib("VmRSS")}
    try:
        # Timed from the torch.compile call: resolving a backend by name may import it (aot2onnx's entry
        # point does), while inductor imports its compiler in the first call. Eager never imports Dynamo.
        start = time.perf_counter()
        if cfg["contender"] != "eager":
            torch._dynamo.reset()
        runner = Runner(cfg["contender"], model, x, y, loss_fn)
        result["rss_compile_called_mib"] = _rss_mib("VmRSS")
        runner.step()
        result["first_step_s"] = time.perf_counter() - start
        result["peak_rss_first_step_mib"] = _rss_mib("VmHWM")
        times = [runner.timed_step()[0] for _ in range(cfg["steps"])]
        result["step_s"] = statistics.median(times) if times else None
    except Exception as e:  # a contender that fails is reported, not fatal
        result["error"] = _failure(e)
    result["peak_rss_mib"] = _rss_mib("VmHWM")
    return result


def _rss_mib(field: str) -> float:
    """This process's resident set size (``VmRSS``) or its peak (``VmHWM``), from /proc/self/status.

    Not ``getrusage(RUSAGE_SELF).ru_maxrss``: Linux keeps that mark across ``execve``, so a worker forked from
    the benchmark process (torch, onnxruntime and models loaded) starts from the parent's RSS at the fork (seen
    here: a bare torch process showed 361 MiB instead of 300). VmHWM starts afresh with the new address space.
    ``ru_maxrss`` is the fallback where there is no /proc.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _worker_entry(arg: str) -> int:
    print("AOT2ONNX_BENCH_RESULT " + json.dumps(_worker(json.loads(arg))), flush=True)
    return 0


# The worker runs this file by path rather than as ``aot2onnx.tools.bench``, so that a process measuring eager
# or inductor never imports aot2onnx, onnx or onnxruntime: their memory would count in its peak RSS.
_WORKER_CODE = "import runpy, sys; sys.exit(runpy.run_path(sys.argv[1])['_worker_entry'](sys.argv[2]))"


def _fresh_process(cfg: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _WORKER_CODE, os.path.abspath(__file__), json.dumps(cfg)],
            env=env, capture_output=True, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("AOT2ONNX_BENCH_RESULT "):
            return json.loads(line.split(" ", 1)[1])
    tail = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return {"error": f"worker exited with {proc.returncode}: {tail[-1][:160] if tail else 'no output'}"}


def _cache_env(cache_root: str) -> dict[str, str]:
    """Compile caches of inductor and aot2onnx under ``cache_root``, so a first run there is cold."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_root, "inductor"),
        "AOT2ONNX_CACHE_DIR": os.path.join(cache_root, "aot2onnx"),
    }


# --------------------------------------------------------------------------- aot2onnx: where time goes


class _PhaseTimer:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.call_s = 0.0  # inside OrtGraph calls
        self.calls = 0
        self.run_s = 0.0  # inside ONNX Runtime's run
        self.runs = 0


class _TimedSession:
    """Stands in for an InferenceSession's C object, timing its ``run*`` methods."""

    def __init__(self, inner: Any, timer: _PhaseTimer) -> None:
        self._inner = inner
        self._timer = timer

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not (name.startswith("run") and callable(attr)):
            return attr
        timer = self._timer

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                timer.run_s += time.perf_counter() - start
                timer.runs += 1

        return timed


@contextlib.contextmanager
def _ort_timers(graphs: Sequence[Any], timer: _PhaseTimer) -> Iterator[None]:
    """Times OrtGraph calls and ONNX Runtime runs, only inside this block (the normal path has no hook)."""
    from aot2onnx.runtime.session import OrtGraph

    original_call = OrtGraph.__call__

    def timed_call(self: Any, args: list[Any]) -> list[Any]:
        start = time.perf_counter()
        try:
            return original_call(self, args)
        finally:
            timer.call_s += time.perf_counter() - start
            timer.calls += 1

    swapped = []
    OrtGraph.__call__ = timed_call
    try:
        for graph in graphs:
            session = graph.session
            if session is not None and hasattr(session, "_sess"):
                swapped.append((session, session._sess))
                session._sess = _TimedSession(session._sess, timer)
        yield
    finally:
        OrtGraph.__call__ = original_call
        for session, inner in swapped:
            session._sess = inner


@contextlib.contextmanager
def _profiled_sessions(prefix: str) -> Iterator[None]:
    """Sessions created inside this block write ONNX Runtime's profile (a JSON trace) under ``prefix``."""
    from aot2onnx.runtime import session as session_module

    original = session_module.session_options

    def with_profiling(options: Any) -> Any:
        so = original(options)
        so.enable_profiling = True
        so.profile_file_prefix = prefix
        return so

    session_module.session_options = with_profiling
    try:
        yield
    finally:
        session_module.session_options = original


def _new_graphs(before: set[int]) -> list[Any]:
    from aot2onnx.runtime.session import compiled_graphs

    return [g for g in compiled_graphs() if id(g) not in before]


def _graph_ids() -> set[int]:
    from aot2onnx.runtime.session import compiled_graphs

    return {id(g) for g in compiled_graphs()}


def _kernel_profile(trace: list[dict[str, Any]], skip_runs: int) -> tuple[int, float, float, dict[str, float]]:
    """(runs kept, seconds in model_run, seconds in node kernels, seconds per op type) of one session's trace,
    leaving out its first ``skip_runs`` runs."""
    runs = sorted((e for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])[skip_runs:]
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in runs]
    kernel_us = 0.0
    by_op: dict[str, float] = {}
    for e in trace:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        if not any(lo <= e["ts"] <= hi for lo, hi in windows):
            continue
        kernel_us += e["dur"]
        op = e.get("args", {}).get("op_name", "?")
        by_op[op] = by_op.get(op, 0.0) + e["dur"] * 1e-6
    return len(runs), sum(e["dur"] for e in runs) * 1e-6, kernel_us * 1e-6, by_op


def _read_profiles(graphs: Sequence[Any], skip_steps: int, steps: int) -> dict[str, Any]:
    """Ends the profiles of ``graphs``: kernel seconds per step over their last ``steps`` steps, in all, per
    graph kind and per op type, and the seconds ONNX Runtime's own ``model_run`` events took."""
    out: dict[str, Any] = {"kernel_s": 0.0, "model_run_s": 0.0, "by_kind": {}, "by_op": {}, "sessions": 0}
    for graph in graphs:
        path = graph.session.end_profiling()
        if not path or not os.path.exists(path):
            continue
        with open(path) as f:
            trace = json.load(f)
        os.remove(path)
        total_runs = sum(1 for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run")
        per_step = max(1, round(total_runs / (skip_steps + steps)))
        _, run_s, kernel_s, by_op = _kernel_profile(trace, total_runs - per_step * steps)
        out["sessions"] += 1
        out["kernel_s"] += kernel_s / steps
        out["model_run_s"] += run_s / steps
        out["by_kind"][graph.kind] = out["by_kind"].get(graph.kind, 0.0) + kernel_s / steps
        for op, seconds in by_op.items():
            out["by_op"][op] = out["by_op"].get(op, 0.0) + seconds / steps
    if not out["sessions"]:
        out["error"] = "no ONNX Runtime profile was written (were the sessions made without session_options?)"
    return out


def _breakdown(runner: Runner, graphs: Sequence[Any], base: nn.Module, x: torch.Tensor, y: torch.Tensor,
               loss_fn: Callable, warmup: int, steps: int, chunks: int = 4) -> dict[str, Any]:
    """Splits aot2onnx's step: phase timers on the compiled contender, kernel times from a profiled copy.

    The two alternate in ``chunks`` blocks, so that both see the same conditions on the machine.
    """
    timer = _PhaseTimer()
    rows: list[tuple[float, ...]] = []
    with tempfile.TemporaryDirectory(prefix="aot2onnx-bench-profile-") as tmp:
        before = _graph_ids()
        profiled = Runner("aot2onnx", copy.deepcopy(base), x, y, loss_fn, tag="aot2onnx_profiled")
        with _profiled_sessions(os.path.join(tmp, "ort")):
            profiled.step()  # compiles the forward and backward graphs: their sessions profile
        profiled_graphs = [g for g in _new_graphs(before) if g.session is not None]
        for _ in range(warmup):
            profiled.step()
        with _ort_timers(graphs, timer):
            for _ in range(warmup):
                runner.step()
        timer.reset()
        sizes = [steps // chunks + (i < steps % chunks) for i in range(min(chunks, steps))]
        for size in sizes:
            gc.collect()
            with _ort_timers(graphs, timer):
                gc.disable()
                try:
                    rows += [runner.timed_step() for _ in range(size)]
                finally:
                    gc.enable()
            gc.collect()
            gc.disable()
            try:
                for _ in range(size):
                    profiled.step()
            finally:
                gc.enable()
        profile = _read_profiles(profiled_graphs, 1 + warmup, steps)
    step_s, zero_grad_s, forward_s, backward_s, opt_s = (sum(col) / steps for col in zip(*rows))
    call_s = timer.call_s / steps
    result: dict[str, Any] = {
        "step_s": step_s, "forward_s": forward_s, "backward_s": backward_s, "optimizer_s": zero_grad_s + opt_s,
        "ort_calls_per_step": timer.calls / steps, "profile": profile, "steps": steps,
    }
    if timer.runs:
        run_s, run_source = timer.run_s / steps, "timed"
    else:  # the session's run method is reached some other way: take ONNX Runtime's own figure
        run_s, run_source = profile.get("model_run_s", 0.0), "profiler"
    kernel_s = profile["kernel_s"] if profile["sessions"] else None
    parts = [
        ("ONNX Runtime kernels (profiler)", kernel_s),
        ("ONNX Runtime outside kernels (executor, allocation)", None if kernel_s is None else run_s - kernel_s),
        ("hand-off torch <-> ORT (binding, DLPack)", call_s - run_s),
        ("Dynamo guards, AOTAutograd wrappers and epilogue, autograd engine", forward_s + backward_s - call_s),
        ("optimizer (zero_grad + SGD step)", zero_grad_s + opt_s),
        ("rest of the loop (timers)", step_s - (zero_grad_s + forward_s + backward_s + opt_s)),
    ]
    if kernel_s is None:
        parts[0] = ("ONNX Runtime run, kernels not separated (no profile)", run_s)
        parts[1] = ("ONNX Runtime outside kernels (executor, allocation)", 0.0)
    result.update(parts=parts, run_s=run_s, run_source=run_source, call_s=call_s, kernel_s=kernel_s,
                  handoff_s=call_s - run_s, wrappers_s=forward_s + backward_s - call_s)
    return result


def _session_settings(graphs: Sequence[Any]) -> dict[str, Any]:
    """What each aot2onnx session really runs with, read back from its session options."""
    spinning, threads = set(), set()
    for graph in graphs:
        if graph.session is None:
            continue
        so = graph.session.get_session_options()
        try:
            spinning.add(so.get_session_config_entry("session.intra_op.allow_spinning"))
        except RuntimeError:  # not set: ONNX Runtime's default, which spins
            spinning.add("unset (ONNX Runtime's default: on)")
        threads.add(so.intra_op_num_threads)
    return {"sessions": sum(1 for g in graphs if g.session is not None), "allow_spinning": sorted(spinning),
            "intra_op_threads": sorted(threads)}


# ------------------------------------------------------------------------------------------------ suite


def _median_ratio(num: Sequence[float], den: Sequence[float]) -> dict[str, float] | None:
    ratios = [a / b for a, b in zip(num, den) if a and b]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def _bench_model(name: str, args: argparse.Namespace, cache_root: str, log: Callable[[str], None]) -> dict[str, Any]:
    contenders = list(args.contenders)
    result: dict[str, Any] = {"name": name, "title": MODELS[name].title, "contenders": {}}
    per = result["contenders"]
    for contender in contenders:
        per[contender] = {}

    fresh_start = _cpu_snapshot()
    # Fresh processes: a cold first step (empty compile caches), peak RSS, and a second process on the
    # caches the first one left (for the compiling contenders).
    for contender in contenders:
        root = os.path.join(cache_root, name, contender)
        env = {**os.environ, **_cache_env(root)}
        cfg = {"model": name, "contender": contender, "steps": args.process_steps, "threads": args.threads}
        log(f"  {contender}: fresh process (first step, peak RSS) ...")
        cold = _fresh_process(cfg, env, args.timeout)
        per[contender]["cold"] = cold
        if contender != "eager" and args.warm_cache and "error" not in cold:
            log(f"  {contender}: second process on the compile caches ...")
            per[contender]["warm"] = _fresh_process({**cfg, "steps": 0}, env, args.timeout)

    result["others_cores_fresh"] = _others_cores(fresh_start)
    # One process, all contenders from one initial state, alternating.
    torch._dynamo.reset()
    base, x, y, loss_fn = _make_batch(name)
    runners: dict[str, Runner] = {}
    aot_graphs: list[Any] = []
    fallbacks: list[Any] = []
    for contender in contenders:
        os.environ.update(_cache_env(os.path.join(cache_root, name, contender)))
        log(f"  {contender}: compiling in the benchmark process ...")
        try:
            before = _graph_ids() if contender == "aot2onnx" else set()
            fallbacks_before = _fallback_ids() if contender == "aot2onnx" else set()
            runner = Runner(contender, copy.deepcopy(base), x, y, loss_fn)
            start = time.perf_counter()
            runner.step()
            per[contender]["in_process_first_step_s"] = time.perf_counter() - start
            runners[contender] = runner
            if contender == "aot2onnx":
                aot_graphs = _new_graphs(before)
                fallbacks = _new_fallbacks(fallbacks_before)
        except Exception as e:
            per[contender]["error"] = _failure(e)
            log(f"  {contender}: failed: {per[contender]['error']}")

    times: dict[str, list[float]] = {c: [] for c in runners}
    phases: dict[str, list[tuple[float, ...]]] = {c: [] for c in runners}
    rounds_start = _cpu_snapshot()
    for r in range(args.rounds):
        live = [c for c in contenders if c in runners]
        order = live[r % len(live):] + live[: r % len(live)] if live else []
        for contender in order:
            try:
                block = _timed_block(runners[contender], args.warmup, args.steps)
            except Exception as e:
                per[contender]["error"] = _failure(e)
                del runners[contender]
                continue
            times[contender].append(statistics.median(b[0] for b in block))
            phases[contender].extend(block)
        log(f"  round {r + 1}/{args.rounds}: " + ", ".join(
            f"{c} {times[c][-1] * 1e3:.1f} ms" for c in order if c in runners and times[c]))
    result["others_cores_rounds"] = _others_cores(rounds_start)
    eager = times.get("eager") if "eager" in runners else None
    for contender, runner_times in times.items():
        if contender not in runners or not runner_times:
            continue
        entry = per[contender]
        entry["step_s"] = statistics.median(runner_times)
        entry["round_step_s"] = runner_times
        columns = list(zip(*phases[contender]))
        entry["phases_s"] = {
            "forward": statistics.median(columns[2]), "backward": statistics.median(columns[3]),
            "optimizer": statistics.median(a + b for a, b in zip(columns[1], columns[4])),
        }
        if eager:
            entry["ratio_to_eager"] = _median_ratio(runner_times, eager)
    if "aot2onnx" in runners and "inductor" in runners:
        result["aot2onnx_to_inductor"] = _median_ratio(times["aot2onnx"], times["inductor"])

    if "aot2onnx" in runners:
        result["sessions"] = _session_settings(aot_graphs)
        result["fallback_graphs"] = len(fallbacks)
        log("  aot2onnx: where the time goes (phase timers and a profiled copy, alternating) ...")
        try:
            result["breakdown"] = _breakdown(runners["aot2onnx"], aot_graphs, base, x, y, loss_fn,
                                             args.warmup, args.breakdown_steps)
        except Exception as e:
            result["breakdown"] = {"error": _failure(e)}
    runners.clear()
    torch._dynamo.reset()
    return result


def _fallback_ids() -> set[int]:
    from aot2onnx.compile.fallback import fallback_graphs

    return {id(g) for g in fallback_graphs()}


def _new_fallbacks(before: set[int]) -> list[Any]:
    from aot2onnx.compile.fallback import fallback_graphs

    return [g for g in fallback_graphs() if id(g) not in before]


def _versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import onnxscript

    import aot2onnx

    versions = {"python": platform.python_version(), "torch": torch.__version__, "onnx": onnx.__version__,
                "onnxscript": onnxscript.__version__, "onnxruntime": onnxruntime.__version__,
                "aot2onnx": aot2onnx.__version__}
    try:
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        head = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        if head:
            versions["aot2onnx"] += f" (git {head}{', with uncommitted changes' if dirty else ''})"
    except (OSError, subprocess.SubprocessError):
        pass
    return versions


def _machine(threads: int) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            cpu = names[0]
    except OSError:
        pass
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "cores": os.cpu_count(), "available_cores": available, "threads": threads,
            "platform": platform.platform()}


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


# Above this many cores used on average by other processes during a measurement, the report says the
# machine was busy. An idle machine shows a few hundredths.
BUSY_CORES = 0.15


def _cpu_snapshot() -> tuple[float, float, float] | None:
    """(wall seconds, CPU seconds the whole machine was busy, CPU seconds of this process and its children)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields + [0] * (8 - len(fields))
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    own = os.times()
    return time.monotonic(), busy, own.user + own.system + own.children_user + own.children_system


def _others_cores(start: tuple[float, float, float] | None) -> float | None:
    """How many cores other processes kept busy, on average, since ``start``: the noise in a measurement."""
    end = _cpu_snapshot()
    if start is None or end is None or end[0] <= start[0]:
        return None
    return max(0.0, (end[1] - start[1]) - (end[2] - start[2])) / (end[0] - start[0])


def run_suite(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs the benchmark described by the parsed ``args``; returns every figure the report shows."""
    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python -m aot2onnx bench " + " ".join(args.argv),
        "machine": _machine(args.threads), "versions": _versions(), "load_start": _load(),
        "settings": {k: getattr(args, k) for k in ("rounds", "steps", "warmup", "breakdown_steps",
                                                      "process_steps", "threads", "quick")},
        "contenders": list(args.contenders), "models": [],
    }
    saved_env = {k: os.environ.get(k) for k in _cache_env("")}
    with tempfile.TemporaryDirectory(prefix="aot2onnx-bench-") as cache_root:
        try:
            for name in args.models:
                log(f"{name}: {MODELS[name].title}")
                results["models"].append(_bench_model(name, args, cache_root, log))
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    results["load_end"] = _load()
    results["summary"] = _summary(results)
    return results


def _geomean(values: Sequence[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _summary(results: dict[str, Any]) -> dict[str, Any]:
    summary: dict[str, Any] = {"geomean_ratio_to_eager": {}}
    for contender in results["contenders"]:
        ratios = [m["contenders"][contender].get("ratio_to_eager", {}) or {} for m in results["models"]]
        medians = [r.get("median") for r in ratios]
        if contender != "eager" and medians and all(medians):
            summary["geomean_ratio_to_eager"][contender] = _geomean(medians)
    return summary


# ----------------------------------------------------------------------------------------------- report


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    return f"{ms:.0f}" if abs(ms) >= 100 else f"{ms:.1f}" if abs(ms) >= 1 else f"{ms:.2f}"


def _cores(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratio(r: dict[str, float] | None) -> str:
    return "-" if not r else f"{r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]"


def _first_step(entry: dict[str, Any], key: str) -> str:
    run = entry.get(key)
    if not run:
        return "-"
    if "error" in run:
        return f"failed: {run['error']}"
    return f"{run['first_step_s']:.2f}"


def _targets(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(target, figure, met / not met) for each of the issue's targets that this run can judge."""
    rows = []
    models = {m["name"]: m for m in results["models"]}
    contenders = results["contenders"]
    if "aot2onnx" in contenders and "eager" in contenders:
        gm = results["summary"]["geomean_ratio_to_eager"].get("aot2onnx")
        rows.append(("aot2onnx step time, geometric mean over the suite, <= 0.75 of eager's",
                     "-" if gm is None else f"{gm:.2f} of eager's", "-" if gm is None else _met(gm <= 0.75)))
    if "aot2onnx" in contenders and "inductor" in contenders:
        figures, ok = [], True
        for name, m in models.items():
            r = m.get("aot2onnx_to_inductor")
            figures.append(f"{name} {r['median']:.2f}" if r else f"{name} -")
            ok = ok and bool(r) and r["median"] < 1.0
        rows.append(("aot2onnx step time below inductor's on each model (aot2onnx / inductor)", ", ".join(figures),
                     _met(ok)))
    if "mlp" in models and "breakdown" in models["mlp"] and models["mlp"]["breakdown"].get("kernel_s"):
        b = models["mlp"]["breakdown"]
        share = (b["handoff_s"] + b["wrappers_s"]) / b["kernel_s"]
        rows.append(("MLP: hand-off + wrappers <= 5% of ONNX Runtime kernel time",
                     f"{_ms(b['handoff_s'] + b['wrappers_s'])} ms of {_ms(b['kernel_s'])} ms = {share:.1%}",
                     _met(share <= 0.05)))
    if "aot2onnx" in contenders and "inductor" in contenders:
        figures, ok = [], True
        for name, m in models.items():
            a = m["contenders"]["aot2onnx"].get("cold", {}).get("first_step_s")
            i = m["contenders"]["inductor"].get("cold", {}).get("first_step_s")
            figures.append(f"{name} {a / i:.2f}" if a and i else f"{name} -")
            ok = ok and bool(a and i) and a <= 0.5 * i
        rows.append(("first step (cold, fresh process) <= half of inductor's (aot2onnx / inductor)",
                     ", ".join(figures), _met(ok)))
    if "aot2onnx" in contenders:
        warm = [(name, m["contenders"]["aot2onnx"].get("warm", {}).get("first_step_s"))
                for name, m in models.items() if name.startswith("encoder")]
        if any(w for _, w in warm):
            rows.append(("transformer layer: first step in a second process (warm aot2onnx cache) <= 2 s",
                         ", ".join(f"{name} {w:.2f} s" if w else f"{name} -" for name, w in warm),
                         _met(all(w and w <= 2.0 for _, w in warm))))
    if "aot2onnx" in contenders and "eager" in contenders:
        figures, ok = [], True
        for name, m in models.items():
            a = m["contenders"]["aot2onnx"].get("cold", {}).get("peak_rss_mib")
            e = m["contenders"]["eager"].get("cold", {}).get("peak_rss_mib")
            figures.append(f"{name} {a / e:.2f}" if a and e else f"{name} -")
            ok = ok and bool(a and e) and a <= 1.1 * e
        rows.append(("peak RSS <= 1.1x eager's (aot2onnx / eager, each in its own process)", ", ".join(figures),
                     _met(ok)))
    return rows


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def _where_time_goes(m: dict[str, Any]) -> list[str]:
    b = m.get("breakdown")
    if not b:
        return []
    if "error" in b:
        return [f"Breakdown failed: {b['error']}", ""]
    step = b["step_s"]
    lines = ["| part of one aot2onnx step | ms | share |", "|---|---:|---:|"]
    for label, seconds in b["parts"]:
        lines.append(f"| {label} | {_ms(seconds)} | {'-' if seconds is None else f'{seconds / step:.0%}'} |")
    lines.append(f"| **step (this run, mean of {b['steps']} steps)** | **{_ms(step)}** | 100% |")
    lines.append("")
    p = b["profile"]
    notes = []
    if p.get("sessions"):
        kinds = ", ".join(f"{kind} {_ms(s)} ms" for kind, s in sorted(p["by_kind"].items()))
        top = sorted(p["by_op"].items(), key=lambda kv: -kv[1])[:6]
        notes.append(f"ONNX Runtime kernels by graph: {kinds}. Heaviest op types: "
                     + ", ".join(f"{op} {_ms(s)} ms" for op, s in top) + ".")
    else:
        notes.append(f"No kernel profile: {p.get('error', 'unknown reason')}.")
    eager = m["contenders"].get("eager", {}).get("phases_s")
    mine = m["contenders"].get("aot2onnx", {}).get("phases_s")
    if eager and mine:
        notes.append("Phase medians from the timed rounds, aot2onnx vs eager: forward+loss "
                     f"{_ms(mine['forward'])} vs {_ms(eager['forward'])} ms, backward {_ms(mine['backward'])} vs "
                     f"{_ms(eager['backward'])} ms, optimizer {_ms(mine['optimizer'])} vs "
                     f"{_ms(eager['optimizer'])} ms.")
    notes.append(f"{b['ort_calls_per_step']:.0f} compiled-graph call(s) per step; ONNX Runtime's run time "
                 f"{'timed around the session run' if b['run_source'] == 'timed' else 'from its profiler'}.")
    if m.get("fallback_graphs"):
        notes.append(f"{m['fallback_graphs']} graph(s) fell back to PyTorch for some nodes: their PyTorch "
                     "compute is counted under the wrappers.")
    return lines + [" ".join(notes), ""]


def _step_gap(m: dict[str, Any]) -> str | None:
    """One model: how aot2onnx's step compares with eager's, phase by phase, and its heaviest ONNX ops."""
    mine, eager, b = m["contenders"].get("aot2onnx", {}), m["contenders"].get("eager", {}), m.get("breakdown")
    if "step_s" not in mine or "step_s" not in eager or not b or "error" in b:
        return None
    p = b["profile"]
    text = f"{m['name']}: aot2onnx {_ms(mine['step_s'])} ms, eager {_ms(eager['step_s'])} ms per step."
    if p.get("sessions"):
        ep = eager.get("phases_s", {})
        kf, kb = p["by_kind"].get("forward", 0.0), p["by_kind"].get("backward", 0.0)
        text += (f" ONNX Runtime's kernels alone take {_ms(b['kernel_s'])} ms: forward graph {_ms(kf)} ms against "
                 f"eager's whole forward+loss {_ms(ep.get('forward'))} ms, backward graph {_ms(kb)} ms against "
                 f"eager's backward {_ms(ep.get('backward'))} ms.")
        top = sorted(p["by_op"].items(), key=lambda kv: -kv[1])[:4]
        text += " Heaviest ONNX op types: " + ", ".join(f"{op} {_ms(sec)} ms" for op, sec in top) + "."
    text += (f" Outside the kernels: ONNX Runtime's executor {_ms(b['parts'][1][1])} ms, "
             f"hand-off {_ms(b['handoff_s'])} ms, wrappers {_ms(b['wrappers_s'])} ms, optimizer "
             f"{_ms(b['optimizer_s'])} ms.")
    return text


# What the figures above do not show by themselves: measurements taken while tuning aot2onnx on the 2-core
# machine the benchmark was written on (2026-11-22), and what would close each gap.
FINDINGS = """What would close the gaps (measured while tuning, on the 2-core machine this report was written on):

- The step is ONNX Runtime's kernels: hand-off and wrappers are 2-10% of it, and the same graphs take
  about the same kernel time run alone in a bare ONNX Runtime process. Matrix products dominate every
  model but the CNN. ONNX Runtime's (MLAS) match MKL's (eager) in isolation and lose inside a step: with
  spinning off, each parallel section has to wake the second thread (one 64x1024x1024 Gemm: 1.34 ms, 0.90
  ms with spinning, torch 1.10 ms); with spinning on, ONNX Runtime's threads hold the cores after the run
  and slow torch's work, and spinning only during runs (`session.force_spinning_stop`) made the MLP step
  slower here (19.2 -> 23.3 ms), and so did short bounded spinning (`session.intra_op.spin_duration_us`
  50 or 200 us: MLP step 1.08-1.11x, transformer layer 0.98-0.99x, same process, alternating rounds). One
  thread pool shared by all sessions (`set_global_thread_pool_sizes`, `use_per_session_threads=False`),
  which spins and cannot be told not to from Python, made the MLP step slower too (median 23.0 against
  16.6 ms; per-session pools that spin: 44 ms). torch's OpenMP workers also spin after each torch op and
  share the cores with the next ONNX Runtime run (`OMP_WAIT_POLICY=PASSIVE` cut the transformer layer's
  backward kernels from 41 to 33 ms, and slowed eager). Neither operand order nor transposed flags change
  the picture: Gemm with the operands swapped and the product transposed (W @ x^T for x @ W^T) was within
  2% on the suite's Linear shapes, and 13% faster only on the MLP's 64-row batch before the transpose
  back. A step faster than eager's needs fewer, fused kernels: LayerNorm, GELU, softmax and ReLU gradients
  are 5-10 elementwise ONNX ops each, and ONNX Runtime's fused gradient kernels exist only in its training
  build, which did not beat eager here either (its on-device training API: MLP 1.31, transformer layer
  1.03, CNN 1.33 of eager's step, from ../shared/FIELD-NOTES.md); custom ONNX Runtime operators would be
  the way.
- CNN: convolutions whose channel counts are multiples of 16 now run in ONNX Runtime's blocked channel
  layout (`com.microsoft.nchwc`; its own transformer takes only constant weights, so aot2onnx reorders the
  weight in the graph): 32->64 channels 7.0 -> 6.4 ms, 64->32 channels 9.0 -> 6.6 ms alone, CNN step
  0.900x (alternating rounds). The convolution weight gradient is now one matrix product over an unfolded
  input (it was a convolution with an image-sized kernel: 43 ms, now about 13 ms), taken as unfolded input
  times dY transposed, so that ONNX Runtime packs the smaller dY (alone 2-27% faster than the other
  orientation on 6 convolutions; step 0.973x); torch's weight gradient, which unfolds inside its kernel,
  is still 1.1-1.8x faster on those shapes. Max-pool indices no longer need a second whole-input MaxPool
  (about 11 ms saved). Batch norm in training mode now normalizes and applies its weight and bias in one
  ONNX BatchNormalization fed the batch statistics (step 0.974x), and a large stride-1 convolution's input
  gradient is a Conv with the flipped weight rather than a ConvTranspose (step 0.993x; alone 7-30% faster
  at 16-64 channels and 32x32 or more, slower on small images, which keep ConvTranspose). Left: MaxPool
  with indices (8.7 ms; 1.4-2.3 ms without; indices from a second MaxPool over a weighted equality mask
  took 28 ms, ONNX Runtime's broadcasts over a size-2 innermost axis being slow), ReLU's backward `Where`
  (3.4 ms per 4M elements, where a multiply by the mask would take 1.7 ms but differs for non-finite
  gradients).
- Attention: saved transposes are no longer written by the forward graph. Views are recomputed in the
  backward graph (`recompute_views`), and aten.transpose is decomposed to permute, which the partitioner
  counts as a view (transpose is missing from its list); ONNX Runtime folds the transposes into the
  backward's MatMuls. GPT step 0.97x, the other models unchanged (alternating rounds). Reshapes of
  matrix-product results (`_unsafe_view`, also missing from that list) are still saved as copies (16 in
  GPT's forward). `_safe_softmax` finds fully masked rows with `all`, which now reduces one-byte truth
  values rather than torch_lib's int64 ones (0.76 -> 0.43 ms per layer alone; GPT step 0.98x); its
  full-size `Where` (0.4 ms per layer) is left.
- Bias gradients: ONNX Runtime's ReduceSum over the leading axis is 1.4-3x slower than a MatMul with a
  row of ones (alone: 90 against 45 us for 1024 x 256), so float sums over leading axes now lower to
  that product: step time 0.97-0.99x (MLP 0.972, transformer layer 0.974, GPT 0.978, CNN 0.990, median
  of 8 alternating rounds). Small models stay far from eager: on the demo's 2-layer, 64-wide
  transformer ONNX Runtime's kernels take 17.5 ms of a 20 ms step against eager's 10 ms step, with
  materialised transposes (1.2 ms of the 6.4 ms forward) and many small elementwise kernels.
- Peak RSS: importing Dynamo alone adds about 70 MiB to torch (inductor pays it too: 1.2x eager here),
  ONNX Runtime 18 MiB, and the cold compilation onnxscript and torch's exporter, about 65 MiB more; the
  rest is ONNX Runtime's arena, one for all sessions. Sessions run without ONNX Runtime's memory pattern
  (a block per session sized for its planned peak): 10-70 MiB less. Tried and worse: the arena growing
  by what is requested rather than by powers of two (+20-30 MiB, fragmentation), and no arena (+10-80
  MiB). On a warm cache a process imports neither onnxscript nor the exporter (GPT 578 MiB, eager 420).
  Lowering in a child process would keep them out of a cold one too. Of GPT's warm 578 MiB, the first
  forward run adds 93 MiB (76 MiB of it the 67 tensors saved for the backward, about what eager saves)
  and the first backward run 84 MiB: the backward graph holds every saved tensor until it ends, where
  eager's autograd frees each node's as it goes. Other arena settings, warm peaks GPT / CNN: growth by
  the requested size -14 / +51 MiB, `max_dead_bytes_per_chunk` 1 MiB -10 / -12 MiB with a slower CNN
  step (77-88 against 68 ms), a 64 MiB first chunk +11 / -2 MiB. The target
  is out of reach for any Dynamo backend on the MLP: torch, the model and Dynamo's imports come to
  354 MiB before compiling, against 383 MiB (1.1x eager's peak).
- First step on a warm cache: AOTAutograd's own cache now sits above the graph cache, so a second
  process skips the capture too (transformer layer: 0.43-0.50 s of AOTAutograd tracing -> 0.04-0.06 s
  for the lookup, the rebuilt runtime wrappers and both sessions), and the decomposition table is built
  only on a miss (0.08 s). That puts the transformer layer at the 2 s line, not clearly under it:
  standalone runs gave 1.75-2.14 s (dropout 0) and 2.01-2.05 s (dropout 0.1). What is left is torch's:
  importing Dynamo (1.1-1.6 s here) and Dynamo's bytecode tracing (about 0.5 s; a quarter of it is
  Dynamo tokenizing source files for its debug headers: 0.22 s of a 0.59 s first step, 0.17 s of it for
  torch/nn/modules/transformer.py, computed for a trace-log line that is off). A margin would take
  skipping Dynamo's tracing too; its experimental precompile (`TORCH_CACHING_PRECOMPILE=1`) did not skip
  it in a second process here (2.21-2.25 s) and drops guards with warnings."""


def _gaps(results: dict[str, Any]) -> list[str]:
    """Where each target that is not met loses, from the figures of this run."""
    models = results["models"]
    lines = []
    slow = [m for m in models if (m["contenders"].get("aot2onnx", {}).get("ratio_to_eager") or {}).get("median", 0)
            > 0.75]
    for m in slow:
        gap = _step_gap(m)
        if gap:
            lines.append(f"- Step time, {gap}")
    for m in models:
        r = m.get("aot2onnx_to_inductor")
        if r and r["median"] >= 1.0:
            ind = m["contenders"]["inductor"]
            lines.append(f"- Against inductor, {m['name']}: aot2onnx {_ms(m['contenders']['aot2onnx']['step_s'])} ms, "
                         f"inductor {_ms(ind['step_s'])} ms (forward {_ms(ind['phases_s']['forward'])}, backward "
                         f"{_ms(ind['phases_s']['backward'])} ms).")
    for m in models:
        a = m["contenders"].get("aot2onnx", {})
        i = m["contenders"].get("inductor", {})
        ac, ic = a.get("cold", {}).get("first_step_s"), i.get("cold", {}).get("first_step_s")
        if ac and ic and ac > 0.5 * ic:
            warm = a.get("warm", {}).get("first_step_s")
            lines.append(f"- First step, {m['name']}: aot2onnx {ac:.2f} s cold"
                         + (f", {warm:.2f} s on a warm cache" if warm else "") + f"; inductor {ic:.2f} s cold.")
    for m in models:
        a = m["contenders"].get("aot2onnx", {}).get("cold", {})
        e = m["contenders"].get("eager", {}).get("cold", {})
        if a.get("peak_rss_mib") and e.get("peak_rss_mib") and a["peak_rss_mib"] > 1.1 * e["peak_rss_mib"]:
            lines.append(_rss_gap(m["name"], a, e))
    return lines


_RSS_KEYS = ("rss_start_mib", "rss_compile_called_mib", "peak_rss_first_step_mib", "peak_rss_mib")


def _rss_steps(run: dict[str, Any]) -> tuple[float, float, float, float] | None:
    """(at start, added by torch.compile's imports, by compiling and the first step, by the later steps)."""
    if any(run.get(k) is None for k in _RSS_KEYS):
        return None
    start, called, first, peak = (run[k] for k in _RSS_KEYS)
    return start, called - start, first - called, peak - first


def _rss_gap(name: str, mine: dict[str, Any], eager: dict[str, Any]) -> str:
    text = f"- Peak RSS, {name}: aot2onnx {mine['peak_rss_mib']:.0f} MiB, eager {eager['peak_rss_mib']:.0f} MiB"
    a, e = _rss_steps(mine), _rss_steps(eager)
    if a and e:
        text += (f"; from the same start ({a[0]:.0f} MiB: torch, the model, the batch), aot2onnx adds "
                 f"{a[1]:.0f} MiB of imports in the setup (`torch.compile`, the optimizer; eager {e[1]:.0f}), {a[2]:.0f} over compilation "
                 f"and the first step (eager {e[2]:.0f}) and {a[3]:.0f} in the later steps (eager {e[3]:.0f})")
    return text + "."


def render_markdown(results: dict[str, Any], chart: str | None = None) -> str:
    """The report: summary, targets, a table and a breakdown per model, method, machine and versions."""
    machine, versions, settings = results["machine"], results["versions"], results["settings"]
    contenders = results["contenders"]
    noise = [(m["name"], m.get("others_cores_rounds"), m.get("others_cores_fresh")) for m in results["models"]]
    busiest = max((v for _, r, f in noise for v in (r, f) if v is not None), default=None)
    out = [
        "# Training-step benchmark: eager vs inductor vs aot2onnx",
        "",
        f"Generated by `{results['command']}` on {results['date']}.",
        "",
    ]
    if busiest is not None:
        out += [
            ("**The machine was busy**: " if busiest > BUSY_CORES else "The machine was quiet: ")
            + "other processes kept this many of its "
            f"{machine['available_cores']} cores busy on average (from /proc/stat, less this process and its "
            "children) during the timed rounds / the fresh-process runs: "
            + ", ".join(f"{n} {_cores(r)} / {_cores(f)}" for n, r, f in noise) + "."
            + (" Other work shared the cores, so these timings are noisy (eager's OpenMP steps suffer most): "
               "rerun `make bench` on a quiet machine." if busiest > BUSY_CORES else ""),
            "",
        ]
    if settings.get("quick"):
        out += ["**Quick mode**: a handful of steps, for tests; these figures are not a measurement.", ""]
    out += ["## Summary", ""]
    if chart:
        out += [f"![step time relative to eager]({chart})", ""]
    header = "| model | " + " | ".join(f"{c} ms" for c in contenders) + " | " + " | ".join(
        f"{c} / eager" for c in contenders if c != "eager") + " |"
    out += [header, "|---|" + "---:|" * (2 * len(contenders) - 1)]
    for m in results["models"]:
        cells = []
        for c in contenders:
            e = m["contenders"][c]
            cells.append(f"failed: {e['error']}" if "error" in e and "step_s" not in e else _ms(e.get("step_s")))
        ratios = [_ratio(m["contenders"][c].get("ratio_to_eager")) for c in contenders if c != "eager"]
        out.append(f"| {m['name']} | " + " | ".join(cells + ratios) + " |")
    gm = results["summary"]["geomean_ratio_to_eager"]
    if gm:
        out += ["", "Geometric mean of the step-time ratio to eager over the suite: "
                + ", ".join(f"{c} **{v:.2f}**" for c, v in gm.items()) + " (lower is faster)."]
    targets = _targets(results)
    if targets:
        out += ["", "## Targets", "", "| target | figure | |", "|---|---|---|"]
        out += [f"| {t} | {f} | {s} |" for t, f, s in targets]
        gaps = _gaps(results)
        if gaps:
            out += ["", "Where the targets that are not met lose:", ""] + gaps + ["", FINDINGS]
    out += ["", "## Per model", ""]
    for m in results["models"]:
        out += [f"### {m['name']}: {m['title']}", "",
                "| contender | step ms | ratio to eager, median [min-max] | first step s, cold | "
                "first step s, compile caches warm | peak RSS MiB |",
                "|---|---:|---:|---:|---:|---:|"]
        for c in contenders:
            e = m["contenders"][c]
            step = _ms(e.get("step_s")) if "step_s" in e else f"failed: {e.get('error', '-')}"
            rss = e.get("cold", {}).get("peak_rss_mib")
            warm = "n/a" if c == "eager" else _first_step(e, "warm")
            out.append(f"| {c} | {step} | {'1.00' if c == 'eager' else _ratio(e.get('ratio_to_eager'))} | "
                       f"{_first_step(e, 'cold')} | {warm} | {'-' if rss is None else f'{rss:.0f}'} |")
        rss = [(c, _rss_steps(m["contenders"][c].get("cold", {}))) for c in contenders]
        if any(r for _, r in rss):
            out += ["", "| RSS of each fresh process, MiB | at start (torch, model, batch) | + setup: "
                    "torch.compile or not, SGD (imports) | + compilation and first step | + later steps |", "|---|---:|---:|---:|---:|"]
            out += [f"| {c} | " + " | ".join(f"{v:.0f}" for v in r) + " |" for c, r in rss if r]
        if m.get("aot2onnx_to_inductor"):
            out += ["", f"aot2onnx / inductor, median of per-round ratios: {_ratio(m['aot2onnx_to_inductor'])}."]
        if "sessions" in m:
            s = m["sessions"]
            out += ["", f"aot2onnx ran {s['sessions']} ONNX Runtime session(s); allow_spinning read back from "
                    f"each session's options: {', '.join(s['allow_spinning']) or '-'} (0 = off); intra-op "
                    f"threads {', '.join(map(str, s['intra_op_threads'])) or '-'}."]
        out += [""]
        if m.get("breakdown"):
            out += ["#### Where aot2onnx's step goes", ""] + _where_time_goes(m)
    out += ["## Method", "", _method(results), "",
            "## Machine and versions", "",
            f"- CPU: {machine['cpu']}, {machine['cores']} cores ({machine['available_cores']} available to the "
            f"process); torch threads {machine['threads']}; {machine['platform']}; 1-minute load average "
            f"{_cores(results.get('load_start'))} at the start, {_cores(results.get('load_end'))} at the end "
            "(this process included)",
            "- " + ", ".join(f"{k} {v}" for k, v in versions.items()),
            f"- settings: {', '.join(f'{k}={v}' for k, v in settings.items())}", ""]
    return "\n".join(out)


def _method(results: dict[str, Any]) -> str:
    s = results["settings"]
    return (
        "Each step is a full SGD training step: `zero_grad(set_to_none=True)`, forward with the loss, "
        "`backward()`, `step()` (learning rate 1e-3). The compiled contenders compile the model together with "
        "its loss (`torch.compile(lambda x, y: loss_fn(model(x), y), backend=...)`, one function object per "
        "contender so Dynamo's caches stay apart); the optimizer runs eagerly for all of them. Per model, every "
        "contender starts from a deep copy of one initial model and trains on the same batch in one process. "
        f"A round runs each contender once: {s['warmup']} warm-up step(s) after a {SETTLE_S * 1e3:.0f} ms pause "
        f"and a garbage collection, then {s['steps']} timed steps with the garbage collector off; the "
        "contender's time for the round is the median of those steps. "
        f"{s['rounds']} rounds rotate the order of the contenders, so each runs first, second and last. A "
        "contender's step time is the median over rounds, and its ratio to eager is the median of the per-round "
        "ratios, with their minimum and maximum. Keeping each measurement clean of the others: ONNX Runtime's "
        "idle threads would otherwise spin and hold the cores while the next contender runs; aot2onnx's "
        "default is `allow_spinning=False`, and the report reads the setting back from every session's "
        "options; the warm-up steps and the pause before each block let the previous contender's thread pools "
        "(ONNX Runtime's, and torch's OpenMP workers) go idle. torch and ONNX Runtime use the same thread count "
        f"({s['threads']}). First-step time is the wall time of the first training step, compilation included, "
        "in a fresh process per (model, contender) that calls `torch._dynamo.reset()` first and uses empty "
        "inductor and aot2onnx compile caches (cold); the compiling contenders are then run in a second fresh "
        f"process on the caches the first left behind (warm). The first process then runs {s['process_steps']} "
        "more steps and reports its peak RSS (VmHWM from `/proc/self/status`: `getrusage(RUSAGE_SELF).ru_maxrss` would carry over the benchmark process's RSS at the fork): it imports torch and the "
        "model, plus only what its contender needs (eager and inductor never import onnx or onnxruntime); "
        "inductor's compile worker processes are not counted. Where aot2onnx's step goes: on the compiled "
        "aot2onnx model, after the rounds, timers are installed around `OrtGraph.__call__` and around the "
        "ONNX Runtime session's run for that run only (the normal path has no hook), and "
        f"{s['breakdown_steps']} steps are timed by phase; the compiled forward+backward wall time minus the "
        "time inside OrtGraph calls is Dynamo's guards, AOTAutograd's wrappers and epilogue and the autograd "
        "engine; time inside OrtGraph calls but outside ONNX Runtime's run is the hand-off (binding inputs and "
        "outputs, DLPack). ONNX Runtime's kernel time comes from a separate copy of the model compiled with "
        "ONNX Runtime's profiler on (the sum of the `Node` kernel durations of its JSON trace over the same "
        "number of steps, warm-up runs left out); the run time minus that is ONNX Runtime's executor and "
        "allocation overhead (the profiler slows the kernels a little, so this can come out negative, which "
        "then means the overhead is below what profiling adds). Noise: the CPU time other processes used while each model was measured (the "
        "machine's busy time from /proc/stat minus this process's and its children's) is reported at the top; "
        f"above {BUSY_CORES} cores on average the report calls the machine busy."
    )


def write_chart(results: dict[str, Any], path: str) -> str | None:
    """A bar chart of step time relative to eager, per model and contender; returns why not, if it can't."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (`pip install matplotlib`, or `make bench` installs it)"
    contenders = [c for c in results["contenders"] if c != "eager"]
    models = results["models"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(models) + 2), 4.0))
    width = 0.8 / max(1, len(contenders))
    colors = {"inductor": "#8c8c8c", "aot2onnx": "#1f77b4"}
    top = 1.2
    for i, contender in enumerate(contenders):
        xs, heights, lows, highs = [], [], [], []
        for j, m in enumerate(models):
            r = m["contenders"][contender].get("ratio_to_eager")
            xpos = j + (i - (len(contenders) - 1) / 2) * width
            if not r:
                ax.text(xpos, 0.05, "failed", rotation=90, ha="center", va="bottom", fontsize=8)
                continue
            xs.append(xpos)
            heights.append(r["median"])
            lows.append(r["median"] - r["min"])
            highs.append(r["max"] - r["median"])
        ax.bar(xs, heights, width, yerr=[lows, highs], capsize=3, label=contender,
               color=colors.get(contender), error_kw={"ecolor": "#444444", "elinewidth": 1})
        for xpos, h, hi in zip(xs, heights, highs):
            ax.text(xpos, h, f"{h:.2f}", ha="center", va="bottom", fontsize=7,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
            top = max(top, 1.08 * (h + hi))
    ax.axhline(1.0, color="black", linewidth=1, label="eager")
    if "aot2onnx" in contenders:
        ax.axhline(0.75, color="#2ca02c", linewidth=1, linestyle="--", label="target 0.75 (geomean)")
    ax.set_ylim(0, top)
    ax.set_xticks(range(len(models)))
    ax.set_xticklabels([m["name"] for m in models])
    ax.set_ylabel("step time / eager's (median of rounds)")
    m = results["machine"]
    noise = [v for x in models for v in (x.get("others_cores_rounds"), x.get("others_cores_fresh")) if v is not None]
    busy = " - machine busy, noisy" if noise and max(noise) > BUSY_CORES else ""
    ax.set_title(f"Training step relative to eager ({m['threads']} threads, {m['cpu']}){busy}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ------------------------------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m aot2onnx bench", description=__doc__.split("\n\n")[0])
    suite = [n for n, s in MODELS.items() if s.in_suite]
    p.add_argument("--models", default=",".join(suite),
                   help=f"comma-separated, from {', '.join(MODELS)} (default: {','.join(suite)})")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated (default: all)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of alternating contenders (default 5)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per contender per round (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before each timed block (default 3)")
    p.add_argument("--breakdown-steps", type=int, default=20, help="steps of the aot2onnx breakdown (default 20)")
    p.add_argument("--process-steps", type=int, default=10,
                   help="steps after the first in each fresh process, for peak RSS (default 10)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads, and so ONNX Runtime's (default 2)")
    p.add_argument("--quick", action="store_true", help="a few steps of everything, for tests")
    p.add_argument("--no-warm-cache", dest="warm_cache", action="store_false",
                   help="skip the second fresh process that measures the first step on warm compile caches")
    p.add_argument("--timeout", type=float, default=1200, help="seconds allowed to each fresh process")
    p.add_argument("--out", default="BENCHMARKS.md", help="the report (default BENCHMARKS.md)")
    p.add_argument("--chart", default="docs/benchmarks.png", help="the bar chart PNG ('' for none)")
    p.add_argument("--json", default="", help="also write every figure as JSON here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = argv
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [m for m in args.models if m not in MODELS] + [c for c in args.contenders if c not in CONTENDERS]
    if unknown or not args.models or not args.contenders:
        parser.error(f"unknown or missing models/contenders: {unknown}")
    args.contenders = [c for c in CONTENDERS if c in args.contenders]
    if args.quick:
        args.rounds, args.steps, args.warmup = min(args.rounds, 2), min(args.steps, 3), min(args.warmup, 1)
        args.breakdown_steps, args.process_steps = min(args.breakdown_steps, 3), min(args.process_steps, 2)
        args.warm_cache = False
    results = run_suite(args, log=lambda line: print(line, flush=True))
    chart = None
    if args.chart:
        why_not = write_chart(results, args.chart)
        if why_not:
            print(f"no chart: {why_not}")
        else:
            chart = os.path.relpath(os.path.abspath(args.chart), os.path.dirname(os.path.abspath(args.out)))
    with open(args.out, "w") as f:
        f.write(render_markdown(results, chart))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    print(f"wrote {args.out}" + (f" and {args.chart}" if chart else ""))
    return 0
