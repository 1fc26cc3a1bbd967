"""``to_tearfree``: the inverse of ``from_tearfree`` on every config tearfree can express.

Round trips over random tearfree options (every supported option drawn), the
exact JSON written for tearfree's defaults, and one named refusal per rule
tearfree has no option for.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shampoo_spec as ss
from shampoo_spec.anchors.tearfree import exporter as tearfree_exporter

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tearfree_options(draw: st.DrawFn) -> dict[str, Any]:
    """Random ``TearfreeOptions`` JSON within what ``from_tearfree`` imports; keys left
    out take tearfree's defaults, enums by name or value."""
    graft: dict[str, Any] = {}
    kind = draw(st.sampled_from(["SGD", "RMSPROP", "NONE", "rmsprop", "GraftingType.SGD", None,
                                 "ADAFACTOR", "adafactor"]))
    if kind is not None:
        graft["grafting_type"] = kind
    adafactor = kind is not None and kind.upper() == "ADAFACTOR"
    if draw(st.booleans()):  # ADAFACTOR's is optax's decay exponent, in (0, 1)
        graft["second_moment_decay"] = draw(st.sampled_from(
            [0.5, 0.8, 0.999] if adafactor else [0.5, 0.9, 0.999, 1.0]))
    for key, values in (("min_dim_size_to_factor", st.integers(1, 256)),
                        ("multiply_by_parameter_scale", st.booleans()),
                        ("clipping_threshold", st.sampled_from([1.0, 2.5]))):
        if draw(st.booleans()):  # checked with any graft, used by ADAFACTOR only
            graft[key] = draw(values)
    if draw(st.booleans()):
        graft["epsilon"] = draw(st.sampled_from([1e-30, 1e-23, 1e-8, 0.1]))
    for key, values in (("start_preconditioning_step", st.integers(-3, 50)),
                        ("skip_preconditioning_rank1", st.booleans()),
                        ("skip_preconditioning_any_dim_gt", st.integers(1, 10_000))):
        if draw(st.booleans()):
            graft[key] = draw(values)
    shampoo: dict[str, Any] = {}
    for key, values in (("block_size", st.integers(2, 4096)),
                        ("update_preconditioners_freq", st.integers(1, 100)),
                        ("update_statistics_freq", st.integers(1, 10)),
                        ("second_moment_decay", st.sampled_from([0.0, 0.5, 0.99, 1.0]))):
        if draw(st.booleans()):
            shampoo[key] = draw(values)
    second: dict[str, Any] = {"shampoo_options": shampoo}
    if draw(st.booleans()):  # Sketchy (eq. 10e): the sketchy options replace shampoo's
        second["second_order_type"] = draw(st.sampled_from(["SKETCHY", "sketchy"]))
        sketchy: dict[str, Any] = {}
        for key, values in (("rank", st.integers(1, 256)),
                            ("epsilon", st.sampled_from([0.0, 1e-7, 1e-3])),
                            ("relative_epsilon", st.booleans()),
                            ("second_moment_decay", st.sampled_from([0.0, 0.9, 0.999, 1.0])),
                            ("update_freq", st.integers(1, 10)),
                            ("add_ggt", st.booleans())):
            if draw(st.booleans()):
                sketchy[key] = draw(values)
        second["sketchy_options"] = sketchy
    if draw(st.booleans()):
        second["merge_dims"] = draw(st.integers(2, 8192))
    momentum: dict[str, Any] = {}
    for key, values in (("ema", st.booleans()), ("nesterov", st.booleans()),
                        ("momentum_decay", st.sampled_from([0.0, 0.5, 0.9, 0.99])),
                        ("weight_decay", st.sampled_from([0.0, 1e-4, 0.1])),
                        ("weight_decay_after_momentum", st.booleans())):
        if draw(st.booleans()):
            momentum[key] = draw(values)
    return {"grafting_options": graft, "second_order_options": second,
            "momentum_options": momentum}


def test_exported() -> None:
    assert "to_tearfree" in ss.__all__ and tearfree_exporter.to_tearfree is ss.to_tearfree


@SETTINGS
@given(tearfree_options(), st.sampled_from([0.0, 1e-3, 0.5]), st.sampled_from([None, True, False]))
def test_round_trip(options: dict[str, Any], lr: float, x64: bool | None) -> None:
    c = ss.from_tearfree(options, lr, x64=x64)
    out = ss.to_tearfree(c)
    assert set(out) == {"learning_rate", "options"}
    back = json.loads(json.dumps(out))  # plain JSON: what report --config reads
    assert ss.from_tearfree(back["options"], back["learning_rate"],
                            x64=c.factor_dtype == "float64") == c


def test_defaults_write_tearfrees_defaults() -> None:
    """Tearfree's default options export to every default written out."""
    out = ss.to_tearfree(ss.from_tearfree({}, 0.1))
    assert out == {"learning_rate": 0.1, "options": {
        "grafting_options": {
            "grafting_type": "RMSPROP", "second_moment_decay": 0.999, "epsilon": 1e-23,
            "start_preconditioning_step": 0, "skip_preconditioning_rank1": True,
            "skip_preconditioning_any_dim_gt": 4096,
        },
        "second_order_options": {
            "merge_dims": 1024, "second_order_type": "SHAMPOO",
            "shampoo_options": {"block_size": 1024, "update_preconditioners_freq": 1,
                                "update_statistics_freq": 1, "second_moment_decay": 0.999},
        },
        "momentum_options": {"ema": False, "nesterov": True, "momentum_decay": 0.9,
                             "weight_decay": 0.0, "weight_decay_after_momentum": True},
    }}


def test_sketchy_exports_its_options() -> None:
    """Eq. (10e)'s sketches export as SKETCHY: rank, epsilon and its scale, the decay, one
    frequency; the unused shampoo_options are left out."""
    c = ss.from_tearfree({"second_order_options": {
        "second_order_type": "SKETCHY", "merge_dims": 16,
        "sketchy_options": {"rank": 4, "epsilon": 1e-3, "relative_epsilon": False,
                            "second_moment_decay": 0.9, "update_freq": 3}}}, 0.1)
    assert ss.to_tearfree(c)["options"]["second_order_options"] == {
        "merge_dims": 16, "second_order_type": "SKETCHY",
        "sketchy_options": {"epsilon": 1e-3, "rank": 4, "relative_epsilon": False,
                            "second_moment_decay": 0.9, "update_freq": 3},
    }


def test_adagrad_graft_exports_as_rmsprop_summing() -> None:
    """Tearfree's RMSPROP at decay 1 is a sum: our ``adagrad`` (eq. 14b)."""
    c = ss.from_tearfree({"grafting_options": {"second_moment_decay": 1.0}}, 0.1)
    assert c.grafting.type == "adagrad"
    graft = ss.to_tearfree(c)["options"]["grafting_options"]
    assert graft["grafting_type"] == "RMSPROP" and graft["second_moment_decay"] == 1.0


BASE = ss.from_tearfree({"grafting_options": {"grafting_type": "SGD"}}, 0.1)

#: One config per rule tearfree has no option for: (field named in the error, config).
MOVES: dict[str, ss.ShampooConfig] = {
    "epsilon.placement": dataclasses.replace(
        BASE, epsilon=ss.EpsilonConfig(value=1e-6)),
    "root_inverse": dataclasses.replace(BASE, root_inverse=ss.CoupledNewtonConfig(),
                                        epsilon=ss.EpsilonConfig(value=1e-6)),
    "exponents.default": dataclasses.replace(BASE, exponents=ss.ExponentConfig()),
    "statistics.initial_value": dataclasses.replace(
        BASE, statistics=ss.StatisticsConfig(beta2=0.999, initial_value="epsilon_identity")),
    "grafting.type": dataclasses.replace(BASE, grafting=dataclasses.replace(
        BASE.grafting, type="adam", beta2=0.999, epsilon=1e-8)),
    "grafting.norm_scope": dataclasses.replace(
        BASE, grafting=dataclasses.replace(BASE.grafting, norm_scope="block")),
    "grafting.epsilon_placement": dataclasses.replace(BASE, grafting=dataclasses.replace(
        BASE.grafting, type="rmsprop", beta2=0.9, epsilon=1e-8)),
    "weight_decay.type": dataclasses.replace(
        BASE, weight_decay=ss.WeightDecayConfig(value=0.1, type="l2")),
    "momentum.dampening": dataclasses.replace(BASE, momentum=dataclasses.replace(
        BASE.momentum, dampening=0.5)),
    "blocking.skip_rank_lt": dataclasses.replace(BASE, blocking=dataclasses.replace(
        BASE.blocking, skip_rank_lt=3)),
    "frequent_directions": dataclasses.replace(
        BASE, frequent_directions=ss.FrequentDirectionsConfig(rank=2),
        epsilon=ss.EpsilonConfig(value=1e-6)),
    "gradient_filter.beta1": dataclasses.replace(
        BASE, gradient_filter=ss.GradientFilterConfig(beta1=0.9)),
    "epsilon.rank_cutoff_scope": dataclasses.replace(
        BASE, epsilon=dataclasses.replace(BASE.epsilon, rank_cutoff_scope="factor")),
}


@pytest.mark.parametrize("field", sorted(MOVES))
def test_inexpressible_fields_are_named(field: str) -> None:
    with pytest.raises(ValueError, match=rf"tearfree cannot express .*{field} = "):
        ss.to_tearfree(MOVES[field])


def test_a_default_config_lists_every_field_tearfree_lacks() -> None:
    with pytest.raises(ValueError) as error:
        ss.to_tearfree(ss.ShampooConfig())
    for field in ("blocking.merge_direction", "blocking.scalar_factor", "epsilon.placement",
                  "epsilon.rank_rtol", "exponents.default"):
        assert f"{field} = " in str(error.value)
