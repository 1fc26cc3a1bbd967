"""Google's ``precondition.tearfree`` options as a :class:`ShampooConfig`.

Tearfree (``precondition/tearfree/optimizer.py`` at 239a8cd) is
``chain(graft(second_order), momentum, -lr)``. :func:`from_tearfree` reads
the JSON form of its ``TearfreeOptions``: three nested objects,
``grafting_options``, ``second_order_options`` (``merge_dims``,
``second_order_type``, ``shampoo_options``, ``sketchy_options``) and
``momentum_options``, each with the fields of its dataclass. Missing keys
take tearfree's defaults; unknown keys are refused (listing the known ones);
every value is checked, errors naming the key path, the value and what is
allowed. Enums are read by member name (``"SGD"``), ``"GraftingType.SGD"``
or their value (``"sgd"``).

What our spec cannot state exactly raises ``NotImplementedError`` naming the
key: the ADAFACTOR graft (``optax.adafactor``:
factored second moments, clipping, parameter scale), Sketchy's
``ekfac_svd``, ``linear_approx_tail`` and ``memory_alloc``, and
``momentum_decay = 1`` (eq. 20 takes mu < 1).

The mapping, rule by rule (each checked against tearfree's source):

- reshaper + shampoo: ``distributed_shampoo.merge_small_dims`` (first to
  last, size-1 dims dropped: ``blocking.merge_dims_up_to = merge_dims``),
  dims >= ``block_size`` zero-padded to a multiple of it and cut into blocks:
  with pseudo-inverse roots a padded block's root is the unpadded block's
  padded with zeros, i.e. our blocks of ``block_size`` with a smaller last
  one (``blocking.max_preconditioner_dim``);
- statistics from zero, ``old * decay + new * (1 - decay)``, a sum at
  decay 1 (eq. 6, ``statistics.beta2``), no bias correction;
- roots: ``eigh``, eigenvalues ``w <= 1e-6 * max(w)`` get 0, others
  ``w^(-1/p)``, no epsilon (eq. 10 ``placement="pseudo_inverse"``,
  ``rank_rtol=1e-6``); ``max(w)`` is over the whole stack of a parameter's
  blocks of one axis (eq. 10g, ``rank_cutoff_scope="parameter"``), which with
  the zero padding is the max over our blocks; p = 2 * (merged) ndim (eq. 12
  ``"preconditioned_dims"``); a 0-d parameter has no factor
  (``scalar_factor=False``);
- 0-based count: statistics at ``count % update_statistics_freq == 0``,
  roots at ``count % update_preconditioners_freq == 0`` from the first step
  (``period_anchor="start"``, ``roots_before_start``), the Shampoo
  direction from ``count >= start_preconditioning_step`` (our start + 1;
  without a graft from the first step);
- graft SGD: the direction rescaled per parameter to the gradient's norm,
  ``P |g| / |P|`` (0 when |P| = 0); masked (graft only): rank <= 1 with
  ``skip_preconditioning_rank1``, any dim > ``skip_preconditioning_any_dim_gt``.
  Eq. (18) divides by ``|P| + norm_epsilon``: we take the least epsilon the
  spec allows (2^-126), which a float64 (float32) sum absorbs whenever
  ``|P| >= 2^-72`` (``2^-101``), and which gives 0 when |P| = 0, as tearfree;
- graft RMSPROP (tearfree's default): ``g * rsqrt(acc + epsilon)``, acc an
  EMA ``decay acc + (1 - decay) g^2`` from 0 or a sum at decay 1: eq. (14c)
  with ``epsilon_placement="inside_sqrt"`` (``rmsprop``, or ``adagrad`` at
  decay 1), no bias correction, norms as SGD's;
- graft NONE: no mask, no warm-up; tearfree then ignores the mask and start
  options (read and checked all the same);
- SKETCHY (``sketchy.py``): the reshaper merges as for Shampoo but pads and
  blocks nothing (``block_size = 0``): one block per parameter
  (``max_preconditioner_dim`` unbounded); every merged dim keeps a sketch of
  ``min(d, rank)`` directions, updated at ``count % update_freq == 0``
  before that step's direction and used every step: eqs. (6c), (10e)
  (``FrequentDirectionsConfig(rank, rule="tearfree")``, ``beta2 =
  second_moment_decay``, both frequencies ``update_freq``), epsilon
  relative to ``sigma_1 + sqrt(beta2) rho`` when ``relative_epsilon`` and
  ``epsilon > 0`` (``EpsilonConfig.scale``), p = 2 * (merged) ndim. The
  graft, mask and start act as with Shampoo. ``add_ggt`` only stores a
  matrix (no effect on the update). Tearfree's ``alpha`` is a float32
  constant: at ndim 3 its ``-1/6`` is rounded (about 3e-8 relative on the
  exponent), ours is not. Where a sketch's M has rank below ``min(d, rank)``
  and a later gradient (``update_freq > 1``) leaves its range, tearfree's
  SVD noise values decide which null directions get ``eps^(-1/p)``: eq.
  (10e) counts them as 0 (docs/spec.md);
- momentum: ``optax.trace(decay, nesterov)`` on one buffer, scaled by
  ``1 - decay`` first when ``ema`` (eq. 20, ``dampening = decay``);
- weight decay ``optax.add_decayed_weights`` before momentum
  (``"direction"``, eq. 19) or after it (``"update"``, eq. 21:
  ``lr * wd * x``); the learning rate last (``"after_momentum"``).

Shape-level departures the config cannot refuse (it has no shapes):
tearfree raises for a parameter with more than two dims >= ``block_size``
after merging (we block it); with graft NONE, a parameter of rank >= 1 whose
dims are all 1 has no factor in tearfree (its direction is g) and a 1 x 1
factor in ours (``scalar_factor`` acts on 0-d parameters only). With the
SGD graft both rescale to g.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..._validate import MAX_INTEGER, SMALLEST_EPSILON
from ...config import (
    BlockingConfig,
    EighConfig,
    EpsilonConfig,
    ExponentConfig,
    FailureConfig,
    FrequentDirectionsConfig,
    GradientFilterConfig,
    GraftingConfig,
    MomentumConfig,
    ScheduleConfig,
    ShampooConfig,
    StatisticsConfig,
    WeightDecayConfig,
)
from .._parse import Args, _refuse, number, schedule_start
from .keys import (
    ADAFACTOR_SCALE_FLOOR,
    GRAFTING_KEYS,
    GRAFTING_TYPES,
    KEYS,
    MOMENTUM_KEYS,
    OWNER,
    RANK_RTOL,
    SECOND_ORDER_KEYS,
    SECOND_ORDER_TYPES,
    SHAMPOO_KEYS,
    SKETCHY_KEYS,
)


def from_tearfree(
    options: Mapping[str, Any],
    learning_rate: float | Callable[[Any], Any],
    x64: bool | None = None,
) -> ShampooConfig:
    """Config equal to ``tearfree.optimizer.tearfree(learning_rate, TearfreeOptions(**options))``.

    ``options`` is the JSON form of ``TearfreeOptions`` (nested dicts, enums
    by name or value). ``learning_rate`` is a number, or a callable of the
    0-based count (an optax schedule, as tearfree takes it): then
    ``config.learning_rate`` is ``learning_rate(0)`` and the schedule itself
    goes to the backend (``shampoo_jax.shampoo(config, learning_rate=schedule)``).
    ``x64``: ``False`` is JAX's default (tearfree in float32:
    ``factor_dtype="float32"``), ``True`` or ``None`` float64.
    """
    a = Args(OWNER, options, KEYS)
    _no_type_key(OWNER, a, KEYS)
    if x64 is not None and not isinstance(x64, bool):
        raise ValueError(f"x64 = {x64!r} is invalid: allowed true, false or None.")
    lr = _learning_rate(learning_rate)
    g = _nested(a, "grafting_options", GRAFTING_KEYS)
    s = _nested(a, "second_order_options", SECOND_ORDER_KEYS)
    m = _nested(a, "momentum_options", MOMENTUM_KEYS)
    with g.section():
        grafting, start, skip_rank_lt, skip_dim_gt = _grafting(g)
    with s.section():
        merge_dims, block_size, so, sketchy = _second_order(s)
    with m.section():
        momentum, weight_decay = _momentum(m)
    with so.section():
        decay = so.number("second_moment_decay", 0.999)
        if not 0.0 <= decay <= 1.0:
            raise _refuse(so.prefix + "second_moment_decay", decay, "a number in [0, 1]")
        statistics = StatisticsConfig(beta2=decay, bias_correction=False, initial_value="zero")
        if sketchy:
            freq = so.integer("update_freq", 1, low=1)
            statistics_freq = freq
            fd, epsilon = _sketchy_config(so)
        else:
            freq = so.integer("update_preconditioners_freq", 1, low=1)
            statistics_freq = so.integer("update_statistics_freq", 1, low=1)
            fd, epsilon = None, EpsilonConfig(value=0.0, placement="pseudo_inverse",
                                              rank_rtol=RANK_RTOL, rank_atol=0.0,
                                              rank_cutoff_scope="parameter")
        schedule = ScheduleConfig(
            precondition_frequency=freq,
            statistics_frequency=statistics_freq,
            start_preconditioning_step=start,
            period_anchor="start",
            roots_before_start=True,
            roots_take_effect="same_step",
        )
    return ShampooConfig(
        learning_rate=lr,
        statistics=statistics,
        epsilon=epsilon,
        frequent_directions=fd,
        root_inverse=EighConfig(),
        exponents=ExponentConfig(default="preconditioned_dims"),
        grafting=grafting,
        gradient_filter=GradientFilterConfig(beta1=0.0),
        momentum=momentum,
        weight_decay=weight_decay,
        blocking=BlockingConfig(
            max_preconditioner_dim=block_size,
            merge_dims_up_to=merge_dims,
            merge_direction="first_to_last",
            squeeze=True,
            skip_dim_size_gt=skip_dim_gt,
            skip_rank_lt=skip_rank_lt,
            scalar_factor=False,
        ),
        schedule=schedule,
        failure=FailureConfig(nonfinite_gradient="raise", max_consecutive_root_failures=None),
        factor_dtype="float32" if x64 is False else "float64",
    )


def _learning_rate(value: Any) -> float:
    """A finite number >= 0, or ``value(0)`` of a callable (an optax schedule)."""
    if callable(value):
        return _non_negative("learning_rate(0)", schedule_start(value))
    return _non_negative("learning_rate", number("learning_rate", value))


def _non_negative(owner: str, value: float) -> float:
    x = number(owner, value)
    if x < 0:
        raise _refuse(owner, value, "a finite number >= 0 (our step is -lr * update)")
    return x


def _no_type_key(owner: str, a: Args, known: set[str]) -> None:
    """Tearfree's dataclasses have no ``type`` field (``Args`` lets one pass for Meta's)."""
    if "type" in a:
        raise ValueError(f"{owner} has unknown key(s) ['type']: allowed keys are "
                         f"{sorted(known)}.")


def _nested(parent: Args, key: str, known: set[str], *, nullable: bool = False) -> Args:
    """The nested options object ``key`` of ``parent`` as :class:`Args` (``{}`` when missing)."""
    owner = parent.prefix + key
    value = parent.get(key, {})
    if value is None and nullable:
        value = {}
    if not isinstance(value, Mapping):
        allowed = "null or a JSON object" if nullable else "a JSON object"
        raise _refuse(owner, value, f"{allowed} with keys {sorted(known)}")
    args = Args(owner, value, known)
    _no_type_key(owner, args, known)
    return args


def _enum(owner: str, value: Any, members: Mapping[str, str], enum: str) -> str:
    """An enum member's value, given by name (``"SGD"``), ``"Enum.NAME"`` or value (``"sgd"``)."""
    if isinstance(value, str):
        name = value
        parts = value.split(".")
        if len(parts) >= 2 and parts[-2] == enum and all(p.isidentifier() for p in parts):
            name = parts[-1]
        if name in members:
            return members[name]
        if value in members.values():
            return value
    names = ", ".join(f"{n!r}" for n in members)
    values = ", ".join(f"{v!r}" for v in members.values())
    raise _refuse(owner, value, f"a {enum} member: one of {names} (or {enum}.NAME, or the "
                  f"value: {values})")


def _grafting(g: Args) -> tuple[GraftingConfig, int, int, int | None]:
    """Reads ``grafting_options``: ``(grafting, start step (1-based), skip_rank_lt,
    skip_dim_size_gt)``. RMSPROP: ``g / sqrt(acc + epsilon)`` (eq. 14c with
    ``epsilon_placement="inside_sqrt"``), acc an EMA with weight 1 - decay
    (``rmsprop``) or a sum at decay 1 (``adagrad``), no bias correction;
    epsilon 0 refused (tearfree's 0 / 0 for a zero gradient). ADAFACTOR:
    ``optax.adafactor`` (eq. 14e): ``second_moment_decay`` is its decay
    exponent c, ``min_dim_size_to_factor`` m, ``clipping_threshold`` eq.
    (14d)'s ``clip_rms``, ``multiply_by_parameter_scale`` (truthy: optax's
    floor 1e-3), epsilon added to G^2 (0 refused, as RMSPROP's)."""
    p = g.prefix
    kind = _enum(p + "grafting_type", g.get("grafting_type", "RMSPROP"), GRAFTING_TYPES,
                 "GraftingType")
    decay = g.number("second_moment_decay", 0.999)
    epsilon = g.number("epsilon", 1e-23)
    # Tearfree does not check the type (any integer, negatives act as 0).
    start = g.integer("start_preconditioning_step", 0, low=-MAX_INTEGER, high=MAX_INTEGER - 1)
    any_dim_gt = g.integer("skip_preconditioning_any_dim_gt", 4096, low=-MAX_INTEGER)
    rank1 = g.flag("skip_preconditioning_rank1", True)
    min_dim = g.integer("min_dim_size_to_factor", 128, low=-MAX_INTEGER)
    # Typed float but used as a bool by optax.adafactor (its default is True).
    scale = g.get("multiply_by_parameter_scale", True)
    if not isinstance(scale, bool):
        number(p + "multiply_by_parameter_scale", scale)
    clipping = g.number("clipping_threshold", 1.0)
    # Tearfree's grafting._validate: only for the adaptive grafts.
    if kind in ("rmsprop", "adafactor") and epsilon < 0:
        raise _refuse(p + "epsilon", epsilon, f"a number >= 0 for grafting_type {kind.upper()}")
    if kind == "rmsprop" and not 0.0 < decay <= 1.0:
        raise _refuse(p + "second_moment_decay", decay, "a number in (0, 1] for grafting_type "
                      "RMSPROP")
    if kind == "adafactor":
        if not 0.0 < decay < 1.0:
            raise _refuse(p + "second_moment_decay", decay, "a number in (0, 1) for "
                          "grafting_type ADAFACTOR")
        if min_dim <= 0:
            raise _refuse(p + "min_dim_size_to_factor", min_dim, "an integer >= 1 for "
                          "grafting_type ADAFACTOR")
        if clipping < 1:
            raise _refuse(p + "clipping_threshold", clipping, "a number >= 1 for "
                          "grafting_type ADAFACTOR")
    if kind in ("rmsprop", "adafactor") and epsilon == 0:
        raise _refuse(p + "epsilon", epsilon, f"a number > 0 for grafting_type {kind.upper()} "
                      "(with 0 a zero gradient gives 0 / 0 in tearfree; eqs. 14c and 14e "
                      "need epsilon > 0)")
    if kind != "none" and any_dim_gt < 1:
        raise NotImplementedError(
            f"{OWNER}.{p}skip_preconditioning_any_dim_gt = {any_dim_gt} is not supported: "
            "below 1 tearfree masks every parameter of rank >= 1 (size-1 dims included) and "
            "no 0-d one; blocking.skip_dim_size_gt is >= 1. Use a value >= 1."
        )
    if kind == "none":
        # graft() returns the direction itself: no mask, no warm-up, no rescale.
        return GraftingConfig(type="none"), 1, 0, None
    adaptive: dict[str, Any] = {}
    if kind == "rmsprop":  # rsqrt(acc + epsilon): epsilon inside the square root
        adaptive = {"type": "adagrad" if decay == 1.0 else "rmsprop", "beta2": decay,
                    "epsilon": epsilon, "epsilon_placement": "inside_sqrt"}
    if kind == "adafactor":  # eq. (14e): optax.adafactor, its decay_rate = our c
        adaptive = {"type": "adafactor", "decay_exponent": decay, "factor_min_dim": min_dim,
                    "epsilon": epsilon, "epsilon_placement": "inside_sqrt",
                    "clip_rms": clipping,
                    "parameter_scale_floor": ADAFACTOR_SCALE_FLOOR if scale else None}
    return (
        GraftingConfig(
            **{"type": "sgd", **adaptive},
            norm_scope="parameter",
            # Tearfree: base * |graft| / |base|, 0 when |base| = 0 (see the module doc).
            norm_epsilon=SMALLEST_EPSILON,
        ),
        max(start, 0) + 1,
        2 if rank1 else 0,
        any_dim_gt,
    )


def _second_order(s: Args) -> tuple[int, int, Args, bool]:
    """Reads ``second_order_options``: ``(merge_dims, block_size, options, sketchy)``,
    ``options`` the ``shampoo_options`` or, with SKETCHY, the ``sketchy_options``
    (then ``block_size`` is unbounded: tearfree's reshaper pads nothing)."""
    p = s.prefix
    merge_dims = s.integer("merge_dims", 1024, low=2)
    kind = _enum(p + "second_order_type", s.get("second_order_type", "SHAMPOO"),
                 SECOND_ORDER_TYPES, "SecondOrderType")
    sketchy = s.get("sketchy_options", None)
    if sketchy is not None:
        _sketchy(_nested(s, "sketchy_options", SKETCHY_KEYS, nullable=True))
    if kind == "sketchy":
        if sketchy is None:
            raise _refuse(p + "sketchy_options", None, "a JSON object with second_order_type "
                          "SKETCHY (tearfree asserts it)")
        if s.get("shampoo_options", None) is not None:  # unused with SKETCHY: checked only
            _shampoo(_nested(s, "shampoo_options", SHAMPOO_KEYS))
        return merge_dims, MAX_INTEGER, _nested(s, "sketchy_options", SKETCHY_KEYS), True
    if "shampoo_options" in s and s.data["shampoo_options"] is None:
        raise _refuse(p + "shampoo_options", None, "a JSON object with second_order_type "
                      "SHAMPOO (tearfree asserts it)")
    sh = _nested(s, "shampoo_options", SHAMPOO_KEYS)
    return merge_dims, _shampoo(sh), sh, False


def _shampoo(sh: Args) -> int:
    """Checks ``shampoo_options``' block size and frequencies; returns the block size."""
    sh.integer("update_preconditioners_freq", 1, low=1)
    sh.integer("update_statistics_freq", 1, low=1)
    sh.number("second_moment_decay", 0.999)
    return sh.integer("block_size", 1024, low=2)


def _sketchy(k: Args) -> None:
    """Checks ``sketchy_options`` (read whether SHAMPOO or SKETCHY uses them)."""
    epsilon = k.number("epsilon", 1e-7)
    if not (epsilon == 0 or epsilon >= SMALLEST_EPSILON):
        raise _refuse(k.prefix + "epsilon", epsilon, f"0 or a number >= {SMALLEST_EPSILON!r} "
                      "(2^-126; eq. 10e adds it to nonnegative values before a negative power)")
    k.integer("rank", 128, low=1)
    k.flag("relative_epsilon", True)
    k.number("second_moment_decay", 0.999)
    k.integer("update_freq", 1, low=1)
    k.flag("add_ggt", False)
    alloc = k.get("memory_alloc", None)
    if alloc is not None and not isinstance(alloc, Mapping):
        raise _refuse(k.prefix + "memory_alloc", alloc, "null or a JSON object")
    k.flag("ekfac_svd", False)
    k.flag("linear_approx_tail", False)


def _sketchy_config(k: Args) -> tuple[FrequentDirectionsConfig, EpsilonConfig]:
    """SKETCHY's sketches (eq. 10e) and epsilon from checked ``sketchy_options``.

    ``add_ggt`` only stores ``EMA(G G^T)`` in the state: no effect on the update.
    Refuses (NotImplementedError) ``ekfac_svd``, ``linear_approx_tail`` and a
    ``memory_alloc``, which eq. (10e) has no rule for.
    """
    p = k.prefix
    lacking = {
        "ekfac_svd": (True, "the EKFAC-SVD preconditioner (all m singular pairs of the "
                      "stacked sketch with the previous tail) is not eq. (10e)"),
        "linear_approx_tail": (True, "a tail fitted to log(eigenvalue) against log(rank) is "
                               "not eq. (10e)'s escaped mass"),
    }
    for key, (bad, what) in lacking.items():
        if k.get(key, False) == bad:
            raise NotImplementedError(
                f"{OWNER}.{p}{key} = {bad!r} is not supported: {what}. Supported: False.")
    alloc = k.get("memory_alloc", None)
    if alloc is not None:
        raise NotImplementedError(
            f"{OWNER}.{p}memory_alloc = {alloc!r} is not supported: a rank per parameter "
            "path and dim; FrequentDirectionsConfig.rank is one rank for every factor. "
            "Supported: null."
        )
    epsilon = k.number("epsilon", 1e-7)
    relative = k.flag("relative_epsilon", True) and epsilon > 0
    return (
        FrequentDirectionsConfig(rank=k.integer("rank", 128, low=1), rule="tearfree"),
        EpsilonConfig(value=epsilon, scale="relative" if relative else "absolute"),
    )


def _momentum(m: Args) -> tuple[MomentumConfig, WeightDecayConfig]:
    """Reads ``momentum_options``: eq. (20) on one buffer, weight decay before
    (``"direction"``) or after (``"update"``) it. ``momentum_decay = 1`` is refused."""
    p = m.prefix
    ema = m.flag("ema", False)
    nesterov = m.flag("nesterov", True)
    decay = m.number("momentum_decay", 0.9)
    if not 0.0 <= decay <= 1.0:
        raise _refuse(p + "momentum_decay", decay, "a number in [0, 1]")
    wd = m.number("weight_decay", 0.0)
    if wd < 0:
        raise _refuse(p + "weight_decay", wd, "a number >= 0")
    after = m.flag("weight_decay_after_momentum", True)
    if decay == 1.0:
        raise NotImplementedError(
            f"{OWNER}.{p}momentum_decay = 1.0 is not supported: eq. (20) takes momentum < 1 "
            "(tearfree's trace then never forgets: M <- M + u)."
        )
    return (
        MomentumConfig(
            momentum=decay,
            dampening=decay if ema and decay > 0 else 0.0,
            nesterov=nesterov if decay > 0 else False,
            buffers="shared",
            learning_rate_placement="after_momentum",
        ),
        WeightDecayConfig(value=wd, type="update" if after else "direction"),
    )
