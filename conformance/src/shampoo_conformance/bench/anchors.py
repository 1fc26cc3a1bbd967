"""Speed and memory side by side with the anchors, in one process per framework.

``python -m shampoo_conformance.bench.anchors [--frameworks torch jax] [--batches 512 8192]``

Model (:mod:`.torch_step` / :mod:`.jax_step`): MLP 512 -> 1024 -> 1024 -> 1024
-> 10, float32, random data. Each library runs from the same
kwargs, ours through our importer:

- torch: Meta's ``DistributedShampoo`` from :data:`META_KWARGS` (Meta's
  defaults, blocks up to 1024, AdaGrad grafting, precondition_frequency 100,
  so preconditioning starts at step 100), ``shampoo_torch.Shampoo`` from
  ``from_meta(META_KWARGS)``, and ``torch.optim.AdamW``;
- JAX: Google's ``distributed_shampoo`` from :data:`GOOGLE_KWARGS` (its
  defaults: coupled Newton, relative epsilon; blocks of 1024, AdaGrad
  grafting, roots every 100 steps), ``shampoo_jax.shampoo`` from
  ``from_google(GOOGLE_KWARGS, x64=False)``, and ``optax.adamw``.

Time: the optimizers alternate, one timed stretch each, ``--periods`` times.
A step's time is recorded per step; root steps (every 100th) and the others
are averaged apart and amortized as (root + 99 * other) / 100, which equals
the mean over whole periods and lets a large batch time fewer steps (the
warm-up to the first root step runs at batch 64: statistics do not change
the cost). Also: the p99 step time, the optimizer step alone (torch), the
FLOPs of a non-root step (contraction model), and the efficiency: ideal
optimizer time (FLOPs at the measured matmul rate + each factor's root at
the measured eigh rate, amortized) over the measured one.

Memory: torch, peak RSS after 110 steps in a fresh process per optimizer,
over a process that runs forward and backward only; and the optimizer state
(bytes of the tensors it holds). JAX, XLA's memory analysis of the compiled
update (temporaries; also with the state donated) and the state's bytes;
and compile + first step time.

Prints, never asserts (docs/results.md has measured figures).
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # see shampoo_conformance.bench.jax_step

#: Meta's arguments for the torch side (Meta's defaults otherwise).
META_KWARGS: dict[str, Any] = {
    "lr": 1e-3,
    "betas": [0.0, 1.0],
    "epsilon": 1e-12,
    "max_preconditioner_dim": 1024,
    "precondition_frequency": 100,
    "grafting_config": {"type": "AdaGradPreconditionerConfig", "epsilon": 1e-10},
}
#: Google's arguments for the JAX side (Google's defaults otherwise).
GOOGLE_KWARGS: dict[str, Any] = {
    "learning_rate": 1e-3,
    "block_size": 1024,
    "graft_type": "ADAGRAD",
    "preconditioning_compute_steps": 100,
}
FREQUENCY = 100
WARMUP_BATCH = 64
MEMORY_STEPS = 110


def _state_bytes(opt: Any, model: Any) -> int:
    """Bytes of the distinct tensor storages an optimizer holds anywhere (its ``state``
    and its own attributes), other than the parameters' and gradients' storages (views
    of those, such as blocked parameters, count nothing); a DTensor counts the local
    piece this rank holds."""
    import torch

    def storage(t: Any) -> Any:  # a DTensor's is its local piece's (what this rank holds)
        return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()

    own = {storage(t).data_ptr() for p in model.parameters()
           for t in (p, p.grad) if t is not None}
    storages: dict[int, int] = {}
    seen: set[int] = set()

    def walk(tree: Any) -> None:
        if id(tree) in seen or isinstance(tree, (str, bytes, int, float, type)):
            return
        seen.add(id(tree))
        if isinstance(tree, torch.Tensor):
            held = storage(tree)
            if held.data_ptr() not in own:
                storages[held.data_ptr()] = held.nbytes()
        elif isinstance(tree, Mapping):
            for v in tree.values():
                walk(v)
        elif isinstance(tree, (list, tuple, set)):
            for v in tree:
                walk(v)
        elif hasattr(tree, "__dict__"):
            walk(vars(tree))

    walk(opt.state)
    walk(vars(opt))
    return sum(storages.values())


def _peak_rss_mib() -> float:
    """This process's peak resident set (VmHWM: it starts afresh at exec, unlike
    ru_maxrss, which a child inherits from the process that forked it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class Timing:
    """Per-step times with the root steps apart."""

    def __init__(self) -> None:
        self.root: list[float] = []
        self.other: list[float] = []

    def add(self, step: int, seconds: float) -> None:
        (self.root if step % FREQUENCY == 0 else self.other).append(seconds)

    def amortized(self) -> float:
        other = statistics.fmean(self.other)
        root = statistics.fmean(self.root) if self.root else other
        return (root + (FREQUENCY - 1) * other) / FREQUENCY

    def p99(self) -> float:
        xs = sorted(self.root + self.other)
        return xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)]


# ----------------------------------------------------------------------- torch
def torch_optimizers() -> dict[str, Callable[[Iterable[Any]], Any]]:
    """Ours (through ``from_meta``), Meta's (where installed) and AdamW, by name: each a
    function of the parameters, at :data:`META_KWARGS`."""
    import torch

    from shampoo_spec import from_meta
    from shampoo_torch import Shampoo

    makers: dict[str, Callable[[Iterable[Any]], Any]] = {
        "ours": lambda p: Shampoo(p, from_meta(META_KWARGS)),
    }
    try:
        from distributed_shampoo import DistributedShampoo

        from shampoo_conformance.thirdparty.meta import meta_kwargs
    except ImportError:
        print("Meta's library is not installed: " + _install("meta"))
    else:
        makers["meta"] = lambda p: DistributedShampoo(p, **meta_kwargs(META_KWARGS))
    makers["adamw"] = lambda p: torch.optim.AdamW(p, lr=1e-3)
    return makers


def ours_compiled() -> Callable[[Iterable[Any]], Any]:
    """Ours with ``compile=True`` (Inductor) at :data:`META_KWARGS`; on a CPU it needs
    the accelerator path (:func:`shampoo_conformance.bench.launches.accelerator_path`)."""
    from shampoo_spec import from_meta
    from shampoo_torch import Shampoo

    return lambda p: Shampoo(p, from_meta(META_KWARGS), compile=True)


def _install(library: str) -> str:
    from shampoo_conformance.thirdparty.registry import THIRD_PARTY

    return THIRD_PARTY[library].install


def _eigh_seconds(sizes: Iterable[int], dtype: Any) -> float:
    """Time of one eigh per size (best of 3), torch, on random SPD matrices."""
    import torch

    total = 0.0
    for n in sizes:
        a = torch.randn(n, n, dtype=dtype)
        a = a @ a.T + n * torch.eye(n, dtype=dtype)
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            torch.linalg.eigh(a)
            best = min(best, time.perf_counter() - t0)
        total += best
    return total


def _factor_sizes(model: Any) -> list[int]:
    from shampoo_spec import from_meta, plan_parameter

    config = from_meta(META_KWARGS)
    sizes = []
    for p in model.parameters():
        plan = plan_parameter(tuple(p.shape), config)
        if plan.preconditioned:
            for block in plan.blocks:
                sizes += [n for n, r in zip(block.shape, block.roots, strict=True) if r != 0]
    return sizes


def torch_side(batches: list[int], periods: int, large_period: int, threads: int) -> None:
    import torch

    from shampoo_conformance.bench import launches, torch_step
    from shampoo_spec import from_meta
    from shampoo_torch.blocks import SYMMETRIC_GRAM_MIN

    torch.set_num_threads(threads)
    makers = torch_optimizers()
    print(f"\n== torch {torch.__version__}, {threads} threads: "
          f"{', '.join(makers)} (same kwargs; ours through from_meta) ==")
    # Each optimizer's ideal at the rate of the GEMM it calls: ours shampoo_torch.gemm
    # (oneDNN on CPU), Meta's torch's BLAS.
    rates = {"ours": torch_step.matmul_rate(), "meta": torch_step.matmul_rate(ours=False)}
    probe = torch_step.make_model()
    config = from_meta(META_KWARGS)
    flops = {"ours": torch_step.step_flops(probe, config, triangle_from=SYMMETRIC_GRAM_MIN),
             "meta": torch_step.step_flops(probe, config)}  # Meta's G G^T is a whole GEMM
    eigh_s = _eigh_seconds(_factor_sizes(probe), torch.float32)
    print(f"float32 1024^2 matmul {rates['ours'] / 1e9:.0f} GFLOP/s (ours: shampoo_torch.gemm), "
          f"{rates['meta'] / 1e9:.0f} GFLOP/s (torch's BLAS); eigh of every factor "
          f"{eigh_s * 1e3:.0f} ms; non-root optimizer FLOPs (G G^T and the mode products of "
          f"every block) ours {flops['ours'] / 1e9:.2f} GFLOP, Meta's "
          f"{flops['meta'] / 1e9:.2f} GFLOP: ratio {flops['ours'] / flops['meta']:.2f}")
    ideal = {name: f / rates[name] + eigh_s / FREQUENCY for name, f in flops.items()}
    for batch in batches:
        period = FREQUENCY if batch <= 1024 else large_period
        trainers = {name: torch_step.Trainer(name, make, batch=batch)
                    for name, make in makers.items()}
        # Warm up to the step before the first root step.
        step_t, opt_t = _timed(trainers, periods, period, FREQUENCY - 1)
        how = ("whole periods" if period == FREQUENCY
               else f"stretches of {period} steps, root step amortized by formula")
        print(f"-- batch {batch} ({periods} x {how}) --")
        print(f"{'':8} {'step ms':>9} {'p99 ms':>8} {'opt ms':>8} {'root ms':>8} "
              f"{'/ AdamW':>8} {'efficiency':>10}")
        adam = step_t.get("adamw")
        for name in trainers:
            s, o = step_t[name], opt_t[name]
            root = statistics.fmean(o.root) * 1e3 if o.root else float("nan")
            ratio = s.amortized() / adam.amortized() if adam else float("nan")
            eff = ideal[name] / o.amortized() if name in ideal else float("nan")
            print(f"{name:8} {s.amortized() * 1e3:9.1f} {s.p99() * 1e3:8.1f} "
                  f"{o.amortized() * 1e3:8.1f} {root:8.0f} {ratio:8.2f} {eff:10.0%}")
        if "meta" in trainers:
            whole = step_t["ours"].amortized() / step_t["meta"].amortized()
            alone = opt_t["ours"].amortized() / opt_t["meta"].amortized()
            print(f"ours / Meta: whole step {whole:.2f}, optimizer step {alone:.2f}")
    _compiled_side_by_side(makers, periods)
    # Step FREQUENCY + 2: past Meta's first root step (its start is the frequency).
    launches.print_table(makers, torch_step.make_model, torch.randn(64, torch_step.SIZES[0]),
                         warmup=FREQUENCY + 1, compiled=ours_compiled())
    _torch_memory(list(makers))


def _timed(trainers: dict[str, Any], periods: int, period: int, warmup: int,
           settle: int = 0) -> tuple[dict[str, Timing], dict[str, Timing]]:
    """Whole-step and optimizer-step times per trainer over ``periods`` stretches of
    ``period`` steps, interleaved, after ``warmup`` steps at :data:`WARMUP_BATCH` and
    ``settle`` more at the full batch (untimed)."""
    step_t = {name: Timing() for name in trainers}
    opt_t = {name: Timing() for name in trainers}
    for tr in trainers.values():
        x, y = tr.x, tr.y
        tr.x, tr.y = x[:WARMUP_BATCH], y[:WARMUP_BATCH]
        tr.run(warmup, record=False)
        tr.x, tr.y = x, y
        if settle:
            tr.run(settle, record=False)
    for _ in range(periods):
        for name, tr in trainers.items():
            tr.step_times, tr.opt_times = [], []
            tr.run(period)
            for (t, dt_opt), dt in zip(tr.opt_times, tr.step_times, strict=True):
                step_t[name].add(t, dt)
                opt_t[name].add(t, dt_opt)
    return step_t, opt_t


def _compiled_side_by_side(makers: dict[str, Callable[[Iterable[Any]], Any]],
                           periods: int) -> None:
    """Ours eager and compiled on the accelerator path, beside Meta's, at batch 512: the
    amortized step and optimizer step over whole periods, after a warm-up past the
    first root step (where the last recompile happens)."""
    from shampoo_conformance.bench import launches, torch_step

    with launches.accelerator_path():
        chosen = {"ours (accelerator)": makers["ours"], "ours (compiled)": ours_compiled(),
                  **({"meta": makers["meta"]} if "meta" in makers else {})}
        trainers = {name: torch_step.Trainer(name, make) for name, make in chosen.items()}
        # Compiles at steps 2, 3 and after the first root step; then to the period's end.
        step_t, opt_t = _timed(trainers, periods, FREQUENCY, FREQUENCY + 3, FREQUENCY - 3)
    print(f"-- the accelerator path on this CPU, eager and compiled (batch 512, {periods} "
          "whole periods) --")
    print(f"{'':20} {'step ms':>9} {'opt ms':>8}")
    for name in trainers:
        print(f"{name:20} {step_t[name].amortized() * 1e3:9.1f} "
              f"{opt_t[name].amortized() * 1e3:8.1f}")
    if "meta" in trainers:
        meta = opt_t["meta"].amortized()
        print("optimizer step / Meta's: " + ", ".join(
            f"{name} {opt_t[name].amortized() / meta:.2f}" for name in trainers if name != "meta"))


def _torch_memory(names: list[str]) -> None:
    """Peak RSS of 110 steps (batch 512) in a fresh process per optimizer."""
    peaks = {}
    states = {}
    for name in ["none", *names]:
        out = subprocess.run(
            [sys.executable, "-m", "shampoo_conformance.bench.anchors", "--memory-of", name],
            check=True, capture_output=True, text=True,
        ).stdout.split()
        peaks[name], states[name] = float(out[0]), float(out[1])
    print(f"-- memory: peak RSS over forward/backward only ({peaks['none']:.0f} MiB), "
          f"{MEMORY_STEPS} steps, batch 512; optimizer state --")
    for name in names:
        print(f"{name:8} +{peaks[name] - peaks['none']:6.0f} MiB   state {states[name]:6.1f} MiB")
    if "meta" in peaks:
        ours, meta = peaks["ours"] - peaks["none"], peaks["meta"] - peaks["none"]
        print(f"ours / Meta peak over baseline {ours / meta:.2f}; "
              f"ours peak / ours state {ours / states['ours']:.2f}")


def _memory_of(name: str) -> None:
    """Child process: run MEMORY_STEPS steps, print peak RSS (MiB) and state (MiB)."""
    import torch

    from shampoo_conformance.bench import torch_step

    torch.set_num_threads(2)
    if name == "none":
        tr = torch_step.Trainer("none", lambda p: torch.optim.SGD(p, lr=0.0))
        for _ in range(MEMORY_STEPS):
            tr.opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(tr.model(tr.x), tr.y).backward()
        state = 0
    else:
        tr = torch_step.Trainer(name, torch_optimizers()[name])
        tr.run(MEMORY_STEPS, record=False)
        state = _state_bytes(tr.opt, tr.model)
    print(f"{_peak_rss_mib():.1f} {state / 2**20:.2f}")


# ------------------------------------------------------------------------- JAX
def jax_side(batches: list[int], periods: int, large_period: int) -> None:
    import jax
    import jax.numpy as jnp
    import optax

    from shampoo_conformance.bench import jax_step
    from shampoo_jax import shampoo
    from shampoo_spec import from_google

    opts: dict[str, optax.GradientTransformation] = {
        "ours": shampoo(from_google(GOOGLE_KWARGS, x64=False)),
    }
    try:
        from precondition import distributed_shampoo as ds

        from shampoo_conformance.thirdparty.google import google_kwargs
    except ImportError:
        print("Google's library is not installed: " + _install("google"))
    else:
        opts["google"] = ds.distributed_shampoo(**google_kwargs(GOOGLE_KWARGS))
    opts["adamw"] = optax.adamw(1e-3)
    print(f"\n== JAX {jax.__version__}: {', '.join(opts)} "
          "(same kwargs; ours through from_google) ==")
    params = jax_step.init_mlp(jax.random.PRNGKey(2))
    grads = jax.tree.map(jnp.ones_like, params)
    # Temporaries of the update alone, and of the same update with the state
    # donated (as a training step donates it: XLA may then add copies).
    print(f"{'':8} {'state MiB':>9} {'update temp MiB':>15} {'donated':>8}"
          f" {'(temp+state)/state':>18}")
    for name, opt in opts.items():
        state = opt.init(params)
        temps = []
        for donate in ((), (1,)):
            update = jax.jit(opt.update, donate_argnums=donate).lower(
                grads, state, params).compile()
            temps.append(getattr(update.memory_analysis(), "temp_size_in_bytes", float("nan")))
        size = sum(leaf.nbytes for leaf in jax.tree.leaves(state) if hasattr(leaf, "nbytes"))
        over = (size + temps[0]) / size if size else float("nan")
        print(f"{name:8} {size / 2**20:9.1f} {temps[0] / 2**20:15.1f} {temps[1] / 2**20:8.1f}"
              f" {over:18.2f}")
    for batch in batches:
        period = FREQUENCY if batch <= 1024 else large_period
        key = jax.random.PRNGKey(0)
        x = jax.random.normal(key, (batch, jax_step.SIZES[0]), jnp.float32)
        y = jax.random.randint(jax.random.PRNGKey(1), (batch,), 0, jax_step.SIZES[-1])
        small_x, small_y = x[:WARMUP_BATCH], y[:WARMUP_BATCH]
        compiled, state, first, timing = {}, {}, {}, {}
        for name, opt in opts.items():
            p = jax_step.init_mlp(jax.random.PRNGKey(2))
            t0 = time.perf_counter()
            compiled[name] = jax_step.make_step(opt).lower(p, opt.init(p), x, y).compile()
            p, s, _ = compiled[name](p, opt.init(p), x, y)  # count 0: a root step for both
            jax.block_until_ready(s)
            first[name] = time.perf_counter() - t0
            # On to the next root step (count 100) at a small batch (its own program).
            warm = jax_step.make_step(opt)
            for _ in range(FREQUENCY - 1):
                p, s, _ = warm(p, s, small_x, small_y)
            jax.block_until_ready(s)
            state[name], timing[name] = (p, s), Timing()
        step = FREQUENCY
        for _ in range(periods):
            for name in opts:
                p, s = state[name]
                for i in range(period):
                    t0 = time.perf_counter()
                    p, s, loss = compiled[name](p, s, x, y)
                    jax.block_until_ready(loss)
                    timing[name].add(step + i, time.perf_counter() - t0)
                state[name] = (p, s)
            step += period
        how = ("whole periods" if period == FREQUENCY
               else f"stretches of {period} steps, root step amortized by formula")
        print(f"-- batch {batch} ({periods} x {how}) --")
        print(f"{'':8} {'step ms':>9} {'p99 ms':>8} {'root ms':>8} {'/ AdamW':>8} "
              f"{'compile+first s':>15}")
        adam = timing.get("adamw")
        for name in opts:
            t = timing[name]
            root = statistics.fmean(t.root) * 1e3 if t.root else float("nan")
            ratio = t.amortized() / adam.amortized() if adam else float("nan")
            print(f"{name:8} {t.amortized() * 1e3:9.1f} {t.p99() * 1e3:8.1f} {root:8.0f} "
                  f"{ratio:8.2f} {first[name]:15.1f}")
        if "google" in opts:
            print(f"ours / Google: whole step "
                  f"{timing['ours'].amortized() / timing['google'].amortized():.2f}, "
                  f"compile + first step {first['ours'] / first['google']:.2f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frameworks", nargs="+", default=["torch", "jax"], choices=["torch", "jax"])
    ap.add_argument("--batches", type=int, nargs="+", default=[512, 8192])
    ap.add_argument("--periods", type=int, default=2, help="timed stretches per optimizer")
    ap.add_argument("--large-period", type=int, default=10,
                    help="steps per stretch for batches > 1024 (root step by formula)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--memory-of", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.memory_of:
        _memory_of(args.memory_of)
        return
    if "torch" in args.frameworks:
        torch_side(args.batches, args.periods, args.large_period, args.threads)
    if "jax" in args.frameworks:
        jax_side(args.batches, args.periods, args.large_period)


if __name__ == "__main__":
    main()
