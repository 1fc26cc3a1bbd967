"""Google's ``distributed_shampoo(...)`` arguments as a :class:`ShampooConfig`.

Rules settled from Google's source, docs/spec.md section 4.2 (one table row
per argument). :func:`from_google` refuses what we do not implement, reads
the values several sections share, then builds the config one section at a
time; each ``_section`` helper reads only its own arguments, so a new
argument goes in the helper of the section it configures (and in
:data:`KEYS`).

Sections are read in the order of the ``from_*`` body: when several
sections hold a bad value, the first one's error is raised. Values are read
strictly (:mod:`._parse`): booleans must be ``true``/``false``, integers
integral and at most ``MAX_INTEGER``, numbers finite; ``"inf"`` only where
it means "no bound" (``skip_preconditioning_dim_size_gt``,
``merge_small_dims_block_size``). ``graft_type``, ``precondtioner_type``
and ``precision`` are read by name, ``"Enum.NAME"`` or the IntEnum value
(``GraftingType.ADAGRAD`` is 2). Google takes no dtype: ``x64`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from .._validate import MAX_INTEGER
from ..config import (
    MAX_NEWTON_ITERATIONS,
    BlockingConfig,
    CoupledNewtonConfig,
    EighConfig,
    EpsilonConfig,
    ExponentConfig,
    FailureConfig,
    FrequentDirectionsConfig,
    GradientFilterConfig,
    GraftingConfig,
    GraftingType,
    LowRankRootConfig,
    MomentumConfig,
    RootInverseConfig,
    ScheduleConfig,
    ShampooConfig,
    StatisticsConfig,
    WeightDecayConfig,
)
from ._parse import UNBOUNDED, Args, _refuse, choice, dim_limit, schedule_start

#: The keyword arguments of ``distributed_shampoo`` (``precondtioner_type``: Google's spelling).
KEYS = {
    "learning_rate",
    "block_size",
    "beta1",
    "beta2",
    "diagonal_epsilon",
    "matrix_epsilon",
    "weight_decay",
    "start_preconditioning_step",
    "preconditioning_compute_steps",
    "statistics_compute_steps",
    "decay_preconditioning_compute_steps",
    "end_preconditioning_compute_steps",
    "best_effort_shape_interpretation",
    "graft_type",
    "nesterov",
    "exponent_override",
    "batch_axis_name",
    "statistics_partition_spec",
    "preconditioner_partition_spec",
    "num_devices_for_pjit",
    "shard_optimizer_states",
    "best_effort_memory_usage_reduction",
    "inverse_failure_threshold",
    "moving_average_for_momentum",
    "skip_preconditioning_dim_size_gt",
    "clip_by_scaled_gradient_norm",
    "precision",
    "tensordot_precision",
    "relative_matrix_epsilon",
    "merge_small_dims_block_size",
    "lobpcg_topk_precondition",
    "lobpcg_max_iter",
    "precondtioner_type",
    "preconditioner_type",
    "generate_fd_metrics",
    "compression_rank",
    "frequent_directions",
    "reset_preconditioner",
    "average_grad",
    "skip_preconditioning_rank_lt",
    "decoupled_learning_rate",
    "decoupled_weight_decay",
    "generate_training_metrics",
    "reuse_preconditioner",
    "eigh",
}

#: Keys whose non-default values we do not implement: key -> (default, what it does).
#: Empty at 239a8cd: every key of Google's ``distributed_shampoo`` imports.
UNSUPPORTED: dict[str, tuple[Any, str]] = {}

#: ``graft_type`` (GraftingType member names) -> ``grafting.type``.
GRAFTS: dict[str, GraftingType] = {
    "NONE": "none",
    "SGD": "sgd",
    "ADAGRAD": "adagrad",
    "RMSPROP": "rmsprop",
    "RMSPROP_NORMALIZED": "rmsprop_normalized",
    "SQRT_N": "sign",
    "ADAGRAD_NORMALIZED": "adagrad_normalized",
}

#: Google's ``GraftingType`` (an IntEnum): value -> member name.
GRAFT_VALUES = {
    0: "NONE", 1: "SGD", 2: "ADAGRAD", 3: "RMSPROP", 4: "RMSPROP_NORMALIZED", 5: "SQRT_N",
    6: "ADAGRAD_NORMALIZED",
}

PreconditionedDims = Literal["all", "all_but_last", "last"]

#: ``preconditioner_type`` (PreconditionerType member names) -> ``blocking.preconditioned_dims``.
SIDES: dict[str, PreconditionedDims] = {"ALL": "all", "INPUT": "all_but_last", "OUTPUT": "last"}

#: Google's ``PreconditionerType`` (an IntEnum): value -> member name.
SIDE_VALUES = {1: "ALL", 2: "INPUT", 3: "OUTPUT"}

#: ``precision`` / ``tensordot_precision``: ``jax.lax.Precision`` members (value -> name).
PRECISION_VALUES = {0: "DEFAULT", 1: "HIGH", 2: "HIGHEST"}
PRECISIONS = {name: name for name in PRECISION_VALUES.values()}


@dataclass(frozen=True)
class ConstantSchedule:
    """A learning rate schedule that is ``value`` at every step.

    What :func:`~shampoo_spec.to_google` writes as ``learning_rate`` when the
    config's root period follows the learning rate (eq. 8b): Google applies
    ``decay_preconditioning_compute_steps`` only when ``learning_rate`` is
    callable. With a constant schedule the ratio lr_t / lr_1 is 1, as it is
    in our backends run at ``config.learning_rate``.
    """

    value: float

    def __call__(self, count: Any) -> float:
        return self.value


class Preconditioner(NamedTuple):
    """The sections :func:`_preconditioner` returns."""

    statistics: StatisticsConfig
    epsilon: EpsilonConfig
    root_inverse: RootInverseConfig
    low_rank: LowRankRootConfig | None
    frequent_directions: FrequentDirectionsConfig | None
    exponents: ExponentConfig


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


def _quantizes_second_moment(a: Args) -> bool:
    """Google's ``quantize_second_moment``: int16 statistics and roots (eq. 20c) with
    ``best_effort_memory_usage_reduction`` and ``batch_axis_name``, and neither
    ``compression_rank`` nor ``frequent_directions``."""
    return a.data.get("best_effort_memory_usage_reduction") is True and (
        a.data.get("batch_axis_name") is not None) and not a.data.get("compression_rank") and (
        a.data.get("frequent_directions") is not True)


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


def _preconditioner(
    a: Args, beta2: float, x64: bool | None = None, reset_every: int | None = None
) -> Preconditioner:
    """Reads ``matrix_epsilon``, ``eigh``, ``relative_matrix_epsilon``,
    ``inverse_failure_threshold``, ``exponent_override``, ``compression_rank``
    (with ``beta2``), and the frequent-directions keys (:func:`_frequent_directions`).

    Returns ``statistics`` (eq. 6 from ``matrix_epsilon * I``, no bias
    correction, eq. 7), ``epsilon`` (eq. 9, relative with floor 1e-25
    (Newton) or 1e-6 (eigh) and Google's power-iteration lambda_max, eq. 9b,
    ``"ridge_floor"``), ``root_inverse`` (eigh,
    eq. 10, or Google's coupled Newton, eq. 11, each failing at
    ``inverse_failure_threshold``: eq. 13's eigh error
    ``max|Q^T (A + eps I) Q - diag(lambda)|``, eq. 11's Newton error) and
    ``exponents`` (eq. 12: 2 * preconditioned dims, or ``exponent_override``
    when > 0). ``compression_rank`` c != 0: ``low_rank`` (eq. 10c) of rank |c|,
    keeping the largest eigenvalues when c > 0 and the smallest when c < 0,
    judged at ``inverse_failure_threshold``, lambda_max floored at 1e-6 (Google's
    ``_low_rank_root``); it turns the int16 storage below off, as in Google.
    With ``frequent_directions`` the rank sketches the factors instead (eqs.
    6c, 10d) and ``low_rank`` is None.
    ``best_effort_memory_usage_reduction`` with ``batch_axis_name``
    stores the statistics and roots as int16 with their diagonals
    (``storage="int16_columnwise_diagonal"``, eq. 20c) in Google's statistics
    dtype: float32, float64 under ``x64`` (and when not said).
    """
    eps = a.number("matrix_epsilon", 1e-6)
    use_eigh = a.flag("eigh", False)
    relative = a.flag("relative_matrix_epsilon", True)
    # Google judges every root by it, eigh roots included (_skip: error >= threshold,
    # the error a float32 metric): eq. (13) for eigh, eq. (11) for Newton.
    threshold = a.number("inverse_failure_threshold", 0.1)
    quantized = _quantizes_second_moment(a)
    if use_eigh:
        root_inverse: RootInverseConfig = EighConfig(failure_threshold=threshold)
        _deflation(a, use_eigh, quantized)  # read and checked: the eigh path has none
    else:
        rank, iterations = _deflation(a, use_eigh, quantized)
        root_inverse = CoupledNewtonConfig(
            max_iterations=100,
            tolerance=1e-6,
            error_growth_limit=1.2,
            retries=5,
            retry_epsilon_factor=10.0,
            retry_error_threshold=0.05,
            failure_threshold=threshold,
            deflation_rank=rank,
            deflation_iterations=iterations,
        )
    override = a.number("exponent_override", 0)
    # Eq. (10c): compression_rank, its eigh root floored at 1e-6 like the eigh path's.
    compression = a.integer("compression_rank", 0, low=-MAX_INTEGER)
    sketch = _frequent_directions(a, compression, reset_every)
    low_rank = None if compression == 0 or sketch is not None else LowRankRootConfig(
        rank=abs(compression), keep="largest" if compression > 0 else "smallest",
        failure_threshold=threshold, relative_floor=None if use_eigh else 1e-6,
    )
    return Preconditioner(
        statistics=StatisticsConfig(
            beta2=beta2, bias_correction=False, initial_value="epsilon_identity",
            storage="int16_columnwise_diagonal" if quantized else "float",
            scale_dtype="float64" if quantized and x64 is not False else "float32",
        ),
        epsilon=EpsilonConfig(
            value=eps,
            scale="relative" if relative else "absolute",
            # Newton's ridge floor is 1e-25; the eigh path floors lambda_max at 1e-6.
            relative_floor=1e-6 if use_eigh else 1e-25,
            placement="ridge_floor",
            # Google's lambda_max: 100 power-iteration steps, tolerance 1e-6 (eq. 9b).
            lambda_max="power_iteration" if relative else "exact",
        ),
        root_inverse=root_inverse,
        low_rank=low_rank,
        frequent_directions=sketch,
        exponents=ExponentConfig(default="preconditioned_dims", override=max(override, 0.0)),
    )


def _deflation(a: Args, use_eigh: bool, quantized: bool) -> tuple[int, int | None]:
    """Reads ``lobpcg_topk_precondition`` k and ``lobpcg_max_iter`` m: eq. (11d)'s
    ``(deflation_rank, deflation_iterations)``.

    Google deflates only in its coupled Newton root: with ``eigh`` (or k <= 0)
    both keys have no effect and (0, None) is returned. m = 0 means k
    iterations (None); m < 0 runs none (0), as Google's loop does. With the
    int16 statistics (eq. 20c) the read-back factors are not symmetric, which
    LOBPCG assumes: refused.
    """
    k = a.integer("lobpcg_topk_precondition", 0, low=-MAX_INTEGER)
    m = a.integer("lobpcg_max_iter", 0, low=-MAX_INTEGER, high=MAX_NEWTON_ITERATIONS)
    if use_eigh or k <= 0:
        return 0, None
    if quantized:
        raise NotImplementedError(
            f"from_google.lobpcg_topk_precondition = {k} with best_effort_memory_usage_reduction "
            f"= True and batch_axis_name = {a.data['batch_axis_name']!r} is not supported "
            "(eq. 11d's LOBPCG needs symmetric factors; eq. 20c's read-back factors are not): "
            "lobpcg_topk_precondition = 0."
        )
    return k, (None if m == 0 else max(m, 0))


def _reset_period(a: Args, beta2: float) -> tuple[int | None, float]:
    """Reads ``reset_preconditioner`` (with ``beta2``): ``(reset_every, beta2)``.

    Google's rule: the sketch is emptied every ``round(1 / (1 - beta2))`` steps
    (never when beta2 = 1), and beta2 becomes 1 for everything (statistics,
    sketch decay, RMSPROP graft). Without it: ``(None, beta2)``.
    """
    if not a.flag("reset_preconditioner", False):
        return None, beta2
    if a.data.get("frequent_directions") is not True:
        raise ValueError("reset_preconditioner = true requires frequent_directions = true "
                         "(Google raises the same).")
    if beta2 == 1.0:
        return None, 1.0
    period = round(1.0 / (1.0 - beta2))  # np.round: ties to even, as Python's round
    if period > MAX_INTEGER:
        raise ValueError(f"beta2 = {beta2!r} with reset_preconditioner = true is invalid: "
                         f"its reset period round(1 / (1 - beta2)) = {period} exceeds "
                         f"{MAX_INTEGER}.")
    return period, 1.0


def _frequent_directions(
    a: Args, compression: int, reset_every: int | None
) -> FrequentDirectionsConfig | None:
    """Reads ``frequent_directions``, ``average_grad``, ``reuse_preconditioner``,
    ``statistics_compute_steps``, ``preconditioning_compute_steps`` (with
    ``compression_rank`` and the reset period of :func:`_reset_period`).

    ``frequent_directions`` (eqs. 6c, 10d): sketches of rank
    ``compression_rank`` (> 0, as Google requires), ``average_grad`` as
    ``average_gradients``, Google's floor 1e-6 under the sketch's largest
    value for a relative epsilon. Google's own refusals are kept (each a
    ValueError there): FD without ``compression_rank > 0``, ``average_grad``
    without FD, statistics and root periods that differ. FD without
    ``reuse_preconditioner`` crashes Google (its sketch update asserts a
    previous preconditioner): refused too.
    """
    fd = a.flag("frequent_directions", False)
    average = a.flag("average_grad", False)
    if average and not fd:
        raise ValueError("average_grad = true requires frequent_directions = true "
                         "(Google raises the same).")
    if not fd:
        return None
    if compression <= 0:
        raise ValueError(f"frequent_directions = true requires compression_rank > 0, found "
                         f"{compression} (Google raises the same).")
    stats = a.integer("statistics_compute_steps", 1, low=1)
    roots = a.integer("preconditioning_compute_steps", 1, low=1)
    if stats != roots:
        raise ValueError(f"frequent_directions = true requires statistics_compute_steps "
                         f"({stats}) = preconditioning_compute_steps ({roots}) (Google "
                         "raises the same).")
    if not a.flag("reuse_preconditioner", False):
        raise ValueError("frequent_directions = true requires reuse_preconditioner = true: "
                         "Google's sketch update reads the previous preconditioner, and "
                         "without it Google's _fd_update_root fails an assertion.")
    return FrequentDirectionsConfig(rank=compression, average_gradients=average,
                                    reset_every=reset_every, relative_floor=1e-6)


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
