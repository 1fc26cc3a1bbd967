"""What :class:`~shampoo_torch.Shampoo` keeps besides ``optimizer.state``.

:class:`ParamGroupPlan`: everything fixed about one torch param group (its
config, the parameters' block layouts, the :class:`~shampoo_torch.blocks.BlockGroup`
s holding the Kronecker state, names, dtypes, owners when distributed).

:class:`BlockView`: the public, read-only view of one block's state that
:meth:`Shampoo.blocks() <shampoo_torch.Shampoo.blocks>` yields.

:class:`CheckpointState`: what a checkpoint reads and writes of the optimizer
(:mod:`shampoo_torch.checkpoint`).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from shampoo_spec import EighConfig, ShampooConfig, large_block_warnings, plan_parameter

from .block_grid import BlockGrid, BlockVectors, block_grid
from .blocks import BlockGroup, ParamLayout, build_block_groups
from .device_path import on_cpu_path
from .distributed import Distributor
from .metrics import StepCounters
from .sharding import PieceGather, ShardInfo, planned, shard_info

FACTOR_DTYPES = {"float32": torch.float32, "float64": torch.float64}
#: ``config.root_dtype`` (``inverse_root_dtype`` or ``eigenvectors_dtype``, else
#: ``factor_dtype``) and ``config.corrected_dtype`` (eq. 17a) -> torch dtype.
ROOT_DTYPES = {**FACTOR_DTYPES, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ParamGroupPlan:
    """Everything fixed about one param group: config, layouts, block groups, dtypes, names."""

    config: ShampooConfig
    layouts: list[ParamLayout]
    block_groups: list[BlockGroup]  # distributed: the blocks this rank owns only
    dtypes: list[torch.dtype]  # per parameter: dtype of its elementwise state and directions
    names: list[str]
    factor_dtype: torch.dtype
    #: distributed: the owner (rank in the trainer group) of each (position, block).
    owners: dict[tuple[int, int], int] | None = None
    #: per parameter, its blocks as a grid (eq. 3's per-block reductions).
    grids: list[BlockGrid] = field(default_factory=list)
    #: per parameter, the flat index of its first block: the param group's blocks
    #: (every parameter's, skipped ones included) in order, as eq. (3)'s flags are.
    offsets: list[int] = field(default_factory=list)
    #: per block group, the flat index of each row's block (on the block group's device).
    flat_rows: list[torch.Tensor] = field(default_factory=list)
    #: |B| of every block in flat order (float64, on the first parameter's device).
    block_sizes: torch.Tensor | None = None
    #: per parameter, its FSDP2 / HSDP placement (:mod:`shampoo_torch.sharding`); None: plain.
    shards: list[ShardInfo | None] = field(default_factory=list)
    #: ``shard_mode="local"``: DTensor parameters are planned and stepped on their pieces.
    local_shards: bool = False
    #: ``"lossless"`` with DTensor parameters: gathers their pieces each step.
    pieces: PieceGather | None = None

    @functools.cached_property
    def vectors(self) -> BlockVectors:
        """Per-block vectors kept across steps, with their per-parameter views
        (:class:`~shampoo_torch.block_grid.BlockVectors`)."""
        return BlockVectors(self.grids)

    @property
    def total_blocks(self) -> int:
        return sum(g.num_blocks for g in self.grids)

    def planned(self, j: int, p: torch.Tensor) -> torch.Tensor:
        """Parameter j as the plan sees it: itself, or under FSDP2 its whole value
        (``"lossless"``, an all-gather over the shard group) or this rank's piece
        (``"local"``)."""
        return planned(p, self.shards[j] if self.shards else None, self.local_shards)

    def held_rows(self) -> dict[tuple[int, int], tuple[BlockGroup, int]]:
        """(position, block) -> (its block group, row) for every block held here."""
        return {member: (bg, row) for bg in self.block_groups
                for row, member in enumerate(bg.members)}

    def block_states(self) -> list[list[dict[str, Any] | None]]:
        """Per parameter, per block (eq. 5): the live state of the block, None if not held.

        Views into its block group (:meth:`BlockGroup.row_state`): copying
        into them writes the state. A parameter that is not preconditioned
        has no blocks.
        """
        held = self.held_rows()
        out: list[list[dict[str, Any] | None]] = []
        for pos, lay in enumerate(self.layouts):
            rows = [held.get((pos, b)) for b in range(lay.num_blocks)]
            out.append([None if r is None else r[0].row_state(r[1]) for r in rows])
        return out

    def store_block_states(self, states: Sequence[Sequence[Mapping[str, Any]]]) -> None:
        """Write back the packed matrices of :meth:`block_states` (``states``, copied into;
        an empty entry: a block not held here), :meth:`BlockGroup.store_row_state`."""
        held = self.held_rows()
        for pos, per_param in enumerate(states):
            for b, state in enumerate(per_param):
                if state:
                    bg, row = held[(pos, b)]
                    bg.store_row_state(row, state)


def build_param_group_plan(
    gi: int, group: dict[str, Any], dist: Distributor | None, first_device: torch.device | None,
    shard_mode: str | None = None,
) -> ParamGroupPlan:
    """Plan param group ``gi`` (eqs. 4-5, 12) and allocate its block state (eqs. 6, 13).

    Distributed, the blocks are assigned to owners (continuing the balance
    of the earlier groups) and only this rank's get block-group rows; every
    parameter must be on ``first_device`` (one device per rank). DTensor
    parameters need a ``shard_mode`` (:mod:`shampoo_torch.sharding`):
    ``"lossless"`` plans their whole shape, ``"local"`` this rank's piece.
    """
    cfg: ShampooConfig = group["config"]
    params: list[torch.Tensor] = group["params"]
    fdt = FACTOR_DTYPES[cfg.factor_dtype]
    if cfg.diagonal is not None or cfg.spectral is not None:
        # Eqs. (16b), (16c) have no factors: their block directions stay in the
        # parameters' precision (factor_dtype has no effect; float32 at least).
        fdt = functools.reduce(torch.promote_types, (p.dtype for p in params), torch.float32)
    names = group.get("param_names") or [
        f"param_groups[{gi}]['params'][{i}] (shape {tuple(p.shape)})"
        for i, p in enumerate(params)
    ]
    for name, p in zip(names, params, strict=True):
        if not p.is_floating_point():
            raise ValueError(
                f"parameter {name!r} has dtype {p.dtype}: allowed a floating-point parameter "
                "(torch.float16, torch.bfloat16, torch.float32 or torch.float64)."
            )
    shards = [shard_info(p, name) for name, p in zip(names, params, strict=True)]
    local = shard_mode == "local"
    for name, info in zip(names, shards, strict=True):
        if info is not None and shard_mode is None:
            raise ValueError(
                f"parameter {name!r} is a DTensor (FSDP2 fully_shard / HSDP): allowed with "
                "Shampoo(distributed=DistributedConfig(shard_mode='lossless' or 'local')), "
                "or a plain tensor."
            )
        if dist is not None:
            dist.adopt(None if info is None else info.mesh, name)
    plans = [
        plan_parameter(info.local_shape if local and info is not None else tuple(p.shape), cfg)
        for p, info in zip(params, shards, strict=True)
    ]
    for name, plan in zip(names, plans, strict=True):
        for message in large_block_warnings(name, plan):  # before allocating the factors
            warnings.warn(message, stacklevel=4)
    owners = None
    owned: Callable[[int, int], bool] | None = None
    if dist is not None:
        first = params[0].device if first_device is None else first_device
        for p in params:
            if p.device != first:
                raise ValueError(
                    f"parameter device {p.device} is invalid with distributed Shampoo: "
                    f"allowed one device per rank ({first})."
                )
        owners = dist.assign(plans, cfg)
        rank, table = dist.rank, owners

        def owned(pos: int, b: int) -> bool:
            return table[(pos, b)] == rank

    layouts, block_groups = build_block_groups(
        plans, [p.device for p in params], fdt, owned, ROOT_DTYPES[cfg.root_dtype],
        ROOT_DTYPES[cfg.corrected_dtype],
        None if cfg.factor_storage_dtype is None else ROOT_DTYPES[cfg.factor_storage_dtype],
    )
    init_scale = cfg.initial_factor_scale
    if cfg.statistics.quantized:  # eq. (20c): c I stored, read back as fl_d(c) I
        init_scale = float(torch.tensor(init_scale, dtype=getattr(
            torch, cfg.statistics.scale_dtype)))
    packs = not cfg.statistics.quantized and on_cpu_path(
        params[0].device if params else torch.device("cpu"))
    for bg in block_groups:
        bg.allocate(init_scale, cfg.eigenvalue_correction is not None,
                    None if cfg.low_rank is None else cfg.low_rank.compresses,
                    cfg.frequent_directions, cfg.root_inverse_stores_basis,
                    # Eq. (20c) rounds each entry on its own scale, and a Newton root
                    # (eq. 11) is symmetric only as far as its iteration converged: both
                    # stay whole. An eigh root (Q diag(x) Q^T) is symmetric to round-off.
                    # On the accelerator path both stay whole: packing and unpacking
                    # are launches, and the device has the memory (device_path).
                    packed=packs,
                    packed_roots=packs and isinstance(cfg.root_inverse, EighConfig))
    dtypes = [torch.promote_types(p.dtype, fdt) for p in params]
    grids = [block_grid(plan, p.device) for plan, p in zip(plans, params, strict=True)]
    offsets = [0]
    for grid in grids:
        offsets.append(offsets[-1] + grid.num_blocks)
    flat_rows = [
        torch.tensor([offsets[pos] + b for pos, b in bg.members], dtype=torch.int64,
                     device=bg.device)
        for bg in block_groups
    ]
    sizes = torch.tensor([float(math.prod(b.shape)) for plan in plans for b in plan.blocks],
                         dtype=torch.float64)
    device = params[0].device if params else torch.device("cpu")
    return ParamGroupPlan(cfg, layouts, block_groups, dtypes, list(names), fdt, owners,
                          grids, offsets[:-1], flat_rows, sizes.to(device), shards, local,
                          PieceGather() if any(shards) and not local else None)


@dataclass(frozen=True)
class BlockView:
    """One block of a preconditioned parameter, read-only (:meth:`Shampoo.blocks`).

    Attributes:
        param_group: index of the parameter's group in ``optimizer.param_groups``.
        parameter: position of the parameter in that group's ``"params"``.
        name: the parameter's name (as in errors and distributed checkpoints).
        block: the block's index in the row-major order of
            ``shampoo_spec.plan_parameter`` (eq. 5).
        shape: the block's shape, a piece of the parameter's merged shape (eq. 4).
        roots: the exponent r_k of each block dim (eq. 12); 0 means dim k is
            not preconditioned.
        owner: distributed, the rank (in the trainer group) that holds the
            block's state; None in one process.
        factors: per block dim k, the statistics ``L_k`` (eq. 6), or None where
            ``r_k = 0``; the field is None when another rank holds the block.
        inverse_roots: per block dim k, ``X_k = (L_k / bc + eps)^(-1/r_k)``
            (eqs. 7-11; the identity before the first root step, eq. 13), or
            with eigenvalue correction the eigenbasis ``Q_k`` (eq. 17); None
            like ``factors``.
        statistics_updates: n of eq. (7), the statistics updates so far.
        consecutive_failures: root steps in a row on which some factor's
            inverse root failed (eq. 13).
        corrected: with eigenvalue correction, the second moment D in the
            eigenbasis (eq. 17, the block's shape); else None.
        corrected_updates: with eigenvalue correction, the updates of D.
        sketches: with ``frequent_directions``, per block dim k its sketch
            ``(U, lambda, rho)`` (eq. 10d; ``factors[k]`` then holds the last
            observation C_k, eq. 6c), or None where dim k is not sketched;
            None without sketches or when another rank holds the block.
        eigenbases: with ``config.root_inverse_stores_basis``, per block dim k
            the eigenbasis Q_k its next root starts from (eqs. 10f, 10h), or None
            where ``r_k = 0``; None otherwise or when another rank holds the block.

    The counters are None when another rank holds the block. The tensors
    are on the optimizer's device, in ``factor_dtype`` (the inverse roots in
    ``config.root_dtype``, eq. 11a); factors and inverse roots stored as one
    triangle (:mod:`shampoo_torch.packed`) are full copies, the rest the
    optimizer's own tensors (no copy): do not modify them, and ``clone()``
    what you keep past the next ``step()``, which may replace or overwrite
    them.
    """

    param_group: int
    parameter: int
    name: str
    block: int
    shape: tuple[int, ...]
    roots: tuple[float, ...]
    owner: int | None
    factors: tuple[torch.Tensor | None, ...] | None
    inverse_roots: tuple[torch.Tensor | None, ...] | None
    statistics_updates: int | None
    consecutive_failures: int | None
    corrected: torch.Tensor | None = None
    corrected_updates: int | None = None
    sketches: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, ...] | None = None
    eigenbases: tuple[torch.Tensor | None, ...] | None = None

    @property
    def held(self) -> bool:
        """Whether this process holds the block's state (always, in one process)."""
        return self.factors is not None


def block_views(plans: Sequence[ParamGroupPlan]) -> Iterator[BlockView]:
    """The :class:`BlockView` of every block of every preconditioned parameter, in order."""
    for gi, gp in enumerate(plans):
        held = gp.held_rows()
        for pos, lay in enumerate(gp.layouts):
            for b in range(lay.num_blocks):
                block = lay.plan.blocks[b]
                owner = None if gp.owners is None else gp.owners[(pos, b)]
                where = held.get((pos, b))
                view = BlockView(
                    param_group=gi, parameter=pos, name=gp.names[pos], block=b,
                    shape=tuple(block.shape), roots=tuple(block.roots), owner=owner,
                    factors=None, inverse_roots=None, statistics_updates=None,
                    consecutive_failures=None,
                )
                if where is not None:
                    view = _held_view(view, *where)
                yield view


def _held_view(view: BlockView, bg: BlockGroup, row: int) -> BlockView:
    st = bg.row_state(row)

    def per_dim(d: dict[int, torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        return tuple(d.get(k) for k in range(len(bg.shape)))

    corrected_updates = st.get("corrected_updates")
    sketches = None
    if bg.sketches:
        held = {k: (s.u[row], s.lam[row], s.rho[row]) for k, s in bg.sketches.items()}
        sketches = tuple(held.get(k) for k in range(len(bg.shape)))
    return replace(
        view, factors=per_dim(st["factors"]), inverse_roots=per_dim(st["inverse_roots"]),
        sketches=sketches,
        eigenbases=per_dim(st["eigenbases"]) if "eigenbases" in st else None,
        statistics_updates=int(st["statistics_updates"]),
        consecutive_failures=int(st["consecutive_failures"]), corrected=st.get("corrected"),
        corrected_updates=None if corrected_updates is None else int(corrected_updates),
    )


@dataclass(frozen=True)
class CheckpointState:
    """What :mod:`shampoo_torch.checkpoint` reads and writes of a
    :class:`~shampoo_torch.Shampoo` (its
    :class:`~shampoo_torch.checkpoint.CheckpointTarget`): the optimizer's param groups
    and state, its plans' block states, its counters and its trainer group."""

    param_groups: list[dict[str, Any]]
    state: Mapping[torch.Tensor, dict[str, Any]]
    plans: Sequence[ParamGroupPlan]
    counters: StepCounters
    distributor: Distributor | None

    @property
    def metrics(self) -> dict[str, int]:
        return self.counters.read()

    def block_states(self) -> list[list[list[dict[str, Any] | None]]]:
        """Per param group :meth:`ParamGroupPlan.block_states`: live views (packed matrices
        as copies, written back by :meth:`store_block_states`), None if not held."""
        return [gp.block_states() for gp in self.plans]

    def store_block_states(self, blocks: Sequence[Sequence[Sequence[Mapping[str, Any]]]]
                           ) -> None:
        """Write back the packed matrices of :meth:`block_states`' block states
        (after a copy into them; an empty entry is another rank's block)."""
        for gp, per_group in zip(self.plans, blocks, strict=True):
            gp.store_block_states(per_group)

    def parameter_names(self) -> list[list[str]]:
        """The parameters' names per param group (the keys of a distributed checkpoint)."""
        return [list(gp.names) for gp in self.plans]

    @property
    def gathers(self) -> bool:
        """Whether the blocks are spread over a trainer group (gathered on saving)."""
        return self.distributor is not None

    def gather(self, obj: object) -> list[object]:
        """``obj`` of every rank of the trainer group (``[obj]`` in one process)."""
        return [obj] if self.distributor is None else self.distributor.all_gather_object(obj)

    def piece(self, gi: int, pos: int) -> ShardInfo | None:
        """``shard_mode="local"``: the placement of a sharded parameter, whose state belongs
        to this rank's piece; else None."""
        gp = self.plans[gi]
        info = gp.shards[pos] if gp.local_shards and gp.shards else None
        return info if info is not None and info.sharded else None

    def gather_pieces(self, obj: object) -> list[object]:
        """``obj`` of every rank of the shard group (``shard_mode="local"``), in the order of
        the shard group's ranks."""
        info = next(i for gi, group in enumerate(self.param_groups)
                    for pos in range(len(group["params"]))
                    if (i := self.piece(gi, pos)) is not None)
        group = info.mesh.get_group(info.mesh.ndim - 1)
        out: list[object] = [None] * info.parts
        torch.distributed.all_gather_object(out, obj, group=group)
        return out

    def restore_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Set the counters to saved counts; the saved ``root_failures`` (a sum over the
        ranks of a trainer group) to rank 0's alone (:meth:`StepCounters.restore`)."""
        first = self.param_groups[0]["params"] if self.param_groups else []
        self.counters.restore(metrics, first[0].device if first else None,
                              self.distributor is None or self.distributor.rank == 0)
