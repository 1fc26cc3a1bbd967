"""Independent float64 NumPy emulator of Meta's single-device ``DistributedShampoo``.

This is a second, independent implementation of the numerics of
facebookresearch/optimizers ``distributed_shampoo`` (single device, one
parameter group), written from a reading of that library's source.  It
deliberately mirrors the library's *structure* (distributor that merges and
blocks, preconditioner "lists" that are updated and then applied block by
block, a per-group step that chains L2 -> factor update -> amortized root ->
gradient filtering -> precondition + graft -> decoupled decay -> momentum ->
-lr) rather than any design of this project, so that it can serve as an
anchor for the project's own reference implementation.

Only NumPy is used.  Every computation is float64 regardless of the
``factor_matrix_dtype`` / ``inv_factor_matrix_dtype`` options (Meta would
compute in float32 by default).

Entry point::

    emulate_meta(kwargs, params, grads) -> list[dict[str, np.ndarray]]

``kwargs`` is the JSON form of the ``DistributedShampoo(...)`` keyword
arguments (nested configs are dicts with a ``"type"`` key naming the Meta
class; enums are given by member name).  Anything not emulated raises
``NotImplementedError``; invalid hyper-parameters raise ``ValueError`` the
way Meta's constructor / config ``__post_init__`` would.
"""

from __future__ import annotations

import copy
import math
from fractions import Fraction
from typing import Any

import numpy as np

__all__ = ["emulate_meta", "merge_small_dims", "multi_dim_split_slices", "MetaEmulatorError"]


class MetaEmulatorError(ValueError):
    """Raised where Meta raises (non-finite factors, too many failed roots, ...)."""


# --------------------------------------------------------------------------
# Config parsing (defaults and range checks as in Meta's constructor and the
# dataclasses of shampoo_types.py / matrix_functions_types.py).
# --------------------------------------------------------------------------

_GRAFT_ALIASES = {
    "SGDGraftingConfig": "SGDPreconditionerConfig",
    "AdaGradGraftingConfig": "AdaGradPreconditionerConfig",
    "RMSpropGraftingConfig": "RMSpropPreconditionerConfig",
    "AdamGraftingConfig": "AdamPreconditionerConfig",
}

_KNOWN_TOP_LEVEL = {
    "lr",
    "betas",
    "beta3",
    "epsilon",
    "weight_decay",
    "weight_decay_type",
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
    # Legacy (older releases) keyword arguments, mapped onto the new ones.
    "momentum",
    "dampening",
    "use_nesterov",
    "use_decoupled_weight_decay",
}


def _typ(cfg: dict | None) -> str | None:
    if cfg is None:
        return None
    if not isinstance(cfg, dict) or "type" not in cfg:
        raise ValueError(f"nested config must be a dict with a 'type' key, got {cfg!r}")
    return cfg["type"]


def _check_keys(cfg: dict, allowed: set[str]) -> None:
    extra = set(cfg) - allowed - {"type"}
    if extra:
        raise NotImplementedError(f"{cfg['type']}: unsupported fields {sorted(extra)}")


def _parse_rank_deficient(cfg: dict | None) -> dict:
    if cfg is None:
        return {"type": "PerturbationConfig", "perturb_before_computation": True}
    t = _typ(cfg)
    if t == "PerturbationConfig":
        _check_keys(cfg, {"perturb_before_computation"})
        return {
            "type": t,
            "perturb_before_computation": bool(cfg.get("perturb_before_computation", True)),
        }
    if t == "PseudoInverseConfig":
        _check_keys(cfg, {"rank_atol", "rank_rtol"})
        return {
            "type": t,
            "rank_atol": float(cfg.get("rank_atol", 0.0)),
            "rank_rtol": cfg.get("rank_rtol", 0.0),
        }
    raise NotImplementedError(f"rank_deficient_stability_config {t}")


def _parse_amortized(cfg: dict | None, default: str) -> dict:
    if cfg is None:
        cfg = {"type": default}
    t = _typ(cfg)
    if t in ("EigenConfig", "EighEigendecompositionConfig", "QREigendecompositionConfig"):
        allowed = {
            "rank_deficient_stability_config",
            "tolerance",
            "retry_double_precision",
            "eigendecomposition_offload_device",
        }
        if t == "QREigendecompositionConfig":
            allowed = {"rank_deficient_stability_config", "tolerance", "max_iterations"}
        _check_keys(cfg, allowed)
        out = {
            "type": t,
            "rank_deficient_stability_config": _parse_rank_deficient(
                cfg.get("rank_deficient_stability_config")
            ),
            "tolerance": float(cfg.get("tolerance", 0.0)),
        }
        if not 0.0 <= out["tolerance"] <= 1.0:
            raise ValueError(
                f"Invalid tolerance value: {out['tolerance']}. Must be in the interval [0.0, 1.0]."
            )
        if t == "EigenConfig" and out["tolerance"] != 0.0:
            raise ValueError("Invalid tolerance value: must be 0.0 for EigenConfig.")
        if t == "QREigendecompositionConfig":
            out["max_iterations"] = int(cfg.get("max_iterations", 1))
        return out
    if t == "CoupledNewtonConfig":
        _check_keys(cfg, {"max_iterations", "tolerance", "epsilon"})
        if "epsilon" in cfg:
            # No such field in Meta's CoupledNewtonConfig: the ridge is the
            # optimizer-level ``epsilon``.
            raise NotImplementedError(
                "CoupledNewtonConfig has no 'epsilon' field in Meta; use the top-level epsilon"
            )
        return {
            "type": t,
            "max_iterations": int(cfg.get("max_iterations", 100)),
            "tolerance": float(cfg.get("tolerance", 1e-6)),
        }
    raise NotImplementedError(f"amortized_computation_config {t}")


def _int_keys(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        out[int(k)] = _int_keys(v) if isinstance(v, dict) else v
    return out


def _parse_preconditioner(cfg: dict | None) -> dict:
    if cfg is None:
        cfg = {"type": "RootInvShampooPreconditionerConfig"}
    t = _typ(cfg)
    if t in ("DefaultShampooConfig",):
        cfg = {"type": "RootInvShampooPreconditionerConfig"}
        t = cfg["type"]
    if t in ("DefaultEigenvalueCorrectedShampooConfig",):
        cfg = {"type": "EigenvalueCorrectedShampooPreconditionerConfig"}
        t = cfg["type"]
    if t == "DefaultSOAPConfig":
        cfg = {
            "type": "EigenvalueCorrectedShampooPreconditionerConfig",
            "amortized_computation_config": {"type": "QREigendecompositionConfig"},
        }
        t = cfg["type"]
    t = _GRAFT_ALIASES.get(t, t)
    if t in (
        "SGDPreconditionerConfig",
        "AdaGradPreconditionerConfig",
        "RMSpropPreconditionerConfig",
        "AdamPreconditionerConfig",
    ):
        return _parse_diag(dict(cfg, type=t))
    base_fields = {
        "amortized_computation_config",
        "drop_weighting_factor_on_gsquare",
        "factor_matrix_dtype",
        "num_tolerated_failed_amortized_computations",
        "use_symmetric_packing",
        "use_trace_scaling",
        "trace_scaling_exponent",
    }
    if t in ("RootInvShampooPreconditionerConfig", "EigendecomposedShampooPreconditionerConfig"):
        allowed = base_fields | {
            "inverse_exponent_override",
            "inv_factor_matrix_dtype",
            "factor_matrix_eigenvectors_dtype",
            "factor_matrix_eigenvalues_dtype",
        }
        default_amort = "EigenConfig" if t.startswith("RootInv") else "EighEigendecompositionConfig"
        kind = "root_inv" if t.startswith("RootInv") else "eigendecomposed"
    elif t == "EigenvalueCorrectedShampooPreconditionerConfig":
        allowed = base_fields | {
            "ignored_basis_change_dims",
            "inverse_exponent_override",
            "factor_matrix_eigenvectors_dtype",
            "corrected_eigenvalues_dtype",
        }
        default_amort = "EighEigendecompositionConfig"
        kind = "eigenvalue_corrected"
    else:
        raise NotImplementedError(f"preconditioner_config {t}")
    _check_keys(cfg, allowed)
    amort = _parse_amortized(cfg.get("amortized_computation_config"), default_amort)
    if kind == "root_inv" and amort["type"] not in ("EigenConfig", "CoupledNewtonConfig"):
        raise NotImplementedError(f"{t} with {amort['type']}")
    if kind != "root_inv" and amort["type"] not in (
        "EighEigendecompositionConfig",
        "QREigendecompositionConfig",
        "EigenConfig",
    ):
        raise NotImplementedError(f"{t} with {amort['type']}")
    out = {
        "type": t,
        "kind": kind,
        "amortized_computation_config": amort,
        "drop_weighting_factor_on_gsquare": bool(
            cfg.get("drop_weighting_factor_on_gsquare", False)
        ),
        "num_tolerated_failed_amortized_computations": int(
            cfg.get("num_tolerated_failed_amortized_computations", 3)
        ),
        "use_trace_scaling": bool(cfg.get("use_trace_scaling", False)),
        "trace_scaling_exponent": float(cfg.get("trace_scaling_exponent", 0.5)),
    }
    if out["num_tolerated_failed_amortized_computations"] < 0:
        raise ValueError("Invalid num_tolerated_failed_amortized_computations value. Must be >= 0.")
    if out["use_trace_scaling"] and not 0.0 < out["trace_scaling_exponent"] <= 1.0:
        raise ValueError(
            "Invalid trace_scaling_exponent value. Must be in (0.0, 1.0] when use_trace_scaling=True."
        )
    if out["drop_weighting_factor_on_gsquare"]:
        # The dataclass docstring says bias correction stays at 1.0 with this
        # flag, but the preconditioner-list code seen still divides by
        # 1 - beta2^t; the two disagree, so this is not emulated.
        raise NotImplementedError("drop_weighting_factor_on_gsquare=True for Shampoo configs")
    override = _int_keys(cfg.get("inverse_exponent_override", {}) or {})
    if kind == "eigenvalue_corrected":
        rdsc = amort["rank_deficient_stability_config"]
        if rdsc["type"] != "PerturbationConfig":
            raise ValueError(
                "EigenvalueCorrectedShampooPreconditionerConfig needs a PerturbationConfig."
            )
        ignored = _int_keys(cfg.get("ignored_basis_change_dims", {}) or {})
        for order, dims in ignored.items():
            if order < 0:
                raise ValueError(
                    "Invalid orders in ignored_basis_change_dims. All orders must be >= 0."
                )
            if any(not (0 <= d <= max(order - 1, 0)) for d in dims):
                raise ValueError("Invalid dimensions in ignored_basis_change_dims.")
            if len(dims) != len(set(dims)):
                raise ValueError("Duplicate dimensions in ignored_basis_change_dims.")
        for order, ov in override.items():
            if order < 0:
                raise ValueError(
                    "Invalid orders in inverse_exponent_override. All orders must be >= 0."
                )
            if ov <= 0:
                raise ValueError(
                    "Invalid override value in inverse_exponent_override. All overrides must be > 0."
                )
        out["ignored_basis_change_dims"] = {k: list(v) for k, v in ignored.items()}
        out["inverse_exponent_override"] = {k: float(v) for k, v in override.items()}
    else:
        for order, ov in override.items():
            if order < 0:
                raise ValueError(
                    "Invalid orders in inverse_exponent_override. All orders must be >= 0."
                )
            if isinstance(ov, dict):
                if any(not (0 <= d <= max(order - 1, 0)) for d in ov):
                    raise ValueError("Invalid dimensions in inverse_exponent_override.")
                if any(v < 0 for v in ov.values()):
                    raise ValueError(
                        "Invalid override value in inverse_exponent_override. All overrides must be >= 0."
                    )
            elif float(ov) < 0:
                raise ValueError(
                    "Invalid override value in inverse_exponent_override. All overrides must be >= 0."
                )
        out["inverse_exponent_override"] = {
            k: ({int(d): float(x) for d, x in v.items()} if isinstance(v, dict) else float(v))
            for k, v in override.items()
        }
    return out


def _parse_diag(cfg: dict | None) -> dict | None:
    if cfg is None:
        return None
    t = _GRAFT_ALIASES.get(_typ(cfg), _typ(cfg))
    if t == "SGDPreconditionerConfig":
        _check_keys(cfg, set())
        return {"type": t}
    if t == "AdaGradPreconditionerConfig":
        _check_keys(cfg, {"epsilon"})
        eps = float(cfg.get("epsilon", 1e-10))
        if not eps > 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}. Must be > 0.0.")
        return {
            "type": t,
            "beta2": 1.0,
            "weighting_factor": 1.0,
            "epsilon": eps,
            "use_bias_correction": False,
        }
    if t in ("RMSpropPreconditionerConfig", "AdamPreconditionerConfig"):
        _check_keys(cfg, {"epsilon", "beta2", "drop_weighting_factor_on_gsquare"})
        eps = float(cfg.get("epsilon", 1e-10))
        beta2 = float(cfg.get("beta2", 0.99 if t.startswith("RMS") else 0.999))
        if not eps > 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}. Must be > 0.0.")
        if not 0.0 < beta2 <= 1.0:
            raise ValueError(f"Invalid grafting beta2 parameter: {beta2}. Must be in (0.0, 1.0].")
        drop = bool(cfg.get("drop_weighting_factor_on_gsquare", False))
        if drop:
            w, bc = 1.0, False
        else:
            w, bc = 1.0 - beta2, t.startswith("Adam")
        return {
            "type": t,
            "beta2": beta2,
            "weighting_factor": w,
            "epsilon": eps,
            "use_bias_correction": bc,
        }
    raise NotImplementedError(f"grafting/diagonal config {t}")


def _parse_iterate_averaging(cfg: dict | None) -> dict | None:
    if cfg is None:
        return None
    t = _typ(cfg)
    if t == "ClassicMomentumConfig":
        _check_keys(cfg, {"momentum", "dampening", "use_nesterov"})
        mom = float(cfg.get("momentum", 0.5))
        damp = float(cfg.get("dampening", 0.0))
        if not 0.0 < mom < 1.0:
            raise ValueError(f"Invalid momentum={mom}. Must be within (0.0, 1.0).")
        if not 0.0 <= damp < 1.0:
            raise ValueError(f"Invalid dampening={damp}. Must be within [0.0, 1.0).")
        return {
            "type": t,
            "momentum": mom,
            "dampening": damp,
            "use_nesterov": bool(cfg.get("use_nesterov", False)),
        }
    if t == "GeneralizedPrimalAveragingConfig":
        _check_keys(cfg, {"eval_interp_coeff", "train_interp_coeff"})
        mx = float(cfg.get("eval_interp_coeff", 0.9))
        my = float(cfg.get("train_interp_coeff", 0.8))
        if not 0.0 <= mx < 1.0:
            raise ValueError("Invalid eval_interp_coeff. Must be within [0.0, 1.0).")
        if not 0.0 < my <= 1.0:
            raise ValueError("Invalid train_interp_coeff. Must be within (0.0, 1.0].")
        return {"type": t, "eval_interp_coeff": mx, "train_interp_coeff": my}
    if t == "ScheduleFreeConfig":
        _check_keys(cfg, {"train_interp_coeff", "eval_coeff_lr_power"})
        my = float(cfg.get("train_interp_coeff", 0.8))
        if not 0.0 < my <= 1.0:
            raise ValueError("Invalid train_interp_coeff. Must be within (0.0, 1.0].")
        return {
            "type": t,
            "train_interp_coeff": my,
            "eval_coeff_lr_power": int(cfg.get("eval_coeff_lr_power", 2)),
        }
    raise NotImplementedError(f"iterate_averaging_config {t}")


def _parse_group(kwargs: dict) -> dict:
    unknown = set(kwargs) - _KNOWN_TOP_LEVEL
    if unknown:
        raise NotImplementedError(f"unsupported DistributedShampoo kwargs: {sorted(unknown)}")
    g: dict[str, Any] = {}
    g["lr"] = float(kwargs.get("lr", 1e-2))
    betas = kwargs.get("betas", (0.9, 1.0))
    g["betas"] = (float(betas[0]), float(betas[1]))
    g["beta3"] = float(kwargs.get("beta3", -1.0))
    g["epsilon"] = float(kwargs.get("epsilon", 1e-12))
    g["weight_decay"] = float(kwargs.get("weight_decay", 0.0))
    wdt = kwargs.get("weight_decay_type", "DECOUPLED")
    if "use_decoupled_weight_decay" in kwargs:  # legacy flag
        if "weight_decay_type" in kwargs:
            raise ValueError("give weight_decay_type or use_decoupled_weight_decay, not both")
        wdt = "DECOUPLED" if kwargs["use_decoupled_weight_decay"] else "L2"
    if isinstance(wdt, str) and wdt.startswith("WeightDecayType."):
        wdt = wdt.split(".", 1)[1]
    if wdt not in ("L2", "DECOUPLED", "CORRECTED", "INDEPENDENT"):
        raise ValueError(f"unknown weight_decay_type {wdt!r}")
    g["weight_decay_type"] = wdt
    g["peak_lr"] = g["lr"]
    mpd = kwargs.get("max_preconditioner_dim", 1024)
    if isinstance(mpd, float) and mpd != math.inf:
        if mpd.is_integer():
            mpd = int(mpd)  # JSON may carry ints as floats
        else:
            raise ValueError("Invalid max_preconditioner_dim. Must be an integer or math.inf.")
    if isinstance(mpd, str) and mpd in ("inf", "math.inf", "Infinity"):
        mpd = math.inf
    g["max_preconditioner_dim"] = mpd
    g["precondition_frequency"] = int(kwargs.get("precondition_frequency", 1))
    g["start_preconditioning_step"] = int(kwargs.get("start_preconditioning_step", -1))
    g["use_bias_correction"] = bool(kwargs.get("use_bias_correction", True))
    g["grafting_config"] = _parse_diag(kwargs.get("grafting_config"))
    g["preconditioner_config"] = _parse_preconditioner(kwargs.get("preconditioner_config"))
    ia = _parse_iterate_averaging(kwargs.get("iterate_averaging_config"))
    legacy_mom = float(kwargs.get("momentum", 0.0))
    if legacy_mom != 0.0 or "dampening" in kwargs or "use_nesterov" in kwargs:
        if ia is not None:
            raise ValueError("give iterate_averaging_config or legacy momentum, not both")
        damp = float(kwargs.get("dampening", 0.0))
        if not 0.0 <= legacy_mom < 1.0:
            raise ValueError(f"Invalid momentum parameter: {legacy_mom}. Must be [0.0, 1.0).")
        if not 0.0 <= damp < 1.0:
            raise ValueError(f"Invalid damping parameter: {damp}. Must be [0.0, 1.0).")
        if legacy_mom != 0.0:
            ia = {
                "type": "ClassicMomentumConfig",
                "momentum": legacy_mom,
                "dampening": damp,
                "use_nesterov": bool(kwargs.get("use_nesterov", False)),
            }
    g["iterate_averaging_config"] = ia
    if kwargs.get("shampoo_pt2_compile_config") is not None:
        raise NotImplementedError("shampoo_pt2_compile_config")
    dc = kwargs.get("distributed_config")
    target = 1
    if dc is not None:
        t = _typ(dc)
        if t not in ("SingleDeviceDistributedConfig", "DefaultSingleDeviceDistributedConfig"):
            raise NotImplementedError(f"distributed_config {t} (only single device is emulated)")
        _check_keys(dc, {"target_parameter_dimensionality"})
        target = dc.get("target_parameter_dimensionality", 1)
        if isinstance(target, str) and target in ("inf", "math.inf", "Infinity"):
            target = math.inf
        if isinstance(target, float) and target != math.inf:
            if target.is_integer():
                target = int(target)
            else:
                raise ValueError(
                    "Invalid target_parameter_dimensionality. Must be an integer or math.inf."
                )
        if target < 1:
            raise ValueError("Invalid target_parameter_dimensionality value. Must be >= 1.")
    g["target_parameter_dimensionality"] = target
    rc = kwargs.get("shampoo_runtime_config")
    if rc is not None and _typ(rc) != "ShampooRuntimeConfig":
        raise NotImplementedError(f"shampoo_runtime_config {rc}")

    # ---- param_group_hyperparameter_check (distributed_shampoo.py) ----
    if not g["lr"] >= 0.0:
        raise ValueError(f"Invalid lr={g['lr']}. Must be >= 0.0.")
    if not 0.0 <= g["betas"][0] < 1.0:
        raise ValueError(f"Invalid betas[0]={g['betas'][0]}. Must be in [0.0, 1.0).")
    if not 0.0 <= g["betas"][1] <= 1.0:
        raise ValueError(f"Invalid betas[1]={g['betas'][1]}. Must be in [0.0, 1.0].")
    if g["beta3"] == -1.0:
        g["beta3"] = g["betas"][0]
    elif not 0.0 <= g["beta3"] < 1.0:
        raise ValueError(f"Invalid beta3={g['beta3']}. Must be in [0.0, 1.0).")
    pc = g["preconditioner_config"]
    uses_pinv = (
        "amortized_computation_config" in pc
        and pc["amortized_computation_config"]
        .get("rank_deficient_stability_config", {})
        .get("type")
        == "PseudoInverseConfig"
    )
    if uses_pinv:
        if g["epsilon"] != 0.0:
            raise ValueError(
                f"Invalid epsilon={g['epsilon']}. Must be == 0.0 when PseudoInverseConfig is used."
            )
    elif not g["epsilon"] > 0.0:
        raise ValueError(f"Invalid epsilon={g['epsilon']}. Must be > 0.0.")
    if not g["weight_decay"] >= 0.0:
        raise ValueError(f"Invalid weight_decay={g['weight_decay']}. Must be >= 0.0.")
    if g["weight_decay_type"] in ("CORRECTED", "INDEPENDENT") and not g["peak_lr"] > 0.0:
        raise ValueError(
            "Invalid peak_lr. Must be > 0.0 when using CORRECTED or INDEPENDENT weight decay."
        )
    if not g["max_preconditioner_dim"] >= 1:
        raise ValueError(
            f"Invalid max_preconditioner_dim={g['max_preconditioner_dim']}. Must be >= 1."
        )
    if not g["precondition_frequency"] >= 1:
        raise ValueError(
            f"Invalid precondition_frequency={g['precondition_frequency']}. Must be >= 1."
        )
    if not g["start_preconditioning_step"] >= -1:
        raise ValueError(
            f"Invalid start_preconditioning_step={g['start_preconditioning_step']}. Must be >= -1."
        )
    if g["start_preconditioning_step"] == -1:
        g["start_preconditioning_step"] = g["precondition_frequency"]
    if g["start_preconditioning_step"] < g["precondition_frequency"]:
        raise ValueError(
            f"Invalid start_preconditioning_step={g['start_preconditioning_step']}. "
            f"Must be >= precondition_frequency={g['precondition_frequency']}."
        )
    return g


# --------------------------------------------------------------------------
# Shapes: merge_small_dims / multi_dim_split (utils/shampoo_utils.py).
# --------------------------------------------------------------------------


def merge_small_dims(
    tensor_shape: tuple[int, ...],
    threshold: int | float,
    target_tensor_dimensionality: int | float = 1,
) -> tuple[int, ...]:
    """Meta's merge: squeeze 1s, walk dims from the LAST one, merge neighbours
    while the product stays <= threshold and more than `target` dims would
    remain; 0-d / all-ones become (1,); any 0-size dim gives (0,)."""
    tensor_shape = tuple(int(s) for s in tensor_shape)
    if 0 in tensor_shape:
        return (0,)
    if isinstance(target_tensor_dimensionality, float):
        assert target_tensor_dimensionality == math.inf
        return tensor_shape
    squeezed = [s for s in reversed(tensor_shape) if s != 1] or [1]
    total = len(squeezed)
    new = [squeezed[0]]
    for processed, nxt in enumerate(squeezed[1:], start=1):
        remaining = total - processed
        potential = len(new) + remaining
        if potential > target_tensor_dimensionality and new[-1] * nxt <= threshold:
            new[-1] = new[-1] * nxt
        else:
            new.append(nxt)
    return tuple(reversed(new))


def multi_dim_split_slices(
    shape: tuple[int, ...], split_size: int | float
) -> list[tuple[slice, ...]]:
    """Index tuples of Meta's multi_dim_split: split dim 0 into chunks of
    split_size (remainder last), then every chunk along dim 1, ...; the
    resulting blocks are in row-major order."""
    blocks: list[tuple[slice, ...]] = [tuple(slice(0, n) for n in shape)]
    if isinstance(split_size, float):
        assert split_size == math.inf
        return blocks
    for dim, n in enumerate(shape):
        new_blocks = []
        for b in blocks:
            for start in range(0, n, split_size) if n > 0 else [0]:
                nb = list(b)
                nb[dim] = slice(start, min(start + split_size, n))
                new_blocks.append(tuple(nb))
        blocks = new_blocks
    return blocks


# --------------------------------------------------------------------------
# Matrix functions (preconditioner/matrix_functions.py).
# --------------------------------------------------------------------------


def _perturb_eigenvalues(L: np.ndarray, epsilon: float) -> np.ndarray:
    return L + epsilon if epsilon != 0 else L


def _perturb_matrix(A: np.ndarray, epsilon: float) -> np.ndarray:
    return A + epsilon * np.eye(A.shape[0]) if epsilon != 0 else A


def _inverse_root_from_eigendecomposition(
    L: np.ndarray, Q: np.ndarray, root: Fraction, epsilon: float, rdsc: dict
) -> np.ndarray:
    if rdsc["type"] == "PseudoInverseConfig":
        if epsilon != 0.0:
            raise ValueError("epsilon should be 0.0 when using pseudo-inverse!")
        rtol = rdsc["rank_rtol"]
        if rtol is None:
            rtol = L.size * np.finfo(L.dtype).eps
        cutoff = max(rdsc["rank_atol"], rtol * max(float(L.max()), 0.0))
        with np.errstate(divide="ignore", invalid="ignore"):
            inv_power = np.where(L <= cutoff, 0.0, np.power(L, -1.0 / float(root)))
    else:
        lambda_min = float(L.min())
        if rdsc["perturb_before_computation"]:
            if lambda_min < epsilon:
                L = _perturb_eigenvalues(L, -lambda_min)
                L = _perturb_eigenvalues(L, epsilon)
        else:
            L = _perturb_eigenvalues(L, -min(lambda_min, 0.0))
            L = _perturb_eigenvalues(L, epsilon)
        with np.errstate(divide="ignore", invalid="ignore"):
            inv_power = np.power(L, -1.0 / float(root))
    return (Q * inv_power[None, :]) @ Q.T


def _off_diagonal_criterion(B: np.ndarray, tolerance: float) -> bool:
    norm = np.linalg.norm(B)
    diag_norm = np.linalg.norm(np.diag(B))
    off = math.sqrt(max(norm**2 - diag_norm**2, 0.0)) if np.isfinite(norm) else float("nan")
    return bool(off <= tolerance * norm)


def _matrix_eigendecomposition(
    A: np.ndarray, epsilon: float, cfg: dict, eigenvectors_estimate: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    rdsc = cfg["rank_deficient_stability_config"]
    if rdsc["type"] == "PseudoInverseConfig" and epsilon != 0.0:
        raise ValueError("epsilon should be 0.0 when using pseudo-inverse!")
    before = rdsc.get("perturb_before_computation", False)
    A_ridge = _perturb_matrix(A, epsilon * (1 if before else 0))
    if cfg["type"] in ("EigenConfig", "EighEigendecompositionConfig"):
        if cfg["tolerance"] != 0.0:
            if eigenvectors_estimate is None:
                raise ValueError("eigenvectors_estimate needed when tolerance != 0.0")
            B = eigenvectors_estimate.T @ A_ridge @ eigenvectors_estimate
            if _off_diagonal_criterion(B, cfg["tolerance"]):
                return np.diag(B).copy(), eigenvectors_estimate
        L, Q = np.linalg.eigh(A_ridge)
        return L, Q
    if cfg["type"] == "QREigendecompositionConfig":
        V = eigenvectors_estimate
        B = V.T @ A_ridge @ V
        it = 0
        while it < cfg["max_iterations"] and not _off_diagonal_criterion(B, cfg["tolerance"]):
            Qk, Rk = np.linalg.qr(B)
            B = Rk @ Qk
            V = V @ Qk
            it += 1
        d = np.diag(B)
        idx = np.argsort(d, kind="stable")
        return d[idx], V[:, idx]
    raise NotImplementedError(cfg["type"])


def _matrix_inverse_root(A: np.ndarray, root: Fraction, cfg: dict, epsilon: float) -> np.ndarray:
    if A.ndim != 2 or A.shape[0] != A.shape[1]:
        raise ValueError("Matrix is not square!")
    if cfg["type"] == "EigenConfig":
        if root <= 0:
            raise ValueError(f"Root {root} should be positive!")
        eig_cfg = dict(cfg, type="EighEigendecompositionConfig", tolerance=0.0)
        L, Q = _matrix_eigendecomposition(A, epsilon, eig_cfg, None)
        return _inverse_root_from_eigendecomposition(
            L, Q, root, epsilon, cfg["rank_deficient_stability_config"]
        )
    if cfg["type"] == "CoupledNewtonConfig":
        if root.denominator != 1:
            raise ValueError(
                f"root.denominator={root.denominator} must be 1 for coupled inverse Newton iteration!"
            )
        p = int(root.numerator)
        alpha = -1.0 / p
        n = A.shape[0]
        identity = np.eye(n)
        A_ridge = _perturb_matrix(A, epsilon)
        z = (p + 1) / (2 * np.linalg.norm(A_ridge))
        X = z ** (-alpha) * identity
        M = z * A_ridge
        error = np.max(np.abs(M - identity))
        iteration = 0
        while error > cfg["tolerance"] and iteration < cfg["max_iterations"]:
            iteration += 1
            M_p = alpha * M + (1 - alpha) * identity
            X = X @ M_p
            M = np.linalg.matrix_power(M_p, p) @ M
            error = np.max(np.abs(M - identity))
        # Not converging only logs a warning in Meta; X is used as is.
        return X
    raise NotImplementedError(cfg["type"])


# --------------------------------------------------------------------------
# Preconditioner lists (preconditioner/*.py).
# --------------------------------------------------------------------------


def _precondition_grad(
    grad: np.ndarray,
    selector: tuple[bool, ...],
    mats: list[np.ndarray],
    contract_first_axis_of_matrix: bool = True,
) -> np.ndarray:
    """Meta's _precondition_grad: walk the dims in order; a preconditioned dim
    is contracted (tensordot of grad axis 0 with the matrix's axis 0, or axis 1
    for the back-transform) and the new axis goes last; an unpreconditioned dim
    is rotated to the end.  After `order` steps the axes are back in order."""
    it = iter(mats)
    out = grad
    axis = 0 if contract_first_axis_of_matrix else 1
    for should in selector:
        if should:
            out = np.tensordot(out, next(it), axes=([0], [axis]))
        else:
            out = np.moveaxis(out, 0, -1)
    return out


class _SGDList:
    def update_preconditioners(self, grads, step, perform_amortized_computation=False):
        pass

    def precondition(self, grads):
        return [g for g in grads]


class _AdagradList:
    """AdaGrad / RMSprop / Adam diagonal preconditioner (grafting or main)."""

    def __init__(self, shapes, cfg):
        self.beta2 = cfg["beta2"]
        self.w = cfg["weighting_factor"]
        self.eps = cfg["epsilon"]
        self.use_bc = cfg["use_bias_correction"]
        self.bc2 = 1.0
        self.state = [np.zeros(s) for s in shapes]

    def update_preconditioners(self, grads, step, perform_amortized_computation=False, mask=None):
        for i, g in enumerate(grads):
            if g is None:
                continue
            if self.beta2 != 1.0:
                self.state[i] = self.state[i] * self.beta2
            self.state[i] = self.state[i] + self.w * (g * g)
        if self.use_bc and self.beta2 < 1.0:
            self.bc2 = 1.0 - self.beta2**step

    def precondition(self, grads):
        out = []
        for i, g in enumerate(grads):
            if g is None:
                out.append(None)
                continue
            denom = np.sqrt(self.state[i] / self.bc2) + self.eps
            out.append(g / denom)
        return out


class _ShampooBlock:
    def __init__(self, dims, selector, roots):
        self.dims = tuple(dims)
        self.selector = tuple(selector)
        pdims = [d for d, s in zip(dims, selector, strict=False) if s]
        self.factor_matrices = [np.zeros((d, d)) for d in pdims]
        self.inv_factor_matrices = [np.eye(d) for d in pdims]
        self.eigenvectors = [np.eye(d) for d in pdims]
        self.eigenvalues = [np.ones(d) for d in pdims]
        self.corrected_eigenvalues = np.zeros(self.dims)
        self.roots = roots
        self.failed = 0


class _ShampooList:
    def __init__(self, shapes, cfg, beta2, epsilon, use_bias_correction):
        self.cfg = cfg
        self.kind = cfg["kind"]
        self.beta2 = beta2
        self.w = 1.0 if beta2 == 1.0 else 1.0 - beta2
        self.eps = epsilon
        self.use_bc = use_bias_correction
        self.bc2 = 1.0
        self.blocks = []
        for dims in shapes:
            selector = self._selector(dims)
            self.blocks.append(_ShampooBlock(dims, selector, self._roots(selector)))

    # ---- inverse exponents (ClassicShampooPreconditionerList) ----
    def _inverse_exponent(self, dimension: int, order: int) -> float:
        ov = self.cfg["inverse_exponent_override"].get(order, {})
        if isinstance(ov, dict):
            return ov.get(dimension, 1 / (2 * max(order, 1)))
        return float(ov)

    def _selector(self, dims):
        if self.kind == "eigenvalue_corrected":
            ignored = self.cfg["ignored_basis_change_dims"].get(len(dims), [])
            return tuple(d not in ignored for d in range(len(dims)))
        return tuple(self._inverse_exponent(d, len(dims)) != 0.0 for d in range(len(dims)))

    def _roots(self, selector):
        if self.kind == "eigenvalue_corrected":
            return (1 / self.cfg["inverse_exponent_override"].get(len(selector), 1 / 2),)
        return tuple(
            1 / self._inverse_exponent(k, len(selector)) for k, s in enumerate(selector) if s
        )

    # ---- update ----
    def update_preconditioners(self, grads, step, perform_amortized_computation):
        for blk, g in zip(self.blocks, grads, strict=False):
            if g is None or not blk.factor_matrices:
                continue
            order = g.ndim
            outer = []
            for k in [k for k in range(order) if blk.selector[k]]:
                axes = [a for a in range(order) if a != k]
                outer.append(np.tensordot(g, g, axes=(axes, axes)))
            for i, op in enumerate(outer):
                fm = blk.factor_matrices[i]
                if self.beta2 != 1.0:
                    fm = fm * self.beta2
                blk.factor_matrices[i] = fm + self.w * op
        if self.use_bc and self.beta2 < 1.0:
            self.bc2 = 1.0 - self.beta2**step
        if perform_amortized_computation:
            for blk, g in zip(self.blocks, grads, strict=False):
                if g is None:
                    continue
                self._amortized_computation(blk)
        if self.kind == "eigenvalue_corrected":
            for blk, g in zip(self.blocks, grads, strict=False):
                if g is None:
                    continue
                gt = _precondition_grad(g, blk.selector, blk.eigenvectors)
                if self.beta2 != 1.0:
                    blk.corrected_eigenvalues = blk.corrected_eigenvalues * self.beta2
                blk.corrected_eigenvalues = blk.corrected_eigenvalues + self.w * gt * gt

    def _amortized_computation(self, blk: _ShampooBlock) -> None:
        amort = self.cfg["amortized_computation_config"]
        last_exc = None
        for i in range(len(blk.factor_matrices)):
            A = blk.factor_matrices[i] / self.bc2
            if self.cfg["use_trace_scaling"]:
                tr = max(float(np.trace(A)), self.eps)
                A = A * tr ** (-self.cfg["trace_scaling_exponent"])
            if not np.all(np.isfinite(A)):
                raise MetaEmulatorError(f"Encountered nan/inf values in factor matrix {i}!")
            try:
                if self.kind == "root_inv":
                    res = {"inv": _matrix_inverse_root(A, Fraction(blk.roots[i]), amort, self.eps)}
                elif self.kind == "eigendecomposed":
                    L, Q = _matrix_eigendecomposition(A, self.eps, amort, blk.eigenvectors[i])
                    res = {"eigenvalues": L, "eigenvectors": Q}
                else:
                    _, Q = _matrix_eigendecomposition(A, self.eps, amort, blk.eigenvectors[i])
                    res = {"eigenvectors": Q}
            except Exception as exc:  # noqa: BLE001 - Meta catches everything here
                last_exc = exc
                continue  # previous quantities are kept
            for name, val in res.items():
                if not np.all(np.isfinite(val)):
                    raise MetaEmulatorError(
                        f"Encountered nan or inf values in {name} of factor matrix {i}!"
                    )
            if "inv" in res:
                blk.inv_factor_matrices[i] = res["inv"]
            if "eigenvalues" in res:
                blk.eigenvalues[i] = res["eigenvalues"]
            if "eigenvectors" in res:
                blk.eigenvectors[i] = res["eigenvectors"]
        if last_exc is None:
            blk.failed = 0
        else:
            blk.failed += 1
            if blk.failed > self.cfg["num_tolerated_failed_amortized_computations"]:
                raise MetaEmulatorError(
                    f"The number of failed amortized computations exceeded the allowed tolerance: {last_exc}"
                ) from last_exc

    # ---- precondition ----
    def precondition(self, grads):
        out = []
        for blk, g in zip(self.blocks, grads, strict=False):
            if g is None:
                out.append(None)
                continue
            if self.kind == "root_inv":
                out.append(_precondition_grad(g, blk.selector, blk.inv_factor_matrices))
            elif self.kind == "eigendecomposed":
                rdsc = self.cfg["amortized_computation_config"]["rank_deficient_stability_config"]
                mats = [
                    _inverse_root_from_eigendecomposition(L, Q, Fraction(r), self.eps, rdsc)
                    for Q, L, r in zip(blk.eigenvectors, blk.eigenvalues, blk.roots, strict=False)
                ]
                out.append(_precondition_grad(g, blk.selector, mats))
            else:
                gt = _precondition_grad(g.copy(), blk.selector, blk.eigenvectors)
                denom = (
                    np.power(blk.corrected_eigenvalues / self.bc2, 1.0 / blk.roots[0]) + self.eps
                )
                gt = gt / denom
                out.append(
                    _precondition_grad(
                        gt, blk.selector, blk.eigenvectors, contract_first_axis_of_matrix=False
                    )
                )
        return out


def _make_list(cfg: dict | None, shapes, group):
    if cfg is None:
        return None
    t = cfg["type"]
    if t == "SGDPreconditionerConfig":
        return _SGDList()
    if t in (
        "AdaGradPreconditionerConfig",
        "RMSpropPreconditionerConfig",
        "AdamPreconditionerConfig",
    ):
        return _AdagradList(shapes, cfg)
    return _ShampooList(
        shapes, cfg, group["betas"][1], group["epsilon"], group["use_bias_correction"]
    )


# --------------------------------------------------------------------------
# The optimizer (distributed_shampoo.py, single-device Distributor).
# --------------------------------------------------------------------------


def emulate_meta(
    kwargs: dict,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    emulate_inplace_aliasing: bool = True,
) -> list[dict[str, np.ndarray]]:
    """Run Meta's single-device DistributedShampoo step by step.

    ``emulate_inplace_aliasing``: Meta's step updates the search directions in
    place (decoupled decay ``add_``, graft rescale ``mul_``, momentum, ``mul_(-lr)``).
    When beta1 != 0, beta3 == beta1 and use_bias_correction is False, the
    "filtered gradient" handed to the preconditioner IS the filtered-gradient
    state tensor; if the preconditioner returns its input unchanged (SGD
    grafting before start_preconditioning_step, SGDPreconditionerConfig, or a
    Shampoo block with no preconditioned dim) those in-place ops overwrite the
    state with the final update.  True reproduces that; False gives the
    mathematically intended algorithm.
    """
    group = _parse_group(copy.deepcopy(kwargs))
    max_dim = group["max_preconditioner_dim"]
    target = group["target_parameter_dimensionality"]

    names = list(params)
    W = {n: np.array(params[n], dtype=np.float64, copy=True) for n in names}
    orig_shapes = {n: W[n].shape for n in names}
    merged_shapes = {n: merge_small_dims(orig_shapes[n], max_dim, target) for n in names}

    # Distributor: global blocked params in parameter order, blocks row-major.
    block_index: list[tuple[str, tuple[slice, ...]]] = []
    for n in names:
        if W[n].size == 0:
            continue  # Meta filters empty tensors out of every update.
        for sl in multi_dim_split_slices(merged_shapes[n], max_dim):
            block_index.append((n, sl))
    block_shapes = [tuple(s.stop - s.start for s in sl) for _, sl in block_index]

    shampoo_list = _make_list(group["preconditioner_config"], block_shapes, group)
    graft_list = _make_list(group["grafting_config"], block_shapes, group)
    beta1, beta3 = group["betas"][0], group["beta3"]
    filtered = [np.zeros(s) for s in block_shapes] if beta1 != 0.0 else None
    ia = group["iterate_averaging_config"]
    momentum_buf = (
        [np.zeros(s) for s in block_shapes]
        if ia and ia["type"] == "ClassicMomentumConfig"
        else None
    )
    weight_buf = None
    lr_sum = 0.0
    if ia and ia["type"] in ("GeneralizedPrimalAveragingConfig", "ScheduleFreeConfig"):
        weight_buf = [W[n].reshape(merged_shapes[n])[sl].copy() for n, sl in block_index]

    step = 0
    history: list[dict[str, np.ndarray]] = []
    for grad_dict in grads:
        # merge_and_block_gradients (missing / empty grads are masked out).
        G: list[np.ndarray | None] = []
        for n, sl in block_index:
            g = grad_dict.get(n)
            if g is None:
                G.append(None)
                continue
            g = np.asarray(g, dtype=np.float64)
            if g.shape != orig_shapes[n]:
                raise ValueError(f"grad for {n} has shape {g.shape}, param {orig_shapes[n]}")
            if not np.all(np.isfinite(g)):
                raise MetaEmulatorError(f"Encountered gradient containing NaN/Inf in parameter {n}")
            G.append(g.reshape(merged_shapes[n])[sl].copy())
        Wb = [W[n].reshape(merged_shapes[n])[sl].copy() for n, sl in block_index]
        active = [g is not None for g in G]

        step += 1
        lr = group["lr"]
        wd, wdt = group["weight_decay"], group["weight_decay_type"]
        freq, start = group["precondition_frequency"], group["start_preconditioning_step"]
        perform_amortized_computation = (step % freq == 0 and step > start) or step == start
        grafting_not_none = group["grafting_config"] is not None
        use_grafting_method = step < start and grafting_not_none

        # iterate-averaging coefficients (computed in step(), before the group step).
        train_c, eval_c = 0.0, 0.0
        if ia and ia["type"] == "GeneralizedPrimalAveragingConfig":
            train_c, eval_c = ia["train_interp_coeff"], ia["eval_interp_coeff"]
        elif ia and ia["type"] == "ScheduleFreeConfig":
            train_c = ia["train_interp_coeff"]
            lr_pow = lr ** ia["eval_coeff_lr_power"]
            lr_sum += lr_pow
            eval_c = 1.0 - lr_pow / lr_sum

        if not any(active):
            history.append({n: W[n].copy() for n in names})
            continue

        # 1. L2 weight decay into the gradient.
        if wd != 0.0 and wdt == "L2":
            G = [g + wd * w if g is not None else None for g, w in zip(G, Wb, strict=False)]

        # 2. Update factor matrices / grafting state; amortized root computation.
        shampoo_list.update_preconditioners(G, step, perform_amortized_computation)
        if grafting_not_none:
            graft_list.update_preconditioners(G, step)

        # 3. Gradient filtering (first moment) with beta3 and bias correction.
        if beta1 != 0.0:
            Gbar = []
            for i, g in enumerate(G):
                if g is None:
                    Gbar.append(None)
                    continue
                f_old = filtered[i]
                gb = f_old + (1 - beta3) * (g - f_old) if beta3 != beta1 else None
                filtered[i] = f_old + (1 - beta1) * (g - f_old)
                if gb is None:
                    gb = filtered[i]
                if group["use_bias_correction"]:
                    gb = gb / (1.0 - beta3 * beta1 ** (step - 1))
                Gbar.append(gb)
        else:
            Gbar = G

        # 4. Precondition (graft before start, else Shampoo rescaled per block).
        if use_grafting_method:
            P = graft_list.precondition(Gbar)
        else:
            P = shampoo_list.precondition(Gbar)
            if grafting_not_none:
                Pg = graft_list.precondition(Gbar)
                P = [
                    None if p is None else p * (np.linalg.norm(pg) / (np.linalg.norm(p) + 1e-16))
                    for p, pg in zip(P, Pg, strict=False)
                ]

        # Does the direction alias the filtered-gradient state (see docstring)?
        state_is_input = beta1 != 0.0 and beta3 == beta1 and not group["use_bias_correction"]
        if use_grafting_method:
            returns_input = [group["grafting_config"]["type"] == "SGDPreconditionerConfig"] * len(P)
        elif isinstance(shampoo_list, _SGDList):
            returns_input = [True] * len(P)
        elif isinstance(shampoo_list, _ShampooList) and shampoo_list.kind != "eigenvalue_corrected":
            returns_input = [not any(b.selector) for b in shampoo_list.blocks]
        else:
            returns_input = [False] * len(P)
        aliased = [emulate_inplace_aliasing and state_is_input and r for r in returns_input]

        # 5. Decoupled / corrected / independent weight decay into the direction.
        if wd != 0.0 and wdt in ("DECOUPLED", "CORRECTED", "INDEPENDENT"):
            alpha = {
                "DECOUPLED": wd,
                "CORRECTED": wd * lr / group["peak_lr"],
                "INDEPENDENT": wd / group["peak_lr"],
            }[wdt]
            P = [None if p is None else p + alpha * w for p, w in zip(P, Wb, strict=False)]

        # 6. Classic momentum (zero-initialised buffer).
        if momentum_buf is not None:
            mu, d, nest = ia["momentum"], ia["dampening"], ia["use_nesterov"]
            for i, p in enumerate(P):
                if p is None:
                    continue
                momentum_buf[i] = mu * momentum_buf[i] + (1 - d) * p
                P[i] = (1 - d) * p + mu * momentum_buf[i] if nest else momentum_buf[i].copy()

        # 7. Multiply by -lr; primal averaging (GPA / Schedule-Free) if enabled.
        D = [None if p is None else -lr * p for p in P]
        if weight_buf is not None and train_c != 0.0:
            for i, dvec in enumerate(D):
                if dvec is None:
                    continue
                z_minus_y = weight_buf[i] - Wb[i]
                weight_buf[i] = weight_buf[i] + dvec
                D[i] = dvec * (1 - train_c * eval_c) + (1 - eval_c) * z_minus_y

        for i, dvec in enumerate(D):
            if dvec is not None and aliased[i]:
                filtered[i] = dvec.copy()

        # 8. Distributor.update_params: W_block += D.
        for (n, sl), dvec in zip(block_index, D, strict=False):
            if dvec is None:
                continue
            view = W[n].reshape(merged_shapes[n])
            view[sl] = view[sl] + dvec
            W[n] = view.reshape(orig_shapes[n])
        history.append({n: W[n].copy() for n in names})
    return history
