"""Probes of PyTorch where it differs between CPUs or torch releases: eager's kernels, its decompositions,
Dynamo and AOTAutograd (aot2onnx supports torch 2.11 to 2.14).

A test whose expectation depends on such a difference asks the torch at hand, not the CPU's name or torch's
version: ATEN_CPU_CAPABILITY, oneDNN's ISA limit or another build moves the kernel, and the probe moves with it.
What no probe can ask, the OpInfo database and the tables generated from it, belongs to the torch
requirements.lock pins (``on_locked_torch``).
"""

from __future__ import annotations

import functools
import pathlib
import re

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = [
    "LOCKED_TORCH",
    "aot_autograd_recompiles_for_new_floats",
    "clamp_ignores_a_nan_number",
    "cumprod_backward_takes_an_int64_relu",
    "dynamo_traces_quantile",
    "gelu_overflows",
    "on_locked_torch",
    "torch_before",
]

_LOCK = pathlib.Path(__file__).resolve().parents[1] / "requirements.lock"
LOCKED_TORCH = re.search(r"^torch==(\S+)$", _LOCK.read_text(), re.MULTILINE).group(1)


def on_locked_torch() -> bool:
    """Whether this is the torch release requirements.lock pins (its build label aside)."""
    return torch.__version__.split("+", 1)[0] == LOCKED_TORCH


def torch_before(release: str) -> bool:
    """Whether this torch is older than ``release``: only where no smaller probe shows the difference."""
    from packaging.version import Version

    return Version(torch.__version__.split("+", 1)[0]) < Version(release)


def gelu_overflows() -> bool:
    """gelu(3e38) is inf (ATen's vectorized kernel on AVX-512 CPUs; elsewhere 3e38, as aot2onnx gives).
    Three values: a single one takes ATen's scalar loop, which does not overflow."""
    return bool(torch.isinf(F.gelu(torch.tensor([3e38, 1.0, 1.0])))[0])


def clamp_ignores_a_nan_number() -> bool:
    """clamp(x, min=nan) and clamp(x, max=nan) are x (torch 2.11; a NaN tensor bound, or NaN as one of two
    bounds, gives NaN there too); torch 2.12 on gives NaN, as aot2onnx does."""
    return not bool(torch.clamp(torch.tensor([1.0]), min=float("nan")).isnan().all())


@functools.cache
def cumprod_backward_takes_an_int64_relu() -> bool:
    """cumprod's backward, decomposed as aot2onnx captures it, holds a Relu of int64 indices (torch 2.12 on;
    torch 2.11's decomposition has none), which ONNX Runtime runs only at opset 18."""
    from aot2onnx.capture import decomposition_table, lowerable_names
    from aot2onnx.lower.registry import default_registry

    def gradient(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(torch.cumprod(x, 0), x, g)

    table = decomposition_table(lowerable_names(default_registry(), 18))
    graph = make_fx(gradient, decomposition_table=table)(torch.randn(5, requires_grad=True), torch.randn(5)).graph
    relu = torch.ops.aten.relu.default
    return any(n.target is relu and n.meta["val"].dtype == torch.int64 for n in graph.nodes)


@functools.cache
def dynamo_traces_quantile() -> bool:
    """torch.quantile in one graph (torch 2.12 on; torch 2.11's Dynamo stops at it: "Data dependent operator")."""
    try:
        torch.compile(lambda x: torch.quantile(x, 0.5), backend="eager", fullgraph=True)(torch.ones(3))
    except Exception:  # Dynamo's Unsupported, whatever it is called in this release
        return False
    finally:
        torch._dynamo.reset()
    return True


@functools.cache
def aot_autograd_recompiles_for_new_floats() -> bool:
    """Whether a frame after a graph break at ``.item()`` that does Python arithmetic with the float is compiled
    again for each new value of it, with any AOTAutograd backend. torch 2.13 makes the float dynamic at its
    second value and compiles no more; torch 2.11's and 2.12's AOTAutograd guard on each value."""
    from torch._dynamo.utils import counters

    layer = torch.nn.Linear(2, 2)

    def scaled(x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(layer(x))
        scale = h.abs().max().item()
        return layer(h / (1.0 + scale))

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    compiled = torch.compile(scaled, backend="aot_eager")
    for value in (0.25, 0.5, 0.75, 1.0):
        compiled(torch.full((3, 2), value)).sum().backward()
    torch._dynamo.reset()
    return counters["stats"]["unique_graphs"] - before > 3  # the graph before the break, the one after it twice
