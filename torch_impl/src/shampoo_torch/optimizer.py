"""Shampoo as a ``torch.optim.Optimizer``, the step in the order of docs/spec.md.

``step()`` reads as the algorithm's outline (eqs. 1-21), in phases over every
param group; parameters of a group at the same step t form a *cohort*:

1. checks: learning rates, merged parameters and gradients, L2 decay, and
   eq. (3): which blocks' steps are refused (a non-finite gradient, or one so
   large that the block's state could overflow, :mod:`shampoo_torch.refusal`),
   decided before anything changes, the same on every rank (eqs. 1-3);
2. elementwise state per parameter: graft state and gradient filter (eqs. 14b, 15),
   and eq. (14e)'s Adafactor moments of the whole parameter;
3. statistics, inverse roots and the corrected second moment per block group
   (eqs. 6-13, 17; :mod:`shampoo_torch.preconditioner`); with
   ``epsilon.rank_cutoff_scope = "parameter"`` (eq. 10g) the roots come after
   every group's statistics, once each parameter's largest eigenvalue per dim
   is known (3b, :mod:`shampoo_torch.rank_cutoff`);
4. directions: graft (eqs. 14c, 14e), Shampoo per block group (eqs. 16-17) with the
   per-block graft rescale (eq. 18), exchanged between ranks when distributed;
   with ``schedule.roots_take_effect = "next_step"`` the inverse roots of
   phase 3 are refreshed here, after the directions (eq. 8);
5. per parameter: the per-parameter graft rescale (eq. 18), direction decay,
   momentum and the update (eqs. 19-22; :mod:`shampoo_torch.updates`); in one
   process on the CPU path a preconditioned parameter takes it inside phase 4,
   as soon as its last block direction is formed (nothing in phase 4 reads
   another parameter's weights), so the block directions of every parameter
   never live at once; the accelerator path updates the cohort in one batch
   of foreach ops instead (one launch per op, :mod:`shampoo_torch.device_path`);
6. the eq. (13) failure limit, raised only now, after every parameter moved
   (failed inverse roots kept the previous ones): a step is never half done
   (:mod:`shampoo_torch.failure_limit`).

Schedule decisions come from ``shampoo_spec.schedule``, blocking from
``shampoo_spec.plan_parameter`` and every derived rule (update weights, bias
corrections, which state exists) from the config's properties; nothing is
re-derived here.

Phases 3-5 per cohort are :mod:`shampoo_torch.phases` (distributed: on the owning
rank, then one all-gather of the block directions).

Host-device syncs (:mod:`shampoo_torch.device_path`): none in a non-root step on the
accelerator path (a non-CPU device, or ``SHAMPOO_TORCH_PATH=accelerator``), where the
blocks eq. (3) ``"raise"`` refuses are skipped on the device and the error waits for
the next root step or host read (:mod:`shampoo_torch.refusal`); there ``compile``
runs such a step as one graph (:mod:`shampoo_torch.compiled`). Root steps (amortized)
sync in ``torch.linalg.eigh`` on CUDA, in the coupled Newton stopping test, for
``failure.max_consecutive_root_failures`` and once for the pending eq. (3) codes. The
CPU path, with no device to wait for, raises eq. (3) in its step and reads two flags
on the host: eq. (22)'s and eq. (18)'s shortcuts when a sum is finite (the same
bits). Counters (:attr:`metrics`) are device tensors read lazily. Distributed: the
eq. (3) codes are one all-reduce (max) per step (every rank raises together, or skips
the same blocks); root steps add an all-reduce for the failure limit and, with
``epsilon.rank_cutoff_scope = "parameter"``, one for eq. (10g)'s largest eigenvalues;
the direction all-gather waits for every rank of the trainer group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from shampoo_spec import ShampooConfig

from . import (
    averaging,
    checkpoint,
    compiled,
    distributed_checkpoint,
    elementwise,
    failure_limit,
    phases,
    rank_cutoff,
    refusal,
)
from .arguments import as_config, check_lr, check_moments, moment_keys
from .checkpoint_entries import shape_tensor
from .cohorts import (
    AVERAGING_MODE,
    FIRST_LR,
    LR_POWER_SUM,
    read_gradients,
    split_cohorts,
)
from .distributed import DistributedConfig, Distributor
from .metrics import StepCounters
from .state import BlockView, CheckpointState, ParamGroupPlan, block_views, build_param_group_plan


class Shampoo(torch.optim.Optimizer):
    """Shampoo with every option of :class:`shampoo_spec.ShampooConfig`.

    Args:
        params: tensors, ``(name, tensor)`` pairs (names appear in errors), or
            param-group dicts; a group may carry its own ``"config"``
            (a ShampooConfig or its ``to_dict()``; the default config when
            absent or None) and/or ``"lr"``.
        config: the default config: a ShampooConfig or its ``to_dict()``
            (``ShampooConfig()`` when None); anything else raises ValueError.
        lr: learning rate overriding ``config.learning_rate``. Per group the
            rate is the group's ``"lr"``, else this ``lr``, else the group
            config's ``learning_rate``; it is stored in ``group["lr"]`` so LR
            schedulers work. With ``schedule.precondition_frequency_growth``
            the root period follows ``group["lr"]`` over the group's rate at
            its first step (eq. 8b), kept in ``group["first_step_lr"]``; with
            ``weight_decay.scale_by_lr_ratio`` the direction decay follows
            ``group["lr"]`` over this ``lr`` (else the config's
            ``learning_rate``), Meta's ``lr / peak_lr`` (eq. 19). For ``cycle_momentum``
            a group has ``"betas"`` = (eq. 15's beta1, eq. 6's beta2) with the filter on
            and ``"momentum"`` = eq. (20)'s mu with momentum on (only then, as Meta names
            them); its beta1 and mu in [0, 1) replace the config's at each step (bias
            correction included); ``betas[1]`` cannot change.
        distributed: spread the block work over the ranks of a
            ``torch.distributed`` process group (:mod:`shampoo_torch.distributed`):
            every rank keeps the factors of its own blocks only and the
            directions are all-gathered; the result equals one process. None:
            one process. Use it with the parameters of a DistributedDataParallel
            model (gradients already averaged); every rank passes the same
            parameters, configs and DistributedConfig. The parameters of a
            ``fully_shard`` (FSDP2) or HSDP model (DTensors) need it too:
            ``DistributedConfig.shard_mode`` chooses between the lossless
            whole-parameter plan and each rank's own piece
            (:mod:`shampoo_torch.sharding`).
        compile: run every non-root step as one ``torch.compile`` graph
            (:mod:`shampoo_torch.compiled`): True for torch's default backend, or a
            backend's name (``"cudagraphs"``: one CUDA graph replay, eager's bits).
            Root steps run eagerly. One process, on the accelerator path.

    Parameters may be float32/float64/bfloat16/float16 on any device. Factors
    and inverse roots are kept in ``config.factor_dtype`` (the roots in
    ``config.inverse_root_dtype`` when set, eq. 11a; the factors in
    ``config.factor_storage_dtype`` when set, eq. 11b), each factor and each
    eigh-formed root as its lower triangle (:mod:`shampoo_torch.packed`); elementwise state
    (graft, filter, momentum; eq. 14e's Adafactor moments, in the parameter's
    own shape) in the wider of the parameter dtype and the
    factor dtype; the update is cast back to the parameter dtype.
    :meth:`blocks` shows the Kronecker state of every block.
    """

    def __init__(
        self,
        params: Iterable[Any],
        config: ShampooConfig | dict[str, Any] | None = None,
        *,
        lr: float | None = None,
        distributed: DistributedConfig | None = None,
        compile: bool | compiled.Backend = False,
    ) -> None:
        config = as_config(config, ShampooConfig(), "config")
        backend = compiled.backend_of(compile, distributed is not None)
        if lr is not None:
            check_lr(lr, "lr")
        if distributed is not None and not isinstance(distributed, DistributedConfig):
            raise ValueError(
                f"distributed = {distributed!r} is invalid: allowed a "
                "shampoo_torch.DistributedConfig or None."
            )
        self._dist = None if distributed is None else Distributor(distributed)
        #: FSDP2 / HSDP (:mod:`shampoo_torch.sharding`): None in one process.
        self._shard_mode = None if distributed is None else distributed.shard_mode
        if self._shard_mode == "local":
            self._dist = None  # each rank steps its own pieces: no optimizer communication
        self._lr_override = lr
        self._plans: list[ParamGroupPlan] = []
        self._counters = StepCounters()
        self._pending = refusal.PendingRefusals()  # eq. (3) "raise", deferred (accelerator)
        defaults = {"lr": config.learning_rate if lr is None else lr, "config": config,
                    **moment_keys(config)}  # what torch's schedulers look for
        self._compiled: compiled.CompiledStep | None = None
        super().__init__(params, defaults)
        if backend is not None:
            compiled.check_compilable(
                backend, [p.device for g in self.param_groups for p in g["params"]])
            self._compiled = compiled.CompiledStep(self._phases, backend)

    # ------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        cfg = as_config(param_group.get("config"), self.defaults["config"],
                        f"param_groups[{len(self.param_groups)}]['config']")
        param_group["config"] = cfg
        if "lr" not in param_group:
            override = self._lr_override
            param_group["lr"] = cfg.learning_rate if override is None else override
        where = f"param_groups[{len(self.param_groups)}]"
        check_lr(param_group["lr"], f"{where}['lr']")
        # Moment keys from the group's own config; torch's add_param_group copies the
        # defaults' into every group, so those this config keeps none of go after it.
        kept = moment_keys(cfg)
        for key, value in kept.items():
            param_group.setdefault(key, value)
        check_moments(param_group, cfg, where)
        super().add_param_group(param_group)
        for key in set(moment_keys(self.defaults["config"])) - set(kept):
            del param_group[key]
        first = self.param_groups[0]["params"]
        try:  # a refused group (e.g. integer parameters) is not left half added
            plan = build_param_group_plan(len(self.param_groups) - 1, param_group, self._dist,
                                          first[0].device if first else None, self._shard_mode)
        except BaseException:
            self.param_groups.pop()
            raise
        self._plans.append(plan)
        if self._compiled is not None:
            self._compiled.cool()  # the new group's kept vectors are made eagerly
        for j, (p, lay, dt) in enumerate(zip(param_group["params"], plan.layouts, plan.dtypes,
                                             strict=True)):
            elementwise.init_state(self.state[p], plan.config, lay.merged_shape, dt, p.device,
                                   lay.plan.shape)
            if cfg.averaging is not None:  # eq. (20d): Z starts at W (the planned tensor)
                w = plan.planned(j, p.detach())
                self.state[p]["averaged"] = w.to(dt).reshape(lay.merged_shape).clone()
            # The keys of a checkpoint entry (torch's flattened load rebuilds an entry from
            # the live state's keys): the shape and number of blocks; the counters once.
            self.state[p]["param_shape"] = shape_tensor(p)
            self.state[p]["blocks"] = lay.num_blocks
            if len(self.param_groups) == 1 and j == 0:
                self.state[p]["metrics"] = self._counters
        if cfg.averaging is not None:
            param_group[AVERAGING_MODE] = "train"
            if cfg.averaging.type == "schedule_free":
                param_group[LR_POWER_SUM] = 0.0

    # ------------------------------------------------ metrics and views
    @property
    def metrics(self) -> dict[str, int]:
        """Counters since construction (read lazily; this reads the device).

        ``root_failures``: factors whose inverse root failed and kept the previous one
        (eq. 13); ``skipped_blocks``: blocks whose step was refused for a non-finite or
        too large gradient (eq. 3, ``"skip_block"``), the same on every rank when
        distributed; ``withheld_updates``: parameter steps in which eq. (22) kept some
        entries of an admitted block unchanged because their new value or momentum
        overflowed (the same on every rank: the update is computed alike everywhere).
        Distributed, ``root_failures`` counts this rank's blocks only (the ranks of a
        trainer group add up to the single-process count).
        """
        self.check_refusals()
        return self._counters.read()

    def check_refusals(self) -> None:
        """Raise eq. (3)'s pending NonFiniteGradientError, if any (a host read).

        On the accelerator path a ``"raise"`` policy reads nothing on the host
        in a non-root step: refused blocks are skipped on the device and the
        error waits for the next root step or a host read (this, :attr:`metrics`,
        :meth:`blocks`, the state dicts; :mod:`shampoo_torch.refusal`). On the
        CPU path the error was raised in its step, so this finds nothing.
        """
        self._pending.raise_any(self.state, self.param_groups, self._plans)

    def blocks(self) -> Iterator[BlockView]:
        """A read-only :class:`~shampoo_torch.BlockView` of every block, in order.

        Order: param group, parameter, block (eq. 5); parameters that are not
        preconditioned have no blocks. Distributed, every rank sees every
        block with its owner, and the state of the blocks it holds (None for
        the others). The tensors are the live state, not copies; the
        counters are read from the device (one read per block).
        """
        self.check_refusals()
        return block_views(self._plans)

    def block_state_bytes(self) -> int:
        """Bytes of the block state held here: factors, inverse roots, moments, counters
        (distributed: this rank's blocks only; it shrinks with the world size)."""
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

        The phases of the module docstring, each over every cohort. Every check that
        can refuse the step (learning rates, gradients, eq. 3 ``"raise"``) comes before
        any change; the eq. (13) limit is raised after the whole step.
        """
        for gi, group in enumerate(self.param_groups):  # before the closure's backward
            if group.get(AVERAGING_MODE, "train") != "train":
                raise RuntimeError(
                    f"step() with param_groups[{gi}] in eval mode: its parameters hold the "
                    "averaged sequence x (eq. 20d); call train() before step()."
                )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):  # a scheduler may have set them
            check_lr(group["lr"], f"param_groups[{gi}]['lr']")
            check_moments(group, group["config"], f"param_groups[{gi}]")
        if self._compiled is None:
            self._phases()
        else:
            self._compiled(self.param_groups, self._plans, self.state, self._pending)
        return loss

    def _phases(self, in_graph: bool = False) -> None:
        """The step's phases 1-6 (the module docstring), after the closure and the
        learning-rate checks: all of it that ``compile`` traces (``in_graph``)."""
        inputs = [  # 1. checks: gradients, eq. (3)
            read_gradients(gi, group, gp, self.state)
            for gi, (group, gp) in enumerate(zip(self.param_groups, self._plans, strict=True))
        ]
        for inp in inputs:
            if inp is not None:
                inp.in_graph = in_graph
        refusal.refuse_blocks(inputs, self.state, self.param_groups, self._plans, self._dist,
                              self._shard_mode, self._counters, self._device, self._pending)
        for inp in inputs:  # eq. (8b)'s lr_1, once the step can no longer be refused
            if inp is not None and inp.gp.config.schedule.precondition_frequency_growth:
                self.param_groups[inp.gi].setdefault(FIRST_LR, inp.lr)
            av = None if inp is None else inp.gp.config.averaging
            if inp is not None and av is not None and av.type == "schedule_free":  # eq. (20d)
                group = self.param_groups[inp.gi]
                group[LR_POWER_SUM] = av.power_sum(group.get(LR_POWER_SUM, 0.0), inp.lr)
        cohorts = [c for inp in inputs if inp is not None for c in split_cohorts(inp)]
        for c in cohorts:
            elementwise.update_cohort_state(c, self.state)  # 2. graft state, filter
        ctx = phases.StepContext(self.state, self.param_groups, self._counters, self._dist,
                                 self._device(), self._lr_override)
        for c in cohorts:
            phases.block_state(ctx, c)  # 3. statistics, inverse roots, corrected moment
        if any(c.cuts_rank_per_parameter and c.root_step for c in cohorts):
            # 3b. eq. (10g): one max over the blocks
            rank_cutoff.parameter_rank_scales(cohorts, self._device(), self._dist)
            for c in cohorts:
                if c.roots_after == "rank_scales":
                    phases.refresh_roots(ctx, c)
        for c in cohorts:
            phases.directions(ctx, c)  # 4. graft and block directions
            if c.roots_after == "directions":
                phases.refresh_roots(ctx, c)  # 4b. eq. (8) "next_step": from t + 1 on
        blocks = phases.exchange(ctx, cohorts)  # distributed: all-gather
        for c in cohorts:
            phases.update(ctx, c, blocks)  # 5. parameter rescale, momentum, update
        failure_limit.check_root_failures(  # 6. eq. (13), after the whole step
            cohorts, self._plans, self._dist, self._shard_mode, self._device)

    def _device(self) -> torch.device:
        device: torch.device = self.param_groups[0]["params"][0].device
        return device

    # ---------------------------------------------- eq. (20d) train / eval
    @torch.no_grad()
    def eval(self) -> None:
        """Put the averaged sequence ``x = (W - (1 - mu_y) Z) / mu_y`` in the parameters of
        every group with ``config.averaging`` (eq. 20d); ``step()`` then refuses until
        :meth:`train`. Groups without averaging, or already in eval mode, are left alone."""
        averaging.switch_sequence(self.param_groups, self._plans, self.state, "eval")

    @torch.no_grad()
    def train(self) -> None:
        """Back to the training sequence ``y = mu_y x + (1 - mu_y) Z`` (eq. 20d)."""
        averaging.switch_sequence(self.param_groups, self._plans, self.state, "train")

    # ------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Tensors, ints, floats, strings, dicts and lists only (``weights_only`` loads).

        Per parameter (by index, as torch does): ``step``, the elementwise state,
        and per block its factors, inverse roots/eigenbases and counters. Each
        group keeps its hyper-parameters with ``config`` as ``config.to_dict()``.
        """
        self.check_refusals()
        return checkpoint.state_dict(self._checkpoint_state())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; tensors move to each parameter's device.

        Raises ValueError (and changes nothing) when the groups, parameter counts, configs
        or any state shape differ from this optimizer's, or a state entry is not finite.
        Version 1 dicts (saved before ``param_shape``) load too (:mod:`.checkpoint`).
        """
        checkpoint.load_state_dict(self._checkpoint_state(), state_dict)
        if self._compiled is not None:
            self._compiled.cool()

    def distributed_state_dict(self) -> dict[str, Any]:
        """Every block's state, keyed by parameter name and block, loadable at any world size.

        Gathered over the trainer group when distributed (a collective: call it
        on every rank; every rank gets the whole dict, save it on one). The
        format is in :mod:`shampoo_torch.checkpoint`. With FSDP2 / HSDP
        parameters in ``shard_mode="lossless"`` it holds whole parameters'
        state, so it also travels through ``torch.distributed.checkpoint``
        (``dcp.save`` / ``dcp.load`` into this dict of a fresh optimizer) and
        loads at another world size; ``shard_mode="local"`` refuses it (use
        :meth:`state_dict` per rank, at the same world size).
        """
        distributed_checkpoint.refuse_local_pieces("distributed_state_dict", self._shard_mode,
                                                   self._plans)
        self.check_refusals()
        return distributed_checkpoint.distributed_state_dict(self._checkpoint_state())

    def load_distributed_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`distributed_state_dict` saved at any world size (1 included).

        Each rank keeps the blocks it owns; raises ValueError (changing nothing) when
        names, configs, blocks or shapes differ or a state entry is not finite. Version 1
        dicts (saved before ``param_shape``) load too.
        """
        distributed_checkpoint.refuse_local_pieces("load_distributed_state_dict",
                                                   self._shard_mode, self._plans)
        distributed_checkpoint.load_distributed_state_dict(self._checkpoint_state(),
                                                           state_dict)
        if self._compiled is not None:
            self._compiled.cool()

    def _checkpoint_state(self) -> CheckpointState:
        """What :mod:`shampoo_torch.checkpoint` reads and writes of this optimizer."""
        return CheckpointState(self.param_groups, self.state, self._plans, self._counters,
                               self._dist)


