"""The Newton family of inverse roots, eqs. (11), (11c), (11d).

- :func:`root_inverse_coupled_newton`: eq. (11) as a ``lax.while_loop``
  over the whole stack (a matrix stops iterating when it converges, stalls
  or its error grows, while the others go on), then the retries;
- :func:`root_inverse_deflated_newton`: eq. (11d), the same with LOBPCG's
  top-k eigenpairs (:mod:`.lobpcg`) deflated before it and restored after;
- :func:`root_inverse_higher_order`: eq. (11c), Meta's coupled higher-order
  iteration;
- :func:`matrix_power`: ``a^n`` in numpy.linalg.matrix_power's order.
"""

from __future__ import annotations

from fractions import Fraction

import jax.numpy as jnp
from jax import Array, lax

from shampoo_spec import CoupledNewtonConfig, EpsilonConfig, HigherOrderNewtonConfig

from .lobpcg import lobpcg_top_k, pth_root_difference
from .regularize import _eye_like, _matmul, all_finite, symmetrize


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

    ``shampoo_reference.roots.newton`` runs the iteration, then reruns it at a
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


__all__ = [
    "matrix_power",
    "root_inverse_coupled_newton",
    "root_inverse_deflated_newton",
    "root_inverse_higher_order",
]
