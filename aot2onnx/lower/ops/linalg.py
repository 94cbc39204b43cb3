"""Linear algebra: factorizations and solves, written out in ONNX ops for matrices of static size.

ONNX has no decompositions (only Det), so each rule spells out the algorithm LAPACK runs for ATen, with
the same conventions, so that factors ATen returns (LU and its pivots, geqrf's Householder vectors and
tau, Cholesky factors) come out the same and not merely equivalent:

- LU: partial pivoting on the largest magnitude (the first one on ties), as LAPACK's getrf.
- QR: LAPACK's Householder reflectors (dlarfg: beta = -sign(alpha) * norm).
- Cholesky: reads the lower triangle (the upper one for ``upper=True``), as potrf.
- Symmetric eigendecomposition and SVD: Jacobi rotations, n / 2 disjoint pairs at a time (Brent and Luk's
  parallel ordering) in an ONNX Loop, a fixed number of sweeps (quadratic convergence makes 10 sweeps
  exact in double precision for the sizes these graphs see). Singular values
  and eigenvalues are unique; singular and eigenvectors are unique only up to sign, which LAPACK fixes in
  its own way, so a rule that returns vectors matches ATen only up to those signs (products such as the
  pseudo-inverse do not depend on them).

The loops over rows and columns are unrolled at lowering time, so the matrix dimensions (the last two)
must be static; batch dimensions may be anything. Everything is computed in float64 and cast back.
The checks that make ATen raise on singular input (``_linalg_check_errors``, behind ``torch.linalg.inv``,
``cholesky``, ``solve``) are not ONNX nodes: the graph returns the ``info`` they read, and the runtime runs
ATen's check on it after the run (``signature.CheckSpec``), so the error is eager's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op

from aot2onnx.lower.checks import CHECK_LINALG, runtime_check
from aot2onnx.lower.ops._common import float64_constant, rounded_to, truth_dtype
from aot2onnx.lower.ops._control import cond, loop
from aot2onnx.lower.registry import project_rule

aten = torch.ops.aten

_DOUBLE = ir.DataType.DOUBLE
_SWEEPS = 10


def _mask(values) -> ir.Value:
    return op.Constant(value=ir.tensor(np.asarray(values, dtype=np.bool_)))


def _ints(values: Sequence[int]) -> ir.Value:
    return op.Constant(value_ints=list(values))


def _matrix_dims(x, what: str = "matrix") -> tuple[int, int]:
    shape = x.shape
    if shape is None or len(shape) < 2 or not all(isinstance(d, int) for d in shape[-2:]):
        raise NotImplementedError(f"aot2onnx lowers linear algebra on {what}s of static size; got shape {shape}")
    return shape[-2], shape[-1]


class M:
    """A float64 batch of matrices [..., rows, cols] with static rows/cols, as an ONNX value."""

    __slots__ = ("v", "rank", "rows", "cols")

    def __init__(self, value, rank: int, rows: int, cols: int) -> None:
        self.v, self.rank, self.rows, self.cols = value, rank, rows, cols

    @classmethod
    def of(cls, x) -> M:
        rows, cols = _matrix_dims(x)
        return cls(op.Cast(x, to=_DOUBLE), len(x.shape), rows, cols)

    def like(self, value, rows: int | None = None, cols: int | None = None) -> M:
        return M(value, self.rank, self.rows if rows is None else rows, self.cols if cols is None else cols)

    @property
    def T(self) -> M:
        perm = list(range(self.rank - 2)) + [self.rank - 1, self.rank - 2]
        return M(op.Transpose(self.v, perm=perm), self.rank, self.cols, self.rows)

    def __matmul__(self, other: M) -> M:
        return M(op.MatMul(self.v, other.v), max(self.rank, other.rank), self.rows, other.cols)

    def col(self, j: int):
        return op.Gather(self.v, op.Constant(value_int=j), axis=-1)  # [..., rows]

    def row(self, i: int):
        return op.Gather(self.v, op.Constant(value_int=i), axis=-2)  # [..., cols]

    def entry(self, i: int, j: int):
        return op.Gather(self.row(i), op.Constant(value_int=j), axis=-1)  # [...]

    def diagonal(self):
        """[..., min(rows, cols)]."""
        axis = -1 if self.rows <= self.cols else -2
        return op.ReduceSum(op.Mul(self.v, float64_constant(np.eye(self.rows, self.cols))), _ints([axis]), keepdims=0)

    def out(self, like):
        return op.CastLike(self.v, like)


def _last(x):
    return op.Unsqueeze(x, _ints([-1]))


def _eye(n: int) -> M:
    return M(float64_constant(np.eye(n)), 2, n, n)


def _triangle(a: M, lower: bool, diagonal: int = 0) -> M:
    mask = np.tril(np.ones((a.rows, a.cols)), diagonal) if lower else np.triu(np.ones((a.rows, a.cols)), diagonal)
    return a.like(op.Mul(a.v, float64_constant(mask)))


# --- triangular solves ---------------------------------------------------------------------------------


def _positions(n: int) -> ir.Value:
    return op.Constant(value=ir.tensor(np.arange(n, dtype=np.int64)))


def _int32(value: int) -> ir.Value:
    return op.Constant(value=ir.tensor(np.int32(value)))


def _zeros_like_solution(t: M, b: M):
    """Zeros of the shape of X in t X = b: the broadcast batch of t and b, then b's rows and columns."""
    shape = op.Shape(op.Expand(b.v, op.Concat(op.Shape(t.v, end=-2), op.Shape(b.v, start=-2), axis=0)))
    return op.ConstantOfShape(shape, value=ir.tensor(np.zeros(1, dtype=np.float64)))


def _substitute(t: M, b: M, unit: bool, upper: bool) -> M:
    """X with t X = b for triangular t: row i of X from the rows already solved, one row per iteration.

    Only the strictly lower (upper) part of t is read, besides the diagonal.
    """
    n = t.rows
    if n == 0:
        return b
    if b.cols == 0:  # nothing to solve; a Loop over empty rows trips ONNX shape inference
        return M(_zeros_like_solution(t, b), max(t.rank, b.rank), n, 0)
    positions, rows = _positions(n), op.Constant(value=ir.tensor(np.arange(n, dtype=np.int64).reshape(n, 1)))

    def step(i, x):
        index = op.Sub(op.Constant(value_int=n - 1), i) if upper else i
        row = op.Gather(t.v, index, axis=-2)  # [..., n]
        solved = op.Greater(positions, index) if upper else op.Less(positions, index)
        row = op.Where(solved, row, float64_constant(0.0))
        acc = op.Sub(op.Gather(b.v, index, axis=-2), op.Squeeze(op.MatMul(op.Unsqueeze(row, _ints([-2])), x), _ints([-2])))
        if not unit:
            acc = op.Div(acc, _last(op.Gather(op.Gather(t.v, index, axis=-2), index, axis=-1)))
        return [op.Where(op.Equal(rows, index), op.Unsqueeze(acc, _ints([-2])), x)]

    x0 = _zeros_like_solution(t, b)
    x0.dtype = _DOUBLE
    (x,) = loop(n, [x0], step, iteration=True)
    return M(x, max(t.rank, b.rank), n, b.cols)


def _solve_lower(t: M, b: M, unit: bool) -> M:
    """X with t X = b for lower-triangular t (forward substitution)."""
    return _substitute(t, b, unit, upper=False)


def _solve_upper(t: M, b: M, unit: bool) -> M:
    """X with t X = b for upper-triangular t (back substitution)."""
    return _substitute(t, b, unit, upper=True)


def _solve_triangular(t: M, b: M, upper: bool, left: bool, unit: bool) -> M:
    if not left:  # X t = b  <=>  t^T X^T = b^T
        return _solve_triangular(t.T, b.T, not upper, True, unit).T
    return _solve_upper(t, b, unit) if upper else _solve_lower(t, b, unit)


@project_rule(aten.linalg_solve_triangular.default)
def aten_linalg_solve_triangular(self, B, upper: bool, left: bool = True, unitriangular: bool = False):
    """linalg_solve_triangular(Tensor self, Tensor B, *, bool upper, bool left=True, bool unitriangular=False) -> Tensor"""
    t, b = M.of(self), M.of(B)
    return _solve_triangular(t, b, upper, left, unitriangular).out(B)


@project_rule(aten.triangular_solve.default)
def aten_triangular_solve(self, A, upper: bool = True, transpose: bool = False, unitriangular: bool = False):
    """triangular_solve(Tensor self, Tensor A, bool upper=True, bool transpose=False, bool unitriangular=False) -> (Tensor solution, Tensor cloned_coefficient)"""
    a, b = M.of(A), M.of(self)
    if transpose:
        a, upper = a.T, not upper
    return _solve_triangular(a, b, upper, True, unitriangular).out(self), op.Identity(A)


# --- Cholesky --------------------------------------------------------------------------------------------


def _cholesky_lower(a: M):
    """The lower Cholesky factor from a's lower triangle, and LAPACK's info (the first non-positive pivot)."""
    n = a.rows
    if n == 0:
        return a, op.Expand(_int32(0), op.Shape(a.v, end=-2))
    positions = _positions(n)

    def step(j, factor, info):
        # Column j: a[:, j] minus what the columns before it account for, scaled by the pivot's root.
        s = op.Sub(op.Gather(a.v, j, axis=-1),
                   op.Squeeze(op.MatMul(factor, op.Unsqueeze(op.Gather(factor, j, axis=-2), _ints([-1]))), _ints([-1])))
        pivot = op.Gather(s, j, axis=-1)
        column = op.Where(op.GreaterOrEqual(positions, j), op.Div(s, _last(op.Sqrt(pivot))), float64_constant(0.0))
        factor = op.Where(op.Equal(positions, j), op.Unsqueeze(column, _ints([-1])), factor)
        failed = op.And(op.Equal(info, _int32(0)), op.Not(op.Greater(pivot, float64_constant(0.0))))
        info = op.Where(failed, op.Cast(op.Add(j, op.Constant(value_int=1)), to=ir.DataType.INT32), info)
        return [factor, info]

    factor0 = op.Mul(a.v, float64_constant(0.0))
    factor0 = op.Where(op.IsNaN(factor0), float64_constant(0.0), factor0)
    factor0.dtype = _DOUBLE
    info0 = op.Expand(_int32(0), op.Shape(a.v, end=-2))
    info0.dtype = ir.DataType.INT32
    factor, info = loop(n, [factor0, info0], step, iteration=True)
    return a.like(factor), info


def _cholesky(x, upper: bool):
    a = M.of(x)
    if upper:  # A = U^T U: the lower factor of A^T, read from A's upper triangle
        lower, info = _cholesky_lower(a.T)
        return lower.T, info
    return _cholesky_lower(a)


@project_rule(aten.linalg_cholesky_ex.default)
def aten_linalg_cholesky_ex(self, upper: bool = False, check_errors: bool = False):
    """linalg_cholesky_ex(Tensor self, *, bool upper=False, bool check_errors=False) -> (Tensor L, Tensor info)"""
    factor, info = _cholesky(self, upper)
    return factor.out(self), op.Expand(info, op.Shape(self, end=-2))


# torch 2.14 removed aten.cholesky (torch.cholesky, deprecated since 1.9, now raises there).
if hasattr(aten, "cholesky"):

    @project_rule(aten.cholesky.default)
    def aten_cholesky(self, upper: bool = False):
        """cholesky(Tensor self, bool upper=False) -> Tensor"""
        return _cholesky(self, upper)[0].out(self)


def _cholesky_solve(b: M, factor: M, upper: bool) -> M:
    if upper:  # A = U^T U
        return _solve_upper(factor, _solve_lower(factor.T, b, False), False)
    return _solve_upper(factor.T, _solve_lower(factor, b, False), False)


@project_rule(aten.cholesky_solve.default)
def aten_cholesky_solve(self, input2, upper: bool = False):
    """cholesky_solve(Tensor self, Tensor input2, bool upper=False) -> Tensor"""
    return _cholesky_solve(M.of(self), M.of(input2), upper).out(self)


@project_rule(aten.cholesky_inverse.default)
def aten_cholesky_inverse(self, upper: bool = False):
    """cholesky_inverse(Tensor self, bool upper=False) -> Tensor"""
    factor = M.of(self)
    return _cholesky_solve(_eye(factor.rows), factor, upper).out(self)


# --- LU ---------------------------------------------------------------------------------------------------


def _getrf(a: M):
    """LAPACK's getrf: (LU, pivots as 1-based int32 row swaps, info, the row permutation as int64)."""
    m, n = a.rows, a.cols
    k = min(m, n)
    batch = op.Shape(a.v, end=-2)
    positions, columns = _positions(m), _positions(n)
    rows = op.Constant(value=ir.tensor(np.arange(m, dtype=np.int64).reshape(m, 1)))
    if k == 0:
        empty = op.Expand(op.Constant(value=ir.tensor(np.zeros((0,), dtype=np.int32))), op.Concat(batch, _ints([0]), axis=0))
        perm = op.Expand(positions, op.Concat(batch, _ints([m]), axis=0))
        return a, empty, op.Expand(_int32(0), batch), perm

    def step(j, lu, perm, pivots, info):
        column = op.Gather(lu, j, axis=-1)  # [..., m]
        candidates = op.Where(op.GreaterOrEqual(positions, j), op.Abs(column), float64_constant(-1.0))
        p = op.ArgMax(candidates, axis=-1, keepdims=1)  # [..., 1], the first largest
        # Swap rows j and p.
        swap = op.Where(op.Equal(positions, j), p, op.Where(op.Equal(positions, p), j, positions))  # [..., m]
        lu = op.GatherElements(lu, op.Expand(_last(swap), op.Shape(lu)), axis=-2)
        perm = op.GatherElements(perm, swap, axis=-1)
        pivots = op.Where(op.Equal(_positions(k), j), op.Cast(op.Add(p, op.Constant(value_int=1)), to=ir.DataType.INT32), pivots)
        pivot = op.Gather(op.Gather(lu, j, axis=-2), j, axis=-1)
        singular = op.Equal(pivot, float64_constant(0.0))
        info = op.Where(op.And(singular, op.Equal(info, _int32(0))), op.Cast(op.Add(j, op.Constant(value_int=1)), to=ir.DataType.INT32), info)
        # Multipliers below the pivot (left unscaled when the pivot is zero, as LAPACK does), then the
        # rank-one update of the trailing block.
        column = op.Gather(lu, j, axis=-1)
        below = op.Greater(positions, j)
        multipliers = op.Where(below, op.Where(_last(singular), column, op.Div(column, _last(pivot))), float64_constant(0.0))
        urow = op.Where(op.Greater(columns, j), op.Gather(lu, j, axis=-2), float64_constant(0.0))  # [..., n]
        lu = op.Sub(lu, op.Mul(op.Unsqueeze(multipliers, _ints([-1])), op.Unsqueeze(urow, _ints([-2]))))
        column_j = op.And(op.Greater(rows, j), op.Equal(columns, j))  # [m, n]
        lu = op.Where(column_j, op.Unsqueeze(multipliers, _ints([-1])), lu)
        return [lu, perm, pivots, info]

    perm0 = op.Expand(positions, op.Concat(batch, _ints([m]), axis=0))
    pivots0 = op.Expand(op.Constant(value=ir.tensor(np.zeros((k,), dtype=np.int32))), op.Concat(batch, _ints([k]), axis=0))
    info0 = op.Expand(_int32(0), batch)
    lu0 = a.v
    for value, dtype in ((lu0, _DOUBLE), (perm0, ir.DataType.INT64), (pivots0, ir.DataType.INT32), (info0, ir.DataType.INT32)):
        value.dtype = dtype
    lu, perm, pivots, info = loop(k, [lu0, perm0, pivots0, info0], step, iteration=True)
    return a.like(lu), pivots, info, perm


def _permutation_matrix(perm, m: int, rank: int) -> M:
    """P with P[perm[i], i] = 1, so that A = P L U when row i of L U is row perm[i] of A."""
    rows = op.Constant(value=ir.tensor(np.arange(m, dtype=np.int64).reshape(m, 1)))
    return M(op.Cast(op.Equal(rows, op.Unsqueeze(perm, _ints([-2]))), to=_DOUBLE), rank, m, m)


def _unpack(lu: M):
    """(L, U) of a packed LU: L unit lower m x k, U upper k x n, k = min(m, n)."""
    m, n = lu.rows, lu.cols
    k = min(m, n)
    lower = np.tril(np.ones((m, k)), -1)
    unit = np.eye(m, k)
    l_value = op.Add(op.Mul(op.Slice(lu.v, _ints([0]), _ints([k]), _ints([-1])), float64_constant(lower)), float64_constant(unit))
    u_value = op.Mul(op.Slice(lu.v, _ints([0]), _ints([k]), _ints([-2])), float64_constant(np.triu(np.ones((k, n)))))
    return M(l_value, lu.rank, m, k), M(u_value, lu.rank, k, n)


def _perm_from_pivots(pivots, m: int, batch_shape):
    """The row permutation that LAPACK's sequential swaps (1-based pivots) produce."""
    positions = op.Constant(value=ir.tensor(np.arange(m, dtype=np.int64)))
    perm = op.Expand(positions, op.Concat(batch_shape, _ints([m]), axis=0))
    count = pivots.shape[-1] if pivots.shape is not None else None
    if not isinstance(count, int):
        raise NotImplementedError("aot2onnx needs a static number of LU pivots")
    for k in range(count):
        p = op.Sub(op.Cast(op.Gather(pivots, op.Constant(value_int=k), axis=-1), to=ir.DataType.INT64), op.Constant(value_int=1))
        p = _last(p)
        swap = op.Where(op.Equal(positions, op.Constant(value_int=k)), p,
                        op.Where(op.Equal(positions, p), op.Constant(value_int=k), positions))
        perm = op.GatherElements(perm, swap, axis=-1)
    return perm


def _gather_rows(b: M, perm) -> M:
    """Rows perm[i] of b: P^T b for the P of ``perm``."""
    index = op.Expand(_last(perm), op.Concat(op.Shape(perm), _ints([b.cols]), axis=0))
    b_value = op.Expand(b.v, op.Concat(op.Shape(perm, end=-1), _ints([b.rows, b.cols]), axis=0))
    return b.like(op.GatherElements(b_value, index, axis=-2))


def _scatter_rows(z: M, perm) -> M:
    """x with x[perm[i]] = z[i]: P z."""
    index = op.Expand(_last(perm), op.Shape(z.v))
    return z.like(op.ScatterElements(op.Mul(z.v, float64_constant(0.0)), index, z.v, axis=-2))


def _lu_solve(lu: M, perm, b: M, left: bool, adjoint: bool) -> M:
    lower, upper = _unpack(lu)
    if not left:  # X A = B  <=>  A^T X^T = B^T
        return _lu_solve(lu, perm, b.T, True, not adjoint).T
    if not adjoint:  # A = P L U: X = U^-1 L^-1 P^T B
        return _solve_upper(upper, _solve_lower(lower, _gather_rows(b, perm), True), False)
    # A^T = U^T L^T P^T: X = P L^-T U^-T B
    return _scatter_rows(_solve_upper(lower.T, _solve_lower(upper.T, b, False), True), perm)


@project_rule(aten.linalg_lu_factor_ex.default)
def aten_linalg_lu_factor_ex(A, pivot: bool = True, check_errors: bool = False):
    """linalg_lu_factor_ex(Tensor A, *, bool pivot=True, bool check_errors=False) -> (Tensor LU, Tensor pivots, Tensor info)"""
    if not pivot:
        raise NotImplementedError("LU without pivoting (ATen has it on CUDA only)")
    lu, pivots, info, _ = _getrf(M.of(A))
    return lu.out(A), pivots, info


@project_rule(aten.linalg_lu.default)
def aten_linalg_lu(A, pivot: bool = True):
    """linalg_lu(Tensor A, *, bool pivot=True) -> (Tensor P, Tensor L, Tensor U)"""
    if not pivot:
        raise NotImplementedError("LU without pivoting (ATen has it on CUDA only)")
    a = M.of(A)
    lu, _, _, perm = _getrf(a)
    lower, upper = _unpack(lu)
    return _permutation_matrix(perm, a.rows, a.rank).out(A), lower.out(A), upper.out(A)


@project_rule(aten.lu_unpack.default)
def aten_lu_unpack(LU_data, LU_pivots, unpack_data: bool = True, unpack_pivots: bool = True):
    """lu_unpack(Tensor LU_data, Tensor LU_pivots, bool unpack_data=True, bool unpack_pivots=True) -> (Tensor P, Tensor L, Tensor U)"""
    lu = M.of(LU_data)
    empty = op.CastLike(op.ConstantOfShape(_ints([0])), LU_data)
    if unpack_pivots:
        perm = _perm_from_pivots(LU_pivots, lu.rows, op.Shape(LU_data, end=-2))
        p = _permutation_matrix(perm, lu.rows, lu.rank).out(LU_data)
    else:
        p = empty
    if unpack_data:
        lower, upper = _unpack(lu)
        return p, lower.out(LU_data), upper.out(LU_data)
    return p, op.Identity(empty), op.Identity(empty)


@project_rule(aten.linalg_lu_solve.default)
def aten_linalg_lu_solve(LU, pivots, B, left: bool = True, adjoint: bool = False):
    """linalg_lu_solve(Tensor LU, Tensor pivots, Tensor B, *, bool left=True, bool adjoint=False) -> Tensor"""
    lu = M.of(LU)
    perm = _perm_from_pivots(pivots, lu.rows, op.Shape(LU, end=-2))
    return _lu_solve(lu, perm, M.of(B), left, adjoint).out(B)


def _is_vector_rhs(A, B) -> bool:
    # ATen's linalg_solve_is_vector_rhs: B is a vector, or a batch of vectors matching A's batch.
    return len(B.shape) == 1 or (len(B.shape) == len(A.shape) - 1 and list(B.shape) == list(A.shape[:-1]))


@project_rule(aten._linalg_solve_ex.default)
def aten__linalg_solve_ex(A, B, left: bool = True, check_errors: bool = False):
    """_linalg_solve_ex(Tensor A, Tensor B, *, bool left=True, bool check_errors=False) -> (Tensor result, Tensor LU, Tensor pivots, Tensor info)"""
    a = M.of(A)
    vector = _is_vector_rhs(A, B)
    if vector:
        b = M(op.Cast(_last(B), to=_DOUBLE), len(B.shape) + 1, B.shape[-1], 1)
    else:
        b = M.of(B)
    lu, pivots, info, perm = _getrf(a)
    x = _lu_solve(lu, perm, b if left else b, left, False)
    result = op.Squeeze(x.v, _ints([-1])) if vector else x.v
    return op.CastLike(result, B), lu.out(A), pivots, info


@project_rule(aten.linalg_inv_ex.default)
def aten_linalg_inv_ex(A, check_errors: bool = False):
    """linalg_inv_ex(Tensor A, *, bool check_errors=False) -> (Tensor inverse, Tensor info)"""
    a = M.of(A)
    lu, _, info, perm = _getrf(a)
    return _lu_solve(lu, perm, _eye(a.rows), True, False).out(A), info


def _swap_parity(pivots, k: int):
    """(-1) ** (number of actual row swaps) as float64, from 1-based pivots."""
    if k == 0:
        return float64_constant(1.0)
    steps = op.Constant(value=ir.tensor(np.arange(1, k + 1, dtype=np.int32)))
    swaps = op.ReduceSum(op.Cast(op.Not(op.Equal(pivots, steps)), to=ir.DataType.INT64), _ints([-1]), keepdims=0)
    odd = op.Cast(op.Mod(swaps, op.Constant(value_int=2)), to=_DOUBLE)
    return op.Sub(float64_constant(1.0), op.Mul(float64_constant(2.0), odd))


@project_rule(aten._linalg_det.default)
def aten__linalg_det(A):
    """_linalg_det(Tensor A) -> (Tensor result, Tensor LU, Tensor pivots)"""
    a = M.of(A)
    lu, pivots, _, _ = _getrf(a)
    if a.rows == 0:
        det = op.Expand(float64_constant(1.0), op.Shape(A, end=-2))
    else:
        det = op.Mul(op.ReduceProd(lu.diagonal(), _ints([-1]), keepdims=0), _swap_parity(pivots, a.rows))
    return op.CastLike(det, A), lu.out(A), pivots


@project_rule(aten._linalg_slogdet.default)
def aten__linalg_slogdet(A):
    """_linalg_slogdet(Tensor A) -> (Tensor sign, Tensor logabsdet, Tensor LU, Tensor pivots)"""
    a = M.of(A)
    lu, pivots, _, _ = _getrf(a)
    if a.rows == 0:
        batch = op.Shape(A, end=-2)
        sign, logabsdet = op.Expand(float64_constant(1.0), batch), op.Expand(float64_constant(0.0), batch)
    else:
        diagonal = lu.diagonal()
        sign = op.Mul(op.ReduceProd(op.Sign(diagonal), _ints([-1]), keepdims=0), _swap_parity(pivots, a.rows))
        logabsdet = op.ReduceSum(op.Log(op.Abs(diagonal)), _ints([-1]), keepdims=0)
    return op.CastLike(sign, A), op.CastLike(logabsdet, A), lu.out(A), pivots


# Effectful ops AOTAutograd threads a token through, whose only effect is to raise on bad input.
_CHECKS = {"aten::_linalg_check_errors"}


@project_rule(torch.ops.higher_order.with_effects)
def higher_order_with_effects(token, effectful_op, *args, **kwargs):
    """with_effects(Tensor token, OpOverload op, *args, **kwargs) -> (Tensor token, *outputs)"""
    name = effectful_op.name() if isinstance(effectful_op, torch._ops.OpOverload) else str(effectful_op)
    if name not in _CHECKS:
        raise NotImplementedError(f"no lowering for the effectful op {name}")
    # The check raises in ATen when a factorization failed. It is not an ONNX node: the graph returns the
    # info it reads, and the runtime runs ATen's check on it after the run (lower/checks.py).
    info, api_name = args
    runtime_check(info, CHECK_LINALG, str(api_name), bool(kwargs.get("is_matrix", True)))
    # The new token is a fresh empty tensor, sunk by prims._sink_tokens.
    return (op.ConstantOfShape(_ints([0]), value=ir.tensor(np.zeros(1, dtype=token.dtype.numpy()))),)


@project_rule(torch.ops.prims._make_token.default)
def prims_make_token():
    """_make_token() -> Tensor: the token an effectful op is threaded with (tokens unlifted, capture/aot.py)."""
    return op.ConstantOfShape(_ints([0]), value=ir.tensor(np.zeros(1, dtype=np.float32)))


@project_rule(torch.ops.prims._sink_tokens.default)
def prims_sink_tokens(tokens):
    """_sink_tokens(Tensor[] tokens) -> (): where the tokens end; nothing to compute."""
    return None


# --- symmetric eigendecomposition and SVD (parallel Jacobi) ---------------------------------------------


def _jacobi_angle(theta, zero):
    """(c, s) of the rotation that zeroes an off-diagonal entry, from theta = (a_qq - a_pp) / (2 a_pq)."""
    sign = op.Where(op.Less(theta, float64_constant(0.0)), float64_constant(-1.0), float64_constant(1.0))
    t = op.Div(sign, op.Add(op.Abs(theta), op.Sqrt(op.Add(op.Mul(theta, theta), float64_constant(1.0)))))
    t = op.Where(zero, float64_constant(0.0), t)
    c = op.Div(float64_constant(1.0), op.Sqrt(op.Add(op.Mul(t, t), float64_constant(1.0))))
    return c, op.Mul(t, c)


def _sorted_columns(values, vectors: M, descending: bool):
    """values [..., n] sorted, and the columns of vectors [..., m, n] in the same order."""
    n = vectors.cols
    values, order = op.TopK(values, _ints([n]), axis=-1, largest=1 if descending else 0, sorted=1)
    index = op.Expand(op.Unsqueeze(order, _ints([-2])), op.Shape(vectors.v))
    return values, vectors.like(op.GatherElements(vectors.v, index, axis=-1))


def _round_robin(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(p, q) [rounds, n / 2]: the circle method's pairing of n (even) indices, every pair once per sweep."""
    rounds = []
    others = list(range(1, n))
    for _ in range(n - 1):
        order = [0, *others]
        rounds.append([(order[k], order[n - 1 - k]) for k in range(n // 2)])
        others = others[-1:] + others[:-1]
    pairs = np.array(rounds, dtype=np.int64)  # [rounds, n / 2, 2]
    return pairs[..., 0], pairs[..., 1]


def _pad_even(a: M, n: int, square: bool) -> tuple[ir.Value, int]:
    """a with a zero column (and row, when ``square``) added when n is odd: a pad the rotations leave alone."""
    if n % 2 == 0:
        return a.v, n
    pads = [0] * (2 * a.rank)
    pads[a.rank + a.rank - 1] = 1
    if square:
        pads[a.rank + a.rank - 2] = 1
    return op.Pad(a.v, _ints(pads)), n + 1


def _jacobi_sweeps(n: int, carried: list, rotate):
    """Runs ``rotate(p, q, *carried)`` for every round of _SWEEPS parallel Jacobi sweeps, as one Loop.

    Each round rotates n / 2 disjoint pairs (p, q) at once (Brent and Luk's ordering), so the body's
    size does not grow with n; the round's pairs come from a table indexed by the iteration number.
    """
    p_table, q_table = _round_robin(n)
    rounds = p_table.shape[0]
    p_all, q_all = op.Constant(value=ir.tensor(p_table)), op.Constant(value=ir.tensor(q_table))

    def body(i, *values):
        r = op.Mod(i, op.Constant(value_int=rounds))
        return rotate(op.Gather(p_all, r, axis=0), op.Gather(q_all, r, axis=0), r, *values)

    for value in carried:
        value.dtype = value.dtype or _DOUBLE
    return loop(_SWEEPS * rounds, carried, body, iteration=True)


def _eigh(a: M, lower: bool):
    n = a.rows
    triangle = _triangle(a, lower)
    s = triangle.like(op.Add(triangle.v, _triangle(a, lower, -1 if lower else 1).T.v))
    if n == 0:
        return op.Expand(float64_constant(np.zeros((0,))), op.Concat(op.Shape(a.v, end=-2), _ints([0]), axis=0)), a
    if n == 1:
        return s.diagonal(), a.like(op.Expand(float64_constant(np.eye(1)), op.Shape(a.v)))
    s_value, ne = _pad_even(s, n, square=True)
    v_value = op.Expand(float64_constant(np.eye(ne)), op.Shape(s_value))
    p_table, q_table = _round_robin(ne)
    ep = op.Constant(value=ir.tensor(np.eye(ne)[p_table]))  # [rounds, n / 2, n]: one-hot rows of p
    eq = op.Constant(value=ir.tensor(np.eye(ne)[q_table]))

    def rotate(p, q, r, s_value, v_value):
        # The rotation of each pair, all at once: J = P^T c P + Q^T c Q + P^T s Q - Q^T s P.
        diagonal = op.ReduceSum(op.Mul(s_value, float64_constant(np.eye(ne))), _ints([-1]), keepdims=0)  # [..., n]
        app, aqq = op.Gather(diagonal, p, axis=-1), op.Gather(diagonal, q, axis=-1)
        rows = op.Gather(s_value, p, axis=-2)  # [..., n / 2, n]
        apq = op.Squeeze(op.GatherElements(rows, op.Expand(_last(q), op.Concat(op.Shape(rows, end=-1), _ints([1]), axis=0)), axis=-1), _ints([-1]))
        zero = op.Equal(apq, float64_constant(0.0))
        theta = op.Div(op.Sub(aqq, app), op.Mul(float64_constant(2.0), op.Where(zero, float64_constant(1.0), apq)))
        c, sn = _jacobi_angle(theta, zero)  # [..., n / 2]
        pm, qm = op.Gather(ep, r, axis=0), op.Gather(eq, r, axis=0)  # [n / 2, n]
        pt, qt = op.Transpose(pm, perm=[1, 0]), op.Transpose(qm, perm=[1, 0])
        scale = lambda m, k: op.Mul(m, op.Unsqueeze(k, _ints([-2])))  # m [n, n/2] times k per column
        j = op.Add(op.Add(op.MatMul(scale(pt, c), pm), op.MatMul(scale(qt, c), qm)),
                   op.Sub(op.MatMul(scale(pt, sn), qm), op.MatMul(scale(qt, sn), pm)))
        perm = list(range(a.rank - 2)) + [a.rank - 1, a.rank - 2]
        s_value = op.MatMul(op.MatMul(op.Transpose(j, perm=perm), s_value), j)
        return [s_value, op.MatMul(v_value, j)]

    s_value, v_value = _jacobi_sweeps(ne, [s_value, v_value], rotate)
    values = M(s_value, a.rank, ne, ne).diagonal()
    vectors = M(v_value, a.rank, ne, ne)
    if ne != n:  # drop the pad: no rotation touched it, so it is still last
        values = op.Slice(values, _ints([0]), _ints([n]), _ints([-1]))
        vectors = M(op.Slice(op.Slice(vectors.v, _ints([0]), _ints([n]), _ints([-1])), _ints([0]), _ints([n]), _ints([-2])),
                    a.rank, n, n)
    return _sorted_columns(values, vectors, descending=False)


@project_rule(aten._linalg_eigh.default)
def aten__linalg_eigh(A, UPLO: str = "L", compute_v: bool = True):
    """_linalg_eigh(Tensor A, str UPLO="L", bool compute_v=True) -> (Tensor eigenvalues, Tensor eigenvectors)"""
    values, vectors = _eigh(M.of(A), UPLO.upper() == "L")
    if not compute_v:
        return op.CastLike(values, A), op.CastLike(op.ConstantOfShape(_ints([0])), A)
    return op.CastLike(values, A), vectors.out(A)


def _svd_tall(a: M):
    """One-sided Jacobi for rows >= cols: (U [..., m, n], S [..., n], V [..., n, n]), S descending."""
    n = a.cols
    if n <= 1:
        w_value, ne = a.v, n
        v_value = op.Expand(float64_constant(np.eye(n)), op.Concat(op.Shape(a.v, end=-2), _ints([n, n]), axis=0))
    else:
        w_value, ne = _pad_even(a, n, square=False)
        v_value = op.Expand(float64_constant(np.eye(ne)), op.Concat(op.Shape(a.v, end=-2), _ints([ne, ne]), axis=0))
        p_table, q_table = _round_robin(ne)
        # Where column j lands in concat(rotated p columns, rotated q columns), per round.
        inverse = np.argsort(np.concatenate([p_table, q_table], axis=1), axis=1).astype(np.int64)
        inverse_all = op.Constant(value=ir.tensor(inverse))

        def rotate(p, q, r, w_value, v_value):
            wp, wq = op.Gather(w_value, p, axis=-1), op.Gather(w_value, q, axis=-1)  # [..., m, n / 2]
            rows = _ints([-2])
            alpha = op.ReduceSum(op.Mul(wp, wp), rows, keepdims=1)
            beta = op.ReduceSum(op.Mul(wq, wq), rows, keepdims=1)
            gamma = op.ReduceSum(op.Mul(wp, wq), rows, keepdims=1)
            zero = op.Equal(gamma, float64_constant(0.0))
            zeta = op.Div(op.Sub(beta, alpha), op.Mul(float64_constant(2.0), op.Where(zero, float64_constant(1.0), gamma)))
            c, s = _jacobi_angle(zeta, zero)  # [..., 1, n / 2]
            back = op.Gather(inverse_all, r, axis=0)

            def turned(x):
                xp, xq = op.Gather(x, p, axis=-1), op.Gather(x, q, axis=-1)
                pair = op.Concat(op.Sub(op.Mul(c, xp), op.Mul(s, xq)), op.Add(op.Mul(s, xp), op.Mul(c, xq)), axis=-1)
                return op.Gather(pair, back, axis=-1)

            return [turned(w_value), turned(v_value)]

        w_value, v_value = _jacobi_sweeps(ne, [w_value, v_value], rotate)
        if ne != n:  # drop the pad column (and V's pad row and column): no rotation touched it
            w_value = op.Slice(w_value, _ints([0]), _ints([n]), _ints([-1]))
            v_value = op.Slice(op.Slice(v_value, _ints([0]), _ints([n]), _ints([-1])), _ints([0]), _ints([n]), _ints([-2]))
    w, v = a.like(w_value), a.like(v_value, n, n)
    norms = op.Sqrt(op.ReduceSum(op.Mul(w.v, w.v), _ints([-2]), keepdims=0))  # [..., n]
    safe = op.Where(op.Equal(norms, float64_constant(0.0)), float64_constant(1.0), norms)
    u = w.like(op.Mul(op.Div(w.v, op.Unsqueeze(safe, _ints([-2]))), op.Unsqueeze(op.Cast(op.Greater(norms, float64_constant(0.0)), to=_DOUBLE), _ints([-2]))))
    s_sorted, u = _sorted_columns(norms, u, descending=True)
    _, v = _sorted_columns(norms, v, descending=True)
    return _orthonormal_completion(u, op.Equal(s_sorted, float64_constant(0.0))), s_sorted, v


def _orthonormal_completion(u: M, missing):
    """u [..., m, n] (m >= n), whose columns flagged in ``missing`` [..., n] are zero and whose others are
    orthonormal, with each missing column replaced by a unit vector orthogonal to all the others.

    A singular value of exactly 0 leaves its column of A V at zero, where LAPACK's U still has orthonormal
    columns (a basis of the null space's complement): a zero matrix, a zero column. In column order, each
    missing column takes the standard basis vector e_i least covered by the columns so far (the smallest
    squared norm of row i, the first on ties) less its projection on them, twice (classical Gram-Schmidt
    with reorthogonalization), normalized. The zero matrix gets the identity's columns, as from LAPACK.
    Runs only where some column is missing (an If), n steps of O(m n) each (a Loop)."""
    m, n = u.rows, u.cols
    if m == 0 or n == 0:
        return u
    columns = op.Constant(value=ir.tensor(np.arange(n, dtype=np.int64)))
    identity = float64_constant(np.eye(m))

    def step(j, u_value):
        covered = op.ReduceSum(op.Mul(u_value, u_value), _ints([-1]), keepdims=0)  # [..., m]
        e = op.Gather(identity, op.ArgMin(covered, axis=-1, keepdims=0), axis=0)  # [..., m]
        col = _last(e)  # [..., m, 1]
        ut = op.Transpose(u_value, perm=list(range(u.rank - 2)) + [u.rank - 1, u.rank - 2])
        for _ in range(2):
            col = op.Sub(col, op.MatMul(u_value, op.MatMul(ut, col)))
        norm = op.Sqrt(op.ReduceSum(op.Mul(col, col), _ints([-2]), keepdims=1))  # [..., 1, 1]
        col = op.Div(col, op.Where(op.Equal(norm, float64_constant(0.0)), float64_constant(1.0), norm))
        here = op.And(_last(op.Gather(missing, j, axis=-1)), op.Equal(columns, j))  # [..., n]
        return [op.Where(op.Unsqueeze(here, _ints([-2])), col, u_value)]

    def complete():
        u_value = op.Identity(u.v)
        u_value.dtype = _DOUBLE
        return loop(n, [u_value], step, iteration=True)

    def keep():
        u_value = op.Identity(u.v)
        u_value.dtype = _DOUBLE
        return [u_value]

    any_missing = op.Cast(op.ReduceMax(op.Cast(missing, to=truth_dtype()), keepdims=0), to=ir.DataType.BOOL)
    return u.like(cond(any_missing, complete, keep)[0])


def _svd(a: M):
    """(U, S, V) with A = U diag(S) V^T, reduced."""
    if a.rows >= a.cols:
        return _svd_tall(a)
    u, s, v = _svd_tall(a.T)
    return v, s, u


@project_rule(aten._linalg_svd.default)
def aten__linalg_svd(A, full_matrices: bool = False, compute_uv: bool = True, driver: str | None = None):
    """_linalg_svd(Tensor A, bool full_matrices=False, bool compute_uv=True, *, str? driver=None) -> (Tensor U, Tensor S, Tensor Vh)"""
    a = M.of(A)
    if min(a.rows, a.cols) == 0:
        batch = op.Shape(A, end=-2)
        k = 0
        u_cols, v_rows = (a.rows, a.cols) if full_matrices else (k, k)
        u = op.Expand(float64_constant(np.eye(a.rows, u_cols)), op.Concat(batch, _ints([a.rows, u_cols]), axis=0))
        vh = op.Expand(float64_constant(np.eye(v_rows, a.cols)), op.Concat(batch, _ints([v_rows, a.cols]), axis=0))
        s = op.Expand(float64_constant(np.zeros((0,))), op.Concat(batch, _ints([0]), axis=0))
        return op.CastLike(u, A), op.CastLike(s, A), op.CastLike(vh, A)
    u, s, v = _svd(a)
    if not compute_uv:
        empty = op.CastLike(op.ConstantOfShape(_ints([0])), A)
        return empty, op.CastLike(s, A), op.Identity(empty)
    if full_matrices:
        u, v = _square_basis(u), _square_basis(v)
    return u.out(A), op.CastLike(s, A), v.T.out(A)


def _square_basis(q: M) -> M:
    """q [..., m, k] with orthonormal columns, k <= m, completed to an orthonormal basis [..., m, m]: the
    columns full_matrices=True adds to the non-square side of an SVD. They span the orthogonal complement of
    q's, and which basis of it is as arbitrary as the singular vectors' signs (LAPACK's own is not specified);
    here the standard basis vectors least covered by q, orthogonalized (``_orthonormal_completion``)."""
    m, k = q.rows, q.cols
    if m == k:
        return q
    zeros = op.Expand(float64_constant(0.0), op.Concat(op.Shape(q.v, end=-2), _ints([m, m - k]), axis=0))
    padded = q.like(op.Concat(q.v, zeros, axis=-1), m, m)
    return _orthonormal_completion(padded, op.Constant(value=ir.tensor(np.arange(m) >= k)))


@project_rule(aten.linalg_pinv.atol_rtol_tensor)
def aten_linalg_pinv_atol_rtol_tensor(self, atol=None, rtol=None, hermitian: bool = False):
    """linalg_pinv.atol_rtol_tensor(Tensor self, *, Tensor? atol=None, Tensor? rtol=None, bool hermitian=False) -> Tensor"""
    # The pseudo-inverse is unique, so the SVD serves the hermitian case too (there |eigenvalues| are the
    # singular values). Singular values at or below max(atol, rtol * largest) count as zero.
    a = M.of(self)
    if hermitian:  # ATen reads the lower triangle only (eigh with UPLO="L")
        a = a.like(op.Add(_triangle(a, True).v, _triangle(a, True, -1).T.v))
    if min(a.rows, a.cols) == 0:
        return op.CastLike(op.ConstantOfShape(op.Concat(op.Shape(self, end=-2), _ints([a.cols, a.rows]), axis=0)), self)
    u, s, v = _svd(a)
    largest = op.ReduceMax(s, _ints([-1]), keepdims=1)
    atol_value = float64_constant(0.0) if atol is None else _last(op.Cast(atol, to=_DOUBLE))
    if rtol is None:
        eps = float(np.finfo(self.dtype.numpy()).eps) * max(a.rows, a.cols)
        rtol_value = float64_constant(eps) if atol is None else op.Where(op.Greater(atol_value, float64_constant(0.0)), float64_constant(0.0), float64_constant(eps))
    else:
        rtol_value = _last(op.Cast(rtol, to=_DOUBLE))
    threshold = op.Max(atol_value, op.Mul(rtol_value, largest))
    kept = op.Greater(s, threshold)
    inverse = op.Where(kept, op.Div(float64_constant(1.0), op.Where(kept, s, float64_constant(1.0))), float64_constant(0.0))
    scaled = v.like(op.Mul(v.v, op.Unsqueeze(inverse, _ints([-2]))))
    return (scaled @ u.T).out(self)


# --- matrix exponential ---------------------------------------------------------------------------------

_TAYLOR_DEGREE = 18
_MAX_SQUARINGS = 48


@project_rule(aten.linalg_matrix_exp.default)
def aten_linalg_matrix_exp(self):
    """linalg_matrix_exp(Tensor self) -> Tensor"""
    # Scaling and squaring: exp(A) = exp(A / 2**s) ** (2**s), with s = ceil(log2 |A|_1) per matrix so that
    # the Taylor series (degree 18) of the scaled matrix is exact in double precision.
    a = M.of(self)
    n = a.rows
    norm = op.ReduceMax(op.ReduceSum(op.Abs(a.v), _ints([-2]), keepdims=0), _ints([-1]), keepdims=0)
    s = op.Max(op.Ceil(op.Div(op.Log(op.Max(norm, float64_constant(1e-300))), float64_constant(np.log(2.0)))), float64_constant(0.0))
    s = op.Min(s, float64_constant(float(_MAX_SQUARINGS)))
    x = a.like(op.Div(a.v, op.Unsqueeze(op.Pow(float64_constant(2.0), s), _ints([-1, -2]))))
    eye = float64_constant(np.eye(n))
    result, term = a.like(op.Add(eye, op.Mul(x.v, float64_constant(0.0)))), a.like(op.Add(eye, op.Mul(x.v, float64_constant(0.0))))
    for k in range(1, _TAYLOR_DEGREE + 1):
        term = term.like(op.Div((term @ x).v, float64_constant(float(k))))
        result = result.like(op.Add(result.v, term.v))
    steps = op.Unsqueeze(s, _ints([-1, -2]))
    for i in range(_MAX_SQUARINGS):
        squared = result @ result
        result = result.like(op.Where(op.Less(float64_constant(float(i)), steps), squared.v, result.v))
    return result.out(self)


# --- QR (Householder, as LAPACK's geqrf) ----------------------------------------------------------------


def _geqrf(a: M):
    """LAPACK's geqrf: R on and above the diagonal, Householder vectors below it, and tau."""
    m, n = a.rows, a.cols
    value, taus = a.v, []
    for k in range(min(m, n)):
        column = op.Gather(value, op.Constant(value_int=k), axis=-1)  # [..., m]
        alpha = op.Gather(column, op.Constant(value_int=k), axis=-1)
        below = op.Mul(column, float64_constant((np.arange(m) > k).astype(np.float64)))
        xnorm = op.Sqrt(op.ReduceSum(op.Mul(below, below), _ints([-1]), keepdims=0))
        trivial = op.Equal(xnorm, float64_constant(0.0))
        # dlarfg: beta = -sign(alpha) * hypot(alpha, xnorm), tau = (beta - alpha) / beta, v = x / (alpha - beta).
        norm = op.Sqrt(op.Add(op.Mul(alpha, alpha), op.Mul(xnorm, xnorm)))
        beta = op.Where(op.Less(alpha, float64_constant(0.0)), norm, op.Neg(norm))
        beta = op.Where(trivial, alpha, beta)
        tau = op.Where(trivial, float64_constant(0.0), op.Div(op.Sub(beta, alpha), op.Where(trivial, float64_constant(1.0), beta)))
        scale = op.Where(trivial, float64_constant(0.0), op.Div(float64_constant(1.0), op.Where(trivial, float64_constant(1.0), op.Sub(alpha, beta))))
        v_below = op.Mul(below, _last(scale))
        v = op.Add(v_below, float64_constant((np.arange(m) == k).astype(np.float64)))  # [..., m], v[k] = 1
        # H = I - tau v v^T applied to the columns right of k.
        w = op.ReduceSum(op.Mul(_last(v), value), _ints([-2]), keepdims=0)  # [..., n]
        w = op.Mul(w, float64_constant((np.arange(n) > k).astype(np.float64)))
        value = op.Sub(value, op.Mul(op.Unsqueeze(op.Mul(v, _last(tau)), _ints([-1])), op.Unsqueeze(w, _ints([-2]))))
        # Column k becomes beta on the diagonal and v below it.
        new_column = op.Add(v_below, op.Mul(_last(beta), float64_constant((np.arange(m) == k).astype(np.float64))))
        keep_above = float64_constant((np.arange(m) < k).astype(np.float64))
        new_column = op.Add(new_column, op.Mul(column, keep_above))
        value = op.Where(_mask(np.arange(n) == k), _last(new_column), value)
        taus.append(_last(tau))
    tau_value = op.Concat(*taus, axis=-1) if taus else op.Expand(float64_constant(np.zeros((0,))), op.Concat(op.Shape(a.v, end=-2), _ints([0]), axis=0))
    return a.like(value), tau_value


def _reflector(packed: M, i: int):
    """The Householder vector v_i (v_i[i] = 1, zeros above) from column i of a packed factorization."""
    m = packed.rows
    column = packed.col(i)
    return op.Add(op.Mul(column, float64_constant((np.arange(m) > i).astype(np.float64))), float64_constant((np.arange(m) == i).astype(np.float64)))


def _apply_reflector(c: M, v, tau, from_left: bool) -> M:
    """(I - tau v v^T) c, or c (I - tau v v^T)."""
    tau = op.Unsqueeze(tau, _ints([-1, -2]))
    if from_left:
        w = op.ReduceSum(op.Mul(_last(v), c.v), _ints([-2]), keepdims=1)  # v^T c: [..., 1, k]
        return c.like(op.Sub(c.v, op.Mul(tau, op.Mul(_last(v), w))))
    w = op.ReduceSum(op.Mul(op.Unsqueeze(v, _ints([-2])), c.v), _ints([-1]), keepdims=1)  # c v: [..., r, 1]
    return c.like(op.Sub(c.v, op.Mul(tau, op.Mul(w, op.Unsqueeze(v, _ints([-2]))))))


def _tau_at(tau, i: int):
    return op.Gather(tau, op.Constant(value_int=i), axis=-1)


def _householder_product(packed: M, tau, count: int, columns: int) -> M:
    """H_1 ... H_count applied to the first ``columns`` columns of the identity (LAPACK's orgqr)."""
    m = packed.rows
    batch = op.Shape(packed.v, end=-2)
    q = M(op.Expand(float64_constant(np.eye(m, columns)), op.Concat(batch, _ints([m, columns]), axis=0)), packed.rank, m, columns)
    for i in range(count - 1, -1, -1):
        q = _apply_reflector(q, _reflector(packed, i), _tau_at(tau, i), from_left=True)
    return q


def _static_count(tau) -> int:
    count = tau.shape[-1] if tau.shape is not None else None
    if not isinstance(count, int):
        raise NotImplementedError("aot2onnx needs a static number of Householder reflectors")
    return count


@project_rule(aten.geqrf.default)
def aten_geqrf(self):
    """geqrf(Tensor self) -> (Tensor a, Tensor tau)"""
    packed, tau = _geqrf(M.of(self))
    return packed.out(self), op.CastLike(tau, self)


@project_rule(aten.linalg_householder_product.default)
def aten_linalg_householder_product(input, tau):
    """linalg_householder_product(Tensor input, Tensor tau) -> Tensor"""
    packed = M.of(input)
    return _householder_product(packed, op.Cast(tau, to=_DOUBLE), _static_count(tau), packed.cols).out(input)


@project_rule(aten.ormqr.default)
def aten_ormqr(self, input2, input3, left: bool = True, transpose: bool = False):
    """ormqr(Tensor self, Tensor input2, Tensor input3, bool left=True, bool transpose=False) -> Tensor"""
    packed, tau, c = M.of(self), op.Cast(input2, to=_DOUBLE), M.of(input3)
    count = _static_count(input2)
    # Q = H_1 ... H_k. Q C applies H_k first; Q^T C applies H_1 first; C Q applies H_1 first.
    order = list(range(count))
    if left != transpose:
        order.reverse()
    for i in order:
        c = _apply_reflector(c, _reflector(packed, i), _tau_at(tau, i), from_left=left)
    return c.out(input3)


@project_rule(aten.linalg_qr.default)
def aten_linalg_qr(A, mode: str = "reduced"):
    """linalg_qr(Tensor A, str mode="reduced") -> (Tensor Q, Tensor R)"""
    a = M.of(A)
    m, n = a.rows, a.cols
    k = min(m, n)
    packed, tau = _geqrf(a)
    rows = m if mode == "complete" else k
    r = op.Mul(op.Slice(packed.v, _ints([0]), _ints([rows]), _ints([-2])), float64_constant(np.triu(np.ones((rows, n)))))
    if mode == "r":
        return op.CastLike(op.ConstantOfShape(_ints([0])), A), op.CastLike(r, A)
    q = _householder_product(packed, tau, k, m if mode == "complete" else k)
    return q.out(A), op.CastLike(r, A)


_HALVES = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


@project_rule(aten.linalg_cross.default)
def aten_linalg_cross(self, other, dim: int = -1):
    """linalg_cross(Tensor self, Tensor other, *, int dim=-1) -> Tensor

    Component i is ``a[i+1] * b[i+2] - a[i+2] * b[i+1]`` (indices mod 3), rounded as ATen's CPU kernel rounds
    it: float32 as one fused multiply-add of the first product and the rounded second (ATen's kernels are
    built with FMA contraction), here exact in double; 16-bit floats round each product and the difference
    (c10's Half and BFloat16 arithmetic); float64 and integers round each step. torch_lib's rule (one
    rounding for all of it) was an ulp off eager in 3 of 4 float32 components, and several bfloat16 ulps off
    where the products nearly cancel. Matched torch.linalg.cross bit for bit on 100,000 random vectors in
    float32, float64 and float16 and 1,000 in bfloat16."""
    a, b = op.Split(self, axis=dim, num_outputs=3), op.Split(other, axis=dim, num_outputs=3)
    dtype = self.dtype

    def component(i: int):
        p, q = (a[(i + 1) % 3], b[(i + 2) % 3]), (a[(i + 2) % 3], b[(i + 1) % 3])
        if dtype == ir.DataType.FLOAT:
            double = ir.DataType.DOUBLE
            exact = op.Mul(op.Cast(p[0], to=double), op.Cast(p[1], to=double))  # 48 bits: exact in double
            return op.Cast(op.Sub(exact, op.Cast(op.Mul(*q), to=double)), to=dtype)
        if dtype in _HALVES:
            f = [[op.Cast(v, to=ir.DataType.FLOAT) for v in pair] for pair in (p, q)]
            return op.Cast(op.Sub(rounded_to(op.Mul(*f[0]), dtype), rounded_to(op.Mul(*f[1]), dtype)), to=dtype)
        return op.Sub(op.Mul(*p), op.Mul(*q))

    return op.Concat(*(component(i) for i in range(3)), axis=dim)
