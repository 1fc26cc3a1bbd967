"""The input checks of the backend contract's ``run(config, params, grads, dtype)`` and ``stepper``.

Every backend adapter of this package (reference, torch, torch_ddp, jax,
jax_sharded) takes the same inputs, so it rejects bad ones with the same
words: one function, here. Arrays are read only through ``numpy.shape``
(a 0-d parameter may be a Python float, a 1-d one a list), so any
framework's arrays, or plain NumPy inputs, are checked alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

#: Parameter dtypes the framework adapters run (the reference is float64 only).
RUN_DTYPES = ("float32", "float64")

#: Optimizers a closed-loop ``stepper`` builds (the backend report's pair).
STEPPER_OPTIMIZERS = ("shampoo", "adamw")


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in np.shape(x))


def check_run_inputs(
    backend: str,
    params: Mapping[str, Any],
    grads: Sequence[Mapping[str, Any]],
    dtype_name: str,
) -> None:
    """Raise ``ValueError`` naming the problem unless the inputs fit the backend contract.

    ``dtype_name`` must be one of :data:`RUN_DTYPES`; every step of ``grads``
    must have exactly the parameters' names, each gradient the shape of its
    parameter.
    """
    if dtype_name not in RUN_DTYPES:
        raise ValueError(
            f"dtype = {dtype_name} is invalid for the {backend} backend: "
            f"allowed {', '.join(RUN_DTYPES)}."
        )
    names = sorted(params)
    for t, step in enumerate(grads, start=1):
        if set(step) != set(params):
            raise ValueError(
                f"grads of step {t} have keys {sorted(step)}; the parameters are {names}."
            )
        for name in names:
            got, want = _shape(step[name]), _shape(params[name])
            if got != want:
                raise ValueError(
                    f"gradient of {name!r} at step {t} has shape {got}, parameter has {want}."
                )


def check_stepper_arguments(optimizer: object, config: object, weight_decay: float) -> None:
    """Raise ``ValueError`` naming the argument unless a ``stepper`` call is consistent.

    ``optimizer`` is one of :data:`STEPPER_OPTIMIZERS`; Shampoo takes its
    weight decay from its config (``weight_decay`` stays 0); AdamW has no
    config (``config`` stays None).
    """
    if optimizer not in STEPPER_OPTIMIZERS:
        raise ValueError(
            f"optimizer = {optimizer!r} is invalid: allowed one of {STEPPER_OPTIMIZERS}."
        )
    if optimizer == "shampoo" and weight_decay != 0.0:
        raise ValueError(
            f"weight_decay = {weight_decay!r} is invalid for 'shampoo': allowed 0.0 "
            "(Shampoo's weight decay is config.weight_decay)."
        )
    if optimizer == "adamw" and config is not None:
        raise ValueError("config is invalid for 'adamw': allowed None (AdamW has no config).")
