"""Meta's root methods (``amortized_computation_config``) and storage dtypes as
``ShampooConfig.root_inverse`` (eqs. 10-13), for :mod:`.import_preconditioner`."""

from __future__ import annotations

from typing import Any

from ...config import (
    MAX_NEWTON_ITERATIONS,
    CoupledNewtonConfig,
    EighConfig,
    HigherOrderNewtonConfig,
    InverseRootDtype,
    RootInverseConfig,
)
from .._parse import (
    Args,
    boolean,
    dtype,
    number,
    type_of,
)
from .keys import (
    AMORTIZED_KEYS,
    TORCH,
)

#: ``inv_factor_matrix_dtype`` values (Meta takes any torch floating dtype).
_ROOT_DTYPES: dict[str, InverseRootDtype] = {
    "float64": "float64", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
}


#: Meta's storage-dtype fields, by the preconditioner class that has them, and what the
#: refusal says the other class stores instead.
_DTYPE_FIELDS: dict[str, tuple[str, str]] = {
    "inv_factor_matrix_dtype": (
        "RootInvShampooPreconditionerConfig",
        "; its eigenvectors and eigenvalues have factor_matrix_eigenvectors_dtype and "
        "corrected_eigenvalues_dtype"),
    "factor_matrix_eigenvectors_dtype": ("EigenvalueCorrectedShampooPreconditionerConfig", ""),
    "corrected_eigenvalues_dtype": ("EigenvalueCorrectedShampooPreconditionerConfig", ""),
}


def _eigendecomposition(cfg: Any) -> dict[str, Any]:
    """``EigendecomposedShampooPreconditionerConfig``'s ``amortized_computation_config``.

    Eq. (10) from a stored eigendecomposition ``A + eps I = Q diag(lambda) Q^T``:
    Meta applies ``Q diag(f(lambda)) Q^T`` each step, computed from the stored
    Q and lambda, which is the root eq. (10) computes on the root step, so
    ``EighEigendecompositionConfig`` (its default) reads as RootInv's eigh
    root (:func:`_root_inverse`, ``tolerance`` 0), and
    ``QREigendecompositionConfig`` as the eigh root with
    ``eigenbasis_method="qr"`` (eq. 10f: Meta's QR refresh from the stored
    eigenvectors, its estimated eigenvalues in place of eigh's).
    """
    owner = "preconditioner_config.amortized_computation_config"
    kind = type_of(owner, cfg) or "EighEigendecompositionConfig"
    if kind not in ("EighEigendecompositionConfig", "QREigendecompositionConfig"):
        raise ValueError(
            f"{owner}.type = {kind!r} is invalid: allowed 'EighEigendecompositionConfig' or "
            "'QREigendecompositionConfig' with EigendecomposedShampooPreconditionerConfig (an "
            "EigendecompositionConfig)."
        )
    return {"type": kind, **dict(cfg or {})}


def _eigendecomposition_dtypes(p: Args, factor_dtype: str) -> None:
    """Eigendecomposed Shampoo's ``factor_matrix_eigenvectors_dtype`` and
    ``factor_matrix_eigenvalues_dtype`` (default float32): equal to the factor
    dtype, Q and lambda are kept as computed (eq. 10 unrounded); another dtype
    rounds them before the root is formed, which is refused (not specified)."""
    for key in ("factor_matrix_eigenvectors_dtype", "factor_matrix_eigenvalues_dtype"):
        value = dtype(f"preconditioner_config.{key}", p.get(key, "float32"), TORCH)
        if value != factor_dtype:
            raise NotImplementedError(
                f"preconditioner_config.{key} = {p.data.get(key, 'float32')!r} with "
                f"factor_matrix_dtype {factor_dtype!r} is not supported yet (the "
                "eigendecomposition stored in another dtype than the factors; set both "
                "factor_matrix_eigenvectors_dtype and factor_matrix_eigenvalues_dtype to "
                "factor_matrix_dtype)."
            )


def _storage_dtype(p: Args, kind: str, key: str, factor_dtype: str) -> InverseRootDtype | None:
    """Reads one of Meta's storage dtypes (default float32): ``inv_factor_matrix_dtype``
    (RootInv only), ``factor_matrix_eigenvectors_dtype`` or ``corrected_eigenvalues_dtype``
    (EigenvalueCorrected only).

    Returns ``inverse_root_dtype`` (eqs. 11a, 16), resp.
    ``eigenvalue_correction.eigenvectors_dtype`` or ``.corrected_eigenvalues_dtype``
    (eq. 17a). Meta computes in the factor dtype and stores the roots (the
    eigenvectors, D) cast to this dtype (docs/spec.md, with the lines of
    Meta's source). Equal to ``factor_matrix_dtype`` that is Meta storing
    them in the factor dtype: None (kept in ``factor_dtype``, unrounded by the
    reference, exactly as before these options). Otherwise its value, Meta's
    default float32 included: with float64 factors Meta rounds them to
    float32. The other preconditioner class has no such field (Meta's
    constructor refuses it): a ValueError there.
    """
    value = dtype(f"preconditioner_config.{key}", p.get(key, "float32"), TORCH)
    owner, instead = _DTYPE_FIELDS[key]
    if kind != owner:
        if key in p:
            raise ValueError(
                f"preconditioner_config.{key} = {p.data[key]!r} is invalid: allowed only with "
                f"{owner} ({kind} has no such field{instead})."
            )
        return None
    return None if value == factor_dtype else _ROOT_DTYPES[value]


def _root_inverse(
    cfg: Any, corrected: bool = False, eigendecomposed: bool = False
) -> tuple[RootInverseConfig, dict[str, Any], dict[str, Any]]:
    """Reads ``preconditioner_config.amortized_computation_config``.

    Returns ``root_inverse``, the epsilon rule (``EpsilonConfig`` fields) and
    the eigenbasis fields of ``EigenvalueCorrectionConfig``: ``EigenConfig`` /
    ``EighEigendecompositionConfig`` -> eigh (eq. 10) with ``"ridge"``, or
    ``"shift_after"`` when ``perturb_before_computation`` is False, or
    ``"pseudo_inverse"`` with its ``rank_rtol`` (None: n times the factor
    dtype's machine epsilon) and ``rank_atol`` for ``PseudoInverseConfig``;
    ``CoupledNewtonConfig`` -> coupled Newton (eq. 11; max_iterations 100,
    tolerance 1e-6) with the ridge; ``CoupledHigherOrderConfig`` -> eq. (11c).
    ``EighEigendecompositionConfig.tolerance`` in [0, 1] is
    ``eigenvalue_correction.basis_reuse_tolerance`` (eq. 17b) with
    eigenvalue correction (``corrected``), the eigh root's
    ``basis_reuse_tolerance`` (eq. 10h) with Eigendecomposed Shampoo
    (``eigendecomposed``); RootInv's ``EigenConfig`` ignores it (Meta
    decomposes with tolerance 0 there); > 0 is refused otherwise.
    ``QREigendecompositionConfig`` is ``eigenbasis_method="qr"`` with its
    ``max_iterations`` and ``tolerance``: eigenvalue correction's (eq. 17c), or
    with Eigendecomposed Shampoo (``eigendecomposed``) the eigh root's
    (``qr_max_iterations``, ``qr_tolerance``, eq. 10f), its epsilon rule as
    eigh's.
    """
    kind = type_of("amortized_computation_config", cfg) or "EigenConfig"
    args = Args("preconditioner_config.amortized_computation_config", cfg or {}, AMORTIZED_KEYS)
    if kind in ("EigenConfig", "EighEigendecompositionConfig"):
        reuse = 0.0
        if kind == "EighEigendecompositionConfig" and (corrected or eigendecomposed):
            reuse = _tolerance(args)
        elif not (corrected or eigendecomposed):
            # RootInv's EigenConfig: read and checked, no numerical effect (Meta's
            # matrix_inverse_root_eigen decomposes with tolerance=0.0 whatever it holds,
            # preconditioner/matrix_functions.py:345-353).
            _tolerance(args)
        else:
            args.unsupported("tolerance", 0.0, "eigenbasis reuse by an off-diagonal "
                             "criterion, supported with EighEigendecompositionConfig "
                             "(eigenvalue correction or Eigendecomposed Shampoo)")
        if eigendecomposed:  # eq. (10h): the eigh root's stored eigenbasis
            return EighConfig(basis_reuse_tolerance=reuse), _stability(args), {}
        return EighConfig(), _stability(args), {"basis_reuse_tolerance": reuse}
    if kind == "QREigendecompositionConfig" and eigendecomposed:
        return EighConfig(
            eigenbasis_method="qr",
            qr_max_iterations=args.integer("max_iterations", 1, low=0,
                                           high=MAX_NEWTON_ITERATIONS),
            qr_tolerance=_tolerance(args),
        ), _stability(args), {}
    if kind == "CoupledNewtonConfig":
        return (
            CoupledNewtonConfig(
                max_iterations=args.integer(
                    "max_iterations", 100, low=1, high=MAX_NEWTON_ITERATIONS
                ),
                tolerance=args.number("tolerance", 1e-6),
            ),
            {"placement": "ridge"},
            {},
        )
    if kind == "QREigendecompositionConfig":
        if not corrected:
            raise ValueError(
                "preconditioner_config.amortized_computation_config.type = "
                "'QREigendecompositionConfig' is invalid: allowed only with "
                "EigenvalueCorrectedShampooPreconditionerConfig or "
                "EigendecomposedShampooPreconditionerConfig (an eigendecomposition "
                "config; RootInv Shampoo takes EigenConfig, CoupledNewtonConfig or "
                "CoupledHigherOrderConfig)."
            )
        where = "preconditioner_config.amortized_computation_config.rank_deficient_stability_config"
        stab = args.get("rank_deficient_stability_config", None)
        if (type_of(where, stab) or "PerturbationConfig") != "PerturbationConfig":
            raise ValueError(f"{where}.type = {stab['type']!r} is invalid: allowed "
                             "'PerturbationConfig' with eigenvalue correction.")
        before = boolean(f"{where}.perturb_before_computation",
                         (stab or {}).get("perturb_before_computation", True))
        return EighConfig(), {"placement": "ridge" if before else "shift_after"}, {
            "eigenbasis_method": "qr",
            "qr_max_iterations": args.integer("max_iterations", 1, low=0,
                                              high=MAX_NEWTON_ITERATIONS),
            "basis_reuse_tolerance": _tolerance(args),
        }
    if kind == "CoupledHigherOrderConfig":
        for key in ("rel_epsilon", "abs_epsilon"):
            if key not in args:
                raise ValueError(
                    f"preconditioner_config.amortized_computation_config.{key} is required "
                    "(Meta's CoupledHigherOrderConfig has no default)."
                )
        if not args.flag("disable_tf32", True):
            raise NotImplementedError(
                "preconditioner_config.amortized_computation_config.disable_tf32 = False is "
                "not supported (TF32 matmuls on CUDA are not reproduced; with True, the "
                "default, every matmul is at full precision)."
            )
        return (
            HigherOrderNewtonConfig(
                order=args.integer("order", 3, low=2),
                rel_epsilon=args.number("rel_epsilon", None),
                abs_epsilon=args.number("abs_epsilon", None),
                max_iterations=args.integer(
                    "max_iterations", 100, low=1, high=MAX_NEWTON_ITERATIONS
                ),
                tolerance=args.number("tolerance", 1e-8),
            ),
            {"placement": "ridge"},
            {},
        )
    raise NotImplementedError(
        f"amortized_computation_config.type = {kind!r} is not supported yet "
        "(supported: EigenConfig, EighEigendecompositionConfig, QREigendecompositionConfig, "
        "CoupledNewtonConfig, CoupledHigherOrderConfig)."
    )


def _stability(args: Args) -> dict[str, Any]:
    """An eigendecomposition config's ``rank_deficient_stability_config``: the
    ``EpsilonConfig`` fields of eq. (10)'s rule (``"ridge"``; ``"shift_after"`` when
    ``perturb_before_computation`` is False; ``"pseudo_inverse"`` with its rank
    tolerances for ``PseudoInverseConfig``)."""
    where = "preconditioner_config.amortized_computation_config.rank_deficient_stability_config"
    stab = args.get("rank_deficient_stability_config", None)
    stab_kind = type_of(where, stab) or "PerturbationConfig"
    if stab_kind == "PseudoInverseConfig":
        pseudo = Args(where, stab, {"rank_atol", "rank_rtol"})
        rtol = pseudo.get("rank_rtol", 0.0)
        return {
            "placement": "pseudo_inverse",
            "rank_rtol": None if rtol is None else number(f"{where}.rank_rtol", rtol),
            "rank_atol": pseudo.number("rank_atol", 0.0),
        }
    if stab_kind != "PerturbationConfig":
        raise ValueError(
            f"{where}.type = {stab_kind!r} is invalid: allowed 'PerturbationConfig' or "
            "'PseudoInverseConfig'."
        )
    before = boolean(
        f"{where}.perturb_before_computation",
        (stab or {}).get("perturb_before_computation", True),
    )
    return {"placement": "ridge" if before else "shift_after"}


def _tolerance(args: Args) -> float:
    """An eigendecomposition config's ``tolerance`` in [0, 1] (eqs. 17b, 17c)."""
    value = args.number("tolerance", 0.0)
    if not 0.0 <= value <= 1.0:
        raise ValueError(
            "preconditioner_config.amortized_computation_config.tolerance = "
            f"{value!r} is invalid: allowed a number in [0, 1]."
        )
    return value
