"""Closed-form checks of the Meta DistributedShampoo emulator itself.

Each test writes the expected trajectory directly (plain optimizer formulas or
hand-derived Shampoo special cases) and compares with ``emulate_meta``.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location(
    "meta_emulator", pathlib.Path(__file__).with_name("meta_emulator.py")
)
meta_emulator = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(meta_emulator)
emulate_meta = meta_emulator.emulate_meta
merge_small_dims = meta_emulator.merge_small_dims
multi_dim_split_slices = meta_emulator.multi_dim_split_slices

SHAPES = {"w": (7, 10), "b": (7,), "t": (3, 4, 5), "v": (12,), "s": ()}
NEVER = 10**9  # start_preconditioning_step that is never reached


def _problem(num_steps=5, seed=0, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s) for k, s in shapes.items()}
    grads = [{k: rng.standard_normal(s) for k, s in shapes.items()} for _ in range(num_steps)]
    return params, grads


def _assert_traj(out, expected, rtol=1e-12, atol=1e-13):
    assert len(out) == len(expected)
    for got_t, exp_t in zip(out, expected, strict=False):
        assert set(got_t) == set(exp_t)
        for k in exp_t:
            assert got_t[k].shape == exp_t[k].shape, k
            np.testing.assert_allclose(got_t[k], exp_t[k], rtol=rtol, atol=atol, err_msg=k)


# ---------------------------------------------------------------- shapes


def test_merge_small_dims_examples():
    assert merge_small_dims((1, 2, 5, 1), 10, 1) == (10,)
    assert merge_small_dims((1, 2, 5, 1), 1, 1) == (2, 5)
    assert merge_small_dims((32, 3, 64, 64), 8192, 1) == (96, 4096)
    assert merge_small_dims((32, 3, 64, 64), 1_000_000, 2) == (32, 12288)
    assert merge_small_dims((7, 10), 1024, 1) == (70,)
    assert merge_small_dims((3, 4, 5), 1024, 1) == (60,)
    assert merge_small_dims((3, 4, 5), 8, 1) == (3, 4, 5)
    assert merge_small_dims((3, 4, 5), 20, 1) == (3, 20)
    assert merge_small_dims((), 1024, 1) == (1,)
    assert merge_small_dims((1, 1), 1024, 1) == (1,)
    assert merge_small_dims((4, 0, 3), 1024, 1) == (0,)
    assert merge_small_dims((1, 7, 10), 1024, math.inf) == (1, 7, 10)


def test_multi_dim_split_row_major_remainder_last():
    sl = multi_dim_split_slices((5, 3), 2)
    got = [tuple((s.start, s.stop) for s in b) for b in sl]
    assert got == [
        ((0, 2), (0, 2)),
        ((0, 2), (2, 3)),
        ((2, 4), (0, 2)),
        ((2, 4), (2, 3)),
        ((4, 5), (0, 2)),
        ((4, 5), (2, 3)),
    ]


# ---------------------------------------------------- grafting-only regimes


@pytest.mark.parametrize("beta1", [0.0, 0.9])
def test_adagrad_graft_before_start_is_adagrad(beta1):
    params, grads = _problem()
    lr, eps = 0.03, 1e-10
    kw = {
        "lr": lr,
        "betas": [beta1, 1.0],
        "start_preconditioning_step": NEVER,
        "grafting_config": {"type": "AdaGradPreconditionerConfig", "epsilon": eps},
    }
    out = emulate_meta(kw, params, grads)
    W = {k: v.copy() for k, v in params.items()}
    acc = {k: np.zeros_like(v) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in params.items()}
    exp = []
    for t, g in enumerate(grads, start=1):
        for k in W:
            acc[k] += g[k] ** 2
            m[k] = beta1 * m[k] + (1 - beta1) * g[k]
            d = m[k] / (1 - beta1**t) if beta1 else g[k]
            W[k] = W[k] - lr * d / (np.sqrt(acc[k]) + eps)
        exp.append({k: v.copy() for k, v in W.items()})
    _assert_traj(out, exp)


def test_adam_graft_before_start_is_adam_with_decoupled_wd():
    params, grads = _problem()
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.99, 1e-8, 0.1
    kw = {
        "lr": lr,
        "betas": [b1, 0.5],
        "start_preconditioning_step": NEVER,
        "weight_decay": wd,
        "weight_decay_type": "DECOUPLED",
        "grafting_config": {"type": "AdamPreconditionerConfig", "beta2": b2, "epsilon": eps},
    }
    out = emulate_meta(kw, params, grads)
    W = {k: v.copy() for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v2 = {k: np.zeros_like(v) for k, v in params.items()}
    exp = []
    for t, g in enumerate(grads, start=1):
        for k in W:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v2[k] = b2 * v2[k] + (1 - b2) * g[k] ** 2
            p = (m[k] / (1 - b1**t)) / (np.sqrt(v2[k] / (1 - b2**t)) + eps)
            W[k] = W[k] - lr * (p + wd * W[k])  # AdamW: decay multiplied by lr
        exp.append({k: v.copy() for k, v in W.items()})
    _assert_traj(out, exp)


def test_rmsprop_graft_has_no_bias_correction():
    params, grads = _problem()
    lr, b2, eps = 1e-2, 0.99, 1e-10
    kw = {
        "lr": lr,
        "betas": [0.0, 1.0],
        "start_preconditioning_step": NEVER,
        "grafting_config": {"type": "RMSpropPreconditionerConfig", "beta2": b2, "epsilon": eps},
    }
    out = emulate_meta(kw, params, grads)
    W = {k: v.copy() for k, v in params.items()}
    v2 = {k: np.zeros_like(v) for k, v in params.items()}
    exp = []
    for g in grads:
        for k in W:
            v2[k] = b2 * v2[k] + (1 - b2) * g[k] ** 2
            W[k] = W[k] - lr * g[k] / (np.sqrt(v2[k]) + eps)
        exp.append({k: v.copy() for k, v in W.items()})
    _assert_traj(out, exp)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_graft_momentum_l2_and_beta3_filter(nesterov):
    params, grads = _problem()
    lr, b1, b3, wd, mu, damp = 0.05, 0.8, 0.5, 0.01, 0.9, 0.1
    kw = {
        "lr": lr,
        "betas": [b1, 1.0],
        "beta3": b3,
        "start_preconditioning_step": NEVER,
        "weight_decay": wd,
        "weight_decay_type": "L2",
        "grafting_config": {"type": "SGDPreconditionerConfig"},
        "iterate_averaging_config": {
            "type": "ClassicMomentumConfig",
            "momentum": mu,
            "dampening": damp,
            "use_nesterov": nesterov,
        },
    }
    out = emulate_meta(kw, params, grads)
    W = {k: v.copy() for k, v in params.items()}
    F = {k: np.zeros_like(v) for k, v in params.items()}
    M = {k: np.zeros_like(v) for k, v in params.items()}  # zero-initialised buffer
    exp = []
    for t, g in enumerate(grads, start=1):
        for k in W:
            gk = g[k] + wd * W[k]
            gbar = (b3 * F[k] + (1 - b3) * gk) / (1 - b3 * b1 ** (t - 1))
            F[k] = b1 * F[k] + (1 - b1) * gk
            M[k] = mu * M[k] + (1 - damp) * gbar
            p = (1 - damp) * gbar + mu * M[k] if nesterov else M[k]
            W[k] = W[k] - lr * p
        exp.append({k: v.copy() for k, v in W.items()})
    _assert_traj(out, exp)


def test_no_grafting_before_start_uses_identity_inverse_factors():
    params, grads = _problem(num_steps=3)
    lr = 0.1
    kw = {"lr": lr, "betas": [0.0, 1.0], "precondition_frequency": 4}  # start = 4
    out = emulate_meta(kw, params, grads)
    W = {k: v.copy() for k, v in params.items()}
    exp = []
    for g in grads:
        for k in W:
            W[k] = W[k] - lr * g[k]
        exp.append({k: v.copy() for k, v in W.items()})
    _assert_traj(out, exp)


# ------------------------------------------------------ Shampoo closed forms


def _sym_inv_root(A, p):
    lam, Q = np.linalg.eigh(A)
    return (Q * lam ** (-1.0 / p)) @ Q.T


def test_1d_param_is_full_matrix_adagrad_with_eps_ridge():
    rng = np.random.default_rng(3)
    n, lr, eps = 6, 0.1, 1e-3
    params = {"v": rng.standard_normal(n)}
    grads = [{"v": rng.standard_normal(n)} for _ in range(8)]  # rank < n for t < 6
    kw = {"lr": lr, "betas": [0.0, 1.0], "epsilon": eps}
    out = emulate_meta(kw, params, grads)
    w, L, exp = params["v"].copy(), np.zeros((n, n)), []
    for g in grads:
        L += np.outer(g["v"], g["v"])
        w = w - lr * _sym_inv_root(L + eps * np.eye(n), 2) @ g["v"]
        exp.append({"v": w.copy()})
    _assert_traj(out, exp, rtol=1e-10, atol=1e-12)


def test_0d_param_is_scalar_adagrad_with_eps_inside_sqrt():
    params = {"s": np.array(1.5)}
    gs = [0.3, -2.0, 0.7]
    grads = [{"s": np.array(g)} for g in gs]
    lr, eps = 0.1, 1e-4
    out = emulate_meta({"lr": lr, "betas": [0.0, 1.0], "epsilon": eps}, params, grads)
    w, acc = 1.5, 0.0
    for g, o in zip(gs, out, strict=False):
        acc += g * g
        w -= lr * g / math.sqrt(acc + eps)
        assert o["s"].shape == ()
        assert o["s"] == pytest.approx(w, rel=1e-13)


def _orthogonal_grads(n, cs, seed=5):
    rng = np.random.default_rng(seed)
    out = []
    for c in cs:
        q, _ = np.linalg.qr(rng.standard_normal((n, n)))
        out.append(c * q)
    return out


@pytest.mark.parametrize("amortized", ["EigenConfig", "CoupledNewtonConfig"])
def test_scalar_identity_factors_and_root_schedule(amortized):
    """G_t = c_t Q_t (Q_t orthogonal): L_t = R_t = S_t I with S_t = sum c^2.
    Roots at steps t == start or (t % f == 0 and t > start): f=3, start=5 -> 5, 6, 9.
    Before start (no grafting) the inverse factors are the identity."""
    n, lr, eps = 4, 0.1, 1e-6
    cs = [1.0, 2.0, 0.5, 1.5, 3.0, 0.7, 1.1, 0.4, 2.5, 0.9]
    G = _orthogonal_grads(n, cs)
    params = {"w": np.zeros((n, n))}
    kw = {
        "lr": lr,
        "betas": [0.0, 1.0],
        "epsilon": eps,
        "max_preconditioner_dim": n,
        "precondition_frequency": 3,
        "start_preconditioning_step": 5,
        "preconditioner_config": {
            "type": "RootInvShampooPreconditionerConfig",
            "amortized_computation_config": {"type": amortized},
        },
    }
    out = emulate_meta(kw, params, [{"w": g} for g in G])
    S, scale, w = 0.0, 1.0, np.zeros((n, n))
    for t, (c, g, o) in enumerate(zip(cs, G, out, strict=False), start=1):
        S += c * c
        if t == 5 or (t % 3 == 0 and t > 5):
            scale = (S + eps) ** -0.5  # (S+eps)^(-1/4) on each side
        w = w - lr * scale * g
        tol = 1e-12 if amortized == "EigenConfig" else 1e-5
        np.testing.assert_allclose(o["w"], w, rtol=tol, atol=tol * 1e-2)


def test_exponent_override_and_skipped_dim():
    n, lr, eps = 3, 0.2, 1e-8
    cs = [1.0, 2.0, 0.5]
    G = _orthogonal_grads(n, cs, seed=7)
    params = {"w": np.zeros((n, n))}
    for override, power in [
        ({"2": 0.5}, 1.0),
        ({"2": {"0": 0.0}}, 0.25),
        ({"2": {"1": 0.0, "0": 0.1}}, 0.1),
    ]:
        kw = {
            "lr": lr,
            "betas": [0.0, 1.0],
            "epsilon": eps,
            "max_preconditioner_dim": n,
            "preconditioner_config": {
                "type": "RootInvShampooPreconditionerConfig",
                "inverse_exponent_override": override,
            },
        }
        out = emulate_meta(kw, params, [{"w": g} for g in G])
        S, w = 0.0, np.zeros((n, n))
        for c, g, o in zip(cs, G, out, strict=False):
            S += c * c
            w = w - lr * (S + eps) ** (-power) * g
            np.testing.assert_allclose(o["w"], w, rtol=1e-11, atol=1e-13)


def test_per_block_graft_rescaling_and_ema_bias_correction():
    """2-D block with orthogonal grads, EMA factors (beta2 < 1) with bias
    correction, SGD grafting: Shampoo direction is G/sqrt(S_hat+eps) and is
    rescaled per block to ||G||, i.e. P = G * ||G|| / (||G||/sqrt(S_hat+eps) + 1e-16)."""
    n, lr, eps, b2 = 4, 0.1, 1e-10, 0.9
    cs = [1.0, 2.0, 0.5, 1.5]
    G = _orthogonal_grads(n, cs, seed=11)
    params = {"w": np.zeros((n, n))}
    kw = {
        "lr": lr,
        "betas": [0.0, b2],
        "epsilon": eps,
        "max_preconditioner_dim": n,
        "grafting_config": {"type": "SGDPreconditionerConfig"},
    }
    out = emulate_meta(kw, params, [{"w": g} for g in G])
    S, w = 0.0, np.zeros((n, n))
    for t, (c, g, o) in enumerate(zip(cs, G, out, strict=False), start=1):
        S = b2 * S + (1 - b2) * c * c
        pshamp = g / math.sqrt(S / (1 - b2**t) + eps)
        p = pshamp * np.linalg.norm(g) / (np.linalg.norm(pshamp) + 1e-16)
        w = w - lr * p
        np.testing.assert_allclose(o["w"], w, rtol=1e-11, atol=1e-13)


def test_eigenvalue_corrected_with_diagonal_factors_is_adam():
    """Diagonal gradients G_t = diag(a_t) with |a_t[i]| strictly increasing in i
    keep both factors diagonal with a stable ascending eigenvalue order, so the
    eigenbasis is the identity (up to signs) and EC-Shampoo reduces to Adam on
    the diagonal entries (epsilon outside the root, Shampoo beta2 bias
    correction) while off-diagonal entries stay 0."""
    n, lr, eps, b1, b2 = 4, 0.01, 1e-8, 0.9, 0.95
    rng = np.random.default_rng(2)
    diags = [
        np.sort(rng.uniform(0.1, 1.0, n)) * np.arange(1, n + 1) * rng.choice([-1, 1], n)
        for _ in range(6)
    ]
    params = {"w": np.zeros((n, n))}
    kw = {
        "lr": lr,
        "betas": [b1, b2],
        "epsilon": eps,
        "max_preconditioner_dim": n,
        "preconditioner_config": {"type": "EigenvalueCorrectedShampooPreconditionerConfig"},
    }
    out = emulate_meta(kw, params, [{"w": np.diag(a)} for a in diags])
    m, v, w = np.zeros(n), np.zeros(n), np.zeros(n)
    for t, (a, o) in enumerate(zip(diags, out, strict=False), start=1):
        m = b1 * m + (1 - b1) * a
        v = b2 * v + (1 - b2) * a * a
        w = w - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        np.testing.assert_allclose(o["w"], np.diag(w), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("aliasing", [True, False])
def test_inplace_aliasing_of_filtered_grad_without_bias_correction(aliasing):
    """beta3 == beta1, no bias correction, SGD graft before start: Meta's
    in-place direction ops turn the filtered-gradient state F into the final
    update -lr*(F + wd*W) (decoupled decay)."""
    params, grads = _problem(num_steps=4)
    lr, b1, wd = 0.1, 0.5, 0.2
    kw = {
        "lr": lr,
        "betas": [b1, 1.0],
        "use_bias_correction": False,
        "weight_decay": wd,
        "start_preconditioning_step": NEVER,
        "grafting_config": {"type": "SGDPreconditionerConfig"},
    }
    out = emulate_meta(kw, params, grads, emulate_inplace_aliasing=aliasing)
    W = {k: v.copy() for k, v in params.items()}
    F = {k: np.zeros_like(v) for k, v in params.items()}
    exp = []
    for g in grads:
        for k in W:
            F[k] = b1 * F[k] + (1 - b1) * g[k]
            upd = -lr * (F[k] + wd * W[k])
            W[k] = W[k] + upd
            if aliasing:
                F[k] = upd
        exp.append({k: v.copy() for k, v in W.items()})
    _assert_traj(out, exp)


def test_constructor_checks():
    p, g = _problem(num_steps=1)
    with pytest.raises(ValueError):
        emulate_meta({"precondition_frequency": 5, "start_preconditioning_step": 2}, p, g)
    with pytest.raises(ValueError):
        emulate_meta({"betas": [1.0, 1.0]}, p, g)
    with pytest.raises(ValueError):
        emulate_meta({"epsilon": 0.0}, p, g)
    with pytest.raises(ValueError):
        emulate_meta(
            {"iterate_averaging_config": {"type": "ClassicMomentumConfig", "momentum": 0.0}}, p, g
        )
    with pytest.raises(NotImplementedError):
        emulate_meta(
            {"preconditioner_config": {"type": "SpectralDescentPreconditionerConfig"}}, p, g
        )
