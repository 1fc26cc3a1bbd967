"""Eq. (16b): a diagonal preconditioner in place of the Kronecker factors.

float64 against the reference (<= 1e-9 relative, docs/spec.md section 5,
as test_reference_equality.py) for every diagonal type, without a graft and
with an adam graft rescaling per block or per parameter, under a gradient
filter and momentum, on a matrix split into blocks, a vector, a 3-d tensor
and a scalar. Then the law: with ``grafting.type="none"`` the step is the
first-order method itself, compared with optax's optimizer in float64
(<= 1e-12 relative). And eq. (3): the state V_D counts in the state max m.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shampoo_jax
import shampoo_spec as ss
from shampoo_conformance.adapters.jax import run as jax_run
from shampoo_reference import ReferenceShampoo
from shampoo_reference import run as reference_run

from .helpers import adam_grafts, reference_error, relative_error, run_x64, stream

# A (7, 10) matrix in 2 x 3 blocks (remainders included), a vector, a 3-d
# tensor in blocks and a 0-d parameter.
SHAPES = {"matrix": (7, 10), "vector": (7,), "tensor": (3, 4, 5), "scalar": ()}
STEPS = 10
BLOCKS = ss.BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None)

DIAGONALS = {
    "sgd": ss.DiagonalPreconditionerConfig(type="sgd"),
    "adagrad": ss.DiagonalPreconditionerConfig(type="adagrad"),
    "rmsprop": ss.DiagonalPreconditionerConfig(type="rmsprop", beta2=0.9, epsilon=1e-8),
    # Eq. (14b) with w = 1 (Meta's drop_weighting_factor_on_gsquare).
    "rmsprop_weight_one": ss.DiagonalPreconditionerConfig(
        type="rmsprop", beta2=0.9, ema_weight="one"),
    "adam": ss.DiagonalPreconditionerConfig(
        type="adam", beta2=0.99, epsilon=1e-8, bias_correction=True),
    "sign": ss.DiagonalPreconditionerConfig(type="sign"),
}
GRAFTS = adam_grafts()
BASE = ss.ShampooConfig(
    learning_rate=0.05,
    blocking=BLOCKS,
    gradient_filter=ss.GradientFilterConfig(beta1=0.9, bias_correction=True),
    momentum=ss.MomentumConfig(momentum=0.5, nesterov=True),
)
# Options around eq. (16b) that take other paths: the start step (the graft
# direction before it, eq. 18), the separate buffers (the diagonal direction
# accumulated every step, eq. 20), skip rules (parameters without blocks take
# the graft direction, V_D still updated), decoupled decay and L2 (eq. 2 enters V_D).
OTHER_CASES = {
    "late_start_separate_buffers": dataclasses.replace(
        BASE,
        diagonal=DIAGONALS["adam"],
        grafting=ss.GraftingConfig(type="adagrad"),
        momentum=ss.MomentumConfig(momentum=0.9, buffers="separate"),
        schedule=ss.ScheduleConfig(start_preconditioning_step=4),
    ),
    "skip_rules_l2": dataclasses.replace(
        BASE,
        diagonal=DIAGONALS["rmsprop"],
        blocking=ss.BlockingConfig(merge_dims_up_to=None, max_preconditioner_dim=4,
                                   skip_rank_lt=2),
        grafting=ss.GraftingConfig(type="rmsprop_normalized", beta2=0.9),
        weight_decay=ss.WeightDecayConfig(value=0.05, type="l2"),
    ),
    "merged_update_decay": dataclasses.replace(
        BASE,
        diagonal=DIAGONALS["adagrad"],
        blocking=ss.BlockingConfig(),
        grafting=ss.GraftingConfig(type="sgd", norm_scope="parameter"),
        weight_decay=ss.WeightDecayConfig(value=0.1, type="update"),
    ),
}


def _float64_error(config: ss.ShampooConfig, seed: int = 4) -> tuple[float, str]:
    return reference_error(config, SHAPES, STEPS, seed)


@pytest.mark.parametrize("graft", list(GRAFTS))
@pytest.mark.parametrize("diagonal", list(DIAGONALS))
def test_float64_equals_reference(diagonal: str, graft: str) -> None:
    config = dataclasses.replace(BASE, diagonal=DIAGONALS[diagonal], grafting=GRAFTS[graft])
    err, where = _float64_error(config)
    assert err <= 1e-9, f"{diagonal} {graft}: relative error {err:.3e} at {where}"


@pytest.mark.parametrize("name", list(OTHER_CASES))
def test_float64_equals_reference_other_paths(name: str) -> None:
    err, where = _float64_error(OTHER_CASES[name])
    assert err <= 1e-9, f"{name}: relative error {err:.3e} at {where}"


def test_state_is_the_diagonals_and_only_where_it_keeps_one() -> None:
    """V_D: a float leaf per parameter with a state (adagrad, rmsprop, adam), None else;
    no factors in any block group; nothing new without ``diagonal``."""
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
    for name, diagonal in DIAGONALS.items():
        s = shampoo_jax.shampoo(dataclasses.replace(BASE, diagonal=diagonal)).init(params)
        assert all(not gs.factors and not gs.inverse_roots for gs in s.groups), name
        if diagonal.has_state:
            assert jax.tree.map(jnp.shape, s.diagonal) == jax.tree.map(jnp.shape, params)
            assert {x.dtype for x in jax.tree.leaves(s.diagonal)} == {jnp.dtype(jnp.float32)}
        else:
            assert s.diagonal is None, name
    assert shampoo_jax.shampoo(BASE).init(params).diagonal is None


def test_diagonal_state_is_the_references() -> None:
    """After the steps, V_D equals the reference's (eq. 14b's rule on the L2-decayed g)."""
    config = OTHER_CASES["skip_rules_l2"]
    params, grads = stream(SHAPES, steps=STEPS, seed=4)
    ref = ReferenceShampoo(config, params)
    for g in grads:
        ref.step(g)
    names = sorted(params)
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        opt = shampoo_jax.shampoo(dataclasses.replace(config, factor_dtype="float64"))
        p = {k: jnp.asarray(params[k]) for k in names}
        s = opt.init(p)
        step = jax.jit(opt.update)
        for g in grads:
            u, s = step({k: jnp.asarray(g[k]) for k in names}, s, p)
            p = optax.apply_updates(p, u)
        for k in names:
            want = ref.state[k].diagonal
            assert want is not None
            np.testing.assert_allclose(np.asarray(s.diagonal[k]).reshape(want.shape), want,
                                       rtol=1e-13, atol=0, err_msg=k)


# ---------------------------------------------------------------- the law
LR = 0.05
TINY = 1e-30  # optax.adagrad's eps inside the sqrt, ours outside: see the adagrad case


def _law(diagonal: ss.DiagonalPreconditionerConfig, **fields: object) -> ss.ShampooConfig:
    """Eq. (16b) with no graft, no filter, no momentum unless given: the method itself."""
    return ss.ShampooConfig(learning_rate=LR, diagonal=diagonal, **fields)  # type: ignore[arg-type]


LAW_CASES = {
    # optax.sgd: w <- w - lr g; with momentum its trace f <- g + mu f is ours
    # with dampening 0 (torch's convention, too).
    "sgd": (optax.sgd(LR), _law(ss.DiagonalPreconditionerConfig(type="sgd"))),
    "sgd_momentum": (
        optax.sgd(LR, momentum=0.9),
        _law(ss.DiagonalPreconditionerConfig(type="sgd"),
             momentum=ss.MomentumConfig(momentum=0.9)),
    ),
    # optax.adagrad differs in two ways: its accumulator starts at
    # initial_accumulator_value (default 0.1; ours 0) and its eps sits inside
    # the sqrt, g / sqrt(V + eps) (ours: g / (sqrt(V) + epsilon), torch's).
    # With initial_accumulator_value=0 and eps = 1e-30 on both sides
    # (epsilon must be >= 2^-126), V + eps == V and sqrt(V) + eps == sqrt(V)
    # in float64 for V > 1e-14: both are g / sqrt(V). The placement of eps
    # itself is checked against the closed form below.
    "adagrad": (
        optax.adagrad(LR, initial_accumulator_value=0.0, eps=TINY),
        _law(ss.DiagonalPreconditionerConfig(type="adagrad", epsilon=TINY)),
    ),
    # optax.rmsprop: `decay` is our beta2; eps_in_sqrt=True by default, ours is outside.
    "rmsprop": (
        optax.rmsprop(LR, decay=0.9, eps=1e-8, eps_in_sqrt=False),
        _law(ss.DiagonalPreconditionerConfig(type="rmsprop", beta2=0.9, epsilon=1e-8)),
    ),
    # optax.adam: b1 is our gradient_filter.beta1 (bias-corrected), b2 the
    # diagonal's beta2 (bias-corrected), eps outside the sqrt (eps_root=0).
    "adam": (
        optax.adam(LR, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0),
        _law(ss.DiagonalPreconditionerConfig(type="adam", beta2=0.999, epsilon=1e-8,
                                             bias_correction=True),
             gradient_filter=ss.GradientFilterConfig(beta1=0.9, bias_correction=True)),
    ),
    # optax.adamw: the decoupled decay lr * wd * w is our weight_decay.type="update".
    "adamw": (
        optax.adamw(LR, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.1),
        _law(ss.DiagonalPreconditionerConfig(type="adam", beta2=0.999, epsilon=1e-8,
                                             bias_correction=True),
             gradient_filter=ss.GradientFilterConfig(beta1=0.9, bias_correction=True),
             weight_decay=ss.WeightDecayConfig(value=0.1, type="update")),
    ),
    "sign_sgd": (optax.sign_sgd(LR), _law(ss.DiagonalPreconditionerConfig(type="sign"))),
    # optax.signum: the sign of an EMA of the gradient (not debiased: a
    # positive factor does not change a sign) = the sign of our filtered gradient.
    "signum": (
        optax.signum(LR, beta=0.9),
        _law(ss.DiagonalPreconditionerConfig(type="sign"),
             gradient_filter=ss.GradientFilterConfig(beta1=0.9)),
    ),
}


@pytest.mark.parametrize("name", list(LAW_CASES))
def test_without_graft_the_diagonal_is_optax(name: str) -> None:
    opt, config = LAW_CASES[name]
    params, grads = stream({"w": (7, 10), "b": (7,), "s": ()}, steps=30, seed=1)
    want = run_x64(lambda: opt, params, grads)[0]  # optax's own, float64
    got = jax_run(config, params, grads, dtype=np.float64)
    err, where = relative_error(got, want, params)
    assert err <= 1e-12, f"{name}: relative error {err:.3e} to optax at {where}"


def test_without_graft_adagrad_is_the_closed_form_with_eps_outside() -> None:
    """``w <- w - lr g / (sqrt(sum g^2) + eps)`` with a large eps (torch.optim.Adagrad's
    placement), where optax's ``g / sqrt(sum g^2 + eps)`` would differ."""
    eps = 0.1
    config = _law(ss.DiagonalPreconditionerConfig(type="adagrad", epsilon=eps))
    params, grads = stream({"w": (7, 10), "b": (7,), "s": ()}, steps=30, seed=1)
    got = jax_run(config, params, grads, dtype=np.float64)
    w = {k: v.copy() for k, v in params.items()}
    v = {k: np.zeros_like(x) for k, x in params.items()}
    want = []
    for g in grads:
        for k in w:
            v[k] = v[k] + g[k] * g[k]
            w[k] = w[k] - LR * g[k] / (np.sqrt(v[k]) + eps)
        want.append({k: x.copy() for k, x in w.items()})
    err, where = relative_error(got, want, params)
    assert err <= 1e-12, f"relative error {err:.3e} to the closed form at {where}"


# ------------------------------------------------------------------ eq. (3)
def test_diagonal_state_counts_in_the_overflow_bound() -> None:
    """Eq. (3)'s m includes V_D: with no factors and no graft state, the only state.

    Every 2 x 2 block of w has max |G_B| = g = 6e18: |B| g^2 = 1.44e38 <= 2^127
    passes at step 1 (V_D = 0); V_D then holds g^2 = 3.6e37 and m + |B| g^2 >
    2^127 refuses all four blocks at step 2, as in the reference (which would
    refuse none if V_D did not count). The vector's small gradient passes.
    """
    config = ss.ShampooConfig(
        learning_rate=0.1, diagonal=ss.DiagonalPreconditionerConfig(type="adagrad"),
        blocking=ss.BlockingConfig(max_preconditioner_dim=2, merge_dims_up_to=None),
        failure=ss.FailureConfig(nonfinite_gradient="skip_block"),
    )
    params, grads = stream({"w": (4, 4), "b": (3,)}, steps=3, seed=1)
    for g in grads:
        g["w"] = 6e18 * np.sign(g["w"])
    ref = ReferenceShampoo(config, params)
    skipped = []
    for g in grads:
        ref.step(g)
        skipped.append(ref.metrics.skipped_blocks)
    assert skipped == [0, 4, 8]
    names = sorted(params)
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        opt = shampoo_jax.shampoo(dataclasses.replace(config, factor_dtype="float64"))
        p = {k: jnp.asarray(params[k]) for k in names}
        s = opt.init(p)
        step = jax.jit(opt.update)
        got = []
        for g in grads:
            u, s = step({k: jnp.asarray(g[k]) for k in names}, s, p)
            p = optax.apply_updates(p, u)
            got.append((int(s.skipped_blocks), np.asarray(s.skipped_per_parameter).tolist()))
    assert got == [(0, [0, 0]), (4, [0, 4]), (8, [0, 8])]  # b, w
    for k in names:
        np.testing.assert_allclose(np.asarray(p[k]), ref.params[k], rtol=1e-14, err_msg=k)


# ------------------------------------------------------------ factor_dtype
@pytest.mark.parametrize("graft", ["no_graft", "adam_block", "adam_parameter"])
def test_float32_factor_dtype_leaves_float64_parameters_exact(graft: str) -> None:
    """``factor_dtype`` has no effect with eq. (16b): float64 parameters under the
    default float32 ``factor_dtype`` keep float64 blocks (the diagonal direction and
    the graft's blocks of eq. 18), so the steps equal the reference's to float64
    rounding (blocks rounded to float32 gave 1e-8 to 8e-8)."""
    config = dataclasses.replace(BASE, diagonal=DIAGONALS["adam"], grafting=GRAFTS[graft])
    assert config.factor_dtype == "float32"
    params, grads = stream(SHAPES, steps=STEPS, seed=4)
    want = reference_run(config, params, grads)
    names = sorted(params)
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        opt = shampoo_jax.shampoo(config)  # factor_dtype as configured, not forced
        p = {k: jnp.asarray(params[k], jnp.float64) for k in names}
        s = opt.init(p)
        step = jax.jit(opt.update)
        got = []
        for g in grads:
            u, s = step({k: jnp.asarray(g[k], jnp.float64) for k in names}, s, p)
            p = optax.apply_updates(p, u)
            got.append({k: np.asarray(v) for k, v in p.items()})
    err, where = relative_error(got, want, params)
    assert err <= 1e-13, f"{graft}: relative error {err:.3e} at {where}"
