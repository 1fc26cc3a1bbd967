"""Block state and root work sharded over a mesh axis, with no step of lag.

``shampoo(config, sharding=ShardingConfig(mesh, axis))`` keeps each block
group's stacked state (factors, inverse roots, corrected moment, sketches,
per-block counters; the leading axis is the blocks) padded to a multiple of
the axis size and sharded along it with ``NamedSharding(mesh, P(axis))``
(elementwise states, eq. 6c's gradient sum included, take the parameters'
placement; eq. 14e's Adafactor moments too, less the dim each averages
over), so a device holds ``ceil(nb / N)`` blocks of every block group.
In each step, inside ``jax.shard_map``, every device runs
:func:`shampoo_jax.preconditioner.block_step` on its own blocks: statistics
(eqs. 6, 6c), inverse roots on root steps (eqs. 7, 9-13; sketches, eq. 10d),
the corrected moment (eq. 17) and the preconditioned, block-rescaled blocks
(eqs. 16-18). The preconditioned blocks are then gathered (``all_gather``)
and the rest of the step (reassembly, parameter-scope grafting, momentum,
eqs. 18-21) runs in the global view with the parameters' own sharding.

Same numerics as one device: inverse roots computed at step t precondition step t
(Google's sharded mode applies them a step late; this does not), and every
operation in ``block_step`` is per block, so a device computes exactly what
the single-device program computes for those blocks.

Padding: the padded blocks hold identity factors and inverse roots, zero
counters and empty sketches (eq. 10d), get a zero gradient and ``ok = False``
(eq. 3's mask), so their state never changes, their inverse roots are
discarded (eq. 13's "keep the previous root") and they count neither as
skipped blocks nor as root failures; where the root method allows it
(one-matrix-at-a-time eigh on CPU, coupled Newton) they are not even
decomposed. Placement (:func:`shampoo_jax.placement.placement`): device d owns slots
``[d c, (d + 1) c)`` of each padded block group stack; the real blocks
are put into slots largest root cost (sum of ``n^3``) first, each on the
device with the least root work so far that has a free slot in its block
group, so the padding is spread and the root work balanced across devices
and block groups.

This module owns placement and collectives only; the maths is
:mod:`shampoo_jax.preconditioner`'s and the state :mod:`shampoo_jax.state`'s.

Supported: parameters replicated (data parallelism: the gradient of a
jitted global-view loss is already the mean over the batch, XLA inserts the
all-reduce) or sharded by their own ``NamedSharding`` over any mesh axes
(e.g. ``P(None, "model")`` on a ``("data", "model")`` mesh), with the blocks
sharded over one axis or several (``axis=("data", "model")``). The update
must be called under ``jax.jit`` in the global view, not inside a user's
``shard_map`` with per-device gradients.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.sharding import NamedSharding, PartitionSpec

from shampoo_spec import ShampooConfig

from . import blocks as B
from .grafting import FactoredMoments
from .placement import ShardingConfig, _slots
from .preconditioner import BlockInputs, block_step
from .roots import Sketch
from .state import BlockGroupState, ShampooState


def _spread(x: Array, size: int, fill: Array | float | bool, slots: tuple[int, ...]) -> Array:
    """A stack of ``size`` entries: ``x[j]`` at ``slots[j]``, ``fill`` elsewhere."""
    if size == x.shape[0] and slots == tuple(range(size)):
        return x
    out = jnp.broadcast_to(jnp.asarray(fill, x.dtype), (size, *x.shape[1:]))
    spread: Array = out.at[np.asarray(slots)].set(x)
    return spread


def _eye_fill(x: Array) -> Array:
    return jnp.eye(x.shape[-1], dtype=x.dtype)


def pad_group(gs: BlockGroupState, size: int, slots: tuple[int, ...]) -> BlockGroupState:
    """A block group's stacks spread to ``size`` slots: padding has identity matrices
    (and empty sketches, eq. 10d)."""
    def opt(x: Array | None, fill: float) -> Array | None:
        return None if x is None else _spread(x, size, fill, slots)

    sketches = gs.sketches
    if sketches is not None:
        sketches = tuple(None if sk is None else Sketch(*(_spread(z, size, 0.0, slots) for z in sk))
                         for sk in sketches)

    return gs._replace(
        factors=tuple(_spread(f, size, _eye_fill(f), slots) for f in gs.factors),
        inverse_roots=tuple(_spread(r, size, _eye_fill(r), slots) for r in gs.inverse_roots),
        statistics_updates=_spread(gs.statistics_updates, size, 0, slots),
        consecutive_failures=_spread(gs.consecutive_failures, size, 0, slots),
        corrected_moment=opt(gs.corrected_moment, 0.0),
        corrected_updates=opt(gs.corrected_updates, 0),
        sketches=sketches,
        eigenbases=None if gs.eigenbases is None else tuple(
            _spread(q, size, _eye_fill(q), slots) for q in gs.eigenbases),  # eqs. (10f), (10h)
    )


def _leaf_sharding(sharding: ShardingConfig, like: Any) -> NamedSharding:
    """A concrete parameter's NamedSharding on the same mesh, else replicated."""
    found = getattr(like, "sharding", None) if isinstance(like, jax.Array) else None
    try:
        if isinstance(found, NamedSharding) and found.mesh == sharding.mesh:
            return found
    except AttributeError:  # pragma: no cover - abstract meshes compare differently
        pass
    return sharding.replicated


def _moment_dropped_dims(m: FactoredMoments, p: Any) -> tuple[int | None, ...]:
    """For R, C and V of :class:`FactoredMoments` ``m`` of parameter ``p``: the dim of ``p``
    each lacks (d0 for R, d1 for C, None for V and for absent fields)."""
    if m.full is not None:
        return (None, None, None)
    shape = tuple(int(d) for d in p.shape)
    order = np.argsort(shape)  # eq. (14e)'s d0, d1: the last two of the argsort
    return (int(order[-1]), int(order[-2]), None)


def _moment_sharding(sharding: ShardingConfig, p: Any, ndim: int, drop: int | None
                     ) -> NamedSharding:
    """The parameter's NamedSharding with the spec entry of dim ``drop`` removed (eq. 14e's
    R lacks d0, C lacks d1); replicated when the parameter is not placed on the mesh."""
    found = _leaf_sharding(sharding, p)
    if found == sharding.replicated or drop is None:
        return found
    spec = list(found.spec) + [None] * (ndim + 1 - len(found.spec))
    del spec[drop]
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))


def shard_state(
    state: ShampooState, sharding: ShardingConfig, params: Any | None = None
) -> ShampooState:
    """The single-device state -> padded and placed for ``sharding`` (works under jit too).

    Block stacks are padded to a multiple of N and constrained to
    ``sharding.blocks``; elementwise states take the sharding of the
    matching (concrete) parameter when it is a NamedSharding on the mesh,
    else they are replicated, as are the scalar counters.
    """
    def place(x: Array, where: NamedSharding) -> Array:
        placed: Array = lax.with_sharding_constraint(x, where)
        return placed

    sizes = tuple(int(gs.statistics_updates.shape[0]) for gs in state.groups)
    slots = _slots(sharding, sizes, state.groups)
    groups = tuple(
        jax.tree.map(lambda x: place(x, sharding.blocks),
                     pad_group(gs, sharding.padded(nb), sl))
        for gs, nb, sl in zip(state.groups, sizes, slots, strict=True)
    )

    def elementwise(tree: Any) -> Any:
        if tree is None:
            return None
        if params is None:
            return jax.tree.map(lambda x: place(x, sharding.replicated), tree)
        return jax.tree.map(lambda x, p: place(x, _leaf_sharding(sharding, p)), tree, params)

    def moments(tree: Any) -> Any:
        # Eq. (14e): R, C (or V) per parameter, sharded as the parameter is along
        # the dims they keep (a dim they average over is dropped from the spec).
        if tree is None:
            return None
        if params is None:
            return jax.tree.map(lambda x: place(x, sharding.replicated), tree)
        return jax.tree.map(
            lambda m, p: FactoredMoments(*(
                None if x is None else place(x, _moment_sharding(sharding, p, x.ndim, drop))
                for x, drop in zip(m, _moment_dropped_dims(m, p), strict=True))),
            tree, params, is_leaf=lambda x: isinstance(x, FactoredMoments))

    rep = sharding.replicated
    return state._replace(
        count=place(state.count, rep),
        groups=groups,
        graft=elementwise(state.graft),
        filtered=elementwise(state.filtered),
        momentum=elementwise(state.momentum),
        graft_momentum=elementwise(state.graft_momentum),
        diagonal=elementwise(state.diagonal),  # eq. (16b)'s V_D: elementwise, as V
        averaged=elementwise(state.averaged),  # eq. (20d)'s Z: the parameters' placement
        gradient_sum=elementwise(state.gradient_sum),  # eq. (6c)'s S: elementwise, as V
        adafactor=moments(state.adafactor),
        lr_power_sum=(None if state.lr_power_sum is None
                      else place(state.lr_power_sum, rep)),  # eq. (20d)'s S_t: a scalar
        root_failures=place(state.root_failures, rep),
        skipped_blocks=place(state.skipped_blocks, rep),
        skipped_per_parameter=(None if state.skipped_per_parameter is None
                               else place(state.skipped_per_parameter, rep)),
        withheld_updates=(None if state.withheld_updates is None
                          else place(state.withheld_updates, rep)),
        momentum_scale=jax.tree.map(lambda x: place(x, rep), state.momentum_scale),
        graft_momentum_scale=jax.tree.map(lambda x: place(x, rep), state.graft_momentum_scale),
        info=None if state.info is None else dataclasses.replace(state.info, slots=slots),
    )


def unshard_state(
    state: ShampooState, like: ShampooState, sharding: ShardingConfig
) -> ShampooState:
    """A state sharded by ``sharding`` -> the single-device layout on the host (NumPy).

    ``like`` is the single-device state or its shapes
    (``jax.eval_shape(shampoo(config).init, params)``); with ``sharding``
    it says which slots hold the real blocks. Padding is dropped, so the
    result does not depend on the device count it came from.
    """
    if len(state.groups) != len(like.groups):
        raise ValueError(
            f"state has {len(state.groups)} block groups; like has {len(like.groups)}: "
            "they must come from the same config and parameter shapes."
        )
    sizes = tuple(int(gs.statistics_updates.shape[0]) for gs in like.groups)
    slots = _slots(sharding, sizes, like.groups)
    groups = []
    for i, (gs, nb, sl) in enumerate(zip(state.groups, sizes, slots, strict=True)):
        have = int(gs.statistics_updates.shape[0])
        if have != sharding.padded(nb):
            raise ValueError(
                f"state.groups[{i}] has {have} blocks; {nb} blocks sharded over "
                f"{sharding.size} devices have {sharding.padded(nb)}: pass the sharding the "
                "state was made with."
            )
        groups.append(jax.tree.map(lambda x, sl=sl: np.asarray(x)[np.asarray(sl, int)], gs))
    host: ShampooState = jax.tree.map(np.asarray, state._replace(groups=()))
    info = None if state.info is None else dataclasses.replace(state.info, slots=None)
    return host._replace(groups=tuple(groups), info=info)


# ---------------------------------------------------------------- update
def sharded_block_step(
    groups: tuple[BlockGroupState, ...],
    inputs: BlockInputs,
    t: Array,
    layout: B.Layout,
    config: ShampooConfig,
    sharding: ShardingConfig,
    lr_ratio: float | Array = 1.0,
) -> tuple[tuple[BlockGroupState, ...], Array, list[Array] | None]:
    """:func:`shampoo_jax.preconditioner.block_step` with each device on its own blocks.

    ``lr_ratio`` (eq. 8b) is replicated: every device takes the same root steps.

    The inputs (global view, ``[nb, ...]`` per group) are padded to the
    state's ``padded(nb)`` blocks and split over the axis; every device runs
    ``block_step`` on its shard; the failure count is summed (``psum``) and
    the preconditioned stacks are gathered (``all_gather``) and unpadded.
    With eq. (10g) each slot's parameter index goes in beside the blocks
    (``BlockInputs.owners``) and the root step's max over a parameter's
    blocks is a ``pmax`` over the axis.
    """
    for i, (grp, gs) in enumerate(zip(layout.groups, groups, strict=True)):
        have, want = int(gs.statistics_updates.shape[0]), sharding.padded(grp.size)
        if have != want:
            raise ValueError(
                f"state.groups[{i}] has {have} blocks; sharding over {sharding.size} devices "
                f"needs {want} ({grp.size} padded): init the state with this transformation "
                "or place it with shampoo_jax.shard_state."
            )
    if not layout.groups:
        return block_step(groups, inputs, t, layout, config, lr_ratio)
    sizes = [sharding.padded(grp.size) for grp in layout.groups]
    slots = _slots(sharding, tuple(grp.size for grp in layout.groups), groups)

    def pad_all(xs: list[Array], fill: float | bool) -> list[Array]:
        # The stacks are made whole (replicated) before they are split: otherwise
        # XLA propagates the block sharding back into the elementwise ops that
        # produce them and splits those into pieces whose vectorized loops round
        # differently (FMA in the vector body, not in the scalar tail), which
        # would break bitwise equality with one device.
        return [
            _spread(lax.with_sharding_constraint(x, sharding.replicated), n, fill, sl)
            for x, n, sl in zip(xs, sizes, slots, strict=True)
        ]

    def pad_optional(xs: list[Array] | None) -> list[Array] | None:
        return None if xs is None else pad_all(xs, 0.0)

    owners = None
    if config.epsilon.cuts_rank_per_parameter:
        # Eq. (10g): a shard cannot tell from the layout whose blocks it holds, so
        # each slot's parameter travels with it (padding: 0, masked by ok anyway).
        owners = [_spread(jnp.asarray(np.asarray([i for i, _ in grp.members], np.int32)),
                          n, 0, sl)
                  for grp, n, sl in zip(layout.groups, sizes, slots, strict=True)]
    padded = BlockInputs(
        grads=pad_all(inputs.grads, 0.0),
        ok=pad_all(inputs.ok, False),  # padded blocks are masked like eq. (3)'s
        filtered=pad_optional(inputs.filtered),
        graft=pad_optional(inputs.graft),
        owners=owners,
    )
    names = sharding.axis_names

    # A traced ratio enters as a replicated operand; a Python one stays static.
    traced = isinstance(lr_ratio, jax.Array)
    ratio_in: Array = lr_ratio if isinstance(lr_ratio, jax.Array) else jnp.zeros(())

    def local(
        groups: tuple[BlockGroupState, ...], inputs: BlockInputs, t: Array, ratio: Array
    ) -> tuple[tuple[BlockGroupState, ...], Array, list[Array] | None]:
        groups, failures, stacks = block_step(
            groups, inputs, t, layout, config, ratio if traced else lr_ratio, names
        )
        failures = lax.psum(failures, names)
        if stacks is not None:
            stacks = [lax.all_gather(s, names, tiled=True, to="invarying") for s in stacks]
        return groups, failures, stacks

    spec, rep = sharding.spec, PartitionSpec()
    groups, failures, stacks = jax.shard_map(
        local, mesh=sharding.mesh, in_specs=(spec, spec, rep, rep), out_specs=(spec, rep, rep)
    )(groups, padded, t, ratio_in)
    if stacks is not None:
        stacks = [s[np.asarray(sl, int)] for s, sl in zip(stacks, slots, strict=True)]
    return groups, failures, stacks


__all__ = [
    "pad_group",
    "shard_state",
    "sharded_block_step",
    "unshard_state",
]
