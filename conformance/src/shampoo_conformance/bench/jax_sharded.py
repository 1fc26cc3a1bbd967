"""Benchmark: the sharded transformation on N host devices vs one device.

``python -m shampoo_conformance.bench.jax_sharded [--devices 4] [--steps 5]``

Model and config: those of :mod:`shampoo_conformance.bench.jax_step` (MLP 512 -> 1024 ->
1024 -> 1024 -> 10, ``max_preconditioner_dim=1024``, AdaGrad grafting,
``precondition_frequency=100``, roots at step 1). The optimizer update
alone is timed (fixed random gradients, one jitted step = update + apply),
so the numbers are about Shampoo, not the model.

Printed per device count:

- root work per device: the factor matrices a device decomposes on a root
  step and the sum of ``n^3`` over them (an eigendecomposition costs
  ``c * n^3``), on CPU (padding skipped) and for a batched eigh (padding
  decomposed too); exact, from the layout and the placement;
- optimizer state bytes per device: the block state (factors, inverse roots,
  counters; sharded) and the whole state (elementwise states replicated),
  read from the arrays' shards on device 0; exact;
- compile time, the root step (step 1) and the median non-root step.

On a CPU host the N "devices" share the machine's cores, so the time
ratios do not show the speed-up N accelerators would give (they show the
overhead of the collectives and the padding); the work and bytes per
device are the hardware-independent figures. Prints, never asserts.
"""

from __future__ import annotations

import argparse
import os
import re

_FLAG = "--xla_force_host_platform_device_count"


def _request_devices(n: int) -> None:
    """Ask XLA for n host devices; must run before jax initialises its backend."""
    flags = re.sub(rf"{_FLAG}=\S*", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags.strip()} {_FLAG}={n}".strip()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # see shampoo_jax.roots.regularize.eigh


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--devices", type=int, default=4, help="N (compared with one device)")
    ap.add_argument("--steps", type=int, default=5, help="non-root steps timed (median)")
    ap.add_argument("--max-dim", type=int, default=1024,
                    help="max_preconditioner_dim (jax_step.py: 1024; smaller: more, smaller "
                    "blocks)")
    args, _ = ap.parse_known_args()  # `nox -s bench -- ARGS` passes every bench the same args
    return args


if __name__ == "__main__":
    _request_devices(_parse().devices)

import dataclasses  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import shampoo_spec as ss  # noqa: E402
from shampoo_conformance.bench.jax_step import init_mlp, shampoo_config  # noqa: E402
from shampoo_jax import ShardingConfig, shampoo  # noqa: E402
from shampoo_jax import blocks as B  # noqa: E402
from shampoo_jax.placement import placement  # noqa: E402


def root_work(layout: B.Layout, sharding: ShardingConfig | None) -> dict[str, float]:
    """Per device on a root step: factors decomposed and their sum of ``n^3`` (max over devices).

    Device d owns slots ``[d c, (d + 1) c)`` of each padded group stack
    (:func:`shampoo_jax.placement.placement` puts the real blocks). ``real``:
    the real blocks only (CPU: padding is not decomposed, see roots.regularize.eigh);
    ``padded``: every slot (a batched eigh, as on GPU/TPU, decomposes the
    padding too).
    """
    n_dev = 1 if sharding is None else sharding.size
    real_f, real_c = [0] * n_dev, [0.0] * n_dev
    pad_f, pad_c = [0] * n_dev, [0.0] * n_dev
    sizes = tuple(grp.size for grp in layout.groups)
    costs = tuple(float(sum(grp.shape[k] ** 3 for k in grp.preconditioned_dims))
                  for grp in layout.groups)
    slots = placement(sizes, costs, n_dev)
    for grp, cost, sl in zip(layout.groups, costs, slots, strict=True):
        nf = len(grp.preconditioned_dims)
        per = -(-grp.size // n_dev)
        for d in range(n_dev):
            pad_f[d] += per * nf
            pad_c[d] += per * cost
        for slot in sl:
            real_f[slot // per] += nf
            real_c[slot // per] += cost
    return {"real_factors": max(real_f), "real_cubes": max(real_c),
            "real_cubes_min": min(real_c), "padded_factors": max(pad_f),
            "padded_cubes": max(pad_c)}


def state_bytes(state: Any, device: jax.Device) -> tuple[int, int]:
    """(block-state bytes, whole-state bytes) held on ``device``."""
    def on(tree: Any) -> int:
        total = 0
        for x in jax.tree.leaves(tree):
            total += sum(s.data.nbytes for s in x.addressable_shards if s.device == device)
        return total

    return on(state.groups), on(state)


def bench(n: int | None, steps: int, max_dim: int) -> dict[str, float]:
    config = dataclasses.replace(
        shampoo_config(), blocking=ss.BlockingConfig(max_preconditioner_dim=max_dim)
    )
    params = init_mlp(jax.random.PRNGKey(2))
    grads = jax.tree.map(
        lambda v: jax.random.normal(jax.random.PRNGKey(3), v.shape, v.dtype), params
    )
    layout = B.make_layout(tuple(tuple(v.shape) for v in jax.tree.leaves(params)), config)
    sharding = None
    if n is not None:
        sharding = ShardingConfig(Mesh(np.array(jax.devices()[:n]), ("blocks",)), "blocks")
        params = jax.device_put(params, sharding.replicated)
        grads = jax.device_put(grads, sharding.replicated)
    opt = shampoo(config, sharding=sharding)

    def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    s = opt.init(params)
    out: dict[str, float] = dict(root_work(layout, sharding))
    out["block_bytes"], out["state_bytes"] = state_bytes(s, jax.devices()[0])
    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, s, grads).compile()
    out["compile_s"] = time.perf_counter() - t0
    p = params
    t0 = time.perf_counter()
    p, s = compiled(p, s, grads)  # step 1: a root step (start_preconditioning_step = 1)
    jax.block_until_ready((p, s))
    out["root_step_s"] = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        p, s = compiled(p, s, grads)
        jax.block_until_ready((p, s))
        times.append(time.perf_counter() - t0)
    out["step_s"] = statistics.median(times)
    return out


def main() -> None:
    args = _parse()
    n = args.devices
    if len(jax.devices()) < n:
        raise SystemExit(f"{n} devices needed, found {len(jax.devices())}: set XLA_FLAGS="
                         f"{_FLAG}={n} before jax starts (running this module does).")
    cpu = platform.processor() or platform.machine()
    print(f"jax {jax.__version__}, {cpu}, {os.cpu_count()} cpus, {len(jax.devices())} "
          f"devices, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print("model: jax_step.py's MLP 512-1024-1024-1024-10, Shampoo update + apply alone, float32, "
          f"max_preconditioner_dim={args.max_dim}")
    one = bench(None, args.steps, args.max_dim)
    many = bench(n, args.steps, args.max_dim)
    rows = [
        ("factors decomposed per device, CPU (max)", "real_factors", "{:.0f}"),
        ("root work per device, CPU: sum n^3 (max)", "real_cubes", "{:.3g}"),
        ("root work per device, CPU: sum n^3 (min)", "real_cubes_min", "{:.3g}"),
        ("factors per device, batched eigh (max)", "padded_factors", "{:.0f}"),
        ("root work per device, batched: sum n^3", "padded_cubes", "{:.3g}"),
        ("block-state bytes per device", "block_bytes", "{:,.0f}"),
        ("whole-state bytes per device", "state_bytes", "{:,.0f}"),
        ("compile (s)", "compile_s", "{:.2f}"),
        ("root step (s)", "root_step_s", "{:.3f}"),
        ("non-root step, median (s)", "step_s", "{:.4f}"),
    ]
    print(f"| quantity | 1 device | {n} devices | ratio {n}/1 |")
    print("|---|---|---|---|")
    for label, key, fmt in rows:
        ratio = many[key] / one[key] if one[key] else float("nan")
        print(f"| {label} | {fmt.format(one[key])} | {fmt.format(many[key])} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
