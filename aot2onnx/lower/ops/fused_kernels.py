"""Ops lowered to one of aot2onnx's fused kernels each (``runtime/fused_ops.cc``: ATen's own CPU kernel
run on ONNX Runtime's buffers), where the standard lowering spells them as chains of ONNX nodes, or where
AOTAutograd decomposes them for want of a rule: a ReLU gradient (LessOrEqual, Where), a softmax gradient
(Mul, ReduceSum, Sub, Mul), a layer norm's backward (two dozen nodes), an embedding's gradient (a ScatterND
with reduction="add", which runs its graph on one thread: ``runtime/rewrites.py``'s ``serial_nodes``); and
forward ops the standard lowering spells out for exactness (softmax, log-softmax, layer norm, batch norm in
training); and the matrix products (mm, addmm, bmm, baddbmm): ATen's GEMM on eager's OpenMP threads, where
ONNX Runtime's MLAS products took 232-243 ms of the bench's GPT step against ATen's 147-167 in the same graphs
(eager's products: 138). One node, eager's values bit for bit. (The graphs' Where nodes, their Transposes that
keep the last axis and their chains of float arithmetic are the runtime's to swap: ``runtime/rewrites.py``'s
``fused_selects``, ``fused_transposes`` and ``fused_elementwise``.)

Only in :func:`aot2onnx.lower.registry.fused_registry`, which the compile backend uses for CPU graphs where the
library is built; with it, the calls the kernels take are kept whole by the decomposition table
(``lower/fusable.py``: tensors of one float dtype, as ATen takes float32, float64, float16 and bfloat16 alike).
A node the kernel does not take goes to the standard rule, or, for an op that has none, was decomposed
(``lower/fusable.py`` states which calls the kernels take: tensors of one float dtype, int64 or int32 indices).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import onnx_ir as ir
import onnxscript
import torch

from aot2onnx.errors import LoweringError
from aot2onnx.lower.registry import default_registry, fused_rule
from aot2onnx.options import BASE_OPSET
from aot2onnx.signature import FUSED_DOMAIN

aten = torch.ops.aten

__all__: list[str] = []

_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
_INDICES = (ir.DataType.INT64, ir.DataType.INT32)


class _NotFused(Exception):
    """The fused kernel does not take this node: the standard rule lowers it (see :func:`_or_standard`)."""


def _fused(op_type: str, inputs: list[ir.Value | None], num_outputs: int = 1, **attributes: object) -> list[ir.Value]:
    """One node of the fused kernels' domain, its inputs of one float dtype, its outputs typed like them."""
    dtypes = {v.dtype for v in inputs if v is not None}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _FLOATS:
        raise _NotFused(f"the fused {op_type} takes tensors of one float dtype, got {sorted(map(str, dtypes))}")
    return _node(op_type, inputs, num_outputs, **attributes)


def _node(op_type: str, inputs: list[ir.Value | None], num_outputs: int = 1, **attributes: object) -> list[ir.Value]:
    """One node of the fused kernels' domain (its output types come from the FX graph's)."""
    node = ir.node(op_type, inputs, attributes=attributes, domain=FUSED_DOMAIN, num_outputs=num_outputs)
    onnxscript.evaluator.default().nodes.append(node)
    return list(node.outputs)


def _or_standard(target: torch._ops.OpOverload) -> Callable[[Callable], Callable]:
    """Registers a fused rule for ``target`` that hands a node its kernel does not take to the standard rule
    (aot2onnx's or torch_lib's). Ops without one are kept whole only where the kernel takes them
    (``lower/fusable.py``), so a refusal there is a bug, and says so."""

    def decorate(rule: Callable) -> Callable:
        @functools.wraps(rule)
        def fused_or_standard(*args: Any, **kwargs: Any) -> Any:
            try:
                return rule(*args, **kwargs)
            except _NotFused as e:
                standard, _ = default_registry().lookup(target, BASE_OPSET)
                if standard is None:
                    raise LoweringError(f"{e}, and no standard rule lowers {target}") from e
                return standard.function(*args, **kwargs)

        fused_rule(target)(fused_or_standard)
        return rule

    return decorate


@_or_standard(aten.threshold_backward.default)
def aten_threshold_backward(grad_output, self, threshold):
    """threshold_backward(Tensor grad_output, Tensor self, Scalar threshold) -> Tensor"""
    # A float attribute is float32 in ONNX: the Python scalar travels exactly, as float.hex().
    return _fused("ThresholdBackward", [grad_output, self], threshold=float(threshold).hex())[0]


@_or_standard(aten.hardtanh_backward.default)
def aten_hardtanh_backward(grad_output, self, min_val, max_val):
    """hardtanh_backward(Tensor grad_output, Tensor self, Scalar min_val, Scalar max_val) -> Tensor"""
    # relu6's gradient (MobileNetV2): the standard rule's Or of two comparisons and a zero-sign-keeping select
    # (LessOrEqual, GreaterOrEqual, Or, ReduceSum, Sub, IsNaN, If) is ATen's one pass here.
    bounds = {"min_val": float(min_val).hex(), "max_val": float(max_val).hex()}
    return _fused("HardtanhBackward", [grad_output, self], **bounds)[0]


@_or_standard(aten.gelu_backward.default)
def aten_gelu_backward(grad_output, self, approximate: str = "none"):
    """gelu_backward(Tensor grad_output, Tensor self, *, str approximate="none") -> Tensor"""
    return _fused("GeluBackward", [grad_output, self], approximate=approximate)[0]


def _binary(op_type: str):
    def rule(grad_output, x):
        return _fused(op_type, [grad_output, x])[0]

    rule.__name__ = rule.__qualname__ = f"aten_{op_type}"
    return rule


for _target, _op_type in (
    (aten.hardswish_backward.default, "HardswishBackward"),
    (aten.silu_backward.default, "SiluBackward"),
    (aten.tanh_backward.default, "TanhBackward"),
    (aten.sigmoid_backward.default, "SigmoidBackward"),
    (aten.hardsigmoid_backward.default, "HardsigmoidBackward"),
):
    _or_standard(_target)(_binary(_op_type))


def _unary(op_type: str):
    def rule(self):
        return _fused(op_type, [self])[0]

    rule.__name__ = rule.__qualname__ = f"aten_{op_type}"
    return rule


@_or_standard(aten.gelu.default)
def aten_gelu(self, approximate: str = "none"):
    """gelu(Tensor self, *, str approximate='none') -> Tensor"""
    # ATen's kernel, where the standard lowering spells GELU as Div, Erf, Add, Mul, Mul (or the tanh form's seven).
    return _fused("Gelu", [self], approximate=approximate)[0]


# Activations the standard lowering spells out (hardswish as Add, Clip, Div, Mul; hardsigmoid as three nodes).
for _target, _op_type in ((aten.hardswish.default, "Hardswish"), (aten.hardsigmoid.default, "Hardsigmoid")):
    _or_standard(_target)(_unary(_op_type))


def _softmax_backward(op_type: str):
    def rule(grad_output, output, dim: int, input_dtype):
        # input_dtype is the forward input's (the exporter hands it over as an ONNX data type): a softmax computed
        # in another dtype than its gradient's (half_to_float) is not fused.
        dtype = ir.DataType(input_dtype)
        if dtype != grad_output.dtype:
            raise _NotFused(f"the fused {op_type} needs the forward's input in the gradient's dtype, got {dtype}")
        return _fused(op_type, [grad_output, output], dim=int(dim))[0]

    rule.__name__ = rule.__qualname__ = f"aten_{op_type}"
    return rule


_or_standard(aten._softmax_backward_data.default)(_softmax_backward("SoftmaxBackward"))
_or_standard(aten._log_softmax_backward_data.default)(_softmax_backward("LogSoftmaxBackward"))


@_or_standard(aten.native_layer_norm_backward.default)
def aten_native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    """native_layer_norm_backward(Tensor grad_out, Tensor input, SymInt[] normalized_shape, Tensor mean, Tensor rstd,
    Tensor? weight, Tensor? bias, bool[3] output_mask) -> (Tensor, Tensor, Tensor)"""
    if any(not isinstance(d, int) for d in normalized_shape):
        raise _NotFused("the fused LayerNormBackward takes a normalized shape of plain sizes")
    if weight is None and bias is not None:
        raise _NotFused("the fused LayerNormBackward takes a bias only beside a weight")
    # mean and rstd are float32 for a 16-bit input (ATen keeps the statistics in float32): one dtype otherwise.
    if input.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        raise _NotFused("the fused LayerNormBackward takes float32 or float64 tensors")
    inputs = [v for v in (grad_out, input, mean, rstd, weight, bias) if v is not None]
    # The kernel computes every gradient it has an output for: the input's, then the weight's and the bias's
    # where they exist (ATen's values do not depend on which are asked for).
    outputs = iter(_fused("LayerNormBackward", inputs, num_outputs=len(inputs) - 3,
                          normalized_shape=list(normalized_shape)))
    grad_input = next(outputs)
    grad_weight = next(outputs) if weight is not None else None
    grad_bias = next(outputs) if bias is not None else None
    return (grad_input if output_mask[0] else None, grad_weight if output_mask[1] else None,
            grad_bias if output_mask[2] else None)


def _float32_or_64(op_type: str, *values: ir.Value | None) -> None:
    """Refuses (to the standard rule) a node whose tensors are not all float32 or all float64: ATen keeps a
    16-bit batch norm's statistics in another dtype than its input's."""
    dtypes = {v.dtype for v in values if v is not None}
    if dtypes not in ({ir.DataType.FLOAT}, {ir.DataType.DOUBLE}):
        raise _NotFused(f"the fused {op_type} takes float32 or float64 tensors of one dtype")


@_or_standard(aten._native_batch_norm_legit_functional.default)
def aten__native_batch_norm_legit_functional(
    input, weight=None, bias=None, running_mean=None, running_var=None, training: bool = False,
    momentum: float = 0.1, eps: float = 1e-5,
):
    """_native_batch_norm_legit_functional(Tensor input, Tensor? weight, Tensor? bias, Tensor running_mean, Tensor running_var, bool training, float momentum, float eps) -> (Tensor, Tensor, Tensor, Tensor running_mean_out, Tensor running_var_out)"""
    if not training:
        raise _NotFused("the fused BatchNormTraining normalizes with the batch's statistics (training=True)")
    _float32_or_64("BatchNormTraining", input, weight, bias, running_mean, running_var)
    # Python floats travel exactly, as float.hex() (an ONNX float attribute is float32).
    return tuple(_fused("BatchNormTraining", [input, running_mean, running_var, weight, bias], num_outputs=5,
                        momentum=float(momentum).hex(), eps=float(eps).hex()))


@_or_standard(aten.native_batch_norm_backward.default)
def aten_native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd,
                                    train: bool, eps: float, output_mask):
    """native_batch_norm_backward(Tensor grad_out, Tensor input, Tensor? weight, Tensor? running_mean, Tensor? running_var, Tensor? save_mean, Tensor? save_invstd, bool train, float eps, bool[3] output_mask) -> (Tensor, Tensor, Tensor)"""
    if weight is None and (output_mask[1] or output_mask[2]):
        raise _NotFused("the fused BatchNormBackward computes a weight's and a bias's gradient only with a weight")
    _float32_or_64("BatchNormBackward", grad_out, input, weight, running_mean, running_var, save_mean, save_invstd)
    # Every gradient the kernel has an output for is computed (ATen's values do not depend on the mask).
    outputs = _fused("BatchNormBackward", [grad_out, input, weight, running_mean, running_var, save_mean, save_invstd],
                     num_outputs=1 if weight is None else 3, train=int(bool(train)), eps=float(eps).hex())
    grad_input = outputs[0] if output_mask[0] else None
    if weight is None:
        return grad_input, None, None
    return grad_input, outputs[1] if output_mask[1] else None, outputs[2] if output_mask[2] else None


@_or_standard(aten.native_group_norm_backward.default)
def aten_native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group: int, output_mask):
    """native_group_norm_backward(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd, Tensor? weight, SymInt N, SymInt C, SymInt HxW, int group, bool[3] output_mask) -> (Tensor, Tensor, Tensor)"""
    # Kept whole only where the kernel takes it (lower/fusable.py): without it, AOTAutograd decomposes the op.
    if not all(isinstance(v, int) for v in (N, C, HxW, group)):
        raise _NotFused("the fused GroupNormBackward takes plain sizes")
    if weight is None and (output_mask[1] or output_mask[2]):
        raise _NotFused("the fused GroupNormBackward computes a weight's and a bias's gradient only with a weight")
    _float32_or_64("GroupNormBackward", grad_out, input, mean, rstd, weight)
    outputs = _fused("GroupNormBackward", [grad_out, input, mean, rstd, weight], num_outputs=1 if weight is None else 3,
                     N=int(N), C=int(C), HxW=int(HxW), group=int(group))
    grad_input = outputs[0] if output_mask[0] else None
    if weight is None:
        return grad_input, None, None
    return grad_input, outputs[1] if output_mask[1] else None, outputs[2] if output_mask[2] else None


@_or_standard(aten.embedding_dense_backward.default)
def aten_embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq: bool):
    """embedding_dense_backward(Tensor grad_output, Tensor indices, SymInt num_weights, SymInt padding_idx, bool scale_grad_by_freq) -> Tensor"""
    # Kept whole only where the kernel takes it (lower/fusable.py): without it, AOTAutograd decomposes the op
    # into a ScatterND with reduction="add".
    if not all(isinstance(v, int) for v in (num_weights, padding_idx)):
        raise _NotFused("the fused EmbeddingDenseBackward takes a plain num_weights and padding_idx")
    if grad_output.dtype not in _FLOATS or indices.dtype not in _INDICES:
        raise _NotFused(f"the fused EmbeddingDenseBackward takes a float gradient and int64 or int32 indices, got "
                        f"{grad_output.dtype} and {indices.dtype}")
    return _node("EmbeddingDenseBackward", [grad_output, indices], num_weights=int(num_weights),
                 padding_idx=int(padding_idx), scale_grad_by_freq=int(bool(scale_grad_by_freq)))[0]


@_or_standard(aten.convolution_backward.default)
def aten_convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed: bool,
                              output_padding, groups: int, output_mask):
    """convolution_backward(Tensor grad_output, Tensor input, Tensor weight, SymInt[]? bias_sizes, SymInt[] stride, SymInt[] padding, SymInt[] dilation, bool transposed, SymInt[] output_padding, SymInt groups, bool[3] output_mask) -> (Tensor, Tensor, Tensor)"""
    # ATen's kernel with eager's arguments: oneDNN's or ATen's own convolution backward, as eager runs it (the
    # standard lowering's one-hot unfolding made an infinite input's weight gradient NaN; and on the bench's
    # CNN shapes it took 399-757 us against ATen's 243-458, 2 threads).
    sizes = (*stride, *padding, *dilation, *output_padding, groups)
    if not all(isinstance(v, int) for v in sizes):
        raise _NotFused("the fused ConvolutionBackward takes plain sizes")
    if not any(output_mask):
        return None, None, None
    outputs = iter(_fused("ConvolutionBackward", [grad_output, input, weight], num_outputs=sum(map(bool, output_mask)),
                          stride=list(stride), padding=list(padding), dilation=list(dilation),
                          transposed=int(bool(transposed)), output_padding=list(output_padding), groups=int(groups),
                          output_mask=[int(bool(m)) for m in output_mask]))
    return tuple(next(outputs) if m else None for m in output_mask)


def _max_pool_with_indices(spatial: int):
    def rule(self, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode: bool = False):
        # ATen's kernel: eager's values and indices, its NaN and -inf windows included (the standard lowering
        # mends ONNX Runtime's MaxPool behind an If). Lists of one size stand for every spatial dimension, an
        # empty stride for the kernel's.
        def full(values, default):
            values = list(values) if values else list(default)
            return values * spatial if len(values) == 1 else values

        kernel = full(kernel_size, ())
        sizes = [kernel, full(stride, kernel), full(padding, (0,)), full(dilation, (1,))]
        if not all(len(v) == spatial and all(isinstance(x, int) for x in v) for v in sizes):
            raise _NotFused(f"the fused MaxPoolWithIndices takes {spatial} plain sizes per argument")
        if self.shape is None or len(self.shape) not in (spatial + 1, spatial + 2):
            raise _NotFused("the fused MaxPoolWithIndices takes a batched or unbatched input of known rank")
        kernel, stride, padding, dilation = sizes
        return tuple(_fused("MaxPoolWithIndices", [self], num_outputs=2, kernel_size=kernel, stride=stride,
                            padding=padding, dilation=dilation, ceil_mode=int(bool(ceil_mode))))

    rule.__name__ = rule.__qualname__ = f"aten_max_pool{spatial}d_with_indices"
    return rule


_or_standard(aten.max_pool2d_with_indices.default)(_max_pool_with_indices(2))
_or_standard(aten.max_pool3d_with_indices.default)(_max_pool_with_indices(3))


# --- forward ops the standard lowering spells out (lower/ops/reductions.py, norm.py): ATen's kernel, one node,
# eager's values bit for bit. ---


def _softmax_forward(op_type: str):
    def rule(self, dim: int, half_to_float: bool):
        # ATen's CPU softmax takes no half_to_float (a CUDA-only conversion); 0-d tensors stay standard.
        if half_to_float or not self.shape:  # no shape known, or 0-d
            raise _NotFused(f"the fused {op_type} takes a tensor of one or more dimensions, in its own dtype")
        return _fused(op_type, [self], dim=int(dim))[0]

    rule.__name__ = rule.__qualname__ = f"aten_{op_type}"
    return rule


_or_standard(aten._softmax.default)(_softmax_forward("Softmax"))
_or_standard(aten._log_softmax.default)(_softmax_forward("LogSoftmax"))


@_or_standard(aten._safe_softmax.default)
def aten__safe_softmax(self, dim: int, dtype: int = -1):
    """_safe_softmax(Tensor self, int dim, ScalarType? dtype=None) -> Tensor"""
    # Attention's softmax in its math formulation: kept whole only where the kernel takes it (lower/fusable.py),
    # else AOTAutograd decomposes it into a softmax and a select of the rows of -inf.
    if dtype not in (-1, None) and ir.DataType(dtype) != self.dtype:
        raise _NotFused("the fused SafeSoftmax keeps the input's dtype")
    if not self.shape:
        raise _NotFused("the fused SafeSoftmax takes a tensor of one or more dimensions")
    return _fused("SafeSoftmax", [self], dim=int(dim))[0]


@_or_standard(aten.native_layer_norm.default)
def aten_native_layer_norm(input, normalized_shape, weight=None, bias=None, eps: float = 1e-05):
    """native_layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)"""
    if any(not isinstance(d, int) for d in normalized_shape):
        raise _NotFused("the fused LayerNorm takes a normalized shape of plain sizes")
    # ATen keeps a 16-bit input's statistics in float32: float32 and float64 only, one dtype throughout.
    _float32_or_64("LayerNorm", input, weight, bias)
    return tuple(_fused("LayerNorm", [input, weight, bias], num_outputs=3, normalized_shape=list(normalized_shape),
                        eps=float(eps).hex()))


# --- matrix products: ATen's mm, addmm, bmm and baddbmm (eager's GEMM on eager's OpenMP threads). ---


def _read_transposed(value: ir.Value) -> tuple[ir.Value, int]:
    """``value``'s source and 1 where Transposes of its last two axes made it from a transposed source (the
    kernel reads the source as a transposed view, as eager's product reads ``w.t()``), its source and 0 where
    an even number of them did (a backward graph's ``t(t(w))``: the forward's view recomputed, transposed
    again), else ``value`` and 0. A Transpose nothing else reads is left to the graph's unused-node removal."""
    transposed = 0
    while True:
        node = value.producer()
        if node is None or node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            return value, transposed
        perm = node.attributes.get("perm")
        rank = len(perm.as_ints()) if perm is not None else None
        source = node.inputs[0]
        if rank not in (2, 3) or list(perm.as_ints()) != [*range(rank - 2), rank - 1, rank - 2] or source is None:
            return value, transposed
        value, transposed = source, 1 - transposed


def _product(a: ir.Value, b: ir.Value, c: ir.Value | None = None, beta: float = 1.0, alpha: float = 1.0) -> ir.Value:
    (a, trans_a), (b, trans_b) = _read_transposed(a), _read_transposed(b)
    return _fused("Mm", [a, b, c], trans_a=trans_a, trans_b=trans_b, alpha=float(alpha).hex(),
                  beta=float(beta).hex())[0]


@_or_standard(aten.mm.default)
def aten_mm(self, mat2):
    """mm(Tensor self, Tensor mat2) -> Tensor"""
    return _product(self, mat2)


@_or_standard(aten.bmm.default)
def aten_bmm(self, mat2):
    """bmm(Tensor self, Tensor mat2) -> Tensor"""
    return _product(self, mat2)


@_or_standard(aten.addmm.default)
def aten_addmm(self, mat1, mat2, beta: float = 1.0, alpha: float = 1.0):
    """addmm(Tensor self, Tensor mat1, Tensor mat2, *, Scalar beta=1, Scalar alpha=1) -> Tensor"""
    return _product(mat1, mat2, self, beta, alpha)


@_or_standard(aten.baddbmm.default)
def aten_baddbmm(self, batch1, batch2, beta: float = 1.0, alpha: float = 1.0):
    """baddbmm(Tensor self, Tensor batch1, Tensor batch2, *, Scalar beta=1, Scalar alpha=1) -> Tensor"""
    return _product(batch1, batch2, self, beta, alpha)


def _sum(self, dims: list[int], keepdim: bool, dtype) -> ir.Value:
    if dtype not in (-1, None) and ir.DataType(dtype) != self.dtype:
        raise _NotFused("the fused Sum keeps the input's dtype")
    if self.shape is None:
        raise _NotFused("the fused Sum takes a tensor of known rank")
    rank = len(self.shape)
    if rank == 0:
        raise _NotFused("the fused Sum takes a tensor of one or more dimensions")
    axes = sorted({d % rank for d in dims})
    if len(axes) == rank:
        axes = []  # every axis (ATen reads an empty list so)
    return _fused("Sum", [self], dims=axes, keepdim=int(bool(keepdim)))[0]


@_or_standard(aten.sum.dim_IntList)
def aten_sum_dim_intlist(self, dim=None, keepdim: bool = False, dtype: int = -1):
    """sum.dim_IntList(Tensor self, int[1]? dim, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor"""
    # ATen's sum: eager's bits (a bias gradient, a layer norm's weight gradient), where the standard lowering sums
    # in MLAS's order (a ones-row MatMul over leading axes) or ONNX Runtime's ReduceSum's.
    return _sum(self, list(dim or ()), keepdim, dtype)


@_or_standard(aten.sum.default)
def aten_sum(self, dtype: int = -1):
    """sum(Tensor self, *, ScalarType? dtype=None) -> Tensor"""
    return _sum(self, [], False, dtype)
