"""Eq. (11d)'s top-k eigenpairs: LOBPCG as Google's deflated Newton root runs it.

Google's ``lobpcg_topk_precondition`` calls JAX's
``jax.experimental.sparse.linalg.lobpcg_standard`` (Knyazev's locally
optimal block preconditioned conjugate gradient, without preconditioner)
for at most m iterations from the first k unit vectors. Its answer after m
iterations is the Rayleigh-Ritz approximation on a subspace that depends on
every choice the routine makes (the start, the first search directions,
the orthonormalization and the truncation of near-dependent directions), so
the result equals Google's only when those choices are the same: this
module makes them in JAX's order (jax/experimental/sparse/linalg.py, as of
jax 0.10.2). Mathematically, iteration i maximizes the Rayleigh quotient
over span(X_i, P_i, R_i): the current Ritz vectors, the previous step's
direction and the residuals A X - X diag(theta).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

Array = NDArray[np.float64]


class TopK(NamedTuple):
    """LOBPCG's answer: Ritz values theta (k, descending), Ritz vectors (n x k), iterations."""

    values: Array
    vectors: Array
    iterations: int


def _column_norms(x: Array) -> Array:
    norms: Array = np.sqrt(np.sum(x * x, axis=0, keepdims=True))
    return norms


def _eigh_descending(a: Array) -> tuple[Array, Array]:
    w, v = np.linalg.eigh(a)
    return w[::-1], v[:, ::-1]


def _svqb(x: Array) -> Array:
    """An orthonormal basis of span(x) from the eigendecomposition of its Gram matrix.

    Columns are normalized first; directions whose Gram eigenvalue is below
    eps times the largest are dropped (their columns set to 0), as is
    every column that was 0.
    """
    norms = _column_norms(x)
    x = x / np.where(norms == 0, 1.0, norms)
    inner = x.T @ x
    w, v = _eigh_descending(inner)
    tau = np.finfo(x.dtype).eps * w[0]
    sqrted = np.where(tau > 0, np.maximum(w, tau), 1.0) ** -0.5
    ortho = x @ (v * sqrted[np.newaxis, :])
    # JAX pairs the i-th eigenvalue with the i-th column's Gram diagonal here.
    keep = ((w > tau) & (np.diag(inner) > 0.0))[np.newaxis, :]
    ortho = ortho * keep
    norms = _column_norms(ortho)
    keep = keep & (norms > 0.0)
    out: Array = ortho / np.where(keep, norms, 1.0)
    return out


def _orthonormalize(x: Array) -> Array:
    return _svqb(_svqb(x))  # twice is enough (Kahan)


def _project_out(basis: Array, u: Array) -> Array:
    """The part of u orthogonal to the orthonormal ``basis``, orthonormalized.

    Columns that do not keep 99% of their norm through the last two
    subtractions are dropped: near convergence the residuals are rounding
    noise, and normalizing noise would reintroduce the basis.
    """
    for _ in range(2):
        u = u - basis @ (basis.T @ u)
        u = _orthonormalize(u)
    for _ in range(2):
        u = u - basis @ (basis.T @ u)
    return u * (_column_norms(u) >= 0.99)


def _extend_basis(x: Array, m: int) -> Array:
    """m orthonormal columns orthogonal to the orthonormal x (a block Householder reflector)."""
    n, k = x.shape
    upper, lower = x[:k], x[k:]
    u, s, vt = np.linalg.svd(upper)
    y = np.concatenate([upper + u @ vt, lower], axis=0)
    other = np.concatenate([np.eye(m), np.zeros((n - k - m, m))], axis=0)
    w = y @ (vt.T * ((2.0 * (1.0 + s)) ** -0.5)[np.newaxis, :])
    h: Array = -2.0 * (w @ w[k:, :].T @ other)
    h[k:] += other
    return h


def lobpcg_top_k(a: Array, k: int, max_iterations: int) -> TopK:
    """The top-k eigenpairs of the symmetric a (n > 5k) by at most ``max_iterations`` steps.

    Starts from X = the first k unit vectors (orthonormalized) and P = k
    more orthonormal directions; each step projects the residuals out of
    [X, P], solves the Rayleigh-Ritz problem on [X, P, R], takes the top k
    Ritz vectors as X and their component along [P, R] (orthonormalized)
    as P. Stops early once every pair has
    ``|A x - theta x| < eps * 10 n (|A x| + theta)`` (eps: float64's).
    """
    n = a.shape[0]
    if not 0 < 5 * k < n:
        raise ValueError(f"LOBPCG needs 0 < 5 k < n; got k = {k}, n = {n}")
    tol = float(np.finfo(np.float64).eps)
    x = _orthonormalize(np.eye(n, k))
    p = _extend_basis(x, k)
    ax = a @ x
    theta = np.sum(x * ax, axis=0)
    r = ax - theta[np.newaxis, :] * x
    with np.errstate(divide="ignore", invalid="ignore"):  # A = 0: NaN, as JAX's (a failed root)
        return _iterate(a, k, max_iterations, tol, x, p, r, theta)


def _iterate(a: Array, k: int, max_iterations: int, tol: float, x: Array, p: Array, r: Array,
             theta: Array) -> TopK:
    """The LOBPCG steps of :func:`lobpcg_top_k` from (X, P, R, theta)."""
    n = a.shape[0]
    i, converged = 0, 0
    while i < max_iterations and converged < k:
        r = _project_out(np.concatenate([x, p], axis=1), r)
        xpr = np.concatenate([x, p, r], axis=1)
        ritz, q = _eigh_descending(xpr.T @ (a @ xpr))
        b = q[:, :k]
        b = b / _column_norms(b)
        x = xpr @ b
        x = x / _column_norms(x)
        # The new direction: the Ritz vectors' component outside the old X,
        # orthogonalized in the Ritz basis (exactly orthonormal after xpr).
        qq, _ = np.linalg.qr(q[:k, k:].T)
        p = xpr @ (q[:, k:] @ qq)
        norm_p = _column_norms(p)
        p = p / np.where(norm_p == 0, 1.0, norm_p)
        ax = a @ x
        theta = ritz[:k]
        r = ax - theta[np.newaxis, :] * x
        residual = np.sqrt(np.sum(r * r, axis=0))
        reltol = (np.sqrt(np.sum(ax * ax, axis=0)) + theta) * n * 10
        converged = int(np.sum(residual < tol * reltol))
        i += 1
    return TopK(theta, x, i)


def pth_root_difference(w: float, alpha: float, beta: Array, p: int) -> Array:
    """``(w + alpha)^(-1/p) - (w + beta)^(-1/p)`` without cancellation (Google's form).

    With a = w + alpha, b = w + beta and d = alpha - beta:
    ``b^(-1/p) expm1(-log1p(d / b) / p)``, or the same with a and b swapped
    (negated) where that quotient is the smaller.
    """
    a = w + alpha
    b = w + beta
    d = alpha - beta
    e = -1.0 / p

    def stable(base: Array | float, diff: Array) -> Array:
        return np.asarray((base ** e) * np.expm1(e * np.log1p(diff / base)))

    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(np.abs(d / b) < np.abs(d / a), -stable(a, -d), stable(b, d))
