"""Eq. (3) inside ``jit``: which blocks a step refuses, and the gradients it keeps.

A block is refused when its gradient has a non-finite entry or when its
state could leave float32's range: ``m + |B| g^2 > STATE_LIMIT``
(``shampoo_spec.block_overflows``, computed here on traced arrays in float32
or wider, a NaN refusing; m includes the graft state V and a diagonal
preconditioner's V_D, eq. 16b, and eq. 14e's Adafactor moments of the whole
parameter). Refused blocks are zeroed in the gradients and
masked out of every state update by the phases of :mod:`shampoo_jax.transform`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from shampoo_spec.limits import STATE_LIMIT

from . import blocks as B
from .placement import ShardingConfig, real_blocks
from .state import BlockGroupState, ShampooState


class Refused(NamedTuple):
    """Eq. (3)'s masks: gradients with refused blocks zeroed, and which they were."""

    grads: list[Array]  # merged leaves
    blocks: list[Array]  # per block group, in the factor dtype
    block_ok: list[Array]  # per block group, [nb]
    finite: list[Array]  # per leaf, elementwise ("not refused")
    skipped: Array  # blocks (and non-preconditioned leaves) skipped this step
    per_parameter: Array  # [number of leaves], the same per parameter



def max_abs(x: Array, axes: tuple[int, ...]) -> Array:
    # At least float32, so a float64 maximum is not rounded into range; 0 for
    # an empty array (a size-0 parameter), the identity of a max of |x|.
    out = jnp.max(jnp.abs(x), axis=axes, initial=0.0)
    return out.astype(jnp.promote_types(x.dtype, jnp.float32))


def held_max(
    groups: tuple[BlockGroupState, ...], layout: B.Layout, sharding: ShardingConfig | None
) -> list[Array | None]:
    """Per block group, the largest |entry| of each block's factors and corrected moment D.

    ``[nb]`` per group (None: no such state). Sharded states are padded and
    placed: the real blocks' entries are picked out (global view).
    """
    per_slot: list[Array | None] = []
    for gs in groups:
        parts = [max_abs(f, (1, 2)) for f in gs.factors]
        d = gs.corrected_moment
        if d is not None:
            parts.append(max_abs(d, tuple(range(1, d.ndim))))
        per_slot.append(functools.reduce(jnp.maximum, parts) if parts else None)
    if sharding is None or not layout.groups:
        return per_slot
    return real_blocks(per_slot, layout, groups, sharding)


def _blocks_max_abs(merged: Sequence[Array], layout: B.Layout) -> list[Array]:
    """Per block group, ``[nb]``: the largest |entry| of each block of ``merged`` leaves,
    read from the leaves' slices (no stack of the blocks: a copy of the state)."""
    out = []
    for grp in layout.groups:
        parts = []
        for i, j in grp.members:
            block = merged[i][layout.leaves[i].plan.blocks[j].slices]
            parts.append(max_abs(block, tuple(range(block.ndim))))
        out.append(jnp.stack(parts))
    return out


def passes(x: Array, held: Array | None, factors: Array | None = None,
           limit: float | None = None) -> Array:
    """Eq. (3) per block of a stack ``[nb, ...]``: finite and ``m + |B| g^2 <= STATE_LIMIT``.

    ``held``: m, the largest |entry| of each block's state (None: 0). The
    bound is ``shampoo_spec.block_overflows``'s, in float32 or wider; a NaN
    anywhere refuses.
    """
    axes = tuple(range(1, x.ndim))
    finite = jnp.all(jnp.isfinite(x), axis=axes)
    g = max_abs(x, axes)
    if held is not None:
        g = g.astype(jnp.promote_types(g.dtype, held.dtype))
    bound = math.prod(x.shape[1:]) * g * g
    if held is not None:
        bound = held.astype(bound.dtype) + bound
    ok: Array = finite & (bound <= STATE_LIMIT)
    if limit is not None:  # float16 factors (eq. 11b): m_f + |B| g^2 <= 2^15 too
        term = math.prod(x.shape[1:]) * g * g
        factor_bound = term if factors is None else factors.astype(term.dtype) + term
        ok = ok & (factor_bound <= limit)
    return ok


def refuse_blocks(
    g: list[Array],
    state: ShampooState,
    elementwise: Sequence[list[Array]],
    layout: B.Layout,
    fdt: Any,
    sharding: ShardingConfig | None,
    limit: float | None = None,
    whole: Sequence[Array] | None = None,
) -> Refused:
    """Eq. (3): refused blocks are zeroed here and masked in every update.

    A block is refused when its gradient has a non-finite entry or when the
    overflow bound ``m + |B| g^2 > STATE_LIMIT`` holds
    (``shampoo_spec.block_overflows``): g = max |G_B|, m = the largest
    |entry| of the block's factors, graft state V and diagonal state V_D
    (eq. 16b; both on its slice) and corrected moment D. With ``limit``
    (float16 factors, ``shampoo_spec.factor_limit``, eq. 11b) also
    ``m_f + |B| g^2 > limit``, m_f of the factors alone. A parameter that is
    not preconditioned is one block (no factors: no factor limit).
    ``elementwise``: the elementwise states that count in m, each a list of
    merged-shape leaves (V, V_D where the config keeps them; empty: none).
    ``whole``: per leaf, a scalar that counts in m for every block of that
    leaf (eq. 14e: the largest entry of the Adafactor moments R, C, V, which
    span the whole parameter); None: none.
    """
    g_blocks = B.gather(g, layout)
    held = held_max(state.groups, layout, sharding)
    factors_held = list(held)  # the factors alone (no D with stored factors): ``limit``'s m
    for v in elementwise if layout.groups else ():
        for gi, m in enumerate(_blocks_max_abs(v, layout)):
            h = held[gi]
            held[gi] = m if h is None else jnp.maximum(h, m)
    if whole is not None:
        for gi, grp in enumerate(layout.groups):
            # Each block's owner's scalar, in the layout's (global) block order.
            m = jnp.stack([whole[i] for i, _ in grp.members])
            h = held[gi]
            held[gi] = m if h is None else jnp.maximum(h, m)
    block_ok = [passes(x, h, f, limit)
                for x, h, f in zip(g_blocks, held, factors_held, strict=True)]
    n = len(layout.leaves)
    per_parameter = jnp.zeros((n,), jnp.int32)
    for grp, ok in zip(layout.groups, block_ok, strict=True):
        owner = np.asarray([i for i, _ in grp.members], np.int32)
        per_parameter = per_parameter + jax.ops.segment_sum(
            (~ok).astype(jnp.int32), owner, num_segments=n
        )
    finite: list[Array] = []
    for i, leaf in enumerate(layout.leaves):
        if leaf.refs:
            finite.append(B.block_flags_to_leaf(block_ok, leaf))
        else:
            vi: Array | None = None if whole is None else whole[i][None]
            for v in elementwise:
                m = max_abs(v[i], tuple(range(v[i].ndim)))[None]
                vi = m if vi is None else jnp.maximum(vi, m)
            ok = passes(g[i][None], vi)[0]
            finite.append(jnp.broadcast_to(ok, g[i].shape))
            per_parameter = per_parameter.at[i].add((~ok).astype(jnp.int32))
    # dtype: under x64 a plain sum would promote the int32 counter to int64.
    skipped = jnp.sum(per_parameter, dtype=jnp.int32) if n else jnp.zeros((), jnp.int32)
    g = [jnp.where(f, x, 0.0) for f, x in zip(finite, g, strict=False)]
    return Refused(g, masked_blocks(g_blocks, block_ok, fdt), block_ok, finite, skipped,
                   per_parameter)


def masked_blocks(g_blocks: list[Array], block_ok: list[Array], fdt: Any) -> list[Array]:
    """Per block group, the stack with refused blocks (eq. 3) zeroed, in ``fdt``."""
    return [jnp.where(B.expand(ok, x), x, 0.0).astype(fdt)
            for ok, x in zip(block_ok, g_blocks, strict=False)]
