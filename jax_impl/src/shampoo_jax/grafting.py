"""Grafting, eq. (14): elementwise state and the graft direction of one parameter.

Same rules as ``shampoo_reference.grafting``; the state V is elementwise, so
it lives in the parameter's (merged) shape and never depends on blocking.
Which types keep a state is ``GraftingConfig.has_state``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import Array

from shampoo_spec import GraftingConfig

from .blocks import frobenius


def norm(x: Array) -> Array:
    """The Frobenius norm of a whole array (eq. 18's parameter scope), overflow-safe."""
    return frobenius(x)


def graft_input(x: Array, graft: GraftingConfig) -> Array:
    """Eq. (14a): ``x / (||x|| + normalize_epsilon)`` for ``*_normalized`` types, else x."""
    if graft.normalizes_input:
        return x / (norm(x) + graft.normalize_epsilon)
    return x


def update_state(state: Array, gradient: Array, graft: GraftingConfig) -> Array:
    """Eq. (14b): ``V <- V + g^2`` (beta2 = 1) or ``beta2 V + w g^2``, w = update_weight."""
    g = graft_input(gradient, graft)
    if graft.beta2 == 1.0:
        return state + g * g
    return graft.beta2 * state + graft.update_weight * (g * g)


def direction(x: Array, state: Array | None, t: Array, graft: GraftingConfig) -> Array:
    """Eq. (14c): ``graft(X)`` at (traced, 1-based) step t (epsilon after or inside the sqrt)."""
    kind = graft.type
    if kind in ("none", "sgd"):
        return x
    if kind == "sign":
        return jnp.sign(x)
    assert state is not None
    x = graft_input(x, graft)
    if graft.corrects_bias:
        # Eq. (14c)'s 1 - beta2^t on the traced step (GraftingConfig.bias_correction_factor).
        bc = 1.0 - jnp.asarray(graft.beta2, x.dtype) ** t.astype(x.dtype)
        state = state / bc
    if graft.epsilon_placement == "inside_sqrt":
        return clip(x / jnp.sqrt(state + graft.epsilon), graft)
    return clip(x / (jnp.sqrt(state) + graft.epsilon), graft)


def clip(u: Array, graft: GraftingConfig) -> Array:
    """Eq. (14d): ``u / max(1, rms(u) / clip_rms)``, ``rms(u) = ||u|| / sqrt(size)``; u if None.

    ``jnp.maximum`` keeps a NaN rms, as Google's ``clip_by_scaled_gradient_norm``.
    """
    c = graft.clip_rms
    if c is None:
        return u
    rms = norm(u) / math.sqrt(u.size)
    out: Array = u / jnp.maximum(1.0, rms / c)
    return out


__all__ = ["clip", "direction", "graft_input", "norm", "update_state"]
