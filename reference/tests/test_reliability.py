"""Failures leave the reference's state whole: eq. (3)'s refusal of blocks whose
gradient is non-finite or too large for float32 state, and eq. (13)'s
RootFailureError raised only once the step is complete."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import pytest

import shampoo_reference.optimizer
import shampoo_spec as ss
from shampoo_reference import ReferenceShampoo
from shampoo_reference.state import ParameterState

F32_MAX = float(np.finfo(np.float32).max)


def _config(policy: str = "skip_block", **changes: Any) -> ss.ShampooConfig:
    """Two blocks of rows per (4, 2) weight, stateful graft, filter and momentum."""
    base = ss.ShampooConfig(
        learning_rate=0.1,
        epsilon=ss.EpsilonConfig(value=1e-3),
        grafting=ss.GraftingConfig(type="adagrad"),
        gradient_filter=ss.GradientFilterConfig(beta1=0.5),
        momentum=ss.MomentumConfig(momentum=0.9),
        blocking=ss.BlockingConfig(max_preconditioner_dim=2, merge_dims_up_to=None),
        failure=ss.FailureConfig(nonfinite_gradient=policy),  # type: ignore[arg-type]
    )
    return dataclasses.replace(base, **changes)


def _stream(steps: int, seed: int = 0) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    params = {"w": rng.standard_normal((4, 2)), "b": rng.standard_normal(3)}
    grads = [{"w": rng.standard_normal((4, 2)), "b": rng.standard_normal(3)} for _ in range(steps)]
    return params, grads


def _snapshot(opt: ReferenceShampoo) -> dict[str, Any]:
    return {
        "t": opt.t,
        "metrics": dataclasses.astuple(opt.metrics),
        "params": copy.deepcopy(opt.params),
        "state": copy.deepcopy(opt.state),
    }


def _assert_same_state(a: ParameterState, b: ParameterState) -> None:
    for name in ("graft", "filtered", "momentum", "graft_momentum"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            np.testing.assert_array_equal(x, y, err_msg=name)
    for ba, bb in zip(a.blocks, b.blocks, strict=True):
        assert ba.statistics_updates == bb.statistics_updates
        assert ba.consecutive_failures == bb.consecutive_failures
        for x, y in zip(ba.factors + ba.inverse_roots, bb.factors + bb.inverse_roots, strict=True):
            if x is not None:
                assert y is not None
                np.testing.assert_array_equal(x, y)


def _assert_unchanged(opt: ReferenceShampoo, before: dict[str, Any]) -> None:
    assert opt.t == before["t"]
    assert dataclasses.astuple(opt.metrics) == before["metrics"]
    for name, value in before["params"].items():
        np.testing.assert_array_equal(opt.params[name], value)
        _assert_same_state(opt.state[name], before["state"][name])


# ----------------------------------------------------------- eq. (3) refusal
def test_huge_finite_gradient_block_is_refused_under_skip_block() -> None:
    config = _config()
    params, grads = _stream(5)
    grads[2]["w"][0, 0] = 1e20  # finite, but |B| g^2 = 4e40 > 2^127
    assert np.all(np.isfinite(grads[2]["w"]))
    opt = ReferenceShampoo(config, params)
    for g in grads[:2]:
        opt.step(g)
    before = _snapshot(opt)
    opt.step(grads[2])
    assert opt.metrics.skipped_blocks == 1
    # The refused block (rows 0-1): its parameter entries and every state on it unchanged.
    np.testing.assert_array_equal(opt.params["w"][:2], before["params"]["w"][:2])
    st, old = opt.state["w"], before["state"]["w"]
    for k, f in enumerate(st.blocks[0].factors):
        assert f is not None
        np.testing.assert_array_equal(f, old.blocks[0].factors[k])
    assert st.blocks[0].statistics_updates == old.blocks[0].statistics_updates
    for name in ("graft", "filtered", "momentum"):
        np.testing.assert_array_equal(getattr(st, name)[:2], getattr(old, name)[:2])
        assert not np.array_equal(getattr(st, name)[2:], getattr(old, name)[2:])
    # The other block and parameter moved.
    assert not np.array_equal(opt.params["w"][2:], before["params"]["w"][2:])
    assert not np.array_equal(opt.params["b"], before["params"]["b"])
    for g in grads[3:]:
        out = opt.step(g)
    assert all(np.all(np.isfinite(v)) for v in out.values())
    assert st.graft is not None
    assert np.all(np.isfinite(st.graft)) and np.max(st.graft) < 1e3


def test_other_blocks_step_as_if_the_refused_block_were_omitted() -> None:
    """Rows 2-3 of w (a block of its own) follow exactly a (2, 2) parameter holding them."""
    config = _config()
    params, grads = _stream(6)
    grads[1]["w"][1, 1] = -3e19  # 4 * 9e38 > 2^127
    grads[4]["w"][0, 0] = np.inf
    whole = ReferenceShampoo(config, params)
    alone = ReferenceShampoo(config, {"v": params["w"][2:], "b": params["b"]})
    for g in grads:
        out = whole.step(g)
        ref = alone.step({"v": g["w"][2:], "b": g["b"]})
        np.testing.assert_allclose(out["w"][2:], ref["v"], rtol=1e-14, atol=0)
        np.testing.assert_allclose(out["b"], ref["b"], rtol=1e-14, atol=0)
    assert whole.metrics.skipped_blocks == 2 and alone.metrics.skipped_blocks == 0


def test_refusal_depends_on_the_block_state() -> None:
    """Each gradient alone is fine; the sum in the factors would pass 2^127: refused then."""
    config = _config(statistics=ss.StatisticsConfig(beta2=1.0))
    opt = ReferenceShampoo(config, {"b": np.zeros(1)})
    g = {"b": np.array([1e19])}  # |B| g^2 = 1e38 each step
    opt.step(g)
    assert opt.metrics.skipped_blocks == 0
    assert not ss.block_overflows(1e19, 1, 0.0) and ss.block_overflows(1e19, 1, 1e38)
    opt.step(g)
    # m = 1e38 (factor and graft), + 1e38 = 2e38 > 2^127: the second step is refused.
    assert opt.metrics.skipped_blocks == 1
    factor = opt.state["b"].blocks[0].factors[0]
    assert factor is not None and factor[0, 0] == pytest.approx(1e38, rel=1e-12)


@pytest.mark.parametrize("bad", [1e20, np.inf, np.nan])
def test_raise_changes_nothing(bad: float) -> None:
    config = _config(policy="raise")
    params, grads = _stream(4)
    opt = ReferenceShampoo(config, params)
    for g in grads[:2]:
        opt.step(g)
    before = _snapshot(opt)
    hostile = copy.deepcopy(grads[2])
    hostile["w"][3, 1] = bad  # the second block of w; "b" comes after it in the dict
    with pytest.raises(ss.NonFiniteGradientError) as info:
        opt.step({"b": hostile["b"], "w": hostile["w"]})
    message = str(info.value)
    assert "'w'" in message and "step 3" in message and "block 1" in message
    if np.isfinite(bad):
        assert "too large for float32 state" in message
    else:
        assert "non-finite gradient" in message
    _assert_unchanged(opt, before)
    # The optimizer goes on exactly as a fresh run that never saw the bad gradient.
    fresh = ReferenceShampoo(config, params)
    for g in grads[:2] + grads[3:]:
        expected = fresh.step(g)
    out = opt.step(grads[3])
    for name in out:
        np.testing.assert_array_equal(out[name], expected[name])


def test_raise_on_a_later_parameter_leaves_earlier_ones_unchanged() -> None:
    config = _config(policy="raise")
    params, grads = _stream(1)
    opt = ReferenceShampoo(config, params)
    before = _snapshot(opt)
    with pytest.raises(ss.NonFiniteGradientError, match="parameter 'b'"):
        opt.step({"w": grads[0]["w"], "b": np.array([0.0, 1e200, 0.0])})
    _assert_unchanged(opt, before)


@pytest.mark.parametrize("graft", ["adagrad", "adagrad_normalized", "none"])
@pytest.mark.parametrize("eigenvalue_corrected", [False, True])
def test_sums_with_big_finite_gradients_never_leave_float32_range(
    graft: str, eigenvalue_corrected: bool
) -> None:
    """beta2 = 1 (sums): 1e18-sized gradients for 200 steps keep every state entry finite
    and within float32's range; blocks are refused once the bound would be passed."""
    config = _config(
        statistics=ss.StatisticsConfig(beta2=1.0),
        grafting=ss.GraftingConfig(type=graft),  # type: ignore[arg-type]
        eigenvalue_correction=(
            ss.EigenvalueCorrectionConfig(beta2=1.0, epsilon=1e-8) if eigenvalue_corrected
            else None
        ),
    )
    rng = np.random.default_rng(1)
    params = {"w": rng.standard_normal((4, 2)), "b": rng.standard_normal(3)}
    opt = ReferenceShampoo(config, params)
    for _ in range(200):
        grads = {k: 1e18 * rng.uniform(0.5, 2.0, v.shape) for k, v in params.items()}
        out = opt.step(grads)
        assert all(np.all(np.isfinite(v)) for v in out.values())
    assert opt.metrics.skipped_blocks > 0
    for st in opt.state.values():
        arrays = [st.graft] if st.graft is not None else []
        for bs in st.blocks:
            arrays += [f for f in bs.factors if f is not None]
            arrays += [x for x in bs.inverse_roots if x is not None]
            if bs.corrected_second_moment is not None:
                arrays.append(bs.corrected_second_moment)
        for a in arrays:
            assert np.all(np.isfinite(a))
            assert np.max(np.abs(a)) <= ss.STATE_LIMIT < F32_MAX


def test_refusal_counts_graft_state_and_corrected_moment() -> None:
    """m includes V on the block's slice and D: big enough V alone refuses a small gradient."""
    config = _config(grafting=ss.GraftingConfig(type="adagrad"))
    opt = ReferenceShampoo(config, {"b": np.zeros(2)})
    st = opt.state["b"]
    assert st.graft is not None
    st.graft[:] = ss.STATE_LIMIT
    opt.step({"b": np.array([0.0, 0.0])})  # 2^127 + 0: passes
    assert opt.metrics.skipped_blocks == 0
    assert not ss.block_overflows(1e16, 2, 0.0)
    opt.step({"b": np.array([1e16, 0.0])})  # 2^127 + 2e32: refused
    assert opt.metrics.skipped_blocks == 1
    np.testing.assert_array_equal(st.graft, [ss.STATE_LIMIT, ss.STATE_LIMIT])

    corrected = _config(
        grafting=ss.GraftingConfig(type="sgd"),
        eigenvalue_correction=ss.EigenvalueCorrectionConfig(epsilon=1e-8),
    )
    opt = ReferenceShampoo(corrected, {"b": np.zeros(2)})
    d = opt.state["b"].blocks[0].corrected_second_moment
    assert d is not None
    d[:] = ss.STATE_LIMIT
    opt.step({"b": np.array([1e16, 0.0])})
    assert opt.metrics.skipped_blocks == 1
    np.testing.assert_array_equal(opt.params["b"], [0.0, 0.0])


# ----------------------------------------------------------- eq. (13) at the end
def _failing_roots(limit: int | None) -> ss.ShampooConfig:
    """Coupled Newton that can never meet its failure threshold: every root fails."""
    return _config(
        root_inverse=ss.CoupledNewtonConfig(
            max_iterations=1, tolerance=1e-12, failure_threshold=1e-12
        ),
        failure=ss.FailureConfig(max_consecutive_root_failures=limit),
        # Root steps 2, 4, 6 (t = start, then t % 2 == 0).
        schedule=ss.ScheduleConfig(precondition_frequency=2, start_preconditioning_step=2),
    )


def test_root_failure_error_is_raised_after_the_step_completes() -> None:
    params, grads = _stream(6, seed=3)
    failing = ReferenceShampoo(_failing_roots(0), params)
    lenient = ReferenceShampoo(_failing_roots(None), params)
    # Step 1 is no root step (frequency 2, anchored at the end): both agree.
    np.testing.assert_array_equal(failing.step(grads[0])["w"], lenient.step(grads[0])["w"])
    before = copy.deepcopy(failing.params)
    with pytest.raises(ss.RootFailureError) as info:
        failing.step(grads[1])
    expected = lenient.step(grads[1])
    message = str(info.value)
    assert "parameter 'w'" in message and "parameter 'b'" in message and "step 2" in message
    assert "block 0" in message and "block 1" in message
    assert failing.t == lenient.t == 2
    for name in params:  # every parameter moved, exactly as without the limit
        assert not np.array_equal(failing.params[name], before[name])
        np.testing.assert_array_equal(failing.params[name], expected[name])
        _assert_same_state(failing.state[name], lenient.state[name])
    assert failing.metrics == lenient.metrics
    assert failing.metrics.root_failures == lenient.metrics.root_failures > 0
    # The failed roots kept their previous value: the identity.
    root = failing.state["w"].blocks[0].inverse_roots[0]
    assert root is not None
    np.testing.assert_array_equal(root, np.eye(2))
    # The optimizer goes on: a non-root step completes; the next root step raises again.
    np.testing.assert_array_equal(failing.step(grads[2])["w"], lenient.step(grads[2])["w"])
    with pytest.raises(ss.RootFailureError, match="2 root steps in a row"):
        failing.step(grads[3])
    np.testing.assert_array_equal(failing.params["w"], lenient.step(grads[3])["w"])


def test_root_failures_within_the_limit_do_not_raise() -> None:
    params, grads = _stream(4, seed=4)
    opt = ReferenceShampoo(_failing_roots(1), params)
    opt.step(grads[0])
    opt.step(grads[1])  # first failing root step: 1 <= 1
    opt.step(grads[2])
    with pytest.raises(ss.RootFailureError, match="failed on 2 root steps"):
        opt.step(grads[3])
    assert opt.t == 4


# ----------------------------------------------------------- construction
def test_large_block_warns_naming_the_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warning comes before the factors are allocated (here: never, to spare 512 MiB)."""

    class Allocating(Exception):
        pass

    def refuse(config: ss.ShampooConfig, shape: tuple[int, ...]) -> None:
        raise Allocating

    monkeypatch.setattr(shampoo_reference.optimizer, "init_parameter", refuse)
    n = ss.LARGE_BLOCK_DIM + 1
    config = ss.ShampooConfig(
        blocking=ss.BlockingConfig(max_preconditioner_dim=n, merge_dims_up_to=None)
    )
    with pytest.warns(UserWarning, match="'huge_embedding'") as caught, pytest.raises(Allocating):
        ReferenceShampoo(config, {"huge_embedding": np.zeros(n), "b": np.zeros(3)})
    assert len(caught) == 1


@pytest.mark.parametrize("config", [None, {}, "eigh", ss.EighConfig()])
def test_config_must_be_a_shampoo_config(config: Any) -> None:
    with pytest.raises(ValueError, match="config = .* allowed a shampoo_spec.ShampooConfig"):
        ReferenceShampoo(config, {"w": np.zeros(3)})


@pytest.mark.parametrize("bad", [np.zeros(3, np.complex64), np.array(["a", "b", "c"]), "w"])
def test_params_and_gradients_must_be_real_arrays(bad: Any) -> None:
    with pytest.raises(ValueError, match="parameter 'w'"):
        ReferenceShampoo(ss.ShampooConfig(), {"w": bad})
    opt = ReferenceShampoo(ss.ShampooConfig(), {"w": np.zeros(3)})
    with pytest.raises(ValueError, match="gradient 'w'"):
        opt.step({"w": bad})
    assert opt.t == 0
    # bool and integer arrays are real: read as float64.
    out = opt.step({"w": np.array([1, 0, 2])})
    assert out["w"].dtype == np.float64 and opt.t == 1


# ------------------------------------------------------- eq. (22), update guard
def test_update_overflowing_float64_is_withheld_with_its_momentum() -> None:
    """1 x 1 blocks without graft: P = sign(G) (L = g^2 + 1e-30 rounds to g^2). lr = 1e308:
    W = -1e308 - lr P = -2e308 overflows float64, so that entry keeps its
    value and its momentum; W = 0 moves to -1e308; one parameter step is counted."""
    cfg = ss.ShampooConfig(
        learning_rate=1e308, epsilon=ss.EpsilonConfig(value=1e-30),
        momentum=ss.MomentumConfig(momentum=0.5),
        blocking=ss.BlockingConfig(max_preconditioner_dim=1),
    )
    opt = ReferenceShampoo(cfg, {"w": np.array([-1e308, 0.0])})
    out = opt.step({"w": np.array([0.5, 0.5])})
    assert out["w"].tolist() == [-1e308, -1e308]
    mom = opt.state["w"].momentum
    assert mom is not None and mom.tolist() == [0.0, 1.0]
    assert opt.metrics.withheld_updates == 1 and opt.metrics.skipped_blocks == 0
    out = opt.step({"w": np.array([0.0, 0.0])})  # P = 0: M = 0.5 M; W = -1e308 - 0.5e308
    assert out["w"].tolist() == [-1e308, -1.5e308]
    assert opt.metrics.withheld_updates == 1
