"""Independent checks of the reference: formulas computed a different way.

The reference is the oracle, so it is never checked against itself: each test
here computes the expected parameters from a closed form, an explicit
Kronecker product, scipy's fractional_matrix_power, or a first-order
optimizer written out directly.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg

import shampoo_spec as ss
from shampoo_reference import ReferenceShampoo, run

RTOL = 1e-10  # float64 with condition numbers <= 1e3: kappa * u * steps << 1e-10


def fmp(a: np.ndarray, power: float) -> np.ndarray:
    return np.real(scipy.linalg.fractional_matrix_power(a, power))


def base(**kw: object) -> ss.ShampooConfig:
    defaults: dict[str, object] = dict(
        learning_rate=0.1,
        epsilon=ss.EpsilonConfig(value=1e-3),
        blocking=ss.BlockingConfig(merge_dims_up_to=None),
    )
    defaults.update(kw)
    return ss.ShampooConfig(**defaults)  # type: ignore[arg-type]


def stream(shape: tuple[int, ...], steps: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) for _ in range(steps)]


def test_vector_parameter_is_full_matrix_adagrad() -> None:
    """1-d Shampoo: w <- w - lr (sum g g^T + eps I)^(-1/2) g."""
    n, steps, eps, lr = 6, 8, 1e-3, 0.1
    gs = stream((n,), steps)
    w0 = np.ones(n)
    out = run(base(), {"w": w0}, [{"w": g} for g in gs])
    w, acc = w0.copy(), np.zeros((n, n))
    for t, g in enumerate(gs):
        acc += np.outer(g, g)
        w = w - lr * fmp(acc + eps * np.eye(n), -0.5) @ g
        np.testing.assert_allclose(out[t]["w"], w, rtol=RTOL, atol=1e-12)


def test_pseudo_inverse_root_of_rank_deficient_statistics() -> None:
    """Eq. (10) ``"pseudo_inverse"`` (Meta's PseudoInverseConfig, epsilon 0).

    1-d, factors from zero: after t < n steps the factor sum g g^T has rank t;
    the direction is ``U_k S_k^(-1/2) U_k^T g`` over the singular values above
    the cutoff (here by SVD, not eigh), and at step 1 exactly ``g / |g|``.
    """
    n, steps, lr, rtol = 6, 8, 0.1, 1e-9
    gs = stream((n,), steps, seed=5)
    w0 = np.ones(n)
    cfg = base(
        epsilon=ss.EpsilonConfig(value=0.0, placement="pseudo_inverse", rank_rtol=rtol),
        statistics=ss.StatisticsConfig(initial_value="zero"),
        factor_dtype="float64",
    )
    out = run(cfg, {"w": w0}, [{"w": g} for g in gs])
    np.testing.assert_allclose(out[0]["w"], w0 - lr * gs[0] / np.linalg.norm(gs[0]),
                               rtol=RTOL, atol=1e-12)
    w, acc = w0.copy(), np.zeros((n, n))
    for t, g in enumerate(gs):
        acc += np.outer(g, g)
        u, sv, _ = scipy.linalg.svd(acc)
        k = sv > rtol * sv[0]
        assert k.sum() == min(t + 1, n)
        w = w - lr * (u[:, k] * sv[k] ** -0.5) @ u[:, k].T @ g
        np.testing.assert_allclose(out[t]["w"], w, rtol=RTOL, atol=1e-12)


@pytest.mark.parametrize("frequency", [1, 3])
def test_roots_taking_effect_next_step_use_the_previous_root_steps_statistics(
    frequency: int,
) -> None:
    """Eq. (8) ``roots_take_effect="next_step"`` (Google's shard_optimizer_states).

    1-d, Google's schedule (roots at t = 1, f + 1, ...): the direction at step
    t is X g_t with X the root of the statistics through the last root step
    *before* t (the identity before any), not through t itself.
    """
    n, steps, eps, lr = 5, 9, 1e-3, 0.1
    gs = stream((n,), steps, seed=3)
    w0 = np.ones(n)
    schedule = ss.ScheduleConfig(
        precondition_frequency=frequency, period_anchor="start", roots_before_start=True,
        roots_take_effect="next_step",
    )
    out = run(base(schedule=schedule), {"w": w0}, [{"w": g} for g in gs])
    w, acc, root = w0.copy(), np.zeros((n, n)), np.eye(n)
    for t, g in enumerate(gs, start=1):
        acc += np.outer(g, g)
        w = w - lr * root @ g
        if (t - 1) % frequency == 0:
            root = fmp(acc + eps * np.eye(n), -0.5)
        np.testing.assert_allclose(out[t - 1]["w"], w, rtol=RTOL, atol=1e-12)


@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 4)])
def test_tensor_update_is_the_explicit_kronecker_formula(shape: tuple[int, ...]) -> None:
    """Order-k block: vec(P) = (L_1^(1/k) kron ... kron L_k^(1/k))^(-1/2) vec(G).

    Row-major vec: vec(A X B^T) = (A kron B) vec(X). With root 2k per factor,
    L_1^(-1/2k) kron ... = (kron of L_i^(1/k))^(-1/2).
    """
    eps, lr, steps = 1e-3, 0.1, 3
    gs = stream(shape, steps, seed=1)
    out = run(base(), {"w": np.zeros(shape)}, [{"w": g} for g in gs])
    k = len(shape)
    factors = [np.zeros((n, n)) for n in shape]
    w = np.zeros(shape)
    for t, g in enumerate(gs):
        for i in range(k):
            m = np.moveaxis(g, i, 0).reshape(shape[i], -1)
            factors[i] += m @ m.T
        big = np.ones((1, 1))
        for i in range(k):
            big = np.kron(big, fmp(factors[i] + eps * np.eye(shape[i]), 1.0 / k))
        w = w - lr * (fmp(big, -0.5) @ g.ravel()).reshape(shape)
        np.testing.assert_allclose(out[t]["w"], w, rtol=RTOL, atol=1e-12)


def orthogonal(n: int, seed: int) -> np.ndarray:
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((n, n)))
    return q


def test_scalar_factors_closed_form_sum() -> None:
    """G = c Q, Q orthogonal: L = R = t c^2 I, so P_t = G / sqrt(t c^2 + eps)."""
    n, c, eps, lr = 5, 0.7, 1e-3, 0.1
    g = c * orthogonal(n, 0)
    out = run(base(), {"w": np.zeros((n, n))}, [{"w": g}] * 6)
    for t in range(1, 7):
        expected = -lr * g * sum(1 / np.sqrt(s * c * c + eps) for s in range(1, t + 1))
        np.testing.assert_allclose(out[t - 1]["w"], expected, rtol=RTOL)


def test_scalar_factors_closed_form_ema_with_bias_correction() -> None:
    """EMA with bias correction: L_t / (1 - b^t) = c^2 I exactly, so P = G / sqrt(c^2 + eps)."""
    n, c, eps, lr, b = 4, 1.3, 1e-3, 0.1, 0.9
    g = c * orthogonal(n, 1)
    cfg = base(statistics=ss.StatisticsConfig(beta2=b, bias_correction=True))
    out = run(cfg, {"w": np.zeros((n, n))}, [{"w": g}] * 5)
    for t in range(1, 6):
        np.testing.assert_allclose(out[t - 1]["w"], -lr * t * g / np.sqrt(c * c + eps), rtol=RTOL)
    # Without bias correction: L_t = (1 - b^t) c^2 I.
    ema = base(statistics=ss.StatisticsConfig(beta2=b))
    raw = run(ema, {"w": np.zeros((n, n))}, [{"w": g}] * 3)
    expected = -lr * g * sum(1 / np.sqrt((1 - b**s) * c * c + eps) for s in range(1, 4))
    np.testing.assert_allclose(raw[2]["w"], expected, rtol=RTOL)


def test_graft_rescale_closed_form_per_block_and_per_parameter() -> None:
    """Shampoo direction rescaled to the AdaGrad graft's norm (eq. 18)."""
    n, c, eps, lr, geps = 4, 0.5, 1e-3, 0.1, 1e-10
    g = c * orthogonal(n, 2)
    for scope in ("block", "parameter"):
        cfg = base(grafting=ss.GraftingConfig(type="adagrad", epsilon=geps, norm_scope=scope))
        out = run(cfg, {"w": np.zeros((n, n))}, [{"w": g}] * 3)
        w = np.zeros((n, n))
        for t in range(1, 4):
            graft = g / (np.sqrt(t * g * g) + geps)
            p = g / np.sqrt(t * c * c + eps)
            w = w - lr * p * np.linalg.norm(graft) / (np.linalg.norm(p) + 1e-16)
        np.testing.assert_allclose(out[2]["w"], w, rtol=RTOL)


def test_blocked_parameter_rescales_each_block_separately() -> None:
    """Two 2x2 blocks of a 2x4 parameter: each block equals its own 2x2 run."""
    gs = stream((2, 4), 4, seed=3)
    cfg = base(
        blocking=ss.BlockingConfig(max_preconditioner_dim=2, merge_dims_up_to=None),
        grafting=ss.GraftingConfig(type="adagrad"),
    )
    whole = run(cfg, {"w": np.zeros((2, 4))}, [{"w": g} for g in gs])[-1]["w"]
    left = run(cfg, {"w": np.zeros((2, 2))}, [{"w": g[:, :2]} for g in gs])[-1]["w"]
    right = run(cfg, {"w": np.zeros((2, 2))}, [{"w": g[:, 2:]} for g in gs])[-1]["w"]
    np.testing.assert_allclose(whole, np.concatenate([left, right], axis=1), rtol=1e-13)


# ------------------------------------------------------------------ never start
NEVER = ss.ScheduleConfig(start_preconditioning_step=None)


def _first_order(kind: str, gs: list[np.ndarray], w0: np.ndarray, lr: float) -> list[np.ndarray]:
    """SGD / AdaGrad / RMSProp / Adam written out directly."""
    w, v, m = w0.copy(), np.zeros_like(w0), np.zeros_like(w0)
    out = []
    for t, g in enumerate(gs, start=1):
        if kind == "sgd":
            step = g
        elif kind == "adagrad":
            v += g * g
            step = g / (np.sqrt(v) + 1e-10)
        elif kind == "rmsprop":
            v = 0.99 * v + 0.01 * g * g
            step = g / (np.sqrt(v) + 1e-8)
        elif kind == "adam":
            m = 0.9 * m + 0.1 * g
            v = 0.999 * v + 0.001 * g * g
            step = (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
        elif kind == "sgd_nesterov":
            m = 0.9 * m + g
            step = g + 0.9 * m
        else:
            raise AssertionError(kind)
        w = w - lr * step
        out.append(w)
    return out


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rmsprop", "adam", "sgd_nesterov"])
def test_never_starting_equals_the_grafting_optimizer(kind: str) -> None:
    graft = {
        "sgd": ss.GraftingConfig(type="sgd"),
        "sgd_nesterov": ss.GraftingConfig(type="sgd"),
        "adagrad": ss.GraftingConfig(type="adagrad", epsilon=1e-10),
        "rmsprop": ss.GraftingConfig(type="rmsprop", beta2=0.99, epsilon=1e-8),
        "adam": ss.GraftingConfig(type="adam", beta2=0.999, epsilon=1e-8, bias_correction=True),
    }[kind]
    filt = ss.GradientFilterConfig(beta1=0.9, bias_correction=True) if kind == "adam" else (
        ss.GradientFilterConfig()
    )
    mom = ss.MomentumConfig(momentum=0.9, nesterov=True) if kind == "sgd_nesterov" else (
        ss.MomentumConfig()
    )
    cfg = base(schedule=NEVER, grafting=graft, gradient_filter=filt, momentum=mom)
    gs = stream((3, 5), 10, seed=4)
    w0 = np.random.default_rng(5).standard_normal((3, 5))
    out = run(cfg, {"w": w0}, [{"w": g} for g in gs])
    for got, want in zip(out, _first_order(kind, gs, w0, 0.1), strict=True):
        np.testing.assert_allclose(got["w"], want, rtol=1e-12)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rmsprop", "adam", "sgd_nesterov"])
def test_diagonal_preconditioner_is_its_method_from_step_one(kind: str) -> None:
    """Eq. (16b) without a graft: the same methods, from step 1, in any blocking."""
    diagonal = {
        "sgd": ss.DiagonalPreconditionerConfig(type="sgd"),
        "sgd_nesterov": ss.DiagonalPreconditionerConfig(type="sgd"),
        "adagrad": ss.DiagonalPreconditionerConfig(type="adagrad", epsilon=1e-10),
        "rmsprop": ss.DiagonalPreconditionerConfig(type="rmsprop", beta2=0.99, epsilon=1e-8),
        "adam": ss.DiagonalPreconditionerConfig(type="adam", beta2=0.999, epsilon=1e-8,
                                                bias_correction=True),
    }[kind]
    filt = ss.GradientFilterConfig(beta1=0.9, bias_correction=True) if kind == "adam" else (
        ss.GradientFilterConfig()
    )
    mom = ss.MomentumConfig(momentum=0.9, nesterov=True) if kind == "sgd_nesterov" else (
        ss.MomentumConfig()
    )
    cfg = base(diagonal=diagonal, gradient_filter=filt, momentum=mom,
               blocking=ss.BlockingConfig(max_preconditioner_dim=2))
    gs = stream((3, 5), 10, seed=4)
    w0 = np.random.default_rng(5).standard_normal((3, 5))
    out = run(cfg, {"w": w0}, [{"w": g} for g in gs])
    for got, want in zip(out, _first_order(kind, gs, w0, 0.1), strict=True):
        np.testing.assert_allclose(got["w"], want, rtol=1e-12)


def test_diagonal_preconditioner_rescaled_per_block_to_the_graft() -> None:
    """Eq. (16b) with an SGD graft (eq. 18 per block): AdaGrad's direction on each
    block, with the norm of that block's gradient; the graft alone before the start."""
    gs = stream((2, 4), 5, seed=6)
    cfg = base(diagonal=ss.DiagonalPreconditionerConfig(type="adagrad"),
               grafting=ss.GraftingConfig(type="sgd"),
               blocking=ss.BlockingConfig(max_preconditioner_dim=2, merge_dims_up_to=None),
               schedule=ss.ScheduleConfig(start_preconditioning_step=3))
    out = run(cfg, {"w": np.zeros((2, 4))}, [{"w": g} for g in gs])
    w, v = np.zeros((2, 4)), np.zeros((2, 4))
    for t, g in enumerate(gs, start=1):
        v = v + g * g
        d = g / (np.sqrt(v) + 1e-10)
        p = g.copy()
        if t >= 3:
            for cols in (slice(0, 2), slice(2, 4)):
                p[:, cols] = d[:, cols] * np.linalg.norm(g[:, cols]) / (
                    np.linalg.norm(d[:, cols]) + 1e-16)
        w = w - 0.1 * p
        np.testing.assert_allclose(out[t - 1]["w"], w, rtol=1e-13)


def test_decoupled_weight_decay_and_l2_closed_form() -> None:
    """SGD graft, never start: 'direction' decay is w <- w - lr (g + wd w); 'l2' the same."""
    gs = stream((4,), 5, seed=6)
    w0 = np.ones(4)
    for kind in ("l2", "direction", "update"):
        cfg = base(
            schedule=NEVER,
            grafting=ss.GraftingConfig(type="sgd"),
            weight_decay=ss.WeightDecayConfig(value=0.01, type=kind),  # type: ignore[arg-type]
        )
        w = w0.copy()
        out = run(cfg, {"w": w0}, [{"w": g} for g in gs])
        for t, g in enumerate(gs):
            w = w - 0.1 * (g + 0.01 * w)
            np.testing.assert_allclose(out[t]["w"], w, rtol=1e-13)


def test_corrected_weight_decay_follows_the_learning_rate() -> None:
    """Eq. (19) with ``scale_by_lr_ratio`` (Meta's CORRECTED) under a schedule:
    ``w <- w - lr_t (g + wd (lr_t / lr_0) w)``, lr_0 the config's rate; the plain
    'direction' decay keeps wd whatever the rate."""
    gs = stream((4,), 6, seed=7)
    w0 = np.ones(4)
    rates = [0.1, 0.05, 0.2, 0.1, 0.025, 0.0]
    for scaled in (True, False):
        cfg = base(
            schedule=NEVER,
            grafting=ss.GraftingConfig(type="sgd"),
            weight_decay=ss.WeightDecayConfig(value=0.01, scale_by_lr_ratio=scaled),
        )
        out = run(cfg, {"w": w0}, [{"w": g} for g in gs], rates)
        w = w0.copy()
        for t, (g, lr) in enumerate(zip(gs, rates, strict=True)):
            decay = 0.01 * lr / 0.1 if scaled else 0.01
            w = w - lr * (g + decay * w)
            np.testing.assert_allclose(out[t]["w"], w, rtol=1e-13)


def test_nonfinite_gradient_policy() -> None:
    cfg = base(failure=ss.FailureConfig(nonfinite_gradient="skip_block"),
               grafting=ss.GraftingConfig(type="adagrad"))
    opt = ReferenceShampoo(cfg, {"w": np.ones((2, 2))})
    g = np.ones((2, 2))
    opt.step({"w": g})
    before = opt.params["w"].copy()
    factors = [f.copy() for f in opt.state["w"].blocks[0].factors if f is not None]
    bad = g.copy()
    bad[0, 0] = np.nan
    after = opt.step({"w": bad})["w"]
    np.testing.assert_array_equal(after, before)
    for old, new in zip(factors, opt.state["w"].blocks[0].factors, strict=True):
        np.testing.assert_array_equal(old, new)
    assert opt.metrics.skipped_blocks == 1
    strict = ReferenceShampoo(base(), {"w": np.ones(2)})
    with pytest.raises(FloatingPointError, match="'w'"):
        strict.step({"w": np.array([np.inf, 1.0])})


def test_eigenvalue_correction_roots_by_order_apply_to_their_order_only() -> None:
    """Eq. (17) with ``roots_by_order``: a 1-d block uses its order's root, a 2-d block
    the default; each equals the run with that root for every order."""
    rng = np.random.default_rng(5)
    params = {"v": rng.standard_normal(6), "m": rng.standard_normal((3, 4))}
    grads = [{k: rng.standard_normal(x.shape) for k, x in params.items()} for _ in range(6)]

    def corrected(ec: ss.EigenvalueCorrectionConfig) -> list[dict[str, np.ndarray]]:
        config = ss.ShampooConfig(
            learning_rate=0.1, epsilon=ss.EpsilonConfig(value=1e-3), eigenvalue_correction=ec,
            blocking=ss.BlockingConfig(merge_dims_up_to=None),
        )
        return run(config, params, grads)

    mixed = corrected(ss.EigenvalueCorrectionConfig(roots_by_order=((1, 4.0),)))
    all4 = corrected(ss.EigenvalueCorrectionConfig(root=4.0))
    all2 = corrected(ss.EigenvalueCorrectionConfig())
    assert np.array_equal(mixed[-1]["v"], all4[-1]["v"])
    assert np.array_equal(mixed[-1]["m"], all2[-1]["m"])
    assert not np.allclose(mixed[-1]["v"], all2[-1]["v"])


@pytest.mark.parametrize("c", [0.05, 0.5, 100.0])
def test_never_starting_clipped_rmsprop_is_written_out(c: float) -> None:
    """Eq. (14d): u = g / (sqrt(v) + eps), divided by max(1, (||u|| / sqrt(n)) / c)."""
    graft = ss.GraftingConfig(type="rmsprop", beta2=0.9, epsilon=1e-8, clip_rms=c)
    gs = stream((3, 5), 10, seed=6)
    w0 = np.random.default_rng(7).standard_normal((3, 5))
    lrs = [0.1 * 0.9**t for t in range(10)]  # a per-step learning rate (eq. 21)
    out = run(base(schedule=NEVER, grafting=graft), {"w": w0}, [{"w": g} for g in gs], lrs)
    w, v, clipped = w0.copy(), np.zeros_like(w0), 0
    for got, g, lr in zip(out, gs, lrs, strict=True):
        v = 0.9 * v + 0.1 * g * g
        u = g / (np.sqrt(v) + 1e-8)
        rms = float(np.sqrt(np.sum(u * u) / u.size))
        clipped += rms > c
        w = w - lr * u / max(1.0, rms / c)
        np.testing.assert_allclose(got["w"], w, rtol=1e-12)
    # 0.05 clips every step, 100 none (rms of an RMSProp step is about 1-3 here).
    assert clipped == {0.05: 10, 0.5: 10, 100.0: 0}[c]


def test_root_steps_follow_the_learning_rate() -> None:
    """Eq. (8b): the inverse roots change exactly on the steps the spec names."""
    schedule = ss.ScheduleConfig(precondition_frequency=10, precondition_frequency_growth=25,
                                 period_anchor="start", roots_before_start=True,
                                 start_preconditioning_step=1)
    cfg = base(schedule=schedule)
    steps = 70
    lrs = [0.1 * max(1.0 - t / 40, 0.0) for t in range(steps)]  # lr_1 = 0.1, linear decay
    opt = ReferenceShampoo(cfg, {"w": np.ones((4, 3))})
    changed = []
    for t, (g, lr) in enumerate(zip(stream((4, 3), steps, seed=8), lrs, strict=True), start=1):
        before = [x.copy() for x in opt.state["w"].blocks[0].inverse_roots if x is not None]
        opt.step({"w": g}, lr)
        after = [x for x in opt.state["w"].blocks[0].inverse_roots if x is not None]
        if any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True)):
            changed.append(t)
    expected = [t for t in range(1, steps + 1)
                if ss.is_root_step(t, schedule, ss.learning_rate_ratio(lrs[t - 1], lrs[0]))]
    # Periods 10, 10, 20, then 30 once the rate has decayed: not a constant frequency.
    assert changed == expected == [1, 11, 21, 61]
    # Without a learning rate per step, lr_t = lr_1 = config.learning_rate (ratio 1).
    constant = ReferenceShampoo(cfg, {"w": np.ones((4, 3))})
    for g in stream((4, 3), 3, seed=8):
        constant.step({"w": g})
    assert constant.first_learning_rate == constant.learning_rate == 0.1
