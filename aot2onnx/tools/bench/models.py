"""The benchmark's models, each with its batch and loss, built the same way in every process.

torch only: the fresh-process worker loads this file by path (see ``worker.py``), and a process measuring eager
or inductor must not import aot2onnx, onnx or onnxruntime.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "MODELS", "SUITES", "TINY_BERT_CONFIG", "Batch", "ModelSpec", "TinyMobileNet", "make_batch"]

Batch = tuple[nn.Module, torch.Tensor, torch.Tensor, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]


# A copy of ``examples/tiny_gpt.py`` (its Block and TinyGPT with dropout 0): examples/ is not installed, and a
# definition in the package proper would make the worker import aot2onnx. tests/test_bench.py checks that the
# two build the same model.
class _Block(nn.Module):
    """A pre-norm causal attention block."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """A GPT-style language model: token and position embeddings, pre-norm causal attention blocks."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# The zoo's MobileNet (tests/zoo.py imports it from here): one definition for the zoo and the device suite.
class _SqueezeExcite(nn.Module):
    def __init__(self, channels: int, reduced: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, reduced, 1)
        self.expand = nn.Conv2d(reduced, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = F.adaptive_avg_pool2d(x, 1)
        return x * F.hardsigmoid(self.expand(F.relu(self.reduce(s))))


class _InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, expand: int, stride: int, se: bool) -> None:
        super().__init__()
        hidden = cin * expand
        self.residual = stride == 1 and cin == cout
        layers: list[nn.Module] = [nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.Hardswish()]
        # Depthwise: one 3x3 filter per channel (groups == channels).
        layers += [nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
                   nn.Hardswish()]
        if se:
            layers.append(_SqueezeExcite(hidden, max(8, hidden // 4)))
        layers += [nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return x + out if self.residual else out


class TinyMobileNet(nn.Module):
    """MobileNetV3-style: inverted residuals with depthwise convolutions, squeeze-excite, hardswish, ReLU6."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6())
        self.blocks = nn.Sequential(
            _InvertedResidual(16, 16, 2, 1, se=True),
            _InvertedResidual(16, 24, 3, 2, se=False),
            _InvertedResidual(24, 24, 3, 1, se=True),
        )
        self.head = nn.Sequential(nn.Conv2d(24, 64, 1, bias=False), nn.BatchNorm2d(64), nn.Hardswish())
        self.fc = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(self.blocks(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# The zoo's bert_seq_cls config (tests/zoo.py builds its member from this mapping too).
TINY_BERT_CONFIG: dict[str, Any] = {
    "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "max_position_embeddings": 32, "type_vocab_size": 2, "num_labels": 3, "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0, "classifier_dropout": 0.0,
}


class _Logits(nn.Module):
    """A Hugging Face model called as a user's training loop calls it, ``input_ids`` in, logits out."""

    def __init__(self, model: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.model = model
        self.kwargs = kwargs

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, **self.kwargs).logits


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _mlp(width: int, layers: int) -> nn.Module:
    modules: list[nn.Module] = []
    for i in range(layers):
        modules.append(nn.Linear(width, width))
        if i < layers - 1:
            modules.append(nn.ReLU())
    return nn.Sequential(*modules)


def _cnn(c1: int = 32, c2: int = 64) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, c1, 3, padding=1), nn.BatchNorm2d(c1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 3, padding=1), nn.BatchNorm2d(c2), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(c2, 10),
    )


# The suites, in the report's order: "main" the models the targets were first set on; "device" models at
# the sizes and batches a small device trains with (milliseconds a step, where per-step overheads weigh most).
SUITES = ("main", "device")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    title: str
    build: Callable[[torch.Generator], Batch]
    suite: str | None  # one of SUITES; None: in no suite (tests; --models names it)
    transformer: bool = False  # the targets against inductor on transformer models count it


def _build_mlp(g: torch.Generator) -> Batch:
    return _mlp(1024, 4), torch.randn(64, 1024, generator=g), torch.randn(64, 1024, generator=g), F.mse_loss


def _build_encoder(dropout: float) -> Callable[[torch.Generator], Batch]:
    def build(g: torch.Generator) -> Batch:
        layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, dropout=dropout,
                                           batch_first=True)
        return layer, torch.randn(8, 128, 256, generator=g), torch.randn(8, 128, 256, generator=g), F.mse_loss
    return build


def _build_cnn(g: torch.Generator) -> Batch:
    return _cnn(), torch.randn(32, 3, 64, 64, generator=g), torch.randint(0, 10, (32,), generator=g), F.cross_entropy


def _build_gpt(g: torch.Generator) -> Batch:
    model = GPT(vocab=512, dim=256, heads=4, layers=4, context=128)
    tokens = torch.randint(0, 512, (8, 129), generator=g)
    return model, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), _lm_loss


def _build_tiny(g: torch.Generator) -> Batch:
    return _mlp(64, 2), torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g), F.mse_loss


def _build_mlp_s(g: torch.Generator) -> Batch:
    return _mlp(512, 4), torch.randn(64, 512, generator=g), torch.randn(64, 512, generator=g), F.mse_loss


def _build_encoder_s(g: torch.Generator) -> Batch:
    layer = nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=512, dropout=0.0, batch_first=True)
    return layer, torch.randn(8, 64, 128, generator=g), torch.randn(8, 64, 128, generator=g), F.mse_loss


def _build_cnn_s(g: torch.Generator) -> Batch:
    return (_cnn(16, 32), torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g),
            F.cross_entropy)


def _build_gpt2_s(g: torch.Generator) -> Batch:
    import transformers  # here: models.py is imported where transformers is not installed

    config = transformers.GPT2Config(vocab_size=1024, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                                     eos_token_id=2)
    # transformers' default attention implementation (sdpa), as a user gets it.
    model = _Logits(transformers.GPT2LMHeadModel(config), use_cache=False)
    tokens = torch.randint(0, 1024, (4, 65), generator=g)
    return model, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), _lm_loss


def _build_gpt2(g: torch.Generator) -> Batch:
    import transformers

    # GPT-2 small's own configuration (124M parameters, vocabulary 50257), randomly initialised: nothing to fetch.
    config = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = _Logits(transformers.GPT2LMHeadModel(config), use_cache=False)
    tokens = torch.randint(0, config.vocab_size, (2, 129), generator=g)
    return model, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), _lm_loss


def _build_mobilenet_s(g: torch.Generator) -> Batch:
    return (TinyMobileNet(), torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g),
            F.cross_entropy)


def _build_bert_s(g: torch.Generator) -> Batch:
    import transformers

    config = transformers.BertConfig(**TINY_BERT_CONFIG)
    config._attn_implementation = "sdpa"  # as the zoo's bert_seq_cls
    model = _Logits(transformers.BertForSequenceClassification(config))
    ids = torch.randint(1, TINY_BERT_CONFIG["vocab_size"], (16, 32), generator=g)
    return model, ids, torch.randint(0, TINY_BERT_CONFIG["num_labels"], (16,), generator=g), F.cross_entropy


_SPECS = (
    ModelSpec("mlp", "MLP: 4 x Linear(1024, 1024) + ReLU, batch 64, MSE", _build_mlp, "main"),
    ModelSpec("encoder", "TransformerEncoderLayer d=256, 4 heads, ff 1024, batch 8 x 128, dropout 0.0, MSE",
              _build_encoder(0.0), "main", transformer=True),
    ModelSpec("encoder-dropout", "TransformerEncoderLayer d=256, 4 heads, ff 1024, batch 8 x 128, dropout 0.1, MSE",
              _build_encoder(0.1), "main", transformer=True),
    ModelSpec("cnn", "CNN: 2 x (Conv3x3-BatchNorm-ReLU), max/avg pooling, Linear; batch 32 x 3x64x64, "
              "cross-entropy", _build_cnn, "main"),
    ModelSpec("gpt", "GPT LM: 4 layers, d=256, 4 heads, sequence 128, vocabulary 512, batch 8, cross-entropy",
              _build_gpt, "main", transformer=True),
    ModelSpec("mlp-s", "MLP: 4 x Linear(512, 512) + ReLU, batch 64, MSE", _build_mlp_s, "device"),
    ModelSpec("encoder-s", "TransformerEncoderLayer d=128, 4 heads, ff 512, batch 8 x 64, dropout 0.0, MSE",
              _build_encoder_s, "device", transformer=True),
    ModelSpec("cnn-s", "CNN: Conv3x3(3->16)-BatchNorm-ReLU, max pooling, Conv3x3(16->32)-BatchNorm-ReLU, "
              "average pooling, Linear; batch 16 x 3x32x32, cross-entropy", _build_cnn_s, "device"),
    ModelSpec("gpt2-s", "Hugging Face GPT2LMHeadModel: 2 layers, d=64, 4 heads, sdpa attention, sequence 64, "
              "vocabulary 1024, batch 4, cross-entropy", _build_gpt2_s, "device", transformer=True),
    ModelSpec("mobilenet-s", "the zoo's TinyMobileNet (inverted residuals, depthwise convolutions, squeeze-excite, "
              "hardswish); batch 16 x 3x32x32, cross-entropy", _build_mobilenet_s, "device"),
    ModelSpec("bert-s", "Hugging Face BertForSequenceClassification, the zoo's bert_seq_cls config: 2 layers, "
              "d=32, 4 heads, sdpa attention, 3 labels; input_ids only, batch 16 x 32 tokens, vocabulary 96, "
              "cross-entropy", _build_bert_s, "device", transformer=True),
    ModelSpec("gpt2", "Hugging Face GPT2LMHeadModel, GPT-2 small's configuration (124M parameters, vocabulary "
              "50257), dropout 0, batch 2 x 128 tokens, cross-entropy (in no suite: --models gpt2)", _build_gpt2, None,
              transformer=True),
    ModelSpec("tiny", "tiny MLP: 2 x Linear(64, 64), batch 8, MSE (for tests)", _build_tiny, None),
)
MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in _SPECS}
assert len(MODELS) == len(_SPECS), "model names must be unique"
assert all(spec.suite in (*SUITES, None) for spec in _SPECS)


def make_batch(name: str) -> Batch:
    """The model in its initial state and its batch: the same in every process for a given name."""
    torch.manual_seed(0)
    return MODELS[name].build(torch.Generator().manual_seed(0))
