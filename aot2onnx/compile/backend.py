"""The ``aot2onnx`` torch.compile backend: capture -> lower -> runtime."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import operator
import os
import pathlib
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import onnx
import torch
import torch.fx

from aot2onnx.capture import GraphKind, capture
from aot2onnx.compile.cache import (
    CachedGraph,
    GraphCache,
    default_cache_dir,
    environment_key,
    graph_key,
    package_fingerprint,
    rule_key,
    unkeyed_rule,
)
from aot2onnx.compile.fallback import FallbackGraph, blamed_nodes, split_unsupported, unsupported_targets
from aot2onnx.compile.graph_breaks import install as install_graph_break_notes
from aot2onnx.compile.graph_breaks import mark_backend
from aot2onnx.errors import LoweringError, RuntimeSessionError, UnsupportedOpError, source_line
from aot2onnx.lower.fusable import FUSED_WHEN
from aot2onnx.lower.registry import Registry, default_registry, fused_registry, user_rules
from aot2onnx.lower.seeds import reseed
from aot2onnx.options import Options
from aot2onnx.runtime import fused
from aot2onnx.runtime.kernels import require_runnable
from aot2onnx.runtime.session import OrtGraph
from aot2onnx.signature import LoweredGraph

if TYPE_CHECKING:
    from aot2onnx.lower.plan import GraphPlan

__all__ = ["backend", "aot2onnx_backend", "compile_fx"]

logger = logging.getLogger("aot2onnx")
_graph_ids = itertools.count()
# Dynamo leaves RNN modules and BatchNorm(momentum=None) to eager PyTorch without calling any backend: its
# compile callbacks tell the user, once per process (compile/graph_breaks.py).
install_graph_break_notes()


def backend(**options: Any) -> Callable:
    """A ``torch.compile`` backend configured with ``options`` (see :class:`aot2onnx.Options`)::

        torch.compile(model, backend=aot2onnx.backend(graph_optimization_level="extended"))
    """
    install_graph_break_notes()
    return mark_backend(functools.partial(compile_fx, options=Options.from_mapping(options)))


@mark_backend
def aot2onnx_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: Any = None) -> Callable:
    """The entry point registered as ``torch_dynamo_backends: aot2onnx``.

    ``torch.compile(m, backend="aot2onnx", options={...})`` passes the options mapping here.
    """
    if not isinstance(options, Options):
        options = Options.from_mapping(options)
    return compile_fx(gm, example_inputs, options=options)


def _graph_cache(options: Options) -> GraphCache | None:
    if not options.cache:
        return None
    directory = options.cache_dir or default_cache_dir()
    return GraphCache.open(directory) if directory else None


def _user_rule_keys() -> tuple[str, ...]:
    """The user's rules by everything their lowerings depend on (the values they read included), for the
    keys above the graph cache: AOTAutograd's entries name graphs by keys made with these rules."""
    return tuple(rule_key(rule) for rule in user_rules())


class _TableOnFirstUse(Mapping):
    """A decomposition table built when AOTAutograd first reads it.

    AOTAutograd reads the table only to trace: a capture that hits AOTAutograd's cache never does, and a
    process whose captures all hit saves building it (about 0.08 s).
    """

    def __init__(self, build: Callable[[], dict]) -> None:
        self._build = build
        self._table: dict | None = None

    def _get(self) -> dict:
        if self._table is None:
            self._table = self._build()
        return self._table

    def __getitem__(self, key: Any) -> Any:
        return self._get()[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


_decomposition_tables: dict[tuple, _TableOnFirstUse] = {}


def _uses_fused_kernels(device: torch.device, options: Options) -> bool:
    """Whether graphs on ``device`` lower to aot2onnx's fused kernels: CPU graphs, unless the options say not,
    where the library is built (said once where it is not)."""
    if device.type != "cpu" or not options.fused_kernels or options.providers not in (None, ("CPUExecutionProvider",)):
        return False
    fused.note_missing_once()
    return fused.library() is not None


def _registry(with_fused: bool) -> Registry:
    return fused_registry() if with_fused else default_registry()


def _decompositions(opset: int, cache: GraphCache | None, with_fused: bool) -> Mapping:
    """The decomposition table for what aot2onnx lowers at ``opset`` (with the fused kernels' ops, where the
    graphs use them), built on first use.

    Which ops lower is a property of the environment and the user's rules, so it is kept in the disk
    cache too: a later process then captures without building torch_lib's registry (about a second).
    """
    memo_key = (opset, _user_rule_keys(), fused.build_id() if with_fused else "none")
    if memo_key not in _decomposition_tables:

        def build() -> dict:
            key = environment_key("lowerable ops", *memo_key)
            from aot2onnx.lower.plan import decompositions, lowerable_ops

            names = cache.load_json(key) if cache is not None else None
            if names is None:
                names = lowerable_ops(default_registry(), opset)
                if cache is not None:
                    cache.store_json(key, names)
            return decompositions(default_registry(), opset, lowerable=names,
                                  kept_when=FUSED_WHEN if with_fused else None)

        _decomposition_tables[memo_key] = _TableOnFirstUse(build)
    return _decomposition_tables[memo_key]


def _device_of(example_inputs: Sequence[Any]) -> torch.device:
    devices = {x.device for x in example_inputs if isinstance(x, torch.Tensor)}
    accelerators = {d for d in devices if d.type != "cpu"}
    if len(accelerators) > 1:
        raise LoweringError(f"one compiled graph takes tensors on several devices: {sorted(map(str, devices))}")
    return next(iter(accelerators), torch.device("cpu"))


def _graph_label(gm: torch.fx.GraphModule) -> str:
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            _, module_type = next(iter(stack.values()))
            name = getattr(module_type, "__name__", None) or str(module_type).rsplit(".", 1)[-1]
            return "".join(c if c.isalnum() else "_" for c in name).strip("_") or "graph"
    return "graph"


def _aot_cache_dir(cache: GraphCache, options: Options, with_fused: bool) -> pathlib.Path:
    """Where AOTAutogradCache keeps this configuration's entries: its key covers the Dynamo graph, the
    inputs and torch's settings, and the directory covers the rest (options, user rules, our source, the fused
    kernels' build: they decide which ops the captured graphs keep whole)."""
    settings = repr(dataclasses.replace(options, cache_dir=None))
    kernels = fused.build_id() if with_fused else "none"
    return cache.directory / "aot" / environment_key("AOTAutograd", package_fingerprint(), settings, _user_rule_keys(),
                                                     kernels)


def compile_fx(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, options: Options) -> Callable:
    """Compiles a Dynamo graph: AOTAutograd captures it, and every graph it produces runs on ONNX Runtime."""
    install_graph_break_notes()  # again after a torch._dynamo.reset(), which removes Dynamo's callbacks
    device = _device_of(example_inputs)
    label = f"g{next(_graph_ids):03d}_{_graph_label(gm)}"
    cache = _graph_cache(options)
    with_fused = _uses_fused_kernels(device, options)

    def compile_graph(
        graph: torch.fx.GraphModule, inputs: Sequence[Any], kind: GraphKind, capture_s: float
    ) -> tuple[OrtGraph | FallbackGraph, str | None]:
        try:
            return _compile_graph(graph, f"{label}_{kind.value}", _Job(kind, device, options, cache, capture_s, with_fused))
        except (LoweringError, RuntimeSessionError) as e:
            if not isinstance(e, UnsupportedOpError):
                _raise_torch_refusal(graph, e)
            raise

    def load_graph(key: str, kind: GraphKind) -> OrtGraph:
        assert cache is not None
        start = time.perf_counter()
        cached = cache.load(key)
        if cached is None:
            raise LookupError(f"aot2onnx: the lowered {kind.value} graph {key} is not in the cache any more")
        job = _Job(kind, device, options, cache, 0.0, with_fused)
        return _start_cached(cached, f"{label}_{kind.value}", job, start, "cache hit, no capture")

    return capture(
        gm,
        example_inputs,
        compile_graph=compile_graph,
        decompositions=_decompositions(options.opset, cache, with_fused),
        partitioner=options.partitioner,
        load_graph=load_graph if cache is not None else None,
        cache_dir=_aot_cache_dir(cache, options, with_fused) if cache is not None else None,
        authenticator=cache.authenticator if cache is not None else None,
    )


@dataclasses.dataclass(frozen=True)
class _Job:
    """What every graph of one capture shares on its way to a session."""

    kind: GraphKind
    device: torch.device
    options: Options
    cache: GraphCache | None
    capture_s: float  # the capture's time, reported with the graph's
    with_fused: bool = False  # lowered with the fused kernels' rules (``runtime/fused.py``)

    @property
    def registry(self) -> Registry:
        return _registry(self.with_fused)


def _compile_graph(graph: torch.fx.GraphModule, name: str, job: _Job) -> tuple[OrtGraph | FallbackGraph, str | None]:
    """The graph's runner, and its key in the graph cache (``None`` where the cache cannot make it again).

    With ``options.fallback``, what ONNX Runtime cannot run goes to PyTorch: nodes without a lowering, and
    nodes whose lowering or session failed (see ``aot2onnx.compile.fallback``), after PyTorch's own error is raised
    where PyTorch refuses a node too.
    """
    options, start = job.options, time.perf_counter()
    views = symbolic_input_views(graph)
    if views:
        refusal = LoweringError(
            f"graph {name!r} returns a view of its input taken with sizes known only at run time; ONNX Runtime "
            "returns a copy, from which AOTAutograd would rebuild the view at offset 0. The view runs in PyTorch:\n"
            + "\n".join(f"    {node.format_node()}" for node in views)
        )
        if not options.fallback:
            raise refusal
        return _split(_plan(graph, job), name, job, refusal), None
    found = _lookup(graph, job)
    # Only whole lowerings are stored, so a hit needs neither the registry nor the plan (``lower/plan.py``).
    plan = None if found[1] is not None else _plan(graph, job)
    if plan is not None and options.fallback and unsupported_targets(plan):
        return _split(plan, name, job, None), None
    try:
        return _compile_whole(graph, name, job, found, start, plan)
    except (LoweringError, RuntimeSessionError) as e:
        if not options.fallback or isinstance(e, UnsupportedOpError):
            raise
        plan = plan or _plan(graph, job)  # a cached model ONNX Runtime refused: the nodes it names are the plan's
        _raise_torch_refusal(plan.gm, e, blamed_nodes(plan.gm, e))
        return _split(plan, name, job, e), None


def _plan(graph: torch.fx.GraphModule, job: _Job) -> GraphPlan:
    """The graph decided once: canonicalized (a copy), each node dispatched once. The whole graph's lowering
    and the fallback's split both read it."""
    from aot2onnx.lower.plan import plan_graph

    return plan_graph(graph, job.registry, job.options.opset)


def symbolic_input_views(graph: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The view ops of ``graph`` that make an output aliasing an input with a symbolic argument
    (``x.narrow(1, 1, x.shape[1] - 2)`` once Dynamo made the size dynamic, ``x[:, n.item():]``).

    AOTAutograd hands the caller such an output as a view of the input, rebuilt from what the compiled graph
    returned: by replaying the view where its arguments are plain numbers, else (``has_symbolic_inputs``) by
    ``as_strided`` with the returned tensor's strides and storage offset. ONNX Runtime returns a fresh copy,
    offset 0, so the rebuilt view started at the input's first element: other values than eager, silently.
    These nodes run in PyTorch instead, which returns the real view."""
    found: list[torch.fx.Node] = []
    output = next(n for n in reversed(graph.graph.nodes) if n.op == "output")
    for node in output.all_input_nodes:
        chain, symbolic = [], False
        while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.args:
            if node.target is operator.getitem:  # one output of a view op with several (split, unbind)
                node = node.args[0]
            elif getattr(node.target, "is_view", False):
                chain.append(node)
                symbolic = symbolic or any(arg is not node.args[0] for arg in node.all_input_nodes)
                node = node.args[0]
            else:
                break
        if chain and symbolic and isinstance(node, torch.fx.Node) and node.op == "placeholder":
            found.extend(n for n in chain if n not in found)
    return found


def _lookup(graph: torch.fx.GraphModule, job: _Job) -> tuple[str | None, CachedGraph | None]:
    """The graph's key in the graph cache and what the cache holds under it (``None, None`` without a cache)."""
    if job.cache is None:
        return None, None
    key = graph_key(graph, opset=job.options.opset, rules=list(user_rules()), device_type=job.device.type,
                    kernels=fused.build_id() if job.with_fused else "none")
    return key, job.cache.load(key)


def _split(plan: GraphPlan, name: str, job: _Job, failure: Exception | None) -> FallbackGraph:
    """The plan's graph split around what ONNX Runtime cannot run: its nodes without a lowering, and, where
    lowering or starting the whole graph failed with ``failure``, the nodes that error names."""

    def compile_partition(partition: torch.fx.GraphModule, partition_name: str) -> OrtGraph:
        try:
            start = time.perf_counter()
            found = _lookup(partition, job)
            part = plan.part(partition) if found[1] is None else None  # its nodes' decisions, made for the graph
            return _compile_whole(partition, partition_name, job, found, start, part)[0]
        except (LoweringError, RuntimeSessionError) as e:
            # PyTorch refuses the node ONNX Runtime refused: its error, as eager raises it.
            _raise_torch_refusal(partition, e, blamed_nodes(partition, e))
            raise  # the fallback runs the partition's nodes in PyTorch

    return split_unsupported(plan, name=name, compile_partition=compile_partition, failure=failure)


def _compile_whole(
    graph: torch.fx.GraphModule, name: str, job: _Job, found: tuple[str | None, CachedGraph | None], start: float,
    plan: GraphPlan | None = None,
) -> tuple[OrtGraph, str | None]:
    """The graph lowered whole (or loaded from the cache: ``found`` is :func:`_lookup`'s answer) and its
    session, with its key where the cache holds it; raises where the lowering or the session fails. ``plan``:
    the graph's plan where the caller made it (else the lowering makes it)."""
    options, cache = job.options, job.cache
    key, cached = found
    if cached is not None:
        return _start_cached(cached, name, job, start, "cache hit"), key
    from aot2onnx.lower.translate import lower_graph

    lowered = lower_graph(graph, name=name, opset=options.opset, registry=job.registry, device_type=job.device.type,
                          plan=plan)
    if options.check_model:
        try:
            onnx.checker.check_model(lowered.model)
        except onnx.checker.ValidationError as e:
            raise LoweringError(f"the lowered model of graph {name!r} fails onnx.checker: {e}") from e
    require_runnable(lowered.model, options.opset, name)
    lower_s = time.perf_counter() - start
    runner = _start_session(lowered, name, job, lower_s, "lowered")
    # Stored once ONNX Runtime has made a session of it: a model it refuses is not served to the next process.
    stored = (
        cache is not None
        and _storable(graph, name)
        and cache.store(key, lowered.model.SerializeToString(), lowered.signature, lowered.fx_node_count)
    )
    return runner, key if stored else None


def _storable(graph: torch.fx.GraphModule, name: str) -> bool:
    """Whether the graph cache may keep the lowering of ``graph`` (as lowered, its passes applied): not if a
    user rule it used reads a value that has no fingerprint, as a later process could not tell it changed."""
    unkeyed = unkeyed_rule(graph, user_rules())
    if unkeyed is None:
        return True
    rule, reason = unkeyed
    logger.debug(
        "aot2onnx: %s is not cached: the lowering rule %s depends on a value it cannot key: %s", name, rule.name, reason
    )
    return False


def _start_cached(cached: CachedGraph, name: str, job: _Job, start: float, how: str) -> OrtGraph:
    # Only whole lowerings are stored, so a hit needs neither the registry nor the fallback check, nor the
    # lowering's imports (onnxscript, torch's exporter): a process that only hits starts faster.
    model = reseed(onnx.load_from_string(cached.model_bytes))  # fresh seeds, as a new lowering gets
    lowered = LoweredGraph(model, cached.signature, cached.fx_node_count, len(model.graph.node))
    return _start_session(lowered, name, job, time.perf_counter() - start, how)


def _start_session(lowered: LoweredGraph, name: str, job: _Job, lower_s: float, how: str) -> OrtGraph:
    options = job.options
    if options.dump_dir:
        os.makedirs(options.dump_dir, exist_ok=True)
        path = os.path.join(options.dump_dir, f"{name}.onnx")
        onnx.save(lowered.model, path)
        logger.info("aot2onnx: wrote %s", path)
    start = time.perf_counter()
    runner = OrtGraph(
        lowered.model, lowered.signature, name=name, device=job.device, options=options, kind=job.kind,
        fx_node_count=lowered.fx_node_count,
    )
    session_s = time.perf_counter() - start
    logger.info(
        "aot2onnx: %s: %d FX nodes -> %d ONNX nodes; capture %.3fs, lowering %.3fs (%s), session %.3fs",
        name, lowered.fx_node_count, lowered.onnx_node_count, job.capture_s, lower_s, how, session_s,
    )
    return runner


# ---------------------------------------------------------------------------------------------------------
# PyTorch's own error for a graph that ONNX Runtime (or a lowering rule) refused


def _raise_torch_refusal(
    graph: torch.fx.GraphModule, error: Exception, nodes: Collection[torch.fx.Node] | None = None
) -> None:
    """Raises the error PyTorch's kernels give for the first node of ``graph`` (of ``nodes``) they refuse.

    The graph was traced with fake tensors, whose meta kernels skip some of the kernels' checks: torch's
    Python meta kernels for addmm and addmv are its decompositions and replace the C++ meta functions that
    compare dtypes, so an int64 input into a float ``nn.Linear`` is captured, and ONNX Runtime then refuses
    its Gemm ("bound to different types"). Run only after a failure: each node runs once with PyTorch's
    kernel on zeros of its inputs' dtypes and shapes, so it costs about one eager pass of the graph.

    Where the graph can fall back to PyTorch, ``nodes`` are the ones ``error`` names: PyTorch's error is
    raised only for the node ONNX Runtime refused too. Another node that fails on zeros (a Cholesky factor of
    a zero matrix) says nothing about the user's values; it runs in PyTorch like the rest.
    """
    if nodes is not None and not nodes:
        return
    from aot2onnx.capture._torch_compat import optimization_hint, unset_fake_temporarily

    class NoExample(Exception):
        pass

    def example(arg: torch.fx.Node) -> Any:
        value = arg.meta.get("val")
        if isinstance(value, torch.Tensor):
            shape = [optimization_hint(d) if isinstance(d, torch.SymInt) else d for d in value.shape]
            return torch.zeros(shape, dtype=value.dtype, device=value.device)
        if isinstance(value, torch.SymInt):
            return optimization_hint(value)
        if isinstance(value, (int, float, bool)):
            return value
        raise NoExample

    with unset_fake_temporarily(), torch.no_grad():
        for node in graph.graph.nodes:
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            if nodes is not None and node not in nodes:
                continue
            try:
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), example)
            except NoExample:  # an input without an example value (a constant attribute): not checked
                continue
            try:
                node.target(*args, **kwargs)
            except Exception as e:
                refused = e
                break
        else:
            return
    # The kernel's message first, as eager PyTorch gives it; then where it was, and what failed without it.
    where = source_line(node.meta.get("stack_trace"))
    message = (
        f"{refused}\n  This is PyTorch's error for {node.format_node()}, as eager PyTorch raises it: tracing with "
        "fake tensors does not make this check."
        + (f"\n  At {where}" if where else "")
        + f"\n  Without it, aot2onnx failed with: {(str(error).splitlines() or [type(error).__name__])[0]}"
    )
    try:
        replacement = type(refused)(message)
    except Exception:  # an exception type that takes other arguments
        replacement = RuntimeError(message)
    raise replacement from refused
