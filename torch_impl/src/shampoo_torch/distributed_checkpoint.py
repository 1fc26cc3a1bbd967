"""The portable checkpoint of :class:`~shampoo_torch.Shampoo`: the distributed state dict.

Every block's state gathered on every rank, keyed by parameter name and
block index, so a dict saved at one world size loads at any other (one
process included); its layout, versions and checks are in
:mod:`shampoo_torch.checkpoint`. Saving is an all-gather over the trainer
group, loading a collective in which every rank validates its own blocks and
raises if any rank found an error.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, cast

import torch

from .checkpoint import CheckpointTarget, block_entries, check_groups, commit
from .checkpoint_validation import (
    VERSION,
    check_config,
    check_group,
    check_metrics,
    check_param_shape,
    check_tree,
    check_version,
    fail,
    shown,
)
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
            "size; allowed state_dict() / load_state_dict() per rank at the same world "
            "size, or shard_mode='lossless' (portable across world sizes)."
        )


def distributed_state_dict(opt: CheckpointTarget) -> dict[str, Any]:
    """Every block's state gathered on every rank, keyed by name and block (see the module doc).

    A collective when distributed: every rank of the trainer group must call it.
    """
    names = _names(opt)
    local = {key: _cpu(entry) for key, entry in _held_blocks(block_entries(opt)).items()}
    root_failures = opt.metrics["root_failures"]
    merged: dict[tuple[int, int, int], dict[str, Any]] = {}
    total = 0
    for part in opt.gather((local, root_failures)):
        blocks, failures = cast(tuple[dict[tuple[int, int, int], dict[str, Any]], int], part)
        merged.update(blocks)
        total += failures
    local, root_failures = merged, total
    state: dict[str, Any] = {}
    groups = []
    counts = _block_counts(opt)
    for gi, group in enumerate(opt.param_groups):
        for pos, p in enumerate(group["params"]):
            entry = {k: _cpu(v) for k, v in opt.state[p].items()}
            entry["param_shape"] = list(p.shape)
            entry["blocks"] = {b: local[(gi, pos, b)] for b in range(counts[gi][pos])}
            state[names[gi][pos]] = entry
        saved = {k: v for k, v in group.items() if k not in ("params", "config", "param_names")}
        saved["config"] = group["config"].to_dict()
        saved["params"] = list(names[gi])
        groups.append(saved)
    metrics = {**opt.metrics, "root_failures": root_failures}
    return {"format": FORMAT, "version": VERSION, "state": state, "param_groups": groups,
            "metrics": metrics}


def load_distributed_state_dict(opt: CheckpointTarget, sd: dict[str, Any]) -> None:
    """Restore a :func:`distributed_state_dict` at any world size; this rank keeps its blocks.

    Validates everything (names, configs, every block present, shapes, lr,
    counters) before changing anything; raises ValueError naming what
    differs. Distributed, a collective over the trainer group: when any
    rank's validation fails every rank raises (and none changed anything).
    """
    try:
        pairs, groups, metrics, blocks = _validate_distributed(opt, sd)
        error = None
    except ValueError as err:
        error = err
    messages = opt.gather(None if error is None else str(error))
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        rank, message = failed[0]
        raise ValueError(f"{message} (found by rank {rank} of the trainer group; no rank "
                         "loaded anything)")
    commit(opt, pairs, groups, metrics, blocks)


def _cpu(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _cpu(v) for k, v in tree.items()}
    return tree


def _held_blocks(
    blocks: list[list[list[dict[str, Any]]]],
) -> dict[tuple[int, int, int], dict[str, Any]]:
    """Live state of the blocks held here (of :func:`block_entries`), keyed (group,
    position, block)."""
    out = {}
    for gi, per_param in enumerate(blocks):
        for pos, pblocks in enumerate(per_param):
            for b, entry in enumerate(pblocks):
                if entry:  # an empty dict: a block owned by another rank
                    out[(gi, pos, b)] = entry
    return out


def _block_counts(opt: CheckpointTarget) -> list[list[int]]:
    """Per group, per parameter: its number of blocks (0 when not preconditioned)."""
    return [[len(per_param) for per_param in group] for group in opt.block_states()]


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


def _validate_distributed(
    opt: CheckpointTarget, sd: dict[str, Any]
) -> tuple[list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]], list[dict[str, Any]],
           dict[str, Any], list[list[list[dict[str, Any]]]]]:
    """Every check of :func:`load_distributed_state_dict` on this rank's part: what to commit
    (and the block states it copies into, :func:`commit`)."""
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        fail("top level", f"expected a dict with format {FORMAT!r} (from "
              "distributed_state_dict()); use load_state_dict for state_dict()")
    version = check_version(sd, absent=None)
    if "state" not in sd or "param_groups" not in sd:
        fail("top level", "expected 'state' and 'param_groups'")
    sd = _int_keys(sd)
    groups = check_groups(sd, opt)
    names = _names(opt)
    blocks = block_entries(opt)
    held = _held_blocks(blocks)
    counts = _block_counts(opt)
    pairs = []
    for gi, (group, saved_group) in enumerate(zip(opt.param_groups, groups, strict=True)):
        if saved_group.get("params") != names[gi]:
            fail(f"param_groups[{gi}].params", f"saved names {saved_group.get('params')} do "
                  f"not match {names[gi]}")
        check_config(f"param_groups[{gi}].config", group["config"], saved_group.get("config"))
        check_group(f"param_groups[{gi}]", saved_group)
        for pos, p in enumerate(group["params"]):
            name = names[gi][pos]
            saved = sd["state"].get(name)
            if not isinstance(saved, dict) or not isinstance(saved.get("blocks"), dict):
                fail(f"state[{name!r}]", "missing (or without 'blocks')")
            count = counts[gi][pos]
            keys = list(saved["blocks"])
            if not all(isinstance(b, int) for b in keys) or sorted(keys) != list(range(count)):
                fail(f"state[{name!r}]['blocks']", f"block indices {shown(keys)} "
                      f"do not match the plan's {list(range(count))}")
            mine = {b: held[(gi, pos, b)] for b in range(count) if (gi, pos, b) in held}
            ours = dict(opt.state[p])
            ours["blocks"] = mine
            saved = check_param_shape(f"state[{name!r}]", p, saved, version, ours)
            subset = dict(saved)
            subset["blocks"] = {b: saved["blocks"][b] for b in mine}
            check_tree(f"state[{name!r}]", ours, subset)
            pairs.append((p, ours, subset))
    return pairs, groups, check_metrics(sd.get("metrics")), blocks


_DECIMAL = re.compile(r"0|[1-9][0-9]*")
#: A block's dicts keyed by block dim k.
_INT_KEYED = ("factors", "inverse_roots", "sketches", "eigenbases")


def _ints(tree: Any) -> Any:
    """A dict whose keys are all decimal strings ("0", "12") keyed by those ints."""
    if isinstance(tree, dict) and tree and all(
            isinstance(k, str) and _DECIMAL.fullmatch(k) for k in tree):
        return {int(k): v for k, v in tree.items()}
    return tree


def _int_keys(sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` with the int keys that ``torch.distributed.checkpoint`` turned into strings
    back to ints (a new dict; ``sd`` is not changed).

    DCP flattens a state dict into paths of strings, so a file written by
    ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` (or
    ``dcp.load`` without a template) holds ``"blocks": {"0": ...}`` and a block's
    ``"factors": {"0": ...}`` (``"inverse_roots"``, ``"sketches"`` alike). Only
    those dicts, and only when every key is a decimal string (no sign, no leading
    zero), are converted: anything else is left for validation to refuse.
    """
    state = sd["state"]
    if not isinstance(state, dict):
        return sd
    out = {}
    for name, entry in state.items():
        if isinstance(entry, dict) and isinstance(entry.get("blocks"), dict):
            blocks = {b: ({k: _ints(v) if k in _INT_KEYED else v for k, v in block.items()}
                          if isinstance(block, dict) else block)
                      for b, block in _ints(entry["blocks"]).items()}
            entry = {**entry, "blocks": blocks}
        out[name] = entry
    return {**sd, "state": out}
