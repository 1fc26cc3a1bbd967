"""The ``optax-shampoo`` backend (shampoo_conformance.thirdparty.optax_shampoo) against
optax-shampoo 0.0.6 itself and against precondition's ``distributed_shampoo``.

Needs optax-shampoo (and precondition, whose helpers the adapter shares with the
``google`` backend); without them every test skips.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

ds = pytest.importorskip("optax_shampoo.distributed_shampoo")
pds = pytest.importorskip("precondition.distributed_shampoo")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from shampoo_conformance import get_backend  # noqa: E402
from shampoo_conformance.suite import user_runs  # noqa: E402
from shampoo_conformance.suite.cases import make_problem  # noqa: E402
from shampoo_conformance.thirdparty import optax_shampoo as O  # noqa: E402
from shampoo_spec import Inexpressible, ShampooConfig  # noqa: E402

BASE: dict[str, Any] = {"learning_rate": 0.1, "block_size": 4, "graft_type": "ADAGRAD",
                        "start_preconditioning_step": 0, "relative_matrix_epsilon": False,
                        "matrix_epsilon": 2.0**-10}
SHAPES = {"w": (5, 6), "b": (4,), "t": (2, 3, 4)}


def _steps(module: Any, kwargs: dict[str, Any], steps: int = 6,
           shapes: dict[str, tuple[int, ...]] = SHAPES) -> dict[str, np.ndarray]:
    """``module.distributed_shampoo(**kwargs)`` stepped in float32 (64-bit JAX off)."""
    params, grads = make_problem(shapes, steps, 0)
    kw = dict(kwargs)
    kw["graft_type"] = module.GraftingType[kw.get("graft_type", "SGD")]
    if "precondtioner_type" in kw:
        kw["precondtioner_type"] = module.PreconditionerType[kw["precondtioner_type"]]
    with jax.enable_x64(False):
        tx = module.distributed_shampoo(**kw)
        p = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
        s = tx.init(p)
        for g in grads:
            u, s = tx.update({k: jnp.asarray(v, jnp.float32) for k, v in g.items()}, s, p)
            p = optax.apply_updates(p, u)
    return {k: np.asarray(v) for k, v in p.items()}


def test_unshimmed_library_fails_on_this_jax() -> None:
    """As shipped it cannot run on JAX 0.10.2: init needs jax.tree_map; with that aliased
    alone, every coupled-Newton root fails on its bool loop carry (DEVIATIONS)."""
    params = {"w": jnp.ones((3, 4))}
    grads = {"w": jnp.arange(12.0).reshape(3, 4)}
    tx = ds.distributed_shampoo(0.1, 4, start_preconditioning_step=0)
    with pytest.raises(AttributeError, match="tree_map"):
        tx.init(params)
    saved = ds.jax
    ds.jax = O._JAX  # the first shim only
    try:
        state = tx.init(params)
        with pytest.raises(TypeError, match="carry input and carry output must have equal"):
            tx.update(grads, state, params)
    finally:
        ds.jax = saved
    with O.compat():
        updates, _ = tx.update(grads, tx.init(params), params)
    assert np.isfinite(np.asarray(updates["w"])).all()
    assert ds.jax is jax and ds.lax is jax.lax  # compat() restores the module
    assert len(O.SHIMS) == 2


def test_arguments_it_lacks_are_refused_by_name() -> None:
    """The diff with precondition: 9 arguments, graft NONE and side OUTPUT it lacks."""
    assert sorted(O.MISSING) == sorted([
        "eigh", "compression_rank", "frequent_directions", "average_grad",
        "reset_preconditioner", "reuse_preconditioner", "generate_fd_metrics",
        "decay_preconditioning_compute_steps", "end_preconditioning_compute_steps"])
    for extra in ({"eigh": True}, {"compression_rank": 2}, {"graft_type": "NONE"},
                  {"precondtioner_type": "OUTPUT"}):
        with pytest.raises(Inexpressible, match=next(iter(extra))):
            O.from_optax_shampoo({**BASE, **extra})
    with pytest.raises(ValueError, match="no argument"):
        O.from_optax_shampoo({**BASE, "not_an_argument": 1})
    eigh = dataclasses.replace(O.base_config(), root_inverse=ShampooConfig().root_inverse)
    assert "coupled Newton only" in str(O.expressible(eigh))


def test_its_own_rules_are_imported() -> None:
    """No retries, lambda_max floor 1e-6, graft norms with 1e-16 (module docstring)."""
    config = O.from_optax_shampoo(BASE)
    assert config.root_inverse.retries == 0  # type: ignore[union-attr]
    assert config.epsilon.relative_floor == 1e-6
    assert (config.grafting.norm_epsilon, config.grafting.normalize_epsilon) == (1e-16, 1e-16)
    assert O.expressible(O.base_config()) is None
    assert O.from_optax_shampoo(O.to_optax_shampoo(config), x64=True) == config


@pytest.mark.parametrize("extra", [{}, {"graft_type": "RMSPROP", "beta2": 0.9},
                                   {"precondtioner_type": "INPUT", "beta1": 0.9,
                                    "merge_small_dims_block_size": 1},
                                   {"preconditioning_compute_steps": 2, "block_size": 3}])
def test_same_numbers_as_precondition_where_the_rules_agree(extra: dict[str, Any]) -> None:
    """Where the four rules do not act (absolute epsilon, converging Newton, nonzero
    norms), optax-shampoo and precondition compute the same float32 numbers (INPUT: no
    vector, on which precondition crashes, the google backend's input_side_vector_crash;
    optax-shampoo preconditions a vector fully there, as the reference does)."""
    kwargs = {**BASE, **extra}
    shapes = ({k: v for k, v in SHAPES.items() if len(v) > 1} if "precondtioner_type" in extra
              else SHAPES)
    with O.compat():
        ours = _steps(ds, kwargs, shapes=shapes)
    google = _steps(pds, kwargs, shapes=shapes)
    for name in ours:
        np.testing.assert_allclose(ours[name], google[name], rtol=0, atol=1e-6)


def test_decoupled_weight_decay_is_scaled_by_lr_twice() -> None:
    """decoupled_weight_decay decays by lr * (lr * wd): precondition's with lr * wd
    (DEVIATIONS["decoupled_weight_decay_lr_squared"])."""
    kwargs = {**BASE, "weight_decay": 0.05, "decoupled_weight_decay": True}
    with O.compat():
        ours = _steps(ds, kwargs)
    same = _steps(pds, {**kwargs, "weight_decay": 0.05 * 0.1})
    plain = _steps(pds, kwargs)
    np.testing.assert_allclose(ours["w"], same["w"], rtol=0, atol=1e-6)
    assert np.abs(ours["w"] - plain["w"]).max() > 1e-3
    assert O.from_optax_shampoo(kwargs).weight_decay.value == pytest.approx(0.005)


def test_all_one_by_one_statistics_crash() -> None:
    """Every statistic 1 x 1: IndexError (DEVIATIONS), and known_crash predicts it."""
    kwargs = O.to_optax_shampoo(O.base_config())
    params = {"w": np.ones(1)}
    assert O.known_crash(kwargs, params) is not None
    assert O.known_crash(kwargs, {"w": np.ones((2, 1))}) is None
    with pytest.raises(IndexError):
        O.run(O.base_config(), params, [{"w": np.ones(1)}])


def test_user_run_hooks() -> None:
    """What the suite's side-effect and defaults properties find: float32 runs leave
    gradients, RNG and unknown arguments alone; float64 crashes (DEVIATIONS)."""
    backend = get_backend("optax-shampoo")
    assert O.defaults_config() == O.from_optax_shampoo(O.USER_KWARGS, x64=False)
    assert O.defaults_config().factor_dtype == "float32"
    for check in (user_runs.check_grads_unchanged, user_runs.check_unknown_argument_refused,
                  user_runs.check_global_rng_unchanged):
        check(backend)
    with pytest.raises(AssertionError, match="crashed on float64"):
        user_runs.check_float64_stays_float64(backend)
    with pytest.raises(AssertionError, match="crashed at its defaults"):
        user_runs.check_defaults(backend, np.float64)
    names = {d.name for d in O.DEVIATIONS}
    assert {"float64_update_crash", "removed_jax_apis", "newton_bool_carry"} <= names


def test_defaults_float32_agree_or_are_unbounded() -> None:
    """At its defaults (relative epsilon 1e-6 on rank-deficient statistics) the section-5
    bound promises nothing on the suite's problems, so the property skips; the library
    is still finite there (user_runs.check_defaults says how far, 4.4e-5)."""
    try:
        user_runs.check_defaults(get_backend("optax-shampoo"), np.float32)
    except pytest.skip.Exception as skip:
        assert "promises nothing" in str(skip)
