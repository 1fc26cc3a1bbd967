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

Host-device syncs: none in the default path of step(). Two documented
exceptions: with ``failure.nonfinite_gradient = "raise"`` one reduction per
param group per step is read on the host to raise before any state changes
(use ``"skip_block"`` for a sync-free step), and root steps (amortized) sync
inside ``torch.linalg.eigh`` on CUDA, in the coupled Newton stopping test, and
for ``failure.max_consecutive_root_failures``. Counters (:attr:`metrics`)
are device tensors read lazily.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from shampoo_spec import (
    CoupledNewtonConfig,
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
from .errors import NonFiniteGradientError, RootFailureError

_FACTOR_DTYPES = {"float32": torch.float32, "float64": torch.float64}
_ELEMENTWISE_STATE = ("graft", "filtered", "momentum", "graft_momentum")


@dataclass
class GroupPlan:
    """Everything fixed about one param group: config, layouts, buckets, dtypes, names."""

    config: ShampooConfig
    layouts: list[ParamLayout]
    buckets: list[Bucket]
    dtypes: list[torch.dtype]  # per parameter: dtype of its elementwise state and directions
    names: list[str]


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
    ) -> None:
        config = ShampooConfig() if config is None else config
        if not isinstance(config, ShampooConfig):
            raise TypeError(f"config must be a ShampooConfig, got {type(config).__name__}.")
        if lr is not None:
            _check_lr(lr)
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
        plans = [plan_parameter(tuple(p.shape), cfg) for p in params]
        layouts, buckets = build_buckets(plans, [p.device for p in params], fdt)
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
        return GroupPlan(cfg, layouts, buckets, dtypes, list(names))

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
        non-finite gradient (eq. 3, ``"skip_block"``).
        """
        out = {"root_failures": 0, "skipped_blocks": 0}
        for counters in self._counters.values():
            for name, value in counters.items():
                out[name] += int(value)
        return out

    # -------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One Shampoo step for every parameter that has a gradient (eqs. 1-21)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, plan in zip(self.param_groups, self._plans, strict=True):
            self._step_group(group, plan)
        return loss

    def _step_group(self, group: dict[str, Any], gp: GroupPlan) -> None:
        cfg = gp.config
        params: list[torch.Tensor] = group["params"]
        active = [i for i, p in enumerate(params) if p.grad is not None]
        if not active:
            return
        lr = float(group["lr"])
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
        if cfg.failure.nonfinite_gradient == "raise":
            self._raise_if_nonfinite(gp, active, g, steps)
        # Parameters that missed steps (no grad) run on their own counter.
        cohorts: dict[int, list[int]] = {}
        for i in active:
            cohorts.setdefault(steps[i], []).append(i)
        for t, positions in cohorts.items():
            self._step_cohort(params, gp, t, positions, w, g, lr)

    def _raise_if_nonfinite(
        self, gp: GroupPlan, active: list[int], g: dict[int, torch.Tensor], steps: dict[int, int]
    ) -> None:
        """Eq. (3), ``"raise"``: one host read per device, before any state changes.

        Fast path: a finite sum proves every entry finite (one read pass per
        gradient); only when some sum is not finite (a NaN/inf, or an overflow
        of huge finite values) is each gradient checked entrywise.
        """
        sums: dict[torch.device, list[torch.Tensor]] = {}
        for i in active:
            sums.setdefault(g[i].device, []).append(g[i].sum())
        if all(bool(torch.isfinite(torch.stack(s)).all()) for s in sums.values()):
            return
        for i in active:
            if not bool(torch.isfinite(g[i]).all()):
                raise NonFiniteGradientError(
                    f"non-finite gradient in parameter {gp.names[i]!r} at step {steps[i]}; "
                    "failure.nonfinite_gradient='raise' (no optimizer state or parameter was "
                    "changed by this step; 'skip_block' skips such blocks instead)."
                )

    def _step_cohort(
        self,
        params: list[torch.Tensor],
        gp: GroupPlan,
        t: int,
        positions: list[int],
        w: dict[int, torch.Tensor],
        g: dict[int, torch.Tensor],
        lr: float,
    ) -> None:
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
        for bi, (members, rows, ok_rows) in selected.items():
            bucket = gp.buckets[bi]
            gb = gather(bucket, gp.layouts, g, members)
            if is_statistics_step(t, cfg.schedule):
                self._update_statistics(bucket, gb, rows, ok_rows, cfg)
            if is_root_step(t, cfg.schedule):
                self._refresh_roots(bucket, rows, ok_rows, members, gp, t)
            if cfg.eigenvalue_correction is not None:
                self._update_corrected_moment(bucket, gb, rows, ok_rows, cfg)

        # Eq. (14c): graft direction; eqs. (16)-(18): Shampoo direction.
        graft_dir = {
            i: grafting.direction(filtered[i], self.state[params[i]].get("graft"), t, cfg.grafting)
            for i in positions
        }
        use_shampoo = uses_preconditioner(t, cfg.schedule)
        separate = "graft_momentum" in self.state[params[positions[0]]]
        shampoo_dir = None
        if use_shampoo or separate:
            shampoo_dir = self._shampoo_directions(gp, positions, selected, filtered, graft_dir)

        # Eqs. (19)-(21): direction decay, momentum, update.
        for i in positions:
            st = self.state[params[i]]
            st["step"] = t
            s_dir = shampoo_dir[i] if shampoo_dir is not None else None
            u = self._momentum(st, s_dir, graft_dir[i], w[i], use_shampoo, cfg, lr, elem_ok.get(i))
            self._apply_update(params[i], w[i], u, cfg, lr, elem_ok.get(i))

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
        """Eq. (6): ``L_k <- beta2 L_k + w G_(k) G_(k)^T`` as one batched GEMM per dim."""
        stats = cfg.statistics
        beta2 = stats.beta2
        weight = 1.0 if (beta2 == 1.0 or stats.ema_weight == "one") else 1.0 - beta2
        in_place = rows is None and ok is None
        for k in bucket.dims:
            a, b = contraction_operands(gb, k)
            if in_place:
                bucket.factors[k].baddbmm_(a, b, beta=beta2, alpha=weight)
                continue
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
        self,
        bucket: Bucket,
        rows: Rows,
        ok: torch.Tensor | None,
        members: list[int],
        gp: GroupPlan,
        t: int,
    ) -> None:
        """Eqs. (7), (9)-(13): new roots (or eigenbases) for every factor, failures kept."""
        cfg = gp.config
        stats = cfg.statistics
        assert bucket.statistics_updates is not None and bucket.consecutive_failures is not None
        n = take(bucket.statistics_updates, rows)
        bc = None
        if stats.bias_correction and stats.beta2 < 1.0:  # eq. (7)
            power = torch.pow(stats.beta2, n.to(bucket.dtype))
            bc = torch.where(n > 0, 1.0 - power, torch.ones_like(power))
        failed_any = torch.zeros(len(members), dtype=torch.bool, device=bucket.device)
        method = cfg.root_inverse
        counter = self._counter(bucket.device)
        for k in bucket.dims:
            a = take(bucket.factors[k], rows)
            if bc is not None:
                a = a / bc[:, None, None]
            if cfg.eigenvalue_correction is not None:
                new, good = roots.eigenbasis(a)
            elif isinstance(method, CoupledNewtonConfig):
                new, good = roots.root_inverse_coupled_newton(
                    a, int(bucket.roots[k]), cfg.epsilon, method
                )
            else:
                new, good = roots.root_inverse_eigh(a, bucket.roots[k], cfg.epsilon)
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
        limit = cfg.failure.max_consecutive_root_failures
        if limit is not None and bool((updated > limit).any()):  # root steps only
            j = int(torch.nonzero(updated > limit)[0, 0])
            pos, block = bucket.members[members[j]]
            raise RootFailureError(
                f"inverse roots of block {block} (shape {bucket.shape}) of parameter "
                f"{gp.names[pos]!r} failed on {int(updated[j])} root steps in a row, the last "
                f"at step {t} (failure.max_consecutive_root_failures={limit})."
            )

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
    def _shampoo_directions(
        self,
        gp: GroupPlan,
        positions: list[int],
        selected: dict[int, tuple[list[int], Rows, torch.Tensor | None]],
        filtered: dict[int, torch.Tensor],
        graft_dir: dict[int, torch.Tensor],
    ) -> dict[int, torch.Tensor]:
        cfg = gp.config
        graft = cfg.grafting
        grafted = graft.type != "none"
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
            if grafted and graft.norm_scope == "block":  # eq. (18), per block
                gd = gather(bucket, gp.layouts, graft_dir, members)
                pb = pb * (_norms(gd) / (_norms(pb) + graft.norm_epsilon))
            for j, r in enumerate(members):
                per_block[bucket.members[r]] = pb[j]
        out = {}
        for i in positions:
            lay = gp.layouts[i]
            if not lay.plan.preconditioned:
                out[i] = graft_dir[i]  # skip rules: the graft direction (eq. 18)
                continue
            pi = assemble(lay, [per_block[(i, b)] for b in range(len(lay.block_slices))],
                          gp.dtypes[i])
            if grafted and graft.norm_scope == "parameter":  # eq. (18), whole parameter
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
            power = torch.pow(ec.beta2, n.to(bucket.dtype))
            bc = torch.where(n > 0, 1.0 - power, torch.ones_like(power))
            d = d / bc.view(-1, *([1] * (d.dim() - 1)))
        rotated = self._rotate(bucket, fb, rows, transpose=True)
        scaled = rotated / (d ** (1.0 / ec.root) + ec.epsilon)
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


def _check_lr(lr: object) -> None:
    if isinstance(lr, torch.Tensor):
        raise TypeError("lr must be a Python float (tensor learning rates are not supported).")
    if not isinstance(lr, (int, float)) or not lr >= 0.0:
        raise ValueError(f"lr = {lr!r} is invalid: allowed is a float >= 0.")
