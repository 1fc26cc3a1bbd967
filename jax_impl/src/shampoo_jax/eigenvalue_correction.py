"""Eigenvalue correction, eq. (17): the second moment D in the factors' eigenbases.

:func:`update_corrected_moment` decays D and adds the rotated gradient's
square (``D <- beta2 D + w (G x_k Q_k^T)^2``, in the eigenbases the root step
just refreshed); :func:`corrected_direction` divides the rotated filtered
gradient by ``D^(1/root) + epsilon`` and rotates it back (:func:`rotate`).
With ``eigenvectors_dtype`` and ``corrected_eigenvalues_dtype`` (eq. 17a) the
rotations and D's arithmetic are Meta's in those dtypes.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import Array

from shampoo_spec import ShampooConfig

from . import blocks as B
from .roots import rounded
from .state import BlockGroupState, Groups, factor_dtype


def rotate(
    x: Array, grp: B.BlockGroupLayout, bases: tuple[Array, ...], transpose: bool,
    config: ShampooConfig,
) -> Array:
    """``x x_k Q_k`` (or ``Q_k^T`` with ``transpose``) over the preconditioned dims, eq. (17).

    With ``eigenvectors_dtype`` q (eq. 17a) the rotation is Meta's in q:
    ``x`` rounded to q, each mode product rounded to q (:func:`rounded`, so
    XLA cannot keep it wider), the result in the factor dtype. A block with
    no preconditioned dim is not rounded.
    """
    ec = config.eigenvalue_correction
    if ec is not None and ec.eigenvectors_dtype is not None and bases:
        qdt = bases[0].dtype
        x = rounded(x, qdt)
        for k, q in zip(grp.preconditioned_dims, bases, strict=False):
            x = rounded(B.mode_product(x, rounded(q, qdt), k, transpose=transpose), qdt)
        return x.astype(factor_dtype(config))
    for k, q in zip(grp.preconditioned_dims, bases, strict=False):
        x = B.mode_product(x, q, k, transpose=transpose)
    return x


def _compute_dtype(stored: Any) -> Any:
    """c_s of eq. (17a): the precision an operation on D in ``stored`` is computed in."""
    return jnp.float64 if stored == jnp.float64 else jnp.float32


def update_corrected_moment(
    groups: Groups,
    layout: B.Layout,
    g_blocks: list[Array],
    block_ok: list[Array],
    config: ShampooConfig,
) -> Groups:
    """Eq. (17): ``D <- beta2 D + w (G x_k Q_k^T)^2`` in the refreshed basis (w = update_weight).

    With ``corrected_eigenvalues_dtype`` s (eq. 17a) Meta's operations:
    ``round_s(c_s(beta2) D)`` (in c_s: float32 below float64, as torch), then
    ``+ (w R) R`` in the factor dtype, rounded to s once.
    """
    ec = config.eigenvalue_correction
    assert ec is not None
    new = []
    for grp, gs, gb, ok in zip(layout.groups, groups, g_blocks, block_ok, strict=False):
        rotated = rotate(gb, grp, gs.inverse_roots, transpose=True, config=config)
        d, n = gs.corrected_moment, gs.corrected_updates
        assert d is not None and n is not None
        if ec.corrected_eigenvalues_dtype is not None:
            c = _compute_dtype(d.dtype)
            decayed = (rounded(d.astype(c) * jnp.asarray(ec.beta2, c), d.dtype) if ec.decays
                       else d)
            weight = ec.update_weight if ec.decays else 1.0
            upd = rounded(decayed.astype(rotated.dtype) + (weight * rotated) * rotated, d.dtype)
        elif ec.decays:
            upd = ec.beta2 * d + ec.update_weight * rotated**2
        else:
            upd = d + rotated**2
        new.append(gs._replace(
            corrected_moment=jnp.where(B.expand(ok, d), upd, d),
            corrected_updates=n + ok.astype(jnp.int32),
        ))
    return tuple(new)


def corrected_direction(
    gs: BlockGroupState, grp: B.BlockGroupLayout, fb: Array, config: ShampooConfig
) -> Array:
    """Eq. (17): ``(F x_k Q_k^T) / (D^(1/root) + epsilon)`` rotated back by ``x_k Q_k``.

    With ``corrected_eigenvalues_dtype`` s (eq. 17a) the denominator is
    Meta's in s: ``D / c_s(bc)``, its root and ``+ c_s(epsilon)`` each
    computed in c_s and rounded to s; the quotient in the factor dtype.
    """
    ec = config.eigenvalue_correction
    assert ec is not None and gs.corrected_moment is not None
    d = gs.corrected_moment
    work = factor_dtype(config)
    bc = None
    if ec.corrects_bias:
        n = gs.corrected_updates
        assert n is not None
        bc = jnp.where(n > 0, 1.0 - jnp.asarray(ec.beta2, work) ** n.astype(work), 1.0)
    rotated = rotate(fb, grp, gs.inverse_roots, transpose=True, config=config)
    root = ec.root_for(len(grp.shape))  # the block order
    if ec.corrected_eigenvalues_dtype is None:
        if bc is not None:
            d = d / B.expand(bc.astype(d.dtype), d)
        scaled = rotated / (d ** (1.0 / root) + ec.epsilon)
    else:
        c = _compute_dtype(d.dtype)
        if bc is not None:
            d = rounded(d.astype(c) / B.expand(bc.astype(c), d), d.dtype)
        powered = jnp.sqrt(d.astype(c)) if root == 2 else d.astype(c) ** (1.0 / root)
        powered = rounded(powered, d.dtype)
        den = rounded(powered.astype(c) + jnp.asarray(ec.epsilon, c), d.dtype)
        wide = jnp.promote_types(rotated.dtype, den.dtype)
        scaled = (rotated.astype(wide) / den.astype(wide)).astype(rotated.dtype)
    return rotate(scaled, grp, gs.inverse_roots, transpose=False, config=config)


__all__ = ["corrected_direction", "rotate", "update_corrected_moment"]
