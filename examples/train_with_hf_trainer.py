"""Train a Hugging Face model with `transformers.Trainer` on ONNX Runtime through aot2onnx.

A small GPT-2, randomly initialised from a config (nothing is downloaded), learns the text this example ships
(examples/data/alice.txt), one character per token. The model is compiled in place before it is handed to the
Trainer:

    model.compile(backend="aot2onnx")      # nn.Module.compile: the model keeps its class and forward
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=...)

`TrainingArguments(torch_compile_backend="aot2onnx")` does not work: accelerate checks the name against its
`DynamoBackend` enum, which lists only the backends it knows ("'AOT2ONNX' is not a valid DynamoBackend",
accelerate 1.15). The same model is then trained again eagerly, on the same batches from the same seed, and the
two runs' logged losses are printed side by side.

    python examples/train_with_hf_trainer.py [--steps 40] [--no-eager]
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

TEXT = pathlib.Path(__file__).parent / "data" / "alice.txt"


class CharacterWindows(torch.utils.data.Dataset):
    """Every window of ``context`` characters of a text, as the Trainer's default collator takes them: a causal
    LM's labels are its inputs (GPT2LMHeadModel shifts them)."""

    def __init__(self, text: str, vocabulary: list[str], context: int) -> None:
        self.ids = torch.tensor([vocabulary.index(c) for c in text])
        self.context = context

    def __len__(self) -> int:
        return len(self.ids) - self.context

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.ids[i : i + self.context]
        return {"input_ids": window, "labels": window}


def tiny_gpt2(vocab_size: int, context: int) -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=vocab_size, n_positions=context, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=None, eos_token_id=None,  # GPT-2's are ids of its own 50257-token vocabulary
        # Dropout off, so that the eager run below takes exactly the same steps: ONNX Runtime draws its own
        # random numbers, as another device would.
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def train(model: torch.nn.Module, dataset: CharacterWindows, steps: int, output_dir: str) -> tuple[list[float], float]:
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        warmup_steps=steps // 10,
        logging_steps=max(1, steps // 8),
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    start = time.perf_counter()
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--no-eager", action="store_true", help="skip the eager run that the losses are compared with")
    args = parser.parse_args()

    text = TEXT.read_text()
    vocabulary = sorted(set(text))
    dataset = CharacterWindows(text, vocabulary, args.context)
    torch.manual_seed(0)
    model = tiny_gpt2(len(vocabulary), args.context)
    eager = tiny_gpt2(len(vocabulary), args.context)
    eager.load_state_dict(model.state_dict())

    # In place: the Trainer sees the GPT2LMHeadModel with its own forward signature (it keeps the dataset's
    # columns that forward takes) and state_dict keys. torch.compile(model, backend="aot2onnx") works too, with
    # TrainingArguments(remove_unused_columns=False): its OptimizedModule's forward takes (*args, **kwargs).
    model.compile(backend="aot2onnx")
    with tempfile.TemporaryDirectory() as output_dir:
        print(f"Training GPT-2 ({sum(p.numel() for p in model.parameters()) / 1e3:.0f}k parameters) on ONNX Runtime:")
        losses, seconds = train(model, dataset, args.steps, output_dir)
        print(f"aot2onnx: {args.steps} steps in {seconds:.1f} s (the first step compiles)")
        print("logged losses:", " ".join(f"{loss:.4f}" for loss in losses))
        if not args.no_eager:
            eager_losses, eager_seconds = train(eager, dataset, args.steps, output_dir)
            print(f"eager PyTorch: {args.steps} steps in {eager_seconds:.1f} s")
            print("logged losses:", " ".join(f"{loss:.4f}" for loss in eager_losses))
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, eager_losses))
            print(f"largest relative difference of a logged loss from eager: {worst:.1e}")
    if losses[-1] >= losses[0]:
        raise SystemExit("the loss did not go down")


if __name__ == "__main__":
    main()
