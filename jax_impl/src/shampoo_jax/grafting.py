"""Grafting, eq. (14): elementwise state and the graft direction of one parameter.

Same rules as ``shampoo_reference.grafting``; the state V is elementwise, so
it lives in the parameter's (merged) shape and never depends on blocking.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array

from shampoo_spec import GraftingConfig

_STATEFUL = ("adagrad", "rmsprop", "adam", "adagrad_normalized", "rmsprop_normalized")


def needs_state(graft: GraftingConfig) -> bool:
    return graft.type in _STATEFUL


def norm(x: Array) -> Array:
    return jnp.sqrt(jnp.sum(x * x))


def graft_input(x: Array, graft: GraftingConfig) -> Array:
    """Eq. (14): ``x / (||x|| + normalize_epsilon)`` for ``*_normalized`` types, else x."""
    if graft.type.endswith("_normalized"):
        return x / (norm(x) + graft.normalize_epsilon)
    return x


def update_state(state: Array, gradient: Array, graft: GraftingConfig) -> Array:
    """Eq. (14b): ``V <- V + g^2`` (beta2 = 1) or ``beta2 V + (1 - beta2) g^2``."""
    g = graft_input(gradient, graft)
    if graft.beta2 == 1.0:
        return state + g * g
    return graft.beta2 * state + (1.0 - graft.beta2) * (g * g)


def direction(x: Array, state: Array | None, t: Array, graft: GraftingConfig) -> Array:
    """Eq. (14c): ``graft(X)`` at (traced, 1-based) step t."""
    kind = graft.type
    if kind in ("none", "sgd"):
        return x
    if kind == "sign":
        return jnp.sign(x)
    assert state is not None
    x = graft_input(x, graft)
    if graft.bias_correction and graft.beta2 < 1.0:
        bc = 1.0 - jnp.asarray(graft.beta2, x.dtype) ** t.astype(x.dtype)
        state = state / bc
    return x / (jnp.sqrt(state) + graft.epsilon)


__all__ = ["direction", "graft_input", "needs_state", "norm", "update_state"]
