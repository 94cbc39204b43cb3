"""ONNX Runtime's CUDA provider as aot2onnx runs it: torch's stream, torch's precision, one memory pool, and
graphs replayed as CUDA graphs.

- **Stream.** Sessions run on torch's current stream (``user_compute_stream``), so their kernels are ordered
  after the torch work that made the inputs and before the torch work that reads the outputs, with no sync.
- **Precision.** ONNX Runtime uses TF32 for MatMul, Gemm and Conv unless ``use_tf32=0``; torch keeps it off for
  matrix products unless asked. One switch covers both in ONNX Runtime, so a graph gets TF32 only where torch
  allows it for every family of op the graph has: ``torch.backends.cuda.matmul.allow_tf32`` for MatMul, Gemm
  and Einsum, ``torch.backends.cudnn.allow_tf32`` for convolutions and RNNs (:func:`tf32_allowed`). The
  settings are read again before each run, and a graph whose answer changed gets a new session.
- **Memory.** With ``cuda_memory="torch"`` (the default) ONNX Runtime allocates from torch's caching allocator
  (the CUDA provider's ``gpu_external_alloc``/``gpu_external_free``/``gpu_external_empty_cache``, as ORTModule
  did), so ``torch.cuda.memory_allocated`` counts its tensors and ``torch.cuda.empty_cache`` frees both. With
  ``"shared"`` every session of a device shares one ONNX Runtime arena that grows by what is asked, not by
  doubling. ``"session"`` leaves each session its own arena, as ONNX Runtime does. On an H100, GPT-2 small
  (fp32, AdamW) held 7.37 GiB with ``"torch"``, 8.26 with ``"shared"`` and 9.46 with ``"session"`` (eager 5.11),
  at the same step time within 5%. A session replayed as a CUDA graph keeps an arena of its own whatever the
  option says (:func:`session_memory`).
- **Algorithms.** ONNX Runtime picks a convolution's cuDNN algorithm by timing every one of them (its
  default, ``EXHAUSTIVE``); torch asks cuDNN's heuristics unless ``torch.backends.cudnn.benchmark`` is set, and
  so do aot2onnx's sessions (``HEURISTIC``): the same algorithm as eager where cuDNN's heuristics decide, and no
  timing at the first run. ``torch.use_deterministic_algorithms(True)`` or ``torch.backends.cudnn.deterministic``
  turns on ONNX Runtime's deterministic compute (:func:`algorithm_settings`).
- **No wait at the end of a run** (:func:`run_options`): ONNX Runtime synchronizes the device with the host at
  the end of every run unless told not to. Its outputs are read on the same stream, so the wait only kept the
  host from queueing the next work while the device computed: two waits a training step.
- **CUDA graphs** (:class:`GraphedRuns`): a graph with static shapes and no random ops is captured once and
  replayed, its inputs and outputs at fixed addresses.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import onnx
import onnxruntime as ort
import torch

from aot2onnx.options import Options
from aot2onnx.runtime.dtypes import ONNX_TO_TORCH
from aot2onnx.runtime.rewrites import model_nodes

__all__ = [
    "GraphedRuns", "StreamOrder", "algorithm_settings", "constant_outputs", "end_failed_capture", "foreach_copy", "graph_op_types",
    "precision_settings", "provider_options", "run_options", "session_memory", "tf32_allowed",
]

logger = logging.getLogger(__name__)

_CUBLAS_OPS = frozenset({"MatMul", "Gemm", "Einsum", "FusedMatMul", "MatMulInteger"})
_CUDNN_OPS = frozenset({"Conv", "ConvTranspose", "LSTM", "GRU", "RNN"})


def graph_op_types(model: onnx.ModelProto) -> frozenset[str]:
    """Every op type of ``model``: its graph, its functions and their subgraphs."""
    return frozenset(node.op_type for node in model_nodes(model))


def precision_settings() -> tuple[bool, bool]:
    """torch's TF32 switches now: (matrix products, cuDNN). ``torch.set_float32_matmul_precision("high")``
    and ``torch.backends.cuda.matmul.fp32_precision = "tf32"`` set the first."""
    return bool(torch.backends.cuda.matmul.allow_tf32), bool(torch.backends.cudnn.allow_tf32)


def algorithm_settings() -> tuple[bool, bool]:
    """torch's switches for how kernels are chosen, now: (``torch.backends.cudnn.benchmark``, deterministic:
    ``torch.backends.cudnn.deterministic`` or ``torch.use_deterministic_algorithms(True)``). ONNX Runtime's
    CUDA sessions follow them (:func:`provider_options`, ``runtime.session.session_options``)."""
    deterministic = bool(torch.backends.cudnn.deterministic) or torch.are_deterministic_algorithms_enabled()
    return bool(torch.backends.cudnn.benchmark), deterministic


def tf32_allowed(op_types: frozenset[str], settings: tuple[bool, bool] | None = None) -> bool:
    """Whether ONNX Runtime may use TF32 for a graph of these op types: only where torch allows it for every
    family of op in it (ONNX Runtime's one switch covers cuBLAS and cuDNN alike)."""
    matmul, cudnn = settings if settings is not None else precision_settings()
    families = []
    if op_types & _CUBLAS_OPS:
        families.append(matmul)
    if op_types & _CUDNN_OPS:
        families.append(cudnn)
    return bool(families) and all(families)


# ---------------------------------------------------------------------------------------------------------
# Memory


_arena_lock = threading.Lock()
_arenas: set[int] = set()


def _share_arena(index: int) -> None:
    """One ONNX Runtime arena on CUDA device ``index`` for every session there (``session.use_env_allocators``),
    growing by what is asked: separate arenas that double kept each session's peak at once."""
    with _arena_lock:
        if index in _arenas:
            return
        info = ort.OrtMemoryInfo("Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, index, ort.OrtMemType.DEFAULT)
        try:
            ort.create_and_register_allocator_v2(
                "CUDAExecutionProvider", info, {"device_id": str(index)}, ort.OrtArenaCfg({"arena_extend_strategy": 1})
            )
        except Exception as e:  # registered by the application already: share that one
            logger.debug("aot2onnx: using the CUDA allocator already registered with ONNX Runtime (%s)", e)
        _arenas.add(index)


_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_EMPTY = ctypes.CFUNCTYPE(None)
# The callbacks handed to ONNX Runtime, per (device, stream): kept alive for the process, as ONNX Runtime
# keeps their addresses.
_torch_allocators: dict[tuple[int, int], tuple[Any, Any, Any]] = {}


def _torch_allocator(index: int, stream: torch.cuda.Stream) -> dict[str, str]:
    key = (index, stream.cuda_stream)
    with _arena_lock:
        if key not in _torch_allocators:

            def alloc(size: int) -> int:
                return torch.cuda.caching_allocator_alloc(size, index, stream)

            def free(pointer: int) -> None:
                torch.cuda.caching_allocator_delete(pointer)

            def empty() -> None:
                torch.cuda.empty_cache()

            _torch_allocators[key] = (_ALLOC(alloc), _FREE(free), _EMPTY(empty))
    alloc_fn, free_fn, empty_fn = _torch_allocators[key]
    return {
        "gpu_external_alloc": str(ctypes.cast(alloc_fn, ctypes.c_void_p).value),
        "gpu_external_free": str(ctypes.cast(free_fn, ctypes.c_void_p).value),
        "gpu_external_empty_cache": str(ctypes.cast(empty_fn, ctypes.c_void_p).value),
    }


_preloaded = False


def _preload_cuda_libraries() -> None:
    """Points onnxruntime-gpu's CUDA provider at the CUDA and cuDNN libraries torch's wheel brought (it looks in
    the nvidia packages), once, before the first CUDA session: without them in the loader's path it fails to
    start. Nothing is loaded twice where torch has loaded them already."""
    global _preloaded
    with _arena_lock:
        if _preloaded:
            return
        _preloaded = True
    preload = getattr(ort, "preload_dlls", None)
    if preload is not None:
        try:
            preload()
        except Exception as e:  # a provider that finds its libraries itself still starts
            logger.debug("aot2onnx: onnxruntime.preload_dlls() failed: %s", e)


def provider_options(device: torch.device, options: Options, *, tf32: bool, cuda_graph: bool,
                     stream: torch.cuda.Stream | None = None) -> dict[str, str]:
    """The CUDA provider's options for a session of a graph on ``device``, running on ``stream`` (by default
    torch's current stream)."""
    _preload_cuda_libraries()
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = stream if stream is not None else torch.cuda.current_stream(index)
    settings = {"device_id": str(index), "user_compute_stream": str(stream.cuda_stream), "use_tf32": str(int(tf32))}
    benchmark, _ = algorithm_settings()
    settings["cudnn_conv_algo_search"] = "EXHAUSTIVE" if benchmark else "HEURISTIC"
    if cuda_graph:
        settings["enable_cuda_graph"] = "1"
        # Its own arena (session_memory), grown by what the capture asks, not by doubling: GPT-2 small held
        # 15.96 GiB replayed, 7.00 not (H200), of which torch's peak was 8.87 and 5.57.
        settings["arena_extend_strategy"] = "kSameAsRequested"
    memory = session_memory(options, cuda_graph)
    if memory == "torch":
        settings.update(_torch_allocator(index, stream))
    elif memory == "shared":
        settings["arena_extend_strategy"] = "kSameAsRequested"
        _share_arena(index)
    return settings


def run_options(**entries: str) -> ort.RunOptions:
    """RunOptions for a CUDA session's run (with ``entries`` added): without ONNX Runtime's wait for the device
    at the end of the run (``disable_synchronize_execution_providers``). What reads the outputs is ordered after
    the run on the device instead: torch's work on the session's stream, or on another stream through
    :class:`StreamOrder`; a value the host reads (a runtime check, a size) waits in torch's copy to the host.
    ONNX Runtime releases the host buffers its kernels used from a callback on the stream, not at the wait."""
    options = ort.RunOptions()
    options.add_run_config_entry("disable_synchronize_execution_providers", "1")
    for key, value in entries.items():
        options.add_run_config_entry(key, value)
    return options


class StreamOrder:
    """Orders a session's runs on its stream (a CUDA graph's own, or torch's current stream when the session
    was made) with torch's current stream at each run, where they differ: the session's stream waits for the
    work that made the inputs, and torch's current stream for the run's outputs (events on the device, no host
    wait)."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream) -> None:
        self.device, self.stream = device, stream

    def before_run(self) -> torch.cuda.Stream | None:
        """The current stream where it is not the session's (after ordering the session's after it), else None."""
        current = torch.cuda.current_stream(self.device)
        if current.cuda_stream == self.stream.cuda_stream:
            return None
        self.stream.wait_stream(current)
        return current

    def after_run(self, current: torch.cuda.Stream | None) -> None:
        """Orders ``current`` (:meth:`before_run`'s answer) after the run."""
        if current is not None:
            current.wait_stream(self.stream)


def session_memory(options: Options, cuda_graph: bool) -> str:
    """Where a CUDA session's tensors come from: ``options.cuda_memory``, except for a session replayed as a
    CUDA graph, which keeps an arena of its own. A replay writes its intermediate values where the capture
    put them, memory the capture's run gave back when it ended: in torch's pool, or in an arena other sessions
    share, that memory would be handed to other tensors (another graph's outputs, the activations a backward
    reads), which the next replay would write over."""
    return "session" if cuda_graph else options.cuda_memory


# ---------------------------------------------------------------------------------------------------------
# CUDA graphs

# One multi-tensor copy (a kernel for many tensors, where copy_ launches one per tensor), through the op's
# public name.
foreach_copy = torch.ops.aten._foreach_copy_.default

# Plain runs before the graph is captured: the first learns which inputs keep their memory from call to call
# (parameters, buffers), the second confirms it. ONNX Runtime makes its own warm-up run before capturing.
_WARMUP_CALLS = 2
# Captures of one graph, each after an input that kept its memory moved (it is copied from then on); past
# these the graph runs plainly.
_CAPTURES = 4


def graph_refusal(model: onnx.ModelProto, op_types: frozenset[str], random_ops: frozenset[str],
                  has_symint_inputs: bool) -> str | None:
    """Why ``model`` cannot run as a CUDA graph, or None."""
    if has_symint_inputs:
        return "it takes sizes as inputs"
    for value in (*model.graph.input, *model.graph.output):
        dims = value.type.tensor_type.shape.dim
        if not value.type.tensor_type.HasField("shape") or any(not d.HasField("dim_value") for d in dims):
            return f"{value.name!r} has a size known only at run time"
    if op_types & random_ops:
        # ONNX Runtime's random kernels advance their generator on the host: a replay repeats its numbers.
        return f"it draws random numbers ({', '.join(sorted(op_types & random_ops))}), which a replay would repeat"
    if op_types & {"If", "Loop", "Scan"}:
        return "it has control flow (If, Loop or Scan)"
    if op_types & {"NonZero", "Unique"}:
        return "an output size depends on the values (NonZero, Unique)"
    return None


def constant_outputs(model: onnx.ModelProto, random_ops: frozenset[str]) -> frozenset[str]:
    """The graph outputs whose values depend on no graph input's data: computed from constants and from the
    shapes of inputs alone (a graph to be captured has static shapes), like a lowering's runtime check of
    indices made by ``arange``. ONNX Runtime folds such an output into an initializer, and a run copies an
    initializer output into its bound buffer with a synchronization of the device, which a capture cannot
    hold (``operation not permitted when stream is capturing``); the runtime serves them from a plain run
    instead (:class:`GraphedRuns`). Sound rather than complete: a value counted as varying may still be folded
    by ONNX Runtime (the capture then fails and the graph runs plainly), but one counted as constant is."""
    varying = {i.name for i in model.graph.input} - {t.name for t in model.graph.initializer}
    for node in model.graph.node:  # in topological order, as ONNX requires
        standard = node.domain in ("", "ai.onnx")
        if standard and node.op_type in ("Shape", "Size"):
            continue  # the sizes of a static shape
        subgraphs = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
        if (node.op_type in random_ops or subgraphs or not standard
                or any(name in varying for name in node.input if name)):
            varying.update(name for name in node.output if name)
    return frozenset(o.name for o in model.graph.output if o.name not in varying)


_cudart_lib: Any = None


def _cudart() -> Any:
    """CUDA's runtime library as this process loaded it (torch's), through ctypes; None where not found."""
    global _cudart_lib
    if _cudart_lib is None:
        candidates = []
        try:
            with open("/proc/self/maps") as maps:
                candidates = sorted({line.split()[-1] for line in maps if "libcudart.so" in line.split()[-1]})
        except OSError:
            pass
        candidates += ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
        for name in candidates:
            try:
                _cudart_lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            _cudart_lib = False
    return _cudart_lib or None


def end_failed_capture(stream: torch.cuda.Stream) -> bool:
    """Ends a stream capture left open by a run that failed inside it (ONNX Runtime does not end it), so that
    the stream takes work again; True where the stream is out of capture mode now."""
    lib = _cudart()
    if lib is None:
        return False
    handle = ctypes.c_void_p(stream.cuda_stream)
    status = ctypes.c_int(0)
    if lib.cudaStreamIsCapturing(handle, ctypes.byref(status)) != 0:
        lib.cudaGetLastError()
        return False
    if status.value != 0:  # cudaStreamCaptureStatusActive or ...Invalidated
        graph = ctypes.c_void_p()
        lib.cudaStreamEndCapture(handle, ctypes.byref(graph))
        if graph.value:
            lib.cudaGraphDestroy(graph)
    lib.cudaGetLastError()  # the capture's error, not sticky: cleared for torch's next call
    return lib.cudaStreamIsCapturing(handle, ctypes.byref(status)) == 0 and status.value == 0


class GraphedRuns:
    """Runs of one session replayed as a CUDA graph (ONNX Runtime's ``enable_cuda_graph``).

    A replay reads and writes the addresses it was captured with. So after the warm-up calls, inputs whose
    memory stayed the same (parameters, buffers) are bound where they are, and held, so that the memory cannot
    be reused for another tensor; the others are copied, all in one multi-tensor copy, into buffers of the
    graph's. Outputs go to the graph's buffers and are copied out, again in one copy, into new tensors the
    caller owns; a written input gets its value copied in. An input that kept its memory until the capture and
    then arrives elsewhere is copied from then on, in a graph captured anew (ONNX Runtime's ``gpu_graph_id``);
    after ``_CAPTURES`` captures, or where an input's shape or dtype changed, the graph runs plainly, saying so
    once.

    The session runs on a stream of its own (a capture cannot be made on CUDA's legacy default stream, where
    torch's work runs unless told otherwise), which the session orders with torch's current stream
    (:class:`StreamOrder`): waits on the GPU, not on the host.
    """

    def __init__(self, name: str, model: onnx.ModelProto, input_names: Sequence[str], output_names: Sequence[str],
                 device: torch.device, *, constant: frozenset[str] = frozenset(),
                 host: frozenset[str] = frozenset()) -> None:
        self.name = name
        self.device = device
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        declared = {v.name: v for v in (*model.graph.input, *model.graph.output)}
        self._outputs = [
            ([d.dim_value for d in t.shape.dim], ONNX_TO_TORCH[t.elem_type])
            for t in (declared[n].type.tensor_type for n in output_names)
        ]
        # Outputs that are constants (constant_outputs): left out of the capture, served from a plain run's
        # values; those the host reads (``host``: the runtime checks' values) kept in host memory.
        self._constant = [i for i, n in enumerate(self.output_names) if n in constant]
        self._host = {i for i in self._constant if self.output_names[i] in host}
        self._remembered: dict[int, torch.Tensor] = {}
        self.calls = 0
        self.replays = 0
        self.captures = 0
        self.stopped: str | None = None  # why the graph runs plainly now
        self.capturing = False  # whether the next run under graph_run captures (its first after setup)
        self._seen: list[list[int]] = []  # the warm-up calls' input addresses
        self._forced: set[int] = set()  # inputs copied because they moved after a capture
        self._pinned: list[torch.Tensor | None] = []  # per input: the tensor bound where it is, or None (copied)
        self._buffers: list[torch.Tensor] = []  # per copied input, in order
        self._copied: list[int] = []  # positions of the copied inputs
        self._out: list[torch.Tensor] = []
        self.plain_run = run_options(gpu_graph_id="-1")
        self.graph_run = run_options()

    @property
    def ready(self) -> bool:
        return bool(self._pinned or self._copied or self._out) and self.stopped is None

    def warmup(self, args: Sequence[torch.Tensor]) -> bool:
        """Records a plain call's input addresses; True once the graph can be set up (:meth:`setup`)."""
        self.calls += 1
        self._seen.append([a.data_ptr() for a in args])
        return self.calls >= _WARMUP_CALLS and len(self._remembered) == len(self._constant)

    @property
    def remembers(self) -> bool:
        """Whether a plain run's outputs are wanted (:meth:`remember`)."""
        return len(self._remembered) < len(self._constant)

    def remember(self, results: Sequence[torch.Tensor]) -> None:
        """Keeps a plain run's values of the constant outputs (``results`` in ``output_names``' order)."""
        for i in self._constant:
            value = results[i]
            self._remembered[i] = value.to("cpu", copy=True) if i in self._host else value.clone()

    def setup(self, args: Sequence[torch.Tensor], bind_input: Callable, bind_output: Callable) -> None:
        """Binds every input and output at the address the graph will replay with, for a new capture."""
        self.captures += 1
        self.capturing = True  # until a run under this capture's id succeeds
        self.graph_run = run_options(gpu_graph_id=str(self.captures - 1))
        self._pinned, self._buffers, self._copied = [], [], []
        for position, (name, arg) in enumerate(zip(self.input_names, args)):
            stable = position not in self._forced and all(seen[position] == arg.data_ptr() for seen in self._seen)
            if stable and arg.is_contiguous():
                self._pinned.append(arg)
                bind_input(name, arg)
            else:
                buffer = torch.empty(arg.shape, dtype=arg.dtype, device=self.device)
                self._pinned.append(None)
                self._copied.append(position)
                self._buffers.append(buffer)
                bind_input(name, buffer)
        if not self._out:
            self._out = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in self._outputs]
        for i, (name, buffer) in enumerate(zip(self.output_names, self._out)):
            if i not in self._remembered:
                bind_output(name, buffer)

    def moved(self, args: Sequence[torch.Tensor]) -> tuple[list[int], bool]:
        """The inputs bound where they were that arrived at other memory (a replay would read the old), and
        whether any input arrived in another shape or dtype than the graph's (a copy would broadcast it)."""
        moved, changed = [], False
        for position, (pinned, arg) in enumerate(zip(self._pinned, args)):
            if pinned is not None:
                changed = changed or arg.shape != pinned.shape or arg.dtype != pinned.dtype
                if arg.data_ptr() != pinned.data_ptr():
                    moved.append(position)
        changed = changed or any(args[i].shape != b.shape or args[i].dtype != b.dtype
                                 for i, b in zip(self._copied, self._buffers))
        return moved, changed

    def recapture(self, moved: Sequence[int]) -> bool:
        """Copies the ``moved`` inputs from now on, in a graph to capture anew; False past ``_CAPTURES``."""
        if self.captures >= _CAPTURES:
            return False
        self._forced.update(moved)
        return True

    def stop(self, reason: str) -> None:
        self.stopped = reason
        self._pinned, self._buffers, self._copied, self._out = [], [], [], []
        logger.warning("aot2onnx: graph %s runs without a CUDA graph from now on: %s", self.name, reason)

    def copy_in(self, args: Sequence[torch.Tensor]) -> None:
        if self._copied:
            foreach_copy(self._buffers, [args[i] for i in self._copied])

    def copy_out(self, kept: range) -> list[torch.Tensor]:
        """The outputs of the last replay, in tensors of the caller's; those at the positions ``kept`` are the
        graph's own buffers, for the caller to copy at once (a written input's new value)."""
        self.replays += 1
        sources = [self._remembered.get(i, b) for i, b in enumerate(self._out)]
        results = [s if i in kept or i in self._host else torch.empty_like(s) for i, s in enumerate(sources)]
        fresh = [i for i in range(len(results)) if i not in kept and i not in self._host]
        if fresh:
            foreach_copy([results[i] for i in fresh], [sources[i] for i in fresh])
        return results

