"""ONNX control flow for rules: a Loop, and an If, whose bodies are traced like a rule's own nodes."""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Callable, Iterator, Sequence

import onnx_ir as ir
import onnxscript
from onnxscript import opset18 as op

from aot2onnx.lower.recorder import Recorder

__all__ = ["cond", "for_device", "loop", "on_device"]

_bodies = itertools.count()

# Whether the graph being lowered runs on an accelerator (ONNX Runtime's CUDA provider), where an If's
# condition lives in device memory: ONNX Runtime copies it to the host before it can choose a branch, a wait
# for everything queued on the stream before it (aot2onnx.runtime.host_copies).
_on_device: contextvars.ContextVar[bool] = contextvars.ContextVar("aot2onnx_lowering_on_device", default=False)


@contextlib.contextmanager
def for_device(device_type: str) -> Iterator[None]:
    """Rules inside the block lower for tensors of ``device_type`` (``"cpu"``, ``"cuda"``)."""
    token = _on_device.set(device_type != "cpu")
    try:
        yield
    finally:
        _on_device.reset(token)


def on_device() -> bool:
    """Whether the graph being lowered runs on an accelerator, where a rule avoids values the host must read."""
    return _on_device.get()


def _trace(body: Callable[[], Sequence[ir.Value]], prefix: str) -> ir.Graph:
    """The graph of the values ``body()`` returns, with no inputs of its own: it reads the enclosing graph's."""
    recorder = Recorder(onnxscript.evaluator.default().opset, {})
    with onnxscript.evaluator.default_as(recorder):
        results = body()
        outputs = [op.Identity(v) for v in results]
    for output, value in zip(outputs, results):
        if value.dtype is None:
            raise ValueError(f"{prefix} returns {value.name or 'a value'} without a dtype; set its dtype")
        output.dtype = value.dtype
    # Names must be unique across the model and its subgraphs (SSA); see loop().
    for i, value in enumerate(v for node in recorder.nodes for v in node.outputs):
        value.name = f"{prefix}_{i}"
    return ir.Graph([], outputs, nodes=recorder.nodes, name=prefix)


def cond(condition: ir.Value, then_branch: Callable[[], Sequence[ir.Value]],
         else_branch: Callable[[], Sequence[ir.Value]], *, exact_then: bool = False) -> list[ir.Value]:
    """``then_branch()`` where the boolean scalar ``condition`` holds, else ``else_branch()``, as one If.

    Only the branch taken runs, so a rare case can cost nothing when it does not occur. Each branch builds
    its nodes like a rule and may read values of the enclosing graph; both return as many values, of the
    same dtypes, each with its dtype set.

    On a device (:func:`on_device`) the condition would be a wait for the GPU, so there is no If: with
    ``exact_then`` (``then_branch()`` is right whatever the condition, ``else_branch()`` a shortcut for the
    common case) the then-branch alone runs, else both do and a Where picks one's values.
    """
    if on_device():
        if exact_then:
            return list(then_branch())
        chosen = []
        for then_value, else_value in zip(then_branch(), else_branch(), strict=True):
            value = op.Where(condition, then_value, else_value)
            value.dtype = then_value.dtype
            chosen.append(value)
        return chosen
    prefix = f"if{next(_bodies)}"
    then_graph, else_graph = _trace(then_branch, f"{prefix}_then"), _trace(else_branch, f"{prefix}_else")
    node = ir.node("If", [condition], attributes={"then_branch": then_graph, "else_branch": else_graph},
                   num_outputs=len(then_graph.outputs))
    onnxscript.evaluator.default().nodes.append(node)
    for result, value in zip(node.outputs, then_graph.outputs):
        result.dtype = value.dtype
    return list(node.outputs)


def loop(trip_count: int | ir.Value, carried: Sequence[ir.Value], body: Callable, *, iteration: bool = False,
         scanned: int = 0, condition: ir.Value | None = None) -> list[ir.Value]:
    """``carried = body(*carried)`` (or ``body(i, *carried)``, i an int64 scalar) ``trip_count`` times, as one Loop.

    Unrolled, iterative algorithms make graphs of thousands of nodes, which the ONNX optimizer takes minutes
    over; a Loop keeps one iteration's nodes. The body may read values of the enclosing graph, and every
    carried value must have its dtype set. With ``scanned``, the body returns that many values more after the
    carried ones (dtypes set), and the Loop stacks each one's values of every iteration along a new first
    axis: the last carried values are returned, then the stacked ones.

    With ``condition`` (a boolean scalar), the Loop runs while it holds, at most ``trip_count`` times: the body
    returns the next condition first, then the carried values (an iterative method that stops once every
    element has converged).
    """
    outer = onnxscript.evaluator.default()
    recorder = Recorder(outer.opset, {})
    counter = ir.Value(name=None, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    running = ir.Value(name=None, type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    inputs = [ir.Value(name=None, type=ir.TensorType(v.dtype)) for v in carried]
    with onnxscript.evaluator.default_as(recorder):
        results = body(counter, *inputs) if iteration else body(*inputs)
        if condition is None:
            keep_going = op.Identity(running)
        else:
            keep_going, *results = results
            keep_going = op.Identity(keep_going)
        outputs = [op.Identity(v) for v in results]
    assert len(outputs) == len(carried) + scanned, "the body returns the carried values, then the scanned ones"
    for output, value in zip(outputs, [*inputs, *results[len(carried):]]):
        if value.dtype is None:
            raise ValueError(f"a loop body's scanned value {value.name or ''} has no dtype; set its dtype")
        output.dtype = value.dtype
    keep_going.dtype = ir.DataType.BOOL
    # Names must be unique across the model and its subgraphs (SSA), and onnx_ir names unnamed values
    # per graph: name the body's values here.
    prefix = f"loop{next(_bodies)}"
    for i, value in enumerate([counter, running, *inputs]):
        value.name = f"{prefix}_in{i}"
    for i, value in enumerate(v for node in recorder.nodes for v in node.outputs):
        value.name = f"{prefix}_{i}"
    graph = ir.Graph([counter, running, *inputs], [keep_going, *outputs], nodes=recorder.nodes, name=prefix)
    if isinstance(trip_count, int):
        trip_count = op.Constant(value_int=trip_count)
    # The node is built directly: the exporter's recorder cannot bind Loop's variadic inputs.
    node = ir.node("Loop", [trip_count, condition, *carried], attributes={"body": graph},
                   num_outputs=len(carried) + scanned)
    outer.nodes.append(node)
    for result, value in zip(node.outputs, outputs):
        result.dtype = value.dtype
    return list(node.outputs)
