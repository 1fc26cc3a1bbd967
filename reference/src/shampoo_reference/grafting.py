"""Grafting: the first-order method whose per-step norm Shampoo borrows, eq. (14).

The graft state V is elementwise (one entry per parameter entry), so blocking
never changes it; only the norm used for rescaling (eq. 18) depends on the
block or parameter scope. Eq. (14e)'s Adafactor keeps row and column means
of the whole parameter in its own shape instead (:class:`FactoredMoments`).
"""

from __future__ import annotations

from dataclasses import dataclass

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


# ------------------------------------------------------------- eq. (14e) Adafactor
@dataclass
class FactoredMoments:
    """Eq. (14e)'s moments of one parameter in its own shape.

    ``dims = (d0, d1)`` (its largest and second largest dim) when factored,
    with the row moment R (the shape without d0) and the column moment C (the
    shape without d1); else None, with the full moment V.
    """

    dims: tuple[int, int] | None
    row: Array | None = None
    col: Array | None = None
    full: Array | None = None

    def arrays(self) -> list[Array]:
        return [x for x in (self.row, self.col, self.full) if x is not None]


def adafactor_init(shape: tuple[int, ...], graft: GraftingConfig) -> FactoredMoments:
    """Zero moments for a parameter of ``shape`` (eq. 14e)."""
    dims = graft.factored_dims(shape)
    if dims is None:
        return FactoredMoments(None, full=np.zeros(shape))
    d0, d1 = dims
    without = lambda d: tuple(n for i, n in enumerate(shape) if i != d)  # noqa: E731
    return FactoredMoments(dims, row=np.zeros(without(d0)), col=np.zeros(without(d1)))


def adafactor_update(m: FactoredMoments, gradient: Array, t: int, graft: GraftingConfig
                     ) -> FactoredMoments:
    """Eq. (14e) at step t: R, C (or V) <- beta_t (.) + (1 - beta_t) means of G^2 + eps;
    ``gradient`` in the parameter's own shape."""
    beta = graft.adafactor_decay(t)
    q = gradient * gradient + graft.epsilon
    if m.dims is None:
        assert m.full is not None
        return FactoredMoments(None, full=beta * m.full + (1.0 - beta) * q)
    assert m.row is not None and m.col is not None
    d0, d1 = m.dims
    return FactoredMoments(m.dims, row=beta * m.row + (1.0 - beta) * q.mean(axis=d0),
                           col=beta * m.col + (1.0 - beta) * q.mean(axis=d1))


def adafactor_direction(x: Array, m: FactoredMoments, parameter: Array,
                        graft: GraftingConfig) -> Array:
    """``graft(X)`` of eq. (14e) in the parameter's own shape: ``X (R / mean_d1 R)^(-1/2)
    C^(-1/2)`` (or ``X V^(-1/2)``), clipped by eq. (14d), times ``max(rms(W), s)``."""
    if m.dims is None:
        assert m.full is not None
        u = x * m.full ** -0.5
    else:
        assert m.row is not None and m.col is not None
        d0, d1 = m.dims
        r_axis = d1 - 1 if d1 > d0 else d1  # d1's axis in R (which lacks d0)
        row = (m.row / m.row.mean(axis=r_axis, keepdims=True)) ** -0.5
        u = x * np.expand_dims(row, d0) * np.expand_dims(m.col ** -0.5, d1)
    u = clip(u, graft)
    floor = graft.parameter_scale_floor
    if floor is not None:
        u = u * max(float(np.sqrt(np.mean(parameter * parameter))), floor)
    return u
