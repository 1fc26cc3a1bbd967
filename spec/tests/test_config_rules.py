"""The rules derived from the config (docs/spec.md eqs. 6-7, 14-15, 17-21), checked by hand.

Every backend reads these properties instead of re-deriving them, so each is
pinned here against its closed form.
"""

from __future__ import annotations

import pytest

from shampoo_spec import (
    GRAFTING_TYPES,
    EigenvalueCorrectionConfig,
    EpsilonConfig,
    GradientFilterConfig,
    GraftingConfig,
    IterateAveragingConfig,
    MomentumConfig,
    ShampooConfig,
    StatisticsConfig,
    WeightDecayConfig,
)


@pytest.mark.parametrize(
    ("beta2", "ema_weight", "weight", "decays"),
    [
        (1.0, "one_minus_beta2", 1.0, False),  # AdaGrad-style sum
        (0.75, "one_minus_beta2", 0.25, True),  # EMA
        (0.75, "one", 1.0, True),  # Google's weight 1 on the new term
        (0.0, "one_minus_beta2", 1.0, True),  # only the latest gradient
    ],
)
def test_statistics_update_weight_eq6(
    beta2: float, ema_weight: str, weight: float, decays: bool
) -> None:
    stats = StatisticsConfig(beta2=beta2, ema_weight=ema_weight)  # type: ignore[arg-type]
    assert stats.update_weight == weight
    assert stats.decays is decays


def test_statistics_bias_correction_eq7() -> None:
    ema = StatisticsConfig(beta2=0.5, bias_correction=True)
    assert ema.corrects_bias
    assert ema.bias_correction_factor(0) == 1.0  # no update yet: nothing to correct
    assert ema.bias_correction_factor(1) == 0.5
    assert ema.bias_correction_factor(3) == 1.0 - 0.125
    # A sum has no bias; without the flag nothing is corrected.
    assert not StatisticsConfig(beta2=1.0, bias_correction=True).corrects_bias
    assert StatisticsConfig(beta2=1.0, bias_correction=True).bias_correction_factor(5) == 1.0
    assert StatisticsConfig(beta2=0.5).bias_correction_factor(5) == 1.0


def test_eigenvalue_correction_rules_eq17() -> None:
    ec = EigenvalueCorrectionConfig(beta2=0.5, bias_correction=True)
    assert ec.decays and ec.corrects_bias
    assert ec.bias_correction_factor(0) == 1.0
    assert ec.bias_correction_factor(2) == 0.75
    summed = EigenvalueCorrectionConfig(beta2=1.0, bias_correction=True)
    assert not summed.decays and not summed.corrects_bias
    assert summed.bias_correction_factor(4) == 1.0
    assert ec.update_weight == 0.5 and summed.update_weight == 1.0
    # Meta's drop_weighting_factor_on_gsquare: D <- beta2 D + (G x_k Q_k^T)^2.
    dropped = EigenvalueCorrectionConfig(beta2=0.5, ema_weight="one", bias_correction=False)
    assert dropped.decays and dropped.update_weight == 1.0
    assert dropped.bias_correction_factor(3) == 1.0


@pytest.mark.parametrize("kind", GRAFTING_TYPES)
def test_grafting_state_and_scope_eq14_eq18(kind: str) -> None:
    beta2 = {"rmsprop": 0.9, "adam": 0.9, "rmsprop_normalized": 0.9}.get(kind, 1.0)
    # Eq. (14e) adds its epsilon inside the moments: no other placement.
    placement = "inside_sqrt" if kind == "adafactor" else "after_sqrt"
    graft = GraftingConfig(type=kind, beta2=beta2, norm_scope="parameter",  # type: ignore[arg-type]
                           epsilon_placement=placement)
    adaptive = kind not in ("none", "sgd", "sign")
    assert graft.adaptive is adaptive
    assert graft.has_state is (adaptive and kind != "adafactor")  # eq. (14b): elementwise V
    assert graft.factored is (kind == "adafactor")
    assert graft.normalizes_input is kind.endswith("_normalized")
    assert graft.rescale_scope == (None if kind == "none" else "parameter")


def test_grafting_weights_and_bias_correction_eq14() -> None:
    adam = GraftingConfig(type="adam", beta2=0.5, bias_correction=True)
    assert adam.update_weight == 0.5
    assert adam.bias_correction_factor(2) == 0.75
    adagrad = GraftingConfig(type="adagrad", bias_correction=True)
    assert adagrad.update_weight == 1.0
    assert not adagrad.corrects_bias and adagrad.bias_correction_factor(7) == 1.0
    dropped = GraftingConfig(type="rmsprop", beta2=0.5, ema_weight="one")
    assert dropped.update_weight == 1.0 and dropped.bias_correction_factor(2) == 1.0


def test_gradient_filter_eq15() -> None:
    off = GradientFilterConfig()
    assert not off.enabled
    same = GradientFilterConfig(beta1=0.5, bias_correction=True)
    assert same.enabled and same.direction_beta == 0.5
    # 1 - beta3 * beta1^(t-1): at t = 1 the filter holds only (1 - beta1) G.
    assert same.bias_correction_factor(1) == 0.5
    assert same.bias_correction_factor(3) == 1.0 - 0.5 * 0.25
    nesterov_like = GradientFilterConfig(beta1=0.5, beta3=0.25, bias_correction=True)
    assert nesterov_like.direction_beta == 0.25
    assert nesterov_like.bias_correction_factor(2) == 1.0 - 0.25 * 0.5
    assert GradientFilterConfig(beta1=0.5).bias_correction_factor(9) == 1.0


def test_momentum_eq19_eq20() -> None:
    assert not MomentumConfig().enabled
    assert not MomentumConfig(buffers="separate").separate_buffers  # no momentum: no buffers
    mom = MomentumConfig(momentum=0.9, dampening=0.25, buffers="separate")
    assert mom.enabled and mom.separate_buffers
    assert mom.direction_weight == 0.75
    assert not mom.lr_before_momentum
    assert MomentumConfig(learning_rate_placement="before_momentum").lr_before_momentum


@pytest.mark.parametrize("kind", ["l2", "direction", "update"])
def test_weight_decay_applies_eqs2_19_21(kind: str) -> None:
    on = WeightDecayConfig(value=0.1, type=kind)  # type: ignore[arg-type]
    assert [k for k in ("l2", "direction", "update") if on.applies(k)] == [kind]
    off = WeightDecayConfig(value=0.0, type=kind)  # type: ignore[arg-type]
    assert not off.applies(kind)  # type: ignore[arg-type]


def test_initial_factor_scale_eq6() -> None:
    eps = EpsilonConfig(value=1e-3)
    assert ShampooConfig(epsilon=eps).initial_factor_scale == 0.0
    google = ShampooConfig(
        epsilon=eps, statistics=StatisticsConfig(initial_value="epsilon_identity")
    )
    assert google.initial_factor_scale == 1e-3


# ------------------------------------------------------------ eq. (20e)
def test_averaging_scalars_in_float32_are_float32_operations() -> None:
    """Eq. (20e): each scalar equals the same operations done in numpy's float32 (IEEE
    single), step by step over a decaying rate; the default (None) keeps float64."""
    np = pytest.importorskip("numpy")
    f32 = np.float32
    for kind, p in (("schedule_free", 2), ("schedule_free", 1), ("gpa", 2)):
        av = IterateAveragingConfig(type=kind, train_interp=0.8, eval_lr_power=p,
                                    scalar_dtype="float32")
        wide = IterateAveragingConfig(type=kind, train_interp=0.8, eval_lr_power=p)
        s, s32, s64 = 0.0, f32(0.0), 0.0
        for t in range(1, 40):
            lr = 0.1 / t**0.5
            l32 = f32(lr)
            s = av.power_sum(s, lr)
            s32 = f32(s32 + l32 ** p)
            assert s == float(s32)
            s64 = wide.power_sum(s64, lr)
            mu_x = av.eval_coefficient(lr, s)
            want = f32(0.9) if kind == "gpa" else f32(f32(1.0) - l32 ** p / s32)
            assert mu_x == float(want)
            a, b = av.step_coefficients(lr, s)
            assert (a, b) == (float(f32(1.0) - want * f32(0.8)), float(f32(1.0) - want))
            assert av.decay_factor(lr, 0.01) == float(f32(1.0) - l32 * f32(0.01))
        assert abs(s64 - sum((0.1 / t**0.5) ** p for t in range(1, 40))) < 1e-15
        assert wide.decay_factor(0.1, 0.01) == 1.0 - 0.1 * 0.01
    assert av.switch_coefficient("eval") == float(f32(1.0) - f32(1.0) / f32(0.8))
    assert av.switch_coefficient("train") == float(f32(1.0) - f32(0.8))
    assert wide.switch_coefficient("eval") == 1.0 - 1.0 / 0.8


def test_to_float32_rounds_past_the_range_to_inf() -> None:
    from shampoo_spec import to_float32

    assert to_float32(3.5e38) == float("inf") and to_float32(-3.5e38) == float("-inf")
    assert to_float32(3.4028235e38) == 3.4028234663852886e38
    assert to_float32(0.1) == 0.10000000149011612
