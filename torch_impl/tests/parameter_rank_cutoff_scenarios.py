"""Per-rank bodies of the eq. (10g) distributed test (``test_parameter_rank_cutoff.py``),
run by ``shampoo_torch.processes.spawn`` on gloo (one thread per process).

Each rank steps the distributed optimizer and, in the same process and thread
setting, the single-process one on the same float64 stream, and returns the
final parameters of both and who owns which block.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shampoo_spec import ShampooConfig
from shampoo_torch import DistributedConfig, Shampoo


def _steps(config: ShampooConfig, params: dict[str, np.ndarray],
           grads: list[dict[str, np.ndarray]], distributed: DistributedConfig | None
           ) -> tuple[dict[str, np.ndarray], dict[str, list[int | None]]]:
    ps = {n: torch.nn.Parameter(torch.tensor(v, dtype=torch.float64)) for n, v in params.items()}
    opt = Shampoo(list(ps.items()), config, distributed=distributed)
    for g in grads:
        for n, p in ps.items():
            p.grad = torch.tensor(g[n], dtype=torch.float64)
        opt.step()
    owners: dict[str, list[int | None]] = {}
    for view in opt.blocks():
        owners.setdefault(view.name, []).append(view.owner)
    return {n: p.detach().numpy().copy() for n, p in ps.items()}, owners


def compare(rank: int, world: int, configs: dict[str, ShampooConfig],
            params: dict[str, np.ndarray], grads: list[dict[str, np.ndarray]]
            ) -> dict[str, Any]:
    """Per config: the distributed and single-process parameters, and the block owners."""
    out: dict[str, Any] = {}
    for name, config in configs.items():
        single, _ = _steps(config, params, grads, None)
        distributed, owners = _steps(config, params, grads, DistributedConfig())
        out[name] = {"single": single, "distributed": distributed, "owners": owners}
    dist.barrier()
    return out
