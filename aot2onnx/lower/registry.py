"""Which function lowers each FX target: project and user rules first, then onnxscript's torch_lib.

A rule is a Python function with the ATen schema's parameters. It receives ``onnx_ir`` values for tensor
arguments and Python values for the rest, and builds ONNX nodes through an onnxscript opset (``op.Add``);
torch_lib's trace-only functions are rules of exactly this kind, so both share one calling convention.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from aot2onnx.options import BASE_OPSET

__all__ = [
    "Origin",
    "Registry",
    "Rule",
    "default_registry",
    "fused_registry",
    "register_lowering",
    "scoped_lowerings",
    "unregister_lowering",
    "user_rules",
]

logger = logging.getLogger("aot2onnx")

Target = Any  # torch._ops.OpOverload or a Python builtin such as operator.mul


class Origin:
    PROJECT = "aot2onnx"
    FUSED = "aot2onnx fused kernel"
    USER = "user"
    TORCHLIB = "torch_lib"


@dataclasses.dataclass(frozen=True)
class Rule:
    target: Target
    function: Callable[..., Any]
    opset_introduced: int = BASE_OPSET
    origin: str = Origin.PROJECT
    is_complex: bool = False

    @property
    def name(self) -> str:
        return getattr(self.function, "__qualname__", repr(self.function))


def _check_target(target: Target) -> None:
    if isinstance(target, torch._ops.OpOverloadPacket):
        raise TypeError(
            f"lowering rules are keyed by an OpOverload, got the packet {target}; "
            f"use {target}.default (or the overload you mean)"
        )
    if not isinstance(target, torch._ops.OpOverload) and not callable(target):
        raise TypeError(f"cannot register a lowering for {target!r}")


def _key(target: Target) -> Any:
    # OpOverload objects hash by identity and some are recreated, so key by their qualified name.
    if isinstance(target, torch._ops.OpOverload):
        return target.name()
    return target


class Registry:
    """Lowering rules by target, with explicit priority: user, then project, then torch_lib."""

    _PRIORITY = {Origin.USER: 0, Origin.FUSED: 1, Origin.PROJECT: 2, Origin.TORCHLIB: 3}

    def __init__(self) -> None:
        self._rules: dict[Any, list[Rule]] = {}

    def add(self, rule: Rule) -> None:
        _check_target(rule.target)
        rules = self._rules.setdefault(_key(rule.target), [])
        rules.append(rule)
        rules.sort(key=lambda r: (self._PRIORITY[r.origin], -r.opset_introduced))

    def lookup(self, target: Target, opset: int, *, is_complex: bool = False,
               passing_over: str | None = None) -> tuple[Rule | None, str]:
        """The rule to use at ``opset``, or ``None`` and the reason every candidate was rejected; with
        ``passing_over`` (an origin), the first rule of another origin."""
        candidates = self._rules.get(_key(target))
        if not candidates:
            return None, "no lowering rule is registered for this op"
        reasons = []
        for rule in candidates:
            if rule.origin == passing_over:
                continue
            if rule.opset_introduced > opset:
                reasons.append(f"{rule.origin} rule {rule.name} needs opset {rule.opset_introduced}")
            elif rule.is_complex != is_complex:
                reasons.append(f"{rule.origin} rule {rule.name} is for {'complex' if rule.is_complex else 'real'} inputs")
            else:
                return rule, ""
        return None, "; ".join(reasons)

    def supports(self, target: Target, opset: int) -> bool:
        return self.lookup(target, opset)[0] is not None

    def targets(self) -> list[Target]:
        return [rules[0].target for rules in self._rules.values()]


_PROJECT_RULES: list[Rule] = []
_FUSED_RULES: list[Rule] = []
_USER_RULES: list[Rule] = []


def _decorator(
    target: Target, opset: int, origin: str, rules: list[Rule], override: bool = False, is_complex: bool = False
) -> Callable[[Callable], Callable]:
    _check_target(target)

    def decorate(function: Callable) -> Callable:
        same = [r for r in rules
                if _key(r.target) == _key(target) and r.opset_introduced == opset and r.is_complex == is_complex]
        if same and not override:
            raise ValueError(
                f"{target} already has the {origin} lowering {same[0].name} (opset {opset}); pass override=True "
                f"to replace it{' (or use aot2onnx.scoped_lowerings() in tests)' if origin == Origin.USER else ''}"
            )
        for rule in same:
            rules.remove(rule)
        rules.append(Rule(target, function, opset, origin, is_complex))
        _clear_registries()  # the next compilation sees the new rule
        return function

    return decorate


def project_rule(target: Target, *, opset: int = BASE_OPSET, is_complex: bool = False) -> Callable[[Callable], Callable]:
    """Decorator for the rules in ``aot2onnx.lower.ops``; a second rule for one overload is an error.

    ``is_complex``: the rule is for complex inputs, which reach it as torch_lib represents them (a real tensor
    with a trailing axis of 2: real and imaginary parts); a real rule and a complex one can share an overload.
    """
    return _decorator(target, opset, Origin.PROJECT, _PROJECT_RULES, is_complex=is_complex)


def fused_rule(target: Target) -> Callable[[Callable], Callable]:
    """Decorator for the rules that lower an op to one of aot2onnx's fused kernels (``runtime/fused_ops.cc``):
    they are in :func:`fused_registry` only, which the compile backend uses where the kernels are built."""
    return _decorator(target, BASE_OPSET, Origin.FUSED, _FUSED_RULES)


def _clear_registries() -> None:
    default_registry.cache_clear()
    fused_registry.cache_clear()


def unregister_lowering(target: Target) -> int:
    """Removes the user lowerings of ``target``; returns how many there were."""
    _check_target(target)
    gone = [r for r in _USER_RULES if _key(r.target) == _key(target)]
    for rule in gone:
        _USER_RULES.remove(rule)
    if gone:
        _clear_registries()
    return len(gone)


@contextlib.contextmanager
def scoped_lowerings() -> Iterator[None]:
    """User lowerings registered inside the block are gone after it (and ones it replaced come back)::

        with aot2onnx.scoped_lowerings():
            aot2onnx.register_lowering(torch.ops.aten.gelu.default, override=True)(my_gelu)
            ...
    """
    saved = list(_USER_RULES)
    try:
        yield
    finally:
        if _USER_RULES != saved:
            _USER_RULES[:] = saved
            _clear_registries()


def register_lowering(target: Target, *, opset: int = BASE_OPSET, override: bool = False) -> Callable[[Callable], Callable]:
    """Registers a user lowering for ``target`` (an ``OpOverload``, e.g. a ``torch.library`` custom op).

    The decorated function takes the op's arguments in schema order: tensors arrive as ``onnx_ir`` values,
    everything else as Python values. It builds nodes with an onnxscript opset and returns the output
    value(s)::

        from onnxscript import opset18 as op

        @aot2onnx.register_lowering(torch.ops.mylib.scaled_tanh.default)
        def scaled_tanh(x, scale: float):
            return op.Mul(op.Tanh(x), op.CastLike(scale, x))

    ``opset``: the opset the rule needs. Models are built at :data:`aot2onnx.options.BASE_OPSET` (18) and
    converted to the target opset afterwards, and rules are chosen at the opset they are built at: a rule for a
    newer opset is not used, and a graph that needs one is refused, naming it (``lower/plan.py``).

    User rules take precedence over aot2onnx's and torch_lib's. Registering a second user rule for the same
    overload and opset is an error unless ``override=True``; :func:`unregister_lowering` and
    :func:`scoped_lowerings` remove them.
    """
    return _decorator(target, opset, Origin.USER, _USER_RULES, override)


def user_rules() -> tuple[Rule, ...]:
    """Every rule registered with ``register_lowering`` so far, oldest first."""
    return tuple(_USER_RULES)


@functools.cache
def _torchlib_rules() -> tuple[Rule, ...]:
    from onnxscript.function_libs.torch_lib import registration  # noqa: F401  (fills torch_lib's registry)

    from aot2onnx.lower import _exporter_compat as exporter

    # Silence the torchvision warnings: torchvision is not a dependency.
    exporter_logger = logging.getLogger(exporter.registration_logger_name)
    level = exporter_logger.level
    exporter_logger.setLevel(logging.ERROR)
    try:
        onnx_registry = exporter.ONNXRegistry.from_torchlib()
    finally:
        exporter_logger.setLevel(level)
    rules = []
    for metas in onnx_registry.functions.values():
        for meta in metas:
            rules.append(
                Rule(meta.fx_target, meta.onnx_function, meta.opset_introduced, Origin.TORCHLIB, meta.is_complex)
            )
    return tuple(rules)


@functools.cache
def default_registry() -> Registry:
    """torch_lib's rules, aot2onnx's own rules and every ``register_lowering`` so far."""
    from aot2onnx.lower import ops  # noqa: F401  (registers the project rules)

    registry = Registry()
    for rule in (*_torchlib_rules(), *_PROJECT_RULES, *_USER_RULES):
        registry.add(rule)
    return registry


@functools.cache
def fused_registry() -> Registry:
    """:func:`default_registry` and the rules that lower ops to aot2onnx's fused kernels, which take precedence
    over aot2onnx's and torch_lib's rules (a user's rule still comes first). For CPU sessions that load the
    kernels' library; exports and CUDA sessions use the default registry."""
    from aot2onnx.lower import ops  # noqa: F401  (registers the project and fused rules)

    registry = Registry()
    for rule in (*_torchlib_rules(), *_PROJECT_RULES, *_FUSED_RULES, *_USER_RULES):
        registry.add(rule)
    return registry
