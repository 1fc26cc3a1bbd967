"""Grafting: the elementwise first-order method whose step size Shampoo borrows, eq. (14).

The graft state V has one entry per parameter entry, so it lives in the
parameter's (merged) layout, not in the blocks; only the norm of the
rescaling (eq. 18) depends on the block or parameter scope.
"""

from __future__ import annotations

import torch

from shampoo_spec import GraftingConfig

_NEEDS_STATE = ("adagrad", "rmsprop", "adam", "adagrad_normalized", "rmsprop_normalized")


def needs_state(graft: GraftingConfig) -> bool:
    return graft.type in _NEEDS_STATE


def graft_input(x: torch.Tensor, graft: GraftingConfig) -> torch.Tensor:
    """``x / (||x|| + normalize_epsilon)`` for the ``*_normalized`` types, else x (eq. 14)."""
    if graft.type.endswith("_normalized"):
        return x / (torch.linalg.vector_norm(x) + graft.normalize_epsilon)
    return x


def update_state(state: torch.Tensor, g: torch.Tensor, graft: GraftingConfig) -> torch.Tensor:
    """Eq. (14b): ``V + g^2`` (beta2 = 1) or ``beta2 V + (1 - beta2) g^2``."""
    g = graft_input(g, graft)
    if graft.beta2 == 1.0:
        return state + g * g
    return graft.beta2 * state + (1.0 - graft.beta2) * g * g


def direction(
    x: torch.Tensor, state: torch.Tensor | None, t: int, graft: GraftingConfig
) -> torch.Tensor:
    """Eq. (14c): X, sign(X), or ``x / (sqrt(V / bc) + epsilon)`` at step t."""
    kind = graft.type
    if kind in ("none", "sgd"):
        return x
    if kind == "sign":
        return torch.sign(x)
    assert state is not None
    x = graft_input(x, graft)
    if graft.bias_correction and graft.beta2 < 1.0:
        state = state / (1.0 - graft.beta2**t)
    return x / (torch.sqrt(state) + graft.epsilon)
