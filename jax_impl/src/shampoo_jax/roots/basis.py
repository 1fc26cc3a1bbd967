"""Roots from a factor's stored eigenbasis, eqs. (10f), (10h), (17b), (17c).

- :func:`basis_still_fits`: eq. (17b)'s off-diagonal test of a stored basis;
- :func:`qr_eigendecomposition`, :func:`qr_eigenbasis`: eq. (17c)'s QR steps
  from the stored basis (Meta's QR algorithm);
- :func:`root_inverse_qr`: eq. (10f), eq. (10)'s root from the QR estimate;
- :func:`root_inverse_reusing_basis`: eq. (10h), the stored basis kept while
  it fits, eigh's otherwise.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array, lax

from shampoo_spec import EpsilonConfig

from .eigh import _rank_cutoff, root_from_eigendecomposition
from .regularize import _eye_like, _matmul, all_finite, effective_epsilon, eigh, symmetrize


def basis_still_fits(q: Array, a: Array, eps: EpsilonConfig, tolerance: float) -> Array:
    """Eq. (17b) per matrix: whether ``B = (Q^T (A + eps I)) Q`` has
    ``sqrt(||B||_F^2 - ||diag B||^2) <= tolerance ||B||_F`` (eps of eq. 9 with the
    ridge placement, else 0; False where the difference of squares rounds below
    0, whose root is NaN); shape ``[b]``."""
    b = _rotated(q, a, _ridge(a, eps))
    norm = jnp.sqrt(jnp.sum(b * b, axis=(-2, -1)))
    diag = jnp.sqrt(jnp.sum(jnp.diagonal(b, axis1=-2, axis2=-1) ** 2, axis=-1))
    off = jnp.sqrt(norm**2 - diag**2)
    return off <= tolerance * norm


def _ridge(a: Array, eps: EpsilonConfig) -> Array:
    """Per matrix, the eps added to A before it is rotated into a stored basis (eqs. 10f,
    10h, 17b, 17c): eq. (9)'s with the ridge placement, else 0; shape ``[b]``."""
    if eps.placement == "ridge":
        return effective_epsilon(a, eps)
    return jnp.zeros_like(a[..., 0, 0])


def _rotated(q: Array, a: Array, ridge: Array, eye: Array | None = None) -> Array:
    """``B = (Q^T (A + ridge I)) Q`` per matrix (``ridge`` ``[b]``, :func:`_ridge`; ``eye``
    I like ``a``, built here when None), in the reference's order: A' rotated into the
    stored basis ``q`` (eqs. 10f, 10h, 17b, 17c)."""
    qt = jnp.swapaxes(q, -1, -2)
    return _matmul(_matmul(qt, a + ridge[..., None, None] * (
        _eye_like(a) if eye is None else eye)), q)


def _sorted_by_diagonal(b: Array, q: Array) -> tuple[Array, Array]:
    """Eqs. (10f), (10h), (17c): ``(lambda, Q)``, lambda = diag B ascending (a stable sort)
    and Q's columns in the same order."""
    diag = jnp.diagonal(b, axis1=-2, axis2=-1)
    order = jnp.argsort(diag, axis=-1, stable=True)
    q = jnp.take_along_axis(q, order[..., None, :], axis=-1)
    return jnp.take_along_axis(diag, order, axis=-1), q


def _off_diagonal_fits(b: Array, tolerance: float) -> Array:
    """Eqs. (17b), (17c) per matrix: ``sqrt(||B||_F^2 - ||diag B||^2) <= tolerance ||B||_F``."""
    norm = jnp.sqrt(jnp.sum(b * b, axis=(-2, -1)))
    diag = jnp.sqrt(jnp.sum(jnp.diagonal(b, axis1=-2, axis2=-1) ** 2, axis=-1))
    fits: Array = jnp.sqrt(norm**2 - diag**2) <= tolerance * norm  # NaN compares False
    return fits


def qr_eigenbasis(
    q: Array, a: Array, eps: EpsilonConfig, max_iterations: int, tolerance: float
) -> tuple[Array, Array]:
    """Eq. (17c) per matrix: the eigenbasis of :func:`qr_eigendecomposition`; (Q, ok)."""
    _, q, ok = qr_eigendecomposition(q, a, eps, max_iterations, tolerance)
    return q, ok


def root_inverse_qr(
    q: Array, a: Array, root: float, eps: EpsilonConfig, max_iterations: int, tolerance: float
) -> tuple[Array, Array, Array]:
    """Eq. (10f) per matrix: eq. (10)'s root from the QR estimate ``(lambda, Q')`` of
    :func:`qr_eigendecomposition` from the stored basis ``q``, as reference
    ``linalg.root_inverse_qr``; ``(X, Q', ok)`` (ok: a finite A, B, Q' and X)."""
    lam, q, ok = qr_eigendecomposition(q, a, eps, max_iterations, tolerance)
    a = jnp.where(all_finite(a)[..., None, None], a, _eye_like(a))
    x = root_from_eigendecomposition(lam, q, root, effective_epsilon(a, eps), eps.placement,
                                     _rank_cutoff(a, eps))
    return x, q, ok & all_finite(x)


def qr_eigendecomposition(
    q: Array, a: Array, eps: EpsilonConfig, max_iterations: int, tolerance: float
) -> tuple[Array, Array, Array]:
    """Eqs. (17c), (10f) per matrix: Meta's QR algorithm from the stored eigenbasis ``q``;
    (lambda ascending, Q, ok).

    As reference ``linalg.qr_eigendecomposition``: ``B = (Q^T (A + eps I)) Q`` (eps
    of eq. 9 with the ridge placement, else 0), QR steps ``B = Q' R``,
    ``B <- R Q'``, ``Q <- Q Q'`` while a matrix fails the off-diagonal
    criterion (at most ``max_iterations``, a static count; stopped matrices
    are frozen), then the columns sorted stably by diag B. ``ok`` is False
    for a non-finite A, B or Q.
    """
    eye = _eye_like(a)
    ok = all_finite(a)
    a = jnp.where(ok[..., None, None], a, eye)
    b = _rotated(q, a, _ridge(a, eps), eye)
    ok = ok & all_finite(b)
    b = jnp.where(ok[..., None, None], b, eye)
    # A while loop, not an unrolled one: qr_max_iterations may be up to 10,000.
    # zeros_like: under shard_map the count varies over the mesh axis like b.
    carry = (b, q, ok, jnp.zeros_like(ok, jnp.int32))

    def cond(carry: tuple[Array, Array, Array, Array]) -> Array:
        b, _, running, done = carry
        return jnp.any(running & (done < max_iterations) & ~_off_diagonal_fits(b, tolerance))

    def body(carry: tuple[Array, Array, Array, Array]) -> tuple[Array, Array, Array, Array]:
        b, q, running, done = carry
        running = running & (done < max_iterations) & ~_off_diagonal_fits(b, tolerance)
        step, r = jnp.linalg.qr(b)
        sel = running[..., None, None]
        b = jnp.where(sel, _matmul(r, step), b)
        q = jnp.where(sel, _matmul(q, step), q)
        return b, q, running, done + running.astype(jnp.int32)

    b, q, _, _ = lax.while_loop(cond, body, carry)
    lam, q = _sorted_by_diagonal(b, q)
    return lam, q, ok & all_finite(q)


def root_inverse_reusing_basis(
    q: Array, a: Array, root: float, eps: EpsilonConfig, tolerance: float,
    active: Array | None = None,
) -> tuple[Array, Array, Array]:
    """Eq. (10h) per matrix: eq. (10)'s root from the stored basis ``q`` while it fits, else
    from eigh, as reference ``linalg.root_inverse_reusing_basis``; ``(X, Q', ok)``.

    ``B = (Q^T A') Q`` with A' = A + eps I (``"ridge"``) or A: where B is finite
    and ``sqrt(||B||_F^2 - ||diag B||^2) <= tolerance ||B||_F`` the basis is kept,
    lambda = diag B and Q' = Q, sorted stably by lambda (eq. 10f with no QR step);
    elsewhere eigh of ``sym(A')`` gives lambda and Q' (eq. 10). Then eq. (10)'s
    epsilon rule (or rank cutoff) and ``X = Q' diag(f(lambda)) Q'^T``. ``ok`` is
    False for a non-finite A, Q' or X (eq. 13 then keeps X and Q). ``active``
    as :func:`eigh`'s: a masked matrix need not be decomposed.

    Cost: on CPU eigh runs one matrix at a time and skips (``lax.cond``) the
    matrices that keep their basis; the batched (accelerator) eigh decomposes
    every matrix of the stack and the kept ones' results are discarded, so a
    root step costs there what eq. (10)'s does, plus the rotation into Q.
    """
    eye = _eye_like(a)
    ok = all_finite(a)
    a = jnp.where(ok[..., None, None], a, eye)
    e = effective_epsilon(a, eps)
    ridge = e if eps.placement == "ridge" else jnp.zeros_like(e)
    b = _rotated(q, a, ridge, eye)
    # all_finite: an overflowed B does not fit (it decomposes, as the reference's);
    # the criterion alone may hold for it (inf <= inf at tolerance 1).
    keep = all_finite(b) & _off_diagonal_fits(b, tolerance)
    lam_kept, q_kept = _sorted_by_diagonal(b, q)
    sym = symmetrize(a) + ridge[..., None, None] * eye
    lam_new, q_new = eigh(sym, ~keep if active is None else active & ~keep)
    lam = jnp.where(keep[..., None], lam_kept, lam_new)
    q = jnp.where(keep[..., None, None], q_kept, q_new)
    x = root_from_eigendecomposition(lam, q, root, e, eps.placement, _rank_cutoff(a, eps))
    return x, q, ok & all_finite(q) & all_finite(x)


__all__ = [
    "basis_still_fits",
    "qr_eigenbasis",
    "qr_eigendecomposition",
    "root_inverse_qr",
    "root_inverse_reusing_basis",
]
