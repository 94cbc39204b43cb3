"""A standalone reproducer of one divergent node: its ONNX nodes as a model, its inputs, PyTorch's answer."""

from __future__ import annotations

import dataclasses
import pathlib
import textwrap
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from aot2onnx.runtime.dtypes import TORCH_TO_ONNX

if TYPE_CHECKING:
    from aot2onnx.tools.parity.nodes import NodeParity

__all__ = ["Reproducer", "make_reproducer"]


@dataclasses.dataclass
class Reproducer:
    """The ONNX nodes that compute a node's value from the values before it, with those values and PyTorch's
    result of the node on them. bfloat16 values (which numpy lacks) cross the model's boundary as float32."""

    node: str  # NodeParity.describe()
    model: onnx.ModelProto
    inputs: dict[str, np.ndarray]
    expected: dict[str, np.ndarray]

    def write(self, directory: str | pathlib.Path) -> list[pathlib.Path]:
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        onnx.save(self.model, directory / "node.onnx")
        np.savez(directory / "inputs.npz", **self.inputs)
        np.savez(directory / "expected.npz", **self.expected)
        (directory / "repro.py").write_text(_SCRIPT.format(node=textwrap.indent(self.node, "    ").strip()))
        return [directory / name for name in ("node.onnx", "inputs.npz", "expected.npz", "repro.py")]


_SCRIPT = '''"""Reproducer of a node where ONNX Runtime and PyTorch part (written by aot2onnx.parity).

    {node}

node.onnx holds the ONNX nodes lowered from it, inputs.npz the values its inputs had in the compiled run, and
expected.npz what PyTorch's kernel returns on exactly those values. Run: python repro.py
"""

import pathlib

import numpy as np
import onnxruntime as ort

here = pathlib.Path(__file__).parent
session = ort.InferenceSession(str(here / "node.onnx"), providers=["CPUExecutionProvider"])
inputs = dict(np.load(here / "inputs.npz"))
expected = dict(np.load(here / "expected.npz"))
names = [o.name for o in session.get_outputs()]
for name, got in zip(names, session.run(names, inputs)):
    want = expected[name].astype(np.float64)
    got = got.astype(np.float64)
    nan = int((np.isnan(got) != np.isnan(want)).sum())
    diff = np.abs(np.nan_to_num(got - want, nan=0.0))
    rel = diff / np.maximum(np.abs(want), np.finfo(np.float64).tiny)
    print(f"{{name}}: shape {{list(got.shape)}}, max |onnxruntime - torch| = {{diff.max():.3e}}, "
          f"max relative {{np.nanmax(rel):.3e}}, NaN on one side only: {{nan}}")
'''


def _outer_names(graph: onnx.GraphProto) -> set[str]:
    """The values a subgraph (an If branch, a Loop body) reads from the scope around it."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    read = set()
    for node in graph.node:
        read.update(i for i in node.input if i and i not in defined)
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs):
                read.update(n for n in _outer_names(sub) if n not in defined)
        defined.update(node.output)
    return read


def _array(value: torch.Tensor) -> np.ndarray:
    value = value.detach().cpu()
    if value.dtype == torch.bfloat16:
        value = value.to(torch.float32)
    return value.contiguous().numpy()


def make_reproducer(
    model: onnx.ModelProto, expected: Mapping[str, torch.Tensor], values: Mapping[str, Any], node: NodeParity
) -> Reproducer:
    """The nodes of ``model`` between the values ``values`` holds and the outputs ``expected`` names."""
    producers = {out: n for n in model.graph.node for out in n.output if out}
    initializers = {t.name: t for t in model.graph.initializer}
    keep: set[int] = set()
    inputs: list[str] = []
    constants: list[TensorProto] = []
    seen: set[str] = set()
    stack = list(expected)
    while stack:
        name = stack.pop()
        if not name or name in seen:
            continue
        seen.add(name)
        if name in values and name not in expected:
            inputs.append(name)
        elif name in initializers:
            constants.append(initializers[name])
        elif name in producers:
            producer = producers[name]
            keep.add(id(producer))
            stack.extend(producer.input)
            for attribute in producer.attribute:
                for sub in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs):
                    stack.extend(_outer_names(sub))
        else:
            inputs.append(name)  # a graph input without a recorded value: the model says what it needs
    nodes = [n for n in model.graph.node if id(n) in keep]
    graph_inputs, casts = [], []
    arrays = {}
    for name in sorted(inputs):
        value = values[name]
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(value)
        if value.dtype == torch.bfloat16:  # numpy has no bfloat16: given as float32, cast inside
            graph_inputs.append(helper.make_tensor_value_info(f"{name}__float32", TensorProto.FLOAT, list(value.shape)))
            casts.append(helper.make_node("Cast", [f"{name}__float32"], [name], to=TensorProto.BFLOAT16))
            arrays[f"{name}__float32"] = _array(value)
        else:
            graph_inputs.append(helper.make_tensor_value_info(name, TORCH_TO_ONNX[value.dtype], list(value.shape)))
            arrays[name] = _array(value)
    graph_outputs, wanted = [], {}
    for name, value in expected.items():
        if value.dtype == torch.bfloat16:
            casts_out = helper.make_node("Cast", [name], [f"{name}__float32"], to=TensorProto.FLOAT)
            nodes.append(casts_out)
            name = f"{name}__float32"
            graph_outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(value.shape)))
        else:
            graph_outputs.append(helper.make_tensor_value_info(name, TORCH_TO_ONNX[value.dtype], list(value.shape)))
        wanted[name] = _array(value)
    graph = helper.make_graph(casts + nodes, f"{node.fx_name}_reproducer", graph_inputs, graph_outputs, constants)
    sub = helper.make_model(graph, opset_imports=list(model.opset_import), functions=list(model.functions),
                            ir_version=model.ir_version, producer_name="aot2onnx.parity")
    return Reproducer(node.describe(), sub, arrays, wanted)
