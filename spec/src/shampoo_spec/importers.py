"""Import the anchors' arguments into a :class:`ShampooConfig` (contract 8.1).

``from_meta(kwargs)`` takes the keyword arguments of Meta's
``DistributedShampoo(...)`` in JSON form; ``from_google(kwargs)`` those of
Google's ``distributed_shampoo(...)``. Missing keys take that library's
defaults, and running the result reproduces that library's numerics (Meta:
single device; Google: the non-sharded path). Options we do not implement
raise ``NotImplementedError`` naming the key; malformed values raise
``ValueError``. docs/spec.md section 4 tabulates every mapping.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .config import (
    BlockingConfig,
    CoupledNewtonConfig,
    EigenvalueCorrectionConfig,
    EighConfig,
    EpsilonConfig,
    ExponentConfig,
    FailureConfig,
    GradientFilterConfig,
    GraftingConfig,
    MomentumConfig,
    OrderOverride,
    RootInverseConfig,
    ScheduleConfig,
    ShampooConfig,
    StatisticsConfig,
    WeightDecayConfig,
)

#: Stand-in for an unbounded dim (``math.inf``): larger than any tensor dim.
UNBOUNDED = 2**62


class _Args:
    """Reads a kwargs dict, tracking unknown and unsupported keys."""

    def __init__(self, owner: str, data: Any, known: set[str]) -> None:
        if not isinstance(data, Mapping):
            raise ValueError(f"{owner} = {data!r} is invalid: allowed a JSON object (dict).")
        self.owner = owner
        self.data = dict(data)
        unknown = sorted(set(self.data) - known - {"type"})
        if unknown:
            raise ValueError(
                f"{owner} has unknown key(s) {unknown}: allowed keys are {sorted(known)}."
            )

    def get(self, key: str, default: Any) -> Any:
        return self.data.get(key, default)

    def unsupported(self, key: str, ok: Any, what: str) -> None:
        """Raise NotImplementedError when ``key`` is present with a value other than ``ok``."""
        if key in self.data and self.data[key] != ok and self.data[key] is not None:
            raise NotImplementedError(
                f"{self.owner}.{key} = {self.data[key]!r} is not supported yet ({what})."
            )


def _type_of(owner: str, cfg: Any) -> str | None:
    if cfg is None:
        return None
    if not isinstance(cfg, Mapping) or not isinstance(cfg.get("type"), str):
        raise ValueError(
            f"{owner} = {cfg!r} is invalid: allowed null or an object with a 'type' key "
            "naming the Meta config class."
        )
    return str(cfg["type"])


def _number(owner: str, value: Any) -> float:
    if isinstance(value, str) and value.lower() in ("inf", "infinity", "math.inf"):
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{owner} = {value!r} is invalid: allowed a number.")
    return float(value)


def _dim_limit(owner: str, value: Any) -> int:
    x = _number(owner, value)
    if x == math.inf:
        return UNBOUNDED
    if not x.is_integer() or x < 1:
        raise ValueError(f"{owner} = {value!r} is invalid: allowed an integer >= 1 or inf.")
    return int(x)


# --------------------------------------------------------------------- Meta
_META_KEYS = {
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
}

_META_UNSUPPORTED_PRECONDITIONERS = {
    "EigendecomposedShampooPreconditionerConfig": "eigendecomposed Shampoo",
    "KLShampooPreconditionerConfig": "KL-Shampoo",
    "SignDescentPreconditionerConfig": "sign descent",
    "SpectralDescentPreconditionerConfig": "spectral descent",
    "SGDPreconditionerConfig": "SGD as the preconditioner",
    "AdaGradPreconditionerConfig": "AdaGrad as the preconditioner",
    "RMSpropPreconditionerConfig": "RMSprop as the preconditioner",
    "AdamPreconditionerConfig": "Adam as the preconditioner",
}


def _meta_grafting(cfg: Any) -> GraftingConfig:
    kind = _type_of("grafting_config", cfg)
    if kind is None:
        return GraftingConfig(type="none")
    args = _Args(
        "grafting_config", cfg, {"epsilon", "beta2", "drop_weighting_factor_on_gsquare"}
    )
    args.unsupported("drop_weighting_factor_on_gsquare", False, "graft EMA without 1 - beta2")
    if kind == "SGDPreconditionerConfig":
        return GraftingConfig(type="sgd")
    if kind == "AdaGradPreconditionerConfig":
        epsilon = _number("epsilon", args.get("epsilon", 1e-10))
        return GraftingConfig(type="adagrad", epsilon=epsilon)
    if kind in ("RMSpropPreconditionerConfig", "AdamPreconditionerConfig"):
        adam = kind == "AdamPreconditionerConfig"
        return GraftingConfig(
            type="adam" if adam else "rmsprop",
            beta2=_number("beta2", args.get("beta2", 0.999 if adam else 0.99)),
            epsilon=_number("epsilon", args.get("epsilon", 1e-10)),
            bias_correction=adam,
        )
    raise NotImplementedError(f"grafting_config.type = {kind!r} is not supported yet.")


def _meta_exponents(
    overrides: Any, ignored: Any = None
) -> ExponentConfig:
    """Meta's inverse_exponent_override maps order -> exponent e (or {dim: e}); root = 1/e."""
    if overrides in (None, {}) and ignored in (None, {}):
        return ExponentConfig()
    if not isinstance(overrides or {}, Mapping):
        raise ValueError(
            f"inverse_exponent_override = {overrides!r} is invalid: allowed an object "
            "mapping order -> exponent or order -> {dim: exponent}."
        )
    items: list[OrderOverride] = []
    orders = {int(k) for k in (overrides or {})} | {int(k) for k in (ignored or {})}
    for order in sorted(orders):
        if order == 0:
            continue  # 0-d blocks only exist with target_parameter_dimensionality = inf.
        value = (overrides or {}).get(order, (overrides or {}).get(str(order), {}))
        default = 1.0 / (2.0 * order)
        if isinstance(value, Mapping):
            per_dim = {int(k): _number("inverse_exponent_override", e) for k, e in value.items()}
            exps = [per_dim.get(d, default) for d in range(order)]
        else:
            exps = [_number("inverse_exponent_override", value)] * order
        skip = set((ignored or {}).get(order, (ignored or {}).get(str(order), [])))
        roots = tuple(0.0 if (e == 0 or d in skip) else 1.0 / e for d, e in enumerate(exps))
        items.append(OrderOverride(order=order, roots=roots))
    return ExponentConfig(overrides_by_order=tuple(items))


def _meta_root(cfg: Any) -> tuple[RootInverseConfig, str]:
    kind = _type_of("amortized_computation_config", cfg) or "EigenConfig"
    args = _Args(
        "amortized_computation_config",
        cfg or {},
        {
            "max_iterations",
            "tolerance",
            "rank_deficient_stability_config",
            "retry_double_precision",
            "exponent_multiplier",
            "enhance_stability",
        },
    )
    if kind in ("EigenConfig", "EighEigendecompositionConfig"):
        args.unsupported("tolerance", 0.0, "eigenbasis reuse by an off-diagonal criterion")
        stab = args.get("rank_deficient_stability_config", None)
        stab_kind = _type_of("rank_deficient_stability_config", stab) or "PerturbationConfig"
        if stab_kind != "PerturbationConfig":
            raise NotImplementedError(
                f"rank_deficient_stability_config.type = {stab_kind!r} is not supported yet "
                "(pseudo-inverse roots)."
            )
        before = bool((stab or {}).get("perturb_before_computation", True))
        return EighConfig(), ("ridge" if before else "shift_after")
    if kind == "CoupledNewtonConfig":
        return (
            CoupledNewtonConfig(
                max_iterations=int(args.get("max_iterations", 100)),
                tolerance=_number("tolerance", args.get("tolerance", 1e-6)),
            ),
            "ridge",
        )
    raise NotImplementedError(
        f"amortized_computation_config.type = {kind!r} is not supported yet "
        "(supported: EigenConfig, CoupledNewtonConfig)."
    )


def from_meta(kwargs: Mapping[str, Any]) -> ShampooConfig:
    """Config equal to Meta's ``DistributedShampoo(**kwargs)`` on a single device.

    Rules settled from Meta's source (docs/spec.md section 4.1): merging to
    one dim from the last while the product <= max_preconditioner_dim,
    root 2 * (merged block order), override values are exponents (root =
    1/e, 0 = not preconditioned), roots at t = start and t % f == 0 after it,
    per-block graft norm with 1e-16, one ``use_bias_correction`` for the
    filter and the factors, zero-initialised momentum, decoupled decay added
    to the direction before momentum. CORRECTED and INDEPENDENT decay are
    imported for a constant learning rate (lr = peak_lr).
    """
    a = _Args("from_meta", kwargs, _META_KEYS)
    lr = _number("lr", a.get("lr", 1e-2))
    betas = a.get("betas", (0.9, 1.0))
    if not isinstance(betas, (list, tuple)) or len(betas) != 2:
        raise ValueError(f"betas = {betas!r} is invalid: allowed a pair [beta1, beta2].")
    beta1, beta2 = _number("betas[0]", betas[0]), _number("betas[1]", betas[1])
    beta3_raw = _number("beta3", a.get("beta3", -1.0))
    beta3 = None if beta3_raw == -1.0 else beta3_raw
    eps = _number("epsilon", a.get("epsilon", 1e-12))
    if eps <= 0:
        raise ValueError(f"epsilon = {eps!r} is invalid: allowed a number > 0.")
    bias = bool(a.get("use_bias_correction", True))

    # Weight decay: new enum, or the legacy boolean.
    wd = _number("weight_decay", a.get("weight_decay", 0.0))
    if "weight_decay_type" in a.data:
        wd_type = a.get("weight_decay_type", "DECOUPLED")
    else:
        wd_type = "DECOUPLED" if a.get("use_decoupled_weight_decay", True) else "L2"
    if wd_type == "L2":
        weight_decay = WeightDecayConfig(value=wd, type="l2")
    elif wd_type in ("DECOUPLED", "CORRECTED"):
        weight_decay = WeightDecayConfig(value=wd, type="direction")
    elif wd_type == "INDEPENDENT":
        if lr <= 0:
            raise ValueError("weight_decay_type = 'INDEPENDENT' needs lr > 0 (it divides by lr).")
        weight_decay = WeightDecayConfig(value=wd / lr, type="direction")
    else:
        raise ValueError(
            f"weight_decay_type = {wd_type!r} is invalid: allowed one of "
            "'L2', 'DECOUPLED', 'CORRECTED', 'INDEPENDENT'."
        )

    # Momentum: ClassicMomentumConfig, or the legacy momentum/dampening/use_nesterov.
    averaging = a.get("iterate_averaging_config", None)
    avg_kind = _type_of("iterate_averaging_config", averaging)
    if avg_kind is None:
        momentum = MomentumConfig(
            momentum=_number("momentum", a.get("momentum", 0.0)),
            dampening=_number("dampening", a.get("dampening", 0.0)),
            nesterov=bool(a.get("use_nesterov", False)),
        )
    elif avg_kind == "ClassicMomentumConfig":
        m = _Args("iterate_averaging_config", averaging, {"momentum", "dampening", "use_nesterov"})
        mu = _number("momentum", m.get("momentum", 0.5))
        if not 0 < mu < 1:
            raise ValueError(
                f"iterate_averaging_config.momentum = {mu!r} is invalid: allowed (0, 1)."
            )
        momentum = MomentumConfig(
            momentum=mu,
            dampening=_number("dampening", m.get("dampening", 0.0)),
            nesterov=bool(m.get("use_nesterov", False)),
        )
    else:
        raise NotImplementedError(
            f"iterate_averaging_config.type = {avg_kind!r} is not supported yet "
            "(GPA and Schedule-Free)."
        )

    # Distribution: only layouts with single-device numerics.
    dist = a.get("distributed_config", None)
    dist_kind = _type_of("distributed_config", dist)
    if dist_kind not in (None, "SingleDeviceDistributedConfig", "DDPDistributedConfig"):
        raise NotImplementedError(
            f"distributed_config.type = {dist_kind!r} is not supported yet (FSDP/HSDP "
            "block by shard)."
        )
    target = (dist or {}).get("target_parameter_dimensionality", 1)
    if target != 1:
        raise NotImplementedError(
            f"distributed_config.target_parameter_dimensionality = {target!r} is not "
            "supported yet (only 1)."
        )
    if a.get("use_merge_dims", True) is not True:
        raise NotImplementedError("use_merge_dims = False is not supported yet.")

    # Preconditioner.
    pc = a.get("preconditioner_config", None)
    pc_kind = _type_of("preconditioner_config", pc) or "RootInvShampooPreconditionerConfig"
    if pc_kind in _META_UNSUPPORTED_PRECONDITIONERS:
        raise NotImplementedError(
            f"preconditioner_config.type = {pc_kind!r} is not supported yet "
            f"({_META_UNSUPPORTED_PRECONDITIONERS[pc_kind]})."
        )
    p = _Args(
        "preconditioner_config",
        pc or {},
        {
            "amortized_computation_config",
            "num_tolerated_failed_amortized_computations",
            "factor_matrix_dtype",
            "inv_factor_matrix_dtype",
            "corrected_eigenvalues_dtype",
            "inverse_exponent_override",
            "ignored_basis_change_dims",
            "use_symmetric_packing",
            "use_trace_scaling",
            "trace_scaling_exponent",
            "drop_weighting_factor_on_gsquare",
        },
    )
    p.unsupported("use_trace_scaling", False, "trace scaling of the factors")
    p.unsupported("drop_weighting_factor_on_gsquare", False, "factor EMA without 1 - beta2")
    root_inverse, placement = _meta_root(p.get("amortized_computation_config", None))
    correction = None
    if pc_kind == "RootInvShampooPreconditionerConfig":
        p.unsupported("ignored_basis_change_dims", {}, "only for eigenvalue-corrected Shampoo")
        exponents = _meta_exponents(p.get("inverse_exponent_override", {}))
    elif pc_kind == "EigenvalueCorrectedShampooPreconditionerConfig":
        if not isinstance(root_inverse, EighConfig) or placement != "ridge":
            raise NotImplementedError(
                "preconditioner_config.amortized_computation_config: eigenvalue-corrected "
                "Shampoo is supported with EighEigendecompositionConfig only."
            )
        overrides = p.get("inverse_exponent_override", {}) or {}
        exps = {_number("inverse_exponent_override", e) for e in overrides.values()}
        if len(exps) > 1:
            raise NotImplementedError(
                "preconditioner_config.inverse_exponent_override with different exponents "
                "per order is not supported yet for eigenvalue-corrected Shampoo."
            )
        exponent = exps.pop() if exps else 0.5
        correction = EigenvalueCorrectionConfig(
            beta2=beta2, epsilon=eps, bias_correction=bias, root=1.0 / exponent
        )
        exponents = _meta_exponents({}, p.get("ignored_basis_change_dims", {}))
    else:
        raise NotImplementedError(f"preconditioner_config.type = {pc_kind!r} is not supported.")
    dtype = str(p.get("factor_matrix_dtype", "float32")).replace("torch.", "")
    if dtype not in ("float32", "float64"):
        raise NotImplementedError(f"preconditioner_config.factor_matrix_dtype = {dtype!r}.")

    freq = int(_number("precondition_frequency", a.get("precondition_frequency", 1)))
    start = int(_number("start_preconditioning_step", a.get("start_preconditioning_step", -1)))
    if start == -1:
        start = freq
    if start < freq:
        raise ValueError(
            f"start_preconditioning_step = {start} is invalid: allowed -1 or an integer >= "
            f"precondition_frequency ({freq})."
        )
    mpd = _dim_limit("max_preconditioner_dim", a.get("max_preconditioner_dim", 1024))
    tolerated = int(
        _number(
            "num_tolerated_failed_amortized_computations",
            p.get("num_tolerated_failed_amortized_computations", 3),
        )
    )
    return ShampooConfig(
        learning_rate=lr,
        statistics=StatisticsConfig(beta2=beta2, bias_correction=bias, initial_value="zero"),
        epsilon=EpsilonConfig(value=eps, scale="absolute", placement=placement),  # type: ignore[arg-type]
        root_inverse=root_inverse,
        exponents=exponents,
        eigenvalue_correction=correction,
        grafting=_meta_grafting(a.get("grafting_config", None)),
        gradient_filter=GradientFilterConfig(beta1=beta1, beta3=beta3, bias_correction=bias),
        momentum=momentum,
        weight_decay=weight_decay,
        blocking=BlockingConfig(
            max_preconditioner_dim=mpd,
            merge_dims_up_to=mpd,
            merge_direction="last_to_first",
        ),
        schedule=ScheduleConfig(
            precondition_frequency=freq,
            start_preconditioning_step=start,
            period_anchor="end",
            roots_before_start=False,
        ),
        failure=FailureConfig(nonfinite_gradient="raise", max_consecutive_root_failures=tolerated),
        factor_dtype=dtype,  # type: ignore[arg-type]
    )


# ------------------------------------------------------------------- Google
_GOOGLE_KEYS = {
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

#: Keys whose non-default values we do not implement, with what they do.
_GOOGLE_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "decay_preconditioning_compute_steps": (False, "a decaying root frequency"),
    "end_preconditioning_compute_steps": (None, "a decaying root frequency"),
    "batch_axis_name": (None, "pmap sharding; the caller averages gradients"),
    "statistics_partition_spec": (None, "pjit sharding"),
    "preconditioner_partition_spec": (None, "pjit sharding"),
    "num_devices_for_pjit": (None, "pjit sharding"),
    "shard_optimizer_states": (False, "pjit sharding (roots one step late)"),
    "best_effort_memory_usage_reduction": (False, "quantized int8/int16 states"),
    "clip_by_scaled_gradient_norm": (None, "clipping of the RMSProp graft"),
    "lobpcg_topk_precondition": (0, "LOBPCG"),
    "lobpcg_max_iter": (0, "LOBPCG"),
    "generate_fd_metrics": (False, "frequent-directions sketching"),
    "compression_rank": (0, "frequent-directions sketching"),
    "frequent_directions": (False, "frequent-directions sketching"),
    "reset_preconditioner": (False, "frequent-directions sketching"),
    "average_grad": (False, "frequent-directions sketching"),
    "best_effort_shape_interpretation": (True, "no squeezing or merging of dims"),
}

_GOOGLE_GRAFTS = {
    "NONE": "none",
    "SGD": "sgd",
    "ADAGRAD": "adagrad",
    "RMSPROP": "rmsprop",
    "RMSPROP_NORMALIZED": "rmsprop_normalized",
    "SQRT_N": "sign",
    "ADAGRAD_NORMALIZED": "adagrad_normalized",
}
_GOOGLE_SIDES = {"ALL": "all", "INPUT": "all_but_last", "OUTPUT": "last"}


def from_google(kwargs: Mapping[str, Any]) -> ShampooConfig:
    """Config equal to Google's ``distributed_shampoo(**kwargs)``, non-sharded path.

    Rules settled from Google's source (docs/spec.md section 4.2): 0-based
    count (so ``period_anchor="start"``, statistics at count % s == 0, roots
    at count % f == 0 from the first step, Shampoo from count >= start),
    statistics from ``matrix_epsilon * I`` without bias correction, one root
    ``2 * (preconditioned dims)`` per parameter, coupled Newton with
    tolerance 1e-6, growth stop 1.2, five retries at 10x ridge while the
    error > 0.05 and failure at ``inverse_failure_threshold``, graft norm
    over the whole parameter with 1e-25, heavy-ball momentum in two buffers
    with Nesterov. ``learning_rate`` must be a number (schedules belong to
    the framework backends). ``decoupled_weight_decay`` follows the current
    source (total decay lr * wd * x), not precondition-opt 0.3.0 (lr^2).
    """
    a = _Args("from_google", kwargs, _GOOGLE_KEYS)
    if "learning_rate" not in a.data:
        raise ValueError("learning_rate is required (Google's distributed_shampoo has no default).")
    if "block_size" not in a.data:
        raise ValueError("block_size is required (Google's distributed_shampoo has no default).")
    for key, (default, what) in _GOOGLE_UNSUPPORTED.items():
        a.unsupported(key, default, what)
    lr = _number("learning_rate", a.get("learning_rate", None))
    block = int(_number("block_size", a.get("block_size", None)))
    beta1 = _number("beta1", a.get("beta1", 0.9))
    beta2 = _number("beta2", a.get("beta2", 0.999))
    eps = _number("matrix_epsilon", a.get("matrix_epsilon", 1e-6))
    diag_eps = _number("diagonal_epsilon", a.get("diagonal_epsilon", 1e-10))
    wd = _number("weight_decay", a.get("weight_decay", 0.0))
    decoupled_lr = bool(a.get("decoupled_learning_rate", True))
    use_eigh = bool(a.get("eigh", False))

    graft_name = a.get("graft_type", "SGD")
    if graft_name not in _GOOGLE_GRAFTS:
        raise ValueError(
            f"graft_type = {graft_name!r} is invalid: allowed one of {sorted(_GOOGLE_GRAFTS)}."
        )
    graft_type = _GOOGLE_GRAFTS[graft_name]
    if graft_type in ("rmsprop", "rmsprop_normalized") and beta2 == 1.0:
        graft_type = "adagrad" if graft_type == "rmsprop" else "adagrad_normalized"
    if graft_type == "none" and not decoupled_lr:
        raise NotImplementedError(
            "decoupled_learning_rate = False with graft_type = 'NONE' is not supported: "
            "Google then applies no learning rate to the Shampoo direction at all."
        )
    adaptive_beta2 = beta2 if graft_type in ("rmsprop", "rmsprop_normalized") else 1.0
    grafting = GraftingConfig(
        type=graft_type,  # type: ignore[arg-type]
        beta2=adaptive_beta2,
        epsilon=diag_eps,
        bias_correction=False,
        norm_scope="parameter",
        norm_epsilon=1e-25,
        normalize_epsilon=1e-25,
    )

    side_name = a.get("preconditioner_type", a.get("precondtioner_type", "ALL"))
    if side_name not in _GOOGLE_SIDES:
        raise ValueError(
            f"preconditioner_type = {side_name!r} is invalid: allowed one of "
            f"{sorted(_GOOGLE_SIDES)}."
        )
    rank_lt = int(_number("skip_preconditioning_rank_lt", a.get("skip_preconditioning_rank_lt", 1)))
    if rank_lt < 1:
        raise NotImplementedError(
            f"skip_preconditioning_rank_lt = {rank_lt} is not supported yet (Google then "
            "preconditions 0-d parameters with no factor at all)."
        )
    relative = bool(a.get("relative_matrix_epsilon", True))
    if use_eigh:
        root_inverse: RootInverseConfig = EighConfig()
    else:
        root_inverse = CoupledNewtonConfig(
            max_iterations=100,
            tolerance=1e-6,
            error_growth_limit=1.2,
            retries=5,
            retry_epsilon_factor=10.0,
            retry_error_threshold=0.05,
            failure_threshold=_number(
                "inverse_failure_threshold", a.get("inverse_failure_threshold", 0.1)
            ),
        )
    override = _number("exponent_override", a.get("exponent_override", 0))
    start = int(_number("start_preconditioning_step", a.get("start_preconditioning_step", 5)))
    skip_gt = _number(
        "skip_preconditioning_dim_size_gt", a.get("skip_preconditioning_dim_size_gt", 4096)
    )
    return ShampooConfig(
        learning_rate=lr,
        statistics=StatisticsConfig(
            beta2=beta2, bias_correction=False, initial_value="epsilon_identity"
        ),
        epsilon=EpsilonConfig(
            value=eps,
            scale="relative" if relative else "absolute",
            # Newton's ridge floor is 1e-25; the eigh path floors lambda_max at 1e-6.
            relative_floor=1e-6 if use_eigh else 1e-25,
            placement="ridge_floor",
        ),
        root_inverse=root_inverse,
        exponents=ExponentConfig(default="preconditioned_dims", override=max(override, 0.0)),
        grafting=grafting,
        gradient_filter=GradientFilterConfig(beta1=0.0),
        momentum=MomentumConfig(
            momentum=beta1,
            dampening=beta1 if a.get("moving_average_for_momentum", False) else 0.0,
            nesterov=bool(a.get("nesterov", True)),
            buffers="separate" if graft_type != "none" and beta1 > 0 else "shared",
            learning_rate_placement="after_momentum" if decoupled_lr else "before_momentum",
        ),
        weight_decay=WeightDecayConfig(
            value=wd,
            type="update" if a.get("decoupled_weight_decay", False) else "direction",
        ),
        blocking=BlockingConfig(
            max_preconditioner_dim=block if block > 0 else UNBOUNDED,
            merge_dims_up_to=_dim_limit(
                "merge_small_dims_block_size", a.get("merge_small_dims_block_size", 4096)
            ),
            merge_direction="first_to_last",
            skip_dim_size_gt=UNBOUNDED if skip_gt == math.inf else int(skip_gt),
            skip_rank_lt=rank_lt,
            preconditioned_dims=_GOOGLE_SIDES[side_name],  # type: ignore[arg-type]
        ),
        schedule=ScheduleConfig(
            precondition_frequency=int(
                _number("preconditioning_compute_steps", a.get("preconditioning_compute_steps", 1))
            ),
            statistics_frequency=int(
                _number("statistics_compute_steps", a.get("statistics_compute_steps", 1))
            ),
            start_preconditioning_step=start + 1,
            period_anchor="start",
            roots_before_start=True,
        ),
        failure=FailureConfig(nonfinite_gradient="raise", max_consecutive_root_failures=None),
        factor_dtype="float64",
    )
