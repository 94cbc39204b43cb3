"""The example a device user copies runs end to end (export, torch-free fine-tuning, aot2onnx.load, generation)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

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
