"""Batched inverse roots equal scipy.linalg.fractional_matrix_power (eqs. 10-11).

optax's own matrix_inverse_pth_root is only right for p in {1, 2, 4, 8};
these roots must be right for every p, so p = 3, 5, 6 are tested with both
methods. Float64, condition numbers up to 1e4: eigh to 1e-10 relative, the
coupled Newton iteration to its tolerance (1e-12 on M, ~1e-11 on X).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

import shampoo_spec as ss
from shampoo_jax.roots import compute_inverse_root


def spd(n: int, cond: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    lam = np.logspace(0, np.log10(cond), n)
    return (q * lam) @ q.T


@pytest.mark.parametrize("method", ["eigh", "coupled_newton"])
def test_roots_match_fractional_matrix_power(method: str) -> None:
    root_inverse = (
        ss.EighConfig() if method == "eigh"
        else ss.CoupledNewtonConfig(tolerance=1e-13, max_iterations=300)
    )
    config = ss.ShampooConfig(epsilon=ss.EpsilonConfig(value=0.0), root_inverse=root_inverse)
    mats = np.stack([spd(12, c, s) for s, c in enumerate((1.0, 1e2, 1e4))])
    with jax.enable_x64(True):
        for p in (1, 2, 3, 4, 5, 6, 8):
            x, ok = compute_inverse_root(jnp.asarray(mats), p, config)
            assert bool(jnp.all(ok)), f"p = {p}: reported failure"
            for a, xi in zip(mats, np.asarray(x), strict=True):
                want = np.real(scipy.linalg.fractional_matrix_power(a, -1.0 / p))
                err = np.linalg.norm(xi - want) / np.linalg.norm(want)
                assert err < 1e-9, f"{method} p = {p}: relative error {err:.2e}"


def test_nonfinite_or_failed_root_is_reported_per_matrix() -> None:
    config = ss.ShampooConfig(
        root_inverse=ss.CoupledNewtonConfig(max_iterations=1, failure_threshold=1e-3)
    )
    good = spd(4, 10.0, 0)
    with jax.enable_x64(True):
        bad = good.copy()
        bad[0, 0] = np.nan
        _, ok = compute_inverse_root(jnp.asarray(np.stack([good, bad])), 3, ss.ShampooConfig())
        assert ok.tolist() == [True, False]
        # 1 iteration: the error is too big.
        _, ok = compute_inverse_root(jnp.asarray(good[None]), 3, config)
        assert ok.tolist() == [False]


@pytest.mark.parametrize("method", ["eigh", "coupled_newton", "eigenbasis"])
def test_inactive_matrices_are_skipped_without_touching_the_others(method: str) -> None:
    """``active`` (masked blocks, sharding's padding) changes nothing for the active ones.

    Inactive matrices are not decomposed (their results are discarded by the
    caller): a NaN-free identity-like result, bitwise-equal active results.
    """
    config = ss.ShampooConfig(
        epsilon=ss.EpsilonConfig(value=1e-6, scale="relative"),
        root_inverse=ss.CoupledNewtonConfig() if method == "coupled_newton" else ss.EighConfig(),
        eigenvalue_correction=ss.EigenvalueCorrectionConfig() if method == "eigenbasis" else None,
    )
    mats = jnp.asarray(np.stack([spd(6, c, s) for s, c in enumerate((1.0, 1e2, 1e3, 10.0))]),
                       jnp.float32)
    active = jnp.asarray([True, False, True, False])
    x_all, ok_all = jax.jit(lambda a: compute_inverse_root(a, 4, config))(mats)
    x, ok = jax.jit(lambda a, m: compute_inverse_root(a, 4, config, m))(mats, active)
    for i in (0, 2):
        np.testing.assert_array_equal(np.asarray(x[i]), np.asarray(x_all[i]))
        assert bool(ok[i]) and bool(ok_all[i])
    assert bool(jnp.all(jnp.isfinite(x)))
    for i in (1, 3):  # really skipped: not the decomposition of the matrix
        assert not np.allclose(np.asarray(x[i]), np.asarray(x_all[i]), atol=1e-3)


@pytest.mark.parametrize("iterations", [0, 1, 3, 400])
def test_qr_eigenbasis_equals_the_reference(iterations: int) -> None:
    """Eq. (17c) on a stack: each matrix as reference ``linalg.qr_eigenbasis`` up to column
    signs (one stops early at the tolerance, one runs every step); 400 steps compile as
    a loop."""
    from shampoo_jax.roots import qr_eigenbasis
    from shampoo_reference.roots.basis import qr_eigenbasis as reference_qr

    rng = np.random.default_rng(iterations)
    mats = [spd(6, 1e2, seed=s) for s in (1, 2)]
    bases = [np.linalg.qr(rng.standard_normal((6, 6)))[0] for _ in mats]
    eps = ss.EpsilonConfig(value=1e-3)
    for tolerance in (0.0, 0.05):
        with jax.enable_x64(True):
            q, ok = qr_eigenbasis(jnp.asarray(np.stack(bases)), jnp.asarray(np.stack(mats)),
                                  eps, iterations, tolerance)
        assert bool(np.all(np.asarray(ok)))
        for k, (a, b) in enumerate(zip(mats, bases, strict=True)):
            want = reference_qr(b, a, 1e-3, iterations, tolerance)
            assert want is not None
            # Up to each column's sign: JAX's QR may return Q' S, R'' = S R (S = +-1
            # diagonal), which carries to Q S; eq. (17) is invariant to those signs.
            got = np.asarray(q[k])
            signs = np.sign(np.sum(got * want, axis=0))
            # Each QR step adds its own rounding, O(u ||B|| / gap) in the columns of
            # close eigenvalues (kappa 1e2 here): 1e-9 for a few steps; after 400,
            # 3e-8 was measured, so 1e-6 there.
            np.testing.assert_allclose(got * signs, want, atol=1e-9 if iterations < 10 else 1e-6)
            assert np.all(np.abs(np.sum(got * want, axis=0)) > 0.5)


@pytest.mark.parametrize("keep", ["largest", "smallest"])
def test_low_rank_roots_equal_the_reference_above_rank_plus_two(keep: str) -> None:
    """Eq. (10c) on factors of 7 (compressed, rank 3) and 5 (= rank + 2: the configured
    coupled Newton root instead), float64, against the reference's roots."""
    from shampoo_reference import root_inverse_eigh_with_error

    low_rank = ss.LowRankRootConfig(rank=3, keep=keep, failure_threshold=0.1)
    config = ss.ShampooConfig(epsilon=ss.EpsilonConfig(value=1e-3), low_rank=low_rank,
                              root_inverse=ss.CoupledNewtonConfig(tolerance=1e-13,
                                                                  max_iterations=300))
    big = np.stack([spd(7, 1e3, s) for s in range(2)])
    small = spd(5, 1e2, 3)
    with jax.enable_x64(True):
        x, ok = compute_inverse_root(jnp.asarray(big), 4, config)
        assert ok.tolist() == [True, True]
        for a, xi in zip(big, np.asarray(x), strict=True):
            want = root_inverse_eigh_with_error(a, 4, 1e-3, "ridge", low_rank=(3, keep)).root
            assert np.linalg.norm(xi - want) / np.linalg.norm(want) < 1e-12
        x, _ = compute_inverse_root(jnp.asarray(small[None]), 4, config)
        want = np.real(scipy.linalg.fractional_matrix_power(small + 1e-3 * np.eye(5), -0.25))
        assert np.linalg.norm(x[0] - want) / np.linalg.norm(want) < 1e-10


@pytest.mark.parametrize("placement", ["ridge", "shift_after"])
@pytest.mark.parametrize("iterations", [0, 1, 3])
def test_qr_root_equals_the_reference(placement: str, iterations: int) -> None:
    """Eq. (10f) on a stack: X as reference ``linalg.root_inverse_qr`` (X does not depend
    on the columns' signs; the basis equals it up to them), per matrix, with and without
    the early stop."""
    from shampoo_jax.roots import root_inverse_qr
    from shampoo_reference.roots.basis import root_inverse_qr as reference_root

    rng = np.random.default_rng(10 + iterations)
    mats = [spd(6, 1e2, seed=s) for s in (3, 4)]
    bases = [np.linalg.qr(rng.standard_normal((6, 6)))[0] for _ in mats]
    eps = ss.EpsilonConfig(value=1e-3, placement=placement)  # type: ignore[arg-type]
    for tolerance in (0.0, 0.05):
        with jax.enable_x64(True):
            x, q, ok = root_inverse_qr(jnp.asarray(np.stack(bases)), jnp.asarray(np.stack(mats)),
                                       4.0, eps, iterations, tolerance)
        assert bool(np.all(np.asarray(ok)))
        for k, (a, b) in enumerate(zip(mats, bases, strict=True)):
            want = reference_root(b, a, 4.0, 1e-3, placement, iterations, tolerance)
            assert want is not None
            # A few QR steps' rounding, O(u ||B|| / gap) (kappa 1e2): as the test above.
            np.testing.assert_allclose(np.asarray(x[k]), want[0], rtol=0, atol=1e-10)
            got = np.asarray(q[k])
            signs = np.sign(np.sum(got * want[1], axis=0))
            np.testing.assert_allclose(got * signs, want[1], atol=1e-9)


@pytest.mark.parametrize("placement", ["ridge", "shift_after", "pseudo_inverse"])
def test_reused_basis_root_equals_the_reference(placement: str) -> None:
    """Eq. (10h) on one stack, per matrix as reference ``linalg.root_inverse_reusing_basis``:
    a stored basis that fits (A's eigenvectors turned by 1e-3) is kept, its columns
    permuted (bitwise) and X = Q diag(f(diag B)) Q^T; a random one does not, and eigh's
    root and eigenvectors (up to signs) replace it; a non-finite A fails (ok False,
    eq. 13) without touching its neighbours; a masked matrix (``active``) is not
    needed."""
    from scipy.linalg import expm

    from shampoo_jax.roots import root_inverse_reusing_basis
    from shampoo_reference.roots.basis import root_inverse_reusing_basis as reference_root

    rng = np.random.default_rng(12)
    mats = [spd(6, 1e2, seed=s) for s in (5, 6, 7)]
    skew = rng.standard_normal((6, 6))
    fitting = np.linalg.eigh(mats[0])[1][:, ::-1] @ expm(1e-3 * (skew - skew.T))
    bases = [fitting, np.linalg.qr(rng.standard_normal((6, 6)))[0], np.eye(6)]
    mats[2] = np.full((6, 6), np.nan)
    value = 0.0 if placement == "pseudo_inverse" else 1e-3
    eps = ss.EpsilonConfig(value=value, placement=placement)  # type: ignore[arg-type]
    rank = (eps.rank_cutoff_rtol(6, "float64"), eps.rank_atol) if eps.pseudo_inverse else None
    with jax.enable_x64(True):
        x, q, ok = root_inverse_reusing_basis(
            jnp.asarray(np.stack(bases)), jnp.asarray(np.stack(mats)), 4.0, eps, 0.05,
            jnp.asarray([True, True, False]))
    assert np.asarray(ok).tolist() == [True, True, False]
    for k in (0, 1):
        want = reference_root(bases[k], mats[k], 4.0, value, placement, 0.05, rank)
        assert want is not None
        np.testing.assert_allclose(np.asarray(x[k]), want[0], rtol=0,
                                   atol=1e-12 * np.abs(want[0]).max())
        got = np.asarray(q[k])
        if k == 0:  # kept: the stored columns, sorted by diag B (eq. 10f with no QR step)
            np.testing.assert_array_equal(got, want[1])
            np.testing.assert_array_equal(got, fitting[:, ::-1])
        else:
            signs = np.sign(np.sum(got * want[1], axis=0))
            np.testing.assert_allclose(got * signs, want[1], atol=1e-12)
