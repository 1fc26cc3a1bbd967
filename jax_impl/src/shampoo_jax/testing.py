"""NumPy in, NumPy out: contract 8.2 for the conformance adapter.

``run(config, params, grads, dtype)`` runs the jitted Shampoo update on the
CPU in ``dtype`` (float32 or float64; float64 enables x64 for the call) with
``factor_dtype`` forced to match, and returns the parameters after each
step. Policies that raise in the reference (``failure.nonfinite_gradient =
"raise"``, ``max_consecutive_root_failures``) raise here too, between
steps, through :func:`shampoo_jax.check_state`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import optax

from shampoo_spec import ShampooConfig

from .transform import check_state, shampoo

_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.float64): "float64"}


def run(
    config: ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: Any = np.float64,
) -> list[dict[str, np.ndarray]]:
    dt = np.dtype(dtype)
    if dt not in _DTYPES:
        raise ValueError(f"dtype = {dt} is invalid for the jax backend: allowed float32, float64.")
    names = sorted(params)
    for t, g in enumerate(grads, start=1):
        if set(g) != set(params):
            raise ValueError(
                f"grads of step {t} have keys {sorted(g)}; the parameters are {names}."
            )
        for k in names:
            if np.shape(g[k]) != np.shape(params[k]):
                raise ValueError(
                    f"gradient of {k!r} at step {t} has shape {np.shape(g[k])}, "
                    f"parameter has {np.shape(params[k])}."
                )
    config = dataclasses.replace(config, factor_dtype=_DTYPES[dt])
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(dt == np.float64), jax.default_device(cpu):
        opt = shampoo(config)

        @jax.jit
        def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        p = {k: jax.numpy.asarray(np.asarray(params[k], dtype=dt)) for k in names}
        s = jax.jit(opt.init)(p)
        out = []
        for g in grads:
            gj = {k: jax.numpy.asarray(np.asarray(g[k], dtype=dt)) for k in names}
            p, s_new = step(p, s, gj)
            check_state(s_new, config, previous=s)
            s = s_new
            out.append({k: np.array(v) for k, v in p.items()})
    return out


__all__ = ["run"]
