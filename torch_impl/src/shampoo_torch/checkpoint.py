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
(:func:`distributed_state_dict`, on every rank, one or many), gathered so that
it holds every block, keyed by parameter name and block index::

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
param_groups) has changed. Distributed, :func:`load_distributed_state_dict`
is a collective over the trainer group: every rank validates its own
blocks and, when any rank finds an error, every rank raises it, so no rank
loads alone.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, NoReturn, cast

import torch

from shampoo_spec import ShampooConfig, config_differences

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


def _fail(where: str, message: str) -> NoReturn:
    raise ValueError(f"cannot load Shampoo state: {where}: {message}")


def _stored(factors: Any) -> bool:
    """Whether a block's factors are held in a storage dtype (eq. 11b: bfloat16, float16)."""
    return isinstance(factors, dict) and any(
        isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16)
        for t in factors.values())


def _check_tree(where: str, ours: Any, saved: Any, exact_dtype: bool = False) -> None:
    """Same keys, same tensor shapes; ints for ints; inverse roots in our dtype exactly.

    The inverse roots' and corrected moment's dtypes are rules (eqs. 11a,
    17a: the stored values are rounded to them), so one saved in any other dtype is
    refused rather than re-rounded or widened on copy; other floating state
    may be any floating dtype (the config, checked first, fixes the factor dtype).
    """
    if isinstance(ours, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            _fail(where, f"expected a tensor, got {type(saved).__name__}")
        if tuple(saved.shape) != tuple(ours.shape):
            _fail(where, f"shape {tuple(saved.shape)} does not match {tuple(ours.shape)}")
        if ours.dtype.is_floating_point:
            if not saved.dtype.is_floating_point or (exact_dtype and saved.dtype != ours.dtype):
                _fail(where, f"dtype {saved.dtype} does not match {ours.dtype}"
                      + (" (a storage rule: config.root_dtype, eq. 11a, "
                         "config.corrected_dtype, eq. 17a, config.factor_storage_dtype, "
                         "eq. 11b, or the momentum scales', eq. 20b)"
                         if exact_dtype else ""))
            if saved.numel() and not bool(torch.isfinite(saved.to(ours.dtype)).all()):
                _fail(where, f"non-finite entries (NaN or inf, in {ours.dtype}): allowed "
                      "finite state only")
            if where.endswith("_scale']") and saved.numel() and bool((saved < 0).any()):
                _fail(where, "a negative momentum scale: allowed scales >= 0 (eq. 20b)")
            return
        if ours.dtype == torch.int8:  # an int8 momentum buffer (eq. 20b), never a counter
            if saved.dtype != torch.int8:
                _fail(where, f"dtype {saved.dtype} does not match {ours.dtype} (int8 momentum "
                      "storage, eq. 20b)")
            if saved.numel() and bool((saved == -128).any()):
                _fail(where, "an int8 momentum entry is -128: allowed -127 to 127 (eq. 20b)")
            return
        if saved.dtype.is_floating_point or saved.dtype.is_complex or saved.dtype == torch.bool:
            _fail(where, f"dtype {saved.dtype} does not match {ours.dtype}")
        if saved.numel() and bool((saved < 0).any()):
            _fail(where, "a counter is negative")
        return
    if isinstance(ours, dict):
        if not isinstance(saved, dict) or set(saved) != set(ours):
            got = sorted(map(str, saved)) if isinstance(saved, dict) else type(saved).__name__
            _fail(where, f"keys {got} do not match {sorted(map(str, ours))}")
        for k in ours:
            # The roots' dtype (eq. 11a), the momentum scales' (eq. 20b) and the
            # factors' storage dtype (eq. 11b) are rules.
            _check_tree(f"{where}[{k!r}]", ours[k], saved[k],
                        exact_dtype or k in ("inverse_roots", "corrected")
                        or str(k).endswith("_scale") or (k == "factors" and _stored(ours[k])))
        return
    if isinstance(ours, list):
        if not isinstance(saved, list) or len(saved) != len(ours):
            _fail(where, f"expected a list of {len(ours)} entries")
        for j, (a, b) in enumerate(zip(ours, saved, strict=True)):
            _check_tree(f"{where}[{j}]", a, b, exact_dtype)
        return
    if isinstance(ours, int) and not _is_count(saved):
        _fail(where, f"expected a step count in [0, {_MAX_COUNT}], got {_shown(saved)}")


_MAX_COUNT = 2**63 - 1  # int64, as the device counters
COUNTERS = ("root_failures", "skipped_blocks", "withheld_updates")  # Shampoo.metrics


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_COUNT


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + "..."


def _copy_tree(ours: Any, saved: Any) -> None:
    if isinstance(ours, torch.Tensor):
        ours.copy_(saved)  # moves to our device, keeps our dtype
    elif isinstance(ours, dict):
        for k in ours:
            _copy_tree(ours[k], saved[k])
    elif isinstance(ours, list):
        for a, b in zip(ours, saved, strict=True):
            _copy_tree(a, b)


def _check_config(where: str, ours: ShampooConfig, saved: object) -> None:
    """The saved config must equal ours; the error names every differing field."""
    if not isinstance(saved, dict):
        _fail(where, f"the saved config is {type(saved).__name__}, expected a dict")
    try:
        config = ShampooConfig.from_dict(cast(dict[str, object], saved))
    except (ValueError, TypeError, KeyError) as err:
        _fail(where, f"the saved config is invalid: {err}")
    differences = config_differences(config, ours)
    if differences:
        _fail(where, "the state was saved under a different config; fields that differ "
              "(saved -> this optimizer's): " + "; ".join(differences))


def _check_group(where: str, saved_group: dict[str, Any]) -> None:
    """The group's hyperparameters that a load would set: ``lr`` must be valid."""
    from .cohorts import AVERAGING_MODE, FIRST_LR, LR_POWER_SUM
    from .optimizer import check_lr

    for key in ("lr", FIRST_LR, LR_POWER_SUM):  # FIRST_LR: eq. (8b)'s lr_1; LR_POWER_SUM:
        if key in saved_group:                  # eq. (20d)'s sum of lr_i^p (both >= 0)
            try:
                check_lr(saved_group[key], f"{where}[{key!r}]")
            except (TypeError, ValueError) as err:
                _fail(where, str(err))
    if AVERAGING_MODE in saved_group and saved_group[AVERAGING_MODE] not in ("train", "eval"):
        _fail(where, f"{AVERAGING_MODE} = {_shown(saved_group[AVERAGING_MODE])}: allowed "
              "'train' or 'eval' (eq. 20d)")


def _check_metrics(metrics: object) -> dict[str, Any]:
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        _fail("metrics", f"expected a dict, got {type(metrics).__name__}")
    for key, value in metrics.items():
        if key not in COUNTERS:
            _fail("metrics", f"unknown counter {_shown(key)}: allowed "
                  + ", ".join(repr(c) for c in COUNTERS))
        if not _is_count(value):
            _fail(f"metrics[{key!r}]", f"expected a count in [0, {_MAX_COUNT}], got "
                  f"{_shown(value)}")
    return metrics


def _version(sd: dict[str, Any], absent: int | None) -> int:
    """The checkpoint's format version (``absent`` when it has no ``"version"``)."""
    version = sd.get("version", absent)
    if type(version) is not int or version not in VERSIONS:  # not a bool, not 2.0
        _fail("version", f"{_shown(version)} is not supported: allowed {list(VERSIONS)}")
    return version


def _check_param_shape(where: str, p: torch.Tensor, saved: dict[str, Any], version: int,
                       ours: dict[str, Any]) -> dict[str, Any]:
    """The parameter the state was saved for must have ``p``'s shape; the rest of the entry.

    Version 2: its ``param_shape``. Version 1 has none: the elementwise state
    (the parameter's merged shape) is compared here, the factors by
    :func:`_check_tree` (the shapes of ``p``'s block plan); see the module
    doc for the parameters this cannot tell apart.
    """
    if version == 1:
        if "param_shape" in saved:
            _fail(where, "'param_shape' is an entry of version 2, but the checkpoint is "
                  "version 1 (a state_dict without 'version', or 'version': 1)")
        for key, mine in ours.items():
            theirs = saved.get(key)
            if (isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor)
                    and tuple(theirs.shape) != tuple(mine.shape)):
                _fail(f"{where}[{key!r}]", f"the state was saved for a parameter whose merged "
                      f"shape is {tuple(theirs.shape)}; this parameter of shape "
                      f"{tuple(p.shape)} merges to {tuple(mine.shape)} (version 1: the shape "
                      "is checked from the state tensors)")
        return saved
    shape = saved.get("param_shape")
    if not (isinstance(shape, (list, tuple)) and all(_is_count(d) for d in shape)):
        _fail(where, f"no valid 'param_shape' (got {_shown(shape)}): a version 2 checkpoint "
              "holds the shape of the parameter the state was saved for")
    if tuple(shape) != tuple(p.shape):
        _fail(where, f"the state was saved for a parameter of shape {tuple(shape)}, this "
              f"parameter has shape {tuple(p.shape)}")
    return {k: v for k, v in saved.items() if k != "param_shape"}


def _groups(sd: dict[str, Any], opt: Shampoo) -> list[dict[str, Any]]:
    groups = sd["param_groups"]
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        _fail("param_groups", "expected a list of dicts")
    if len(groups) != len(opt.param_groups):
        _fail("param_groups", f"{len(groups)} saved groups, this optimizer has "
              f"{len(opt.param_groups)}")
    if not isinstance(sd["state"], dict):
        _fail("state", f"expected a dict, got {type(sd['state']).__name__}")
    return groups


def _apply(
    opt: Shampoo,
    pairs: list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]],
    groups: list[dict[str, Any]],
    metrics: dict[str, Any],
    blocks: list[list[list[dict[str, Any]]]],
) -> None:
    """Copy validated state, group hyperparameters and counters into ``opt``.

    ``blocks`` (:func:`_block_entries`) holds the block states ``pairs`` copy
    into: views, but packed matrices (new tensors), stored back afterwards.

    Called only after every check passed (nothing here can fail on a
    validated checkpoint), so a bad checkpoint changes nothing.
    ``root_failures`` is a sum over ranks (each counts its own blocks): only
    rank 0 of a distributed optimizer takes the saved total.
    """
    for p, ours, saved in pairs:
        _copy_tree(ours, saved)
        opt.state[p]["step"] = int(saved["step"])
    opt._checkpoint_store(blocks)
    for group, saved_group in zip(opt.param_groups, groups, strict=True):
        for key, value in saved_group.items():
            if key not in ("params", "config", "param_names"):
                group[key] = value
    opt._restore_metrics(metrics)


def load_state_dict(opt: Shampoo, sd: dict[str, Any]) -> None:
    """Validate everything, then commit (see the module doc); ValueError changes nothing."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        _fail("top level", "expected a dict with 'state' and 'param_groups'")
    if "format" in sd:
        _fail("top level", f"a dict with format {_shown(sd['format'])}: use "
              "load_distributed_state_dict for distributed_state_dict()")
    version = _version(sd, absent=1)  # version 1 had no "version"
    groups = _groups(sd, opt)
    blocks = _block_entries(opt)
    pairs = []  # (our live state tree, saved tree), validated before any copy
    for gi, (group, saved_group, per_param) in enumerate(
        zip(opt.param_groups, groups, blocks, strict=True)
    ):
        ids = saved_group.get("params", [])
        if not isinstance(ids, list) or len(ids) != len(group["params"]):
            _fail(f"param_groups[{gi}]", f"{len(ids) if isinstance(ids, list) else ids!r} "
                  f"saved parameters, this group has {len(group['params'])}")
        _check_config(f"param_groups[{gi}].config", group["config"], saved_group.get("config"))
        _check_group(f"param_groups[{gi}]", saved_group)
        for j, (p, pid, pblocks) in enumerate(zip(group["params"], ids, per_param, strict=True)):
            where = f"param_groups[{gi}] parameter {j} (state[{pid!r}])"
            saved = sd["state"].get(pid) if isinstance(pid, (int, str)) else None
            if not isinstance(saved, dict):
                _fail(where, "missing")
            ours = dict(opt.state[p])
            ours["blocks"] = pblocks
            saved = _check_param_shape(where, p, saved, version, ours)
            _check_tree(where, ours, saved)
            pairs.append((p, ours, saved))
    metrics = _check_metrics(sd.get("metrics"))
    _apply(opt, pairs, groups, metrics, blocks)


FORMAT = "shampoo_torch.distributed_state_dict"
VERSION = 2  # of both formats; 2: with each parameter's "param_shape"
VERSIONS = (1, 2)  # loadable


def _cpu(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _cpu(v) for k, v in tree.items()}
    return tree


def _held_blocks(
    blocks: list[list[list[dict[str, Any]]]],
) -> dict[tuple[int, int, int], dict[str, Any]]:
    """Live state of the blocks held here (of :func:`_block_entries`), keyed (group,
    position, block)."""
    out = {}
    for gi, per_param in enumerate(blocks):
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
    local = {key: _cpu(entry) for key, entry in _held_blocks(_block_entries(opt)).items()}
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
            entry["param_shape"] = list(p.shape)
            entry["blocks"] = {b: local[(gi, pos, b)] for b in range(counts[gi][pos])}
            state[names[gi][pos]] = entry
        saved = {k: v for k, v in group.items() if k not in ("params", "config", "param_names")}
        saved["config"] = group["config"].to_dict()
        saved["params"] = list(names[gi])
        groups.append(saved)
    metrics = {**opt.metrics, "root_failures": root_failures}
    return {"format": FORMAT, "version": VERSION, "state": state, "param_groups": groups,
            "metrics": metrics}


def load_distributed_state_dict(opt: Shampoo, sd: dict[str, Any]) -> None:
    """Restore a :func:`distributed_state_dict` at any world size; this rank keeps its blocks.

    Validates everything (names, configs, every block present, shapes, lr,
    counters) before changing anything; raises ValueError naming what
    differs. Distributed, a collective over the trainer group: when any
    rank's validation fails every rank raises (and none changed anything).
    """
    try:
        pairs, groups, metrics, blocks = _validate_distributed(opt, sd)
        error = None
    except ValueError as err:
        error = err
    messages = opt._checkpoint_gather(None if error is None else str(error))
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        rank, message = failed[0]
        raise ValueError(f"{message} (found by rank {rank} of the trainer group; no rank "
                         "loaded anything)")
    _apply(opt, pairs, groups, metrics, blocks)


_DECIMAL = re.compile(r"0|[1-9][0-9]*")
#: A block's dicts keyed by block dim k.
_INT_KEYED = ("factors", "inverse_roots", "sketches", "eigenbases")


def _ints(tree: Any) -> Any:
    """A dict whose keys are all decimal strings ("0", "12") keyed by those ints."""
    if isinstance(tree, dict) and tree and all(
            isinstance(k, str) and _DECIMAL.fullmatch(k) for k in tree):
        return {int(k): v for k, v in tree.items()}
    return tree


def _int_keys(sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` with the int keys that ``torch.distributed.checkpoint`` turned into strings
    back to ints (a new dict; ``sd`` is not changed).

    DCP flattens a state dict into paths of strings, so a file written by
    ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` (or
    ``dcp.load`` without a template) holds ``"blocks": {"0": ...}`` and a block's
    ``"factors": {"0": ...}`` (``"inverse_roots"``, ``"sketches"`` alike). Only
    those dicts, and only when every key is a decimal string (no sign, no leading
    zero), are converted: anything else is left for validation to refuse.
    """
    state = sd["state"]
    if not isinstance(state, dict):
        return sd
    out = {}
    for name, entry in state.items():
        if isinstance(entry, dict) and isinstance(entry.get("blocks"), dict):
            blocks = {b: ({k: _ints(v) if k in _INT_KEYED else v for k, v in block.items()}
                          if isinstance(block, dict) else block)
                      for b, block in _ints(entry["blocks"]).items()}
            entry = {**entry, "blocks": blocks}
        out[name] = entry
    return {**sd, "state": out}


def _validate_distributed(
    opt: Shampoo, sd: dict[str, Any]
) -> tuple[list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]], list[dict[str, Any]],
           dict[str, Any], list[list[list[dict[str, Any]]]]]:
    """Every check of :func:`load_distributed_state_dict` on this rank's part: what to commit
    (and the block states it copies into, :func:`_apply`)."""
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        _fail("top level", f"expected a dict with format {FORMAT!r} (from "
              "distributed_state_dict()); use load_state_dict for state_dict()")
    version = _version(sd, absent=None)
    if "state" not in sd or "param_groups" not in sd:
        _fail("top level", "expected 'state' and 'param_groups'")
    sd = _int_keys(sd)
    groups = _groups(sd, opt)
    names = _names(opt)
    blocks = _block_entries(opt)
    held = _held_blocks(blocks)
    counts = _block_counts(opt)
    pairs = []
    for gi, (group, saved_group) in enumerate(zip(opt.param_groups, groups, strict=True)):
        if saved_group.get("params") != names[gi]:
            _fail(f"param_groups[{gi}].params", f"saved names {saved_group.get('params')} do "
                  f"not match {names[gi]}")
        _check_config(f"param_groups[{gi}].config", group["config"], saved_group.get("config"))
        _check_group(f"param_groups[{gi}]", saved_group)
        for pos, p in enumerate(group["params"]):
            name = names[gi][pos]
            saved = sd["state"].get(name)
            if not isinstance(saved, dict) or not isinstance(saved.get("blocks"), dict):
                _fail(f"state[{name!r}]", "missing (or without 'blocks')")
            count = counts[gi][pos]
            keys = list(saved["blocks"])
            if not all(isinstance(b, int) for b in keys) or sorted(keys) != list(range(count)):
                _fail(f"state[{name!r}]['blocks']", f"block indices {_shown(keys)} "
                      f"do not match the plan's {list(range(count))}")
            mine = {b: held[(gi, pos, b)] for b in range(count) if (gi, pos, b) in held}
            ours = dict(opt.state[p])
            ours["blocks"] = mine
            saved = _check_param_shape(f"state[{name!r}]", p, saved, version, ours)
            subset = dict(saved)
            subset["blocks"] = {b: saved["blocks"][b] for b in mine}
            _check_tree(f"state[{name!r}]", ours, subset)
            pairs.append((p, ours, subset))
    return pairs, groups, _check_metrics(sd.get("metrics")), blocks
