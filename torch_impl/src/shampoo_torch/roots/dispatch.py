"""The one place that reads the config and picks the inverse-root method for a stack of
factors (docs/spec.md eqs. 10-11d, 17, 17c, 10d-10h).

:func:`compute_inverse_root` takes the stack ``[B, n, n]`` of one factor dim's
rows, prepared as eq. (10) decomposes it (eqs. 7, 7b), and returns the new
inverse roots (or eigenbases, eq. 17) with a per-row ``ok`` (eq. 13);
:func:`root_inverse_in_storage_dtype` does so for factors stored in bfloat16
or float16 (eq. 11b) and :func:`sketch_root` for a sketched factor (eqs.
10d, 10e). Which rows take part, and accepting or refusing what comes back
(eq. 13), is the caller's (:func:`shampoo_torch.preconditioner.refresh_inverse_roots`).

The eigh and Newton roots take the rows together: their operations are
batch invariant (:mod:`shampoo_torch.invariance`) but for pow, which they take per row
inside. The stored-dtype, higher-order and stored-basis roots run one row per
call (:func:`~shampoo_torch.invariance.rowwise`).
"""

from __future__ import annotations

from functools import partial

import torch

from shampoo_spec import (
    CoupledNewtonConfig,
    EighConfig,
    EpsilonConfig,
    HigherOrderNewtonConfig,
    ShampooConfig,
)

from ..blocks import Sketch
from ..invariance import rowwise
from .basis import qr_eigenbasis, root_inverse_qr, root_inverse_reusing_basis
from .eigh import eigenbasis, root_inverse_eigh, root_inverse_eigh_stored
from .newton import (
    root_inverse_coupled_newton,
    root_inverse_deflated_newton,
    root_inverse_higher_order,
)
from .sketch import frequent_directions_root, sketch_epsilon, tearfree_sketch_root


def root_inverse_in_storage_dtype(
    a: torch.Tensor, root: float, eps: EpsilonConfig, work_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (11b): :func:`~.eigh.root_inverse_eigh_stored` of each row of ``a`` (in the
    storage dtype s, bias corrected), one row per call; (X in s, ok)."""
    new, good = rowwise(
        partial(root_inverse_eigh_stored, root=root, eps=eps, work_dtype=work_dtype),
        a,
    )
    return new, good


def starts_from_basis(cfg: ShampooConfig) -> bool:
    """Whether :func:`compute_inverse_root` starts from the factor's stored eigenbasis:
    eq. (17c)'s QR eigenbasis, or eq. (10f)'s / (10h)'s root (the config allows those
    with plain eigh roots only: no eigenvalue correction, low rank or sketch)."""
    ec = cfg.eigenvalue_correction
    if ec is not None:
        return ec.eigenbasis_method == "qr"
    return cfg.root_inverse_stores_basis


def compute_inverse_root(
    a: torch.Tensor, root: float, cfg: ShampooConfig, tau: float | None,
    basis: torch.Tensor | None = None, scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Eqs. (10)-(11d), (17), (17c), (10f), (10h) for one stack ``a`` of factors
    (bias corrected, eq. 7b applied): ``(X or Q, ok, new stored basis)``.

    With eigenvalue correction the eigenbasis Q (eq. 17; eq. 17c's QR steps
    from ``basis``); else eq. (10c)'s low-rank root where it compresses the
    factor, eq. (11c), eq. (11d) where it deflates, eq. (11), eqs. (10f) /
    (10h) from the stored ``basis`` (whose new value comes third: the caller
    stores it where the root is accepted), or eq. (10)'s eigh root. ``tau``:
    fl32 of eq. (10b)'s failure threshold for eigh roots and eigenbases (None:
    no error computed). ``basis``: the stored eigenbasis of each row, given
    exactly when :func:`starts_from_basis`. ``scale``: eq. (10g)'s Lambda_k per
    row (the config allows it with plain eigh roots only).
    """
    stats = cfg.statistics
    method = cfg.root_inverse
    ec = cfg.eigenvalue_correction
    if ec is not None and ec.eigenbasis_method == "qr":  # eq. (17c)
        assert basis is not None
        new, good = rowwise(
            partial(qr_eigenbasis, eps=cfg.epsilon,
                    max_iterations=ec.qr_max_iterations,
                    tolerance=ec.basis_reuse_tolerance),
            torch.stack([basis.to(a.dtype), a], dim=1),
        )
    # The eigh and Newton roots take the rows together: their operations are batch
    # invariant (:mod:`.invariance`) but for pow, which they take per row inside; one
    # call per chunk, not per block.
    elif ec is not None:
        new, good = eigenbasis(a, failure_threshold=tau)
    elif cfg.low_rank is not None and cfg.low_rank.compresses(a.shape[-1]):  # eq. (10c)
        lr = cfg.low_rank
        new, good = root_inverse_eigh(
            a, root, lr.epsilon_for(cfg.epsilon), lr.eigh.failure_threshold_float32,
            (lr.rank, lr.keep))
    elif isinstance(method, HigherOrderNewtonConfig):
        new, good = rowwise(
            partial(root_inverse_higher_order, root=root, config=method), a
        )
    elif isinstance(method, CoupledNewtonConfig) and method.deflates(a.shape[-1]):  # eq. (11d)
        new, good = root_inverse_deflated_newton(a, int(root), cfg.epsilon, method)
    elif isinstance(method, CoupledNewtonConfig):
        new, good = root_inverse_coupled_newton(
            a, int(root), cfg.epsilon, method,
            symmetric=not stats.quantized)  # eq. (20c): as read back
    elif cfg.root_inverse_stores_basis:  # eqs. (10f), (10h)
        assert isinstance(method, EighConfig) and basis is not None
        return _stored_basis_root(a, root, cfg.epsilon, method, basis)
    else:
        new, good = root_inverse_eigh(a, root, cfg.epsilon, tau, scale=scale)
    return new, good, None


def _stored_basis_root(
    a: torch.Tensor, root: float, eps: EpsilonConfig, method: EighConfig, basis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eq. (10f)'s QR root, or eq. (10h)'s (the basis kept while it fits, else eigh), of
    each row from its stored eigenbasis, one row per call (batch invariance); (X, ok,
    the new basis)."""
    if method.qr:
        from_basis = partial(root_inverse_qr, max_iterations=method.qr_max_iterations,
                             tolerance=method.qr_tolerance)
    else:
        from_basis = partial(root_inverse_reusing_basis,
                             tolerance=method.basis_reuse_tolerance)
    out, good = rowwise(partial(from_basis, root=root, eps=eps),
                        torch.stack([basis, a], dim=1))
    return out[:, 0], good, out[:, 1]


def sketch_root(
    sketch: Sketch, c: torch.Tensor, root: float, cfg: ShampooConfig, t: int, largest: int = 0
) -> tuple[Sketch, torch.Tensor, torch.Tensor]:
    """Eq. (10d) (eq. 10e with ``frequent_directions.rule = "tearfree"``) at root step t:
    the rows' sketches, emptied first when ``frequent_directions.resets(t)``, take the
    observations ``c`` of eq. (6c); (new sketch, X, ok). With ``packing = "google"``
    only the first ``kept_values(n, largest)`` values are read back (``largest``: the
    largest factor of the param group)."""
    fd = cfg.frequent_directions
    assert fd is not None
    rtol = fd.zero_rtol(c.shape[-1], cfg.factor_dtype)
    beta = cfg.statistics.beta2
    if fd.rule == "tearfree":  # eq. (10e): no reset, epsilon by its own rule
        e = cfg.epsilon
        return tearfree_sketch_root(sketch, c, root, beta, e.value, e.scale == "relative", rtol)
    kept = fd.kept_values(c.shape[-1], largest)
    if kept < sketch.lam.shape[-1]:  # packing "google": the values past ``kept`` read as 0
        lam = sketch.lam.clone()
        lam[:, kept:] = 0
        sketch = Sketch(sketch.u, lam, sketch.rho)
    if fd.resets(t):
        sketch = Sketch(*(torch.zeros_like(x) for x in sketch.tensors()))
    eps = sketch_epsilon(sketch.lam[:, 0], cfg.epsilon, fd.relative_floor)
    return frequent_directions_root(sketch, c, root, beta, eps, rtol)
