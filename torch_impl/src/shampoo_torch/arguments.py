"""The rules for Shampoo's arguments: learning rates and configs, at the top level and
per param group (and in a checkpoint's groups, :mod:`shampoo_torch.checkpoint_validation`).
"""

from __future__ import annotations

import math
import numbers

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
