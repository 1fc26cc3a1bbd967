"""With start_preconditioning_step=None Shampoo is its graft: equal to optax.

The shape of optax's equivalence_test: the same gradients through both, the
parameters compared after 30 steps in float32 (rtol 1e-5: a handful of
float32 roundings per step). A comment marks every naming or default
difference between optax and ShampooConfig.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import shampoo_spec as ss
from shampoo_conformance.adapters.jax import run as jax_run

from .helpers import stream

NEVER = ss.ScheduleConfig(start_preconditioning_step=None)
LR = 0.05


def optax_run(opt: optax.GradientTransformation, params: dict, grads: list[dict]) -> list[dict]:
    with jax.enable_x64(False):
        p = {k: jax.numpy.asarray(v, np.float32) for k, v in params.items()}
        s = opt.init(p)

        @jax.jit
        def step(p: dict, s: object, g: dict) -> tuple[dict, object]:
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        out = []
        for g in grads:
            p, s = step(p, s, {k: jax.numpy.asarray(v, np.float32) for k, v in g.items()})
            out.append({k: np.asarray(v) for k, v in p.items()})
    return out


TINY = 1e-30  # the adagrad case's eps on both sides (see there)

CASES = {
    # optax.sgd's trace: f <- g + mu f; update f (Nesterov: g + mu f). Ours with
    # dampening 0 is the same buffer convention (torch's, too).
    "sgd_momentum": (
        optax.sgd(LR, momentum=0.9),
        ss.ShampooConfig(learning_rate=LR, grafting=ss.GraftingConfig(type="sgd"),
                         momentum=ss.MomentumConfig(momentum=0.9), schedule=NEVER),
    ),
    "sgd_nesterov": (
        optax.sgd(LR, momentum=0.9, nesterov=True),
        ss.ShampooConfig(learning_rate=LR, grafting=ss.GraftingConfig(type="sgd"),
                         momentum=ss.MomentumConfig(momentum=0.9, nesterov=True), schedule=NEVER),
    ),
    # optax.adagrad: accumulator starts at initial_accumulator_value (default 0.1,
    # ours 0) and eps (default 1e-7) sits *inside* the sqrt: g / sqrt(V + eps);
    # ours is g / (sqrt(V) + epsilon). They coincide for initial_accumulator_value=0
    # and a tiny eps on both sides (grafting.epsilon must be > 0): with V and
    # sqrt(V) of order 1, adding 1e-30 changes neither (in float32), so both
    # are g / sqrt(V), compared here.
    "adagrad": (
        optax.adagrad(LR, initial_accumulator_value=0.0, eps=TINY),
        ss.ShampooConfig(learning_rate=LR, grafting=ss.GraftingConfig(type="adagrad", epsilon=TINY),
                         schedule=NEVER),
    ),
    # optax.rmsprop: `decay` is our grafting.beta2; eps_in_sqrt=True by default
    # (g / sqrt(nu + eps)); ours is eps outside (eps_in_sqrt=False).
    "rmsprop": (
        optax.rmsprop(LR, decay=0.9, eps=1e-8, eps_in_sqrt=False),
        ss.ShampooConfig(learning_rate=LR,
                         grafting=ss.GraftingConfig(type="rmsprop", beta2=0.9, epsilon=1e-8),
                         schedule=NEVER),
    ),
    # optax.adam: b1 is our gradient_filter.beta1 (with bias_correction), b2 the
    # adam graft's beta2 (bias-corrected); eps outside the sqrt in both (eps_root=0).
    "adam": (
        optax.adam(LR, b1=0.9, b2=0.999, eps=1e-8),
        ss.ShampooConfig(
            learning_rate=LR,
            gradient_filter=ss.GradientFilterConfig(beta1=0.9, bias_correction=True),
            grafting=ss.GraftingConfig(type="adam", beta2=0.999, epsilon=1e-8,
                                       bias_correction=True),
            schedule=NEVER,
        ),
    ),
    # optax.adamw: decoupled decay lr * wd * w added after Adam = our
    # weight_decay.type="update" (optax's default weight_decay is 1e-4, ours 0).
    "adamw": (
        optax.adamw(LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1),
        ss.ShampooConfig(
            learning_rate=LR,
            gradient_filter=ss.GradientFilterConfig(beta1=0.9, bias_correction=True),
            grafting=ss.GraftingConfig(type="adam", beta2=0.999, epsilon=1e-8,
                                       bias_correction=True),
            weight_decay=ss.WeightDecayConfig(value=0.1, type="update"),
            schedule=NEVER,
        ),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_never_preconditioned_equals_optax(name: str) -> None:
    opt, config = CASES[name]
    params, grads = stream({"w": (7, 10), "b": (7,), "s": ()}, steps=30, seed=1)
    want = optax_run(opt, params, grads)
    got = jax_run(config, params, grads, dtype=np.float32)
    for k in params:
        np.testing.assert_allclose(got[-1][k], want[-1][k], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{name}: parameter {k!r} after 30 steps")
