"""Learning-rate schedules and gradient clipping on the device: the learning rate (and AdamW's weight decay)
are inputs of optimizer.onnx, the schedule is data in the signature, and the trainer matches torch.optim with
torch.optim.lr_scheduler and clip_grad_norm_."""

from __future__ import annotations

import copy
import json

import numpy as np
import onnx
import pytest
import safetensors.numpy
import torch
import torch.nn as nn
import torch.nn.functional as F

import aot2onnx
from aot2onnx.artifact import edge
from aot2onnx.artifact.optim import AdamW, Constant, WarmupCosine, WarmupLinear

STEPS = 12


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, x, y):
        return F.mse_loss(self.net(x), y)


def _batches(generator):
    # Targets far from the outputs: the gradients are large, so clipping at 0.5 engages on most steps.
    return [(torch.randn(4, 8, generator=generator), 5 * torch.randn(4, 2, generator=generator)) for _ in range(STEPS)]


@pytest.mark.parametrize("schedule", [Constant(), WarmupLinear(3, STEPS), WarmupCosine(4, STEPS)], ids=repr)
def test_schedule_factors_are_lambdalr_s(schedule):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = schedule.torch(opt)
    for step in range(STEPS + 2):
        assert opt.param_groups[0]["lr"] == 0.5 * edge.lr_factor(schedule.to_json(), step)
        opt.step()
        scheduler.step()


CASES = {
    "sgd_linear_clipped": (lambda: aot2onnx.optim.SGD(0.1, momentum=0.9, schedule=WarmupLinear(3, STEPS),
                                                      max_grad_norm=0.5),
                           lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), WarmupLinear(3, STEPS), 0.5),
    "adamw_cosine": (lambda: AdamW(1e-2, weight_decay=0.1, schedule=WarmupCosine(4, STEPS)),
                     lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1), WarmupCosine(4, STEPS), None),
    "adamw_linear_clipped": (lambda: AdamW(1e-2, schedule=WarmupLinear(2, STEPS), max_grad_norm=1.0),
                             lambda p: torch.optim.AdamW(p, lr=1e-2), WarmupLinear(2, STEPS), 1.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_device_schedules_and_clips_like_torch(tmp_path, case):
    make, make_torch, schedule, max_norm = CASES[case]
    torch.manual_seed(0)
    model = Regressor()
    batches = _batches(torch.Generator().manual_seed(1))
    aot2onnx.export_training(copy.deepcopy(model), batches[0], tmp_path, optimizer=make())
    hyper = json.loads((tmp_path / "signature.json").read_text())["optimizer"]["hyperparameters"]
    assert hyper["schedule"] == schedule.to_json() and hyper["max_grad_norm"] == max_norm

    opt = make_torch(model.parameters())
    scheduler = schedule.torch(opt)
    # Half the steps, then the state saved and a new trainer on it: the schedule goes on from the saved step.
    trainer = edge.Trainer(tmp_path)
    for i, (x, y) in enumerate(batches):
        if i == STEPS // 2:
            trainer.save(tmp_path / "state.safetensors")
            trainer = edge.Trainer(tmp_path)
        assert trainer.hyperparameter("lr") == opt.param_groups[0]["lr"]
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        scheduler.step()
        assert trainer.step(x.numpy(), y.numpy()) == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    for name, value in model.state_dict().items():
        # AdamW divides by sqrt(v): where a gradient is near zero, float rounding in the clipping's norms
        # (ReduceL2 against torch's norm) moves a parameter by up to lr per step.
        np.testing.assert_allclose(trainer.state[name], value.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_format_1_artifact_still_reads(tmp_path):
    # /1: no lr or weight-decay inputs, no schedule. An artifact without an optimizer differs from /1 in the
    # format line only.
    aot2onnx.export_training(Regressor(), _batches(torch.Generator().manual_seed(0))[0], tmp_path)
    path = tmp_path / "signature.json"
    sig = json.loads(path.read_text())
    sig["format"] = "aot2onnx.training/1"
    path.write_text(json.dumps(sig))
    for model in ("forward.onnx", "backward.onnx"):
        proto = onnx.load(str(tmp_path / model))
        next(p for p in proto.metadata_props if p.key == edge.SIGNATURE_KEY).value = json.dumps(sig, sort_keys=True)
        onnx.save(proto, str(tmp_path / model))
    artifact = edge.open_artifact(tmp_path)
    assert artifact.signature["format"] == "aot2onnx.training/1"
    assert set(safetensors.numpy.load_file(str(tmp_path / "state.safetensors"))) == {e["name"] for e in sig["state"]}
    assert aot2onnx.load(tmp_path)(*(t for t in _batches(torch.Generator().manual_seed(0))[0])).item() > 0
