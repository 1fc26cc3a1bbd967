"""PNG plots of the report (matplotlib, Agg backend, imported only when plotting).

One figure per problem: a panel per backend that trained, loss against
step on a log axis, for Shampoo and AdamW at their tuned learning rates:
the median over seeds as a line and the min-max range as a band, the
target loss as a dashed line (and the known minimum when it is above 0).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .collect import ProblemInfo, Report
from .convergence import ConvergenceResult, OptimizerRun

COLORS = {"shampoo": "#1f5fa8", "adamw": "#d9661f"}
LABELS = {"shampoo": "Shampoo", "adamw": "AdamW"}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as err:
        raise RuntimeError(
            "the report's plots need matplotlib: pip install 'shampoo-conformance[report]' "
            "(or pip install matplotlib); or pass --no-plots"
        ) from err
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def band(run: OptimizerRun) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Median, min and max loss over seeds at each step (NaN where every seed diverged)."""
    losses = np.array([c.losses for c in run.curves], dtype=np.float64)
    with np.errstate(all="ignore"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return (np.nanmedian(losses, axis=0), np.nanmin(losses, axis=0),
                    np.nanmax(losses, axis=0))


def _panel(ax: Any, c: ConvergenceResult, info: ProblemInfo, start: int | None) -> None:
    steps = np.arange(c.steps + 1)
    if start is not None and 1 < start < c.steps:
        ax.axvline(start, color="0.6", ls=":", lw=1,
                   label=f"Shampoo preconditions from step {start}")
    for run in (c.adamw, c.shampoo):  # Shampoo drawn last: it equals AdamW before its start
        median, low, high = band(run)
        positive = np.where(median > 0, median, np.nan)
        label = f"{LABELS[run.optimizer]} (lr {run.lr:g})"
        ax.plot(steps, positive, color=COLORS[run.optimizer], lw=2, label=label)
        if len(run.curves) > 1:
            ax.fill_between(steps, np.where(low > 0, low, np.nan), high,
                            color=COLORS[run.optimizer], alpha=0.2, lw=0)
    if info.target_loss is not None and info.target_loss > 0:
        seed0 = " (seed 0)" if c.seeds > 1 else ""
        ax.axhline(info.target_loss, color="0.3", ls="--", lw=1,
                   label=f"target{seed0} {info.target_loss:.3g}")
    if info.loss_floor is not None and info.loss_floor > 0:
        ax.axhline(info.loss_floor, color="0.5", ls=":", lw=1,
                   label=f"minimum {info.loss_floor:.3g}")
    ax.set_yscale("log")
    ax.set_xlim(0, c.steps)
    ax.set_xlabel("step")
    ax.set_title(f"{c.backend} ({c.dtype})", fontsize=11)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=9, loc="best", framealpha=0.9)


def plot_convergence(report: Report, out_dir: Path) -> list[str]:
    """Write one PNG per problem with convergence results; their file names."""
    plt = _pyplot()
    names = []
    for info in report.problems:
        runs = [c for c in report.convergence if c.problem == info.name]
        if not runs:
            continue
        fig, axes = plt.subplots(1, len(runs), figsize=(4.6 * len(runs) + 0.6, 4.0),
                                 sharey=True, squeeze=False)
        for ax, c in zip(axes[0], runs, strict=True):
            _panel(ax, c, info, report.settings.config.schedule.start_preconditioning_step)
        axes[0][0].set_ylabel("training loss (full batch)")
        seeds = runs[0].seeds
        fig.suptitle(
            f"{info.name}: median over {seeds} seed{'s' if seeds > 1 else ''}"
            + (", band = min-max" if seeds > 1 else ""),
            fontsize=12,
        )
        fig.tight_layout()
        name = f"convergence_{info.name}.png"
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        names.append(name)
    return names
