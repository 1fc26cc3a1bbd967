"""The ``torch-fsdp2`` backend: FSDP2 DTensor parameters on 2 gloo processes (the backend contract).

``run(config, params, grads, dtype)`` has the contract of
:func:`shampoo_conformance.adapters.torch.run`: every parameter becomes a
DTensor as ``fully_shard`` makes it (``[Shard(0)]`` on a 1-D mesh of 2 CPU
ranks; a 0-d parameter, which ``fully_shard`` cannot shard, ``[Replicate()]``),
every rank gets the same whole gradients as DTensors of the same placement
(as after FSDP2's averaging), and ``Shampoo(..., distributed=DistributedConfig(
shard_mode="lossless"))`` steps them; the result is rank 0's whole parameters
after each step (rank 1's must be identical, else the call fails).

Only ``"lossless"`` is a conformance backend: it plans the whole parameters
and so must equal the reference. ``"local"`` preconditions each rank's piece
as a parameter of its own, another algorithm whose oracle is the reference
run on the pieces (torch_impl/tests/test_fsdp2.py checks it so).

It runs on the two worker processes of :mod:`.gloo_pool` (started once,
shared with ``torch-ddp``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from shampoo_conformance.adapters.gloo_pool import run_on_pool
from shampoo_conformance.adapters.inputs import check_run_inputs
from shampoo_conformance.adapters.torch import _DTYPES
from shampoo_spec import ShampooConfig
from shampoo_torch import DistributedConfig, Shampoo

NAME = "torch-fsdp2"
_MESH: list[Any] = []  # the worker's 1-D mesh, made once per process


def _mesh() -> Any:
    if not _MESH:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        _MESH.append(init_device_mesh("cpu", (dist.get_world_size(),)))
    return _MESH[0]


def run_rank(
    config: ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: Any = np.float64,
) -> list[dict[str, np.ndarray]]:
    """One rank's part of :func:`run` (torch.distributed already initialized)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    key = np.dtype(dtype)
    check_run_inputs(NAME, params, grads, key.name)
    tdtype, factor_dtype = _DTYPES[key]
    config = dataclasses.replace(config, factor_dtype=factor_dtype)
    mesh = _mesh()

    def dtensor(x: Any, placements: Any) -> Any:
        return distribute_tensor(torch.tensor(np.asarray(x), dtype=tdtype), mesh, placements)

    names = list(params)
    placements = {n: [Shard(0)] if np.ndim(params[n]) else [Replicate()] for n in names}
    tensors: dict[str, Any] = {  # nn.Parameter(DTensor): a DTensor, typed as a Parameter
        n: torch.nn.Parameter(dtensor(params[n], placements[n])) for n in names
    }
    opt = Shampoo([(n, tensors[n]) for n in names], config,
                  distributed=DistributedConfig(shard_mode="lossless"))
    out = []
    for step in grads:
        for n in names:
            tensors[n].grad = dtensor(step[n], placements[n])
        opt.step()
        out.append({n: tensors[n].full_tensor().detach().numpy().copy() for n in names})
    return out


def run(
    config: ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: Any = np.float64,
) -> list[dict[str, np.ndarray]]:
    """Rank 0's whole parameters (``dtype`` arrays) after each step, on 2 gloo ranks."""
    check_run_inputs(NAME, params, grads, np.dtype(dtype).name)
    return run_on_pool(NAME, run_rank, config, params, grads, dtype)
