"""Inverse roots stored in ``inverse_root_dtype`` (docs/spec.md eqs. 11a, 13, 16).

The reference is the oracle, so its rounding is checked independently:
``round_to`` against NumPy's own casts and, for bfloat16, against
``ml_dtypes`` (the conversion JAX uses; skipped where it is not installed)
and hand-made ties; the stored roots against the unrounded roots of the same
run (the factors do not depend on the roots, so with and without rounding
they are the same float64 numbers and the comparison is exact); a direction
against eq. (16) written out with NumPy matrix products.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import shampoo_spec as ss
from shampoo_reference import ReferenceShampoo, round_to
from shampoo_reference.rounding import round_to_bfloat16

ROUNDED = ("float32", "bfloat16", "float16")

#: Significant bits of each dtype (the ulp of 1 is 2^(1 - bits)).
BITS = {"float32": 24, "bfloat16": 8, "float16": 11}


def _samples() -> np.ndarray:
    """Values over many binades, both signs, and the special values."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(20_000) * np.exp2(rng.integers(-30, 30, 20_000))
    special = [0.0, -0.0, np.inf, -np.inf, 1e-45, 1e-40, 6e-8, 65504.0, 65520.0, 3.4e38, 1e39]
    return np.concatenate([x, special, [-v for v in special]])


# ------------------------------------------------------------------ round_s, eq. (11a)
def test_float64_is_not_rounded() -> None:
    x = _samples()
    assert np.array_equal(round_to(x, "float64"), x)


def test_float32_is_numpys_correctly_rounded_cast() -> None:
    x = _samples()
    with np.errstate(over="ignore"):
        assert np.array_equal(round_to(x, "float32"), x.astype(np.float32).astype(np.float64))


def test_float16_goes_through_float32() -> None:
    x = _samples()
    with np.errstate(over="ignore"):
        want = x.astype(np.float32).astype(np.float16).astype(np.float64)
    assert np.array_equal(round_to(x, "float16"), want)
    # Overflow to inf above 65504 (65520 is the tie with the next, inf), subnormals kept.
    assert round_to(np.array([65519.0, 65520.0]), "float16").tolist() == [65504.0, np.inf]
    assert round_to(np.array([2.0**-24]), "float16")[0] == 2.0**-24


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_two_roundings_as_torch_jax_and_ml_dtypes_convert(dtype: str) -> None:
    """1 + half an ulp + a little: float32 first rounds it onto the tie, which goes to even.

    Rounded once it would go up; every backend (and Meta, through torch's
    ``.to``) converts float64 through float32, so eq. (11a) does too.
    """
    half_ulp = 2.0 ** -BITS[dtype]
    x = np.array([1.0 + half_ulp + 2.0**-30, 1.0 + half_ulp + 2.0**-20])
    assert round_to(x, dtype).tolist() == [1.0, 1.0 + 2 * half_ulp]


def test_bfloat16_ties_go_to_even() -> None:
    ulp = 2.0**-7  # of bfloat16 at 1
    x = np.array([1.0 + ulp / 2, 1.0 + 3 * ulp / 2, -(1.0 + ulp / 2), 1.0 + ulp / 2 + 2.0**-23])
    assert round_to(x, "bfloat16").tolist() == [1.0, 1.0 + 2 * ulp, -1.0, 1.0 + ulp]


def test_bfloat16_range_and_specials() -> None:
    big = float(np.finfo(np.float32).max)  # rounds up out of bfloat16's range
    x = np.array([big, -big, np.inf, np.nan, 0.0, 1e-40])
    out = round_to(x, "bfloat16")
    assert out[:3].tolist() == [np.inf, -np.inf, np.inf]
    assert np.isnan(out[3]) and out[4] == 0.0
    assert out[5] == float(round_to_bfloat16(np.array([1e-40], np.float32))[0]) != 0.0


def test_bfloat16_matches_ml_dtypes() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes (installed with JAX)")
    x = _samples()
    with np.errstate(over="ignore"):
        f32 = x.astype(np.float32)
    want = f32.astype(ml_dtypes.bfloat16).astype(np.float64)
    assert np.array_equal(round_to(x, "bfloat16"), want)
    # Every float32 tie of bfloat16 in [1, 2) and around the top of the range.
    ties = (np.arange(2**7, dtype=np.uint32) << 16) + (np.uint32(0x3F80) << 16) + 0x8000
    top = np.arange(0x7F7F0000, 0x7F7FFFFF, 0x1111, dtype=np.uint32)
    for bits in (ties, top, ties | np.uint32(0x80000000)):
        v = bits.view(np.float32)
        assert np.array_equal(round_to_bfloat16(v), v.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="float8"):
        round_to(np.ones(2), "float8")


# ------------------------------------------------------ the optimizer, eqs. (11a), (13), (16)
BASE = ss.ShampooConfig(
    learning_rate=0.1,
    epsilon=ss.EpsilonConfig(value=1e-3),
    blocking=ss.BlockingConfig(merge_dims_up_to=None, max_preconditioner_dim=6),
    grafting=ss.GraftingConfig(type="adagrad"),
    statistics=ss.StatisticsConfig(beta2=0.9, bias_correction=True),
    factor_dtype="float64",
)
SHAPES = {"w": (7, 10), "t": (3, 4, 5), "v": (12,)}


def _stream(steps: int, seed: int = 0) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
    return params, [{k: rng.standard_normal(s) for k, s in SHAPES.items()} for _ in range(steps)]


@pytest.mark.parametrize("root_inverse", [ss.EighConfig(), ss.CoupledNewtonConfig()],
                         ids=["eigh", "coupled_newton"])
@pytest.mark.parametrize("dtype", ROUNDED)
def test_stored_roots_are_the_float64_roots_rounded(dtype: str, root_inverse: object) -> None:
    """Eq. (11a): X^ = round_s(X), X the root of the same factor (equal in both runs)."""
    exact_config = dataclasses.replace(BASE, root_inverse=root_inverse)  # type: ignore[arg-type]
    config = dataclasses.replace(exact_config, inverse_root_dtype=dtype)  # type: ignore[arg-type]
    params, grads = _stream(4)
    exact, rounded = ReferenceShampoo(exact_config, params), ReferenceShampoo(config, params)
    checked = 0
    for g in grads:
        exact.step(g)
        rounded.step(g)
        for name in SHAPES:
            for a, b in zip(exact.state[name].blocks, rounded.state[name].blocks, strict=True):
                for fa, fb in zip(a.factors, b.factors, strict=True):
                    # The roots do not feed the factors: equal in both runs.
                    assert fa is None or (fb is not None and np.array_equal(fa, fb))
                for xa, xb in zip(a.inverse_roots, b.inverse_roots, strict=True):
                    if xa is not None:
                        assert xb is not None and np.array_equal(xb, round_to(xa, dtype))
                        checked += 1
    assert checked > 0
    # The rounding is real (the roots are not representable in s) and moves the trajectory.
    assert not np.array_equal(exact.params["w"], rounded.params["w"])


def test_default_none_is_todays_reference_bit_for_bit() -> None:
    """None: no rounding anywhere; "float64" rounds nothing either: the same trajectory."""
    params, grads = _stream(5)
    runs = [ReferenceShampoo(dataclasses.replace(BASE, inverse_root_dtype=d), params)
            for d in (None, "float64")]
    for g in grads:
        a, b = (opt.step(g) for opt in runs)
        for name in SHAPES:
            assert np.array_equal(a[name], b[name])


def _round_each(dtype: str, *xs: np.ndarray) -> list[np.ndarray]:
    return [round_to(x, dtype) for x in xs]


@pytest.mark.parametrize("dtype", ROUNDED)
def test_direction_is_eq16_in_the_storage_dtype(dtype: str) -> None:
    """Eq. (16) written out for a matrix block: round_s(round_s(X^_1 round_s(G)) X^_2^T).

    No graft, no filter, one root step: W_1 = W_0 - lr P with the roots the
    reference stored (eq. 11a is checked above). The products here are NumPy
    ``@`` in float64 (the reference uses ``tensordot`` along the dim); a
    different float64 summation could only change P across a rounding
    boundary of s, where the two float64 sums differ by ~2^-53 relative:
    probability about 2^-53 / 2^-24 per entry, so P must be equal exactly.
    """
    config = ss.ShampooConfig(
        learning_rate=0.5, epsilon=ss.EpsilonConfig(value=1e-2),
        blocking=ss.BlockingConfig(merge_dims_up_to=None), factor_dtype="float64",
        inverse_root_dtype=dtype,  # type: ignore[arg-type]
    )
    rng = np.random.default_rng(3)
    w0, g = rng.standard_normal((7, 10)), rng.standard_normal((7, 10))
    opt = ReferenceShampoo(config, {"w": w0})
    w1 = opt.step({"w": g})["w"]
    x1, x2 = opt.state["w"].blocks[0].inverse_roots
    assert x1 is not None and x2 is not None
    (g_s,) = _round_each(dtype, g)
    p = round_to(round_to(x1 @ g_s, dtype) @ x2.T, dtype)
    assert np.array_equal(w1, w0 - 0.5 * p)
    # Rounding only the roots, or only at the end, is a different rule (and different numbers).
    assert not np.array_equal(p, round_to(x1 @ g @ x2.T, dtype))


def test_float16_root_that_overflows_fails_and_keeps_the_previous_one() -> None:
    """Eq. (13): X^ = round_float16(X) = inf (X ~ 1e6 > 65504) is a failed root."""
    config = ss.ShampooConfig(
        epsilon=ss.EpsilonConfig(value=1e-12), blocking=ss.BlockingConfig(merge_dims_up_to=None),
        factor_dtype="float64", inverse_root_dtype="float16",
        failure=ss.FailureConfig(max_consecutive_root_failures=None),
    )
    opt = ReferenceShampoo(config, {"v": np.zeros(3)})
    opt.step({"v": np.array([1e-4, 0.0, 0.0])})  # L = g g^T: eigenvalues 1e-8 and 0
    x = opt.state["v"].blocks[0].inverse_roots[0]
    assert x is not None and np.array_equal(x, np.eye(3))  # identity kept (eq. 13)
    assert opt.metrics.root_failures == 1
    assert np.all(np.isfinite(opt.params["v"]))


def test_eigenvalue_correction_refuses_a_root_dtype() -> None:
    with pytest.raises(ValueError, match="inverse_root_dtype"):
        ss.ShampooConfig(eigenvalue_correction=ss.EigenvalueCorrectionConfig(),
                         inverse_root_dtype="bfloat16")


# ------------------------------------------------------------ update_dtype, eq. (21a)
UPDATE_ROUNDED = ["float32", "bfloat16", "float16"]


@pytest.mark.parametrize("dtype", UPDATE_ROUNDED)
def test_update_is_rounded_before_it_is_added(dtype: str) -> None:
    """Eq. (21a) in closed form: W <- W + round_c(-lr U - lr wd W).

    SGD graft before the start step (P = G), Nesterov momentum and update
    decay: M_t = mu M_{t-1} + G_t, U = G_t + mu M_t; the update is formed in
    float64, rounded to c entry by entry, then added (bit for bit).
    """
    lr, wd, mu = 0.3, 0.01, 0.9
    exact_config = ss.ShampooConfig(
        learning_rate=lr, factor_dtype="float64",
        grafting=ss.GraftingConfig(type="sgd"),
        momentum=ss.MomentumConfig(momentum=mu, nesterov=True),
        weight_decay=ss.WeightDecayConfig(value=wd, type="update"),
        schedule=ss.ScheduleConfig(start_preconditioning_step=100),
    )
    config = dataclasses.replace(exact_config, update_dtype=dtype)  # type: ignore[arg-type]
    params, grads = _stream(3, seed=4)
    rounded, exact = ReferenceShampoo(config, params), ReferenceShampoo(exact_config, params)
    w = {k: v.copy() for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in params.items()}
    for g in grads:
        got = rounded.step(g)
        unrounded = exact.step(g)
        for k in SHAPES:
            m[k] = mu * m[k] + g[k]
            u = g[k] + mu * m[k]
            w[k] = w[k] + round_to(-(lr * u) - lr * wd * w[k], dtype)
            assert np.array_equal(got[k], w[k]), k
    # The rounding is real: the trajectories part.
    assert all(not np.array_equal(got[k], unrounded[k]) for k in SHAPES)


def test_float16_update_overflow_is_withheld() -> None:
    """Eq. (22) judges W + round_c(Delta): an update beyond float16's 65504 is withheld."""
    config = ss.ShampooConfig(
        learning_rate=1.0, factor_dtype="float64", grafting=ss.GraftingConfig(type="sgd"),
        schedule=ss.ScheduleConfig(start_preconditioning_step=100), update_dtype="float16",
    )
    opt = ReferenceShampoo(config, {"v": np.zeros(2)})
    w = opt.step({"v": np.array([1e5, 1.0])})["v"]
    assert np.array_equal(w, [0.0, -1.0]) and opt.metrics.withheld_updates == 1

