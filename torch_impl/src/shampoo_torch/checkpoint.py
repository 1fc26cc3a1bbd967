"""Checkpoints of :class:`~shampoo_torch.Shampoo`: plain contents, strict loading.

The saved dict holds only tensors, ints, floats, strings, dicts and lists, so
it loads with ``torch.load(..., weights_only=True)``; each group's config is
stored as ``config.to_dict()`` (JSON form). Block state lives stacked in
block groups at run time (see :mod:`shampoo_torch.blocks`); here it is cut
back into one entry per block of each parameter, so the checkpoint does not
depend on how blocks were batched.

The optimizer gives this module a small internal API (its ``_checkpoint_*``
and ``_restore_metrics`` methods): the live state of every block as views
into the block groups, the parameter names, an all-gather over the trainer
group, and the counters; nothing else of its internals is read here.

Layout::

    {"state": {index: {"step": int, "graft"|"filtered"|"momentum"|"graft_momentum": T,
                       "blocks": [{"factors": {k: T}, "inverse_roots": {k: T},
                                   "statistics_updates": T, "consecutive_failures": T,
                                   ["corrected": T, "corrected_updates": T]}, ...]}},
     "param_groups": [{"lr": float, "config": dict, "params": [index, ...], ...}],
     "metrics": {"root_failures": int, "skipped_blocks": int}}

With ``Shampoo(..., distributed=...)`` :meth:`~shampoo_torch.Shampoo.state_dict`
is this rank's state (blocks owned elsewhere are ``{}``) and loads at the same
world size and rank only. The portable form is the *distributed state dict*
(:func:`distributed_state_dict`, on every rank, one or many), gathered so that
it holds every block, keyed by parameter name and block index::

    {"format": "shampoo_torch.distributed_state_dict", "version": 1,
     "state": {name: {"step": int, "graft"|"filtered"|"momentum"|"graft_momentum": T,
                      "blocks": {block_index: {"factors": {k: T}, "inverse_roots": {k: T},
                                               "statistics_updates": T,
                                               "consecutive_failures": T,
                                               ["corrected": T, "corrected_updates": T]}}}},
     "param_groups": [{"lr": float, "config": dict, "params": [name, ...], ...}],
     "metrics": {"root_failures": int, "skipped_blocks": int}}

``name`` is the parameter's name (from ``(name, tensor)`` pairs or the
group's ``param_names``; else ``"param_groups[g]['params'][i] (shape ...)"``),
``block_index`` its block in the row-major order of
``shampoo_spec.plan_parameter`` (eq. 5), ``k`` a preconditioned dim of the
block; tensors are on the CPU, elementwise state in the parameter's merged
shape. Nothing depends on the world size, so a dict saved from W ranks loads
at W' ranks, W' = 1 (plain ``Shampoo``) included, and the run continues bit
for bit; every rank loads the same dict and keeps its own blocks.
``root_failures`` is summed over the ranks of a trainer group; after loading
it is held by the group's rank 0 (the per-rank :attr:`metrics` add up to it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from .optimizer import Shampoo


def _block_entries(opt: Shampoo) -> list[list[list[dict[str, Any]]]]:
    """Per group, per parameter, per block: live tensor views ({} for another rank's block)."""
    return [[[{} if entry is None else entry for entry in per_param] for per_param in group]
            for group in opt._checkpoint_blocks()]


def _clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree


def state_dict(opt: Shampoo) -> dict[str, Any]:
    blocks = _block_entries(opt)
    state: dict[int, Any] = {}
    groups = []
    index = 0
    for group, per_param in zip(opt.param_groups, blocks, strict=True):
        ids = []
        for p, pblocks in zip(group["params"], per_param, strict=True):
            entry = {k: _clone(v) for k, v in opt.state[p].items()}
            entry["blocks"] = _clone(pblocks)
            state[index] = entry
            ids.append(index)
            index += 1
        saved = {k: v for k, v in group.items() if k not in ("params", "config")}
        saved["config"] = group["config"].to_dict()
        saved["params"] = ids
        groups.append(saved)
    return {"state": state, "param_groups": groups, "metrics": opt.metrics}


def _fail(where: str, message: str) -> None:
    raise ValueError(f"cannot load Shampoo state: {where}: {message}")


def _check_tree(where: str, ours: Any, saved: Any) -> None:
    """Same keys, same tensor shapes; ints for ints."""
    if isinstance(ours, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            _fail(where, f"expected a tensor, got {type(saved).__name__}")
        if tuple(saved.shape) != tuple(ours.shape):
            _fail(where, f"shape {tuple(saved.shape)} does not match {tuple(ours.shape)}")
        if saved.dtype.is_floating_point != ours.dtype.is_floating_point:
            _fail(where, f"dtype {saved.dtype} does not match {ours.dtype}")
        return
    if isinstance(ours, dict):
        if not isinstance(saved, dict) or set(saved) != set(ours):
            got = sorted(map(str, saved)) if isinstance(saved, dict) else type(saved).__name__
            _fail(where, f"keys {got} do not match {sorted(map(str, ours))}")
        for k in ours:
            _check_tree(f"{where}[{k!r}]", ours[k], saved[k])
        return
    if isinstance(ours, list):
        if not isinstance(saved, list) or len(saved) != len(ours):
            _fail(where, f"expected a list of {len(ours)} entries")
        for j, (a, b) in enumerate(zip(ours, saved, strict=True)):
            _check_tree(f"{where}[{j}]", a, b)
        return
    if isinstance(ours, int) and (not isinstance(saved, int) or saved < 0):
        _fail(where, f"expected a step count >= 0, got {saved!r}")


def _copy_tree(ours: Any, saved: Any) -> None:
    if isinstance(ours, torch.Tensor):
        ours.copy_(saved)  # moves to our device, keeps our dtype
    elif isinstance(ours, dict):
        for k in ours:
            _copy_tree(ours[k], saved[k])
    elif isinstance(ours, list):
        for a, b in zip(ours, saved, strict=True):
            _copy_tree(a, b)


def _config_difference(ours: dict[str, Any], saved: object) -> str:
    if not isinstance(saved, dict):
        return f"saved config is {type(saved).__name__}, expected a dict"
    keys = sorted(k for k in set(ours) | set(saved) if ours.get(k) != saved.get(k))
    return "fields differ: " + ", ".join(
        f"{k} (saved {saved.get(k)!r}, ours {ours.get(k)!r})" for k in keys
    )


def _apply(
    opt: Shampoo,
    pairs: list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]],
    groups: list[dict[str, Any]],
    metrics: dict[str, Any],
) -> None:
    """Copy validated state, group hyperparameters and counters into ``opt``.

    Called only after every check passed, so a bad checkpoint changes nothing.
    ``root_failures`` is a sum over ranks (each counts its own blocks): only
    rank 0 of a distributed optimizer takes the saved total.
    """
    for p, ours, saved in pairs:
        _copy_tree(ours, saved)
        opt.state[p]["step"] = int(saved["step"])
    for group, saved_group in zip(opt.param_groups, groups, strict=True):
        for key, value in saved_group.items():
            if key not in ("params", "config", "param_names"):
                group[key] = value
    opt._restore_metrics(metrics)


def load_state_dict(opt: Shampoo, sd: dict[str, Any]) -> None:
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        _fail("top level", "expected a dict with 'state' and 'param_groups'")
    groups = sd["param_groups"]
    if len(groups) != len(opt.param_groups):
        _fail("param_groups", f"{len(groups)} saved groups, this optimizer has "
              f"{len(opt.param_groups)}")
    blocks = _block_entries(opt)
    pairs = []  # (our live state tree, saved tree), validated before any copy
    for gi, (group, saved_group, per_param) in enumerate(
        zip(opt.param_groups, groups, blocks, strict=True)
    ):
        ids = saved_group.get("params", [])
        if len(ids) != len(group["params"]):
            _fail(f"param_groups[{gi}]", f"{len(ids)} saved parameters, this group has "
                  f"{len(group['params'])}")
        ours_cfg = group["config"].to_dict()
        if saved_group.get("config") != ours_cfg:
            _fail(f"param_groups[{gi}].config",
                  "the saved config differs from this optimizer's: "
                  + _config_difference(ours_cfg, saved_group.get("config")))
        for j, (p, pid, pblocks) in enumerate(zip(group["params"], ids, per_param, strict=True)):
            if pid not in sd["state"]:
                _fail(f"state[{pid}]", "missing")
            ours = dict(opt.state[p])
            ours["blocks"] = pblocks
            _check_tree(f"param_groups[{gi}] parameter {j} (state[{pid}])", ours, sd["state"][pid])
            pairs.append((p, ours, sd["state"][pid]))
    _apply(opt, pairs, groups, sd.get("metrics", {}))


FORMAT = "shampoo_torch.distributed_state_dict"
VERSION = 1


def _cpu(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _cpu(v) for k, v in tree.items()}
    return tree


def _held_blocks(opt: Shampoo) -> dict[tuple[int, int, int], dict[str, Any]]:
    """Live state of the blocks held here, keyed (group, position, block)."""
    out = {}
    for gi, per_param in enumerate(_block_entries(opt)):
        for pos, pblocks in enumerate(per_param):
            for b, entry in enumerate(pblocks):
                if entry:  # an empty dict: a block owned by another rank
                    out[(gi, pos, b)] = entry
    return out


def _block_counts(opt: Shampoo) -> list[list[int]]:
    """Per group, per parameter: its number of blocks (0 when not preconditioned)."""
    return [[len(per_param) for per_param in group] for group in opt._checkpoint_blocks()]


def _names(opt: Shampoo) -> list[list[str]]:
    names = opt._checkpoint_names()
    seen: set[str] = set()
    for group_names in names:
        for n in group_names:
            if n in seen:
                raise ValueError(f"parameter name {n!r} is not unique: the distributed state "
                                 "dict is keyed by name, allowed unique names.")
            seen.add(n)
    return names


def distributed_state_dict(opt: Shampoo) -> dict[str, Any]:
    """Every block's state gathered on every rank, keyed by name and block (see the module doc).

    A collective when distributed: every rank of the trainer group must call it.
    """
    names = _names(opt)
    local = {key: _cpu(entry) for key, entry in _held_blocks(opt).items()}
    root_failures = opt.metrics["root_failures"]
    merged: dict[tuple[int, int, int], dict[str, Any]] = {}
    total = 0
    for part in opt._checkpoint_gather((local, root_failures)):
        blocks, failures = cast(tuple[dict[tuple[int, int, int], dict[str, Any]], int], part)
        merged.update(blocks)
        total += failures
    local, root_failures = merged, total
    state: dict[str, Any] = {}
    groups = []
    counts = _block_counts(opt)
    for gi, group in enumerate(opt.param_groups):
        for pos, p in enumerate(group["params"]):
            entry = {k: _cpu(v) for k, v in opt.state[p].items()}
            entry["blocks"] = {b: local[(gi, pos, b)] for b in range(counts[gi][pos])}
            state[names[gi][pos]] = entry
        saved = {k: v for k, v in group.items() if k not in ("params", "config", "param_names")}
        saved["config"] = group["config"].to_dict()
        saved["params"] = list(names[gi])
        groups.append(saved)
    metrics = {"root_failures": root_failures, "skipped_blocks": opt.metrics["skipped_blocks"]}
    return {"format": FORMAT, "version": VERSION, "state": state, "param_groups": groups,
            "metrics": metrics}


def load_distributed_state_dict(opt: Shampoo, sd: dict[str, Any]) -> None:
    """Restore a :func:`distributed_state_dict` at any world size; this rank keeps its blocks.

    Validates everything (names, configs, every block present, shapes)
    before changing anything; raises ValueError naming what differs.
    """
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        _fail("top level", f"expected a dict with format {FORMAT!r} (from "
              "distributed_state_dict()); use load_state_dict for state_dict()")
    if sd.get("version") != VERSION:
        _fail("version", f"{sd.get('version')!r} is not supported: allowed {VERSION}")
    groups = sd["param_groups"]
    if len(groups) != len(opt.param_groups):
        _fail("param_groups", f"{len(groups)} saved groups, this optimizer has "
              f"{len(opt.param_groups)}")
    names = _names(opt)
    held = _held_blocks(opt)
    counts = _block_counts(opt)
    pairs = []
    for gi, (group, saved_group) in enumerate(zip(opt.param_groups, groups, strict=True)):
        if saved_group.get("params") != names[gi]:
            _fail(f"param_groups[{gi}].params", f"saved names {saved_group.get('params')} do "
                  f"not match {names[gi]}")
        ours_cfg = group["config"].to_dict()
        if saved_group.get("config") != ours_cfg:
            _fail(f"param_groups[{gi}].config",
                  "the saved config differs from this optimizer's: "
                  + _config_difference(ours_cfg, saved_group.get("config")))
        for pos, p in enumerate(group["params"]):
            name = names[gi][pos]
            saved = sd["state"].get(name)
            if not isinstance(saved, dict) or not isinstance(saved.get("blocks"), dict):
                _fail(f"state[{name!r}]", "missing (or without 'blocks')")
            count = counts[gi][pos]
            if sorted(saved["blocks"]) != list(range(count)):
                _fail(f"state[{name!r}]['blocks']", f"block indices {sorted(saved['blocks'])} "
                      f"do not match the plan's {list(range(count))}")
            mine = {b: held[(gi, pos, b)] for b in range(count) if (gi, pos, b) in held}
            ours = dict(opt.state[p])
            ours["blocks"] = mine
            subset = dict(saved)
            subset["blocks"] = {b: saved["blocks"][b] for b in mine}
            _check_tree(f"state[{name!r}]", ours, subset)
            pairs.append((p, ours, subset))
    _apply(opt, pairs, groups, sd.get("metrics", {}))
