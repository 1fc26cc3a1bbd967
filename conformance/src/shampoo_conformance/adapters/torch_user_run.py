"""A user's run of a torch optimizer (the registry's ``library_run``), shared by our
torch adapter and every torch library's: the optimizer built from exactly the
arguments given and stepped as a user steps it, on the caller's own generators."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from shampoo_conformance.thirdparty.registry import LibraryRun

#: Parameter dtypes these runs take, as torch's.
TORCH = {np.dtype(np.float64): torch.float64, np.dtype(np.float32): torch.float32}


def torch_library_run(
    construct: Callable[[list[torch.nn.Parameter], dict[str, Any]], torch.optim.Optimizer],
    kwargs: dict[str, Any],
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: Any,
) -> LibraryRun:
    """A user's run of a torch library (the registry's ``library_run``).

    ``construct(parameters, kwargs)`` builds the library's optimizer from exactly
    ``kwargs``; each step sets ``p.grad`` from ``grads`` and calls ``step()`` on the
    caller's own generators (unlike the backends' ``run``,
    :func:`~shampoo_conformance.thirdparty.torch_library.run_optimizer`, nothing is
    forked or seeded: the side-effect properties look at what the library does to
    them).
    What it returns is what the caller sees after each step: the parameters in the
    dtype the library left them, and ``p.grad``.
    """
    key = np.dtype(dtype)
    names = list(params)
    tensors = {n: torch.nn.Parameter(torch.tensor(np.asarray(params[n]), dtype=TORCH[key]))
               for n in names}
    opt = construct(list(tensors.values()), dict(kwargs))
    out, seen = [], []
    for step in grads:
        for n in names:
            tensors[n].grad = torch.tensor(np.asarray(step[n]), dtype=TORCH[key])
        opt.step()
        out.append({n: tensors[n].detach().numpy().copy() for n in names})
        seen.append({n: _grad_seen(tensors[n], step[n]) for n in names})
    return LibraryRun(params=out, grads=seen)


def _grad_seen(tensor: torch.nn.Parameter, given: np.ndarray) -> np.ndarray:
    """``p.grad`` as the caller sees it after a step (NaN where the library cleared it)."""
    grad = tensor.grad
    if grad is None:
        return np.full(np.shape(given), np.nan)
    return grad.detach().numpy().copy()
