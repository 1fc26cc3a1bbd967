"""The one place that reads the config and picks a factor's inverse-root method.

Eq. numbers refer to docs/spec.md. Each function takes the config, the
factor's root input A (eq. 10's, after eqs. 7 and 7b) and what the method
needs of the block's state (a sketch, a stored eigenbasis, the step), and
returns the new root, eigenbasis or sketch; None where the method failed.
The state bookkeeping around it (failures of eq. 13, rounding to the stored
dtype, int16 storage) is the optimizer's.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from shampoo_spec import (
    CoupledNewtonConfig,
    EighConfig,
    EpsilonConfig,
    HigherOrderNewtonConfig,
    ShampooConfig,
)

from .basis import basis_still_fits, qr_eigenbasis, root_inverse_qr, root_inverse_reusing_basis
from .eigh import (
    eigenbasis,
    eigenbasis_with_error,
    eigh_fails,
    root_inverse_eigh,
    root_inverse_eigh_stored,
    root_inverse_eigh_with_error,
)
from .newton import (
    root_inverse_coupled_newton,
    root_inverse_deflated_newton,
    root_inverse_higher_order,
)
from .regularize import effective_epsilon
from .sketch import Sketch, frequent_directions_root, tearfree_sketch_root

Array = NDArray[np.float64]


def sketch_root(config: ShampooConfig, t: int, sketch: Sketch, c: Array, root: float,
                largest: int = 0) -> tuple[Sketch, Array]:
    """Eq. (10d) at step t: reset if due, then fold C into the sketch; its X.
    Eq. (10e) with ``frequent_directions.rule = "tearfree"``. ``largest``: the
    largest factor the config preconditions; with ``packing = "google"`` a
    smaller factor reads back only ``kept_values(n, largest)`` of its values."""
    fd = config.frequent_directions
    assert fd is not None
    if fd.rule == "tearfree":
        e = config.epsilon
        return tearfree_sketch_root(
            sketch, c, root, config.statistics.beta2, e.value, e.scale == "relative",
            fd.zero_rtol(c.shape[0], config.factor_dtype))
    kept = fd.kept_values(c.shape[0], largest)
    if kept < len(sketch.lam):  # packing "google": the values past ``kept`` read as 0
        sketch = Sketch(sketch.u, np.where(np.arange(len(sketch.lam)) < kept, sketch.lam, 0.0),
                        sketch.rho)
    if fd.resets(t):
        sketch = Sketch.empty(*sketch.u.shape)
    e = config.epsilon
    eps = e.value
    if e.scale == "relative":
        eps *= max(float(sketch.lam[0]), fd.relative_floor)
    rtol = fd.zero_rtol(c.shape[0], config.factor_dtype)
    return frequent_directions_root(sketch, c, root, config.statistics.beta2, eps, rtol)


def qr_basis(config: ShampooConfig, basis: Array | None, a: Array) -> Array | None:
    """Eq. (17c): QR steps from the stored eigenbasis (identity before the first) on
    ``a + eps I`` (eps of eq. 9 with the ridge placement, else 0); None: failed."""
    ec = config.eigenvalue_correction
    assert ec is not None and basis is not None
    if not np.all(np.isfinite(a)):
        return None
    eps = config.epsilon
    ridge = effective_epsilon(a, eps) if eps.placement == "ridge" else 0.0
    return qr_eigenbasis(basis, a, ridge, ec.qr_max_iterations, ec.basis_reuse_tolerance)


def eigenbasis_still_fits(config: ShampooConfig, basis: Array | None, a: Array) -> bool:
    """Eq. (17b): with ``basis_reuse_tolerance`` tau > 0, whether the stored eigenbasis
    still diagonalizes the finite factor ``a + eps I`` to tau (eps of eq. 9 with the
    ridge placement, else 0)."""
    ec = config.eigenvalue_correction
    if ec is None or ec.basis_reuse_tolerance == 0 or basis is None:
        return False
    if not np.all(np.isfinite(a)):
        return False
    eps = config.epsilon
    ridge = effective_epsilon(a, eps) if eps.placement == "ridge" else 0.0
    return basis_still_fits(basis, a, ridge, ec.basis_reuse_tolerance)


def stored_basis_root(config: ShampooConfig, basis: Array | None, a: Array, root: float
                      ) -> tuple[Array | None, Array | None]:
    """Eq. (10f): eq. (10)'s root from eq. (17c)'s QR steps on ``a`` (plus eps I with the
    ridge) from the stored ``basis``; eq. (10h): from ``basis`` while it fits, else
    from eigh. ``(X, Q)``, ``(None, None)`` when it failed."""
    method = config.root_inverse
    assert isinstance(method, EighConfig) and basis is not None
    if not np.all(np.isfinite(a)):
        return None, None
    e = config.epsilon
    rank = rank_cutoff(config, a, e)
    if method.reuses_basis:
        try:
            result = root_inverse_reusing_basis(basis, a, root, effective_epsilon(a, e),
                                                e.placement, method.basis_reuse_tolerance,
                                                rank)
        except np.linalg.LinAlgError:
            return None, None
    else:
        result = root_inverse_qr(basis, a, root, effective_epsilon(a, e), e.placement,
                                 method.qr_max_iterations, method.qr_tolerance, rank)
    return (None, None) if result is None else result


def inverse_root(config: ShampooConfig, a: Array, root: float, scale: float | None = None
                 ) -> Array | None:
    """Eq. (10) or (11) for one factor: ``A^(-1/root)`` (or its eigenbasis, eq. 17);
    ``scale``: eq. (10g)'s Lambda_k for the rank cutoff (None: lambda_max(A)).

    None when the method fails: a non-finite input, eq. (11)'s failure, or
    an eigendecomposition whose error e reaches ``EighConfig.failure_threshold``
    tau in float32 (eq. 10b: ``fl32(e) >= fl32(tau)``); e is computed only
    when tau is set.
    """
    cfg = config
    if not np.all(np.isfinite(a)):
        return None
    method = cfg.root_inverse
    tau = method.failure_threshold_float32 if isinstance(method, EighConfig) else None
    if cfg.eigenvalue_correction is not None:
        try:
            if tau is None:
                return eigenbasis(a)
            basis = eigenbasis_with_error(a)
        except np.linalg.LinAlgError:
            return None
        return None if eigh_fails(basis.error, tau) else basis.root
    low_rank = cfg.low_rank
    if low_rank is not None and low_rank.compresses(a.shape[0]):  # eq. (10c)
        return eigh_root(cfg, a, root, low_rank.epsilon_for(cfg.epsilon),
                         low_rank.eigh.failure_threshold_float32,
                         (low_rank.rank, low_rank.keep))
    if isinstance(method, HigherOrderNewtonConfig):
        return root_inverse_higher_order(a, root, method)  # eq. (11c): its own ridge
    if isinstance(method, CoupledNewtonConfig):
        if method.deflates(a.shape[0]):  # eq. (11d)
            try:
                result = root_inverse_deflated_newton(a, int(root), cfg.epsilon, method)
            except np.linalg.LinAlgError:
                # A zero factor's Ritz vectors are 0/0 after one LOBPCG step: NaN,
                # which eigh refuses (Google's JAX eigh returns NaN: a failed root).
                return None
        else:
            # Eq. (20c): the read-back factor as it is, not symmetrized (Google's).
            eps = effective_epsilon(a, cfg.epsilon)
            result = root_inverse_coupled_newton(a, int(root), eps, method,
                                                 symmetric=not cfg.statistics.quantized)
        threshold = method.failure_threshold
        if not math.isfinite(result.error) or (
            threshold is not None and result.error >= threshold
        ):
            return None
        return result.root
    if cfg.factor_storage_dtype is not None:  # eq. (11b): the root in s
        return root_inverse_eigh_stored(a, root, effective_epsilon(a, cfg.epsilon),
                                        cfg.epsilon.placement, cfg.factor_storage_dtype)
    return eigh_root(cfg, a, root, cfg.epsilon, tau, scale=scale)


def eigh_root(config: ShampooConfig, a: Array, root: float, e: EpsilonConfig, tau: float | None,
              low_rank: tuple[int, str] | None = None, scale: float | None = None
              ) -> Array | None:
    """Eq. (10) with epsilon ``e`` (eq. 10c's ``low_rank`` when given) for the finite
    ``a``; None when eigh raises or, with ``tau`` = fl32(tau), eq. (10b) fails it
    (e is computed only then). ``scale``: eq. (10g)'s Lambda_k."""
    eps = effective_epsilon(a, e)
    rank = rank_cutoff(config, a, e, scale)
    try:
        if tau is None:
            return root_inverse_eigh(a, root, eps, e.placement, rank, low_rank)
        checked = root_inverse_eigh_with_error(a, root, eps, e.placement, rank, low_rank)
    except np.linalg.LinAlgError:
        return None
    return None if eigh_fails(checked.error, tau) else checked.root


def rank_cutoff(config: ShampooConfig, a: Array, e: EpsilonConfig, scale: float | None = None
                ) -> tuple[float, float] | None:
    """``(rtol, atol)`` of eq. (10)'s ``"pseudo_inverse"`` rank cutoff for ``a``; else None.

    With eq. (10g)'s ``scale`` Lambda_k the cutoff is already known, and is
    returned as an absolute one: ``(0, max(rtol * max(Lambda_k, 0), atol))``.
    """
    if not e.pseudo_inverse:
        return None
    rtol = e.rank_cutoff_rtol(a.shape[0], config.factor_dtype)
    if scale is None:
        return rtol, e.rank_atol
    return 0.0, max(rtol * max(scale, 0.0), e.rank_atol)


def stored_root_dtype(config: ShampooConfig) -> str | None:
    """The dtype roots are stored rounded to: ``inverse_root_dtype`` (eq. 11a), or
    ``eigenvalue_correction.eigenvectors_dtype`` for eigenbases (eq. 17a); None: unrounded."""
    ec = config.eigenvalue_correction
    return config.inverse_root_dtype if ec is None else ec.eigenvectors_dtype
