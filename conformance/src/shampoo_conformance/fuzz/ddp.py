"""Invariant (f): two gloo ranks, a NaN on one rank only; the replicas must stay equal.

:func:`check_ddp` runs :func:`replicas` on 2 fresh processes through
``shampoo_torch.processes.spawn`` (as torch_impl/tests do), all cases of one
Hypothesis example in one spawn (starting processes costs seconds). Every
rank steps ``Shampoo(..., distributed=DistributedConfig())`` with the same
gradients except on rank ``bad_rank``, which sees NaN in one entry at one
step. Each rank returns, per case and step, the exception type raised (or
None) and the bytes of its weights; the ranks must agree on both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

import shampoo_spec as ss

from .invariants import Violation, count

Case = tuple[ss.ShampooConfig, dict[str, np.ndarray], list[dict[str, np.ndarray]], int, int,
             str, int]


def replicas(rank: int, world_size: int, cases: list[Case]) -> list[list[tuple[Any, ...]]]:
    """Per case, per step: (exception type name or None, weights bytes, skipped_blocks)."""
    import torch

    from shampoo_torch import DistributedConfig, Shampoo

    out = []
    for config, params, grads, bad_step, bad_rank, bad_name, bad_index in cases:
        config = dataclasses.replace(config, factor_dtype="float32")
        tensors = {n: torch.nn.Parameter(torch.tensor(v, dtype=torch.float32))
                   for n, v in params.items()}
        opt = Shampoo(list(tensors.items()), config, distributed=DistributedConfig())
        steps: list[tuple[Any, ...]] = []
        for t, step in enumerate(grads):
            for n, g in step.items():
                g = np.array(g, dtype=np.float32)
                if t == bad_step and rank == bad_rank and n == bad_name:
                    g.reshape(-1)[bad_index] = np.nan
                tensors[n].grad = torch.tensor(g)
            try:
                opt.step()
                err = None
            except Exception as e:  # noqa: BLE001 - compared between ranks
                err = type(e).__name__
            weights = b"".join(tensors[n].detach().numpy().tobytes() for n in sorted(tensors))
            steps.append((err, weights, opt.metrics["skipped_blocks"]))
        out.append(steps)
    return out


def check_ddp(cases: list[Case], timeout_s: float = 300.0) -> None:
    """(f): both ranks raise alike and hold equal weights after every step."""
    from shampoo_torch.processes import spawn

    results = spawn("shampoo_conformance.fuzz.ddp:replicas", 2, (cases,), timeout_s=timeout_s)
    for r in results:
        if isinstance(r, BaseException):
            raise Violation(f"torch-ddp: a rank failed: {type(r).__name__}: {r}") from r
    for i, (case, a, b) in enumerate(zip(cases, results[0], results[1], strict=True)):
        policy = case[0].failure.nonfinite_gradient
        for t, (sa, sb) in enumerate(zip(a, b, strict=True)):
            where = (f"torch-ddp case {i} ({policy!r}, NaN in {case[5]!r} on rank {case[4]} at "
                     f"step {case[3] + 1}), step {t + 1}")
            if sa[0] != sb[0]:
                raise Violation(f"{where}: rank 0 raised {sa[0]}, rank 1 raised {sb[0]}")
            if sa[0] not in (None, "NonFiniteGradientError", "RootFailureError"):
                raise Violation(f"{where}: both ranks raised {sa[0]}")
            if sa[1] != sb[1]:
                raise Violation(f"{where}: the replicas' weights differ")
        count("f_ddp", "torch", policy)


__all__ = ["check_ddp", "replicas"]
