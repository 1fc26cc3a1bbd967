"""Named configurations covering every option of the spec, and their problems.

The Hypothesis strategies explore the config space at random; these cases
pin down one deliberate configuration per option (and the anchors' presets)
so every rule of docs/spec.md is exercised on every run, deterministically.
Epsilons and step counts keep each factor well conditioned, so the
comparison tolerance (see :mod:`tolerances`) stays meaningful.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import NDArray

import shampoo_spec as ss

#: Shapes every named case runs on, together: a matrix, vectors, a 3-tensor,
#: a 0-d scalar, size-1 dims, and a matrix with several equal-shaped blocks.
CASE_SHAPES: dict[str, tuple[int, ...]] = {
    "matrix": (7, 10),
    "vector": (7,),
    "tensor": (3, 4, 5),
    "long": (12,),
    "scalar": (),
    "ones": (1, 5, 1),
    "wide": (6, 8),
}


@dataclass(frozen=True)
class Case:
    """One named config with the gradient stream it runs on."""

    name: str
    config: ss.ShampooConfig
    steps: int = 10
    seed: int = 0
    #: Scales every gradient entry past the first 4 of its first dim (the blocks of
    #: 4 after the first): blocks of one parameter at different scales.
    tail_scale: float = 1.0

    def problem(
        self,
    ) -> tuple[dict[str, NDArray[np.float64]], list[dict[str, NDArray[np.float64]]]]:
        params, grads = make_problem(CASE_SHAPES, self.steps, self.seed)
        if self.tail_scale != 1.0:
            for step in grads:
                for g in step.values():
                    if g.ndim:
                        g[4:] *= self.tail_scale
        return params, grads


def make_problem(
    shapes: dict[str, tuple[int, ...]], steps: int, seed: int, scale: float = 1.0
) -> tuple[dict[str, NDArray[np.float64]], list[dict[str, NDArray[np.float64]]]]:
    """Seeded standard-normal parameters and gradient stream."""
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s) for k, s in shapes.items()}
    grads = [{k: scale * rng.standard_normal(s) for k, s in shapes.items()} for _ in range(steps)]
    return params, grads


_UNMERGED = ss.BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None)
_BASE = ss.ShampooConfig(
    learning_rate=0.1,
    epsilon=ss.EpsilonConfig(value=1e-3),
    blocking=_UNMERGED,
    grafting=ss.GraftingConfig(type="adagrad"),
    factor_dtype="float64",
)


def _with(**sections: object) -> ss.ShampooConfig:
    return replace(_BASE, **sections)  # type: ignore[arg-type]


def named_cases() -> list[Case]:
    """The deterministic coverage set: one case per rule of docs/spec.md."""
    return [
        Case("plain_kronecker_no_graft", _with(grafting=ss.GraftingConfig())),
        Case("adagrad_graft_block_norm", _BASE),
        Case(
            "adagrad_graft_parameter_norm",
            _with(grafting=ss.GraftingConfig(type="adagrad", norm_scope="parameter")),
        ),
        Case("sgd_graft", _with(grafting=ss.GraftingConfig(type="sgd"))),
        Case("rmsprop_graft", _with(grafting=ss.GraftingConfig(type="rmsprop", beta2=0.9))),
        Case(
            "adam_graft_filter",
            _with(
                grafting=ss.GraftingConfig(type="adam", beta2=0.99, bias_correction=True),
                gradient_filter=ss.GradientFilterConfig(beta1=0.9, bias_correction=True),
            ),
        ),
        Case("sign_graft", _with(grafting=ss.GraftingConfig(type="sign"))),
        Case(
            # Tearfree's RMSProp graft: epsilon inside the square root (eq. 14c).
            "rmsprop_graft_epsilon_inside_sqrt",
            _with(grafting=ss.GraftingConfig(type="rmsprop", beta2=0.9, epsilon=0.01,
                                             epsilon_placement="inside_sqrt")),
        ),
        Case(
            "normalized_grafts",
            _with(grafting=ss.GraftingConfig(type="rmsprop_normalized", beta2=0.9)),
        ),
        Case(
            # Eq. (14e), optax's Adafactor (tearfree's ADAFACTOR graft): the matrices,
            # the tensor and "ones" factored over their two largest dims (m = 3), the
            # vectors not; scaled by rms(W); the raw graft for two steps. Not clipped:
            # steps of rms about 1 would be clipped to exactly 1, hiding a wrong scale.
            "adafactor_graft",
            _with(grafting=ss.GraftingConfig(
                type="adafactor", decay_exponent=0.8, factor_min_dim=3, epsilon=1e-30,
                epsilon_placement="inside_sqrt", parameter_scale_floor=1e-3,
                norm_scope="parameter"),
                schedule=ss.ScheduleConfig(start_preconditioning_step=3)),
        ),
        Case(
            "nadam_filter_beta3",
            _with(
                gradient_filter=ss.GradientFilterConfig(beta1=0.9, beta3=0.5, bias_correction=True)
            ),
        ),
        Case(
            "ema_statistics_bias_corrected",
            _with(statistics=ss.StatisticsConfig(beta2=0.9, bias_correction=True)),
        ),
        Case(
            "epsilon_identity_init",
            _with(statistics=ss.StatisticsConfig(beta2=0.95, initial_value="epsilon_identity")),
        ),
        Case(
            "relative_epsilon_shift_after",
            _with(epsilon=ss.EpsilonConfig(value=1e-3, scale="relative", placement="shift_after")),
        ),
        Case("epsilon_floor", _with(epsilon=ss.EpsilonConfig(value=1e-2, placement="floor"))),
        Case(
            # Meta's PseudoInverseConfig: factors from zero are rank-deficient for the
            # first steps; eigenvalues below 1e-4 lambda_max (float32 eigh noise is
            # about 1e-7 lambda_max, the kept ones about 1) get a zero root.
            "pseudo_inverse",
            _with(epsilon=ss.EpsilonConfig(value=0.0, placement="pseudo_inverse",
                                           rank_rtol=1e-4)),
        ),
        Case(
            # Eq. (10g), tearfree's cutoff: the largest eigenvalue over a parameter's
            # blocks of one dim scales rtol. Blocks of 4 split the matrices and "long",
            # whose later blocks have eigenvalues about 1e-6 of the first's: cut here
            # (100 times below 1e-4 Lambda), kept by each factor's own cutoff.
            "pseudo_inverse_per_parameter",
            _with(epsilon=ss.EpsilonConfig(value=0.0, placement="pseudo_inverse",
                                           rank_rtol=1e-4, rank_cutoff_scope="parameter")),
            tail_scale=1e-3,
        ),
        Case(
            "coupled_newton",
            _with(root_inverse=ss.CoupledNewtonConfig(tolerance=1e-12, max_iterations=200)),
        ),
        Case(
            "coupled_newton_google_rules",
            _with(
                root_inverse=ss.CoupledNewtonConfig(
                    tolerance=1e-12,
                    error_growth_limit=1.2,
                    retries=2,
                    failure_threshold=0.1,
                ),
                epsilon=ss.EpsilonConfig(value=1e-3, scale="relative", placement="ridge_floor"),
            ),
        ),
        Case(
            # Eq. (11d): Google's LOBPCG deflation, k = 2 after one LOBPCG step, on blocks
            # of up to 12 (the 12-vector's factor, above 5k, is deflated; the others take
            # eq. 11 as it is), relative epsilon (lambda_max = theta_1) and Google's rules.
            "deflated_newton",
            _with(
                root_inverse=ss.CoupledNewtonConfig(
                    tolerance=1e-12, error_growth_limit=1.2, retries=2, failure_threshold=0.1,
                    deflation_rank=2, deflation_iterations=1,
                ),
                epsilon=ss.EpsilonConfig(value=1e-3, scale="relative", placement="ridge_floor"),
                blocking=ss.BlockingConfig(max_preconditioner_dim=12, merge_dims_up_to=None),
            ),
        ),
        Case(
            # Meta's CoupledHigherOrderConfig (eq. 11c): its own ridge, order 3.
            "higher_order_newton",
            _with(root_inverse=ss.HigherOrderNewtonConfig(abs_epsilon=1e-3, tolerance=1e-12)),
        ),
        Case(
            # A fractional root r = 5/2 (X computed for p = 5, then squared), order 4.
            "higher_order_newton_fractional_root",
            _with(
                root_inverse=ss.HigherOrderNewtonConfig(
                    order=4, rel_epsilon=1e-3, abs_epsilon=1e-6, tolerance=1e-12
                ),
                exponents=ss.ExponentConfig(override=2.5),
            ),
        ),
        Case(
            # Google's lambda_max estimate (eq. 9b), with a tolerance loose enough
            # that some factors stop after a few steps, far from the exact value.
            "relative_epsilon_power_iteration",
            _with(epsilon=ss.EpsilonConfig(
                value=1e-3, scale="relative", placement="ridge_floor",
                lambda_max="power_iteration", power_iteration_tolerance=1e-2,
            )),
        ),
        Case(
            # Meta's use_trace_scaling (eq. 7b): the roots see A / tr(A)^0.5.
            "trace_scaling",
            _with(statistics=ss.StatisticsConfig(trace_scaling_exponent=0.5)),
        ),
        Case(
            "exponent_overrides",
            _with(
                exponents=ss.ExponentConfig(
                    overrides_by_order=(ss.OrderOverride(order=2, roots=(2.0, 0.0)),)
                )
            ),
        ),
        Case("exponent_override_all", _with(exponents=ss.ExponentConfig(override=3.0))),
        Case(
            "preconditioned_dims_default",
            _with(exponents=ss.ExponentConfig(default="preconditioned_dims")),
        ),
        Case(
            "one_sided_last",
            _with(blocking=replace(_UNMERGED, preconditioned_dims="last")),
        ),
        Case(
            # Google's best_effort_shape_interpretation=False: (1, 5, 1) keeps two
            # 1 x 1 factors, each counting in the root 2 * 3 of its block; the
            # scalar is a block with no factor (P = F, then the graft rescale).
            "keep_size_one_dims",
            _with(
                blocking=replace(_UNMERGED, squeeze=False, scalar_factor=False),
                exponents=ss.ExponentConfig(default="preconditioned_dims"),
            ),
        ),
        Case(
            "merge_last_to_first",
            _with(blocking=ss.BlockingConfig(max_preconditioner_dim=16, merge_dims_up_to=16)),
        ),
        Case(
            "merge_first_to_last_skip_rules",
            _with(
                blocking=ss.BlockingConfig(
                    max_preconditioner_dim=16,
                    merge_dims_up_to=16,
                    merge_direction="first_to_last",
                    skip_dim_size_gt=9,
                    skip_rank_lt=1,
                )
            ),
        ),
        Case(
            "momentum_nesterov_dampening",
            _with(momentum=ss.MomentumConfig(momentum=0.9, dampening=0.1, nesterov=True)),
        ),
        Case(
            "separate_buffers_lr_before",
            _with(
                momentum=ss.MomentumConfig(
                    momentum=0.8,
                    nesterov=True,
                    buffers="separate",
                    learning_rate_placement="before_momentum",
                ),
                schedule=ss.ScheduleConfig(start_preconditioning_step=4),
            ),
        ),
        Case(
            "weight_decay_l2",
            _with(weight_decay=ss.WeightDecayConfig(value=0.05, type="l2")),
        ),
        Case(
            "weight_decay_direction_momentum",
            _with(
                weight_decay=ss.WeightDecayConfig(value=0.05, type="direction"),
                momentum=ss.MomentumConfig(momentum=0.5),
            ),
        ),
        Case(
            "weight_decay_update",
            _with(weight_decay=ss.WeightDecayConfig(value=0.05, type="update")),
        ),
        Case(
            "schedule_meta_style",
            _with(
                schedule=ss.ScheduleConfig(precondition_frequency=3, start_preconditioning_step=5)
            ),
        ),
        Case(
            "schedule_google_style",
            _with(
                schedule=ss.ScheduleConfig(
                    precondition_frequency=3,
                    statistics_frequency=2,
                    start_preconditioning_step=4,
                    period_anchor="start",
                    roots_before_start=True,
                )
            ),
        ),
        Case(
            # Google's shard_optimizer_states: a root step's roots precondition
            # only the steps after it (the step itself uses the previous ones).
            "schedule_roots_next_step",
            _with(
                schedule=ss.ScheduleConfig(
                    precondition_frequency=3,
                    period_anchor="start",
                    roots_before_start=True,
                    roots_take_effect="next_step",
                )
            ),
        ),
        Case(
            "never_start",
            _with(schedule=ss.ScheduleConfig(start_preconditioning_step=None)),
        ),
        Case(
            "eigenvalue_corrected",
            _with(
                eigenvalue_correction=ss.EigenvalueCorrectionConfig(beta2=0.95, epsilon=1e-8),
                # First eigenbasis once every <= 4-dim block factor has full rank.
                schedule=ss.ScheduleConfig(precondition_frequency=5),
            ),
            steps=12,
        ),
        Case(
            # Meta's QREigendecompositionConfig (eq. 17c): two QR steps from the stored
            # basis per root step, stopping early at tolerance 1e-3.
            "eigenvalue_corrected_qr",
            _with(
                eigenvalue_correction=ss.EigenvalueCorrectionConfig(
                    beta2=0.95, epsilon=1e-8, eigenbasis_method="qr", qr_max_iterations=2,
                    basis_reuse_tolerance=1e-3,
                ),
                schedule=ss.ScheduleConfig(precondition_frequency=2),
            ),
            steps=12,
        ),
        Case(
            # Meta's Eigendecomposed Shampoo with QREigendecompositionConfig (eq. 10f): the
            # inverse roots from two QR steps from the stored basis per root step, stopping
            # early at tolerance 1e-3; first root at step 6, once every <= 4-dim block
            # factor has full rank (a repeated eigenvalue's sorted order is rounding's).
            "eigh_qr_root",
            _with(
                root_inverse=ss.EighConfig(eigenbasis_method="qr", qr_max_iterations=2,
                                           qr_tolerance=1e-3),
                schedule=ss.ScheduleConfig(precondition_frequency=2,
                                           start_preconditioning_step=6),
            ),
            steps=12,
        ),
        Case(
            # Meta's Eigendecomposed Shampoo with EighEigendecompositionConfig.tolerance
            # (eq. 10h): each factor keeps its stored eigenbasis while B's off-diagonal
            # part is <= 0.4 of it (168 of 186 decisions here), else eigh replaces it.
            # Every ratio is >= 3% from 0.4, so float32 decides alike.
            "eigh_basis_reuse",
            _with(
                root_inverse=ss.EighConfig(basis_reuse_tolerance=0.4),
                schedule=ss.ScheduleConfig(precondition_frequency=2,
                                           start_preconditioning_step=4),
            ),
            steps=14,
        ),
        Case(
            # Eq. (10f) with Meta's perturb_before_computation=False (QR on A, epsilon
            # after) and the KL statistics of eq. (6b) preconditioned by the QR roots.
            "eigh_qr_root_shift_after_kl",
            _with(
                root_inverse=ss.EighConfig(eigenbasis_method="qr"),
                epsilon=ss.EpsilonConfig(value=1e-3, placement="shift_after"),
                statistics=ss.StatisticsConfig(beta2=0.95, bias_correction=True, kl=True),
                schedule=ss.ScheduleConfig(precondition_frequency=1,
                                           start_preconditioning_step=5),
            ),
            steps=12,
        ),
        Case(
            # Meta's per-order inverse_exponent_override: 1-d blocks root 4, 3-d blocks
            # root 1, every other order the default 2.
            "eigenvalue_corrected_roots_by_order",
            _with(
                eigenvalue_correction=ss.EigenvalueCorrectionConfig(
                    beta2=0.95, epsilon=1e-8, roots_by_order=((1, 4.0), (3, 1.0))
                ),
                schedule=ss.ScheduleConfig(precondition_frequency=5),
            ),
            steps=12,
        ),
        Case(
            # Eqs. (6c), (10d): the 4 x 4 factors sketched at rank 1 (the vectors' blocks
            # span one direction per step: X = I on step 1), reset every 4 steps.
            "frequent_directions",
            _with(frequent_directions=ss.FrequentDirectionsConfig(rank=1, reset_every=4),
                  statistics=ss.StatisticsConfig(beta2=0.9)),
        ),
        Case(
            # average_gradients: the statistics see the mean over each period of 2.
            "frequent_directions_averaged",
            _with(frequent_directions=ss.FrequentDirectionsConfig(rank=1,
                                                                  average_gradients=True),
                  epsilon=ss.EpsilonConfig(value=1e-3, scale="relative"),
                  schedule=ss.ScheduleConfig(precondition_frequency=2, statistics_frequency=2)),
        ),
        Case(
            # Eqs. (6c), (10e), tearfree's Sketchy: every factor sketched at
            # k = min(n, 2) (the 4 x 4 and 3 x 3 factors deflated, with a tail decayed by
            # sqrt(beta2); the 2 x 2 and smaller ones whole), epsilon relative.
            "frequent_directions_tearfree",
            _with(frequent_directions=ss.FrequentDirectionsConfig(rank=2, rule="tearfree"),
                  statistics=ss.StatisticsConfig(beta2=0.9),
                  epsilon=ss.EpsilonConfig(value=1e-3, scale="relative")),
        ),
        Case(
            # Absolute epsilon, a sum (beta2 = 1), sketches updated every 2 steps (the
            # odd steps reuse the last X, as tearfree's update_freq).
            "frequent_directions_tearfree_every_2",
            _with(frequent_directions=ss.FrequentDirectionsConfig(rank=3, rule="tearfree"),
                  statistics=ss.StatisticsConfig(beta2=1.0),
                  epsilon=ss.EpsilonConfig(value=1e-2),
                  schedule=ss.ScheduleConfig(precondition_frequency=2, statistics_frequency=2)),
        ),
        Case(
            "meta_preset",
            replace(ss.from_meta({"lr": 0.1, "epsilon": 1e-4}), factor_dtype="float64"),
        ),
        Case(
            "google_preset",
            ss.from_google({"learning_rate": 0.1, "block_size": 4, "graft_type": "ADAGRAD"}),
        ),
        Case(
            # best_effort_memory_usage_reduction on Google's pmap path: int8 momentum
            # (eq. 20b) and int16 factors and roots with float diagonals (eq. 20c).
            "google_preset_quantized",
            ss.from_google({"learning_rate": 0.1, "block_size": 4, "graft_type": "ADAGRAD",
                            "best_effort_memory_usage_reduction": True,
                            "batch_axis_name": "batch"}),
        ),
    ]
