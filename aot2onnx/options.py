"""Backend options: one frozen dataclass, validated once, shared by every stage."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["BASE_OPSET", "DEFAULT_OPSET", "Options", "CUDA_MEMORY", "GRAPH_OPTIMIZATION_LEVELS", "PARTITIONERS"]

GRAPH_OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "layout", "all")
PARTITIONERS = ("min_cut", "default")
CUDA_MEMORY = ("session", "shared", "torch")

# The opset every model is built at, the one torch_lib's rules are written against: rules are chosen at it
# (``lower/plan.py``), and a higher target is reached with the version converter after lowering. The one
# copy of this number: the runtime's kernel probes, coverage and the lowering read it from here.
BASE_OPSET = 18
# The opset models target unless the options say another.
DEFAULT_OPSET = BASE_OPSET


@dataclasses.dataclass(frozen=True)
class Options:
    """How aot2onnx compiles and runs graphs.

    Attributes:
        providers: ONNX Runtime execution providers, in priority order. ``None`` picks them from the
            inputs' device: ``CPUExecutionProvider`` for CPU tensors, ``CUDAExecutionProvider`` for CUDA.
        opset: The ONNX opset the models target: 18 (the default), or a newer one at which the installed
            ONNX Runtime runs every op it runs at 18 (``aot2onnx.runtime.kernels.newest_runnable_opset``).
        intra_op_num_threads: ONNX Runtime's intra-op thread count; 0 means ``torch.get_num_threads()``,
            so ONNX Runtime and torch share the same cores the same way, or one thread for a CPU graph
            that runs faster on one: measured on the graph's first calls (``runtime/session.py``,
            "Threads per graph").
        inter_op_num_threads: ONNX Runtime's inter-op thread count.
        graph_optimization_level: One of ``disable``, ``basic``, ``extended``, ``layout``, ``all``.
        allow_spinning: Whether ONNX Runtime's idle intra-op threads spin waiting for the next operator.
            ``False``: they sleep, and each operator wakes them. ``"run"``: they spin while a run is going and
            stop when it returns (ONNX Runtime's ``session.force_spinning_stop``), so they never hold the cores
            while torch runs the epilogue and the optimizer between runs. ``True``: they spin after runs too.
        partitioner: ``min_cut`` (AOTAutograd's rematerialising min-cut partitioner) or ``default``
            (save every intermediate the backward needs).
        dump_dir: Where every lowered model is written; defaults to ``$AOT2ONNX_DUMP_DIR``.
        check_model: Run ``onnx.checker`` on every lowered model before creating its session.
        fallback: What to do with FX nodes that have no lowering. ``True``: they run in PyTorch, the rest
            of their graph on ONNX Runtime, and a warning names them once per graph. ``False``:
            compilation fails with an ``UnsupportedOpError`` listing every such op.
        cache: Keep lowered models in the persistent on-disk cache (see ``aot2onnx.compile.cache``).
        cache_dir: Where; ``None`` means ``$AOT2ONNX_CACHE_DIR`` or the user cache directory
            (``~/.cache/aot2onnx``). ``AOT2ONNX_CACHE_DIR=off`` turns the cache off.
        fused_kernels: On the CPU, lower the ops aot2onnx has fused kernels for (ATen's own kernels as ONNX
            Runtime custom ops, ``runtime/fused.py``: activation, softmax and normalization gradients, softmax,
            log-softmax, layer and batch norm, an embedding's gradient) to those kernels, and run the graphs'
            ``Where`` nodes by the kernels' select, where set-up built them. ``False`` keeps every graph to
            standard ONNX operators (exports always are).
        cuda_graphs: On CUDA, replay each graph with static shapes and no random ops as a CUDA graph
            (``runtime/cuda.py``); a graph that cannot be captured runs plainly and says why once. Off by
            default for its memory (an arena of each replayed session's own, fixed output buffers): on an H200,
            GPT d256's step was 0.73x eager's with it and 2.20x without, GPT-2 small held 15.96 GiB against 7.00.
        cuda_memory: Where ONNX Runtime's CUDA tensors come from: ``"torch"`` (the default), torch's caching
            allocator (one pool, counted by ``torch.cuda.memory_allocated``: the least device memory on the
            H100, at the same speed); ``"shared"``, one ONNX Runtime arena per device shared by every session;
            ``"session"``, an arena of each session's own (ONNX Runtime's default). A session replayed as a
            CUDA graph keeps an arena of its own whatever this says.
    """

    providers: tuple[str, ...] | None = None
    opset: int = DEFAULT_OPSET
    intra_op_num_threads: int = 0
    inter_op_num_threads: int = 1
    graph_optimization_level: str = "all"
    allow_spinning: bool | str = False
    partitioner: str = "min_cut"
    dump_dir: str | None = None
    check_model: bool = True
    fallback: bool = True
    cache: bool = True
    cache_dir: str | None = None
    fused_kernels: bool = True
    cuda_graphs: bool = False
    cuda_memory: str = "torch"

    def __post_init__(self) -> None:
        if self.providers is not None:
            if isinstance(self.providers, str) or not isinstance(self.providers, Sequence):
                raise TypeError(f"providers must be a sequence of provider names, got {self.providers!r}")
            object.__setattr__(self, "providers", tuple(self.providers))
        if self.opset != DEFAULT_OPSET:
            from aot2onnx.runtime.kernels import check_target_opset

            check_target_opset(self.opset)  # one the installed ONNX Runtime runs every kernel of
        if self.graph_optimization_level not in GRAPH_OPTIMIZATION_LEVELS:
            raise ValueError(
                f"graph_optimization_level must be one of {GRAPH_OPTIMIZATION_LEVELS}, "
                f"got {self.graph_optimization_level!r}"
            )
        if self.partitioner not in PARTITIONERS:
            raise ValueError(f"partitioner must be one of {PARTITIONERS}, got {self.partitioner!r}")
        if self.cuda_memory not in CUDA_MEMORY:
            raise ValueError(f"cuda_memory must be one of {CUDA_MEMORY}, got {self.cuda_memory!r}")
        if self.allow_spinning not in (False, True, "run"):
            raise ValueError(f"allow_spinning must be False, True or \"run\", got {self.allow_spinning!r}")
        if self.intra_op_num_threads < 0 or self.inter_op_num_threads < 0:
            raise ValueError("thread counts must be >= 0")
        if self.dump_dir is None and os.environ.get("AOT2ONNX_DUMP_DIR"):
            object.__setattr__(self, "dump_dir", os.environ["AOT2ONNX_DUMP_DIR"])

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None) -> Options:
        """Builds options from ``torch.compile(..., options={...})``, rejecting unknown keys."""
        options = dict(options or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown aot2onnx option(s) {unknown}; known options: {sorted(known)}")
        return cls(**options)
