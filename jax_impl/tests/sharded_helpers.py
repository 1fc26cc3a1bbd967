"""Running the single-device and the sharded transformation side by side."""

from __future__ import annotations

import functools
from dataclasses import dataclass
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
from shampoo_jax.placement import group_costs, placement

AXIS = "blocks"


def devices(n: int) -> list[jax.Device]:
    found = jax.devices("cpu")
    if len(found) < n:
        pytest.fail(
            f"{n} host devices needed, {len(found)} found: XLA_FLAGS must hold "
            "--xla_force_host_platform_device_count=4 before jax starts (tests/conftest.py)."
        )
    return found[:n]


def mesh_1d(n: int) -> Mesh:
    return Mesh(np.array(devices(n)), (AXIS,))


def sharding_1d(n: int) -> shampoo_jax.ShardingConfig:
    return shampoo_jax.ShardingConfig(mesh_1d(n), AXIS)


@functools.cache
def transformation(
    config: ss.ShampooConfig, n: int | None
) -> tuple[optax.GradientTransformation, Any]:
    """``(opt, jitted step)`` for one device (n = None) or sharded over n devices (cached)."""
    opt = shampoo_jax.shampoo(config, sharding=None if n is None else sharding_1d(n))

    def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    return opt, jax.jit(step)


def place(tree: dict[str, np.ndarray], n: int | None, dtype: Any = jnp.float32) -> Any:
    arrays = {k: jnp.asarray(v, dtype) for k, v in tree.items()}
    if n is None:
        return arrays
    return jax.device_put(arrays, sharding_1d(n).replicated)


def trajectory(
    config: ss.ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    n: int | None,
    state: Any = None,
) -> tuple[list[dict[str, np.ndarray]], Any]:
    """Parameters after each step (NumPy) and the final state."""
    opt, step = transformation(config, n)
    p = place(params, n)
    s = opt.init(p) if state is None else state
    out = []
    for g in grads:
        p, s = step(p, s, place(g, n))
        out.append({k: np.asarray(v) for k, v in p.items()})
    return out, s


#: Shapes for a 2 x 2 ("data", "model") mesh and their shardings over "model" (v stays
#: replicated: 9 is odd).
MESH_SHAPES = {"w": (12, 10), "t": (3, 4, 6), "v": (9,)}
MESH_SPECS = {"w": P(None, "model"), "t": P(None, "model", None), "v": P()}


@dataclass(frozen=True)
class MeshRun:
    """One float32 run on the 2 x 2 mesh: the state ``opt.init`` gave, the parameters
    after each step (NumPy), the final parameters and state, and their layout."""

    initial_state: Any
    params: list[dict[str, np.ndarray]]
    final_params: dict[str, jax.Array]
    final_state: Any
    where: dict[str, NamedSharding]
    sharding: shampoo_jax.ShardingConfig


def run_on_2x2_mesh(config: ss.ShampooConfig, params: dict[str, np.ndarray],
                    grads: list[dict[str, np.ndarray]], specs: dict[str, P],
                    axis: str | tuple[str, ...] = "data") -> MeshRun:
    """Shampoo sharded over ``axis`` of a 2 x 2 ("data", "model") mesh of host devices,
    the parameters and gradients placed by ``specs``; ``opt.init`` runs eagerly, so
    elementwise states take the parameters' shardings."""
    mesh = Mesh(np.array(devices(4)).reshape(2, 2), ("data", "model"))
    sharding = shampoo_jax.ShardingConfig(mesh, axis)
    opt = shampoo_jax.shampoo(config, sharding=sharding)
    where = {k: NamedSharding(mesh, specs[k]) for k in params}

    def put(tree: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return {k: jax.device_put(jnp.asarray(v, jnp.float32), where[k]) for k, v in tree.items()}

    @jax.jit
    def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    p = put(params)
    s = s0 = opt.init(p)
    out = []
    for g in grads:
        p, s = step(p, s, put(g))
        out.append({k: np.asarray(v) for k, v in p.items()})
    return MeshRun(s0, out, p, s, where, sharding)


def padding(groups: tuple[Any, ...], n: int) -> list[np.ndarray]:
    """Per group (single-device state), the mask of padding slots when sharded over n."""
    sizes = tuple(int(gs.statistics_updates.shape[0]) for gs in groups)
    masks = []
    for nb, slots in zip(sizes, placement(sizes, group_costs(groups), n), strict=True):
        mask = np.ones(-(-nb // n) * n, bool)
        mask[list(slots)] = False
        masks.append(mask)
    return masks


def assert_bitwise(got: list[dict[str, np.ndarray]], want: list[dict[str, np.ndarray]]) -> None:
    for t, (a, b) in enumerate(zip(got, want, strict=True), start=1):
        for k in b:
            if not np.array_equal(a[k], b[k]):
                diff = np.max(np.abs(a[k] - b[k]))
                raise AssertionError(f"param {k!r} differs at step {t} by up to {diff:.3e}")
