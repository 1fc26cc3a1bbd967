"""The ``google`` backend (shampoo_conformance.thirdparty.google) against Google's own API.

Needs Google's library (``precondition-opt``; the anchors-library-google
environment); without it every test here but the first skips, and the first
checks the message a user then gets.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shampoo_spec as ss
from shampoo_conformance import BackendUnavailable, get_backend
from shampoo_conformance.suite.divergence import bound_and_reference
from shampoo_conformance.thirdparty.registry import THIRD_PARTY
from shampoo_spec import Inexpressible, from_google

#: Google kwargs every test below starts from (preconditioning from step 1, roots every step).
BASE: dict[str, Any] = {
    "learning_rate": 0.1, "block_size": 4, "graft_type": "ADAGRAD",
    "start_preconditioning_step": 0, "relative_matrix_epsilon": False,
}


def test_unavailable_library_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Google's library the backend is unavailable, with the command that installs it."""
    monkeypatch.setitem(sys.modules, "precondition", None)  # import precondition fails
    monkeypatch.setitem(sys.modules, "precondition.distributed_shampoo", None)
    monkeypatch.delitem(sys.modules, "shampoo_conformance.thirdparty.google", raising=False)
    with pytest.raises(BackendUnavailable) as err:
        get_backend("google")
    assert "backend 'google' is not installed" in str(err.value)
    assert THIRD_PARTY["google"].install in str(err.value)
    assert "pip install" in str(err.value)


# Everything below runs Google's library.
try:
    from precondition import distributed_shampoo as ds
except ImportError:
    ds = None
needs_google = pytest.mark.skipif(
    ds is None, reason="needs Google's library: " + THIRD_PARTY["google"].install)
if ds is not None:
    from shampoo_conformance.thirdparty import google as G

Arrays = dict[str, np.ndarray]


def _problem(seed: int = 0, steps: int = 4) -> tuple[Arrays, list[Arrays]]:
    rng = np.random.default_rng(seed)
    shapes = {"w": (5, 3), "b": (3,)}
    params = {k: rng.standard_normal(s) for k, s in shapes.items()}
    grads = [{k: rng.standard_normal(s) for k, s in shapes.items()} for _ in range(steps)]
    return params, grads


def _by_hand(kwargs: dict[str, Any], params: dict[str, np.ndarray],
             grads: list[dict[str, np.ndarray]], x64: bool) -> list[dict[str, np.ndarray]]:
    """Google's optimizer as its README drives it: init, then update and apply_updates."""
    dtype = np.float64 if x64 else np.float32
    with jax.enable_x64(x64), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Explicitly requested dtype float64", UserWarning)
        tx = ds.distributed_shampoo(**G.google_kwargs(kwargs))
        p = {k: jnp.asarray(v.astype(dtype)) for k, v in params.items()}
        state = G.google_init(tx, p) if x64 else tx.init(p)
        step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
            *tx.update(g, s, p)))
        out = []
        for g in grads:
            p, state = step(p, state, {k: jnp.asarray(v.astype(dtype)) for k, v in g.items()})
            out.append({k: np.array(v) for k, v in p.items()})
    return out


# ------------------------------------------------------------------ expressible
@needs_google
def test_expressible_configs_and_refusals_with_the_reason() -> None:
    backend = get_backend("google")
    assert backend.dtypes == (np.float64, np.float32)  # type: ignore[attr-defined]
    google = from_google(BASE, x64=True)
    for dtype in (np.float64, np.float32):
        assert backend.expressible(google, dtype) is None  # type: ignore[attr-defined]
    # Our defaults use Meta-like rules Google has no argument for: every field named.
    reason = backend.expressible(ss.ShampooConfig())  # type: ignore[attr-defined]
    assert reason is not None and "statistics.initial_value" in reason
    assert "schedule.period_anchor" in reason
    with pytest.raises(Inexpressible, match="statistics.initial_value"):
        backend.run(ss.ShampooConfig(), {"w": np.zeros(3)}, [{"w": np.ones(3)}])
    # What one process cannot run: Google's pjit path.
    sharded = from_google({**BASE, "shard_optimizer_states": True, "num_devices_for_pjit": 1},
                          x64=True)
    reason = backend.expressible(sharded)  # type: ignore[attr-defined]
    assert reason is not None and "shard_optimizer_states" in reason
    with pytest.raises(Inexpressible, match="pjit"):
        backend.run(sharded, {"w": np.zeros(3)}, [{"w": np.ones(3)}])


@needs_google
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_drawn_configs_are_expressible_in_both_dtypes(data: st.DataObject) -> None:
    config = data.draw(G.configs())
    for dtype in G.dtypes:
        assert G.expressible(config, dtype) is None
    assert from_google(ss.to_google(config), x64=True) == config


# ---------------------------------------------------------------------- running
@needs_google
@pytest.mark.parametrize("case", [
    {},
    {"eigh": True, "graft_type": "RMSPROP", "beta2": 0.9},
    {"relative_matrix_epsilon": True, "nesterov": False, "moving_average_for_momentum": True},
    {"weight_decay": 0.01, "decoupled_weight_decay": True, "preconditioning_compute_steps": 2},
], ids=["adagrad", "eigh_rmsprop", "relative_moving_average", "decoupled_decay"])
def test_run_float64_is_googles_own_run(case: dict[str, Any]) -> None:
    """``run`` float64 is Google's update under x64 with the cast state: bitwise."""
    kwargs = {**BASE, **case}
    params, grads = _problem()
    ours = G.run(from_google(kwargs, x64=True), params, grads, np.float64)
    theirs = _by_hand(kwargs, params, grads, x64=True)
    for a, b in zip(ours, theirs, strict=True):
        for k in params:
            assert a[k].dtype == np.float64
            np.testing.assert_array_equal(a[k], b[k])


@needs_google
def test_run_float32_is_google_without_x64_and_leaves_x64_as_it_was() -> None:
    kwargs = {**BASE, "eigh": False}
    params, grads = _problem(1)
    before = jax.config.jax_enable_x64
    ours = G.run(from_google(kwargs, x64=False), params, grads, np.float32)
    assert jax.config.jax_enable_x64 == before
    theirs = _by_hand(kwargs, params, grads, x64=False)
    wide = G.run(from_google(kwargs, x64=True), params, grads, np.float64)
    for a, b, c in zip(ours, theirs, wide, strict=True):
        for k in params:
            assert a[k].dtype == np.float32
            np.testing.assert_array_equal(a[k], b[k])
            # float32 rounding, not another rule: near the float64 run, yet not equal to it.
            np.testing.assert_allclose(a[k], c[k], rtol=1e-4, atol=1e-5)
    assert any(not np.array_equal(a[k], c[k].astype(np.float32))
               for a, c in zip(ours, wide, strict=True) for k in params)


@needs_google
def test_google_init_casts_to_float64_and_keeps_its_epsilon_unless_told() -> None:
    kwargs = {**BASE, "matrix_epsilon": 0.1}
    with jax.enable_x64(True):
        tx = ds.distributed_shampoo(**G.google_kwargs(kwargs))
        params = {"w": jnp.zeros((3, 3))}
        as_user = G.google_init(tx, params)
        exact = G.google_init(tx, params, matrix_epsilon=0.1)
    stats = as_user.stats["w"]
    assert all(s.dtype == jnp.float64 for s in stats.statistics)
    assert all(s.dtype == jnp.float32 for s in jax.tree.leaves(stats.training_metrics))
    # Google's float32(0.1), widened; the anchors test's exact float64 0.1.
    assert float(stats.statistics[0][0, 0]) == float(np.float32(0.1))
    assert float(exact.stats["w"].statistics[0][0, 0]) == 0.1


def _relative_deviation_from_reference(kwargs: dict[str, Any], exact_epsilon: bool) -> float:
    """Max over steps of ||google - reference||_inf / ||reference||_inf (float64, 2 steps)."""
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal(2)}
    grads = [{"w": rng.standard_normal(2)} for _ in range(2)]
    _, ref = bound_and_reference(from_google(kwargs, x64=True), params, grads, np.float64)
    with jax.enable_x64(True):
        tx = ds.distributed_shampoo(**G.google_kwargs(kwargs))
        p = {"w": jnp.asarray(params["w"])}
        s = G.google_init(tx, p, kwargs["matrix_epsilon"] if exact_epsilon else None)
        worst = 0.0
        for g, want in zip(grads, ref, strict=True):
            u, s = tx.update({"w": jnp.asarray(g["w"])}, s, p)
            p = optax.apply_updates(p, u)
            worst = max(worst, float(np.abs(np.asarray(p["w"]) - want["w"]).max()
                                     / np.abs(want["w"]).max()))
    return worst


@needs_google
def test_float32_initial_statistics_under_x64() -> None:
    """A defect in DEVIATIONS: under x64 Google starts from float32(matrix_epsilon) * I.

    Measured on a (2,) parameter, eigh roots, beta2 0.9, 2 steps: 1.7e-12 relative
    from the reference at matrix_epsilon 1e-4 as shipped; with the exact float64
    epsilon (or one exact in float32, as configs() draws) rounding only.
    """
    kwargs = {**BASE, "graft_type": "SGD", "beta1": 0.0, "beta2": 0.9, "eigh": True,
              "learning_rate": 0.01, "block_size": 2, "merge_small_dims_block_size": 1}
    shipped = _relative_deviation_from_reference({**kwargs, "matrix_epsilon": 1e-4}, False)
    exact = _relative_deviation_from_reference({**kwargs, "matrix_epsilon": 1e-4}, True)
    power_of_2 = _relative_deviation_from_reference({**kwargs, "matrix_epsilon": 2.0**-13},
                                                    False)
    assert shipped > 1e-13, shipped
    assert exact < 1e-14 and power_of_2 < 1e-14, (exact, power_of_2)


def _runs(config: ss.ShampooConfig, params: Arrays) -> bool:
    """Whether Google's update runs one step on ``params`` (finite), as a user calls it."""
    out = G.run(config, params, [{k: np.ones_like(v) for k, v in params.items()}])
    return all(np.isfinite(v).all() for v in out[0].values())


@needs_google
def test_all_one_by_one_statistics_crash_google() -> None:
    """A crash defect in DEVIATIONS: when every statistic of the step is 1 x 1 Google's
    update fails (both root methods); one larger statistic beside it and it runs, as
    known_crash predicts. Fails once Google fixes it."""
    lone = {"w": np.zeros(1)}
    for eigh, error in ((False, UnboundLocalError), (True, IndexError)):
        config = from_google({**BASE, "eigh": eigh}, x64=True)
        kwargs = ss.to_google(config)
        assert G.known_crash(kwargs, lone) is not None
        with pytest.raises(error):
            G.run(config, lone, [{"w": np.ones(1)}])
        beside = {**lone, "v": np.zeros((3, 4))}
        assert G.known_crash(kwargs, beside) is None and _runs(config, beside)
    # Also a (2, 1) with only its last dim preconditioned and no shape interpretation.
    output = from_google({**BASE, "precondtioner_type": "OUTPUT",
                          "best_effort_shape_interpretation": False}, x64=True)
    assert G.known_crash(ss.to_google(output), {"w": np.zeros((2, 1))}) is not None
    with pytest.raises(UnboundLocalError):
        G.run(output, {"w": np.zeros((2, 1))}, [{"w": np.ones((2, 1))}])
    # Not preconditioned (rank below skip_preconditioning_rank_lt): Google runs it.
    skip = from_google({**BASE, "skip_preconditioning_rank_lt": 2}, x64=True)
    assert G.known_crash(ss.to_google(skip), lone) is None and _runs(skip, lone)


@needs_google
def test_compression_rank_with_only_small_statistics_crashes_google() -> None:
    """A crash defect in DEVIATIONS: with compression_rank 1 a step whose statistics are
    all at most 3 x 3 fails in Google's _low_rank_root; a 4 x 4 beside them and it runs,
    as known_crash predicts. Fails once Google fixes it."""
    config = from_google({**BASE, "compression_rank": 1}, x64=True)
    kwargs = ss.to_google(config)
    small = {"w": np.zeros(3)}
    assert G.known_crash(kwargs, small) is not None
    with pytest.raises(AssertionError):
        G.run(config, small, [{"w": np.ones(3)}])
    beside = {**small, "v": np.zeros((3, 4))}  # merged to 12, blocks of 4
    assert G.known_crash(kwargs, beside) is None and _runs(config, beside)


@needs_google
def test_input_side_on_a_vector_crashes_google() -> None:
    """The INPUT defect in DEVIATIONS: a parameter whose merged shape is 1-d (a vector,
    or a (3, 5) merged into 15) crashes Google; unmerged, the matrix runs."""
    kwargs = {**BASE, "precondtioner_type": "INPUT"}
    config = from_google(kwargs, x64=True)
    exported = ss.to_google(config)
    for shape in ((4,), (3, 5)):
        assert G.known_crash(exported, {"w": np.zeros(shape)}) is not None
        with pytest.raises(AssertionError):
            G.run(config, {"w": np.zeros(shape)}, [{"w": np.ones(shape)}])
    unmerged = from_google({**kwargs, "merge_small_dims_block_size": 1}, x64=True)
    matrix = {"w": np.zeros((3, 5))}
    assert G.known_crash(ss.to_google(unmerged), matrix) is None and _runs(unmerged, matrix)


@needs_google
def test_ungrafted_coupled_learning_rate_is_ignored_by_google() -> None:
    """The other defect in DEVIATIONS: graft NONE with decoupled_learning_rate=False
    takes the same preconditioned steps whatever the learning rate (from step 2, Google's
    start 1), so from_google refuses it. Fails once Google fixes it."""
    kwargs = {**BASE, "graft_type": "NONE", "decoupled_learning_rate": False,
              "start_preconditioning_step": 1, "beta1": 0.0}
    params, grads = _problem(3)
    runs = [_by_hand({**kwargs, "learning_rate": lr}, params, grads, x64=True)
            for lr in (0.1, 1e-3)]
    start = {k: params[k] - 0.1 * grads[0][k] for k in params}  # SGD warm-up step: lr acts
    np.testing.assert_allclose(runs[0][0]["w"], start["w"], rtol=1e-12)
    for k in params:
        steps = [np.diff(np.stack([r[t][k] for t in range(len(grads))]), axis=0) for r in runs]
        np.testing.assert_allclose(steps[0], steps[1], rtol=1e-12)  # lr 100x apart
    with pytest.raises(NotImplementedError, match="decoupled_learning_rate"):
        from_google(kwargs, x64=True)


@needs_google
def test_stepper_is_run_closed_loop_and_adamw_is_optax() -> None:
    config = from_google(BASE, x64=True)
    params, grads = _problem(2, steps=3)
    step = get_backend("google").stepper("shampoo", params, lr=0.1, config=config)  # type: ignore[attr-defined]
    want = G.run(config, params, grads)
    for g, w in zip(grads, want, strict=True):
        got = step.step(g)
        for k in params:
            np.testing.assert_allclose(got[k], w[k], rtol=1e-12, atol=1e-14)
    adamw = G.stepper("adamw", params, lr=0.01, weight_decay=0.1)
    with jax.enable_x64(True):
        tx = optax.adamw(0.01, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)
        p = {k: jnp.asarray(v) for k, v in params.items()}
        s = tx.init(p)
        for g in grads:
            u, s = tx.update({k: jnp.asarray(v) for k, v in g.items()}, s, p)
            p = optax.apply_updates(p, u)
            got = adamw.step(g)
            for k in params:
                np.testing.assert_allclose(got[k], np.asarray(p[k]), rtol=1e-12, atol=1e-14)
    with pytest.raises(Inexpressible):
        G.stepper("shampoo", params, lr=0.1, config=ss.ShampooConfig())


@needs_google
def test_command_line_runs_the_suite_on_google() -> None:
    """``python -m shampoo_conformance run --backend google`` runs Google's named case."""
    proc = subprocess.run(
        [sys.executable, "-m", "shampoo_conformance", "run", "--backend", "google", "--",
         "-q", "-k", "test_named_case_float64 and google_preset"],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 passed" in proc.stdout



#: Frequent directions as Google requires it (eqs. 6c, 10d): rank 1, statistics and
#: roots every step, the previous preconditioner passed in; matrices kept unmerged, so
#: each factor's observations span more than rank + 1 directions from the first step.
FD: dict[str, Any] = {**BASE, "block_size": 8, "merge_small_dims_block_size": 1,
                      "frequent_directions": True, "compression_rank": 1,
                      "reuse_preconditioner": True}


def _fd_problem(shapes: dict[str, tuple[int, ...]], steps: int = 3
                ) -> tuple[Arrays, list[Arrays]]:
    rng = np.random.default_rng(7)
    params = {k: rng.standard_normal(s) for k, s in shapes.items()}
    grads = [{k: rng.standard_normal(s) for k, s in shapes.items()} for _ in range(steps)]
    return params, grads


def _worst_from_reference(kwargs: dict[str, Any], params: Arrays, grads: list[Arrays],
                          own: bool = False) -> float:
    """Google against the reference of ``from_google(kwargs)``; ``own``: with eq. (10d)'s
    ``packing`` and eq. (11d)'s ``deflation_padding`` "own" (each factor by itself)."""
    config = from_google(kwargs, x64=True)
    if own and config.frequent_directions is not None:
        config = dataclasses.replace(config, frequent_directions=dataclasses.replace(
            config.frequent_directions, packing="own"))
    if own and isinstance(config.root_inverse, ss.CoupledNewtonConfig):
        config = dataclasses.replace(config, root_inverse=dataclasses.replace(
            config.root_inverse, deflation_padding="own"))
    _, ref = bound_and_reference(config, params, grads, np.float64)
    got = _by_hand(kwargs, params, grads, x64=True)
    return max(float(np.abs(g[k] - r[k]).max() / np.abs(r[k]).max())
               for g, r in zip(got, ref, strict=True) for k in r)


@needs_google
def test_frequent_directions_sketch_of_a_smaller_factor_is_lost_by_google() -> None:
    """A defect in DEVIATIONS: Google packs a sketch (its values lambda and has_zeros in
    the last rows) at the size of its largest statistic, then cuts the packed matrix to
    the factor's own rows, so a sketched factor smaller than the largest keeps no lambda:
    its next update starts from eps alone. One 5 x 5 factor beside 8 x 8 ones leaves the
    reference with ``packing="own"`` at once, and agrees with the imported
    ``packing="google"``; alone, or as large as the others, it agrees to rounding."""
    params, grads = _fd_problem({"w": (8, 8), "v": (5, 5)})
    with jax.enable_x64(True):
        tx = ds.distributed_shampoo(**G.google_kwargs(FD))
        p = {k: jnp.asarray(v) for k, v in params.items()}
        s = G.google_init(tx, p)
        _, s = tx.update({k: jnp.asarray(v) for k, v in grads[0].items()}, s, p)
    largest = np.asarray(s.stats["w"].preconditioners[0])  # (8, 3): lambda in [-1, -1]
    smaller = np.asarray(s.stats["v"].preconditioners[0])  # (5, 3): its row 4 is padding's
    assert largest[-1, -1] > 0 and smaller[-1, -1] == 0.0
    assert _worst_from_reference(FD, params, grads, own=True) > 1e-3
    assert _worst_from_reference(FD, params, grads) < 1e-12
    alone = _fd_problem({"v": (5, 5)})
    same = _fd_problem({"w": (8, 8), "v": (8, 8)})
    assert _worst_from_reference(FD, *alone) < 1e-12
    assert _worst_from_reference(FD, *same) < 1e-12


LOBPCG: dict[str, Any] = {**BASE, "block_size": 16, "merge_small_dims_block_size": 1,
                          "lobpcg_topk_precondition": 2}


@needs_google
def test_lobpcg_rejects_every_root_of_a_smaller_factor() -> None:
    """A defect in DEVIATIONS: with LOBPCG Google judges a root by max|X^p (A + eps I) - I|
    over the padded matrix, whose padding rows are 0, so a factor smaller than the
    largest statistic shows the error 1 and keeps its initial identity root for ever.
    An 11 x 11 factor beside 12 x 12 ones: its roots never change and the reference
    with ``deflation_padding="own"`` (which deflates it, eq. 11d) leaves Google, with
    the imported ``"google"`` it does not; alone, or as large as the others, the two
    agree to rounding, and there the deflation changes the trajectory."""
    params, grads = _fd_problem({"w": (12, 12), "v": (11, 11)})
    with jax.enable_x64(True):
        tx = ds.distributed_shampoo(**G.google_kwargs(LOBPCG))
        p = {k: jnp.asarray(v) for k, v in params.items()}
        s0 = G.google_init(tx, p)
        s = s0
        for g in grads:
            _, s = tx.update({k: jnp.asarray(v) for k, v in g.items()}, s, p)
    for before, after in zip(s0.stats["v"].preconditioners, s.stats["v"].preconditioners,
                             strict=True):
        np.testing.assert_array_equal(np.asarray(after), np.eye(11))
        np.testing.assert_array_equal(np.asarray(before), np.eye(11))
    assert all(np.abs(np.asarray(x) - np.eye(12)).max() > 0.1
               for x in s.stats["w"].preconditioners)
    assert _worst_from_reference(LOBPCG, params, grads, own=True) > 1e-2
    assert _worst_from_reference(LOBPCG, params, grads) < 1e-12
    assert _worst_from_reference(LOBPCG, *_fd_problem({"v": (11, 11)})) < 1e-12
    same = _fd_problem({"w": (12, 12), "v": (12, 12)})
    assert _worst_from_reference(LOBPCG, *same) < 1e-12
    _, deflated = bound_and_reference(from_google(LOBPCG, x64=True), *same, np.float64)
    plain_kwargs = {k: v for k, v in LOBPCG.items() if k != "lobpcg_topk_precondition"}
    _, plain = bound_and_reference(from_google(plain_kwargs, x64=True), *same, np.float64)
    assert max(float(np.abs(a[k] - b[k]).max() / np.abs(b[k]).max())
               for a, b in zip(deflated, plain, strict=True) for k in b) > 1e-2


@needs_google
def test_known_crash_predicts_googles_lobpcg_limit() -> None:
    """JAX's lobpcg_standard needs 5k below the (padded) statistic size."""
    small = {"v": np.zeros((10, 10))}
    assert "5 lobpcg_topk_precondition" in (G.known_crash(LOBPCG, small) or "")
    assert G.known_crash(LOBPCG, {"v": np.zeros((11, 11))}) is None
    assert G.known_crash({**LOBPCG, "eigh": True}, small) is None


@needs_google
def test_average_grad_changes_googles_state_structure_on_unpreconditioned_parameters() -> None:
    """A defect in DEVIATIONS: with average_grad Google's init gives every parameter a
    gradient sum, and its update replaces that of a parameter it does not precondition
    by optax.MaskedNode: the state's structure changes after the first step, so a
    lax.scan (or a restore by the initial structure) over Google's update fails. Its
    numbers are unaffected (the sum is unused there)."""
    kwargs = {**FD, "average_grad": True, "skip_preconditioning_rank_lt": 2}
    params, grads = _fd_problem({"w": (8, 8), "b": (8,)})
    with jax.enable_x64(True):
        tx = ds.distributed_shampoo(**G.google_kwargs(kwargs))
        p = {k: jnp.asarray(v) for k, v in params.items()}
        s0 = G.google_init(tx, p)
        _, s1 = tx.update({k: jnp.asarray(v) for k, v in grads[0].items()}, s0, p)
    assert not isinstance(s0.stats["b"].avg_grad, optax.MaskedNode)
    assert isinstance(s1.stats["b"].avg_grad, optax.MaskedNode)
    assert jax.tree.structure(s0) != jax.tree.structure(s1)
    # Preconditioned parameters keep theirs, and the numbers match the reference.
    assert not isinstance(s1.stats["w"].avg_grad, optax.MaskedNode)
    assert _worst_from_reference(kwargs, params, grads) < 1e-12
