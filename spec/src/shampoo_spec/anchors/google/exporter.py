"""``to_google``: a :class:`ShampooConfig` as the keyword arguments of Google's
``distributed_shampoo(**kwargs)``, in the JSON form :func:`from_google` takes.

``from_google(to_google(c), x64=...) == c`` for every config Google can express
(its kwargs carry no dtype: it computes in float64 exactly when 64-bit JAX is
on, so ``x64 = c.factor_dtype == "float64"``). A config it cannot express
raises one ``ValueError`` naming every field Google lacks, with its value and
why (:mod:`.._export`).
"""

from __future__ import annotations

from typing import Any

from ..._validate import MAX_INTEGER
from ...config import (
    CoupledNewtonConfig,
    EighConfig,
    HigherOrderNewtonConfig,
    ShampooConfig,
)
from .._export import _check_round_trip, _Lacks
from .importer import from_google
from .keys import GRAFTS, SIDES, ConstantSchedule


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
            threshold = newton.failure_threshold
            lacks.same("root_inverse.deflation_padding", newton.deflation_padding,
                       "google" if threshold is not None and threshold <= 1 else "own",
                       "Google deflates its statistics padded to the largest and judges "
                       "the padding (a smaller factor's root fails at a threshold <= 1)")
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
    lacks.same("frequent_directions.packing", fd.packing, "google",
               "Google packs every sketch at its largest statistic's size: a smaller "
               "sketched factor loses values (eq. 10d)")
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
