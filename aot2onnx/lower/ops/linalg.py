"""Linear algebra: factorizations and solves, written out in ONNX ops for matrices of static size.

ONNX has no decompositions (only Det), so each rule spells out the algorithm LAPACK runs for ATen, with
the same conventions, so that factors ATen returns (LU and its pivots, geqrf's Householder vectors and
tau, Cholesky factors) come out the same and not merely equivalent:

- LU: partial pivoting on the largest magnitude (the first one on ties), as LAPACK's getrf.
- QR: LAPACK's Householder reflectors (dlarfg: beta = -sign(alpha) * norm).
- Cholesky: reads the lower triangle (the upper one for ``upper=True``), as potrf.
- Symmetric eigendecomposition and SVD: cyclic Jacobi rotations, a fixed number of sweeps (quadratic
  convergence makes 10 sweeps exact in double precision for the sizes these graphs see). Singular values
  and eigenvalues are unique; singular and eigenvectors are unique only up to sign, which LAPACK fixes in
  its own way, so a rule that returns vectors matches ATen only up to those signs (products such as the
  pseudo-inverse do not depend on them).

The loops over rows and columns are unrolled at lowering time, so the matrix dimensions (the last two)
must be static; batch dimensions may be anything. Everything is computed in float64 and cast back.
Checks that make ATen raise on singular input (``_linalg_check_errors``) are not kept: the ``info``
outputs report the failure, as they do in ATen with ``check_errors=False``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op

from aot2onnx.lower.registry import project_rule

aten = torch.ops.aten

_DOUBLE = ir.DataType.DOUBLE
_SWEEPS = 10


def _const(value) -> ir.Value:
    return op.Constant(value=ir.tensor(np.asarray(value, dtype=np.float64)))


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
        return op.ReduceSum(op.Mul(self.v, _const(np.eye(self.rows, self.cols))), _ints([axis]), keepdims=0)

    def out(self, like):
        return op.CastLike(self.v, like)


def _stack(vectors: list, axis: int):
    """Stacks [..., k] vectors along a new ``axis`` (-1: as columns, -2: as rows)."""
    return op.Concat(*[op.Unsqueeze(v, _ints([axis])) for v in vectors], axis=axis)


def _last(x):
    return op.Unsqueeze(x, _ints([-1]))


def _eye(n: int, like: M) -> M:
    return M(_const(np.eye(n)), 2, n, n)


def _triangle(a: M, lower: bool, diagonal: int = 0) -> M:
    mask = np.tril(np.ones((a.rows, a.cols)), diagonal) if lower else np.triu(np.ones((a.rows, a.cols)), diagonal)
    return a.like(op.Mul(a.v, _const(mask)))


# --- triangular solves ---------------------------------------------------------------------------------


def _solve_lower(t: M, b: M, unit: bool) -> M:
    """X with t X = b for lower-triangular t, by forward substitution (rows of X built one by one)."""
    if t.rows == 0:
        return b
    rows = []
    for i in range(t.rows):
        acc = b.row(i)  # [..., k]
        for j in range(i):
            acc = op.Sub(acc, op.Mul(_last(t.entry(i, j)), rows[j]))
        rows.append(acc if unit else op.Div(acc, _last(t.entry(i, i))))
    return M(_stack(rows, -2), max(t.rank, b.rank), t.rows, b.cols)


def _solve_upper(t: M, b: M, unit: bool) -> M:
    """X with t X = b for upper-triangular t, by back substitution."""
    n = t.rows
    if n == 0:
        return b
    rows: list = [None] * n
    for i in range(n - 1, -1, -1):
        acc = b.row(i)
        for j in range(i + 1, n):
            acc = op.Sub(acc, op.Mul(_last(t.entry(i, j)), rows[j]))
        rows[i] = acc if unit else op.Div(acc, _last(t.entry(i, i)))
    return M(_stack(rows, -2), max(t.rank, b.rank), n, b.cols)


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
    rows_at_or_below = [_const((np.arange(n) >= j).astype(np.float64)) for j in range(n)]
    columns, info = [], None
    for j in range(n):
        s = a.col(j)
        for k in range(j):
            s = op.Sub(s, op.Mul(columns[k], _last(op.Gather(columns[k], op.Constant(value_int=j), axis=-1))))
        pivot = op.Gather(s, op.Constant(value_int=j), axis=-1)
        failed = op.Not(op.Greater(pivot, _const(0.0)))  # also NaN
        step = op.Where(failed, op.Constant(value=ir.tensor(np.int32(j + 1))), op.Constant(value=ir.tensor(np.int32(0))))
        info = step if info is None else op.Where(op.Equal(info, op.Constant(value=ir.tensor(np.int32(0)))), step, info)
        columns.append(op.Mul(op.Div(s, _last(op.Sqrt(pivot))), rows_at_or_below[j]))
    if n == 0:
        return a, op.Constant(value=ir.tensor(np.int32(0)))
    return a.like(_stack(columns, -1)), info


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
    return _cholesky_solve(_eye(factor.rows, factor), factor, upper).out(self)


# --- LU ---------------------------------------------------------------------------------------------------


def _getrf(a: M):
    """LAPACK's getrf: (LU, pivots as 1-based int32 row swaps, info, the row permutation as int64)."""
    m, n = a.rows, a.cols
    positions = op.Constant(value=ir.tensor(np.arange(m, dtype=np.int64)))
    perm = op.Expand(positions, op.Concat(op.Shape(a.v, end=-2), _ints([m]), axis=0))
    lu, pivots, info = a.v, [], None
    zero32 = op.Constant(value=ir.tensor(np.int32(0)))
    for k in range(min(m, n)):
        column = op.Gather(lu, op.Constant(value_int=k), axis=-1)  # [..., m]
        candidates = op.Where(_mask(np.arange(m) >= k), op.Abs(column), _const(-1.0))
        p = op.ArgMax(candidates, axis=-1, keepdims=1)  # [..., 1], the first largest
        # Swap rows k and p.
        swap = op.Where(op.Equal(positions, op.Constant(value_int=k)), p,
                        op.Where(op.Equal(positions, p), op.Constant(value_int=k), positions))  # [..., m]
        lu = op.GatherElements(lu, op.Expand(_last(swap), op.Shape(lu)), axis=-2)
        perm = op.GatherElements(perm, swap, axis=-1)
        pivots.append(op.Cast(op.Add(p, op.Constant(value_int=1)), to=ir.DataType.INT32))
        pivot = op.Gather(op.Gather(lu, op.Constant(value_int=k), axis=-2), op.Constant(value_int=k), axis=-1)
        singular = op.Equal(pivot, _const(0.0))
        step = op.Where(singular, op.Constant(value=ir.tensor(np.int32(k + 1))), zero32)
        info = step if info is None else op.Where(op.Equal(info, zero32), step, info)
        # Multipliers below the pivot (left unscaled when the pivot is zero, as LAPACK does), then the
        # rank-one update of the trailing block.
        column = op.Gather(lu, op.Constant(value_int=k), axis=-1)
        below = _const((np.arange(m) > k).astype(np.float64))
        multipliers = op.Mul(op.Where(_last(singular), column, op.Div(column, _last(pivot))), below)  # [..., m]
        urow = op.Gather(lu, op.Constant(value_int=k), axis=-2)  # [..., n]
        right = _const((np.arange(n) > k).astype(np.float64))
        update = op.Mul(op.Unsqueeze(multipliers, _ints([-1])), op.Unsqueeze(op.Mul(urow, right), _ints([-2])))
        lu = op.Sub(lu, update)
        column_k = _mask((np.arange(m)[:, None] > k) & (np.arange(n)[None, :] == k))
        lu = op.Where(column_k, op.Unsqueeze(multipliers, _ints([-1])), lu)
    batch = op.Shape(a.v, end=-2)
    if pivots:
        pivots_value = op.Concat(*pivots, axis=-1)
    else:
        pivots_value = op.Expand(op.Constant(value=ir.tensor(np.zeros((0,), dtype=np.int32))), op.Concat(batch, _ints([0]), axis=0))
    if info is None:
        info = op.Expand(zero32, batch)
    else:
        info = op.Expand(info, batch)
    return a.like(lu), pivots_value, info, perm


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
    l_value = op.Add(op.Mul(op.Slice(lu.v, _ints([0]), _ints([k]), _ints([-1])), _const(lower)), _const(unit))
    u_value = op.Mul(op.Slice(lu.v, _ints([0]), _ints([k]), _ints([-2])), _const(np.triu(np.ones((k, n)))))
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
    return z.like(op.ScatterElements(op.Mul(z.v, _const(0.0)), index, z.v, axis=-2))


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
    return _lu_solve(lu, perm, _eye(a.rows, a), True, False).out(A), info


def _swap_parity(pivots, k: int):
    """(-1) ** (number of actual row swaps) as float64, from 1-based pivots."""
    if k == 0:
        return _const(1.0)
    steps = op.Constant(value=ir.tensor(np.arange(1, k + 1, dtype=np.int32)))
    swaps = op.ReduceSum(op.Cast(op.Not(op.Equal(pivots, steps)), to=ir.DataType.INT64), _ints([-1]), keepdims=0)
    odd = op.Cast(op.Mod(swaps, op.Constant(value_int=2)), to=_DOUBLE)
    return op.Sub(_const(1.0), op.Mul(_const(2.0), odd))


@project_rule(aten._linalg_det.default)
def aten__linalg_det(A):
    """_linalg_det(Tensor A) -> (Tensor result, Tensor LU, Tensor pivots)"""
    a = M.of(A)
    lu, pivots, _, _ = _getrf(a)
    if a.rows == 0:
        det = op.Expand(_const(1.0), op.Shape(A, end=-2))
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
        sign, logabsdet = op.Expand(_const(1.0), batch), op.Expand(_const(0.0), batch)
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
    # The check raises in ATen when a factorization failed; here the info outputs carry that instead.
    # The new token is a fresh empty tensor: AOTAutograd passes no tensor for the token at run time, so
    # the graph must not read its token input.
    return (op.ConstantOfShape(_ints([0]), value=ir.tensor(np.zeros(1, dtype=token.dtype.numpy()))),)
