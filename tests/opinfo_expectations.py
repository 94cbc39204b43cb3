"""The OpInfo sweep's table: one entry per OpInfo that needs anything other than the defaults.

An entry carries tolerances, input wrangling and expected failures. Expected failures are strict: the
sweep fails on an unexpected pass, and on a failure of another kind than the one expected, so the table
always says what happens today. Each ``xfail`` names the outcome it expects:

- a crash, by the stage that raised: ``dynamo`` (Dynamo cannot trace the op; without ``fullgraph`` it
  would run eagerly), ``capture`` (AOTAutograd), ``unsupported`` (no lowering rule for an ATen op),
  ``lowering`` (a rule failed), ``ort`` (ONNX Runtime could not create or run the session), ``error``
  (anything else);
- ``mismatch``: a wrong answer (values, shapes or dtypes differ from eager);
- ``eager``: no graph reached aot2onnx (Dynamo ran the op itself).

Keys are OpInfo names, with the variant after a dot as in ``nn.functional.pad.replicate``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
import torch_behaviour

from aot2onnx.tools import coverage

__all__ = ["CRASHES", "OUTCOMES", "Entry", "XFail", "ENTRIES", "NEWER_OPINFOS", "entry", "xfail", "tolerance"]

CRASHES = ("dynamo", "capture", "unsupported", "lowering", "ort", "error")
OUTCOMES = ("pass", "mismatch", "eager", *CRASHES)

# (rtol, atol) by dtype for outputs and gradients; integer and bool results must be equal.
_DEFAULT_TOLERANCE = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
    # Complex results compare part by part (assert_close on view_as_real) with their parts' tolerance.
    torch.complex64: (1e-4, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}


@dataclasses.dataclass(frozen=True)
class XFail:
    outcome: str
    reason: str
    kind: str = "fwd"
    dtypes: tuple[torch.dtype, ...] | None = None  # None: every dtype
    opsets: tuple[int, ...] | None = None  # None: every target opset
    # None: always; else a probe of the torch at hand (tests/torch_behaviour.py) that says whether it fails so
    when: Callable[[], bool] | None = None

    def applies(self, kind: str, dtype: torch.dtype, opset: int) -> bool:
        return (
            self.kind == kind
            and (self.dtypes is None or dtype in self.dtypes)
            and (self.opsets is None or opset in self.opsets)
            and (self.when is None or self.when())
        )


def xfail(
    outcome: str,
    reason: str,
    *,
    kind: str = "fwd",
    dtypes: Iterable[torch.dtype] | None = None,
    opsets: Iterable[int] | None = None,
    when: Callable[[], bool] | None = None,
) -> XFail:
    """An expected failure: ``outcome`` (a crash stage or ``mismatch``) in the ``fwd`` or ``bwd`` check."""
    if outcome not in OUTCOMES or outcome == "pass":
        raise ValueError(f"xfail outcome must be one of {OUTCOMES[1:]}, got {outcome!r}")
    if kind not in ("fwd", "bwd"):
        raise ValueError(f"xfail kind must be 'fwd' or 'bwd', got {kind!r}")
    if not reason:
        raise ValueError("every xfail needs a reason")
    return XFail(
        outcome, reason, kind, None if dtypes is None else tuple(dtypes), None if opsets is None else tuple(opsets),
        when,
    )


@dataclasses.dataclass(frozen=True)
class Entry:
    xfails: tuple[XFail, ...] = ()
    # Tolerance overrides by dtype, (rtol, atol), for outputs and for gradients.
    tol: dict[torch.dtype, tuple[float, float]] = dataclasses.field(default_factory=dict)
    grad_tol: dict[torch.dtype, tuple[float, float]] = dataclasses.field(default_factory=dict)
    # Rewrites a SampleInput before it runs (both eagerly and compiled).
    wrangle: Callable | None = None
    # False where the output's values cannot match eager's: ATen leaves them unspecified (torch.empty and
    # kin), or they are random (ONNX Runtime's generator is not torch's). Only shapes and dtypes are then
    # compared. A callable decides per sample (dropout with p=0 is deterministic). "processed" compares the
    # values the sample's output_process_fn_grad makes of the outputs (U @ V^H for an SVD, whose vectors'
    # signs are not unique).
    values: bool | str | Callable = True

    def expected(self, kind: str, dtype: torch.dtype, opset: int) -> XFail | None:
        matches = [x for x in self.xfails if x.applies(kind, dtype, opset)]
        if len(matches) > 1:
            raise ValueError(f"several xfails apply to {kind} {dtype} opset {opset}: {matches}")
        return matches[0] if matches else None


def entry(*xfails: XFail, tol=None, grad_tol=None, wrangle=None, values: bool | str | Callable = True) -> Entry:
    return Entry(tuple(xfails), dict(tol or {}), dict(grad_tol or {}), wrangle, values)


def tolerance(entry_: Entry, dtype: torch.dtype, *, grad: bool) -> tuple[float, float]:
    overrides = entry_.grad_tol if grad else entry_.tol
    return overrides.get(dtype, _DEFAULT_TOLERANCE.get(dtype, (0.0, 0.0)))


def _table(pairs: list[tuple[str, Entry]]) -> dict[str, Entry]:
    table: dict[str, Entry] = {}
    for name, value in pairs:
        assert name not in table, f"two entries for {name}"
        table[name] = value
    return table


_TIED_INTEGERS = "the index among tied integer values is unspecified (ATen's std::nth_element)"
_TIED_16_BIT = "the index among tied 16-bit values is unspecified (ATen's std::nth_element)"


def _deterministic_dropout(sample) -> bool:
    """Dropout-like ops draw nothing when p is 0 or outside training: then their values are eager's."""
    kwargs = sample.kwargs
    return kwargs.get("p", 0.5) == 0 or not kwargs.get("training", True)


def _without_m(sample):
    sample.kwargs = {**sample.kwargs, "M": None}
    return sample


def _stable(sample):
    sample.kwargs = {**sample.kwargs, "stable": True}
    return sample


def _without_dropout(sample):
    sample.kwargs = {**sample.kwargs, "dropout_p": 0.0}
    return sample


def _without_ignored_options(sample):
    """linear_cross_entropy ignores ``options`` (the chunked path) unless the weight is 2-D, the reduction mean, sum
    or none, label_smoothing 0 and the target int64: it then warns and computes the reference loss, and Dynamo
    cannot trace warnings.warn with fullgraph=True. Those samples run without the options that do nothing."""
    weight, target = sample.args[0], sample.args[1]
    kwargs = sample.kwargs
    ignored = (weight.dim() != 2 or kwargs.get("reduction", "mean") not in ("mean", "sum", "none")
               or kwargs.get("label_smoothing", 0.0) != 0.0 or target.dtype != torch.int64)
    if ignored and kwargs.get("options") is not None:
        sample.kwargs = {k: v for k, v in kwargs.items() if k != "options"}
    return sample


_RANDOM = "random values: ONNX Runtime's generator is not torch's"
_COMPLEX = "complex tensors (lowered as real [..., 2] pairs)"
# The target opsets newer than 18 (aot2onnx.tools.coverage.target_opsets: the newest the installed ONNX Runtime runs).
_NEWER = tuple(o for o in coverage.target_opsets() if o > 18)
_SPARSE = "sparse tensors: torch.compile does not trace them"
_DATA_DEPENDENT = "a Python value computed from tensor data: torch.compile(fullgraph=True) cannot trace it"
_DYNAMIC_SHAPE = "its output shape depends on tensor data: Dynamo does not trace it by default (capture_dynamic_output_shape_ops)"



ENTRIES: dict[str, Entry] = _table([
    # --- Random ops: shapes and dtypes are compared, values cannot be.
    *[(name, entry(values=False)) for name in (
        "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial", "normal", "normal.in_place",
        "normal.number_mean", "uniform", "rand_like", "randn", "randn_like", "randint", "randint_like",
    )],
    # float16 index_reduce reduces in float32 (ONNX Runtime's CPU ScatterElements has no float16 add or mul) and
    # rounds once, where ATen rounds after each step: ours is nearer float64's (products of 5 float16 factors:
    # 2.5 from float64 against eager's 5.5), and the two differ by more than float16's default tolerance.
    *[(name, entry(tol={torch.float16: (2e-2, 2e-2)}, grad_tol={torch.float16: (2e-2, 2e-2)}))
      for name in ("index_reduce.mean", "index_reduce.prod")],
    # svd_lowrank and pca_lowrank draw a random projection. For a matrix of rank q at most, U @ V^H and S do
    # not depend on it, but the singular vectors' signs do. svd_lowrank's M makes A - M of full rank, where
    # every value depends on the projection: those samples run without M.
    ("svd_lowrank", entry(values="processed", wrangle=_without_m)),
    ("pca_lowrank", entry(values="processed")),
    # A singular vector's sign is not unique: LAPACK's gesdd (eager) and aot2onnx's Jacobi sweeps pick their
    # own, as CPU and CUDA eager do (torch.linalg.svd's documentation). The samples' own output_process_fn_grad
    # keeps what is unique: U @ Vh and S, or |U|, |Vh| and S.
    *[(name, entry(values="processed")) for name in ("linalg.svd", "svd")],
    ("nn.functional.rrelu", entry(
        xfail("mismatch", f"{_RANDOM}: the gradient is the drawn slope", kind="bwd"),
        values=lambda sample: not sample.kwargs.get("training", False),
    )),
    *[(name, entry(values=_deterministic_dropout)) for name in (
        "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d", "nn.functional.alpha_dropout",
        "nn.functional.feature_alpha_dropout.with_train", "nn.functional.feature_alpha_dropout.without_train",
    )],
    ("nn.functional.multi_head_attention_forward", entry(
        xfail("mismatch", f"{_RANDOM}: attention dropout draws a different mask", kind="bwd"),
        # args[9] is dropout_p.
        values=lambda sample: sample.args[9] == 0 or not sample.kwargs.get("training", True),
    )),
    # Attention dropout draws its mask from ONNX Runtime's generator: the samples run with dropout_p=0 here, and
    # test_ops.test_attention_dropout_gradients_use_the_forwards_mask checks the dropout path against its own
    # output. Two float32 gradient elements of about 1e-5 differ by 1.1e-5 (summation order).
    ("nn.functional.scaled_dot_product_attention", entry(
        wrangle=_without_dropout, grad_tol={torch.float32: (1e-4, 3e-5)},
    )),
    # Over a single normalized element, x - mean is 0 here and a rounding error of x in eager's kernel (4e-8 at
    # x = 2.2), which rstd = 1/sqrt(eps) = 316 turns into a weight gradient of 1.4e-5 to 1.5e-4 where ours is 0.
    *[(name, entry(grad_tol={torch.float32: (1e-4, 2e-4)})) for name in ("native_layer_norm", "nn.functional.layer_norm")],
    # ATen's unstable sort (the default) leaves the order of equal values unspecified; aot2onnx's sort is stable
    # either way (ONNX Runtime's TopK). The float16, bfloat16 and bool samples have ties: sort and argsort run
    # them with stable=True, and msort, which has no such argument, sends a tied value's gradient elsewhere.
    *[(name, entry(wrangle=_stable)) for name in ("sort", "argsort")],
    ("msort", entry(xfail("mismatch", "ties: eager's unstable sort puts equal values in another order than ours "
                          "(stable), so their gradients land on other elements", kind="bwd",
                          dtypes=(torch.float16, torch.bfloat16)))),
    ("nn.functional.linear_cross_entropy.chunked", entry(
        xfail("mismatch", "16-bit inputs: ATen's chunked op (acc_policy 'compact') rounds the logits' gradient and "
                          "accumulates the weight gradient in the input's dtype chunk by chunk; the lowering "
                          "accumulates in float32 and rounds once", kind="bwd", dtypes=(torch.float16, torch.bfloat16)),
        wrangle=_without_ignored_options)),
    ("nn.functional.linear_cross_entropy.chunked_none", entry(wrangle=_without_ignored_options)),
    # --- Ops whose values ATen leaves unspecified.
    *[(name, entry(values=False)) for name in (
        "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted",
    )],
    # --- Dynamo cannot trace these with fullgraph=True (without it they would run eagerly).
    *[(name, entry(xfail("dynamo", _DATA_DEPENDENT))) for name in ("allclose", "equal", "corrcoef", "cov")],
    ("nn.functional.gaussian_nll_loss", entry(xfail("dynamo", "checks a data-dependent condition in Python (Eq(u0, 1))"))),
    *[(name, entry(xfail("dynamo", _DYNAMIC_SHAPE))) for name in (
        "linalg.lstsq", "linalg.lstsq.grad_oriented", "nn.functional.ctc_loss",
    )],
    *[(name, entry(xfail("dynamo", _SPARSE))) for name in ("sparse.mm.reduce", "sparse.sampled_addmm", "to_sparse")],
    ("resize_", entry(xfail("dynamo", "Dynamo does not trace Tensor.resize_"))),
    ("resize_as_", entry(xfail("dynamo", "Dynamo does not trace torch.resize_as_"))),
    # torch 2.14 captures it (no smaller probe than the sweep's own capture shows the difference)
    ("bucketize", entry(xfail("capture", "AOTAutograd specializes a data-dependent size (GuardOnDataDependentSymNode)",
                              when=lambda: torch_behaviour.torch_before("2.14")))),
    # --- Ties: which index of equal values eager returns is unspecified (ATen's std::nth_element and
    # partial_sort); integer samples have many. The values match; the indices point at equal values.
    # 16-bit samples tie too: topk and mode send a tied value's gradient elsewhere (mode's 3000-element sample
    # ties in float16 as well).
    ("kthvalue", entry(xfail("mismatch", _TIED_INTEGERS, dtypes=(torch.int64,)))),
    *[(name, entry(xfail("mismatch", _TIED_INTEGERS, dtypes=(torch.int64,)),
                   xfail("mismatch", _TIED_16_BIT, dtypes=dtypes),
                   xfail("mismatch", _TIED_16_BIT + ": their gradients land on other elements", kind="bwd",
                         dtypes=dtypes))) for name, dtypes in (("topk", (torch.bfloat16,)),
                                                               ("mode", (torch.bfloat16, torch.float16)))],
    # --- Eager is wrong: ATen's float16 and bfloat16 matrix_exp returns NaN for any nonzero input (torch 2.13;
    # float32 and float64 are right). Ours is the float64 result rounded.
    # In float32, over the slow sweep's [5, 5, 5] sample of column sums up to 28, eager's own error is up to
    # 0.05 against float64's matrix_exp; ours, computed in float64 and rounded, is 0.0018 off it (one element of
    # 125 differs from eager by 3.5e-4, relative 2.4e-3): the float32 tolerance covers eager's error.
    ("matrix_exp", entry(*(xfail("mismatch", "eager's 16-bit matrix_exp returns NaN", kind=kind,
                                 dtypes=(torch.float16, torch.bfloat16)) for kind in ("fwd", "bwd")),
                         tol={torch.float32: (3e-3, 1e-5)})),
    # --- Complex numbers.
    ("chalf", entry(xfail("lowering", "complex32 has no ONNX equivalent"))),
    ("linalg.eig", entry(xfail("unsupported", "no lowering for the general (complex) eigendecomposition"))),
    ("linalg.eigvals", entry(xfail("unsupported", "no lowering for the general (complex) eigendecomposition"))),
    # (Results of sums over 10-20 values up to 9 in size: a float32 rounding of them exceeds atol 1e-5.)
    *[(name, entry(tol={torch.float32: (1e-4, 1e-4)}))
      for name in ("fft.hfft", "fft.hfft2", "fft.hfftn", "fft.irfft", "fft.irfft2", "fft.irfftn")],
    # --- No lowering yet.
    ("_upsample_bilinear2d_aa", entry(xfail("unsupported", "no lowering for _upsample_bilinear2d_aa_backward", kind="bwd"))),
    ("grid_sampler_2d", entry(xfail("unsupported", "no lowering for grid_sampler_2d_backward", kind="bwd"))),
    ("nn.functional.grid_sample", entry(xfail("unsupported", "no lowering for grid_sampler_2d_backward", kind="bwd"))),
    ("grid_sampler_3d", entry(xfail("unsupported", "no lowering for grid_sampler_3d (ONNX GridSample is 2-D before opset 20)"))),
    ("hash_tensor", entry(xfail("unsupported", "no lowering for hash_tensor"))),
    ("histogramdd", entry(xfail("unsupported", "no lowering for _histogramdd_bin_edges / _histogramdd_from_bin_cts"))),
    *[(name, entry(xfail("unsupported", "no lowering for the LDL factorization (LAPACK's Bunch-Kaufman pivoting)")))
      for name in ("linalg.ldl_factor", "linalg.ldl_factor_ex", "linalg.ldl_solve")],
    ("nn.functional.fractional_max_pool2d", entry(xfail("unsupported", "no lowering for fractional_max_pool2d"))),
    ("nn.functional.fractional_max_pool3d", entry(xfail("unsupported", "no lowering for fractional_max_pool3d"))),
    # OpInfos of torch releases after the locked one (NEWER_OPINFOS)
    ("linalg.matrix_sqrth", entry(xfail("unsupported", "no lowering for linalg_matrix_sqrth (new in torch 2.14)"))),
    ("linalg.polar", entry(xfail("unsupported", "no lowering for linalg_polar (new in torch 2.14)"))),
    # ATen's flash kernel sums the keys block by block; the lowering's float32 sums in another order: measured on
    # torch 2.14.1's sample (query 3, keys 6, causal), gradients up to 5.5e-5 off at magnitudes up to 20.7.
    ("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu", entry(grad_tol={torch.float32: (1e-5, 1e-4)})),
    *[(name, entry(xfail("dynamo", "torch 2.11's Dynamo stops at quantile (\"Data dependent operator\"); torch "
                                   "2.12 on traces it", when=lambda: not torch_behaviour.dynamo_traces_quantile())))
      for name in ("quantile", "nanquantile")],
    # --- Wrong answers.
    ("linalg.eigh", entry(xfail(
        "mismatch", "eigenvectors are unique only up to sign, and the Jacobi lowering's signs are not LAPACK's "
        "(eigenvalues, and the gradients, match)"))),
    ("tensor_split", entry(
        xfail("lowering", "the outputs are views of the input at data-dependent offsets, which AOTAutograd would "
                          "rebuild from ONNX Runtime's copies at offset 0: those views run in PyTorch "
                          "(compile.backend.symbolic_input_views), a LoweringError under this sweep's fallback=False"),
    )),
    # --- ONNX Runtime refuses the model or fails running it.
    ("nn.functional.pad.replicate_negative", entry(xfail(
        "mismatch", "16-bit replication_pad backward: the copies of an edge are summed in another order and rounding "
                    "than ATen's, which rounds after each add (float32 and float64 pass)", kind="bwd", dtypes=(torch.float16, torch.bfloat16)))),
    *[(name, entry(xfail("lowering", "ONNX Runtime has no int64 Relu kernel (cumprod's backward takes one of its int64 "
                                     "indices): it runs one in an opset-18 model through the schema's function body, "
                                     "not at a newer opset, and aot2onnx refuses to convert such a node",
                         kind="bwd", opsets=_NEWER, when=torch_behaviour.cumprod_backward_takes_an_int64_relu)))
      for name in ("cumprod", "masked.cumprod")],
])

# Entries for OpInfos that only torch releases after requirements.lock's have (test_expectations_name_opinfos).
NEWER_OPINFOS = frozenset({
    "linalg.matrix_sqrth", "linalg.polar", "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
})
