"""Save and restore a :class:`ShampooState` as plain NumPy arrays (no pickle).

``state_to_arrays`` flattens the state pytree to a list of NumPy arrays in
``jax.tree.flatten`` order; ``state_from_arrays`` puts them back into the
structure of a freshly initialised state (``opt.init(params)``). The round
trip is bit-identical, so training resumes exactly (tests/test_checkpoint.py).
Store the list with ``numpy.savez`` and load it with ``numpy.load``
(``allow_pickle=False``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def state_to_arrays(state: Any) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def state_from_arrays(arrays: list[np.ndarray], like: Any) -> Any:
    """Rebuild a state with the structure (and dtypes) of ``like`` from ``arrays``."""
    leaves, treedef = jax.tree.flatten(like)
    if len(leaves) != len(arrays):
        raise ValueError(
            f"len(arrays) = {len(arrays)} is invalid: the state has {len(leaves)} arrays."
        )
    out = []
    for i, (ref, arr) in enumerate(zip(leaves, arrays, strict=True)):
        if tuple(ref.shape) != tuple(arr.shape) or np.dtype(ref.dtype) != arr.dtype:
            raise ValueError(
                f"array {i} has shape {arr.shape} and dtype {arr.dtype}; the state needs "
                f"{tuple(ref.shape)} {np.dtype(ref.dtype)}."
            )
        out.append(jnp.asarray(arr))
    return jax.tree.unflatten(treedef, out)


__all__ = ["state_from_arrays", "state_to_arrays"]
