"""How Shampoo's cost grows with block size and model width (torch), against AdamW.

``python -m shampoo_conformance.bench.scale [--widths 512 1024 2048 4096]
[--blocks 256 512 1024 2048] [--optimizers ours adamw] [--plot PATH]``

Model: MLP 512 -> w -> w -> w -> 10 (width w), cross entropy, float32, batch
512 of random data, 2 threads. Shampoo: ``from_meta`` of
:data:`bench_anchors.META_KWARGS` (AdaGrad grafting, epsilon 1e-12) with
``max_preconditioner_dim`` = the block size b, so a w x w weight is cut into
``ceil(w / b)^2`` blocks of at most b x b with two factors each (merged dims
up to b). ``meta`` (Meta's ``DistributedShampoo`` from the same kwargs) may
join where it is installed.

Each (width, block, optimizer) runs in a fresh process (so its peak RSS is
its own) for 11 steps with roots every :data:`PERIOD` = 4 steps (steps 4 and 8;
preconditioning from step 4): the root step is timed at step 8 and the other
steps at 5-7 and 9-11 (median), and the step time is amortized to roots every
100 steps, ``(root + 99 * other) / 100``, as in ``bench_anchors`` (a root
step's work does not depend on the period). Memory: the optimizer's state
(``bench_anchors._state_bytes``) and peak RSS over a process that runs forward
and backward only at the same width.

Per width it prints, per block size: the amortized whole step and its ratio to
AdamW's, the optimizer step alone, the root step, the non-root step's FLOPs
(``shampoo_conformance.bench.torch_step.step_flops``), the state and the peak over the
baseline; ``--plot`` draws the step ratio and the state per parameter against
width, one line per block size. Prints, never asserts (docs/results.md has
measured figures).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # see shampoo_conformance.bench.jax_step

PERIOD = 4  #: roots every PERIOD steps in the timed run (steps 4 and 8)
STEPS = 3 * PERIOD - 1  #: 11: roots at 4 and 8, the other steps 5-7 and 9-11
AMORTIZE = 100  #: the step time is reported for roots every AMORTIZE steps
BATCH = 512
INPUT, CLASSES = 512, 10


def sizes(width: int) -> tuple[int, ...]:
    return (INPUT, width, width, width, CLASSES)


def make_model(width: int, seed: int = 0) -> Any:
    from shampoo_conformance.bench.torch_step import make_model as mlp

    return mlp(seed, sizes(width))


def meta_kwargs(block: int) -> dict[str, Any]:
    """The benchmark's Meta kwargs at block size ``block``, roots every PERIOD steps."""
    from shampoo_conformance.bench.anchors import META_KWARGS

    return {**META_KWARGS, "max_preconditioner_dim": block, "precondition_frequency": PERIOD}


def make_optimizer(name: str, params: Iterable[Any], block: int) -> Any:
    import torch

    if name == "ours":
        from shampoo_spec import from_meta
        from shampoo_torch import Shampoo

        return Shampoo(params, from_meta(meta_kwargs(block)))
    if name == "meta":
        from distributed_shampoo import DistributedShampoo

        from shampoo_conformance.thirdparty.meta import meta_kwargs as to_meta_objects

        return DistributedShampoo(params, **to_meta_objects(meta_kwargs(block)))
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if name == "none":  # forward and backward only: the memory baseline
        return torch.optim.SGD(params, lr=0.0)
    raise ValueError(f"optimizer {name!r}: expected one of ours, meta, adamw, none")


def amortized(root: float, other: float) -> float:
    """Mean step time over a period of AMORTIZE steps with one root step."""
    return (root + (AMORTIZE - 1) * other) / AMORTIZE


@dataclass(frozen=True)
class Run:
    """One (width, block, optimizer) run's measurements (seconds, bytes, MiB)."""

    step_root: float
    step_other: float
    opt_root: float
    opt_other: float
    state_bytes: int
    peak_rss_mib: float

    @property
    def step(self) -> float:
        return amortized(self.step_root, self.step_other)

    @property
    def opt(self) -> float:
        return amortized(self.opt_root, self.opt_other)


def run_one(width: int, block: int, name: str, threads: int) -> Run:
    """Child process: STEPS steps of one optimizer; root step at 8, the others 5-7, 9-11."""
    import torch

    from shampoo_conformance.bench.anchors import _peak_rss_mib, _state_bytes

    torch.set_num_threads(threads)
    model = make_model(width)
    opt = make_optimizer(name, model.parameters(), block)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, INPUT, generator=gen)
    y = torch.randint(0, CLASSES, (BATCH,), generator=gen)
    steps: dict[int, tuple[float, float]] = {}
    for t in range(1, STEPS + 1):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        mid = time.perf_counter()
        if name != "none":
            opt.step()
        end = time.perf_counter()
        steps[t] = (end - start, end - mid)
    others = [steps[t] for t in range(PERIOD + 1, STEPS + 1) if t != 2 * PERIOD]
    return Run(
        step_root=steps[2 * PERIOD][0],
        step_other=statistics.median(s for s, _ in others),
        opt_root=steps[2 * PERIOD][1],
        opt_other=statistics.median(o for _, o in others),
        state_bytes=0 if name == "none" else _state_bytes(opt, model),
        peak_rss_mib=_peak_rss_mib(),
    )


def measure(width: int, block: int, name: str, threads: int) -> Run:
    out = subprocess.run(
        [sys.executable, "-m", "shampoo_conformance.bench.scale", "--one",
         str(width), str(block), name, "--threads", str(threads)],
        check=True, capture_output=True, text=True,
    ).stdout
    return Run(**json.loads(out.strip().splitlines()[-1]))


def non_root_flops(width: int, block: int) -> float:
    from shampoo_conformance.bench.torch_step import step_flops
    from shampoo_spec import from_meta
    from shampoo_torch.blocks import SYMMETRIC_GRAM_MIN

    return step_flops(make_model(width), from_meta(meta_kwargs(block)),
                      triangle_from=SYMMETRIC_GRAM_MIN)


def sweep(widths: list[int], blocks: list[int], names: list[str], threads: int,
          plot: str | None) -> dict[tuple[int, int, str], Run]:
    import torch

    print(f"torch {torch.__version__}, {threads} threads; MLP 512 -> w -> w -> w -> 10, "
          f"batch {BATCH}, float32; roots every {AMORTIZE} steps (amortized)")
    results: dict[tuple[int, int, str], Run] = {}
    shampoos = [n for n in names if n != "adamw"]
    total = len(widths) * (1 + ("adamw" in names) + len(blocks) * len(shampoos))
    done = 0
    for width in widths:
        n_params = sum(p.numel() for p in make_model(width).parameters())
        base = measure(width, 0, "none", threads)
        adam = measure(width, 0, "adamw", threads) if "adamw" in names else None
        done += 2
        print(f"\n-- width {width} ({n_params / 1e6:.1f}M parameters, "
              f"{4 * n_params / 2**20:.0f} MiB; forward/backward peak RSS "
              f"{base.peak_rss_mib:.0f} MiB) --", flush=True)
        print(f"{'':6} {'block':>5} {'step ms':>9} {'/ AdamW':>8} {'opt ms':>8} "
              f"{'root s':>7} {'GFLOP':>7} {'state MiB':>9} {'peak+ MiB':>9}")
        if adam is not None:
            results[(width, 0, "adamw")] = adam
            print(f"{'adamw':6} {'-':>5} {adam.step * 1e3:9.1f} {1.0:8.2f} "
                  f"{adam.opt * 1e3:8.1f} {'-':>7} {'-':>7} {adam.state_bytes / 2**20:9.1f} "
                  f"{adam.peak_rss_mib - base.peak_rss_mib:9.0f}", flush=True)
        for block in blocks:
            for name in shampoos:
                run = measure(width, block, name, threads)
                results[(width, block, name)] = run
                done += 1
                ratio = run.step / adam.step if adam else math.nan
                flops = non_root_flops(width, block) if name == "ours" else math.nan
                print(f"{name:6} {block:5} {run.step * 1e3:9.1f} {ratio:8.2f} "
                      f"{run.opt * 1e3:8.1f} {run.opt_root:7.2f} {flops / 1e9:7.1f} "
                      f"{run.state_bytes / 2**20:9.1f} "
                      f"{run.peak_rss_mib - base.peak_rss_mib:9.0f}   [{done}/{total}]",
                      flush=True)
        results[(width, 0, "none")] = base
    if plot:
        draw(results, widths, blocks, plot)
    return results


def draw(results: dict[tuple[int, int, str], Run], widths: list[int], blocks: list[int],
         path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for block in blocks:
        ws = [w for w in widths if (w, block, "ours") in results and (w, 0, "adamw") in results]
        left.plot(ws, [results[(w, block, "ours")].step / results[(w, 0, "adamw")].step
                       for w in ws], marker="o", label=f"block {block}")
        params = [4 * sum(p.numel() for p in make_model(w).parameters()) for w in ws]
        right.plot(ws, [results[(w, block, "ours")].state_bytes / b
                        for w, b in zip(ws, params, strict=True)], marker="o",
                   label=f"block {block}")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(widths, [str(w) for w in widths])
        ax.set_xlabel("model width w (MLP 512-w-w-w-10)")
        ax.grid(alpha=0.3)
        ax.legend()
    left.set_ylabel("whole step / AdamW step (roots every 100)")
    left.set_title("time")
    right.set_ylabel("optimizer state / parameter bytes (AdamW: 2)")
    right.set_title("memory")
    fig.suptitle("shampoo_torch cost vs block size and width (bench_scale)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--blocks", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--optimizers", nargs="+", default=["ours", "adamw"],
                    choices=["ours", "meta", "adamw"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plot", help="write the plot (PNG) here")
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        width, block, name = int(args.one[0]), int(args.one[1]), args.one[2]
        print(json.dumps(dataclasses.asdict(run_one(width, block, name, args.threads))))
        return
    sweep(args.widths, args.blocks, args.optimizers, args.threads, args.plot)


if __name__ == "__main__":
    main()
