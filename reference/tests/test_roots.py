"""Inverse roots (eqs. 10-11) against scipy.linalg.fractional_matrix_power; eq. (13)'s
eigh error test in closed form.

Tolerances follow from perturbation theory, not from tuning: for a symmetric
positive definite A with condition number kappa, a backward-stable
eigendecomposition gives A^(-1/p) with relative error about
(1/p) * kappa * u (u = 2^-53), and scipy's Schur-Pade reference carries an
error of the same order. We allow c * kappa * u with c = 1e3 (matrix size
n = 16 plus both methods' error), floored at 1e-12. The coupled Newton
iteration stops at max|M - I| <= tol, which bounds the relative error of X by
about tol / p once converged; we allow 10 * tol plus the same kappa * u term.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg

import shampoo_spec as ss
from shampoo_reference import (
    coupled_newton_iteration,
    eigenbasis_with_error,
    eigh_error,
    eigh_fails,
    root_inverse_eigh,
    root_inverse_eigh_with_error,
)
from shampoo_reference.roots.basis import qr_eigenbasis
from shampoo_reference.roots.eigh import eigh_input
from shampoo_reference.roots.newton import root_inverse_higher_order
from shampoo_spec import CoupledNewtonConfig

U = np.finfo(np.float64).eps / 2


def spd(n: int, cond: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    lam = np.logspace(0, -np.log10(cond), n)
    return (q * lam) @ q.T


def truth(a: np.ndarray, p: int) -> np.ndarray:
    return np.real(scipy.linalg.fractional_matrix_power(a, -1.0 / p))


def rel(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


CONDS = [1e0, 1e2, 1e4, 1e6, 1e8, 1e10]


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("cond", CONDS)
def test_eigh_root_matches_fractional_matrix_power(p: int, cond: float) -> None:
    a = spd(16, cond, seed=p)
    x = root_inverse_eigh(a, p, 0.0, "ridge")
    assert rel(x, truth(a, p)) <= max(1e-12, 1e3 * cond * U)


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("cond", [1e0, 1e2, 1e4, 1e6])
def test_coupled_newton_matches_fractional_matrix_power(p: int, cond: float) -> None:
    a = spd(16, cond, seed=10 + p)
    tol = 1e-10
    res = coupled_newton_iteration(a, p, CoupledNewtonConfig(max_iterations=500, tolerance=tol))
    assert res.error <= tol
    assert rel(res.root, truth(a, p)) <= 10 * tol + 1e3 * cond * U


def test_p3_is_right() -> None:
    """optax's matrix_inverse_pth_root is reported wrong at p = 3; ours must not be."""
    a = spd(8, 1e3, seed=3)
    res = coupled_newton_iteration(a, 3, CoupledNewtonConfig(tolerance=1e-12, max_iterations=500))
    x = res.root
    np.testing.assert_allclose(np.linalg.matrix_power(x, 3) @ a, np.eye(8), atol=1e-9)


def test_epsilon_placements_closed_form() -> None:
    """A = diag(4, 0, -1e-3) (PSD up to rounding): each placement's eigenvalues by hand."""
    a = np.diag([4.0, 0.0, -1e-3])
    eps = 1e-2
    ridge = root_inverse_eigh(a, 2, eps, "ridge")
    # eigenvalues of A + eps I: 4.01, 0.01, 0.009; min < eps -> shift by eps - 0.009 = 0.001.
    np.testing.assert_allclose(np.diag(ridge), np.array([4.011, 0.011, 0.01]) ** -0.5)
    after = root_inverse_eigh(a, 2, eps, "shift_after")
    # eig(A) = 4, 0, -1e-3; shift by +1e-3 + eps.
    np.testing.assert_allclose(np.diag(after), np.array([4.011, 0.011, 0.01]) ** -0.5)
    floor = root_inverse_eigh(a, 2, eps, "floor")
    np.testing.assert_allclose(np.diag(floor), np.array([4.0, 0.01, 0.01]) ** -0.5)


def test_newton_error_growth_stop_returns_previous_iterate() -> None:
    a = spd(6, 2.0, seed=1)
    grow = coupled_newton_iteration(
        a, 4, CoupledNewtonConfig(tolerance=1e-30, max_iterations=200, error_growth_limit=1.0)
    )
    # With an unreachable tolerance and a growth limit of 1 the iteration stops as soon
    # as rounding keeps the error from shrinking; the iterate returned is still accurate.
    assert 0 < grow.iterations < 200
    assert rel(grow.root, truth(a, 4)) < 1e-12


def start(n: int) -> np.ndarray:
    """Eq. (9b)'s start vector as the backends take it: float64 from the spec's tuple."""
    return np.asarray(ss.power_iteration_start(n), dtype=np.float64)


def test_power_iteration_stops_on_a_small_change_far_from_lambda_max() -> None:
    """Eq. (9b): on a factor with eigenvalues <= 1e-6 the first quotient already moves
    by <= the tolerance 1e-6 from 0, so the estimate is the Rayleigh quotient of the
    start vector, well below lambda_max (why Google's relative epsilon differs)."""
    from shampoo_reference.roots.regularize import power_iteration_lambda_max

    n = 6
    a = np.diag(1e-7 * np.arange(1.0, n + 1))
    v = start(n)
    rayleigh = float(v @ a @ v / (v @ v))
    estimate = power_iteration_lambda_max(a, 100, 1e-6)
    assert estimate == pytest.approx(rayleigh, rel=1e-14)
    assert estimate < 0.8 * 6e-7  # exact lambda_max = 6e-7
    # A separated top eigenvalue: the loop runs until the quotient settles.
    b = np.diag([10.0, 1.0, 1.0, 0.5])
    assert power_iteration_lambda_max(b, 100, 1e-6) == pytest.approx(10.0, abs=1e-5)
    assert power_iteration_lambda_max(b, 1, 1e-6) == pytest.approx(
        float(start(4) @ b @ start(4)) / float(start(4) @ start(4)), rel=1e-14)
    np.testing.assert_array_equal(start(5), np.random.RandomState(1729).uniform(-1.0, 1.0, 5))

# ------------------------------------------------- eq. (13): the eigh error test
def test_eigh_error_closed_form() -> None:
    """B = diag(1, 2), Q = R(theta) a rotation, lambda = (1, 2): by hand
    Q^T B Q = [[1 + s^2, s c], [s c, 2 - s^2]], so e = max(s^2, |s c|) = |s c|."""
    b = np.diag([1.0, 2.0])
    for theta in (1e-3, 0.1, 0.5):
        s, c = np.sin(theta), np.cos(theta)
        q = np.array([[c, -s], [s, c]])
        assert eigh_error(b, np.array([1.0, 2.0]), q) == pytest.approx(abs(s * c), rel=1e-12)
    # An exact decomposition has no error: a diagonal B, Q = I.
    assert eigh_error(np.diag([3.0, 1e-9, 7.0]), np.array([3.0, 1e-9, 7.0]), np.eye(3)) == 0.0


def test_eigh_error_is_on_the_decomposed_matrix() -> None:
    """B = sym(A) + eps I for the ridge placements, sym(A) otherwise (eq. 10)."""
    a = spd(6, 1e3, seed=5) * 1e4
    eps = 0.5
    for placement in ("ridge", "ridge_floor", "shift_after", "floor"):
        result = root_inverse_eigh_with_error(a, 2, eps, placement)
        b = eigh_input(a, eps, placement)
        lam, q = np.linalg.eigh(b)
        assert result.error == eigh_error(b, lam, q)
        assert np.array_equal(result.root, root_inverse_eigh(a, 2, eps, placement))
    basis = eigenbasis_with_error(a)  # eq. (17): B = sym(A), no epsilon
    sym = 0.5 * (a + a.T)
    lam, q = np.linalg.eigh(sym)
    assert basis.error == eigh_error(sym, lam, q) and np.array_equal(basis.root, q)


def test_eigh_fails_compares_in_float32() -> None:
    """fl32(e) >= fl32(tau), or e NaN: Google's comparison of its float32 error metric."""
    tau32 = ss.EighConfig(failure_threshold=0.1).failure_threshold_float32
    assert tau32 is not None
    assert eigh_fails(0.1, tau32) and eigh_fails(1.0, tau32) and eigh_fails(math.nan, tau32)
    assert not eigh_fails(0.09, tau32) and not eigh_fails(0.0, tau32)
    # Just below 0.1 in float64, but 0.1 once rounded to float32: fails, as in Google.
    below = math.nextafter(0.1, 0.0)
    assert below < 0.1 and np.float32(below) == np.float32(0.1) and eigh_fails(below, tau32)
    # Beyond float32's range e rounds to inf: fails whatever the threshold.
    huge = ss.EighConfig(failure_threshold=3e38).failure_threshold_float32
    assert huge is not None and eigh_fails(1e39, huge) and not eigh_fails(1e38, huge)
    assert eigh_fails(math.inf, math.inf) and not eigh_fails(3.4e38, math.inf)


# ------------------------------------------------------ eq. (11c) higher order
@pytest.mark.parametrize("order", [2, 3, 5])
@pytest.mark.parametrize("root", [1.0, 2.0, 4.0, 2.5, 0.75])
@pytest.mark.parametrize("cond", [1e0, 1e2, 1e4])
def test_higher_order_root_matches_fractional_matrix_power(
    order: int, root: float, cond: float
) -> None:
    """Eq. (11c) converges to ``(A + eps I)^(-1/r)``, r = p/q a fraction (5/2, 3/4 too).

    Tolerance 1e-8 (``tolerance`` 1e-12; the iteration converges quadratically or
    faster, and X^q amplifies the error of X by q, plus kappa * u as above).
    """
    a = spd(16, cond, seed=int(10 * root) + order)
    config = ss.HigherOrderNewtonConfig(order=order, abs_epsilon=1e-8, rel_epsilon=1e-9,
                                        tolerance=1e-12)
    x = root_inverse_higher_order(a, root, config)
    assert x is not None
    eps = max(1e-9 * np.abs(a).sum(axis=1).max(), 1e-8)
    expected = np.real(scipy.linalg.fractional_matrix_power(a + eps * np.eye(16), -1.0 / root))
    assert rel(x, expected) <= 1e-8 + 1e3 * cond * U


def test_higher_order_root_failures() -> None:
    """Eq. (11c) fails on ||A||_inf = inf, and when one iteration leaves
    max|(A + eps I) X^p - I| above 0.1."""
    config = ss.HigherOrderNewtonConfig()
    a = spd(8, 1e6, seed=1)
    assert root_inverse_higher_order(a, 2.0, ss.HigherOrderNewtonConfig(max_iterations=1)) is None
    assert root_inverse_higher_order(a, 2.0, config) is not None
    assert root_inverse_higher_order(np.full((3, 3), np.inf), 2.0, config) is None
    assert root_inverse_higher_order(np.zeros((3, 3)), 2.0, config) is None  # tr = 0


def test_higher_order_coefficients_are_lakic_binomials() -> None:
    """b_i = prod_{j<i} (1 + j p) / (i! p^i): the series of (1 - x)^(-1/p) (eq. 11c)."""
    for p in (1, 2, 3, 4):
        b = ss.HigherOrderNewtonConfig(order=6).coefficients(p)
        expected = [math.prod(1 + j * p for j in range(i)) / (math.factorial(i) * p**i)
                    for i in range(6)]
        np.testing.assert_allclose(b, expected, rtol=1e-15)
        # binomial series of (1 - x)^(-1/p): coefficient of x^i is (1/p)_i / i!
        assert abs(b[1] - 1.0 / p) < 1e-15


# ----------------------------------------------------- eq. (17c) QR eigenbasis
def test_qr_eigenbasis_converges_to_the_eigenvectors() -> None:
    """Eq. (17c): from the identity, enough unshifted QR steps diagonalize A + eps I; the
    columns, sorted by diag B, are eigh's eigenvectors up to sign (distinct eigenvalues)."""
    a = spd(6, 1e2, seed=11)
    q = qr_eigenbasis(np.eye(6), a, 1e-3, max_iterations=2000, tolerance=0.0)
    assert q is not None
    lam, v = np.linalg.eigh(a + 1e-3 * np.eye(6))
    np.testing.assert_allclose(np.abs(q.T @ v), np.eye(6), atol=1e-8)
    np.testing.assert_allclose(np.diag(q.T @ (a + 1e-3 * np.eye(6)) @ q), lam, rtol=1e-10)


def test_qr_eigenbasis_steps_and_the_stopping_criterion() -> None:
    """One step is ``Q Q'`` with ``B = Q' R`` (then sorted); a basis that already meets the
    tolerance takes no step, only the sort; a non-finite B fails (None)."""
    a = spd(5, 1e1, seed=12)
    rng = np.random.default_rng(3)
    q0 = np.linalg.qr(rng.standard_normal((5, 5)))[0]
    b = q0.T @ a @ q0
    step, r = np.linalg.qr(b)
    one = q0 @ step
    order = np.argsort(np.diag(r @ step), kind="stable")
    np.testing.assert_array_equal(qr_eigenbasis(q0, a, 0.0, 1, 0.0), one[:, order])
    kept = qr_eigenbasis(q0, a, 0.0, 5, 1.0)  # tolerance 1: every B fits
    np.testing.assert_array_equal(kept, q0[:, np.argsort(np.diag(b), kind="stable")])
    np.testing.assert_array_equal(qr_eigenbasis(q0, a, 0.0, 0, 0.0), kept)
    assert qr_eigenbasis(q0, np.full((5, 5), 1e308), 0.0, 1, 0.0) is None


@pytest.mark.parametrize("keep", ["largest", "smallest"])
@pytest.mark.parametrize("rank", [1, 3])
def test_low_rank_root_is_kept_eigenpairs_plus_their_mean(keep: str, rank: int) -> None:
    """Eq. (10c) written out: X = Q_K diag(x_K) Q_K^T + c (I - Q_K Q_K^T), x = (lambda +
    eps)^(-1/p) over the eigenpairs of A, K the rank largest or smallest, c the others' mean."""
    n, p, eps = 7, 4, 1e-3
    a = spd(n, 1e3, 5)
    lam, q = np.linalg.eigh(a)
    x = (lam + eps) ** (-1.0 / p)
    kept = slice(n - rank, n) if keep == "largest" else slice(0, rank)
    others = np.delete(np.arange(n), np.arange(n)[kept])
    qk = q[:, kept]
    want = (qk * x[kept]) @ qk.T + x[others].mean() * (np.eye(n) - qk @ qk.T)
    got = root_inverse_eigh_with_error(a, p, eps, "ridge", low_rank=(rank, keep))
    assert rel(got.root, want) < 1e3 * U
    assert got.error < 1e3 * U  # eq. (10b) is taken as for eq. (10)
    # Not the full root: the compressed eigenvalues are moved by a lot here.
    assert rel(got.root, root_inverse_eigh(a, p, eps, "ridge")) > 1e-2
