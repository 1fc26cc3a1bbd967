"""Eq. (3): which blocks' steps are refused, decided before any state changes.

A block's step is refused when its gradient (after eq. 2's L2 decay) holds a
non-finite entry, or when ``shampoo_spec.block_overflows(max|G_B|, |B|, m)``:
``m + |B| max|G_B|^2 > shampoo_spec.STATE_LIMIT``, m being the largest
absolute entry of the block's state (its factors, the graft state on its
slice, the eigenvalue-corrected moment D; 0 where absent; eq. 14e's Adafactor
moments R, C, V of the whole parameter for every block of it). Such a gradient
could carry the state out of float32's range (a sum of squares of 1e20 is
inf), so it is treated exactly like a non-finite one: raised under
``"raise"``, skipped and counted under ``"skip_block"``.

:func:`block_codes` computes the decision for every block of a param group
at once, on the device and without a host sync: one separable max per
parameter over its blocks (:func:`~shampoo_torch.block_grid.flat_block_maxima`) for
the gradient and the graft state, one max per row of each block group's
factors and moment (max |x| over the whole factor, not its diagonal: a
loaded factor need not be PSD), and the bound on the param group's flat
vector of blocks (every parameter's blocks in order, as
:class:`~shampoo_torch.state.ParamGroupPlan` numbers them). The bound is
computed in float64 (float32 where the device has no float64), so the
decision matches the reference's.

:func:`refuse_blocks` then takes the step's decision from the codes: agreed
over the process group when distributed (one all-reduce, max), raised under
``"raise"`` before anything changed, or kept as per-row flags on the device
and counted under ``"skip_block"``.

``"raise"`` on the accelerator path (:mod:`.device_path`) reads nothing on the
host in a non-root step: the refused blocks are skipped on the device, as under
``"skip_block"`` (their state and entries unchanged; not counted), their codes
are kept (:class:`PendingRefusals`, a max over the steps), and the error is
raised at the next host read: the next root step (before it changes anything),
or the user's next read of :attr:`~shampoo_torch.Shampoo.metrics`,
:meth:`~shampoo_torch.Shampoo.blocks`, a state dict, or
:meth:`~shampoo_torch.Shampoo.check_refusals`. Its message names the parameter,
the block and the steps since the previous read (docs/reliability.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shampoo_spec import STATE_LIMIT, NonFiniteGradientError, factor_limit, is_root_step

from .block_grid import flat_block_maxima
from .blocks import BlockGroup
from .cohorts import StepInput
from .device_path import moved, on_cpu_path, scalar
from .distributed import Distributor
from .grafting import adafactor_max_abs
from .metrics import StepCounters
from .packed import SymmetricStack
from .state import ParamGroupPlan

OK, TOO_LARGE, NONFINITE = 0, 1, 2
CODE_DTYPE = torch.int32


@dataclass
class PendingRefusals:
    """Eq. (3) ``"raise"`` deferred on the accelerator path: per param group, the
    largest code of each block (flat order) since the last host read, on the device.

    ``steps``: per param group, the first and last step (host ints) whose codes the
    pending tensor holds, for the error message.
    """

    codes: dict[int, torch.Tensor] = field(default_factory=dict)
    steps: dict[int, tuple[int, int]] = field(default_factory=dict)

    def add(self, gi: int, code: torch.Tensor, t: int | None) -> None:
        """Fold one step's codes into the pending ones (one launch, no host read); ``t``
        None: the step is noted after a compiled step (:meth:`note`)."""
        old = self.codes.get(gi)
        self.codes[gi] = code.clone() if old is None else torch.maximum(old, code)
        if t is not None:
            self.note(gi, t)

    def note(self, gi: int, t: int) -> None:
        """Step t of param group gi folded its codes in."""
        first = self.steps.get(gi, (t, t))[0]
        self.steps[gi] = (first, t)

    def raise_any(self, state: Mapping[torch.Tensor, dict[str, Any]],
                  param_groups: Sequence[Mapping[str, Any]],
                  plans: Sequence[ParamGroupPlan]) -> None:
        """One host read of every pending code; NonFiniteGradientError for the first
        refused block, if any. Forgets the codes either way (an error is raised once).

        No collective: the codes were agreed over the process group when they were
        computed, so every rank raises the same error at its own read.
        """
        if not self.codes:
            return
        pending, steps = self.codes, self.steps
        self.codes, self.steps = {}, {}
        for gi in sorted(pending):
            host = pending[gi].cpu().tolist()
            gp = plans[gi]
            for pos, grid in enumerate(gp.grids):
                off = gp.offsets[pos]
                bad = [b for b in range(grid.num_blocks) if host[off + b]]
                if bad:
                    first, last = steps[gi]
                    when = (f"at step {first}" if first == last
                            else f"at a step from {first} to {last}")
                    what, why = _what(host[off + bad[0]], plans[gi])
                    raise NonFiniteGradientError(
                        f"{what} in parameter {gp.names[pos]!r} {when} (block {bad[0]})"
                        f"{why}; failure."
                        "nonfinite_gradient='raise' on the accelerator path: the refused "
                        "blocks were skipped at those steps (their state and entries "
                        "unchanged) and the error is raised at this host read; "
                        "'skip_block' skips such blocks without raising."
                    )


def bound_dtype(device: torch.device) -> torch.dtype:
    """float64, or float32 on a device without float64 (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _stacks(bg: BlockGroup) -> list[torch.Tensor]:
    """The non-empty stacks eq. (3)'s ``m`` reads of ``bg``: its factors (a packed
    one's triangle holds every entry of the symmetric matrix) and corrected moment."""
    stacks = [*(f.data if isinstance(f, SymmetricStack) else f for f in bg.factors.values()),
              *([] if bg.corrected is None else [bg.corrected])]
    return [x for x in stacks if x.numel() > 0]


def _row_max_abs(stacks: list[torch.Tensor], cpu: bool) -> torch.Tensor:
    """``[B]``: the largest absolute entry of each row of ``stacks``.

    CPU path: max and min, no |x| temporary (``torch.aminmax`` and the inf-norm
    reduction are slow on CPU); accelerator path: one inf-norm reduction per stack.
    """
    out = None
    for x in stacks:
        if cpu:
            flat = x.flatten(1)
            m = torch.maximum(flat.amax(dim=1), -flat.amin(dim=1))
        else:
            m = torch.linalg.vector_norm(x, float("inf"), dim=tuple(range(1, x.dim())))
        out = m if out is None else torch.maximum(out, m)
    assert out is not None
    return out


def _held_maxima(gp: ParamGroupPlan, device: torch.device, dt: torch.dtype) -> torch.Tensor:
    """``[blocks]``: each block's row maximum of :func:`_row_max_abs` (0 where it
    has no factors or rows here).

    On the accelerator path the one-row stacks of one-block parameters take one
    ``torch._foreach_norm(inf)`` for all (a row's maximum is then its stack's), one
    ``torch._foreach_maximum`` per further stack of a row, and one copy through the
    group's kept vector (:class:`~shampoo_torch.block_grid.BlockVector`); the other
    stacks one reduction each.
    """
    cpu = on_cpu_path(device)
    kept = None if cpu else gp.vectors.get("factor max", dt, device)
    held = (torch.zeros(gp.total_blocks, dtype=dt, device=device) if kept is None
            else kept.data.zero_())
    single: dict[int, list[torch.Tensor]] = {}
    for bg, flat in zip(gp.block_groups, gp.flat_rows, strict=True):
        stacks = _stacks(bg)
        if not stacks:
            continue
        if (kept is not None and len(bg) == 1 and bg.members[0][0] in kept.single
                and all(x.device == device for x in stacks)):
            single[bg.members[0][0]] = stacks
            continue
        held.index_copy_(0, moved(flat, device), moved(_row_max_abs(stacks, cpu), device, dt))
    if single:
        assert kept is not None
        rows = list(single.values())
        norms = iter(torch._foreach_norm([x for r in rows for x in r], float("inf")))
        per_row = [[next(norms) for _ in r] for r in rows]
        largest = [r[0] for r in per_row]
        for j in range(1, max(len(r) for r in per_row)):
            more = [k for k, r in enumerate(per_row) if len(r) > j]
            for k, m in zip(more, torch._foreach_maximum([largest[k] for k in more],
                                                         [per_row[k][j] for k in more]),
                            strict=True):
                largest[k] = m
        torch._foreach_copy_([kept.single[pos] for pos in single], largest)
    return held


def block_codes(inp: StepInput, state: Mapping[torch.Tensor, Any]) -> torch.Tensor:
    """Eq. (3) per block of ``inp``'s param group, in flat order: ``[blocks]`` int32.

    :data:`OK`, :data:`TOO_LARGE` or :data:`NONFINITE` (a non-finite
    gradient entry); blocks of parameters without a gradient are OK. On the
    first parameter's device; distributed, only the blocks held here
    contribute their factors (the optimizer all-reduces the codes). Each
    maximum is one vector over the group's blocks
    (:func:`~shampoo_torch.block_grid.flat_block_maxima`), so the launches do
    not grow with its parameters on the accelerator path.
    """
    gp = inp.gp
    device = inp.params[0].device
    dt = bound_dtype(device)
    # The accelerator path writes the maxima into the group's kept vectors (one copy).
    kept = None if on_cpu_path(device) else gp.vectors
    gmax = flat_block_maxima(gp.grids, inp.g, device, dt,
                             None if kept is None else kept.get("gradient max", dt, device))
    factors = _held_maxima(gp, device, dt)  # the factors alone (no corrected moment then)
    if len(inp.g) < len(gp.grids):  # the state of a parameter without a gradient is not read
        present = torch.tensor([pos in inp.g for pos, grid in enumerate(gp.grids)
                                for _ in range(grid.num_blocks)], device=device)
        factors = torch.where(present, factors, 0.0)
    m = factors
    for key in ("graft", "diagonal"):  # V of eq. (14b), V_D of eq. (16b)
        elementwise = {pos: st[key] for pos in inp.g
                       if (st := state[inp.params[pos]]).get(key) is not None}
        if elementwise:
            m = torch.maximum(m, flat_block_maxima(
                gp.grids, elementwise, device, dt,
                None if kept is None else kept.get(f"{key} max", dt, device)))
    if gp.config.grafting.factored:  # eq. (14e): R, C, V span the parameter, so every block's m
        parts = []
        for pos, grid in enumerate(gp.grids):
            moments = adafactor_max_abs(state[inp.params[pos]]) if pos in inp.g else None
            parts.append(torch.zeros(grid.num_blocks, dtype=dt, device=device)
                         if moments is None else moved(moments, device, dt).expand(grid.num_blocks))
        m = torch.maximum(m, torch.cat(parts))
    assert gp.block_sizes is not None
    sizes = moved(gp.block_sizes, device, dt)
    bound = m + sizes * gmax * gmax  # as shampoo_spec.block_overflows
    # The codes as kept 0-d tensors: Python numbers would be new tensors, and launches.
    ok, too_large, nonfinite = (scalar(v, CODE_DTYPE, device) for v in (OK, TOO_LARGE, NONFINITE))
    codes = torch.where(bound <= STATE_LIMIT, ok, too_large)
    limit = factor_limit(gp.config.factor_storage_dtype)
    if limit is not None:  # float16 factors (eq. 11b): m_f + |B| g^2 <= 2^15 too
        codes = torch.where(factors + sizes * gmax * gmax <= limit, codes, too_large)
    # gmax - gmax is 0 for a finite maximum, NaN for an inf or NaN one (isfinite's test
    # in two ops, not four).
    return torch.where(gmax - gmax == 0, codes, nonfinite)


def refuse_blocks(
    inputs: list[StepInput | None], state: Mapping[torch.Tensor, dict[str, Any]],
    param_groups: Sequence[Mapping[str, Any]], plans: Sequence[ParamGroupPlan],
    dist: Distributor | None, shard_mode: str | None, counters: StepCounters,
    device: Callable[[], torch.device], pending: PendingRefusals,
) -> None:
    """Eq. (3), before any state changes: the blocks whose step is refused.

    Per param group :func:`block_codes` (on the device, no host
    sync). Distributed: one all-reduce (max) of every group's codes over
    the whole process group, so every rank and replica refuses the same
    blocks whichever rank saw the bad gradient or holds the block's
    factors. ``"raise"``: the codes are read on the host (once per step)
    and the error comes before anything changed; ``"skip_block"``: the
    flags stay on the device (``inp.ok``) and the refused blocks are counted.
    """
    live = [inp for inp in inputs if inp is not None]
    codes = [block_codes(inp, state) for inp in live]
    deferring = [_defers(inp) for inp in live]
    raising = [inp.gp.config.failure.nonfinite_gradient == "raise" and not d
               for inp, d in zip(live, deferring, strict=True)]
    if shard_mode == "local" and any(
            gp.config.failure.nonfinite_gradient == "raise" for gp in plans):
        # Every step, on every rank (one whose pieces are all empty too).
        _agree_local_raise([c for c, r in zip(codes, raising, strict=True) if r], device)
    if not live:
        return
    local = codes
    if dist is not None:
        flat = torch.cat(codes)  # one device per rank
        if any(raising):
            local = list(flat.clone().split([len(c) for c in codes]))
        dist.agree_max(flat)
        codes = list(flat.split([len(c) for c in codes]))
    if any(raising):
        _raise_refused(
            [(inp, code, mine) for inp, code, mine, r in zip(live, codes, local, raising,
                                                              strict=True) if r],
            state, param_groups, plans, dist, device,
        )
    for inp, code, r, d in zip(live, codes, raising, deferring, strict=True):
        if d:  # "raise" deferred: skipped now, raised at the next host read
            pending.add(inp.gi, code, None if inp.in_graph else max(inp.steps.values()))
            _admit(inp, code)
        elif not r:
            _admit(inp, code)
            counters.on(code.device)["skipped_blocks"].add_((code != OK).sum())
    if any(_reads_host(inp) for inp in live):  # a root step syncs anyway: raise now
        pending.raise_any(state, param_groups, plans)


def _admit(inp: StepInput, code: torch.Tensor) -> None:
    """``inp.ok``: the blocks whose step is taken. On the accelerator path written into
    the group's kept vector, whose per-parameter views then cost no op per step."""
    if on_cpu_path(code.device):
        inp.ok = code == OK
        return
    kept = inp.gp.vectors.get("admitted", torch.bool, code.device)
    inp.ok = torch.eq(code, OK, out=kept.data)
    inp.ok_single = kept.single


def _defers(inp: StepInput) -> bool:
    """Whether ``inp``'s eq. (3) ``"raise"`` waits for the next host read (the
    accelerator path, one process or DDP; the local shard mode decides at once)."""
    return (inp.gp.config.failure.nonfinite_gradient == "raise"
            and not on_cpu_path(inp.params[0].device) and not inp.gp.local_shards)


def _reads_host(inp: StepInput) -> bool:
    """Whether this step of ``inp``'s group is a root step for some parameter (eq. 8):
    it reads the host anyway, so a pending refusal is raised before it changes anything."""
    return _defers(inp) and any(is_root_step(t, inp.gp.config.schedule, inp.lr_ratio)
                                for t in inp.steps.values())


def _what(code: int, gp: ParamGroupPlan) -> tuple[str, str]:
    """The kind of refusal a code names, and why, in words."""
    if code == NONFINITE:
        return "non-finite gradient", ""
    why = (": finite, but max|state| + |B| max|G_B|^2 > 2^127, so the block's state "
           "could overflow float32 (eq. 3, shampoo_spec.block_overflows)")
    if gp.config.factor_storage_dtype == "float16":
        why += (", or max|factors| + |B| max|G_B|^2 > 2^15, so its float16 factors "
                "could overflow (factor_storage_dtype, eq. 11b)")
    return "too large gradient", why


def _agree_local_raise(codes: list[torch.Tensor], device: Callable[[], torch.device]) -> None:
    """``shard_mode="local"``, eq. (3) ``"raise"``: every rank raises, or none.

    Each rank decides on its own pieces; one all-reduce (max) of one flag
    over the world, every step of an optimizer with a ``"raise"`` group,
    then makes the ranks whose pieces were fine raise too (a rank raising
    alone would leave the others waiting in FSDP's next collective). With
    :mod:`shampoo_torch.failure_limit`'s, the only optimizer collectives of
    the local mode.
    """
    import torch.distributed as tdist

    mine = any(bool((c != OK).any()) for c in codes)
    flag = torch.tensor([int(mine)], dtype=torch.int32, device=device())
    tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
    if int(flag.item()) and not mine:
        raise NonFiniteGradientError(
            "a non-finite or too large gradient in another rank's pieces (shard_mode="
            "'local': each rank decides on its own pieces; that rank's error names the "
            "parameter); failure.nonfinite_gradient='raise' (no optimizer state or "
            "parameter was changed by this step on any rank)."
        )


def _raise_refused(
    raising: list[tuple[StepInput, torch.Tensor, torch.Tensor]],
    state: Mapping[torch.Tensor, dict[str, Any]], param_groups: Sequence[Mapping[str, Any]],
    plans: Sequence[ParamGroupPlan], dist: Distributor | None,
    device: Callable[[], torch.device],
) -> None:
    """Eq. (3) ``"raise"``: NonFiniteGradientError for the first refused block, if any.

    ``raising``: per param group with that policy, its agreed codes and
    this rank's own. One host read per device; distributed, every rank
    sees the same agreed codes, and one more all-reduce (on the error path
    only) names the lowest rank that saw a refused block.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, code, _ in raising:
        by_device.setdefault(code.device, []).append(code)
    if not any(bool(torch.cat(cs).any()) for cs in by_device.values()):
        return
    first: tuple[int, ...] | None = None  # (group, position, block, code), seen here
    for inp, _, mine in raising:
        host = mine.cpu().tolist()
        gp = inp.gp
        for pos in sorted(inp.g):
            off = gp.offsets[pos]
            bad = [b for b in range(gp.grids[pos].num_blocks) if host[off + b]]
            if bad:
                first = (inp.gi, pos, bad[0], host[off + bad[0]])
                break
        if first is not None:
            break
    where = ""
    if dist is not None:
        found = dist.first_flagged(first, 4, device(), whole_world=True)
        assert found is not None  # the agreed codes say some rank saw one
        rank, first = found
        where = f" on rank {rank} of {dist.full_world} (every rank raises this error)"
    assert first is not None
    gi, pos, block, kind = first
    step = state[param_groups[gi]["params"][pos]]["step"] + 1
    what, why = _what(kind, plans[gi])
    raise NonFiniteGradientError(
        f"{what} in parameter {plans[gi].names[pos]!r} at step {step} (block {block})"
        f"{where}{why}; failure.nonfinite_gradient='raise' (no optimizer state or "
        "parameter was changed by this step; 'skip_block' skips such blocks instead)."
    )
