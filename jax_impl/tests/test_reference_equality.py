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
from shampoo_conformance.suite.basis_reuse import CountingReference
from shampoo_conformance.suite.eigh_failures import reference_eigh_failures
from shampoo_conformance.suite.tolerances import fraction_not_bitwise, trajectory_bound
from shampoo_jax.blocks import make_layout
from shampoo_reference import ReferenceShampoo
from shampoo_reference import run as reference_run

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
    # eq. (14b) with w = 1 (Meta's drop_weighting_factor_on_gsquare)
    "graft_weight_one_normalized": ss.ShampooConfig(
        epsilon=EPS,
        blocking=SMALL_BLOCKS,
        grafting=ss.GraftingConfig(type="rmsprop_normalized", beta2=0.9, ema_weight="one",
                                   bias_correction=True),
    ),
    # eq. (21a): the update rounded to update_dtype before it is added
    "update_bfloat16_update_decay": ss.ShampooConfig(
        learning_rate=0.1, epsilon=EPS, blocking=SMALL_BLOCKS, update_dtype="bfloat16",
        grafting=ss.GraftingConfig(type="adagrad"),
        momentum=ss.MomentumConfig(momentum=0.9, nesterov=True),
        weight_decay=ss.WeightDecayConfig(value=0.01, type="update"),
    ),
    "update_float16_lr_first": ss.ShampooConfig(
        learning_rate=0.1, epsilon=EPS, update_dtype="float16",
        momentum=ss.MomentumConfig(momentum=0.5, learning_rate_placement="before_momentum"),
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
    # Eq. (20) without a graft (Google's NONE with beta1 > 0): the second buffer
    # gathers the warm-up direction F~, the first the Shampoo direction, both from step 1.
    "separate_buffers_no_graft": ss.ShampooConfig(
        learning_rate=0.05,
        epsilon=EPS,
        grafting=ss.GraftingConfig(type="none"),
        momentum=ss.MomentumConfig(momentum=0.5, nesterov=True, buffers="separate"),
        schedule=ss.ScheduleConfig(precondition_frequency=2, start_preconditioning_step=4),
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
    # Meta's drop_weighting_factor_on_gsquare with eigenvalue correction (eqs. 6, 17).
    "eigenvalue_correction_weight_one": ss.ShampooConfig(
        eigenvalue_correction=ss.EigenvalueCorrectionConfig(
            beta2=0.9, ema_weight="one", bias_correction=False, epsilon=1e-8),
        statistics=ss.StatisticsConfig(beta2=0.9, ema_weight="one"),
        blocking=SMALL_BLOCKS,  # no graft: its rescale would cancel D's weight
        schedule=ss.ScheduleConfig(precondition_frequency=2, start_preconditioning_step=13),
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
    # Eq. (14d): Google's RMSPROP graft clipped at rms 1 (some steps clip, some not).
    "google_rmsprop_clip": ss.from_google({
        "learning_rate": 0.05, "block_size": 6, "graft_type": "RMSPROP", "beta2": 0.9,
        "clip_by_scaled_gradient_norm": 1.0, "start_preconditioning_step": 2,
        "relative_matrix_epsilon": False,
    }),
    "rmsprop_normalized_clip_block": ss.ShampooConfig(
        grafting=ss.GraftingConfig(type="rmsprop_normalized", beta2=0.9, clip_rms=0.3),
        blocking=SMALL_BLOCKS,
    ),
    "meta_defaults": ss.from_meta({"lr": 0.05, "epsilon": 1e-6}),
    "meta_adam_graft_momentum": ss.from_meta({
        "lr": 0.05, "epsilon": 1e-6, "max_preconditioner_dim": 6,
        "precondition_frequency": 3, "start_preconditioning_step": 3,
        "grafting_config": {"type": "AdamPreconditionerConfig", "beta2": 0.999, "epsilon": 1e-8},
        "momentum": 0.9, "use_nesterov": True, "weight_decay": 0.01,
    }),
}


#: Eq. (10f): QR roots from the stored eigenbases, from step 13 (every factor of SHAPES
#: full rank: a repeated eigenvalue's sorted order is rounding's, docs/spec.md eq. 17c).
QR_ROOT_CASES = {
    "qr_one_iteration": ss.ShampooConfig(
        learning_rate=0.05, epsilon=ss.EpsilonConfig(value=1e-6),
        blocking=ss.BlockingConfig(merge_dims_up_to=None),
        root_inverse=ss.EighConfig(eigenbasis_method="qr"),
        schedule=ss.ScheduleConfig(start_preconditioning_step=13)),
    "qr_relative_epsilon": ss.ShampooConfig(
        learning_rate=0.05, epsilon=ss.EpsilonConfig(value=1e-4, scale="relative"),
        blocking=ss.BlockingConfig(merge_dims_up_to=None),
        root_inverse=ss.EighConfig(eigenbasis_method="qr", qr_max_iterations=3),
        schedule=ss.ScheduleConfig(start_preconditioning_step=13)),
    "qr_iterations_tolerance_shift_after_kl": ss.ShampooConfig(
        learning_rate=0.05, epsilon=ss.EpsilonConfig(value=1e-6, placement="shift_after"),
        blocking=ss.BlockingConfig(merge_dims_up_to=None),
        root_inverse=ss.EighConfig(eigenbasis_method="qr", qr_max_iterations=4,
                                   qr_tolerance=0.05),
        statistics=ss.StatisticsConfig(beta2=0.9, bias_correction=True, kl=True),
        schedule=ss.ScheduleConfig(precondition_frequency=2, start_preconditioning_step=14),
        grafting=ss.GraftingConfig(type="adagrad")),
}


@pytest.mark.parametrize("name", list(QR_ROOT_CASES))
def test_qr_root_float64_equals_reference(name: str) -> None:
    params, grads = stream()
    err, where = _float64_error(QR_ROOT_CASES[name], params, grads)
    assert err <= 1e-9, f"{name}: relative error {err:.3e} at {where}"


@pytest.mark.parametrize("name", list(CASES))
def test_float64_equals_reference(name: str) -> None:
    config = CASES[name]
    params, grads = stream()
    err, where = _float64_error(config, params, grads)
    assert err <= 1e-9, f"{name}: relative error {err:.3e} at {where}; config {config}"


@pytest.mark.parametrize("name", ["blocked_adagrad_nesterov", "eigenvalue_correction"])
def test_float32_within_documented_bound(name: str) -> None:
    config = dataclasses.replace(CASES[name], epsilon=ss.EpsilonConfig(value=1e-2))
    params, grads = stream()
    want = reference_run(config, params, grads)
    got = jax_run(config, params, grads, dtype=np.float32)
    err, where = relative_error(got, want, params)
    assert err <= 1e-2, f"{name}: float32 relative error {err:.3e} at {where}"


# ------------------------------------------------- inverse_root_dtype, eqs. (11a), (16)
ROOT_BASE = ss.ShampooConfig(
    learning_rate=0.05, epsilon=ss.EpsilonConfig(value=1e-3), factor_dtype="float64",
    blocking=ss.BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None),
)
ROOT_CASES = {
    "plain": ROOT_BASE,
    "adagrad_momentum_newton": dataclasses.replace(
        ROOT_BASE, grafting=ss.GraftingConfig(type="adagrad"),
        momentum=ss.MomentumConfig(momentum=0.9, nesterov=True),
        root_inverse=ss.CoupledNewtonConfig(),
        schedule=ss.ScheduleConfig(precondition_frequency=2, start_preconditioning_step=2),
    ),
    "merged_parameter_graft": dataclasses.replace(
        ROOT_BASE, blocking=ss.BlockingConfig(merge_dims_up_to=64),
        grafting=ss.GraftingConfig(type="rmsprop", beta2=0.9, norm_scope="parameter"),
        exponents=ss.ExponentConfig(
            overrides_by_order=(ss.OrderOverride(order=2, roots=(4.0, 0.0)),)
        ),
    ),
}


def _float64_error(
    config: ss.ShampooConfig, params: dict[str, np.ndarray], grads: list[dict[str, np.ndarray]]
) -> tuple[float, str]:
    """JAX in float64 against the reference on ``grads``: the worst relative error and where."""
    want = reference_run(config, params, grads)
    got = jax_run(config, params, grads, dtype=np.float64)
    return relative_error(got, want, params)


def _states_after(
    config: ss.ShampooConfig, params: dict[str, np.ndarray], grads: list[dict[str, np.ndarray]]
) -> tuple[ReferenceShampoo, Any, list[str]]:
    """The reference stepped over ``grads``, and the JAX state after the same gradients
    (its parameters held at ``params``), for the tests that compare stored state."""
    ref = ReferenceShampoo(config, params)
    for g in grads:
        ref.step(g)
    names = sorted(params)
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        opt = shampoo_jax.shampoo(config)
        p = {k: jnp.asarray(params[k]) for k in names}
        state = opt.init(p)
        update = jax.jit(opt.update)
        for g in grads:
            _, state = update({k: jnp.asarray(g[k]) for k in names}, state, p)
    return ref, state, names


def _root_config(name: str, dtype: str) -> ss.ShampooConfig:
    return dataclasses.replace(ROOT_CASES[name], inverse_root_dtype=dtype)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", list(ROOT_CASES))
def test_inverse_root_dtype_within_derived_bound(name: str, dtype: str) -> None:
    """float64 JAX with roots stored in s against the reference's exact emulation.

    Bound: spec section 5 for roots stored in s, ``SAFETY n u_s kappa steps``
    capped at 1e-2 (``tolerances.trajectory_bound``, whose u is u_s here): the
    reference emulates every rounding of eqs. (11a) and (16), so only a root
    or product whose unrounded value lies across a rounding boundary of s
    from the reference's can differ, by one ulp of s. The cap applies here;
    measured (seed 0, 20 steps): float32 5e-7 to 1.5e-5 (XLA's float32 dots
    accumulate in float32, n u32 times the cancellation); bfloat16 and
    float16 0 to 4e-16 with blocks of 4 (their dots accumulate in float32,
    far below one ulp of s: no entry rounds otherwise), 6e-5 (float16) and
    3e-4 (bfloat16) with the merged 70-dim factor, where a few entries do.
    """
    config = _root_config(name, dtype)
    params, grads = stream()
    # u = u_s here: the tolerance module takes the roots' storage dtype when coarser.
    rtol = min(1e-2, trajectory_bound(config, params, grads, np.float64).rtol)
    err, where = _float64_error(config, params, grads)
    assert err <= rtol, f"{name} {dtype}: relative error {err:.3e} at {where}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_stored_roots_are_the_references_bit_for_bit(dtype: str) -> None:
    """Eq. (11a) at the first root step (factors equal to the reference's to ~1e-16).

    The unrounded roots differ by about kappa u64, so an entry rounds
    otherwise only that close to a boundary of s: about kappa u64 / u_s per
    entry (<= 1e-4 for float32 at kappa 1e4). At most 1% may differ, by one
    ulp; unrounded or truncated roots differ in about half the entries.
    """
    config = _root_config("plain", dtype)
    params, grads = stream(steps=1, seed=11)
    ref = ReferenceShampoo(config, params)
    ref.step(grads[0])
    names = sorted(params)
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        opt = shampoo_jax.shampoo(config)
        p = {k: jnp.asarray(params[k]) for k in names}
        state = opt.init(p)
        _, state = jax.jit(opt.update)({k: jnp.asarray(grads[0][k]) for k in names}, state, p)
        layout = make_layout(tuple(tuple(np.shape(params[k])) for k in names), config)
        fractions = []
        for grp, gs in zip(layout.groups, state.groups, strict=True):
            for i, k in enumerate(grp.preconditioned_dims):
                x = np.asarray(gs.inverse_roots[i])
                assert x.dtype == np.dtype(getattr(jnp, dtype))
                for row, (leaf, block) in enumerate(grp.members):
                    want = ref.state[names[leaf]].blocks[block].inverse_roots[k]
                    assert want is not None
                    fractions.append(fraction_not_bitwise(x[row].astype(np.float64), want, dtype))
    assert fractions and float(np.mean(fractions)) <= 0.01, fractions


# ----------------------------------------------------- factor_storage_dtype, eq. (11b)
FACTOR_STORAGE_CASES = {
    "plain": ROOT_BASE,
    "graft_momentum_bias_corrected": dataclasses.replace(
        ROOT_BASE, grafting=ss.GraftingConfig(type="adagrad"),
        momentum=ss.MomentumConfig(momentum=0.9, nesterov=True),
        statistics=ss.StatisticsConfig(beta2=0.95, bias_correction=True),
        schedule=ss.ScheduleConfig(precondition_frequency=2, start_preconditioning_step=2),
    ),
    "merged_shift_after": dataclasses.replace(
        ROOT_BASE, blocking=ss.BlockingConfig(merge_dims_up_to=64),
        epsilon=ss.EpsilonConfig(value=1e-3, placement="shift_after"),
        exponents=ss.ExponentConfig(
            overrides_by_order=(ss.OrderOverride(order=2, roots=(4.0, 6.0)),)
        ),
    ),
}


def _factor_storage_config(name: str, dtype: str, inverse: str | None = None
                           ) -> ss.ShampooConfig:
    return dataclasses.replace(FACTOR_STORAGE_CASES[name], factor_storage_dtype=dtype,  # type: ignore[arg-type]
                               inverse_root_dtype=inverse)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(FACTOR_STORAGE_CASES))
def test_factor_storage_dtype_within_derived_bound(name: str, dtype: str) -> None:
    """float64 JAX with factors stored in s (native s arrays, each rounding behind a
    barrier) against the reference's exact emulation of eq. (11b): section 5's bound
    with u = u_s, capped at 1e-2 (``trajectory_bound`` takes u_s)."""
    config = _factor_storage_config(name, dtype)
    params, grads = stream()
    rtol = min(1e-2, trajectory_bound(config, params, grads, np.float64).rtol)
    err, where = _float64_error(config, params, grads)
    assert err <= rtol, f"{name} {dtype}: relative error {err:.3e} at {where}"


@pytest.mark.parametrize("inverse", [None, "float32"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_stored_factors_and_roots_are_the_references_bit_for_bit(
        dtype: str, inverse: str | None) -> None:
    """Eq. (11b) after four steps: the stored factors and roots are s numbers equal to the
    reference's in all but a few entries (a flip needs an entry within kappa 2^-53, or a
    float32 power's error, of a boundary of s); a rounding left out moves far more."""
    config = _factor_storage_config("graft_momentum_bias_corrected", dtype, inverse)
    params, grads = stream(steps=4, seed=11)
    ref, state, names = _states_after(config, params, grads)
    layout = make_layout(tuple(tuple(np.shape(params[k])) for k in names), config)
    fractions = []
    for grp, gs in zip(layout.groups, state.groups, strict=True):
        for i, k in enumerate(grp.preconditioned_dims):
            f = np.asarray(gs.factors[i])
            assert f.dtype == np.dtype(getattr(jnp, dtype))
            x = np.asarray(gs.inverse_roots[i])
            assert x.dtype == np.dtype(getattr(jnp, inverse or "float64"))
            for row, (leaf, block) in enumerate(grp.members):
                bs = ref.state[names[leaf]].blocks[block]
                for mine, theirs in ((f, bs.factors[k]), (x, bs.inverse_roots[k])):
                    assert theirs is not None
                    fractions.append(fraction_not_bitwise(mine[row].astype(np.float64),
                                                          theirs, dtype))
    assert fractions and float(np.mean(fractions)) <= 0.01, fractions


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_first_direction_is_the_references_bit_for_bit(dtype: str) -> None:
    """Eq. (16) at step 1 (W_0 = 0, lr = 1, no graft: W_1 = -P exactly).

    XLA's bfloat16/float16 dots on CPU accumulate in float32: a product
    differs from the reference's by about n u32 times the cancellation, so
    an entry rounds otherwise only within that of a boundary of s, about
    n u32 c / u_s per entry. At most 1% may differ, by one ulp; a product
    rounded once at the end, or a gradient not rounded first, moves most.
    """
    config = dataclasses.replace(_root_config("plain", dtype), learning_rate=1.0)
    params, grads = stream(steps=1, seed=5)
    params = {k: np.zeros_like(v) for k, v in params.items()}
    (want,) = reference_run(config, params, grads)
    (got,) = jax_run(config, params, grads, dtype=np.float64)
    fractions = [fraction_not_bitwise(got[k], want[k], dtype) for k in params if want[k].size > 1]
    assert float(np.mean(fractions)) <= 0.01, fractions


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


@pytest.mark.parametrize("name", sorted(EIGH_FAILURE_CASES))
def test_eigh_failure_threshold_equals_reference(name: str) -> None:
    """Some roots fail (kept and counted, eq. 13), some pass: float64 equals the reference."""
    config = dataclasses.replace(EIGH_FAILURE_CASES[name], factor_dtype="float64")
    params, grads = eigh_failure_stream()
    failures = reference_eigh_failures(config, params, grads, EIGH_TAU)
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


# ------------------------------------ eq. (8b): the root period follows the learning rate
#: Google's anchor, period 4 growing by up to 21 as the rate decays linearly to 0 over
#: 20 steps: x = 4 + 1.05 c (c = t - 1), so f = 1 for c <= 5, 10 up to 15, then 20: roots
#: at every one of the first six steps, then at c = 10 only. x never lands within float32
#: rounding of a multiple of 10, so float32 takes the same root steps.
GROWTH = ss.from_google({
    "learning_rate": 0.05, "block_size": 6, "graft_type": "ADAGRAD", "eigh": True,
    "relative_matrix_epsilon": False, "start_preconditioning_step": 2,
    "preconditioning_compute_steps": 4,
})
GROWTH = dataclasses.replace(GROWTH, schedule=dataclasses.replace(
    GROWTH.schedule, precondition_frequency_growth=21))


def _decaying(count: Any) -> Any:
    """0.05 (1 - count / 20): a schedule in the dtype JAX computes in (float64 under x64)."""
    return 0.05 * (1.0 - count / 20.0)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_growing_root_period_equals_reference(dtype: type) -> None:
    params, grads = stream()
    rates = [0.05 * (1.0 - c / 20.0) for c in range(len(grads))]
    roots = [t for t in range(1, 21)
             if ss.is_root_step(t, GROWTH.schedule, ss.learning_rate_ratio(rates[t - 1], 0.05))]
    assert roots == [1, 2, 3, 4, 5, 6, 11]  # not the constant period's 1, 5, 9, ...
    want = reference_run(GROWTH, params, grads, rates)
    names = sorted(params)
    config = dataclasses.replace(GROWTH, factor_dtype=np.dtype(dtype).name)
    with jax.enable_x64(dtype == np.float64), jax.default_device(jax.devices("cpu")[0]):
        opt = shampoo_jax.shampoo(config, learning_rate=_decaying)
        p = {k: jnp.asarray(params[k], dtype) for k in names}
        state = opt.init(p)
        update = jax.jit(opt.update)
        got = []
        for g in grads:
            u, state = update({k: jnp.asarray(g[k], dtype) for k in names}, state, p)
            p = optax.apply_updates(p, u)
            got.append({k: np.asarray(v, np.float64) for k, v in p.items()})
    err, where = relative_error(got, want, params)
    # float32: section 5's bound for these factors (eps 1e-6 absolute, n <= 6): 1e-2 cap.
    assert err <= (1e-9 if dtype == np.float64 else 1e-2), f"{dtype}: {err:.3e} at {where}"
    # The constant-period control moves far more: the root steps matter here.
    constant = reference_run(
        dataclasses.replace(GROWTH, schedule=dataclasses.replace(
            GROWTH.schedule, precondition_frequency_growth=None)), params, grads, rates)
    assert relative_error(constant, want, params)[0] > 1e-3


def test_corrected_weight_decay_follows_the_schedule() -> None:
    """Eq. (19) with ``scale_by_lr_ratio`` (Meta's CORRECTED) under a schedule: the
    coefficient wd * lr(count) / lr_0, lr_0 the config's rate (the schedule is passed
    separately); equal to the reference fed the same rates."""
    config = dataclasses.replace(GROWTH, factor_dtype="float64", weight_decay=(
        ss.WeightDecayConfig(value=0.5, type="direction", scale_by_lr_ratio=True)))
    params, grads = stream()
    rates = [0.05 * (1.0 - c / 20.0) for c in range(len(grads))]
    want = reference_run(config, params, grads, rates)
    names = sorted(params)
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        opt = shampoo_jax.shampoo(config, learning_rate=_decaying)
        p = {k: jnp.asarray(params[k], np.float64) for k in names}
        state = opt.init(p)
        update = jax.jit(opt.update)
        got = []
        for g in grads:
            u, state = update({k: jnp.asarray(g[k], np.float64) for k in names}, state, p)
            p = optax.apply_updates(p, u)
            got.append({k: np.asarray(v, np.float64) for k, v in p.items()})
    err, where = relative_error(got, want, params)
    assert err <= 1e-9, f"{err:.3e} at {where}"
    plain = dataclasses.replace(config, weight_decay=ss.WeightDecayConfig(value=0.5))
    assert relative_error(reference_run(plain, params, grads, rates), want, params)[0] > 1e-3


def test_growing_root_period_sharded_is_single_device() -> None:
    """The traced ratio reaches every device: the sharded root steps are the single device's.

    The inverse roots (block work, computed from the gradients alone) are
    compared bitwise after 12 steps; the parameters within the float32 bound
    of this module (the sharded program may contract another ``a * b + c`` into an FMA:
    jax_impl/tests/test_sharded.py).
    """
    from .sharded_helpers import sharding_1d

    params, grads = stream(steps=12)
    names = sorted(params)
    config = dataclasses.replace(GROWTH, factor_dtype="float32")
    outs = []
    for n in (None, 2, 4):
        sharding = None if n is None else sharding_1d(n)
        opt = shampoo_jax.shampoo(config, learning_rate=_decaying, sharding=sharding)
        p = {k: jnp.asarray(params[k], jnp.float32) for k in names}
        state = opt.init(p)
        update = jax.jit(opt.update)
        traj = []
        for g in grads:
            u, state = update({k: jnp.asarray(g[k], jnp.float32) for k in names}, state, p)
            p = optax.apply_updates(p, u)
            traj.append({k: np.asarray(v, np.float64) for k, v in p.items()})
        if sharding is not None:
            state = shampoo_jax.unshard_state(state, outs[0][1], sharding)
        outs.append((traj, state))
    (want, s1), *sharded = outs
    rates = [0.05 * (1.0 - c / 20.0) for c in range(12)]
    bound = 1e-2  # the float32 bound of this module's docstring
    assert relative_error(want, reference_run(GROWTH, params, grads, rates), params)[0] <= bound
    for got, s in sharded:
        assert int(s.root_failures) == int(s1.root_failures)
        for a, b in zip(jax.tree.leaves([g.inverse_roots for g in s.groups]),
                        jax.tree.leaves([g.inverse_roots for g in s1.groups]), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert relative_error(got, want, params)[0] <= bound


# ------------------------------------------------- momentum.storage, eq. (20b)
def _int8_momentum(config: ss.ShampooConfig, scale_dtype: str = "float64") -> ss.ShampooConfig:
    return dataclasses.replace(config, momentum=dataclasses.replace(
        config.momentum, storage="int8_columnwise", scale_dtype=scale_dtype))


INT8_CASES = {
    "shared_nesterov": _int8_momentum(CASES["blocked_adagrad_nesterov"]),
    "separate_lr_first": _int8_momentum(CASES["separate_buffers_lr_first_direction_decay"]),
    "never_start_separate_adam": _int8_momentum(CASES["never_start_separate_adam"]),
    "google_defaults_float32_scales": _int8_momentum(CASES["google_defaults"], "float32"),
}


@pytest.mark.parametrize("name", list(INT8_CASES))
def test_int8_momentum_float64_equals_reference(name: str) -> None:
    """Eq. (20b) in float64: within the float64 bound of section 5 (1e-9 over 20 steps).

    The integers are the reference's unless an M/s lies within the step's
    rounding of a half-integer (probability about 127 kappa u64 per entry);
    none does on these streams, so the trajectories agree as without int8.
    """
    config = INT8_CASES[name]
    params, grads = stream()
    err, where = _float64_error(config, params, grads)
    assert err <= 1e-9, f"{name}: relative error {err:.3e} at {where}"


@pytest.mark.parametrize("scale_dtype", ["float32", "float64"])
def test_int8_momentum_state_is_the_references(scale_dtype: str) -> None:
    """The stored integers after 5 steps equal the reference's, the scales agree to the
    rounding of M (float64 JAX).

    int8 of the parameter's shape for rank >= 2 (the (1, 5, 1) parameter too:
    its own rank is 3), float for the vector, the long vector and the scalar.
    """
    config = dataclasses.replace(
        _int8_momentum(CASES["never_start_separate_adam"], scale_dtype), factor_dtype="float64")
    params, grads = stream(steps=5, seed=3)
    ref, state, names = _states_after(config, params, grads)
    for field, scales in (("momentum", state.momentum_scale),
                          ("graft_momentum", state.graft_momentum_scale)):
        buffers = getattr(state, field)
        for i, k in enumerate(names):
            leaf = np.asarray(buffers[k])
            if len(params[k].shape) >= 2:
                q, s = ref.state[k].stored[field]
                assert leaf.dtype == np.int8 and leaf.shape == params[k].shape
                np.testing.assert_array_equal(leaf, q)
                got_s = np.asarray(scales[i])
                assert got_s.dtype == np.dtype(scale_dtype)
                # s_j = max |fl_d(M)| / 127 is continuous in M, and JAX's M differs from
                # the reference's by its Shampoo direction's rounding (kappa u64, measured
                # up to 4e-15 here; section 5 allows 1e-9): s_j to that, or an ulp of float32.
                rtol = max(2 * float(np.finfo(scale_dtype).eps), 1e-9)
                np.testing.assert_allclose(got_s, s, rtol=rtol, atol=0)
            else:
                assert scales[i] is None and leaf.dtype == np.float64
                assert field not in ref.state[k].stored


def test_int8_momentum_float32_within_bound() -> None:
    """float32 JAX, float32 scales: the float32 bound of section 5 (1e-2 here, as above),
    which also holds a flipped integer (1/127 of a column maximum, times mu, in one entry)."""
    config = dataclasses.replace(
        _int8_momentum(CASES["blocked_adagrad_nesterov"], "float32"),
        epsilon=ss.EpsilonConfig(value=1e-2))
    params, grads = stream()
    want = reference_run(config, params, grads)
    got = jax_run(config, params, grads, dtype=np.float32)
    err, where = relative_error(got, want, params)
    assert err <= 1e-2, f"float32 relative error {err:.3e} at {where}"


# ------------------------------------------------ statistics.storage, eq. (20c)
_INT16 = {"best_effort_memory_usage_reduction": True, "batch_axis_name": "b",
          "relative_matrix_epsilon": False}
INT16_CASES = {
    "google_defaults": ss.from_google({"learning_rate": 0.05, "block_size": 5, **_INT16},
                                      x64=True),
    "google_adagrad_ema_every_2nd_root": ss.from_google({
        "learning_rate": 0.05, "block_size": 6, "graft_type": "ADAGRAD", "beta2": 0.9,
        "start_preconditioning_step": 2, "preconditioning_compute_steps": 2,
        "matrix_epsilon": 1e-4, **_INT16}, x64=True),
    # float32 scales (x64=False: Google's float32 statistics), computed in float64 here.
    "google_float32_scales": dataclasses.replace(ss.from_google(
        {"learning_rate": 0.05, "block_size": 6, "graft_type": "SGD", "statistics_compute_steps": 2,
         **_INT16}, x64=False), factor_dtype="float64"),
}


@pytest.mark.parametrize("name", list(INT16_CASES))
def test_int16_statistics_float64_equals_reference(name: str) -> None:
    """Eq. (20c) in float64: within the float64 bound of section 5 (1e-9 over 20 steps).

    The stored integers are the reference's unless a factor's or root's entry
    lies within the step's rounding of a half-integer times its scale
    (probability about 32767 kappa u64 per entry); none does on these streams.
    """
    config = INT16_CASES[name]
    assert config.statistics.quantized
    params, grads = stream()
    want = reference_run(config, params, grads)
    got = jax_run(config, params, grads, dtype=np.float64)
    err, where = relative_error(got, want, params)
    assert err <= 1e-9, f"{name}: relative error {err:.3e} at {where}"
    plain = dataclasses.replace(config, statistics=dataclasses.replace(
        config.statistics, storage="float", scale_dtype="float32"))
    err_plain, _ = relative_error(reference_run(plain, params, grads), want, params)
    assert err_plain > 1e3 * 1e-9, f"{name}: int16 storage changed nothing ({err_plain:.1e})"


def test_int16_stored_factors_and_roots_are_the_references() -> None:
    """After 6 steps (float64 JAX) every factor and inverse root JAX holds is stored with
    the reference's integers (JAX keeps the read-back values: re-quantizing them gives
    their integers back); scales and diagonals agree to the rounding of the unrounded
    factors and roots (kappa u64; 1e-12 relative here)."""
    from shampoo_reference.quantization import quantize_with_diagonal
    config = INT16_CASES["google_adagrad_ema_every_2nd_root"]
    params, grads = stream(steps=6, seed=3)
    ref, state, names = _states_after(config, params, grads)
    layout = make_layout(tuple(tuple(np.shape(params[k])) for k in names), config)
    compared = 0
    for li, k in enumerate(names):
        leaf = layout.leaves[li]
        for bi, (gi, slot) in enumerate(leaf.refs):
            bs = ref.state[k].blocks[bi]
            gs = state.groups[gi]
            kept = [k2 for k2, f in enumerate(bs.factors) if f is not None]
            for i, (fk, xk) in enumerate(zip(gs.factors, gs.inverse_roots, strict=True)):
                for kind, got in (("factor", fk), ("root", xk)):
                    q, s, d = bs.stored[(kind, kept[i])]
                    mine = np.asarray(got[slot])
                    np.testing.assert_array_equal(quantize_with_diagonal(mine, "float64")[0], q)
                    theirs = bs.factors[kept[i]] if kind == "factor" else bs.inverse_roots[kept[i]]
                    assert theirs is not None
                    np.testing.assert_allclose(mine, theirs, rtol=1e-12, atol=0)
                    compared += 1
    assert compared > 5


# ------------------------------ eigenvalue correction's storage dtypes, eq. (17a)
EC_DTYPES = [("float32", "float32"), ("bfloat16", None), (None, "bfloat16"),
             ("bfloat16", "bfloat16"), ("float16", "float16")]


def _ec_config(name: str, q: str | None, s: str | None) -> ss.ShampooConfig:
    config = CASES[name]
    ec = config.eigenvalue_correction
    assert ec is not None
    # epsilon >= 1e-4: float16 holds it (eq. 17a needs >= 2^-24 there).
    ec = dataclasses.replace(ec, eigenvectors_dtype=q, corrected_eigenvalues_dtype=s,
                             epsilon=max(ec.epsilon, 1e-4))
    return dataclasses.replace(config, factor_dtype="float64", eigenvalue_correction=ec)


@pytest.mark.parametrize(("q", "s"), EC_DTYPES)
@pytest.mark.parametrize("name", ["eigenvalue_correction", "eigenvalue_correction_sum_root4"])
def test_eigenvalue_correction_dtypes_within_derived_bound(
    name: str, q: str | None, s: str | None
) -> None:
    """float64 JAX with Q_k stored in q and D in s against the reference's emulation.

    Spec section 5: ``trajectory_bound`` with u of the coarsest storage dtype,
    capped at 1e-2; the test below checks Q_k and D entry by entry.
    """
    config = _ec_config(name, q, s)
    params, grads = stream()
    rtol = min(1e-2, trajectory_bound(config, params, grads, np.float64).rtol)
    err, where = _float64_error(config, params, grads)
    print(f"{name} q={q} s={s}: {err:.2e} (bound {rtol:.1e})")
    assert err <= rtol, f"{name} q={q} s={s}: relative error {err:.3e} at {where}"


@pytest.mark.parametrize(("q", "s"), [("bfloat16", "bfloat16"), ("float16", "float16"),
                                      ("float32", "float32")])
def test_eigenbases_and_moment_are_the_references_bit_for_bit(q: str, s: str) -> None:
    """Eq. (17a) after 5 steps (root steps 2, 4): Q_k stored in q, D in s, within one ulp of its
    dtype of the reference's entry, equal in almost all (2% may differ): Q_k comes
    from the float64 factor; XLA's bfloat16/float16 rotations accumulate in float32,
    far below their ulp. float32 D is held to 2 (n + 2) u32 (XLA's float32 dots
    accumulate in float32, n u32 per rotated entry, n <= 12 here)."""
    config = dataclasses.replace(_ec_config("eigenvalue_correction", q, s),
                                 schedule=ss.ScheduleConfig(precondition_frequency=2,
                                                            start_preconditioning_step=2))
    params, grads = stream(steps=5, seed=11)
    ref, state, names = _states_after(config, params, grads)
    layout = make_layout(tuple(tuple(np.shape(params[k])) for k in names), config)
    bases, moments, refreshed = [], [], []
    for grp, gs in zip(layout.groups, state.groups, strict=True):
        d = np.asarray(gs.corrected_moment)
        assert d.dtype == np.dtype(getattr(jnp, s))
        for row, (leaf, block) in enumerate(grp.members):
            bs = ref.state[names[leaf]].blocks[block]
            want = bs.corrected_second_moment
            assert want is not None
            if s == "float32":
                np.testing.assert_allclose(d[row].astype(np.float64), want,
                                           rtol=2 * (12 + 2) * 2.0**-24, atol=0)
            else:
                moments.append(fraction_not_bitwise(d[row].astype(np.float64), want, s))
        for i, k in enumerate(grp.preconditioned_dims):
            x = np.asarray(gs.inverse_roots[i])
            assert x.dtype == np.dtype(getattr(jnp, q))
            for row, (leaf, block) in enumerate(grp.members):
                basis = ref.state[names[leaf]].blocks[block].inverse_roots[k]
                assert basis is not None
                y = x[row].astype(np.float64)
                y = y * np.where(np.sum(y * basis, axis=0) < 0, -1.0, 1.0)  # sign: eigh's
                bases.append(fraction_not_bitwise(y, basis, q))
                refreshed.append(not np.array_equal(basis, np.eye(len(basis))))
    assert sum(refreshed) > len(refreshed) // 2 and float(np.mean(bases)) <= 0.02, bases
    assert s == "float32" or float(np.mean(moments)) <= 0.02, moments


# ------------------------------------------------ eq. (17b): eigenbasis reuse
@pytest.mark.parametrize("tolerance", [0.05, 0.3])
@pytest.mark.parametrize("q", [None, "bfloat16"])
def test_basis_reuse_equals_reference(tolerance: float, q: str | None) -> None:
    """float64 JAX against the reference with eigenbases kept by eq. (17b) on some root
    steps and recomputed on others (both happen: checked): the float64 agreement."""
    base = CASES["eigenvalue_correction"]
    ec = base.eigenvalue_correction
    assert ec is not None
    config = dataclasses.replace(
        base, factor_dtype="float64",
        schedule=ss.ScheduleConfig(precondition_frequency=1, start_preconditioning_step=13),
        eigenvalue_correction=dataclasses.replace(ec, basis_reuse_tolerance=tolerance,
                                                  eigenvectors_dtype=q))  # type: ignore[arg-type]
    params, grads = stream()
    counting = CountingReference(config, params)
    for g in grads:
        counting.step(g)
    assert any(counting.decisions) and not all(counting.decisions), counting.decisions
    err, where = _float64_error(config, params, grads)
    assert err <= 1e-9, f"relative error {err:.3e} at {where}"


def test_float16_factors_refuse_blocks_as_the_reference() -> None:
    """Eq. (3) with float16 factors (eq. 11b): a block whose factors could pass 2^15 is
    skipped as the reference skips it (counted, state unchanged), sharded-safe masks."""
    config = dataclasses.replace(
        _factor_storage_config("plain", "float16"),
        failure=ss.FailureConfig(nonfinite_gradient="skip_block"))
    params, grads = stream(steps=3, seed=3)
    name = sorted(params)[0]
    grads[1][name] = np.full_like(grads[1][name], 100.0)  # its blocks: |B| 100^2 > 2^15
    ref = ReferenceShampoo(config, params)
    for g in grads:
        ref.step(g)
    assert ref.metrics.skipped_blocks > 0
    names = sorted(params)
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        opt = shampoo_jax.shampoo(config)
        p = {k: jnp.asarray(params[k]) for k in names}
        state = opt.init(p)
        update = jax.jit(opt.update)
        for g in grads:
            u, state = update({k: jnp.asarray(g[k]) for k in names}, state, p)
            p = optax.apply_updates(p, u)
        assert int(state.skipped_blocks) == ref.metrics.skipped_blocks
        for k in names:
            theirs = ref.params[k]
            assert np.abs(np.asarray(p[k]) - theirs).max() <= 1e-2 * np.abs(theirs).max()
