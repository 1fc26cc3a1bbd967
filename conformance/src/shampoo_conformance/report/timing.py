"""Optimizer step time and state size, Shampoo vs AdamW in the same framework.

For one problem and backend, both optimizers are stepped closed-loop (each
at its tuned learning rate, gradients computed outside the timed region)
and only the optimizer's own update is timed (``Stepper.last_step_seconds``:
``optimizer.step()`` in torch, the jitted update up to
``block_until_ready`` in JAX, ``step()`` of the NumPy reference).

Protocol: both are first warmed up past Shampoo's first root step (and
JAX's compilation); then ``rounds`` rounds alternate one amortization
period of Shampoo (``precondition_frequency`` steps, so exactly one root
step each) with the same number of AdamW steps. Each round gives a mean
step time per optimizer; the figure is the median over rounds, and the
ratio compares medians measured side by side on the same machine state.

Memory, two figures per optimizer, both measured after warm-up:

- ``state_bytes``: the optimizer state arrays the backend stores (torch:
  the tensors of ``optimizer.state_dict()["state"]``; JAX: the leaves of the
  optax state; reference: the NumPy arrays): what stays between steps.
- ``peak_bytes``: the most the optimizer holds at any moment of an update,
  state plus temporaries (parameters and gradients excluded), the maximum
  over one more amortization period (so a root step is in it), from the
  stepper's ``step_with_peak`` (torch: the CPU allocator's events under
  ``torch.profiler``; JAX: XLA's buffer assignment of the compiled update).
  None for a backend whose stepper cannot measure it (the reference).
  These steps are not timed: profiling slows them.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shampoo_conformance.protocol import Backend
from shampoo_datasets import Problem
from shampoo_spec import ShampooConfig


@dataclass(frozen=True)
class TimingResult:
    """Median optimizer step times (seconds) and state sizes (bytes)."""

    problem: str
    backend: str
    dtype: str
    rounds: int
    period: int
    shampoo_seconds: float
    adamw_seconds: float
    shampoo_state_bytes: int
    adamw_state_bytes: int
    shampoo_peak_bytes: int | None = None
    adamw_peak_bytes: int | None = None

    @property
    def time_ratio(self) -> float:
        return self.shampoo_seconds / self.adamw_seconds

    @property
    def memory_ratio(self) -> float:
        """Shampoo / AdamW optimizer-state bytes."""
        return self.shampoo_state_bytes / self.adamw_state_bytes

    @property
    def peak_ratio(self) -> float | None:
        """Shampoo / AdamW peak optimizer bytes during an update; None if unmeasured."""
        if self.shampoo_peak_bytes is None or self.adamw_peak_bytes is None:
            return None
        return self.shampoo_peak_bytes / self.adamw_peak_bytes


class _Runner:
    """One stepper plus its closed-loop parameters."""

    def __init__(self, stepper: Any, problem: Problem) -> None:
        self.stepper = stepper
        self.problem = problem
        self.params: dict[str, Any] = problem.copy_init_params()

    def run(self, steps: int) -> float:
        """Total seconds of ``steps`` optimizer updates."""
        total = 0.0
        for _ in range(steps):
            self.params = self.stepper.step(self.problem.grad(self.params))
            total += self.stepper.last_step_seconds
        return total

    def peak(self, steps: int) -> int | None:
        """Most optimizer bytes over ``steps`` untimed updates (None: not measurable)."""
        step_with_peak = getattr(self.stepper, "step_with_peak", None)
        if step_with_peak is None:
            return None
        most = 0
        for _ in range(steps):
            self.params, peak = step_with_peak(self.problem.grad(self.params))
            if peak is None:
                return None
            most = max(most, int(peak))
        return most


def timing_steps(config: ShampooConfig, rounds: int) -> int:
    """Optimizer steps :func:`measure_timing` takes (for progress accounting)."""
    period = config.schedule.precondition_frequency
    return 2 * (_warmup(config) + (rounds + 1) * period)


def _warmup(config: ShampooConfig) -> int:
    start = config.schedule.start_preconditioning_step or 1
    return max(start, config.schedule.precondition_frequency) + 1


def measure_timing(
    problem: Problem,
    backend: Backend,
    config: ShampooConfig,
    *,
    lr_shampoo: float,
    lr_adamw: float,
    rounds: int,
    dtype: Any,
    on_steps: Callable[[int], None] | None = None,
) -> TimingResult:
    """The protocol of the module docstring."""
    make = backend.stepper  # type: ignore[attr-defined]
    shampoo = _Runner(make("shampoo", problem.init_params, lr=lr_shampoo, config=config,
                           dtype=dtype), problem)
    adamw = _Runner(make("adamw", problem.init_params, lr=lr_adamw, dtype=dtype), problem)
    warm = _warmup(config)
    for runner in (shampoo, adamw):
        runner.run(warm)
        if on_steps is not None:
            on_steps(warm)
    period = config.schedule.precondition_frequency
    times: dict[str, list[float]] = {"shampoo": [], "adamw": []}
    for _ in range(rounds):
        for name, runner in (("shampoo", shampoo), ("adamw", adamw)):
            times[name].append(runner.run(period) / period)
            if on_steps is not None:
                on_steps(period)
    peaks = {}
    for name, runner in (("shampoo", shampoo), ("adamw", adamw)):
        peaks[name] = runner.peak(period)
        if on_steps is not None:
            on_steps(period)
    return TimingResult(
        problem=problem.name,
        backend=backend.name,
        dtype=np.dtype(dtype).name,
        rounds=rounds,
        period=period,
        shampoo_seconds=statistics.median(times["shampoo"]),
        adamw_seconds=statistics.median(times["adamw"]),
        shampoo_state_bytes=shampoo.stepper.state_bytes(),
        adamw_state_bytes=adamw.stepper.state_bytes(),
        shampoo_peak_bytes=peaks["shampoo"],
        adamw_peak_bytes=peaks["adamw"],
    )
