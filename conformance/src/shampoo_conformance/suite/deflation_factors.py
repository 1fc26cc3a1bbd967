"""The configs and seeded factors every backend's tests of eq. (11d) share.

Google's coupled Newton root (the settings ``from_google`` gives it) with
LOBPCG deflation, Google's relative epsilon, and a seeded draw of PSD
factors on which LOBPCG either runs out of iterations or converges early.
The reference's, torch's and JAX's ``test_deflation.py`` all check their
port on these, so a change here moves all three together.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from numpy.typing import NDArray

import shampoo_spec as ss

#: Google's coupled Newton (distributed_shampoo's ``matrix_inverse_pth_root``
#: with its retries), as ``from_google`` maps it, without deflation.
GOOGLE_NEWTON = ss.CoupledNewtonConfig(
    max_iterations=100, tolerance=1e-6, error_growth_limit=1.2, retries=5,
    retry_epsilon_factor=10.0, retry_error_threshold=0.05, failure_threshold=0.1,
)

#: Google's relative epsilon (eq. 9b's lambda_max by power iteration; with
#: deflation theta_1 replaces it).
RELATIVE = ss.EpsilonConfig(
    value=1e-6, scale="relative", relative_floor=1e-25, placement="ridge_floor",
    lambda_max="power_iteration",
)


def google_newton(k: int, m: int | None = None, tolerance: float = GOOGLE_NEWTON.tolerance
                  ) -> ss.CoupledNewtonConfig:
    """:data:`GOOGLE_NEWTON` deflating k pairs after at most m LOBPCG steps
    (None: k), its Newton iteration stopped at ``tolerance``."""
    return replace(GOOGLE_NEWTON, deflation_rank=k, deflation_iterations=m, tolerance=tolerance)


def deflation_factor(seed: int) -> tuple[NDArray[np.float64], int, int]:
    """A PSD factor of size n in 11..40, k with 5k < n, and an iteration bound m.

    Even seeds: a Gram matrix G G^T (no gap: LOBPCG runs its m in 1..5
    iterations); odd seeds: k eigenvalues 1e2..1e3 over a spectrum in
    [0.5, 5] (a gap: it converges and stops before m in 12..40).
    """
    rng = np.random.default_rng(seed)
    n = int(rng.integers(11, 41))
    k = int(rng.integers(1, (n - 1) // 5 + 1))
    if seed % 2 == 0:
        g = rng.standard_normal((n, n + 3)) * rng.uniform(0.1, 3.0, n + 3)
        return g @ g.T, k, int(rng.integers(1, 6))
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    lam = np.concatenate([np.geomspace(1e3, 1e2, k), rng.uniform(0.5, 5.0, n - k)])
    return (q * lam) @ q.T, k, int(rng.integers(12, 41))
