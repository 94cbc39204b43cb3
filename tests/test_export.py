"""export_training: the torch-free trainer and aot2onnx.load against eager PyTorch; the export command line;
refusing bad artifacts.

Every training comparison runs 20 steps from the same initial state on the same data, at a batch size (8)
other than the export example's (6), and compares losses, final parameters, buffers and optimizer state with
eager PyTorch and torch.optim.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable

import numpy as np
import onnx
import pytest
import safetensors.numpy
import torch
import torch.nn as nn
import torch.nn.functional as F

import aot2onnx
from aot2onnx.artifact import edge
from aot2onnx.errors import ArtifactError, CaptureError

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples"))
from test_training_parity import SmallCNN, TokenModel  # noqa: E402
from tiny_gpt import TinyGPT, lm_loss  # noqa: E402

STEPS = 20
EXPORT_BATCH, TRAIN_BATCH = 6, 8
RTOL, ATOL = 1e-4, 1e-5  # float32, SGD and AdamW alike, except for the parameters named in Case.noise
SGD_ARGS = {"lr": 0.01, "momentum": 0.9}
ADAMW_ARGS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
EDGE_PY = pathlib.Path(edge.__file__)


class WithLoss(nn.Module):
    """A model and its loss: what export_training takes (module(*inputs) returns the loss)."""

    def __init__(self, model: nn.Module, loss: Callable) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(self.model(x), y)


def _nll(logp: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.nll_loss(logp.reshape(-1, logp.shape[-1]), y.reshape(-1))


@dataclasses.dataclass(frozen=True)
class Case:
    make: Callable[[], nn.Module]
    loss: Callable
    data: Callable[[torch.Generator, int], tuple[torch.Tensor, torch.Tensor]]
    # Under AdamW: state entries (and the slice of them) whose gradient is zero in exact arithmetic, so that
    # both sides see rounding noise (~1e-8 against gradients ~1e-1 here). Adam divides a gradient by its own
    # running magnitude, so noise moves these entries as far as real gradients move the others: up to about lr
    # per step, in directions that differ between eager and ONNX Runtime. They are compared at
    # atol = lr * steps (Adam's bound on the distance travelled), everything else at RTOL/ATOL.
    noise: dict[str, slice] = dataclasses.field(default_factory=dict)


DIM = 32  # TinyGPT width: qkv.bias is [q | k | v], each DIM wide
CASES = {
    "mlp": Case(
        lambda: nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)),
        F.mse_loss,
        lambda g, b: (torch.randn(b, 32, generator=g), torch.randn(b, 8, generator=g)),
    ),
    "cnn_batchnorm": Case(
        SmallCNN,
        F.cross_entropy,
        lambda g, b: (torch.randn(b, 3, 32, 32, generator=g), torch.randint(0, 10, (b,), generator=g)),
        # The convolution's bias feeds BatchNorm, which subtracts the batch mean: the bias cancels. The running
        # mean tracks the convolution's output, bias included.
        noise={"model.features.0.bias": slice(None), "model.features.1.running_mean": slice(None)},
    ),
    "causal_lm": Case(
        lambda: TinyGPT(vocab=61, dim=DIM, heads=4, layers=2, context=16),
        lm_loss,
        lambda g, b: (torch.randint(0, 61, (b, 16), generator=g), torch.randint(0, 61, (b, 16), generator=g)),
        # The key bias adds the same amount to every score of a query: softmax cancels it.
        noise={f"model.blocks.{i}.qkv.bias": slice(DIM, 2 * DIM) for i in range(2)},
    ),
    "embedding_layernorm": Case(
        TokenModel,
        _nll,
        lambda g, b: (torch.randint(0, 97, (b, 16), generator=g), torch.randint(0, 97, (b, 16), generator=g)),
    ),
}


@dataclasses.dataclass
class Exported:
    out_dir: pathlib.Path
    module: WithLoss  # the module exported, in its initial state (export must not change it)
    batches: list[tuple[torch.Tensor, ...]]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Callable[[str, str], Exported]:
    """export(case, optimizer) -> the artifact, exported once per module run."""
    done: dict[tuple[str, str], Exported] = {}

    def export(name: str, optimizer: str) -> Exported:
        if (name, optimizer) not in done:
            case = CASES[name]
            torch.manual_seed(0)
            module = WithLoss(case.make(), case.loss)
            before = copy.deepcopy(module.state_dict())
            g = torch.Generator().manual_seed(1)
            example = case.data(g, EXPORT_BATCH)
            batches = [case.data(g, TRAIN_BATCH) for _ in range(STEPS)]
            opt = aot2onnx.optim.SGD(**SGD_ARGS) if optimizer == "sgd" else aot2onnx.optim.AdamW(**ADAMW_ARGS)
            out_dir = tmp_path_factory.mktemp(f"{name}_{optimizer}")
            aot2onnx.export_training(module, example, out_dir, optimizer=opt)
            for key, value in module.state_dict().items():
                assert torch.equal(value, before[key]), f"export_training changed {key}"
            done[name, optimizer] = Exported(out_dir, module, batches)
        return done[name, optimizer]

    return export


def _torch_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, **SGD_ARGS)
    return torch.optim.AdamW(params, **ADAMW_ARGS)


def _eager(module: nn.Module, batches, optimizer: str) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    """20 eager steps with torch.optim: losses, final state_dict, optimizer state by our state names."""
    module = copy.deepcopy(module)
    opt = _torch_optimizer(optimizer, module.parameters())
    losses = []
    for batch in batches:
        loss = module(*batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    opt_state = {}
    for name, p in module.named_parameters():
        for slot, value in opt.state[p].items():
            opt_state["optimizer:step" if slot == "step" else f"{name}:{slot}"] = value
    return losses, module.state_dict(), opt_state


def _assert_close(name: str, actual, expected, case: Case, optimizer: str) -> None:
    actual = np.asarray(actual)
    expected = expected.detach().numpy() if isinstance(expected, torch.Tensor) else np.asarray(expected)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (name, actual.dtype, expected.dtype)
    noise = case.noise.get(name) if optimizer == "adamw" else None
    if noise is None:
        np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL, err_msg=name)
        return
    tight = np.ones(actual.shape, dtype=bool)
    tight[noise] = False
    np.testing.assert_allclose(actual[tight], expected[tight], rtol=RTOL, atol=ATOL, err_msg=name)
    np.testing.assert_allclose(actual[noise], expected[noise], rtol=0, atol=ADAMW_ARGS["lr"] * STEPS,
                               err_msg=f"{name} (rounding-noise gradient)")


def _assert_matches_eager(case: Case, optimizer: str, losses, state: dict, eager) -> None:
    eager_losses, eager_state, eager_opt_state = eager
    np.testing.assert_allclose(losses, eager_losses, rtol=RTOL, atol=ATOL, err_msg="losses")
    for name, value in eager_state.items():
        _assert_close(name, state[name], value, case, optimizer)
    for name, value in eager_opt_state.items():
        if name == "optimizer:step":  # torch counts in float32 per parameter; we count once, in int64
            assert int(state[name]) == int(value) == STEPS
        else:
            _assert_close(name, state[name], value, case, optimizer)


# ---------------------------------------------------------------------------------------------------------
# The torch-free trainer, run as a copied file in a process where importing torch fails


@pytest.fixture(scope="module")
def no_torch_env(tmp_path_factory) -> dict[str, str]:
    """Environment for a Python in which ``import torch`` raises (a sitecustomize meta-path blocker)."""
    blocker = tmp_path_factory.mktemp("no_torch")
    (blocker / "sitecustomize.py").write_text(textwrap.dedent("""
        import sys

        class _NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError(f"torch is blocked in this process (importing {name!r})")
                return None

        sys.meta_path.insert(0, _NoTorch())
    """))
    env = {**os.environ, "PYTHONPATH": str(blocker)}
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "torch is blocked" in probe.stderr, "the torch blocker does not work"
    return env


def _device_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A directory holding only a copy of edge.py, as a device would."""
    device = tmp_path / "device"
    device.mkdir()
    shutil.copy(EDGE_PY, device / "edge.py")
    return device


def _write_batches(path: pathlib.Path, batches, names=("x", "y")) -> None:
    np.savez(path, **{name: np.stack([b[i].numpy() for b in batches]) for i, name in enumerate(names)})


def _run_edge(args: list[str], cwd: pathlib.Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "edge.py", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


# causal_lm (the slowest, 7-8 s a pair) trains with AdamW in the default run; -m slow adds it with SGD.
@pytest.mark.parametrize("name,optimizer", [
    pytest.param(n, o, id=f"{n}-{o}", marks=[pytest.mark.slow] if (n, o) == ("causal_lm", "sgd") else [])
    for n in CASES for o in ("sgd", "adamw")
])
def test_edge_trainer_matches_eager(name, optimizer, exported, no_torch_env, tmp_path):
    art = exported(name, optimizer)
    device = _device_dir(tmp_path)
    _write_batches(tmp_path / "batches.npz", art.batches)
    out = tmp_path / "final.safetensors"
    run = _run_edge([str(art.out_dir), "--data", str(tmp_path / "batches.npz"), "--steps", str(STEPS),
                     "--out", str(out), "--threads", "2"], device, no_torch_env)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert [line.split()[:3] for line in lines] == [["step", str(i + 1), "loss"] for i in range(STEPS)]
    losses = [float(line.split()[3]) for line in lines]
    state = safetensors.numpy.load_file(str(out))
    _assert_matches_eager(CASES[name], optimizer, losses, state, _eager(art.module, art.batches, optimizer))


def test_edge_imports_only_stdlib_numpy_onnxruntime_safetensors():
    import ast

    tree = ast.parse(EDGE_PY.read_text())
    roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0}
    assert roots - set(sys.stdlib_module_names) == {"numpy", "onnxruntime", "safetensors"}


def test_edge_trainer_api_and_save(exported, tmp_path):
    art = exported("mlp", "sgd")
    trainer = edge.Trainer(art.out_dir, intra_op_num_threads=2)
    losses = [trainer.step(*(t.numpy() for t in batch)) for batch in art.batches[:3]]
    assert all(isinstance(loss, float) for loss in losses) and trainer.steps == 3
    trainer.save(tmp_path / "state.safetensors")
    saved = safetensors.numpy.load_file(str(tmp_path / "state.safetensors"))
    assert set(saved) == {e["name"] for e in trainer.artifact.signature["state"]}
    # Bad inputs are refused with the input's name, not left to ONNX Runtime.
    x, y = (t.numpy() for t in art.batches[0])
    with pytest.raises(ValueError, match="input 'x' must be float32"):
        trainer.step(x.astype(np.float64), y)
    with pytest.raises(ValueError, match="inputs disagree on dim 'batch'"):
        trainer.step(x, y[:3])
    with pytest.raises(ValueError, match="takes 2 inputs"):
        trainer.step(x)


def test_edge_module_form_runs(exported, tmp_path):
    """``python -m aot2onnx.artifact.edge`` runs the same trainer where aot2onnx is installed."""
    art = exported("mlp", "sgd")
    _write_batches(tmp_path / "b.npz", art.batches[:2])
    run = subprocess.run([sys.executable, "-m", "aot2onnx.artifact.edge", str(art.out_dir), "--data",
                          str(tmp_path / "b.npz"), "--steps", "3", "--out", str(tmp_path / "s.safetensors")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert len(run.stdout.splitlines()) == 3 and (tmp_path / "s.safetensors").is_file()
    assert "Warning" not in run.stderr, run.stderr  # `import aot2onnx` does not import edge before runpy does


# ---------------------------------------------------------------------------------------------------------
# aot2onnx.load + a torch optimizer


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("name", list(CASES))
def test_load_trains_with_torch_optimizer(name, optimizer, exported):
    art = exported(name, "sgd")  # the torch optimizer does the update; optimizer.onnx is not used
    loaded = aot2onnx.load(art.out_dir, intra_op_num_threads=2)
    assert list(loaded.state_dict()) == list(art.module.state_dict())
    for key, value in art.module.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    opt = _torch_optimizer(optimizer, loaded.parameters())
    losses = []
    for batch in art.batches:
        loss = loaded(*batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = {k: v.numpy() for k, v in loaded.state_dict().items()}
    for p_name, p in loaded.named_parameters():
        for slot, value in opt.state[p].items():
            state["optimizer:step" if slot == "step" else f"{p_name}:{slot}"] = value
    _assert_matches_eager(CASES[name], optimizer, losses, state, _eager(art.module, art.batches, optimizer))
    # Every forward and backward ran on ONNX Runtime.
    assert loaded._aot2onnx.forward.runs == STEPS and loaded._aot2onnx.backward.runs == STEPS


def test_load_returns_user_outputs_and_writes_buffers_back(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)
            self.bn = nn.BatchNorm1d(3)

        def forward(self, x, y):
            out = self.bn(self.fc(x))
            return F.mse_loss(out, y), out

    torch.manual_seed(0)
    net = Net()
    aot2onnx.export_training(net, (torch.randn(5, 4), torch.randn(5, 3)), tmp_path)
    loaded = aot2onnx.load(tmp_path)
    x, y = torch.randn(7, 4), torch.randn(7, 3)
    loss, out = loaded(x, y)
    eager_loss, eager_out = net(x, y)
    torch.testing.assert_close(loss, eager_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out, eager_out.detach(), rtol=RTOL, atol=ATOL)
    assert not out.requires_grad and loss.requires_grad
    for key in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        torch.testing.assert_close(loaded.get_buffer(key), net.get_buffer(key), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_load_reads_16_bit_state(dtype, tmp_path):
    """The state file's bfloat16 tensors are ml_dtypes arrays, which torch.from_numpy refused: load failed."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)
            self.register_buffer("scale", torch.tensor([0.5, 2.0, -1.25]))

        def forward(self, x, y):
            return F.mse_loss(self.fc(x) * self.scale, y)

    torch.manual_seed(0)
    net = Net().to(dtype)
    aot2onnx.export_training(net, (torch.randn(5, 4, dtype=dtype), torch.randn(5, 3, dtype=dtype)), tmp_path)
    loaded = aot2onnx.load(tmp_path)
    for key, value in net.state_dict().items():  # exactly the exported bits
        assert loaded.state_dict()[key].dtype == dtype and torch.equal(loaded.state_dict()[key], value), key
    x, y = torch.randn(7, 4, dtype=dtype), torch.randn(7, 3, dtype=dtype)
    loss, eager_loss = loaded(x, y), net(x, y)
    loss.backward()
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss)  # torch's default tolerances for the dtype
    for name, p in net.named_parameters():
        torch.testing.assert_close(loaded.get_parameter(name).grad, p.grad, msg=name)


def test_frozen_parameter_eval_batchnorm_and_non_persistent_buffer(tmp_path):
    """The backward reads buffers (BatchNorm in eval mode); a frozen parameter gets no gradient and no update."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 5)
            self.bn = nn.BatchNorm1d(5)
            self.head = nn.Linear(5, 2)
            self.register_buffer("scale", torch.tensor(2.0), persistent=False)

        def forward(self, x, y):
            return F.mse_loss(self.head(self.bn(self.fc(x))) * self.scale, y)

    torch.manual_seed(0)
    net = Net()
    net.fc.weight.requires_grad_(False)
    net.bn.eval()
    with torch.no_grad():
        net.bn.running_mean.uniform_()
        net.bn.running_var.uniform_(0.5, 1.5)
    aot2onnx.export_training(net, (torch.randn(4, 6), torch.randn(4, 2)), tmp_path,
                             optimizer=aot2onnx.optim.SGD(**SGD_ARGS))
    sig = json.loads((tmp_path / "signature.json").read_text())
    assert {e["source"] for e in sig["backward"]["inputs"] if e["role"] == "buffer"} >= {"bn.running_var", "scale"}
    assert "fc.weight" not in {e["target"] for e in sig["backward"]["outputs"]}
    assert next(e for e in sig["state"] if e["name"] == "scale")["persistent"] is False

    trainer, loaded = edge.Trainer(tmp_path), aot2onnx.load(tmp_path)
    assert list(loaded.state_dict()) == list(net.state_dict())
    loaded_opt = torch.optim.SGD([p for p in loaded.parameters() if p.requires_grad], **SGD_ARGS)
    eager = copy.deepcopy(net)
    eager_opt = torch.optim.SGD([p for p in eager.parameters() if p.requires_grad], **SGD_ARGS)
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        x, y = torch.randn(7, 6, generator=g), torch.randn(7, 2, generator=g)
        losses = [trainer.step(x.numpy(), y.numpy())]
        for model, opt in ((loaded, loaded_opt), (eager, eager_opt)):
            loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        np.testing.assert_allclose(losses[:2], [losses[2]] * 2, rtol=RTOL, atol=ATOL)
    for key, value in eager.state_dict().items():
        np.testing.assert_allclose(trainer.state[key], value.numpy(), rtol=RTOL, atol=ATOL, err_msg=key)
        np.testing.assert_allclose(loaded.state_dict()[key].numpy(), value.numpy(), rtol=RTOL, atol=ATOL, err_msg=key)


# ---------------------------------------------------------------------------------------------------------
# What the artifact holds


def test_signature_and_models(exported):
    art = exported("mlp", "adamw")
    sig = json.loads((art.out_dir / "signature.json").read_text())
    assert sig["format"] == "aot2onnx.training/2"
    assert set(sig["versions"]) == {"aot2onnx", "torch", "onnx", "onnxruntime", "opset"}
    assert sig["dims"] == {"batch": {"example": EXPORT_BATCH, "min": 1, "max": None}}
    assert sig["user_inputs"] == [
        {"position": 0, "name": "x", "dtype": "float32", "shape": ["batch", 32]},
        {"position": 1, "name": "y", "dtype": "float32", "shape": ["batch", 8]},
    ]
    kinds = {s["name"]: s["kind"] for s in sig["state"]}
    assert kinds["model.0.weight"] == "parameter" and kinds["model.0.weight:exp_avg"] == "optimizer_state"
    assert kinds["optimizer:step"] == "optimizer_state"
    assert sig["optimizer"]["hyperparameters"] == {"name": "adamw", "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                   "weight_decay": 0.01, "schedule": {"name": "constant"},
                                                   "max_grad_norm": None}
    # The learning rate and the weight decay are inputs a device feeds (float64 scalars).
    roles = {e["role"]: e for e in sig["optimizer"]["inputs"]}
    assert (roles["lr"]["dtype"], roles["lr"]["shape"]) == ("float64", [])
    assert (roles["weight_decay"]["dtype"], roles["weight_decay"]["shape"]) == ("float64", [])
    for graph in ("forward", "backward", "optimizer"):
        model = onnx.load(str(art.out_dir / sig[graph]["model"]))
        props = {p.key: p.value for p in model.metadata_props}
        assert json.loads(props["aot2onnx.signature"]) == sig
        assert [i.name for i in model.graph.input] == [e["name"] for e in sig[graph]["inputs"]]
        assert [o.name for o in model.graph.output] == [e["name"] for e in sig[graph]["outputs"]]
    forward = onnx.load(str(art.out_dir / "forward.onnx"))
    x = next(i for i in forward.graph.input if i.name == "x")
    assert [d.dim_param or d.dim_value for d in x.type.tensor_type.shape.dim] == ["batch", 32]
    state = safetensors.numpy.load_file(str(art.out_dir / "state.safetensors"))
    assert state["optimizer:step"].dtype == np.int64 and int(state["optimizer:step"]) == 0
    np.testing.assert_array_equal(state["model.0.weight"], art.module.state_dict()["model.0.weight"].numpy())


def test_batch_size_fixed_by_the_model_is_refused(tmp_path):
    class Fixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x):
            return self.fc(x.view(6, 4)).sum()

    with pytest.raises(CaptureError, match="fixes the batch size to 6"):
        aot2onnx.export_training(Fixed(), (torch.randn(6, 4),), tmp_path)
    aot2onnx.export_training(Fixed(), (torch.randn(6, 4),), tmp_path, dynamic_batch=False)
    sig = json.loads((tmp_path / "signature.json").read_text())
    assert sig["user_inputs"][0]["shape"] == [6, 4] and sig["dims"] == {}


class _ExpandsToEmpty(nn.Module):
    """Expands a size-1 dimension to the batch's size: on an empty batch, an Expand to size 0, which ONNX
    Runtime's ExpandElimination takes for a no-op (the forward's value came out [1, 4], the loss 2 * t.sum())."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.t.unsqueeze(0).expand_as(x) * 2).sum() + x.sum()


def test_an_empty_batch_trains_in_edge_as_in_the_backend(tmp_path):
    torch.manual_seed(0)
    module = _ExpandsToEmpty()
    x = torch.zeros(0, 4)
    aot2onnx.export_training(module, (x,), tmp_path, optimizer=aot2onnx.optim.SGD(lr=0.1), dynamic_batch=False)
    trainer = edge.Trainer(tmp_path)
    assert "ExpandElimination" in trainer.artifact.disabled_optimizers["forward"]
    edge_loss = trainer.step(x.numpy())

    compiled = copy.deepcopy(module)
    backend_loss = torch.compile(compiled, backend="aot2onnx")(x)
    backend_loss.backward()
    with torch.no_grad():
        compiled.t -= 0.1 * compiled.t.grad
    eager = copy.deepcopy(module)
    eager_loss = eager(x)
    eager_loss.backward()
    assert eager.t.grad is not None and not eager.t.grad.any()
    assert edge_loss == backend_loss.item() == eager_loss.item() == 0.0
    np.testing.assert_array_equal(trainer.state["t"], compiled.t.detach().numpy())
    np.testing.assert_array_equal(trainer.state["t"], module.t.detach().numpy())  # a zero gradient moved nothing


def test_the_runtime_decides_which_rewrites_edge_turns_off(exported):
    from aot2onnx.runtime.rewrites import disabled_optimizers

    art = exported("mlp", "sgd")
    artifact = edge.open_artifact(art.out_dir)
    for graph, path in artifact.models.items():
        assert artifact.disabled_optimizers[graph] == disabled_optimizers(onnx.load(str(path))), graph


def set_metadata(path: pathlib.Path, key: str, value: str | None) -> None:
    """Rewrites the model at ``path`` with its metadata entry ``key`` set to ``value`` (None: no such entry), as
    a model exported before the entry existed, or a hostile one, would have it."""
    model = onnx.load(str(path))
    kept = [p for p in model.metadata_props if p.key != key]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    if value is not None:
        model.metadata_props.add(key=key, value=value)
    path.write_bytes(model.SerializeToString())


def test_a_model_exported_before_the_rewrites_were_recorded_turns_off_every_one(artifact_copy, exported):
    set_metadata(artifact_copy / "forward.onnx", edge.DISABLED_OPTIMIZERS_KEY, None)
    artifact = edge.open_artifact(artifact_copy)
    assert artifact.disabled_optimizers["forward"] == ["NoopElimination", "ExpandElimination"]
    assert artifact.disabled_optimizers["backward"] == ["NoopElimination"]
    # ONNX Runtime takes both names, and the step is the one the recorded entry gives.
    batch = [t.numpy() for t in exported("mlp", "sgd").batches[0]]
    assert edge.Trainer(artifact_copy).step(*batch) == edge.Trainer(exported("mlp", "sgd").out_dir).step(*batch)


def test_refuses_rewrite_names_that_are_not_names(artifact_copy):
    set_metadata(artifact_copy / "forward.onnx", edge.DISABLED_OPTIMIZERS_KEY, "NoopElimination;rm -rf")
    with pytest.raises(edge.ArtifactError, match="not a comma-separated list"):
        edge.open_artifact(artifact_copy)


def test_the_runtime_decides_which_models_edge_runs_on_one_thread(exported):
    """An embedding's gradient is a ScatterND adding rows, which ONNX Runtime's CPU kernel gets wrong on more
    than one thread (runtime/rewrites.py, serial_nodes): the exporter names those nodes in the model, and the
    trainer runs that model's session on one thread, the others on the threads asked for."""
    from aot2onnx.runtime.rewrites import serial_nodes

    art = exported("embedding_layernorm", "sgd")
    artifact = edge.open_artifact(art.out_dir)
    for graph, path in artifact.models.items():
        model = onnx.load(str(path))
        recorded = next(p.value for p in model.metadata_props if p.key == edge.ONE_THREAD_KEY)
        assert recorded == ",".join(serial_nodes(model)), graph
        assert artifact.one_thread[graph] == bool(recorded)
    assert artifact.one_thread["backward"] and not artifact.one_thread["forward"]
    trainer = edge.Trainer(art.out_dir, intra_op_num_threads=2)
    threads = {g: s.get_session_options().intra_op_num_threads for g, s in trainer._sessions.items()}
    assert threads["backward"] == 1 and threads["forward"] == 2


def test_a_model_exported_before_its_one_thread_nodes_were_recorded_runs_on_one_thread(artifact_copy):
    set_metadata(artifact_copy / "forward.onnx", edge.ONE_THREAD_KEY, None)
    artifact = edge.open_artifact(artifact_copy)
    assert artifact.one_thread["forward"] and not artifact.one_thread["backward"]


def test_the_module_is_traced_as_torch_export_traces_it(tmp_path):
    # torch.compiler.is_compiling() and is_exporting() are True while the module is traced, so code written for
    # traces takes the path that holds for every input. transformers' mask helpers skip an all-ones mask only
    # where neither is set, with `.all()` on the mask: a value the trace cannot decide (GPT-2 with
    # use_cache=False failed to export with "Could not guard on data-dependent expression").
    seen = []

    class SkipsAnAllOnesMask(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x, mask):
            seen.append((torch.compiler.is_compiling(), torch.compiler.is_exporting()))
            if not torch.compiler.is_exporting() and bool(mask.all()):
                return self.fc(x).square().mean()
            return (self.fc(x).squeeze(-1).square() * mask).sum() / mask.sum()

    torch.manual_seed(0)
    model = SkipsAnAllOnesMask()
    aot2onnx.export_training(copy.deepcopy(model), (torch.randn(4, 4), torch.ones(4)), tmp_path,
                             optimizer=aot2onnx.optim.SGD(0.1))
    assert (True, True) in seen and not torch.compiler.is_compiling() and not torch.compiler.is_exporting()
    x, mask = torch.randn(5, 4), torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    assert edge.Trainer(tmp_path).step(x.numpy(), mask.numpy()) == pytest.approx(model(x, mask).item(), rel=1e-6)


# ---------------------------------------------------------------------------------------------------------
# python -m aot2onnx export


def test_export_command_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_models.py").write_text(textwrap.dedent("""
        import torch.nn as nn
        import torch.nn.functional as F

        class Regressor(nn.Module):
            def __init__(self):
                super().__init__()
                self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

            def forward(self, features, target):
                return F.mse_loss(self.net(features), target)

        def make():
            return Regressor()
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    np.savez(tmp_path / "example.npz", features=np.zeros((4, 8), np.float32), target=np.zeros((4, 1), np.float32))
    from aot2onnx.__main__ import main

    out = tmp_path / "artifact"
    code = main(["export", "my_models:make", "--example-inputs", str(tmp_path / "example.npz"), "--out", str(out),
                 "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--seed", "3"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "[1/6] tracing the joint forward-backward graph" in captured.err and "done in" in captured.err
    for name in ("forward.onnx", "backward.onnx", "optimizer.onnx", "state.safetensors", "signature.json"):
        assert (out / name).is_file() and name in captured.out
    assert "4 parameters (161 values, 4 trainable)" in captured.out
    sig = json.loads((out / "signature.json").read_text())
    assert sig["optimizer"]["hyperparameters"] == {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0,
                                                   "schedule": {"name": "constant"}, "max_grad_norm": None}
    assert [u["name"] for u in sig["user_inputs"]] == ["features", "target"]
    trainer = edge.Trainer(out)
    assert np.isfinite(trainer.step(np.ones((3, 8), np.float32), np.ones((3, 1), np.float32)))

    assert main(["export", "my_models:nothing_here", "--example-inputs", str(tmp_path / "example.npz"),
                 "--out", str(out)]) == 1
    assert "my_models has no attribute 'nothing_here'" in capsys.readouterr().err
    np.savez(tmp_path / "wrong.npz", a=np.zeros((4, 8), np.float32))
    assert main(["export", "my_models:make", "--example-inputs", str(tmp_path / "wrong.npz"), "--out", str(out)]) == 1
    assert "name the arrays after Regressor.forward's parameters" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# Refusing bad artifacts: both readers, every problem named


def _load(path):
    return aot2onnx.load(path)


def _trainer(path):
    return edge.Trainer(path)


READERS = {"aot2onnx.load": (_load, ArtifactError), "edge.Trainer": (_trainer, edge.ArtifactError)}


@pytest.fixture
def artifact_copy(exported, tmp_path) -> pathlib.Path:
    path = tmp_path / "artifact"
    shutil.copytree(exported("mlp", "sgd").out_dir, path)
    return path


def _edit_signature(path: pathlib.Path, edit: Callable[[dict], None]) -> None:
    sig = json.loads((path / "signature.json").read_text())
    edit(sig)
    (path / "signature.json").write_text(json.dumps(sig))


def _entry(sig: dict, graph: str, direction: str, name: str) -> dict:
    return next(e for e in sig[graph][direction] if e["name"] == name)


def _refused(reader: str, path: pathlib.Path, match: str) -> None:
    load, error = READERS[reader]
    with pytest.raises(error, match=match) as info:
        load(path)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("file", ["signature.json", "forward.onnx", "backward.onnx", "optimizer.onnx",
                                  "state.safetensors"])
def test_refuses_missing_file(reader, file, artifact_copy):
    (artifact_copy / file).unlink()
    _refused(reader, artifact_copy, f"{file}.* is missing")


@pytest.mark.parametrize("reader", list(READERS))
def test_refuses_unknown_format(reader, artifact_copy):
    _edit_signature(artifact_copy, lambda s: s.update(format="aot2onnx.training/99"))
    _refused(reader, artifact_copy, "unknown format 'aot2onnx.training/99'")


@pytest.mark.parametrize("reader", list(READERS))
def test_refuses_signature_that_is_not_json(reader, artifact_copy):
    (artifact_copy / "signature.json").write_text("{not json")
    _refused(reader, artifact_copy, "signature.json is not valid JSON")


def _change_user_input(sig: dict, position: int, **fields) -> None:
    """Changes user input ``position`` and every model input fed from it alike: the signature stays consistent
    with itself and disagrees with the models only."""
    sig["user_inputs"][position].update(fields)
    for graph in ("forward", "backward"):
        for e in sig[graph]["inputs"]:
            if e["role"] == "user_input" and e["source"] == position:
                e.update(fields)


def _change_loss(sig: dict, **fields) -> None:
    _entry(sig, "forward", "outputs", "loss").update(fields)
    _entry(sig, "backward", "inputs", "grad:loss").update(fields)


SIGNATURE_EDITS = {
    "input name": (lambda s: _entry(s, "forward", "inputs", "x").update(name="features"),
                   r"forward.onnx: the signature lists input 'features' .* which the model does not have"),
    "output name": (lambda s: _entry(s, "backward", "outputs", "grad:model.0.bias").update(name="grad:bias"),
                    r"backward.onnx: the signature lists output 'grad:bias'"),
    "missing input": (lambda s: s["forward"]["inputs"].remove(_entry(s, "forward", "inputs", "y")),
                      r"forward.onnx: the model has input 'y', which the signature does not list"),
    "dtype": (lambda s: _change_user_input(s, 0, dtype="float64"),
              r"forward.onnx: input 'x' is float32 in the model but float64 in the signature"),
    "rank": (lambda s: _change_user_input(s, 0, shape=["batch", 32, 1]),
             r"forward.onnx: input 'x' has rank 2 in the model but 3 in the signature"),
    "output dtype": (lambda s: _change_loss(s, dtype="float16"),
                     r"output 'loss' is float32 in the model but float16 in the signature"),
    "dangling source": (lambda s: _entry(s, "forward", "inputs", "model.0.weight").update(source="model.9.weight"),
                        r"has source 'model.9.weight', which names no parameter"),
    "unknown role": (lambda s: _entry(s, "forward", "inputs", "x").update(role="label"),
                     r"has role 'label'"),
}


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("edit", list(SIGNATURE_EDITS))
def test_refuses_signature_that_disagrees(reader, edit, artifact_copy):
    change, match = SIGNATURE_EDITS[edit]
    _edit_signature(artifact_copy, change)
    _refused(reader, artifact_copy, match)


@pytest.mark.parametrize("reader", list(READERS))
def test_refuses_models_from_another_export(reader, artifact_copy, exported):
    shutil.copy(exported("mlp", "adamw").out_dir / "backward.onnx", artifact_copy / "backward.onnx")
    _refused(reader, artifact_copy, "carries a different signature")


@pytest.mark.parametrize("reader", list(READERS))
def test_refuses_state_missing_a_tensor(reader, artifact_copy):
    state = safetensors.numpy.load_file(str(artifact_copy / "state.safetensors"))
    del state["model.2.bias"]
    safetensors.numpy.save_file(state, str(artifact_copy / "state.safetensors"))
    _refused(reader, artifact_copy, r"state.safetensors has no tensor 'model.2.bias' \(parameter")


@pytest.mark.parametrize("reader", list(READERS))
def test_refuses_state_tensor_of_wrong_shape(reader, artifact_copy):
    state = safetensors.numpy.load_file(str(artifact_copy / "state.safetensors"))
    state["model.0.weight"] = np.ascontiguousarray(state["model.0.weight"].T)
    safetensors.numpy.save_file(state, str(artifact_copy / "state.safetensors"))
    _refused(reader, artifact_copy, r"tensor 'model.0.weight' is float32\[32, 64\], the signature says "
                                    r"float32\[64, 32\]")


@pytest.mark.parametrize("reader", list(READERS))
def test_refuses_corrupt_state_file(reader, artifact_copy):
    (artifact_copy / "state.safetensors").write_bytes(b"\xff" * 64)
    _refused(reader, artifact_copy, "is not a readable safetensors file")


def _add_external_initializer(model_path: pathlib.Path, location: str) -> None:
    model = onnx.load(str(model_path))
    tensor = onnx.TensorProto(name="stolen", data_type=onnx.TensorProto.FLOAT, dims=[4])
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=location)
    model.graph.initializer.append(tensor)
    model_path.write_bytes(model.SerializeToString())


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("where", ["parent", "absolute", "nested_parent", "symlink"])
def test_refuses_external_data_outside_the_artifact(reader, where, artifact_copy, tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    if where == "symlink":
        (artifact_copy / "inside.bin").symlink_to(secret)
    location = {"parent": "../secret.bin", "absolute": str(secret), "nested_parent": "sub/../../secret.bin",
                "symlink": "inside.bin"}[where]
    _add_external_initializer(artifact_copy / "backward.onnx", location)
    _refused(reader, artifact_copy, "external data of tensor 'stolen'.*outside the artifact directory")


@pytest.mark.parametrize("reader", list(READERS))
def test_refuses_missing_external_data(reader, artifact_copy):
    _add_external_initializer(artifact_copy / "forward.onnx", "weights.bin")
    _refused(reader, artifact_copy, "external data of tensor 'stolen' is in 'weights.bin', which is missing")


@pytest.mark.parametrize("reader", list(READERS))
def test_refuses_model_path_outside_the_artifact(reader, artifact_copy, tmp_path):
    shutil.copy(artifact_copy / "forward.onnx", tmp_path / "forward.onnx")
    _edit_signature(artifact_copy, lambda s: s["forward"].update(model="../forward.onnx"))
    _refused(reader, artifact_copy, "forward.model is '../forward.onnx', which points outside")


@pytest.mark.parametrize("reader", list(READERS))
def test_refuses_a_model_that_is_not_onnx(reader, artifact_copy):
    (artifact_copy / "forward.onnx").write_bytes(b"\x07\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff")
    _refused(reader, artifact_copy, "forward.onnx")


def test_data_file_is_read_without_pickle(exported, no_torch_env, tmp_path):
    device = _device_dir(tmp_path)
    np.savez(tmp_path / "batches.npz", x=np.array([{"a": 1}], dtype=object), y=np.zeros((1, 8, 8), np.float32))
    run = _run_edge([str(exported("mlp", "sgd").out_dir), "--data", str(tmp_path / "batches.npz"), "--steps", "1",
                     "--out", str(tmp_path / "s.safetensors")], device, no_torch_env)
    assert run.returncode == 1 and "allow_pickle=False" in run.stderr


def test_the_documented_training_loop_trains(exported, no_torch_env, tmp_path):
    """docs/artifact-format.md's code, run as written with numpy and onnxruntime only, matches eager."""
    doc = (pathlib.Path(__file__).parents[1] / "docs" / "artifact-format.md").read_text()
    code = doc.split("In code, with numpy and onnxruntime only:\n\n```python\n", 1)[1].split("```", 1)[0]
    art = exported("cnn_batchnorm", "sgd")
    _write_batches(tmp_path / "batches.npz", art.batches)
    (tmp_path / "loop.py").write_text(
        f"art = {str(art.out_dir)!r}\n" + code + textwrap.dedent(f"""
            data = np.load({str(tmp_path / "batches.npz")!r})
            for i in range({STEPS}):
                print(repr(step(data["x"][i], data["y"][i])))
            save_file(state, {str(tmp_path / "final.safetensors")!r})
        """))
    run = subprocess.run([sys.executable, "loop.py"], cwd=tmp_path, env=no_torch_env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    losses = [float(line) for line in run.stdout.split()]
    state = safetensors.numpy.load_file(str(tmp_path / "final.safetensors"))
    _assert_matches_eager(CASES["cnn_batchnorm"], "sgd", losses, state, _eager(art.module, art.batches, "sgd"))
