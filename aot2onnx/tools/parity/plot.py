"""The error along a graph as an SVG drawing, written by hand (matplotlib is not a dependency)."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from aot2onnx.tools.parity.nodes import GraphParity

__all__ = ["error_plot"]

_FLOOR = 1e-6  # ratios below this (0 included) sit on the bottom line
_EAGER, _OWN, _LIMIT = "#1f77b4", "#ff7f0e", "#d62728"


def _log(ratio: float, top: float) -> float:
    if math.isnan(ratio) or math.isinf(ratio):
        return math.log10(top)
    return math.log10(min(max(ratio, _FLOOR), top))


def error_plot(graph: GraphParity, width: int = 860, height: int = 280) -> str:
    """Per node of ``graph``, in graph order, its error divided by its tolerance (log scale): against eager
    (a line: what came before it included) and its own (dots: the same inputs on both sides). Past the dashed
    line at 1 is beyond tolerance; the first divergent node is marked and named."""
    nodes = graph.nodes
    left, right, top_margin, bottom = 64, 16, 50, 42
    plot_w, plot_h = width - left - right, height - top_margin - bottom
    finite = [r for n in nodes for s in (n.error, n.own) if s is not None for r in [s.ratio] if math.isfinite(r)]
    top = 10.0 ** max(1, math.ceil(math.log10(max([*finite, 1.0]) * 2)))
    low, high = math.log10(_FLOOR), math.log10(top)

    def x(i: int) -> float:
        return left + (plot_w * (i + 0.5) / max(len(nodes), 1))

    def y(ratio: float) -> float:
        return top_margin + plot_h * (1 - (_log(ratio, top) - low) / (high - low))

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="20" font-size="13" font-weight="bold">{html.escape(graph.name)} ({graph.kind}): '
        f'error / tolerance per node</text>',
        f'<rect x="{left}" y="{top_margin}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#888"/>',
    ]
    for decade in range(int(low), int(high) + 1):
        yy = y(10.0**decade)
        parts.append(f'<line x1="{left}" y1="{yy:.1f}" x2="{left + plot_w}" y2="{yy:.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{left - 6}" y="{yy + 4:.1f}" text-anchor="end">1e{decade}</text>')
    yy = y(1.0)
    parts.append(f'<line x1="{left}" y1="{yy:.1f}" x2="{left + plot_w}" y2="{yy:.1f}" stroke="{_LIMIT}" '
                 'stroke-dasharray="5,4"/>')
    parts.append(f'<text x="{left + plot_w - 4}" y="{yy - 4:.1f}" text-anchor="end" fill="{_LIMIT}">tolerance</text>')
    step = next(s for s in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10**9) if s * 10 >= len(nodes))
    for i in range(0, len(nodes), step):
        parts.append(f'<text x="{x(i):.1f}" y="{top_margin + plot_h + 14}" text-anchor="middle">{i}</text>')
    parts.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 8}" text-anchor="middle">FX nodes with an ONNX '
                 f'value, in graph order ({len(nodes)})</text>')
    parts.append(f'<text x="14" y="{top_margin + plot_h / 2:.1f}" text-anchor="middle" '
                 f'transform="rotate(-90 14 {top_margin + plot_h / 2:.1f})">error / tolerance</text>')
    # The error against eager as a line through the nodes that have one; a node equal to eager's (a transpose
    # of a weight) breaks it, with a tick on the bottom line, so that the line follows what carries error.
    segments: list[list[str]] = [[]]
    for i, n in enumerate(nodes):
        if n.error is None or n.error.ratio == 0:
            if segments[-1]:
                segments.append([])
            if n.error is not None:
                parts.append(f'<line x1="{x(i):.1f}" y1="{y(0) - 3:.1f}" x2="{x(i):.1f}" y2="{y(0):.1f}" '
                             f'stroke="{_EAGER}"/>')
            continue
        segments[-1].append(f"{x(i):.1f},{y(n.error.ratio):.1f}")
    for points in segments:
        if len(points) == 1:
            cx, cy = points[0].split(",")
            parts.append(f'<circle cx="{cx}" cy="{cy}" r="1.5" fill="{_EAGER}"/>')
        elif points:
            parts.append(f'<polyline points="{" ".join(points)}" fill="none" stroke="{_EAGER}" stroke-width="1.5"/>')
    for i, n in enumerate(nodes):
        if n.own is not None:
            tip = html.escape(f"{n.fx_name} ({n.target}): own {n.own.ratio:.3g}, against eager "
                              f"{n.error.ratio if n.error else float('nan'):.3g}")
            colour = _LIMIT if n.divergent else _OWN
            parts.append(f'<circle cx="{x(i):.1f}" cy="{y(n.own.ratio):.1f}" r="{3.5 if n.divergent else 2.5}" '
                         f'fill="{colour}"><title>{tip}</title></circle>')
    first = graph.first_divergence
    if first is not None:
        i = nodes.index(first)
        cx, cy = x(i), y(first.own.ratio if first.own else math.inf)
        anchor = "end" if cx > left + plot_w * 0.6 else "start"
        dx = -8 if anchor == "end" else 8
        parts.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="6" fill="none" stroke="{_LIMIT}" stroke-width="2"/>')
        parts.append(f'<text x="{cx + dx:.1f}" y="{max(cy - 8, top_margin + 12):.1f}" text-anchor="{anchor}" '
                     f'fill="{_LIMIT}">first divergent: {html.escape(first.target)} ({html.escape(first.fx_name)})</text>')
    parts += _legend(left + plot_w - 250, 12, [("line", _EAGER, "against eager (carries upstream error)"),
                                                  ("dot", _OWN, "own (same inputs on both sides)"),
                                                  ("dot", _LIMIT, "own, beyond tolerance: divergent")])
    parts.append("</svg>")
    return "\n".join(parts)


def _legend(x0: float, y0: float, entries: Sequence[tuple[str, str, str]]) -> list[str]:
    parts = []
    for k, (shape, colour, label) in enumerate(entries):
        yy = y0 + 13 * k
        if shape == "line":
            parts.append(f'<line x1="{x0}" y1="{yy - 4}" x2="{x0 + 16}" y2="{yy - 4}" stroke="{colour}" stroke-width="2"/>')
        else:
            parts.append(f'<circle cx="{x0 + 8}" cy="{yy - 4}" r="3" fill="{colour}"/>')
        parts.append(f'<text x="{x0 + 22}" y="{yy}">{html.escape(label)}</text>')
    return parts
