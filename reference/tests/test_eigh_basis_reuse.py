"""Eq. (10h): the eigh root that keeps its stored eigenbasis while it fits (Meta's
Eigendecomposed Shampoo with ``EighEigendecompositionConfig.tolerance > 0``), against
closed forms and an independent computation of each root step's decision."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shampoo_reference import ReferenceShampoo
from shampoo_spec import BlockingConfig, EighConfig, EpsilonConfig, ShampooConfig

EPS = 1e-3


def _optimizer(tolerance: float, placement: str = "ridge") -> tuple[ReferenceShampoo, np.ndarray]:
    """A (6, 5) weight, unmerged (two factors, root 4 each), float64 factors, beta2 = 1
    (a sum), a root step every step."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 5))
    cfg = ShampooConfig(root_inverse=EighConfig(basis_reuse_tolerance=tolerance),
                        factor_dtype="float64",
                        epsilon=EpsilonConfig(value=EPS, placement=placement),
                        blocking=BlockingConfig(merge_dims_up_to=None))
    return ReferenceShampoo(cfg, {"w": w}), w


def _grads(steps: int, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((6, 5)) for _ in range(steps)]


def test_tolerance_one_keeps_the_identity_a_diagonal_root() -> None:
    """tau = 1 always fits (the off-diagonal norm is at most the norm): the basis stays
    I (its columns sorted by diag B, eq. 10f) and X_k = diag(diag(A_k) + eps)^(-1/4),
    diagonal Shampoo (no shift: every diag(A_k) + eps >= eps)."""
    opt, _ = _optimizer(1.0)
    for g in _grads(4):
        opt.step({"w": g})
    bs = opt.state["w"].blocks[0]
    for k in range(2):
        a, x, q = bs.factors[k], bs.inverse_roots[k], bs.eigenbases[k]
        assert a is not None and x is not None and q is not None
        assert np.isin(q, (0.0, 1.0)).all()
        np.testing.assert_array_equal(q @ q.T, np.eye(a.shape[0]))  # a permutation
        np.testing.assert_allclose(x, np.diag((np.diag(a) + EPS) ** -0.25), rtol=1e-14, atol=0)


@pytest.mark.parametrize("placement", ["ridge", "shift_after"])
def test_a_tolerance_nothing_meets_is_eq_10_every_step(placement: str) -> None:
    """A tau no dense B meets (the smallest normal) decomposes on every root step: the
    run is eq. (10)'s eigh root run bit for bit."""
    opt, w = _optimizer(2.0**-1022, placement)
    plain = ReferenceShampoo(dataclasses.replace(opt.config, root_inverse=EighConfig()), {"w": w})
    for g in _grads(5):
        np.testing.assert_array_equal(opt.step({"w": g})["w"], plain.step({"w": g})["w"])


def test_each_root_step_keeps_a_fitting_basis_and_replaces_a_stale_one() -> None:
    """Per root step and factor, from the basis stored the step before: B = (Q^T A') Q;
    when sqrt(||B||^2 - ||diag B||^2) <= tau ||B||, Q is kept and X = Q diag(diag(B)^
    (-1/4)) Q^T; else eigh(A') gives Q and X. Both happen on this stream (a growing
    sum of gradients, whose eigenbasis settles); every X and Q equals this."""
    tau = 0.05
    opt, _ = _optimizer(tau)
    kept = replaced = 0
    before = [np.eye(6), np.eye(5)]
    for g in _grads(24):
        opt.step({"w": g})
        bs = opt.state["w"].blocks[0]
        for k in range(2):
            a, x, q = bs.factors[k], bs.inverse_roots[k], bs.eigenbases[k]
            assert a is not None and x is not None and q is not None
            ridged = a + EPS * np.eye(a.shape[0])
            b = before[k].T @ ridged @ before[k]
            off = np.sqrt(np.linalg.norm(b) ** 2 - np.linalg.norm(np.diag(b)) ** 2)
            if off <= tau * np.linalg.norm(b):
                kept += 1
                lam, want_q = np.diag(b), before[k]
            else:
                replaced += 1
                lam, want_q = np.linalg.eigh((ridged + ridged.T) / 2)
            lam = lam + max(0.0, EPS - lam.min())  # eq. (10)'s ridge rule
            np.testing.assert_allclose(x, (want_q * lam**-0.25) @ want_q.T, rtol=1e-12,
                                       atol=1e-12 * np.abs(x).max())
            # The stored basis: the same columns, possibly in another (sorted) order.
            assert {tuple(c) for c in np.round(q.T, 12)} == {
                tuple(c) for c in np.round(want_q.T, 12)}
            before[k] = q
    assert kept > 5 and replaced > 5, (kept, replaced)
