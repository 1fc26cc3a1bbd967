"""Every option of ShampooConfig through shampoo_jax equals the float64 reference.

Float64: <= 1e-9 relative (docs/spec.md section 5) after 20 steps on the
shapes (7, 10), (7,), (3, 4, 5), (12,), (), (1, 5, 1), with epsilon >= 1e-6
or factors that are full rank before their first root. Float32: the bound of
section 5, ``n * u * kappa * steps`` with u = 2^-24, n the largest factor
(70 here) and kappa <= 1e4 for these cases (epsilon 1e-2 on unit-variance
gradients), capped at 1e-2: 70 * 6e-8 * 1e4 * 20 > 1e-2, so 1e-2 here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shampoo_jax
import shampoo_spec as ss
from shampoo_conformance.adapters.jax import run as jax_run
from shampoo_reference import ReferenceShampoo, eigh_error
from shampoo_reference import run as reference_run
from shampoo_reference.linalg import eigh_input

from .helpers import relative_error, stream

EPS = ss.EpsilonConfig(value=1e-4)
SMALL_BLOCKS = ss.BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None)

CASES: dict[str, ss.ShampooConfig] = {
    "default_merged": ss.ShampooConfig(learning_rate=0.1, epsilon=EPS),
    "blocked_adagrad_nesterov": ss.ShampooConfig(
        learning_rate=0.1,
        epsilon=EPS,
        blocking=SMALL_BLOCKS,
        grafting=ss.GraftingConfig(type="adagrad"),
        momentum=ss.MomentumConfig(momentum=0.9, nesterov=True),
        schedule=ss.ScheduleConfig(precondition_frequency=3, start_preconditioning_step=4),
    ),
    "ema_bias_shift_after": ss.ShampooConfig(
        statistics=ss.StatisticsConfig(
            beta2=0.9, bias_correction=True, initial_value="epsilon_identity"
        ),
        epsilon=ss.EpsilonConfig(value=1e-3, placement="shift_after"),
        blocking=ss.BlockingConfig(merge_dims_up_to=None),
        grafting=ss.GraftingConfig(type="rmsprop", beta2=0.9, norm_scope="parameter"),
        schedule=ss.ScheduleConfig(precondition_frequency=2, start_preconditioning_step=3),
    ),
    "ema_one_floor_relative": ss.ShampooConfig(
        statistics=ss.StatisticsConfig(beta2=0.95, ema_weight="one"),
        epsilon=ss.EpsilonConfig(value=1e-3, scale="relative", placement="floor"),
        blocking=ss.BlockingConfig(merge_dims_up_to=None, max_preconditioner_dim=5),
        grafting=ss.GraftingConfig(type="adam", beta2=0.99, bias_correction=True),
        schedule=ss.ScheduleConfig(precondition_frequency=4, start_preconditioning_step=6),
    ),
    "ridge_floor_relative_override": ss.ShampooConfig(
        epsilon=ss.EpsilonConfig(value=1e-3, scale="relative", placement="ridge_floor"),
        exponents=ss.ExponentConfig(override=2.5),
        blocking=ss.BlockingConfig(merge_dims_up_to=None),
        grafting=ss.GraftingConfig(type="sgd", norm_scope="parameter"),
    ),
    "preconditioned_dims_default": ss.ShampooConfig(
        epsilon=EPS,
        exponents=ss.ExponentConfig(default="preconditioned_dims"),
        blocking=ss.BlockingConfig(merge_dims_up_to=None, preconditioned_dims="all_but_last"),
        grafting=ss.GraftingConfig(type="adagrad", norm_scope="parameter"),
    ),
    "overrides_by_order_one_sided": ss.ShampooConfig(
        epsilon=EPS,
        exponents=ss.ExponentConfig(overrides_by_order=(
            ss.OrderOverride(order=2, roots=(0.0, 3.0)),
            ss.OrderOverride(order=1, roots=(0.0,)),
        )),
        blocking=ss.BlockingConfig(merge_dims_up_to=None, preconditioned_dims="last"),
        grafting=ss.GraftingConfig(type="adagrad"),
    ),
    "skip_rules": ss.ShampooConfig(
        epsilon=EPS,
        blocking=ss.BlockingConfig(merge_dims_up_to=None, skip_dim_size_gt=9, skip_rank_lt=2),
        grafting=ss.GraftingConfig(type="rmsprop_normalized", beta2=0.9),
    ),
    "merge_first_to_last": ss.ShampooConfig(
        epsilon=EPS,
        blocking=ss.BlockingConfig(
            merge_dims_up_to=12, merge_direction="first_to_last", max_preconditioner_dim=6
        ),
        grafting=ss.GraftingConfig(type="adagrad_normalized"),
        momentum=ss.MomentumConfig(momentum=0.5, dampening=0.2),
    ),
    "separate_buffers_lr_first_direction_decay": ss.ShampooConfig(
        learning_rate=0.05,
        epsilon=EPS,
        blocking=ss.BlockingConfig(merge_dims_up_to=None),
        grafting=ss.GraftingConfig(type="adagrad", norm_scope="parameter"),
        momentum=ss.MomentumConfig(
            momentum=0.9, nesterov=True, buffers="separate",
            learning_rate_placement="before_momentum",
        ),
        weight_decay=ss.WeightDecayConfig(value=0.1, type="direction"),
        schedule=ss.ScheduleConfig(precondition_frequency=3, start_preconditioning_step=5),
    ),
    "filter_sign_update_decay": ss.ShampooConfig(
        epsilon=EPS,
        gradient_filter=ss.GradientFilterConfig(beta1=0.9, beta3=0.5, bias_correction=True),
        grafting=ss.GraftingConfig(type="sign"),
        weight_decay=ss.WeightDecayConfig(value=0.1, type="update"),
        blocking=SMALL_BLOCKS,
    ),
    "filter_l2_schedule_start_anchor": ss.ShampooConfig(
        epsilon=EPS,
        gradient_filter=ss.GradientFilterConfig(beta1=0.8),
        weight_decay=ss.WeightDecayConfig(value=0.05, type="l2"),
        schedule=ss.ScheduleConfig(
            precondition_frequency=3, statistics_frequency=2, start_preconditioning_step=4,
            period_anchor="start", roots_before_start=True,
        ),
        blocking=ss.BlockingConfig(merge_dims_up_to=None),
    ),
    "eigenvalue_correction": ss.ShampooConfig(
        eigenvalue_correction=ss.EigenvalueCorrectionConfig(beta2=0.95, epsilon=1e-8),
        blocking=ss.BlockingConfig(merge_dims_up_to=None),
        grafting=ss.GraftingConfig(type="adagrad"),
        schedule=ss.ScheduleConfig(precondition_frequency=4, start_preconditioning_step=13),
    ),
    "eigenvalue_correction_sum_root4": ss.ShampooConfig(
        eigenvalue_correction=ss.EigenvalueCorrectionConfig(
            beta2=1.0, epsilon=1e-8, bias_correction=False, root=4.0
        ),
        statistics=ss.StatisticsConfig(beta2=0.99, bias_correction=True),
        blocking=SMALL_BLOCKS,
        schedule=ss.ScheduleConfig(precondition_frequency=5, start_preconditioning_step=13),
    ),
    "coupled_newton_plain": ss.ShampooConfig(
        epsilon=ss.EpsilonConfig(value=1e-3),
        root_inverse=ss.CoupledNewtonConfig(tolerance=1e-12, max_iterations=200),
        blocking=ss.BlockingConfig(merge_dims_up_to=None),
    ),
    "coupled_newton_google_rules_root5": ss.ShampooConfig(
        epsilon=ss.EpsilonConfig(value=1e-3, scale="relative"),
        root_inverse=ss.CoupledNewtonConfig(
            tolerance=1e-12, max_iterations=200, error_growth_limit=1.2, retries=3,
            failure_threshold=0.1,
        ),
        exponents=ss.ExponentConfig(override=5),
        blocking=SMALL_BLOCKS,
        grafting=ss.GraftingConfig(type="rmsprop", beta2=0.99),
    ),
    "never_start_separate_adam": ss.ShampooConfig(
        grafting=ss.GraftingConfig(type="adam", beta2=0.999, bias_correction=True),
        momentum=ss.MomentumConfig(momentum=0.9, buffers="separate"),
        schedule=ss.ScheduleConfig(start_preconditioning_step=None),
    ),
    "google_defaults": ss.from_google({"learning_rate": 0.05, "block_size": 5}),
    "google_eigh_adagrad": ss.from_google({
        "learning_rate": 0.05, "block_size": 128, "eigh": True, "graft_type": "ADAGRAD",
        "start_preconditioning_step": 3, "preconditioning_compute_steps": 2,
    }),
    "meta_defaults": ss.from_meta({"lr": 0.05, "epsilon": 1e-6}),
    "meta_adam_graft_momentum": ss.from_meta({
        "lr": 0.05, "epsilon": 1e-6, "max_preconditioner_dim": 6,
        "precondition_frequency": 3, "start_preconditioning_step": 3,
        "grafting_config": {"type": "AdamPreconditionerConfig", "beta2": 0.999, "epsilon": 1e-8},
        "momentum": 0.9, "use_nesterov": True, "weight_decay": 0.01,
    }),
}


@pytest.mark.parametrize("name", list(CASES))
def test_float64_equals_reference(name: str) -> None:
    config = CASES[name]
    params, grads = stream()
    want = reference_run(config, params, grads)
    got = jax_run(config, params, grads, dtype=np.float64)
    err, where = relative_error(got, want, params)
    assert err <= 1e-9, f"{name}: relative error {err:.3e} at {where}; config {config}"


@pytest.mark.parametrize("name", ["blocked_adagrad_nesterov", "eigenvalue_correction"])
def test_float32_within_documented_bound(name: str) -> None:
    config = dataclasses.replace(CASES[name], epsilon=ss.EpsilonConfig(value=1e-2))
    params, grads = stream()
    want = reference_run(config, params, grads)
    got = jax_run(config, params, grads, dtype=np.float32)
    err, where = relative_error(got, want, params)
    assert err <= 1e-2, f"{name}: float32 relative error {err:.3e} at {where}"


# ------------------------------------------- eq. (13): eigh roots judged by their error
#: Gradient scales per parameter for eq. (13)'s threshold: the eigh error e is
#: rounding noise, about 1e-16 ||B||, so small gradients give e <= 1e-17 and large
#: ones e >= 1e-8 (float64); "vector" switches from small to large at step 15, so
#: its roots pass, then fail and keep the root of step 14. tau = 1e-11 sits >= 100x
#: from every error (checked on the reference's factors).
EIGH_TAU = 1e-11
EIGH_SCALES = {"matrix": 1e-4, "tensor": 1e4, "long": 1e-2, "scalar": 1.0, "ones": 1e-2}
EIGH_SWITCH = 15
EIGH_FAILURE_CASES = {
    "eigh": ss.ShampooConfig(
        epsilon=ss.EpsilonConfig(value=1e-6),
        root_inverse=ss.EighConfig(failure_threshold=EIGH_TAU),
        blocking=ss.BlockingConfig(merge_dims_up_to=None),
        grafting=ss.GraftingConfig(type="adagrad"),
    ),
    # Eq. (17): the eigenbases judged alike (from step 13, once the factors are full rank).
    "eigenvalue_correction": ss.ShampooConfig(
        epsilon=ss.EpsilonConfig(value=1e-6),
        root_inverse=ss.EighConfig(failure_threshold=EIGH_TAU),
        eigenvalue_correction=ss.EigenvalueCorrectionConfig(),
        blocking=ss.BlockingConfig(merge_dims_up_to=None),
        grafting=ss.GraftingConfig(type="adagrad"),
        schedule=ss.ScheduleConfig(start_preconditioning_step=13),
    ),
}


def eigh_failure_stream(seed: int = 5) -> tuple[dict, list[dict]]:
    params, grads = stream(seed=seed)
    for t, g in enumerate(grads, start=1):
        for k in g:
            g[k] = g[k] * EIGH_SCALES.get(k, 1e-4 if t < EIGH_SWITCH else 1e4)
    return params, grads


def reference_eigh_failures(config: ss.ShampooConfig, params: dict, grads: list[dict]) -> int:
    """The reference's root failures, after checking that every error is >= 100x from tau."""
    opt = ReferenceShampoo(config, params)
    passed = 0
    for g in grads:
        opt.step(g)
        if not ss.is_root_step(opt.t, config.schedule):
            continue
        for a in (a for st in opt.state.values() for bs in st.blocks for a in bs.factors):
            if a is None:
                continue
            if config.eigenvalue_correction is None:
                b = eigh_input(a, config.epsilon.value, config.epsilon.placement)
            else:
                b = 0.5 * (a + a.T)
            lam, q = np.linalg.eigh(b)
            e = eigh_error(b, lam, q)
            assert e <= EIGH_TAU / 100 or e >= EIGH_TAU * 100, e
            passed += e < EIGH_TAU
    assert opt.metrics.root_failures > 0 and passed > 0
    return opt.metrics.root_failures


@pytest.mark.parametrize("name", sorted(EIGH_FAILURE_CASES))
def test_eigh_failure_threshold_equals_reference(name: str) -> None:
    """Some roots fail (kept and counted, eq. 13), some pass: float64 equals the reference."""
    config = dataclasses.replace(EIGH_FAILURE_CASES[name], factor_dtype="float64")
    params, grads = eigh_failure_stream()
    failures = reference_eigh_failures(config, params, grads)
    want = reference_run(config, params, grads)
    with jax.enable_x64(True):
        opt = shampoo_jax.shampoo(config)

        @jax.jit
        def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        p = {k: jnp.asarray(v) for k, v in params.items()}
        s = opt.init(p)
        got = []
        for g in grads:
            p, s = step(p, s, {k: jnp.asarray(v) for k, v in g.items()})
            got.append({k: np.asarray(v) for k, v in p.items()})
        assert int(s.root_failures) == failures
    err, where = relative_error(got, want, params)
    assert err <= 1e-9, f"{name}: relative error {err:.3e} at {where}"
