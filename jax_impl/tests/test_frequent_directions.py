"""Eqs. (6c), (10d): frequent-directions (Sketchy) sketches of the large factors.

float64 against the reference (<= 1e-12 relative): rank 1 and 3, beta2 = 1
and < 1, ``average_gradients`` with statistics and roots every 3rd step
(and a root step at the start step between them), ``reset_every``,
relative and absolute epsilon, a 3-d parameter, blocks that leave some
factors at ``n <= rank + 2`` (eq. 6 and the configured root), lagged roots,
a refused block, and the states themselves (sketch, observation, root, the
gradient sum). :func:`shampoo_jax.roots.frequent_directions_root` against
the reference's on its own, ``has_zeros`` and a non-finite observation
included. A checkpoint taken mid-period (the gradient sum half full)
resumes bit for bit. The sharded path: tests/test_sharded.py's
``frequent_directions`` config.

The vector's sketch spans at most r directions on its first steps (rank-1
observations): sigma_{r+1} is rounding noise there, which eq. (10d)'s
cutoff ``n eps_f sigma_1`` counts as 0, so X = I in both programs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shampoo_jax
import shampoo_spec as ss
from shampoo_jax.blocks import make_layout
from shampoo_jax.roots import Sketch, frequent_directions_root, tearfree_sketch_root
from shampoo_reference import ReferenceShampoo
from shampoo_reference import run as reference_run
from shampoo_reference.roots.sketch import Sketch as ReferenceSketch
from shampoo_reference.roots.sketch import frequent_directions_root as reference_root
from shampoo_reference.roots.sketch import tearfree_sketch_root as reference_tearfree_root

from .helpers import reference_error, relative_error, run_x64, stream
from .sharded_helpers import assert_bitwise, trajectory, transformation

#: Unblocked: w's factors 8 and 6, t's 6, 5 and 7 (5 <= rank + 2 for rank 3:
#: eq. 6 and the configured root), v's 9 (rank-1 observations).
SHAPES: dict[str, tuple[int, ...]] = {"w": (8, 6), "t": (6, 5, 7), "v": (9,)}
#: In blocks of 5: w's blocks 5 x 5 and 2 x 5 (factor 2 not sketched), t's
#: 5 x 5 x 5 down to 1 x 5 x 2, v's 5 and 4 (4 not sketched at rank 1).
BLOCKED_SHAPES: dict[str, tuple[int, ...]] = {"w": (12, 10), "t": (6, 5, 7), "v": (9,)}
STEPS = 12

BASE = ss.ShampooConfig(
    learning_rate=0.05,
    epsilon=ss.EpsilonConfig(value=1e-6),
    grafting=ss.GraftingConfig(type="adagrad"),  # bounded steps whatever X is
    blocking=ss.BlockingConfig(merge_dims_up_to=None),
    schedule=ss.ScheduleConfig(precondition_frequency=1, start_preconditioning_step=1),
    frequent_directions=ss.FrequentDirectionsConfig(rank=1),
)


def _fd(config: ss.ShampooConfig, **fields: Any) -> ss.ShampooConfig:
    fd = config.frequent_directions
    assert fd is not None
    return dataclasses.replace(config, frequent_directions=dataclasses.replace(fd, **fields))


EVERY_3 = ss.ScheduleConfig(precondition_frequency=3, statistics_frequency=3,
                            start_preconditioning_step=2)
CASES: dict[str, tuple[ss.ShampooConfig, dict[str, tuple[int, ...]]]] = {
    "rank1_sum": (BASE, SHAPES),
    "rank3_ema": (dataclasses.replace(_fd(BASE, rank=3),
                                      statistics=ss.StatisticsConfig(beta2=0.95)), SHAPES),
    # Eq. (6c): G^ = S / 3 in every factor; the start step 2 is a root step
    # before any statistics step: it folds the initial (zero) observation.
    "average_gradients": (dataclasses.replace(
        _fd(BASE, rank=2, average_gradients=True), schedule=EVERY_3,
        statistics=ss.StatisticsConfig(beta2=0.9)), SHAPES),
    # Eq. (10d): emptied at steps 1, 5, 9; eps_t = 1e-3 max(lambda_1, floor).
    "reset_relative": (dataclasses.replace(
        _fd(BASE, rank=2, reset_every=4), statistics=ss.StatisticsConfig(beta2=0.9),
        epsilon=ss.EpsilonConfig(value=1e-3, scale="relative")), SHAPES),
    "average_reset_relative_sum": (dataclasses.replace(
        _fd(BASE, rank=3, average_gradients=True, reset_every=4, relative_floor=1e-3),
        schedule=EVERY_3, epsilon=ss.EpsilonConfig(value=1e-4, scale="relative")), SHAPES),
    # Eq. (10e), tearfree's Sketchy: every factor sketched at min(n, 2), EMA (tail decayed
    # by sqrt(beta2)), epsilon relative to sigma_1 + sqrt(beta2) rho.
    "tearfree_ema_relative": (dataclasses.replace(
        _fd(BASE, rank=2, rule="tearfree"), statistics=ss.StatisticsConfig(beta2=0.9),
        epsilon=ss.EpsilonConfig(value=1e-3, scale="relative")), SHAPES),
    # A sum, absolute epsilon, sketches every 3rd step (the last one used in between).
    "tearfree_every_3_sum": (dataclasses.replace(
        _fd(BASE, rank=3, rule="tearfree"), schedule=EVERY_3,
        epsilon=ss.EpsilonConfig(value=1e-2)), SHAPES),
    "blocked": (dataclasses.replace(
        _fd(BASE, reset_every=5), statistics=ss.StatisticsConfig(beta2=0.95),
        blocking=ss.BlockingConfig(max_preconditioner_dim=5, merge_dims_up_to=None)),
        BLOCKED_SHAPES),
    # Eq. (8): the roots (and sketches) refreshed at t act from t + 1; an adam
    # graft, momentum and coupled Newton roots for the small factors.
    "lagged_momentum": (dataclasses.replace(
        _fd(BASE, rank=2, average_gradients=True),
        schedule=ss.ScheduleConfig(precondition_frequency=2, statistics_frequency=2,
                                   roots_take_effect="next_step"),
        statistics=ss.StatisticsConfig(beta2=0.99),
        grafting=ss.GraftingConfig(type="adam", beta2=0.999, bias_correction=True),
        momentum=ss.MomentumConfig(momentum=0.5, nesterov=True),
        root_inverse=ss.CoupledNewtonConfig(tolerance=1e-13, max_iterations=300)), SHAPES),
}


@pytest.mark.parametrize("name", list(CASES))
def test_float64_equals_reference(name: str) -> None:
    config, shapes = CASES[name]
    err, where = reference_error(config, shapes, STEPS)
    assert err <= 1e-12, f"{name}: relative error {err:.3e} at {where}"


def test_sketches_change_the_run() -> None:
    """Without the sketches (eq. 6 everywhere) the reference takes another trajectory."""
    config, shapes = CASES["average_gradients"]
    params, grads = stream(shapes, steps=6, seed=4)
    plain = dataclasses.replace(config, frequent_directions=None)
    assert relative_error(reference_run(plain, params, grads),
                          reference_run(config, params, grads), params)[0] > 1e-3


def _reference_after(config: ss.ShampooConfig, params: dict[str, np.ndarray],
                     grads: list[dict[str, np.ndarray]]) -> ReferenceShampoo:
    ref = ReferenceShampoo(dataclasses.replace(config, factor_dtype="float64"),
                           {k: v.copy() for k, v in params.items()})
    for g in grads:
        ref.step(g)
    return ref


def _assert_close(got: Any, want: np.ndarray, what: str, rtol: float = 1e-11) -> None:
    got, want = np.asarray(got), np.asarray(want)
    scale = max(float(np.max(np.abs(want), initial=0.0)), 1e-300)
    err = float(np.max(np.abs(got - want), initial=0.0)) / scale
    assert err <= rtol, f"{what}: {err:.3e} relative"


@pytest.mark.parametrize("name", ["average_gradients", "reset_relative", "blocked"])
def test_state_equals_reference(name: str) -> None:
    """After 11 steps (mid-period for the averaged case: S holds steps 10 and 11), every
    factor slot, sketch (lambda, rho and U diag(lambda) U^T; U's column signs are
    eigh's choice), inverse root and gradient sum is the reference's."""
    config, shapes = CASES[name]
    params, grads = stream(shapes, steps=11, seed=4)
    ref = _reference_after(config, params, grads)
    _, s, _ = run_x64(lambda: shampoo_jax.shampoo(
        dataclasses.replace(config, factor_dtype="float64")), params, grads)
    names = sorted(params)
    layout = make_layout(tuple(tuple(np.shape(params[k])) for k in names), config)
    sketched = 0
    for grp, gs in zip(layout.groups, s.groups, strict=True):
        for row, (leaf, block) in enumerate(grp.members):
            bs = ref.state[names[leaf]].blocks[block]
            for i, k in enumerate(grp.preconditioned_dims):
                where = f"{names[leaf]} block {block} dim {k}"
                _assert_close(gs.factors[i][row], bs.factors[k], f"factor {where}")
                _assert_close(gs.inverse_roots[i][row], bs.inverse_roots[k], f"root {where}")
                mine, theirs = gs.sketch(i), bs.sketches[k]
                assert (mine is None) == (theirs is None), where
                if mine is None or theirs is None:
                    continue
                sketched += 1
                _assert_close(mine.lam[row], theirs.lam, f"lambda {where}")
                _assert_close(mine.rho[row], theirs.rho, f"rho {where}")
                u = np.asarray(mine.u[row])
                _assert_close(u * np.asarray(mine.lam[row]) @ u.T,
                              theirs.u * theirs.lam @ theirs.u.T, f"U lambda U^T {where}")
    assert sketched >= 3
    fd = config.frequent_directions
    assert fd is not None
    if fd.average_gradients:
        for k in names:
            want = ref.state[k].gradient_sum
            assert want is not None and np.any(want != 0)
            _assert_close(np.asarray(s.gradient_sum[k]).reshape(want.shape), want,
                          f"gradient sum {k}", rtol=0.0)
    else:
        assert s.gradient_sum is None


def test_rank_deficient_observation_leaves_the_dim_unpreconditioned() -> None:
    """Eq. (10d)'s has_zeros: a first gradient with one nonzero entry has observations
    diag(c, 0, ...) (exact zeros), so lambda'_2 = 0 (rank 2) and X = I exactly, as in
    the reference; the run then goes on as the reference's."""
    config = CASES["reset_relative"][0]
    shapes = {"w": (8, 6)}
    params, grads = stream(shapes, steps=6, seed=2)
    grads[0]["w"] = np.zeros((8, 6))
    grads[0]["w"][2, 3] = 1.5
    ref = _reference_after(config, params, grads[:1])
    _, s, _ = run_x64(lambda: shampoo_jax.shampoo(
        dataclasses.replace(config, factor_dtype="float64")), params, grads[:1])
    bs = ref.state["w"].blocks[0]
    for i, x in enumerate(s.groups[0].inverse_roots):
        np.testing.assert_array_equal(np.asarray(x[0]), np.eye(x.shape[-1]))
        np.testing.assert_array_equal(bs.inverse_roots[i], np.eye(x.shape[-1]))
        sk = s.groups[0].sketch(i)
        assert sk is not None
        assert float(sk.lam[0, 0]) > 0 and float(sk.lam[0, 1]) == 0.0
        assert float(sk.rho[0]) == 0.0
    err, where = relative_error(
        _jax_run(config, params, grads), reference_run(config, params, grads), params)
    assert err <= 1e-12, f"relative error {err:.3e} at {where}"


def _jax_run(config: ss.ShampooConfig, params: dict[str, np.ndarray],
             grads: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    from shampoo_conformance.adapters.jax import run as jax_run

    return jax_run(config, params, grads, dtype=np.float64)


def test_refused_block_adds_nothing_to_the_sum() -> None:
    """Eq. (3) with average_gradients: a block with a NaN is skipped, its entries add 0
    to S, the other blocks of the parameter go on; as the reference."""
    config = dataclasses.replace(
        CASES["blocked"][0], frequent_directions=ss.FrequentDirectionsConfig(
            rank=1, average_gradients=True), schedule=EVERY_3,
        failure=ss.FailureConfig(nonfinite_gradient="skip_block"))
    params, grads = stream(BLOCKED_SHAPES, steps=9, seed=6)
    grads[3]["w"][0, 0] = np.nan  # step 4, mid-period: block (0, 0) of w
    grads[5]["t"][5, 4, 6] = np.inf  # step 6, a statistics step: t's last block
    err, where = relative_error(
        _jax_run(config, params, grads), reference_run(config, params, grads), params)
    assert err <= 1e-12, f"relative error {err:.3e} at {where}"


def _reference_sketch(u: np.ndarray, lam: np.ndarray, rho: float) -> ReferenceSketch:
    return ReferenceSketch(u.copy(), lam.copy(), float(rho))


def test_frequent_directions_root_equals_the_reference() -> None:
    """Eq. (10d) on a stack: a random sketch and observation, an empty sketch with an
    observation of rank 4 > r, empty sketches with a diagonal observation of rank 1
    (exact zeros) and a dense one of rank 1 (noise below the cutoff), both has_zeros:
    X = I; a non-finite observation (ok False, the sketch kept)."""
    rng = np.random.default_rng(0)
    n, rank, beta, root = 7, 2, 0.9, 4.0
    rtol = ss.FrequentDirectionsConfig.zero_rtol(n, "float64")
    q, _ = np.linalg.qr(rng.standard_normal((n, rank)))
    held = [(q, np.array([3.0, 1.0]), 0.5)]
    held += [(np.zeros((n, rank)), np.zeros(rank), 0.0)] * 4
    g = rng.standard_normal((n, 4))
    diagonal = np.zeros((n, n))
    diagonal[1, 1] = 2.0
    observations = [g @ g.T, g @ g.T, diagonal, np.outer(g[:, 0], g[:, 0]),
                    np.full((n, n), np.nan)]
    eps = np.full(len(held), 1e-3)
    with jax.enable_x64(True):
        sketch = Sketch(*(jnp.asarray(np.stack(z)) for z in zip(*held, strict=True)))
        new, x, ok = frequent_directions_root(
            sketch, jnp.asarray(np.stack(observations)), root, beta, jnp.asarray(eps), rtol)
    assert np.asarray(ok).tolist() == [True, True, True, True, False]
    for j in range(4):
        want, want_x = reference_root(_reference_sketch(*held[j]), observations[j], root,
                                      beta, float(eps[j]), rtol)
        u, lam = np.asarray(new.u[j]), np.asarray(new.lam[j])
        _assert_close(lam, want.lam, f"lambda {j}", 1e-13)
        _assert_close(new.rho[j], want.rho, f"rho {j}", 1e-13)
        _assert_close(u * lam @ u.T, want.u * want.lam @ want.u.T, f"U lambda U^T {j}", 1e-13)
        _assert_close(x[j], want_x, f"X {j}", 1e-13)
    for j in (2, 3):  # has_zeros
        np.testing.assert_array_equal(np.asarray(x[j]), np.eye(n))
    for a, b in zip(new, sketch, strict=True):  # non-finite: the sketch as it came
        np.testing.assert_array_equal(np.asarray(a[4]), np.asarray(b[4]))


@pytest.mark.parametrize(("epsilon", "relative"), [(1e-3, True), (1e-2, False), (0.0, True)])
def test_tearfree_sketch_root_equals_the_reference(epsilon: float, relative: bool) -> None:
    """Eq. (10e) on a stack: a random sketch with a tail and a random observation, an
    empty sketch with an observation of rank 4 > k (a tail from the first fold), an
    empty sketch with a rank-1 observation (rho' = 0: the complement gets 0), a sketch
    with a zero observation (values decay by beta, the tail by sqrt(beta)), and a
    non-finite observation (ok False, the sketch kept)."""
    rng = np.random.default_rng(3)
    n, k, beta, root = 7, 2, 0.81, 4.0
    rtol = ss.FrequentDirectionsConfig.zero_rtol(n, "float64")
    q, _ = np.linalg.qr(rng.standard_normal((n, k)))
    empty = (np.zeros((n, k)), np.zeros(k), 0.0)
    held = [(q, np.array([3.0, 1.0]), 0.5), empty, empty, (q, np.array([2.0, 0.5]), 0.3),
            empty]
    g = rng.standard_normal((n, 4))
    observations = [g @ g.T, g @ g.T, np.outer(g[:, 0], g[:, 0]), np.zeros((n, n)),
                    np.full((n, n), np.nan)]
    with jax.enable_x64(True):
        sketch = Sketch(*(jnp.asarray(np.stack(z)) for z in zip(*held, strict=True)))
        new, x, ok = tearfree_sketch_root(sketch, jnp.asarray(np.stack(observations)), root,
                                          beta, epsilon, relative, rtol)
    assert np.asarray(ok).tolist() == [True] * 4 + [False]
    for j in range(4):
        want, want_x = reference_tearfree_root(_reference_sketch(*held[j]), observations[j],
                                               root, beta, epsilon, relative, rtol)
        u, lam = np.asarray(new.u[j]), np.asarray(new.lam[j])
        _assert_close(lam, want.lam, f"lambda {j}", 1e-13)
        _assert_close(new.rho[j], want.rho, f"rho {j}", 1e-13)
        _assert_close(u * lam @ u.T, want.u * want.lam @ want.u.T, f"U lambda U^T {j}", 1e-13)
        _assert_close(x[j], want_x, f"X {j}", 1e-13)
    assert float(new.rho[2]) == 0.0  # rank 1 < k: nothing escaped
    _assert_close(new.rho[3], 0.9 * 0.3, "sqrt(beta) rho", 1e-15)
    for a, b in zip(new, sketch, strict=True):  # non-finite: the sketch as it came
        np.testing.assert_array_equal(np.asarray(a[4]), np.asarray(b[4]))


def test_state_holds_sketches_and_gradient_sum_only_with_the_config() -> None:
    """Sketched factors (n > rank + 2) get an empty sketch and X = 0 (eq. 10d, as eq.
    10c's); the others an identity root and no sketch; S (zeros) only with
    average_gradients; no new arrays without frequent_directions."""
    config = CASES["average_gradients"][0]
    params, _ = stream(SHAPES, steps=1)
    p = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
    s = shampoo_jax.shampoo(config).init(p)
    layout = make_layout(tuple(tuple(np.shape(params[k])) for k in sorted(params)), config)
    for grp, gs in zip(layout.groups, s.groups, strict=True):
        assert gs.sketches is not None and len(gs.sketches) == len(grp.preconditioned_dims)
        for i, k in enumerate(grp.preconditioned_dims):
            n, sk = grp.shape[k], gs.sketch(i)
            x = np.asarray(gs.inverse_roots[i])
            if n > 4:
                assert sk is not None
                assert sk.u.shape == (grp.size, n, 2) and sk.lam.shape == (grp.size, 2)
                assert sk.rho.shape == (grp.size,)
                assert all(not np.any(np.asarray(z)) for z in sk)
                np.testing.assert_array_equal(x, 0.0)
            else:
                assert sk is None
                np.testing.assert_array_equal(x, np.broadcast_to(np.eye(n), x.shape))
    for k in params:
        np.testing.assert_array_equal(np.asarray(s.gradient_sum[k]), 0.0)
    plain = shampoo_jax.shampoo(dataclasses.replace(config, frequent_directions=None)).init(p)
    assert plain.gradient_sum is None and all(gs.sketches is None for gs in plain.groups)
    assert len(jax.tree.leaves(s)) > len(jax.tree.leaves(plain))
    unaveraged = shampoo_jax.shampoo(_fd(config, average_gradients=False)).init(p)
    assert unaveraged.gradient_sum is None
    # After S only eq. (14e)'s Adafactor moments (None here: no arrays).
    assert shampoo_jax.ShampooState._fields[-2:] == ("gradient_sum", "adafactor")
    # After the sketches only eq. (10f)'s eigenbases (None here: no arrays).
    assert shampoo_jax.BlockGroupState._fields[-2:] == ("sketches", "eigenbases")


@pytest.mark.parametrize("name", ["average_reset_relative_sum", "tearfree_every_3_sum"])
def test_checkpoint_mid_period_resumes_bit_for_bit(name: str) -> None:
    """Saved after step 4 (statistics every 3rd step: S, with average_gradients, holds step
    4's gradient, the sketches two folds), restored into a fresh state: the run goes on
    bit for bit (eq. 10e's sketches of k = min(n, rank) directions too)."""
    config = dataclasses.replace(CASES[name][0], learning_rate=0.1)
    params, grads = stream(SHAPES, steps=9, seed=8)
    want, _ = trajectory(config, params, grads, None)
    cut = 4
    first, s = trajectory(config, params, grads[:cut], None)
    if s.gradient_sum is not None:
        assert any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(s.gradient_sum))
    assert any(np.any(np.asarray(sk.lam) > 0) for gs in s.groups
               for sk in (gs.sketches or ()) if sk is not None)
    arrays = shampoo_jax.state_to_arrays(s)
    like = transformation(config, None)[0].init(
        {k: jnp.asarray(v, jnp.float32) for k, v in params.items()})
    restored = shampoo_jax.state_from_arrays(arrays, like=like)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(s), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rest, _ = trajectory(config, dict(first[-1]), grads[cut:], None, state=restored)
    assert_bitwise(first + rest, want)
