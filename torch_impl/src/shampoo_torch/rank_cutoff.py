"""Eq. (10g): the rank cutoff shared over a parameter's blocks, Lambda_k per (parameter, dim).

With ``epsilon.rank_cutoff_scope = "parameter"`` a block's pseudo-inverse
cutoff scales with the largest eigenvalue of dim k over every block of its
parameter, not its own; the root step waits for every block's statistics,
then :func:`parameter_rank_scales` takes that max (across ranks when
distributed) before the roots are refreshed.
"""

from __future__ import annotations

import math

import torch

from . import preconditioner
from .cohorts import Cohort
from .distributed import Distributor


def parameter_rank_scales(
    cohorts: list[Cohort], device: torch.device, dist: Distributor | None
) -> None:
    """Eq. (10g): ``Lambda_k = max over blocks b of lambda_max(A_{b,k})`` for every
    (parameter, dim k) of the cohorts whose root step cuts the rank per parameter,
    stored per block-group row in ``c.rank_scales``.

    Blocks of all parameters share block groups (by shape), so each row's
    lambda_max (:func:`preconditioner.largest_eigenvalues`: -inf for a row
    that is not admitted or not finite) goes to its (parameter, k) slot by one
    scatter max per group and dim; the max never crosses parameters. The slots
    are laid out from the plans (every stepping parameter, every dim), not
    from the rows held here, so they agree across ranks: distributed, one
    all-reduce (max) over the trainer group, whose ranks own the parameter's
    blocks between them, completes every slot at once (a max is exact and
    order-free, so the result equals one process bit for bit). Then each
    row reads its slot back. Called on every rank alike (the cohorts and
    their root steps are the same on every rank).
    """
    jobs = [c for c in cohorts if c.cuts_rank_per_parameter and c.root_step]
    dtype = (torch.float64 if any(c.inp.gp.factor_dtype == torch.float64 for c in jobs)
             else torch.float32)  # exact for every group's Lambda (a max of its values)
    slots: dict[tuple[int, int, int], int] = {}  # (cohort, position, dim) -> slot
    for j, c in enumerate(jobs):
        for pos in c.positions:
            plan = c.inp.gp.layouts[pos].plan
            if plan.preconditioned:
                for k in range(max(len(b.shape) for b in plan.blocks)):
                    slots[(j, pos, k)] = len(slots)
    lambdas = torch.full((len(slots),), -math.inf, dtype=dtype, device=device)
    reads: list[tuple[Cohort, int, int, torch.Tensor]] = []
    for j, c in enumerate(jobs):
        gp = c.inp.gp
        for index, (members, rows, ok) in c.selected.items():
            bg = gp.block_groups[index]
            for k in bg.dims:
                top = preconditioner.largest_eigenvalues(bg, k, rows, ok, c.config)
                ids = torch.tensor([slots[(j, bg.members[r][0], k)] for r in members],
                                   dtype=torch.int64, device=device)
                lambdas.scatter_reduce_(0, ids, top.to(device, dtype), "amax")
                reads.append((c, index, k, ids))
    if dist is not None:
        dist.max_over_trainers(lambdas)
    for c, index, k, ids in reads:
        bg = c.inp.gp.block_groups[index]
        lam = lambdas.index_select(0, ids).to(bg.device, bg.dtype)
        c.rank_scales.setdefault(index, {})[k] = lam
