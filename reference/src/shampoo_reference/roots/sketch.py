"""Compressed roots: low rank (eq. 10c) and frequent-directions sketches (eqs. 10d, 10e).

Eq. numbers refer to docs/spec.md: the low-rank inverse-root eigenvalues,
Google's frequent-directions sketch and its root, and tearfree's Sketchy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

Array = NDArray[np.float64]


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
