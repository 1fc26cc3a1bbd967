"""Eq. (20b): int8 momentum storage in the reference, against closed forms.

The integers and scales equal Google's own ``QuantizedValue`` bit for bit
(anchors/test_google_library.py, run where Google's library is installed);
here: the map's properties and the step's order (read back, update
unrounded, U from the unrounded buffer, quantize at the end).
"""

from __future__ import annotations

import numpy as np
import pytest

import shampoo_spec as ss
from shampoo_reference import ReferenceShampoo
from shampoo_reference.quantization import dequantize_columnwise, quantize_columnwise


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_quantize_bounds_zero_and_flushed_columns(dtype: str) -> None:
    rng = np.random.default_rng(0)
    m = rng.standard_normal((6, 5, 3)) * np.exp(rng.uniform(-30, 30, (1, 5, 3)))
    m[:, 0, 0] = 0.0  # a zero column
    tiny = float(np.finfo(dtype).tiny)
    m[:, 1, 0] = tiny * 10  # scale below the smallest normal number: flushed
    q, s = quantize_columnwise(m, dtype)
    assert q.dtype == np.int8 and q.shape == m.shape
    assert s.dtype == np.dtype(dtype) and s.shape == (5, 3)
    assert np.abs(q).max() == 127 and q.min() >= -127
    assert s[0, 0] == 0 and s[1, 0] == 0 and not q[:, 0, 0].any() and not q[:, 1, 0].any()
    back = dequantize_columnwise(q, s)
    # Each entry within half a step (and the rounding of the scale) of fl_d(m).
    x = m.astype(dtype).astype(np.float64)
    ok = s > 0
    err = np.abs(back - x)[:, ok]
    assert np.all(err <= 0.5 * s[ok].astype(np.float64) * (1 + 1e-5) + 1e-300)
    # Every nonzero column keeps its largest entry at |q| = 127.
    assert np.all(np.abs(q).max(axis=0)[ok] == 127)
    # Quantizing what was read back gives the same integers (a fixed point).
    q2, _ = quantize_columnwise(back, dtype)
    np.testing.assert_array_equal(q2, q)


def test_rint_ties_to_even() -> None:
    """A column whose scale is exactly 1: the ratios are the values, half-integers round to even."""
    # s = fl(127 * fl(1/127)) is 1 in float64 (127 * fl(1/127) rounds to 1).
    assert 127.0 * (1.0 / 127.0) == 1.0
    col = np.array([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5])
    q, s = quantize_columnwise(col[:, None], "float64")
    assert s[0] == 1.0
    np.testing.assert_array_equal(q[:, 0], [127, 0, 2, 2, 0, -2, -2, 126, -126])


def _config(storage: str, scale_dtype: str = "float64", nesterov: bool = False) -> ss.ShampooConfig:
    return ss.ShampooConfig(
        learning_rate=0.1,
        grafting=ss.GraftingConfig(type="sgd"),
        schedule=ss.ScheduleConfig(start_preconditioning_step=None),
        momentum=ss.MomentumConfig(momentum=0.9, nesterov=nesterov, storage=storage,  # type: ignore[arg-type]
                                   scale_dtype=scale_dtype),  # type: ignore[arg-type]
        factor_dtype="float64",
    )


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("scale_dtype", ["float32", "float64"])
def test_step_order_closed_form(nesterov: bool, scale_dtype: str) -> None:
    """SGD throughout (start never reached): eqs. (20), (20b), (21) written out.

    M' = mu read(M) + G (unrounded), U = M' (or G + mu M'), W <- W - lr U,
    then M is stored as quantize(M'). A (4, 3) weight is quantized; the
    (3,) bias and the 0-d scale keep float buffers, bit for bit as with
    ``storage="float"``.
    """
    rng = np.random.default_rng(1)
    params = {"w": rng.standard_normal((4, 3)), "b": rng.standard_normal(3),
              "c": np.array(0.5)}
    grads = [{k: rng.standard_normal(v.shape) for k, v in params.items()} for _ in range(6)]
    opt = ReferenceShampoo(_config("int8_columnwise", scale_dtype, nesterov), params)
    plain = ReferenceShampoo(_config("float", "float32", nesterov), params)
    w, m = params["w"].copy(), np.zeros((4, 3))
    for g in grads:
        out = opt.step(g)
        ref = plain.step(g)
        new_m = 0.9 * m + g["w"]
        u = g["w"] + 0.9 * new_m if nesterov else new_m
        w = w - 0.1 * u
        q, s = quantize_columnwise(new_m, scale_dtype)
        m = dequantize_columnwise(q, s)
        np.testing.assert_array_equal(out["w"], w)
        stored_q, stored_s = opt.state["w"].stored["momentum"]
        np.testing.assert_array_equal(stored_q, q)
        np.testing.assert_array_equal(stored_s, s)
        np.testing.assert_array_equal(out["b"], ref["b"])
        np.testing.assert_array_equal(out["c"], ref["c"])
    assert set(opt.state["b"].stored) == set() and set(opt.state["c"].stored) == set()


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (3, 0, 2)])
def test_empty_parameters(shape: tuple[int, ...]) -> None:
    """An empty dim 0 has column maxima 0 (scales 0); empty columns have no scale at all."""
    q, s = quantize_columnwise(np.zeros(shape), "float32")
    assert q.shape == shape and s.shape == shape[1:] and not s.any()
    opt = ReferenceShampoo(_config("int8_columnwise"), {"w": np.zeros(shape)})
    opt.step({"w": np.zeros(shape)})
    assert opt.state["w"].stored["momentum"][0].shape == shape


# ------------------------------------------------ eq. (20c): int16 factors and roots
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_int16_with_diagonal_bounds_and_fixed_point(dtype: str) -> None:
    """The diagonal kept in d, off-diagonal entries within half a step, |q| <= 32767."""
    from shampoo_reference.quantization import dequantize_with_diagonal, quantize_with_diagonal

    rng = np.random.default_rng(2)
    g = rng.standard_normal((7, 12))
    a = g @ g.T + 1e-3 * rng.standard_normal((7, 7))
    q, s, d = quantize_with_diagonal(a, dtype)
    assert q.dtype == np.int16 and s.dtype == d.dtype == np.dtype(dtype)
    assert not np.diagonal(q).any() and np.abs(q).max() == 32767
    x = a.astype(dtype).astype(np.float64)
    np.testing.assert_array_equal(d, np.diagonal(a).astype(dtype))
    back = dequantize_with_diagonal(q, s, d)
    np.testing.assert_array_equal(np.diagonal(back), np.diagonal(x))
    off = ~np.eye(7, dtype=bool)
    err = np.abs(back - x)
    assert np.all(err[off] <= (0.5 * s.astype(np.float64) * (1 + 1e-5))[np.newaxis, :]
                  .repeat(7, 0)[off])
    q2, s2, d2 = quantize_with_diagonal(back, dtype)
    np.testing.assert_array_equal(q2, q)
    eye = quantize_with_diagonal(1e-6 * np.eye(3), dtype)
    assert not eye[0].any() and not eye[1].any()
    np.testing.assert_array_equal(dequantize_with_diagonal(*eye),
                                  np.float64(np.asarray(1e-6, dtype)) * np.eye(3))


def _int16_config(scale_dtype: str, beta2: float = 1.0) -> ss.ShampooConfig:
    return ss.ShampooConfig(
        learning_rate=0.1,
        statistics=ss.StatisticsConfig(beta2=beta2, initial_value="epsilon_identity",
                                       storage="int16_columnwise_diagonal",
                                       scale_dtype=scale_dtype),  # type: ignore[arg-type]
        root_inverse=ss.CoupledNewtonConfig(),
        # eps 0.1: the (5, 5) factor of a (5, 3) gradient has rank 3, and float32
        # quantization moves its zero eigenvalues by about 1e-5 either way.
        epsilon=ss.EpsilonConfig(value=0.1),
        grafting=ss.GraftingConfig(type="none"),
        blocking=ss.BlockingConfig(merge_dims_up_to=None),
        factor_dtype="float64",
    )


@pytest.mark.parametrize("beta2", [1.0, 0.9])
@pytest.mark.parametrize("scale_dtype", ["float32", "float64"])
def test_int16_step_closed_form(scale_dtype: str, beta2: float) -> None:
    """Eqs. (6), (11), (16) with eq. (20c) written out for a (5, 3) weight, no graft.

    L <- stored(beta2 R(L) + w G G^T) (R(L) the read-back factor), X = eq. (11)
    on R(L) + eps I as it is (not symmetrized), stored; the direction is
    R(X_0)^T G R(X_1) (Google's contraction of the roots' first index).
    """
    from shampoo_reference.quantization import dequantize_with_diagonal, quantize_with_diagonal
    from shampoo_reference.roots.newton import root_inverse_coupled_newton

    cfg = _int16_config(scale_dtype, beta2)
    rng = np.random.default_rng(3)
    w = rng.standard_normal((5, 3))
    opt = ReferenceShampoo(cfg, {"w": w})
    eps = cfg.epsilon.value
    stored = lambda a: dequantize_with_diagonal(*quantize_with_diagonal(a, scale_dtype))  # noqa: E731
    factors = [stored(eps * np.eye(5)), stored(eps * np.eye(3))]
    weight = cfg.statistics.update_weight
    saw_asymmetric = False
    for t in range(4):
        g = rng.standard_normal((5, 3))
        out = opt.step({"w": g})
        grams = [g @ g.T, g.T @ g]
        roots = []
        for k in range(2):
            factors[k] = stored((beta2 * factors[k] if beta2 != 1.0 else factors[k])
                                + weight * grams[k])
            bc = cfg.statistics.bias_correction_factor(t + 1)
            result = root_inverse_coupled_newton(factors[k] / bc, 4, eps, cfg.root_inverse,
                                                 symmetric=False)
            roots.append(stored(result.root))
            bs = opt.state["w"].blocks[0]
            np.testing.assert_array_equal(bs.factors[k], factors[k])
            np.testing.assert_array_equal(bs.inverse_roots[k], roots[k])
            q, s, d = quantize_with_diagonal(result.root, scale_dtype)
            np.testing.assert_array_equal(bs.stored[("root", k)][0], q)
            saw_asymmetric |= not np.array_equal(roots[k], roots[k].T)
        w = w - 0.1 * (roots[0].T @ g @ roots[1])
        np.testing.assert_allclose(out["w"], w, rtol=0, atol=1e-14)
    assert saw_asymmetric and opt.metrics.root_failures == 0
