"""The ``torch-ddp`` backend: NumPy in, NumPy out over 2 gloo processes (the backend contract).

``run(config, params, grads, dtype)`` has the contract of
:func:`shampoo_conformance.adapters.torch.run`: it steps
``Shampoo(..., distributed=DistributedConfig())`` on two CPU processes joined
by gloo, every rank fed the same gradients (as after DistributedDataParallel's
averaging), and returns rank 0's parameters after each step; it also checks
that rank 1's parameters are identical and fails if they are not.

It runs on the two persistent worker processes of :mod:`.gloo_pool`
(started once, shared with ``torch-fsdp2``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shampoo_conformance.adapters.gloo_pool import run_on_pool
from shampoo_conformance.adapters.inputs import check_run_inputs
from shampoo_conformance.adapters.torch import run as run_torch
from shampoo_spec import ShampooConfig
from shampoo_torch import DistributedConfig


def _check_inputs(
    params: dict[str, np.ndarray], grads: list[dict[str, np.ndarray]], dtype: Any
) -> None:
    """The errors of :func:`.torch.run`, raised here before any worker runs."""
    check_run_inputs("torch-ddp", params, grads, np.dtype(dtype).name)


def run_rank(
    config: ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: Any = np.float64,
    distributed: DistributedConfig | None = None,
) -> list[dict[str, np.ndarray]]:
    """One rank's part of :func:`run` (torch.distributed already initialized)."""
    return run_torch(config, params, grads, dtype, distributed=distributed or DistributedConfig())


def run(
    config: ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: Any = np.float64,
) -> list[dict[str, np.ndarray]]:
    """Rank 0's parameters (as ``dtype`` arrays) after each step of ``grads``, on 2 gloo ranks."""
    _check_inputs(params, grads, dtype)
    return run_on_pool("torch-ddp", run_rank, config, params, grads, dtype)
