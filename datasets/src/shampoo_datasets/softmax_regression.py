r"""Multinomial logistic (softmax) regression on scikit-learn's bundled digits.

Data: the 1797 8x8 images of ``sklearn.datasets.load_digits`` (shipped inside
scikit-learn, so nothing is downloaded), pixel values 0..16 scaled to
``[0, 1]``, giving features ``X`` of shape (n, 64), n = 1797, and labels
``y_i`` in 0..9 with one-hot matrix ``Y`` of shape (n, 10).

Model and loss (mean cross-entropy over the full batch)::

    Z = X W + 1 b^T                      W: (64, 10),  b: (10,)
    P_ic = exp(Z_ic) / sum_k exp(Z_ik)   (row-wise softmax)
    f(W, b) = -(1/n) sum_i log P_{i, y_i}
            = (1/n) sum_i [ logsumexp_k Z_ik - Z_{i, y_i} ]

Gradient::

    df/dW = X^T (P - Y) / n
    df/db = (P - Y)^T 1 / n

``f`` is convex; the data are (nearly) separable, so there is no finite
minimizer and ``f`` decreases towards 0. ``W`` is a (64, 10) matrix, so
Shampoo keeps a 64x64 left and a 10x10 right Kronecker factor for it.
``metrics`` gives the training accuracy (the fraction of samples whose
largest logit is at the label).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from . import _bundled, _validate
from ._problem import Array, Params, Problem, check_params, read_only
from ._softmax import softmax_and_log_normalizer

N_FEATURES = 64
N_CLASSES = 10
#: Mean cross-entropy counted as "solved": about what full-batch gradient descent
#: with its best power-of-two step (8) reaches in 40 steps from the default start.
DIGITS_TARGET_LOSS = 0.15


@lru_cache(maxsize=1)
def _digits_unit_scaled() -> tuple[Array, Array]:
    """Features scaled to [0, 1] and one-hot labels, both read-only float64."""
    pixels, labels = _bundled.digits()
    return read_only(pixels / 16.0), read_only(_bundled.one_hot(labels, N_CLASSES))


def digits_softmax(*, seed: int = 0, init_scale: float = 0.01) -> Problem:
    """Softmax regression on digits; ``W_0 ~ N(0, init_scale^2)`` from ``seed``, ``b_0 = 0``."""
    seed = _validate.seed(seed)
    init_scale = _validate.real_at_least("init_scale", init_scale, 0.0)
    features, onehot = _digits_unit_scaled()
    n = features.shape[0]
    shapes = {"W": (N_FEATURES, N_CLASSES), "b": (N_CLASSES,)}
    name = "digits_softmax"

    def logits(params: Params) -> Array:
        check_params(name, params, shapes)
        weights = np.asarray(params["W"], dtype=np.float64)
        bias = np.asarray(params["b"], dtype=np.float64)
        return features @ weights + bias

    def loss(params: Params) -> float:
        z = logits(params)
        _, log_normalizer = softmax_and_log_normalizer(z)
        return float(np.mean(log_normalizer - np.sum(z * onehot, axis=1)))

    def grad(params: Params) -> dict[str, Array]:
        probs, _ = softmax_and_log_normalizer(logits(params))
        residual = (probs - onehot) / n
        return {"W": features.T @ residual, "b": residual.sum(axis=0)}

    def metrics(params: Params) -> dict[str, float]:
        predicted = np.argmax(logits(params), axis=1)
        return {"accuracy": float(np.mean(predicted == np.argmax(onehot, axis=1)))}

    rng = np.random.default_rng(seed)
    init = {
        "W": read_only(init_scale * rng.standard_normal(shapes["W"])),
        "b": read_only(np.zeros(shapes["b"])),
    }
    return Problem(
        name=name,
        init_params=init,
        loss=loss,
        grad=grad,
        target_loss=DIGITS_TARGET_LOSS,
        description=(
            f"softmax regression on scikit-learn digits (n={n}, 64 features in [0, 1], "
            "10 classes), mean cross-entropy, full batch; params W (64, 10), b (10,)"
        ),
        data={"features": features, "onehot_labels": onehot},
        metrics=metrics,
    )
