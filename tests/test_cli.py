"""The command lines refuse bad arguments with one clear line, before any work is done."""

from __future__ import annotations

import os
import textwrap

import numpy as np
import pytest

from aot2onnx.__main__ import main as aot2onnx_main
from aot2onnx.artifact import edge

_FACTORY_CALLS = "FACTORY_CALLS"


@pytest.fixture
def models(tmp_path, monkeypatch):
    (tmp_path / "cli_models.py").write_text(textwrap.dedent(f"""
        import os
        import torch.nn as nn
        import torch.nn.functional as F

        class Regressor(nn.Module):
            def __init__(self):
                super().__init__()
                self.net = nn.Linear(4, 1)

            def forward(self, features, target):
                return F.mse_loss(self.net(features), target)

        def make():
            os.environ["{_FACTORY_CALLS}"] = str(int(os.environ.get("{_FACTORY_CALLS}", "0")) + 1)
            return Regressor()
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(_FACTORY_CALLS, "0")
    np.savez(tmp_path / "example.npz", features=np.zeros((4, 4), np.float32), target=np.zeros((4, 1), np.float32))
    return tmp_path


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--optimizer", "sgd", "--lr", "-1"], "SGD needs lr, momentum and weight_decay >= 0"),
        (["--optimizer", "adamw", "--lr", "1e-3", "--betas", "1.5", "0.9"], "AdamW needs two betas in [0, 1)"),
        (["--opset", "30"], "opset 30 cannot be targeted"),
        (["--opset", "17"], "opset must be >= 18"),
    ],
)
def test_export_refuses_bad_arguments_before_building_the_model(models, capsys, extra, message):
    code = aot2onnx_main(["export", "cli_models:make", "--example-inputs", str(models / "example.npz"),
                          "--out", str(models / "artifact"), *extra])
    err = capsys.readouterr().err
    assert code == 1 and f"aot2onnx export: error: {message}" in err and "Traceback" not in err
    assert os.environ[_FACTORY_CALLS] == "0"
    assert not (models / "artifact").exists()


@pytest.fixture
def artifact(models):
    out = models / "artifact"
    assert aot2onnx_main(["export", "cli_models:make", "--example-inputs", str(models / "example.npz"),
                          "--out", str(out), "--optimizer", "sgd", "--lr", "0.1", "--quiet"]) == 0
    np.savez(models / "batches.npz", features=np.ones((2, 3, 4), np.float32), target=np.ones((2, 3, 1), np.float32))
    return out


def test_edge_refuses_zero_steps(artifact, capsys):
    with pytest.raises(SystemExit) as info:
        edge.main([str(artifact), "--data", str(artifact.parent / "batches.npz"), "--steps", "0",
                   "--out", str(artifact.parent / "state.safetensors")])
    assert info.value.code == 2 and "--steps must be at least 1, got 0" in capsys.readouterr().err
    assert not (artifact.parent / "state.safetensors").exists()


@pytest.mark.parametrize("where", ["missing directory", "a directory", "read-only directory"])
def test_edge_refuses_an_unwritable_out_before_training(artifact, capsys, where):
    root = artifact.parent
    if where == "missing directory":
        out = root / "no" / "such" / "state.safetensors"
    elif where == "a directory":
        out = root
    else:
        locked = root / "locked"
        locked.mkdir(mode=0o500)
        out = locked / "state.safetensors"
        if os.access(locked, os.W_OK):  # root ignores the mode: make it a file's child instead
            (root / "plain").write_text("")
            out = root / "plain" / "state.safetensors"
    code = edge.main([str(artifact), "--data", str(root / "batches.npz"), "--steps", "3", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 1 and "error: --out" in captured.err
    assert "step 1 loss" not in captured.out  # refused before the first step


def test_edge_trains_and_writes_with_good_arguments(artifact, capsys):
    out = artifact.parent / "state.safetensors"
    code = edge.main([str(artifact), "--data", str(artifact.parent / "batches.npz"), "--steps", "2", "--out", str(out)])
    assert code == 0 and out.is_file() and "step 2 loss" in capsys.readouterr().out
