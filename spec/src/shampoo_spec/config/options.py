"""The values several sections share: their option tuples, dtype names and bounds.

Each ``Literal`` alias names the options a field's type allows; the tuple
beside it is the same options in the order error messages list them.
"""

from __future__ import annotations

from typing import Literal

#: Upper bound of ``CoupledNewtonConfig.max_iterations`` (and of the other iteration counts).
MAX_NEWTON_ITERATIONS = 10_000
#: The largest order of eq. (11c): each step costs about order matrix products.
MAX_HIGHER_ORDER = 16
#: Upper bound of ``SpectralDescentConfig.num_iterations``.
MAX_NEWTON_SCHULZ_ITERATIONS = 1000
#: The largest ``IterateAveragingConfig.eval_lr_power``.
MAX_EVAL_LR_POWER = 16

GraftingType = Literal[
    "none",
    "sgd",
    "adagrad",
    "rmsprop",
    "adam",
    "sign",
    "adagrad_normalized",
    "rmsprop_normalized",
    "adafactor",
]
GRAFTING_TYPES: tuple[str, ...] = (
    "none",
    "sgd",
    "adagrad",
    "rmsprop",
    "adam",
    "sign",
    "adagrad_normalized",
    "rmsprop_normalized",
    "adafactor",
)

#: Grafting types that keep a second-moment state V (eq. 14b).
GRAFTING_TYPES_WITH_STATE: tuple[str, ...] = (
    "adagrad",
    "rmsprop",
    "adam",
    "adagrad_normalized",
    "rmsprop_normalized",
)

#: The elementwise methods a diagonal preconditioner may be (eq. 16b).
DiagonalType = Literal["sgd", "adagrad", "rmsprop", "adam", "sign"]
DIAGONAL_TYPES: tuple[str, ...] = ("sgd", "adagrad", "rmsprop", "adam", "sign")

#: The dtypes inverse roots may be stored in (``ShampooConfig.inverse_root_dtype``, eqs. 11a, 16).
InverseRootDtype = Literal["float64", "float32", "bfloat16", "float16"]
INVERSE_ROOT_DTYPES: tuple[str, ...] = ("float64", "float32", "bfloat16", "float16")

#: How momentum buffers are stored (``MomentumConfig.storage``, eq. 20b).
MomentumStorage = Literal["float", "int8_columnwise"]
MOMENTUM_STORAGES: tuple[str, ...] = ("float", "int8_columnwise")

#: How factors and their inverse roots are stored (``StatisticsConfig.storage``, eq. 20c).
FactorStorage = Literal["float", "int16_columnwise_diagonal"]
FACTOR_STORAGES: tuple[str, ...] = ("float", "int16_columnwise_diagonal")

#: The smallest positive number of a storage dtype (its smallest subnormal) where it is
#: above the least epsilon every section allows (2^-126): float16 only.
SMALLEST_POSITIVE: dict[str, tuple[float, str]] = {"float16": (2.0**-24, "2^-24")}

#: The dtypes a step's update may be rounded to (``ShampooConfig.update_dtype``, eq. 21a).
UpdateDtype = Literal["float32", "bfloat16", "float16"]
UPDATE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")

#: The dtypes the factors may be stored in below ``factor_dtype``
#: (``ShampooConfig.factor_storage_dtype``, eq. 11b; Meta's ``factor_matrix_dtype``).
FactorStorageDtype = Literal["bfloat16", "float16"]
FACTOR_STORAGE_DTYPES: tuple[str, ...] = ("bfloat16", "float16")

#: The dtypes scales and diagonals of the quantized storages are kept in (eqs. 20b, 20c).
SCALE_DTYPES: tuple[str, ...] = ("float32", "float64")

#: ``ema_weight``: the weight of the new term of an EMA (eqs. 6, 14b, 17).
EMA_WEIGHTS: tuple[str, ...] = ("one_minus_beta2", "one")

#: ``EpsilonConfig.placement``: the epsilon rules of eq. (10).
EPSILON_PLACEMENTS = ("ridge", "shift_after", "floor", "ridge_floor", "pseudo_inverse")

#: ``FrequentDirectionsConfig.rule``: Google's eq. (10d) or tearfree's Sketchy, eq. (10e).
FREQUENT_DIRECTIONS_RULES = ("google", "tearfree")
#: ``FrequentDirectionsConfig.packing``: how the sketch's values are stored (eq. 10d).
FREQUENT_DIRECTIONS_PACKINGS = ("own", "google")

#: The spacing at 1 of each factor dtype (the rank cutoffs of eqs. 10 and 10d).
MACHINE_EPSILON = {"float32": 2.0**-23, "float64": 2.0**-52}
