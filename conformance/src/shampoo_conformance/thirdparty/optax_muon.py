"""The ``optax-muon`` backend: ``optax.contrib.muon`` of optax 0.2.8, as shipped.

``muon(learning_rate, ...)`` (optax/contrib/_muon.py:519-727) partitions the
parameters: 2-D ones go to ``scale_by_muon`` -> ``scale_by_shape`` ->
``add_decayed_weights`` -> ``scale_by_learning_rate`` (:694-714), the others to
``optax.adamw`` (:715-724). On a matrix, in the spec's terms (:mod:`.muon`):

- ``mu = beta mu + (1 - beta) G`` (:486): eq. (15)'s F_t, beta1 = beta;
  without Nesterov ``mu / (1 - beta^t)`` (:497): F~ bias-corrected (eq. 15 with
  beta3 = beta1), a scale Newton-Schulz does not see;
- with Nesterov (its default) ``beta mu / (1 - beta^(t+1)) + (1 - beta) G /
  (1 - beta^t)`` (:488-495): the weight of G against F_{t-1} changes with t,
  which no beta3 says (it tends to beta3 = beta^2): DEVIATIONS;
- ``X / (||X||_F + eps)`` (:340), transposed when it has more rows than columns
  (:325-327), ``ns_steps`` times ``X <- a X + (b A + c A^2) X``, A = X X^T
  (:239-247) in the parameters' dtype: eq. (16c), whose floor is max(., 1e-8);
- ``scale_by_shape``: times ``sqrt(max(1, fan_out / fan_in))`` (:140-146; with
  ``consistent_rms`` c, ``sqrt(max(fan_in, fan_out)) c``, :149-157), fan_in =
  dim 0, fan_out = dim 1 by default: a wide matrix steps sqrt(B / A) further;
- ``U + wd W`` then ``-lr U`` (:712-713): eq. (21)'s update decay.

:func:`run` expresses a config exactly on matrices: ``eps`` = the smallest
float32 normal (1.2e-38: it rounds away against any norm above about 1e-31,
and leaves 0 / eps = 0 for a zero gradient, as eq. 16c's floor does) and, per
matrix, ``MuonDimensionNumbers`` that name its longer dim the reduction axis (the
orthogonalization of X^T is that of X transposed, the factor is 1). A problem
with a non-matrix is refused: optax sends it to AdamW, which no config says
beside spectral descent (eq. 18 would rescale the matrices too).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from hypothesis import strategies as st
from optax.contrib import MuonDimensionNumbers
from optax.contrib import muon as optax_muon

from shampoo_conformance.adapters.inputs import check_run_inputs
from shampoo_conformance.adapters.jax import Stepper, adamw, library_stepper
from shampoo_conformance.thirdparty.muon import (
    MUON_COEFFICIENTS,
    beta_of,
    kwargs_or_reason,
    matrices_only,
    muon_config,
    refuse_differences,
    update_decay,
)
from shampoo_conformance.thirdparty.optax_library import optax_library_run
from shampoo_conformance.thirdparty.registry import Deviation, LibraryRun
from shampoo_spec import Inexpressible, ShampooConfig

BACKEND = "optax-muon"
_SRC = "optax/contrib/_muon.py"

dtypes = (np.float64, np.float32)

#: ``optax.contrib.muon``'s defaults (optax/contrib/_muon.py:519-551), the matrix part.
DEFAULTS: dict[str, Any] = {
    "ns_coeffs": MUON_COEFFICIENTS, "ns_steps": 5, "beta": 0.95, "eps": 1e-8,
    "weight_decay": 0.0, "weight_decay_mask": None, "mu_dtype": None, "nesterov": True,
    "adaptive": False, "preconditioning": "frobenius", "muon_weight_dimension_numbers": None,
    "consistent_rms": None,
}
#: Its AdamW's arguments: they act on non-matrices only, which :func:`run` refuses.
ADAM_ARGUMENTS = ("adam_b1", "adam_b2", "adam_eps_root", "adam_weight_decay",
                  "adam_learning_rate")

#: What a user must pass: the learning rate (no default); Muon's usual 0.02.
USER_KWARGS: dict[str, Any] = {"learning_rate": 0.02}

#: The floor :func:`run` passes as eps (module docstring).
TINY = float(np.finfo(np.float32).tiny)


def from_kwargs(kwargs: dict[str, Any]) -> ShampooConfig:
    """The config ``optax.contrib.muon(**kwargs)`` runs on matrices (module docstring;
    Nesterov as beta3 = beta^2, eps as eq. 16c's floor: DEVIATIONS); raises
    :class:`Inexpressible` for what no config says."""
    unknown = sorted(set(kwargs) - set(DEFAULTS) - set(ADAM_ARGUMENTS) - {"learning_rate"})
    if unknown:
        raise Inexpressible(f"{BACKEND}: unknown arguments {unknown} ({_SRC}:519-551)")
    k = {**DEFAULTS, **kwargs}
    bad = [f"{name} = {k[name]!r}" for name, ok in (
        ("adaptive", k["adaptive"] is False), ("preconditioning", k["preconditioning"] ==
                                               "frobenius"),
        ("consistent_rms", k["consistent_rms"] is None),
        ("muon_weight_dimension_numbers", k["muon_weight_dimension_numbers"] is None),
        ("weight_decay_mask", k["weight_decay_mask"] is None),
        ("mu_dtype", k["mu_dtype"] is None),
        ("learning_rate", isinstance(k.get("learning_rate"), (int, float)))) if not ok]
    coeffs = k["ns_coeffs"]
    if isinstance(coeffs, str):
        coeffs = {"standard": MUON_COEFFICIENTS}.get(coeffs, coeffs)
    if isinstance(coeffs, str) or np.ndim(coeffs) != 1:
        bad.append(f"ns_coeffs = {k['ns_coeffs']!r} (one (a, b, c) per iteration, {_SRC}:"
                   "352-359; eq. 16c has one triple)")
    if bad:
        raise Inexpressible(f"{BACKEND} cannot express: " + "; ".join(bad))
    return muon_config(lr=k["learning_rate"], beta1=k["beta"], nesterov=bool(k["nesterov"]),
                       coefficients=tuple(coeffs), steps=int(k["ns_steps"]),
                       weight_decay=k["weight_decay"], bias_correction=not k["nesterov"])


def muon_kwargs(config: ShampooConfig) -> dict[str, Any]:
    """``optax.contrib.muon``'s kwargs for ``config`` (the dimension numbers and eps of
    :func:`run` aside); raises :class:`Inexpressible` naming what they cannot say."""
    sd = config.spectral
    if sd is None or sd.method != "newton_schulz":
        raise Inexpressible(f"{BACKEND} cannot express: spectral = {sd!r} (Newton-Schulz "
                            "spectral descent, eq. 16c, only)")
    beta1, nesterov = beta_of(config)
    kwargs = {"learning_rate": config.learning_rate, "ns_coeffs": sd.coefficients,
              "ns_steps": sd.num_iterations, "beta": beta1, "nesterov": nesterov,
              "weight_decay": update_decay(config, BACKEND)}
    refuse_differences(BACKEND, config, from_kwargs(kwargs))
    if nesterov:
        raise Inexpressible(f"{BACKEND} cannot express: gradient_filter.beta3 = "
                            f"{config.gradient_filter.beta3!r} exactly (its Nesterov weights "
                            f"change with t, {_SRC}:488-495: DEVIATIONS['nesterov_bias_"
                            "correction'])")
    return kwargs


def _run_kwargs(config: ShampooConfig) -> dict[str, Any]:
    """The kwargs of :func:`muon_kwargs` (Nesterov allowed: a user's default) plus the
    floor and per-matrix dimension numbers of :func:`run`."""
    try:
        kwargs = muon_kwargs(config)
    except Inexpressible:
        if not beta_of(config)[1]:
            raise
        beta1 = config.gradient_filter.beta1
        kwargs = muon_kwargs(_without_nesterov(config))
        kwargs.update(nesterov=True, beta=beta1)
    return {**kwargs, "eps": TINY, "muon_weight_dimension_numbers": _unscaled_dims}


def _without_nesterov(config: ShampooConfig) -> ShampooConfig:
    import dataclasses
    f = config.gradient_filter
    return dataclasses.replace(config, gradient_filter=dataclasses.replace(
        f, beta3=None, bias_correction=True))


def _unscaled_dims(params: Any) -> Any:
    """Per matrix, the longer dim as the reduction axis (fan_in): scale_by_shape's
    factor sqrt(max(1, fan_out / fan_in)) is then 1 (:140-146)."""
    return jax.tree.map(
        lambda x: (MuonDimensionNumbers(reduction_axis=1, output_axis=0)
                   if x.ndim == 2 and x.shape[0] < x.shape[1] else MuonDimensionNumbers()),
        params)


def expressible(config: ShampooConfig, dtype: Any = np.float64) -> str | None:
    """Why ``optax.contrib.muon`` cannot run ``config``, or None."""
    return kwargs_or_reason(muon_kwargs, config)


@st.composite
def _kwargs(draw: Any) -> dict[str, Any]:
    """Its kwargs without Nesterov (DEVIATIONS['nesterov_bias_correction'])."""
    return {
        "learning_rate": draw(st.sampled_from([0.01, 0.02, 0.1])),
        "beta": draw(st.sampled_from([0.0, 0.5, 0.9, 0.95])),
        "nesterov": False,
        "weight_decay": draw(st.sampled_from([0.0, 0.1])),
        "ns_steps": draw(st.sampled_from([1, 5, 8])),
        "ns_coeffs": draw(st.sampled_from([MUON_COEFFICIENTS, (3.0, -3.2, 1.2)])),
    }


def configs() -> st.SearchStrategy[ShampooConfig]:
    """Configs ``optax.contrib.muon`` expresses: its own kwargs, mapped."""
    return _kwargs().map(from_kwargs)


def base_config() -> ShampooConfig:
    """Its config nearest ``ShampooConfig()``: lr 0.01, no momentum, no weight decay."""
    return from_kwargs({"learning_rate": 0.01, "beta": 0.0, "nesterov": False})


def defaults_config() -> ShampooConfig:
    """The spec's config nearest ``optax.contrib.muon(learning_rate=0.02)``."""
    return from_kwargs(USER_KWARGS)


_NOT_2D = (f"optax.contrib.muon sends it to optax.adamw ({_SRC}:661-665, :715-724), which "
           "no config says beside spectral descent")


def run(config: ShampooConfig, params: dict[str, np.ndarray],
        grads: list[dict[str, np.ndarray]], dtype: Any = np.float64,
        ) -> list[dict[str, np.ndarray]]:
    """The parameters (as ``dtype`` arrays) after each step; non-matrices refused."""
    key = np.dtype(dtype)
    check_run_inputs(BACKEND, params, grads, key.name)
    kwargs = _run_kwargs(config)
    matrices_only(BACKEND, params, _NOT_2D)
    out = optax_library_run(optax_muon(**kwargs), params, grads, key).params
    return [{n: np.asarray(v, dtype=key) for n, v in step.items()} for step in out]


def library_run(kwargs: dict[str, Any], params: dict[str, np.ndarray],
                grads: list[dict[str, np.ndarray]], dtype: Any = np.float64) -> LibraryRun:
    """``optax.contrib.muon(**kwargs)`` stepped as a user steps it."""
    return optax_library_run(optax_muon(**kwargs), params, grads, dtype)


def transformation(config: ShampooConfig) -> optax.GradientTransformation:
    """The library's transformation :func:`run` steps for ``config``."""
    return optax_muon(**_run_kwargs(config))


def _muon_or_adamw(optimizer: str, config: ShampooConfig | None, dtype: np.dtype[Any],
                   lr: Any, weight_decay: Any) -> optax.GradientTransformation:
    if optimizer == "shampoo":
        assert config is not None
        return optax_muon(**{**_run_kwargs(config), "learning_rate": lambda count: lr})
    return adamw(lr, weight_decay)  # the jax backend's


def stepper(optimizer: str, params: dict[str, np.ndarray], *, lr: float,
            config: ShampooConfig | None = None, weight_decay: float = 0.0,
            dtype: Any = np.float64) -> Stepper:
    """A closed-loop Stepper: ``optax.contrib.muon`` from ``config`` (default
    :func:`base_config`) at rate ``lr``, or ``optax.adamw``; matrices only."""
    matrices_only(BACKEND, params, _NOT_2D)
    if optimizer == "shampoo" and config is None:
        config = base_config()
    return library_stepper(BACKEND, optimizer, params, lr=lr, config=config,
                           weight_decay=weight_decay, dtype=dtype, expressible=expressible,
                           make=_muon_or_adamw, init=lambda tx, p, dt: tx.init(p))


CASES: dict[str, ShampooConfig] = {
    "defaults": from_kwargs({"learning_rate": 0.02}),
    "no_nesterov": from_kwargs({"learning_rate": 0.02, "nesterov": False, "beta": 0.9,
                                "weight_decay": 0.1}),
    "modula": from_kwargs({"learning_rate": 0.02, "nesterov": False,
                           "ns_coeffs": (3.0, -3.2, 1.2), "ns_steps": 8}),
}

WIDE: dict[str, tuple[int, ...]] = {"w": (7, 10), "row": (1, 6)}

DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        name="nesterov_bias_correction",
        config=CASES["defaults"],
        shapes=WIDE,
        tests=("test_library_case_*[[]defaults]", "test_library_defaults_*"),
        cause=(f"with nesterov=True (its default) the direction is beta mu_t / (1 - beta^(t+1))"
               f" + (1 - beta) G_t / (1 - beta^t) ({_SRC}:488-495): G_t's weight against "
               "F_{t-1} changes with t; eq. (15)'s F~ has a fixed beta3 (imported as beta^2, "
               "its limit)"),
        kind="design",
    ),
    Deviation(
        name="wide_matrix_lr_factor",
        config=None,
        tests=("test_library_defaults_*",),
        cause=(f"scale_by_shape multiplies a matrix's direction by sqrt(max(1, fan_out / "
               f"fan_in)) = sqrt(max(1, B / A)) for shape (A, B) by default ({_SRC}:140-146, "
               ":708-711; with consistent_rms c, sqrt(max(A, B)) c): a wide matrix steps "
               "further; the spec's rate is one for all parameters (run cancels it with "
               "per-matrix MuonDimensionNumbers)"),
        kind="design",
    ),
    Deviation(
        name="epsilon_added",
        config=None,
        tests=("test_library_defaults_*",),
        cause=(f"X / (||X||_F + eps), eps = 1e-8 ({_SRC}:340, :533); eq. (16c) divides by "
               "max(||X||_F, 1e-8): the input is shrunk by 1 - 1e-8 / ||X||, which "
               "Newton-Schulz does not undo (run passes eps = 1.2e-38)"),
        kind="design",
    ),
    Deviation(
        name="non_matrix_adamw",
        config=None,
        # The random-config property draws shapes, mostly not matrices: run refuses those
        # examples and Hypothesis stops on its filter_too_much health check.
        tests=("test_library_defaults_*", "test_random_config_*"),
        cause=(f"every non-2-D parameter is stepped by optax.adamw (b1 0.9, b2 0.999, its "
               f"Nesterov, {_SRC}:661-665, :715-724); the spec leaves it to the graft "
               "(skip_rank_lt = 2: P = F~ without one), and a graft would rescale the "
               "matrices too (eq. 18). run refuses such problems (skipped)"),
        kind="design",
    ),
)
