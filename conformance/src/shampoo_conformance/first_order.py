"""First-order optimizers written out directly, for the never-start law.

With the start step never reached, Shampoo is its grafting method (eq. 14)
with the gradient filter (eq. 15) and momentum (eq. 20); these are those
methods computed from their textbook formulas, not from the reference.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

import shampoo_spec as ss

Array = NDArray[np.float64]

#: Graft configs the never-start law is checked for, by name.
GRAFTS: dict[str, ss.GraftingConfig] = {
    "sgd": ss.GraftingConfig(type="sgd"),
    "sign": ss.GraftingConfig(type="sign"),
    "adagrad": ss.GraftingConfig(type="adagrad", epsilon=1e-8),
    "rmsprop": ss.GraftingConfig(type="rmsprop", beta2=0.9, epsilon=1e-8),
    "adam": ss.GraftingConfig(type="adam", beta2=0.99, epsilon=1e-8, bias_correction=True),
}


def trajectory(
    kind: str, w0: Array, grads: list[Array], lr: float, beta1: float, momentum: float
) -> list[Array]:
    """SGD / sign / AdaGrad / RMSProp / Adam with an optional EMA of gradients
    (beta1, bias-corrected) and heavy-ball momentum (zero-initialised)."""
    w, v, m, buf = w0.copy(), np.zeros_like(w0), np.zeros_like(w0), np.zeros_like(w0)
    out = []
    for t, g in enumerate(grads, start=1):
        if beta1:
            m = beta1 * m + (1 - beta1) * g
            f = m / (1 - beta1**t)
        else:
            f = g
        if kind == "sgd":
            p = f
        elif kind == "sign":
            p = np.sign(f)
        elif kind == "adagrad":
            v = v + g * g
            p = f / (np.sqrt(v) + 1e-8)
        elif kind == "rmsprop":
            v = 0.9 * v + 0.1 * g * g
            p = f / (np.sqrt(v) + 1e-8)
        elif kind == "adam":
            v = 0.99 * v + 0.01 * g * g
            p = f / (np.sqrt(v / (1 - 0.99**t)) + 1e-8)
        else:
            raise ValueError(f"kind = {kind!r} is invalid: allowed one of {sorted(GRAFTS)}.")
        if momentum:
            buf = momentum * buf + p
            p = buf
        w = w - lr * p
        out.append(w)
    return out
