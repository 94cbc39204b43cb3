"""``python -m aot2onnx bench``: training steps timed side by side, eager vs inductor vs aot2onnx.

The package, by concern: ``models.py`` (the models and their batches), ``worker.py`` (one contender's
training step, and the fresh-process worker: it imports nothing of aot2onnx), ``timing.py`` (the fresh
processes, the alternating rounds, the breakdown of aot2onnx's step), ``report.py`` (``BENCHMARKS.md`` and
the chart). What the timings mean is written in the report's Method section (``report._method``).

``python -m aot2onnx bench --device cuda`` runs the GPU benchmark instead (``cuda.py``), which writes its own
section of the report.

Two suites: "main" (the models the issue's first targets were set on) and "device" (smaller models at the batches
a device trains with), where each of ``timing.LEVERS`` is also timed against aot2onnx's default. Run
``python -m aot2onnx bench --help`` for the options; ``make bench`` runs both suites in full.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from aot2onnx.tools.bench.models import MODELS, SUITES
from aot2onnx.tools.bench.report import findings_link, render_markdown, write_chart
from aot2onnx.tools.bench.timing import run_suite
from aot2onnx.tools.bench.worker import CONTENDERS

__all__ = ["CONTENDERS", "MODELS", "main", "render_markdown", "run_suite"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m aot2onnx bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--suites", default=",".join(SUITES),
                   help=f"comma-separated suites to run, from {', '.join(SUITES)} (default: all): "
                   + "; ".join(f"{suite}: {', '.join(n for n, s in MODELS.items() if s.suite == suite)}"
                               for suite in SUITES))
    p.add_argument("--models", default="",
                   help=f"comma-separated, from {', '.join(MODELS)}; overrides --suites")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated (default: all)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of alternating contenders, at least (default 5)")
    p.add_argument("--min-timed-s", type=float, default=4.0,
                   help="more rounds, up to --max-rounds, until every contender's timed steps add up to this many "
                   "seconds: a model of a few milliseconds a step gets the rounds its noise needs (default 4)")
    p.add_argument("--max-rounds", type=int, default=25, help="rounds at most (default 25)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per contender per round (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before each timed block (default 3)")
    p.add_argument("--trial-steps", type=int, default=400,
                   help="untimed steps at most after aot2onnx's first step, until each graph's thread trial has "
                   "settled (default 400)")
    p.add_argument("--breakdown-steps", type=int, default=20, help="steps of the aot2onnx breakdown (default 20)")
    p.add_argument("--process-steps", type=int, default=10,
                   help="steps after the first in each fresh process, for peak RSS (default 10)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads, and so ONNX Runtime's (default 2)")
    p.add_argument("--quick", action="store_true", help="a few steps of everything, for tests")
    p.add_argument("--levers", action=argparse.BooleanOptionalAction, default=None,
                   help="on the device suite's models, time each lever (timing.LEVERS) against aot2onnx's default "
                   "(default: on, off under --quick)")
    p.add_argument("--no-warm-cache", dest="warm_cache", action="store_false",
                   help="skip the second fresh process that measures the first step on warm compile caches")
    p.add_argument("--timeout", type=float, default=1200, help="seconds allowed to each fresh process")
    p.add_argument("--out", default="BENCHMARKS.md", help="the report (default BENCHMARKS.md)")
    p.add_argument("--chart", default="docs/benchmarks.png", help="the bar chart PNG ('' for none)")
    p.add_argument("--json", default="", help="also write every figure as JSON here")
    return p


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    """The options, with ``--suites`` resolved into models and ``--quick``'s limits applied."""
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = list(argv)
    args.suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    if not args.suites or any(s not in SUITES for s in args.suites):
        parser.error(f"unknown or missing suites: {[s for s in args.suites if s not in SUITES]}; known: {SUITES}")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()] or [
        name for suite in SUITES if suite in args.suites for name, spec in MODELS.items() if spec.suite == suite]
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [m for m in args.models if m not in MODELS] + [c for c in args.contenders if c not in CONTENDERS]
    if unknown or not args.models or not args.contenders:
        parser.error(f"unknown or missing models/contenders: {unknown}")
    args.contenders = [c for c in CONTENDERS if c in args.contenders]
    if args.levers is None:
        args.levers = not args.quick
    if args.quick:
        args.rounds, args.steps, args.warmup = min(args.rounds, 2), min(args.steps, 3), min(args.warmup, 1)
        args.min_timed_s = 0.0
        args.trial_steps = min(args.trial_steps, 3)
        args.breakdown_steps, args.process_steps = min(args.breakdown_steps, 3), min(args.process_steps, 2)
        args.warm_cache = False
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--device" in argv or any(a.startswith("--device=") for a in argv):
        from aot2onnx.tools.bench import cuda  # the GPU benchmark: its own models, contenders and section

        return cuda.main(argv)
    args = _parse(argv)
    results = run_suite(args, log=lambda line: print(line, flush=True))
    chart = None
    if args.chart:
        why_not = write_chart(results, args.chart)
        if why_not:
            print(f"no chart: {why_not}")
        else:
            chart = os.path.relpath(os.path.abspath(args.chart), os.path.dirname(os.path.abspath(args.out)))
    from aot2onnx.tools.bench.cuda import kept_section

    gpu = kept_section(args.out)  # the GPU benchmark's section, measured elsewhere: kept as it is
    with open(args.out, "w") as f:
        f.write(render_markdown(results, chart, findings_link(args.out)) + (f"\n{gpu}" if gpu else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    print(f"wrote {args.out}" + (f" and {args.chart}" if chart else ""))
    return 0
