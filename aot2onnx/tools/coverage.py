"""``python -m aot2onnx coverage``: regenerates ``opset_tables/`` from the OpInfo sweep.

The sweep is ``tests/test_opinfo.py``: in its default selection, the first float32 sample of every OpInfo
in PyTorch's ``op_db``, compiled through aot2onnx at each target opset and compared with eager (outputs
and gradients). Each sample leaves a :class:`SampleRecord`: its outcomes and the ATen overloads of its
forward and backward graphs. :func:`render_tables` turns the records into one markdown table per target
opset; it is a pure function of the records, so the tables are deterministic.

This command runs that sweep with pytest, with :data:`REGENERATE_ENV` set, so that the sweep's last test
(``test_opset_tables``) writes the tables instead of comparing them with the checked-in files. The
default ``make test`` run does the comparison: a checked-in table that differs from what the sweep
generates fails it. Running the sweep needs a source checkout and the test extra (pytest, expecttest).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from aot2onnx.options import BASE_OPSET

__all__ = [
    "REGENERATE_ENV",
    "TABLES_DIR",
    "SampleRecord",
    "core_aten_ops",
    "main",
    "opinfo_name",
    "render_tables",
    "target_opsets",
    "write_tables",
]

REGENERATE_ENV = "AOT2ONNX_REGENERATE_OPSET_TABLES"
_REPO = Path(__file__).resolve().parents[2]
TABLES_DIR = _REPO / "opset_tables"
_SWEEP = _REPO / "tests" / "test_opinfo.py"

# Outcomes of a sample that leave the OpInfo out of the counts: there is nothing to compare with.
_NOT_TESTED = ("no-sample", "no-eager")


@dataclasses.dataclass(frozen=True)
class SampleRecord:
    """What one sample of the sweep did at one opset.

    ``fwd`` and ``bwd`` are outcomes: ``pass``, ``mismatch`` (a wrong answer), ``eager`` (nothing reached
    aot2onnx), a crash stage (``dynamo``, ``capture``, ``unsupported``, ``lowering``, ``ort``, ``error``),
    and for ``bwd`` also ``n/a`` (no gradient checked) and ``blocked`` (the forward failed).
    ``fwd_ops``/``bwd_ops`` map each ATen overload of the forward (and inference) / backward graphs to the
    dtypes of its inputs.
    """

    opinfo: str
    opset: int
    fwd: str
    bwd: str
    detail: str
    fwd_ops: Mapping[str, tuple[str, ...]]
    bwd_ops: Mapping[str, tuple[str, ...]]
    no_compute: tuple[str, ...] = ()  # "fwd"/"bwd": that graph had nothing to compute, so no session ran
    values_compared: bool = True  # False: random or uninitialized outputs, compared by shape and dtype only
    reason: str = ""  # why the sweep expects the failure it saw (the OpInfo's xfail), where it failed


def opinfo_name(name: str, variant: str = "") -> str:
    """An OpInfo's name in the sweep and the tables: ``nn.functional.pad.replicate`` for a variant."""
    return f"{name}.{variant}" if variant else name


@functools.cache
def target_opsets() -> tuple[int, ...]:
    """The opsets the tables cover: 18 (what aot2onnx lowers at) and the newest the installed ONNX Runtime
    runs (probed per op, see ``aot2onnx.runtime.kernels``)."""
    from aot2onnx.runtime.kernels import newest_runnable_opset

    return tuple(sorted({BASE_OPSET, newest_runnable_opset()}))


@functools.cache
def core_aten_ops() -> tuple[str, ...]:
    """Every ATen overload tagged ``torch.Tag.core``."""
    import torch

    from aot2onnx.capture._torch_compat import jit_get_all_schemas

    names = set()
    for schema in jit_get_all_schemas():
        if not schema.name.startswith("aten::"):
            continue
        packet = getattr(torch.ops.aten, schema.name.removeprefix("aten::"))
        overload = getattr(packet, schema.overload_name or "default")
        if torch.Tag.core in overload.tags:
            names.add(str(overload))
    return tuple(sorted(names))


def _overload(name: str):
    import torch

    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def _lowering_origins(names: Iterable[str], opset: int) -> dict[str, str]:
    """Where each overload's lowering at ``opset`` comes from: a rule's origin, decomposition, or none."""
    from aot2onnx.lower.plan import build_opset, decompositions
    from aot2onnx.lower.registry import default_registry

    registry = default_registry()
    decomposed = {str(op) for op in decompositions(registry, opset)}
    opset = build_opset(opset)  # where rules are chosen for a model targeting opset
    origins = {}
    for name in names:
        target = _overload(name)
        real, _ = registry.lookup(target, opset)
        complex_, _ = registry.lookup(target, opset, is_complex=True)
        if real is not None:
            origins[name] = real.origin + (" (+complex)" if complex_ is not None else "")
        elif complex_ is not None:
            origins[name] = f"{complex_.origin} (complex only)"
        else:
            origins[name] = "decomposition" if name in decomposed else "none"
    return origins


def _ratio(passed: int, total: int) -> str:
    return f"{passed}/{total}" if total else "-"


def _percent(passed: int, total: int) -> str:
    return f"{100.0 * passed / total:.1f}%" if total else "-"


def _opinfo_outcomes(records: Sequence[SampleRecord]) -> dict[str, tuple[str, str, str]]:
    """OpInfo -> (fwd, bwd, note): the first failure of its samples, or pass, and what to note about it."""
    by_opinfo: dict[str, list[SampleRecord]] = collections.defaultdict(list)
    for r in records:
        by_opinfo[r.opinfo].append(r)
    outcomes = {}
    for name, rs in by_opinfo.items():
        fwd = next((r for r in rs if r.fwd != "pass"), rs[0])
        bwd = next((r for r in rs if r.bwd not in ("pass", "n/a")), rs[0])
        if fwd.fwd != "pass" or bwd.bwd not in ("pass", "n/a"):
            failed = fwd if fwd.fwd != "pass" else bwd
            detail = failed.detail
            note = failed.reason or (detail if detail.startswith("no lowering:") else "")
        else:
            note = "" if all(r.values_compared for r in rs) else "shapes and dtypes only (random or uninitialized values)"
        outcomes[name] = (fwd.fwd, bwd.bwd, note)
    return outcomes


def render_table(records: Sequence[SampleRecord], opset: int) -> str:
    """The markdown coverage table for one opset, from that opset's records."""
    records = sorted((r for r in records if r.opset == opset), key=lambda r: r.opinfo)
    opinfos = _opinfo_outcomes(records)
    counted = {n: o for n, o in opinfos.items() if o[0] not in _NOT_TESTED}
    fwd_pass = sum(o[0] == "pass" for o in counted.values())
    shapes_only = sorted({r.opinfo for r in records if not r.values_compared and opinfos[r.opinfo][0] == "pass"})
    autograd = {n: o for n, o in counted.items() if o[1] != "n/a"}
    bwd_pass = sum(o[1] == "pass" for o in autograd.values())
    left_out = sorted(n for n, o in opinfos.items() if o[0] in _NOT_TESTED)

    seen = collections.defaultdict(lambda: {"fwd": [0, 0], "bwd": [0, 0], "dtypes": set()})
    for r in records:
        if r.fwd in _NOT_TESTED:
            continue
        for kind, ops, outcome in (("fwd", r.fwd_ops, r.fwd), ("bwd", r.bwd_ops, r.bwd)):
            for op, dtypes in ops.items():
                seen[op][kind][0] += outcome == "pass"
                seen[op][kind][1] += 1
                seen[op]["dtypes"].update(dtypes)
    core = set(core_aten_ops())
    names = sorted(set(seen) | core)
    origins = _lowering_origins(names, opset)
    origin_counts = collections.Counter(origin.split(" ")[0] for origin in origins.values())

    lines = [
        f"# ATen operator coverage at ONNX opset {opset}",
        "",
        "Generated by `python -m aot2onnx coverage` from the OpInfo sweep (`tests/test_opinfo.py`: the first "
        "float32 sample of every OpInfo, compiled through aot2onnx with `fallback=False` and compared with "
        "eager, outputs and gradients). Do not edit; `make test` fails when this file differs from what the "
        "sweep generates.",
        "",
        f"**Summary.** OpInfo entries with float32 samples: {len(counted)}"
        + (f" ({len(left_out)} more do not run eagerly on CPU and are not counted)" if left_out else "")
        + f". Forward passes: {fwd_pass} ({_percent(fwd_pass, len(counted))}"
        + (f"; {len(shapes_only)} of them compare shapes and dtypes only, their values being random or "
           "uninitialized" if shapes_only else "")
        + "). "
        f"Supporting autograd: {len(autograd)}; backward passes: {bwd_pass} ({_percent(bwd_pass, len(autograd))}). "
        f"ATen overloads: {len(names)} ({len(seen)} seen in the sweep's graphs, {len(core)} core ATen ops); "
        f"lowering: " + ", ".join(f"{origin_counts[o]} {o}" for o in sorted(origin_counts)) + ".",
        "",
        "## ATen overloads",
        "",
        "One row per overload that appears in the sweep's forward or backward graphs, and per core ATen op. "
        "*lowering*: where the lowering at this opset comes from (`aot2onnx` rule, `torch_lib` rule, "
        "`decomposition` into other ops before lowering, or `none`; a rule for complex inputs is noted). *forward*/*backward*: of the sweep's "
        "samples whose forward/backward graph holds the op, how many passed (`-`: no graph held it). "
        "*dtypes*: of its inputs in those graphs.",
        "",
        "| ATen overload | core | lowering | forward | backward | dtypes |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        s = seen.get(name)
        fwd = _ratio(*s["fwd"]) if s else "-"
        bwd = _ratio(*s["bwd"]) if s else "-"
        dtypes = ", ".join(sorted(s["dtypes"])) if s else ""
        lines.append(f"| `{name}` | {'core' if name in core else ''} | {origins[name]} | {fwd} | {bwd} | {dtypes} |")
    lines += [
        "",
        "## OpInfo entries",
        "",
        "*forward*/*backward*: `pass`, `mismatch` (a wrong answer), or the stage that crashed: `dynamo` "
        "(Dynamo cannot trace it), `capture` (AOTAutograd), `unsupported` (an op without lowering), "
        "`lowering` (a rule failed), `ort` (ONNX Runtime), `error`; `eager`: nothing reached aot2onnx; "
        "backward `n/a`: no gradient checked, `blocked`: the forward failed. *note*: for a miss, why it is expected "
        "(the sweep's expectation for it, `tests/opinfo_expectations.py`).",
        "",
        "| OpInfo | forward | backward | note |",
        "|---|---|---|---|",
    ]
    for name, (fwd, bwd, note) in sorted(opinfos.items()):
        lines.append(f"| `{name}` | {fwd} | {bwd} | {note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def render_tables(records: Sequence[SampleRecord], opsets: Sequence[int]) -> dict[Path, str]:
    """Path -> text of every table (``opset_tables/opset<N>.md``)."""
    return {TABLES_DIR / f"opset{opset}.md": render_table(records, opset) for opset in opsets}


def write_tables(tables: Mapping[Path, str]) -> None:
    for path, text in tables.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m aot2onnx coverage",
        description="Run the OpInfo sweep (tests/test_opinfo.py, default selection) and write opset_tables/.",
    )
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments, e.g. -x or -p no:randomly")
    args = parser.parse_args(argv)
    if not _SWEEP.exists():
        print(f"the sweep {_SWEEP} is missing: run this command from a source checkout", file=sys.stderr)
        return 2
    try:
        import expecttest  # noqa: F401  (torch's OpInfo database needs it)
        import pytest
    except ImportError as e:
        print(f"the sweep needs the test extra (pip install -e '.[test]'): {e}", file=sys.stderr)
        return 2
    start = time.time()
    os.environ[REGENERATE_ENV] = "1"
    try:
        code = pytest.main(
            [str(_SWEEP), "-q", "-p", "no:cacheprovider", "--rootdir", str(_REPO), "-c", str(_REPO / "pyproject.toml"),
             *args.pytest_args]
        )
    finally:
        del os.environ[REGENERATE_ENV]
    written = [p for p in sorted(TABLES_DIR.glob("opset*.md")) if p.stat().st_mtime >= start]
    if not written:
        print("no table was written: the sweep did not run completely", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path.relative_to(_REPO)}")
    if code != 0:
        print(f"the sweep reported failures (pytest exit code {int(code)}); the tables record what ran")
    return 0
