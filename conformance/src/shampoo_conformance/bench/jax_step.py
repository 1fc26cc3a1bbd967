"""Benchmark: Shampoo vs optax.adamw on an MLP, whole training steps, side by side.

``python -m shampoo_conformance.bench.jax_step [--batches 512 16384] [--periods 2] [--period 100]``

Model: MLP 512 -> 1024 -> 1024 -> 1024 -> 10 (ReLU), softmax cross-entropy,
float32, random data. Each optimizer gets one jitted training step
(forward, backward, update, parameters and state donated). Shampoo:
``max_preconditioner_dim=1024``, ``precondition_frequency=100``, AdaGrad
grafting. The two optimizers alternate in one run over whole amortization
periods (``--period`` steps, default 100 = the precondition frequency), so
each Shampoo period contains exactly one root step, and the reported ratio
is amortized. With ``--period`` smaller than 100 (for the slow large batch)
the root step is timed separately and amortized by the formula
(root + (f - 1) * non_root) / f, which the output says.

Also printed: compile times, and the optimizer update alone (non-root step)
as a FLOP rate against a measured float32 matmul rate. Prints, never asserts.
"""

from __future__ import annotations

import argparse
import os

# jaxlib's CPU eigh splits a batch over XLA's threads, and each thread calls
# scipy's OpenBLAS; with OpenBLAS multithreaded (its default) two concurrent
# calls deadlock (seen with jaxlib 0.10.2 on 2 cores: every thread idle, one in
# exec_blas_async_wait). One OpenBLAS thread avoids it; XLA still uses every
# core. Must be set before scipy's OpenBLAS loads (jax loads it lazily).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import platform
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import shampoo_spec as ss
from shampoo_jax import blocks as B
from shampoo_jax import shampoo

SIZES = (512, 1024, 1024, 1024, 10)
FREQUENCY = 100


def shampoo_config() -> ss.ShampooConfig:
    return ss.ShampooConfig(
        learning_rate=1e-3,
        epsilon=ss.EpsilonConfig(value=1e-6),
        grafting=ss.GraftingConfig(type="adagrad"),
        blocking=ss.BlockingConfig(max_preconditioner_dim=1024),
        schedule=ss.ScheduleConfig(precondition_frequency=FREQUENCY, start_preconditioning_step=1),
    )


def init_mlp(key: jax.Array) -> dict[str, jax.Array]:
    params = {}
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:], strict=True)):
        key, sub = jax.random.split(key)
        params[f"w{i}"] = jax.random.normal(sub, (a, b), jnp.float32) * np.sqrt(2.0 / a)
        params[f"b{i}"] = jnp.zeros((b,), jnp.float32)
    return params


def loss_fn(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    h = x
    n = len(SIZES) - 1
    for i in range(n):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < n - 1:
            h = jax.nn.relu(h)
    loss: jax.Array = optax.softmax_cross_entropy_with_integer_labels(h, y).mean()
    return loss


def make_step(opt: optax.GradientTransformation) -> Any:
    def step(p: Any, s: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    return jax.jit(step, donate_argnums=(0, 1))


def update_flops(params: dict[str, jax.Array], config: ss.ShampooConfig) -> float:
    """Matmul FLOPs of one non-root Shampoo update: statistics (eq. 6) + eq. (16)."""
    shapes = tuple(tuple(v.shape) for v in jax.tree.leaves(params))
    layout = B.make_layout(shapes, config)
    flops = 0.0
    for grp in layout.groups:
        numel = float(np.prod(grp.shape))
        for k in grp.preconditioned_dims:
            n = grp.shape[k]
            flops += grp.size * (2.0 * n * numel + 2.0 * n * numel)  # G G^T and X G
    return flops


def matmul_rate(n: int = 2048, reps: int = 5) -> float:
    a = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(reps):
        f(a).block_until_ready()
    return 2.0 * n**3 * reps / (time.perf_counter() - t0)


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    return out, time.perf_counter() - t0


def bench_batch(batch: int, periods: int, period: int) -> dict[str, float]:
    key = jax.random.PRNGKey(0)
    kx, ky = jax.random.split(key)
    x = jax.random.normal(kx, (batch, SIZES[0]), jnp.float32)
    y = jax.random.randint(ky, (batch,), 0, SIZES[-1])
    opts = {
        "shampoo": shampoo(shampoo_config()),
        "adamw": optax.adamw(1e-3, weight_decay=1e-4),
    }
    state: dict[str, Any] = {}
    compile_s: dict[str, float] = {}
    steps: dict[str, Any] = {}
    for name, opt in opts.items():
        p = init_mlp(jax.random.PRNGKey(2))
        s = opt.init(p)
        step = make_step(opt)
        t0 = time.perf_counter()
        compiled = step.lower(p, s, x, y).compile()
        compile_s[name] = time.perf_counter() - t0
        steps[name] = compiled
        state[name] = (p, s)
    # Warm-up one step each (Shampoo's step 1 is a root step: start = 1).
    root_s = {}
    for name in opts:
        (p, s, _), dt = timed(steps[name], *state[name], x, y)
        state[name] = (p, s)
        root_s[name] = dt
    times: dict[str, list[float]] = {name: [] for name in opts}
    for _ in range(periods):
        for name in opts:
            p, s = state[name]
            t0 = time.perf_counter()
            for _ in range(period):
                p, s, loss = steps[name](p, s, x, y)
            jax.block_until_ready((p, s, loss))
            times[name].append((time.perf_counter() - t0) / period)
            state[name] = (p, s)
    out = {f"compile_{k}": v for k, v in compile_s.items()}
    for name in opts:
        out[f"step_{name}"] = float(np.median(times[name]))
    out["shampoo_count"] = float(state["shampoo"][1].count)
    if period < FREQUENCY:
        # Whole periods of 100 steps are too slow at a large batch on a small
        # machine: amortize the root step (step 1, start = 1) by formula.
        dt_root = root_s["shampoo"]
        non_root = out["step_shampoo"]
        out["step_shampoo_amortized"] = (dt_root + (FREQUENCY - 1) * non_root) / FREQUENCY
        out["root_step_shampoo"] = dt_root
    else:
        out["step_shampoo_amortized"] = out["step_shampoo"]
    return out


def bench_update_rate(reps: int = 10) -> dict[str, float]:
    """The Shampoo update alone (gradients given), non-root steps, as FLOP/s."""
    config = shampoo_config()
    opt = shampoo(config)
    p = init_mlp(jax.random.PRNGKey(2))
    g = jax.tree.map(lambda v: jax.random.normal(jax.random.PRNGKey(3), v.shape, v.dtype), p)
    s = opt.init(p)
    update = jax.jit(lambda g, s, p: opt.update(g, s, p), donate_argnums=(1,))
    u, s = update(g, s, p)  # step 1: root step (start = 1)
    jax.block_until_ready(s)
    t0 = time.perf_counter()
    for _ in range(reps):
        u, s = update(g, s, p)
    jax.block_until_ready((u, s))
    dt = (time.perf_counter() - t0) / reps
    flops = update_flops(p, config)
    return {"update_s": dt, "update_flops": flops, "update_rate": flops / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[512, 16384])
    ap.add_argument("--periods", type=int, default=2)
    ap.add_argument("--period", type=int, default=FREQUENCY,
                    help="steps per timed period (default: one amortization period)")
    ap.add_argument("--large-period", type=int, default=10,
                    help="steps per period for batches >= 4096 (root step amortized by formula)")
    args = ap.parse_args()
    cpu = platform.processor() or platform.machine()
    flags = os.environ.get("XLA_FLAGS", "")
    print(f"jax {jax.__version__}, optax {optax.__version__}, {cpu}, {os.cpu_count()} cpus, "
          f"devices {jax.devices()}, XLA_FLAGS={flags!r}")
    rate = matmul_rate()
    print(f"float32 matmul (2048^3, jitted): {rate / 1e9:.1f} GFLOP/s")
    up = bench_update_rate()
    print(f"Shampoo update alone (non-root step): {up['update_s'] * 1e3:.1f} ms, "
          f"{up['update_flops'] / 1e9:.2f} GFLOP of matmuls -> "
          f"{up['update_rate'] / 1e9:.1f} GFLOP/s "
          f"= {100 * up['update_rate'] / rate:.0f}% of the matmul rate")
    for batch in args.batches:
        period = args.period if batch < 4096 else min(args.period, args.large_period)
        r = bench_batch(batch, args.periods, period)
        line = (f"batch {batch}: compile shampoo {r['compile_shampoo']:.2f} s, adamw "
                f"{r['compile_adamw']:.2f} s; step adamw {r['step_adamw'] * 1e3:.1f} ms, shampoo "
                f"{r['step_shampoo'] * 1e3:.1f} ms")
        if period < FREQUENCY:
            line += (f" (non-root; root step {r['root_step_shampoo'] * 1e3:.0f} ms, amortized "
                     f"over {FREQUENCY}: {r['step_shampoo_amortized'] * 1e3:.1f} ms)")
        else:
            line += f" (amortized: each {period}-step period holds one root step)"
        ratio = r["step_shampoo_amortized"] / r["step_adamw"]
        print(line + f"; ratio shampoo/adamw = {ratio:.2f}x")


if __name__ == "__main__":
    main()
