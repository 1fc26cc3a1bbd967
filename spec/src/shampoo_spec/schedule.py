"""The step schedule, eq. (8): which work happens at step t (t = 1, 2, ...).

Pure functions of the step number and :class:`ScheduleConfig`; every backend
asks these rather than re-deriving the off-by-one conventions of the anchors.
"""

from __future__ import annotations

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


def is_root_step(t: int, schedule: ScheduleConfig) -> bool:
    """Are the inverse roots (eqs. 10-11) recomputed at step t?

    With ``roots_before_start`` roots follow the frequency from step 1;
    otherwise only from the start step on, and always at the start step so
    the first Shampoo step never uses identity roots.
    """
    on_period = _on_period(t, schedule.precondition_frequency, schedule.period_anchor)
    if schedule.roots_before_start:
        return on_period
    start = schedule.start_preconditioning_step
    if start is None:
        return False
    return t == start or (t > start and on_period)
