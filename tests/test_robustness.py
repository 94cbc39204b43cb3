"""Inputs at the edges: artifacts whose files point elsewhere, ONNX external data in functions, dtypes that
fake tensors let through capture, and empty batches. Each compares with eager PyTorch or with what eager
PyTorch raises.
"""

from __future__ import annotations

import pathlib
import shutil
from collections.abc import Callable

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import helper

import aot2onnx
from aot2onnx.artifact import edge
from aot2onnx.errors import ArtifactError, RuntimeSessionError

RTOL, ATOL = 1e-5, 1e-6  # float32: one step of a 4 -> 3 linear layer, or sums over empty batches
LR = 0.1


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.lin(x), y)


def _net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> pathlib.Path:
    out_dir = tmp_path_factory.mktemp("net_sgd")
    aot2onnx.export_training(_net(), _batch(6, 1), out_dir, optimizer=aot2onnx.optim.SGD(lr=LR))
    return out_dir


@pytest.fixture
def artifact(exported, tmp_path) -> pathlib.Path:
    path = tmp_path / "artifact"
    shutil.copytree(exported, path)
    return path


READERS: dict[str, tuple[Callable, type[Exception]]] = {
    "aot2onnx.load": (aot2onnx.load, ArtifactError),
    "edge.Trainer": (edge.Trainer, edge.ArtifactError),
}


def _refused(reader: str, path: pathlib.Path, match: str) -> None:
    load, error = READERS[reader]
    with pytest.raises(error, match=match) as info:
        load(path)
    assert isinstance(info.value, ValueError)


def _assert_trains_like_eager(reader: str, path: pathlib.Path) -> None:
    """One step from the artifact: the loss and the gradients (aot2onnx.load) or the SGD update (edge) match
    eager PyTorch's."""
    x, y = _batch(8, 2)
    eager = _net()
    eager_loss = eager(x, y)
    eager_loss.backward()
    if reader == "aot2onnx.load":
        loaded = aot2onnx.load(path)
        loss = loaded(x, y)
        loss.backward()
        torch.testing.assert_close(loss, eager_loss, rtol=RTOL, atol=ATOL)
        for name, p in eager.named_parameters():
            torch.testing.assert_close(loaded.get_parameter(name).grad, p.grad, rtol=RTOL, atol=ATOL)
    else:
        trainer = edge.Trainer(path)
        loss = trainer.step(x.numpy(), y.numpy())
        torch.testing.assert_close(torch.tensor(loss), eager_loss.detach(), rtol=RTOL, atol=ATOL)
        for name, p in eager.named_parameters():
            torch.testing.assert_close(
                torch.from_numpy(trainer.state[name]), (p - LR * p.grad).detach(), rtol=RTOL, atol=ATOL
            )


# ---------------------------------------------------------------------------------------------------------
# (a) Every file a reader opens stays inside the artifact directory, symbolic links followed


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("file", ["signature.json", "state.safetensors"])
def test_refuses_a_symlink_to_a_file_outside_the_artifact(reader, file, artifact, tmp_path):
    # The file outside is a valid copy: a reader that follows the link would load it without complaint.
    outside = tmp_path / "elsewhere" / file
    outside.parent.mkdir()
    shutil.move(artifact / file, outside)
    (artifact / file).symlink_to(outside)
    what = {"signature.json": "signature", "state.safetensors": "state"}[file]
    _refused(
        reader,
        artifact,
        f"the {what} file is '{file}', which resolves to .*elsewhere.*, outside the artifact directory",
    )


@pytest.mark.parametrize("reader", list(READERS))
def test_symlinks_inside_the_artifact_are_followed(reader, artifact):
    for file in ("signature.json", "state.safetensors"):
        (artifact / "store").mkdir(exist_ok=True)
        shutil.move(artifact / file, artifact / "store" / file)
        (artifact / file).symlink_to(pathlib.Path("store") / file)
    _assert_trains_like_eager(reader, artifact)


@pytest.mark.parametrize("reader", list(READERS))
def test_an_artifact_reached_through_a_symlinked_directory_loads(reader, artifact, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(artifact, target_is_directory=True)
    _assert_trains_like_eager(reader, link)


# ---------------------------------------------------------------------------------------------------------
# (b) External data is checked wherever ONNX can hold a tensor, functions included


def _external_tensor(location: str) -> onnx.TensorProto:
    tensor = onnx.TensorProto(name="stolen", data_type=onnx.TensorProto.FLOAT, dims=[4])
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=location)
    return tensor


def _function_with(where: str, tensor: onnx.TensorProto) -> onnx.FunctionProto:
    """A function adding a constant: the constant's tensor in a node attribute, in a subgraph of one, or in the
    default value of the function's own attribute."""
    opset = [helper.make_opsetid("", 18)]
    if where == "node attribute":
        body = [helper.make_node("Constant", [], ["c"], value=tensor)]
    elif where == "subgraph":
        branch = helper.make_graph(
            [helper.make_node("Constant", [], ["inner"], value=tensor)],
            "branch",
            [],
            [helper.make_tensor_value_info("inner", onnx.TensorProto.FLOAT, [4])],
        )
        body = [
            helper.make_node(
                "Constant", [], ["cond"], value=helper.make_tensor("t", onnx.TensorProto.BOOL, [], [True])
            ),
            helper.make_node("If", ["cond"], ["c"], then_branch=branch, else_branch=branch),
        ]
    else:
        constant = helper.make_node("Constant", [], ["c"])
        constant.attribute.append(onnx.AttributeProto(name="value", ref_attr_name="v", type=onnx.AttributeProto.TENSOR))
        body = [constant]
    function = helper.make_function(
        "test.robustness",
        "AddConstant",
        ["x"],
        ["y"],
        [*body, helper.make_node("Add", ["x", "c"], ["y"])],
        opset,
        attributes=["v"] if where == "attribute default" else [],
    )
    if where == "attribute default":
        function.attribute.clear()
        function.attribute_proto.append(helper.make_attribute("v", tensor))
    return function


WHERE = ["node attribute", "subgraph", "attribute default"]


@pytest.mark.parametrize("where", WHERE)
def test_external_data_in_a_function_is_found(where, tmp_path):
    model = helper.make_model(
        helper.make_graph([], "g", [], []), functions=[_function_with(where, _external_tensor("w.bin"))]
    )
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    assert set(edge._external_locations(memoryview(path.read_bytes()))) == {("stolen", "w.bin")}


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("where", WHERE)
def test_refuses_external_data_outside_the_artifact_in_a_function(reader, where, artifact, tmp_path):
    (tmp_path / "secret.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    model = onnx.load(str(artifact / "backward.onnx"))
    model.functions.append(_function_with(where, _external_tensor("../secret.bin")))
    (artifact / "backward.onnx").write_bytes(model.SerializeToString())
    _refused(reader, artifact, "external data of tensor 'stolen'.*outside the artifact directory")


def test_the_external_data_walk_reaches_every_tensor_onnx_can_hold():
    """edge.py reads the protobuf wire format by field numbers of its own; onnx's descriptors say which fields
    of which messages lead to a TensorProto. Every one of them must be followed."""
    names = {
        "ModelProto": "model",
        "TrainingInfoProto": "training_info",
        "GraphProto": "graph",
        "FunctionProto": "function",
        "NodeProto": "node",
        "AttributeProto": "attribute",
        "SparseTensorProto": "sparse_tensor",
        "TensorProto": "tensor",
    }
    leads: dict[str, bool] = {}

    def leads_to_tensor(descriptor, seen=frozenset()) -> bool:
        if descriptor.name == "TensorProto":
            return True
        if descriptor.full_name not in leads:
            if descriptor.full_name in seen:
                return False
            leads[descriptor.full_name] = any(
                leads_to_tensor(f.message_type, seen | {descriptor.full_name})
                for f in descriptor.fields
                if f.message_type is not None
            )
        return leads[descriptor.full_name]

    missing = []
    pending, visited = [onnx.ModelProto.DESCRIPTOR], set()
    while pending:
        descriptor = pending.pop()
        if descriptor.name in visited or descriptor.name == "TensorProto":
            continue
        visited.add(descriptor.name)
        for field in descriptor.fields:
            child = field.message_type
            if child is None or not leads_to_tensor(child):
                continue
            message = names.get(descriptor.name)
            if message is None or edge._MESSAGES[message].get(field.number) != names.get(child.name):
                missing.append(f"{descriptor.name}.{field.name} ({field.number}) -> {child.name}")
            pending.append(child)
    assert not missing, f"edge._MESSAGES does not follow: {missing}"


# ---------------------------------------------------------------------------------------------------------
# (c) A dtype mismatch that fake tensors let through capture raises PyTorch's own error

_W, _B = torch.randn(3, 4), torch.randn(3)
DTYPE_MISMATCHES = {
    "linear": lambda x: F.linear(x, _W, _B),
    "linear without bias": lambda x: F.linear(x, _W),
    "mm": lambda x: x @ _W.t(),
    "mv": lambda x: torch.mv(x, _W[0]),
    "addmm half": lambda x: torch.addmm(_B, x.half(), _W.t()),
}


def _eager_error(fn: Callable, *args) -> str:
    with pytest.raises(RuntimeError) as info:
        fn(*args)
    return str(info.value)


@pytest.mark.parametrize("case", list(DTYPE_MISMATCHES))
def test_dtype_mismatch_raises_pytorch_error(case):
    fn = DTYPE_MISMATCHES[case]
    x = torch.randint(0, 5, (2, 4))
    expected = _eager_error(fn, x)
    with pytest.raises(RuntimeError) as info:
        torch.compile(fn, backend="aot2onnx")(x)
    assert expected in str(info.value)
    assert str(info.value).index(expected) < str(info.value).index("aot2onnx failed with")


@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_int64_input_into_float_linear(grad):
    linear = _net().lin.requires_grad_(grad)
    x = torch.randint(0, 5, (2, 4))
    expected = _eager_error(linear, x)
    assert "Long and Float" in expected
    with pytest.raises(RuntimeError) as info:
        torch.compile(linear, backend="aot2onnx")(x)
    assert expected in str(info.value)
    assert "bound to different types" not in str(info.value).split("aot2onnx failed with")[0]


def test_a_graph_pytorch_accepts_keeps_the_onnx_runtime_error():
    # ONNX Runtime's CPU provider has no double Erf: PyTorch runs every node, so its error stays the one raised
    # (with fallback=False; by default the GELU runs in PyTorch, tests/test_fallback.py). On standard operators:
    # the fused kernels' GELU is ATen's, which takes double.
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU()).double()
    with pytest.raises(
        torch._dynamo.exc.BackendCompilerFailed, match=r"no Erf kernel for inputs of type \(double\)"
    ) as info:
        torch.compile(model, backend=aot2onnx.backend(fallback=False, fused_kernels=False))(
            torch.randn(2, 4, dtype=torch.float64))
    assert "PyTorch's error" not in str(info.value)


# ---------------------------------------------------------------------------------------------------------
# (d) Empty batches with gradients

_MSE = (
    "torch's mse_loss_backward decomposition computes 2.0 / input.numel(): ZeroDivisionError at capture "
    "(torch/_decomp/decompositions.py)"
)
# The backward graph's session fails when the graph compiles: inside Dynamo's compile where AOTAutograd compiles
# the backward with the forward, at the first backward() where it compiles it then.
_COMPILE_FAILS = (torch._dynamo.exc.BackendCompilerFailed, RuntimeSessionError)


class _Model(nn.Module):
    def __init__(self, body: nn.Module, loss: Callable) -> None:
        super().__init__()
        self.body, self.loss = body, loss

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.body(x)
        return self.loss(out), out


EMPTY_BATCHES = {
    "linear mse": (lambda: nn.Linear(4, 3), (0, 4), lambda o: F.mse_loss(o, torch.zeros_like(o))),
    "mlp cross entropy": (
        lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)),
        (0, 4),
        lambda o: F.cross_entropy(o, torch.zeros(o.shape[0], dtype=torch.long)),
    ),
    "linear 3d": (lambda: nn.Linear(4, 3), (0, 5, 4), lambda o: o.sum()),
    "layer norm": (lambda: nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8)), (0, 4), lambda o: o.sum()),
    "conv": (lambda: nn.Conv2d(3, 4, 3, padding=1), (0, 3, 8, 8), lambda o: o.sum()),
    "conv mean": (lambda: nn.Conv2d(3, 4, 3, padding=1), (0, 3, 8, 8), lambda o: o.mean()),
    "conv batch norm": (
        lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()),
        (0, 3, 8, 8),
        lambda o: o.sum(),
    ),
    "conv grouped strided max pool": (
        lambda: nn.Sequential(nn.Conv2d(4, 8, 3, groups=2, stride=2), nn.MaxPool2d(2)),
        (0, 4, 9, 9),
        lambda o: o.sum(),
    ),
    "conv large kernel": (lambda: nn.Conv2d(300, 4, 11), (0, 300, 12, 12), lambda o: o.sum()),
    "batch norm 1d": (lambda: nn.BatchNorm1d(4), (0, 4), lambda o: o.sum()),
}
EMPTY_BATCH_XFAILS = {
    "linear mse": pytest.mark.xfail(raises=_COMPILE_FAILS, strict=True, reason=_MSE),
}


@pytest.mark.parametrize("case", [pytest.param(name, marks=EMPTY_BATCH_XFAILS.get(name, ())) for name in EMPTY_BATCHES])
def test_empty_batch_matches_eager(case):
    make, shape, loss = EMPTY_BATCHES[case]
    torch.manual_seed(0)
    eager = _Model(make(), loss)
    compiled_module = _Model(make(), loss)
    compiled_module.load_state_dict(eager.state_dict())
    x = torch.randn(shape)
    x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()

    eager_loss, eager_out = eager(x_eager)
    eager_loss.backward()
    loss_value, out = torch.compile(compiled_module, backend="aot2onnx")(x_compiled)
    loss_value.backward()

    def close(actual, expected, what):
        torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, equal_nan=True, msg=lambda m: f"{what}: {m}")

    close(loss_value, eager_loss, "loss")
    close(out, eager_out, "output")
    close(x_compiled.grad, x_eager.grad, "input gradient")
    for (name, p), q in zip(eager.named_parameters(), compiled_module.parameters()):
        close(q.grad, p.grad, f"gradient of {name}")
    for (name, b), c in zip(eager.named_buffers(), compiled_module.buffers()):
        close(c, b, f"buffer {name}")


def test_expand_of_size_one_to_size_zero():
    # ONNX Runtime's ExpandElimination takes Expand([1, 4] -> [0, 4]) for a no-op: [1, 4] came out.
    def fn(t: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return t.unsqueeze(0).expand(0, 4) * 2, (x + t).sum(1)

    t, x = torch.randn(4), torch.randn(0, 4)
    for actual, expected in zip(torch.compile(fn, backend="aot2onnx")(t, x), fn(t, x)):
        torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)


def test_expand_of_size_one_to_size_zero_with_gradients():
    def fn(t: torch.Tensor) -> torch.Tensor:
        return (t.unsqueeze(0).expand(0, 4) * 2).sum()

    t = torch.randn(4)
    t_eager, t_compiled = t.clone().requires_grad_(), t.clone().requires_grad_()
    fn(t_eager).backward()
    torch.compile(fn, backend="aot2onnx")(t_compiled).backward()
    torch.testing.assert_close(t_compiled.grad, t_eager.grad, rtol=RTOL, atol=ATOL)
