"""Tearfree's Sketchy (docs/spec.md eqs. 6c, 10e) against closed forms and an
independent transcription of tearfree's own algorithm.

- With rank >= n and beta2 = 1 nothing escapes the sketch: after t steps X is
  the pseudo-inverse root of S = sum_s G_s G_s^T with eps added on its range,
  ``(S + eps)^(-1/p)`` there and 0 on its null space (eps = epsilon sigma_1(S)
  when relative).
- With rank < n, beta2 < 1 and every step a root step, the reference's
  direction equals a NumPy transcription of ``sketchy._update_axis`` and
  ``_precondition`` (QR then SVD of ``[sqrt(beta2) U diag(s), G_(k)]``, the
  tail decayed by sqrt(beta2)), a different algorithm for the same numbers.
- ``update_freq``: steps between updates reuse the last sketch's X.

Tolerances: 1e3 u relative (u = 2^-53), as tests/test_frequent_directions.py:
an SVD and an eigendecomposition of well-separated spectra agree to about
u ||M||, and the sums over a few steps, the root and n <= 12 add small factors.
"""

from __future__ import annotations

import numpy as np
import pytest

import shampoo_spec as ss
from shampoo_reference.roots.sketch import Sketch, tearfree_sketch_root

from .helpers import directions

U = 2.0**-53
TOL = 1e3 * U


def _config(rank: int, *, beta2: float = 1.0, epsilon: float = 1e-3, relative: bool = True,
            freq: int = 1) -> ss.ShampooConfig:
    """Both dims of a matrix sketched (root p = 4, as tearfree's 2-d tensors), no graft,
    no momentum, learning rate 1: the direction is the preconditioned gradient itself."""
    return ss.ShampooConfig(
        learning_rate=1.0,
        statistics=ss.StatisticsConfig(beta2=beta2),
        epsilon=ss.EpsilonConfig(value=epsilon, scale="relative" if relative else "absolute"),
        frequent_directions=ss.FrequentDirectionsConfig(rank=rank, rule="tearfree"),
        exponents=ss.ExponentConfig(default="preconditioned_dims"),
        grafting=ss.GraftingConfig(type="none"),
        momentum=ss.MomentumConfig(momentum=0.0),
        blocking=ss.BlockingConfig(max_preconditioner_dim=1024, merge_dims_up_to=None),
        schedule=ss.ScheduleConfig(precondition_frequency=freq, statistics_frequency=freq,
                                   period_anchor="start", roots_before_start=True),
        factor_dtype="float64",
    )


def _pinv_root(s: np.ndarray, p: float, epsilon: float) -> np.ndarray:
    """``(S + eps)^(-1/p)`` on the range of S, 0 on its null space (eps relative)."""
    w, q = np.linalg.eigh(s)
    eps = epsilon * w[-1]
    keep = w > 1e-12 * w[-1]
    x = np.where(keep, (np.where(keep, w, 1.0) + eps) ** (-1.0 / p), 0.0)
    return (q * x) @ q.T


@pytest.mark.parametrize("shape", [(5, 3), (4, 7)])
def test_full_rank_sum_is_the_pseudo_inverse_root_plus_eps(shape: tuple[int, int]) -> None:
    """rank >= n, beta2 = 1: X_k is the pseudo-inverse root of sum G_(k) G_(k)^T with eps
    on its range (eq. 10e with cut = 0, rho = 0)."""
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(shape) for _ in range(2)]  # a rank-deficient S at step 1
    epsilon = 1e-3
    got = directions(_config(rank=16, epsilon=epsilon), grads)
    left, right = np.zeros((shape[0],) * 2), np.zeros((shape[1],) * 2)
    for g, d in zip(grads, got, strict=True):
        left += g @ g.T
        right += g.T @ g
        want = _pinv_root(left, 4, epsilon) @ g @ _pinv_root(right, 4, epsilon)
        np.testing.assert_allclose(d, want, rtol=0, atol=TOL * np.abs(want).max())


def _tearfree_axis(u_s: tuple[np.ndarray, np.ndarray, float], g: np.ndarray, k: int,
                   beta: float, epsilon: float, relative: bool, ndim: int
                   ) -> tuple[tuple[np.ndarray, np.ndarray, float], np.ndarray, float]:
    """NumPy transcription of tearfree's ``sketchy._update_axis`` (no ekfac, no linear tail):
    ((eigvecs, eigvals, tail), inv_eigvals, inv_tail) from the axis state and G_(k)."""
    eigvecs, eigvals, tail = u_s
    d = g.shape[0]
    decay = np.sqrt(beta)
    updated = np.concatenate([eigvecs * eigvals[None, :] * decay, g], axis=1)
    updated = np.linalg.qr(updated.T, mode="r").T
    u, s, _ = np.linalg.svd(updated, full_matrices=False)
    cutoff = max(s[k], 0.0) if k < len(s) else 0.0
    top = np.maximum(s[:k], 0.0)
    deflated = np.sqrt(np.maximum(0.0, top - cutoff)) * np.sqrt(top + cutoff)
    new_tail = tail * decay + cutoff**2
    undeflated = np.square(top) + tail * decay
    mask = deflated > 0
    vecs = u[:, :k] * mask
    alpha = -1.0 / (2 * ndim)
    eps = np.max(undeflated) * epsilon if relative and epsilon > 0 else epsilon
    inv = np.where(mask, (undeflated + eps) ** alpha, 0.0)
    inv_tail = (new_tail + eps) ** alpha if new_tail > 0 else 0.0
    assert vecs.shape == (d, k)
    return (vecs, deflated * mask, new_tail), inv, inv_tail


def _tearfreedirections(grads: list[np.ndarray], rank: int, beta: float, epsilon: float,
                         relative: bool, freq: int) -> list[np.ndarray]:
    """Tearfree's ``_update`` + ``_precondition`` on one matrix (0-based count)."""
    shape = grads[0].shape
    ks = [min(d, rank) for d in shape]
    axes = [((np.zeros((d, k)), np.zeros(k), 0.0), np.zeros(k), 0.0)
            for d, k in zip(shape, ks, strict=True)]
    out = []
    for count, g in enumerate(grads):
        if count % freq == 0:
            axes = [_tearfree_axis(a[0], (g if i == 0 else g.T), ks[i], beta, epsilon, relative, 2)
                    for i, a in enumerate(axes)]
        x = []
        for (vecs, _, _), inv, inv_tail in axes:
            x.append((vecs * (inv - inv_tail)) @ vecs.T + inv_tail * np.eye(vecs.shape[0]))
        out.append(x[0] @ g @ x[1])
    return out


@pytest.mark.parametrize(("rank", "beta2", "epsilon", "relative", "freq"), [
    (3, 0.9, 1e-3, True, 1),      # both dims deflated, an EMA (tail decayed by sqrt(0.9))
    (3, 0.9, 1e-2, False, 1),     # absolute epsilon
    (2, 1.0, 1e-4, True, 1),      # a sum
    (3, 0.8, 1e-3, True, 3),      # update_freq 3: updates at counts 0, 3, 6
    (5, 0.95, 0.0, True, 1),      # epsilon 0 (then also the absolute rule)
    # rank 8 >= 6: the 6-dim undeflated (k = n, no tail); the first step's 11 x 11 M
    # has rank 6 < k = 8. Every step a root step: each gradient lies in the range of
    # its M, where tearfree's SVD noise values (exact zeros here) do not act. (With
    # update_freq > 1 a later gradient leaves that range, and tearfree's float result
    # then depends on which noise directions its SVD ranks in the top k: docs/spec.md
    # eq. 10e.)
    (8, 0.9, 1e-3, True, 1),
])
def test_matches_a_transcription_of_tearfree(rank: int, beta2: float, epsilon: float,
                                             relative: bool, freq: int) -> None:
    rng = np.random.default_rng(rank + int(10 * beta2))
    grads = [rng.standard_normal((6, 11)) for _ in range(8)]
    got = directions(_config(rank, beta2=beta2, epsilon=epsilon, relative=relative,
                              freq=freq), grads)
    want = _tearfreedirections(grads, rank, beta2, epsilon, relative, freq)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        err = np.abs(a - b).max() / np.abs(b).max()
        assert err <= TOL, f"step {step + 1}: {err:.1e}"


def test_tail_decays_by_sqrt_beta2() -> None:
    """Eq. (10e): rho' = sqrt(beta2) rho + sigma_{k+1}; with a zero observation the values
    decay by beta2 and the tail by sqrt(beta2) (tearfree's rule)."""
    n, k, beta = 4, 2, 0.81
    sketch = Sketch(np.eye(n)[:, :k], np.array([3.0, 2.0]), 5.0)
    new, x = tearfree_sketch_root(sketch, np.zeros((n, n)), 2.0, beta, 0.0, False, 0.0)
    np.testing.assert_allclose(new.lam, beta * np.array([3.0, 2.0]), rtol=4 * U)
    assert new.rho == pytest.approx(0.9 * 5.0, rel=4 * U)
    # X: (sigma_i + sqrt(beta) rho)^(-1/2) on the kept directions, rho'^(-1/2) elsewhere.
    want = np.diag([(beta * 3 + 4.5) ** -0.5, (beta * 2 + 4.5) ** -0.5, 4.5**-0.5, 4.5**-0.5])
    np.testing.assert_allclose(x, want, rtol=0, atol=8 * U)


def test_config_rules() -> None:
    fd = ss.FrequentDirectionsConfig(rank=4, rule="tearfree")
    assert fd.compresses(2) and fd.sketch_rank(2) == 2 and fd.sketch_rank(9) == 4
    google = ss.FrequentDirectionsConfig(rank=4)
    assert not google.compresses(6) and google.sketch_rank(2) == 4
    with pytest.raises(ValueError, match="reset_every"):
        ss.FrequentDirectionsConfig(rank=4, rule="tearfree", reset_every=3)
    with pytest.raises(ValueError, match="average_gradients"):
        ss.FrequentDirectionsConfig(rank=4, rule="tearfree", average_gradients=True)
    with pytest.raises(ValueError, match="rule"):
        ss.FrequentDirectionsConfig(rank=4, rule="sketchy")  # type: ignore[arg-type]
