"""Export the browser demo's model (js/demo/): a small classifier of two interleaved half-moons, trained in the
page by the JavaScript trainer with onnxruntime-web on data the page makes itself.

    python examples/export_for_web.py --out js/demo/artifact     (what `make demo-web` runs, before serving js/)
"""

from __future__ import annotations

import argparse
import pathlib

import torch
import torch.nn as nn
import torch.nn.functional as F

import aot2onnx

STEPS = 300  # the page's default number of steps: the warm-up and cosine schedule span them


class MoonsClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2))

    def forward(self, points: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(points), labels)


def export(out: pathlib.Path, steps: int = STEPS) -> None:
    torch.manual_seed(0)
    example = (torch.randn(4, 2), torch.tensor([0, 1, 0, 1]))
    optimizer = aot2onnx.optim.AdamW(2e-2, schedule=aot2onnx.optim.WarmupCosine(steps // 15, steps))
    aot2onnx.export_training(MoonsClassifier(), example, out, optimizer=optimizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("js/demo/artifact"))
    parser.add_argument("--steps", type=int, default=STEPS, help="the schedule's length (the page trains this many)")
    args = parser.parse_args()
    export(args.out, args.steps)
    print(f"exported the demo model to {args.out}")


if __name__ == "__main__":
    main()
