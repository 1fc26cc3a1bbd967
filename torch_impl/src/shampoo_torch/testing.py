"""Numpy in, numpy out: the torch backend for the conformance adapter (DESIGN.md 8.2).

``run(config, params, grads, dtype)`` steps :class:`~shampoo_torch.Shampoo`
on CPU with parameters in ``dtype`` and factors in the same precision
(``factor_dtype`` is replaced to match), and returns the parameters after
each step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from shampoo_spec import ShampooConfig

from .optimizer import Shampoo

_DTYPES: dict[Any, tuple[torch.dtype, str]] = {
    np.dtype(np.float64): (torch.float64, "float64"),
    np.dtype(np.float32): (torch.float32, "float32"),
}


def run(
    config: ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: Any = np.float64,
) -> list[dict[str, np.ndarray]]:
    """The parameters (as ``dtype`` arrays) after each step of ``grads``."""
    key = np.dtype(dtype)
    if key not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported: allowed are float32, float64.")
    tdtype, factor_dtype = _DTYPES[key]
    config = dataclasses.replace(config, factor_dtype=factor_dtype)
    names = list(params)
    tensors = {
        n: torch.nn.Parameter(torch.tensor(np.asarray(params[n]), dtype=tdtype)) for n in names
    }
    opt = Shampoo([(n, tensors[n]) for n in names], config)
    out = []
    for step in grads:
        if set(step) != set(names):
            raise ValueError(
                f"grads keys {sorted(step)} do not match parameter names {sorted(names)}."
            )
        for n in names:
            g = np.asarray(step[n])
            if g.shape != tuple(tensors[n].shape):
                raise ValueError(
                    f"gradient of {n!r} has shape {g.shape}, parameter has "
                    f"{tuple(tensors[n].shape)}."
                )
            tensors[n].grad = torch.tensor(g, dtype=tdtype)
        opt.step()
        out.append({n: tensors[n].detach().numpy().copy() for n in names})
    return out
