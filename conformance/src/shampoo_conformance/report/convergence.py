"""Closed-loop training of Shampoo and AdamW: learning-rate tuning, seeds, steps to target.

For one problem and one backend, each optimizer is run from the problem's
start ``theta_0`` with the problem's exact NumPy gradient at the current
parameters (``g_t = grad f(theta_{t-1})``, full batch), so every backend
sees the same kind of gradients and only the optimizer differs. The loss
``f(theta_t)`` is evaluated in float64 after every step.

Protocol (the same step budget ``T`` for both optimizers):

1. tuning: on seed 0, every learning rate of the grid; the chosen rate has
   the fewest steps to the target, ties and never-reached broken by the
   lowest final loss ``f(theta_T)``;
2. evaluation: the chosen rate on seeds ``0 .. S-1`` (seed 0's tuning run
   is reused). A seed changes the problem's start and, for synthetic
   problems, the problem itself.

Steps to target: the first ``t`` with ``f(theta_t) <= target_loss``
(:func:`steps_to_target`); a run that never gets there counts as infinite,
so the median over seeds is "not reached" when half or more of the seeds
miss. A run diverges when its loss is not finite or exceeds
:data:`DIVERGENCE_FACTOR` times the starting loss (or the optimizer raises
a FloatingPointError, e.g. for a non-finite gradient); it stops there, its
remaining losses are NaN and its final loss is infinite.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shampoo_conformance.protocol import Backend
from shampoo_datasets import Problem, load_problem
from shampoo_spec import ShampooConfig

#: A loss this many times the starting loss counts as divergence.
DIVERGENCE_FACTOR = 1e3


@dataclass(frozen=True)
class Curve:
    """Losses ``f(theta_0) .. f(theta_T)`` of one run (NaN after a divergence)."""

    losses: tuple[float, ...]
    diverged: bool
    final_metrics: dict[str, float] = field(default_factory=dict)  # problem.metrics at the end

    @property
    def final_loss(self) -> float:
        return math.inf if self.diverged else self.losses[-1]


def steps_to_target(losses: Sequence[float], target: float | None) -> int | None:
    """The first step ``t`` with ``losses[t] <= target`` (None: never, or no target)."""
    if target is None:
        return None
    for t, value in enumerate(losses):
        if value <= target:
            return t
    return None


@dataclass(frozen=True)
class Spread:
    """Median and range of one figure over seeds (None entries: not reached)."""

    median: float | None
    low: float | None
    high: float | None
    reached: int
    count: int


def spread(values: Sequence[float | None]) -> Spread:
    """Median over all entries with None as +inf (None if the median is inf); min-max of the rest.

    >>> spread([10, 12, None])
    Spread(median=12.0, low=10.0, high=12.0, reached=2, count=3)
    """
    if not values:
        raise ValueError("values = [] is invalid: allowed at least one value.")
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    as_inf = [math.inf if v is None else float(v) for v in values]
    med = statistics.median(as_inf)
    return Spread(
        median=med if math.isfinite(med) else None,
        low=min(finite) if finite else None,
        high=max(finite) if finite else None,
        reached=len(finite),
        count=len(values),
    )


def train(
    problem: Problem,
    backend: Backend,
    optimizer: str,
    lr: float,
    steps: int,
    *,
    config: ShampooConfig | None,
    dtype: Any,
    on_step: Callable[[], None] | None = None,
) -> Curve:
    """Run ``optimizer`` for ``steps`` closed-loop steps; the loss after each."""
    stepper = backend.stepper(  # type: ignore[attr-defined]
        optimizer, problem.init_params, lr=lr,
        config=config if optimizer == "shampoo" else None, dtype=dtype,
    )
    params: dict[str, Any] = problem.copy_init_params()
    start = problem.loss(params)
    losses = [start]
    diverged = False
    for done in range(steps):
        try:
            params = stepper.step(problem.grad(params))
            loss = problem.loss(params)
        except FloatingPointError:
            loss = math.nan
        if on_step is not None:
            on_step()
        if not (math.isfinite(loss) and loss <= DIVERGENCE_FACTOR * max(start, 1e-300)):
            diverged = True
            losses += [math.nan] * (steps - done)
            if on_step is not None:
                for _ in range(steps - done - 1):
                    on_step()
            break
        losses.append(loss)
    metrics = problem.metrics(params) if problem.metrics is not None and not diverged else {}
    return Curve(tuple(losses), diverged, dict(metrics))


@dataclass(frozen=True)
class GridPoint:
    """One learning rate tried on seed 0."""

    lr: float
    steps_to_target: int | None
    final_loss: float


@dataclass(frozen=True)
class OptimizerRun:
    """One optimizer on one problem and backend: tuning and evaluation."""

    optimizer: str
    grid: tuple[GridPoint, ...]
    lr: float
    curves: tuple[Curve, ...]  # one per seed, at ``lr``
    steps_to_target: Spread
    final_loss: Spread
    final_metrics: dict[str, Spread] = field(default_factory=dict)

    @property
    def lr_at_grid_edge(self) -> bool:
        """True when the chosen rate is the grid's smallest or largest (widen the grid)."""
        rates = [p.lr for p in self.grid]
        return len(rates) > 1 and self.lr in (min(rates), max(rates))


def _score(point: GridPoint) -> tuple[float, float, float]:
    steps = math.inf if point.steps_to_target is None else point.steps_to_target
    final = point.final_loss if math.isfinite(point.final_loss) else math.inf
    return (steps, final, point.lr)


def choose_learning_rate(points: Sequence[GridPoint]) -> GridPoint:
    """Fewest steps to target, then lowest final loss, then the smaller rate."""
    if not points:
        raise ValueError("points = [] is invalid: allowed at least one grid point.")
    return min(points, key=_score)


@dataclass(frozen=True)
class ConvergenceResult:
    """Tuned Shampoo and AdamW on one problem and backend."""

    problem: str
    backend: str
    dtype: str
    steps: int
    seeds: int
    target_loss: float | None
    loss_floor: float | None
    shampoo: OptimizerRun
    adamw: OptimizerRun

    @property
    def step_ratio(self) -> float | None:
        """Median steps to target, Shampoo / AdamW (None unless both reach it)."""
        s, a = self.shampoo.steps_to_target.median, self.adamw.steps_to_target.median
        if s is None or a is None or a == 0:
            return None
        return s / a


def _metric_spreads(curves: Sequence[Curve]) -> dict[str, Spread]:
    """Median and range of each final metric over seeds (a diverged seed counts as None)."""
    names = sorted({k for c in curves for k in c.final_metrics})
    return {k: spread([c.final_metrics.get(k) for c in curves]) for k in names}


def tune_and_evaluate(
    problem_name: str,
    backend: Backend,
    *,
    config: ShampooConfig,
    grid: Sequence[float],
    steps: int,
    seeds: int,
    dtype: Any,
    on_step: Callable[[], None] | None = None,
) -> ConvergenceResult:
    """The protocol of the module docstring for both optimizers."""
    problems = [load_problem(problem_name, seed=s) for s in range(seeds)]
    runs = {}
    for optimizer in ("shampoo", "adamw"):
        tried: list[tuple[GridPoint, Curve]] = []
        for lr in grid:
            curve = train(
                problems[0], backend, optimizer, lr, steps, config=config, dtype=dtype,
                on_step=on_step,
            )
            point = GridPoint(lr, steps_to_target(curve.losses, problems[0].target_loss),
                              curve.final_loss)
            tried.append((point, curve))
        best = choose_learning_rate([p for p, _ in tried])
        curves = [next(c for p, c in tried if p is best)]
        for problem in problems[1:]:
            curves.append(
                train(problem, backend, optimizer, best.lr, steps, config=config, dtype=dtype,
                      on_step=on_step)
            )
        reached = [
            steps_to_target(c.losses, p.target_loss) for c, p in zip(curves, problems, strict=True)
        ]
        runs[optimizer] = OptimizerRun(
            optimizer=optimizer,
            grid=tuple(p for p, _ in tried),
            lr=best.lr,
            curves=tuple(curves),
            steps_to_target=spread(reached),
            final_loss=spread([c.final_loss for c in curves]),
            final_metrics=_metric_spreads(curves),
        )
    return ConvergenceResult(
        problem=problem_name,
        backend=getattr(backend, "name", str(backend)),
        dtype=np.dtype(dtype).name,
        steps=steps,
        seeds=seeds,
        target_loss=problems[0].target_loss,
        loss_floor=problems[0].loss_floor,
        shampoo=runs["shampoo"],
        adamw=runs["adamw"],
    )
