"""Export a :class:`ShampooConfig` to the anchors' arguments (contract 8.1).

``to_meta(config)`` gives the keyword arguments of Meta's
``DistributedShampoo(params, **kwargs)``, ``to_google(config)`` those of
Google's ``distributed_shampoo(**kwargs)`` and ``to_tearfree(config)`` the
learning rate and ``TearfreeOptions`` of Google's ``precondition.tearfree``,
in exactly the JSON form the importers take: nested Meta configs as dicts
with a ``"type"`` key naming Meta's class, enums by member name
(``"DECOUPLED"``, ``"ADAGRAD"``, ``"RMSPROP"``), dtypes as strings
(``"float64"``). Every mapped argument is written, defaults
included, so the dict says everything on its own.

``from_meta(to_meta(c)) == c`` and ``from_google(to_google(c), x64=...) == c``
for every config the target can express (Google's kwargs carry no dtype: it
computes in float64 exactly when 64-bit JAX is on, so
``x64 = c.factor_dtype == "float64"``; the default ``x64=None`` reads float64).
A config the target cannot express raises one ``ValueError`` naming every
field the target lacks, with its value and why. One exception to equality:
an ``OrderOverride`` with a single root for an order > 1 exports as Meta's
scalar exponent and imports back as one root per dim (the same roots).

Layout mirrors the importers: one helper per section of the anchor's
arguments, each writing its keys and noting what it cannot express; a final
re-import checks that nothing was missed (:func:`_check_round_trip`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from ._validate import MAX_INTEGER, SMALLEST_EPSILON
from .config import (
    CoupledNewtonConfig,
    DiagonalPreconditionerConfig,
    EighConfig,
    GraftingConfig,
    HigherOrderNewtonConfig,
    OrderOverride,
    ShampooConfig,
    SpectralDescentConfig,
    config_to_dict,
)
from .config import flatten as _flatten
from .errors import Inexpressible
from .importers import from_google, from_meta, from_tearfree
from .importers.google import GRAFTS, SIDES, ConstantSchedule
from .importers.meta import MAX_ORDER
from .importers.tearfree import ADAFACTOR_SCALE_FLOOR as TEARFREE_SCALE_FLOOR
from .importers.tearfree import RANK_RTOL as TEARFREE_RANK_RTOL

__all__ = ["to_google", "to_meta", "to_tearfree"]

#: The defaults of the fields of ``CoupledNewtonConfig`` Meta has no argument for.
_NEWTON_DEFAULTS = CoupledNewtonConfig()


class _Lacks:
    """The fields a target cannot express: ``path -> "path = value (why)"``, first reason wins."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.items: dict[str, str] = {}

    def need(self, ok: bool, path: str, value: Any, why: str) -> None:
        """Notes ``path`` (holding ``value``) as inexpressible unless ``ok``."""
        if not ok and path not in self.items:
            self.items[path] = f"{path} = {value!r} ({why})"

    def same(self, path: str, value: Any, wanted: Any, why: str) -> None:
        """Notes ``path`` unless ``value == wanted`` (the only value the target gives)."""
        self.need(value == wanted, path, value, f"{why}; {self.target} gives {wanted!r}")

    def raise_if_any(self) -> None:
        if self.items:
            listed = "; ".join(self.items[k] for k in sorted(self.items))
            raise Inexpressible(
                f"{self.target} cannot express {len(self.items)} option(s) of this config: "
                f"{listed}."
            )


def _reciprocal(root: float) -> float | None:
    """An exponent e with ``1.0 / e == root`` exactly (Meta's exponents are 1 / root), or None."""
    if root == 0.0:
        return 0.0
    e = 1.0 / root
    candidates = [e]
    up = down = e
    for _ in range(4):
        up, down = math.nextafter(up, math.inf), math.nextafter(down, 0.0)
        candidates += [up, down]
    for candidate in candidates:
        if candidate > 0 and 1.0 / candidate == root:
            return candidate
    return None


def _canonical(config: ShampooConfig) -> ShampooConfig:
    """``config`` with single-root overrides of orders > 1 written one root per dim."""
    items = tuple(
        OrderOverride(order=item.order, roots=item.roots * item.order)
        if len(item.roots) == 1 and item.order > 1 else item
        for item in config.exponents.overrides_by_order
    )
    if items == config.exponents.overrides_by_order:
        return config
    exponents = dataclasses.replace(config.exponents, overrides_by_order=items)
    return dataclasses.replace(config, exponents=exponents)


def _check_round_trip(
    config: ShampooConfig, kwargs: dict[str, Any], lacks: _Lacks,
    importer: Callable[[dict[str, Any]], ShampooConfig],
) -> None:
    """Re-imports ``kwargs``; every field that comes back different is noted as lacking.

    A safety net under the section helpers: whatever they missed is still
    named, so ``to_x`` never returns kwargs that import to another config.
    """
    try:
        back = importer(kwargs)
    except (ValueError, NotImplementedError) as error:
        lacks.need(False, "(the exported arguments)", kwargs, f"re-import failed: {error}")
        return
    want: dict[str, Any] = {}
    got: dict[str, Any] = {}
    _flatten("", config_to_dict(_canonical(config)), want)
    _flatten("", config_to_dict(back), got)
    for key in sorted(set(want) | set(got)):
        if want.get(key, "<absent>") != got.get(key, "<absent>"):
            lacks.same(key, want.get(key, "<absent>"), got.get(key, "<absent>"),
                       "no argument gives it")


# ====================================================================== Meta
def to_meta(config: ShampooConfig) -> dict[str, Any]:
    """The kwargs of Meta's ``DistributedShampoo`` (JSON form) for ``config``.

    ``from_meta(to_meta(config)) == config``. Raises ``ValueError`` naming
    every option Meta cannot express (for example Google's coupled Newton
    rules, relative epsilon, parameter-wide graft norms, separate momentum
    buffers, ``"update"`` weight decay, skipped dims, statistics from eps I).
    """
    c = config
    lacks = _Lacks("Meta's DistributedShampoo")
    kwargs: dict[str, Any] = {}
    kwargs.update(_meta_shared(c, lacks))
    kwargs.update(_meta_weight_decay(c, lacks))
    kwargs["iterate_averaging_config"] = _meta_momentum(c, lacks)
    kwargs["preconditioner_config"] = _meta_preconditioner(c, lacks)
    kwargs.update(_meta_schedule(c, lacks))
    kwargs.update(_meta_blocking(c, lacks))
    kwargs["grafting_config"] = _meta_grafting(c, lacks)
    lacks.raise_if_any()
    _check_round_trip(c, kwargs, lacks, from_meta)
    lacks.raise_if_any()
    return kwargs


def _meta_shared(c: ShampooConfig, lacks: _Lacks) -> dict[str, Any]:
    """Writes ``lr``, ``betas``, ``beta3``, ``epsilon``, ``use_bias_correction``.

    From ``learning_rate``, ``gradient_filter`` (eq. 15), ``statistics``
    (eqs. 6-7) and ``epsilon.value``: Meta has one ``use_bias_correction``
    for the filter and the factors, and its factors start at zero.
    """
    s, f = c.statistics, c.gradient_filter
    lacks.same("statistics.initial_value", s.initial_value, "zero", "Meta's factors start at zero")
    lacks.same("statistics.storage", s.storage, "float",
               "Meta keeps its factors and roots in float (eq. 20c)")
    if s.ema_weight == "one":
        lacks.same("statistics.bias_correction", s.bias_correction, False,
                   "with drop_weighting_factor_on_gsquare Meta does not bias-correct its factors")
    else:
        lacks.same("gradient_filter.bias_correction", f.bias_correction, s.bias_correction,
                   "one use_bias_correction sets both the filter's and the statistics'")
    lacks.need(c.epsilon.value > 0 or c.epsilon.pseudo_inverse, "epsilon.value",
               c.epsilon.value, "Meta needs epsilon > 0 (0 only with pseudo-inverse roots)")
    return {
        "lr": c.learning_rate,
        "betas": [f.beta1, s.beta2],
        "beta3": -1.0 if f.beta3 is None else f.beta3,
        "epsilon": c.epsilon.value,
        "use_bias_correction": f.bias_correction,
    }


def _meta_weight_decay(c: ShampooConfig, lacks: _Lacks) -> dict[str, Any]:
    """Writes ``weight_decay``, ``weight_decay_type``: l2 -> L2, direction -> DECOUPLED
    (CORRECTED with ``scale_by_lr_ratio``)."""
    wd = c.weight_decay
    lacks.need(wd.type != "update", "weight_decay.type", wd.type,
               "Meta adds decay to the gradient (L2) or to the direction before momentum "
               "(DECOUPLED), never after momentum")
    kind = "L2" if wd.type == "l2" else ("CORRECTED" if wd.scale_by_lr_ratio else "DECOUPLED")
    return {"weight_decay": wd.value, "weight_decay_type": kind}


def _meta_momentum(c: ShampooConfig, lacks: _Lacks) -> dict[str, Any] | None:
    """Writes ``iterate_averaging_config``: ClassicMomentumConfig, GPA or Schedule-Free
    (``averaging``, eq. 20d), or null without either."""
    m = c.momentum
    lacks.same("momentum.buffers", m.buffers, "shared", "Meta keeps one momentum buffer")
    lacks.same("momentum.storage", m.storage, "float",
               "Meta keeps its momentum buffer in float (eq. 20b)")
    lacks.same("momentum.learning_rate_placement", m.learning_rate_placement, "after_momentum",
               "Meta multiplies the momentum output by lr")
    if m.momentum == 0.0:
        lacks.same("momentum.dampening", m.dampening, 0.0, "unused without momentum")
        lacks.same("momentum.nesterov", m.nesterov, False, "unused without momentum")
        av = c.averaging
        if av is None:
            return None
        if av.type == "gpa":  # eq. (20d)
            return {"type": "GeneralizedPrimalAveragingConfig",
                    "eval_interp_coeff": av.eval_interp, "train_interp_coeff": av.train_interp}
        return {"type": "ScheduleFreeConfig", "train_interp_coeff": av.train_interp,
                "eval_coeff_lr_power": av.eval_lr_power}
    return {
        "type": "ClassicMomentumConfig",
        "momentum": m.momentum,
        "dampening": m.dampening,
        "use_nesterov": m.nesterov,
    }


def _meta_preconditioner(c: ShampooConfig, lacks: _Lacks) -> dict[str, Any]:
    """Writes ``preconditioner_config``: RootInv or EigenvalueCorrected Shampoo.

    From ``epsilon`` (absolute; eq. 10 placement), ``root_inverse``,
    ``exponents`` (per-order exponents 1 / root), ``eigenvalue_correction``,
    ``factor_dtype`` or ``factor_storage_dtype`` (eq. 11b), ``inverse_root_dtype``
    (RootInv's ``inv_factor_matrix_dtype``, eqs. 11a, 16) and ``failure``.
    """
    eps = c.epsilon
    lacks.same("epsilon.scale", eps.scale, "absolute", "Meta's epsilon is absolute")
    lacks.same("epsilon.relative_floor", eps.relative_floor, 1e-16,
               "unused with an absolute epsilon")
    lacks.same("epsilon.lambda_max", eps.lambda_max, "exact", "unused with an absolute epsilon")
    lacks.same("epsilon.power_iteration_steps", eps.power_iteration_steps, 100,
               "unused with an absolute epsilon")
    lacks.same("epsilon.power_iteration_tolerance", eps.power_iteration_tolerance, 1e-6,
               "unused with an absolute epsilon")
    lacks.need(c.failure.max_consecutive_root_failures is not None,
               "failure.max_consecutive_root_failures", None,
               "Meta raises after num_tolerated_failed_amortized_computations failures")
    lacks.same("failure.nonfinite_gradient", c.failure.nonfinite_gradient, "raise",
               "Meta raises on non-finite values; it cannot skip a block")
    lacks.same("low_rank", c.low_rank, None, "Meta has no low-rank inverse roots (eq. 10c)")
    lacks.same("frequent_directions", c.frequent_directions, None,
               "Meta has no frequent-directions sketches (eqs. 6c, 10d)")
    corrected = c.eigenvalue_correction is not None
    # Eqs. (10f), (10h): Eigendecomposed Shampoo, its QR or tolerant eigh config.
    qr = c.root_inverse_stores_basis
    kl = "KL" if c.statistics.kl else ""  # eq. (6b)
    out: dict[str, Any] = {
        "type": (
            "EigenvalueCorrectedShampooPreconditionerConfig" if corrected
            else f"Eigendecomposed{kl}ShampooPreconditionerConfig" if qr
            else f"RootInv{kl}ShampooPreconditionerConfig"
        ),
        "amortized_computation_config": _meta_root_inverse(c, lacks),
        "factor_matrix_dtype": _meta_factor_dtype(c, lacks),
        "num_tolerated_failed_amortized_computations": c.failure.max_consecutive_root_failures,
    }
    if corrected:
        out.update(_meta_eigenvalue_correction(c, lacks))
    elif qr:
        # Meta's stored eigendecomposition in the factor dtype: eq. (10f) unrounded
        # (the config refuses inverse_root_dtype with it).
        for key in ("factor_matrix_eigenvectors_dtype", "factor_matrix_eigenvalues_dtype"):
            out[key] = out["factor_matrix_dtype"]
        out["inverse_exponent_override"] = _meta_exponents(c, lacks)
    else:
        out["inv_factor_matrix_dtype"] = _meta_inverse_root_dtype(c, lacks)
        out["inverse_exponent_override"] = _meta_exponents(c, lacks)
    if c.statistics.ema_weight == "one":
        out["drop_weighting_factor_on_gsquare"] = True
    if c.statistics.trace_scaling_exponent > 0:  # eq. (7b)
        out["use_trace_scaling"] = True
        out["trace_scaling_exponent"] = c.statistics.trace_scaling_exponent
    if c.diagonal is not None:
        # Eq. (16b): the Kronecker sections (checked above as for Shampoo) have no
        # effect; the round trip checks they hold what from_meta gives them.
        return _meta_diagonal(c.diagonal, lacks)
    if c.spectral is not None:  # eq. (16c), likewise
        return _meta_spectral(c.spectral)
    return out


def _meta_spectral(sd: SpectralDescentConfig) -> dict[str, Any]:
    """Writes ``SpectralDescentPreconditionerConfig`` (eq. 16c) with its
    orthogonalization config (the default scale_by_dims_fn, 1)."""
    if sd.method == "svd":
        oc: dict[str, Any] = {"type": "SVDOrthogonalizationConfig",
                              "scale_by_nuclear_norm": sd.scale_by_nuclear_norm}
    else:
        oc = {"type": "NewtonSchulzOrthogonalizationConfig",
              "num_iterations": sd.num_iterations, "coefficients": list(sd.coefficients)}
    return {"type": "SpectralDescentPreconditionerConfig", "orthogonalization_config": oc}


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


def _meta_schedule(c: ShampooConfig, lacks: _Lacks) -> dict[str, Any]:
    """Writes ``precondition_frequency``, ``start_preconditioning_step`` (eq. 8, Meta's rule)."""
    s = c.schedule
    lacks.same("schedule.statistics_frequency", s.statistics_frequency, 1,
               "Meta updates the factors every step")
    lacks.same("schedule.period_anchor", s.period_anchor, "end", "Meta's roots are at t % f == 0")
    lacks.same("schedule.roots_before_start", s.roots_before_start, False,
               "Meta computes no roots before the start step")
    lacks.same("schedule.roots_take_effect", s.roots_take_effect, "same_step",
               "Meta's roots precondition the step that computes them")
    start = s.start_preconditioning_step
    lacks.need(start is not None, "schedule.start_preconditioning_step", start,
               "Meta always starts preconditioning")
    lacks.need(start is None or start >= s.precondition_frequency,
               "schedule.start_preconditioning_step", start,
               f"Meta needs a start >= precondition_frequency ({s.precondition_frequency})")
    lacks.same("schedule.precondition_frequency_growth", s.precondition_frequency_growth, None,
               "Meta's root period does not follow the learning rate")
    # Without a graft Meta preconditions from step 1 (distributed_shampoo.py,
    # use_grafting_method): with eigenvalue correction that is D in the identity
    # basis before the first eigenbasis, which eq. (8) does not say.
    lacks.need(not (c.eigenvalue_correction is not None and c.grafting.type == "none"
                    and start is not None and start > 1),
               "schedule.start_preconditioning_step", start,
               "1 with eigenvalue correction and no graft (Meta then applies the correction "
               "from step 1, in the identity basis before the first eigenbasis)")
    return {
        "precondition_frequency": s.precondition_frequency,
        "start_preconditioning_step": start if start is not None else -1,
    }


def _meta_blocking(c: ShampooConfig, lacks: _Lacks) -> dict[str, Any]:
    """Writes ``max_preconditioner_dim`` and, unless 1, the target rank as
    ``distributed_config.target_parameter_dimensionality`` (eqs. 4-5): Meta
    merges up to the block size, or neither squeezes nor merges (inf).
    ``update_dtype`` (eq. 21a) set: a ``DDPDistributedConfig`` with it as
    ``communication_dtype``."""
    b = c.blocking
    out: dict[str, Any] = {"max_preconditioner_dim": b.max_preconditioner_dim}
    if not b.squeeze:
        lacks.same("blocking.merge_dims_up_to", b.merge_dims_up_to, None,
                   "Meta keeps size-1 dims only when it merges nothing (target inf)")
        lacks.same("blocking.merge_target_rank", b.merge_target_rank, 1,
                   "unused when nothing is merged")
        lacks.same("blocking.scalar_factor", b.scalar_factor, False,
                   "Meta keeps a 0-d parameter 0-d (no factor) when it merges nothing")
        target: float | int = math.inf
    else:
        lacks.same("blocking.merge_dims_up_to", b.merge_dims_up_to, b.max_preconditioner_dim,
                   "Meta merges dims up to max_preconditioner_dim")
        lacks.same("blocking.scalar_factor", b.scalar_factor, True,
                   "Meta promotes a 0-d parameter to (1,), a 1 x 1 factor")
        target = b.merge_target_rank
    if c.update_dtype is not None:
        # Eq. (21a): Meta's DDP rounds every block's update to communication_dtype.
        out["distributed_config"] = {
            "type": "DDPDistributedConfig", "communication_dtype": c.update_dtype,
        }
    if target != 1:
        out.setdefault("distributed_config", {"type": "SingleDeviceDistributedConfig"})
        out["distributed_config"]["target_parameter_dimensionality"] = (
            "inf" if target == math.inf else target
        )
    lacks.same("blocking.merge_direction", b.merge_direction, "last_to_first",
               "Meta merges from the last dim")
    lacks.same("blocking.skip_dim_size_gt", b.skip_dim_size_gt, None,
               "Meta preconditions every dim")
    lacks.same("blocking.skip_rank_lt", b.skip_rank_lt, 0, "Meta preconditions every rank")
    lacks.same("blocking.preconditioned_dims", b.preconditioned_dims, "all",
               "Meta's one-sided preconditioning is per order (inverse_exponent_override), "
               "not by position")
    return out


#: ``grafting.type`` -> Meta's grafting config class.
_META_GRAFTS = {
    "sgd": "SGDPreconditionerConfig",
    "adagrad": "AdaGradPreconditionerConfig",
    "rmsprop": "RMSpropPreconditionerConfig",
    "adam": "AdamPreconditionerConfig",
}


def _meta_diagonal(d: DiagonalPreconditionerConfig, lacks: _Lacks) -> dict[str, Any]:
    """Writes a diagonal ``preconditioner_config`` (eq. 16b): Meta's first-order
    class of the same type (:func:`_meta_first_order`), or sign descent with its
    default scale."""
    if d.type == "sign":
        return {"type": "SignDescentPreconditionerConfig"}
    out = _meta_first_order(d.as_graft(), "diagonal", lacks)
    assert out is not None
    return out


def _meta_grafting(c: ShampooConfig, lacks: _Lacks) -> dict[str, Any] | None:
    """Writes ``grafting_config`` (eqs. 14, 18): per-block norms with 1e-16."""
    g = c.grafting
    lacks.need(g.type in _META_GRAFTS or g.type == "none", "grafting.type", g.type,
               f"Meta grafts with none or one of {sorted(_META_GRAFTS)}")
    lacks.same("grafting.norm_scope", g.norm_scope, "block", "Meta takes graft norms per block")
    lacks.same("grafting.norm_epsilon", g.norm_epsilon, 1e-16, "Meta's graft norm epsilon")
    lacks.same("grafting.normalize_epsilon", g.normalize_epsilon, 1e-16,
               "Meta has no normalized grafts")
    lacks.same("grafting.clip_rms", g.clip_rms, None, "Meta does not clip its graft")
    lacks.same("grafting.epsilon_placement", g.epsilon_placement, "after_sqrt",
               "Meta adds its graft epsilon after the square root")
    return _meta_first_order(g, "grafting", lacks)


def _meta_first_order(g: GraftingConfig, path: str, lacks: _Lacks) -> dict[str, Any] | None:
    """Meta's SGD/AdaGrad/RMSprop/Adam config for eq. (14)'s method ``g`` (None for
    none), as ``grafting_config`` or a diagonal ``preconditioner_config``."""
    lacks.same(f"{path}.bias_correction", g.bias_correction,
               g.type == "adam" and g.ema_weight == "one_minus_beta2",
               "Meta bias-corrects Adam only, and not with drop_weighting_factor_on_gsquare "
               "(ema_weight 'one')")
    if g.type in ("none", "sgd"):
        lacks.same(f"{path}.epsilon", g.epsilon, 1e-10, f"unused by {g.type!r}")
        lacks.same(f"{path}.beta2", g.beta2, 1.0, f"unused by {g.type!r}")
    if g.type not in _META_GRAFTS:
        return None
    out: dict[str, Any] = {"type": _META_GRAFTS[g.type]}
    if g.type != "sgd":
        out["epsilon"] = g.epsilon
    if g.type in ("rmsprop", "adam"):
        out["beta2"] = g.beta2
    if g.ema_weight == "one":  # eq. (14b) w = 1
        out["drop_weighting_factor_on_gsquare"] = True
    return out


# ==================================================================== Google
def to_google(config: ShampooConfig) -> dict[str, Any]:
    """The kwargs of Google's ``distributed_shampoo`` (JSON form) for ``config``.

    ``from_google(to_google(config), x64=config.factor_dtype == "float64") ==
    config``: Google has no dtype argument (it runs in float64 exactly when
    64-bit JAX is on). Raises ``ValueError`` naming every option Google
    cannot express (for example Meta's gradient filter, bias correction,
    per-order roots, eigenvalue correction, per-block graft norms, Adam
    grafting, L2 decay, statistics from zero).
    """
    c = config
    lacks = _Lacks("Google's distributed_shampoo")
    # Google lets the root period follow the learning rate (eq. 8b) only for a callable one.
    kwargs: dict[str, Any] = {
        "learning_rate": c.learning_rate if c.schedule.precondition_frequency_growth is None
        else ConstantSchedule(c.learning_rate)
    }
    kwargs.update(_google_preconditioner(c, lacks))
    kwargs.update(_google_grafting(c, lacks))
    kwargs.update(_google_momentum(c, lacks))
    kwargs.update(_google_weight_decay(c, lacks))
    kwargs.update(_google_blocking(c, lacks))
    kwargs.update(_google_schedule(c, lacks))
    lacks.same("gradient_filter.beta1", c.gradient_filter.beta1, 0.0,
               "Google filters no gradient (its beta1 is momentum)")
    lacks.same("gradient_filter.beta3", c.gradient_filter.beta3, None, "Google filters nothing")
    lacks.same("gradient_filter.bias_correction", c.gradient_filter.bias_correction, False,
               "Google filters nothing")
    lacks.same("failure.nonfinite_gradient", c.failure.nonfinite_gradient, "raise",
               "Google lets non-finite values through; 'raise' is the nearest rule")
    lacks.same("failure.max_consecutive_root_failures", c.failure.max_consecutive_root_failures,
               None, "Google keeps the previous root however often roots fail")
    lacks.raise_if_any()
    x64 = c.factor_dtype == "float64"
    _check_round_trip(c, kwargs, lacks, lambda k: from_google(k, x64=x64))
    lacks.raise_if_any()
    return kwargs


def _google_preconditioner(c: ShampooConfig, lacks: _Lacks) -> dict[str, Any]:
    """Writes ``beta2``, ``matrix_epsilon``, ``relative_matrix_epsilon``, ``eigh``,
    ``inverse_failure_threshold``, ``exponent_override``.

    From ``statistics`` (EMA from eps I, no bias correction), ``epsilon``
    (ridge plus floor; lambda_max floored at 1e-25 for Newton, 1e-6 for
    eigh), ``root_inverse`` (eigh, or Google's fixed Newton rules) and
    ``exponents`` (2 * preconditioned dims, or one override). Both root
    methods carry ``inverse_failure_threshold`` (eqs. 11, 13).
    """
    s, eps, ex = c.statistics, c.epsilon, c.exponents
    lacks.same("statistics.ema_weight", s.ema_weight, "one_minus_beta2",
               "Google weighs G G^T by 1 - beta2")
    lacks.same("statistics.bias_correction", s.bias_correction, False,
               "Google does not bias-correct its statistics")
    lacks.same("statistics.initial_value", s.initial_value, "epsilon_identity",
               "Google's statistics start at matrix_epsilon * I")
    lacks.same("statistics.trace_scaling_exponent", s.trace_scaling_exponent, 0.0,
               "Google has no trace scaling")
    lacks.same("epsilon.placement", eps.placement, "ridge_floor",
               "Google adds a ridge and floors the eigenvalues at it")
    use_eigh = isinstance(c.root_inverse, EighConfig)
    lacks.same("epsilon.relative_floor", eps.relative_floor, 1e-6 if use_eigh else 1e-25,
               "Google's floor under lambda_max for its root method")
    relative = eps.scale == "relative"
    lacks.same("epsilon.lambda_max", eps.lambda_max, "power_iteration" if relative else "exact",
               "Google estimates lambda_max by power iteration" if relative
               else "unused with an absolute epsilon")
    lacks.same("epsilon.power_iteration_steps", eps.power_iteration_steps, 100,
               "Google's power iteration runs at most 100 steps")
    lacks.same("epsilon.power_iteration_tolerance", eps.power_iteration_tolerance, 1e-6,
               "Google's power iteration stops at a change <= 1e-6")
    lacks.same("eigenvalue_correction", c.eigenvalue_correction, None,
               "Google has no eigenvalue-corrected Shampoo")
    lacks.same("diagonal", c.diagonal, None,
               "Google has no diagonal preconditioner in place of Shampoo's (eq. 16b)")
    lacks.same("averaging", c.averaging, None, "Google has no iterate averaging (eq. 20d)")
    lacks.same("spectral", c.spectral, None, "Google has no spectral descent (eq. 16c)")
    lacks.same("inverse_root_dtype", c.inverse_root_dtype, None,
               "Google keeps its preconditioners in the computation dtype (eq. 11a)")
    lacks.same("factor_storage_dtype", c.factor_storage_dtype, None,
               "Google keeps its statistics in the computation dtype (eq. 11b)")
    lacks.same("update_dtype", c.update_dtype, None,
               "Google returns its updates unrounded (eq. 21a)")
    lacks.same("exponents.default", ex.default, "preconditioned_dims",
               "Google's root is 2 * (preconditioned dims of the parameter)")
    lacks.same("exponents.overrides_by_order", ex.overrides_by_order, (),
               "Google has one exponent_override for every factor")
    out: dict[str, Any] = {
        "beta2": s.beta2,
        "matrix_epsilon": eps.value,
        "relative_matrix_epsilon": eps.scale == "relative",
        "eigh": use_eigh,
        "exponent_override": (
            int(ex.override) if float(ex.override).is_integer() else ex.override
        ),
    }
    if isinstance(c.root_inverse, CoupledNewtonConfig):
        newton = c.root_inverse
        fixed = {"max_iterations": 100, "tolerance": 1e-6, "error_growth_limit": 1.2,
                 "retries": 5, "retry_epsilon_factor": 10.0, "retry_error_threshold": 0.05}
        for name, value in fixed.items():
            lacks.same(f"root_inverse.{name}", getattr(newton, name), value,
                       "fixed in Google's coupled Newton")
        if newton.deflation_rank > 0:  # eq. (11d)
            out["lobpcg_topk_precondition"] = newton.deflation_rank
            iterations = newton.deflation_iterations
            # Google's 0 means k iterations; any negative value, none.
            out["lobpcg_max_iter"] = 0 if iterations is None else (iterations or -1)
    if isinstance(c.root_inverse, HigherOrderNewtonConfig):
        lacks.need(False, "root_inverse.method", c.root_inverse.method,
                   "Google's roots are eigh or its coupled Newton")
        return out
    if isinstance(c.root_inverse, EighConfig):
        lacks.same("root_inverse.eigenbasis_method", c.root_inverse.eigenbasis_method, "eigh",
                   "Google's eigh root decomposes each factor afresh (no QR refresh from "
                   "a stored eigenbasis, eq. 10f)")
        lacks.same("root_inverse.basis_reuse_tolerance", c.root_inverse.basis_reuse_tolerance,
                   0.0, "Google's eigh root decomposes each factor afresh (no stored "
                   "eigenbasis kept while it fits, eq. 10h)")
    # Eq. (11) for Newton, eq. (13) for eigh: Google judges both by the one threshold.
    threshold = c.root_inverse.failure_threshold
    lacks.need(threshold is not None, "root_inverse.failure_threshold", None,
               "Google always judges a root by inverse_failure_threshold (eigh roots too)")
    out["inverse_failure_threshold"] = threshold
    if c.low_rank is not None:  # eq. (10c)
        lr = c.low_rank
        lacks.same("low_rank.failure_threshold", lr.failure_threshold, threshold,
                   "Google judges its low-rank roots by inverse_failure_threshold too")
        lacks.same("low_rank.relative_floor", lr.epsilon_for(eps).relative_floor, 1e-6,
                   "Google's low-rank root floors lambda_max at 1e-6")
        out["compression_rank"] = lr.rank if lr.keep == "largest" else -lr.rank
    if c.frequent_directions is not None:
        out.update(_google_sketch(c, lacks))
    return out


def _google_sketch(c: ShampooConfig, lacks: _Lacks) -> dict[str, Any]:
    """Writes ``frequent_directions``, ``compression_rank``, ``reuse_preconditioner``
    (which Google's sketch needs), ``average_grad`` and, for a reset period R,
    ``reset_preconditioner`` with ``beta2 = 1 - 1/R`` (Google's period
    ``round(1 / (1 - beta2))``; it then runs with beta2 = 1, which the config
    must say)."""
    fd = c.frequent_directions
    assert fd is not None
    lacks.same("frequent_directions.rule", fd.rule, "google",
               "Google's frequent directions is eq. (10d); tearfree's Sketchy rule (eq. 10e: "
               "every factor sketched, the tail decayed by sqrt(beta2), its own epsilon) "
               "has no option there")
    lacks.same("frequent_directions.relative_floor", fd.relative_floor, 1e-6,
               "Google's sketch floors its largest value at 1e-6")
    out: dict[str, Any] = {"frequent_directions": True, "compression_rank": fd.rank,
                           "reuse_preconditioner": True}
    if fd.average_gradients:
        out["average_grad"] = True
    if fd.reset_every is not None:
        lacks.same("statistics.beta2", c.statistics.beta2, 1.0,
                   "Google's reset_preconditioner runs with beta2 = 1")
        out["reset_preconditioner"] = True
        out["beta2"] = 1.0 - 1.0 / fd.reset_every
    return out


#: ``grafting.type`` -> Google's GraftingType member name.
_GOOGLE_GRAFTS = {ours: name for name, ours in GRAFTS.items()}


def _google_grafting(c: ShampooConfig, lacks: _Lacks) -> dict[str, Any]:
    """Writes ``graft_type``, ``diagonal_epsilon`` (eqs. 14, 18): norms over the parameter."""
    g = c.grafting
    lacks.need(g.type in _GOOGLE_GRAFTS, "grafting.type", g.type,
               f"Google grafts with one of {sorted(_GOOGLE_GRAFTS)}")
    rms = g.type in ("rmsprop", "rmsprop_normalized")
    lacks.same("grafting.beta2", g.beta2, c.statistics.beta2 if rms else 1.0,
               "Google's RMSPROP grafts use the statistics' beta2; the others none")
    lacks.same("grafting.ema_weight", g.ema_weight, "one_minus_beta2",
               "Google's RMSPROP graft weighs g^2 by 1 - beta2")
    lacks.same("grafting.bias_correction", g.bias_correction, False,
               "Google does not bias-correct its graft")
    lacks.same("grafting.epsilon_placement", g.epsilon_placement, "after_sqrt",
               "Google adds diagonal_epsilon after the square root")
    lacks.same("grafting.norm_scope", g.norm_scope, "parameter",
               "Google takes graft norms over the whole parameter")
    lacks.same("grafting.norm_epsilon", g.norm_epsilon, 1e-25, "Google's graft norm epsilon")
    lacks.same("grafting.normalize_epsilon", g.normalize_epsilon, 1e-25,
               "Google's normalization epsilon")
    lacks.need(not (g.type == "none" and c.momentum.lr_before_momentum),
               "momentum.learning_rate_placement", c.momentum.learning_rate_placement,
               "with no graft Google's decoupled_learning_rate=False applies no learning rate")
    out: dict[str, Any] = {
        "graft_type": _GOOGLE_GRAFTS.get(g.type, "SGD"), "diagonal_epsilon": g.epsilon
    }
    if g.clip_rms is not None:
        # Google clips its RMSPROP grafts only; one with beta2 = 1 is our AdaGrad.
        adagrad = g.type in ("adagrad", "adagrad_normalized")
        lacks.need(rms or (adagrad and c.statistics.beta2 == 1.0), "grafting.clip_rms",
                   g.clip_rms, "Google clips the RMSPROP grafts only (an AdaGrad graft with "
                   "statistics.beta2 = 1 is RMSPROP there)")
        if adagrad:
            out["graft_type"] = "RMSPROP" if g.type == "adagrad" else "RMSPROP_NORMALIZED"
        out["clip_by_scaled_gradient_norm"] = g.clip_rms
    return out


def _google_momentum(c: ShampooConfig, lacks: _Lacks) -> dict[str, Any]:
    """Writes ``beta1``, ``moving_average_for_momentum``, ``nesterov``,
    ``decoupled_learning_rate`` (eq. 20): two buffers whenever beta1 > 0;
    ``best_effort_memory_usage_reduction`` with int8 storage (eq. 20b, scales in
    ``factor_dtype``, the dtype Google computes in); with int16 factor storage
    (eq. 20c, which needs int8 momentum storage) also ``batch_axis_name="batch"``:
    Google's update must then run inside a ``pmap`` binding that axis."""
    m = c.momentum
    lacks.need(m.dampening in (0.0, m.momentum), "momentum.dampening", m.dampening,
               "Google's dampening is 0 or beta1 (moving_average_for_momentum)")
    separate = m.momentum > 0
    lacks.same("momentum.buffers", m.buffers, "separate" if separate else "shared",
               "Google keeps a Shampoo and a graft buffer (the SGD warm-up's without a "
               "graft) whenever beta1 > 0")
    if m.storage != "float":
        # Eq. (20b): Google quantizes in its buffers' dtype, the one x64 (factor_dtype) sets.
        lacks.same("momentum.scale_dtype", m.scale_dtype, c.factor_dtype,
                   "Google quantizes in its computation dtype, factor_dtype here")
    out: dict[str, Any] = {
        "beta1": m.momentum,
        "moving_average_for_momentum": m.momentum > 0 and m.dampening == m.momentum,
        "nesterov": m.nesterov,
        "decoupled_learning_rate": not m.lr_before_momentum,
    }
    if m.storage == "int8_columnwise":
        out["best_effort_memory_usage_reduction"] = True
    if c.statistics.quantized:
        # Eq. (20c): Google's int16 statistics and roots come with its int8 momentum,
        # on its pmap path only; the caller's pmap (or shard_map) binds the axis "batch".
        lacks.same("momentum.storage", m.storage, "int8_columnwise",
                   "Google quantizes the momentum whenever it quantizes its statistics "
                   "(best_effort_memory_usage_reduction)")
        lacks.same("statistics.scale_dtype", c.statistics.scale_dtype, c.factor_dtype,
                   "Google quantizes in its computation dtype, factor_dtype here")
        lacks.same("schedule.roots_take_effect", c.schedule.roots_take_effect, "same_step",
                   "Google's int16 statistics are on its pmap path, whose roots take effect "
                   "the same step")
        out["batch_axis_name"] = "batch"
    return out


def _google_weight_decay(c: ShampooConfig, lacks: _Lacks) -> dict[str, Any]:
    """Writes ``weight_decay``, ``decoupled_weight_decay``: direction (coupled) or update."""
    wd = c.weight_decay
    lacks.need(wd.type != "l2", "weight_decay.type", wd.type,
               "Google adds decay to the direction or the update, never to the gradient")
    lacks.same("weight_decay.scale_by_lr_ratio", wd.scale_by_lr_ratio, False,
               "Google's decay does not follow the learning rate's schedule")
    return {"weight_decay": wd.value, "decoupled_weight_decay": wd.type == "update"}


#: ``blocking.preconditioned_dims`` -> Google's PreconditionerType member name.
_GOOGLE_SIDES = {ours: name for name, ours in SIDES.items()}


def _google_blocking(c: ShampooConfig, lacks: _Lacks) -> dict[str, Any]:
    """Writes ``block_size``, ``merge_small_dims_block_size``,
    ``skip_preconditioning_dim_size_gt``, ``skip_preconditioning_rank_lt``,
    ``precondtioner_type`` (Google's spelling), ``best_effort_shape_interpretation``
    (False exactly when size-1 dims are kept) (eqs. 4-5)."""
    b = c.blocking
    lacks.same("blocking.merge_direction", b.merge_direction, "first_to_last",
               "Google merges from the first dim")
    lacks.same("blocking.merge_target_rank", b.merge_target_rank, 1,
               "Google merges down to one dim when the sizes allow")
    if b.squeeze:
        lacks.need(b.merge_dims_up_to is not None, "blocking.merge_dims_up_to", None,
                   "Google merges whenever it drops size-1 dims; merge_dims_up_to=1 plans "
                   "the same shapes")
    else:
        lacks.need(b.merge_dims_up_to is None, "blocking.merge_dims_up_to",
                   b.merge_dims_up_to, "Google keeps size-1 dims only when it merges nothing")
    lacks.need(b.skip_dim_size_gt is not None, "blocking.skip_dim_size_gt", None,
               f"Google always has a bound; {MAX_INTEGER} (MAX_INTEGER) never skips")
    if b.skip_rank_lt < 1:
        lacks.same("blocking.scalar_factor", b.scalar_factor, False,
                   "Google preconditions a 0-d parameter with no factor")
    else:
        lacks.same("blocking.scalar_factor", b.scalar_factor, True,
                   "unused when 0-d parameters are skipped (Google's spelling)")
    shape_kwargs: dict[str, Any] = (
        {"merge_small_dims_block_size": b.merge_dims_up_to} if b.squeeze
        else {"best_effort_shape_interpretation": False}
    )
    return {
        "block_size": b.max_preconditioner_dim,
        **shape_kwargs,
        "skip_preconditioning_dim_size_gt": b.skip_dim_size_gt,
        "skip_preconditioning_rank_lt": b.skip_rank_lt,
        "precondtioner_type": _GOOGLE_SIDES[b.preconditioned_dims],
    }


def _google_schedule(c: ShampooConfig, lacks: _Lacks) -> dict[str, Any]:
    """Writes ``start_preconditioning_step`` (ours - 1: Google counts from 0),
    ``preconditioning_compute_steps``, ``statistics_compute_steps`` (eq. 8);
    with a growing root period (eq. 8b), ``decay_preconditioning_compute_steps``
    and ``end_preconditioning_compute_steps`` (``to_google`` then writes a
    callable ``learning_rate``, which Google requires for them to act);
    ``shard_optimizer_states`` (with ``num_devices_for_pjit=1``, which it
    needs) for roots that take effect the next step."""
    s = c.schedule
    lacks.same("schedule.period_anchor", s.period_anchor, "start",
               "Google's work is at count % f == 0, count = t - 1")
    lacks.same("schedule.roots_before_start", s.roots_before_start, True,
               "Google computes roots from the first step")
    start = s.start_preconditioning_step
    lacks.need(start is not None, "schedule.start_preconditioning_step", start,
               "Google always starts preconditioning")
    out: dict[str, Any] = {
        "start_preconditioning_step": (start if start is not None else 1) - 1,
        "preconditioning_compute_steps": s.precondition_frequency,
        "statistics_compute_steps": s.statistics_frequency,
        **({"shard_optimizer_states": True, "num_devices_for_pjit": 1}
           if s.roots_take_effect == "next_step" else {}),
    }
    if s.precondition_frequency_growth is not None:
        out["decay_preconditioning_compute_steps"] = True
        out["end_preconditioning_compute_steps"] = s.precondition_frequency_growth
    return out


# ================================================================== tearfree
def to_tearfree(config: ShampooConfig) -> dict[str, Any]:
    """``{"learning_rate": lr, "options": TearfreeOptions JSON}`` for ``config``.

    The form ``report --config`` reads under ``"from_tearfree"``:
    ``from_tearfree(out["options"], out["learning_rate"], x64=config.factor_dtype ==
    "float64") == config``. Tearfree (``precondition.tearfree``) runs eigh
    pseudo-inverse roots with a 1e-6 relative cutoff and no epsilon, statistics
    from 0 without bias correction, one momentum buffer and per-parameter graft
    norms (the rules in :mod:`shampoo_spec.importers.tearfree`): a config
    outside them raises one ``ValueError`` naming every field tearfree lacks.
    Enums are written by member name (``"RMSPROP"``).
    """
    c = config
    lacks = _Lacks("Google's precondition.tearfree")
    options = {
        "grafting_options": _tearfree_grafting(c, lacks),
        "second_order_options": _tearfree_second_order(c, lacks),
        "momentum_options": _tearfree_momentum(c, lacks),
    }
    _tearfree_fixed(c, lacks)
    lacks.raise_if_any()
    out: dict[str, Any] = {"learning_rate": c.learning_rate, "options": options}
    x64 = c.factor_dtype == "float64"
    _check_round_trip(c, out, lacks,
                      lambda k: from_tearfree(k["options"], k["learning_rate"], x64=x64))
    lacks.raise_if_any()
    return out


def _tearfree_grafting(c: ShampooConfig, lacks: _Lacks) -> dict[str, Any]:
    """Writes ``grafting_options``: SGD, RMSPROP (``rmsprop``/``adagrad`` with epsilon
    inside the square root, eq. 14c) or NONE; the start step (ours - 1: tearfree counts
    from 0) and the masks (``blocking.skip_rank_lt`` 0 or 2, ``skip_dim_size_gt``)."""
    g, b = c.grafting, c.blocking
    start = c.schedule.start_preconditioning_step
    if g.type == "none":
        # graft() returns the direction itself: no warm-up and no masks.
        lacks.same("schedule.start_preconditioning_step", start, 1,
                   "without a graft tearfree preconditions from the first step")
        lacks.same("blocking.skip_rank_lt", b.skip_rank_lt, 0,
                   "without a graft tearfree masks no parameter")
        lacks.same("blocking.skip_dim_size_gt", b.skip_dim_size_gt, None,
                   "without a graft tearfree masks no parameter")
        return {"grafting_type": "NONE"}
    kinds = {"sgd": "SGD", "rmsprop": "RMSPROP", "adagrad": "RMSPROP", "adafactor": "ADAFACTOR"}
    lacks.need(g.type in kinds, "grafting.type", g.type,
               "tearfree grafts SGD, RMSprop or optax's Adafactor (eq. 14e)")
    out: dict[str, Any] = {"grafting_type": kinds.get(g.type, "SGD")}
    if g.has_state:
        lacks.same("grafting.epsilon_placement", g.epsilon_placement, "inside_sqrt",
                   "tearfree's RMSprop is g * rsqrt(acc + epsilon)")
        out["second_moment_decay"] = g.beta2
        out["epsilon"] = g.epsilon
    if g.factored:  # eq. (14e): optax.adafactor with tearfree's arguments
        floor = g.parameter_scale_floor
        lacks.need(floor in (None, TEARFREE_SCALE_FLOOR), "grafting.parameter_scale_floor",
                   floor, f"optax.adafactor scales by max(rms(W), {TEARFREE_SCALE_FLOOR}) "
                   "or not at all")
        lacks.need(g.clip_rms is not None and g.clip_rms >= 1.0, "grafting.clip_rms",
                   g.clip_rms, "tearfree's Adafactor always clips, at a threshold >= 1")
        out.update({"second_moment_decay": g.decay_exponent, "epsilon": g.epsilon,
                    "min_dim_size_to_factor": g.factor_min_dim,
                    "multiply_by_parameter_scale": floor is not None,
                    "clipping_threshold": g.clip_rms if g.clip_rms is not None else 1.0})
    lacks.same("grafting.norm_scope", g.norm_scope, "parameter",
               "tearfree rescales each parameter to its graft's norm")
    lacks.same("grafting.norm_epsilon", g.norm_epsilon, SMALLEST_EPSILON,
               "tearfree divides by |P| (0 for P = 0); the least epsilon says the same")
    lacks.need(start is not None, "schedule.start_preconditioning_step", start,
               "tearfree always starts preconditioning")
    out["start_preconditioning_step"] = (start if start is not None else 1) - 1
    lacks.need(b.skip_rank_lt in (0, 2), "blocking.skip_rank_lt", b.skip_rank_lt,
               "tearfree masks rank <= 1 (skip_preconditioning_rank1) or nothing by rank")
    out["skip_preconditioning_rank1"] = b.skip_rank_lt == 2
    lacks.need(b.skip_dim_size_gt is not None, "blocking.skip_dim_size_gt", None,
               f"tearfree always has a bound; {MAX_INTEGER} (MAX_INTEGER) never skips")
    out["skip_preconditioning_any_dim_gt"] = b.skip_dim_size_gt or MAX_INTEGER
    return out


def _tearfree_second_order(c: ShampooConfig, lacks: _Lacks) -> dict[str, Any]:
    """Writes ``second_order_options``: ``merge_dims`` and SHAMPOO with its
    ``shampoo_options`` (``block_size``, both frequencies, the statistics' decay), or,
    for eq. (10e)'s sketches, SKETCHY with its ``sketchy_options`` (``rank``,
    ``epsilon``, ``relative_epsilon``, the decay, ``update_freq``; no blocks)."""
    b, s = c.blocking, c.schedule
    lacks.need(b.merge_dims_up_to is not None, "blocking.merge_dims_up_to", None,
               "tearfree always merges small dims")
    lacks.same("blocking.merge_direction", b.merge_direction, "first_to_last",
               "tearfree merges from the first dim")
    lacks.same("blocking.squeeze", b.squeeze, True, "tearfree drops size-1 dims")
    lacks.same("blocking.scalar_factor", b.scalar_factor, False,
               "tearfree gives a 0-d parameter no factor")
    merge_dims = b.merge_dims_up_to if b.merge_dims_up_to is not None else 1024
    fd = c.frequent_directions
    if fd is not None and fd.rule == "tearfree":
        lacks.same("blocking.max_preconditioner_dim", b.max_preconditioner_dim, MAX_INTEGER,
                   "tearfree's Sketchy sketches each merged dim whole (no blocks)")
        lacks.same("schedule.statistics_frequency", s.statistics_frequency,
                   s.precondition_frequency, "Sketchy folds each gradient in on its root step")
        e = c.epsilon
        return {
            "merge_dims": merge_dims,
            "second_order_type": "SKETCHY",
            "sketchy_options": {
                "epsilon": e.value,
                "rank": fd.rank,
                "relative_epsilon": e.scale == "relative",
                "second_moment_decay": c.statistics.beta2,
                "update_freq": s.precondition_frequency,
            },
        }
    lacks.same("frequent_directions", fd, None,
               "tearfree sketches only with its own rule (frequent_directions.rule='tearfree')")
    e = c.epsilon
    lacks.same("epsilon.placement", e.placement, "pseudo_inverse",
               "tearfree's eigh roots drop eigenvalues <= 1e-6 * max and add no epsilon")
    lacks.same("epsilon.rank_rtol", e.rank_rtol, TEARFREE_RANK_RTOL,
               "tearfree's cutoff is 1e-6 times the largest eigenvalue")
    lacks.same("epsilon.rank_cutoff_scope", e.rank_cutoff_scope, "parameter",
               "tearfree's cutoff scales by the largest eigenvalue over a parameter's "
               "blocks (eq. 10g)")
    return {
        "merge_dims": merge_dims,
        "second_order_type": "SHAMPOO",
        "shampoo_options": {
            "block_size": b.max_preconditioner_dim,
            "update_preconditioners_freq": s.precondition_frequency,
            "update_statistics_freq": s.statistics_frequency,
            "second_moment_decay": c.statistics.beta2,
        },
    }


def _tearfree_momentum(c: ShampooConfig, lacks: _Lacks) -> dict[str, Any]:
    """Writes ``momentum_options``: optax's ``trace`` on one buffer (``ema``: scaled by
    1 - decay first, eq. 20 with ``dampening = momentum``), weight decay on the
    direction or the update."""
    m, wd = c.momentum, c.weight_decay
    lacks.same("momentum.buffers", m.buffers, "shared", "tearfree keeps one momentum buffer")
    ema = m.momentum > 0 and m.dampening == m.momentum
    lacks.need(m.dampening == 0.0 or ema, "momentum.dampening", m.dampening,
               "tearfree's ema scales by 1 - momentum, otherwise by 1")
    lacks.need(wd.type != "l2", "weight_decay.type", wd.type,
               "tearfree adds decay to the direction or the update, never to the gradient")
    lacks.same("weight_decay.scale_by_lr_ratio", wd.scale_by_lr_ratio, False,
               "tearfree's decay does not follow the learning rate's schedule")
    return {
        "ema": ema,
        "nesterov": m.nesterov,
        "momentum_decay": m.momentum,
        "weight_decay": wd.value,
        "weight_decay_after_momentum": wd.type == "update",
    }


def _tearfree_fixed(c: ShampooConfig, lacks: _Lacks) -> None:
    """Notes the rules tearfree has no option for (each its only value)."""
    lacks.need(isinstance(c.root_inverse, EighConfig), "root_inverse",
               type(c.root_inverse).__name__, "tearfree's roots are eigh roots")
    lacks.same("exponents.default", c.exponents.default, "preconditioned_dims",
               "tearfree's root is 2 x the (merged) rank")
    lacks.same("statistics.initial_value", c.statistics.initial_value, "zero",
               "tearfree's statistics start at 0")
    lacks.same("statistics.bias_correction", c.statistics.bias_correction, False,
               "tearfree does not bias-correct its statistics")
    lacks.same("gradient_filter.beta1", c.gradient_filter.beta1, 0.0,
               "tearfree filters no gradient")
    lacks.same("momentum.learning_rate_placement", c.momentum.learning_rate_placement,
               "after_momentum", "tearfree scales by the learning rate last")
    for section, what in (("low_rank", "low-rank roots"),
                          ("eigenvalue_correction", "eigenvalue correction"),
                          ("diagonal", "a diagonal preconditioner"),
                          ("spectral", "spectral descent"),
                          ("averaging", "iterate averaging")):
        lacks.same(section, getattr(c, section), None, f"tearfree has no {what}")
    s, b = c.schedule, c.blocking
    lacks.same("schedule.period_anchor", s.period_anchor, "start",
               "tearfree's work is at count % f == 0, count = t - 1")
    lacks.same("schedule.roots_before_start", s.roots_before_start, True,
               "tearfree computes roots from the first step")
    lacks.same("schedule.roots_take_effect", s.roots_take_effect, "same_step",
               "tearfree applies a root on the step it computes it")
    lacks.same("schedule.precondition_frequency_growth", s.precondition_frequency_growth,
               None, "tearfree's root period is fixed")
    lacks.same("blocking.merge_target_rank", b.merge_target_rank, 1,
               "tearfree merges down to one dim when the sizes allow")
    lacks.same("blocking.preconditioned_dims", b.preconditioned_dims, "all",
               "tearfree preconditions every dim")
    for dtype in ("inverse_root_dtype", "update_dtype", "factor_storage_dtype"):
        lacks.same(dtype, getattr(c, dtype), None,
                   "tearfree stores and applies everything in the parameters' dtype")
