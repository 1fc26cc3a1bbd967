"""The backend protocol (the backend contract) and the base of our backend classes.

A backend is any object with ``run(config, params, grads, dtype)`` returning
the parameters after each step (:class:`Backend`); for closed-loop training
(the backend report) it may also have ``stepper(optimizer, params, *, lr,
config=None, weight_decay=0.0, dtype)`` returning a :class:`Stepper`.

:class:`BackendBase` is what the backend classes of this package
(the reference's, the registry's framework and third-party ones, the
mutants') share: ``run`` and ``stepper`` written once, their arguments
copied into plain dicts and checked before the backend's own ``_run`` and
``_stepper_factory``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from shampoo_conformance.adapters.inputs import check_stepper_arguments
from shampoo_conformance.compiled_code import release_jax_compilations_if_crowded
from shampoo_spec import ShampooConfig

#: Parameters (or gradients) by name, as a backend returns them.
Params = dict[str, NDArray[Any]]
#: Parameters by name, as the backend contract passes them.
ParamsIn = Mapping[str, NDArray[Any]]
#: One mapping of gradients per step.
GradStream = Sequence[ParamsIn]


@runtime_checkable
class Backend(Protocol):
    """Contract 8.2: run a config over a gradient stream.

    A backend may also declare ``dtypes`` (the parameter dtypes it runs;
    float64 and float32 when absent).
    """

    name: str

    def run(self, config: ShampooConfig, params: ParamsIn, grads: GradStream,
            dtype: Any = np.float64) -> list[Params]:
        """Parameters (numpy arrays, same shapes) after each of ``len(grads)`` steps."""
        ...


@runtime_checkable
class Stepper(Protocol):
    """One optimizer, stepped with NumPy gradients (closed loop).

    ``step(grads)`` applies one step and returns the parameters after it;
    ``last_step_seconds`` is the wall time of the optimizer's own update in
    the last ``step`` (conversions excluded); ``state_bytes()`` the size of
    the optimizer state the backend stores.

    Optional: ``step_with_peak(grads) -> (params, peak_bytes | None)``, one
    untimed step and the most bytes the optimizer held during it (state plus
    temporaries; parameters and gradients excluded). The report shows peak
    memory for the steppers that have it.
    """

    last_step_seconds: float

    def step(self, grads: Mapping[str, NDArray[Any]]) -> Params:
        """One step with ``grads``: the parameters after it."""
        ...

    def state_bytes(self) -> int:
        """Bytes of the optimizer state."""
        ...


#: ``stepper``'s arguments after :class:`BackendBase` checked them: ``(optimizer,
#: params, *, lr, config, weight_decay, dtype)``.
StepperFactory = Callable[..., Stepper]


class BackendBase:
    """``run`` and ``stepper`` of the backend contract with their arguments handled once.

    ``run`` checks ``dtype`` (:meth:`_check_dtype`), then hands ``_run`` the
    parameters as a dict and the gradients as a list of dicts; ``stepper``
    asks :meth:`_stepper_factory` for the backend's constructor (which may
    refuse the dtype, or say there is none), checks the optimizer name, the
    config and the weight decay, then calls it with the parameters as a dict.
    """

    name: str

    def run(self, config: ShampooConfig, params: ParamsIn, grads: GradStream,
            dtype: Any = np.float64) -> list[Params]:
        """Parameters (numpy arrays, same shapes) after each of ``len(grads)`` steps."""
        self._check_dtype(dtype)
        try:
            return self._run(config, dict(params), [dict(g) for g in grads], dtype)
        finally:
            # A session of many runs would otherwise exhaust vm.max_map_count (JAX).
            release_jax_compilations_if_crowded()

    def stepper(self, optimizer: str, params: ParamsIn, *, lr: float,
                config: ShampooConfig | None = None, weight_decay: float = 0.0,
                dtype: Any = np.float64) -> Stepper:
        """``optimizer`` (``"shampoo"`` with ``config``, or ``"adamw"``) at learning rate
        ``lr``, stepped one gradient at a time."""
        make = self._stepper_factory(dtype)
        check_stepper_arguments(optimizer, config, weight_decay)
        return make(optimizer, dict(params), lr=lr, config=config,
                    weight_decay=weight_decay, dtype=dtype)

    def _check_dtype(self, dtype: Any) -> None:
        """Raise for a ``dtype`` the backend never runs (here: none; ``_run`` checks)."""

    def _run(self, config: ShampooConfig, params: Params, grads: list[Params],
             dtype: Any) -> list[Params]:
        raise NotImplementedError

    def _stepper_factory(self, dtype: Any) -> StepperFactory:
        raise NotImplementedError
