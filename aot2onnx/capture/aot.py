"""AOTAutograd with our graph compilers."""

from __future__ import annotations

import enum
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch._functorch.config
import torch.fx
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["GraphKind", "capture"]

PARTITIONERS = {"min_cut": min_cut_rematerialization_partition, "default": default_partition}


class GraphKind(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    INFERENCE = "inference"


# compile_graph(gm, example_inputs, kind, capture_seconds) -> boxed callable
GraphCompiler = Callable[[torch.fx.GraphModule, Sequence[Any], GraphKind, float], Callable]


def capture(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    compile_graph: GraphCompiler,
    decompositions: dict,
    partitioner: str = "min_cut",
) -> Callable:
    """Runs AOTAutograd on a Dynamo graph; ``compile_graph`` receives each graph it produces.

    AOTAutograd's runtime wrappers (the autograd.Function, the mutation epilogue, aliased-output
    regeneration, deduplication) wrap the callables ``compile_graph`` returns, which must follow the
    boxed calling convention.
    """
    start = time.perf_counter()

    def compiler(kind: GraphKind, graph: torch.fx.GraphModule, inputs: Sequence[Any]) -> Callable:
        # Forward and inference graphs come out of the joint trace: its time is the capture time. The
        # backward graph was partitioned in the same trace, so it reports no capture time of its own.
        seconds = 0.0 if kind is GraphKind.BACKWARD else time.perf_counter() - start
        return compile_graph(graph, inputs, kind, seconds)

    # Attention is traced through its math formulation, so that the backward graph holds matmul and
    # softmax gradients rather than the fused CPU kernel's backward, which has no ONNX equivalent.
    # AOTAutograd's common-subexpression pass on the joint graph is left out: ONNX Runtime's graph
    # optimizer eliminates common subexpressions in each model anyway, and the pass imports inductor's
    # pattern matcher and lowerings, which cost a process about 1.2 s and 40 MiB (measured here; the
    # benchmark's transformer layer partitions into the same graphs either way).
    with sdpa_kernel(SDPBackend.MATH), torch._functorch.config.patch(cse=False):
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=functools.partial(compiler, GraphKind.FORWARD),
            bw_compiler=functools.partial(compiler, GraphKind.BACKWARD),
            inference_compiler=functools.partial(compiler, GraphKind.INFERENCE),
            decompositions=decompositions,
            partition_fn=PARTITIONERS[partitioner],
        )
