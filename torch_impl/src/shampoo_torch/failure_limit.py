"""Eq. (13)'s limit on consecutive root failures, checked at the end of a step.

A failed inverse root keeps the previous one (eq. 13) and is counted per
block; when a block's count passes ``failure.max_consecutive_root_failures``
the step raises RootFailureError, but only after every parameter was
updated, so a step is never half done. Distributed, every rank raises for
the same block (one all-reduce over the trainer group on root steps); with
``shard_mode="local"`` every rank raises, or none (one flag over the world).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from shampoo_spec import RootFailureError

from .cohorts import Cohort
from .distributed import Distributor
from .state import ParamGroupPlan


def check_root_failures(
    cohorts: list[Cohort], plans: Sequence[ParamGroupPlan], dist: Distributor | None,
    shard_mode: str | None, device: Callable[[], torch.device],
) -> None:
    """Eq. (13): raise when a block's inverse roots failed too many root steps in a row.

    Checked at the end of the step, after every parameter was updated
    (the failed inverse roots kept the previous ones), so the step is
    complete when it raises; distributed: one all-reduce over the trainer
    group on root steps, so every rank raises for the same block (named
    with its owner).
    """
    exceeded: tuple[int, ...] | None = None  # (group, position, block, count, step)
    checked = False
    for c in cohorts:
        limit = c.config.failure.max_consecutive_root_failures
        if limit is None or not c.root_step:
            continue
        checked = True
        for bg, members, updated in c.root_counts:
            over = updated > limit
            if bool(over.any()):  # root steps only (amortized)
                j = int(torch.nonzero(over)[0, 0])
                pos, block = bg.members[members[j]]
                found = (c.inp.gi, pos, block, int(updated[j]), c.t)
                exceeded = found if exceeded is None else min(exceeded, found)
    where = ""
    if dist is not None and checked:
        agreed = dist.first_flagged(exceeded, 5, device(), whole_world=False)
        exceeded = None if agreed is None else agreed[1]
        if agreed is not None:
            where = f" (owned by rank {agreed[0]}; every rank raises this error)"
    if shard_mode == "local" and any(
            gp.config.failure.max_consecutive_root_failures is not None
            for gp in plans):  # every step, on every rank
        _agree_local_root_failure(exceeded is not None, device)
    if exceeded is None:
        return
    gi, pos, block, count, t = exceeded
    gp = plans[gi]
    raise RootFailureError(
        f"inverse roots of block {block} (shape {gp.layouts[pos].plan.blocks[block].shape}) "
        f"of parameter {gp.names[pos]!r} failed on {count} root steps in a row, the last "
        f"at step {t} (failure.max_consecutive_root_failures="
        f"{gp.config.failure.max_consecutive_root_failures}){where}. This step was "
        "completed (every parameter updated, the failed inverse roots kept the previous "
        "ones) before raising."
    )


def _agree_local_root_failure(mine: bool, device: Callable[[], torch.device]) -> None:
    """``shard_mode="local"``, eq. (13) limit: every rank raises, or none (one flag)."""
    import torch.distributed as tdist

    flag = torch.tensor([int(mine)], dtype=torch.int32, device=device())
    tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
    if int(flag.item()) and not mine:
        raise RootFailureError(
            "inverse roots of a block of another rank's pieces failed too many root steps "
            "in a row (failure.max_consecutive_root_failures; shard_mode='local': that "
            "rank's error names the block). This step was completed before raising."
        )
