"""A stored eigenbasis, eqs. (10f), (10h), (17b), (17c): kept while it fits, or QR steps.

Eq. numbers refer to docs/spec.md: the off-diagonal test of a stored basis
Q on ``B = (Q^T A) Q``, Meta's QR iteration from Q, and the roots of
eq. (10) from the QR estimate or from the kept basis.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from .eigh import eigh_input, root_from_eigendecomposition

Array = NDArray[np.float64]


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
