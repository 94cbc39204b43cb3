"""``python -m aot2onnx export``: export_training from the command line.

Also the reading of a model factory (``MODULE:FACTORY``) and an example batch (``.npz``) that
``python -m aot2onnx parity`` shares.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import pathlib
import sys
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn as nn

from aot2onnx.artifact.export import export_training, forward_input_names
from aot2onnx.artifact.optim import SGD, AdamW, Optimizer
from aot2onnx.options import DEFAULT_OPSET
from aot2onnx.runtime.kernels import check_target_opset

__all__ = ["example_inputs", "load_factory", "main"]


def load_factory(spec: str) -> Callable[[], nn.Module]:
    """The callable ``MODULE:FACTORY`` names: MODULE a dotted module name or a .py file, FACTORY an attribute
    path in it."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected MODULE:FACTORY (e.g. mypkg.models:make_model or path/to/file.py:make_model), got {spec!r}")
    if module_name.endswith(".py") or os.sep in module_name:
        path = pathlib.Path(module_name)
        if not path.is_file():
            raise ValueError(f"no such file: {path}")
        loaded_spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(loaded_spec)
        sys.modules.setdefault(path.stem, mod)
        loaded_spec.loader.exec_module(mod)
    else:
        try:
            mod = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"cannot import {module_name}: {e}") from e
    factory = mod
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise ValueError(f"{module_name} has no attribute {attr!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ValueError(f"{spec} is not callable")
    return factory


def example_inputs(path: str, module: nn.Module) -> list[torch.Tensor]:
    """The example batch in the .npz file ``path``: arrays named after ``module.forward``'s parameters, or
    ``arr_0``, ``arr_1``, ... in order."""
    with np.load(path, allow_pickle=False) as data:
        arrays = dict(data.items())
    positional = [f"arr_{i}" for i in range(len(arrays))]
    if sorted(arrays) == sorted(positional):
        ordered = [arrays[k] for k in positional]
    else:
        names = forward_input_names(module, len(arrays), set())
        missing = [n for n in names if n not in arrays]
        if missing:
            raise ValueError(
                f"{path} holds {sorted(arrays)}; name the arrays after {type(module).__name__}.forward's parameters "
                f"({names}) or save them positionally (np.savez(path, x, y) gives arr_0, arr_1)"
            )
        ordered = [arrays[n] for n in names]
    return [torch.from_numpy(np.asarray(a, order="C")) for a in ordered]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m aot2onnx export",
        description="Export forward.onnx, backward.onnx, optimizer.onnx, state.safetensors and signature.json "
        "for training on a device (see docs/artifact-format.md).",
    )
    parser.add_argument("factory", metavar="MODULE:FACTORY",
                        help="a callable returning the nn.Module whose forward returns the loss (MODULE is a dotted "
                        "module name or a .py file)")
    parser.add_argument("--example-inputs", required=True, metavar="FILE.npz",
                        help="one example batch: arrays named after forward's parameters, or arr_0, arr_1, ...")
    parser.add_argument("--out", required=True, metavar="DIR", help="the artifact directory")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), help="write optimizer.onnx for this optimizer")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    parser.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default 0)")
    parser.add_argument("--weight-decay", type=float, help="default 0 for SGD, 0.01 for AdamW")
    parser.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999), metavar=("BETA1", "BETA2"))
    parser.add_argument("--eps", type=float, default=1e-8, help="AdamW epsilon (default 1e-8)")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (default {DEFAULT_OPSET})")
    parser.add_argument("--static-batch", action="store_true", help="keep the example's batch size fixed")
    parser.add_argument("--seed", type=int, help="torch.manual_seed before calling the factory")
    parser.add_argument("--quiet", action="store_true", help="no progress display")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from aot2onnx.errors import Aot2OnnxError

    args = _parser().parse_args(argv)
    optimizer: Optimizer | None = None
    try:
        # Bad arguments are refused before any work: the factory may build a large model.
        check_target_opset(args.opset)
        if args.optimizer == "sgd":
            optimizer = SGD(args.lr, momentum=args.momentum, weight_decay=args.weight_decay or 0.0)
        elif args.optimizer == "adamw":
            optimizer = AdamW(args.lr, betas=tuple(args.betas), eps=args.eps,
                              weight_decay=0.01 if args.weight_decay is None else args.weight_decay)
        if args.seed is not None:
            torch.manual_seed(args.seed)
        module = load_factory(args.factory)()
        if not isinstance(module, nn.Module):
            raise ValueError(f"{args.factory} returned {type(module).__name__}, not an nn.Module")
        inputs = example_inputs(args.example_inputs, module)
        artifact = export_training(module, inputs, args.out, optimizer=optimizer, dynamic_batch=not args.static_batch,
                                   opset=args.opset, progress=None if args.quiet else sys.stderr.write)
    except (Aot2OnnxError, ValueError, OSError) as e:
        print(f"aot2onnx export: error: {e}", file=sys.stderr)
        return 1
    print(artifact.summary())
    return 0
