"""Train a small transformer language model on ONNX Runtime with torch.compile(backend="aot2onnx").

Character-level, on a text shipped in examples/data. Prints the loss as it goes down, the training speed
of aot2onnx and of eager PyTorch side by side (same model, same data, same process), and the parity of
the two over ten strict steps. Run with `make demo`.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from tiny_gpt import TinyGPT, lm_loss  # noqa: E402

from aot2onnx.testing import assert_parity  # noqa: E402


def batches(text: str, steps: int, batch: int, context: int, seed: int = 0):
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text])
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, len(ids) - context - 1, (batch,), generator=g)
        window = torch.stack([ids[s : s + context + 1] for s in start])
        yield window[:, :-1], window[:, 1:]


def train(model, data, lr: float, log_every: int = 0, label: str = ""):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, times = [], []
    for step, (x, y) in enumerate(data, start=1):
        start = time.perf_counter()
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if log_every and (step == 1 or step % log_every == 0):
            print(f"  {label} step {step:4d}  loss {loss.item():.4f}", flush=True)
    return losses, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    args = parser.parse_args()

    text = (pathlib.Path(__file__).parent / "data" / "alice.txt").read_text()
    vocab = len(set(text))
    torch.manual_seed(0)
    eager = TinyGPT(vocab, context=args.context)
    model = copy.deepcopy(eager)
    params = sum(p.numel() for p in model.parameters())
    print(f"TinyGPT: {params / 1e3:.0f}k parameters, vocabulary {vocab}, context {args.context}, "
          f"batch {args.batch}; {args.steps} AdamW steps, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")

    print("Training through ONNX Runtime (torch.compile(backend='aot2onnx')):")
    compiled = torch.compile(model, backend="aot2onnx")
    data = list(batches(text, args.steps, args.batch, args.context))
    losses, ort_times = train(compiled, data, lr=3e-3, log_every=max(1, args.steps // 10), label="aot2onnx")
    print("Training the same model eagerly on the same data:")
    eager_losses, eager_times = train(eager, data, lr=3e-3)

    warm = slice(min(10, len(data) - 1), None)  # the first steps include compilation
    ort_rate = len(ort_times[warm]) / sum(ort_times[warm])
    eager_rate = len(eager_times[warm]) / sum(eager_times[warm])
    print()
    print(f"loss: {losses[0]:.3f} -> {losses[-1]:.3f} (aot2onnx), {eager_losses[0]:.3f} -> "
          f"{eager_losses[-1]:.3f} (eager)")
    print(f"first step (compile + run): {ort_times[0]:.2f} s")
    print(f"steps/s after warm-up: aot2onnx {ort_rate:.1f}, eager {eager_rate:.1f} "
          f"(ratio {ort_rate / eager_rate:.2f}x)")
    drift = max((p - q).abs().max().item() for p, q in zip(model.parameters(), eager.parameters()))
    print(f"after {args.steps} steps, largest parameter difference from eager: {drift:.2e}")

    # SGD here: Adam divides each gradient by its running RMS, so a parameter whose gradient is pure
    # rounding noise (the attention key bias: softmax ignores it) takes full-size steps in a random
    # direction in both runs, and no tolerance on the parameters is meaningful.
    print("Parity over 10 SGD steps from one initial state (rtol=1e-4, atol=1e-5):", end=" ", flush=True)
    report = assert_parity(
        lambda: TinyGPT(vocab, context=args.context),
        [x for x, _ in data[:10]],
        targets=[y for _, y in data[:10]],
        loss_fn=lm_loss,
        steps=10,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        rtol=1e-4,
        atol=1e-5,
    )
    print(f"PASS ({report.compared} tensors compared, {report.ort_runs} ONNX Runtime runs, "
          f"largest loss difference {max(abs(a - b) for a, b in zip(report.eager_losses, report.compiled_losses)):.1e})")
    if losses[-1] >= losses[0]:
        sys.exit("the loss did not go down")


if __name__ == "__main__":
    main()
