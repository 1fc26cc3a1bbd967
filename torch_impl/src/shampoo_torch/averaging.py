"""Eq. (20d)'s switch between the training sequence y and the averaged sequence x
(:meth:`shampoo_torch.Shampoo.eval` and :meth:`~shampoo_torch.Shampoo.train`).

The parameters hold y while training; ``eval()`` puts ``x = (W - (1 - mu_y) Z) / mu_y``
in them and ``train()`` puts y back, both as ``W <- W + c (Z - W)`` with the
group's averaged sequence Z (its ``"averaged"`` state). The averaged step
itself is :func:`shampoo_torch.elementwise.averaged_step`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from . import sharding
from .cohorts import AVERAGING_MODE
from .state import ParamGroupPlan


def switch_sequence(
    param_groups: Sequence[dict[str, Any]], plans: Sequence[ParamGroupPlan],
    state: Mapping[torch.Tensor, dict[str, Any]], mode: Literal["eval", "train"],
) -> None:
    """``W <- W + c (Z - W)`` for every parameter of the groups not yet in ``mode``
    (``c = 1 - 1/mu_y`` to eval, ``1 - mu_y`` to train; eq. 20e in float32).

    Under FSDP2 a collective in ``"lossless"`` mode: every rank of the shard
    group calls ``Shampoo.train`` / ``Shampoo.eval`` together, as it calls ``step``."""
    for group, gp in zip(param_groups, plans, strict=True):
        av = gp.config.averaging
        if av is None or group[AVERAGING_MODE] == mode:
            continue
        c = av.switch_coefficient(mode)
        for j, p in enumerate(group["params"]):
            z = state[p]["averaged"]
            whole = gp.planned(j, p.detach())  # FSDP2 "lossless": all-gathered
            w = whole.to(z.dtype).reshape(z.shape)
            new = (w + c * (z - w)).reshape(whole.shape).to(whole.dtype)
            sharding.store_planned(p, new, gp.shards[j] if gp.shards else None,
                                   gp.local_shards)
        group[AVERAGING_MODE] = mode
