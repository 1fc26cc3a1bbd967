"""Meta's ``DistributedShampoo`` arguments: their names, enum tables and the values
that several of the importer's sections share."""

from __future__ import annotations

from typing import Literal, NamedTuple

from ...config import (
    DiagonalPreconditionerConfig,
    EigenvalueCorrectionConfig,
    EpsilonConfig,
    ExponentConfig,
    FactorStorageDtype,
    FailureConfig,
    InverseRootDtype,
    RootInverseConfig,
    SpectralDescentConfig,
    StatisticsConfig,
)

#: The keyword arguments of ``DistributedShampoo`` (besides ``params``).
KEYS = {
    "lr",
    "betas",
    "beta3",
    "epsilon",
    "momentum",
    "dampening",
    "use_nesterov",
    "weight_decay",
    "weight_decay_type",
    "use_decoupled_weight_decay",
    "max_preconditioner_dim",
    "precondition_frequency",
    "start_preconditioning_step",
    "use_bias_correction",
    "iterate_averaging_config",
    "grafting_config",
    "use_pin_memory",
    "shampoo_pt2_compile_config",
    "distributed_config",
    "preconditioner_config",
    "shampoo_runtime_config",
    "use_merge_dims",
    "concurrency_config",
}

#: The keys of ``preconditioner_config`` (any of Meta's Shampoo preconditioner configs).
PRECONDITIONER_KEYS = {
    "amortized_computation_config",
    "num_tolerated_failed_amortized_computations",
    "factor_matrix_dtype",
    "inv_factor_matrix_dtype",
    "corrected_eigenvalues_dtype",
    "factor_matrix_eigenvectors_dtype",
    "factor_matrix_eigenvalues_dtype",
    "inverse_exponent_override",
    "ignored_basis_change_dims",
    "use_symmetric_packing",
    "use_trace_scaling",
    "trace_scaling_exponent",
    "drop_weighting_factor_on_gsquare",
}

#: The keys of ``preconditioner_config.amortized_computation_config``.
AMORTIZED_KEYS = {
    "max_iterations",
    "tolerance",
    "rel_epsilon",
    "abs_epsilon",
    "order",
    "disable_tf32",
    "rank_deficient_stability_config",
    "retry_double_precision",
    "exponent_multiplier",
    "enhance_stability",
    "eigendecomposition_offload_device",
}

#: KL-Shampoo's classes (eq. 6b) and the class whose preconditioner each uses.
KL_CLASSES = {
    "RootInvKLShampooPreconditionerConfig": "RootInvShampooPreconditionerConfig",
    "EigendecomposedKLShampooPreconditionerConfig": "EigendecomposedShampooPreconditionerConfig",
}

#: Preconditioner config classes that are a diagonal preconditioner (eq. 16b).
DIAGONAL_PRECONDITIONERS = {
    "SGDPreconditionerConfig",
    "AdaGradPreconditionerConfig",
    "RMSpropPreconditionerConfig",
    "AdamPreconditionerConfig",
    "SignDescentPreconditionerConfig",
}

Placement = Literal["ridge", "shift_after", "pseudo_inverse"]
FactorDtype = Literal["float32", "float64"]
FACTOR_DTYPES: dict[str, FactorDtype] = {"float32": "float32", "float64": "float64"}

#: ``factor_matrix_dtype`` values stored below the working precision
#: (``factor_storage_dtype``, eq. 11b); the working precision is then float64.
FACTOR_STORAGE_DTYPES: dict[str, FactorStorageDtype] = {
    "bfloat16": "bfloat16", "float16": "float16",
}

#: ``weight_decay_type`` (WeightDecayType member names; each value is its name).
WEIGHT_DECAY_TYPES = {name: name for name in ("L2", "DECOUPLED", "CORRECTED", "INDEPENDENT")}

#: How Meta's dtypes are spelled in JSON: ``"float32"`` or ``str(torch.float32)``.
TORCH = ("torch.",)


class Shared(NamedTuple):
    """The top-level values that more than one section reads."""

    lr: float
    beta1: float
    beta2: float
    beta3: float | None
    epsilon: float
    bias_correction: bool


class Preconditioner(NamedTuple):
    """The sections :func:`_preconditioner` returns."""

    statistics: StatisticsConfig
    epsilon: EpsilonConfig
    root_inverse: RootInverseConfig
    exponents: ExponentConfig
    eigenvalue_correction: EigenvalueCorrectionConfig | None
    diagonal: DiagonalPreconditionerConfig | None
    spectral: SpectralDescentConfig | None
    factor_dtype: FactorDtype
    inverse_root_dtype: InverseRootDtype | None
    factor_storage_dtype: FactorStorageDtype | None
    failure: FailureConfig
