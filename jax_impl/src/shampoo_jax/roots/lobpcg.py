"""Eq. (11d)'s top-k eigenpairs, batched: LOBPCG as Google's deflated Newton root runs it.

Google's ``lobpcg_topk_precondition`` calls
``jax.experimental.sparse.linalg.lobpcg_standard(A, X0, m)`` (Knyazev's
locally optimal block preconditioned conjugate gradient, without
preconditioner) from X0 = the first k unit vectors. After m iterations the
answer is the Rayleigh-Ritz approximation on a subspace that depends on
every choice the routine makes, so this module is a line-by-line port of
that routine (jax 0.10.2), as ``shampoo_reference.roots.lobpcg`` is in NumPy:
iteration i maximizes the Rayleigh quotient over span(X_i, P_i, R_i), the
current Ritz vectors, the previous step's direction and the residuals
``A X - X diag(theta)``.

A port rather than the call, because ``lobpcg_standard`` starts its
``while_loop`` from constants (the iteration and convergence counters,
X0): inside ``jax.shard_map`` (the sharded state, :mod:`shampoo_jax.sharded`) the loop
then carries values that do not vary over the mesh axis into ones that
do, which ``shard_map`` refuses. Here every carried value is built from
the factor. The per-matrix function equals ``lobpcg_standard`` bit for bit
(tests/test_deflation.py); :func:`lobpcg_top_k` maps it over a stack, each
factor stopping at its own iteration.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array, lax

_HIGHEST = lax.Precision.HIGHEST


class TopK(NamedTuple):
    """LOBPCG's answer per matrix: Ritz values theta ``[b, k]`` (descending), Ritz
    vectors ``[b, n, k]``, iterations ``[b]``."""

    values: Array
    vectors: Array
    iterations: Array


def _mm(a: Array, b: Array) -> Array:
    return lax.dot(a, b, precision=(_HIGHEST, _HIGHEST))


def _column_norms(x: Array) -> Array:
    norms: Array = jnp.linalg.norm(x, ord=2, axis=0, keepdims=True)
    return norms


def _eigh_descending(a: Array) -> tuple[Array, Array]:
    w, v = jnp.linalg.eigh(a)
    return w[::-1], v[:, ::-1]


def _svqb(x: Array) -> Array:
    """An orthonormal basis of span(x) from the eigendecomposition of its Gram matrix.

    Columns are normalized first; directions whose Gram eigenvalue is at or
    below eps times the largest are dropped (their columns set to 0), as is
    every column that was 0.
    """
    norms = _column_norms(x)
    x = x / jnp.where(norms == 0, 1.0, norms)
    inner = _mm(x.T, x)
    w, v = _eigh_descending(inner)
    tau = jnp.finfo(x.dtype).eps * w[0]
    # tau = 0: x was all zeros (nothing to scale).
    sqrted = jnp.where(tau > 0, jnp.maximum(w, tau), 1.0) ** (-0.5)
    ortho = _mm(x, v * sqrted[jnp.newaxis, :])
    # As JAX's: the i-th eigenvalue is paired with the i-th column's Gram diagonal.
    keep = ((w > tau) * (jnp.diag(inner) > 0.0))[jnp.newaxis, :]
    ortho = ortho * keep.astype(ortho.dtype)
    norms = _column_norms(ortho)
    keep = keep * (norms > 0.0)
    out: Array = ortho / jnp.where(keep, norms, 1.0)
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
        u = u - _mm(basis, _mm(basis.T, u))
        u = _orthonormalize(u)
    for _ in range(2):
        u = u - _mm(basis, _mm(basis.T, u))
    out: Array = u * (_column_norms(u) >= 0.99).astype(u.dtype)
    return out


def _extend_basis(x: Array, m: int) -> Array:
    """m orthonormal columns orthogonal to the orthonormal x (a block Householder reflector
    H(w) with ``H(w) X = [-U V^T; 0]``: H(w)'s columns k..k+m-1)."""
    n, k = x.shape
    upper, lower = x[:k], x[k:]
    u, s, vt = jnp.linalg.svd(upper)
    y = jnp.concatenate([upper + _mm(u, vt), lower], axis=0)
    other = jnp.concatenate(
        [jnp.eye(m, dtype=x.dtype), jnp.zeros((n - k - m, m), dtype=x.dtype)], axis=0)
    w = _mm(y, vt.T * ((2 * (1 + s)) ** (-1 / 2))[jnp.newaxis, :])
    h = -2 * jnp.linalg.multi_dot([w, w[k:, :].T, other], precision=_HIGHEST)
    out: Array = h.at[k:].add(other)
    return out


# The loop's state: iteration, X, P, R, converged count, theta [1, k].
_Carry = tuple[Array, Array, Array, Array, Array, Array]


def top_k_one(a: Array, k: int, max_iterations: int, active: Array | None = None
              ) -> tuple[Array, Array, Array]:
    """The top-k eigenpairs of one symmetric ``a`` (n > 5k) by at most ``max_iterations``
    LOBPCG steps: ``(theta [k] descending, V [n, k], iterations)``.

    ``lobpcg_standard(a, [I_k; 0], max_iterations)``: X = the first k unit
    vectors orthonormalized, P = k more orthonormal directions; each step
    projects the residuals out of [X, P], solves the Rayleigh-Ritz problem
    on [X, P, R], takes the top k Ritz vectors as X and their component
    along [P, R] (orthonormalized) as P. Stops early once every pair has
    ``|A x - theta x| < eps * 10 n (|A x| + theta)`` (eps: a's dtype's).
    ``active`` False: no step (the caller discards the result).
    """
    n = a.shape[-1]
    if not 0 < 5 * k < n:
        raise ValueError(f"LOBPCG needs 0 < 5 k < n; got k = {k}, n = {n}")
    dt = a.dtype
    tol = float(jnp.finfo(dt).eps)
    # Every carried value is built from a: under shard_map it then varies
    # over the mesh axis as a does (while_loop needs equal carry types).
    zero = jnp.zeros_like(a[0, 0])
    start = jnp.concatenate([jnp.eye(k, dtype=dt), jnp.zeros((n - k, k), dtype=dt)]) + zero
    x = _orthonormalize(start)
    p = _extend_basis(x, k)
    ax = _mm(a, x)
    theta = jnp.sum(x * ax, axis=0, keepdims=True)
    r = ax - theta * x
    count = jnp.zeros_like(zero, jnp.int32)
    # An inactive matrix starts "converged": the loop leaves it as it is.
    converged = count if active is None else jnp.where(active, count, k)

    def cond(state: _Carry) -> Array:
        i, _, _, _, converged, _ = state
        return jnp.logical_and(i < max_iterations, converged < k)

    def body(state: _Carry) -> _Carry:
        i, x, p, r, _, theta = state
        r = _project_out(jnp.concatenate((x, p), axis=1), r)
        xpr = jnp.concatenate((x, p, r), axis=1)
        ritz, q = _eigh_descending(_mm(xpr.T, _mm(a, xpr)))  # the Rayleigh-Ritz problem
        b = q[:, :k]
        b = b / _column_norms(b)
        x = _mm(xpr, b)
        x = x / _column_norms(x)
        # The new direction: the Ritz vectors' component outside the old X,
        # orthogonalized in the Ritz basis (exactly orthonormal after xpr).
        qq, _ = jnp.linalg.qr(q[:k, k:].T)
        p = _mm(xpr, _mm(q[:, k:], qq))
        norm_p = _column_norms(p)
        p = p / jnp.where(norm_p == 0, 1.0, norm_p)
        ax = _mm(a, x)
        r = ax - ritz[jnp.newaxis, :k] * x
        residual = jnp.linalg.norm(r, ord=2, axis=0)
        reltol = (jnp.linalg.norm(ax, ord=2, axis=0) + ritz[:k]) * n * 10
        converged = jnp.sum(residual < tol * reltol).astype(jnp.int32)
        return i + 1, x, p, r, converged, ritz[jnp.newaxis, :k]

    i, x, _, _, _, theta = lax.while_loop(cond, body, (count, x, p, r, converged, theta))
    return theta[0, :], x, i


def lobpcg_top_k(a: Array, k: int, max_iterations: int, active: Array | None = None) -> TopK:
    """:func:`top_k_one` for each symmetric matrix of the stack ``a`` ``[b, n, n]``.

    On CPU one matrix at a time (``lax.map``), for the reason of
    ``regularize.eigh``: each step's eigendecomposition would otherwise be a
    batched LAPACK call, which jaxlib spreads over the thread pool. Elsewhere
    ``jax.vmap``: a matrix whose loop has stopped keeps its state (the
    batched while_loop selects) while the others go on, so each gets its
    own result either way. ``active`` ``[b]`` (optional): matrices the
    caller discards take no step.
    """
    def one(args: tuple[Array, Array | None]) -> tuple[Array, Array, Array]:
        return top_k_one(args[0], k, max_iterations, args[1])

    operands = (a, active)
    if a.shape[0] > 1 and jax.default_backend() == "cpu":
        values, vectors, iterations = lax.map(one, operands)
    else:
        values, vectors, iterations = jax.vmap(one)(operands)
    return TopK(values, vectors, iterations)


def pth_root_difference(w: Array, alpha: Array, beta: Array, p: int) -> Array:
    """``(w + alpha)^(-1/p) - (w + beta)^(-1/p)`` without cancellation (Google's form).

    With a = w + alpha, b = w + beta and d = alpha - beta:
    ``b^(-1/p) expm1(-log1p(d / b) / p)``, or the same with a and b swapped
    (negated) where that quotient is the smaller. Broadcasts (``w``,
    ``alpha``: ``[b, 1]`` against ``beta`` ``[b, k]``).
    """
    a = w + alpha
    b = w + beta
    d = alpha - beta
    e = -1.0 / p

    def stable(base: Array, diff: Array) -> Array:
        out: Array = (base ** e) * jnp.expm1(e * jnp.log1p(diff / base))
        return out

    return jnp.where(jnp.abs(d / b) < jnp.abs(d / a), -stable(a, -d), stable(b, d))


__all__ = ["TopK", "lobpcg_top_k", "pth_root_difference", "top_k_one"]
