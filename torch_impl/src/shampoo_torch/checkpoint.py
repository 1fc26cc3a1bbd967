"""Checkpoints of :class:`~shampoo_torch.Shampoo`: plain contents, strict loading.

The saved dict holds only tensors, ints, floats, strings, dicts and lists, so
it loads with ``torch.load(..., weights_only=True)``; each group's config is
stored as ``config.to_dict()`` (JSON form). Block state lives stacked in
block groups at run time (see :mod:`shampoo_torch.blocks`); here it is cut
back into one entry per block of each parameter, so the checkpoint does not
depend on how blocks were batched.

The optimizer hands this module a :class:`CheckpointTarget`: its param groups
and per-parameter state, the live state of every block as views into the
block groups, the parameter names, an all-gather over the trainer group, and
the counters; nothing else of its internals is read here. The validation is
in :mod:`shampoo_torch.checkpoint_validation`, the portable distributed
format in :mod:`shampoo_torch.distributed_checkpoint`.

Layout (version 2)::

    {"version": 2,
     "state": {index: {"step": int, "param_shape": [int, ...],
                       "graft"|"filtered"|"momentum"|"graft_momentum"|"gradient_sum": T,
                       ["adafactor_row": T, "adafactor_col": T | "adafactor_full": T],
                       "blocks": [{"factors": {k: T}, "inverse_roots": {k: T},
                                   "statistics_updates": T, "consecutive_failures": T,
                                   ["corrected": T, "corrected_updates": T],
                                   ["sketches": {k: {"u": T, "lam": T, "rho": T}}],
                                   ["eigenbases": {k: T}]},
                                  ...]}},
     "param_groups": [{"lr": float, "config": dict, "params": [index, ...], ...}],
     "metrics": {"root_failures": int, "skipped_blocks": int, "withheld_updates": int}}

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

With ``Shampoo(..., distributed=...)`` :meth:`~shampoo_torch.Shampoo.state_dict`
is this rank's state (blocks owned elsewhere are ``{}``) and loads at the same
world size and rank only. The portable form is the *distributed state dict*
(:func:`~shampoo_torch.distributed_checkpoint.distributed_state_dict`, on every
rank, one or many), gathered so that it holds every block, keyed by parameter
name and block index::

    {"format": "shampoo_torch.distributed_state_dict", "version": 2,
     "state": {name: {"step": int, "param_shape": [int, ...],
                      "graft"|"filtered"|"momentum"|"graft_momentum"|"gradient_sum": T,
                      ["adafactor_row": T, "adafactor_col": T | "adafactor_full": T],
                      "blocks": {block_index: {"factors": {k: T}, "inverse_roots": {k: T},
                                               "statistics_updates": T,
                                               "consecutive_failures": T,
                                               ["corrected": T, "corrected_updates": T],
                                               ["sketches": {k: {...}}],
                                               ["eigenbases": {k: T}]}}}},
     "param_groups": [{"lr": float, "config": dict, "params": [name, ...], ...}],
     "metrics": {"root_failures": int, "skipped_blocks": int, "withheld_updates": int}}

``name`` is the parameter's name (from ``(name, tensor)`` pairs or the
group's ``param_names``; else ``"param_groups[g]['params'][i] (shape ...)"``),
``block_index`` its block in the row-major order of
``shampoo_spec.plan_parameter`` (eq. 5), ``k`` a preconditioned (for
``"sketches"``, a sketched) dim of the block; tensors are on the CPU,
elementwise state in the parameter's merged shape. Nothing depends on the
world size, so a dict saved from W ranks loads at W' ranks, W' = 1 (plain
``Shampoo``) included, and the run continues bit for bit; every rank loads
the same dict and keeps its own blocks.
The same dict serves every mode: a plain ``Shampoo``, one under
DistributedDataParallel and FSDP2 / HSDP ``shard_mode="lossless"`` save and
load it alike (the state of whole parameters). ``block_index`` and ``k`` may
also be decimal strings (``"0"``): ``torch.distributed.checkpoint`` writes
them so, and ``format_utils.dcp_to_torch_save`` turns a DCP checkpoint into a
``torch.save`` file holding them; loading reads them as the ints.
``root_failures`` is summed over the ranks of a trainer group; after loading
it is held by the group's rank 0 (the per-rank :attr:`metrics` add up to it).
``param_shape`` is the parameter's own shape (version 2): a state saved
for a (4, 3) parameter never loads into a (3, 4) one, even where both merge
to the same blocks. Every state tensor must be finite (NaN or inf in a
factor, a root or the elementwise state is refused).

Version 1, written before ``param_shape`` existed, still loads: a
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
param_groups) has changed. Distributed,
:func:`~shampoo_torch.distributed_checkpoint.load_distributed_state_dict`
is a collective over the trainer group: every rank validates its own
blocks and, when any rank finds an error, every rank raises it, so no rank
loads alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from .checkpoint_validation import (
    VERSION,
    check_config,
    check_group,
    check_metrics,
    check_param_shape,
    check_tree,
    check_version,
    fail,
    shown,
)


class CheckpointTarget(Protocol):
    """What this module reads and writes of an optimizer; :class:`~shampoo_torch.Shampoo`
    hands one in (a :class:`~shampoo_torch.state.CheckpointState` of its state), so nothing
    else of its internals is reached from here."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's param groups (hyperparameters and ``config`` of each)."""

    @property
    def state(self) -> Mapping[torch.Tensor, dict[str, Any]]:
        """The optimizer's per-parameter state (``step`` and the elementwise state)."""

    @property
    def metrics(self) -> dict[str, int]:
        """:attr:`shampoo_torch.Shampoo.metrics` (this reads the device)."""

    def block_states(self) -> list[list[list[dict[str, Any] | None]]]:
        """Per param group, per parameter, per block: its state as live views (packed
        matrices as copies, written back by :meth:`store_block_states`), None if another
        rank holds it."""

    def store_block_states(
        self, blocks: Sequence[Sequence[Sequence[Mapping[str, Any]]]]
    ) -> None:
        """Write back the packed matrices of :meth:`block_states`' block states (after a
        copy into them; an empty entry is another rank's block)."""

    def parameter_names(self) -> list[list[str]]:
        """The parameters' names per param group (the keys of a distributed checkpoint)."""

    def gather(self, obj: object) -> list[object]:
        """``obj`` of every rank of the trainer group (``[obj]`` in one process)."""

    def restore_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Set :attr:`metrics` to saved counts (``root_failures``: rank 0's alone)."""


def state_dict(opt: CheckpointTarget) -> dict[str, Any]:
    blocks = block_entries(opt)
    state: dict[int, Any] = {}
    groups = []
    index = 0
    for group, per_param in zip(opt.param_groups, blocks, strict=True):
        ids = []
        for p, pblocks in zip(group["params"], per_param, strict=True):
            entry = {k: _clone(v) for k, v in opt.state[p].items()}
            entry["param_shape"] = list(p.shape)
            entry["blocks"] = _clone(pblocks)
            state[index] = entry
            ids.append(index)
            index += 1
        saved = {k: v for k, v in group.items() if k not in ("params", "config")}
        saved["config"] = group["config"].to_dict()
        saved["params"] = ids
        groups.append(saved)
    return {"version": VERSION, "state": state, "param_groups": groups,
            "metrics": opt.metrics}


def load_state_dict(opt: CheckpointTarget, sd: dict[str, Any]) -> None:
    """Validate everything, then commit (see the module doc); ValueError changes nothing."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        fail("top level", "expected a dict with 'state' and 'param_groups'")
    if "format" in sd:
        fail("top level", f"a dict with format {shown(sd['format'])}: use "
              "load_distributed_state_dict for distributed_state_dict()")
    version = check_version(sd, absent=1)  # version 1 had no "version"
    groups = check_groups(sd, opt)
    blocks = block_entries(opt)
    pairs = []  # (our live state tree, saved tree), validated before any copy
    for gi, (group, saved_group, per_param) in enumerate(
        zip(opt.param_groups, groups, blocks, strict=True)
    ):
        ids = saved_group.get("params", [])
        if not isinstance(ids, list) or len(ids) != len(group["params"]):
            fail(f"param_groups[{gi}]", f"{len(ids) if isinstance(ids, list) else ids!r} "
                  f"saved parameters, this group has {len(group['params'])}")
        check_config(f"param_groups[{gi}].config", group["config"], saved_group.get("config"))
        check_group(f"param_groups[{gi}]", saved_group)
        for j, (p, pid, pblocks) in enumerate(zip(group["params"], ids, per_param, strict=True)):
            where = f"param_groups[{gi}] parameter {j} (state[{pid!r}])"
            saved = sd["state"].get(pid) if isinstance(pid, (int, str)) else None
            if not isinstance(saved, dict):
                fail(where, "missing")
            ours = dict(opt.state[p])
            ours["blocks"] = pblocks
            saved = check_param_shape(where, p, saved, version, ours)
            check_tree(where, ours, saved)
            pairs.append((p, ours, saved))
    metrics = check_metrics(sd.get("metrics"))
    commit(opt, pairs, groups, metrics, blocks)


def block_entries(opt: CheckpointTarget) -> list[list[list[dict[str, Any]]]]:
    """Per group, per parameter, per block: live tensor views ({} for another rank's block)."""
    return [[[{} if entry is None else entry for entry in per_param] for per_param in group]
            for group in opt.block_states()]


def _clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree


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
    for group, saved_group in zip(opt.param_groups, groups, strict=True):
        for key, value in saved_group.items():
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
