"""Deviation of each backend from the float64 reference, in float64 and float32.

For one problem: the reference runs the report's Shampoo config closed-loop
for ``steps`` steps (``g_t = grad f(theta_{t-1})``); that gradient stream
is then replayed open-loop through ``backend.run`` (the backend contract) in each
dtype, and the trajectories are compared step by step, exactly as
``python -m shampoo_conformance compare`` does on random data:

    error = max_t max_param ||theta_t - theta_t^ref|| / ||theta_t^ref - theta_0||

(:func:`~shampoo_conformance.report.compare.max_relative_error`), next to the
tolerance derived from dtype, factor conditioning and step count
(:func:`~shampoo_conformance.suite.tolerances.bound_and_reference`, docs/spec.md
section 5); ``within`` is the suite's own verdict
(:func:`~shampoo_conformance.suite.divergence.first_divergence` finds no step out of
bounds). The bound grows with kappa; with the report's relative epsilon of
1e-6 kappa can reach 1e6, which makes the float32 bound loose (the table
shows it), so the recommendation also asks for a practical accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from shampoo_conformance.adapters.reference import ReferenceBackend
from shampoo_conformance.protocol import Backend
from shampoo_conformance.report.compare import max_relative_error
from shampoo_conformance.suite.divergence import first_divergence
from shampoo_conformance.suite.tolerances import bound_and_reference
from shampoo_datasets import Problem
from shampoo_spec import Inexpressible, ShampooConfig


@dataclass(frozen=True)
class AccuracyResult:
    """One backend, problem and dtype against the reference."""

    problem: str
    backend: str
    dtype: str
    steps: int
    max_relative_error: float
    tolerance: float
    kappa: float
    within: bool
    first_divergent_step: int | None
    error: str | None = None  # the exception text when the backend failed to run


def reference_gradients(
    problem: Problem, config: ShampooConfig, steps: int
) -> list[dict[str, NDArray[np.float64]]]:
    """The gradients the float64 reference sees on its own closed-loop trajectory."""
    grads: list[dict[str, NDArray[np.float64]]] = []

    def grad_fn(params: Any) -> dict[str, NDArray[np.float64]]:
        g = problem.grad(params)
        grads.append(g)
        return g

    ReferenceBackend().trajectory(config, problem.copy_init_params(), grad_fn, steps)
    return grads


def measure_accuracy(
    problem: Problem,
    backend: Backend,
    config: ShampooConfig,
    steps: int,
    dtypes: tuple[Any, ...] | None = None,
) -> list[AccuracyResult]:
    """One :class:`AccuracyResult` per dtype the backend runs (float64 and float32 by default)."""
    grads = reference_gradients(problem, config, steps)
    params = problem.copy_init_params()
    run_dtypes: tuple[Any, ...] = tuple(
        dtypes or getattr(backend, "dtypes", None) or (np.float64, np.float32)
    )
    out = []
    for dtype in run_dtypes:
        bound, ref = bound_and_reference(config, params, grads, dtype)
        name = np.dtype(dtype).name
        try:
            ours = backend.run(config, params, grads, dtype=dtype)
        except Inexpressible:
            raise  # not measurable on this problem (the report lists it apart)
        except Exception as err:  # reported in the table, never fatal
            out.append(AccuracyResult(
                problem.name, backend.name, name, steps, float("nan"), bound.rtol, bound.kappa,
                False, None, error=f"{type(err).__name__}: {err}",
            ))
            continue
        div = first_divergence(ours, ref, params, bound)
        out.append(AccuracyResult(
            problem=problem.name,
            backend=backend.name,
            dtype=name,
            steps=steps,
            max_relative_error=max_relative_error(ours, ref, params),
            tolerance=bound.rtol,
            kappa=bound.kappa,
            within=div is None,
            first_divergent_step=None if div is None else div.step,
        ))
    return out
