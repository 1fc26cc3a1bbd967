"""The report as text: a terminal summary table and a Markdown document.

Numbers are formatted once here (:func:`steps_text`, :func:`loss_text`)
so the terminal and Markdown tables always agree.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from .accuracy import AccuracyResult
from .collect import Report
from .convergence import ConvergenceResult, OptimizerRun, Spread
from .defaults import CHECK_NAMES
from .recommend import PRACTICAL_RTOL
from .timing import TimingResult


def steps_text(s: Spread) -> str:
    """``"14 [12-17]"``, with ``" (2/3)"`` when some seeds miss; ``"not reached"``."""
    if s.median is None:
        return f"not reached ({s.reached}/{s.count})" if s.reached else "not reached"
    text = f"{s.median:.0f}"
    if s.count > 1 and s.low is not None and s.high is not None:
        text += f" [{s.low:.0f}-{s.high:.0f}]"
    if s.reached < s.count:
        text += f" ({s.reached}/{s.count})"
    return text


def loss_text(s: Spread) -> str:
    """``"1.2e-03 [9e-04-2e-03]"``; ``"diverged"`` when the median run diverged."""
    if s.median is None:
        return "diverged"
    text = f"{s.median:.3g}"
    if s.count > 1 and s.low is not None and s.high is not None:
        text += f" [{s.low:.2g}, {s.high:.2g}]"
    return text


def metrics_text(run: OptimizerRun) -> str:
    """``"accuracy 0.981"`` (medians over seeds) or ``"-"`` when the problem has no metrics."""
    if not run.final_metrics:
        return "-"
    return ", ".join(
        f"{k} {'diverged' if v.median is None else f'{v.median:.3g}'}"
        for k, v in run.final_metrics.items()
    )


def ratio_text(c: ConvergenceResult) -> str:
    r = c.step_ratio
    return "-" if r is None else f"{r:.2f}"


def _deviation(rows: Sequence[AccuracyResult], problem: str, backend: str, dtype: str) -> str:
    row = next((r for r in rows if (r.problem, r.backend, r.dtype) == (problem, backend, dtype)),
               None)
    if row is None:
        return "-"
    if row.error is not None:
        return "error"
    mark = "" if row.within and row.max_relative_error <= PRACTICAL_RTOL else " !"
    return f"{row.max_relative_error:.1e}{mark}"


def _timing(rows: Sequence[TimingResult], problem: str, backend: str) -> TimingResult | None:
    return next((t for t in rows if (t.problem, t.backend) == (problem, backend)), None)


DEFAULTS_HEADER = ("backend", "user arguments", *CHECK_NAMES.values())
SUMMARY_HEADER = (
    "problem", "backend", "dev f64", "dev f32", "shampoo ms", "time x", "state x", "peak x",
    "steps shampoo", "steps adamw", "ratio",
)


def summary_rows(report: Report) -> list[tuple[str, ...]]:
    """One row per problem and requested backend (missing ones say so)."""
    rows: list[tuple[str, ...]] = []
    for info in report.problems:
        for status in report.backends:
            name = status.name
            if not status.installed:
                rows.append((info.name, name, "not installed", *("",) * 8))
                continue
            dev64 = "oracle" if name == "reference" else _deviation(
                report.accuracy, info.name, name, "float64")
            dev32 = "-" if name == "reference" else _deviation(
                report.accuracy, info.name, name, "float32")
            t = _timing(report.timing, info.name, name)
            conv = next((c for c in report.convergence
                         if (c.problem, c.backend) == (info.name, name)), None)
            rows.append((
                info.name, name, dev64, dev32,
                f"{t.shampoo_seconds * 1e3:.3g}" if t else "-",
                f"{t.time_ratio:.2f}" if t else "-",
                f"{t.memory_ratio:.1f}" if t else "-",
                _ratio(t.peak_ratio) if t else "-",
                steps_text(conv.shampoo.steps_to_target) if conv else "-",
                steps_text(conv.adamw.steps_to_target) if conv else "-",
                ratio_text(conv) if conv else "-",
            ))
    return rows


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _kib(x: int | None) -> str:
    return "-" if x is None else f"{x / 1024:.1f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(x).ljust(w) for x, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(out)


LEGEND = (
    "dev: max deviation from the float64 reference relative to the parameters' displacement "
    f"(! = outside the derived bound or above {PRACTICAL_RTOL:g}); shampoo ms: median optimizer "
    "step; time x / state x / peak x: Shampoo / AdamW step time, optimizer-state bytes and "
    "peak optimizer bytes during an update (state + temporaries), same framework; steps: "
    "median steps to the target loss [min-max over seeds], ratio = Shampoo / AdamW."
)


#: A check's cell in the defaults table: passed, failed (explained by a documented
#: deviation, or not), or not checkable.
_CELLS = {"pass": "ok", "n/a": "n/a"}
DEFAULTS_LEGEND = (
    "At its defaults: the library built with only the arguments a user must give, "
    "against exact Shampoo on the spec's reading of those defaults (exact f64 / f32), and "
    "what a step does to the caller (grads kept, refuses typos: an unknown argument "
    "raises, RNG kept: torch/NumPy/Python global generators, stays f64). ok = passed; "
    "dev = fails as a documented deviation (docs/third-party.md); FAIL = fails, "
    "undocumented; n/a = not checkable (reason in report.md)."
)


def defaults_rows(report: Report) -> list[tuple[str, ...]]:
    """One row per backend probed at its defaults: its arguments and each check's cell."""
    rows: list[tuple[str, ...]] = []
    for verdict in report.defaults:
        cells = {o.check: _CELLS.get(o.status, "dev" if o.deviation else "FAIL")
                 for o in verdict.outcomes}
        rows.append((verdict.backend, verdict.user_kwargs,
                     *(cells.get(check, "-") for check in CHECK_NAMES)))
    return rows


def _defaults_lines(report: Report) -> list[str]:
    """Each backend's one-line verdict at its defaults."""
    return [f"- {v.backend}: {v.summary()}" for v in report.defaults]


def terminal_summary(report: Report) -> str:
    """The tables printed at the end of a run: each backend at its defaults first, then
    at the report's config, with the recommendation."""
    lines: list[str] = []
    if report.defaults:
        lines += ["At its own defaults (what you get if you change nothing):",
                  _table(DEFAULTS_HEADER, defaults_rows(report)), "", DEFAULTS_LEGEND, "",
                  *_defaults_lines(report), "",
                  "At the report's config (or the nearest each library expresses):"]
    lines += [_table(SUMMARY_HEADER, summary_rows(report)), "", LEGEND, "", "Recommendation:"]
    lines += [r.replace("**", "") for r in report.recommendations]
    if report.console_output:
        lines += ["", report.console_output]
    if report.not_measured:
        lines += ["", f"Not measurable: {len(report.not_measured)} measurements (the library "
                  "cannot run that problem or config; listed in report.md)."]
    if report.errors:
        lines += ["", "Errors (measurements skipped):", *(f"- {e}" for e in report.errors)]
    return "\n".join(lines)


def _defaults_section(report: Report) -> list[str]:
    if not report.defaults:
        return []
    details = [f"- {v.backend}, {CHECK_NAMES[o.check]}: {o.status}: {o.detail}"
               for v in report.defaults for o in v.outcomes if o.detail]
    return ["## At each backend's own defaults", "",
            _markdown_table(DEFAULTS_HEADER, defaults_rows(report)), "", DEFAULTS_LEGEND, "",
            *_defaults_lines(report), "", "What each check said:", "", *details, ""]


def _accuracy_section(report: Report) -> list[str]:
    rows = [
        (a.problem, a.backend, a.dtype, f"{a.max_relative_error:.2e}", f"{a.tolerance:.2e}",
         f"{a.kappa:.2e}",
         "error: " + a.error if a.error else ("within" if a.within else
                                              f"outside from step {a.first_divergent_step}"))
        for a in report.accuracy
    ]
    return [
        "## Accuracy against the reference",
        "",
        f"The float64 reference runs the config for {report.settings.accuracy_steps} steps on "
        "each problem (gradients at its own parameters); that gradient stream is replayed "
        "through each backend's `run` in each dtype. Error: max over steps and parameters of "
        "||theta - theta_ref|| / ||theta_ref - theta_0||; tolerance: the bound derived from "
        "dtype, factor condition number kappa and step count (docs/spec.md section 5).",
        "",
        _markdown_table(("problem", "backend", "dtype", "max rel. error", "tolerance", "kappa",
                         "verdict"), rows) if rows else "(no backend besides the reference)",
        "",
    ]


def _timing_section(report: Report) -> list[str]:
    rows = [
        (t.problem, t.backend, t.dtype, f"{t.shampoo_seconds * 1e3:.3g}",
         f"{t.adamw_seconds * 1e3:.3g}", f"{t.time_ratio:.2f}",
         _kib(t.shampoo_state_bytes), _kib(t.adamw_state_bytes), _ratio(t.memory_ratio),
         _kib(t.shampoo_peak_bytes), _kib(t.adamw_peak_bytes), _ratio(t.peak_ratio))
        for t in report.timing
    ]
    period = report.settings.config.schedule.precondition_frequency
    return [
        "## Step time and optimizer memory",
        "",
        f"The optimizer update alone (gradients given), median over "
        f"{report.settings.timing_rounds} interleaved rounds of {period} steps per optimizer "
        "(each Shampoo round holds one root step, so its time is amortized). State: bytes of "
        "the optimizer state arrays the backend stores between steps. Peak: the most bytes "
        f"the optimizer holds during an update, state plus temporaries, over {period} more "
        "(untimed) steps including a root step; torch: the CPU allocator's events under "
        "torch.profiler; JAX: XLA's buffer assignment of the compiled update (state in and "
        "out both live); '-' where the backend cannot measure it.",
        "",
        _markdown_table(("problem", "backend", "dtype", "Shampoo ms", "AdamW ms", "ratio",
                         "Shampoo state KiB", "AdamW state KiB", "ratio",
                         "Shampoo peak KiB", "AdamW peak KiB", "ratio"), rows)
        if rows else "(nothing timed)",
        "",
    ]


def _convergence_section(report: Report) -> list[str]:
    s = report.settings
    rows = []
    grid_rows = []
    with_metrics = any(c.shampoo.final_metrics for c in report.convergence)
    for c in report.convergence:
        rows.append((
            c.problem, c.backend, c.dtype, f"{c.shampoo.lr:g}",
            steps_text(c.shampoo.steps_to_target), loss_text(c.shampoo.final_loss),
            f"{c.adamw.lr:g}", steps_text(c.adamw.steps_to_target),
            loss_text(c.adamw.final_loss), ratio_text(c),
        ) + ((metrics_text(c.shampoo), metrics_text(c.adamw)) if with_metrics else ()))
        for run in (c.shampoo, c.adamw):
            cells = [
                ("-" if p.steps_to_target is None else str(p.steps_to_target))
                + f" / {p.final_loss:.2g}"
                for p in run.grid
            ]
            grid_rows.append((c.problem, c.backend, run.optimizer, *cells))
    lines = [
        "## Convergence",
        "",
        f"Each optimizer's learning rate is the best of the grid {list(s.grid)} on seed 0 "
        "(fewest steps to the target, then lowest final loss); then {seeds} seeds at that rate, "
        "the same step budget for both. Steps to target: median [min-max] over seeds, "
        "(k/n) when only k of n seeds reach it. Final loss: median [min, max].".format(
            seeds=s.seeds),
        "",
        _markdown_table(("problem", "backend", "dtype", "Shampoo lr", "Shampoo steps",
                         "Shampoo final loss", "AdamW lr", "AdamW steps", "AdamW final loss",
                         "ratio", *(("Shampoo final metrics", "AdamW final metrics")
                                    if with_metrics else ())), rows)
        if rows else "(no backend could train)",
        "",
    ]
    if grid_rows:
        lines += [
            "Learning-rate grid on seed 0 (steps to target / final loss; - = not reached):",
            "",
            _markdown_table(("problem", "backend", "optimizer", *(f"{lr:g}" for lr in s.grid)),
                            grid_rows),
            "",
        ]
    return lines


def markdown(report: Report, plots: Sequence[str], command: str) -> str:
    """The whole report as Markdown; ``plots`` are PNG file names beside it."""
    s = report.settings
    lines = [
        "# Shampoo backend report",
        "",
        f"Command: `{command}`; {report.seconds:.0f} s.",
        "",
        *([report.console_output, ""] if report.console_output else []),
        *_defaults_section(report),
        "## Summary at the report's config",
        "",
        _markdown_table(SUMMARY_HEADER, summary_rows(report)),
        "",
        LEGEND,
        "",
        "## Recommendation",
        "",
        *report.recommendations,
        "",
        "## Problems",
        "",
        *(f"- **{p.name}** ({p.steps} steps, target loss "
          f"{'none' if p.target_loss is None else f'{p.target_loss:.3g}'}): {p.description}"
          for p in report.problems),
        "",
    ]
    lines += _convergence_section(report)
    for png in plots:
        lines += [f"![{png}]({png})", ""]
    lines += _accuracy_section(report) + _timing_section(report)
    lines += [
        "## Backends",
        "",
        *(f"- {b.name}: " + ("installed" if b.installed else "") + (
            f"; {b.note}" if b.installed and b.note else b.note) for b in report.backends),
        "",
    ]
    if report.not_measured:
        lines += ["## Not measurable", "", "A library that cannot run a problem (a shape, "
                  "a config) or a config on which the reference itself overflows:", "",
                  *(f"- {e}" for e in report.not_measured), ""]
    if report.errors:
        lines += ["## Errors", "", *(f"- {e}" for e in report.errors), ""]
    lines += [
        "## Shampoo configuration",
        "",
        "The learning rate is tuned per problem and backend (above); everything else is this "
        "`ShampooConfig` (JSON), the same for every backend except a third-party library "
        "that cannot express it: that one runs the nearest config it expresses, with the "
        "changes listed under Backends:",
        "",
        "```json",
        json.dumps(s.config.to_dict(), indent=1, sort_keys=True),
        "```",
        "",
        "AdamW: betas (0.9, 0.999), eps 1e-8, no weight decay (torch.optim.AdamW, optax.adamw, "
        "and its NumPy twin for the reference). Framework backends train in float32, the "
        "reference in float64.",
        "",
        "## Environment",
        "",
        *(f"- {k}: {v}" for k, v in report.environment.items()),
        "",
    ]
    return "\n".join(lines)
