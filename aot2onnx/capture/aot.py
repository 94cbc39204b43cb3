"""AOTAutograd with our graph compilers, and AOTAutograd's own cache above them."""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import hashlib
import logging
import os
import pathlib
import pickle
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any
from unittest import mock

import torch
import torch.fx
from torch.nn.attention import SDPBackend, sdpa_kernel

from aot2onnx.authentication import Authenticator
from aot2onnx.capture import chunked_loss
from aot2onnx.capture._torch_compat import (
    AOTAUTOGRAD_CACHE_PREFIX,
    AOTAutogradCache,
    AOTAutogradCacheDetails,
    AOTAutogradCachePickler,
    BypassAOTAutogradCache,
    GmWrapper,
    OutputCode,
    SerializableAOTDispatchCompiler,
    TracingContext,
    aot_module_simplified,
    autocast_supported_devices,
    autograd_cache,
    check_node_safe,
    counters,
    default_partition,
    functorch_config,
    graph_compile,
    linalg_checks_kept,
    min_cut_rematerialization_partition,
    sanitize_gm_for_cache,
)
from aot2onnx.signature import GraphKind

__all__ = ["GraphKind", "GraphObserver", "ReloadableGraph", "capture", "math_attention", "observing", "partition_function"]

logger = logging.getLogger("aot2onnx")



def math_attention() -> contextlib.AbstractContextManager:
    """Attention traced through its math formulation, so that the backward graph holds matmul and softmax
    gradients rather than the fused CPU kernel's backward, which has no ONNX equivalent. Both captures
    (this module's and joint.py's) trace under it."""
    return sdpa_kernel(SDPBackend.MATH)


def partition_function(name: str) -> Callable:
    """AOTAutograd's partitioner behind a name of ``options.PARTITIONERS`` (the one list of names)."""
    return {"min_cut": min_cut_rematerialization_partition, "default": default_partition}[name]


# compile_graph(gm, example_inputs, kind, capture_seconds) -> (boxed callable, its key or None); the key is
# what load_graph(key, kind) takes to make the same callable again in a later process.
GraphCompiler = Callable[[torch.fx.GraphModule, Sequence[Any], GraphKind, float], tuple[Callable, str | None]]
GraphLoader = Callable[[str, GraphKind], Callable]

# observer(kind, graph, runner) -> runner: sees each graph a capture makes and what it was compiled to.
GraphObserver = Callable[[GraphKind, torch.fx.GraphModule, Callable], Callable]

# The open observing() block's observer, if any. A module global, not a context variable: AOTAutograd may
# compile the backward graph at the first backward, in the autograd engine's thread.
_observer: GraphObserver | None = None


@contextlib.contextmanager
def observing(observer: GraphObserver) -> Iterator[None]:
    """Shows ``observer`` every graph that captures compile inside the block (aot2onnx.parity's hook).

    ``observer(kind, graph, runner)`` gets a copy of the FX graph as AOTAutograd produced it (the compiler's
    passes and the fallback's split rewrite their own) and the callable it was compiled to, and returns the
    callable AOTAutograd is to run instead (the same one, or a wrapper in the boxed calling convention).
    Graphs served by AOTAutograd's cache are not compiled, so not shown: observe with the cache off. Off, a
    capture pays one check of a global per graph.
    """
    global _observer
    outer, _observer = _observer, observer
    try:
        yield
    finally:
        _observer = outer


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` with nodes of its own (their meta dicts copied, the fake values in them shared)."""
    return torch.fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)


# The loader of the capture in progress: AOTAutogradCache unpickles a ReloadableGraph and calls its
# post_compile with nothing of ours in reach.
_LOADER: contextvars.ContextVar[GraphLoader] = contextvars.ContextVar("aot2onnx_graph_loader")


class ReloadableGraph(OutputCode):
    """A compiled graph as AOTAutogradCache keeps it: the key its compiler loads it back by.

    AOTAutogradCache stores what it needs to rebuild its runtime wrappers (the view and mutation
    metadata, the epilogue's instructions) beside the compiled forward and backward, which it requires to
    be ``OutputCode`` objects it can pickle. This one pickles as its key and kind; on a hit, its
    ``post_compile`` asks the capture's ``load_graph`` for the callable (for aot2onnx: the lowered model
    from the graph cache and a new ONNX Runtime session). A graph without a key (one split around
    unsupported nodes, which runs FX code) makes the entry uncacheable, so AOTAutograd stores nothing.
    """

    def __init__(self, runner: Callable | None, key: str | None, kind: GraphKind) -> None:
        self.runner = runner
        self.key = key
        self.kind = kind
        # Set on the instance: torch._dynamo.disable, which wraps a reloaded backward, copies the
        # instance's __dict__ onto its wrapper, and AOTAutograd reads the calling convention there.
        self._boxed_call = True

    def __call__(self, args: list[Any]) -> Any:
        return self.runner(args)

    def __getstate__(self) -> dict[str, Any]:
        return {"key": self.key, "kind": self.kind}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(None, state["key"], state["kind"])

    def prepare_for_serialization(self) -> None:
        if self.key is None:
            raise BypassAOTAutogradCache(f"the {self.kind.value} graph runs partly in PyTorch (fallback)")
        self.runner = None

    def post_compile(self, example_inputs: Sequence[Any], constants: Any, graph_kwargs: Any) -> None:
        if self.runner is None:
            self.runner = _LOADER.get()(self.key, self.kind)

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass


def capture(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    compile_graph: GraphCompiler,
    decompositions: Mapping,
    partitioner: str = "min_cut",
    load_graph: GraphLoader | None = None,
    cache_dir: str | os.PathLike | None = None,
    authenticator: Authenticator | None = None,
) -> Callable:
    """Runs AOTAutograd on a Dynamo graph; ``compile_graph`` receives each graph it produces.

    AOTAutograd's runtime wrappers (the autograd.Function, the mutation epilogue, aliased-output
    regeneration, deduplication) wrap the callables ``compile_graph`` returns, which must follow the
    boxed calling convention.

    With ``cache_dir`` and ``load_graph``, AOTAutograd's own cache (AOTAutogradCache) runs above the graph
    compiler, in ``cache_dir``: on a hit, a later process skips AOTAutograd's tracing, functionalization
    and partitioning, and ``load_graph`` makes each graph's callable from the key ``compile_graph``
    returned with it. AOTAutogradCache keys an entry by the Dynamo graph, the inputs' metadata and
    torch's configuration, not by what our compilers do: ``cache_dir`` must be specific to everything
    else that decides the graphs (aot2onnx's options, source and versions). Its entries are pickles:
    ``authenticator`` seals each one written and opens each one read, and an entry that does not
    authenticate is never unpickled.
    """
    start = time.perf_counter()
    # Counted as every AOTAutograd backend of torch counts itself (torch._dynamo.backends.common): Dynamo's
    # DDPOptimizer, which calls this backend once per DDP bucket, reads the count to learn that the bucket
    # went through AOTAutograd. Only then does it record the bucket's metadata (which a backward compiled
    # lazily reads: "expected same # of fw and bw compiles, but found bucket -1" without it) and call the
    # compiled bucket for the next bucket's example inputs; AOTAutograd's first call of it returns fake
    # tensors for that (fakify_first_call), which otherwise reached the user's first real step instead.
    counters["aot_autograd"]["total"] += 1

    def compiler(kind: GraphKind, graph: torch.fx.GraphModule, inputs: Sequence[Any]) -> Callable:
        # Forward and inference graphs come out of the joint trace: its time is the capture time. The
        # backward graph was partitioned in the same trace, so it reports no capture time of its own.
        seconds = 0.0 if kind is GraphKind.BACKWARD else time.perf_counter() - start
        compile_start = time.perf_counter_ns()
        observer = _observer
        original = _copy(graph) if observer is not None else None
        runner, key = compile_graph(graph, inputs, kind, seconds)
        if observer is not None:
            runner = observer(kind, original, runner)
        if not cached:
            return runner
        reloadable = ReloadableGraph(runner, key, kind)
        reloadable._time_taken_ns = time.perf_counter_ns() - compile_start  # AOTAutogradCache's statistics
        return reloadable

    cached = cache_dir is not None and load_graph is not None
    if cached and authenticator is None:
        raise ValueError("AOTAutograd's cache holds pickles: it needs an authenticator")
    if cached:
        compilers = {
            kind: SerializableAOTDispatchCompiler(ReloadableGraph, functools.partial(compiler, kind))
            for kind in GraphKind
        }
    else:
        compilers = {kind: functools.partial(compiler, kind) for kind in GraphKind}

    # Attention is traced through its math formulation (see math_attention). AOTAutograd's common-subexpression pass on the joint graph is left out: ONNX Runtime's graph
    # optimizer eliminates common subexpressions in each model anyway, and the pass imports inductor's
    # pattern matcher and lowerings, which cost a process about 1.2 s and 40 MiB (measured here; the
    # benchmark's transformer layer partitions into the same graphs either way).
    # Views are recomputed in the backward graph rather than saved (recompute_views): an ONNX graph output
    # is a copy, so a saved view costs a copy that torch's view would not, while a view recomputed in the
    # backward graph is free or folds into the MatMul that reads it (with transposes decomposed to permute,
    # see decompositions.py; GPT step 0.97x, other benchmark models unchanged, alternating rounds).
    # Effect tokens (the check behind torch.linalg.inv, cholesky, solve: with_effects) are unlifted, as for
    # inductor: the graphs make their token (prims._make_token) and sink it, rather than taking it as an input
    # and returning it. AOTAutogradCache rebuilds no wrapper for lifted tokens, so a graph with one, reloaded
    # from the cache, got its inputs shifted by one and failed its run (the first step of every later process).
    # Our backward graphs donate no saved tensor (ONNX Runtime never writes into an input it was not told to),
    # and saying so keeps `backward(retain_graph=True)` working: AOTAutograd refuses a second backward of a
    # graph whose backward was compiled with donated buffers, and it compiles ours during the capture
    # (AOTAutograd's cache, symbolic sizes saved for the backward), where torch's lazy compile would have
    # cleared the list at a first backward that keeps the graph.
    with (
        math_attention(),
        linalg_checks_kept(),
        chunked_loss.backward_as_one_op(),
        functorch_config.patch(cse=False, recompute_views=True, unlift_effect_tokens=True),
        mock.patch.object(graph_compile, "collect_bw_donated_buffer_idxs", _no_donated_buffers),
        _aot_autograd_cache(cache_dir, load_graph, authenticator) if cached else contextlib.nullcontext(),
    ):
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=compilers[GraphKind.FORWARD],
            bw_compiler=compilers[GraphKind.BACKWARD],
            inference_compiler=compilers[GraphKind.INFERENCE],
            decompositions=decompositions,
            partition_fn=partition_function(partitioner),
            keep_inference_input_mutations=not _needs_autograd(gm, example_inputs),
        )


def _no_donated_buffers(*args: Any, **kwargs: Any) -> list[int]:
    """Stands in for AOTAutograd's ``collect_bw_donated_buffer_idxs`` in our captures: no saved tensor is
    donated to the backward graph (see capture)."""
    return []


def _needs_autograd(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    """Whether AOTAutograd makes forward and backward graphs of ``gm`` (its own test: grad mode, and a tensor
    among the parameters, buffers and inputs that requires grad) rather than one inference graph.

    An inference graph keeps a data mutation of an input as ``copy_(input, value)`` (a compiled optimizer
    step's parameters and state): the runtime has ONNX Runtime write the value into the input's memory where
    that is safe, instead of returning it for AOTAutograd's epilogue to copy in. Training graphs keep the
    epilogue: with the mutation in the forward graph, the min-cut partitioner (with recompute_views) may save
    the mutated input itself and recompute a view of its old value from it in the backward graph, which then
    reads the new value (``x.view(-1).add_(1); return (x * w).sum(0)`` gave w a gradient of x + 2).
    """
    if not torch.is_grad_enabled():
        return False
    tensors = (*gm.parameters(), *gm.buffers(), *example_inputs)
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


class _CacheKeyDetails(AOTAutogradCacheDetails):
    """What AOTAutogradCache keys an entry by, without inductor's part.

    torch's details also hash inductor's configuration and inductor's source, and import its lowerings
    and code generators to do so: about 0.6 s in a fresh process here, more than a hit saves. Our entries
    hold no inductor output. Kept: the Dynamo graph (its code, its submodules, its tensors' metadata), the
    inputs' metadata, AOTAutograd's configuration and settings, grad mode, autocast and deterministic
    algorithms, activation-checkpointing and saved-tensor-hook functions. (torch 2.11 and 2.12 hash inductor's
    part inline, with no method to leave it out: the key is as sound, and a compile with the cache on takes
    that much longer there.)

    Autocast's dtype per device is added here: torch 2.11 and 2.12 key by whether autocast is on, not by its
    dtype, and served a graph captured under bfloat16 autocast to a float16 one (its outputs bfloat16).
    """

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any, *rest: Any) -> None:
        super().__init__(gm, example_inputs, config, *rest)
        self.aot2onnx_autocast = {
            device: torch.get_autocast_dtype(device)
            for device in autocast_supported_devices()
            if torch.is_autocast_enabled(device)
        }

    def _init_fx_graph_hash_details(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], fx_config: Any
    ) -> None:
        self.gm = gm
        self.example_inputs = list(example_inputs)


def _cache_key(mod: Any, example_inputs: Sequence[Any], config: Any, *rest: Any) -> tuple[str, list[str]]:
    """Stands in for ``autograd_cache.autograd_cache_key`` in our captures (same safety checks, our details).

    ``rest``: inductor's settings (``compiler_config_extra``, ``fx_config`` in torch 2.11), which our details
    leave out, then what torch 2.14 adds to the details (``act_input_paths``), passed on to them.
    """
    gm = mod.gm if isinstance(mod, GmWrapper) else mod
    tracing_context = TracingContext.try_get()
    if tracing_context is not None and tracing_context.fakify_first_call:
        # DDPOptimizer's buckets: their first call must return fake tensors, which AOTAutograd arranges
        # only on a fresh compile (its FakifiedOutWrapper is not rebuilt from an entry). torch's own key
        # function refuses these graphs for the same reason; the graph cache still serves them.
        raise BypassAOTAutogradCache("a DDPOptimizer bucket (fakify_first_call) is compiled afresh")
    with sanitize_gm_for_cache(gm):
        for module in gm.modules():
            if isinstance(module, torch.fx.GraphModule):
                for node in module.graph.nodes:
                    check_node_safe(node)  # raises BypassAOTAutogradCache for what a key cannot cover
                    _check_builtin_op(node)
        details = _CacheKeyDetails(gm, example_inputs, config, {}, *rest[1:])
        return AOTAUTOGRAD_CACHE_PREFIX + AOTAutogradCachePickler(gm).get_hash(details), []


# Operator namespaces whose ops are torch's own: their meaning changes only with torch's version, which
# the cache directory covers.
_TORCH_NAMESPACES = frozenset({"aten", "prims", "rngprims", "higher_order", "profiler"})


def _check_builtin_op(node: torch.fx.Node) -> None:
    """A custom op (``torch.library``) makes a graph uncacheable here: the key holds its name, not its
    Python implementation, autograd formula or fake kernel, and a changed backward formula would reuse a
    stale backward graph. Such graphs still hit the graph cache."""
    target = node.target
    if node.op == "call_function" and isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        qualified = target.name() if isinstance(target, torch._ops.OpOverload) else target._qualified_op_name
        if qualified.split("::", 1)[0] not in _TORCH_NAMESPACES:
            raise BypassAOTAutogradCache(f"custom op {target}")


@contextlib.contextmanager
def _aot_autograd_cache(
    directory: str | os.PathLike, load_graph: GraphLoader, authenticator: Authenticator
) -> Iterator[None]:
    """AOTAutogradCache for one ``aot_module_simplified`` call, in ``directory``, holding whole entries.

    - Bundled entries: the compiled graphs are pickled into the entry (as ReloadableGraph keys), rather
      than looked up in inductor's FX graph cache.
    - The backward graph is compiled during the capture rather than at the first backward: AOTAutograd
      writes the entry once both graphs are compiled, and a backward compiled later would be compiled
      outside this block. A forward run under grad whose backward never runs still compiles it.
    - The entries go under ``directory`` instead of torch's cache directory: AOTAutograd's key does not
      cover our options or our source, so the directory does.
    - The key leaves out inductor's configuration and source (see ``_CacheKeyDetails``).
    - Entries are authenticated: each is written sealed with an HMAC over the pickle, its key and this
      directory's name, and read back only if the HMAC matches, before anything is unpickled (see
      ``_AuthenticatedEntries``). The remote cache (fbcode's) is off: nothing would authenticate its entries.

    The patches are process-wide while the block runs. Dynamo compiles under its global compile lock, so
    no other torch.compile capture (ours or inductor's) runs meanwhile.
    """
    entries = _AuthenticatedEntries(directory, authenticator)
    token = _LOADER.set(load_graph)
    try:
        with (
            functorch_config.patch(
                enable_autograd_cache=True,
                enable_remote_autograd_cache=False,
                bundled_autograd_cache=True,
                force_non_lazy_backward_lowering=True,
            ),
            mock.patch.object(AOTAutogradCache, "_get_tmp_dir", classmethod(lambda cls: os.fspath(directory))),
            mock.patch.object(autograd_cache, "autograd_cache_key", _cache_key),
            entries.patched(),
        ):
            yield
    finally:
        _LOADER.reset(token)


class _AuthenticatedEntries:
    """AOTAutogradCache's local reads and writes, with every entry sealed by an HMAC.

    torch writes an entry in ``_write_to_local_cache`` and reads entries in ``iterate_over_candidates``
    (``GuardedCache``'s, which ``_lookup`` reaches through ``find_guarded_entry``), where it unpickles every
    file under the key's directory. These replace both: a file is unpickled only if it opens with the
    authenticator, under the key and directory it was written for; one that does not is a miss, with a
    warning.
    """

    def __init__(self, directory: str | os.PathLike, authenticator: Authenticator) -> None:
        self.directory = os.fspath(directory)
        self.authenticator = authenticator
        self._label = os.fsencode(pathlib.Path(directory).name)

    def _names(self, key: str) -> tuple[bytes, ...]:
        return b"aot", self._label, key.encode()

    def write(self, key: str, content: bytes) -> None:
        subdir = os.path.join(self.directory, key)
        os.makedirs(subdir, exist_ok=True)
        # Named after the pickle's digest, as torch names its entries; written atomically by torch's helper.
        path = os.path.join(subdir, hashlib.sha256(content).hexdigest())
        autograd_cache.write_atomic(path, self.authenticator.seal(content, *self._names(key)))

    def candidates(self, local: bool, remote_cache: Any, key: str) -> Iterator[tuple[Any, bytes, bool]]:
        if not local:
            return
        subdir = os.path.join(self.directory, key)
        try:
            names = sorted(os.listdir(subdir))
        except OSError:
            return
        for name in names:
            if name.startswith("."):  # write_atomic's temporary files
                continue
            path = os.path.join(subdir, name)
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            content = self.authenticator.open(data, *self._names(key))
            if content is None:
                logger.warning(
                    "aot2onnx: ignoring AOTAutograd's cache entry %s: it does not authenticate (written by "
                    "someone else, altered, or from before entries were authenticated); not unpickled",
                    path,
                )
                continue
            try:
                entry = pickle.loads(content)
            except Exception:  # torch's own reader logs and skips an entry that does not unpickle
                logger.warning("aot2onnx: AOTAutograd's cache entry %s does not unpickle", path, exc_info=True)
                continue
            yield entry, content, True

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        def candidates(cls: type, local: bool, remote_cache: Any, key: str) -> Iterator[tuple[Any, bytes, bool]]:
            return self.candidates(local, remote_cache, key)

        with (
            mock.patch.object(AOTAutogradCache, "_write_to_local_cache", staticmethod(self.write)),
            mock.patch.object(AOTAutogradCache, "iterate_over_candidates", classmethod(candidates)),
        ):
            yield
