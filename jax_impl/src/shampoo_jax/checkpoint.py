"""Save and restore a :class:`ShampooState` as plain NumPy arrays (no pickle).

``state_to_arrays`` flattens the state pytree to a list of NumPy arrays in
``jax.tree.flatten`` order; ``state_from_arrays`` puts them back into the
structure of a freshly initialised state (``opt.init(params)``). The round
trip is bit-identical, so training resumes exactly (tests/test_checkpoint.py).
Store the list with ``numpy.savez`` and load it with ``numpy.load``
(``allow_pickle=False``).

The arrays are positional (``jax.tree.flatten`` order of the NamedTuples'
fields), never keyed by field name, so renaming a field keeps old
checkpoints loadable: ``BlockGroupState.inverse_roots`` (called ``roots``
before) is still the second field of each block group, and checkpoints
written before the rename load unchanged (tests/test_state.py).

Sharded states (:mod:`shampoo_jax.sharded`) are saved in the single-device
layout: ``sharded_state_to_arrays`` drops the padding, so the arrays equal
those of the same state on one device, and ``sharded_state_from_arrays``
pads and places them for any device count. A state saved on N devices
resumes on N' (or on one device with ``state_from_arrays``) exactly.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .sharded import ShardingConfig, shard_state, unshard_state


def state_to_arrays(state: Any) -> list[np.ndarray]:
    """The state's arrays as NumPy, in ``jax.tree.flatten`` order (the checkpoint format)."""
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


def sharded_state_to_arrays(
    state: Any, like: Any, sharding: ShardingConfig
) -> list[np.ndarray]:
    """A state sharded by ``sharding`` -> the arrays of the single-device layout.

    ``like``: the single-device state or its shapes,
    ``jax.eval_shape(shampoo(config).init, params)``. Padding is dropped.
    """
    return state_to_arrays(unshard_state(state, like, sharding))


def sharded_state_from_arrays(
    arrays: list[np.ndarray], like: Any, sharding: ShardingConfig, params: Any | None = None
) -> Any:
    """Single-device-layout arrays -> a state padded and placed for ``sharding``.

    ``like`` as in :func:`sharded_state_to_arrays`; ``params`` (optional):
    elementwise states take their NamedShardings.
    """
    return shard_state(state_from_arrays(arrays, like), sharding, params)


__all__ = [
    "sharded_state_from_arrays",
    "sharded_state_to_arrays",
    "state_from_arrays",
    "state_to_arrays",
]
