"""Compressed roots, eqs. (10c), (10d), (10e).

- :class:`Sketch`, :func:`select_sketch`: a factor's frequent-directions
  sketch (eq. 10d), per block of a group;
- :func:`low_rank_eigenvalues`: eq. (10c)'s ``compression_rank``;
- :func:`sketch_epsilon`, :func:`frequent_directions_root`: eq. (10d), a
  sketched factor's observation folded into its sketch, and the sketch's
  inverse root;
- :func:`tearfree_sketch_root`: eq. (10e), tearfree's Sketchy.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import Array

from shampoo_spec import EpsilonConfig

from .. import blocks as B
from .regularize import _eye_like, _matmul, all_finite, eigh, symmetrize


class Sketch(NamedTuple):
    """Eq. (10d): the frequent-directions sketch of one factor of every block of a group.

    ``u`` ``[nb, n, r]`` (orthonormal or zero columns), ``lam`` ``[nb, r]``
    (descending, >= 0) and the tail ``rho`` ``[nb]``, all 0 at first, in
    :func:`shampoo_jax.state.factor_dtype`; r is ``frequent_directions.sketch_rank(n)``
    (``rank``; eq. 10e: ``min(n, rank)``).
    """

    u: Array
    lam: Array
    rho: Array


def select_sketch(flags: Array | bool, new: Sketch, old: Sketch) -> Sketch:
    """Per block (``flags`` ``[nb]``, or one Python bool for all): ``new`` where True, else
    ``old``."""
    if flags is True:
        return new
    if flags is False:
        return old
    return Sketch(*(jnp.where(B.expand(jnp.asarray(flags), a), a, b)
                    for a, b in zip(new, old, strict=True)))



def low_rank_eigenvalues(x: Array, low_rank: tuple[int, str]) -> Array:
    """Eq. (10c) per matrix of ``x`` [..., n] (ascending eigenvalues of B): keep ``rank``
    of the largest (``keep="largest"``) or smallest; every other one becomes their mean."""
    rank, keep = low_rank
    n = x.shape[-1]
    index = jnp.arange(n)
    kept = index >= n - rank if keep == "largest" else index < rank
    c = jnp.sum(jnp.where(kept, 0.0, x), axis=-1, keepdims=True) / (n - rank)
    return jnp.where(kept, x, c)


def sketch_epsilon(lam: Array, eps: EpsilonConfig, relative_floor: float) -> Array:
    """Eq. (10d)'s eps_t per sketch: ``eps.value``, times ``max(lambda_1, relative_floor)``
    with ``eps.scale = "relative"`` (``lam`` ``[b, r]`` descending: lambda_1 its first);
    shape ``[b]``."""
    if eps.scale == "absolute":
        return jnp.full_like(lam[..., 0], eps.value)
    out: Array = eps.value * jnp.maximum(lam[..., 0], relative_floor)
    return out


def _folded_spectrum(u: Array, values: Array, c: Array, beta: float, rtol: float,
                     active: Array | None) -> tuple[Array, Array, Array]:
    """The decomposition eqs. (10d) and (10e) share, per matrix: ``M = beta U
    diag(values) U^T + C``, its eigenvalues sigma descending (with their eigenvectors),
    those at most ``rtol sigma_1`` set to 0; and whether M is finite (a non-finite M
    is decomposed as I). ``active``: as :func:`eigh`."""
    scaled = beta * (u * values[..., None, :])
    m = symmetrize(_matmul(scaled, jnp.swapaxes(u, -1, -2)) + c)
    finite = all_finite(m)
    sigma, v = eigh(jnp.where(finite[..., None, None], m, _eye_like(m)), active)
    sigma, v = sigma[..., ::-1], v[..., ::-1]  # descending
    sigma = jnp.where(sigma > rtol * jnp.maximum(sigma[..., :1], 0.0), sigma, 0.0)
    return sigma, v, finite


def frequent_directions_root(
    sketch: Sketch, c: Array, root: float, beta: float, eps: Array, rtol: float,
    active: Array | None = None,
) -> tuple[Sketch, Array, Array]:
    """Eq. (10d) per matrix: fold the observation ``c`` (eq. 6c) into ``sketch``: (sketch', X, ok).

    As reference ``linalg.frequent_directions_root``, in its order of operations::

        M = beta U diag(lambda + eps) U^T + C,   V diag(sigma) V^T = eigh(sym M) (descending)
        sigma_i <- 0 where sigma_i <= rtol max(sigma_1, 0)
        lambda' = sigma_1..r - sigma_{r+1},  U' = V_1..r,  rho' = max(beta rho + sigma_{r+1}, 0)
        U'_i, lambda'_i <- 0 where lambda'_i <= 0
        X = U' diag((sigma_1..r + beta rho)^(-1/p)) U'^T + rho'^(-1/p) (I - U' U'^T)

    (``sigma_i + beta rho`` is ``lambda'_i + rho'``, formed as Google does),
    and X = I where some lambda'_i or rho' is 0 (Google's ``has_zeros``).
    ``rtol``: eq. (10d)'s zero cutoff, ``n eps_f``
    (``FrequentDirectionsConfig.zero_rtol``): eigenvalues that small are
    the rounding noise of M's null space, and counting them as 0 makes a
    sketch of rank <= r give X = I whatever the noise's sign.
    ``eps`` ``[b]``: eq. (10d)'s eps_t (:func:`sketch_epsilon`); ``active``:
    as :func:`eigh`. ``ok`` is False for a non-finite X or M (eq. 13: the
    caller keeps the previous X); a non-finite M (which eq. 3's bounds keep
    out) also keeps ``sketch`` as it came, so the stored state stays finite.
    """
    rank = sketch.u.shape[-1]
    sigma, v, finite = _folded_spectrum(sketch.u, sketch.lam + eps[..., None], c, beta, rtol,
                                        active)
    eye = _eye_like(c)
    cut = sigma[..., rank]
    decayed = beta * sketch.rho
    rho = jnp.maximum(decayed + cut, 0.0)
    lam = sigma[..., :rank] - cut[..., None]
    kept = lam > 0
    lam = jnp.where(kept, lam, 0.0)
    u = v[..., :rank] * kept[..., None, :].astype(v.dtype)
    has_zeros = ~jnp.all(kept, axis=-1) | (rho <= 0)
    # Where has_zeros the powers may be inf or NaN (rho' = 0): discarded by the where.
    x = (sigma[..., :rank] + decayed[..., None]) ** (-1.0 / root)
    const = rho ** (-1.0 / root)
    x = _matmul(u * (x - const[..., None])[..., None, :], jnp.swapaxes(u, -1, -2))
    x = jnp.where(has_zeros[..., None, None], eye, x + const[..., None, None] * eye)
    new = select_sketch(finite, Sketch(u, lam, rho), sketch)
    return new, x, finite & all_finite(x)


def tearfree_sketch_root(
    sketch: Sketch, c: Array, root: float, beta: float, epsilon: float, relative: bool,
    rtol: float, active: Array | None = None,
) -> tuple[Sketch, Array, Array]:
    """Eq. (10e), tearfree's Sketchy, per matrix: fold ``c`` (eq. 6c) into ``sketch``:
    (sketch', X, ok).

    As reference ``linalg.tearfree_sketch_root``, in its order of operations
    (U ``[b, n, k]``, k = min(n, rank))::

        M = beta U diag(lambda) U^T + C,  V diag(sigma) V^T = eigh(sym M) (descending)
        sigma_i <- 0 where sigma_i <= rtol max(sigma_1, 0);  cut = sigma_{k+1} (0 if k = n)
        lambda' = sigma_1..k - cut,  U' = V_1..k,  rho' = sqrt(beta) rho + cut
        U'_i, lambda'_i <- 0 where lambda'_i <= 0
        eps = epsilon (sigma_1 + sqrt(beta) rho)  (relative, epsilon > 0), else epsilon
        X = U' diag((sigma_1..k + sqrt(beta) rho + eps)^(-1/p)) U'^T + t (I - U' U'^T),
        t = (rho' + eps)^(-1/p), 0 where rho' = 0

    ``ok`` is False for a non-finite X or M (eq. 13); a non-finite M keeps
    ``sketch`` as it came. ``active``: as :func:`eigh`.
    """
    n, k = sketch.u.shape[-2], sketch.u.shape[-1]
    sigma, v, finite = _folded_spectrum(sketch.u, sketch.lam, c, beta, rtol, active)
    eye = _eye_like(c)
    cut = sigma[..., k] if k < n else jnp.zeros_like(sigma[..., 0])
    decayed = jnp.sqrt(jnp.asarray(beta, sigma.dtype)) * sketch.rho
    lam = sigma[..., :k] - cut[..., None]
    rho = decayed + cut
    kept = lam > 0
    lam = jnp.where(kept, lam, 0.0)
    u = v[..., :k] * kept[..., None, :].astype(v.dtype)
    undeflated = sigma[..., :k] + decayed[..., None]
    if relative and epsilon > 0:
        eps = epsilon * jnp.max(undeflated, axis=-1)
    else:
        eps = jnp.full_like(rho, epsilon)
    # Where not kept (or rho' = 0) the power may be inf: discarded by the where.
    x = jnp.where(kept, (undeflated + eps[..., None]) ** (-1.0 / root), 0.0)
    const = jnp.where(rho > 0, (jnp.where(rho > 0, rho, 1.0) + eps) ** (-1.0 / root), 0.0)
    x = _matmul(u * (x - const[..., None])[..., None, :], jnp.swapaxes(u, -1, -2))
    x = x + const[..., None, None] * eye
    new = select_sketch(finite, Sketch(u, lam, rho), sketch)
    return new, x, finite & all_finite(x)


__all__ = [
    "Sketch",
    "frequent_directions_root",
    "low_rank_eigenvalues",
    "select_sketch",
    "sketch_epsilon",
    "tearfree_sketch_root",
]
