"""Every private name of ONNX Runtime's Python package that aot2onnx uses.

A compiled graph runs through ONNX Runtime's C++ binding objects rather than their Python wrappers: the
wrappers' ``IOBinding.bind_input`` and ``InferenceSession.run_with_iobinding`` add a Python call and checks per
tensor per step, which the training step's many small tensors pay for (BENCHMARKS.md). The C++ objects are
reached through private attributes, which an ONNX Runtime release may rename. They are read here and nowhere
else, so a rename fails here, naming the attribute (``tests/test_ort_compat.py`` checks each one), instead of
somewhere in a training step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import onnxruntime as ort

__all__ = ["SYMBOLS", "c_binding", "c_device", "c_run_with_iobinding", "c_run_with_ortvaluevector", "ort_value_vector"]

# Our name -> the private attribute it reads: (the public object it is read from, the attribute).
SYMBOLS: dict[str, tuple[str, str]] = {
    "c_binding": ("onnxruntime.IOBinding", "_iobinding"),
    "c_run_with_iobinding": ("onnxruntime.InferenceSession", "_sess"),
    "c_device": ("onnxruntime.OrtDevice", "_get_c_device"),
    "c_run_with_ortvaluevector": ("onnxruntime.InferenceSession", "_sess"),
    "ort_value_vector": ("onnxruntime", "capi"),
}


def _read(owner: Any, attribute: str) -> Any:
    try:
        return getattr(owner, attribute)
    except AttributeError as e:
        raise AttributeError(
            f"aot2onnx needs {type(owner).__module__}.{type(owner).__qualname__}.{attribute} (private to ONNX "
            f"Runtime), which onnxruntime {ort.__version__} lacks: use the onnxruntime release aot2onnx's lock "
            "names, or report it"
        ) from e


def c_binding(session: ort.InferenceSession) -> Any:
    """A new IO binding of ``session``, as ONNX Runtime's C++ object (``bind_input(name, device, element type,
    shape, pointer)``, ``bind_output``, ``get_outputs``, ``clear_binding_inputs``, ``clear_binding_outputs``)."""
    return _read(session.io_binding(), "_iobinding")


def c_run_with_iobinding(session: ort.InferenceSession) -> Callable[[Any, Any], None]:
    """``session``'s C++ ``run_with_iobinding(binding, run_options)``, which takes a :func:`c_binding`."""
    return _read(_read(session, "_sess"), "run_with_iobinding")


def c_device(device_type: str, index: int = 0) -> Any:
    """The C++ ``OrtDevice`` that :func:`c_binding`'s ``bind_input`` and ``bind_output`` take."""
    return _read(ort.OrtDevice.make(device_type, index), "_get_c_device")()


def c_run_with_ortvaluevector(session: ort.InferenceSession) -> Callable[..., None] | None:
    """``session``'s C++ ``run_with_ortvaluevector(run options, input names, inputs, output names, outputs,
    output devices)``, which takes :func:`ort_value_vector` s (``runtime.one_call``); None where this onnxruntime
    lacks it."""
    return getattr(_read(session, "_sess"), "run_with_ortvaluevector", None)


def ort_value_vector() -> Any | None:
    """A new, empty C++ ``OrtValueVector`` (``push_back_batch(tensors, addresses, numpy dtypes, shapes,
    devices)``, ``to_dlpacks(to_tensor)``), from ``onnxruntime.capi``; None where this onnxruntime has no
    ``push_back_batch``."""
    vector_type = _vector_type()
    return None if vector_type is None else vector_type()


@functools.cache
def _vector_type() -> Any | None:
    # Looked up once: a run makes two vectors, and the import and lookups cost more than making one.
    from onnxruntime.capi import _pybind_state

    vector_type = getattr(_pybind_state, "OrtValueVector", None)
    return vector_type if vector_type is not None and hasattr(vector_type, "push_back_batch") else None
