"""Eq. (11d) in torch: the LOBPCG top-k deflation of the coupled Newton root, against the
reference (docs/spec.md eq. 11d).

The torch port (:mod:`shampoo_torch.roots.lobpcg`, ``root_inverse_deflated_newton``)
makes the reference's choices in its order, so in float64 it agrees with it to rounding:
the Ritz values and the deflated part ``V diag(theta) V^T`` to 1e-12 relative after the
same number of iterations, the root to 1e-12 relative of its largest entry, and the
optimizer to the 1e-9 of test_reference_equality.py. A row's result does not depend on
the batch it is in (bit for bit, one thread: :mod:`shampoo_torch.invariance`).
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch

from shampoo_conformance.adapters.torch import run as torch_run
from shampoo_conformance.suite.deflation_factors import (
    RELATIVE,
    deflation_factor,
    google_newton,
)
from shampoo_reference import run as reference_run
from shampoo_reference.roots.lobpcg import lobpcg_top_k as reference_top_k
from shampoo_reference.roots.lobpcg import pth_root_difference as reference_difference
from shampoo_reference.roots.newton import root_inverse_deflated_newton as reference_root
from shampoo_spec import (
    BlockingConfig,
    GraftingConfig,
    ScheduleConfig,
    ShampooConfig,
    from_google,
)
from shampoo_torch import Shampoo
from shampoo_torch.roots.lobpcg import lobpcg_top_k, pth_root_difference
from shampoo_torch.roots.newton import root_inverse_deflated_newton

from .helpers import max_relative_error, stream


@pytest.mark.parametrize("seed", range(16))
def test_lobpcg_equals_reference(seed: int) -> None:
    a, k, m = deflation_factor(seed)
    want = reference_top_k(a, k, m)
    got = lobpcg_top_k(torch.tensor(a)[None], k, m)
    assert int(got.iterations[0]) == want.iterations
    if seed % 2 == 1:
        assert want.iterations < m  # the gap cases stop early: each row's own loop
    values, vectors = got.values[0].numpy(), got.vectors[0].numpy()
    np.testing.assert_allclose(values, want.values, rtol=1e-12)
    deflated = (vectors * values) @ vectors.T
    expected = (want.vectors * want.values) @ want.vectors.T
    assert np.abs(deflated - expected).max() <= 1e-12 * np.abs(expected).max()


@pytest.mark.parametrize("p", [2, 4, 6])
def test_pth_root_difference_equals_reference(p: int) -> None:
    rng = np.random.default_rng(p)
    w, alpha = 1e-3, 0.2
    beta = np.concatenate([[alpha], rng.uniform(0.2, 50.0, 8), rng.uniform(0.2, 0.2001, 3)])
    want = reference_difference(w, alpha, beta, p)
    got = pth_root_difference(torch.tensor([w], dtype=torch.float64),
                              torch.tensor([alpha], dtype=torch.float64),
                              torch.tensor(beta)[None], p)[0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=0)


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("root", [2, 4])
def test_deflated_root_equals_reference(seed: int, root: int) -> None:
    a, k, m = deflation_factor(seed)
    config = google_newton(k, m)
    want = reference_root(a, root, RELATIVE, config)
    x, ok = root_inverse_deflated_newton(torch.tensor(a)[None], root, RELATIVE, config)
    assert bool(ok[0]) == (np.isfinite(want.error) and want.error < 0.1)
    got = x[0].numpy()
    assert np.abs(got - want.root).max() <= 1e-12 * np.abs(want.root).max()


def test_deflated_root_fails_where_unconverged_pairs_leave_a_large_error() -> None:
    """Eq. (13) judges the restored root on the undeflated factor: after one LOBPCG step
    on a gapped spectrum it fails (reference error >= 0.1), and torch says so too."""
    rng = np.random.default_rng(3)
    n, k = 30, 2
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    a = (q * np.concatenate([[40.0, 30.0], rng.uniform(0.1, 20.0, n - 2)])) @ q.T
    config = google_newton(k, 1)
    want = reference_root(a, 2, RELATIVE, config)
    _, ok = root_inverse_deflated_newton(torch.tensor(a)[None], 2, RELATIVE, config)
    assert want.error >= 0.1 and not bool(ok[0])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_batch_rows_equal_each_row_alone(dtype: torch.dtype) -> None:
    """Rows stopping after different LOBPCG iteration counts, a non-finite row (the
    identity, failed) and a zero row (0 / 0 Ritz vectors after one step: NaN, failed,
    without aborting the batch) give each row exactly its result alone."""
    rng = np.random.default_rng(0)
    n, k = 24, 2
    mats = []
    for gap in (1e3, 10.0, 2.0, 1.2, 1.0):
        q, _ = np.linalg.qr(rng.standard_normal((n, n)))
        lam = np.concatenate([gap * np.array([2.0, 1.5]), rng.uniform(0.5, 1.0, n - k)])
        mats.append((q * lam) @ q.T)
    mats += [np.full((n, n), np.nan), np.zeros((n, n))]
    a = torch.tensor(np.stack(mats), dtype=dtype)
    config = google_newton(k, 20)
    top = lobpcg_top_k(torch.nan_to_num(a[:5]), k, 20)
    assert len(set(top.iterations.tolist())) > 2  # the rows stop at different steps
    x, ok = root_inverse_deflated_newton(a, 2, RELATIVE, config)
    assert ok.tolist() == [True] * 5 + [False, False]
    for i in range(len(mats)):
        xi, oki = root_inverse_deflated_newton(a[i:i + 1], 2, RELATIVE, config)
        assert bool(oki[0]) == bool(ok[i])
        assert torch.equal(xi[0], x[i]) or (bool(xi[0].isnan().any()) and not bool(ok[i]))
    # float32: the same operations in float32 (its eps for LOBPCG's tolerances).
    want = np.stack([reference_root(m, 2, RELATIVE, config).root for m in mats[:5]])
    scale = np.abs(want).max(axis=(1, 2))
    error = np.abs(x[:5].double().numpy() - want).max(axis=(1, 2)) / scale
    assert error.max() <= (1e-12 if dtype == torch.float64 else 1e-3)


# ---------------------------------------------------------------- the optimizer
#: Factors of 12, 16, 24 (and 7) above 5k: deflated; "v"'s 7 at rank 2 (7 <= 10): the
#: plain eq. (11) root beside them.
SHAPES = {"w": (12, 16), "u": (24,), "v": (7,)}

#: The deviation is rounding amplified by the restoration's cancellation: along a top
#: pair X = (eps + low)^(-1/r) - d, and while a factor has rank t < n (eps I plus t
#: outer products) low is eps-sized, so the two terms are about (theta / eps)^(1/r)
#: times their difference: about 1e2 for the vectors' r = 2 here (the reference's own
#: rounding, too); google_rank2 measures about 1.5e-10, relative_rank1_every_2 6e-12.
CASES: dict[str, ShampooConfig] = {
    # Google's defaults (relative epsilon by LOBPCG's max theta, power iteration for the
    # undeflated "v", statistics from eps I) with lobpcg_topk_precondition = 2 (2
    # iterations: about a third of the roots fail eq. 13's test and keep the previous).
    "google_rank2": dataclasses.replace(
        from_google({"learning_rate": 0.1, "block_size": 32, "graft_type": "ADAGRAD",
                     "start_preconditioning_step": 2}),
        root_inverse=google_newton(2, None), blocking=BlockingConfig(max_preconditioner_dim=32,
                                                              merge_dims_up_to=None)),
    # Statistics from 0 (rank-deficient factors early on), a root every 2nd step, rank 1
    # by 3 iterations.
    "relative_rank1_every_2": ShampooConfig(
        learning_rate=0.05, epsilon=RELATIVE, root_inverse=google_newton(1, 3),
        grafting=GraftingConfig(type="adagrad"),
        blocking=BlockingConfig(merge_dims_up_to=None),
        schedule=ScheduleConfig(precondition_frequency=2)),
}
STEPS = 10


@pytest.mark.parametrize("name", sorted(CASES))
def test_optimizer_float64_equals_reference(name: str) -> None:
    config = CASES[name]
    params, grads = stream(4000 + sorted(CASES).index(name), STEPS, SHAPES)
    ref = reference_run(config, params, grads)
    ours = torch_run(config, params, grads, dtype=np.float64)
    assert max_relative_error(params, ours, ref) <= 1e-9


def test_resume_is_bit_identical() -> None:
    """Eq. (11d) adds no state: a run saved and restored mid-way equals one that was not."""
    config = CASES["relative_rank1_every_2"]
    params, grads = stream(5000, STEPS, SHAPES)

    def make() -> tuple[list[torch.nn.Parameter], Shampoo]:
        tensors = [torch.nn.Parameter(torch.tensor(v)) for v in params.values()]
        return tensors, Shampoo(tensors, dataclasses.replace(config, factor_dtype="float64"))

    def steps(tensors: list[torch.nn.Parameter], opt: Shampoo, part: list[dict]) -> None:
        for g in part:
            for t, v in zip(tensors, g.values(), strict=True):
                t.grad = torch.tensor(v)
            opt.step()

    straight, opt = make()
    steps(straight, opt, grads)
    first, opt1 = make()
    steps(first, opt1, grads[:5])
    buffer = io.BytesIO()
    torch.save(opt1.state_dict(), buffer)
    buffer.seek(0)
    resumed, opt2 = make()
    with torch.no_grad():
        for r, f in zip(resumed, first, strict=True):
            r.copy_(f)
    opt2.load_state_dict(torch.load(buffer))
    steps(resumed, opt2, grads[5:])
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)
