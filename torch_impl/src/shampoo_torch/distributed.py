"""Data-parallel Shampoo on ``torch.distributed``: blocks owned by ranks (arXiv 2309.06497).

Every rank plans the same blocks (eqs. 4-5). :func:`shampoo_spec.assign_blocks`
gives each block an *owner*, balancing per-step work, root work and factor
memory (:func:`shampoo_spec.block_cost`), the same on every rank without
communication. Per step:

1. every rank decides which blocks' steps eq. (3) refuses (a non-finite
   gradient, or one that could overflow the block's state) from its
   gradients and the state it holds, and one all-reduce (max) of these flags
   over the whole process group makes one decision for all ranks: under
   ``"raise"`` all ranks raise the same
   :class:`~shampoo_torch.NonFiniteGradientError` before any state changes,
   under ``"skip_block"`` all ranks (and replicas) skip the same blocks and
   count them alike, so replicas never diverge even when a gradient is bad on
   one rank only;
2. every rank updates the elementwise state (graft, filter; eqs. 14-15), which
   is replicated: it is cheap, and the per-parameter graft rescale (eq. 18)
   needs whole parameters;
3. the owner of a block alone updates its factors (eq. 6), inverse roots (eqs. 7-13),
   corrected moment (eq. 17) and computes its direction (eqs. 16-17) with the
   per-block graft rescale (eq. 18, ``norm_scope="block"``, which needs only
   the block) in exactly the batched order of the single-process optimizer;
4. one all-gather (:class:`DirectionExchange`) of every block's direction into
   a preallocated flat buffer, each rank's segment padded to equal length, in
   ``communication_dtype``; every rank, the owner included, reads the
   gathered (possibly rounded) values, so all ranks stay identical;
5. every rank assembles the parameters' directions, applies the
   per-parameter graft rescale (eq. 18), momentum and the update (eqs. 19-21).

Factor state exists only for owned blocks, so optimizer memory per rank
shrinks with the world size. With ``trainers_per_group = k`` the world is cut
into groups of ``k`` consecutive ranks: blocks are distributed within a group
and the computation is replicated across groups (for large jobs where one
all-gather over every rank would cost more than the root work it saves).

Equality with one process: with float32/float64 communication (at least the
factor dtype) every parameter equals the single-process :class:`Shampoo` bit
for bit (tested at world sizes 1, 2, 3 on CPU with one thread per process).
What makes it hold on CPU: a block's result must not depend on which other
blocks share its batch. Matmuls, ``eigh`` and row reductions are computed
per batch row; but elementwise CPU kernels vectorize all but a tail of each
call and ``pow``'s vectorized and scalar code differ in the last bit, so the
optimizer computes inverse roots (eqs. 9-11) one block per call on CPU and uses
:func:`shampoo_torch.invariance.rowwise` for the other ``pow`` s.

Assumptions: every rank steps the same parameters (the same ``grad is
None`` pattern, as under DistributedDataParallel, whose averaged gradients
are identical on every rank). FSDP2 (``fully_shard``) and HSDP parameters
(DTensors) are described in :mod:`shampoo_torch.sharding`: in the default
``shard_mode="lossless"`` the trainer group is the mesh's shard group and
the steps above run on the gathered whole parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from shampoo_spec import ParameterPlan, ShampooConfig, assign_blocks, plan_block_costs

from .sharding import SHARD_MODES

_COMM_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

BlockKey = tuple[int, int, int]  # (param group index, parameter position, block index)


def _fail(field: str, value: object, allowed: str) -> None:
    raise ValueError(f"DistributedConfig.{field} = {value!r} is invalid: allowed {allowed}.")


@dataclass(frozen=True)
class DistributedConfig:
    """How :class:`~shampoo_torch.Shampoo` spreads its block work over ranks.

    Not part of :class:`shampoo_spec.ShampooConfig`: distribution changes where
    the work runs, not the numerics (with lossless communication).

    Attributes:
        process_group: the ranks taking part; None is the default (WORLD) group.
        communication_dtype: dtype of the all-gathered directions: "float32",
            "float64", "bfloat16" or "float16"; None (default) is the widest
            factor dtype of the param groups, which is lossless. A narrower
            dtype rounds every direction once (on every rank alike).
        trainers_per_group: ranks per group that shares the block work (a
            divisor of the world size); None is the whole process group.
        shard_mode: for FSDP2 / HSDP (DTensor) parameters
            (:mod:`shampoo_torch.sharding`): ``"lossless"`` (default) plans
            the whole parameters and equals one process bit for bit; the
            shard group of the parameters' mesh shares the block work (so
            ``process_group`` and ``trainers_per_group`` must stay None).
            ``"local"`` steps each rank's piece as a parameter of its own,
            without optimizer communication (the other fields must stay None).
    """

    process_group: Any = None
    communication_dtype: str | None = None
    trainers_per_group: int | None = None
    shard_mode: str = "lossless"

    def __post_init__(self) -> None:
        pg = self.process_group
        if pg is not None and not isinstance(pg, dist.ProcessGroup):
            _fail("process_group", pg, "a torch.distributed.ProcessGroup or None (WORLD)")
        dt = self.communication_dtype
        if dt is not None and dt not in _COMM_DTYPES:
            _fail("communication_dtype", dt,
                  "one of " + ", ".join(repr(k) for k in _COMM_DTYPES) + ", or None")
        k = self.trainers_per_group
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            _fail("trainers_per_group", k, "an integer >= 1, or None (the whole group)")
        mode = self.shard_mode
        if not isinstance(mode, str) or mode not in SHARD_MODES:
            _fail("shard_mode", mode, " or ".join(repr(m) for m in SHARD_MODES))
        if mode == "local":
            for name in ("process_group", "communication_dtype", "trainers_per_group"):
                value = getattr(self, name)
                if value is not None:
                    _fail(name, value, "None with shard_mode='local' (no optimizer "
                          "communication: each rank steps its own pieces)")


class Distributor:
    """The runtime side of a :class:`DistributedConfig`: groups, owners, collectives."""

    def __init__(self, config: DistributedConfig) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "Shampoo(distributed=...) needs torch.distributed to be initialized: call "
                "torch.distributed.init_process_group first."
            )
        self.config = config
        # WORLD is typed Optional (it is None before init_process_group, checked above).
        self.group = cast(dist.ProcessGroup, config.process_group or dist.group.WORLD)
        full_world = dist.get_world_size(self.group)
        full_rank = dist.get_rank(self.group)
        k = config.trainers_per_group or full_world
        if full_world % k != 0:
            _fail("trainers_per_group", k, f"a divisor of the world size {full_world}")
        self.full_world, self.full_rank = full_world, full_rank
        self.world, self.rank = k, full_rank % k
        self.comm_group = self.group
        if k != full_world:
            # Every rank must create every subgroup, in the same order.
            for start in range(0, full_world, k):
                ranks = [self._global_rank(r) for r in range(start, start + k)]
                pg = dist.new_group(ranks)
                if start <= full_rank < start + k:
                    self.comm_group = pg
        self.loads: list[list[float]] = [[0.0, 0.0, 0.0] for _ in range(k)]
        self.comm_dtype = (
            None if config.communication_dtype is None
            else _COMM_DTYPES[config.communication_dtype]
        )
        self.exchange = DirectionExchange(self)
        #: "plain" once plain tensors were planned, else the adopted DTensor mesh.
        self.kind: object = None

    def adopt(self, mesh: Any | None, name: str) -> None:
        """Take the trainer group from a DTensor parameter's mesh (None: a plain tensor).

        Lossless FSDP2 / HSDP: the blocks are shared within the mesh's last
        (shard) dim and replicated over its first (replica) dim; eq. (3) is
        still agreed over the whole world. Every parameter of the optimizer
        must be on that one mesh, or every one a plain tensor.
        """
        kind = "plain" if mesh is None else mesh
        if self.kind is not None:
            if self.kind is not kind and self.kind != kind:
                raise ValueError(
                    f"parameter {name!r} is on {'no mesh' if mesh is None else mesh}, the "
                    f"earlier parameters on {self.kind}: allowed with distributed Shampoo "
                    "either plain tensors only or DTensors of one device mesh only."
                )
            return
        self.kind = kind
        if mesh is None:
            return
        for field_name in ("process_group", "trainers_per_group"):
            value = getattr(self.config, field_name)
            if value is not None:
                _fail(field_name, value, "None with FSDP2 / HSDP (DTensor) parameters: "
                      "the mesh's shard group shares the block work")
        world = dist.get_world_size()
        if mesh.size() != world:
            raise ValueError(
                f"parameter {name!r} is on a mesh of {mesh.size()} ranks, the world has "
                f"{world}: allowed a mesh over every rank."
            )
        dim = mesh.ndim - 1
        self.group = cast(dist.ProcessGroup, dist.group.WORLD)
        self.full_world, self.full_rank = world, dist.get_rank()
        self.comm_group = mesh.get_group(dim)
        self.world, self.rank = mesh.size(dim), mesh.get_local_rank(dim)
        self.loads = [[0.0, 0.0, 0.0] for _ in range(self.world)]
        self.exchange = DirectionExchange(self)

    def _global_rank(self, group_rank: int) -> int:
        if self.group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def assign(
        self, plans: Sequence[ParameterPlan], config: ShampooConfig
    ) -> dict[tuple[int, int], int]:
        """Owner (rank within the trainer group) of every block of a param group.

        The assignment continues from the loads of the earlier param
        groups, so the balance holds over all of them.
        """
        costs = plan_block_costs(plans, config)
        result = assign_blocks([c.vector() for c in costs], self.world, self.loads)
        self.loads = [list(v) for v in result.loads]
        keys = [(pos, b) for pos, p in enumerate(plans) if p.preconditioned
                for b in range(len(p.blocks))]
        return dict(zip(keys, result.owners, strict=True))

    # ----------------------------------------------------------- agreement
    def agree_max(self, flags: torch.Tensor) -> None:
        """In place: the entrywise max of ``flags`` over the whole process group.

        Eq. (3): every rank of every trainer group refuses the same blocks.
        An all-reduce on the device (no host sync with NCCL).
        """
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)

    def max_over_trainers(self, values: torch.Tensor) -> None:
        """In place: the entrywise max of ``values`` over the trainer group (the ranks
        that own a parameter's blocks between them; replicas hold the same values).

        Eq. (10g): Lambda_k of every (parameter, dim) of a root step, one all-reduce.
        """
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.comm_group)

    def first_flagged(
        self, local: tuple[int, ...] | None, width: int, device: torch.device, whole_world: bool
    ) -> tuple[int, tuple[int, ...]] | None:
        """All-reduce of per-rank flags: the lowest rank's entry and that rank, or None.

        ``local`` is this rank's entry (``width`` ints) or None; every rank
        gets the same answer (one all-reduce over the process group, or over
        the trainer group when ``whole_world`` is False).
        """
        group = self.group if whole_world else self.comm_group
        world = self.full_world if whole_world else self.world
        rank = self.full_rank if whole_world else self.rank
        table = torch.zeros((world, width + 1), dtype=torch.int64, device=device)
        if local is not None:
            table[rank, 0] = 1
            table[rank, 1:] = torch.tensor(local, dtype=torch.int64)
        dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
        rows = table.cpu().tolist()
        for r, row in enumerate(rows):
            if row[0]:
                return r, tuple(int(x) for x in row[1:])
        return None

    # ------------------------------------------------------- directions
    def exchange_directions(
        self,
        parts: Sequence[
            tuple[int, Mapping[int, ParameterPlan], Mapping[tuple[int, int], int], torch.dtype]
        ],
        mine: dict[BlockKey, torch.Tensor],
        device: torch.device,
    ) -> dict[BlockKey, torch.Tensor]:
        """Step 4 of the module doc: every block's direction on every rank.

        ``parts``: per cohort taking part, ``(param group index, plan of each
        parameter stepping by position, owner of each (position, block),
        factor dtype)``, the same on every rank; ``mine``: the directions of
        the blocks this rank owns. The result is in each group's factor dtype.
        """
        order: list[tuple[BlockKey, torch.Size, int]] = []
        dtypes, out_dtypes = [], {}
        for gi, plans, owners, factor_dtype in parts:
            out_dtypes[gi] = factor_dtype
            for pos, plan in plans.items():
                if not plan.preconditioned:
                    continue
                dtypes.append(factor_dtype)
                for b, block in enumerate(plan.blocks):
                    order.append(((gi, pos, b), torch.Size(block.shape), owners[(pos, b)]))
        if not order:
            return mine
        dtype = self.comm_dtype
        if dtype is None:
            dtype = torch.float64 if torch.float64 in dtypes else torch.float32
        return self.exchange.run(order, mine, dtype, device, lambda key: out_dtypes[key[0]])

    # ------------------------------------------------------- checkpoints
    def all_gather_object(self, obj: object) -> list[object]:
        """Objects of every rank of the trainer group (checkpoints only)."""
        out: list[object] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.comm_group)
        return out


@dataclass(frozen=True)
class _Slot:
    key: BlockKey
    shape: torch.Size
    offset: int  # within its owner's segment
    owner: int


@dataclass
class _Layout:
    slots: list[_Slot]
    mine: list[_Slot]
    segment: int
    send: torch.Tensor
    recv: torch.Tensor

    @property
    def bytes_per_step(self) -> int:
        """Bytes every rank receives from the all-gather (its own segment included)."""
        return self.recv.numel() * self.recv.element_size()


class DirectionExchange:
    """One all-gather per step of every block's direction (step 4 of the module doc).

    The layout (which block sits where in the flat buffer) is a function of
    the blocks taking part and their owners, the same on every rank; the
    buffers are allocated once per layout and reused.
    """

    def __init__(self, distributor: Distributor) -> None:
        self.distributor = distributor
        self._layout: tuple[object, _Layout] | None = None
        self.last_bytes = 0

    def _build(
        self,
        blocks: list[tuple[BlockKey, torch.Size, int]],
        dtype: torch.dtype,
        device: torch.device,
    ) -> _Layout:
        world = self.distributor.world
        fill = [0] * world
        slots = []
        for key, shape, owner in blocks:
            slots.append(_Slot(key, shape, fill[owner], owner))
            fill[owner] += shape.numel()
        segment = max(max(fill), 1)
        send = torch.zeros(segment, dtype=dtype, device=device)
        recv = torch.zeros(world * segment, dtype=dtype, device=device)
        mine = [s for s in slots if s.owner == self.distributor.rank]
        return _Layout(slots, mine, segment, send, recv)

    def layout_for(
        self,
        blocks: list[tuple[BlockKey, torch.Size, int]],
        dtype: torch.dtype,
        device: torch.device,
    ) -> _Layout:
        signature = (tuple((k, tuple(s), o) for k, s, o in blocks), dtype, device)
        if self._layout is None or self._layout[0] != signature:
            self._layout = (signature, self._build(blocks, dtype, device))
        return self._layout[1]

    def run(
        self,
        blocks: list[tuple[BlockKey, torch.Size, int]],
        owned: dict[BlockKey, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        out_dtype: Callable[[BlockKey], torch.dtype],
    ) -> dict[BlockKey, torch.Tensor]:
        """Every block's direction on every rank; ``owned`` holds this rank's blocks."""
        layout = self.layout_for(blocks, dtype, device)
        for slot in layout.mine:
            layout.send[slot.offset:slot.offset + slot.shape.numel()].copy_(
                owned[slot.key].reshape(-1)
            )
        _all_gather_flat(layout.recv, layout.send, self.distributor.comm_group)
        self.last_bytes = layout.bytes_per_step
        out = {}
        for slot in layout.slots:
            start = slot.owner * layout.segment + slot.offset
            flat = layout.recv[start:start + slot.shape.numel()]
            out[slot.key] = flat.view(slot.shape).to(out_dtype(slot.key))
        return out


def _all_gather_flat(recv: torch.Tensor, send: torch.Tensor, group: Any) -> None:
    """``recv = concat over ranks of send``: one collective into the flat buffer."""
    gather_single = getattr(dist, "all_gather_single", None)  # torch >= 2.13
    if gather_single is not None:
        gather_single(recv, send, group=group)
        return
    try:
        dist.all_gather_into_tensor(recv, send, group=group)
    except (RuntimeError, NotImplementedError):  # a backend without the flat collective
        dist.all_gather(list(recv.chunk(recv.numel() // send.numel())), send, group=group)
