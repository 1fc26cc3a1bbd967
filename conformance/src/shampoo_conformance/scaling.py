"""Scaling on paper: the block plan and the owner assignment on Llama-2 shapes, 8 to 4096 ranks.

``python -m shampoo_conformance scaling --out DIR`` (``nox -s scaling``)
plans the blocks of a real model's parameters (eqs. 4-5,
:func:`shampoo_spec.plan_parameter`), assigns owners with the load balancer
(:func:`shampoo_spec.assign_blocks` over :func:`shampoo_spec.block_cost`)
and tabulates, per rank, the root work, the per-step work, the factor
memory and the bytes the optimizer communicates per step, in four modes:

- ``ddp``: blocks of the full shapes, owners over all N ranks; one
  all-gather of every block's direction per step (each rank's segment padded
  to the longest, as ``shampoo_torch.distributed.DirectionExchange`` does).
- ``lossless``: FSDP2 ``fully_shard`` parameters (``Shard(0)``, chunks as
  ``torch.chunk`` cuts them: ``ceil(d0 / N)`` rows each, the last shorter or
  empty); blocks of the full shapes owned over the N ranks; per step every
  owner gathers its blocks' gradient pieces from the ranks holding them and
  sends each rank its slice of the direction (exact bytes from the overlap of
  blocks and shards).
- ``local``: every rank plans blocks on its own ``Shard(0)`` slice and owns
  them all; no optimizer communication, but other blocks than one process
  has, so other numerics.
- ``hsdp-S``: replicas of S-rank shard groups (R = N / S); inside a group as
  ``lossless`` over S ranks, the work repeated in every replica.

Nothing runs on a device: every number is a function of shapes, the config
and the cost model of :mod:`shampoo_spec.assignment` (root work = its
``root`` load, ``ROOT_FLOPS_PER_CUBE n^3`` per factor; step work = its
``step`` load; factor memory = its ``memory`` entries, float32 here).

The owners are :func:`shampoo_spec.assign_blocks`'s own: 67,080 blocks
(Llama-2-70B, block size 1024) over 4096 ranks take 0.4 s (its heap over
runs of equal blocks; scanning every rank for every block took 1.6 us per
block and rank, about 7 minutes there).
"""

from __future__ import annotations

import csv
import heapq
import math
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from shampoo_spec import ShampooConfig, assign_blocks, block_cost, plan_parameter

#: Bytes of one communicated entry (float32 gradients and directions) and of one factor entry.
BYTES_PER_ENTRY = 4
#: World sizes of the default run: 8, 16, ..., 4096.
WORLD_SIZES = tuple(2**k for k in range(3, 13))
#: Block sizes (``blocking.max_preconditioner_dim``) of the default run; 1024 is the default.
BLOCK_SIZES = (512, 1024, 2048, 4096)
#: Shard-group sizes S of the HSDP rows (8: one node of 8 GPUs).
SHARD_GROUPS = (8, 64)


# --------------------------------------------------------------------------- models
@dataclass(frozen=True)
class DecoderShapes:
    """A Llama-style decoder: the dims that fix every parameter's shape."""

    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int

    def parameters(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` in ``named_parameters`` order of Hugging Face's ``LlamaForCausalLM``.

        Linear weights are ``(out_features, in_features)``; k/v project to
        ``kv_heads * head_dim`` (grouped-query attention when kv_heads < heads).
        """
        h, inter = self.hidden, self.intermediate
        kv = self.kv_heads * (h // self.heads)
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [
                (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (inter, h)),
                (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter)),
                (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,)),
            ]
        return out + [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]


# The published configurations: Hugging Face meta-llama/Llama-2-7b-hf and
# meta-llama/Llama-2-70b-hf, config.json (hidden_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, intermediate_size, vocab_size;
# tie_word_embeddings false), and Touvron et al. 2023, "Llama 2", arXiv
# 2307.09288, Table 1 (grouped-query attention for 70B). The parameter counts
# these give, 6,738,415,616 and 68,976,648,192, are the published ones (tested).
LLAMA2_7B = DecoderShapes("llama-2-7b", vocab=32000, hidden=4096, layers=32, heads=32,
                          kv_heads=32, intermediate=11008)
LLAMA2_70B = DecoderShapes("llama-2-70b", vocab=32000, hidden=8192, layers=80, heads=64,
                           kv_heads=8, intermediate=28672)
MODELS = {m.name: m for m in (LLAMA2_7B, LLAMA2_70B)}


# --------------------------------------------------------------------------- sharding
def shard_rows(rows: int, world: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each rank's ``Shard(0)`` chunk of ``rows`` rows.

    ``torch.chunk``'s cut, as FSDP2 uses it: chunks of ``ceil(rows / world)``
    rows, the last one shorter, ranks past the last chunk empty.
    """
    step = -(-rows // world)
    return [(min(r * step, rows), min((r + 1) * step, rows) - min(r * step, rows))
            for r in range(world)]


def _shard_lengths(rows: int, world: int) -> np.ndarray:
    step = -(-rows // world)
    start = np.minimum(np.arange(world, dtype=np.int64) * step, rows)
    lengths: np.ndarray = np.minimum(start + step, rows) - start
    return lengths


# --------------------------------------------------------------------------- blocks
@dataclass(frozen=True)
class BlockTable:
    """Every block of a model's full-shape plan, in the canonical order, as arrays.

    Per block: ``costs`` (step flops, root flops, memory entries), ``size``,
    ``param`` (index into the per-parameter arrays), the block's range along
    merged dim 0 (``row_start``, ``row_len``) and ``width`` (entries per unit
    of merged dim 0). Per parameter: ``rows`` (original dim 0), ``inner``
    (merged-dim-0 units per original row: a ``Shard(0)`` chunk of rows
    ``[a, b)`` is merged-dim-0 range ``[a * inner, b * inner)``), ``numel``
    and ``preconditioned``.
    """

    costs: np.ndarray
    size: np.ndarray
    param: np.ndarray
    row_start: np.ndarray
    row_len: np.ndarray
    width: np.ndarray
    rows: np.ndarray
    inner: np.ndarray
    numel: np.ndarray
    preconditioned: np.ndarray

    @property
    def count(self) -> int:
        return len(self.size)


def block_table(shapes: Sequence[tuple[int, ...]], config: ShampooConfig) -> BlockTable:
    """The :class:`BlockTable` of parameters of these shapes (plans cached per shape)."""
    per_shape: dict[tuple[int, ...], tuple[np.ndarray, ...]] = {}
    cols: list[list[np.ndarray]] = [[] for _ in range(6)]
    rows, inner, numel, pre = [], [], [], []
    for index, shape in enumerate(shapes):
        shape = tuple(shape)
        if shape not in per_shape:
            plan = plan_parameter(shape, config)
            blocks = plan.blocks if plan.preconditioned and plan.size > 0 else ()
            costs = np.array([block_cost(b, config).vector() for b in blocks],
                             dtype=np.float64).reshape(-1, 3)
            sizes = np.array([math.prod(b.shape) for b in blocks], dtype=np.int64)
            starts = np.array([b.offsets[0] for b in blocks], dtype=np.int64)
            lens = np.array([b.shape[0] for b in blocks], dtype=np.int64)
            widths = np.array([math.prod(b.shape[1:]) for b in blocks], dtype=np.int64)
            d0 = shape[0] if shape else 1
            after = math.prod(shape[1:]) if shape else 1  # entries per original row
            later = math.prod(plan.merged_shape[1:])  # entries per merged-dim-0 unit
            per_shape[shape] = (costs, sizes, starts, lens, widths,
                                np.array([d0, after // later if later else 0, plan.size,
                                          bool(len(blocks))]))
        costs, sizes, starts, lens, widths, meta = per_shape[shape]
        for col, values in zip(cols, (costs, sizes, np.full(len(sizes), index), starts, lens,
                                      widths), strict=True):
            col.append(values)
        rows.append(meta[0])
        inner.append(meta[1])
        numel.append(meta[2])
        pre.append(bool(meta[3]))
    cat = [np.concatenate(c) if c else np.zeros(0) for c in cols]
    return BlockTable(
        costs=cat[0].reshape(-1, 3), size=cat[1].astype(np.int64),
        param=cat[2].astype(np.int64), row_start=cat[3].astype(np.int64),
        row_len=cat[4].astype(np.int64), width=cat[5].astype(np.int64),
        rows=np.array(rows, dtype=np.int64), inner=np.array(inner, dtype=np.int64),
        numel=np.array(numel, dtype=np.int64), preconditioned=np.array(pre, dtype=bool),
    )


# --------------------------------------------------------------------------- assignment
def assign_owners(costs: np.ndarray, world: int) -> np.ndarray:
    """Owners of blocks with ``(B, 3)`` cost vectors: :func:`shampoo_spec.assign_blocks`."""
    vectors = [tuple(c) for c in np.asarray(costs, dtype=np.float64).reshape(-1, 3).tolist()]
    return np.array(assign_blocks(vectors, world).owners, dtype=np.int64)


def lower_bound(costs: np.ndarray, world: int) -> float:
    """No assignment of these indivisible block costs to ``world`` ranks has a smaller maximum.

    ``max(total / world, max over k of the k+1 smallest of the k*world+1
    largest)``: of the ``k*world + 1`` largest blocks some rank gets k+1
    (pigeonhole). k = 0 is the largest block; with equal blocks it gives
    ``ceil(B / world)`` blocks.
    """
    if len(costs) == 0:
        return 0.0
    p = np.sort(np.asarray(costs, dtype=np.float64))[::-1]
    cum = np.concatenate(([0.0], np.cumsum(p)))
    k = np.arange((len(p) - 1) // world + 1)
    top = k * world + 1
    return float(max(cum[-1] / world, np.max(cum[top] - cum[top - k - 1])))


def lpt_makespan(costs: np.ndarray, world: int) -> float:
    """The largest load of longest-processing-time scheduling of one load alone.

    Blocks in decreasing cost, each to the least-loaded rank: what balancing
    this load and no other achieves (within 4/3 of the optimum, Graham 1969).
    """
    loads = [(0.0, r) for r in range(world)]
    for c in np.sort(np.asarray(costs, dtype=np.float64))[::-1].tolist():
        load, rank = heapq.heappop(loads)
        heapq.heappush(loads, (load + c, rank))
    return max(load for load, _ in loads)


# --------------------------------------------------------------------------- per rank
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
        out += _shard_lengths(d0, world) * per_row * count
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
        lengths = _shard_lengths(rows, world)
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


# --------------------------------------------------------------------------- rows
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


# --------------------------------------------------------------------------- output
def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _bytes(x: float) -> str:
    for scale, prefix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}"
    return f"{x:.0f} B"


def _num(x: object) -> float:
    """A number of a row (a float, or its text when the rows were read from the CSV)."""
    return float(str(x))


def _fixed(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


MARKDOWN_HEADER = ("| mode | N | blocks | root max | root max/mean | LPT root alone | step max "
                   "| step max/mean | factor memory max | memory max/mean | comm per step max "
                   "| pieces max | where the imbalance comes from |")


def markdown_table(rows: Sequence[dict[str, object]]) -> str:
    """The rows as a markdown table (units: flop, bytes in binary prefixes)."""
    lines = [MARKDOWN_HEADER, "|" + "---|" * (MARKDOWN_HEADER.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['world']} | {r['blocks']} | {_si(_num(r['root_max']), 'flop')} "
            f"| {_num(r['root_imbalance']):.2f} | {_fixed(_num(r['root_lpt_imbalance']))} "
            f"| {_si(_num(r['step_max']), 'flop')} | {_num(r['step_imbalance']):.2f} "
            f"| {_bytes(_num(r['memory_max_bytes']))} | {_num(r['memory_imbalance']):.2f} "
            f"| {_bytes(_num(r['comm_max_bytes']))} "
            f"| {r['pieces_max'] if str(r['mode']) not in ('ddp', 'local') else '-'} "
            f"| {r['cause']} |"
        )
    return "\n".join(lines)


#: World sizes of the summary tables (docs/scaling.md).
SUMMARY_WORLDS = (8, 64, 512, 4096)
#: Block size of the summary's per-mode tables and of the plot.
SUMMARY_BLOCK_SIZE = 1024


def block_size_table(rows: Sequence[dict[str, object]], world: int) -> str:
    """At one world size, per model and block size: what the block size changes."""
    header = ("| model | block size | blocks | idle ranks | root max (ddp, lossless) "
              "| root max/mean | LPT root alone | factor memory max | comm max, lossless "
              "| comm max, ddp | root max, local | factor memory max, local |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    pick = {(r["model"], int(str(r["block_size"])), r["mode"]): r
            for r in rows if int(str(r["world"])) == world}
    for model, bs in sorted({(m, b) for m, b, _ in pick}, key=lambda k: (str(k[0]), k[1])):
        ddp, lossless, local = (pick.get((model, bs, m)) for m in ("ddp", "lossless", "local"))
        if ddp is None or lossless is None or local is None:
            continue
        lines.append(
            f"| {model} | {bs} | {ddp['blocks']} | {ddp['idle_ranks']} "
            f"| {_si(_num(ddp['root_max']), 'flop')} "
            f"| {_num(ddp['root_imbalance']):.2f} "
            f"| {_fixed(_num(ddp['root_lpt_imbalance']))} "
            f"| {_bytes(_num(ddp['memory_max_bytes']))} "
            f"| {_bytes(_num(lossless['comm_max_bytes']))} "
            f"| {_bytes(_num(ddp['comm_max_bytes']))} "
            f"| {_si(_num(local['root_max']), 'flop')} "
            f"| {_bytes(_num(local['memory_max_bytes']))} |"
        )
    return "\n".join(lines)


def summary_tables(rows: Sequence[dict[str, object]]) -> list[tuple[str, str]]:
    """``(title, markdown table)``: docs/scaling.md's tables, computed from ``rows``.

    Per model, every mode at :data:`SUMMARY_WORLDS` with block size
    :data:`SUMMARY_BLOCK_SIZE`; then every block size at the largest world size.
    """
    out = []
    for model in sorted({str(r["model"]) for r in rows}):
        sub = [r for r in rows if r["model"] == model
               and int(str(r["block_size"])) == SUMMARY_BLOCK_SIZE
               and int(str(r["world"])) in SUMMARY_WORLDS]
        if sub:
            out.append((f"{model}, block size {SUMMARY_BLOCK_SIZE}", markdown_table(sub)))
    worlds = [int(str(r["world"])) for r in rows]
    if worlds:
        out.append((f"Block size at N = {max(worlds)}", block_size_table(rows, max(worlds))))
    return out


def summary_rows(models: Iterable[DecoderShapes] = MODELS.values()) -> list[dict[str, object]]:
    """Only the rows :func:`summary_tables` reads (what docs/scaling.md shows)."""
    models = list(models)
    rows = scaling_rows(models, [SUMMARY_BLOCK_SIZE], SUMMARY_WORLDS, SHARD_GROUPS)
    others = [b for b in BLOCK_SIZES if b != SUMMARY_BLOCK_SIZE]
    return rows + scaling_rows(models, others, [max(SUMMARY_WORLDS)], SHARD_GROUPS)


def write_outputs(rows: Sequence[dict[str, object]], out: Path, plot: bool = True) -> list[Path]:
    """``scaling.csv`` (every column), ``scaling.md`` (a table per model and block size), plot."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "scaling.csv", out / "scaling.md"]
    with written[0].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    sections = ["# Shampoo block plan and owners on Llama-2 shapes", "",
                "Generated by `python -m shampoo_conformance scaling`; see docs/scaling.md.", ""]
    sections += ["## Summary", ""]
    for title, table in summary_tables(rows):
        sections += [f"### {title}", "", table, ""]
    keys = sorted({(str(r["model"]), int(str(r["block_size"]))) for r in rows})
    for model, bs in keys:
        sub = [r for r in rows if r["model"] == model and r["block_size"] == bs]
        sections += [f"## {model}, block size {bs}", "", markdown_table(sub), ""]
    written[1].write_text("\n".join(sections))
    if plot:
        written.append(plot_rows(rows, out / "scaling.png"))
    return written


def plot_rows(rows: Sequence[dict[str, object]], path: Path, block_size: int | None = None
              ) -> Path:
    """Max per rank vs world size, per mode: root work, factor memory, communication.

    At ``block_size`` (default :data:`SUMMARY_BLOCK_SIZE` where the rows have
    it, else their smallest).
    """
    sizes = {int(str(r["block_size"])) for r in rows}
    if block_size is None:
        block_size = SUMMARY_BLOCK_SIZE if SUMMARY_BLOCK_SIZE in sizes else min(sizes)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({str(r["model"]) for r in rows})
    metrics = (("root_max", "root work per root step, max rank [flop]"),
               ("memory_max_bytes", "factor memory, max rank [bytes]"),
               ("comm_max_bytes", "optimizer comm per step, max rank [bytes]"))
    fig, axes = plt.subplots(len(models), len(metrics), figsize=(12, 3.4 * len(models)),
                             squeeze=False)
    modes = sorted({str(r["mode"]) for r in rows}, key=lambda m: (m.startswith("hsdp"),
                                                                  len(m), m))
    for i, model in enumerate(models):
        sub = [r for r in rows
               if r["model"] == model and int(str(r["block_size"])) == block_size]
        for j, (key, label) in enumerate(metrics):
            ax = axes[i][j]
            for n, mode in enumerate(modes):
                pts = sorted((int(str(r["world"])), _num(r[key]))
                             for r in sub if r["mode"] == mode)
                pts = [(x, y) for x, y in pts if y > 0]
                if pts:
                    # ddp wide and lossless dashed: their work and memory coincide.
                    ax.plot(*zip(*pts, strict=True), marker="o", ms=3, label=mode,
                            color=f"C{n}", lw=3.5 if mode == "ddp" else 1.5,
                            ls="--" if mode == "lossless" else "-")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("ranks N")
            ax.set_title(f"{model}: {label}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
        axes[i][0].legend(fontsize=8)
    fig.suptitle(f"block size {block_size}; comm 0 (local) not drawn", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path


def main(out: str, models: Sequence[str] | None = None, block_sizes: Sequence[int] = BLOCK_SIZES,
         world_sizes: Sequence[int] = WORLD_SIZES, shard_groups: Sequence[int] = SHARD_GROUPS,
         plot: bool = True) -> int:
    """The CLI's work: compute every row, write the files, print where they are."""
    chosen = [MODELS[m] for m in (models or list(MODELS))]
    started = time.perf_counter()
    rows = scaling_rows(chosen, block_sizes, world_sizes, shard_groups, log=True)
    for path in write_outputs(rows, Path(out), plot=plot):
        print(path)
    print(f"{len(rows)} rows in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0
