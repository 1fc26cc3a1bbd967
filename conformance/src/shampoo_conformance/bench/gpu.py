"""The prepared check for the day a GPU is lent (``nox -s gpu``): one short script.

On a CUDA device (the default where one is present) it prints, in one run:

1. which path the device takes (``shampoo_torch.describe``);
2. agreement: ours on the device against the float64 reference, 12 steps with
   fixed gradients (root steps included) at Meta's arguments and at the spec's
   defaults, parameters and factors in float64, as
   ``max |W - W_ref| / max |W_ref - W_0|``, at most 1e-8 (the anchors' bound);
3. what a GPU pays for in one non-root step (leaf ops and host syncs,
   :mod:`.launches`) for ours, Meta's library (where installed) and AdamW;
4. step time on the benchmark MLP (batch 512), ours, Meta's and AdamW side by side,
   synchronized, median of ``--steps`` steps after warm-up.

``--device cpu`` runs the same on this CPU under ``SHAMPOO_TORCH_PATH=accelerator``
(a dry run of the script; CI runs it with ``--steps 2``). Exit status 1 if an
agreement exceeds its bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from typing import Any

#: Meta's arguments at small blocks and frequent roots, with epsilon 1e-6: at its 1e-12,
#: a dozen steps leave these factors near singular and their roots amplify float64
#: rounding to ~1e-5 relative on any device (conditioning, not the device; measured).
SMALL_META = {"lr": 1e-2, "betas": [0.9, 0.999], "epsilon": 1e-6, "max_preconditioner_dim": 8,
              "precondition_frequency": 3, "start_preconditioning_step": 3,
              "grafting_config": {"type": "AdaGradPreconditionerConfig", "epsilon": 1e-8}}
#: The agreement bound in float64 (relative to the displacement).
BOUND = 1e-8
SHAPES = {"w": (12, 10), "b": (10,), "conv": (4, 3, 2, 2)}


def agreement(config: Any, device: str, steps: int = 12, ours_config: Any = None) -> float:
    """``max |W - W_ref| / max |W_ref - W_0|`` over the parameters after ``steps`` steps:
    ours on ``device`` at ``ours_config`` (None: ``config``), the reference at ``config``."""
    import numpy as np
    import torch

    from shampoo_reference import run as reference_run
    from shampoo_torch import Shampoo

    # Factors in float64, as the reference's.
    config = dataclasses.replace(config, factor_dtype="float64")
    ours_config = dataclasses.replace(ours_config or config, factor_dtype="float64")
    rng = np.random.default_rng(0)
    params = {name: rng.standard_normal(shape) for name, shape in SHAPES.items()}
    grads = [{name: rng.standard_normal(shape) for name, shape in SHAPES.items()}
             for _ in range(steps)]
    ours = {name: torch.tensor(p, dtype=torch.float64, device=device, requires_grad=True)
            for name, p in params.items()}
    opt = Shampoo(list(ours.values()), ours_config)
    for g in grads:
        for name, p in ours.items():
            p.grad = torch.tensor(g[name], dtype=torch.float64, device=device)
        opt.step()
    want = reference_run(config, {n: p.copy() for n, p in params.items()}, grads)[-1]
    err = max(float(np.abs(ours[n].detach().cpu().numpy() - want[n]).max()) for n in SHAPES)
    moved = max(float(np.abs(want[n] - params[n]).max()) for n in SHAPES)
    return err / moved


def step_times(device: str, steps: int, sizes: tuple[int, ...]) -> dict[str, float]:
    """Median whole training step (ms) per optimizer on an MLP of ``sizes``, synchronized."""
    import torch

    from shampoo_conformance.bench import anchors, torch_step

    out = {}
    for name, make in {**anchors.torch_optimizers(), "compiled": anchors.ours_compiled()}.items():
        model = torch_step.make_model(sizes=sizes).to(device)
        opt = make(model.parameters())
        x = torch.randn(512, sizes[0], device=device)
        times = []
        for t in range(anchors.FREQUENCY + 1 + steps):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            model(x).float().pow(2).mean().backward()
            opt.step()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            if t > anchors.FREQUENCY:
                times.append(time.perf_counter() - start)
        out[name] = statistics.median(times) * 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    from shampoo_conformance.bench import anchors, launches, torch_step
    from shampoo_spec import ShampooConfig, from_meta
    from shampoo_torch import describe

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per optimizer")
    parser.add_argument("--quick", action="store_true",
                        help="a small MLP (64-128-128-10) in place of the benchmark's")
    args = parser.parse_args(argv)
    if not args.device.startswith("cuda"):
        os.environ["SHAMPOO_TORCH_PATH"] = "accelerator"  # the dry run: a CUDA device's path
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    print(f"== {name}, torch {torch.__version__}: {describe(args.device)} ==")
    failed = False
    for label, config in (("Meta's arguments", from_meta(SMALL_META)),
                          ("spec defaults", ShampooConfig())):
        rel = agreement(config, args.device)
        failed |= not rel <= BOUND
        print(f"agreement with the float64 reference, {label}: {rel:.2e} "
              f"({'within' if rel <= BOUND else 'OVER'} {BOUND:.0e})")
    sizes = (64, 128, 128, 10) if args.quick else torch_step.SIZES
    print(f"MLP {'-'.join(map(str, sizes))}, the benchmark's arguments (roots every "
          f"{anchors.FREQUENCY} steps)")
    x = torch.randn(64, sizes[0], device=args.device)
    for kind, make in {**anchors.torch_optimizers(), "compiled": anchors.ours_compiled()}.items():
        model = torch_step.make_model(sizes=sizes).to(args.device)
        ops, syncs, _ = launches.count_step(model, make, x, warmup=anchors.FREQUENCY + 3)
        print(f"{kind:8} one non-root step: {ops} leaf ops, {syncs} host syncs")
    times = step_times(args.device, args.steps, sizes)
    print("median training step (batch 512): " + ", ".join(
        f"{k} {v:.2f} ms" for k, v in times.items()))
    if "meta" in times:
        print(f"ours / Meta: {times['ours'] / times['meta']:.2f}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
