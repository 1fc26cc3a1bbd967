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
        return GraftingConfig(type="adagrad", epsilon=_number("epsilon", args.get("epsilon", 1e-10)))
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
