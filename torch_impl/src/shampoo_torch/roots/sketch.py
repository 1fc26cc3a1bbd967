"""Sketched roots (docs/spec.md eqs. 10d, 10e): frequent directions and tearfree's Sketchy.

A sketched factor keeps ``(U, lambda, rho)`` (:class:`~shampoo_torch.blocks.Sketch`)
instead of its n x n statistics; at a root step its observation C (eq. 6c) is
folded into the sketch and the root formed from the new sketch. Eq. (10c)'s
low-rank eigenvalues are :func:`~shampoo_torch.roots.eigh.low_rank_eigenvalues`
(applied inside eq. 10's eigh root).
"""

from __future__ import annotations

import math

import torch

from shampoo_spec import EpsilonConfig

from ..blocks import Sketch
from ..invariance import rowwise
from .eigh import eigh
from .regularize import finite_rows, sanitize, symmetrize


def sketch_epsilon(lam_1: torch.Tensor, eps: EpsilonConfig, relative_floor: float
                   ) -> torch.Tensor:
    """Eq. (10d)'s eps_t per row: ``epsilon.value``, times ``max(lambda_1, relative_floor)``
    when relative (``lam_1`` [B]: each sketch's largest value, after a reset)."""
    if eps.scale == "absolute":
        return torch.full_like(lam_1, eps.value)
    return eps.value * torch.clamp_min(lam_1, relative_floor)


def _folded_spectrum(u: torch.Tensor, values: torch.Tensor, c: torch.Tensor, beta: float,
                     rtol: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decomposition eqs. (10d) and (10e) share, per row: ``M = beta U diag(values)
    U^T + C``, its eigenvalues sigma descending (with their eigenvectors), those at most
    ``rtol sigma_1`` set to 0; and whether the row's M is finite and its eigh succeeded."""
    m = torch.matmul(beta * (u * values[:, None, :]), u.mT) + c
    m, finite = sanitize(m)
    w, vectors, ok_eigh = eigh(symmetrize(m))
    sigma, v = w.flip(-1), vectors.flip(-1).contiguous()  # descending
    sigma = torch.where(sigma > rtol * torch.clamp_min(sigma[:, :1], 0.0), sigma, 0.0)
    return sigma, v, finite & ok_eigh


def frequent_directions_root(
    sketch: Sketch, c: torch.Tensor, root: float, beta: float, eps: torch.Tensor, rtol: float,
) -> tuple[Sketch, torch.Tensor, torch.Tensor]:
    """Eq. (10d) per row: fold the observation ``c`` (eq. 6c) into the sketch; the new
    sketch ``(U', lambda', rho')``, X and ok (eq. 13).

    ``M = beta U diag(lambda + eps) U^T + C`` (``c`` [B, n, n], ``eps`` [B]) is
    decomposed, eigenvalues sigma descending, those at most ``rtol sigma_1`` set
    to 0 (``FrequentDirectionsConfig.zero_rtol``: the rounding noise of M's null
    space, which would otherwise decide between X = I and a huge ``rho'^(-1/p)``).
    ``lambda' = sigma_1..r - sigma_{r+1}`` (eigenvectors U'),
    ``rho' = max(beta rho + sigma_{r+1}, 0)``, and columns with ``lambda' <= 0``
    zeroed. ``X = U' diag((sigma_1..r + beta rho)^(-1/p)) U'^T
    + rho'^(-1/p) (I - U' U'^T)`` (``sigma_i + beta rho = lambda'_i + rho'``, as
    Google forms it and the reference computes it), or I while some lambda' or
    rho' is 0 (Google's ``has_zeros``). The powers are taken one row per call
    (batch invariance). A row whose M is not finite or whose eigh fails keeps
    its sketch and fails (the reference has no sketch to give there); every
    other row's sketch is the new one whatever X is.
    """
    u, lam, rank = sketch.u, sketch.lam, sketch.u.shape[-1]
    eye = torch.eye(c.shape[-1], dtype=c.dtype, device=c.device)
    sigma, v, valid = _folded_spectrum(u, lam + eps[:, None], c, beta, rtol)
    cut = sigma[:, rank]
    new_lam = sigma[:, :rank] - cut[:, None]
    decayed = beta * sketch.rho
    new_rho = torch.clamp_min(decayed + cut, 0.0)
    kept = new_lam > 0
    new_lam = torch.where(kept, new_lam, 0.0)
    new_u = v[:, :, :rank] * kept[:, None, :]
    powers = rowwise(lambda z: z.pow(-1.0 / root),
                     torch.cat([sigma[:, :rank] + decayed[:, None], new_rho[:, None]], dim=1))
    x_kept, const = powers[:, :rank], powers[:, rank]
    x = torch.matmul(new_u * (x_kept - const[:, None])[:, None, :], new_u.mT)
    x = x + const[:, None, None] * eye
    has_zeros = ~kept.all(dim=1) | (new_rho <= 0)
    x = torch.where(has_zeros[:, None, None], eye, x)
    new = sketch.where(valid, Sketch(new_u, new_lam, new_rho))
    return new, x, valid & finite_rows(x)


def tearfree_sketch_root(
    sketch: Sketch, c: torch.Tensor, root: float, beta: float, epsilon: float, relative: bool,
    rtol: float,
) -> tuple[Sketch, torch.Tensor, torch.Tensor]:
    """Eq. (10e), tearfree's Sketchy, per row: fold ``c`` (eq. 6c) into the sketch; the new
    sketch, X and ok (eq. 13).

    As reference ``linalg.tearfree_sketch_root`` (U [B, n, k], k = min(n, rank))::

        M = beta U diag(lambda) U^T + C,  sigma descending, <= rtol sigma_1 set to 0
        cut = sigma_{k+1} (0 if k = n),  lambda' = sigma_1..k - cut,  U' = V_1..k
        rho' = sqrt(beta) rho + cut;  U'_i, lambda'_i <- 0 where lambda'_i <= 0
        eps = epsilon (sigma_1 + sqrt(beta) rho) if relative and epsilon > 0, else epsilon
        X = U' diag((sigma_1..k + sqrt(beta) rho + eps)^(-1/p)) U'^T + t (I - U' U'^T),
        t = (rho' + eps)^(-1/p), 0 where rho' = 0

    The powers are taken one row per call (batch invariance). A row whose M is
    not finite or whose eigh fails keeps its sketch and fails.
    """
    u, lam = sketch.u, sketch.lam
    n, k = u.shape[-2], u.shape[-1]
    eye = torch.eye(n, dtype=c.dtype, device=c.device)
    sigma, v, valid = _folded_spectrum(u, lam, c, beta, rtol)
    cut = sigma[:, k] if k < n else torch.zeros_like(sigma[:, 0])
    decayed = math.sqrt(beta) * sketch.rho
    new_lam = sigma[:, :k] - cut[:, None]
    new_rho = decayed + cut
    kept = new_lam > 0
    new_lam = torch.where(kept, new_lam, 0.0)
    new_u = v[:, :, :k] * kept[:, None, :]
    undeflated = sigma[:, :k] + decayed[:, None]
    if relative and epsilon > 0:
        eps = epsilon * undeflated.amax(dim=1)
    else:
        eps = torch.full_like(new_rho, epsilon)
    positive = new_rho > 0
    powers = rowwise(lambda z: z.pow(-1.0 / root), torch.cat(
        [undeflated + eps[:, None], (torch.where(positive, new_rho, 1.0) + eps)[:, None]], dim=1))
    x_kept = torch.where(kept, powers[:, :k], 0.0)
    const = torch.where(positive, powers[:, k], 0.0)
    x = torch.matmul(new_u * (x_kept - const[:, None])[:, None, :], new_u.mT)
    x = x + const[:, None, None] * eye
    new = sketch.where(valid, Sketch(new_u, new_lam, new_rho))
    return new, x, valid & finite_rows(x)
