"""How a compiled graph's positional inputs and outputs map onto its ONNX model.

Lowering produces a :class:`GraphSignature`; the runtime follows it. An FX graph from AOTAutograd takes
tensors and Python ints (symbolic sizes) and returns tensors, ints and ``None``; an ONNX graph takes and
returns tensors only, each once. The signature records the difference.

ONNX has no complex type that ONNX Runtime computes with: a complex tensor travels through a lowered graph,
and across its boundary, as a real tensor of the same precision with a trailing axis of 2 (real and
imaginary parts, ``torch.view_as_real``'s layout). ``is_complex`` on an input or output says so: the runtime
binds ``view_as_real`` of a complex input and returns ``view_as_complex`` of a complex output.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx



class GraphKind(enum.StrEnum):
    """Which of AOTAutograd's graphs a compiled graph is (a str: ``kind == "forward"`` holds)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    INFERENCE = "inference"


# ONNX ops whose nodes carry a seed: lowering seeds them, and a model from the cache is seeded afresh.
RANDOM_OPS = frozenset(
    {"Dropout", "RandomUniform", "RandomUniformLike", "RandomNormal", "RandomNormalLike", "Bernoulli", "Multinomial"}
)

# The domain of aot2onnx's fused training kernels (runtime/fused_ops.cc): lowered to where the compile backend's
# CPU sessions load them (lower/ops/fused_kernels.py), never in an exported artifact.
FUSED_DOMAIN = "aot2onnx.fused"

__all__ = [
    "InputKind", "OutputKind", "InputSpec", "OutputSpec", "MutationSpec", "CheckSpec", "GraphSignature", "LoweredGraph", "RANDOM_OPS", "FUSED_DOMAIN",
]


class InputKind(enum.Enum):
    TENSOR = "tensor"  # bound to the ONNX input of the same name
    SYMINT = "symint"  # a Python int, fed as a 0-d int64 tensor
    UNUSED = "unused"  # the ONNX model does not read it


class OutputKind(enum.Enum):
    TENSOR = "tensor"  # an ONNX output
    SYMINT = "symint"  # an ONNX 0-d int64 output, returned as a Python int
    INPUT = "input"  # the graph returns one of its inputs unchanged: handed back without ONNX Runtime
    CONSTANT = "constant"  # a Python constant (None, an int) that the graph returns
    DUPLICATE = "duplicate"  # the same value as an earlier output


@dataclasses.dataclass(frozen=True)
class InputSpec:
    kind: InputKind
    onnx_name: str | None = None
    is_complex: bool = False  # a complex tensor, bound as its real [..., 2] view


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    kind: OutputKind
    onnx_name: str | None = None
    index: int | None = None  # the input position (INPUT) or the earlier output position (DUPLICATE)
    value: object = None  # the constant (CONSTANT)
    is_complex: bool = False  # a complex tensor (TENSOR), which the ONNX output holds as real [..., 2]


@dataclasses.dataclass(frozen=True)
class MutationSpec:
    """An input the graph writes: AOTAutograd keeps a data mutation of an input in the graph as
    ``aten.copy_(input, value)``, and the runtime puts ``value`` (this ONNX output, of the input's shape and
    dtype) into the input's memory, where ONNX Runtime can write it directly (runtime/inplace.py) or else
    by a copy after the run."""

    index: int  # the input's position
    onnx_name: str  # the ONNX output holding its new value


# Kinds of CheckSpec.
CHECK_LINALG = "linalg"  # ATen's _linalg_check_errors on a factorization's info
CHECK_NEGATIVE_INDEX = "negative_index"  # the smallest index an op read, which ATen refuses below 0


@dataclasses.dataclass(frozen=True)
class CheckSpec:
    """A check that makes ATen raise on bad input, run by the runtime after the graph's run on a value the graph
    returns as this ONNX output, after the written inputs' values (``aot2onnx.lower.checks``): ATen's
    ``_linalg_check_errors`` on a factorization's ``info`` (behind ``torch.linalg.inv``, ``cholesky``,
    ``solve``...), so a singular matrix raises eager's error instead of returning inf or NaN; or the smallest
    index an op read, where ATen refuses a negative one and ONNX's Gather would read from the end."""

    onnx_name: str  # the ONNX output holding info (or what ``kind`` checks)
    api_name: str  # the name the error message gives (``linalg.inv``)
    is_matrix: bool
    kind: str = CHECK_LINALG


@dataclasses.dataclass(frozen=True)
class GraphSignature:
    inputs: tuple[InputSpec, ...]
    outputs: tuple[OutputSpec, ...]
    mutations: tuple[MutationSpec, ...] = ()
    checks: tuple[CheckSpec, ...] = ()

    @property
    def onnx_outputs(self) -> tuple[str, ...]:
        return tuple(
            o.onnx_name for o in self.outputs if o.kind in (OutputKind.TENSOR, OutputKind.SYMINT)
        )

    @property
    def has_complex(self) -> bool:
        """Whether a complex tensor crosses the graph's boundary (as a real [..., 2] tensor)."""
        return any(spec.is_complex for spec in (*self.inputs, *self.outputs))


@dataclasses.dataclass(frozen=True)
class LoweredGraph:
    """What lowering hands the runtime: the ONNX model and how to call it."""

    model: onnx.ModelProto
    signature: GraphSignature
    fx_node_count: int
    onnx_node_count: int
