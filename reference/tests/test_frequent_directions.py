"""Frequent-directions sketches (docs/spec.md eqs. 6c, 10d) against closed forms.

Independent checks of the reference's sketch: the first root from the SVD of
the gradient itself, the frequent-directions error bound (Liberty 2013;
Ghashami et al. 2016) over many steps, the identity while the sketch spans at
most r directions, the reset, and the averaged statistics gradient of eq. (6c).
The rounding of a float64 eigendecomposition of a well-separated spectrum is
about u ||M|| (u = 2^-53); the tolerances below are 1e3 u relative (the
inverse root's exponent, the sums over steps and the matrix size n <= 12
each add a small factor), far below the effect each rule has.
"""

from __future__ import annotations

import numpy as np
import pytest

import shampoo_spec as ss
from shampoo_reference import ReferenceShampoo

U = 2.0**-53
TOL = 1e3 * U


def _config(rank: int, **kw: object) -> ss.ShampooConfig:
    """One factor per block (the parameters are matrices with the last dim left alone),
    roots every step from step 1, no graft: the direction is X G itself."""
    fd_kw = {k: kw.pop(k) for k in ("average_gradients", "reset_every") if k in kw}
    beta2 = kw.pop("beta2", 1.0)
    schedule = kw.pop("schedule", ss.ScheduleConfig())
    eps = kw.pop("epsilon", ss.EpsilonConfig(value=1e-30))
    dims = kw.pop("preconditioned_dims", "all_but_last")
    assert not kw
    return ss.ShampooConfig(
        learning_rate=1.0,
        statistics=ss.StatisticsConfig(beta2=beta2),
        epsilon=eps,
        frequent_directions=ss.FrequentDirectionsConfig(rank=rank, **fd_kw),
        exponents=ss.ExponentConfig(override=2.0),
        grafting=ss.GraftingConfig(type="none"),
        momentum=ss.MomentumConfig(momentum=0.0),
        blocking=ss.BlockingConfig(max_preconditioner_dim=1024, merge_dims_up_to=None,
                                   preconditioned_dims=dims),
        schedule=schedule,
        factor_dtype="float64",
    )


def _direction(opt: ReferenceShampoo, g: np.ndarray) -> np.ndarray:
    """The step's direction X G (learning rate 1, no graft, no momentum)."""
    before = opt.params["w"].copy()
    return before - opt.step({"w": g})["w"]


def test_first_root_is_the_gradients_top_singular_pairs_and_tail() -> None:
    """One step from an empty sketch: M = G G^T, so with G = P diag(s) Q^T the kept
    directions are P_r, lambda' = s_i^2 - s_{r+1}^2, rho' = s_{r+1}^2 and
    X = P_r diag(s_i^-1) P_r^T + s_{r+1}^-1 (I - P_r P_r^T) at root 2."""
    n, m, r = 9, 6, 3
    rng = np.random.default_rng(0)
    g = rng.standard_normal((n, m))
    opt = ReferenceShampoo(_config(r), {"w": np.zeros((n, m))})
    d = _direction(opt, g)
    p, s, _ = np.linalg.svd(g)
    pr = p[:, :r]
    x = (pr / s[:r]) @ pr.T + (np.eye(n) - pr @ pr.T) / s[r]
    sketch = opt.state["w"].blocks[0].sketches[0]
    assert sketch is not None
    assert np.allclose(sketch.lam, s[:r] ** 2 - s[r] ** 2, rtol=TOL, atol=0)
    assert abs(sketch.rho - s[r] ** 2) <= TOL * s[r] ** 2
    assert np.abs(d - x @ g).max() <= TOL * np.abs(x @ g).max()
    # Not the full-matrix root (the tail replaces s_{r+1..}): the rule shows.
    full = (p[:, :m] / s) @ p[:, :m].T
    assert np.abs(d - full @ g).max() > 1e-2 * np.abs(full @ g).max()


@pytest.mark.parametrize("rank", [1, 3])
def test_sketch_obeys_the_frequent_directions_error_bound(rank: int) -> None:
    """With beta2 = 1 (and eps negligible) the sketch B = U diag(lambda) U^T of the
    summed statistics A = sum C_t satisfies 0 <= A - B <= rho I (rho the summed cuts):
    the frequent-directions guarantee, which no wrong deflation or tail keeps."""
    n, m = 10, 2
    rng = np.random.default_rng(rank)
    opt = ReferenceShampoo(_config(rank), {"w": np.zeros((n, m))})
    a = np.zeros((n, n))
    for _ in range(12):
        g = rng.standard_normal((n, m)) * rng.uniform(0.5, 2.0)
        opt.step({"w": g})
        a += g @ g.T
        sk = opt.state["w"].blocks[0].sketches[0]
        assert sk is not None
        b = (sk.u * sk.lam) @ sk.u.T
        gap = np.linalg.eigvalsh(a - b)
        scale = np.linalg.norm(a, 2)
        assert gap.min() >= -TOL * scale
        assert gap.max() <= sk.rho + TOL * scale
    assert sk.rho > 0  # the bound was not met trivially by an exact sketch


def test_sketch_of_rank_at_most_r_leaves_the_dim_unpreconditioned() -> None:
    """Rank-1 observations (a vector parameter): while the sketch spans at most r
    directions rho' = 0 and X = I (Google's has_zeros); from the (r+1)-th step on the
    tail is positive and X is the sketch's root."""
    n, r = 8, 3
    rng = np.random.default_rng(1)
    opt = ReferenceShampoo(_config(r, preconditioned_dims="all"), {"w": np.zeros(n)})
    for t in range(1, r + 3):
        g = rng.standard_normal(n)
        d = _direction(opt, g)
        sk = opt.state["w"].blocks[0].sketches[0]
        assert sk is not None
        if t <= r:
            assert sk.rho == 0.0
            assert np.abs(d - g).max() <= 4 * U * np.abs(opt.params["w"]).max()  # X = I
            assert np.count_nonzero(sk.lam) == t
        else:
            assert sk.rho > 0
            assert np.abs(d - g).max() > 1e-3 * np.abs(g).max()


def test_reset_empties_the_sketch_on_its_steps() -> None:
    """reset_every = 3: the sketch after step 4 ((4 - 1) mod 3 = 0) is that of a fresh
    optimizer given step 4's gradient alone; after step 3 it is not."""
    n, m, r = 9, 5, 2
    rng = np.random.default_rng(2)
    grads = [rng.standard_normal((n, m)) for _ in range(4)]
    opt = ReferenceShampoo(_config(r, reset_every=3, beta2=0.9), {"w": np.zeros((n, m))})
    kept = ReferenceShampoo(_config(r, beta2=0.9), {"w": np.zeros((n, m))})
    fresh = ReferenceShampoo(_config(r, beta2=0.9), {"w": np.zeros((n, m))})
    for g in grads:
        opt.step({"w": g})
        kept.step({"w": g})
    fresh.step({"w": grads[3]})
    never = kept.state["w"].blocks[0].sketches[0]
    assert never is not None
    got = opt.state["w"].blocks[0].sketches[0]
    want = fresh.state["w"].blocks[0].sketches[0]
    assert got is not None and want is not None
    assert np.allclose(got.lam, want.lam, rtol=TOL, atol=0)
    assert abs(got.rho - want.rho) <= TOL * want.rho
    assert np.abs(np.abs(got.u.T @ want.u) - np.eye(r)).max() < 1e-10  # same directions
    assert never.rho > 1.5 * want.rho  # without the reset the tail carries steps 1-3


def test_averaged_statistics_gradient_is_the_period_mean() -> None:
    """average_gradients with statistics every 3 steps (anchored at the start: steps 1,
    4, 7): C after step 4 is (g2 + g3 + g4)/3 times its transpose, after step 1 g1/3."""
    n, m, r = 6, 4, 1
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal((n, m)) for _ in range(4)]
    schedule = ss.ScheduleConfig(precondition_frequency=3, statistics_frequency=3,
                                 period_anchor="start", roots_before_start=True)
    opt = ReferenceShampoo(_config(r, average_gradients=True, schedule=schedule),
                           {"w": np.zeros((n, m))})
    for t, g in enumerate(grads, start=1):
        opt.step({"w": g})
        c = opt.state["w"].blocks[0].factors[0]
        assert c is not None
        if t == 1:
            want = (g / 3) @ (g / 3).T
            assert np.abs(c - want).max() <= TOL * np.abs(want).max()
    mean = sum(grads[1:]) / 3
    want = mean @ mean.T
    assert np.abs(c - want).max() <= TOL * np.abs(want).max()
    assert opt.state["w"].gradient_sum is not None
    assert not opt.state["w"].gradient_sum.any()  # emptied after the statistics step
