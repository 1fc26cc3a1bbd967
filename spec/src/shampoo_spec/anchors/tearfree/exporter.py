"""``to_tearfree``: a :class:`ShampooConfig` as the learning rate and ``TearfreeOptions``
of Google's ``precondition.tearfree``, in the JSON form :func:`from_tearfree` takes.

``from_tearfree(**to_tearfree(c)) == c`` for every config tearfree can express;
one ``ValueError`` names every field it lacks (:mod:`.._export`).
"""

from __future__ import annotations

from typing import Any

from ..._validate import MAX_INTEGER, SMALLEST_EPSILON
from ...config import (
    EighConfig,
    ShampooConfig,
)
from .._export import _check_round_trip, _Lacks
from .importer import from_tearfree
from .keys import ADAFACTOR_SCALE_FLOOR as TEARFREE_SCALE_FLOOR
from .keys import RANK_RTOL as TEARFREE_RANK_RTOL


def to_tearfree(config: ShampooConfig) -> dict[str, Any]:
    """``{"learning_rate": lr, "options": TearfreeOptions JSON}`` for ``config``.

    The form ``report --config`` reads under ``"from_tearfree"``:
    ``from_tearfree(out["options"], out["learning_rate"], x64=config.factor_dtype ==
    "float64") == config``. Tearfree (``precondition.tearfree``) runs eigh
    pseudo-inverse roots with a 1e-6 relative cutoff and no epsilon, statistics
    from 0 without bias correction, one momentum buffer and per-parameter graft
    norms (the rules in :mod:`shampoo_spec.anchors.tearfree.importer`): a config
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
