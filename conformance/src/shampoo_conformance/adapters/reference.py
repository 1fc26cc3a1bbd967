"""The reference backend: the float64 NumPy oracle behind the backend contract.

``run`` (open loop), ``trajectory`` (closed loop: each gradient computed at
the current parameters) and ``stepper`` (``"shampoo"`` or the NumPy AdamW of
:mod:`shampoo_conformance.adapters.first_order`, one step at a time, timed). Float64
only, by design.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from shampoo_conformance.protocol import BackendBase, Params, Stepper, StepperFactory
from shampoo_spec import ShampooConfig


class _ReferenceStepper:
    """:class:`ReferenceShampoo` or the NumPy :class:`~.first_order.AdamW`, timed per step."""

    def __init__(self, optimizer: Any) -> None:
        self._optimizer = optimizer
        self.last_step_seconds = float("nan")

    def step(self, grads: Mapping[str, NDArray[Any]]) -> Params:
        start = time.perf_counter()
        out: Params = self._optimizer.step(dict(grads))
        self.last_step_seconds = time.perf_counter() - start
        return out

    def state_bytes(self) -> int:
        state_bytes = getattr(self._optimizer, "state_bytes", None)
        if state_bytes is not None:
            return int(state_bytes())
        return _array_bytes(self._optimizer.state)


def _array_bytes(tree: Any) -> int:
    """Bytes of every NumPy array in nested dicts, lists and dataclasses."""
    if isinstance(tree, np.ndarray):
        return int(tree.nbytes)
    if isinstance(tree, dict):
        return sum(_array_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_array_bytes(v) for v in tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return sum(_array_bytes(getattr(tree, f.name)) for f in dataclasses.fields(tree))
    return 0


class ReferenceBackend(BackendBase):
    """The float64 NumPy reference (``shampoo_reference``)."""

    name = "reference"
    dtypes = (np.float64,)

    def _run(self, config: ShampooConfig, params: Params, grads: list[Params],
             dtype: Any) -> list[Params]:
        from shampoo_reference import run

        return run(config, params, grads)

    def trajectory(
        self,
        config: ShampooConfig,
        params: Mapping[str, NDArray[Any]],
        grad_fn: Callable[[Params], Mapping[str, NDArray[Any]]],
        steps: int,
        dtype: Any = np.float64,
    ) -> list[Params]:
        """Closed-loop run: the gradient of each step is ``grad_fn(current params)``."""
        self._check_dtype(dtype)
        from shampoo_reference import ReferenceShampoo

        opt = ReferenceShampoo(config, dict(params))
        current = {k: v.copy() for k, v in opt.params.items()}
        out = []
        for _ in range(steps):
            current = opt.step(dict(grad_fn(current)))
            out.append(current)
        return out

    def _stepper_factory(self, dtype: Any) -> StepperFactory:
        self._check_dtype(dtype)
        return self._new_stepper

    @staticmethod
    def _new_stepper(optimizer: str, params: Params, *, lr: float, config: ShampooConfig | None,
                     weight_decay: float, dtype: Any) -> Stepper:
        """``"shampoo"``: :class:`ReferenceShampoo` with ``config`` at learning rate
        ``lr``; ``"adamw"``: :class:`~.first_order.AdamW` (float64 NumPy)."""
        if optimizer == "adamw":
            from shampoo_conformance.adapters.first_order import AdamW

            return _ReferenceStepper(AdamW(params, lr=lr, weight_decay=weight_decay))
        from shampoo_reference import ReferenceShampoo

        config = ShampooConfig() if config is None else config
        config = dataclasses.replace(config, learning_rate=lr)
        return _ReferenceStepper(ReferenceShampoo(config, params))

    #: The registry's user-run hooks (thirdparty/registry.py): a user of the reference
    #: writes ``ReferenceShampoo(ShampooConfig(**kwargs), params)``; the learning rate
    #: is the one argument a user sets (eq. 2's lr).
    USER_KWARGS: dict[str, Any] = {"learning_rate": 1e-2}

    @staticmethod
    def defaults_config() -> ShampooConfig:
        """``ShampooConfig()`` at :attr:`USER_KWARGS`'s learning rate: the reference itself."""
        return ShampooConfig(**ReferenceBackend.USER_KWARGS)

    def library_run(self, kwargs: dict[str, Any], params: Params, grads: list[Params],
                    dtype: Any) -> Any:
        """``ReferenceShampoo(ShampooConfig(**kwargs), params)`` stepped with the caller's
        own gradient arrays: a :class:`~shampoo_conformance.thirdparty.registry.LibraryRun`."""
        from shampoo_conformance.thirdparty.registry import LibraryRun
        from shampoo_reference import ReferenceShampoo

        self._check_dtype(dtype)
        opt = ReferenceShampoo(ShampooConfig(**kwargs), dict(params))
        out, seen = [], []
        for step in grads:
            given = {n: np.asarray(g, dtype=np.float64) for n, g in step.items()}
            out.append({n: np.array(v) for n, v in opt.step(given).items()})
            seen.append({n: g.copy() for n, g in given.items()})
        return LibraryRun(params=out, grads=seen)

    def _check_dtype(self, dtype: Any) -> None:
        if np.dtype(dtype) != np.float64:
            raise ValueError(
                f"dtype = {np.dtype(dtype)} is invalid for the reference backend: "
                "allowed float64 (the reference is exact float64 by design)."
            )
