"""The limits for hostile input: eq. (3)'s overflow bound, the large-block
warning, config_differences, and the value limits every config field enforces."""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import Any

import pytest

import shampoo_spec as ss
from shampoo_spec.config import MAX_NEWTON_ITERATIONS, OrderOverride

FLOAT32_MAX = struct.unpack("<f", bytes.fromhex("ffff7f7f"))[0]  # (2 - 2^-23) 2^127

#: Every section, the name its errors use, and a valid instance to vary.
SECTIONS: list[tuple[type[Any], str, dict[str, Any]]] = [
    (ss.StatisticsConfig, "statistics", {}),
    (ss.EpsilonConfig, "epsilon", {}),
    (ss.CoupledNewtonConfig, "root_inverse", {"deflation_rank": 1}),
    (ss.ExponentConfig, "exponents", {}),
    (OrderOverride, "exponents.overrides_by_order[]", {"order": 1, "roots": (2.0,)}),
    (ss.EigenvalueCorrectionConfig, "eigenvalue_correction", {"eigenbasis_method": "qr"}),
    (ss.GraftingConfig, "grafting", {"type": "rmsprop", "beta2": 0.9}),
    (ss.GradientFilterConfig, "gradient_filter", {"beta3": 0.5}),
    (ss.MomentumConfig, "momentum", {}),
    (ss.WeightDecayConfig, "weight_decay", {}),
    (ss.BlockingConfig, "blocking", {}),
    (ss.ScheduleConfig, "schedule", {}),
    (ss.FailureConfig, "failure", {"max_consecutive_root_failures": 3}),
    (ss.ShampooConfig, "ShampooConfig", {}),
]


#: Fields valid only beside another value, with the base that allows them (eq. 14e's
#: fields need ``type="adafactor"``).
FIELD_BASES: dict[tuple[str, str], dict[str, Any]] = {
    ("grafting", name): {"type": "adafactor", "epsilon_placement": "inside_sqrt"}
    for name in ("decay_exponent", "factor_min_dim", "parameter_scale_floor")
}


def _fields(kind: str) -> list[tuple[type[Any], str, dict[str, Any], str]]:
    """(section, owner, base kwargs, field) for every field annotated ``kind`` (or optional)."""
    out = []
    for cls, owner, base in SECTIONS:
        for f in dataclasses.fields(cls):
            if str(f.type) in (kind, f"{kind} | None"):
                out.append((cls, owner, FIELD_BASES.get((owner, f.name), base), f.name))
    return out


INTEGER_FIELDS = _fields("int")
REAL_FIELDS = _fields("float")


def test_the_field_lists_cover_the_config() -> None:
    names = {f"{owner}.{name}" for _, owner, _, name in INTEGER_FIELDS}
    assert names == {
        "root_inverse.max_iterations", "root_inverse.retries",
        "exponents.overrides_by_order[].order", "epsilon.power_iteration_steps",
        "blocking.max_preconditioner_dim", "blocking.merge_dims_up_to",
        "blocking.skip_dim_size_gt", "blocking.skip_rank_lt", "blocking.merge_target_rank",
        "schedule.precondition_frequency", "schedule.statistics_frequency",
        "schedule.start_preconditioning_step", "failure.max_consecutive_root_failures",
        "schedule.precondition_frequency_growth", "eigenvalue_correction.qr_max_iterations",
        "root_inverse.deflation_rank", "root_inverse.deflation_iterations",
        "grafting.factor_min_dim",
    }
    reals = {f"{owner}.{name}" for _, owner, _, name in REAL_FIELDS}
    assert len(reals) == len(REAL_FIELDS) >= 20
    assert {
        "ShampooConfig.learning_rate", "grafting.epsilon", "grafting.norm_epsilon",
        "grafting.normalize_epsilon", "eigenvalue_correction.epsilon", "gradient_filter.beta3",
        "root_inverse.failure_threshold", "exponents.override", "weight_decay.value",
        "grafting.clip_rms",
    } <= reals


# ------------------------------------------------------- eq. (3) overflow bound
def test_state_limit_is_half_of_float32_range() -> None:
    assert ss.STATE_LIMIT == 2.0**127
    assert ss.STATE_LIMIT < FLOAT32_MAX < 2 * ss.STATE_LIMIT
    # Representable exactly in float32: the bound itself never rounds.
    assert struct.unpack("<f", struct.pack("<f", ss.STATE_LIMIT))[0] == ss.STATE_LIMIT


@pytest.mark.parametrize(
    ("g", "size", "m", "refused"),
    [
        (0.0, 1, 0.0, False),
        (1.0, 10**6, 1e30, False),
        (1e19, 1, 0.0, False),  # 1e38 < 2^127 ~ 1.7e38
        (1e20, 1, 0.0, True),  # 1e40: a finite gradient too large for float32 state
        (1e19, 2, 0.0, True),  # 2e38
        (2.0**63, 2, 0.0, False),  # exactly 2^127: the boundary passes
        (2.0**63, 3, 0.0, True),
        (0.0, 5, 2.0**127, False),  # state at the limit, zero gradient
        (0.0, 5, math.nextafter(2.0**127, math.inf), True),
        (2.0**62, 1, 2.0**127 - 2.0**124, False),  # m + |B| g^2 = 2^127 - 2^124 + 2^124
        (2.0**62, 2, 2.0**127 - 2.0**124, True),
        (math.nan, 1, 0.0, True),
        (0.0, 1, math.nan, True),
        (math.inf, 1, 0.0, True),
        (1.0, 1, math.inf, True),
    ],
)
def test_block_overflows_closed_forms(g: float, size: int, m: float, refused: bool) -> None:
    assert ss.block_overflows(g, size, m) is refused
    assert ss.block_overflows(g, size, m) == (not m + size * g * g <= 2.0**127)


def test_float16_factor_limit() -> None:
    """Eq. (3) with float16 factors (eq. 11b): m_f + |B| g^2 <= 2^15 as well."""
    assert ss.factor_limit("float16") == ss.FLOAT16_FACTOR_LIMIT == 2.0**15
    assert ss.factor_limit("bfloat16") is None and ss.factor_limit(None) is None
    assert ss.FLOAT16_FACTOR_LIMIT * 2 < 65504 * 1.01  # half of float16's range
    assert not ss.block_overflows(90.0, 4, 0.0, 0.0, 2.0**15)  # 32400
    assert ss.block_overflows(91.0, 4, 0.0, 0.0, 2.0**15)  # 33124
    assert ss.block_overflows(1.0, 4, 0.0, 2.0**15 - 3, 2.0**15)
    assert not ss.block_overflows(91.0, 4, 0.0)  # float32's limit alone
    assert ss.block_overflows(float("nan"), 4, 0.0, 0.0, 2.0**15)


def test_block_overflows_bounds_every_update() -> None:
    """A block that passes keeps every state term below float32's range (eqs. 6, 14b, 17)."""
    g, size = 3e18, 16
    m = 0.0
    steps = 0
    while not ss.block_overflows(g, size, m):
        m += size * g * g  # the largest a factor, V or D entry can grow (weights <= 1)
        steps += 1
        assert m <= ss.STATE_LIMIT < FLOAT32_MAX
    assert steps == int(ss.STATE_LIMIT // (size * g * g))


# ------------------------------------------------------- large-block warning
def test_large_block_warning_names_the_parameter() -> None:
    config = ss.ShampooConfig(
        blocking=ss.BlockingConfig(max_preconditioner_dim=20000, merge_dims_up_to=None)
    )
    warnings = ss.large_block_warnings("emb", ss.plan_parameter((10000, 10), config))
    assert len(warnings) == 1
    assert "'emb'" in warnings[0] and "(10000, 10)" in warnings[0]
    assert "[10000]" in warnings[0] and str(ss.LARGE_BLOCK_DIM) in warnings[0]
    assert "max_preconditioner_dim" in warnings[0]


def test_no_large_block_warning_at_the_limit_or_for_unpreconditioned_dims() -> None:
    blocking = ss.BlockingConfig(max_preconditioner_dim=20000, merge_dims_up_to=None)
    config = ss.ShampooConfig(blocking=blocking)
    assert ss.LARGE_BLOCK_DIM == 8192
    assert ss.large_block_warnings("w", ss.plan_parameter((8192, 3), config)) == []
    assert ss.large_block_warnings("w", ss.plan_parameter((8193, 3), config)) != []
    # Only the last dim is preconditioned: the 10000 dim has no factor.
    last = ss.ShampooConfig(blocking=dataclasses.replace(blocking, preconditioned_dims="last"))
    assert ss.large_block_warnings("w", ss.plan_parameter((10000, 10), last)) == []
    # A skipped parameter has no factor at all.
    skip = ss.ShampooConfig(blocking=dataclasses.replace(blocking, skip_dim_size_gt=9000))
    assert ss.large_block_warnings("w", ss.plan_parameter((10000, 10), skip)) == []


@pytest.mark.parametrize("shape", [(1, 100000), (100000,), (3000, 3000), (50000, 4096), (7, 1, 9)])
def test_default_config_never_warns(shape: tuple[int, ...]) -> None:
    config = ss.ShampooConfig()
    assert ss.large_block_warnings("w", ss.plan_parameter(shape, config)) == []


# ------------------------------------------------------- config_differences
def test_config_differences() -> None:
    a = ss.ShampooConfig()
    assert ss.config_differences(a, a) == []
    assert ss.config_differences(a, ss.ShampooConfig()) == []
    b = dataclasses.replace(
        a, learning_rate=0.1, grafting=ss.GraftingConfig(type="adagrad")
    )
    assert ss.config_differences(a, b) == [
        "grafting.type: 'none' -> 'adagrad'",
        "learning_rate: 0.01 -> 0.1",
    ]
    assert ss.config_differences(b, a) == [
        "grafting.type: 'adagrad' -> 'none'",
        "learning_rate: 0.1 -> 0.01",
    ]
    c = dataclasses.replace(a, eigenvalue_correction=ss.EigenvalueCorrectionConfig(beta2=0.9))
    diff = ss.config_differences(a, c)
    assert "eigenvalue_correction: None -> '<absent>'" in diff
    assert "eigenvalue_correction.beta2: '<absent>' -> 0.9" in diff
    newton = dataclasses.replace(a, root_inverse=ss.CoupledNewtonConfig())
    assert "root_inverse.method: 'eigh' -> 'coupled_newton'" in ss.config_differences(a, newton)
    quantized = dataclasses.replace(
        a, root_inverse=ss.CoupledNewtonConfig(),
        statistics=dataclasses.replace(a.statistics, storage="int16_columnwise_diagonal"))
    assert "statistics.storage: 'float' -> 'int16_columnwise_diagonal'" in (
        ss.config_differences(a, quantized))
    stored = dataclasses.replace(a, momentum=ss.MomentumConfig(momentum=0.5,
                                                              storage="int8_columnwise"))
    assert ss.config_differences(a, stored) == [
        "momentum.momentum: 0.0 -> 0.5", "momentum.storage: 'float' -> 'int8_columnwise'"]
    rounded = dataclasses.replace(a, inverse_root_dtype="bfloat16")
    assert ss.config_differences(a, rounded) == ["inverse_root_dtype: None -> 'bfloat16'"]
    stored = dataclasses.replace(a, factor_storage_dtype="bfloat16")
    assert ss.config_differences(a, stored) == ["factor_storage_dtype: None -> 'bfloat16'"]
    ec = dataclasses.replace(a, eigenvalue_correction=ss.EigenvalueCorrectionConfig())
    stored = dataclasses.replace(a, eigenvalue_correction=ss.EigenvalueCorrectionConfig(
        eigenvectors_dtype="float32", corrected_eigenvalues_dtype="bfloat16"))
    assert ss.config_differences(ec, stored) == [
        "eigenvalue_correction.corrected_eigenvalues_dtype: None -> 'bfloat16'",
        "eigenvalue_correction.eigenvectors_dtype: None -> 'float32'",
    ]
    update = dataclasses.replace(a, update_dtype="float16")
    assert ss.config_differences(a, update) == ["update_dtype: None -> 'float16'"]


# ------------------------------------------------------- integer fields
@pytest.mark.parametrize(("cls", "owner", "base", "name"), INTEGER_FIELDS,
                         ids=[f"{o}.{n}" for _, o, _, n in INTEGER_FIELDS])
def test_integer_fields_are_bounded_by_max_integer(
    cls: type[Any], owner: str, base: dict[str, Any], name: str
) -> None:
    iterations = ("max_iterations", "power_iteration_steps", "qr_max_iterations",
                  "deflation_iterations")  # <= 10,000
    high = MAX_NEWTON_ITERATIONS if name in iterations else ss.MAX_INTEGER
    assert getattr(cls(**{**base, name: high}), name) == high
    for bad in (high + 1, 2**31, 2**62, 10**400, -(2**62), True, 2.0, 2.5, math.nan, "3", [3]):
        with pytest.raises(ValueError, match=rf"^{_re(owner)}\.{name} = .* is invalid: allowed "):
            cls(**{**base, name: bad})


def test_max_integer_is_int32_max() -> None:
    assert ss.MAX_INTEGER == 2**31 - 1
    assert MAX_NEWTON_ITERATIONS == 10_000
    with pytest.raises(ValueError, match=r"\[1, 10000\]"):
        ss.CoupledNewtonConfig(max_iterations=10_001)


# ------------------------------------------------------- real fields
@pytest.mark.parametrize(("cls", "owner", "base", "name"), REAL_FIELDS,
                         ids=[f"{o}.{n}" for _, o, _, n in REAL_FIELDS])
@pytest.mark.parametrize(
    "bad", [10**400, -(10**400), math.nan, math.inf, -math.inf, "0.5", [0.5], {}, {"a": 1}, True],
    ids=["1e400", "-1e400", "nan", "inf", "-inf", "str", "list", "dict", "dict1", "bool"],
)
def test_real_fields_refuse_non_finite_and_non_numbers(
    cls: type[Any], owner: str, base: dict[str, Any], name: str, bad: Any
) -> None:
    with pytest.raises(ValueError, match=rf"^{_re(owner)}\.{name} = .* is invalid: allowed "):
        cls(**{**base, name: bad})


def test_huge_value_is_shortened_in_the_message() -> None:
    with pytest.raises(ValueError) as info:
        ss.ShampooConfig(learning_rate=10**400)
    assert len(str(info.value)) < 200 and "characters" in str(info.value)


# ------------------------------------------------------- dividing epsilons
@pytest.mark.parametrize("gtype", ss.GRAFTING_TYPES_WITH_STATE)
def test_graft_epsilon_positive_for_types_with_state(gtype: str) -> None:
    beta2 = 1.0 if gtype.startswith("adagrad") else 0.9
    with pytest.raises(ValueError, match=r"grafting\.epsilon = 0\.0 is invalid: allowed .*2\^-126"):
        ss.GraftingConfig(type=gtype, beta2=beta2, epsilon=0.0)  # type: ignore[arg-type]
    assert ss.GraftingConfig(type=gtype, beta2=beta2, epsilon=1e-30).epsilon == 1e-30  # type: ignore[arg-type]


@pytest.mark.parametrize("gtype", ["none", "sgd", "sign"])
def test_graft_epsilon_may_be_zero_without_state(gtype: str) -> None:
    assert ss.GraftingConfig(type=gtype, epsilon=0.0).epsilon == 0.0  # type: ignore[arg-type]


@pytest.mark.parametrize("gtype", [t for t in ss.GRAFTING_TYPES if t != "none"])
def test_norm_epsilon_positive_with_any_graft(gtype: str) -> None:
    beta2 = 0.9 if gtype in ("rmsprop", "adam", "rmsprop_normalized") else 1.0
    with pytest.raises(ValueError, match=r"grafting\.norm_epsilon = 0\.0"):
        ss.GraftingConfig(type=gtype, beta2=beta2, norm_epsilon=0.0)  # type: ignore[arg-type]


def test_norm_epsilon_may_be_zero_without_graft() -> None:
    assert ss.GraftingConfig(type="none", norm_epsilon=0.0).norm_epsilon == 0.0


@pytest.mark.parametrize("gtype", ["adagrad_normalized", "rmsprop_normalized"])
def test_normalize_epsilon_positive_for_normalized_types(gtype: str) -> None:
    beta2 = 1.0 if gtype.startswith("adagrad") else 0.9
    with pytest.raises(ValueError, match=r"grafting\.normalize_epsilon = 0\.0"):
        ss.GraftingConfig(type=gtype, beta2=beta2, normalize_epsilon=0.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("gtype", ["none", "sgd", "adagrad", "rmsprop", "adam", "sign"])
def test_normalize_epsilon_may_be_zero_otherwise(gtype: str) -> None:
    beta2 = 0.9 if gtype in ("rmsprop", "adam") else 1.0
    g = ss.GraftingConfig(type=gtype, beta2=beta2, normalize_epsilon=0.0)  # type: ignore[arg-type]
    assert g.normalize_epsilon == 0.0


def test_eigenvalue_correction_epsilon_positive() -> None:
    with pytest.raises(ValueError, match=r"eigenvalue_correction\.epsilon = 0\.0 .*2\^-126"):
        ss.EigenvalueCorrectionConfig(epsilon=0.0)
    with pytest.raises(ValueError, match=r"eigenvalue_correction\.epsilon = -1e-12"):
        ss.EigenvalueCorrectionConfig(epsilon=-1e-12)
    assert ss.EigenvalueCorrectionConfig(epsilon=2.0**-126).epsilon == 2.0**-126


def test_matrix_epsilon_may_still_be_zero() -> None:
    """Eq. (9)'s epsilon is a ridge, not a divisor: 0 stays valid (the roots' floor decides)."""
    assert ss.EpsilonConfig(value=0.0).value == 0.0


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_from_dict_names_a_missing_required_key() -> None:
    """An override without its order is a named ValueError, not a TypeError of __init__."""
    missing = r"overrides_by_order\[\] lacks the required key\(s\) \['order', 'roots'\]"
    with pytest.raises(ValueError, match=missing):
        ss.ShampooConfig.from_dict({"exponents": {"overrides_by_order": [{}]}})
