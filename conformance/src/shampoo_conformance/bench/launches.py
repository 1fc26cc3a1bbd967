"""What a GPU pays for in one non-root optimizer step: leaf ATen ops and host syncs.

Counted by ``torch.profiler`` on any device (this CPU included): every leaf ATen
op reaches at least one kernel launch on a GPU, except that a multi-tensor
``aten::_foreach_*`` op is one launch however many tensors it holds (on a CPU it
runs per tensor, below it), so it counts once and its children not at all. A
host sync is an ``aten::_local_scalar_dense`` (``.item()``, ``bool(t)``,
``.tolist()``): on a GPU it waits for the queue to drain. ``ours (accelerator)``
runs under ``SHAMPOO_TORCH_PATH=accelerator``: the branches a CUDA device takes
(``shampoo_torch.device_path``).

:mod:`shampoo_conformance.bench.anchors` prints the table beside its step times,
for the benchmark's MLP (``nox -s bench_anchors``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Any, NamedTuple

#: Where Dynamo checks a compiled graph's guards: a 0-d CPU int or float64 tensor among
#: the inputs is guarded by its value (torch's fake tensors read it with ``item()``);
#: on a GPU such a tensor is a device tensor and no value is read.
GUARDS = "TorchDynamo Cache Lookup"


class StepCount(NamedTuple):
    """One optimizer step's launches (``ops``), host syncs, and the value reads of a
    compiled step's guards (:data:`GUARDS`; not host syncs on a GPU)."""

    ops: int
    syncs: int
    guard_reads: int = 0


def count_step(model: Any, make: Callable[[Iterable[Any]], Any], x: Any,
               warmup: int) -> StepCount:
    """The :class:`StepCount` of the optimizer step after ``warmup`` steps (past the
    first root step, so that the profiled step preconditions and is not a root step).
    A compiled step's fused kernels (Inductor's, profiled with its kernel profile on)
    count one launch each.
    """
    from torch.profiler import ProfilerActivity, profile

    opt = make(model.parameters())

    def backward() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).float().pow(2).mean().backward()

    for _ in range(warmup):
        backward()
        opt.step()
    backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
    events = [e for e in prof.events() if e.name.startswith("aten::")]

    def under_foreach(e: Any) -> bool:
        p = e.cpu_parent
        while p is not None:
            if p.name.startswith("aten::_foreach_"):
                return True
            p = p.cpu_parent
        return False

    parents = {e.cpu_parent.id for e in events
               if e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")}
    leaves = [e for e in events if not under_foreach(e) and not _in_guards(e)
              and (e.name.startswith("aten::_foreach_") or e.id not in parents)]
    fused = [e for e in prof.events() if "_cpp_fused_" in e.name or "triton_" in e.name]
    reads = [e for e in events if e.name == "aten::_local_scalar_dense"]
    guarded = sum(1 for e in reads if _in_guards(e))
    return StepCount(len(leaves) + len(fused), len(reads) - guarded, guarded)


def _in_guards(e: Any) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name == GUARDS:
            return True
        p = p.cpu_parent
    return False


@contextmanager
def accelerator_path() -> Any:
    """``SHAMPOO_TORCH_PATH=accelerator`` for the block (restored after)."""
    old = os.environ.get("SHAMPOO_TORCH_PATH")
    os.environ["SHAMPOO_TORCH_PATH"] = "accelerator"
    try:
        yield
    finally:
        if old is None:
            del os.environ["SHAMPOO_TORCH_PATH"]
        else:
            os.environ["SHAMPOO_TORCH_PATH"] = old


def print_table(makers: dict[str, Callable[[Iterable[Any]], Any]],
                model_fn: Callable[[], Any], x: Any, warmup: int,
                compiled: Callable[[Iterable[Any]], Any] | None = None) -> None:
    """One line per optimizer, ``ours`` on both paths (and ``compiled``, ours with
    ``compile=True``, on the accelerator path); ratios to Meta's where it runs."""
    import torch._inductor.config

    rows: dict[str, StepCount] = {}
    for name, make in makers.items():
        if name == "ours":
            rows["ours (cpu)"] = count_step(model_fn(), make, x, warmup)
            with accelerator_path():
                rows["ours (accelerator)"] = count_step(model_fn(), make, x, warmup)
                if compiled is not None:
                    old = torch._inductor.config.cpp.enable_kernel_profile
                    torch._inductor.config.cpp.enable_kernel_profile = True
                    try:
                        # Two steps more: the last recompile is the step after the
                        # first root step (shampoo_torch.compiled).
                        rows["ours (compiled)"] = count_step(model_fn(), compiled, x,
                                                             warmup + 2)
                    finally:
                        torch._inductor.config.cpp.enable_kernel_profile = old
        else:
            rows[name] = count_step(model_fn(), make, x, warmup)
    meta = rows.get("meta")
    print("-- one non-root optimizer step: leaf ATen ops (a _foreach_ op once) and host syncs --")
    print(f"{'':20} {'leaf ops':>9} {'host syncs':>10} {'/ Meta ops':>10}")
    for name, (ops, syncs, _) in rows.items():
        ratio = f"{ops / meta[0]:10.2f}" if meta else f"{'':>10}"
        print(f"{name:20} {ops:9d} {syncs:10d} {ratio}")
    if "ours (compiled)" in rows:
        print("ours (compiled): Inductor's fused kernels counted once each; its guards read "
              f"{rows['ours (compiled)'].guard_reads} 0-d CPU tensors by value (torch's rule "
              "for 0-d CPU int and float64 tensors: none on a GPU)")
