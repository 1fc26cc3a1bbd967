"""Eq. (16c): spectral descent, each block's direction the orthogonalized ``orth(F~_B)``.

float64 against the reference (<= 1e-9 relative, docs/spec.md section 5,
as test_reference_equality.py) for the SVD (plain and scaled by the nuclear
norm) and Newton-Schulz (Muon's coefficients, 5 steps; another polynomial,
20 steps), without a graft and with an adam graft rescaling per block or
per parameter, under a gradient filter and momentum, on matrices split into
blocks, a 3-d tensor merged to 2-D and a vector left to the graft. Then the
closed forms (one SVD step is ``-lr U V^T`` per block; Newton-Schulz with
Modula's coefficients converges to an orthonormal-column matrix), the
sharded transformation against one device, and ``factor_dtype`` without
effect: float64 parameters under a float32 ``factor_dtype`` are not rounded
to float32 on the way through the blocks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shampoo_jax
import shampoo_spec as ss
from shampoo_conformance.adapters.jax import run as jax_run
from shampoo_conformance.suite.divergence import first_divergence
from shampoo_conformance.suite.tolerances import trajectory_bound
from shampoo_jax.blocks import make_layout
from shampoo_jax.placement import group_costs, placement
from shampoo_jax.preconditioner import BlockInputs, block_step, orthogonalize
from shampoo_jax.sharded import shard_state, sharded_block_step
from shampoo_reference import run as reference_run

from .helpers import adam_grafts, reference_error, relative_error, run_x64, stream
from .sharded_helpers import sharding_1d, trajectory

# (6, 9) and (9, 4) in blocks of at most 4 x 4 (remainders included), a
# (2, 3, 4) tensor merged to (6, 4) (then 4 x 4 and 2 x 4 blocks) and a
# vector, which skip_rank_lt=2 leaves to the graft direction.
SHAPES = {"wide": (6, 9), "tall": (9, 4), "tensor": (2, 3, 4), "vector": (5,)}
STEPS = 10
BLOCKS = ss.BlockingConfig(max_preconditioner_dim=4, merge_target_rank=2, skip_rank_lt=2)

SPECTRALS = {
    "svd": ss.SpectralDescentConfig(method="svd"),
    "svd_nuclear": ss.SpectralDescentConfig(method="svd", scale_by_nuclear_norm=True),
    "newton_schulz": ss.SpectralDescentConfig(),
    "newton_schulz_20": ss.SpectralDescentConfig(
        coefficients=(3.0, -3.2, 1.2), num_iterations=20),
}
GRAFTS = adam_grafts()
BASE = ss.ShampooConfig(
    learning_rate=0.05,
    blocking=BLOCKS,
    gradient_filter=ss.GradientFilterConfig(beta1=0.9, bias_correction=True),
    momentum=ss.MomentumConfig(momentum=0.5, nesterov=True),
)


def _float64_error(config: ss.ShampooConfig, seed: int = 4) -> tuple[float, str]:
    return reference_error(config, SHAPES, STEPS, seed)


@pytest.mark.parametrize("graft", list(GRAFTS))
@pytest.mark.parametrize("spectral", list(SPECTRALS))
def test_float64_equals_reference(spectral: str, graft: str) -> None:
    config = dataclasses.replace(BASE, spectral=SPECTRALS[spectral], grafting=GRAFTS[graft])
    err, where = _float64_error(config)
    assert err <= 1e-9, f"{spectral} {graft}: relative error {err:.3e} at {where}"


def test_state_has_no_factors_and_other_blocks_are_refused() -> None:
    """No factors, roots or corrected moment; a block that is not a matrix is refused
    (``shampoo_spec.plan_parameter``'s ValueError) when it is preconditioned."""
    config = dataclasses.replace(BASE, spectral=SPECTRALS["svd"])
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
    s = shampoo_jax.shampoo(config).init(params)
    assert s.groups and all(not gs.factors and not gs.inverse_roots
                            and gs.corrected_moment is None for gs in s.groups)
    assert all(len(grp.shape) == 2 for grp in make_layout(
        tuple(SHAPES[k] for k in sorted(SHAPES)), config).groups)
    no_skip = dataclasses.replace(config, blocking=ss.BlockingConfig(
        max_preconditioner_dim=4, merge_target_rank=2))
    with pytest.raises(ValueError, match="2-D blocks only"):
        shampoo_jax.shampoo(no_skip).init({"vector": jnp.zeros((5,), jnp.float32)})


# ------------------------------------------------------------ closed forms
def test_svd_step_is_minus_lr_u_vt_per_block() -> None:
    """With the SVD and no graft, the first step from W0 is ``-lr U V^T`` of every
    gradient block (no filter, no momentum)."""
    lr = 0.05
    config = ss.ShampooConfig(
        learning_rate=lr, spectral=SPECTRALS["svd"],
        blocking=ss.BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None))
    params, grads = stream({"w": (6, 9)}, steps=1, seed=2)
    got = jax_run(config, params, grads, dtype=np.float64)[0]["w"]
    g = grads[0]["w"]
    want = params["w"].copy()
    for rows in (slice(0, 4), slice(4, 6)):
        for cols in (slice(0, 4), slice(4, 8), slice(8, 9)):
            u, _, vt = np.linalg.svd(g[rows, cols], full_matrices=False)
            want[rows, cols] -= lr * (u @ vt)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-14)
    assert not np.allclose(got, params["w"] - lr * g, atol=1e-3)  # not plain sgd


@pytest.mark.parametrize("shape", [(9, 4), (4, 9)])
def test_newton_schulz_with_modula_coefficients_orthonormalizes(shape: tuple[int, int]) -> None:
    """60 steps of ``(3, -16/5, 6/5)``: each s -> 3s - 3.2s^3 + 1.2s^5 has the fixed
    point 1 (slope -0.6), so a full-rank block goes to its polar factor U V^T, with
    orthonormal columns (tall) or rows (wide, through the transpose)."""
    spectral = ss.SpectralDescentConfig(coefficients=(3.0, -16 / 5, 6 / 5), num_iterations=60)
    rng = np.random.default_rng(5)
    f = rng.standard_normal((3, *shape))
    f[1] *= 1e-6  # the 1e-8 floor of the norm plays no part: the scale divides out
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        x = np.asarray(jax.jit(lambda a: orthogonalize(a, spectral))(jnp.asarray(f)))
    assert x.dtype == np.float64
    for i in range(len(f)):
        small = x[i] if shape[0] >= shape[1] else x[i].T
        np.testing.assert_allclose(small.T @ small, np.eye(min(shape)), rtol=0, atol=1e-10)
        u, _, vt = np.linalg.svd(f[i], full_matrices=False)
        np.testing.assert_allclose(x[i], u @ vt, rtol=0, atol=1e-10)


# ----------------------------------------------------------------- sharded
SHARDED = {
    "svd": dataclasses.replace(
        BASE, spectral=SPECTRALS["svd_nuclear"], grafting=GRAFTS["adam_block"]),
    "newton_schulz": dataclasses.replace(
        BASE, spectral=SPECTRALS["newton_schulz"],
        grafting=ss.GraftingConfig(type="adagrad", norm_scope="parameter"),
        momentum=ss.MomentumConfig(momentum=0.9, buffers="separate"),
        schedule=ss.ScheduleConfig(start_preconditioning_step=3)),
}
# Six 4 x 4 blocks in one group (uneven over 4 devices), remainders, the merged
# tensor and the vector left to the graft.
SHARDED_SHAPES = {"w": (12, 10), "t": (2, 3, 4), "v": (9,)}
SHARDED_STEPS = 6


@pytest.mark.parametrize("name", sorted(SHARDED))
def test_sharded_block_work_equals_single_device(name: str) -> None:
    """``block_step`` on each device's shard == on all blocks (padding included): bitwise."""
    config = SHARDED[name]
    layout = make_layout(tuple(SHARDED_SHAPES[k] for k in sorted(SHARDED_SHAPES)), config)
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHARDED_SHAPES.items()}
    s1 = shampoo_jax.shampoo(config).init(params)
    rng = np.random.default_rng(7)
    stacks = [rng.standard_normal((grp.size, *grp.shape)).astype(np.float32)
              for grp in layout.groups]
    inputs = BlockInputs(
        grads=[jnp.asarray(x) for x in stacks],
        ok=[jnp.asarray(np.arange(grp.size) % 5 != 1) for grp in layout.groups],
        filtered=[jnp.asarray(1.5 * x) for x in stacks],
        graft=[jnp.asarray(-x) for x in stacks] if config.grafting.rescale_scope == "block"
        else None,
    )
    t = jnp.asarray(4, jnp.int32)
    _, _, want = jax.jit(lambda g, i, t: block_step(g, i, t, layout, config))(
        s1.groups, inputs, t)
    assert want is not None
    for n in (2, 3, 4):
        sh = sharding_1d(n)
        got = jax.jit(lambda g, i, t, sh=sh: sharded_block_step(g, i, t, layout, config, sh))(
            shard_state(s1, sh).groups, jax.device_put(inputs, sh.replicated), t)[2]
        assert got is not None
        assert placement(tuple(grp.size for grp in layout.groups), group_costs(s1.groups), n)
        for a, b in zip(got, want, strict=True):
            # Bitwise (checked on jax 0.10.2: the per-block SVD and batched products
            # round alike on the per-device stacks).
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{n=}")


@pytest.mark.parametrize("name", sorted(SHARDED))
def test_sharded_parameters_equal_single_device(name: str) -> None:
    """Within the float32 trajectory bound (docs/spec.md section 5), not bitwise: the
    elementwise ops around the blocks fuse differently (test_sharded.py's docstring)."""
    config = SHARDED[name]
    params, grads = stream(SHARDED_SHAPES, steps=SHARDED_STEPS, seed=3)
    want, s1 = trajectory(config, params, grads, None)
    assert all(not np.array_equal(want[-1][k], params[k]) for k in params)
    bound = trajectory_bound(config, params, grads, np.float32)
    for n in (2, 3, 4):
        got, s = trajectory(config, params, grads, n)
        div = first_divergence(
            got, [{k: v.astype(np.float64) for k, v in w.items()} for w in want], params, bound)
        assert div is None, div.describe()
        assert int(s.count) == SHARDED_STEPS
        assert int(s.skipped_blocks) == int(s1.skipped_blocks)


# ------------------------------------------------------------ factor_dtype
META = {"lr": 0.01, "preconditioner_config": {"type": "SpectralDescentPreconditionerConfig"},
        "max_preconditioner_dim": 4}


def _run_float64_params(config: ss.ShampooConfig, params: dict, grads: list[dict]) -> list[dict]:
    """float64 parameters under x64 with the config's own ``factor_dtype`` (not forced)."""
    out: list[dict] = run_x64(lambda: shampoo_jax.shampoo(config), params, grads)[0]
    return out


META_GRAFTS = {
    "meta_default": None,  # Meta's config: no graft
    "adagrad_block": ss.GraftingConfig(type="adagrad"),
    "adagrad_parameter": ss.GraftingConfig(type="adagrad", norm_scope="parameter"),
}


@pytest.mark.parametrize("graft", list(META_GRAFTS))
def test_float32_factor_dtype_leaves_float64_parameters_exact(graft: str) -> None:
    """Meta's spectral config has ``factor_dtype = "float32"``; it has no effect: with
    float64 parameters the blocks (and the graft's blocks, eq. 18) stay float64."""
    config = ss.from_meta(META)
    assert config.factor_dtype == "float32" and config.spectral is not None
    grafting = META_GRAFTS[graft]
    if grafting is not None:
        config = dataclasses.replace(config, grafting=grafting)
    # Meta's merge limit is max_preconditioner_dim: (2, 2, 4) merges to (4, 4), every
    # parameter is 2-D after eq. (4) (Meta's config skips nothing).
    params, grads = stream({"wide": (6, 9), "tall": (9, 4), "tensor": (2, 2, 4)},
                           steps=STEPS, seed=6)
    want = reference_run(config, params, grads)
    got = _run_float64_params(config, params, grads)
    assert all(v.dtype == np.float64 for v in got[-1].values())
    err, where = relative_error(got, want, params)
    assert err <= 1e-13, f"relative error {err:.3e} at {where} (float32 blocks: ~2e-6)"
