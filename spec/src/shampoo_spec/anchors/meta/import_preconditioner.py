"""Meta's ``preconditioner_config`` and ``grafting_config`` as sections: the statistics,
epsilon, root, exponents and dtypes of the Kronecker preconditioners (eqs. 6-17), the
diagonal (eq. 16b) and spectral (eq. 16c) ones, and the graft (eq. 14)."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

from ...config import (
    MUON_COEFFICIENTS,
    DiagonalPreconditionerConfig,
    DiagonalType,
    EighConfig,
    EpsilonConfig,
    FailureConfig,
    GraftingConfig,
    SpectralDescentConfig,
    StatisticsConfig,
)
from .._parse import (
    Args,
    dtype,
    number,
    type_of,
)
from .import_exponents import _eigenvalue_correction, _exponents
from .import_roots import (
    _eigendecomposition,
    _eigendecomposition_dtypes,
    _root_inverse,
    _storage_dtype,
)
from .keys import (
    DIAGONAL_PRECONDITIONERS,
    FACTOR_DTYPES,
    FACTOR_STORAGE_DTYPES,
    KL_CLASSES,
    PRECONDITIONER_KEYS,
    TORCH,
    Preconditioner,
    Shared,
)


def _preconditioner(a: Args, shared: Shared) -> Preconditioner:
    """Reads ``preconditioner_config`` (its type and every key in it).

    Returns ``statistics`` (eqs. 6-7: beta2 = betas[1], zero start),
    ``epsilon`` (eq. 9, absolute; placement from the root method, eq. 10),
    ``root_inverse`` (eqs. 10-11, :func:`_root_inverse`), ``exponents``
    (eq. 12, :func:`_exponents`), ``eigenvalue_correction`` (eq. 17, for
    ``EigenvalueCorrectedShampooPreconditionerConfig``), ``factor_dtype``,
    ``inverse_root_dtype`` (eqs. 11a, 16, :func:`_storage_dtype`),
    ``factor_storage_dtype`` (eq. 11b: a bfloat16 or float16
    ``factor_matrix_dtype``, with ``factor_dtype`` float64, the precision of
    Meta's eigendecomposition, which retries in float64) and
    ``failure`` (eq. 13, ``num_tolerated_failed_amortized_computations``).
    """
    pc = a.get("preconditioner_config", None)
    kind = type_of("preconditioner_config", pc) or "RootInvShampooPreconditionerConfig"
    # KL-Shampoo (eq. 6b): RootInv's or Eigendecomposed's preconditioner, its factors
    # from the gradient preconditioned on the other dims.
    kl = kind in KL_CLASSES
    kind = KL_CLASSES.get(kind, kind)
    diagonal = spectral = None
    if kind in DIAGONAL_PRECONDITIONERS or kind == "SpectralDescentPreconditionerConfig":
        # Eqs. (16b), (16c): no Kronecker factors; the shared values (betas[1],
        # epsilon, use_bias_correction) are read as for the default RootInv config,
        # where they have no effect, so the export writes them back unchanged.
        if kind == "SpectralDescentPreconditionerConfig":
            spectral = _spectral(pc)
        else:
            diagonal = _diagonal(kind, pc)
        pc, kind = None, "RootInvShampooPreconditionerConfig"
    p = Args("preconditioner_config", pc or {}, PRECONDITIONER_KEYS)
    trace_scaling = p.flag("use_trace_scaling", False)
    tau = p.number("trace_scaling_exponent", 0.5)
    if trace_scaling and not 0.0 < tau <= 1.0:
        raise ValueError(
            f"preconditioner_config.trace_scaling_exponent = {tau!r} is invalid: allowed a "
            "number in (0, 1] with use_trace_scaling = True."
        )
    drop_weight = p.flag("drop_weighting_factor_on_gsquare", False)
    amortized = p.get("amortized_computation_config", None)
    eigendecomposed = kind == "EigendecomposedShampooPreconditionerConfig"
    if eigendecomposed:
        amortized = _eigendecomposition(amortized)
        stab = amortized.get("rank_deficient_stability_config") or {}
        if kl and stab.get("perturb_before_computation", True) is False:
            raise NotImplementedError(
                "preconditioner_config.amortized_computation_config."
                "rank_deficient_stability_config.perturb_before_computation = False with "
                "EigendecomposedKLShampooPreconditionerConfig is not supported yet (before "
                "the first root step Meta's stored eigenvalues are 1, whose root with epsilon "
                "after is (1 + epsilon)^(-1/r) I, not the identity eq. (6b) preconditions "
                "the statistics with)."
            )
    root_inverse, rule, basis = _root_inverse(
        amortized, corrected=kind == "EigenvalueCorrectedShampooPreconditionerConfig",
        eigendecomposed=eigendecomposed,
    )
    placement = rule["placement"]
    if (placement == "pseudo_inverse") != (shared.epsilon == 0):
        raise ValueError(
            f"epsilon = {shared.epsilon!r} is invalid: allowed "
            + ("0.0 with rank_deficient_stability_config PseudoInverseConfig (Meta's rule)."
               if placement == "pseudo_inverse" else
               "a number > 0 (0 only with PseudoInverseConfig).")
        )
    correction = None
    if kind == "RootInvShampooPreconditionerConfig" or eigendecomposed:
        p.unsupported("ignored_basis_change_dims", {}, "only for eigenvalue-corrected Shampoo")
        exponents = _exponents(p.get("inverse_exponent_override", {}))
    elif kind == "EigenvalueCorrectedShampooPreconditionerConfig":
        correction = dataclasses.replace(
            _eigenvalue_correction(p, shared, root_inverse, placement, drop_weight),
            **basis,
        )
        exponents = _exponents({}, p.get("ignored_basis_change_dims", {}))
    else:
        known = sorted({"RootInvShampooPreconditionerConfig",
                        "EigendecomposedShampooPreconditionerConfig",
                        "EigenvalueCorrectedShampooPreconditionerConfig",
                        "SpectralDescentPreconditionerConfig",
                        *KL_CLASSES, *DIAGONAL_PRECONDITIONERS})
        raise NotImplementedError(f"preconditioner_config.type = {kind!r} is not supported "
                                  f"(Meta's classes at f606606: {', '.join(known)}).")
    factor_dtype = dtype(
        "preconditioner_config.factor_matrix_dtype", p.get("factor_matrix_dtype", "float32"), TORCH
    )
    storage = FACTOR_STORAGE_DTYPES.get(factor_dtype)
    if storage is not None:
        # Eq. (11b): factors stored in s, the rest in float64 (Meta's eigh retry).
        if correction is not None or eigendecomposed:
            raise NotImplementedError(
                f"preconditioner_config.factor_matrix_dtype = {factor_dtype!r} with "
                f"{kind} is not supported yet (factors in bfloat16 or float16 are "
                "specified for RootInvShampooPreconditionerConfig, eq. 11b)."
            )
        # Eq. (11b) takes the root's upper triangle, as Meta's packed storage does.
        packed = p.flag("use_symmetric_packing", True)
        unsupported = (
            "use_trace_scaling" if trace_scaling
            else "use_symmetric_packing" if not packed
            else "amortized_computation_config" if not isinstance(root_inverse, EighConfig)
            or placement == "pseudo_inverse" else None
        )
        if unsupported is not None:
            raise NotImplementedError(
                f"preconditioner_config.factor_matrix_dtype = {factor_dtype!r} with "
                f"preconditioner_config.{unsupported} = {p.data[unsupported]!r} is not supported "
                "yet (factors in bfloat16 or float16 with EigenConfig's perturbation roots, "
                "no trace scaling and symmetric packing, eq. 11b)."
            )
        factor_dtype = "float64"
    elif factor_dtype not in FACTOR_DTYPES:
        raise NotImplementedError(
            f"preconditioner_config.factor_matrix_dtype = {factor_dtype!r} is not supported yet "
            "(factors in float64, float32, bfloat16 or float16)."
        )
    inverse_root_dtype = _storage_dtype(p, kind, "inv_factor_matrix_dtype", factor_dtype)
    if kl and inverse_root_dtype is not None:
        raise NotImplementedError(
            f"preconditioner_config.inv_factor_matrix_dtype = "
            f"{p.data.get('inv_factor_matrix_dtype', 'float32')!r} with factor_matrix_dtype "
            f"{factor_dtype!r} and KL-Shampoo is not supported yet (eq. 6b is specified with "
            "the roots in the factor dtype: set inv_factor_matrix_dtype to factor_matrix_dtype)."
        )
    if correction is not None:
        correction = dataclasses.replace(
            correction,
            eigenvectors_dtype=_storage_dtype(p, kind, "factor_matrix_eigenvectors_dtype",
                                              factor_dtype),
            corrected_eigenvalues_dtype=_storage_dtype(p, kind, "corrected_eigenvalues_dtype",
                                                       factor_dtype),
        )
    elif eigendecomposed:
        _storage_dtype(p, kind, "corrected_eigenvalues_dtype", factor_dtype)
        _eigendecomposition_dtypes(p, factor_dtype)
    else:
        for key in ("factor_matrix_eigenvectors_dtype", "corrected_eigenvalues_dtype"):
            _storage_dtype(p, kind, key, factor_dtype)
    if "factor_matrix_eigenvalues_dtype" in p and not eigendecomposed:
        raise ValueError(
            f"preconditioner_config.factor_matrix_eigenvalues_dtype = "
            f"{p.data['factor_matrix_eigenvalues_dtype']!r} is invalid: allowed only with "
            f"EigendecomposedShampooPreconditionerConfig ({kind} has no such field)."
        )
    tolerated = p.integer("num_tolerated_failed_amortized_computations", 3, low=0)
    return Preconditioner(
        statistics=StatisticsConfig(
            beta2=shared.beta2, initial_value="zero",
            # drop_weighting_factor_on_gsquare: L <- beta2 L + G G^T (eq. 6's weight 1),
            # and Meta then leaves the factors' bias correction at 1 (not an EMA).
            bias_correction=shared.bias_correction and not drop_weight,
            ema_weight="one" if drop_weight else "one_minus_beta2",
            trace_scaling_exponent=tau if trace_scaling else 0.0,  # eq. (7b)
            kl=kl,  # eq. (6b)
        ),
        epsilon=EpsilonConfig(value=shared.epsilon, scale="absolute", **rule),
        root_inverse=root_inverse,
        exponents=exponents,
        eigenvalue_correction=correction,
        diagonal=diagonal,
        spectral=spectral,
        factor_dtype=FACTOR_DTYPES[factor_dtype],
        inverse_root_dtype=inverse_root_dtype,
        factor_storage_dtype=storage,
        failure=FailureConfig(nonfinite_gradient="raise", max_consecutive_root_failures=tolerated),
    )


def _diagonal(kind: str, cfg: Any) -> DiagonalPreconditionerConfig:
    """Reads a diagonal ``preconditioner_config`` (eq. 16b).

    SGD, AdaGrad, RMSprop and Adam read as the graft of that class
    (:func:`_grafting`: the same class, keys, defaults and rules);
    ``SignDescentPreconditionerConfig`` with its default ``scale_fn``
    (1: the direction is sign(F~)). A ``scale_fn`` is a Python function, not
    JSON: any value of it is refused.
    """
    if kind == "SignDescentPreconditionerConfig":
        args = Args("preconditioner_config", cfg, {"scale_fn"})
        if "scale_fn" in args:
            raise NotImplementedError(
                f"preconditioner_config.scale_fn = {args.data['scale_fn']!r} is not supported "
                "(a function; only SignDescentPreconditionerConfig's default scale 1 is, "
                "eq. 16b)."
            )
        return DiagonalPreconditionerConfig(type="sign")
    g = _grafting(cfg, "preconditioner_config")
    return DiagonalPreconditionerConfig(
        type=cast(DiagonalType, g.type), beta2=g.beta2, ema_weight=g.ema_weight,
        epsilon=g.epsilon, bias_correction=g.bias_correction,
    )


#: The keys of each of Meta's orthogonalization configs (eq. 16c).
_ORTHOGONALIZATION_KEYS = {
    "NewtonSchulzOrthogonalizationConfig": {"num_iterations", "coefficients",
                                            "scale_by_dims_fn"},
    "SVDOrthogonalizationConfig": {"scale_by_nuclear_norm", "scale_by_dims_fn"},
}


def _spectral(cfg: Any) -> SpectralDescentConfig:
    """Reads ``SpectralDescentPreconditionerConfig`` (eq. 16c).

    Its ``orthogonalization_config``: ``NewtonSchulzOrthogonalizationConfig``
    (the default: 5 iterations, Muon's coefficients) or
    ``SVDOrthogonalizationConfig`` (``scale_by_nuclear_norm``). A
    ``scale_by_dims_fn`` is a Python function, not JSON: any value of it is
    refused (the default scale is 1).
    """
    args = Args("preconditioner_config", cfg, {"orthogonalization_config"})
    owner = "preconditioner_config.orthogonalization_config"
    oc = args.get("orthogonalization_config", None)
    kind = type_of(owner, oc) or "NewtonSchulzOrthogonalizationConfig"
    if kind not in _ORTHOGONALIZATION_KEYS:
        raise NotImplementedError(f"{owner}.type = {kind!r} is not supported yet "
                                  f"(allowed {sorted(_ORTHOGONALIZATION_KEYS)}).")
    o = Args(owner, oc or {}, _ORTHOGONALIZATION_KEYS[kind])
    if "scale_by_dims_fn" in o:
        raise NotImplementedError(
            f"{owner}.scale_by_dims_fn = {o.data['scale_by_dims_fn']!r} is not supported (a "
            "function; only the default scale 1 is, eq. 16c)."
        )
    if kind == "SVDOrthogonalizationConfig":
        return SpectralDescentConfig(
            method="svd", scale_by_nuclear_norm=o.flag("scale_by_nuclear_norm", False))
    coefficients = o.get("coefficients", list(MUON_COEFFICIENTS))
    if not isinstance(coefficients, (list, tuple)) or len(coefficients) != 3:
        raise ValueError(f"{owner}.coefficients = {coefficients!r} is invalid: allowed three "
                         "numbers [a, b, c].")
    a, b, c = (number(f"{owner}.coefficients[{i}]", x) for i, x in enumerate(coefficients))
    return SpectralDescentConfig(
        method="newton_schulz", num_iterations=o.integer("num_iterations", 5, low=0),
        coefficients=(a, b, c))


def _grafting(cfg: Any, owner: str = "grafting_config") -> GraftingConfig:
    """Reads ``grafting_config`` (null or a Meta preconditioner config).

    Returns ``grafting`` (eqs. 14, 18; per-block norms with 1e-16): SGD;
    AdaGrad (eps 1e-10); RMSprop (beta2 0.99, eps 1e-10); Adam (beta2 0.999,
    eps 1e-10, bias-corrected); null -> none. RMSprop's and Adam's
    ``drop_weighting_factor_on_gsquare``: ``V <- beta2 V + G^2`` (eq. 14b's
    ``grafting.ema_weight="one"``), never bias-corrected (Meta then drops
    Adam's correction too).
    """
    kind = type_of(owner, cfg)
    if kind is None:
        return GraftingConfig(type="none")
    args = Args(owner, cfg, {"epsilon", "beta2", "drop_weighting_factor_on_gsquare"})
    if kind == "SGDPreconditionerConfig":
        return GraftingConfig(type="sgd")
    if kind == "AdaGradPreconditionerConfig":
        return GraftingConfig(type="adagrad", epsilon=args.number("epsilon", 1e-10))
    if kind in ("RMSpropPreconditionerConfig", "AdamPreconditionerConfig"):
        adam = kind == "AdamPreconditionerConfig"
        drop_weight = args.flag("drop_weighting_factor_on_gsquare", False)
        return GraftingConfig(
            type="adam" if adam else "rmsprop",
            beta2=args.number("beta2", 0.999 if adam else 0.99),
            ema_weight="one" if drop_weight else "one_minus_beta2",
            epsilon=args.number("epsilon", 1e-10),
            bias_correction=adam and not drop_weight,
        )
    raise NotImplementedError(f"{owner}.type = {kind!r} is not supported yet.")
