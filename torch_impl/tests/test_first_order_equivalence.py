"""Never starting Shampoo (start_preconditioning_step=None) is its grafting optimizer.

With the start step never reached the direction is graft(F~) (eq. 18), so
Shampoo must equal the matching ``torch.optim`` optimizer on the same
gradients. Correspondences (where the two libraries name or default a thing
differently):

- SGD(momentum=mu, nesterov): grafting "sgd", momentum mu (dampening 0).
  Our buffer starts at zero and takes ``(1 - d) P`` on step 1; torch's is set
  to the first gradient. Equal when dampening = 0 (ours: 0 * mu + P = P).
- Adagrad(lr, eps=1e-10, initial_accumulator_value=0, lr_decay=0): grafting
  "adagrad" with epsilon 1e-10; both add eps outside the sqrt.
- RMSprop(alpha=a, eps, centered=False, momentum=0): grafting "rmsprop" with
  beta2 = a, no bias correction; eps outside the sqrt in both.
- Adam(betas=(b1, b2), eps): grafting "adam" (beta2 = b2, bias_correction) and
  gradient_filter beta1 = b1 with bias_correction: our used filter
  ``F_t / (1 - b1 * b1^(t-1)) = F_t / (1 - b1^t)`` is Adam's m-hat.
- AdamW(weight_decay=wd): Adam as above plus weight_decay type "update":
  ``W <- W - lr U - lr wd W`` with the old W, which is torch's
  ``W <- W (1 - lr wd)`` followed by ``W <- W - lr U``. (Type "direction"
  gives the same result here because there is no momentum after it, but
  "update" is the decoupled rule whatever the momentum.)

The same methods as a diagonal preconditioner (eq. 16b: Meta's SGD, AdaGrad,
RMSprop and Adam ``preconditioner_config``) without a graft, from step 1,
equal them too, in blocks and with ``factor_dtype`` float32 (no effect there).

Tolerance: float64, 30 steps; only the order of floating-point operations
differs, so agreement to 1e-12 relative.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from shampoo_spec import (
    BlockingConfig,
    DiagonalPreconditionerConfig,
    GradientFilterConfig,
    GraftingConfig,
    MomentumConfig,
    ScheduleConfig,
    ShampooConfig,
    WeightDecayConfig,
)
from shampoo_torch import Shampoo

LR = 0.05
NEVER = ScheduleConfig(start_preconditioning_step=None)
SHAPES = [(7, 10), (7,), (3, 4, 5), ()]


def config(**kw: object) -> ShampooConfig:
    return ShampooConfig(learning_rate=LR, schedule=NEVER, factor_dtype="float64", **kw)  # type: ignore[arg-type]


def diagonal(**kw: object) -> ShampooConfig:
    """Eq. (16b) from step 1 without a graft: blocks of 4, float32 factor_dtype (no effect)."""
    return ShampooConfig(learning_rate=LR, diagonal=DiagonalPreconditionerConfig(**kw),  # type: ignore[arg-type]
                         blocking=BlockingConfig(max_preconditioner_dim=4))


CASES: dict[str, tuple[ShampooConfig, Callable[[list[torch.Tensor]], torch.optim.Optimizer]]] = {
    "sgd": (config(grafting=GraftingConfig(type="sgd")),
            lambda p: torch.optim.SGD(p, lr=LR)),
    "sgd_momentum": (config(grafting=GraftingConfig(type="sgd"),
                            momentum=MomentumConfig(momentum=0.9)),
                     lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9)),
    "sgd_nesterov": (config(momentum=MomentumConfig(momentum=0.9, nesterov=True)),
                     lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9, nesterov=True)),
    "sgd_l2": (config(weight_decay=WeightDecayConfig(value=0.01, type="l2"),
                      momentum=MomentumConfig(momentum=0.5)),
               lambda p: torch.optim.SGD(p, lr=LR, momentum=0.5, weight_decay=0.01)),
    "adagrad": (config(grafting=GraftingConfig(type="adagrad", epsilon=1e-10)),
                lambda p: torch.optim.Adagrad(p, lr=LR, eps=1e-10)),
    "rmsprop": (config(grafting=GraftingConfig(type="rmsprop", beta2=0.9, epsilon=1e-8)),
                lambda p: torch.optim.RMSprop(p, lr=LR, alpha=0.9, eps=1e-8)),
    "adam": (config(grafting=GraftingConfig(type="adam", beta2=0.999, epsilon=1e-8,
                                            bias_correction=True),
                    gradient_filter=GradientFilterConfig(beta1=0.9, bias_correction=True)),
             lambda p: torch.optim.Adam(p, lr=LR, betas=(0.9, 0.999), eps=1e-8)),
    "adamw": (config(grafting=GraftingConfig(type="adam", beta2=0.99, epsilon=1e-8,
                                             bias_correction=True),
                     gradient_filter=GradientFilterConfig(beta1=0.8, bias_correction=True),
                     weight_decay=WeightDecayConfig(value=0.1, type="update")),
              lambda p: torch.optim.AdamW(p, lr=LR, betas=(0.8, 0.99), eps=1e-8,
                                          weight_decay=0.1)),
    # Meta's first-order classes as preconditioner_config (eq. 16b).
    "diagonal_sgd_momentum": (
        replace(diagonal(type="sgd"), momentum=MomentumConfig(momentum=0.9, nesterov=True)),
        lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9, nesterov=True)),
    "diagonal_adagrad": (diagonal(type="adagrad", epsilon=1e-10),
                         lambda p: torch.optim.Adagrad(p, lr=LR, eps=1e-10)),
    "diagonal_rmsprop": (diagonal(type="rmsprop", beta2=0.9, epsilon=1e-8),
                         lambda p: torch.optim.RMSprop(p, lr=LR, alpha=0.9, eps=1e-8)),
    "diagonal_adamw": (
        replace(diagonal(type="adam", beta2=0.99, epsilon=1e-8, bias_correction=True),
                gradient_filter=GradientFilterConfig(beta1=0.8, bias_correction=True),
                weight_decay=WeightDecayConfig(value=0.1, type="update")),
        lambda p: torch.optim.AdamW(p, lr=LR, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.1)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_never_started_equals_torch_optim(name: str) -> None:
    cfg, make_torch = CASES[name]
    gen = torch.Generator().manual_seed(sorted(CASES).index(name))
    init = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
    ours = [torch.nn.Parameter(x.clone()) for x in init]
    theirs = [torch.nn.Parameter(x.clone()) for x in init]
    opt_ours, opt_theirs = Shampoo(ours, cfg), make_torch(theirs)
    for _ in range(30):
        grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
        for p, q, g in zip(ours, theirs, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        opt_ours.step()
        opt_theirs.step()
    for p, q, w0 in zip(ours, theirs, init, strict=True):
        moved = torch.linalg.vector_norm(q.detach() - w0)
        assert torch.linalg.vector_norm(p.detach() - q.detach()) <= 1e-12 * moved
