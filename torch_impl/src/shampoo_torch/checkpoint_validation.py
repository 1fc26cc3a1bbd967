"""The checks of a saved Shampoo state (:mod:`shampoo_torch.checkpoint`) before any of it
is loaded: every one raises ValueError naming what it found, and none changes anything.

Structure, configs (the differing fields named), shapes and kinds of every
state tensor (the inverse roots', corrected moment's, stored factors' and
momentum scales' dtypes exactly: storage rules), finiteness, step counts,
the groups' hyperparameters, the metrics and the format version.
"""

from __future__ import annotations

from typing import Any, NoReturn, cast

import torch

from shampoo_spec import ShampooConfig, config_differences

from .arguments import check_lr, check_moments
from .cohorts import AVERAGING_MODE, FIRST_LR, LR_POWER_SUM
from .metrics import COUNTERS

VERSION = 3  # of both formats; 2: with each parameter's "param_shape"; 3: entries whole
VERSIONS = (1, 2, 3)  # loadable


def fail(where: str, message: str) -> NoReturn:
    raise ValueError(f"cannot load Shampoo state: {where}: {message}")


def check_version(sd: dict[str, Any], absent: int | None) -> int | None:
    """The checkpoint's format version (``absent`` when it has no ``"version"``)."""
    if "version" not in sd:
        return absent
    version = sd["version"]
    if type(version) is not int or version not in VERSIONS:  # not a bool, not 2.0
        fail("version", f"{shown(version)} is not supported: allowed {list(VERSIONS)}")
    return version


def infer_version(state: object) -> int:
    """The version of a state dict without ``"version"`` (torch's
    ``get_optimizer_state_dict`` keeps only ``state`` and ``param_groups``), read from its
    entries' ``param_shape``: an int64 tensor in version 3, a list in version 2, absent in
    version 1."""
    entries = [e for e in state.values() if isinstance(e, dict)] if isinstance(state, dict) \
        else []
    shapes = [e["param_shape"] for e in entries if "param_shape" in e]
    if not shapes:
        return 1
    if all(isinstance(s, torch.Tensor) for s in shapes):
        return 3
    if all(isinstance(s, (list, tuple)) for s in shapes):
        return 2
    fail("state", "the entries' 'param_shape' mix int64 tensors (version 3) and lists "
          "(version 2)")


def check_config(where: str, ours: ShampooConfig, saved: object) -> None:
    """The saved config must equal ours; the error names every differing field."""
    if not isinstance(saved, dict):
        fail(where, f"the saved config is {type(saved).__name__}, expected a dict")
    try:
        config = ShampooConfig.from_dict(cast(dict[str, object], saved))
    except (ValueError, TypeError, KeyError) as err:
        fail(where, f"the saved config is invalid: {err}")
    differences = config_differences(config, ours)
    if differences:
        fail(where, "the state was saved under a different config; fields that differ "
              "(saved -> this optimizer's): " + "; ".join(differences))


def check_group(where: str, saved_group: dict[str, Any]) -> None:
    """The group's hyperparameters that a load would set: ``lr`` must be valid, and so
    must ``"betas"`` / ``"momentum"`` for the saved config (checked equal to ours before)."""
    for key in ("lr", FIRST_LR, LR_POWER_SUM):  # FIRST_LR: eq. (8b)'s lr_1; LR_POWER_SUM:
        if key in saved_group:                  # eq. (20d)'s sum of lr_i^p (both >= 0)
            try:
                check_lr(saved_group[key], f"{where}[{key!r}]")
            except (TypeError, ValueError) as err:
                fail(where, str(err))
    try:  # eqs. (15), (20): the moments a scheduler cycles, as the step checks them
        check_moments(saved_group, ShampooConfig.from_dict(saved_group.get("config", {})),
                      where)
    except (TypeError, ValueError, KeyError) as err:
        fail(where, str(err))
    if AVERAGING_MODE in saved_group and saved_group[AVERAGING_MODE] not in ("train", "eval"):
        fail(where, f"{AVERAGING_MODE} = {shown(saved_group[AVERAGING_MODE])}: allowed "
              "'train' or 'eval' (eq. 20d)")


def check_param_shape(where: str, p: torch.Tensor, saved: dict[str, Any], version: int,
                       ours: dict[str, Any]) -> dict[str, Any]:
    """The parameter the state was saved for must have ``p``'s shape; the rest of the entry.

    Version 2: its ``param_shape``. Version 1 has none: the elementwise state
    (the parameter's merged shape) is compared here, the factors by
    :func:`check_tree` (the shapes of ``p``'s block plan); see the module
    doc for the parameters this cannot tell apart.
    """
    if version == 1:
        if "param_shape" in saved:
            fail(where, "'param_shape' is an entry of versions 2 and 3, but the checkpoint "
                  "is version 1 ('version': 1)")
        for key, mine in ours.items():
            theirs = saved.get(key)
            if (isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor)
                    and tuple(theirs.shape) != tuple(mine.shape)):
                fail(f"{where}[{key!r}]", f"the state was saved for a parameter whose merged "
                      f"shape is {tuple(theirs.shape)}; this parameter of shape "
                      f"{tuple(p.shape)} merges to {tuple(mine.shape)} (version 1: the shape "
                      "is checked from the state tensors)")
        return saved
    shape = saved.get("param_shape")
    if version >= 3:  # an int64 tensor of rank 1 (a list cannot be flattened by torch)
        if not (isinstance(shape, torch.Tensor) and shape.dtype == torch.int64
                and shape.dim() == 1):
            fail(where, f"no valid 'param_shape' (got {shown(shape)}): a version 3 "
                  "checkpoint holds the parameter's shape as a rank-1 int64 tensor")
        shape = shape.tolist()
    if not (isinstance(shape, (list, tuple)) and all(_is_count(d) for d in shape)):
        fail(where, f"no valid 'param_shape' (got {shown(shape)}): a version {version} "
              "checkpoint holds the shape of the parameter the state was saved for")
    if tuple(shape) != tuple(p.shape):
        fail(where, f"the state was saved for a parameter of shape {tuple(shape)}, this "
              f"parameter has shape {tuple(p.shape)}")
    return {k: v for k, v in saved.items() if k != "param_shape"}


def check_tree(where: str, ours: Any, saved: Any, exact_dtype: bool = False) -> None:
    """Same keys, same tensor shapes; ints for ints; inverse roots in our dtype exactly.

    The inverse roots' and corrected moment's dtypes are rules (eqs. 11a,
    17a: the stored values are rounded to them), so one saved in any other dtype is
    refused rather than re-rounded or widened on copy; other floating state
    may be any floating dtype (the config, checked first, fixes the factor dtype).
    """
    if isinstance(ours, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            fail(where, f"expected a tensor, got {type(saved).__name__}")
        if tuple(saved.shape) != tuple(ours.shape):
            fail(where, f"shape {tuple(saved.shape)} does not match {tuple(ours.shape)}")
        if ours.dtype.is_floating_point:
            if not saved.dtype.is_floating_point or (exact_dtype and saved.dtype != ours.dtype):
                fail(where, f"dtype {saved.dtype} does not match {ours.dtype}"
                      + (" (a storage rule: config.root_dtype, eq. 11a, "
                         "config.corrected_dtype, eq. 17a, config.factor_storage_dtype, "
                         "eq. 11b, or the momentum scales', eq. 20b)"
                         if exact_dtype else ""))
            if saved.numel() and not bool(torch.isfinite(saved.to(ours.dtype)).all()):
                fail(where, f"non-finite entries (NaN or inf, in {ours.dtype}): allowed "
                      "finite state only")
            if where.endswith("_scale']") and saved.numel() and bool((saved < 0).any()):
                fail(where, "a negative momentum scale: allowed scales >= 0 (eq. 20b)")
            return
        if ours.dtype == torch.int8:  # an int8 momentum buffer (eq. 20b), never a counter
            if saved.dtype != torch.int8:
                fail(where, f"dtype {saved.dtype} does not match {ours.dtype} (int8 momentum "
                      "storage, eq. 20b)")
            if saved.numel() and bool((saved == -128).any()):
                fail(where, "an int8 momentum entry is -128: allowed -127 to 127 (eq. 20b)")
            return
        if saved.dtype.is_floating_point or saved.dtype.is_complex or saved.dtype == torch.bool:
            fail(where, f"dtype {saved.dtype} does not match {ours.dtype}")
        if saved.numel() and bool((saved < 0).any()):
            fail(where, "a counter is negative")
        return
    if isinstance(ours, dict):
        if not isinstance(saved, dict) or set(saved) != set(ours):
            got = sorted(map(str, saved)) if isinstance(saved, dict) else type(saved).__name__
            fail(where, f"keys {got} do not match {sorted(map(str, ours))}")
        for k in ours:
            # The roots' dtype (eq. 11a), the momentum scales' (eq. 20b) and the
            # factors' storage dtype (eq. 11b) are rules.
            check_tree(f"{where}[{k!r}]", ours[k], saved[k],
                        exact_dtype or k in ("inverse_roots", "corrected")
                        or str(k).endswith("_scale") or (k == "factors" and _stored(ours[k])))
        return
    if isinstance(ours, list):
        if not isinstance(saved, list) or len(saved) != len(ours):
            fail(where, f"expected a list of {len(ours)} entries")
        for j, (a, b) in enumerate(zip(ours, saved, strict=True)):
            check_tree(f"{where}[{j}]", a, b, exact_dtype)
        return
    if isinstance(ours, int) and not _is_count(saved):
        fail(where, f"expected a step count in [0, {_MAX_COUNT}], got {shown(saved)}")


def _stored(factors: Any) -> bool:
    """Whether a block's factors are held in a storage dtype (eq. 11b: bfloat16, float16)."""
    return isinstance(factors, dict) and any(
        isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16)
        for t in factors.values())


_MAX_COUNT = 2**63 - 1  # int64, as the device counters


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_COUNT


def shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + "..."


def check_metrics(metrics: object, complete: bool = False) -> dict[str, Any]:
    """The saved counters; ``complete`` (version 3): every counter must be there."""
    if metrics is None and not complete:
        return {}
    if not isinstance(metrics, dict):
        fail("metrics", f"expected a dict, got {type(metrics).__name__}")
    missing = [c for c in COUNTERS if c not in metrics]
    if complete and missing:
        fail("metrics", f"missing counters {missing}: version 3 holds "
              + ", ".join(repr(c) for c in COUNTERS))
    for key, value in metrics.items():
        if key not in COUNTERS:
            fail("metrics", f"unknown counter {shown(key)}: allowed "
                  + ", ".join(repr(c) for c in COUNTERS))
        if not _is_count(value):
            fail(f"metrics[{key!r}]", f"expected a count in [0, {_MAX_COUNT}], got "
                  f"{shown(value)}")
    return metrics
