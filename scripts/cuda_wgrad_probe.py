"""Which spelling of a 3x3 convolution's weight gradient (stride 1, padding 1) is fastest on ONNX Runtime's CUDA
provider: the input unfolded by a one-hot grouped convolution then multiplied per sample (aot2onnx's CPU
choice), the batch as the channel axis of one convolution, or the input unfolded by nine Slices, multiplied
per sample or as one GEMM over the folded batch. Each against torch's convolution_backward (float64 reference
for the error); times are CUDA-event medians of 100 runs with IO binding, TF32 off in both.
Usage: python scripts/cuda_wgrad_probe.py"""

import statistics

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

ort.preload_dlls()
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False


def model(kind, n, c, o, h, w):
    nodes, inits = [], []

    def const(name, vals):
        inits.append(helper.make_tensor(name, TensorProto.INT64, [len(vals)], vals))

    def node(op, ins, outs, **kw):
        nodes.append(helper.make_node(op, ins, outs, **kw))

    p = h * w
    if kind == "onehot_conv":
        eye = np.tile(np.eye(9, dtype=np.float32).reshape(9, 1, 3, 3), (c, 1, 1, 1))
        inits.append(helper.make_tensor("eye", TensorProto.FLOAT, list(eye.shape), eye.reshape(-1)))
        const("s1", [n, c * 9, p])
        const("s2", [n, o, p])
        const("a0", [0])
        const("sw", [o, c, 3, 3])
        node("Conv", ["x", "eye"], ["cols4"], pads=[1, 1, 1, 1], group=c)
        node("Reshape", ["cols4", "s1"], ["cols"])
        node("Reshape", ["dy", "s2"], ["d"])
        node("Transpose", ["d"], ["dt"], perm=[0, 2, 1])
        node("MatMul", ["cols", "dt"], ["m"])
        node("ReduceSum", ["m", "a0"], ["t"], keepdims=0)
        node("Transpose", ["t"], ["tt"], perm=[1, 0])
        node("Reshape", ["tt", "sw"], ["y"])
    elif kind == "batch_as_channel":
        node("Transpose", ["x"], ["xt"], perm=[1, 0, 2, 3])
        node("Transpose", ["dy"], ["dyt"], perm=[1, 0, 2, 3])
        node("Conv", ["xt", "dyt"], ["g"], pads=[1, 1, 1, 1])
        node("Transpose", ["g"], ["y"], perm=[1, 0, 2, 3])
    elif kind in ("slices", "slices_one_gemm"):
        const("pads", [0, 0, 1, 1, 0, 0, 1, 1])
        const("ax", [2, 3])
        const("u", [2])
        node("Pad", ["x", "pads"], ["xp"])
        parts = []
        for i in range(3):
            for j in range(3):
                const(f"st{i}{j}", [i, j])
                const(f"en{i}{j}", [i + h, j + w])
                node("Slice", ["xp", f"st{i}{j}", f"en{i}{j}", "ax"], [f"s{i}{j}"])
                node("Unsqueeze", [f"s{i}{j}", "u"], [f"q{i}{j}"])
                parts.append(f"q{i}{j}")
        node("Concat", parts, ["cols5"], axis=2)
        const("sw", [o, c, 3, 3])
        if kind == "slices":
            const("s1", [n, c * 9, p])
            const("s2", [n, o, p])
            const("a0", [0])
            node("Reshape", ["cols5", "s1"], ["cols"])
            node("Reshape", ["dy", "s2"], ["d"])
            node("Transpose", ["d"], ["dt"], perm=[0, 2, 1])
            node("MatMul", ["cols", "dt"], ["m"])
            node("ReduceSum", ["m", "a0"], ["t"], keepdims=0)
        else:
            const("s1", [n, c * 9, p])
            const("s1b", [c * 9, n * p])
            const("s2", [n, o, p])
            const("s2b", [n * p, o])
            node("Reshape", ["cols5", "s1"], ["cols"])
            node("Transpose", ["cols"], ["colst"], perm=[1, 0, 2])
            node("Reshape", ["colst", "s1b"], ["c2"])
            node("Reshape", ["dy", "s2"], ["d"])
            node("Transpose", ["d"], ["dt"], perm=[0, 2, 1])
            node("Reshape", ["dt", "s2b"], ["d2"])
            node("MatMul", ["c2", "d2"], ["t"])
        node("Transpose", ["t"], ["tt"], perm=[1, 0])
        node("Reshape", ["tt", "sw"], ["y"])
    g = helper.make_graph(nodes, kind, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, c, h, w]),
                                        helper.make_tensor_value_info("dy", TensorProto.FLOAT, [n, o, h, w])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [o, c, 3, 3])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9).SerializeToString()


def timed(fn):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(100):
        a, e = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        fn()
        e.record()
        e.synchronize()
        times.append(a.elapsed_time(e) * 1000)
    return statistics.median(times)


def session_fn(blob, x, dy, y):
    s = ort.InferenceSession(blob, providers=[("CUDAExecutionProvider", {"use_tf32": 0,
                                                                          "cudnn_conv_algo_search": "HEURISTIC"})])
    b = s.io_binding()
    b.bind_input("x", "cuda", 0, np.float32, list(x.shape), x.data_ptr())
    b.bind_input("dy", "cuda", 0, np.float32, list(dy.shape), dy.data_ptr())
    b.bind_output("y", "cuda", 0, np.float32, list(y.shape), y.data_ptr())
    return lambda: s.run_with_iobinding(b)


kinds = ["onehot_conv", "batch_as_channel", "slices", "slices_one_gemm"]
print("x -> dy | torch us | " + " | ".join(kinds) + "   (us, max error / max |dW|)")
for n, c, o, h in [(32, 3, 32, 64), (32, 32, 64, 32), (32, 64, 128, 16), (16, 64, 64, 56)]:
    torch.manual_seed(0)
    x, dy = torch.randn(n, c, h, h, device="cuda"), torch.randn(n, o, h, h, device="cuda")
    wt = torch.empty(o, c, 3, 3, device="cuda")
    ref = torch.ops.aten.convolution_backward(dy.double(), x.double(), wt.double(), None, [1, 1], [1, 1], [1, 1],
                                              False, [0, 0], 1, [False, True, False])[1]

    def eager(dy=dy, x=x, wt=wt):
        return torch.ops.aten.convolution_backward(dy, x, wt, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                                   [False, True, False])

    row = [f"{timed(eager):.1f}"]
    for k in kinds:
        y = torch.empty(o, c, 3, 3, device="cuda")
        try:
            t = timed(session_fn(model(k, n, c, o, h, h), x, dy, y))
            row.append(f"{t:.1f} ({((y.double() - ref).abs().max() / ref.abs().max()).item():.1e})")
        except Exception as e:  # a variant ONNX Runtime refuses
            row.append(f"failed: {str(e)[:80]}")
    print(f"{(n, c, h, h)} -> {(n, o, h, h)} | " + " | ".join(row), flush=True)
