"""The Newton family of eq. (11): coupled, deflated (11d) and higher order (11c).

Eq. numbers refer to docs/spec.md. These are iterative by design: each is
the method being specified, with its stopping rule and its retries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from numpy.typing import NDArray

from shampoo_spec import CoupledNewtonConfig, EpsilonConfig, HigherOrderNewtonConfig

from .lobpcg import lobpcg_top_k, pth_root_difference
from .regularize import symmetrize

Array = NDArray[np.float64]


@dataclass(frozen=True)
class NewtonResult:
    """Outcome of eq. (11): the root, its final error max|M - I|, iterations."""

    root: Array
    error: float
    iterations: int


def coupled_newton_iteration(
    matrix: Array, root: int, config: CoupledNewtonConfig, symmetric: bool = True
) -> NewtonResult:
    """One run of the coupled Newton iteration for ``matrix^(-1/root)`` (eq. 11).

    ``z = (1 + r) / (2 ||A||_F)``, ``X_0 = z^(1/r) I``, ``M_0 = z A``;
    ``T = ((r + 1) I - M) / r``, ``X <- X T``, ``M <- T^r M``. Converges
    since the spectrum of M_0 lies in (0, (1 + r)/2]; stops at
    ``max|M - I| <= tolerance``, after ``max_iterations``, or (when
    ``error_growth_limit`` is set) when the error would grow by that factor,
    returning the previous iterate with the grown error (which then decides
    retries and failure). ``symmetric=False`` (eq. 20c's read-back factors)
    iterates on the matrix as it is: X and M are polynomials in A, so X
    approximates the primary root of the non-symmetric A, as Google's does.
    """
    a = symmetrize(matrix) if symmetric else np.asarray(matrix)
    n = a.shape[0]
    identity = np.eye(n)
    norm = float(np.linalg.norm(a))
    if not np.isfinite(norm) or norm == 0.0:
        return NewtonResult(identity.copy(), float("nan"), 0)
    z = (1.0 + root) / (2.0 * norm)
    x = identity * z ** (1.0 / root)
    m = a * z
    error = float(np.max(np.abs(m - identity)))
    it = 0
    while it < config.max_iterations and error > config.tolerance:
        t = ((root + 1.0) * identity - m) / root
        new_m = np.linalg.matrix_power(t, root) @ m
        new_error = float(np.max(np.abs(new_m - identity)))
        if config.error_growth_limit is not None and not (
            new_error < error * config.error_growth_limit
        ):
            error = new_error  # report the error that stopped it (it decides retries)
            break
        x = x @ t
        m = new_m
        error = new_error
        it += 1
    return NewtonResult(x, error, it)


def root_inverse_coupled_newton(
    matrix: Array, root: int, eps: float, config: CoupledNewtonConfig, symmetric: bool = True
) -> NewtonResult:
    """``(A + eps I)^(-1/root)`` by eq. (11), with retries at a larger ridge.

    While the error exceeds ``retry_error_threshold`` and retries remain, the
    ridge is multiplied by ``retry_epsilon_factor`` and the iteration rerun.
    """
    n = matrix.shape[0]
    ridge = eps
    result = coupled_newton_iteration(matrix + ridge * np.eye(n), root, config, symmetric)
    for _ in range(config.retries):
        if np.isfinite(result.error) and result.error <= config.retry_error_threshold:
            break
        ridge *= config.retry_epsilon_factor
        result = coupled_newton_iteration(matrix + ridge * np.eye(n), root, config, symmetric)
    return result


def root_inverse_deflated_newton(
    matrix: Array, root: int, eps: EpsilonConfig, config: CoupledNewtonConfig
) -> NewtonResult:
    """Eq. (11d): ``(A + eps I)^(-1/root)`` by eq. (11) with the top-k pairs deflated.

    LOBPCG's top-k Ritz pairs (theta, V) of A (``lobpcg_top_k``), lambda_max
    = max theta for a relative epsilon (instead of eq. 9b), then

        A_d = A - V diag(theta - min theta) V^T
        X   = Newton(A_d + eps I) - V diag(d) V^T,
        d_i = (eps + min theta)^(-1/r) - (eps + theta_i)^(-1/r)

    with eq. (11)'s retries on A_d. Where V holds exact eigenvectors this is
    the root of A + eps I itself; after fewer iterations it is not, which is
    why the error returned (the one eq. 13 judges) is
    ``max|X^r (A + eps I) - I|`` on the undeflated factor.
    """
    a = symmetrize(matrix)
    n = a.shape[0]
    top = lobpcg_top_k(a, config.deflation_rank, config.lobpcg_iterations)
    low = float(np.min(top.values))
    shift = top.vectors * np.sqrt(top.values - low)[np.newaxis, :]
    deflated = a - shift @ shift.T
    ridge = float(eps.value)
    if eps.scale == "relative":
        ridge *= max(float(np.max(top.values)), eps.relative_floor)
    result = root_inverse_coupled_newton(deflated, root, ridge, config)
    restore = top.vectors * np.sqrt(pth_root_difference(ridge, low, top.values, root))
    x = result.root - restore @ restore.T
    with np.errstate(all="ignore"):
        check = np.linalg.matrix_power(x, root) @ (a + ridge * np.eye(n))
        error = float(np.max(np.abs(check - np.eye(n))))
    return NewtonResult(x, error, result.iterations)


def root_inverse_higher_order(
    matrix: Array, root: float, config: HigherOrderNewtonConfig
) -> Array | None:
    """``A^(-1/root)`` by Meta's coupled higher-order iteration, eq. (11c); None: failed.

    ``root = p / q`` exactly (``Fraction(root)``). Ridge
    ``eps = max(rel_epsilon ||A||_inf, abs_epsilon)``, ``z = 1 / tr(A + eps I)``,
    ``X = z^(1/p) I``, ``M = z (A + eps I)``; one Newton step
    ``T = s M + (1 - s) I`` (s = -1/p), ``X <- X T``, ``M <- T^p M``; then
    while ``max|M - I| > tolerance`` and fewer than ``max_iterations`` steps:
    ``T = sum_i b_i (I - M)^i`` (Horner), ``X <- X T``, ``M <- T^p M``,
    stopping (the new iterate kept) when the error grows beyond 1.2 times or
    repeats below 1e-3. Fails when ``||A||_inf`` is not finite, when
    ``max|(A + eps I) X^p - I| > 0.1`` or when ``X^q`` is not finite.
    """
    fraction = Fraction(root)
    p, q = fraction.numerator, fraction.denominator
    matrix = symmetrize(matrix)  # as eq. (11): a no-op on the symmetric factors
    n = matrix.shape[0]
    identity = np.eye(n)
    with np.errstate(all="ignore"):
        lam = float(np.max(np.sum(np.abs(matrix), axis=1)))
        if not math.isfinite(lam):
            return None
        eps = max(lam * config.rel_epsilon, config.abs_epsilon)
        a = matrix + eps * identity
        z = float(np.float64(1.0) / np.trace(a))  # inf for a zero trace: X non-finite
        s = -1.0 / p
        x = z ** (1.0 / p) * identity
        m = z * a
        t = s * m + (1.0 - s) * identity  # one Newton step first (Meta's convergence guard)
        x = x @ t
        m = np.linalg.matrix_power(t, p) @ m
        error = float(np.max(np.abs(m - identity)))
        b = config.coefficients(p)
        iterations = 1
        while error > config.tolerance and iterations < config.max_iterations:
            iterations += 1
            base = identity - m
            t = b[-1] * base + b[-2] * identity
            for coefficient in reversed(b[:-2]):
                t = coefficient * identity + t @ base
            x = x @ t
            m = np.linalg.matrix_power(t, p) @ m
            new_error = float(np.max(np.abs(m - identity)))
            if new_error > error * 1.2 or (new_error == error and error < 1e-3):
                break  # Meta keeps this last iterate
            error = new_error
        true_error = float(np.max(np.abs(a @ np.linalg.matrix_power(x, p) - identity)))
        if true_error > 0.1:
            return None
        if q > 1:
            x = np.linalg.matrix_power(x, q)
    return x if bool(np.all(np.isfinite(x))) else None
