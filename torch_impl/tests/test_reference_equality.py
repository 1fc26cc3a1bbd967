"""The torch optimizer equals the float64 reference (docs/spec.md section 5).

Every option of ShampooConfig appears in at least one case below. Each case
runs 20 steps of a seeded gradient stream over the shapes (7, 10), (7,),
(3, 4, 5), (12,), (), (1, 5, 1) and compares, after every step, the
displacement ``W_t - W_0`` of each parameter with the reference's:

    ||(W_torch - W_0) - (W_ref - W_0)|| <= rtol * max(||W_ref - W_0||, s_t)

with s_t the largest single step ``||W_ref,i - W_ref,i-1||`` up to t: a net
displacement that cancels (four sign steps summing to half an ulp) would
otherwise divide rounding that is relative to the steps taken by nothing.

float64: rtol = 1e-9 (spec section 5: 20 steps at kappa <= 1e6 give about
2e-9 in the worst case, far less typically). The cases keep every factor
well conditioned: epsilon 1e-6 (ANCHORS D: with rank-deficient factors and a
tiny eps the result depends on the arbitrary basis of degenerate
eigenspaces), and eigenvalue-corrected cases start after the factors are
full rank (their eigenvectors have no meaning before that).

float32: rtol = min(1e-2, n * u * kappa * steps) with u = 2^-24, n the
largest factor and kappa the largest condition number (after eq. 10) the
reference's factors reach on the stream: the bound of spec section 5.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from shampoo_conformance.adapters.torch import run as torch_run
from shampoo_conformance.suite.basis_reuse import CountingReference
from shampoo_conformance.suite.eigh_failures import reference_eigh_failures
from shampoo_conformance.suite.tolerances import STORAGE_UNIT_ROUNDOFF, fraction_not_bitwise
from shampoo_reference import ReferenceShampoo
from shampoo_reference import run as reference_run
from shampoo_reference.roots.regularize import effective_epsilon
from shampoo_spec import (
    BlockingConfig,
    CoupledNewtonConfig,
    EigenvalueCorrectionConfig,
    EighConfig,
    EpsilonConfig,
    ExponentConfig,
    FailureConfig,
    FrequentDirectionsConfig,
    GradientFilterConfig,
    GraftingConfig,
    MomentumConfig,
    OrderOverride,
    ScheduleConfig,
    ShampooConfig,
    StatisticsConfig,
    WeightDecayConfig,
    from_google,
    from_meta,
)
from shampoo_spec import is_root_step as ss_is_root_step
from shampoo_torch import NonFiniteGradientError, Shampoo

from .helpers import SHAPES, STEPS, max_relative_error, stepped, stream

BASE = ShampooConfig(
    learning_rate=0.05,
    epsilon=EpsilonConfig(value=1e-6),
    blocking=BlockingConfig(merge_dims_up_to=None),
)


def _stepped_both(
    config: ShampooConfig, params: dict[str, np.ndarray], grads: list[dict[str, np.ndarray]]
) -> tuple[ReferenceShampoo, Shampoo]:
    """The reference and torch's optimizer, each stepped over ``grads`` (float64), for
    the tests that compare stored state."""
    ref = ReferenceShampoo(config, params)
    for g in grads:
        ref.step(g)
    return ref, stepped(config, params, grads)


def cfg(**changes: object) -> ShampooConfig:
    return dataclasses.replace(BASE, **changes)  # type: ignore[arg-type]


def sched(**kw: object) -> ScheduleConfig:
    return ScheduleConfig(**kw)  # type: ignore[arg-type]


MOM = MomentumConfig(momentum=0.9)
ADAGRAD = GraftingConfig(type="adagrad")
NEWTON = CoupledNewtonConfig()
GOOGLE_NEWTON = CoupledNewtonConfig(
    error_growth_limit=1.2, retries=5, retry_epsilon_factor=10.0,
    retry_error_threshold=0.05, failure_threshold=0.1,
)

CASES: dict[str, ShampooConfig] = {
    # shape plan, eqs. (4)-(5), (12)
    "plain": BASE,
    "merge_last_to_first": cfg(blocking=BlockingConfig(merge_dims_up_to=64)),
    "merge_first_to_last": cfg(
        blocking=BlockingConfig(merge_dims_up_to=20, merge_direction="first_to_last")
    ),
    "blocked": cfg(blocking=BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None)),
    "skip_dim_size_gt": cfg(blocking=BlockingConfig(merge_dims_up_to=None, skip_dim_size_gt=8),
                            grafting=ADAGRAD),
    "skip_rank_lt": cfg(blocking=BlockingConfig(merge_dims_up_to=None, skip_rank_lt=2),
                        grafting=GraftingConfig(type="rmsprop", beta2=0.9)),
    "one_sided_all_but_last": cfg(
        blocking=BlockingConfig(merge_dims_up_to=None, preconditioned_dims="all_but_last")
    ),
    "one_sided_last": cfg(
        blocking=BlockingConfig(merge_dims_up_to=None, preconditioned_dims="last")
    ),
    "exponent_override": cfg(exponents=ExponentConfig(override=2.0)),
    "exponent_by_order": cfg(exponents=ExponentConfig(overrides_by_order=(
        OrderOverride(order=2, roots=(0.0, 2.0)), OrderOverride(order=3, roots=(4.0,)),
    ))),
    "exponent_preconditioned_dims": cfg(
        exponents=ExponentConfig(default="preconditioned_dims"),
        blocking=BlockingConfig(merge_dims_up_to=None, preconditioned_dims="last"),
    ),
    # statistics, eqs. (6)-(7)
    "ema_bias_corrected": cfg(statistics=StatisticsConfig(beta2=0.9, bias_correction=True)),
    "ema_weight_one": cfg(statistics=StatisticsConfig(beta2=0.95, ema_weight="one")),
    "initial_eps_identity": cfg(statistics=StatisticsConfig(initial_value="epsilon_identity")),
    # epsilon, eqs. (9)-(10)
    "eps_shift_after": cfg(epsilon=EpsilonConfig(value=1e-6, placement="shift_after")),
    "eps_floor": cfg(epsilon=EpsilonConfig(value=1e-6, placement="floor")),
    "eps_ridge_floor": cfg(epsilon=EpsilonConfig(value=1e-6, placement="ridge_floor")),
    "eps_relative": cfg(epsilon=EpsilonConfig(value=1e-4, scale="relative", relative_floor=1e-6)),
    # roots, eq. (11)
    "newton": cfg(root_inverse=NEWTON),
    "newton_google_rules": cfg(
        root_inverse=GOOGLE_NEWTON,
        epsilon=EpsilonConfig(value=1e-4, scale="relative", relative_floor=1e-6),
        statistics=StatisticsConfig(beta2=0.99, initial_value="epsilon_identity"),
    ),
    # schedule, eq. (8)
    # (eps 1e-3: the first roots see 1-5 gradients, so (12,) has a rank-deficient factor)
    "schedule_meta": cfg(schedule=sched(precondition_frequency=3, start_preconditioning_step=5),
                         grafting=ADAGRAD, epsilon=EpsilonConfig(value=1e-3)),
    "schedule_google": cfg(
        schedule=sched(precondition_frequency=3, statistics_frequency=2,
                       start_preconditioning_step=4, period_anchor="start",
                       roots_before_start=True),
        grafting=GraftingConfig(type="sgd", norm_scope="parameter"),
        epsilon=EpsilonConfig(value=1e-3),
    ),
    # eigenvalue correction, eq. (17) (starts once the factors are full rank)
    "eigenvalue_correction": cfg(
        eigenvalue_correction=EigenvalueCorrectionConfig(),
        schedule=sched(precondition_frequency=2, start_preconditioning_step=13),
    ),
    "eigenvalue_correction_sum_root4": cfg(
        eigenvalue_correction=EigenvalueCorrectionConfig(beta2=1.0, bias_correction=False,
                                                         root=4.0, epsilon=1e-8),
        schedule=sched(precondition_frequency=100, start_preconditioning_step=13),
        statistics=StatisticsConfig(beta2=0.9, bias_correction=True),
        grafting=ADAGRAD,
    ),
    # grafting, eqs. (14), (18)
    **{
        f"graft_{kind}_{scope}": cfg(grafting=GraftingConfig(
            type=kind,  # type: ignore[arg-type]
            beta2=beta2, bias_correction=kind == "adam", norm_scope=scope,  # type: ignore[arg-type]
        ))
        for kind, beta2 in [
            ("sgd", 1.0), ("adagrad", 1.0), ("rmsprop", 0.9), ("adam", 0.99), ("sign", 1.0),
            ("adagrad_normalized", 1.0), ("rmsprop_normalized", 0.9),
        ]
        for scope in ("block", "parameter")
    },
    # gradient filter, eq. (15)
    "filter": cfg(gradient_filter=GradientFilterConfig(beta1=0.9)),
    "filter_beta3_bias": cfg(
        gradient_filter=GradientFilterConfig(beta1=0.9, beta3=0.5, bias_correction=True),
        grafting=ADAGRAD,
    ),
    # momentum, eq. (20)
    "momentum": cfg(momentum=MOM),
    "momentum_nesterov_dampening": cfg(
        momentum=MomentumConfig(momentum=0.9, dampening=0.1, nesterov=True)
    ),
    "momentum_separate_before": cfg(
        momentum=MomentumConfig(momentum=0.9, nesterov=True, buffers="separate",
                                learning_rate_placement="before_momentum"),
        grafting=GraftingConfig(type="rmsprop", beta2=0.9, norm_scope="parameter"),
        schedule=sched(start_preconditioning_step=6, roots_before_start=True),
        weight_decay=WeightDecayConfig(value=0.01, type="direction"),
    ),
    # Eq. (20) without a graft (Google's NONE with beta1 > 0): F~ before the start step.
    "momentum_separate_no_graft": cfg(
        momentum=MomentumConfig(momentum=0.5, nesterov=True, buffers="separate"),
        grafting=GraftingConfig(type="none"),
        schedule=sched(start_preconditioning_step=6, roots_before_start=True),
    ),
    # weight decay, eqs. (2), (19), (21)
    "wd_l2": cfg(weight_decay=WeightDecayConfig(value=0.1, type="l2"), grafting=ADAGRAD),
    "wd_direction": cfg(weight_decay=WeightDecayConfig(value=0.1, type="direction"),
                        momentum=MOM),
    "wd_update": cfg(weight_decay=WeightDecayConfig(value=0.1, type="update"), momentum=MOM),
    # anchors' defaults through the importers
    "meta_defaults": from_meta({"lr": 0.01, "epsilon": 1e-6}),
    "meta_adagrad_graft": from_meta({
        "lr": 0.01, "epsilon": 1e-6, "precondition_frequency": 3, "max_preconditioner_dim": 8,
        "grafting_config": {"type": "AdaGradPreconditionerConfig", "epsilon": 1e-10},
        "weight_decay": 0.01,
    }),
    "google_defaults": from_google({"learning_rate": 0.1, "block_size": 8}),
    # Eq. (14d): Google's RMSPROP graft clipped at rms 1; a clipped normalized graft per block.
    "google_rmsprop_clip": from_google({
        "learning_rate": 0.05, "block_size": 6, "graft_type": "RMSPROP", "beta2": 0.9,
        "clip_by_scaled_gradient_norm": 1.0, "start_preconditioning_step": 2,
        "relative_matrix_epsilon": False,
    }),
    "rmsprop_normalized_clip_block": cfg(
        grafting=GraftingConfig(type="rmsprop_normalized", beta2=0.9, clip_rms=0.3),
        blocking=BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None),
    ),
    "google_eigh": from_google({"learning_rate": 0.1, "block_size": 8, "eigh": True,
                                "graft_type": "ADAGRAD"}),
}


#: Meta's options mapped to grafting.ema_weight (eq. 14b), update_dtype (eq. 21a)
#: and eigenvalue_correction.ema_weight (eq. 17); their own seeds, so that
#: adding them moved no seed of CASES.
META_OPTION_CASES: dict[str, ShampooConfig] = {
    # eq. (14b) with w = 1 (Meta's drop_weighting_factor_on_gsquare)
    "graft_rmsprop_weight_one": cfg(grafting=GraftingConfig(
        type="rmsprop", beta2=0.9, ema_weight="one")),
    "graft_adam_weight_one_corrected": cfg(grafting=GraftingConfig(
        type="adam", beta2=0.9, ema_weight="one", bias_correction=True)),
    # eq. (21a): the update rounded to update_dtype before it is added
    "update_bfloat16_nesterov_update_decay": cfg(
        update_dtype="bfloat16", grafting=ADAGRAD,
        momentum=MomentumConfig(momentum=0.9, nesterov=True),
        weight_decay=WeightDecayConfig(value=0.01, type="update")),
    "update_float16_lr_first": cfg(
        update_dtype="float16", grafting=ADAGRAD,
        momentum=MomentumConfig(momentum=0.5, learning_rate_placement="before_momentum")),
    "update_float32": cfg(update_dtype="float32", grafting=ADAGRAD, momentum=MOM),
    # Meta's drop_weighting_factor_on_gsquare with eigenvalue correction: weight 1
    # for the factors and D, neither bias-corrected (eqs. 6, 17). No graft: its
    # norm rescale would cancel D's weight (D scales with it) but for epsilon.
    "eigenvalue_correction_weight_one": cfg(
        eigenvalue_correction=EigenvalueCorrectionConfig(
            beta2=0.9, ema_weight="one", bias_correction=False, epsilon=1e-8),
        statistics=StatisticsConfig(beta2=0.9, ema_weight="one"),
        # From step 13: before, factors of rank < 13 have null spaces whose basis
        # is arbitrary (each backend's eigh picks its own), and D lives in it.
        schedule=sched(precondition_frequency=2, start_preconditioning_step=13),
    ),
}


#: Eq. (10f): QR roots from the stored eigenbases, in a dict of their own (seeds). From
#: step 13 (every factor of SHAPES full rank: a rank-deficient one's repeated eigenvalue
#: eps leaves its sorted order to rounding, docs/spec.md eq. 17c).
QR_ROOT_CASES: dict[str, ShampooConfig] = {
    "qr_one_iteration": cfg(root_inverse=EighConfig(eigenbasis_method="qr"),
                            schedule=sched(start_preconditioning_step=13)),
    "qr_iterations_tolerance_shift_after": cfg(
        root_inverse=EighConfig(eigenbasis_method="qr", qr_max_iterations=4, qr_tolerance=0.05),
        epsilon=EpsilonConfig(value=1e-6, placement="shift_after"),
        statistics=StatisticsConfig(beta2=0.9, bias_correction=True),
        schedule=sched(precondition_frequency=2, start_preconditioning_step=14),
        grafting=ADAGRAD),
    "qr_relative_epsilon": cfg(
        root_inverse=EighConfig(eigenbasis_method="qr", qr_max_iterations=3),
        epsilon=EpsilonConfig(value=1e-4, scale="relative"),
        schedule=sched(start_preconditioning_step=13)),
    "qr_meta_eigendecomposed": from_meta({
        # Factors of at most 8 (Meta merges dims: a 70 x 70 factor has rank <= 13).
        "lr": 0.01, "epsilon": 1e-6, "start_preconditioning_step": 13,
        "max_preconditioner_dim": 8,
        "preconditioner_config": {
            "type": "EigendecomposedShampooPreconditionerConfig",
            "amortized_computation_config": {"type": "QREigendecompositionConfig",
                                             "max_iterations": 2, "tolerance": 0.01},
            "factor_matrix_dtype": "float64", "factor_matrix_eigenvectors_dtype": "float64",
            "factor_matrix_eigenvalues_dtype": "float64"}}),
}


@pytest.mark.parametrize("name", sorted(QR_ROOT_CASES))
def test_qr_root_float64_equals_reference(name: str) -> None:
    _check_equals_reference(QR_ROOT_CASES, name, 3000)


def _check_equals_reference(cases: dict[str, ShampooConfig], name: str, seed_base: int,
                            shapes: dict[str, tuple[int, ...]] = SHAPES) -> None:
    """Case ``name`` on its own seeded stream (the seed: ``seed_base`` plus its sorted
    index, so adding a case to one dict moves no other dict's seeds), float64, <= 1e-9."""
    config = cases[name]
    params, grads = stream(seed=seed_base + sorted(cases).index(name), shapes=shapes)
    ref = reference_run(config, params, grads)
    ours = torch_run(config, params, grads, dtype=np.float64)
    assert max_relative_error(params, ours, ref) <= 1e-9


@pytest.mark.parametrize("name", sorted(CASES))
def test_float64_equals_reference(name: str) -> None:
    _check_equals_reference(CASES, name, 0)


@pytest.mark.parametrize("name", sorted(META_OPTION_CASES))
def test_meta_option_float64_equals_reference(name: str) -> None:
    _check_equals_reference(META_OPTION_CASES, name, 1000)


#: Eq. (10c), in a dict of their own so that CASES keep their seeds: SHAPES' factors of
#: 7, 10, 12 compressed at rank 3, those of 5 and below by the configured (Newton) root;
#: keep smallest on the eigh path, from step 8 (full-rank factors, docs/spec.md eq. 10c).
LOW_RANK_CASES: dict[str, ShampooConfig] = {
    "google_compression_rank": from_google({"learning_rate": 0.1, "block_size": 16,
                                            "compression_rank": 3, "graft_type": "ADAGRAD"}),
    "google_compression_rank_smallest_eigh": from_google({
        "learning_rate": 0.1, "block_size": 16, "compression_rank": -3, "eigh": True,
        "graft_type": "ADAGRAD", "start_preconditioning_step": 8}),
}


@pytest.mark.parametrize("name", sorted(LOW_RANK_CASES))
def test_low_rank_float64_equals_reference(name: str) -> None:
    _check_equals_reference(LOW_RANK_CASES, name, 2000)


#: Eqs. (6c), (10d). Sketched at rank 1: every factor of 4 or more; at rank 3: 6 or
#: more, so "t" (3, 8, 6) keeps its 3 by eq. (6) and "v" is never sketched. The vector
#: "u" observes rank 1 per step: its sketch spans at most r directions for its first r
#: root steps, where X = I (its null eigenvalues, rounding noise, count as 0: eq. 10d's
#: cutoff). Grafting keeps the steps bounded.
FREQUENT_DIRECTIONS_SHAPES = {"w": (7, 10), "t": (3, 8, 6), "m": (8, 6), "u": (12,), "v": (3,),
                              "s": ()}


def _fd(rank: int, **changes: object) -> ShampooConfig:
    fd = FrequentDirectionsConfig(rank=rank, **changes)  # type: ignore[arg-type]
    return cfg(frequent_directions=fd, grafting=ADAGRAD)


FREQUENT_DIRECTIONS_CASES: dict[str, ShampooConfig] = {
    "rank3_sum": _fd(3),
    "rank1_ema_relative_eps": dataclasses.replace(
        _fd(1, relative_floor=1e-3), statistics=StatisticsConfig(beta2=0.9),
        epsilon=EpsilonConfig(value=1e-4, scale="relative")),
    # Roots at t = 1 (the start: the empty slot, X = I) and every 3rd step; resets at
    # t = 1, 8, 15 (the root step 15 empties its sketch first).
    "rank3_average_gradients_every_3_reset": dataclasses.replace(
        _fd(3, average_gradients=True, reset_every=7), statistics=StatisticsConfig(beta2=0.95),
        schedule=sched(precondition_frequency=3, statistics_frequency=3), momentum=MOM),
    # Blocks of 4: factors of 4 sketched at rank 1, those of 3 and 2 by eq. (6).
    "rank1_blocked_reset_every_4": dataclasses.replace(
        _fd(1, reset_every=4), blocking=BlockingConfig(max_preconditioner_dim=4,
                                                       merge_dims_up_to=None)),
    "rank2_average_relative_eps_next_step": dataclasses.replace(
        _fd(2, average_gradients=True), epsilon=EpsilonConfig(value=1e-3, scale="relative"),
        schedule=sched(precondition_frequency=2, statistics_frequency=2,
                       roots_take_effect="next_step")),
}


@pytest.mark.parametrize("name", sorted(FREQUENT_DIRECTIONS_CASES))
def test_frequent_directions_float64_equals_reference(name: str) -> None:
    _check_equals_reference(FREQUENT_DIRECTIONS_CASES, name, 3000, FREQUENT_DIRECTIONS_SHAPES)


def test_frequent_directions_state_is_the_references() -> None:
    """Eqs. (6c), (10d): the observations C_k, sketches (U up to each column's sign),
    inverse roots and the gradient sum S (mid-period) are the reference's."""
    config = dataclasses.replace(FREQUENT_DIRECTIONS_CASES[
        "rank3_average_gradients_every_3_reset"], factor_dtype="float64")
    params, grads = stream(seed=3100, steps=10, shapes=FREQUENT_DIRECTIONS_SHAPES)
    ref, opt = _stepped_both(config, params, grads)
    sketched = 0
    for view in opt.blocks():
        bs = ref.state[view.name].blocks[view.block]
        assert view.factors is not None and view.inverse_roots is not None
        for k, sketch in enumerate(bs.sketches):
            if bs.factors[k] is None:
                continue
            np.testing.assert_allclose(view.factors[k].numpy(), bs.factors[k], rtol=1e-12)
            np.testing.assert_allclose(view.inverse_roots[k].numpy(), bs.inverse_roots[k],
                                       rtol=1e-9, atol=1e-9)
            mine = None if view.sketches is None else view.sketches[k]
            if sketch is None:
                assert mine is None
                continue
            assert mine is not None
            sketched += 1
            u, lam, rho = (x.numpy() for x in mine)
            np.testing.assert_allclose(lam, sketch.lam, rtol=1e-10)
            np.testing.assert_allclose(float(rho), sketch.rho, rtol=1e-10)
            u_ref = sketch.u
            np.testing.assert_allclose(np.abs(u.T @ u_ref), np.eye(u.shape[1]), atol=1e-9)
    assert sketched >= 4
    for i, p in enumerate(opt.param_groups[0]["params"]):
        name = list(params)[i]
        np.testing.assert_allclose(opt.state[p]["gradient_sum"].numpy(),
                                   ref.state[name].gradient_sum, rtol=0, atol=0)


def test_frequent_directions_skip_block_equals_reference() -> None:
    """Eq. (3) "skip_block" with eq. (6c)'s gradient sum: a refused block's entries add 0
    to S, and the block keeps its observation, sketch and root, as the reference's."""
    config = dataclasses.replace(
        FREQUENT_DIRECTIONS_CASES["rank1_blocked_reset_every_4"],
        frequent_directions=FrequentDirectionsConfig(rank=1, average_gradients=True),
        schedule=sched(precondition_frequency=2, statistics_frequency=2),
        failure=FailureConfig(nonfinite_gradient="skip_block"))
    params, grads = stream(seed=3200, shapes=FREQUENT_DIRECTIONS_SHAPES)
    grads[3]["w"][0, 0] = np.nan  # a statistics step: one block of w refused
    grads[4]["t"][1, 2, 3] = np.inf  # between statistics steps: t's block adds 0 to S
    ref = reference_run(config, params, grads)
    ours = torch_run(config, params, grads, dtype=np.float64)
    assert max_relative_error(params, ours, ref) <= 1e-9


def test_nonfinite_skip_block_equals_reference() -> None:
    """Eq. (3), "skip_block": the skipped blocks and their state match the reference."""
    config = cfg(
        failure=FailureConfig(nonfinite_gradient="skip_block"), momentum=MOM,
        blocking=BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None),
        grafting=ADAGRAD, gradient_filter=GradientFilterConfig(beta1=0.5),
    )
    params, grads = stream(seed=99)
    grads[3]["w"][0, 0] = np.nan  # one block of w
    grads[4]["t"][1, 2, 3] = np.inf
    grads[5]["s"] = np.array(np.nan)
    ref = reference_run(config, params, grads)
    ours = torch_run(config, params, grads, dtype=np.float64)
    assert max_relative_error(params, ours, ref) <= 1e-9


def _float32_rtol(config: ShampooConfig, params: dict, grads: list[dict]) -> float:
    """min(1e-2, n u kappa steps) from the reference's factors along the stream."""
    opt = ReferenceShampoo(config, params)
    kappa, n = 1.0, 1
    for g in grads:
        opt.step(g)
        for st in opt.state.values():
            for bs in st.blocks:
                for a in bs.factors:
                    if a is None:
                        continue
                    eps = effective_epsilon(a, config.epsilon)
                    lam = np.linalg.eigvalsh(0.5 * (a + a.T))
                    kappa = max(kappa, float((lam.max() + eps) / (max(lam.min(), 0.0) + eps)))
                    n = max(n, a.shape[0])
    u = 2.0**-24
    return min(1e-2, n * u * kappa * len(grads))


@pytest.mark.parametrize("name", ["plain", "blocked", "graft_adagrad_block", "newton",
                                  "momentum_nesterov_dampening", "meta_defaults"])
def test_float32_within_derived_bound(name: str) -> None:
    config = dataclasses.replace(CASES[name], epsilon=EpsilonConfig(value=1e-3))
    params, grads = stream(seed=7)
    rtol = _float32_rtol(config, params, grads)
    ref = reference_run(config, params, grads)
    ours = torch_run(config, params, grads, dtype=np.float32)
    assert max_relative_error(params, ours, ref) <= rtol


# ------------------------------------------------ statistics.storage, eq. (20c)
def _int16_cases() -> dict[str, ShampooConfig]:
    from shampoo_spec import from_google

    flags = {"best_effort_memory_usage_reduction": True, "batch_axis_name": "b",
             "relative_matrix_epsilon": False}
    return {
        "google_defaults": from_google({"learning_rate": 0.05, "block_size": 5, **flags},
                                       x64=True),
        "google_adagrad_ema_every_2nd_root": from_google({
            "learning_rate": 0.05, "block_size": 6, "graft_type": "ADAGRAD", "beta2": 0.9,
            "start_preconditioning_step": 2, "preconditioning_compute_steps": 2,
            "matrix_epsilon": 1e-4, **flags}, x64=True),
        "google_float32_scales": dataclasses.replace(from_google(
            {"learning_rate": 0.05, "block_size": 6, "statistics_compute_steps": 2, **flags},
            x64=False), factor_dtype="float64"),
    }


INT16_CASES = _int16_cases()


@pytest.mark.parametrize("name", sorted(INT16_CASES))
def test_int16_statistics_float64_equals_reference(name: str) -> None:
    """Eq. (20c) in float64: the float64 bound (an integer could differ only where an
    entry is within kappa u64 of a rounding boundary; none is on these streams); float
    storage instead moves the trajectory far beyond it."""
    config = INT16_CASES[name]
    assert config.statistics.quantized
    params, grads = stream(seed=5)
    ref = reference_run(config, params, grads)
    ours = torch_run(config, params, grads, dtype=np.float64)
    assert max_relative_error(params, ours, ref) <= 1e-9
    plain = dataclasses.replace(config, statistics=dataclasses.replace(
        config.statistics, storage="float", scale_dtype="float32"))
    assert max_relative_error(params, reference_run(plain, params, grads), ref) > 1e-6


# ------------------------------------------------- momentum.storage, eq. (20b)
def _int8(config: ShampooConfig, scale_dtype: str = "float64") -> ShampooConfig:
    return dataclasses.replace(config, momentum=dataclasses.replace(
        config.momentum, storage="int8_columnwise", scale_dtype=scale_dtype))


INT8_CASES = {
    "nesterov_dampening": _int8(CASES["momentum_nesterov_dampening"]),
    "separate_before": _int8(CASES["momentum_separate_before"]),
    "google_defaults_float32_scales": _int8(CASES["google_defaults"], "float32"),
}


@pytest.mark.parametrize("name", sorted(INT8_CASES))
def test_int8_momentum_float64_equals_reference(name: str) -> None:
    """Eq. (20b) in float64: the float64 bound (an integer could differ only where M/s is
    within kappa u64 of a half-integer; none is on these streams)."""
    config = INT8_CASES[name]
    params, grads = stream(seed=5)
    ref = reference_run(config, params, grads)
    ours = torch_run(config, params, grads, dtype=np.float64)
    assert max_relative_error(params, ours, ref) <= 1e-9


def test_int8_momentum_skip_block_equals_reference() -> None:
    """Eq. (20b) with eq. (3)'s skipped blocks: their entries keep the read-back old value,
    requantized with the column's new scale, as the reference does."""
    config = _int8(cfg(
        failure=FailureConfig(nonfinite_gradient="skip_block"), momentum=MOM,
        blocking=BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None),
        grafting=ADAGRAD, factor_dtype="float64"))
    params, grads = stream(seed=99)
    grads[3]["w"][0, 0] = np.nan
    grads[4]["t"][1, 2, 3] = np.inf
    ref = reference_run(config, params, grads)
    ours = torch_run(config, params, grads, dtype=np.float64)
    assert max_relative_error(params, ours, ref) <= 1e-9


@pytest.mark.parametrize("scale_dtype", ["float32", "float64"])
def test_int8_momentum_state_is_the_references(scale_dtype: str) -> None:
    """The stored integers after 5 steps equal the reference's; the scales agree to the
    rounding of M: an ulp of float32, or in float64 the section 5 bound 1e-9 (measured
    1e-12 on the (1, 5, 1) parameter, whose early factors have kappa near 1e6)."""
    config = dataclasses.replace(_int8(CASES["momentum_separate_before"], scale_dtype),
                                 factor_dtype="float64")
    params, grads = stream(seed=3, steps=5)
    ref = ReferenceShampoo(config, params)
    tensors = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in params.items()}
    opt = Shampoo(list(tensors.values()), config)
    for g in grads:
        ref.step(g)
        for k, p in tensors.items():
            p.grad = torch.tensor(g[k])
        opt.step()
    for k, p in tensors.items():
        st = opt.state[p]
        for key in ("momentum", "graft_momentum"):
            if len(SHAPES[k]) >= 2:
                q, s = ref.state[k].stored[key]
                assert st[key].dtype == torch.int8
                np.testing.assert_array_equal(st[key].numpy(), q)
                got = st[key + "_scale"].numpy()
                assert got.dtype == np.dtype(scale_dtype)
                rtol = max(2 * float(np.finfo(scale_dtype).eps), 1e-9)
                np.testing.assert_allclose(got, s, rtol=rtol, atol=0)
            else:
                assert st[key].dtype == torch.float64 and key + "_scale" not in st


def test_int8_momentum_float32_within_derived_bound() -> None:
    """float32 torch, float32 scales: the float32 bound of section 5 (a flipped integer
    moves one entry by 1/127 of its column's maximum, times mu: inside it here)."""
    config = dataclasses.replace(INT8_CASES["google_defaults_float32_scales"],
                                 epsilon=EpsilonConfig(value=1e-3))
    params, grads = stream(seed=7)
    rtol = _float32_rtol(config, params, grads)
    ref = reference_run(config, params, grads)
    ours = torch_run(config, params, grads, dtype=np.float32)
    assert max_relative_error(params, ours, ref) <= rtol


# ------------------------------------------------- inverse_root_dtype, eqs. (11a), (16)
ROOT_CASES = ["plain", "blocked", "graft_adagrad_block", "newton", "exponent_by_order",
              "momentum_nesterov_dampening"]


def _root_config(name: str, dtype: str) -> ShampooConfig:
    return dataclasses.replace(CASES[name], epsilon=EpsilonConfig(value=1e-3),
                               factor_dtype="float64",
                               inverse_root_dtype=dtype)  # type: ignore[arg-type]


def _storage_rtol(config: ShampooConfig, params: dict, grads: list[dict], dtype: str) -> float:
    """Spec section 5 for roots stored in s: the float32 bound with u = u_s, capped at 1e-2.

    The reference emulates every rounding of eqs. (11a) and (16); what is left
    is a root or product whose unrounded value differs (kappa u64, resp. the
    backend's accumulation error) across a rounding boundary of s, one ulp of
    s in that entry, entering the direction as a root error does.
    """
    return min(1e-2, _float32_rtol(config, params, grads) * STORAGE_UNIT_ROUNDOFF[dtype] / 2.0**-24)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", ROOT_CASES)
def test_inverse_root_dtype_within_derived_bound(name: str, dtype: str) -> None:
    """float64 torch with roots stored in s against the reference's exact emulation.

    The bound is the spec's worst case (every entry one ulp off), here the
    1e-2 cap; measured (seed 7, 20 steps): float32 3e-6 to 5e-6 (torch's
    float32 GEMMs accumulate in float32, n u32 times the cancellation, which
    eps = 1e-3 keeps small); bfloat16 0 to 2e-15 (its CPU GEMMs accumulate in
    float32, far below one ulp of bfloat16: no entry rounds otherwise than in
    the reference, the trajectories are the same); float16 up to 1.4e-5 (a
    few entries one ulp of float16 apart). The tests below check the roots
    and the first direction entry by entry, where a wrong rule cannot hide.
    """
    config = _root_config(name, dtype)
    params, grads = stream(seed=7)
    rtol = _storage_rtol(config, params, grads, dtype)
    ref = reference_run(config, params, grads)
    ours = torch_run(config, params, grads, dtype=np.float64)
    assert max_relative_error(params, ours, ref) <= rtol


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_stored_roots_are_the_references_bit_for_bit(dtype: str) -> None:
    """Eq. (11a) at the first root step, where torch's factors equal the reference's to
    ~1e-16: the unrounded roots differ by kappa u64 (kappa <= 1e4 here), so a root
    entry can round differently only when it lies that close to a boundary of s,
    probability about kappa u64 / u_s per entry (<= 1e-4 for float32). We allow
    1% of the entries to differ, by one ulp of s at most; a root not rounded, or
    rounded by truncation, differs in about half of them.
    """
    config = _root_config("blocked", dtype)
    params, grads = stream(seed=11, steps=1)
    ref = ReferenceShampoo(config, params)
    ref.step(grads[0])
    ours = torch_run_with_views(config, params, grads)
    fractions = []
    for name, blocks in ours.items():
        for bs, roots in zip(ref.state[name].blocks, blocks, strict=True):
            for x, y in zip(bs.inverse_roots, roots, strict=True):
                if x is not None:
                    assert y is not None and y.dtype == ROOT_TORCH_DTYPES[dtype]
                    fractions.append(fraction_not_bitwise(y.double().numpy(), x, dtype))
    assert fractions and float(np.mean(fractions)) <= 0.01, fractions


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_first_direction_is_the_references_bit_for_bit(dtype: str) -> None:
    """Eq. (16) at step 1 (W_0 = 0, lr = 1, no graft: W_1 = -P exactly).

    Torch's bfloat16/float16 GEMMs on CPU accumulate in float32: the product
    differs from the reference's float64 one by about n u32 times the
    cancellation of the sum, so an entry rounds differently only within that
    of a boundary of s: probability about n u32 c / u_s (< 1e-3 here). At most
    1% of the entries may differ, each by one ulp; computing the product
    wider than s and rounding only once (or not rounding the gradient) moves
    most entries.
    """
    config = dataclasses.replace(_root_config("blocked", dtype), learning_rate=1.0)
    params, grads = stream(seed=5, steps=1)
    params = {k: np.zeros_like(v) for k, v in params.items()}
    (ref,) = reference_run(config, params, grads)
    (ours,) = torch_run(config, params, grads, dtype=np.float64)
    fractions = [fraction_not_bitwise(ours[k], ref[k], dtype) for k in params if ref[k].size > 1]
    assert float(np.mean(fractions)) <= 0.01, fractions


ROOT_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                     "float16": torch.float16}


# ----------------------------------------------------- factor_storage_dtype, eq. (11b)
#: Cases with eq. (11b)'s root (eigh, absolute epsilon, ridge; shift_after added).
FACTOR_STORAGE_CASES = ["plain", "blocked", "graft_adagrad_block", "exponent_by_order",
                        "momentum_nesterov_dampening", "shift_after"]


def _factor_storage_config(name: str, dtype: str, inverse: str | None = None) -> ShampooConfig:
    base = (cfg(epsilon=EpsilonConfig(value=1e-3, placement="shift_after"))
            if name == "shift_after" else CASES[name])
    return dataclasses.replace(base, epsilon=dataclasses.replace(base.epsilon, value=1e-3),
                               factor_dtype="float64", inverse_root_dtype=inverse,  # type: ignore[arg-type]
                               factor_storage_dtype=dtype)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", FACTOR_STORAGE_CASES)
def test_factor_storage_dtype_within_derived_bound(name: str, dtype: str) -> None:
    """float64 torch with factors stored in s (native s tensors) against the reference's
    exact emulation (eq. 11b), within section 5's bound with u = u_s (1e-2 cap).

    torch forms the outer products, the eigendecomposition and the root's
    product in float64, and its s kernels are the ones the reference emulates,
    so only (a)-(c) of eq. (11b) remain. The entry-by-entry test below is the
    sharp one.
    """
    config = _factor_storage_config(name, dtype)
    params, grads = stream(seed=7)
    rtol = _storage_rtol(config, params, grads, dtype)
    ref = reference_run(config, params, grads)
    ours = torch_run(config, params, grads, dtype=np.float64)
    assert max_relative_error(params, ours, ref) <= rtol


@pytest.mark.parametrize("inverse", [None, "float32"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_stored_factors_and_roots_are_the_references_bit_for_bit(
        dtype: str, inverse: str | None) -> None:
    """Eq. (11b) after four steps (roots every step): torch's factors and roots are s
    numbers equal to the reference's in all but a few entries (a flip needs an
    entry within kappa 2^-53, or a float32 power's error, of a boundary of s);
    a rounding step left out or done in another precision moves far more."""
    config = _factor_storage_config("blocked", dtype, inverse)
    params, grads = stream(seed=11, steps=4)
    ref, opt = _stepped_both(config, params, grads)
    fractions = []
    root_dtype = torch.float64 if inverse is None else ROOT_TORCH_DTYPES[inverse]
    for view in opt.blocks():
        assert view.factors is not None and view.inverse_roots is not None
        bs = ref.state[view.name].blocks[view.block]
        for mine, theirs in ((view.factors, bs.factors), (view.inverse_roots, bs.inverse_roots)):
            for y, x in zip(mine, theirs, strict=True):
                if x is not None:
                    assert y is not None
                    assert y.dtype in (ROOT_TORCH_DTYPES[dtype], root_dtype)
                    fractions.append(fraction_not_bitwise(y.double().numpy(), x, dtype))
    assert fractions and float(np.mean(fractions)) <= 0.01, fractions


def torch_run_with_views(
    config: ShampooConfig, params: dict, grads: list[dict]
) -> dict[str, list[tuple[torch.Tensor | None, ...]]]:
    """Step torch (float64 parameters) through ``grads``; each parameter's blocks' roots."""
    opt = stepped(config, params, grads)
    out: dict[str, list[tuple[torch.Tensor | None, ...]]] = {k: [] for k in params}
    for view in opt.blocks():
        assert view.inverse_roots is not None
        out[view.name].append(view.inverse_roots)
    return out


# ------------------------------------------- eq. (13): eigh roots judged by their error
#: Gradient scales per parameter for eq. (13)'s threshold: the eigh error e is
#: rounding noise, about 1e-16 ||B||, so small gradients give e <= 1e-17 and large
#: ones e >= 1e-8 (float64); "v" switches from small to large at step 15, so its
#: roots pass, then fail and keep the root of step 14. tau = 1e-11 sits >= 100x
#: from every error (checked on the reference's factors).
EIGH_TAU = 1e-11
EIGH_SCALES = {"w": 1e-4, "t": 1e4, "u": 1e-2, "s": 1.0, "o": 1e-2}
EIGH_SWITCH = 15


def eigh_failure_stream(seed: int = 5) -> tuple[dict, list[dict]]:
    params, grads = stream(seed)
    for t, g in enumerate(grads, start=1):
        for k in g:
            g[k] = g[k] * EIGH_SCALES.get(k, 1e-4 if t < EIGH_SWITCH else 1e4)
    return params, grads


EIGH_FAILURE_CASES = {
    "eigh": cfg(root_inverse=EighConfig(failure_threshold=EIGH_TAU), grafting=ADAGRAD),
    # Eq. (17): the eigenbases judged alike (from step 13, once the factors are full rank).
    "eigenvalue_correction": cfg(
        root_inverse=EighConfig(failure_threshold=EIGH_TAU), grafting=ADAGRAD,
        eigenvalue_correction=EigenvalueCorrectionConfig(),
        schedule=sched(start_preconditioning_step=13),
    ),
}


@pytest.mark.parametrize("name", sorted(EIGH_FAILURE_CASES))
def test_eigh_failure_threshold_equals_reference(name: str) -> None:
    """Some roots fail (kept and counted, eq. 13), some pass: float64 equals the reference."""
    config = EIGH_FAILURE_CASES[name]
    params, grads = eigh_failure_stream()
    failures = reference_eigh_failures(config, params, grads, EIGH_TAU)
    ref = reference_run(config, params, grads)
    config64 = dataclasses.replace(config, factor_dtype="float64")
    tensors = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in params.items()}
    opt = Shampoo(list(tensors.items()), config64)
    ours = []
    for g in grads:
        for k, p in tensors.items():
            p.grad = torch.tensor(g[k])
        opt.step()
        ours.append({k: p.detach().numpy().copy() for k, p in tensors.items()})
    assert max_relative_error(params, ours, ref) <= 1e-9
    assert opt.metrics["root_failures"] == failures


# ------------------------------------ eq. (8b): the root period follows the learning rate
#: Google's anchor, period 4 growing by up to 21 as a LambdaLR decays the rate linearly
#: to 0 over 20 steps: x = 4 + 1.05 c, so roots at each of the first six steps, then at
#: c = 10 only (as jax_impl/tests/test_reference_equality.py).
GROWTH = from_google({
    "learning_rate": 0.05, "block_size": 6, "graft_type": "ADAGRAD", "eigh": True,
    "relative_matrix_epsilon": False, "start_preconditioning_step": 2,
    "preconditioning_compute_steps": 4,
})
GROWTH = dataclasses.replace(GROWTH, schedule=dataclasses.replace(
    GROWTH.schedule, precondition_frequency_growth=21))


def _scheduled_run(config: ShampooConfig, params: dict, grads: list[dict],
                   dtype: torch.dtype) -> tuple[list[dict], Shampoo]:
    names = list(params)
    tensors = {n: torch.nn.Parameter(torch.tensor(params[n], dtype=dtype)) for n in names}
    opt = Shampoo([(n, tensors[n]) for n in names], config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda c: 1.0 - c / 20.0)
    out = []
    for step in grads:
        for n in names:
            tensors[n].grad = torch.tensor(step[n], dtype=dtype)
        opt.step()
        scheduler.step()
        out.append({n: tensors[n].detach().numpy().copy() for n in names})
    return out, opt


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_growing_root_period_equals_reference(dtype: torch.dtype) -> None:
    params, grads = stream(seed=3)
    rates = [0.05 * (1.0 - c / 20.0) for c in range(STEPS)]
    roots = [t for t in range(1, STEPS + 1)
             if ss_is_root_step(t, GROWTH.schedule, rates[t - 1] / rates[0])]
    assert roots == [1, 2, 3, 4, 5, 6, 11]  # not the constant period's 1, 5, 9, ...
    ref = reference_run(GROWTH, params, grads, rates)
    config = dataclasses.replace(
        GROWTH, factor_dtype="float64" if dtype == torch.float64 else "float32")
    ours, opt = _scheduled_run(config, params, grads, dtype)
    assert opt.param_groups[0]["first_step_lr"] == 0.05
    # float32: section 5's bound, capped at 1e-2 (factors of size <= 6, eps 1e-6).
    assert max_relative_error(params, ours, ref) <= (1e-9 if dtype == torch.float64 else 1e-2)
    constant = reference_run(dataclasses.replace(GROWTH, schedule=dataclasses.replace(
        GROWTH.schedule, precondition_frequency_growth=None)), params, grads, rates)
    assert max_relative_error(params, constant, ref) > 1e-3  # the root steps matter here


# ------------------------- eq. (19): decay scaled by lr_t / lr_0 (Meta's CORRECTED)
def test_corrected_weight_decay_follows_the_schedule() -> None:
    """``scale_by_lr_ratio`` under a LambdaLR: the decay coefficient is wd * lr_t / lr_0,
    lr_0 the config's rate; equal to the reference fed the same rates, far from the
    unscaled decay."""
    config = dataclasses.replace(GROWTH, factor_dtype="float64", weight_decay=(
        WeightDecayConfig(value=0.5, type="direction", scale_by_lr_ratio=True)))
    params, grads = stream(seed=4)
    rates = [0.05 * (1.0 - c / 20.0) for c in range(STEPS)]
    ref = reference_run(config, params, grads, rates)
    ours, _ = _scheduled_run(config, params, grads, torch.float64)
    assert max_relative_error(params, ours, ref) <= 1e-9
    plain = dataclasses.replace(config, weight_decay=WeightDecayConfig(value=0.5))
    assert max_relative_error(params, reference_run(plain, params, grads, rates), ref) > 1e-3


# ------------------------------ eigenvalue correction's storage dtypes, eq. (17a)
#: (eigenvectors_dtype q, corrected_eigenvalues_dtype s): Meta's default (float32
#: both), each coarse one alone, and both coarse.
EC_DTYPES = [("float32", "float32"), ("bfloat16", None), (None, "bfloat16"),
             ("bfloat16", "bfloat16"), ("float16", "float16")]


EC_CASES = ["eigenvalue_correction", "eigenvalue_correction_sum_root4"]


def _ec_config(name: str, q: str | None, s: str | None) -> ShampooConfig:
    config = CASES[name]
    ec = config.eigenvalue_correction
    assert ec is not None
    # epsilon 1e-4: float16 holds it (eq. 17a needs >= 2^-24 there).
    ec = dataclasses.replace(ec, eigenvectors_dtype=q, corrected_eigenvalues_dtype=s,
                             epsilon=max(ec.epsilon, 1e-4))
    return dataclasses.replace(config, factor_dtype="float64", eigenvalue_correction=ec)


def _coarser(q: str | None, s: str | None) -> str:
    return max((d for d in (q, s) if d is not None), key=STORAGE_UNIT_ROUNDOFF.__getitem__)


@pytest.mark.parametrize(("q", "s"), EC_DTYPES)
@pytest.mark.parametrize("name", EC_CASES)
def test_eigenvalue_correction_dtypes_within_derived_bound(
    name: str, q: str | None, s: str | None
) -> None:
    """float64 torch with Q_k stored in q and D in s against the reference's emulation.

    Spec section 5 with u of the coarser of q and s (capped at 1e-2).
    Measured (seed 7, 20 steps): see docs/spec.md section 5; the tests below
    check the eigenbases and D entry by entry.
    """
    config = _ec_config(name, q, s)
    params, grads = stream(seed=7)
    rtol = _storage_rtol(config, params, grads, _coarser(q, s))
    ref = reference_run(config, params, grads)
    ours = torch_run(config, params, grads, dtype=np.float64)
    error = max_relative_error(params, ours, ref)
    print(f"{name} q={q} s={s}: {error:.2e} (bound {rtol:.1e})")
    assert error <= rtol


@pytest.mark.parametrize(("q", "s"), [("float32", "float32"), ("bfloat16", "bfloat16"),
                                      ("float16", "float16")])
def test_eigenbases_and_moment_are_the_references_bit_for_bit(q: str, s: str) -> None:
    """Eq. (17a) at step 14, after the first root step with the basis in use (13).

    Each stored Q_k is in q and within one ulp of q of the reference's entry,
    equal in almost all (Q_k comes from the factor in float64: a flip needs
    an entry within kappa u64 of a rounding boundary); 2% may differ. D is in
    s. For bfloat16 and float16 it is equal in almost all entries as well
    (torch's rotations in them accumulate in float32, far below their ulp);
    measured: every entry. For float32, torch's float32 GEMMs accumulate each
    rotated entry with n u32 relative error, which D squares and sums: D is
    then within 2 (n + 2) u32 relative (n the largest block dim, 10 here);
    measured: 2 ulps at most, in 8% to 38% of the entries.
    """
    config = _ec_config("eigenvalue_correction", q, s)
    params, grads = stream(seed=11, steps=14)
    ref, opt = _stepped_both(config, params, grads)
    bases, moments = [], []
    for view in opt.blocks():
        bs = ref.state[view.name].blocks[view.block]
        assert view.inverse_roots is not None and view.corrected is not None
        assert bs.corrected_second_moment is not None
        for x, y in zip(bs.inverse_roots, view.inverse_roots, strict=True):
            if x is not None:
                assert y is not None and y.dtype == ROOT_TORCH_DTYPES[q]
                # An eigenvector's sign is the decomposition's choice: compare up to it.
                y64 = y.double().numpy()
                y64 = y64 * np.where(np.sum(y64 * x, axis=0) < 0, -1.0, 1.0)
                bases.append(fraction_not_bitwise(y64, x, q))
        assert view.corrected.dtype == ROOT_TORCH_DTYPES[s]
        d, want = view.corrected.double().numpy(), bs.corrected_second_moment
        if s == "float32":
            np.testing.assert_allclose(d, want, rtol=2 * (10 + 2) * 2.0**-24, atol=0)
        else:
            moments.append(fraction_not_bitwise(d, want, s))
    assert bases and float(np.mean(bases)) <= 0.02, bases
    assert s == "float32" or float(np.mean(moments)) <= 0.02, moments


# ------------------------------------------------ eq. (17b): eigenbasis reuse
@pytest.mark.parametrize("tolerance", [0.05, 0.3])
@pytest.mark.parametrize("q", [None, "bfloat16"])
def test_basis_reuse_equals_reference(tolerance: float, q: str | None) -> None:
    """float64 torch against the reference with eigenbases kept by eq. (17b) on some
    root steps and recomputed on others (both happen here: checked): the same
    trajectory to float64 rounding (the float64 bound; a decision could only differ
    where the ratio lies within ~1e-16 of the tolerance)."""
    base = CASES["eigenvalue_correction"]
    ec = base.eigenvalue_correction
    assert ec is not None
    config = dataclasses.replace(
        base, factor_dtype="float64",
        schedule=sched(precondition_frequency=1, start_preconditioning_step=13),
        eigenvalue_correction=dataclasses.replace(ec, basis_reuse_tolerance=tolerance,
                                                  eigenvectors_dtype=q))  # type: ignore[arg-type]
    params, grads = stream(seed=7)
    counting = CountingReference(config, params)
    for g in grads:
        counting.step(g)
    assert any(counting.decisions) and not all(counting.decisions), counting.decisions
    ref = reference_run(config, params, grads)
    ours = torch_run(config, params, grads, dtype=np.float64)
    assert max_relative_error(params, ours, ref) <= 1e-9
    without = reference_run(dataclasses.replace(config, eigenvalue_correction=dataclasses.replace(
        config.eigenvalue_correction, basis_reuse_tolerance=0.0)), params, grads)
    assert max_relative_error(params, without, ref) > 1e-6  # the reuse changes the run


@pytest.mark.parametrize("policy", ["raise", "skip_block"])
def test_float16_factors_refuse_blocks_as_the_reference(policy: str) -> None:
    """Eq. (3) with float16 factors (eq. 11b): a block whose factors could pass 2^15 is
    refused as the reference refuses it (raised naming float16, or skipped and counted)."""
    config = dataclasses.replace(
        _factor_storage_config("blocked", "float16"),
        failure=FailureConfig(nonfinite_gradient=policy))  # type: ignore[arg-type]
    params, grads = stream(seed=3, steps=3)
    grads[1]["o"] = np.full_like(grads[1]["o"], 100.0)  # its (4,) block: 4 * 100^2 > 2^15
    ref = ReferenceShampoo(config, params)
    tensors = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in params.items()}
    opt = Shampoo(list(tensors.items()), config)
    for g in grads:
        for k, t in tensors.items():
            t.grad = torch.tensor(g[k])
        if policy == "raise":
            try:
                ref.step(g)
            except NonFiniteGradientError:
                with pytest.raises(NonFiniteGradientError, match="float16 factors"):
                    opt.step()
                return
        else:
            ref.step(g)
        opt.step()
    assert policy == "skip_block"
    assert ref.metrics.skipped_blocks > 0
    assert opt.metrics["skipped_blocks"] == ref.metrics.skipped_blocks
    for k, t in tensors.items():
        ours, theirs = t.detach().numpy(), ref.params[k]
        assert np.abs(ours - theirs).max() <= 1e-2 * max(np.abs(theirs).max(), 1e-30)
