"""``from_tearfree``: the mapping of tearfree's options, its refusals and its messages.

The numerics are checked against the real library in anchors/test_tearfree_library.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any

import pytest

import shampoo_spec as ss
from shampoo_spec import from_tearfree

SGD = {"grafting_options": {"grafting_type": "SGD"}}


def _with(section: str, **values: Any) -> dict[str, Any]:
    return {**SGD, section: {**SGD.get(section, {}), **values}}


def test_exported() -> None:
    assert "from_tearfree" in ss.__all__
    assert ss.anchors.from_tearfree is from_tearfree


def test_adafactor_graft_is_eq_14e() -> None:
    """ADAFACTOR: optax.adafactor with tearfree's arguments (eq. 14e); its decay is the
    exponent c of 1 - t^-c, the clip eq. (14d)'s, the parameter scale floored at 1e-3."""
    c = from_tearfree({"grafting_options": {"grafting_type": "ADAFACTOR"}}, 0.01)
    assert c.grafting == ss.GraftingConfig(
        type="adafactor", decay_exponent=0.999, factor_min_dim=128, epsilon=1e-23,
        epsilon_placement="inside_sqrt", clip_rms=1.0, parameter_scale_floor=1e-3,
        norm_scope="parameter", norm_epsilon=2.0**-126)
    c = from_tearfree(_with("grafting_options", grafting_type="ADAFACTOR",
                            second_moment_decay=0.8, min_dim_size_to_factor=4,
                            multiply_by_parameter_scale=False, clipping_threshold=2.0,
                            epsilon=1e-30), 0.01)
    g = c.grafting
    assert (g.decay_exponent, g.factor_min_dim, g.parameter_scale_floor, g.clip_rms,
            g.epsilon) == (0.8, 4, None, 2.0, 1e-30)
    with pytest.raises(ValueError, match=r"grafting_options\.epsilon = 0\.0 is invalid"):
        from_tearfree(_with("grafting_options", grafting_type="ADAFACTOR", epsilon=0.0), 0.01)
    with pytest.raises(ValueError, match=r"second_moment_decay = 1\.0 is invalid"):
        from_tearfree(_with("grafting_options", grafting_type="ADAFACTOR",
                            second_moment_decay=1.0), 0.01)


def test_sgd_defaults() -> None:
    c = from_tearfree(SGD, 0.01)
    assert c.learning_rate == 0.01
    assert c.statistics == ss.StatisticsConfig(beta2=0.999, initial_value="zero")
    assert c.epsilon == ss.EpsilonConfig(value=0.0, placement="pseudo_inverse", rank_rtol=1e-6,
                                         rank_cutoff_scope="parameter")  # eq. (10g)
    assert isinstance(c.root_inverse, ss.EighConfig) and c.root_inverse.failure_threshold is None
    assert c.low_rank is None and c.frequent_directions is None
    assert c.exponents == ss.ExponentConfig(default="preconditioned_dims")
    assert c.grafting.type == "sgd" and c.grafting.norm_scope == "parameter"
    assert c.grafting.norm_epsilon == 2.0**-126
    assert c.gradient_filter.beta1 == 0.0
    assert c.momentum == ss.MomentumConfig(momentum=0.9, nesterov=True, buffers="shared")
    assert c.weight_decay == ss.WeightDecayConfig(value=0.0, type="update")
    assert c.blocking == ss.BlockingConfig(
        max_preconditioner_dim=1024, merge_dims_up_to=1024, merge_direction="first_to_last",
        skip_dim_size_gt=4096, skip_rank_lt=2, scalar_factor=False,
    )
    assert c.schedule == ss.ScheduleConfig(
        precondition_frequency=1, statistics_frequency=1, start_preconditioning_step=1,
        period_anchor="start", roots_before_start=True,
    )
    assert c.factor_dtype == "float64"
    assert from_tearfree(SGD, 0.01, x64=False).factor_dtype == "float32"


def test_every_option_maps() -> None:
    c = from_tearfree({
        "grafting_options": {
            "grafting_type": "GraftingType.SGD", "start_preconditioning_step": 4,
            "skip_preconditioning_rank1": False, "skip_preconditioning_any_dim_gt": 100,
            "second_moment_decay": 0.0, "epsilon": 0.0,
        },
        "second_order_options": {
            "merge_dims": 64, "second_order_type": "shampoo",
            "shampoo_options": {"block_size": 48, "update_preconditioners_freq": 5,
                                "update_statistics_freq": 2, "second_moment_decay": 1.0},
        },
        "momentum_options": {"ema": True, "nesterov": False, "momentum_decay": 0.5,
                             "weight_decay": 0.01, "weight_decay_after_momentum": False},
    }, 0.1)
    assert c.schedule.start_preconditioning_step == 5  # count 4 is our step 5
    assert c.schedule.precondition_frequency == 5 and c.schedule.statistics_frequency == 2
    assert c.blocking.skip_rank_lt == 0 and c.blocking.skip_dim_size_gt == 100
    assert c.blocking.merge_dims_up_to == 64 and c.blocking.max_preconditioner_dim == 48
    assert c.statistics.beta2 == 1.0 and c.statistics.update_weight == 1.0
    assert c.momentum == ss.MomentumConfig(momentum=0.5, dampening=0.5, nesterov=False)
    assert c.weight_decay == ss.WeightDecayConfig(value=0.01, type="direction")


def test_no_graft_ignores_masks_and_start() -> None:
    c = from_tearfree({"grafting_options": {"grafting_type": "none",
                                            "start_preconditioning_step": 9}}, 0.001)
    assert c.grafting.type == "none"
    assert c.schedule.start_preconditioning_step == 1
    assert c.blocking.skip_rank_lt == 0 and c.blocking.skip_dim_size_gt is None


def test_negative_start_acts_as_zero_and_no_momentum() -> None:
    c = from_tearfree({**SGD, "grafting_options": {"grafting_type": "SGD",
                                                   "start_preconditioning_step": -3},
                       "momentum_options": {"momentum_decay": 0.0, "ema": True}}, 0.01)
    assert c.schedule.start_preconditioning_step == 1
    assert c.momentum == ss.MomentumConfig()


def test_callable_learning_rate() -> None:
    c = from_tearfree(SGD, lambda count: 0.5 / (1 + count))
    assert c.learning_rate == 0.5
    with pytest.raises(ValueError, match=r"learning_rate\(0\) failed"):
        from_tearfree(SGD, lambda count: "x")


def _sketchy(**values: Any) -> dict[str, Any]:
    return _with("second_order_options", second_order_type="SKETCHY", sketchy_options=values)


def test_sketchy_defaults() -> None:
    """Eq. (10e) (``rule="tearfree"``) on every merged dim, one block per parameter,
    epsilon 1e-7 relative, decay 0.999 (sketch beta2; tail sqrt(beta2)), every step."""
    c = from_tearfree(_sketchy(), 0.01)
    shampoo = from_tearfree(SGD, 0.01)
    assert c.frequent_directions == ss.FrequentDirectionsConfig(rank=128, rule="tearfree")
    assert c.epsilon == ss.EpsilonConfig(value=1e-7, scale="relative")
    assert c.statistics == shampoo.statistics
    assert c.blocking == replace(shampoo.blocking, max_preconditioner_dim=2**31 - 1)
    assert c.schedule == shampoo.schedule
    assert (c.grafting, c.momentum, c.weight_decay) == (
        shampoo.grafting, shampoo.momentum, shampoo.weight_decay)
    assert c.exponents.default == "preconditioned_dims"


def test_sketchy_options_map() -> None:
    c = from_tearfree(_sketchy(epsilon=1e-3, rank=5, relative_epsilon=False,
                               second_moment_decay=0.9, update_freq=3, add_ggt=True), 0.01)
    assert c.frequent_directions == ss.FrequentDirectionsConfig(rank=5, rule="tearfree")
    assert c.epsilon == ss.EpsilonConfig(value=1e-3, scale="absolute")
    assert c.statistics.beta2 == 0.9
    assert (c.schedule.precondition_frequency, c.schedule.statistics_frequency) == (3, 3)
    # Epsilon 0: no relative rule (tearfree's "relative_epsilon and epsilon > 0").
    assert from_tearfree(_sketchy(epsilon=0.0), 0.01).epsilon.scale == "absolute"
    # add_ggt stores a matrix only: the same config.
    assert from_tearfree(_sketchy(add_ggt=True), 0.01) == from_tearfree(_sketchy(), 0.01)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"rank": 0}, r"sketchy_options\.rank = 0 is invalid"),
        ({"update_freq": 0}, r"sketchy_options\.update_freq = 0 is invalid"),
        ({"second_moment_decay": 1.5}, r"sketchy_options\.second_moment_decay = 1\.5 is invalid"),
        ({"epsilon": -1.0}, r"sketchy_options\.epsilon = -1\.0 is invalid"),
        ({"bogus": 1}, r"unknown key"),
    ],
)
def test_sketchy_invalid_options(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_tearfree(_sketchy(**values), 0.01)


def test_shampoo_options_are_checked_and_unused_with_sketchy() -> None:
    c = from_tearfree(_with("second_order_options", second_order_type="SKETCHY",
                            sketchy_options={}, shampoo_options={"block_size": 8}), 0.01)
    assert c == from_tearfree(_sketchy(), 0.01)
    with pytest.raises(ValueError, match=r"shampoo_options\.block_size = 1 is invalid"):
        from_tearfree(_with("second_order_options", second_order_type="SKETCHY",
                            sketchy_options={}, shampoo_options={"block_size": 1}), 0.01)


def test_sketchy_options_are_checked_and_unused_with_shampoo() -> None:
    c = from_tearfree(_with("second_order_options", sketchy_options={"rank": 4}), 0.01)
    assert c == from_tearfree(SGD, 0.01)
    with pytest.raises(ValueError, match=r"second_order_options\.sketchy_options\.rank = 0"):
        from_tearfree(_with("second_order_options", sketchy_options={"rank": 0}), 0.01)


@pytest.mark.parametrize(
    ("options", "key", "formula"),
    [
        (_sketchy(ekfac_svd=True), "second_order_options.sketchy_options.ekfac_svd = True",
         "EKFAC-SVD"),
        (_sketchy(linear_approx_tail=True),
         "second_order_options.sketchy_options.linear_approx_tail = True", "log(rank)"),
        (_sketchy(memory_alloc={"w": [2, 2]}),
         "second_order_options.sketchy_options.memory_alloc = {'w': [2, 2]}",
         "FrequentDirectionsConfig.rank"),
        (_with("momentum_options", momentum_decay=1.0), "momentum_options.momentum_decay = 1.0",
         "momentum < 1"),
        (_with("grafting_options", grafting_type="SGD", skip_preconditioning_any_dim_gt=0),
         "grafting_options.skip_preconditioning_any_dim_gt = 0", "skip_dim_size_gt"),
    ],
)
def test_unsupported_options_raise_naming_the_key(options: Any, key: str, formula: str) -> None:
    with pytest.raises(NotImplementedError) as err:
        from_tearfree(options, 0.01)
    assert f"from_tearfree.{key}" in str(err.value)
    assert formula in str(err.value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"grafting": {}}, "from_tearfree has unknown key(s) ['grafting']: allowed keys are "
         "['grafting_options', 'momentum_options', 'second_order_options']"),
        ({"type": "x"}, "from_tearfree has unknown key(s) ['type']"),
        (_with("grafting_options", graft_type="SGD"),
         "grafting_options has unknown key(s) ['graft_type']: allowed keys are ['clipping_"),
        (_with("second_order_options", shampoo_options={"blocksize": 4}),
         "second_order_options.shampoo_options has unknown key(s) ['blocksize']"),
        (_with("momentum_options", type="x"), "momentum_options has unknown key(s) ['type']"),
        ({"grafting_options": []}, "grafting_options = [] is invalid: allowed a JSON object"),
        ({"grafting_options": {"grafting_type": "ADAGRAD"}},
         "grafting_options.grafting_type = 'ADAGRAD' is invalid: allowed a GraftingType member"),
        ({"grafting_options": {"grafting_type": 1}}, "grafting_options.grafting_type = 1"),
        (_with("grafting_options", grafting_type="SGD", skip_preconditioning_rank1=1),
         "grafting_options.skip_preconditioning_rank1 = 1 is invalid: allowed true or false"),
        (_with("grafting_options", grafting_type="SGD", start_preconditioning_step=1.5),
         "grafting_options.start_preconditioning_step = 1.5 is invalid: allowed an integer"),
        (_with("grafting_options", grafting_type="RMSPROP", epsilon=-1.0),
         "grafting_options.epsilon = -1.0 is invalid: allowed a number >= 0"),
        (_with("grafting_options", grafting_type="RMSPROP", second_moment_decay=0.0),
         "grafting_options.second_moment_decay = 0.0 is invalid: allowed a number in (0, 1]"),
        (_with("grafting_options", grafting_type="ADAFACTOR", clipping_threshold=0.5),
         "grafting_options.clipping_threshold = 0.5 is invalid: allowed a number >= 1"),
        (_with("grafting_options", grafting_type="SGD", epsilon=math.nan),
         "grafting_options.epsilon = nan is invalid: allowed a finite number"),
        (_with("second_order_options", merge_dims=1),
         "second_order_options.merge_dims = 1 is invalid: allowed an integer in [2,"),
        (_with("second_order_options", second_order_type="KFAC"),
         "second_order_options.second_order_type = 'KFAC' is invalid: allowed a SecondOrderType"),
        (_with("second_order_options", second_order_type="SKETCHY"),
         "second_order_options.sketchy_options = None is invalid: allowed a JSON object"),
        (_with("second_order_options", shampoo_options=None),
         "second_order_options.shampoo_options = None is invalid: allowed a JSON object"),
        (_with("second_order_options", shampoo_options={"block_size": 1}),
         "second_order_options.shampoo_options.block_size = 1 is invalid: allowed an integer "
         "in [2,"),
        (_with("second_order_options", shampoo_options={"update_statistics_freq": 0}),
         "second_order_options.shampoo_options.update_statistics_freq = 0 is invalid"),
        (_with("second_order_options", shampoo_options={"update_preconditioners_freq": "2"}),
         "second_order_options.shampoo_options.update_preconditioners_freq = '2' is invalid"),
        (_with("second_order_options", shampoo_options={"second_moment_decay": 1.5}),
         "second_order_options.shampoo_options.second_moment_decay = 1.5 is invalid: allowed "
         "a number in [0, 1]"),
        (_with("momentum_options", momentum_decay=-0.1),
         "momentum_options.momentum_decay = -0.1 is invalid: allowed a number in [0, 1]"),
        (_with("momentum_options", weight_decay=-1),
         "momentum_options.weight_decay = -1.0 is invalid: allowed a number >= 0"),
        (_with("momentum_options", ema="true"),
         "momentum_options.ema = 'true' is invalid: allowed true or false"),
    ],
)
def test_malformed_options_raise_value_error(options: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        from_tearfree(options, 0.01)


@pytest.mark.parametrize("lr", [-0.1, math.inf, "0.1", None])
def test_malformed_learning_rate(lr: Any) -> None:
    with pytest.raises(ValueError, match="learning_rate"):
        from_tearfree(SGD, lr)


def test_malformed_x64_and_options_object() -> None:
    with pytest.raises(ValueError, match="x64"):
        from_tearfree(SGD, 0.01, x64="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="allowed a JSON object"):
        from_tearfree([], 0.01)  # type: ignore[arg-type]


def test_rmsprop_graft_is_eq_14c_with_epsilon_inside_the_square_root() -> None:
    """Tearfree's default graft: g * rsqrt(acc + epsilon), acc an EMA (or a sum at 1)."""
    default = from_tearfree({}, 0.01).grafting
    assert (default.type, default.beta2, default.epsilon, default.epsilon_placement) == (
        "rmsprop", 0.999, 1e-23, "inside_sqrt")
    assert not default.bias_correction and default.norm_scope == "parameter"
    summed = from_tearfree({"grafting_options": {"second_moment_decay": 1.0}}, 0.01).grafting
    assert (summed.type, summed.beta2) == ("adagrad", 1.0)
    with pytest.raises(ValueError, match=r"grafting_options\.epsilon = 0\.0 is invalid"):
        from_tearfree({"grafting_options": {"epsilon": 0.0}}, 0.01)
