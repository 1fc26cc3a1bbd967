"""Factors stored in ``factor_storage_dtype`` (docs/spec.md eq. 11b).

The reference is the oracle, so eq. (11b) is checked independently of
``round_to``: against the same steps written out in NumPy's float32 and
float16 arithmetic and ml_dtypes' bfloat16 (each operation of Meta's in s
as float32 arithmetic followed by a cast to s), against a closed form (a
diagonal factor: eigh is exact and the root is the rounded powers), and
in a run: the stored factors are s numbers, and the run differs from the
same config without the rule.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import shampoo_spec as ss
from shampoo_reference import ReferenceShampoo
from shampoo_reference.roots.eigh import root_inverse_eigh_stored
from shampoo_reference.rounding import round_to

ml_dtypes = pytest.importorskip("ml_dtypes")

STORAGE = ("bfloat16", "float16")


def _np_dtype(dtype: str) -> type:
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16


def _to_s(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 arithmetic's result cast to s (torch's and Meta's kernels: compute in
    float32, round once to s), back in float64."""
    return np.atleast_1d(np.asarray(x, dtype=np.float32)).astype(_np_dtype(dtype)).astype(
        np.float64)


def _written_out_root(a: np.ndarray, root: float, eps: float, placement: str,
                      dtype: str) -> np.ndarray:
    """Eq. (11b)'s root, each operation in float32 and cast to s; eigh in float64; the
    last product summed in float64 (the reference's order) and cast to s."""
    f32 = np.float32
    e = f32(_to_s(np.array(eps), dtype)[0])
    a32 = a.astype(f32)
    if placement == "ridge":
        a32 = _to_s(a32 + e * np.eye(a.shape[0], dtype=f32), dtype).astype(f32)
    lam, q = np.linalg.eigh(a32.astype(np.float64))
    lam32, q32 = _to_s(lam.astype(f32), dtype).astype(f32), _to_s(q.astype(f32), dtype).astype(f32)
    m = lam32.min()
    if placement == "ridge":
        if float(m) < eps:
            lam32 = _to_s(_to_s(lam32 - m, dtype).astype(f32) + e, dtype).astype(f32)
    else:
        if m < 0:
            lam32 = _to_s(lam32 - m, dtype).astype(f32)
        lam32 = _to_s(lam32 + e, dtype).astype(f32)
    p = f32(_to_s(np.array(-1.0 / root), dtype)[0])
    x = _to_s(lam32.astype(np.float64) ** float(p), dtype).astype(f32)
    scaled = _to_s(q32 * x, dtype)
    full = _to_s((scaled @ q32.astype(np.float64).T).astype(f32), dtype)
    n = full.shape[0]
    return np.array([[full[min(i, j), max(i, j)] for j in range(n)] for i in range(n)])


def _s_matrix(n: int, dtype: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((n, 3 * n))
    return round_to(g @ g.T / n, dtype)


@pytest.mark.parametrize("dtype", STORAGE)
@pytest.mark.parametrize("placement", ["ridge", "shift_after"])
@pytest.mark.parametrize("root", [2.0, 4.0, 6.0])
def test_root_equals_the_steps_written_out_in_float32_and_s(
        dtype: str, placement: str, root: float) -> None:
    for seed in range(4):
        a = _s_matrix(12, dtype, seed)
        got = root_inverse_eigh_stored(a, root, 1e-3, placement, dtype)
        assert np.array_equal(got, _written_out_root(a, root, 1e-3, placement, dtype))


@pytest.mark.parametrize("dtype", STORAGE)
def test_rank_deficient_factor_is_shifted_by_its_smallest_eigenvalue(dtype: str) -> None:
    """A rank-1 factor: the ridge 1e-4 is lost in s next to entries near 1, the smallest
    eigenvalue is rounding noise, so Meta's rule shifts (m < eps) and adds eps again."""
    v = round_to(np.linspace(0.5, 1.0, 8), dtype)
    a = round_to(np.outer(v, v), dtype)
    got = root_inverse_eigh_stored(a, 2.0, 1e-4, "ridge", dtype)
    assert np.array_equal(got, _written_out_root(a, 2.0, 1e-4, "ridge", dtype))
    assert np.all(np.isfinite(got)) and np.array_equal(round_to(got, dtype), got)


@pytest.mark.parametrize("dtype", STORAGE)
@pytest.mark.parametrize("root", [2.0, 4.0])
def test_diagonal_factor_closed_form(dtype: str, root: float) -> None:
    """A diagonal s factor: eigh is exact (Q a signed permutation), so the root is
    diag(round_s(round_s(d + round_s(eps)) ^ round_s(-1/root))) (ridge, d >= eps)."""
    d = round_to(np.array([4.0, 0.25, 9.0, 1.5, 100.0]), dtype)
    eps = 1e-2
    got = root_inverse_eigh_stored(np.diag(d), root, eps, "ridge", dtype)
    ridged = round_to(d + round_to(np.array([eps]), dtype)[0], dtype)
    power = float(round_to(np.array([-1.0 / root]), dtype)[0])
    assert np.array_equal(got, np.diag(round_to(ridged**power, dtype)))


def _config(dtype: str | None, **kw: object) -> ss.ShampooConfig:
    return ss.ShampooConfig(
        learning_rate=0.05, factor_dtype="float64", factor_storage_dtype=dtype,
        epsilon=ss.EpsilonConfig(value=1e-4),
        statistics=ss.StatisticsConfig(beta2=0.95, bias_correction=True),
        grafting=ss.GraftingConfig(type="adagrad", epsilon=1e-8),
        blocking=ss.BlockingConfig(max_preconditioner_dim=6), **kw,  # type: ignore[arg-type]
    )


def _run(cfg: ss.ShampooConfig, steps: int = 6) -> ReferenceShampoo:
    rng = np.random.default_rng(3)
    params = {"w": rng.standard_normal((5, 7)), "b": rng.standard_normal(4)}
    opt = ReferenceShampoo(cfg, params)
    for _ in range(steps):
        opt.step({k: rng.standard_normal(v.shape) for k, v in params.items()})
    return opt


@pytest.mark.parametrize("dtype", STORAGE)
def test_stored_factors_are_s_numbers_and_follow_the_written_out_update(dtype: str) -> None:
    """Eq. (11b) in a run: every factor is an s number; the last step's update of one
    factor equals round_s(round_s(fl32(beta2) L) + w G G^T) written out in NumPy."""
    cfg = _config(dtype)
    opt = _run(cfg, steps=5)
    rng = np.random.default_rng(11)
    g = {"w": rng.standard_normal((5, 7)), "b": rng.standard_normal(4)}
    before = [f.copy() for f in opt.state["b"].blocks[0].factors if f is not None]
    opt.step(g)
    after = [f for f in opt.state["b"].blocks[0].factors if f is not None]
    decayed = _to_s(np.float32(0.95) * before[0].astype(np.float32), dtype)
    want = round_to(decayed + 0.05 * np.outer(g["b"], g["b"]), dtype)
    assert np.array_equal(after[0], want)
    for st in opt.state.values():
        for bs in st.blocks:
            for f in bs.factors:
                if f is not None:
                    assert np.array_equal(round_to(f, dtype), f)
            for x in bs.inverse_roots:
                if x is not None:
                    assert np.array_equal(round_to(x, dtype), x)


@pytest.mark.parametrize("dtype", STORAGE)
def test_the_rule_changes_the_run_and_none_keeps_todays_numerics(dtype: str) -> None:
    plain = _run(_config(None)).params
    stored = _run(_config(dtype)).params
    again = _run(_config(None)).params
    for k in plain:
        assert np.array_equal(plain[k], again[k])
        assert not np.array_equal(plain[k], stored[k])
        rel = np.abs(plain[k] - stored[k]).max() / np.abs(plain[k]).max()
        assert rel < 0.2  # a rounding of the statistics, not another algorithm


def test_with_inverse_root_dtype_the_s_root_is_rounded_again() -> None:
    """Eq. (11a) after eq. (11b): a bfloat16 root stored in float16 is round_float16 of it."""
    cfg = dataclasses.replace(_config("bfloat16"), inverse_root_dtype="float16")
    opt = _run(cfg)
    for st in opt.state.values():
        for bs in st.blocks:
            for x in bs.inverse_roots:
                if x is not None:
                    assert np.array_equal(round_to(x, "float16"), x)


@pytest.mark.parametrize("policy", ["raise", "skip_block"])
def test_float16_factors_refuse_blocks_that_could_overflow(policy: str) -> None:
    """Eq. (3) with float16 factors: a finite gradient whose block could take a factor
    past 2^15 is refused (raised, or skipped with its state unchanged); bfloat16, whose
    range is float32's, takes it."""
    base = dataclasses.replace(_config("float16"), failure=ss.FailureConfig(
        nonfinite_gradient=policy))  # type: ignore[arg-type]
    params = {"b": np.zeros(4)}
    big = {"b": np.array([91.0, 1.0, -2.0, 3.0])}  # 4 * 91^2 = 33124 > 2^15
    opt = ReferenceShampoo(base, params)
    opt.step({"b": np.array([1.0, 2.0, 3.0, 4.0])})
    before = [f.copy() for f in opt.state["b"].blocks[0].factors if f is not None]
    if policy == "raise":
        with pytest.raises(ss.NonFiniteGradientError, match="float16 factors"):
            opt.step(big)
        return
    opt.step(big)
    assert opt.metrics.skipped_blocks == 1
    after = [f for f in opt.state["b"].blocks[0].factors if f is not None]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    wide = ReferenceShampoo(dataclasses.replace(base, factor_storage_dtype="bfloat16"), params)
    wide.step(big)
    assert wide.metrics.skipped_blocks == 0
