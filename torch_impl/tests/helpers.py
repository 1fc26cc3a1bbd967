"""Seeded data streams, the deviation measure, a stepped optimizer and the worker spawn
the torch tests share."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shampoo_spec import ShampooConfig
from shampoo_torch import Shampoo
from shampoo_torch.processes import spawn

#: The shapes the per-option reference-equality cases run on: a matrix, vectors,
#: a 3-tensor, a 0-d scalar and size-1 dims.
SHAPES = {"w": (7, 10), "v": (7,), "t": (3, 4, 5), "u": (12,), "s": (), "o": (1, 5, 1)}
STEPS = 20


def stream(seed: int, steps: int = STEPS, shapes: dict[str, tuple[int, ...]] = SHAPES
           ) -> tuple[dict, list[dict]]:
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s) for k, s in shapes.items()}
    grads = [{k: rng.standard_normal(s) for k, s in shapes.items()} for _ in range(steps)]
    return params, grads


def max_relative_error(params: dict, ours: list[dict], ref: list[dict]) -> float:
    """The deviation of ``ours`` from ``ref`` over the reference's displacement from
    ``params``, floored at the largest single step so far (worst over steps and keys)."""
    worst = 0.0
    previous = dict(params)
    largest_step = dict.fromkeys(params, 0.0)
    for mine, theirs in zip(ours, ref, strict=True):
        for k, w0 in params.items():
            largest_step[k] = max(largest_step[k], float(np.linalg.norm(theirs[k] - previous[k])))
            diff = np.linalg.norm(np.asarray(mine[k], dtype=np.float64) - theirs[k])
            scale = max(float(np.linalg.norm(theirs[k] - w0)), largest_step[k])
            worst = max(worst, diff / scale if scale > 0 else diff)
        previous = theirs
    return worst


def spawn_ok(target: str, world: int, args: tuple[Any, ...] = (),
             timeout_s: float = 300.0) -> list[Any]:
    """Each rank's return value of ``target`` on ``world`` gloo workers
    (:func:`shampoo_torch.processes.spawn`); a rank that raised fails the test, named."""
    results = spawn(target, world, args, timeout_s=timeout_s, collective_timeout_s=120.0)
    for rank, r in enumerate(results):
        if isinstance(r, BaseException):
            raise AssertionError(f"rank {rank} of {world} raised: {r!r}") from r
    return results


def stepped(config: ShampooConfig, params: dict[str, np.ndarray],
            grads: list[dict[str, np.ndarray]]) -> Shampoo:
    """Torch's optimizer on float64 copies of ``params``, stepped over ``grads``."""
    tensors = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in params.items()}
    opt = Shampoo(list(tensors.items()), config)
    for g in grads:
        for k, t in tensors.items():
            t.grad = torch.tensor(g[k])
        opt.step()
    return opt


def load_scenarios(path: str, name: str) -> Any:
    """The scenario file at ``path`` as a module (it is also the target of spawned ranks,
    which load it by path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
