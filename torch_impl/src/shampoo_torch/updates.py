"""Phase 5 of the step: eqs. (18)-(22) per parameter, batched across a cohort on the
accelerator path.

For each parameter: its Shampoo direction assembled from its blocks and rescaled
per parameter (eq. 18), direction decay and momentum (eqs. 19-20,
:func:`~shampoo_torch.elementwise.momentum`), iterate averaging (eq. 20d), and the
guarded update (eqs. 21-22, :func:`~shampoo_torch.elementwise.apply_update`).

On the accelerator path (:mod:`.device_path`) the update of every parameter that
keeps no buffer (no momentum, no averaging, no ``update_dtype``) is one batch:
:func:`~shampoo_torch.elementwise.apply_updates`, the same ops per tensor as
``apply_update`` (so the same bits) with the elementwise arithmetic as
``torch._foreach_*`` ops, one launch each for the cohort. The CPU path updates one
parameter at a time, with its host shortcut for eq. (22).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from . import elementwise, preconditioner
from .blocks import assemble
from .cohorts import LR_POWER_SUM, Cohort, write_back
from .device_path import on_cpu_path
from .distributed import BlockKey
from .metrics import StepCounters


def parameter_direction(c: Cohort, i: int, blocks: Mapping[BlockKey, torch.Tensor]
                        ) -> torch.Tensor:
    """Parameter ``i``'s Shampoo direction from its blocks, rescaled per parameter (eq. 18).

    A parameter the skip rules leave unpreconditioned takes its graft direction.
    """
    gp, graft = c.inp.gp, c.config.grafting
    lay = gp.layouts[i]
    if not lay.plan.preconditioned:
        return c.graft_dir[i]
    p = assemble(lay, [blocks[(c.inp.gi, i, b)] for b in range(lay.num_blocks)], gp.dtypes[i])
    if graft.rescale_scope == "parameter":
        p = preconditioner.rescale_to_graft(p, c.graft_dir[i], graft.norm_epsilon)
    return p


def update_parameters(
    c: Cohort, positions: list[int], blocks: MutableMapping[BlockKey, torch.Tensor],
    state: Mapping[torch.Tensor, dict[str, Any]], group: Mapping[str, Any],
    lr_0: float | None,
) -> None:
    """Eq. (18) per parameter, eqs. (19)-(22) for the parameters ``positions`` of ``c``:
    assemble, rescale, momentum, guarded update; their block directions are let go
    once assembled. ``group``: their param group (eq. 20d's sum of lr powers);
    ``lr_0``: the rate eq. (19)'s ``scale_by_lr_ratio`` divides by (None: the config's).
    """
    inp, cfg = c.inp, c.config
    batch: list[tuple[int, torch.Tensor]] = []
    for i in positions:
        c.updated.add(i)
        shampoo_dir = None if c.owned is None else parameter_direction(c, i, blocks)
        if c.owned is not None:
            for b in range(inp.gp.layouts[i].num_blocks):
                c.owned.pop((i, b), None)
                blocks.pop((inp.gi, i, b), None)
        st = state[inp.params[i]]
        st["step"] = c.t
        ok = c.elem_ok.get(i)
        u, buffers = elementwise.momentum(st, shampoo_dir, c.graft_dir.get(i), inp.w[i],
                                          c.use_shampoo, cfg, inp.lr, ok, lr_0)
        if (not buffers and cfg.averaging is None and cfg.update_dtype is None
                and not on_cpu_path(u.device)):
            batch.append((i, u))
            continue
        delta = None
        if cfg.averaging is not None:  # eq. (20d)
            mu_x = cfg.averaging.eval_coefficient(inp.lr, group.get(LR_POWER_SUM, 0.0))
            delta, buffers["averaged"] = elementwise.averaged_step(
                st, u, inp.w[i], cfg, inp.lr, mu_x, ok, lr_0)
        withheld = elementwise.apply_update(inp.targets.get(i, inp.params[i]), inp.w[i], u,
                                            buffers, st, cfg, inp.lr, ok, delta)
        write_back(inp, i)  # lossless FSDP2: this rank's piece of the new parameter
        c.withheld.append(withheld.reshape(1))
    if batch:
        c.withheld.append(elementwise.apply_updates(
            [inp.targets.get(i, inp.params[i]) for i, _ in batch],
            [inp.w[i] for i, _ in batch], [u for _, u in batch], cfg, inp.lr,
            [c.elem_ok.get(i) for i, _ in batch]))
        for i, _ in batch:
            write_back(inp, i)


def count_withheld(c: Cohort, counters: StepCounters) -> None:
    """Adds the cohort's eq. (22) withheld parameter steps to ``withheld_updates``: one
    sum and one add for the cohort, not an add per parameter."""
    if not c.withheld:
        return
    flags = c.withheld[0] if len(c.withheld) == 1 else torch.cat(c.withheld)
    count = flags.sum()
    counters.on(count.device)["withheld_updates"].add_(count)
