"""The ``tearfree`` backend (shampoo_conformance.thirdparty.tearfree) against tearfree's own API.

Needs Google's library (``precondition-opt``, which ships ``precondition.tearfree``;
the anchors-library-google environment); without it every test here but the
first skips, and the first checks the message a user then gets.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shampoo_spec as ss
from shampoo_conformance import BackendUnavailable, get_backend
from shampoo_conformance.suite.divergence import bound_and_reference, first_divergence
from shampoo_conformance.thirdparty.registry import THIRD_PARTY
from shampoo_reference import run as reference_run
from shampoo_spec import Inexpressible, from_tearfree


def test_unavailable_library_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Google's library the backend is unavailable, with the command that installs it."""
    monkeypatch.setitem(sys.modules, "precondition", None)  # import precondition fails
    monkeypatch.setitem(sys.modules, "precondition.tearfree", None)
    monkeypatch.delitem(sys.modules, "shampoo_conformance.thirdparty.tearfree", raising=False)
    with pytest.raises(BackendUnavailable) as err:
        get_backend("tearfree")
    assert "backend 'tearfree' is not installed" in str(err.value)
    assert THIRD_PARTY["tearfree"].install in str(err.value)


# Everything below runs tearfree.
try:
    from precondition.tearfree import optimizer as tf_optimizer
except ImportError:
    tf_optimizer = None
needs_tearfree = pytest.mark.skipif(
    tf_optimizer is None, reason="needs Google's library: " + THIRD_PARTY["tearfree"].install)
if tf_optimizer is not None:
    from shampoo_conformance.thirdparty import tearfree as T

Arrays = dict[str, np.ndarray]

#: Tearfree options every test below starts from: the SGD graft from the first step,
#: biases preconditioned, no momentum, blocks of 8.
BASE: dict[str, Any] = {
    "grafting_options": {"grafting_type": "SGD", "skip_preconditioning_rank1": False},
    "second_order_options": {"merge_dims": 8, "shampoo_options": {"block_size": 8}},
    "momentum_options": {"momentum_decay": 0.0},
}


def _problem(seed: int = 0, steps: int = 4) -> tuple[Arrays, list[Arrays]]:
    rng = np.random.default_rng(seed)
    shapes = {"w": (5, 3), "b": (3,)}
    params = {k: rng.standard_normal(s) for k, s in shapes.items()}
    grads = [{k: rng.standard_normal(s) for k, s in shapes.items()} for _ in range(steps)]
    return params, grads


def _by_hand(lr: float, options: dict[str, Any], params: Arrays, grads: list[Arrays],
             x64: bool) -> list[Arrays]:
    """Tearfree as its docstring drives it: init, then update and apply_updates."""
    dtype = np.float64 if x64 else np.float32
    with jax.enable_x64(x64):
        tx = tf_optimizer.tearfree(lr, T.tearfree_options(options))
        p = {k: jnp.asarray(v.astype(dtype)) for k, v in params.items()}
        state = tx.init(p)
        step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
            *tx.update(g, s, p)))
        out = []
        for g in grads:
            p, state = step(p, state, {k: jnp.asarray(v.astype(dtype)) for k, v in g.items()})
            out.append({k: np.array(v) for k, v in p.items()})
    return out


def _with(options: dict[str, Any], **sections: dict[str, Any]) -> dict[str, Any]:
    out = {k: dict(v) for k, v in options.items()}
    for section, values in sections.items():
        out[section] = {**out.get(section, {}), **values}
    return out


# ------------------------------------------------------------------ expressible
@needs_tearfree
def test_expressible_configs_and_refusals_with_the_reason() -> None:
    backend = get_backend("tearfree")
    assert backend.dtypes == (np.float64, np.float32)  # type: ignore[attr-defined]
    config = from_tearfree(BASE, 0.1)
    for dtype in (np.float64, np.float32):
        assert backend.expressible(config, dtype) is None  # type: ignore[attr-defined]
    # Our defaults: a ridge epsilon and Meta's merging, which tearfree has no option for.
    reason = backend.expressible(ss.ShampooConfig())  # type: ignore[attr-defined]
    assert reason is not None and "epsilon.placement" in reason
    assert "blocking.merge_direction" in reason
    with pytest.raises(Inexpressible, match="epsilon.placement"):
        backend.run(ss.ShampooConfig(), {"w": np.zeros(3)}, [{"w": np.ones(3)}])


@needs_tearfree
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_drawn_configs_are_expressible_in_both_dtypes(data: st.DataObject) -> None:
    config = data.draw(T.configs())
    for dtype in T.dtypes:
        assert T.expressible(config, dtype) is None
    exported = ss.to_tearfree(config)
    assert from_tearfree(exported["options"], exported["learning_rate"], x64=True) == config


# ---------------------------------------------------------------------- running
@needs_tearfree
@pytest.mark.parametrize("case", [
    {},
    {"grafting_options": {"grafting_type": "RMSPROP", "second_moment_decay": 0.9,
                          "epsilon": 1e-6}},
    {"momentum_options": {"momentum_decay": 0.9, "ema": True, "weight_decay": 0.01}},
    {"second_order_options": {"shampoo_options": {"block_size": 8,
                                                  "update_preconditioners_freq": 2}}},
], ids=["sgd", "rmsprop", "ema_weight_decay", "root_period"])
def test_run_is_tearfrees_own_run(case: dict[str, Any]) -> None:
    """``run`` is tearfree's update (init, update, apply_updates), bitwise, in both dtypes."""
    options = _with(BASE, **case)
    params, grads = _problem()
    for x64, dtype in ((True, np.float64), (False, np.float32)):
        before = jax.config.jax_enable_x64
        ours = T.run(from_tearfree(options, 0.1, x64=x64), params, grads, dtype)
        assert jax.config.jax_enable_x64 == before
        theirs = _by_hand(0.1, options, params, grads, x64=x64)
        for a, b in zip(ours, theirs, strict=True):
            for k in params:
                assert a[k].dtype == dtype
                np.testing.assert_array_equal(a[k], b[k])


@needs_tearfree
def test_run_float64_matches_the_reference() -> None:
    """The import is exact: tearfree's float64 run within the reference's rounding bound."""
    config = from_tearfree(_with(BASE, momentum_options={"momentum_decay": 0.5}), 0.1)
    params, grads = _problem(3, steps=6)
    bound, ref = bound_and_reference(config, params, grads, np.float64)
    assert first_divergence(T.run(config, params, grads), ref, params, bound) is None


@needs_tearfree
def test_stepper_is_run_closed_loop() -> None:
    """The report's closed-loop stepper (the rate a traced argument) steps as ``run``."""
    config = from_tearfree(_with(BASE, momentum_options={"momentum_decay": 0.9}), 0.1)
    params, grads = _problem(2, steps=3)
    step = get_backend("tearfree").stepper("shampoo", params, lr=0.1, config=config)  # type: ignore[attr-defined]
    for g, w in zip(grads, T.run(config, params, grads), strict=True):
        got = step.step(g)
        for k in params:
            np.testing.assert_allclose(got[k], w[k], rtol=1e-12, atol=1e-14)
    with pytest.raises(Inexpressible, match="epsilon.placement"):
        T.stepper("shampoo", params, lr=0.1, config=ss.ShampooConfig())


def _eigh_operand_ranks(jaxpr: Any) -> list[int]:
    """The rank of every eigh operand in ``jaxpr`` and its sub-jaxprs (loops, conds)."""
    ranks = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "eigh":
            ranks.append(eqn.invars[0].aval.ndim)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            ranks += _eigh_operand_ranks(sub)
    return ranks


@needs_tearfree
def test_tearfree_is_traced_with_one_matrix_per_eigh() -> None:
    """DEVIATIONS batched_cpu_eigh_deadlock: ``run``'s step and the stepper's update
    trace tearfree's roots with 2-d eigh operands only (no batched CPU eigh), even when
    traced outside ``run`` / ``stepper``; a parameter in 2 blocks of 4 gives a stack."""
    options = _with(BASE, second_order_options={
        "merge_dims": 8, "shampoo_options": {"block_size": 4}})
    config = from_tearfree(options, 0.1)
    params = {"v": np.ones(8), "w": np.ones((8, 4))}
    grads = {k: np.full_like(v, 0.5) for k, v in params.items()}
    with jax.enable_x64(True):
        p = {k: jnp.asarray(v) for k, v in params.items()}
        g = {k: jnp.asarray(v) for k, v in grads.items()}
        init, step = T._jitted_step(config, np.dtype(np.float64))
        traced = jax.make_jaxpr(step)(p, init(p), g).jaxpr
        stepper = T.stepper("shampoo", params, lr=0.1, config=config)
        lr = jnp.asarray(0.1)
        traced_update = jax.make_jaxpr(stepper._update)(p, stepper._state, g, lr, lr).jaxpr
    for jaxpr in (traced, traced_update):
        ranks = _eigh_operand_ranks(jaxpr)
        assert ranks and set(ranks) == {2}, ranks
    # Unpatched, tearfree decomposes the (2, 4, 4) stack in one batched call.
    with jax.enable_x64(True):
        tx = tf_optimizer.tearfree(0.1, T.tearfree_options(ss.to_tearfree(config)["options"]))
        raw = jax.make_jaxpr(lambda p, s, g: tx.update(g, s, p))(p, tx.init(p), g).jaxpr
    assert 3 in _eigh_operand_ranks(raw)


# ------------------------------------------------------------------ deviations
@needs_tearfree
def test_rank_cutoff_over_a_parameters_blocks_is_eq_10g() -> None:
    """Tearfree's cutoff over a parameter's blocks is eq. (10g): an 8-vector in two blocks
    of 4 whose second block's gradients are 1e-4 of the first's. Each block's factor has
    one eigenvalue (|g_b|^2 after one step); 1e-6 times the max over both blocks drops
    the second (1e-8 of the first), so the second block stays where it was in tearfree
    and in the reference alike; with eq. (10)'s per-factor cutoff it would move by
    lr g_2 / |g_2|. In one block of 8 the two scopes agree."""
    rng = np.random.default_rng(5)
    params = {"v": rng.standard_normal(8)}
    g = rng.standard_normal(8)
    g[4:] *= 1e-4
    grads = [{"v": g}]
    for block in (4, 8):
        options = _with(BASE, second_order_options={
            "merge_dims": 8, "shampoo_options": {"block_size": block}})
        config = from_tearfree(options, 0.1)
        assert config.epsilon.rank_cutoff_scope == "parameter"
        ours = reference_run(config, params, grads)
        theirs = T.run(config, params, grads)
        step = float(np.max(np.abs(ours[0]["v"] - params["v"])))
        np.testing.assert_allclose(theirs[0]["v"], ours[0]["v"], rtol=0, atol=1e-14 * step)
        per_factor = dataclasses.replace(
            config, epsilon=dataclasses.replace(config.epsilon, rank_cutoff_scope="factor"))
        control = reference_run(per_factor, params, grads)
        if block == 4:
            np.testing.assert_array_equal(theirs[0]["v"][4:], params["v"][4:])
            assert float(np.max(np.abs(control[0]["v"][4:] - params["v"][4:]))) > 0.1 * step
        else:
            np.testing.assert_array_equal(control[0]["v"], ours[0]["v"])


@needs_tearfree
def test_sketchy_does_not_trace_in_float64_and_runs_in_float32() -> None:
    """DEVIATIONS sketchy_float64_trace_failure: tearfree's Sketchy as shipped raises while
    tracing under 64-bit JAX; the same options run in float32, within float32 rounding of
    the reference (eq. 10e)."""
    options = _with(BASE, second_order_options={
        "merge_dims": 8, "second_order_type": "SKETCHY", "sketchy_options": {"rank": 2}})
    params, grads = _problem(4, steps=3)
    with pytest.raises(TypeError):
        T.run(from_tearfree(options, 0.1, x64=True), params, grads, np.float64)
    config = from_tearfree(options, 0.1, x64=False)
    ours = T.run(config, params, grads, np.float32)
    ref = reference_run(config, params, grads)
    for a, b in zip(ours, ref, strict=True):
        for k in params:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-5)


@needs_tearfree
def test_known_departure_predicts_the_all_ones_shape_without_graft() -> None:
    none = from_tearfree(_with(BASE, grafting_options={"grafting_type": "NONE"}), 0.1)
    assert T.known_departure(none, {"w": np.zeros((1, 1))}) is not None
    assert T.known_departure(none, {"w": np.zeros((1, 2))}) is None
    assert T.known_departure(none, {"w": np.zeros(())}) is None
    assert T.known_departure(from_tearfree(BASE, 0.1), {"w": np.zeros((1, 1))}) is None
    # What it predicts: outside a property the run goes ahead and shows it.
    params, grads = {"w": np.full((1, 1), 0.5)}, [{"w": np.full((1, 1), 3.0)}]
    theirs = T.run(none, params, grads)[0]["w"]
    ours = reference_run(none, params, grads)[0]["w"]
    np.testing.assert_allclose(theirs, 0.5 - 0.1 * 3.0)  # direction g
    # Direction g L^(-1/2), L = (1 - 0.999) g^2 (tearfree's default statistics decay).
    np.testing.assert_allclose(ours, 0.5 - 0.1 * 3.0 / np.sqrt(0.001 * 9.0), rtol=1e-14)
