"""shampoo_spec: the one specification of Shampoo every backend implements.

- :class:`ShampooConfig` and its sections (validated, frozen, JSON round trip);
- :func:`plan_parameter`: squeeze, merge, block, roots (eqs. 4-5, 12);
- :mod:`schedule`: which work happens at step t (eq. 8);
- :func:`from_meta`, :func:`from_google`: import the anchors' arguments;
- :data:`PRESETS`: named configurations.

Equation numbers refer to docs/spec.md. Standard library only.
"""

from .config import (
    GRAFTING_TYPES,
    BlockingConfig,
    CoupledNewtonConfig,
    EigenvalueCorrectionConfig,
    EighConfig,
    EpsilonConfig,
    ExponentConfig,
    FailureConfig,
    GradientFilterConfig,
    GraftingConfig,
    MomentumConfig,
    OrderOverride,
    RootInverseConfig,
    ScheduleConfig,
    ShampooConfig,
    StatisticsConfig,
    WeightDecayConfig,
)
from .importers import from_google, from_meta
from .plan import BlockPlan, ParameterPlan, merge_dims, plan_parameter, squeeze_shape
from .schedule import is_root_step, is_statistics_step, uses_preconditioner
from .serialization import config_from_dict, config_to_dict

__all__ = [
    "GRAFTING_TYPES",
    "BlockPlan",
    "BlockingConfig",
    "CoupledNewtonConfig",
    "EigenvalueCorrectionConfig",
    "EighConfig",
    "EpsilonConfig",
    "ExponentConfig",
    "FailureConfig",
    "GradientFilterConfig",
    "GraftingConfig",
    "MomentumConfig",
    "OrderOverride",
    "ParameterPlan",
    "RootInverseConfig",
    "ScheduleConfig",
    "ShampooConfig",
    "StatisticsConfig",
    "WeightDecayConfig",
    "config_from_dict",
    "config_to_dict",
    "from_google",
    "from_meta",
    "is_root_step",
    "is_statistics_step",
    "merge_dims",
    "plan_parameter",
    "squeeze_shape",
    "uses_preconditioner",
]
