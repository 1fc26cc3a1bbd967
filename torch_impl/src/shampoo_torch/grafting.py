"""Grafting: the elementwise first-order method whose step size Shampoo borrows, eq. (14).

The graft state V has one entry per parameter entry, so it lives in the
parameter's (merged) layout, not in the blocks; only the norm of the
rescaling (eq. 18, :mod:`shampoo_torch.preconditioner`) depends on the
block or parameter scope. Whether there is a state at all is
``GraftingConfig.has_state``.
"""

from __future__ import annotations

import math

import torch

from shampoo_spec import GraftingConfig


def norm(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``||x||_2`` (over ``dim``, else all of x) that cannot overflow for finite x.

    ``torch.linalg.vector_norm`` sums squares, which overflow once an entry
    passes ~1.8e19 in float32 (eq. 3 admits finite gradients up to about
    2^63.5 / sqrt(|B|), and preconditioning can enlarge them): the eq. (18)
    rescale would then take inf / inf. Where the plain norm is not finite
    but every entry is, this returns ``max|x| * ||x / max|x|||`` instead;
    elsewhere the plain norm itself, bit for bit (a non-finite x keeps its
    inf or NaN norm).
    """
    plain: torch.Tensor = (
        torch.linalg.vector_norm(x) if dim is None else torch.linalg.vector_norm(x, dim=dim)
    )
    if x.numel() == 0:  # an empty parameter: its norm is 0 (amax has no identity)
        return plain
    if plain.device.type == "cpu" and bool(torch.isfinite(plain).all()):
        return plain  # what the select below gives; on CPU the read syncs no device
    big = x.abs().amax() if dim is None else x.abs().amax(dim=dim)
    safe = torch.where(big > 0, big, torch.ones_like(big))
    div = safe if dim is None else safe.unsqueeze(dim)
    scaled = big * (torch.linalg.vector_norm(x / div) if dim is None
                    else torch.linalg.vector_norm(x / div, dim=dim))
    return torch.where(torch.isfinite(plain) | ~torch.isfinite(big), plain, scaled)


def graft_input(x: torch.Tensor, graft: GraftingConfig) -> torch.Tensor:
    """``x / (||x|| + normalize_epsilon)`` for the ``*_normalized`` types, else x (eq. 14a)."""
    if graft.normalizes_input:
        out: torch.Tensor = x / (norm(x) + graft.normalize_epsilon)
        return out
    return x


def update_state(state: torch.Tensor, g: torch.Tensor, graft: GraftingConfig) -> torch.Tensor:
    """Eq. (14b): ``V + g^2`` (beta2 = 1) or ``beta2 V + w g^2``, w = update_weight."""
    g = graft_input(g, graft)
    if graft.beta2 == 1.0:
        return state + g * g
    return graft.beta2 * state + graft.update_weight * g * g


def direction(
    x: torch.Tensor, state: torch.Tensor | None, t: int, graft: GraftingConfig
) -> torch.Tensor:
    """Eq. (14c): X, sign(X), or ``x / (sqrt(V / bc) + epsilon)`` at step t
    (``epsilon_placement="inside_sqrt"``: ``x / sqrt(V / bc + epsilon)``)."""
    kind = graft.type
    if kind in ("none", "sgd"):
        return x
    if kind == "sign":
        return torch.sign(x)
    assert state is not None
    x = graft_input(x, graft)
    if graft.corrects_bias:
        state = state / graft.bias_correction_factor(t)
    if graft.epsilon_placement == "inside_sqrt":
        return clip(x / torch.sqrt(state + graft.epsilon), graft)
    return clip(x / (torch.sqrt(state) + graft.epsilon), graft)


def clip(u: torch.Tensor, graft: GraftingConfig) -> torch.Tensor:
    """Eq. (14d): ``u / max(1, rms(u) / clip_rms)``, ``rms(u) = ||u|| / sqrt(size)``; u if None.

    ``torch.maximum`` keeps a NaN rms (as the reference's ``np.maximum`` and
    Google's ``jnp.maximum``).
    """
    c = graft.clip_rms
    if c is None:
        return u
    rms = norm(u) / math.sqrt(u.numel())
    out: torch.Tensor = u / torch.maximum(rms / c, torch.ones_like(rms))
    return out
