"""Eq. (10) by eigendecomposition, with eq. (10b)'s accuracy test.

- :func:`root_inverse_eigh`: eq. (10), every epsilon placement (eq. 10c's low
  rank through :func:`shampoo_jax.roots.sketch.low_rank_eigenvalues`), with
  eq. (10b)'s error test (:func:`eigh_passes`) when
  ``EighConfig.failure_threshold`` is set;
- :func:`root_from_eigendecomposition`: eq. (10)'s ``X = Q diag(f(lambda)) Q^T``
  from any eigendecomposition (eigh's, or the stored bases' of :mod:`.basis`);
- :func:`root_inverse_eigh_stored`: eq. (11b), the root of factors stored in
  bfloat16 or float16;
- :func:`eigenbasis`: the eigenvectors of eq. (17);
- :func:`eigh_for_parameter_cutoff` and :func:`root_at_cutoff`: eq. (10) in
  two halves for eq. (10g), whose rank cutoff needs the largest eigenvalue
  of every block of a parameter before any of its roots is formed;
  :func:`_rank_cutoff` is eq. (10)'s own ``"pseudo_inverse"`` cutoff.

The eigendecomposition call itself is :func:`shampoo_jax.roots.regularize.eigh`.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import Array

from shampoo_spec import EighConfig, EpsilonConfig, ShampooConfig

from .regularize import (
    _eye_like,
    _matmul,
    all_finite,
    eigh,
    regularized_eigenvalues,
    rounded,
    symmetrize,
)
from .sketch import low_rank_eigenvalues


def _rank_cutoff(a: Array, eps: EpsilonConfig) -> tuple[float, float] | None:
    """``(rtol, atol)`` of ``"pseudo_inverse"`` for the stack ``a`` (eq. 10); else None."""
    if not eps.pseudo_inverse:
        return None
    dtype = "float64" if a.dtype == jnp.float64 else "float32"
    return eps.rank_cutoff_rtol(a.shape[-1], dtype), eps.rank_atol


def root_inverse_eigh(
    a: Array, root: float, eps: Array, placement: str, active: Array | None = None,
    failure_threshold: float | None = None, rank: tuple[float, float] | None = None,
    low_rank: tuple[int, str] | None = None,
) -> tuple[Array, Array | None]:
    """Eq. (10): ``X = Q diag(lambda'^(-1/root)) Q^T`` for each matrix (``active``: see eigh).

    Returns ``(X, passes)``: ``passes`` is eq. (10b)'s test of the
    eigendecomposition's error on B (``A + eps I`` for the ridge placements,
    else A) against ``failure_threshold`` (``fl32(tau)``); None without one.
    ``rank``: ``(rtol, atol)`` of ``"pseudo_inverse"`` (:func:`inverse_root_eigenvalues`);
    ``low_rank``: ``(rank, keep)`` of eq. (10c) (:func:`low_rank_eigenvalues`).
    """
    a = symmetrize(a)
    if placement in ("ridge", "ridge_floor"):
        a = a + eps[..., None, None] * _eye_like(a)
    lam, q = eigh(a, active)
    passes = eigh_passes(a, lam, q, failure_threshold)
    return root_from_eigendecomposition(lam, q, root, eps, placement, rank, low_rank), passes


def eigh_error(b: Array, lam: Array, q: Array) -> Array:
    """Eq. (10b) per matrix: ``e = max_ij |(Q^T B Q - diag(lambda))_ij|``, shape ``[b]``.

    The products in Google's order, ``Q^T (B Q)``, as reference ``linalg.eigh_error``.
    """
    recovered = _matmul(jnp.swapaxes(q, -1, -2), _matmul(b, q))
    diag = lam[..., :, None] * _eye_like(b)
    return jnp.max(jnp.abs(recovered - diag), axis=(-2, -1))


def eigh_passes(b: Array, lam: Array, q: Array, threshold_float32: float | None) -> Array | None:
    """Eq. (10b): ``[b]`` bools, False where ``fl32(e) >= fl32(tau)`` or e is NaN.

    ``threshold_float32`` is ``fl32(tau)`` (``EighConfig.failure_threshold_float32``),
    a normal float32 or inf, so no flush to zero can move it. None: no
    threshold, e is not computed and None is returned (nothing traced).
    """
    if threshold_float32 is None:
        return None
    error32 = eigh_error(b, lam, q).astype(jnp.float32)  # overflow rounds to inf: fails
    tau = jnp.asarray(threshold_float32, jnp.float32)
    passes: Array = error32 < tau  # NaN compares False
    return passes


def root_from_eigendecomposition(
    lam: Array, q: Array, root: float, eps: Array, placement: str,
    rank: tuple[float, float] | None = None, low_rank: tuple[int, str] | None = None,
) -> Array:
    """Eq. (10)'s ``X = Q diag(lambda'^(-1/root)) Q^T`` per matrix from ``B = Q diag(lambda)
    Q^T`` (lambda ascending, ``eps`` eq. 9's per matrix): eigh's, or eq. (10f)'s QR
    estimate (:func:`root_inverse_qr`)."""
    lam = regularized_eigenvalues(lam, eps, placement)
    values = inverse_root_eigenvalues(lam, root, rank)
    if low_rank is not None:
        values = low_rank_eigenvalues(values, low_rank)
    x: Array = _matmul(q * values[..., None, :], jnp.swapaxes(q, -1, -2))
    return x


def inverse_root_eigenvalues(
    lam: Array, root: float, rank: tuple[float, float] | None
) -> Array:
    """``lambda'^(-1/root)`` of eq. (10) (ascending ``lam``); with ``rank = (rtol, atol)``
    (``"pseudo_inverse"``) 0 at or below ``max(rtol * max(lambda_max, 0), atol)``."""
    if rank is None:
        powered: Array = lam ** (-1.0 / root)
        return powered
    rtol, atol = rank
    cutoff = jnp.maximum(rtol * jnp.maximum(lam[..., -1:], 0.0), atol)
    return cut_eigenvalues(lam, root, cutoff)


def cut_eigenvalues(lam: Array, root: float, cutoff: Array) -> Array:
    """``"pseudo_inverse"``'s ``lambda^(-1/root)``, 0 at or below ``cutoff`` (broadcast
    against ``lam``): eq. (10)'s own cutoff, or eq. (10g)'s shared one."""
    kept = lam > cutoff
    # The inner where keeps a cut eigenvalue (zero or negative) out of the power,
    # where it would give inf or NaN: discarded, but jax_debug_nans would stop on it.
    return jnp.where(kept, jnp.where(kept, lam, 1.0) ** (-1.0 / root), 0.0)


def root_inverse_eigh_stored(
    a: Array, root: float, eps: EpsilonConfig, work: Any, active: Array | None = None,
) -> Array:
    """Eq. (11b) for a stack of factors stored in s (bfloat16 or float16), in s.

    Meta's steps, each computed in float32 (torch's s kernels) and rounded to s
    behind :func:`rounded`'s barrier: the ridge ``A + round_s(eps) I``, the
    eigendecomposition in ``work`` (the factor dtype; Meta's float64 retry) with
    lambda and Q rounded to s, the shift by each matrix's smallest eigenvalue m
    and the epsilon (``"ridge"``: only where ``m < eps``; ``"shift_after"``: by
    ``min(m, 0)``, then ``+ round_s(eps)``), the power with the exponent rounded
    to s, the column scaling, and ``(Q diag(x)) Q^T`` summed in ``work``, rounded
    to s, its upper triangle mirrored (Meta stores the root packed).
    """
    s = a.dtype
    f32 = jnp.float32
    e = jnp.asarray(eps.value, s).astype(f32)  # round_s(eps)
    if eps.placement == "ridge":
        a = rounded(a.astype(f32) + e * _eye_like(a).astype(f32), s)
    lam, q = eigh(a.astype(work), active)
    lam, q = rounded(lam, s), rounded(q, s)
    m = lam[..., :1].astype(f32)  # ascending: the smallest eigenvalue of each matrix
    lam32 = lam.astype(f32)
    if eps.placement == "ridge":
        shifted = rounded(rounded(lam32 - m, s).astype(f32) + e, s)
        lam = jnp.where(m.astype(jnp.float64 if work == jnp.float64 else f32) < eps.value,
                        shifted, lam)
    else:  # "shift_after"
        lam = rounded(jnp.where(m < 0, rounded(lam32 - m, s).astype(f32), lam32) + e, s)
    exponent = float(np.asarray(-1.0 / root, np.float32).astype(s))  # round_s, via float32
    x = rounded(lam.astype(f32) ** exponent, s)
    scaled = rounded(q.astype(f32) * x.astype(f32)[..., None, :], s)
    full = rounded(_matmul(scaled.astype(work), jnp.swapaxes(q, -1, -2).astype(work)), s)
    upper = jnp.triu(full)
    out: Array = upper + jnp.swapaxes(jnp.triu(full, 1), -1, -2)
    return out


def eigenbasis(
    a: Array, active: Array | None = None, failure_threshold: float | None = None
) -> tuple[Array, Array | None]:
    """Eq. (17): orthonormal eigenvectors (columns, ascending eigenvalues), and eq. (10b)'s
    ``passes`` on ``B = sym(A)`` as :func:`root_inverse_eigh`."""
    b = symmetrize(a)
    lam, q = eigh(b, active)
    return q, eigh_passes(b, lam, q, failure_threshold)


def eigh_for_parameter_cutoff(
    a: Array, config: ShampooConfig, active: Array | None = None
) -> tuple[Array, Array, Array, Array]:
    """Eq. (10g), first half, for one stack of factors: ``(lambda, Q, ok, finite)``.

    Eq. (10)'s eigendecomposition ``sym(A) = Q diag(lambda) Q^T`` (lambda
    ascending, placement ``"pseudo_inverse"``: no ridge) exactly as
    :func:`compute_inverse_root` makes it, with ``ok`` its checks so far (A
    finite, eq. 10b's error test when ``EighConfig.failure_threshold`` is set)
    and ``finite`` whether A is finite. The cutoff is not known yet: it needs
    lambda_max of every block of the parameter (:func:`root_at_cutoff` then).
    A non-finite A is decomposed as the identity; ``active`` as :func:`eigh`.
    """
    finite = all_finite(a)
    a = jnp.where(finite[..., None, None], a, _eye_like(a))
    method = config.root_inverse
    tau = method.failure_threshold_float32 if isinstance(method, EighConfig) else None
    b = symmetrize(a)
    lam, q = eigh(b, active)
    passes = eigh_passes(b, lam, q, tau)
    ok = finite if passes is None else finite & passes
    return lam, q, ok, finite


def root_at_cutoff(lam: Array, q: Array, ok: Array, root: float, cutoff: Array
                   ) -> tuple[Array, Array]:
    """Eq. (10g), second half: ``X = Q diag(lambda'^(-1/root)) Q^T`` with eigenvalues at
    or below ``cutoff`` (``[b]``, eq. 10g's c per matrix) given a zero inverse root;
    ``(X, ok)``, ``ok`` also False where X is not finite (eq. 13)."""
    values = cut_eigenvalues(lam, root, cutoff[..., None])
    x: Array = _matmul(q * values[..., None, :], jnp.swapaxes(q, -1, -2))
    return x, ok & all_finite(x)


__all__ = [
    "cut_eigenvalues",
    "eigenbasis",
    "eigh_error",
    "eigh_for_parameter_cutoff",
    "eigh_passes",
    "inverse_root_eigenvalues",
    "root_at_cutoff",
    "root_from_eigendecomposition",
    "root_inverse_eigh",
    "root_inverse_eigh_stored",
]
