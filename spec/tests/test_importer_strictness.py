"""The importers read hostile JSON strictly: every refusal is a ValueError naming
the key path, the value and what is allowed; valid inputs map as before."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

import shampoo_spec as ss

GOOGLE = {"learning_rate": 0.1, "block_size": 8}
EIGEN_CORRECTED = {"type": "EigenvalueCorrectedShampooPreconditionerConfig"}
NEWTON = {"type": "CoupledNewtonConfig"}
ROOT_INV = {"type": "RootInvShampooPreconditionerConfig"}
TOLERATED = "num_tolerated_failed_amortized_computations"


def _refused(importer: Any, kwargs: dict[str, Any], path: str, allowed: str) -> str:
    """Run ``importer`` and check its ValueError names ``path`` = value and ``allowed``."""
    with pytest.raises(ValueError) as info:
        importer(kwargs)
    message = str(info.value)
    assert type(info.value) is ValueError, message
    assert re.search(rf"(^|[ .]){re.escape(path)} = ", message), message
    assert "is invalid: allowed" in message and allowed in message, message
    return message


# ------------------------------------------------------------------ booleans
@pytest.mark.parametrize("bad", ["false", "true", 0, 1, None, 0.0, [], "False"])
@pytest.mark.parametrize(
    ("key", "kwargs"),
    [
        ("nesterov", {}),
        ("eigh", {}),
        ("relative_matrix_epsilon", {}),
        ("decoupled_learning_rate", {}),
        ("decoupled_weight_decay", {}),
        ("moving_average_for_momentum", {}),
    ],
)
def test_google_booleans_must_be_bools(key: str, kwargs: dict[str, Any], bad: Any) -> None:
    message = _refused(ss.from_google, {**GOOGLE, **kwargs, key: bad}, key, "true or false")
    assert repr(bad) in message


def test_google_nesterov_none_is_not_false() -> None:
    _refused(ss.from_google, {**GOOGLE, "nesterov": None}, "nesterov", "true or false")
    assert ss.from_google({**GOOGLE, "nesterov": False}).momentum.nesterov is False
    assert ss.from_google({**GOOGLE, "nesterov": True}).momentum.nesterov is True
    assert ss.from_google(GOOGLE).momentum.nesterov is True


def test_google_valid_booleans_map_as_before() -> None:
    c = ss.from_google(
        {**GOOGLE, "eigh": True, "relative_matrix_epsilon": False,
         "decoupled_weight_decay": True, "moving_average_for_momentum": True}
    )
    assert isinstance(c.root_inverse, ss.EighConfig)
    assert c.epsilon.scale == "absolute"
    assert c.weight_decay.type == "update"
    assert c.momentum.dampening == 0.9


@pytest.mark.parametrize("bad", ["false", 0, 1, None, "yes"])
@pytest.mark.parametrize(
    ("kwargs", "path"),
    [
        ({"use_bias_correction": "BAD"}, "use_bias_correction"),
        ({"use_nesterov": "BAD"}, "use_nesterov"),
        ({"use_decoupled_weight_decay": "BAD"}, "use_decoupled_weight_decay"),
        ({"use_merge_dims": "BAD"}, "use_merge_dims"),
        ({"iterate_averaging_config": {"type": "ClassicMomentumConfig", "use_nesterov": "BAD"}},
         "iterate_averaging_config.use_nesterov"),
        ({"preconditioner_config": {**ROOT_INV, "amortized_computation_config": {
            "type": "EigenConfig", "rank_deficient_stability_config": {
                "type": "PerturbationConfig", "perturb_before_computation": "BAD"}}}},
         "preconditioner_config.amortized_computation_config.rank_deficient_stability_config"
         ".perturb_before_computation"),
    ],
)
def test_meta_booleans_must_be_bools(kwargs: dict[str, Any], path: str, bad: Any) -> None:
    _refused(ss.from_meta, _substitute(kwargs, bad), path, "true or false")


def test_meta_false_string_is_not_true() -> None:
    """``bool("false")`` is True: the strict reader never lets that through."""
    with pytest.raises(ValueError, match="use_bias_correction = 'false'"):
        ss.from_meta({"use_bias_correction": "false"})
    c = ss.from_meta({"use_bias_correction": False, "use_nesterov": True, "momentum": 0.5})
    assert c.statistics.bias_correction is False and c.gradient_filter.bias_correction is False
    assert c.momentum.nesterov is True
    assert ss.from_meta({"use_decoupled_weight_decay": False}).weight_decay.type == "l2"


def test_meta_use_merge_dims_false_still_unsupported() -> None:
    with pytest.raises(NotImplementedError, match="use_merge_dims"):
        ss.from_meta({"use_merge_dims": False})


# ------------------------------------------------------------------ integers
@pytest.mark.parametrize(
    ("key", "bad", "allowed"),
    [
        ("block_size", "inf", "an integer in ["),
        ("block_size", 2.5, "an integer in ["),
        ("block_size", float("inf"), "an integer in ["),
        ("block_size", float("nan"), "an integer in ["),
        ("block_size", 10**12, "an integer in ["),
        ("block_size", 10**400, "an integer in ["),
        ("block_size", True, "an integer in ["),
        ("start_preconditioning_step", "inf", "an integer in [0, 2147483646]"),
        ("start_preconditioning_step", 2.5, "an integer in [0, 2147483646]"),
        ("start_preconditioning_step", 10**400, "an integer in [0, 2147483646]"),
        ("start_preconditioning_step", 2**31 - 1, "an integer in [0, 2147483646]"),
        ("start_preconditioning_step", -1, "an integer in [0, 2147483646]"),
        ("preconditioning_compute_steps", 1.5, "an integer in [1, 2147483647]"),
        ("preconditioning_compute_steps", "inf", "an integer in [1, 2147483647]"),
        ("preconditioning_compute_steps", 0, "an integer in [1, 2147483647]"),
        ("statistics_compute_steps", "inf", "an integer in [1, 2147483647]"),
        ("statistics_compute_steps", 2**40, "an integer in [1, 2147483647]"),
        ("skip_preconditioning_rank_lt", 1.5, "an integer in ["),
        ("skip_preconditioning_rank_lt", "inf", "an integer in ["),
        ("skip_preconditioning_dim_size_gt", 2.5, "an integer >= 1 or inf"),
        ("skip_preconditioning_dim_size_gt", 0, "an integer >= 1 or inf"),
        ("skip_preconditioning_dim_size_gt", 10**12, "an integer >= 1 or inf"),
        ("skip_preconditioning_dim_size_gt", float("nan"), "an integer >= 1 or inf"),
        ("merge_small_dims_block_size", 1e300, "an integer >= 1 or inf"),
        ("merge_small_dims_block_size", "many", "an integer >= 1 or inf"),
    ],
)
def test_google_integers_are_integral_and_bounded(key: str, bad: Any, allowed: str) -> None:
    _refused(ss.from_google, {**GOOGLE, key: bad}, key, allowed)


def test_google_integral_floats_and_inf_bounds_map_as_before() -> None:
    as_int = ss.from_google({**GOOGLE, "start_preconditioning_step": 3,
                             "preconditioning_compute_steps": 2})
    as_float = ss.from_google({**GOOGLE, "block_size": 8.0, "start_preconditioning_step": 3.0,
                               "preconditioning_compute_steps": 2.0})
    assert as_int == as_float
    assert as_int.schedule.start_preconditioning_step == 4
    assert as_int.schedule.precondition_frequency == 2
    assert ss.from_google({**GOOGLE, "block_size": 0}).blocking.max_preconditioner_dim == (
        ss.MAX_INTEGER
    )
    unbounded = ss.from_google({**GOOGLE, "skip_preconditioning_dim_size_gt": "inf",
                                "merge_small_dims_block_size": float("inf")})
    assert unbounded.blocking.skip_dim_size_gt == ss.MAX_INTEGER
    assert unbounded.blocking.merge_dims_up_to == ss.MAX_INTEGER
    limit = ss.from_google({**GOOGLE, "start_preconditioning_step": 2**31 - 2})
    assert limit.schedule.start_preconditioning_step == ss.MAX_INTEGER


def test_google_rank_below_one_preconditions_scalars_without_a_factor() -> None:
    for rank_lt in (0, -3):
        b = ss.from_google({**GOOGLE, "skip_preconditioning_rank_lt": rank_lt}).blocking
        assert (b.skip_rank_lt, b.scalar_factor) == (0, False)
        plan = ss.plan_parameter((), ss.ShampooConfig(blocking=b))
        assert plan.preconditioned and [blk.roots for blk in plan.blocks] == [(0.0,)]
    b = ss.from_google({**GOOGLE, "skip_preconditioning_rank_lt": 1}).blocking
    assert (b.skip_rank_lt, b.scalar_factor) == (1, True)


@pytest.mark.parametrize(
    ("kwargs", "path", "allowed"),
    [
        ({"precondition_frequency": "inf"}, "precondition_frequency", "an integer in [1, "),
        ({"precondition_frequency": 2.5}, "precondition_frequency", "an integer in [1, "),
        ({"precondition_frequency": 10**400}, "precondition_frequency", "an integer in [1, "),
        ({"precondition_frequency": 2**31}, "precondition_frequency", "an integer in [1, "),
        ({"start_preconditioning_step": "inf"}, "start_preconditioning_step",
         "an integer in [-1, "),
        ({"start_preconditioning_step": 2.5}, "start_preconditioning_step",
         "an integer in [-1, "),
        ({"start_preconditioning_step": -2}, "start_preconditioning_step",
         "an integer in [-1, "),
        ({"max_preconditioner_dim": 2.5}, "max_preconditioner_dim", "an integer >= 1 or inf"),
        ({"max_preconditioner_dim": 10**12}, "max_preconditioner_dim",
         "an integer >= 1 or inf"),
        ({"preconditioner_config": {**ROOT_INV, TOLERATED: "inf"}},
         "preconditioner_config.num_tolerated_failed_amortized_computations",
         "an integer in [0, "),
        ({"preconditioner_config": {**ROOT_INV, TOLERATED: 1.5}},
         "preconditioner_config.num_tolerated_failed_amortized_computations",
         "an integer in [0, "),
        ({"preconditioner_config": {**ROOT_INV, TOLERATED: 10**400}},
         "preconditioner_config.num_tolerated_failed_amortized_computations",
         "an integer in [0, "),
        ({"preconditioner_config": {**ROOT_INV, "amortized_computation_config": {**NEWTON,
                                                                     "max_iterations": "100"}}},
         "preconditioner_config.amortized_computation_config.max_iterations",
         "an integer in [1, 10000]"),
        ({"preconditioner_config": {**ROOT_INV, "amortized_computation_config": {**NEWTON,
                                                                     "max_iterations": 2.5}}},
         "preconditioner_config.amortized_computation_config.max_iterations",
         "an integer in [1, 10000]"),
        ({"preconditioner_config": {**ROOT_INV, "amortized_computation_config": {**NEWTON,
                                                                     "max_iterations": 10**6}}},
         "preconditioner_config.amortized_computation_config.max_iterations",
         "an integer in [1, 10000]"),
        ({"preconditioner_config": {**ROOT_INV, "amortized_computation_config": {**NEWTON,
                                                                     "max_iterations": True}}},
         "preconditioner_config.amortized_computation_config.max_iterations",
         "an integer in [1, 10000]"),
        ({"preconditioner_config": {**ROOT_INV, "amortized_computation_config": {**NEWTON,
                                                                     "tolerance": "inf"}}},
         "preconditioner_config.amortized_computation_config.tolerance", "a finite number"),
    ],
)
def test_meta_integers_are_integral_and_bounded(
    kwargs: dict[str, Any], path: str, allowed: str
) -> None:
    _refused(ss.from_meta, kwargs, path, allowed)


def test_meta_integral_floats_map_as_before() -> None:
    as_int = ss.from_meta({"precondition_frequency": 3, "start_preconditioning_step": 6,
                           "preconditioner_config": {**ROOT_INV,
                               "num_tolerated_failed_amortized_computations": 2,
                               "amortized_computation_config": {**NEWTON, "max_iterations": 50}}})
    as_float = ss.from_meta({"precondition_frequency": 3.0, "start_preconditioning_step": 6.0,
                             "preconditioner_config": {**ROOT_INV,
                                 "num_tolerated_failed_amortized_computations": 2.0,
                                 "amortized_computation_config": {**NEWTON,
                                                                  "max_iterations": 50.0}}})
    assert as_int == as_float
    assert as_int.schedule.precondition_frequency == 3
    assert as_int.schedule.start_preconditioning_step == 6
    assert as_int.failure.max_consecutive_root_failures == 2
    assert isinstance(as_int.root_inverse, ss.CoupledNewtonConfig)
    assert as_int.root_inverse.max_iterations == 50
    assert ss.from_meta({"max_preconditioner_dim": "inf"}).blocking.max_preconditioner_dim == (
        ss.MAX_INTEGER
    )
    assert ss.from_meta({"precondition_frequency": 4}).schedule.start_preconditioning_step == 4


# ------------------------------------------------------------------ reals
@pytest.mark.parametrize("bad", ["inf", float("inf"), float("nan"), 10**400, "-inf", "1e-3"])
@pytest.mark.parametrize("key", ["learning_rate", "beta2", "diagonal_epsilon", "matrix_epsilon",
                                 "weight_decay", "inverse_failure_threshold", "exponent_override",
                                 "beta1"])
def test_google_reals_are_finite(key: str, bad: Any) -> None:
    _refused(ss.from_google, {**GOOGLE, key: bad}, key, "a finite number")


@pytest.mark.parametrize("bad", ["inf", float("nan"), 10**400, -(10**400)])
@pytest.mark.parametrize(
    ("kwargs", "path"),
    [
        ({"lr": "BAD"}, "lr"),
        ({"epsilon": "BAD"}, "epsilon"),
        ({"beta3": "BAD"}, "beta3"),
        ({"weight_decay": "BAD"}, "weight_decay"),
        ({"momentum": "BAD"}, "momentum"),
        ({"betas": [0.9, "BAD"]}, "betas[1]"),
        ({"grafting_config": {"type": "AdamPreconditionerConfig", "epsilon": "BAD"}},
         "grafting_config.epsilon"),
        ({"iterate_averaging_config": {"type": "ClassicMomentumConfig", "dampening": "BAD"}},
         "iterate_averaging_config.dampening"),
    ],
)
def test_meta_reals_are_finite(kwargs: dict[str, Any], path: str, bad: Any) -> None:
    _refused(ss.from_meta, _substitute(kwargs, bad), path, "a finite number")


# ------------------------------------------------------------------ exponent overrides
def _override(value: Any, corrected: bool = False) -> dict[str, Any]:
    base = EIGEN_CORRECTED if corrected else {"type": "RootInvShampooPreconditionerConfig"}
    return {"preconditioner_config": {**base, "inverse_exponent_override": value}}


@pytest.mark.parametrize(
    ("override", "path", "allowed"),
    [
        ({"x": 0.5}, "preconditioner_config.inverse_exponent_override key",
         "an integer in [0, 64]"),
        ({"2.5": 0.5}, "preconditioner_config.inverse_exponent_override key",
         "an integer in [0, 64]"),
        ({2.5: 0.5}, "preconditioner_config.inverse_exponent_override key",
         "an integer in [0, 64]"),
        ({"-1": 0.5}, "preconditioner_config.inverse_exponent_override key",
         "an integer in [0, 64]"),
        ({"65": 0.5}, "preconditioner_config.inverse_exponent_override key",
         "an integer in [0, 64]"),
        ({str(2**31 - 1): 0.5}, "preconditioner_config.inverse_exponent_override key",
         "an integer in [0, 64]"),
        ({"2": {"x": 0.5}}, "preconditioner_config.inverse_exponent_override.2 key",
         "an integer in [0, 64]"),
        ({"2": "inf"}, "preconditioner_config.inverse_exponent_override.2", "a finite number"),
        ({"2": -0.5}, "preconditioner_config.inverse_exponent_override.2", "an exponent >= 0"),
        ({"2": 1e-320}, "preconditioner_config.inverse_exponent_override.2", "1/e finite"),
        ({"2": {"1": float("nan")}}, "preconditioner_config.inverse_exponent_override.2.1",
         "a finite number"),
        ([0.5], "preconditioner_config.inverse_exponent_override", "an object mapping"),
    ],
)
def test_meta_override_keys_and_exponents(override: Any, path: str, allowed: str) -> None:
    with pytest.raises(ValueError) as info:
        ss.from_meta(_override(override))
    message = str(info.value)
    assert type(info.value) is ValueError
    assert path + " = " in message and allowed in message, message


def test_meta_override_duplicate_order_refused() -> None:
    with pytest.raises(ValueError, match=r"inverse_exponent_override names 1 twice"):
        ss.from_meta(_override({1: 0.5, "1": 0.25}))


def test_meta_override_int_and_string_keys_map_alike() -> None:
    by_string = ss.from_meta(_override({"1": 0.5, "2": {"1": 0.125}, "3": 0}))
    by_int = ss.from_meta(_override({1: 0.5, 2: {1: 0.125}, 3: 0.0}))
    assert by_string == by_int
    assert by_int.exponents.overrides_by_order == (
        ss.OrderOverride(order=1, roots=(2.0,)),
        ss.OrderOverride(order=2, roots=(4.0, 8.0)),
        ss.OrderOverride(order=3, roots=(0.0, 0.0, 0.0)),
    )


@pytest.mark.parametrize("exponent", [0, 0.0, -0.5, "inf", float("nan"), 1e-320])
def test_meta_eigenvalue_corrected_exponent_must_be_positive(exponent: Any) -> None:
    with pytest.raises(ValueError) as info:  # never ZeroDivisionError
        ss.from_meta(_override({"2": exponent}, corrected=True))
    message = str(info.value)
    assert type(info.value) is ValueError
    assert "preconditioner_config.inverse_exponent_override.2 = " in message, message
    assert "allowed" in message


def test_meta_eigenvalue_corrected_keys_must_be_orders() -> None:
    with pytest.raises(ValueError, match=r"inverse_exponent_override key = 'x'"):
        ss.from_meta(_override({"x": 0.25}, corrected=True))
    c = ss.from_meta(_override({"1": 0.25, 2: 0.25}, corrected=True))
    assert c.eigenvalue_correction is not None
    assert c.eigenvalue_correction.roots_by_order == ((1, 4.0), (2, 4.0))


@pytest.mark.parametrize(
    ("ignored", "path"),
    [
        ({"2": "0"}, "preconditioner_config.ignored_basis_change_dims.2"),
        ({"2": [0.5]}, "preconditioner_config.ignored_basis_change_dims.2[]"),
        ({"x": [0]}, "preconditioner_config.ignored_basis_change_dims key"),
        ([0], "preconditioner_config.ignored_basis_change_dims"),
    ],
)
def test_meta_ignored_basis_change_dims_are_integers(ignored: Any, path: str) -> None:
    config = {"preconditioner_config": {**EIGEN_CORRECTED, "ignored_basis_change_dims": ignored}}
    with pytest.raises(ValueError) as info:
        ss.from_meta(config)
    assert type(info.value) is ValueError
    assert path + " = " in str(info.value), str(info.value)


def test_meta_ignored_basis_change_dims_map_as_before() -> None:
    config = {"preconditioner_config": {**EIGEN_CORRECTED, "ignored_basis_change_dims": {"2": [0]}}}
    assert ss.from_meta(config).exponents.overrides_by_order == (
        ss.OrderOverride(order=2, roots=(0.0, 4.0)),
    )


# ------------------------------------------------------------------ helpers
def _substitute(data: Any, value: Any) -> Any:
    """``data`` with every ``"BAD"`` replaced by ``value``."""
    if data == "BAD":
        return value
    if isinstance(data, dict):
        return {k: _substitute(v, value) for k, v in data.items()}
    if isinstance(data, list):
        return [_substitute(v, value) for v in data]
    return data


# ------------------------------------------------------- enum and dtype forms
@pytest.mark.parametrize(
    ("spelled", "expected"),
    [("ADAGRAD", "adagrad"), ("GraftingType.ADAGRAD", "adagrad"), (2, "adagrad"),
     ("distributed_shampoo.GraftingType.SQRT_N", "sign"), (5, "sign"), (0, "none"),
     ("GraftingType.RMSPROP_NORMALIZED", "rmsprop_normalized"), (6, "adagrad_normalized")],
)
def test_google_graft_type_by_name_enum_name_or_value(spelled: Any, expected: str) -> None:
    assert ss.from_google({**GOOGLE, "graft_type": spelled, "beta2": 0.9}).grafting.type == expected


@pytest.mark.parametrize("bad", [7, -1, True, 2.0, "ADAM", "GraftingType.ADAM",
                                 "PreconditionerType.ALL", "graftingtype.SGD", None])
def test_google_graft_type_refusals_name_path_value_and_allowed(bad: Any) -> None:
    message = _refused(ss.from_google, {**GOOGLE, "graft_type": bad}, "graft_type",
                       "(or GraftingType.NAME, or the value: 0=NONE, 1=SGD, 2=ADAGRAD")
    assert repr(bad) in message


@pytest.mark.parametrize(
    ("spelled", "expected"),
    [("INPUT", "all_but_last"), ("PreconditionerType.INPUT", "all_but_last"), (2, "all_but_last"),
     (3, "last"), ("PreconditionerType.OUTPUT", "last"), (1, "all")],
)
def test_google_preconditioner_type_forms(spelled: Any, expected: str) -> None:
    for key in ("precondtioner_type", "preconditioner_type"):
        c = ss.from_google({**GOOGLE, key: spelled})
        assert c.blocking.preconditioned_dims == expected


def test_google_preconditioner_type_refused() -> None:
    _refused(ss.from_google, {**GOOGLE, "precondtioner_type": 4}, "preconditioner_type",
             "1=ALL, 2=INPUT, 3=OUTPUT")


@pytest.mark.parametrize("spelled", ["HIGHEST", "Precision.HIGH", "lax.Precision.DEFAULT", 2, 0])
def test_google_precision_forms_have_no_numerical_effect(spelled: Any) -> None:
    for key in ("precision", "tensordot_precision"):
        assert ss.from_google({**GOOGLE, key: spelled}) == ss.from_google(GOOGLE)


@pytest.mark.parametrize(
    ("kwargs", "path", "allowed"),
    [({"precision": "FASTEST"}, "precision", "Precision.NAME"),
     ({"tensordot_precision": 3}, "tensordot_precision", "0=DEFAULT, 1=HIGH, 2=HIGHEST"),
     ({"generate_training_metrics": "no"}, "generate_training_metrics", "true or false"),
     ({"reuse_preconditioner": 1}, "reuse_preconditioner", "true or false"),
     ({"batch_axis_name": 3}, "batch_axis_name", "null or a mesh axis name (a string)"),
     ({"statistics_partition_spec": "mdl"}, "statistics_partition_spec",
      "null or a list of entries, each null, an axis name or a list of axis names"),
     ({"preconditioner_partition_spec": [["a", 1]]}, "preconditioner_partition_spec",
      "null or a list of entries")],
)
def test_google_no_effect_keys_are_read_strictly(
    kwargs: dict[str, Any], path: str, allowed: str
) -> None:
    _refused(ss.from_google, {**GOOGLE, **kwargs}, path, allowed)
    assert ss.from_google(
        {**GOOGLE, "generate_training_metrics": False, "reuse_preconditioner": True,
         "batch_axis_name": "batch", "statistics_partition_spec": [None, ["data", "mdl"]],
         "preconditioner_partition_spec": [], "num_devices_for_pjit": 2}
    ) == ss.from_google(GOOGLE)


def test_google_x64_sets_the_factor_dtype() -> None:
    assert ss.from_google(GOOGLE).factor_dtype == "float64"  # None: as before x64 existed
    assert ss.from_google(GOOGLE, x64=True).factor_dtype == "float64"
    assert ss.from_google(GOOGLE, x64=False).factor_dtype == "float32"
    assert ss.from_google(GOOGLE, x64=False) == dataclasses.replace(
        ss.from_google(GOOGLE), factor_dtype="float32"
    )
    with pytest.raises(ValueError, match="x64 = 1 is invalid: allowed true, false or None"):
        ss.from_google(GOOGLE, x64=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("spelled", ["DECOUPLED", "WeightDecayType.DECOUPLED",
                                     "distributed_shampoo.shampoo_types.WeightDecayType.L2"])
def test_meta_weight_decay_type_forms(spelled: str) -> None:
    c = ss.from_meta({"weight_decay": 0.1, "weight_decay_type": spelled})
    assert c.weight_decay.type == ("l2" if spelled.endswith("L2") else "direction")


@pytest.mark.parametrize("bad", ["decoupled", "GraftingType.L2", 1, None, "WeightDecayType."])
def test_meta_weight_decay_type_refused(bad: Any) -> None:
    _refused(ss.from_meta, {"weight_decay_type": bad}, "weight_decay_type",
             "['CORRECTED', 'DECOUPLED', 'INDEPENDENT', 'L2'] (or WeightDecayType.NAME)")


@pytest.mark.parametrize("spelled", ["float64", "torch.float64"])
@pytest.mark.parametrize("key", ["factor_matrix_dtype", "inv_factor_matrix_dtype"])
def test_meta_dtype_forms(spelled: str, key: str) -> None:
    c = ss.from_meta({"preconditioner_config": {**ROOT_INV, key: spelled}})
    assert c.factor_dtype == ("float64" if key == "factor_matrix_dtype" else "float32")
    # float64 factors with Meta's default float32 roots; float32 factors with float64 roots.
    assert c.inverse_root_dtype == ("float32" if key == "factor_matrix_dtype" else "float64")


@pytest.mark.parametrize(
    ("factor", "inv", "expected"),
    [
        (None, None, None),  # Meta's defaults: float32 factors and roots
        ("float64", None, "float32"),  # Meta's default roots are float32 whatever the factors
        ("float64", "float64", None),
        ("float64", "torch.float32", "float32"),
        ("float64", "bfloat16", "bfloat16"),
        ("float32", "float16", "float16"),
        ("float32", "torch.float32", None),
        ("float32", "float64", "float64"),
    ],
)
def test_meta_inv_factor_matrix_dtype_maps_to_inverse_root_dtype(
    factor: str | None, inv: str | None, expected: str | None
) -> None:
    """Eqs. (11a), (16): Meta's root storage dtype, None where it is the factor dtype."""
    pc: dict[str, Any] = dict(ROOT_INV)
    if factor is not None:
        pc["factor_matrix_dtype"] = factor
    if inv is not None:
        pc["inv_factor_matrix_dtype"] = inv
    c = ss.from_meta({"preconditioner_config": pc})
    assert c.inverse_root_dtype == expected
    assert ss.from_meta(ss.to_meta(c)) == c


def test_meta_inv_factor_matrix_dtype_refused_with_eigenvalue_correction() -> None:
    """Meta's EigenvalueCorrected config has no inv_factor_matrix_dtype: refused, not ignored."""
    _refused(ss.from_meta, {"preconditioner_config": {**EIGEN_CORRECTED,
                                                      "inv_factor_matrix_dtype": "float64"}},
             "preconditioner_config.inv_factor_matrix_dtype",
             "only with RootInvShampooPreconditionerConfig")
    assert ss.from_meta({"preconditioner_config": EIGEN_CORRECTED}).inverse_root_dtype is None


@pytest.mark.parametrize(
    ("factor", "stored", "expected"),
    [
        (None, None, None),  # Meta's defaults: float32 factors, Q_k and D
        ("float64", None, "float32"),  # Meta's defaults are float32 whatever the factors
        ("float64", "float64", None),
        ("float64", "torch.bfloat16", "bfloat16"),
        ("float64", "float16", "float16"),
        (None, "float64", "float64"),
        (None, "torch.float32", None),
    ],
)
@pytest.mark.parametrize(("key", "field"),
                         [("factor_matrix_eigenvectors_dtype", "eigenvectors_dtype"),
                          ("corrected_eigenvalues_dtype", "corrected_eigenvalues_dtype")])
def test_meta_eigenvalue_correction_dtypes_map_to_eq17a(
    key: str, field: str, factor: str | None, stored: str | None, expected: str | None
) -> None:
    """Eq. (17a): Meta's storage dtypes of Q_k and D, None where it is the factor dtype;
    they are no longer accepted and ignored."""
    pc: dict[str, Any] = dict(EIGEN_CORRECTED)
    if factor is not None:
        pc["factor_matrix_dtype"] = factor
    if stored is not None:
        pc[key] = stored
    c = ss.from_meta({"preconditioner_config": pc, "epsilon": 1e-4})
    assert c.eigenvalue_correction is not None
    assert getattr(c.eigenvalue_correction, field) == expected
    assert ss.from_meta(ss.to_meta(c)) == c
    assert ss.to_meta(c)["preconditioner_config"][key] == (
        expected or ("float64" if factor == "float64" else "float32"))


@pytest.mark.parametrize("key", ["factor_matrix_eigenvectors_dtype",
                                 "corrected_eigenvalues_dtype"])
def test_meta_eigenvalue_correction_dtypes_refused_with_root_inverse(key: str) -> None:
    """Meta's RootInv config has neither field: refused, not ignored."""
    _refused(ss.from_meta, {"preconditioner_config": {**ROOT_INV, key: "float32"}},
             f"preconditioner_config.{key}",
             "only with EigenvalueCorrectedShampooPreconditionerConfig")


def test_meta_float16_corrected_eigenvalues_need_an_epsilon_float16_holds() -> None:
    """Eq. (17a): Meta adds epsilon to D in float16; its default 1e-12 is 0 there (Meta
    then divides 0 by 0 wherever D is 0): refused, naming the epsilon."""
    pc = {**EIGEN_CORRECTED, "corrected_eigenvalues_dtype": "float16"}
    with pytest.raises(ValueError, match=r"eigenvalue_correction.epsilon = 1e-12 is invalid"):
        ss.from_meta({"preconditioner_config": pc})
    c = ss.from_meta({"preconditioner_config": pc, "epsilon": 1e-6})
    assert c.eigenvalue_correction is not None
    assert c.eigenvalue_correction.corrected_eigenvalues_dtype == "float16"


def test_google_has_no_inverse_root_dtype() -> None:
    """Google keeps preconditioners in its computation dtype: None, and to_google refuses one."""
    assert ss.from_google(GOOGLE).inverse_root_dtype is None
    with pytest.raises(ValueError, match=r"inverse_root_dtype = 'float32' \(Google keeps"):
        ss.to_google(dataclasses.replace(ss.from_google(GOOGLE), inverse_root_dtype="float32"))


@pytest.mark.parametrize("bad", ["jnp.float64", "torch.int32", "double", 64, None, "float"])
@pytest.mark.parametrize("key", ["factor_matrix_dtype", "inv_factor_matrix_dtype",
                                 "corrected_eigenvalues_dtype",
                                 "factor_matrix_eigenvectors_dtype"])
def test_meta_dtypes_refused_naming_path_value_and_allowed(bad: Any, key: str) -> None:
    config = {**EIGEN_CORRECTED, key: bad}
    _refused(ss.from_meta, {"preconditioner_config": config}, f"preconditioner_config.{key}",
             "a floating dtype, one of ['bfloat16', 'float16', 'float32', 'float64']")


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
@pytest.mark.parametrize("inv", [None, "float32", "float64", "bfloat16"])
def test_meta_low_precision_factors_import_as_factor_storage_dtype(
        low: str, inv: str | None) -> None:
    """Eq. (11b): a bfloat16/float16 factor_matrix_dtype is stored in it, computed in
    float64 (Meta's eigh retry); the roots' dtype as before (float32 by default)."""
    pc: dict[str, Any] = {**ROOT_INV, "factor_matrix_dtype": f"torch.{low}"}
    if inv is not None:
        pc["inv_factor_matrix_dtype"] = inv
    c = ss.from_meta({"preconditioner_config": pc, "epsilon": 1e-6})
    assert (c.factor_storage_dtype, c.factor_dtype) == (low, "float64")
    assert c.inverse_root_dtype == (None if inv == "float64" else inv or "float32")
    assert ss.from_meta(ss.to_meta(c)) == c


@pytest.mark.parametrize(("extra", "key"), [
    ({"amortized_computation_config": {"type": "CoupledNewtonConfig"}},
     "amortized_computation_config"),
    ({"amortized_computation_config": {"type": "EigenConfig", "rank_deficient_stability_config":
                                       {"type": "PseudoInverseConfig"}}},
     "amortized_computation_config"),
    ({"use_trace_scaling": True}, "use_trace_scaling"),
    ({"use_symmetric_packing": False}, "use_symmetric_packing"),
])
def test_meta_low_precision_factors_refused_where_not_specified(
        extra: dict[str, Any], key: str) -> None:
    pc = {**ROOT_INV, "factor_matrix_dtype": "bfloat16", **extra}
    eps = 0.0 if "PseudoInverseConfig" in str(extra) else 1e-6
    with pytest.raises(NotImplementedError,
                       match=f"factor_matrix_dtype = 'bfloat16' with preconditioner_config.{key}"):
        ss.from_meta({"preconditioner_config": pc, "epsilon": eps})
    with pytest.raises(NotImplementedError, match="EigenvalueCorrectedShampooPreconditionerConfig"):
        ss.from_meta({"preconditioner_config": {**EIGEN_CORRECTED,
                                                "factor_matrix_dtype": "bfloat16"}})


def test_meta_float16_factors_need_epsilon_representable_in_float16() -> None:
    with pytest.raises(ValueError, match=r"epsilon.value = 1e-12 .* >= 2\^-24"):
        ss.from_meta({"preconditioner_config": {**ROOT_INV, "factor_matrix_dtype": "float16"}})


def test_to_meta_refuses_factor_storage_with_float32_work() -> None:
    c = ss.from_meta({"preconditioner_config": {**ROOT_INV, "factor_matrix_dtype": "bfloat16"}})
    with pytest.raises(ValueError, match="factor_dtype = 'float32'"):
        ss.to_meta(dataclasses.replace(c, factor_dtype="float32"))
    with pytest.raises(ValueError, match="factor_storage_dtype = 'bfloat16'"):
        ss.to_google(dataclasses.replace(
            ss.from_google({**GOOGLE, "eigh": True, "relative_matrix_epsilon": False}),
            root_inverse=ss.EighConfig(), factor_storage_dtype="bfloat16",
            epsilon=ss.EpsilonConfig(value=1e-6, placement="ridge"),
            statistics=ss.StatisticsConfig(beta2=0.999, initial_value="zero")))


def test_meta_keys_of_this_snapshot_are_accepted() -> None:
    # Constructor argument and config fields of Meta @ f606606 with no numerical effect.
    same = ss.from_meta({
        "concurrency_config": {"type": "ConcurrencyConfig",
                               "enable_cuda_stream_for_param_groups": False},
        "preconditioner_config": {**ROOT_INV, "amortized_computation_config": {
            "type": "EigenConfig", "eigendecomposition_offload_device": "cpu"}},
    })
    assert same == ss.from_meta({})


@pytest.mark.parametrize(
    ("importer", "kwargs", "argument"),
    [
        (ss.from_google,
         {"learning_rate": 0.1, "block_size": 128, "inverse_failure_threshold": 0.0},
         "inverse_failure_threshold"),
        (ss.from_google, {"learning_rate": 0.1, "block_size": 128, "beta1": 1e20}, "beta1"),
        (ss.from_meta, {"betas": [1.0, 1.0]}, "betas"),
    ],
)
def test_config_errors_name_the_anchor_argument(importer: Any, kwargs: dict[str, Any],
                                                argument: str) -> None:
    """A value our config refuses is reported with the anchor's argument, not only our field."""
    with pytest.raises(ValueError, match=rf"^from_(meta|google): {argument} = "):
        importer(kwargs)


def test_meta_eigh_tolerance_is_eigenbasis_reuse_with_eigenvalue_correction() -> None:
    """Eq. (17b): EighEigendecompositionConfig.tolerance of eigenvalue-corrected Shampoo
    is basis_reuse_tolerance (exported back); out of [0, 1] it is refused; RootInv's
    EigenConfig ignores it, as Meta does; Eigendecomposed Shampoo's is eq. (10h)."""
    pc = {**EIGEN_CORRECTED, "amortized_computation_config": {
        "type": "EighEigendecompositionConfig", "tolerance": 0.05}}
    c = ss.from_meta({"preconditioner_config": pc})
    assert c.eigenvalue_correction is not None
    assert c.eigenvalue_correction.basis_reuse_tolerance == 0.05
    exported = ss.to_meta(c)["preconditioner_config"]["amortized_computation_config"]
    assert exported == {"type": "EighEigendecompositionConfig", "tolerance": 0.05}
    assert ss.from_meta(ss.to_meta(c)) == c
    bad = {**pc, "amortized_computation_config": {"type": "EighEigendecompositionConfig",
                                                   "tolerance": 1.5}}
    with pytest.raises(ValueError, match=r"amortized_computation_config.tolerance = 1.5 is "
                                         r"invalid: allowed a number in \[0, 1\]"):
        ss.from_meta({"preconditioner_config": bad})
    # RootInv's EigenConfig holds one too, which Meta's root ignores (tolerance=0.0).
    plain = ss.from_meta({"preconditioner_config": ROOT_INV})
    assert ss.from_meta({"preconditioner_config": {**ROOT_INV, "amortized_computation_config": {
        "type": "EigenConfig", "tolerance": 0.05}}}) == plain
    # Eigendecomposed Shampoo's: eq. (10h), exported back.
    eigendecomposed = ss.from_meta({"preconditioner_config": {
        "type": "EigendecomposedShampooPreconditionerConfig",
        "amortized_computation_config": {"type": "EighEigendecompositionConfig",
                                         "tolerance": 0.05}}})
    assert eigendecomposed.root_inverse == ss.EighConfig(basis_reuse_tolerance=0.05)
    assert ss.from_meta(ss.to_meta(eigendecomposed)) == eigendecomposed
