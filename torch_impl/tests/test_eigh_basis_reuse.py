"""Eq. (10h) in torch: the eigh root that keeps its stored eigenbasis while it fits
(Meta's Eigendecomposed Shampoo with ``EighEigendecompositionConfig.tolerance > 0``),
against the reference: row by row, over runs where the basis is kept on some root
steps and replaced on others (counted), and at tau = 1 (diagonal Shampoo)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from shampoo_conformance.adapters.torch import run as torch_run
from shampoo_reference import ReferenceShampoo
from shampoo_reference import run as reference_run
from shampoo_reference.roots.basis import root_inverse_reusing_basis
from shampoo_spec import (
    BlockingConfig,
    EighConfig,
    EpsilonConfig,
    ScheduleConfig,
    ShampooConfig,
    StatisticsConfig,
    from_meta,
)
from shampoo_torch.roots.basis import root_inverse_reusing_basis as torch_root

from .helpers import max_relative_error, stepped, stream

#: Factors of 6, 5, 4, 3 and a vector's 5; every one full rank from step 6 (a vector's
#: statistics gain rank 1 a step), where the roots start: a rank-deficient factor's
#: repeated eigenvalue leaves its eigenbasis to LAPACK's choice, which a kept basis
#: would then carry (docs/spec.md eq. 17c).
SHAPES = {"w": (6, 5), "m": (4, 3), "v": (5,), "s": ()}
STEPS = 24


def _config(tolerance: float, placement: str = "ridge", value: float = 1e-3,
            scale: str = "absolute", start: int = 6) -> ShampooConfig:
    """float64 factors, beta2 = 1 (a sum, whose eigenbasis settles), a root every step."""
    return ShampooConfig(
        learning_rate=0.05, factor_dtype="float64",
        root_inverse=EighConfig(basis_reuse_tolerance=tolerance),
        epsilon=EpsilonConfig(value=value, placement=placement, scale=scale),  # type: ignore[arg-type]
        statistics=StatisticsConfig(beta2=1.0),
        blocking=BlockingConfig(merge_dims_up_to=None),
        schedule=ScheduleConfig(precondition_frequency=1, start_preconditioning_step=start))


CASES: dict[str, ShampooConfig] = {
    "ridge": _config(0.05),
    "ridge_tolerance_0.3": _config(0.3),
    "shift_after": _config(0.05, "shift_after"),
    "pseudo_inverse": _config(0.05, "pseudo_inverse", value=0.0),
    "ridge_relative_epsilon": _config(0.05, value=1e-4, scale="relative"),
    "meta_eigendecomposed": from_meta({
        "lr": 0.01, "epsilon": 1e-6, "betas": (0.9, 1.0), "precondition_frequency": 1,
        "start_preconditioning_step": 6, "max_preconditioner_dim": 8,
        "preconditioner_config": {
            "type": "EigendecomposedShampooPreconditionerConfig",
            "amortized_computation_config": {"type": "EighEigendecompositionConfig",
                                             "tolerance": 0.05},
            "factor_matrix_dtype": "float64", "factor_matrix_eigenvectors_dtype": "float64",
            "factor_matrix_eigenvalues_dtype": "float64"}}),
}


class _CountingReference(ReferenceShampoo):
    """The reference, counting eq. (10h)'s decisions: a root step whose new basis is
    the stored one's columns (reordered) kept it, any other replaced it."""

    kept = 0
    replaced = 0

    def _stored_basis_root(self, basis: Any, a: Any, root: float) -> Any:
        x, q = super()._stored_basis_root(basis, a, root)
        if q is not None:
            if sorted(map(tuple, q.T)) == sorted(map(tuple, basis.T)):
                self.kept += 1
            else:
                self.replaced += 1
        return x, q


def _spd_and_bases(n: int, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Four SPD matrices and stored bases: two their eigenvectors slightly rotated (B
    nearly diagonal: kept at tau 0.05), two random orthogonal ones (replaced)."""
    rng = np.random.default_rng(seed)
    mats, bases = [], []
    for i in range(4):
        q, _ = np.linalg.qr(rng.standard_normal((n, n)))
        mats.append((q * np.logspace(0, -2, n)) @ q.T)
        if i < 2:
            turn, _ = np.linalg.qr(np.eye(n) + 1e-3 * rng.standard_normal((n, n)))
            bases.append(q @ turn)
        else:
            bases.append(np.linalg.qr(rng.standard_normal((n, n)))[0])
    return mats, bases


@pytest.mark.parametrize("placement", ["ridge", "shift_after", "pseudo_inverse"])
def test_torch_rows_equal_the_reference(placement: str) -> None:
    """Eq. (10h) in torch on a stack whose rows keep their basis (two) or take eigh's
    (two), and a non-finite row: X and the new basis as the reference's
    ``root_inverse_reusing_basis`` (eigh's eigenvectors up to their sign: two LAPACKs);
    each row as computed alone (batch invariance), the non-finite row failed."""
    n, tolerance = 6, 0.05
    mats, bases = _spd_and_bases(n, seed=30)
    mats.append(np.full((n, n), np.nan))
    bases.append(np.eye(n))
    eps = EpsilonConfig(value=0.0 if placement == "pseudo_inverse" else 1e-3,
                        placement=placement)  # type: ignore[arg-type]
    rank = ((eps.rank_cutoff_rtol(n, "float64"), eps.rank_atol) if eps.pseudo_inverse
            else None)
    pair = torch.tensor(np.stack([np.stack(bases), np.stack(mats)], axis=1))
    out, ok = torch_root(pair, 4.0, eps, tolerance)
    assert ok.tolist() == [True] * 4 + [False]
    for k, (a, b) in enumerate(zip(mats[:4], bases[:4], strict=True)):
        want = root_inverse_reusing_basis(b, a, 4.0, eps.value, placement, tolerance, rank)
        assert want is not None
        x, q = out[k, 0].numpy(), out[k, 1].numpy()
        np.testing.assert_allclose(x, want[0], rtol=0, atol=1e-11)
        if k < 2:  # kept: the stored columns themselves, sorted by diag B
            assert sorted(map(tuple, q.T)) == sorted(map(tuple, b.T))
        signs = np.where(np.sum(q * want[1], axis=0) < 0, -1.0, 1.0)
        np.testing.assert_allclose(q * signs, want[1], rtol=0, atol=1e-12)
        alone, ok_alone = torch_root(pair[k:k + 1], 4.0, eps, tolerance)
        assert bool(ok_alone[0]) and torch.equal(alone[0], out[k])


@pytest.mark.parametrize("name", sorted(CASES))
def test_float64_equals_reference(name: str) -> None:
    """float64 torch against the reference on a stream where both decisions happen
    (counted; eq. 10's fresh eigh root every step gives another run), <= 1e-10
    (measured: about 3e-15); the stored inverse roots and bases at the end are the
    reference's (bases up to each column's sign)."""
    config = CASES[name]
    params, grads = stream(seed=5, steps=STEPS, shapes=SHAPES)
    counting = _CountingReference(config, params)
    for g in grads:
        counting.step(g)
    assert counting.kept > 5 and counting.replaced > 5, (counting.kept, counting.replaced)
    ref = reference_run(config, params, grads)
    ours = torch_run(config, params, grads, dtype=np.float64)
    assert max_relative_error(params, ours, ref) <= 1e-10
    fresh = dataclasses.replace(config, root_inverse=EighConfig())
    assert max_relative_error(params, reference_run(fresh, params, grads), ref) > 1e-6
    opt = stepped(config, params, grads)
    compared = 0
    for view in opt.blocks():
        bs = counting.state[view.name].blocks[view.block]
        assert view.inverse_roots is not None and view.eigenbases is not None
        for k, want in enumerate(bs.eigenbases):
            if want is None:
                assert view.eigenbases[k] is None
                continue
            x, q = view.inverse_roots[k].numpy(), view.eigenbases[k].numpy()
            np.testing.assert_allclose(x, bs.inverse_roots[k], rtol=0,
                                       atol=1e-9 * np.abs(bs.inverse_roots[k]).max())
            signs = np.where(np.sum(q * want, axis=0) < 0, -1.0, 1.0)
            np.testing.assert_allclose(q * signs, want, rtol=0, atol=1e-9)
            compared += 1
    assert compared >= 5


def test_tolerance_one_is_diagonal_shampoo() -> None:
    """tau = 1 always fits: every stored basis stays a permutation of I and X_k =
    diag(diag(A_k) + eps)^(-1/r_k) (eq. 10h with eq. 10's ridge, no shift: each
    diag(A_k) + eps >= eps); the run is the reference's."""
    config = _config(1.0, start=1)
    params, grads = stream(seed=6, steps=8, shapes=SHAPES)
    ref = reference_run(config, params, grads)
    ours = torch_run(config, params, grads, dtype=np.float64)
    assert max_relative_error(params, ours, ref) <= 1e-10
    opt = stepped(config, params, grads)
    checked = 0
    for view in opt.blocks():
        assert view.factors is not None and view.eigenbases is not None
        assert view.inverse_roots is not None
        for k, q in enumerate(view.eigenbases):
            if q is None:
                continue
            a, x = view.factors[k].numpy(), view.inverse_roots[k].numpy()
            assert set(np.unique(q.numpy())) <= {0.0, 1.0}
            assert torch.equal(q @ q.T, torch.eye(q.shape[0], dtype=q.dtype))
            np.testing.assert_allclose(x, np.diag((np.diag(a) + 1e-3) ** (-1 / view.roots[k])),
                                       rtol=1e-14, atol=0)
            checked += 1
    assert checked >= 5
