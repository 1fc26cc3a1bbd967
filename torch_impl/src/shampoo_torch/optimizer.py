"""Shampoo as a ``torch.optim.Optimizer``, the step in the order of docs/spec.md.

``step()`` reads as the algorithm's outline (eqs. 1-21), in phases over every
param group; parameters of a group at the same step t form a *cohort*:

1. checks: merged parameters and gradients, L2 decay, the eq. (3) ``"raise"``
   check before anything changes (eqs. 1-3);
2. elementwise state per parameter: graft state and gradient filter (eqs. 14b, 15);
3. statistics, inverse roots and the corrected second moment per block group
   (eqs. 6-13, 17; :mod:`shampoo_torch.preconditioner`), then the eq. (13)
   failure limit;
4. directions: graft (eq. 14c), Shampoo per block group (eqs. 16-17) with the
   per-block graft rescale (eq. 18), exchanged between ranks when distributed;
5. per parameter: the per-parameter graft rescale (eq. 18), direction decay,
   momentum and the update (eqs. 19-21; :mod:`shampoo_torch.elementwise`).

Schedule decisions come from ``shampoo_spec.schedule``, blocking from
``shampoo_spec.plan_parameter`` and every derived rule (update weights, bias
corrections, which state exists) from the config's properties; nothing is
re-derived here.

Distributed (``distributed=DistributedConfig(...)``, :mod:`shampoo_torch.distributed`):
phase 3 and the per-block part of phase 4 run on the owning rank only, and one
all-gather at the end of phase 4 gives every rank every block's direction.

Host-device syncs: none in the default path of step(). Two documented
exceptions: with ``failure.nonfinite_gradient = "raise"`` one reduction per
param group per step is read on the host to raise before any state changes
(use ``"skip_block"`` for a sync-free step), and root steps (amortized) sync
inside ``torch.linalg.eigh`` on CUDA, in the coupled Newton stopping test, and
for ``failure.max_consecutive_root_failures``. Counters (:attr:`metrics`)
are device tensors read lazily. Distributed, the ``"raise"`` check and the
root-failure limit are all-reduces (so every rank raises together), and the
direction all-gather waits for every rank of the trainer group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from shampoo_spec import (
    NonFiniteGradientError,
    RootFailureError,
    ShampooConfig,
    is_statistics_step,
)

from . import checkpoint, elementwise, grafting, preconditioner
from .blocks import assemble, finite_blocks, gather, select_rows
from .cohorts import Cohort, StepInput, read_gradients, split_cohorts
from .distributed import BlockKey, DistributedConfig, Distributor
from .state import BlockView, ParamGroupPlan, block_views, build_param_group_plan


class Shampoo(torch.optim.Optimizer):
    """Shampoo with every option of :class:`shampoo_spec.ShampooConfig`.

    Args:
        params: tensors, ``(name, tensor)`` pairs (names appear in errors), or
            param-group dicts; a group may carry its own ``"config"``
            (a ShampooConfig or its ``to_dict()``) and/or ``"lr"``.
        config: the default config (``ShampooConfig()`` when None).
        lr: learning rate overriding ``config.learning_rate``. Per group the
            rate is the group's ``"lr"``, else this ``lr``, else the group
            config's ``learning_rate``; it is stored in ``group["lr"]`` so LR
            schedulers work.
        distributed: spread the block work over the ranks of a
            ``torch.distributed`` process group (:mod:`shampoo_torch.distributed`):
            every rank keeps the factors of its own blocks only and the
            directions are all-gathered; the result equals one process. None:
            one process. Use it with the parameters of a DistributedDataParallel
            model (gradients already averaged); every rank passes the same
            parameters, configs and DistributedConfig.

    Parameters may be float32/float64/bfloat16/float16 on any device. Factors
    and inverse roots are kept in ``config.factor_dtype``; elementwise state
    (graft, filter, momentum) in the wider of the parameter dtype and the
    factor dtype; the update is cast back to the parameter dtype.
    :meth:`blocks` shows the Kronecker state of every block.
    """

    def __init__(
        self,
        params: Iterable[Any],
        config: ShampooConfig | None = None,
        *,
        lr: float | None = None,
        distributed: DistributedConfig | None = None,
    ) -> None:
        config = ShampooConfig() if config is None else config
        if not isinstance(config, ShampooConfig):
            raise TypeError(f"config must be a ShampooConfig, got {type(config).__name__}.")
        if lr is not None:
            _check_lr(lr)
        if distributed is not None and not isinstance(distributed, DistributedConfig):
            raise ValueError(
                f"distributed = {distributed!r} is invalid: allowed a "
                "shampoo_torch.DistributedConfig or None."
            )
        self._dist = None if distributed is None else Distributor(distributed)
        self._lr_override = lr
        self._plans: list[ParamGroupPlan] = []
        self._counters: dict[torch.device, dict[str, torch.Tensor]] = {}
        defaults = {"lr": config.learning_rate if lr is None else lr, "config": config}
        super().__init__(params, defaults)

    # ------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        cfg = param_group.get("config", self.defaults["config"])
        if isinstance(cfg, dict):
            cfg = ShampooConfig.from_dict(cfg)
        if not isinstance(cfg, ShampooConfig):
            raise TypeError(f"group config must be a ShampooConfig, got {type(cfg).__name__}.")
        param_group["config"] = cfg
        if "lr" not in param_group:
            override = self._lr_override
            param_group["lr"] = cfg.learning_rate if override is None else override
        _check_lr(param_group["lr"])
        super().add_param_group(param_group)
        first = self.param_groups[0]["params"]
        plan = build_param_group_plan(len(self.param_groups) - 1, param_group, self._dist,
                                      first[0].device if first else None)
        self._plans.append(plan)
        for p, lay, dt in zip(param_group["params"], plan.layouts, plan.dtypes, strict=True):
            elementwise.init_state(self.state[p], plan.config, lay.merged_shape, dt, p.device)

    # ------------------------------------------------ metrics and views
    def _counter(self, device: torch.device) -> dict[str, torch.Tensor]:
        if device not in self._counters:
            self._counters[device] = {
                name: torch.zeros((), dtype=torch.int64, device=device)
                for name in ("root_failures", "skipped_blocks")
            }
        return self._counters[device]

    @property
    def metrics(self) -> dict[str, int]:
        """Counters since construction (read lazily; this reads the device).

        ``root_failures``: factors whose inverse root failed and kept the
        previous one (eq. 13); ``skipped_blocks``: blocks skipped for a
        non-finite gradient (eq. 3, ``"skip_block"``). Distributed,
        ``root_failures`` counts this rank's blocks only (the ranks of a
        trainer group add up to the single-process count).
        """
        out = {"root_failures": 0, "skipped_blocks": 0}
        for counters in self._counters.values():
            for name, value in counters.items():
                out[name] += int(value)
        return out

    def blocks(self) -> Iterator[BlockView]:
        """A read-only :class:`~shampoo_torch.BlockView` of every block, in order.

        Order: param group, parameter, block (eq. 5); parameters that are not
        preconditioned have no blocks. Distributed, every rank sees every
        block with its owner, and the state of the blocks it holds (None for
        the others). The tensors are the live state, not copies; the
        counters are read from the device (one read per block).
        """
        return block_views(self._plans)

    def block_state_bytes(self) -> int:
        """Bytes of the block state held here: factors, inverse roots, moments, counters.

        Distributed: this rank's blocks only (it shrinks with the world size).
        """
        return sum(t.numel() * t.element_size()
                   for gp in self._plans for bg in gp.block_groups for t in bg.tensors())

    @property
    def exchange_bytes(self) -> int:
        """Bytes every rank received in the last direction all-gather (0 in one process)."""
        return 0 if self._dist is None else self._dist.exchange.last_bytes

    # -------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Shampoo step for every parameter that has a gradient (eqs. 1-21).

        The phases of the module docstring, each over every cohort. The
        eq. (3) ``"raise"`` check comes before any change and the eq. (13)
        limit before any parameter changes.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inputs = [  # 1. checks: gradients, eq. (3) "raise"
            read_gradients(gi, group, gp, self.state)
            for gi, (group, gp) in enumerate(zip(self.param_groups, self._plans, strict=True))
        ]
        self._check_nonfinite(inputs)
        cohorts = [c for inp in inputs if inp is not None for c in split_cohorts(inp)]
        for c in cohorts:
            self._elementwise_state(c)  # 2. graft state, filter
        for c in cohorts:
            self._block_state(c)  # 3. statistics, inverse roots, corrected moment
        self._check_root_failures(cohorts)
        for c in cohorts:
            self._directions(c)  # 4. graft and block directions
        blocks = self._exchange(cohorts)  # distributed: all-gather
        for c in cohorts:
            self._update(c, blocks)  # 5. parameter rescale, momentum, update
        return loss

    def _check_nonfinite(self, inputs: list[StepInput | None]) -> None:
        """Eq. (3), ``"raise"``: before any state changes, on every rank alike.

        Distributed: one all-reduce over the process group, whenever some
        param group has the ``"raise"`` policy, so a gradient that is bad on
        one rank only makes every rank raise the same error.
        """
        local: tuple[int, ...] | None = None
        for inp in inputs:
            if inp is not None and inp.gp.config.failure.nonfinite_gradient == "raise":
                pos = elementwise.first_nonfinite(inp.g)
                if pos is not None:
                    local = (inp.gi, pos)
                    break
        where = ""
        if self._dist is not None:
            if not any(gp.config.failure.nonfinite_gradient == "raise" for gp in self._plans):
                return
            found = self._dist.first_flagged(local, 2, self._device(), whole_world=True)
            if found is None:
                return
            rank, local = found
            where = f" on rank {rank} of {self._dist.full_world} (every rank raises this error)"
        if local is None:
            return
        gi, pos = local
        step = self.state[self.param_groups[gi]["params"][pos]]["step"] + 1
        raise NonFiniteGradientError(
            f"non-finite gradient in parameter {self._plans[gi].names[pos]!r} at step {step}"
            f"{where}; failure.nonfinite_gradient='raise' (no optimizer state or parameter "
            "was changed by this step; 'skip_block' skips such blocks instead)."
        )

    def _elementwise_state(self, c: Cohort) -> None:
        """Eq. (3) ``"skip_block"`` flags (no host sync), eqs. (14b), (15) per parameter."""
        cfg, params = c.config, c.inp.params
        for i in c.positions:
            if cfg.failure.nonfinite_gradient == "skip_block":
                c.block_ok[i], c.elem_ok[i] = finite_blocks(c.inp.gp.layouts[i], c.g[i])
                c.g[i] = torch.where(c.elem_ok[i], c.g[i], 0.0)
                skipped = (~torch.stack(c.block_ok[i])).sum()
                self._counter(c.g[i].device)["skipped_blocks"].add_(skipped)
            st, ok = self.state[params[i]], c.elem_ok.get(i)
            if cfg.grafting.has_state:
                st["graft"] = elementwise.masked(
                    grafting.update_state(st["graft"], c.g[i], cfg.grafting), st["graft"], ok
                )
            c.filtered[i] = elementwise.filter_gradient(st, c.g[i], c.t, cfg.gradient_filter, ok)

    def _block_state(self, c: Cohort) -> None:
        """Eqs. (6)-(13), (17) per block group: statistics, inverse roots, corrected moment."""
        gp, cfg = c.inp.gp, c.config
        c.selected = select_rows(gp.block_groups, c.positions, c.block_ok)
        for index, (members, rows, ok) in c.selected.items():
            bg = gp.block_groups[index]
            gb = gather(bg, gp.layouts, c.g, members)
            if is_statistics_step(c.t, cfg.schedule):
                preconditioner.update_statistics(bg, gb, rows, ok, cfg.statistics)
            if c.root_step:
                updated, failures = preconditioner.refresh_inverse_roots(bg, rows, ok, cfg)
                self._counter(bg.device)["root_failures"].add_(failures)
                c.root_counts.append((bg, members, updated))
            if cfg.eigenvalue_correction is not None:
                preconditioner.update_corrected_moment(
                    bg, gb, rows, ok, cfg.eigenvalue_correction
                )

    def _check_root_failures(self, cohorts: list[Cohort]) -> None:
        """Eq. (13): raise when a block's inverse roots failed too many root steps in a row.

        Checked after every cohort's inverse roots (before any parameter
        changes); distributed: one all-reduce over the trainer group on root
        steps, so every rank raises for the same block (named with its owner).
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
        if self._dist is not None and checked:
            agreed = self._dist.first_flagged(exceeded, 5, self._device(), whole_world=False)
            exceeded = None if agreed is None else agreed[1]
            if agreed is not None:
                where = f" (owned by rank {agreed[0]}; every rank raises this error)"
        if exceeded is None:
            return
        gi, pos, block, count, t = exceeded
        gp = self._plans[gi]
        raise RootFailureError(
            f"inverse roots of block {block} (shape {gp.layouts[pos].plan.blocks[block].shape}) "
            f"of parameter {gp.names[pos]!r} failed on {count} root steps in a row, the last "
            f"at step {t} (failure.max_consecutive_root_failures="
            f"{gp.config.failure.max_consecutive_root_failures}){where}."
        )

    def _directions(self, c: Cohort) -> None:
        """Eq. (14c) per parameter; eqs. (16)-(17) per block group, (18) when per block.

        The block directions are those of the blocks held here (all of them in
        one process, the owned ones when distributed), needed when the step
        uses Shampoo or separate momentum buffers keep its direction.
        """
        gp, cfg, params = c.inp.gp, c.config, c.inp.params
        graft = cfg.grafting
        c.graft_dir = {
            i: grafting.direction(c.filtered[i], self.state[params[i]].get("graft"), c.t, graft)
            for i in c.positions
        }
        if not (c.use_shampoo or cfg.momentum.separate_buffers):
            return
        c.owned = {}
        for index, (members, rows, _) in c.selected.items():
            bg = gp.block_groups[index]
            fb = gather(bg, gp.layouts, c.filtered, members)
            pb = preconditioner.shampoo_direction(bg, fb, rows, cfg)
            if graft.rescale_scope == "block":
                gd = gather(bg, gp.layouts, c.graft_dir, members)
                pb = preconditioner.rescale_blocks_to_graft(pb, gd, graft.norm_epsilon)
            for j, r in enumerate(members):
                c.owned[bg.members[r]] = pb[j]

    def _exchange(self, cohorts: list[Cohort]) -> dict[BlockKey, torch.Tensor]:
        """Every block's direction, keyed (group, position, block).

        One process: the blocks computed here. Distributed: one all-gather of
        the owners' directions (:meth:`Distributor.exchange_directions`); the
        gathered values are used on every rank, the owner's included.
        """
        wanted = [c for c in cohorts if c.owned is not None]
        mine = {(c.inp.gi, pos, b): d for c in wanted for (pos, b), d in (c.owned or {}).items()}
        if self._dist is None or not wanted:
            return mine
        parts = []
        for c in wanted:
            gp = c.inp.gp
            assert gp.owners is not None
            plans = {pos: gp.layouts[pos].plan for pos in c.positions}
            parts.append((c.inp.gi, plans, gp.owners, gp.factor_dtype))
        return self._dist.exchange_directions(parts, mine, self._device())

    def _update(self, c: Cohort, blocks: Mapping[BlockKey, torch.Tensor]) -> None:
        """Eq. (18) per parameter, eqs. (19)-(21): assemble, rescale, momentum, update."""
        inp, cfg = c.inp, c.config
        for i in c.positions:
            shampoo_dir = None if c.owned is None else _parameter_direction(c, i, blocks)
            st = self.state[inp.params[i]]
            st["step"] = c.t
            ok = c.elem_ok.get(i)
            u = elementwise.momentum(st, shampoo_dir, c.graft_dir[i], inp.w[i], c.use_shampoo,
                                     cfg, inp.lr, ok)
            elementwise.apply_update(inp.params[i], inp.w[i], u, cfg, inp.lr, ok)

    def _device(self) -> torch.device:
        device: torch.device = self.param_groups[0]["params"][0].device
        return device

    # ------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Tensors, ints, floats, strings, dicts and lists only (``weights_only`` loads).

        Per parameter (by index, as torch does): ``step``, the elementwise state,
        and per block its factors, inverse roots/eigenbases and counters. Each
        group keeps its hyper-parameters with ``config`` as ``config.to_dict()``.
        """
        return checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; tensors move to each parameter's device.

        Raises ValueError (and changes nothing) when the groups, parameter
        counts, configs or any state shape differ from this optimizer's.
        """
        checkpoint.load_state_dict(self, state_dict)

    def distributed_state_dict(self) -> dict[str, Any]:
        """Every block's state, keyed by parameter name and block, loadable at any world size.

        Gathered over the trainer group when distributed (a collective: call it
        on every rank; every rank gets the whole dict, save it on one). The
        format is in :mod:`shampoo_torch.checkpoint`.
        """
        return checkpoint.distributed_state_dict(self)

    def load_distributed_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`distributed_state_dict` saved at any world size (1 included).

        Each rank keeps the blocks it owns; raises ValueError (changing
        nothing) when names, configs, blocks or shapes differ.
        """
        checkpoint.load_distributed_state_dict(self, state_dict)

    # The internal API of :mod:`shampoo_torch.checkpoint` (nothing else calls it).
    def _checkpoint_blocks(self) -> list[list[list[dict[str, Any] | None]]]:
        """Per param group :meth:`ParamGroupPlan.block_states`: live views, None if not held."""
        return [gp.block_states() for gp in self._plans]

    def _checkpoint_names(self) -> list[list[str]]:
        """The parameters' names per param group (the keys of a distributed checkpoint)."""
        return [list(gp.names) for gp in self._plans]

    def _checkpoint_gather(self, obj: object) -> list[object]:
        """``obj`` of every rank of the trainer group (``[obj]`` in one process)."""
        return [obj] if self._dist is None else self._dist.all_gather_object(obj)

    def _restore_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Set :attr:`metrics` to saved counts.

        ``root_failures`` is a sum over the ranks of a trainer group (each
        counts its own blocks), so only rank 0 of a distributed optimizer
        takes the saved total.
        """
        self._counters.clear()
        if not (self.param_groups and self.param_groups[0]["params"]):
            return
        counters = self._counter(self._device())
        counters["skipped_blocks"].fill_(int(metrics.get("skipped_blocks", 0)))
        if self._dist is None or self._dist.rank == 0:
            counters["root_failures"].fill_(int(metrics.get("root_failures", 0)))


def _parameter_direction(
    c: Cohort, i: int, blocks: Mapping[BlockKey, torch.Tensor]
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


def _check_lr(lr: object) -> None:
    if isinstance(lr, torch.Tensor):
        raise TypeError("lr must be a Python float (tensor learning rates are not supported).")
    if not isinstance(lr, (int, float)) or not lr >= 0.0:
        raise ValueError(f"lr = {lr!r} is invalid: allowed is a float >= 0.")
