"""to_meta / to_google: the importers' inverse on every expressible config (the importer contract).

The expressible configs of an anchor are exactly the images of its importer,
so the property tests draw the anchor's own arguments, import them and
check ``from_x(to_x(c)) == c``; then they move drawn configs off the
anchor's space (fields the anchor has no argument for) and check that the
``ValueError`` names every moved field. Hand-written examples cover each
anchor's defaults and a few published configs (ANCHORS.md section C).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import shampoo_spec as ss
from shampoo_spec.anchors import _export
from shampoo_spec.anchors.google import exporter as google_exporter
from shampoo_spec.anchors.google import keys as google_keys
from shampoo_spec.anchors.meta import exporter as meta_exporter
from shampoo_spec.config import flatten as _flatten

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------ strategies
unit = st.floats(0.0, 0.99, allow_nan=False)
small = st.sampled_from([1e-12, 1e-10, 1e-8, 1e-6, 1e-4, 0.01])
exponent = st.sampled_from([0.0, 0.5, 0.25, 0.125, 0.2, 1.0 / 3.0, 0.3])


@st.composite
def meta_kwargs(draw: st.DrawFn) -> dict[str, Any]:
    """Keyword arguments of Meta's DistributedShampoo, JSON form, within its validation."""
    freq = draw(st.integers(1, 100))
    kwargs: dict[str, Any] = {
        "lr": draw(st.floats(1e-4, 1.0)),
        "betas": [draw(unit), draw(st.one_of(st.just(1.0), st.floats(0.5, 1.0)))],
        "beta3": draw(st.one_of(st.just(-1.0), unit)),
        "epsilon": draw(small),
        "use_bias_correction": draw(st.booleans()),
        "weight_decay": draw(st.sampled_from([0.0, 1e-5, 0.1])),
        "weight_decay_type": draw(st.sampled_from(
            ["L2", "DECOUPLED", "CORRECTED", "INDEPENDENT", "WeightDecayType.L2"])),
        "max_preconditioner_dim": draw(st.one_of(st.integers(1, 8192), st.just("inf"))),
        "precondition_frequency": freq,
        "start_preconditioning_step": draw(st.one_of(st.just(-1), st.integers(freq, 500))),
    }
    target = draw(st.sampled_from([None, 1, 2, 3, "inf"]))
    if target is not None:
        kwargs["distributed_config"] = {"type": "SingleDeviceDistributedConfig",
                                        "target_parameter_dimensionality": target}
    comm = draw(st.sampled_from([None, "float32", "torch.bfloat16", "float16"]))
    if comm is not None:  # DDP: the update rounded to communication_dtype (eq. 21a)
        kwargs["distributed_config"] = {**kwargs.get("distributed_config", {}),
                                        "type": "DDPDistributedConfig",
                                        "communication_dtype": comm}
    mu = draw(st.sampled_from([None, 0.5, 0.9, "gpa", "schedule_free"]))
    if mu == "gpa":  # eq. (20d)
        kwargs["iterate_averaging_config"] = {
            "type": "GeneralizedPrimalAveragingConfig",
            "eval_interp_coeff": draw(st.sampled_from([0.0, 0.9])),
            "train_interp_coeff": draw(st.sampled_from([0.5, 1.0]))}
    elif mu == "schedule_free":
        kwargs["iterate_averaging_config"] = {
            "type": "ScheduleFreeConfig", "train_interp_coeff": draw(st.floats(0.1, 1.0)),
            "eval_coeff_lr_power": draw(st.integers(0, 4))}
    elif mu is not None:
        kwargs["iterate_averaging_config"] = {
            "type": "ClassicMomentumConfig", "momentum": mu,
            "dampening": draw(st.sampled_from([0.0, 0.1])), "use_nesterov": draw(st.booleans()),
        }
    graft = draw(st.sampled_from([None, "SGD", "AdaGrad", "RMSprop", "Adam"]))
    if graft is not None:
        kwargs["grafting_config"] = {"type": f"{graft}PreconditionerConfig"}
        if graft != "SGD":
            kwargs["grafting_config"]["epsilon"] = draw(small)
        if graft in ("RMSprop", "Adam"):
            kwargs["grafting_config"]["beta2"] = draw(st.floats(0.5, 0.999))
            kwargs["grafting_config"]["drop_weighting_factor_on_gsquare"] = draw(st.booleans())
    corrected = draw(st.booleans())
    method = ""  # RootInv's root method (drawn below)
    pc: dict[str, Any] = {
        "drop_weighting_factor_on_gsquare": draw(st.booleans()),
        "factor_matrix_dtype": draw(st.sampled_from(["float32", "torch.float64", "float64"])),
        "num_tolerated_failed_amortized_computations": draw(st.integers(0, 10)),
    }
    orders = draw(st.lists(st.integers(1, 4), unique=True, max_size=3))
    if corrected:
        pc["type"] = "EigenvalueCorrectedShampooPreconditionerConfig"
        pc["amortized_computation_config"] = {"type": "EighEigendecompositionConfig"}
        reuse = draw(st.sampled_from([None, 0.0, 0.01, 0.5]))  # eq. (17b)
        if reuse is not None:
            pc["amortized_computation_config"]["tolerance"] = reuse
        if draw(st.booleans()):  # eq. (17c): Meta's QR algorithm
            pc["amortized_computation_config"]["type"] = "QREigendecompositionConfig"
            pc["amortized_computation_config"]["max_iterations"] = draw(st.integers(0, 5))
        pc["ignored_basis_change_dims"] = {
            o: draw(st.lists(st.integers(0, o - 1), unique=True)) for o in orders
        }
        e = draw(st.sampled_from([None, 0.5, 0.25, 1.0 / 3.0]))
        if e is not None:
            pc["inverse_exponent_override"] = {o: e for o in range(1, 65)}
        # Some orders with their own exponent (the others keep e, or Meta's 1/2).
        for o in draw(st.lists(st.integers(1, 4), unique=True, max_size=2)):
            pc.setdefault("inverse_exponent_override", {})[o] = draw(
                st.sampled_from([0.5, 0.25, 1.0]))
        # Meta's storage dtypes of Q_k and D (eq. 17a); absent means float32.
        for key in ("factor_matrix_eigenvectors_dtype", "corrected_eigenvalues_dtype"):
            stored = draw(st.sampled_from([None, "float32", "float64", "bfloat16", "float16",
                                           "torch.float32", "torch.bfloat16"]))
            if stored is not None:
                pc[key] = stored
    else:
        pc["type"] = draw(st.sampled_from(["RootInvShampooPreconditionerConfig",
                                           "RootInvKLShampooPreconditionerConfig"]))
        if draw(st.booleans()):
            pc["use_trace_scaling"] = True
            pc["trace_scaling_exponent"] = draw(st.sampled_from([0.25, 0.5, 1.0]))
        # Meta's storage dtype of the roots (eqs. 11a, 16); absent means float32.
        inv = draw(st.sampled_from([None, "float32", "float64", "bfloat16", "float16",
                                    "torch.float32", "torch.bfloat16"]))
        if inv is not None:
            pc["inv_factor_matrix_dtype"] = inv
        method = draw(st.sampled_from(["newton", "higher_order", "eigen",
                                            "eigendecomposed_qr"]))
        if method == "higher_order":  # eq. (11c), any root (fractional ones too)
            pc["amortized_computation_config"] = {
                "type": "CoupledHigherOrderConfig", "rel_epsilon": draw(small),
                "abs_epsilon": draw(st.sampled_from([0.0, 1e-8])),
                "order": draw(st.integers(2, 6)), "max_iterations": draw(st.integers(1, 200)),
                "tolerance": draw(small)}
        elif method == "newton":
            pc["amortized_computation_config"] = {
                "type": "CoupledNewtonConfig", "max_iterations": draw(st.integers(1, 200)),
                "tolerance": draw(small),
            }
        else:
            pc["amortized_computation_config"] = {
                "type": "EigenConfig", "rank_deficient_stability_config": draw(st.sampled_from([
                    {"type": "PerturbationConfig",
                     "perturb_before_computation": draw(st.booleans())},
                    # Meta's rule: epsilon 0 (set below) exactly with the pseudo-inverse.
                    {"type": "PseudoInverseConfig", "rank_rtol": draw(
                        st.sampled_from([None, 0.0, 1e-6])), "rank_atol": draw(
                        st.sampled_from([0.0, 1e-9]))}]))}
            if pc["amortized_computation_config"]["rank_deficient_stability_config"][
                    "type"] == "PseudoInverseConfig":
                kwargs["epsilon"] = 0.0
        pc["inverse_exponent_override"] = {
            o: draw(st.one_of(exponent, st.dictionaries(st.integers(0, o - 1), exponent)))
            for o in orders
        }
        perturbation = pc["amortized_computation_config"].get(
            "rank_deficient_stability_config", {}).get("type") == "PerturbationConfig"
        if perturbation and "use_trace_scaling" not in pc:
            # Eq. (11b): factors stored in bfloat16 or float16 (float16 needs an
            # epsilon >= 2^-24: a smaller one rounds to 0 there).
            low = draw(st.sampled_from([None, "bfloat16", "torch.float16"]))
            if low is not None:
                pc["factor_matrix_dtype"] = low
                if low.endswith("float16") and not low.endswith("bfloat16"):
                    kwargs["epsilon"] = max(kwargs["epsilon"], 1e-6)
    kwargs["preconditioner_config"] = pc
    if pc["type"] == "RootInvKLShampooPreconditionerConfig":
        # Eq. (6b) with roots in the factor dtype only (low-precision factors refused).
        if pc.get("factor_matrix_dtype") in ("bfloat16", "torch.float16"):
            pc["type"] = "RootInvShampooPreconditionerConfig"
        else:
            pc["inv_factor_matrix_dtype"] = pc["factor_matrix_dtype"]
    stab = pc.get("amortized_computation_config", {}).get("rank_deficient_stability_config", {})
    if (method == "eigendecomposed_qr"
            and pc.get("factor_matrix_dtype") not in ("bfloat16", "torch.float16")
            # Eigendecomposed with epsilon after: refused before the first root step
            # without a graft (Meta's stored eigenvalues 1), and always with KL.
            and stab.get("perturb_before_computation") is not False):
        # Eq. (10f): Eigendecomposed (KL) Shampoo with Meta's QR config, the same
        # stability rule; its eigendecomposition stored in the factor dtype.
        kl = "KL" if "KL" in pc["type"] else ""
        pc["type"] = f"Eigendecomposed{kl}ShampooPreconditionerConfig"
        pc["amortized_computation_config"] = {
            "type": "QREigendecompositionConfig", "max_iterations": draw(st.integers(0, 5)),
            "tolerance": draw(st.sampled_from([0.0, 0.01, 0.5])),
            "rank_deficient_stability_config": stab}
        pc.pop("inv_factor_matrix_dtype", None)
        for key in ("factor_matrix_eigenvectors_dtype", "factor_matrix_eigenvalues_dtype"):
            pc[key] = pc["factor_matrix_dtype"]
    if draw(st.sampled_from([False] * 7 + [True])):  # eq. (16c): spectral descent
        oc = draw(st.sampled_from([
            None, {"type": "SVDOrthogonalizationConfig"},
            {"type": "SVDOrthogonalizationConfig", "scale_by_nuclear_norm": True},
            {"type": "NewtonSchulzOrthogonalizationConfig",
             "num_iterations": draw(st.integers(0, 20)),
             "coefficients": [3.0, -3.2, 1.2]}]))
        kwargs["preconditioner_config"] = {"type": "SpectralDescentPreconditionerConfig"}
        if oc is not None:
            kwargs["preconditioner_config"]["orthogonalization_config"] = oc
        return kwargs
    diagonal = draw(st.sampled_from([None, None, None, "SGD", "AdaGrad", "RMSprop", "Adam",
                                     "SignDescent"]))
    if diagonal is not None:  # eq. (16b): a first-order method in place of Shampoo
        kwargs["preconditioner_config"] = dpc = {"type": f"{diagonal}PreconditionerConfig"}
        if diagonal not in ("SGD", "SignDescent"):
            dpc["epsilon"] = draw(small)
        if diagonal in ("RMSprop", "Adam"):
            dpc["beta2"] = draw(st.floats(0.5, 0.999))
            dpc["drop_weighting_factor_on_gsquare"] = draw(st.booleans())
        return kwargs
    if corrected and graft is None:
        # Without a graft Meta applies the correction from step 1 (refused for a later start).
        kwargs["precondition_frequency"] = kwargs["start_preconditioning_step"] = 1
    return kwargs


@st.composite
def google_kwargs(draw: st.DrawFn) -> dict[str, Any]:
    """Keyword arguments of Google's distributed_shampoo, JSON form (enums in every spelling)."""
    graft = draw(st.sampled_from(sorted(google_keys.GRAFT_VALUES)))
    name = google_keys.GRAFT_VALUES[graft]
    side = draw(st.sampled_from([1, 2, 3]))
    side_name = google_keys.SIDE_VALUES[side]
    lr = draw(st.floats(1e-4, 1.0))
    # A callable learning rate (an optax schedule in Google's hands) lets the root
    # period follow it (eq. 8b); the importer reads its value at count 0.
    scheduled = draw(st.booleans())
    kwargs = {
        "learning_rate": (lambda count: lr * 0.5**count) if scheduled else lr,
        "decay_preconditioning_compute_steps": draw(st.booleans()),
        "end_preconditioning_compute_steps": draw(st.sampled_from([None, 0, 10, 100])),
        # Eq. (14d): acts on the RMSPROP grafts only, when nonzero.
        "clip_by_scaled_gradient_norm": draw(st.sampled_from([None, 0, 0.5, 2.0])),
        "block_size": draw(st.integers(-1, 1024)),
        "beta1": draw(unit),
        "beta2": draw(st.one_of(st.just(1.0), st.floats(0.5, 0.999))),
        "diagonal_epsilon": draw(small),
        "matrix_epsilon": draw(small),
        "weight_decay": draw(st.sampled_from([0.0, 5e-5, 0.1])),
        "start_preconditioning_step": draw(st.integers(0, 100)),
        "preconditioning_compute_steps": draw(st.integers(1, 20)),
        "statistics_compute_steps": draw(st.integers(1, 20)),
        "graft_type": draw(st.sampled_from([graft, name, f"GraftingType.{name}"])),
        "nesterov": draw(st.booleans()),
        "exponent_override": draw(st.integers(0, 8)),
        # Both root methods carry it (eqs. 11, 13); 1e-30 and 1e-9 as in the anchor tests.
        "inverse_failure_threshold": draw(st.sampled_from([0.1, 0.5, 1e-9, 1e-30])),
        "moving_average_for_momentum": draw(st.booleans()),
        "skip_preconditioning_dim_size_gt": draw(st.one_of(st.integers(1, 8192), st.just("inf"))),
        "relative_matrix_epsilon": draw(st.booleans()),
        "merge_small_dims_block_size": draw(st.one_of(st.integers(1, 8192), st.just("inf"))),
        "best_effort_shape_interpretation": draw(st.booleans()),
        "precondtioner_type": draw(st.sampled_from([side, side_name,
                                                    f"PreconditionerType.{side_name}"])),
        "skip_preconditioning_rank_lt": draw(st.integers(0, 3)),
        "decoupled_learning_rate": draw(st.booleans()) or graft == 0,
        "decoupled_weight_decay": draw(st.booleans()),
        "eigh": draw(st.booleans()),
        # Eq. (10c); 0 twice as often (low-rank roots off).
        "compression_rank": draw(st.sampled_from([0, 0, 3, -5, 64])),
        "generate_fd_metrics": draw(st.booleans()),
        # pjit: roots one step late (eq. 8); the device count and specs only place work.
        **draw(st.sampled_from([{}, {"shard_optimizer_states": False}, {
            "shard_optimizer_states": True, "num_devices_for_pjit": 4,
            "statistics_partition_spec": [None, "mdl"],
            "preconditioner_partition_spec": [["data", "mdl"], None, None]}])),
        # pmap's axis places root work only; with it Google's quantization adds int16
        # statistics and roots (eq. 20c).
        **draw(st.sampled_from([{"batch_axis_name": "batch"},
                                {"best_effort_memory_usage_reduction": True},
                                {"best_effort_memory_usage_reduction": True,
                                 "batch_axis_name": "batch"},
                                {"best_effort_memory_usage_reduction": False}])),
    }
    if draw(st.sampled_from([False, False, False, True])):
        # Frequent directions (eqs. 6c, 10d) as Google requires it: a positive rank,
        # statistics on the root steps, the previous preconditioner passed in.
        kwargs.update(
            frequent_directions=True, compression_rank=draw(st.sampled_from([1, 3])),
            reuse_preconditioner=True, average_grad=draw(st.booleans()),
            reset_preconditioner=draw(st.booleans()),
            statistics_compute_steps=kwargs["preconditioning_compute_steps"],
            decay_preconditioning_compute_steps=False)
    if draw(st.sampled_from([False, False, True])):
        # Eq. (11d): LOBPCG deflation (Newton roots only; 0 and negative counts: off, k
        # iterations, none).
        kwargs.update(lobpcg_topk_precondition=draw(st.sampled_from([-1, 0, 1, 4])),
                      lobpcg_max_iter=draw(st.sampled_from([-3, 0, 2, 30])))
    if kwargs.get("best_effort_memory_usage_reduction") and "batch_axis_name" in kwargs:
        # Eq. (20c) is Google's pmap path with Newton roots (eigh, pjit: refused by name;
        # LOBPCG refused by name).
        kwargs["eigh"] = False
        kwargs.pop("lobpcg_topk_precondition", None)
        kwargs.pop("shard_optimizer_states", None)
        kwargs.pop("num_devices_for_pjit", None)
        kwargs.pop("statistics_partition_spec", None)
        kwargs.pop("preconditioner_partition_spec", None)
    return kwargs


def _imported(importer: Any, kwargs: dict[str, Any], **extra: Any) -> ss.ShampooConfig:
    try:
        return importer(kwargs, **extra)  # type: ignore[no-any-return]
    except ValueError:
        assume(False)  # a combination the config refuses (e.g. a fractional Newton root)
        raise


def _named(error: pytest.ExceptionInfo[ValueError]) -> list[str]:
    """The field paths a ValueError of an exporter names (``path = value (why)``)."""
    message = str(error.value)
    count = int(re.search(r"cannot express (\d+) option", message).group(1))  # type: ignore[union-attr]
    body = message.split("of this config: ", 1)[1]
    named = re.findall(r"(?:^|; )([a-z_0-9.]+(?:\[order=\d+\]\.roots)?) = ", body)
    assert len(named) == count, message
    return named


def _is_field(path: str) -> bool:
    flat: dict[str, Any] = {}
    config = ss.ShampooConfig(eigenvalue_correction=ss.EigenvalueCorrectionConfig())
    _flatten("", ss.config_to_dict(config), flat)
    _flatten("", ss.config_to_dict(ss.ShampooConfig(root_inverse=ss.CoupledNewtonConfig())), flat)
    _flatten("", ss.config_to_dict(ss.ShampooConfig(root_inverse=ss.HigherOrderNewtonConfig())),
             flat)
    _flatten("", ss.config_to_dict(ss.ShampooConfig(low_rank=ss.LowRankRootConfig(rank=1))),
             flat)
    _flatten("", ss.config_to_dict(ss.ShampooConfig(
        frequent_directions=ss.FrequentDirectionsConfig(rank=1))), flat)
    base = path.split("[", 1)[0]
    return base in flat or base in ("eigenvalue_correction", "low_rank", "frequent_directions",
                                    "exponents.overrides_by_order")


# --------------------------------------------------------------- round trips
@SETTINGS
@given(meta_kwargs())
def test_meta_round_trip(kwargs: dict[str, Any]) -> None:
    c = _imported(ss.from_meta, kwargs)
    exported = ss.to_meta(c)
    assert ss.from_meta(exported) == c
    assert ss.from_meta(json.loads(json.dumps(exported))) == c  # JSON keys become strings


@SETTINGS
@given(google_kwargs(), st.sampled_from([None, True, False]))
def test_google_round_trip(kwargs: dict[str, Any], x64: bool | None) -> None:
    c = _imported(ss.from_google, kwargs, x64=x64)
    exported = ss.to_google(c)
    assert ss.from_google(exported, x64=c.factor_dtype == "float64") == c
    # A growing root period exports a callable learning rate (Google's condition), not JSON.
    assert callable(exported["learning_rate"]) == (
        c.schedule.precondition_frequency_growth is not None
    )
    if c.factor_dtype == "float64" and not callable(exported["learning_rate"]):
        assert ss.from_google(json.loads(json.dumps(exported))) == c


#: Moves off Meta's space: (field path, new section values) per section.
META_MOVES: dict[str, tuple[str, dict[str, Any]]] = {
    "weight_decay.type": ("weight_decay", {"type": "update"}),
    "momentum.learning_rate_placement": (
        "momentum", {"learning_rate_placement": "before_momentum"}
    ),
    "statistics.initial_value": ("statistics", {"initial_value": "epsilon_identity"}),
    "epsilon.scale": ("epsilon", {"scale": "relative"}),
    "blocking.skip_rank_lt": ("blocking", {"skip_rank_lt": 1}),
    "blocking.merge_direction": ("blocking", {"merge_direction": "first_to_last"}),
    "schedule.roots_before_start": ("schedule", {"roots_before_start": True}),
    "schedule.roots_take_effect": ("schedule", {"roots_take_effect": "next_step"}),
    "schedule.statistics_frequency": ("schedule", {"statistics_frequency": 2}),
    "grafting.norm_scope": ("grafting", {"norm_scope": "parameter"}),
    "failure.nonfinite_gradient": ("failure", {"nonfinite_gradient": "skip_block"}),
    "momentum.storage": ("momentum", {"storage": "int8_columnwise"}),
    # Roots stored explicitly in the factor dtype: Meta's equal dtypes import as None.
    "inverse_root_dtype": ("inverse_root_dtype=factor_dtype", {}),

    # Q_k and D stored explicitly in the factor dtype (eq. 17a): Meta's equal dtypes
    # import as None.
    "eigenvalue_correction.eigenvectors_dtype": ("ec_dtype=eigenvectors_dtype", {}),
    "eigenvalue_correction.corrected_eigenvalues_dtype": (
        "ec_dtype=corrected_eigenvalues_dtype", {}),
    # Meta judges no root by its error: neither eigh (eq. 13) nor Newton (eq. 11).
    "root_inverse.failure_threshold": ("root_inverse", {"failure_threshold": 0.1}),
    # Meta has no low-rank roots (eq. 10c).
    "low_rank": ("low_rank=4", {}),
    # Google's root period that follows the learning rate (eq. 8b), its graft clip (eq. 14d;
    # refused by the config for grafts without state: the test assumes those away).
    "schedule.precondition_frequency_growth": ("schedule", {"precondition_frequency_growth": 10}),
    "grafting.clip_rms": ("grafting", {"clip_rms": 0.5}),
}

#: Moves off Google's space.
GOOGLE_MOVES: dict[str, tuple[str, dict[str, Any]]] = {
    "gradient_filter.beta1": ("gradient_filter", {"beta1": 0.5}),
    "statistics.bias_correction": ("statistics", {"bias_correction": True}),
    "weight_decay.type": ("weight_decay", {"type": "l2"}),
    # Google's decay is 'direction' or 'update'; the latter with this move is refused.
    "weight_decay.scale_by_lr_ratio": ("weight_decay", {"scale_by_lr_ratio": True}),
    "grafting.norm_scope": ("grafting", {"norm_scope": "block"}),
    "exponents.default": ("exponents", {"default": "block_order"}),
    "schedule.period_anchor": ("schedule", {"period_anchor": "end"}),
    "failure.max_consecutive_root_failures": ("failure", {"max_consecutive_root_failures": 3}),
    "statistics.initial_value": ("statistics", {"initial_value": "zero"}),
    "blocking.merge_direction": ("blocking", {"merge_direction": "last_to_first"}),
    "factor_dtype+eigenvalue_correction": ("eigenvalue_correction", {}),
    "inverse_root_dtype": ("inverse_root_dtype=bfloat16", {}),
    "update_dtype": ("update_dtype=bfloat16", {}),
    # Google judges every root, eigh included, by inverse_failure_threshold.
    "root_inverse.failure_threshold": ("root_inverse", {"failure_threshold": None}),
    # ... its low-rank roots too (eq. 10c), with lambda_max floored at 1e-6.
    "low_rank.failure_threshold": ("low_rank", {"failure_threshold": 0.7}),
    "low_rank.relative_floor": ("low_rank", {"relative_floor": 1e-20}),
}


def _moved(c: ss.ShampooConfig, moves: dict[str, tuple[str, dict[str, Any]]],
           chosen: list[str]) -> ss.ShampooConfig:
    for path in chosen:
        section, values = moves[path]
        if section == "eigenvalue_correction":
            c = dataclasses.replace(c, root_inverse=ss.EighConfig(),
                                    exponents=ss.ExponentConfig(default=c.exponents.default),
                                    eigenvalue_correction=ss.EigenvalueCorrectionConfig())
        elif section.startswith("ec_dtype="):
            if c.eigenvalue_correction is None:
                raise ValueError("no eigenvalue correction to store")  # assumed away
            ec = dataclasses.replace(c.eigenvalue_correction,
                                     **{section.partition("=")[2]: c.factor_dtype})
            c = dataclasses.replace(c, eigenvalue_correction=ec)
        elif section.startswith("low_rank="):
            rank = int(section.partition("=")[2])
            c = dataclasses.replace(c, low_rank=ss.LowRankRootConfig(rank=rank))
        elif section.startswith("update_dtype="):
            c = dataclasses.replace(c, update_dtype=section.partition("=")[2])
        elif section.startswith("inverse_root_dtype="):
            # Refused with eigenvalue correction (ValueError: the tests assume it away).
            value = section.partition("=")[2]
            value = c.factor_dtype if value == "factor_dtype" else value
            c = dataclasses.replace(c, inverse_root_dtype=value)
        else:
            current = getattr(c, section)
            if current is None or not all(hasattr(current, k) for k in values):
                # e.g. a failure_threshold for a root method without one: assumed away.
                raise ValueError(f"{type(current).__name__} has no {sorted(values)}")
            c = dataclasses.replace(c, **{section: dataclasses.replace(current, **values)})
    return c


@SETTINGS
@given(meta_kwargs(), st.lists(st.sampled_from(sorted(META_MOVES)), min_size=1, max_size=4,
                               unique=True))
def test_meta_names_every_option_it_lacks(kwargs: dict[str, Any], chosen: list[str]) -> None:
    try:
        c = _moved(_imported(ss.from_meta, kwargs), META_MOVES, chosen)
    except ValueError:
        assume(False)  # an inverse_root_dtype with eigenvalue correction
        raise
    with pytest.raises(ValueError, match="Meta's DistributedShampoo cannot express") as error:
        ss.to_meta(c)
    named = _named(error)
    assert set(chosen) <= set(named), (chosen, str(error.value))
    assert all(_is_field(path) for path in named), named


@SETTINGS
@given(google_kwargs(), st.lists(st.sampled_from(sorted(GOOGLE_MOVES)), min_size=1, max_size=4,
                                 unique=True))
def test_google_names_every_option_it_lacks(kwargs: dict[str, Any], chosen: list[str]) -> None:
    try:
        c = _moved(_imported(ss.from_google, kwargs), GOOGLE_MOVES, chosen)
    except ValueError:
        assume(False)  # e.g. eigenvalue correction with separate buffers and no graft
        raise
    with pytest.raises(ValueError, match="Google's distributed_shampoo cannot express") as error:
        ss.to_google(c)
    named = _named(error)
    expected = {"eigenvalue_correction" if p.startswith("factor_dtype+") else p for p in chosen}
    assert expected <= set(named), (chosen, str(error.value))
    assert all(_is_field(path) for path in named), named


@st.composite
def any_config(draw: st.DrawFn) -> ss.ShampooConfig:
    """A config drawn over the sections' fields (not from an anchor)."""
    newton = draw(st.booleans())
    grafting_type = draw(st.sampled_from(ss.GRAFTING_TYPES))
    beta2 = 1.0 if grafting_type.startswith("adagrad") else (
        0.9 if grafting_type in ("rmsprop", "adam", "rmsprop_normalized") else
        draw(st.sampled_from([1.0, 0.9])))
    try:
        return ss.ShampooConfig(
            learning_rate=draw(st.floats(0.0, 1.0)),
            statistics=ss.StatisticsConfig(
                beta2=draw(st.sampled_from([1.0, 0.999])), ema_weight=draw(
                    st.sampled_from(["one_minus_beta2", "one"])),
                bias_correction=draw(st.booleans()),
                initial_value=draw(st.sampled_from(["zero", "epsilon_identity"]))),
            epsilon=ss.EpsilonConfig(
                value=draw(small), scale=draw(st.sampled_from(["absolute", "relative"])),
                relative_floor=draw(st.sampled_from([1e-16, 1e-25, 1e-6])),
                placement=draw(st.sampled_from(["ridge", "shift_after", "floor", "ridge_floor"])),
            ) if not draw(st.booleans()) else ss.EpsilonConfig(
                value=0.0, placement="pseudo_inverse",
                rank_rtol=draw(st.sampled_from([None, 0.0, 1e-6])),
                rank_atol=draw(st.sampled_from([0.0, 1e-9]))),
            root_inverse=ss.CoupledNewtonConfig(
                error_growth_limit=draw(st.sampled_from([None, 1.2])),
                retries=draw(st.sampled_from([0, 5])),
                failure_threshold=draw(st.sampled_from([None, 0.1])),
                **draw(st.sampled_from([{}, {}, {"deflation_rank": 2}, {
                    "deflation_rank": 1, "deflation_iterations": draw(st.sampled_from([0, 7]))}])),
            ) if newton else draw(st.sampled_from([
                ss.EighConfig(failure_threshold=draw(st.sampled_from([None, 0.1, 1e-30]))),
                ss.HigherOrderNewtonConfig(order=draw(st.integers(2, 5)),
                                           abs_epsilon=draw(st.sampled_from([0.0, 1e-6])))])),
            exponents=ss.ExponentConfig(
                default=draw(st.sampled_from(["block_order", "preconditioned_dims"])),
                override=draw(st.sampled_from([0.0, 4.0]))),
            grafting=ss.GraftingConfig(
                type=grafting_type, beta2=beta2,
                ema_weight=draw(st.sampled_from(["one_minus_beta2", "one"]))
                if grafting_type in ("rmsprop", "adam", "rmsprop_normalized")
                else "one_minus_beta2",
                bias_correction=draw(st.booleans()),
                norm_scope=draw(st.sampled_from(["block", "parameter"])),
                norm_epsilon=draw(st.sampled_from([1e-16, 1e-25])),
                normalize_epsilon=draw(st.sampled_from([1e-16, 1e-25]))),
            gradient_filter=ss.GradientFilterConfig(
                beta1=draw(st.sampled_from([0.0, 0.9])), bias_correction=draw(st.booleans())),
            momentum=ss.MomentumConfig(
                momentum=draw(st.sampled_from([0.0, 0.9])),
                dampening=draw(st.sampled_from([0.0, 0.9])), nesterov=draw(st.booleans()),
                buffers=draw(st.sampled_from(["shared", "separate"]))),
            weight_decay=draw(st.sampled_from([
                ss.WeightDecayConfig(value=0.01, type="l2"),
                ss.WeightDecayConfig(value=0.01, type="direction"),
                ss.WeightDecayConfig(value=0.01, type="direction", scale_by_lr_ratio=True),
                ss.WeightDecayConfig(value=0.01, type="update")])),
            blocking=ss.BlockingConfig(
                max_preconditioner_dim=draw(st.sampled_from([128, 1024])),
                merge_dims_up_to=draw(st.sampled_from([None, 128, 1024, 4096])),
                merge_direction=draw(st.sampled_from(["last_to_first", "first_to_last"])),
                squeeze=draw(st.booleans()),
                merge_target_rank=draw(st.sampled_from([1, 2])),
                scalar_factor=draw(st.booleans()),
                skip_dim_size_gt=draw(st.sampled_from([None, 4096])),
                skip_rank_lt=draw(st.sampled_from([0, 1]))),
            schedule=ss.ScheduleConfig(
                precondition_frequency=draw(st.sampled_from([1, 10])),
                start_preconditioning_step=draw(st.sampled_from([None, 1, 10, 26])),
                period_anchor=draw(st.sampled_from(["end", "start"])),
                roots_before_start=draw(st.booleans()),
                roots_take_effect=draw(st.sampled_from(["same_step", "next_step"]))),
            failure=ss.FailureConfig(max_consecutive_root_failures=draw(
                st.sampled_from([None, 3]))),
            factor_dtype=draw(st.sampled_from(["float32", "float64"])),
            inverse_root_dtype=draw(st.sampled_from([None, *ss.INVERSE_ROOT_DTYPES])),
            update_dtype=draw(st.sampled_from([None, *ss.UPDATE_DTYPES])),
            low_rank=draw(st.sampled_from([None, None, ss.LowRankRootConfig(
                rank=3, keep=draw(st.sampled_from(["largest", "smallest"])),
                failure_threshold=draw(st.sampled_from([None, 0.1])),
                relative_floor=draw(st.sampled_from([None, 1e-6])))])),
            frequent_directions=draw(st.sampled_from([None, None, ss.FrequentDirectionsConfig(
                rank=2, average_gradients=draw(st.booleans()),
                reset_every=draw(st.sampled_from([None, 10])),
                relative_floor=draw(st.sampled_from([1e-6, 1e-16]))),
                ss.FrequentDirectionsConfig(rank=2, rule="tearfree")])),
        )
    except ValueError:
        assume(False)
        raise


@SETTINGS
@given(any_config())
def test_any_config_exports_exactly_or_names_what_is_lacking(c: ss.ShampooConfig) -> None:
    for exporter, back in (
        (ss.to_meta, ss.from_meta),
        (ss.to_google, lambda k: ss.from_google(k, x64=c.factor_dtype == "float64")),
    ):
        try:
            exported = exporter(c)
        except ValueError as error:
            named = _named(pytest.ExceptionInfo.from_exception(error))
            assert named and all(_is_field(path) for path in named), named
        else:
            assert back(exported) == c


# --------------------------------------------------------- hand-written examples
def test_tearfree_sketchy_is_named_as_lacking() -> None:
    """Eq. (10e) (``frequent_directions.rule = "tearfree"``): neither Meta nor Google has it."""
    c = ss.from_tearfree({"grafting_options": {"grafting_type": "SGD"},
                          "second_order_options": {"second_order_type": "SKETCHY",
                                                   "sketchy_options": {"rank": 4}}}, 0.01)
    with pytest.raises(ValueError, match="Google's distributed_shampoo cannot express") as e:
        ss.to_google(c)
    assert "frequent_directions.rule" in _named(e)
    with pytest.raises(ValueError, match="Meta's DistributedShampoo cannot express") as e:
        ss.to_meta(c)
    assert "frequent_directions" in _named(e)


def test_tearfree_parameter_rank_cutoff_is_named_as_lacking() -> None:
    """Eq. (10g) (``epsilon.rank_cutoff_scope = "parameter"``): Meta's PseudoInverseConfig
    cuts each factor at its own lambda_max; Google has no pseudo-inverse at all."""
    c = ss.from_tearfree({"grafting_options": {"grafting_type": "SGD"}}, 0.01)
    assert c.epsilon.rank_cutoff_scope == "parameter"
    with pytest.raises(ValueError, match="Meta's DistributedShampoo cannot express") as e:
        ss.to_meta(c)
    assert "epsilon.rank_cutoff_scope" in _named(e)
    with pytest.raises(ValueError, match="Google's distributed_shampoo cannot express") as e:
        ss.to_google(c)
    assert "epsilon.placement" in _named(e)


def test_meta_default_config() -> None:
    c = ss.from_meta({})
    exported = ss.to_meta(c)
    assert exported["preconditioner_config"] == {
        "type": "RootInvShampooPreconditionerConfig",
        "amortized_computation_config": {"type": "EigenConfig"},
        "factor_matrix_dtype": "float32",
        "num_tolerated_failed_amortized_computations": 3,
        "inv_factor_matrix_dtype": "float32",
        "inverse_exponent_override": {},
    }
    assert exported["betas"] == [0.9, 1.0] and exported["weight_decay_type"] == "DECOUPLED"
    assert exported["grafting_config"] is None and exported["iterate_averaging_config"] is None
    assert ss.from_meta(exported) == c


def test_google_default_config() -> None:
    c = ss.from_google({"learning_rate": 0.1, "block_size": 128})
    exported = ss.to_google(c)
    assert exported["graft_type"] == "SGD" and exported["precondtioner_type"] == "ALL"
    assert exported["start_preconditioning_step"] == 5 and exported["exponent_override"] == 0
    assert ss.from_google(exported) == c


def test_google_root_period_growth_and_graft_clip() -> None:
    """Eq. (8b) exports with a callable learning rate; eq. (14d) as RMSPROP's clip."""
    c = ss.from_google({"learning_rate": lambda count: 0.1 / (1 + count), "block_size": 128,
                        "graft_type": "RMSPROP", "beta2": 0.9,
                        "clip_by_scaled_gradient_norm": 0.5, "preconditioning_compute_steps": 10,
                        "decay_preconditioning_compute_steps": True,
                        "end_preconditioning_compute_steps": 40})
    assert c.learning_rate == 0.1 and c.schedule.precondition_frequency_growth == 40
    assert c.grafting.clip_rms == 0.5
    exported = ss.to_google(c)
    assert exported["learning_rate"] == google_keys.ConstantSchedule(0.1)
    assert exported["learning_rate"](7) == 0.1
    assert exported["decay_preconditioning_compute_steps"] is True
    assert exported["end_preconditioning_compute_steps"] == 40
    assert exported["clip_by_scaled_gradient_norm"] == 0.5
    assert ss.from_google(exported) == c
    # Google clips an RMSPROP graft with beta2 = 1, our AdaGrad: exported back as RMSPROP.
    adagrad = ss.from_google({"learning_rate": 0.1, "block_size": 128, "graft_type": "RMSPROP",
                              "beta2": 1.0, "clip_by_scaled_gradient_norm": 0.5})
    assert (adagrad.grafting.type, adagrad.grafting.clip_rms) == ("adagrad", 0.5)
    assert ss.to_google(adagrad)["graft_type"] == "RMSPROP"
    assert ss.from_google(ss.to_google(adagrad)) == adagrad
    # ... but not an AdaGrad graft beside EMA statistics, nor a clipped Adam graft.
    lone = dataclasses.replace(c, grafting=dataclasses.replace(
        c.grafting, type="adagrad", beta2=1.0))
    with pytest.raises(ValueError, match=r"grafting.clip_rms = 0.5 \(Google clips the RMSPROP"):
        ss.to_google(lone)
    with pytest.raises(ValueError, match=r"grafting.clip_rms = 0.5 \(Meta does not clip"):
        ss.to_meta(lone)
    with pytest.raises(ValueError, match=r"schedule.precondition_frequency_growth = 40 \(Meta"):
        ss.to_meta(c)


def test_google_eigh_failure_threshold_round_trip() -> None:
    """eigh=True carries inverse_failure_threshold both ways (eq. 13); Meta has none."""
    c = ss.from_google({"learning_rate": 0.1, "block_size": 128, "eigh": True,
                        "inverse_failure_threshold": 1e-30})
    assert c.root_inverse == ss.EighConfig(failure_threshold=1e-30)
    exported = ss.to_google(c)
    assert exported["eigh"] is True and exported["inverse_failure_threshold"] == 1e-30
    assert ss.from_google(exported) == c
    default = ss.to_google(ss.from_google({"learning_rate": 0.1, "block_size": 128,
                                           "eigh": True}))
    assert default["inverse_failure_threshold"] == 0.1
    with pytest.raises(ValueError, match=r"root_inverse.failure_threshold = None \(Google "):
        ss.to_google(dataclasses.replace(c, root_inverse=ss.EighConfig()))
    meta = ss.from_meta({})
    with pytest.raises(ValueError, match=r"root_inverse.failure_threshold = 0.1 \(Meta's "):
        ss.to_meta(dataclasses.replace(meta, root_inverse=ss.EighConfig(failure_threshold=0.1)))


#: Meta's AlgoPerf submission (ANCHORS.md C: block 1024, roots every 100 steps, fp32
#: factors) with Adam grafting, as in docs/migrating.md.
ALGOPERF_META = {
    "lr": 0.001, "betas": [0.9, 0.999], "epsilon": 1e-12, "weight_decay": 1e-5,
    "weight_decay_type": "DECOUPLED", "max_preconditioner_dim": 1024,
    "precondition_frequency": 100, "start_preconditioning_step": 100,
    "use_bias_correction": True,
    "grafting_config": {"type": "AdamPreconditionerConfig", "beta2": 0.999, "epsilon": 1e-8},
    "preconditioner_config": {"type": "RootInvShampooPreconditionerConfig",
                              "amortized_computation_config": {"type": "EigenConfig"},
                              "factor_matrix_dtype": "float32"},
}

#: Meta's README example 1 (SGD with momentum).
README_SGD_META = {
    "lr": 0.01, "betas": [0.0, 0.999], "epsilon": 1e-12, "weight_decay": 1e-5,
    "max_preconditioner_dim": 8192, "precondition_frequency": 100,
    "grafting_config": {"type": "SGDPreconditionerConfig"},
    "iterate_averaging_config": {"type": "ClassicMomentumConfig", "momentum": 0.9,
                                 "dampening": 0.0, "use_nesterov": False},
}

#: Google's MLPerf ResNet-50 run (ANCHORS.md C: block 128, SGD graft + Nesterov,
#: exponent_override 4, f32 roots), the other values illustrative as in docs/migrating.md.
MLPERF_GOOGLE = {
    "learning_rate": 0.1, "block_size": 128, "beta1": 0.9, "beta2": 0.95,
    "weight_decay": 5e-5, "start_preconditioning_step": 25,
    "preconditioning_compute_steps": 10, "graft_type": "SGD", "nesterov": True,
    "exponent_override": 4,
}


@pytest.mark.parametrize("kwargs", [ALGOPERF_META, README_SGD_META], ids=["algoperf", "readme"])
def test_real_meta_configs(kwargs: dict[str, Any]) -> None:
    c = ss.from_meta(kwargs)
    exported = ss.to_meta(c)
    assert ss.from_meta(exported) == c
    for key, value in kwargs.items():
        if key != "preconditioner_config" and key != "grafting_config":
            assert exported[key] == value, key


def test_real_google_config_in_float32() -> None:
    c = ss.from_google(MLPERF_GOOGLE, x64=False)
    assert c.factor_dtype == "float32"
    exported = ss.to_google(c)
    assert {k: exported[k] for k in MLPERF_GOOGLE} == MLPERF_GOOGLE
    assert ss.from_google(exported, x64=False) == c
    assert ss.from_google(exported) == dataclasses.replace(c, factor_dtype="float64")


@pytest.mark.parametrize("x64", [None, True, False])
def test_google_int8_momentum_round_trip(x64: bool | None) -> None:
    """best_effort_memory_usage_reduction (no batch_axis_name): int8 momentum only (eq. 20b),
    scales in the dtype Google computes in; a scale dtype other than that is inexpressible."""
    kwargs = {"learning_rate": 0.1, "block_size": 128, "best_effort_memory_usage_reduction": True}
    c = ss.from_google(kwargs, x64=x64)
    want = "float32" if x64 is False else "float64"
    assert c.momentum.storage == "int8_columnwise" and c.momentum.scale_dtype == want
    assert c.factor_dtype == want
    exported = ss.to_google(c)
    assert exported["best_effort_memory_usage_reduction"] is True
    assert ss.from_google(exported, x64=c.factor_dtype == "float64") == c
    other = "float64" if want == "float32" else "float32"
    moved = dataclasses.replace(c, momentum=dataclasses.replace(c.momentum, scale_dtype=other))
    with pytest.raises(ValueError, match=rf"momentum.scale_dtype = '{other}'"):
        ss.to_google(moved)
    plain = ss.from_google({**kwargs, "best_effort_memory_usage_reduction": False}, x64=x64)
    assert plain.momentum.storage == "float" and plain.momentum.scale_dtype == "float32"
    assert "best_effort_memory_usage_reduction" not in ss.to_google(plain)
    assert ss.from_google({**kwargs, "batch_axis_name": "batch"}, x64=x64).statistics.quantized


@pytest.mark.parametrize("x64", [None, True, False])
def test_google_int16_statistics_round_trip(x64: bool | None) -> None:
    """best_effort_memory_usage_reduction with batch_axis_name: int8 momentum (eq. 20b) and
    int16 statistics and roots (eq. 20c), both in the dtype Google computes in; exported
    with the axis "batch"; what Google cannot pair is named."""
    kwargs = {"learning_rate": 0.1, "block_size": 128, "best_effort_memory_usage_reduction": True,
              "batch_axis_name": "devices"}
    c = ss.from_google(kwargs, x64=x64)
    want = "float32" if x64 is False else "float64"
    assert c.statistics.storage == "int16_columnwise_diagonal"
    assert c.statistics.scale_dtype == c.momentum.scale_dtype == c.factor_dtype == want
    assert c.momentum.storage == "int8_columnwise"
    assert isinstance(c.root_inverse, ss.CoupledNewtonConfig)
    exported = ss.to_google(c)
    assert exported["best_effort_memory_usage_reduction"] is True
    assert exported["batch_axis_name"] == "batch"
    assert ss.from_google(exported, x64=c.factor_dtype == "float64") == c
    # The axis alone imports as before (it places root work only).
    assert not ss.from_google({**kwargs, "best_effort_memory_usage_reduction": False},
                              x64=x64).statistics.quantized
    other = "float64" if want == "float32" else "float32"
    moved = dataclasses.replace(c, statistics=dataclasses.replace(c.statistics,
                                                                  scale_dtype=other))
    with pytest.raises(ValueError, match=rf"statistics.scale_dtype = '{other}'"):
        ss.to_google(moved)
    alone = dataclasses.replace(c, momentum=dataclasses.replace(
        c.momentum, storage="float", scale_dtype="float32"))
    with pytest.raises(ValueError, match="momentum.storage = 'float'"):
        ss.to_google(alone)


def test_meta_exports_exponents_and_eigenvalue_correction() -> None:
    c = ss.from_meta({"preconditioner_config": {
        "type": "RootInvShampooPreconditionerConfig",
        "inverse_exponent_override": {"2": {"0": 0.0}, "3": 0.25}}})
    pc = ss.to_meta(c)["preconditioner_config"]
    assert pc["inverse_exponent_override"] == {2: {0: 0.0, 1: 0.25}, 3: 0.25}
    assert ss.from_meta(ss.to_meta(c)) == c
    corrected = ss.from_meta({"preconditioner_config": {
        "type": "EigenvalueCorrectedShampooPreconditionerConfig",
        "ignored_basis_change_dims": {"2": [1]},
        "inverse_exponent_override": {str(o): 0.25 for o in range(1, 65)}}})
    pc = ss.to_meta(corrected)["preconditioner_config"]
    assert pc["ignored_basis_change_dims"] == {2: [1]}
    assert set(pc["inverse_exponent_override"].values()) == {0.25}
    assert ss.from_meta(ss.to_meta(corrected)) == corrected


def test_single_root_override_exports_as_one_exponent() -> None:
    one = ss.ShampooConfig(
        gradient_filter=ss.GradientFilterConfig(beta1=0.9, bias_correction=True),
        statistics=ss.StatisticsConfig(bias_correction=True),
        failure=ss.FailureConfig(max_consecutive_root_failures=3),
        exponents=ss.ExponentConfig(overrides_by_order=(ss.OrderOverride(order=2, roots=(4.0,)),)),
    )
    exported = ss.to_meta(one)
    assert exported["preconditioner_config"]["inverse_exponent_override"] == {2: 0.25}
    back = ss.from_meta(exported)
    assert back.exponents.overrides_by_order == (ss.OrderOverride(order=2, roots=(4.0, 4.0)),)
    assert ss.plan_parameter((8, 8), back) == ss.plan_parameter((8, 8), one)


def test_roots_export_as_exact_reciprocals_or_are_named() -> None:
    for root in (0.0, 2.0, 3.0, 4.0, 6.0, 7.0, 8.0, 1.0 / 0.3):
        e = _export._reciprocal(root)
        assert e is not None and (root == 0.0 or 1.0 / e == root)
    # No float e has 1 / e == 49: Meta's exponent cannot state root 49 exactly.
    assert _export._reciprocal(49.0) is None
    meta = ss.from_meta({})
    odd = dataclasses.replace(meta, exponents=ss.ExponentConfig(
        overrides_by_order=(ss.OrderOverride(order=1, roots=(49.0,)),)))
    with pytest.raises(ValueError, match=r"exponents\.overrides_by_order\[order=1\]\.roots = "):
        ss.to_meta(odd)


def test_inexpressible_configs_name_each_option() -> None:
    google = ss.from_google(MLPERF_GOOGLE)
    with pytest.raises(ValueError) as error:
        ss.to_meta(google)
    named = _named(error)
    for path in ("epsilon.scale", "statistics.initial_value", "momentum.buffers",
                 "grafting.norm_scope", "root_inverse.retries", "schedule.period_anchor"):
        assert path in named, str(error.value)
    meta = ss.from_meta(ALGOPERF_META)
    with pytest.raises(ValueError) as error:
        ss.to_google(meta)
    named = _named(error)
    for path in ("gradient_filter.beta1", "grafting.type", "statistics.bias_correction",
                 "statistics.initial_value", "exponents.default"):
        assert path in named, str(error.value)
    assert "grafting.type = 'adam' (Google grafts with one of" in str(error.value)


def test_package_exports_the_exporters() -> None:
    assert {"to_meta", "to_google"} <= set(ss.__all__)
    assert ss.to_meta is meta_exporter.to_meta and ss.to_google is google_exporter.to_google


def test_meta_eigenvalue_correction_without_graft_needs_start_1() -> None:
    """Without a graft Meta applies the correction from step 1 (identity basis before
    the first eigenbasis): a later start is named; start 1 round-trips."""
    c = ss.ShampooConfig(
        eigenvalue_correction=ss.EigenvalueCorrectionConfig(beta2=0.99, epsilon=1e-8),
        statistics=ss.StatisticsConfig(beta2=0.99, bias_correction=True),
        gradient_filter=ss.GradientFilterConfig(bias_correction=True),
        epsilon=ss.EpsilonConfig(value=1e-8),
        schedule=ss.ScheduleConfig(precondition_frequency=5, start_preconditioning_step=5),
        failure=ss.FailureConfig(max_consecutive_root_failures=3),
    )
    with pytest.raises(ValueError, match="schedule.start_preconditioning_step = 5"):
        ss.to_meta(c)
    one = dataclasses.replace(c, schedule=ss.ScheduleConfig(start_preconditioning_step=1))
    assert ss.from_meta(ss.to_meta(one)) == one


def test_meta_names_int16_factor_storage() -> None:
    """Eq. (20c) is Google's; Meta keeps its factors and roots in float."""
    c = dataclasses.replace(
        ss.from_meta({"lr": 0.1}), root_inverse=ss.CoupledNewtonConfig(),
        statistics=dataclasses.replace(ss.from_meta({"lr": 0.1}).statistics,
                                       storage="int16_columnwise_diagonal"))
    with pytest.raises(ValueError, match="statistics.storage = 'int16_columnwise_diagonal'"):
        ss.to_meta(c)
