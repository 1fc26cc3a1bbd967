"""A small MLP on scikit-learn digits: Shampoo drives the training loss down.

Measured (float32, CPU, jax 0.10.2, this config, seed 0), loss after 60
full-batch steps, starting from 2.40:

    Shampoo (this config)                          0.0034
    the same with start_preconditioning_step=None  0.0114   (AdaGrad graft alone)
    optax.adam(0.01)                               0.127
    optax.sgd(0.05, momentum=0.9)                  0.326

THRESHOLD = 3 x the measured Shampoo loss (0.01): room for rounding on other
machines, yet below what the graft alone reaches, so a preconditioner that
silently does nothing fails the test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import shampoo_jax
import shampoo_spec as ss

STEPS = 60
MEASURED = 0.0034
THRESHOLD = 3 * MEASURED


def _data() -> tuple[jax.Array, jax.Array]:
    x, y = load_digits(return_X_y=True)
    return jnp.asarray(x / 16.0, jnp.float32), jnp.asarray(y)


def _init(key: jax.Array) -> dict:
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (64, 32)) / 8.0,
        "b1": jnp.zeros(32),
        "w2": jax.random.normal(k2, (32, 10)) / np.sqrt(32.0),
        "b2": jnp.zeros(10),
    }


def _loss(p: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"] + p["b2"], y).mean()


def train(opt: optax.GradientTransformation) -> list[float]:
    x, y = _data()
    p = _init(jax.random.PRNGKey(0))
    s = opt.init(p)

    @jax.jit
    def step(p: dict, s: object) -> tuple[dict, object, jax.Array]:
        loss, g = jax.value_and_grad(_loss)(p, x, y)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    losses = []
    for _ in range(STEPS):
        p, s, loss = step(p, s)
        losses.append(float(loss))
    losses.append(float(_loss(p, x, y)))
    return losses


CONFIG = ss.ShampooConfig(
    learning_rate=0.05,
    epsilon=ss.EpsilonConfig(value=1e-6),
    grafting=ss.GraftingConfig(type="adagrad"),
    momentum=ss.MomentumConfig(momentum=0.9),
    schedule=ss.ScheduleConfig(precondition_frequency=5, start_preconditioning_step=5),
)


def test_shampoo_trains_digits() -> None:
    losses = train(shampoo_jax.shampoo(CONFIG))
    assert losses[0] > 2.0
    assert losses[-1] < THRESHOLD, f"loss {losses[-1]:.4f} after {STEPS} steps: {losses[::10]}"
