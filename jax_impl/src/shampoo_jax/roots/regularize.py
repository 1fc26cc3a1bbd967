"""What every inverse-root method shares, eqs. (9)-(10).

The stack primitives (products at ``Precision.HIGHEST``, identities shaped like
a stack, :func:`_one_at_a_time` on CPU), :func:`eigh` (the eigendecomposition
of a stack, one matrix at a time on CPU: eq. 9's exact lambda_max needs it, so
it sits here below :mod:`.eigh`), :func:`symmetrize`, :func:`rounded`
(``round_s`` of eqs. 11a, 16), :func:`all_finite`, eq. (9)'s
:func:`effective_epsilon` (absolute, or relative to the exact lambda_max or to
eq. 9b's :func:`power_iteration_lambda_max`) and eq. (10)'s
:func:`regularized_eigenvalues` (how epsilon meets the eigenvalues).

Every function takes a stack of matrices ``a`` of shape ``[b, n, n]`` and
returns per-matrix results, so one failed matrix never affects its neighbours
and nothing branches in Python on a traced value.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from shampoo_spec import EpsilonConfig, power_iteration_start

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


def eigh(a: Array, active: Array | None = None) -> tuple[Array, Array]:
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
        lam_max = eigh(symmetrize(a), active)[0][..., -1]
    return eps.value * jnp.maximum(lam_max, eps.relative_floor)


def power_iteration_lambda_max(a: Array, steps: int, tolerance: float) -> Array:
    """Eq. (9b) per matrix of ``a`` [..., n, n]: Google's power iteration (its while loop,
    vmapped: a matrix that has stopped keeps its vector and quotient)."""
    n = a.shape[-1]
    # The spec's start is a tuple of Python floats: float64 first, then a's dtype (one rounding).
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


__all__ = [
    "all_finite",
    "effective_epsilon",
    "eigh",
    "power_iteration_lambda_max",
    "regularized_eigenvalues",
    "rounded",
    "symmetrize",
]
