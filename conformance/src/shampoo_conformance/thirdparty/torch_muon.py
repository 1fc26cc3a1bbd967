"""The ``torch-muon`` backend: ``torch.optim.Muon`` of torch 2.13, as shipped.

Its step (torch/optim/_muon.py:308-341), in the spec's terms (:mod:`.muon`):

- ``buf.lerp_(grad, 1 - momentum)`` (:333): eq. (15)'s F_t with beta1 = momentum;
  ``grad.lerp(buf, momentum)`` with Nesterov (:334): F~ with beta3 = momentum^2;
- Newton-Schulz (:31-70): the input cast to **bfloat16** (:55), transposed when it
  has more rows than columns (:56-57), divided by ``max(||X||_F, eps)`` with eps
  = 1e-7 (:59), ``ns_steps`` times ``X <- a X + (b A + c A^2) X``, A = X X^T, all
  in bfloat16 (:61-66); eq. (16c) with ``coefficients = ns_coefficients``;
- ``W <- W (1 - lr wd)`` then ``W <- W - lr r O`` (:340-341): eq. (21)'s update
  decay, with r = ``sqrt(max(1, A / B))`` for a parameter of shape (A, B)
  (``adjust_lr_fn`` None or "original", :73-84), 1 for a square or wide one.

Differences no config says (:data:`DEVIATIONS`): the bfloat16 iteration (eq. 16c
is in the working precision: about 1e-2 relative on every step), r > 1 on tall
matrices, the floor 1e-7 for 1e-8. It refuses every parameter that is not 2-D
(:129-133): :func:`run` refuses such a problem (a skip in the suite).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from shampoo_conformance.adapters.torch import Stepper
from shampoo_conformance.adapters.torch_user_run import torch_library_run
from shampoo_conformance.thirdparty.muon import (
    MUON_COEFFICIENTS,
    beta_of,
    kwargs_or_reason,
    matrices_only,
    muon_config,
    refuse_differences,
    update_decay,
)
from shampoo_conformance.thirdparty.registry import Deviation, LibraryRun
from shampoo_conformance.thirdparty.torch_library import make_stepper, run_optimizer
from shampoo_spec import Inexpressible, ShampooConfig

BACKEND = "torch-muon"
_SRC = "torch/optim/_muon.py"

#: Parameter dtypes it runs (its iteration is bfloat16 whatever they are).
dtypes = (np.float64, np.float32)

#: ``torch.optim.Muon``'s defaults (torch/optim/_muon.py:88-99).
DEFAULTS: dict[str, Any] = {
    "lr": 1e-3, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
    "ns_coefficients": MUON_COEFFICIENTS, "eps": 1e-7, "ns_steps": 5, "adjust_lr_fn": None,
}

#: What a user must pass besides the parameters: nothing (every argument has a default).
USER_KWARGS: dict[str, Any] = {}


def from_kwargs(kwargs: dict[str, Any]) -> ShampooConfig:
    """The config ``torch.optim.Muon(params, **kwargs)`` runs on square or wide matrices
    (module docstring); raises :class:`Inexpressible` for what no config says."""
    unknown = sorted(set(kwargs) - set(DEFAULTS))
    if unknown:
        raise Inexpressible(f"{BACKEND}: unknown arguments {unknown} (Muon.__init__ has "
                            f"none such, {_SRC}:88-99)")
    k = {**DEFAULTS, **kwargs}
    if k["adjust_lr_fn"] not in (None, "original"):
        raise Inexpressible(
            f"{BACKEND} cannot express: adjust_lr_fn = {k['adjust_lr_fn']!r} (lr times "
            f"0.2 sqrt(max(A, B)) per shape, {_SRC}:80-81; the spec's learning rate is one "
            "for all parameters)")
    return muon_config(lr=k["lr"], beta1=k["momentum"], nesterov=bool(k["nesterov"]),
                       coefficients=tuple(k["ns_coefficients"]), steps=k["ns_steps"],
                       weight_decay=k["weight_decay"])


def muon_kwargs(config: ShampooConfig) -> dict[str, Any]:
    """``torch.optim.Muon``'s kwargs for ``config``; raises :class:`Inexpressible`
    naming every field they cannot say."""
    sd = config.spectral
    if sd is None or sd.method != "newton_schulz":
        raise Inexpressible(f"{BACKEND} cannot express: spectral = {sd!r} (Muon is "
                            "Newton-Schulz spectral descent, eq. 16c, only)")
    if sd.num_iterations >= 100:
        raise Inexpressible(f"{BACKEND} cannot express: spectral.num_iterations = "
                            f"{sd.num_iterations} (it refuses 100 or more, {_SRC}:46-49)")
    beta1, nesterov = beta_of(config)
    kwargs = {"lr": config.learning_rate, "weight_decay": update_decay(config, BACKEND),
              "momentum": beta1, "nesterov": nesterov,
              "ns_coefficients": sd.coefficients, "ns_steps": sd.num_iterations}
    refuse_differences(BACKEND, config, from_kwargs(kwargs))
    return kwargs


def expressible(config: ShampooConfig, dtype: Any = np.float64) -> str | None:
    """Why ``torch.optim.Muon`` cannot run ``config``, or None."""
    return kwargs_or_reason(muon_kwargs, config)


@st.composite
def _kwargs(draw: Any) -> dict[str, Any]:
    return {
        "lr": draw(st.sampled_from([0.01, 0.02, 0.1])),
        "momentum": draw(st.sampled_from([0.0, 0.5, 0.9, 0.95])),
        "nesterov": draw(st.booleans()),
        "weight_decay": draw(st.sampled_from([0.0, 0.1])),
        "ns_steps": draw(st.sampled_from([1, 5, 8])),
        "ns_coefficients": draw(st.sampled_from([MUON_COEFFICIENTS, (3.0, -3.2, 1.2)])),
    }


def configs() -> st.SearchStrategy[ShampooConfig]:
    """Configs ``torch.optim.Muon`` expresses: its own kwargs, mapped."""
    return _kwargs().map(from_kwargs)


def base_config() -> ShampooConfig:
    """Its config nearest ``ShampooConfig()``: lr 0.01, no momentum, no weight decay."""
    return from_kwargs({"lr": 0.01, "momentum": 0.0, "nesterov": False, "weight_decay": 0.0})


def defaults_config() -> ShampooConfig:
    """The spec's config nearest ``torch.optim.Muon(params)``."""
    return from_kwargs(USER_KWARGS)


def _construct(tensors: list[torch.nn.Parameter], kwargs: dict[str, Any]) -> torch.optim.Muon:
    return torch.optim.Muon(tensors, **kwargs)


def _optimizer(config: ShampooConfig, tensors: list[torch.nn.Parameter],
               dtype: Any) -> torch.optim.Muon:
    return _construct(tensors, muon_kwargs(config))


_NOT_2D = f"torch.optim.Muon raises ValueError for every non-2-D parameter ({_SRC}:129-133)"


def run(config: ShampooConfig, params: dict[str, np.ndarray],
        grads: list[dict[str, np.ndarray]], dtype: Any = np.float64,
        ) -> list[dict[str, np.ndarray]]:
    """The parameters after each step; a problem with a non-matrix is refused."""
    muon_kwargs(config)
    matrices_only(BACKEND, params, _NOT_2D)
    return run_optimizer(BACKEND, _optimizer, config, params, grads, dtype)


def library_run(kwargs: dict[str, Any], params: dict[str, np.ndarray],
                grads: list[dict[str, np.ndarray]], dtype: Any = np.float64) -> LibraryRun:
    """``torch.optim.Muon(params, **kwargs)`` stepped as a user steps it."""
    return torch_library_run(_construct, kwargs, params, grads, dtype)


def stepper(optimizer: str, params: dict[str, np.ndarray], *, lr: float,
            config: ShampooConfig | None = None, weight_decay: float = 0.0,
            dtype: Any = np.float64) -> Stepper:
    """A closed-loop Stepper: ``torch.optim.Muon`` from ``config`` with rate ``lr``
    (default :func:`base_config`), or torch's AdamW."""
    matrices_only(BACKEND, params, _NOT_2D)
    return make_stepper(BACKEND, _optimizer, optimizer, params, lr, config, weight_decay,
                        base_config(), dtype)


#: Its own argument sets: defaults at Muon's usual lr, without Nesterov, Modula's
#: coefficients (p(1) = 1) with more iterations and no decay.
CASES: dict[str, ShampooConfig] = {
    "defaults": from_kwargs({"lr": 0.02}),
    "no_nesterov": from_kwargs({"lr": 0.02, "nesterov": False, "momentum": 0.9}),
    "modula": from_kwargs({"lr": 0.02, "ns_coefficients": (3.0, -3.2, 1.2), "ns_steps": 8,
                           "weight_decay": 0.0}),
}

#: The suite's problems for its deviations: matrices only (it refuses the rest).
WIDE: dict[str, tuple[int, ...]] = {"w": (7, 10), "row": (1, 6)}
TALL: dict[str, tuple[int, ...]] = {"w": (10, 7)}

DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        name="bfloat16_newton_schulz",
        config=from_kwargs({"lr": 0.02, "momentum": 0.0, "weight_decay": 0.0}),
        shapes=WIDE,
        tests=("test_library_case_*", "test_library_defaults_*", "test_random_config_*",
               "test_spectral_descent_*"),
        cause=(f"the Newton-Schulz iteration runs in bfloat16 whatever the parameters' dtype "
               f"(grad.bfloat16(), {_SRC}:55; its products and sums in bfloat16, :61-66); "
               "eq. (16c) runs in the working precision: every step's direction is off by "
               "about 2^-8 relative"),
        kind="design",
    ),
    Deviation(
        name="tall_matrix_lr_factor",
        config=None,
        tests=(),
        cause=(f"adjust_lr_fn None / 'original' (its default) multiplies lr by "
               f"sqrt(max(1, A / B)) for a parameter of shape (A, B) ({_SRC}:77-79, :338): "
               "a tall matrix steps sqrt(A / B) times further; the spec's learning rate is "
               "one for every parameter (hidden here by the bfloat16 deviation)"),
        kind="design",
    ),
    Deviation(
        name="norm_floor",
        config=None,
        tests=(),
        cause=(f"X / max(||X||_F, eps) with eps = 1e-7 ({_SRC}:24, :59), computed in "
               "bfloat16; eq. (16c) floors at 1e-8: differs only for ||F~|| < 1e-7"),
        kind="design",
    ),
    Deviation(
        name="non_matrix_refused",
        config=None,
        # The random-config property draws shapes, mostly not matrices: run refuses those
        # examples and Hypothesis stops on its filter_too_much health check.
        tests=("test_library_defaults_*", "test_side_effect_grads_unchanged*",
               "test_side_effect_global_rng_unchanged*",
               "test_side_effect_float64_stays_float64*", "test_random_config_*"),
        cause=(f"{_NOT_2D}: a user puts vectors and tensors in another optimizer; the spec "
               "leaves them to the graft (skip_rank_lt = 2). The suite's problems with a "
               "non-matrix are refused by run (skipped); library_run raises as torch does"),
        kind="design",
    ),
)
