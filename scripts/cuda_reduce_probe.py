"""Which spelling of a batch norm's per-channel sum is fastest on ONNX Runtime's CUDA provider: ReduceSum over
(0, 2, 3) (cuDNN's reduction), the same after a Reshape to (N, C, H*W), the inner axis first, or a MatMul with
a column of ones (cuBLAS). Each variant's result is compared with torch's sum
times are CUDA-event medians of
200 runs with IO binding. Usage: python scripts/cuda_reduce_probe.py"""

import statistics

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

ort.preload_dlls()


def model(kind: str, shape):
    n, c, h, w = shape
    nodes, inits = [], []
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [c])

    def const(name, vals):
        inits.append(helper.make_tensor(name, TensorProto.INT64, [len(vals)], vals))

    if kind == "reduce023":
        const("ax", [0, 2, 3])
        nodes.append(helper.make_node("ReduceSum", ["x", "ax"], ["y"], keepdims=0))
    elif kind == "reshape_inner_then_batch":
        const("s", [n, c, h * w])
        const("a2", [2])
        const("a0", [0])
        nodes += [helper.make_node("Reshape", ["x", "s"], ["r"]),
                  helper.make_node("ReduceSum", ["r", "a2"], ["p"], keepdims=0),
                  helper.make_node("ReduceSum", ["p", "a0"], ["y"], keepdims=0)]
    elif kind == "reshape_02":
        const("s", [n, c, h * w])
        const("a", [0, 2])
        nodes += [helper.make_node("Reshape", ["x", "s"], ["r"]),
                  helper.make_node("ReduceSum", ["r", "a"], ["y"], keepdims=0)]
    elif kind == "matmul_ones":
        const("s", [n * c, h * w])
        const("s2", [n, c])
        const("a0", [0])
        inits.append(helper.make_tensor("ones", TensorProto.FLOAT, [h * w, 1], np.ones(h * w, np.float32)))
        nodes += [helper.make_node("Reshape", ["x", "s"], ["r"]),
                  helper.make_node("MatMul", ["r", "ones"], ["m"]),
                  helper.make_node("Reshape", ["m", "s2"], ["p"]),
                  helper.make_node("ReduceSum", ["p", "a0"], ["y"], keepdims=0)]
    elif kind == "transpose_reduce_last":
        const("s", [c, n * h * w])
        const("a", [1])
        nodes += [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2, 3]),
                  helper.make_node("Reshape", ["t", "s"], ["r"]),
                  helper.make_node("ReduceSum", ["r", "a"], ["y"], keepdims=0)]
    g = helper.make_graph(nodes, kind, [x], [y], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9).SerializeToString()


def time_session(blob, x):
    so = ort.SessionOptions()
    s = ort.InferenceSession(blob, so, providers=[("CUDAExecutionProvider", {"use_tf32": 0})])
    y = torch.empty(x.shape[1], device="cuda")
    b = s.io_binding()
    b.bind_input("x", "cuda", 0, np.float32, list(x.shape), x.data_ptr())
    b.bind_output("y", "cuda", 0, np.float32, [x.shape[1]], y.data_ptr())
    for _ in range(20):
        s.run_with_iobinding(b)
    torch.cuda.synchronize()
    times = []
    for _ in range(200):
        a, e = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        s.run_with_iobinding(b)
        e.record()
        e.synchronize()
        times.append(a.elapsed_time(e) * 1000)
    return statistics.median(times), y


def time_torch(x):
    for _ in range(20):
        x.sum((0, 2, 3))
    times = []
    for _ in range(200):
        a, e = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        x.sum((0, 2, 3))
        e.record()
        e.synchronize()
        times.append(a.elapsed_time(e) * 1000)
    return statistics.median(times)


kinds = ["reduce023", "reshape_02", "reshape_inner_then_batch", "matmul_ones", "transpose_reduce_last"]
print("shape | torch us | " + " | ".join(kinds) + "   (us, max rel err vs torch float64)")
for shape in [(32, 32, 64, 64), (32, 64, 32, 32), (32, 128, 16, 16), (32, 256, 8, 8), (128, 64, 56, 56)]:
    torch.manual_seed(0)
    x = torch.randn(*shape, device="cuda")
    ref = x.double().sum((0, 2, 3))
    row = [f"{time_torch(x):.1f}"]
    for k in kinds:
        t, y = time_session(model(k, shape), x)
        err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
        row.append(f"{t:.1f} ({err:.1e})")
    print(shape, "|", " | ".join(row), flush=True)
