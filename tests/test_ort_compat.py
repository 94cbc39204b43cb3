"""Every private name of ONNX Runtime's Python package that aot2onnx uses is where it expects it, in the shape
it uses it: after an onnxruntime upgrade, this test names what moved."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from aot2onnx.runtime import _ort_compat as compat

PACKAGE = pathlib.Path(compat.__file__).parents[1]
PRIVATE_ATTRIBUTES = {attribute for _, attribute in compat.SYMBOLS.values()}


def _session() -> ort.InferenceSession:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "neg", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("name", sorted(compat.SYMBOLS))
def test_ort_symbol_is_where_aot2onnx_reads_it(name):
    owner, attribute = compat.SYMBOLS[name]
    instance = {"onnxruntime.IOBinding": lambda: _session().io_binding(),
                "onnxruntime.InferenceSession": _session,
                "onnxruntime.OrtDevice": lambda: ort.OrtDevice.make("cpu", 0),
                "onnxruntime": lambda: ort}[owner]()
    assert hasattr(instance, attribute), f"{owner}.{attribute} moved"


def test_the_binding_objects_run_a_model_as_aot2onnx_drives_them():
    # The calls session.py makes on them, with their argument order: a moved or reshaped method fails here.
    session = _session()
    binding, run, cpu = compat.c_binding(session), compat.c_run_with_iobinding(session), compat.c_device("cpu")
    x = np.array([1.0, -2.0, 0.0], dtype=np.float32)
    binding.bind_input("x", cpu, TensorProto.FLOAT, [3], x.ctypes.data)
    binding.bind_output("y", cpu)
    run(binding, ort.RunOptions())
    (y,) = binding.get_outputs()
    np.testing.assert_array_equal(y.numpy(), -x)
    binding.clear_binding_inputs()
    binding.clear_binding_outputs()


def test_the_one_call_objects_run_a_model_as_aot2onnx_drives_them():
    # runtime/one_call.py's calls: the inputs wrapped in one push_back_batch, the run, the outputs by DLPack.
    session = _session()
    feeds, fetches = compat.ort_value_vector(), compat.ort_value_vector()
    assert feeds is not None, "this onnxruntime has no OrtValueVector.push_back_batch"
    x = np.array([1.0, -2.0, 0.0], dtype=np.float32)
    feeds.push_back_batch([x], [x.ctypes.data], [np.float32], [[3]], [compat.c_device("cpu")])
    run = compat.c_run_with_ortvaluevector(session)
    run(ort.RunOptions(), ["x"], feeds, ["y"], fetches, [compat.c_device("cpu")])
    (capsule,) = fetches.to_dlpacks(None)
    import torch

    np.testing.assert_array_equal(torch.from_dlpack(capsule).numpy(), -x)


def test_a_missing_attribute_is_named():
    with pytest.raises(AttributeError, match=r"IOBinding\._not_there .*private to ONNX Runtime"):
        compat._read(_session().io_binding(), "_not_there")


def _private_ort_uses(tree: ast.AST, ort_names: set[str]) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("onnxruntime"):
            found += [f"from {node.module} import {a.name}" for a in node.names
                      if a.name.startswith("_") or "capi" in node.module]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("onnxruntime.")]
        elif isinstance(node, ast.Attribute):
            if node.attr in PRIVATE_ATTRIBUTES:
                found.append(f".{node.attr}")
            elif isinstance(node.value, ast.Name) and node.value.id in ort_names and (
                (node.attr.startswith("_") and not node.attr.startswith("__")) or node.attr == "capi"
            ):
                found.append(f"{node.value.id}.{node.attr}")
    return found


def test_no_other_module_reaches_ort_privates():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_ort_compat.py":
            continue
        tree = ast.parse(path.read_text())
        ort_names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
                     if a.name == "onnxruntime"}
        offenders += [f"{path.relative_to(PACKAGE)}: {u}" for u in _private_ort_uses(tree, ort_names)]
    assert offenders == []
