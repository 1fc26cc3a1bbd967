"""What every inverse-root method shares, eqs. (9)-(10): symmetry, epsilon, regularization.

Eq. numbers refer to docs/spec.md: the effective epsilon of eq. (9),
absolute or relative to lambda_max (exact, or Google's power iteration of
eq. 9b), and how it meets the eigenvalues, eq. (10).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from shampoo_spec import EpsilonConfig, power_iteration_start

Array = NDArray[np.float64]


def effective_epsilon(matrix: Array, eps: EpsilonConfig) -> float:
    """Eq. (9): eps, or eps * max(lambda_max(A), floor) when relative.

    lambda_max exact, or Google's power-iteration estimate (eq. 9b).
    """
    if eps.scale == "absolute":
        return float(eps.value)
    if eps.lambda_max == "power_iteration":
        lam_max = power_iteration_lambda_max(
            matrix, eps.power_iteration_steps, eps.power_iteration_tolerance
        )
    else:
        lam_max = float(np.linalg.eigvalsh(symmetrize(matrix))[-1])
    return float(eps.value) * max(lam_max, eps.relative_floor)


def power_iteration_lambda_max(matrix: Array, steps: int, tolerance: float) -> float:
    """Eq. (9b): Google's power iteration on A as it is (not symmetrized)."""
    v = np.asarray(power_iteration_start(matrix.shape[0]), dtype=np.float64).astype(matrix.dtype)
    s = 0.0
    for _ in range(steps):
        u = v / np.sqrt(np.sum(v * v))
        w = matrix @ u
        s_new = float(u @ w)
        moved = abs(s_new - s) > tolerance  # False for NaN: the loop stops, as Google's
        v, s = w, s_new
        if not moved:
            break
    return s


def symmetrize(matrix: Array) -> Array:
    return 0.5 * (matrix + matrix.T)


def regularized_eigenvalues(lam: Array, eps: float, placement: str) -> Array:
    """Eigenvalues after the epsilon rule of eq. (10).

    ``lam`` are the eigenvalues returned by eigh: of ``A + eps I`` for
    ``"ridge"`` and ``"ridge_floor"``, of ``A`` otherwise.
    """
    lam_min = float(lam.min())
    if placement == "pseudo_inverse":
        return lam  # no epsilon: the rank cutoff of inverse_root_eigenvalues instead
    if placement == "ridge":
        return lam + max(0.0, eps - lam_min)
    # "floor" and "ridge_floor" (whose lam are of A + eps I) both floor at eps.
    if placement == "shift_after":
        return lam - min(lam_min, 0.0) + eps
    return np.maximum(lam, eps)
