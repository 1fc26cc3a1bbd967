"""Which rank owns which block: a deterministic, load-balanced assignment.

Distributed Shampoo (arXiv 2309.06497, section 3) keeps the Kronecker
factors of a block (eq. 6), computes its roots (eqs. 7-13) and its search
direction (eqs. 16-17) on one rank only, its *owner*, and shares the
directions with one all-gather. Every rank must arrive at the same owners
without talking to the others, so the rule is a pure function of the shape
plans (:func:`shampoo_spec.plan_parameter`) and the config, framework-neutral,
and lives here.

Cost of a block B with dims ``n_k`` (``k`` over its preconditioned dims,
root != 0) is a vector of three loads (:class:`BlockCost`):

- ``step``: floating-point operations of every step, ``|B|`` for the
  elementwise work plus, per k, ``2 n_k |B| / statistics_frequency``
  (eq. 6, ``G_(k) G_(k)^T``) and ``2 n_k |B|`` (eq. 16, one mode product);
- ``root``: operations of one root step (eqs. 9-11),
  ``ROOT_FLOPS_PER_CUBE n_k^3`` per k; ``ROOT_FLOPS_PER_CUBE = 10`` is the
  usual estimate of a symmetric eigendecomposition with eigenvectors (about
  ``9 n^3``) plus forming ``Q diag Q^T`` (it puts ``root`` on the scale of
  ``step``; the assignment normalizes each load, so it does not change owners);
- ``memory``: entries of factor state, ``2 n_k^2`` per k (factor and root).

All three matter: every rank waits for the others at each step's
all-gather, so the per-step work sets the step time; the root work sets the
time of the (amortized) root steps; the memory sets what fits.

Assignment: greedy vector scheduling, which is longest processing time
(LPT) for a single load. Each load is normalized by its total; blocks are
taken in decreasing order of their summed normalized loads (ties: lower
block index first), each to the rank whose largest normalized load after
taking it is smallest (ties: smaller summed load, then lower rank). With
one load this is LPT, whose makespan is at most ``(4/3 - 1/(3m))`` times the
optimum for ``m`` ranks (Graham 1969). With ``d`` loads, every normalized
load of every rank ends at most ``d/m + `` the largest normalized load of
one block. Ranks may own no block (fewer blocks than ranks).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .config import ShampooConfig
from .plan import BlockPlan, ParameterPlan

#: Floating-point operations of one inverse root (or eigenbasis) of an n x n factor, per n^3.
ROOT_FLOPS_PER_CUBE = 10.0


@dataclass(frozen=True)
class BlockCost:
    """The loads of a block: ``step`` and ``root`` flops, ``memory`` entries (module doc)."""

    step: float
    root: float
    memory: int

    def vector(self) -> tuple[float, float, float]:
        """The loads :func:`assign_blocks` balances: (step, root, memory)."""
        return (self.step, self.root, float(self.memory))


def block_cost(block: BlockPlan, config: ShampooConfig) -> BlockCost:
    """The cost of one block under ``config`` (see the module docstring for the formula)."""
    size = math.prod(block.shape)
    step = float(size)
    root = 0.0
    memory = 0
    for k in block.preconditioned_dims:
        n = block.shape[k]
        step += 2.0 * n * size / config.schedule.statistics_frequency + 2.0 * n * size
        root += ROOT_FLOPS_PER_CUBE * n**3
        memory += 2 * n * n
    return BlockCost(step=step, root=root, memory=memory)


def plan_block_costs(plans: Sequence[ParameterPlan], config: ShampooConfig) -> list[BlockCost]:
    """Costs of the blocks of the preconditioned parameters, in plan order.

    The order is the canonical block order shared by every rank: parameters
    in the given order, each parameter's blocks in row-major order (eq. 5);
    parameters that a skip rule leaves unpreconditioned have no blocks here.
    """
    return [block_cost(b, config) for p in plans if p.preconditioned for b in p.blocks]


@dataclass(frozen=True)
class Assignment:
    """``owners[i]``: the rank of block i; ``loads[r]``: rank r's summed cost vector."""

    owners: tuple[int, ...]
    loads: tuple[tuple[float, ...], ...]

    def blocks_of(self, rank: int) -> tuple[int, ...]:
        """The block indices owned by ``rank``, ascending."""
        return tuple(i for i, r in enumerate(self.owners) if r == rank)


def _vectors(costs: Sequence[float | Sequence[float]]) -> list[tuple[float, ...]]:
    out = [(float(c),) if isinstance(c, (int, float)) else tuple(float(x) for x in c)
           for c in costs]
    width = len(out[0]) if out else 1
    for i, c in enumerate(out):
        if len(c) != width or not all(math.isfinite(x) and x >= 0.0 for x in c):
            raise ValueError(
                f"costs[{i}] = {costs[i]!r} is invalid: allowed a finite number >= 0, or "
                f"{width} such numbers (every block the same count)."
            )
    return out


def assign_blocks(
    costs: Sequence[float | Sequence[float]],
    world_size: int,
    initial_loads: Sequence[float | Sequence[float]] | None = None,
) -> Assignment:
    """Greedy assignment of blocks with ``costs`` (numbers or vectors) to ``world_size`` ranks.

    ``initial_loads`` (one per rank, numbers or vectors like ``costs``)
    continue an earlier assignment, e.g. of the previous param group, so the
    balance holds over all groups. Pure and deterministic: equal inputs give
    equal owners on every rank.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size = {world_size!r} is invalid: allowed an integer >= 1.")
    vectors = _vectors(costs)
    width = len(vectors[0]) if vectors else (
        len(_vectors(initial_loads)[0]) if initial_loads else 1)
    if initial_loads is None:
        loads = [[0.0] * width for _ in range(world_size)]
    else:
        given = list(initial_loads)
        start = _vectors(given) if len(given) == world_size else []
        if len(start) != world_size or any(len(v) != width for v in start):
            raise ValueError(
                f"initial_loads = {given!r} is invalid: allowed {world_size} loads (one per "
                f"rank) of {width} finite numbers >= 0."
            )
        loads = [list(v) for v in start]
    totals = [sum(v[k] for v in vectors) + sum(r[k] for r in loads) for k in range(width)]
    scale = [1.0 / t if t > 0.0 else 0.0 for t in totals]

    def normalized(v: Sequence[float]) -> list[float]:
        return [x * s for x, s in zip(v, scale, strict=True)]

    owners = [0] * len(vectors)
    order = sorted(range(len(vectors)), key=lambda j: (-sum(normalized(vectors[j])), j))

    def after(r: int, c: tuple[float, ...]) -> tuple[float, float, int]:
        new = normalized([a + b for a, b in zip(loads[r], c, strict=True)])
        return (max(new), sum(new), r)

    # The rule is rank = min(range(world_size), key=after); the keys are unique
    # (they end in r). While equal blocks follow each other (as sorted equal
    # vectors do), only the rank that took the last one changes its key, so a
    # heap of every rank's key gives the same minimum in O(log world_size)
    # per block; a new cost vector rebuilds the heap.
    heap: list[tuple[float, float, int]] = []
    current: tuple[float, ...] | None = None
    for i in order:
        c = vectors[i]
        if c != current:
            current = c
            heap = [after(r, c) for r in range(world_size)]
            heapq.heapify(heap)
        rank = heapq.heappop(heap)[2]
        owners[i] = rank
        loads[rank] = [a + b for a, b in zip(loads[rank], c, strict=True)]
        heapq.heappush(heap, after(rank, c))
    return Assignment(owners=tuple(owners), loads=tuple(tuple(v) for v in loads))
