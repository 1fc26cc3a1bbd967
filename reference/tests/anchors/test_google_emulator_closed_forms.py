"""Closed-form checks of google_emulator.py (fast; numpy + scipy only)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from scipy.linalg import fractional_matrix_power

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from google_emulator import (  # noqa: E402
    emulate_google,
    inverse_pth_root_eigh,
    inverse_pth_root_newton,
    merge_small_dims,
    power_iteration,
)


def _problem(shapes, steps, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s) for k, s in shapes.items()}
    grads = [{k: scale * rng.standard_normal(s) for k, s in shapes.items()} for _ in range(steps)]
    return params, grads


def _spd(n, rng, cond=1e3):
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    ev = np.geomspace(1.0, 1.0 / cond, n)
    return (q * ev) @ q.T


@pytest.mark.parametrize("graft", ["SGD", "ADAGRAD", "RMSPROP"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_before_start_is_the_graft_optimizer_with_googles_momentum(graft, nesterov):
    lr, b1, b2, deps, wd = 0.1, 0.9, 0.95, 1e-10, 0.01
    kwargs = dict(learning_rate=lr, block_size=128, beta1=b1, beta2=b2, diagonal_epsilon=deps,
                  weight_decay=wd, graft_type=graft, nesterov=nesterov,
                  start_preconditioning_step=10**9)
    shapes = {"w": (7, 10), "b": (7,), "t": (3, 4, 5), "s": ()}
    params, grads = _problem(shapes, 4)
    got = emulate_google(kwargs, params, grads)
    for k in shapes:
        x = params[k].copy()
        acc = np.zeros_like(x)
        m = np.zeros_like(x)
        for t, g in enumerate(grads):
            g = g[k]
            if graft == "SGD":
                d = g
            elif graft == "ADAGRAD":
                acc = acc + g * g
                d = g / (np.sqrt(acc) + deps)
            else:
                acc = b2 * acc + (1 - b2) * g * g
                d = g / (np.sqrt(acc) + deps)
            d = d + wd * x  # coupled weight decay enters the direction
            m = b1 * m + d  # momentum weight 1, not 1 - beta1
            n = d + b1 * m if nesterov else m
            x = x - lr * n
            np.testing.assert_allclose(got[t][k], x, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("eigh,rtol", [(True, 1e-12), (False, 1e-6)])
def test_vector_param_is_full_matrix_adagrad_with_ridge(eigh, rtol):
    # beta2 = 1 -> weight 1 on G G^T; absolute ridge; graft NONE -> no rescale;
    # no momentum -> x_{t+1} = x_t - lr (eps0 I + sum g g^T + eps I)^(-1/2) g.
    # The coupled Newton stops at max|M - I| <= 1e-6, so its root is only
    # accurate to ~1e-7 relative (by design of the library); eigh is exact.
    eps, lr, n = 0.25, 0.3, 6  # eps exactly representable in float32
    kwargs = dict(learning_rate=lr, block_size=128, beta1=0.0, beta2=1.0, matrix_epsilon=eps,
                  relative_matrix_epsilon=False, graft_type="NONE", nesterov=False,
                  start_preconditioning_step=0, eigh=eigh)
    params, grads = _problem({"v": (n,)}, 3, seed=3)
    got = emulate_google(kwargs, params, grads)
    x = params["v"].copy()
    L = eps * np.eye(n)
    for t, g in enumerate(grads):
        g = g["v"]
        L = L + np.outer(g, g)
        P = fractional_matrix_power(L + eps * np.eye(n), -0.5).real
        x = x - lr * (P @ g)
        np.testing.assert_allclose(got[t]["v"], x, rtol=rtol, atol=rtol * 1e-2)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("cond", [1e3, 1e8])
def test_newton_root_matches_scipy(p, cond):
    # Stopping rule max|M - I| <= 1e-6 bounds the root's relative error by ~1e-6
    # (measured 1e-12 .. 3e-7); p = 3 converges correctly (unlike optax's copy).
    rng = np.random.default_rng(p)
    a = _spd(9, rng, cond=cond)
    eps = 1e-9
    got, err = inverse_pth_root_newton(a, p, eps, relative=False)
    damped = a + eps * np.eye(9)
    want = fractional_matrix_power(damped, -1.0 / p).real
    assert err <= 1e-6
    assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want)
    resid = np.linalg.matrix_power(got, p) @ damped - np.eye(9)
    assert np.abs(resid).max() <= 1e-5


def test_newton_relative_ridge_uses_power_iteration_lambda_max():
    rng = np.random.default_rng(11)
    a = _spd(7, rng, cond=1e2) * 3.0
    lam = power_iteration(a)
    assert abs(lam - np.linalg.eigvalsh(a)[-1]) < 1e-5
    got, _ = inverse_pth_root_newton(a, 4, 1e-3, relative=True)
    want = fractional_matrix_power(a + 1e-3 * lam * np.eye(7), -0.25).real
    assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want)


def test_eigh_root_clamps_with_floor():
    rng = np.random.default_rng(5)
    a = _spd(6, rng, cond=1e3)
    got, _ = inverse_pth_root_eigh(a, 3, 1e-4, relative=True)
    lam = power_iteration(a)
    want = fractional_matrix_power(a + 1e-4 * max(lam, 1e-6) * np.eye(6), -1 / 3).real
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-11)


def test_merge_small_dims_examples():
    assert merge_small_dims([1, 2, 512, 1, 2048, 1, 3, 4], 1024) == [1024, 2048, 12]
    assert merge_small_dims([1, 2, 768, 1, 2048], 1024) == [2, 768, 2048]
    assert merge_small_dims([7, 10], 4096) == [70]
    assert merge_small_dims([3, 4, 5], 4096) == [60]
    assert merge_small_dims([3, 4, 5], 12) == [12, 5]
    assert merge_small_dims([1, 1], 4096) == [1]
    assert merge_small_dims([], 4096) == []


def test_shampoo_step_has_graft_norm_over_whole_parameter():
    lr = 0.1
    kwargs = dict(learning_rate=lr, block_size=4, beta1=0.0, nesterov=False,
                  graft_type="ADAGRAD", start_preconditioning_step=0)
    params, grads = _problem({"w": (7, 10)}, 1, seed=2)
    got = emulate_google(kwargs, params, grads)
    g = grads[0]["w"]
    graft = g / (np.abs(g) + 1e-10)
    step = got[0]["w"] - params["w"]
    np.testing.assert_allclose(np.linalg.norm(step), lr * np.linalg.norm(graft), rtol=1e-12)


@pytest.mark.parametrize("version,factor", [("head", 1.0), ("0.3.0", 0.1)])
def test_decoupled_weight_decay_versions(version, factor):
    lr, wd = 0.1, 0.5
    kwargs = dict(learning_rate=lr, block_size=8, beta1=0.0, nesterov=False, graft_type="SGD",
                  weight_decay=wd, decoupled_weight_decay=True, start_preconditioning_step=99)
    params, grads = _problem({"v": (5,)}, 1, seed=4)
    got = emulate_google(kwargs, params, grads, version=version)
    x, g = params["v"], grads[0]["v"]
    # head: -lr*(g + wd*x); 0.3.0: -lr*(g + lr*wd*x)
    np.testing.assert_allclose(got[0]["v"], x - lr * (g + factor * wd * x), rtol=1e-14)


def test_scalar_param_is_skipped_and_gets_graft_direction():
    kwargs = dict(learning_rate=0.2, block_size=8, beta1=0.5, graft_type="SGD",
                  start_preconditioning_step=0)
    params, grads = _problem({"s": ()}, 3, seed=9)
    got = emulate_google(kwargs, params, grads)
    x, m = params["s"].copy(), 0.0
    for t, g in enumerate(grads):
        d = g["s"]
        m = 0.5 * m + d
        x = x - 0.2 * (d + 0.5 * m)
        np.testing.assert_allclose(got[t]["s"], x, rtol=1e-14)


def test_unsupported_options_raise():
    p, g = _problem({"v": (3,)}, 1)
    with pytest.raises(NotImplementedError):
        emulate_google(dict(learning_rate=0.1, block_size=8,
                            best_effort_memory_usage_reduction=True), p, g)
    with pytest.raises(NotImplementedError):
        emulate_google(dict(learning_rate=0.1, block_size=8, batch_axis_name="batch"), p, g)
    with pytest.raises(ValueError):
        emulate_google(dict(learning_rate=0.1, block_size=8, average_grad=True), p, g)
