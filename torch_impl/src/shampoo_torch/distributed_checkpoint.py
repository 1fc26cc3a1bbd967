"""The portable checkpoint of :class:`~shampoo_torch.Shampoo` keyed by parameter name: the
distributed state dict.

The entries of :meth:`~shampoo_torch.Shampoo.state_dict` (version 3,
:mod:`shampoo_torch.checkpoint`: every block's state gathered on every rank)
keyed by parameter name instead of index, with ``"format"``; it loads at any
world size (one process included) and in any mode but ``shard_mode="local"``.
Versions 1 and 2 of this dict (the same layout with ``param_shape`` a list,
or absent, and the counters in a top-level ``"metrics"``) still load.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .checkpoint import CheckpointTarget, load_agreed, saved_group, validate
from .checkpoint_entries import saved_entries
from .checkpoint_validation import VERSION, check_version, fail
from .state import ParamGroupPlan

FORMAT = "shampoo_torch.distributed_state_dict"


def refuse_local_pieces(method: str, shard_mode: str | None, plans: Sequence[ParamGroupPlan]
                        ) -> None:
    """``shard_mode="local"`` with DTensor parameters: ``Shampoo.<method>()`` is refused (each
    rank's state belongs to pieces whose plan depends on the world size)."""
    if shard_mode == "local" and any(
            info is not None for gp in plans for info in gp.shards):
        raise ValueError(
            f"Shampoo.{method}() with DistributedConfig.shard_mode = 'local' is invalid: "
            "each rank's state belongs to its own pieces, whose plan depends on the world "
            "size; allowed state_dict() / load_state_dict() (every rank's pieces, loadable "
            "in 'local' mode at the same shard group size), or shard_mode='lossless' "
            "(portable across world sizes)."
        )


def distributed_state_dict(opt: CheckpointTarget) -> dict[str, Any]:
    """Every block's state gathered on every rank, keyed by name and block (see the module doc).

    A collective when distributed: every rank of the trainer group must call it.
    """
    names = _names(opt)
    state: dict[str, Any] = {}
    groups = []
    for gi, (group, entries) in enumerate(zip(opt.param_groups, saved_entries(opt),
                                              strict=True)):
        state.update(zip(names[gi], entries, strict=True))
        groups.append(saved_group(group, list(names[gi]), names=False))  # params: names
    return {"format": FORMAT, "version": VERSION, "state": state, "param_groups": groups}


def load_distributed_state_dict(opt: CheckpointTarget, sd: dict[str, Any]) -> None:
    """Restore a :func:`distributed_state_dict` at any world size; this rank keeps its blocks.

    Validates everything (names, configs, every block present, shapes, lr,
    counters) before changing anything; raises ValueError naming what
    differs. Distributed, a collective over the trainer group: when any
    rank's validation fails every rank raises (and none changed anything).
    """
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        fail("top level", f"expected a dict with format {FORMAT!r} (from "
              "distributed_state_dict()); use load_state_dict for state_dict()")
    version = check_version(sd, absent=None)
    if version is None:
        fail("version", "missing: a distributed state dict holds its 'version'")
    if "state" not in sd or "param_groups" not in sd:
        fail("top level", "expected 'state' and 'param_groups'")
    _names(opt)
    load_agreed(opt, lambda: validate(opt, sd, version, by_name=True))


def _names(opt: CheckpointTarget) -> list[list[str]]:
    names = opt.parameter_names()
    seen: set[str] = set()
    for group_names in names:
        for n in group_names:
            if n in seen:
                raise ValueError(f"parameter name {n!r} is not unique: the distributed state "
                                 "dict is keyed by name, allowed unique names.")
            seen.add(n)
    return names
