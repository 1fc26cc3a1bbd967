"""What the backend report measures: problems, backends, budgets, the Shampoo config.

The Shampoo configuration (:func:`report_shampoo_config`) is the one every
backend runs, chosen to be comparable to AdamW and sensible for runs of a
few hundred steps:

- statistics: EMA with ``beta2 = 0.999`` and bias correction (eqs. 6-7);
- epsilon: relative, ``1e-6 * lambda_max`` (eq. 9), which bounds each
  factor's condition number near 1e6 (as in the MLPerf ResNet-50 anchor);
- grafting: Adam (``beta2 = 0.999``, ``epsilon = 1e-8``, bias-corrected,
  eq. 14), so the step length is AdamW's;
- gradient filter ``beta1 = 0.9`` with bias correction (eq. 15), AdamW's
  first moment;
- blocking: blocks of at most 128, no dim merging (eqs. 4-5), so a matrix
  keeps its two Kronecker factors;
- schedule: roots every 10 steps, the Shampoo direction from step 10
  (eq. 8), so short runs see many root refreshes.

AdamW is ``betas = (0.9, 0.999)``, ``eps = 1e-8``, no weight decay (the
problems define their own optimum). Each optimizer gets its own learning
rate: the best of a grid on seed 0 (:mod:`.convergence`), then the same
step budget on every seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shampoo_spec import (
    BlockingConfig,
    EpsilonConfig,
    GradientFilterConfig,
    GraftingConfig,
    ScheduleConfig,
    ShampooConfig,
    StatisticsConfig,
)

#: Backends of the default report (the ones present are run; a missing
#: framework is reported as "not installed"). "torch-ddp" and "jax-sharded"
#: can be asked for with ``--backends``.
DEFAULT_BACKENDS: tuple[str, ...] = ("reference", "torch", "jax")

#: Step budget per problem: enough for the better of the two tuned
#: optimizers to reach the target on every seed. Other problems get
#: :data:`FALLBACK_STEPS`.
STEPS_BY_PROBLEM: dict[str, int] = {
    "digits_softmax": 100,
    "ill_conditioned_least_squares": 300,
    "diabetes_least_squares": 300,
    "breast_cancer_logistic": 300,
    "digits_mlp": 200,
    "markov_transformer": 200,
}
FALLBACK_STEPS = 200

#: Learning-rate grids, powers of about 3 (half decades). The full grid
#: covers both optimizers' best rates on every problem with room on each
#: side (up to 1000: diabetes_least_squares' raw targets are in the
#: hundreds, and AdamW's step length is about its learning rate, so its best
#: rate there is about 300); the demo grid is the part its problems need.
FULL_GRID: tuple[float, ...] = (
    1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0
)
DEMO_GRID: tuple[float, ...] = (1e-2, 3e-2, 1e-1, 3e-1, 1.0, 3.0, 10.0)

#: Steps of the accuracy comparison (agreement after 20 steps).
ACCURACY_STEPS = 20
#: Dtype of the framework backends in the convergence and timing runs
#: (the reference is float64 by design).
TRAINING_DTYPE = np.float32


def report_shampoo_config() -> ShampooConfig:
    """The Shampoo configuration of the report (module docstring); lr set per run."""
    return ShampooConfig(
        learning_rate=0.1,
        statistics=StatisticsConfig(beta2=0.999, bias_correction=True),
        epsilon=EpsilonConfig(value=1e-6, scale="relative"),
        grafting=GraftingConfig(type="adam", beta2=0.999, epsilon=1e-8, bias_correction=True),
        gradient_filter=GradientFilterConfig(beta1=0.9, bias_correction=True),
        blocking=BlockingConfig(max_preconditioner_dim=128, merge_dims_up_to=None),
        schedule=ScheduleConfig(precondition_frequency=10, start_preconditioning_step=10),
    )


@dataclass(frozen=True)
class ReportSettings:
    """Everything one report run does; see :func:`settings_for` for the presets.

    ``steps`` None: :data:`STEPS_BY_PROBLEM` times ``step_scale`` (at least
    10); else one budget for all.
    ``seeds``: evaluation seeds (problem seeds 0..seeds-1; the grid is tuned
    on seed 0). ``timing_rounds``: interleaved Shampoo/AdamW periods timed.
    """

    problems: tuple[str, ...]
    backends: tuple[str, ...] = DEFAULT_BACKENDS
    out: Path = Path("shampoo-report")
    steps: int | None = None
    seeds: int = 3
    grid: tuple[float, ...] = FULL_GRID
    timing_rounds: int = 10
    accuracy_steps: int = ACCURACY_STEPS
    step_scale: float = 1.0
    config: ShampooConfig = field(default_factory=report_shampoo_config)

    def steps_for(self, problem: str) -> int:
        if self.steps is not None:
            return self.steps
        base = STEPS_BY_PROBLEM.get(problem, FALLBACK_STEPS)
        return max(10, round(base * self.step_scale))


def available_problems() -> tuple[str, ...]:
    """Every problem of ``shampoo_datasets``."""
    from shampoo_datasets import PROBLEMS

    return tuple(PROBLEMS)


def default_problems() -> tuple[str, ...]:
    """The problems of the default report: every problem of ``shampoo_datasets``."""
    return available_problems()


#: The embedded demo: the two problems that run in seconds per backend.
DEMO_PROBLEMS: tuple[str, ...] = ("digits_softmax", "ill_conditioned_least_squares")
#: ``nox -s compare``'s default: the demo's problems and a small network, so that every
#: library's every backend fits in 15 minutes on 2 cores (``--full``: every problem).
COMPARE_PROBLEMS: tuple[str, ...] = (*DEMO_PROBLEMS, "digits_mlp")


def settings_for(
    preset: str,
    *,
    problems: Sequence[str] | None = None,
    backends: Sequence[str] | None = None,
    out: Path | str | None = None,
    steps: int | None = None,
    seeds: int | None = None,
    config: ShampooConfig | None = None,
) -> ReportSettings:
    """Settings of a preset, overridden by whatever is given.

    ``"demo"``: :data:`DEMO_PROBLEMS`, 3 seeds, :data:`DEMO_GRID`, 5 timing
    rounds (about a minute on 2 cores). ``"compare"``: :data:`COMPARE_PROBLEMS`,
    2 seeds, the demo grid, half the steps, 3 timing rounds (``nox -s compare``
    over every library). ``"default"``: every problem, 3
    seeds, :data:`FULL_GRID`. ``"quick"``: the demo at a quarter of the
    steps and one seed (a smoke test). ``"full"`` (the convergence
    benchmark): every problem, 5 seeds, :data:`FULL_GRID`, 10 rounds.
    Unknown names raise ``ValueError`` listing the valid ones.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset = {preset!r} is invalid: allowed one of {PRESETS}.")
    base: dict[str, object]
    if preset == "demo":
        base = {"problems": DEMO_PROBLEMS, "seeds": 3, "grid": DEMO_GRID, "timing_rounds": 5}
    elif preset == "quick":
        base = {
            "problems": DEMO_PROBLEMS, "seeds": 1, "grid": DEMO_GRID, "timing_rounds": 2,
            "step_scale": 0.25,
        }
    elif preset == "compare":
        base = {"problems": COMPARE_PROBLEMS, "seeds": 2, "grid": DEMO_GRID, "timing_rounds": 3,
                "step_scale": 0.5}
    elif preset == "full":
        base = {"problems": default_problems(), "seeds": 5, "grid": FULL_GRID, "timing_rounds": 10}
    else:
        base = {"problems": default_problems(), "seeds": 3, "grid": FULL_GRID}
    if problems is not None:
        base["problems"] = tuple(check_names("problem", problems, available_problems()))
    if backends is not None:
        from shampoo_conformance.backends import known_backends

        base["backends"] = tuple(check_names("backend", backends, known_backends()))
    if out is not None:
        base["out"] = Path(out)
    if seeds is not None:
        base["seeds"] = check_positive("seeds", seeds)
    if steps is not None:
        base["steps"] = check_positive("steps", steps)
    if config is not None:
        base["config"] = config
    return ReportSettings(**base)  # type: ignore[arg-type]


def load_config(path: Path | str) -> ShampooConfig:
    """The report's Shampoo configuration from a JSON file (``--config``).

    The file holds ``ShampooConfig.to_dict()``'s form, or one key
    ``"from_meta"`` (Meta's ``DistributedShampoo`` keyword arguments, JSON
    form), ``"from_google"`` (Google's ``distributed_shampoo`` arguments) or
    ``"from_tearfree"`` (``{"learning_rate": lr, "options": {...}}``, Google's
    ``TearfreeOptions`` in JSON form), read by the importers: any
    preconditioner, graft, averaging or schedule of the spec runs in the
    report, on every backend that expresses it.
    Raises ValueError naming the file and what is wrong.
    """
    import json

    from shampoo_spec import from_google, from_meta, from_tearfree

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"--config {path}: cannot read a JSON object ({err})") from err
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a JSON object, got {type(data).__name__}")
    try:
        if set(data) == {"from_meta"}:
            return from_meta(data["from_meta"])
        if set(data) == {"from_google"}:
            return from_google(data["from_google"])
        if set(data) == {"from_tearfree"}:
            tearfree = data["from_tearfree"]
            if not isinstance(tearfree, dict) or set(tearfree) - {"learning_rate", "options"}:
                raise ValueError("from_tearfree: expected {\"learning_rate\": a number, "
                                 "\"options\": TearfreeOptions as JSON}")
            return from_tearfree(tearfree.get("options", {}), tearfree["learning_rate"])
        return ShampooConfig.from_dict(data)
    except (ValueError, TypeError, KeyError, NotImplementedError) as err:
        raise ValueError(f"--config {path}: {err}") from err


PRESETS: tuple[str, ...] = ("demo", "quick", "compare", "default", "full")


def check_names(kind: str, names: Sequence[str], valid: Sequence[str]) -> list[str]:
    """``names`` if each is in ``valid`` (duplicates dropped), else ``ValueError`` listing them."""
    out: list[str] = []
    for name in names:
        if name not in valid:
            raise ValueError(
                f"{kind} = {name!r} is invalid: allowed one of {', '.join(valid)}."
            )
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError(f"{kind}s = [] is invalid: allowed at least one of {', '.join(valid)}.")
    return out


def check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} = {value!r} is invalid: allowed an int >= 1.")
    return value
