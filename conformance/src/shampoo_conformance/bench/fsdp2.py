"""Benchmark: Shampoo under FSDP2 (``fully_shard``) at 1, 2 and 4 gloo ranks, per rank.

``python -m shampoo_conformance.bench.fsdp2 [--worlds 1 2 4] [--period 10] [--steps 10]
[--threads T] [--no-meta]``

Model and Shampoo config of :mod:`shampoo_conformance.bench.torch_step` (MLP 512 -> 1024 ->
1024 -> 1024 -> 10, Meta's defaults with blocks up to 1024 and AdaGrad
grafting) with ``precondition_frequency = start = --period``; every Linear
and then the whole model wrapped by ``fully_shard`` on a 1-D CPU mesh of N
gloo ranks (fresh processes, ``max(1, 2 // N)`` torch threads each), the
global batch of 512 split over the ranks. Per N and
``DistributedConfig.shard_mode`` ("lossless", "local"): warm-up of
``--period`` steps (the first root step included), then ``--steps`` timed
steps (the last one a root step when ``--steps`` is the period).

Per rank it measures: the optimizer state (bytes of the distinct storages
the optimizer holds other than the parameters' and gradients', by
``anchors._state_bytes``) split into block state
(factors, inverse roots, counters: ``Shampoo.block_state_bytes()``),
elementwise state (``optimizer.state``: graft, filter, momentum) and the
rest (communication buffers); the peak RSS over the same process's peak
after forward/backward-only steps before the optimizer existed; the median
non-root ``opt.step()`` and whole-step wall times and the root step's.
It prints max and mean over the ranks and the ratio to one rank.

It then runs Meta's ``DistributedShampoo`` (if importable) from the same
kwargs (``anchors.META_KWARGS``, frequency ``--period``) with
``FullyShardDistributedConfig`` on the same FSDP2 model:
``FSDPParamAssignmentStrategy.DEFAULT`` (``FullyShardDistributor``, each
rank its pieces, like "local") at 1 and 2 ranks, ``ROUND_ROBIN`` and
``REPLICATE`` (``FullyShardLosslessDistributor``: whole parameters per
owner rank, or on every rank) at 2; Meta's block state is what its
``"shampoo"`` entries hold. A failure is printed with its exception and
the line of Meta's source that raised it. Prints, never asserts.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import time
import traceback
import types
from collections.abc import Iterator
from typing import Any

import torch

from shampoo_conformance.bench import anchors, torch_step
from shampoo_spec import is_root_step
from shampoo_torch import DistributedConfig, Shampoo
from shampoo_torch.processes import spawn

MODES = ("lossless", "local")
#: Meta's FSDPParamAssignmentStrategy -> the world sizes it runs at (DEFAULT's
#: 1-rank run is every Meta row's baseline: Meta's single-device plan).
META_RUNS = {"DEFAULT": (1, 2), "ROUND_ROBIN": (2,), "REPLICATE": (2,)}
MIB = 2.0**-20


def _sharded_model(world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = torch_step.make_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _meta(params: Iterator[torch.nn.Parameter], strategy: str, period: int) -> Any:
    from distributed_shampoo import (
        DistributedShampoo,
        FSDPParamAssignmentStrategy,
        FullyShardDistributedConfig,
    )

    meta_kwargs = importlib.import_module("shampoo_conformance.thirdparty.meta").meta_kwargs
    kwargs = {**anchors.META_KWARGS, "precondition_frequency": period}
    return DistributedShampoo(params, **meta_kwargs(kwargs), distributed_config=(
        FullyShardDistributedConfig(
            param_assignment_strategy=FSDPParamAssignmentStrategy[strategy])))


def _state(opt: Any, model: torch.nn.Module, meta: bool) -> dict[str, float]:
    """State bytes: total, block, elementwise (and by difference the rest); a DTensor
    counts its local piece (the bytes this rank holds)."""
    state_bytes = anchors._state_bytes

    def ns(tree: Any) -> Any:
        return types.SimpleNamespace(state=tree)

    total = state_bytes(opt, model)
    in_state = state_bytes(ns(opt.state), model)
    if meta:
        block = state_bytes(ns([b["shampoo"] for st in opt.state.values()
                                 for b in st.values()
                                 if isinstance(b, dict) and "shampoo" in b]), model)
    else:
        block = opt.block_state_bytes()
    elementwise = in_state - block if meta else in_state  # Meta's factors are in its state
    return {"total": total * MIB, "block": block * MIB, "elementwise": elementwise * MIB,
            "other": (total - block - elementwise) * MIB}


def bench_rank(rank: int, world: int, meta: bool, mode: str, period: int, steps: int,
               threads: int | None) -> dict[str, Any]:
    """One rank: fwd/bwd baseline, then ``period + steps`` training steps; memory and times.

    ``mode``: our ``shard_mode``, or Meta's ``FSDPParamAssignmentStrategy`` name.
    """
    _peak_rss_mib = anchors._peak_rss_mib
    threads = threads or max(1, 2 // world)
    torch.set_num_threads(threads)
    model = _sharded_model(world)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(torch_step.BATCH, torch_step.SIZES[0], generator=gen).chunk(world)[rank]
    y = torch.randint(0, torch_step.SIZES[-1], (torch_step.BATCH,),
                      generator=gen).chunk(world)[rank]

    def forward_backward() -> None:
        torch.nn.functional.cross_entropy(model(x), y).backward()

    for _ in range(3):  # the baseline: forward and backward only
        model.zero_grad(set_to_none=True)
        forward_backward()
    baseline = _peak_rss_mib()
    model.zero_grad(set_to_none=True)
    config = torch_step.shampoo_config(period)
    try:
        opt = (_meta(model.parameters(), mode, period) if meta else Shampoo(
            model.named_parameters(), config, distributed=DistributedConfig(shard_mode=mode)))
        times: list[tuple[int, float, float]] = []
        for t in range(1, period + steps + 1):
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            forward_backward()
            mid = time.perf_counter()
            opt.step()
            end = time.perf_counter()
            if t > period:
                times.append((t, end - start, end - mid))
    except Exception as err:  # noqa: BLE001 - Meta's failure is a result to report
        frames = traceback.extract_tb(err.__traceback__)
        theirs = [f for f in frames if "distributed_shampoo" in f.filename] or frames
        f = theirs[-1]
        return {"error": f"{type(err).__name__}: {err}",
                "where": f"{f.filename.split('site-packages/')[-1]}:{f.lineno}: {f.line}"}
    roots = [(w, o) for t, w, o in times if is_root_step(t, config.schedule)]
    plain = [(w, o) for t, w, o in times if not is_root_step(t, config.schedule)]
    return {
        "threads": threads,
        **_state(opt, model, meta),
        "rss": _peak_rss_mib() - baseline,
        "step": statistics.median(w for w, _ in plain),
        "opt": statistics.median(o for _, o in plain),
        "root": statistics.fmean(o for _, o in roots) if roots else float("nan"),
        "roots": len(roots),
    }


COLUMNS = (  # (key, header, format): MiB columns, then ms
    ("total", "state", ".1f"), ("block", "block", ".1f"), ("elementwise", "elem", ".1f"),
    ("other", "other", ".1f"), ("rss", "+RSS", ".0f"),
)


def _failure(ranks: list[Any]) -> str | None:
    """Why a run failed (the first failing rank's reason), or None."""
    bad = [r for r in ranks if isinstance(r, BaseException) or "error" in r]
    if not bad:
        return None
    r = bad[0]
    why = (f"{r['error']}\n      at {r['where']}" if isinstance(r, dict)
           else f"{type(r).__name__}: {r}".splitlines()[0])
    return f"failed on {len(bad)} of {len(ranks)} ranks: {why}"


def _report(label: str, world: int, ranks: list[Any], one: list[Any] | None) -> None:
    """One line: max / mean over ranks, ratios to the 1-rank run ``one``."""
    why = _failure(ranks)
    if why is not None:
        print(f"{label:<20} {world:>2}  {why}")
        return
    cells = [f"{max(r[k] for r in ranks):{fmt}}/{statistics.fmean(r[k] for r in ranks):{fmt}}"
             for k, _, fmt in COLUMNS]
    ratio = "-"
    if one is not None and _failure(one) is None:
        ratio = (f"{max(r['total'] for r in ranks) / one[0]['total']:.2f}x / "
                 f"{max(r['block'] for r in ranks) / one[0]['block']:.2f}x")
    times = "  ".join(f"{1e3 * max(r[k] for r in ranks):6.0f}" for k in ("step", "opt", "root"))
    print(f"{label:<20} {world:>2} {ranks[0]['threads']:>3}  "
          + "  ".join(f"{c:>13}" for c in cells) + f"  {ratio:>15}  {times}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--period", type=int, default=10, help="precondition frequency = start")
    parser.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up")
    parser.add_argument("--threads", type=int, help="torch threads per rank (max(1, 2 // N))")
    parser.add_argument("--no-meta", action="store_true", help="skip Meta's DistributedShampoo")
    args = parser.parse_args(argv)
    target = "shampoo_conformance.bench.fsdp2:bench_rank"
    n_params = sum(p.numel() for p in torch_step.make_model().parameters())
    cores = os.cpu_count()
    print(f"torch {torch.__version__}, gloo on CPU, fully_shard on every Linear and the root; MLP "
          f"{torch_step.SIZES} ({n_params / 1e6:.2f}M params), global batch "
          f"{torch_step.BATCH} split "
          f"over the ranks; period {args.period}: {args.period} warm-up + {args.steps} timed "
          f"steps; torch threads per rank {args.threads or 'max(1, 2 // N)'}. This machine "
          f"has {cores} cores: N ranks x threads > {cores} are oversubscribed, so times are "
          f"not a scaling figure (load average {_load()} at the start).")
    print("MiB per rank, max/mean over ranks: state = block + elem + other (block: factors, "
          "roots, counters; elem: optimizer.state: graft, filter, momentum; other: buffers); "
          "+RSS: peak RSS over the forward/backward-only peak; ratio: max state and max "
          "block over the 1-rank run's; ms, max over ranks: median non-root whole step, "
          "median non-root opt.step(), root-step opt.step().")
    header = "  ".join(f"{h:>13}" for _, h, _ in COLUMNS)
    print(f"{'':<20} {'N':>2} {'thr':>3}  {header}  {'ratio state/blk':>15}  "
          f"{'step':>6}  {'opt':>6}  {'root':>6}")
    runs = [(f"ours {mode}", False, mode, tuple(args.worlds)) for mode in MODES]
    if not args.no_meta:
        try:
            import distributed_shampoo  # noqa: F401
        except ImportError as err:
            print(f"Meta's distributed_shampoo is not importable: {err}")
        else:
            runs += [(f"Meta {name}", True, name, worlds) for name, worlds in META_RUNS.items()]
    ones: dict[str, list[Any]] = {}
    for label, meta, mode, worlds in runs:
        family = "Meta" if meta else label
        for world in worlds:
            ranks = spawn(target, world, args=(meta, mode, args.period, args.steps, args.threads),
                          timeout_s=600, collective_timeout_s=120)
            if world == 1:
                ones[family] = ranks
            _report(label, world, ranks, ones.get(family))
    print(f"load average {_load()} at the end")


def _load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
