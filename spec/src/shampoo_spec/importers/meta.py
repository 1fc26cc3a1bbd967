"""Meta's ``DistributedShampoo(...)`` arguments as a :class:`ShampooConfig`.

Rules settled from Meta's source, docs/spec.md section 4.1 (one table row
per argument). :func:`from_meta` reads the values several sections share
(:func:`_shared`), then builds the config one section at a time; each
``_section`` helper reads only its own arguments, so a new argument goes in
the helper of the section it configures (and in :data:`KEYS`).

Sections are read in the order of the ``from_*`` body: when several
sections hold a bad value, the first one's error is raised. Values are read
strictly (:mod:`._parse`): booleans must be ``true``/``false``, integers
integral and at most ``MAX_INTEGER``, numbers finite; ``"inf"`` only for
``max_preconditioner_dim`` (no bound). ``weight_decay_type`` is read by
name or ``"WeightDecayType.NAME"``, ``param_assignment_strategy`` by name or
``"FSDPParamAssignmentStrategy.NAME"``; dtypes as ``"float32"`` or
``"torch.float32"``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple, cast

from ..config import (
    MAX_NEWTON_ITERATIONS,
    MUON_COEFFICIENTS,
    BlockingConfig,
    CoupledNewtonConfig,
    DiagonalPreconditionerConfig,
    DiagonalType,
    EigenvalueCorrectionConfig,
    EighConfig,
    EpsilonConfig,
    ExponentConfig,
    FactorStorageDtype,
    FailureConfig,
    GradientFilterConfig,
    GraftingConfig,
    HigherOrderNewtonConfig,
    InverseRootDtype,
    IterateAveragingConfig,
    MomentumConfig,
    OrderOverride,
    RootInverseConfig,
    ScheduleConfig,
    ShampooConfig,
    SpectralDescentConfig,
    StatisticsConfig,
    UpdateDtype,
    WeightDecayConfig,
)
from ._parse import (
    _INF_NAMES,
    Args,
    boolean,
    choice,
    dim_limit,
    dtype,
    integer,
    number,
    type_of,
)

#: The keyword arguments of ``DistributedShampoo`` (besides ``params``).
KEYS = {
    "lr",
    "betas",
    "beta3",
    "epsilon",
    "momentum",
    "dampening",
    "use_nesterov",
    "weight_decay",
    "weight_decay_type",
    "use_decoupled_weight_decay",
    "max_preconditioner_dim",
    "precondition_frequency",
    "start_preconditioning_step",
    "use_bias_correction",
    "iterate_averaging_config",
    "grafting_config",
    "use_pin_memory",
    "shampoo_pt2_compile_config",
    "distributed_config",
    "preconditioner_config",
    "shampoo_runtime_config",
    "use_merge_dims",
    "concurrency_config",
}

#: The keys of ``preconditioner_config`` (any of Meta's Shampoo preconditioner configs).
PRECONDITIONER_KEYS = {
    "amortized_computation_config",
    "num_tolerated_failed_amortized_computations",
    "factor_matrix_dtype",
    "inv_factor_matrix_dtype",
    "corrected_eigenvalues_dtype",
    "factor_matrix_eigenvectors_dtype",
    "factor_matrix_eigenvalues_dtype",
    "inverse_exponent_override",
    "ignored_basis_change_dims",
    "use_symmetric_packing",
    "use_trace_scaling",
    "trace_scaling_exponent",
    "drop_weighting_factor_on_gsquare",
}

#: The keys of ``preconditioner_config.amortized_computation_config``.
AMORTIZED_KEYS = {
    "max_iterations",
    "tolerance",
    "rel_epsilon",
    "abs_epsilon",
    "order",
    "disable_tf32",
    "rank_deficient_stability_config",
    "retry_double_precision",
    "exponent_multiplier",
    "enhance_stability",
    "eigendecomposition_offload_device",
}

#: KL-Shampoo's classes (eq. 6b) and the class whose preconditioner each uses.
_KL_CLASSES = {
    "RootInvKLShampooPreconditionerConfig": "RootInvShampooPreconditionerConfig",
    "EigendecomposedKLShampooPreconditionerConfig": "EigendecomposedShampooPreconditionerConfig",
}

#: Preconditioner config classes that are a diagonal preconditioner (eq. 16b).
DIAGONAL_PRECONDITIONERS = {
    "SGDPreconditionerConfig",
    "AdaGradPreconditionerConfig",
    "RMSpropPreconditionerConfig",
    "AdamPreconditionerConfig",
    "SignDescentPreconditionerConfig",
}

Placement = Literal["ridge", "shift_after", "pseudo_inverse"]
FactorDtype = Literal["float32", "float64"]
_FACTOR_DTYPES: dict[str, FactorDtype] = {"float32": "float32", "float64": "float64"}

#: ``factor_matrix_dtype`` values stored below the working precision
#: (``factor_storage_dtype``, eq. 11b); the working precision is then float64.
_FACTOR_STORAGE_DTYPES: dict[str, FactorStorageDtype] = {
    "bfloat16": "bfloat16", "float16": "float16",
}

#: ``weight_decay_type`` (WeightDecayType member names; each value is its name).
WEIGHT_DECAY_TYPES = {name: name for name in ("L2", "DECOUPLED", "CORRECTED", "INDEPENDENT")}

#: How Meta's dtypes are spelled in JSON: ``"float32"`` or ``str(torch.float32)``.
TORCH = ("torch.",)


class Shared(NamedTuple):
    """The top-level values that more than one section reads."""

    lr: float
    beta1: float
    beta2: float
    beta3: float | None
    epsilon: float
    bias_correction: bool


class Preconditioner(NamedTuple):
    """The sections :func:`_preconditioner` returns."""

    statistics: StatisticsConfig
    epsilon: EpsilonConfig
    root_inverse: RootInverseConfig
    exponents: ExponentConfig
    eigenvalue_correction: EigenvalueCorrectionConfig | None
    diagonal: DiagonalPreconditionerConfig | None
    spectral: SpectralDescentConfig | None
    factor_dtype: FactorDtype
    inverse_root_dtype: InverseRootDtype | None
    factor_storage_dtype: FactorStorageDtype | None
    failure: FailureConfig


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
    ``eval_coeff_lr_power`` (2). None for anything else.
    """
    cfg = a.get("iterate_averaging_config", None)
    kind = type_of("iterate_averaging_config", cfg)
    if kind not in _AVERAGING_KEYS:
        return None
    m = Args("iterate_averaging_config", cfg, _AVERAGING_KEYS[kind])
    train = m.number("train_interp_coeff", 0.8)
    if kind == "GeneralizedPrimalAveragingConfig":
        return IterateAveragingConfig(type="gpa", train_interp=train,
                                      eval_interp=m.number("eval_interp_coeff", 0.9))
    return IterateAveragingConfig(type="schedule_free", train_interp=train,
                                  eval_lr_power=m.integer("eval_coeff_lr_power", 2, low=0))


def _distribution(a: Args, shard_local: bool = False) -> tuple[int | None, UpdateDtype | None]:
    """Reads ``distributed_config``, ``use_merge_dims``; returns the target rank
    and ``update_dtype``.

    Accepts the layouts whose numerics are single-device ones (none,
    SingleDevice, DDP, the lossless FSDP2 ones: :func:`_fully_shard`; dims
    merged), and, with ``shard_local``, only the FSDP2 ones with
    ``param_assignment_strategy`` DEFAULT (each rank's dim-0 piece a parameter
    of its own). FSDPDistributedConfig and HSDPDistributedConfig (each
    parameter's part of an FSDP1 flat-parameter shard split into rectangular
    pieces, Meta's split tensor block recovery) are refused.
    Returns ``target_parameter_dimensionality`` (default 1; None for inf:
    neither squeeze nor merge) and, for DDP and HybridShard,
    ``update_dtype`` (eq. 21a): :func:`_ddp_update_dtype`.
    """
    dist = a.get("distributed_config", None)
    kind = type_of("distributed_config", dist)
    if kind in _FULLY_SHARD_KEYS:
        update_dtype = _fully_shard(kind, dist, shard_local)
    elif shard_local:
        raise ValueError(
            f"shard_local = True is invalid with distributed_config.type = {kind!r}: it "
            "imports FullyShardDistributedConfig or HybridShardDistributedConfig with "
            "param_assignment_strategy DEFAULT (each rank's piece a parameter of its own)."
        )
    elif kind in (None, "SingleDeviceDistributedConfig", "DDPDistributedConfig"):
        update_dtype = _ddp_update_dtype(dist) if kind == "DDPDistributedConfig" else None
    else:
        raise NotImplementedError(
            f"distributed_config.type = {kind!r} is not supported yet (FSDP/HSDP block "
            "the rectangular pieces of FSDP1's flat-parameter shards; "
            "FullyShardDistributedConfig and HybridShardDistributedConfig are: "
            "REPLICATE or ROUND_ROBIN lossless, DEFAULT with shard_local=True)."
        )
    target = (dist or {}).get("target_parameter_dimensionality", 1)
    if not a.flag("use_merge_dims", True):
        raise NotImplementedError("use_merge_dims = False is not supported yet.")
    if (isinstance(target, str) and target.strip().lower() in _INF_NAMES) or (
        isinstance(target, float) and target == math.inf
    ):
        return None, update_dtype
    return (integer("distributed_config.target_parameter_dimensionality", target, low=1),
            update_dtype)


#: What Meta's ``distributed_config`` does with the parameters (:func:`meta_distribution`).
MetaDistribution = Literal["single_device", "ddp", "whole_parameters", "pieces"]


def meta_distribution(kwargs: Mapping[str, Any]) -> MetaDistribution:
    """How Meta's ``distributed_config`` in ``kwargs`` steps the parameters.

    ``"single_device"`` (none or SingleDeviceDistributedConfig), ``"ddp"``
    (DDPDistributedConfig), ``"whole_parameters"`` (FullyShard/HybridShard with
    REPLICATE or ROUND_ROBIN: each whole parameter gathered) and ``"pieces"``
    (FullyShard/HybridShard with DEFAULT, Meta's default: each rank's dim-0
    piece of a ``fully_shard`` parameter stepped as a parameter of its own,
    which :func:`from_meta` imports with ``shard_local=True``). The first three
    have single-device numerics. FSDPDistributedConfig and
    HSDPDistributedConfig raise ``NotImplementedError``, as in
    :func:`from_meta`, which validates the rest of the section.
    """
    dist = kwargs.get("distributed_config", None)
    kind = type_of("distributed_config", dist)
    if kind in (None, "SingleDeviceDistributedConfig"):
        return "single_device"
    if kind == "DDPDistributedConfig":
        return "ddp"
    if kind not in _FULLY_SHARD_KEYS:
        _distribution(Args("from_meta", {"distributed_config": dist}, KEYS))  # raises
    strategy = choice("distributed_config.param_assignment_strategy",
                      dist.get("param_assignment_strategy", "DEFAULT"),
                      PARAM_ASSIGNMENT_STRATEGIES, enum="FSDPParamAssignmentStrategy")
    return "pieces" if strategy == "DEFAULT" else "whole_parameters"


#: ``FSDPParamAssignmentStrategy`` (member names; each value is its name).
PARAM_ASSIGNMENT_STRATEGIES = {name: name for name in ("DEFAULT", "REPLICATE", "ROUND_ROBIN")}

_FULLY_SHARD = {"target_parameter_dimensionality", "param_assignment_strategy",
                "num_sub_groups", "load_balancing_config"}
#: Meta's FSDP2 (``fully_shard``) config classes and their keys; HybridShard's
#: also DDPDistributedConfig's (it subclasses both) and its ``device_mesh``.
_FULLY_SHARD_KEYS = {
    "FullyShardDistributedConfig": _FULLY_SHARD,
    "HybridShardDistributedConfig": _FULLY_SHARD | {
        "device_mesh", "communication_dtype", "num_trainers_per_group", "communicate_params"},
}


def _fully_shard(kind: str, dist: Mapping[str, Any], shard_local: bool = False,
                 ) -> UpdateDtype | None:
    """Reads ``FullyShardDistributedConfig`` / ``HybridShardDistributedConfig`` (every key).

    ``param_assignment_strategy`` (an ``FSDPParamAssignmentStrategy`` name,
    default DEFAULT): REPLICATE and ROUND_ROBIN select Meta's
    ``FullyShardLosslessDistributor`` / ``HybridShardLosslessDistributor``
    (distributed_shampoo.py ``_select_distributor_class``), which gather each
    whole parameter and its whole gradient (``full_tensor`` or all_to_all)
    onto its owner rank(s), block and precondition it as one device does,
    and copy the updated parameter back into the shards: single-device
    numerics. DEFAULT (``FullyShardDistributor``, ``HybridShardDistributor``)
    merges and blocks each rank's nonempty local piece (``p.to_local()``) as a
    parameter of its own and exchanges no parameters: the same config on the
    pieces, imported only with ``shard_local`` (and only DEFAULT is then);
    HybridShard's replicas split its blocks and all-gather the updates as
    DDP does, so the update is rounded as below. ``num_sub_groups``
    (an int >= 1; > 1 needs REPLICATE or ROUND_ROBIN, Meta's rule) splits
    the group into groups with the same settings (``split_param_groups``);
    Meta couples no blocks (per-block graft norms and root-failure counters,
    the step counted per group every step), so it only places work, as do
    ``load_balancing_config``, ``device_mesh`` and ``num_trainers_per_group``.
    FullyShard adds the update to the parameters unrounded (the single-device
    ``Distributor.update_params``): ``update_dtype`` None. HybridShard's
    lossless distributor spreads the blocks over the replicas and all-gathers
    the updates (or, with ``communicate_params``, the parameters) in
    ``communication_dtype`` as DDP does (shampoo_hybrid_shard_distributor.py
    ``update_params``, inherited): :func:`_ddp_update_dtype`.
    """
    d = Args("distributed_config", dist, _FULLY_SHARD_KEYS[kind])
    strategy = choice("distributed_config.param_assignment_strategy",
                      d.get("param_assignment_strategy", "DEFAULT"),
                      PARAM_ASSIGNMENT_STRATEGIES, enum="FSDPParamAssignmentStrategy")
    sub_groups = d.integer("num_sub_groups", 1, low=1)
    if strategy == "DEFAULT":
        if sub_groups > 1:
            raise ValueError(
                f"distributed_config.num_sub_groups = {sub_groups} is invalid with "
                "param_assignment_strategy = 'DEFAULT': num_sub_groups > 1 needs REPLICATE "
                "or ROUND_ROBIN (Meta's FullyShardDistributedConfig rule)."
            )
        if not shard_local:
            raise ValueError(
                f"distributed_config.param_assignment_strategy = 'DEFAULT' ({kind}) blocks "
                "each rank's piece of a parameter, not the parameter: import it with "
                "from_meta(kwargs, shard_local=True) and run it on the pieces "
                "(shampoo_torch.from_meta_distributed gives the config and "
                "DistributedConfig(shard_mode='local')); REPLICATE or ROUND_ROBIN have "
                "single-device numerics."
            )
    elif shard_local:
        raise ValueError(
            f"shard_local = True is invalid with distributed_config.param_assignment_strategy "
            f"= {strategy!r}: its distributor gathers whole parameters (single-device "
            "numerics); shard_local imports DEFAULT only."
        )
    if kind == "FullyShardDistributedConfig":
        return None
    if d.get("device_mesh", None) is None:
        raise ValueError(
            "distributed_config.device_mesh is missing: HybridShardDistributedConfig needs "
            "its 2-D device mesh (replicate, shard)."
        )
    trainers = d.integer("num_trainers_per_group", -1, low=-1)
    if trainers == 0:
        raise ValueError("distributed_config.num_trainers_per_group = 0 is invalid: "
                         "allowed -1 or an integer >= 1.")
    return _ddp_update_dtype(dist)


def _ddp_update_dtype(dist: Mapping[str, Any]) -> UpdateDtype | None:
    """Reads ``DDPDistributedConfig.communication_dtype`` (default float32) and
    ``communicate_params`` (default False); returns ``update_dtype`` (eq. 21a).
    HybridShardDistributedConfig's are the same fields, used the same way.

    Meta's DDP distributor copies each block's update ``-lr P`` into an
    all-gather buffer of ``communication_dtype`` (rounding it) and adds the
    gathered buffer to the parameters, on every rank, its own blocks
    included, at any world size (shampoo_ddp_distributor.py
    ``update_params`` and ``_construct_distributed_buffers``). float32,
    bfloat16, float16: that dtype (float32 changes nothing for float32
    parameters and rounds float64 ones, as Meta); float64: None (nothing
    is rounded). With ``communicate_params`` Meta gathers the updated
    parameters instead, so the parameters themselves are rounded: refused
    for bfloat16/float16 (no option says it); float32 and float64 import as
    None (no effect on float32 parameters).
    """
    comm = dtype("distributed_config.communication_dtype",
                 dist.get("communication_dtype", "float32"), TORCH)
    if boolean("distributed_config.communicate_params", dist.get("communicate_params", False)):
        if comm in ("bfloat16", "float16"):
            raise NotImplementedError(
                f"distributed_config.communication_dtype = {comm!r} with communicate_params = "
                "True is not supported yet (Meta rounds the parameters themselves to it)."
            )
        return None
    return None if comm == "float64" else _UPDATE_DTYPES[comm]


#: ``communication_dtype`` values that round the update (eq. 21a).
_UPDATE_DTYPES: dict[str, UpdateDtype] = {
    "float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
}


def _preconditioner(a: Args, shared: Shared) -> Preconditioner:
    """Reads ``preconditioner_config`` (its type and every key in it).

    Returns ``statistics`` (eqs. 6-7: beta2 = betas[1], zero start),
    ``epsilon`` (eq. 9, absolute; placement from the root method, eq. 10),
    ``root_inverse`` (eqs. 10-11, :func:`_root_inverse`), ``exponents``
    (eq. 12, :func:`_exponents`), ``eigenvalue_correction`` (eq. 17, for
    ``EigenvalueCorrectedShampooPreconditionerConfig``), ``factor_dtype``,
    ``inverse_root_dtype`` (eqs. 11a, 16, :func:`_storage_dtype`),
    ``factor_storage_dtype`` (eq. 11b: a bfloat16 or float16
    ``factor_matrix_dtype``, with ``factor_dtype`` float64, the precision of
    Meta's eigendecomposition, which retries in float64) and
    ``failure`` (eq. 13, ``num_tolerated_failed_amortized_computations``).
    """
    pc = a.get("preconditioner_config", None)
    kind = type_of("preconditioner_config", pc) or "RootInvShampooPreconditionerConfig"
    # KL-Shampoo (eq. 6b): RootInv's or Eigendecomposed's preconditioner, its factors
    # from the gradient preconditioned on the other dims.
    kl = kind in _KL_CLASSES
    kind = _KL_CLASSES.get(kind, kind)
    diagonal = spectral = None
    if kind in DIAGONAL_PRECONDITIONERS or kind == "SpectralDescentPreconditionerConfig":
        # Eqs. (16b), (16c): no Kronecker factors; the shared values (betas[1],
        # epsilon, use_bias_correction) are read as for the default RootInv config,
        # where they have no effect, so the export writes them back unchanged.
        if kind == "SpectralDescentPreconditionerConfig":
            spectral = _spectral(pc)
        else:
            diagonal = _diagonal(kind, pc)
        pc, kind = None, "RootInvShampooPreconditionerConfig"
    p = Args("preconditioner_config", pc or {}, PRECONDITIONER_KEYS)
    trace_scaling = p.flag("use_trace_scaling", False)
    tau = p.number("trace_scaling_exponent", 0.5)
    if trace_scaling and not 0.0 < tau <= 1.0:
        raise ValueError(
            f"preconditioner_config.trace_scaling_exponent = {tau!r} is invalid: allowed a "
            "number in (0, 1] with use_trace_scaling = True."
        )
    drop_weight = p.flag("drop_weighting_factor_on_gsquare", False)
    amortized = p.get("amortized_computation_config", None)
    eigendecomposed = kind == "EigendecomposedShampooPreconditionerConfig"
    if eigendecomposed:
        amortized = _eigendecomposition(amortized)
        stab = amortized.get("rank_deficient_stability_config") or {}
        if kl and stab.get("perturb_before_computation", True) is False:
            raise NotImplementedError(
                "preconditioner_config.amortized_computation_config."
                "rank_deficient_stability_config.perturb_before_computation = False with "
                "EigendecomposedKLShampooPreconditionerConfig is not supported yet (before "
                "the first root step Meta's stored eigenvalues are 1, whose root with epsilon "
                "after is (1 + epsilon)^(-1/r) I, not the identity eq. (6b) preconditions "
                "the statistics with)."
            )
    root_inverse, rule, basis = _root_inverse(
        amortized, corrected=kind == "EigenvalueCorrectedShampooPreconditionerConfig",
        eigendecomposed=eigendecomposed,
    )
    placement = rule["placement"]
    if (placement == "pseudo_inverse") != (shared.epsilon == 0):
        raise ValueError(
            f"epsilon = {shared.epsilon!r} is invalid: allowed "
            + ("0.0 with rank_deficient_stability_config PseudoInverseConfig (Meta's rule)."
               if placement == "pseudo_inverse" else
               "a number > 0 (0 only with PseudoInverseConfig).")
        )
    correction = None
    if kind == "RootInvShampooPreconditionerConfig" or eigendecomposed:
        p.unsupported("ignored_basis_change_dims", {}, "only for eigenvalue-corrected Shampoo")
        exponents = _exponents(p.get("inverse_exponent_override", {}))
    elif kind == "EigenvalueCorrectedShampooPreconditionerConfig":
        correction = dataclasses.replace(
            _eigenvalue_correction(p, shared, root_inverse, placement, drop_weight),
            **basis,
        )
        exponents = _exponents({}, p.get("ignored_basis_change_dims", {}))
    else:
        known = sorted({"RootInvShampooPreconditionerConfig",
                        "EigendecomposedShampooPreconditionerConfig",
                        "EigenvalueCorrectedShampooPreconditionerConfig",
                        "SpectralDescentPreconditionerConfig",
                        *_KL_CLASSES, *DIAGONAL_PRECONDITIONERS})
        raise NotImplementedError(f"preconditioner_config.type = {kind!r} is not supported "
                                  f"(Meta's classes at f606606: {', '.join(known)}).")
    factor_dtype = dtype(
        "preconditioner_config.factor_matrix_dtype", p.get("factor_matrix_dtype", "float32"), TORCH
    )
    storage = _FACTOR_STORAGE_DTYPES.get(factor_dtype)
    if storage is not None:
        # Eq. (11b): factors stored in s, the rest in float64 (Meta's eigh retry).
        if correction is not None or eigendecomposed:
            raise NotImplementedError(
                f"preconditioner_config.factor_matrix_dtype = {factor_dtype!r} with "
                f"{kind} is not supported yet (factors in bfloat16 or float16 are "
                "specified for RootInvShampooPreconditionerConfig, eq. 11b)."
            )
        # Eq. (11b) takes the root's upper triangle, as Meta's packed storage does.
        packed = p.flag("use_symmetric_packing", True)
        unsupported = (
            "use_trace_scaling" if trace_scaling
            else "use_symmetric_packing" if not packed
            else "amortized_computation_config" if not isinstance(root_inverse, EighConfig)
            or placement == "pseudo_inverse" else None
        )
        if unsupported is not None:
            raise NotImplementedError(
                f"preconditioner_config.factor_matrix_dtype = {factor_dtype!r} with "
                f"preconditioner_config.{unsupported} = {p.data[unsupported]!r} is not supported "
                "yet (factors in bfloat16 or float16 with EigenConfig's perturbation roots, "
                "no trace scaling and symmetric packing, eq. 11b)."
            )
        factor_dtype = "float64"
    elif factor_dtype not in _FACTOR_DTYPES:
        raise NotImplementedError(
            f"preconditioner_config.factor_matrix_dtype = {factor_dtype!r} is not supported yet "
            "(factors in float64, float32, bfloat16 or float16)."
        )
    inverse_root_dtype = _storage_dtype(p, kind, "inv_factor_matrix_dtype", factor_dtype)
    if kl and inverse_root_dtype is not None:
        raise NotImplementedError(
            f"preconditioner_config.inv_factor_matrix_dtype = "
            f"{p.data.get('inv_factor_matrix_dtype', 'float32')!r} with factor_matrix_dtype "
            f"{factor_dtype!r} and KL-Shampoo is not supported yet (eq. 6b is specified with "
            "the roots in the factor dtype: set inv_factor_matrix_dtype to factor_matrix_dtype)."
        )
    if correction is not None:
        correction = dataclasses.replace(
            correction,
            eigenvectors_dtype=_storage_dtype(p, kind, "factor_matrix_eigenvectors_dtype",
                                              factor_dtype),
            corrected_eigenvalues_dtype=_storage_dtype(p, kind, "corrected_eigenvalues_dtype",
                                                       factor_dtype),
        )
    elif eigendecomposed:
        _storage_dtype(p, kind, "corrected_eigenvalues_dtype", factor_dtype)
        _eigendecomposition_dtypes(p, factor_dtype)
    else:
        for key in ("factor_matrix_eigenvectors_dtype", "corrected_eigenvalues_dtype"):
            _storage_dtype(p, kind, key, factor_dtype)
    if "factor_matrix_eigenvalues_dtype" in p and not eigendecomposed:
        raise ValueError(
            f"preconditioner_config.factor_matrix_eigenvalues_dtype = "
            f"{p.data['factor_matrix_eigenvalues_dtype']!r} is invalid: allowed only with "
            f"EigendecomposedShampooPreconditionerConfig ({kind} has no such field)."
        )
    tolerated = p.integer("num_tolerated_failed_amortized_computations", 3, low=0)
    return Preconditioner(
        statistics=StatisticsConfig(
            beta2=shared.beta2, initial_value="zero",
            # drop_weighting_factor_on_gsquare: L <- beta2 L + G G^T (eq. 6's weight 1),
            # and Meta then leaves the factors' bias correction at 1 (not an EMA).
            bias_correction=shared.bias_correction and not drop_weight,
            ema_weight="one" if drop_weight else "one_minus_beta2",
            trace_scaling_exponent=tau if trace_scaling else 0.0,  # eq. (7b)
            kl=kl,  # eq. (6b)
        ),
        epsilon=EpsilonConfig(value=shared.epsilon, scale="absolute", **rule),
        root_inverse=root_inverse,
        exponents=exponents,
        eigenvalue_correction=correction,
        diagonal=diagonal,
        spectral=spectral,
        factor_dtype=_FACTOR_DTYPES[factor_dtype],
        inverse_root_dtype=inverse_root_dtype,
        factor_storage_dtype=storage,
        failure=FailureConfig(nonfinite_gradient="raise", max_consecutive_root_failures=tolerated),
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


#: The largest block order an override may name: no tensor has more dims
#: (NumPy's limit), and a scalar exponent expands to ``order`` roots.
MAX_ORDER = 64

_OVERRIDE = "preconditioner_config.inverse_exponent_override"
_IGNORED = "preconditioner_config.ignored_basis_change_dims"


def _int_key(owner: str, key: Any, *, high: int) -> int:
    """A JSON object key naming an order or a dim: an int, or a string of digits."""
    if isinstance(key, str) and key.strip().isdigit() and len(key) <= 20:
        key = int(key)
    return integer(f"{owner} key", key, low=0, high=high)


def _by_int_key(owner: str, data: Any, what: str, *, high: int) -> dict[int, Any]:
    """``data`` (a JSON object) with its keys read by :func:`_int_key`; duplicates refused."""
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{owner} = {data!r} is invalid: allowed an object mapping {what}.")
    out: dict[int, Any] = {}
    for key, value in data.items():
        k = _int_key(owner, key, high=high)
        if k in out:
            raise ValueError(f"{owner} names {k} twice (as {key!r} and another key).")
        out[k] = value
    return out


def _exponent(owner: str, value: Any, *, zero_ok: bool) -> float:
    """A Meta exponent e (root 1/e): finite, > 0, or 0 (= not preconditioned) when allowed."""
    e = number(owner, value)
    allowed = "an exponent >= 0 (0: not preconditioned)" if zero_ok else "an exponent > 0"
    if e < 0 or (e == 0 and not zero_ok) or (e != 0 and not math.isfinite(1.0 / e)):
        raise ValueError(f"{owner} = {value!r} is invalid: allowed {allowed} with 1/e finite.")
    return e


def _exponents(overrides: Any, ignored: Any = None) -> ExponentConfig:
    """Reads ``inverse_exponent_override`` and ``ignored_basis_change_dims``.

    Returns ``exponents`` (eq. 12): Meta's override maps order -> exponent e
    (or {dim: e}), root = 1/e, e = 0 -> root 0 (not preconditioned); an
    ignored dim gets root 0. Order 0 is skipped (0-d blocks only exist with
    ``target_parameter_dimensionality`` = inf). Orders and dims are integers
    (JSON keys: strings of digits), orders at most :data:`MAX_ORDER`.
    """
    if overrides in (None, {}) and ignored in (None, {}):
        return ExponentConfig()
    by_order = _by_int_key(
        _OVERRIDE, overrides, "order -> exponent or order -> {dim: exponent}", high=MAX_ORDER
    )
    skipped = _by_int_key(_IGNORED, ignored, "order -> [dim, ...]", high=MAX_ORDER)
    items: list[OrderOverride] = []
    for order in sorted(set(by_order) | set(skipped)):
        if order == 0:
            continue
        value = by_order.get(order, {})
        path = f"{_OVERRIDE}.{order}"
        default = 1.0 / (2.0 * order)
        if isinstance(value, Mapping):
            per_dim = {
                d: _exponent(f"{path}.{d}", e, zero_ok=True)
                for d, e in _by_int_key(path, value, "dim -> exponent", high=MAX_ORDER).items()
            }
            exps = [per_dim.get(d, default) for d in range(order)]
        else:
            exps = [_exponent(path, value, zero_ok=True)] * order
        dims = skipped.get(order, [])
        if not isinstance(dims, (list, tuple)):
            raise ValueError(
                f"{_IGNORED}.{order} = {dims!r} is invalid: allowed a list of dims."
            )
        skip = {integer(f"{_IGNORED}.{order}[]", d, low=0, high=MAX_ORDER) for d in dims}
        roots = tuple(0.0 if (e == 0 or d in skip) else 1.0 / e for d, e in enumerate(exps))
        items.append(OrderOverride(order=order, roots=roots))
    return ExponentConfig(overrides_by_order=tuple(items))


def _eigenvalue_correction(
    p: Args, shared: Shared, root_inverse: RootInverseConfig, placement: Placement,
    drop_weight: bool = False,
) -> EigenvalueCorrectionConfig:
    """Reads ``inverse_exponent_override`` of ``EigenvalueCorrectedShampooPreconditionerConfig``.

    Returns ``eigenvalue_correction`` (eq. 17): beta2 = betas[1], epsilon,
    bias correction = use_bias_correction. ``drop_weight``
    (``drop_weighting_factor_on_gsquare``): Meta also weighs the corrected
    eigenvalues' update by 1 (``ema_weight="one"``) and leaves their bias
    correction at 1, as the factors' (shampoo_preconditioner_list.py,
    ``update_preconditioners``: one ``_bias_correction2`` and one
    ``_weighting_factor`` for both). An order o the override maps to
    e > 0 gets root 1/e, every other order Meta's exponent 1/2 (root 2).
    Canonical form: a map naming every order 1..MAX_ORDER sets ``root`` from
    order MAX_ORDER; ``roots_by_order`` lists the orders whose root differs
    from ``root``. Needs eigh roots with the ridge placement.
    """
    if not isinstance(root_inverse, EighConfig) or placement != "ridge":
        raise NotImplementedError(
            "preconditioner_config.amortized_computation_config: eigenvalue-corrected "
            "Shampoo is supported with EighEigendecompositionConfig only."
        )
    overrides = _by_int_key(
        _OVERRIDE, p.get("inverse_exponent_override", {}), "order -> exponent", high=MAX_ORDER
    )
    roots = {
        order: 1.0 / _exponent(f"{_OVERRIDE}.{order}", e, zero_ok=False)
        for order, e in overrides.items()
    }
    every_order = set(roots) >= set(range(1, MAX_ORDER + 1))
    root = roots[MAX_ORDER] if every_order else 2.0
    return EigenvalueCorrectionConfig(
        beta2=shared.beta2,
        ema_weight="one" if drop_weight else "one_minus_beta2",
        epsilon=shared.epsilon,
        bias_correction=shared.bias_correction and not drop_weight,
        root=root,
        roots_by_order=tuple(sorted((o, r) for o, r in roots.items() if r != root)),
    )


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


def _diagonal(kind: str, cfg: Any) -> DiagonalPreconditionerConfig:
    """Reads a diagonal ``preconditioner_config`` (eq. 16b).

    SGD, AdaGrad, RMSprop and Adam read as the graft of that class
    (:func:`_grafting`: the same class, keys, defaults and rules);
    ``SignDescentPreconditionerConfig`` with its default ``scale_fn``
    (1: the direction is sign(F~)). A ``scale_fn`` is a Python function, not
    JSON: any value of it is refused.
    """
    if kind == "SignDescentPreconditionerConfig":
        args = Args("preconditioner_config", cfg, {"scale_fn"})
        if "scale_fn" in args:
            raise NotImplementedError(
                f"preconditioner_config.scale_fn = {args.data['scale_fn']!r} is not supported "
                "(a function; only SignDescentPreconditionerConfig's default scale 1 is, "
                "eq. 16b)."
            )
        return DiagonalPreconditionerConfig(type="sign")
    g = _grafting(cfg, "preconditioner_config")
    return DiagonalPreconditionerConfig(
        type=cast(DiagonalType, g.type), beta2=g.beta2, ema_weight=g.ema_weight,
        epsilon=g.epsilon, bias_correction=g.bias_correction,
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


#: The keys of each of Meta's orthogonalization configs (eq. 16c).
_ORTHOGONALIZATION_KEYS = {
    "NewtonSchulzOrthogonalizationConfig": {"num_iterations", "coefficients",
                                            "scale_by_dims_fn"},
    "SVDOrthogonalizationConfig": {"scale_by_nuclear_norm", "scale_by_dims_fn"},
}


def _spectral(cfg: Any) -> SpectralDescentConfig:
    """Reads ``SpectralDescentPreconditionerConfig`` (eq. 16c).

    Its ``orthogonalization_config``: ``NewtonSchulzOrthogonalizationConfig``
    (the default: 5 iterations, Muon's coefficients) or
    ``SVDOrthogonalizationConfig`` (``scale_by_nuclear_norm``). A
    ``scale_by_dims_fn`` is a Python function, not JSON: any value of it is
    refused (the default scale is 1).
    """
    args = Args("preconditioner_config", cfg, {"orthogonalization_config"})
    owner = "preconditioner_config.orthogonalization_config"
    oc = args.get("orthogonalization_config", None)
    kind = type_of(owner, oc) or "NewtonSchulzOrthogonalizationConfig"
    if kind not in _ORTHOGONALIZATION_KEYS:
        raise NotImplementedError(f"{owner}.type = {kind!r} is not supported yet "
                                  f"(allowed {sorted(_ORTHOGONALIZATION_KEYS)}).")
    o = Args(owner, oc or {}, _ORTHOGONALIZATION_KEYS[kind])
    if "scale_by_dims_fn" in o:
        raise NotImplementedError(
            f"{owner}.scale_by_dims_fn = {o.data['scale_by_dims_fn']!r} is not supported (a "
            "function; only the default scale 1 is, eq. 16c)."
        )
    if kind == "SVDOrthogonalizationConfig":
        return SpectralDescentConfig(
            method="svd", scale_by_nuclear_norm=o.flag("scale_by_nuclear_norm", False))
    coefficients = o.get("coefficients", list(MUON_COEFFICIENTS))
    if not isinstance(coefficients, (list, tuple)) or len(coefficients) != 3:
        raise ValueError(f"{owner}.coefficients = {coefficients!r} is invalid: allowed three "
                         "numbers [a, b, c].")
    a, b, c = (number(f"{owner}.coefficients[{i}]", x) for i, x in enumerate(coefficients))
    return SpectralDescentConfig(
        method="newton_schulz", num_iterations=o.integer("num_iterations", 5, low=0),
        coefficients=(a, b, c))


def _grafting(cfg: Any, owner: str = "grafting_config") -> GraftingConfig:
    """Reads ``grafting_config`` (null or a Meta preconditioner config).

    Returns ``grafting`` (eqs. 14, 18; per-block norms with 1e-16): SGD;
    AdaGrad (eps 1e-10); RMSprop (beta2 0.99, eps 1e-10); Adam (beta2 0.999,
    eps 1e-10, bias-corrected); null -> none. RMSprop's and Adam's
    ``drop_weighting_factor_on_gsquare``: ``V <- beta2 V + G^2`` (eq. 14b's
    ``grafting.ema_weight="one"``), never bias-corrected (Meta then drops
    Adam's correction too).
    """
    kind = type_of(owner, cfg)
    if kind is None:
        return GraftingConfig(type="none")
    args = Args(owner, cfg, {"epsilon", "beta2", "drop_weighting_factor_on_gsquare"})
    if kind == "SGDPreconditionerConfig":
        return GraftingConfig(type="sgd")
    if kind == "AdaGradPreconditionerConfig":
        return GraftingConfig(type="adagrad", epsilon=args.number("epsilon", 1e-10))
    if kind in ("RMSpropPreconditionerConfig", "AdamPreconditionerConfig"):
        adam = kind == "AdamPreconditionerConfig"
        drop_weight = args.flag("drop_weighting_factor_on_gsquare", False)
        return GraftingConfig(
            type="adam" if adam else "rmsprop",
            beta2=args.number("beta2", 0.999 if adam else 0.99),
            ema_weight="one" if drop_weight else "one_minus_beta2",
            epsilon=args.number("epsilon", 1e-10),
            bias_correction=adam and not drop_weight,
        )
    raise NotImplementedError(f"{owner}.type = {kind!r} is not supported yet.")


def _gradient_filter(shared: Shared) -> GradientFilterConfig:
    """From ``betas[0]``, ``beta3``, ``use_bias_correction`` (read by :func:`_shared`).

    Returns ``gradient_filter`` (eq. 15): betas[0] filters the gradient (it is
    not momentum), beta3 weighs the direction, bias-corrected with the factors.
    """
    return GradientFilterConfig(
        beta1=shared.beta1, beta3=shared.beta3, bias_correction=shared.bias_correction
    )
