"""Google's ``distributed_shampoo`` arguments: their names, the enum tables (by member
name and IntEnum value), and the learning-rate schedule the exporter writes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from ...config import (
    EpsilonConfig,
    ExponentConfig,
    FrequentDirectionsConfig,
    GraftingType,
    LowRankRootConfig,
    RootInverseConfig,
    StatisticsConfig,
)

#: The keyword arguments of ``distributed_shampoo`` (``precondtioner_type``: Google's spelling).
KEYS = {
    "learning_rate",
    "block_size",
    "beta1",
    "beta2",
    "diagonal_epsilon",
    "matrix_epsilon",
    "weight_decay",
    "start_preconditioning_step",
    "preconditioning_compute_steps",
    "statistics_compute_steps",
    "decay_preconditioning_compute_steps",
    "end_preconditioning_compute_steps",
    "best_effort_shape_interpretation",
    "graft_type",
    "nesterov",
    "exponent_override",
    "batch_axis_name",
    "statistics_partition_spec",
    "preconditioner_partition_spec",
    "num_devices_for_pjit",
    "shard_optimizer_states",
    "best_effort_memory_usage_reduction",
    "inverse_failure_threshold",
    "moving_average_for_momentum",
    "skip_preconditioning_dim_size_gt",
    "clip_by_scaled_gradient_norm",
    "precision",
    "tensordot_precision",
    "relative_matrix_epsilon",
    "merge_small_dims_block_size",
    "lobpcg_topk_precondition",
    "lobpcg_max_iter",
    "precondtioner_type",
    "preconditioner_type",
    "generate_fd_metrics",
    "compression_rank",
    "frequent_directions",
    "reset_preconditioner",
    "average_grad",
    "skip_preconditioning_rank_lt",
    "decoupled_learning_rate",
    "decoupled_weight_decay",
    "generate_training_metrics",
    "reuse_preconditioner",
    "eigh",
}

#: Keys whose non-default values we do not implement: key -> (default, what it does).
#: Empty at 239a8cd: every key of Google's ``distributed_shampoo`` imports.
UNSUPPORTED: dict[str, tuple[Any, str]] = {}

#: ``graft_type`` (GraftingType member names) -> ``grafting.type``.
GRAFTS: dict[str, GraftingType] = {
    "NONE": "none",
    "SGD": "sgd",
    "ADAGRAD": "adagrad",
    "RMSPROP": "rmsprop",
    "RMSPROP_NORMALIZED": "rmsprop_normalized",
    "SQRT_N": "sign",
    "ADAGRAD_NORMALIZED": "adagrad_normalized",
}

#: Google's ``GraftingType`` (an IntEnum): value -> member name.
GRAFT_VALUES = {
    0: "NONE", 1: "SGD", 2: "ADAGRAD", 3: "RMSPROP", 4: "RMSPROP_NORMALIZED", 5: "SQRT_N",
    6: "ADAGRAD_NORMALIZED",
}

PreconditionedDims = Literal["all", "all_but_last", "last"]

#: ``preconditioner_type`` (PreconditionerType member names) -> ``blocking.preconditioned_dims``.
SIDES: dict[str, PreconditionedDims] = {"ALL": "all", "INPUT": "all_but_last", "OUTPUT": "last"}

#: Google's ``PreconditionerType`` (an IntEnum): value -> member name.
SIDE_VALUES = {1: "ALL", 2: "INPUT", 3: "OUTPUT"}

#: ``precision`` / ``tensordot_precision``: ``jax.lax.Precision`` members (value -> name).
PRECISION_VALUES = {0: "DEFAULT", 1: "HIGH", 2: "HIGHEST"}
PRECISIONS = {name: name for name in PRECISION_VALUES.values()}


@dataclass(frozen=True)
class ConstantSchedule:
    """A learning rate schedule that is ``value`` at every step.

    What :func:`~shampoo_spec.to_google` writes as ``learning_rate`` when the
    config's root period follows the learning rate (eq. 8b): Google applies
    ``decay_preconditioning_compute_steps`` only when ``learning_rate`` is
    callable. With a constant schedule the ratio lr_t / lr_1 is 1, as it is
    in our backends run at ``config.learning_rate``.
    """

    value: float

    def __call__(self, count: Any) -> float:
        return self.value


class Preconditioner(NamedTuple):
    """The sections :func:`_preconditioner` returns."""

    statistics: StatisticsConfig
    epsilon: EpsilonConfig
    root_inverse: RootInverseConfig
    low_rank: LowRankRootConfig | None
    frequent_directions: FrequentDirectionsConfig | None
    exponents: ExponentConfig
