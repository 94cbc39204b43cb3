"""ONNX control flow for rules: a Loop whose body is traced like a rule's own nodes."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import onnx_ir as ir
import onnxscript
from onnxscript import opset18 as op
from torch.onnx._internal.exporter import _building

__all__ = ["loop"]

_bodies = itertools.count()


def loop(trip_count: int | ir.Value, carried: Sequence[ir.Value], body: Callable, *, iteration: bool = False) -> list[ir.Value]:
    """``carried = body(*carried)`` (or ``body(i, *carried)``, i an int64 scalar) ``trip_count`` times, as one Loop.

    Unrolled, iterative algorithms make graphs of thousands of nodes, which the ONNX optimizer takes minutes
    over; a Loop keeps one iteration's nodes. The body may read values of the enclosing graph, and every
    carried value must have its dtype set.
    """
    outer = onnxscript.evaluator.default()
    recorder = _building.OpRecorder(outer.opset, {})
    counter = ir.Value(name=None, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    condition = ir.Value(name=None, type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    inputs = [ir.Value(name=None, type=ir.TensorType(v.dtype)) for v in carried]
    with onnxscript.evaluator.default_as(recorder):
        results = body(counter, *inputs) if iteration else body(*inputs)
        outputs = [op.Identity(v) for v in results]
        keep_going = op.Identity(condition)
    for output, value in zip(outputs, inputs):
        output.dtype = value.dtype
    keep_going.dtype = ir.DataType.BOOL
    # Names must be unique across the model and its subgraphs (SSA), and onnx_ir names unnamed values
    # per graph: name the body's values here.
    prefix = f"loop{next(_bodies)}"
    for i, value in enumerate([counter, condition, *inputs]):
        value.name = f"{prefix}_in{i}"
    for i, value in enumerate(v for node in recorder.nodes for v in node.outputs):
        value.name = f"{prefix}_{i}"
    graph = ir.Graph([counter, condition, *inputs], [keep_going, *outputs], nodes=recorder.nodes, name=prefix)
    if isinstance(trip_count, int):
        trip_count = op.Constant(value_int=trip_count)
    # The node is built directly: the exporter's recorder cannot bind Loop's variadic inputs.
    node = ir.node("Loop", [trip_count, None, *carried], attributes={"body": graph}, num_outputs=len(carried))
    outer.nodes.append(node)
    for result, value in zip(node.outputs, carried):
        result.dtype = value.dtype
    return list(node.outputs)
