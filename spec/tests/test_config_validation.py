"""Every field of every config section rejects bad values with a message naming it."""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from typing import Any

import pytest

import shampoo_spec as ss

SECTIONS = [
    ss.StatisticsConfig,
    ss.EpsilonConfig,
    ss.EighConfig,
    ss.CoupledNewtonConfig,
    ss.HigherOrderNewtonConfig,
    ss.ExponentConfig,
    ss.EigenvalueCorrectionConfig,
    ss.GraftingConfig,
    ss.GradientFilterConfig,
    ss.MomentumConfig,
    ss.WeightDecayConfig,
    ss.BlockingConfig,
    ss.ScheduleConfig,
    ss.FailureConfig,
    ss.ShampooConfig,
]

# Values no field of any section accepts, by declared type. Each list is tried
# in turn; a field passes the test when at least one value is rejected AND
# every rejection names the field.
BAD_BY_TYPE: dict[str, list[object]] = {
    "float": [math.nan, math.inf, "1.0", -1.0, 2.0, None],
    "int": [1.5, True, -1, 0, "3"],
    "bool": ["yes", 1, None],
    "literal": ["bogus", None, 3],
    "section": [{"not": "a config"}, None, 3],
    "tuple": ["not a tuple", [1, 2]],
}


def _kind(cls: type, name: str) -> str:
    hint = typing.get_type_hints(cls)[name]
    text = repr(hint)
    if "Literal" in text:
        return "literal"
    if hint is bool:
        return "bool"
    if "tuple" in text:
        return "tuple"
    if hint is int or text in ("int | None", "typing.Optional[int]"):
        return "int"
    if hint is float or "float" in text:
        return "float"
    return "section"


FIELDS = [
    (cls, f.name)
    for cls in SECTIONS
    for f in dataclasses.fields(cls)
]


@pytest.mark.parametrize(("cls", "name"), FIELDS, ids=[f"{c.__name__}.{n}" for c, n in FIELDS])
def test_every_field_rejects_bad_values_naming_the_field(cls: type, name: str) -> None:
    rejected = 0
    for bad in BAD_BY_TYPE[_kind(cls, name)]:
        try:
            cls(**{name: bad})
        except ValueError as err:
            rejected += 1
            message = str(err)
            assert name in message, message
            assert repr(bad) in message or str(bad) in message, message
            assert "allowed" in message, message
    assert rejected > 0, f"{cls.__name__}.{name} accepted every bad value"


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: ss.GraftingConfig(type="adagrad", beta2=0.9), "beta2"),
        (lambda: ss.GraftingConfig(type="adam", beta2=1.0), "beta2"),
        (lambda: ss.GraftingConfig(type="sgd", clip_rms=1.0), "clip_rms"),
        (lambda: ss.GraftingConfig(type="sign", clip_rms=1.0), "clip_rms"),
        (lambda: ss.GraftingConfig(type="adagrad", ema_weight="one"), "ema_weight"),
        (lambda: ss.GraftingConfig(type="sgd", ema_weight="one"), "ema_weight"),
        (lambda: ss.ExponentConfig(override=4.0, overrides_by_order=(
            ss.OrderOverride(order=2, roots=(2.0,)),)), "override"),
        (lambda: ss.OrderOverride(order=2, roots=(2.0, 2.0, 2.0)), "roots"),
        (lambda: ss.ShampooConfig(
            eigenvalue_correction=ss.EigenvalueCorrectionConfig(),
            root_inverse=ss.CoupledNewtonConfig()), "method"),
        (lambda: ss.ShampooConfig(
            root_inverse=ss.CoupledNewtonConfig(),
            exponents=ss.ExponentConfig(override=2.5)), "override"),
        (lambda: ss.ShampooConfig(
            eigenvalue_correction=ss.EigenvalueCorrectionConfig(),
            inverse_root_dtype="float32"), "inverse_root_dtype"),
        (lambda: ss.ShampooConfig(
            eigenvalue_correction=ss.EigenvalueCorrectionConfig(),
            schedule=ss.ScheduleConfig(roots_take_effect="next_step")), "roots_take_effect"),
        (lambda: ss.EpsilonConfig(value=1e-12, placement="pseudo_inverse"), "value"),
        (lambda: ss.WeightDecayConfig(type="update", scale_by_lr_ratio=True),
         "scale_by_lr_ratio"),
        (lambda: ss.ShampooConfig(learning_rate=0.0, weight_decay=ss.WeightDecayConfig(
            scale_by_lr_ratio=True)), "learning_rate"),
        (lambda: ss.EpsilonConfig(rank_rtol=1e-6), "rank_rtol"),
        (lambda: ss.EpsilonConfig(rank_atol=1e-9), "rank_atol"),
        (lambda: ss.EpsilonConfig(rank_rtol=None), "rank_rtol"),
        (lambda: ss.ShampooConfig(
            epsilon=ss.EpsilonConfig(value=0.0, placement="pseudo_inverse"),
            root_inverse=ss.CoupledNewtonConfig()), "placement"),
        (lambda: ss.ShampooConfig(
            epsilon=ss.EpsilonConfig(value=0.0, placement="pseudo_inverse"),
            eigenvalue_correction=ss.EigenvalueCorrectionConfig()), "placement"),
        # Eq. (11b): factors stored in s only with Meta's eigh root in s.
        (lambda: ss.ShampooConfig(factor_storage_dtype="bfloat16",
                                  root_inverse=ss.CoupledNewtonConfig()), "method"),
        (lambda: ss.ShampooConfig(factor_storage_dtype="bfloat16",
                                  root_inverse=ss.HigherOrderNewtonConfig()), "method"),
        (lambda: ss.ShampooConfig(factor_storage_dtype="bfloat16",
                                  root_inverse=ss.EighConfig(failure_threshold=0.1)),
         "failure_threshold"),
        (lambda: ss.ShampooConfig(factor_storage_dtype="float16",
                                  epsilon=ss.EpsilonConfig(value=1e-3, placement="floor")),
         "placement"),
        (lambda: ss.ShampooConfig(factor_storage_dtype="float16",
                                  epsilon=ss.EpsilonConfig(value=1e-3, scale="relative")),
         "scale"),
        (lambda: ss.ShampooConfig(factor_storage_dtype="bfloat16", statistics=ss.StatisticsConfig(
            trace_scaling_exponent=0.5)), "trace_scaling_exponent"),
        (lambda: ss.ShampooConfig(factor_storage_dtype="bfloat16", statistics=ss.StatisticsConfig(
            initial_value="epsilon_identity")), "initial_value"),
        (lambda: ss.ShampooConfig(factor_storage_dtype="bfloat16",
                                  eigenvalue_correction=ss.EigenvalueCorrectionConfig()),
         "factor_storage_dtype"),
        (lambda: ss.ShampooConfig(factor_storage_dtype="float16",
                                  epsilon=ss.EpsilonConfig(value=2.0**-25)), "value"),
    ],
)
def test_cross_field_rules(make: typing.Callable[[], object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make()


def test_factor_storage_errors_name_field_value_and_allowed() -> None:
    """Eq. (20c): storage is 'float' or 'int16_columnwise_diagonal', with coupled Newton
    roots and no inverse_root_dtype; scales only with int16 storage."""
    with pytest.raises(ValueError) as err:
        ss.StatisticsConfig(storage="int8")  # type: ignore[arg-type]
    assert str(err.value) == (
        "statistics.storage = 'int8' is invalid: allowed one of 'float', "
        "'int16_columnwise_diagonal'."
    )
    with pytest.raises(ValueError, match=r"statistics.scale_dtype = 'float64' is invalid: "
                       r"allowed 'float32' \(the default\) with storage='float'"):
        ss.StatisticsConfig(scale_dtype="float64")
    stats = ss.StatisticsConfig(storage="int16_columnwise_diagonal", scale_dtype="float64")
    assert stats.quantized and not ss.StatisticsConfig().quantized
    with pytest.raises(ValueError, match=r"root_inverse.method = 'eigh' is invalid: allowed "
                       r"'coupled_newton' with statistics.storage='int16_columnwise_diagonal'"):
        ss.ShampooConfig(statistics=stats)
    with pytest.raises(ValueError, match=r"ShampooConfig.inverse_root_dtype = 'float32' is "
                       r"invalid: allowed None with statistics.storage="):
        ss.ShampooConfig(statistics=stats, root_inverse=ss.CoupledNewtonConfig(),
                         inverse_root_dtype="float32")
    ss.ShampooConfig(statistics=stats, root_inverse=ss.CoupledNewtonConfig())


def test_momentum_storage_errors_name_field_value_and_allowed() -> None:
    """Eq. (20b): storage is 'float' or 'int8_columnwise'; scales only with int8 storage."""
    with pytest.raises(ValueError) as err:
        ss.MomentumConfig(storage="int4")  # type: ignore[arg-type]
    assert str(err.value) == (
        "momentum.storage = 'int4' is invalid: allowed one of 'float', 'int8_columnwise'."
    )
    with pytest.raises(ValueError, match=r"momentum.scale_dtype = 'float64' is invalid: "
                       r"allowed 'float32' \(the default\) with storage='float'"):
        ss.MomentumConfig(scale_dtype="float64")
    m = ss.MomentumConfig(momentum=0.9, storage="int8_columnwise", scale_dtype="float64")
    assert m.quantizes(2) and m.quantizes(4)
    assert not m.quantizes(1) and not m.quantizes(0)
    assert not ss.MomentumConfig(storage="int8_columnwise").quantizes(2)  # no buffer
    assert not ss.MomentumConfig(momentum=0.9).quantizes(2)


def test_inverse_root_dtype_error_names_field_value_and_allowed() -> None:
    with pytest.raises(ValueError) as err:
        ss.ShampooConfig(inverse_root_dtype="float8")  # type: ignore[arg-type]
    assert str(err.value) == (
        "ShampooConfig.inverse_root_dtype = 'float8' is invalid: allowed one of 'float64', "
        "'float32', 'bfloat16', 'float16', or None (the roots stay in factor_dtype)."
    )


@pytest.mark.parametrize(
    ("field", "what"),
    [("eigenvectors_dtype", "the eigenbases stay in factor_dtype"),
     ("corrected_eigenvalues_dtype", "D stays in factor_dtype")],
)
def test_eigenvalue_correction_dtype_errors_name_field_value_and_allowed(
    field: str, what: str
) -> None:
    with pytest.raises(ValueError) as err:
        ss.EigenvalueCorrectionConfig(**{field: "float8"})
    assert str(err.value) == (
        f"eigenvalue_correction.{field} = 'float8' is invalid: allowed one of 'float64', "
        f"'float32', 'bfloat16', 'float16', or None ({what})."
    )


def test_float16_corrected_eigenvalues_need_an_epsilon_float16_holds() -> None:
    """Eq. (17a): epsilon is added in s; below float16's smallest positive it is 0 there."""
    ss.EigenvalueCorrectionConfig(epsilon=2.0**-24, corrected_eigenvalues_dtype="float16")
    with pytest.raises(ValueError) as err:
        ss.EigenvalueCorrectionConfig(epsilon=1e-8, corrected_eigenvalues_dtype="float16")
    assert str(err.value) == (
        "eigenvalue_correction.epsilon = 1e-08 is invalid: allowed a number >= 2^-24 (the "
        "smallest positive float16) with corrected_eigenvalues_dtype='float16': a smaller one "
        "is 0 there.")
    ss.EigenvalueCorrectionConfig(epsilon=1e-30, corrected_eigenvalues_dtype="bfloat16")


def test_update_dtype_error_names_field_value_and_allowed() -> None:
    with pytest.raises(ValueError) as err:
        ss.ShampooConfig(update_dtype="float64")  # type: ignore[arg-type]
    assert str(err.value) == (
        "ShampooConfig.update_dtype = 'float64' is invalid: allowed one of 'float32', "
        "'bfloat16', 'float16', or None (the update is added unrounded)."
    )


def test_factor_storage_dtype_error_names_field_value_and_allowed() -> None:
    with pytest.raises(ValueError) as err:
        ss.ShampooConfig(factor_storage_dtype="float32")  # type: ignore[arg-type]
    assert str(err.value) == (
        "ShampooConfig.factor_storage_dtype = 'float32' is invalid: allowed one of 'bfloat16', "
        "'float16', or None (the factors stay in factor_dtype)."
    )
    with pytest.raises(ValueError, match=r"epsilon.value = 1e-12 .* >= 2\^-24"):
        ss.ShampooConfig(factor_storage_dtype="float16")
    # bfloat16 has float32's range: Meta's default epsilon is fine; float16 from 2^-24.
    assert ss.ShampooConfig(factor_storage_dtype="bfloat16").stores_factors_rounded
    ss.ShampooConfig(factor_storage_dtype="float16", epsilon=ss.EpsilonConfig(value=2.0**-24))
    ss.ShampooConfig(factor_storage_dtype="float16",
                     epsilon=ss.EpsilonConfig(value=1e-3, placement="shift_after"))


def test_defaults_are_valid_and_frozen() -> None:
    c = ss.ShampooConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.learning_rate = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("build", "field", "zero_ok"),
    [
        (lambda e: ss.EpsilonConfig(value=e), "epsilon.value", True),
        (lambda e: ss.EpsilonConfig(relative_floor=e), "epsilon.relative_floor", True),
        (lambda e: ss.EigenvalueCorrectionConfig(epsilon=e), "eigenvalue_correction.epsilon",
         False),
        (lambda e: ss.GraftingConfig(type="adagrad", epsilon=e), "grafting.epsilon", False),
        (lambda e: ss.GraftingConfig(type="sgd", norm_epsilon=e), "grafting.norm_epsilon",
         False),
        (lambda e: ss.GraftingConfig(type="none", norm_epsilon=e), "grafting.norm_epsilon",
         True),
        # Compared in float32 (eq. 13): a subnormal threshold would be flushed to 0 by XLA.
        (lambda e: ss.EighConfig(failure_threshold=e), "root_inverse.failure_threshold", False),
    ],
)
def test_epsilons_are_zero_or_float32_normal(build: Any, field: str, zero_ok: bool) -> None:
    """A subnormal epsilon is flushed to zero by XLA and by GPUs: refused, naming the bound."""
    build(2.0**-126)  # float32's smallest normal: accepted
    for bad in (1e-39, 2.0**-127, 5e-324):
        with pytest.raises(ValueError, match=re.escape(field) + r".*2\^-126"):
            build(bad)
    if zero_ok:
        build(0.0)
    else:
        with pytest.raises(ValueError, match=re.escape(field)):
            build(0.0)


def test_eigenvalue_correction_roots_by_order() -> None:
    ec = ss.EigenvalueCorrectionConfig(root=2.0, roots_by_order=((1, 4.0), (3, 1.5)))
    assert [ec.root_for(o) for o in (1, 2, 3, 4)] == [4.0, 2.0, 1.5, 2.0]
    config = ss.ShampooConfig(eigenvalue_correction=ec)
    assert ss.ShampooConfig.from_dict(config.to_dict()) == config  # JSON pairs back to tuples
    for bad, why in [
        (((1, 4.0), (1, 3.0)), "at most one root per order"),
        (((2, 4.0), (1, 3.0)), "sorted by order"),
        (((1, 2.0),), "differ from root"),
        (((0, 4.0),), "order"),
        (((1, -1.0),), "root"),
        (((1,),), "pairs"),
        ([(1, 4.0)], "pairs"),
    ]:
        with pytest.raises(ValueError, match=f"eigenvalue_correction.roots_by_order.*{why}"):
            ss.EigenvalueCorrectionConfig(roots_by_order=bad)  # type: ignore[arg-type]

def test_eigh_failure_threshold() -> None:
    """None (fail only when non-finite) or a finite real >= 2^-126, rounded to float32 (eq. 13)."""
    assert ss.EighConfig().failure_threshold is None
    assert ss.EighConfig().failure_threshold_float32 is None
    assert ss.EighConfig(failure_threshold=0.1).failure_threshold_float32 == 0.10000000149011612
    assert ss.EighConfig(failure_threshold=1e-30).failure_threshold_float32 == (
        1.0000000031710769e-30
    )
    # Beyond float32's range the rounded threshold is inf: only an inf or NaN error fails.
    assert ss.EighConfig(failure_threshold=1e39).failure_threshold_float32 == math.inf
    assert ss.EighConfig(failure_threshold=3.4028235e38).failure_threshold_float32 == (
        3.4028234663852886e38
    )
    for bad in (0.0, -0.1, math.nan, math.inf, True, "0.1", 1e-40):
        with pytest.raises(ValueError, match=r"^root_inverse\.failure_threshold = .* is invalid: "
                           r"allowed a finite number >= 2\^-126 .*, or None \(an eigh root"):
            ss.EighConfig(failure_threshold=bad)
    c = ss.ShampooConfig(root_inverse=ss.EighConfig(failure_threshold=1e-9),
                         eigenvalue_correction=ss.EigenvalueCorrectionConfig())
    assert ss.ShampooConfig.from_dict(c.to_dict()) == c


def test_pseudo_inverse_rank_cutoff() -> None:
    """Eq. (10): the relative cutoff is rank_rtol, or n * machine epsilon of the factor dtype."""
    e = ss.EpsilonConfig(value=0.0, placement="pseudo_inverse", rank_rtol=None, rank_atol=1e-9)
    assert e.pseudo_inverse and e.rank_cutoff_rtol(10, "float32") == 10 * 2.0**-23
    assert e.rank_cutoff_rtol(3, "float64") == 3 * 2.0**-52
    assert dataclasses.replace(e, rank_rtol=1e-4).rank_cutoff_rtol(10, "float32") == 1e-4
    with pytest.raises(ValueError, match=r"epsilon.value = 1e-12 is invalid: allowed 0 with "
                       "placement 'pseudo_inverse'"):
        dataclasses.replace(e, value=1e-12)
    with pytest.raises(ValueError, match=r"epsilon.rank_atol = 1e-09 is invalid: allowed 0.0 "
                       "unless placement is 'pseudo_inverse'"):
        dataclasses.replace(e, placement="ridge", value=1e-12, rank_rtol=0.0)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"rank": 0}, "rank"),
    ({"rank": 2.0}, "rank"),
    ({"rank": True}, "rank"),
    ({"rank": 2, "keep": "middle"}, "keep"),
    ({"rank": 2, "failure_threshold": 0.0}, "failure_threshold"),
    ({"rank": 2, "failure_threshold": math.nan}, "failure_threshold"),
    ({"rank": 2, "relative_floor": -1.0}, "relative_floor"),
    ({"rank": 2, "relative_floor": 1e-300}, "relative_floor"),
])
def test_low_rank_fields_name_field_value_and_allowed(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"low_rank\.{field} = .* is invalid: allowed"):
        ss.LowRankRootConfig(**kwargs)


@pytest.mark.parametrize(("extra", "field"), [
    ({"eigenvalue_correction": ss.EigenvalueCorrectionConfig()}, "eigenvalue_correction"),
    ({"diagonal": ss.DiagonalPreconditionerConfig()}, "diagonal"),
    ({"spectral": ss.SpectralDescentConfig(),
      "blocking": ss.BlockingConfig(merge_target_rank=2)}, "spectral"),
    ({"inverse_root_dtype": "bfloat16"}, "inverse_root_dtype"),
    ({"factor_storage_dtype": "bfloat16"}, "factor_storage_dtype"),
    ({"statistics": ss.StatisticsConfig(storage="int16_columnwise_diagonal"),
      "root_inverse": ss.CoupledNewtonConfig()}, "storage"),
])
def test_low_rank_refuses_what_has_no_inverse_root_to_compress(
        extra: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"{field} = .* allowed .*with low_rank \(eq\. 10c"):
        ss.ShampooConfig(low_rank=ss.LowRankRootConfig(rank=2), **extra)


def test_low_rank_compresses_above_rank_plus_two_and_replaces_the_floor() -> None:
    lr = ss.LowRankRootConfig(rank=3, relative_floor=1e-6)
    assert [n for n in range(1, 9) if lr.compresses(n)] == [6, 7, 8]
    eps = ss.EpsilonConfig(scale="relative", relative_floor=1e-25)
    assert lr.epsilon_for(eps) == dataclasses.replace(eps, relative_floor=1e-6)
    assert ss.LowRankRootConfig(rank=3).epsilon_for(eps) is eps
    assert lr.eigh == ss.EighConfig()


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"rank": 0}, "rank"),
    ({"rank": 2.0}, "rank"),
    ({"rank": 2, "average_gradients": 1}, "average_gradients"),
    ({"rank": 2, "reset_every": 0}, "reset_every"),
    ({"rank": 2, "reset_every": True}, "reset_every"),
    ({"rank": 2, "relative_floor": -1.0}, "relative_floor"),
    ({"rank": 2, "relative_floor": 1e-300}, "relative_floor"),
])
def test_frequent_directions_fields_name_field_value_and_allowed(
        kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"frequent_directions\.{field} = .* is invalid: allowed"):
        ss.FrequentDirectionsConfig(**kwargs)


@pytest.mark.parametrize(("extra", "field"), [
    ({"eigenvalue_correction": ss.EigenvalueCorrectionConfig()}, "eigenvalue_correction"),
    ({"diagonal": ss.DiagonalPreconditionerConfig()}, "diagonal"),
    ({"inverse_root_dtype": "bfloat16"}, "inverse_root_dtype"),
    ({"factor_storage_dtype": "bfloat16"}, "factor_storage_dtype"),
    ({"statistics": ss.StatisticsConfig(storage="int16_columnwise_diagonal"),
      "root_inverse": ss.CoupledNewtonConfig()}, "storage"),
    ({"low_rank": ss.LowRankRootConfig(rank=2)}, "low_rank"),
    ({"statistics": ss.StatisticsConfig(kl=True)}, "kl"),
    ({"statistics": ss.StatisticsConfig(beta2=0.9, bias_correction=True)}, "bias_correction"),
    ({"statistics": ss.StatisticsConfig(trace_scaling_exponent=0.5)}, "trace_scaling_exponent"),
    ({"schedule": ss.ScheduleConfig(precondition_frequency=2)}, "statistics_frequency"),
    ({"schedule": ss.ScheduleConfig(precondition_frequency_growth=20)},
     "precondition_frequency_growth"),
    ({"epsilon": ss.EpsilonConfig(value=0.0, placement="pseudo_inverse")}, "placement"),
])
def test_frequent_directions_refuses_what_it_replaces_or_cannot_combine(
        extra: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"{field} = .* allowed .*with frequent_directions"):
        ss.ShampooConfig(frequent_directions=ss.FrequentDirectionsConfig(rank=2), **extra)


def test_frequent_directions_sketches_above_rank_plus_two_and_resets_on_its_period() -> None:
    fd = ss.FrequentDirectionsConfig(rank=3, reset_every=4)
    assert [n for n in range(1, 9) if fd.compresses(n)] == [6, 7, 8]
    assert [t for t in range(1, 11) if fd.resets(t)] == [1, 5, 9]
    assert not any(ss.FrequentDirectionsConfig(rank=3).resets(t) for t in range(1, 11))
    assert fd.zero_rtol(8, "float64") == 8 * 2.0**-52
    assert fd.zero_rtol(8, "float32") == 8 * 2.0**-23
    # Statistics and roots on the same steps are allowed, with any period.
    ss.ShampooConfig(frequent_directions=fd, schedule=ss.ScheduleConfig(
        precondition_frequency=3, statistics_frequency=3))
