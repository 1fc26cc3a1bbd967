"""Where a backend's trajectory leaves the reference's tolerance, and why.

The check the property suite and the report share (the ``compare`` command
of :mod:`.compare` prints it as a table). A failure message is a standalone
reproduction: the config as JSON, the shapes, the seed, the dtype, the first
step where the backend leaves the tolerance, and the per-parameter errors at
that step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import DTypeLike, NDArray

from shampoo_conformance.protocol import Backend
from shampoo_conformance.suite.tolerances import Bound, bound_and_reference
from shampoo_spec import ShampooConfig

Params = Mapping[str, NDArray[Any]]


@dataclass(frozen=True)
class Divergence:
    """Where and by how much a trajectory left its tolerance."""

    step: int
    errors: dict[str, tuple[float, float]]  # name -> (error, allowed)

    def describe(self) -> str:
        rows = [
            f"    {name}: |backend - reference| = {err:.3e} > allowed {allowed:.3e}"
            for name, (err, allowed) in self.errors.items()
        ]
        return f"first divergence at step {self.step}:\n" + "\n".join(rows)


def first_divergence(
    ours: Sequence[Params], ref: Sequence[Params], w0: Params, bound: Bound
) -> Divergence | None:
    """The first step at which some parameter is outside ``bound``, or None.

    Each step's rounding is made at the scale of that step and of the parameter
    then (spec section 5), so step t allows ``bound.rtol`` times the reference's
    path length up to t, sum_s ||W_s - W_(s-1)||, and ``bound.atol_scale`` times
    ||W_0|| plus the largest ||W_s|| so far: a trajectory that moves out and back
    (a net displacement far below its steps) still gets its steps' rounding.
    """
    if len(ours) != len(ref):
        return Divergence(len(ours), {"<steps>": (float(len(ours)), float(len(ref)))})
    previous = {name: np.asarray(w, dtype=np.float64) for name, w in w0.items()}
    path = dict.fromkeys(previous, 0.0)
    largest = dict.fromkeys(previous, 0.0)
    for t, (a, b) in enumerate(zip(ours, ref, strict=True), start=1):
        bad = {}
        for name, want in b.items():
            got = np.asarray(a[name], dtype=np.float64)
            if got.shape != want.shape:
                bad[name] = (float("inf"), 0.0)
                continue
            path[name] += float(np.linalg.norm(want - previous[name]))
            largest[name] = max(largest[name], float(np.linalg.norm(want)))
            previous[name] = np.asarray(want, dtype=np.float64)
            err = float(np.linalg.norm(got - want)) if np.all(np.isfinite(got)) else float("inf")
            allowed = bound.allowed(float(np.linalg.norm(w0[name])), largest[name], path[name])
            if not err <= allowed:
                bad[name] = (err, allowed)
        if bad:
            return Divergence(t, bad)
    return None


def reproduction(
    config: ShampooConfig,
    shapes: Mapping[str, tuple[int, ...]],
    steps: int,
    seed: int | None,
    dtype: DTypeLike,
    backend: str,
) -> str:
    """Text that lets anyone rerun the failing case without the suite."""
    return (
        f"backend: {backend}\ndtype: {np.dtype(dtype).name}\nsteps: {steps}\nseed: {seed}\n"
        f"shapes: {json.dumps({k: list(v) for k, v in shapes.items()})}\n"
        f"config: {json.dumps(config.to_dict(), sort_keys=True)}\n"
        "rerun: python -m shampoo_conformance compare --config CONFIG.json "
        f"--steps {steps} --seed {seed}"
    )


def assert_matches_reference(
    backend: Backend,
    config: ShampooConfig,
    params: dict[str, NDArray[np.float64]],
    grads: list[dict[str, NDArray[np.float64]]],
    dtype: DTypeLike = np.float64,
    seed: int | None = None,
) -> Bound:
    """Run both and raise AssertionError with a reproduction on divergence."""
    bound, ref = bound_and_reference(config, params, grads, dtype)
    ours = backend.run(config, params, grads, dtype=dtype)
    div = first_divergence(ours, ref, params, bound)
    if div is not None:
        shapes = {k: tuple(v.shape) for k, v in params.items()}
        raise AssertionError(
            f"backend {backend.name!r} diverges from the reference "
            f"(kappa <= {bound.kappa:.3g}, max factor dim {bound.max_dim}, "
            f"rtol {bound.rtol:.3g}).\n{div.describe()}\n"
            + reproduction(config, shapes, len(grads), seed, dtype, backend.name)
        )
    return bound
