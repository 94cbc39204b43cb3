"""The exported batch dimension: which sizes an artifact accepts, and training at sizes other than the example's."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import safetensors.numpy
import torch
import torch.nn as nn
import torch.nn.functional as F

import aot2onnx
from aot2onnx.artifact import edge


class SmallCNN(nn.Module):
    def __init__(self, channels: int, batch_norm: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, channels, 3), nn.BatchNorm2d(channels) if batch_norm else nn.Identity(), nn.ReLU(),
            nn.MaxPool2d(2), nn.Conv2d(channels, 2 * channels, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(2 * channels, 3),
        )

    def forward(self, x, y):
        return F.cross_entropy(self.body(x), y)


def _batch(size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, 3, 12, 12, generator=generator), torch.randint(0, 3, (size,), generator=generator)


@pytest.mark.parametrize("example_batch", [4, 20])
@pytest.mark.parametrize("channels,batch_norm", [(16, True), (32, False)])
def test_convolutional_models_train_at_any_batch_size(tmp_path, example_batch, channels, batch_norm):
    # FakeTensor's convolution once guarded the batch against oneDNN's threshold of 16: an example batch below
    # 16 gave an artifact for [2, 15], one of 16 or more [16, inf).
    torch.manual_seed(0)
    model = SmallCNN(channels, batch_norm)
    generator = torch.Generator().manual_seed(1)
    aot2onnx.export_training(copy.deepcopy(model), _batch(example_batch, generator), tmp_path,
                             optimizer=aot2onnx.optim.SGD(0.05, momentum=0.9))
    dims = json.loads((tmp_path / "signature.json").read_text())["dims"]["batch"]
    assert (dims["min"], dims["max"]) == (1, None)

    batches = [_batch(size, generator) for size in (3, 17, 1, 33)]
    eager = copy.deepcopy(model)
    opt = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    trainer = edge.Trainer(tmp_path)
    for x, y in batches:
        loss = eager(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert trainer.step(x.numpy(), y.numpy()) == pytest.approx(loss.item(), rel=1e-4, abs=1e-5)
    trainer.save(tmp_path / "state.safetensors")
    state = safetensors.numpy.load_file(str(tmp_path / "state.safetensors"))
    for name, value in eager.state_dict().items():
        np.testing.assert_allclose(state[name], value.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


class BatchNormOverFeatures(nn.Module):
    """Training BatchNorm1d on [batch, features]: eager refuses a batch of 1 ("more than 1 value per channel")."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x, y):
        return F.cross_entropy(self.body(x), y)


def test_a_batch_of_one_is_refused_where_eager_refuses_it(tmp_path):
    model = BatchNormOverFeatures()
    x, y = torch.randn(4, 6), torch.randint(0, 2, (4,))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        model(x[:1], y[:1])
    aot2onnx.export_training(model, (x, y), tmp_path, optimizer=aot2onnx.optim.SGD(0.1))
    assert json.loads((tmp_path / "signature.json").read_text())["dims"]["batch"]["min"] == 2
    with pytest.raises(ValueError, match=r"dim 'batch' is 1, outside the exported range \[2, None\]"):
        edge.Trainer(tmp_path).step(x[:1].numpy(), y[:1].numpy())


def test_a_trace_that_depends_on_the_batch_not_being_one_says_so(tmp_path):
    class SqueezesTheBatch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 1)

        def forward(self, x):
            # squeeze drops the batch dim only when it is 1: the graph traced at 4 keeps it, so it is wrong at 1.
            return self.linear(x).squeeze().square().sum()

    aot2onnx.export_training(SqueezesTheBatch(), (torch.randn(4, 3),), tmp_path)
    assert json.loads((tmp_path / "signature.json").read_text())["dims"]["batch"]["min"] == 2
