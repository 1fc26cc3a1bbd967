"""The study's rows: per model, block size, mode and world size, one row of maxima,
means and imbalances, with where the root work's imbalance comes from."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace

from shampoo_conformance.studies.scaling.blocks import BlockTable, assign_owners, block_table
from shampoo_conformance.studies.scaling.loads import (
    BYTES_PER_ENTRY,
    RankLoads,
    ddp_loads,
    local_loads,
    lossless_loads,
)
from shampoo_conformance.studies.scaling.models import MODELS, DecoderShapes
from shampoo_spec import ShampooConfig

#: World sizes of the default run: 8, 16, ..., 4096.
WORLD_SIZES = tuple(2**k for k in range(3, 13))
#: Block sizes (``blocking.max_preconditioner_dim``) of the default run; 1024 is the default.
BLOCK_SIZES = (512, 1024, 2048, 4096)
#: Shard-group sizes S of the HSDP rows (8: one node of 8 GPUs).
SHARD_GROUPS = (8, 64)

COLUMNS = (
    "model", "block_size", "mode", "world", "shard_group", "replicas", "blocks", "idle_ranks",
    "root_max", "root_mean", "root_imbalance", "root_lpt_imbalance", "root_lower_bound",
    "step_max", "step_mean", "step_imbalance",
    "memory_max_bytes", "memory_mean_bytes", "memory_imbalance",
    "comm_max_bytes", "comm_mean_bytes", "pieces_max", "elementwise_max", "cause",
)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 1.0


def _cause(loads: RankLoads, blocks: int, world: int, mode: str, uneven: str) -> str:
    """Where the root work's imbalance (max / mean) comes from, in words.

    Assignment modes: ranks without a block; the block granularity (what
    balancing the root load alone, LPT, reaches, and the proven
    :func:`lower_bound` when it exceeds the mean); the price of balancing
    three loads at once (max over that LPT). Local shard: the uneven cut.
    """
    idle = int((loads.blocks == 0).sum())
    mean = float(loads.root.mean())
    parts = []
    if idle:
        parts.append(f"{idle} of {world} ranks own no block"
                     + (f" ({blocks} blocks)" if blocks < world else ""))
    if mode == "local":
        if uneven:
            parts.append(uneven)
    else:
        lpt = _ratio(loads.bounds["root_lpt"], mean)
        bound = _ratio(loads.bounds["root"], mean)
        if lpt > 1.005:
            parts.append(f"block granularity: root alone balances to {lpt:.2f}"
                         + (f" (none below {bound:.2f})" if bound > 1.005 else ""))
        vector = _ratio(float(loads.root.max()), loads.bounds["root_lpt"])
        if vector > 1.005:
            parts.append(f"balancing 3 loads at once: {vector:.2f}x that")
    return "; ".join(parts) or "balanced"


def _uneven(shapes: Sequence[tuple[int, ...]], world: int) -> str:
    """Which parameters ``Shard(0)`` cuts unevenly over ``world`` ranks, in words."""
    rows = [s[0] if s else 1 for s in shapes]
    empty = sum(1 for d in rows if -(-d // world) * (world - 1) >= d)
    uneven = sum(1 for d in rows if d % world != 0)
    parts = []
    if uneven:
        parts.append(f"uneven Shard(0): {uneven} of {len(rows)} parameters")
    if empty:
        parts.append(f"{empty} with empty chunks")
    return ", ".join(parts)


def summarize(model: str, block_size: int, mode: str, world: int, group: int, blocks: int,
              loads: RankLoads, cause: str) -> dict[str, object]:
    """One table row (:data:`COLUMNS`) from per-rank loads."""
    mem = loads.memory * BYTES_PER_ENTRY
    return {
        "model": model, "block_size": block_size, "mode": mode, "world": world,
        "shard_group": group, "replicas": world // group, "blocks": blocks,
        "idle_ranks": int((loads.blocks == 0).sum()),
        "root_max": float(loads.root.max()), "root_mean": float(loads.root.mean()),
        "root_imbalance": _ratio(float(loads.root.max()), float(loads.root.mean())),
        # Reference maxima exist where owners are assigned (not in local shard): NaN there.
        "root_lpt_imbalance": _ratio(loads.bounds.get("root_lpt", math.nan),
                                     float(loads.root.mean())),
        "root_lower_bound": _ratio(loads.bounds.get("root", math.nan), float(loads.root.mean())),
        "step_max": float(loads.step.max()), "step_mean": float(loads.step.mean()),
        "step_imbalance": _ratio(float(loads.step.max()), float(loads.step.mean())),
        "memory_max_bytes": float(mem.max()), "memory_mean_bytes": float(mem.mean()),
        "memory_imbalance": _ratio(float(mem.max()), float(mem.mean())),
        "comm_max_bytes": float(loads.comm.max()), "comm_mean_bytes": float(loads.comm.mean()),
        "pieces_max": int(loads.pieces.max()),
        "elementwise_max": float(loads.elementwise.max()), "cause": cause,
    }


def scaling_rows(
    models: Iterable[DecoderShapes] = MODELS.values(),
    block_sizes: Iterable[int] = BLOCK_SIZES,
    world_sizes: Iterable[int] = WORLD_SIZES,
    shard_groups: Iterable[int] = SHARD_GROUPS,
    config: ShampooConfig | None = None,
    log: bool = False,
) -> list[dict[str, object]]:
    """Every row: per model, block size and world size, the four modes (HSDP per S)."""
    base = config or ShampooConfig()
    worlds = sorted(set(world_sizes))
    groups = sorted(set(shard_groups))
    rows = []
    for model in models:
        shapes = [s for _, s in model.parameters()]
        for bs in block_sizes:
            cfg = replace(base, blocking=replace(base.blocking, max_preconditioner_dim=bs))
            started = time.perf_counter()
            table = block_table(shapes, cfg)
            cache: dict[int, tuple[RankLoads, RankLoads]] = {}

            def full(n: int, table: BlockTable = table,
                     cache: dict[int, tuple[RankLoads, RankLoads]] = cache
                     ) -> tuple[RankLoads, RankLoads]:
                if n not in cache:
                    owners = assign_owners(table.costs, n)
                    cache[n] = (ddp_loads(table, owners, n), lossless_loads(table, owners, n))
                return cache[n]

            for n in worlds:
                ddp, lossless = full(n)
                for mode, loads in (("ddp", ddp), ("lossless", lossless)):
                    rows.append(summarize(model.name, bs, mode, n, n, table.count, loads,
                                          _cause(loads, table.count, n, mode, "")))
                local = local_loads(shapes, cfg, n)
                rows.append(summarize(model.name, bs, "local", n, n, int(local.blocks.sum()),
                                      local, _cause(local, table.count, n, "local",
                                                    _uneven(shapes, n))))
                for s in groups:
                    if s <= n and n % s == 0:
                        inner = full(s)[1]
                        rows.append(summarize(model.name, bs, f"hsdp-{s}", n, s, table.count,
                                              inner, _cause(inner, table.count, s, "hsdp", "")))
            if log:
                print(f"{model.name} block {bs}: {table.count} blocks, "
                      f"{time.perf_counter() - started:.1f} s", file=sys.stderr)
    return rows
