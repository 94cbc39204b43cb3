"""The parity report measured on planted faults (``aot2onnx.tools.parity.faults``): in real models, nodes picked
at random (seeded) get their ONNX value made wrong by a relative 1e-3, which the report must name as the first
divergent node of its graph, or by four float32 ulps, which it must not blame; and each model, clean, must have
no divergent node at all.

The models are the zoo's (``tests/zoo.py``: decoders, encoders, CNNs, the U-Net block, recurrent LMs, the
recommender) and one with user lowerings: two custom ops with their own backward ops, one of which returns two
gradients. Nodes are drawn per model from the forward and the backward graphs in turn, one of each kind of rule
(aot2onnx's, torch_lib's, the user's) and of single- and multi-output nodes the model has first, then at random;
an output of a node with several is drawn at random. Each compiled step carries one fault per graph: the
forward graph's and the backward graph's are scored apart (a backward node is judged on the inputs the
backward graph received, which the forward's fault changed). Faults go into the lowering, and the model trains
a step with them ("compiled"), or into the models a clean report compared, compared again ("rerun": no training,
many times faster; each graph is judged on the inputs its call received either way).

Used by ``tests/test_parity_faults.py`` and ``scripts/parity_fault_sweep.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import sys
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from onnxscript import opset18 as op

import aot2onnx
import aot2onnx.parity
from aot2onnx.tools.parity import faults
from aot2onnx.tools.parity.faults import Outcome, Site

sys.path.insert(0, str(Path(__file__).parent))
import zoo  # noqa: E402

__all__ = ["CASES", "DEFAULT_SWEEP", "MODES", "Case", "CaseResult", "case", "format_results", "run_case"]


# ----------------------------------------------------------------------------------------------------------
# A model lowered partly by user rules


@torch.library.custom_op("aot2onnx_faults::wiggle", mutates_args=())
def wiggle(x: torch.Tensor) -> torch.Tensor:
    return x + 0.1 * torch.sin(3 * x)


@torch.library.custom_op("aot2onnx_faults::wiggle_backward", mutates_args=())
def wiggle_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return grad * (1 + 0.3 * torch.cos(3 * x))


@torch.library.custom_op("aot2onnx_faults::gate", mutates_args=())
def gate(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * weight


@torch.library.custom_op("aot2onnx_faults::gate_backward", mutates_args=())
def gate_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.tanh(x)
    return grad * weight * (1 - t * t), (grad * t).sum(0)


wiggle.register_fake(lambda x: torch.empty_like(x))
wiggle_backward.register_fake(lambda grad, x: torch.empty_like(grad))
gate.register_fake(lambda x, weight: torch.empty_like(x))
gate_backward.register_fake(lambda grad, x, weight: (torch.empty_like(grad), torch.empty_like(weight)))
wiggle.register_autograd(lambda ctx, grad: wiggle_backward(grad, ctx.saved_tensors[0]),
                         setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))
gate.register_autograd(lambda ctx, grad: gate_backward(grad, *ctx.saved_tensors),
                       setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


def _wiggle(x):
    """aot2onnx_faults::wiggle(Tensor x) -> Tensor"""
    return op.Add(x, op.Mul(op.CastLike(0.1, x), op.Sin(op.Mul(op.CastLike(3.0, x), x))))


def _wiggle_backward(grad, x):
    """aot2onnx_faults::wiggle_backward(Tensor grad, Tensor x) -> Tensor"""
    return op.Mul(grad, op.Add(op.CastLike(1.0, x), op.Mul(op.CastLike(0.3, x), op.Cos(op.Mul(op.CastLike(3.0, x), x)))))


def _gate(x, weight):
    """aot2onnx_faults::gate(Tensor x, Tensor weight) -> Tensor"""
    return op.Mul(op.Tanh(x), weight)


def _gate_backward(grad, x, weight):
    """aot2onnx_faults::gate_backward(Tensor grad, Tensor x, Tensor weight) -> (Tensor, Tensor)"""
    t = op.Tanh(x)
    grad_x = op.Mul(op.Mul(grad, weight), op.Sub(op.CastLike(1.0, t), op.Mul(t, t)))
    return grad_x, op.ReduceSum(op.Mul(grad, t), op.Constant(value_ints=[0]), keepdims=0)


@contextlib.contextmanager
def _user_rules() -> Iterator[None]:
    with aot2onnx.scoped_lowerings():
        for target, rule in ((torch.ops.aot2onnx_faults.wiggle.default, _wiggle),
                             (torch.ops.aot2onnx_faults.wiggle_backward.default, _wiggle_backward),
                             (torch.ops.aot2onnx_faults.gate.default, _gate),
                             (torch.ops.aot2onnx_faults.gate_backward.default, _gate_backward)):
            aot2onnx.register_lowering(target)(rule)
        yield


class UserRuleNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 32)
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 32))
        self.b = torch.nn.Linear(32, 32)
        self.c = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.ops.aot2onnx_faults.gate(self.a(x), self.weight)
        h = torch.ops.aot2onnx_faults.wiggle(torch.relu(self.b(h)))
        return self.c(h)


def _user_rule_data(step: int) -> tuple[tuple, Any]:
    g = torch.Generator().manual_seed(500 + step)
    return (torch.randn(16, 8, generator=g),), torch.randint(0, 4, (16,), generator=g)


# ----------------------------------------------------------------------------------------------------------
# The models


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    family: str
    build: Callable[[], torch.nn.Module]
    data: Callable[[int], tuple[tuple, Any]]
    loss_fn: Callable[..., torch.Tensor]
    tol: tuple[float, float]
    context: Callable[[], contextlib.AbstractContextManager]

    def compare(self, keep_graphs: bool = False) -> aot2onnx.parity.ParityReport:
        """One compare of the model (the same weights and data every time), with what the case needs."""
        torch.manual_seed(0)
        model = self.build()
        args, target = self.data(0)
        with self.context(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return aot2onnx.parity.compare(model, args, loss_fn=self.loss_fn, targets=target, rtol=self.tol[0],
                                           atol=self.tol[1], keep_graphs=keep_graphs)


def _zoo_case(member: zoo.Member) -> Case:
    return Case(member.name, member.family, member.build, member.data, member.loss_fn, member.tol, member.context)


CASES: dict[str, Case] = {
    "user_rules": Case("user_rules", "user lowerings", UserRuleNet, _user_rule_data, F.cross_entropy, (1e-4, 1e-5),
                       _user_rules),
    **{m.name: _zoo_case(m) for m in zoo.MEMBERS if not m.xfail},
}

# The sweep's models: at least one of each family of the zoo, the default run's and a few slow ones.
DEFAULT_SWEEP = ["user_rules", "gpt2", "llama_gqa", "mistral_sliding_window", "bert_seq_cls", "t5", "resnet",
                 "mobilenet_se", "vit", "unet_block", "lstm_lm", "dlrm", "convnext", "swin"]


def case(name: str) -> Case:
    return CASES[name]


# ----------------------------------------------------------------------------------------------------------
# Drawing and scoring


@dataclasses.dataclass
class CaseResult:
    name: str
    family: str
    clean_blamed: list[str]  # nodes the clean model's report blamed: must be none
    clean_summary: str
    largest_own: tuple[float, str]  # the clean model's largest own error over its tolerance, and that node
    sites: int  # places a fault could go
    outcomes: list[Outcome]  # relative 1e-3 faults
    ulp_outcomes: list[Outcome]  # ulp-scale faults
    seconds: float


def _draw(found: Sequence[Site], count: int, rng: random.Random) -> list[Site]:
    """``count`` nodes (an output of each): one of each kind of rule and of single/multi-output node first,
    then at random, without a node twice."""
    nodes: dict[tuple[str, int, str], list[Site]] = defaultdict(list)
    for site in found:
        nodes[(site.graph, site.occurrence, site.fx_name)].append(site)
    keys = sorted(nodes)
    rng.shuffle(keys)
    first: dict[tuple[str, bool], tuple] = {}
    for key in keys:
        site = nodes[key][0]
        first.setdefault((site.origin, site.several), key)
    rare = sorted(first, key=lambda kind: (kind[0] != "user", not kind[1], kind[0]))  # the user's rules first
    order = list(dict.fromkeys([*(first[kind] for kind in rare), *keys]))[:count]
    return [rng.choice(nodes[key]) for key in order]


def _paired(forward: list[Site], backward: list[Site]) -> list[list[Site]]:
    """One fault per graph per step: the i-th forward fault with the i-th backward fault."""
    runs = []
    for i in range(max(len(forward), len(backward))):
        runs.append([s for s in (forward[i] if i < len(forward) else None, backward[i] if i < len(backward) else None)
                     if s is not None])
    return runs


MODES = ("compiled", "rerun")


def run_case(case_: Case, *, faults_count: int, ulp_count: int, seed: int = 0, mode: str = "compiled",
             progress: Callable[[str], None] | None = None) -> CaseResult:
    """The clean report of one model, then ``faults_count`` relative 1e-3 faults and ``ulp_count`` ulp-scale
    faults, half in the forward graphs and half in the backward ones, two per compiled step.

    ``mode``: "compiled" plants each fault in the lowering, and the model trains a step with it (a compile per
    pair of faults); "rerun" plants it in the models the clean report compared and compares those graphs again
    (faults.replanted: the same inputs per graph, no training, many times faster)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    say = progress or (lambda text: None)
    started = time.perf_counter()
    clean = case_.compare(keep_graphs=mode == "rerun")
    blamed = [f"{n.kind} {n.fx_name} ({n.target}): {n.own.against_tolerance() if n.own else n.note}"
              for n in clean.divergences]
    own = [(n.own.ratio, f"{n.kind} {n.fx_name} ({n.target})") for g in clean.graphs for n in g.nodes if n.own]
    largest = max(own, default=(0.0, ""))
    with case_.context():  # the rules that lowered each node: the user's too
        found = faults.sites(clean)
    say(f"{case_.name}: clean report {'ok' if not blamed else 'BLAMES ' + str(len(blamed))}, {len(found)} sites")
    rng = random.Random(f"{seed}:{case_.name}")
    forward = [s for s in found if s.kind != "backward"]
    backward = [s for s in found if s.kind == "backward"]
    outcomes: dict[faults.Fault, list[Outcome]] = {faults.RELATIVE: [], faults.ULPS: []}
    for fault, count in ((faults.RELATIVE, faults_count), (faults.ULPS, ulp_count)):
        half = math.ceil(count / 2) if backward else count
        runs = _paired(_draw(forward, half, rng), _draw(backward, count - half, rng) if backward else [])
        for sites_ in runs:
            if mode == "rerun":
                report, where = faults.replanted(clean, [(s, fault) for s in sites_])
            else:
                with faults.planted([(s, fault) for s in sites_]) as where:
                    report = case_.compare()
            for site in sites_:
                outcome = faults.score(report, site, fault, where)
                outcomes[fault].append(outcome)
                if fault == faults.RELATIVE:
                    say(f"  1e-3 {'named first' if outcome.named_first else 'MISSED'}: {site.describe()}"
                        + (f": {outcome.why}" if outcome.why else ""))
                else:
                    say(f"  ulp  {'BLAMED' if outcome.blamed else 'not blamed'}: {site.describe()}"
                        + (f": {outcome.why}" if outcome.blamed else ""))
    return CaseResult(case_.name, case_.family, blamed, clean.summary_line(), largest, len(found), outcomes[faults.RELATIVE],
                      outcomes[faults.ULPS], time.perf_counter() - started)


# ----------------------------------------------------------------------------------------------------------
# The figures


def format_results(results: Sequence[CaseResult]) -> str:
    """The figures: per model and in all, faults planted, named first, ulp faults blamed, clean blames; then
    every miss with why, and the share named first per kind of graph, rule and node."""
    lines = ["| model | family | sites | 1e-3 faults | named first | no effect | ulp faults | ulp blamed | "
             "clean model blamed | clean: largest own error / tolerance | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        counted = [o for o in r.outcomes if not o.no_effect]
        lines.append(f"| {r.name} | {r.family} | {r.sites} | {len(counted)} | {sum(o.named_first for o in counted)} | "
                     f"{len(r.outcomes) - len(counted)} | {len(r.ulp_outcomes)} | {sum(o.blamed for o in r.ulp_outcomes)} | "
                     f"{len(r.clean_blamed)} | {r.largest_own[0]:.3g} ({r.largest_own[1]}) | {r.seconds:.0f} |")
    outcomes = [o for r in results for o in r.outcomes]
    counted = [o for o in outcomes if not o.no_effect]
    hits = sum(o.named_first for o in counted)
    ulps = [o for r in results for o in r.ulp_outcomes]
    lines += ["", f"relative 1e-3 faults: {len(counted)} planted with an effect over {len(results)} models; named first "
                  f"in their graph: {hits} ({100 * hits / max(len(counted), 1):.1f}%); "
                  f"{len(outcomes) - len(counted)} more had no effect (the value is all zeros)",
              f"ulp-scale faults ({faults.ULPS}): {len(ulps)} planted; blamed: {sum(o.blamed for o in ulps)}",
              f"clean models: {len(results)}; nodes blamed: {sum(len(r.clean_blamed) for r in results)}"]
    breakdown: dict[str, Counter[bool]] = defaultdict(Counter)
    for o in counted:
        for label in (f"graph {'backward' if o.site.kind == 'backward' else 'forward'}", f"rule {o.site.origin}",
                      f"{'multi' if o.site.several else 'single'}-output node"):
            breakdown[label][o.named_first] += 1
    lines += ["", "named first, by kind:"]
    lines += [f"  {label}: {c[True]} of {c[True] + c[False]}" for label, c in sorted(breakdown.items())]
    misses = [(r.name, o) for r in results for o in r.outcomes if not o.named_first]
    lines += ["", f"misses and faults without effect ({len(misses)}):"]
    lines += [f"  {name}: {o.site.describe()}: {o.why}" for name, o in misses] or ["  none"]
    blamed_ulps = [(r.name, o) for r in results for o in r.ulp_outcomes if o.blamed]
    lines += ["", f"ulp-scale faults blamed ({len(blamed_ulps)}):"]
    lines += [f"  {name}: {o.site.describe()}: {o.why}" for name, o in blamed_ulps] or ["  none"]
    clean = [(r.name, b) for r in results for b in r.clean_blamed]
    lines += ["", f"nodes blamed in clean models ({len(clean)}):"]
    lines += [f"  {name}: {b}" for name, b in clean] or ["  none"]
    return "\n".join(lines)
