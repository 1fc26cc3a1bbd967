"""Row-wise softmax and log-normalizer, shared by the classification problems."""

from __future__ import annotations

import numpy as np

from ._problem import Array


def softmax_and_log_normalizer(logits: Array) -> tuple[Array, Array]:
    """``softmax(z)`` and ``logsumexp(z)`` along the last axis, computed stably.

    Subtracting the row maximum ``m`` first keeps ``exp`` in ``(0, 1]``:
    ``logsumexp(z) = m + log sum_k exp(z_k - m)`` exactly.
    """
    shift = logits.max(axis=-1, keepdims=True)
    probs = np.asarray(logits - shift, dtype=np.float64)
    # In place on a named array: NumPy's check before reusing an unnamed
    # temporary costs more than the exp itself on arrays of a few 100 kB.
    np.exp(probs, out=probs)
    total = probs.sum(axis=-1, keepdims=True)
    probs /= total
    log_normalizer = np.asarray((np.log(total) + shift)[..., 0], dtype=np.float64)
    return probs, log_normalizer
