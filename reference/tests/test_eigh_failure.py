"""Eq. (13) for eigh roots: ``EighConfig.failure_threshold`` tau, constructed cases.

The eigendecomposition's error ``e = max|Q^T B Q - diag(lambda)|`` is rounding
noise, about ``u ||B||`` (u = 2^-53): ~1e-22 for the small factors below and
~1e-8 for the large ones. Each case first checks that its thresholds sit many
orders of magnitude from every error it judges, then that the optimizer fails
exactly the roots it should: counted, the previous root kept (eq. 13).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import shampoo_spec as ss
from shampoo_reference import ReferenceShampoo, eigh_error, root_inverse_eigh
from shampoo_reference.roots.eigh import eigh_input

SHAPE = (4, 3)  # one block, factors 4 x 4 and 3 x 3, roots 4
EPS = 1e-6

BASE = ss.ShampooConfig(
    learning_rate=0.01,
    epsilon=ss.EpsilonConfig(value=EPS),
    blocking=ss.BlockingConfig(merge_dims_up_to=None),
)


def _config(tau: float | None, **changes: object) -> ss.ShampooConfig:
    return dataclasses.replace(  # type: ignore[arg-type]
        BASE, root_inverse=ss.EighConfig(failure_threshold=tau), **changes
    )


def _stream(scales: list[float], seed: int = 0) -> tuple[dict, list[dict]]:
    rng = np.random.default_rng(seed)
    params = {"w": rng.standard_normal(SHAPE)}
    return params, [{"w": s * rng.standard_normal(SHAPE)} for s in scales]


def _errors(opt: ReferenceShampoo) -> list[float]:
    """Eq. (13)'s error of each factor of ``w`` as the step just taken saw it."""
    out = []
    for a in opt.state["w"].blocks[0].factors:
        assert a is not None
        b = eigh_input(a, EPS, "ridge")
        lam, q = np.linalg.eigh(b)
        out.append(eigh_error(b, lam, q))
    return out


def _roots(opt: ReferenceShampoo) -> list[np.ndarray]:
    roots = opt.state["w"].blocks[0].inverse_roots
    assert all(x is not None for x in roots)
    return [np.array(x) for x in roots]


def test_threshold_below_every_error_fails_every_root() -> None:
    """tau = 2^-126: every root fails, is counted, and the identity stays."""
    params, grads = _stream([1.0] * 5)
    opt = ReferenceShampoo(_config(2.0**-126), params)
    for t, g in enumerate(grads, start=1):
        opt.step(g)
        assert min(_errors(opt)) > 1e-30  # far above tau
        assert opt.metrics.root_failures == 2 * t
        assert opt.state["w"].blocks[0].consecutive_failures == t
        for x in _roots(opt):
            np.testing.assert_array_equal(x, np.eye(len(x)))
    # With identity roots the direction is the gradient itself (eq. 16, no graft).
    plain = ReferenceShampoo(dataclasses.replace(BASE, schedule=ss.ScheduleConfig(
        start_preconditioning_step=None)), params)
    for g in grads:
        plain.step(g)
    np.testing.assert_allclose(opt.params["w"], plain.params["w"], rtol=0, atol=1e-15)


@pytest.mark.parametrize("tau", [1.0, 1e30])
def test_threshold_above_every_error_never_fails(tau: float) -> None:
    """Bit for bit the run without a threshold, and no failure counted."""
    params, grads = _stream([1e-4, 1.0, 1e4, 1.0])
    checked = ReferenceShampoo(_config(tau), params)
    plain = ReferenceShampoo(_config(None), params)
    for g in grads:
        np.testing.assert_array_equal(checked.step(g)["w"], plain.step(g)["w"])
        assert max(_errors(checked)) < tau * 1e-6
    assert checked.metrics.root_failures == plain.metrics.root_failures == 0


def test_failing_roots_keep_the_previous_root() -> None:
    """Small gradients for 3 steps (e ~ 1e-22: pass), then large ones (e ~ 1e-8: fail).

    tau = 1e-15: the roots of step 3 stay through steps 4-6, 2 failures a step.
    """
    params, grads = _stream([1e-4] * 3 + [1e4] * 3)
    opt = ReferenceShampoo(_config(1e-15), params)
    for g in grads[:3]:
        opt.step(g)
        assert max(_errors(opt)) < 1e-19
    assert opt.metrics.root_failures == 0
    factors = [np.array(a) for a in opt.state["w"].blocks[0].factors if a is not None]
    kept = _roots(opt)
    for x, a in zip(kept, factors, strict=True):  # root 4 = 2 * order (eq. 12)
        np.testing.assert_array_equal(x, root_inverse_eigh(a, 4, EPS, "ridge"))
    assert not np.allclose(kept[0], np.eye(4))
    for t, g in enumerate(grads[3:], start=1):
        opt.step(g)
        assert min(_errors(opt)) > 1e-12
        assert opt.metrics.root_failures == 2 * t
        assert opt.state["w"].blocks[0].consecutive_failures == t
        for x, old in zip(_roots(opt), kept, strict=True):
            np.testing.assert_array_equal(x, old)


def test_failing_eigenbases_keep_the_previous_basis() -> None:
    """Eq. (17): the eigenbasis of B = sym(A) is judged alike; a failed one keeps Q."""
    params, grads = _stream([1.0] * 3)
    config = _config(2.0**-126, eigenvalue_correction=ss.EigenvalueCorrectionConfig())
    opt = ReferenceShampoo(config, params)
    for t, g in enumerate(grads, start=1):
        opt.step(g)
        assert opt.metrics.root_failures == 2 * t
        for q in _roots(opt):
            np.testing.assert_array_equal(q, np.eye(len(q)))
    lenient = ReferenceShampoo(dataclasses.replace(config, root_inverse=ss.EighConfig()), params)
    for g in grads:
        lenient.step(g)
    assert lenient.metrics.root_failures == 0
    assert not np.allclose(_roots(lenient)[0], np.eye(4))


def test_failing_roots_count_towards_the_limit() -> None:
    """Eq. (13): over max_consecutive_root_failures, RootFailureError after the step."""
    params, grads = _stream([1.0] * 2)
    opt = ReferenceShampoo(
        _config(2.0**-126, failure=ss.FailureConfig(max_consecutive_root_failures=1)), params
    )
    opt.step(grads[0])
    with pytest.raises(ss.RootFailureError, match="failed on 2 root steps in a row"):
        opt.step(grads[1])
    assert opt.t == 2 and opt.metrics.root_failures == 4
