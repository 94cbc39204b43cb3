"""The zoo's language and vision models (``tests/zoo.py``) exported with ``export_training`` and trained on the
torch-free trainer (``aot2onnx/artifact/edge.py``: numpy and ONNX Runtime) like eager PyTorch and torch.optim.

Each case wraps a zoo member's model and loss so that ``module(*inputs)`` returns the scalar loss, exports it
with an example batch of 4 and trains 20 steps alternating batches of 2 and 6 (both inside the range the
signature states, neither the example's), with SGD (momentum and weight decay) and with AdamW. Eager trains a
copy on the same batches; every step's loss and, at the end, every parameter, buffer and optimizer state tensor
are compared.

Tolerances (float32): rtol 1e-4, atol 1e-5 for losses and state, SGD and AdamW alike; measured worst 9.5e-7
on a loss and 4.1e-6 on a state entry (``python tests/test_export_zoo.py`` prints the table). The one
exception is AdamW on entries whose gradient is
zero in exact arithmetic, so that both sides see only rounding noise: an attention key bias adds the same
amount to every score of a query, and the softmax cancels it. Adam divides a gradient by its own running
magnitude, so such noise (~1e-9) moves the entry about as far as a real gradient would, up to lr per step, in
directions that differ between eager and ONNX Runtime: those entries are compared at atol = lr * steps (Adam's
bound on the distance travelled), as in ``tests/test_export.py``. Under SGD the same noise moves them by lr x
1e-9 and they are compared at the common tolerance.

Members in the default run: GPT-2, the ResNet-style CNN (BatchNorm running statistics are state the forward
updates) and ViT; BERT, Llama (RoPE, grouped-query attention) and T5 with ``-m slow``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
import zoo

import aot2onnx
from aot2onnx.artifact import edge

pytest.importorskip("transformers")

STEPS = 20
EXPORT_BATCH = 4
TRAIN_BATCHES = (2, 6)  # step i trains at TRAIN_BATCHES[i % 2]
RTOL, ATOL = 1e-4, 1e-5
OPTIMIZERS = {
    "sgd": {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.01},
    "adamw": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
}
NOISE_ATOL = OPTIMIZERS["adamw"]["lr"] * STEPS


class LossFirst(nn.Module):
    """A zoo member's model and loss: ``module(*inputs)`` returns the scalar loss, what export_training takes.

    transformers' models take the labels and compute the loss themselves (``zoo._loss_attr`` reads it); for the
    others, the last input is the target of the member's loss function.
    """

    def __init__(self, member: zoo.Member, target: bool) -> None:
        super().__init__()
        self.model = member.build()
        self.loss_fn = member.loss_fn
        self.target = target

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self.target:
            return self.loss_fn(self.model(*inputs[:-1]), inputs[-1])
        return self.loss_fn(self.model(*inputs), None)


# ---------------------------------------------------------------------------------------------------------
# Batches of any size, shaped as the zoo's own data (which has one batch size per member)


def _token_ids(g: torch.Generator, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(1, zoo.VOCAB, (batch, seq), generator=g)


def _causal_lm(g: torch.Generator, batch: int) -> tuple[torch.Tensor, ...]:
    ids = _token_ids(g, batch, 12)
    return ids, ids.clone()  # input_ids, labels (shifted inside the model)


def _bert(g: torch.Generator, batch: int) -> tuple[torch.Tensor, ...]:
    seq = 12
    mask = zoo._padding_mask(batch, seq)  # the second and third sequences padded
    token_type = torch.zeros(batch, seq, dtype=torch.long)
    token_type[:, seq // 2:] = 1
    return _token_ids(g, batch, seq) * mask, token_type, mask, torch.randint(0, 3, (batch,), generator=g)


def _seq2seq(g: torch.Generator, batch: int) -> tuple[torch.Tensor, ...]:
    mask = zoo._padding_mask(batch, 12)
    return _token_ids(g, batch, 12) * mask, mask, _token_ids(g, batch, 8)  # input_ids, attention_mask, labels


def _images(classes: int) -> Callable[[torch.Generator, int], tuple[torch.Tensor, ...]]:
    def images(g: torch.Generator, batch: int) -> tuple[torch.Tensor, ...]:
        return torch.randn(batch, 3, 16, 16, generator=g), torch.randint(0, classes, (batch,), generator=g)

    return images


# ---------------------------------------------------------------------------------------------------------
# The cases


@dataclasses.dataclass(frozen=True)
class Case:
    member: str  # the zoo member whose builder and loss this exports
    data: Callable[[torch.Generator, int], tuple[torch.Tensor, ...]]
    batch_range: tuple[int, int | None]  # (min, max) the signature states
    range_reason: str = ""  # why min is not 1 (docs/artifact-format.md: where the range comes from)
    target: bool = False  # the last input is the loss function's target
    # Under AdamW: entries (and the slice of them) whose gradient is rounding noise; see the module docstring.
    noise: dict[str, slice] = dataclasses.field(default_factory=dict)
    slow: bool = False


_MASK_EXPAND = ("transformers' create_causal_mask expands position ids [1, seq] to the batch only where the batch "
                "is not 1 (masking_utils._preprocess_mask_arguments): the trace records Ne(batch, 1)")
CASES = {
    "gpt2": Case(
        "gpt2", _causal_lm, (2, None), _MASK_EXPAND,
        # c_attn's bias is [query | key | value], 32 wide each
        noise={f"model.model.transformer.h.{i}.attn.c_attn.bias": slice(32, 64) for i in range(2)},
    ),
    "resnet": Case("resnet", _images(10), (1, None), target=True),
    "vit": Case(
        "vit", _images(5), (1, None),
        noise={f"model.model.vit.layers.{i}.attention.k_proj.bias": slice(None) for i in range(2)},
    ),
    "bert_seq_cls": Case(
        "bert_seq_cls", _bert, (1, None),
        noise={f"model.model.bert.encoder.layer.{i}.attention.self.key.bias": slice(None) for i in range(2)},
        slow=True,
    ),
    "llama_gqa": Case("llama_gqa", _causal_lm, (2, None), _MASK_EXPAND, slow=True),
    "t5": Case(
        "t5", _seq2seq, (2, None),
        "T5's _shift_right writes the labels into a new tensor with a slice assignment, and the fake copy_ "
        "(torch/_meta_registrations.py meta_copy_) records Ne(batch, 1) while checking the broadcast",
        slow=True,
    ),
}
_MEMBERS = {m.name: m for m in zoo.MEMBERS}
assert all(c.member in _MEMBERS for c in CASES.values()), "a case names a member the zoo does not have"


@dataclasses.dataclass
class Result:
    """One case trained both ways: what the table reports."""

    losses: list[float]  # the trainer's, per step
    eager_losses: list[float]
    state: dict[str, np.ndarray]  # the trainer's final state, by state entry
    eager_state: dict[str, torch.Tensor]  # eager's final parameters, buffers and optimizer state, by state entry
    signature: dict
    batch_sizes: list[int]
    seconds: dict[str, float]


def _torch_optimizer(name: str, params) -> torch.optim.Optimizer:
    return (torch.optim.SGD if name == "sgd" else torch.optim.AdamW)(params, **OPTIMIZERS[name])


def _artifact_optimizer(name: str) -> aot2onnx.optim.Optimizer:
    return (aot2onnx.optim.SGD if name == "sgd" else aot2onnx.optim.AdamW)(**OPTIMIZERS[name])


def train(name: str, optimizer: str, out_dir: pathlib.Path) -> Result:
    """Exports case ``name`` with ``optimizer`` into ``out_dir``, trains it on the trainer and eagerly."""
    case = CASES[name]
    torch.manual_seed(0)
    module = LossFirst(_MEMBERS[case.member], case.target)
    before = copy.deepcopy(module.state_dict())
    g = torch.Generator().manual_seed(1)
    example = case.data(g, EXPORT_BATCH)
    sizes = [TRAIN_BATCHES[i % len(TRAIN_BATCHES)] for i in range(STEPS)]
    batches = [case.data(g, size) for size in sizes]
    seconds = {}

    start = time.perf_counter()
    aot2onnx.export_training(module, example, out_dir, optimizer=_artifact_optimizer(optimizer))
    seconds["export"] = time.perf_counter() - start
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key]), f"export_training changed {key}"
    signature = json.loads((out_dir / "signature.json").read_text())

    start = time.perf_counter()
    trainer = edge.Trainer(out_dir)
    losses = [trainer.step(*(x.numpy() for x in batch)) for batch in batches]
    seconds["trainer"] = time.perf_counter() - start

    start = time.perf_counter()
    eager = copy.deepcopy(module)
    opt = _torch_optimizer(optimizer, eager.parameters())
    eager_losses = []
    threads = torch.get_num_threads()
    # One thread: these models are tiny, and OpenMP threads waiting on each other on busy cores made the 20
    # eager steps take 10-30 s here instead of 1.
    torch.set_num_threads(1)
    try:
        for batch in batches:
            loss = eager(*batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            eager_losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    seconds["eager"] = time.perf_counter() - start

    # Eager's state under the artifact's names: a tied tensor is one entry (its first name), non-persistent
    # buffers are state too, optimizer state is <parameter>:<slot>.
    tied = {t["name"] for t in signature.get("tied", [])}
    eager_state: dict[str, torch.Tensor] = {}
    named = [*eager.named_parameters(remove_duplicate=False), *eager.named_buffers(remove_duplicate=False)]
    for key, value in named:
        if key not in tied:
            eager_state[key] = value.detach()
    for key, p in eager.named_parameters():
        for slot, value in opt.state[p].items():
            eager_state["optimizer:step" if slot == "step" else f"{key}:{slot}"] = value
    return Result(losses, eager_losses, trainer.state, eager_state, signature, sizes, seconds)


def _split(name: str, value: np.ndarray, case: Case, optimizer: str) -> tuple[np.ndarray, np.ndarray]:
    """(entries compared at RTOL/ATOL, entries compared at NOISE_ATOL) of a state tensor, flattened."""
    parameter = name.split(":")[0]
    noise = case.noise.get(parameter) if optimizer == "adamw" else None
    if noise is None:
        return value.ravel(), value.ravel()[:0]
    loose = np.zeros(value.shape, dtype=bool)
    loose[noise] = True
    return value[~loose], value[loose]


def figures(name: str, optimizer: str, result: Result) -> dict[str, Any]:
    """The table's row: largest differences from eager, the signature's batch range, the sizes trained."""
    case = CASES[name]
    state_diff = (0.0, "")
    noise_diff = 0.0
    for key, expected in result.eager_state.items():
        if key == "optimizer:step":
            continue
        actual = result.state[key].astype(np.float64)
        tight_a, loose_a = _split(key, actual, case, optimizer)
        tight_e, loose_e = _split(key, expected.to(torch.float64).numpy(), case, optimizer)
        if tight_a.size:
            state_diff = max(state_diff, (float(np.abs(tight_a - tight_e).max()), key))
        if loose_a.size:
            noise_diff = max(noise_diff, float(np.abs(loose_a - loose_e).max()))
    dims = result.signature["dims"]["batch"]
    return {
        "case": name, "optimizer": optimizer,
        "loss_diff": max(abs(a - e) for a, e in zip(result.losses, result.eager_losses)),
        "state_diff": state_diff[0], "worst": state_diff[1], "noise_diff": noise_diff,
        "range": (dims["min"], dims["max"]), "example": dims["example"],
        "trained": sorted(set(result.batch_sizes)), **{f"{k}_s": v for k, v in result.seconds.items()},
    }


# The default run trains each default case with one optimizer (gpt2 with AdamW, resnet and vit with SGD: both
# optimizers and every default model, 15 of the 33 s); -m slow trains every pair.
_DEFAULT_OPTIMIZER = {"gpt2": "adamw", "resnet": "sgd", "vit": "sgd"}


def _param(name: str, optimizer: str):
    slow = CASES[name].slow or _DEFAULT_OPTIMIZER.get(name, optimizer) != optimizer
    return pytest.param(name, optimizer, id=f"{name}-{optimizer}", marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("name,optimizer", [_param(n, o) for n in CASES for o in OPTIMIZERS])
def test_zoo_model_trains_on_the_device_like_eager(name, optimizer, tmp_path):
    case = CASES[name]
    result = train(name, optimizer, tmp_path)

    dims = result.signature["dims"]["batch"]
    assert (dims["example"], dims["min"], dims["max"]) == (EXPORT_BATCH, *case.batch_range)
    assert bool(case.range_reason) == (case.batch_range[0] != 1), "a range other than [1, None] says why"
    for size in TRAIN_BATCHES:
        assert size != EXPORT_BATCH and dims["min"] <= size and (dims["max"] is None or size <= dims["max"])

    np.testing.assert_allclose(result.losses, result.eager_losses, rtol=RTOL, atol=ATOL, err_msg="losses")
    # Every parameter, buffer and optimizer state tensor eager has, and nothing else in the artifact's state.
    assert set(result.state) == set(result.eager_state), set(result.state) ^ set(result.eager_state)
    for key, expected in result.eager_state.items():
        actual = result.state[key]
        if key == "optimizer:step":  # torch counts per parameter in float32; the artifact once, in int64
            assert int(actual) == int(expected) == STEPS
            continue
        expected = expected.numpy()
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, (key, actual.dtype, expected.dtype)
        if not np.issubdtype(expected.dtype, np.floating):  # BatchNorm's num_batches_tracked, position ids
            np.testing.assert_array_equal(actual, expected, err_msg=key)
            continue
        tight_a, loose_a = _split(key, actual, case, optimizer)
        tight_e, loose_e = _split(key, expected, case, optimizer)
        np.testing.assert_allclose(tight_a, tight_e, rtol=RTOL, atol=ATOL, err_msg=key)
        np.testing.assert_allclose(loose_a, loose_e, rtol=0, atol=NOISE_ATOL, err_msg=f"{key} (rounding-noise gradient)")


def test_the_cases_cover_what_they_promise():
    default = {n for n, c in CASES.items() if not c.slow}
    assert {"gpt2", "resnet"} <= default and default & {"bert_seq_cls", "vit"}
    assert any(b.is_floating_point() for b in LossFirst(_MEMBERS["resnet"], True).buffers())  # BatchNorm's stats
    for case in CASES.values():
        module = LossFirst(_MEMBERS[case.member], case.target)
        names = dict(module.named_parameters())
        for key, where in case.noise.items():
            assert key in names and names[key][where].numel() > 0, f"{case.member}: no parameter {key}"


# ---------------------------------------------------------------------------------------------------------
# python tests/test_export_zoo.py: the table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The zoo exported and trained on the device, against eager.")
    parser.add_argument("cases", nargs="*", help=f"default: all of {list(CASES)}")
    args = parser.parse_args(argv)
    print(f"{STEPS} steps, export batch {EXPORT_BATCH}, trained at {TRAIN_BATCHES} alternately; "
          f"{torch.get_num_threads()} torch threads\n")
    print("| model | optimizer | max loss diff | max param/buffer/optimizer-state diff (entry) | "
          "AdamW noise entries | batch range | sizes trained | export s | trainer s | eager s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.cases or CASES:
        for optimizer in OPTIMIZERS:
            with tempfile.TemporaryDirectory() as out_dir:
                row = figures(name, optimizer, train(name, optimizer, pathlib.Path(out_dir)))
            noise = f"{row['noise_diff']:.1e}" if CASES[name].noise and optimizer == "adamw" else "-"
            low, high = row["range"]
            print(f"| {name} | {optimizer} | {row['loss_diff']:.1e} | {row['state_diff']:.1e} ({row['worst']}) | "
                  f"{noise} | [{low}, {'inf' if high is None else high}] | {', '.join(map(str, row['trained']))} | "
                  f"{row['export_s']:.1f} | {row['trainer_s']:.1f} | {row['eager_s']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
