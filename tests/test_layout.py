"""The package's layout: data flows capture -> lower -> runtime, with compile/, artifact/ and tools/ on top.

Read from the source (every import statement, those inside functions too), so a backwards import fails here
whether or not a test happens to run it.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import aot2onnx
from aot2onnx.capture.aot import partition_function
from aot2onnx.options import PARTITIONERS

PACKAGE = pathlib.Path(aot2onnx.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: pathlib.Path) -> tuple[set[str], set[str]]:
    """(imports at module level, imports anywhere) of one file, as module names. ``from package import
    submodule`` is an edge to the submodule: the package is being initialised already when it imports its own
    submodules that way."""
    tree = ast.parse(path.read_text())
    top, anywhere = set(), set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            submodules = [f"{node.module}.{a.name}" for a in node.names]
            names = [n for n in submodules if n in MODULES] or [node.module]
        anywhere.update(names)
        if node in tree.body:
            top.update(names)
    return top, anywhere


IMPORTS = {name: _imports(path) for name, path in MODULES.items()}


def _internal(names: set[str]) -> set[str]:
    return {n for n in names if n in MODULES}


def _stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else None


# stage -> the stages it must never import (STYLE.md, "The shape of the package")
FORBIDDEN = {
    "capture": {"lower", "runtime", "compile", "artifact", "tools"},
    "lower": {"runtime", "compile", "artifact", "tools"},
    "runtime": {"capture", "lower", "compile", "artifact", "tools"},
    "compile": {"artifact", "tools"},
    "artifact": {"compile", "tools"},
}


@pytest.mark.parametrize("stage", sorted(FORBIDDEN))
def test_no_stage_imports_backwards(stage: str) -> None:
    wrong = []
    for module, (_, anywhere) in sorted(IMPORTS.items()):
        if _stage(module) != stage:
            continue
        for imported in sorted(_internal(anywhere)):
            if _stage(imported) in FORBIDDEN[stage]:
                wrong.append(f"{module} imports {imported}")
    assert not wrong, "\n".join(wrong)


def test_capture_does_not_import_onnx() -> None:
    wrong = [f"{m} imports {i}" for m, (_, anywhere) in IMPORTS.items() if _stage(m) == "capture"
             for i in anywhere if i.split(".")[0] in ("onnx", "onnx_ir", "onnxscript", "onnxruntime")]
    assert not wrong, wrong


def test_no_import_cycle_at_module_level() -> None:
    graph = {m: {i for i in _internal(top) if i != m} for m, (top, _) in IMPORTS.items()}
    # The package's __init__ re-exports the API: a submodule importing ``aot2onnx.x`` goes through it, but that
    # edge is Python's, not the layout's.
    graph["aot2onnx"] = set()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for nxt in sorted(graph[module]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_the_layout_has_its_rooms() -> None:
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert {"capture", "lower", "runtime", "compile", "artifact", "tools"} <= rooms
    root_files = sorted(p.name for p in PACKAGE.glob("*.py"))
    # the root holds the package's API and the small types every stage shares; parity.py is the API of a tool
    # (aot2onnx.parity.compare), which lives in tools/parity/
    assert root_files == ["__init__.py", "__main__.py", "_version.py", "authentication.py", "errors.py",
                          "options.py", "parity.py", "signature.py", "testing.py"], root_files


def test_every_partitioner_name_has_a_function() -> None:
    assert all(callable(partition_function(name)) for name in PARTITIONERS)
