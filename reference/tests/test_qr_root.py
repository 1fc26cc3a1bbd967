"""Eq. (10f): the inverse root from eq. (17c)'s QR eigenbasis (Meta's Eigendecomposed
Shampoo with ``QREigendecompositionConfig``), against closed forms and independent
computations."""

from __future__ import annotations

import numpy as np
import pytest

from shampoo_reference import ReferenceShampoo
from shampoo_reference.roots.basis import root_inverse_qr
from shampoo_reference.roots.eigh import root_inverse_eigh
from shampoo_spec import BlockingConfig, EighConfig, EpsilonConfig, ShampooConfig


def spd(n: int, cond: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    lam = np.logspace(0, -np.log10(cond), n)
    return (q * lam) @ q.T


def rel(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


@pytest.mark.parametrize("placement", ["ridge", "shift_after"])
@pytest.mark.parametrize("root", [2.0, 4.0])
def test_converged_qr_root_is_the_eigh_root(placement: str, root: float) -> None:
    """Distinct eigenvalues and enough QR steps from the identity: the QR estimate is
    the eigendecomposition, so X is eq. (10)'s eigh root, to the iteration's limit.

    That limit is about sqrt(u) ~ 1.5e-8 in the eigenvectors, not u: the computed
    ``R Q'`` is not exactly symmetric, and the unshifted iteration stalls once B's
    off-diagonal entries are at that level (the eigenvalues, Rayleigh quotients, are
    then exact to u: their error is quadratic). Measured: 2.3e-8 relative in X.
    """
    a = spd(6, 1e2, seed=5)
    out = root_inverse_qr(np.eye(6), a, root, 1e-3, placement, 5000, 0.0)
    assert out is not None
    x, q = out
    assert rel(x, root_inverse_eigh(a, root, 1e-3, placement)) < 1e-7
    np.testing.assert_allclose(q.T @ q, np.eye(6), atol=1e-13)


def test_one_step_from_a_stale_basis_is_one_qr_step() -> None:
    """One step from a basis Q0 that is not A's: ``B = Q0^T (A + eps I) Q0 = Q' R``,
    ``Q = Q0 Q'``, lambda = diag(R Q'), then X = Q diag((lambda + max(0, eps -
    lambda_min))^(-1/2)) Q^T (sorting does not change X) -- not the eigh root."""
    a = spd(5, 1e1, seed=7)
    eps = 1e-2
    q0 = np.linalg.qr(np.random.default_rng(2).standard_normal((5, 5)))[0]
    b = q0.T @ (a + eps * np.eye(5)) @ q0
    step, r = np.linalg.qr(b)
    q, lam = q0 @ step, np.diag(r @ step)
    lam = lam + max(0.0, eps - lam.min())
    expected = (q * lam**-0.5) @ q.T
    out = root_inverse_qr(q0, a, 2.0, eps, "ridge", 1, 0.0)
    assert out is not None
    np.testing.assert_allclose(out[0], expected, rtol=1e-12, atol=1e-14)
    order = np.argsort(np.diag(r @ step), kind="stable")
    np.testing.assert_array_equal(out[1], q[:, order])
    assert rel(out[0], root_inverse_eigh(a, 2.0, eps, "ridge")) > 1e-3


def test_one_step_from_the_identity_is_the_factor_itself() -> None:
    """From I, B = A + eps I: its QR step gives Q = Q' (B = Q' R), lambda = diag(R Q')."""
    a = spd(4, 1e1, seed=9)
    step, r = np.linalg.qr(a + 1e-3 * np.eye(4))
    lam = np.diag(r @ step)
    out = root_inverse_qr(np.eye(4), a, 2.0, 1e-3, "ridge", 1, 0.0)
    assert out is not None
    np.testing.assert_allclose(out[0], (step * lam**-0.5) @ step.T, rtol=1e-12, atol=1e-14)


def test_tolerance_keeps_a_fitting_basis_with_its_rayleigh_quotients() -> None:
    """A basis meeting the criterion takes no step: lambda = diag(Q^T A' Q) (Meta's
    eigenvalue estimate); 0 iterations likewise."""
    a = spd(5, 1e1, seed=4)
    q0 = np.linalg.qr(np.random.default_rng(8).standard_normal((5, 5)))[0]
    lam = np.diag(q0.T @ a @ q0)
    order = np.argsort(lam, kind="stable")
    expected = (q0 * (lam - min(lam.min(), 0.0) + 1e-6) ** -0.5) @ q0.T
    for iterations, tolerance in ((5, 1.0), (0, 0.0)):
        out = root_inverse_qr(q0, a, 2.0, 1e-6, "shift_after", iterations, tolerance)
        assert out is not None
        np.testing.assert_allclose(out[0], expected, rtol=1e-12, atol=1e-14)
        np.testing.assert_array_equal(out[1], q0[:, order])


def test_pseudo_inverse_cuts_small_estimates() -> None:
    """``pseudo_inverse``: the QR estimate of A (no ridge) takes eq. (10)'s rank cutoff;
    converged, X is A's pseudo-inverse root from eigh (its null space dropped)."""
    g = np.random.default_rng(1).standard_normal((6, 3))
    a = g @ g.T  # rank 3
    out = root_inverse_qr(np.eye(6), a, 2.0, 0.0, "pseudo_inverse", 3000, 0.0, (1e-10, 0.0))
    assert out is not None
    lam, v = np.linalg.eigh(a)
    kept = lam > 1e-10 * lam.max()
    expected = (v[:, kept] * lam[kept] ** -0.5) @ v[:, kept].T
    np.testing.assert_allclose(out[0], expected, atol=1e-9)


def test_non_finite_factor_fails() -> None:
    """Eq. (13): a B that overflows is a failed root (None)."""
    assert root_inverse_qr(np.eye(3), np.full((3, 3), 1e308), 2.0, 0.0, "ridge", 1, 0.0) is None


def _run(root_inverse: EighConfig, steps: int) -> tuple[np.ndarray, ReferenceShampoo]:
    """A (6, 5) weight, unmerged (two factors, root 4 each), eps 1e-3, float64 factors,
    beta2 = 1 (a sum: no bias correction), a root step every step."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 5))
    cfg = ShampooConfig(root_inverse=root_inverse, factor_dtype="float64",
                        epsilon=EpsilonConfig(value=1e-3),
                        blocking=BlockingConfig(merge_dims_up_to=None))
    opt = ReferenceShampoo(cfg, {"w": w})
    out = w
    for _ in range(steps):
        out = opt.step({"w": rng.standard_normal((6, 5))})["w"]
    return out, opt


def test_optimizer_keeps_the_basis_between_root_steps() -> None:
    """Many QR steps give eigh's run; one step does not. Each root step starts from the
    basis stored by the one before: the last root and basis are root_inverse_qr of the
    last factor from the basis stored a step earlier."""
    eigh, _ = _run(EighConfig(), 8)
    qr_many, _ = _run(EighConfig(eigenbasis_method="qr", qr_max_iterations=3000), 8)
    assert rel(qr_many, eigh) < 1e-7  # the iteration's sqrt(u) limit (above)
    one, opt = _run(EighConfig(eigenbasis_method="qr"), 8)
    assert rel(one, eigh) > 1e-6
    _, before = _run(EighConfig(eigenbasis_method="qr"), 7)
    bs, bs7 = opt.state["w"].blocks[0], before.state["w"].blocks[0]
    for k in range(2):
        a, prev, q = bs.factors[k], bs7.eigenbases[k], bs.eigenbases[k]
        assert a is not None and prev is not None and q is not None
        np.testing.assert_allclose(q.T @ q, np.eye(q.shape[0]), atol=1e-13)
        expected = root_inverse_qr(prev, a, 4.0, 1e-3, "ridge", 1, 0.0)
        assert expected is not None
        np.testing.assert_array_equal(bs.inverse_roots[k], expected[0])
        np.testing.assert_array_equal(q, expected[1])
