"""The ``sirfshampoo`` backend (shampoo_conformance.thirdparty.sirfshampoo) against
sirfshampoo 0.0.1 itself: the update its docstring states (which no config of the
spec expresses), the one expressible setting, and the user-run hooks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("sirfshampoo")

import torch  # noqa: E402

from shampoo_conformance import get_backend  # noqa: E402
from shampoo_conformance.suite import user_runs  # noqa: E402
from shampoo_conformance.suite.cases import make_problem  # noqa: E402
from shampoo_conformance.suite.divergence import bound_and_reference, first_divergence  # noqa: E402
from shampoo_conformance.thirdparty import sirfshampoo as S  # noqa: E402
from shampoo_spec import Inexpressible, ShampooConfig  # noqa: E402


def _mode(x: np.ndarray, n: int, m: np.ndarray) -> np.ndarray:
    """x with m multiplied onto its axis n: (x x_n m)_{..i..} = sum_j m[i, j] x_{..j..}."""
    return np.moveaxis(np.tensordot(m, x, axes=([1], [n])), 0, n)


def _docstring_step(w: np.ndarray, g: np.ndarray, k: dict[str, Any]) -> np.ndarray:
    """One step from K = I, m = 0 as the module docstring states it (batch size 1)."""
    dims = g.shape
    c = [1.0 / np.sqrt(d) for d in dims]
    gk = g.copy()
    for n in range(g.ndim):
        gk = _mode(gk, n, (c[n] * np.eye(dims[n])).T)
    tau = np.array([c[n] ** 2 * dims[n] / dims[n] for n in range(g.ndim)])
    p = g.copy()
    for n in range(g.ndim):
        others = [j for j in range(g.ndim) if j != n]
        gk_n = np.moveaxis(gk, n, 0).reshape(dims[n], -1)
        s = (k["lam"] / 2 * np.prod(tau[others]) * np.prod(dims) * c[n] ** 2 * np.eye(dims[n])
             + dims[n] / 2 * gk_n @ gk_n.T - 0.5 * np.eye(dims[n]))
        m = (1 - k["alpha2"]) * s
        kn = np.eye(dims[n]) - k["beta2"] / max(1.0, float(np.linalg.norm(m))) * m
        p = _mode(p, n, kn @ kn.T)
    out: np.ndarray = w - k["lr"] * (p + k["kappa"] * w)  # momentum's first step: M = P
    return out


@pytest.mark.parametrize("shape", [(3, 4), (5,), (2, 3, 2)])
def test_first_step_is_the_docstring_update(shape: tuple[int, ...]) -> None:
    """The K update and direction of the module docstring, to float64 rounding: what
    the spec's eqs. (6), (9)-(13) would have to say, and cannot."""
    params, grads = make_problem({"w": shape}, 1, 3)
    kwargs = {"lr": 0.1, "beta2": 0.3, "alpha1": 0.9, "alpha2": 0.5, "lam": 0.01,
              "kappa": 0.02}
    run = S.library_run(kwargs, params, grads, np.float64)
    want = _docstring_step(params["w"], grads[0]["w"], kwargs)
    np.testing.assert_allclose(run.params[0]["w"], want, rtol=1e-12, atol=1e-13)
    assert np.abs(want - (params["w"] - 0.1 * (grads[0]["w"] + 0.02 * params["w"]))).max() > 1e-3


def test_preconditioning_configs_are_inexpressible() -> None:
    """Every config that preconditions gets the reason; so do its defaults."""
    assert S.expressible(ShampooConfig()) == S.REASON
    assert "eqs. (6) and (9)-(13)" in S.REASON
    with pytest.raises(Inexpressible, match="replaces eqs"):
        S.defaults_config()
    with pytest.raises(Inexpressible):
        S.run(ShampooConfig(), {"w": np.ones(3)}, [{"w": np.ones(3)}])
    with pytest.raises(ValueError, match="no argument"):
        S.from_kwargs({"not_an_argument": 1})


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_never_updating_factors_is_heavy_ball_sgd(dtype: Any) -> None:
    """T never true: K stays I, and the library is the reference on the imported config."""
    params, grads = make_problem({"w": (7, 10), "b": (5,), "t": (3, 4, 5), "r": (1, 6)}, 6, 0)
    for config in S.CASES.values():
        assert S.expressible(config) is None
        bound, ref = bound_and_reference(config, params, grads, dtype)
        assert first_divergence(S.run(config, params, grads, dtype), ref, params, bound) is None


def test_user_run_hooks() -> None:
    """What the suite's side-effect properties will find: all four pass; the defaults
    properties skip (defaults_config raises Inexpressible)."""
    backend = get_backend("sirfshampoo")
    for check in (user_runs.check_grads_unchanged, user_runs.check_unknown_argument_refused,
                  user_runs.check_global_rng_unchanged, user_runs.check_float64_stays_float64):
        check(backend)
    assert S.USER_KWARGS == {} and S.DEVIATIONS == ()
    before = torch.get_rng_state()
    S.library_run({}, {"w": np.ones((2, 3))}, [{"w": np.ones((2, 3))}], np.float32)
    assert torch.equal(before, torch.get_rng_state())
