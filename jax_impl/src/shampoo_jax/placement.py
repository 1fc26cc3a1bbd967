"""Where the block state lives on a mesh: :class:`ShardingConfig` and the static placement.

``ShardingConfig(mesh, axis)`` names the mesh axis (or axes) the stacked block
state is split over (:mod:`shampoo_jax.sharded` pads, places and steps it).
:func:`placement` decides, once per layout (static, cached), which slot of
each padded block group stack holds which real block: device d owns slots
``[d c, (d + 1) c)``, and the real blocks are put into slots largest root
cost (sum of ``n^3``) first, each on the device with the least root work so
far that has a free slot in its block group. :func:`real_blocks` picks the
real blocks' entries back out of a padded stack (eq. 3's refusal reads the
state's maxima through it).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from jax import Array
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import blocks as B
from .state import BlockGroupState


@dataclass(frozen=True)
class ShardingConfig:
    """Where the block state lives: ``mesh`` and the mesh ``axis`` (or axes) of the blocks."""

    mesh: Mesh
    axis: str | tuple[str, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise ValueError(
                f"ShardingConfig.mesh = {self.mesh!r} is invalid: allowed a jax.sharding.Mesh."
            )
        names = (self.axis,) if isinstance(self.axis, str) else self.axis
        if (
            not isinstance(names, tuple)
            or not names
            or not all(isinstance(a, str) for a in names)
            or len(set(names)) != len(names)
        ):
            raise ValueError(
                f"ShardingConfig.axis = {self.axis!r} is invalid: allowed a mesh axis name or "
                f"a non-empty tuple of distinct names from {tuple(self.mesh.axis_names)}."
            )
        for a in names:
            if a not in self.mesh.axis_names:
                raise ValueError(
                    f"ShardingConfig.axis = {self.axis!r} is invalid: {a!r} is not an axis of "
                    f"the mesh; allowed {tuple(self.mesh.axis_names)}."
                )

    @property
    def axis_names(self) -> tuple[str, ...]:
        return (self.axis,) if isinstance(self.axis, str) else self.axis

    @property
    def size(self) -> int:
        """N: the number of shards of the block axis."""
        return math.prod(int(self.mesh.shape[a]) for a in self.axis_names)

    def padded(self, num_blocks: int) -> int:
        """``num_blocks`` rounded up to a multiple of N (at least N)."""
        return max(1, -(-num_blocks // self.size)) * self.size

    @property
    def spec(self) -> PartitionSpec:
        names = self.axis_names
        return PartitionSpec(names[0] if len(names) == 1 else names)

    @property
    def blocks(self) -> NamedSharding:
        """The sharding of every stacked block-state array."""
        return NamedSharding(self.mesh, self.spec)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())


# ------------------------------------------------------------- placement
@functools.lru_cache(maxsize=256)
def placement(
    sizes: tuple[int, ...], costs: tuple[float, ...], devices: int
) -> tuple[tuple[int, ...], ...]:
    """Per block group, the slot of each real block in its padded stack (static, cached).

    ``sizes[g]`` blocks of root cost ``costs[g]`` (sum of ``n^3`` over the
    group's factors) per block group; a block group is padded to ``c * devices`` slots
    and device d owns slots ``[d c, (d + 1) c)``. Largest cost first, each
    block goes to the device with the least work so far (ties: the lowest
    index) that has a free slot in its group: the longest-processing-time
    rule, within the per-group capacity c.
    """
    load = [0.0] * devices
    used = [[0] * devices for _ in sizes]
    slots = [[0] * nb for nb in sizes]
    blocks = sorted(
        ((costs[g], g, j) for g, nb in enumerate(sizes) for j in range(nb)),
        key=lambda b: (-b[0], b[1], b[2]),
    )
    for cost, g, j in blocks:
        per = -(-sizes[g] // devices)
        d = min((d for d in range(devices) if used[g][d] < per), key=lambda d: (load[d], d))
        slots[g][j] = d * per + used[g][d]
        used[g][d] += 1
        load[d] += cost
    return tuple(tuple(s) for s in slots)


def group_costs(groups: tuple[BlockGroupState, ...]) -> tuple[float, ...]:
    """Root cost of one block of each block group: the sum of ``n^3`` over its factors."""
    return tuple(float(sum(int(f.shape[-1]) ** 3 for f in gs.factors)) for gs in groups)


def _slots(sharding: ShardingConfig, sizes: tuple[int, ...],
           groups: tuple[BlockGroupState, ...]) -> tuple[tuple[int, ...], ...]:
    return placement(sizes, group_costs(groups), sharding.size)


def real_blocks(
    per_slot: list[Array | None],
    layout: B.Layout,
    groups: tuple[BlockGroupState, ...],
    sharding: ShardingConfig,
) -> list[Array | None]:
    """Per block group, the entries of a padded, sharded ``[padded nb, ...]`` stack that
    belong to the real blocks, in the layout's order (``[nb, ...]``, global view; None
    stays None)."""
    slots = _slots(sharding, tuple(grp.size for grp in layout.groups), groups)
    return [None if x is None else x[np.asarray(sl, int)]
            for x, sl in zip(per_slot, slots, strict=True)]


__all__ = ["ShardingConfig", "group_costs", "placement", "real_blocks"]
