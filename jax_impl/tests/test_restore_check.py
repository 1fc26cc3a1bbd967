"""The config check of a restore through a pytree checkpointer (shampoo_jax.restore_check).

An Orbax restore takes the state's static part (config, parameter shapes,
block placement) from the restore target, so a state saved under another
config would restore silently; :func:`shampoo_jax.check_restored` refuses it
from :func:`shampoo_jax.checkpoint_metadata`'s dict, saved with the state.
The Orbax round trip of a state sharded over four host devices runs where
``orbax-checkpoint`` is installed: restored onto the mesh with the saved
shardings, it continues the uninterrupted run bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shampoo_jax
import shampoo_spec as ss

from .helpers import stream
from .sharded_helpers import place, transformation

CONFIG = ss.ShampooConfig(
    learning_rate=0.1,
    epsilon=ss.EpsilonConfig(value=1e-3),
    grafting=ss.GraftingConfig(type="adagrad"),
    momentum=ss.MomentumConfig(momentum=0.9),
    blocking=ss.BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None),
    schedule=ss.ScheduleConfig(precondition_frequency=2, start_preconditioning_step=2),
)
SHAPES = {"w": (8, 6), "v": (5,)}


def _params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _grads(n: int) -> list[dict[str, np.ndarray]]:
    return [{k: np.asarray(v, np.float32) for k, v in g.items()}
            for g in stream(SHAPES, n, seed=1)[1]]


def _like(config: ss.ShampooConfig, n: int | None, shapes: dict[str, tuple[int, ...]] = SHAPES
          ) -> Any:
    opt, _ = transformation(config, n)
    return jax.eval_shape(opt.init, place({k: np.zeros(s) for k, s in shapes.items()}, n))


def _saved(config: ss.ShampooConfig = CONFIG, n: int | None = 4) -> dict[str, Any]:
    """The metadata as a checkpointer stores it (a JSON round trip)."""
    return json.loads(json.dumps(shampoo_jax.checkpoint_metadata(_like(config, n))))


def test_same_config_and_layout_pass_after_a_json_round_trip() -> None:
    saved = _saved()
    assert saved["format"] == shampoo_jax.restore_check.METADATA_FORMAT
    (entry,) = saved["states"]
    assert ss.ShampooConfig.from_dict(entry["config"]) == CONFIG
    assert entry["parameters"] == [["['v']", [5]], ["['w']", [8, 6]]]
    assert entry["slots"] is not None  # sharded: the placement is recorded
    shampoo_jax.check_restored(saved, _like(CONFIG, 4))
    shampoo_jax.check_restored(_saved(n=None), _like(CONFIG, None))


def test_a_state_from_another_config_is_refused_naming_every_field() -> None:
    other = dataclasses.replace(
        CONFIG, learning_rate=0.05, epsilon=ss.EpsilonConfig(value=1e-4)
    )  # no array changes shape: the checkpointer alone would restore it silently
    with pytest.raises(ValueError, match="another config") as err:
        shampoo_jax.check_restored(_saved(CONFIG), _like(other, 4))
    message = str(err.value)
    assert "learning_rate: 0.1 -> 0.05" in message
    assert "epsilon.value: 0.001 -> 0.0001" in message
    assert "momentum" not in message


def test_a_state_for_other_parameter_shapes_is_refused_naming_them() -> None:
    shapes = {"w": (6, 8), "v": (5,), "u": (3,)}
    with pytest.raises(ValueError, match="other parameters") as err:
        shampoo_jax.check_restored(_saved(), _like(CONFIG, 4, shapes))
    assert "['w']: (8, 6) -> (6, 8)" in str(err.value)
    assert "['u']: <absent> -> (3,)" in str(err.value)
    assert "['v']" not in str(err.value)


@pytest.mark.parametrize(("saved_on", "restored_on"), [(4, 2), (4, None), (None, 4)])
def test_another_device_count_is_refused(saved_on: int | None, restored_on: int | None) -> None:
    with pytest.raises(ValueError, match="block placement.*sharded_state_to_arrays"):
        shampoo_jax.check_restored(_saved(n=saved_on), _like(CONFIG, restored_on))


def test_chains_invalid_metadata_and_stateless_trees() -> None:
    params = place(_params(), None)
    chain = optax.chain(optax.clip_by_global_norm(1.0), shampoo_jax.shampoo(CONFIG))
    saved = shampoo_jax.checkpoint_metadata({"opt": chain.init(params), "params": params})
    shampoo_jax.check_restored(saved, chain.init(params))
    two = optax.multi_transform(
        {"a": shampoo_jax.shampoo(CONFIG), "b": shampoo_jax.shampoo(CONFIG)},
        {"w": "a", "v": "b"},
    )
    with pytest.raises(ValueError, match="holds 1 Shampoo states; like holds 2"):
        shampoo_jax.check_restored(saved, two.init(params))
    with pytest.raises(ValueError, match="format None.*checkpoint_metadata"):
        shampoo_jax.check_restored({"states": saved["states"]}, chain.init(params))
    broken = {**saved, "states": [{**saved["states"][0], "config": {"learning_rate": "x"}}]}
    with pytest.raises(ValueError, match="checkpoint's config is invalid"):
        shampoo_jax.check_restored(broken, chain.init(params))
    with pytest.raises(ValueError, match="holds no ShampooState"):
        shampoo_jax.checkpoint_metadata(params)
    hand_built = shampoo_jax.shampoo(CONFIG).init(params)._replace(info=None)
    with pytest.raises(ValueError, match="carries no config"):
        shampoo_jax.checkpoint_metadata(hand_built)


def test_orbax_sharded_round_trip_keeps_shardings_and_continues_bit_for_bit(
    tmp_path: Path,
) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    opt, step = transformation(CONFIG, 4)
    grads = [place(g, 4) for g in _grads(5)]
    params = place(_params(), 4)
    state = opt.init(params)
    for g in grads[:3]:  # a root step (eq. 7) at step 2, the next at step 4
        params, state = step(params, state, g)
    checkpointer = ocp.StandardCheckpointer()
    path = tmp_path / "ckpt"
    checkpointer.save(path, {"params": params, "opt": state},
                      custom_metadata={"shampoo": shampoo_jax.checkpoint_metadata(state)})
    checkpointer.wait_until_finished()

    fresh = {"params": params, "opt": opt.init(params)}
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh)
    saved = checkpointer.metadata(path).custom_metadata["shampoo"]
    shampoo_jax.check_restored(saved, target)
    restored = checkpointer.restore(path, target)
    assert isinstance(restored["opt"], shampoo_jax.ShampooState)
    assert restored["opt"].info == state.info
    before = jax.tree.leaves({"params": params, "opt": state})
    after = jax.tree.leaves(restored)
    assert len(before) == len(after)
    for a, b in zip(before, after, strict=True):
        assert b.sharding == a.sharding
        assert np.array_equal(np.asarray(a), np.asarray(b))

    p1, s1, p2, s2 = params, state, restored["params"], restored["opt"]
    for g in grads[3:]:
        p1, s1 = step(p1, s1, g)
        p2, s2 = step(p2, s2, g)
    for a, b in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2)), strict=True):
        assert jnp.asarray(a).dtype == jnp.asarray(b).dtype
        assert np.array_equal(np.asarray(a), np.asarray(b))

    other = dataclasses.replace(CONFIG, momentum=ss.MomentumConfig(momentum=0.5))
    with pytest.raises(ValueError, match=r"momentum\.momentum: 0\.9 -> 0\.5"):
        shampoo_jax.check_restored(saved, _like(other, 4))


def test_a_flax_nnx_optimizers_state_is_checked() -> None:
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(8, 6, rngs=nnx.Rngs(0))

    def opt_state(config: ss.ShampooConfig) -> Any:
        return nnx.Optimizer(model, shampoo_jax.shampoo(config), wrt=nnx.Param).opt_state

    saved = json.loads(json.dumps(shampoo_jax.checkpoint_metadata(opt_state(CONFIG))))
    paths = [p for p, _ in saved["states"][0]["parameters"]]
    assert paths == ["['bias'].value", "['kernel'].value"]
    shampoo_jax.check_restored(saved, opt_state(CONFIG))
    with pytest.raises(ValueError, match="learning_rate: 0.1 -> 0.2"):
        shampoo_jax.check_restored(saved, opt_state(dataclasses.replace(CONFIG, learning_rate=0.2)))
