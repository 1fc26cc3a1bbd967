"""The step schedule, eq. (8): which work happens at step t (t = 1, 2, ...).

Pure functions of the step number and :class:`ScheduleConfig`; every backend
asks these rather than re-deriving the off-by-one conventions of the anchors.
"""

from __future__ import annotations

import math

from ._validate import MAX_INTEGER
from .config import ScheduleConfig


def _on_period(t: int, frequency: int, anchor: str) -> bool:
    """True on the amortized step of each period of ``frequency`` steps.

    ``anchor="end"``: t = f, 2f, ... (Meta's 1-based ``t % f == 0``);
    ``anchor="start"``: t = 1, f + 1, 2f + 1, ... (Google's 0-based count).
    """
    if t < 1:
        raise ValueError(f"step t = {t} is invalid: steps are counted from 1.")
    return (t % frequency == 0) if anchor == "end" else ((t - 1) % frequency == 0)


def is_statistics_step(t: int, schedule: ScheduleConfig) -> bool:
    """Do the Kronecker factors (eq. 6) absorb this step's gradient?"""
    return _on_period(t, schedule.statistics_frequency, schedule.period_anchor)


def uses_preconditioner(t: int, schedule: ScheduleConfig) -> bool:
    """Is the Shampoo direction (rather than the graft) used at step t?"""
    start = schedule.start_preconditioning_step
    return start is not None and t >= start


def learning_rate_ratio(lr_t: float, lr_1: float) -> float:
    """``rho_t = lr_t / lr_1`` of eq. (8b) as IEEE float64 division.

    ``x / 0`` is ``+-inf`` and ``0 / 0`` NaN (Python's ``/`` would raise):
    a schedule that starts at 0 (a warm-up) gives a non-finite ratio, and
    eq. (8b) then has no root step at all, as in Google's library.
    """
    lr_t, lr_1 = float(lr_t), float(lr_1)
    if lr_1 != 0.0:
        return lr_t / lr_1
    if lr_t == 0.0 or math.isnan(lr_t):
        return math.nan
    return math.copysign(math.inf, lr_t) * math.copysign(1.0, lr_1)


def root_period(schedule: ScheduleConfig, lr_ratio: float = 1.0) -> int | None:
    """The root period f_t of eq. (8b); None when there is none (no root step).

    Without ``precondition_frequency_growth`` it is ``precondition_frequency``
    whatever ``lr_ratio``. With growth g, in float64 (Google's
    ``preconditioning_compute_steps_schedule``)::

        x = f + (1 - rho) * g;   f_t = max(floor(x / 10) * 10, 1)

    ``floor(x / 10)`` is the floor of the exact quotient (Python's and
    NumPy's float ``//``); a non-finite x (a NaN or infinite ratio) gives
    None, as Google's ``count % nan == 0`` is never true. f_t is capped at
    ``MAX_INTEGER``: no step counter reaches a longer period, so the cap
    changes no decision.
    """
    growth = schedule.precondition_frequency_growth
    if growth is None:
        return schedule.precondition_frequency
    x = schedule.precondition_frequency + (1.0 - float(lr_ratio)) * growth
    if not math.isfinite(x):
        return None
    period = max((x // 10.0) * 10.0, 1.0)
    return int(min(period, float(MAX_INTEGER)))


def is_root_step(t: int, schedule: ScheduleConfig, lr_ratio: float = 1.0) -> bool:
    """Are the inverse roots (eqs. 10-11) recomputed at step t?

    With ``roots_before_start`` roots follow the period from step 1;
    otherwise only from the start step on, and always at the start step so
    the first Shampoo step never uses identity roots. The period is
    :func:`root_period` at ``lr_ratio`` = lr_t / lr_1 (eq. 8b; only read
    with ``precondition_frequency_growth``).
    """
    period = root_period(schedule, lr_ratio)
    on_period = _on_period(t, period or 1, schedule.period_anchor) and period is not None
    if schedule.roots_before_start:
        return on_period
    start = schedule.start_preconditioning_step
    if start is None:
        return False
    return t == start or (t > start and on_period)
