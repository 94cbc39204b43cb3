"""The benchmark's report: markdown (``BENCHMARKS.md``) and a bar chart of step time relative to eager."""

from __future__ import annotations

import os
from typing import Any

from aot2onnx.tools.bench.models import SUITES
from aot2onnx.tools.bench.timing import SETTLE_S, suite_group

__all__ = ["FINDINGS", "findings_link", "render_markdown", "write_chart"]

# Above this many cores used on average by other processes during a measurement, the report says the
# machine was busy. An idle machine shows a few hundredths.
BUSY_CORES = 0.15

# What the figures do not show by themselves: what was measured while tuning aot2onnx, and what would close
# each gap. A document of the source tree, which the report links to.
FINDINGS = "docs/benchmark-findings.md"

SUITE_TITLES = {"main": "Main suite", "device": "Device-scale suite"}
assert set(SUITE_TITLES) == set(SUITES)

# The device suite's targets: aot2onnx's geometric mean at most eager's, and no model above this ratio to eager.
DEVICE_MODEL_LIMIT = 1.2


def findings_link(report_path: str) -> str | None:
    """The path from the report's folder to the findings document, if this is a source tree that has it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    path = os.path.join(root, FINDINGS)
    if not os.path.exists(path):
        return None
    return os.path.relpath(path, os.path.dirname(os.path.abspath(report_path)))


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    return f"{ms:.0f}" if abs(ms) >= 100 else f"{ms:.1f}" if abs(ms) >= 1 else f"{ms:.2f}"


def _cores(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratio(r: dict[str, float] | None) -> str:
    return "-" if not r else f"{r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]"


def _first_step(entry: dict[str, Any], key: str) -> str:
    run = entry.get(key)
    if not run:
        return "-"
    if "error" in run:
        return f"failed: {run['error']}"
    return f"{run['first_step_s']:.2f}"


def _groups(results: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    """(suite, its models in this run) for each suite this run has models of, in SUITES' order."""
    groups = [(suite, [m for m in results["models"] if suite_group(m) == suite]) for suite in SUITES]
    return [(suite, models) for suite, models in groups if models]


def _targets(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(target, figure, met / not met) for each of the issue's targets that this run can judge: the first
    targets over the main suite, then the same three for each suite."""
    main = [m for m in results["models"] if suite_group(m) == "main"]
    rows = _main_targets(results, {m["name"]: m for m in main}) if main else []
    for suite, models in _groups(results):
        rows += _suite_targets(results, suite, models)
    return rows


def _suite_targets(results: dict[str, Any], suite: str, models: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    contenders, title = results["contenders"], SUITE_TITLES[suite]
    if "aot2onnx" not in contenders or "eager" not in contenders:
        return []
    gm = results["summary"]["geomean_by_suite"].get(suite, {}).get("aot2onnx")
    rows = [(f"{title}: aot2onnx step time <= eager's, geometric mean over the suite",
             "-" if gm is None else f"{gm:.2f} of eager's", "-" if gm is None else _met(gm <= 1.0))]
    ratios = [(m["name"], (m["contenders"]["aot2onnx"].get("ratio_to_eager") or {}).get("median")) for m in models]
    rows.append((f"{title}: no model above {DEVICE_MODEL_LIMIT}x eager (aot2onnx / eager)",
                 ", ".join(f"{name} {r:.2f}" if r else f"{name} -" for name, r in ratios),
                 _met(all(r and r <= DEVICE_MODEL_LIMIT for _, r in ratios))))
    transformers = [m for m in models if m.get("transformer")]
    if "inductor" in contenders and transformers:
        figures = [(m["name"], (m.get("aot2onnx_to_inductor") or {}).get("median")) for m in transformers]
        rows.append((f"{title}: aot2onnx below inductor on the transformer models (aot2onnx / inductor)",
                     ", ".join(f"{name} {r:.2f}" if r else f"{name} -" for name, r in figures),
                     _met(all(r and r < 1.0 for _, r in figures))))
    return rows


def _main_targets(results: dict[str, Any], models: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = []
    contenders = results["contenders"]
    if "aot2onnx" in contenders and "eager" in contenders:
        gm = results["summary"]["geomean_ratio_to_eager"].get("aot2onnx")
        rows.append(("aot2onnx step time, geometric mean over the suite, <= 0.75 of eager's",
                     "-" if gm is None else f"{gm:.2f} of eager's", "-" if gm is None else _met(gm <= 0.75)))
    if "aot2onnx" in contenders and "inductor" in contenders:
        figures, ok = [], True
        for name, m in models.items():
            r = m.get("aot2onnx_to_inductor")
            figures.append(f"{name} {r['median']:.2f}" if r else f"{name} -")
            ok = ok and bool(r) and r["median"] < 1.0
        rows.append(("aot2onnx step time below inductor's on each model (aot2onnx / inductor)", ", ".join(figures),
                     _met(ok)))
    if "mlp" in models and "breakdown" in models["mlp"] and models["mlp"]["breakdown"].get("kernel_s"):
        b = models["mlp"]["breakdown"]
        share = (b["handoff_s"] + b["wrappers_s"]) / b["kernel_s"]
        rows.append(("MLP: hand-off + wrappers <= 5% of ONNX Runtime kernel time",
                     f"{_ms(b['handoff_s'] + b['wrappers_s'])} ms of {_ms(b['kernel_s'])} ms = {share:.1%}",
                     _met(share <= 0.05)))
    if "aot2onnx" in contenders and "inductor" in contenders:
        figures, ok = _cold_ratios(models, "first_step_s", "inductor", 0.5)
        rows.append(("first step (cold, fresh process) <= half of inductor's (aot2onnx / inductor)", figures,
                     _met(ok)))
    if "aot2onnx" in contenders:
        warm = [(name, m["contenders"]["aot2onnx"].get("warm", {}).get("first_step_s"))
                for name, m in models.items() if name.startswith("encoder")]
        if any(w for _, w in warm):
            rows.append(("transformer layer: first step in a second process (warm aot2onnx cache) <= 2 s",
                         ", ".join(f"{name} {w:.2f} s" if w else f"{name} -" for name, w in warm),
                         _met(all(w and w <= 2.0 for _, w in warm))))
    if "aot2onnx" in contenders and "eager" in contenders:
        figures, ok = _cold_ratios(models, "peak_rss_mib", "eager", 1.1)
        rows.append(("peak RSS <= 1.1x eager's (aot2onnx / eager, each in its own process)", figures, _met(ok)))
    return rows


def _cold_ratios(models: dict[str, Any], key: str, other: str, limit: float) -> tuple[str, bool]:
    """Per model, aot2onnx's ``key`` over ``other``'s, each from its cold fresh process; and whether every
    model has both and a ratio of at most ``limit``."""
    figures, ok = [], True
    for name, m in models.items():
        mine = m["contenders"]["aot2onnx"].get("cold", {}).get(key)
        theirs = m["contenders"][other].get("cold", {}).get(key)
        figures.append(f"{name} {mine / theirs:.2f}" if mine and theirs else f"{name} -")
        ok = ok and bool(mine and theirs) and mine <= limit * theirs
    return ", ".join(figures), ok


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def _where_time_goes(m: dict[str, Any]) -> list[str]:
    b = m.get("breakdown")
    if not b:
        return []
    if "error" in b:
        return [f"Breakdown failed: {b['error']}", ""]
    step = b["step_s"]
    lines = ["| part of one aot2onnx step | ms | share |", "|---|---:|---:|"]
    for label, seconds in b["parts"]:
        lines.append(f"| {label} | {_ms(seconds)} | {'-' if seconds is None else f'{seconds / step:.0%}'} |")
    lines.append(f"| **step (this run, mean of {b['steps']} steps)** | **{_ms(step)}** | 100% |")
    lines.append("")
    p = b["profile"]
    notes = []
    if p.get("sessions"):
        kinds = ", ".join(f"{kind} {_ms(s)} ms" for kind, s in sorted(p["by_kind"].items()))
        top = sorted(p["by_op"].items(), key=lambda kv: -kv[1])[:6]
        notes.append(f"ONNX Runtime kernels by graph: {kinds}. Heaviest op types: "
                     + ", ".join(f"{op} {_ms(s)} ms" for op, s in top) + ".")
    else:
        notes.append(f"No kernel profile: {p.get('error', 'unknown reason')}.")
    eager = m["contenders"].get("eager", {}).get("phases_s")
    mine = m["contenders"].get("aot2onnx", {}).get("phases_s")
    if eager and mine:
        notes.append("Phase medians from the timed rounds, aot2onnx vs eager: forward+loss "
                     f"{_ms(mine['forward'])} vs {_ms(eager['forward'])} ms, backward {_ms(mine['backward'])} vs "
                     f"{_ms(eager['backward'])} ms, optimizer {_ms(mine['optimizer'])} vs "
                     f"{_ms(eager['optimizer'])} ms.")
    notes.append(f"{b['ort_calls_per_step']:.0f} compiled-graph call(s) per step; ONNX Runtime's run time "
                 f"{'timed around the session run' if b['run_source'] == 'timed' else 'from its profiler'}.")
    if m.get("fallback_graphs"):
        notes.append(f"{m['fallback_graphs']} graph(s) fell back to PyTorch for some nodes: their PyTorch "
                     "compute is counted under the wrappers.")
    return lines + [" ".join(notes), ""]


def _step_gap(m: dict[str, Any]) -> str | None:
    """One model: how aot2onnx's step compares with eager's, phase by phase, and its heaviest ONNX ops."""
    mine, eager, b = m["contenders"].get("aot2onnx", {}), m["contenders"].get("eager", {}), m.get("breakdown")
    if "step_s" not in mine or "step_s" not in eager or not b or "error" in b:
        return None
    p = b["profile"]
    text = f"{m['name']}: aot2onnx {_ms(mine['step_s'])} ms, eager {_ms(eager['step_s'])} ms per step."
    if p.get("sessions"):
        ep = eager.get("phases_s", {})
        kf, kb = p["by_kind"].get("forward", 0.0), p["by_kind"].get("backward", 0.0)
        text += (f" ONNX Runtime's kernels alone take {_ms(b['kernel_s'])} ms: forward graph {_ms(kf)} ms against "
                 f"eager's whole forward+loss {_ms(ep.get('forward'))} ms, backward graph {_ms(kb)} ms against "
                 f"eager's backward {_ms(ep.get('backward'))} ms.")
        top = sorted(p["by_op"].items(), key=lambda kv: -kv[1])[:4]
        text += " Heaviest ONNX op types: " + ", ".join(f"{op} {_ms(sec)} ms" for op, sec in top) + "."
        if p.get("model_run_s") and b.get("run_s"):
            # The profiler's own cost grows with the node count (MobileNet-s's backward, 523 nodes: 18.4 ms
            # profiled, 15.4 ms without): these kernel figures are upper bounds.
            text += (f" (Profiled, the graphs' runs took {_ms(p['model_run_s'])} ms a step against "
                     f"{_ms(b['run_s'])} ms without the profiler: the kernel figures are upper bounds.)")
    text += (f" Outside the kernels: ONNX Runtime's executor {_ms(b['parts'][1][1])} ms, "
             f"hand-off {_ms(b['handoff_s'])} ms, wrappers {_ms(b['wrappers_s'])} ms, optimizer "
             f"{_ms(b['optimizer_s'])} ms.")
    return text


def _gaps(results: dict[str, Any]) -> list[str]:
    """Where each target that is not met loses, from the figures of this run: on the main suite, a step above
    0.75 of eager's, at or above inductor's, a first step above half of inductor's, peak RSS above 1.1x eager's;
    on the device suite, a step above eager's, and a transformer model's at or above inductor's."""
    models = results["models"]
    main = [m for m in models if suite_group(m) == "main"]
    lines = []
    for m in models:
        limit = 0.75 if suite_group(m) == "main" else 1.0
        if (m["contenders"].get("aot2onnx", {}).get("ratio_to_eager") or {}).get("median", 0) > limit:
            gap = _step_gap(m)
            if gap:
                lines.append(f"- Step time, {gap}")
    for m in models:
        r = m.get("aot2onnx_to_inductor")
        if r and r["median"] >= 1.0 and (suite_group(m) == "main" or m.get("transformer")):
            ind = m["contenders"]["inductor"]
            lines.append(f"- Against inductor, {m['name']}: aot2onnx {_ms(m['contenders']['aot2onnx']['step_s'])} ms, "
                         f"inductor {_ms(ind['step_s'])} ms (forward {_ms(ind['phases_s']['forward'])}, backward "
                         f"{_ms(ind['phases_s']['backward'])} ms).")
    for m in main:
        a = m["contenders"].get("aot2onnx", {})
        i = m["contenders"].get("inductor", {})
        ac, ic = a.get("cold", {}).get("first_step_s"), i.get("cold", {}).get("first_step_s")
        if ac and ic and ac > 0.5 * ic:
            warm = a.get("warm", {}).get("first_step_s")
            lines.append(f"- First step, {m['name']}: aot2onnx {ac:.2f} s cold"
                         + (f", {warm:.2f} s on a warm cache" if warm else "") + f"; inductor {ic:.2f} s cold.")
    for m in main:
        a = m["contenders"].get("aot2onnx", {}).get("cold", {})
        e = m["contenders"].get("eager", {}).get("cold", {})
        if a.get("peak_rss_mib") and e.get("peak_rss_mib") and a["peak_rss_mib"] > 1.1 * e["peak_rss_mib"]:
            lines.append(_rss_gap(m["name"], a, e))
    return lines


_RSS_KEYS = ("rss_start_mib", "rss_compile_called_mib", "peak_rss_first_step_mib", "peak_rss_mib")


def _rss_steps(run: dict[str, Any]) -> tuple[float, float, float, float] | None:
    """(at start, added by torch.compile's imports, by compiling and the first step, by the later steps)."""
    if any(run.get(k) is None for k in _RSS_KEYS):
        return None
    start, called, first, peak = (run[k] for k in _RSS_KEYS)
    return start, called - start, first - called, peak - first


def _rss_gap(name: str, mine: dict[str, Any], eager: dict[str, Any]) -> str:
    text = f"- Peak RSS, {name}: aot2onnx {mine['peak_rss_mib']:.0f} MiB, eager {eager['peak_rss_mib']:.0f} MiB"
    a, e = _rss_steps(mine), _rss_steps(eager)
    if a and e:
        text += (f"; from the same start ({a[0]:.0f} MiB: torch, the model, the batch), aot2onnx adds "
                 f"{a[1]:.0f} MiB of imports in the setup (`torch.compile`, the optimizer; eager {e[1]:.0f}), {a[2]:.0f} over compilation "
                 f"and the first step (eager {e[2]:.0f}) and {a[3]:.0f} in the later steps (eager {e[3]:.0f})")
    return text + "."


def _summary_table(contenders: list[str], models: list[dict[str, Any]]) -> list[str]:
    header = "| model | " + " | ".join(f"{c} ms" for c in contenders) + " | " + " | ".join(
        f"{c} / eager" for c in contenders if c != "eager") + " |"
    lines = [header, "|---|" + "---:|" * (2 * len(contenders) - 1)]
    for m in models:
        cells = []
        for c in contenders:
            e = m["contenders"][c]
            cells.append(f"failed: {e['error']}" if "error" in e and "step_s" not in e else _ms(e.get("step_s")))
        ratios = [_ratio(m["contenders"][c].get("ratio_to_eager")) for c in contenders if c != "eager"]
        lines.append(f"| {m['name']} | " + " | ".join(cells + ratios) + " |")
    return lines


def _lever_description(lever: dict[str, Any]) -> str:
    text = lever["description"]
    if lever["optimizer"] != "sgd":
        text += f" (optimizer {lever['optimizer']}; the default it is compared with uses it too)"
    return text


def _lever_cell(lever: dict[str, Any]) -> str:
    if "error" in lever:
        return f"failed: {lever['error']}"
    return _ratio(lever.get("ratio_to_default"))


def _lever_detail(lever: dict[str, Any]) -> str:
    text = f"{lever['name']} {_lever_cell(lever)}"
    if "step_s" in lever:
        text += f" ({_ms(lever['step_s'])} ms against {_ms(lever['default_step_s'])} ms)"
        if lever.get("fallback_graphs"):
            text += f", {lever['fallback_graphs']} graph(s) with nodes in PyTorch"
    return text


def _levers(results: dict[str, Any]) -> list[str]:
    """The levers table: one row per lever, one column per device-suite model it was measured on."""
    models = [m for m in results["models"] if m.get("levers")]
    if not models:
        return []
    levers: dict[str, dict[str, Any]] = {}
    for m in models:
        for lever in m["levers"]:
            levers.setdefault(lever["name"], lever)
    out = ["", "## Levers (device suite)", "",
           "**Levers (device suite): step time with the lever / aot2onnx's default**, median of the per-round "
           "ratios [min-max]; below 1.00 the lever makes the step faster. Each lever is timed against aot2onnx "
           "with default options and the same optimizer, in alternating rounds in the benchmark process (Method).",
           "", "| lever | what it does | " + " | ".join(m["name"] for m in models) + " |",
           "|---|---|" + "---:|" * len(models)]
    for name, lever in levers.items():
        found = [next((x for x in m["levers"] if x["name"] == name), None) for m in models]
        cells = ["-" if x is None else _lever_cell(x) for x in found]
        out.append(f"| {name} | {_lever_description(lever)} | " + " | ".join(cells) + " |")
    return out


def render_markdown(results: dict[str, Any], chart: str | None = None, findings: str | None = None) -> str:
    """The report: summary, targets, a table and a breakdown per model, method, machine and versions.

    ``chart`` and ``findings`` are the paths of the bar chart and of the findings document from the report's
    folder (None: no chart; the findings named as a file of aot2onnx's source tree).
    """
    machine, versions, settings = results["machine"], results["versions"], results["settings"]
    contenders = results["contenders"]
    noise = [(m["name"], m.get("others_cores_rounds"), m.get("others_cores_fresh"), m.get("others_cores_levers"))
             for m in results["models"]]
    busiest = max((v for _, *values in noise for v in values if v is not None), default=None)
    out = [
        "# Training-step benchmark: eager vs inductor vs aot2onnx",
        "",
        f"Generated by `{results['command']}` on {results['date']}.",
        "",
    ]
    if busiest is not None:
        out += [
            ("**The machine was busy**: " if busiest > BUSY_CORES else "The machine was quiet: ")
            + "other processes kept this many of its "
            f"{machine['available_cores']} cores busy on average (from /proc/stat, less this process and its "
            "children) during the timed rounds / the fresh-process runs (/ the lever rounds): "
            + ", ".join(f"{n} {_cores(r)} / {_cores(f)}" + ("" if lv is None else f" / {_cores(lv)}")
                        for n, r, f, lv in noise) + "."
            + (" Other work shared the cores, so these timings are noisy (eager's OpenMP steps suffer most): "
               "rerun `make bench` on a quiet machine." if busiest > BUSY_CORES else ""),
            "",
        ]
    if settings.get("quick"):
        out += ["**Quick mode**: a handful of steps, for tests; these figures are not a measurement.", ""]
    out += ["## Summary", ""]
    if chart:
        out += [f"![step time relative to eager]({chart})", ""]
    for suite, models in _groups(results):
        out += [f"### {SUITE_TITLES[suite]}", ""] + _summary_table(contenders, models)
        gm = results["summary"]["geomean_by_suite"].get(suite)
        if gm:
            out += ["", f"Geometric mean of the step-time ratio to eager over the {SUITE_TITLES[suite].lower()}: "
                    + ", ".join(f"{c} **{v:.2f}**" for c, v in gm.items()) + " (lower is faster)."]
        out += [""]
    targets = _targets(results)
    if targets:
        out += ["", "## Targets", "", "| target | figure | |", "|---|---|---|"]
        out += [f"| {t} | {f} | {s} |" for t, f, s in targets]
        gaps = _gaps(results)
        if gaps:
            where = f"[{FINDINGS}]({findings})" if findings else f"`{FINDINGS}` in aot2onnx's source tree"
            out += ["", "Where the targets that are not met lose:", ""] + gaps + [
                "", f"What would close the gaps, measured while tuning aot2onnx: {where}."]
    out += _levers(results)
    out += ["", "## Per model", ""]
    for m in results["models"]:
        out += [f"### {m['name']}: {m['title']}", ""]
        if m.get("rounds"):
            out += [f"{m['rounds']} rounds of {results['settings']['steps']} timed steps per contender.", ""]
        out += ["| contender | step ms | ratio to eager, median [min-max] | first step s, cold | "
                "first step s, compile caches warm | peak RSS MiB |",
                "|---|---:|---:|---:|---:|---:|"]
        for c in contenders:
            e = m["contenders"][c]
            step = _ms(e.get("step_s")) if "step_s" in e else f"failed: {e.get('error', '-')}"
            rss = e.get("cold", {}).get("peak_rss_mib")
            warm = "n/a" if c == "eager" else _first_step(e, "warm")
            out.append(f"| {c} | {step} | {'1.00' if c == 'eager' else _ratio(e.get('ratio_to_eager'))} | "
                       f"{_first_step(e, 'cold')} | {warm} | {'-' if rss is None else f'{rss:.0f}'} |")
        rss = [(c, _rss_steps(m["contenders"][c].get("cold", {}))) for c in contenders]
        if any(r for _, r in rss):
            out += ["", "| RSS of each fresh process, MiB | at start (torch, model, batch) | + setup: "
                    "torch.compile or not, SGD (imports) | + compilation and first step | + later steps |", "|---|---:|---:|---:|---:|"]
            out += [f"| {c} | " + " | ".join(f"{v:.0f}" for v in r) + " |" for c, r in rss if r]
        if m.get("aot2onnx_to_inductor"):
            out += ["", f"aot2onnx / inductor, median of per-round ratios: {_ratio(m['aot2onnx_to_inductor'])}."]
        if "sessions" in m:
            s = m["sessions"]
            out += ["", f"aot2onnx ran {s['sessions']} ONNX Runtime session(s); allow_spinning read back from "
                    f"each session's options: {', '.join(s['allow_spinning']) or '-'} (0 = off); intra-op "
                    f"threads {', '.join(map(str, s['intra_op_threads'])) or '-'}."]
        if m.get("levers"):
            out += ["", "Levers, step time with the lever / aot2onnx's default (median [min-max] of rounds): "
                    + "; ".join(_lever_detail(lever) for lever in m["levers"]) + "."]
        out += [""]
        if m.get("breakdown"):
            out += ["#### Where aot2onnx's step goes", ""] + _where_time_goes(m)
    out += ["## Method", "", _method(results), "",
            "## Machine and versions", "",
            f"- CPU: {machine['cpu']}, {machine['cores']} cores ({machine['available_cores']} available to the "
            f"process); torch threads {machine['threads']}; {machine['platform']}; 1-minute load average "
            f"{_cores(results.get('load_start'))} at the start, {_cores(results.get('load_end'))} at the end "
            "(this process included)",
            "- " + ", ".join(f"{k} {v}" for k, v in versions.items()),
            f"- settings: {', '.join(f'{k}={v}' for k, v in settings.items())}", ""]
    return "\n".join(out)


def _method(results: dict[str, Any]) -> str:
    s = results["settings"]
    return (
        "Each step is a full SGD training step: `zero_grad(set_to_none=True)`, forward with the loss, "
        "`backward()`, `step()` (learning rate 1e-3). The compiled contenders compile the model together with "
        "its loss (`torch.compile(lambda x, y: loss_fn(model(x), y), backend=...)`, one function object per "
        "contender so Dynamo's caches stay apart); the optimizer runs eagerly for all of them. Per model, every "
        "contender starts from a deep copy of one initial model and trains on the same batch in one process. "
        "After its first step, aot2onnx trains untimed until each graph's thread trial has settled (the trial's "
        f"calls take turns between sessions on other thread counts; {s.get('trial_steps', 400)} steps at "
        "most), so that the rounds time the sessions a training run keeps. "
        f"A round runs each contender once: {s['warmup']} warm-up step(s) after a {SETTLE_S * 1e3:.0f} ms pause "
        f"and a garbage collection, then {s['steps']} timed steps with the garbage collector off; the "
        "contender's time for the round is the median of those steps. "
        + (f"{s['rounds']} rounds" if not s.get("min_timed_s") else
           f"At least {s['rounds']} rounds, and more where steps are short (until every contender's timed steps "
           f"add up to {s['min_timed_s']:g} s, {s['max_rounds']} rounds at most; each model's section gives "
           "its count),")
        + " rotate the order of the contenders, so each runs first, second and last. A "
        "contender's step time is the median over rounds, and its ratio to eager is the median of the per-round "
        "ratios, with their minimum and maximum. Keeping each measurement clean of the others: ONNX Runtime's "
        "idle threads would otherwise spin and hold the cores while the next contender runs; aot2onnx's "
        "default is `allow_spinning=False`, and the report reads the setting back from every session's "
        "options; the warm-up steps and the pause before each block let the previous contender's thread pools "
        "(ONNX Runtime's, and torch's OpenMP workers) go idle. torch and ONNX Runtime use the same thread count "
        f"({s['threads']}). First-step time is the wall time of the first training step, compilation included, "
        "in a fresh process per (model, contender) that calls `torch._dynamo.reset()` first and uses empty "
        "inductor and aot2onnx compile caches (cold); the compiling contenders are then run in a second fresh "
        f"process on the caches the first left behind (warm). The first process then runs {s['process_steps']} "
        "more steps and reports its peak RSS (VmHWM from `/proc/self/status`: `getrusage(RUSAGE_SELF).ru_maxrss` would carry over the benchmark process's RSS at the fork): it imports torch and the "
        "model, plus only what its contender needs (eager and inductor never import onnx or onnxruntime); "
        "inductor's compile worker processes are not counted. Where aot2onnx's step goes: on the compiled "
        "aot2onnx model, after the rounds, the runtime's `aot2onnx.runtime.session.profiling()` hook times each "
        "compiled-graph call and the ONNX Runtime run inside it (outside such a block the hook costs one check "
        f"per call), and {s['breakdown_steps']} steps are timed by phase; the compiled forward+backward wall time minus the "
        "time inside OrtGraph calls is Dynamo's guards, AOTAutograd's wrappers and epilogue and the autograd "
        "engine; time inside OrtGraph calls but outside ONNX Runtime's run is the hand-off (binding inputs and "
        "outputs, DLPack). ONNX Runtime's kernel time comes from a separate copy of the model compiled with "
        "ONNX Runtime's profiler on (the sum of the `Node` kernel durations of its JSON trace over the same "
        "number of steps, warm-up runs left out); the run time minus that is ONNX Runtime's executor and "
        "allocation overhead. The profiler has a cost of its own per node (MobileNet-s's backward graph, 523 "
        "nodes, ran in 18.4 ms profiled against 15.4 ms without; with 648 nodes, 24.3 against 15.6 ms), so the "
        "kernel figures are upper bounds and this overhead can come out negative; each model's line gives the "
        "profiled and the unprofiled run time side by side. "
        f"{_method_suites(results)} Noise: the CPU time other processes used while each model was measured (the "
        "machine's busy time from /proc/stat minus this process's and its children's) is reported at the top; "
        f"above {BUSY_CORES} cores on average the report calls the machine busy."
    )


def _method_suites(results: dict[str, Any]) -> str:
    s = results["settings"]
    text = (
        "Two suites. The main suite is the models the issue's first targets were set on. The device-scale suite "
        "is smaller models at the batches a small device trains with (milliseconds a step, where the fixed "
        "costs of a step weigh most): an MLP, a transformer layer, a CNN, two Hugging Face models built as a "
        "user builds them (GPT-2 and BERT, transformers' default sdpa attention, called with `input_ids` only, "
        "the loss on the logits) and the model zoo's MobileNet; its targets are a geometric mean of at most "
        f"eager's step time, no model above {DEVICE_MODEL_LIMIT}x eager's, and aot2onnx below inductor on its "
        "transformer models. Both suites are measured the same way."
    )
    if not s.get("levers"):
        return text + " Levers were not measured in this run (`--levers` turns them on)."
    return text + (
        " Levers, on each device-suite model: after the breakdown, in the same process, aot2onnx compiles a "
        "new deep copy of the initial model with the lever (`torch.compile(fn, backend=\"aot2onnx\", "
        "options=...)` with the lever's options; a lever that compiles the optimizer also compiles a function "
        "calling `opt.step()` with the same backend and options, at its first call like the model), and it is "
        "timed against aot2onnx with default options and the same optimizer (the rounds' aot2onnx runner "
        f"where that is SGD): {s['rounds']} rounds, the two taking turns to go first, each block "
        f"{s['warmup']} warm-up and {s['steps']} timed steps as above. A lever's figure is the median of the "
        "per-round ratios lever / default, with their minimum and maximum."
    )


def _chart_panel(ax: Any, models: list[dict[str, Any]], contenders: list[str], suite: str) -> float:
    """One suite's bars on ``ax``; returns the height the bars and their ranges reach."""
    width = 0.8 / max(1, len(contenders))
    colors = {"inductor": "#8c8c8c", "aot2onnx": "#1f77b4"}
    top = 1.2
    for i, contender in enumerate(contenders):
        xs, heights, lows, highs = [], [], [], []
        for j, m in enumerate(models):
            r = m["contenders"][contender].get("ratio_to_eager")
            xpos = j + (i - (len(contenders) - 1) / 2) * width
            if not r:
                ax.text(xpos, 0.05, "failed", rotation=90, ha="center", va="bottom", fontsize=8)
                continue
            xs.append(xpos)
            heights.append(r["median"])
            lows.append(r["median"] - r["min"])
            highs.append(r["max"] - r["median"])
        ax.bar(xs, heights, width, yerr=[lows, highs], capsize=3, label=contender,
               color=colors.get(contender), error_kw={"ecolor": "#444444", "elinewidth": 1})
        for xpos, h, hi in zip(xs, heights, highs):
            ax.text(xpos, h, f"{h:.2f}", ha="center", va="bottom", fontsize=7,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
            top = max(top, 1.08 * (h + hi))
    ax.axhline(1.0, color="black", linewidth=1, label="eager")
    if "aot2onnx" in contenders and suite == "main":
        ax.axhline(0.75, color="#2ca02c", linewidth=1, linestyle="--", label="target 0.75 (geomean)")
    if "aot2onnx" in contenders and suite == "device":
        ax.axhline(DEVICE_MODEL_LIMIT, color="#d62728", linewidth=1, linestyle=":",
                   label=f"target: no model above {DEVICE_MODEL_LIMIT}")
    ax.set_xticks(range(len(models)))
    ax.set_xticklabels([m["name"] for m in models], fontsize=8)
    ax.set_title(SUITE_TITLES[suite], fontsize=9)
    ax.legend(fontsize=7)
    return top


def write_chart(results: dict[str, Any], path: str) -> str | None:
    """A bar chart of step time relative to eager, per model and contender; returns why not, if it can't."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (`pip install matplotlib`, or `make bench` installs it)"
    contenders = [c for c in results["contenders"] if c != "eager"]
    models = results["models"]
    groups = _groups(results)
    # One panel per suite, as wide as its models; a shared y axis keeps the bars comparable.
    fig, axes = plt.subplots(1, len(groups), squeeze=False, sharey=True,
                             figsize=(max(6.0, 1.6 * len(models) + 2), 4.0),
                             gridspec_kw={"width_ratios": [len(ms) for _, ms in groups]})
    top = max(_chart_panel(ax, ms, contenders, suite) for ax, (suite, ms) in zip(axes[0], groups))
    axes[0][0].set_ylim(0, top)
    axes[0][0].set_ylabel("step time / eager's (median of rounds)")
    m = results["machine"]
    noise = [v for x in models for v in (x.get("others_cores_rounds"), x.get("others_cores_fresh")) if v is not None]
    busy = " - machine busy, noisy" if noise and max(noise) > BUSY_CORES else ""
    fig.suptitle(f"Training step relative to eager ({m['threads']} threads, {m['cpu']}){busy}", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


