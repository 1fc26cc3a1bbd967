"""Eq. (10): inverse roots (and eq. 17's eigenbases) by eigendecomposition.

Eq. numbers refer to docs/spec.md: the matrix eigh decomposes, its error
of eq. (10b) and the failure test of eq. (13), the inverse-root eigenvalues
with the pseudo-inverse rank cutoff, the root of eq. (10) and the one
computed in the storage dtype s, eq. (11b). Exact up to float64 rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ..rounding import round_to
from .regularize import regularized_eigenvalues, symmetrize
from .sketch import low_rank_eigenvalues

Array = NDArray[np.float64]


@dataclass(frozen=True)
class EighResult:
    """An eigendecomposition's product (inverse root, eq. 10, or eigenbasis, eq. 17) and
    its error ``e`` of eq. (10b)."""

    root: Array
    error: float


def eigh_input(matrix: Array, eps: float, placement: str) -> Array:
    """B of eq. (10), the matrix eigh decomposes: ``sym(A) + eps I`` (ridge placements),
    else ``sym(A)``."""
    a = symmetrize(matrix)
    if placement in ("ridge", "ridge_floor"):
        a = a + eps * np.eye(a.shape[0])
    return a


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


def eigenbasis_with_error(matrix: Array) -> EighResult:
    """Eq. (17)'s eigenbasis Q of ``B = sym(A)`` and its error e of eq. (10b)."""
    b = symmetrize(matrix)
    lam, q = np.linalg.eigh(b)
    return EighResult(q, eigh_error(b, lam, q))
