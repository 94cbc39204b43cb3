"""Every private symbol of PyTorch's ONNX exporter (``torch.onnx._internal.exporter``) that aot2onnx uses.

aot2onnx lowers FX nodes the way the exporter does, with its argument conversion, op recorder and
provenance metadata, and builds torch_lib's registry through it. Those are private: a torch upgrade may
move them. They are imported here and nowhere else, so a move fails here, at import, naming the symbol
(``tests/test_exporter_compat.py`` checks each one), instead of somewhere in a lowering.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ONNXRegistry",
    "OpRecorder",
    "SYMBOLS",
    "SymbolicTensor",
    "TorchTensor",
    "add_opset_imports",
    "convert_fx_arg_to_onnx_arg",
    "core_logger_name",
    "insert_type_promotion_nodes_except",
    "registration_logger_name",
    "remove_assertion_nodes",
    "set_node_metadata",
    "set_shape_type",
]

_PACKAGE = "torch.onnx._internal.exporter"

# Our name -> (the exporter's module, the symbol in it).
SYMBOLS: dict[str, tuple[str, str]] = {
    "OpRecorder": ("_building", "OpRecorder"),
    "SymbolicTensor": ("_tensors", "SymbolicTensor"),
    "TorchTensor": ("_core", "TorchTensor"),
    "set_shape_type": ("_core", "_set_shape_type"),
    "convert_fx_arg_to_onnx_arg": ("_core", "_convert_fx_arg_to_onnx_arg"),
    "set_node_metadata": ("_core", "_set_node_metadata"),
    "core_logger": ("_core", "logger"),
    "fx_passes": ("_fx_passes", "passes"),
    "remove_assertion_nodes": ("_fx_passes", "remove_assertion_nodes"),
    "add_opset_imports": ("_ir_passes", "add_opset_imports"),
    "ONNXRegistry": ("_registration", "ONNXRegistry"),
}


def _resolve(name: str) -> Any:
    module_name, symbol = SYMBOLS[name]
    import torch

    try:
        return getattr(importlib.import_module(f"{_PACKAGE}.{module_name}"), symbol)
    except (ImportError, AttributeError) as e:
        raise ImportError(
            f"aot2onnx needs {_PACKAGE}.{module_name}.{symbol} (private API of PyTorch's ONNX exporter), which "
            f"torch {torch.__version__} does not have: {e}. aot2onnx supports the torch its pyproject.toml names."
        ) from e


OpRecorder = _resolve("OpRecorder")
SymbolicTensor = _resolve("SymbolicTensor")
TorchTensor = _resolve("TorchTensor")
set_shape_type = _resolve("set_shape_type")
convert_fx_arg_to_onnx_arg = _resolve("convert_fx_arg_to_onnx_arg")
set_node_metadata = _resolve("set_node_metadata")
core_logger_name: str = _resolve("core_logger").name
_fx_passes = _resolve("fx_passes")


def insert_type_promotion_nodes_except(graph_module: Any, ops: tuple[str, ...]) -> None:
    """The exporter's type promotion pass (its ``insert_type_promotion_nodes``) without its rules for ``ops``
    (packet names such as ``"aten.std"``), whose nodes it then leaves as they are."""
    table = _fx_passes.type_promotion.TypePromotionTable()
    for name in ops:
        table._rule_table.pop(name, None)
    for module in graph_module.modules():
        _fx_passes.InsertTypePromotion(module, table).run()
remove_assertion_nodes = _resolve("remove_assertion_nodes")
add_opset_imports = _resolve("add_opset_imports")
ONNXRegistry = _resolve("ONNXRegistry")
registration_logger_name: str = f"{_PACKAGE}._registration"
