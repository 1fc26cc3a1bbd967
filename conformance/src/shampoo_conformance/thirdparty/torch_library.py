"""What every backend that runs a torch library shares: one process on the CPU,
NumPy in and out (the backend contract), and the closed-loop stepper of the report.

``make(config, tensors, dtype)`` is the adapter's constructor of the library's
optimizer (it raises :class:`~shampoo_spec.Inexpressible` for a config the
library cannot express).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from shampoo_conformance.adapters.inputs import check_run_inputs, check_stepper_arguments
from shampoo_conformance.adapters.torch import Stepper
from shampoo_conformance.adapters.torch_user_run import TORCH
from shampoo_spec import ShampooConfig


def run_optimizer(
    backend: str,
    make: Any,
    config: ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: Any,
) -> list[dict[str, np.ndarray]]:
    """Parameters after each step of ``grads``, stepping ``make(config, tensors, dtype)``.

    A library may draw from torch's global generator (pytorch-optimizer's
    ScalableShampoo starts its power iteration from ``torch.randn``,
    docs/third-party.md), so its trajectory would vary from run to run: runs
    here draw from a generator seeded 0, forked so that the caller's stream is
    left as it was.
    """
    key = np.dtype(dtype)
    check_run_inputs(backend, params, grads, key.name)
    names = list(params)
    tensors = {n: torch.nn.Parameter(torch.tensor(np.asarray(params[n]), dtype=TORCH[key]))
               for n in names}
    opt = make(config, list(tensors.values()), key)
    out = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for step in grads:
            for n in names:
                tensors[n].grad = torch.tensor(np.asarray(step[n]), dtype=TORCH[key])
            opt.step()
            out.append({n: tensors[n].detach().numpy().copy() for n in names})
    return out


def make_stepper(
    backend: str,
    make: Any,
    optimizer: str,
    params: dict[str, np.ndarray],
    lr: float,
    config: ShampooConfig | None,
    weight_decay: float,
    default: ShampooConfig,
    dtype: Any,
) -> Stepper:
    """A closed-loop Stepper: ``make(config with lr, ...)``, or torch's AdamW."""
    key = np.dtype(dtype)
    check_run_inputs(backend, params, [], key.name)
    check_stepper_arguments(optimizer, config, weight_decay)
    tensors = {n: torch.nn.Parameter(torch.tensor(np.asarray(v), dtype=TORCH[key]))
               for n, v in params.items()}
    opt: torch.optim.Optimizer
    if optimizer == "shampoo":
        config = dataclasses.replace(default if config is None else config, learning_rate=lr)
        opt = make(config, list(tensors.values()), key)
    else:
        opt = torch.optim.AdamW(tensors.values(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=weight_decay)
    return Stepper(opt, tensors)


def in_dtype(config: ShampooConfig, dtype: Any) -> ShampooConfig:
    """``config`` with its factors in the run's precision (as the torch backend runs it;
    the torch libraries keep their statistics in the parameters' dtype). A diagonal
    preconditioner or spectral descent (eqs. 16b, 16c) has no factors: its config is
    returned as it is."""
    if config.diagonal is not None or config.spectral is not None:
        return config
    return dataclasses.replace(
        config, factor_dtype="float64" if np.dtype(dtype) == np.float64 else "float32")
