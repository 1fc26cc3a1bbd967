"""Batched inverse roots of stacked factors (docs/spec.md eqs. 9-11d, 13, 17).

Every function takes a stack ``[B, n, n]`` of (bias-corrected, eq. 7)
factors and returns the new inverse roots ``A^(-1/r)`` (or eigenbases)
together with a per-row ``ok`` mask (False: non-finite, eq. 11's Newton
failure, or eq. 10b's eigh error at ``EighConfig.failure_threshold``); the caller
(:func:`shampoo_torch.preconditioner.refresh_inverse_roots`) keeps the
previous inverse root wherever ``ok`` is False (eq. 13). ``root`` arguments
are the exponents r of eq. (12). Rows with
non-finite entries are replaced by the identity before any decomposition so
that one bad factor never poisons (or aborts) the batch.

Host syncs: none for the eigendecomposition path on CPU; ``torch.linalg.eigh``
itself checks convergence on CUDA (root steps only, amortized). The coupled
Newton iteration (eq. 11) stops when every row has converged; it asks the
device whether any row is still running every ``check_every`` iterations
(1 on CPU, where it is free); the results do not depend on that interval
because finished rows are frozen. Eq. (11d)'s LOBPCG reads which rows still
run once per iteration (at most m per root step).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch

from shampoo_spec import (
    CoupledNewtonConfig,
    EpsilonConfig,
    HigherOrderNewtonConfig,
    power_iteration_start,
)

from . import gemm
from .blocks import Sketch
from .invariance import rowwise
from .lobpcg import lobpcg_top_k, pth_root_difference


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


def eigh(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batched ``torch.linalg.eigh`` that never raises: (lambda, Q, ok).

    If the batched call reports a failure, the rows are decomposed one at a
    time and the failing ones get (1, I) with ok = False.
    """
    try:
        lam, q = torch.linalg.eigh(a)
        return lam, q, torch.ones(a.shape[0], dtype=torch.bool, device=a.device)
    except torch.linalg.LinAlgError:
        pass
    n = a.shape[-1]
    lams, qs, oks = [], [], []
    for row in a:
        try:
            lam, q = torch.linalg.eigh(row)
            oks.append(True)
        except torch.linalg.LinAlgError:
            lam = torch.ones(n, dtype=a.dtype, device=a.device)
            q = torch.eye(n, dtype=a.dtype, device=a.device)
            oks.append(False)
        lams.append(lam)
        qs.append(q)
    return torch.stack(lams), torch.stack(qs), torch.tensor(oks, device=a.device)


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
    start = torch.as_tensor(np.asarray(power_iteration_start(n), dtype=np.float64),
                            dtype=a.dtype, device=a.device)
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


def inverse_root_eigenvalues(lam: torch.Tensor, root: float, eps: EpsilonConfig,
                             scale: torch.Tensor | None = None) -> torch.Tensor:
    """``lambda'^(-1/root)`` of eq. (10), rows ascending; ``"pseudo_inverse"``: 0 at or
    below the cutoff ``max(rtol * max(lambda_max, 0), atol)`` of each row.

    ``scale`` ``[B]`` (eq. 10g, ``epsilon.rank_cutoff_scope="parameter"``): Lambda_k of
    each row, the largest eigenvalue over its parameter's blocks of the same dim, in
    place of the row's own lambda_max: ``c = max(rtol * max(Lambda_k, 0), atol)``, rtol
    still the row's own. A row whose Lambda_k is -inf (no block of that dim had a
    decomposable finite factor) takes its own lambda_max, as the reference does then.
    """
    def power(x: torch.Tensor) -> torch.Tensor:  # per row: batch invariance (.invariance)
        return rowwise(lambda v: v.pow(-1.0 / root), x)

    if not eps.pseudo_inverse:
        return power(lam)
    dtype = "float64" if lam.dtype == torch.float64 else "float32"
    rtol = eps.rank_cutoff_rtol(lam.shape[-1], dtype)
    top = lam[:, -1:]
    if scale is not None:  # eq. (10g)
        scale = scale.to(lam.dtype)[:, None]
        top = torch.where(torch.isneginf(scale), top, scale)
    cutoff = torch.clamp_min(rtol * torch.clamp_min(top, 0.0), eps.rank_atol)
    kept = lam > cutoff
    return torch.where(kept, power(torch.where(kept, lam, 1.0)), 0.0)


def eigh_error(b: torch.Tensor, lam: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Eq. (10b) per row: ``e = max_ij |(Q^T B Q - diag(lambda))_ij|``, ``[B]``.

    The products in Google's order, ``Q^T (B Q)``, as reference
    ``linalg.eigh_error``.
    """
    recovered = torch.matmul(q.transpose(1, 2), torch.matmul(b, q))
    # In place on the fresh product: the same values as ``recovered - diag_embed(lam)``
    # (off the diagonal x - 0 = x exactly), without three more [B, n, n] temporaries.
    recovered.diagonal(dim1=-2, dim2=-1).sub_(lam)
    return recovered.abs_().flatten(1).amax(dim=1)


def eigh_passes(
    b: torch.Tensor, lam: torch.Tensor, q: torch.Tensor, threshold_float32: float
) -> torch.Tensor:
    """Eq. (10b): ``[B]`` bools, False where ``fl32(e) >= fl32(tau)`` or e is NaN.

    ``threshold_float32`` is ``fl32(tau)`` (``EighConfig.failure_threshold_float32``).
    Callers skip it without a threshold: e is then never computed.
    """
    error32 = eigh_error(b, lam, q).to(torch.float32)  # overflow rounds to inf: fails
    return error32 < threshold_float32  # exact: a float32 value; NaN compares False


def low_rank_eigenvalues(x: torch.Tensor, low_rank: tuple[int, str]) -> torch.Tensor:
    """Eq. (10c) per row of ``x`` [B, n] (ascending eigenvalues of B): keep ``rank`` of
    the largest (``keep="largest"``) or smallest; every other one becomes their mean."""
    rank, keep = low_rank
    n = x.shape[-1]
    index = torch.arange(n, device=x.device)
    kept = index >= n - rank if keep == "largest" else index < rank
    c = x[:, ~kept].mean(dim=-1, keepdim=True)
    return torch.where(kept, x, c)


def root_inverse_eigh(
    a: torch.Tensor, root: float, eps: EpsilonConfig, failure_threshold: float | None = None,
    low_rank: tuple[int, str] | None = None, scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``X = Q diag(lambda'^(-1/root)) Q^T`` for each row, eqs. (9)-(10), and ok (eq. 13).

    A row fails when non-finite or, with ``failure_threshold`` (``fl32(tau)``),
    when its eigendecomposition's error e of eq. (10b) has ``fl32(e) >= fl32(tau)``.
    ``low_rank``: ``(rank, keep)`` of eq. (10c) (:func:`low_rank_eigenvalues`).
    ``scale``: eq. (10g)'s Lambda_k per row for the rank cutoff
    (:func:`inverse_root_eigenvalues`; None: each row's own lambda_max).
    """
    a, ok = sanitize(a)
    e = effective_epsilon(a, eps)
    a = eigh_input(a, e, eps.placement)
    lam, q, ok_eigh = eigh(a)
    if failure_threshold is not None:
        ok = ok & eigh_passes(a, lam, q, failure_threshold)
    x = root_from_eigendecomposition(lam, q, root, e, eps, low_rank, scale)
    return x, ok & ok_eigh & finite_rows(x)


def eigh_input(a: torch.Tensor, e: torch.Tensor, placement: str) -> torch.Tensor:
    """B of eq. (10), the matrix eigh decomposes per row: ``sym(A) + e I`` (ridge
    placements; ``e`` [B] eq. 9's epsilon), else ``sym(A)``."""
    a = symmetrize(a)
    if placement in ("ridge", "ridge_floor"):  # on symmetrize's fresh result, in place
        a.add_(e[:, None, None] * torch.eye(a.shape[-1], dtype=a.dtype, device=a.device))
    return a


def root_from_eigendecomposition(
    lam: torch.Tensor, q: torch.Tensor, root: float, e: torch.Tensor, eps: EpsilonConfig,
    low_rank: tuple[int, str] | None = None, scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. (10)'s ``X = Q diag(lambda'^(-1/root)) Q^T`` per row from ``B = Q diag(lambda)
    Q^T`` (lambda ascending; ``e`` [B] eq. 9's epsilon): eigh's, or eq. (10f)'s QR
    estimate (:func:`root_inverse_qr`). ``scale``: eq. (10g)'s Lambda_k per row."""
    lam = regularized_eigenvalues(lam, e, eps.placement)
    values = inverse_root_eigenvalues(lam, root, eps, scale)
    if low_rank is not None:
        values = low_rank_eigenvalues(values, low_rank)
    return gemm.bmm(q * values.unsqueeze(1), q.transpose(1, 2))


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


def root_inverse_eigh_stored(
    a: torch.Tensor, root: float, eps: EpsilonConfig, work_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (11b) per row: the inverse root of factors stored in s (bfloat16 or float16).

    ``a`` [B, n, n] in s, already bias corrected. Meta's steps in s, each one
    torch's s kernel (float32 arithmetic rounded once to s; the added scalars,
    ``add``'s alpha and ``pow``'s exponent rounded to s): the ridge
    ``A + round_s(eps) I``, the eigendecomposition in ``work_dtype`` (Meta's
    float64 retry) with lambda and Q cast to s, the shift by the smallest
    eigenvalue m and the epsilon (``"ridge"``: only where ``m < eps``;
    ``"shift_after"``: by ``min(m, 0)``, then ``+ eps``), ``pow(-1/root)``, the
    column scaling (``pow`` in float32, as torch's vectorized s kernel); the product
    ``(Q diag(x)) Q^T`` of s numbers summed in
    ``work_dtype`` and rounded to s (the reference's sum, to that precision), its
    upper triangle mirrored (Meta stores the root packed as its upper triangle).
    Returns the root in s and ok (eq. 13: finite input, eigh converged, finite
    root).
    """
    s = a.dtype
    a, ok = sanitize(a)
    n = a.shape[-1]
    value = eps.value
    if eps.placement == "ridge":
        a = a.add(torch.eye(n, dtype=s, device=a.device), alpha=value)
    lam, q, ok_eigh = eigh(a.to(work_dtype))
    lam, q = lam.to(s), q.to(s)
    m = lam[:, :1]  # ascending: the smallest eigenvalue of each row
    if eps.placement == "ridge":
        shifted = (lam - m) + value  # per row: m is the row's scalar, as Meta's .item()
        lam = torch.where(m.double() < value, shifted, lam)
    else:  # "shift_after"
        lam = torch.where(m < 0, lam - m, lam) + value
    # The power in float32 with the exponent rounded to s, rounded once to s: torch's s
    # kernel, except bfloat16 pow(-1/2), whose scalar tail (entries outside whole SIMD
    # vectors) rounds sqrt to bfloat16 before dividing (docs/spec.md eq. 11b).
    exponent = float(torch.tensor(-1.0 / root, dtype=torch.float64).to(s))
    x = lam.float().pow(exponent).to(s)
    scaled = q * x.unsqueeze(1)
    out = torch.matmul(scaled.to(work_dtype), q.to(work_dtype).transpose(1, 2)).to(s)
    out = torch.triu(out) + torch.triu(out, 1).transpose(1, 2)  # the upper triangle, mirrored
    return out, ok & ok_eigh & finite_rows(out)


def eigenbasis(
    a: torch.Tensor, failure_threshold: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvectors (ascending eigenvalues) of each row, eq. (17), and ok (eq. 10b as
    :func:`root_inverse_eigh`, on ``B = sym(A)``)."""
    a, ok = sanitize(a)
    b = symmetrize(a)
    lam, q, ok_eigh = eigh(b)
    if failure_threshold is not None:
        ok = ok & eigh_passes(b, lam, q, failure_threshold)
    return q, ok & ok_eigh & finite_rows(q)


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
    check_every = _check_every(a.device)  # as eq. (11): frozen rows make it value-neutral
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


def _check_every(device: torch.device) -> int:
    return 1 if device.type == "cpu" else 8


def coupled_newton_iteration(
    a: torch.Tensor, root: int, config: CoupledNewtonConfig, symmetric: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """One run of eq. (11) on each row of ``a`` (ridge already added): (X, error).

    Row by row this is exactly reference ``linalg.coupled_newton_iteration``:
    rows stop independently (tolerance, ``max_iterations``, or error growth
    beyond ``error_growth_limit``, which keeps the previous iterate and
    reports the grown error); a zero or non-finite norm gives (I, nan).
    ``symmetric=False``: the matrices as they are (eq. 20c's read-back factors).
    """
    a = symmetrize(a) if symmetric else a
    n = a.shape[-1]
    eye = torch.eye(n, dtype=a.dtype, device=a.device)
    norm = torch.linalg.matrix_norm(a)
    bad = ~torch.isfinite(norm) | (norm == 0)
    z = (1.0 + root) / (2.0 * torch.where(bad, torch.ones_like(norm), norm))
    # pow per row (batch invariance, :mod:`.invariance`); the rest is matmuls, exactly
    # rounded elementwise operations and row reductions, each row computed alone.
    x = eye * rowwise(lambda v: v.pow(1.0 / root), z)[:, None, None]
    m = a * z[:, None, None]
    x = torch.where(bad[:, None, None], eye, x)
    m = torch.where(bad[:, None, None], eye, m)
    error = (m - eye).abs().flatten(1).amax(dim=1)
    error = torch.where(bad, torch.full_like(error, float("nan")), error)
    active = error > config.tolerance  # False for nan, as in the reference loop
    check_every = _check_every(a.device)
    growth = config.error_growth_limit
    for it in range(config.max_iterations):
        if it % check_every == 0 and not bool(active.any()):
            break
        t = ((root + 1.0) * eye - m) / root
        new_m = torch.matmul(torch.linalg.matrix_power(t, root), m)
        new_error = (new_m - eye).abs().flatten(1).amax(dim=1)
        if growth is not None:
            grown = active & ~(new_error < error * growth)
            error = torch.where(grown, new_error, error)
            active = active & ~grown
        act = active[:, None, None]
        x = torch.where(act, torch.matmul(x, t), x)
        m = torch.where(act, new_m, m)
        error = torch.where(active, new_error, error)
        active = active & (new_error > config.tolerance)
    return x, error


def root_inverse_coupled_newton(
    a: torch.Tensor, root: int, eps: EpsilonConfig, config: CoupledNewtonConfig,
    symmetric: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A + eps I)^(-1/root)`` by eq. (11) with retries at a larger ridge; (X, ok).

    While a row's error exceeds ``retry_error_threshold`` (or is not finite)
    and retries remain, its ridge is multiplied by ``retry_epsilon_factor``
    and the iteration rerun for it. A row fails when its final error is not
    finite or ``>= failure_threshold``. Retrying stops early once no ridge can
    grow (all inf), where a rerun would only repeat the result. Cost: at most
    ``(retries + 1) * max_iterations`` iterations (max_iterations <= 10000 by
    the spec: a non-converging 64 x 64 factor takes about 1 s of CPU at the
    bound).
    """
    a, ok = sanitize(a)
    x, error = _coupled_newton_with_retries(a, root, effective_epsilon(a, eps), config,
                                            symmetric)
    return x, ok & _newton_passes(error, config) & finite_rows(x)


def _newton_passes(error: torch.Tensor, config: CoupledNewtonConfig) -> torch.Tensor:
    """Eq. (11)'s failure test per row: the final error finite and ``< failure_threshold``."""
    good = torch.isfinite(error)
    if config.failure_threshold is not None:
        good = good & (error < config.failure_threshold)
    return good


def _coupled_newton_with_retries(
    a: torch.Tensor, root: int, ridge: torch.Tensor, config: CoupledNewtonConfig,
    symmetric: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (11) on ``A + ridge I`` per row (``ridge`` [B]) with the retries of
    :func:`root_inverse_coupled_newton`; (X, final error)."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    x, error = coupled_newton_iteration(a + ridge[:, None, None] * eye, root, config, symmetric)
    for _ in range(config.retries):
        retry = ~(torch.isfinite(error) & (error <= config.retry_error_threshold))
        if not bool(retry.any()):
            break
        grown = torch.where(retry, ridge * config.retry_epsilon_factor, ridge)
        if not bool((grown != ridge).any()):
            break  # every retrying ridge is inf already: reruns would repeat (I, nan)
        ridge = grown
        x2, e2 = coupled_newton_iteration(a + ridge[:, None, None] * eye, root, config,
                                          symmetric)
        x = torch.where(retry[:, None, None], x2, x)
        error = torch.where(retry, e2, error)
    return x, error


def root_inverse_deflated_newton(
    a: torch.Tensor, root: int, eps: EpsilonConfig, config: CoupledNewtonConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (11d): ``(A + eps I)^(-1/root)`` per row by eq. (11) with the top-k pairs
    deflated (Google's ``lobpcg_topk_precondition``); (X, ok).

    Row by row reference ``linalg.root_inverse_deflated_newton``: LOBPCG's
    top-k Ritz pairs (theta, V) of ``sym(A)`` (:func:`.lobpcg.lobpcg_top_k`,
    k = ``deflation_rank``, m = ``lobpcg_iterations``), lambda_max = max theta
    for a relative epsilon (instead of eq. 9b), then

        A_d = A - V diag(theta - min theta) V^T
        X   = Newton(A_d + eps I) - V diag(d) V^T,
        d_i = (eps + min theta)^(-1/r) - (eps + theta_i)^(-1/r)

    with eq. (11)'s retries on A_d. Where V holds exact eigenvectors this is
    the root of A + eps I itself; after fewer iterations it is not, so a row
    fails (eq. 13) when ``max|X^r (A + eps I) - I|``, on the undeflated
    factor, is not finite or ``>= failure_threshold``. Only for symmetric
    factors (the config refuses eq. 20c's read-back ones).
    """
    a, ok = sanitize(a)
    a = symmetrize(a)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    top = lobpcg_top_k(a, config.deflation_rank, config.lobpcg_iterations)
    low = top.values.amin(dim=-1)
    # theta - low >= 0: the Ritz values are the top k and low their least.
    shift = top.vectors * torch.sqrt(top.values - low[:, None])[:, None, :]
    deflated = a - shift @ shift.mT
    ridge = torch.full_like(low, eps.value)
    if eps.scale == "relative":  # max theta: LOBPCG's estimate of lambda_max
        ridge = ridge * torch.clamp_min(top.values.amax(dim=-1), eps.relative_floor)
    x, _ = _coupled_newton_with_retries(deflated, root, ridge, config)
    restore = top.vectors * torch.sqrt(
        pth_root_difference(ridge, low, top.values, root))[:, None, :]
    x = x - restore @ restore.mT
    check = torch.linalg.matrix_power(x, root) @ (a + ridge[:, None, None] * eye)
    error = (check - eye).abs().flatten(1).amax(dim=1)
    return x, ok & _newton_passes(error, config) & finite_rows(x)


def root_inverse_higher_order(
    a: torch.Tensor, root: float, config: HigherOrderNewtonConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """``A^(-1/root)`` of each row by eq. (11c), Meta's coupled higher-order iteration; (X, ok).

    Row by row reference ``linalg.root_inverse_higher_order``: ``root = p/q``
    exactly, the ridge ``max(rel_epsilon ||A||_inf, abs_epsilon)``, one
    Newton step, then Horner steps of ``order`` while a row's error exceeds
    the tolerance (rows stop independently, keeping the iterate that grew
    or stalled); a row fails on a non-finite ``||A||_inf``, on
    ``max|(A + eps I) X^p - I| > 0.1`` or on a non-finite ``X^q``.
    """
    fraction = Fraction(root)
    p, q = fraction.numerator, fraction.denominator
    a, ok = sanitize(a)
    a = symmetrize(a)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    lam = a.abs().sum(dim=-1).amax(dim=-1)
    ok = ok & torch.isfinite(lam)
    eps = torch.clamp_min(lam * config.rel_epsilon, config.abs_epsilon)
    a = a + eps[:, None, None] * eye
    z = 1.0 / torch.diagonal(a, dim1=-2, dim2=-1).sum(-1)
    s = -1.0 / p
    x = z.pow(1.0 / p)[:, None, None] * eye
    m = z[:, None, None] * a
    t = s * m + (1.0 - s) * eye  # the Newton step first
    x = torch.matmul(x, t)
    m = torch.matmul(torch.linalg.matrix_power(t, p), m)
    error = (m - eye).abs().flatten(1).amax(dim=1)
    b = config.coefficients(p)
    active = error > config.tolerance  # False for NaN, as the reference's loop
    check_every = _check_every(a.device)
    for it in range(1, config.max_iterations):
        if (it - 1) % check_every == 0 and not bool(active.any()):
            break
        base = eye - m
        t = b[-1] * base + b[-2] * eye
        for coefficient in reversed(b[:-2]):
            t = coefficient * eye + torch.matmul(t, base)
        act = active[:, None, None]
        x = torch.where(act, torch.matmul(x, t), x)
        m = torch.where(act, torch.matmul(torch.linalg.matrix_power(t, p), m), m)
        new_error = (m - eye).abs().flatten(1).amax(dim=1)
        stop = (new_error > error * 1.2) | ((new_error == error) & (error < 1e-3))
        error = torch.where(active & ~stop, new_error, error)
        active = active & ~stop & (new_error > config.tolerance)
    true_error = (torch.matmul(a, torch.linalg.matrix_power(x, p)) - eye).abs().flatten(1)
    ok = ok & ~(true_error.amax(dim=1) > 0.1)  # NaN passes here, as Meta's test; X^q decides
    if q > 1:
        x = torch.linalg.matrix_power(x, q)
    return x, ok & finite_rows(x)
