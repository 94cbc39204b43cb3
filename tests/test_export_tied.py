"""Tied (shared) parameters export as one state entry: GPT-2's and BERT's LM heads share the word embedding."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn as nn

import aot2onnx
from aot2onnx.artifact import edge

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 48, 10


class LanguageModel(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(input_ids=ids, labels=labels).loss


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def _bert() -> nn.Module:
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(config)


TIED = {
    "gpt2": (_gpt2, {"model.lm_head.weight": "model.transformer.wte.weight"}),
    "bert": (_bert, {"model.cls.predictions.decoder.weight": "model.bert.embeddings.word_embeddings.weight",
                     "model.cls.predictions.decoder.bias": "model.cls.predictions.bias"}),
}


def _batch(size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randint(0, VOCAB, (size, SEQ), generator=generator),
            torch.randint(0, VOCAB, (size, SEQ), generator=generator))


@pytest.mark.parametrize("name", sorted(TIED))
def test_tied_weights_train_on_both_readers_like_eager(tmp_path, name):
    make, tied = TIED[name]
    torch.manual_seed(0)
    model = LanguageModel(make())
    for alias, shared in tied.items():
        assert model.get_parameter(alias) is model.get_parameter(shared)
    generator = torch.Generator().manual_seed(1)
    aot2onnx.export_training(copy.deepcopy(model), _batch(4, generator), tmp_path,
                             optimizer=aot2onnx.optim.SGD(0.1, momentum=0.9))
    sig = json.loads((tmp_path / "signature.json").read_text())
    assert {t["name"]: t["state"] for t in sig["tied"]} == tied
    assert not set(tied) & {e["name"] for e in sig["state"]}  # one state entry per tensor

    eager = copy.deepcopy(model)
    opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    trainer = edge.Trainer(tmp_path)
    loaded = aot2onnx.load(tmp_path)
    loaded_opt = torch.optim.SGD(loaded.parameters(), lr=0.1, momentum=0.9)
    for size in (3, 5, 3):
        ids, labels = _batch(size, generator)
        loss = eager(ids, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert trainer.step(ids.numpy(), labels.numpy()) == pytest.approx(loss.item(), rel=1e-4, abs=1e-5)
        loaded_loss = loaded(ids, labels)
        loaded_opt.zero_grad()
        loaded_loss.backward()
        loaded_opt.step()
        assert loaded_loss.item() == pytest.approx(loss.item(), rel=1e-4, abs=1e-5)
    expected = eager.state_dict()
    for entry in sig["state"]:
        if entry["name"] in expected:  # parameters and persistent buffers
            np.testing.assert_allclose(trainer.state[entry["name"]], expected[entry["name"]].numpy(), rtol=1e-4,
                                       atol=1e-5, err_msg=entry["name"])
    # aot2onnx.load holds the tied tensor under every name, as the module did, and its state_dict matches.
    for alias, shared in tied.items():
        assert loaded.get_parameter(alias) is loaded.get_parameter(shared)
    loaded_state = loaded.state_dict()
    for key, value in expected.items():
        np.testing.assert_allclose(loaded_state[key].detach().numpy(), value.numpy(), rtol=1e-4, atol=1e-5, err_msg=key)
