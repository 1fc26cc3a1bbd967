"""The step schedule (eq. 8) under both anchors' conventions."""

from __future__ import annotations

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
