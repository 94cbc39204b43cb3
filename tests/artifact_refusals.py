"""Hostile and broken artifacts every reader refuses at open, as one list: the cases of tests/test_export.py
("Refusing bad artifacts") and tests/test_robustness.py (files and external data that point elsewhere), each a
change to a copy of a good artifact and the pattern its refusal message matches.

The base artifact is test_export.py's "mlp" shape: ``WithLoss(nn.Sequential(Linear(32, 64), ReLU, Linear(64,
64), ReLU, Linear(64, 8)), loss)`` over inputs ``x`` [batch, 32] and ``y``, exported with SGD, so the names the
cases edit (``model.0.weight``, ``grad:model.0.bias``, ``model.2.bias``) exist. tests/test_js_trainer.py runs
every case through the Python reader (edge.Trainer) and the JavaScript one (Node, and the browser where one is
installed), so a case added here is checked against all of them.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
from collections.abc import Callable

import numpy as np
import onnx
import safetensors.numpy
from onnx import helper

__all__ = ["Refusal", "REFUSALS", "ACCEPTED", "prepare"]


@dataclasses.dataclass(frozen=True)
class Refusal:
    change: Callable[[pathlib.Path, pathlib.Path], None]  # (artifact copy, a scratch directory outside it)
    match: str  # a regular expression the refusal's message matches
    over_http: bool = True  # False: the case needs a file system (symbolic links); a URL reader cannot see it


def _edit_signature(edit: Callable[[dict], None]) -> Callable[[pathlib.Path, pathlib.Path], None]:
    def change(path: pathlib.Path, scratch: pathlib.Path) -> None:
        sig = json.loads((path / "signature.json").read_text())
        edit(sig)
        (path / "signature.json").write_text(json.dumps(sig))

    return change


def _entry(sig: dict, graph: str, direction: str, name: str) -> dict:
    return next(e for e in sig[graph][direction] if e["name"] == name)


def _unlink(file: str):
    return lambda path, scratch: (path / file).unlink()


def _write(file: str, data: bytes):
    return lambda path, scratch: (path / file).write_bytes(data)


def _edit_state(edit: Callable[[dict], None]):
    def change(path: pathlib.Path, scratch: pathlib.Path) -> None:
        state = safetensors.numpy.load_file(str(path / "state.safetensors"))
        edit(state)
        safetensors.numpy.save_file(state, str(path / "state.safetensors"))

    return change


def _other_export(path: pathlib.Path, scratch: pathlib.Path) -> None:
    # backward.onnx as another export of the same module writes it: the same inputs and outputs, another
    # signature inside (test_export.py copies an AdamW export's; a changed hyperparameter is the same case).
    sig = json.loads((path / "signature.json").read_text())
    sig["optimizer"]["hyperparameters"]["lr"] *= 2
    model = onnx.load(str(path / "backward.onnx"))
    next(p for p in model.metadata_props if p.key == "aot2onnx.signature").value = json.dumps(sig, sort_keys=True)
    (path / "backward.onnx").write_bytes(model.SerializeToString())


def _external_tensor(location: str) -> onnx.TensorProto:
    tensor = onnx.TensorProto(name="stolen", data_type=onnx.TensorProto.FLOAT, dims=[4])
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=location)
    return tensor


def _secret(scratch: pathlib.Path) -> pathlib.Path:
    secret = scratch / "secret.bin"
    secret.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    return secret


def _external_initializer(model_file: str, where: str):
    def change(path: pathlib.Path, scratch: pathlib.Path) -> None:
        secret = _secret(scratch)
        if where == "symlink":
            (path / "inside.bin").symlink_to(secret)
        location = {"parent": "../secret.bin", "absolute": str(secret), "nested_parent": "sub/../../secret.bin",
                    "symlink": "inside.bin", "missing": "weights.bin"}[where]
        model = onnx.load(str(path / model_file))
        model.graph.initializer.append(_external_tensor(location))
        (path / model_file).write_bytes(model.SerializeToString())

    return change


def _function_with(where: str, tensor: onnx.TensorProto) -> onnx.FunctionProto:
    """A function adding a constant held in a node attribute, a subgraph of one, or the default value of the
    function's own attribute (tests/test_robustness.py's cases)."""
    if where == "node attribute":
        body = [helper.make_node("Constant", [], ["c"], value=tensor)]
    elif where == "subgraph":
        branch = helper.make_graph([helper.make_node("Constant", [], ["inner"], value=tensor)], "branch", [],
                                   [helper.make_tensor_value_info("inner", onnx.TensorProto.FLOAT, [4])])
        body = [helper.make_node("Constant", [], ["cond"], value=helper.make_tensor("t", onnx.TensorProto.BOOL, [], [True])),
                helper.make_node("If", ["cond"], ["c"], then_branch=branch, else_branch=branch)]
    else:
        constant = helper.make_node("Constant", [], ["c"])
        constant.attribute.append(onnx.AttributeProto(name="value", ref_attr_name="v", type=onnx.AttributeProto.TENSOR))
        body = [constant]
    function = helper.make_function("test.refusals", "AddConstant", ["x"], ["y"],
                                    [*body, helper.make_node("Add", ["x", "c"], ["y"])],
                                    [helper.make_opsetid("", 18)], attributes=["v"] if where == "attribute default" else [])
    if where == "attribute default":
        function.attribute.clear()
        function.attribute_proto.append(helper.make_attribute("v", tensor))
    return function


def _external_in_function(where: str):
    def change(path: pathlib.Path, scratch: pathlib.Path) -> None:
        _secret(scratch)
        model = onnx.load(str(path / "backward.onnx"))
        model.functions.append(_function_with(where, _external_tensor("../secret.bin")))
        (path / "backward.onnx").write_bytes(model.SerializeToString())

    return change


def _symlink_outside(file: str):
    def change(path: pathlib.Path, scratch: pathlib.Path) -> None:
        # The file outside is a valid copy: a reader that follows the link would load it without complaint.
        outside = scratch / "elsewhere" / file
        outside.parent.mkdir()
        (path / file).rename(outside)
        (path / file).symlink_to(outside)

    return change


def _model_outside(path: pathlib.Path, scratch: pathlib.Path) -> None:
    (scratch / "forward.onnx").write_bytes((path / "forward.onnx").read_bytes())
    _edit_signature(lambda s: s["forward"].update(model="../forward.onnx"))(path, scratch)


def _no_optimizer(path: pathlib.Path, scratch: pathlib.Path) -> None:
    # An artifact exported without an optimizer can be read back (aot2onnx.load) but not trained on a device.
    sig = json.loads((path / "signature.json").read_text())
    sig["optimizer"] = None
    sig["state"] = [s for s in sig["state"] if s["kind"] != "optimizer_state"]
    (path / "signature.json").write_text(json.dumps(sig))
    (path / "optimizer.onnx").unlink()
    for model_file in ("forward.onnx", "backward.onnx"):
        model = onnx.load(str(path / model_file))
        next(p for p in model.metadata_props if p.key == "aot2onnx.signature").value = json.dumps(sig, sort_keys=True)
        (path / model_file).write_bytes(model.SerializeToString())


REFUSALS: dict[str, Refusal] = {
    **{f"missing {file}": Refusal(_unlink(file), f"{file}.* is missing")
       for file in ("signature.json", "forward.onnx", "backward.onnx", "optimizer.onnx", "state.safetensors")},
    "unknown format": Refusal(_edit_signature(lambda s: s.update(format="aot2onnx.training/99")),
                              "unknown format 'aot2onnx.training/99'"),
    "signature not JSON": Refusal(_write("signature.json", b"{not json"), "signature.json is not valid JSON"),
    "input name": Refusal(_edit_signature(lambda s: _entry(s, "forward", "inputs", "x").update(name="features")),
                          r"forward.onnx: the signature lists input 'features' .* which the model does not have"),
    "output name": Refusal(
        _edit_signature(lambda s: _entry(s, "backward", "outputs", "grad:model.0.bias").update(name="grad:bias")),
        r"backward.onnx: the signature lists output 'grad:bias'"),
    "missing input": Refusal(_edit_signature(lambda s: s["forward"]["inputs"].remove(_entry(s, "forward", "inputs", "y"))),
                             r"forward.onnx: the model has input 'y', which the signature does not list"),
    "dtype": Refusal(_edit_signature(lambda s: _entry(s, "forward", "inputs", "model.0.weight").update(dtype="float64")),
                     r"forward.onnx: input 'model.0.weight' is float32 in the model but float64 in the signature|"
                     # the Python readers' validator finds the signature against the state first
                     r"forward.inputs 'model.0.weight' \(parameter\) is float64\[64, 32\], but its source "
                     r"'model.0.weight' is float32\[64, 32\]"),
    "rank": Refusal(_edit_signature(lambda s: _entry(s, "forward", "inputs", "x").update(shape=["batch", 32, 1])),
                    r"forward.onnx: input 'x' has rank 2 in the model but 3 in the signature|"
                    r"forward.inputs 'x' \(user_input\) is float32\['batch', 32, 1\], but its source 0 is "
                    r"float32\['batch', 32\]"),
    "static size": Refusal(_edit_signature(lambda s: _entry(s, "forward", "inputs", "x").update(shape=["batch", 31])),
                           r"forward.onnx: input 'x' has shape \['batch', 32\] in the model but \['batch', 31\]|"
                           r"forward.inputs 'x' \(user_input\) is float32\['batch', 31\], but its source 0 is "
                           r"float32\['batch', 32\]"),
    "output dtype": Refusal(_edit_signature(lambda s: _entry(s, "forward", "outputs", "loss").update(dtype="float16")),
                            r"output 'loss' is float32 in the model but float16 in the signature|"
                            r"backward.inputs 'grad:loss' \(grad_of_loss\) is float32\[\], but the loss is float16\[\]"),
    "dangling source": Refusal(
        _edit_signature(lambda s: _entry(s, "forward", "inputs", "model.0.weight").update(source="model.9.weight")),
        r"has source 'model.9.weight', which names no parameter"),
    "unknown role": Refusal(_edit_signature(lambda s: _entry(s, "forward", "inputs", "x").update(role="label")),
                            r"has role 'label'"),
    "two losses": Refusal(_edit_signature(lambda s: s["forward"]["outputs"].append(
        {"name": "loss2", "role": "loss", "dtype": "float32", "shape": []})),
        r"exactly one loss output, the signature lists 2"),
    "state listed twice": Refusal(_edit_signature(lambda s: s["state"].append(dict(s["state"][0]))),
                                  r"state '[^']+' is listed twice"),
    "models from another export": Refusal(_other_export, "carries a different signature"),
    "state missing a tensor": Refusal(_edit_state(lambda s: s.pop("model.2.bias")),
                                      r"state.safetensors has no tensor 'model.2.bias' \(parameter"),
    "state tensor of wrong shape": Refusal(
        _edit_state(lambda s: s.update({"model.0.weight": np.ascontiguousarray(s["model.0.weight"].T)})),
        r"tensor 'model.0.weight' is float32\[32, 64\], the signature says float32\[64, 32\]"),
    "corrupt state file": Refusal(_write("state.safetensors", b"\xff" * 64), "is not a readable safetensors file"),
    **{f"external data {where}": Refusal(_external_initializer("backward.onnx", where),
                                         "external data of tensor 'stolen'.*outside the artifact directory",
                                         over_http=where != "symlink")
       for where in ("parent", "absolute", "nested_parent", "symlink")},
    "missing external data": Refusal(_external_initializer("forward.onnx", "missing"),
                                     "external data of tensor 'stolen' is in 'weights.bin', which is missing"),
    **{f"external data in a function ({where})": Refusal(_external_in_function(where),
                                                         "external data of tensor 'stolen'.*outside the artifact directory")
       for where in ("node attribute", "subgraph", "attribute default")},
    "model path outside": Refusal(_model_outside, "forward.model is '../forward.onnx', which points outside"),
    "model not ONNX": Refusal(_write("forward.onnx", b"\x07\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"), "forward.onnx"),
    **{f"symlink to {file} outside": Refusal(
        _symlink_outside(file),
        f"the {what} file is '{file}', which resolves to .*elsewhere.*, outside the artifact directory", over_http=False)
       for file, what in (("signature.json", "signature"), ("state.safetensors", "state"))},
    "no optimizer": Refusal(_no_optimizer, "was exported without an optimizer"),
}


def _symlinks_inside(path: pathlib.Path, scratch: pathlib.Path) -> None:
    (path / "store").mkdir()
    for file in ("signature.json", "state.safetensors"):
        (path / file).rename(path / "store" / file)
        (path / file).symlink_to(pathlib.Path("store") / file)


# Changes a reader must accept: symbolic links that stay inside the artifact are followed.
ACCEPTED: dict[str, Callable[[pathlib.Path, pathlib.Path], None]] = {
    "symlinks inside the artifact": _symlinks_inside,
}


def prepare(base: pathlib.Path, root: pathlib.Path, change: Callable[[pathlib.Path, pathlib.Path], None]) -> pathlib.Path:
    """A copy of ``base`` under ``root``/artifact with ``change`` applied (``root``/scratch for files outside)."""
    path, scratch = root / "artifact", root / "scratch"
    shutil.copytree(base, path)
    scratch.mkdir()
    change(path, scratch)
    return path
