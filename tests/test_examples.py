"""The examples a user copies run end to end: export, torch-free fine-tuning, aot2onnx.load and generation; training
a Hugging Face model with transformers.Trainer."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).parents[1] / "examples"


def test_export_and_train_on_device_example(tmp_path):
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "export_and_train_on_device.py"), "--steps", "12", "--batch", "4",
         "--out", str(tmp_path / "artifact")],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"step \d+ loss ([0-9.]+)", run.stdout)]
    assert len(losses) >= 2 and all(0 < loss < 10 for loss in losses)
    sample = re.search(r"greedy sample after training: '(.*)'", run.stdout)
    assert sample and sample.group(1).startswith("Alice ") and len(sample.group(1)) == len("Alice ") + 60
    assert (tmp_path / "artifact" / "trained.safetensors").is_file()


@pytest.mark.slow  # 26-93 s on 2 cores; tests/test_hf_trainer.py checks the same path against eager in the default run
def test_train_with_hf_trainer_example():
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_with_hf_trainer.py"), "--steps", "8"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    aot2onnx_losses, eager_losses = (
        [float(x) for x in line.split()] for line in re.findall(r"logged losses: (.*)", run.stdout)
    )
    assert len(aot2onnx_losses) == len(eager_losses) == 8
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(aot2onnx_losses, eager_losses))
    worst = float(re.search(r"largest relative difference of a logged loss from eager: (\S+)", run.stdout).group(1))
    assert worst <= 1e-4
