"""Benchmark: what each preconditioner family costs against classic Shampoo and AdamW.

``python -m shampoo_conformance.bench.torch_variants [--period 100] [--periods 2] [--threads 2]``

The model and data of :mod:`shampoo_conformance.bench.torch_step` (MLP 512 -> 1024 -> 1024 ->
1024 -> 10, batch 512, float32). Every variant is that benchmark's Shampoo
(Meta's defaults through ``from_meta``: blocks up to 1024, AdaGrad graft,
roots every ``period`` steps from step ``period``) with one option changed:

- ``kl``: KL-Shampoo statistics (eq. 6b);
- ``spectral``: spectral descent by Newton-Schulz (eq. 16c; vectors skipped
  to the graft, ``skip_rank_lt=2``);
- ``sign``: sign descent as the preconditioner (eq. 16b), AdaGrad-grafted;
- ``diagonal_adam``: Meta's Adam as the preconditioner, no graft (Adam's step);
- ``gpa`` and ``schedule_free``: iterate averaging (eq. 20d) in place of
  nothing (the base has no momentum);
- ``low_rank``: low-rank inverse roots of rank 64 (eq. 10c, Google's
  ``compression_rank``; the same eigendecomposition, the n x n root kept);
- ``frequent_directions``: sketches of rank 64 (eqs. 6c, 10d, Google's
  ``frequent_directions`` with ``average_grad``): the gradients summed every
  step, one observation folded into each sketch per period (statistics on
  the root steps, as the rule requires; no bias correction).
- ``sketchy_tearfree``: tearfree's Sketchy (eq. 10e), every factor sketched
  at rank 64, statistics on the root steps as ``frequent_directions``;
- ``eigendecomposed_qr``: Meta's Eigendecomposed Shampoo with
  ``QREigendecompositionConfig`` (eq. 10f: one QR step from the stored
  eigenbasis in place of eigh);
- ``coupled_newton`` and ``coupled_newton_deflated``: Google's coupled
  Newton root (eq. 11, relative epsilon 1e-6 as Google's default), without
  and with its top-16 LOBPCG deflation (eq. 11d, ``lobpcg_topk_precondition``);
- ``adafactor_graft``: tearfree's Adafactor graft (eq. 14e, optax's defaults:
  decay exponent 0.8, parameter scale floor 1e-3) in place of AdaGrad.

Each runs in turn, whole amortization periods interleaved (Shampoo, AdamW,
the variants, repeated), after a warm-up past the start step, so every
ratio compares like for like on the same machine state. It prints the mean
whole training step, its ratio to Shampoo's and AdamW's, and the optimizer
state (bytes of every state tensor). It prints and never asserts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch

from shampoo_conformance.bench.torch_step import (
    SIZES,
    Trainer,
    diagonal_config,
    parse_args,
    shampoo_config,
    state_bytes,
)
from shampoo_spec import (
    BlockingConfig,
    CoupledNewtonConfig,
    DiagonalPreconditionerConfig,
    EpsilonConfig,
    FrequentDirectionsConfig,
    GraftingConfig,
    IterateAveragingConfig,
    LowRankRootConfig,
    ShampooConfig,
    SpectralDescentConfig,
)
from shampoo_torch import Shampoo


def variants(period: int) -> dict[str, ShampooConfig]:
    """The base config (:func:`.torch_step.shampoo_config`) and each variant."""
    base = shampoo_config(period)
    replace = dataclasses.replace
    blocking = base.blocking
    # Google's relative epsilon: with Meta's absolute 1e-12 the iteration on
    # these ill-conditioned factors would run to its 100-iteration cap.
    newton_epsilon = EpsilonConfig(value=1e-6, scale="relative")
    return {
        "shampoo": base,
        "kl": replace(base, statistics=replace(base.statistics, kl=True)),
        "spectral": replace(base, spectral=SpectralDescentConfig(), blocking=BlockingConfig(
            max_preconditioner_dim=blocking.max_preconditioner_dim,
            merge_dims_up_to=blocking.merge_dims_up_to, merge_target_rank=2, skip_rank_lt=2)),
        "sign": replace(base, diagonal=DiagonalPreconditionerConfig(type="sign")),
        "diagonal_adam": diagonal_config(),
        "gpa": replace(base, averaging=IterateAveragingConfig(type="gpa")),
        "schedule_free": replace(base, averaging=IterateAveragingConfig(type="schedule_free")),
        "low_rank": replace(base, low_rank=LowRankRootConfig(rank=64)),
        "frequent_directions": replace(
            base, frequent_directions=FrequentDirectionsConfig(rank=64, average_gradients=True),
            statistics=replace(base.statistics, bias_correction=False),
            schedule=replace(base.schedule, statistics_frequency=period)),
        "sketchy_tearfree": replace(
            base, frequent_directions=FrequentDirectionsConfig(rank=64, rule="tearfree"),
            statistics=replace(base.statistics, bias_correction=False),
            schedule=replace(base.schedule, statistics_frequency=period)),
        "eigendecomposed_qr": replace(base, root_inverse=replace(
            base.root_inverse, eigenbasis_method="qr", qr_max_iterations=1)),
        "coupled_newton": replace(base, root_inverse=CoupledNewtonConfig(),
                                  epsilon=newton_epsilon),
        "coupled_newton_deflated": replace(
            base, root_inverse=CoupledNewtonConfig(deflation_rank=16), epsilon=newton_epsilon),
        "adafactor_graft": replace(base, grafting=GraftingConfig(
            type="adafactor", epsilon=1e-30, epsilon_placement="inside_sqrt",
            decay_exponent=0.8, parameter_scale_floor=1e-3)),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv, __doc__.splitlines()[0])

    def make(
        config: ShampooConfig,
    ) -> Callable[[Iterator[torch.nn.Parameter]], torch.optim.Optimizer]:
        return lambda p: Shampoo(p, config)

    trainers: dict[str, Trainer[torch.optim.Optimizer]] = {
        name: Trainer(name, make(config)) for name, config in variants(args.period).items()}
    trainers["adamw"] = Trainer("AdamW", lambda p: torch.optim.AdamW(p, lr=1e-3))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, MLP {SIZES}, "
          f"period {args.period} x {args.periods} interleaved, float32")
    for t in trainers.values():
        t.run(args.period, record=False)  # past the start step
    for _ in range(args.periods):
        for t in trainers.values():
            t.run(args.period)

    def ms(xs: list[float]) -> float:
        return 1e3 * sum(xs) / len(xs)

    shampoo, adamw = ms(trainers["shampoo"].step_times), ms(trainers["adamw"].step_times)
    print(f"{'variant':24} {'step ms':>9} {'/ Shampoo':>10} {'/ AdamW':>8} {'state MiB':>10}")
    for name, t in trainers.items():
        step = ms(t.step_times)
        print(f"{name:24} {step:9.1f} {step / shampoo:10.2f} {step / adamw:8.2f} "
              f"{state_bytes(t.opt) / 2**20:10.1f}")


if __name__ == "__main__":
    main()
