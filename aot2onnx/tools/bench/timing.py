"""The measurements: fresh processes, alternating rounds in one process, and where aot2onnx's step goes.

Every contender trains the same model from the same initial state (a deep copy) on the same batch, with
plain SGD, in one process. Rounds alternate the order of the contenders, and a contender's ratio to eager
is the median of its per-round ratios, with their range. First-step time (compilation included) and peak
RSS come from a fresh process per (model, contender) (``worker.py``). For aot2onnx, one step is then split
into ONNX Runtime's kernel time (from ONNX Runtime's profiler, in a separate copy of the model), ONNX
Runtime's own overhead, the hand-off between torch and ONNX Runtime, AOTAutograd's wrappers and the
optimizer step, timed through the runtime's :func:`aot2onnx.runtime.session.profiling` hook. On the device
suite, each of :data:`LEVERS` is measured the same way: aot2onnx with the lever against aot2onnx without it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

import aot2onnx
from aot2onnx.compile.fallback import fallback_graphs
from aot2onnx.runtime.session import GraphCall, OrtGraph, compiled_graphs, profiling
from aot2onnx.tools.bench import worker
from aot2onnx.tools.bench.models import MODELS, SUITES, make_batch
from aot2onnx.tools.bench.worker import Runner, failure

__all__ = ["LEVERS", "SETTLE_S", "TORCH_THREADS", "Lever", "run_suite", "suite_group"]

# The pause before each contender's block, so that any thread pool the previous contender woke has gone
# back to sleep (ONNX Runtime's with spinning off, torch's OpenMP workers after their spin time).
SETTLE_S = 0.1


@dataclasses.dataclass(frozen=True)
class Lever:
    """A way to make aot2onnx's step faster, measured on each model of the device suite against aot2onnx's default.

    ``options`` go to the backend (``torch.compile(fn, backend="aot2onnx", options=options)``);
    ``compile_optimizer`` compiles the optimizer step through the same backend; ``optimizer`` is a key of
    :data:`aot2onnx.tools.bench.worker.OPTIMIZERS`, used by both sides of the comparison.
    """

    name: str
    description: str
    options: dict[str, Any]
    compile_optimizer: bool = False
    optimizer: str = "sgd"


# An option value that stands for torch's thread count when the lever's runner is built (--threads).
TORCH_THREADS = "torch.get_num_threads()"

LEVERS = (
    Lever("compiled-optimizer", "torch.compile(opt.step) through aot2onnx: one graph for all parameters (SGD)", {},
          compile_optimizer=True),
    Lever("compiled-optimizer-momentum", "the same with SGD, momentum 0.9, against aot2onnx with that SGD eagerly",
          {}, compile_optimizer=True, optimizer="sgd-momentum"),
    Lever("compiled-optimizer-adamw", "the same with AdamW, against aot2onnx with AdamW eagerly", {},
          compile_optimizer=True, optimizer="adamw"),
    Lever("no-thread-trial", "every session on torch's thread count: no per-graph trial of one thread "
          "(the default measures one against it on each graph's first calls)",
          {"intra_op_num_threads": TORCH_THREADS}),
    Lever("one-thread", "ONNX Runtime sessions on one intra-op thread", {"intra_op_num_threads": 1}),
    Lever("spin-during-runs", "ONNX Runtime's intra-op threads spin between a run's operators and stop when it "
          "returns (allow_spinning=\"run\"; the default lets them sleep, each operator waking them)",
          {"allow_spinning": "run"}),
    Lever("no-fused-kernels", "standard ONNX operators only: without aot2onnx's fused training kernels (ATen's "
          "backward kernels as ONNX Runtime custom ops, the default where they are built)", {"fused_kernels": False}),
)
assert len({lever.name for lever in LEVERS}) == len(LEVERS), "lever names must be unique"
assert all(lever.optimizer in worker.OPTIMIZERS for lever in LEVERS)


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


def _cache_env(cache_root: str) -> dict[str, str]:
    """Compile caches of inductor and aot2onnx under ``cache_root``, so a first run there is cold."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_root, "inductor"),
        "AOT2ONNX_CACHE_DIR": os.path.join(cache_root, "aot2onnx"),
    }


# --------------------------------------------------------------------------- aot2onnx: where time goes


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


def _read_profiles(graphs: Sequence[OrtGraph], skip_steps: int, steps: int) -> dict[str, Any]:
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


def _new_graphs(before: set[int]) -> list[OrtGraph]:
    return [g for g in compiled_graphs() if id(g) not in before]


def _graph_ids() -> set[int]:
    return {id(g) for g in compiled_graphs()}


def _settle_trials(runner: Runner, graphs: Sequence[OrtGraph], limit: int) -> int:
    """Untimed steps until no graph of ``graphs`` is in its thread trial, at most ``limit``; how many ran. The
    rounds then time the sessions a training run keeps, not the trial's turns between sessions."""
    steps = 0
    while steps < limit and any(g.trial_pending for g in graphs):
        runner.step()
        steps += 1
    return steps


def _breakdown(runner: Runner, base: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable, warmup: int,
               steps: int, chunks: int = 4) -> dict[str, Any]:
    """Splits aot2onnx's step: the runtime's call timings on the compiled contender, kernel times from a
    profiled copy. The two alternate in ``chunks`` blocks, so that both see the same conditions on the machine.
    """
    calls: list[GraphCall] = []
    rows: list[tuple[float, ...]] = []
    with tempfile.TemporaryDirectory(prefix="aot2onnx-bench-profile-") as tmp:
        before = _graph_ids()
        profiled = Runner("aot2onnx", copy.deepcopy(base), x, y, loss_fn, tag="aot2onnx_profiled")
        with profiling(ort_profile_prefix=os.path.join(tmp, "ort")):
            profiled.step()  # compiles the forward and backward graphs: their sessions profile
        profiled_graphs = [g for g in _new_graphs(before) if g.session is not None]
        for _ in range(warmup):
            profiled.step()
        with profiling():
            for _ in range(warmup):
                runner.step()
        sizes = [steps // chunks + (i < steps % chunks) for i in range(min(chunks, steps))]
        for size in sizes:
            gc.collect()
            with profiling() as profile:
                gc.disable()
                try:
                    rows += [runner.timed_step() for _ in range(size)]
                finally:
                    gc.enable()
            calls += profile.calls
            gc.collect()
            gc.disable()
            try:
                for _ in range(size):
                    profiled.step()
            finally:
                gc.enable()
        profile_figures = _read_profiles(profiled_graphs, 1 + warmup, steps)
    step_s, zero_grad_s, forward_s, backward_s, opt_s = (sum(col) / steps for col in zip(*rows))
    call_s = sum(c.call_s for c in calls) / steps
    runs = [c.run_s for c in calls if c.run_s is not None]
    result: dict[str, Any] = {
        "step_s": step_s, "forward_s": forward_s, "backward_s": backward_s, "optimizer_s": zero_grad_s + opt_s,
        "ort_calls_per_step": len(calls) / steps, "profile": profile_figures, "steps": steps,
    }
    if runs:
        run_s, run_source = sum(runs) / steps, "timed"
    else:  # no call ran a session: take ONNX Runtime's own figure
        run_s, run_source = profile_figures.get("model_run_s", 0.0), "profiler"
    kernel_s = profile_figures["kernel_s"] if profile_figures["sessions"] else None
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


def _session_settings(graphs: Sequence[OrtGraph]) -> dict[str, Any]:
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


def _alternate(pair: Sequence[Runner], args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Per round, each runner's median step over a timed block; the two go first in turn."""
    times: tuple[list[float], list[float]] = ([], [])
    for r in range(args.rounds):
        for k in (0, 1) if r % 2 == 0 else (1, 0):
            block = _timed_block(pair[k], args.warmup, args.steps)
            times[k].append(statistics.median(b[0] for b in block))
    return times


def _bench_levers(default: Runner | None, base: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                  args: argparse.Namespace, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Each of :data:`LEVERS` against aot2onnx's default in alternating rounds, as the contenders are timed.

    ``default`` is the rounds' aot2onnx runner (plain SGD), if it ran; a lever with another optimizer is
    compared with a default runner of its own, with that optimizer.
    """
    defaults: dict[str, Runner] = {"sgd": default} if default is not None else {}
    out = []
    for i, lever in enumerate(LEVERS):
        entry: dict[str, Any] = {"name": lever.name, "description": lever.description, "options": lever.options,
                                 "compile_optimizer": lever.compile_optimizer, "optimizer": lever.optimizer}
        out.append(entry)
        log(f"  lever {lever.name}: compiling, then {args.rounds} alternating rounds against aot2onnx's default ...")
        try:
            if lever.optimizer not in defaults:
                tag = "aot2onnx_" + lever.optimizer.replace("-", "_")
                before = _graph_ids()
                runner = Runner("aot2onnx", copy.deepcopy(base), x, y, loss_fn, tag=tag, optimizer=lever.optimizer)
                runner.step()
                _settle_trials(runner, _new_graphs(before), args.trial_steps)
                defaults[lever.optimizer] = runner
            before, fallbacks_before = _graph_ids(), {id(g) for g in fallback_graphs()}
            options = {k: torch.get_num_threads() if v == TORCH_THREADS else v for k, v in lever.options.items()}
            mine = Runner("aot2onnx", copy.deepcopy(base), x, y, loss_fn, tag=f"aot2onnx_lever_{i}",
                          options=options, compile_optimizer=lever.compile_optimizer, optimizer=lever.optimizer)
            start = time.perf_counter()
            mine.step()
            entry["in_process_first_step_s"] = time.perf_counter() - start
            entry["trial_steps"] = _settle_trials(mine, _new_graphs(before), args.trial_steps)
            entry["sessions"] = _session_settings(_new_graphs(before))
            entry["fallback_graphs"] = sum(1 for g in fallback_graphs() if id(g) not in fallbacks_before)
            default_times, lever_times = _alternate([defaults[lever.optimizer], mine], args)
        except Exception as e:
            entry["error"] = failure(e)
            log(f"  lever {lever.name}: failed: {entry['error']}")
            continue
        entry.update(step_s=statistics.median(lever_times), default_step_s=statistics.median(default_times),
                     round_step_s=lever_times, default_round_step_s=default_times,
                     ratio_to_default=_median_ratio(lever_times, default_times))
        log(f"  lever {lever.name}: {entry['step_s'] * 1e3:.2f} ms against {entry['default_step_s'] * 1e3:.2f} ms")
    return out


def _another_round(done: int, args: argparse.Namespace, timed_s: Sequence[float]) -> bool:
    """Whether the rounds go on after ``done``: to ``args.rounds``, and then, to ``args.max_rounds`` at most, while
    some contender's timed steps (``timed_s``, each one's total) add up to less than ``args.min_timed_s``. Five
    rounds of a 5 ms step time a contender for half a second, and the VM's slow and fast spells then move a
    small model's ratio to inductor by up to 0.5 between runs (docs/benchmark-findings.md, 2026-11-29)."""
    if done < args.rounds:
        return True
    return bool(timed_s) and done < args.max_rounds and min(timed_s) < args.min_timed_s


def _bench_model(name: str, args: argparse.Namespace, cache_root: str, log: Callable[[str], None]) -> dict[str, Any]:
    contenders = list(args.contenders)
    spec = MODELS[name]
    result: dict[str, Any] = {"name": name, "title": spec.title, "suite": spec.suite, "transformer": spec.transformer,
                              "contenders": {}}
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
        cold = worker.run_in_fresh_process(cfg, env, args.timeout)
        per[contender]["cold"] = cold
        if contender != "eager" and args.warm_cache and "error" not in cold:
            log(f"  {contender}: second process on the compile caches ...")
            per[contender]["warm"] = worker.run_in_fresh_process({**cfg, "steps": 0}, env, args.timeout)

    result["others_cores_fresh"] = _others_cores(fresh_start)
    # One process, all contenders from one initial state, alternating.
    torch.compiler.reset()
    base, x, y, loss_fn = make_batch(name)
    runners: dict[str, Runner] = {}
    aot_graphs: list[OrtGraph] = []
    fallbacks: list[Any] = []
    for contender in contenders:
        os.environ.update(_cache_env(os.path.join(cache_root, name, contender)))
        log(f"  {contender}: compiling in the benchmark process ...")
        try:
            before = _graph_ids() if contender == "aot2onnx" else set()
            fallbacks_before = {id(g) for g in fallback_graphs()} if contender == "aot2onnx" else set()
            runner = Runner(contender, copy.deepcopy(base), x, y, loss_fn)
            start = time.perf_counter()
            runner.step()
            per[contender]["in_process_first_step_s"] = time.perf_counter() - start
            runners[contender] = runner
            if contender == "aot2onnx":
                aot_graphs = _new_graphs(before)
                fallbacks = [g for g in fallback_graphs() if id(g) not in fallbacks_before]
                per[contender]["trial_steps"] = _settle_trials(runner, aot_graphs, args.trial_steps)
        except Exception as e:
            per[contender]["error"] = failure(e)
            log(f"  {contender}: failed: {per[contender]['error']}")

    times: dict[str, list[float]] = {c: [] for c in runners}
    phases: dict[str, list[tuple[float, ...]]] = {c: [] for c in runners}
    rounds_start = _cpu_snapshot()
    r = 0
    while _another_round(r, args, [sum(step[0] for step in phases[c]) for c in runners]):
        live = [c for c in contenders if c in runners]
        order = live[r % len(live):] + live[: r % len(live)] if live else []
        for contender in order:
            try:
                block = _timed_block(runners[contender], args.warmup, args.steps)
            except Exception as e:
                per[contender]["error"] = failure(e)
                del runners[contender]
                continue
            times[contender].append(statistics.median(b[0] for b in block))
            phases[contender].extend(block)
        log(f"  round {r + 1}/{args.rounds}{'+' if r + 1 > args.rounds else ''}: " + ", ".join(
            f"{c} {times[c][-1] * 1e3:.1f} ms" for c in order if c in runners and times[c]))
        r += 1
    result["rounds"] = r
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
        log("  aot2onnx: where the time goes (call timings and a profiled copy, alternating) ...")
        try:
            result["breakdown"] = _breakdown(runners["aot2onnx"], base, x, y, loss_fn, args.warmup,
                                             args.breakdown_steps)
        except Exception as e:
            result["breakdown"] = {"error": failure(e)}
    if args.levers and spec.suite == "device":
        levers_start = _cpu_snapshot()
        result["levers"] = _bench_levers(runners.get("aot2onnx"), base, x, y, loss_fn, args, log)
        result["others_cores_levers"] = _others_cores(levers_start)
    runners.clear()
    torch.compiler.reset()
    return result


# ------------------------------------------------------------------------- the machine and its noise


def _versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import onnxscript

    versions = {"python": platform.python_version(), "torch": torch.__version__, "onnx": onnx.__version__,
                "onnxscript": onnxscript.__version__, "onnxruntime": onnxruntime.__version__,
                "aot2onnx": aot2onnx.__version__}
    try:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(aot2onnx.__file__)))
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
        "settings": {k: getattr(args, k) for k in ("rounds", "min_timed_s", "max_rounds", "steps", "warmup",
                                                      "trial_steps", "breakdown_steps", "process_steps", "threads",
                                                      "quick", "levers")},
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


def suite_group(model: dict[str, Any]) -> str:
    """The suite a model's figures are reported with: its own, or the main suite's for a model outside the
    suites (the tests' tiny model stands in for the main suite)."""
    return model.get("suite") or SUITES[0]


def _geomeans(results: dict[str, Any], suite: str) -> dict[str, float]:
    """Per contender, the geometric mean over ``suite``'s models of the ratio to eager (all of them or none)."""
    models = [m for m in results["models"] if suite_group(m) == suite]
    out = {}
    for contender in results["contenders"]:
        medians = [(m["contenders"][contender].get("ratio_to_eager") or {}).get("median") for m in models]
        if contender != "eager" and medians and all(medians):
            out[contender] = _geomean(medians)
    return out


def _summary(results: dict[str, Any]) -> dict[str, Any]:
    present = [suite for suite in SUITES if any(suite_group(m) == suite for m in results["models"])]
    by_suite = {suite: _geomeans(results, suite) for suite in present}
    # geomean_ratio_to_eager: the main suite's, the figure the first targets are set on.
    return {"geomean_ratio_to_eager": by_suite.get(SUITES[0], {}), "geomean_by_suite": by_suite}
