"""Differential testing of aot2onnx against eager PyTorch: seeded random programs, their error budget, and
standalone reproducers.

``generate(seed)`` writes a small straight-line program (1-3 input tensors, 3-10 ops before dead ones are
pruned, drawn from pointwise math, reductions, matrix products, indexing, pooling and normalization) with its
inputs: ordinary values, and in 60% of programs NaN, +-inf, -0.0, denormals and huge or tiny values mixed in.
Constants are drawn near where arithmetic changes behaviour: 0 and -0.0, 1e-12..1e-6, 1 +- 1e-7..1e-4, 1e30
and 3e38, denormals (1e-40 in float32, 1e-310 in float64). ``run_programs`` runs each program in eager PyTorch
and through ``torch.compile(backend="aot2onnx")`` (several programs share one compiled function, to share the
compile cost), with gradients where the inputs are finite, and ``compare`` says whether the two agree.
``shrink`` minimises a failing program and ``repro_script`` writes it as a script a developer can paste.

What "agree" means
------------------
NaN, +inf, -inf and finite must match element for element. Finite values must be within a budget built from
``TOLERANCES``, how many units in the last place (ULPs) each ATen op, forward or backward, may be off by:

* ops not in the table are exact (+ - * /, reciprocal, neg, abs, relu, maximum/minimum, clamp, where,
  masked_fill, floor, round, sign, amax/amin, max pooling, indexing, cat/stack, views): a program of exact ops
  must match bit for bit, signs of zero included (except in gradients, where autograd itself does not keep
  them);
* transcendental ops have a few ULPs of their output (4 for exp, log, tanh, sigmoid, ...; sqrt 1, because
  eager's own vectorized float32 sqrt is not correctly rounded);
* reductions and matrix products have ULPs per term on their operands (any summation order is within
  (n - 1) ULPs of each term, n the number of terms), plus ULPs on the output;
* ops whose error is absolute rather than relative (log-sum-exp, log-softmax: a relative error in the sum is
  an absolute error of the log; gelu's 1 + erf(x) cancels for negative x) have an absolute budget.

The budgets compound through the program by stochastic arithmetic: the program is run ``NOISE_SAMPLES`` more
times in eager under ``Noise``, a dispatch mode that moves every ATen op's result by its budget (whole ULPs,
seeded random signs), forward and backward. Autograd saves the moved results, so a backward formula that reads
an output (tanh's 1 - y^2) sees the moved one; backward ops that are formulas over reductions (layer norm's,
softmax's) are decomposed so that each of their sums carries its own budget. The spread of these runs around
eager is how far a correct implementation may land, the program's conditioning included (cancellation, exp
amplifying its argument's error, floor or a comparison flipping near a boundary); compiled must be within
``SAFETY`` times that spread, so a lone op with a budget of k ULPs may be off by SAFETY * k (a gradient element
also by SAFETY * GRAD_SHARED times the largest spread in its tensor: backward passes sum across elements). An
element whose NaN/inf class changes within the noisy runs is unstable and its class is not compared.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import re
import textwrap
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch._decomp
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "BATCH_SIZE",
    "EXACT",
    "GRAD_SHARED",
    "NOISE_SAMPLES",
    "SAFETY",
    "TOLERANCES",
    "Noise",
    "Outcome",
    "Program",
    "Result",
    "Stmt",
    "Tol",
    "compare",
    "compare_results",
    "describe_error",
    "generate",
    "repro_script",
    "run_eager",
    "run_programs",
    "shrink",
]

nan, inf = float("nan"), float("inf")

# ---------------------------------------------------------------------------------------------------------
# The error budget of each ATen op


@dataclasses.dataclass(frozen=True)
class Tol:
    """One ATen op's error budget. Each field is ``const + per_n * n``, n the number of terms behind each output
    element (the reduced elements, a matrix product's inner size, a pooling window): see ``_terms``.

    out: ULPs of each floating output. inp: ULPs of each floating operand element (what any summation order
    costs per term). abs: absolute error, in units of the dtype's epsilon. abs_x: absolute error in units of
    epsilon times |first operand|. abs_out_n: absolute error in units of epsilon times the largest magnitude of
    the output, per term (an FFT's error is of the whole signal's size, eps log(n) ||x||, not of each element's).
    """

    out: float = 0.0
    out_n: float = 0.0
    inp: float = 0.0
    inp_n: float = 0.0
    abs: float = 0.0
    abs_n: float = 0.0
    abs_x: float = 0.0
    abs_out_n: float = 0.0  # absolute, in units of epsilon times the output's largest magnitude, per term (FFTs)

    def at(self, n: int) -> tuple[float, float, float, float]:
        """(output ULPs, operand ULPs, absolute epsilons, epsilons of |x|) for n terms."""
        return self.out + self.out_n * n, self.inp + self.inp_n * n, self.abs + self.abs_n * n, self.abs_x


EXACT = Tol()

# ATen op (overload packet name) -> budget; an op not listed is exact. Exact: IEEE + - * / are correctly
# rounded on both sides (reciprocal is 1 / x), and the rest (neg, abs, relu, maximum, minimum,
# clamp, where, masked_fill, floor, round, sign, amax, amin, max pooling and its backward, indexing, cat,
# views) select or move values without rounding.
TOLERANCES: dict[str, Tol] = {}


def _budget(tol: Tol, *ops: str) -> None:
    for name in ops:
        assert name not in TOLERANCES, name
        TOLERANCES[name] = tol


_budget(Tol(out=4), "exp", "log", "log1p", "tanh", "sigmoid", "pow", "erf", "expm1")
_budget(Tol(out=2), "rsqrt")  # 1 / sqrt(x): two roundings
_budget(Tol(out=1), "sqrt")  # eager's vectorized float32 sqrt is not correctly rounded (AVX2: 1 ULP off)
_budget(Tol(out=5), "silu")  # x * sigmoid(x)
_budget(Tol(out=4, abs_x=4), "gelu")  # x/2 (1 + erf(x/sqrt 2)): 1 + erf cancels for x < 0
_budget(Tol(out=3), "tanh_backward", "sigmoid_backward")  # g (1 - y^2), g (1 - y) y
_budget(Tol(out=8), "silu_backward")
_budget(Tol(out=8), "gelu_backward")  # and an absolute term, in Noise.budget
_budget(Tol(inp_n=1), "sum")  # any order of n terms: within n - 1 ULPs of each term
_budget(Tol(inp_n=1, out=1), "mean")
_budget(Tol(out_n=1), "prod", "cumprod")  # a product of n terms in any order: n - 1 roundings
_budget(Tol(inp_n=1, out=2, out_n=1), "var")  # the mean's terms, then a sum of n squares
_budget(Tol(inp_n=1, out=3, out_n=1), "std")
# max + log(sum exp(x - max)): the sum's relative error (n terms, each exp 4 ULPs) is the log's absolute error
_budget(Tol(out=2, abs=4, abs_n=2), "logsumexp")
_budget(Tol(out=6, out_n=2), "_softmax")  # exp, an all-positive sum, a division
_budget(Tol(inp=1, out=1, abs=4, abs_n=2), "_log_softmax")
_budget(Tol(inp_n=1, out=1), "mm", "bmm", "addmm")  # n = inner size; out: the bias
# sums of n terms (see _terms), zero sums' signs by the summation's start (ONNX Runtime's GEMM starts from +0)
_budget(Tol(inp_n=1, out=1), "convolution", "convolution_backward")
_budget(Tol(inp_n=1, out=1), "avg_pool2d", "avg_pool2d_backward", "_adaptive_avg_pool2d",
        "_adaptive_avg_pool2d_backward")
_budget(Tol(inp_n=1), "index_add", "scatter_add")  # n = how many sources one element can receive
# the weighted sum of n rows' picked values, the sum of their weights, a division; the gradient: -w / total
_budget(Tol(inp_n=1, out=2), "nll_loss_forward")
_budget(Tol(out=2), "nll_loss_backward")
# (x - mean) / sqrt(var + eps) * w + b: the statistics' terms, then a few roundings. Their backward ops are
# decomposed into noisy primitives (_DECOMPOSED).
# Any FFT of n terms: within eps * log2(n) * ||x||_2 (scaled as the output), at most eps * n * max|output|.
_budget(Tol(abs_out_n=1), "_fft_r2c", "_fft_c2c", "_fft_c2r")
_budget(Tol(inp_n=2, out=8), "native_layer_norm", "native_batch_norm", "_native_batch_norm_legit",
        "_native_batch_norm_legit_functional", "native_group_norm")

_COMPLEX_ABS = Tol(out=2)
# c10::complex's scaled division: a ratio, a product-sum and a reciprocal per part, which ATen's kernels may round
# with fused multiply-adds (measured 1 ULP apart in complex128)
_COMPLEX_DIV = Tol(out=4)

NOISE_SAMPLES = 4
SAFETY = 4.0  # compiled may be this many times the noisy runs' spread away from eager
GRAD_SHARED = 1 / 16  # a gradient element may be off by SAFETY * this * the largest spread in its tensor


# ---------------------------------------------------------------------------------------------------------
# Programs


@dataclasses.dataclass(frozen=True)
class Stmt:
    """``out = expr.format(*args)``: ``args`` are variable names, the rest of ``expr`` is literal."""

    out: str
    op: str
    expr: str
    args: tuple[str, ...]

    def code(self) -> str:
        return f"{self.out} = {self.expr.format(*self.args)}"


@dataclasses.dataclass
class Program:
    seed: int
    dtype: torch.dtype
    inputs: list[torch.Tensor]  # x0, x1, ...
    stmts: list[Stmt]
    outputs: list[str]
    finite: bool  # every input finite and ordinary: gradients are compared

    @property
    def input_names(self) -> list[str]:
        return [f"x{i}" for i in range(len(self.inputs))]

    def dtype_of(self, name: str) -> torch.dtype | None:
        """The dtype of a variable (every variable is of the program's dtype), None for a name that is none."""
        names = set(self.input_names) | {s.out for s in self.stmts}
        return self.dtype if name in names else None

    @property
    def ops(self) -> list[str]:
        return [s.op for s in self.stmts]

    def source(self, name: str = "program") -> str:
        lines = [f"def {name}({', '.join(self.input_names)}):"]
        lines += [f"    {s.code()}" for s in self.stmts]
        lines.append(f"    return ({', '.join(self.outputs)},)")
        return "\n".join(lines) + "\n"

    def function(self, name: str = "program") -> Callable:
        namespace = _namespace()
        exec(compile(self.source(name), f"<program {self.seed}>", "exec"), namespace)
        return namespace[name]

    @classmethod
    def parse(cls, seed: int, code: str, inputs: Sequence[torch.Tensor], *, finite: bool | None = None) -> Program:
        """A hand-written program: ``code`` is lines ``name = expression`` over x0, x1, ... and earlier names; the
        last line's name is the output (``return a, b`` names several)."""
        names = {f"x{i}" for i in range(len(inputs))}
        stmts, outputs = [], []
        for line in textwrap.dedent(code).strip().splitlines():
            if line.startswith("return "):
                outputs = [o.strip() for o in line[len("return ") :].split(",") if o.strip()]
                continue
            out, expr = (part.strip() for part in line.split("=", 1))
            args = list(dict.fromkeys(a for a in re.findall(r"\b[a-z_]\w*\b", expr) if a in names))
            expr = expr.replace("{", "{{").replace("}", "}}")
            for i, a in enumerate(args):
                expr = re.sub(rf"\b{a}\b", f"{{{i}}}", expr)
            stmts.append(Stmt(out, "handwritten", expr, tuple(args)))
            names.add(out)
        outputs = outputs or [stmts[-1].out]
        dtype = inputs[0].dtype
        if finite is None:
            finite = all(bool(torch.isfinite(x).all()) for x in inputs)
        return cls(seed, dtype, list(inputs), stmts, outputs, finite)

    def cotangents(self, outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The fixed random cotangent of each output: backward of sum(output * cotangent)."""
        g = torch.Generator().manual_seed(1_000_003 + self.seed)
        return [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype) for o in outputs]

    def prune(self) -> Program:
        """The program without statements that no output depends on."""
        live = set(self.outputs)
        kept = []
        for s in reversed(self.stmts):
            if s.out in live:
                kept.append(s)
                live.update(s.args)
        return dataclasses.replace(self, stmts=kept[::-1])


def _namespace() -> dict[str, Any]:
    return {"torch": torch, "F": F, "nan": nan, "inf": inf}


# ---------------------------------------------------------------------------------------------------------
# Generation

_DENORMAL = {torch.float32: 1e-40, torch.float64: 1e-310}
_ORDINARY_CONSTANTS = (0.5, 2.0, -3.0, 0.1, 1.5, 10.0, -1.0, 1.0, 0.25, -0.7, 3.0)
_NEAR_ZERO = (0.0, -0.0, 1e-12, -1e-12, 1e-9, -1e-9, 1e-8, 1e-7, -1e-7, 1e-6, -1e-6)
_NEAR_ONE = (1 + 1e-7, 1 - 1e-7, 1 + 1e-6, 1 - 1e-6, 1 + 1e-5, 1 - 1e-5, 1 + 1e-4, 1 - 1e-4)
_HUGE = (1e30, -1e30, 3e38, -3e38)
_MAX_NUMEL = 256
_FINITE_SHARE = 0.4  # programs whose inputs are finite and ordinary: gradients are compared


def _fmt(value: float) -> str:
    return repr(float(value))  # exact: a float's repr reads back to the same double; nan, inf, -inf by name


class _Gen:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.dtype = torch.float32 if self.rng.random() < 0.7 else torch.float64
        self.finite = self.rng.random() < _FINITE_SHARE
        self.env: dict[str, torch.Tensor] = {}
        self.pool: list[str] = []
        self.stmts: list[Stmt] = []

    # -- values --------------------------------------------------------------------------------------

    def constant(self, finite: bool | None = None) -> float:
        rng = self.rng
        finite = self.finite if finite is None else finite
        r = rng.random()
        if r < 0.45:
            return rng.choice(_ORDINARY_CONSTANTS)
        if r < 0.65:
            return rng.choice(_NEAR_ZERO)
        if r < 0.82:
            return rng.choice(_NEAR_ONE)
        if r < 0.9:
            return rng.choice(_HUGE)
        if r < 0.95 or finite:
            return rng.choice((1.0, -1.0)) * _DENORMAL[self.dtype]
        return rng.choice((nan, inf, -inf))

    def input_tensor(self, shape: tuple[int, ...]) -> torch.Tensor:
        rng = self.rng
        scale = rng.choice((1.0, 1.0, 10.0, 1e-3, 100.0))
        offset = rng.choice((0.0, 0.0, 0.0, 1.0, -50.0))
        numel = math.prod(shape)
        values = [offset + scale * rng.gauss(0.0, 1.0) for _ in range(numel)]
        if not self.finite:
            specials = [nan, inf, -inf, -0.0, 0.0, _DENORMAL[self.dtype], -_DENORMAL[self.dtype], 1e30, -1e30,
                        3e38, 1e-12, 1 + 1e-7, 1.0, -1.0, 2.0]
            share = rng.choice((0.1, 0.25, 0.5))
            for i in range(numel):
                if rng.random() < share:
                    values[i] = rng.choice(specials)
        return torch.tensor(values, dtype=torch.float64).to(self.dtype).reshape(shape)

    # -- the pool of variables -----------------------------------------------------------------------

    def pick(self, exclude: str | None = None) -> str:
        names = [n for n in self.pool if n != exclude] or self.pool
        if self.rng.random() < 0.5:
            return names[-1]
        return self.rng.choice(names)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.env[name].shape)

    def pick_broadcastable(self, a: str) -> str:
        candidates = [n for n in self.pool if _broadcasts(self.shape(a), self.shape(n))]
        return self.rng.choice(candidates)  # a itself always qualifies

    def try_add(self, op: str, expr: str, args: Sequence[str]) -> bool:
        name = f"v{len(self.stmts)}"
        stmt = Stmt(name, op, expr, tuple(args))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                value = eval(expr.format(*args), _namespace(), dict(self.env))
        except Exception:
            return False
        if not isinstance(value, torch.Tensor) or value.dtype != self.dtype or value.numel() == 0:
            return False
        if value.numel() > _MAX_NUMEL:
            return False
        if self.finite and not torch.isfinite(value).all() and self.rng.random() < 0.9:
            return False
        self.env[name] = value
        self.pool.append(name)
        self.stmts.append(stmt)
        return True


def _broadcasts(a: Sequence[int], b: Sequence[int]) -> bool:
    try:
        return tuple(torch.broadcast_shapes(tuple(a), tuple(b))) == tuple(a)
    except RuntimeError:
        return False


def _dims(g: _Gen, rank: int) -> tuple[int, ...]:
    k = g.rng.randint(1, rank)
    return tuple(sorted(g.rng.sample(range(rank), k)))


def _dim_arg(dims: tuple[int, ...]) -> str:
    return str(dims[0]) if len(dims) == 1 else str(dims)


# -- op families ---------------------------------------------------------------------------------------

_UNARY = {
    "exp": "torch.exp({0})", "log": "torch.log({0})", "log1p": "torch.log1p({0})", "sqrt": "torch.sqrt({0})",
    "rsqrt": "torch.rsqrt({0})", "tanh": "torch.tanh({0})", "sigmoid": "torch.sigmoid({0})",
    "relu": "torch.relu({0})", "silu": "F.silu({0})", "abs": "torch.abs({0})", "neg": "torch.neg({0})",
    "reciprocal": "torch.reciprocal({0})", "floor": "torch.floor({0})", "round": "torch.round({0})",
}
_DOMAIN_SAFE = {"log", "sqrt", "rsqrt", "log1p", "reciprocal"}  # finite programs feed these |x| + 0.5


def _gen_unary(g: _Gen) -> bool:
    op = g.rng.choice([*_UNARY, "gelu", "sign"])
    a = g.pick()
    if op == "gelu":
        approximate = g.rng.choice(("none", "none", "tanh"))
        expr = "F.gelu({0})" if approximate == "none" else "F.gelu({0}, approximate='tanh')"
    elif op == "sign":
        expr = "torch.sign({0})"
    else:
        expr = _UNARY[op]
    if g.finite and op in _DOMAIN_SAFE and (g.env[a] <= 0).any():
        return g.try_add("add", "torch.abs({0}) + 0.5", [a]) and g.try_add(op, expr, [g.pool[-1]])
    return g.try_add(op, expr, [a])


_BINARY = {"add": "+", "sub": "-", "mul": "*", "div": "/"}


def _gen_binary(g: _Gen) -> bool:
    rng = g.rng
    op = rng.choice(["add", "sub", "mul", "div", "add", "mul", "maximum", "minimum", "pow"])
    a = g.pick()
    form = rng.random()
    if op in ("maximum", "minimum"):
        b = g.pick_broadcastable(a)
        return g.try_add(op, f"torch.{op}({{0}}, {{1}})", [a, b])
    if op == "pow":
        if form < 0.6:
            e = rng.choice((2.0, 3.0, 0.5, -1.0, -0.5, 1.5, 0.0, -2.0, 1 / 3, 2.5))
            if g.finite and e != int(e) and (g.env[a] < 0).any():
                return g.try_add("abs", "torch.abs({0})", [a]) and g.try_add("pow", f"torch.pow({{0}}, {_fmt(e)})",
                                                                          [g.pool[-1]])
            return g.try_add("pow", f"torch.pow({{0}}, {_fmt(e)})", [a])
        if form < 0.8:
            base = rng.choice((2.0, 0.5, 10.0, -2.0, 0.0, 1.0 + 1e-6))
            return g.try_add("pow", f"torch.pow({_fmt(base)}, {{0}})", [a])
        b = g.pick_broadcastable(a)
        return g.try_add("pow", "torch.pow({0}, {1})", [a, b])
    sym = _BINARY[op]
    if form < 0.4:
        b = g.pick_broadcastable(a)
        return g.try_add(op, f"{{0}} {sym} {{1}}", [a, b])
    if form < 0.8:
        c = g.constant()
        return g.try_add(op, f"{{0}} {sym} {_fmt(c)}", [a])
    c = g.constant()
    return g.try_add(op, f"{_fmt(c)} {sym} {{0}}", [a])


def _gen_clamp(g: _Gen) -> bool:
    a = g.pick()
    lo, hi = g.constant(), g.constant()
    which = g.rng.random()
    if which < 0.33:
        return g.try_add("clamp", f"torch.clamp({{0}}, min={_fmt(lo)})", [a])
    if which < 0.66:
        return g.try_add("clamp", f"torch.clamp({{0}}, max={_fmt(hi)})", [a])
    return g.try_add("clamp", f"torch.clamp({{0}}, {_fmt(lo)}, {_fmt(hi)})", [a])


_COMPARISONS = (">", "<", ">=", "<=", "==", "!=")


def _condition(g: _Gen, a: str) -> tuple[str, list[str]]:
    """A boolean expression of ``{0}`` (= a), maybe of a second variable ``{1}``: (expr, extra args)."""
    cmp = g.rng.choice(_COMPARISONS)
    r = g.rng.random()
    if r < 0.15:
        return "torch.isnan({0})", []
    if r < 0.55:
        b = g.pick_broadcastable(a)
        return f"({{0}} {cmp} {{1}})", [b]
    return f"({{0}} {cmp} {_fmt(g.constant())})", []


def _gen_where(g: _Gen) -> bool:
    a = g.pick()
    cond, extra = _condition(g, a)
    args = [a, *extra]
    x = g.pick_broadcastable(a)
    nx = len(args)
    args.append(x)
    if g.rng.random() < 0.6:
        y = g.pick_broadcastable(a)
        args.append(y)
        return g.try_add("where", f"torch.where({cond}, {{{nx}}}, {{{nx + 1}}})", args)
    return g.try_add("where", f"torch.where({cond}, {{{nx}}}, {_fmt(g.constant())})", args)


def _gen_masked_fill(g: _Gen) -> bool:
    a = g.pick()
    m = g.pick_broadcastable(a)
    cond, extra = _condition(g, m)
    # renumber: {0} is a, the condition's {0} and {1} become {1} and {2}
    cond = cond.replace("{1}", "{2}").replace("{0}", "{1}")
    return g.try_add("masked_fill", f"{{0}}.masked_fill({cond}, {_fmt(g.constant())})", [a, m, *extra])


def _gen_reduction(g: _Gen) -> bool:
    rng = g.rng
    op = rng.choice(["sum", "mean", "amax", "amin", "var", "std", "logsumexp", "softmax", "log_softmax", "prod"])
    a = g.pick()
    shape = g.shape(a)
    rank = len(shape)
    keep = rng.random() < 0.4
    if op in ("softmax", "log_softmax", "prod"):
        d = rng.randrange(rank)
        if op == "prod":
            return g.try_add(op, f"torch.prod({{0}}, dim={d}, keepdim={keep})", [a])
        return g.try_add(op, f"torch.{op}({{0}}, dim={d})", [a])
    dims = _dims(g, rank)
    if op in ("sum", "mean") and rng.random() < 0.2:
        return g.try_add(op, f"torch.{op}({{0}})", [a])
    if op in ("var", "std"):
        correction = rng.choice((0, 1))
        return g.try_add(op, f"torch.{op}({{0}}, dim={_dim_arg(dims)}, correction={correction}, keepdim={keep})",
                         [a])
    return g.try_add(op, f"torch.{op}({{0}}, dim={_dim_arg(dims)}, keepdim={keep})", [a])


def _common_divisors(a: int, b: int) -> list[int]:
    return [k for k in range(1, min(a, b, 16) + 1) if a % k == 0 and b % k == 0]


def _gen_matmul(g: _Gen) -> bool:
    rng = g.rng
    a, b = g.pick(), g.pick()
    na, nb = g.env[a].numel(), g.env[b].numel()
    op = rng.choice(["mm", "bmm", "linear"])
    if op == "bmm":
        batches = [k for k in _common_divisors(na, nb) if k <= 4]
        bsz = rng.choice(batches)
        ks = _common_divisors(na // bsz, nb // bsz)
        k = rng.choice(ks)
        return g.try_add("bmm", f"torch.bmm({{0}}.reshape({bsz}, -1, {k}), {{1}}.reshape({bsz}, {k}, -1))", [a, b])
    k = rng.choice(_common_divisors(na, nb))
    if op == "mm":
        return g.try_add("mm", f"torch.mm({{0}}.reshape(-1, {k}), {{1}}.reshape({k}, -1))", [a, b])
    out_features = nb // k
    c = g.pick()
    if rng.random() < 0.5 and g.env[c].numel() >= out_features:
        return g.try_add("linear", f"F.linear({{0}}.reshape(-1, {k}), {{1}}.reshape(-1, {k}), "
                                   f"{{2}}.reshape(-1)[:{out_features}])", [a, b, c])
    return g.try_add("linear", f"F.linear({{0}}.reshape(-1, {k}), {{1}}.reshape(-1, {k}))", [a, b])


def _literal(values: Any) -> str:
    return f"torch.tensor({values!r})"


def _gen_indexing(g: _Gen) -> bool:
    rng = g.rng
    op = rng.choice(["index_select", "gather", "slice", "slice", "cat", "stack"])
    a = g.pick()
    shape = g.shape(a)
    rank = len(shape)
    d = rng.randrange(rank)
    if op == "index_select":
        index = [rng.randrange(shape[d]) for _ in range(rng.randint(1, 4))]
        return g.try_add(op, f"torch.index_select({{0}}, {d}, {_literal(index)})", [a])
    if op == "gather":
        ishape = [rng.randint(1, s) for s in shape]
        ishape[d] = rng.randint(1, 4)
        index = torch.randint(0, shape[d], ishape, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
        return g.try_add(op, f"torch.gather({{0}}, {d}, {_literal(index.tolist())})", [a])
    if op == "slice":
        parts = []
        for s in shape:
            r = rng.random()
            if r < 0.4 or s == 1:
                parts.append(":")
            elif r < 0.6:
                parts.append(f"{rng.randrange(1, s)}:")
            elif r < 0.75:
                parts.append(f"::{rng.choice((2, 3))}")
            elif r < 0.9:
                parts.append(f"-{rng.randint(1, s)}:")
            else:
                parts.append(str(rng.randrange(s)))  # an integer index drops the dim
        return g.try_add(op, f"{{0}}[{', '.join(parts)}]", [a])
    same = [n for n in g.pool if g.shape(n) == shape]
    if op == "stack":
        b = rng.choice(same)
        return g.try_add(op, f"torch.stack([{{0}}, {{1}}], dim={rng.randint(-rank - 1, rank)})", [a, b])
    fits = [n for n in g.pool if len(g.shape(n)) == rank and all(
        x == y for i, (x, y) in enumerate(zip(shape, g.shape(n))) if i != d)]
    b = rng.choice(fits)
    return g.try_add(op, f"torch.cat([{{0}}, {{1}}], dim={d})", [a, b])


def _as_nchw(shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    if len(shape) >= 4:
        lead = math.prod(shape[:-3])
        new = (lead, *shape[-3:]) if len(shape) > 4 else shape
    elif len(shape) == 3:
        new = (1, *shape)
    elif len(shape) == 2:
        new = (1, 1, *shape)
    else:
        new = (1, 1, 1, shape[0])
    return (f".reshape{tuple(new)}" if tuple(new) != tuple(shape) else ""), tuple(new)


def _gen_pool(g: _Gen) -> bool:
    rng = g.rng
    op = rng.choice(["max_pool1d", "max_pool2d", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d"])
    a = g.pick()
    k = rng.choice((2, 3))
    stride = rng.choice((1, 2, None))
    padding = rng.choice((0, 0, 1))
    ceil = rng.random() < 0.3
    if op == "max_pool1d":
        shape = g.shape(a)
        reshape = "" if len(shape) == 3 else f".reshape(1, -1, {shape[-1]})"
        dilation = rng.choice((1, 1, 2))
        return g.try_add(op, f"F.max_pool1d({{0}}{reshape}, {k}, stride={stride}, padding={padding}, "
                             f"dilation={dilation}, ceil_mode={ceil})", [a])
    reshape, shape = _as_nchw(g.shape(a))
    if op == "max_pool2d":
        dilation = rng.choice((1, 1, 2))
        return g.try_add(op, f"F.max_pool2d({{0}}{reshape}, {k}, stride={stride}, padding={padding}, "
                             f"dilation={dilation}, ceil_mode={ceil})", [a])
    if op == "avg_pool2d":
        include = rng.random() < 0.5
        divisor = rng.choice((None, None, None, 3))
        return g.try_add(op, f"F.avg_pool2d({{0}}{reshape}, {k}, stride={stride}, padding={padding}, "
                             f"ceil_mode={ceil}, count_include_pad={include}, divisor_override={divisor})",
                         [a])
    oh, ow = rng.randint(1, shape[-2]), rng.randint(1, shape[-1])
    return g.try_add(op, f"F.adaptive_avg_pool2d({{0}}{reshape}, ({oh}, {ow}))", [a])


def _gen_conv(g: _Gen) -> bool:
    """A 2-D convolution of a tensor seen as NCHW, its weight (and bias) cut from other values: ungrouped or
    depthwise, strided, padded, kernels 1-3 (programs of ``generate(convolutions=True)``)."""
    rng = g.rng
    a = g.pick()
    reshape, (n, c, h, w) = _as_nchw(g.shape(a))
    k = rng.choice((1, 2, 3, 3))
    stride, padding = rng.choice((1, 1, 2)), rng.choice((0, 1, 1))
    if h + 2 * padding < k or w + 2 * padding < k:
        return False
    groups = c if c > 1 and rng.random() < 0.3 else 1
    out_channels = groups * rng.choice((1, 2, 3))
    need = out_channels * (c // groups) * k * k
    weights = [m for m in g.pool if g.env[m].numel() >= need]
    if not weights:
        return False
    b = rng.choice(weights)
    # Finite values only: ONNX Runtime's convolution multiplies the padding's zeros by the weights (im2col), where
    # eager's skips them, so an infinite weight makes NaN there (README, exactness: not emulated).
    if not (torch.isfinite(g.env[a]).all() and torch.isfinite(g.env[b].reshape(-1)[:need]).all()):
        return False
    weight = f"{{1}}.reshape(-1)[:{need}].reshape({out_channels}, {c // groups}, {k}, {k})"
    biases = [m for m in g.pool if g.env[m].numel() >= out_channels]
    if rng.random() < 0.5:
        bias = rng.choice(biases)
        return g.try_add("conv2d", f"F.conv2d({{0}}{reshape}, {weight}, {{2}}.reshape(-1)[:{out_channels}], "
                                   f"stride={stride}, padding={padding}, groups={groups})", [a, b, bias])
    return g.try_add("conv2d", f"F.conv2d({{0}}{reshape}, {weight}, stride={stride}, padding={padding}, "
                               f"groups={groups})", [a, b])


def _affine(g: _Gen, size: int) -> tuple[str, str, list[str]]:
    """(weight, bias) expressions over extra args {1}, {2} for an affine of ``size`` elements, or None."""
    pool = [n for n in g.pool if g.env[n].numel() >= size]
    if not pool or g.rng.random() < 0.4:
        return "None", "None", []
    w = g.rng.choice(pool)
    b = g.rng.choice(pool)
    return f"{{1}}.reshape(-1)[:{size}]", f"{{2}}.reshape(-1)[:{size}]", [w, b]


def _gen_norm(g: _Gen) -> bool:
    rng = g.rng
    op = rng.choice(["layer_norm", "batch_norm", "group_norm"])
    a = g.pick()
    shape = g.shape(a)
    eps = rng.choice((1e-5, 1e-5, 1e-3, 1e-6, 0.0 if not g.finite else 1e-5))
    if op == "layer_norm":
        d = rng.randint(1, min(2, len(shape)))
        normalized = shape[-d:]
        size = math.prod(normalized)
        w, b, extra = _affine(g, size)
        if extra:
            w, b = f"{w}.reshape{tuple(normalized)}", f"{b}.reshape{tuple(normalized)}"
        return g.try_add(op, f"F.layer_norm({{0}}, {tuple(normalized)}, {w}, {b}, eps={_fmt(eps)})", [a, *extra])
    if len(shape) < 2:
        return False
    channels = shape[1]
    w, b, extra = _affine(g, channels)
    if op == "batch_norm":
        return g.try_add(op, f"F.batch_norm({{0}}, None, None, {w}, {b}, training=True, eps={_fmt(eps)})",
                         [a, *extra])
    groups = rng.choice([k for k in range(1, channels + 1) if channels % k == 0])
    return g.try_add(op, f"F.group_norm({{0}}, {groups}, {w}, {b}, eps={_fmt(eps)})", [a, *extra])


def _gen_loss(g: _Gen) -> bool:
    """A classification loss of a tensor seen as [N, C] (its last dim the classes): cross_entropy (log_softmax and
    nll_loss) or nll_loss itself, targets drawn among the classes with some ignored, class weights cut from another
    value or none, each reduction (programs of ``generate(losses=True)``)."""
    rng = g.rng
    a = g.pick()
    shape = g.shape(a)
    classes = shape[-1]
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    if classes < 2:
        return False
    targets = [rng.randrange(classes) for _ in range(rows)]
    ignore = rng.randrange(classes) if rng.random() < 0.4 else -100
    op = rng.choice(["cross_entropy", "nll_loss"])
    reduction = rng.choice(["mean", "sum", "none"])
    weights = [n for n in g.pool if g.env[n].numel() >= classes]
    extra, weight = [], "None"
    if weights and rng.random() < 0.5:
        extra, weight = [rng.choice(weights)], f"{{1}}.reshape(-1)[:{classes}].detach()"  # weights take no gradient
    return g.try_add(op, f"F.{op}({{0}}.reshape(-1, {classes}), {_literal(targets)}, weight={weight}, "
                         f"ignore_index={ignore}, reduction={reduction!r})", [a, *extra])


_NORMS = ("backward", "forward", "ortho")
# An FFT's rounding error is of the size of the whole signal, and the order of its sums is not eager's: a signal
# with an infinity, a NaN or a value near overflow would give NaN or inf in another pattern. Complex
# statements take finite operands of moderate size.
_SPECTRAL_LIMIT = 1e15


def _gen_spectral(g: _Gen) -> bool:
    """A statement through complex values, real in and out: FFTs (fft, rfft, irfft, hfft; a circular
    convolution), complex products, sums and magnitudes."""
    rng = g.rng
    a = g.pick()
    x = g.env[a]
    if x.dim() == 0 or not torch.isfinite(x).all() or x.abs().max() > _SPECTRAL_LIMIT:
        return False
    d = rng.randrange(x.dim())
    norm = rng.choice(_NORMS)
    size = x.shape[d]
    n = rng.choice((size, size, size + 1, max(1, size - 1), 2 * size))
    form = rng.random()
    if form < 0.25:
        return g.try_add("fft", f"torch.fft.fft({{0}}, n={n}, dim={d}, norm={norm!r}).abs()", [a])
    if form < 0.45:
        return g.try_add("rfft", f"torch.view_as_real(torch.fft.rfft({{0}}, n={n}, dim={d}, norm={norm!r}))"
                                 f".sum(-1)", [a])
    if form < 0.65:
        # the real signal of a (scaled) one-sided spectrum, n its length
        c = rng.choice((0.5, 2.0, -1.0))
        return g.try_add("irfft", f"torch.fft.irfft(torch.fft.rfft({{0}}, dim={d}, norm={norm!r}) * {_fmt(c)}, "
                                  f"n={n}, dim={d}, norm={norm!r})", [a])
    if form < 0.75:
        return g.try_add("hfft", f"torch.fft.hfft(torch.complex({{0}}, {{0}} * 0.5), n={n}, dim={d}, norm={norm!r})",
                         [a])
    b = g.pick_broadcastable(a)
    y = g.env[b]
    if not torch.isfinite(y).all() or y.abs().max() > _SPECTRAL_LIMIT:
        return False
    if form < 0.83:
        # circular convolution of a and b along d
        return g.try_add("rfft", f"torch.fft.irfft(torch.fft.rfft({{0}}, dim={d}, norm={norm!r}) * "
                                 f"torch.fft.rfft({{1}}.expand_as({{0}}), dim={d}, norm={norm!r}), n={size}, dim={d}, "
                                 f"norm={norm!r})", [a, b])
    part = rng.choice(("real", "imag"))
    if form < 0.95:
        # a complex quotient (ATen's scaled division; a zero divisor gives a complex infinity or NaN)
        return g.try_add("complex", f"(torch.complex({{0}}, {{1}}.expand_as({{0}})) / torch.complex({{1}}.expand_as({{0}}), "
                                f"{{0}} * 0.5)).{part}", [a, b])
    return g.try_add("complex", f"(torch.complex({{0}}, {{1}}.expand_as({{0}})) * torch.complex({{1}}.expand_as({{0}}), "
                            f"{{0}}) + torch.complex({{0}}, {{0}})).{part}", [a, b])


_FAMILIES: tuple[tuple[Callable[[_Gen], bool], float], ...] = (
    (_gen_unary, 4.0),
    (_gen_binary, 4.0),
    (_gen_clamp, 0.7),
    (_gen_where, 0.8),
    (_gen_masked_fill, 0.5),
    (_gen_reduction, 3.0),
    (_gen_matmul, 1.2),
    (_gen_indexing, 2.0),
    (_gen_pool, 1.0),
    (_gen_norm, 1.0),
)


def _input_shapes(g: _Gen) -> list[tuple[int, ...]]:
    rng = g.rng
    rank = rng.choice((1, 2, 2, 3, 3, 4))
    base = tuple(rng.randint(1, 5) for _ in range(rank))
    while math.prod(base) > 96:
        base = tuple(max(1, s - 1) for s in base)
    shapes = [base]
    for _ in range(rng.choice((0, 1, 1, 2)) ):
        r = rng.random()
        if r < 0.5:
            shapes.append(base)
        elif r < 0.8:  # broadcastable: some dims 1
            shapes.append(tuple(1 if rng.random() < 0.5 else s for s in base))
        else:  # trailing dims only
            shapes.append(base[rng.randrange(rank):])
    return shapes


# Complex programs: the families above and statements through complex values (generate(seed, spectral=True)).
# A family list of its own, so that adding it changes no other seed's program.
_SPECTRAL_FAMILIES = (*_FAMILIES, (_gen_spectral, 6.0))
_CONV_FAMILIES = (*_FAMILIES, (_gen_conv, 14.0))
_LOSS_FAMILIES = (*_FAMILIES, (_gen_loss, 10.0))


def generate(seed: int, *, spectral: bool = False, convolutions: bool = False, losses: bool = False) -> Program:
    """The program of ``seed``: the same program, inputs and constants for the same seed. ``spectral``: with
    statements through complex values (FFTs, complex products), each real in and out; ``convolutions``: with
    2-D convolutions; ``losses``: with classification losses (cross_entropy, nll_loss)."""
    g = _Gen(seed)
    inputs = [g.input_tensor(s) for s in _input_shapes(g)]
    for i, x in enumerate(inputs):
        g.env[f"x{i}"] = x
        g.pool.append(f"x{i}")
    length = g.rng.randint(3, 10)
    families, weights = zip(*(_SPECTRAL_FAMILIES if spectral else _CONV_FAMILIES if convolutions
                              else _LOSS_FAMILIES if losses else _FAMILIES))
    attempts = 0
    while len(g.stmts) < length and attempts < 200:
        attempts += 1
        family = g.rng.choices(families, weights)[0]
        with contextlib.suppress(IndexError, ValueError):  # a family that finds no operand here draws again
            family(g)
    last = g.stmts[-1].out if g.stmts else "x0"
    outputs = [last]
    others = [s.out for s in g.stmts[:-1]]
    if others and g.rng.random() < 0.5:
        outputs.insert(0, g.rng.choice(others))
    program = Program(seed, g.dtype, inputs, g.stmts, outputs, g.finite)
    return program.prune()


# ---------------------------------------------------------------------------------------------------------
# The noisy runs


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of floats at |x| (x's dtype): the smallest denormal at 0, finite at the largest float."""
    a = x.detach().abs()
    up = torch.nextafter(a, torch.full_like(a, inf)) - a
    down = a - torch.nextafter(a, torch.zeros_like(a))
    return torch.where(torch.isfinite(up), up, down)


_aten = torch.ops.aten
# Backward ops that are a formula over reductions: decomposed (torch._decomp) in the noisy runs, so that each
# of their sums carries its own budget and the cancellation after it shows in the spread.
_DECOMPOSED = {
    _aten.native_layer_norm_backward.default,
    _aten.native_batch_norm_backward.default,
    _aten.native_group_norm_backward.default,
    _aten._softmax_backward_data.default,
    _aten._log_softmax_backward_data.default,
}
_SUM_LIKE = {"sum", "mean", "var", "std", "prod", "logsumexp", "amax", "amin"}


def _terms(name: str, args: Sequence[Any], out: Any) -> int:
    """How many terms are behind each output element of ATen op ``name``."""
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    result = out[0] if isinstance(out, (tuple, list)) else out
    if first is None:
        return 1
    if name in _SUM_LIKE:
        return max(1, first.numel() // max(1, result.numel()))
    if name in ("_softmax", "_log_softmax", "cumprod"):
        return first.shape[args[1]] if first.dim() else 1
    if name in ("mm", "bmm"):
        return first.shape[-1]
    if name == "convolution":  # per output: in_channels / groups * kernel terms, and the bias
        return max(1, math.prod(args[1].shape[1:])) + 1
    if name == "convolution_backward":  # the input's gradient: out_channels * kernel; the weight's: N * output
        grad, weight = args[0], args[2]
        return max(1, grad.shape[0] * math.prod(grad.shape[2:]), weight.shape[0] * math.prod(weight.shape[2:]))
    if name == "addmm":
        return args[1].shape[-1]
    if name in ("avg_pool2d", "avg_pool2d_backward"):
        kernel = args[1] if name == "avg_pool2d" else args[2]
        return math.prod(kernel) if len(kernel) == 2 else kernel[0] ** 2
    if name in ("_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward"):
        big, small = (first, result) if name == "_adaptive_avg_pool2d" else (result, first)
        return (big.shape[-2] // small.shape[-2] + 1) * (big.shape[-1] // small.shape[-1] + 1)
    if name == "native_layer_norm":
        return math.prod(args[1])
    if name in ("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional"):
        return max(1, first.numel() // first.shape[1])
    if name == "native_group_norm":
        return max(1, first.numel() // (args[3] * args[6]))  # N, C, HxW, group
    if name in ("_fft_r2c", "_fft_c2c", "_fft_c2r"):
        sizes = [first.shape[d] for d in args[1]]
        if name == "_fft_c2r":
            sizes[-1] = args[3]  # the output's length along the last dim
        return max(1, math.prod(sizes))
    if name == "index_add":
        return int(torch.bincount(args[2]).max()) if args[2].numel() else 1
    if name == "nll_loss_forward":  # the rows summed
        return max(1, first.shape[0]) if first.dim() == 2 else 1
    if name == "scatter_add":
        return args[2].shape[args[1]] if args[2].dim() else 1
    return 1


class Noise(TorchDispatchMode):
    """One noisy run: every ATen op, forward and backward, has its result moved by its budget (whole ULPs,
    seeded random signs), and reductions their operands too. Autograd saves the moved results, so a backward
    formula that reads an output (tanh's 1 - y^2) sees the moved one."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(seed)
        # A zero result of an inexact op moves to +tiny in runs of even seed and -tiny in runs of odd seed, so
        # that two runs are enough to show that its sign (and 1 / it) is not determined.
        self.zero_sign = 1.0 if seed % 2 == 0 else -1.0

    def _signs(self, shape: torch.Size) -> torch.Tensor:
        return torch.randint(0, 2, tuple(shape), generator=self.gen).to(torch.float64) * 2 - 1

    def _move(self, y: Any, ulps: float, absolute: torch.Tensor | float | None = None) -> Any:
        if isinstance(y, torch.Tensor) and y.is_complex():  # each part by the budget
            return torch.view_as_complex(self._move(torch.view_as_real(y.resolve_conj()), ulps, absolute).contiguous())
        if not isinstance(y, torch.Tensor) or not y.is_floating_point() or not (ulps or absolute is not None):
            return y
        y64 = y.to(torch.float64)
        d = self._signs(y.shape) * ulps * _ulp(y).to(torch.float64)
        if absolute is not None:
            d = d + self._signs(y.shape) * absolute
        d = torch.where(y64 == 0, self.zero_sign * d.abs(), d)
        return torch.where(torch.isfinite(y64) & torch.isfinite(d), y64 + d, y64).to(y.dtype)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _DECOMPOSED:
            with self:
                return torch._decomp.decomposition_table[func](*args, **kwargs)
        name = func.overloadpacket.__name__
        tol = TOLERANCES.get(name)
        if name == "abs" and args and isinstance(args[0], torch.Tensor) and args[0].is_complex():
            tol = _COMPLEX_ABS  # a hypot: within ulps, where the real abs is exact
        elif name in ("div", "reciprocal") and any(isinstance(a, torch.Tensor) and a.is_complex() for a in args):
            tol = _COMPLEX_DIV
        if tol is None or name.endswith("_"):
            return func(*args, **kwargs)
        n = _terms(name, args, func(*args, **kwargs)) if tol.inp_n or tol.out_n or tol.abs_n or tol.abs_out_n else 1
        out_ulps, in_ulps, abs_eps, abs_x = tol.at(n)
        if in_ulps:
            args = [self._move(a, in_ulps) for a in args]
        out = func(*args, **kwargs)
        first = out[0] if isinstance(out, (tuple, list)) else out
        if not (first.is_floating_point() or first.is_complex()):
            return out
        eps = torch.finfo(first.dtype).eps
        absolute: Any = abs_eps * eps if abs_eps else None
        if tol.abs_out_n and first.numel():
            largest = (torch.view_as_real(first) if first.is_complex() else first).detach().abs().max()
            absolute = (absolute or 0.0) + tol.abs_out_n * n * eps * largest.to(torch.float64)
        if abs_x:
            absolute = (absolute or 0.0) + abs_x * eps * args[0].detach().abs().to(torch.float64)
        if name == "gelu_backward":  # 1 - tanh^2 and 1 + erf cancel: relative to |grad| (1 + |x| + |x|^3 / 5)
            x = args[1].detach().abs().to(torch.float64)
            absolute = 4 * eps * args[0].detach().abs().to(torch.float64) * (1 + x + x**3 / 5)
        if isinstance(out, (tuple, list)):
            return type(out)(self._move(o, out_ulps, absolute if i == 0 else None) for i, o in enumerate(out))
        return self._move(out, out_ulps, absolute)


# ---------------------------------------------------------------------------------------------------------
# Running and comparing


@dataclasses.dataclass
class Result:
    """What one side computed: outputs, and the gradients of the inputs when the program is finite."""

    outputs: list[torch.Tensor]
    grads: list[torch.Tensor] | None


def _inputs(program: Program, grad: bool) -> list[torch.Tensor]:
    return [x.clone().requires_grad_(grad) for x in program.inputs]


def _grads(program: Program, inputs: list[torch.Tensor], outputs: Sequence[torch.Tensor],
           cotangents: list[torch.Tensor]) -> list[torch.Tensor] | None:
    pairs = [(o, c) for o, c in zip(outputs, cotangents) if o.requires_grad]
    if not pairs:
        return [torch.zeros_like(x) for x in inputs]
    got = torch.autograd.grad([o for o, _ in pairs], inputs, [c for _, c in pairs], allow_unused=True)
    return [torch.zeros_like(x) if g is None else g.detach() for x, g in zip(inputs, got)]


def run_eager(program: Program, noise: Noise | None = None) -> Result:
    fn = program.function()
    inputs = _inputs(program, program.finite)
    with warnings.catch_warnings(), torch.enable_grad(), noise or contextlib.nullcontext():
        warnings.simplefilter("ignore")
        outputs = fn(*inputs)
        grads = None
        if program.finite:
            grads = _grads(program, inputs, outputs, program.cotangents(outputs))
    return Result([o.detach() for o in outputs], grads)


def _class(x: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 NaN, 2 +inf, 3 -inf."""
    c = torch.zeros(x.shape, dtype=torch.int8)
    c[torch.isnan(x)] = 1
    c[x == inf] = 2
    c[x == -inf] = 3
    return c


def _hex(x: float) -> str:
    return float(x).hex() if math.isfinite(x) else repr(x)


def compare(name: str, eager: torch.Tensor, compiled: torch.Tensor, noisy: Sequence[torch.Tensor],
            zero_sign: bool = True, shared: float = 0.0) -> str | None:
    """None where ``compiled`` agrees with ``eager`` (module docstring), else what differs. ``zero_sign``: a
    zero's sign must match where no noisy run changed it. ``shared``: every element may also be off by SAFETY
    times this fraction of the tensor's largest spread (a backward pass sums across elements: their rounding
    is shared, and a few noisy runs can miss it at one element)."""
    if compiled.shape != eager.shape or compiled.dtype != eager.dtype:
        return f"{name}: compiled {compiled.dtype}{list(compiled.shape)}, eager {eager.dtype}{list(eager.shape)}"
    e, c = eager.detach(), compiled.detach()
    ce, cc = _class(e), _class(c)
    unstable = torch.zeros(e.shape, dtype=torch.bool)
    spread = torch.zeros(e.shape, dtype=torch.float64)
    signs = torch.zeros(e.shape, dtype=torch.bool)  # the sign of zero varies across the noisy runs
    for n in noisy:
        unstable |= _class(n) != ce
        diff = (n.to(torch.float64) - e.to(torch.float64)).abs()
        spread = torch.maximum(spread, torch.where(torch.isfinite(diff), diff, torch.full_like(diff, inf)))
        signs |= (n == 0) & (e == 0) & (torch.signbit(n) != torch.signbit(e))
    finite_spread = spread[torch.isfinite(spread)]
    if shared and finite_spread.numel():
        spread = torch.maximum(spread, shared * finite_spread.max())
    class_bad = (ce != cc) & ~unstable
    finite = (ce == 0) & (cc == 0)
    err = (c.to(torch.float64) - e.to(torch.float64)).abs()
    value_bad = finite & (err > SAFETY * spread)
    sign_bad = finite & (e == 0) & (c == 0) & (torch.signbit(e) != torch.signbit(c)) & (spread == 0) & ~signs
    sign_bad &= zero_sign
    bad = class_bad | value_bad | sign_bad
    if not bad.any():
        return None
    where = bad.nonzero()
    lines = [f"{name}: {int(bad.sum())} of {e.numel()} elements differ "
             f"({int(class_bad.sum())} NaN/inf pattern, {int(value_bad.sum())} value, {int(sign_bad.sum())} sign "
             f"of zero)"]
    ulp = _ulp(e).to(torch.float64)
    for idx in where[:6].tolist():
        i = tuple(idx)
        ev, cv = float(e[i]), float(c[i])
        tol = SAFETY * float(spread[i])
        extra = f", {float(err[i] / ulp[i]):.3g} ULP, budget {tol:.3g}" if bool(finite[i]) else ""
        lines.append(f"  at {list(i)}: eager {ev!r} ({_hex(ev)}), compiled {cv!r} ({_hex(cv)}){extra}")
    return "\n".join(lines)


def compare_results(program: Program, eager: Result, compiled: Result, noisy: Sequence[Result]) -> list[str]:
    problems = []
    for i, e in enumerate(eager.outputs):
        p = compare(f"output {i} ({program.outputs[i]})", e, compiled.outputs[i], [n.outputs[i] for n in noisy])
        if p:
            problems.append(p)
    if eager.grads is not None and compiled.grads is not None:
        for i, e in enumerate(eager.grads):
            # a gradient's zero sign is not compared: autograd itself does not keep it (0 * -g is -0)
            p = compare(f"grad of x{i}", e, compiled.grads[i], [n.grads[i] for n in noisy], zero_sign=False,
                        shared=GRAD_SHARED)
            if p:
                problems.append(p)
    return problems


@dataclasses.dataclass
class Outcome:
    seed: int
    status: str  # pass, mismatch, refused, crash, eager-error
    detail: str = ""
    fell_back: bool = False

    @property
    def ok(self) -> bool:
        return self.status in ("pass", "refused", "eager-error")


def _unwrap(e: BaseException) -> BaseException:
    """The backend's own exception inside Dynamo's wrappers."""
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        inner = getattr(e, "inner_exception", None) or e.__cause__
        if inner is None or isinstance(e, _aot2onnx_error()):
            break
        e = inner
    return e


def _is_refusal(e: BaseException) -> bool:
    """A clear refusal: an op without a lowering, or a kernel ONNX Runtime does not have (float64 AveragePool,
    Erf, ...), each named with what to do. A lowering rule that raised, a model ONNX Runtime finds ill-typed or
    an exception from elsewhere is a crash."""
    from aot2onnx.errors import RuntimeSessionError, UnsupportedOpError

    if isinstance(e, UnsupportedOpError):
        return True
    return isinstance(e, RuntimeSessionError) and "NOT_IMPLEMENTED" in str(e)


def _aot2onnx_error() -> type:
    from aot2onnx.errors import Aot2OnnxError

    return Aot2OnnxError


def _batch_function(programs: Sequence[Program]) -> tuple[Callable, list[slice]]:
    namespace = _namespace()
    params, calls, spans = [], [], []
    start = 0
    for p in programs:
        namespace.update({f"p{p.seed}": p.function(f"p{p.seed}")})
        names = [f"a{p.seed}_{i}" for i in range(len(p.inputs))]
        params += names
        calls.append(f"*p{p.seed}({', '.join(names)})")
        spans.append(slice(start, start + len(p.outputs)))
        start += len(p.outputs)
    source = f"def batch({', '.join(params)}):\n    return ({', '.join(calls)},)\n"
    exec(compile(source, "<batch>", "exec"), namespace)
    return namespace["batch"], spans


def run_compiled(programs: Sequence[Program]) -> list[Result]:
    """Every program through one ``torch.compile(backend="aot2onnx")``: outputs, and gradients of the finite ones."""
    fn, spans = _batch_function(programs)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot2onnx")
    inputs = [_inputs(p, p.finite) for p in programs]
    with warnings.catch_warnings(), torch.enable_grad():
        warnings.simplefilter("ignore")
        flat = compiled(*(x for xs in inputs for x in xs))
        results = []
        outputs_needing_grad, cotangents, grad_inputs = [], [], []
        for p, xs, span in zip(programs, inputs, spans):
            outs = list(flat[span])
            results.append(Result([o.detach() for o in outs], None))
            if p.finite:
                # the same cotangents as eager's: they depend only on the seed and the output shapes
                for o, c in zip(outs, p.cotangents(outs)):
                    if o.requires_grad:
                        outputs_needing_grad.append(o)
                        cotangents.append(c)
                grad_inputs += xs
        if grad_inputs:
            if outputs_needing_grad:
                got = torch.autograd.grad(outputs_needing_grad, grad_inputs, cotangents, allow_unused=True)
            else:
                got = [None] * len(grad_inputs)
            got = iter(got)
            for p, xs, r in zip(programs, inputs, results):
                if p.finite:
                    r.grads = [torch.zeros_like(x) if (gx := next(got)) is None else gx.detach() for x in xs]
    torch._dynamo.reset()
    return results


def _fell_back() -> bool:
    from aot2onnx.compile.fallback import fallback_graphs

    return bool(fallback_graphs())


# Several programs share one compiled function (one Dynamo trace, one AOTAutograd capture, one ONNX model and
# session per graph): compiling is most of the cost, and a batch of 16 costs about 4 programs compiled alone.
# float64 batches are smaller: ONNX Runtime lacks double kernels for several ops (AveragePool, Erf, ...), and a
# refused program costs its batch a bisection.
BATCH_SIZE = {torch.float32: 16, torch.float64: 4}


def run_programs(programs: Sequence[Program], *, batch: bool = True) -> dict[int, Outcome]:
    """Outcome of each program by seed; several programs share one compiled function when ``batch``."""
    from aot2onnx.compile.fallback import reset_fallback_graphs

    outcomes: dict[int, Outcome] = {}
    eager: dict[int, Result] = {}
    noisy: dict[int, list[Result]] = {}
    for p in programs:
        try:
            eager[p.seed] = run_eager(p)
        except Exception as e:
            outcomes[p.seed] = Outcome(p.seed, "eager-error", f"{type(e).__name__}: {e}")
            continue
        noisy[p.seed] = [run_eager(p, Noise(p.seed * 97 + s)) for s in range(NOISE_SAMPLES)]
    runnable = [p for p in programs if p.seed in eager]

    def finish(group: Sequence[Program], results: Sequence[Result], fell_back: bool) -> None:
        for p, r in zip(group, results):
            problems = compare_results(p, eager[p.seed], r, noisy[p.seed])
            status = "mismatch" if problems else "pass"
            outcomes[p.seed] = Outcome(p.seed, status, "\n".join(problems), fell_back)

    def attempt(group: Sequence[Program]) -> None:
        reset_fallback_graphs()
        try:
            results = run_compiled(group)
        except Exception as e:
            torch._dynamo.reset()
            if len(group) > 1:  # some program spoils the group: halve it until each failure is alone
                attempt(group[: len(group) // 2])
                attempt(group[len(group) // 2 :])
                return
            status = "refused" if _is_refusal(_unwrap(e)) else "crash"
            outcomes[group[0].seed] = Outcome(group[0].seed, status, describe_error(e))
            return
        finish(group, results, _fell_back())

    for dtype in (torch.float32, torch.float64):
        group = [p for p in runnable if p.dtype == dtype]
        size = BATCH_SIZE[dtype] if batch else 1
        for i in range(0, len(group), size):
            attempt(group[i : i + size])
    return outcomes


def describe_error(e: BaseException) -> str:
    """The chain of exceptions below Dynamo's wrapper: 'PassError <- IndexError: ...'."""
    chain = []
    inner: BaseException | None = e
    while inner is not None and len(chain) < 6:
        if type(inner).__module__.split(".")[0] != "torch" or inner is not e:
            chain.append(inner)
        if isinstance(inner, _aot2onnx_error()):
            break
        inner = getattr(inner, "inner_exception", None) or inner.__cause__
    last = chain[-1] if chain else e
    names = " <- ".join(type(x).__name__ for x in chain) or type(e).__name__
    return f"{names}: {str(last)[:2000]}"


def _signature(outcome: Outcome) -> tuple[str, frozenset[str]]:
    """What kind of failure: the status, and for a mismatch which results differ and how."""
    kinds = set()
    for line in outcome.detail.splitlines():
        m = re.match(r"(output|grad) .*elements differ \((\d+) NaN/inf pattern, (\d+) value, (\d+) sign", line)
        if m:
            for kind, count in zip(("pattern", "value", "sign"), m.groups()[1:]):
                if int(count):
                    kinds.add(f"{m.group(1)} {kind}")
    return outcome.status, frozenset(kinds)


def shrink(program: Program, *, budget: int = 150) -> Program:
    """A smaller program that fails the same way: outputs dropped, statements bypassed (their result replaced
    by an operand), unused inputs dropped, input elements set to 1.0. ``budget``: at most this many trials."""
    want = _signature(run_programs([program], batch=False)[program.seed])
    if want[0] not in ("mismatch", "crash"):
        return program
    trials = 0

    def fails(candidate: Program) -> bool:
        nonlocal trials
        trials += 1
        try:
            got = run_programs([candidate], batch=False)[candidate.seed]
        except Exception:
            return False
        status, kinds = _signature(got)
        return status == want[0] and (not want[1] or bool(kinds & want[1]))

    best = program
    changed = True
    while changed and trials < budget:
        changed = False
        for candidate in _smaller(best):
            if trials >= budget:
                break
            if fails(candidate):
                best, changed = candidate, True
                break
    return best


def _smaller(p: Program) -> Iterator[Program]:
    """Candidate simplifications of p, biggest steps first."""
    if len(p.outputs) > 1:
        for i in range(len(p.outputs)):
            yield _tidy(dataclasses.replace(p, outputs=p.outputs[:i] + p.outputs[i + 1 :]))
    for i in reversed(range(len(p.stmts))):
        s = p.stmts[i]
        for arg in dict.fromkeys(s.args):
            if p.dtype_of(arg) is not None:
                yield _tidy(_bypass(p, i, arg))
    for k, x in enumerate(p.inputs):
        flat = x.reshape(-1)
        ordinary = (flat == 1.0) | (flat == 2.0)
        todo = (~ordinary).nonzero().reshape(-1).tolist()
        size = len(todo)
        while size >= 1:
            for start in range(0, len(todo), size):
                y = flat.clone()
                y[todo[start : start + size]] = 1.0
                inputs = list(p.inputs)
                inputs[k] = y.reshape(x.shape)
                yield dataclasses.replace(p, inputs=inputs)
            size //= 2


def _bypass(p: Program, i: int, arg: str) -> Program:
    """p with statement i removed and its result replaced by ``arg`` wherever it is used."""
    old = p.stmts[i].out
    stmts = []
    for j, s in enumerate(p.stmts):
        if j == i:
            continue
        stmts.append(dataclasses.replace(s, args=tuple(arg if a == old else a for a in s.args)) if j > i else s)
    outputs = list(dict.fromkeys(arg if o == old else o for o in p.outputs))
    return dataclasses.replace(p, stmts=stmts, outputs=outputs)


def _tidy(p: Program) -> Program:
    """Dead statements and unused inputs removed, inputs renumbered x0, x1, ..."""
    p = p.prune()
    used = {a for s in p.stmts for a in s.args} | set(p.outputs)
    keep = [i for i, name in enumerate(p.input_names) if name in used]
    rename = {f"x{i}": f"x{k}" for k, i in enumerate(keep)}
    stmts = [dataclasses.replace(s, args=tuple(rename.get(a, a) for a in s.args)) for s in p.stmts]
    outputs = [rename.get(o, o) for o in p.outputs]
    return dataclasses.replace(p, inputs=[p.inputs[i] for i in keep], stmts=stmts, outputs=outputs)


# ---------------------------------------------------------------------------------------------------------
# Reproducers


def _tensor_literal(x: torch.Tensor) -> str:
    dtype = str(x.dtype).replace("torch.", "torch.")
    values = ", ".join(_fmt(v) for v in x.detach().reshape(-1).tolist())
    return f"torch.tensor([{values}], dtype={dtype}).reshape({tuple(x.shape)})"


def repro_script(program: Program, *, grads: bool | None = None) -> str:
    """A standalone script: the program, its inputs as exact literals, eager against aot2onnx, element by element."""
    grads = program.finite if grads is None else grads
    names = program.input_names
    inputs = "\n".join(f"{n} = {_tensor_literal(x)}" for n, x in zip(names, program.inputs))
    head = textwrap.dedent(f"""\
        # aot2onnx differential test, seed {program.seed}: eager PyTorch against torch.compile(backend="aot2onnx")
        import torch
        import torch.nn.functional as F

        nan, inf = float("nan"), float("inf")


        """)
    body = program.source() + "\n\n" + inputs + "\n"
    if grads:
        body += textwrap.dedent(f"""\


            def run(fn):
                xs = [x.clone().requires_grad_() for x in ({', '.join(names)},)]
                outs = fn(*xs)
                g = torch.Generator().manual_seed({1_000_003 + program.seed})
                cots = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype) for o in outs]
                pairs = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
                gs = torch.autograd.grad([o for o, _ in pairs], xs, [c for _, c in pairs], allow_unused=True)
                return [o.detach() for o in outs] + [torch.zeros_like(x) if g is None else g for x, g in zip(xs, gs)]
            """)
    else:
        body += textwrap.dedent(f"""\


            def run(fn):
                return list(fn({', '.join(names)}))
            """)
    tail = textwrap.dedent("""\


        eager = run(program)
        compiled = run(torch.compile(program, backend="aot2onnx"))
        for i, (e, c) in enumerate(zip(eager, compiled)):
            same = ((e == c) & (e.signbit() == c.signbit())) | (e.isnan() & c.isnan())
            print(f"result {i}: {'same' if bool(same.all()) else 'DIFFERENT'}")
            for idx in (~same).nonzero().tolist()[:8]:
                a, b = e[tuple(idx)].item(), c[tuple(idx)].item()
                print(f"  at {idx}: eager {a!r} ({a.hex()}), compiled {b!r} ({b.hex()})")
        """)
    return head + body + tail


