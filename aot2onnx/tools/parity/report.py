"""The parity report: what was compared, what parted, and the pages ``save`` writes."""

from __future__ import annotations

import dataclasses
import html
import json
import math
import pathlib
import re
from collections.abc import Callable, Sequence
from typing import Any

from aot2onnx.tools.parity.errors import NOISE_FACTOR, SLACK_ULPS, ErrorStats
from aot2onnx.tools.parity.nodes import GraphParity, NodeParity
from aot2onnx.tools.parity.plot import error_plot

__all__ = ["ParityReport", "Parting", "TensorParity"]

# Which graphs first_divergence(kind) looks in: an inference graph is a forward graph without a backward.
_KINDS = {"forward": ("forward", "inference"), "backward": ("backward",), "inference": ("inference",),
          "optimizer": ("optimizer",)}
_TABLE_ROWS = 15  # node rows per graph in the Markdown page (the HTML page and the JSON have them all)


@dataclasses.dataclass
class TensorParity:
    """An output, a gradient, a buffer or a mutated input after the step: compiled against eager."""

    what: str  # loss, output, grad, input grad, buffer, mutated input, parameter, optimizer state
    name: str
    shape: list[int]
    dtype: str
    stats: ErrorStats
    step: int = 1  # the training step after which it was compared

    @property
    def ok(self) -> bool:
        return self.stats.ok

    def to_dict(self) -> dict[str, Any]:
        return {"what": self.what, "name": self.name, "step": self.step, "shape": self.shape, "dtype": self.dtype,
                "ok": self.ok, **self.stats.to_dict()}


def _g(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


@dataclasses.dataclass(frozen=True)
class Parting:
    """Where eager and compiled first part: the first step with a divergent node or a tensor beyond tolerance,
    the first graph of that step (in the order graphs ran) with a divergent node and that node, and the
    tensors beyond tolerance after that step."""

    step: int
    graph: GraphParity | None
    node: NodeParity | None
    tensors: list[TensorParity]

    def describe(self) -> str:
        if self.node is not None and self.graph is not None:
            text = (f"at step {self.step}, in the {self.graph.kind} graph {self.graph.name}: {self.node.target} "
                    f"(FX node {self.node.fx_name}) at {self.node.source}")
        else:
            text = f"at step {self.step}, with no node beyond tolerance on its own"
        if self.tensors:
            shown = ", ".join(f"{t.what} {t.name}" for t in self.tensors[:4])
            text += f"; {len(self.tensors)} tensor(s) beyond tolerance after it ({shown}"
            text += f" and {len(self.tensors) - 4} more)" if len(self.tensors) > 4 else ")"
        return text


@dataclasses.dataclass
class ParityReport:
    """What :func:`aot2onnx.parity.compare` found. ``ok``: every tensor within tolerance and no divergent node,
    at every step."""

    rtol: float
    atol: float
    tensors: list[TensorParity]
    graphs: list[GraphParity]
    notes: list[str]
    seconds: float = 0.0
    steps: int = 1
    # compare(..., keep_graphs=True): recompare(transform, only=None), transform(graph name, ONNX model) -> model:
    # the graphs of every step (only those with models of the names in ``only``) compared again with their models
    # so transformed (the tensors stay as they were).
    recompare: Callable[..., list[GraphParity]] | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.tensors) and not self.divergences

    @property
    def divergences(self) -> list[NodeParity]:
        """Every divergent node (own error beyond tolerance), graph by graph in the order they ran."""
        return [n for g in self.graphs for n in g.nodes if n.divergent]

    def first_divergence(self, kind: str = "forward") -> NodeParity | None:
        """The first node, in the order the ``kind`` graphs ran (``forward`` includes inference graphs; also
        ``optimizer``, for a compiled optimizer step) and in graph order within them, whose own error is beyond
        tolerance; None if there is none. Over several steps, the first step's first."""
        if kind not in _KINDS:
            raise ValueError(f"kind must be one of {sorted(_KINDS)}, got {kind!r}")
        found = [(g.step, g.order, n.index, n) for g in self.graphs if g.kind in _KINDS[kind] for n in g.nodes
                 if n.divergent]
        return min(found, key=lambda t: t[:3])[3] if found else None

    def first_parting(self) -> Parting | None:
        """Where the two sides first part (None where they never do): the step, the graph and its node."""
        steps = sorted({t.step for t in self.tensors if not t.ok} | {g.step for g in self.graphs if g.first_divergence})
        if not steps:
            return None
        step = steps[0]
        divergent = sorted((g for g in self.graphs if g.step == step and g.first_divergence), key=lambda g: g.order)
        graph = divergent[0] if divergent else None
        return Parting(step, graph, graph.first_divergence if graph else None,
                       [t for t in self.tensors if t.step == step and not t.ok])

    def graph(self, name: str, step: int = 1) -> GraphParity:
        return next(g for g in self.graphs if g.name == name and g.step == step)

    def _reproducer(self, node: NodeParity) -> Any:
        graph = next(g for g in self.graphs if any(n is node for n in g.nodes))
        return graph.reproducer if graph.first_divergence is node else None

    # ------------------------------------------------------------------------------------------ text

    def summary_line(self) -> str:
        beyond = [t for t in self.tensors if not t.ok]
        compared = sum(n.compared for g in self.graphs for n in g.nodes)
        not_compared = sum(not n.compared for g in self.graphs for n in g.nodes)
        over = f" over {self.steps} training steps" if self.steps > 1 else ""
        head = (f"parity {'ok' if self.ok else 'NOT ok'}{over}: {len(self.tensors) - len(beyond)} of {len(self.tensors)} "
                f"tensors within rtol={self.rtol:g}, atol={self.atol:g}; {compared} nodes in {len(self.graphs)} "
                "compiled graph(s) compared" + (f" ({not_compared} not compared: see their notes)" if not_compared else ""))
        if self.steps > 1 and (parting := self.first_parting()) is not None:
            return head + "; the two first part " + parting.describe()
        firsts = self._leads()
        if firsts:
            head += "; first divergent node: " + "; ".join(f"{k} {n.target} ({n.fx_name}) at {n.source}" for k, n in firsts)
        elif compared:
            head += ", none divergent"
        return head

    def summary(self) -> str:
        """Several lines: the summary, the tensors beyond tolerance, the first divergent nodes."""
        lines = [self.summary_line()]
        beyond = [t for t in self.tensors if not t.ok]
        if beyond:
            lines.append("tensors beyond tolerance:")
            lines += [f"  {f'step {t.step}: ' if self.steps > 1 else ''}{t.what} {t.name} {t.dtype}{t.shape}: " + (t.stats.mismatch or
                      f"worst element |diff| {t.stats.against_tolerance()} (its tolerance), "
                      f"{100 * t.stats.beyond:.3g}% of elements beyond") for t in beyond]
        for kind, node in self._leads():
            lines.append(f"first divergent node of the {kind} graphs: " + node.describe())
        if beyond and not self.divergences and any(g.nodes for g in self.graphs):
            tied = [n.fx_name for g in self.graphs for n in g.nodes if n.note.startswith("indices of tied")]
            lines.append(
                "no node is beyond tolerance on its own: the difference accumulated from differences within it "
                "(rounding)" + (f", or follows from tied values ordered differently ({', '.join(tied)})" if tied else "")
                + ", or comes from code outside the compiled graphs"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        first = {k: (n.to_dict() if (n := self.first_divergence(k)) else None) for k in self._kinds()}
        parting = self.first_parting()
        return {
            "ok": self.ok, "rtol": self.rtol, "atol": self.atol, "slack_ulps": SLACK_ULPS, "noise_factor": NOISE_FACTOR, "seconds": self.seconds,
            "summary": self.summary_line(), "tensors": [t.to_dict() for t in self.tensors],
            "first_divergence": first, "graphs": [g.to_dict() for g in self.graphs], "notes": self.notes,
            "steps": self.steps,
            "first_parting": None if parting is None else {
                "step": parting.step, "graph": parting.graph.name if parting.graph else None,
                "kind": parting.graph.kind if parting.graph else None,
                "node": parting.node.fx_name if parting.node else None,
                "tensors": [f"{t.what} {t.name}" for t in parting.tensors]},
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def __str__(self) -> str:
        return self.summary()

    # ------------------------------------------------------------------------------------------ pages

    def save(self, directory: str | pathlib.Path) -> pathlib.Path:
        """Writes ``report.md``, ``report.html`` (the plots inline), ``report.json``, one SVG plot per graph,
        and for the first divergent node of the forward and of the backward graphs (and of a compiled optimizer's)
        a reproducer in ``repro_forward/``, ``repro_backward/`` (``repro_optimizer/``) (``node.onnx``,
        ``inputs.npz``, ``expected.npz``, ``repro.py``). Returns the Markdown page's path."""
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        plots = {}
        for graph in self.graphs:
            if graph.nodes:
                path = directory / f"plot_{_slug(graph.name)}{f'_step{graph.step}' if self.steps > 1 else ''}.svg"
                path.write_text(error_plot(graph))
                plots[id(graph)] = path
        repros = {}
        for kind in self._kinds():
            node = self.first_divergence(kind)
            reproducer = self._reproducer(node) if node is not None else None
            if reproducer is not None:
                reproducer.write(directory / f"repro_{kind}")
                repros[kind] = directory / f"repro_{kind}"
        (directory / "report.json").write_text(self.to_json())
        (directory / "report.md").write_text(self._markdown(plots, repros))
        (directory / "report.html").write_text(self._html(plots, repros))
        return directory / "report.md"

    def _tolerance_text(self) -> str:
        return (f"A tensor element is beyond tolerance where |compiled - eager| > atol + rtol * |eager| "
                f"(rtol={self.rtol:g}, atol={self.atol:g}), or where NaN or an infinity is on one side only. A node's "
                f"own error (PyTorch's kernel and ONNX Runtime on the same input values) is beyond where it exceeds "
                f"rtol * |PyTorch| + slack, without atol (a node's values may be far smaller than the outputs'): the "
                f"slack is {SLACK_ULPS} float32 ulps of the node's largest output magnitude or, where an element is "
                f"small beside what it was computed from, {NOISE_FACTOR} times the rounding the node makes on these "
                "inputs (PyTorch's own error against float64, or the move of its result when its inputs move by one "
                "ulp).")

    def _tensor_rows(self) -> list[list[str]]:
        return [[*([str(t.step)] if self.steps > 1 else []), t.what, t.name, str(t.shape), t.dtype,
                 t.stats.against_tolerance(), f"{100 * t.stats.beyond:.3g}%", _g(t.stats.max_abs) if not t.stats.mismatch else "",
                 "ok" if t.ok else ("**" + (t.stats.mismatch or "beyond") + "**")] for t in self.tensors]

    def _tensor_header(self) -> list[str]:
        return [*(["step"] if self.steps > 1 else []), *self._TENSOR_HEADER]

    @staticmethod
    def _node_row(n: NodeParity) -> list[str]:
        if n.divergent:
            verdict = "**divergent**"
        elif not n.compared:
            verdict = n.note
        else:
            verdict = "ok" + (f" ({n.note})" if n.note else "")
        return [str(n.index), n.fx_name, n.target, str(n.shape),
                n.own.against_tolerance() if n.own else "", f"{100 * n.own.beyond:.3g}%" if n.own else "",
                _g(n.error.max_abs) if n.error and not n.error.mismatch else "", verdict, n.source]

    _NODE_HEADER = ["#", "FX node", "op", "shape", "own error: worst |diff| vs its tolerance", "own beyond",
                    "max |diff| vs eager", "", "source"]
    _TENSOR_HEADER = ["what", "name", "shape", "dtype", "worst |diff| vs its tolerance", "beyond", "max |diff|", ""]

    def verdict(self) -> str:
        """One sentence: ok or not, and how many tensors and nodes are beyond tolerance."""
        beyond = [t for t in self.tensors if not t.ok]
        divergent = self.divergences
        if self.ok:
            return (f"Parity ok{f' over {self.steps} training steps' if self.steps > 1 else ''}: all "
                    f"{len(self.tensors)} compared tensors (outputs, gradients, buffers) within tolerance, "
                    f"no divergent node among {sum(n.compared for g in self.graphs for n in g.nodes)} compared.")
        parts = []
        if beyond:
            parts.append(f"{len(beyond)} of {len(self.tensors)} compared tensors (outputs, gradients, buffers) beyond "
                         "tolerance")
        if divergent:
            parts.append(f"{len(divergent)} divergent node(s)")
        else:
            parts.append("no node beyond tolerance on its own")
        return "Parity NOT ok: " + ", ".join(parts) + "."

    def _leads(self) -> list[tuple[str, NodeParity]]:
        return [(k, n) for k in self._kinds() if (n := self.first_divergence(k)) is not None]

    def _kinds(self) -> tuple[str, ...]:
        """The kinds of graph the report speaks of: the optimizer's where one was compiled."""
        return ("forward", "backward", *(("optimizer",) if any(g.kind == "optimizer" for g in self.graphs) else ()))

    @staticmethod
    def _lead_line(kind: str, node: NodeParity) -> str:
        own = node.own.against_tolerance() if node.own else node.note
        share = f", {100 * node.own.beyond:.3g}% of its elements beyond" if node.own and not node.own.mismatch else ""
        return (f"first divergent node of the {kind} graphs: {node.target} (FX node {node.fx_name} of graph "
                f"{node.graph}), own error {own}{share}")

    def _markdown(self, plots: dict[int, pathlib.Path], repros: dict[str, pathlib.Path]) -> str:
        def table(header: list[str], rows: list[list[str]]) -> list[str]:
            clean = [[c.replace("|", "\\|").replace("\n", " ") for c in r] for r in [header, *rows]]
            header, rows = clean[0], clean[1:]
            return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]

        out = ["# Parity report: eager PyTorch against aot2onnx on ONNX Runtime", "", f"**{self.verdict()}**", ""]
        if self.steps > 1 and (parting := self.first_parting()) is not None:
            out += [f"**The two first part {parting.describe()}.**", ""]
        for kind, node in self._leads():
            out += [f"- **{self._lead_line(kind, node)}**", f"  at `{node.source}`"]
        if self._leads():
            out.append("")
        elif not self.ok:
            out += [self.summary().splitlines()[-1], ""]
        out += [self.summary_line(), "", self._tolerance_text(), "", "## Outputs, gradients, buffers", ""]
        out += table(self._tensor_header(), self._tensor_rows()) if self.tensors else ["(none compared)"]
        out += ["", "## First divergent nodes", ""]
        for kind in self._kinds():
            node = self.first_divergence(kind)
            out.append(f"### {kind}")
            out.append("")
            if node is None:
                out += ["None: no node's own error is beyond tolerance.", ""]
                continue
            out += ["```", node.describe(), "```", ""]
            if kind in repros:
                out += [f"Reproducer: `{repros[kind].name}/` (`python {repros[kind].name}/repro.py` prints the "
                        "difference between ONNX Runtime and PyTorch on the node's inputs).", ""]
        out += ["## Graphs", ""]
        for graph in self.graphs:
            out += [f"### {self._graph_title(graph)}", "", self._graph_line(graph), ""]
            if id(graph) in plots:
                out += [f"![error along {graph.name}]({plots[id(graph)].name})", ""]
            shown = sorted((n for n in graph.nodes if n.own is not None or n.note),
                           key=lambda n: (not n.divergent, n.compared, -(n.own.ratio if n.own else 0)))[:_TABLE_ROWS]
            if shown:
                out += [f"The {len(shown)} nodes with the largest own error, and those not compared (all "
                        f"{len(graph.nodes)} in report.html and report.json):", ""]
                out += table(self._NODE_HEADER, [self._node_row(n) for n in sorted(shown, key=lambda n: n.index)])
                out.append("")
        if self.notes:
            out += ["## Notes", "", *(f"- {n}" for n in self.notes), ""]
        return "\n".join(out) + "\n"

    def _graph_title(self, graph: GraphParity) -> str:
        return f"{graph.name} ({graph.kind}" + (f", step {graph.step})" if self.steps > 1 else ")")

    @staticmethod
    def _graph_line(graph: GraphParity) -> str:
        compared = sum(n.compared for n in graph.nodes)
        text = (f"{compared} of {graph.fx_node_count} lowered FX nodes compared ({graph.unobserved} have no "
                f"value of their own in the ONNX model: folded or renamed by its cleanup"
                + (f"; {len(graph.nodes) - compared} not compared, each saying why" if compared < len(graph.nodes)
                   else "") + f"); {graph.onnx_node_count} ONNX nodes.")
        if graph.name != graph.whole:
            text += f" A partition of {graph.whole}, split by the fallback"
            text += f"; {len(graph.in_torch)} node(s) of it run in PyTorch." if graph.in_torch else "."
        first = graph.first_divergence
        text += f" First divergent node: {first.fx_name} ({first.target})." if first else " No divergent node."
        return text

    def _html(self, plots: dict[int, pathlib.Path], repros: dict[str, pathlib.Path]) -> str:
        def table(header: list[str], rows: list[list[str]], marked: Sequence[bool] = ()) -> str:
            head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
            body = []
            for i, row in enumerate(rows):
                style = ' class="bad"' if i < len(marked) and marked[i] else ""
                cells = "".join(f"<td>{html.escape(c.strip('*'))}</td>" for c in row)
                body.append(f"<tr{style}>{cells}</tr>")
            return f"<table><tr>{head}</tr>{''.join(body)}</table>"

        status = "ok" if self.ok else "bad"
        parts = [
            "<!DOCTYPE html><html><head><meta charset='utf-8'><title>aot2onnx parity report</title><style>",
            "body{font-family:sans-serif;margin:2em;max-width:1200px} table{border-collapse:collapse;font-size:12px}",
            "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left} tr.bad{background:#fdd}",
            ".ok{color:#070} .bad{color:#b00} pre{background:#f6f6f6;padding:8px;overflow-x:auto}",
            ".verdict{font-size:1.3em;padding:10px;border:2px solid} .verdict.ok{border-color:#070;background:#efe}",
            ".verdict.bad{border-color:#b00;background:#fee} .lead{font-size:1.05em;margin:0.6em 0}",
            "</style></head><body>",
            "<h1>Parity report: eager PyTorch against aot2onnx on ONNX Runtime</h1>",
            f"<p id='verdict' class='verdict {status}'><b>{html.escape(self.verdict())}</b></p>",
        ]
        if self.steps > 1 and (parting := self.first_parting()) is not None:
            parts.append(f"<p class='lead bad'><b>{html.escape(f'The two first part {parting.describe()}.')}</b></p>")
        for kind, node in self._leads():
            parts.append(f"<p class='lead bad'><b>{html.escape(self._lead_line(kind, node))}</b><br>"
                         f"at <code>{html.escape(node.source)}</code></p>")
        if not self._leads() and not self.ok:
            parts.append(f"<p class='lead'>{html.escape(self.summary().splitlines()[-1])}</p>")
        parts += [
            f"<p>{html.escape(self.summary_line())}</p>",
            f"<p>{html.escape(self._tolerance_text())}</p>",
            "<h2>Outputs, gradients, buffers</h2>",
            table(self._tensor_header(), self._tensor_rows(), [not t.ok for t in self.tensors]),
            "<h2>First divergent nodes</h2>",
        ]
        for kind in self._kinds():
            node = self.first_divergence(kind)
            parts.append(f"<h3>{kind}</h3>")
            if node is None:
                parts.append("<p>None: no node's own error is beyond tolerance.</p>")
                continue
            parts.append(f"<pre>{html.escape(node.describe())}</pre>")
            if kind in repros:
                parts.append(f"<p>Reproducer: <code>{repros[kind].name}/</code> (<code>python {repros[kind].name}/repro.py"
                             "</code> prints the difference between ONNX Runtime and PyTorch on the node's inputs).</p>")
        parts.append("<h2>Graphs</h2>")
        for graph in self.graphs:
            parts += [f"<h3>{html.escape(self._graph_title(graph))}</h3>", f"<p>{html.escape(self._graph_line(graph))}</p>"]
            if id(graph) in plots:
                parts.append(plots[id(graph)].read_text())
            if graph.nodes:
                parts.append("<details><summary>every compared node</summary>")
                parts.append(table(self._NODE_HEADER, [self._node_row(n) for n in graph.nodes],
                                   [n.divergent for n in graph.nodes]))
                parts.append("</details>")
        if self.notes:
            parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in self.notes) + "</ul>")
        parts.append("</body></html>")
        return "\n".join(parts) + "\n"
