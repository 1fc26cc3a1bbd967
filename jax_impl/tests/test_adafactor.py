"""Eq. (14e), the Adafactor graft (``grafting.type="adafactor"``), in shampoo_jax.

- float64 (x64) equals the reference (<= 1e-9 relative, docs/spec.md
  section 5, as test_reference_equality.py) with Shampoo on after a warm-up,
  on factored 2-d and 3-d parameters (a tie of the two largest dims, a size-1
  dim, a merged 3-d parameter), unfactored vectors, small matrices and a
  scalar, with and without the clip (eq. 14d) and the parameter scale, under
  momentum and a gradient filter, per-block and per-parameter rescale (eq. 18);
  float32 within the bound test_reference_equality.py uses (1e-2).
- float32: the graft alone (lr 1, no momentum, preconditioning never starts)
  is optax's ``adafactor`` update bit for bit without the clip (both take
  beta_t with XLA's float32 ``pow``); with the clip within 8 float32 ulps:
  eq. (14d)'s rms is ``||u|| / sqrt(n)``, optax's ``sqrt(mean(u^2))``.
- beta_t under x64 is eq. (14e)'s correctly rounded schedule (the
  reference's) over the first 5000 steps; without x64 it is XLA's float32
  ``pow``, one ulp off at some t (t = 2 for c = 0.999).
- Eq. (3): a step that refuses a block leaves the moments of the whole
  parameter; the moments count in every block's m.
- Checkpoints round trip bit for bit; sharded (replicated and model-sharded
  parameters) equals one device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import shampoo_jax
import shampoo_spec as ss
from shampoo_conformance.adapters.jax import run as jax_run
from shampoo_conformance.suite.divergence import first_divergence
from shampoo_conformance.suite.tolerances import trajectory_bound
from shampoo_jax.grafting import FactoredMoments, adafactor_decay
from shampoo_reference import ReferenceShampoo
from shampoo_reference import run as reference_run
from shampoo_spec.limits import STATE_LIMIT

from .helpers import relative_error, run_x64, stream
from .sharded_helpers import (
    MESH_SHAPES,
    MESH_SPECS,
    assert_bitwise,
    place,
    run_on_2x2_mesh,
    sharding_1d,
    trajectory,
    transformation,
)

#: Factored (m = 4): (6, 9), the tie (6, 6) (d0 = 1, the later dim), (3, 8, 5) (d0 = 1,
#: d1 = 2) and (4, 1, 5) (d0 = 2, d1 = 0); unfactored: (7,), (2, 9) (2 < 4) and ().
SHAPES = {"m": (6, 9), "tie": (6, 6), "t": (3, 8, 5), "ones": (4, 1, 5), "v": (7,),
          "small": (2, 9), "s": ()}
STEPS = 8


def graft(**kwargs: Any) -> ss.GraftingConfig:
    fields: dict[str, Any] = {"type": "adafactor", "epsilon_placement": "inside_sqrt",
                              "epsilon": 1e-30, "decay_exponent": 0.8, "factor_min_dim": 4,
                              **kwargs}
    return ss.GraftingConfig(**fields)


BASE = ss.ShampooConfig(
    learning_rate=0.1,
    epsilon=ss.EpsilonConfig(value=1e-4),
    blocking=ss.BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None),
    grafting=graft(),
    momentum=ss.MomentumConfig(momentum=0.9),
    schedule=ss.ScheduleConfig(precondition_frequency=2, start_preconditioning_step=3),
)
CASES = {
    "plain": BASE,
    "clip_scale": dataclasses.replace(
        BASE, grafting=graft(clip_rms=0.5, parameter_scale_floor=1e-3)),
    # A floor above rms(W) for some parameters, a clip that acts on some steps,
    # eps inside the moments that matters, c = 0.999, the parameter-scope rescale.
    "clip_floor_parameter_scope_filter": dataclasses.replace(
        BASE,
        grafting=graft(clip_rms=1.0, parameter_scale_floor=0.9, epsilon=1e-3,
                       decay_exponent=0.999, norm_scope="parameter"),
        gradient_filter=ss.GradientFilterConfig(beta1=0.9),
        momentum=ss.MomentumConfig(momentum=0.5, nesterov=True),
        schedule=ss.ScheduleConfig(precondition_frequency=3, start_preconditioning_step=2),
    ),
    # Default blocking merges (3, 8, 5) and (4, 1, 5): the moments keep the
    # parameter's own shape; separate momentum buffers take the graft direction
    # every step (eq. 20).
    "merged_separate_buffers": dataclasses.replace(
        BASE, blocking=ss.BlockingConfig(),
        grafting=graft(parameter_scale_floor=1e-3),
        momentum=ss.MomentumConfig(momentum=0.9, buffers="separate"),
        schedule=ss.ScheduleConfig(start_preconditioning_step=2)),
}


@pytest.fixture(scope="module")
def data() -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    params, grads = stream(SHAPES, steps=STEPS, seed=2)
    return {k: 0.5 * v for k, v in params.items()}, grads


# --------------------------------------------------------------- vs the reference
@pytest.mark.parametrize("name", sorted(CASES))
def test_float64_equals_reference(name: str, data) -> None:  # noqa: ANN001
    config = CASES[name]
    params, grads = data
    want = reference_run(config, params, grads)
    got = jax_run(config, params, grads, dtype=np.float64)
    err, where = relative_error(got, want, params)
    assert err <= 1e-9, f"{name}: relative error {err:.3e} at {where}"
    # The graft is in the step: another graft type gives another trajectory.
    other = reference_run(dataclasses.replace(config, grafting=ss.GraftingConfig(
        type="rmsprop", beta2=0.9, epsilon_placement="inside_sqrt",
        norm_scope=config.grafting.norm_scope)), params, grads)
    assert relative_error(other, want, params)[0] > 1e-3


@pytest.mark.parametrize("name", ["plain", "clip_floor_parameter_scope_filter"])
def test_float32_within_documented_bound(name: str, data) -> None:  # noqa: ANN001
    config = dataclasses.replace(CASES[name], epsilon=ss.EpsilonConfig(value=1e-2))
    params, grads = data
    want = reference_run(config, params, grads)
    got = jax_run(config, params, grads, dtype=np.float32)
    err, where = relative_error(got, want, params)
    assert err <= 1e-2, f"{name}: float32 relative error {err:.3e} at {where}"


# ------------------------------------------------------------------ beta_t
@pytest.mark.parametrize("c", [0.8, 0.999])
def test_decay_under_x64_is_the_correctly_rounded_schedule(c: float) -> None:
    t = np.arange(1, 5001)
    graft = ss.GraftingConfig(type="adafactor", epsilon_placement="inside_sqrt",
                              decay_exponent=c)
    want = np.array([graft.adafactor_decay(int(i)) for i in t], np.float32)
    with jax.enable_x64(True):
        got = np.asarray(jax.jit(lambda t: adafactor_decay(t, c))(jnp.asarray(t, jnp.int32)))
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.float32 and got[0] == 0.0
    # Without x64 (float32 pow): t^(-c) at most one ulp off (<= 2^-24, as t^(-c) <= 1),
    # and off somewhere (t = 2 at c = 0.999, where beta_2 < 1/2 is then 2 of its ulps off).
    with jax.enable_x64(False):
        f32 = np.asarray(jax.jit(lambda t: adafactor_decay(t, c))(jnp.asarray(t, jnp.int32)))
    diff = np.abs(f32.astype(np.float64) - want)
    assert diff.max() <= 2.0**-24
    assert np.any(diff > 0)
    if c == 0.999:
        assert diff[1] > 0


# --------------------------------------------------------- optax.adafactor, float32
def _graft_only(clip: float | None, floor: float | None) -> ss.ShampooConfig:
    """The Adafactor graft alone: lr 1, no momentum, preconditioning never starts (eq. 18
    takes the graft direction), float32."""
    return ss.ShampooConfig(
        learning_rate=1.0, grafting=graft(clip_rms=clip, parameter_scale_floor=floor),
        momentum=ss.MomentumConfig(momentum=0.0),
        schedule=ss.ScheduleConfig(start_preconditioning_step=1000))


@pytest.mark.parametrize("clip, floor", [(None, None), (None, 1e-3), (None, 0.2),
                                         (0.05, None), (1.0, 1e-3)])
def test_graft_step_is_optax_adafactor(clip: float | None, floor: float | None) -> None:
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32)
              for k, s in SHAPES.items()}
    ours = shampoo_jax.shampoo(_graft_only(clip, floor))
    theirs = optax.adafactor(learning_rate=None, min_dim_size_to_factor=4, decay_rate=0.8,
                             multiply_by_parameter_scale=floor is not None, eps=1e-30,
                             clipping_threshold=clip)
    if floor is not None and floor != 1e-3:
        # optax.adafactor's chain with scale_by_param_block_rms's min_scale (1e-3 there) set.
        theirs = optax.chain(
            optax.scale_by_factored_rms(decay_rate=0.8, min_dim_size_to_factor=4, epsilon=1e-30),
            *([optax.clip_by_block_rms(clip)] if clip is not None else []),
            optax.scale_by_param_block_rms(min_scale=floor),
            optax.scale(-1.0))
    with jax.enable_x64(False):
        s_ours, s_theirs = ours.init(params), theirs.init(params)
        f_ours, f_theirs = jax.jit(ours.update), jax.jit(theirs.update)
        p = params
        clipped = scaled = floored = False
        for step in range(12):
            g = {k: jnp.asarray(rng.standard_normal(s) * 3.0 ** (step % 3), jnp.float32)
                 for k, s in SHAPES.items()}
            u_ours, s_ours = f_ours(g, s_ours, p)
            u_theirs, s_theirs = f_theirs(g, s_theirs, p)
            for k in SHAPES:
                a, b = np.asarray(u_ours[k]), np.asarray(u_theirs[k])
                assert a.dtype == b.dtype == np.float32
                if clip is None:
                    np.testing.assert_array_equal(a, b, err_msg=f"{k} at step {step + 1}")
                else:
                    np.testing.assert_allclose(a, b, rtol=8 * 2.0**-24, atol=0,
                                               err_msg=f"{k} at step {step + 1}")
                rms = float(np.sqrt(np.mean(np.square(a, dtype=np.float64))))
                w_rms = float(np.sqrt(np.mean(np.square(np.asarray(p[k]), dtype=np.float64))))
                scale = 1.0 if floor is None else max(w_rms, floor)
                clipped |= clip is not None and abs(rms / scale - clip) < 1e-5 * clip
                scaled |= floor is not None and w_rms > floor
                floored |= floor is not None and w_rms < floor
            p = optax.apply_updates(p, u_theirs)
    assert clipped == (clip is not None)  # the clip acted on some step
    # Both sides of max(rms(W), floor) were taken (rms(W) = 0.1 at first, then grows).
    assert scaled == (floor is not None)
    assert floored or floor != 0.2


# ----------------------------------------------------------------- eq. (3)
def _one_matrix_config(grafting: ss.GraftingConfig) -> ss.ShampooConfig:
    return ss.ShampooConfig(
        learning_rate=1e-20,
        blocking=ss.BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None),
        grafting=grafting, momentum=ss.MomentumConfig(momentum=0.0),
        failure=ss.FailureConfig(nonfinite_gradient="skip_block"),
        schedule=ss.ScheduleConfig(start_preconditioning_step=1000))


def test_a_refused_block_leaves_the_moments(data) -> None:  # noqa: ANN001
    """A NaN in one (4, 4) block of (6, 9): that step's moments are the previous ones
    (compared with the state after the steps before it), and the trajectory is the
    reference's."""
    config = dataclasses.replace(CASES["clip_scale"],
                                 failure=ss.FailureConfig(nonfinite_gradient="skip_block"))
    params, grads = data
    grads = [dict(g) for g in grads]
    grads[4]["m"] = grads[4]["m"].copy()
    grads[4]["m"][5, 8] = np.nan

    def make() -> Any:
        return shampoo_jax.shampoo(dataclasses.replace(config, factor_dtype="float64"))

    got, s, _ = run_x64(make, params, grads)
    _, before, _ = run_x64(make, params, grads[:4])
    _, after, _ = run_x64(make, params, grads[:5])
    assert int(s.skipped_blocks) == 1
    for k in SHAPES:
        same = k == "m"  # only the refused parameter keeps its moments
        for a, b in zip(jax.tree.leaves(after.adafactor[k]), jax.tree.leaves(before.adafactor[k]),
                        strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b)) == same, k
    want = reference_run(config, params, grads)
    err, where = relative_error(got, want, params)
    assert err <= 1e-9, f"relative error {err:.3e} at {where}"


@pytest.mark.parametrize("skip_rank_lt", [1, 3])
def test_the_moments_count_in_every_blocks_state_bound(skip_rank_lt: int) -> None:
    """Eq. (3)'s m of a block includes max(R, C) of its whole parameter.

    (4, 8): d0 = 1, d1 = 0. Step 1 puts g1 in entry (0, 0) (block A with blocks
    of 4, or the whole unblocked parameter with skip_rank_lt = 3), so max C =
    g1^2 / 4; step 2 puts g2 in the other half (block B), with 16 g2^2 just under
    the limit: block B's own state (eps I) lets it through, the moments do not.
    Without the Adafactor graft the step is taken; with it, refused as by the
    reference.
    """
    # Step 1 passes (32 or 16 g1^2 < LIMIT) and leaves max C = g1^2 / 4 = 0.0077 LIMIT;
    # step 2's |B| g2^2 = 0.995 LIMIT (|B| = 16 for block B, 32 unblocked).
    g1 = np.sqrt(0.99 * STATE_LIMIT / 32)
    g2 = np.sqrt(0.995 * STATE_LIMIT / (16 if skip_rank_lt == 1 else 32))
    step1 = np.zeros((4, 8))
    step1[0, 0] = g1
    step2 = np.zeros((4, 8))
    step2[:, 4:] = g2
    params = {"w": np.zeros((4, 8))}
    grads = [{"w": step1}, {"w": step2}]
    blocking = ss.BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None,
                                 skip_rank_lt=skip_rank_lt)
    counts = {}
    for name, grafting in (("adafactor", graft()), ("none", ss.GraftingConfig())):
        config = dataclasses.replace(_one_matrix_config(grafting), blocking=blocking)
        ref = ReferenceShampoo(config, params)
        for g in grads:
            ref.step(g)
        _, s, _ = run_x64(lambda c=config: shampoo_jax.shampoo(
            dataclasses.replace(c, factor_dtype="float64")), params, grads)
        assert int(s.skipped_blocks) == ref.metrics.skipped_blocks, name
        counts[name] = int(s.skipped_blocks)
    assert counts == {"adafactor": 1, "none": 0}


# ----------------------------------------------------------- params and state
def test_parameter_scale_needs_params(data) -> None:  # noqa: ANN001
    params, grads = data
    opt = shampoo_jax.shampoo(CASES["clip_scale"])
    p = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
    g = {k: jnp.asarray(v, jnp.float32) for k, v in grads[0].items()}
    with pytest.raises(ValueError, match=r"params = None is invalid with "
                                         r"grafting.parameter_scale_floor = 0.001"):
        opt.update(g, opt.init(p))
    unscaled = shampoo_jax.shampoo(CASES["plain"])
    # No scale: params not needed (traced abstractly: the check runs at trace time).
    jax.eval_shape(lambda g, s: unscaled.update(g, s), g, unscaled.init(p))


def test_state_holds_the_moments_in_each_parameters_own_shape(data) -> None:  # noqa: ANN001
    params, _ = data
    config = CASES["merged_separate_buffers"]  # (3, 8, 5) is merged for the blocks
    s = shampoo_jax.shampoo(config).init({k: jnp.asarray(v, jnp.float32)
                                          for k, v in params.items()})
    assert s.graft is None
    # The last field, so every state without the Adafactor graft keeps its checkpoint layout.
    assert shampoo_jax.ShampooState._fields[-1] == "adafactor"
    plain = shampoo_jax.shampoo(dataclasses.replace(config, grafting=ss.GraftingConfig(
        type="adam", beta2=0.99))).init({k: jnp.asarray(v) for k, v in params.items()})
    assert plain.adafactor is None and plain.graft is not None
    want = {"m": ((6,), (9,), None), "tie": ((6,), (6,), None), "t": ((3, 5), (3, 8), None),
            "ones": ((4, 1), (1, 5), None), "v": (None, None, (7,)),
            "small": (None, None, (2, 9)), "s": (None, None, ())}
    for k, shapes in want.items():
        m = s.adafactor[k]
        assert isinstance(m, FactoredMoments)
        assert tuple(None if x is None else x.shape for x in m) == shapes, k
        assert all(x is None or (x.dtype == jnp.float32 and not np.any(x)) for x in m)


def test_checkpoint_round_trip_resumes_bit_identically(tmp_path, data) -> None:  # noqa: ANN001
    config = dataclasses.replace(CASES["clip_scale"], factor_dtype="float64")
    params, grads = data

    def make() -> Any:
        return shampoo_jax.shampoo(config)

    want, _, _ = run_x64(make, params, grads)
    cut = 4
    first, s, _ = run_x64(make, params, grads[:cut])
    arrays = shampoo_jax.state_to_arrays(s)
    # The moments are the state's last arrays, in tree order (before format and config).
    moments = [np.asarray(x) for x in jax.tree.leaves(s.adafactor)]
    assert len(moments) == 11  # R and C of 4 factored parameters, V of 3
    for a, b in zip(arrays[-2 - len(moments):-2], moments, strict=True):
        assert a.dtype == np.float64
        np.testing.assert_array_equal(a, b)
    np.savez(tmp_path / "ckpt.npz", *arrays)
    with np.load(tmp_path / "ckpt.npz", allow_pickle=False) as f:
        loaded = [f[f"arr_{i}"] for i in range(len(f.files))]
    with jax.enable_x64(True):
        like = make().init({k: jnp.asarray(v) for k, v in params.items()})
        restored = shampoo_jax.state_from_arrays(loaded, like)
    for a, b in zip(jax.tree.leaves(restored.adafactor), moments, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    rest, _, _ = run_x64(lambda: _Resumed(make(), restored), dict(first[-1]), grads[cut:])
    assert_bitwise(first + rest, want)
    # A damaged moment is refused, naming the field.
    bad = list(loaded)
    bad[-3] = np.full_like(bad[-3], np.nan)
    with jax.enable_x64(True), pytest.raises(ValueError, match=r"adafactor.*non-finite"):
        shampoo_jax.state_from_arrays(bad, like)


class _Resumed:
    """A transformation whose ``init`` returns a restored state (for :func:`run_x64`)."""

    def __init__(self, opt: Any, state: Any) -> None:
        self.opt, self.state = opt, state

    def init(self, params: Any) -> Any:
        return self.state

    def update(self, g: Any, s: Any, p: Any) -> Any:
        return self.opt.update(g, s, p)


# ------------------------------------------------------------------- sharded
SHARDED = dataclasses.replace(
    BASE, grafting=graft(clip_rms=0.5, parameter_scale_floor=1e-3),
    failure=ss.FailureConfig(nonfinite_gradient="skip_block"))


def _assert_within_bound(config: ss.ShampooConfig, params: Any, grads: Any, got: Any,
                         want: Any) -> None:
    bound = trajectory_bound(config, params, grads, np.float32)
    want64 = [{k: np.asarray(v, np.float64) for k, v in w.items()} for w in want]
    div = first_divergence(got, want64, params, bound)
    assert div is None, div.describe()


def test_sharded_equals_single_device(data) -> None:  # noqa: ANN001
    """Replicated parameters, the blocks over 2, 3 and 4 devices, a refused block at
    step 5: the same trajectory and moments as one device (float32)."""
    params, grads = data
    grads = [dict(g) for g in grads]
    grads[4]["t"] = grads[4]["t"].copy()
    grads[4]["t"][0, 0, 0] = np.inf
    want, s1 = trajectory(SHARDED, params, grads, None)
    assert int(s1.skipped_blocks) == 1
    for n in (2, 3, 4):
        got, s = trajectory(SHARDED, params, grads, n)
        _assert_within_bound(SHARDED, params, grads, got, want)
        assert int(s.skipped_blocks) == 1
        for k in SHAPES:
            for a, b in zip(jax.tree.leaves(s.adafactor[k]), jax.tree.leaves(s1.adafactor[k]),
                            strict=True):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=0,
                                           err_msg=f"{k} on {n} devices")
        assert_bitwise(got, want)  # the programs fuse alike here (jax 0.10.2)


def test_sharded_checkpoint_restores_onto_another_device_count(data) -> None:  # noqa: ANN001
    params, grads = data
    want, _ = trajectory(SHARDED, params, grads, 2)
    cut = 4
    first, s = trajectory(SHARDED, params, grads[:cut], 2)
    like = jax.eval_shape(transformation(SHARDED, None)[0].init, place(params, None))
    arrays = shampoo_jax.sharded_state_to_arrays(s, like, sharding_1d(2))
    _, s_cut = trajectory(SHARDED, params, grads[:cut], None)
    for a, b in zip(arrays[:-2], jax.tree.leaves(s_cut), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    for n in (2, 3):
        restored = shampoo_jax.sharded_state_from_arrays(arrays, like, sharding_1d(n))
        rest, _ = trajectory(SHARDED, dict(first[-1]), grads[cut:], n, state=restored)
        if n == 2:
            assert_bitwise(first + rest, want)
        else:
            _assert_within_bound(SHARDED, params, grads, first + rest, want)


def test_model_sharded_parameters_shard_their_moments() -> None:
    """On a 2 x 2 mesh with parameters sharded over "model": R and C keep the spec
    entries of the dims they keep (the mean over a sharded dim is a cross-device
    reduction), V the parameter's; the trajectory is one device's within the float32
    bound."""
    config = dataclasses.replace(SHARDED, grafting=graft(clip_rms=0.5, parameter_scale_floor=1e-3,
                                                         factor_min_dim=3))
    params, grads = stream(MESH_SHAPES, steps=5, seed=11)
    want, _ = trajectory(config, params, grads, None)
    run = run_on_2x2_mesh(config, params, grads, MESH_SPECS)
    s = run.initial_state
    # w (12, 10): d0 = 0, d1 = 1, R = (10,) keeps "model", C = (12,) does not;
    # t (3, 4, 6): d0 = 2, d1 = 1, R = (3, 4) keeps "model", C = (3, 6) does not.
    assert s.adafactor["w"].row.sharding.spec == P("model")
    assert s.adafactor["w"].col.sharding.spec == P(None)
    assert s.adafactor["t"].row.sharding.spec == P(None, "model")
    assert s.adafactor["t"].col.sharding.spec == P(None, None)
    assert s.adafactor["v"].full.sharding.spec == P()
    _assert_within_bound(config, params, grads, run.params, want)
