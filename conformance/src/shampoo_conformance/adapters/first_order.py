"""First-order optimizers written out directly, for the never-start law and the report.

With the start step never reached, Shampoo is its grafting method (eq. 14)
with the gradient filter (eq. 15) and momentum (eq. 20), and without a graft
a diagonal preconditioner (eq. 16b) is its method from step 1; these are
those methods computed from their textbook formulas, not from the reference.

:class:`AdamW` is the baseline of the backend report
(``shampoo_conformance.report``): the NumPy twin of ``torch.optim.AdamW``
and ``optax.adamw``, so the reference backend has the same baseline as the
frameworks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import cast

import numpy as np
from numpy.typing import NDArray

import shampoo_spec as ss
from shampoo_spec.config import DiagonalType

Array = NDArray[np.float64]

#: Graft configs the never-start law is checked for, by name.
GRAFTS: dict[str, ss.GraftingConfig] = {
    "sgd": ss.GraftingConfig(type="sgd"),
    "sign": ss.GraftingConfig(type="sign"),
    "adagrad": ss.GraftingConfig(type="adagrad", epsilon=1e-8),
    "rmsprop": ss.GraftingConfig(type="rmsprop", beta2=0.9, epsilon=1e-8),
    "adam": ss.GraftingConfig(type="adam", beta2=0.99, epsilon=1e-8, bias_correction=True),
}

#: The same methods as diagonal preconditioners (eq. 16b), for the diagonal law.
DIAGONALS: dict[str, ss.DiagonalPreconditionerConfig] = {
    name: ss.DiagonalPreconditionerConfig(
        type=cast(DiagonalType, g.type), beta2=g.beta2, epsilon=g.epsilon,
        bias_correction=g.bias_correction)
    for name, g in GRAFTS.items()
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


class AdamW:
    """AdamW (Loshchilov and Hutter) over a dict of named float64 NumPy arrays.

    At step t = 1, 2, ... with gradient g and weight decay lambda::

        m <- beta1 m + (1 - beta1) g,          v <- beta2 v + (1 - beta2) g^2
        m_hat = m / (1 - beta1^t),             v_hat = v / (1 - beta2^t)
        w <- w - lr (m_hat / (sqrt(v_hat) + eps) + lambda w)

    which is ``torch.optim.AdamW`` (decay ``w (1 - lr lambda)`` first, the
    same product) and ``optax.adamw`` (``eps_root = 0``) written out; m and v
    start at zero. The defaults are theirs except ``weight_decay`` (torch
    defaults to 1e-2, optax to 1e-4; here 0 unless asked).

    >>> opt = AdamW({"w": w0}, lr=1e-3)
    >>> params = opt.step({"w": g})      # new parameters after step 1
    """

    def __init__(
        self,
        params: Mapping[str, NDArray[np.floating]],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        _check_real("lr", lr, low=0.0)
        if not (isinstance(betas, tuple) and len(betas) == 2):
            raise ValueError(f"betas = {betas!r} is invalid: allowed a pair (beta1, beta2).")
        for name, beta in zip(("betas[0]", "betas[1]"), betas, strict=True):
            _check_real(name, beta, low=0.0, below=1.0)
        _check_real("eps", eps, low=0.0)
        _check_real("weight_decay", weight_decay, low=0.0)
        self.lr, self.betas, self.eps, self.weight_decay = float(lr), betas, eps, weight_decay
        self.t = 0
        self.params = {k: np.array(v, dtype=np.float64, copy=True) for k, v in params.items()}
        self.m = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.v = {k: np.zeros_like(v) for k, v in self.params.items()}

    def step(self, grads: Mapping[str, NDArray[np.floating]]) -> dict[str, Array]:
        """Apply one step and return copies of the parameters."""
        if set(grads) != set(self.params):
            raise ValueError(
                f"grads keys {sorted(grads)} do not match parameter names {sorted(self.params)}."
            )
        self.t += 1
        beta1, beta2 = self.betas
        for name, w in self.params.items():
            g = np.asarray(grads[name], dtype=np.float64)
            if g.shape != w.shape:
                raise ValueError(
                    f"gradient of {name!r} has shape {g.shape}, parameter has {w.shape}."
                )
            self.m[name] = beta1 * self.m[name] + (1.0 - beta1) * g
            self.v[name] = beta2 * self.v[name] + (1.0 - beta2) * g * g
            m_hat = self.m[name] / (1.0 - beta1**self.t)
            v_hat = self.v[name] / (1.0 - beta2**self.t)
            update = m_hat / (np.sqrt(v_hat) + self.eps) + self.weight_decay * w
            self.params[name] = w - self.lr * update
        return {k: v.copy() for k, v in self.params.items()}

    def state_bytes(self) -> int:
        """Bytes of the optimizer state arrays (m and v; the step count is a Python int)."""
        return sum(a.nbytes for a in (*self.m.values(), *self.v.values()))


def _check_real(name: str, value: object, *, low: float, below: float | None = None) -> None:
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= low
        and (below is None or value < below)
    )
    if not ok:
        allowed = f"a finite real >= {low}" + ("" if below is None else f" and < {below}")
        raise ValueError(f"{name} = {value!r} is invalid: allowed {allowed}.")
