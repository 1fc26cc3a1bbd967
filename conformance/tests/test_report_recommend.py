"""The recommendation rules of shampoo_conformance.report.recommend on synthetic measurements."""

from __future__ import annotations

import math

from shampoo_conformance.report.accuracy import AccuracyResult
from shampoo_conformance.report.convergence import (
    ConvergenceResult,
    Curve,
    GridPoint,
    OptimizerRun,
    spread,
)
from shampoo_conformance.report.recommend import PRACTICAL_RTOL, choose_backend, recommend
from shampoo_conformance.report.timing import TimingResult

P = "problem"


def acc(backend: str, dtype: str, error: float, within: bool = True) -> AccuracyResult:
    return AccuracyResult(P, backend, dtype, 20, error, 1.0, 1e3, within, None)


def timing(backend: str, shampoo_ms: float, adamw_ms: float = 1.0) -> TimingResult:
    return TimingResult(P, backend, "float32", 3, 10, shampoo_ms / 1e3, adamw_ms / 1e3, 300, 100)


def run(optimizer: str, steps: list[int | None], lr: float = 0.1,
        grid: tuple[float, ...] = (0.01, 0.1, 1.0)) -> OptimizerRun:
    curves = tuple(Curve((1.0, 0.5), False) for _ in steps)
    return OptimizerRun(
        optimizer, tuple(GridPoint(g, None, 1.0) for g in grid), lr, curves, spread(steps),
        spread([0.5] * len(steps)),
    )


def conv(backend: str, shampoo: list[int | None], adamw: list[int | None],
         **kw: float) -> ConvergenceResult:
    return ConvergenceResult(P, backend, "float32", 100, len(shampoo), 0.1, None,
                             run("shampoo", shampoo, **kw), run("adamw", adamw))


EXACT = [acc(b, d, 1e-6) for b in ("torch", "jax") for d in ("float64", "float32")]


def test_fastest_exact_backend_is_chosen() -> None:
    chosen, dtype, text = choose_backend(P, EXACT, [timing("torch", 3.0), timing("jax", 2.0)])
    assert chosen is not None and (chosen.backend, dtype) == ("jax", "float32")
    assert "use **jax** in float32" in text and "Shampoo step 2 ms = 2.00x AdamW's" in text


def test_faster_backend_that_is_not_exact_is_passed_over() -> None:
    accuracy = [a for a in EXACT if a.backend != "jax"] + [
        acc("jax", "float64", 1e-12), acc("jax", "float32", 10 * PRACTICAL_RTOL)]
    chosen, dtype, text = choose_backend(P, accuracy, [timing("torch", 3.0), timing("jax", 2.0)])
    assert chosen is not None and (chosen.backend, dtype) == ("torch", "float32")
    assert "faster but not exact enough: jax" in text


def test_outside_the_derived_bound_is_not_exact_even_if_small() -> None:
    accuracy = [acc("torch", "float64", 1e-12), acc("torch", "float32", 1e-6, within=False)]
    chosen, dtype, text = choose_backend(P, accuracy, [timing("torch", 3.0)])
    assert chosen is not None and dtype == "float64"
    assert "float32 deviates 1.0e-06" in text


def test_float64_fallback_and_no_recommendation() -> None:
    accuracy = [acc("torch", "float64", 1e-12), acc("torch", "float32", 0.1)]
    _, dtype, _ = choose_backend(P, accuracy, [timing("torch", 3.0)])
    assert dtype == "float64"
    bad = [acc("torch", "float64", 0.5, within=False), acc("torch", "float32", 0.5)]
    chosen, _, text = choose_backend(P, bad, [timing("torch", 3.0)])
    assert chosen is None and "no backend is exact enough" in text and "5.0e-01" in text
    assert choose_backend(P, EXACT, [timing("reference", 1.0)])[0] is None  # oracle excluded


def _line(convergence: list[ConvergenceResult], timings: list[TimingResult] | None = None) -> str:
    (line,) = recommend(EXACT, timings or [timing("torch", 2.0)], convergence, problems=[P])
    return line


def test_fewer_steps_and_time_to_target() -> None:
    # r = 50 / 100 = 0.5 and Shampoo's step costs 2x: time to target 1.0x -> "<= 1".
    line = _line([conv("torch", [50, 40, 60], [100, 90, 110])])
    assert "Shampoo needs 50% fewer steps (50 vs 100)" in line
    assert "optimizer time to target 1.00x AdamW's" in line
    # r = 0.5 but the step costs 4x: the saved steps do not pay.
    line = _line([conv("torch", [50, 40, 60], [100, 90, 110])], [timing("torch", 4.0)])
    assert "but optimizer time to target is 2.00x AdamW's" in line


def test_adamw_better_or_no_clear_difference() -> None:
    assert "AdamW needs fewer steps (50 vs 80): prefer AdamW" in _line(
        [conv("torch", [80, 80, 80], [50, 50, 50])])
    assert "no clear difference in steps (95 vs 100)" in _line(
        [conv("torch", [95, 95, 95], [100, 100, 100])])


def test_only_one_or_neither_reaches_the_target() -> None:
    assert "only Shampoo reaches the target within 100 steps (median 30 steps)" in _line(
        [conv("torch", [30, 30, 30], [None, None, 90])])
    assert "only AdamW reaches the target" in _line(
        [conv("torch", [None, None, 30], [40, 40, 40])])
    assert "neither optimizer reaches the target within 100 steps" in _line(
        [conv("torch", [None] * 3, [None] * 3)])


def test_grid_edge_caveat_and_missing_backends() -> None:
    c = conv("torch", [50] * 3, [100] * 3, lr=1.0)
    lines = recommend(EXACT, [timing("torch", 2.0)], [c], problems=[P], missing=["jax"])
    assert "tuned rate of shampoo (lr 1) is at the edge of the grid" in lines[0]
    assert lines[1] == "- jax: not installed, not measured (install it to include it)."


def test_convergence_of_the_recommended_backend_is_used() -> None:
    runs = [conv("reference", [10] * 3, [100] * 3), conv("torch", [90] * 3, [100] * 3),
            conv("jax", [50] * 3, [100] * 3)]
    line = _line(runs, [timing("torch", 3.0), timing("jax", 2.0)])
    assert "Convergence (jax): Shampoo needs 50% fewer steps" in line
    assert math.isclose(runs[2].step_ratio or 0.0, 0.5)
