"""``compare``: one training step of a model in eager PyTorch and through aot2onnx, from the same state, and
every compiled graph node by node; ``compare_artifact``: the same for an exported training artifact."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import pathlib
import tempfile
import time
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import onnx
import torch
import torch.fx

from aot2onnx.capture._torch_compat import tree_leaves
from aot2onnx.capture.aot import observing
from aot2onnx.compile.backend import backend
from aot2onnx.compile.fallback import FallbackGraph
from aot2onnx.options import Options
from aot2onnx.runtime.session import OrtGraph
from aot2onnx.signature import GraphKind, InputKind, InputSpec
from aot2onnx.tools.parity.errors import measure
from aot2onnx.tools.parity.nodes import GraphParity, OnnxRun, analyse, exposable, run_intermediates
from aot2onnx.tools.parity.report import ParityReport, TensorParity

__all__ = ["compare", "compare_artifact"]

Progress = Callable[[str], None] | None


def _say(progress: Progress, text: str) -> None:
    if progress is not None:
        progress(text)


class _Recorded:
    """A compiled graph's callable, keeping the FX graph it was compiled from and, per step of ``compare``, a
    copy of the inputs of its first call in that step (later calls are passed through untouched)."""

    _boxed_call = True

    def __init__(self, kind: str, graph: torch.fx.GraphModule, runner: Callable, order: Iterator[int],
                 step: list[int]) -> None:
        self.kind, self.graph, self.runner = kind, graph, runner
        self.calls: dict[int, list[Any]] = {}  # step -> inputs of the first call in it
        self.orders: dict[int, int] = {}  # step -> when that call came, among every graph's
        self._order, self._step = order, step

    def __call__(self, args: list[Any]) -> Any:
        step = self._step[0]
        if step not in self.calls:
            self.calls[step] = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
            self.orders[step] = next(self._order)
        return self.runner(args)


def _copies(args: Sequence[Any]) -> tuple[Any, ...]:
    """Each side's own copy of the inputs, keeping requires_grad: gradients and mutations stay apart."""
    return tuple(
        a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else copy.deepcopy(a)
        for a in args
    )


def _step(model: Callable, args: tuple, loss_fn: Callable | None, targets: Any, seed: int) -> tuple[list[Any], Any]:
    """One forward and backward: the outputs (tensor leaves) and the loss (None without ``loss_fn``, where
    the outputs are differentiated with fixed random cotangents, the same on both sides)."""
    torch.manual_seed(seed)
    output = model(*args)
    leaves = [o for o in tree_leaves(output) if isinstance(o, torch.Tensor)]
    if loss_fn is not None:
        loss = loss_fn(output) if targets is None else loss_fn(output, targets)
        loss.backward()
        return leaves, loss
    differentiable = [o for o in leaves if o.requires_grad and o.is_floating_point()]
    if differentiable:
        generator = torch.Generator().manual_seed(seed + 1)
        cotangents = [torch.randn(o.shape, generator=generator, dtype=torch.float32).to(o.dtype) for o in differentiable]
        torch.autograd.backward(differentiable, cotangents)
    return leaves, None


def _options(options: Options | Mapping[str, Any] | None) -> dict[str, Any]:
    if isinstance(options, Options):
        return {f.name: getattr(options, f.name) for f in dataclasses.fields(Options)}
    return dict(options or {})


def _tensors(report: list[TensorParity], what: str, name: str, eager: Any, compiled: Any, rtol: float, atol: float,
             step: int = 1) -> None:
    if eager is None and compiled is None:
        return
    stats = measure(eager, compiled, rtol=rtol, atol=atol)
    if isinstance(eager, torch.Tensor) and isinstance(compiled, torch.Tensor) and eager.shape != compiled.shape:
        stats = dataclasses.replace(stats, mismatch=f"compiled {compiled.dtype}{list(compiled.shape)} vs eager "
                                                    f"{eager.dtype}{list(eager.shape)}")
    reference = eager if isinstance(eager, torch.Tensor) else compiled
    shape = list(reference.shape) if isinstance(reference, torch.Tensor) else []
    dtype = str(reference.dtype).removeprefix("torch.") if isinstance(reference, torch.Tensor) else type(reference).__name__
    report.append(TensorParity(what, name, shape, dtype, stats, step))


def _compare_state(
    eager_model: torch.nn.Module, compiled_model: torch.nn.Module, args_e: tuple, args_c: tuple, inputs: Sequence[Any],
    rtol: float, atol: float, report: list[TensorParity], step: int = 1,
) -> None:
    """Gradients of parameters and of inputs, buffers after the step, and inputs the step mutated."""
    params_c = dict(compiled_model.named_parameters())
    for name, p_e in eager_model.named_parameters():
        p_c = params_c.get(name)
        _tensors(report, "grad", name, p_e.grad, None if p_c is None else p_c.grad, rtol, atol, step)
    for i, (x_e, x_c) in enumerate(zip(args_e, args_c)):
        if isinstance(x_e, torch.Tensor) and x_e.requires_grad:
            _tensors(report, "input grad", f"input {i}", x_e.grad, x_c.grad, rtol, atol, step)
    buffers_c = dict(compiled_model.named_buffers())
    for name, b_e in eager_model.named_buffers():
        _tensors(report, "buffer", name, b_e, buffers_c.get(name), rtol, atol, step)
    for i, (x_e, x_c, x) in enumerate(zip(args_e, args_c, inputs)):
        if isinstance(x, torch.Tensor) and not (
            torch.equal(x_e.detach(), x.detach()) and torch.equal(x_c.detach(), x.detach())
        ):
            _tensors(report, "mutated input", f"input {i}", x_e.detach(), x_c.detach(), rtol, atol, step)


def _partition_inputs(fallback: FallbackGraph, inputs: Sequence[Any]) -> dict[str, list[Any]]:
    """The inputs each ONNX Runtime partition of a split graph receives, by running the split graph again
    on ``inputs`` (a copy) and noting what each partition is called with."""
    seen: dict[str, list[Any]] = {}

    class Recorder(torch.fx.Interpreter):
        def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
            submodule = self.fetch_attr(target)
            compiled = getattr(submodule, "compiled", None)
            if isinstance(compiled, OrtGraph):
                seen.setdefault(compiled.name, [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args])
            elif isinstance(submodule, torch.fx.GraphModule):  # split again where a partition failed to compile
                return Recorder(submodule).run(*args)
            return super().call_module(target, args, kwargs)

    with torch.no_grad():
        Recorder(fallback.split).run(*[a.detach().clone() if isinstance(a, torch.Tensor) else a for a in inputs])
    return seen


def _load_model(dump_dir: pathlib.Path, name: str) -> onnx.ModelProto:
    return onnx.load(str(dump_dir / f"{name}.onnx"))


def _graph_runs(
    recorded: _Recorded, step: int, models: Callable[[str], onnx.ModelProto], options: Options, notes: list[str],
) -> list[OnnxRun]:
    """Each ONNX model a recorded graph ran in ``step`` (``models(name)``), run again with its intermediates
    exposed."""
    runner = recorded.runner
    if isinstance(runner, OrtGraph):
        graphs = [(runner, recorded.calls[step])]
    elif isinstance(runner, FallbackGraph):
        inputs = _partition_inputs(runner, recorded.calls[step])
        graphs = [(g, inputs[g.name]) for g in runner.subgraphs if g.name in inputs]
        for g in runner.subgraphs:
            if g.name not in inputs:
                notes.append(f"partition {g.name} did not run: not compared")
    else:
        notes.append(f"a {recorded.kind} graph compiled to {type(runner).__name__}: not compared")
        return []
    wanted = exposable(recorded.graph)
    runs = []
    for graph, inputs in graphs:
        if graph.session is None:
            continue
        model = models(graph.name)
        values = run_intermediates(model, graph.signature.inputs, inputs, wanted=wanted, name=graph.name,
                                   kind=graph.kind, device=graph.device, options=options)
        runs.append(OnnxRun(graph.name, model, values, order=recorded.orders[step]))
    return runs


class _NodeComparison:
    """Every compiled graph of a compare() with the inputs of its calls and the ONNX models it ran: what the
    node by node comparison needs, and all it needs to be made again (``ParityReport.recompare``)."""

    def __init__(self, recorded: list[_Recorded], dump_dir: pathlib.Path, options: Options, rtol: float,
                 atol: float) -> None:
        self.recorded, self.dump_dir, self.options, self.rtol, self.atol = recorded, dump_dir, options, rtol, atol
        self.models: dict[str, onnx.ModelProto] = {}

    def model(self, name: str) -> onnx.ModelProto:
        if name not in self.models:
            self.models[name] = _load_model(self.dump_dir, name)
        return self.models[name]

    def graphs(self, step: int, notes: list[str], progress: Progress = None,
               transform: Callable[[str, onnx.ModelProto], onnx.ModelProto] | None = None,
               only: Collection[str] | None = None) -> list[GraphParity]:
        """The graphs that ran in ``step`` (``only`` those with an ONNX model of these names), compared node by
        node; ``transform(name, model)`` changes the ONNX model of graph ``name`` first (a copy)."""
        def models(name: str) -> onnx.ModelProto:
            return self.model(name) if transform is None else transform(name, self.model(name))

        def names(r: _Recorded) -> set[str]:
            runner = r.runner
            return {g.name for g in runner.subgraphs} if isinstance(runner, FallbackGraph) else {getattr(runner, "name", "")}

        found = []
        for r in sorted((r for r in self.recorded if step in r.calls), key=lambda r: r.orders[step]):
            if only is not None and not names(r) & set(only):
                continue
            runs = _graph_runs(r, step, models, self.options, notes)
            if not runs:
                continue
            whole = runs[0].name if len(runs) == 1 else _whole_name(runs)
            _say(progress, f"    {whole} ({r.kind}): {sum(1 for n in r.graph.graph.nodes if n.op == 'call_function')} "
                           f"FX nodes in {len(runs)} ONNX model(s)")
            for graph in analyse(r.graph, r.calls[step], runs, kind=r.kind, whole=whole, rtol=self.rtol, atol=self.atol):
                graph.step = step
                found.append(graph)
        return found

    def keep(self) -> None:
        """Reads every model the graphs ran into memory (the dump directory may go)."""
        for name in (p.stem for p in self.dump_dir.glob("*.onnx")):
            self.model(name)

    def again(self, transform: Callable[[str, onnx.ModelProto], onnx.ModelProto],
              only: Collection[str] | None = None) -> list[GraphParity]:
        steps = sorted({step for r in self.recorded for step in r.calls})
        return [g for step in steps for g in self.graphs(step, [], transform=transform, only=only)]


@contextlib.contextmanager
def _dump_dir(options: dict[str, Any]) -> Iterator[pathlib.Path]:
    if options.get("dump_dir"):
        yield pathlib.Path(options["dump_dir"])
        return
    with tempfile.TemporaryDirectory(prefix="aot2onnx-parity-") as directory:
        options["dump_dir"] = directory
        yield pathlib.Path(directory)


def _per_step(value: Any, step: int) -> Any:
    """``value(step)`` for a function of the step (0-based), else ``value``."""
    return value(step) if callable(value) and not isinstance(value, torch.nn.Module) else value


def _arguments(inputs: Any) -> tuple:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _compare_optimizer(
    eager_model: torch.nn.Module, compiled_model: torch.nn.Module, opt_e: torch.optim.Optimizer,
    opt_c: torch.optim.Optimizer, rtol: float, atol: float, report: list[TensorParity], step: int,
) -> None:
    """The parameters after the optimizer's step, and its state (momentum, moments, step counts)."""
    params_c = dict(compiled_model.named_parameters())
    names_e = {id(p): name for name, p in eager_model.named_parameters()}
    for name, p_e in eager_model.named_parameters():
        _tensors(report, "parameter", name, p_e.detach(), params_c[name].detach() if name in params_c else None,
                 rtol, atol, step)
    for p_e, state_e in opt_e.state.items():
        name = names_e.get(id(p_e))
        state_c = opt_c.state.get(params_c.get(name)) if name in params_c else None
        for key, value in state_e.items():
            other = state_c.get(key) if state_c is not None else None
            if isinstance(value, torch.Tensor) or isinstance(other, torch.Tensor):
                _tensors(report, "optimizer state", f"{name}: {key}", value, other, rtol, atol, step)


def compare(
    model: torch.nn.Module,
    inputs: Any,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    targets: Any = None,
    options: Options | Mapping[str, Any] | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    seed: int = 0,
    steps: int = 1,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    compile_optimizer: bool = False,
    keep_graphs: bool = False,
    progress: Progress = None,
) -> ParityReport:
    """``steps`` training steps of ``model`` in eager PyTorch and through ``torch.compile(backend="aot2onnx")``,
    each on its own deep copy (``model`` itself is not touched), compared tensor by tensor and node by node at
    every step.

    Args:
        model: The module.
        inputs: Its positional arguments: a tuple, or one tensor; or a function ``step -> arguments`` (steps
            count from 0). Tensors that require grad get gradients.
        loss_fn: ``loss_fn(output)``, or ``loss_fn(output, targets)`` with ``targets`` (or ``targets(step)``
            for a function); its result is differentiated. Without it, every floating-point output that
            requires grad is differentiated with fixed random cotangents.
        options: aot2onnx options (``aot2onnx.Options`` or a mapping, as ``torch.compile(options=...)``
            takes); the cache is off whatever they say, since graphs must be compiled to be seen.
        rtol, atol: ``|compiled - eager| <= atol + rtol * |eager|``, for every tensor; a node's own error is
            within ``rtol * |eager| + slack`` (no atol: a node's values may be far below the outputs'; the slack
            is the rounding ``aot2onnx.tools.parity.errors.SLACK_ULPS`` and ``NOISE_FACTOR`` describe).
        seed: ``torch.manual_seed(seed + step)`` before each side's step.
        steps: Training steps. Each side keeps its own state from step to step (parameters, buffers, the
            optimizer's momentum and moments), as training does, so a difference that only shows once the
            optimizer has moved the weights, or once its state exists, is seen at the step it appears.
        optimizer: ``params -> torch.optim.Optimizer``, one per side, stepped after each backward (and the
            gradients zeroed before it); its parameters and state are compared after every step. Default: SGD
            with lr=0.1 where ``steps`` > 1, none for one step (the gradients are compared, not the update).
        compile_optimizer: Compile the compiled side's ``optimizer.step`` through aot2onnx too: its graphs
            are compared node by node, as kind "optimizer".
        keep_graphs: Keep the compiled graphs, the inputs of their calls and their ONNX models (and sessions)
            with the report, so that ``report.recompare(transform)`` compares them node by node again with
            their models transformed, without training again (``aot2onnx.tools.parity.faults`` plants faults
            so).
        progress: Called with a line of text per stage.

    Resets Dynamo (``torch.compiler.reset()``) first, as a fresh compilation is what is observed: other
    compiled models of the process compile again on their next call. Random ops (dropout) draw other numbers
    on ONNX Runtime than in PyTorch: compare models in a state without them (``model.eval()`` or p=0).
    ``report.first_parting()`` says at which step and in which graph the two sides first part.
    """
    rtol, atol = float(rtol), float(atol)
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if optimizer is None and (steps > 1 or compile_optimizer):
        def optimizer(params: Any) -> torch.optim.Optimizer:
            return torch.optim.SGD(params, lr=0.1)
    opts = _options(options)
    opts["cache"] = False
    started = time.perf_counter()
    tensors: list[TensorParity] = []
    notes: list[str] = []
    graphs: list[GraphParity] = []
    with _dump_dir(opts) as dump_dir:
        compile_options = Options.from_mapping(opts)
        eager_model, compiled_model = copy.deepcopy(model), copy.deepcopy(model)
        opt_e = optimizer(eager_model.parameters()) if optimizer is not None else None
        opt_c = optimizer(compiled_model.parameters()) if optimizer is not None else None
        recorded: list[_Recorded] = []
        order = itertools.count()
        current = [1]  # the step in progress, which _Recorded reads
        phase = ["model"]

        def observe(kind: GraphKind, graph: torch.fx.GraphModule, runner: Callable) -> Callable:
            label = "optimizer" if phase[0] == "optimizer" else kind.value
            recorded.append(_Recorded(label, graph, runner, order, current))
            return recorded[-1]

        torch.compiler.reset()
        compiled = torch.compile(compiled_model, backend=backend(**opts))
        step_c = torch.compile(opt_c.step, backend=backend(**opts)) if opt_c is not None and compile_optimizer else (
            opt_c.step if opt_c is not None else None)
        nodes = _NodeComparison(recorded, dump_dir, compile_options, rtol, atol)
        for step in range(1, steps + 1):
            tag = f"step {step}/{steps}: " if steps > 1 else ""
            args = _arguments(_per_step(inputs, step - 1))
            step_targets = _per_step(targets, step - 1)
            args_e, args_c = _copies(args), _copies(args)
            _say(progress, f"[1/4] {tag}eager step")
            if opt_e is not None:
                opt_e.zero_grad(set_to_none=True)
            out_e, loss_e = _step(eager_model, args_e, loss_fn, step_targets, seed + step - 1)
            if opt_e is not None:
                opt_e.step()

            _say(progress, f"[2/4] {tag}compiled step (capturing, lowering, running on ONNX Runtime)")
            current[0] = step
            with observing(observe), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if opt_c is not None:
                    opt_c.zero_grad(set_to_none=True)
                out_c, loss_c = _step(compiled, args_c, loss_fn, step_targets, seed + step - 1)
                if step_c is not None:
                    phase[0] = "optimizer"
                    try:
                        step_c()
                    finally:
                        phase[0] = "model"
            for w in caught:  # aot2onnx's own (what fell back to PyTorch, and why) go into the report
                if str(w.message).startswith("aot2onnx"):
                    notes.append(tag + str(w.message))
                else:
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)

            if loss_fn is not None:
                _tensors(tensors, "loss", "loss", loss_e, loss_c, rtol, atol, step)
            if len(out_e) != len(out_c):
                notes.append(f"{tag}the compiled model returned {len(out_c)} tensors, eager {len(out_e)}")
            for i, (o_e, o_c) in enumerate(zip(out_e, out_c)):
                _tensors(tensors, "output", f"output {i}", o_e.detach(), o_c.detach(), rtol, atol, step)
            _compare_state(eager_model, compiled_model, args_e, args_c, args, rtol, atol, tensors, step)
            if opt_e is not None and opt_c is not None:
                _compare_optimizer(eager_model, compiled_model, opt_e, opt_c, rtol, atol, tensors, step)

            if not recorded:
                notes.append(f"{tag}no graph was compiled (Dynamo ran everything in eager PyTorch): nothing to "
                             "compare node by node")
            _say(progress, f"[3/4] {tag}comparing {sum(step in r.calls for r in recorded)} compiled graph(s) node by node")
            graphs += nodes.graphs(step, notes, progress)
        for r in recorded:
            if not r.calls:
                notes.append(f"a {r.kind} graph was compiled but not run: not compared")
        torch.compiler.reset()  # the compiled copies are not kept: nothing of them stays in Dynamo's caches
        if keep_graphs:
            nodes.keep()
    report = ParityReport(rtol, atol, tensors, graphs, notes, time.perf_counter() - started, steps=steps,
                          recompare=nodes.again if keep_graphs else None)
    _say(progress, f"[4/4] {report.summary_line()}")
    return report


def _whole_name(runs: Sequence[OnnxRun]) -> str:
    """The split graph's name: its partitions are named ``<graph>_<partition>``."""
    names = [r.name for r in runs]
    prefix = names[0]
    for name in names[1:]:
        while not name.startswith(prefix):
            prefix = prefix[:-1]
    return prefix.rstrip("_") or names[0]


# ----------------------------------------------------------------------------------------------------------
# An exported training artifact against the module it came from


def compare_artifact(
    artifact_dir: str | pathlib.Path,
    module: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    *,
    options: Options | Mapping[str, Any] | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    seed: int = 0,
    progress: Progress = None,
) -> ParityReport:
    """One training step of an exported artifact (``aot2onnx.load(artifact_dir)``) against eager ``module``,
    the module it was exported from, both from ``module``'s current parameters and buffers.

    ``module(*inputs)`` returns the loss, or ``(loss, *outputs)``, as for ``aot2onnx.export_training``.
    Compares the loss, the outputs, every parameter's gradient and the buffers after the step; then
    ``forward.onnx`` and ``backward.onnx`` node by node against the module's joint graph traced again the way
    the export traced it (same decompositions and partitioner, so its nodes have the names the artifact's
    ONNX values keep). ``options``: ONNX Runtime options for ``aot2onnx.load``.
    """
    from aot2onnx.artifact.loaded import load

    rtol, atol = float(rtol), float(atol)
    artifact_dir = pathlib.Path(artifact_dir)
    started = time.perf_counter()
    opts = Options.from_mapping({k: v for k, v in _options(options).items() if k not in ("cache", "dump_dir")})
    tensors: list[TensorParity] = []
    notes: list[str] = []
    inputs = tuple(x.detach() for x in inputs)
    _say(progress, f"[1/4] loading {artifact_dir}")
    loaded = load(artifact_dir, **{k: v for k, v in _options(options).items() if k not in ("cache", "dump_dir")})
    signature = loaded.signature
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    with torch.no_grad():
        for name, tensor in itertools.chain(loaded.named_parameters(), loaded.named_buffers()):
            if name not in state:
                notes.append(f"the artifact holds {name!r}, which the module does not: the artifact's value is used")
                continue
            if tensor.shape != state[name].shape or not torch.equal(tensor, state[name].to(tensor.dtype)):
                notes.append(f"{name}: the artifact's state differs from the module's; both sides start from the module's")
            tensor.copy_(state[name])
    eager = copy.deepcopy(module)

    _say(progress, "[2/4] one step in eager PyTorch and one through the artifact")

    def split(output: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return (output, []) if isinstance(output, torch.Tensor) else (output[0], list(output[1:]))

    torch.manual_seed(seed)
    loss_e, out_e = split(eager(*inputs))
    loss_e.backward()
    torch.manual_seed(seed)
    loss_c, out_c = split(loaded(*inputs))
    loss_c.backward()
    _tensors(tensors, "loss", "loss", loss_e.detach().reshape(()), loss_c.detach().reshape(()), rtol, atol)
    for i, (o_e, o_c) in enumerate(zip(out_e, out_c)):
        _tensors(tensors, "output", f"output {i + 1}", o_e.detach(), o_c.detach(), rtol, atol)
    _compare_state(eager, loaded, (), (), (), rtol, atol, tensors)

    _say(progress, "[3/4] tracing the module's joint graph again and comparing forward.onnx and backward.onnx node by node")
    graphs = _artifact_graphs(artifact_dir, module, inputs, signature, opts, rtol, atol, notes)
    report = ParityReport(rtol, atol, tensors, graphs, notes, time.perf_counter() - started)
    _say(progress, f"[4/4] {report.summary_line()}")
    return report


def _trace(module: torch.nn.Module, inputs: Sequence[torch.Tensor], signature: dict, opset: int) -> dict[GraphKind, torch.fx.GraphModule]:
    from aot2onnx.capture.joint import trace_joint
    from aot2onnx.lower.plan import decompositions
    from aot2onnx.lower.registry import default_registry

    graphs: dict[GraphKind, torch.fx.GraphModule] = {}

    def keep(kind: GraphKind, gm: torch.fx.GraphModule) -> None:
        graphs[kind] = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))

    with _stack_traces():
        trace_joint(
            copy.deepcopy(module), inputs, dynamic_batch=bool(signature.get("dims")),
            decompositions=decompositions(default_registry(), opset), compile_graph=keep,
        )
    return graphs


def _stack_traces() -> contextlib.AbstractContextManager:
    """AOTAutograd's own trace (the export's, outside Dynamo) with the stack trace of every node recorded, as
    Dynamo records them: the report's source lines. The node names, which the artifact's values keep, are the
    same with or without."""
    import functools
    from unittest import mock

    from aot2onnx.capture._torch_compat import graph_capture, make_fx

    if getattr(graph_capture, "make_fx", None) is not make_fx:  # another torch: the lines stay unknown
        return contextlib.nullcontext()
    return mock.patch.object(graph_capture, "make_fx", functools.partial(make_fx, record_stack_traces=True))


def _artifact_graphs(
    artifact_dir: pathlib.Path, module: torch.nn.Module, inputs: tuple, signature: dict, options: Options,
    rtol: float, atol: float, notes: list[str],
) -> list:
    from aot2onnx.capture._torch_compat import aot_descriptors as aot_desc
    from aot2onnx.capture.joint import WRAPPER_PREFIX

    fx = _trace(module, inputs, signature, int(signature["versions"]["opset"]))
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    state = {k: v.detach().clone() for k, v in state.items()}

    def input_value(entry: Mapping[str, Any], produced: Mapping[str, torch.Tensor]) -> torch.Tensor:
        role, source = entry["role"], entry.get("source")
        if role in ("parameter", "buffer"):
            return state[source]
        if role == "user_input":
            return inputs[source]
        if role == "grad_of_loss":
            return torch.ones((), dtype=produced.get("loss", torch.ones(())).dtype)
        return produced[source]  # saved: a forward output

    def desc_value(desc: Any, name: str, produced: Mapping[str, torch.Tensor]) -> Any:
        if isinstance(desc, (aot_desc.ParamAOTInput, aot_desc.BufferAOTInput)):
            target = desc.target.removeprefix(WRAPPER_PREFIX)
            tied = {t["name"]: t["state"] for t in signature.get("tied", [])}
            return state[tied.get(target, target)]
        if isinstance(desc, aot_desc.PlainAOTInput):
            return inputs[desc.idx]
        if isinstance(desc, aot_desc.TangentAOTInput):
            return torch.ones((), dtype=torch.float32)
        return produced[name]  # saved for backward: the forward's value of the node of that name

    graphs = []
    produced: dict[str, torch.Tensor] = {}  # forward outputs by artifact name
    by_fx: dict[str, torch.Tensor] = {}  # forward values by FX node name
    for order, kind in enumerate((GraphKind.FORWARD, GraphKind.BACKWARD)):
        section = signature[kind.value]
        model = onnx.load(str(artifact_dir / section["model"]))
        gm = fx[kind]
        specs = [InputSpec(InputKind.TENSOR, e["name"]) for e in section["inputs"]]
        args = [input_value(e, produced) for e in section["inputs"]]
        aliases = _artifact_aliases(gm, section, aot_desc)
        values = run_intermediates(model, specs, args, wanted={**exposable(gm), **{e["name"]: None for e in section["outputs"]}},
                                   name=f"{artifact_dir.name}_{kind.value}", kind=kind, device=torch.device("cpu"),
                                   options=options)
        if kind is GraphKind.FORWARD:
            produced = {e["name"]: values[e["name"]] for e in section["outputs"]}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        fx_inputs = [desc_value(p.meta.get("desc"), p.name, by_fx) for p in placeholders]
        run = OnnxRun(f"{artifact_dir.name}/{section['model']}", model, values, aliases, order)
        found = [n for n in exposable(gm) if n in values or aliases.get(n) in values]
        if len(found) < len(exposable(gm)) // 4:
            notes.append(f"{section['model']}: few of its values are named after the module's traced {kind} graph: the "
                         "artifact may not come from this module, or was exported by another version")
        graphs += analyse(gm, fx_inputs, [run], kind=kind.value, whole=run.name, rtol=rtol, atol=atol)
        if kind is GraphKind.FORWARD:
            by_fx = {n.name: values[aliases.get(n.name, n.name)] for n in gm.graph.nodes
                     if aliases.get(n.name, n.name) in values}
            by_fx.update({name: values[f"saved:{name}"] for name in (n.name for n in gm.graph.nodes)
                          if f"saved:{name}" in values})
    return graphs


def _artifact_aliases(gm: torch.fx.GraphModule, section: dict, aot_desc: Any) -> dict[str, str]:
    """FX node name -> the artifact's name of its value, for values the export renamed (graph outputs)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    returned = output.args[0] if isinstance(output.args[0], (list, tuple)) else (output.args[0],)
    descs = output.meta.get("desc") or [None] * len(returned)
    aliases: dict[str, str] = {}
    names = {e["name"] for e in section["outputs"]}
    for desc, node in zip(descs, returned):
        if not isinstance(node, torch.fx.Node):
            continue
        if f"saved:{node.name}" in names:
            aliases.setdefault(node.name, f"saved:{node.name}")
        elif isinstance(desc, aot_desc.PlainAOTOutput):
            aliases.setdefault(node.name, "loss" if desc.idx == 0 else f"output_{desc.idx}")
        elif isinstance(desc, aot_desc.InputMutationAOTOutput) and isinstance(desc.mutated_input, aot_desc.BufferAOTInput):
            target = desc.mutated_input.target
            match = [e["name"] for e in section["outputs"] if e.get("role") == "buffer_update"
                     and target.endswith(e.get("target", "\0"))]
            if match:
                aliases.setdefault(node.name, match[0])
        elif isinstance(desc, aot_desc.GradAOTOutput) and isinstance(desc.grad_of, aot_desc.ParamAOTInput):
            target = desc.grad_of.target
            match = [e["name"] for e in section["outputs"] if e.get("role") == "grad" and target.endswith(e.get("target", "\0"))]
            if match:
                aliases.setdefault(node.name, match[0])
    return {k: v for k, v in aliases.items() if v in names and k != v}
