"""Benchmark: distributed Shampoo on 2 gloo ranks against 1 process, per rank.

``python -m shampoo_conformance.bench.torch_distributed [--period 20] [--periods 2] [--small]
[--threads 1]``

Model and Shampoo config of :mod:`shampoo_conformance.bench.torch_step` (MLP 512 -> 1024 ->
1024 -> 1024 -> 10, blocks up to 1024, Meta's defaults with AdaGrad
grafting), with ``precondition_frequency = start = --period`` so that a short
run has ``--periods`` root steps. ``--small`` halves every width, for slow
machines. Each configuration runs in fresh processes with one thread each:
1 process with the plain optimizer, then 2 gloo ranks with
``distributed=DistributedConfig()``; both ranks see the same batch (as
after DistributedDataParallel's averaging, without its all-reduce).

Per rank it reports: the time inside the root computation (eqs. 7-13, timed
around :func:`shampoo_torch.preconditioner.refresh_inverse_roots`, which the
optimizer calls through its module), per root step and amortized per step, as
CPU time of the rank's one compute thread (the work, robust on a shared
machine) and as wall time; the same two for the median non-root
``opt.step()`` (the wall time includes the all-gather and waiting for the
other rank);
the bytes of block state held (``Shampoo.block_state_bytes()``: factors,
inverse roots, counters); the bytes one all-gather moves into every rank per
step (``Shampoo.exchange_bytes``). The
targets (issue 6) are <= 0.6x root time and <= 0.6x factor
memory on the busier rank. It also checks that the 2-rank parameters equal
the 1-process ones bit for bit. It prints and never asserts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch

from shampoo_conformance.bench import torch_step
from shampoo_spec import is_root_step
from shampoo_torch import DistributedConfig, Shampoo, preconditioner
from shampoo_torch.processes import spawn


def bench_rank(rank: int, world: int, distributed: bool, period: int, periods: int,
               small: bool, threads: int = 1) -> dict[str, Any]:
    """One rank: train ``period * (periods + 1)`` steps; root time, memory, step times."""
    torch.set_num_threads(threads)
    if small:
        # The module-level model widths.
        torch_step.SIZES = tuple(max(s // 2, 10) for s in torch_step.SIZES)
    config = torch_step.shampoo_config(period)
    trainer = torch_step.Trainer("Shampoo", lambda p: Shampoo(
        p, config, distributed=DistributedConfig() if distributed else None))
    opt = trainer.opt
    root_time = [0.0, 0.0]  # wall, CPU of this (the only compute) thread
    refresh = preconditioner.refresh_inverse_roots

    def timed(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return refresh(*args, **kwargs)
        finally:
            root_time[0] += time.perf_counter() - wall
            root_time[1] += time.thread_time() - cpu

    preconditioner.refresh_inverse_roots = timed  # this process only runs this benchmark
    step_cpu: list[float] = []
    step = opt.step

    def cpu_timed_step(*args: Any, **kwargs: Any) -> Any:
        cpu = time.thread_time()
        try:
            return step(*args, **kwargs)
        finally:
            step_cpu.append(time.thread_time() - cpu)

    opt.step = cpu_timed_step  # type: ignore[method-assign]
    trainer.run(period * (periods + 1))
    plain = [dt for t, dt in trainer.opt_times if not is_root_step(t, config.schedule)]
    plain_cpu = [dt for (t, _), dt in zip(trainer.opt_times, step_cpu, strict=True)
                 if not is_root_step(t, config.schedule)]
    root_steps = [t for t, _ in trainer.opt_times if is_root_step(t, config.schedule)]
    return {
        "root_s": root_time[0],
        "root_cpu_s": root_time[1],
        "root_steps": len(root_steps),
        "steps": len(trainer.opt_times),
        "factor_bytes": opt.block_state_bytes(),
        "gather_bytes": opt.exchange_bytes,
        "blocks": sum(1 for view in opt.blocks() if view.held),
        "plain_step_s": statistics.median(plain),
        "plain_step_cpu_s": statistics.median(plain_cpu),
        "params": [p.detach().numpy().copy() for p in trainer.model.parameters()],
        "sizes": torch_step.SIZES,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--period", type=int, default=20, help="precondition frequency = start")
    parser.add_argument("--periods", type=int, default=2, help="root steps measured")
    parser.add_argument("--small", action="store_true", help="halve the model widths")
    parser.add_argument("--threads", type=int, default=1,
                        help="threads per rank (CPU time then counts the main thread only)")
    args = parser.parse_args(argv)
    target = "shampoo_conformance.bench.torch_distributed:bench_rank"
    extra = (args.period, args.periods, args.small, args.threads)
    one = spawn(target, 1, args=(False, *extra), timeout_s=3600)
    two = spawn(target, 2, args=(True, *extra), timeout_s=3600)
    for r in one + two:
        if isinstance(r, BaseException):
            raise r
    base = one[0]
    n_params = sum(p.size for p in base["params"])
    print(f"torch {torch.__version__}, gloo on CPU, {args.threads} thread(s) per rank; "
          f"MLP {base['sizes']} "
          f"({n_params / 1e6:.2f}M params), {base['steps']} steps, {base['root_steps']} root "
          f"steps (period {args.period})")

    def row(label: str, key: str, scale: float, unit: str, fmt: str = "8.2f") -> None:
        a = base[key] * scale
        per = [r[key] * scale for r in two]
        ratio = f"{max(per) / a:6.2f}x" if a else "     -"
        ranks = " / ".join(f"{v:{fmt}}" for v in per)
        print(f"  {label:<32} {a:{fmt}} {unit:<5} | {ranks} {unit:<5} | {ratio}")

    print(f"  {'per rank':<32} {'1 process':>14} | {'2 ranks (rank 0 / rank 1)':>27} | max/1")
    for r in (base, *two):
        r["root_per"] = r["root_s"] / max(r["root_steps"], 1)
        r["root_cpu_per"] = r["root_cpu_s"] / max(r["root_steps"], 1)
        r["root_amortized"] = r["root_cpu_s"] / r["steps"]
    row("root CPU time per root step", "root_cpu_per", 1e3, "ms", "8.1f")
    row("root wall time per root step", "root_per", 1e3, "ms", "8.1f")
    row("root CPU time amortized per step", "root_amortized", 1e3, "ms", "8.2f")
    row("factor state", "factor_bytes", 2.0**-20, "MiB", "8.2f")
    row("blocks owned", "blocks", 1.0, "", "8.0f")
    row("median non-root opt.step() CPU", "plain_step_cpu_s", 1e3, "ms", "8.1f")
    row("median non-root opt.step() wall", "plain_step_s", 1e3, "ms", "8.1f")
    gather = two[0]["gather_bytes"]
    print(f"  all-gather per step: {gather / 2**20:.2f} MiB received by each rank "
          f"({gather / 2 / 2**20:.2f} MiB sent; float32; no all-gather with 1 process)")
    same = all(np.array_equal(a, b) for a, b in zip(base["params"], two[0]["params"], strict=True))
    same &= all(np.array_equal(a, b) for a, b in zip(two[0]["params"], two[1]["params"],
                                                     strict=True))
    print(f"  parameters after {base['steps']} steps: 2 ranks equal 1 process bit for bit: {same}")


if __name__ == "__main__":
    main()
