"""The GPU benchmark's harness on the CPU: its profile of a step and the report's rows (the figures themselves
need a GPU, scripts/gpu_check.sh)."""

from __future__ import annotations

import torch

from aot2onnx.tools.bench import cuda as bench_cuda


def test_profile_and_report_rows(monkeypatch):
    monkeypatch.setattr(bench_cuda, "_device", torch.device("cpu"))
    model = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    calls = []

    def step() -> None:
        calls.append(1)
        model(x).sum().backward()

    profiled = bench_cuda.profile_steps(step, steps=2)
    assert len(calls) == 2
    assert profiled["wall_ms"] > 0
    # no CUDA here: no kernels, copies or waits counted
    assert profiled["kernels"] == 0 and profiled["copies"] == {} and profiled["waits"] == 0
    results = {"date": "d", "device": "CPU", "torch": torch.__version__, "onnxruntime": "o", "models": {
        "mlp": {"title": "t", "ms": {"eager/fp32": 2.0, "aot2onnx/fp32": 3.0}, "memory": {},
                "profile": {"aot2onnx/fp32": {**profiled, "kernels": 96, "busy_ms": 0.29, "copies": {"DtoH": 4}, "waits": 5},
                            "eager/fp32": {"error": "RuntimeError: no"}}}}}
    section = bench_cuda.render_section(results)
    assert "| mlp | fp32 | 2.00 | 3.00 (1.50) |" in section
    row = next(line for line in section.splitlines() if line.startswith("| mlp | aot2onnx/fp32 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == "96" and cells[5] == "0.29" and cells[6] == "4" and cells[9] == "5"
    assert "| mlp | eager/fp32 | failed: RuntimeError: no |" in section
