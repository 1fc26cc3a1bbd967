"""The ``torch`` backend: ``shampoo_torch`` NumPy in, NumPy out (the backend contract).

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
import os
import time
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch

from shampoo_conformance.adapters.inputs import check_run_inputs, check_stepper_arguments
from shampoo_conformance.adapters.torch_user_run import torch_library_run
from shampoo_spec import ShampooConfig
from shampoo_torch import DistributedConfig, Shampoo

_DTYPES: dict[Any, tuple[torch.dtype, Literal["float32", "float64"]]] = {
    np.dtype(np.float64): (torch.float64, "float64"),
    np.dtype(np.float32): (torch.float32, "float32"),
}


def run(
    config: ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: Any = np.float64,
    *,
    distributed: DistributedConfig | None = None,
) -> list[dict[str, np.ndarray]]:
    """The parameters (as ``dtype`` arrays) after each step of ``grads``.

    ``distributed``: this rank's part of a distributed run (torch.distributed
    already initialized; :mod:`.torch_ddp` runs it on every rank).
    """
    key = np.dtype(dtype)
    check_run_inputs("torch", params, grads, key.name)
    tdtype, factor_dtype = _DTYPES[key]
    config = dataclasses.replace(config, factor_dtype=factor_dtype)
    names = list(params)
    tensors = {
        n: torch.nn.Parameter(torch.tensor(np.asarray(params[n]), dtype=tdtype)) for n in names
    }
    opt = Shampoo([(n, tensors[n]) for n in names], config, distributed=distributed)
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
    AdamW. ``step_with_peak(grads)`` is an untimed step that also returns
    the optimizer's peak bytes during it.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.nn.Parameter]
    ) -> None:
        self.optimizer = optimizer
        self._tensors = tensors
        self.last_step_seconds = float("nan")

    def step(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One step with ``grads``; the parameters after it (NumPy, the stepper's dtype)."""
        self._set_grads(grads)
        start = time.perf_counter()
        self.optimizer.step()
        self.last_step_seconds = time.perf_counter() - start
        return {n: p.detach().numpy().copy() for n, p in self._tensors.items()}

    def step_with_peak(
        self, grads: dict[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], int | None]:
        """One step (as :meth:`step`, untimed) and the optimizer's peak bytes during it.

        Peak = bytes of the state before the step (:meth:`state_bytes`) +
        the highest point of the bytes allocated minus freed since the step
        began, read from the CPU allocator's events under ``torch.profiler``
        (``profile_memory=True``; the workspaces of ATen kernels included).
        Gradients and parameters are allocated before the step, so they
        are not counted. None where this torch does not expose the events.
        """
        self._set_grads(grads)
        held = self.state_bytes()
        rise = _allocation_peak(self.optimizer.step)
        params = {n: p.detach().numpy().copy() for n, p in self._tensors.items()}
        return params, None if rise is None else held + rise

    def _set_grads(self, grads: dict[str, np.ndarray]) -> None:
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

    def state_bytes(self) -> int:
        """Bytes of the tensors in ``optimizer.state_dict()["state"]``."""
        return _tensor_bytes(self.optimizer.state_dict()["state"])


def _allocation_peak(fn: Callable[[], object]) -> int | None:
    """Highest point of (bytes allocated - bytes freed) on the CPU while ``fn()`` runs.

    Reads the allocation events that ``torch.profiler`` records with
    ``profile_memory=True`` (signed sizes, in time order). The event tree is
    the profiler's experimental interface (the one its memory timeline is
    built on); with a torch that lacks it, ``fn`` still runs and the
    answer is None.
    """
    # Kineto logs every profiler start/stop to stderr at its default level;
    # level 6 silences that (it would tear through the report's progress bar).
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    try:
        from torch._C._profiler import _EventType

        roots = prof.profiler.kineto_results.experimental_event_tree()
    except (ImportError, AttributeError):
        return None
    events: list[tuple[int, int]] = []
    stack = list(reversed(roots))  # preorder: ties in time keep the recorded order
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and str(node.extra_fields.device) == "cpu":
            events.append((node.start_time_ns, int(node.extra_fields.alloc_size)))
        stack.extend(reversed(node.children))
    live = peak = 0
    for _, size in sorted(events, key=lambda e: e[0]):  # stable
        live += size
        peak = max(peak, live)
    return peak


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
    check_run_inputs("torch", params, [], key.name)
    check_stepper_arguments(optimizer, config, weight_decay)
    tdtype, factor_dtype = _DTYPES[key]
    tensors = {
        n: torch.nn.Parameter(torch.tensor(np.asarray(v), dtype=tdtype)) for n, v in params.items()
    }
    opt: torch.optim.Optimizer
    if optimizer == "shampoo":
        config = ShampooConfig() if config is None else config
        config = dataclasses.replace(config, factor_dtype=factor_dtype)
        opt = Shampoo(list(tensors.items()), config, lr=lr)
    else:
        opt = torch.optim.AdamW(
            tensors.values(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay
        )
    return Stepper(opt, tensors)


# ------------------------------------ the registry's user-run hooks (thirdparty/registry.py)
#: What a user passes ``Shampoo(params, config=None, *, lr=None)`` (torch_impl/README.md):
#: nothing is required; the learning rate is the one argument a user sets (eq. 2's lr).
USER_KWARGS: dict[str, Any] = {"lr": 1e-2}


def defaults_config() -> ShampooConfig:
    """``ShampooConfig()`` at :data:`USER_KWARGS`'s learning rate: what ``Shampoo(params,
    lr=...)`` runs (factors in float32 whatever the parameters' dtype)."""
    return ShampooConfig(learning_rate=USER_KWARGS["lr"])


def library_run(kwargs: dict[str, Any], params: dict[str, np.ndarray],
                grads: list[dict[str, np.ndarray]], dtype: Any) -> Any:
    """``Shampoo(named parameters, **kwargs)`` stepped as a user steps it
    (:func:`~shampoo_conformance.adapters.torch_user_run.torch_library_run`)."""
    return torch_library_run(lambda tensors, kw: Shampoo(tensors, **kw), kwargs, params,
                             grads, dtype)

