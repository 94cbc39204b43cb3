"""The dependency lock: ``requirements.lock`` pins every package ``make demo`` and ``make test`` install.

    python scripts/lock.py names            # the project's requirements by name, without versions
    python scripts/lock.py freeze VENV_PY   # the lock from what is installed in VENV_PY's environment
    VENV_PY scripts/lock.py torch-version   # the torch installed there, without its build label

``make check-latest`` installs the newest torch and ``names`` (the newest releases) into a throwaway
environment and runs the default suite there; ``make lock`` then writes that environment's ``freeze`` to
``requirements.lock``, torch included, which is where the Makefile reads the torch it installs first.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import subprocess
import sys

import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXTRAS = ("test",)
# What PyPI's Linux torch wheel brings for CUDA: left out of the lock, which the CPU build installs too.
CUDA_PREFIXES = ("nvidia-", "cuda-", "triton")


def names() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in EXTRAS:
        requirements += project["optional-dependencies"][extra]
    found = [re.match(r"[A-Za-z0-9_.\-]+", r).group(0) for r in requirements]
    return sorted({n for n in found if n.lower() != "torch"}, key=str.lower)


def freeze(python: str) -> str:
    listing = subprocess.run(
        [python, "-m", "pip", "freeze", "--exclude-editable", "--all"], check=True, capture_output=True, text=True
    ).stdout
    lines = []
    for line in listing.splitlines():
        name = line.split("==", 1)[0]
        if name.lower() in ("pip", "setuptools", "wheel", "aot2onnx") or name.lower().startswith(CUDA_PREFIXES):
            continue
        if name.lower() == "torch":
            line = line.split("+", 1)[0]  # a build's local label (+cpu, +cu130) is not on PyPI
        lines.append(line)
    header = (
        "# Every package `make demo` and `make test` install, at the versions the suite last passed on.\n"
        "# Written by `make lock` (scripts/lock.py) after `make check-latest` passed; do not edit by hand.\n"
    )
    return header + "\n".join(sorted(lines, key=str.lower)) + "\n"


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "names":
        print(" ".join(names()))
    elif command == "freeze" and len(sys.argv) == 3:
        sys.stdout.write(freeze(sys.argv[2]))
    elif command == "torch-version":
        print(importlib.metadata.version("torch").split("+", 1)[0])
    else:
        sys.exit(__doc__)
