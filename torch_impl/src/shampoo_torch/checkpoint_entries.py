"""The per-parameter entries of a Shampoo checkpoint (version 3, :mod:`shampoo_torch.checkpoint`).

An entry holds everything of one parameter: its ``step``, the shape it was
saved for, its elementwise state and every block's state, gathered from the
ranks that hold them, so it does not depend on the world size. Under
``shard_mode="local"`` each value of a sharded parameter's entry is keyed by
the piece's coordinate i in its shard group (``torch.chunk(full, S)[i]``, as
the string ``str(i)``): each rank's state belongs to its own piece.

The live state (``optimizer.state[p]``) holds the same top-level keys as an
entry (:data:`LIVE_KEYS` beside ``step`` and the elementwise state), since
``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` with
``flatten_optimizer_state_dict=True`` rebuilds each entry from the keys of
the live state: ``param_shape`` (the parameter's shape, an int64 tensor),
``blocks`` (the parameter's number of blocks; their state lives stacked in
the block groups) and, on the optimizer's first parameter, ``metrics`` (the
:class:`~shampoo_torch.metrics.StepCounters`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Protocol, cast

import torch

from .sharding import ShardInfo

#: Keys of the live state that an entry fills from elsewhere than ``optimizer.state[p]``.
LIVE_KEYS = ("param_shape", "blocks", "metrics")
#: Where, in the optimizer's first parameter's entry, the counters travel.
METRICS = "metrics"


class EntrySource(Protocol):
    """What :func:`saved_entries` reads of an optimizer
    (:class:`~shampoo_torch.state.CheckpointState` is one)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    @property
    def state(self) -> Mapping[torch.Tensor, dict[str, Any]]: ...

    @property
    def metrics(self) -> dict[str, int]: ...

    @property
    def gathers(self) -> bool:
        """Whether the blocks are spread over a trainer group (gathered on saving)."""

    def block_states(self) -> list[list[list[dict[str, Any] | None]]]: ...

    def gather(self, obj: object) -> list[object]: ...

    def piece(self, gi: int, pos: int) -> ShardInfo | None:
        """``shard_mode="local"``: the shard placement of a sharded parameter; else None."""

    def gather_pieces(self, obj: object) -> list[object]:
        """``obj`` of every rank of the shard group (``shard_mode="local"``)."""


def block_entries(opt: EntrySource) -> list[list[list[dict[str, Any]]]]:
    """Per group, per parameter, per block: live tensor views ({} for another rank's block)."""
    return [[[{} if entry is None else entry for entry in per_param] for per_param in group]
            for group in opt.block_states()]


def has_pieces(opt: EntrySource) -> bool:
    """Whether some parameter's state belongs to this rank's piece (``"local"``)."""
    return any(opt.piece(gi, pos) is not None for gi, group in enumerate(opt.param_groups)
               for pos in range(len(group["params"])))


def saved_entries(opt: EntrySource) -> list[list[dict[str, Any]]]:
    """Per group, per parameter: its entry (copies; on the CPU where gathered), the first
    one with the counters. A collective when the blocks or pieces are spread over ranks."""
    blocks = block_entries(opt)
    gathered = opt.gathers or has_pieces(opt)
    move = _cpu if gathered else _clone
    held = {key: move(entry) for key, entry in _held(blocks).items()}
    metrics: dict[str, Any] = dict(opt.metrics)
    if opt.gathers:
        merged: dict[tuple[int, int, int], dict[str, Any]] = {}
        total = 0
        for part in opt.gather((held, metrics["root_failures"])):
            their_blocks, failures = cast(tuple[dict[tuple[int, int, int], Any], int], part)
            merged.update(their_blocks)
            total += failures
        held, metrics["root_failures"] = merged, total
    entries: list[list[dict[str, Any]]] = []
    mine: dict[tuple[int, int], dict[str, Any]] = {}
    for gi, (group, per_param) in enumerate(zip(opt.param_groups, blocks, strict=True)):
        row = []
        for pos, p in enumerate(group["params"]):
            entry = {k: move(v) for k, v in opt.state[p].items() if k not in LIVE_KEYS}
            entry["blocks"] = {b: held[(gi, pos, b)] for b in range(len(per_param[pos]))}
            if opt.piece(gi, pos) is not None:
                mine[(gi, pos)] = entry
            entry = dict(entry)
            entry["param_shape"] = shape_tensor(p, "cpu" if gathered else None)
            row.append(entry)
        entries.append(row)
    if has_pieces(opt):
        _key_by_piece(opt, entries, mine, metrics)
    elif entries and entries[0]:
        entries[0][0][METRICS] = metrics
    return entries


def _key_by_piece(opt: EntrySource, entries: list[list[dict[str, Any]]],
                  mine: dict[tuple[int, int], dict[str, Any]], metrics: dict[str, Any]) -> None:
    """``"local"``: every sharded parameter's values (and the counters) keyed by piece."""
    index = next(info.index for gi, pos in mine if (info := opt.piece(gi, pos)) is not None)
    parts = [cast(tuple[int, dict[tuple[int, int], dict[str, Any]], dict[str, Any]], part)
             for part in opt.gather_pieces((index, mine, metrics))]
    # Pieces are keyed by decimal strings: DCP loads a non-tensor leaf (a step, a counter)
    # under the string of each int key on its path, beside the template's int key.
    # Pieces of one parameter may keep different state: a one-row piece keeps an
    # unfactored Adafactor moment where the others keep row and column factors. Each key
    # holds the pieces that have it.
    for gi, pos in mine:
        by_piece = {i: their[(gi, pos)] for i, their, _ in parts}
        keys = dict.fromkeys(k for i in sorted(by_piece) for k in by_piece[i])
        entry = {k: {str(i): by_piece[i][k] for i in sorted(by_piece) if k in by_piece[i]}
                 for k in keys}
        entry["param_shape"] = entries[gi][pos]["param_shape"]
        entries[gi][pos] = entry
    if entries and entries[0]:
        entries[0][0][METRICS] = {str(i): m for i, _, m in sorted(parts, key=lambda x: x[0])}


def shape_tensor(p: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """The parameter's (whole) shape as an int64 tensor, on ``device`` (default: ``p``'s
    device, so that every tensor of a one-process state dict is on one device)."""
    return torch.tensor(list(p.shape), dtype=torch.int64,
                        device=_device(p) if device is None else device)


def _device(p: torch.Tensor) -> torch.device:
    local = getattr(p, "to_local", None)  # a DTensor's own device is that of its piece
    return local().device if callable(local) else p.device


def _held(blocks: list[list[list[dict[str, Any]]]]) -> dict[tuple[int, int, int], dict[str, Any]]:
    """Live state of the blocks held here, keyed (group, position, block)."""
    return {(gi, pos, b): entry for gi, per_param in enumerate(blocks)
            for pos, pblocks in enumerate(per_param) for b, entry in enumerate(pblocks) if entry}


def _clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree


def _cpu(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _cpu(v) for k, v in tree.items()}
    return tree


_DECIMAL = re.compile(r"0|[1-9][0-9]*")


def int_keys(tree: Any) -> Any:
    """``tree`` with every dict whose keys are all decimal strings ("0", "12", no sign, no
    leading zero) keyed by those ints (new dicts; ``tree`` is not changed).

    ``torch.distributed.checkpoint`` writes an entry's int keys (block indices,
    block dims, piece coordinates) as strings: in a file of
    ``format_utils.dcp_to_torch_save`` and in an entry rebuilt by
    ``set_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``. The
    keys of an entry are otherwise names, so nothing else is converted, and a
    key that is neither is left for validation to refuse.
    """
    if not isinstance(tree, dict):
        return tree
    out = {k: int_keys(v) for k, v in tree.items()}
    if out and all(isinstance(k, str) and _DECIMAL.fullmatch(k) for k in out):
        return {int(k): v for k, v in out.items()}
    return out


def select_piece(entry: Mapping[str, Any], info: ShardInfo | None) -> dict[str, Any] | str:
    """This rank's part of a saved entry: the entry itself, or under ``"local"`` its piece's
    values; a string says why the entry does not fit (see :func:`saved_entries`)."""
    local = {k: v for k, v in entry.items() if k != "param_shape"}
    keyed = bool(local) and all(isinstance(v, dict) and v and all(isinstance(i, int) for i in v)
                                for k, v in local.items() if k != "blocks") \
        and isinstance(local.get("step"), dict)
    if info is None:
        if keyed:
            return ("saved by shard_mode='local' (each value keyed by piece): it loads only "
                    "into shard_mode='local' at the same shard group size")
        return dict(entry)
    if not keyed:
        return ("saved for the whole parameter; this optimizer has shard_mode='local' (each "
                "rank's state belongs to its own piece): allowed a state saved in 'local' "
                "mode at the same shard group size")
    pieces = sorted(local["step"])
    # Every piece has a step; a key of state that only some pieces keep (see
    # saved_entries) lists those; torch's flattening drops an empty piece's blocks.
    if pieces != list(range(info.parts)) or any(
            not set(v) <= set(pieces) for v in local.values() if isinstance(v, dict)):
        return (f"saved for pieces {pieces}; this shard group has {info.parts} "
                f"(allowed the same shard group size)")
    out = {k: v.get(info.index, {}) if k == "blocks" else v[info.index]
           for k, v in local.items() if k == "blocks" or info.index in v}
    if "param_shape" in entry:
        out["param_shape"] = entry["param_shape"]
    return out


def own_metrics(metrics: object, pieces: ShardInfo | None) -> object:
    """The counters of this rank from a saved entry's ``metrics`` (keyed by piece in
    ``"local"`` mode)."""
    if pieces is not None and isinstance(metrics, dict) and metrics and all(
            isinstance(i, int) for i in metrics):
        return metrics.get(pieces.index)
    return metrics


def first_piece(opt: EntrySource) -> ShardInfo | None:
    """The shard placement of some sharded parameter (``"local"``), else None."""
    for gi, group in enumerate(opt.param_groups):
        for pos in range(len(group["params"])):
            info = opt.piece(gi, pos)
            if info is not None:
                return info
    return None
