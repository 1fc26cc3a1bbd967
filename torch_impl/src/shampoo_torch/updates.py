"""Phase 5 of the step: eqs. (18)-(22) per parameter, batched across a cohort on the
accelerator path.

For each parameter: its Shampoo direction assembled from its blocks and rescaled
per parameter (eq. 18), direction decay and momentum (eqs. 19-20,
:func:`~shampoo_torch.elementwise.momentum`), iterate averaging (eq. 20d), and the
guarded update (eqs. 21-22, :func:`apply_update`).

On the accelerator path (:mod:`.device_path`) the update of every parameter that
keeps no buffer (no momentum, no averaging, no ``update_dtype``) is one batch:
:func:`apply_updates`, the same ops per tensor as
``apply_update`` (so the same bits) with the elementwise arithmetic as
``torch._foreach_*`` ops, one launch each for the cohort. The CPU path updates one
parameter at a time, with its host shortcut for eq. (22).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shampoo_spec import ShampooConfig

from . import elementwise, preconditioner
from .block_grid import BlockVectors
from .blocks import assemble
from .cohorts import LR_POWER_SUM, Cohort, write_back
from .device_path import moved, on_cpu_path, scalar
from .distributed import BlockKey
from .elementwise import SCALE_SUFFIX, read_momentum, write_momentum
from .metrics import StepCounters

#: Eq. (21a)'s ``update_dtype``: the dtype the update is rounded to before it is added.
UPDATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    # The accelerator path updates the parameters without buffers in one batch.
    batched = (cfg.averaging is None and cfg.update_dtype is None and bool(positions)
               and not on_cpu_path(inp.params[positions[0]].device))
    for i in positions:
        c.updated.add(i)
        shampoo_dir = None if c.owned is None else parameter_direction(c, i, blocks)
        if c.owned is not None:
            for b in range(inp.gp.layouts[i].num_blocks):
                c.owned.pop((i, b), None)
                blocks.pop((inp.gi, i, b), None)
        st = state[inp.params[i]]
        if not inp.in_graph:  # else compiled.count_steps, after the graph
            st["step"] = c.t
        ok = c.elem_ok.get(i)
        u, buffers = elementwise.momentum(st, shampoo_dir, c.graft_dir.get(i), inp.w[i],
                                          c.use_shampoo, cfg, inp.lr, ok, lr_0, inp.momentum)
        if batched and not buffers:
            batch.append((i, u))
            continue
        delta = None
        if cfg.averaging is not None:  # eq. (20d)
            delta, buffers["averaged"] = elementwise.averaged_step(
                st, u, inp.w[i], cfg, inp.lr, group.get(LR_POWER_SUM, 0.0), ok, lr_0)
        withheld = apply_update(inp.targets.get(i, inp.params[i]), inp.w[i], u, buffers, st,
                                cfg, inp.lr, ok, delta)
        write_back(inp, i)  # lossless FSDP2: this rank's piece of the new parameter
        c.withheld.append(withheld.reshape(1))
    if batch:
        c.withheld.append(apply_updates(
            [inp.targets.get(i, inp.params[i]) for i, _ in batch],
            [inp.w[i] for i, _ in batch], [u for _, u in batch], cfg, inp.lr,
            [c.elem_ok.get(i) for i, _ in batch],
            KeptVectors(inp.gp.vectors, inp.ok, inp.ok_single, [i for i, _ in batch])))
        for i, _ in batch:
            write_back(inp, i)


def all_finite_on_host(tensors: Sequence[torch.Tensor]) -> bool:
    """True only if every entry of ``tensors`` is finite, read on the host from one sum
    each; False off CPU (a read would sync the device) and wherever a sum is not
    finite: an inf or NaN entry makes it so, and so may an overflow of finite
    entries, for which the caller's exact per-entry test then runs.
    """
    return all(on_cpu_path(t.device) and t.is_floating_point() and bool(torch.isfinite(t.sum()))
               for t in tensors)


def finite_entries(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Where every one of ``tensors`` (of one shape) is finite: ``sum_j (x_j - x_j)`` is
    0 there and NaN elsewhere, since ``x - x`` is exactly 0 for a finite x and NaN for
    an inf or NaN, and a NaN term makes the sum NaN. The same flags as ``isfinite`` of
    each, and'ed, in ``2n`` elementwise ops instead of ``4n - 1`` (isfinite is itself
    three); the last test is ``total == total`` (false only for NaN), with no scalar."""
    total = torch.sub(tensors[0], tensors[0])
    for x in tensors[1:]:
        total = total + torch.sub(x, x)
    return torch.eq(total, total)


def apply_update(
    p: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    buffers: dict[str, torch.Tensor],
    st: dict[str, Any],
    cfg: ShampooConfig,
    lr: float,
    ok: torch.Tensor | None,
    delta: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. (21): ``W <- W - lr U`` (``- lr wd W`` with update decay), written into p's dtype.

    ``delta``: eq. (20d)'s update of W in place of ``-lr U`` (iterate averaging;
    its Z is in ``buffers``).

    Eq. (21a), ``update_dtype`` c set: ``W <- W + round_c(-lr U - lr wd W)``,
    the update rounded to c (torch's cast, as Meta's copy into its
    ``communication_dtype`` buffer) before it is added.

    Eq. (22), the update guard: an entry whose new value (in the parameter's
    dtype) or new momentum buffer is non-finite keeps its old ones; the
    statistics before it are finite by eq. (3), so only the direction can
    overflow (a huge inverse root times a finite gradient). Stores the
    buffers and returns a 0-d bool tensor (no host sync): whether an entry
    of an admitted block was withheld.
    """
    wd = cfg.weight_decay
    step_lr = 1.0 if cfg.momentum.lr_before_momentum else lr
    if delta is not None:
        new_w = w + (delta if cfg.update_dtype is None else
                     delta.to(UPDATE_DTYPES[cfg.update_dtype]).to(w.dtype))  # eq. (21a)
    elif cfg.update_dtype is None:
        new_w = step_lr * u
        # W - lr U written over the fresh product (the same subtraction): one
        # parameter-sized temporary, not two.
        new_w = (torch.sub(w, new_w, out=new_w) if new_w.dtype == w.dtype
                 and new_w.shape == w.shape else w - new_w)
        if wd.applies("update"):
            new_w.sub_(lr * wd.value * w)
    else:
        delta = -(step_lr * u)
        if wd.applies("update"):
            delta = delta - lr * wd.value * w
        new_w = w + delta.to(UPDATE_DTYPES[cfg.update_dtype]).to(w.dtype)  # eq. (21a)
    new_w = moved(new_w, dtype=p.dtype)
    quantized = any(st.get(key + SCALE_SUFFIX) is not None for key in buffers)
    if not quantized and all_finite_on_host([new_w, *buffers.values()]):
        # Every entry finite (checked on CPU, where reading it syncs no device):
        # eq. (22) keeps all of them, so skip its per-entry test and selects.
        for key, b in buffers.items():
            write_momentum(st, key, b, tuple(p.shape))
        p.copy_((new_w if ok is None else torch.where(ok, new_w, w)).view(p.shape))
        return torch.zeros((), dtype=torch.bool, device=p.device)
    checked = [new_w, *buffers.values()]
    for key, b in buffers.items():
        scale = st.get(key + SCALE_SUFFIX)
        if scale is not None:  # eq. (20b) quantizes fl_d(M): it must be finite too
            checked.append(b.to(scale.dtype))
    keep = finite_entries(checked)
    for key, b in buffers.items():
        old = read_momentum(st, key, tuple(b.shape), b.dtype)
        write_momentum(st, key, torch.where(keep, b, old), tuple(p.shape))
    write = keep if ok is None else keep & ok
    new_p = torch.where(write, new_w, w)
    p.copy_(new_p if new_p.shape == p.shape else new_p.view(p.shape))
    # ok & ~keep is ok ^ write (write is within ok): one op, not two.
    withheld = ~keep if ok is None else ok ^ write
    return withheld.any()


def apply_updates(
    targets: list[torch.Tensor], ws: list[torch.Tensor], us: list[torch.Tensor],
    cfg: ShampooConfig, lr: float, oks: list[torch.Tensor | None],
    kept: KeptVectors | None = None,
) -> torch.Tensor:
    """:func:`apply_update` for several parameters that keep no buffer (no momentum, no
    averaging, no ``update_dtype``): per non-empty parameter (an empty one withholds
    nothing), in order, whether it withheld an entry of an admitted block (eq. 22).

    The same ops per tensor as :func:`apply_update`'s per-entry branch (so the same
    bits), its elementwise arithmetic as ``torch._foreach_*`` ops (one launch each
    for all the parameters): ``W - lr U`` (eq. 21, ``- lr wd W`` with update decay),
    eq. (22)'s ``x - x`` (:func:`finite_entries`), the copies into the parameters,
    and the count, from one inf-norm of ``x - x`` over the admitted entries (NaN
    exactly where an admitted entry is not finite). Per parameter remain the
    selects: ``keep``, its ``and`` with eq. (3)'s flags, and ``where``.

    ``kept`` (the accelerator path): the param group's kept vectors and each
    parameter's position in it. Where every parameter is one block of one dtype
    (its eq. 3 flag a 0-d view of ``ok``), the flags join ``x - x`` as a 0 or a
    NaN added to it (one launch: :func:`_withheld_by_block`), so per parameter
    remain ``keep`` and ``where``; the result is then per block of the group.
    """
    wd = cfg.weight_decay
    step_lr = 1.0 if cfg.momentum.lr_before_momentum else lr
    new_ws = list(torch._foreach_sub(ws, torch._foreach_mul(us, step_lr)))
    if wd.applies("update"):
        torch._foreach_sub_(new_ws, torch._foreach_mul(ws, lr * wd.value))
    new_ws = [moved(x, dtype=p.dtype) for x, p in zip(new_ws, targets, strict=True)]
    nans = torch._foreach_sub(new_ws, new_ws)  # 0 where finite, NaN elsewhere
    if kept is not None and _one_block_each(nans, oks, kept):
        return _withheld_by_block(targets, ws, new_ws, nans, kept)
    news, admitted_nans = [], []
    for p, w, x, d, ok in zip(targets, ws, new_ws, nans, oks, strict=True):
        keep = torch.eq(d, d)
        new = torch.where(keep if ok is None else keep & ok, x, w)
        news.append(new if new.shape == p.shape else new.view(p.shape))
        if d.numel() > 0:  # an inf-norm needs an entry
            admitted_nans.append(d if ok is None
                                 else torch.where(ok, d, scalar(0.0, d.dtype, d.device)))
    torch._foreach_copy_(targets, news)
    if not admitted_nans:
        return torch.zeros(0, dtype=torch.bool, device=targets[0].device)
    return torch.stack(torch._foreach_norm(admitted_nans, float("inf"))).isnan()


@dataclass
class KeptVectors:
    """What :func:`apply_updates` needs of a param group's kept vectors: the vectors,
    eq. (3)'s per-block flags (None: every block steps), their 0-d views by position,
    and the position of each parameter updated."""

    vectors: BlockVectors
    ok: torch.Tensor | None
    ok_single: Mapping[int, torch.Tensor]
    positions: list[int]


def _one_block_each(nans: Sequence[torch.Tensor], oks: list[torch.Tensor | None],
                    kept: KeptVectors) -> bool:
    """Whether every parameter is non-empty, one block, of one dtype, with no flag or its
    0-d flag from ``kept`` (the case :func:`_withheld_by_block` takes)."""
    single = kept.vectors.get("withheld", nans[0].dtype, nans[0].device).single
    return all(d.numel() > 0 and d.dtype == nans[0].dtype and pos in single
               and (ok is None if kept.ok is None else ok is kept.ok_single.get(pos))
               for d, ok, pos in zip(nans, oks, kept.positions, strict=True))


def _withheld_by_block(targets: list[torch.Tensor], ws: list[torch.Tensor],
                       new_ws: list[torch.Tensor], nans: Sequence[torch.Tensor],
                       kept: KeptVectors) -> torch.Tensor:
    """Eq. (22) for one-block parameters, their eq. (3) flags folded into ``x - x``: an
    entry is written where ``(x - x) + r == itself``, ``r`` 0 for an admitted block and
    NaN for a refused one (the same entries as ``keep & ok``). Returns per block of the
    group whether an admitted entry was withheld (false for the blocks not updated)."""
    dtype, device = nans[0].dtype, nans[0].device
    marked = nans
    if kept.ok is not None:
        refused = kept.vectors.get("refused", dtype, device)
        torch.where(kept.ok, scalar(0.0, dtype, device), scalar(math.nan, dtype, device),
                    out=refused.data)
        marked = torch._foreach_add(list(nans), [refused.single[pos] for pos in kept.positions])
    news = []
    for p, w, x, m in zip(targets, ws, new_ws, marked, strict=True):
        new = torch.where(torch.eq(m, m), x, w)
        news.append(new if new.shape == p.shape else new.view(p.shape))
    torch._foreach_copy_(targets, news)
    # Per parameter max |x - x|: NaN exactly where an entry is not finite.
    worst = kept.vectors.get("withheld", dtype, device)
    worst.data.zero_()  # the blocks not updated here withhold nothing
    torch._foreach_copy_([worst.single[pos] for pos in kept.positions],
                         torch._foreach_norm(list(nans), float("inf")))
    withheld = worst.data.isnan()
    return withheld if kept.ok is None else withheld & kept.ok


def count_withheld(c: Cohort, counters: StepCounters) -> None:
    """Adds the cohort's eq. (22) withheld parameter steps to ``withheld_updates``: one
    sum and one add for the cohort, not an add per parameter."""
    if not c.withheld:
        return
    flags = c.withheld[0] if len(c.withheld) == 1 else torch.cat(c.withheld)
    count = flags.sum()
    counters.on(count.device)["withheld_updates"].add_(count)
