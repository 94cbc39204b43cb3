"""Every private symbol of torch's ONNX exporter that aot2onnx uses is where it expects it: after a torch
upgrade, this test names what moved."""

from __future__ import annotations

import importlib

import pytest

from aot2onnx.lower import _exporter_compat


@pytest.mark.parametrize("name", sorted(_exporter_compat.SYMBOLS))
def test_exporter_symbol_is_where_aot2onnx_reads_it(name):
    module, symbol = _exporter_compat.SYMBOLS[name]
    found = getattr(importlib.import_module(f"torch.onnx._internal.exporter.{module}"), symbol, None)
    assert found is not None, f"torch.onnx._internal.exporter.{module}.{symbol} moved"


def test_no_other_module_imports_the_exporter_privately():
    import pathlib

    root = pathlib.Path(_exporter_compat.__file__).parents[1]
    offenders = [
        str(path.relative_to(root)) for path in root.rglob("*.py")
        if path.name != "_exporter_compat.py" and "torch.onnx._internal" in path.read_text()
    ]
    assert offenders == []


def test_the_recorder_method_aot2onnx_overrides_is_there():
    # Recorder (float64 scalars kept exact) overrides the exporter's OpRecorder._call_op by its signature.
    import inspect

    method = getattr(_exporter_compat.OpRecorder, "_call_op", None)
    assert method is not None, "OpRecorder._call_op moved"
    assert list(inspect.signature(method).parameters) == [
        "self", "op_signature", "named_inputs", "named_attrs", "num_outputs"
    ]
