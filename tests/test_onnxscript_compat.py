"""Every private name of onnxscript that aot2onnx uses is where it expects it: after an onnxscript upgrade, this
test names what moved."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib

import pytest

from aot2onnx.lower import _onnxscript_compat as compat

PACKAGE = pathlib.Path(compat.__file__).parents[1]


@pytest.mark.parametrize("name", sorted(compat.SYMBOLS))
def test_onnxscript_symbol_is_where_aot2onnx_reads_it(name):
    module, symbol = compat.SYMBOLS[name]
    found = getattr(importlib.import_module(module), symbol, None)
    assert found is not None, f"{module}.{symbol} moved"
    assert getattr(compat, name) is found


def test_fold_constants_pass_takes_the_arguments_lowering_gives_it():
    parameters = inspect.signature(compat.FoldConstantsPass).parameters
    assert {"shape_inference", "input_size_limit", "output_size_limit", "should_fold"} <= set(parameters)


def test_values_classes_are_where_the_cache_reads_them():
    import onnxscript  # noqa: F401  (the cache reads the module only once onnxscript is imported)

    values = compat.loaded_values_module()
    assert values is not None and values.__name__ in compat.VALUES_MODULES
    for name in compat.VALUES_CLASSES:
        assert isinstance(getattr(values, name, None), type), f"{values.__name__}.{name} moved"


def _private_onnxscript_names(tree: ast.AST) -> list[str]:
    """onnxscript's ``_``-modules and ``_``-names that a module imports or names in a string."""
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("onnxscript."):
            names = [node.value]
        found += [n for n in names if n.split(".")[0] == "onnxscript"
                  and any(p.startswith("_") and not p.startswith("__") for p in n.split(".")[1:])]
    return found


def test_no_other_module_reaches_onnxscript_privates():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_onnxscript_compat.py":
            continue
        offenders += [f"{path.relative_to(PACKAGE)}: {n}" for n in _private_onnxscript_names(ast.parse(path.read_text()))]
    assert offenders == []
