"""Eq. (10g), a parameter's rank cutoff (``epsilon.rank_cutoff_scope="parameter"``),
against closed forms and an independent computation.

- Diagonal factors: a vector in two blocks, one with eigenvalues 1e4, the
  other 1 and 1e-5. Eq. (10)'s own cutoff (1e-6 lambda_max = 1e-6) keeps the
  1e-5 direction, whose preconditioned gradient is then exactly 1; eq. (10g)'s
  (1e-6 * 1e4 = 1e-2) drops it: 0.
- A matrix in three row blocks, one scaled down: the reference's direction
  equals ``X_0 G X_1`` per block with each root formed here from ``eigh`` and
  the cutoff ``1e-6 max_b lambda_max(A_{b,k})``, which drops the small block
  (every eigenvalue at least a factor 10 from it, so no decision is left to
  rounding).
- A parameter that is one block: the two scopes give the same steps.

Tolerance: 1e3 u relative (u = 2^-53): two eigendecompositions of the same
small well-conditioned matrices agree to about n u ||A||, and the powers,
products and sums over a few steps add small factors.
"""

from __future__ import annotations

import numpy as np
import pytest

import shampoo_spec as ss
from shampoo_conformance.suite.rank_cutoff_problems import RTOL, diagonal_stream, tearfree_shampoo

from .helpers import directions

U = 2.0**-53
TOL = 1e3 * U


def _config(scope: str, block: int = 4, precondition_frequency: int = 1) -> ss.ShampooConfig:
    return tearfree_shampoo(scope, block=block,  # type: ignore[arg-type]
                            precondition_frequency=precondition_frequency)


def test_parameter_scope_drops_what_the_factor_scope_keeps() -> None:
    grads = diagonal_stream()
    own = directions(_config("factor"), grads)[-1]
    shared = directions(_config("parameter"), grads)[-1]
    # The fourth step's gradient is sqrt(1e-5) on entry 7, whose eigenvalue is 1e-5:
    # (1e-5)^(-1/2) sqrt(1e-5) = 1 kept (eq. 10), 0 dropped (eq. 10g).
    assert own[7] == pytest.approx(1.0, rel=TOL)
    assert shared[7] == 0.0
    # Block 0 (the largest eigenvalue) and the rest of block 1 are the same.
    np.testing.assert_allclose(shared[:7], own[:7], rtol=TOL, atol=0.0)


def _pinv_root(a: np.ndarray, p: float, cutoff: float) -> tuple[np.ndarray, float]:
    """X of eq. (10) with the given absolute cutoff; also the smallest ratio between an
    eigenvalue and the cutoff, either way (how far every decision is from rounding)."""
    lam, q = np.linalg.eigh((a + a.T) / 2)
    kept = lam > cutoff
    x = np.where(kept, np.where(kept, lam, 1.0) ** (-1.0 / p), 0.0)
    ratio = np.maximum(np.abs(lam), 1e-300) / cutoff
    margin = float(np.min(np.maximum(ratio, 1.0 / ratio)))
    return (q * x) @ q.T, margin


@pytest.mark.parametrize("precondition_frequency", [1, 2])
def test_parameter_scope_matches_an_independent_computation(
        precondition_frequency: int) -> None:
    rng = np.random.default_rng(7)
    steps, shape = 4, (12, 3)
    grads = [rng.standard_normal(shape) for _ in range(steps)]
    for g in grads:
        g[8:] *= 1e-4  # the third block's eigenvalues about 1e-8 of the others'
    config = _config("parameter", precondition_frequency=precondition_frequency)
    got = directions(config, grads)

    sums = [[np.zeros((4, 4)), np.zeros((3, 3))] for _ in range(3)]
    roots = [[np.eye(4), np.eye(3)] for _ in range(3)]
    worst_margin = np.inf
    for t, g in enumerate(grads, start=1):
        blocks = [g[4 * b:4 * b + 4] for b in range(3)]
        for b, gb in enumerate(blocks):
            sums[b][0] += gb @ gb.T
            sums[b][1] += gb.T @ gb
        if (t - 1) % precondition_frequency == 0:
            for k in range(2):
                top = max(float(np.linalg.eigvalsh(sums[b][k])[-1]) for b in range(3))
                for b in range(3):
                    roots[b][k], margin = _pinv_root(sums[b][k], 4.0, RTOL * top)
                    worst_margin = min(worst_margin, margin)
        want = np.concatenate([roots[b][0] @ blocks[b] @ roots[b][1] for b in range(3)])
        np.testing.assert_allclose(got[t - 1], want, rtol=TOL, atol=TOL * np.abs(want).max())
    assert worst_margin > 10.0, worst_margin
    # Eq. (10)'s own cutoffs keep the small block's directions: the scopes differ there.
    own = directions(_config("factor", precondition_frequency=precondition_frequency), grads)
    assert np.abs(own[-1][8:]).max() > 1e-3
    assert np.abs(got[-1][8:]).max() == 0.0


def test_one_block_parameters_do_not_see_the_scope() -> None:
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal((4, 3)) for _ in range(3)]
    own = directions(_config("factor"), grads)
    shared = directions(_config("parameter"), grads)
    for a, b in zip(own, shared, strict=True):
        np.testing.assert_array_equal(a, b)


def _pseudo_inverse(**kwargs: object) -> ss.EpsilonConfig:
    return ss.EpsilonConfig(value=0.0, placement="pseudo_inverse", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("make, field", [
    (lambda: ss.EpsilonConfig(value=1e-6, rank_cutoff_scope="parameter"), "rank_cutoff_scope"),
    (lambda: ss.EpsilonConfig(value=0.0, placement="pseudo_inverse", rank_cutoff_scope="block"),
     "rank_cutoff_scope"),
    (lambda: ss.ShampooConfig(epsilon=_pseudo_inverse(rank_cutoff_scope="parameter"),
                              low_rank=ss.LowRankRootConfig(rank=2)), "low_rank"),
    (lambda: ss.ShampooConfig(epsilon=_pseudo_inverse(rank_cutoff_scope="parameter"),
                              inverse_root_dtype="float32"), "inverse_root_dtype"),
    (lambda: ss.ShampooConfig(epsilon=_pseudo_inverse(rank_cutoff_scope="parameter"),
                              root_inverse=ss.EighConfig(eigenbasis_method="qr")),
     "eigenbasis_method"),
])
def test_parameter_scope_refuses_what_eq_10g_does_not_cover(make, field: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=field):
        make()
