"""A recommendation that follows from the measured numbers, by fixed rules.

Rules, applied per problem (each problem is its own size):

1. Exact enough. Backend B is exact enough in dtype D on a problem when its
   trajectory stays within the derived tolerance of the reference
   (:mod:`.accuracy`) *and* its largest deviation is at most
   :data:`PRACTICAL_RTOL` of the distance the parameters travelled. The
   second condition is needed because the derived float32 bound grows with
   the factors' condition number (up to 1e6 here) and can exceed 1, which
   would accept anything.
2. Backend. Among the framework backends (not the reference, which is the
   oracle and slow by design) that were timed on the problem running the
   report's config itself (:mod:`.collect` leaves out a library that runs the
   nearest config it expresses: another algorithm), recommend the
   one with the smallest median Shampoo step time that is exact enough in
   the training dtype (float32); if none is, the fastest exact enough in
   float64, saying so; if none is exact enough at all, say that no backend
   can be recommended and name the worst deviation.
3. Steps. With r = median steps to target of Shampoo / AdamW (each at its
   tuned learning rate, same budget), taken from the recommended backend's
   runs (else the first backend that trained): r <= 0.9 "Shampoo needs
   (1 - r) fewer steps"; r >= 1.1 "AdamW needs fewer steps: prefer AdamW
   here"; otherwise "no clear difference". If only one optimizer reaches
   the target (median over seeds), that one is recommended; if neither
   does, the final losses are compared and a longer run is suggested.
4. Time. When both reach the target and step times were measured in the
   same backend, the optimizer time to target is r * (Shampoo step time /
   AdamW step time); above 1, Shampoo's saved steps do not pay for its
   per-step cost at this size (the gradient computation, which both
   share, is not included).
5. Caveats: a tuned learning rate on the edge of its grid (the optimum may
   lie outside), and backends that were asked for but are not installed.
"""

from __future__ import annotations

from collections.abc import Sequence

from .accuracy import AccuracyResult
from .convergence import ConvergenceResult
from .timing import TimingResult

#: Largest deviation from the reference, relative to the parameters'
#: displacement, that counts as exact enough (rule 1): 0.1%, far below
#: what shows on a loss curve.
PRACTICAL_RTOL = 1e-3
#: Step ratios within [FEWER, MORE] count as no clear difference (rule 3).
FEWER, MORE = 0.9, 1.1
TRAINING_DTYPE = "float32"


def exact_enough(results: Sequence[AccuracyResult], problem: str, backend: str, dtype: str) -> bool:
    """Rule 1 on the rows of ``results`` for this problem, backend and dtype."""
    rows = [
        r for r in results if (r.problem, r.backend, r.dtype) == (problem, backend, dtype)
    ]
    return bool(rows) and all(
        r.error is None and r.within and r.max_relative_error <= PRACTICAL_RTOL for r in rows
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def choose_backend(
    problem: str, accuracy: Sequence[AccuracyResult], timing: Sequence[TimingResult]
) -> tuple[TimingResult | None, str | None, str]:
    """Rule 2: (timing row of the chosen backend, its dtype, the sentence)."""
    timed = sorted(
        (t for t in timing if t.problem == problem and t.backend != "reference"),
        key=lambda t: t.shampoo_seconds,
    )
    if not timed:
        return None, None, "no framework backend was timed, so none is recommended."
    for dtype in (TRAINING_DTYPE, "float64"):
        for t in timed:
            if exact_enough(accuracy, problem, t.backend, dtype):
                deviation = max(
                    r.max_relative_error for r in accuracy
                    if (r.problem, r.backend, r.dtype) == (problem, t.backend, dtype)
                )
                note = ""
                if dtype != TRAINING_DTYPE:
                    low = [r.max_relative_error for r in accuracy if (r.problem, r.backend, r.dtype)
                           == (problem, t.backend, TRAINING_DTYPE)]
                    note = (
                        f" ({TRAINING_DTYPE} deviates {max(low):.1e} of the displacement, above "
                        f"{PRACTICAL_RTOL:g}; the step times are of {t.dtype})"
                        if low else f" ({TRAINING_DTYPE} was not compared)"
                    )
                faster = [o.backend for o in timed if o.shampoo_seconds < t.shampoo_seconds]
                skipped = f"; faster but not exact enough: {', '.join(faster)}" if faster else ""
                peak = "" if t.peak_ratio is None else f", peak {t.peak_ratio:.1f}x"
                return t, dtype, (
                    f"use **{t.backend}** in {dtype}{note}: deviation from the reference "
                    f"{deviation:.1e} of the displacement (<= {PRACTICAL_RTOL:g}), Shampoo step "
                    f"{_ms(t.shampoo_seconds)} = {t.time_ratio:.2f}x AdamW's, optimizer state "
                    f"{t.memory_ratio:.1f}x AdamW's{peak}{skipped}."
                )
    rows = [r for r in accuracy if r.problem == problem and r.backend != "reference"]
    worst_text = ""
    if rows:
        worst = max(rows, key=lambda r: r.max_relative_error)
        worst_text = (
            f" (worst: {worst.backend} {worst.dtype}, deviation {worst.max_relative_error:.1e})"
        )
    return None, None, f"no backend is exact enough to recommend{worst_text}."


def _steps_sentence(c: ConvergenceResult, timing: TimingResult | None) -> str:
    s, a = c.shampoo.steps_to_target.median, c.adamw.steps_to_target.median
    budget = f"{c.steps} steps"
    if s is None and a is None:
        fs, fa = c.shampoo.final_loss.median, c.adamw.final_loss.median
        if fs is None or fa is None:
            lower = "neither (a run diverged)"
        else:
            lower = "Shampoo" if fs < fa else "AdamW"
        return (
            f"neither optimizer reaches the target within {budget}; {lower} ends lower "
            f"(median final loss Shampoo {_num(fs)}, AdamW {_num(fa)}); run longer to compare."
        )
    if a is None:
        return f"only Shampoo reaches the target within {budget} (median {s:.0f} steps)."
    if s is None:
        return (
            f"only AdamW reaches the target within {budget} (median {a:.0f} steps): "
            "prefer AdamW here."
        )
    r = s / a
    if r <= FEWER:
        text = f"Shampoo needs {100 * (1 - r):.0f}% fewer steps ({s:.0f} vs {a:.0f})"
    elif r >= MORE:
        text = f"AdamW needs fewer steps ({a:.0f} vs {s:.0f}): prefer AdamW here"
    else:
        text = f"no clear difference in steps ({s:.0f} vs {a:.0f})"
    if timing is not None:
        t = r * timing.time_ratio
        if t <= 1:
            text += f"; optimizer time to target {t:.2f}x AdamW's"
        else:
            text += (
                f"; but optimizer time to target is {t:.2f}x AdamW's: at this size its "
                f"per-step cost ({timing.time_ratio:.2f}x) outweighs the saved steps"
            )
    return text + "."


def _num(x: float | None) -> str:
    return "diverged" if x is None else f"{x:.3g}"


def recommend(
    accuracy: Sequence[AccuracyResult],
    timing: Sequence[TimingResult],
    convergence: Sequence[ConvergenceResult],
    *,
    problems: Sequence[str],
    missing: Sequence[str] = (),
) -> list[str]:
    """One line per problem (rules 2-4) plus caveats (rule 5), Markdown."""
    lines = []
    for problem in problems:
        chosen, _, backend_text = choose_backend(problem, accuracy, timing)
        runs = [c for c in convergence if c.problem == problem]
        pick = next((c for c in runs if chosen and c.backend == chosen.backend), None)
        if pick is None and runs:
            pick = next((c for c in runs if c.backend != "reference"), runs[0])
        text = f"- **{problem}**: {backend_text}"
        if pick is not None:
            same = next(
                (t for t in timing if (t.problem, t.backend) == (problem, pick.backend)), None
            )
            text += f" Convergence ({pick.backend}): {_steps_sentence(pick, same)}"
            edges = [
                f"{run.optimizer} (lr {run.lr:g})" for run in (pick.shampoo, pick.adamw)
                if run.lr_at_grid_edge
            ]
            if edges:
                text += (
                    f" Caveat: the tuned rate of {' and '.join(edges)} is at the edge of the "
                    "grid; the best rate may lie outside it."
                )
        lines.append(text)
    for name in missing:
        lines.append(f"- {name}: not installed, not measured (install it to include it).")
    return lines
