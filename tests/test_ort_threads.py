"""ONNX Runtime's CPU kernels that add or compare into one place from many updates, at one thread and at
several: the ones the lowering emits give the one-thread bits on more threads (ScatterElements, Col2Im), and
the one that does not (ScatterND with a reduction, which loses updates when two threads hit one row:
onnxruntime#18048) is among ``serial_nodes``, whose graphs run on one thread. Sized where ONNX Runtime
splits the work among threads; a change of ONNX Runtime that parallelizes another of them fails here."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from aot2onnx.runtime.rewrites import serial_nodes

ROWS, COLS, UPDATES = 512, 256, 4096  # 1M updates into 128K places: each place hit 8 times on average


def _model(node, inputs, output_shape):
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, output_shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model


def _runs(model, feeds, threads: int, times: int = 5) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return [session.run(None, feeds)[0] for _ in range(times)]


@pytest.mark.parametrize("reduction", ["add", "max", "min", "mul"])
def test_scatter_elements_reductions_give_the_one_thread_bits_on_more_threads(reduction):
    rng = np.random.default_rng(0)
    index = rng.integers(0, ROWS, (UPDATES, COLS))
    updates = rng.standard_normal((UPDATES, COLS)).astype(np.float32)
    if reduction == "mul":
        updates = (1 + updates / 64).astype(np.float32)
    node = helper.make_node("ScatterElements", ["data", "index", "updates"], ["out"], axis=0, reduction=reduction)
    model = _model(node, [helper.make_tensor_value_info("data", TensorProto.FLOAT, [ROWS, COLS]),
                          helper.make_tensor_value_info("index", TensorProto.INT64, [UPDATES, COLS]),
                          helper.make_tensor_value_info("updates", TensorProto.FLOAT, [UPDATES, COLS])], [ROWS, COLS])
    feeds = {"data": np.ones((ROWS, COLS), np.float32), "index": index, "updates": updates}
    (one,) = _runs(model, feeds, 1, times=1)
    for threads in (2, 4):
        for out in _runs(model, feeds, threads):
            np.testing.assert_array_equal(out, one)
    assert serial_nodes(model) == []


def test_col2im_gives_the_one_thread_bits_on_more_threads():
    n, c, h, w, k = 4, 32, 48, 48, 3
    positions = (h - k + 1) * (w - k + 1)
    graph_inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, c * k * k, positions])]
    node = helper.make_node("Col2Im", ["x", "image", "block"], ["out"])
    graph = helper.make_graph([node], "g", graph_inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, [n, c, h, w])],
                              initializer=[helper.make_tensor("image", TensorProto.INT64, [2], [h, w]),
                                           helper.make_tensor("block", TensorProto.INT64, [2], [k, k])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    feeds = {"x": np.random.default_rng(0).standard_normal((n, c * k * k, positions)).astype(np.float32)}
    (one,) = _runs(model, feeds, 1, times=1)
    for out in _runs(model, feeds, 2):
        np.testing.assert_array_equal(out, one)
    assert serial_nodes(model) == []


@pytest.mark.parametrize("reduction", ["add", "max", "min", "mul"])
def test_a_scatter_nd_with_a_reduction_runs_on_one_thread(reduction):
    node = helper.make_node("ScatterND", ["data", "index", "updates"], ["out"], name="rows", reduction=reduction)
    model = _model(node, [helper.make_tensor_value_info("data", TensorProto.FLOAT, [ROWS, COLS]),
                          helper.make_tensor_value_info("index", TensorProto.INT64, [UPDATES, 1]),
                          helper.make_tensor_value_info("updates", TensorProto.FLOAT, [UPDATES, COLS])], [ROWS, COLS])
    assert serial_nodes(model) == ["rows"]
