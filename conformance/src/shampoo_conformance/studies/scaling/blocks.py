"""A model's blocks as arrays, their ``Shard(0)`` chunks, owners and lower bounds.

The block plan is the spec's (eqs. 4-5, :func:`shampoo_spec.plan_parameter`),
the costs its :func:`shampoo_spec.block_cost` and the owners its load
balancer (:func:`shampoo_spec.assign_blocks`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shampoo_spec import ShampooConfig, assign_blocks, block_cost, plan_parameter


def shard_rows(rows: int, world: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each rank's ``Shard(0)`` chunk of ``rows`` rows.

    ``torch.chunk``'s cut, as FSDP2 uses it: chunks of ``ceil(rows / world)``
    rows, the last one shorter, ranks past the last chunk empty.
    """
    step = -(-rows // world)
    return [(min(r * step, rows), min((r + 1) * step, rows) - min(r * step, rows))
            for r in range(world)]


def shard_lengths(rows: int, world: int) -> np.ndarray:
    """The lengths of :func:`shard_rows`, as an array."""
    step = -(-rows // world)
    start = np.minimum(np.arange(world, dtype=np.int64) * step, rows)
    lengths: np.ndarray = np.minimum(start + step, rows) - start
    return lengths


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
