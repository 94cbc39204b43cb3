"""The benchmark's models, each with its batch and loss, built the same way in every process.

torch only: the fresh-process worker loads this file by path (see ``worker.py``), and a process measuring eager
or inductor must not import aot2onnx, onnx or onnxruntime.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "MODELS", "Batch", "ModelSpec", "make_batch"]

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


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _mlp(width: int, layers: int) -> nn.Module:
    modules: list[nn.Module] = []
    for i in range(layers):
        modules.append(nn.Linear(width, width))
        if i < layers - 1:
            modules.append(nn.ReLU())
    return nn.Sequential(*modules)


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(64, 10),
    )


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    title: str
    build: Callable[[torch.Generator], Batch]
    in_suite: bool = True


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


_SPECS = (
    ModelSpec("mlp", "MLP: 4 x Linear(1024, 1024) + ReLU, batch 64, MSE", _build_mlp),
    ModelSpec("encoder", "TransformerEncoderLayer d=256, 4 heads, ff 1024, batch 8 x 128, dropout 0.0, MSE",
              _build_encoder(0.0)),
    ModelSpec("encoder-dropout", "TransformerEncoderLayer d=256, 4 heads, ff 1024, batch 8 x 128, dropout 0.1, MSE",
              _build_encoder(0.1)),
    ModelSpec("cnn", "CNN: 2 x (Conv3x3-BatchNorm-ReLU), max/avg pooling, Linear; batch 32 x 3x64x64, "
              "cross-entropy", _build_cnn),
    ModelSpec("gpt", "GPT LM: 4 layers, d=256, 4 heads, sequence 128, vocabulary 512, batch 8, cross-entropy",
              _build_gpt),
    ModelSpec("tiny", "tiny MLP: 2 x Linear(64, 64), batch 8, MSE (for tests)", _build_tiny, in_suite=False),
)
MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in _SPECS}
assert len(MODELS) == len(_SPECS), "model names must be unique"


def make_batch(name: str) -> Batch:
    """The model in its initial state and its batch: the same in every process for a given name."""
    torch.manual_seed(0)
    return MODELS[name].build(torch.Generator().manual_seed(0))
