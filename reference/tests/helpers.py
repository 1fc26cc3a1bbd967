"""Shared scaffolding of the reference's own tests."""

from __future__ import annotations

import numpy as np

import shampoo_spec as ss
from shampoo_reference import ReferenceShampoo


def directions(config: ss.ShampooConfig, grads: list[np.ndarray]) -> list[np.ndarray]:
    """The reference's step ``W_{t-1} - W_t`` for one parameter ``"w"`` from zero, per gradient."""
    opt = ReferenceShampoo(config, {"w": np.zeros(grads[0].shape)})
    out = []
    for g in grads:
        before = opt.params["w"].copy()
        out.append(before - opt.step({"w": g})["w"])
    return out
