"""Grafting: the first-order method whose per-step norm Shampoo borrows, eq. (14).

The graft state V is elementwise (one entry per parameter entry), so blocking
never changes it; only the norm used for rescaling (eq. 18) depends on the
block or parameter scope.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from shampoo_spec import GraftingConfig

Array = NDArray[np.float64]

def graft_input(gradient: Array, graft: GraftingConfig) -> Array:
    """The gradient the graft state sees: normalised for ``*_normalized`` (eq. 14a)."""
    if graft.normalizes_input:
        return gradient / (np.linalg.norm(gradient) + graft.normalize_epsilon)
    return gradient


def update_state(state: Array, gradient: Array, graft: GraftingConfig) -> Array:
    """``V <- beta2 V + w g^2`` (eq. 14b): w = 1 for AdaGrad (beta2 = 1) or
    ``ema_weight="one"``, else 1 - beta2 (``GraftingConfig.update_weight``)."""
    g = graft_input(gradient, graft)
    if graft.beta2 == 1.0:
        return state + g * g
    return graft.beta2 * state + graft.update_weight * g * g


def direction(x: Array, state: Array | None, t: int, graft: GraftingConfig) -> Array:
    """``graft(X)`` of eq. (14c) at step t.

    ``none``/``sgd``: X; ``sign``: sign(X); adaptive types:
    ``X / (sqrt(V / bc) + epsilon)`` (``epsilon_placement="inside_sqrt"``:
    ``X / sqrt(V / bc + epsilon)``) with ``bc = 1 - beta2^t`` when
    ``bias_correction`` (and beta2 < 1), else 1. Normalised variants apply the
    same division to the normalised X.
    """
    kind = graft.type
    if kind in ("none", "sgd"):
        return x
    if kind == "sign":
        return np.sign(x)
    assert state is not None
    x = graft_input(x, graft)
    v = state / graft.bias_correction_factor(t)
    if graft.epsilon_placement == "inside_sqrt":
        return clip(x / np.sqrt(v + graft.epsilon), graft)
    return clip(x / (np.sqrt(v) + graft.epsilon), graft)


def clip(u: Array, graft: GraftingConfig) -> Array:
    """Eq. (14d): ``u / max(1, rms(u) / c)``, ``rms(u) = ||u|| / sqrt(size)``, c = ``clip_rms``.

    Over the whole parameter, as Google's ``clip_by_scaled_gradient_norm``
    (``jnp.maximum``: a NaN rms gives NaN); u unchanged when ``clip_rms`` is None.
    """
    c = graft.clip_rms
    if c is None:
        return u
    rms = np.linalg.norm(u) / np.sqrt(float(u.size))
    out: Array = u / np.maximum(1.0, rms / c)
    return out
