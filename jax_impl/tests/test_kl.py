"""Eq. (6b): KL-Shampoo statistics, ``L_k <- beta2 L_k + w G~_k(k) G~_k(k)^T`` with
``G~_k = G_B x_{j != k} X_j`` and the inverse roots held before the step's refresh.

float64 against the reference (<= 1e-9 relative, docs/spec.md section 5,
as test_reference_equality.py) with eigh and coupled Newton roots, a sum
(beta2 = 1) and an EMA (beta2 = 0.9), on a matrix split into blocks, a
vector and a 3-d tensor in blocks (two other dims per factor); then the
paths around it (lagged roots, statistics every 2nd step with bias
correction, an adam graft with a filter and momentum). The factors after
the steps are the reference's; before the first root step (identity roots)
they are plain Shampoo's, bit for bit, and differ after it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shampoo_jax
import shampoo_spec as ss
from shampoo_jax.blocks import make_layout
from shampoo_reference import ReferenceShampoo
from shampoo_reference import run as reference_run

from .helpers import BLOCKED_SHAPES, blocked_base, reference_error, relative_error, stream

SHAPES = BLOCKED_SHAPES
STEPS = 10
BASE: ss.ShampooConfig = blocked_base()  # type: ignore[assignment]
ROOTS = {
    "eigh": ss.EighConfig(),
    # Tight enough that the Newton roots of both programs agree far below 1e-9.
    "coupled_newton": ss.CoupledNewtonConfig(tolerance=1e-12, max_iterations=100),
}
BETA2 = {"sum": 1.0, "ema": 0.9}
OTHER_CASES = {
    # Eq. (8): the roots refreshed at step t take effect at t + 1; eq. (6b) still
    # takes the ones held before the refresh.
    "next_step_roots": dataclasses.replace(
        BASE, statistics=ss.StatisticsConfig(kl=True, beta2=0.95),
        schedule=ss.ScheduleConfig(precondition_frequency=3, roots_take_effect="next_step")),
    # Statistics every 2nd step (under lax.cond), bias-corrected EMA, ridge_floor epsilon.
    "sparse_statistics_bias_correction": dataclasses.replace(
        BASE, statistics=ss.StatisticsConfig(kl=True, beta2=0.9, bias_correction=True),
        epsilon=ss.EpsilonConfig(value=1e-6, placement="ridge_floor"),
        schedule=ss.ScheduleConfig(precondition_frequency=2, statistics_frequency=2)),
    "adam_graft_filter_momentum": dataclasses.replace(
        BASE, statistics=ss.StatisticsConfig(kl=True, beta2=0.99),
        grafting=ss.GraftingConfig(type="adam", beta2=0.999, bias_correction=True),
        gradient_filter=ss.GradientFilterConfig(beta1=0.9, bias_correction=True),
        momentum=ss.MomentumConfig(momentum=0.5, nesterov=True)),
}


def _kl(root: str, beta2: str) -> ss.ShampooConfig:
    return dataclasses.replace(BASE, root_inverse=ROOTS[root],
                               statistics=ss.StatisticsConfig(kl=True, beta2=BETA2[beta2]))


def _float64_error(config: ss.ShampooConfig, seed: int = 4) -> tuple[float, str]:
    return reference_error(config, SHAPES, STEPS, seed)


@pytest.mark.parametrize("beta2", list(BETA2))
@pytest.mark.parametrize("root", list(ROOTS))
def test_float64_equals_reference(root: str, beta2: str) -> None:
    config = _kl(root, beta2)
    err, where = _float64_error(config)
    assert err <= 1e-9, f"{root} {beta2}: relative error {err:.3e} at {where}"
    # Eq. (6b) changes the run: plain Shampoo's statistics give another trajectory.
    params, grads = stream(SHAPES, steps=STEPS, seed=4)
    plain = dataclasses.replace(config, statistics=dataclasses.replace(
        config.statistics, kl=False))
    assert relative_error(reference_run(plain, params, grads),
                          reference_run(config, params, grads), params)[0] > 1e-3


@pytest.mark.parametrize("name", list(OTHER_CASES))
def test_float64_equals_reference_other_paths(name: str) -> None:
    err, where = _float64_error(OTHER_CASES[name])
    assert err <= 1e-9, f"{name}: relative error {err:.3e} at {where}"


def _groups(config: ss.ShampooConfig, params: dict, grads: list[dict]) -> tuple:
    """The block groups of the state after ``grads`` (float64)."""
    names = sorted(params)
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        opt = shampoo_jax.shampoo(dataclasses.replace(config, factor_dtype="float64"))
        p = {k: jnp.asarray(params[k], jnp.float64) for k in names}
        s = opt.init(p)
        step = jax.jit(opt.update)
        for g in grads:
            u, s = step({k: jnp.asarray(g[k], jnp.float64) for k in names}, s, p)
            p = optax.apply_updates(p, u)
        return jax.tree.map(np.asarray, s.groups)


def _factors(config: ss.ShampooConfig, params: dict, grads: list[dict]) -> list[np.ndarray]:
    return [f for gs in _groups(config, params, grads) for f in gs.factors]


def test_identity_roots_give_plain_statistics_then_the_roots_count() -> None:
    """Until the first root step's roots exist (step 2 with frequency 2: its statistics
    come before its refresh) eq. (6b) takes the identity roots of eq. (13): the factors
    equal plain Shampoo's bit for bit. Step 3 takes step 2's roots: they differ wherever
    a block has another preconditioned dim."""
    config = _kl("eigh", "sum")
    plain = dataclasses.replace(config, statistics=ss.StatisticsConfig())
    params, grads = stream(SHAPES, steps=3, seed=1)
    for a, b in zip(_factors(config, params, grads[:2]), _factors(plain, params, grads[:2]),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    # A block with one preconditioned dim (the vector) has no other dim: unchanged.
    for ga, gb in zip(_groups(config, params, grads), _groups(plain, params, grads),
                      strict=True):
        for a, b in zip(ga.factors, gb.factors, strict=True):
            assert (len(ga.factors) == 1) == np.allclose(a, b, rtol=1e-6, atol=0), a.shape


def test_factors_equal_the_references() -> None:
    """After the steps every factor is the reference's L_k (eq. 6b), block by block."""
    config = _kl("eigh", "ema")
    params, grads = stream(SHAPES, steps=STEPS, seed=4)
    ref = ReferenceShampoo(config, params)
    for g in grads:
        ref.step(g)
    names = sorted(params)
    layout = make_layout(tuple(np.shape(params[k]) for k in names), config)
    compared = 0
    for grp, gs in zip(layout.groups, _groups(config, params, grads), strict=True):
        for pos, (leaf, block) in enumerate(grp.members):
            bs = ref.state[names[leaf]].blocks[block]
            for k, lk in zip(grp.preconditioned_dims, gs.factors, strict=True):
                want = bs.factors[k]
                assert want is not None
                np.testing.assert_allclose(lk[pos], want, rtol=1e-9, atol=1e-12,
                                           err_msg=f"{names[leaf]} block {block} dim {k}")
                compared += 1
    assert compared == sum(f is not None for k in names for bs in ref.state[k].blocks
                           for f in bs.factors)
