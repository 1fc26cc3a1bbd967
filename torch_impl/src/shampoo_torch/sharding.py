"""FSDP2 (``fully_shard``) and HSDP parameters: DTensors sharded along dim 0.

A parameter of a ``fully_shard`` model is a DTensor on a device mesh: 1-D
(``[Shard(0)]``, FSDP) or 2-D (``[Replicate(), Shard(0)]``, HSDP: replica
groups on the outer mesh dim, the shard group on the inner one). Each rank
holds ``torch.chunk(full, S, dim=0)[i]`` (S ranks in the shard group, i its
coordinate; trailing ranks hold an empty piece when dim 0 has fewer than S
chunks). A parameter FSDP2 cannot shard (0-d) may be a DTensor replicated on
the same mesh (``[Replicate()]`` / ``[Replicate(), Replicate()]``).

:class:`~shampoo_torch.DistributedConfig` ``shard_mode`` chooses how
:class:`~shampoo_torch.Shampoo` treats them:

``"lossless"``: the plan is that of the whole parameter (eqs. 4-5), as in one
process. Per step every rank all-gathers the parameters and their gradients
over the shard group (:class:`PieceGather`: one collective per param group
and dtype; exact copies), the blocks are owned and exchanged exactly as for
DistributedDataParallel (:mod:`shampoo_torch.distributed`, the shard group
being the trainer group), the elementwise state is kept whole and updated
alike on every rank, and each rank writes its own piece of the new
parameter (:func:`local_piece`). Every value equals the single-process run
bit for bit (CPU, one thread per process).

``"local"``: each rank steps its own piece as if it were the whole parameter
(the plan of the piece's shape; Meta's ``FullyShardDistributor``), with no
optimizer communication but one: under ``failure.nonfinite_gradient="raise"``
one all-reduce of one flag per step, so every rank raises when any rank's
pieces hold a refused gradient (eq. 3 is decided per rank on its pieces),
and likewise on root steps with ``failure.max_consecutive_root_failures``
(eq. 13); empty pieces take no step. What spans a whole parameter then spans
the piece: eq. (14d)'s clip, eq. (18)'s per-parameter norms, and eq. (14e)'s
Adafactor moments and rms(W).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SHARD_MODES = ("lossless", "local")


def is_dtensor(p: torch.Tensor) -> bool:
    """True for FSDP2 (``fully_shard``) / DTensor parameters."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(p, DTensor)


@dataclass(frozen=True)
class ShardInfo:
    """Where one DTensor parameter lives: its mesh and this rank's piece."""

    mesh: Any  # torch.distributed.device_mesh.DeviceMesh
    sharded: bool  # Shard(0) on the last mesh dim; False: replicated everywhere
    parts: int  # ranks in the shard group (the last mesh dim)
    index: int  # this rank's coordinate in it
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]


def _allowed(ndim: int) -> str:
    if ndim == 1:
        return "[Shard(dim=0)] (fully_shard) or [Replicate()]"
    return "[Replicate(), Shard(dim=0)] (HSDP) or [Replicate(), Replicate()]"


def shard_info(p: torch.Tensor, name: str) -> ShardInfo | None:
    """The :class:`ShardInfo` of a DTensor parameter (None for a plain tensor).

    Raises ValueError naming the parameter for a placement other than those
    of ``fully_shard`` / HSDP, or a local piece that is not
    ``torch.chunk(full, S, dim=0)[i]``.
    """
    if not is_dtensor(p):
        return None
    from torch.distributed.tensor import Replicate, Shard

    mesh = p.device_mesh  # type: ignore[attr-defined]
    placements = tuple(p.placements)  # type: ignore[attr-defined]
    ndim = mesh.ndim
    outer_ok = all(isinstance(x, Replicate) for x in placements[:-1])
    last = placements[-1] if placements else None
    sharded = isinstance(last, Shard) and last.dim == 0
    if ndim not in (1, 2) or not outer_ok or not (sharded or isinstance(last, Replicate)):
        raise ValueError(
            f"parameter {name!r} is a DTensor with placements {list(placements)} on a "
            f"{ndim}-D mesh: allowed on a 1-D mesh {_allowed(1)}, on a 2-D mesh "
            f"{_allowed(2)}."
        )
    parts, index = mesh.size(ndim - 1), mesh.get_local_rank(ndim - 1)
    global_shape = tuple(p.shape)
    local_shape = tuple(p.to_local().shape)  # type: ignore[attr-defined]
    expected = global_shape
    if sharded:
        expected = (_rows(global_shape[0], parts, index)[1], *global_shape[1:])
    if local_shape != expected:
        raise ValueError(
            f"parameter {name!r}: its local piece has shape {local_shape}, expected "
            f"{expected} (torch.chunk of {global_shape} into {parts} along dim 0, piece "
            f"{index}): allowed fully_shard's even chunking."
        )
    return ShardInfo(mesh, sharded, parts, index, global_shape, local_shape)


def full(x: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor on every rank (an all-gather over the shard group)."""
    out: torch.Tensor = x.full_tensor()  # type: ignore[attr-defined]
    return out


def local(x: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (its storage: writes reach the parameter)."""
    out: torch.Tensor = x.to_local()  # type: ignore[attr-defined]
    return out


def planned(p: torch.Tensor, info: ShardInfo | None, local_shards: bool) -> torch.Tensor:
    """Parameter ``p`` as its param group's plan sees it: itself (no DTensor), this
    rank's piece (``"local"``) or the whole value (``"lossless"``, an all-gather)."""
    if info is None:
        return p
    return local(p) if local_shards else full(p)


def store_planned(p: torch.Tensor, value: torch.Tensor, info: ShardInfo | None,
                  local_shards: bool) -> None:
    """Write ``value``, a new :func:`planned` value of ``p``, into ``p``: this rank's piece
    of it in ``"lossless"`` mode."""
    if info is None:
        p.copy_(value)
    elif local_shards:
        local(p).copy_(value)
    else:
        local(p).copy_(local_piece(value, info))


def local_piece(whole: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """This rank's piece of a whole (gathered) tensor: ``torch.chunk(whole, S)[i]``."""
    if not info.sharded:
        return whole
    return whole.narrow(0, *_rows(whole.shape[0], info.parts, info.index))


def _rows(n: int, parts: int, index: int) -> tuple[int, int]:
    """(first row, rows) of piece ``index`` of ``torch.chunk`` of n rows into ``parts``:
    pieces of ceil(n / parts) rows, the last ones shorter or empty."""
    size = -(-n // parts)
    start = min(n, index * size)
    return start, min(size, n - start)


class PieceGather:
    """``"lossless"``: the whole parameters and gradients from the pieces, one collective.

    Per param group and dtype, one all-gather over the shard group of every
    sharded parameter's piece and its gradient's piece, packed into a flat
    buffer (each rank's segment padded to the longest), the buffers allocated
    once per layout and reused (one layout per dtype); the whole tensors are
    the pieces of every rank concatenated along dim 0 (copies: exact).
    Replicated parameters need no collective (their piece is the whole).
    """

    def __init__(self) -> None:
        #: (shapes, dtype, device) -> (send, receive, segment): one layout per dtype.
        self._buffers: dict[tuple[object, torch.dtype, torch.device],
                            tuple[torch.Tensor, torch.Tensor, int]] = {}

    def run(
        self, items: list[tuple[ShardInfo, torch.Tensor, torch.Tensor]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per ``(info, parameter piece, gradient piece)``: (whole parameter, whole gradient).

        Every rank of the shard group must call it with the same parameters.
        """
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(items)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for j, (info, w, g) in enumerate(items):
            if not info.sharded:
                out[j] = (w, g)
            else:
                by_dtype.setdefault(w.dtype, []).append(j)
        for dtype, js in by_dtype.items():
            for j, wg in zip(js, self._gather([items[j] for j in js], dtype), strict=True):
                out[j] = wg
        return [x for x in out if x is not None]

    def _gather(self, items: list[tuple[ShardInfo, torch.Tensor, torch.Tensor]],
                dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        import torch.distributed as dist

        info0 = items[0][0]
        parts, mesh = info0.parts, info0.mesh
        # Per rank r and item: the numel of r's piece (the same arithmetic on every rank).
        sizes = [[_rows(i.global_shape[0], parts, r)[1] * math.prod(i.global_shape[1:])
                  for i, _, _ in items] for r in range(parts)]
        segment = max(max(2 * sum(s) for s in sizes), 1)
        device = items[0][1].device
        key = (tuple(i.global_shape for i, _, _ in items), dtype, device)
        if key not in self._buffers:
            send = torch.empty(segment, dtype=dtype, device=device)
            recv = torch.empty(parts * segment, dtype=dtype, device=device)
            # One layout kept per dtype and device: the current one (a group of bfloat16
            # and float32 parameters keeps both buffers between steps).
            self._buffers = {k: v for k, v in self._buffers.items() if k[1:] != key[1:]}
            self._buffers[key] = (send, recv, segment)
        send, recv, segment = self._buffers[key]
        offset = 0
        for (_, w, g), n in zip(items, sizes[info0.index], strict=True):
            send[offset:offset + n].copy_(w.reshape(-1))
            send[offset + n:offset + 2 * n].copy_(g.reshape(-1))
            offset += 2 * n
        dist.all_gather_into_tensor(recv, send, group=mesh.get_group(mesh.ndim - 1))
        wholes = []
        starts = [r * segment for r in range(parts)]
        for j, (info, _, _) in enumerate(items):
            w_parts, g_parts = [], []
            for r in range(parts):
                n = sizes[r][j]
                w_parts.append(recv[starts[r]:starts[r] + n])
                g_parts.append(recv[starts[r] + n:starts[r] + 2 * n])
                starts[r] += 2 * n
            wholes.append((torch.cat(w_parts).view(info.global_shape),
                           torch.cat(g_parts).view(info.global_shape)))
        return wholes
