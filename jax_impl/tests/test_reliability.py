"""Hostile inputs: eq. (3)'s overflow refusal, argument checks, naming, limits, checkpoints.

Few compilations: every jitted test shares :data:`CONFIG` and :data:`SHAPES`
(one program, :func:`_step`); the rest runs eagerly or under ``eval_shape``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import shampoo_jax
import shampoo_spec as ss
import shampoo_spec.schedule as spec_schedule
from shampoo_jax import blocks as B
from shampoo_jax import grafting, schedule
from shampoo_spec.config import MAX_NEWTON_ITERATIONS

# sgd grafting with the parameter-scope rescale (eq. 18 over the whole of w),
# summed factors (beta2 = 1): a factor entry only grows.
CONFIG = ss.ShampooConfig(
    learning_rate=0.1,
    blocking=ss.BlockingConfig(max_preconditioner_dim=2, merge_dims_up_to=None),
    grafting=ss.GraftingConfig(type="sgd", norm_scope="parameter"),
    statistics=ss.StatisticsConfig(beta2=1.0),
    failure=ss.FailureConfig(nonfinite_gradient="skip_block"),
)
RAISE = dataclasses.replace(CONFIG, failure=ss.FailureConfig(nonfinite_gradient="raise"))
SHAPES = {"b": (3,), "w": (4, 4)}  # w: four 2 x 2 blocks


@functools.lru_cache(maxsize=1)
def _step() -> tuple[Any, Any]:
    opt = shampoo_jax.shampoo(CONFIG)

    @jax.jit
    def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    return opt, step


def _data(steps: int, seed: int = 0) -> tuple[dict[str, Any], list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in SHAPES.items()}
    grads = [{k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
             for _ in range(steps)]
    return params, grads


def _run(params: Any, grads: list[dict[str, np.ndarray]]) -> list[tuple[Any, Any]]:
    opt, step = _step()
    p, s = params, opt.init(params)
    out = []
    for g in grads:
        p, s = step(p, s, {k: jnp.asarray(v) for k, v in g.items()})
        out.append((p, s))
    return out


def _all_finite(tree: Any) -> bool:
    return all(bool(np.all(np.isfinite(np.asarray(x)))) for x in jax.tree.leaves(tree)
               if np.issubdtype(np.asarray(x).dtype, np.floating))


def _max_factor(s: Any) -> float:
    return max(float(np.max(np.abs(np.asarray(f)))) for gs in s.groups for f in gs.factors)


# ------------------------------------------------------------- item 1: eq. (3)
def test_huge_finite_gradient_is_refused_like_a_nan() -> None:
    params, grads = _data(steps=5)
    huge = [dict(g) for g in grads]
    nan = [dict(g) for g in grads]
    huge[2]["w"] = grads[2]["w"].copy()
    huge[2]["w"][0, 0] = 1e20  # finite, but |B| g^2 = 4e40 > STATE_LIMIT
    nan[2]["w"] = grads[2]["w"].copy()
    nan[2]["w"][0, 0] = np.nan
    got, want = _run(params, huge), _run(params, nan)
    p, s = got[-1]
    assert _all_finite(p) and _all_finite(s)
    assert int(s.skipped_blocks) == 1
    assert np.asarray(s.skipped_per_parameter).tolist() == [0, 1]  # b, w
    # Refused exactly like a non-finite gradient: same parameters and state, bit for bit.
    for (pa, sa), (pb, sb) in zip(got, want, strict=True):
        for a, b in zip(jax.tree.leaves((pa, sa)), jax.tree.leaves((pb, sb)), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
    # The refused block's parameter entries did not move at step 3.
    before, after = np.asarray(got[1][0]["w"]), np.asarray(got[2][0]["w"])
    assert np.array_equal(before[:2, :2], after[:2, :2])
    assert not np.array_equal(before[2:, 2:], after[2:, 2:])
    # "raise": check_state names the parameter.
    with pytest.raises(ss.NonFiniteGradientError, match=re.escape("['w']")) as err:
        shampoo_jax.check_state(got[2][1], RAISE, previous=got[1][1])
    assert "['b']" not in str(err.value)
    shampoo_jax.check_state(got[3][1], RAISE, previous=got[2][1])  # nothing new: no raise


def test_overflow_bound_counts_the_state_and_rescale_stays_finite() -> None:
    # Every 2 x 2 block of w has max |G_B| = g = 6e18 (entries 3e18-6e18, random
    # signs, full rank): |B| g^2 = 1.44e38 <= 2^127 passes at step 1 (factors ~ 0);
    # the factors then hold an entry >= g^2 = 3.6e37, and m + |B| g^2 > 2^127
    # refuses all four blocks at step 2. At step 1 the sum of squares over w
    # (>= 1.4e38, up to 5.8e38) can overflow float32: eq. (18)'s
    # parameter-scope rescale must not give inf/inf.
    params, grads = _data(steps=2, seed=1)
    g = 6e18
    rng = np.random.default_rng(2)
    u = rng.uniform(0.5, 1.0, SHAPES["w"]) * rng.choice([-1.0, 1.0], SHAPES["w"])
    for i in (0, 2):
        for j in (0, 2):
            u[i:i + 2, j:j + 2] /= np.max(np.abs(u[i:i + 2, j:j + 2]))
    w_grad = (g * u).astype(np.float32)
    with np.errstate(over="ignore"):
        assert not np.isfinite(np.sum(np.square(w_grad)))  # the plain norm overflows
    for x in grads:
        x["w"] = w_grad
    opt, _ = _step()
    s0 = opt.init(params)
    (p1, s1), (p2, s2) = _run(params, grads)
    assert not ss.block_overflows(g, 4, _max_factor(s0))
    assert ss.block_overflows(g, 4, _max_factor(s1))
    assert int(s1.skipped_blocks) == 0 and int(s2.skipped_blocks) == 4
    assert np.asarray(s2.skipped_per_parameter).tolist() == [0, 4]
    assert _all_finite((p1, s1, p2, s2))
    moved = np.asarray(p1["w"]) - np.asarray(params["w"])
    # sgd graft: the step has the graft's norm ||G|| (the rescale worked).
    np.testing.assert_allclose(np.linalg.norm(moved.astype(np.float64)),
                               0.1 * np.linalg.norm(w_grad.astype(np.float64)), rtol=1e-4)
    assert np.array_equal(np.asarray(p2["w"]), np.asarray(p1["w"]))  # refused: unchanged
    assert not np.array_equal(np.asarray(p2["b"]), np.asarray(p1["b"]))


def test_frobenius_is_overflow_safe_and_plain_otherwise() -> None:
    big = jnp.full((16,), 6e18, jnp.float32)
    assert not np.isfinite(float(jnp.sqrt(jnp.sum(big * big))))
    np.testing.assert_allclose(float(grafting.norm(big)), 4 * 6e18, rtol=1e-6)
    stack = jnp.stack([big.reshape(4, 4), jnp.ones((4, 4), jnp.float32)])
    np.testing.assert_allclose(np.asarray(B.block_norms(stack)), [2.4e19, 4.0], rtol=1e-6)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 7)), jnp.float32)
    assert float(grafting.norm(x)) == float(jnp.sqrt(jnp.sum(x * x)))
    assert np.isnan(float(grafting.norm(x.at[0, 0].set(jnp.nan))))
    assert float(grafting.norm(x.at[0, 0].set(jnp.inf))) == np.inf


# ------------------------------------------------------------- item 2: arguments
@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -float("inf"), -0.1, "0.1", True,
                                [0.1], np.array([0.1, 0.2])])
def test_bad_learning_rate_is_a_value_error(lr: Any) -> None:
    with pytest.raises(ValueError, match="learning_rate"):
        shampoo_jax.shampoo(CONFIG, learning_rate=lr)


def test_integer_learning_rate_beyond_int32_updates() -> None:
    """An int rate is used as a float: 2**62 is no int32 weak type without x64 (the fuzzer)."""
    params = {"a": jnp.ones(3)}
    for opt in (shampoo_jax.shampoo(CONFIG, learning_rate=2**62),
                shampoo_jax.shampoo(dataclasses.replace(CONFIG, learning_rate=2**62)),
                shampoo_jax.shampoo(CONFIG, learning_rate=np.int64(2**62))):
        update, _ = opt.update({"a": jnp.ones(3)}, opt.init(params), params)
        assert update["a"].dtype == jnp.float32
        assert np.all(np.isfinite(np.asarray(update["a"])))


def test_good_learning_rates_and_bad_configs() -> None:
    for lr in (0.0, 0.1, 1, np.float32(0.5), optax.constant_schedule(0.1), lambda c: 0.1):
        shampoo_jax.shampoo(CONFIG, learning_rate=lr)
    for bad in (None, "config", {"learning_rate": 0.1}, CONFIG.to_dict()):
        with pytest.raises(ValueError, match="config"):
            shampoo_jax.shampoo(bad)  # type: ignore[arg-type]


# ------------------------------------------------------------- item 3: naming
def test_root_failure_names_the_parameter_on_one_device_and_sharded() -> None:
    limited = dataclasses.replace(
        CONFIG, failure=ss.FailureConfig(max_consecutive_root_failures=1))
    params = {"a": jnp.ones((3,)), "w": jnp.ones((4, 4))}
    opt = shampoo_jax.shampoo(limited)
    s = opt.init(params)
    layout = B.make_layout(s.info.shapes, limited)
    gi = next(i for i, grp in enumerate(layout.groups) if grp.shape == (2, 2))
    j = 3  # the block at offsets (2, 2)
    assert layout.groups[gi].members[j] == (1, 3)

    def failing(state: Any) -> Any:
        groups = list(state.groups)
        cf = np.zeros(groups[gi].consecutive_failures.shape, np.int32)
        slots = state.info.slots
        cf[j if slots is None else slots[gi][j]] = 5
        groups[gi] = groups[gi]._replace(consecutive_failures=jnp.asarray(cf))
        return state._replace(groups=tuple(groups))

    with pytest.raises(ss.RootFailureError, match=re.escape("['w'] (block at offsets (2, 2))")):
        shampoo_jax.check_state(failing(s), limited)
    sharding = shampoo_jax.ShardingConfig(Mesh(np.array(jax.devices()[:4]), ("blocks",)),
                                          "blocks")
    sharded = shampoo_jax.shard_state(s, sharding)
    assert sharded.info is not None and sharded.info.slots is not None
    with pytest.raises(ss.RootFailureError, match=re.escape("['w'] (block at offsets (2, 2))")):
        shampoo_jax.check_state(failing(sharded), limited)
    shampoo_jax.check_state(sharded, limited)  # no failures: no raise


# ------------------------------------------------------------- item 4: shapes
def test_transposed_gradient_is_refused_naming_the_path() -> None:
    opt = shampoo_jax.shampoo(CONFIG)
    params = {"b": jnp.ones((3,)), "w": jnp.ones((2, 6))}
    s = opt.init(params)
    bad = {"b": jnp.ones((3,)), "w": jnp.ones((6, 2))}
    with pytest.raises(ValueError, match=re.escape("['w']")):
        opt.update(bad, s, params)
    with pytest.raises(ValueError, match=re.escape("['w']")):
        jax.eval_shape(opt.update, bad, s, params)
    with pytest.raises(ValueError, match="have 2"):
        opt.update({"w": jnp.ones((2, 6))}, s, params)


# ------------------------------------------------------------- item 5: integers
def test_integers_up_to_max_integer_work() -> None:
    top = ss.MAX_INTEGER
    config = ss.ShampooConfig(
        learning_rate=0.1,
        schedule=ss.ScheduleConfig(precondition_frequency=top, statistics_frequency=top,
                                   start_preconditioning_step=top),
        root_inverse=ss.CoupledNewtonConfig(max_iterations=MAX_NEWTON_ITERATIONS),
    )
    assert MAX_NEWTON_ITERATIONS == 10000
    for t in (1, 2, top - 1, top):
        tj = jnp.asarray(t, jnp.int32)
        for name in ("is_root_step", "is_statistics_step", "uses_preconditioner"):
            got = getattr(schedule, name)(tj, config.schedule)
            assert bool(got) == getattr(spec_schedule, name)(t, config.schedule), (name, t)
    opt = shampoo_jax.shampoo(config)
    params = {"w": jnp.ones((3, 4))}
    s = opt.init(params)
    state = s._replace(count=jnp.asarray(top - 1, jnp.int32))  # the next step is 2^31 - 1
    u, s2 = jax.jit(opt.update)({"w": jnp.ones((3, 4))}, state, params)
    assert int(s2.count) == top
    assert _all_finite(u) and _all_finite(s2)
    assert int(s2.groups[0].statistics_updates[0]) == 1  # t = 2^31 - 1 is a statistics step


# ------------------------------------------------------------- item 6: checkpoints
def _saved(arrays: list[np.ndarray], path: Any) -> list[np.ndarray]:
    np.savez(path, *arrays)
    with np.load(path, allow_pickle=False) as loaded:
        return [loaded[f"arr_{i}"] for i in range(len(loaded.files))]


def test_checkpoint_always_stores_the_config_and_refuses_another(tmp_path: Any) -> None:
    opt = shampoo_jax.shampoo(CONFIG)
    params = {k: jnp.ones(s) for k, s in SHAPES.items()}
    s = opt.init(params)
    assert s.info is not None and s.info.config is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        arrays = _saved(shampoo_jax.state_to_arrays(s), tmp_path / "c.npz")
        assert len(arrays) == len(jax.tree.leaves(s)) + 2  # the format and config entries
        assert ss.ShampooConfig.from_dict(json.loads(str(arrays[-1]))) == CONFIG
        # The config argument (first version of the API) is the same entry.
        legacy = shampoo_jax.state_to_arrays(s, CONFIG)
        assert str(legacy[-1]) == str(arrays[-1])
        for like in (s, jax.eval_shape(opt.init, params)):  # no config argument needed
            restored = shampoo_jax.state_from_arrays(arrays, like)
            for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(s), strict=True):
                assert np.array_equal(np.asarray(a), np.asarray(b))
        shampoo_jax.state_from_arrays(arrays, like=s, config=CONFIG)
        # A whole optax.chain state: one config entry per Shampoo state.
        chain = optax.chain(optax.clip_by_global_norm(1.0), opt)
        cs = chain.init(params)
        chained = shampoo_jax.state_to_arrays(cs)
        assert len(chained) == len(jax.tree.leaves(cs)) + 2
        shampoo_jax.state_from_arrays(chained, chain.init(params))
    other = dataclasses.replace(CONFIG, learning_rate=0.2,
                                statistics=ss.StatisticsConfig(beta2=0.99))
    other_like = shampoo_jax.shampoo(other).init(params)
    for like, config in ((other_like, None), (jax.eval_shape(lambda: other_like), None),
                         (other_like, other)):
        with pytest.raises(ValueError, match="learning_rate: 0.1 -> 0.2") as err:
            shampoo_jax.state_from_arrays(arrays, like, config=config)
        assert "statistics.beta2: 1.0 -> 0.99" in str(err.value)
        assert "grafting" not in str(err.value)
    with pytest.raises(ValueError, match="learning_rate: 0.1 -> 0.2"):
        shampoo_jax.state_from_arrays(chained, optax.chain(
            optax.clip_by_global_norm(1.0), shampoo_jax.shampoo(other)).init(params))
    # config= must agree with the state / like it goes with.
    with pytest.raises(ValueError, match="learning_rate: 0.1 -> 0.2"):
        shampoo_jax.state_to_arrays(s, other)
    with pytest.raises(ValueError, match="learning_rate: 0.1 -> 0.2"):
        shampoo_jax.state_from_arrays(arrays, like=s, config=other)
    # Resuming under a changed config on purpose: replace the entry.
    changed = [*arrays[:-1], shampoo_jax.config_array(other)]
    shampoo_jax.state_from_arrays(changed, other_like)
    # A dropped config entry is refused (state_to_arrays always writes one) ...
    with pytest.raises(ValueError, match="no config entry"):
        shampoo_jax.state_from_arrays(arrays[:-1], like=s)
    # ... and so is a config entry that is not a config.
    with pytest.raises(ValueError, match="config entry is invalid"):
        shampoo_jax.state_from_arrays([*arrays[:-1], np.asarray('{"nonsense": 1}')], like=s)


def test_checkpoint_written_before_configs_were_stored_loads_with_a_warning() -> None:
    opt = shampoo_jax.shampoo(CONFIG)
    params = {k: jnp.ones(s) for k, s in SHAPES.items()}
    _, s = _run(*_data(2))[-1]
    # The old format: no config entry, no skip counters per parameter, no withheld count.
    leaves = jax.tree.leaves(s._replace(skipped_per_parameter=None, withheld_updates=None))
    old = [np.asarray(x) for x in leaves]
    for like in (opt.init(params), jax.eval_shape(opt.init, params)):
        with pytest.warns(UserWarning, match="written before configs were stored"):
            restored = shampoo_jax.state_from_arrays(old, like)
        assert np.asarray(restored.skipped_per_parameter).tolist() == [0, 0]
        assert int(restored.withheld_updates) == 0
        kept = jax.tree.leaves(restored._replace(skipped_per_parameter=None,
                                                 withheld_updates=None))
        for a, b in zip(kept, leaves, strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    # Inside an optax.chain state too.
    chain = optax.chain(optax.scale_by_adam(), opt)
    cs = chain.init(params)
    old_chain = [np.asarray(x) for x in jax.tree.leaves(
        (cs[0], cs[1]._replace(skipped_per_parameter=None, withheld_updates=None)))]
    with pytest.warns(UserWarning, match="written before configs were stored"):
        restored_chain = shampoo_jax.state_from_arrays(old_chain, cs)
    assert np.asarray(restored_chain[1].skipped_per_parameter).tolist() == [0, 0]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_checkpoint_with_a_nonfinite_entry_is_refused_naming_the_field(bad: float) -> None:
    opt = shampoo_jax.shampoo(CONFIG)
    params = {k: jnp.ones(s) for k, s in SHAPES.items()}
    _, s = _run(*_data(2))[-1]
    arrays = shampoo_jax.state_to_arrays(s)
    keyed = jax.tree_util.tree_flatten_with_path(s)[0]
    floats = [i for i, (_, x) in enumerate(keyed) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert len(floats) >= 4
    for i in floats:
        damaged = [a.copy() for a in arrays]
        damaged[i].reshape(-1)[-1] = bad
        field = re.escape(f"(state field {jax.tree_util.keystr(keyed[i][0])}) holds 1 non-finite")
        with pytest.raises(ValueError, match=field):
            shampoo_jax.state_from_arrays(damaged, opt.init(params))
    # The sharded loader refuses it too, before placing anything.
    sharding = shampoo_jax.ShardingConfig(Mesh(np.array(jax.devices()[:4]), ("blocks",)),
                                          "blocks")
    damaged = [a.copy() for a in arrays]
    damaged[floats[0]].reshape(-1)[0] = bad
    with pytest.raises(ValueError, match="non-finite"):
        shampoo_jax.sharded_state_from_arrays(damaged, jax.eval_shape(opt.init, params),
                                              sharding)


def test_sharded_checkpoint_stores_and_checks_the_config() -> None:
    opt = shampoo_jax.shampoo(CONFIG)
    params = {k: jnp.ones(s) for k, s in SHAPES.items()}
    like = jax.eval_shape(opt.init, params)
    sharding = shampoo_jax.ShardingConfig(Mesh(np.array(jax.devices()[:4]), ("blocks",)),
                                          "blocks")
    s = shampoo_jax.shard_state(opt.init(params), sharding)
    arrays = shampoo_jax.sharded_state_to_arrays(s, like, sharding)
    assert arrays[-1].shape == () and str(arrays[-1]) == str(shampoo_jax.config_array(CONFIG))
    single = shampoo_jax.state_to_arrays(opt.init(params))
    assert len(arrays) == len(single)
    for a, b in zip(arrays, single, strict=True):
        assert np.array_equal(a, b)
    assert shampoo_jax.sharded_state_to_arrays(s, like, sharding, CONFIG)[-1] == arrays[-1]
    back = shampoo_jax.sharded_state_from_arrays(arrays, like, sharding)
    assert back.info is not None and back.info.slots == s.info.slots
    assert back.info.config == s.info.config
    shampoo_jax.sharded_state_from_arrays(arrays, like, sharding, config=CONFIG)
    other = dataclasses.replace(CONFIG, blocking=ss.BlockingConfig(
        max_preconditioner_dim=3, merge_dims_up_to=None))
    with pytest.raises(ValueError, match=re.escape("blocking.max_preconditioner_dim: 2 -> 3")):
        shampoo_jax.sharded_state_from_arrays(
            arrays, jax.eval_shape(shampoo_jax.shampoo(other).init, params), sharding)


# ------------------------------------------------------------- item 7: huge dims
def test_large_blocks_warn_naming_the_parameter() -> None:
    big = ss.ShampooConfig(blocking=ss.BlockingConfig(max_preconditioner_dim=10000))
    shape = {"emb": jax.ShapeDtypeStruct((1, 9000), jnp.float32)}
    with pytest.warns(UserWarning, match=re.escape("['emb']")):
        jax.eval_shape(shampoo_jax.shampoo(big).init, shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.eval_shape(shampoo_jax.shampoo(ss.ShampooConfig()).init,
                       {"emb": jax.ShapeDtypeStruct((1, 100000), jnp.float32)})


def test_empty_parameters_step() -> None:
    """Size-0 parameters step (found by the fuzzer: a max over no entries has no identity)."""
    config = ss.ShampooConfig(grafting=ss.GraftingConfig(type="adagrad_normalized"))
    tx = shampoo_jax.shampoo(config)
    params = {"w": jnp.zeros((0,)), "v": jnp.zeros((0, 3)), "u": jnp.ones((2,))}
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(params, state, params)
    assert updates["w"].shape == (0,) and updates["v"].shape == (0, 3)
    assert int(state.skipped_blocks) == 0


def test_checkpoint_written_before_the_update_guard_loads() -> None:
    """Arrays with a config entry but no ``withheld_updates`` (eq. 22): the counter starts at 0."""
    opt = shampoo_jax.shampoo(CONFIG)
    params = {k: jnp.ones(s) for k, s in SHAPES.items()}
    _, s = _run(*_data(2))[-1]
    arrays = shampoo_jax.state_to_arrays(s)
    # Before the guard: no withheld_updates (the state's last array), no format entry.
    assert str(arrays[-2]) == shampoo_jax.checkpoint.FORMAT
    before = [*arrays[:-3], arrays[-1]]
    restored = shampoo_jax.state_from_arrays(before, opt.init(params))
    assert int(restored.withheld_updates) == 0
    for a, b in zip(jax.tree.leaves(restored)[:-1], jax.tree.leaves(s)[:-1], strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # Without the format entry only that older layout loads: any other count is damage.
    with pytest.raises(ValueError, match="no format entry"):
        shampoo_jax.state_from_arrays([*arrays[:-4], arrays[-1]], opt.init(params))
    with pytest.raises(ValueError, match="no format entry"):
        shampoo_jax.state_from_arrays([*arrays[:-2], arrays[-1]], opt.init(params))
    # With it, exactly the current layout: a missing counter is refused, not shifted.
    with pytest.raises(ValueError, match="len"):
        shampoo_jax.state_from_arrays([*arrays[:-3], *arrays[-2:]], opt.init(params))
    with pytest.raises(ValueError, match="format entry is"):
        shampoo_jax.state_from_arrays(
            [*arrays[:-2], np.asarray("shampoo_jax.state_to_arrays/9"), arrays[-1]],
            opt.init(params))


# ------------------------------------------------------- eq. (22), update guard
def _overflowing_update_config() -> ss.ShampooConfig:
    """1 x 1 blocks, root 1, epsilon 1e-37, a root step before the first statistics.

    Step 1: the inverse root is 1/eps = 1e37, so P = 0.5e37 and lr M = 5e38,
    beyond float32 (eq. 22 withholds the update). Step 2: L = 0.25 + eps,
    P = 2, M = 2, W = 1 - 200. Step 3 (no statistics step): M = 0.9 * 2 + 2
    = 3.8, W = -199 - 380 = -579.
    """
    base = ss.ShampooConfig()
    return dataclasses.replace(
        base, learning_rate=100.0, epsilon=ss.EpsilonConfig(value=1e-37),
        exponents=dataclasses.replace(base.exponents, override=1.0),
        blocking=ss.BlockingConfig(max_preconditioner_dim=1),
        schedule=ss.ScheduleConfig(statistics_frequency=2),
        momentum=ss.MomentumConfig(momentum=0.9),
    )


def test_overflowing_update_is_withheld_and_counted() -> None:
    opt = shampoo_jax.shampoo(_overflowing_update_config())
    params = jnp.ones((2, 3), jnp.float32)
    state = opt.init(params)
    step = jax.jit(opt.update)
    g = jnp.full((2, 3), 0.5, jnp.float32)
    seen = []
    for _ in range(3):
        u, state = step(g, state, params)
        params = optax.apply_updates(params, u)
        seen.append((np.asarray(params).tolist(), np.asarray(state.momentum).tolist(),
                     int(state.withheld_updates)))
    assert seen[0] == ([[1.0] * 3] * 2, [[0.0] * 3] * 2, 1)  # withheld, momentum kept
    assert seen[1][0] == [[-199.0] * 3] * 2 and seen[2][0] == [[-579.0] * 3] * 2
    assert seen[2][2] == 1 and int(state.skipped_blocks) == 0


def test_update_guard_checks_the_new_value_when_params_are_passed() -> None:
    """float16 (largest 65504): with params, entries whose new value overflows get a zero
    update; without params only the update itself is checked (the docstring's contract)."""
    base = ss.ShampooConfig()
    cfg = dataclasses.replace(base, learning_rate=2000.0,
                              blocking=ss.BlockingConfig(max_preconditioner_dim=1))
    opt = shampoo_jax.shampoo(cfg)
    w0 = jnp.asarray([[-64000.0, 0.0, 64000.0]], jnp.float16)
    g = jnp.asarray([[1.0, 1.0, -1.0]], jnp.float16)  # P = sign(g) on 1 x 1 blocks
    u, s = opt.update(g, opt.init(w0), w0)
    assert np.asarray(optax.apply_updates(w0, u)).tolist() == [[-64000.0, -2000.0, 64000.0]]
    assert int(s.withheld_updates) == 1
    u, s = opt.update(g, opt.init(w0))
    assert np.asarray(u).tolist() == [[-2000.0, -2000.0, 2000.0]]
    assert int(s.withheld_updates) == 0


@pytest.mark.parametrize("devices", [None, 2])
def test_state_dtypes_are_stable_under_x64(devices: int | None) -> None:
    """Under x64 an update returns the state with init's dtypes (int32 counters stay
    int32), so a jitted update compiles once and ``lax.scan`` over it works."""
    with jax.enable_x64(True):
        sharding = None
        if devices is not None:
            mesh = Mesh(np.array(jax.devices("cpu")[:devices]), ("d",))
            sharding = shampoo_jax.ShardingConfig(mesh, "d")
        opt = shampoo_jax.shampoo(dataclasses.replace(CONFIG, factor_dtype="float64"),
                                  sharding=sharding)
        params = {k: jnp.ones(s, jnp.float64) for k, s in SHAPES.items()}
        state = opt.init(params)
        grads = {k: jnp.full(s, 0.5, jnp.float64) for k, s in SHAPES.items()}
        _, new = jax.jit(opt.update)(grads, state, params)
        assert jax.tree.map(lambda x: x.dtype, new) == jax.tree.map(lambda x: x.dtype, state)


def test_huge_integer_learning_rates_do_not_overflow() -> None:
    """A learning rate given as a Python int beyond int32 (the fuzzer drew 2**62) is a
    float to JAX: the update is computed, not an OverflowError."""
    params = {k: jnp.ones(s) for k, s in SHAPES.items()}
    grads = {k: jnp.full(s, 0.5) for k, s in SHAPES.items()}
    for opt in (shampoo_jax.shampoo(CONFIG, 2**62), shampoo_jax.shampoo(CONFIG, lambda _: 2**62)):
        u, _ = opt.update(grads, opt.init(params), params)
        assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(u))
