"""The model zoo: small, randomly initialised models of the architectures people train, each trained through
aot2onnx with default options against eager PyTorch (``tests/test_zoo.py``).

Nothing is downloaded: transformers models come from tiny configs (hidden sizes 32, 2 layers, 8-12 tokens);
the vision nets, the U-Net block, the recurrent LMs and the recommender are written here. Every dropout
probability is 0 (eager and compiled draw from different random streams). Members marked ``slow`` run with
``-m slow``; the rest are the default run.

``FALLBACKS`` records where every node ran: for each member, the ops that fell back to PyTorch (the per-node
fallback). It is strict, like ``tests/opinfo_expectations.py``: the set a member falls back on must equal
its entry, so an op that starts falling back fails the test, and so does one that stops.

``python tests/zoo.py --report [--steps N] [--threads N] [member ...]`` trains each member eagerly and
compiled side by side and prints a markdown table: per member, the largest loss and gradient difference
from eager, eager's own float32 error (against a float64 copy) as the scale to judge them on, the step
times and their ratio, and the fallbacks. Speed is reported, never asserted. On a machine other processes
load, ``--threads 1`` keeps eager's OpenMP threads from waiting on each other (two threads on two busy cores
made eager's steps 50-100x slower here, intermittently).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from aot2onnx.tools.bench.models import TINY_BERT_CONFIG, TinyMobileNet

__all__ = ["FALLBACKS", "MEMBERS", "STEPS", "Member", "check", "fallen_back_ops", "main", "report_row", "report_rows"]

STEPS = 3  # optimizer steps in the default test run


@dataclasses.dataclass(frozen=True)
class Member:
    name: str
    family: str
    build: Callable[[], nn.Module]
    # step (0-based) -> (model arguments, target); the target goes to ``loss_fn(output, target)``.
    data: Callable[[int], tuple[tuple, Any]]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    tol: tuple[float, float] = (1e-4, 1e-5)  # (rtol, atol); a looser one says why in ``tol_reason``
    tol_reason: str = ""
    slow: bool = False
    allow_rnn: bool = False
    # A strict expected failure: the precise reason, and a regular expression the error must match (another
    # error fails the test, and so does a pass).
    xfail: str = ""
    xfail_match: str = ""
    # Why torch itself runs model compute (matmuls, convolutions, ...) in a compiled step, if it does: then
    # assert_parity's check for that is off. Only an op that falls back can make it so.
    torch_compute: str = ""

    def context(self) -> contextlib.AbstractContextManager:
        return torch._dynamo.config.patch(allow_rnn=True) if self.allow_rnn else contextlib.nullcontext()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _loss_attr(output: Any, _target: Any = None) -> torch.Tensor:
    return output.loss


def _cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


# ----------------------------------------------------------------------------------------------------------
# transformers models, called with keyword arguments


class _HF(nn.Module):
    """Calls a transformers model with keyword arguments from positional ones (assert_parity passes tuples)."""

    def __init__(self, model: nn.Module, keys: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.keys = keys

    def forward(self, *args: torch.Tensor) -> Any:
        return self.model(**dict(zip(self.keys, args)), use_cache=False)


def _hf(model_cls: str, config_cls: str, keys: tuple[str, ...], attn: str = "eager", loss_type: str = "",
        **config: Any) -> Callable:
    def build() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config_cls)(**config)
        cfg._attn_implementation = attn
        model = getattr(transformers, model_cls)(cfg)
        if loss_type:
            # Where transformers cannot tell the loss from the class name (GPT2LMHeadModel), it logs a warning
            # at every call: a graph break under Dynamo.
            model.loss_type = loss_type
        return _HF(model, keys)

    return build


VOCAB = 96


def _tokens(step: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, seq), generator=_gen(seed * 1000 + step))


def _causal_lm_data(batch: int, seq: int, seed: int) -> Callable:
    def data(step: int) -> tuple[tuple, Any]:
        ids = _tokens(step, batch, seq, seed)
        return (ids, ids.clone()), None  # input_ids, labels (shifted inside the model)

    return data


def _padding_mask(batch: int, seq: int) -> torch.Tensor:
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, seq - 3:] = 0  # the second sequence is padded
    if batch > 2:
        mask[2, seq - 5:] = 0
    return mask


def _bert_data(step: int) -> tuple[tuple, Any]:
    batch, seq = 3, 12
    ids = _tokens(step, batch, seq, 3)
    mask = _padding_mask(batch, seq)
    ids = ids * mask
    token_type = torch.zeros(batch, seq, dtype=torch.long)
    token_type[:, seq // 2:] = 1
    labels = torch.randint(0, 3, (batch,), generator=_gen(30 + step))
    return (ids, token_type, mask, labels), None


def _seq2seq_data(seed: int) -> Callable:
    def data(step: int) -> tuple[tuple, Any]:
        batch, src, tgt = 2, 12, 8
        ids = _tokens(step, batch, src, seed)
        mask = _padding_mask(batch, src)
        labels = _tokens(step + 100, batch, tgt, seed)
        return (ids * mask, mask, labels), None

    return data


def _image_labels(batch: int, size: int, classes: int, seed: int) -> Callable:
    def data(step: int) -> tuple[tuple, Any]:
        g = _gen(seed * 1000 + step)
        return (torch.randn(batch, 3, size, size, generator=g),), torch.randint(0, classes, (batch,), generator=g)

    return data


def _vit_data(step: int) -> tuple[tuple, Any]:
    g = _gen(7000 + step)
    return (torch.randn(2, 3, 16, 16, generator=g), torch.randint(0, 5, (2,), generator=g)), None


# ----------------------------------------------------------------------------------------------------------
# Vision nets written here (no torchvision)


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class TinyResNet(nn.Module):
    """ResNet-style: a stem, max pooling, residual basic blocks with BatchNorm, global average pooling."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.layers = nn.Sequential(_BasicBlock(16, 16, 1), _BasicBlock(16, 32, 2), _BasicBlock(32, 64, 2))
        self.fc = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.pool(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# TinyMobileNet (with its _SqueezeExcite and _InvertedResidual) is defined in the benchmark's models.py, imported
# above: the device suite trains it too.


class _ResBlock(nn.Module):
    """A diffusion U-Net residual block: GroupNorm, SiLU, convolution, twice, with a 1x1 skip projection."""

    def __init__(self, cin: int, cout: int, groups: int = 8) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class TinyUNet(nn.Module):
    """A U-Net level: down (strided convolution), a middle block, up (F.interpolate) with a skip connection."""

    def __init__(self, mode: str = "nearest") -> None:
        super().__init__()
        self.mode = mode
        self.inp = nn.Conv2d(3, 32, 3, padding=1)
        self.down_block = _ResBlock(32, 32)
        self.down = nn.Conv2d(32, 32, 3, stride=2, padding=1)
        self.mid = _ResBlock(32, 64)
        self.up_block = _ResBlock(64 + 32, 32)
        self.out_norm = nn.GroupNorm(8, 32)
        self.out = nn.Conv2d(32, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.down_block(self.inp(x))
        h = self.mid(self.down(skip))
        if self.mode == "nearest":
            h = F.interpolate(h, scale_factor=2.0, mode="nearest")
        else:
            h = F.interpolate(h, size=skip.shape[-2:], mode=self.mode, align_corners=False)
        h = self.up_block(torch.cat([h, skip], dim=1))
        return self.out(F.silu(self.out_norm(h)))


def _unet_data(step: int) -> tuple[tuple, Any]:
    g = _gen(9000 + step)
    return (torch.randn(2, 3, 16, 16, generator=g),), torch.randn(2, 3, 16, 16, generator=g)


# ----------------------------------------------------------------------------------------------------------
# Recurrent language models (need torch._dynamo.config.allow_rnn)


class RecurrentLM(nn.Module):
    """Embedding, a 2-layer LSTM or GRU, a linear head: next-token logits (a tagger's, bidirectional)."""

    def __init__(self, cell: str, bidirectional: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[cell]
        self.rnn = rnn(32, 48, num_layers=2, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(96 if bidirectional else 48, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(ids))
        return self.head(out)


class BiLSTMClassifier(nn.Module):
    """A sequence classifier over input features (audio frames, sensor readings): a 2-layer bidirectional
    LSTM, mean over time, a linear head."""

    def __init__(self, features: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.rnn = nn.LSTM(features, 32, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out.mean(dim=1))


def _features_data(step: int) -> tuple[tuple, Any]:
    g = _gen(12000 + step)
    return (torch.randn(3, 10, 16, generator=g),), torch.randint(0, 5, (3,), generator=g)


def _rnn_data(step: int) -> tuple[tuple, Any]:
    ids = _tokens(step, 3, 10, 11)
    return (ids[:, :-1],), ids[:, 1:]


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


# ----------------------------------------------------------------------------------------------------------
# A recommender, written here


class TinyDLRM(nn.Module):
    """DLRM-style: a bottom MLP for dense features, EmbeddingBag lookups of multi-hot categorical features (a sum
    with a padding index, a mean, a max), pairwise dot-product interactions, a top MLP giving a click logit."""

    def __init__(self) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
        self.tables = nn.ModuleList([
            nn.EmbeddingBag(40, 16, mode="sum", padding_idx=0),
            nn.EmbeddingBag(30, 16, mode="mean"),
            nn.EmbeddingBag(20, 16, mode="max"),
        ])
        features = 1 + len(self.tables)
        self.pairs = torch.triu_indices(features, features, 1).tolist()
        self.top = nn.Sequential(nn.Linear(16 + len(self.pairs[0]), 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, dense: torch.Tensor, *bags: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        embedded = [table(ids, offsets) for table, ids, offsets in zip(self.tables, bags[0::2], bags[1::2])]
        features = torch.stack([x, *embedded], dim=1)  # [batch, features, 16]
        interactions = torch.bmm(features, features.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, interactions], dim=1)).squeeze(1)


def _dlrm_data(step: int) -> tuple[tuple, Any]:
    g = _gen(10000 + step)
    batch, per_step = 4, 10  # 10 indices per table, split into 4 bags differently at each step
    bags: list[torch.Tensor] = []
    for rows in (40, 30, 20):
        ids = torch.randint(0, rows, (per_step,), generator=g)
        cuts = torch.sort(torch.randint(0, per_step + 1, (batch - 1,), generator=g)).values
        bags += [ids, torch.cat([torch.zeros(1, dtype=torch.long), cuts])]
    # Empty bags and padding indices on every step: the last bag of the first table is empty, and two of its
    # indices are the padding index.
    bags[1][-1] = per_step
    bags[0][:2] = 0
    clicks = torch.randint(0, 2, (batch,), generator=g).float()
    return (torch.randn(batch, 8, generator=g), *bags), clicks


def _bce(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(output, target)


# ----------------------------------------------------------------------------------------------------------
# The members

_LM_KEYS = ("input_ids", "labels")
_TINY_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=64, attention_dropout=0.0)
_BERT_KEYS = ("input_ids", "token_type_ids", "attention_mask", "labels")
_SEQ2SEQ_KEYS = ("input_ids", "attention_mask", "labels")


def _logits_cross_entropy(output: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, target)


def _bert_without_labels(step: int) -> tuple[tuple, Any]:
    (ids, token_type, mask, labels), _ = _bert_data(step)
    return (ids, token_type, mask), labels


def _pixels_and_labels(batch: int, size: int, classes: int, seed: int) -> Callable:
    """For transformers' image classifiers, which take the labels and compute the loss."""
    data = _image_labels(batch, size, classes, seed)

    def pixels_and_labels(step: int) -> tuple[tuple, Any]:
        (pixels,), labels = data(step)
        return (pixels, labels), None

    return pixels_and_labels


def _audio_data(step: int) -> tuple[tuple, Any]:
    g = _gen(11000 + step)
    return (torch.randn(2, 400, generator=g), torch.randint(0, 3, (2,), generator=g)), None


def _whisper_data(step: int) -> tuple[tuple, Any]:
    g = _gen(8000 + step)
    # input_features [batch, mel bins, frames]: Whisper wants frames = 2 * max_source_positions
    return (torch.randn(2, 8, 16, generator=g), torch.randint(3, VOCAB, (2, 6), generator=g)), None


MEMBERS: list[Member] = [
    # Decoder language models
    Member(
        "gpt2", "decoder LM",
        _hf("GPT2LMHeadModel", "GPT2Config", _LM_KEYS, vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
            n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2,
            loss_type="ForCausalLM"),
        _causal_lm_data(2, 12, 1), _loss_attr,
    ),
    Member(  # RoPE, grouped-query attention (4 query heads share 2 key/value heads), RMSNorm, SwiGLU
        "llama_gqa", "decoder LM",
        _hf("LlamaForCausalLM", "LlamaConfig", _LM_KEYS, "sdpa", num_key_value_heads=2, **_TINY_DECODER),
        _causal_lm_data(2, 12, 2), _loss_attr,
    ),
    Member(  # a 4-token sliding window over 12 tokens: the mask differs from a causal one
        "mistral_sliding_window", "decoder LM",
        _hf("MistralForCausalLM", "MistralConfig", _LM_KEYS, num_key_value_heads=2, sliding_window=4,
            head_dim=8, **_TINY_DECODER),
        _causal_lm_data(2, 12, 4), _loss_attr,
    ),
    Member(  # top-2 of 4 experts; "batched_mm" gathers each token's expert weights and runs bmm
        "mixtral_moe", "decoder LM",
        _hf("MixtralForCausalLM", "MixtralConfig", _LM_KEYS, "sdpa", num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, head_dim=8, router_jitter_noise=0.0, experts_implementation="batched_mm",
            **_TINY_DECODER),
        _causal_lm_data(2, 12, 5), _loss_attr, slow=True,
    ),
    Member(  # transformers' default experts implementation: under Dynamo with float32 weights it calls its
        # custom op transformers::grouped_mm_fallback (a Python loop over experts), which has no lowering
        "mixtral_moe_grouped_mm", "decoder LM",
        _hf("MixtralForCausalLM", "MixtralConfig", _LM_KEYS, "sdpa", num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, head_dim=8, router_jitter_noise=0.0, **_TINY_DECODER),
        _causal_lm_data(2, 12, 5), _loss_attr, slow=True,
        torch_compute="transformers' grouped_mm_fallback runs torch.mm per expert, in PyTorch by design",
    ),
    Member(  # shared expert with a sigmoid gate beside the routed ones
        "qwen2_moe", "decoder LM",
        _hf("Qwen2MoeForCausalLM", "Qwen2MoeConfig", _LM_KEYS, "sdpa", num_key_value_heads=2, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            experts_implementation="batched_mm", **_TINY_DECODER),
        _causal_lm_data(2, 12, 24), _loss_attr, slow=True,
    ),
    Member(  # ALiBi position biases, baddbmm attention
        "bloom_alibi", "decoder LM",
        _hf("BloomForCausalLM", "BloomConfig", _LM_KEYS, vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
            hidden_dropout=0.0, attention_dropout=0.0),
        _causal_lm_data(2, 12, 20), _loss_attr, slow=True,
    ),
    Member(  # multi-query attention (one key/value head), GeGLU, scaled embeddings, RMSNorm with 1 + weight
        "gemma_mqa", "decoder LM",
        _hf("GemmaForCausalLM", "GemmaConfig", _LM_KEYS, num_key_value_heads=1, head_dim=8, **_TINY_DECODER),
        _causal_lm_data(2, 12, 21), _loss_attr, slow=True,
    ),
    Member(  # rotary embedding on half of each head, parallel attention and MLP
        "gpt_neox_partial_rotary", "decoder LM",
        _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", _LM_KEYS, rotary_pct=0.5, hidden_dropout=0.0, **_TINY_DECODER),
        _causal_lm_data(2, 12, 22), _loss_attr, slow=True,
    ),
    # Encoders
    Member(  # token_type_ids and a padding attention mask (two of three sequences padded)
        "bert_seq_cls", "encoder",
        # The config is the benchmark's (its device suite trains it as bert-s); its vocabulary is VOCAB.
        _hf("BertForSequenceClassification", "BertConfig", _BERT_KEYS, "sdpa", **TINY_BERT_CONFIG),
        _bert_data, _loss_attr,
    ),
    Member(  # disentangled attention with relative position buckets. The loss comes from the logits:
        # DeBERTa's own picks labeled rows with nonzero(), a data-dependent shape that breaks the graph
        "deberta_v2", "encoder",
        _hf("DebertaV2ForSequenceClassification", "DebertaV2Config", _BERT_KEYS[:3], vocab_size=VOCAB,
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=32, type_vocab_size=2, num_labels=3, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, pooler_dropout=0.0, relative_attention=True, position_buckets=8,
            max_relative_positions=16, pos_att_type=["p2c", "c2p"]),
        _bert_without_labels, _logits_cross_entropy, slow=True,
    ),
    Member(  # a convolutional feature encoder (GroupNorm, GELU), a weight-normed positional convolution
        "wav2vec2", "encoder",
        _hf("Wav2Vec2ForSequenceClassification", "Wav2Vec2Config", ("input_values", "labels"), vocab_size=VOCAB,
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16, 16),
            conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
            num_labels=3, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
            final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, mask_feature_prob=0.0),
        _audio_data, _loss_attr, slow=True,
        xfail="Dynamo graph-breaks in transformers' Wav2Vec2 code (a `lock` context manager, ContextVar.get, "
              "hooks registered during the call, setattr of requires_grad in the feature encoder) and runs the "
              "encoder layers in eager PyTorch; nothing to lower there. (weight_norm's backward, "
              "_weight_norm_interface_backward, also has no lowering and falls back)",
        xfail_match="torch itself ran model compute during a compiled step",
    ),
    # Encoder-decoders
    Member(  # relative attention buckets, RMS layer norm, labels shifted into decoder inputs
        "t5", "encoder-decoder",
        _hf("T5ForConditionalGeneration", "T5Config", _SEQ2SEQ_KEYS, vocab_size=VOCAB, d_model=32, d_kv=8,
            d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
            relative_attention_max_distance=16, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
            eos_token_id=1),
        _seq2seq_data(6), _loss_attr,
    ),
    Member(
        "bart", "encoder-decoder",
        _hf("BartForConditionalGeneration", "BartConfig", _SEQ2SEQ_KEYS, "sdpa", vocab_size=VOCAB, d_model=32,
            encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, classifier_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            decoder_start_token_id=2, forced_eos_token_id=None),
        _seq2seq_data(8), _loss_attr, slow=True,
    ),
    Member(  # a Conv1d/GELU audio front end, sinusoidal encoder positions
        "whisper", "encoder-decoder",
        _hf("WhisperForConditionalGeneration", "WhisperConfig", ("input_features", "labels"), vocab_size=VOCAB,
            num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=8,
            max_target_positions=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, suppress_tokens=None,
            begin_suppress_tokens=None),
        _whisper_data, _loss_attr, slow=True,
    ),
    # Vision CNNs, written here
    Member("resnet", "vision CNN", TinyResNet, _image_labels(4, 16, 10, 12), _cross_entropy),
    Member("mobilenet_se", "vision CNN", TinyMobileNet, _image_labels(4, 16, 10, 13), _cross_entropy),
    Member(  # depthwise 7x7 convolutions, channels-first LayerNorm, layer scale
        "convnext", "vision CNN",
        _hf("ConvNextForImageClassification", "ConvNextConfig", ("pixel_values", "labels"), num_stages=2,
            hidden_sizes=[16, 32], depths=[1, 1], num_labels=5, drop_path_rate=0.0),
        _pixels_and_labels(2, 32, 5, 14), _loss_attr, slow=True,
    ),
    # Vision transformers
    Member(
        "vit", "vision transformer",
        _hf("ViTForImageClassification", "ViTConfig", ("pixel_values", "labels"), image_size=16, patch_size=4,
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_labels=5,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        _vit_data, _loss_attr,
    ),
    Member(  # shifted windows (torch.roll), relative position bias tables, patch merging
        "swin", "vision transformer",
        _hf("SwinForImageClassification", "SwinConfig", ("pixel_values", "labels"), image_size=32, patch_size=2,
            embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4, num_labels=5, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, drop_path_rate=0.0),
        _pixels_and_labels(2, 32, 5, 15), _loss_attr, slow=True,
    ),
    # U-Net blocks, written here
    Member("unet_block", "U-Net", TinyUNet, _unet_data, _mse),
    Member("unet_block_bilinear", "U-Net", lambda: TinyUNet("bilinear"), _unet_data, _mse, slow=True),
    # Recurrent language models, written here
    Member("lstm_lm", "recurrent LM", lambda: RecurrentLM("lstm"), _rnn_data, _lm_loss, allow_rnn=True),
    Member("gru_lm", "recurrent LM", lambda: RecurrentLM("gru"), _rnn_data, _lm_loss, allow_rnn=True, slow=True),
    Member("bilstm_tagger", "recurrent LM", lambda: RecurrentLM("lstm", bidirectional=True), _rnn_data, _lm_loss,
           allow_rnn=True, slow=True),
    Member(
        "bilstm_on_features", "recurrent", BiLSTMClassifier, _features_data, _cross_entropy, allow_rnn=True,
        slow=True,
        xfail="PyTorch 2.13: where a bidirectional nn.LSTM's input needs no gradient (features, not an "
              "embedding), AOTAutograd's forward graph saves None for the backward and its runtime wrapper "
              "asserts on it; backend='aot_eager' fails the same way (bilstm_tagger, on an embedding, trains)",
        xfail_match="expected all tensors_saved_with_vc_check to be Tensors",
    ),
    # A recommender, written here
    Member("dlrm", "recommender", TinyDLRM, _dlrm_data, _bce),
]

_names = [m.name for m in MEMBERS]
assert len(set(_names)) == len(_names), "member names must be unique"

# What falls back to PyTorch, per member: the FX targets of the nodes that ran in PyTorch (the per-node
# fallback). Strict: the set a member falls back on must equal its entry, so an op that starts falling back
# fails its test, and so does one that stops (then the entry is updated, saying why in the commit).
_FALLBACK_PAIRS: list[tuple[str, frozenset[str]]] = [
    ("gpt2", frozenset()),
    ("llama_gqa", frozenset()),
    ("mistral_sliding_window", frozenset()),
    ("mixtral_moe", frozenset()),
    # transformers' custom op and its backward (they run torch.mm per expert), nothing else
    ("mixtral_moe_grouped_mm", frozenset({"transformers.grouped_mm_fallback.default",
                                          "transformers.grouped_mm_fallback_backward.default"})),
    ("qwen2_moe", frozenset()),
    ("bloom_alibi", frozenset()),
    ("gemma_mqa", frozenset()),
    ("gpt_neox_partial_rotary", frozenset()),
    ("bert_seq_cls", frozenset()),
    ("deberta_v2", frozenset()),
    ("wav2vec2", frozenset({"aten._weight_norm_interface_backward.default"})),  # not checked while it fails
    ("t5", frozenset()),
    ("bart", frozenset()),
    ("whisper", frozenset()),
    ("resnet", frozenset()),
    ("mobilenet_se", frozenset()),
    ("convnext", frozenset()),
    ("vit", frozenset()),
    ("swin", frozenset()),
    ("unet_block", frozenset()),
    ("unet_block_bilinear", frozenset()),
    ("lstm_lm", frozenset()),
    ("gru_lm", frozenset()),
    ("bilstm_tagger", frozenset()),
    ("bilstm_on_features", frozenset()),
    ("dlrm", frozenset()),
]
FALLBACKS: dict[str, frozenset[str]] = dict(_FALLBACK_PAIRS)
assert len(FALLBACKS) == len(_FALLBACK_PAIRS), "FALLBACKS names a member twice"
assert set(FALLBACKS) == set(_names), "FALLBACKS needs exactly one entry per member"


# ----------------------------------------------------------------------------------------------------------
# Checking and reporting


def fallen_back_ops() -> frozenset[str]:
    """The FX targets that ran in PyTorch in the graphs compiled since the last reset."""
    from aot2onnx.compile.fallback import fallback_graphs

    return frozenset(t for g in fallback_graphs() for t in g.fallen_back)


def check(member: Member, steps: int = STEPS) -> frozenset[str]:
    """Trains ``member`` eagerly and through aot2onnx with ``assert_parity``; returns the ops that fell back."""
    from aot2onnx.testing import assert_parity

    data = [member.data(i) for i in range(steps)]
    rtol, atol = member.tol
    expected = FALLBACKS[member.name]
    with member.context(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="aot2onnx: graph .* run in PyTorch")
        assert_parity(
            member.build, lambda i: data[i][0], loss_fn=member.loss_fn, targets=[t for _, t in data], steps=steps,
            rtol=rtol, atol=atol, allow_fallback=bool(expected), check_torch_ops=not member.torch_compute,
        )
        return fallen_back_ops()


def _grad_vector(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().to(torch.float64).flatten() for p in model.parameters() if p.grad is not None])


def _step(model: Callable, opt: torch.optim.Optimizer, args: tuple, target: Any, loss_fn: Callable) -> tuple[float, float]:
    """One training step: (loss, seconds)."""
    start = time.perf_counter()
    loss = loss_fn(model(*args), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach()), time.perf_counter() - start


def _float64(value: Any) -> Any:
    return value.to(torch.float64) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def report_row(member: Member, steps: int = 8) -> dict[str, Any]:
    """Trains an eager, a compiled and a float64 eager copy side by side for ``steps`` steps.

    Per step, eager and compiled alternate which goes first. The row holds the largest loss and gradient
    difference between compiled and eager over all steps, the same for eager float32 against float64
    (eager's own rounding error: the scale a difference is judged on, since small differences grow along the
    training trajectory; ``None`` where the model does not run in float64), the median step times after the
    first (which compiles), and the fallbacks.
    """
    from aot2onnx.compile.fallback import reset_fallback_graphs

    torch._dynamo.reset()
    reset_fallback_graphs()
    torch.manual_seed(0)
    eager = member.build()
    compiled_model = copy.deepcopy(eager)
    reference: nn.Module | None = copy.deepcopy(eager).to(torch.float64)
    opts = {m: torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled_model, reference)}
    loss_diff = grad_diff = 0.0
    loss_floor: float | None = 0.0
    grad_floor: float | None = 0.0
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    with member.context(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(compiled_model, backend="aot2onnx")
        for step in range(steps):
            args, target = member.data(step)
            losses = {}
            sides = [("eager", eager, eager), ("compiled", compiled, compiled_model)]
            for side, model, params in sides if step % 2 else sides[::-1]:
                losses[side], seconds = _step(model, opts[params], _copies(args), target, member.loss_fn)
                times[side].append(seconds)
            # optimizer.step() leaves .grad alone: these are this step's gradients.
            g_e, g_c = _grad_vector(eager), _grad_vector(compiled_model)
            loss_diff = max(loss_diff, abs(losses["compiled"] - losses["eager"]))
            grad_diff = max(grad_diff, float((g_c - g_e).abs().max()))
            if reference is not None:
                try:
                    loss64, _ = _step(reference, opts[reference], tuple(_float64(a) for a in args), _float64(target),
                                      member.loss_fn)
                except RuntimeError:  # e.g. transformers' grouped_mm takes no float64
                    reference, loss_floor, grad_floor = None, None, None
                    continue
                loss_floor = max(loss_floor, abs(losses["eager"] - loss64))
                grad_floor = max(grad_floor, float((g_e - _grad_vector(reference)).abs().max()))
        fallen = fallen_back_ops()
    eager_s, compiled_s = statistics.median(times["eager"][1:]), statistics.median(times["compiled"][1:])
    return {"member": member.name, "family": member.family, "loss_diff": loss_diff, "grad_diff": grad_diff,
            "loss_floor": loss_floor, "grad_floor": grad_floor, "eager_ms": eager_s * 1e3,
            "compiled_ms": compiled_s * 1e3, "ratio": compiled_s / eager_s, "fallbacks": sorted(fallen)}


def _copies(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def report_rows(members: list[Member], steps: int = 8) -> Iterator[dict[str, Any]]:
    for member in members:
        try:
            yield report_row(member, steps)
        except Exception as e:  # noqa: BLE001 - a row says what failed; the table goes on
            yield {"member": member.name, "family": member.family, "error": f"{type(e).__name__}: {e}"[:160]}


def _load() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The model zoo: eager against aot2onnx, side by side.")
    parser.add_argument("--report", action="store_true", help="print the markdown table")
    parser.add_argument("--steps", type=int, default=8, help="training steps per member (default 8)")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (ONNX Runtime follows)")
    parser.add_argument("members", nargs="*", help="member names (default: all)")
    args = parser.parse_args(argv)
    if not args.report:
        parser.print_help()
        return 0
    unknown = set(args.members) - set(_names)
    if unknown:
        parser.error(f"unknown members {sorted(unknown)}; the zoo has {_names}")
    if args.threads:
        torch.set_num_threads(args.threads)
    members = [m for m in MEMBERS if not args.members or m.name in args.members]
    print(f"{args.steps} SGD steps per member; {torch.get_num_threads()} torch threads; "
          f"{len(os.sched_getaffinity(0))} cores, load average {_load()} at the start\n")
    print("| member | family | max loss diff | max grad diff | eager fp32 vs fp64: loss, grad | step ms eager | "
          "step ms compiled | compiled/eager | fallen back to PyTorch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in report_rows(members, args.steps):
        if "error" in row:
            print(f"| {row['member']} | {row['family']} | {row['error']} | | | | | | |", flush=True)
            continue
        fallbacks = ", ".join(f"`{t}`" for t in row["fallbacks"]) or "none"
        floor = "n/a" if row["loss_floor"] is None else f"{row['loss_floor']:.1e}, {row['grad_floor']:.1e}"
        print(f"| {row['member']} | {row['family']} | {row['loss_diff']:.1e} | {row['grad_diff']:.1e} | "
              f"{floor} | {row['eager_ms']:.1f} | {row['compiled_ms']:.1f} | "
              f"{row['ratio']:.2f} | {fallbacks} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
