"""What each step of the report costs, measured before it starts: an honest ETA.

The progress bar counts work in seconds, not steps. A step of Meta's library
on the Markov transformer costs a hundred times one of ours on the digits
softmax, so a bar that counts steps (the report's before this module) shows
a minute left while the slowest backend has ten to go. Before measuring,
:func:`step_costs` times a short closed-loop run of each training backend on
each problem (Shampoo and AdamW, one root period and one more step, after a
warm-up run that pays for construction and compilation); each later step
advances the bar by its piece's cost, and :class:`~.progress.Progress` turns
the seconds done into the ETA.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from shampoo_conformance.protocol import Backend
from shampoo_datasets import load_problem
from shampoo_spec import ShampooConfig

from .convergence import train

#: Learning rate of the timing runs: small, so no run diverges and stops early.
PROBE_LR = 1e-3


def _seconds_per_step(problem: Any, backend: Backend, config: ShampooConfig, dtype: Any) -> float:
    steps = config.schedule.precondition_frequency + 1
    total = 0.0
    for optimizer in ("shampoo", "adamw"):
        train(problem, backend, optimizer, PROBE_LR, 2, config=config, dtype=dtype)  # warm-up
        start = time.perf_counter()
        train(problem, backend, optimizer, PROBE_LR, steps, config=config, dtype=dtype)
        total += time.perf_counter() - start
    return total / (2 * steps)


def step_costs(
    problems: Sequence[str],
    backends: dict[str, Backend],
    training: Sequence[str],
    configs: dict[str, ShampooConfig],
    dtype_of: Any,
) -> dict[tuple[str, str], float]:
    """Seconds per optimizer step of each backend on each problem (module docstring).

    A training backend whose probe raises, and a backend that does not train
    (open-loop only), get the median cost of the problem's other backends: the
    measurement itself reports the error later.
    """
    costs: dict[tuple[str, str], float] = {}
    for name in problems:
        problem = load_problem(name, seed=0)
        for backend in training:
            try:
                costs[(backend, name)] = _seconds_per_step(
                    problem, backends[backend], configs[backend], dtype_of(backend))
            except Exception:  # noqa: BLE001 (the measurement reports it)
                continue
        known = [c for (_, p), c in costs.items() if p == name]
        fallback = statistics.median(known) if known else 1e-3
        for backend in backends:
            costs.setdefault((backend, name), fallback)
    return costs
