"""The one configuration of Shampoo shared by every backend.

Every option of the two anchors (Meta's PyTorch ``DistributedShampoo`` and
Google's JAX ``distributed_shampoo``) is a named field here, never a hidden
quirk. Each section documents the equation of docs/spec.md it governs. All
configs are frozen, keyword-only dataclasses validated in ``__post_init__``:
a bad value raises ``ValueError`` naming the field, the value and what is
allowed.

Layout: one module per group of sections (:mod:`.statistics`: statistics and
epsilon; :mod:`.roots`: the root methods and exponents; :mod:`.sketches`: low
rank and frequent directions; :mod:`.grafting`; :mod:`.preconditioners`:
eigenvalue correction, diagonal, spectral; :mod:`.update`: filter, momentum,
averaging, weight decay; :mod:`.execution`: blocking, schedule, failure),
:mod:`.shampoo` (the whole config), :mod:`.allowed` (what each field allows,
declared in its metadata), :mod:`.rules` (the cross-section rules),
:mod:`.options` (shared option tuples and bounds) and :mod:`.serialization`
(the JSON round trip).
"""

from .allowed import check_fields
from .execution import BlockingConfig, FailureConfig, ScheduleConfig
from .grafting import GraftingConfig
from .options import (
    DIAGONAL_TYPES,
    EPSILON_PLACEMENTS,
    FACTOR_STORAGE_DTYPES,
    FACTOR_STORAGES,
    FREQUENT_DIRECTIONS_PACKINGS,
    FREQUENT_DIRECTIONS_RULES,
    GRAFTING_TYPES,
    GRAFTING_TYPES_WITH_STATE,
    INVERSE_ROOT_DTYPES,
    MACHINE_EPSILON,
    MAX_EVAL_LR_POWER,
    MAX_HIGHER_ORDER,
    MAX_NEWTON_ITERATIONS,
    MAX_NEWTON_SCHULZ_ITERATIONS,
    MOMENTUM_STORAGES,
    UPDATE_DTYPES,
    DiagonalType,
    FactorStorage,
    FactorStorageDtype,
    GraftingType,
    InverseRootDtype,
    MomentumStorage,
    UpdateDtype,
)
from .preconditioners import (
    MUON_COEFFICIENTS,
    DiagonalPreconditionerConfig,
    EigenvalueCorrectionConfig,
    SpectralDescentConfig,
)
from .roots import (
    CoupledNewtonConfig,
    EighConfig,
    ExponentConfig,
    HigherOrderNewtonConfig,
    OrderOverride,
    RootInverseConfig,
)
from .serialization import config_differences, config_to_dict, flatten
from .shampoo import ShampooConfig, config_from_dict
from .sketches import FrequentDirectionsConfig, LowRankRootConfig
from .statistics import EpsilonConfig, StatisticsConfig
from .update import GradientFilterConfig, IterateAveragingConfig, MomentumConfig, WeightDecayConfig

__all__ = [
    "DIAGONAL_TYPES",
    "EPSILON_PLACEMENTS",
    "FACTOR_STORAGES",
    "FACTOR_STORAGE_DTYPES",
    "FREQUENT_DIRECTIONS_PACKINGS",
    "FREQUENT_DIRECTIONS_RULES",
    "GRAFTING_TYPES",
    "GRAFTING_TYPES_WITH_STATE",
    "INVERSE_ROOT_DTYPES",
    "MACHINE_EPSILON",
    "MAX_EVAL_LR_POWER",
    "MAX_HIGHER_ORDER",
    "MAX_NEWTON_ITERATIONS",
    "MAX_NEWTON_SCHULZ_ITERATIONS",
    "MOMENTUM_STORAGES",
    "MUON_COEFFICIENTS",
    "UPDATE_DTYPES",
    "BlockingConfig",
    "CoupledNewtonConfig",
    "DiagonalPreconditionerConfig",
    "DiagonalType",
    "EigenvalueCorrectionConfig",
    "EighConfig",
    "EpsilonConfig",
    "ExponentConfig",
    "FactorStorage",
    "FactorStorageDtype",
    "FailureConfig",
    "FrequentDirectionsConfig",
    "GradientFilterConfig",
    "GraftingConfig",
    "GraftingType",
    "HigherOrderNewtonConfig",
    "InverseRootDtype",
    "IterateAveragingConfig",
    "LowRankRootConfig",
    "MomentumConfig",
    "MomentumStorage",
    "OrderOverride",
    "RootInverseConfig",
    "ScheduleConfig",
    "ShampooConfig",
    "SpectralDescentConfig",
    "StatisticsConfig",
    "UpdateDtype",
    "WeightDecayConfig",
    "check_fields",
    "config_differences",
    "config_from_dict",
    "config_to_dict",
    "flatten",
]
