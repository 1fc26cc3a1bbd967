"""Numpy in, numpy out: the torch backend for the conformance adapter (DESIGN.md 8.2).

``run(config, params, grads, dtype)`` steps :class:`~shampoo_torch.Shampoo`
on CPU with parameters in ``dtype`` and factors in the same precision
(``factor_dtype`` is replaced to match), and returns the parameters after
each step.

``stepper(optimizer, params, lr=..., dtype=...)`` is the closed-loop form
used by the backend report: Shampoo or ``torch.optim.AdamW``, stepped one
NumPy gradient at a time, with the optimizer step timed alone.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import torch

from shampoo_spec import ShampooConfig, check_run_inputs

from .optimizer import Shampoo

_DTYPES: dict[Any, tuple[torch.dtype, str]] = {
    np.dtype(np.float64): (torch.float64, "float64"),
    np.dtype(np.float32): (torch.float32, "float32"),
}


def _arrays(tree: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in tree.items()}


def run(
    config: ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: Any = np.float64,
) -> list[dict[str, np.ndarray]]:
    """The parameters (as ``dtype`` arrays) after each step of ``grads``."""
    key = np.dtype(dtype)
    check_run_inputs("torch", _arrays(params), [_arrays(g) for g in grads], key.name)
    tdtype, factor_dtype = _DTYPES[key]
    config = dataclasses.replace(config, factor_dtype=factor_dtype)
    names = list(params)
    tensors = {
        n: torch.nn.Parameter(torch.tensor(np.asarray(params[n]), dtype=tdtype)) for n in names
    }
    opt = Shampoo([(n, tensors[n]) for n in names], config)
    out = []
    for step in grads:
        for n in names:
            tensors[n].grad = torch.tensor(np.asarray(step[n]), dtype=tdtype)
        opt.step()
        out.append({n: tensors[n].detach().numpy().copy() for n in names})
    return out


class Stepper:
    """One optimizer stepped with NumPy gradients: the closed-loop twin of :func:`run`.

    Made by :func:`stepper`. ``step(grads)`` copies the gradients into the
    parameters' ``.grad``, calls ``optimizer.step()`` and returns the new
    parameters as NumPy arrays; ``last_step_seconds`` is the wall time of
    that ``optimizer.step()`` call alone (no conversions; on CPU the call is
    synchronous). ``state_bytes()`` is the size of every tensor in
    ``optimizer.state_dict()["state"]``: factors, roots, counters and
    elementwise state for Shampoo; ``step``, ``exp_avg``, ``exp_avg_sq`` for
    AdamW.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.nn.Parameter]
    ) -> None:
        self.optimizer = optimizer
        self._tensors = tensors
        self.last_step_seconds = float("nan")

    def step(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One step with ``grads``; the parameters after it (NumPy, the stepper's dtype)."""
        names = list(self._tensors)
        if set(grads) != set(names):
            raise ValueError(
                f"grads keys {sorted(grads)} do not match parameter names {sorted(names)}."
            )
        for n, p in self._tensors.items():
            g = np.asarray(grads[n])
            if g.shape != tuple(p.shape):
                raise ValueError(
                    f"gradient of {n!r} has shape {g.shape}, parameter has {tuple(p.shape)}."
                )
            p.grad = torch.tensor(g, dtype=p.dtype)
        start = time.perf_counter()
        self.optimizer.step()
        self.last_step_seconds = time.perf_counter() - start
        return {n: p.detach().numpy().copy() for n, p in self._tensors.items()}

    def state_bytes(self) -> int:
        """Bytes of the tensors in ``optimizer.state_dict()["state"]``."""
        return _tensor_bytes(self.optimizer.state_dict()["state"])


def _tensor_bytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def stepper(
    optimizer: str,
    params: dict[str, np.ndarray],
    *,
    lr: float,
    config: ShampooConfig | None = None,
    weight_decay: float = 0.0,
    dtype: Any = np.float64,
) -> Stepper:
    """A :class:`Stepper` for ``"shampoo"`` or ``"adamw"`` on CPU in ``dtype``.

    ``"shampoo"``: :class:`~shampoo_torch.Shampoo` with ``config``
    (``ShampooConfig()`` when None), learning rate ``lr`` and ``factor_dtype``
    matched to ``dtype`` (as :func:`run` does); its weight decay is the
    config's (``weight_decay`` must stay 0). ``"adamw"``:
    ``torch.optim.AdamW(lr=lr, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=weight_decay)``; ``config`` must be None.
    """
    key = np.dtype(dtype)
    check_run_inputs("torch", _arrays(params), [], key.name)
    tdtype, factor_dtype = _DTYPES[key]
    tensors = {
        n: torch.nn.Parameter(torch.tensor(np.asarray(v), dtype=tdtype)) for n, v in params.items()
    }
    opt: torch.optim.Optimizer
    if optimizer == "shampoo":
        if weight_decay != 0.0:
            raise ValueError(
                f"weight_decay = {weight_decay!r} is invalid for 'shampoo': allowed 0.0 "
                "(Shampoo's weight decay is config.weight_decay)."
            )
        config = ShampooConfig() if config is None else config
        config = dataclasses.replace(config, factor_dtype=factor_dtype)
        opt = Shampoo(list(tensors.items()), config, lr=lr)
    elif optimizer == "adamw":
        if config is not None:
            raise ValueError("config is invalid for 'adamw': allowed None (AdamW has no config).")
        opt = torch.optim.AdamW(
            tensors.values(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay
        )
    else:
        raise ValueError(f"optimizer = {optimizer!r} is invalid: allowed 'shampoo', 'adamw'.")
    return Stepper(opt, tensors)
