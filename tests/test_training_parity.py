"""Ten SGD steps, eager against torch.compile(backend="aot2onnx"), from the same state on the same data."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from aot2onnx.testing import assert_parity

RTOL, ATOL = 1e-4, 1e-5  # float32, as the acceptance criteria set them
STEPS = 10


def _batches(make, steps=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [make(g) for _ in range(steps)]


def _check(report, min_graphs=2):
    assert len(report.eager_losses) == STEPS
    assert len(report.graphs) >= min_graphs
    # Every graph ran on ONNX Runtime: forward once and backward once per step, plus the op check's call.
    for graph in report.graphs:
        assert graph.runs >= STEPS, graph
        assert graph.fx_node_count > 0 and graph.onnx_node_count > 0, graph
    assert report.torch_heavy_ops == []
    return report


def test_mlp():
    def model():
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                             nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))

    batches = _batches(lambda g: (torch.randn(16, 32, generator=g),))
    targets = _batches(lambda g: torch.randn(16, 8, generator=g), seed=2)
    report = assert_parity(model, batches, targets=targets, loss_fn=F.mse_loss, steps=STEPS, rtol=RTOL, atol=ATOL)
    _check(report)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_transformer_encoder_layer(norm_first):
    def model():
        return nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, dropout=0.0,
                                          batch_first=True, norm_first=norm_first)

    batches = _batches(lambda g: (torch.randn(4, 12, 64, generator=g),))
    report = assert_parity(model, batches, loss_fn=lambda out: out.pow(2).mean(), steps=STEPS, rtol=RTOL, atol=ATOL)
    _check(report)


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, groups=2, dilation=2),
            nn.GELU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def test_cnn_with_batchnorm():
    batches = _batches(lambda g: (torch.randn(8, 3, 32, 32, generator=g),))
    targets = _batches(lambda g: torch.randint(0, 10, (8,), generator=g), seed=2)
    report = assert_parity(SmallCNN, batches, targets=targets, loss_fn=F.cross_entropy, steps=STEPS,
                           rtol=RTOL, atol=ATOL)
    _check(report)
    # Parameters (grad at step 1 and final value), the BatchNorm running mean, variance and counter, the
    # losses and the input were all compared.
    assert report.compared == 2 * len(list(SmallCNN().parameters())) + 3 + STEPS + 1


class TokenModel(nn.Module):
    def __init__(self, vocab: int = 97, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return F.log_softmax(self.out(self.norm(self.embed(tokens))), dim=-1)


def test_embedding_layernorm_nll():
    batches = _batches(lambda g: (torch.randint(0, 97, (4, 16), generator=g),))
    targets = _batches(lambda g: torch.randint(0, 97, (4, 16), generator=g), seed=2)
    report = assert_parity(TokenModel, batches, targets=targets, steps=STEPS, rtol=RTOL, atol=ATOL,
                           loss_fn=lambda logp, y: F.nll_loss(logp.reshape(-1, logp.shape[-1]), y.reshape(-1)))
    _check(report)


def test_input_requires_grad():
    def model():
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))

    batches = _batches(lambda g: (torch.randn(8, 16, generator=g).requires_grad_(),))
    report = assert_parity(model, batches, loss_fn=lambda out: out.pow(2).mean(), steps=STEPS, rtol=RTOL, atol=ATOL)
    _check(report)
