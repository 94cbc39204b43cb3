"""The training export's capture: AOTAutograd's joint forward-backward graph of a module whose first output is
the loss, partitioned into a forward and a backward graph (``torch.compile`` captures through
:func:`aot2onnx.capture.aot.capture`; both trace attention the same way and use the same decompositions).

Nothing about ONNX here: the caller's ``compile_graph`` receives each partitioned graph.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from unittest import mock

import sympy
import torch
import torch.fx
import torch.nn as nn
from torch.fx.passes.runtime_assert import insert_deferred_runtime_asserts

from aot2onnx.capture._torch_compat import (
    FAKE_CONV_HINT,
    DimDynamic,
    FakeTensorMode,
    ShapeEnv,
    StatelessSymbolicContext,
    aot_compile_joint_with_descriptors,
    aot_export_joint_with_descriptors,
    compiling_state_context,
    fake_impls,
    fx_config,
    int_oo,
    linalg_checks_kept,
    symbolic_shapes,
)
from aot2onnx.capture.aot import math_attention, partition_function
from aot2onnx.errors import CaptureError
from aot2onnx.signature import GraphKind

__all__ = ["JointTrace", "WRAPPER_PREFIX", "trace_joint"]

WRAPPER_PREFIX = "module."  # _LossFirst registers the user's module under this name


@dataclasses.dataclass
class JointTrace:
    """What the trace learnt besides the graphs."""

    batch_symbol: str | None  # the batch's tracing symbol (None without a dynamic batch)
    batch: dict | None  # {"example", "min", "max"}: the batch sizes the graphs hold for
    dynamic: list[bool]  # per input: is its first dim the batch?
    returns: str  # "loss" or "tuple": what the module returned


class _LossFirst(nn.Module):
    """The user's module, returning ``(loss, *user_outputs)`` with every output but the loss detached.

    Detached outputs need no tangent, so the joint graph differentiates the loss alone, which is what a
    training step does.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.returns = "loss"  # or "tuple": what the module returned while traced

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.module(*inputs)
        outputs = (out,) if isinstance(out, torch.Tensor) else tuple(out) if isinstance(out, (tuple, list)) else None
        if not outputs or not all(isinstance(o, torch.Tensor) for o in outputs):
            raise CaptureError(
                f"export_training needs module(*inputs) to return the loss tensor or a tuple (loss, *outputs) of "
                f"tensors; {type(self.module).__name__} returned {type(out).__name__}"
            )
        loss = outputs[0]
        if loss.numel() != 1 or not loss.is_floating_point() or not loss.requires_grad:
            raise CaptureError(
                f"the first output of {type(self.module).__name__} must be the scalar floating-point loss that "
                f"depends on trainable parameters; got {loss.dtype}{list(loss.shape)} "
                f"(requires_grad={loss.requires_grad})"
            )
        self.returns = "loss" if isinstance(out, torch.Tensor) else "tuple"
        return (loss if loss.dim() == 0 else loss.reshape(()), *(o.detach() for o in outputs[1:]))


def _fake_inputs(example_inputs: Sequence[torch.Tensor], dynamic_batch: bool) -> tuple[list, ShapeEnv, Any, int | None, list[bool]]:
    """Fake copies of the inputs; with ``dynamic_batch``, one symbol for every leading dim equal to the first
    input's (the batch)."""
    shape_env = ShapeEnv()
    fake_mode = FakeTensorMode(shape_env=shape_env)
    batch = None
    if dynamic_batch and example_inputs and example_inputs[0].dim() >= 1:
        batch = int(example_inputs[0].shape[0])
        if batch < 2:
            raise CaptureError(
                f"dynamic_batch=True needs an example batch of at least 2 (got {batch}): torch specialises sizes "
                "0 and 1. Export with a larger example batch, or with dynamic_batch=False"
            )
    fakes, symbol, flags = [], None, []
    for x in example_inputs:
        dynamic = batch is not None and x.dim() >= 1 and x.shape[0] == batch
        flags.append(dynamic)
        # DUCK, not DYNAMIC: dims of equal size share one symbol, so every batch dim is the same ``batch``.
        sizes = [DimDynamic.DUCK if dynamic and i == 0 else DimDynamic.STATIC for i in range(x.dim())]
        fake = fake_mode.from_tensor(x, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes))
        if dynamic:
            if symbol is not None and fake.shape[0].node.expr != symbol:
                raise AssertionError(f"two symbols for the batch: {symbol} and {fake.shape[0].node.expr}")
            symbol = fake.shape[0].node.expr
        fakes.append(fake)
    return fakes, shape_env, symbol, batch, flags


def trace_joint(
    module: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    dynamic_batch: bool,
    decompositions: Mapping,
    compile_graph: Callable[[GraphKind, torch.fx.GraphModule], None],
    stage: Callable[[str], contextlib.AbstractContextManager] = lambda _: contextlib.nullcontext(),
) -> JointTrace:
    """Traces ``module``'s joint graph with AOTAutograd and partitions it (min-cut); ``compile_graph`` gets the
    forward and the backward graph. ``stage(text)`` wraps the trace (a progress line)."""
    wrapper = _LossFirst(module)
    with fx_config.patch(backed_size_oblivious=True):  # read when the batch symbol is made (see below)
        fakes, shape_env, symbol, batch, dynamic = _fake_inputs(example_inputs, dynamic_batch)
    kinds: list[GraphKind] = []

    def compiler(kind: GraphKind, gm: torch.fx.GraphModule, _inputs: Sequence[Any]) -> Callable:
        kinds.append(kind)
        compile_graph(kind, gm)

        def never_called(args: list[Any]) -> list[Any]:
            raise AssertionError("an exported joint graph is not run")

        never_called._boxed_call = True  # type: ignore[attr-defined]
        return never_called

    with contextlib.ExitStack() as stack:
        stack.enter_context(math_attention())
        stack.enter_context(linalg_checks_kept())
        stack.enter_context(_convolutions_without_layout_guards())
        # Sizes 0 and 1 are not specialised away: a batch of 1 stays possible, and where the trace does
        # depend on it, the guard says so (see _admits_one).
        stack.enter_context(fx_config.patch(backed_size_oblivious=True))
        stack.enter_context(torch.enable_grad())  # the joint graph needs autograd, even if the caller is in no_grad
        with stage("tracing the joint forward-backward graph with AOTAutograd"):
            try:
                # torch.compiler.is_compiling() and is_exporting() are True while the module runs, as in
                # torch.export's non-strict trace: libraries then take the paths written for a graph that must
                # hold for every input, instead of branching on values (transformers' mask helpers call
                # .all() on the attention or position ids otherwise, which a trace cannot decide).
                with compiling_state_context():
                    joint = aot_export_joint_with_descriptors(
                        stack, wrapper, tuple(fakes), decompositions=decompositions
                    )
            except CaptureError:
                raise
            except Exception as e:
                raise CaptureError(f"AOTAutograd could not trace {type(module).__name__}'s joint graph: {e}") from e
        metadata = joint._aot_state.fw_metadata
        _check_metadata(metadata, module)
        if symbol is not None:
            specialised = shape_env.replacements.get(symbol)
            if specialised is not None and specialised.is_number:
                raise CaptureError(
                    f"{type(module).__name__} fixes the batch size to {specialised} while tracing (a view, reshape or "
                    "size check on the batch dimension). Make it use the input's size, or export with "
                    "dynamic_batch=False"
                )
            # Binds each input size symbol to a sym_size node after the placeholders, as Dynamo does for the
            # graphs it hands AOTAutograd; the partitioner's passes look symbols up in the graph.
            insert_deferred_runtime_asserts(joint.graph_module, shape_env, "aot2onnx export")
        aot_compile_joint_with_descriptors(
            joint,
            partition_fn=partition_function("min_cut"),
            fw_compiler=lambda gm, inputs: compiler(GraphKind.FORWARD, gm, inputs),
            bw_compiler=lambda gm, inputs: compiler(GraphKind.BACKWARD, gm, inputs),
        )
    if sorted(kinds) != [GraphKind.BACKWARD, GraphKind.FORWARD]:
        raise CaptureError(f"AOTAutograd produced the graphs {sorted(kinds)}; a training export needs forward and backward")

    if symbol is None:
        return JointTrace(None, None, dynamic, wrapper.returns)
    bounds = shape_env.var_to_range.get(symbol)
    upper = None if bounds is None or bounds.upper == int_oo else int(bounds.upper)
    lower = 1 if bounds is None or bounds.lower == -int_oo else max(1, int(bounds.lower))
    if lower == 1 and (not _admits_one(shape_env, symbol) or not _eager_runs_one(module, example_inputs, dynamic)):
        lower = 2
    return JointTrace(str(symbol), {"example": batch, "min": lower, "max": upper}, dynamic, wrapper.returns)


_CONVOLUTIONS = (
    torch.ops.aten.convolution.default,
    torch.ops.aten._convolution.default,
    torch.ops.aten._convolution.deprecated,
    torch.ops.aten.convolution_backward.default,
)


@contextlib.contextmanager
def _convolutions_without_layout_guards() -> Any:
    """Fake convolutions that do not guard the batch size.

    FakeTensor's convolution picks its output's memory format as eager's CPU kernel would, and to do so
    asks ``torch._C._select_conv_backend``, whose oneDNN heuristic compares the batch size with 16: the
    comparison became a guard, and an artifact exported with an example batch below 16 accepted [2, 15],
    one exported with 16 or more [16, inf). An ONNX model has no memory formats, so the fake convolution
    is told the sizes have no hint, and takes its layout-free path.
    """

    def without_hints(impl: Callable) -> Callable:
        def conv(*args: Any, **kwargs: Any) -> Any:
            with mock.patch.object(symbolic_shapes, FAKE_CONV_HINT, lambda *_: False):
                return impl(*args, **kwargs)

        return conv

    table = fake_impls.op_implementations_dict
    patched = {op: without_hints(table[op]) for op in _CONVOLUTIONS if op in table}
    with mock.patch.dict(table, patched):
        yield


def _admits_one(shape_env: ShapeEnv, symbol: Any) -> bool:
    """Whether the trace holds for a batch of 1: no guard it recorded is false there.

    The trace runs with size-oblivious reasoning for backed sizes (``backed_size_oblivious``): a batch
    symbol ranges over [0, inf) instead of [2, inf), and a decision that did depend on the batch being 1
    or not is recorded as a guard (``Ne(s0, 1)``), which this checks.
    """
    for guard in shape_env.guards:
        if symbol in guard.expr.free_symbols and guard.expr.subs(symbol, 1) == sympy.false:
            return False
    return True


def _eager_runs_one(module: nn.Module, example_inputs: Sequence[torch.Tensor], dynamic: list[bool]) -> bool:
    """Whether eager accepts a batch of 1: some models refuse one by their data, not their shapes (training
    BatchNorm over a single value per channel), and an artifact cannot raise as eager does."""
    inputs = [x[:1] if flag else x for x, flag in zip(example_inputs, dynamic)]
    copy_ = copy.deepcopy(module)
    try:
        with torch.no_grad():
            copy_(*inputs)
    except Exception:  # eager's own refusal, whatever it is: the artifact keeps the batch at 2 or more
        return False
    return True


def _check_metadata(metadata: Any, module: nn.Module) -> None:
    """Refuses what a pair of ONNX models cannot express.

    Outputs that alias inputs or each other need no refusal: the models return values, and a device has no
    views whose aliasing could be observed.
    """
    if metadata.tokens:
        raise CaptureError(f"{type(module).__name__} calls side-effecting ops (effect tokens); they cannot be exported")
