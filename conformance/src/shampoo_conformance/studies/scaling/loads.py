"""Per-rank root work, step work, factor memory and bytes per step, in each mode.

``ddp`` (owners over all ranks, one all-gather of the directions),
``lossless`` (FSDP2 ``Shard(0)`` chunks, owners gather gradient pieces and
scatter direction slices) and ``local`` (every rank plans its own chunks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from shampoo_conformance.studies.scaling.blocks import (
    BlockTable,
    lower_bound,
    lpt_makespan,
    shard_lengths,
)
from shampoo_spec import ShampooConfig, block_cost, plan_parameter

#: Bytes of one communicated entry (float32 gradients and directions) and of one factor entry.
BYTES_PER_ENTRY = 4


@dataclass
class RankLoads:
    """Per-rank arrays of one mode at one world size (length N)."""

    root: np.ndarray  # flops of one root step
    step: np.ndarray  # flops of every step (block_cost's step load)
    memory: np.ndarray  # factor entries (factors and roots)
    comm: np.ndarray  # bytes received per step (= bytes sent, in lossless)
    elementwise: np.ndarray  # parameter entries this rank updates elementwise each step
    blocks: np.ndarray  # blocks this rank owns
    pieces: np.ndarray  # lossless: (block, other rank) pairs exchanged per step; else 0
    bounds: dict[str, float] = field(default_factory=dict)  # _bounds: reference maxima


def _owned(table: BlockTable, owners: np.ndarray, world: int) -> dict[str, np.ndarray]:
    def per_rank(weights: np.ndarray) -> np.ndarray:
        return np.bincount(owners, weights=weights, minlength=world)

    return {"step": per_rank(table.costs[:, 0]), "root": per_rank(table.costs[:, 1]),
            "memory": per_rank(table.costs[:, 2]),
            "blocks": np.bincount(owners, minlength=world).astype(np.float64)}


def _bounds(table: BlockTable, world: int) -> dict[str, float]:
    """Per load, :func:`lower_bound`; and ``root_lpt``, :func:`lpt_makespan` of the root load."""
    out = {name: lower_bound(table.costs[:, k], world)
           for k, name in enumerate(("step", "root", "memory"))}
    out["root_lpt"] = lpt_makespan(table.costs[:, 1], world)
    return out


def ddp_loads(table: BlockTable, owners: np.ndarray, world: int) -> RankLoads:
    """DDP: owned blocks' loads; every rank receives the other ranks' padded segments."""
    owned = _owned(table, owners, world)
    segment = max(int(np.bincount(owners, weights=table.size, minlength=world).max(initial=0)),
                  1)
    comm = np.full(world, float((world - 1) * segment * BYTES_PER_ENTRY))
    total = float(table.numel.sum())
    return RankLoads(owned["root"], owned["step"], owned["memory"], comm,
                     np.full(world, total), owned["blocks"], np.zeros(world),
                     _bounds(table, world))


def shard_entries(table: BlockTable, world: int, preconditioned_only: bool) -> np.ndarray:
    """Entries of every rank's ``Shard(0)`` chunks, summed over the parameters."""
    out = np.zeros(world, dtype=np.int64)
    keep = table.preconditioned if preconditioned_only else np.ones(len(table.rows), bool)
    groups: dict[tuple[int, int], int] = {}
    for d0, n, k in zip(table.rows.tolist(), table.numel.tolist(), keep.tolist(), strict=True):
        if k and n:
            groups[(d0, n // d0)] = groups.get((d0, n // d0), 0) + 1
    for (d0, per_row), count in groups.items():
        out += shard_lengths(d0, world) * per_row * count
    return out


def block_shard_overlap(table: BlockTable, ranks: np.ndarray, world: int) -> np.ndarray:
    """Entries of block i inside rank ``ranks[i]``'s ``Shard(0)`` chunk of its parameter."""
    d0 = table.rows[table.param]
    inner = table.inner[table.param]
    step = -(-d0 // world)
    lo = np.minimum(ranks * step, d0) * inner
    hi = np.minimum((ranks + 1) * step, d0) * inner
    rows = np.minimum(table.row_start + table.row_len, hi) - np.maximum(table.row_start, lo)
    entries: np.ndarray = np.clip(rows, 0, None) * table.width
    return entries


def lossless_loads(table: BlockTable, owners: np.ndarray, world: int) -> RankLoads:
    """fully_shard lossless: owners gather gradient pieces and scatter direction slices.

    Rank r receives the pieces of its blocks held by other ranks, ``size -
    overlap(owner)`` per owned block, and from other owners the slices of
    their directions on its chunk; the latter sum to r's chunk entries in
    preconditioned parameters minus the overlap of r's own blocks with its
    chunk. It sends exactly as many entries as it receives.
    """
    owned = _owned(table, owners, world)
    own = block_shard_overlap(table, owners, world)
    pieces = np.bincount(owners, weights=(table.size - 2 * own).astype(np.float64),
                         minlength=world)
    received = shard_entries(table, world, preconditioned_only=True) + pieces
    return RankLoads(owned["root"], owned["step"], owned["memory"],
                     received * BYTES_PER_ENTRY,
                     shard_entries(table, world, preconditioned_only=False).astype(np.float64),
                     owned["blocks"], block_pieces(table, owners, world),
                     _bounds(table, world))


def block_pieces(table: BlockTable, owners: np.ndarray, world: int) -> np.ndarray:
    """Per rank, the (block, other rank) pairs it exchanges in lossless mode per step.

    A block whose rows lie in the chunks of ranks ``first..last`` costs its
    owner one gradient piece in and one direction slice out per other rank
    of that span, and each of those ranks one piece out and one slice in.
    """
    unit = -(-table.rows[table.param] // world) * table.inner[table.param]
    first = table.row_start // unit
    last = (table.row_start + table.row_len - 1) // unit
    cover = np.zeros(world + 1, dtype=np.int64)
    np.add.at(cover, first, 1)
    np.add.at(cover, last + 1, -1)
    inside = ((first <= owners) & (owners <= last)).astype(np.int64)
    span = last - first + 1
    as_owner = np.bincount(owners, weights=(span - 2 * inside).astype(np.float64),
                           minlength=world)
    covered: np.ndarray = np.cumsum(cover[:world]) + as_owner
    return covered


def local_loads(shapes: Sequence[tuple[int, ...]], config: ShampooConfig,
                world: int) -> RankLoads:
    """Local shard: every rank plans and owns the blocks of its own ``Shard(0)`` chunks."""
    counts: dict[tuple[int, ...], int] = {}
    for shape in shapes:
        counts[tuple(shape)] = counts.get(tuple(shape), 0) + 1
    root, step, memory, entries, blocks = (np.zeros(world) for _ in range(5))
    for shape, count in counts.items():
        rows = shape[0] if shape else 1
        lengths = shard_lengths(rows, world)
        for length in np.unique(lengths).tolist():
            piece = (length, *shape[1:]) if shape else ()
            plan = plan_parameter(piece, config)
            on = lengths == length
            entries[on] += count * math.prod(piece)
            if not plan.preconditioned or plan.size == 0:
                continue
            costs = [block_cost(b, config) for b in plan.blocks]
            root[on] += count * sum(c.root for c in costs)
            step[on] += count * sum(c.step for c in costs)
            memory[on] += count * sum(c.memory for c in costs)
            blocks[on] += count * len(costs)
    return RankLoads(root, step, memory, np.zeros(world), entries, blocks, np.zeros(world))
