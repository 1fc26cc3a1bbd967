"""``python -m shampoo_conformance compare``: one config through every backend.

Prints, for each installed backend and dtype, the largest error relative to
the reference over the run (relative to the parameters' total displacement),
the relative tolerance derived for it, and the verdict of the suite's own
check (:func:`~shampoo_conformance.suite.divergence.first_divergence`), which also
allows for the rounding of the parameters themselves (docs/spec.md
section 5): with a small learning rate that term dominates early steps in
float32, so a relative error above ``rtol`` can still be within tolerance.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from numpy.typing import NDArray

from shampoo_conformance.backends import BackendUnavailable, available_backends, get_backend
from shampoo_conformance.suite.cases import CASE_SHAPES, make_problem, named_cases
from shampoo_conformance.suite.divergence import first_divergence
from shampoo_conformance.suite.tolerances import trajectory_bound
from shampoo_reference import run as reference_run
from shampoo_spec import ShampooConfig


def load_config(path: str | None) -> ShampooConfig:
    if path is None:
        # A well-conditioned default (epsilon 1e-3, AdaGrad grafting, blocks of 4):
        # Shampoo's own default epsilon of 1e-12 makes kappa, and so the bound, huge.
        return next(c.config for c in named_cases() if c.name == "adagrad_graft_block_norm")
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--config {path!r}: cannot read a JSON config: {err}") from err
    return ShampooConfig.from_dict(data)


def max_relative_error(
    ours: Sequence[Mapping[str, NDArray[Any]]],
    ref: Sequence[Mapping[str, NDArray[Any]]],
    w0: Mapping[str, NDArray[Any]],
) -> float:
    worst = 0.0
    for a, b in zip(ours, ref, strict=True):
        for k in b:
            moved = np.linalg.norm(b[k] - w0[k]) or 1.0
            worst = max(worst, float(np.linalg.norm(np.asarray(a[k], np.float64) - b[k]) / moved))
    return worst


def compare(
    config: ShampooConfig,
    steps: int,
    seed: int,
    backends: list[str] | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Print the error table; status 1 if an installed backend is out of tolerance."""
    params, grads = make_problem(CASE_SHAPES, steps, seed)
    ref = reference_run(config, params, grads)
    status = 0
    print(
        f"{'backend':26s} {'dtype':8s} {'max rel. error':>15s} {'rtol':>11s} "
        f"{'kappa':>9s}  verdict",
        file=out,
    )
    for name in backends or available_backends():
        try:
            backend = get_backend(name)
        except BackendUnavailable:
            print(f"{name:26s} {'-':8s} {'-':>15s} {'-':>11s} {'-':>9s}  not installed", file=out)
            continue
        for dtype in getattr(backend, "dtypes", (np.float64, np.float32)):
            bound = trajectory_bound(config, params, grads, dtype)
            ours = backend.run(config, params, grads, dtype=dtype)
            err = max_relative_error(ours, ref, params)
            divergence = first_divergence(ours, ref, params, bound)
            status |= divergence is not None
            verdict = (
                "ok"
                if divergence is None
                else f"OUT OF TOLERANCE from step {divergence.step}"
            )
            dname = np.dtype(dtype).name
            print(
                f"{name:26s} {dname:8s} {err:15.3e} {bound.rtol:11.3e} {bound.kappa:9.2e}  "
                f"{verdict}",
                file=out,
            )
    return status
