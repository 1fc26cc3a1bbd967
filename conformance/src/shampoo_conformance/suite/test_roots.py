"""Root-inverse accuracy through ``run``: every method, p = 1..8, over conditioning.

A 1-d parameter of size n receives n gradients sqrt(lambda_i) q_i, so its
factor after step n is exactly A = Q diag(lambda) Q^T with a chosen
condition number; the only root is computed at step n (start = n, frequency
3n). The next n gradients are the unit vectors e_j, so the update at step
n + j is -lr X e_j: the backend's X = A^(-1/p), column by column, compared
with the float64 eigendecomposition. Tolerance (docs/spec.md s. 5):
C * n * u * kappa for eigh, plus C * tolerance for coupled Newton.
"""

from __future__ import annotations

import numpy as np
import pytest
from numpy.typing import NDArray

import shampoo_spec as ss
from shampoo_conformance.protocol import Backend
from shampoo_conformance.suite.strategies import spd_matrix
from shampoo_conformance.suite.tolerances import SAFETY, unit_roundoff

N = 6
METHODS: dict[str, ss.RootInverseConfig] = {
    "eigh": ss.EighConfig(),
    "coupled_newton": ss.CoupledNewtonConfig(tolerance=1e-12, max_iterations=500),
}


def _recover_root(
    backend: Backend, method: str, p: int, cond: float, dtype: type
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    a = spd_matrix(N, cond, seed=p)
    lam, q = np.linalg.eigh(a)
    grads = [np.sqrt(max(lam[i], 0.0)) * q[:, i] for i in range(N)] + list(np.eye(N))
    config = ss.ShampooConfig(
        learning_rate=1.0,
        epsilon=ss.EpsilonConfig(value=0.0),
        root_inverse=METHODS[method],
        exponents=ss.ExponentConfig(override=float(p)),
        schedule=ss.ScheduleConfig(precondition_frequency=3 * N, start_preconditioning_step=N),
    )
    out = backend.run(config, {"w": np.zeros(N)}, [{"w": g} for g in grads], dtype=dtype)
    steps = [np.zeros(N)] + [np.asarray(s["w"], dtype=np.float64) for s in out]
    x = np.stack([steps[N + j] - steps[N + j + 1] for j in range(N)], axis=1)
    want = (q * lam ** (-1.0 / p)) @ q.T
    return x, want


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("cond", [1e0, 1e2, 1e4, 1e6])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_root_inverse_float64(backend: Backend, method: str, p: int, cond: float) -> None:
    x, want = _recover_root(backend, method, p, cond, np.float64)
    err = np.linalg.norm(x - want) / np.linalg.norm(want)
    # Plus rounding of the parameters, which carry the steps' sum: u * ||W|| per step.
    allowed = SAFETY * N * unit_roundoff(np.float64) * cond * 2 * N
    newton = METHODS[method]
    if isinstance(newton, ss.CoupledNewtonConfig):
        allowed += SAFETY * newton.tolerance
    assert err <= allowed, f"{method} p={p} cond={cond:g}: relative error {err:.3e} > {allowed:.3e}"


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6, 7, 8])
def test_root_inverse_float32(backend: Backend, p: int) -> None:
    if np.dtype(np.float32) not in [np.dtype(d) for d in getattr(backend, "dtypes", (np.float32,))]:
        pytest.skip(f"backend {backend.name!r} runs float64 only")
    cond = 1e2
    x, want = _recover_root(backend, "eigh", p, cond, np.float32)
    err = np.linalg.norm(x - want) / np.linalg.norm(want)
    allowed = SAFETY * N * unit_roundoff(np.float32) * cond * 2 * N
    assert err <= allowed, f"eigh float32 p={p}: relative error {err:.3e} > {allowed:.3e}"
