"""The shape plan: how a parameter becomes preconditioned blocks, eqs. (4)-(5), (12).

Pure Python over shapes; every backend calls :func:`plan_parameter` and cuts
blocks with the offsets it returns, so all backends agree on the blocking by
construction.

1. Squeeze: drop size-1 dims (a 0-d or all-ones shape becomes ``(1,)``);
   with ``blocking.squeeze=False`` they stay. A 0-d parameter is one ``(1,)``
   block, with no factor when ``blocking.scalar_factor`` is False (its
   direction is then its filtered gradient).
2. Merge: greedily multiply adjacent dims while the product stays
   ``<= merge_dims_up_to``, scanning in ``merge_direction``.
3. Block: split each merged dim into chunks of ``max_preconditioner_dim``,
   the remainder last; blocks are listed in row-major order of chunk index.
4. Roots: each block dim gets the root r of eq. (12), 0 meaning "not
   preconditioned" (identity factor). With a diagonal preconditioner
   (eq. 16b) every root is 0: the blocks exist (eq. 18 rescales per block)
   but hold no factor.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .config import BlockingConfig, ExponentConfig, ShampooConfig


@dataclass(frozen=True)
class BlockPlan:
    """One block: where it sits in the merged tensor and its roots."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    roots: tuple[float, ...]

    @property
    def slices(self) -> tuple[slice, ...]:
        """Index of this block inside the merged tensor."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.shape, strict=True))

    @property
    def preconditioned_dims(self) -> tuple[int, ...]:
        return tuple(k for k, r in enumerate(self.roots) if r != 0)


@dataclass(frozen=True)
class ParameterPlan:
    """How one parameter is preconditioned.

    ``merged_shape`` is the shape blocks are cut from (at least 1-d).
    ``preconditioned`` is False when a skip rule applies: the parameter then
    takes the graft direction (eq. 14) and has one block with all roots 0.
    """

    shape: tuple[int, ...]
    merged_shape: tuple[int, ...]
    preconditioned: bool
    blocks: tuple[BlockPlan, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def squeeze_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """Drop size-1 dims; a 0-d or all-ones shape becomes ``(1,)`` (eq. 4)."""
    squeezed = tuple(int(d) for d in shape if d != 1)
    return squeezed or (1,)


def merge_dims(
    shape: Sequence[int], up_to: int | None, direction: str = "last_to_first",
    target_rank: int = 1,
) -> tuple[int, ...]:
    """Greedy merge of adjacent dims while the product is <= ``up_to`` (eq. 4).

    ``first_to_last``: walk dims in order, multiplying into the current group
    while it fits, else start a new group. ``last_to_first``: the same walk
    from the last dim, so the leftover small group ends up first. A dim joins
    the current group only while the groups so far plus the dims still to
    walk outnumber ``target_rank`` (Meta's target_parameter_dimensionality),
    so merging stops once the result could keep that many dims.
    """
    dims = list(shape)
    if up_to is None or len(dims) <= 1:
        return tuple(dims)
    if direction == "last_to_first":
        dims.reverse()
    groups = [dims[0]]
    for i, d in enumerate(dims[1:], start=1):
        if len(groups) + len(dims) - i > target_rank and groups[-1] * d <= up_to:
            groups[-1] *= d
        else:
            groups.append(d)
    if direction == "last_to_first":
        groups.reverse()
    return tuple(groups)


def block_offsets(merged_shape: Sequence[int], block: int) -> list[tuple[tuple[int, int], ...]]:
    """Per dim, the (start, length) chunks of size ``block`` (remainder last)."""
    per_dim = []
    for n in merged_shape:
        per_dim.append(tuple((s, min(block, n - s)) for s in range(0, n, block)))
    return per_dim


def _skipped(shape: tuple[int, ...], blocking: BlockingConfig) -> bool:
    if len(shape) < blocking.skip_rank_lt:
        return True
    limit = blocking.skip_dim_size_gt
    return limit is not None and any(d > limit for d in shape)


def _side_mask(rank: int, side: str) -> tuple[bool, ...]:
    """Which merged dims are preconditioned under one-sided preconditioning."""
    if side == "all" or rank <= 1:
        return (True,) * rank
    if side == "all_but_last":
        return (True,) * (rank - 1) + (False,)
    return (False,) * (rank - 1) + (True,)


def block_roots(
    block_order: int, mask: tuple[bool, ...], exponents: ExponentConfig
) -> tuple[float, ...]:
    """The inverse root of each dim of a block, eq. (12); 0 = not preconditioned."""
    for item in exponents.overrides_by_order:
        if item.order == block_order:
            roots = item.roots * block_order if len(item.roots) == 1 else item.roots
            return tuple(float(r) if m else 0.0 for r, m in zip(roots, mask, strict=True))
    if exponents.override > 0:
        base = float(exponents.override)
    elif exponents.default == "block_order":
        base = 2.0 * max(block_order, 1)
    else:
        base = 2.0 * max(sum(mask), 1)
    return tuple(base if m else 0.0 for m in mask)


def plan_parameter(shape: Sequence[int], config: ShampooConfig) -> ParameterPlan:
    """The full plan of one parameter of the given shape (eqs. 4, 5, 12)."""
    shape = tuple(int(d) for d in shape)
    for d in shape:
        if d < 0:
            raise ValueError(f"parameter shape {shape} is invalid: dims must be >= 0.")
    blocking = config.blocking
    # Without squeezing, size-1 dims stay (each a 1 x 1 factor). A 0-d
    # parameter is a (1,) block, with no factor unless scalar_factor.
    kept = squeeze_shape(shape) if blocking.squeeze else (shape or (1,))
    merged = merge_dims(kept, blocking.merge_dims_up_to, blocking.merge_direction,
                        blocking.merge_target_rank)
    no_dims = not blocking.scalar_factor and not shape
    if _skipped(shape, blocking) or math.prod(shape) == 0:
        whole = BlockPlan(offsets=(0,) * len(merged), shape=merged, roots=(0.0,) * len(merged))
        return ParameterPlan(shape, merged, False, (whole,))
    mask = _side_mask(len(merged), blocking.preconditioned_dims)
    chunks = block_offsets(merged, blocking.max_preconditioner_dim)
    blocks = []
    for combo in itertools.product(*chunks):
        offsets = tuple(start for start, _ in combo)
        bshape = tuple(length for _, length in combo)
        if config.spectral is not None and len(bshape) != 2:
            raise ValueError(
                f"parameter shape {shape} gives blocks of shape {bshape} with spectral "
                "descent: allowed 2-D blocks only (eq. 16c orthogonalizes matrices; "
                "blocking.merge_target_rank=2 merges larger parameters to 2-D; "
                "blocking.skip_rank_lt=2 leaves 0-d and 1-d ones to the graft, or put "
                "them in a param group of their own)."
            )
        if no_dims or config.diagonal is not None or config.spectral is not None:
            # Eqs. (16b), (16c): no factor on any dim.
            roots = (0.0,) * len(bshape)
        else:
            roots = block_roots(len(bshape), mask, config.exponents)
        blocks.append(BlockPlan(offsets=offsets, shape=bshape, roots=roots))
    return ParameterPlan(shape, merged, True, tuple(blocks))
