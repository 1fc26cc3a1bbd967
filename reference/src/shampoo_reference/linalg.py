"""Float64 linear algebra of a block: its factor contraction, mode products, orthogonalization.

Eq. numbers refer to docs/spec.md: the contraction ``G_(k) G_(k)^T`` of
eq. (6), the mode products of eq. (16) and the orthogonalized direction of
eq. (16c). The inverse roots are :mod:`shampoo_reference.roots`; rounding
to a dtype is :mod:`shampoo_reference.rounding`.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from shampoo_spec import SpectralDescentConfig

Array = NDArray[np.float64]


def factor_contraction(block: Array, k: int) -> Array:
    """``G_(k) G_(k)^T``: contract G with itself over every dim but k (eq. 6)."""
    moved = np.moveaxis(block, k, 0).reshape(block.shape[k], -1)
    return moved @ moved.T


def mode_product(tensor: Array, matrix: Array, k: int) -> Array:
    """``T x_k M``: multiply dim k of T by the symmetric matrix M (eq. 16)."""
    moved = np.moveaxis(tensor, k, 0)
    out = np.tensordot(matrix, moved, axes=([1], [0]))
    return np.moveaxis(out, 0, k)


def orthogonalize(block: Array, spectral: SpectralDescentConfig) -> Array:
    """Eq. (16c): the matrix ``block`` orthogonalized, ``orth(F~_B)``.

    ``"svd"``: ``U_r V_r^T`` over the singular pairs of the reduced SVD
    ``block = U S V^T`` above the rank tolerance ``max(m, n) eps s_max``
    (:func:`svd_rank_tolerance`; times ``sum(S)`` with
    ``scale_by_nuclear_norm``): the polar factor on the block's range, unique
    whatever its rank. ``"newton_schulz"``: ``X = block / max(||block||_F, 1e-8)``,
    transposed when it has fewer rows than columns, then ``num_iterations``
    times ``A = X^T X, X = a X + X (b A + c A A)``, transposed back: for X with
    singular values s in (0, 1] each step maps s to ``a s + b s^3 + c s^5``.
    """
    if spectral.method == "svd":
        u, s, vt = np.linalg.svd(block, full_matrices=False)
        kept = s > svd_rank_tolerance(block.shape, s, np.finfo(np.float64).eps)
        out: Array = (u * kept) @ vt
        return out * np.sum(s) if spectral.scale_by_nuclear_norm else out
    x = block / max(float(np.linalg.norm(block)), 1e-8)
    transpose = x.shape[0] < x.shape[1]
    if transpose:
        x = x.T
    a, b, c = spectral.coefficients
    for _ in range(spectral.num_iterations):
        gram = x.T @ x
        x = a * x + x @ (b * gram + c * (gram @ gram))
    return x.T if transpose else x


def svd_rank_tolerance(shape: tuple[int, ...], s: Array, eps: float) -> float:
    """Eq. (16c)'s rank tolerance ``max(m, n) * eps * s_max`` (NumPy's ``matrix_rank``).

    A singular value at or below it is a rounding error of a zero one: its
    singular vectors are arbitrary (any basis of the null space), so ``U V^T``
    over them is not a function of the block. The gradient of a softmax
    output layer, whose rows of residuals sum to zero, is always such a block.
    """
    return float(max(shape) * eps * (np.max(s) if s.size else 0.0))
