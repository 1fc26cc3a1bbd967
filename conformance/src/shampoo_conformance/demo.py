"""``python -m shampoo_conformance demo``: Shampoo next to gradient descent.

Runs the float64 reference Shampoo (``get_backend("reference")``) and plain
full-batch gradient descent from the same start on a problem of
``shampoo_datasets`` and prints, at a few steps, both losses and the
cumulative wall time of each optimizer (gradient evaluations included,
loss evaluations for the table excluded).

Gradient descent is ``theta_{t+1} = theta_t - eta * grad f(theta_t)``.
Shampoo uses :func:`demo_config`: the default ``ShampooConfig`` except the
learning rate and ``blocking.merge_dims_up_to = None``. (The default merges
dims while their product is <= 1024, which would turn the (64, 10) weight
into one 640-vector preconditioned by a full 640 x 640 matrix; unmerged, it
keeps its 64 x 64 and 10 x 10 Kronecker factors, which is Shampoo proper.)
Each learning rate is the one with the lowest loss after the default 40
steps in a sweep over powers of two; they are listed in
:data:`TUNED_LEARNING_RATES` so the comparison can be reproduced. With
sum statistics and no grafting, Shampoo's first steps have a length of
about the learning rate, so its loss may rise for a few steps before it
falls fast.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO

import numpy as np
from numpy.typing import NDArray

from shampoo_datasets import Problem, load_problem
from shampoo_spec import BlockingConfig, ShampooConfig

from . import get_backend

Params = dict[str, NDArray[np.float64]]

DEFAULT_PROBLEM = "digits_softmax"
DEFAULT_STEPS = 40
DEFAULT_BACKEND = "reference"


@dataclass(frozen=True)
class LearningRates:
    """Step sizes of the two optimizers on one problem."""

    shampoo: float
    gradient_descent: float


#: Per-problem learning rates: for each optimizer, the power of two with the
#: lowest loss after DEFAULT_STEPS steps (seed 0). Gradient descent diverges
#: on the least squares problem above 2 (its Hessian's largest eigenvalue is 1).
TUNED_LEARNING_RATES: Mapping[str, LearningRates] = {
    "digits_softmax": LearningRates(shampoo=16.0, gradient_descent=8.0),
    "ill_conditioned_least_squares": LearningRates(shampoo=128.0, gradient_descent=1.0),
}


@dataclass(frozen=True)
class DemoRow:
    """One line of the table: losses after ``step`` steps and seconds spent so far."""

    step: int
    loss_shampoo: float
    loss_gradient_descent: float
    seconds_shampoo: float
    seconds_gradient_descent: float


@dataclass(frozen=True)
class DemoResult:
    """Everything the demo measured, one row per step (step 0 = the start)."""

    problem: Problem
    config: ShampooConfig
    learning_rates: LearningRates
    rows: tuple[DemoRow, ...]


def demo_config(problem_name: str) -> ShampooConfig:
    """The Shampoo configuration the demo uses on ``problem_name``."""
    return ShampooConfig(
        learning_rate=TUNED_LEARNING_RATES[problem_name].shampoo,
        blocking=BlockingConfig(merge_dims_up_to=None),
    )


def _shampoo_trajectory(
    problem: Problem, config: ShampooConfig, steps: int, backend_name: str
) -> tuple[list[Params], list[float]]:
    """Parameters after each step and cumulative seconds at each step's end."""
    backend = get_backend(backend_name)
    trajectory = getattr(backend, "trajectory", None)
    if trajectory is None:
        raise RuntimeError(
            f"backend {backend_name!r} has no trajectory(config, params, grad_fn, steps, dtype); "
            "the demo needs it to feed gradients computed at the current parameters"
        )
    call_times: list[float] = []

    def grad_fn(params: Mapping[str, NDArray[np.float64]]) -> Params:
        call_times.append(time.perf_counter())
        return problem.grad(params)

    start = time.perf_counter()
    params_by_step = list(
        trajectory(config, problem.copy_init_params(), grad_fn, steps, dtype=np.float64)
    )
    end = time.perf_counter()
    if len(params_by_step) != steps:
        raise RuntimeError(
            f"backend {backend_name!r} returned {len(params_by_step)} steps, asked for {steps}"
        )
    # The (k+1)-th gradient call happens once step k is done; the last step ends at `end`.
    ends = [*call_times[1:steps], end]
    return params_by_step, [t - start for t in ends]


def _gradient_descent_trajectory(
    problem: Problem, learning_rate: float, steps: int
) -> tuple[list[Params], list[float]]:
    """Plain full-batch gradient descent: parameters and cumulative seconds after each step."""
    params = problem.copy_init_params()
    params_by_step: list[Params] = []
    seconds: list[float] = []
    start = time.perf_counter()
    for _ in range(steps):
        grads = problem.grad(params)
        params = {name: value - learning_rate * grads[name] for name, value in params.items()}
        seconds.append(time.perf_counter() - start)
        params_by_step.append(params)
    return params_by_step, seconds


def run_demo(
    problem_name: str = DEFAULT_PROBLEM,
    *,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    backend_name: str = DEFAULT_BACKEND,
) -> DemoResult:
    """Run both optimizers for ``steps`` steps and collect one :class:`DemoRow` per step."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if problem_name not in TUNED_LEARNING_RATES:
        raise ValueError(
            f"problem must be one of {', '.join(TUNED_LEARNING_RATES)}; got {problem_name!r}"
        )
    problem = load_problem(problem_name, seed=seed)
    config = demo_config(problem_name)
    rates = TUNED_LEARNING_RATES[problem_name]
    shampoo, shampoo_seconds = _shampoo_trajectory(problem, config, steps, backend_name)
    descent, descent_seconds = _gradient_descent_trajectory(problem, rates.gradient_descent, steps)
    start_loss = problem.loss(problem.init_params)
    rows = [DemoRow(0, start_loss, start_loss, 0.0, 0.0)]
    for k in range(steps):
        rows.append(
            DemoRow(
                step=k + 1,
                loss_shampoo=problem.loss(shampoo[k]),
                loss_gradient_descent=problem.loss(descent[k]),
                seconds_shampoo=shampoo_seconds[k],
                seconds_gradient_descent=descent_seconds[k],
            )
        )
    return DemoResult(problem, config, rates, tuple(rows))


def steps_to_shown(steps: int) -> list[int]:
    """The steps the table shows: 0, 1, 2, 5, then every tenth, and the last."""
    shown = {0, 1, 2, 5, steps, *range(10, steps + 1, 10)}
    return sorted(s for s in shown if s <= steps)


def _first_step_at_or_below(losses: Sequence[float], target: float) -> str:
    for step, value in enumerate(losses):
        if value <= target:
            return str(step)
    return "not reached"


def format_result(result: DemoResult) -> str:
    """The printed report: a header, the table, and steps to the target loss."""
    rates = result.learning_rates
    lines = [
        f"problem: {result.problem.name} - {result.problem.description}",
        f"shampoo: reference backend, ShampooConfig(learning_rate={rates.shampoo:g}, "
        "blocking=BlockingConfig(merge_dims_up_to=None)), other fields default",
        f"gd:      gradient descent, learning rate {rates.gradient_descent:g}",
        "",
        f"{'step':>5}  {'loss shampoo':>13}  {'loss gd':>13}  {'time shampoo s':>14}  "
        f"{'time gd s':>10}",
    ]
    for step in steps_to_shown(len(result.rows) - 1):
        row = result.rows[step]
        lines.append(
            f"{row.step:>5}  {row.loss_shampoo:>13.6g}  {row.loss_gradient_descent:>13.6g}  "
            f"{row.seconds_shampoo:>14.3f}  {row.seconds_gradient_descent:>10.3f}"
        )
    target = result.problem.target_loss
    if target is not None:
        shampoo = _first_step_at_or_below([r.loss_shampoo for r in result.rows], target)
        descent = _first_step_at_or_below([r.loss_gradient_descent for r in result.rows], target)
        lines += ["", f"steps to target loss {target:.3g}: shampoo {shampoo}, gd {descent}"]
    return "\n".join(lines)


def main(
    problem_name: str = DEFAULT_PROBLEM,
    *,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    backend_name: str = DEFAULT_BACKEND,
    out: TextIO | None = None,
) -> int:
    """Print the demo report; exit status 1 if Shampoo's loss became non-finite."""
    stream = sys.stdout if out is None else out
    result = run_demo(problem_name, steps=steps, seed=seed, backend_name=backend_name)
    print(format_result(result), file=stream)
    if not all(math.isfinite(row.loss_shampoo) for row in result.rows):
        print("error: Shampoo's loss is not finite", file=sys.stderr)
        return 1
    return 0
