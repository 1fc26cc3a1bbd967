"""Shared helpers of the datasets tests: small options, random points, tiny optimizers."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from numpy.typing import NDArray

from shampoo_datasets import Problem

Array = NDArray[np.float64]

#: Options that keep every problem small enough for finite differences.
SMALL_OPTIONS: dict[str, dict[str, object]] = {
    "digits_softmax": {},
    "ill_conditioned_least_squares": {"rows": 5, "cols": 3, "condition_number": 100.0},
    "diabetes_least_squares": {},
    "breast_cancer_logistic": {},
    "digits_mlp": {"hidden": 8},
    "markov_transformer": {
        "vocab_size": 5,
        "sequence_length": 6,
        "num_sequences": 4,
        "d_model": 8,
        "heads": 2,
        "layers": 2,
        "order": 2,
    },
}


def random_point(
    problem: Problem, rng: np.random.Generator, scale: float = 0.1
) -> dict[str, Array]:
    """``init + scale * N(0, 1)``, away from any special start (zeros, unit gains)."""
    return {k: v + scale * rng.standard_normal(v.shape) for k, v in problem.init_params.items()}


def adam(problem: Problem, learning_rate: float, steps: int) -> list[float]:
    """Losses after each of ``steps`` full-batch Adam steps (beta 0.9, 0.999, eps 1e-8)."""
    x = problem.copy_init_params()
    m = {k: np.zeros_like(v) for k, v in x.items()}
    v2 = {k: np.zeros_like(v) for k, v in x.items()}
    losses = []
    for t in range(1, steps + 1):
        g = problem.grad(x)
        for k in x:
            m[k] = 0.9 * m[k] + 0.1 * g[k]
            v2[k] = 0.999 * v2[k] + 0.001 * g[k] * g[k]
            step = (m[k] / (1 - 0.9**t)) / (np.sqrt(v2[k] / (1 - 0.999**t)) + 1e-8)
            x[k] = x[k] - learning_rate * step
        losses.append(problem.loss(x))
    return losses


def flatten(params: Mapping[str, Array], keys: list[str]) -> Array:
    return np.concatenate([np.ravel(params[k]) for k in keys])


def unflatten(vector: Array, like: Mapping[str, Array], keys: list[str]) -> dict[str, Array]:
    out, start = {}, 0
    for k in keys:
        size = like[k].size
        out[k] = vector[start : start + size].reshape(like[k].shape)
        start += size
    return out
