"""Every private name of onnxscript that aot2onnx uses.

Lowering folds constants with onnxscript's ``FoldConstantsPass``, which takes a ``should_fold`` predicate
(aot2onnx folds only what folds exactly, lower/translate.py); the public ``onnxscript.optimizer.fold_constants``
does not take one. The pass and its default limits live in the private ``onnxscript.optimizer._constant_folding``,
and the compile cache recognises onnxscript's function and opset objects by their classes, defined in the private
``onnxscript._internal.values`` (re-exported by ``onnxscript.values``). An onnxscript release may move any of
them. They are read here and nowhere else, so a move fails here, at import, naming the symbol
(``tests/test_onnxscript_compat.py`` checks each one), instead of somewhere in a lowering.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

__all__ = [
    "DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT",
    "DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT",
    "FoldConstantsPass",
    "SYMBOLS",
    "VALUES_MODULES",
    "loaded_values_module",
]

# Our name -> (onnxscript's module, the symbol in it).
SYMBOLS: dict[str, tuple[str, str]] = {
    "FoldConstantsPass": ("onnxscript.optimizer._constant_folding", "FoldConstantsPass"),
    "DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT": (
        "onnxscript.optimizer._constant_folding", "DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT"),
    "DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT": (
        "onnxscript.optimizer._constant_folding", "DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT"),
}
# Where onnxscript defines Opset, OnnxFunction and TracedOnnxFunction: the private module first, then the
# public one that re-exports them.
VALUES_MODULES = ("onnxscript._internal.values", "onnxscript.values")
VALUES_CLASSES = ("Opset", "OnnxFunction", "TracedOnnxFunction")


def _resolve(name: str) -> Any:
    module_name, symbol = SYMBOLS[name]
    try:
        return getattr(importlib.import_module(module_name), symbol)
    except (ImportError, AttributeError) as e:
        import onnxscript

        raise ImportError(
            f"aot2onnx needs {module_name}.{symbol} (private to onnxscript), which onnxscript "
            f"{onnxscript.__version__} lacks: use the onnxscript release aot2onnx's lock names, or report it"
        ) from e


FoldConstantsPass = _resolve("FoldConstantsPass")
DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT: int = _resolve("DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT")
DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT: int = _resolve("DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT")


def loaded_values_module() -> ModuleType | None:
    """The module holding onnxscript's ``Opset``, ``OnnxFunction`` and ``TracedOnnxFunction``, if onnxscript is
    imported already (None otherwise: a value can only be one of them if it is)."""
    return next((m for name in VALUES_MODULES if (m := sys.modules.get(name)) is not None), None)
