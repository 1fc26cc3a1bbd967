"""What every inverse root shares, eqs. (9)-(10): symmetry, finiteness, epsilon.

Every function takes a stack ``[B, n, n]`` of factors (or their eigenvalues
``[B, n]``) and works per row. Rows with non-finite entries are replaced by
the identity (:func:`sanitize`) before any decomposition, so that one bad
factor never poisons (or aborts) the batch.
"""

from __future__ import annotations

import math

import torch

from shampoo_spec import EpsilonConfig, power_iteration_start


def symmetrize(a: torch.Tensor) -> torch.Tensor:
    """``(A + A^T) / 2`` per row (the halving in place on the fresh sum: one temporary)."""
    return (a + a.transpose(-1, -2)).mul_(0.5)


def finite_rows(a: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: every entry of the row's matrix is finite."""
    return torch.isfinite(a).flatten(1).all(dim=1)


def sanitize(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace non-finite rows by the identity; returns (safe stack, finite mask)."""
    ok = finite_rows(a)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return torch.where(ok[:, None, None], a, eye), ok


def effective_epsilon(a: torch.Tensor, eps: EpsilonConfig) -> torch.Tensor:
    """Eq. (9) per row: eps, or eps * max(lambda_max(A), floor).

    lambda_max exact (eigvalsh) or Google's power-iteration estimate (eq. 9b).
    """
    if eps.scale == "absolute":
        return torch.full((a.shape[0],), eps.value, dtype=a.dtype, device=a.device)
    if eps.lambda_max == "power_iteration":
        lam_max = power_iteration_lambda_max(
            a, eps.power_iteration_steps, eps.power_iteration_tolerance
        )
    else:
        lam_max = torch.linalg.eigvalsh(symmetrize(a))[:, -1]
    return eps.value * torch.clamp_min(lam_max, eps.relative_floor)


#: Power-iteration steps between host reads of "has every row stopped?".
_POWER_CHECK_EVERY = 8


def power_iteration_lambda_max(a: torch.Tensor, steps: int, tolerance: float) -> torch.Tensor:
    """Eq. (9b) per row of ``a`` [B, n, n]: Google's power iteration, rows stopping alone.

    A row that has stopped keeps its vector and quotient while the others go
    on, so each row's result is that of its own loop. A host read every
    :data:`_POWER_CHECK_EVERY` steps (root steps only) ends the loop once every
    row has stopped; the steps in between change no stopped row.
    """
    b, n = a.shape[0], a.shape[-1]
    # The spec's start is a tuple of Python floats: float64 first, then a's dtype (one rounding).
    start = torch.tensor(power_iteration_start(n), dtype=torch.float64).to(a.device, a.dtype)
    v = start.expand(b, n).clone()
    s = torch.zeros(b, dtype=a.dtype, device=a.device)
    running = torch.ones(b, dtype=torch.bool, device=a.device)
    for i in range(steps):
        if i % _POWER_CHECK_EVERY == 0 and not bool(running.any()):
            break
        u = v / torch.linalg.vector_norm(v, dim=-1, keepdim=True)
        w = torch.einsum("bij,bj->bi", a, u)
        s_new = torch.einsum("bi,bi->b", u, w)
        moved = (s_new - s).abs() > tolerance  # False for NaN, as Google's
        v = torch.where(running[:, None], w, v)
        s = torch.where(running, s_new, s)
        running = running & moved
    return s


def regularized_eigenvalues(lam: torch.Tensor, eps: torch.Tensor, placement: str) -> torch.Tensor:
    """Eq. (10): the eigenvalues after the epsilon rule (ascending ``lam``, ``eps`` [B])."""
    lam_min = lam[:, :1]
    e = eps[:, None]
    if placement == "pseudo_inverse":
        return lam  # no epsilon: inverse_root_eigenvalues' rank cutoff instead
    if placement == "ridge":
        return lam + torch.clamp_min(e - lam_min, 0.0)
    if placement == "shift_after":
        return lam - torch.clamp_max(lam_min, 0.0) + e
    return torch.maximum(lam, e)  # "floor", "ridge_floor"


def largest_eigenvalues(a: torch.Tensor) -> torch.Tensor:
    """``[B]``: lambda_max of each row's symmetrized matrix (eq. 10g's contribution), -inf
    where the row is non-finite or its eigenvalues cannot be computed (no contribution).

    ``eigvalsh`` (no eigenvectors: the cutoff must be known before any root is
    formed, so the roots' own decompositions come later); computed per matrix, so a
    row's value does not depend on its batch (:mod:`.invariance`).
    """
    a, finite = sanitize(a)
    try:
        top = torch.linalg.eigvalsh(symmetrize(a))[:, -1]
    except torch.linalg.LinAlgError:  # one row at a time; a failing row gives nothing
        tops = []
        for row in symmetrize(a):
            try:
                tops.append(torch.linalg.eigvalsh(row)[-1])
            except torch.linalg.LinAlgError:
                tops.append(torch.tensor(-math.inf, dtype=a.dtype, device=a.device))
        top = torch.stack(tops)
    return torch.where(finite, top, -math.inf)
