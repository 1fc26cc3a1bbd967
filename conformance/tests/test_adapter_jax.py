"""The jax adapters: jax-sharded's one worker on four host devices equals the jax adapter,
and its errors are re-raised in the parent with their type and message."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import shampoo_spec as ss
from shampoo_conformance.suite.divergence import first_divergence
from shampoo_conformance.suite.tolerances import trajectory_bound

pytest.importorskip("shampoo_jax")

from shampoo_conformance.adapters import jax as jax_adapter  # noqa: E402
from shampoo_conformance.adapters import jax_sharded  # noqa: E402

CONFIG = ss.ShampooConfig(
    learning_rate=0.1,
    epsilon=ss.EpsilonConfig(value=1e-3),
    grafting=ss.GraftingConfig(type="adagrad"),
    momentum=ss.MomentumConfig(momentum=0.9),
    blocking=ss.BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None),
    schedule=ss.ScheduleConfig(precondition_frequency=2, start_preconditioning_step=2),
    failure=ss.FailureConfig(nonfinite_gradient="raise"),
)
SHAPES = {"w": (12, 6), "v": (5,)}


def stream(
    shapes: dict[str, tuple[int, ...]], steps: int, seed: int
) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s) for k, s in shapes.items()}
    grads = [{k: rng.standard_normal(s) for k, s in shapes.items()} for _ in range(steps)]
    return params, grads


def test_adapter_equals_one_device_and_reraises_worker_errors() -> None:
    params, grads = stream(SHAPES, steps=4, seed=2)
    got = jax_sharded.run(CONFIG, params, grads, dtype=np.float64)
    want = jax_adapter.run(CONFIG, params, grads, dtype=np.float64)
    assert any(not np.array_equal(got[-1][k], params[k]) for k in params)
    # Same numerics as one device (jax_impl/tests/test_sharded.py): within the float64 bound.
    div = first_divergence(got, want, params, trajectory_bound(CONFIG, params, grads, np.float64))
    assert div is None, div.describe()
    worker = jax_sharded._worker
    assert worker is not None and worker.proc.poll() is None  # persistent

    with pytest.raises(ValueError, match="dtype = int32 is invalid"):
        jax_sharded.run(CONFIG, params, grads, dtype=np.int32)
    bad = [dict(g) for g in grads]
    bad[1] = {**bad[1], "w": np.where(np.eye(12, 6) > 0, np.nan, bad[1]["w"])}
    with pytest.raises(ss.NonFiniteGradientError, match="by step 2"):
        jax_sharded.run(CONFIG, params, bad, dtype=np.float64)
    with pytest.raises(ValueError, match="grads of step 1 have keys"):
        jax_sharded.run(CONFIG, params, [{"w": grads[0]["w"]}])
    failing = dataclasses.replace(
        CONFIG,
        root_inverse=ss.CoupledNewtonConfig(max_iterations=1, failure_threshold=1e-9),
        failure=ss.FailureConfig(max_consecutive_root_failures=1),
    )
    with pytest.raises(ss.RootFailureError):
        jax_sharded.run(failing, params, grads, dtype=np.float64)
    assert jax_sharded._worker is worker  # errors do not cost the worker
