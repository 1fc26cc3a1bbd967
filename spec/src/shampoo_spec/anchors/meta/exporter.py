"""``to_meta``: a :class:`ShampooConfig` as the keyword arguments of Meta's
``DistributedShampoo(params, **kwargs)`` (the importer contract).

In exactly the JSON form :func:`from_meta` takes: nested Meta configs as
dicts with a ``"type"`` key naming Meta's class, enums by member name
(``"DECOUPLED"``, ``"ADAGRAD"``), dtypes as strings (``"float64"``). Every
mapped argument is written, defaults included, so the dict says everything
on its own.

``from_meta(to_meta(c)) == c`` for every config Meta can express; a config it
cannot express raises one ``ValueError`` naming every field Meta lacks, with
its value and why. One exception to equality: an ``OrderOverride`` with a
single root for an order > 1 exports as Meta's scalar exponent and imports
back as one root per dim (the same roots).

Layout mirrors the importer: one helper per section of Meta's arguments
(the root ones in :mod:`.export_roots`), each writing its keys and noting
what it cannot express; a final re-import checks that nothing was missed
(:func:`~shampoo_spec.anchors._export._check_round_trip`).
"""

from __future__ import annotations

import math
from typing import Any

from ...config import (
    DiagonalPreconditionerConfig,
    GraftingConfig,
    ShampooConfig,
    SpectralDescentConfig,
)
from .._export import _check_round_trip, _Lacks
from .export_roots import (
    _meta_eigenvalue_correction,
    _meta_exponents,
    _meta_factor_dtype,
    _meta_inverse_root_dtype,
    _meta_root_inverse,
)
from .importer import from_meta


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
        lacks.same("averaging.scalar_dtype", av.scalar_dtype, "float32",
                   "Meta holds the scalars of eq. (20d) in float32 tensors (eq. 20e)")
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
