"""Eq. (14e), the Adafactor graft, against optax's ``adafactor`` (an independent
implementation) and closed forms.

- Before preconditioning starts the step is the graft direction itself, so with
  learning rate 1 and no momentum the reference's step equals optax's
  ``adafactor(learning_rate=None, ...)`` update (descent sign flipped), for
  factored and unfactored shapes, ties of the two largest dims, ranks 1-3, with
  and without the clip and the parameter scale. optax computes its decay
  ``1 - t^(-c)`` with XLA's float32 ``pow``, which for c = 0.8 equals the
  correctly rounded one (eq. 14e) at t = 1, 2, 3 (tested first, so a mismatch
  there names the schedule, not the moments).
- One step (beta_1 = 0) of an unfactored vector is ``g / sqrt(g^2 + eps)``.
- The factored estimate ``R C / mean(R)`` of a rank-one ``G^2`` is exact.

Tolerance: 1e3 u relative (u = 2^-53): means, one division and square roots
per entry, over at most 3 steps.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import shampoo_spec as ss
from shampoo_reference import ReferenceShampoo

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy

TOL = 1e3 * 2.0**-53
C = 0.8


def _config(**graft: object) -> ss.ShampooConfig:
    """The Adafactor graft alone: preconditioning never starts, no momentum, lr 1."""
    kwargs: dict[str, object] = {"epsilon": 1e-30, "decay_exponent": C, "factor_min_dim": 4,
                                 "clip_rms": None, "parameter_scale_floor": None, **graft}
    return ss.ShampooConfig(
        learning_rate=1.0,
        grafting=ss.GraftingConfig(type="adafactor", epsilon_placement="inside_sqrt",
                                   norm_scope="parameter", **kwargs),  # type: ignore[arg-type]
        momentum=ss.MomentumConfig(momentum=0.0),
        schedule=ss.ScheduleConfig(start_preconditioning_step=1000),
        factor_dtype="float64",
    )


def test_decay_is_optax_float32_schedule_where_xla_rounds_correctly() -> None:
    with jax.enable_x64(True):
        theirs = [float(1.0 - jnp.array(t, jnp.float32) ** (-C)) for t in (1, 2, 3)]
    graft = _config().grafting
    assert [graft.adafactor_decay(t) for t in (1, 2, 3)] == theirs
    assert graft.adafactor_decay(1) == 0.0


@pytest.mark.parametrize("shape, dims", [
    ((5,), None), ((6, 7), (1, 0)), ((7, 6), (0, 1)), ((6, 6), (1, 0)),
    ((3, 8, 5), (1, 2)), ((2, 9), None), ((4, 1, 5), (2, 0)),
])
def test_factored_dims_are_optax(shape: tuple[int, ...], dims: tuple[int, int] | None) -> None:
    from optax._src import factorized  # the rule itself, as optax states it
    assert _config().grafting.factored_dims(shape) == dims
    theirs = factorized._factored_dims(shape, True, 4)
    assert (None if theirs is None else (theirs[1], theirs[0])) == dims


@pytest.mark.parametrize("shape", [(5,), (6, 7), (7, 6), (6, 6), (3, 8, 5), (2, 9), (4, 1, 5)])
@pytest.mark.parametrize("clip, floor", [(None, None), (1.0, 1e-3), (0.05, None)])
def test_graft_step_is_optax_adafactor(shape: tuple[int, ...], clip: float | None,
                                       floor: float | None) -> None:
    rng = np.random.default_rng(len(shape) * 7 + shape[0])
    w0 = rng.standard_normal(shape) * 0.01
    grads = [rng.standard_normal(shape) * s for s in (1.0, 0.3, 2.0)]
    config = _config(clip_rms=clip, parameter_scale_floor=floor)
    opt = ReferenceShampoo(config, {"w": w0.copy()})
    tx = optax.adafactor(learning_rate=None, min_dim_size_to_factor=4, decay_rate=C,
                         multiply_by_parameter_scale=floor is not None, eps=1e-30,
                         clipping_threshold=clip)
    with jax.enable_x64(True):
        w = jnp.asarray(w0)
        state = tx.init(w)
        for g in grads:
            before = opt.params["w"].copy()
            ours = before - opt.step({"w": g})["w"]
            updates, state = tx.update(jnp.asarray(g), state, w)
            theirs = -np.asarray(updates)
            np.testing.assert_allclose(ours, theirs, rtol=TOL, atol=0.0)
            w = optax.apply_updates(w, updates)


def test_first_step_of_a_vector_is_g_over_rms() -> None:
    g = np.array([3.0, -4.0, 0.0, 1e-3])
    eps = 1e-6
    opt = ReferenceShampoo(_config(epsilon=eps), {"w": np.zeros(4)})
    step = -opt.step({"w": g})["w"]
    np.testing.assert_allclose(step, g / np.sqrt(g * g + eps), rtol=TOL, atol=0.0)


def test_factored_estimate_of_a_rank_one_square_is_exact() -> None:
    """G = a b^T: G^2 = (a^2)(b^2)^T, and with eps 0-like the factored V^ = R C / mean(R)
    equals G^2, so one step is sign(G) (each entry g / |g|)."""
    a = np.array([1.0, 2.0, 0.5, 3.0])
    b = np.array([0.25, 1.0, 4.0, 2.0, 1.5])
    g = np.outer(a, b)
    opt = ReferenceShampoo(_config(epsilon=2.0**-126), {"w": np.zeros(g.shape)})
    step = -opt.step({"w": g})["w"]
    np.testing.assert_allclose(step, np.sign(g), rtol=TOL, atol=0.0)


def test_a_refused_block_leaves_the_moments() -> None:
    """Eq. (14e): the moments span the parameter, so a step with a refused block keeps
    them; the next admitted step decays from them."""
    cfg = dataclasses.replace(_config(), failure=ss.FailureConfig(nonfinite_gradient="skip_block"))
    rng = np.random.default_rng(1)
    g1 = rng.standard_normal((6, 7))
    bad = g1.copy()
    bad[0, 0] = np.nan
    skipped = ReferenceShampoo(cfg, {"w": np.zeros((6, 7))})
    plain = ReferenceShampoo(cfg, {"w": np.zeros((6, 7))})
    skipped.step({"w": g1})
    skipped.step({"w": bad})
    plain.step({"w": g1})
    plain.step({"w": np.zeros((6, 7))})  # a zero step changes the moments...
    a = skipped.state["w"].graft
    b = plain.state["w"].graft
    assert not np.allclose(a.row, b.row)  # ...so the skipped step did not take one
    one = ReferenceShampoo(cfg, {"w": np.zeros((6, 7))})
    one.step({"w": g1})
    np.testing.assert_array_equal(a.row, one.state["w"].graft.row)
    np.testing.assert_array_equal(a.col, one.state["w"].graft.col)
