"""The traced schedule (shampoo_jax.schedule) equals shampoo_spec.schedule, eq. (8)."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

import shampoo_spec as ss
from shampoo_jax import schedule as js

STEPS = np.arange(1, 301)

SCHEDULES = [
    ss.ScheduleConfig(
        precondition_frequency=f, statistics_frequency=sf, start_preconditioning_step=s,
        period_anchor=a, roots_before_start=b,
    )
    for f, sf, s, a, b in itertools.product(
        (1, 3, 100), (1, 2), (None, 1, 2, 5, 150), ("end", "start"), (False, True)
    )
]


@pytest.mark.parametrize("rule", ["is_statistics_step", "uses_preconditioner", "is_root_step"])
def test_traced_schedule_equals_spec(rule: str) -> None:
    t = jnp.asarray(STEPS, dtype=jnp.int32)
    for sched in SCHEDULES:
        got = np.broadcast_to(np.asarray(getattr(js, rule)(t, sched)), STEPS.shape)
        want = np.array([getattr(ss, rule)(int(s), sched) for s in STEPS])
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, f"{rule} differs at t = {STEPS[bad][:5]} for {sched}"
