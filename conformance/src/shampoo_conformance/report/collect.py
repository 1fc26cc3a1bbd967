"""Run every measurement of the report and gather the results in one :class:`Report`.

First each backend at its own defaults (:mod:`.defaults`), then the step
costs for the ETA (:mod:`.eta`). Order per problem: convergence (tunes each
optimizer's learning rate per backend), then accuracy against the reference at Shampoo's tuned rate,
then timing at both tuned rates. A backend whose framework is missing is
listed as "not installed"; one without a ``stepper`` (open-loop only) gets
the accuracy comparison alone; an exception inside one measurement is
recorded with its message and the report goes on.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
import time
from dataclasses import dataclass, field, replace
from importlib import metadata
from typing import Any, TextIO

import numpy as np

from shampoo_conformance.backends import BackendUnavailable, get_backend, has_stepper
from shampoo_conformance.protocol import Backend
from shampoo_conformance.thirdparty.registry import nearest_config
from shampoo_datasets import load_problem
from shampoo_spec import Inexpressible, NonFiniteGradientError, ShampooConfig

from . import settings as S
from .accuracy import AccuracyResult, measure_accuracy
from .convergence import ConvergenceResult, tune_and_evaluate
from .defaults import DefaultsVerdict, defaults_verdict
from .eta import step_costs
from .progress import Progress
from .recommend import recommend
from .timing import TimingResult, measure_timing, timing_steps


@dataclass(frozen=True)
class BackendStatus:
    """Whether a requested backend could be loaded and what it can do."""

    name: str
    installed: bool
    trains: bool  # has a closed-loop stepper (convergence and timing)
    note: str


@dataclass(frozen=True)
class ProblemInfo:
    name: str
    description: str
    target_loss: float | None
    loss_floor: float | None
    steps: int


@dataclass
class Report:
    """Everything measured, ready to render."""

    settings: S.ReportSettings
    backends: list[BackendStatus]
    problems: list[ProblemInfo]
    convergence: list[ConvergenceResult] = field(default_factory=list)
    accuracy: list[AccuracyResult] = field(default_factory=list)
    timing: list[TimingResult] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: Measurements a backend cannot make (its library cannot run the problem or the
    #: config, or the reference overflows there): listed, not errors.
    not_measured: list[str] = field(default_factory=list)
    recommendations: list[str] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    #: What the libraries printed and warned, and where it went (:mod:`.capture`).
    console_output: str = ""
    #: Each backend at its own defaults (:mod:`.defaults`): the first verdict.
    defaults: list[DefaultsVerdict] = field(default_factory=list)


def training_dtype(backend: str) -> Any:
    """float64 for the reference (float64 by design), else the report's training dtype."""
    return np.float64 if backend == "reference" else S.TRAINING_DTYPE


def load_backends(names: tuple[str, ...]) -> tuple[dict[str, Backend], list[BackendStatus]]:
    loaded: dict[str, Backend] = {}
    status = []
    for name in names:
        try:
            backend = get_backend(name)
        except BackendUnavailable as err:
            status.append(BackendStatus(name, False, False, f"not installed ({err})"))
            continue
        trains = has_stepper(backend)
        loaded[name] = backend
        note = "" if trains else "no stepper: accuracy only (open-loop run)"
        deviations = getattr(backend, "deviations", ())
        if deviations:  # a third-party library's (docs/third-party.md)
            listed = ", ".join(f"{d.name} ({d.kind})" for d in deviations)
            note = "; ".join(filter(None, [note, f"documented deviations: {listed} "
                                                 "(docs/third-party.md)"]))
        status.append(BackendStatus(name, True, trains, note))
    return loaded, status


def _versions() -> dict[str, str]:
    out = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": str(os.cpu_count()),
    }
    for package in ("numpy", "scipy", "torch", "jax", "jaxlib", "optax"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return out


def _total_seconds(settings: S.ReportSettings, training: list[str], compared: list[str],
                   costs: dict[tuple[str, str], float]) -> float:
    """Estimated seconds of the whole report (:mod:`.eta`): the progress bar's total."""
    total = 0.0
    period_steps = timing_steps(settings.config, settings.timing_rounds)
    runs = 2 * (len(settings.grid) + settings.seeds - 1)
    for problem in settings.problems:
        for name in training:
            total += costs[(name, problem)] * (runs * settings.steps_for(problem) + period_steps)
        for name in compared:
            total += _accuracy_cost(settings, costs, name, problem)
    return max(total, 1e-6)


def _advance_steps(progress: Progress, cost: float, steps: int) -> None:
    progress.advance(steps * cost)


def _accuracy_cost(settings: S.ReportSettings, costs: dict[tuple[str, str], float],
                   backend: str, problem: str) -> float:
    """Seconds of one accuracy comparison: the backend's and the reference's runs in two
    dtypes."""
    reference = costs.get(("reference", problem), costs[(backend, problem)])
    return 2 * settings.accuracy_steps * (costs[(backend, problem)] + reference)


def collect(settings: S.ReportSettings, *, progress_stream: TextIO | None = None) -> Report:
    """Measure everything ``settings`` asks for (progress bar on ``progress_stream``)."""
    start = time.perf_counter()
    backends, status = load_backends(settings.backends)
    training = [n for n in backends if has_stepper(backends[n])]
    configs = _configs(backends, settings.config, status)
    infos = []
    for name in settings.problems:
        p = load_problem(name, seed=0)
        infos.append(ProblemInfo(name, p.description, p.target_loss, p.loss_floor,
                                 settings.steps_for(name)))
    report = Report(settings, status, infos, environment=_versions())
    stream = progress_stream if progress_stream is not None else sys.stderr
    report.defaults = _defaults(backends, stream)
    stream.write("timing one step of each backend on each problem (for the ETA) ...\n")
    costs = step_costs(settings.problems, backends, training, configs, training_dtype)
    compared = [n for n in backends if n != "reference"]
    progress = Progress(_total_seconds(settings, training, compared, costs), stream=stream)
    for info in infos:
        _problem(report, info, backends, configs, training, progress, costs)
    progress.close()
    missing = [s.name for s in status if not s.installed]
    # Only a backend that runs the report's config itself is a candidate: one that runs
    # the nearest config its library expresses runs another algorithm (its status says).
    own = {name for name, config in configs.items() if config == settings.config}
    report.recommendations = recommend(
        report.accuracy, [t for t in report.timing if t.backend in own], report.convergence,
        problems=settings.problems, missing=missing,
    )
    report.seconds = time.perf_counter() - start
    return report


def _defaults(backends: dict[str, Backend], stream: TextIO) -> list[DefaultsVerdict]:
    """Every backend at its own defaults (:mod:`.defaults`), with a progress bar."""
    progress = Progress(max(len(backends), 1), stream=stream)
    out = []
    for name, backend in backends.items():
        progress.set_label(f"{name}: at its defaults")
        out.append(defaults_verdict(backend))
        progress.advance(1)
    progress.close()
    return out


def _configs(
    backends: dict[str, Backend], config: ShampooConfig, status: list[BackendStatus]
) -> dict[str, ShampooConfig]:
    """The config each backend runs: ``config``, or for another library the nearest
    config it expresses (:func:`~shampoo_conformance.thirdparty.registry.nearest_config`),
    with the changes written into that backend's status note."""
    out = {}
    for index, entry in enumerate(status):
        if entry.name not in backends:
            continue
        out[entry.name], changed = nearest_config(backends[entry.name], config)
        if changed:
            note = "runs the nearest config its library expresses: " + "; ".join(changed)
            status[index] = replace(entry, note="; ".join(filter(None, [entry.note, note])))
    return out


def _failed(report: Report, what: str, err: Exception) -> None:
    """Record a measurement that raised: not measurable (the library cannot run this
    problem or config, or the reference itself overflows on it at this rate: a fact of
    the measurement, listed apart) or an error (anything else: the status is 1)."""
    line = f"{what}: {type(err).__name__}: {err}"
    if isinstance(err, Inexpressible | NonFiniteGradientError):
        report.not_measured.append(line)
    else:
        report.errors.append(line)


def _problem(
    report: Report,
    info: ProblemInfo,
    backends: dict[str, Backend],
    configs: dict[str, ShampooConfig],
    training: list[str],
    progress: Progress,
    costs: dict[tuple[str, str], float],
) -> None:
    settings = report.settings
    name = info.name
    for backend_name in training:
        progress.set_label(f"{name}: convergence on {backend_name}")
        cost = costs[(backend_name, name)]
        try:
            report.convergence.append(tune_and_evaluate(
                name, backends[backend_name], config=configs[backend_name], grid=settings.grid,
                steps=info.steps, seeds=settings.seeds,
                dtype=training_dtype(backend_name),
                on_step=functools.partial(progress.advance, cost),
            ))
        except Exception as err:  # one failed measurement must not end the report
            _failed(report, f"convergence {name} / {backend_name}", err)
    tuned = {c.backend: c for c in report.convergence if c.problem == name}
    source = tuned.get("reference") or next(iter(tuned.values()), None)
    lr = source.shampoo.lr if source is not None else settings.config.learning_rate
    problem = load_problem(name, seed=0)
    for backend_name, backend in backends.items():
        if backend_name == "reference":
            continue  # the oracle itself
        progress.set_label(f"{name}: accuracy of {backend_name}")
        # Against the exact reference on the config this backend runs.
        accuracy_config = replace(configs[backend_name], learning_rate=lr)
        try:
            report.accuracy.extend(
                measure_accuracy(problem, backend, accuracy_config, settings.accuracy_steps)
            )
        except Exception as err:
            _failed(report, f"accuracy {name} / {backend_name}", err)
        progress.advance(_accuracy_cost(settings, costs, backend_name, name))
    for backend_name in training:
        progress.set_label(f"{name}: timing on {backend_name}")
        run = tuned.get(backend_name)
        cost = costs[(backend_name, name)]
        try:
            config = configs[backend_name]
            report.timing.append(measure_timing(
                problem, backends[backend_name], config,
                lr_shampoo=run.shampoo.lr if run else config.learning_rate,
                lr_adamw=run.adamw.lr if run else config.learning_rate,
                rounds=settings.timing_rounds, dtype=training_dtype(backend_name),
                on_steps=functools.partial(_advance_steps, progress, cost),
            ))
        except Exception as err:
            _failed(report, f"timing {name} / {backend_name}", err)
