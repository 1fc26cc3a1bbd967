"""The rules for Shampoo's arguments: learning rates, configs and the moments torch's
schedulers cycle (``"betas"``, ``"momentum"``), at the top level and per param group
(and in a checkpoint's groups, :mod:`shampoo_torch.checkpoint_validation`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from shampoo_spec import ShampooConfig


def check_lr(lr: object, name: str) -> None:
    """A learning rate: a finite real number >= 0 (not a bool, not a tensor); else ValueError.

    ``name`` says where it came from (``"lr"``, ``"param_groups[1]['lr']"``).
    """
    ok = (isinstance(lr, numbers.Real) and not isinstance(lr, bool)
          and not isinstance(lr, torch.Tensor))
    if ok:
        try:
            ok = math.isfinite(float(lr)) and float(lr) >= 0.0  # type: ignore[arg-type]
        except (OverflowError, TypeError, ValueError):
            ok = False
    if not ok:
        text = repr(lr)
        text = text if len(text) <= 80 else text[:60] + "..."
        raise ValueError(f"{name} = {text} is invalid: allowed a finite number >= 0 (a Python "
                         "float or int; tensor learning rates are not supported).")


def as_config(value: object, default: ShampooConfig, name: str) -> ShampooConfig:
    """The one rule for a config argument, at the top level and in a param group.

    A :class:`~shampoo_spec.ShampooConfig`; its ``to_dict()`` form (a dict,
    read by ``ShampooConfig.from_dict``, as checkpoints store it); or None
    for ``default``. Anything else, or a dict ``from_dict`` refuses, raises
    ValueError naming ``name`` (``"config"``, ``"param_groups[1]['config']"``).
    """
    if value is None:
        return default
    if isinstance(value, ShampooConfig):
        return value
    if isinstance(value, dict):
        try:
            return ShampooConfig.from_dict(value)
        except (ValueError, TypeError, KeyError) as err:
            raise ValueError(f"{name} is an invalid ShampooConfig dict: {err}") from err
    text = repr(value)
    text = text if len(text) <= 80 else text[:60] + "..."
    raise ValueError(f"{name} = {text} ({type(value).__name__}) is invalid: allowed a "
                     "shampoo_spec.ShampooConfig, its to_dict() form (a dict) or None.")


#: The param-group keys of the moments torch's schedulers cycle (``cycle_momentum``), as
#: torch's optimizers and Meta's DistributedShampoo name them: ``"betas"`` = (beta1 of
#: eq. 15's filter, beta2 of eq. 6's statistics), ``"momentum"`` = mu of eq. (20).
BETAS = "betas"
MOMENTUM = "momentum"


def moment_keys(config: ShampooConfig) -> dict[str, object]:
    """The moment keys a param group with ``config`` carries, at the config's values.

    Only where the config keeps the moment the key drives (its state buffer exists):
    ``"betas"`` with eq. (15)'s filter on (beta1 > 0), ``"momentum"`` with eq. (20)'s
    momentum on (mu > 0). A group's value then replaces the config's at each step.
    """
    keys: dict[str, object] = {}
    if config.gradient_filter.enabled:
        keys[BETAS] = (config.gradient_filter.beta1, config.statistics.beta2)
    if config.momentum.enabled:
        keys[MOMENTUM] = config.momentum.momentum
    return keys


def check_moment(value: object, name: str) -> None:
    """A moment coefficient: a real number in [0, 1) (not a bool, a tensor or NaN); else
    ValueError naming ``name`` (``"param_groups[0]['betas'][0]"``)."""
    if not (_real(value) and 0.0 <= float(value) < 1.0):  # type: ignore[arg-type]  # not NaN
        raise ValueError(f"{name} = {_shown(value)} is invalid: allowed a number in [0, 1) "
                         "(a Python float; tensor values are not supported).")


def check_moments(group: Mapping[str, Any], config: ShampooConfig, where: str) -> None:
    """A param group's ``"betas"`` and ``"momentum"`` (:func:`moment_keys`), checked before
    a step or a load changes anything; ValueError naming ``where[key]``.

    ``betas[0]``, eq. (15)'s beta1, and ``momentum``, eq. (20)'s mu: in [0, 1)
    (0 keeps the buffer: F_t = G_t, M = (1 - d) P). ``betas[1]`` is the statistics'
    beta2 (eq. 6), which the group cannot change: it must equal the config's. A
    key the config keeps no moment for is refused (its value would be ignored).
    """
    kept = moment_keys(config)
    for key in (BETAS, MOMENTUM):
        if key not in group:
            continue
        value, name = group[key], f"{where}[{key!r}]"
        if key not in kept:
            moment = ("gradient filter (gradient_filter.beta1 > 0, eq. 15)" if key == BETAS
                      else "momentum (momentum.momentum > 0, eq. 20)")
            raise ValueError(f"{name} = {_shown(value)} is invalid: this group's config keeps "
                             f"no {moment}, so it has no {key!r} to change: allowed only with "
                             "a config that keeps it.")
        if key == MOMENTUM:
            check_moment(value, name)
            continue
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise ValueError(f"{name} = {_shown(value)} is invalid: allowed a pair (beta1, "
                             "beta2), as torch's optimizers keep it.")
        check_moment(value[0], f"{name}[0]")
        beta2 = config.statistics.beta2
        if not (_real(value[1]) and float(value[1]) == beta2):
            raise ValueError(
                f"{name}[1] = {_shown(value[1])} is invalid: allowed {beta2!r}, the config's "
                "statistics.beta2 (eq. 6), which a param group cannot change (only "
                f"{name}[0], the filter's beta1, follows the group).")


def _real(value: object) -> bool:
    """Whether ``value`` is a real number that converts to a float (not a bool or tensor)."""
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, torch.Tensor)):
        return False
    try:
        float(value)
    except (OverflowError, TypeError, ValueError):
        return False
    return True


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + "..."
