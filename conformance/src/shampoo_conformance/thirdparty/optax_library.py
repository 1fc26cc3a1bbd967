"""A user's run of an optax library (the registry's ``library_run``), shared by the
adapters of JAX libraries (Google's, tearfree, optax-shampoo, optax.contrib.muon)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

from shampoo_conformance.thirdparty.registry import LibraryRun


def optax_library_run(
    transformation: optax.GradientTransformation,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: Any,
) -> LibraryRun:
    """``transformation`` stepped as a user steps it: ``state = init(params)``, then
    ``updates, state = update(grads, state, params)`` and ``optax.apply_updates``
    per step, unjitted, in 64-bit JAX exactly for float64 (a user of float64 turns it
    on); the parameters after each step in the dtype the library left them, and the
    gradient arrays given to ``update`` as the caller holds them after it.
    """
    key = np.dtype(dtype)
    names = sorted(params)
    with jax.enable_x64(bool(key == np.float64)), jax.default_device(jax.devices("cpu")[0]):
        p = {n: jax.numpy.asarray(np.asarray(params[n], dtype=key)) for n in names}
        state = transformation.init(p)
        out, seen = [], []
        for step in grads:
            g = {n: jax.numpy.asarray(np.asarray(step[n], dtype=key)) for n in names}
            updates, state = transformation.update(g, state, p)
            p = optax.apply_updates(p, updates)
            out.append({n: np.array(v) for n, v in p.items()})
            seen.append({n: np.array(v) for n, v in g.items()})
    return LibraryRun(params=out, grads=seen)
