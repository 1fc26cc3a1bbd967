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


@pytest.mark.parametrize("anchor", ["end", "start"])
def test_traced_growing_period_equals_spec(anchor: str) -> None:
    """Eq. (8b) on a traced ratio (float64, as the spec computes) equals the spec, NaN/inf too."""
    import jax

    ratios = [*np.linspace(-1.0, 2.0, 31), 0.6, 0.0, np.inf, -np.inf, np.nan]
    t = jnp.asarray(STEPS, dtype=jnp.int32)
    for f, g, start, before in itertools.product((1, 4, 10, 29), (1, 25, 2**31 - 1),
                                                 (1, 7), (False, True)):
        sched = ss.ScheduleConfig(precondition_frequency=f, precondition_frequency_growth=g,
                                  start_preconditioning_step=start, period_anchor=anchor,
                                  roots_before_start=before)
        for rho in ratios:
            with jax.enable_x64(True):
                got = np.broadcast_to(
                    np.asarray(js.is_root_step(t, sched, jnp.asarray(rho, jnp.float64))),
                    STEPS.shape)
            want = np.array([ss.is_root_step(int(s), sched, float(rho)) for s in STEPS])
            bad = np.flatnonzero(got != want)
            assert bad.size == 0, f"differs at t = {STEPS[bad][:5]} for {sched}, rho {rho}"
            # A Python ratio takes the static path: the same decisions.
            static = np.broadcast_to(np.asarray(js.is_root_step(t, sched, float(rho))),
                                     STEPS.shape)
            assert np.array_equal(static, want)


def test_linear_decay_root_steps_in_float32_and_float64() -> None:
    """The anchors' linear case (issue i46c: period 10 growing by 23 as optax's
    linear_schedule 0.01 -> 0 over 50 steps decays): x_c = 10 + 23 c / 50 stays away
    from multiples of 10, so the traced rule takes the spec's root steps 1, 11, 21, 41
    on the float64 rates and on optax's float32 ones, whether XLA forms 1 - c / 50 with
    one rounding (an FMA, as Google's compiled program does) or with two (as ours)."""
    import jax
    import optax

    sched = ss.ScheduleConfig(precondition_frequency=10, precondition_frequency_growth=23,
                              period_anchor="start", roots_before_start=True)
    counts = np.arange(50)
    f32 = np.float32
    two_roundings = f32(0.01) * (f32(1) - counts.astype(f32) * f32(1 / 50))
    one_rounding = f32(0.01) * (1 - counts * np.float64(f32(1 / 50))).astype(f32)
    rates64 = 0.01 * (1 - counts / 50)
    want = [t for t in range(1, 51)
            if ss.is_root_step(t, sched, ss.learning_rate_ratio(rates64[t - 1], 0.01))]
    assert want == [1, 11, 21, 41]
    t = jnp.arange(1, 51, dtype=jnp.int32)
    with jax.enable_x64(True):
        lr_0 = optax.linear_schedule(0.01, 0.0, 50)(0)  # Google's lr(0): a Python 0
        for rates in (two_roundings, one_rounding, rates64):
            ratio = jnp.asarray(rates) / lr_0
            got = np.asarray(js.is_root_step(t, sched, ratio))
            assert [int(s) for s in np.flatnonzero(got) + 1] == want, rates.dtype
