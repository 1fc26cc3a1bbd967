"""The Muon backends (``torch-muon``, ``optax-muon``, ``heavyball-muon``): their kwargs
imported as eq. (16c) spectral descent, refusals that name the field, each library
at its named cases against the reference, and each documented deviation shown.

``_orth`` is eq. (16c)'s Newton-Schulz written out (float64 NumPy); ``_heavyball``
is heavyball's Muon as its source reads (thirdparty/heavyball_muon.py cites the
lines), so that its one difference on matrices, the coefficient schedule, is
shown to be the whole difference.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch

import shampoo_spec as ss
from shampoo_conformance.suite.cases import make_problem
from shampoo_conformance.suite.divergence import first_divergence
from shampoo_conformance.suite.tolerances import bound_and_reference

MODULES = {
    "torch-muon": "shampoo_conformance.thirdparty.torch_muon",
    "optax-muon": "shampoo_conformance.thirdparty.optax_muon",
    "heavyball-muon": "shampoo_conformance.thirdparty.heavyball_muon",
}
#: Matrices only (torch and optax refuse other shapes): wide, tall, a row, square.
MATRICES: dict[str, tuple[int, ...]] = {"w": (7, 10), "t": (10, 7), "r": (1, 6), "s": (4, 4)}


def _module(name: str) -> Any:
    """The backend's adapter; the test skips where its library is not installed (the
    torch-optim and optax-contrib sessions install no heavyball)."""
    try:
        return importlib.import_module(MODULES[name])
    except ImportError as err:
        pytest.skip(f"{name}: {err}")


def _divergence(mod: Any, config: ss.ShampooConfig, shapes: Mapping[str, tuple[int, ...]],
                steps: int = 10, dtype: Any = np.float64) -> Any:
    params, grads = make_problem(dict(shapes), steps, 0)
    bound, ref = bound_and_reference(config, params, grads, dtype)
    return first_divergence(mod.run(config, params, grads, dtype), ref, params, bound)


def _orth(g: np.ndarray, coefficients: list[tuple[float, float, float]],
          floor: float = 1e-8) -> np.ndarray:
    """Eq. (16c)'s Newton-Schulz, one (a, b, c) per iteration."""
    wide = g.shape[0] < g.shape[1]
    x = (g.T if wide else g) / max(np.linalg.norm(g), floor)
    for a, b, c in coefficients:
        gram = x.T @ x
        x = a * x + x @ (b * gram + c * gram @ gram)
    out: np.ndarray = x.T if wide else x
    return out


# ----------------------------------------------------------------- importing kwargs
def test_torch_kwargs_import_as_filter_and_update_decay() -> None:
    c = _module("torch-muon").from_kwargs({})
    assert c.spectral == ss.SpectralDescentConfig()
    assert (c.gradient_filter.beta1, c.gradient_filter.beta3) == (0.95, 0.95 ** 2)
    assert not c.gradient_filter.bias_correction
    assert (c.weight_decay.type, c.weight_decay.value, c.learning_rate) == ("update", 0.1, 1e-3)
    assert c.blocking.skip_rank_lt == 2 and not c.blocking.squeeze


def test_optax_kwargs_import_bias_correction_without_nesterov() -> None:
    c = _module("optax-muon").from_kwargs({"learning_rate": 0.1, "nesterov": False,
                                           "beta": 0.9, "ns_coeffs": "standard"})
    assert (c.gradient_filter.beta1, c.gradient_filter.beta3) == (0.9, None)
    assert c.gradient_filter.bias_correction and c.learning_rate == 0.1


def test_heavyball_kwargs_import_nesterov_as_half_beta() -> None:
    c = _module("heavyball-muon").from_kwargs({})
    assert (c.gradient_filter.beta1, c.gradient_filter.beta3) == (0.9, 0.45)
    assert c.learning_rate == 0.0025 and c.blocking.merge_dims_up_to is not None


@pytest.mark.parametrize(("name", "kwargs", "field"), [
    ("torch-muon", {"adjust_lr_fn": "match_rms_adamw"}, "adjust_lr_fn"),
    ("torch-muon", {"lrr": 0.1}, "lrr"),
    ("optax-muon", {"learning_rate": 0.1, "preconditioning": "aol"}, "preconditioning"),
    ("optax-muon", {"learning_rate": 0.1, "ns_coeffs": "dion"}, "ns_coeffs"),
    ("optax-muon", {"learning_rate": 0.1, "consistent_rms": 0.2}, "consistent_rms"),
    ("heavyball-muon", {"mars": True}, "mars"),
    ("heavyball-muon", {"heavyball_momentum": True}, "heavyball_momentum"),
])
def test_refusals_name_the_argument(name: str, kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ss.Inexpressible, match=field):
        _module(name).from_kwargs(kwargs)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_configs_outside_muon_are_refused_by_field(name: str) -> None:
    mod = _module(name)
    base = mod.base_config()
    graft = ss.ShampooConfig(**{**base.__dict__, "grafting": ss.GraftingConfig(
        type="adam", beta2=0.999, epsilon=1e-8)})
    assert "grafting" in (mod.expressible(graft) or "")
    assert mod.expressible(base) is None
    assert all(mod.expressible(c) is None for c in mod.CASES.values()
               if name != "optax-muon" or c.gradient_filter.beta3 is None)


@pytest.mark.parametrize("name", ["torch-muon", "optax-muon"])
def test_non_matrices_are_refused_naming_the_parameter(name: str) -> None:
    mod = _module(name)
    params, grads = make_problem({"w": (3, 4), "bias": (3,)}, 1, 0)
    with pytest.raises(ss.Inexpressible, match="'bias'"):
        mod.run(mod.base_config(), params, grads, np.float64)


# ----------------------------------------------------------------- against the reference
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", ["no_nesterov", "modula"])
def test_optax_cases_equal_the_reference(case: str, dtype: Any) -> None:
    """On matrices (the suite's named problem has vectors, which optax sends to AdamW)."""
    mod = _module("optax-muon")
    assert _divergence(mod, mod.CASES[case], MATRICES, dtype=dtype) is None


def test_optax_nesterov_is_its_bias_corrected_form() -> None:
    """DEVIATIONS['nesterov_bias_correction']: optax's Nesterov direction is
    beta mu_t / (1 - beta^(t+1)) + (1 - beta) G_t / (1 - beta^t), out of the bound
    against eq. (15) with beta3 = beta^2, and exactly that form written out."""
    mod = _module("optax-muon")
    config = mod.CASES["defaults"]
    assert _divergence(mod, config, MATRICES) is not None
    params, grads = make_problem({"w": (5, 8)}, 4, 0)
    ours = mod.run(config, params, grads, np.float64)
    w, mu, beta = params["w"], np.zeros((5, 8)), 0.95
    for t, (g, step) in enumerate(zip(grads, ours, strict=True), start=1):
        mu = beta * mu + (1 - beta) * g["w"]
        hat = beta * mu / (1 - beta ** (t + 1)) + (1 - beta) * g["w"] / (1 - beta ** t)
        w = w - config.learning_rate * _orth(hat, [ss.config.preconditioners.MUON_COEFFICIENTS]
                                             * 5)
        np.testing.assert_allclose(step["w"], w, rtol=0, atol=1e-13)


def test_optax_defaults_scale_wide_matrices_and_add_eps() -> None:
    """DEVIATIONS['wide_matrix_lr_factor'], ['epsilon_added']: at its defaults (no
    Nesterov to isolate them) a wide (A, B) matrix steps sqrt(B / A) times eq. (16c);
    a tall one differs only by eps = 1e-8 added to the norm."""
    mod = _module("optax-muon")
    kwargs = {"learning_rate": 0.02, "nesterov": False, "beta": 0.0}
    params, grads = make_problem({"w": (4, 9), "t": (9, 4)}, 1, 0)
    user = mod.library_run(kwargs, params, grads, np.float64).params[0]
    spec = mod.run(mod.from_kwargs(kwargs), params, grads, np.float64)[0]
    moved = {k: user[k] - params[k] for k in params}
    want = {k: spec[k] - params[k] for k in params}
    # 1.5 = sqrt(9 / 4); eps moves each step by about 1e-8 / ||G|| of it (< 1e-6).
    wide = np.abs(moved["w"] - 1.5 * want["w"]).max() / np.abs(want["w"]).max()
    tall = np.abs(moved["t"] - want["t"]).max() / np.abs(want["t"]).max()
    assert wide < 1e-6 and 1e-10 < tall < 1e-6


def test_torch_is_eq_16c_in_bfloat16() -> None:
    """DEVIATIONS['bfloat16_newton_schulz']: out of the float64 bound, within a few
    bfloat16 ulps (2^-8) of the reference's step."""
    mod = _module("torch-muon")
    config = mod.CASES["no_nesterov"]
    params, grads = make_problem({"w": (7, 10), "s": (4, 4)}, 3, 0)
    bound, ref = bound_and_reference(config, params, grads, np.float64)
    ours = mod.run(config, params, grads, np.float64)
    assert first_divergence(ours, ref, params, bound) is not None
    step = np.abs(ref[0]["w"] - params["w"]).max()
    assert np.abs(ours[0]["w"] - ref[0]["w"]).max() < 8 * 2.0 ** -8 * step
    x = torch.randn(5, 3, dtype=torch.float64)
    out = torch.optim._muon._zeropower_via_newtonschulz(x, (3.4445, -4.775, 2.0315), 5, 1e-7)
    assert out.dtype == torch.bfloat16


def test_torch_scales_tall_matrices() -> None:
    """DEVIATIONS['tall_matrix_lr_factor']: a (10, 4) matrix steps sqrt(10 / 4) times
    its transpose's step (to bfloat16's accuracy)."""
    mod = _module("torch-muon")
    params, grads = make_problem({"w": (4, 10)}, 1, 0)
    kwargs = {"lr": 0.02, "momentum": 0.0, "weight_decay": 0.0}
    wide = mod.library_run(kwargs, params, grads, np.float64).params[0]["w"] - params["w"]
    tall = mod.library_run(kwargs, {"w": params["w"].T}, [{"w": grads[0]["w"].T}],
                           np.float64).params[0]["w"] - params["w"].T
    ratio = np.linalg.norm(tall) / np.linalg.norm(wide)
    assert abs(ratio - np.sqrt(10 / 4)) < 0.02


# ----------------------------------------------------------------- heavyball, modelled
_SCHEDULE = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
             (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]


def _heavyball(params: dict[str, np.ndarray], grads: list[dict[str, np.ndarray]],
               lr: float, beta: float) -> list[dict[str, np.ndarray]]:
    """heavyball.Muon with Nesterov, float64: U = G + F_t; a matrix (rank >= 2 flattened
    to (d0, rest)) orthogonalized with the schedule, floor 1e-7, times
    sqrt(max(1, rows / cols)); vectors and scalars step U."""
    w = {k: np.array(v, dtype=np.float64) for k, v in params.items()}
    f = {k: np.zeros_like(v) for k, v in w.items()}
    out = []
    for g in grads:
        for k in w:
            f[k] = beta * f[k] + (1 - beta) * g[k]
            u = g[k] + f[k]
            if u.ndim >= 2:
                m = u.reshape(u.shape[0], -1)
                u = (_orth(m, _SCHEDULE, 1e-7) * max(1.0, m.shape[0] / m.shape[1]) ** 0.5
                     ).reshape(u.shape)
            w[k] = w[k] - lr * u
        out.append({k: v.copy() for k, v in w.items()})
    return out


def test_heavyball_is_its_model() -> None:
    """The reading of heavyball's Muon is complete: at lr 2^-6 (exact in float32, no
    float32_learning_rate) with Nesterov (no float32 debias weight), float64 equals
    the model; so on matrices only the schedule (and the tall scale) differ from eq.
    (16c), and on vectors the factor 2 (DEVIATIONS)."""
    mod = _module("heavyball-muon")
    shapes = {"w": (7, 10), "t": (10, 4), "x": (3, 4, 5), "b": (7,), "s": ()}
    params, grads = make_problem(shapes, 4, 0)
    ours = mod.run(mod.from_kwargs({"lr": 2.0 ** -6}), params, grads, np.float64)
    for got, want in zip(ours, _heavyball(params, grads, 2.0 ** -6, 0.9), strict=True):
        for k in shapes:
            np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-13)


def test_heavyball_vectors_without_nesterov_need_float64_rates() -> None:
    """Vectors without Nesterov: the reference's step, but for the float32 lr and debias
    weight (DEVIATIONS: about 1e-7 relative), and exact at beta 0, lr 2^-6."""
    mod = _module("heavyball-muon")
    shapes = {"b": (7,), "c": (12,)}
    assert _divergence(mod, mod.from_kwargs({"lr": 2.0 ** -6, "betas": (0.0, 0.99),
                                             "nesterov": False}), shapes) is None
    assert _divergence(mod, mod.from_kwargs({"lr": 2.0 ** -6, "nesterov": False}),
                       shapes) is not None


@pytest.mark.parametrize("name", sorted(MODULES))
def test_documented_deviations_reproduce(name: str) -> None:
    mod = _module(name)
    for d in mod.DEVIATIONS:
        if d.config is not None:
            assert _divergence(mod, d.config, d.shapes or MATRICES) is not None, d.name


# ----------------------------------------------------------------- user-run side effects
def test_side_effects_as_predicted() -> None:
    """What DEVIATIONS predicts for the suite's side-effect properties."""
    shapes = {"w": (7, 10), "b": (5,), "t": (3, 4, 5), "r": (1, 6)}
    params, grads = make_problem(shapes, 2, 0)
    torch_muon, optax_muon, hb = (_module(n) for n in
                                  ("torch-muon", "optax-muon", "heavyball-muon"))
    with pytest.raises(ValueError, match="2D"):  # non_matrix_refused
        torch_muon.library_run({}, params, grads, np.float64)
    for mod in (torch_muon, optax_muon, hb):
        with pytest.raises(TypeError):
            mod.library_run({**mod.USER_KWARGS, "not_an_argument": 1.0}, params, grads,
                            np.float64)
    run = optax_muon.library_run(optax_muon.USER_KWARGS, params, grads, np.float64)
    assert all(v.dtype == np.float64 for v in run.params[-1].values())
    run = hb.library_run({}, params, grads, np.float64)
    assert all(v.dtype == np.float64 for v in run.params[-1].values())
    assert np.isnan(run.grads[0]["w"]).all()  # grad_consumed: p.grad is None after step
    before = torch.get_rng_state().clone()
    hb.library_run({}, params, grads, np.float32)  # bfloat16_stochastic_rounding
    assert not torch.equal(before, torch.get_rng_state())
