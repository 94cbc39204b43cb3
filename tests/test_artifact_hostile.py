"""Artifacts as untrusted input (issue 39): crafted directories, each breaking one rule of "What a reader must
refuse" in docs/artifact-format.md or one way the readers were found to fail, refused by both readers
(``aot2onnx.load`` and ``edge.Trainer``) at open, before any ONNX Runtime session, with the file, the entry and
the problem named; the command line's one-line errors; and mutants of a valid artifact, each refused at open or
training bit for bit as the original does.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import safetensors.numpy
import torch
import torch.nn as nn
import torch.nn.functional as F

import aot2onnx
from aot2onnx.artifact import edge
from aot2onnx.errors import ArtifactError

READERS: dict[str, tuple[Callable, type[Exception]]] = {
    "aot2onnx.load": (aot2onnx.load, ArtifactError),
    "edge.Trainer": (edge.Trainer, edge.ArtifactError),
}
STEPS = 3  # training steps a mutant that opens must take exactly as the original does


class _Net(nn.Module):
    """A parameter-only layer, a BatchNorm (buffers and their updates) and an output besides the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.bn(self.fc(x))
        return F.mse_loss(out, y), out


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)) for _ in range(STEPS)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> pathlib.Path:
    out_dir = tmp_path_factory.mktemp("hostile_adamw")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    example = (torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g))
    aot2onnx.export_training(_Net(), example, out_dir, optimizer=aot2onnx.optim.AdamW(lr=1e-2, weight_decay=0.1))
    return out_dir


@pytest.fixture
def artifact(exported, tmp_path) -> pathlib.Path:
    path = tmp_path / "artifact"
    shutil.copytree(exported, path)
    return path


@pytest.fixture
def sessions(monkeypatch) -> list:
    """Every ONNX Runtime session created while the test runs (both readers create theirs through
    ``onnxruntime.InferenceSession``)."""
    created = []

    class Spy(ort.InferenceSession):
        def __init__(self, *args, **kwargs):
            created.append(args[0] if args else kwargs.get("path_or_bytes"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", Spy)
    return created


def _signature(path: pathlib.Path) -> dict:
    return json.loads((path / "signature.json").read_text())


def _write_signature(path: pathlib.Path, sig: dict, *, embed: bool = False) -> None:
    """signature.json; with ``embed``, the models carry the same text, as one export's files do."""
    (path / "signature.json").write_text(json.dumps(sig))
    if embed:
        for graph in ("forward", "backward", "optimizer"):
            model = onnx.load(str(path / f"{graph}.onnx"))
            next(p for p in model.metadata_props if p.key == edge.SIGNATURE_KEY).value = json.dumps(sig)
            onnx.save(model, str(path / f"{graph}.onnx"))


def _entry(sig: dict, graph: str, direction: str, name: str) -> dict:
    return next(e for e in sig[graph][direction] if e["name"] == name)


def _state(sig: dict, name: str) -> dict:
    return next(e for e in sig["state"] if e["name"] == name)


def _edit_state(path: pathlib.Path, edit: Callable[[dict], None]) -> None:
    tensors = safetensors.numpy.load_file(str(path / "state.safetensors"))
    edit(tensors)
    safetensors.numpy.save_file(tensors, str(path / "state.safetensors"), metadata={"format": edge.FORMAT})


def _refused_at_open(path: pathlib.Path, match: str, sessions: list, readers=tuple(READERS)) -> None:
    """Each reader raises its ArtifactError (a ValueError) matching ``match`` and naming a file of the artifact,
    before creating any session."""
    for reader in readers:
        read, error = READERS[reader]
        before = len(sessions)
        with pytest.raises(error, match=match) as info:
            read(path)
        assert isinstance(info.value, ValueError)
        assert str(path) in str(info.value), f"{reader}: the message names no file of the artifact: {info.value}"
        assert len(sessions) == before, f"{reader} created a session before refusing: {info.value}"


# ---------------------------------------------------------------------------------------------------------
# One crafted directory per rule. Each case edits the signature (a dict) and may change files; it returns the
# pattern the refusal must match (the file, the entry, the problem).


def _missing(name: str) -> Callable:
    def craft(path: pathlib.Path, sig: dict) -> str:
        (path / name).unlink()
        return rf"{name} is missing"
    return craft


def _swap_dtype_everywhere(sig: dict, position: int, dtype: str) -> None:
    sig["user_inputs"][position]["dtype"] = dtype
    for graph in ("forward", "backward"):
        for e in sig[graph]["inputs"]:
            if e["role"] == "user_input" and e["source"] == position:
                e["dtype"] = dtype


def _model_static_where_named(path: pathlib.Path, sig: dict) -> str:
    for graph, direction in (("forward", "outputs"), ("backward", "inputs")):
        _entry(sig, graph, direction, "saved:getitem_1")["shape"] = ["batch"]
    return r"forward.onnx: output 'saved:getitem_1' has shape \[3\] in the model but \['batch'\]"


def _edit_model(path: pathlib.Path, graph: str, edit: Callable[[onnx.ModelProto], None]) -> None:
    model = onnx.load(str(path / f"{graph}.onnx"))
    edit(model)
    (path / f"{graph}.onnx").write_bytes(model.SerializeToString())


def _graph_in_two_pieces(path: pathlib.Path, sig: dict) -> str:
    """ModelProto.graph given twice: protobuf (and so ONNX Runtime) merges the two into one graph."""
    piece = onnx.GraphProto(input=[onnx.helper.make_tensor_value_info("extra", onnx.TensorProto.FLOAT, [1])])
    data = piece.SerializeToString()
    with open(path / "forward.onnx", "ab") as f:
        f.write(bytes([7 << 3 | 2, len(data)]) + data)  # field 7 (graph), length-delimited; len(data) < 128
    assert "extra" in [i.name for i in onnx.load(str(path / "forward.onnx")).graph.input]
    return r"forward.onnx: the model has input 'extra', which the signature does not list"


def _embedded_differs(path: pathlib.Path, sig: dict) -> str:
    other = copy.deepcopy(sig)
    other["versions"]["aot2onnx"] = "0.0.0"
    _edit_model(path, "backward", lambda m: setattr(
        next(p for p in m.metadata_props if p.key == edge.SIGNATURE_KEY), "value", json.dumps(other)))
    return r"backward.onnx carries a different signature than .*signature.json"


def _embedded_twice(path: pathlib.Path, sig: dict) -> str:
    _edit_model(path, "forward", lambda m: m.metadata_props.add(key=edge.SIGNATURE_KEY, value=json.dumps(sig)))
    return r"forward.onnx carries 2 signatures"


def _external(location: str) -> Callable:
    def craft(path: pathlib.Path, sig: dict) -> str:
        if location == "inside.bin":
            (path.parent / "secret.bin").write_bytes(b"\0" * 16)
            (path / "inside.bin").symlink_to(path.parent / "secret.bin")
        tensor = onnx.TensorProto(name="stolen", data_type=onnx.TensorProto.FLOAT, dims=[4])
        tensor.data_location = onnx.TensorProto.EXTERNAL
        tensor.external_data.add(key="location", value=location)
        _edit_model(path, "optimizer", lambda m: m.graph.initializer.append(tensor))
        if location == "missing.bin":
            return r"optimizer.onnx: the external data of tensor 'stolen' is in 'missing.bin', which is missing"
        return r"optimizer.onnx: the external data of tensor 'stolen' is .*outside the artifact directory"
    return craft


def _linked_outside(name: str) -> Callable:
    def craft(path: pathlib.Path, sig: dict) -> str:
        outside = path.parent / f"outside-{name}"
        shutil.move(path / name, outside)
        (path / name).symlink_to(outside)
        return rf"{name}'?, which resolves to .*outside the artifact directory"
    return craft


def _model_path(value: str) -> Callable:
    def craft(path: pathlib.Path, sig: dict) -> str:
        sig["optimizer"]["model"] = value
        return r"signature.json: optimizer.model (is|must be)"
    return craft


def _state_tensor(edit: Callable[[dict], None], match: str) -> Callable:
    def craft(path: pathlib.Path, sig: dict) -> str:
        _edit_state(path, edit)
        return match
    return craft


def _state_entry_differs_from_its_input(field: str) -> Callable:
    """The issue's case: a state entry and its tensor agree with each other, not with the model input they feed.
    Before, both readers opened it and ONNX Runtime failed at the first step."""
    def craft(path: pathlib.Path, sig: dict) -> str:
        if field == "dtype":
            _state(sig, "bn.running_mean")["dtype"] = "float64"
            _edit_state(path, lambda t: t.update({"bn.running_mean": t["bn.running_mean"].astype(np.float64)}))
            return (r"signature.json: forward.inputs 'bn.running_mean' \(buffer\) is float32\[3\], but its source "
                    r"'bn.running_mean' is float64\[3\]")
        _state(sig, "fc.bias")["shape"] = [4]
        _edit_state(path, lambda t: t.update({"fc.bias": np.zeros(4, np.float32)}))
        return r"signature.json: forward.inputs 'fc.bias' \(parameter\) is float32\[3\], but its source 'fc.bias' is float32\[4\]"
    return craft


def _deep_json(path: pathlib.Path, sig: dict) -> str:
    (path / "signature.json").write_text("[" * 200_000 + "]" * 200_000)
    return r"signature.json nests 200000 levels deep"


def _raw_signature(text: str, match: str) -> Callable:
    def craft(path: pathlib.Path, sig: dict) -> str:
        (path / "signature.json").write_text(text.replace("SIG", json.dumps(sig)[1:-1]))
        return match
    return craft


def _sig(edit: Callable[[dict], None], match: str) -> Callable:
    def craft(path: pathlib.Path, sig: dict) -> str:
        edit(sig)
        return match
    return craft


def _then(change: Callable[[pathlib.Path], object], match: str) -> Callable:
    def craft(path: pathlib.Path, sig: dict) -> str:
        change(path)
        return match
    return craft


def _hyper(sig: dict) -> dict:
    return sig["optimizer"]["hyperparameters"]


def _without(d: dict, key: str) -> None:
    del d[key]


def _remove(entries: list, name: str) -> None:
    entries.remove(next(e for e in entries if e["name"] == name))


CASES: dict[str, Callable[[pathlib.Path, dict], str]] = {
    # --- a missing file
    **{f"missing {name}": _missing(name) for name in
       ("signature.json", "state.safetensors", "forward.onnx", "backward.onnx", "optimizer.onnx")},
    # --- format; not JSON; contradictions: unknown role, a source or target naming nothing, one name twice,
    # not exactly one loss
    "unknown format": _sig(lambda s: s.update(format="aot2onnx.training/3"), r"unknown format 'aot2onnx.training/3'"),
    "not JSON": _raw_signature("{SIG", r"signature.json is not valid JSON"),
    "not UTF-8": _then(lambda p: (p / "signature.json").write_bytes(b'{"format": "\xff"}'),
                       r"signature.json is not valid JSON: it is not UTF-8"),
    "not an object": _raw_signature("[{SIG}]", r"signature.json: the signature must be a JSON object"),
    "unknown role": _sig(lambda s: _entry(s, "forward", "inputs", "x").update(role="label"),
                         r"signature.json: forward.inputs 'x' has role 'label'"),
    "source names nothing": _sig(lambda s: _entry(s, "optimizer", "inputs", "fc.weight:exp_avg").update(source="fc.w"),
                                 r"optimizer.inputs 'fc.weight:exp_avg' \(optimizer_state\) has source 'fc.w', which "
                                 r"names no optimizer state"),
    "source of another kind": _sig(lambda s: _entry(s, "forward", "inputs", "bn.running_mean").update(
        source="fc.bias"), r"forward.inputs 'bn.running_mean' \(buffer\) has source 'fc.bias', which names no buffer"),
    "user input out of range": _sig(lambda s: _entry(s, "forward", "inputs", "y").update(source=2),
                                    r"forward.inputs 'y' \(user_input\) has source 2, which names no user input"),
    "user input source a bool": _sig(lambda s: _entry(s, "forward", "inputs", "x").update(source=False),
                                     r"forward.inputs 'x' \(user_input\) has source False"),
    "target names nothing": _sig(lambda s: _entry(s, "optimizer", "outputs", "updated:fc.bias").update(target="fc"),
                                 r"optimizer.outputs 'updated:fc.bias' \(parameter_update\) has target 'fc', which "
                                 "names no parameter"),
    "saved source names nothing": _sig(lambda s: _entry(s, "backward", "inputs", "saved:addmm").update(source="loss2"),
                                       r"backward.inputs 'saved:addmm' \(saved\) has source 'loss2', which names no "
                                       "forward output"),
    "gradient names nothing": _sig(lambda s: _entry(s, "optimizer", "inputs", "grad:fc.bias").update(source="bn.x"),
                                   r"optimizer.inputs 'grad:fc.bias' \(grad\) has source 'bn.x', which names no gradient"),
    "state entry twice": _sig(lambda s: s["state"].append(dict(_state(s, "fc.bias"))),
                              r"signature.json: state 'fc.bias' is listed twice"),
    "model input twice": _sig(lambda s: s["forward"]["inputs"].append(dict(_entry(s, "forward", "inputs", "x"))),
                              r"signature.json: forward.inputs lists 'x' twice"),
    "user input twice": _sig(lambda s: s["user_inputs"].append(dict(s["user_inputs"][0], position=2)),
                             r"signature.json: user_inputs 'x' is listed twice"),
    "tied name is a state name": _sig(lambda s: s.update(tied=[{"name": "fc.bias", "state": "fc.weight"}]),
                                      r"signature.json: tied name 'fc.bias' is listed twice"),
    "no loss": _sig(lambda s: _entry(s, "forward", "outputs", "loss").update(role="saved"),
                    r"exactly one loss output, the signature lists 0"),
    "two losses": _sig(lambda s: s["forward"]["outputs"].append(dict(_entry(s, "forward", "outputs", "loss"),
                                                                     name="loss2")),
                       r"exactly one loss output, the signature lists 2"),
    # --- a model whose inputs or outputs differ (names, dtypes, ranks, static sizes)
    "model input name": _sig(lambda s: _entry(s, "forward", "inputs", "fc.weight").update(name="w"),
                             r"forward.onnx: the signature lists input 'w' \(parameter\), which the model does not have"),
    "model input missing": _sig(lambda s: _remove(s["backward"]["inputs"], "x"),
                                r"backward.onnx: the model has input 'x', which the signature does not list"),
    "model dtype": _sig(lambda s: _swap_dtype_everywhere(s, 1, "float64"),
                        r"forward.onnx: input 'y' is float32 in the model but float64 in the signature"),
    "model rank": _sig(lambda s: [e.update(shape=[3, 1]) for e in (_entry(s, "forward", "outputs", "saved:getitem_2"),
                                                                 _entry(s, "backward", "inputs", "saved:getitem_2"))],
                       r"forward.onnx: output 'saved:getitem_2' has rank 1 in the model but 2"),
    "model static size": _sig(lambda s: [e.update(shape=[5]) for e in (_entry(s, "forward", "outputs", "saved:getitem_2"),
                                                                     _entry(s, "backward", "inputs", "saved:getitem_2"))],
                              r"forward.onnx: output 'saved:getitem_2' has shape \[3\] in the model but \[5\]"),
    "model static where the signature names a dim": _model_static_where_named,
    "model without shapes": _then(lambda p: _edit_model(p, "backward", lambda m: m.graph.output[0].type.tensor_type.
                                                        ClearField("shape")),
                                  r"backward.onnx: output 'grad:fc.weight' has no shape in the model"),
    "model input not a tensor": _then(lambda p: _edit_model(p, "forward", lambda m: m.graph.input[0].type.CopyFrom(
        onnx.helper.make_sequence_type_proto(m.graph.input[0].type))), r"forward.onnx: input 'fc.weight' is not a tensor"),
    "model lists an input twice": _then(lambda p: _edit_model(p, "forward", lambda m: m.graph.input.append(
        m.graph.input[0])), r"forward.onnx: the model lists input 'fc.weight' twice"),
    "model graph in two pieces": _graph_in_two_pieces,
    "model not protobuf": _then(lambda p: (p / "backward.onnx").write_bytes(b"\x0a\xff\xff\xff\xff\x0f"),
                                r"backward.onnx is not a valid ONNX model"),
    # --- a model carrying another signature
    "embedded signature differs": _embedded_differs,
    "embedded signature twice": _embedded_twice,
    # --- the state file
    "state tensor missing": _state_tensor(lambda t: t.pop("bn.running_var"),
                                          r"state.safetensors has no tensor 'bn.running_var' \(buffer"),
    "state tensor dtype": _state_tensor(lambda t: t.update({"fc.bias": t["fc.bias"].astype(np.float16)}),
                                        r"state.safetensors: tensor 'fc.bias' is float16\[3\], the signature says "
                                        r"float32\[3\]"),
    "state tensor shape": _state_tensor(lambda t: t.update({"fc.weight": np.ascontiguousarray(t["fc.weight"].T)}),
                                        r"tensor 'fc.weight' is float32\[4, 3\], the signature says float32\[3, 4\]"),
    "state file corrupt": _then(lambda p: (p / "state.safetensors").write_bytes(b"\xff" * 64),
                                r"state.safetensors is not a readable safetensors file"),
    # --- paths that leave the directory
    "signature.json linked outside": _linked_outside("signature.json"),
    "state.safetensors linked outside": _linked_outside("state.safetensors"),
    "model linked outside": _linked_outside("forward.onnx"),
    "model path with ..": _model_path("../optimizer.onnx"),
    "model path absolute": _model_path("/etc/passwd"),
    "model path with a NUL": _model_path("optimizer.onnx\0.txt"),
    "model path a number": _model_path(7),
    "external data with ..": _external("../secret.bin"),
    "external data absolute": _external("/etc/passwd"),
    "external data linked outside": _external("inside.bin"),
    "external data missing": _external("missing.bin"),
    # --- issue 39: two writers of one state entry (trained, exit 0, one update lost)
    "two optimizer outputs write one entry": _sig(
        lambda s: _entry(s, "optimizer", "outputs", "updated:fc.weight:exp_avg").update(target="fc.weight:exp_avg_sq"),
        r"signature.json: optimizer.outputs 'updated:fc.weight:exp_avg_sq' \(optimizer_state_update\) writes state "
        r"'fc.weight:exp_avg_sq', which optimizer.outputs 'updated:fc.weight:exp_avg' writes too"),
    "two buffer updates write one entry": _sig(
        lambda s: _entry(s, "forward", "outputs", "updated:bn.running_var").update(target="bn.running_mean"),
        r"forward.outputs 'updated:bn.running_var' \(buffer_update\) writes state 'bn.running_mean', which "
        r"forward.outputs 'updated:bn.running_mean' writes too"),
    "two gradients of one parameter": _sig(
        lambda s: _entry(s, "backward", "outputs", "grad:bn.weight").update(target="bn.bias"),
        r"backward.outputs lists two gradients of 'bn.bias'"),
    # --- issue 39: an entry that does not fit the model input it feeds or the output that writes it (found at
    # the first step, as ONNX Runtime's errors)
    "state dtype differs from its input": _state_entry_differs_from_its_input("dtype"),
    "state shape differs from its input": _state_entry_differs_from_its_input("shape"),
    "output does not fit its target": _sig(lambda s: _entry(s, "optimizer", "outputs", "updated:fc.bias").update(
        dtype="float64"), r"optimizer.outputs 'updated:fc.bias' \(parameter_update\) is float64\[3\], but its target "
        r"'fc.bias' is float32\[3\]"),
    "saved value does not fit": _sig(lambda s: _entry(s, "backward", "inputs", "saved:getitem_1").update(shape=[4]),
                                     r"backward.inputs 'saved:getitem_1' \(saved\) is float32\[4\], but its source "
                                     r"'saved:getitem_1' is float32\[3\]"),
    "gradient does not fit its parameter": _sig(lambda s: _entry(s, "backward", "outputs", "grad:fc.bias").update(
        shape=[3, 1]), r"backward.outputs 'grad:fc.bias' \(grad\) is float32\[3, 1\], but its target 'fc.bias'"),
    "user input does not fit": _sig(lambda s: _entry(s, "backward", "inputs", "x").update(shape=["batch", 5]),
                                    r"backward.inputs 'x' \(user_input\) is float32\['batch', 5\], but its source 0 is "
                                    r"float32\['batch', 4\]"),
    "lr not float64": _sig(lambda s: _entry(s, "optimizer", "inputs", "optimizer:lr").update(dtype="float32"),
                           r"optimizer.inputs 'optimizer:lr' \(lr\) is float32\[\]; the lr input is float64\[\]"),
    "step counter not int64": _sig(lambda s: [e.update(dtype="float32") for e in (
        _state(s, "optimizer:step"), _entry(s, "optimizer", "inputs", "optimizer:step"),
        _entry(s, "optimizer", "outputs", "updated:optimizer:step"))],
        r"state 'optimizer:step' is the optimizer's step counter and must be int64\[\], got float32\[\]"),
    "gradient of a frozen parameter": _sig(lambda s: _state(s, "bn.bias").update(requires_grad=False),
                                           r"backward.outputs 'grad:bn.bias' \(grad\) is a gradient of 'bn.bias', which "
                                           "has requires_grad false"),
    # --- issue 39: sizes taken on trust
    "grad_of_loss of 2^31 x 16": _sig(lambda s: _entry(s, "backward", "inputs", "grad:loss").update(
        shape=[2**31, 16]), r"backward.inputs 'grad:loss' has shape \[2147483648, 16\], beyond this reader's limits"),
    "grad_of_loss not a scalar": _sig(lambda s: _entry(s, "backward", "inputs", "grad:loss").update(shape=[1000, 1000]),
                                      r"backward.inputs 'grad:loss' \(grad_of_loss\) is float32\[1000, 1000\], but the "
                                      r"loss is float32\[\]"),
    "too many elements": _sig(lambda s: _entry(s, "forward", "outputs", "output_1").update(
        shape=["batch", 2**31 - 1, 4]), r"forward.outputs 'output_1' has shape .*beyond this reader's limits"),
    "negative state size": _sig(lambda s: _state(s, "fc.bias").update(shape=[-3]),
                                r"state 'fc.bias' has shape \[-3\]; expected a list of sizes >= 0"),
    "negative model size": _sig(lambda s: _entry(s, "forward", "inputs", "x").update(shape=["batch", -4]),
                                r"forward.inputs 'x' has shape \['batch', -4\]; expected a list of sizes >= 0 and "
                                "dimension names"),
    "size a float": _sig(lambda s: _state(s, "fc.bias").update(shape=[3.0]), r"state 'fc.bias' has shape \[3.0\]"),
    "size a bool": _sig(lambda s: _state(s, "fc.bias").update(shape=[True]), r"state 'fc.bias' has shape \[True\]"),
    "dim min above max": _sig(lambda s: s["dims"]["batch"].update(max=1),
                              r"dim 'batch' needs integers 1 <= 'min' <= 'example' <= 'max'"),
    "dim min 0": _sig(lambda s: s["dims"]["batch"].update(min=0), r"dim 'batch' needs integers 1 <= 'min'"),
    "dim example huge": _sig(lambda s: s["dims"]["batch"].update(example=2**40), r"dim 'batch' needs integers"),
    "dims a list": _sig(lambda s: s.update(dims=[]), r"'dims' must be a JSON object"),
    "user input dim not in dims": _sig(lambda s: s["user_inputs"][0].update(shape=["n", 4]),
                                       r"user_inputs 'x' has dimension 'n', which 'dims' does not list"),
    "position wrong": _sig(lambda s: s["user_inputs"][1].update(position=0), r"user_inputs 'y' has position 0, expected 1"),
    # --- issue 39: JSON that used to raise untyped errors
    "200,000-deep JSON": _deep_json,
    "duplicate key": _raw_signature('{SIG, "format": "aot2onnx.training/1"}',
                                    r"signature.json: an object lists the key 'format' twice"),
    "NaN": _raw_signature('{SIG, "extra": NaN}', r"signature.json: NaN is not a JSON number"),
    "number out of range": _raw_signature('{SIG, "extra": 1e999}', r"signature.json: the number 1e999 is out of range"),
    "integer of 5000 digits": _raw_signature('{SIG, "extra": ' + "9" * 5000 + "}", r"signature.json is not valid JSON"),
    # --- issue 39: hyperparameters incomplete or of other types (KeyError at the first step, AttributeError)
    "no lr": _sig(lambda s: _without(_hyper(s), "lr"), r"optimizer.hyperparameters has no 'lr'"),
    "lr a string": _sig(lambda s: _hyper(s).update(lr="0.01"), r"optimizer.hyperparameters 'lr' is '0.01'"),
    "lr negative": _sig(lambda s: _hyper(s).update(lr=-1.0), r"optimizer.hyperparameters 'lr' is -1.0"),
    "hyperparameters a list": _sig(lambda s: s["optimizer"].update(hyperparameters=[1e-2]),
                                   r"optimizer.hyperparameters must be a JSON object, got \[0.01\]"),
    "no weight_decay": _sig(lambda s: _without(_hyper(s), "weight_decay"),
                            r"optimizer.hyperparameters has no 'weight_decay'"),
    "betas of three": _sig(lambda s: _hyper(s).update(betas=[0.9, 0.99, 0.999]),
                           r"optimizer.hyperparameters 'betas' is \[0.9, 0.99, 0.999\]; expected two numbers"),
    "sgd without momentum": _sig(lambda s: _hyper(s).update(name="sgd"), r"optimizer.hyperparameters has no 'momentum'"),
    "unknown optimizer": _sig(lambda s: _hyper(s).update(name="lion"), r"names optimizer 'lion'"),
    "schedule unknown": _sig(lambda s: _hyper(s).update(schedule={"name": "step"}), r"schedule \{'name': 'step'\}"),
    "schedule steps a string": _sig(lambda s: _hyper(s).update(schedule={"name": "linear", "warmup_steps": "2",
                                                                         "total_steps": 9}), r"schedule"),
    "max_grad_norm negative": _sig(lambda s: _hyper(s).update(max_grad_norm=-1), r"max_grad_norm is -1"),
    # --- issue 39: fields aot2onnx.load trusted
    "user output without index": _sig(lambda s: _without(_entry(s, "forward", "outputs", "output_1"), "index"),
                                      r"forward.outputs 'output_1' \(user_output\) has index None"),
    "user output index a string": _sig(lambda s: _entry(s, "forward", "outputs", "output_1").update(index="1"),
                                       r"forward.outputs 'output_1' \(user_output\) has index '1'"),
    "index on a loss": _sig(lambda s: _entry(s, "forward", "outputs", "loss").update(index=0),
                            r"forward.outputs 'loss' \(loss\) has an 'index'"),
    "module without returns": _sig(lambda s: _without(s["module"], "returns"), r"'module' must be an object"),
    "returns loss with outputs": _sig(lambda s: s["module"].update(returns="loss"),
                                      r"module.returns is \"loss\", but forward.outputs lists user_output entries"),
    "tied to optimizer state": _sig(lambda s: s.update(tied=[{"name": "fc.w", "state": "fc.weight:exp_avg"}]),
                                    r"tied entry .* must have a 'name' and a 'state' naming a parameter or buffer"),
    "tied name a module of a tensor": _sig(lambda s: s.update(tied=[{"name": "fc", "state": "bn.weight"}]),
                                           r"state 'fc.weight' lies in module 'fc', which is a tensor too"),
    "state name with an empty part": _sig(lambda s: s.update(tied=[{"name": "head..weight", "state": "bn.weight"}]),
                                          r"state 'head..weight' is not a module path"),
    "requires_grad a string": _sig(lambda s: _state(s, "fc.bias").update(requires_grad="yes"),
                                   r"state 'fc.bias' has requires_grad 'yes'"),
    "source on a loss": _sig(lambda s: _entry(s, "forward", "outputs", "loss").update(source="x"),
                             r"forward.outputs 'loss' \(loss\) has a 'source'"),
    "target on an input": _sig(lambda s: _entry(s, "forward", "inputs", "fc.bias").update(target="fc.bias"),
                               r"forward.inputs 'fc.bias' \(parameter\) has a 'target'"),
    "sections a list": _sig(lambda s: s.update(backward=[]), r"'backward' must be a JSON object, got \[\]"),
    "versions a string": _sig(lambda s: s.update(versions="1"), r"'versions' must be a JSON object"),
}


def _craft(case: str, path: pathlib.Path) -> str:
    """Applies ``case`` to the artifact in ``path``; returns the pattern of its refusal."""
    sig = _signature(path)
    before = json.dumps(sig)  # not ==: False == 0 and 3.0 == 3 in Python, not in JSON
    match = CASES[case](path, sig)
    if json.dumps(sig) != before:
        _write_signature(path, sig)
    return match


@pytest.mark.parametrize("case", list(CASES))
def test_refused_at_open_by_both_readers(case, artifact, sessions):
    _refused_at_open(artifact, _craft(case, artifact), sessions)


def test_the_crafted_cases_start_from_an_artifact_both_readers_open(artifact, sessions):
    for read, _ in READERS.values():
        before = len(sessions)
        read(artifact)
        assert len(sessions) > before


def test_refuses_a_signature_too_large(artifact, sessions, monkeypatch):
    monkeypatch.setattr(edge, "MAX_SIGNATURE_BYTES", 1000)
    _refused_at_open(artifact, r"signature.json is \d+ bytes; a signature is at most 1000", sessions)


def test_a_signature_that_disagrees_only_with_the_models_is_refused_too(artifact, sessions):
    """Written into the models as well (an attacker's consistent files): the model checks still refuse it."""
    sig = _signature(artifact)
    _swap_dtype_everywhere(sig, 0, "float64")
    _write_signature(artifact, sig, embed=True)
    _refused_at_open(artifact, r"forward.onnx: input 'x' is float32 in the model but float64", sessions)


def test_load_refuses_a_name_no_module_can_hold(artifact, sessions):
    """Torch's own rules for names (nn.Module's attributes) are aot2onnx.load's: the torch-free trainer, which
    registers nothing, trains such an artifact."""
    sig = _signature(artifact)
    sig["tied"] = [{"name": "bn.forward", "state": "bn.weight"}]
    _write_signature(artifact, sig, embed=True)
    _refused_at_open(artifact, r"signature.json: tied: 'bn.forward' cannot be a name in a module: .*already exists",
                     sessions, readers=("aot2onnx.load",))
    edge.Trainer(artifact).step(*(b.numpy() for b in _batches()[0]))


def test_json_depth_is_measured_outside_strings():
    nested = {"a": {"b": {"c": ["[[[[", "{{{{\\"]}}}
    assert edge.parse_json(json.dumps(nested).encode(), "x") == nested
    with pytest.raises(edge.ArtifactError, match="nests 33 levels deep"):
        edge.parse_json(b"[" * 33 + b"]" * 33, "x")
    edge.parse_json(b"[" * 32 + b"]" * 32, "x")


def test_the_model_reader_follows_onnx_proto():
    """edge.py reads models with field numbers of its own (onnx is no dependency of the device's file)."""
    fields = {
        (onnx.ModelProto, "graph"): edge._MODEL_GRAPH, (onnx.ModelProto, "metadata_props"): edge._MODEL_METADATA,
        (onnx.GraphProto, "initializer"): edge._GRAPH_INITIALIZER, (onnx.GraphProto, "input"): edge._GRAPH_INPUT,
        (onnx.GraphProto, "output"): edge._GRAPH_OUTPUT,
        (onnx.GraphProto, "sparse_initializer"): edge._GRAPH_SPARSE_INITIALIZER,
        (onnx.ValueInfoProto, "name"): edge._VALUE_NAME, (onnx.ValueInfoProto, "type"): edge._VALUE_TYPE,
        (onnx.TypeProto, "tensor_type"): edge._TYPE_TENSOR, (onnx.TypeProto, "denotation"): edge._TYPE_DENOTATION,
        (onnx.TypeProto.Tensor, "elem_type"): edge._TENSOR_ELEM_TYPE, (onnx.TypeProto.Tensor, "shape"): edge._TENSOR_SHAPE,
        (onnx.TensorShapeProto, "dim"): edge._SHAPE_DIM,
        (onnx.TensorShapeProto.Dimension, "dim_value"): edge._DIM_VALUE,
        (onnx.TensorShapeProto.Dimension, "dim_param"): edge._DIM_PARAM,
        (onnx.SparseTensorProto, "values"): edge._SPARSE_VALUES, (onnx.TensorProto, "name"): edge._TENSOR_NAME,
    }
    for (message, field), number in fields.items():
        assert message.DESCRIPTOR.fields_by_name[field].number == number, (message.DESCRIPTOR.name, field)
    for code, dtype in edge._ONNX_DTYPES.items():
        assert onnx.helper.tensor_dtype_to_np_dtype(code).name == dtype
    assert set(edge._ONNX_DTYPES.values()) == set(edge._DTYPES)


def test_the_model_reader_reads_what_onnx_reads(exported):
    def dims(value: onnx.ValueInfoProto) -> list:
        return [d.dim_param if d.HasField("dim_param") else d.dim_value for d in value.type.tensor_type.shape.dim]

    for graph in ("forward", "backward", "optimizer"):
        path = exported / f"{graph}.onnx"
        model, read = onnx.load(str(path)), edge._read_model(path)
        for values, found in ((model.graph.input, read.inputs), (model.graph.output, read.outputs)):
            expected = {v.name: (onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name, dims(v))
                        for v in values}
            assert found == expected
        assert read.metadata == {p.key: [p.value] for p in model.metadata_props}


# ---------------------------------------------------------------------------------------------------------
# The command line: one line for bad input, a traceback for a bug of the reader


def _npz(path: pathlib.Path, n: int = 2, batch: int = 8) -> pathlib.Path:
    g = np.random.default_rng(0)
    np.savez(path, x=g.standard_normal((n, batch, 4), dtype=np.float32),
             y=g.standard_normal((n, batch, 3), dtype=np.float32))
    return path


def _cli(artifact: pathlib.Path, data: pathlib.Path, capsys) -> tuple[int, str]:
    code = edge.main([str(artifact), "--data", str(data), "--steps", "2", "--out", str(artifact.parent / "out.st")])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case", ["200,000-deep JSON", "no lr", "hyperparameters a list",
                                  "two optimizer outputs write one entry", "state dtype differs from its input",
                                  "grad_of_loss of 2^31 x 16", "model not protobuf"])
def test_cli_reports_a_hostile_artifact_in_one_line(case, artifact, capsys):
    _craft(case, artifact)
    code, err = _cli(artifact, _npz(artifact.parent / "b.npz"), capsys)
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err


DATA = {
    "an .npy, not an .npz": (lambda p: np.save(p.open("wb"), np.zeros(3, np.float32)), "holds one array"),
    "not a zip": (lambda p: p.write_bytes(b"PK\x03\x04 truncated"), "is not an .npz file numpy reads"),
    "empty file": (lambda p: p.write_bytes(b""), "is not an .npz file numpy reads"),
    "pickled objects": (lambda p: np.savez(p, x=np.array([{}], dtype=object), y=np.zeros((1, 8, 3), np.float32)),
                        "allow_pickle=False"),
    "no batches": (lambda p: np.savez(p, x=np.zeros((0, 8, 4), np.float32), y=np.zeros((0, 8, 3), np.float32)),
                   "of one batch or more"),
    "wrong dtype": (lambda p: np.savez(p, x=np.zeros((1, 8, 4), np.float64), y=np.zeros((1, 8, 3), np.float32)),
                    "input 'x' must be float32"),
    "batch below min": (lambda p: np.savez(p, x=np.zeros((1, 1, 4), np.float32), y=np.zeros((1, 1, 3), np.float32)),
                        "outside the exported range"),
    "index out of range in the model": (None, "ONNX Runtime failed at step 1"),
}


@pytest.mark.parametrize("case", list(DATA))
def test_cli_reports_bad_data_in_one_line(case, artifact, capsys):
    write, message = DATA[case]
    data = artifact.parent / "b.npz"
    if write is None:
        # A model that fails inside ONNX Runtime although every check passes: a Gather index out of range.
        _npz(data)
        _edit_model(artifact, "forward", _gather_out_of_range)
    else:
        write(data)
    code, err = _cli(artifact, data, capsys)
    assert code == 1 and message in err and err.count("\n") == 1 and "Traceback" not in err, err


def _gather_out_of_range(model: onnx.ModelProto) -> None:
    """loss = loss + Gather(x, [99])[0, 0] * 0: the output keeps its dtype and shape; the index is out of range."""
    graph = model.graph
    loss = next(o for o in graph.output if o.name == "loss")
    producer = next(n for n in graph.node if "loss" in n.output)
    producer.output[list(producer.output).index("loss")] = "loss_before"
    graph.initializer.append(onnx.numpy_helper.from_array(np.array([99], np.int64), "bad_index"))
    graph.initializer.append(onnx.numpy_helper.from_array(np.array([0, 0], np.int64), "corner"))
    graph.node.extend([
        onnx.helper.make_node("Gather", ["x", "bad_index"], ["picked"]),
        onnx.helper.make_node("Reshape", ["picked", "shape_of"], ["flat"]),
        onnx.helper.make_node("ReduceSum", ["flat"], ["summed"], keepdims=0),
        onnx.helper.make_node("Mul", ["summed", "zero"], ["nothing"]),
        onnx.helper.make_node("Add", ["loss_before", "nothing"], [loss.name]),
    ])
    graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1], np.int64), "shape_of"))
    graph.initializer.append(onnx.numpy_helper.from_array(np.array(0, np.float32), "zero"))


def test_cli_shows_the_traceback_of_a_bug_in_the_reader(artifact, capsys, monkeypatch):
    def broken(self, *inputs):
        raise KeyError("a bug of the reader")

    monkeypatch.setattr(edge.Trainer, "step", broken)
    with pytest.raises(KeyError, match="a bug of the reader"):
        _cli(artifact, _npz(artifact.parent / "b.npz"), capsys)


def test_copied_cli_reports_deep_json_in_one_line(artifact, tmp_path):
    """As a device runs it: a copy of edge.py, in a process of its own."""
    shutil.copy(edge.__file__, tmp_path / "edge.py")
    _deep_json(artifact, {})
    run = subprocess.run([sys.executable, "edge.py", str(artifact), "--data", str(_npz(tmp_path / "b.npz")),
                          "--steps", "1", "--out", str(tmp_path / "out.st")], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert run.returncode == 1 and run.stderr.count("\n") == 1 and "nests 200000 levels deep" in run.stderr, run.stderr


# ---------------------------------------------------------------------------------------------------------
# Mutants: each refused at open, or training bit for bit as the original
#
# The operators change structure: drop a field or an entry, duplicate an entry (or a key, in the JSON text),
# replace a value by one of another JSON type, resize a size or a shape's rank, rename a key or a string value
# (to a name nothing else has). They never replace a number by another number nor a name by another existing
# name: such an artifact is consistent and means something else (another learning rate, inputs swapped), which
# no reader can tell from the files.

MUTANTS = 40  # the default run; -m slow adds SLOW_MUTANTS more
SLOW_MUTANTS = 600
_OTHER_TYPES = [None, True, -1, "x", [], {}]  # one value of each JSON type; -1 is no size, index or limit


def _json_type(value) -> str:
    if isinstance(value, bool) or value is None:
        return type(value).__name__
    return "number" if isinstance(value, (int, float)) else type(value).__name__


def _paths(value, path=()) -> list[tuple]:
    found = [path] if path else []
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        found += _paths(child, (*path, key))
    return found


class _Pairs(list):
    """A JSON object as its (key, value) pairs, so that a key can appear twice."""


def _dumps(value) -> str:
    if isinstance(value, _Pairs):
        return "{" + ", ".join(f"{json.dumps(k)}: {_dumps(v)}" for k, v in value) + "}"
    if isinstance(value, dict):
        return _dumps(_Pairs(value.items()))
    if isinstance(value, list):
        return "[" + ", ".join(_dumps(v) for v in value) + "]"
    return json.dumps(value)


def _mutate(sig: dict, rng: random.Random) -> tuple[str, str] | None:
    """One structural change at a random place of ``sig`` (the mutant's JSON text), or None where the operator
    drawn does not apply."""
    sig = copy.deepcopy(sig)
    path = rng.choice(_paths(sig))
    parent = sig
    for key in path[:-1]:
        parent = parent[key]
    key, value = path[-1], parent[path[-1]]
    where = "/".join(map(str, path))
    operator = rng.choice(["drop", "duplicate", "retype", "resize", "rename"])
    if operator == "drop":
        del parent[key]
    elif operator == "duplicate":
        if isinstance(parent, list):
            parent.insert(key, copy.deepcopy(value))
        else:  # the key twice, the second time with a value of another type
            other = rng.choice([v for v in _OTHER_TYPES if _json_type(v) != _json_type(value)])
            grandparent = sig
            for step in path[:-2]:
                grandparent = grandparent[step]
            pairs = _Pairs(parent.items())
            pairs.insert(rng.randrange(len(pairs) + 1), (key, other))
            if len(path) == 1:
                sig = pairs
            else:
                grandparent[path[-2]] = pairs
    elif operator == "retype":
        value = rng.choice([v for v in _OTHER_TYPES if _json_type(v) != _json_type(value)])
        parent[key] = value
    elif operator == "resize":
        if isinstance(value, list) and all(isinstance(d, (int, str)) and not isinstance(d, bool) for d in value) \
                and path[-1] == "shape":
            value = value + [1] if rng.random() < 0.5 or not value else value[:-1]
        elif isinstance(value, int) and not isinstance(value, bool):
            value = rng.choice([value + 1, value - 1, -1, 0, 2**31, 2**62, -(2**63)])
        else:
            return None
        parent[key] = value
    else:  # rename
        if isinstance(parent, dict) and rng.random() < 0.5:
            parent[f"{key}_renamed"] = parent.pop(key)
        elif isinstance(value, str):
            value = f"{value}~renamed"
            parent[key] = value
        else:
            return None
    description = f"{operator} {where}" + (f" -> {value!r}" if operator in ("retype", "resize", "rename") else "")
    return description, _dumps(sig)


def _state_mutant(tensors: dict, rng: random.Random) -> str:
    name = rng.choice(sorted(tensors))
    operator = rng.choice(["drop", "retype", "resize", "rename"])
    if operator == "drop":
        del tensors[name]
    elif operator == "retype":
        tensors[name] = tensors[name].astype(np.float64 if tensors[name].dtype != np.float64 else np.float32)
    elif operator == "resize":
        tensors[name] = np.zeros((*tensors[name].shape, 2), tensors[name].dtype)
    else:
        tensors[f"{name}~renamed"] = tensors.pop(name)
    return f"state.safetensors: {operator} {name}"


@pytest.fixture(scope="module")
def reference(exported, tmp_path_factory) -> tuple[pathlib.Path, dict, dict]:
    """The base of every mutant (the export, its models without embedded signatures, so that a mutant of
    signature.json meets every other check) and how the original trains in each reader."""
    base = tmp_path_factory.mktemp("mutant_base")
    shutil.rmtree(base)
    shutil.copytree(exported, base)
    for graph in ("forward", "backward", "optimizer"):
        _edit_model(base, graph, lambda m: m.metadata_props.remove(
            next(p for p in m.metadata_props if p.key == edge.SIGNATURE_KEY)))
    return base, _train_edge(base), _train_load(base)


def _train_edge(path: pathlib.Path) -> dict:
    trainer = edge.Trainer(path)
    losses = [trainer.step(*(b.numpy() for b in batch)) for batch in _batches()]
    return {"losses": losses, **{k: v.copy() for k, v in trainer.state.items()}}


def _train_load(path: pathlib.Path) -> dict:
    module = aot2onnx.load(path)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    results = {}
    for i, batch in enumerate(_batches()):
        loss, out = module(*batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        results[f"loss {i}"], results[f"out {i}"] = loss.detach().numpy(), out.numpy()
    return {**results, **{k: v.detach().numpy().copy() for k, v in module.state_dict().items()}}


def _bitwise_equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = np.asarray(a[key]), np.asarray(b[key])
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            return False
    return True


def _check_mutant(index: int, reference, tmp_path: pathlib.Path, sessions: list) -> None:
    base, edge_trained, load_trained = reference
    rng = random.Random(index)
    path = tmp_path / "mutant"
    shutil.copytree(base, path)
    if rng.random() < 0.1:
        tensors = safetensors.numpy.load_file(str(path / "state.safetensors"))
        description = _state_mutant(tensors, rng)
        safetensors.numpy.save_file(tensors, str(path / "state.safetensors"))
    else:
        mutant = None
        while mutant is None:
            mutant = _mutate(_signature(base), rng)
        description, text = mutant
        (path / "signature.json").write_text(text)
    for reader, (_, error) in READERS.items():
        before = len(sessions)
        train = _train_edge if reader == "edge.Trainer" else _train_load
        try:
            trained = train(path)
        except error as e:
            assert str(path) in str(e), f"mutant {index} ({description}): {reader}'s refusal names no file: {e}"
            assert len(sessions) == before, f"mutant {index} ({description}): {reader} refused it after a session: {e}"
            continue
        expected = edge_trained if reader == "edge.Trainer" else load_trained
        assert _bitwise_equal(trained, expected), f"mutant {index} ({description}) trains otherwise in {reader}"


@pytest.mark.parametrize("index", range(MUTANTS))
def test_a_mutant_is_refused_at_open_or_trains_as_the_original(index, reference, tmp_path, sessions):
    _check_mutant(index, reference, tmp_path, sessions)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(MUTANTS, MUTANTS + SLOW_MUTANTS))
def test_a_mutant_is_refused_at_open_or_trains_as_the_original_slow(index, reference, tmp_path, sessions):
    _check_mutant(index, reference, tmp_path, sessions)


# Changes that keep an artifact valid: both readers open it and train it as the original (the mutants above
# are mostly refused; these show that the comparison runs, and that the checks are not stricter than the format).
BENIGN: dict[str, Callable[[dict], None]] = {
    "requires_grad dropped (true is the default)": lambda s: _without(_state(s, "fc.weight"), "requires_grad"),
    "versions dropped (informative)": lambda s: _without(s, "versions"),
    "an unknown key": lambda s: s.update(comment="from a newer exporter"),
    "another name of a saved value's dimension": lambda s: [
        e["shape"].__setitem__(0, "16*batch") for e in (_entry(s, "forward", "outputs", "saved:addmm"),
                                                        _entry(s, "backward", "inputs", "saved:addmm"))],
    "schedule and max_grad_norm dropped (constant, none)": lambda s: [
        _without(_hyper(s), "schedule"), _without(_hyper(s), "max_grad_norm")],
    "another example batch": lambda s: s["dims"]["batch"].update(example=5),
    "another output index": lambda s: _entry(s, "forward", "outputs", "output_1").update(index=7),
    "no optimizer (the trainer refuses it at open)": lambda s: s.update(optimizer=None),
}


@pytest.mark.parametrize("change", list(BENIGN))
def test_a_valid_change_opens_and_trains_as_the_original(change, reference, tmp_path, sessions):
    base, edge_trained, load_trained = reference
    shutil.copytree(base, tmp_path / "a")
    sig = _signature(base)
    BENIGN[change](sig)
    _write_signature(tmp_path / "a", sig)
    assert _bitwise_equal(_train_load(tmp_path / "a"), load_trained)
    if sig["optimizer"] is None:
        _refused_at_open(tmp_path / "a", "was exported without an optimizer", sessions, readers=("edge.Trainer",))
    else:
        assert _bitwise_equal(_train_edge(tmp_path / "a"), edge_trained)


def test_the_comparison_sees_another_learning_rate(reference, tmp_path):
    base, edge_trained, _ = reference
    shutil.copytree(base, tmp_path / "a")
    sig = _signature(base)
    _hyper(sig)["lr"] *= 2
    _write_signature(tmp_path / "a", sig)
    assert not _bitwise_equal(_train_edge(tmp_path / "a"), edge_trained)
