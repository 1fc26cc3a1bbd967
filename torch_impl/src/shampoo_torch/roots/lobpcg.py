"""Eq. (11d)'s top-k eigenpairs, batched: LOBPCG as Google's deflated Newton root runs it.

The torch port of reference ``shampoo_reference.roots.lobpcg`` (itself a port of
JAX's ``jax.experimental.sparse.linalg.lobpcg_standard``, which Google's
``lobpcg_topk_precondition`` calls) on a stack ``[B, n, n]`` of symmetric
factors, one per leading row (docs/spec.md eq. 11d). After at most m
iterations the answer is the Rayleigh-Ritz approximation on a subspace that
depends on every choice the routine makes (start, first directions,
orthonormalization, truncation of near-dependent directions), so each
choice is made in JAX's order, in the factors' dtype (its eps for the
tolerances, as JAX takes them from the array's dtype).

Each row runs its own loop, as under ``jax.vmap`` of the ``while_loop``:
a row that has converged is not stepped again (the loop steps only the rows
still running, so a finished row neither changes nor feeds a decomposition
whatever its state). The operations are batch invariant (:mod:`.invariance`:
matmuls, ``eigh``, ``qr``, reductions per row, correctly rounded elementwise
operations; the powers one row per call), so a row's result does not depend
on the batch it is in. Host syncs: one per iteration (which rows still run),
on root steps only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..invariance import rowwise


class TopK(NamedTuple):
    """LOBPCG's answer per row: Ritz values theta ``[B, k]`` (descending), Ritz vectors
    ``[B, n, k]``, iterations ``[B]``."""

    values: torch.Tensor
    vectors: torch.Tensor
    iterations: torch.Tensor


def _column_norms(x: torch.Tensor) -> torch.Tensor:
    """``[B, 1, c]``: the Euclidean norm of each column of ``x`` ``[B, n, c]``."""
    return torch.sqrt(torch.sum(x * x, dim=-2, keepdim=True))


def _eigh_descending(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched ``eigh``, eigenvalues descending; a row whose decomposition fails (a NaN
    Gram matrix: a zero factor's Ritz vectors are 0 / 0 after one step) gets NaN, as
    JAX's ``eigh`` returns, and carries it to its root, which then fails (eq. 13),
    instead of aborting the batch."""
    try:
        w, v = torch.linalg.eigh(a)
    except torch.linalg.LinAlgError:
        ws, vs = [], []
        for row in a:  # one LAPACK call per row, as the batched call makes
            try:
                wr, vr = torch.linalg.eigh(row)
            except torch.linalg.LinAlgError:
                wr = torch.full_like(row[0], float("nan"))
                vr = torch.full_like(row, float("nan"))
            ws.append(wr)
            vs.append(vr)
        w, v = torch.stack(ws), torch.stack(vs)
    # Row-major either way: bmm picks its kernel by layout (:mod:`.invariance`).
    return w.flip(-1), v.flip(-1).contiguous()


def _svqb(x: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of each row's span(x) from the eigendecomposition of its Gram
    matrix (reference ``_svqb``).

    Columns are normalized first; directions whose Gram eigenvalue is at most
    eps times the largest are dropped (their columns set to 0), as is every
    column that was 0.
    """
    norms = _column_norms(x)
    x = x / torch.where(norms == 0, 1.0, norms)
    inner = x.mT @ x
    w, v = _eigh_descending(inner)
    tau = torch.finfo(x.dtype).eps * w[:, :1]
    # w^(-1/2) as 1 / sqrt (correctly rounded twice, so the same in every row and batch;
    # torch's pow(-0.5) is rsqrt too); where tau <= 0 the row is all dropped below.
    sqrted = 1.0 / torch.sqrt(torch.where(tau > 0, torch.maximum(w, tau), 1.0))
    ortho = x @ (v * sqrted[:, None, :])
    # JAX pairs the i-th eigenvalue with the i-th column's Gram diagonal here.
    keep = ((w > tau) & (torch.diagonal(inner, dim1=-2, dim2=-1) > 0.0))[:, None, :]
    ortho = ortho * keep
    norms = _column_norms(ortho)
    keep = keep & (norms > 0.0)
    return ortho / torch.where(keep, norms, 1.0)


def _orthonormalize(x: torch.Tensor) -> torch.Tensor:
    return _svqb(_svqb(x))  # twice is enough (Kahan)


def _project_out(basis: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The part of u orthogonal to the orthonormal ``basis``, orthonormalized.

    Columns that do not keep 99% of their norm through the last two
    subtractions are dropped: near convergence the residuals are rounding
    noise, and normalizing noise would reintroduce the basis.
    """
    for _ in range(2):
        u = u - basis @ (basis.mT @ u)
        u = _orthonormalize(u)
    for _ in range(2):
        u = u - basis @ (basis.mT @ u)
    return u * (_column_norms(u) >= 0.99)


def _extend_basis(x: torch.Tensor, m: int) -> torch.Tensor:
    """m orthonormal columns orthogonal to the orthonormal x ``[n, k]`` (a block
    Householder reflector; one matrix: the start is the same in every row)."""
    n, k = x.shape
    upper, lower = x[:k], x[k:]
    u, s, vt = torch.linalg.svd(upper)
    y = torch.cat([upper + u @ vt, lower], dim=0)
    other = torch.cat([torch.eye(m, dtype=x.dtype, device=x.device),
                       torch.zeros(n - k - m, m, dtype=x.dtype, device=x.device)], dim=0)
    w = y @ (vt.T * torch.pow(2.0 * (1.0 + s), -0.5)[None, :])
    h: torch.Tensor = -2.0 * (w @ w[k:, :].T @ other)
    h[k:] += other
    return h


def _step(a: torch.Tensor, x: torch.Tensor, p: torch.Tensor, r: torch.Tensor, tol: float
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One LOBPCG iteration of every row given: the new (theta, X, P, R, converged count).

    Rayleigh-Ritz on [X, P, R] (R's part in [X, P] projected out first): the
    top k Ritz vectors are the new X, their component along [P, R]
    (orthonormalized in the Ritz basis) the new P.
    """
    n, k = a.shape[-1], x.shape[-1]
    r = _project_out(torch.cat([x, p], dim=-1), r)
    xpr = torch.cat([x, p, r], dim=-1)
    ritz, q = _eigh_descending(xpr.mT @ (a @ xpr))
    b = q[:, :, :k]
    b = b / _column_norms(b)
    x = xpr @ b
    x = x / _column_norms(x)
    # The new direction: the Ritz vectors' component outside the old X,
    # orthogonalized in the Ritz basis (exactly orthonormal after xpr).
    qq, _ = torch.linalg.qr(q[:, :k, k:].mT)
    p = xpr @ (q[:, :, k:] @ qq)
    norm_p = _column_norms(p)
    p = p / torch.where(norm_p == 0, 1.0, norm_p)
    ax = a @ x
    theta = ritz[:, :k]
    r = ax - theta[:, None, :] * x
    residual = _column_norms(r)[:, 0]
    reltol = (_column_norms(ax)[:, 0] + theta) * n * 10
    converged = torch.sum(residual < tol * reltol, dim=-1)
    return theta, x, p, r, converged


def lobpcg_top_k(a: torch.Tensor, k: int, max_iterations: int) -> TopK:
    """The top-k eigenpairs of each symmetric row of ``a`` ``[B, n, n]`` (n > 5k) by at most
    ``max_iterations`` steps (reference ``lobpcg_top_k``, row by row).

    Starts from X = the first k unit vectors (orthonormalized) and P = k
    more orthonormal directions; each step projects the residuals
    ``R = A X - X diag(theta)`` out of [X, P], solves the Rayleigh-Ritz
    problem on [X, P, R], takes the top k Ritz vectors as X and their
    component along [P, R] (orthonormalized) as P. A row stops once every
    pair has ``|A x - theta x| < eps * 10 n (|A x| + theta)`` (eps: the
    dtype's).
    """
    batch, n = a.shape[0], a.shape[-1]
    if not 0 < 5 * k < n:
        raise ValueError(f"LOBPCG needs 0 < 5 k < n; got k = {k}, n = {n}")
    tol = float(torch.finfo(a.dtype).eps)
    start = _orthonormalize(torch.eye(n, k, dtype=a.dtype, device=a.device)[None])[0]
    x = start.expand(batch, n, k).clone()
    p = _extend_basis(start, k).expand(batch, n, k).clone()
    ax = a @ x
    theta = torch.sum(x * ax, dim=-2)
    r = ax - theta[:, None, :] * x
    iterations = torch.zeros(batch, dtype=torch.int64, device=a.device)
    running = torch.ones(batch, dtype=torch.bool, device=a.device)
    for _ in range(max_iterations):
        rows = running.nonzero().squeeze(1)  # host sync: the rows whose loop goes on
        if rows.numel() == 0:
            break
        if rows.numel() == batch:
            theta, x, p, r, converged = _step(a, x, p, r, tol)
        else:  # step only the running rows: a finished row's loop has ended
            t_, x_, p_, r_, converged = _step(a[rows], x[rows], p[rows], r[rows], tol)
            theta, x, p, r = theta.clone(), x.clone(), p.clone(), r.clone()
            theta[rows], x[rows], p[rows], r[rows] = t_, x_, p_, r_
        iterations[rows] += 1
        running[rows] = converged < k
    return TopK(theta, x, iterations)


def pth_root_difference(w: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, p: int
                        ) -> torch.Tensor:
    """``(w + alpha)^(-1/p) - (w + beta)^(-1/p)`` per row without cancellation (Google's
    form; reference ``pth_root_difference``). ``w``, ``alpha`` ``[B]``, ``beta`` ``[B, k]``.

    With a = w + alpha, b = w + beta and d = alpha - beta:
    ``b^(-1/p) expm1(-log1p(d / b) / p)``, or the same with a and b swapped
    (negated) where that quotient is the smaller.
    """
    e = -1.0 / p

    def difference(z: torch.Tensor) -> torch.Tensor:
        w_, alpha_, beta_ = z[:, :1], z[:, 1:2], z[:, 2:]
        a = w_ + alpha_
        b = w_ + beta_
        d = alpha_ - beta_

        def stable(base: torch.Tensor, diff: torch.Tensor) -> torch.Tensor:
            return torch.pow(base, e) * torch.expm1(e * torch.log1p(diff / base))

        return torch.where((d / b).abs() < (d / a).abs(), -stable(a, -d), stable(b, d))

    # pow, log1p and expm1 one row per call: batch invariance (:mod:`.invariance`).
    return rowwise(difference, torch.cat([w[:, None], alpha[:, None], beta], dim=1))
