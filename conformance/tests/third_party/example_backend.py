"""A third-party backend, as a user would write one: named on the command line
as ``example_backend:make`` (or ``example_backend:make_broken``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from shampoo_reference import ReferenceShampoo


class ExampleBackend:
    """Someone's own Shampoo: here, the reference driven step by step."""

    name = "example"
    dtypes = (np.float64,)

    def run(self, config: Any, params: Any, grads: Any, dtype: Any = np.float64) -> list[Any]:
        opt = ReferenceShampoo(config, dict(params))
        return [opt.step(dict(g)) for g in grads]


class BrokenBackend(ExampleBackend):
    """Forgets the learning rate's sign: every property about trajectories must fail."""

    name = "broken"

    def run(self, config: Any, params: Any, grads: Any, dtype: Any = np.float64) -> list[Any]:
        out = super().run(config, params, grads, dtype)
        return [{k: 2 * params[k] - v for k, v in step.items()} for step in out]


def make() -> ExampleBackend:
    return ExampleBackend()


def make_broken() -> BrokenBackend:
    return BrokenBackend()
