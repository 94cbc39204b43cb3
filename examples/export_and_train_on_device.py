"""Export a language model's training step, then train it with ONNX Runtime alone, as a device would.

1. `aot2onnx.export_training` writes forward.onnx, backward.onnx, optimizer.onnx (AdamW with a warm-up and
   cosine learning-rate schedule and gradient clipping), state.safetensors and signature.json (the format:
   docs/artifact-format.md).
2. The artifact is fine-tuned by `aot2onnx/artifact/edge.py` on the text this example ships, run as a plain
   file in a separate process: it imports numpy, onnxruntime and safetensors, not torch and not aot2onnx.
   Copy that file and the artifact directory to a device and run the same command there.
3. `aot2onnx.load` reads the artifact back with the trained state, and its ONNX Runtime forward writes a few
   characters.

    python examples/export_and_train_on_device.py [--steps 200] [--out /tmp/tiny_gpt_artifact]
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile

import numpy as np
import safetensors.torch
import torch
import torch.nn as nn

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from tiny_gpt import TinyGPT, lm_loss  # noqa: E402

import aot2onnx  # noqa: E402
from aot2onnx.artifact import edge  # noqa: E402


class LanguageModelLoss(nn.Module):
    """What export_training takes: a module whose forward returns the loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(tokens)
        return lm_loss(logits, targets), logits  # the loss first; the logits are an output a device can read


def windows(ids: np.ndarray, count: int, batch: int, context: int, rng: np.random.Generator) -> np.ndarray:
    starts = rng.integers(0, len(ids) - context - 1, size=(count, batch))
    return np.stack([[ids[s : s + context + 1] for s in row] for row in starts])  # [count, batch, context + 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--out", type=pathlib.Path, help="artifact directory (default: a temporary one)")
    args = parser.parse_args()
    out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="tiny_gpt_artifact_"))

    text = (pathlib.Path(__file__).parent / "data" / "alice.txt").read_text()
    vocab = sorted(set(text))
    ids = np.array([vocab.index(c) for c in text], dtype=np.int64)
    torch.manual_seed(0)
    module = LanguageModelLoss(TinyGPT(len(vocab), context=args.context))

    # 1. Export, with an example batch smaller than the training batch: the batch is a symbolic dim.
    example = torch.from_numpy(windows(ids, 1, 4, args.context, np.random.default_rng(1))[0])
    optimizer = aot2onnx.optim.AdamW(3e-3, schedule=aot2onnx.optim.WarmupCosine(args.steps // 10, args.steps),
                                     max_grad_norm=1.0)
    artifact = aot2onnx.export_training(module, (example[:, :-1], example[:, 1:]), out, optimizer=optimizer,
                                        progress=sys.stderr.write)
    print(artifact.summary())

    # 2. Train without torch: the edge trainer's command line, in its own process.
    data = windows(ids, args.steps, args.batch, args.context, np.random.default_rng(2))
    np.savez(out / "batches.npz", tokens=data[:, :, :-1], targets=data[:, :, 1:])
    final = out / "trained.safetensors"
    print(f"\ntraining {args.steps} steps of batch {args.batch} with {edge.__file__} (no torch):", flush=True)
    run = subprocess.run([sys.executable, edge.__file__, str(out), "--data", str(out / "batches.npz"),
                          "--steps", str(args.steps), "--out", str(final)], capture_output=True, text=True, check=True)
    lines = run.stdout.splitlines()
    for line in lines[:: max(1, len(lines) // 10)] + lines[-1:]:
        print(" ", line)

    # 3. Back through aot2onnx.load: the artifact as a module, its forward on ONNX Runtime, with the trained
    # state. The sequence length is the export's; attention is causal, so the logits at a position see
    # nothing after it, and a prompt shorter than the context is padded at the end.
    loaded = aot2onnx.load(out)
    state = safetensors.torch.load_file(str(final))
    loaded.load_state_dict({name: state[name] for name in loaded.state_dict()})
    prompt = "Alice "
    tokens = [vocab.index(c) for c in prompt]
    with torch.no_grad():
        for _ in range(60):
            window = tokens[-args.context:]
            padded = torch.tensor([window + [0] * (args.context - len(window))])
            _, logits = loaded(padded, padded)
            tokens.append(int(logits[0, len(window) - 1].argmax()))
    print(f"\ngreedy sample after training: {''.join(vocab[i] for i in tokens)!r}")
    print(f"artifact: {out}")


if __name__ == "__main__":
    main()
