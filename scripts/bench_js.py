"""Steps per second of the three artifact readers on the same artifacts and data: the Python reader
(aot2onnx/artifact/edge.py, onnxruntime), the JavaScript one in Node (onnxruntime-node) and in headless
Chromium (onnxruntime-web, WebAssembly, one thread).

    python scripts/bench_js.py [--steps 50] [--rounds 15] [--threads 1] [--append BENCHMARKS.md]

The artifacts are tests/test_js_trainer.py's parity cases, exported here. Each reader is opened once and kept
(the JavaScript ones as js/test/bench.mjs workers); they take turns in short blocks of steps, so that a shared
machine's drifting load falls on all of them alike. A figure is the median block's steps per second: the
training loop alone, no process start, no session creation. Needs node, js/node_modules and (for the browser column) Chromium.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnxruntime
import torch

import aot2onnx
from aot2onnx.artifact import edge

ROOT = pathlib.Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_js_trainer import CASES, CHROMIUM, EXPORT_BATCH, NODE, TRAIN_BATCH  # noqa: E402

WARMUP = 10


class _PythonWorker:
    def __init__(self, artifact: pathlib.Path, data: pathlib.Path, threads: int) -> None:
        self.trainer = edge.Trainer(artifact, intra_op_num_threads=threads)
        self.batches = edge.read_batches(data, self.trainer.artifact.signature["user_inputs"])
        self.step = 0

    def run(self, steps: int) -> float:
        count = self.batches[0].shape[0]
        started = time.perf_counter()
        for _ in range(steps):
            self.trainer.step(*(b[self.step % count] for b in self.batches))
            self.step += 1
        return time.perf_counter() - started

    def close(self) -> None:
        pass


class _JsWorker:
    """js/test/bench.mjs, kept running: one line in ("N"), the seconds of N steps out."""

    def __init__(self, artifact: pathlib.Path, data: pathlib.Path, threads: int, browser: bool) -> None:
        args = [NODE, "js/test/bench.mjs", str(artifact), "--data", str(data), "--threads", str(threads),
                *(["--browser"] if browser else [])]
        self.process = subprocess.Popen(args, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env={**os.environ, "CHROMIUM": CHROMIUM or ""})
        assert json.loads(self.process.stdout.readline()) == {"ready": True}

    def run(self, steps: int) -> float:
        self.process.stdin.write(f"{steps}\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())["seconds"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50, help="steps per block")
    parser.add_argument("--rounds", type=int, default=15, help="blocks per reader, taking turns")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of the Python and Node readers")
    parser.add_argument("--append", type=pathlib.Path, help="append the table as a section of this file")
    args = parser.parse_args()
    browser = CHROMIUM is not None
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in CASES.items():
            torch.manual_seed(0)
            g = torch.Generator().manual_seed(1)
            root = pathlib.Path(tmp) / name
            aot2onnx.export_training(copy.deepcopy(case.make()), case.data(g, EXPORT_BATCH), root / "artifact",
                                     optimizer=case.optimizer())
            batches = [case.data(g, TRAIN_BATCH) for _ in range(20)]
            names = [u["name"] for u in json.loads((root / "artifact" / "signature.json").read_text())["user_inputs"]]
            np.savez(root / "batches.npz", **{n: np.stack([b[i].numpy() for b in batches]) for i, n in enumerate(names)})
            art, data = root / "artifact", root / "batches.npz"
            workers = {"python": _PythonWorker(art, data, args.threads),
                       "node": _JsWorker(art, data, args.threads, browser=False)}
            if browser:
                workers["chromium"] = _JsWorker(art, data, 1, browser=True)
            for worker in workers.values():
                worker.run(WARMUP)
            # Short blocks taking turns: on a shared machine the load drifts; each reader sees the same drift.
            rates: dict[str, list[float]] = {k: [] for k in workers}
            for _ in range(args.rounds):
                for key, worker in workers.items():
                    rates[key].append(args.steps / worker.run(args.steps))
            for worker in workers.values():
                worker.close()
            row = {k: statistics.median(v) for k, v in rates.items() if v}
            rows.append((name, row))
            print(name, {k: round(v, 1) for k, v in row.items()}, flush=True)

    node_version = subprocess.run([NODE, "--version"], capture_output=True, text=True).stdout.strip()
    lines = [
        "## The artifact readers: Python, Node, browser",
        "",
        f"Training steps per second on `tests/test_js_trainer.py`'s artifacts (batch {TRAIN_BATCH}), measured by "
        f"`scripts/bench_js.py`: each reader opened once, {WARMUP} untimed steps, then {args.rounds} blocks of "
        f"{args.steps} steps, the readers taking turns block by block; the median block. The loop alone: no process "
        "start, no session creation. Python: `edge.Trainer` on onnxruntime "
        f"{onnxruntime.__version__}; Node: js/ on onnxruntime-node 1.30.0 ({node_version}); Chromium: js/ on "
        "onnxruntime-web 1.30.0, WebAssembly, one thread. Python and Node with "
        f"{args.threads} intra-op thread(s). {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"1-minute load average {load_before:.1f} at the start and {os.getloadavg()[0]:.1f} at the end. "
        "`make bench` rewrites this file without this section: run `scripts/bench_js.py --append BENCHMARKS.md` "
        "again after it.",
        "",
        "| artifact | Python | Node | Node / Python | Chromium | Chromium / Python |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows:
        chromium = row.get("chromium")
        lines.append(f"| {name} | {row['python']:.0f} | {row['node']:.0f} | {row['node'] / row['python']:.2f} | "
                     + (f"{chromium:.0f} | {chromium / row['python']:.2f} |" if chromium else "n/a | n/a |"))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
