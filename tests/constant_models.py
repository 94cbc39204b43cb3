"""Models holding tensor constants, trained against eager in a process of their own (tests/test_constants.py).

Run as a script, it trains each model with ``assert_parity`` under the default options (the persistent
cache on, in ``$AOT2ONNX_CACHE_DIR``) and prints one JSON line per model: whether it matched eager, and
how many graphs were lowered and how many came from the cache. ``CONST_SCALE`` sets the value of one
model's constant, so that a later process can change it and must not be served the old one.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

SCALE = float(os.environ.get("CONST_SCALE", "2.0"))


class TensorConstant(nn.Module):
    """The issue's repro: a ``torch.tensor`` literal in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        return (self.l(x) * torch.tensor([SCALE, 1.0, 1.0, 1.0])).sum()


class Buffers(nn.Module):
    """Registered buffers that are not parameters, of several dtypes and shapes (0-d included)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(6, 6)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))
        self.register_buffer("offset", torch.tensor(0.25, dtype=torch.float64))
        self.register_buffer("order", torch.tensor([5, 4, 3, 2, 1, 0]))
        self.register_buffer("keep", torch.tensor([True, False, True, True, False, True]))
        self.register_buffer("table", torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) / 24)

    def forward(self, x):
        h = self.l(x) * self.scale + self.offset.to(x.dtype)
        h = h.index_select(1, self.order).masked_fill(~self.keep, 0.0)
        return h.square().mean() + (self.table.sum(0) @ self.table[0].T).trace() * h.mean()


class FullMasks(nn.Module):
    """``torch.full`` and integer ``torch.tensor`` constants built in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(5, 5)

    def forward(self, x):
        h = self.l(x)
        weights = torch.full((5,), 0.5).to(torch.float32)
        index = torch.tensor([[0, 2, 4], [1, 3, 0]])
        picked = torch.gather(h[:2], 1, index)
        return (h * weights).sum() + picked.sum() + torch.full((2, 3), -1, dtype=torch.int64).sum()


class CausalAttention(nn.Module):
    """A causal mask built at call time from the input's length."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        t = x.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5 + mask, dim=-1)
        keep = torch.ones(t, t, dtype=torch.bool).tril()
        return (attn.masked_fill(~keep, 0.0) @ v).square().mean()


class EmptyConstant(nn.Module):
    """An empty buffer and an empty literal taking part in the computation."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(3, 3)
        self.register_buffer("nothing", torch.zeros(0))

    def forward(self, x):
        h = torch.cat([self.l(x).flatten(), self.nothing, torch.tensor([])])
        return h.square().sum() + self.nothing.sum()


class TinyGPT(nn.Module):
    """A GPT-style decoder: a causal-mask buffer as Hugging Face's GPT-2 keeps it, a padding mask and the
    position ids built from constants, tied embedding and head."""

    def __init__(self, vocab: int = 32, d: int = 16, heads: int = 2, layers: int = 2, context: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"ln1": nn.LayerNorm(d), "qkv": nn.Linear(d, 3 * d), "proj": nn.Linear(d, d),
                           "ln2": nn.LayerNorm(d), "fc": nn.Linear(d, 4 * d), "out": nn.Linear(4 * d, d)})
            for _ in range(layers)
        )
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.register_buffer("bias", torch.tril(torch.ones(context, context, dtype=torch.bool)).view(1, 1, context, context))
        self.register_buffer("masked_bias", torch.tensor(-1e4))

    def forward(self, ids, targets):
        b, t = ids.shape
        pad = ids.eq(0)  # token 0 pads; its keys are masked out
        positions = torch.arange(t).unsqueeze(0)
        h = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            q, k, v = block["qkv"](block["ln1"](h)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
            allowed = self.bias[:, :, :t, :t] & ~pad[:, None, None, :]
            scores = torch.where(allowed, scores, self.masked_bias.to(scores.dtype))
            h = h + block["proj"]((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1))
            h = h + block["out"](F.gelu(block["fc"](block["ln2"](h))))
        logits = self.head(self.ln(h))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=0)


def _inputs(generator: torch.Generator) -> dict:
    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    ids = torch.randint(1, 32, (3, 8), generator=generator)
    ids[0, 6:] = 0
    return {
        "TensorConstant": (TensorConstant, [(randn(2, 4),)]),
        "Buffers": (Buffers, [(randn(3, 6),)]),
        "FullMasks": (FullMasks, [(randn(3, 5),)]),
        "CausalAttention": (CausalAttention, [(randn(2, 6, 8),), (randn(2, 6, 8),)]),
        "EmptyConstant": (EmptyConstant, [(randn(2, 3),)]),
        "TinyGPT": (TinyGPT, [(ids, torch.roll(ids, -1, 1))]),
    }


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lowered = self.hits = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.lowered += "(lowered)" in message
        self.hits += "(cache hit" in message


def main(names: list[str]) -> None:
    from aot2onnx.testing import assert_parity

    logger = logging.getLogger("aot2onnx")
    logger.setLevel(logging.INFO)
    models = _inputs(torch.Generator().manual_seed(0))
    for name in names or list(models):
        factory, batches = models[name]
        count = _Count()
        logger.addHandler(count)
        try:
            report = assert_parity(factory, batches, steps=3, rtol=1e-4, atol=1e-5)
            result = {"model": name, "ok": True, "ort_runs": report.ort_runs, "losses": report.compiled_losses}
        except Exception as e:  # reported to the test, which fails with the message
            result = {"model": name, "ok": False, "error": f"{type(e).__name__}: {e}"[-3000:]}
        finally:
            logger.removeHandler(count)
        result.update(lowered=count.lowered, cache_hits=count.hits)
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
