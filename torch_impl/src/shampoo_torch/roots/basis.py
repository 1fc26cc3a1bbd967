"""Roots from a stored eigenbasis (docs/spec.md eqs. 10f, 10h, 17b, 17c).

Each function takes ``pair = stack([Q, A], 1)`` ([B, 2, n, n]): the stored
eigenbasis Q and the factor A of each row. Eq. (17b) tests whether Q still
fits A, eq. (17c) refines Q by QR steps (Meta's QR algorithm), eq. (10f)
forms the root from that estimate and eq. (10h) keeps Q where it fits, else
takes eigh's.
"""

from __future__ import annotations

import torch

from shampoo_spec import EpsilonConfig

from .eigh import eigh, eigh_input, root_from_eigendecomposition
from .newton import check_interval
from .regularize import effective_epsilon, finite_rows, sanitize


def basis_still_fits(pair: torch.Tensor, eps: EpsilonConfig, tolerance: float) -> torch.Tensor:
    """Eq. (17b) per row of ``pair = stack([Q, A], 1)`` ([B, 2, n, n]): whether
    ``B = (Q^T (A + eps I)) Q`` has ``sqrt(||B||_F^2 - ||diag B||^2) <= tolerance ||B||_F``
    (eps of eq. 9 with the ridge placement, else 0; False where the difference of
    squares rounds below 0, whose root is NaN), as Meta's
    ``eigenvalues_estimate_criterion_below_or_equal_tolerance``."""
    q, a = pair[:, 0], pair[:, 1]
    return _off_diagonal_fits(_rotated_factor(q, a, _ridge(a, eps)), tolerance)


def _off_diagonal_fits(b: torch.Tensor, tolerance: float) -> torch.Tensor:
    """Eqs. (17b), (17c) per row: ``sqrt(||B||_F^2 - ||diag B||^2) <= tolerance ||B||_F``."""
    norm = torch.linalg.vector_norm(b.flatten(1), dim=1)
    diag = torch.linalg.vector_norm(torch.diagonal(b, dim1=-2, dim2=-1), dim=1)
    fits: torch.Tensor = torch.sqrt(norm**2 - diag**2) <= tolerance * norm  # NaN: False
    return fits


def qr_eigendecomposition(
    pair: torch.Tensor, eps: EpsilonConfig, max_iterations: int, tolerance: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eqs. (17c), (10f) per row of ``pair = stack([Q, A], 1)``: Meta's QR algorithm from
    the stored eigenbasis, as reference ``linalg.qr_eigendecomposition``; (lambda
    ascending, Q, ok).

    ``B = (Q^T (A + eps I)) Q`` (eps of eq. 9 with the ridge placement, else
    0); each row takes QR steps ``B = Q' R``, ``B <- R Q'``, ``Q <- Q Q'``
    until it meets the off-diagonal criterion or ``max_iterations`` (rows
    stop independently); the columns are then sorted stably by diag B. A row
    fails on a non-finite A, B or Q.
    """
    q, a = pair[:, 0], pair[:, 1]
    a, ok = sanitize(a)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    b = _rotated_factor(q, a, _ridge(a, eps))
    ok = ok & finite_rows(b)
    b = torch.where(ok[:, None, None], b, eye)
    running = ok.clone()
    check_every = check_interval(a.device)  # as eq. (11): frozen rows make it value-neutral
    for it in range(max_iterations):
        running = running & ~_off_diagonal_fits(b, tolerance)
        if it % check_every == 0 and not bool(running.any()):  # root steps only
            break
        step, r = torch.linalg.qr(b)
        sel = running[:, None, None]
        b = torch.where(sel, r @ step, b)
        q = torch.where(sel, q @ step, q)
    lam, q = _sorted_by_diagonal(b, q)
    return lam, q, ok & finite_rows(q)


def qr_eigenbasis(
    pair: torch.Tensor, eps: EpsilonConfig, max_iterations: int, tolerance: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (17c) per row of ``pair = stack([Q, A], 1)``: the eigenbasis of
    :func:`qr_eigendecomposition`; (Q, ok)."""
    _, q, ok = qr_eigendecomposition(pair, eps, max_iterations, tolerance)
    return q, ok


def root_inverse_qr(
    pair: torch.Tensor, root: float, eps: EpsilonConfig, max_iterations: int, tolerance: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (10f) per row of ``pair = stack([Q, A], 1)``: eq. (10)'s root from the QR
    estimate ``(lambda, Q)`` of :func:`qr_eigendecomposition` from the stored basis Q, as
    reference ``linalg.root_inverse_qr``; returns ``stack([X, Q'], 1)`` (root and new
    basis) and ok (eq. 13: a finite A, B, Q' and X)."""
    lam, q, ok = qr_eigendecomposition(pair, eps, max_iterations, tolerance)
    e = effective_epsilon(sanitize(pair[:, 1])[0], eps)
    x = root_from_eigendecomposition(lam, q, root, e, eps)
    return torch.stack([x, q], dim=1), ok & finite_rows(x)


def root_inverse_reusing_basis(
    pair: torch.Tensor, root: float, eps: EpsilonConfig, tolerance: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (10h) per row of ``pair = stack([Q, A], 1)``, as reference
    ``linalg.root_inverse_reusing_basis``; returns ``stack([X, Q'], 1)`` and ok.

    ``B = (Q^T A') Q`` with the stored Q (A' = A + eps I with the ridge, else A):
    a row whose B is finite and meets eq. (17b)'s criterion ``sqrt(||B||_F^2 -
    ||diag B||^2) <= tolerance ||B||_F`` keeps Q, lambda = diag B (eq. 10f with
    no QR step: columns sorted stably by diag B); every other row takes eq.
    (10)'s eigh of ``sym(A')``, Q' its eigenvectors. Then eq. (10)'s epsilon
    rule and ``X = Q' diag(f(lambda)) Q'^T``. ok (eq. 13): a finite A, Q' and X,
    and eigh converged where it ran. Only the rows that do not fit are
    decomposed (eigh is batch invariant, :mod:`.invariance`): one host read.
    """
    a, ok = sanitize(pair[:, 1])
    e = effective_epsilon(a, eps)
    b = _rotated_factor(pair[:, 0], a, e if eps.placement == "ridge" else torch.zeros_like(e))
    fits = finite_rows(b) & _off_diagonal_fits(b, tolerance)
    lam, q = _sorted_by_diagonal(b, pair[:, 0])
    redo = ~fits
    if bool(redo.any()):  # root steps only
        lam_e, q_e, ok_e = eigh(eigh_input(a[redo], e[redo], eps.placement))
        lam, q = lam.index_put((redo,), lam_e), q.index_put((redo,), q_e)
        ok = ok.index_put((redo,), ok[redo] & ok_e)
    x = root_from_eigendecomposition(lam, q, root, e, eps)
    return torch.stack([x, q], dim=1), ok & finite_rows(q) & finite_rows(x)


def _ridge(a: torch.Tensor, eps: EpsilonConfig) -> torch.Tensor:
    """The ridge of eqs. (10f), (10h), (17b), (17c) per row: eq. (9)'s epsilon with the
    ``"ridge"`` placement, else 0."""
    if eps.placement == "ridge":
        return effective_epsilon(a, eps)
    return torch.zeros(a.shape[0], dtype=a.dtype, device=a.device)


def _rotated_factor(q: torch.Tensor, a: torch.Tensor, ridge: torch.Tensor) -> torch.Tensor:
    """Eqs. (10f), (10h), (17b), (17c) per row: ``B = (Q^T (A + ridge I)) Q``."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return (q.transpose(1, 2) @ (a + ridge[:, None, None] * eye)) @ q


def _sorted_by_diagonal(b: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eqs. (10f), (17c): diag B ascending and Q's columns in that (stable) order."""
    lam, order = torch.sort(torch.diagonal(b, dim1=-2, dim2=-1), dim=-1, stable=True)
    return lam, torch.take_along_dim(q, order[:, None, :].expand_as(q), dim=2)
