"""The :class:`Problem` record shared by every problem in the registry."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

Array = NDArray[np.float64]
Params = Mapping[str, Array]
LossFn = Callable[[Params], float]
GradFn = Callable[[Params], dict[str, Array]]
MetricsFn = Callable[[Params], dict[str, float]]


@dataclass(frozen=True, eq=False, kw_only=True)
class Problem:
    """A full-batch, deterministic minimization problem ``min_theta f(theta)``.

    ``theta`` is a mapping from parameter names to float64 arrays (the same
    shape of data that ``backend.run`` takes). ``loss(theta)`` returns
    ``f(theta)`` as a Python float and ``grad(theta)`` returns the exact
    gradient ``df/dtheta`` as a new dict of float64 arrays with the shapes of
    ``init_params``. Both are pure: they never modify their argument.

    ``init_params`` holds read-only arrays (so one problem can be shared
    safely); use :meth:`copy_init_params` for writable copies.
    ``target_loss`` is the loss at which a benchmark counts the problem as
    solved (``None`` when there is no such agreed level); ``optimum`` and
    ``loss_floor`` are the minimizer and the minimum where they are known
    (``loss_floor`` may also be a population-level floor that the finite
    training set does not enforce; each problem's description says which).
    ``metrics(theta)``, where given, returns problem-specific figures such as
    the training accuracy, keyed by name (``None`` when the problem has none).
    """

    name: str
    init_params: dict[str, Array]
    loss: LossFn
    grad: GradFn
    target_loss: float | None
    description: str
    optimum: dict[str, Array] | None = None
    loss_floor: float | None = None
    data: Mapping[str, Array] = field(default_factory=dict)
    metrics: MetricsFn | None = None

    def copy_init_params(self) -> dict[str, Array]:
        """Writable float64 copies of ``init_params``."""
        return {k: np.array(v, dtype=np.float64, copy=True) for k, v in self.init_params.items()}


def read_only(array: Array) -> Array:
    """A float64, C-contiguous, non-writable copy of ``array``."""
    out = np.array(array, dtype=np.float64, order="C", copy=True)
    out.setflags(write=False)
    return out


def linear_model_start(seed: int, n_features: int, init_scale: float) -> dict[str, Array]:
    """Start of a linear model ``X w + b``: ``w ~ init_scale * N(0, I)`` (``seed``), ``b = 0``."""
    rng = np.random.default_rng(seed)
    return {
        "w": read_only(init_scale * rng.standard_normal(n_features)),
        "b": read_only(np.zeros(1)),
    }


def check_params(problem_name: str, params: Params, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raise ``ValueError`` unless ``params`` has exactly the expected names and shapes."""
    if not isinstance(params, Mapping):
        raise ValueError(
            f"{problem_name}: params must be a mapping of name -> array, "
            f"got {type(params).__name__}"
        )
    if set(params) != set(shapes):
        raise ValueError(
            f"{problem_name}: params has names {sorted(params)}, expected {sorted(shapes)}"
        )
    for key, shape in shapes.items():
        got = np.shape(params[key])
        if got != shape:
            raise ValueError(f"{problem_name}: params[{key!r}] has shape {got}, expected {shape}")
