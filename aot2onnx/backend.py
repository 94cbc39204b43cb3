"""The ``aot2onnx`` torch.compile backend: capture -> lower -> runtime."""

from __future__ import annotations

import functools
import itertools
import logging
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import onnx
import torch
import torch.fx

from aot2onnx.capture import GraphKind, capture, decomposition_table
from aot2onnx.capture.fastpath import FASTPATH_DECOMPOSITIONS
from aot2onnx.errors import LoweringError
from aot2onnx.fallback import FallbackGraph, split_unsupported, unsupported_targets
from aot2onnx.lower.registry import Registry, default_registry
from aot2onnx.lower.translate import lower_graph
from aot2onnx.options import Options
from aot2onnx.runtime.session import OrtGraph

__all__ = ["backend", "aot2onnx_backend", "compile_fx"]

logger = logging.getLogger("aot2onnx")
_graph_ids = itertools.count()


def backend(**options: Any) -> Callable:
    """A ``torch.compile`` backend configured with ``options`` (see :class:`aot2onnx.Options`)::

        torch.compile(model, backend=aot2onnx.backend(graph_optimization_level="extended"))
    """
    return functools.partial(compile_fx, options=Options.from_mapping(options))


def aot2onnx_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: Any = None) -> Callable:
    """The entry point registered as ``torch_dynamo_backends: aot2onnx``.

    ``torch.compile(m, backend="aot2onnx", options={...})`` passes the options mapping here.
    """
    if not isinstance(options, Options):
        options = Options.from_mapping(options)
    return compile_fx(gm, example_inputs, options=options)


_decomposition_cache: weakref.WeakKeyDictionary[Registry, dict[int, dict]] = weakref.WeakKeyDictionary()


def _decompositions(registry: Registry, opset: int) -> dict:
    """The decomposition table for what ``registry`` lowers at ``opset`` (built once per registry)."""
    by_opset = _decomposition_cache.setdefault(registry, {})
    if opset not in by_opset:
        table = decomposition_table(t for t in registry.targets() if registry.supports(t, opset))
        by_opset[opset] = {**table, **FASTPATH_DECOMPOSITIONS}
    return by_opset[opset]


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


def compile_fx(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, options: Options) -> Callable:
    """Compiles a Dynamo graph: AOTAutograd captures it, and every graph it produces runs on ONNX Runtime."""
    registry = default_registry()
    device = _device_of(example_inputs)
    label = f"g{next(_graph_ids):03d}_{_graph_label(gm)}"

    def compile_graph(graph: torch.fx.GraphModule, inputs: Sequence[Any], kind: GraphKind, capture_s: float) -> OrtGraph:
        return _compile_graph(graph, f"{label}_{kind.value}", kind, device, options, registry, capture_s)

    return capture(
        gm,
        example_inputs,
        compile_graph=compile_graph,
        decompositions=_decompositions(registry, options.opset),
        partitioner=options.partitioner,
    )


def _compile_graph(
    graph: torch.fx.GraphModule,
    name: str,
    kind: GraphKind,
    device: torch.device,
    options: Options,
    registry: Registry,
    capture_s: float,
) -> OrtGraph | FallbackGraph:
    if options.fallback and unsupported_targets(graph, registry, options.opset):
        def compile_partition(partition: torch.fx.GraphModule, partition_name: str) -> OrtGraph:
            return _compile_lowerable(partition, partition_name, kind, device, options, registry, capture_s)

        return split_unsupported(
            graph, name=name, registry=registry, opset=options.opset, compile_partition=compile_partition
        )
    return _compile_lowerable(graph, name, kind, device, options, registry, capture_s)


def _compile_lowerable(
    graph: torch.fx.GraphModule,
    name: str,
    kind: GraphKind,
    device: torch.device,
    options: Options,
    registry: Registry,
    capture_s: float,
) -> OrtGraph:
    start = time.perf_counter()
    lowered = lower_graph(graph, name=name, opset=options.opset, registry=registry)
    if options.check_model:
        try:
            onnx.checker.check_model(lowered.model)
        except onnx.checker.ValidationError as e:
            raise LoweringError(f"the lowered model of graph {name!r} fails onnx.checker: {e}") from e
    lower_s = time.perf_counter() - start
    if options.dump_dir:
        os.makedirs(options.dump_dir, exist_ok=True)
        path = os.path.join(options.dump_dir, f"{name}.onnx")
        onnx.save(lowered.model, path)
        logger.info("aot2onnx: wrote %s", path)
    start = time.perf_counter()
    runner = OrtGraph(
        lowered.model, lowered.signature, name=name, device=device, options=options, kind=kind.value,
        fx_node_count=lowered.fx_node_count,
    )
    session_s = time.perf_counter() - start
    logger.info(
        "aot2onnx: %s: %d FX nodes -> %d ONNX nodes; capture %.3fs, lowering %.3fs, session %.3fs",
        name, lowered.fx_node_count, lowered.onnx_node_count, capture_s, lower_s, session_s,
    )
    return runner
