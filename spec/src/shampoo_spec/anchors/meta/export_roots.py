"""``to_meta``'s root, exponent, eigenvalue-correction and dtype arguments (eqs. 10-17),
for :mod:`.exporter`."""

from __future__ import annotations

from typing import Any

from ...config import (
    CoupledNewtonConfig,
    EighConfig,
    HigherOrderNewtonConfig,
    ShampooConfig,
)
from .._export import _Lacks, _reciprocal
from .import_exponents import MAX_ORDER

#: The defaults of the fields of ``CoupledNewtonConfig`` Meta has no argument for.
_NEWTON_DEFAULTS = CoupledNewtonConfig()


def _meta_factor_dtype(c: ShampooConfig, lacks: _Lacks) -> str:
    """Writes ``factor_matrix_dtype``: ``factor_storage_dtype`` (eq. 11b) when set, whose
    working precision must be float64 (Meta's eigendecomposition of a bfloat16 or
    float16 factor retries in float64), else ``factor_dtype``."""
    if c.factor_storage_dtype is None:
        return c.factor_dtype
    lacks.same("factor_dtype", c.factor_dtype, "float64",
               f"with factor_storage_dtype={c.factor_storage_dtype!r} Meta decomposes its "
               "factors in float64 (its eigh retry, eq. 11b)")
    return c.factor_storage_dtype


def _meta_inverse_root_dtype(c: ShampooConfig, lacks: _Lacks) -> str:
    """Writes ``inv_factor_matrix_dtype`` (eqs. 11a, 16): ``inverse_root_dtype``, or the
    factor dtype for None (Meta then keeps its roots in the factor dtype, as we do)."""
    lacks.need(c.inverse_root_dtype != c.factor_dtype, "inverse_root_dtype",
               c.inverse_root_dtype,
               "Meta's inv_factor_matrix_dtype equal to factor_matrix_dtype keeps the roots in "
               "the factor dtype: inverse_root_dtype=None (the reference rounds an explicit "
               "inverse_root_dtype, eq. 11a, but not factor_dtype)")
    return c.root_dtype


def _meta_root_inverse(c: ShampooConfig, lacks: _Lacks) -> dict[str, Any]:
    """Writes ``amortized_computation_config``: EigenConfig (or EighEigendecompositionConfig
    for eigenvalue correction; QREigendecompositionConfig for eq. 10f's or 17c's QR
    eigenbasis), with perturb-after for ``"shift_after"`` or the pseudo-inverse;
    CoupledNewtonConfig; CoupledHigherOrderConfig."""
    placement = c.epsilon.placement
    if isinstance(c.root_inverse, EighConfig):
        lacks.same("root_inverse.failure_threshold", c.root_inverse.failure_threshold, None,
                   "Meta's eigendecomposition fails a root only when it is non-finite")
        corrected = c.eigenvalue_correction is not None
        allowed = ("ridge",) if corrected else ("ridge", "shift_after", "pseudo_inverse")
        lacks.need(placement in allowed, "epsilon.placement", placement,
                   f"Meta's eigendecomposition places epsilon as one of {list(allowed)}")
        reuses = c.root_inverse.reuses_basis  # eq. (10h): Eigendecomposed Shampoo's
        out: dict[str, Any] = {
            "type": "EighEigendecompositionConfig" if corrected or reuses else "EigenConfig"
        }
        if placement == "shift_after":
            out["rank_deficient_stability_config"] = {
                "type": "PerturbationConfig", "perturb_before_computation": False,
            }
        if placement == "pseudo_inverse":
            lacks.same("epsilon.rank_cutoff_scope", c.epsilon.rank_cutoff_scope, "factor",
                       "Meta's PseudoInverseConfig cuts each factor at its own lambda_max")
            out["rank_deficient_stability_config"] = {
                "type": "PseudoInverseConfig",
                "rank_rtol": c.epsilon.rank_rtol, "rank_atol": c.epsilon.rank_atol,
            }
        ec = c.eigenvalue_correction
        if c.root_inverse.stores_basis:  # eqs. (10f), (10h): Eigendecomposed Shampoo's
            lacks.need(not (c.statistics.kl and placement == "shift_after"),
                       "epsilon.placement", placement,
                       "Meta's EigendecomposedKLShampoo starts from stored eigenvalues 1, "
                       "whose root with epsilon after is not the identity eq. (6b) takes")
        if c.root_inverse.reuses_basis:
            out["tolerance"] = c.root_inverse.basis_reuse_tolerance
        elif c.root_inverse.qr:
            out["type"] = "QREigendecompositionConfig"
            out["max_iterations"] = c.root_inverse.qr_max_iterations
            out["tolerance"] = c.root_inverse.qr_tolerance
        elif ec is not None and ec.eigenbasis_method == "qr":  # eq. (17c)
            out["type"] = "QREigendecompositionConfig"
            out["max_iterations"] = ec.qr_max_iterations
            out["tolerance"] = ec.basis_reuse_tolerance
        elif ec is not None and ec.basis_reuse_tolerance > 0:  # eq. (17b)
            out["tolerance"] = ec.basis_reuse_tolerance
        return out
    if isinstance(c.root_inverse, HigherOrderNewtonConfig):  # eq. (11c)
        higher = c.root_inverse
        lacks.same("epsilon.placement", placement, "ridge",
                   "unused by CoupledHigherOrderConfig (its own ridge): the default")
        return {
            "type": "CoupledHigherOrderConfig",
            "rel_epsilon": higher.rel_epsilon,
            "abs_epsilon": higher.abs_epsilon,
            "max_iterations": higher.max_iterations,
            "tolerance": higher.tolerance,
            "order": higher.order,
            "disable_tf32": True,
        }
    newton = c.root_inverse
    lacks.same("epsilon.placement", placement, "ridge", "Meta's coupled Newton adds a ridge")
    for name in ("error_growth_limit", "retries", "retry_epsilon_factor",
                 "retry_error_threshold", "failure_threshold", "deflation_rank"):
        lacks.same(f"root_inverse.{name}", getattr(newton, name), getattr(_NEWTON_DEFAULTS, name),
                   "Meta's CoupledNewtonConfig has only max_iterations and tolerance")
    return {
        "type": "CoupledNewtonConfig",
        "max_iterations": newton.max_iterations,
        "tolerance": newton.tolerance,
    }


def _meta_exponents(c: ShampooConfig, lacks: _Lacks) -> dict[int, Any]:
    """Writes ``inverse_exponent_override``: order -> exponent 1/root (or {dim: exponent})."""
    ex = c.exponents
    lacks.same("exponents.default", ex.default, "block_order",
               "Meta's default root is 2 * (block order)")
    lacks.same("exponents.override", ex.override, 0.0,
               "Meta has no one root for every factor: use overrides_by_order")
    out: dict[int, Any] = {}
    for item in ex.overrides_by_order:
        exps = [_reciprocal(r) for r in item.roots]
        path = f"exponents.overrides_by_order[order={item.order}].roots"
        lacks.need(all(e is not None for e in exps), path, item.roots,
                   "a root with no float exponent e such that 1 / e is that root")
        if len(set(exps)) == 1:
            out[item.order] = exps[0]
        else:
            out[item.order] = dict(enumerate(exps))
    return out


def _meta_eigenvalue_correction(c: ShampooConfig, lacks: _Lacks) -> dict[str, Any]:
    """Writes ``ignored_basis_change_dims``, ``inverse_exponent_override`` (eq. 17) and the
    storage dtypes ``factor_matrix_eigenvectors_dtype``, ``corrected_eigenvalues_dtype`` (eq. 17a).

    Meta's eigenvalue correction shares betas[1], epsilon and
    use_bias_correction with the factors; its root is one exponent for
    every order (written for orders 1..64), and per-dim roots can only be
    0 (an ignored basis-change dim).
    """
    ec = c.eigenvalue_correction
    assert ec is not None
    lacks.same("eigenvalue_correction.beta2", ec.beta2, c.statistics.beta2,
               "Meta's betas[1] sets both it and statistics.beta2")
    lacks.same("eigenvalue_correction.epsilon", ec.epsilon, c.epsilon.value,
               "Meta's epsilon sets both it and epsilon.value")
    lacks.same("eigenvalue_correction.ema_weight", ec.ema_weight, c.statistics.ema_weight,
               "Meta's drop_weighting_factor_on_gsquare sets both it and statistics.ema_weight")
    lacks.same("eigenvalue_correction.bias_correction", ec.bias_correction,
               c.statistics.bias_correction,
               "Meta's use_bias_correction sets both it and statistics.bias_correction")
    ex = c.exponents
    lacks.same("exponents.default", ex.default, "block_order",
               "Meta's default root is 2 * (block order)")
    lacks.same("exponents.override", ex.override, 0.0,
               "eigenvalue-corrected Shampoo takes its root from eigenvalue_correction.root")
    ignored: dict[int, list[int]] = {}
    for item in ex.overrides_by_order:
        roots = item.roots * item.order if len(item.roots) == 1 else item.roots
        lacks.need(all(r in (0.0, 2.0 * item.order) for r in roots),
                   f"exponents.overrides_by_order[order={item.order}].roots", item.roots,
                   "with eigenvalue correction Meta only ignores dims (root 0); other roots "
                   f"stay 2 * order = {2 * item.order}")
        ignored[item.order] = [d for d, r in enumerate(roots) if r == 0.0]
    # Meta's unlisted orders take exponent 1/2: a root other than 2 is written for
    # every order it could apply to, and roots_by_order for their own orders.
    orders = range(1, MAX_ORDER + 1) if ec.root != 2.0 else [o for o, _ in ec.roots_by_order]
    override: dict[int, float] = {}
    for order, _ in ec.roots_by_order:
        lacks.need(order <= MAX_ORDER, "eigenvalue_correction.roots_by_order", ec.roots_by_order,
                   f"Meta's orders go up to {MAX_ORDER}")
    for order in orders:
        root = ec.root_for(order)
        e = _reciprocal(root)
        where = ("eigenvalue_correction.root" if root == ec.root
                 else f"eigenvalue_correction.roots_by_order[order={order}]")
        lacks.need(e is not None, where, root, "no float exponent e such that 1 / e is that root")
        if e is not None:
            override[order] = e
    out: dict[str, Any] = {"ignored_basis_change_dims": ignored,
                           "inverse_exponent_override": override}
    # Eq. (17a): the storage dtypes, or the factor dtype for None (Meta then keeps
    # Q_k and D in the factor dtype, as we do).
    for field, key in (("eigenvectors_dtype", "factor_matrix_eigenvectors_dtype"),
                       ("corrected_eigenvalues_dtype", "corrected_eigenvalues_dtype")):
        stored = getattr(ec, field)
        lacks.need(stored != c.factor_dtype, f"eigenvalue_correction.{field}", stored,
                   f"Meta's {key} equal to factor_matrix_dtype keeps them in the factor "
                   f"dtype: {field}=None (the reference rounds an explicit {field}, eq. 17a, "
                   "but not factor_dtype)")
        out[key] = c.factor_dtype if stored is None else stored
    return out
