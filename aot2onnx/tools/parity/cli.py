"""``python -m aot2onnx parity MODULE:FACTORY --example-inputs FILE.npz --out DIR [--steps N]``: the parity
report of one training step (or N, the optimizer's included), eager PyTorch against aot2onnx, written to DIR.
Exit status 0: parity; 1: the runtimes part; 2: the command could not run."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["main"]

_LOSSES: dict[str, Callable[..., torch.Tensor] | None] = {
    "cotangents": None,  # every differentiable output, with fixed random cotangents
    "output": lambda out: out,
    "sum": lambda out: out.sum(),
    "mean": lambda out: out.mean(),
    "mse": lambda out, target: F.mse_loss(out, target),
    "cross_entropy": lambda out, target: F.cross_entropy(out, target),
}
_NEEDS_TARGETS = ("mse", "cross_entropy")
_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr),
    "sgd-momentum": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m aot2onnx parity",
        description="One training step of a model in eager PyTorch and through aot2onnx (ONNX Runtime), compared "
        "output by output, gradient by gradient and node by node; writes report.md, report.html, report.json and a "
        "reproducer of the first divergent node to --out.",
    )
    parser.add_argument("factory", metavar="MODULE:FACTORY",
                        help="a callable returning the nn.Module (MODULE is a dotted module name or a .py file)")
    parser.add_argument("--example-inputs", required=True, metavar="FILE.npz",
                        help="the model's arguments: arrays named after forward's parameters, or arr_0, arr_1, ...")
    parser.add_argument("--out", required=True, metavar="DIR", help="where the report is written")
    parser.add_argument("--loss", choices=sorted(_LOSSES), default="cotangents",
                        help="what is differentiated: the model's output as the loss ('output'), its sum or mean, "
                        "mse or cross_entropy against --targets, or (default) every output with random cotangents")
    parser.add_argument("--targets", metavar="FILE.npz", help="the target of --loss mse/cross_entropy (its one array)")
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--atol", type=float, default=1e-5)
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="an aot2onnx option, e.g. graph_optimization_level=basic (VALUE is read as JSON, else as a "
                        "string); repeatable")
    parser.add_argument("--eval", action="store_true", help="put the model in eval mode (no dropout)")
    parser.add_argument("--seed", type=int, default=0, help="torch.manual_seed before the factory and each step")
    parser.add_argument("--steps", type=int, default=1, help="training steps to compare, each on the same inputs; "
                        "with more than one, or with --optimizer, the optimizer steps too and the report says at "
                        "which step and in which graph the two first part")
    parser.add_argument("--optimizer", choices=sorted(_OPTIMIZERS),
                        help="the optimizer of every step (default with --steps > 1: sgd)")
    parser.add_argument("--lr", type=float, default=0.1, help="the optimizer's learning rate")
    parser.add_argument("--compile-optimizer", action="store_true",
                        help="compile the optimizer's step through aot2onnx too and compare its graphs node by node")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--option expects KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: Sequence[str] | None = None) -> int:
    from aot2onnx.errors import Aot2OnnxError
    from aot2onnx.tools.export import example_inputs, load_factory
    from aot2onnx.tools.parity.compare import compare

    args = _parser().parse_args(argv)
    say = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        if args.loss in _NEEDS_TARGETS and not args.targets:
            raise ValueError(f"--loss {args.loss} needs --targets FILE.npz")
        options = dict(_option(o) for o in args.option)
        torch.manual_seed(args.seed)
        if say:
            say(f"building {args.factory}")
        model = load_factory(args.factory)()
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"{args.factory} returned {type(model).__name__}, not an nn.Module")
        if args.eval:
            model.eval()
        inputs = example_inputs(args.example_inputs, model)
        targets = None
        if args.targets:
            with np.load(args.targets, allow_pickle=False) as data:
                arrays = list(data.values())
            if len(arrays) != 1:
                raise ValueError(f"{args.targets} must hold one array (the target), holds {len(arrays)}")
            targets = torch.from_numpy(np.asarray(arrays[0], order="C"))
        optimizer = None
        if args.optimizer or args.steps > 1 or args.compile_optimizer:
            make = _OPTIMIZERS[args.optimizer or "sgd"]
            optimizer = lambda params: make(params, args.lr)  # noqa: E731
        report = compare(model, tuple(inputs), loss_fn=_LOSSES[args.loss], targets=targets, options=options,
                         rtol=args.rtol, atol=args.atol, seed=args.seed, steps=args.steps, optimizer=optimizer,
                         compile_optimizer=args.compile_optimizer, progress=say)
        page = report.save(args.out)
    except (Aot2OnnxError, ValueError, TypeError, OSError) as e:
        print(f"aot2onnx parity: error: {e}", file=sys.stderr)
        return 2
    print(report.summary())
    print(f"wrote {page} and {page.with_suffix('.html').name}, report.json, the plots"
          + (" and the reproducer(s)" if report.divergences else ""))
    return 0 if report.ok else 1
