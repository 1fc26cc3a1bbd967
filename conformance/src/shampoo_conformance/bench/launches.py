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
from typing import Any


def count_step(model: Any, make: Callable[[Iterable[Any]], Any], x: Any,
               warmup: int) -> tuple[int, int]:
    """(leaf ops, host syncs) of the optimizer step after ``warmup`` steps (past the
    first root step, so that the profiled step preconditions and is not a root step)."""
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
    leaves = [e for e in events if not under_foreach(e)
              and (e.name.startswith("aten::_foreach_") or e.id not in parents)]
    syncs = sum(1 for e in events if e.name == "aten::_local_scalar_dense")
    return len(leaves), syncs


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
                model_fn: Callable[[], Any], x: Any, warmup: int) -> None:
    """One line per optimizer, ``ours`` on both paths; ratios to Meta's where it runs."""
    rows: dict[str, tuple[int, int]] = {}
    for name, make in makers.items():
        if name == "ours":
            rows["ours (cpu)"] = count_step(model_fn(), make, x, warmup)
            with accelerator_path():
                rows["ours (accelerator)"] = count_step(model_fn(), make, x, warmup)
        else:
            rows[name] = count_step(model_fn(), make, x, warmup)
    meta = rows.get("meta")
    print("-- one non-root optimizer step: leaf ATen ops (a _foreach_ op once) and host syncs --")
    print(f"{'':20} {'leaf ops':>9} {'host syncs':>10} {'/ Meta ops':>10}")
    for name, (ops, syncs) in rows.items():
        ratio = f"{ops / meta[0]:10.2f}" if meta else f"{'':>10}"
        print(f"{name:20} {ops:9d} {syncs:10d} {ratio}")
