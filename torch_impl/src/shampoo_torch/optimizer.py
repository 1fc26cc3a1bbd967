"""Shampoo as a ``torch.optim.Optimizer``, the step in the order of docs/spec.md.

``step()`` reads as the algorithm's outline (eqs. 1-21):

1. per parameter: counter, L2 decay, non-finite check (eqs. 1-3);
2. per parameter, elementwise: graft state and gradient filter (eqs. 14b, 15);
3. per bucket of equal-shape blocks, batched: statistics, roots, corrected
   second moment (eqs. 6-13, 17);
4. graft direction (eq. 14c), Shampoo direction per bucket (eqs. 16-17),
   graft rescale per block or parameter (eq. 18);
5. per parameter: direction decay, momentum, update (eqs. 19-21).

Schedule decisions come from ``shampoo_spec.schedule`` and blocking from
``shampoo_spec.plan_parameter``; nothing is re-derived here.

Distributed (``distributed=DistributedConfig(...)``, :mod:`shampoo_torch.distributed`):
step 3 and the per-block part of step 4 run on the owning rank only, and one
all-gather between steps 4 and 5 gives every rank every block's direction.

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

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from shampoo_spec import (
    CoupledNewtonConfig,
    NonFiniteGradientError,
    RootFailureError,
    ShampooConfig,
    is_root_step,
    is_statistics_step,
    plan_parameter,
    uses_preconditioner,
)

from . import checkpoint, grafting, roots
from .blocks import (
    Bucket,
    ParamLayout,
    Rows,
    assemble,
    build_buckets,
    contraction_operands,
    gather,
    mode_product,
    put,
    take,
)
from .distributed import BlockKey, DistributedConfig, Distributor, is_dtensor
from .invariance import rowwise

_FACTOR_DTYPES = {"float32": torch.float32, "float64": torch.float64}
_ELEMENTWISE_STATE = ("graft", "filtered", "momentum", "graft_momentum")


@dataclass
class GroupPlan:
    """Everything fixed about one param group: config, layouts, buckets, dtypes, names."""

    config: ShampooConfig
    layouts: list[ParamLayout]
    buckets: list[Bucket]  # distributed: the blocks this rank owns only
    dtypes: list[torch.dtype]  # per parameter: dtype of its elementwise state and directions
    names: list[str]
    factor_dtype: torch.dtype
    #: distributed: the owner (rank in the trainer group) of each (position, block).
    owners: dict[tuple[int, int], int] | None = None


@dataclass
class _StepInput:
    """One param group at this step: merged parameters and gradients (eqs. 1-2)."""

    gi: int
    gp: GroupPlan
    params: list[torch.Tensor]
    active: list[int]
    w: dict[int, torch.Tensor]
    g: dict[int, torch.Tensor]
    steps: dict[int, int]
    lr: float


@dataclass
class _Cohort:
    """Parameters of a group at the same step t, between the state update and the update."""

    inp: _StepInput
    t: int
    positions: list[int]
    elem_ok: dict[int, torch.Tensor]
    graft_dir: dict[int, torch.Tensor]
    use_shampoo: bool
    #: directions of the blocks held here, keyed (position, block); None: not needed.
    owned: dict[tuple[int, int], torch.Tensor] | None
    root_step: bool
    root_counts: list[tuple[Bucket, list[int], torch.Tensor]]


def _norms(x: torch.Tensor) -> torch.Tensor:
    """Frobenius norm of each block of a stack ``[B, ...]``, shaped to broadcast."""
    n = torch.linalg.vector_norm(x.flatten(1), dim=1)
    return n.view(-1, *([1] * (x.dim() - 1)))


def _masked(new: torch.Tensor, old: torch.Tensor, ok: torch.Tensor | None) -> torch.Tensor:
    return new if ok is None else torch.where(ok, new, old)


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
    and roots are kept in ``config.factor_dtype``; elementwise state (graft,
    filter, momentum) in the wider of the parameter dtype and the factor
    dtype; the update is cast back to the parameter dtype.
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
        self._plans: list[GroupPlan] = []
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
        self._plans.append(self._build_plan(len(self.param_groups) - 1, param_group))

    def _build_plan(self, gi: int, group: dict[str, Any]) -> GroupPlan:
        cfg: ShampooConfig = group["config"]
        params: list[torch.Tensor] = group["params"]
        fdt = _FACTOR_DTYPES[cfg.factor_dtype]
        for p in params:
            if not p.is_floating_point():
                raise TypeError(f"Shampoo needs floating-point parameters, got {p.dtype}.")
            if is_dtensor(p):
                raise TypeError(
                    "Shampoo does not support DTensor (FSDP2 fully_shard) parameters yet; "
                    "use DistributedDataParallel with Shampoo(distributed=DistributedConfig())."
                )
        plans = [plan_parameter(tuple(p.shape), cfg) for p in params]
        owners = None
        owned: Callable[[int, int], bool] | None = None
        if self._dist is not None:
            first = self.param_groups[0]["params"][0] if self.param_groups else params[0]
            for p in params:
                if p.device != first.device:
                    raise ValueError(
                        f"parameter device {p.device} is invalid with distributed Shampoo: "
                        f"allowed one device per rank ({first.device})."
                    )
            owners = self._dist.assign(plans, cfg)
            rank, table = self._dist.rank, owners

            def owned(pos: int, b: int) -> bool:
                return table[(pos, b)] == rank

        layouts, buckets = build_buckets(plans, [p.device for p in params], fdt, owned)
        init = cfg.epsilon.value if cfg.statistics.initial_value == "epsilon_identity" else 0.0
        for bucket in buckets:
            bucket.allocate(init, cfg.eigenvalue_correction is not None)
        dtypes = [torch.promote_types(p.dtype, fdt) for p in params]
        names = group.get("param_names") or [
            f"param_groups[{gi}]['params'][{i}] (shape {tuple(p.shape)})"
            for i, p in enumerate(params)
        ]
        separate = cfg.momentum.buffers == "separate" and cfg.momentum.momentum != 0.0
        wanted = {
            "graft": grafting.needs_state(cfg.grafting),
            "filtered": cfg.gradient_filter.beta1 != 0.0,
            "momentum": cfg.momentum.momentum != 0.0,
            "graft_momentum": separate,
        }
        for p, lay, dt in zip(params, layouts, dtypes, strict=True):
            st = self.state[p]
            st["step"] = 0
            for key in _ELEMENTWISE_STATE:
                if wanted[key]:
                    st[key] = torch.zeros(lay.merged_shape, dtype=dt, device=p.device)
        return GroupPlan(cfg, layouts, buckets, dtypes, list(names), fdt, owners)

    # ----------------------------------------------------------- metrics
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
        previous root (eq. 13); ``skipped_blocks``: blocks skipped for a
        non-finite gradient (eq. 3, ``"skip_block"``). Distributed,
        ``root_failures`` counts this rank's blocks only (the ranks of a
        trainer group add up to the single-process count).
        """
        out = {"root_failures": 0, "skipped_blocks": 0}
        for counters in self._counters.values():
            for name, value in counters.items():
                out[name] += int(value)
        return out

    # -------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One Shampoo step for every parameter that has a gradient (eqs. 1-21).

        Phases, each over every param group: read the gradients and apply the
        eq. (3) ``"raise"`` check (nothing has changed yet); per cohort update
        the state and compute the block directions (eqs. 6-18; distributed:
        the blocks this rank owns); exchange the directions (distributed
        only: one all-gather); assemble and update (eqs. 18-21).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inputs = [
            self._gradients(gi, group, gp)
            for gi, (group, gp) in enumerate(zip(self.param_groups, self._plans, strict=True))
        ]
        self._check_nonfinite(inputs)
        cohorts = [c for inp in inputs if inp is not None for c in self._begin_cohorts(inp)]
        self._check_root_failures(cohorts)
        blocks = self._exchange(cohorts)
        for c in cohorts:
            self._finish_cohort(c, blocks)
        return loss

    def _gradients(self, gi: int, group: dict[str, Any], gp: GroupPlan) -> _StepInput | None:
        """Eqs. (1)-(2): the merged parameters and (L2-decayed) gradients; no state changes."""
        cfg = gp.config
        params: list[torch.Tensor] = group["params"]
        active = [i for i, p in enumerate(params) if p.grad is not None]
        if not active:
            return None
        wd = cfg.weight_decay
        w: dict[int, torch.Tensor] = {}
        g: dict[int, torch.Tensor] = {}
        for i in active:
            p, shape, dt = params[i], gp.layouts[i].merged_shape, gp.dtypes[i]
            if p.grad.is_sparse:
                raise TypeError("Shampoo does not support sparse gradients.")
            w[i] = p.detach().reshape(shape).to(dt)
            grad = p.grad.detach().reshape(shape).to(dt)
            if wd.type == "l2" and wd.value != 0.0:
                grad = grad + wd.value * w[i]  # eq. (2)
            g[i] = grad
        steps = {i: self.state[params[i]]["step"] + 1 for i in active}  # eq. (1)
        return _StepInput(gi, gp, params, active, w, g, steps, float(group["lr"]))

    def _begin_cohorts(self, inp: _StepInput) -> list[_Cohort]:
        # Parameters that missed steps (no grad) run on their own counter.
        cohorts: dict[int, list[int]] = {}
        for i in inp.active:
            cohorts.setdefault(inp.steps[i], []).append(i)
        return [self._begin_cohort(inp, t, positions) for t, positions in cohorts.items()]

    # ------------------------------------------------------ eq. (3) raise
    def _check_nonfinite(self, inputs: list[_StepInput | None]) -> None:
        """Eq. (3), ``"raise"``: before any state changes, on every rank alike.

        Distributed: one all-reduce over the process group, whenever some
        param group has the ``"raise"`` policy, so a gradient that is bad on
        one rank only makes every rank raise the same error.
        """
        raising = [
            inp for inp in inputs
            if inp is not None and inp.gp.config.failure.nonfinite_gradient == "raise"
        ]
        local = None
        for inp in raising:
            pos = self._first_nonfinite(inp)
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
            where = (f" on rank {rank} of {self._dist.full_world} (every rank raises this "
                     "error)")
        if local is None:
            return
        gi, pos = local
        gp = self._plans[gi]
        step = self.state[self.param_groups[gi]["params"][pos]]["step"] + 1
        raise NonFiniteGradientError(
            f"non-finite gradient in parameter {gp.names[pos]!r} at step {step}{where}; "
            "failure.nonfinite_gradient='raise' (no optimizer state or parameter was "
            "changed by this step; 'skip_block' skips such blocks instead)."
        )

    @staticmethod
    def _first_nonfinite(inp: _StepInput) -> int | None:
        """The first parameter with a non-finite gradient, or None: one host read per device.

        Fast path: a finite sum proves every entry finite (one read pass per
        gradient); only when some sum is not finite (a NaN/inf, or an overflow
        of huge finite values) is each gradient checked entrywise.
        """
        sums: dict[torch.device, list[torch.Tensor]] = {}
        for i in inp.active:
            sums.setdefault(inp.g[i].device, []).append(inp.g[i].sum())
        if all(bool(torch.isfinite(torch.stack(s)).all()) for s in sums.values()):
            return None
        for i in inp.active:
            if not bool(torch.isfinite(inp.g[i]).all()):
                return i
        return None

    def _begin_cohort(self, inp: _StepInput, t: int, positions: list[int]) -> _Cohort:
        """Eqs. (3)-(18) for the parameters at step t: state updates and block directions."""
        params, gp, g = inp.params, inp.gp, dict(inp.g)
        cfg = gp.config
        # Eq. (3), "skip_block": per-block finite flags, no host sync.
        block_ok: dict[int, list[torch.Tensor]] = {}
        elem_ok: dict[int, torch.Tensor] = {}
        if cfg.failure.nonfinite_gradient == "skip_block":
            for i in positions:
                block_ok[i], elem_ok[i] = self._finite_blocks(gp.layouts[i], g[i])
                g[i] = torch.where(elem_ok[i], g[i], 0.0)
                skipped = (~torch.stack(block_ok[i])).sum()
                self._counter(g[i].device)["skipped_blocks"].add_(skipped)

        # Eqs. (14b), (15): elementwise graft state and gradient filter.
        filtered: dict[int, torch.Tensor] = {}
        for i in positions:
            st = self.state[params[i]]
            ok = elem_ok.get(i)
            if "graft" in st:
                st["graft"] = _masked(
                    grafting.update_state(st["graft"], g[i], cfg.grafting), st["graft"], ok
                )
            filtered[i] = self._filter(st, g[i], t, cfg, ok)

        # Eqs. (6)-(13), (17): statistics, roots, corrected moment, per bucket.
        selected = self._select_rows(gp, positions, block_ok)
        root_step = is_root_step(t, cfg.schedule)
        root_counts = []
        for bi, (members, rows, ok_rows) in selected.items():
            bucket = gp.buckets[bi]
            gb = gather(bucket, gp.layouts, g, members)
            if is_statistics_step(t, cfg.schedule):
                self._update_statistics(bucket, gb, rows, ok_rows, cfg)
            if root_step:
                updated = self._refresh_roots(bucket, rows, ok_rows, cfg)
                root_counts.append((bucket, members, updated))
            if cfg.eigenvalue_correction is not None:
                self._update_corrected_moment(bucket, gb, rows, ok_rows, cfg)

        # Eq. (14c): graft direction; eqs. (16)-(18): Shampoo direction of each block.
        graft_dir = {
            i: grafting.direction(filtered[i], self.state[params[i]].get("graft"), t, cfg.grafting)
            for i in positions
        }
        use_shampoo = uses_preconditioner(t, cfg.schedule)
        separate = "graft_momentum" in self.state[params[positions[0]]]
        owned = None
        if use_shampoo or separate:
            owned = self._block_directions(gp, selected, filtered, graft_dir)
        return _Cohort(inp, t, positions, elem_ok, graft_dir, use_shampoo, owned, root_step,
                       root_counts)

    def _finish_cohort(self, c: _Cohort, blocks: dict[BlockKey, torch.Tensor]) -> None:
        """Eqs. (18)-(21): assemble the directions, momentum, update."""
        inp, cfg = c.inp, c.inp.gp.config
        shampoo_dir = None
        if c.owned is not None:
            shampoo_dir = self._assemble_directions(inp.gp, inp.gi, c.positions, blocks,
                                                    c.graft_dir)
        for i in c.positions:
            st = self.state[inp.params[i]]
            st["step"] = c.t
            s_dir = shampoo_dir[i] if shampoo_dir is not None else None
            ok = c.elem_ok.get(i)
            u = self._momentum(st, s_dir, c.graft_dir[i], inp.w[i], c.use_shampoo, cfg, inp.lr,
                               ok)
            self._apply_update(inp.params[i], inp.w[i], u, cfg, inp.lr, ok)

    # ---------------------------------------------- eq. (13) failure limit
    def _check_root_failures(self, cohorts: list[_Cohort]) -> None:
        """Eq. (13): raise when a block's roots failed more root steps in a row than allowed.

        Checked after every cohort's roots (before any parameter changes);
        distributed: one all-reduce over the trainer group on root steps, so
        every rank raises for the same block (named with its owner).
        """
        exceeded: tuple[int, ...] | None = None  # (group, position, block, count, step)
        checked = False
        for c in cohorts:
            limit = c.inp.gp.config.failure.max_consecutive_root_failures
            if limit is None or not c.root_step:
                continue
            checked = True
            for bucket, members, updated in c.root_counts:
                over = updated > limit
                if bool(over.any()):  # root steps only (amortized)
                    j = int(torch.nonzero(over)[0, 0])
                    pos, block = bucket.members[members[j]]
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
        shape = gp.layouts[pos].plan.blocks[block].shape
        raise RootFailureError(
            f"inverse roots of block {block} (shape {shape}) of parameter "
            f"{gp.names[pos]!r} failed on {count} root steps in a row, the last "
            f"at step {t} (failure.max_consecutive_root_failures="
            f"{gp.config.failure.max_consecutive_root_failures}){where}."
        )

    # ------------------------------------------------- direction exchange
    def _exchange(self, cohorts: list[_Cohort]) -> dict[BlockKey, torch.Tensor]:
        """Every block's direction, keyed (group, position, block).

        One process: the blocks computed here. Distributed: one all-gather of
        the owners' directions (:class:`~shampoo_torch.distributed.DirectionExchange`);
        the gathered values are used on every rank, the owner's included.
        """
        wanted = [c for c in cohorts if c.owned is not None]
        mine = {
            (c.inp.gi, pos, b): d for c in wanted for (pos, b), d in (c.owned or {}).items()
        }
        if self._dist is None or not wanted:
            return mine
        order: list[tuple[BlockKey, torch.Size, int]] = []
        dtypes = []
        for c in wanted:
            gp = c.inp.gp
            assert gp.owners is not None
            for pos in c.positions:
                plan = gp.layouts[pos].plan
                if not plan.preconditioned:
                    continue
                dtypes.append(gp.factor_dtype)
                for b, block in enumerate(plan.blocks):
                    order.append(((c.inp.gi, pos, b), torch.Size(block.shape),
                                  gp.owners[(pos, b)]))
        if not order:
            return mine
        dtype = self._dist.comm_dtype
        if dtype is None:
            dtype = torch.float64 if torch.float64 in dtypes else torch.float32
        return self._dist.exchange.run(
            order, mine, dtype, self._device(), lambda key: self._plans[key[0]].factor_dtype
        )

    def _device(self) -> torch.device:
        return self.param_groups[0]["params"][0].device

    # ------------------------------------------------------ eq. (3) skip
    @staticmethod
    def _finite_blocks(
        layout: ParamLayout, g: torch.Tensor
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        finite = torch.isfinite(g)
        if layout.single_block:
            ok = finite.all()
            return [ok], ok
        flags = [finite[sl].all() for sl in layout.block_slices]
        elem = torch.empty_like(finite)
        for sl, flag in zip(layout.block_slices, flags, strict=True):
            elem[sl] = flag
        return flags, elem

    def _select_rows(
        self, gp: GroupPlan, positions: list[int], block_ok: dict[int, list[torch.Tensor]]
    ) -> dict[int, tuple[list[int], Rows, torch.Tensor | None]]:
        """Per bucket: the rows of this cohort, their index tensor (None: all), finite flags."""
        chosen = set(positions)
        out: dict[int, tuple[list[int], Rows, torch.Tensor | None]] = {}
        for bi, bucket in enumerate(gp.buckets):
            members = [r for r, (pos, _) in enumerate(bucket.members) if pos in chosen]
            if not members:
                continue
            rows = None
            if len(members) != len(bucket):
                rows = torch.tensor(members, dtype=torch.int64, device=bucket.device)
            ok_rows = None
            if block_ok:
                flags = [block_ok[pos][b] for pos, b in (bucket.members[r] for r in members)]
                ok_rows = torch.stack(flags)
            out[bi] = (members, rows, ok_rows)
        return out

    # --------------------------------------------------- eq. (15) filter
    def _filter(
        self,
        st: dict[str, Any],
        g: torch.Tensor,
        t: int,
        cfg: ShampooConfig,
        ok: torch.Tensor | None,
    ) -> torch.Tensor:
        """Stored ``F_t = beta1 F + (1 - beta1) G``; used ``beta3 F_{t-1} + (1 - beta3) G``."""
        if "filtered" not in st:
            return g
        f = cfg.gradient_filter
        beta3 = f.beta1 if f.beta3 is None else f.beta3
        old = st["filtered"]
        new = f.beta1 * old + (1.0 - f.beta1) * g
        used = new if beta3 == f.beta1 else beta3 * old + (1.0 - beta3) * g
        if f.bias_correction:
            used = used / (1.0 - beta3 * f.beta1 ** (t - 1))
        st["filtered"] = _masked(new, old, ok)
        return used

    # ------------------------------------------- eqs. (6)-(13) statistics
    @staticmethod
    def _update_statistics(
        bucket: Bucket, gb: torch.Tensor, rows: Rows, ok: torch.Tensor | None, cfg: ShampooConfig
    ) -> None:
        """Eq. (6): ``L_k <- beta2 L_k + w G_(k) G_(k)^T`` as one batched GEMM per dim.

        A 1-d block contracts over nothing (``G G^T`` is an outer product);
        there the update is elementwise, because CPU ``baddbmm`` fuses a
        rank-1 update differently for one batch row than for several, which
        would make a block's factor depend on its bucket (:mod:`.invariance`).
        """
        stats = cfg.statistics
        beta2 = stats.beta2
        weight = 1.0 if (beta2 == 1.0 or stats.ema_weight == "one") else 1.0 - beta2
        in_place = rows is None and ok is None
        for k in bucket.dims:
            a, b = contraction_operands(gb, k)
            if a.shape[-1] == 1:  # rank-1 update: products, scalings and sums entry by entry
                outer = a * b if weight == 1.0 else weight * (a * b)
                old = take(bucket.factors[k], rows)
                new = outer + (old if beta2 == 1.0 else beta2 * old)
            elif in_place:
                bucket.factors[k].baddbmm_(a, b, beta=beta2, alpha=weight)
                continue
            else:
                old = take(bucket.factors[k], rows)
                new = torch.baddbmm(old, a, b, beta=beta2, alpha=weight)
            new = _masked(new, old, None if ok is None else ok[:, None, None])
            bucket.factors[k] = put(bucket.factors[k], rows, new)
        assert bucket.statistics_updates is not None
        n = take(bucket.statistics_updates, rows)
        bucket.statistics_updates = put(
            bucket.statistics_updates, rows, n + (1 if ok is None else ok.long())
        )

    def _refresh_roots(
        self, bucket: Bucket, rows: Rows, ok: torch.Tensor | None, cfg: ShampooConfig
    ) -> torch.Tensor:
        """Eqs. (7), (9)-(13): new roots (or eigenbases) for every factor, failures kept.

        Returns the updated consecutive-failure count of each row; the limit
        is checked by :meth:`_check_root_failures` once every cohort is done.
        Roots are computed one block per call on CPU (:func:`rowwise`), so a
        block's root does not depend on the other blocks of its bucket.
        """
        stats = cfg.statistics
        assert bucket.statistics_updates is not None and bucket.consecutive_failures is not None
        n = take(bucket.statistics_updates, rows)
        bc = None
        if stats.bias_correction and stats.beta2 < 1.0:  # eq. (7)
            power = rowwise(lambda x: torch.pow(stats.beta2, x), n.to(bucket.dtype))
            bc = torch.where(n > 0, 1.0 - power, torch.ones_like(power))
        failed_any = torch.zeros(n.shape[0], dtype=torch.bool, device=bucket.device)
        method = cfg.root_inverse
        counter = self._counter(bucket.device)
        for k in bucket.dims:
            a = take(bucket.factors[k], rows)
            if bc is not None:
                a = a / bc[:, None, None]
            root = bucket.roots[k]
            if cfg.eigenvalue_correction is not None:
                new, good = rowwise(roots.eigenbasis, a)
            elif isinstance(method, CoupledNewtonConfig):
                new, good = rowwise(
                    partial(roots.root_inverse_coupled_newton, root=int(root), eps=cfg.epsilon,
                            config=method),
                    a,
                )
            else:
                new, good = rowwise(
                    partial(roots.root_inverse_eigh, root=root, eps=cfg.epsilon), a
                )
            # Row-major, whatever layout the decomposition returned: later matmuls must
            # pick the same kernel for a block whatever its batch (:mod:`.invariance`).
            new = new.contiguous()
            failed = ~good if ok is None else (~good & ok)
            keep_new = good if ok is None else (good & ok)
            old = take(bucket.inverse_roots[k], rows)
            bucket.inverse_roots[k] = put(
                bucket.inverse_roots[k], rows, torch.where(keep_new[:, None, None], new, old)
            )
            counter["root_failures"].add_(failed.sum())
            failed_any |= failed
        consecutive = take(bucket.consecutive_failures, rows)
        updated = torch.where(failed_any, consecutive + 1, torch.zeros_like(consecutive))
        if ok is not None:
            updated = torch.where(ok, updated, consecutive)
        bucket.consecutive_failures = put(bucket.consecutive_failures, rows, updated)
        return updated

    @staticmethod
    def _rotate(
        bucket: Bucket, x: torch.Tensor, rows: Rows, transpose: bool
    ) -> torch.Tensor:
        """``X x_k Q_k^T`` (transpose) or ``X x_k Q_k`` over every preconditioned dim."""
        for k in bucket.dims:
            x = mode_product(x, take(bucket.inverse_roots[k], rows), k, transpose=transpose)
        return x

    def _update_corrected_moment(
        self, bucket: Bucket, gb: torch.Tensor, rows: Rows, ok: torch.Tensor | None,
        cfg: ShampooConfig,
    ) -> None:
        """Eq. (17): ``D <- beta2 D + (1 - beta2) (G x_k Q_k^T)^2`` in the current basis."""
        ec = cfg.eigenvalue_correction
        assert ec is not None and bucket.corrected is not None
        assert bucket.corrected_updates is not None
        rotated = self._rotate(bucket, gb, rows, transpose=True)
        old = take(bucket.corrected, rows)
        if ec.beta2 == 1.0:
            new = old + rotated**2
        else:
            new = ec.beta2 * old + (1.0 - ec.beta2) * rotated**2
        if ok is not None:
            new = torch.where(ok.view(-1, *([1] * (new.dim() - 1))), new, old)
        bucket.corrected = put(bucket.corrected, rows, new)
        n = take(bucket.corrected_updates, rows)
        bucket.corrected_updates = put(
            bucket.corrected_updates, rows, n + (1 if ok is None else ok.long())
        )

    # -------------------------------------------- eqs. (16)-(18) direction
    def _block_directions(
        self,
        gp: GroupPlan,
        selected: dict[int, tuple[list[int], Rows, torch.Tensor | None]],
        filtered: dict[int, torch.Tensor],
        graft_dir: dict[int, torch.Tensor],
    ) -> dict[tuple[int, int], torch.Tensor]:
        """Eqs. (16)-(17) per bucket, and eq. (18) when its scope is the block.

        Keyed (parameter position, block); only the blocks held here (all of
        them in one process, the owned ones when distributed).
        """
        cfg = gp.config
        graft = cfg.grafting
        per_block: dict[tuple[int, int], torch.Tensor] = {}
        for bi, (members, rows, _) in selected.items():
            bucket = gp.buckets[bi]
            fb = gather(bucket, gp.layouts, filtered, members)
            if cfg.eigenvalue_correction is not None:
                pb = self._corrected_direction(bucket, fb, rows, cfg)
            else:
                pb = fb
                for k in bucket.dims:  # eq. (16)
                    pb = mode_product(pb, take(bucket.inverse_roots[k], rows), k)
            if graft.type != "none" and graft.norm_scope == "block":  # eq. (18), per block
                gd = gather(bucket, gp.layouts, graft_dir, members)
                pb = pb * (_norms(gd) / (_norms(pb) + graft.norm_epsilon))
            for j, r in enumerate(members):
                per_block[bucket.members[r]] = pb[j]
        return per_block

    def _assemble_directions(
        self,
        gp: GroupPlan,
        gi: int,
        positions: list[int],
        blocks: dict[BlockKey, torch.Tensor],
        graft_dir: dict[int, torch.Tensor],
    ) -> dict[int, torch.Tensor]:
        """Each parameter's Shampoo direction from its blocks, eq. (18) per parameter."""
        graft = gp.config.grafting
        out = {}
        for i in positions:
            lay = gp.layouts[i]
            if not lay.plan.preconditioned:
                out[i] = graft_dir[i]  # skip rules: the graft direction (eq. 18)
                continue
            pi = assemble(lay, [blocks[(gi, i, b)] for b in range(len(lay.block_slices))],
                          gp.dtypes[i])
            if graft.type != "none" and graft.norm_scope == "parameter":  # eq. (18)
                scale = torch.linalg.vector_norm(graft_dir[i]) / (
                    torch.linalg.vector_norm(pi) + graft.norm_epsilon
                )
                pi = pi * scale
            out[i] = pi
        return out

    def _corrected_direction(
        self, bucket: Bucket, fb: torch.Tensor, rows: Rows, cfg: ShampooConfig
    ) -> torch.Tensor:
        """Eq. (17): ``((F x_k Q_k^T) / ((D / bc)^(1/root) + eps)) x_k Q_k``."""
        ec = cfg.eigenvalue_correction
        assert ec is not None and bucket.corrected is not None
        assert bucket.corrected_updates is not None
        d = take(bucket.corrected, rows)
        if ec.bias_correction and ec.beta2 < 1.0:
            n = take(bucket.corrected_updates, rows)
            power = rowwise(lambda x: torch.pow(ec.beta2, x), n.to(bucket.dtype))
            bc = torch.where(n > 0, 1.0 - power, torch.ones_like(power))
            d = d / bc.view(-1, *([1] * (d.dim() - 1)))
        rotated = self._rotate(bucket, fb, rows, transpose=True)
        # sqrt is correctly rounded (batch invariant); other roots one block per call.
        root_d = torch.sqrt(d) if ec.root == 2 else rowwise(lambda x: x ** (1.0 / ec.root), d)
        scaled = rotated / (root_d + ec.epsilon)
        return self._rotate(bucket, scaled, rows, transpose=False)

    # ---------------------------------------- eqs. (19)-(21) momentum, update
    @staticmethod
    def _momentum(
        st: dict[str, Any],
        shampoo_dir: torch.Tensor | None,
        graft_dir: torch.Tensor,
        w: torch.Tensor,
        use_shampoo: bool,
        cfg: ShampooConfig,
        lr: float,
        ok: torch.Tensor | None,
    ) -> torch.Tensor:
        mom, wd = cfg.momentum, cfg.weight_decay
        lr_first = mom.learning_rate_placement == "before_momentum"

        def prepare(p: torch.Tensor) -> torch.Tensor:
            if lr_first:
                p = lr * p
            if wd.type == "direction" and wd.value != 0.0:
                p = p + wd.value * w  # eq. (19)
            return p

        chosen = shampoo_dir if use_shampoo else graft_dir
        assert chosen is not None
        p = prepare(chosen)
        if "momentum" not in st:
            return p
        mu, damp = mom.momentum, 1.0 - mom.dampening
        if "graft_momentum" not in st:  # eq. (20), one shared buffer
            st["momentum"] = _masked(mu * st["momentum"] + damp * p, st["momentum"], ok)
            m = st["momentum"]
        else:  # eq. (20), separate Shampoo and graft buffers, both updated every step
            assert shampoo_dir is not None
            ps = p if use_shampoo else prepare(shampoo_dir)
            pg = prepare(graft_dir) if use_shampoo else p
            st["momentum"] = _masked(mu * st["momentum"] + damp * ps, st["momentum"], ok)
            st["graft_momentum"] = _masked(
                mu * st["graft_momentum"] + damp * pg, st["graft_momentum"], ok
            )
            m = st["momentum"] if use_shampoo else st["graft_momentum"]
        return damp * p + mu * m if mom.nesterov else m

    @staticmethod
    def _apply_update(
        p: torch.Tensor,
        w: torch.Tensor,
        u: torch.Tensor,
        cfg: ShampooConfig,
        lr: float,
        ok: torch.Tensor | None,
    ) -> None:
        """Eq. (21): ``W <- W - lr U`` (``- lr wd W`` with update decay), cast to p's dtype."""
        wd = cfg.weight_decay
        step_lr = 1.0 if cfg.momentum.learning_rate_placement == "before_momentum" else lr
        new_w = w - step_lr * u
        if wd.type == "update" and wd.value != 0.0:
            new_w = new_w - lr * wd.value * w
        if ok is not None:
            new_w = torch.where(ok, new_w, w)
        p.copy_(new_w.view(p.shape))

    # ------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Tensors, ints, floats, strings, dicts and lists only (``weights_only`` loads).

        Per parameter (by index, as torch does): ``step``, the elementwise state,
        and per block its factors, roots/eigenbases and counters. Each group
        keeps its hyper-parameters with ``config`` as ``config.to_dict()``.
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


def _check_lr(lr: object) -> None:
    if isinstance(lr, torch.Tensor):
        raise TypeError("lr must be a Python float (tensor learning rates are not supported).")
    if not isinstance(lr, (int, float)) or not lr >= 0.0:
        raise ValueError(f"lr = {lr!r} is invalid: allowed is a float >= 0.")
