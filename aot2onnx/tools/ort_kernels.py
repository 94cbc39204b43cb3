"""``python -m aot2onnx ort-kernels``: writes ``opset_tables/ort_cuda_kernels.json``, the kernels of ONNX Runtime's
CUDA execution provider, from ONNX Runtime's ``docs/OperatorKernels.md``.

That file is generated in ONNX Runtime's repository from the kernels each execution provider registers: per
provider and domain, one row per op with its formal inputs (and the type constraint each is bound to), then
one row per kernel with the opset versions it covers and the element types each of its type constraints
allows. A node for which the CUDA provider has no kernel runs on the CPU provider, with copies of its inputs
to the host and of its outputs back (``aot2onnx.runtime.host_copies`` reads the table to find such nodes).

The markdown is not part of this repository: give its path, and where it came from (repository, commit),
which the table records. The table holds only op names, versions and element types.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from aot2onnx.runtime.host_copies import CUDA_KERNELS_PATH

__all__ = ["TABLE_PATH", "main", "parse_operator_kernels", "render_table"]

TABLE_PATH = CUDA_KERNELS_PATH
_PROVIDER = "CUDAExecutionProvider"

_SECTION = re.compile(r"^## Operators implemented by (\w+)\s*$")
_DOMAIN = re.compile(r"^\|\*\*Operator Domain:\*\* \*([\w.]+)\*")
_PARAMETER = re.compile(r"\*(in|out)\* [^:]*:\*\*([^*]+)\*\*")
_CONSTRAINT = re.compile(r"\*\*([^*]+)\*\* = (.*)")


def _versions(cell: str) -> list[int | None]:
    """``13+`` -> [13, None]; ``[6, 12]`` -> [6, 12]; ``13`` -> [13, 13]."""
    cell = cell.strip()
    if cell.endswith("+"):
        return [int(cell[:-1]), None]
    if cell.startswith("["):
        first, last = cell.strip("[]").split(",")
        return [int(first), int(last)]
    return [int(cell), int(cell)]


def _element_type(text: str) -> str:
    """``tensor(float)`` -> ``float``; sequences and optionals stay as written."""
    text = text.strip()
    match = re.fullmatch(r"tensor\((\w+)\)", text)
    return match.group(1) if match else text


def _split_types(text: str) -> list[str]:
    """``tensor(float), map(int64,tensor(float))`` -> its two types: commas inside parentheses do not split."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _types(cell: str) -> dict[str, list[str]]:
    types: dict[str, list[str]] = {}
    for part in cell.split("<br/>"):
        match = _CONSTRAINT.match(part.strip())
        if match:
            name = match.group(1)
            assert name not in types, f"constraint {name} twice in {cell!r}"
            types[name] = [_element_type(t) for t in _split_types(match.group(2))]
    return types


def _parameters(cell: str, kind: str) -> list[str | None]:
    """The type constraint (or fixed type) of each formal input (``kind`` "in") or output ("out"), by position;
    ``None`` where the op's signatures (``or``) disagree at a position."""
    signatures = [[c for k, c in _PARAMETER.findall(s) if k == kind] for s in cell.split("<br><br>or<br><br>")]
    length = max(map(len, signatures), default=0)
    found: list[str | None] = []
    for i in range(length):
        names = {s[i] if i < len(s) else None for s in signatures}
        found.append(names.pop() if len(names) == 1 else None)
    return found


def parse_operator_kernels(text: str, provider: str = _PROVIDER) -> dict[str, dict[str, dict]]:
    """domain -> op type -> ``{"inputs": [constraint per input], "outputs": [constraint per output], "kernels":
    [{"versions": [first, last or None], "types": {constraint: [element type]}}]}`` for ``provider``'s section
    of OperatorKernels.md. A constraint a kernel lists no types for is one it does not check."""
    table: dict[str, dict[str, dict]] = {}
    section = domain = op = None
    for line in text.splitlines():
        if match := _SECTION.match(line):
            section, domain, op = match.group(1), None, None
            continue
        if section != provider or not line.startswith("|"):
            continue
        if match := _DOMAIN.match(line):
            domain = match.group(1)
            table.setdefault(domain, {})
            continue
        cells = line.strip()[1:-1].split("|")
        if len(cells) != 4 or domain is None or not cells[2].strip() or cells[2].strip().startswith("-"):
            continue
        name, parameters, versions, types = cells
        if name == "Op Name":
            continue
        if name:
            op = name
            assert op not in table[domain], f"{domain} {op} listed twice"
            table[domain][op] = {"inputs": _parameters(parameters, "in"), "outputs": _parameters(parameters, "out"),
                                 "kernels": []}
        assert op is not None, line
        table[domain][op]["kernels"].append({"versions": _versions(versions), "types": _types(types)})
    return table


def render_table(table: dict[str, dict[str, dict]], source: dict[str, str],
                 cpu_ops: dict[str, list[str]]) -> str:
    """The JSON text of the table: the CUDA provider's kernels one op a line, so that a new ONNX Runtime's
    changes read as a diff, and the names of the ops the CPU provider has kernels for, per domain (a node no
    provider has a kernel for is replaced by its ONNX function's body, where its op has one)."""
    lines = ["{", f' "provider": {json.dumps(_PROVIDER)},', f' "source": {json.dumps(source, sort_keys=True)},',
             ' "domains": {']
    for d, (domain, ops) in enumerate(sorted(table.items())):
        lines.append(f"  {json.dumps(domain)}: {{")
        for o, (op, entry) in enumerate(sorted(ops.items())):
            comma = "," if o < len(ops) - 1 else ""
            lines.append(f"   {json.dumps(op)}: {json.dumps(entry, separators=(',', ':'))}{comma}")
        lines.append("  }" + ("," if d < len(table) - 1 else ""))
    lines += [" },", ' "cpu_ops": {']
    for d, (domain, ops) in enumerate(sorted(cpu_ops.items())):
        lines.append(f"  {json.dumps(domain)}: {json.dumps(sorted(ops))}" + ("," if d < len(cpu_ops) - 1 else ""))
    lines += [" }", "}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aot2onnx ort-kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("markdown", type=Path, help="a copy of ONNX Runtime's docs/OperatorKernels.md")
    parser.add_argument("--repository", required=True, help="where it came from, e.g. github:microsoft/onnxruntime")
    parser.add_argument("--commit", required=True, help="the commit it was read at")
    parser.add_argument("--note", default="", help="what else to record: the ONNX Runtime version, the date")
    parser.add_argument("--out", type=Path, default=TABLE_PATH)
    args = parser.parse_args(argv)
    text = args.markdown.read_text()
    table = parse_operator_kernels(text)
    cpu_ops = {domain: sorted(ops) for domain, ops in parse_operator_kernels(text, "CPUExecutionProvider").items()}
    if not table or not cpu_ops:
        parser.error(f"{args.markdown} lacks the {_PROVIDER} or CPUExecutionProvider section")
    source = {"file": "docs/OperatorKernels.md", "repository": args.repository, "commit": args.commit}
    if args.note:
        source["note"] = args.note
    args.out.write_text(render_table(table, source, cpu_ops))
    print(f"wrote {args.out}: {sum(map(len, table.values()))} ops in {len(table)} domains")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
