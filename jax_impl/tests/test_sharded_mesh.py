"""Sharded Shampoo with model-sharded parameters (2 x 2 mesh) and under data parallelism.

Reductions over a parameter that is itself sharded (graft norms, eq. 14,
the parameter-scope rescale of eq. 18) and the batch sum of a data-parallel
gradient are split into per-device partial sums plus an all-reduce, a
different summation order than one device's: the trajectories then agree
within the float bound of docs/spec.md section 5 (computed per case by
``shampoo_conformance.suite.tolerances``), not bitwise.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import shampoo_jax
import shampoo_spec as ss
from shampoo_conformance.suite.divergence import first_divergence
from shampoo_conformance.suite.tolerances import trajectory_bound

from .helpers import stream
from .sharded_helpers import MESH_SHAPES, MESH_SPECS, devices, run_on_2x2_mesh, trajectory

CONFIG = ss.ShampooConfig(
    learning_rate=0.1,
    epsilon=ss.EpsilonConfig(value=1e-3),
    grafting=ss.GraftingConfig(type="adagrad", norm_scope="parameter"),
    momentum=ss.MomentumConfig(momentum=0.9),
    blocking=ss.BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None),
    schedule=ss.ScheduleConfig(precondition_frequency=2, start_preconditioning_step=2),
)
SHAPES, SPECS = MESH_SHAPES, MESH_SPECS


def _check(config: ss.ShampooConfig, params: Any, grads: Any, got: Any, want: Any,
           dtype: Any) -> None:
    bound = trajectory_bound(config, params, grads, dtype)
    want64 = [{k: np.asarray(v, np.float64) for k, v in w.items()} for w in want]
    div = first_divergence(got, want64, params, bound)
    assert div is None, div.describe()


@pytest.mark.parametrize("axis", ["data", ("data", "model")])
def test_model_sharded_parameters_on_a_2x2_mesh(axis: str | tuple[str, ...]) -> None:
    params, grads = stream(SHAPES, steps=5, seed=11)
    want, s1 = trajectory(CONFIG, params, grads, None)
    run = run_on_2x2_mesh(CONFIG, params, grads, SPECS, axis)
    assert run.initial_state.momentum["w"].sharding.spec == SPECS["w"]
    _check(CONFIG, params, grads, run.params, want, np.float32)
    p, s, sharding = run.final_params, run.final_state, run.sharding
    assert int(s.root_failures) == int(s1.root_failures)
    for k in SHAPES:  # the parameters keep their own sharding
        assert p[k].sharding.is_equivalent_to(run.where[k], p[k].ndim), (k, p[k].sharding)
    for gs in s.groups:
        for x in jax.tree.leaves(gs):
            assert x.sharding.spec == sharding.spec
            assert x.addressable_shards[0].data.shape[0] == x.shape[0] // sharding.size


def test_data_parallel_training_equals_one_device() -> None:
    """Batch sharded over "data", parameters replicated, blocks sharded over "data" (float64).

    The gradient of the global-view mean loss is the batch mean; XLA sums
    each device's part and all-reduces. The bound is computed on the
    gradients the one-device run saw.
    """
    config = dataclasses.replace(CONFIG, factor_dtype="float64")
    rng = np.random.default_rng(4)
    x = rng.standard_normal((32, 12))
    y = rng.standard_normal((32, 10))
    params = {"w": 0.1 * rng.standard_normal((12, 10)), "b": np.zeros(10)}

    def loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    mesh = Mesh(np.array(devices(4)), ("data",))
    sharding = shampoo_jax.ShardingConfig(mesh, "data")
    runs: dict[str, tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]] = {}
    with jax.enable_x64(True):
        for name, sh in (("one", None), ("sharded", sharding)):
            opt = shampoo_jax.shampoo(config, sharding=sh)

            @jax.jit
            def step(p: Any, s: Any, x: jax.Array, y: jax.Array, opt: Any = opt) -> Any:
                g = jax.grad(loss)(p, x, y)
                u, s = opt.update(g, s, p)
                return optax.apply_updates(p, u), s, g

            p = {k: jnp.asarray(v) for k, v in params.items()}
            xs, ys = jnp.asarray(x), jnp.asarray(y)
            if sh is not None:
                p = jax.device_put(p, sh.replicated)
                batch = NamedSharding(mesh, P("data"))
                xs, ys = jax.device_put(xs, batch), jax.device_put(ys, batch)
            s = opt.init(p)
            traj, seen = [], []
            for _ in range(6):
                p, s, g = step(p, s, xs, ys)
                traj.append({k: np.asarray(v) for k, v in p.items()})
                seen.append({k: np.asarray(v) for k, v in g.items()})
            runs[name] = (traj, seen)
    want, grads = runs["one"]
    got, _ = runs["sharded"]
    assert np.linalg.norm(want[-1]["w"] - params["w"]) > 0.1
    _check(config, params, grads, got, want, np.float64)
