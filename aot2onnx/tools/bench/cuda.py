"""``python -m aot2onnx bench --device cuda``: training steps on a GPU, eager vs inductor (plain and with CUDA
graphs, ``mode="reduce-overhead"``) vs aot2onnx, in fp32 (TF32 off in torch, and so in ONNX Runtime) and TF32
(on in both), side by side in one process; peak device memory per contender in fresh processes; parity with
eager (``aot2onnx.testing.assert_parity``) on every model. Writes its section of BENCHMARKS.md, with the card.

Timing: every contender of a model is compiled and warmed up first; then rounds alternate them, each round a
block of steps between two ``torch.cuda.synchronize()``; a contender's figure is the median of its blocks'
mean step. Memory: device memory held after the steps in a fresh process of the contender alone, less what
the process held before the model was built (CUDA's context): torch's pool and ONNX Runtime's arena both
count, as neither gives memory back to the driver.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from aot2onnx.tools.bench.models import GPT, make_batch

__all__ = ["CUDA_CONTENDERS", "CUDA_MODELS", "main", "render_section"]

# aot2onnx's variants are its levers, each against the default options.
CUDA_CONTENDERS: dict[str, tuple[str, dict[str, Any]]] = {
    "eager": ("eager", {}),
    "inductor": ("inductor", {}),
    "inductor-ro": ("inductor", {"mode": "reduce-overhead"}),
    "aot2onnx": ("aot2onnx", {}),
    "aot2onnx-cuda-graphs": ("aot2onnx", {"cuda_graphs": True}),
    "aot2onnx-shared-arena": ("aot2onnx", {"cuda_memory": "shared"}),
    "aot2onnx-session-arenas": ("aot2onnx", {"cuda_memory": "session"}),
}
PRECISIONS = ("fp32", "tf32")
SECTION_START, SECTION_END = "<!-- cuda benchmark -->", "<!-- /cuda benchmark -->"


def _cnn3() -> nn.Module:
    layers: list[nn.Module] = []
    channels = 3
    for width in (32, 64, 128):
        layers += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2)]
        channels = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))


def _lm(vocab: int, dim: int, heads: int, layers: int, context: int, batch: int) -> Callable[[], tuple]:
    def build() -> tuple:
        model = GPT(vocab=vocab, dim=dim, heads=heads, layers=layers, context=context)
        tokens = torch.randint(0, vocab, (batch, context + 1))
        return model, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), _lm_loss, "sgd"
    return build


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _gpt2_small() -> tuple:
    import transformers

    from aot2onnx.tools.bench.models import _Logits

    config = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # 124M parameters
    model = _Logits(transformers.GPT2LMHeadModel(config), use_cache=False)
    tokens = torch.randint(0, config.vocab_size, (8, 257))
    return model, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), _lm_loss, "adamw"


def _bench_model(name: str) -> Callable[[], tuple]:
    def build() -> tuple:
        model, x, y, loss = make_batch(name)
        return model, x, y, loss, "sgd"
    return build


@dataclasses.dataclass(frozen=True)
class CudaModel:
    name: str
    title: str
    build: Callable[[], tuple]  # () -> (model, input, target, loss_fn, optimizer name), on the CPU


CUDA_MODELS = {m.name: m for m in (
    CudaModel("mlp", "MLP 4 x Linear(1024, 1024) + ReLU, batch 256, MSE",
              lambda: (*_mlp_batch(), "sgd")),
    CudaModel("cnn", "CNN 3 x (Conv3x3-BatchNorm-ReLU-MaxPool), batch 32 x 3x64x64", lambda: (
        _cnn3(), torch.randn(32, 3, 64, 64), torch.randint(0, 10, (32,)), F.cross_entropy, "sgd")),
    CudaModel("gpt-d256", "GPT d256, 4 layers, sequence 128, batch 16", _lm(512, 256, 4, 4, 128, 16)),
    CudaModel("gpt-d768", "GPT d768, 6 layers, sequence 256, batch 8", _lm(2048, 768, 12, 6, 256, 8)),
    CudaModel("gpt2-small", "Hugging Face GPT-2 small (124M), batch 8 x 256, AdamW", _gpt2_small),
    CudaModel("mobilenet", "the zoo's TinyMobileNet, batch 16 x 3x32x32", _bench_model("mobilenet-s")),
    CudaModel("bert", "the zoo's BertForSequenceClassification config, batch 16 x 32", _bench_model("bert-s")),
)}


def _mlp_batch() -> tuple:
    layers: list[nn.Module] = []
    for i in range(4):
        layers += [nn.Linear(1024, 1024)] + ([nn.ReLU()] if i < 3 else [])
    return nn.Sequential(*layers), torch.randn(256, 1024), torch.randn(256, 1024), F.mse_loss


_device = torch.device("cuda")


def _sync() -> None:
    if _device.type == "cuda":
        torch.cuda.synchronize()


def _set_precision(precision: str) -> None:
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4) if name == "adamw" else torch.optim.SGD(params, lr=1e-3)


def _runner(model_name: str, contender: str) -> Callable[[], None]:
    """One training step of a fresh copy of the model (seeded), compiled as ``contender`` says."""
    torch.manual_seed(0)
    model, x, y, loss_fn, optimizer_name = CUDA_MODELS[model_name].build()
    model, x, y = model.to(_device), x.to(_device), y.to(_device)
    backend, settings = CUDA_CONTENDERS[contender]
    if backend == "eager":
        forward = model
    elif backend == "inductor":
        forward = torch.compile(model, **settings)
    else:
        forward = torch.compile(model, backend="aot2onnx", options={"cache": False, **settings})
    optimizer = _optimizer(optimizer_name, model.parameters())

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(forward(x), y).backward()
        optimizer.step()

    return step


def _time(runners: dict[str, Callable[[], None]], rounds: int, steps: int, log: Callable[[str], None]) -> dict[str, float]:
    blocks: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, step in runners.items():
            _sync()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            _sync()
            blocks[name].append((time.perf_counter() - start) / steps * 1e3)
    return {name: statistics.median(b) for name, b in blocks.items()}


_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
          "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize")


def profile_steps(step: Callable[[], None], steps: int) -> dict[str, Any]:
    """Where ``steps`` warm training steps spend their time (``torch.profiler`` with CUDA activity, which sees
    ONNX Runtime's kernels too): per step, the wall time, kernels launched and their summed and overlapped
    device time, copies by direction, CUDA-graph launches, and the host waits for the device (synchronize
    calls and synchronous ``cudaMemcpy``); the kernels that take the most device time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        _sync()
        wall = time.perf_counter() - start
    events = prof.events()
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    kernels = [e for e in device if not e.name.startswith(("Memcpy", "Memset"))]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, float("-inf")
    for a, b in spans:  # the union of the kernels' intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    copies: dict[str, int] = {}
    for e in device:
        if e.name.startswith("Memcpy"):
            kind = e.name.split()[1]  # DtoH, HtoD, DtoD
            copies[kind] = copies.get(kind, 0) + 1
    api: dict[str, int] = {}
    for e in events:
        if e.device_type == DeviceType.CPU and (e.name in _SYNCS or e.name in ("cudaGraphLaunch", "cuGraphLaunch")):
            api[e.name] = api.get(e.name, 0) + 1
    top: dict[str, list[float]] = {}
    for e in kernels:
        t = top.setdefault(e.name[:90], [0, 0.0])
        t[0] += 1
        t[1] += e.time_range.elapsed_us()
    per = 1 / steps
    return {
        "wall_ms": wall * 1e3 * per, "kernels": len(kernels) * per,
        "kernel_ms": sum(e.time_range.elapsed_us() for e in kernels) / 1e3 * per, "busy_ms": busy / 1e3 * per,
        "copies": {k: v * per for k, v in sorted(copies.items())},
        "waits": sum(v for k, v in api.items() if k in _SYNCS) * per,
        "graph_launches": sum(v for k, v in api.items() if "GraphLaunch" in k) * per,
        "api": {k: v * per for k, v in sorted(api.items())},
        "top_kernels": [{"name": n, "calls": c * per, "ms": t / 1e3 * per}
                        for n, (c, t) in sorted(top.items(), key=lambda kv: -kv[1][1])[:12]],
    }


def _device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def measure_memory(model_name: str, contender: str, precision: str, steps: int) -> dict[str, float]:
    """In this process (a fresh one): device memory held after ``steps`` steps, less what was held before."""
    torch.cuda.init()
    torch.empty(1, device="cuda")
    before = _device_used()
    _set_precision(precision)
    step = _runner(model_name, contender)
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    times = []
    for _ in range(steps - 1):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    result = {"device_gib": (_device_used() - before) / 2**30, "torch_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
              "first_step_s": first, "step_ms": statistics.median(times[-3:]) if times else None}
    if CUDA_CONTENDERS[contender][0] == "aot2onnx":
        from aot2onnx.runtime import compiled_graphs

        # per graph: its CUDA-graph replays, or why it has none
        result["graphs"] = {g.name: g.cuda_graph_replays or g.cuda_graph_refusal for g in compiled_graphs()}
    return result


def _memory_in_fresh_process(model_name: str, contender: str, precision: str, steps: int, timeout: float) -> dict:
    code = ("import json, sys; from aot2onnx.tools.bench.cuda import measure_memory; "
            f"print('RESULT', json.dumps(measure_memory({model_name!r}, {contender!r}, {precision!r}, {steps})))")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": (done.stderr.strip().splitlines() or ["no result"])[-1][:300]}


def _parity(model_name: str, steps: int, cuda_graphs: bool) -> dict[str, Any]:
    """aot2onnx against eager, fp32, through ``aot2onnx.testing.assert_parity``, with the default options, and
    with CUDA graphs (replays from the third step on) where the benchmark times them."""
    from aot2onnx.testing import assert_parity

    _set_precision("fp32")
    torch.manual_seed(0)
    model, x, y, loss_fn, optimizer_name = CUDA_MODELS[model_name].build()
    x, y = x.to(_device), y.to(_device)
    torch.compiler.reset()
    try:
        import aot2onnx

        backend = aot2onnx.backend(cache=False, cuda_graphs=cuda_graphs)
        assert_parity(lambda: model.to(_device), (x,), loss_fn=loss_fn, targets=[y] * steps, steps=steps, backend=backend,
                      optimizer=lambda p: _optimizer(optimizer_name, p), rtol=1e-4, atol=1e-5, check_torch_ops=False)
        return {"ok": True}
    except AssertionError as e:
        return {"ok": False, "message": str(e)[:2000]}
    except Exception as e:  # a failure to run is reported beside the figures, not instead of them
        return {"ok": False, "message": f"failed to run: {type(e).__name__}: {str(e)[:1500]}"}


def _save(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Writes the figures so far to ``--json`` (after every model: a run stopped at its time limit keeps them)."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    deadline = time.monotonic() + args.budget
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if _device.type == "cuda" else "CPU", "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "models": {},
    }
    import onnxruntime

    results["onnxruntime"] = onnxruntime.__version__
    for model_name in args.models:
        entry: dict[str, Any] = {"title": CUDA_MODELS[model_name].title, "ms": {}, "memory": {}}
        results["models"][model_name] = entry
        if time.monotonic() > deadline:
            entry["skipped"] = "over the time budget"
            continue
        if args.parity:
            graphs = any(CUDA_CONTENDERS[c][1].get("cuda_graphs") for c in args.contenders)
            entry["parity"] = _parity(model_name, args.parity_steps, cuda_graphs=graphs)
            log(f"{model_name}: parity {entry['parity']}")
        for precision in args.precisions:
            if time.monotonic() > deadline:
                break
            _set_precision(precision)
            runners = {}
            for contender in args.contenders:
                torch.compiler.reset()
                try:
                    start = time.perf_counter()
                    step = _runner(model_name, contender)
                    step()
                    _sync()
                    entry.setdefault("first_step_s", {})[f"{contender}/{precision}"] = time.perf_counter() - start
                    for _ in range(args.warmup - 1):
                        step()
                    _sync()
                    runners[contender] = step
                except Exception as e:  # one contender failing leaves the others' figures
                    entry["ms"][f"{contender}/{precision}"] = None
                    entry.setdefault("errors", {})[f"{contender}/{precision}"] = f"{type(e).__name__}: {str(e)[:300]}"
            for contender, ms in _time(runners, args.rounds, args.steps, log).items():
                entry["ms"][f"{contender}/{precision}"] = ms
            if model_name in args.profile_models and precision == args.precisions[0]:
                for contender, step in runners.items():
                    try:
                        profiled = profile_steps(step, args.profile_steps)
                    except Exception as e:  # the profiler failing leaves the timings
                        profiled = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    entry.setdefault("profile", {})[f"{contender}/{precision}"] = profiled
                    log(f"{model_name} {contender}/{precision} profile: "
                        + json.dumps({k: v for k, v in profiled.items() if k != "top_kernels"}, default=str))
            first = entry.get("first_step_s", {})
            log(f"{model_name} {precision}: " + ", ".join(
                f"{c} {entry['ms'].get(f'{c}/{precision}') or float('nan'):.2f} ms"
                f" (first step {first.get(f'{c}/{precision}', float('nan')):.1f} s)" for c in args.contenders))
            for key, error in entry.get("errors", {}).items():
                if key.endswith(f"/{precision}"):
                    log(f"{model_name} {key} failed: {error}")
            del runners
            if _device.type == "cuda":
                torch.cuda.empty_cache()
            _save(args, results)
        for contender in args.memory_contenders if model_name in args.memory_models and _device.type == "cuda" else ():
            if time.monotonic() > deadline:
                break
            entry["memory"][contender] = _memory_in_fresh_process(model_name, contender, "fp32", args.memory_steps,
                                                                  args.timeout)
            log(f"{model_name} memory {contender}: {entry['memory'][contender]}")
            _save(args, results)
    return results


def render_section(results: dict[str, Any]) -> str:
    contenders = sorted({k.split("/")[0] for m in results["models"].values() for k in m["ms"]},
                        key=list(CUDA_CONTENDERS).index)
    lines = [
        SECTION_START,
        "## CUDA",
        "",
        f"Generated by `python -m aot2onnx bench --device cuda` on {results['date']}: {results['device']}, torch "
        f"{results['torch']}, onnxruntime {results['onnxruntime']}. Training step in ms (median of alternating "
        "blocks, one process), ratio to eager in brackets. fp32: TF32 off in torch and so in ONNX Runtime; tf32: on "
        "in both. inductor-ro: `mode=\"reduce-overhead\"` (CUDA graphs). aot2onnx: the default options; the other "
        "aot2onnx columns are its levers (`cuda_graphs=True`, `cuda_memory=\"shared\"` or `\"session\"`).",
        "",
        "| model | precision | " + " | ".join(contenders) + " | parity |",
        "|---|---|" + "---:|" * len(contenders) + "---|",
    ]
    for name, m in results["models"].items():
        for precision in PRECISIONS:
            eager = m["ms"].get(f"eager/{precision}")
            cells = []
            for c in contenders:
                ms = m["ms"].get(f"{c}/{precision}", "absent")
                if ms == "absent":
                    cells.append("")
                elif ms is None:
                    cells.append("failed")
                else:
                    cells.append(f"{ms:.2f}" + (f" ({ms / eager:.2f})" if eager and c != "eager" else ""))
            if not any(cells):
                continue
            parity = m.get("parity", {})
            verdict = "" if precision != "fp32" or not parity else ("ok" if parity.get("ok") else "**differs**")
            lines.append(f"| {name} | {precision} | " + " | ".join(cells) + f" | {verdict} |")
    memory_rows = [(n, c, v) for n, m in results["models"].items() for c, v in m.get("memory", {}).items()]
    if memory_rows:
        lines += ["", "Device memory held after the fp32 steps, fresh process per contender (GiB; torch's own peak "
                  "allocation beside it), the first step's seconds, and a step's ms there (median of the last three, each "
                  "step synchronized; a process per contender, so not side by side):", "",
                  "| model | contender | device GiB | torch peak GiB | first step s | step ms |",
                  "|---|---|---:|---:|---:|---:|"]
        for name, contender, v in memory_rows:
            if "error" in v:
                lines.append(f"| {name} | {contender} | failed: {v['error']} | | |")
            else:
                step_ms = f"{v['step_ms']:.1f}" if v.get("step_ms") else ""
                lines.append(f"| {name} | {contender} | {v['device_gib']:.2f} | {v['torch_peak_gib']:.2f} | "
                             f"{v['first_step_s']:.1f} | {step_ms} |")
    profile_rows = [(n, k, v) for n, m in results["models"].items() for k, v in m.get("profile", {}).items()]
    if profile_rows:
        lines += ["", "Where a step's time goes (`torch.profiler` over warm steps, per step; busy: the kernels' "
                  "overlapped device time; waits: host waits for the device, synchronize calls and synchronous "
                  "copies):", "",
                  "| model | contender | wall ms | kernels | kernel ms | busy ms | DtoH | HtoD | DtoD | waits | graph launches |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, key, v in profile_rows:
            if "error" in v:
                lines.append(f"| {name} | {key} | failed: {v['error']} | | | | | | | | |")
                continue
            c = v["copies"]
            lines.append(f"| {name} | {key} | {v['wall_ms']:.2f} | {v['kernels']:.0f} | {v['kernel_ms']:.2f} | "
                         f"{v['busy_ms']:.2f} | {c.get('DtoH', 0):.0f} | {c.get('HtoD', 0):.0f} | {c.get('DtoD', 0):.0f} | "
                         f"{v['waits']:.0f} | {v['graph_launches']:.0f} |")
    errors = [(n, k, e) for n, m in results["models"].items() for k, e in m.get("errors", {}).items()]
    errors += [(n, "parity", m["parity"]["message"].splitlines()[0]) for n, m in results["models"].items()
               if m.get("parity") and not m["parity"].get("ok")]
    if errors:
        lines += ["", "Failures:", ""] + [f"- {n} {k}: {e}" for n, k, e in errors]
    lines.append(SECTION_END)
    return "\n".join(lines) + "\n"


def write_section(path: str, section: str) -> None:
    """Puts ``section`` into the report at ``path`` in place of an earlier one (or at its end)."""
    text = open(path).read() if os.path.exists(path) else ""
    if SECTION_START in text and SECTION_END in text:
        before, rest = text.split(SECTION_START, 1)
        text = before + section.rstrip("\n") + rest.split(SECTION_END, 1)[1]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section
    with open(path, "w") as f:
        f.write(text)


def kept_section(path: str) -> str | None:
    """The CUDA section of the report at ``path``, for the CPU benchmark to keep when it rewrites the file."""
    if not os.path.exists(path):
        return None
    text = open(path).read()
    if SECTION_START not in text or SECTION_END not in text:
        return None
    return SECTION_START + text.split(SECTION_START, 1)[1].split(SECTION_END, 1)[0] + SECTION_END + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m aot2onnx bench --device cuda", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda; cpu runs the same harness on the CPU (a dry run)")
    p.add_argument("--models", default="mlp,cnn,gpt-d256,gpt-d768,gpt2-small,mobilenet,bert")
    p.add_argument("--contenders", default=",".join(CUDA_CONTENDERS))
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=4, help="untimed steps (CUDA graphs are captured in these)")
    p.add_argument("--parity", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--parity-steps", type=int, default=5)
    p.add_argument("--profile-models", default="", help="comma-separated models whose contenders are also profiled "
                   "(torch.profiler, first precision): kernels, copies and host waits per step")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--memory-models", default="gpt2-small")
    p.add_argument("--memory-contenders", default="eager,aot2onnx,aot2onnx-shared-arena,aot2onnx-session-arenas")
    p.add_argument("--memory-steps", type=int, default=8)
    p.add_argument("--budget", type=float, default=540, help="seconds, after which no new measurement starts")
    p.add_argument("--timeout", type=float, default=300, help="seconds allowed to each fresh process")
    p.add_argument("--out", default="BENCHMARKS.md", help="the report whose CUDA section is (re)written")
    p.add_argument("--json", default="", help="also write every figure as JSON here")
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    split = lambda s: [v.strip() for v in s.split(",") if v.strip()]  # noqa: E731
    args.models, args.contenders, args.precisions = split(args.models), split(args.contenders), split(args.precisions)
    args.memory_models, args.memory_contenders = split(args.memory_models), split(args.memory_contenders)
    args.profile_models = split(args.profile_models)
    unknown = [m for m in args.models if m not in CUDA_MODELS] + [c for c in args.contenders if c not in CUDA_CONTENDERS]
    unknown += [p for p in args.precisions if p not in PRECISIONS]
    if unknown:
        parser().error(f"unknown models, contenders or precisions: {unknown}")
    global _device
    _device = torch.device(args.device)
    if _device.type == "cuda" and not torch.cuda.is_available():
        print("python -m aot2onnx bench --device cuda needs a CUDA device; torch sees none", file=sys.stderr)
        return 2
    if _device.type not in ("cuda", "cpu"):
        parser().error(f"--device takes cuda (or cpu, to try the harness), not {args.device}")
    results = run(args, log=lambda line: print(line, flush=True))
    _save(args, results)
    section = render_section(results)
    print(section)
    write_section(args.out, section)
    print(f"wrote the CUDA section of {args.out}")
    return 0
