"""Hugging Face ``Trainer`` trains a model compiled with aot2onnx as it trains the eager model.

A tiny randomly initialised GPT-2 (from a config: nothing is downloaded) on random tokens, CPU, no saving: the
losses the Trainer logs and the final parameters equal those of the same Trainer run on the eager model, and
every compiled graph ran on ONNX Runtime at every step. ``TrainingArguments(torch_compile_backend="aot2onnx")``
is refused by accelerate, whose ``DynamoBackend`` enum lists only the backends it knows.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

import aot2onnx  # noqa: E402
from aot2onnx.compile.fallback import fallback_graphs, reset_fallback_graphs  # noqa: E402

STEPS = 6
VOCAB = 40


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=1, n_head=2, bos_token_id=None, eos_token_id=None,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # ONNX Runtime draws its own random numbers
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def _dataset() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (4 * STEPS, 16), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def _args(output_dir, **overrides) -> TrainingArguments:
    settings = dict(
        output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=4, logging_steps=1,
        # SGD: AdamW divides each gradient by its running RMS, so a parameter whose gradient is rounding noise
        # (GPT-2's key bias: softmax ignores it) would take full steps in a direction noise picks, in both runs.
        optim="sgd", learning_rate=0.5, save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
    )  # fmt: skip
    settings.update(overrides)
    return TrainingArguments(**settings)


def _train(model: torch.nn.Module, args: TrainingArguments) -> list[float]:
    trainer = Trainer(model=model, args=args, train_dataset=_dataset())
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory):
    model = _model()
    losses = _train(model, _args(tmp_path_factory.mktemp("eager")))
    return losses, dict(model.named_parameters())


@pytest.mark.parametrize("how", ["module.compile", "torch.compile"])
def test_trainer_trains_a_compiled_model_like_eager(how, eager_run, tmp_path):
    eager_losses, eager_params = eager_run
    model = _model()
    aot2onnx.reset_compiled_graphs()
    reset_fallback_graphs()
    if how == "module.compile":
        # In place: the Trainer sees GPT2LMHeadModel's forward, and keeps the dataset's columns it takes.
        model.compile(backend="aot2onnx")
        losses = _train(model, _args(tmp_path))
    else:
        # The OptimizedModule's forward takes (*args, **kwargs): the Trainer would drop every column.
        losses = _train(torch.compile(model, backend="aot2onnx"), _args(tmp_path, remove_unused_columns=False))

    assert len(losses) == len(eager_losses) == STEPS
    torch.testing.assert_close(losses, eager_losses, rtol=1e-4, atol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, eager_params[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    graphs = aot2onnx.compiled_graphs()
    assert graphs and all(g.runs == STEPS for g in graphs), [(g.name, g.runs) for g in graphs]
    assert not fallback_graphs(), [g.fallen_back for g in fallback_graphs()]


def test_the_compiled_module_needs_remove_unused_columns_false(tmp_path):
    # What the README says: without it the Trainer keeps only the columns named args and kwargs.
    with pytest.raises(ValueError, match="The batch received was empty"):
        _train(torch.compile(_model(), backend="aot2onnx"), _args(tmp_path))


def test_torch_compile_backend_argument_is_refused_by_accelerate(tmp_path):
    # accelerate (1.15) checks the name against its DynamoBackend enum; the README says to compile the model
    # instead. This fails the day accelerate takes any registered backend: the README should say so then.
    with pytest.raises(ValueError, match="'AOT2ONNX' is not a valid DynamoBackend"):
        Trainer(model=_model(), args=_args(tmp_path, torch_compile_backend="aot2onnx"), train_dataset=_dataset())
