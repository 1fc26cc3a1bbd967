"""The real data sets bundled with scikit-learn, loaded once per process, read-only.

``sklearn.datasets.load_digits``, ``load_breast_cancer`` and ``load_diabetes``
read files shipped inside the scikit-learn wheel: nothing is downloaded.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ._problem import Array, read_only


def standardize(features: Array) -> Array:
    """Columns shifted to mean 0 and scaled to (population) standard deviation 1.

    A constant column (standard deviation 0, such as the always-blank corner
    pixels of digits) becomes all zeros instead of 0/0.
    """
    centered = features - features.mean(axis=0)
    std = features.std(axis=0)
    scale = np.where(std > 0.0, std, 1.0)
    return np.asarray(centered / scale, dtype=np.float64)


def one_hot(labels: Array, classes: int) -> Array:
    """``Y[i, c] = 1`` if ``labels[i] == c`` else 0, as float64."""
    out = np.zeros((labels.size, classes), dtype=np.float64)
    out[np.arange(labels.size), labels.astype(np.int64)] = 1.0
    return out


@lru_cache(maxsize=1)
def digits() -> tuple[Array, Array]:
    """Digits: pixel values 0..16 as float64 (1797, 64) and labels 0..9 as float64 (1797,)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return read_only(bunch.data), read_only(bunch.target)


@lru_cache(maxsize=1)
def breast_cancer() -> tuple[Array, Array]:
    """Wisconsin breast cancer: raw features (569, 30) and labels 0/1 (569,), float64."""
    from sklearn.datasets import load_breast_cancer

    bunch = load_breast_cancer()
    return read_only(bunch.data), read_only(bunch.target)


@lru_cache(maxsize=1)
def diabetes() -> tuple[Array, Array]:
    """Diabetes: features as bundled (442, 10) and the raw disease-progression target (442,).

    scikit-learn ships the features already centered with each column of
    Euclidean norm 1 (``scaled=True``, the default); the target is unscaled
    (values 25..346).
    """
    from sklearn.datasets import load_diabetes

    bunch = load_diabetes()
    return read_only(bunch.data), read_only(bunch.target)
