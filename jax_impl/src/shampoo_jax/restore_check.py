"""The config check of a restore through a pytree checkpointer (Orbax), sharded or not.

A :class:`ShampooState` is a pytree of arrays, so any pytree checkpointer
saves and restores it as it is (Orbax's ``StandardCheckpointer``, a sharded
state included: restored onto a target with the same ``NamedSharding``\\ s,
the run continues bit for bit). What such a checkpointer does not save is
the static part of the state (``ShampooState.info``,
:class:`shampoo_jax.state.ParameterInfo`): the config the state was made
under, its parameters' paths and shapes, the block placement of a sharded
state. On restore that part comes from the restore target, so a state saved
under another config (a learning rate, a beta2, an epsilon: fields that do
not change any array's shape) would be restored silently, and one saved for
other shapes or another device count fails deep inside the checkpointer.

:func:`checkpoint_metadata` writes that static part as a small JSON-able
dict, to save next to the state (Orbax: ``save(path, state,
custom_metadata={"shampoo": checkpoint_metadata(state)})``), and
:func:`check_restored` compares it with the restore target before restoring
(Orbax: ``checkpointer.metadata(path).custom_metadata["shampoo"]``), raising
``ValueError`` that names every config field that differs
(``shampoo_spec.config_differences``, as ``shampoo_torch``'s loader and
:func:`shampoo_jax.state_from_arrays` do), every parameter whose path or shape
differs, or a block placement of another device count (the padded stacks of
:mod:`shampoo_jax.sharded`). To resume under a changed config on purpose,
replace the entry: ``metadata["states"][i]["config"] = new_config.to_dict()``.

The metadata is plain JSON (no arrays, no pickle) and holds, per Shampoo
state in the pytree (in tree order, as :mod:`shampoo_jax.checkpoint`): the
config (``config.to_dict()``), the parameters' paths and shapes, the padded
stack size of each block group (the leading axis of eq. 6's factors) and,
sharded, the slot of each real block in its stack.
"""

from __future__ import annotations

import json
from typing import Any

from shampoo_spec import ShampooConfig, config_differences

from .checkpoint import _shampoo_states
from .state import ShampooState

#: The ``"format"`` entry of :func:`checkpoint_metadata`'s dict.
METADATA_FORMAT = "shampoo_jax.checkpoint_metadata/1"


def _describe(state: ShampooState, what: str) -> dict[str, Any]:
    info = state.info
    if info is None or info.config is None:
        raise ValueError(
            f"{what} carries no config (not made by shampoo(config).init): "
            "pass a state, or its shapes (jax.eval_shape), made by shampoo(config).init."
        )
    return {
        "config": json.loads(info.config),
        "parameters": [[p, list(s)] for p, s in zip(info.paths, info.shapes, strict=True)],
        "stacks": [int(g.statistics_updates.shape[0]) for g in state.groups],
        "slots": None if info.slots is None else [list(s) for s in info.slots],
    }


def _states(tree: Any, what: str) -> list[dict[str, Any]]:
    found = [_describe(s, what) for s in _shampoo_states(tree)]
    if not found:
        raise ValueError(f"{what} holds no ShampooState (made by shampoo(config).init).")
    return found


def checkpoint_metadata(state: Any) -> dict[str, Any]:
    """What a pytree checkpointer does not save of ``state``: a JSON-able dict.

    ``state``: a :class:`ShampooState` made by ``shampoo(config).init`` (or
    ``shampoo(config, sharding=...).init``), or a pytree holding them (an
    ``optax.chain`` state, a dict of parameters and optimizer state, a Flax
    NNX ``nnx.Optimizer``'s ``opt_state``). Save it with the state (Orbax:
    ``custom_metadata``) and pass it to :func:`check_restored` before restoring.
    """
    return {"format": METADATA_FORMAT, "states": _states(state, "the state")}


def check_restored(metadata: Any, like: Any) -> None:
    """Raise ``ValueError`` unless a state saved with ``metadata`` may be restored as ``like``.

    ``metadata``: :func:`checkpoint_metadata`'s dict of the saved state (as
    saved, or after a JSON round trip). ``like``: the restore target (the
    state of the run that resumes, made by its ``shampoo(config).init``, or
    its shapes: ``jax.eval_shape``, ``orbax.checkpoint.utils.to_shape_dtype_struct``),
    or the restored state (it carries the target's static part). The error
    names every config field that differs (``section.field: saved -> current``),
    the parameters of another path or shape, or the device count of another
    block placement; the config is checked first.
    """
    if not isinstance(metadata, dict) or metadata.get("format") != METADATA_FORMAT:
        found = metadata.get("format") if isinstance(metadata, dict) else type(metadata).__name__
        raise ValueError(
            f"metadata (format {found!r}) is invalid: allowed the dict of "
            f"shampoo_jax.checkpoint_metadata (format {METADATA_FORMAT!r})."
        )
    saved, current = metadata.get("states"), _states(like, "like")
    if not isinstance(saved, list) or len(saved) != len(current):
        count = len(saved) if isinstance(saved, list) else saved
        raise ValueError(
            f"the checkpoint holds {count} Shampoo states; like holds {len(current)}: "
            "restore onto the structure the checkpoint was saved from."
        )
    for i, (a, b) in enumerate(zip(saved, current, strict=True)):
        which = f" (Shampoo state {i})" if len(saved) > 1 else ""
        try:
            config = ShampooConfig.from_dict(a["config"])
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"the checkpoint's config{which} is invalid: {e}") from e
        diffs = config_differences(config, ShampooConfig.from_dict(b["config"]))
        if diffs:
            raise ValueError(
                f"the checkpoint was saved under another config{which}; fields that differ "
                f"(saved -> current): {'; '.join(diffs)}."
            )
        _check_parameters(a.get("parameters"), b["parameters"], which)
        if a.get("stacks") != b["stacks"] or a.get("slots") != b["slots"]:
            raise ValueError(
                f"the checkpoint's block placement{which} is {_placement(a)}; like's is "
                f"{_placement(b)}: a sharded state restores onto a mesh with as many devices "
                "along the sharding axis (the stacks are padded to a multiple of that count); "
                "to change it, save with sharded_state_to_arrays (the single-device layout) "
                "and load with sharded_state_from_arrays."
            )


def _check_parameters(saved: Any, current: list[list[Any]], which: str) -> None:
    """Same parameter paths, in the same order, with the same shapes; else name the differences."""
    if saved == current:
        return
    try:
        before = {str(p): tuple(s) for p, s in saved}
    except (TypeError, ValueError) as e:
        raise ValueError(f"the checkpoint's parameters{which} are invalid: {e}") from e
    after = {p: tuple(s) for p, s in current}
    diffs = [
        f"{p}: {before.get(p, '<absent>')} -> {after.get(p, '<absent>')}"
        for p in sorted(set(before) | set(after))
        if before.get(p) != after.get(p)
    ]
    if not diffs:  # the same parameters in another order: the state's arrays are in tree order
        diffs = [f"order {list(before)} -> {list(after)}"]
    raise ValueError(
        f"the checkpoint was saved for other parameters{which}; parameter shapes that differ "
        f"(saved -> current): {'; '.join(diffs)}."
    )


def _placement(entry: dict[str, Any]) -> str:
    if entry.get("slots") is None:
        return f"one device (block group stacks {entry.get('stacks')})"
    return f"sharded (padded block group stacks {entry.get('stacks')}, slots {entry.get('slots')})"


__all__ = ["METADATA_FORMAT", "check_restored", "checkpoint_metadata"]
