"""Benchmark: a whole training step with Shampoo vs AdamW, and the step's FLOP rate.

``python -m shampoo_conformance.bench.torch_step [--period 100] [--periods 2] [--threads 2]``

Model: MLP 512 -> 1024 -> 1024 -> 1024 -> 10 (about 2.6M parameters), cross
entropy, float32, batch 512 of random data. Shampoo: Meta's defaults through
``from_meta`` with max_preconditioner_dim 1024, precondition_frequency 100 and
AdaGrad grafting (so dims merge up to 1024, start step = frequency). Both
optimizers first warm up past Shampoo's start step, then whole amortization
periods alternate in one run (Shampoo, AdamW, Shampoo, AdamW, ...), each
period containing exactly one root step, so the per-step times compare like
for like on the same machine state.

A third optimizer runs alongside, Shampoo with Meta's
``AdamPreconditionerConfig`` as its preconditioner (eq. 16b, the diagonal
that makes it Adam): what the spec's machinery costs over ``torch.optim.AdamW``
for the same numbers.

It also reports the optimizer step alone (``opt.step()``, non-root steps):
its FLOPs from the shape plan (statistics ``2 n_k |B|`` and preconditioning
``2 n_k |B|`` per block B and preconditioned dim k) divided by its time,
against the measured float32 rate of a 1024 x 1024 matmul. It prints and
never asserts.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import torch

from shampoo_spec import ShampooConfig, from_meta, is_root_step, plan_parameter
from shampoo_torch import Shampoo, gemm
from shampoo_torch.blocks import SYMMETRIC_GRAM_MIN

SIZES: tuple[int, ...] = (512, 1024, 1024, 1024, 10)
BATCH = 512
Opt = TypeVar("Opt", bound=torch.optim.Optimizer)


def make_model(seed: int = 0, sizes: tuple[int, ...] = SIZES) -> torch.nn.Sequential:
    """An MLP of Linear layers ``sizes[0] -> sizes[1] -> ...`` with ReLU between them."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def shampoo_config(period: int = 100) -> ShampooConfig:
    """Meta's defaults (AdaGrad grafting, blocks up to 1024); inverse roots every
    ``period`` steps, used from step ``period`` on."""
    config = from_meta({
        "lr": 1e-3,
        "betas": [0.0, 1.0],
        "epsilon": 1e-12,
        "max_preconditioner_dim": 1024,
        "precondition_frequency": 100,
        "grafting_config": {"type": "AdaGradPreconditionerConfig", "epsilon": 1e-10},
    })
    schedule = dataclasses.replace(config.schedule, precondition_frequency=period,
                                   start_preconditioning_step=period)
    return dataclasses.replace(config, schedule=schedule)


def diagonal_config() -> ShampooConfig:
    """Eq. (16b): Meta's Adam as ``preconditioner_config``, no graft; the step is Adam's."""
    return from_meta({
        "lr": 1e-3, "betas": [0.9, 0.999], "max_preconditioner_dim": 1024,
        "preconditioner_config": {"type": "AdamPreconditionerConfig", "beta2": 0.999,
                                  "epsilon": 1e-8},
    })


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``opt.state_dict()`` (optimizer state only)."""
    total = 0

    def visit(x: object) -> None:
        nonlocal total
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(opt.state_dict()["state"])
    return total


def step_flops(
    model: torch.nn.Module, config: ShampooConfig, triangle_from: float = math.inf
) -> float:
    """FLOPs of statistics and preconditioning in one non-root Shampoo step.

    A factor of size n contracts ``2 n * size`` FLOPs for ``G G^T`` (3/4 of that
    from ``triangle_from`` on: :func:`shampoo_torch.blocks.gram_update_`; ours
    passes ``blocks.SYMMETRIC_GRAM_MIN``, a whole-GEMM library the default) and
    ``2 n * size`` for its mode product.
    """
    total = 0.0
    for p in model.parameters():
        plan = plan_parameter(tuple(p.shape), config)
        if not plan.preconditioned:
            continue
        for block in plan.blocks:
            size = math.prod(block.shape)
            for n, r in zip(block.shape, block.roots, strict=True):
                if r != 0:
                    gram = 0.75 if n >= triangle_from else 1.0
                    total += (gram + 1.0) * 2.0 * n * size
    return total


def matmul_rate(n: int = 1024, repeats: int = 10, trials: int = 5, ours: bool = True) -> float:
    """Best of ``trials`` timings of ``repeats`` float32 n x n matmuls (FLOP/s).

    ``ours``: through :func:`shampoo_torch.gemm.bmm`, the kernel the optimizer's
    products use (oneDNN on CPU); False: ``a @ b``, torch's BLAS (MKL), as
    other libraries call it.
    """
    a, b = torch.randn(1, n, n), torch.randn(1, n, n)

    def product() -> torch.Tensor:
        return gemm.bmm(a, b) if ours else a[0] @ b[0]

    for _ in range(3):
        product()
    best = math.inf
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(repeats):
            product()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 * repeats / best


class Trainer(Generic[Opt]):
    """One model + optimizer; times whole training steps and opt.step() alone."""

    def __init__(
        self, name: str, make_opt: Callable[[Iterator[torch.nn.Parameter]], Opt], seed: int = 0,
        batch: int = BATCH,
    ) -> None:
        self.name = name
        self.model = make_model(seed)
        self.opt = make_opt(self.model.parameters())
        gen = torch.Generator().manual_seed(seed + 1)
        self.x = torch.randn(batch, SIZES[0], generator=gen)
        self.y = torch.randint(0, SIZES[-1], (batch,), generator=gen)
        self.t = 0
        self.step_times: list[float] = []
        self.opt_times: list[tuple[int, float]] = []

    def run(self, steps: int, record: bool = True) -> None:
        for _ in range(steps):
            start = time.perf_counter()
            self.opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(self.model(self.x), self.y)
            loss.backward()
            mid = time.perf_counter()
            self.opt.step()
            end = time.perf_counter()
            self.t += 1
            if record:
                self.step_times.append(end - start)
                self.opt_times.append((self.t, end - mid))
        self.loss = float(loss.detach())


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    """The benchmarks' command line (``--period``, ``--periods``, ``--threads``); sets
    torch's thread count."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--period", type=int, default=100, help="steps per period (= frequency)")
    parser.add_argument("--periods", type=int, default=2, help="measured periods per optimizer")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv, __doc__.splitlines()[0])

    config = shampoo_config(args.period)
    shampoo = Trainer("Shampoo", lambda p: Shampoo(p, config))
    adamw = Trainer("AdamW", lambda p: torch.optim.AdamW(p, lr=1e-3))
    diagonal = Trainer("diagonal Adam", lambda p: Shampoo(p, diagonal_config()))
    n_params = sum(p.numel() for p in shampoo.model.parameters())
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"MLP {SIZES} ({n_params / 1e6:.2f}M params), batch {BATCH}, float32")
    rate_before = matmul_rate()

    # Warm up past the start step (Shampoo's direction is used from t = period on).
    shampoo.run(args.period, record=False)
    adamw.run(10, record=False)
    diagonal.run(10, record=False)
    for _ in range(args.periods):
        shampoo.run(args.period)
        adamw.run(args.period)
        diagonal.run(args.period)
    rate = max(rate_before, matmul_rate())
    print(f"float32 1024x1024 matmul (best of 5, before/after): "
          f"{rate_before / 1e9:.0f} / {rate / 1e9:.0f} GFLOP/s")

    def ms(xs: list[float]) -> float:
        return 1e3 * sum(xs) / len(xs)

    def med(xs: list[float]) -> float:
        return 1e3 * statistics.median(xs)

    s_ms, a_ms = ms(shampoo.step_times), ms(adamw.step_times)
    roots = [dt for t, dt in shampoo.opt_times if is_root_step(t, config.schedule)]
    plain = [dt for t, dt in shampoo.opt_times if not is_root_step(t, config.schedule)]
    adam_opt = [dt for _, dt in adamw.opt_times]
    flops = step_flops(shampoo.model, config, triangle_from=SYMMETRIC_GRAM_MIN)
    print(f"whole training step ({args.periods} interleaved periods of {args.period} steps each,"
          f" one root step per Shampoo period):")
    print(f"  mean    Shampoo {s_ms:7.1f} ms  AdamW {a_ms:7.1f} ms  ratio {s_ms / a_ms:.2f}x")
    print(f"  median  Shampoo {med(shampoo.step_times):7.1f} ms  AdamW "
          f"{med(adamw.step_times):7.1f} ms  ratio "
          f"{med(shampoo.step_times) / med(adamw.step_times):.2f}x")
    print(f"optimizer step alone: Shampoo non-root mean {ms(plain):.1f} / median {med(plain):.1f}"
          f" ms, root step {ms(roots):.0f} ms (x{len(roots)}, amortized "
          f"{sum(roots) * 1e3 / len(shampoo.opt_times):.1f} ms/step); AdamW mean "
          f"{ms(adam_opt):.1f} / median {med(adam_opt):.1f} ms")
    achieved = flops / (med(plain) / 1e3)
    print(f"Shampoo non-root step: {flops / 1e9:.2f} GFLOP (statistics + preconditioning) in "
          f"{med(plain):.1f} ms (median) -> {achieved / 1e9:.0f} GFLOP/s = "
          f"{100 * achieved / rate:.0f}% of the matmul rate")
    d_ms, d_opt = ms(diagonal.step_times), [dt for _, dt in diagonal.opt_times]
    print(f"diagonal Adam (eq. 16b, Shampoo with Meta's AdamPreconditionerConfig): whole step "
          f"mean {d_ms:.1f} ms = {d_ms / a_ms:.2f}x AdamW, {d_ms / s_ms:.2f}x Shampoo; optimizer "
          f"step median {med(d_opt):.1f} ms ({med(d_opt) / med(adam_opt):.2f}x AdamW's); state "
          f"{state_bytes(diagonal.opt) / 2**20:.1f} MiB (AdamW "
          f"{state_bytes(adamw.opt) / 2**20:.1f}, Shampoo {state_bytes(shampoo.opt) / 2**20:.1f})")
    print(f"final loss: Shampoo {shampoo.loss:.4f}, AdamW {adamw.loss:.4f} (random data); "
          f"Shampoo metrics {shampoo.opt.metrics}")


if __name__ == "__main__":
    main()
