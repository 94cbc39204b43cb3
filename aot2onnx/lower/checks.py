"""Checks a lowered graph leaves to the runtime: conditions under which ATen raises, computed by the graph.

ONNX has no op that fails a run on a condition, and where ATen raises on bad input an ONNX op may compute
something instead: its Gather and Scatter read a negative index from the end, where ATen's embedding,
index_select, gather and scatters refuse it (``index out of range``), and ATen's factorizations raise on a singular matrix
(``_linalg_check_errors`` on their ``info``). A rule that lowers such an op hands
the value that decides the error to :func:`runtime_check`; the graph returns it as an extra output (a
``CheckSpec`` of the graph's signature), and the runtime raises after the run where eager would have
raised (``runtime/session.py``, ``_raise_if_failed``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, NamedTuple

from aot2onnx.signature import CHECK_LINALG, CHECK_NEGATIVE_INDEX

__all__ = ["CHECK_LINALG", "CHECK_NEGATIVE_INDEX", "Check", "collecting", "runtime_check"]


class Check(NamedTuple):
    """One check a rule asked for: the graph returns ``value`` and the runtime checks it after each run."""

    value: Any  # the ONNX value (onnx_ir) that decides the error
    kind: str  # CHECK_LINALG or CHECK_NEGATIVE_INDEX
    api_name: str  # the name the error gives (``linalg.inv``)
    is_matrix: bool  # _linalg_check_errors' argument


_PENDING: contextvars.ContextVar[list[Check] | None] = contextvars.ContextVar("aot2onnx_checks", default=None)


@contextlib.contextmanager
def collecting() -> Iterator[list[Check]]:
    """Collects the checks the rules ask for while a graph is lowered."""
    checks: list[Check] = []
    token = _PENDING.set(checks)
    try:
        yield checks
    finally:
        _PENDING.reset(token)


def runtime_check(value: Any, kind: str, api_name: str, is_matrix: bool = True) -> None:
    """Has the runtime check ``value`` (of ``kind``) after each run of the graph, naming ``api_name`` in the
    error (``is_matrix``: _linalg_check_errors' argument). Outside a lowering (a rule traced on its own)
    there is no graph to return it from: ignored."""
    checks = _PENDING.get()
    if checks is not None:
        checks.append(Check(value, kind, api_name, is_matrix))
