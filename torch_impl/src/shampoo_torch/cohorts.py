"""The bookkeeping of one :meth:`Shampoo.step <shampoo_torch.Shampoo.step>`.

:class:`StepInput`: one param group's merged parameters and gradients at
this step (eqs. 1-2) and its eq. (3) flags. :class:`Cohort`: the parameters
of a param group at the same step t (parameters that missed steps run on
their own counter), which the phases of the step fill in turn: per-entry
flags and filtered gradients, the block-group rows taking part, root-step failure counts,
graft and block directions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from shampoo_spec import ShampooConfig, is_root_step, learning_rate_ratio, uses_preconditioner

from . import sharding
from .arguments import BETAS, MOMENTUM
from .blocks import BlockGroup, Rows
from .device_path import moved
from .state import ParamGroupPlan

#: The param-group key holding the group's learning rate at its first step
#: (eq. 8b's lr_1), set with ``schedule.precondition_frequency_growth`` only.
FIRST_LR = "first_step_lr"
#: Param-group keys of eq. (20d): which sequence the parameters hold ("train" or
#: "eval"), and Schedule-Free's sum of lr_i^p over the steps so far.
AVERAGING_MODE = "averaging_mode"
LR_POWER_SUM = "lr_power_sum"


@dataclass
class StepInput:
    """One param group at this step: merged parameters and gradients (eqs. 1-2)."""

    gi: int
    gp: ParamGroupPlan
    params: list[torch.Tensor]
    active: list[int]
    w: dict[int, torch.Tensor]
    g: dict[int, torch.Tensor]
    steps: dict[int, int]
    lr: float
    #: eq. (15)'s beta1 and eq. (20)'s mu at this step: the group's ``"betas"[0]`` and
    #: ``"momentum"`` (a scheduler may cycle them), else the config's.
    beta1: float
    momentum: float
    #: eq. (8b): lr / the group's learning rate at its first step (1 before it).
    lr_ratio: float
    #: eq. (3) ``"skip_block"``: per block of the param group (flat order, see
    #: :class:`~shampoo_torch.state.ParamGroupPlan`), whether its step is taken;
    #: None: every block's is (the ``"raise"`` policy, after its check).
    ok: torch.Tensor | None = None
    #: the accelerator path: ``ok``'s entry of each one-block parameter, a 0-d view
    #: made once (:class:`~shampoo_torch.block_grid.BlockVector`); empty otherwise.
    ok_single: Mapping[int, torch.Tensor] = field(default_factory=dict)
    #: per parameter, the plain tensor its update is written into (eq. 21): the
    #: parameter, or for a DTensor its piece (``"local"``) or its gathered whole
    #: (``"lossless"``, whose piece :func:`write_back` then copies).
    targets: dict[int, torch.Tensor] = field(default_factory=dict)
    #: the step runs as a compiled graph (:mod:`shampoo_torch.compiled`): the host ints
    #: (each parameter's step count, the steps of pending refusals) are written after
    #: it, on the host, not by the graph.
    in_graph: bool = False


#: When a root step refreshes a cohort's roots (:attr:`Cohort.roots_after`).
RootsAfter = Literal["statistics", "rank_scales", "directions"]


@dataclass
class Cohort:
    """The parameters of a param group at the same step t, filled in phase by phase."""

    inp: StepInput
    t: int
    positions: list[int]
    g: dict[int, torch.Tensor]  # the gradients; "skip_block" zeroes refused blocks
    #: per parameter, eq. (3) ``"skip_block"``: whether each entry's block steps.
    elem_ok: dict[int, torch.Tensor] = field(default_factory=dict)
    filtered: dict[int, torch.Tensor] = field(default_factory=dict)
    #: eq. (6c), ``average_gradients``: per parameter G^ = S / s, what the statistics
    #: take in place of ``g`` (empty otherwise).
    averaged_g: dict[int, torch.Tensor] = field(default_factory=dict)
    #: per block group index: its rows here, their index tensor, their finite flags.
    selected: dict[int, tuple[list[int], Rows, torch.Tensor | None]] = field(default_factory=dict)
    #: per block group of a root step: its rows here and their consecutive failures.
    root_counts: list[tuple[BlockGroup, list[int], torch.Tensor]] = field(default_factory=list)
    #: eq. (10g), on a root step with ``epsilon.rank_cutoff_scope="parameter"``: per block
    #: group index, per dim k, Lambda_k of each row's parameter (the rows of ``selected``).
    rank_scales: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    graft_dir: dict[int, torch.Tensor] = field(default_factory=dict)
    #: directions of the blocks held here, keyed (position, block); None: not needed.
    owned: dict[tuple[int, int], torch.Tensor] | None = None
    #: positions whose phase 5 is done (one process: as their blocks complete in phase 4).
    updated: set[int] = field(default_factory=set)
    #: eq. (22): per parameter updated, whether it withheld an entry (0-d bool), summed
    #: into the counter once per cohort.
    withheld: list[torch.Tensor] = field(default_factory=list)

    @property
    def config(self) -> ShampooConfig:
        return self.inp.gp.config

    @property
    def use_shampoo(self) -> bool:
        return uses_preconditioner(self.t, self.config.schedule)

    @property
    def root_step(self) -> bool:
        return is_root_step(self.t, self.config.schedule, self.inp.lr_ratio)

    @property
    def cuts_rank_per_parameter(self) -> bool:
        """Eq. (10g): the roots wait for every block's statistics of the step (and, when
        distributed, for the other ranks' blocks) to learn their rank cutoffs."""
        return self.config.epsilon.cuts_rank_per_parameter

    @property
    def roots_lag(self) -> bool:
        """Eq. (8), ``roots_take_effect="next_step"``: refresh the roots after the directions."""
        return self.config.schedule.roots_take_effect == "next_step"

    @property
    def roots_after(self) -> RootsAfter:
        """The one place that decides when a root step refreshes this cohort's inverse
        roots (eqs. 7, 9-13): right after each block group's statistics
        (``"statistics"``); after every group's statistics, once eq. (10g)'s
        per-parameter scales are known (``"rank_scales"``); or after the directions,
        with eq. (8)'s ``roots_take_effect="next_step"`` (``"directions"``)."""
        if self.roots_lag:
            return "directions"
        return "rank_scales" if self.cuts_rank_per_parameter else "statistics"


def read_gradients(
    gi: int, group: dict[str, Any], gp: ParamGroupPlan, state: Mapping[torch.Tensor, Any]
) -> StepInput | None:
    """Eqs. (1)-(2) for param group ``gi``: merged parameters and (L2-decayed) gradients.

    Only the parameters with a gradient take part (None when there are
    none); ``state`` (the optimizer's) gives each one's step counter.
    Nothing is changed. DTensor parameters (:mod:`shampoo_torch.sharding`):
    ``"lossless"`` all-gathers each one and its gradient over the shard
    group (exact copies; every rank of the group must call this), ``"local"``
    reads this rank's pieces; an empty piece takes no step.
    """
    wd = gp.config.weight_decay
    params: list[torch.Tensor] = group["params"]
    w: dict[int, torch.Tensor] = {}
    g: dict[int, torch.Tensor] = {}
    targets: dict[int, torch.Tensor] = {}
    wholes = _gathered(gp, params)
    for i, p in enumerate(params):
        if p.grad is None:
            continue
        info = gp.shards[i] if gp.shards else None
        target, grad_in = p, p.grad
        if info is not None:
            if gp.local_shards:
                target, grad_in = sharding.local(p), sharding.local(p.grad)
                if target.numel() == 0:
                    continue
            else:
                target, grad_in = wholes[i]
        if p.grad.is_sparse or p.grad.layout != torch.strided:
            raise ValueError(
                f"the gradient of parameter {gp.names[i]!r} is sparse ({p.grad.layout}): "
                "allowed a dense (strided) gradient; sparse gradients are not supported by "
                "Shampoo (e.g. use nn.Embedding(sparse=False))."
            )
        if tuple(grad_in.shape) != tuple(target.shape):
            raise ValueError(
                f"the gradient of parameter {gp.names[i]!r} has shape {tuple(grad_in.shape)}, "
                f"the parameter {tuple(target.shape)}: allowed a gradient of the parameter's "
                "shape."
            )
        shape, dt = gp.layouts[i].merged_shape, gp.dtypes[i]
        targets[i] = target
        w[i] = _merged(target, shape, dt)
        grad = _merged(grad_in, shape, dt)
        if wd.applies("l2"):
            grad = grad + wd.value * w[i]  # eq. (2)
        g[i] = grad
    if not g:
        return None
    steps = {i: state[params[i]]["step"] + 1 for i in g}  # eq. (1)
    lr = float(group["lr"])
    ratio = learning_rate_ratio(lr, group.get(FIRST_LR, lr))  # eq. (8b)
    # Read as lr is: a Python float each step (under compile a symbolic float, no recompile).
    beta1 = float(group[BETAS][0]) if BETAS in group else gp.config.gradient_filter.beta1
    mu = float(group[MOMENTUM]) if MOMENTUM in group else gp.config.momentum.momentum
    return StepInput(gi, gp, params, list(g), w, g, steps, lr, beta1, mu, ratio,
                     targets=targets)


def _merged(x: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``x`` detached, in its merged ``shape`` and ``dtype``, with no op where it is
    already so (the step runs under ``no_grad``, where nothing needs detaching)."""
    if torch.is_grad_enabled():
        x = x.detach()
    if tuple(x.shape) != tuple(shape):
        x = x.reshape(shape)
    return moved(x, dtype=dtype)


def write_back(inp: StepInput, i: int) -> None:
    """``"lossless"``: copy this rank's piece of the updated whole parameter into it."""
    info = inp.gp.shards[i] if inp.gp.shards else None
    if info is not None and not inp.gp.local_shards:
        sharding.store_planned(inp.params[i], inp.targets[i], info, False)


def _gathered(
    gp: ParamGroupPlan, params: list[torch.Tensor]
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``"lossless"``: (whole parameter, whole gradient) of each DTensor parameter with a
    gradient, by position (one all-gather per dtype, :class:`sharding.PieceGather`)."""
    if gp.pieces is None:
        return {}
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    positions, items = [], []
    for i, (p, info) in enumerate(zip(params, gp.shards, strict=True)):
        if info is None or p.grad is None:
            continue
        if p.grad.dtype != p.dtype:  # a gradient in another dtype: gathered on its own
            out[i] = (sharding.full(p.detach()), sharding.full(p.grad))
            continue
        positions.append(i)
        items.append((info, sharding.local(p.detach()), sharding.local(p.grad)))
    out.update(zip(positions, gp.pieces.run(items), strict=True))
    return out


def split_cohorts(inp: StepInput) -> list[Cohort]:
    """The parameters of ``inp`` by step: those that missed steps run on their own counter."""
    # Grouped by comparing steps, not by hashing them: under torch.compile a step is a
    # symbolic int, which a hash would pin to its value (a recompile at every step).
    by_step: list[tuple[int, list[int]]] = []
    for i in inp.active:
        t = inp.steps[i]
        same = next((positions for u, positions in by_step if u == t), None)
        if same is None:
            by_step.append((t, [i]))
        else:
            same.append(i)
    return [Cohort(inp, t, positions, {i: inp.g[i] for i in positions})
            for t, positions in by_step]
