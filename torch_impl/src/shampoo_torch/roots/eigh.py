"""Eq. (11)'s inverse roots by eigendecomposition (docs/spec.md eqs. 10, 10b, 10c, 11b, 17).

``torch.linalg.eigh`` that never raises (:func:`eigh`), its accuracy test
(eq. 10b), the root ``Q diag(lambda'^(-1/r)) Q^T`` of eq. (10) with the
pseudo-inverse's rank cutoff and eq. (10g)'s parameter-wide scale, eq.
(10c)'s low-rank eigenvalues, eq. (11b)'s root of factors stored in bfloat16
or float16, and eq. (17)'s eigenbasis.

Host syncs: none on CPU; ``torch.linalg.eigh`` itself checks convergence on
CUDA (root steps only, amortized).
"""

from __future__ import annotations

import torch

from shampoo_spec import EpsilonConfig

from .. import gemm
from ..invariance import rowwise
from .regularize import (
    effective_epsilon,
    finite_rows,
    regularized_eigenvalues,
    sanitize,
    symmetrize,
)


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


def eigh_input(a: torch.Tensor, e: torch.Tensor, placement: str) -> torch.Tensor:
    """B of eq. (10), the matrix eigh decomposes per row: ``sym(A) + e I`` (ridge
    placements; ``e`` [B] eq. 9's epsilon), else ``sym(A)``."""
    a = symmetrize(a)
    if placement in ("ridge", "ridge_floor"):  # on symmetrize's fresh result, in place
        a.add_(e[:, None, None] * torch.eye(a.shape[-1], dtype=a.dtype, device=a.device))
    return a


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


def low_rank_eigenvalues(x: torch.Tensor, low_rank: tuple[int, str]) -> torch.Tensor:
    """Eq. (10c) per row of ``x`` [B, n] (ascending eigenvalues of B): keep ``rank`` of
    the largest (``keep="largest"``) or smallest; every other one becomes their mean."""
    rank, keep = low_rank
    n = x.shape[-1]
    index = torch.arange(n, device=x.device)
    kept = index >= n - rank if keep == "largest" else index < rank
    c = x[:, ~kept].mean(dim=-1, keepdim=True)
    return torch.where(kept, x, c)


def root_from_eigendecomposition(
    lam: torch.Tensor, q: torch.Tensor, root: float, e: torch.Tensor, eps: EpsilonConfig,
    low_rank: tuple[int, str] | None = None, scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. (10)'s ``X = Q diag(lambda'^(-1/root)) Q^T`` per row from ``B = Q diag(lambda)
    Q^T`` (lambda ascending; ``e`` [B] eq. 9's epsilon): eigh's, or eq. (10f)'s QR
    estimate (:func:`.basis.root_inverse_qr`). ``scale``: eq. (10g)'s Lambda_k per row."""
    lam = regularized_eigenvalues(lam, e, eps.placement)
    values = inverse_root_eigenvalues(lam, root, eps, scale)
    if low_rank is not None:
        values = low_rank_eigenvalues(values, low_rank)
    return gemm.bmm(q * values.unsqueeze(1), q.transpose(1, 2))


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
