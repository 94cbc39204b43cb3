"""Every private name of PyTorch's compiler stack that aot2onnx uses: AOTAutograd and functorch, Dynamo,
Inductor, FakeTensor, ``torch.fx.experimental``, ``torch._export``, ``torch._decomp`` and ``torch._C``.

aot2onnx drives AOTAutograd from inside (its compilers, partitioners, cache and descriptors) and Dynamo's
callbacks, and none of that is public: a torch release may move or reshape any of it. Those names are
imported here and nowhere else (``tests/test_torch_compat.py`` checks each one, and that no other module of
the package reaches into ``torch._``), so a move fails here, at import, naming the symbol, instead of in a
user's first compile. aot2onnx supports torch 2.11 to 2.14; where those releases differ, the difference is
settled below, beside the name, and said in the log where a feature works less well on the older torch.
(``torch._ops.OpOverload`` and its kin, the types of ``torch.ops.aten.*`` that lowering rules are keyed by,
are left out: they are how ``torch.library`` names ops, and have kept their place since torch 1.x.)
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "AOTAUTOGRAD_CACHE_PREFIX",
    "AOTAutogradCache",
    "AOTAutogradCacheDetails",
    "AOTAutogradCachePickler",
    "BypassAOTAutogradCache",
    "CallbackArgs",
    "CallbackTrigger",
    "ConvertFrameAssert",
    "DimDynamic",
    "EffectType",
    "FAKE_CONV_HINT",
    "FakeTensorMode",
    "GRAPH_BREAK_NOTES",
    "after_dynamo_reset",
    "GmWrapper",
    "LINALG_CHECK",
    "OutputCode",
    "SYMBOLS",
    "SerializableAOTDispatchCompiler",
    "ShapeEnv",
    "StatelessSymbolicContext",
    "TracingContext",
    "aot_compile_joint_with_descriptors",
    "aot_descriptors",
    "aot_export_joint_with_descriptors",
    "aot_module_simplified",
    "autocast_supported_devices",
    "autograd_cache",
    "callback_handler",
    "check_node_safe",
    "chunked_loss_accumulator",
    "compiling_state_context",
    "counters",
    "decomposition_table",
    "default_partition",
    "fake_impls",
    "functorch_config",
    "get_effect",
    "fx_config",
    "graph_break_reasons",
    "graph_capture",
    "graph_compile",
    "inductor_config",
    "innermost_backend",
    "int_oo",
    "jit_get_all_schemas",
    "linalg_checks_kept",
    "make_fx",
    "min_cut_rematerialization_partition",
    "optimization_hint",
    "register_effectful_op",
    "sanitize_gm_for_cache",
    "symbolic_shapes",
    "tree_leaves",
    "unset_fake_temporarily",
]

logger = logging.getLogger("aot2onnx")

# Our name -> (torch's module, the symbol in it). Every entry is in every supported torch.
SYMBOLS: dict[str, tuple[str, str]] = {
    # AOTAutograd (functorch)
    "functorch_config": ("torch._functorch", "config"),
    "aot_module_simplified": ("torch._functorch.aot_autograd", "aot_module_simplified"),
    "aot_export_joint_with_descriptors": ("torch._functorch.aot_autograd", "aot_export_joint_with_descriptors"),
    "aot_compile_joint_with_descriptors": ("torch._functorch.aot_autograd", "aot_compile_joint_with_descriptors"),
    "default_partition": ("torch._functorch.partitioners", "default_partition"),
    "min_cut_rematerialization_partition": ("torch._functorch.partitioners", "min_cut_rematerialization_partition"),
    "graph_compile": ("torch._functorch._aot_autograd", "graph_compile"),
    "graph_capture": ("torch._functorch._aot_autograd", "graph_capture"),
    "aot_descriptors": ("torch._functorch._aot_autograd", "descriptors"),
    "SerializableAOTDispatchCompiler": ("torch._functorch._aot_autograd.schemas", "SerializableAOTDispatchCompiler"),
    "autograd_cache": ("torch._functorch._aot_autograd", "autograd_cache"),
    "AOTAutogradCache": ("torch._functorch._aot_autograd.autograd_cache", "AOTAutogradCache"),
    "AOTAutogradCacheDetails": ("torch._functorch._aot_autograd.autograd_cache", "AOTAutogradCacheDetails"),
    "AOTAutogradCachePickler": ("torch._functorch._aot_autograd.autograd_cache", "AOTAutogradCachePickler"),
    "BypassAOTAutogradCache": ("torch._functorch._aot_autograd.autograd_cache", "BypassAOTAutogradCache"),
    "check_node_safe": ("torch._functorch._aot_autograd.autograd_cache", "check_node_safe"),
    "sanitize_gm_for_cache": ("torch._functorch._aot_autograd.autograd_cache", "sanitize_gm_for_cache"),
    # Inductor: the base class AOTAutogradCache requires of a compiled graph; its configuration
    "OutputCode": ("torch._inductor.output_code", "OutputCode"),
    "inductor_config": ("torch._inductor", "config"),
    # Dynamo
    "counters": ("torch._dynamo.utils", "counters"),
    "GmWrapper": ("torch._dynamo.utils", "GmWrapper"),
    "TracingContext": ("torch._guards", "TracingContext"),
    # FakeTensor, symbolic shapes, tracing
    "FakeTensorMode": ("torch._subclasses.fake_tensor", "FakeTensorMode"),
    "unset_fake_temporarily": ("torch._subclasses.fake_tensor", "unset_fake_temporarily"),
    "fake_impls": ("torch._subclasses", "fake_impls"),
    "fx_config": ("torch.fx.experimental", "_config"),
    "symbolic_shapes": ("torch.fx.experimental", "symbolic_shapes"),
    "DimDynamic": ("torch.fx.experimental.symbolic_shapes", "DimDynamic"),
    "ShapeEnv": ("torch.fx.experimental.symbolic_shapes", "ShapeEnv"),
    "StatelessSymbolicContext": ("torch.fx.experimental.symbolic_shapes", "StatelessSymbolicContext"),
    "make_fx": ("torch.fx.experimental.proxy_tensor", "make_fx"),
    "int_oo": ("torch.utils._sympy.numbers", "int_oo"),
    "compiling_state_context": ("torch._export.utils", "_compiling_state_context"),
    "decomposition_table": ("torch._decomp", "decomposition_table"),
    "tree_leaves": ("torch.utils._pytree", "tree_leaves"),
    "EffectType": ("torch._higher_order_ops.effects", "_EffectType"),
    "get_effect": ("torch._higher_order_ops.effects", "_get_effect"),
    "register_effectful_op": ("torch._higher_order_ops.effects", "_register_effectful_op"),
    # torch._C
    "autocast_supported_devices": ("torch._C", "_autocast_supported_devices"),
    "jit_get_all_schemas": ("torch._C", "_jit_get_all_schemas"),
}

# Dynamo's callbacks and graph-break records, for compile/graph_breaks.py's notes: optional, as the notes are
# advice. A torch without one of them turns the notes off (said in the log), never compiling.
GRAPH_BREAK_SYMBOLS: dict[str, tuple[str, str]] = {
    "callback_handler": ("torch._dynamo.callback", "callback_handler"),
    "CallbackArgs": ("torch._dynamo.callback", "CallbackArgs"),
    "CallbackTrigger": ("torch._dynamo.callback", "CallbackTrigger"),
    "ConvertFrameAssert": ("torch._dynamo.convert_frame", "ConvertFrameAssert"),
    "innermost_backend": ("torch._dynamo.eval_frame", "innermost_backend"),
    "graph_break_reasons": ("torch._dynamo.utils", "graph_break_reasons"),
}


def _find(module_name: str, symbol: str) -> Any:
    module = importlib.import_module(module_name)
    if not hasattr(module, symbol):  # a submodule not imported yet
        importlib.import_module(f"{module_name}.{symbol}")
    return getattr(module, symbol)


def _resolve(name: str) -> Any:
    module_name, symbol = SYMBOLS[name]
    try:
        return _find(module_name, symbol)
    except (ImportError, AttributeError) as e:
        raise ImportError(
            f"aot2onnx needs {module_name}.{symbol} (a private name of PyTorch's compiler), which torch "
            f"{torch.__version__} does not have: {e}. aot2onnx supports torch 2.11 to 2.14 (pyproject.toml)."
        ) from e


functorch_config = _resolve("functorch_config")
aot_module_simplified = _resolve("aot_module_simplified")
aot_export_joint_with_descriptors = _resolve("aot_export_joint_with_descriptors")
aot_compile_joint_with_descriptors = _resolve("aot_compile_joint_with_descriptors")
default_partition = _resolve("default_partition")
min_cut_rematerialization_partition = _resolve("min_cut_rematerialization_partition")
graph_compile = _resolve("graph_compile")
graph_capture = _resolve("graph_capture")
aot_descriptors = _resolve("aot_descriptors")
SerializableAOTDispatchCompiler = _resolve("SerializableAOTDispatchCompiler")
autograd_cache = _resolve("autograd_cache")
AOTAutogradCache = _resolve("AOTAutogradCache")
AOTAutogradCacheDetails = _resolve("AOTAutogradCacheDetails")
AOTAutogradCachePickler = _resolve("AOTAutogradCachePickler")
BypassAOTAutogradCache = _resolve("BypassAOTAutogradCache")
check_node_safe = _resolve("check_node_safe")
sanitize_gm_for_cache = _resolve("sanitize_gm_for_cache")
OutputCode = _resolve("OutputCode")
inductor_config = _resolve("inductor_config")
counters = _resolve("counters")
GmWrapper = _resolve("GmWrapper")
TracingContext = _resolve("TracingContext")
FakeTensorMode = _resolve("FakeTensorMode")
unset_fake_temporarily = _resolve("unset_fake_temporarily")
fake_impls = _resolve("fake_impls")
fx_config = _resolve("fx_config")
symbolic_shapes = _resolve("symbolic_shapes")
DimDynamic = _resolve("DimDynamic")
ShapeEnv = _resolve("ShapeEnv")
StatelessSymbolicContext = _resolve("StatelessSymbolicContext")
make_fx = _resolve("make_fx")
int_oo = _resolve("int_oo")
compiling_state_context = _resolve("compiling_state_context")
decomposition_table = _resolve("decomposition_table")
tree_leaves = _resolve("tree_leaves")
EffectType = _resolve("EffectType")
get_effect = _resolve("get_effect")
register_effectful_op = _resolve("register_effectful_op")
autocast_supported_devices = _resolve("autocast_supported_devices")
jit_get_all_schemas = _resolve("jit_get_all_schemas")


def _graph_break_symbols() -> tuple[dict[str, Any], str | None]:
    found = {}
    for name, (module_name, symbol) in GRAPH_BREAK_SYMBOLS.items():
        try:
            found[name] = _find(module_name, symbol)
        except (ImportError, AttributeError) as e:
            return {}, f"{module_name}.{symbol}: {type(e).__name__}: {e}"
    return found, None


# None where every name is there; else what is missing (compile/graph_breaks.py then turns its notes off).
_graph_break_found, GRAPH_BREAK_NOTES = _graph_break_symbols()
callback_handler = _graph_break_found.get("callback_handler")
CallbackArgs = _graph_break_found.get("CallbackArgs", Any)
CallbackTrigger = _graph_break_found.get("CallbackTrigger")
ConvertFrameAssert = _graph_break_found.get("ConvertFrameAssert")
innermost_backend = _graph_break_found.get("innermost_backend")
graph_break_reasons = _graph_break_found.get("graph_break_reasons")


def after_dynamo_reset(fn: Callable[[], None]) -> None:
    """Calls ``fn`` each time ``torch._dynamo.reset()`` has cleared Dynamo's compile callbacks.

    reset() clears ``callback_handler``'s callbacks through its ``clear()`` (torch/_dynamo/__init__.py), and
    Dynamo offers no hook to run after it: the handler's ``clear`` is wrapped, on the instance, to call ``fn``
    after it (once per ``fn``, however often this is called). Without this, the callbacks would be registered
    again only when aot2onnx next compiles a graph, and a frame that Dynamo gives up before calling any backend
    (an RNN module: graph_breaks.py) would go unseen.
    """
    handler = callback_handler
    clear = handler.clear
    kept: list[Callable[[], None]] | None = getattr(clear, "_aot2onnx_after", None)
    if kept is not None:
        if fn not in kept:
            kept.append(fn)
        return
    after = [fn]

    def clear_then_call() -> None:
        clear()
        for f in after:
            f()

    clear_then_call._aot2onnx_after = after  # type: ignore[attr-defined]
    handler.clear = clear_then_call


# --- where the supported releases differ ------------------------------------------------------------------

# The prefix of AOTAutograd's cache keys: torch 2.13 names it in inductor's codecache; torch 2.11 and 2.12
# write the literal "a" in autograd_cache_key.
AOTAUTOGRAD_CACHE_PREFIX: str = getattr(_find("torch._inductor", "codecache"), "AOTAUTOGRAD_CACHE_PREFIX", "a")

# The function FakeTensor's convolution asks whether the sizes have a hint before it picks a memory layout
# (capture/joint.py patches it): ``has_guarding_hint`` from torch 2.13, ``has_hint`` before.
FAKE_CONV_HINT: str = "has_guarding_hint" if hasattr(symbolic_shapes, "has_guarding_hint") else "has_hint"



def _size_hint(a: Any, fallback: int | None = None) -> int:
    """torch 2.11's ``size_hint`` as torch 2.13's ``optimization_hint`` calls it: a data-dependent (unbacked)
    size gets inductor's ``unbacked_symint_fallback`` where ``size_hint`` alone raises."""
    return symbolic_shapes.size_hint(a, inductor_config.unbacked_symint_fallback if fallback is None else fallback)


# A size's value for choosing, without a guard: ``optimization_hint`` from torch 2.12, ``size_hint`` before.
optimization_hint = getattr(symbolic_shapes, "optimization_hint", None) or _size_hint



# ATen's check behind torch.linalg.inv, cholesky, solve, lu_factor... (raise on a singular input).
LINALG_CHECK = "aten::_linalg_check_errors"


@contextlib.contextmanager
def linalg_checks_kept() -> Iterator[None]:
    """A block in which AOTAutograd keeps linalg's error checks in the graphs it traces.

    torch 2.13 registers ``_linalg_check_errors`` as an ordered effect, so AOTAutograd keeps it (as
    ``with_effects``) though it returns nothing. torch 2.11 and 2.12 do not, and their AOTAutograd drops it:
    a compiled ``torch.linalg.inv`` of a singular matrix returned inf where eager raised, with every backend
    (aot_eager and inductor too). There it is registered for the block only, leaving other backends as they are.
    """
    if get_effect(LINALG_CHECK) is not None:
        yield
        return
    handle = register_effectful_op(LINALG_CHECK, EffectType.ORDERED)
    try:
        yield
    finally:
        handle.destroy()


# torch.nn.functional.linear_cross_entropy's chunked loop (torch 2.13 on), which the autograd formula of its
# reduction="none" op calls in Python (capture/chunked_loss.py routes that call to an op of aot2onnx's).
CHUNKED_LOSS = ("torch.nn.modules.linear_cross_entropy", "_linear_cross_entropy_batch_chunked_accumulator")


def chunked_loss_accumulator() -> tuple[Any, Callable[..., Any] | None]:
    """(the module, its chunked accumulator) of torch's linear_cross_entropy, or (None, None) where this torch
    has none (before 2.13) or has moved it."""
    module_name, symbol = CHUNKED_LOSS
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None, None
    function = getattr(module, symbol, None)
    if not callable(function):
        logger.info("aot2onnx: torch %s has no %s.%s: linear_cross_entropy(reduction='none')'s backward is "
                    "traced unrolled, one block per chunk", torch.__version__, module_name, symbol)
        return None, None
    return module, function

