"""One parameter's blocks as a grid (docs/spec.md eqs. 3, 5): per-block reductions and
per-block flags expanded back to the entries, with no loop over blocks.

Eq. (3) refuses a block's step from ``max |G|`` over the block
(:func:`block_max_abs`, :mod:`shampoo_torch.refusal`), and a refused block's
entries are masked by its flag expanded to the parameter (:func:`expand_blocks`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shampoo_spec import ParameterPlan


@dataclass(frozen=True)
class BlockGrid:
    """The blocks of one parameter (eq. 5) as a grid: chunks along each merged dim.

    Blocks are the Cartesian product of the chunks of each merged dim,
    row-major, so a per-block reduction is separable: reducing the chunks of
    one dim after the other gives every block's result at once, without a
    loop over blocks (:func:`block_max_abs`), and a per-block flag expands
    back to the entries by one ``index_select`` per dim (:func:`expand_blocks`).
    """

    merged_shape: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]  # per merged dim, the chunk lengths (remainder last)
    index: tuple[torch.Tensor, ...]  # per merged dim, the chunk of each entry (multi-block)
    sizes: torch.Tensor  # [blocks] float64: entries per block (|B| of eq. 3)

    @property
    def shape(self) -> tuple[int, ...]:
        """Chunks per dim; the grid of blocks."""
        return tuple(len(c) for c in self.chunks)

    @property
    def num_blocks(self) -> int:
        return len(self.sizes)


def block_grid(plan: ParameterPlan, device: torch.device) -> BlockGrid:
    """The :class:`BlockGrid` of a plan (any plan: a skipped one has one whole block)."""
    merged = plan.merged_shape
    starts: list[dict[int, int]] = [{} for _ in merged]
    for block in plan.blocks:
        for k, (o, n) in enumerate(zip(block.offsets, block.shape, strict=True)):
            starts[k][o] = n
    chunks = tuple(tuple(n for _, n in sorted(s.items())) for s in starts)
    index: tuple[torch.Tensor, ...] = ()
    if len(plan.blocks) > 1:
        index = tuple(
            torch.repeat_interleave(torch.arange(len(c)), torch.tensor(c, dtype=torch.int64))
            .to(device) for c in chunks
        )
    sizes = torch.tensor([float(math.prod(b.shape)) for b in plan.blocks],
                         dtype=torch.float64).to(device)
    return BlockGrid(merged, chunks, index, sizes)


def block_max_abs(grid: BlockGrid, x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` over each block of a merged-shape tensor: ``[blocks]``, row-major.

    NaN propagates (a block holding a NaN gets NaN); an empty block gets 0.
    """
    if x.numel() == 0:
        return torch.zeros(grid.num_blocks, dtype=x.dtype, device=x.device)
    y = x.abs()
    if grid.num_blocks == 1:
        return y.amax().reshape(1)
    for k, chunks in enumerate(grid.chunks):
        if len(chunks) == 1:
            y = y.amax(k, keepdim=True)
            continue
        d, q = chunks[0], len(chunks) - (chunks[-1] != chunks[0])
        full = y.narrow(k, 0, q * d).unflatten(k, (q, d)).amax(k + 1)
        if q == len(chunks):
            y = full
        else:
            rest = y.narrow(k, q * d, chunks[-1]).amax(k, keepdim=True)
            y = torch.cat([full, rest], dim=k)
    return y.reshape(-1)


def expand_blocks(grid: BlockGrid, flags: torch.Tensor) -> torch.Tensor:
    """Per-block values ``[blocks]`` as a merged-shape tensor (each entry its block's value).

    A parameter of one block gets a 0-d tensor (it broadcasts).
    """
    if grid.num_blocks == 1:
        return flags.reshape(())
    out = flags.reshape(grid.shape)
    for k, index in enumerate(grid.index):
        if len(grid.chunks[k]) > 1:
            out = out.index_select(k, index)
        else:
            out = out.expand(*out.shape[:k], grid.merged_shape[k], *out.shape[k + 1:])
    return out
