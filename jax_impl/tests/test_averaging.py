"""Eq. (20d): iterate averaging (GPA, Schedule-Free) in place of momentum.

float64 against the reference (<= 1e-9 relative, docs/spec.md section 5,
as test_reference_equality.py): GPA and Schedule-Free (powers 2 and 0),
with and without direction decay (Z shrinks; scaled by lr_t / lr_0 once),
with an adam graft, under a learning-rate schedule (Schedule-Free's mu_x
follows it), with the update rounded to bfloat16 (eq. 21a), with a
refused block (eq. 3: W and Z kept); Z and S equal the reference's, and
``averaged_params`` equals the reference's ``eval()`` parameters. Then the
law: GPA with mu_y = 1 and mu_x = beta on an SGD diagonal at lr / (1 - beta)
is ``optax.sgd(lr, momentum=beta)``. And the API: the state's fields,
``params`` required, one compile under a schedule, a chain's state, config
checks, a warmup from lr 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shampoo_jax
import shampoo_spec as ss
from shampoo_reference import ReferenceShampoo
from shampoo_reference import run as reference_run

from .helpers import BLOCKED_SHAPES, blocked_base, relative_error, run_x64, stream

SHAPES = BLOCKED_SHAPES
STEPS = 10
BASE: ss.ShampooConfig = blocked_base()  # type: ignore[assignment]
GPA = ss.IterateAveragingConfig(type="gpa", train_interp=0.8, eval_interp=0.9)
SCHEDULE_FREE = ss.IterateAveragingConfig(type="schedule_free", train_interp=0.7)
DECAY = ss.WeightDecayConfig(value=0.1, type="direction")
ADAM = ss.GraftingConfig(type="adam", beta2=0.999, bias_correction=True)

CASES = {
    "gpa": dataclasses.replace(BASE, averaging=GPA),
    "schedule_free": dataclasses.replace(BASE, averaging=SCHEDULE_FREE),
    # p = 0: mu_x = 1 - 1 / t, the uniform average.
    "schedule_free_power_0": dataclasses.replace(
        BASE, averaging=ss.IterateAveragingConfig(type="schedule_free", eval_lr_power=0)),
    "gpa_decay": dataclasses.replace(BASE, averaging=GPA, weight_decay=DECAY),
    "schedule_free_decay": dataclasses.replace(BASE, averaging=SCHEDULE_FREE, weight_decay=DECAY),
    "gpa_adam_graft": dataclasses.replace(BASE, averaging=GPA, grafting=ADAM),
    # The graft's rescale per parameter, the filter, L2 decay into the gradient.
    "schedule_free_adam_l2_filter": dataclasses.replace(
        BASE, averaging=SCHEDULE_FREE,
        grafting=dataclasses.replace(ADAM, norm_scope="parameter"),
        gradient_filter=ss.GradientFilterConfig(beta1=0.9, bias_correction=True),
        weight_decay=ss.WeightDecayConfig(value=0.05, type="l2")),
    # Eq. (21a): Delta rounded to bfloat16 (Z is not), then added.
    "gpa_update_bf16": dataclasses.replace(BASE, averaging=GPA, update_dtype="bfloat16"),
    # The learning rate scales P before the (absent) momentum: d = -(lr P) all the same.
    "gpa_lr_before_momentum": dataclasses.replace(
        BASE, averaging=GPA, grafting=ADAM,
        momentum=ss.MomentumConfig(learning_rate_placement="before_momentum")),
}


def _lr_schedule(count: Any) -> Any:
    """0.05 (1 - count / 16): in the dtype JAX computes in (float64 under x64)."""
    return 0.05 * (1.0 - count / 16.0)


RATES = [0.05 * (1.0 - c / 16.0) for c in range(STEPS)]


def _jax_run(
    config: ss.ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    learning_rate: Any = None,
) -> tuple[list[dict[str, np.ndarray]], Any, dict[str, np.ndarray]]:
    """float64 trajectory, the final state and ``averaged_params`` after the last step."""
    def averaged(s: Any, p: Any) -> dict[str, np.ndarray]:
        x = jax.jit(shampoo_jax.averaged_params)(s, p)
        return {k: np.asarray(v) for k, v in x.items()}

    return run_x64(lambda: shampoo_jax.shampoo(
        dataclasses.replace(config, factor_dtype="float64"), learning_rate=learning_rate),
        params, grads, averaged)


def _reference(
    config: ss.ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    rates: list[float] | None = None,
) -> tuple[list[dict[str, np.ndarray]], ReferenceShampoo]:
    ref = ReferenceShampoo(config, params)
    steps = rates if rates is not None else [None] * len(grads)
    return [ref.step(g, lr) for g, lr in zip(grads, steps, strict=True)], ref


@pytest.mark.parametrize("name", list(CASES))
def test_float64_equals_reference(name: str) -> None:
    config = CASES[name]
    params, grads = stream(SHAPES, steps=STEPS, seed=4)
    want, ref = _reference(config, params, grads)
    got, state, x = _jax_run(config, params, grads)
    err, where = relative_error(got, want, params)
    assert err <= 1e-9, f"{name}: relative error {err:.3e} at {where}"
    # The state: Z (merged shape in the reference) and S.
    for k in params:
        z = ref.state[k].averaged
        assert z is not None
        np.testing.assert_allclose(np.asarray(state.averaged[k]).reshape(z.shape), z,
                                   rtol=1e-9, atol=1e-12, err_msg=f"{name} Z of {k}")
    if config.averaging is not None and config.averaging.type == "schedule_free":
        assert float(state.lr_power_sum) == pytest.approx(ref.lr_power_sum, rel=1e-15)
    else:
        assert state.lr_power_sum is None
    # averaged_params is the reference's eval(); train() puts W back.
    ref.eval()
    err, where = relative_error([x], [ref.params], params)
    assert err <= 1e-9, f"{name}: averaged_params {err:.3e} from eval() at {where}"
    ref.train()
    err, _ = relative_error([got[-1]], [ref.params], params)
    assert err <= 1e-9


@pytest.mark.parametrize("averaging", ["gpa", "schedule_free"])
def test_float64_equals_reference_under_a_schedule(averaging: str) -> None:
    """lr_t from a schedule: d = -lr_t P, Z's decay lr_t alpha_t with alpha_t =
    value lr_t / lr_0 (Meta's CORRECTED decay), Schedule-Free's S_t and mu_x."""
    config = dataclasses.replace(
        BASE, averaging=GPA if averaging == "gpa" else SCHEDULE_FREE, grafting=ADAM,
        weight_decay=ss.WeightDecayConfig(value=0.5, scale_by_lr_ratio=True))
    params, grads = stream(SHAPES, steps=STEPS, seed=5)
    want, ref = _reference(config, params, grads, RATES)
    got, state, x = _jax_run(config, params, grads, learning_rate=_lr_schedule)
    err, where = relative_error(got, want, params)
    assert err <= 1e-9, f"{averaging}: relative error {err:.3e} at {where}"
    if averaging == "schedule_free":
        assert float(state.lr_power_sum) == pytest.approx(sum(r**2 for r in RATES), rel=1e-14)
    ref.eval()
    assert relative_error([x], [ref.params], params)[0] <= 1e-9
    # The schedule matters: the constant rate's run is far away.
    constant = reference_run(config, params, grads)
    assert relative_error(constant, want, params)[0] > 1e-3


def test_refused_block_keeps_w_and_z() -> None:
    """Eq. (3): a block with a non-finite gradient keeps its W and Z (the others move), as
    in the reference; the other blocks' entries of the parameter move."""
    config = dataclasses.replace(CASES["schedule_free_decay"], failure=ss.FailureConfig(
        nonfinite_gradient="skip_block"))
    params, grads = stream(SHAPES, steps=6, seed=6)
    grads[3]["wide"][0, 0] = np.nan  # the block at offsets (0, 0), 4 x 4
    want, ref = _reference(config, params, grads)
    got, state, _ = _jax_run(config, params, grads)
    assert int(state.skipped_blocks) == ref.metrics.skipped_blocks == 1
    assert int(state.withheld_updates) == 0
    err, where = relative_error(got, want, params)
    assert err <= 1e-9, f"relative error {err:.3e} at {where}"
    np.testing.assert_array_equal(got[3]["wide"][:4, :4], got[2]["wide"][:4, :4])
    assert not np.array_equal(got[3]["wide"][4:], got[2]["wide"][4:])
    z = ref.state["wide"].averaged
    assert z is not None
    np.testing.assert_allclose(np.asarray(state.averaged["wide"]), z, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------- the law
LR = 0.0625


@pytest.mark.parametrize("beta", [0.5, 0.9])
def test_gpa_at_full_train_interpolation_is_heavy_ball_sgd(beta: float) -> None:
    """mu_y = 1, mu_x = beta on an SGD diagonal (eq. 16b), no graft, at lr / (1 - beta):
    ``optax.sgd(lr, momentum=beta)`` (m <- g + beta m, w <- w - lr m), float64."""
    config = ss.ShampooConfig(
        learning_rate=LR / (1.0 - beta), diagonal=ss.DiagonalPreconditionerConfig(type="sgd"),
        averaging=ss.IterateAveragingConfig(type="gpa", train_interp=1.0, eval_interp=beta))
    params, grads = stream({"w": (7, 10), "b": (7,), "s": ()}, steps=30, seed=1)
    got, _, x = _jax_run(config, params, grads)
    names = sorted(params)
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        opt = optax.sgd(LR, momentum=beta)
        p = {k: jnp.asarray(params[k], jnp.float64) for k in names}
        s = opt.init(p)
        want = []
        for g in grads:
            u, s = opt.update({k: jnp.asarray(g[k], jnp.float64) for k in names}, s, p)
            p = optax.apply_updates(p, u)
            want.append({k: np.asarray(v) for k, v in p.items()})
    err, where = relative_error(got, want, params)
    assert err <= 1e-13, f"beta {beta}: relative error {err:.3e} to optax at {where}"
    for k in names:  # mu_y = 1: the evaluation sequence is the parameters
        np.testing.assert_array_equal(x[k], got[-1][k])


# ------------------------------------------------------------------- the API
def _f32(tree: dict[str, np.ndarray]) -> dict[str, Any]:
    return {k: jnp.asarray(v, jnp.float32) for k, v in tree.items()}


def test_state_fields_only_with_averaging() -> None:
    """Z starts at W (a copy, elementwise dtype: float32 for bfloat16 parameters); S_0 = 0
    with Schedule-Free only; nothing new without averaging."""
    params, _ = stream(SHAPES, steps=1)
    p = _f32(params)
    p["vector"] = p["vector"].astype(jnp.bfloat16)
    s = shampoo_jax.shampoo(CASES["schedule_free"]).init(p)
    for k in p:
        assert s.averaged[k].dtype == (jnp.float32 if k == "vector" else p[k].dtype)
        np.testing.assert_array_equal(np.asarray(s.averaged[k]),
                                      np.asarray(p[k].astype(jnp.float32)))
        assert s.averaged[k] is not p[k]
    assert s.lr_power_sum.shape == () and s.lr_power_sum.dtype == jnp.float32
    assert float(s.lr_power_sum) == 0.0
    gpa = shampoo_jax.shampoo(CASES["gpa"]).init(p)
    assert gpa.averaged is not None and gpa.lr_power_sum is None
    plain = shampoo_jax.shampoo(BASE).init(p)
    assert plain.averaged is None and plain.lr_power_sum is None
    # Only eq. (14e)'s Adafactor moments (None here: no arrays) come after them.
    assert shampoo_jax.ShampooState._fields[-5:] == (
        "diagonal", "averaged", "lr_power_sum", "gradient_sum", "adafactor")


def test_update_needs_params_and_compiles_once_under_a_schedule() -> None:
    config = CASES["schedule_free_decay"]
    params, grads = stream(SHAPES, steps=4, seed=2)
    opt = shampoo_jax.shampoo(config, learning_rate=optax.linear_schedule(0.05, 0.01, 4))
    p = _f32(params)
    s = opt.init(p)
    with pytest.raises(ValueError, match=r"params = None is invalid with averaging"):
        opt.update(_f32(grads[0]), s)
    traces: list[int] = []

    @jax.jit
    def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
        traces.append(1)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    for g in grads:
        p, s = step(p, s, _f32(g))
    assert len(traces) == 1 and int(s.count) == 4
    rates = [0.05 - 0.01 * c for c in range(4)]
    assert float(s.lr_power_sum) == pytest.approx(sum(r * r for r in rates), rel=1e-6)


def test_averaged_params_is_pure_and_reads_a_chain() -> None:
    """averaged_params changes nothing, finds the Shampoo state inside a chain's state, uses
    the config the state carries, refuses another one naming the field, and returns the
    parameters themselves without averaging."""
    params, grads = stream(SHAPES, steps=3, seed=3)
    config = CASES["gpa"]
    opt = optax.chain(optax.clip_by_global_norm(10.0), shampoo_jax.shampoo(config))
    p = _f32(params)
    s = opt.init(p)
    for g in grads:
        u, s = opt.update(_f32(g), s, p)
        p = optax.apply_updates(p, u)
    before = [np.asarray(x) for x in jax.tree.leaves((s, p))]
    x = shampoo_jax.averaged_params(s, p)
    assert x.keys() == p.keys()
    for a, b in zip(jax.tree.leaves((s, p)), before, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    z = s[1].averaged
    for k in p:
        c = 1.0 - 1.0 / 0.8
        np.testing.assert_allclose(np.asarray(x[k]),
                                   np.asarray(p[k] + c * (z[k] - p[k])), rtol=1e-6)
        assert x[k].dtype == p[k].dtype and x[k].shape == p[k].shape
    assert shampoo_jax.averaged_params(s, p, config)["wide"].shape == (6, 9)
    other = dataclasses.replace(config, averaging=dataclasses.replace(GPA, train_interp=0.5))
    with pytest.raises(ValueError, match=r"averaging.train_interp"):
        shampoo_jax.averaged_params(s, p, other)
    with pytest.raises(ValueError, match="exactly one"):
        shampoo_jax.averaged_params((s[1], s[1]), p)
    plain = shampoo_jax.shampoo(BASE).init(p)
    assert shampoo_jax.averaged_params(plain, p) is p


def test_schedule_free_from_a_zero_learning_rate() -> None:
    """A warmup from lr 0: S_1 = 0, so mu_x is taken as 1 (the ratio 0 / 0 as 0, Defazio
    et al.'s convention): a zero step, nothing withheld, finite from then on."""
    config = CASES["schedule_free_decay"]
    params, grads = stream(SHAPES, steps=4, seed=2)
    opt = shampoo_jax.shampoo(config, learning_rate=optax.linear_schedule(0.0, 0.05, 3))
    p = _f32(params)
    s = opt.init(p)
    step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
        *opt.update(g, s, p)))
    out = []
    for g in grads:
        p, s = step(p, s, _f32(g))
        out.append(p)
    for k in params:
        np.testing.assert_array_equal(np.asarray(out[0][k]), np.asarray(_f32(params)[k]))
        assert np.all(np.isfinite(np.asarray(out[-1][k])))
        assert not np.array_equal(np.asarray(out[-1][k]), np.asarray(out[0][k]))
    assert int(s.withheld_updates) == 0
