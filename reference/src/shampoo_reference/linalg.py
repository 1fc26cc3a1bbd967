"""Float64 linear algebra of Shampoo: contractions, mode products, inverse roots.

Eq. numbers refer to docs/spec.md. Everything here is exact up to float64
rounding except :func:`root_inverse_coupled_newton`, which is iterative by
design (it is the method being specified, with its stopping rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from numpy.typing import NDArray

from shampoo_spec import (
    CoupledNewtonConfig,
    EpsilonConfig,
    HigherOrderNewtonConfig,
    SpectralDescentConfig,
    power_iteration_start,
)

from .lobpcg import lobpcg_top_k, pth_root_difference

Array = NDArray[np.float64]


def factor_contraction(block: Array, k: int) -> Array:
    """``G_(k) G_(k)^T``: contract G with itself over every dim but k (eq. 6)."""
    moved = np.moveaxis(block, k, 0).reshape(block.shape[k], -1)
    return moved @ moved.T


def mode_product(tensor: Array, matrix: Array, k: int) -> Array:
    """``T x_k M``: multiply dim k of T by the symmetric matrix M (eq. 16)."""
    moved = np.moveaxis(tensor, k, 0)
    out = np.tensordot(matrix, moved, axes=([1], [0]))
    return np.moveaxis(out, 0, k)


def round_to(x: Array, dtype: str) -> Array:
    """``round_s(x)`` of eq. (11a): each entry rounded to ``dtype``, returned in float64.

    Round to nearest, ties to even, exactly as the backends' casts (and so
    Meta's ``.to(dtype)``) round a float64: ``"float64"`` leaves x alone;
    ``"float32"`` is NumPy's correctly rounded cast; ``"float16"`` and
    ``"bfloat16"`` round the float32 value again (torch, JAX/XLA and
    ml_dtypes all convert float64 to them through float32, so a float64
    within 2^-24 relative of a tie rounds as that tie: two roundings, not
    one). float16 overflows to inf above 65504 and keeps its subnormals;
    bfloat16 (:func:`round_to_bfloat16`) has float32's range. NaN stays NaN.
    """
    if dtype == "float64":
        return np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):  # beyond the dtype's range: inf, as the casts give
        f32 = np.asarray(x, dtype=np.float64).astype(np.float32)
        if dtype == "float32":
            return f32.astype(np.float64)
        if dtype == "float16":
            return f32.astype(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        return round_to_bfloat16(f32).astype(np.float64)
    raise ValueError(
        f"dtype = {dtype!r} is invalid: allowed one of 'float64', 'float32', 'bfloat16', "
        "'float16' (shampoo_spec.INVERSE_ROOT_DTYPES)."
    )


def round_to_bfloat16(x: NDArray[np.float32]) -> NDArray[np.float32]:
    """float32 values rounded to bfloat16 (its 8 significant bits), still as float32.

    bfloat16 is the top half of a float32's bits, so rounding to nearest even
    is integer arithmetic on them: add ``0x7FFF`` plus the lowest kept bit
    (a tie then carries into the kept half exactly when that bit is odd) and
    clear the low 16 bits. A carry out of the largest finite bfloat16 gives
    inf, as it should; subnormals round the same way. NaN is kept as NaN
    (the carry could turn a NaN payload into inf). Written out rather than
    taken from ``ml_dtypes`` so the reference needs only NumPy and SciPy;
    reference/tests/test_rounding.py checks it against ml_dtypes where that
    is installed.
    """
    f32 = np.ascontiguousarray(x, dtype=np.float32)
    bits = f32.view(np.uint32)
    lowest_kept = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = (bits + np.uint32(0x7FFF) + lowest_kept) & np.uint32(0xFFFF0000)
    return np.where(np.isnan(f32), f32, rounded.view(np.float32))


def effective_epsilon(matrix: Array, eps: EpsilonConfig) -> float:
    """Eq. (9): eps, or eps * max(lambda_max(A), floor) when relative.

    lambda_max exact, or Google's power-iteration estimate (eq. 9b).
    """
    if eps.scale == "absolute":
        return float(eps.value)
    if eps.lambda_max == "power_iteration":
        lam_max = power_iteration_lambda_max(
            matrix, eps.power_iteration_steps, eps.power_iteration_tolerance
        )
    else:
        lam_max = float(np.linalg.eigvalsh(symmetrize(matrix))[-1])
    return float(eps.value) * max(lam_max, eps.relative_floor)


def power_iteration_lambda_max(matrix: Array, steps: int, tolerance: float) -> float:
    """Eq. (9b): Google's power iteration on A as it is (not symmetrized)."""
    v = np.asarray(power_iteration_start(matrix.shape[0]), dtype=np.float64).astype(matrix.dtype)
    s = 0.0
    for _ in range(steps):
        u = v / np.sqrt(np.sum(v * v))
        w = matrix @ u
        s_new = float(u @ w)
        moved = abs(s_new - s) > tolerance  # False for NaN: the loop stops, as Google's
        v, s = w, s_new
        if not moved:
            break
    return s


def symmetrize(matrix: Array) -> Array:
    return 0.5 * (matrix + matrix.T)


def regularized_eigenvalues(lam: Array, eps: float, placement: str) -> Array:
    """Eigenvalues after the epsilon rule of eq. (10).

    ``lam`` are the eigenvalues returned by eigh: of ``A + eps I`` for
    ``"ridge"`` and ``"ridge_floor"``, of ``A`` otherwise.
    """
    lam_min = float(lam.min())
    if placement == "pseudo_inverse":
        return lam  # no epsilon: the rank cutoff of inverse_root_eigenvalues instead
    if placement == "ridge":
        return lam + max(0.0, eps - lam_min)
    # "floor" and "ridge_floor" (whose lam are of A + eps I) both floor at eps.
    if placement == "shift_after":
        return lam - min(lam_min, 0.0) + eps
    return np.maximum(lam, eps)


def inverse_root_eigenvalues(lam: Array, root: float, rank: tuple[float, float] | None) -> Array:
    """``lambda'^(-1/root)`` of eq. (10); with ``rank = (rtol, atol)`` (``"pseudo_inverse"``)
    0 for every eigenvalue at or below ``max(rtol * max(lambda_max, 0), atol)``."""
    if rank is None:
        powered: Array = lam ** (-1.0 / root)
        return powered
    rtol, atol = rank
    cutoff = max(rtol * max(float(lam.max()), 0.0), atol)
    kept = lam > cutoff
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(kept, np.where(kept, lam, 1.0) ** (-1.0 / root), 0.0)


def low_rank_eigenvalues(x: Array, low_rank: tuple[int, str]) -> Array:
    """Eq. (10c): of the inverse-root eigenvalues ``x`` (ascending eigenvalues of B),
    keep the ``rank`` of the largest (``keep="largest"``) or smallest eigenvalues; each
    other one becomes their mean c."""
    rank, keep = low_rank
    n = x.shape[0]
    kept = np.arange(n) >= n - rank if keep == "largest" else np.arange(n) < rank
    c = float(np.mean(x[~kept]))
    return np.where(kept, x, c)


@dataclass(frozen=True)
class Sketch:
    """Eq. (10d): a sketched factor's U (n x r), lambda (r, descending) and tail rho."""

    u: Array
    lam: Array
    rho: float

    @classmethod
    def empty(cls, n: int, rank: int) -> Sketch:
        return cls(np.zeros((n, rank)), np.zeros(rank), 0.0)


def _folded_spectrum(u: Array, values: Array, c: Array, beta: float, rtol: float
                     ) -> tuple[Array, Array]:
    """The decomposition eqs. (10d) and (10e) share: ``M = beta U diag(values) U^T + C``,
    its eigenvalues sigma descending (with their eigenvectors), those at most ``rtol``
    times the largest set to 0 (the rounding noise of M's null space)."""
    m = beta * (u * values) @ u.T + c
    sigma, v = np.linalg.eigh((m + m.T) / 2)
    sigma, v = sigma[::-1], v[:, ::-1]  # descending
    return np.where(sigma > rtol * max(sigma[0], 0.0), sigma, 0.0), v


def frequent_directions_root(
    sketch: Sketch, c: Array, root: float, beta: float, eps: float, rtol: float
) -> tuple[Sketch, Array]:
    """Eq. (10d): fold the observation ``c`` (eq. 6c) into ``sketch``; the new sketch and X.

    ``M = beta U diag(lambda + eps) U^T + C`` is decomposed; its eigenvalues at
    most ``rtol`` times the largest count as 0 (rounding noise of a null space);
    its r largest less the (r+1)-th are the new lambda (their eigenvectors U'),
    the (r+1)-th joins the decayed tail. ``X = U' diag((lambda' + rho')^(-1/p))
    U'^T + rho'^(-1/p) (I - U' U'^T)``, or I while a lambda' or rho' is 0.
    """
    n, rank = sketch.u.shape
    sigma, v = _folded_spectrum(sketch.u, sketch.lam + eps, c, beta, rtol)
    cut = float(sigma[rank])
    lam = sigma[:rank] - cut
    decayed = beta * sketch.rho
    rho = max(decayed + cut, 0.0)
    kept = lam > 0
    lam = np.where(kept, lam, 0.0)
    u = v[:, :rank] * kept
    new = Sketch(u, lam, float(rho))
    if not kept.all() or rho <= 0:
        return new, np.eye(n)  # Google's has_zeros: the dim is not preconditioned
    # sigma_i + beta rho (= lambda' + rho'), as Google forms it.
    x = (sigma[:rank] + decayed) ** (-1.0 / root)
    const = rho ** (-1.0 / root)
    return new, (u * (x - const)) @ u.T + const * np.eye(n)


def tearfree_sketch_root(
    sketch: Sketch, c: Array, root: float, beta: float, epsilon: float, relative: bool,
    rtol: float,
) -> tuple[Sketch, Array]:
    """Eq. (10e), tearfree's Sketchy: fold ``c`` (eq. 6c) into ``sketch``; the new sketch and X.

    ``M = beta U diag(lambda) U^T + C`` (``U`` n x k, k = min(n, rank)) is
    decomposed, eigenvalues sigma descending, those at most ``rtol sigma_1``
    set to 0; ``cut = sigma_{k+1}`` (0 when k = n)::

        lambda' = sigma_1..k - cut,  U' = V_1..k,  rho' = sqrt(beta) rho + cut
        U'_i, lambda'_i <- 0 where lambda'_i <= 0
        eps = epsilon (sigma_1 + sqrt(beta) rho)  if relative and epsilon > 0, else epsilon
        X = U' diag((sigma_1..k + sqrt(beta) rho + eps)^(-1/p)) U'^T
            + (rho' + eps)^(-1/p) (I - U' U'^T)            ((rho' + eps)^(-1/p) -> 0 if rho' = 0)

    ``sigma_i + sqrt(beta) rho`` is ``lambda'_i + rho'`` (tearfree's
    ``undeflated``), formed as tearfree does; tearfree's SVD of
    ``[sqrt(beta) U diag(lambda)^(1/2), G_(k)]`` has the singular values
    ``sqrt(sigma)`` and the same vectors.
    """
    n, k = sketch.u.shape
    sigma, v = _folded_spectrum(sketch.u, sketch.lam, c, beta, rtol)
    cut = float(sigma[k]) if k < n else 0.0
    decayed = float(np.sqrt(beta)) * sketch.rho
    lam = sigma[:k] - cut
    rho = decayed + cut
    kept = lam > 0
    lam = np.where(kept, lam, 0.0)
    u = v[:, :k] * kept
    undeflated = sigma[:k] + decayed
    eps = epsilon * float(np.max(undeflated)) if relative and epsilon > 0 else epsilon
    x = np.where(kept, (undeflated + eps) ** (-1.0 / root), 0.0)
    const = (rho + eps) ** (-1.0 / root) if rho > 0 else 0.0
    new = Sketch(u, lam, float(rho))
    return new, (u * (x - const)) @ u.T + const * np.eye(n)


@dataclass(frozen=True)
class EighResult:
    """An eigendecomposition's product (inverse root, eq. 10, or eigenbasis, eq. 17) and
    its error ``e`` of eq. (10b)."""

    root: Array
    error: float


def eigh_error(b: Array, lam: Array, q: Array) -> float:
    """Eq. (10b): ``e = max_ij |(Q^T B Q - diag(lambda))_ij|`` for ``eigh(B) = (lambda, Q)``.

    Google's eigh error (``matrix_inverse_pth_root_eigh``: ``U^T (R U) - diag(e)``
    on its regularized input R), in that order of products. Rounding noise of
    the decomposition, about ``u ||B||`` (u the unit roundoff of B's dtype).
    """
    return float(np.max(np.abs(q.T @ (b @ q) - np.diag(lam))))


def eigh_fails(error: float, threshold_float32: float) -> bool:
    """Eqs. (10b), (13): whether an eigh root with error ``e`` fails at threshold tau.

    ``fl32(e) >= fl32(tau)``, or e NaN: both rounded to float32 as Google
    compares them (its error is a float32 metric). ``threshold_float32`` is
    ``fl32(tau)`` (``EighConfig.failure_threshold_float32``); an ``e`` beyond
    float32's range rounds to inf and fails.
    """
    with np.errstate(over="ignore"):
        e32 = np.float32(error)
    return not bool(e32 < np.float32(threshold_float32))


def eigh_input(matrix: Array, eps: float, placement: str) -> Array:
    """B of eq. (10), the matrix eigh decomposes: ``sym(A) + eps I`` (ridge placements),
    else ``sym(A)``."""
    a = symmetrize(matrix)
    if placement in ("ridge", "ridge_floor"):
        a = a + eps * np.eye(a.shape[0])
    return a


def _root_inverse_eigh(
    matrix: Array, root: float, eps: float, placement: str, with_error: bool,
    rank: tuple[float, float] | None, low_rank: tuple[int, str] | None = None,
) -> EighResult:
    b = eigh_input(matrix, eps, placement)
    lam, q = np.linalg.eigh(b)
    error = eigh_error(b, lam, q) if with_error else math.nan
    return EighResult(root_from_eigendecomposition(lam, q, root, eps, placement, rank, low_rank),
                      error)


def root_from_eigendecomposition(
    lam: Array, q: Array, root: float, eps: float, placement: str,
    rank: tuple[float, float] | None = None, low_rank: tuple[int, str] | None = None,
) -> Array:
    """Eq. (10)'s ``X = Q diag(lambda'^(-1/root)) Q^T`` from a decomposition
    ``B = Q diag(lambda) Q^T`` (lambda ascending): eigh's, or eq. (10f)'s QR estimate."""
    lam_reg = regularized_eigenvalues(lam, eps, placement)
    x = inverse_root_eigenvalues(lam_reg, root, rank)
    if low_rank is not None:
        x = low_rank_eigenvalues(x, low_rank)
    root_inverse: Array = (q * x) @ q.T
    return root_inverse


def root_inverse_eigh(
    matrix: Array, root: float, eps: float, placement: str,
    rank: tuple[float, float] | None = None, low_rank: tuple[int, str] | None = None,
) -> Array:
    """``X = Q diag(lambda'^(-1/root)) Q^T`` with lambda' from eq. (10); ``rank``: the
    ``(rtol, atol)`` of ``"pseudo_inverse"`` (:func:`inverse_root_eigenvalues`);
    ``low_rank``: ``(rank, keep)`` of eq. (10c), :func:`low_rank_eigenvalues`."""
    return _root_inverse_eigh(matrix, root, eps, placement, False, rank, low_rank).root


def root_inverse_eigh_with_error(
    matrix: Array, root: float, eps: float, placement: str,
    rank: tuple[float, float] | None = None, low_rank: tuple[int, str] | None = None,
) -> EighResult:
    """Eq. (10)'s X and its eigendecomposition's error e of eq. (10b), computed on B.

    Costs two more matrix products than :func:`root_inverse_eigh`: only for
    ``EighConfig.failure_threshold`` set. ``low_rank``: ``(rank, keep)`` of
    eq. (10c), :func:`low_rank_eigenvalues`.
    """
    return _root_inverse_eigh(matrix, root, eps, placement, True, rank, low_rank)


def root_inverse_eigh_stored(matrix: Array, root: float, eps: float, placement: str,
                             dtype: str) -> Array:
    """Eq. (11b): the inverse root of a factor stored in ``dtype`` s (bfloat16 or float16).

    ``matrix`` is the bias-corrected factor A, already s-valued. Every step
    Meta takes in s is rounded to s here: the ridge ``round_s(A + round_s(eps) I)``
    (``"ridge"``), the eigenvalues and eigenvectors of the exact
    eigendecomposition (float64, Meta's retry), the shift by the smallest
    eigenvalue m and the epsilon (``"ridge"``: only when ``m < eps``;
    ``"shift_after"``: by ``min(m, 0)``, then ``+ round_s(eps)``), the power
    ``l ** round_s(-1/root)``, the column scaling ``Q diag(x)`` and the
    product ``(Q diag(x)) Q^T``, whose upper triangle is the root (mirrored:
    Meta stores symmetric matrices packed). Each operand is s-valued, so each operation's
    exact result is formed in float64 (a product of two s numbers is exact;
    a sum of two is exact or, by Figueroa's double-rounding theorem, rounds
    to float32 as float32 arithmetic does) and rounded once to s through
    float32; only the n-term sum of the last product and the power carry a
    float64 rounding (docs/spec.md eq. 11b says what is exact). Returns the
    s-valued root in float64.
    """
    e = float(round_to(np.array([eps]), dtype)[0])
    a = np.asarray(matrix, dtype=np.float64)
    if placement == "ridge":
        a = round_to(a + e * np.eye(a.shape[0]), dtype)
    lam, q = np.linalg.eigh(a)
    lam, q = round_to(lam, dtype), round_to(q, dtype)
    m = float(lam.min())
    if placement == "ridge":
        if m < eps:
            lam = round_to(round_to(lam - m, dtype) + e, dtype)
    else:  # "shift_after"
        if m < 0:
            lam = round_to(lam - m, dtype)
        lam = round_to(lam + e, dtype)
    with np.errstate(divide="ignore", over="ignore"):
        x = round_to(lam ** float(round_to(np.array([-1.0 / root]), dtype)[0]), dtype)
        scaled = round_to(q * x, dtype)
        product = round_to(scaled @ q.T, dtype)
    # Meta stores the root as its upper triangle (use_symmetric_packing): the rounded
    # product is not symmetric, and its lower triangle is the upper one mirrored.
    stored: Array = np.triu(product) + np.triu(product, 1).T
    return stored


def eigenbasis(matrix: Array) -> Array:
    """Orthonormal eigenvectors of a symmetric factor, ascending eigenvalues (eq. 17)."""
    return np.linalg.eigh(symmetrize(matrix))[1]


def basis_still_fits(basis: Array, matrix: Array, eps: float, tolerance: float) -> bool:
    """Eq. (17b): whether ``B = (Q^T (A + eps I)) Q`` is nearly diagonal,
    ``sqrt(||B||_F^2 - ||diag B||^2) <= tolerance ||B||_F`` (False when the
    difference of squares rounds below 0: its root is NaN)."""
    b = (basis.T @ (matrix + eps * np.eye(matrix.shape[0]))) @ basis
    return off_diagonal_fits(b, tolerance)


def off_diagonal_fits(b: Array, tolerance: float) -> bool:
    """Eqs. (17b), (17c): ``sqrt(||B||_F^2 - ||diag B||^2) <= tolerance ||B||_F`` (False
    where the difference of squares rounds below 0: its root is NaN)."""
    with np.errstate(over="ignore", invalid="ignore"):  # overflow: NaN, not fitting
        norm = float(np.linalg.norm(b))
        off = float(np.sqrt(np.float64(norm**2 - float(np.linalg.norm(np.diag(b))) ** 2)))
    return off <= tolerance * norm


def qr_eigendecomposition(
    basis: Array, matrix: Array, eps: float, max_iterations: int, tolerance: float
) -> tuple[Array, Array] | None:
    """Eqs. (17c), (10f): Meta's QR algorithm from the stored eigenbasis Q; the estimated
    eigenvalues (diag B, ascending) and eigenvectors, or None (B or Q non-finite).

    ``B = (Q^T (A + eps I)) Q``; while fewer than ``max_iterations`` steps and
    B fails the off-diagonal criterion at ``tolerance``: ``B = Q' R`` (QR,
    LAPACK's Householder convention), ``B <- R Q'``, ``Q <- Q Q'``. Then
    Q's columns are sorted (stably) by the diagonal of B, ascending.
    """
    with np.errstate(all="ignore"):
        b = (basis.T @ (matrix + eps * np.eye(matrix.shape[0]))) @ basis
    if not np.all(np.isfinite(b)):
        return None  # an overflowing B (a QR step keeps a finite one finite)
    q = basis
    for _ in range(max_iterations):
        if off_diagonal_fits(b, tolerance):
            break
        step, r = np.linalg.qr(b)
        with np.errstate(all="ignore"):  # overflow: a non-finite B, a failed root
            b = r @ step
            q = q @ step
    order = np.argsort(np.diag(b), kind="stable")
    out: Array = q[:, order]
    if not bool(np.all(np.isfinite(out))):
        return None
    lam: Array = np.diag(b)[order]
    return lam, out


def qr_eigenbasis(
    basis: Array, matrix: Array, eps: float, max_iterations: int, tolerance: float
) -> Array | None:
    """Eq. (17c): the eigenbasis of :func:`qr_eigendecomposition` (None: failed)."""
    result = qr_eigendecomposition(basis, matrix, eps, max_iterations, tolerance)
    return None if result is None else result[1]


def root_inverse_qr(
    basis: Array, matrix: Array, root: float, eps: float, placement: str,
    max_iterations: int, tolerance: float, rank: tuple[float, float] | None = None,
) -> tuple[Array, Array] | None:
    """Eq. (10f): ``(X, Q)``, eq. (10)'s root from the QR estimate ``(lambda, Q)`` of
    :func:`qr_eigendecomposition` on ``A + eps I`` (``"ridge"``) or A (``"shift_after"``,
    ``"pseudo_inverse"``) from the stored ``basis``; None when the estimate is not finite."""
    ridge = eps if placement == "ridge" else 0.0
    result = qr_eigendecomposition(basis, matrix, ridge, max_iterations, tolerance)
    if result is None:
        return None
    lam, q = result
    return root_from_eigendecomposition(lam, q, root, eps, placement, rank), q


def root_inverse_reusing_basis(
    basis: Array, matrix: Array, root: float, eps: float, placement: str,
    tolerance: float, rank: tuple[float, float] | None = None,
) -> tuple[Array, Array] | None:
    """Eq. (10h): ``(X, Q)``; the stored ``basis`` kept (eq. 10f with no QR step:
    lambda = diag B, sorted) when ``B = (Q^T A') Q`` meets the off-diagonal
    criterion at ``tolerance``, else eq. (10)'s eigh root and eigenvectors of
    ``sym(A')``; A' = A + eps I (``"ridge"``) or A. None: a non-finite estimate."""
    ridge = eps if placement == "ridge" else 0.0
    with np.errstate(all="ignore"):  # overflow: a non-finite B, which does not fit
        b = (basis.T @ (matrix + ridge * np.eye(matrix.shape[0]))) @ basis
    if bool(np.all(np.isfinite(b))) and off_diagonal_fits(b, tolerance):
        return root_inverse_qr(basis, matrix, root, eps, placement, 0, tolerance, rank)
    lam, q = np.linalg.eigh(eigh_input(matrix, eps, placement))
    return root_from_eigendecomposition(lam, q, root, eps, placement, rank), q


def eigenbasis_with_error(matrix: Array) -> EighResult:
    """Eq. (17)'s eigenbasis Q of ``B = sym(A)`` and its error e of eq. (10b)."""
    b = symmetrize(matrix)
    lam, q = np.linalg.eigh(b)
    return EighResult(q, eigh_error(b, lam, q))


@dataclass(frozen=True)
class NewtonResult:
    """Outcome of eq. (11): the root, its final error max|M - I|, iterations."""

    root: Array
    error: float
    iterations: int


def coupled_newton_iteration(
    matrix: Array, root: int, config: CoupledNewtonConfig, symmetric: bool = True
) -> NewtonResult:
    """One run of the coupled Newton iteration for ``matrix^(-1/root)`` (eq. 11).

    ``z = (1 + r) / (2 ||A||_F)``, ``X_0 = z^(1/r) I``, ``M_0 = z A``;
    ``T = ((r + 1) I - M) / r``, ``X <- X T``, ``M <- T^r M``. Converges
    since the spectrum of M_0 lies in (0, (1 + r)/2]; stops at
    ``max|M - I| <= tolerance``, after ``max_iterations``, or (when
    ``error_growth_limit`` is set) when the error would grow by that factor,
    returning the previous iterate with the grown error (which then decides
    retries and failure). ``symmetric=False`` (eq. 20c's read-back factors)
    iterates on the matrix as it is: X and M are polynomials in A, so X
    approximates the primary root of the non-symmetric A, as Google's does.
    """
    a = symmetrize(matrix) if symmetric else np.asarray(matrix)
    n = a.shape[0]
    identity = np.eye(n)
    norm = float(np.linalg.norm(a))
    if not np.isfinite(norm) or norm == 0.0:
        return NewtonResult(identity.copy(), float("nan"), 0)
    z = (1.0 + root) / (2.0 * norm)
    x = identity * z ** (1.0 / root)
    m = a * z
    error = float(np.max(np.abs(m - identity)))
    it = 0
    while it < config.max_iterations and error > config.tolerance:
        t = ((root + 1.0) * identity - m) / root
        new_m = np.linalg.matrix_power(t, root) @ m
        new_error = float(np.max(np.abs(new_m - identity)))
        if config.error_growth_limit is not None and not (
            new_error < error * config.error_growth_limit
        ):
            error = new_error  # report the error that stopped it (it decides retries)
            break
        x = x @ t
        m = new_m
        error = new_error
        it += 1
    return NewtonResult(x, error, it)


def root_inverse_coupled_newton(
    matrix: Array, root: int, eps: float, config: CoupledNewtonConfig, symmetric: bool = True
) -> NewtonResult:
    """``(A + eps I)^(-1/root)`` by eq. (11), with retries at a larger ridge.

    While the error exceeds ``retry_error_threshold`` and retries remain, the
    ridge is multiplied by ``retry_epsilon_factor`` and the iteration rerun.
    """
    n = matrix.shape[0]
    ridge = eps
    result = coupled_newton_iteration(matrix + ridge * np.eye(n), root, config, symmetric)
    for _ in range(config.retries):
        if np.isfinite(result.error) and result.error <= config.retry_error_threshold:
            break
        ridge *= config.retry_epsilon_factor
        result = coupled_newton_iteration(matrix + ridge * np.eye(n), root, config, symmetric)
    return result


def root_inverse_deflated_newton(
    matrix: Array, root: int, eps: EpsilonConfig, config: CoupledNewtonConfig
) -> NewtonResult:
    """Eq. (11d): ``(A + eps I)^(-1/root)`` by eq. (11) with the top-k pairs deflated.

    LOBPCG's top-k Ritz pairs (theta, V) of A (``lobpcg_top_k``), lambda_max
    = max theta for a relative epsilon (instead of eq. 9b), then

        A_d = A - V diag(theta - min theta) V^T
        X   = Newton(A_d + eps I) - V diag(d) V^T,
        d_i = (eps + min theta)^(-1/r) - (eps + theta_i)^(-1/r)

    with eq. (11)'s retries on A_d. Where V holds exact eigenvectors this is
    the root of A + eps I itself; after fewer iterations it is not, which is
    why the error returned (the one eq. 13 judges) is
    ``max|X^r (A + eps I) - I|`` on the undeflated factor.
    """
    a = symmetrize(matrix)
    n = a.shape[0]
    top = lobpcg_top_k(a, config.deflation_rank, config.lobpcg_iterations)
    low = float(np.min(top.values))
    shift = top.vectors * np.sqrt(top.values - low)[np.newaxis, :]
    deflated = a - shift @ shift.T
    ridge = float(eps.value)
    if eps.scale == "relative":
        ridge *= max(float(np.max(top.values)), eps.relative_floor)
    result = root_inverse_coupled_newton(deflated, root, ridge, config)
    restore = top.vectors * np.sqrt(pth_root_difference(ridge, low, top.values, root))
    x = result.root - restore @ restore.T
    with np.errstate(all="ignore"):
        check = np.linalg.matrix_power(x, root) @ (a + ridge * np.eye(n))
        error = float(np.max(np.abs(check - np.eye(n))))
    return NewtonResult(x, error, result.iterations)


def root_inverse_higher_order(
    matrix: Array, root: float, config: HigherOrderNewtonConfig
) -> Array | None:
    """``A^(-1/root)`` by Meta's coupled higher-order iteration, eq. (11c); None: failed.

    ``root = p / q`` exactly (``Fraction(root)``). Ridge
    ``eps = max(rel_epsilon ||A||_inf, abs_epsilon)``, ``z = 1 / tr(A + eps I)``,
    ``X = z^(1/p) I``, ``M = z (A + eps I)``; one Newton step
    ``T = s M + (1 - s) I`` (s = -1/p), ``X <- X T``, ``M <- T^p M``; then
    while ``max|M - I| > tolerance`` and fewer than ``max_iterations`` steps:
    ``T = sum_i b_i (I - M)^i`` (Horner), ``X <- X T``, ``M <- T^p M``,
    stopping (the new iterate kept) when the error grows beyond 1.2 times or
    repeats below 1e-3. Fails when ``||A||_inf`` is not finite, when
    ``max|(A + eps I) X^p - I| > 0.1`` or when ``X^q`` is not finite.
    """
    fraction = Fraction(root)
    p, q = fraction.numerator, fraction.denominator
    matrix = symmetrize(matrix)  # as eq. (11): a no-op on the symmetric factors
    n = matrix.shape[0]
    identity = np.eye(n)
    with np.errstate(all="ignore"):
        lam = float(np.max(np.sum(np.abs(matrix), axis=1)))
        if not math.isfinite(lam):
            return None
        eps = max(lam * config.rel_epsilon, config.abs_epsilon)
        a = matrix + eps * identity
        z = float(np.float64(1.0) / np.trace(a))  # inf for a zero trace: X non-finite
        s = -1.0 / p
        x = z ** (1.0 / p) * identity
        m = z * a
        t = s * m + (1.0 - s) * identity  # one Newton step first (Meta's convergence guard)
        x = x @ t
        m = np.linalg.matrix_power(t, p) @ m
        error = float(np.max(np.abs(m - identity)))
        b = config.coefficients(p)
        iterations = 1
        while error > config.tolerance and iterations < config.max_iterations:
            iterations += 1
            base = identity - m
            t = b[-1] * base + b[-2] * identity
            for coefficient in reversed(b[:-2]):
                t = coefficient * identity + t @ base
            x = x @ t
            m = np.linalg.matrix_power(t, p) @ m
            new_error = float(np.max(np.abs(m - identity)))
            if new_error > error * 1.2 or (new_error == error and error < 1e-3):
                break  # Meta keeps this last iterate
            error = new_error
        true_error = float(np.max(np.abs(a @ np.linalg.matrix_power(x, p) - identity)))
        if true_error > 0.1:
            return None
        if q > 1:
            x = np.linalg.matrix_power(x, q)
    return x if bool(np.all(np.isfinite(x))) else None


def orthogonalize(block: Array, spectral: SpectralDescentConfig) -> Array:
    """Eq. (16c): the matrix ``block`` orthogonalized, ``orth(F~_B)``.

    ``"svd"``: ``U_r V_r^T`` over the singular pairs of the reduced SVD
    ``block = U S V^T`` above the rank tolerance ``max(m, n) eps s_max``
    (:func:`svd_rank_tolerance`; times ``sum(S)`` with
    ``scale_by_nuclear_norm``): the polar factor on the block's range, unique
    whatever its rank. ``"newton_schulz"``: ``X = block / max(||block||_F, 1e-8)``,
    transposed when it has fewer rows than columns, then ``num_iterations``
    times ``A = X^T X, X = a X + X (b A + c A A)``, transposed back: for X with
    singular values s in (0, 1] each step maps s to ``a s + b s^3 + c s^5``.
    """
    if spectral.method == "svd":
        u, s, vt = np.linalg.svd(block, full_matrices=False)
        kept = s > svd_rank_tolerance(block.shape, s, np.finfo(np.float64).eps)
        out: Array = (u * kept) @ vt
        return out * np.sum(s) if spectral.scale_by_nuclear_norm else out
    x = block / max(float(np.linalg.norm(block)), 1e-8)
    transpose = x.shape[0] < x.shape[1]
    if transpose:
        x = x.T
    a, b, c = spectral.coefficients
    for _ in range(spectral.num_iterations):
        gram = x.T @ x
        x = a * x + x @ (b * gram + c * (gram @ gram))
    return x.T if transpose else x


def svd_rank_tolerance(shape: tuple[int, ...], s: Array, eps: float) -> float:
    """Eq. (16c)'s rank tolerance ``max(m, n) * eps * s_max`` (NumPy's ``matrix_rank``).

    A singular value at or below it is a rounding error of a zero one: its
    singular vectors are arbitrary (any basis of the null space), so ``U V^T``
    over them is not a function of the block. The gradient of a softmax
    output layer, whose rows of residuals sum to zero, is always such a block.
    """
    return float(max(shape) * eps * (np.max(s) if s.size else 0.0))
