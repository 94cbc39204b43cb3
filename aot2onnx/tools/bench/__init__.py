"""``python -m aot2onnx bench``: training steps timed side by side, eager vs inductor vs aot2onnx.

The package, by concern: ``models.py`` (the models and their batches), ``worker.py`` (one contender's
training step, and the fresh-process worker: it imports nothing of aot2onnx), ``timing.py`` (the fresh
processes, the alternating rounds, the breakdown of aot2onnx's step), ``report.py`` (``BENCHMARKS.md`` and
the chart). What the timings mean is written in the report's Method section (``report._method``).

Run ``python -m aot2onnx bench --help`` for the options; ``make bench`` runs the full suite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from aot2onnx.tools.bench.models import MODELS
from aot2onnx.tools.bench.report import findings_link, render_markdown, write_chart
from aot2onnx.tools.bench.timing import run_suite
from aot2onnx.tools.bench.worker import CONTENDERS

__all__ = ["CONTENDERS", "MODELS", "main", "render_markdown", "run_suite"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m aot2onnx bench", description=__doc__.split("\n\n")[0])
    suite = [n for n, s in MODELS.items() if s.suite == "main"]
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
        f.write(render_markdown(results, chart, findings_link(args.out)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    print(f"wrote {args.out}" + (f" and {args.chart}" if chart else ""))
    return 0
