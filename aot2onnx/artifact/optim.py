"""Optimizers for exported training artifacts: torch.optim's update rules as one ONNX step.

``aot2onnx.export_training(..., optimizer=aot2onnx.optim.AdamW(1e-3))`` writes ``optimizer.onnx``, which
updates every trainable parameter and its optimizer state in one run. The arithmetic follows torch.optim's
single-tensor CPU implementations operation by operation (``SGD``: ``_single_tensor_sgd``; ``AdamW``:
``_single_tensor_adam`` with decoupled weight decay), with the scalar factors computed the way torch
computes them: in double precision, then rounded to the parameter's dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "SGD",
    "STEP_STATE",
    "AdamW",
    "Constant",
    "Optimizer",
    "OptimizerStep",
    "Schedule",
    "WarmupCosine",
    "WarmupLinear",
]

# The state entry that counts optimizer steps (AdamW's bias correction and the schedules need it). Module
# attribute names cannot contain ":", so no parameter or buffer name collides with an optimizer state name.
STEP_STATE = "optimizer:step"
# The optimizer model's scalar inputs (float64, as torch keeps hyperparameters): a device may change them.
LR_INPUT = "optimizer:lr"
WEIGHT_DECAY_INPUT = "optimizer:weight_decay"


class Schedule:
    """A learning-rate schedule, as data in the signature: both readers apply it (the torch-free trainer
    feeds ``optimizer.onnx`` the scheduled rate), and :meth:`torch` gives the same schedule for torch."""

    def to_json(self) -> dict:
        raise NotImplementedError

    def factor(self, step: int) -> float:
        """The multiplier of the base learning rate for the step after ``step`` completed ones."""
        from aot2onnx.artifact.edge import lr_factor  # the one implementation, which the torch-free trainer runs

        return lr_factor(self.to_json(), step)

    def torch(self, optimizer: Any) -> Any:
        """``torch.optim.lr_scheduler.LambdaLR`` over ``optimizer`` with this schedule (call its ``step()``
        after each ``optimizer.step()``), e.g. for a module from ``aot2onnx.load``."""
        import torch

        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.factor)


@dataclasses.dataclass(frozen=True)
class Constant(Schedule):
    """The base learning rate at every step."""

    def to_json(self) -> dict:
        return {"name": "constant"}


@dataclasses.dataclass(frozen=True)
class WarmupLinear(Schedule):
    """Linear warm-up from 0 over ``warmup_steps``, then linear decay to 0 at ``total_steps``
    (transformers' ``get_linear_schedule_with_warmup``)."""

    warmup_steps: int
    total_steps: int

    def __post_init__(self) -> None:
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(f"need 0 <= warmup_steps <= total_steps, got {self}")

    def to_json(self) -> dict:
        return {"name": "linear", "warmup_steps": self.warmup_steps, "total_steps": self.total_steps}


@dataclasses.dataclass(frozen=True)
class WarmupCosine(Schedule):
    """Linear warm-up from 0 over ``warmup_steps``, then cosine decay (``num_cycles`` 0.5: to 0 at
    ``total_steps``), as transformers' ``get_cosine_schedule_with_warmup``."""

    warmup_steps: int
    total_steps: int
    num_cycles: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(f"need 0 <= warmup_steps <= total_steps, got {self}")

    def to_json(self) -> dict:
        return {"name": "cosine", "warmup_steps": self.warmup_steps, "total_steps": self.total_steps,
                "num_cycles": self.num_cycles}


def state_name(param: str, slot: str) -> str:
    """The state entry of optimizer slot ``slot`` (``exp_avg``, ...) for parameter ``param``."""
    return f"{param}:{slot}"


def grad_name(param: str) -> str:
    return f"grad:{param}"


def updated_name(state: str) -> str:
    return f"updated:{state}"


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    name: str
    dtype: int  # onnx.TensorProto element type
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class OptimizerStep:
    """The optimizer model and what the signature needs to say about it."""

    model: onnx.ModelProto
    state: list[dict]  # {"name", "kind": "optimizer_state", "dtype", "shape", "init": "zeros"}
    inputs: list[dict]  # {"name", "role", "source"}
    outputs: list[dict]  # {"name", "role", "target"}


class _Builder:
    """Nodes of one flat ONNX graph, with scalar constants shared by value and dtype."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._constants: dict[tuple[float, int], str] = {}
        self._count = 0

    def op(self, op_type: str, *inputs: str, name: str | None = None, **attrs) -> str:
        self._count += 1
        out = name or f"{op_type.lower()}_{self._count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=f"n{self._count}_{op_type}", **attrs))
        return out

    def rename(self, names: dict[str, str]) -> None:
        """Renames values the builder produced (say, to name graph outputs after what they update)."""
        for node in self.nodes:
            node.input[:] = [names.get(i, i) for i in node.input]
            node.output[:] = [names.get(o, o) for o in node.output]

    def const_ints(self, values: list[int]) -> str:
        name = f"ints_{len(self.initializers)}"
        self.initializers.append(numpy_helper.from_array(np.array(values, dtype=np.int64), name))
        return name

    def const(self, value: float, dtype: int) -> str:
        key = (value, dtype)
        if key not in self._constants:
            name = f"const_{len(self._constants)}"
            array = np.array(value, dtype=helper.tensor_dtype_to_np_dtype(dtype))
            self.initializers.append(numpy_helper.from_array(array, name))
            self._constants[key] = name
        return self._constants[key]


class Optimizer:
    """Base class: an optimizer configuration that can write its step as an ONNX model."""

    name: str = ""
    slots: tuple[str, ...] = ()  # per-parameter state tensors, shaped like the parameter
    counts_steps: bool = False

    def hyperparameters(self) -> dict:
        raise NotImplementedError

    def _update(self, b: _Builder, p: ParamInfo, param: str, grad: str, slots: dict[str, str], step: dict) -> tuple[str, dict[str, str]]:
        raise NotImplementedError

    schedule: Schedule
    max_grad_norm: float | None

    @property
    def scheduled_weight_decay(self) -> bool:
        """Whether the weight decay is an input of the model (a device may schedule it)."""
        return False

    def _step_scalars(self, b: _Builder, step: str, hyper: dict) -> dict:
        return {"new_step": b.op("Add", step, b.const(1, TensorProto.INT64), name=updated_name(STEP_STATE))}

    def _check_common(self) -> None:
        if not isinstance(self.schedule, Schedule):
            raise TypeError(f"schedule must be an aot2onnx.optim schedule (Constant, WarmupLinear, WarmupCosine), "
                            f"got {self.schedule!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {self.max_grad_norm}")

    def _common_hyperparameters(self) -> dict:
        return {"schedule": self.schedule.to_json(), "max_grad_norm": self.max_grad_norm}

    def _clip_coefficient(self, b: _Builder, params: Sequence[ParamInfo]) -> str:
        """``torch.nn.utils.clip_grad_norm_``'s ``clip_coef_clamped``: min(max_norm / (total + 1e-6), 1), with
        ``total`` the 2-norm of the per-parameter gradient 2-norms, in the first parameter's dtype."""
        dtype = params[0].dtype
        norms = []
        for p in params:
            norm = b.op("ReduceL2", grad_name(p.name), keepdims=1)
            norm = b.op("Reshape", norm, b.const_ints([1]))
            norms.append(norm if p.dtype == dtype else b.op("Cast", norm, to=dtype))
        total = b.op("ReduceL2", b.op("Concat", *norms, axis=0), keepdims=0)
        coefficient = b.op("Div", b.const(float(self.max_grad_norm), dtype), b.op("Add", total, b.const(1e-6, dtype)))
        return b.op("Min", coefficient, b.const(1.0, dtype))

    def build(self, params: Sequence[ParamInfo], *, opset: int) -> OptimizerStep:
        """The step over ``params`` (the parameters that receive gradients), as an ONNX model."""
        b = _Builder()
        graph_inputs, graph_outputs, state, inputs, outputs = [], [], [], [], []

        def tensor_io(name: str, dtype: int, shape: Sequence[int]) -> onnx.ValueInfoProto:
            return helper.make_tensor_value_info(name, dtype, list(shape))

        renames: dict[str, str] = {}
        double = TensorProto.DOUBLE
        graph_inputs.append(tensor_io(LR_INPUT, double, []))
        inputs.append({"name": LR_INPUT, "role": "lr"})
        hyper = {"lr": LR_INPUT}
        if self.scheduled_weight_decay:
            graph_inputs.append(tensor_io(WEIGHT_DECAY_INPUT, double, []))
            inputs.append({"name": WEIGHT_DECAY_INPUT, "role": "weight_decay"})
            hyper["weight_decay"] = WEIGHT_DECAY_INPUT
        step_scalars: dict = dict(hyper)
        if self.counts_steps:
            state.append({"name": STEP_STATE, "kind": "optimizer_state", "dtype": "int64", "shape": [], "init": "zeros"})
            graph_inputs.append(tensor_io(STEP_STATE, TensorProto.INT64, []))
            inputs.append({"name": STEP_STATE, "role": "step", "source": STEP_STATE})
            step_scalars.update(self._step_scalars(b, STEP_STATE, hyper))
            new_step = step_scalars.pop("new_step")
            graph_outputs.append(tensor_io(new_step, TensorProto.INT64, []))
            outputs.append({"name": new_step, "role": "optimizer_state_update", "target": STEP_STATE})

        clip = self._clip_coefficient(b, params) if self.max_grad_norm is not None else None
        for p in params:
            dtype_name = helper.tensor_dtype_to_np_dtype(p.dtype).name
            graph_inputs.append(tensor_io(p.name, p.dtype, p.shape))
            inputs.append({"name": p.name, "role": "parameter", "source": p.name})
            graph_inputs.append(tensor_io(grad_name(p.name), p.dtype, p.shape))
            inputs.append({"name": grad_name(p.name), "role": "grad", "source": p.name})
            slots = {}
            for slot in self.slots:
                s = state_name(p.name, slot)
                state.append({"name": s, "kind": "optimizer_state", "dtype": dtype_name, "shape": list(p.shape),
                              "init": "zeros"})
                graph_inputs.append(tensor_io(s, p.dtype, p.shape))
                inputs.append({"name": s, "role": "optimizer_state", "source": s})
                slots[slot] = s
            grad = grad_name(p.name)
            if clip is not None:  # grad.mul_(clip_coef_clamped), as clip_grad_norm_ does before the step
                grad = b.op("Mul", grad, clip if p.dtype == params[0].dtype else b.op("Cast", clip, to=p.dtype))
            new_param, new_slots = self._update(b, p, p.name, grad, slots, step_scalars)
            # Every update is computed by a node of its own (never an input passed through), so its value
            # can be renamed after the state it replaces.
            for target, value, role in [(p.name, new_param, "parameter_update"),
                                        *((slots[s], new_slots[s], "optimizer_state_update") for s in self.slots)]:
                out = renames[value] = updated_name(target)
                graph_outputs.append(tensor_io(out, p.dtype, p.shape))
                outputs.append({"name": out, "role": role, "target": target})

        b.rename(renames)
        graph = helper.make_graph(b.nodes, f"{self.name}_step", graph_inputs, graph_outputs, b.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="aot2onnx")
        model.ir_version = min(model.ir_version, 10)
        onnx.checker.check_model(model, full_check=True)
        return OptimizerStep(model, state, inputs, outputs)


@dataclasses.dataclass(frozen=True)
class SGD(Optimizer):
    """``torch.optim.SGD(params, lr, momentum, weight_decay=weight_decay)`` (no dampening, no Nesterov).

    The momentum buffer starts at zero; torch starts it at the first gradient. Both give the same first
    step exactly: ``0 * momentum + grad`` is ``grad``.
    """

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    schedule: Schedule = Constant()
    max_grad_norm: float | None = None
    name = "sgd"

    def __post_init__(self) -> None:
        if self.lr < 0 or self.momentum < 0 or self.weight_decay < 0:
            raise ValueError(f"SGD needs lr, momentum and weight_decay >= 0, got {self}")
        self._check_common()

    @property
    def counts_steps(self) -> bool:  # type: ignore[override]
        return not isinstance(self.schedule, Constant)  # a schedule needs to know the step

    @property
    def slots(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("momentum_buffer",) if self.momentum else ()

    def hyperparameters(self) -> dict:
        return {"name": self.name, "lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
                **self._common_hyperparameters()}

    def _update(self, b, p, param, grad, slots, step):
        dtype = p.dtype
        if self.weight_decay:
            grad = b.op("Add", grad, b.op("Mul", b.const(self.weight_decay, dtype), param))  # grad.add(param, alpha=wd)
        new_slots = {}
        if self.momentum:
            buf = b.op("Add", b.op("Mul", slots["momentum_buffer"], b.const(self.momentum, dtype)), grad)
            new_slots["momentum_buffer"] = buf
            grad = buf
        alpha = b.op("Neg", b.op("Cast", step["lr"], to=dtype))  # add_(grad, alpha=-lr): -lr rounded to dtype
        return b.op("Add", param, b.op("Mul", alpha, grad)), new_slots


@dataclasses.dataclass(frozen=True)
class AdamW(Optimizer):
    """``torch.optim.AdamW(params, lr, betas, eps, weight_decay)`` (no AMSGrad, not maximizing).

    The step counter is shared by all parameters (torch keeps one per parameter; they count alike when
    every parameter gets a gradient at every step). Bias corrections use the incremented count, in double
    precision, as torch computes them from ``step.item()``.
    """

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    schedule: Schedule = Constant()
    max_grad_norm: float | None = None
    name = "adamw"
    slots = ("exp_avg", "exp_avg_sq")
    counts_steps = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"AdamW needs two betas in [0, 1), got {self.betas}")
        if self.lr < 0 or self.eps < 0 or self.weight_decay < 0:
            raise ValueError(f"AdamW needs lr, eps and weight_decay >= 0, got {self}")
        self._check_common()

    @property
    def scheduled_weight_decay(self) -> bool:
        return True

    def hyperparameters(self) -> dict:
        return {"name": self.name, "lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                "weight_decay": self.weight_decay, **self._common_hyperparameters()}

    def _step_scalars(self, b, step, hyper):
        double = TensorProto.DOUBLE
        new_step = super()._step_scalars(b, step, hyper)["new_step"]
        t = b.op("Cast", new_step, to=double)
        beta1, beta2 = self.betas
        bias_correction1 = b.op("Sub", b.const(1.0, double), b.op("Pow", b.const(beta1, double), t))
        bias_correction2 = b.op("Sub", b.const(1.0, double), b.op("Pow", b.const(beta2, double), t))
        step_size = b.op("Div", hyper["lr"], bias_correction1)
        return {
            "new_step": new_step,
            # param.mul_(1 - lr * weight_decay): in double, as torch computes it from Python floats
            "decay": b.op("Sub", b.const(1.0, double), b.op("Mul", hyper["lr"], hyper["weight_decay"])),
            "neg_step_size": b.op("Neg", step_size),  # double; cast per parameter dtype
            "bias_correction2_sqrt": b.op("Sqrt", bias_correction2),
        }

    def _update(self, b, p, param, grad, slots, step):
        dtype = p.dtype
        beta1, beta2 = self.betas
        param = b.op("Mul", param, b.op("Cast", step["decay"], to=dtype))
        m, v = slots["exp_avg"], slots["exp_avg_sq"]
        # exp_avg.lerp_(grad, 1 - beta1): the weight is below 0.5, so lerp is m + w * (g - m).
        m = b.op("Add", m, b.op("Mul", b.const(1 - beta1, dtype), b.op("Sub", grad, m)))
        # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        v = b.op("Add", b.op("Mul", v, b.const(beta2, dtype)),
                 b.op("Mul", b.op("Mul", b.const(1 - beta2, dtype), grad), grad))
        # denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        denom = b.op("Add", b.op("Div", b.op("Sqrt", v), b.op("Cast", step["bias_correction2_sqrt"], to=dtype)),
                     b.const(self.eps, dtype))
        # param.addcdiv_(exp_avg, denom, value=-step_size): param + value * exp_avg / denom
        value = b.op("Cast", step["neg_step_size"], to=dtype)
        new_param = b.op("Add", param, b.op("Div", b.op("Mul", value, m), denom))
        return new_param, {"exp_avg": m, "exp_avg_sq": v}
