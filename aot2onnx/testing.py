"""Parity of training through aot2onnx against eager PyTorch."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from aot2onnx.capture._torch_compat import tree_leaves
from aot2onnx.compile.fallback import fallback_graphs, reset_fallback_graphs
from aot2onnx.runtime.session import OrtGraph, compiled_graphs, reset_compiled_graphs

__all__ = ["EffectsReport", "ParityReport", "assert_parity", "assert_same_effects", "HEAVY_ATEN_OPS"]

# Ops that, if torch ran them during a compiled forward/backward, would mean model compute ran in eager.
HEAVY_ATEN_OPS = frozenset(
    "aten::" + name
    for name in (
        "mm addmm bmm baddbmm matmul linear convolution _convolution convolution_backward cudnn_convolution "
        "mkldnn_convolution native_layer_norm native_layer_norm_backward _softmax _softmax_backward_data "
        "native_batch_norm _native_batch_norm_legit _native_batch_norm_legit_functional native_batch_norm_backward "
        "max_pool2d_with_indices max_pool2d_with_indices_backward embedding embedding_dense_backward gelu "
        "gelu_backward relu threshold_backward scaled_dot_product_attention "
        "_scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_flash_attention_for_cpu_backward"
    ).split()
)


@dataclasses.dataclass
class Mismatch:
    what: str  # loss, grad, input grad, parameter, buffer
    name: str
    step: int
    max_abs: float
    max_rel: float
    shape: tuple[int, ...]


@dataclasses.dataclass
class ParityReport:
    eager_losses: list[float]
    compiled_losses: list[float]
    compared: int  # how many tensors were compared
    mismatches: list[Mismatch]
    graphs: list[OrtGraph]
    torch_heavy_ops: list[str]  # heavy ATen ops torch ran during a compiled forward/backward

    @property
    def ort_runs(self) -> int:
        return sum(g.runs for g in self.graphs)

    def table(self) -> str:
        rows = [("what", "name", "step", "max |diff|", "max rel", "shape")]
        rows += [(m.what, m.name, str(m.step), f"{m.max_abs:.3e}", f"{m.max_rel:.3e}", str(list(m.shape)))
                 for m in self.mismatches]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def _compare(what: str, name: str, step: int, eager: torch.Tensor | None, compiled: torch.Tensor | None,
             rtol: float, atol: float, out: list[Mismatch]) -> int:
    if eager is None and compiled is None:
        return 0
    if eager is None or compiled is None:
        out.append(Mismatch(what, f"{name} (None on one side)", step, float("inf"), float("inf"), ()))
        return 1
    eager, compiled = eager.detach(), compiled.detach()
    if eager.shape != compiled.shape or eager.dtype != compiled.dtype:
        out.append(Mismatch(what, f"{name} ({compiled.dtype}{list(compiled.shape)} vs eager "
                                  f"{eager.dtype}{list(eager.shape)})", step, float("inf"), float("inf"),
                            tuple(eager.shape)))
        return 1
    if eager.dtype == torch.bool or not eager.is_floating_point():
        diff = (eager != compiled).to(torch.float64)
        if diff.any():
            out.append(Mismatch(what, name, step, float(diff.sum()), 1.0, tuple(eager.shape)))
        return 1
    e, c = eager.to(torch.float64), compiled.to(torch.float64)
    if not torch.allclose(c, e, rtol=rtol, atol=atol, equal_nan=True):
        diff = (c - e).abs()
        rel = diff / e.abs().clamp_min(1e-30)
        out.append(Mismatch(what, name, step, float(diff.max()), float(rel.max()), tuple(eager.shape)))
    return 1


def _batches(inputs: Any, steps: int) -> list[tuple]:
    if callable(inputs):
        return [tuple(inputs(i)) for i in range(steps)]
    if isinstance(inputs, torch.Tensor):
        return [(inputs,)] * steps
    if isinstance(inputs, tuple):
        return [inputs] * steps
    batches = [b if isinstance(b, tuple) else (b,) for b in inputs]
    return [batches[i % len(batches)] for i in range(steps)]


def _copy_batch(batch: tuple) -> tuple:
    # Each side gets its own copy, keeping requires_grad, so input gradients and input mutations are separate.
    return tuple(
        x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else copy.deepcopy(x)
        for x in batch
    )


def assert_parity(
    model_factory: Callable[[], torch.nn.Module],
    inputs: Any,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    targets: Sequence[Any] | None = None,
    steps: int = 10,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    backend: Any = "aot2onnx",
    seed: int = 0,
    check_torch_ops: bool = True,
    allow_fallback: bool = False,
) -> ParityReport:
    """Trains an eager copy and a ``torch.compile(backend=...)`` copy of one model side by side.

    Args:
        model_factory: Builds the model; called once (under ``torch.manual_seed(seed)``), then deep-copied,
            so both copies start from the same state.
        inputs: A tuple of model arguments used at every step, a list of such tuples (cycled), or a
            function ``step -> tuple``. Tensors that require grad have their gradients compared too.
        loss_fn: ``loss_fn(output)`` or, with ``targets``, ``loss_fn(output, targets[step])``. By default
            the output must be the loss.
        steps: Optimizer steps to train.
        rtol, atol: The tolerance of every comparison: ``|compiled - eager| <= atol + rtol * |eager|``.
        optimizer: ``params -> torch.optim.Optimizer``; SGD with lr=0.1 by default.
        check_torch_ops: Profile one compiled step and fail if torch ran model compute (see
            ``HEAVY_ATEN_OPS``) instead of ONNX Runtime.
        allow_fallback: Accept graphs split by the per-node fallback (some nodes ran in PyTorch); by
            default that fails the check, naming the ops.

    Compares the loss at every step, every parameter gradient and input gradient at step 1, and the
    parameters, buffers and inputs after the last step. Raises ``AssertionError`` with a table of every
    mismatch; also when no ONNX Runtime session ran. Returns the report otherwise. Where tensors differ and
    the backend is aot2onnx's, the message also holds :func:`aot2onnx.parity.compare`'s summary of the first
    step from the same initial state: the first node of the forward and of the backward graphs whose own
    error is beyond tolerance, with the user's source line.
    """
    optimizer = optimizer or (lambda params: torch.optim.SGD(params, lr=0.1))
    loss_fn = loss_fn or (lambda out, *_: out)
    torch.compiler.reset()
    reset_compiled_graphs()
    reset_fallback_graphs()
    torch.manual_seed(seed)
    eager_model = model_factory()
    compiled_model = copy.deepcopy(eager_model)
    compiled = torch.compile(compiled_model, backend=backend)
    opt_e, opt_c = optimizer(eager_model.parameters()), optimizer(compiled_model.parameters())
    batches = _batches(inputs, steps)
    mismatches: list[Mismatch] = []
    compared = 0
    eager_losses, compiled_losses = [], []
    heavy: list[str] = []

    for step, batch in enumerate(batches, start=1):
        args_e, args_c = _copy_batch(batch), _copy_batch(batch)
        extra = (targets[(step - 1) % len(targets)],) if targets is not None else ()
        torch.manual_seed(seed + step)
        loss_e = loss_fn(eager_model(*args_e), *extra)
        opt_e.zero_grad()
        loss_e.backward()
        torch.manual_seed(seed + step)
        loss_c = loss_fn(compiled(*args_c), *extra)
        opt_c.zero_grad()
        loss_c.backward()
        eager_losses.append(float(loss_e.detach()))
        compiled_losses.append(float(loss_c.detach()))
        compared += _compare("loss", "loss", step, loss_e, loss_c, rtol, atol, mismatches)
        if step == 1:
            for (name, p_e), (_, p_c) in zip(eager_model.named_parameters(), compiled_model.named_parameters()):
                compared += _compare("grad", name, step, p_e.grad, p_c.grad, rtol, atol, mismatches)
            for i, (x_e, x_c) in enumerate(zip(args_e, args_c)):
                if isinstance(x_e, torch.Tensor) and x_e.requires_grad:
                    compared += _compare("input grad", f"input {i}", step, x_e.grad, x_c.grad, rtol, atol, mismatches)
        opt_e.step()
        opt_c.step()
        if step == len(batches):
            for i, (x_e, x_c) in enumerate(zip(args_e, args_c)):
                if isinstance(x_e, torch.Tensor):
                    compared += _compare("input", f"input {i}", step, x_e, x_c, rtol, atol, mismatches)

    for (name, p_e), (_, p_c) in zip(eager_model.named_parameters(), compiled_model.named_parameters()):
        compared += _compare("parameter", name, len(batches), p_e, p_c, rtol, atol, mismatches)
    for (name, b_e), (_, b_c) in zip(eager_model.named_buffers(), compiled_model.named_buffers()):
        compared += _compare("buffer", name, len(batches), b_e, b_c, rtol, atol, mismatches)

    if check_torch_ops:
        # After every comparison: this extra forward/backward changes the compiled copy's state.
        heavy = _heavy_ops_run_by_torch(compiled, batches[0])
    report = ParityReport(eager_losses, compiled_losses, compared, mismatches, compiled_graphs(), heavy)
    problems = []
    if mismatches:
        problems.append(f"{len(mismatches)} of {compared} compared tensors differ from eager "
                        f"(rtol={rtol}, atol={atol}):\n{report.table()}")
        options = _aot2onnx_options(backend)
        if options is not None:
            problems.append(_where_they_part(model_factory, batches[0], loss_fn, targets, options, rtol, atol, seed))
    if backend == "aot2onnx" or getattr(backend, "func", None) is not None:
        if not report.graphs or report.ort_runs == 0:
            problems.append("no ONNX Runtime session ran")
        elif any(g.runs == 0 for g in report.graphs):
            problems.append(f"graphs compiled but never run: {[g.name for g in report.graphs if g.runs == 0]}")
    if heavy:
        problems.append(f"torch itself ran model compute during a compiled step: {heavy}")
    fallen_back = sorted({t for g in fallback_graphs() for t in g.fallen_back})
    if fallen_back and not allow_fallback:
        problems.append(f"ops without a lowering ran in PyTorch (per-node fallback): {fallen_back}")
    if problems:
        raise AssertionError("\n".join(problems))
    return report


def _aot2onnx_options(backend: Any) -> dict[str, Any] | None:
    """The options of an aot2onnx backend (``"aot2onnx"``, ``aot2onnx.backend(...)``); None for another backend."""
    if backend == "aot2onnx":
        return {}
    options = getattr(backend, "keywords", {}).get("options") if getattr(backend, "func", None) is not None else None
    if options is None:
        return None
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}


def _where_they_part(model_factory: Callable[[], torch.nn.Module], batch: tuple, loss_fn: Callable[..., torch.Tensor],
                     targets: Sequence[Any] | None, options: dict[str, Any], rtol: float, atol: float, seed: int) -> str:
    """The parity report of the first step, from the same initial state: the first node of the forward and of
    the backward graphs where ONNX Runtime and eager part, with the user's source line."""
    from aot2onnx.parity import compare

    try:
        torch.manual_seed(seed)
        model = model_factory()
        report = compare(model, _copy_batch(batch), loss_fn=loss_fn,
                         targets=targets[0] if targets is not None else None, options=options, rtol=rtol, atol=atol,
                         seed=seed + 1)
    except Exception as e:  # the diagnosis must not hide the failure it explains
        return f"aot2onnx.parity could not compare the first step node by node: {type(e).__name__}: {e}"
    return "aot2onnx.parity, the first step node by node:\n" + report.summary()


def _heavy_ops_run_by_torch(compiled: Callable, batch: tuple) -> list[str]:
    """Heavy ATen ops that torch itself runs during one compiled forward and backward.

    Only the compiled call and the backward through its outputs are profiled: a loss computed in the
    user's code runs eagerly by design and is not held against the model.
    """
    args = _copy_batch(batch)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with _quiet_stderr():  # the profiler's C++ side prints a line on start and on stop
        prof.start()
    try:
        outputs = [o for o in tree_leaves(compiled(*args))
                   if isinstance(o, torch.Tensor) and o.requires_grad]
        if outputs:
            torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
    finally:
        with _quiet_stderr():
            prof.stop()
    return sorted({e.key for e in prof.key_averages()} & HEAVY_ATEN_OPS)


@contextlib.contextmanager
def _quiet_stderr():
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# ----------------------------------------------------------------------------------------------------------
# Side effects of one call: outputs, gradients, input mutations (data and metadata), aliasing.


@dataclasses.dataclass
class EffectsReport:
    """What :func:`assert_same_effects` compared, for the caller to inspect or assert more on."""

    eager_outputs: list[Any]
    compiled_outputs: list[Any]
    compared: list[str]  # one line per comparison made
    graphs: list[OrtGraph]


def _tensor_leaves(value: Any) -> list[Any]:
    return tree_leaves(value)


def _autograd_leaves(args: Sequence[Any]) -> list[torch.Tensor]:
    """The leaf tensors requiring grad that ``args`` come from (themselves, their bases, what they were computed from)."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def visit(fn: Any) -> None:
        if fn is None or id(fn) in seen:
            return
        seen.add(id(fn))
        variable = getattr(fn, "variable", None)
        if isinstance(variable, torch.Tensor):
            found.setdefault(id(variable), variable)
        for next_fn, _ in fn.next_functions:
            visit(next_fn)

    for x in args:
        if not isinstance(x, torch.Tensor) or not x.requires_grad:
            continue
        if x.is_leaf:
            found.setdefault(id(x), x)
        else:
            visit(x.grad_fn)
    return list(found.values())


def _storage_key(t: torch.Tensor) -> int | None:
    if t.numel() == 0 or t.is_sparse:
        return None
    return t.untyped_storage().data_ptr()


def _aliasing(outputs: list[Any], args: Sequence[Any]) -> list[tuple]:
    """Per tensor output: (input positions sharing its storage, earlier outputs sharing it, is it a view)."""
    in_keys = [_storage_key(a) if isinstance(a, torch.Tensor) else None for a in args]
    out_keys = [_storage_key(o) if isinstance(o, torch.Tensor) else None for o in outputs]
    result = []
    for i, o in enumerate(outputs):
        if not isinstance(o, torch.Tensor):
            result.append(None)
            continue
        key = out_keys[i]
        inputs = tuple(j for j, k in enumerate(in_keys) if key is not None and k == key)
        earlier = tuple(j for j in range(i) if key is not None and out_keys[j] == key)
        shared = bool(inputs) or any(j != i and k == key for j, k in enumerate(out_keys) if key is not None)
        # A view whose base is neither an input nor another output is unobservable: AOTAutograd (with any
        # backend) may hand it back as a fresh tensor, so it is recorded as "no view".
        result.append((inputs, earlier, shared and o._base is not None))
    return result


def assert_same_effects(
    fn: Callable[..., Any],
    make_inputs: Callable[[], Sequence[Any]],
    *,
    backend: Any = "aot2onnx",
    dynamic: bool | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    grad: bool = True,
    mutate_outputs: bool = True,
    seed: int = 0,
) -> EffectsReport:
    """Calls ``fn`` eagerly and through ``torch.compile(backend=...)`` and checks that nothing differs.

    ``make_inputs()`` is called once per side (after ``torch.manual_seed(seed)``) and must build equal,
    independent inputs; it can build aliasing ones (``a, a.view(-1)``). ``fn`` may be an ``nn.Module``: the
    compiled side runs a deep copy, and its parameters' gradients and its buffers are compared too.

    Compared, in order:
      1. the outputs: values, dtypes, shapes, and for outputs that alias an input, strides;
      2. aliasing: for each output, which inputs and which earlier outputs share its storage, and whether
         it is a view (has a ``_base``) of something the caller can see;
      3. every tensor input after the call: contents, shape, strides (data and metadata mutations);
      4. with ``grad``: after a backward pass with random cotangents through the outputs that require
         grad, the gradient of every autograd leaf the inputs come from, and of the module's parameters;
      5. with ``mutate_outputs``: after ``out.add_(1)`` on every floating output (under ``no_grad``), the
         inputs again, so that a returned view of an input is a real view of it.
    Also asserts that ONNX Runtime ran at least one compiled graph.
    """
    compared: list[str] = []

    def check_tensor(what: str, e: Any, c: Any, strides: bool) -> None:
        if not isinstance(e, torch.Tensor):
            assert e == c, f"{what}: {c!r} != eager {e!r}"
            compared.append(what)
            return
        assert isinstance(c, torch.Tensor), f"{what}: compiled gave {type(c).__name__}, eager a tensor"
        assert c.dtype == e.dtype, f"{what}: dtype {c.dtype} != eager {e.dtype}"
        assert c.shape == e.shape, f"{what}: shape {tuple(c.shape)} != eager {tuple(e.shape)}"
        if strides:
            assert c.stride() == e.stride(), f"{what}: strides {c.stride()} != eager {e.stride()}"
        torch.testing.assert_close(c.detach(), e.detach(), rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}: {m}")
        compared.append(what)

    reset_compiled_graphs()
    torch.manual_seed(seed)
    args_e = tuple(make_inputs())
    torch.manual_seed(seed)
    args_c = tuple(make_inputs())
    is_module = isinstance(fn, torch.nn.Module)
    fn_c = copy.deepcopy(fn) if is_module else fn
    compiled = torch.compile(fn_c, backend=backend, dynamic=dynamic)

    torch.manual_seed(seed + 1)
    out_e = _tensor_leaves(fn(*args_e))
    torch.manual_seed(seed + 1)
    out_c = _tensor_leaves(compiled(*args_c))
    assert len(out_c) == len(out_e), f"{len(out_c)} outputs, eager gave {len(out_e)}"

    alias_e, alias_c = _aliasing(out_e, args_e), _aliasing(out_c, args_c)
    for i, (e, c) in enumerate(zip(out_e, out_c)):
        check_tensor(f"output {i}", e, c, strides=bool(alias_e[i] and alias_e[i][0]))
        assert alias_c[i] == alias_e[i], (
            f"output {i} aliasing (inputs, earlier outputs, is a view): {alias_c[i]} != eager {alias_e[i]}"
        )
        compared.append(f"output {i} aliasing")
        if isinstance(e, torch.Tensor):
            assert c.requires_grad == e.requires_grad, f"output {i}: requires_grad {c.requires_grad} != eager"

    def check_inputs(when: str) -> None:
        for i, (e, c) in enumerate(zip(args_e, args_c)):
            if isinstance(e, torch.Tensor):
                check_tensor(f"input {i} {when}", e, c, strides=True)
        if is_module:
            for (name, b_e), (_, b_c) in zip(fn.named_buffers(), fn_c.named_buffers()):
                check_tensor(f"buffer {name} {when}", b_e, b_c, strides=True)
            for (name, p_e), (_, p_c) in zip(fn.named_parameters(), fn_c.named_parameters()):
                check_tensor(f"parameter {name} {when}", p_e, p_c, strides=True)

    check_inputs("after the call")

    if grad:
        diff_e = [o for o in out_e if isinstance(o, torch.Tensor) and o.requires_grad]
        diff_c = [o for o in out_c if isinstance(o, torch.Tensor) and o.requires_grad]
        if diff_e:
            g = torch.Generator().manual_seed(seed + 2)
            cotangents = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in diff_e]
            torch.autograd.backward(diff_e, cotangents)
            torch.autograd.backward(diff_c, [t.clone() for t in cotangents])
            leaves_e, leaves_c = _autograd_leaves(args_e), _autograd_leaves(args_c)
            assert len(leaves_e) == len(leaves_c)
            for i, (e, c) in enumerate(zip(leaves_e, leaves_c)):
                check_tensor(f"grad of input leaf {i}", e.grad, c.grad, strides=False)
            if is_module:
                for (name, p_e), (_, p_c) in zip(fn.named_parameters(), fn_c.named_parameters()):
                    if p_e.grad is not None or p_c.grad is not None:
                        check_tensor(f"grad of {name}", p_e.grad, p_c.grad, strides=False)

    if mutate_outputs:
        with torch.no_grad():
            for i, (e, c) in enumerate(zip(out_e, out_c)):
                if isinstance(e, torch.Tensor) and e.is_floating_point():
                    # Some outputs may not be mutated (a view from a multi-output view op): then
                    # neither side may allow it.
                    try:
                        e.add_(1)
                    except RuntimeError as err:
                        try:
                            c.add_(1)
                        except RuntimeError:
                            continue
                        raise AssertionError(f"output {i}: eager refuses add_ ({err}), compiled allows it") from None
                    c.add_(1)
        check_inputs("after mutating the outputs")
        for i, (e, c) in enumerate(zip(out_e, out_c)):
            check_tensor(f"output {i} after mutating the outputs", e, c, strides=False)

    graphs = compiled_graphs()
    assert graphs and any(g.runs for g in graphs), "no ONNX Runtime session ran"
    return EffectsReport(out_e, out_c, compared, graphs)
