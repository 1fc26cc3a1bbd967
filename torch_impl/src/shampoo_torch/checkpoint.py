"""Checkpoints of :class:`~shampoo_torch.Shampoo`: plain contents, strict loading.

The saved dict holds only tensors, ints, floats, strings and dicts, so it
loads with ``torch.load(..., weights_only=True)`` and travels through
``torch.distributed.checkpoint`` (``get_optimizer_state_dict`` /
``set_optimizer_state_dict``, with or without ``full_state_dict``,
``cpu_offload`` or ``flatten_optimizer_state_dict``, and ``dcp.save`` /
``dcp.load``): everything of a parameter is in its entry and everything of a
group in the group, which are all that torch keeps. Block state lives
stacked in block groups at run time (:mod:`shampoo_torch.blocks`); here it
is cut back into one entry per block of each parameter, so the checkpoint
does not depend on how blocks were batched, nor on the world size.

The optimizer hands this module a :class:`CheckpointTarget` (a
:class:`~shampoo_torch.state.CheckpointState`); the entries are built in
:mod:`shampoo_torch.checkpoint_entries`, checked by
:mod:`shampoo_torch.checkpoint_validation`; the same entries keyed by
parameter name are the distributed state dict
(:mod:`shampoo_torch.distributed_checkpoint`).

Layout (version 3)::

    {"version": 3,
     "state": {index: {"step": int, "param_shape": T (int64, the parameter's shape),
                       "graft"|"filtered"|"momentum"|"graft_momentum"|"gradient_sum": T,
                       ["adafactor_row": T, "adafactor_col": T | "adafactor_full": T],
                       "blocks": {block_index: {
                           "factors": {k: T}, "inverse_roots": {k: T},
                           "statistics_updates": T, "consecutive_failures": T,
                           ["corrected": T, "corrected_updates": T],
                           ["sketches": {k: {"u": T, "lam": T, "rho": T}}],
                           ["eigenbases": {k: T}]}},
                       ["metrics": {"root_failures": int, "skipped_blocks": int,
                                    "withheld_updates": int}]}},
     "param_groups": [{"lr": float, "config": dict, "params": [index, ...], ...}]}

``block_index`` is the block in the row-major order of
``shampoo_spec.plan_parameter`` (eq. 5), ``k`` a preconditioned (for
``"sketches"``, a sketched) dim of the block; elementwise state is in the
parameter's merged shape. The optimizer's counters (:attr:`metrics`) travel
in the entry of its first parameter. The top-level ``"version"`` is dropped
by torch's ``get_optimizer_state_dict``: a dict without it is read by its
entries (an int64 tensor ``param_shape``: version 3; a list: version 2;
none: version 1). Int keys may arrive as decimal strings (``"0"``, from DCP
or a flattened dict); they are read as the ints.

Distributed (``Shampoo(..., distributed=...)``, DDP or FSDP2 / HSDP
``shard_mode="lossless"``) :meth:`~shampoo_torch.Shampoo.state_dict` is a
collective over the trainer group: every rank gets every block (on the CPU),
so the dict is the same on every rank, DCP saves it once, and it loads at
any world size and in any of these modes, one process included, each rank
keeping its own blocks. ``root_failures`` is summed over the ranks; after
loading it is held by the group's rank 0 (the per-rank :attr:`metrics` add
up to it). Under ``shard_mode="local"`` a sharded parameter's state belongs
to each rank's piece: its entry keys each value (``step``, the elementwise
state, ``blocks``, and the counters) by the piece's coordinate i in the
shard group (``torch.chunk(full, S)[i]``, the key ``str(i)``), gathered over the shard group, and
loads only in ``"local"`` mode with the same shard group size S.

With ``frequent_directions`` (eqs. 6c, 10d) a block's ``"sketches"`` hold the
sketch of each sketched dim k (U, lambda, rho in ``factor_dtype``; its
``"factors"`` entry the last observation C_k), and with ``average_gradients``
each parameter's ``"gradient_sum"`` the gradients summed since the last
statistics step (merged shape), so a run resumed mid-period continues bit for bit.
With ``grafting.type="adafactor"`` (eq. 14e) each parameter holds its
moments in its own shape (not the merged one): R (``"adafactor_row"``, the
shape without its largest dim d0) and C (``"adafactor_col"``, without d1) when
factored, else V (``"adafactor_full"``, the parameter's shape); their shapes are
checked like every state tensor's, so a resumed run continues bit for bit.
With ``config.root_inverse_stores_basis`` (the QR root of eq. 10f or the reused eigh
basis of eq. 10h) a block's ``"eigenbases"`` hold the eigenbasis Q_k each dim's next
root starts from (``factor_dtype``).

Tensors keep the optimizer's dtypes: factors in ``factor_dtype``, inverse
roots (eigenbases) in ``config.root_dtype`` (``inverse_root_dtype`` or
``eigenvectors_dtype`` when set, eqs. 11a, 17a: a bfloat16 root is saved as
bfloat16), the corrected moment in ``config.corrected_dtype`` (eq. 17a). A
saved inverse root or corrected moment in any other dtype is refused, not
converted (converting would round a value the rule never rounded, or widen
one it did). With
``momentum.storage="int8_columnwise"`` (eq. 20b) the momentum buffers of
parameters of rank >= 2 are int8 tensors in the parameter's own shape (not
the merged one), each with ``"momentum_scale"`` / ``"graft_momentum_scale"``
(shape ``param_shape[1:]``, in ``momentum.scale_dtype``); both are saved as
they are and must load in exactly those dtypes (an int8 of -128, or a
negative or non-finite scale, is refused).

Versions 1 and 2 still load. Version 2 (``"version": 2``) held ``param_shape``
as a list and ``blocks`` as a list, and when distributed only this rank's
blocks (others ``{}``), loading at the same world size and rank only; its
counters were the top-level ``"metrics"``. Version 1, written before ``param_shape``
existed: a
:meth:`~shampoo_torch.Shampoo.state_dict` without ``"version"`` and a
distributed state dict with ``"version": 1``, the same layouts without
``param_shape`` (which they must not hold: in version 2 a missing one is an
error). Their shapes are checked from the state tensors alone: the
elementwise state has the parameter's merged shape and every factor the
shape the current parameter's block plan gives it. What version 1 cannot
detect: a parameter whose shape differs from the saved one but merges to the
same shape under the group's config (``shampoo_spec.plan_parameter``: the
same merged dims, so the same blocks and the same elementwise shape), e.g.
(4, 3), (3, 4) and (2, 6) with ``merge_dims_up_to >= 12`` (all (12,)), or
(1, 12) and (12,) (size-1 dims dropped); and an entry that holds no tensor at all
(a parameter the skip rules leave unpreconditioned, under a config without
graft, filter or momentum state: only its step), where any shape loads.

Loading is atomic: everything is validated first (group and parameter
structure, the config, which must equal this optimizer's, the differing
fields named through ``shampoo_spec.config_differences``; every parameter's
shape and every state tensor's shape and kind; step counters; the groups'
hyperparameters such as ``lr``; the metrics), then committed; on any error
a ValueError is raised and nothing (state, step counters, metrics,
param_groups) has changed. Distributed, loading is a collective over the
trainer group (the shard group in ``"local"`` mode): every rank validates
its own blocks and, when any rank finds an error, every rank raises it, so
no rank loads alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from .checkpoint_entries import (
    LIVE_KEYS,
    METRICS,
    EntrySource,
    block_entries,
    first_piece,
    has_pieces,
    int_keys,
    own_metrics,
    saved_entries,
    select_piece,
)
from .checkpoint_validation import (
    VERSION,
    check_config,
    check_group,
    check_metrics,
    check_param_shape,
    check_tree,
    check_version,
    fail,
    infer_version,
    shown,
)


class CheckpointTarget(EntrySource, Protocol):
    """What this module reads and writes of an optimizer; :class:`~shampoo_torch.Shampoo`
    hands one in (a :class:`~shampoo_torch.state.CheckpointState` of its state), so nothing
    else of its internals is reached from here."""

    def store_block_states(
        self, blocks: Sequence[Sequence[Sequence[Mapping[str, Any]]]]
    ) -> None:
        """Write back the packed matrices of :meth:`block_states`' block states (after a
        copy into them; an empty entry is another rank's block)."""

    def parameter_names(self) -> list[list[str]]:
        """The parameters' names per param group (the keys of a distributed checkpoint)."""

    def restore_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Set :attr:`metrics` to saved counts (``root_failures``: rank 0's alone)."""


#: What :func:`validate` returns: (parameter, live tree, saved tree) per parameter, the
#: saved groups, the counters, and the block states the trees copy into.
Checked = tuple[list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]], list[dict[str, Any]],
                dict[str, Any], list[list[list[dict[str, Any]]]]]


def state_dict(opt: CheckpointTarget) -> dict[str, Any]:
    """Version 3, keyed by parameter index (a collective when distributed)."""
    state: dict[int, Any] = {}
    groups = []
    for group, entries in zip(opt.param_groups, saved_entries(opt), strict=True):
        ids = list(range(len(state), len(state) + len(entries)))
        state.update(zip(ids, entries, strict=True))
        groups.append(saved_group(group, ids))
    return {"version": VERSION, "state": state, "param_groups": groups}


def saved_group(group: Mapping[str, Any], params: list[Any], names: bool = True
                ) -> dict[str, Any]:
    """A param group as saved: its hyperparameters (and ``param_names`` where torch keeps
    them, unless ``names`` is False: its flattened load reads every key of the live group),
    ``config.to_dict()`` and ``params``."""
    dropped = ("params", "config") if names else ("params", "config", "param_names")
    saved = {k: v for k, v in group.items() if k not in dropped}
    saved["config"] = group["config"].to_dict()
    saved["params"] = params
    return saved


def load_state_dict(opt: CheckpointTarget, sd: dict[str, Any]) -> None:
    """Validate everything, then commit (see the module doc); ValueError changes nothing."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        fail("top level", "expected a dict with 'state' and 'param_groups'")
    if "format" in sd:
        fail("top level", f"a dict with format {shown(sd['format'])}: use "
              "load_distributed_state_dict for distributed_state_dict()")
    version = check_version(sd, absent=None)
    if version is None:
        version = infer_version(sd["state"])
    if version < 3:
        commit(opt, *_validate_per_rank(opt, sd, version))
    else:
        load_agreed(opt, lambda: validate(opt, sd, version, by_name=False))


def load_agreed(opt: CheckpointTarget, check: Any) -> None:
    """Run ``check`` (:func:`validate`) on every rank of the group the state is spread
    over; commit only when no rank found an error, else every rank raises."""
    try:
        checked, error = check(), None
    except ValueError as err:
        checked, error = None, err
    spread = opt.gather if opt.gathers else opt.gather_pieces if has_pieces(opt) else None
    messages = [None] if spread is None else spread(None if error is None else str(error))
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        rank, message = failed[0]
        raise ValueError(f"{message} (found by rank {rank} of the group; no rank loaded "
                         "anything)")
    commit(opt, *checked)


def validate(opt: CheckpointTarget, sd: dict[str, Any], version: int, by_name: bool
             ) -> Checked:
    """Every check of a whole-state dict (version 3, or a distributed state dict of any
    version) on this rank's part; what to commit."""
    groups = check_groups(sd, opt)
    names = opt.parameter_names()
    blocks = block_entries(opt)
    held = {(gi, pos, b) for gi, per_param in enumerate(blocks)
            for pos, pblocks in enumerate(per_param) for b, e in enumerate(pblocks) if e}
    pairs = []
    first = None
    for gi, (group, saved_group_) in enumerate(zip(opt.param_groups, groups, strict=True)):
        keys = saved_group_.get("params")
        if by_name and keys != names[gi]:
            fail(f"param_groups[{gi}].params", f"saved names {shown(keys)} do not match "
                  f"{names[gi]}")
        if not isinstance(keys, list) or len(keys) != len(group["params"]):
            fail(f"param_groups[{gi}]", f"{len(keys) if isinstance(keys, list) else shown(keys)}"
                  f" saved parameters, this group has {len(group['params'])}")
        check_config(f"param_groups[{gi}].config", group["config"], saved_group_.get("config"))
        check_group(f"param_groups[{gi}]", saved_group_)
        for pos, (p, key) in enumerate(zip(group["params"], keys, strict=True)):
            where = (f"state[{key!r}]" if by_name
                     else f"param_groups[{gi}] parameter {pos} (state[{key!r}])")
            saved = sd["state"].get(key) if isinstance(key, (int, str)) else None
            if not isinstance(saved, dict):
                fail(where, "missing")
            part = select_piece(int_keys(saved), opt.piece(gi, pos))
            if isinstance(part, str):
                fail(where, part)
            if first is None:
                first = part.get(METRICS)
            count = len(blocks[gi][pos])
            ours = {k: v for k, v in opt.state[p].items() if k not in LIVE_KEYS}
            ours["blocks"] = {b: blocks[gi][pos][b] for b in range(count) if (gi, pos, b) in held}
            part = check_param_shape(where, p, part, version, ours)
            saved_blocks = part.get("blocks", {})  # torch's flattening drops an empty dict
            if not isinstance(saved_blocks, dict) or set(saved_blocks) != set(range(count)):
                found = list(saved_blocks) if isinstance(saved_blocks, dict) else saved_blocks
                fail(f"{where}['blocks']", f"block indices {shown(found)} do not match the "
                      f"plan's {list(range(count))}")
            subset = {k: v for k, v in part.items() if k != METRICS}
            subset["blocks"] = {b: saved_blocks[b] for b in ours["blocks"]}
            check_tree(where, ours, subset)
            pairs.append((p, ours, subset))
    if version < 3:
        return pairs, groups, check_metrics(sd.get("metrics")), blocks
    if pairs and first is None:
        fail("metrics", "missing: version 3 keeps the counters in the first parameter's "
              f"entry ({METRICS!r})")
    metrics = check_metrics(own_metrics(first, first_piece(opt)), complete=bool(pairs))
    return pairs, groups, metrics, blocks


def _validate_per_rank(opt: CheckpointTarget, sd: dict[str, Any], version: int) -> Checked:
    """Versions 1 and 2 of :meth:`~shampoo_torch.Shampoo.state_dict`: each parameter's
    blocks a list, this rank's only (others ``{}``); the same world size and rank."""
    groups = check_groups(sd, opt)
    blocks = block_entries(opt)
    pairs = []  # (our live state tree, saved tree), validated before any copy
    for gi, (group, saved_group_, per_param) in enumerate(
        zip(opt.param_groups, groups, blocks, strict=True)
    ):
        ids = saved_group_.get("params", [])
        if not isinstance(ids, list) or len(ids) != len(group["params"]):
            fail(f"param_groups[{gi}]", f"{len(ids) if isinstance(ids, list) else ids!r} "
                  f"saved parameters, this group has {len(group['params'])}")
        check_config(f"param_groups[{gi}].config", group["config"], saved_group_.get("config"))
        check_group(f"param_groups[{gi}]", saved_group_)
        for j, (p, pid, pblocks) in enumerate(zip(group["params"], ids, per_param, strict=True)):
            where = f"param_groups[{gi}] parameter {j} (state[{pid!r}])"
            saved = sd["state"].get(pid) if isinstance(pid, (int, str)) else None
            if not isinstance(saved, dict):
                fail(where, "missing")
            ours = {k: v for k, v in opt.state[p].items() if k not in LIVE_KEYS}
            ours["blocks"] = pblocks
            saved = check_param_shape(where, p, saved, version, ours)
            check_tree(where, ours, saved)
            pairs.append((p, ours, saved))
    return pairs, groups, check_metrics(sd.get("metrics")), blocks


def check_groups(sd: dict[str, Any], opt: CheckpointTarget) -> list[dict[str, Any]]:
    groups = sd["param_groups"]
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        fail("param_groups", "expected a list of dicts")
    if len(groups) != len(opt.param_groups):
        fail("param_groups", f"{len(groups)} saved groups, this optimizer has "
              f"{len(opt.param_groups)}")
    if not isinstance(sd["state"], dict):
        fail("state", f"expected a dict, got {type(sd['state']).__name__}")
    return groups


def commit(
    opt: CheckpointTarget,
    pairs: list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]],
    groups: list[dict[str, Any]],
    metrics: dict[str, Any],
    blocks: list[list[list[dict[str, Any]]]],
) -> None:
    """Copy validated state, group hyperparameters and counters into ``opt``.

    ``blocks`` (:func:`block_entries`) holds the block states ``pairs`` copy
    into: views, but packed matrices (new tensors), stored back afterwards.

    Called only after every check passed (nothing here can fail on a
    validated checkpoint), so a bad checkpoint changes nothing.
    ``root_failures`` is a sum over ranks (each counts its own blocks): only
    rank 0 of a distributed optimizer takes the saved total.
    """
    for p, ours, saved in pairs:
        _copy_tree(ours, saved)
        opt.state[p]["step"] = int(saved["step"])
    opt.store_block_states(blocks)
    for group, saved_group_ in zip(opt.param_groups, groups, strict=True):
        for key, value in saved_group_.items():
            if key not in ("params", "config", "param_names"):
                group[key] = value
    opt.restore_metrics(metrics)


def _copy_tree(ours: Any, saved: Any) -> None:
    if isinstance(ours, torch.Tensor):
        ours.copy_(saved)  # moves to our device, keeps our dtype
    elif isinstance(ours, dict):
        for k in ours:
            _copy_tree(ours[k], saved[k])
    elif isinstance(ours, list):
        for a, b in zip(ours, saved, strict=True):
            _copy_tree(a, b)
