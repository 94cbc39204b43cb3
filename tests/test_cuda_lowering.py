"""What the CUDA path decides without a GPU at hand: graphs lowered for CUDA make ONNX Runtime copy no device
value to the host in the middle of a run, and compute bit for bit what the CPU lowering computes (run here on
ONNX Runtime's CPU provider, at ordinary and at special values); TF32 follows torch's settings per graph; the
CUDA graph's bookkeeping copies and refuses as it should. The GPU check (scripts/gpu_check.py) runs the rest
against eager on a GPU."""

from __future__ import annotations

import contextlib

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aot2onnx.compile.backend as backend
import aot2onnx.lower.translate as translate
from aot2onnx.options import Options
from aot2onnx.runtime import cuda
from aot2onnx.runtime.host_copies import cpu_fallbacks, host_round_trips
from aot2onnx.signature import FUSED_DOMAIN
from aot2onnx.tools.bench.models import make_batch

NAN, INF = float("nan"), float("inf")


@contextlib.contextmanager
def lowered_for(device_type: str, monkeypatch: pytest.MonkeyPatch):
    """Every graph compiled inside the block is lowered as for ``device_type`` (and run on the CPU provider),
    and its ONNX model collected. The fused kernels are used as the backend uses them on ``device_type``: on
    the CPU only."""
    models: list[onnx.ModelProto] = []
    original, original_fused = translate.lower_graph, backend._uses_fused_kernels

    def lower_graph(*args, **kwargs):
        kwargs["device_type"] = device_type
        lowered = original(*args, **kwargs)
        models.append(lowered.model)
        return lowered

    with monkeypatch.context() as m:
        m.setattr(translate, "lower_graph", lower_graph)
        m.setattr(backend, "_uses_fused_kernels",
                  lambda device, options: original_fused(torch.device(device_type), options))
        yield models


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn,
          **options) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot2onnx", options={"cache": False, **options})
    loss = loss_fn(compiled(x), y)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("name", ["mlp-s", "cnn-s", "encoder-s", "mobilenet-s"])
def test_cuda_lowering_makes_no_host_copies_and_matches_the_cpu_lowering(name, monkeypatch):
    model, x, y, loss_fn = make_batch(name)
    # Without the fused kernels, which the CUDA lowering has not (ATen's CPU kernels): what differs is the
    # rules' choices for the device.
    with lowered_for("cpu", monkeypatch):
        cpu_loss, cpu_grads = _step(model, x, y, loss_fn, fused_kernels=False)
    with lowered_for("cuda", monkeypatch) as cuda_models:
        cuda_loss, cuda_grads = _step(model, x, y, loss_fn)
    assert cuda_models and all(not host_round_trips(m) for m in cuda_models), [
        str(t) for m in cuda_models for t in host_round_trips(m)]
    # Nor does any node run on the CPU provider for want of a CUDA kernel.
    assert not [str(f) for m in cuda_models for f in cpu_fallbacks(m)]
    # Bit for bit: the CUDA lowering computes what the CPU lowering computes, minus its shortcuts.
    assert torch.equal(cpu_loss, cuda_loss)
    for c, g in zip(cpu_grads, cuda_grads, strict=True):
        assert torch.equal(c, g)


def test_cpu_lowering_has_the_host_copies_the_analysis_finds(monkeypatch):
    """The analysis finds what it is for: the CPU lowering's shortcuts are Ifs on device values (its standard
    operators: with the fused kernels, the layer norm is ATen's, unguarded)."""
    model, x, y, loss_fn = make_batch("encoder-s")
    with lowered_for("cpu", monkeypatch) as models:
        _step(model, x, y, loss_fn, fused_kernels=False)
    trips = [t for m in models for t in host_round_trips(m)]
    assert trips and all(t.op_type == "If" for t in trips)
    assert any("native_layer_norm" in t.fx_node for t in trips)


def test_host_round_trips_follows_shapes_onto_the_host():
    """A Reshape whose shape comes from Shape and integer arithmetic stays on the host; one whose shape is
    computed from a tensor's values needs a copy; a graph input bound in host memory needs none."""
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])
    n = onnx.helper.make_tensor_value_info("n", onnx.TensorProto.INT64, [1])
    out = [onnx.helper.make_tensor_value_info(f"y{i}", onnx.TensorProto.FLOAT, None) for i in range(3)]
    nodes = [
        onnx.helper.make_node("Shape", ["x"], ["s"]),
        onnx.helper.make_node("ReduceProd", ["s"], ["p"], keepdims=1),
        onnx.helper.make_node("Reshape", ["x", "p"], ["y0"]),  # host: Shape -> ReduceProd
        onnx.helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
        onnx.helper.make_node("Cast", ["m"], ["mi"], to=onnx.TensorProto.INT64),
        onnx.helper.make_node("Unsqueeze", ["mi", "zero"], ["mu"]),
        onnx.helper.make_node("Reshape", ["x", "mu"], ["y1"]),  # device: computed from x's values
        onnx.helper.make_node("Reshape", ["x", "n"], ["y2"]),  # as bound
    ]
    zero = onnx.numpy_helper.from_array(np.array([0], dtype=np.int64), "zero")
    model = onnx.helper.make_model(onnx.helper.make_graph(nodes, "g", [x, n], out, [zero]))
    assert [(t.node or t.value, t.input_index) for t in host_round_trips(model)] == [("mu", 1), ("n", 1)]
    assert [t.value for t in host_round_trips(model, host_inputs=["n"])] == ["mu"]


def _graph_model(nodes, inputs, outputs, opset: int = 18, initializers=()) -> onnx.ModelProto:
    graph = onnx.helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])


def _tensor(name: str, elem_type: int = onnx.TensorProto.FLOAT, shape=None) -> onnx.ValueInfoProto:
    return onnx.helper.make_tensor_value_info(name, elem_type, shape)


def test_cpu_fallbacks_finds_nodes_the_cuda_provider_has_no_kernel_for():
    """MaxUnpool has no CUDA kernel at all; ArgMax has none for int64 data; Upsample none for the version
    opset 18 selects (10; its kernels are 7-8 and 9); aot2onnx's fused kernels none. Their origins are named.
    CastLike has no kernel either, but its function's body runs in its place."""
    int64 = onnx.TensorProto.INT64
    unpool = onnx.helper.make_node("MaxUnpool", ["g", "i", "s"], ["u"], name="unpool", kernel_shape=[1, 1])
    unpool.metadata_props.add(key="pkg.torch.onnx.fx_node", value="%max_pool2d_with_indices_backward")
    nodes = [
        unpool,
        onnx.helper.make_node("ArgMax", ["n"], ["a"], name="argmax_int64"),
        onnx.helper.make_node("ArgMax", ["g"], ["b"], name="argmax_float"),
        onnx.helper.make_node("Upsample", ["g", "scales"], ["up"], name="upsample"),
        onnx.helper.make_node("ThresholdBackward", ["g", "g"], ["t"], name="fused", domain=FUSED_DOMAIN),
        onnx.helper.make_node("Relu", ["g"], ["r"], name="relu"),
        # No CUDA kernel, nor a CPU one: ONNX Runtime runs its function's body instead (Cast).
        onnx.helper.make_node("CastLike", ["n", "g"], ["c"], name="castlike"),
    ]
    scales = onnx.numpy_helper.from_array(np.ones(4, dtype=np.float32), "scales")
    model = _graph_model(nodes, [_tensor("g"), _tensor("i", int64), _tensor("s", int64), _tensor("n", int64)],
                         [_tensor(n) for n in ("u", "up", "t", "r", "c")] + [_tensor(n, int64) for n in ("a", "b")],
                         initializers=[scales])
    found = {f.node: f for f in cpu_fallbacks(model)}
    assert list(found) == ["unpool", "argmax_int64", "upsample", "fused"]
    assert found["unpool"].reason == "no CUDA kernel for this op"
    assert found["unpool"].fx_node == "%max_pool2d_with_indices_backward"
    assert "lowered from %max_pool2d_with_indices_backward" in str(found["unpool"])
    assert "T=int64" in found["argmax_int64"].reason
    assert "version 10" in found["upsample"].reason
    assert "fused" in found["fused"].reason


def test_cpu_fallbacks_reads_the_opset_types_and_subgraphs():
    """Against a table of two kernels: a kernel registered 13+ serves opset 18, one for 11-12 does not; an
    input of unknown type is not held against its node; a node whose inputs are all on the host (computed from
    shapes) runs there for free; a node inside an If branch is found."""
    kernels = {"domains": {"ai.onnx": {
        "Neg": {"inputs": ["T"], "outputs": ["T"], "kernels": [{"versions": [13, None], "types": {"T": ["float"]}}]},
        "Sign": {"inputs": ["T"], "outputs": ["T"], "kernels": [{"versions": [9, 12], "types": {"T": ["float"]}}]},
        "Shape": {"inputs": ["T"], "outputs": ["T1"], "kernels": [{"versions": [1, None], "types": {}}]},
        "If": {"inputs": ["B"], "outputs": ["V"], "kernels": [{"versions": [1, None], "types": {}}]},
    }}}
    branch = onnx.helper.make_graph([onnx.helper.make_node("Sign", ["x"], ["inner"], name="in_branch")], "b", [],
                                    [_tensor("inner")])
    nodes = [
        onnx.helper.make_node("Neg", ["x"], ["y"], name="neg"),
        onnx.helper.make_node("Sign", ["x"], ["z"], name="sign"),
        onnx.helper.make_node("Neg", ["d"], ["w"], name="neg_double"),
        onnx.helper.make_node("Neg", ["untyped"], ["v"], name="neg_untyped"),
        onnx.helper.make_node("Shape", ["x"], ["s"], name="shape"),
        onnx.helper.make_node("Sign", ["s"], ["ss"], name="sign_of_shape"),
        onnx.helper.make_node("If", ["c"], ["o"], name="if", then_branch=branch, else_branch=branch),
    ]
    inputs = [_tensor("x"), _tensor("d", onnx.TensorProto.DOUBLE), _tensor("c", onnx.TensorProto.BOOL),
              onnx.helper.make_tensor_value_info("untyped", onnx.TensorProto.UNDEFINED, None)]
    model = _graph_model(nodes, inputs, [_tensor(n) for n in ("y", "z", "w", "v", "o")])
    found = {f.node: f.reason for f in cpu_fallbacks(model, kernels=kernels)}
    assert list(found) == ["sign", "neg_double", "in_branch"]
    assert found["sign"] == "no CUDA kernel for version 13 (opset 18); kernels: 9-12"
    assert found["neg_double"] == "no CUDA kernel for T=double at version 13"
    # At opset 11 the Sign kernel serves (Sign-9 is the version opset 11 selects), Neg's 13+ does not.
    model.opset_import[0].version = 11
    assert [f.node for f in cpu_fallbacks(model, kernels=kernels)] == ["neg", "neg_double", "neg_untyped"]


@pytest.mark.parametrize(
    ("op_types", "settings", "expected"),
    [
        ({"MatMul", "Add"}, (False, True), False),  # torch's default: TF32 off for matmul
        ({"MatMul"}, (True, True), True),
        ({"Conv"}, (False, True), True),  # torch's default: TF32 on for cuDNN convolutions
        ({"Conv", "Gemm"}, (False, True), False),  # one switch in ONNX Runtime: off unless both allow it
        ({"Conv", "Gemm"}, (True, True), True),
        ({"Conv"}, (True, False), False),
        ({"Add", "Relu"}, (True, True), False),
    ],
)
def test_tf32_only_where_torch_allows_it_for_every_op_family(op_types, settings, expected):
    assert cuda.tf32_allowed(frozenset(op_types), settings) is expected


def test_tf32_follows_torch_settings():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert cuda.precision_settings()[0] is False
        assert not cuda.tf32_allowed(frozenset({"MatMul"}))
        torch.set_float32_matmul_precision("high")
        assert cuda.precision_settings()[0] is True
        assert cuda.tf32_allowed(frozenset({"MatMul"}))
        with torch.backends.cudnn.flags(allow_tf32=False):  # the setter refuses once a test froze the flags
            assert cuda.precision_settings() == (True, False)
            assert not cuda.tf32_allowed(frozenset({"MatMul", "Conv"}))
    finally:
        torch.set_float32_matmul_precision(before)


def test_provider_options_carry_precision_stream_and_memory(monkeypatch):
    class Stream:
        cuda_stream = 12345

    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: Stream())
    monkeypatch.setattr(cuda, "_share_arena", lambda index: None)
    monkeypatch.setattr(cuda, "_preloaded", True)
    device = torch.device("cuda", 0)
    plain = cuda.provider_options(device, Options(cuda_memory="session"), tf32=False, cuda_graph=False)
    assert plain == {"device_id": "0", "user_compute_stream": "12345", "use_tf32": "0",
                     "cudnn_conv_algo_search": "HEURISTIC"}
    shared = cuda.provider_options(device, Options(cuda_memory="shared"), tf32=False, cuda_graph=False)
    assert shared["arena_extend_strategy"] == "kSameAsRequested"
    torch_pool = cuda.provider_options(device, Options(), tf32=True, cuda_graph=False)  # the default
    assert torch_pool["use_tf32"] == "1" and "enable_cuda_graph" not in torch_pool
    external = ("gpu_external_alloc", "gpu_external_free", "gpu_external_empty_cache")
    assert all(int(torch_pool[k]) != 0 for k in external)
    # A CUDA graph keeps its own arena, whatever cuda_memory says: its replays write where its capture put
    # its intermediate values, which torch's pool or a shared arena would hand to other tensors.
    for memory in ("torch", "shared", "session"):
        graphed = cuda.provider_options(device, Options(cuda_memory=memory), tf32=False, cuda_graph=True)
        assert graphed == {"device_id": "0", "user_compute_stream": "12345", "use_tf32": "0", "enable_cuda_graph": "1",
                           "cudnn_conv_algo_search": "HEURISTIC", "arena_extend_strategy": "kSameAsRequested"}
        assert cuda.session_memory(Options(cuda_memory=memory), True) == "session"
    with pytest.raises(ValueError, match="cuda_memory"):
        Options(cuda_memory="pool")


def test_sessions_follow_torchs_algorithm_switches(monkeypatch):
    """cuDNN's algorithm as torch chooses it (heuristics unless benchmark is on), deterministic compute where
    torch asks for deterministic algorithms, and CUDA runs without ONNX Runtime's wait at their end."""
    class Stream:
        cuda_stream = 1

    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: Stream())
    monkeypatch.setattr(cuda, "_preloaded", True)
    device = torch.device("cuda", 0)
    assert cuda.algorithm_settings() == (False, False)
    cudnn = torch.backends.cudnn
    # the flags() context, as other tests may have called torch.backends.disable_global_flags()
    with cudnn.flags(enabled=cudnn.enabled, benchmark=True, deterministic=False, allow_tf32=cudnn.allow_tf32):
        search = cuda.provider_options(device, Options(cuda_memory="session"), tf32=False, cuda_graph=False)
        assert search["cudnn_conv_algo_search"] == "EXHAUSTIVE"
    with cudnn.flags(enabled=cudnn.enabled, benchmark=True, deterministic=True, allow_tf32=cudnn.allow_tf32):
        assert cuda.algorithm_settings() == (True, True)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert cuda.algorithm_settings()[1] is True
    finally:
        torch.use_deterministic_algorithms(before)
    from aot2onnx.runtime.session import session_options
    assert session_options(Options(), deterministic=True).use_deterministic_compute
    assert not session_options(Options()).use_deterministic_compute
    for run in (cuda.run_options(), cuda.run_options(gpu_graph_id="-1")):
        assert run.get_run_config_entry("disable_synchronize_execution_providers") == "1"
    assert cuda.run_options(gpu_graph_id="2").get_run_config_entry("gpu_graph_id") == "2"


def _model(inputs: dict[str, list], outputs: dict[str, list], nodes=(), dtype=onnx.TensorProto.FLOAT) -> onnx.ModelProto:
    graph = onnx.helper.make_graph(
        list(nodes), "g",
        [onnx.helper.make_tensor_value_info(n, dtype, s) for n, s in inputs.items()],
        [onnx.helper.make_tensor_value_info(n, dtype, s) for n, s in outputs.items()],
    )
    return onnx.helper.make_model(graph)


def test_cuda_graph_refusals():
    relu = [onnx.helper.make_node("Relu", ["x"], ["y"])]
    static = _model({"x": [2, 3]}, {"y": [2, 3]}, relu)
    ops = cuda.graph_op_types(static)
    assert cuda.graph_refusal(static, ops, frozenset({"Dropout"}), False) is None
    assert "sizes as inputs" in cuda.graph_refusal(static, ops, frozenset(), True)
    dynamic = _model({"x": ["batch", 3]}, {"y": ["batch", 3]}, relu)
    assert "run time" in cuda.graph_refusal(dynamic, ops, frozenset(), False)
    dropout = _model({"x": [2, 3]}, {"y": [2, 3]}, [onnx.helper.make_node("Dropout", ["x"], ["y"])])
    assert "random" in cuda.graph_refusal(dropout, cuda.graph_op_types(dropout), frozenset({"Dropout"}), False)


def test_graphed_runs_pin_stable_inputs_copy_the_others_and_recapture_when_one_moves():
    model = _model({"w": [3], "x": [3]}, {"y": [3]}, [onnx.helper.make_node("Add", ["w", "x"], ["y"])])
    runs = cuda.GraphedRuns("g", model, ["w", "x"], ["y"], torch.device("cpu"))
    w = torch.ones(3)
    assert not runs.warmup([w, torch.zeros(3)])
    x = torch.full((3,), 2.0)
    assert runs.warmup([w, x])
    bound: dict[str, int] = {}

    def bind(name, tensor):
        bound[name] = tensor.data_ptr()

    runs.setup([w, x], bind, bind)
    assert runs.ready and runs.graph_run.get_run_config_entry("gpu_graph_id") == "0"
    assert bound["w"] == w.data_ptr() and bound["x"] != x.data_ptr()  # the parameter pinned, x copied
    later = torch.full((3,), 5.0)
    assert runs.moved([w, later]) == ([], False)
    runs.copy_in([w, later])
    assert torch.equal(runs._buffers[0], later)
    runs._out[0].copy_(torch.arange(3.0))  # as a replay would write it
    (out,) = runs.copy_out(range(0))
    assert torch.equal(out, torch.arange(3.0)) and out.data_ptr() != runs._out[0].data_ptr()
    assert runs.moved([w, torch.zeros(4)]) == ([], True)
    # The parameter moved: copied from now on, in a graph captured anew under the next id.
    w2 = w.clone()
    assert runs.moved([w2, later]) == ([0], False)
    assert runs.recapture([0])
    runs.setup([w2, later], bind, bind)
    assert bound["w"] != w2.data_ptr() and runs.graph_run.get_run_config_entry("gpu_graph_id") == "1"
    while runs.captures < cuda._CAPTURES:
        runs.setup([w2, later], bind, bind)
    assert not runs.recapture([1])
    runs.stop("test")
    assert not runs.ready and runs.stopped == "test"


def test_constant_outputs_are_those_of_constants_and_static_shapes():
    """What ONNX Runtime would fold into an initializer (whose copy into a bound output synchronizes the
    device, which a capture cannot hold): outputs of constants and of shapes alone, not of input data or
    random numbers."""
    nodes = [
        onnx.helper.make_node("Shape", ["x"], ["shape"]),
        onnx.helper.make_node("ReduceMin", ["shape"], ["smallest"], keepdims=0),
        onnx.helper.make_node("Constant", [], ["c"], value_int=3),
        onnx.helper.make_node("Add", ["c", "smallest"], ["from_constants"]),
        onnx.helper.make_node("ReduceMin", ["x"], ["from_data"], keepdims=0),
        onnx.helper.make_node("RandomNormal", [], ["noise"], shape=[2]),
    ]
    model = _model({"x": [2, 3]}, {"from_constants": [], "from_data": [], "noise": [2]}, nodes,
                   dtype=onnx.TensorProto.INT64)
    assert cuda.constant_outputs(model, frozenset({"RandomNormal"})) == {"from_constants"}


def test_gpt_lowered_for_cuda_has_its_position_check_constant(monkeypatch):
    """The GPT's position embedding looks up ``arange``: the index check the lowering returns for it is a
    constant (the one that broke the first capture on an H100), the token embedding's is not."""
    from aot2onnx.runtime.session import RANDOM_OPS
    from aot2onnx.tools.bench.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab=64, dim=32, heads=2, layers=1, context=8)
    with lowered_for("cuda", monkeypatch) as models, torch.no_grad():
        torch._dynamo.reset()
        torch.compile(model, backend="aot2onnx", options={"cache": False})(torch.randint(0, 64, (2, 8)))
    (lowered,) = models
    extra = [o.name for o in lowered.graph.output][1:]  # the logits, then the two embeddings' checks
    assert len(extra) == 2
    assert cuda.constant_outputs(lowered, RANDOM_OPS) & set(extra) == {extra[1]}


def test_graphed_runs_serve_constant_outputs_from_a_plain_run():
    model = _model({"x": [3]}, {"y": [3], "c": [3], "check": []}, [
        onnx.helper.make_node("Relu", ["x"], ["y"]),
        onnx.helper.make_node("Constant", [], ["c"], value_floats=[1.0, 2.0, 3.0]),
        onnx.helper.make_node("Constant", [], ["check"], value_float=0.0),
    ])
    runs = cuda.GraphedRuns("g", model, ["x"], ["y", "c", "check"], torch.device("cpu"),
                            constant=frozenset({"c", "check"}), host=frozenset({"check"}))
    x = torch.ones(3)
    assert runs.remembers and not runs.warmup([x]) and not runs.warmup([x])  # no plain run's values yet
    runs.remember([torch.zeros(3), torch.tensor([1.0, 2.0, 3.0]), torch.tensor(0.0)])
    assert not runs.remembers and runs.warmup([x])
    bound: list[str] = []
    runs.setup([x], lambda name, t: None, lambda name, t: bound.append(name))
    assert bound == ["y"] and runs.capturing  # the constants are left out of the capture
    runs._out[0].copy_(torch.full((3,), 7.0))
    y, c, check = runs.copy_out(range(0))
    assert torch.equal(y, torch.full((3,), 7.0)) and torch.equal(c, torch.tensor([1.0, 2.0, 3.0]))
    assert c.data_ptr() != runs._remembered[1].data_ptr()  # the caller's own tensor
    assert check.device.type == "cpu" and float(check) == 0.0


class _FakeCudart:
    """cudaStreamIsCapturing / cudaStreamEndCapture / cudaGraphDestroy / cudaGetLastError, recorded."""

    def __init__(self, status: int):
        self.status, self.calls = status, []

    def cudaStreamIsCapturing(self, stream, status):
        self.calls.append("is_capturing")
        status._obj.value = self.status
        return 0

    def cudaStreamEndCapture(self, stream, graph):
        self.calls.append("end_capture")
        graph._obj.value = 1234
        self.status = 0
        return 907  # cudaErrorStreamCaptureInvalidated: the capture ends all the same

    def cudaGraphDestroy(self, graph):
        self.calls.append("destroy")
        return 0

    def cudaGetLastError(self):
        self.calls.append("clear")
        return 0


@pytest.mark.parametrize("status", [0, 2])
def test_a_failed_capture_is_ended_so_the_stream_takes_work_again(status, monkeypatch):
    fake = _FakeCudart(status)
    monkeypatch.setattr(cuda, "_cudart_lib", fake)
    stream = type("Stream", (), {"cuda_stream": 99})()
    assert cuda.end_failed_capture(stream)
    expected = ["is_capturing", "end_capture", "destroy", "clear", "is_capturing"] if status else [
        "is_capturing", "clear", "is_capturing"]
    assert fake.calls == expected
    monkeypatch.setattr(cuda, "_cudart_lib", False)  # no CUDA runtime in this process: nothing to end
    assert not cuda.end_failed_capture(stream)


@pytest.mark.parametrize("special", [NAN, INF, -INF])
def test_cuda_lowering_keeps_special_values(special, monkeypatch):
    """The rare cases the CPU lowering guards with an If run unconditionally on CUDA: NaN and infinities in a
    layer norm, a max pool and a ReLU gradient come out as eager's."""

    def fn(x, w):
        h = F.layer_norm(x, (8,), w)
        h = F.max_pool1d(h, 2)
        return F.relu(h @ torch.ones(4, 4)).sum(-1)

    x = torch.randn(64, 4, 8)
    x[3, 1, 2] = special
    w = torch.randn(8)
    results = {}
    for device_type in ("cpu", "cuda"):
        with lowered_for(device_type, monkeypatch):
            xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
            torch._dynamo.reset()
            # The CPU lowering without the fused kernels, which the CUDA lowering has not.
            out = torch.compile(fn, backend="aot2onnx", options={"cache": False, "fused_kernels": False})(xc, wc)
            out.sum().backward()
            results[device_type] = (out.detach(), xc.grad, wc.grad)
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    eager = fn(xe, we)
    eager.sum().backward()
    for a, b in zip(results["cpu"], results["cuda"]):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
    assert torch.equal(results["cuda"][0].isnan(), eager.detach().isnan())


def test_max_pool_backward_scatters_on_cuda_with_the_cpu_lowerings_values(monkeypatch):
    """Non-overlapping float32 windows: the CPU lowering places the gradient with MaxUnpool, which the CUDA
    provider has no kernel for; the CUDA lowering scatter-adds it, each position once, so the values are the
    same, NaN and infinities included, and eager's to the bit (ATen adds to zeros too: a -0.0 gradient comes
    out +0.0, where MaxUnpool keeps its sign)."""

    def fn(x, g):
        return (F.max_pool2d(x, 2) * g).sum()

    x = torch.randn(2, 3, 8, 8)
    g = torch.randn(2, 3, 4, 4)
    g[0, 0, 0, :3] = torch.tensor([NAN, INF, -0.0])
    grads, models = {}, {}
    for device_type in ("cpu", "cuda"):
        with lowered_for(device_type, monkeypatch) as models[device_type]:
            xc = x.clone().requires_grad_()
            torch._dynamo.reset()
            torch.compile(fn, backend="aot2onnx", options={"cache": False})(xc, g).backward()
        grads[device_type] = xc.grad
    op_types = {d: {n.op_type for m in ms for n in m.graph.node} for d, ms in models.items()}
    assert "MaxUnpool" in op_types["cpu"] and "MaxUnpool" not in op_types["cuda"]
    assert "ScatterElements" in op_types["cuda"]
    assert not [str(f) for m in models["cuda"] for f in cpu_fallbacks(m)]
    xe = x.clone().requires_grad_()
    fn(xe, g).backward()
    cpu, cuda = grads["cpu"], grads["cuda"]
    assert torch.equal(cpu.isnan(), cuda.isnan()) and torch.equal(torch.nan_to_num(cpu), torch.nan_to_num(cuda))
    assert torch.equal(cuda.view(torch.int32), xe.grad.view(torch.int32))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: (x > 0).any(dim=1),
        lambda x: (x > 0).any(),
        lambda x: (x > 0).to(torch.uint8).any(dim=0),
        lambda x: (x > 0).all(dim=2),
        lambda x: (x > 0).amax(dim=-1),
    ],
    ids=["any-dim", "any", "any-uint8", "all-dim", "amax-bool"],
)
def test_truth_reductions_run_on_cuda_with_the_cpu_lowerings_values(fn, monkeypatch):
    """any/all/amax of truth values reduce one-byte values on the CPU; the CUDA provider's ReduceMax has no
    uint8 kernel, so the CUDA lowering reduces int32 ones, to the same result."""
    x = torch.randn(4, 5, 6)
    x[0] = -1.0
    results = {}
    for device_type in ("cpu", "cuda"):
        with lowered_for(device_type, monkeypatch) as models:
            torch._dynamo.reset()
            results[device_type] = torch.compile(fn, backend="aot2onnx", options={"cache": False})(x)
        if device_type == "cuda":
            assert models and not [str(f) for m in models for f in cpu_fallbacks(m)]
    expected = fn(x)
    for result in results.values():
        assert result.dtype == expected.dtype and torch.equal(result, expected)


def test_stream_order_waits_only_where_streams_differ(monkeypatch):
    """A plain CUDA session's runs stay on its stream; under another current stream each waits for the other's
    work (events, no host wait)."""
    waits = []

    class Stream:
        def __init__(self, handle):
            self.cuda_stream = handle

        def wait_stream(self, other):
            waits.append((self.cuda_stream, other.cuda_stream))

    session_stream, current = Stream(1), Stream(1)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    order = cuda.StreamOrder(torch.device("cuda", 0), session_stream)
    assert order.before_run() is None
    order.after_run(None)
    assert waits == []
    current = Stream(2)
    other = order.before_run()
    assert other is current and waits == [(1, 2)]
    order.after_run(other)
    assert waits == [(1, 2), (2, 1)]


def _run_all(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    model = onnx.ModelProto.FromString(model.SerializeToString())
    model.ir_version = min(model.ir_version, 10)  # an older onnxruntime (torch 2.11's set-up) reads up to 13
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_per_channel_reductions_split_in_two_steps(dtype):
    """ReduceSum and ReduceMean over every axis but 1, kept dims or not, rank 3 to 5, with axes written
    negative: each taken in two steps, with the one-step result's shape and its value up to reordered
    additions; a NaN and an infinity reach the same channel's result as before."""
    from aot2onnx.runtime.rewrites import split_channel_reductions

    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    cases = [((4, 3, 5), [0, 2]), ((4, 3, 5, 6), [0, 2, 3]), ((2, 3, 4, 5, 6), [0, -3, -2, -1])]
    nodes, inputs, outputs, inits, feeds = [], [], [], [], {}
    rng = np.random.default_rng(0)
    for k, (shape, axes) in enumerate(cases):
        inputs.append(_tensor(f"x{k}", elem, list(shape)))
        inits.append(onnx.numpy_helper.from_array(np.array(axes, dtype=np.int64), f"axes{k}"))
        value = rng.standard_normal(shape).astype(dtype) * 100
        value[1, 0, 1], value[0, 2, 0] = np.nan, np.inf
        feeds[f"x{k}"] = value
        for op in ("ReduceSum", "ReduceMean"):
            for keep in (0, 1):
                out = f"{op}_{k}_{keep}"
                nodes.append(onnx.helper.make_node(op, [f"x{k}", f"axes{k}"], [out], keepdims=keep))
                outputs.append(_tensor(out, elem))
    model = _graph_model(nodes, inputs, outputs, initializers=inits)
    split, count = split_channel_reductions(model)
    assert count == len(nodes)
    assert sum(n.op_type.startswith("Reduce") for n in split.graph.node) == 2 * len(nodes)
    for before, after in zip(_run_all(model, feeds), _run_all(split, feeds), strict=True):
        assert before.shape == after.shape and before.dtype == after.dtype
        np.testing.assert_allclose(after, before, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=0)
        np.testing.assert_array_equal(np.isnan(after), np.isnan(before))
        np.testing.assert_array_equal(np.isinf(after), np.isinf(before))


def test_reductions_the_split_leaves():
    """Not split: a 16-bit input (its partial sums would round to 16 bits between the steps), unknown or zero
    sizes, axes that include axis 1 or leave out another, axes computed in the graph, rank 2."""
    from aot2onnx.runtime.rewrites import split_channel_reductions

    f16, f32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    inputs = [_tensor("h", f16, [2, 3, 4]), _tensor("d", f32, ["n", 3, 4]), _tensor("z", f32, [0, 3, 4]),
              _tensor("x", f32, [2, 3, 4, 5]), _tensor("m", f32, [2, 3]), _tensor("a", onnx.TensorProto.INT64, [2])]
    inits = [onnx.numpy_helper.from_array(np.array(v, dtype=np.int64), n)
             for n, v in [("ax02", [0, 2]), ("ax012", [0, 1, 2, 3]), ("ax03", [0, 3]), ("ax0", [0])]]
    nodes = [onnx.helper.make_node("ReduceSum", [x, axes], [f"o{k}"])
             for k, (x, axes) in enumerate([("h", "ax02"), ("d", "ax02"), ("z", "ax02"), ("x", "ax012"),
                                            ("x", "ax03"), ("m", "ax0"), ("x", "a")])]
    outputs = [_tensor(f"o{k}", f16 if k == 0 else f32) for k in range(len(nodes))]
    model = _graph_model(nodes, inputs, outputs, initializers=inits)
    assert split_channel_reductions(model) == (model, 0)


def test_split_reductions_train_a_cnn_as_before(monkeypatch):
    """The CUDA lowering of a CNN (batch norms and biased convolutions), its per-channel reductions split as
    CUDA sessions split them, run here on the CPU provider: loss and gradients as the unsplit graphs' to
    float32's reordering."""
    import aot2onnx.runtime.session as session_module
    from aot2onnx.runtime.rewrites import split_channel_reductions

    model, x, y, loss_fn = make_batch("cnn-s")
    with lowered_for("cuda", monkeypatch):
        loss, grads = _step(model, x, y, loss_fn)
    splits = []
    original = session_module.compute_in_float

    def compute_then_split(m):
        m, count = original(m)
        m, split = split_channel_reductions(m)
        splits.append(split)
        return m, count

    monkeypatch.setattr(session_module, "compute_in_float", compute_then_split)
    with lowered_for("cuda", monkeypatch):
        split_loss, split_grads = _step(model, x, y, loss_fn)
    assert sum(splits) >= 2 * 2  # at least two batch norms' statistics forward, their sums backward
    torch.testing.assert_close(split_loss, loss, rtol=1e-6, atol=0)
    for g, s in zip(grads, split_grads, strict=True):
        torch.testing.assert_close(s, g, rtol=2e-5, atol=1e-6)
