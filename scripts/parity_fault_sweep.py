"""Measures the parity report on planted faults: the figures of issue 38.

    python scripts/parity_fault_sweep.py [--faults 24] [--ulp-faults 6] [--seed 0] [--mode rerun|compiled]
                                         [--clean-only] [model ...]

For each model (default: tests/parity_faults.py's DEFAULT_SWEEP; ``all`` for every zoo model that trains),
compares it clean (no node may be blamed), then plants ``--faults`` faults of a relative 1e-3 and
``--ulp-faults`` of four float32 ulps in nodes drawn at random (seeded), half in the forward graphs and half in
the backward ones, and scores the report: the planted node named first in its graph, or, for an ulp, nothing
blamed. ``--mode compiled`` plants each fault in the lowering and trains a step with it (a compile per pair of
faults); ``rerun`` (the default) plants it in the models the clean report compared and compares those graphs
again, on the same inputs, many times faster. Prints a line per fault as it goes, then a Markdown table, the totals, the share named first per kind of
graph, rule and node, every miss with why, and every node blamed in a clean model. Exits 1 if fewer than 97% are
named first, an ulp fault or a clean model is blamed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import parity_faults  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", help="model names, or 'all' (default: the sweep's 14)")
    parser.add_argument("--faults", type=int, default=24, help="relative 1e-3 faults per model")
    parser.add_argument("--ulp-faults", type=int, default=6, help="ulp-scale faults per model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=parity_faults.MODES, default="rerun",
                        help="where faults go: the lowering (compiled) or the clean report's models (rerun)")
    parser.add_argument("--clean-only", action="store_true", help="only the clean reports (no faults)")
    args = parser.parse_args(argv)
    names = args.models or parity_faults.DEFAULT_SWEEP
    if names == ["all"]:
        names = list(parity_faults.CASES)
    results = []
    for name in names:
        result = parity_faults.run_case(parity_faults.case(name), faults_count=0 if args.clean_only else args.faults,
                                        ulp_count=0 if args.clean_only else args.ulp_faults, seed=args.seed,
                                        mode=args.mode, progress=lambda text: print(text, flush=True))
        results.append(result)
    print()
    print(parity_faults.format_results(results))
    counted = [o for r in results for o in r.outcomes if not o.no_effect]
    hits = sum(o.named_first for o in counted)
    bad = (hits < 0.97 * len(counted) or any(o.blamed for r in results for o in r.ulp_outcomes)
           or any(r.clean_blamed for r in results))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
