"""The backend report: CLI, files, steps-to-target logic, accuracy, timing, progress."""

from __future__ import annotations

import io
import json
import math
import os
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shampoo_conformance import backends as backends_module
from shampoo_conformance import get_backend
from shampoo_conformance.__main__ import main as cli
from shampoo_conformance.backends import BackendUnavailable
from shampoo_conformance.report import ReportSettings, generate, report_shampoo_config, settings_for
from shampoo_conformance.report.accuracy import measure_accuracy
from shampoo_conformance.report.capture import captured
from shampoo_conformance.report.convergence import (
    DIVERGENCE_FACTOR,
    GridPoint,
    choose_learning_rate,
    spread,
    steps_to_target,
    train,
)
from shampoo_conformance.report.defaults import defaults_verdict
from shampoo_conformance.report.progress import Progress, format_seconds
from shampoo_conformance.report.timing import measure_timing
from shampoo_conformance.thirdparty.registry import Deviation, LibraryRun
from shampoo_datasets import load_problem
from shampoo_spec import ShampooConfig

LS = "ill_conditioned_least_squares"


def _tiny(out: Path, backends: tuple[str, ...] = ("reference",)) -> ReportSettings:
    return ReportSettings(
        problems=(LS,), backends=backends, out=out, steps=12, seeds=2, grid=(0.1, 1.0),
        timing_rounds=1, accuracy_steps=4,
    )


# ------------------------------------------------------------------ CLI
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["report", "--problems", "mnist"], "valid choices: digits_softmax"),
        (["report", "--backends", "reference,tensorflow"], "'tensorflow'; valid choices:"),
        (["demo", "--steps", "0"], "--steps must be >= 1"),
        (["report", "--seeds", "-1"], "--seeds must be >= 1"),
        (["report", "--quick", "--full"], "not allowed with argument"),
    ],
)
def test_cli_rejects_bad_arguments(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_settings_validate_names_and_counts() -> None:
    with pytest.raises(ValueError, match="problem = 'mnist' is invalid: allowed one of"):
        settings_for("default", problems=["mnist"])
    with pytest.raises(ValueError, match="backend = 'tf' is invalid"):
        settings_for("default", backends=["tf"])
    with pytest.raises(ValueError, match="preset = 'huge' is invalid"):
        settings_for("huge")
    with pytest.raises(ValueError, match="seeds = 0 is invalid"):
        settings_for("demo", seeds=0)
    quick = settings_for("quick")
    assert quick.steps_for(LS) == 75 and quick.seeds == 1
    assert settings_for("demo", steps=7).steps_for(LS) == 7
    assert settings_for("demo", backends=["jax", "jax"]).backends == ("jax",)


# ------------------------------------------------------------- the files
def test_report_writes_markdown_json_and_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out_text, err_text = io.StringIO(), io.StringIO()
    status = generate.main(_tiny(tmp_path, ("reference", "torch")), stdout=out_text,
                           stderr=err_text, command="test")
    assert status == 0, out_text.getvalue()
    md = (tmp_path / "report.md").read_text()
    assert "| problem | backend | dev f64 |" in md
    assert f"| {LS} | torch |" in md and "## Recommendation" in md
    assert f"![convergence_{LS}.png](convergence_{LS}.png)" in md
    png = tmp_path / f"convergence_{LS}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    raw = json.loads((tmp_path / "report.json").read_text())
    curves = raw["convergence"][0]["shampoo"]["curves"]
    assert len(curves) == 2 and len(curves[0]["losses"]) == 13
    table = out_text.getvalue()
    assert "steps shampoo" in table and "Recommendation:" in table
    assert "done in" in err_text.getvalue()  # the progress bar ran (plain lines: not a tty)
    # Each backend at its own defaults comes first, on the console and in the Markdown.
    assert table.index("At its own defaults") < table.index("steps shampoo")
    assert md.index("## At each backend's own defaults") < md.index("## Summary at the report")
    assert "| torch | lr=0.01 | n/a | n/a | ok | ok | ok | ok |" in md
    assert (tmp_path / "library-output.log").exists() and "library-output.log" in md


def test_missing_backend_is_reported_not_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unavailable() -> None:
        raise BackendUnavailable("backend 'torch' is not installed (test)")

    monkeypatch.setitem(backends_module._BUILTIN, "torch", unavailable)
    out_text = io.StringIO()
    status = generate.main(_tiny(tmp_path, ("reference", "torch")), plots=False,
                           stdout=out_text, stderr=io.StringIO(), command="test")
    assert status == 0
    assert "torch      not installed" in out_text.getvalue()
    md = (tmp_path / "report.md").read_text()
    assert "| torch | not installed |" in md
    assert "- torch: not installed, not measured" in md


def test_no_installed_backend_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unavailable() -> None:
        raise BackendUnavailable("not installed (test)")

    monkeypatch.setitem(backends_module._BUILTIN, "jax", unavailable)
    status = generate.main(_tiny(tmp_path, ("jax",)), plots=False, stdout=io.StringIO(),
                           stderr=io.StringIO(), command="test")
    assert status == 1


# ----------------------------------------------------- steps to target
def test_steps_to_target_is_the_first_step_at_or_below() -> None:
    losses = [5.0, 4.0, 3.0, 3.5, 2.0]
    assert steps_to_target(losses, 3.0) == 2  # equality counts
    assert steps_to_target(losses, 10.0) == 0  # the start itself
    assert steps_to_target(losses, 1.0) is None
    assert steps_to_target(losses, None) is None
    assert steps_to_target([math.nan, 1.0], 2.0) == 1  # NaN never counts


def test_spread_counts_misses_as_infinite() -> None:
    s = spread([10, 12, None])
    assert (s.median, s.low, s.high, s.reached, s.count) == (12.0, 10.0, 12.0, 2, 3)
    assert spread([None, None, 5]).median is None  # most seeds miss: not reached
    assert spread([8, None]).median is None  # median of (8, inf) is inf
    assert spread([math.inf, 1.0, 2.0]).median == 2.0
    with pytest.raises(ValueError, match="at least one value"):
        spread([])


def test_learning_rate_choice() -> None:
    points = [GridPoint(0.1, 30, 1e-3), GridPoint(0.3, 20, 1e-2), GridPoint(1.0, 20, 1e-4),
              GridPoint(3.0, None, math.inf)]
    assert choose_learning_rate(points).lr == 1.0  # fewest steps, then lowest final loss
    unreached = [GridPoint(0.1, None, 0.5), GridPoint(0.3, None, 0.2),
                 GridPoint(1.0, None, math.inf)]
    assert choose_learning_rate(unreached).lr == 0.3


def test_train_stops_on_divergence_and_reaches_targets() -> None:
    problem = load_problem(LS, seed=0)
    backend = get_backend("reference")
    good = train(problem, backend, "shampoo", 1.0, 30, config=report_shampoo_config(),
                 dtype=np.float64)
    assert not good.diverged and len(good.losses) == 31 and good.losses[-1] < good.losses[0]
    assert good.final_loss == good.losses[-1]
    # Gradient descent on this problem is stable only below step 2 (largest Hessian
    # eigenvalue 1); AdamW with a huge rate leaves the basin at once.
    calls: list[int] = []
    bad = train(problem, backend, "adamw", 1e6, 20, config=None, dtype=np.float64,
                on_step=lambda: calls.append(1))
    assert bad.diverged and bad.final_loss == math.inf and len(bad.losses) == 21
    assert math.isnan(bad.losses[-1]) and len(calls) == 20  # progress still completes
    limit = DIVERGENCE_FACTOR * bad.losses[0]
    first_bad = next(i for i, v in enumerate(bad.losses) if not v <= limit)
    assert all(math.isnan(v) for v in bad.losses[first_bad:])


# ------------------------------------------------------------- accuracy
def test_accuracy_flags_a_mutant_and_passes_the_reference_path() -> None:
    problem = load_problem(LS, seed=0)
    config = report_shampoo_config()
    (mutant,) = measure_accuracy(problem, get_backend("mutant:wrong_default_root"), config, 12,
                                 dtypes=(np.float64,))
    assert not mutant.within and mutant.max_relative_error > 1e-3
    assert mutant.first_divergent_step == 10  # the first root step (start 10)
    try:
        torch_backend = get_backend("torch")
    except BackendUnavailable:
        pytest.skip("torch not installed")
    f64, f32 = measure_accuracy(problem, torch_backend, config, 12)
    assert (f64.dtype, f32.dtype) == ("float64", "float32")
    assert f64.within and f64.max_relative_error < 1e-9
    assert f32.max_relative_error > f64.max_relative_error  # float32 rounding is visible


# --------------------------------------------------------------- timing
def test_timing_measures_both_optimizers() -> None:
    problem = load_problem(LS, seed=0)
    steps: list[int] = []
    t = measure_timing(problem, get_backend("reference"), report_shampoo_config(),
                       lr_shampoo=0.3, lr_adamw=0.3, rounds=2, dtype=np.float64,
                       on_steps=steps.append)
    assert t.shampoo_seconds > 0 and t.adamw_seconds > 0
    assert t.period == 10 and sum(steps) == 2 * (11 + 3 * 10)  # warm-up, 2 rounds, peak
    assert t.memory_ratio == pytest.approx((2 * (64 + 36) + 2 * 48) / (2 * 48))
    assert t.shampoo_peak_bytes is None and t.peak_ratio is None  # the reference has no peak


def test_timing_peak_on_a_framework_backend() -> None:
    try:
        backend = get_backend("torch")
    except BackendUnavailable:
        pytest.skip("torch not installed")
    t = measure_timing(load_problem(LS, seed=0), backend, report_shampoo_config(),
                       lr_shampoo=0.3, lr_adamw=0.3, rounds=1, dtype=np.float64)
    assert t.shampoo_peak_bytes is not None and t.adamw_peak_bytes is not None
    assert t.shampoo_peak_bytes >= t.shampoo_state_bytes
    assert t.adamw_peak_bytes >= t.adamw_state_bytes
    assert t.peak_ratio is not None and t.peak_ratio > 1.0  # factors and roots vs m and v


# ------------------------------------------------------------- progress
def test_progress_without_a_terminal_prints_a_line_per_tenth() -> None:
    stream = io.StringIO()
    bar = Progress(200, stream=stream)
    assert not bar.interactive
    for _ in range(200):
        bar.advance(1, "work")
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 12  # 0%..100% (11 lines: first advance is the 0% tenth) + "done in"
    assert lines[-2].startswith("[" + "#" * 28 + "] 100%") and lines[-1].startswith("done in")
    assert "\r" not in stream.getvalue()


def test_progress_on_a_terminal_redraws_in_place() -> None:
    stream = io.StringIO()
    bar = Progress(4, stream=stream, interactive=True)
    bar.advance(4, "all")
    bar.close()
    assert stream.getvalue().startswith("\r") and "100%" in stream.getvalue()
    with pytest.raises(ValueError, match="total = 0 is invalid"):
        Progress(0)


def test_format_seconds() -> None:
    assert [format_seconds(s) for s in (0.4, 59, 61, 3725)] == ["0s", "59s", "1m01s", "1h02m"]
    assert format_seconds(math.inf) == "?" and format_seconds(math.nan) == "?"


# ------------------------------------------- defaults verdict, captured output
class _Careless:
    """A backend whose library consumes the caller's gradients, swallows unknown
    arguments and prints and warns while it steps (the report must keep all of it)."""

    name = "careless"
    dtypes = (np.float64, np.float32)
    USER_KWARGS = {"lr": 0.1}
    deviations = (Deviation("grads_zeroed", None, ("test_side_effect_grads_unchanged",),
                            "zeroes p.grad (test)", "design"),)

    def defaults_config(self) -> Any:
        return replace(ShampooConfig(), learning_rate=0.1)

    def library_run(self, kwargs: dict[str, Any], params: Any, grads: Any,
                    dtype: Any) -> LibraryRun:
        print("debug: abc,adb,aec->ade")
        warnings.warn("float64 truncated (test)", UserWarning, stacklevel=1)
        run = get_backend("reference").run(self.defaults_config(), params, grads)
        return LibraryRun([{k: np.asarray(v, dtype) for k, v in p.items()} for p in run],
                          [{k: np.zeros_like(v) for k, v in g.items()} for g in grads])


def test_defaults_verdict_tells_documented_from_undocumented() -> None:
    verdict = defaults_verdict(_Careless())  # type: ignore[arg-type]
    by_check = {o.check: o for o in verdict.outcomes}
    grads = by_check["test_side_effect_grads_unchanged"]
    assert grads.status == "fail" and grads.deviation == "grads_zeroed (design)"
    typo = by_check["test_side_effect_unknown_argument_refused"]
    assert typo.status == "fail" and not typo.deviation and "silently" in typo.detail
    assert [o.check for o in verdict.undocumented] == [typo.check]
    assert by_check["test_side_effect_float64_stays_float64"].status == "pass"
    assert "UNDOCUMENTED" in verdict.summary() and "grads_zeroed" in verdict.summary()


def test_captured_output_goes_to_the_log_and_is_counted(tmp_path: Path) -> None:
    log = tmp_path / "out" / "library-output.log"
    with captured(log) as (output, console):
        print("from python", flush=True)
        os.write(1, b"from C\n")
        os.write(2, b"to stderr\n")
        for _ in range(3):
            warnings.warn("again (test)", UserWarning, stacklevel=1)
        console.write("progress stays on the console\n")
    text = log.read_text()
    assert "from python" in text and "from C" in text and "to stderr" in text
    assert "progress stays" not in text
    assert (output.warnings, output.distinct_warnings) == (3, 1)
    assert output.lines == text.count("\n") and "3 warnings (1 distinct)" in output.summary()


def test_a_measurement_the_library_cannot_make_is_listed_not_an_error(tmp_path: Path) -> None:
    from shampoo_conformance.report.collect import Report, _failed
    from shampoo_spec import Inexpressible, NonFiniteGradientError

    report = Report(_tiny(tmp_path), [], [])
    _failed(report, "convergence p / b", Inexpressible("parameter 'b' is not a matrix"))
    _failed(report, "accuracy p / b", NonFiniteGradientError("the reference overflows"))
    _failed(report, "timing p / b", AttributeError("no attribute 'tree_flatten'"))
    assert [line.split(":")[0] for line in report.not_measured] == [
        "convergence p / b", "accuracy p / b"]
    assert report.errors == ["timing p / b: AttributeError: no attribute 'tree_flatten'"]
