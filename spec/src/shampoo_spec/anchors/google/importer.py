"""Google's ``distributed_shampoo(...)`` arguments as a :class:`ShampooConfig`.

Rules settled from Google's source, docs/spec.md section 4.2 (one table row
per argument). :func:`from_google` refuses what we do not implement, reads
the values several sections share, then builds the config one section at a
time; each ``_section`` helper reads only its own arguments, so a new
argument goes in the helper of the section it configures (and in
:data:`KEYS`).

Sections are read in the order of the ``from_*`` body: when several
sections hold a bad value, the first one's error is raised. Values are read
strictly (:mod:`.._parse`): booleans must be ``true``/``false``, integers
integral and at most ``MAX_INTEGER``, numbers finite; ``"inf"`` only where
it means "no bound" (``skip_preconditioning_dim_size_gt``,
``merge_small_dims_block_size``). ``graft_type``, ``precondtioner_type``
and ``precision`` are read by name, ``"Enum.NAME"`` or the IntEnum value
(``GraftingType.ADAGRAD`` is 2). Google takes no dtype: ``x64`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..._validate import MAX_INTEGER
from ...config import (
    BlockingConfig,
    FailureConfig,
    GradientFilterConfig,
    GraftingConfig,
    MomentumConfig,
    ScheduleConfig,
    ShampooConfig,
    WeightDecayConfig,
)
from .._parse import UNBOUNDED, Args, _refuse, choice, dim_limit, schedule_start
from .import_preconditioner import _preconditioner, _quantizes_second_moment, _reset_period
from .keys import (
    GRAFT_VALUES,
    GRAFTS,
    KEYS,
    PRECISION_VALUES,
    PRECISIONS,
    SIDE_VALUES,
    SIDES,
    UNSUPPORTED,
)


def from_google(kwargs: Mapping[str, Any], x64: bool | None = None) -> ShampooConfig:
    """Config equal to Google's ``distributed_shampoo(**kwargs)``, non-sharded path.

    ``x64`` says how Google runs: ``False`` is JAX's default (64-bit off), where
    Google keeps statistics and computes roots in float32, so
    ``factor_dtype="float32"``; ``True`` (``jax_enable_x64``) gives float64.
    ``None`` (not said) gives float64, as before this argument existed: the
    float64 statement of Google's algorithm that the reference and the
    conformance comparisons run (``factor_dtype`` only sets the precision
    fast backends keep factors in, never the algorithm). ``inverse_root_dtype``
    stays None: Google has no storage dtype of its own for the roots (they
    are in the computation dtype, the one ``x64`` sets).

    Rules settled from Google's source (docs/spec.md section 4.2): 0-based
    count (so ``period_anchor="start"``, statistics at count % s == 0, roots
    at count % f == 0 from the first step, Shampoo from count >= start),
    statistics from ``matrix_epsilon * I`` without bias correction, one root
    ``2 * (preconditioned dims)`` per parameter, coupled Newton with
    tolerance 1e-6, growth stop 1.2, five retries at 10x ridge while the
    error > 0.05, failure of any root (eigh too, eq. 13) at
    ``inverse_failure_threshold``, graft norm
    over the whole parameter with 1e-25, heavy-ball momentum in two buffers
    with Nesterov. ``decoupled_weight_decay`` follows the current
    source (total decay lr * wd * x), not precondition-opt 0.3.0 (lr^2).

    ``learning_rate`` is a number, or a callable as Google takes it (an optax
    schedule, called with the 0-based count): then ``config.learning_rate``
    is ``learning_rate(0)`` and the schedule itself goes to the backend
    (``shampoo_jax.shampoo(config, learning_rate=schedule)``, a torch LR
    scheduler). Only a callable one lets ``decay_preconditioning_compute_steps``
    with a nonzero ``end_preconditioning_compute_steps`` act (Google's
    condition): it imports as ``schedule.precondition_frequency_growth``
    (eq. 8b); with a number it changes nothing and imports as None.
    """
    a = Args("from_google", kwargs, KEYS)
    if x64 is not None and not isinstance(x64, bool):
        raise ValueError(f"x64 = {x64!r} is invalid: allowed true, false or None.")
    _require(a, "learning_rate")
    _require(a, "block_size")
    _unsupported(a)
    _no_numerical_effect(a)
    lr_value = a.get("learning_rate", None)
    schedule_fn: Callable[[Any], Any] | None = lr_value if callable(lr_value) else None
    lr = schedule_start(schedule_fn) if schedule_fn is not None else a.number("learning_rate", None)
    # Shared: beta2 by the statistics (eq. 6) and the RMSPROP graft (eq. 14b);
    # decoupled_learning_rate by the grafting check and the momentum (eq. 20).
    beta2 = a.number("beta2", 0.999)
    # reset_preconditioner turns beta2 into 1 everywhere (eq. 10d's reset period instead).
    reset_every, beta2 = _reset_period(a, beta2)
    decoupled_lr = a.flag("decoupled_learning_rate", True)
    with a.section():
        grafting = _grafting(a, beta2, decoupled_lr)
    with a.section():
        pre = _preconditioner(a, beta2, x64, reset_every)
    with a.section():
        momentum = _momentum(a, grafting.type, decoupled_lr, x64)
    with a.section():
        weight_decay = _weight_decay(a)
    with a.section():
        blocking = _blocking(a)
    with a.section():
        schedule = _schedule(a, scheduled_lr=schedule_fn is not None)
    with a.section(since_start=True):  # cross-section rules, and the learning rate
        return ShampooConfig(
            learning_rate=lr,
            statistics=pre.statistics,
            epsilon=pre.epsilon,
            root_inverse=pre.root_inverse,
            low_rank=pre.low_rank,
            frequent_directions=pre.frequent_directions,
            exponents=pre.exponents,
            grafting=grafting,
            gradient_filter=GradientFilterConfig(beta1=0.0),  # Google filters nothing (eq. 15).
            momentum=momentum,
            weight_decay=weight_decay,
            blocking=blocking,
            schedule=schedule,
            failure=FailureConfig(nonfinite_gradient="raise", max_consecutive_root_failures=None),
            factor_dtype="float32" if x64 is False else "float64",
        )


def _require(a: Args, key: str) -> None:
    """Refuses kwargs without ``key`` (``learning_rate``, ``block_size``: no default)."""
    if key not in a:
        raise ValueError(f"{key} is required (Google's distributed_shampoo has no default).")


def _unsupported(a: Args) -> None:
    """Reads every key of :data:`UNSUPPORTED`; returns nothing.

    Refuses a non-default value of what we do not implement (nothing at
    239a8cd but the following): Google's int16 statistics (its
    ``best_effort_memory_usage_reduction`` under ``batch_axis_name``) with
    ``eigh`` or ``shard_optimizer_states``.
    """
    for key, (default, what) in UNSUPPORTED.items():
        a.unsupported(key, default, what)
    if _quantizes_second_moment(a):
        # Eq. (20c) is Google's pmap path (coupled Newton roots). With eigh, or on
        # the pjit path (shard_optimizer_states), its quantized statistics meet
        # code that was never checked against ours.
        for key in ("eigh", "shard_optimizer_states"):
            if a.data.get(key) is True:
                raise NotImplementedError(
                    f"from_google.{key} = True with best_effort_memory_usage_reduction = True "
                    f"and batch_axis_name = {a.data['batch_axis_name']!r} is not supported "
                    "(int16 statistics and roots, eq. 20c, import with Google's coupled "
                    f"Newton roots on its pmap path: {key} = False)."
                )


def _no_numerical_effect(a: Args) -> None:
    """Reads ``precision``, ``tensordot_precision``, ``generate_training_metrics``,
    ``reuse_preconditioner``, ``generate_fd_metrics``; returns nothing.

    Checks their values strictly; none changes the numbers we compute:
    ``precision`` / ``tensordot_precision`` are XLA matmul precisions
    (``jax.lax.Precision`` by name, ``"Precision.NAME"`` or value; our
    backends compute at full precision, HIGHEST), ``generate_training_metrics``
    only adds metrics (``generate_fd_metrics`` too, with frequent directions
    only), and ``reuse_preconditioner`` passes the previous root
    to root functions that discard it (frequent directions, which reads it,
    requires it: :func:`_frequent_directions`).
    """
    choice("precision", a.get("precision", "HIGHEST"), PRECISIONS, enum="Precision",
           values=PRECISION_VALUES)
    if a.get("tensordot_precision", None) is not None:
        choice("tensordot_precision", a.get("tensordot_precision", None), PRECISIONS,
               enum="Precision", values=PRECISION_VALUES)
    a.flag("generate_training_metrics", True)
    # FD metrics: diagnostics of the sketch, which they leave as it is.
    a.flag("generate_fd_metrics", False)
    a.flag("reuse_preconditioner", False)
    _distribution_hints(a)


def _distribution_hints(a: Args) -> None:
    """Reads ``batch_axis_name``, ``statistics_partition_spec``,
    ``preconditioner_partition_spec``; returns nothing.

    Where Google's root work runs, not what it computes. ``batch_axis_name``
    (pmap): each device computes the roots of a share of the statistics and
    ``all_gather`` gives every device all of them; Google does not average
    the gradients (the caller does, before ``update``), so from the averaged
    gradient the numbers are the non-sharded path's. The partition specs
    (pjit, with ``shard_optimizer_states``) place the stacked statistics and
    roots. Our JAX backend places its blocks with its own ShardingConfig.
    """
    name = a.get("batch_axis_name", None)
    if name is not None and not isinstance(name, str):
        raise _refuse("batch_axis_name", name, "null or a mesh axis name (a string)")
    for key in ("statistics_partition_spec", "preconditioner_partition_spec"):
        _partition_spec(key, a.get(key, None))


def _partition_spec(key: str, spec: Any) -> None:
    """A ``jax.sharding.PartitionSpec`` in JSON form: null, or a list of
    entries, each null, an axis name or a list of axis names."""
    allowed = "null or a list of entries, each null, an axis name or a list of axis names"
    if spec is None:
        return
    if not isinstance(spec, (list, tuple)):
        raise _refuse(key, spec, allowed)
    for entry in spec:
        names = entry if isinstance(entry, (list, tuple)) else [entry]
        if entry is not None and not all(isinstance(n, str) for n in names):
            raise _refuse(key, spec, allowed)


def _grafting(a: Args, beta2: float, decoupled_lr: bool) -> GraftingConfig:
    """Reads ``diagonal_epsilon``, ``graft_type``, ``clip_by_scaled_gradient_norm``
    (with ``beta2``, ``decoupled_learning_rate``).

    Returns ``grafting`` (eqs. 14, 18): norms over the whole parameter with
    1e-25, no bias correction; RMSPROP with beta2 = 1 is AdaGrad; NONE with
    ``decoupled_learning_rate=False`` is refused. The clip (eq. 14d,
    ``clip_rms``) acts only on the RMSPROP grafts and only when nonzero
    (Google's ``if clip_by_scaled_gradient_norm``); otherwise it is None.
    """
    diag_eps = a.number("diagonal_epsilon", 1e-10)
    graft_type = choice(
        "graft_type", a.get("graft_type", "SGD"), GRAFTS, enum="GraftingType", values=GRAFT_VALUES
    )
    clip = a.get("clip_by_scaled_gradient_norm", None)
    if clip is not None:
        clip = a.number("clip_by_scaled_gradient_norm", None)
        if clip < 0:
            raise ValueError(
                f"clip_by_scaled_gradient_norm = {clip!r} is invalid: allowed None, 0 (no "
                "clipping) or a number > 0."
            )
    clips = graft_type in ("rmsprop", "rmsprop_normalized") and bool(clip)
    if graft_type in ("rmsprop", "rmsprop_normalized") and beta2 == 1.0:
        graft_type = "adagrad" if graft_type == "rmsprop" else "adagrad_normalized"
    if graft_type == "none" and not decoupled_lr:
        raise NotImplementedError(
            "decoupled_learning_rate = False with graft_type = 'NONE' is not supported: "
            "Google then applies no learning rate to the Shampoo direction at all."
        )
    return GraftingConfig(
        type=graft_type,
        beta2=beta2 if graft_type in ("rmsprop", "rmsprop_normalized") else 1.0,
        epsilon=diag_eps,
        bias_correction=False,
        norm_scope="parameter",
        norm_epsilon=1e-25,
        normalize_epsilon=1e-25,
        clip_rms=clip if clips else None,
    )


def _momentum(a: Args, graft_type: str, decoupled_lr: bool, x64: bool | None) -> MomentumConfig:
    """Reads ``beta1``, ``moving_average_for_momentum``, ``nesterov``,
    ``best_effort_memory_usage_reduction`` (with ``decoupled_learning_rate``, ``x64``).

    Returns ``momentum`` (eq. 20): heavy ball (dampening beta1 with the
    moving average), separate Shampoo and graft buffers when beta1 > 0 (with
    graft NONE too: Google's second buffer then gathers its SGD warm-up
    direction), lr after momentum unless ``decoupled_learning_rate=False``.
    ``best_effort_memory_usage_reduction=True`` quantizes the momentum buffers
    of parameters of rank >= 2 to int8 (``storage="int8_columnwise"``, eq.
    20b; with ``batch_axis_name`` also the statistics and roots to int16,
    eq. 20c: :func:`_preconditioner`), in the dtype Google computes
    in: float32, float64 under ``x64`` (and when not said, as ``factor_dtype``).
    """
    beta1 = a.number("beta1", 0.9)
    quantized = a.flag("best_effort_memory_usage_reduction", False)
    return MomentumConfig(
        momentum=beta1,
        dampening=beta1 if a.flag("moving_average_for_momentum", False) else 0.0,
        nesterov=a.flag("nesterov", True),
        buffers="separate" if beta1 > 0 else "shared",
        learning_rate_placement="after_momentum" if decoupled_lr else "before_momentum",
        storage="int8_columnwise" if quantized else "float",
        scale_dtype="float32" if x64 is False or not quantized else "float64",
    )


def _weight_decay(a: Args) -> WeightDecayConfig:
    """Reads ``weight_decay``, ``decoupled_weight_decay``.

    Returns ``weight_decay``: ``"direction"`` (eq. 19, added before
    momentum), or ``"update"`` when decoupled (eq. 21, lr * wd * x).
    """
    return WeightDecayConfig(
        value=a.number("weight_decay", 0.0),
        type="update" if a.flag("decoupled_weight_decay", False) else "direction",
    )


def _blocking(a: Args) -> BlockingConfig:
    """Reads ``block_size``, ``preconditioner_type`` (or ``precondtioner_type``),
    ``skip_preconditioning_rank_lt``, ``skip_preconditioning_dim_size_gt``,
    ``merge_small_dims_block_size``, ``best_effort_shape_interpretation``.

    Returns ``blocking`` (eqs. 4-5): dims merged from the first, blocks of
    block_size (<= 0: unbounded), parameters skipped by rank or by an
    original dim, one-sided preconditioning (INPUT, OUTPUT).
    ``best_effort_shape_interpretation=False``: size-1 dims kept (each a
    1 x 1 factor, counted in the block's order) and nothing merged.
    """
    interpret = a.flag("best_effort_shape_interpretation", True)
    block = a.integer("block_size", None, low=-MAX_INTEGER)
    side = choice(
        "preconditioner_type",
        a.get("preconditioner_type", a.get("precondtioner_type", "ALL")),
        SIDES,
        enum="PreconditionerType",
        values=SIDE_VALUES,
    )
    rank_lt = a.integer("skip_preconditioning_rank_lt", 1, low=-MAX_INTEGER)
    merge = dim_limit("merge_small_dims_block_size", a.get("merge_small_dims_block_size", 4096))
    return BlockingConfig(
        max_preconditioner_dim=block if block > 0 else UNBOUNDED,
        merge_dims_up_to=merge if interpret else None,
        squeeze=interpret,
        merge_direction="first_to_last",
        skip_dim_size_gt=dim_limit(
            "skip_preconditioning_dim_size_gt", a.get("skip_preconditioning_dim_size_gt", 4096)
        ),
        # Below 1 Google preconditions a 0-d parameter with no factor at all (its
        # shape merges to ()); our plan's (1,) block without a factor is that.
        skip_rank_lt=max(rank_lt, 0),
        scalar_factor=rank_lt >= 1,
        preconditioned_dims=side,
    )


def _schedule(a: Args, *, scheduled_lr: bool = False) -> ScheduleConfig:
    """Reads ``start_preconditioning_step``, ``preconditioning_compute_steps``,
    ``statistics_compute_steps``, ``decay_preconditioning_compute_steps``,
    ``end_preconditioning_compute_steps`` (with whether ``learning_rate`` is callable).

    Returns ``schedule`` (eq. 8) for Google's 0-based count: anchored at the
    start, roots from the first step, the Shampoo direction from start + 1;
    the root period follows the learning rate (eq. 8b, growth = end) exactly
    when Google's ``decay and end and callable(learning_rate)`` holds.

    Also reads ``shard_optimizer_states``, ``num_devices_for_pjit``. Google's
    pjit path (``shard_optimizer_states=True``) computes a step's direction
    from the roots in its state and refreshes them afterwards, so roots
    take effect the step after their root step (``roots_take_effect =
    "next_step"``); ``num_devices_for_pjit`` (required there, as in Google)
    only pads the stacked statistics with identities to a multiple of it.
    """
    # Our start step is Google's + 1 (1-based), so Google's may be at most MAX_INTEGER - 1.
    start = a.integer("start_preconditioning_step", 5, low=0, high=MAX_INTEGER - 1)
    decay = a.flag("decay_preconditioning_compute_steps", False)
    end = a.get("end_preconditioning_compute_steps", None)
    if end is not None:
        end = a.integer("end_preconditioning_compute_steps", None, low=0)
    sharded = a.flag("shard_optimizer_states", False)
    devices = a.get("num_devices_for_pjit", None)
    if devices is not None or sharded:
        if devices is None:
            raise _refuse("num_devices_for_pjit", None,
                          "a positive integer with shard_optimizer_states = true "
                          "(Google pads its statistics to a multiple of it)")
        a.integer("num_devices_for_pjit", None, low=1)
    return ScheduleConfig(
        precondition_frequency_growth=end if decay and end and scheduled_lr else None,
        precondition_frequency=a.integer("preconditioning_compute_steps", 1, low=1),
        statistics_frequency=a.integer("statistics_compute_steps", 1, low=1),
        start_preconditioning_step=start + 1,
        period_anchor="start",
        roots_before_start=True,
        roots_take_effect="next_step" if sharded else "same_step",
    )
