"""The step schedule of eq. (8) on a traced step count.

The same rules as :mod:`shampoo_spec.schedule`, written so that a decision
known at trace time stays a Python ``bool`` (no work is emitted for it) and
one that depends on the step becomes a traced boolean scalar. ``t`` is the
1-based step of eq. (1). tests/test_schedule.py checks every function
against ``shampoo_spec.schedule`` for many steps and configs.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array

from shampoo_spec import MAX_INTEGER, ScheduleConfig, root_period

Flag = bool | Array


def _and(a: Flag, b: Flag) -> Flag:
    if a is False or b is False:
        return False
    if a is True:
        return b
    if b is True:
        return a
    return jnp.logical_and(a, b)


def _or(a: Flag, b: Flag) -> Flag:
    if a is True or b is True:
        return True
    if a is False:
        return b
    if b is False:
        return a
    return jnp.logical_or(a, b)


def on_period(t: Array, frequency: int, anchor: str) -> Flag:
    """``t % f == 0`` (anchor "end") or ``(t - 1) % f == 0`` ("start"); True when f = 1."""
    if frequency == 1:
        return True
    if anchor == "end":
        return t % frequency == 0
    return (t - 1) % frequency == 0


def is_statistics_step(t: Array, schedule: ScheduleConfig) -> Flag:
    """Do the factors absorb this step's gradient (eq. 6)?"""
    return on_period(t, schedule.statistics_frequency, schedule.period_anchor)


def uses_preconditioner(t: Array, schedule: ScheduleConfig) -> Flag:
    """Is the Shampoo direction (not the graft) used at step t?"""
    start = schedule.start_preconditioning_step
    if start is None:
        return False
    if start <= 1:
        return True
    return t >= start


def root_period_flag(t: Array, schedule: ScheduleConfig, lr_ratio: float | Array) -> Flag:
    """``on(t, f_t)`` with eq. (8b)'s period f_t at ``lr_ratio`` (False where there is none).

    A Python ``lr_ratio`` (or no ``precondition_frequency_growth``) gives a
    static period, :func:`shampoo_spec.root_period`. A traced one follows
    the same formula in its own dtype, as Google's library does::

        x = f + (1 - rho) g;  f_t = max(floor(x / 10) * 10, 1)  (jnp's float ``//``)

    a non-finite x has no root step, and f_t is capped at ``MAX_INTEGER``
    (taken as an int32 exactly; every float32 below 2^31 is).
    """
    anchor = schedule.period_anchor
    growth = schedule.precondition_frequency_growth
    if growth is None or not isinstance(lr_ratio, Array):
        period = root_period(schedule, float(lr_ratio))
        return False if period is None else on_period(t, period, anchor)
    x = schedule.precondition_frequency + (1 - lr_ratio) * growth
    finite = jnp.isfinite(x)
    f = jnp.maximum((x // 10) * 10, 1)
    big = f >= 2.0**31
    f_int = jnp.where(finite & ~big, f, 1).astype(jnp.int32)
    f_int = jnp.where(big, MAX_INTEGER, f_int)
    steps = t if anchor == "end" else t - 1
    return jnp.logical_and(finite, steps % f_int == 0)


def is_root_step(t: Array, schedule: ScheduleConfig, lr_ratio: float | Array = 1.0) -> Flag:
    """Are the inverse roots (eqs. 10-11) recomputed at step t (eqs. 8, 8b)?"""
    period = root_period_flag(t, schedule, lr_ratio)
    if schedule.roots_before_start:
        return period
    start = schedule.start_preconditioning_step
    if start is None:
        return False
    at_start: Flag = True if start <= 1 and period is True else (t == start)
    if at_start is True:
        return True
    after: Flag = _and(t > start, period)
    return _or(at_start, after)
