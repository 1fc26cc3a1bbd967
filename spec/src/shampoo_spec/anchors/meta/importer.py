"""Meta's ``DistributedShampoo(...)`` arguments as a :class:`ShampooConfig`.

Rules settled from Meta's source, docs/spec.md section 4.1 (one table row
per argument). :func:`from_meta` reads the values several sections share
(:func:`_shared`), then builds the config one section at a time; each
``_section`` helper reads only its own arguments, so a new argument goes in
the helper of the section it configures (and in :data:`KEYS`).

Sections are read in the order of the ``from_*`` body: when several
sections hold a bad value, the first one's error is raised. Values are read
strictly (:mod:`.._parse`): booleans must be ``true``/``false``, integers
integral and at most ``MAX_INTEGER``, numbers finite; ``"inf"`` only for
``max_preconditioner_dim`` (no bound). ``weight_decay_type`` is read by
name or ``"WeightDecayType.NAME"``, ``param_assignment_strategy`` by name or
``"FSDPParamAssignmentStrategy.NAME"``; dtypes as ``"float32"`` or
``"torch.float32"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ...config import (
    BlockingConfig,
    GradientFilterConfig,
    GraftingConfig,
    IterateAveragingConfig,
    MomentumConfig,
    ScheduleConfig,
    ShampooConfig,
    WeightDecayConfig,
)
from .._parse import (
    Args,
    choice,
    dim_limit,
    number,
    type_of,
)
from .import_distribution import _distribution
from .import_preconditioner import _grafting, _preconditioner
from .keys import (
    KEYS,
    WEIGHT_DECAY_TYPES,
    Preconditioner,
    Shared,
)


def from_meta(kwargs: Mapping[str, Any], *, shard_local: bool = False) -> ShampooConfig:
    """Config equal to Meta's ``DistributedShampoo(**kwargs)`` on a single device.

    ``shard_local=True`` imports a FullyShard/HybridShard ``distributed_config``
    with ``param_assignment_strategy`` DEFAULT (Meta's default), whose
    ``FullyShardDistributor`` / ``HybridShardDistributor`` step each rank's
    dim-0 piece of a ``fully_shard`` parameter as a parameter of its own: the
    config returned is then Meta's for those pieces, which only a backend that
    steps pieces runs (``shampoo_torch.DistributedConfig(shard_mode="local")``;
    ``shampoo_torch.from_meta_distributed`` returns both). Without it DEFAULT
    is refused, naming this argument; with it any other distribution is.

    Rules settled from Meta's source (docs/spec.md section 4.1): merging to
    one dim from the last while the product <= max_preconditioner_dim,
    root 2 * (merged block order), override values are exponents (root =
    1/e, 0 = not preconditioned), roots at t = start and t % f == 0 after it,
    per-block graft norm with 1e-16, one ``use_bias_correction`` for the
    filter and the factors, zero-initialised momentum, decoupled decay added
    to the direction before momentum. CORRECTED and INDEPENDENT decay are
    imported for a constant learning rate (lr = peak_lr).
    """
    if not isinstance(shard_local, bool):
        raise ValueError(f"shard_local = {shard_local!r} is invalid: allowed True or False.")
    a = Args("from_meta", kwargs, KEYS)
    shared = _shared(a)
    with a.section():
        weight_decay = _weight_decay(a, shared.lr)
    with a.section():
        momentum = _momentum(a)
        averaging = _averaging(a)
    target_rank, update_dtype = _distribution(a, shard_local)
    with a.section():
        pre = _preconditioner(a, shared)
    with a.section():
        schedule = _schedule(a)
    with a.section():
        # Spectral descent: Meta sets target_parameter_dimensionality to 2 (eq. 16c).
        blocking = _blocking(a, 2 if pre.spectral is not None else target_rank)
    with a.section():
        grafting = _grafting(a.get("grafting_config", None))
    if pre.diagonal is not None or pre.spectral is not None:
        schedule = _diagonal_schedule(a, schedule, pre, grafting)
    start = schedule.start_preconditioning_step
    if (type_of("preconditioner_config", a.get("preconditioner_config", None)) in (
            "EigendecomposedShampooPreconditionerConfig",
            "EigendecomposedKLShampooPreconditionerConfig")
            and pre.epsilon.placement == "shift_after" and grafting.type == "none"
            and start != 1):
        # Before its first root step Meta's stored eigenvalues are 1: with epsilon
        # after, its root is (1 + epsilon)^(-1/r) I, not eq. (8)'s direction F~.
        raise NotImplementedError(
            "EigendecomposedShampooPreconditionerConfig with perturb_before_computation = "
            f"False, grafting_config = None and start_preconditioning_step = {start} (> 1) "
            "is not supported yet (before the first root step Meta preconditions with "
            "(1 + epsilon)^(-1/r) I)."
        )
    if pre.eigenvalue_correction is not None and grafting.type == "none" and start != 1:
        # Meta's use_grafting_method is False without a graft: it preconditions from
        # step 1, with eigenvalue correction D in the identity basis until the first
        # eigenbasis (at the start step); eq. (8) takes P = F~ before the start.
        raise NotImplementedError(
            f"grafting_config = None with EigenvalueCorrectedShampooPreconditionerConfig and "
            f"start_preconditioning_step = {start} (> 1) is not supported yet (without a graft "
            "Meta applies the eigenvalue correction from step 1, in the identity basis before "
            "the first eigenbasis)."
        )
    # The shared values (lr, betas, epsilon, ...) and cross-section rules.
    with a.section(since_start=True):
        return ShampooConfig(
            learning_rate=shared.lr,
            statistics=pre.statistics,
            epsilon=pre.epsilon,
            root_inverse=pre.root_inverse,
            exponents=pre.exponents,
            eigenvalue_correction=pre.eigenvalue_correction,
            diagonal=pre.diagonal,
            spectral=pre.spectral,
            grafting=grafting,
            gradient_filter=_gradient_filter(shared),
            momentum=momentum,
            averaging=averaging,
            weight_decay=weight_decay,
            blocking=blocking,
            schedule=schedule,
            failure=pre.failure,
            factor_dtype=pre.factor_dtype,
            inverse_root_dtype=pre.inverse_root_dtype,
            factor_storage_dtype=pre.factor_storage_dtype,
            update_dtype=update_dtype,
        )


def _shared(a: Args) -> Shared:
    """Reads ``lr``, ``betas``, ``beta3``, ``epsilon``, ``use_bias_correction``.

    Returns the values several sections share: ``betas[1]``, ``epsilon`` and
    ``use_bias_correction`` serve the statistics (eqs. 6-7, 9) and the
    eigenvalue correction (eq. 17); ``betas[0]``, ``beta3`` (-1: None, i.e.
    beta1) and ``use_bias_correction`` the gradient filter (eq. 15); ``lr``
    the learning rate and INDEPENDENT weight decay.
    """
    lr = a.number("lr", 1e-2)
    betas = a.get("betas", (0.9, 1.0))
    if not isinstance(betas, (list, tuple)) or len(betas) != 2:
        raise ValueError(f"betas = {betas!r} is invalid: allowed a pair [beta1, beta2].")
    beta1, beta2 = number("betas[0]", betas[0]), number("betas[1]", betas[1])
    beta3 = a.number("beta3", -1.0)
    eps = a.number("epsilon", 1e-12)
    if eps < 0:  # 0 only with PseudoInverseConfig (checked with the root method)
        raise ValueError(f"epsilon = {eps!r} is invalid: allowed a number > 0.")
    return Shared(
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        beta3=None if beta3 == -1.0 else beta3,
        epsilon=eps,
        bias_correction=a.flag("use_bias_correction", True),
    )


def _weight_decay(a: Args, lr: float) -> WeightDecayConfig:
    """Reads ``weight_decay``, ``weight_decay_type`` (or the legacy ``use_decoupled_weight_decay``).

    Returns ``weight_decay``: L2 -> ``"l2"`` (eq. 2); DECOUPLED ->
    ``"direction"`` (eq. 19); CORRECTED -> ``"direction"`` with
    ``scale_by_lr_ratio`` (Meta's ``wd * lr_t / peak_lr``, peak_lr the
    constructor's lr); INDEPENDENT -> ``"direction"`` with value wd / lr
    (Meta's ``wd / peak_lr``, constant under a schedule too).
    """
    wd = a.number("weight_decay", 0.0)
    if "weight_decay_type" in a:
        wd_type = choice(
            "weight_decay_type", a.get("weight_decay_type", "DECOUPLED"), WEIGHT_DECAY_TYPES,
            enum="WeightDecayType",
        )
    else:
        wd_type = "DECOUPLED" if a.flag("use_decoupled_weight_decay", True) else "L2"
    if wd_type == "L2":
        return WeightDecayConfig(value=wd, type="l2")
    if wd_type == "DECOUPLED":
        return WeightDecayConfig(value=wd, type="direction")
    if wd_type == "CORRECTED":  # alpha = wd * lr_t / peak_lr, peak_lr = lr (eq. 19)
        if lr <= 0:
            raise ValueError("weight_decay_type = 'CORRECTED' needs lr > 0 (it divides by lr).")
        return WeightDecayConfig(value=wd, type="direction", scale_by_lr_ratio=True)
    # INDEPENDENT (choice() refused anything else).
    if lr <= 0:
        raise ValueError("weight_decay_type = 'INDEPENDENT' needs lr > 0 (it divides by lr).")
    return WeightDecayConfig(value=wd / lr, type="direction")


def _momentum(a: Args) -> MomentumConfig:
    """Reads ``iterate_averaging_config`` or the legacy ``momentum``/``dampening``/``use_nesterov``.

    Returns ``momentum`` (eq. 20), one zero-initialised buffer.
    ``ClassicMomentumConfig`` (momentum in (0, 1), default 0.5) replaces the
    legacy keys; GPA and Schedule-Free are refused.
    """
    averaging = a.get("iterate_averaging_config", None)
    kind = type_of("iterate_averaging_config", averaging)
    if kind is None:
        return MomentumConfig(
            momentum=a.number("momentum", 0.0),
            dampening=a.number("dampening", 0.0),
            nesterov=a.flag("use_nesterov", False),
        )
    if kind == "ClassicMomentumConfig":
        m = Args("iterate_averaging_config", averaging, {"momentum", "dampening", "use_nesterov"})
        mu = m.number("momentum", 0.5)
        if not 0 < mu < 1:
            raise ValueError(
                f"iterate_averaging_config.momentum = {mu!r} is invalid: allowed (0, 1)."
            )
        return MomentumConfig(
            momentum=mu,
            dampening=m.number("dampening", 0.0),
            nesterov=m.flag("use_nesterov", False),
        )
    if kind in _AVERAGING_KEYS:
        return MomentumConfig()  # eq. (20d) in its place: _averaging
    raise NotImplementedError(
        f"iterate_averaging_config.type = {kind!r} is not supported yet (allowed "
        f"ClassicMomentumConfig, {', '.join(sorted(_AVERAGING_KEYS))})."
    )


#: Meta's iterate averaging classes (eq. 20d) and their keys.
_AVERAGING_KEYS = {
    "GeneralizedPrimalAveragingConfig": {"eval_interp_coeff", "train_interp_coeff"},
    "ScheduleFreeConfig": {"train_interp_coeff", "eval_coeff_lr_power"},
}


def _averaging(a: Args) -> IterateAveragingConfig | None:
    """Reads ``GeneralizedPrimalAveragingConfig`` / ``ScheduleFreeConfig`` (eq. 20d).

    GPA: ``eval_interp_coeff`` (mu_x, default 0.9) and ``train_interp_coeff``
    (mu_y, 0.8); Schedule-Free: ``train_interp_coeff`` (0.8) and
    ``eval_coeff_lr_power`` (2). Both with ``scalar_dtype="float32"`` (eq. 20e).
    None for anything else.
    """
    cfg = a.get("iterate_averaging_config", None)
    kind = type_of("iterate_averaging_config", cfg)
    if kind not in _AVERAGING_KEYS:
        return None
    m = Args("iterate_averaging_config", cfg, _AVERAGING_KEYS[kind])
    train = m.number("train_interp_coeff", 0.8)
    # Eq. (20e): Meta holds lr, S_t and both coefficients in float32 tensors.
    if kind == "GeneralizedPrimalAveragingConfig":
        return IterateAveragingConfig(type="gpa", train_interp=train,
                                      eval_interp=m.number("eval_interp_coeff", 0.9),
                                      scalar_dtype="float32")
    return IterateAveragingConfig(type="schedule_free", train_interp=train,
                                  eval_lr_power=m.integer("eval_coeff_lr_power", 2, low=0),
                                  scalar_dtype="float32")


def _schedule(a: Args) -> ScheduleConfig:
    """Reads ``precondition_frequency``, ``start_preconditioning_step``.

    Returns ``schedule`` (eq. 8): roots at t = start and at t % f == 0 after
    it (``period_anchor="end"``, ``roots_before_start=False``); start -1
    means f, and a start below f is refused.
    """
    freq = a.integer("precondition_frequency", 1, low=1)
    start = a.integer("start_preconditioning_step", -1, low=-1)
    if start == -1:
        start = freq
    if start < freq:
        raise ValueError(
            f"start_preconditioning_step = {start} is invalid: allowed -1 or an integer >= "
            f"precondition_frequency ({freq})."
        )
    return ScheduleConfig(
        precondition_frequency=freq,
        start_preconditioning_step=start,
        period_anchor="end",
        roots_before_start=False,
    )


def _blocking(a: Args, target_rank: int | None) -> BlockingConfig:
    """Reads ``max_preconditioner_dim`` (an integer or inf), with the target rank.

    Returns ``blocking`` (eqs. 4-5): size-1 dims dropped, dims merged from the
    last while the product <= max_preconditioner_dim and more than
    ``target_rank`` dims could remain, then blocks of that size.
    ``target_rank`` None (Meta's target_parameter_dimensionality = inf): the
    shape as it is, size-1 dims kept and nothing merged.
    """
    mpd = dim_limit("max_preconditioner_dim", a.get("max_preconditioner_dim", 1024))
    return BlockingConfig(
        max_preconditioner_dim=mpd,
        merge_dims_up_to=mpd if target_rank is not None else None,
        merge_direction="last_to_first",
        squeeze=target_rank is not None,
        merge_target_rank=target_rank or 1,
        # inf: Meta leaves a 0-d parameter 0-d, a block with no factor.
        scalar_factor=target_rank is not None,
    )


def _diagonal_schedule(
    a: Args, schedule: ScheduleConfig, pre: Preconditioner, grafting: GraftingConfig,
) -> ScheduleConfig:
    """Eq. (8) for a diagonal preconditioner or spectral descent (eqs. 16b, 16c),
    as Meta runs them.

    Without a graft Meta applies them from step 1 (its ``use_grafting_method``
    is False): start 1. With one, the graft direction before the start step,
    as for Shampoo. Sign and spectral descent: Meta sets
    ``precondition_frequency`` to 1 before it reads a start of -1, so the
    default start is 1 too. ``precondition_frequency`` is imported as 1: it
    times only root steps (eq. 8), and neither has roots.
    """
    start = schedule.start_preconditioning_step
    resets = pre.spectral is not None or (pre.diagonal is not None
                                          and pre.diagonal.type == "sign")
    if grafting.type == "none" or (resets and a.get("start_preconditioning_step", -1) == -1):
        start = 1
    # No roots: the period has no effect (1, so that any start >= 1 is Meta's).
    return dataclasses.replace(schedule, precondition_frequency=1,
                               start_preconditioning_step=start)


def _gradient_filter(shared: Shared) -> GradientFilterConfig:
    """From ``betas[0]``, ``beta3``, ``use_bias_correction`` (read by :func:`_shared`).

    Returns ``gradient_filter`` (eq. 15): betas[0] filters the gradient (it is
    not momentum), beta3 weighs the direction, bias-corrected with the factors.
    """
    return GradientFilterConfig(
        beta1=shared.beta1, beta3=shared.beta3, bias_correction=shared.bias_correction
    )
