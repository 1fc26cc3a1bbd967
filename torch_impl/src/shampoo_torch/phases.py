"""Phases 3-5 of the step (:mod:`shampoo_torch.optimizer`) per cohort: the block state,
the directions, their exchange between ranks and the parameter update.

- :func:`block_state`: eqs. (6)-(13), (17) per block group (statistics, inverse roots,
  corrected moment); the roots of a root step come after the statistics, after every
  group's eq. (10g) scales (3b), or after the directions (eq. 8 ``"next_step"``, 4b),
  as :attr:`~shampoo_torch.cohorts.Cohort.roots_after` says: :func:`refresh_roots`.
- :func:`directions`: eq. (14c) per parameter, eqs. (16)-(18) per block group.
- :func:`exchange`: distributed, one all-gather of the owners' block directions.
- :func:`update`: eqs. (18)-(22) per parameter (:mod:`shampoo_torch.updates`).

Distributed (``distributed=DistributedConfig(...)``, :mod:`shampoo_torch.distributed`):
phase 3 and the per-block part of phase 4 run on the owning rank only, and one
all-gather at the end of phase 4 gives every rank every block's direction.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shampoo_spec import is_statistics_step

from . import grafting, preconditioner, updates
from .blocks import gather, row_chunks, select_rows
from .cohorts import Cohort
from .device_path import batches, on_cpu_path
from .distributed import BlockKey, Distributor
from .metrics import StepCounters


@dataclass
class StepContext:
    """What phases 3-5 read of the optimizer: its state and param groups, counters, the
    distributor (None in one process or each rank on its own pieces), the device, and
    the ``lr`` given at construction (eq. 19's ``scale_by_lr_ratio``)."""

    state: Mapping[torch.Tensor, dict[str, Any]]
    param_groups: Sequence[dict[str, Any]]
    counters: StepCounters
    dist: Distributor | None
    device: torch.device
    lr_override: float | None


def block_state(ctx: StepContext, c: Cohort) -> None:
    """Eqs. (6)-(13), (17) per block group: statistics, inverse roots, corrected moment."""
    gp, cfg = c.inp.gp, c.config
    c.selected = select_rows(gp.block_groups, gp.flat_rows, c.positions, c.inp.ok)
    for index, (members, rows, ok) in c.selected.items():
        bg = gp.block_groups[index]
        if is_statistics_step(c.t, cfg.schedule):
            # Eq. (6c): G^, the averaged gradients with average_gradients, else G;
            # in chunks of rows (blocks.WORKSPACE_BYTES): the stacked gradient
            # blocks do not grow with the group.
            observed = c.averaged_g or c.g
            row_bytes = math.prod(bg.shape) * torch.finfo(bg.dtype).bits // 8
            for part, part_rows in row_chunks(rows, len(members), row_bytes, bg.device):
                preconditioner.update_statistics(
                    bg, gather(bg, gp.layouts, observed, members[part]), part_rows,
                    None if ok is None else ok[part], cfg.statistics,
                    zero_refused=not c.averaged_g)  # c.g is 0 where eq. (3) refused
        if c.roots_after == "statistics":  # else in step 3b or 4b
            refresh_group_roots(ctx, c, index)
        if cfg.eigenvalue_correction is not None:
            # Eq. (17a): with eigenbases in another dtype, the gradient rounded to it
            # straight from its own, as Meta's grad.to(...).
            dtype = bg.root_dtype if bg.rounds_roots and bg.dims else None
            preconditioner.update_corrected_moment(
                bg, gather(bg, gp.layouts, c.g, members, dtype), rows, ok,
                cfg.eigenvalue_correction
            )

def refresh_roots(ctx: StepContext, c: Cohort) -> None:
    """Eqs. (7), (9)-(13) for every block group of the cohort (after its directions)."""
    for index in c.selected:
        refresh_group_roots(ctx, c, index)

def refresh_group_roots(ctx: StepContext, c: Cohort, index: int) -> None:
    """Eqs. (7), (9)-(13) for one block group on a root step; counts the failures."""
    if not c.root_step:
        return
    members, rows, ok = c.selected[index]
    bg = c.inp.gp.block_groups[index]
    scales = c.rank_scales.get(index) if c.cuts_rank_per_parameter else None
    # Eq. (10d), packing "google": the largest factor of the param group.
    largest = max((g.shape[k] for g in c.inp.gp.block_groups for k in g.factors), default=0)
    updated, failures = preconditioner.refresh_inverse_roots(bg, rows, ok, c.config, c.t,
                                                             scales, largest)
    ctx.counters.on(bg.device)["root_failures"].add_(failures)
    c.root_counts.append((bg, members, updated))

def directions(ctx: StepContext, c: Cohort) -> None:
    """Eq. (14c) per parameter; eqs. (16)-(17) per block group, (18) when per block.

    The block directions are those of the blocks held here (all of them in
    one process, the owned ones when distributed), needed when the step
    uses Shampoo or separate momentum buffers keep its direction.
    """
    gp, cfg, params = c.inp.gp, c.config, c.inp.params
    graft = cfg.grafting

    def graft_direction(i: int) -> torch.Tensor:
        if graft.factored:  # eq. (14e): in the parameter's own shape, scaled by rms(W)
            return grafting.adafactor_direction(c.filtered[i], ctx.state[params[i]],
                                                c.inp.w[i], gp.layouts[i].plan.shape, graft)
        return grafting.direction(c.filtered[i], ctx.state[params[i]].get("graft"), c.t,
                                  graft)

    # The graft directions _update reads; the others (the preconditioned parameters'
    # with eq. 18 per block and one momentum buffer) only scale their blocks here,
    # so each is formed when its first block needs it and dropped after its last:
    # never every parameter's at once beside the block directions. The accelerator
    # path forms them all at once instead: one launch per op for the lot.
    per_block = graft.rescale_scope == "block"
    lazy = (on_cpu_path(ctx.device) and c.use_shampoo and per_block
            and not cfg.momentum.separate_buffers)
    only_here = {i for i in c.positions if lazy and gp.layouts[i].plan.preconditioned}
    wanted = [i for i in c.positions if i not in only_here]
    if graft.factored:
        c.graft_dir = {i: graft_direction(i) for i in wanted}
    else:  # eq. (14c) as foreach ops across each batch
        c.graft_dir = {}
        for batch in batches(wanted, ctx.device):
            c.graft_dir.update(zip(batch, grafting.directions(
                [c.filtered[i] for i in batch],
                [ctx.state[params[i]].get("graft") for i in batch], c.t, graft),
                strict=True))
    if not (c.use_shampoo or cfg.momentum.separate_buffers):
        return
    # Eq. (16b): a diagonal preconditioner's blocks are D(F~) (eq. 14c with its
    # own V_D); every root is 0, so eq. (16) passes them through unchanged.
    source = c.filtered
    if cfg.diagonal is not None:
        diagonal = cfg.diagonal.as_graft()
        source = {
            i: grafting.direction(c.filtered[i], ctx.state[params[i]].get("diagonal"),
                                  c.t, diagonal)
            for i in c.positions
        }
    c.owned = {}
    blocks_left = Counter(gp.block_groups[index].members[r][0]
                          for index, (members, _, _) in c.selected.items() for r in members)
    dirs = c.graft_dir  # with the only_here ones while their blocks remain
    for index, (members, rows, _) in c.selected.items():
        bg = gp.block_groups[index]
        # In chunks of rows (blocks.WORKSPACE_BYTES), so the stacked blocks and
        # the mode products in flight do not grow with the group.
        row_bytes = math.prod(bg.shape) * torch.finfo(bg.dtype).bits // 8
        for part, part_rows in row_chunks(rows, len(members), row_bytes, bg.device):
            chunk = members[part]
            # Eq. (16) with inverse_root_dtype: the filtered gradient is rounded
            # to the roots' dtype straight from its own (as Meta's grad.to(...)),
            # not through the factor dtype (two roundings could differ).
            fb = gather(bg, gp.layouts, source, chunk,
                        bg.root_dtype if bg.rounds_roots and bg.dims else None)
            pb = preconditioner.shampoo_direction(bg, fb, part_rows, cfg)
            if per_block:
                for pos in {bg.members[r][0] for r in chunk} - dirs.keys():
                    dirs[pos] = graft_direction(pos)
                gd = gather(bg, gp.layouts, dirs, chunk)
                # shampoo_direction returns fb itself or a new tensor, never a view.
                fresh = pb is not fb
                pb = preconditioner.rescale_blocks_to_graft(pb, gd, graft.norm_epsilon,
                                                            in_place=fresh)
            complete = []
            for j, r in enumerate(chunk):
                c.owned[bg.members[r]] = pb[j]
                pos = bg.members[r][0]
                blocks_left[pos] -= 1
                if blocks_left[pos] == 0:
                    complete.append(pos)
            for pos in complete:
                if pos in only_here and not cfg.momentum.enabled:
                    dirs.pop(pos, None)  # its blocks are scaled; the update never reads it
                if ctx.dist is None and on_cpu_path(ctx.device):
                    # One process, CPU path: phase 5 for a parameter whose blocks
                    # are all here, now: its block directions never wait beside
                    # every other parameter's (nothing later in phase 4 reads it).
                    # The accelerator path updates the cohort in one batch.
                    updates.update_parameters(
                        c, [pos], {(c.inp.gi, pos, b): c.owned[(pos, b)]
                                   for b in range(gp.layouts[pos].num_blocks)},
                        ctx.state, ctx.param_groups[c.inp.gi], ctx.lr_override)
                if pos in only_here:
                    dirs.pop(pos, None)

def exchange(ctx: StepContext, cohorts: list[Cohort]) -> dict[BlockKey, torch.Tensor]:
    """Every block's direction, keyed (group, position, block).

    One process: the blocks computed here that phase 4 has not already
    consumed (it updates a parameter as its blocks complete, so none in
    practice). Distributed: one all-gather of
    the owners' directions (:meth:`Distributor.exchange_directions`); the
    gathered values are used on every rank, the owner's included.
    """
    wanted = [c for c in cohorts if c.owned is not None]
    mine = {(c.inp.gi, pos, b): d for c in wanted for (pos, b), d in (c.owned or {}).items()}
    if ctx.dist is None or not wanted:
        return mine
    parts = []
    for c in wanted:
        gp = c.inp.gp
        assert gp.owners is not None
        plans = {pos: gp.layouts[pos].plan for pos in c.positions}
        parts.append((c.inp.gi, plans, gp.owners, gp.factor_dtype))
    return ctx.dist.exchange_directions(parts, mine, ctx.device)

def update(ctx: StepContext, c: Cohort, blocks: dict[BlockKey, torch.Tensor]) -> None:
    """Phase 5 for every parameter of the cohort not yet updated in phase 4."""
    updates.update_parameters(c, [i for i in c.positions if i not in c.updated], blocks,
                              ctx.state, ctx.param_groups[c.inp.gi], ctx.lr_override)
    updates.count_withheld(c, ctx.counters)

