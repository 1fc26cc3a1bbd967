"""jit compiles once; checkpoints resume bit-identically; failure masks; bf16 params."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shampoo_jax
import shampoo_spec as ss
from shampoo_conformance.adapters.jax import run as jax_run
from shampoo_reference import NonFiniteGradientError as RefNonFinite
from shampoo_reference import RootFailureError as RefRootFailure
from shampoo_reference import run as reference_run

from .helpers import relative_error, stream

CONFIG = ss.ShampooConfig(
    learning_rate=0.1,
    epsilon=ss.EpsilonConfig(value=1e-3),
    grafting=ss.GraftingConfig(type="adagrad"),
    momentum=ss.MomentumConfig(momentum=0.9),
    blocking=ss.BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None),
    schedule=ss.ScheduleConfig(precondition_frequency=3, start_preconditioning_step=2),
)
SHAPES = {"w": (6, 5), "b": (5,)}


def _jnp(tree: dict) -> dict:
    return {k: jnp.asarray(v, jnp.float32) for k, v in tree.items()}


def _make_step(config: ss.ShampooConfig, traces: list[int] | None = None):  # noqa: ANN202
    opt = shampoo_jax.shampoo(config)

    def step(p, s, g):  # noqa: ANN001, ANN202
        if traces is not None:
            traces.append(1)  # runs only while tracing
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    return opt, jax.jit(step)


def test_update_compiles_once_over_root_and_non_root_steps() -> None:
    traces: list[int] = []
    opt, step = _make_step(CONFIG, traces)
    params, grads = stream(SHAPES, steps=10)
    p = _jnp(params)
    s = opt.init(p)
    for g in grads:  # steps 1..10: root steps 2, 3, 6, 9 and non-root steps
        p, s = step(p, s, _jnp(g))
    assert len(traces) == 1, f"traced {len(traces)} times"
    assert step._cache_size() == 1, f"{step._cache_size()} compiled programs"
    assert int(s.count) == 10


def test_checkpoint_round_trip_resumes_bit_identically(tmp_path) -> None:  # noqa: ANN001
    opt, step = _make_step(CONFIG)
    params, grads = stream(SHAPES, steps=10)
    p = _jnp(params)
    s = opt.init(p)
    for g in grads[:5]:
        p, s = step(p, s, _jnp(g))
    path = tmp_path / "state.npz"
    arrays = shampoo_jax.state_to_arrays(s)
    np.savez(path, *arrays, **{f"param_{k}": np.asarray(v) for k, v in p.items()})
    loaded = np.load(path, allow_pickle=False)
    s2 = shampoo_jax.state_from_arrays(
        [loaded[f"arr_{i}"] for i in range(len(arrays))], like=opt.init(p)
    )
    p2 = {k: jnp.asarray(loaded[f"param_{k}"]) for k in p}
    for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(s2), strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    for g in grads[5:]:
        p, s = step(p, s, _jnp(g))
        p2, s2 = step(p2, s2, _jnp(g))
    for k in p:
        assert np.array_equal(np.asarray(p[k]), np.asarray(p2[k])), k
    for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(s2), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def _four_steps(config: ss.ShampooConfig):  # noqa: ANN202
    """The optimizer, its jitted step, and params and state after 4 of 8 steps (and the rest)."""
    opt, step = _make_step(config)
    params, grads = stream(SHAPES, steps=8)
    p = _jnp(params)
    s = opt.init(p)
    for g in grads[:4]:
        p, s = step(p, s, _jnp(g))
    return opt, step, p, s, grads[4:]


def _savez_load_and_resume(tmp_path, opt, step, p, s, rest) -> list:  # noqa: ANN001
    """Save ``s`` through numpy.savez, load it bit for bit (dtypes too), and check that
    the loaded state resumes exactly over ``rest``; returns the saved arrays."""
    path = tmp_path / "state.npz"
    arrays = shampoo_jax.state_to_arrays(s)
    np.savez(path, *arrays)
    loaded = np.load(path, allow_pickle=False)
    s2 = shampoo_jax.state_from_arrays([loaded[f"arr_{i}"] for i in range(len(arrays))],
                                       like=opt.init(p))
    for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(s2), strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    p2 = p
    for g in rest:
        p, s = step(p, s, _jnp(g))
        p2, s2 = step(p2, s2, _jnp(g))
    for k in p:
        assert np.array_equal(np.asarray(p[k]), np.asarray(p2[k])), k
    return arrays


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_checkpoint_keeps_the_inverse_root_dtype(tmp_path, dtype: str) -> None:  # noqa: ANN001
    """Eq. (11a): roots live and are saved in ``inverse_root_dtype``; through numpy.savez
    (bfloat16 comes back as raw 2-byte voids) they load bit for bit and resume exactly."""
    config = dataclasses.replace(CONFIG, inverse_root_dtype=dtype)  # type: ignore[arg-type]
    opt, step, p, s, rest = _four_steps(config)
    want = np.dtype(getattr(jnp, dtype))
    assert {np.dtype(x.dtype) for gs in s.groups for x in gs.inverse_roots} == {want}
    assert {np.dtype(x.dtype) for gs in s.groups for x in gs.factors} == {np.dtype(np.float32)}
    arrays = _savez_load_and_resume(tmp_path, opt, step, p, s, rest)
    # Roots in another dtype are refused, naming the field (never re-rounded on load).
    wrong = [a.astype(np.float32) if np.dtype(a.dtype) == want and a.ndim == 3 else a
             for a in arrays]
    if dtype != "float32":
        with pytest.raises(ValueError, match=r"inverse_roots.*the state needs"):
            shampoo_jax.state_from_arrays(wrong, like=opt.init(p))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_checkpoint_keeps_the_factor_storage_dtype(tmp_path, dtype: str) -> None:  # noqa: ANN001
    """Eq. (11b): factors live and are saved in ``factor_storage_dtype``; through
    numpy.savez they load bit for bit and resume exactly; factors widened to float32
    are refused naming the field (never re-rounded on load)."""
    config = dataclasses.replace(CONFIG, factor_storage_dtype=dtype,  # type: ignore[arg-type]
                                 epsilon=ss.EpsilonConfig(value=1e-4))
    opt, step, p, s, rest = _four_steps(config)
    want = np.dtype(getattr(jnp, dtype))
    assert {np.dtype(x.dtype) for gs in s.groups for x in gs.factors} == {want}
    assert {np.dtype(x.dtype) for gs in s.groups for x in gs.inverse_roots} == \
        {np.dtype(np.float32)}
    arrays = _savez_load_and_resume(tmp_path, opt, step, p, s, rest)
    wrong = [a.astype(np.float32) if np.dtype(a.dtype) == want else a for a in arrays]
    with pytest.raises(ValueError, match=r"factors.*the state needs"):
        shampoo_jax.state_from_arrays(wrong, like=opt.init(p))


def test_checkpoint_keeps_int8_momentum(tmp_path) -> None:  # noqa: ANN001
    """Eq. (20b): int8 buffers and their scales are saved as they are, load bit for bit
    through numpy.savez and resume exactly; a float buffer in their place, or a state
    saved under float storage, is refused naming what differs."""
    config = dataclasses.replace(CONFIG, momentum=ss.MomentumConfig(
        momentum=0.9, storage="int8_columnwise"))
    opt, step, p, s, rest = _four_steps(config)
    assert np.asarray(s.momentum["w"]).dtype == np.int8
    assert np.asarray(s.momentum["b"]).dtype == np.float32  # a vector: kept in float
    assert s.momentum_scale[0] is None and s.momentum_scale[1].shape == (5,)
    assert np.abs(np.asarray(s.momentum["w"])).max() == 127
    arrays = _savez_load_and_resume(tmp_path, opt, step, p, s, rest)
    wrong = [a.astype(np.float32) if a.dtype == np.int8 else a for a in arrays]
    with pytest.raises(ValueError, match=r"momentum.*int8"):
        shampoo_jax.state_from_arrays(wrong, like=opt.init(p))
    float_opt = shampoo_jax.shampoo(CONFIG)
    with pytest.raises(ValueError, match="momentum.storage"):
        shampoo_jax.state_from_arrays(arrays, like=float_opt.init(p))


def test_checkpoint_keeps_int16_statistics(tmp_path) -> None:  # noqa: ANN001
    """Eq. (20c): the read-back factors and roots are saved as they are (float32 here),
    load bit for bit and resume exactly; a state saved under float storage is refused
    naming the field, and the reverse."""
    config = dataclasses.replace(
        CONFIG, root_inverse=ss.CoupledNewtonConfig(),
        statistics=ss.StatisticsConfig(storage="int16_columnwise_diagonal"))
    opt, step, p, s, rest = _four_steps(config)
    arrays = _savez_load_and_resume(tmp_path, opt, step, p, s, rest)
    float_opt = shampoo_jax.shampoo(dataclasses.replace(config, statistics=ss.StatisticsConfig()))
    with pytest.raises(ValueError, match="statistics.storage"):
        shampoo_jax.state_from_arrays(arrays, like=float_opt.init(p))
    plain = shampoo_jax.state_to_arrays(float_opt.init(p))
    with pytest.raises(ValueError, match="statistics.storage"):
        shampoo_jax.state_from_arrays(plain, like=opt.init(p))


@pytest.mark.parametrize(("q", "d"), [("bfloat16", "float16"), ("float16", "bfloat16")])
def test_checkpoint_keeps_the_eigenvalue_correction_dtypes(tmp_path, q: str, d: str) -> None:  # noqa: ANN001
    """Eq. (17a): eigenbases live and are saved in ``eigenvectors_dtype``, D in
    ``corrected_eigenvalues_dtype``; through numpy.savez they load bit for bit and
    resume exactly; a D in another dtype is refused, naming the field."""
    ec = ss.EigenvalueCorrectionConfig(epsilon=1e-4, eigenvectors_dtype=q,  # type: ignore[arg-type]
                                       corrected_eigenvalues_dtype=d)  # type: ignore[arg-type]
    config = dataclasses.replace(CONFIG, eigenvalue_correction=ec)
    opt, step, p, s, rest = _four_steps(config)
    assert {np.dtype(x.dtype) for gs in s.groups for x in gs.inverse_roots} == \
        {np.dtype(getattr(jnp, q))}
    assert {np.dtype(gs.corrected_moment.dtype) for gs in s.groups} == \
        {np.dtype(getattr(jnp, d))}
    arrays = _savez_load_and_resume(tmp_path, opt, step, p, s, rest)
    moment = np.dtype(getattr(jnp, d))
    # Only D is in d here (q differs): widen it to float32.
    wrong = [a.astype(np.float32) if np.dtype(a.dtype) == moment else a for a in arrays]
    with pytest.raises(ValueError, match=r"corrected_moment.*the state needs"):
        shampoo_jax.state_from_arrays(wrong, like=opt.init(p))


def test_checkpoint_keeps_the_diagonal_state(tmp_path) -> None:  # noqa: ANN001
    """Eq. (16b): the diagonal state V_D is saved (the last arrays, after every other
    field), loads bit for bit through numpy.savez and resumes exactly; zeroing it
    changes the next steps (it is not recomputed); a state saved without a diagonal
    is refused naming the field."""
    diagonal = ss.DiagonalPreconditionerConfig(type="adam", beta2=0.99, bias_correction=True)
    config = dataclasses.replace(CONFIG, diagonal=diagonal)
    opt, step, p, s, rest = _four_steps(config)
    vd = jax.tree.leaves(s.diagonal)
    assert [x.shape for x in vd] == [(5,), (6, 5)]  # b, w
    assert all(float(np.min(np.asarray(x))) > 0 for x in vd)
    arrays = _savez_load_and_resume(tmp_path, opt, step, p, s, rest)
    for a, b in zip(arrays[-2 - len(vd):-2], vd, strict=True):  # before format and config
        assert np.array_equal(a, np.asarray(b))
    lost = s._replace(diagonal=jax.tree.map(jnp.zeros_like, s.diagonal))
    assert not np.array_equal(np.asarray(step(p, lost, _jnp(rest[0]))[0]["w"]),
                              np.asarray(step(p, s, _jnp(rest[0]))[0]["w"]))
    plain = shampoo_jax.state_to_arrays(shampoo_jax.shampoo(CONFIG).init(p))
    with pytest.raises(ValueError, match="diagonal"):
        shampoo_jax.state_from_arrays(plain, like=opt.init(p))


@pytest.mark.parametrize("root_inverse", [
    ss.EighConfig(eigenbasis_method="qr"), ss.EighConfig(basis_reuse_tolerance=0.3)],
    ids=["qr", "reuse"])
def test_checkpoint_keeps_the_stored_eigenbases(tmp_path, root_inverse: ss.EighConfig) -> None:  # noqa: ANN001
    """Eqs. (10f), (10h): the stored eigenbases (the last field of each block group) are
    saved, load bit for bit through numpy.savez and resume exactly; reset to I they
    change the next root step (they are not recomputed)."""
    config = dataclasses.replace(CONFIG, root_inverse=root_inverse)
    opt, step, p, s, rest = _four_steps(config)
    bases = [q for gs in s.groups for q in (gs.eigenbases or ())]
    assert all(not np.array_equal(np.asarray(q)[0], np.eye(q.shape[-1]))
               for q in bases if q.shape[-1] > 1)  # a 1 x 1 basis is +-1
    _savez_load_and_resume(tmp_path, opt, step, p, s, rest)
    reset = s._replace(groups=tuple(gs._replace(eigenbases=tuple(
        jnp.broadcast_to(jnp.eye(q.shape[-1], dtype=q.dtype), q.shape) for q in gs.eigenbases))
        for gs in s.groups))
    p1, p2 = p, p
    for g in rest[:2]:  # steps 5 (a root step: frequency 3, from 2) and 6
        p1, s = step(p1, s, _jnp(g))
        p2, reset = step(p2, reset, _jnp(g))
    assert not np.array_equal(np.asarray(p1["w"]), np.asarray(p2["w"]))


@pytest.mark.parametrize("averaging", ["gpa", "schedule_free"])
def test_checkpoint_keeps_the_averaging_state(tmp_path, averaging: str) -> None:  # noqa: ANN001
    """Eq. (20d): the base sequence Z and Schedule-Free's S are saved (the last arrays,
    after V_D's place), load bit for bit through numpy.savez and resume exactly; a
    changed Z or S changes the next steps (neither is recomputed); a state saved
    without averaging is refused naming the field."""
    config = dataclasses.replace(
        CONFIG, momentum=ss.MomentumConfig(), weight_decay=ss.WeightDecayConfig(value=0.01),
        averaging=ss.IterateAveragingConfig(type=averaging))  # type: ignore[arg-type]
    opt, step, p, s, rest = _four_steps(config)
    z = jax.tree.leaves(s.averaged)
    assert [x.shape for x in z] == [(5,), (6, 5)]  # b, w
    tail = z if averaging == "gpa" else [*z, s.lr_power_sum]
    if averaging == "schedule_free":
        assert float(s.lr_power_sum) == pytest.approx(4 * 0.1**2, rel=1e-6)
    arrays = _savez_load_and_resume(tmp_path, opt, step, p, s, rest)
    for a, b in zip(arrays[-2 - len(tail):-2], tail, strict=True):  # before format and config
        assert np.array_equal(a, np.asarray(b))
    moved = s._replace(averaged=jax.tree.map(lambda x: x + 1.0, s.averaged))
    assert not np.array_equal(np.asarray(step(p, moved, _jnp(rest[0]))[0]["w"]),
                              np.asarray(step(p, s, _jnp(rest[0]))[0]["w"]))
    if averaging == "schedule_free":
        doubled = s._replace(lr_power_sum=2.0 * s.lr_power_sum)
        assert not np.array_equal(np.asarray(step(p, doubled, _jnp(rest[0]))[0]["w"]),
                                  np.asarray(step(p, s, _jnp(rest[0]))[0]["w"]))
    plain = shampoo_jax.state_to_arrays(shampoo_jax.shampoo(
        dataclasses.replace(config, averaging=None)).init(p))
    with pytest.raises(ValueError, match="averaging"):
        shampoo_jax.state_from_arrays(plain, like=opt.init(p))


class _GroupBeforeRename(NamedTuple):
    """``BlockGroupState`` as it was before ``roots`` became ``inverse_roots``."""

    factors: tuple
    roots: tuple
    statistics_updates: object
    consecutive_failures: object
    corrected_moment: object
    corrected_updates: object


def test_checkpoint_written_before_the_inverse_roots_rename_loads() -> None:
    # Checkpoints are positional (tree order), so the field's old name does not matter.
    assert shampoo_jax.BlockGroupState._fields == (
        "factors", "inverse_roots", "statistics_updates", "consecutive_failures",
        "corrected_moment", "corrected_updates", "sketches", "eigenbases",
    )
    opt, step = _make_step(CONFIG)
    params, grads = stream(SHAPES, steps=3)
    p = _jnp(params)
    s = opt.init(p)
    for g in grads:
        p, s = step(p, s, _jnp(g))
    # The sketches (eq. 10d) and QR eigenbases (eq. 10f), added after the rename, are
    # None here: no arrays.
    assert all(gs.sketches is None and gs.eigenbases is None for gs in s.groups)
    old = s._replace(groups=tuple(_GroupBeforeRename(*gs[:6]) for gs in s.groups))
    arrays = shampoo_jax.state_to_arrays(old)
    restored = shampoo_jax.state_from_arrays(arrays, like=opt.init(p))
    for gs, want in zip(restored.groups, s.groups, strict=True):
        assert isinstance(gs, shampoo_jax.BlockGroupState)
        for a, b in zip(gs.inverse_roots, want.inverse_roots, strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(s), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_block_is_skipped_exactly_as_the_reference(bad: float) -> None:
    config = dataclasses.replace(
        CONFIG, failure=ss.FailureConfig(nonfinite_gradient="skip_block"),
        blocking=ss.BlockingConfig(max_preconditioner_dim=2, merge_dims_up_to=None),
    )
    params, grads = stream({"w": (4, 2), "b": (3,)}, steps=8)
    grads[2]["w"][0, 0] = bad
    grads[4]["b"][1] = bad
    want = reference_run(config, params, grads)
    got = jax_run(config, params, grads, dtype=np.float64)
    err, where = relative_error(got, want, params)
    assert err <= 1e-9, f"relative error {err:.2e} at {where}"
    np.testing.assert_array_equal(got[2]["w"][:2], got[1]["w"][:2])  # masked block unchanged
    # The counter: the bad w block at step 3 and b's whole (single) block at step 5.
    opt, step = _make_step(config)
    p, s = _jnp(params), opt.init(_jnp(params))
    for g in grads:
        p, s = step(p, s, _jnp(g))
    assert int(s.skipped_blocks) == 2
    for leaf in jax.tree.leaves(s):
        assert bool(jnp.all(jnp.isfinite(leaf))) if leaf.dtype.kind == "f" else True


def test_raise_policy_raises_between_steps_like_the_reference() -> None:
    config = dataclasses.replace(CONFIG, failure=ss.FailureConfig(nonfinite_gradient="raise"))
    params, grads = stream(SHAPES, steps=3)
    grads[1]["w"][0, 0] = np.nan
    with pytest.raises(RefNonFinite):
        reference_run(config, params, grads)
    with pytest.raises(shampoo_jax.NonFiniteGradientError):
        jax_run(config, params, grads, dtype=np.float64)


def test_failed_roots_keep_previous_root_and_are_counted() -> None:
    # One Newton iteration can never reach error < 1e-9: every root fails and
    # the inverse roots stay identity (eq. 13), as in the reference.
    config = dataclasses.replace(
        CONFIG, root_inverse=ss.CoupledNewtonConfig(max_iterations=1, failure_threshold=1e-9),
    )
    params, grads = stream(SHAPES, steps=7)
    want = reference_run(config, params, grads)
    got = jax_run(config, params, grads, dtype=np.float64)
    err, where = relative_error(got, want, params)
    assert err <= 1e-9, f"relative error {err:.2e} at {where}"
    opt, step = _make_step(config)
    p, s = _jnp(params), opt.init(_jnp(params))
    for g in grads:
        p, s = step(p, s, _jnp(g))
    # Root steps 2, 3, 6; factors: w (6,5) in blocks 4x4, 4x1, 2x4, 2x1 -> 8, b -> 2 factors.
    assert int(s.root_failures) == 3 * 10
    for gs in s.groups:
        for r in gs.inverse_roots:
            eye = np.broadcast_to(np.eye(r.shape[-1]), r.shape)
            np.testing.assert_array_equal(np.asarray(r), eye)
        assert np.asarray(gs.consecutive_failures).tolist() == [3] * gs.consecutive_failures.size
    limited = dataclasses.replace(config, failure=ss.FailureConfig(max_consecutive_root_failures=1))
    with pytest.raises(RefRootFailure):
        reference_run(limited, params, grads)
    with pytest.raises(shampoo_jax.RootFailureError):
        jax_run(limited, params, grads, dtype=np.float64)


def test_bfloat16_params_keep_their_dtype_and_track_float32() -> None:
    opt, step = _make_step(CONFIG)
    params, grads = stream(SHAPES, steps=6)
    p16 = {k: jnp.asarray(v, jnp.bfloat16) for k, v in params.items()}
    s16 = opt.init(p16)
    p32 = {k: v.astype(jnp.float32) for k, v in p16.items()}
    s32 = opt.init(p32)
    for g in grads:
        p16, s16 = step(p16, s16, {k: jnp.asarray(v, jnp.bfloat16) for k, v in g.items()})
        p32, s32 = step(p32, s32, {k: jnp.asarray(v, jnp.bfloat16).astype(jnp.float32)
                                   for k, v in g.items()})
    for k in p16:
        assert p16[k].dtype == jnp.bfloat16
        assert s16.momentum[k].dtype == jnp.float32  # elementwise state in float32
        a, b = np.asarray(p16[k], np.float32), np.asarray(p32[k])
        # bf16 keeps 8 bits: each of 6 steps rounds the parameter by <= 2^-9 relative.
        assert np.linalg.norm(a - b) <= 6 * 2.0**-8 * np.linalg.norm(b), k


def test_schedule_learning_rate_and_weight_decay_needs_params() -> None:
    params, grads = stream(SHAPES, steps=4)
    fixed = jax_run(CONFIG, params, grads, dtype=np.float32)
    opt = shampoo_jax.shampoo(CONFIG, learning_rate=optax.constant_schedule(0.1))
    p, s = _jnp(params), opt.init(_jnp(params))
    step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
        *opt.update(g, s, p)))
    for g in grads:
        p, s = step(p, s, _jnp(g))
    for k in p:
        np.testing.assert_allclose(np.asarray(p[k]), fixed[-1][k], rtol=1e-6, atol=1e-7)
    decayed = shampoo_jax.shampoo(dataclasses.replace(
        CONFIG, weight_decay=ss.WeightDecayConfig(value=0.1)))
    with pytest.raises(ValueError, match="params"):
        decayed.update(_jnp(grads[0]), decayed.init(_jnp(params)))


def test_float64_statistics_scales_need_x64() -> None:
    """Eq. (20c) in float64 needs 64-bit JAX (it would compute in float32 otherwise)."""
    config = dataclasses.replace(
        CONFIG, root_inverse=ss.CoupledNewtonConfig(),
        statistics=ss.StatisticsConfig(storage="int16_columnwise_diagonal",
                                       scale_dtype="float64"))
    with jax.enable_x64(False), pytest.raises(
            ValueError, match="statistics.scale_dtype = 'float64' needs 64-bit JAX"):
        shampoo_jax.shampoo(config).init(_jnp({k: np.zeros(s) for k, s in SHAPES.items()}))
