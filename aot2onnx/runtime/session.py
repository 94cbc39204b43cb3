"""One ONNX Runtime session per compiled graph, fed through IO binding without copies."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import re
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import onnx
import onnxruntime as ort
import torch
from torch.utils.dlpack import from_dlpack as _from_capsule

from aot2onnx.errors import RuntimeSessionError, source_line
from aot2onnx.options import Options
from aot2onnx.runtime import cuda, fused, native_run
from aot2onnx.runtime._ort_compat import c_binding, c_device, c_run_with_iobinding, c_run_with_ortvaluevector
from aot2onnx.runtime.dtypes import TORCH_TO_ONNX
from aot2onnx.runtime.inplace import writable_in_place
from aot2onnx.runtime.nchwc import DOMAIN as NCHWC
from aot2onnx.runtime.nchwc import rewrite_convolutions
from aot2onnx.runtime.one_call import OneCallRun, view_outputs, with_shape
from aot2onnx.runtime.one_call import refusal as one_call_refusal
from aot2onnx.runtime.precision import compute_in_float
from aot2onnx.runtime.rewrites import (
    disabled_optimizers,
    fused_elementwise,
    fused_scatter_scales,
    fused_selects,
    fused_transposes,
    model_nodes,
    serial_nodes,
    split_channel_reductions,
    standard_products,
)
from aot2onnx.signature import (
    CHECK_LINALG,
    CHECK_NEGATIVE_INDEX,
    FUSED_DOMAIN,
    RANDOM_OPS,
    GraphKind,
    GraphSignature,
    InputKind,
    OutputKind,
)

logger = logging.getLogger(__name__)

__all__ = [
    "GraphCall",
    "OrtGraph",
    "Profile",
    "compiled_graphs",
    "profiling",
    "providers_for",
    "as_real_pairs",
    "from_real_pairs",
    "reset_compiled_graphs",
    "session_options",
]

_OPT_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "layout": getattr(ort.GraphOptimizationLevel, "ORT_ENABLE_LAYOUT", ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED),
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}

_registry_lock = threading.Lock()
_COMPILED: list[weakref.ref[OrtGraph]] = []


def compiled_graphs() -> list[OrtGraph]:
    """Every graph compiled in this process (since the last reset) that is still alive."""
    with _registry_lock:
        return [g for ref in _COMPILED if (g := ref()) is not None]


def reset_compiled_graphs() -> None:
    with _registry_lock:
        _COMPILED.clear()


@dataclasses.dataclass(frozen=True)
class GraphCall:
    """One call of a compiled graph, timed by :func:`profiling`."""

    graph: str  # the OrtGraph's name
    kind: GraphKind
    call_s: float  # the whole call: binding the inputs, ONNX Runtime's run, the outputs through DLPack
    run_s: float | None  # inside ONNX Runtime's run; None for a graph with no session (nothing to compute)


@dataclasses.dataclass
class Profile:
    """What one :func:`profiling` block recorded: every compiled-graph call made in it, in order."""

    ort_profile_prefix: str | None = None
    calls: list[GraphCall] = dataclasses.field(default_factory=list)


# The open profiling() block, if any. OrtGraph.__call__ reads it once per call: off, that check is all
# profiling costs.
_profile: Profile | None = None


@contextlib.contextmanager
def profiling(ort_profile_prefix: str | None = None) -> Iterator[Profile]:
    """Times every compiled-graph call made inside the block, in any thread, and records it in the Profile.

    With ``ort_profile_prefix``, sessions created inside the block also run with ONNX Runtime's profiler on
    and write its JSON trace to a file named from that prefix (``session.end_profiling()`` ends it and returns
    the file's path); sessions created outside keep it off. A nested block records into itself only, and the
    enclosing block resumes when it ends. The benchmark's breakdown of a step (``python -m aot2onnx bench``)
    is measured this way::

        with profiling() as profile:
            train_step()
        seconds_in_onnx_runtime = sum(c.run_s or 0.0 for c in profile.calls)
    """
    global _profile
    outer, _profile = _profile, Profile(ort_profile_prefix)
    try:
        yield _profile
    finally:
        _profile = outer


_arena_lock = threading.Lock()
_arena_registered = False


def _share_cpu_arena() -> None:
    """Registers one CPU arena allocator in ONNX Runtime's environment, for every session to share.

    Each session otherwise keeps an arena of its own that never shrinks, so a training step holds the
    forward's and the backward's peaks at once. Measured here with one arena (peak RSS, fresh process):
    GPT 751 -> 697 MiB, CNN 710 -> 626, transformer layer 518 -> 492; step time unchanged.
    """
    global _arena_registered
    with _arena_lock:
        if _arena_registered:
            return
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        try:
            ort.create_and_register_allocator(info, ort.OrtArenaCfg({}))
        except Exception as e:  # one is registered already (by the application): share that one
            logger.debug("aot2onnx: using the CPU allocator already registered with ONNX Runtime (%s)", e)
        _arena_registered = True


def uses_fused_kernels(model: onnx.ModelProto) -> bool:
    """Whether ``model`` has nodes of aot2onnx's fused kernels (``runtime/fused.py``)."""
    return any(o.domain == FUSED_DOMAIN for o in model.opset_import)


def session_options(options: Options, intra_op_threads: int | None = None, *,
                    fused_kernels: bool = False, env_allocators: bool = True,
                    deterministic: bool = False) -> ort.SessionOptions:
    """A session's options; with the library of aot2onnx's fused kernels for a model that has their ops.
    ``env_allocators``: the session takes its memory from the arenas registered with ONNX Runtime's environment
    (the CPU arena all CPU sessions share; the CUDA one of ``cuda_memory="shared"``). ``deterministic``:
    ONNX Runtime's deterministic compute (a CUDA session where torch asks for deterministic algorithms)."""
    so = ort.SessionOptions()
    so.use_deterministic_compute = deterministic
    if fused_kernels:
        path = fused.library()
        if path is None:
            raise RuntimeSessionError(f"the model uses aot2onnx's fused kernels, which this process lacks: "
                                      f"{fused.missing_reason()}")
        so.register_custom_ops_library(path)
    so.intra_op_num_threads = intra_op_threads or options.intra_op_num_threads or torch.get_num_threads()
    so.inter_op_num_threads = options.inter_op_num_threads
    so.graph_optimization_level = _OPT_LEVELS[options.graph_optimization_level]
    spinning = "1" if options.allow_spinning else "0"
    so.add_session_config_entry("session.intra_op.allow_spinning", spinning)
    so.add_session_config_entry("session.inter_op.allow_spinning", spinning)
    if options.allow_spinning == "run":
        # The pool's threads spin between a run's operators and stop when the run returns.
        so.add_session_config_entry("session.force_spinning_stop", "1")
    if env_allocators:
        _share_cpu_arena()
        so.add_session_config_entry("session.use_env_allocators", "1")
    # No memory pattern: with one, a session takes one block sized for its planned peak on every run, on top
    # of the shared arena's free chunks. Measured here without it (fresh process, warm cache): peak RSS GPT
    # 639-653 -> 582 MiB, CNN 579-627 -> 555, transformer layer 443-447 -> 432; step time the same within
    # noise (off/on, median of 8 alternating rounds: MLP 0.94, transformer layer 1.01, CNN 0.97, GPT 0.99).
    so.enable_mem_pattern = False
    if _profile is not None and _profile.ort_profile_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = _profile.ort_profile_prefix
    return so


def providers_for(
    device: torch.device, options: Options, cuda_options: dict[str, str] | None = None
) -> list[str | tuple[str, dict[str, str]]]:
    """The execution providers for tensors on ``device``, unless the options name them; ``cuda_options`` are the
    CUDA provider's (``runtime.cuda.provider_options``: torch's stream, TF32 as torch allows it, memory)."""
    available = ort.get_available_providers()
    if options.providers is not None:
        missing = [p for p in options.providers if p not in available]
        if missing:
            raise RuntimeSessionError(
                f"execution provider(s) {missing} are not available in this onnxruntime build "
                f"(available: {available})"
            )
        return list(options.providers)
    if device.type == "cpu":
        return ["CPUExecutionProvider"]
    if device.type == "cuda":
        if "CUDAExecutionProvider" not in available:
            raise RuntimeSessionError(
                "the inputs are CUDA tensors but this onnxruntime has no CUDAExecutionProvider "
                f"(available: {available}); install the onnxruntime-gpu package in place of onnxruntime"
            )
        if cuda_options is None:
            cuda_options = cuda.provider_options(device, options, tf32=False, cuda_graph=False)
        return [("CUDAExecutionProvider", cuda_options), "CPUExecutionProvider"]
    raise RuntimeSessionError(f"aot2onnx runs CPU and CUDA tensors; got a tensor on {device}")


_MISSING_KERNEL = re.compile(r"Could not find an implementation for (\w+)\((\d+)\) node with name '([^']*)'")


def _output_plan(signature: GraphSignature) -> tuple[list[Any], list[int]] | None:
    """How a call's outputs are picked, with no Python per output, from the list ``[*results, *constants, *args]``
    (the run's returned outputs, the constants returned, the call's inputs): (constants, a position in that list
    per output). None where an output needs work of its own (a complex tensor's real pairs, a size's int)."""
    results = sum(spec.kind is OutputKind.TENSOR for spec in signature.outputs)
    constants = [spec.value for spec in signature.outputs if spec.kind is OutputKind.CONSTANT]
    positions: list[int] = []
    result = constant = 0
    for spec in signature.outputs:
        if spec.kind is OutputKind.TENSOR and not spec.is_complex:
            positions.append(result)
            result += 1
        elif spec.kind is OutputKind.CONSTANT:
            positions.append(results + constant)
            constant += 1
        elif spec.kind is OutputKind.INPUT:
            positions.append(results + len(constants) + spec.index)
        elif spec.kind is OutputKind.DUPLICATE:
            positions.append(positions[spec.index])
        else:
            return None
    return constants, positions


def _declared_dims(value: onnx.ValueInfoProto) -> tuple[int | str | None, ...] | None:
    """A graph input's or output's declared shape: a size, a symbol's name, or None per dim; None if no rank."""
    tensor_type = value.type.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    return tuple(
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor_type.shape.dim
    )


# Other errors ONNX Runtime raises about one node of a model it loads name it like this (shape and type
# inference: "Node (node_Unsqueeze_40) Op (Unsqueeze) [ShapeInferenceError] ...", "... in node (node_Mul_3)").
_NAMED_NODE = re.compile(r"[Nn]ode \(([^)]+)\)")


def _explain_session_error(model: onnx.ModelProto, message: str) -> str:
    """For ONNX Runtime's error about one node: the ATen node it was lowered from and the user's source line,
    and for a missing kernel the node's input types. The fallback reads the FX node's text from here."""
    match = _MISSING_KERNEL.search(message)
    if match is not None:
        op_type, _, node_name = match.groups()
    else:
        named = _NAMED_NODE.search(message)
        if named is None:
            return ""
        op_type, node_name = None, named.group(1)
    # A node ONNX Runtime's optimizer made is named after the node it came from ("node_Gemm_9/GemmTransposeFusion/").
    names = (node_name, node_name.split("/", 1)[0])
    node = next((n for n in model.graph.node if n.name in names), None)
    if node is None:
        return ""
    props = {p.key: p.value for p in node.metadata_props}
    origin = props.get("pkg.torch.onnx.fx_node", "")
    where = source_line(props.get("pkg.torch.onnx.stack_trace"))
    lines = []
    if op_type is not None:
        types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.value_info)}
        types.update({t.name: t.data_type for t in model.graph.initializer})
        input_types = [onnx.TensorProto.DataType.Name(types[i]).lower() if i in types else "?" for i in node.input if i]
        lines.append(f"\n  ONNX Runtime's providers have no {op_type} kernel for inputs of type ({', '.join(input_types)}).")
    lines += [
        f"\n  The node was lowered from: {origin}" if origin else "",
        f"\n  at {where}" if where else "",
    ]
    if op_type is not None:
        lines.append("\n  Run this part of the model in a dtype ONNX Runtime supports for the op (float32 in most cases).")
    return "".join(lines)


# Threads and products per graph, measured: a graph of many small kernels can run faster on one thread than on
# several, each of its parallel kernels waking the pool's other threads (idle threads do not spin, see Options);
# and the fused kernels' matrix products (ATen's, on torch's OpenMP threads) can run slower or faster than ONNX
# Runtime's own (MLAS's, on its pool) depending on the machine, the shapes and the threads (rewrites.
# standard_products). With the thread count left to aot2onnx, a CPU graph's calls after the first
# _TRIAL_WARMUP go in turn to its session and to each candidate (one thread; MLAS's products, on the graph's
# threads and on one), and after _TRIAL_RUNS timed runs of each (a candidate's first run warms it up, untimed)
# the graph keeps the fastest where it beats its own session by _TRIAL_MARGIN. Measured on the benchmark's
# device-scale suite, 2 cores: see BENCHMARKS.md ("no-thread-trial" lever). In turn, so that a burst of other
# work on the machine falls on all. Graphs with random ops are left out: each session's kernels keep their own
# generator, so a second session would start the same dropout masks over; and so are sessions with ONNX
# Runtime's profiler on, whose trace must hold every run.
_TRIAL_WARMUP = 2
_TRIAL_RUNS = 8
_TRIAL_MARGIN = 0.95


class _TimedRun:
    """An ONNX Runtime run callable that adds up the seconds its runs take."""

    def __init__(self, ort_run: Callable[..., Any]) -> None:
        self.ort_run = ort_run
        self.seconds = 0.0

    def __call__(self, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.ort_run(*args)
        finally:
            self.seconds += time.perf_counter() - start


def _label(threads: int, products: str) -> str:
    """A trial candidate's name: "2 threads, ATen's products", "1 thread"."""
    return f"{threads} thread{'s' if threads > 1 else ''}" + (f", {products}" if products else "")


@dataclasses.dataclass
class _Candidate:
    """One configuration the trial times: a session on ``threads`` intra-op threads of ``model_bytes``."""

    label: str
    threads: int
    model_bytes: bytes
    runner: _Runner | None = None  # created at its first turn; the graph's own session's is never needed
    calls: int = 0
    runs_s: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _ThreadTrial:
    disabled_optimizers: list[str]
    options: ort.SessionOptions  # the first session's, whose profiling settings the others keep
    fused_kernels: bool
    candidates: list[_Candidate]  # the graph's own session first
    calls: int = 0

    @property
    def threads(self) -> int:
        return self.options.intra_op_num_threads

    @staticmethod
    def of(model: onnx.ModelProto, model_bytes: bytes, disabled: list[str], options: ort.SessionOptions,
           fused_kernels: bool, serial: bool) -> _ThreadTrial | None:
        """The trial of a graph, with its candidates; None where there is nothing to choose between. A serial
        graph (serial_nodes) weighs products only, on its one thread."""
        threads = options.intra_op_num_threads
        counts = [1] if serial else sorted({threads, torch.get_num_threads(), 1}, reverse=True)
        own = "ATen's products" if fused_kernels and any(
            n.op_type == "Mm" and n.domain == FUSED_DOMAIN for n in model.graph.node) else ""
        candidates = [_Candidate(_label(threads, own), threads, model_bytes)]
        candidates += [_Candidate(_label(t, own), t, model_bytes) for t in counts if t != threads]
        if own:
            standard, count = standard_products(model)
            if count:
                standard_bytes = standard.SerializeToString()
                candidates += [_Candidate(_label(t, "MLAS's products"), t, standard_bytes) for t in counts]
        return _ThreadTrial(disabled, options, fused_kernels, candidates) if len(candidates) > 1 else None


@dataclasses.dataclass
class _Runner:
    """A session and the binding state that goes with it."""

    session: Any
    binding: Any
    ort_run: Any
    bound: dict

    def fields(self) -> tuple[Any, Any, Any, dict]:
        return self.session, self.binding, self.ort_run, self.bound

    @staticmethod
    def create(trial: _ThreadTrial, candidate: _Candidate, options: Options) -> _Runner:
        so = session_options(options, intra_op_threads=candidate.threads, fused_kernels=trial.fused_kernels)
        if trial.options.enable_profiling:
            so.enable_profiling = True
            so.profile_file_prefix = trial.options.profile_file_prefix
        session = ort.InferenceSession(candidate.model_bytes, sess_options=so, providers=["CPUExecutionProvider"],
                                       disabled_optimizers=trial.disabled_optimizers)
        _made_of(session, candidate.model_bytes, so, trial.disabled_optimizers)
        return _Runner(session, c_binding(session), c_run_with_iobinding(session), {})


def _made_of(session: ort.InferenceSession, model_bytes: bytes, so: ort.SessionOptions, disabled: list[str]) -> None:
    """Notes on ``session`` what it was made of, for its native twin (:meth:`OrtGraph._native_twin`)."""
    session._aot2onnx_made_of = (model_bytes, so, list(disabled))


# The ops whose ONNX Runtime kernels do a graph's heavy work on its intra-op pool (the NCHWc domain's Conv and
# com.microsoft's fused ones included): a graph without them does it in the fused kernels, on torch's OpenMP
# threads (_own_threads).
_POOL_OPS = frozenset({"Conv", "ConvTranspose", "FusedConv", "MatMul", "Gemm", "FusedGemm", "FusedMatMul", "LSTM",
                       "GRU", "RNN", "Attention", "MultiHeadAttention"})


def _own_threads(model: onnx.ModelProto, options: Options, providers: list[Any], fused_kernels: bool) -> int | None:
    """One intra-op thread for a CPU graph whose heavy kernels are the fused kernels' (ATen's, on torch's OpenMP
    threads), with the thread count left to aot2onnx; None for torch's count. ONNX Runtime's pool would add
    threads of its own beside OpenMP's, whose workers spin between ATen's parallel regions: on 2 cores the
    step then loses more outside the run (the hand-off, AOTAutograd's wrappers, the optimizer) than the pool
    gives its elementwise kernels. Same process, 7 alternating rounds, aot2onnx / eager, pool on torch's
    threads (the trial's choice) -> one thread: encoder-s 1.26 -> 1.18, mlp-s 1.19 -> 1.15, gpt2-s 1.11 -> 1.07,
    encoder 1.15 -> 1.10, GPT 1.07 -> 1.05; the CNN, whose convolutions are ONNX Runtime's, 0.90 -> 0.99. The
    thread trial still times torch's count against it."""
    if options.intra_op_num_threads or providers != ["CPUExecutionProvider"] or not fused_kernels:
        return None
    return None if any(node.op_type in _POOL_OPS for node in model_nodes(model)) else 1


def _thread_trial_applies(model: onnx.ModelProto, options: Options, providers: list[Any],
                          sess_options: ort.SessionOptions) -> bool:
    if options.intra_op_num_threads:
        return False
    if sess_options.enable_profiling:
        # A profiled session measures the graph (the benchmark's breakdown): its trace must hold every run,
        # which a switch to a second session would split.
        return False
    if providers != ["CPUExecutionProvider"]:
        return False
    if torch.are_deterministic_algorithms_enabled():
        # The candidates' products (ATen's or MLAS's) sum in other orders: which one a trial keeps, timed on
        # the machine, would change the values from process to process (a cold and a warm cache included).
        return False
    return not any(node.domain in ("", "ai.onnx") and node.op_type in RANDOM_OPS for node in model_nodes(model))


class OrtGraph:
    """A lowered graph and its session: a boxed callable for AOTAutograd's runtime wrappers.

    Inputs are bound on the torch tensors' memory and outputs come back through DLPack, so no tensor is
    copied between torch and ONNX Runtime (a non-contiguous input is made contiguous first, since ONNX
    tensors have no strides). An input the graph writes (``signature.mutations``) gets its new value in
    place: its output is bound on the input's memory where that is safe (``runtime.inplace``), and copied
    into the input after the run elsewhere.
    """

    _boxed_call = True

    def __init__(
        self,
        model: onnx.ModelProto,
        signature: GraphSignature,
        *,
        name: str,
        device: torch.device,
        options: Options,
        kind: GraphKind = GraphKind.INFERENCE,
        fx_node_count: int = 0,
    ) -> None:
        self.name = name
        self.kind = GraphKind(kind)
        self.options = options
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
        self.signature = signature
        self.device = device
        self.fx_node_count = fx_node_count
        self.onnx_node_count = len(model.graph.node)
        self.op_counts = collections.Counter(node.op_type for node in model.graph.node)  # before ORT's fusions
        self.runs = 0
        self._onnx_outputs = signature.onnx_outputs
        self._mutations = signature.mutations
        self._checks = signature.checks
        self._in_place: frozenset[str] = frozenset()  # mutation outputs bound on their input's memory
        # ONNX Runtime hands bool tensors to DLPack as uint8; the output's declared type says which they are.
        declared = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
        self._bool_outputs = [i for i, n in enumerate(self._onnx_outputs) if declared.get(n) == onnx.TensorProto.BOOL]
        self._output_plan = _output_plan(signature)
        # The shapes the graph declares (FX's, for every input and output), which ONNX Runtime does not enforce
        # on outputs it allocates: see _check_shapes.
        self._input_dims = {i.name: _declared_dims(i) for i in model.graph.input}
        # ONNX Runtime refuses an input of another shape than a static one the model declares: where every input's
        # is static, the inputs of a run after the first come in the same shapes, and the one-call run need not
        # look at them (_run_in_one_call).
        self._static_inputs = all(dims is not None and all(isinstance(d, int) for d in dims)
                                  for dims in self._input_dims.values())
        output_dims = {o.name: _declared_dims(o) for o in model.graph.output}
        # In the order of the run's results: the returned outputs, the written inputs' new values, the checks'.
        self._output_dims = [(n, output_dims.get(n)) for n in (
            *self._onnx_outputs, *(m.onnx_name for m in self._mutations), *(c.onnx_name for c in self._checks))]
        # Per input: the (address, shape, dtype) bound last. Parameters keep their memory from step to
        # step, so most inputs need no new binding.
        self._bound: dict[str, tuple[int, tuple[int, ...], int]] = {}
        self._session = None
        self._trial: _ThreadTrial | None = None
        self.nchwc_convolutions = 0  # Conv nodes moved to ONNX Runtime's blocked layout (nchwc.py)
        self.float32_nodes = 0  # low-precision nodes computed in float32, having no kernel (precision.py)
        self.fused_kernels = False  # whether the graph runs nodes of aot2onnx's fused kernels (runtime/fused.py)
        self.fused_selects = 0  # Where nodes run by the fused kernels' Where (rewrites.fused_selects)
        self.fused_transposes = 0  # Transpose nodes run by the fused kernels' (rewrites.fused_transposes)
        self.fused_elementwise = 0  # arithmetic nodes run in the fused kernels' chains (rewrites.fused_elementwise)
        self.fused_scatter_scales = 0  # ScatterElements-Mul pairs run as one node (rewrites.fused_scatter_scales)
        self.split_reductions = 0  # per-channel sums taken in two steps on CUDA (rewrites.split_channel_reductions)
        self.serial: list[str] = []  # nodes that make the session run on one thread (serial_nodes)
        self._own_threads: int | None = None  # the session's intra-op threads where not torch's (_own_threads)
        # The returned outputs handed over as the value they view (one_call.view_outputs): positions, shapes, names.
        self._view_shapes: list[tuple[int, tuple[int, ...], str]] = []
        self._cuda = device.type == "cuda" and options.providers is None
        self._op_types = cuda.graph_op_types(model) if self._cuda else frozenset()  # what TF32 concerns
        self._precision = cuda.precision_settings() if self._cuda else None
        self._algorithms = cuda.algorithm_settings() if self._cuda else (False, False)
        self.tf32 = self._cuda and cuda.tf32_allowed(self._op_types, self._precision)
        self._graphed: cuda.GraphedRuns | None = None
        self._stream: torch.cuda.Stream | None = None  # a graphed session's own (cuda.GraphedRuns)
        self.cuda_graph_refusal: str | None = None  # why the graph is not replayed as a CUDA graph
        self._run_options: Any = None  # ONNX Runtime's RunOptions for a plain run (None: the defaults)
        self._order: cuda.StreamOrder | None = None  # a CUDA session's stream against torch's current one
        # The run in one call (runtime.one_call) where the graph allows it, else the IOBinding below; the
        # input shapes of its last run (a change has the outputs' shapes checked).
        self._one_call: OneCallRun | None = None
        self.one_call_refusal: str | None = "the graph has nothing to compute"
        self._one_call_shapes: list[torch.Size] | None = None
        self._one_call_session: Any = None  # the session whose run_with_ortvaluevector _one_call_run is
        self._one_call_run: Any = None
        # That session's twin, run with no Python per tensor (runtime.native_run); False where it cannot be.
        self._native: native_run.NativeSession | bool | None = None
        if self._onnx_outputs or self._mutations or self._checks:
            try:
                if self._cuda:
                    self.cuda_graph_refusal = self._cuda_graph_refusal(model, options)
                    providers = self._cuda_providers()
                    model, self.split_reductions = split_channel_reductions(model)
                else:
                    providers = providers_for(device, options)
                if options.graph_optimization_level in ("layout", "all") and providers == ["CPUExecutionProvider"]:
                    # ONNX Runtime's layout level would move these to its blocked layout itself, were
                    # their weights constants (see nchwc.py).
                    model = rewrite_convolutions(model)
                self.nchwc_convolutions = sum(n.op_type == "Conv" and n.domain == NCHWC for n in model.graph.node)
                if providers == ["CPUExecutionProvider"]:
                    # bfloat16 nodes (autocast) ONNX Runtime's CPU provider has no kernel for: in float32.
                    model, self.float32_nodes = compute_in_float(model)
                    if options.fused_kernels and fused.library() is not None:
                        model, self.fused_selects = fused_selects(model)
                        model, self.fused_transposes = fused_transposes(model)
                        model, self.fused_scatter_scales = fused_scatter_scales(model)
                        model, self.fused_elementwise = fused_elementwise(model)
                if providers == ["CPUExecutionProvider"]:
                    # CUDA's provider runs kernels on a stream, in the same order; kept to copies until tested.
                    self._in_place = writable_in_place(model, signature)
                    self.serial = serial_nodes(model)
                self.one_call_refusal = one_call_refusal(model, signature, device, providers, self._in_place)
                if self.one_call_refusal is None:
                    model, replaced = view_outputs(model, self._onnx_outputs)
                    self._onnx_outputs = tuple(replaced[k][0] if k in replaced else name
                                               for k, name in enumerate(self._onnx_outputs))
                    self._view_shapes = [(k, shape, self._output_dims[k][0])
                                         for k, (_, shape) in sorted(replaced.items())]
                    self._one_call = OneCallRun(signature, [
                        *self._onnx_outputs, *(name for name, _ in self._output_dims[len(self._onnx_outputs):])])
                model_bytes = model.SerializeToString()
                disabled = disabled_optimizers(model)
                self.fused_kernels = uses_fused_kernels(model)
                self._own_threads = _own_threads(model, options, providers, self.fused_kernels)
                sess_options = self._session_options()
                self._session = self._open(model_bytes, sess_options, providers, disabled)
                if _thread_trial_applies(model, options, providers, sess_options):
                    self._trial = _ThreadTrial.of(model, model_bytes, disabled, sess_options, self.fused_kernels,
                                                  bool(self.serial))
            except RuntimeSessionError:
                raise
            except Exception as e:
                raise RuntimeSessionError(
                    f"ONNX Runtime could not create a session for graph {name!r}: {e}{_explain_session_error(model, str(e))}"
                ) from e
            self._binding = c_binding(self._session)
            self._ort_run: Callable[[Any, Any], None] | None = c_run_with_iobinding(self._session)
            self._model_bytes, self._disabled = model_bytes, disabled
        else:
            self._ort_run = None
        self._cpu = device.type == "cpu"
        self._ort_device = c_device("cuda" if device.type == "cuda" else "cpu", device.index or 0)
        self._host_device = c_device("cpu", 0)
        self._lock = threading.Lock()
        self._trial_lock = threading.Lock()
        # What the thread trial measured, once settled: the threads it started with, the median run time on
        # them and on one thread, each candidate's median run time, and the candidate kept.
        self.thread_trial: dict[str, Any] | None = None
        with _registry_lock:
            _COMPILED.append(weakref.ref(self))

    def _cuda_graph_refusal(self, model: onnx.ModelProto, options: Options) -> str | None:
        """Why the graph is not to be replayed as a CUDA graph, or None."""
        if not options.cuda_graphs:
            return "cuda_graphs is off"
        if self.signature.has_complex:  # bound as views made per call (as_real_pairs): not kept in place
            return "a complex tensor crosses the graph's boundary"
        symints = any(spec.kind is InputKind.SYMINT for spec in self.signature.inputs)
        return cuda.graph_refusal(model, self._op_types, RANDOM_OPS, symints)

    def _session_options(self) -> ort.SessionOptions:
        """This graph's session options: a CUDA session shares an environment's arena only where its memory
        is the shared arena (``cuda.session_memory``), never where it is torch's or its own."""
        env = not self._cuda or cuda.session_memory(self.options, self.cuda_graph_refusal is None) == "shared"
        return session_options(self.options, 1 if self.serial else self._own_threads, fused_kernels=self.fused_kernels,
                               env_allocators=env, deterministic=self._cuda and self._algorithms[1])

    def _cuda_providers(self) -> list[Any]:
        """The providers of a CUDA session: on a stream of the graph's own where it is to be a CUDA graph."""
        graphed = self.cuda_graph_refusal is None
        if graphed and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        # A plain session runs on torch's stream of now (provider_options), a graphed one on its own, and their
        # runs without the wait at their end (cuda.run_options): ordered with the stream that is current at each
        # run instead.
        self._order = cuda.StreamOrder(self.device, self._stream if graphed else torch.cuda.current_stream(self.device))
        self._run_options = None if graphed else cuda.run_options()
        return providers_for(self.device, self.options, cuda.provider_options(
            self.device, self.options, tf32=self.tf32, cuda_graph=graphed, stream=self._stream if graphed else None))

    def _open(self, model_bytes: bytes, sess_options: ort.SessionOptions, providers: list[Any],
              disabled: list[str]) -> ort.InferenceSession:
        """The session; for a CUDA graph, with its runs set up, or without one where ONNX Runtime refuses it
        (a node placed on the CPU provider, say), saying why once."""
        try:
            session = ort.InferenceSession(model_bytes, sess_options=sess_options, providers=providers,
                                           disabled_optimizers=disabled)
            _made_of(session, model_bytes, sess_options, disabled)
        except Exception as e:
            message = str(e).lower()
            if not self._cuda or self.cuda_graph_refusal is not None or not (
                "cuda graph" in message or "graph capture" in message
            ):
                raise
            self.cuda_graph_refusal = f"ONNX Runtime refused to capture it: {str(e).splitlines()[0]}"
            logger.warning("aot2onnx: graph %s runs without a CUDA graph: %s", self.name, self.cuda_graph_refusal)
            return ort.InferenceSession(model_bytes, sess_options=self._session_options(),
                                        providers=self._cuda_providers(), disabled_optimizers=disabled)
        if self._cuda and self.cuda_graph_refusal is None:
            inputs = [spec.onnx_name for spec in self.signature.inputs if spec.kind is not InputKind.UNUSED]
            outputs = [*self._onnx_outputs, *(m.onnx_name for m in self._mutations), *(c.onnx_name for c in self._checks)]
            model = onnx.load_from_string(model_bytes)
            self._graphed = cuda.GraphedRuns(self.name, model, inputs, outputs, self.device,
                                             constant=cuda.constant_outputs(model, RANDOM_OPS),
                                             host=frozenset(c.onnx_name for c in self._checks))
            self._run_options = self._graphed.plain_run
        return session

    def _follow_precision(self) -> None:
        """A new session where torch's TF32 settings changed what this graph may use, or its switches for how
        kernels are chosen changed (``runtime.cuda``: benchmark, deterministic)."""
        settings, algorithms = cuda.precision_settings(), cuda.algorithm_settings()
        if settings == self._precision and algorithms == self._algorithms:
            return
        self._precision = settings
        tf32 = cuda.tf32_allowed(self._op_types, settings)
        if (tf32 == self.tf32 and algorithms == self._algorithms) or self._session is None:
            self._algorithms = algorithms
            return
        logger.info("aot2onnx: graph %s gets a new session: torch's settings changed (TF32 %s, cuDNN benchmark %s, "
                    "deterministic %s)", self.name, "on" if tf32 else "off", *algorithms)
        with self._lock:
            self.tf32, self._algorithms = tf32, algorithms
            self._graphed = None
            self._session = self._open(self._model_bytes, self._session_options(), self._cuda_providers(),
                                       self._disabled)
            self._binding = c_binding(self._session)
            self._ort_run = c_run_with_iobinding(self._session)
            self._bound = {}

    def __call__(self, args: list[Any]) -> list[Any]:
        if self._cuda:
            self._follow_precision()
        if self._trial is not None:
            return self._trial_call(args)
        return self._settled_call(args)

    def _settled_call(self, args: list[Any]) -> list[Any]:
        profile = _profile
        if profile is not None:  # inside profiling(); off, this check is all the hook costs
            return self._profiled_call(args, profile)
        return self._call(args, self._ort_run)

    def _use(self, runner: _Runner) -> _Runner:
        """Runs the graph's calls on ``runner``'s session from now on; returns the one they ran on."""
        previous = _Runner(self._session, self._binding, self._ort_run, self._bound)
        self._session, self._binding, self._ort_run, self._bound = runner.fields()
        return previous

    def _trial_call(self, args: list[Any]) -> list[Any]:
        """A call while the graph's threads and products are being chosen (:class:`_ThreadTrial`)."""
        with self._trial_lock:
            trial = self._trial
            if trial is None:  # decided while this call waited
                return self._settled_call(args)
            trial.calls += 1
            if trial.calls <= _TRIAL_WARMUP:
                return self._settled_call(args)
            candidate = trial.candidates[(trial.calls - _TRIAL_WARMUP - 1) % len(trial.candidates)]
            own = candidate is trial.candidates[0]
            if not own and candidate.runner is None:
                try:
                    candidate.runner = _Runner.create(trial, candidate, self.options)
                except Exception as e:  # the trial is an optimization: go on without the candidate
                    logger.debug("aot2onnx: no session for graph %s on %s: %s", self.name, candidate.label, e)
                    trial.candidates.remove(candidate)
                    if len(trial.candidates) == 1:
                        self._trial = None
                    return self._settled_call(args)
            mine = None if own else self._use(candidate.runner)
            timed_run = _TimedRun(self._ort_run)
            start = time.perf_counter()
            try:
                return self._call(args, timed_run)
            finally:
                call_s, run_s = time.perf_counter() - start, timed_run.seconds
                if _profile is not None:
                    _profile.calls.append(GraphCall(self.name, self.kind, call_s, run_s))
                if mine is not None:
                    candidate.runner = self._use(mine)
                candidate.calls += 1
                if own or candidate.calls > 1:  # another session's first run warms it up
                    candidate.runs_s.append(run_s)
                if all(len(c.runs_s) >= _TRIAL_RUNS for c in trial.candidates):
                    self._settle(trial)

    def _settle(self, trial: _ThreadTrial) -> None:
        """Keeps the fastest session of the trial where it beats the graph's own by the margin; drops the others."""
        medians = {c.label: statistics.median(c.runs_s) for c in trial.candidates}
        own = trial.candidates[0]
        best = min(trial.candidates[1:], key=lambda c: medians[c.label])
        kept = best if medians[best.label] < _TRIAL_MARGIN * medians[own.label] else own
        if kept is not own:
            assert kept.runner is not None
            self._use(kept.runner)
        one_thread = next((c for c in trial.candidates if c.threads == 1 and c.model_bytes is own.model_bytes), None)
        self.thread_trial = {
            "threads": trial.threads, "median_run_s": medians[own.label],
            "one_thread_median_run_s": None if one_thread is None else medians[one_thread.label],
            "median_run_s_by_candidate": medians, "kept": kept.label,
        }
        self._trial = None

    @property
    def trial_pending(self) -> bool:
        """Whether the graph's thread trial is still under way: its calls still take turns between sessions."""
        return self._trial is not None

    @property
    def intra_op_threads(self) -> int | None:
        """The intra-op thread count of the session the graph runs on now (None without a session)."""
        return None if self._session is None else self._session.get_session_options().intra_op_num_threads

    def _profiled_call(self, args: list[Any], profile: Profile) -> list[Any]:
        """The call, timed whole and around ONNX Runtime's run, recorded in ``profile``."""
        timed_run = None if self._ort_run is None else _TimedRun(self._ort_run)
        start = time.perf_counter()
        try:
            return self._call(args, timed_run)
        finally:
            profile.calls.append(GraphCall(self.name, self.kind, time.perf_counter() - start,
                                           None if timed_run is None else timed_run.seconds))

    def _call(self, args: list[Any], ort_run: Callable[[Any, Any], None] | None) -> list[Any]:
        """The boxed call, running the session through ``ort_run`` (None for a graph without a session)."""
        results = self._run(args, ort_run) if ort_run is not None else []
        plan = self._output_plan
        if plan is not None:
            constants, positions = plan
            outputs = list(map([*results, *constants, *args].__getitem__, positions))
            args.clear()  # boxed convention: the caller's references to the inputs can be freed now
            return outputs
        outputs = []
        it = iter(results)
        for spec in self.signature.outputs:
            if spec.kind is OutputKind.TENSOR:
                outputs.append(from_real_pairs(next(it)) if spec.is_complex else next(it))
            elif spec.kind is OutputKind.SYMINT:
                outputs.append(int(next(it).item()))
            elif spec.kind is OutputKind.INPUT:
                outputs.append(args[spec.index])
            elif spec.kind is OutputKind.DUPLICATE:
                outputs.append(outputs[spec.index])
            else:
                outputs.append(spec.value)
        args.clear()  # boxed convention: the caller's references to the inputs can be freed now
        return outputs

    def _run(self, args: Sequence[Any], ort_run: Callable[[Any, Any], None]) -> list[torch.Tensor]:
        if self._one_call is not None:
            return self._run_in_one_call(args, ort_run)
        graphed = self._graphed
        if graphed is not None and graphed.stopped is None:
            replayed = self._replay(graphed, args, ort_run)
            if replayed is not None:
                return replayed
        keep_alive = []
        with self._lock:
            binding = self._binding
            new_shapes = False
            for spec, arg in zip(self.signature.inputs, args):
                if spec.kind is InputKind.UNUSED:
                    continue
                if spec.kind is InputKind.SYMINT:
                    # In host memory: a size feeds shapes, which a device kernel reads from the host.
                    arg = torch.tensor(int(arg), dtype=torch.int64)
                    bound = (arg.data_ptr(), (), TORCH_TO_ONNX[torch.int64])
                    keep_alive.append(arg)
                    binding.bind_input(spec.onnx_name, self._host_device, bound[2], [], bound[0])
                    self._bound.pop(spec.onnx_name, None)
                    continue
                if arg.device != self.device:
                    if arg.dim() != 0:
                        raise RuntimeSessionError(
                            f"graph {self.name!r} was compiled for {self.device} but got a tensor on {arg.device}"
                        )
                    arg = arg.to(self.device)  # a CPU scalar beside CUDA tensors, as torch allows
                if arg.is_complex():
                    arg = as_real_pairs(arg)
                elif not arg.is_contiguous():
                    arg = arg.contiguous()
                keep_alive.append(arg)
                dtype = TORCH_TO_ONNX.get(arg.dtype)
                if dtype is None:
                    raise RuntimeSessionError(f"graph {self.name!r}: ONNX Runtime cannot take {arg.dtype} tensors")
                bound = (arg.data_ptr(), tuple(arg.shape), dtype)
                previous = self._bound.get(spec.onnx_name)
                if previous != bound:
                    # A binding only records an address and a shape: the same ones bind the same memory.
                    binding.bind_input(spec.onnx_name, self._ort_device, dtype, list(bound[1]), bound[0])
                    self._bound[spec.onnx_name] = bound
                    new_shapes = new_shapes or previous is None or previous[1] != bound[1]
            # Outputs are bound afresh on every run: an output ONNX Runtime allocated in the last run stays
            # bound and would be written over in place, under a tensor the caller still holds. (Outputs
            # allocated by torch and bound by address would save the DLPack conversions, about 0.15 ms
            # per MLP step, but keep a second pool beside ONNX Runtime's arena: 30-70 MiB more peak RSS on
            # the benchmark's GPT, transformer layer and CNN.)
            for output in self._onnx_outputs:
                binding.bind_output(output, self._ort_device)
            copied = self._bind_mutations(args, binding) if self._mutations else ()
            for check in self._checks:
                binding.bind_output(check.onnx_name, self._ort_device)
            order = self._order
            current = order.before_run() if order is not None else None
            try:
                ort_run(binding, self._run_options)
            except Exception as e:
                self._bound.clear()  # bind every input afresh after a failure
                raise RuntimeSessionError(f"ONNX Runtime failed running graph {self.name!r}: {e}") from e
            finally:
                if order is not None:
                    order.after_run(current)
            self.runs += 1
            if not self._onnx_outputs and not copied and not self._checks:
                return []
            values = binding.get_outputs()
            if self._cpu:
                # The capsules directly, made in one call: torch.from_dlpack's protocol negotiation (stream,
                # version) costs about 3 us more per output here, and CPU tensors have no stream to hand over;
                # to_dlpacks skips a Python OrtValue per output (19 outputs: 176 -> 157 us a run).
                results = values.to_dlpacks(_from_capsule)
            else:
                results = [torch.from_dlpack(values[i]) for i in range(len(values))]
            if graphed is not None and graphed.remembers:
                graphed.remember(results)
            self._shape_views(results)
            if new_shapes:
                self._check_shapes(results, {name: bound[1] for name, bound in self._bound.items()})
            for index, position in copied:
                written = args[index].detach()
                (torch.view_as_real(written) if written.is_complex() else written).copy_(results[position])
            checked = results[len(self._onnx_outputs) + len(self._mutations):]
            del results[len(self._onnx_outputs):]
        return self._finish(results, checked)

    def _run_in_one_call(self, args: Sequence[Any], ort_run: Callable[..., None]) -> list[torch.Tensor]:
        """The run with every input and output handed over in one call (``runtime.one_call``)."""
        one_call = self._one_call
        assert one_call is not None
        with self._lock:
            if self._one_call_session is not self._session:  # the first run, or the thread trial's other session
                self._one_call_session, self._one_call_run = self._session, c_run_with_ortvaluevector(self._session)
                self._native = None
            sess_run = self._one_call_run
            timing = isinstance(ort_run, _TimedRun)
            # The trial's timed calls compare the Python sessions; every other call, a profiled one included,
            # runs on the twin once there is one: a graph with random ops must draw from one session only (each
            # session's generator starts from the seeds in the model).
            native = self._trial is None or not timing
            if self._native is None and native:
                self._native = self._native_twin()
            twin = self._native if native and self._native else None
            timed = _TimedRun(twin.run if twin else sess_run) if timing else None
            # The twin takes any tensor (it copies one that is not contiguous); the input shapes are looked at
            # where they may have changed since the last run (the first run, or a symbolic size).
            tensors = one_call.inputs(args) if twin else one_call.tensors(args, self.name)
            fresh = self._one_call_shapes is None or not self._static_inputs
            shapes = [t.shape for t in tensors] if fresh or not twin else None
            try:
                if twin:
                    results = (timed or twin.run)(tensors)
                else:
                    results = one_call.run(timed or sess_run, tensors, shapes)
            except KeyError as e:
                raise RuntimeSessionError(f"graph {self.name!r}: ONNX Runtime cannot take {e.args[0]} tensors") from e
            except Exception as e:
                raise RuntimeSessionError(f"ONNX Runtime failed running graph {self.name!r}: {e}") from e
            finally:
                if timed is not None:
                    ort_run.seconds += timed.seconds
            self.runs += 1
            self._shape_views(results)
            if fresh and shapes != self._one_call_shapes:
                self._check_shapes(results, dict(zip(one_call.names, shapes)))
                self._one_call_shapes = shapes
            returned = len(self._onnx_outputs)
            for k, spec in enumerate(self._mutations):
                args[spec.index].detach().copy_(results[returned + k])
            checked = results[returned + len(self._mutations):]
            del results[returned:]
        return self._finish(results, checked)

    def _native_twin(self) -> native_run.NativeSession | bool:
        """The session the graph runs on, opened again through the C API (runtime.native_run), or False where it
        cannot be: the switch is off, the library is not available, or the session is not one of aot2onnx's
        own making. Made at the session's first call outside the thread trial's turns and kept with it: the
        trial's candidates run and are timed on their Python sessions (their runs are the same), and the one the
        graph keeps gets its twin at its first call after."""
        session = self._session
        twin = getattr(session, "_aot2onnx_twin", None)
        if twin is not None:
            return twin
        twin = False
        made_of = getattr(session, "_aot2onnx_made_of", None)
        recipe = None if made_of is None else native_run.recipe(made_of[1], made_of[2])
        if native_run.ENABLED and recipe is not None and self._one_call is not None and native_run.available():
            try:
                twin = native_run.NativeSession(made_of[0], recipe, self.fused_kernels, self._one_call.names,
                                                self._one_call.output_names)
            except Exception as e:  # an optimization: the Python session runs the graph as before
                logger.debug("aot2onnx: graph %s runs without a native session: %s", self.name, e)
        session._aot2onnx_twin = twin
        return twin

    @property
    def native(self) -> bool:
        """Whether the graph's runs go through its native session (runtime.native_run)."""
        return bool(self._native)

    def _shape_views(self, results: list[torch.Tensor]) -> None:
        """Gives the outputs handed over as the value they view their own shapes (one_call.view_outputs)."""
        for position, shape, name in self._view_shapes:
            results[position] = with_shape(results[position], shape, name)

    @property
    def view_outputs(self) -> int:
        """How many returned outputs the run hands over as the value they view, without a copy."""
        return len(self._view_shapes)

    def _finish(self, results: list[torch.Tensor], checked: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """A run's returned outputs, after its checks raised eager's error where ATen would have."""
        for check, value in zip(self._checks, checked):
            # where eager raises: ATen's own linalg check and message, or an IndexError for a negative index
            _raise_if_failed(check.kind, check.api_name, value, check.is_matrix)
        for i in self._bool_outputs:
            if results[i].dtype != torch.bool:
                results[i] = results[i].view(torch.bool)
        return results

    def _replay(self, graphed: cuda.GraphedRuns, args: Sequence[Any],
                ort_run: Callable[[Any, Any], None]) -> list[torch.Tensor] | None:
        """The run as a CUDA graph's replay (:class:`cuda.GraphedRuns`); None for a plain run instead (the
        warm-up calls, and every call after the replays ended)."""
        tensors = [arg for spec, arg in zip(self.signature.inputs, args) if spec.kind is not InputKind.UNUSED]
        with self._lock:
            if graphed.ready:
                moved, changed = graphed.moved(tensors)
                if changed or (moved and not graphed.recapture(moved)):
                    graphed.stop("an input came in another shape or dtype" if changed else
                                 f"inputs that kept their memory until a capture moved after {graphed.captures} captures")
                    self.cuda_graph_refusal = graphed.stopped
                    self._unbind()
                    return None
                if moved:
                    self._setup(graphed, tensors)
            else:
                if not graphed.warmup(tensors):
                    return None
                if any(t.device != self.device for t in tensors):
                    graphed.stop("an input is on another device")
                    self.cuda_graph_refusal = graphed.stopped
                    return None
                self._setup(graphed, tensors)
            graphed.copy_in(tensors)
            order = self._order
            assert order is not None  # a graphed session is a CUDA one
            current = order.before_run()
            try:
                ort_run(self._binding, graphed.graph_run)
            except Exception as e:
                if not graphed.capturing:
                    order.after_run(current)
                    raise RuntimeSessionError(f"ONNX Runtime failed replaying graph {self.name!r}: {e}") from e
                # The capture failed: the graph runs plainly from now on, once the stream is out of capture
                # mode (ONNX Runtime leaves it there, and every later call on it would fail).
                if self._stream is None or not cuda.end_failed_capture(self._stream):
                    raise RuntimeSessionError(
                        f"ONNX Runtime failed capturing graph {self.name!r} as a CUDA graph, and its stream could not "
                        f"be taken out of capture mode (pass cuda_graphs=False): {e}") from e
                order.after_run(current)
                graphed.stop(f"ONNX Runtime failed to capture it: {str(e).splitlines()[0][:300]}")
                self.cuda_graph_refusal = graphed.stopped
                self._unbind()
                return None
            order.after_run(current)
            graphed.capturing = False
            self.runs += 1
            returned, written = len(self._onnx_outputs), len(self._mutations)
            results = graphed.copy_out(range(returned, returned + written))
            new_values = results[returned:returned + written]
            if new_values:
                cuda.foreach_copy([args[spec.index].detach() for spec in self._mutations], new_values)
            checked = results[returned + written:]
            del results[returned:]
        for check, value in zip(self._checks, checked):
            _raise_if_failed(check.kind, check.api_name, value, check.is_matrix)
        return results

    def _unbind(self) -> None:
        """Forgets every binding: the next run binds afresh."""
        self._binding.clear_binding_inputs()
        self._binding.clear_binding_outputs()
        self._bound.clear()

    def _setup(self, graphed: cuda.GraphedRuns, tensors: Sequence[torch.Tensor]) -> None:
        """Binds the graph's inputs and outputs where a new capture will replay them."""
        self._unbind()
        binding = self._binding

        def bind_input(name: str, tensor: torch.Tensor) -> None:
            binding.bind_input(name, self._ort_device, TORCH_TO_ONNX[tensor.dtype], list(tensor.shape),
                               tensor.data_ptr())

        def bind_output(name: str, tensor: torch.Tensor) -> None:
            binding.bind_output(name, self._ort_device, TORCH_TO_ONNX[tensor.dtype], list(tensor.shape),
                                tensor.data_ptr())

        graphed.setup(tensors, bind_input, bind_output)

    def _check_shapes(self, results: Sequence[torch.Tensor], input_shapes: dict[str, Sequence[int]]) -> None:
        """Raises where an output's shape is not the one the graph declares (FX's: the ATen op's). ONNX Runtime
        only logs that, and a tensor of another shape would go on into the caller's code, where broadcasting
        can turn it into wrong numbers without an error. Run on a graph's first call and whenever an input's
        shape changed: rank and static sizes, and symbolic sizes named by an input (the same symbol, the
        same size). A mismatch is a lowering rule's bug."""
        sizes: dict[str, int] = {}
        for name, dims in self._input_dims.items():
            shape = input_shapes.get(name)
            if dims is not None and shape is not None:
                for dim, size in zip(dims, shape):
                    if isinstance(dim, str):
                        sizes.setdefault(dim, size)
        for (name, dims), result in zip(self._output_dims, results):
            if dims is None:
                continue
            shape = tuple(result.shape)
            if len(shape) != len(dims) or any(
                (isinstance(dim, int) and size != dim) or (isinstance(dim, str) and sizes.get(dim, size) != size)
                for dim, size in zip(dims, shape)
            ):
                raise RuntimeSessionError(
                    f"graph {self.name!r}: ONNX Runtime returned output {name!r} of shape {list(shape)}, where the "
                    f"graph declares {list(dims)} (from the ATen graph; symbolic sizes here: {sizes}). The lowering "
                    "computed something other than the ATen op: a bug of aot2onnx's, please report it"
                )

    def _bind_mutations(self, args: Sequence[Any], binding: Any) -> list[tuple[int, int]]:
        """Binds the outputs holding the written inputs' new values, after the returned outputs: on the
        input's memory where ONNX Runtime may write it in place, else on memory ONNX Runtime allocates.
        Returns (input position, output position) of the values to copy in after the run."""
        copied = []
        for k, spec in enumerate(self._mutations):
            arg = args[spec.index]
            name = spec.onnx_name
            if (
                name in self._in_place
                and arg.device == self.device
                and arg.is_contiguous()
                and arg.numel() > 0
                and (dtype := TORCH_TO_ONNX.get(arg.dtype)) is not None
            ):
                bound = (arg.data_ptr(), tuple(arg.shape), dtype)
                if self._bound.get(name) != bound:
                    binding.bind_output(name, self._ort_device, dtype, list(bound[1]), bound[0])
                    self._bound[name] = bound
            else:
                binding.bind_output(name, self._ort_device)
                self._bound.pop(name, None)
                copied.append((spec.index, len(self._onnx_outputs) + k))
        return copied

    @property
    def cuda_graph_replays(self) -> int:
        """How many runs were replays of a captured CUDA graph (``runtime.cuda.GraphedRuns``)."""
        return 0 if self._graphed is None else self._graphed.replays

    @property
    def written_in_place(self) -> frozenset[str]:
        """The outputs of written inputs (``signature.mutations``) that ONNX Runtime writes into the inputs'
        own memory; the others are copied in after the run."""
        return self._in_place

    @property
    def session(self) -> ort.InferenceSession | None:
        """The ONNX Runtime session (``None`` for a graph whose outputs need no computation)."""
        return self._session

    def __repr__(self) -> str:
        return (
            f"OrtGraph({self.name!r}, kind={self.kind}, fx_nodes={self.fx_node_count}, onnx_nodes={self.onnx_node_count}, "
            f"runs={self.runs}, device={self.device})"
        )


def as_real_pairs(tensor: torch.Tensor) -> torch.Tensor:
    """A complex tensor as the real tensor with a trailing axis of 2 that a lowered graph reads
    (``signature``): ``torch.view_as_real`` of it, without a copy where it is contiguous and has no conjugate or
    negative bit (a tensor that has one, ``x.conj()``, is resolved first: ``view_as_real`` refuses it)."""
    tensor = tensor.resolve_conj().resolve_neg()
    return torch.view_as_real(tensor if tensor.is_contiguous() else tensor.contiguous())


def from_real_pairs(tensor: torch.Tensor) -> torch.Tensor:
    """The complex tensor whose real [..., 2] pairs a graph returned (``signature``), without a copy. An empty one
    comes from DLPack with strides of 0, which ``view_as_complex`` refuses: it gets fresh (empty) memory."""
    if tensor.numel() == 0:
        tensor = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    return torch.view_as_complex(tensor)


def _raise_if_failed(kind: str, api_name: str, value: torch.Tensor, is_matrix: bool) -> None:
    """Raises eager's error where a check's value from the run (``signature.CheckSpec``) says ATen would have."""
    if kind == CHECK_LINALG:
        torch.ops.aten._linalg_check_errors(value, api_name, is_matrix=is_matrix)
    elif kind == CHECK_NEGATIVE_INDEX:
        smallest = int(value)
        if smallest < 0:
            raise IndexError(
                f"{api_name}: index {smallest} is out of range: ATen refuses a negative index here, as eager does "
                "(ONNX Runtime would have read from the end)"
            )
    else:
        raise RuntimeSessionError(f"unknown check kind {kind!r} in a graph's signature")
