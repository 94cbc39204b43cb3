"""Operator coverage on PyTorch's OpInfo database: outputs and gradients, compiled through aot2onnx vs eager.

Every OpInfo with float32 samples on CPU is checked. Each sample runs eagerly and through
``torch.compile(..., backend=aot2onnx.backend(opset=18, fallback=False, cache=False), fullgraph=True)``;
the outputs (and the inputs the op mutates) must match, and, when the OpInfo supports autograd, so must
the gradients with respect to every input that requires grad, for a random cotangent. ``fullgraph=True``
turns a graph break into an error, so an op Dynamo cannot trace is a failure (``dynamo``), never a silent
eager pass; ``fallback=False`` makes an op without a lowering fail (``unsupported``) instead of running
in torch; ``cache=False`` makes every graph go through the lowering.

A sample passes only if ONNX Runtime ran: some compiled graph must have run a session. The one exception,
counted as a pass and marked ``no_compute`` in the records: a graph whose outputs need no computation
(every output is an input, or a view of one that AOTAutograd regenerates) has no ONNX outputs and so no
session, and the gradients of such views flow through torch's view backward, with no backward graph.
The values are still compared with eager.

Newer target opsets are checked by replay: ``lower_graph(..., opset=N)`` lowers at 18 and converts the
model, so every graph the opset-18 run ran is converted the same way, given its own session and run on
the very inputs it got at 18; its outputs must equal those of the opset-18 model (see ``replay``).

- Default run (``test_opinfo``): the first float32 sample of every OpInfo, at opset 18 and replayed at
  the newest opset the installed ONNX Runtime loads. Its records regenerate ``opset_tables/``
  (``test_opset_tables``, last in this module; ``python -m aot2onnx coverage`` writes them).
- ``-m slow`` (``test_opinfo_all_samples``): every sample, in float32, float64, int64, bool, float16 and
  bfloat16 where the OpInfo supports the dtype. float16/bfloat16 samples whose graphs need a kernel
  ONNX Runtime's CPU provider does not have are not tested (skipped).

The table of tolerances, input wrangling and strict expected failures is ``opinfo_expectations.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import Any
from unittest import mock

import onnx
import onnx_ir as ir
import onnxscript
import pytest
import torch
import torch_behaviour
from opinfo_expectations import ENTRIES, NEWER_OPINFOS, Entry, tolerance
from torch.testing._internal import common_methods_invocations
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._pytree import tree_flatten, tree_map

import aot2onnx
from aot2onnx.errors import LoweringError, RuntimeSessionError, UnsupportedOpError
from aot2onnx.runtime.kernels import require_runnable
from aot2onnx.runtime.session import OrtGraph
from aot2onnx.tools import coverage

_backend_module = importlib.import_module("aot2onnx.compile.backend")
_translate_module = importlib.import_module("aot2onnx.lower.translate")
_ORT_GRAPH_CALL = OrtGraph.__call__

TARGET_OPSETS = coverage.target_opsets()
SLOW_DTYPES = (torch.float32, torch.float64, torch.int64, torch.bool, torch.float16, torch.bfloat16)


def _opinfos() -> dict[str, Any]:
    table: dict[str, Any] = {}
    for op in op_db:
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        name = coverage.opinfo_name(op.name, op.variant_test_name)
        assert name not in table, f"two OpInfos named {name}"
        table[name] = op
    return table


OPINFOS = _opinfos()
_RECORDS: list[coverage.SampleRecord] = []  # the default run's, for test_opset_tables


@dataclasses.dataclass
class Check:
    outcome: str  # one of opinfo_expectations.OUTCOMES, or "n/a", "blocked", "no-eager", "no-kernel"
    detail: str = ""


@dataclasses.dataclass
class SampleResult:
    fwd: Check
    bwd: Check
    fwd_ops: dict[str, set[str]]
    bwd_ops: dict[str, set[str]]
    fwd_no_compute: bool = False
    bwd_no_compute: bool = False
    values_compared: bool = True
    recorder: Any = None
    replays: dict[int, tuple[Check, Check]] = dataclasses.field(default_factory=dict)


class _GraphRecorder:
    """Wraps the backend's ``lower_graph`` to note the ATen overloads (and dtypes) of each graph, and keeps
    each lowered model and the inputs and outputs of its runs, for the replay at newer opsets."""

    def __init__(self, lower_graph: Callable) -> None:
        self._lower_graph = lower_graph
        self.ops = {"forward": {}, "backward": {}}
        self.lowered: dict[str, Any] = {}
        self.runs: list[tuple[Any, list[Any], list[Any]]] = []

    def __call__(self, gm: torch.fx.GraphModule, **kwargs: Any) -> Any:
        kind = "backward" if kwargs["name"].endswith("_backward") else "forward"  # inference counts as forward
        for node in gm.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and not _is_assert(node):
                self.ops[kind].setdefault(str(node.target), set()).update(_node_dtypes(node))
        lowered = self._lower_graph(gm, **kwargs)
        self.lowered[kwargs["name"]] = lowered
        return lowered

    def call(self, graph: Any, args: list[Any]) -> list[Any]:
        inputs = [_detached(a) for a in args]
        outputs = _ORT_GRAPH_CALL(graph, args)
        self.runs.append((graph, inputs, [_detached(o) for o in outputs]))
        return outputs


def _detached(x: Any) -> Any:
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def _is_assert(node: torch.fx.Node) -> bool:
    # Runtime asserts on symbolic sizes, which lowering drops: not ops of the graph's computation.
    return node.target.name() in ("aten::_assert_scalar", "aten::_assert_async", "aten::_assert_async.msg",
                                  "aten::_assert_tensor_metadata", "aten::sym_constrain_range_for_size")


def _unseeded():
    """OpInfo runs random ops under ``wrapper_set_seed``, which saves, reseeds and restores torch's generator:
    Dynamo cannot trace that. The sweep seeds before each run itself and calls the op directly."""
    return mock.patch.object(common_methods_invocations, "wrapper_set_seed", lambda op, *args, **kwargs: op(*args, **kwargs))


@contextlib.contextmanager
def _recording(recorder: _GraphRecorder):
    """Routes the backend's lowering (wherever the backend looks ``lower_graph`` up) and every ONNX Runtime
    graph's runs through ``recorder``."""
    with contextlib.ExitStack() as stack:
        for module in (_translate_module, _backend_module):
            if hasattr(module, "lower_graph"):
                stack.enter_context(mock.patch.object(module, "lower_graph", recorder))
        stack.enter_context(mock.patch.object(OrtGraph, "__call__", lambda graph, args: recorder.call(graph, args)))
        yield


def _converted(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """An opset-18 model at ``opset``, converted as ``lower_graph(..., opset=opset)`` converts its own, and
    refused as the backend refuses a node ONNX Runtime cannot run at ``opset``."""
    ir_model = ir.serde.deserialize_model(model)
    onnxscript.version_converter.convert_version(ir_model, opset, fallback=True)
    converted = ir.serde.serialize_model(ir_model)
    onnx.checker.check_model(converted)
    require_runnable(converted, opset, "graph")
    return converted


def replay(recorder: _GraphRecorder, result: SampleResult, opset: int, dtype: torch.dtype, entry: Entry) -> tuple[Check, Check]:
    """The sample's outcomes at ``opset``, by replaying each graph the opset-18 run ran, converted.

    ``lower_graph(..., opset=N)`` lowers at 18 and converts the model, so a graph's model at N is its
    opset-18 model converted. Each one is converted, given a session, and run on the very inputs the
    opset-18 run gave it; its outputs must equal the opset-18 outputs, which were compared with eager.
    Crashes before any graph ran (Dynamo, capture, lowering) are the same at every opset.
    """
    failures: dict[str, Check] = {}
    for graph, inputs, expected in recorder.runs:
        kind = "bwd" if graph.kind == "backward" else "fwd"
        if kind in failures:
            continue
        lowered = recorder.lowered[graph.name]
        try:
            model = _converted(lowered.model, opset)
        except LoweringError as e:
            failures[kind] = Check("lowering", _first_line(str(e)))
            continue
        except Exception as e:
            failures[kind] = Check("lowering", f"version conversion to opset {opset}: {type(e).__name__}: {_first_line(str(e))}")
            continue
        try:
            replayed = OrtGraph(model, lowered.signature, name=graph.name, device=graph.device, options=graph.options,
                                kind=graph.kind, fx_node_count=graph.fx_node_count)
            actual = _ORT_GRAPH_CALL(replayed, list(inputs))
        except Exception as e:
            failures[kind] = classify(e, dtype)
            continue
        differs = _compare(actual, expected, dtype, entry, grad=False)
        if differs:
            failures[kind] = Check("mismatch", f"differs from the opset-18 model: {differs}")
    fwd = failures.get("fwd", result.fwd)
    bwd = failures.get("bwd", result.bwd)
    if fwd.outcome != "pass" and result.fwd.outcome == "pass" and bwd.outcome == "pass":
        bwd = Check("blocked")
    return fwd, bwd


def _node_dtypes(node: torch.fx.Node) -> set[str]:
    """The dtypes of the node's tensor inputs, or of its outputs for a node without tensor inputs."""

    def dtypes(values: Any) -> set[str]:
        leaves, _ = tree_flatten(values)
        return {str(v.dtype).removeprefix("torch.") for v in leaves if isinstance(v, torch.Tensor)}

    inputs = dtypes([a.meta.get("val") for a in node.all_input_nodes])
    return inputs or dtypes(node.meta.get("val"))


def _clone(tree: Any) -> Any:
    """Detached copies of every tensor, keeping requires_grad and which leaves are the same tensor."""
    memo: dict[int, torch.Tensor] = {}

    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in memo:
            memo[id(x)] = x.detach().clone().requires_grad_(x.requires_grad)
        return memo[id(x)]

    return tree_map(one, tree)


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


def classify(exc: BaseException, dtype: torch.dtype) -> Check:
    """The stage that raised, and a one-line message to group failures by."""
    inner = exc
    while getattr(inner, "inner_exception", None) is not None:  # Dynamo's BackendCompilerFailed
        inner = inner.inner_exception
    if isinstance(inner, UnsupportedOpError):
        ops = re.findall(r"^  (\S+)  \(", str(inner), flags=re.MULTILINE)
        return Check("unsupported", "no lowering: " + ", ".join(sorted(ops)))
    if isinstance(inner, RuntimeSessionError):
        message = str(inner)
        if dtype in (torch.float16, torch.bfloat16) and "Could not find an implementation" in message:
            return Check("no-kernel", _first_line(message))
        return Check("ort", re.sub(r"graph '[^']*'", "graph", _first_line(message)))
    if isinstance(inner, LoweringError):
        cause = inner.__cause__
        detail = _first_line(str(inner))
        if cause is not None:
            detail += f" <- {type(cause).__name__}: {_first_line(str(cause))}"
        return Check("lowering", re.sub(r"graph '[^']*'", "graph", detail))
    if isinstance(exc, torch._dynamo.exc.BackendCompilerFailed):
        return Check("capture", f"{type(inner).__name__}: {_first_line(str(inner))}")
    if isinstance(exc, (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)) or type(exc).__module__.startswith(
        "torch._dynamo"
    ):
        return Check("dynamo", f"{type(exc).__name__}: {_first_line(str(exc))}")
    if isinstance(exc, torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode):
        return Check("dynamo", f"{type(exc).__name__}: {_first_line(str(exc))}")
    return Check("error", f"{type(exc).__name__}: {_first_line(str(exc))}")


def _compare(actual: Any, expected: Any, dtype: torch.dtype, entry: Entry, *, grad: bool, compare_values: bool = True) -> str | None:
    """None when ``actual`` matches ``expected``, else the first line of what differs."""
    actual_leaves, actual_spec = tree_flatten(actual)
    expected_leaves, expected_spec = tree_flatten(expected)
    if actual_spec != expected_spec:
        return f"output structure differs: {actual_spec} != {expected_spec}"
    rtol, atol = tolerance(entry, dtype, grad=grad)
    for i, (a, e) in enumerate(zip(actual_leaves, expected_leaves)):
        try:
            if isinstance(e, torch.Tensor) and not (compare_values or grad):
                assert isinstance(a, torch.Tensor), f"a {type(a).__name__} where eager returns a tensor"
                assert (a.shape, a.dtype) == (e.shape, e.dtype), f"{a.shape} {a.dtype} != {e.shape} {e.dtype}"
            elif isinstance(e, (torch.Tensor, int, float, complex)) and not isinstance(e, bool):
                # An integer sample's floating results (sin of int64 values is float32) take their own dtype's
                # tolerance, not the sample's exact one.
                floating = isinstance(e, torch.Tensor) and (e.is_floating_point() or e.is_complex())
                if floating and not (dtype.is_floating_point or dtype.is_complex):
                    rtol, atol = tolerance(entry, e.dtype, grad=grad)
                torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True, check_device=False)
            else:
                assert a == e, f"{a!r} != {e!r}"
        except (AssertionError, TypeError) as error:
            return f"leaf {i}: {_first_line(str(error))}"
    return None


def _aliases(x: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    """Whether ``x`` is one of ``inputs`` or a view of one (shares its storage)."""
    return any(x.untyped_storage().data_ptr() == i.untyped_storage().data_ptr() for i in inputs)


def _grad_leaves(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]


def run_sample(
    opinfo: Any, sample: Any, dtype: torch.dtype, opset: int, entry: Entry, check_grad: bool, replay_opsets: Sequence[int] = ()
) -> SampleResult:
    """Runs one sample eagerly and compiled; compares outputs and, if ``check_grad``, gradients.

    ``result.replays`` holds the outcomes at each of ``replay_opsets`` (see :func:`replay`).
    """
    result = _run_sample(opinfo, sample, dtype, opset, entry, check_grad)
    recorder = result.recorder
    result.replays = {n: replay(recorder, result, n, dtype, entry) for n in replay_opsets}
    result.recorder = None
    return result


def _run_sample(opinfo: Any, sample: Any, dtype: torch.dtype, opset: int, entry: Entry, check_grad: bool) -> SampleResult:
    if entry.wrangle is not None:
        sample = entry.wrangle(sample)
    recorder = _GraphRecorder(_translate_module.lower_graph)
    result = SampleResult(Check("pass"), Check("n/a"), recorder.ops["forward"], recorder.ops["backward"])
    result.recorder = recorder
    eager_in = _clone((sample.input, sample.args, sample.kwargs))
    compiled_in = _clone((sample.input, sample.args, sample.kwargs))

    def call(input: Any, args: Any, kwargs: Any) -> Any:
        return opinfo.op(input, *args, **kwargs)

    torch.manual_seed(0)
    try:
        with _unseeded():
            expected = call(*eager_in)
    except Exception as e:  # the op does not run eagerly on CPU (jiterator ops are CUDA-only)
        result.fwd = Check("no-eager", f"{type(e).__name__}: {_first_line(str(e))}")
        return result
    torch._dynamo.reset()
    aot2onnx.reset_compiled_graphs()
    compiled = torch.compile(
        # Standard ONNX operators only: the tables say what an opset's operators cover (the fused CPU kernels,
        # ATen's own, are tested in test_fused_kernels.py).
        call, backend=aot2onnx.backend(opset=opset, fallback=False, cache=False, fused_kernels=False), fullgraph=True,
        dynamic=False
    )
    with _recording(recorder), _unseeded():
        torch.manual_seed(0)
        try:
            actual = compiled(*compiled_in)
        except Exception as e:
            result.fwd = classify(e, dtype)
            result.bwd = Check("blocked") if check_grad else Check("n/a")
            return result
        graphs = aot2onnx.compiled_graphs()
        forward = [g for g in graphs if g.kind in ("forward", "inference")]
        result.fwd_no_compute = bool(forward) and all(g.session is None for g in forward)
        compare_values = entry.values(sample) if callable(entry.values) else entry.values
        result.values_compared = bool(compare_values)
        if compare_values == "processed":
            process = sample.output_process_fn_grad
            differs = _compare((process(actual), compiled_in), (process(expected), eager_in), dtype, entry, grad=False)
        else:
            differs = _compare((actual, compiled_in), (expected, eager_in), dtype, entry, grad=False,
                               compare_values=compare_values)
        if not forward or not (result.fwd_no_compute or any(g.runs for g in forward)):
            result.fwd = Check("eager", "no graph reached ONNX Runtime")
        elif differs:
            result.fwd = Check("mismatch", differs)
        if not check_grad:
            return result
        outputs_e = _grad_leaves(sample.output_process_fn_grad(expected))
        outputs_c = _grad_leaves(sample.output_process_fn_grad(actual))
        inputs_e, inputs_c = _grad_leaves(eager_in), _grad_leaves(compiled_in)
        if not outputs_e or not inputs_e:
            return result  # nothing differentiable in this sample: bwd stays n/a
        generator = torch.Generator().manual_seed(0)
        cotangents = [torch.randn(o.shape, generator=generator, dtype=o.dtype) for o in outputs_e]
        grads_e = torch.autograd.grad(outputs_e, inputs_e, cotangents, allow_unused=True)
        try:
            grads_c = torch.autograd.grad(outputs_c, inputs_c, cotangents, allow_unused=True)
        except Exception as e:
            result.bwd = classify(e, dtype)
            return result
        zeros = lambda grads, inputs: [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]
        differs = _compare(zeros(grads_c, inputs_c), zeros(grads_e, inputs_e), dtype, entry, grad=True)
        backward = [g for g in aot2onnx.compiled_graphs() if g.kind == "backward"]
        if backward:
            result.bwd_no_compute = all(g.session is None for g in backward)
            ran = result.bwd_no_compute or any(g.runs for g in backward)
        else:
            # Outputs that are inputs or views of inputs are regenerated by AOTAutograd outside the compiled
            # graph, so their gradients flow through the views' own backward, and no backward graph exists.
            result.bwd_no_compute = ran = all(_aliases(o, inputs_c) for o in outputs_c)
        if not ran:
            result.bwd = Check("eager", "no backward graph reached ONNX Runtime")
        elif differs:
            result.bwd = Check("mismatch", differs)
        else:
            result.bwd = Check("pass")
    return result


def _merge(checks: list[Check]) -> Check:
    """One outcome for several samples: the first failure, or pass if every tested sample passed."""
    tested = [c for c in checks if c.outcome not in ("no-eager", "no-kernel", "n/a")]
    if not tested:
        return checks[0] if checks else Check("n/a")
    return next((c for c in tested if c.outcome != "pass"), tested[0])


def _review(entry: Entry, dtype: torch.dtype, opset: int, fwd: Check, bwd: Check) -> tuple[list[str], list[str]]:
    """(problems, expected failures): outcomes the table does not expect, and those it does."""
    problems, expected_failures = [], []
    for kind, check in (("fwd", fwd), ("bwd", bwd)):
        expected = entry.expected(kind, dtype, opset)
        where = f"opset {opset} {kind}"
        if check.outcome in ("blocked", "no-kernel"):
            continue  # the forward failed (a bwd xfail waits until it passes), or ONNX Runtime has no kernel
        if check.outcome == "n/a":
            # An integer or bool sample has no backward to check: a bwd xfail is the floating dtypes'.
            if expected is not None and (dtype.is_floating_point or dtype.is_complex):
                problems.append(f"{where}: no gradients were checked; remove the xfail ({expected.reason})")
            continue
        if expected is None:
            if check.outcome != "pass":
                problems.append(f"{where}: {check.outcome}: {check.detail}")
        elif check.outcome == "pass":
            problems.append(f"{where}: unexpected pass; remove the xfail ({expected.reason})")
        elif check.outcome != expected.outcome:
            problems.append(f"{where}: expected {expected.outcome} ({expected.reason}), got {check.outcome}: {check.detail}")
        else:
            expected_failures.append(f"{where} {check.outcome}: {expected.reason}")
    return problems, expected_failures


def _expected_reason(entry: Entry, dtype: torch.dtype, opset: int, fwd: Check, bwd: Check) -> str:
    """The expectation's reason for the first failure of a sample (its forward's, else its backward's), for the
    coverage table's note; empty where nothing failed or nothing expected it."""
    for kind, check in (("fwd", fwd), ("bwd", bwd)):
        if check.outcome not in ("pass", "n/a", "blocked"):
            expected = entry.expected(kind, dtype, opset)
            return expected.reason if expected is not None and expected.outcome == check.outcome else ""
    return ""


def check_expectations(entry: Entry, dtype: torch.dtype, outcomes: dict[int, tuple[Check, Check]]) -> None:
    """Fails on any outcome the table does not expect; xfails when every failure was expected."""
    fwd = next(iter(outcomes.values()))[0]
    if fwd.outcome in ("no-sample", "no-eager", "no-kernel"):
        pytest.skip(f"not tested: {fwd.detail}")
    problems, expected_failures = [], []
    for opset, (fwd, bwd) in outcomes.items():
        p, x = _review(entry, dtype, opset, fwd, bwd)
        problems += p
        expected_failures += x
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
    if expected_failures:
        pytest.xfail("; ".join(expected_failures))


def _samples(opinfo: Any, dtype: torch.dtype, check_grad: bool, first_only: bool = False) -> list[Any]:
    torch.manual_seed(0)  # sample inputs are drawn from torch's global generator
    samples = opinfo.sample_inputs("cpu", dtype, requires_grad=check_grad)
    if first_only:  # some OpInfos make hundreds of samples; the default run needs one
        return [s for s, _ in zip(samples, range(1))]
    return list(samples)


def _checks_grad(opinfo: Any, dtype: torch.dtype) -> bool:
    return (opinfo.supports_autograd and (dtype.is_floating_point or dtype.is_complex)
            and dtype in opinfo.supported_backward_dtypes("cpu"))


@pytest.mark.parametrize("name", sorted(OPINFOS))
def test_opinfo(name: str) -> None:
    """The first float32 sample, forward and backward, at opset 18 and (replayed) at the newer target opsets."""
    opinfo, entry, dtype = OPINFOS[name], ENTRIES.get(name, Entry()), torch.float32
    check_grad = _checks_grad(opinfo, dtype)
    samples = _samples(opinfo, dtype, check_grad, first_only=True)
    if samples:
        result = run_sample(opinfo, samples[0], dtype, TARGET_OPSETS[0], entry, check_grad, TARGET_OPSETS[1:])
    else:
        result = SampleResult(Check("no-sample", "the OpInfo yields no float32 sample"), Check("n/a"), {}, {})
    outcomes = {TARGET_OPSETS[0]: (result.fwd, result.bwd)}
    outcomes.update({n: result.replays.get(n, (result.fwd, result.bwd)) for n in TARGET_OPSETS[1:]})
    for opset, (fwd, bwd) in outcomes.items():
        _RECORDS.append(
            coverage.SampleRecord(
                opinfo=name,
                opset=opset,
                fwd=fwd.outcome,
                bwd=bwd.outcome,
                detail=fwd.detail if fwd.outcome != "pass" else bwd.detail,
                fwd_ops={op: tuple(sorted(d)) for op, d in result.fwd_ops.items()},
                bwd_ops={op: tuple(sorted(d)) for op, d in result.bwd_ops.items()},
                no_compute=tuple(k for k in ("fwd", "bwd") if getattr(result, f"{k}_no_compute")),
                values_compared=result.values_compared,
                reason=_expected_reason(entry, dtype, opset, fwd, bwd),
            )
        )
    check_expectations(entry, dtype, outcomes)


# OpInfos checked on complex inputs too: those whose ops lower with complex tensors (as real [..., 2] pairs,
# aot2onnx.lower.ops.complex and fft). The default run checks their first complex64 sample; the slow run every
# complex64 and complex128 sample.
COMPLEX_OPINFOS = tuple(name for name in (
    "abs", "add", "bmm", "cat", "clone", "conj_physical", "div.no_rounding_mode", "expand", "fft.fft", "fft.fft2", "fft.fftn", "fft.hfft",
    "fft.hfft2", "fft.hfftn", "fft.ifft", "fft.ifft2", "fft.ifftn", "fft.irfft", "fft.irfft2", "fft.irfftn", "flip",
    "imag", "mean", "mm", "mul", "narrow", "neg", "permute", "real", "reciprocal", "reshape", "roll", "select", "squeeze",
    "stack", "sub", "sum", "t", "transpose", "true_divide", "unsqueeze", "view", "view_as_real",
) if name in OPINFOS and torch.complex64 in OPINFOS[name].supported_dtypes("cpu"))
COMPLEX_DTYPES = (torch.complex64, torch.complex128)


@pytest.mark.parametrize("name", COMPLEX_OPINFOS)
def test_opinfo_complex(name: str) -> None:
    """The first complex64 sample, forward and backward, at opset 18 and (replayed) at the newer target opsets."""
    opinfo, entry, dtype = OPINFOS[name], ENTRIES.get(name, Entry()), torch.complex64
    check_grad = _checks_grad(opinfo, dtype)
    samples = _samples(opinfo, dtype, check_grad, first_only=True)
    assert samples, f"{name} yields no complex64 sample"
    result = run_sample(opinfo, samples[0], dtype, TARGET_OPSETS[0], entry, check_grad, TARGET_OPSETS[1:])
    outcomes = {TARGET_OPSETS[0]: (result.fwd, result.bwd)}
    outcomes.update({n: result.replays.get(n, (result.fwd, result.bwd)) for n in TARGET_OPSETS[1:]})
    check_expectations(entry, dtype, outcomes)


def _slow_params() -> list[Any]:
    return [
        pytest.param(name, dtype, id=f"{str(dtype).removeprefix('torch.')}-{name}")
        for name, opinfo in sorted(OPINFOS.items())
        for dtype in (*SLOW_DTYPES, *(COMPLEX_DTYPES if name in COMPLEX_OPINFOS else ()))
        if dtype in opinfo.supported_dtypes("cpu")
    ]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dtype"), _slow_params())
def test_opinfo_all_samples(name: str, dtype: torch.dtype) -> None:
    """Every sample, in every dtype the OpInfo supports among SLOW_DTYPES, at opset 18 and replayed at the newer ones."""
    opinfo, entry = OPINFOS[name], ENTRIES.get(name, Entry())
    check_grad = _checks_grad(opinfo, dtype)
    samples = _samples(opinfo, dtype, check_grad)
    if not samples:
        pytest.skip(f"the OpInfo yields no {dtype} sample")
    results = [run_sample(opinfo, s, dtype, TARGET_OPSETS[0], entry, check_grad, TARGET_OPSETS[1:]) for s in samples]
    outcomes = {}
    for opset in TARGET_OPSETS:
        per_sample = [(r.fwd, r.bwd) if opset == TARGET_OPSETS[0] else r.replays[opset] for r in results]
        fwd = _merge([f for f, _ in per_sample])
        bwd = _merge([b for f, b in per_sample if f.outcome not in ("no-eager", "no-kernel")])
        if fwd.outcome not in ("pass", "no-eager", "no-kernel") and bwd.outcome == "pass":
            bwd = Check("blocked")
        outcomes[opset] = (fwd, bwd)
    check_expectations(entry, dtype, outcomes)


def test_expectations_name_opinfos() -> None:
    stale = sorted(set(ENTRIES) - set(OPINFOS))
    if torch_behaviour.on_locked_torch():
        assert sorted(set(stale) - NEWER_OPINFOS) == [], f"opinfo_expectations.py has entries for OpInfos that do not exist: {stale}"
        assert sorted(NEWER_OPINFOS & set(OPINFOS)) == [], "NEWER_OPINFOS names OpInfos the locked torch has"
    # Another torch's OpInfo database may lack OpInfos of the locked torch's (those of torch 2.14's new ops on 2.11).
    for name, entry in ((n, e) for n, e in ENTRIES.items() if n not in stale):
        for x in entry.xfails:
            assert x.kind == "fwd" or _checks_grad(OPINFOS[name], torch.float32) or x.dtypes, (
                f"{name}: a bwd xfail for an OpInfo without float32 gradients"
            )


def test_opset_tables() -> None:
    """opset_tables/ is exactly what this session's default sweep generates (``python -m aot2onnx coverage``)."""
    if not torch_behaviour.on_locked_torch():  # the tables count the OpInfos of one torch's database
        pytest.skip(f"opset_tables/ are generated on requirements.lock's torch {torch_behaviour.LOCKED_TORCH}, "
                    f"not {torch.__version__}")
    covered = {(r.opinfo, r.opset) for r in _RECORDS}
    wanted = {(name, opset) for name in OPINFOS for opset in TARGET_OPSETS}
    missing = wanted - covered
    if missing:
        pytest.skip(f"needs the whole default sweep in this session ({len(missing)} OpInfo runs missing)")
    start = time.perf_counter()
    tables = coverage.render_tables(_RECORDS, TARGET_OPSETS)
    if os.environ.get(coverage.REGENERATE_ENV):
        coverage.write_tables(tables)
        return
    problems = []
    for path, text in tables.items():
        current = path.read_text() if path.exists() else ""
        if current != text:
            diff = difflib.unified_diff(current.splitlines(), text.splitlines(), str(path), "generated", lineterm="", n=0)
            problems.append("\n".join(list(diff)[:40]))
    stale = sorted(set(coverage.TABLES_DIR.glob("opset*.md")) - set(tables))
    if stale:
        problems.append(f"tables for opsets that are no longer targets: {[p.name for p in stale]}")
    assert not problems, (
        "opset_tables/ differs from what the sweep generates; regenerate with `python -m aot2onnx coverage`\n"
        + "\n".join(problems)
        + f"\n(rendered in {time.perf_counter() - start:.1f}s)"
    )

