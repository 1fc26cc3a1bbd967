"""Eigenbases and corrected eigenvalues stored in their dtypes (docs/spec.md eq. 17a).

The reference is the oracle, so its rounding is checked independently: the
stored eigenbases against the unrounded ones of the same run (the factors do
not depend on Q_k or D, so both runs have the same float64 factors and the
comparison is exact); D and the direction of two steps against eq. (17a)
written out with NumPy's float32 and float16 arithmetic (an operation on
float32 numbers correctly rounded, as IEEE requires; float16 computed in
float32 and rounded, as torch does), not with the reference's ``round_to``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import shampoo_spec as ss
from shampoo_reference import ReferenceShampoo, round_to
from shampoo_reference.roots.basis import basis_still_fits

ROUNDED = ("float32", "bfloat16", "float16")

BASE = ss.ShampooConfig(
    learning_rate=0.1,
    epsilon=ss.EpsilonConfig(value=1e-3),
    blocking=ss.BlockingConfig(merge_dims_up_to=None, max_preconditioner_dim=6),
    grafting=ss.GraftingConfig(type="adagrad"),
    statistics=ss.StatisticsConfig(beta2=0.9, bias_correction=True),
    # epsilon 1e-4: float16 holds it (its smallest positive is 2^-24, eq. 17a's validation).
    eigenvalue_correction=ss.EigenvalueCorrectionConfig(beta2=0.95, epsilon=1e-4),
    factor_dtype="float64",
)
SHAPES = {"w": (7, 10), "t": (3, 4, 5), "v": (12,)}


def _with(config: ss.ShampooConfig, **dtypes: str | None) -> ss.ShampooConfig:
    ec = config.eigenvalue_correction
    assert ec is not None
    return dataclasses.replace(config, eigenvalue_correction=dataclasses.replace(ec, **dtypes))


def _stream(steps: int, seed: int = 0) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
    return params, [{k: rng.standard_normal(s) for k, s in SHAPES.items()} for _ in range(steps)]


@pytest.mark.parametrize("dtype", ROUNDED)
def test_stored_eigenbases_are_the_float64_eigenbases_rounded(dtype: str) -> None:
    """Eq. (17a): Q^_k = round_q(Q_k), Q_k the eigenbasis of the same factor in both runs."""
    params, grads = _stream(4)
    exact = ReferenceShampoo(BASE, params)
    rounded = ReferenceShampoo(_with(BASE, eigenvectors_dtype=dtype,
                                     corrected_eigenvalues_dtype=dtype), params)
    checked = 0
    for g in grads:
        exact.step(g)
        rounded.step(g)
        for name in SHAPES:
            for a, b in zip(exact.state[name].blocks, rounded.state[name].blocks, strict=True):
                for fa, fb in zip(a.factors, b.factors, strict=True):
                    assert fa is None or (fb is not None and np.array_equal(fa, fb))
                for qa, qb in zip(a.inverse_roots, b.inverse_roots, strict=True):
                    if qa is not None:
                        assert qb is not None and np.array_equal(qb, round_to(qa, dtype))
                        checked += 1
                d = b.corrected_second_moment
                assert d is not None and np.array_equal(d, round_to(d, dtype))  # stored in s
    assert checked > 0
    assert not np.array_equal(exact.params["w"], rounded.params["w"])


def test_none_and_float64_eigenbases_are_todays_reference() -> None:
    """q = None and q = "float64" round nothing: the same trajectory bit for bit;
    s = "float64" follows Meta's order (beta2 D, then + ((1 - beta2) R) R), which
    differs from today's only in float64 rounding."""
    params, grads = _stream(5)
    runs = [ReferenceShampoo(_with(BASE, eigenvectors_dtype=q, corrected_eigenvalues_dtype=s),
                             params)
            for q, s in ((None, None), ("float64", None), (None, "float64"))]
    for g in grads:
        a, b, c = (opt.step(g) for opt in runs)
        for name in SHAPES:
            assert np.array_equal(a[name], b[name])
            np.testing.assert_allclose(c[name], a[name], rtol=1e-13, atol=1e-13)


def _rotate(x: np.ndarray, q1: np.ndarray, q2: np.ndarray, back: bool,
            cast: type) -> np.ndarray:
    """Q1^T X Q2 (into the basis) or Q1 X Q2^T (back), each product rounded by ``cast``."""
    x = x.astype(cast).astype(np.float64)
    if back:
        x = (q1 @ x).astype(cast).astype(np.float64)
        return (x @ q2.T).astype(cast).astype(np.float64)
    x = (q1.T @ x).astype(cast).astype(np.float64)
    return (x @ q2).astype(cast).astype(np.float64)


@pytest.mark.parametrize(("dtype", "cast"), [("float32", np.float32), ("float16", np.float16)])
def test_two_steps_are_eq17a_in_numpy_arithmetic(dtype: str, cast: type) -> None:
    """Eq. (17a) for a matrix block, two steps, no graft: D and W written out.

    float32: NumPy float32 operations (correctly rounded). float16: the
    operation in float32, then the float16 cast (torch's rule for float16
    tensors). Products in float64 ``@`` then cast: a different float64
    summation than the reference's ``tensordot`` could only change a result
    across a rounding boundary of q, probability ~2^-53 / 2^-11 per entry.
    """
    ec = ss.EigenvalueCorrectionConfig(beta2=0.9, epsilon=1e-3, eigenvectors_dtype=dtype,
                                       corrected_eigenvalues_dtype=dtype)  # type: ignore[arg-type]
    config = ss.ShampooConfig(learning_rate=0.5, blocking=ss.BlockingConfig(merge_dims_up_to=None),
                              factor_dtype="float64", eigenvalue_correction=ec)
    rng = np.random.default_rng(3)
    w = rng.standard_normal((7, 10))
    opt = ReferenceShampoo(config, {"w": w})
    f32 = np.float32
    d = np.zeros((7, 10), dtype=cast)
    for t in (1, 2):
        g = rng.standard_normal((7, 10))
        new_w = opt.step({"w": g})["w"]
        q1, q2 = opt.state["w"].blocks[0].inverse_roots
        assert q1 is not None and q2 is not None
        r = _rotate(g, q1, q2, back=False, cast=cast)
        decayed = (d.astype(f32) * f32(0.9)).astype(cast)  # round_s(c_s(beta2) D)
        d = (decayed.astype(np.float64) + ((1.0 - 0.9) * r) * r).astype(cast)
        bc = f32(1.0 - 0.9**t)
        quotient = (d.astype(f32) / bc).astype(cast)
        root = np.sqrt(quotient.astype(f32)).astype(cast)
        den = (root.astype(f32) + f32(1e-3)).astype(cast).astype(np.float64)
        p = _rotate(r / den, q1, q2, back=True, cast=cast)
        stored = opt.state["w"].blocks[0].corrected_second_moment
        assert stored is not None and np.array_equal(stored, d.astype(np.float64))
        assert np.array_equal(new_w, w - 0.5 * p)
        w = new_w


def test_bfloat16_moment_is_eq17a() -> None:
    """bfloat16 through ml_dtypes (JAX's bfloat16; skipped where it is not installed)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = ml_dtypes.bfloat16
    ec = ss.EigenvalueCorrectionConfig(beta2=0.9, epsilon=1e-3,
                                       corrected_eigenvalues_dtype="bfloat16")
    config = ss.ShampooConfig(learning_rate=0.5, blocking=ss.BlockingConfig(merge_dims_up_to=None),
                              factor_dtype="float64", eigenvalue_correction=ec)
    rng = np.random.default_rng(4)
    opt = ReferenceShampoo(config, {"w": rng.standard_normal((6, 5))})
    d = np.zeros((6, 5), dtype=np.float32)
    for _ in range(3):
        g = rng.standard_normal((6, 5))
        opt.step({"w": g})
        q1, q2 = opt.state["w"].blocks[0].inverse_roots
        assert q1 is not None and q2 is not None
        r = q1.T @ g @ q2  # q = None: the rotation unrounded (float64)
        decayed = (d * np.float32(0.9)).astype(bf16).astype(np.float32)
        d = (decayed.astype(np.float64) + (0.1 * r) * r).astype(np.float32).astype(bf16)
        d = d.astype(np.float32)
        stored = opt.state["w"].blocks[0].corrected_second_moment
        assert stored is not None
        np.testing.assert_allclose(stored, d, rtol=0, atol=0)


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="eigenvectors_dtype"):
        ss.EigenvalueCorrectionConfig(eigenvectors_dtype="float8")  # type: ignore[arg-type]


# ------------------------------------------------ eq. (17b): eigenbasis reuse
@pytest.mark.parametrize("theta", [0.01, 0.1, 0.3])
def test_basis_fit_criterion_closed_form(theta: float) -> None:
    """A = diag(3, 1) in a basis rotated by theta: B's off-diagonal entries are
    (3 - 1) sin(theta) cos(theta), so ||off||_F = sqrt(2) |sin(2 theta)| and
    ||B||_F = sqrt(10); the basis fits iff that ratio is <= tolerance."""
    c, s = np.cos(theta), np.sin(theta)
    q = np.array([[c, -s], [s, c]])
    ratio = np.sqrt(2.0) * abs(np.sin(2 * theta)) / np.sqrt(10.0)
    a = np.diag([3.0, 1.0])
    assert basis_still_fits(q, a, 0.0, ratio * (1 + 1e-9))
    assert not basis_still_fits(q, a, 0.0, ratio * (1 - 1e-9))
    # eps I is part of A (Meta's A_ridge): it adds to the norm, not to the off-diagonal.
    ridge = np.sqrt(2.0) * abs(np.sin(2 * theta)) / np.linalg.norm([3.5, 1.5])
    assert basis_still_fits(q, a, 0.5, ridge * (1 + 1e-9))
    assert not basis_still_fits(q, a, 0.5, ridge * (1 - 1e-9))


def test_tolerance_one_keeps_the_identity_basis_adam_in_closed_form() -> None:
    """Eq. (17b) with tolerance 1: ||off|| <= ||B|| always holds, so Q_k stays I and
    eq. (17) is Adam on the block: D = EMA of G^2, P = G / (sqrt(D / bc) + epsilon)."""
    ec = ss.EigenvalueCorrectionConfig(beta2=0.9, epsilon=1e-3, basis_reuse_tolerance=1.0)
    config = ss.ShampooConfig(learning_rate=0.5, blocking=ss.BlockingConfig(merge_dims_up_to=None),
                              factor_dtype="float64", eigenvalue_correction=ec)
    rng = np.random.default_rng(5)
    w = rng.standard_normal((4, 3))
    opt = ReferenceShampoo(config, {"w": w})
    d = np.zeros((4, 3))
    for t in range(1, 6):
        g = rng.standard_normal((4, 3))
        new_w = opt.step({"w": g})["w"]
        d = 0.9 * d + 0.1 * g**2
        p = g / (np.sqrt(d / (1 - 0.9**t)) + 1e-3)
        np.testing.assert_allclose(new_w, w - 0.5 * p, rtol=1e-13, atol=1e-15)
        for q in opt.state["w"].blocks[0].inverse_roots:
            assert q is not None and np.array_equal(q, np.eye(len(q)))
        w = new_w
    assert opt.metrics.root_failures == 0
    # Without reuse the same stream leaves the identity at the first root step.
    fresh = ReferenceShampoo(dataclasses.replace(config, eigenvalue_correction=dataclasses.replace(
        ec, basis_reuse_tolerance=0.0)), {"w": rng.standard_normal((4, 3))})
    fresh.step({"w": rng.standard_normal((4, 3))})
    assert not all(np.array_equal(q, np.eye(len(q)))
                   for q in fresh.state["w"].blocks[0].inverse_roots if q is not None)
