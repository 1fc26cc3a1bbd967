"""shampoo_spec: the one specification of Shampoo every backend implements.

- :class:`ShampooConfig` and its sections (validated, frozen, JSON round trip);
- :func:`plan_parameter`: squeeze, merge, block, roots (eqs. 4-5, 12);
- :mod:`schedule`: which work happens at step t (eq. 8);
- :func:`assign_blocks`, :func:`plan_block_costs`: which rank owns which block
  (distributed backends);
- :func:`from_meta`, :func:`from_google`: import the anchors' arguments;
  :func:`to_meta`, :func:`to_google`, :func:`to_tearfree`: export a config to them;
- :data:`PRESETS`: named configurations;
- :mod:`errors`: every exception of the project (re-exported by backends);
- :mod:`limits`: the overflow rule of eq. (3) and the large-block warning.

Equation numbers refer to docs/spec.md. Standard library only.
"""

from ._validate import MAX_INTEGER
from .assignment import (
    ROOT_FLOPS_PER_CUBE,
    Assignment,
    BlockCost,
    assign_blocks,
    block_cost,
    plan_block_costs,
)
from .config import (
    EPSILON_PLACEMENTS,
    FACTOR_STORAGE_DTYPES,
    FACTOR_STORAGES,
    FREQUENT_DIRECTIONS_RULES,
    GRAFTING_TYPES,
    GRAFTING_TYPES_WITH_STATE,
    INVERSE_ROOT_DTYPES,
    MOMENTUM_STORAGES,
    UPDATE_DTYPES,
    BlockingConfig,
    CoupledNewtonConfig,
    DiagonalPreconditionerConfig,
    EigenvalueCorrectionConfig,
    EighConfig,
    EpsilonConfig,
    ExponentConfig,
    FactorStorage,
    FactorStorageDtype,
    FailureConfig,
    FrequentDirectionsConfig,
    GradientFilterConfig,
    GraftingConfig,
    HigherOrderNewtonConfig,
    InverseRootDtype,
    IterateAveragingConfig,
    LowRankRootConfig,
    MomentumConfig,
    MomentumStorage,
    OrderOverride,
    RootInverseConfig,
    ScheduleConfig,
    ShampooConfig,
    SpectralDescentConfig,
    StatisticsConfig,
    UpdateDtype,
    WeightDecayConfig,
    config_differences,
    config_from_dict,
    config_to_dict,
)
from .errors import (
    BackendUnavailable,
    Inexpressible,
    NonFiniteGradientError,
    RootFailureError,
    StepperUnavailable,
)
from .exporters import to_google, to_meta, to_tearfree
from .importers import MetaDistribution, from_google, from_meta, from_tearfree, meta_distribution
from .limits import (
    FLOAT16_FACTOR_LIMIT,
    LARGE_BLOCK_DIM,
    STATE_LIMIT,
    block_overflows,
    factor_limit,
    large_block_warnings,
)
from .plan import BlockPlan, ParameterPlan, merge_dims, plan_parameter, squeeze_shape
from .power_iteration import power_iteration_start
from .schedule import (
    is_root_step,
    is_statistics_step,
    learning_rate_ratio,
    root_period,
    uses_preconditioner,
)

__all__ = [
    "EPSILON_PLACEMENTS",
    "FREQUENT_DIRECTIONS_RULES",
    "GRAFTING_TYPES",
    "GRAFTING_TYPES_WITH_STATE",
    "FACTOR_STORAGE_DTYPES",
    "INVERSE_ROOT_DTYPES",
    "MOMENTUM_STORAGES",
    "FACTOR_STORAGES",
    "UPDATE_DTYPES",
    "LARGE_BLOCK_DIM",
    "MAX_INTEGER",
    "ROOT_FLOPS_PER_CUBE",
    "STATE_LIMIT",
    "FLOAT16_FACTOR_LIMIT",
    "Assignment",
    "BackendUnavailable",
    "BlockCost",
    "BlockPlan",
    "BlockingConfig",
    "CoupledNewtonConfig",
    "DiagonalPreconditionerConfig",
    "EigenvalueCorrectionConfig",
    "EighConfig",
    "EpsilonConfig",
    "ExponentConfig",
    "FailureConfig",
    "GradientFilterConfig",
    "GraftingConfig",
    "HigherOrderNewtonConfig",
    "IterateAveragingConfig",
    "FrequentDirectionsConfig",
    "LowRankRootConfig",
    "FactorStorageDtype",
    "Inexpressible",
    "InverseRootDtype",
    "MomentumStorage",
    "FactorStorage",
    "MomentumConfig",
    "NonFiniteGradientError",
    "OrderOverride",
    "ParameterPlan",
    "RootFailureError",
    "RootInverseConfig",
    "ScheduleConfig",
    "ShampooConfig",
    "SpectralDescentConfig",
    "StatisticsConfig",
    "MetaDistribution",
    "StepperUnavailable",
    "UpdateDtype",
    "WeightDecayConfig",
    "assign_blocks",
    "block_cost",
    "block_overflows",
    "factor_limit",
    "power_iteration_start",
    "config_differences",
    "config_from_dict",
    "config_to_dict",
    "from_google",
    "from_meta",
    "from_tearfree",
    "is_root_step",
    "is_statistics_step",
    "large_block_warnings",
    "learning_rate_ratio",
    "merge_dims",
    "meta_distribution",
    "plan_block_costs",
    "plan_parameter",
    "root_period",
    "squeeze_shape",
    "to_google",
    "to_meta",
    "to_tearfree",
    "uses_preconditioner",
]
