"""How far training drifts on CUDA, run to run and against eager: a model trained a few steps twice eagerly, and
twice with aot2onnx (two compilations, so two sets of sessions), each step's largest parameter difference
between the runs. Tells run-to-run nondeterminism (a run against its twin) from a difference in the arithmetic
(aot2onnx against eager). Usage: python scripts/cuda_drift.py [model] [steps]; cuDNN benchmark on with
DRIFT_BENCHMARK=1."""

from __future__ import annotations

import os
import sys

import torch

import aot2onnx
from aot2onnx.tools.bench.cuda import CUDA_MODELS


def train(name: str, steps: int, compiled: bool) -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    model, x, y, loss_fn, _ = CUDA_MODELS[name].build()
    model, x, y = model.cuda(), x.cuda(), y.cuda()
    forward = torch.compile(model, backend=aot2onnx.backend(cache=False)) if compiled else model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    states = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss_fn(forward(x), y).backward()
        optimizer.step()
        states.append([t.detach().clone() for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()])
    torch.compiler.reset()
    return states


def largest(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a, b))


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "cnn"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = os.environ.get("DRIFT_BENCHMARK") == "1"
    eager = [train(name, steps, False) for _ in range(2)]
    ours = [train(name, steps, True) for _ in range(2)]
    print(f"{name}, cuDNN benchmark {torch.backends.cudnn.benchmark}: largest parameter difference per step")
    print("step | eager vs eager | aot2onnx vs aot2onnx | aot2onnx vs eager")
    for k in range(steps):
        print(f"{k + 1} | {largest(eager[0][k], eager[1][k]):.3e} | {largest(ours[0][k], ours[1][k]):.3e} | "
              f"{largest(ours[0][k], eager[0][k]):.3e}")


if __name__ == "__main__":
    main()
