"""The step schedule (eq. 8) under both anchors' conventions."""

from __future__ import annotations

import math

import pytest

import shampoo_spec as ss


def _steps(pred, schedule: ss.ScheduleConfig, n: int = 12) -> list[int]:  # type: ignore[no-untyped-def]
    return [t for t in range(1, n + 1) if pred(t, schedule)]


def test_meta_convention_roots_at_start_then_every_period_end() -> None:
    s = ss.ScheduleConfig(precondition_frequency=4, start_preconditioning_step=6)
    assert _steps(ss.is_root_step, s) == [6, 8, 12]
    assert _steps(ss.uses_preconditioner, s) == list(range(6, 13))
    assert _steps(ss.is_statistics_step, s) == list(range(1, 13))


def test_google_convention_roots_from_step_one_every_period_start() -> None:
    s = ss.ScheduleConfig(
        precondition_frequency=4,
        statistics_frequency=2,
        start_preconditioning_step=6,
        period_anchor="start",
        roots_before_start=True,
    )
    assert _steps(ss.is_root_step, s) == [1, 5, 9]
    assert _steps(ss.is_statistics_step, s) == [1, 3, 5, 7, 9, 11]
    assert _steps(ss.uses_preconditioner, s) == list(range(6, 13))


def test_never_start() -> None:
    s = ss.ScheduleConfig(start_preconditioning_step=None)
    assert _steps(ss.is_root_step, s) == []
    assert _steps(ss.uses_preconditioner, s) == []


def test_step_zero_is_rejected() -> None:
    with pytest.raises(ValueError, match="step"):
        ss.is_root_step(0, ss.ScheduleConfig())


# ------------------------------------------------ eq. (8b): the growing period
GROWING = ss.ScheduleConfig(precondition_frequency=10, precondition_frequency_growth=25,
                            period_anchor="start", roots_before_start=True)


@pytest.mark.parametrize(
    ("ratio", "period"),
    [
        (1.0, 10),  # f + 0 g = 10
        (0.6, 20),  # 10 + 0.4 * 25 = 20 exactly
        (0.61, 10),  # 19.75: floor to the ten below
        (0.0, 30),  # 35 -> 30
        (-1.0, 60),  # 60 (a negative rate only lengthens the period)
        (1.5, 1),  # -2.5 -> floor -10, at least 1
        (3.0, 1),
        (math.inf, None),  # a warm-up from lr_1 = 0: x = -inf, no root step (Google: NaN)
        (math.nan, None),  # 0 / 0 at step 1
        (-1e308, None),  # x overflows to inf
    ],
)
def test_root_period_closed_forms(ratio: float, period: int | None) -> None:
    assert ss.root_period(GROWING, ratio) == period


def test_root_period_floor_is_the_exact_quotient_and_capped() -> None:
    # x just below 30 stays in the twenties; exactly 30 is thirty.
    s = ss.ScheduleConfig(precondition_frequency=29, precondition_frequency_growth=1)
    assert ss.root_period(s, 2.0**-40) == 20
    assert ss.root_period(s, 0.0) == 30
    # f below 10 with growth: Google's rule gives 1 (every step) at ratio 1.
    assert ss.root_period(ss.ScheduleConfig(precondition_frequency=5,
                                            precondition_frequency_growth=3), 1.0) == 1
    huge = ss.ScheduleConfig(precondition_frequency=10, precondition_frequency_growth=2**31 - 1)
    assert ss.root_period(huge, -5.0) == ss.MAX_INTEGER
    # Without growth the ratio is never read.
    assert ss.root_period(ss.ScheduleConfig(precondition_frequency=7), math.nan) == 7


def test_learning_rate_ratio_is_ieee() -> None:
    assert ss.learning_rate_ratio(0.05, 0.1) == 0.05 / 0.1
    assert math.isnan(ss.learning_rate_ratio(0.0, 0.0))
    assert ss.learning_rate_ratio(0.1, 0.0) == math.inf
    assert ss.learning_rate_ratio(-0.1, 0.0) == -math.inf


def test_growing_period_root_steps() -> None:
    """Google's count c = t - 1: roots where c % f_t == 0, f_t from this step's ratio."""
    def ratio(t: int) -> float:  # a linear decay to 0 over 40 steps
        return max(1.0 - (t - 1) / 40, 0.0)

    roots = [t for t in range(1, 62) if ss.is_root_step(t, GROWING, ratio(t))]
    expected = []
    for t in range(1, 62):
        f = max(math.floor((10 + (1 - ratio(t)) * 25) / 10) * 10, 1)
        if (t - 1) % f == 0:
            expected.append(t)
    assert roots == expected == [1, 11, 21, 61]  # periods 10, 10, 20, then 30 from t = 41
    # Meta's anchor: the start step, then t % f_t == 0 after it.
    meta = ss.ScheduleConfig(precondition_frequency=10, precondition_frequency_growth=25,
                             start_preconditioning_step=5)
    assert [t for t in range(1, 61) if ss.is_root_step(t, meta, ratio(t))] == [5, 10, 20, 60]
    # No period at all: only the start step (Meta's rule) is left.
    assert [t for t in range(1, 30) if ss.is_root_step(t, meta, math.nan)] == [5]
    assert not any(ss.is_root_step(t, GROWING, math.nan) for t in range(1, 30))
