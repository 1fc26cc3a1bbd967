"""The non-root step under ``torch.compile`` (``Shampoo(..., compile=True)``).

A non-root step on the accelerator path (:mod:`.device_path`) reads nothing on the
host, so its phases (eqs. 1-22 but the roots) trace as one graph: no graph break.
What changes from step to step is the step count t, a Python int in each
parameter's state; Dynamo makes it a symbolic int after the first change
(automatic dynamic), and the schedule's tests on it (eq. 8: ``t % f != 0``,
``t >= start``) become guards that every non-root step satisfies: no recompile.
The step counts are therefore never hashed inside the step (a hash pins a
symbolic int to its value; :func:`shampoo_torch.cohorts.split_cohorts`).

Root steps (eqs. 9-13: eigendecompositions, Newton's stopping test, the failure
limit) read the host and are amortized over ``precondition_frequency`` steps: they
run eagerly, decided on the host before the step (:class:`CompiledStep`), so the
compiled graph never holds one.

Backends: ``True`` is torch's default (Inductor), whose fused kernels sum in
their own order (float64 results within a few ulps of eager, scaled by the
inverse roots' condition number); ``"aot_eager"`` and, on CUDA, ``"cudagraphs"``
(one graph replay per step) run eager's kernels and give eager's bits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from shampoo_spec import is_root_step, learning_rate_ratio

from .cohorts import FIRST_LR
from .device_path import on_cpu_path
from .refusal import PendingRefusals
from .state import ParamGroupPlan

#: ``compile=True``'s backend: torch's default.
DEFAULT_BACKEND = "inductor"


#: A ``torch.compile`` backend: a registered name or a callable (graph, inputs) -> callable.
Backend = str | Callable[..., Any]


def backend_of(option: object, distributed: bool) -> Backend | None:
    """The backend ``Shampoo(compile=option)`` names (None: not compiled); a ValueError
    naming the argument for anything but a bool or a backend torch knows, and for any
    backend with ``distributed`` (a distributed step's collectives are not traced)."""
    if option is False:
        return None
    if option is True or callable(option) or (
            isinstance(option, str) and option in torch._dynamo.list_backends(exclude_tags=())):
        if distributed:
            raise ValueError(
                f"compile = {option!r} is invalid with distributed: allowed in one process "
                "only (a distributed step's collectives are not traced)."
            )
        return DEFAULT_BACKEND if option is True else option
    raise ValueError(
        f"compile = {option!r} is invalid: allowed False, True (torch.compile's default "
        f"backend, {DEFAULT_BACKEND!r}), a backend name of "
        "torch._dynamo.list_backends() or a backend callable."
    )


def check_compilable(backend: Backend, devices: Sequence[torch.device]) -> None:
    """A ValueError unless every parameter takes the accelerator path (the CPU path
    reads flags on the host, each a graph break)."""
    cpu = [d for d in devices if on_cpu_path(d)]
    if cpu:
        raise ValueError(
            f"compile = {backend!r} is invalid for parameters on {cpu[0]}, which takes the CPU "
            "path (it reads flags on the host, each a graph break): allowed on the "
            "accelerator path, a CUDA or other non-CPU device, or any device with "
            "SHAMPOO_TORCH_PATH=accelerator (shampoo_torch.device_path)."
        )


def is_root_step_here(param_groups: Sequence[Mapping[str, Any]],
                      plans: Sequence[ParamGroupPlan],
                      state: Mapping[torch.Tensor, Mapping[str, Any]]) -> bool:
    """Whether this step is a root step (eq. 8) for some parameter with a gradient, read
    on the host before the step (the same test as the step's own, on t + 1)."""
    for group, gp in zip(param_groups, plans, strict=True):
        lr = float(group["lr"])
        ratio = learning_rate_ratio(lr, group.get(FIRST_LR, lr))
        for p in group["params"]:
            if p.grad is not None and is_root_step(state[p]["step"] + 1, gp.config.schedule,
                                                   ratio):
                return True
    return False


class CompiledStep:
    """``phases`` (the optimizer's phases 1-6) compiled whole (``fullgraph=True``: a
    graph break raises), run for the non-root steps; eagerly a root step, and the
    first step after construction, a new param group or a loaded state (``cool``): it
    makes the kept vectors and scalars the graph then reuses
    (:class:`~shampoo_torch.block_grid.BlockVectors`, ``device_path.scalar``)."""

    def __init__(self, phases: Callable[..., None], backend: Backend) -> None:
        self._phases = phases
        self._graph = torch.compile(phases, backend=backend, fullgraph=True)
        self._warm = False

    def cool(self) -> None:
        """The next step runs eagerly (the optimizer's state or groups were replaced)."""
        self._warm = False

    def __call__(self, param_groups: Sequence[Mapping[str, Any]],
                 plans: Sequence[ParamGroupPlan],
                 state: Mapping[torch.Tensor, dict[str, Any]],
                 pending: PendingRefusals) -> None:
        if not self._warm or is_root_step_here(param_groups, plans, state):
            self._phases()
            self._warm = True
            return
        self._graph(in_graph=True)
        count_steps(param_groups, state, pending)


def count_steps(param_groups: Sequence[Mapping[str, Any]],
                state: Mapping[torch.Tensor, dict[str, Any]],
                pending: PendingRefusals) -> None:
    """After a compiled step, on the host: t + 1 for every parameter that had a
    gradient (eq. 1), and the step noted for each group's pending eq. (3) codes.
    The graph writes no Python int: Inductor would return a symbolic step count it
    no longer binds where nothing else in the graph reads it (torch 2.13)."""
    for gi, group in enumerate(param_groups):
        steps = []
        for p in group["params"]:
            if p.grad is not None:
                state[p]["step"] += 1
                steps.append(state[p]["step"])
        if gi in pending.codes and steps:
            pending.note(gi, max(steps))
