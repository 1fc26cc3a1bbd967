r"""A two-layer tanh network (MLP) on scikit-learn's bundled digits.

Data: the 1797 8x8 images of ``sklearn.datasets.load_digits`` (bundled, not
downloaded), each of the 64 pixel columns standardized to mean 0 and
standard deviation 1 (the always-blank pixels become 0), giving ``X`` of shape
(n, 64), n = 1797, and one-hot labels ``Y`` of shape (n, 10).

Model and loss (mean softmax cross-entropy over the full batch)::

    A = X W1 + 1 b1^T,   H = tanh(A)          W1: (64, h),  b1: (h,)
    Z = H W2 + 1 b2^T                         W2: (h, 10),  b2: (10,)
    P = softmax(Z) row-wise
    f = (1/n) sum_i [ logsumexp_k Z_ik - Z_{i, y_i} ]

Backward pass (``tanh' = 1 - tanh^2``)::

    dZ  = (P - Y) / n
    dW2 = H^T dZ,          db2 = dZ^T 1
    dA  = (dZ W2^T) * (1 - H * H)
    dW1 = X^T dA,          db1 = dA^T 1

Start (from ``seed``): Glorot-normal weights ``W ~ N(0, 2 / (fan_in + fan_out))``
and zero biases. The loss is non-convex; with h >= 32 hidden units the
network can fit the training set, so the infimum is 0 and no finite minimum
is known (``loss_floor`` is ``None``). ``metrics`` gives the training accuracy.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from . import _bundled, _validate
from ._problem import Array, Params, Problem, check_params, read_only
from ._softmax import softmax_and_log_normalizer

N_FEATURES = 64
N_CLASSES = 10
#: Mean cross-entropy counted as "solved" (the training set is then fitted,
#: accuracy 1). Measured at the default h = 32, seed 0: Adam reaches it in 64
#: steps at step 0.1 and 237 at 0.03; gradient descent in 392 at step 8.
DIGITS_MLP_TARGET_LOSS = 1e-3


@lru_cache(maxsize=1)
def _digits_standardized() -> tuple[Array, Array]:
    """Standardized features (1797, 64) and one-hot labels (1797, 10), read-only."""
    pixels, labels = _bundled.digits()
    features = _bundled.standardize(pixels)
    return read_only(features), read_only(_bundled.one_hot(labels, N_CLASSES))


def _glorot_normal(rng: np.random.Generator, fan_in: int, fan_out: int) -> Array:
    return np.asarray(
        rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / (fan_in + fan_out)),
        dtype=np.float64,
    )


def digits_mlp(*, seed: int = 0, hidden: int = 32) -> Problem:
    """64 -> ``hidden`` (tanh) -> 10 softmax classifier on standardized digits."""
    seed = _validate.seed(seed)
    hidden = _validate.size("hidden", hidden)
    features, onehot = _digits_standardized()
    labels = np.argmax(onehot, axis=1)
    n = features.shape[0]
    shapes = {
        "W1": (N_FEATURES, hidden),
        "b1": (hidden,),
        "W2": (hidden, N_CLASSES),
        "b2": (N_CLASSES,),
    }
    name = "digits_mlp"

    def forward(params: Params) -> tuple[Array, Array]:
        """Hidden activations ``H`` and logits ``Z``."""
        check_params(name, params, shapes)
        p = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
        # In place on named arrays: NumPy's check before reusing an unnamed
        # temporary of >= 256 kB (here n x h) can cost more than the arithmetic.
        h = np.asarray(features @ p["W1"], dtype=np.float64)
        h += p["b1"]
        np.tanh(h, out=h)
        return h, h @ p["W2"] + p["b2"]

    def loss(params: Params) -> float:
        _, z = forward(params)
        _, log_normalizer = softmax_and_log_normalizer(z)
        return float(np.mean(log_normalizer - np.sum(z * onehot, axis=1)))

    def grad(params: Params) -> dict[str, Array]:
        h, z = forward(params)
        probs, _ = softmax_and_log_normalizer(z)
        d_logits = (probs - onehot) / n
        d_pre = np.asarray(h * h)  # tanh' = 1 - h^2
        np.subtract(1.0, d_pre, out=d_pre)
        d_pre *= d_logits @ np.asarray(params["W2"], dtype=np.float64).T
        return {
            "W1": features.T @ d_pre,
            "b1": d_pre.sum(axis=0),
            "W2": h.T @ d_logits,
            "b2": d_logits.sum(axis=0),
        }

    def metrics(params: Params) -> dict[str, float]:
        _, z = forward(params)
        return {"accuracy": float(np.mean(np.argmax(z, axis=1) == labels))}

    rng = np.random.default_rng(seed)
    init = {
        "W1": read_only(_glorot_normal(rng, N_FEATURES, hidden)),
        "b1": read_only(np.zeros(hidden)),
        "W2": read_only(_glorot_normal(rng, hidden, N_CLASSES)),
        "b2": read_only(np.zeros(N_CLASSES)),
    }
    return Problem(
        name=name,
        init_params=init,
        loss=loss,
        grad=grad,
        target_loss=DIGITS_MLP_TARGET_LOSS,
        description=(
            f"2-layer tanh MLP 64 -> {hidden} -> 10 on scikit-learn digits (n={n}, "
            "standardized pixels), mean softmax cross-entropy, full batch; params "
            f"W1 (64, {hidden}), b1 ({hidden},), W2 ({hidden}, 10), b2 (10,); "
            "non-convex, infimum 0 (no known floor)"
        ),
        data={"features": features, "onehot_labels": onehot},
        metrics=metrics,
    )
