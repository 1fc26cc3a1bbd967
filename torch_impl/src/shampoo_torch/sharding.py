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
process. Per step every rank all-gathers each parameter and its gradient
over the shard group (:func:`full`, DTensor's ``full_tensor``: exact
copies), the blocks are owned and exchanged exactly as for
DistributedDataParallel (:mod:`shampoo_torch.distributed`, the shard group
being the trainer group), the elementwise state is kept whole and updated
alike on every rank, and each rank writes its own piece of the new
parameter (:func:`local_piece`). Every value equals the single-process run
bit for bit (CPU, one thread per process).

``"local"``: each rank steps its own piece as if it were the whole parameter
(the plan of the piece's shape; Meta's ``FullyShardDistributor``), with no
optimizer communication; empty pieces take no step.
"""

from __future__ import annotations

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
