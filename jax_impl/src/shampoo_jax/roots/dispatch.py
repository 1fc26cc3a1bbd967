"""The one place that reads the config and picks the inverse-root method for a stack.

:func:`compute_inverse_root`: one stack of factors by the configured method
(eqs. 10, 10c, 11, 11b, 11c, 11d, 17; on CPU one matrix at a time); a failed
or non-finite inverse root is reported (eq. 13) so that the caller keeps the
previous one. The state bookkeeping around it (batching, eq. 13's keep, the
stored bases of eqs. 10f, 10h, 17c, eq. 10g's parameter pass, sketches) is
:mod:`shampoo_jax.preconditioner`'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from shampoo_spec import CoupledNewtonConfig, EighConfig, HigherOrderNewtonConfig, ShampooConfig

from .eigh import _rank_cutoff, eigenbasis, root_inverse_eigh, root_inverse_eigh_stored
from .newton import (
    root_inverse_coupled_newton,
    root_inverse_deflated_newton,
    root_inverse_higher_order,
)
from .regularize import _eye_like, _identity_like, _one_at_a_time, all_finite, effective_epsilon


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
    (:func:`eigh`). Every method here is per matrix, so each matrix takes
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


__all__ = [
    "compute_inverse_root",
]
