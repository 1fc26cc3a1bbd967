"""Eq. (11d): the LOBPCG top-k deflation of the coupled Newton root, against closed forms.

The port's agreement with JAX's own ``lobpcg_standard`` (the routine Google
calls) is checked in jax_impl/tests/test_deflation.py, where JAX is imported.
"""

from __future__ import annotations

import numpy as np
import pytest

from shampoo_conformance.suite.deflation_factors import (
    GOOGLE_NEWTON,
    RELATIVE,
    google_newton,
)
from shampoo_reference.roots.lobpcg import lobpcg_top_k, pth_root_difference
from shampoo_reference.roots.newton import (
    root_inverse_coupled_newton,
    root_inverse_deflated_newton,
)
from shampoo_reference.roots.regularize import effective_epsilon
from shampoo_spec import CoupledNewtonConfig


def _psd(rng: np.random.Generator, n: int, spectrum: np.ndarray | None = None) -> np.ndarray:
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    lam = rng.uniform(0.1, 1.0, n) if spectrum is None else spectrum
    return (q * lam) @ q.T


def _orthonormal(x: np.ndarray) -> np.ndarray:
    q, r = np.linalg.qr(x)
    return q[:, np.abs(np.diag(r)) > 1e-12 * np.abs(r).max()]


@pytest.mark.parametrize("seed", range(6))
def test_first_iteration_is_rayleigh_ritz_on_start_directions_and_residuals(seed: int) -> None:
    """One step maximizes the Rayleigh quotient over span(e_1..e_2k, R_0).

    X_0 = e_1..e_k, P_0 = e_{k+1}..e_{2k} (the reflector's extension of the
    unit vectors), R_0 = A X_0 - X_0 diag(theta_0): the top k Ritz pairs of
    that span, computed here by an independent QR and eigendecomposition.
    """
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(11, 30)), int(rng.integers(1, 3))
    a = _psd(rng, n)
    x0 = np.eye(n)[:, :k]
    r0 = a @ x0 - x0 * np.diag(x0.T @ a @ x0)
    s = _orthonormal(np.concatenate([np.eye(n)[:, : 2 * k], r0], axis=1))
    w, v = np.linalg.eigh(s.T @ a @ s)
    want_values, want_vectors = w[::-1][:k], (s @ v[:, ::-1])[:, :k]
    got = lobpcg_top_k(a, k, 1)
    assert got.iterations == 1
    np.testing.assert_allclose(got.values, want_values, rtol=1e-13)
    np.testing.assert_allclose(np.abs(got.vectors.T @ want_vectors), np.eye(k), atol=1e-10)


@pytest.mark.parametrize("seed", range(4))
def test_converged_lobpcg_finds_the_top_eigenpairs_and_stops_early(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, k = 30, 3
    spectrum = np.concatenate([[10.0, 7.0, 5.0], rng.uniform(0.1, 1.0, n - k)])
    a = _psd(rng, n, spectrum)
    got = lobpcg_top_k(a, k, 200)
    assert got.iterations < 200  # every pair met the residual test
    np.testing.assert_allclose(got.values, spectrum[:3], rtol=1e-12)
    residual = a @ got.vectors - got.vectors * got.values
    assert np.abs(residual).max() < 1e-10


def test_lobpcg_refuses_sizes_outside_its_limit() -> None:
    with pytest.raises(ValueError, match="5 k < n"):
        lobpcg_top_k(np.eye(10), 2, 3)


@pytest.mark.parametrize("p", [2, 4, 6])
def test_pth_root_difference_equals_the_direct_difference(p: int) -> None:
    rng = np.random.default_rng(p)
    w, alpha = 1e-3, 0.2
    beta = np.concatenate([[alpha], rng.uniform(0.2, 50.0, 8)])
    direct = (w + alpha) ** (-1.0 / p) - (w + beta) ** (-1.0 / p)
    got = pth_root_difference(w, alpha, beta, p)
    assert got[0] == 0.0  # the smallest pair is restored by nothing
    np.testing.assert_allclose(got, direct, rtol=1e-13, atol=1e-15)
    assert np.all(got >= 0.0)


@pytest.mark.parametrize(("p", "k"), [(2, 1), (4, 2), (6, 3)])
def test_deflated_root_of_converged_pairs_is_the_root_itself(p: int, k: int) -> None:
    """With V exact eigenvectors, eq. (11d) is (A + eps I)^(-1/p) (eq. 11's target).

    The deflated factor's largest eigenvalue is theta_k: the Newton iteration
    sees a better conditioned matrix, and the restoration adds back exactly
    the difference of the roots along V.
    """
    rng = np.random.default_rng(p + k)
    n = 24
    spectrum = np.concatenate([np.geomspace(1e3, 1e2, k), rng.uniform(0.5, 5.0, n - k)])
    a = _psd(rng, n, spectrum)
    cfg = google_newton(k, 100, tolerance=1e-12)
    got = root_inverse_deflated_newton(a, p, RELATIVE, cfg)
    eps = 1e-6 * spectrum.max()
    lam, q = np.linalg.eigh(a)
    want = (q * (lam + eps) ** (-1.0 / p)) @ q.T
    np.testing.assert_allclose(got.root, want, rtol=0, atol=1e-9 * np.abs(want).max())
    assert got.error < 1e-9


def test_unconverged_deflation_differs_from_the_root_and_its_error_says_so() -> None:
    """After one LOBPCG step V is not an eigenbasis: X is not the root of A + eps I,
    and the error eq. (13) judges (on the undeflated factor) measures how far."""
    rng = np.random.default_rng(3)
    n, k, p = 30, 2, 2
    a = _psd(rng, n, np.concatenate([[40.0, 30.0], rng.uniform(0.1, 20.0, n - 2)]))
    cfg = google_newton(k, 1)
    got = root_inverse_deflated_newton(a, p, RELATIVE, cfg)
    plain = root_inverse_coupled_newton(a, p, effective_epsilon(a, RELATIVE),
                                        GOOGLE_NEWTON)
    gap = np.abs(got.root - plain.root).max() / np.abs(plain.root).max()
    assert gap > 1e-3
    eps = 1e-6 * lobpcg_top_k(a, k, 1).values.max()
    direct = np.abs(np.linalg.matrix_power(got.root, p) @ (a + eps * np.eye(n)) - np.eye(n)).max()
    assert got.error == pytest.approx(direct, rel=1e-12)
    assert got.error > 1e-3


def test_deflation_applies_only_above_five_times_the_rank() -> None:
    cfg = CoupledNewtonConfig(deflation_rank=2)
    assert not cfg.deflates(10) and cfg.deflates(11)
    assert not CoupledNewtonConfig().deflates(1000)
    assert cfg.lobpcg_iterations == 2
    assert CoupledNewtonConfig(deflation_rank=2, deflation_iterations=7).lobpcg_iterations == 7
    with pytest.raises(ValueError, match=r"root_inverse\.deflation_iterations = 3 is invalid"):
        CoupledNewtonConfig(deflation_iterations=3)


def test_a_zero_factor_fails_its_deflated_root() -> None:
    """LOBPCG on A = 0 meets 0/0 (NaN Ritz vectors) at its second step: the root fails
    (eq. 13 keeps the previous one), as Google's NaN error fails it."""
    from shampoo_reference.optimizer import ReferenceShampoo
    from shampoo_spec import ShampooConfig
    cfg = ShampooConfig(root_inverse=google_newton(2),
                        epsilon=RELATIVE)
    opt = ReferenceShampoo(cfg, {"w": np.zeros(12)})
    assert opt._inverse_root(np.zeros((12, 12)), 2.0) is None
