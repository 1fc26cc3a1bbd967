"""Batched inverse roots of Kronecker factors, eqs. (9)-(13).

Every function takes a stack of matrices ``a`` of shape ``[b, n, n]`` and
returns per-matrix results plus a per-matrix ``ok`` flag, so one failed
matrix never affects its neighbours and nothing branches in Python on a
traced value. The rules are those of ``shampoo_reference.linalg``:

- :func:`effective_epsilon`: eq. (9), with the exact largest eigenvalue;
- :func:`root_inverse_eigh`: eq. (10), every epsilon placement, with
  eq. (10b)'s error test (:func:`eigh_passes`) when ``EighConfig.failure_threshold``
  is set;
- :func:`root_inverse_coupled_newton`: eq. (11) as a ``lax.while_loop``
  over the whole stack (a matrix stops iterating when it converges, stalls
  or its error grows, while the others go on), then the retries;
- :func:`root_inverse_deflated_newton`: eq. (11d), the same with LOBPCG's
  top-k eigenpairs (:mod:`.lobpcg`) deflated before it and restored after;
- :func:`eigh_for_parameter_cutoff` and :func:`root_at_cutoff`: eq. (10) in
  two halves for eq. (10g), whose rank cutoff needs the largest eigenvalue
  of every block of a parameter before any of its roots is formed;
- :func:`root_inverse_qr` and :func:`root_inverse_reusing_basis`: eq. (10)'s
  root from a factor's stored eigenbasis, after eq. (17c)'s QR steps from it
  (eq. 10f), or kept while it fits and eigh's otherwise (eq. 10h);
- :func:`eigenbasis`: the eigenvectors of eq. (17);
- :func:`compute_inverse_root`: one stack by the configured method (on
  CPU one matrix at a time); a failed or non-finite inverse root is
  reported (eq. 13) so that the caller keeps the previous one;
- :func:`frequent_directions_root`: eq. (10d), a sketched factor's
  observation folded into its sketch, and the sketch's inverse root.

``root`` is always the exponent r of eq. (12); the matrices ``A^(-1/r)``
(or eigenbases) are inverse roots.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from shampoo_spec import (
    CoupledNewtonConfig,
    EighConfig,
    EpsilonConfig,
    HigherOrderNewtonConfig,
    ShampooConfig,
    power_iteration_start,
)

from .lobpcg import lobpcg_top_k, pth_root_difference
from .state import Sketch, select_sketch

_HIGHEST = lax.Precision.HIGHEST


def _matmul(a: Array, b: Array) -> Array:
    return jnp.matmul(a, b, precision=_HIGHEST)


def symmetrize(a: Array) -> Array:
    return 0.5 * (a + jnp.swapaxes(a, -1, -2))


def _eye_like(a: Array) -> Array:
    return jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)


def _identity_like(m: Array) -> Array:
    """The identity of ``m``'s shape and dtype; built from ``m`` so that under
    ``shard_map`` it varies over a mesh axis as ``m`` does (``lax.cond`` branches
    must agree)."""
    return jnp.zeros_like(m) + jnp.eye(m.shape[-1], dtype=m.dtype)


def _one_at_a_time(one: Any, skip: Any, a: Array, active: Array | None) -> tuple[Array, Array]:
    """``one`` over the matrices of the stack ``a`` one at a time (``lax.map``); with
    ``active``, a matrix whose flag is False takes ``skip`` instead (``lax.cond``)."""
    pairs: tuple[Array, Array]
    if active is None:
        pairs = lax.map(one, a)
    else:
        pairs = lax.map(lambda mo: lax.cond(mo[1], one, skip, mo[0]), (a, active))
    return pairs


def _eigh(a: Array, active: Array | None = None) -> tuple[Array, Array]:
    """``jnp.linalg.eigh`` over a stack; on CPU one matrix at a time (``lax.map``).

    jaxlib's CPU kernel spreads a batch over XLA's thread pool and calls the
    (scipy-bundled) OpenBLAS from several threads at once; with a
    multithreaded OpenBLAS that deadlocks on large matrices (jaxlib 0.10.2, 2
    cores). It also deadlocks with one OpenBLAS thread: the kernel waits, on a
    thread of XLA's intra-op pool, for the batch it gave that pool, and when
    independent batched calls run at once on every thread of the pool none can
    finish (Google's tearfree meets it: docs/third-party.md,
    ``batched_cpu_eigh_deadlock``). One matrix per call does not use the pool;
    it is safe and LAPACK still threads inside it.

    ``active`` (``[b]`` bools, optional): on the one-at-a-time path a matrix
    with ``active = False`` is not decomposed (``lax.cond``); it gets
    eigenvalues 1 and the identity as eigenvectors. Its caller discards it:
    a block masked by eq. (3), or a padding block of the sharded state. The
    batched path decomposes every matrix.
    """
    if a.shape[0] > 1 and jax.default_backend() == "cpu":
        def one(m: Array) -> tuple[Array, Array]:
            lam, q = jnp.linalg.eigh(m, symmetrize_input=False)
            return lam, q

        def skip(m: Array) -> tuple[Array, Array]:
            return jnp.ones_like(m[0]), _identity_like(m)

        return _one_at_a_time(one, skip, a, active)
    lam, q = jnp.linalg.eigh(a, symmetrize_input=False)
    return lam, q


def rounded(x: Array, dtype: Any) -> Array:
    """``round_s(x)`` of eqs. (11a), (16): ``x`` in ``dtype``, rounded there for certain.

    XLA may keep a narrow value in wider precision (``xla_allow_excess_precision``,
    on by default): on CPU it computes a bfloat16/float16 dot in float32 and
    then drops a float32 -> bfloat16 -> float32 pair of converts around it, so
    a product would skip its rounding, depending on the batch size and the
    fusion (measured on jax 0.10.2: every entry of a batched matrix-vector
    product). The barrier makes the value in ``dtype`` a real value of the
    program. ``lax.reduce_precision`` would not do: it flushes float16
    subnormals (below 6.1e-5, common gradient entries) to zero.
    """
    y = x.astype(dtype)
    if y.dtype == x.dtype and x.dtype in (jnp.float32, jnp.float64):
        return y  # already in dtype: nothing to round
    out: Array = lax.optimization_barrier(y)
    return out


def all_finite(a: Array) -> Array:
    """Per matrix: are all entries finite? Shape ``[b]``."""
    return jnp.all(jnp.isfinite(a), axis=(-2, -1))


def effective_epsilon(a: Array, eps: EpsilonConfig, active: Array | None = None) -> Array:
    """Eq. (9): ``value``, or ``value * max(lambda_max(A), relative_floor)``; shape ``[b]``."""
    if eps.scale == "absolute":
        return jnp.full_like(a[..., 0, 0], eps.value)  # varies with ``a`` under shard_map
    if eps.lambda_max == "power_iteration":
        lam_max = power_iteration_lambda_max(
            a, eps.power_iteration_steps, eps.power_iteration_tolerance
        )
    else:
        lam_max = _eigh(symmetrize(a), active)[0][..., -1]
    return eps.value * jnp.maximum(lam_max, eps.relative_floor)


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
    as :func:`_eigh`'s: a masked matrix need not be decomposed.

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
    lam_new, q_new = _eigh(sym, ~keep if active is None else active & ~keep)
    lam = jnp.where(keep[..., None], lam_kept, lam_new)
    q = jnp.where(keep[..., None, None], q_kept, q_new)
    x = root_from_eigendecomposition(lam, q, root, e, eps.placement, _rank_cutoff(a, eps))
    return x, q, ok & all_finite(q) & all_finite(x)


def power_iteration_lambda_max(a: Array, steps: int, tolerance: float) -> Array:
    """Eq. (9b) per matrix of ``a`` [..., n, n]: Google's power iteration (its while loop,
    vmapped: a matrix that has stopped keeps its vector and quotient)."""
    n = a.shape[-1]
    start = jnp.asarray(np.asarray(power_iteration_start(n), dtype=np.float64), a.dtype)

    def one(m: Array) -> Array:
        def cond(state: tuple[Array, Array, Array, Array]) -> Array:
            i, _, _, running = state
            return jnp.logical_and(i < steps, running)

        def body(state: tuple[Array, Array, Array, Array]) -> tuple[Array, Array, Array, Array]:
            i, v, s, _ = state
            u = v / jnp.linalg.norm(v)
            w = jnp.einsum("ij,j->i", m, u, precision=lax.Precision.HIGHEST)
            s_new = jnp.einsum("i,i->", u, w, precision=lax.Precision.HIGHEST)
            return i + 1, w, s_new, jnp.abs(s_new - s) > tolerance

        zero = jnp.zeros_like(m[0, 0])  # built from m: varies with it under shard_map
        init = (jnp.zeros((), jnp.int32), start + zero, zero, zero == 0)
        return lax.while_loop(cond, body, init)[2]

    batch = a.shape[:-2]
    flat = a.reshape((-1, n, n))
    return jax.vmap(one)(flat).reshape(batch)


def regularized_eigenvalues(lam: Array, eps: Array, placement: str) -> Array:
    """Eq. (10): eigenvalues after the epsilon rule (``lam`` ascending, ``eps`` per matrix)."""
    lam_min = lam[..., :1]
    e = eps[..., None]
    if placement == "pseudo_inverse":
        return lam  # no epsilon: inverse_root_eigenvalues' rank cutoff instead
    if placement == "ridge":
        return lam + jnp.maximum(0.0, e - lam_min)
    if placement == "shift_after":
        return lam - jnp.minimum(lam_min, 0.0) + e
    return jnp.maximum(lam, e)  # "floor" and "ridge_floor"


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


def low_rank_eigenvalues(x: Array, low_rank: tuple[int, str]) -> Array:
    """Eq. (10c) per matrix of ``x`` [..., n] (ascending eigenvalues of B): keep ``rank``
    of the largest (``keep="largest"``) or smallest; every other one becomes their mean."""
    rank, keep = low_rank
    n = x.shape[-1]
    index = jnp.arange(n)
    kept = index >= n - rank if keep == "largest" else index < rank
    c = jnp.sum(jnp.where(kept, 0.0, x), axis=-1, keepdims=True) / (n - rank)
    return jnp.where(kept, x, c)


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


def root_inverse_eigh(
    a: Array, root: float, eps: Array, placement: str, active: Array | None = None,
    failure_threshold: float | None = None, rank: tuple[float, float] | None = None,
    low_rank: tuple[int, str] | None = None,
) -> tuple[Array, Array | None]:
    """Eq. (10): ``X = Q diag(lambda'^(-1/root)) Q^T`` for each matrix (``active``: see _eigh).

    Returns ``(X, passes)``: ``passes`` is eq. (10b)'s test of the
    eigendecomposition's error on B (``A + eps I`` for the ridge placements,
    else A) against ``failure_threshold`` (``fl32(tau)``); None without one.
    ``rank``: ``(rtol, atol)`` of ``"pseudo_inverse"`` (:func:`inverse_root_eigenvalues`);
    ``low_rank``: ``(rank, keep)`` of eq. (10c) (:func:`low_rank_eigenvalues`).
    """
    a = symmetrize(a)
    if placement in ("ridge", "ridge_floor"):
        a = a + eps[..., None, None] * _eye_like(a)
    lam, q = _eigh(a, active)
    passes = eigh_passes(a, lam, q, failure_threshold)
    return root_from_eigendecomposition(lam, q, root, eps, placement, rank, low_rank), passes


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
    lam, q = _eigh(a.astype(work), active)
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
    lam, q = _eigh(b, active)
    return q, eigh_passes(b, lam, q, failure_threshold)


def matrix_power(a: Array, n: int) -> Array:
    """``a^n`` for a static integer n >= 1, multiplied in numpy.linalg.matrix_power's order."""
    if n == 1:
        return a
    if n == 2:
        return _matmul(a, a)
    if n == 3:
        return _matmul(_matmul(a, a), a)
    z = result = None
    while n > 0:
        z = a if z is None else _matmul(z, z)
        n, bit = divmod(n, 2)
        if bit:
            result = z if result is None else _matmul(result, z)
    assert result is not None
    return result


def _max_abs_dev(m: Array) -> Array:
    return jnp.max(jnp.abs(m - _eye_like(m)), axis=(-2, -1))


def _newton_start(a: Array, root: int, symmetric: bool = True
                  ) -> tuple[Array, Array, Array, Array]:
    """Eq. (11) start: ``(X_0, M_0, e_0, bad)``; a zero or non-finite matrix is *bad*.

    ``symmetric=False``: the matrix as it is (eq. 20c's read-back factors)."""
    a = symmetrize(a) if symmetric else a
    eye = _eye_like(a)
    norm = jnp.sqrt(jnp.sum(a * a, axis=(-2, -1)))
    bad = ~jnp.isfinite(norm) | (norm == 0.0)
    norm = jnp.where(bad, 1.0, norm)
    z = (1.0 + root) / (2.0 * norm)
    x = jnp.where(bad[..., None, None], eye, eye * (z ** (1.0 / root))[..., None, None])
    m = jnp.where(bad[..., None, None], eye, a * z[..., None, None])
    error = jnp.where(bad, jnp.nan, _max_abs_dev(m))
    return x, m, error, bad


# The coupled Newton loop's per-matrix state: X, M, error, active, done,
# iterations, retries, ridge.
_NewtonCarry = tuple[Array, Array, Array, Array, Array, Array, Array, Array]


def root_inverse_coupled_newton(
    a: Array, root: int, eps: Array, config: CoupledNewtonConfig, active: Array | None = None,
    symmetric: bool = True,
) -> tuple[Array, Array]:
    """``(A + eps I)^(-1/root)`` by eq. (11), retries included: ``(X, final error)``.

    ``shampoo_reference.linalg`` runs the iteration, then reruns it at a
    ridge ``retry_epsilon_factor`` times larger while the error exceeds
    ``retry_error_threshold`` (at most ``retries`` times). Here the whole
    stack runs in one ``lax.while_loop`` and each matrix carries its own
    state: *active* while it iterates (error above the tolerance, fewer than
    ``max_iterations`` iterations, and with ``error_growth_limit`` the error
    did not grow by that factor, in which case the previous iterate is kept
    with the grown error); when it stops, it restarts at the larger ridge if
    a retry is due, else it is *done*. A zero or non-finite matrix gives the
    identity with a NaN error, as in the reference.
    """
    eye = _eye_like(a)
    limit = config.error_growth_limit
    tol = config.tolerance

    def start(ridge: Array) -> tuple[Array, Array, Array, Array]:
        x, m, error, bad = _newton_start(a + ridge[..., None, None] * eye, root, symmetric)
        return x, m, error, ~bad & (error > tol)

    x, m, error, started = start(eps)
    wanted = jnp.ones_like(started) if active is None else active
    # zeros_like, not zeros(shape): under shard_map the carry then varies over
    # the mesh axis like the stack it belongs to (while_loop needs equal types).
    zeros = jnp.zeros_like(error, jnp.int32)
    # A matrix not wanted (``active`` False: discarded by the caller) is done
    # from the start; the loop stops when the wanted ones are.
    carry: _NewtonCarry = (x, m, error, started & wanted, ~wanted, zeros, zeros, eps)

    def cond(carry: _NewtonCarry) -> Array:
        return ~jnp.all(carry[4])

    def body(carry: _NewtonCarry) -> _NewtonCarry:
        x, m, error, active, done, iters, retried, ridge = carry
        # Stopped matrices: restart at a larger ridge if a retry is due, else done.
        stopped = ~done & ~active
        due = ~(jnp.isfinite(error) & (error <= config.retry_error_threshold))
        restart = stopped & due & (retried < config.retries)
        done = done | (stopped & ~restart)
        ridge = jnp.where(restart, ridge * config.retry_epsilon_factor, ridge)

        def restarted(operand: tuple[Array, Array, Array, Array]
                      ) -> tuple[Array, Array, Array, Array]:
            x, m, error, active = operand
            x0, m0, e0, a0 = start(ridge)
            sel = restart[..., None, None]
            return (jnp.where(sel, x0, x), jnp.where(sel, m0, m),
                    jnp.where(restart, e0, error), jnp.where(restart, a0, active))

        # Most iterations restart no matrix: the new starts of the whole stack (a
        # symmetrized copy, its norm, X_0 and M_0) only when one does.
        x, m, error, active = lax.cond(jnp.any(restart), restarted, lambda o: o,
                                       (x, m, error, active))
        iters = jnp.where(restart, 0, iters)
        retried = retried + restart.astype(jnp.int32)
        # One iteration of eq. (11) for the active matrices.
        active = active & (iters < config.max_iterations)
        t = ((root + 1.0) * eye - m) / root
        new_m = _matmul(matrix_power(t, root), m)
        new_error = _max_abs_dev(new_m)
        if limit is not None:
            grew = ~(new_error < error * limit)
            error = jnp.where(active & grew, new_error, error)
            active = active & ~grew
        sel = active[..., None, None]
        x = jnp.where(sel, _matmul(x, t), x)
        m = jnp.where(sel, new_m, m)
        error = jnp.where(active, new_error, error)
        iters = iters + active.astype(jnp.int32)
        active = active & (error > tol) & (iters < config.max_iterations)
        return x, m, error, active, done, iters, retried, ridge

    x, _, error, *_ = lax.while_loop(cond, body, carry)
    return x, error


def root_inverse_deflated_newton(
    a: Array, root: int, eps: EpsilonConfig, config: CoupledNewtonConfig,
    active: Array | None = None,
) -> tuple[Array, Array]:
    """Eq. (11d): ``(A + eps I)^(-1/root)`` per matrix by eq. (11) with the top-k pairs
    deflated (Google's ``lobpcg_topk_precondition``); ``(X, final error)``.

    Matrix by matrix reference ``linalg.root_inverse_deflated_newton``:
    LOBPCG's top-k Ritz pairs (theta, V) of ``sym(A)``
    (:func:`.lobpcg.lobpcg_top_k`, k = ``deflation_rank``, m =
    ``lobpcg_iterations``), lambda_max = max theta for a relative epsilon
    (instead of eq. 9b), then

        A_d = A - V diag(theta - min theta) V^T
        X   = Newton(A_d + eps I) - V diag(d) V^T,
        d_i = (eps + min theta)^(-1/r) - (eps + theta_i)^(-1/r)

    with eq. (11)'s retries on A_d (:func:`root_inverse_coupled_newton`).
    Where V holds exact eigenvectors this is the root of A + eps I itself;
    after fewer iterations it is not, which is why the error returned (the
    one eq. 13 judges) is ``max|X^r (A + eps I) - I|`` on the undeflated
    factor. A zero factor's Ritz vectors are 0/0 after one step: NaN, a
    failed root, as in the reference. Only for symmetric factors (the
    config refuses eq. 20c's read-back ones). ``active``: as
    :func:`root_inverse_coupled_newton` (inactive matrices take no LOBPCG
    step either).
    """
    a = symmetrize(a)
    top = lobpcg_top_k(a, config.deflation_rank, config.lobpcg_iterations, active)
    low = jnp.min(top.values, axis=-1)
    # theta - low >= 0: the Ritz values are the top k and low their least.
    shift = top.vectors * jnp.sqrt(top.values - low[..., None])[..., None, :]
    deflated = a - _matmul(shift, jnp.swapaxes(shift, -1, -2))
    ridge = jnp.full_like(low, eps.value)
    if eps.scale == "relative":  # max theta: LOBPCG's estimate of lambda_max
        ridge = ridge * jnp.maximum(jnp.max(top.values, axis=-1), eps.relative_floor)
    x, _ = root_inverse_coupled_newton(deflated, root, ridge, config, active)
    restore = top.vectors * jnp.sqrt(
        pth_root_difference(ridge[..., None], low[..., None], top.values, root))[..., None, :]
    x = x - _matmul(restore, jnp.swapaxes(restore, -1, -2))
    check = _matmul(matrix_power(x, root), a + ridge[..., None, None] * _eye_like(a))
    return x, _max_abs_dev(check)


def root_inverse_higher_order(
    a: Array, root: float, config: HigherOrderNewtonConfig, active: Array | None = None
) -> tuple[Array, Array]:
    """``A^(-1/root)`` per matrix by eq. (11c), Meta's coupled higher-order iteration; (X, ok).

    Matrix by matrix reference ``linalg.root_inverse_higher_order``: ``root =
    p/q`` exactly, the ridge ``max(rel_epsilon ||A||_inf, abs_epsilon)``, one
    Newton step, then Horner steps of ``order`` in one ``lax.while_loop``
    where each matrix stops on its own (tolerance, ``max_iterations``, or
    an error that grew beyond 1.2 times or stalled below 1e-3, that iterate
    kept). ``ok`` is False on a non-finite ``||A||_inf``, on
    ``max|(A + eps I) X^p - I| > 0.1`` or on a non-finite ``X^q``.
    ``active`` False: the caller discards the matrix, which does not iterate.
    """
    fraction = Fraction(root)
    p, q = fraction.numerator, fraction.denominator
    a = symmetrize(a)
    eye = _eye_like(a)
    lam = jnp.max(jnp.sum(jnp.abs(a), axis=-1), axis=-1)
    eps = jnp.maximum(lam * config.rel_epsilon, config.abs_epsilon)
    a = a + eps[..., None, None] * eye
    z = 1.0 / jnp.trace(a, axis1=-2, axis2=-1)
    s = -1.0 / p
    x = (z ** (1.0 / p))[..., None, None] * eye
    m = z[..., None, None] * a
    t = s * m + (1.0 - s) * eye  # the Newton step first
    x = _matmul(x, t)
    m = _matmul(matrix_power(t, p), m)
    error = _max_abs_dev(m)
    b = config.coefficients(p)
    running = error > config.tolerance  # False for NaN, as the reference's loop
    if active is not None:
        running = running & active
    iters = jnp.ones_like(error, jnp.int32)

    def cond(carry: tuple[Array, Array, Array, Array, Array]) -> Array:
        return jnp.any(carry[3])

    def body(
        carry: tuple[Array, Array, Array, Array, Array],
    ) -> tuple[Array, Array, Array, Array, Array]:
        x, m, error, running, iters = carry
        base = eye - m
        t = b[-1] * base + b[-2] * eye
        for coefficient in reversed(b[:-2]):
            t = coefficient * eye + _matmul(t, base)
        sel = running[..., None, None]
        x = jnp.where(sel, _matmul(x, t), x)
        m = jnp.where(sel, _matmul(matrix_power(t, p), m), m)
        new_error = _max_abs_dev(m)
        stop = (new_error > error * 1.2) | ((new_error == error) & (error < 1e-3))
        error = jnp.where(running & ~stop, new_error, error)
        iters = iters + running.astype(jnp.int32)
        running = (running & ~stop & (new_error > config.tolerance)
                   & (iters < config.max_iterations))
        return x, m, error, running, iters

    running = running & (iters < config.max_iterations)
    x = lax.while_loop(cond, body, (x, m, error, running, iters))[0]
    true_error = _max_abs_dev(_matmul(a, matrix_power(x, p)))
    ok = jnp.isfinite(lam) & ~(true_error > 0.1)  # NaN passes here, as Meta's; X^q decides
    if q > 1:
        x = matrix_power(x, q)
    return x, ok & all_finite(x)


def _rank_cutoff(a: Array, eps: EpsilonConfig) -> tuple[float, float] | None:
    """``(rtol, atol)`` of ``"pseudo_inverse"`` for the stack ``a`` (eq. 10); else None."""
    if not eps.pseudo_inverse:
        return None
    dtype = "float64" if a.dtype == jnp.float64 else "float32"
    return eps.rank_cutoff_rtol(a.shape[-1], dtype), eps.rank_atol


def compute_inverse_root(
    a: Array, root: float, config: ShampooConfig, active: Array | None = None
) -> tuple[Array, Array]:
    """Eqs. (10), (11), (11c), (11d), (17) for one stack of factors: ``(inverse root, ok)``.

    ``ok`` is False where the input or output is non-finite, the coupled
    Newton iteration failed (eq. 11) or an eigendecomposition's error e
    reached ``EighConfig.failure_threshold`` tau (eq. 10b, ``fl32(e) >= fl32(tau)``;
    e is computed only when tau is set); the caller keeps the previous
    inverse root there and counts it (eq. 13). Non-finite inputs are
    replaced by the identity before the decomposition so that they cannot
    disturb the batched LAPACK call.
    ``active`` (optional ``[b]`` bools): matrices the caller will discard
    whatever comes out (eq. 3's masked blocks, padding); on CPU (every
    method) and with coupled Newton (elsewhere) they are not decomposed, and
    their ``ok`` is meaningless.

    On CPU a stack of more than one matrix goes one matrix at a time
    (``lax.map``, an inactive one skipped by ``lax.cond``), as eigh does
    (:func:`_eigh`). Every method here is per matrix, so each matrix takes
    the batched call's steps (on the 9 x 1024 Newton stack below, the same
    bits); but an iteration (eqs. 9b, 11, 11c) then
    stops with its own matrix instead of multiplying it along until the
    slowest of the stack converges, and the workspace is one matrix's: eq.
    (11) on 9 x 1024 float32 factors took 220 MiB of temporaries batched and
    32 MiB one at a time, and 3.6 s instead of 2.2 s (2 cores). On GPU and
    TPU the stack stays one batched call.
    """
    if a.shape[0] > 1 and jax.default_backend() == "cpu":
        def one(m: Array) -> tuple[Array, Array]:
            x, ok = _inverse_root_of_stack(m[None], root, config)
            return x[0], ok[0]

        def skip(m: Array) -> tuple[Array, Array]:
            return _identity_like(m), jnp.zeros_like(m[0, 0], bool)

        return _one_at_a_time(one, skip, a, active)
    return _inverse_root_of_stack(a, root, config, active)


def _inverse_root_of_stack(
    a: Array, root: float, config: ShampooConfig, active: Array | None = None
) -> tuple[Array, Array]:
    """:func:`compute_inverse_root` of a whole stack in one batched call."""
    finite_in = all_finite(a)
    a = jnp.where(finite_in[..., None, None], a, _eye_like(a))
    ok = finite_in
    method = config.root_inverse
    tau = method.failure_threshold_float32 if isinstance(method, EighConfig) else None
    passes: Array | None = None
    if config.factor_storage_dtype is not None:  # eq. (11b): the root in s
        work = jnp.float64 if config.factor_dtype == "float64" else jnp.float32
        x = root_inverse_eigh_stored(a, root, config.epsilon, work, active)
    elif config.eigenvalue_correction is not None:
        x, passes = eigenbasis(a, active, tau)
    elif config.low_rank is not None and config.low_rank.compresses(a.shape[-1]):
        lr = config.low_rank  # eq. (10c)
        e = lr.epsilon_for(config.epsilon)
        x, passes = root_inverse_eigh(
            a, root, effective_epsilon(a, e, active), e.placement, active,
            lr.eigh.failure_threshold_float32, _rank_cutoff(a, e), (lr.rank, lr.keep))
    elif isinstance(method, HigherOrderNewtonConfig):  # eq. (11c): its own ridge
        x, higher_ok = root_inverse_higher_order(a, root, method, active)
        ok = ok & higher_ok
    elif isinstance(method, CoupledNewtonConfig):
        if method.deflates(a.shape[-1]):  # eq. (11d): its epsilon from LOBPCG's max theta
            x, error = root_inverse_deflated_newton(a, int(root), config.epsilon, method,
                                                    active)
        else:
            eps = effective_epsilon(a, config.epsilon, active)
            # Eq. (20c): the read-back factors as they are (not symmetrized).
            x, error = root_inverse_coupled_newton(a, int(root), eps, method, active,
                                                   symmetric=not config.statistics.quantized)
        ok = ok & jnp.isfinite(error)
        if method.failure_threshold is not None:
            ok = ok & (error < method.failure_threshold)
    else:
        e = config.epsilon
        eps = effective_epsilon(a, e, active)
        x, passes = root_inverse_eigh(a, root, eps, e.placement, active, tau,
                                      _rank_cutoff(a, e))
    if passes is not None:
        ok = ok & passes
    ok = ok & all_finite(x)
    return x, ok


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
    A non-finite A is decomposed as the identity; ``active`` as :func:`_eigh`.
    """
    finite = all_finite(a)
    a = jnp.where(finite[..., None, None], a, _eye_like(a))
    method = config.root_inverse
    tau = method.failure_threshold_float32 if isinstance(method, EighConfig) else None
    b = symmetrize(a)
    lam, q = _eigh(b, active)
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
    is decomposed as I). ``active``: as :func:`_eigh`."""
    scaled = beta * (u * values[..., None, :])
    m = symmetrize(_matmul(scaled, jnp.swapaxes(u, -1, -2)) + c)
    finite = all_finite(m)
    sigma, v = _eigh(jnp.where(finite[..., None, None], m, _eye_like(m)), active)
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
    as :func:`_eigh`. ``ok`` is False for a non-finite X or M (eq. 13: the
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
    ``sketch`` as it came. ``active``: as :func:`_eigh`.
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
    "all_finite",
    "compute_inverse_root",
    "cut_eigenvalues",
    "effective_epsilon",
    "eigenbasis",
    "eigh_error",
    "eigh_for_parameter_cutoff",
    "eigh_passes",
    "frequent_directions_root",
    "matrix_power",
    "root_inverse_coupled_newton",
    "root_inverse_deflated_newton",
    "root_at_cutoff",
    "root_inverse_eigh",
    "sketch_epsilon",
    "symmetrize",
    "tearfree_sketch_root",
]

