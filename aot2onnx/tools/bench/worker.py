"""One contender training one model, and the fresh-process worker that times its first step and peak RSS.

This file imports the standard library and torch, nothing of aot2onnx: the benchmark runs it by path in a fresh
process (:func:`run_in_fresh_process`), so that a process measuring eager or inductor never imports aot2onnx,
onnx or onnxruntime, whose memory would count in its peak RSS. The worker loads ``models.py`` beside it by path
too; aot2onnx is imported in the worker only by ``torch.compile(backend="aot2onnx")``, as in a user's process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

__all__ = ["CONTENDERS", "LEARNING_RATE", "OPTIMIZERS", "Runner", "failure", "run_in_fresh_process"]

CONTENDERS = ("eager", "inductor", "aot2onnx")
LEARNING_RATE = 1e-3

OPTIMIZERS: dict[str, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=LEARNING_RATE),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=LEARNING_RATE, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=LEARNING_RATE),
}


def _own_code(fn: Callable, name: str) -> Callable:
    """``fn`` (a closure) as a function with a code object of its own, named ``name``.

    Dynamo caches compiled frames per code object: two backends compiling one function would share one
    cache (and its recompile limit), and each call would check the other backend's guards first.
    """
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, None, fn.__closure__)


def _loss_function(model: nn.Module, loss_fn: Callable, tag: str) -> Callable:
    """``loss_fn(model(x), y)`` as a function of its own (:func:`_own_code`)."""

    def step_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(model(x), y)

    return _own_code(step_loss, f"step_loss_{tag}")


def _optimizer_step(opt: torch.optim.Optimizer, tag: str) -> Callable[[], None]:
    """``opt.step()`` as a function of its own (:func:`_own_code`), for ``torch.compile``."""

    def optimizer_step() -> None:
        opt.step()

    return _own_code(optimizer_step, f"optimizer_step_{tag}")


class Runner:
    """One contender training one model: compiles lazily, on the first step, as torch.compile does.

    ``options`` go to the compiling contender's backend (``torch.compile(..., options=options)``);
    ``compile_optimizer`` compiles the optimizer step with the same backend and options; ``optimizer`` is a
    key of :data:`OPTIMIZERS`. ``tag`` names the compiled functions (:func:`_own_code`): runners that compile
    side by side in one process need different tags.
    """

    def __init__(self, contender: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                 tag: str = "", *, options: dict[str, Any] | None = None, compile_optimizer: bool = False,
                 optimizer: str = "sgd") -> None:
        if contender not in CONTENDERS:
            raise ValueError(f"unknown contender {contender!r}; known: {CONTENDERS}")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r}; known: {tuple(OPTIMIZERS)}")
        if contender == "eager" and (options or compile_optimizer):
            raise ValueError("eager compiles nothing: options and compile_optimizer need a compiling contender")
        self.contender = contender
        self.model = model.train()
        self.x, self.y = x, y
        tag = tag or contender.replace("-", "_")
        fn = _loss_function(model, loss_fn, tag)
        self.fn = fn if contender == "eager" else torch.compile(fn, backend=contender, options=options or None)
        self.opt = OPTIMIZERS[optimizer](model.parameters())
        self.opt_step: Callable[[], Any] = self.opt.step
        if compile_optimizer:
            self.opt_step = torch.compile(_optimizer_step(self.opt, tag), backend=contender, options=options or None)

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.fn(self.x, self.y).backward()
        self.opt_step()

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
        self.opt_step()
        t4 = clock()
        return t4 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3


def failure(e: BaseException) -> str:
    """An exception as one short line for the report (a failing contender is reported, not fatal)."""
    text = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    first = text[0] if text else ""
    if first.endswith(":") and len(text) > 1:  # Dynamo's "backend='aot2onnx' raised:", the reason below it
        first += " " + text[1]
    reason = (f"{type(e).__name__}: {first}" if first else type(e).__name__).replace("|", "/")
    return reason if len(reason) <= 160 else reason[:157] + "..."


# ---------------------------------------------------------------------------------- the fresh process


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


def _models() -> types.ModuleType:
    """``models.py`` beside this file, loaded by path (importing it as aot2onnx.tools.bench.models would import
    aot2onnx)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models.py")
    spec = importlib.util.spec_from_file_location("_aot2onnx_bench_models", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def _worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: the first step (compilation included), ``steps`` more, and how RSS grew."""
    torch.set_num_threads(cfg["threads"])
    model, x, y, loss_fn = _models().make_batch(cfg["model"])
    result: dict[str, Any] = {"rss_start_mib": _rss_mib("VmRSS")}
    try:
        # Timed from the torch.compile call: resolving a backend by name may import it (aot2onnx's entry
        # point does), while inductor imports its compiler in the first call. Eager never imports Dynamo.
        start = time.perf_counter()
        if cfg["contender"] != "eager":
            torch.compiler.reset()
        runner = Runner(cfg["contender"], model, x, y, loss_fn)
        result["rss_compile_called_mib"] = _rss_mib("VmRSS")
        runner.step()
        result["first_step_s"] = time.perf_counter() - start
        result["peak_rss_first_step_mib"] = _rss_mib("VmHWM")
        times = [runner.timed_step()[0] for _ in range(cfg["steps"])]
        result["step_s"] = statistics.median(times) if times else None
    except Exception as e:  # a contender that fails is reported, not fatal
        result["error"] = failure(e)
    result["peak_rss_mib"] = _rss_mib("VmHWM")
    return result


_RESULT = "AOT2ONNX_BENCH_RESULT "
_WORKER_CODE = "import runpy, sys; sys.exit(runpy.run_path(sys.argv[1])['_worker_entry'](sys.argv[2]))"


def _worker_entry(arg: str) -> int:
    print(_RESULT + json.dumps(_worker(json.loads(arg))), flush=True)
    return 0


def run_in_fresh_process(cfg: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Runs :func:`_worker` on ``cfg`` (model, contender, steps, threads) in a new Python process."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _WORKER_CODE, os.path.abspath(__file__), json.dumps(cfg)],
            env=env, capture_output=True, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_RESULT):
            return json.loads(line[len(_RESULT):])
    tail = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return {"error": f"worker exited with {proc.returncode}: {tail[-1][:160] if tail else 'no output'}"}
