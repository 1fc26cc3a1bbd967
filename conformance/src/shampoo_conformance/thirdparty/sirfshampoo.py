"""The ``sirfshampoo`` backend: Lin et al.'s structured inverse- and root-free Shampoo.

sirfshampoo 0.0.1 (``from sirfshampoo import SIRFShampoo``; "Can We Remove the
Square-Root in Adaptive Gradient Methods?", Lin et al. 2024) keeps, per
parameter of rank N (each parameter its own group, ``optimizer.py:231-257``),
one factor K_n (d_n x d_n, from I) per dim and a Riemannian momentum m_n (from
0). On a preconditioner step (``global_step % T == 0``, 0-based, or ``T(step)``
true, :412), with B the batch size its forward hook counted, c_n = d_n^(-1/2),
K'_n = c_n K_n, GK = sqrt(B) G x_1 K'_1^T ... x_N K'_N^T and
tau_n = tr(K'_n^T K'_n) / d_n (:433-446):

    S_n = (lam/2) prod_{j != n} tau_j prod_j d_j K'_n^T K'_n
          + (d_n/2) GK_(n) GK_(n)^T - (1/2) I                       (:455-461)
    m_n <- alpha2 m_n + (1 - alpha2) S_n                             (:464-465)
    K_n <- K_n - beta2 / max(1, ||m_n||_F) K_n m_n                   (:468)

(a first-order truncation of K exp(-beta2 m)). Every step the direction is
P = G x_1 K_1 K_1^T ... x_N K_N K_N^T (scaled by s_n = max(1, sqrt(max|K_n|))
and back, :488-501), then P <- P + kappa W, M <- alpha1 M + P,
W <- W - lr M (:386-400; without momentum W <- W - lr P).

What the spec cannot express: K_n K_n^T is not a function of the gradient
statistics. Eq. (6) accumulates L = sum beta2^i G G^T and eqs. (9)-(13) take
X = (L + eps I)^(-1/r) by an eigendecomposition or coupled Newton; SIRFShampoo
has no L at all, and its K_n follows the multiplicative update above (a
Riemannian natural-gradient step on the factor, whose fixed point is
K K^T ~ (E[GK GK^T] + lam ...)^(-1), i.e. an exponent -1 on a
trace-coupled, damped, batch-size-scaled statistic; its path is not any
eq. (6)'s root). So eqs. (6), (9)-(13) and (16)'s X_k are replaced, for every
config that preconditions (:data:`REASON`). Its ``structures`` accept only
``"dense"`` in 0.0.1 (:48, :286-298: "diagonal" and the others are refused by
the library itself); ``preconditioner_dtypes`` sets K's dtype (eq. 11a/11b's
storage, but of K, not of a root).

The one setting the spec expresses: ``T`` a callable that is never true
(:func:`never`). K stays I (s_n = 1, exact), P = G, and the update is SGD with
heavy-ball momentum (eq. 20, dampening 0, no Nesterov, lr after momentum) and
eq. (19)'s direction weight decay kappa, the grafted method throughout
(``schedule.start_preconditioning_step = None``, SGD graft, eq. 8):
:func:`from_kwargs` imports it, :func:`run` runs it, CASES test it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import numpy as np
import torch
from hypothesis import strategies as st
from sirfshampoo import SIRFShampoo

from shampoo_conformance.adapters.torch import Stepper
from shampoo_conformance.adapters.torch_user_run import torch_library_run
from shampoo_conformance.thirdparty.registry import Deviation, LibraryRun
from shampoo_conformance.thirdparty.torch_library import make_stepper, run_optimizer
from shampoo_spec import Inexpressible, ShampooConfig, config_differences
from shampoo_spec.config import (
    GraftingConfig,
    MomentumConfig,
    ScheduleConfig,
    WeightDecayConfig,
)

SRC = "sirfshampoo/optimizer.py"
#: Parameter dtypes it runs (its factors follow the parameters' dtype by default).
dtypes = (np.float64, np.float32)

#: Why no config that preconditions is expressible (module docstring).
REASON = (
    "SIRFShampoo replaces eqs. (6) and (9)-(13): it keeps no statistics L and takes no "
    "inverse root; each factor K_n (the direction's K_n K_n^T in place of eq. 16's X_k) "
    "follows a Riemannian update K_n <- K_n - beta2/max(1, ||m_n||_F) K_n m_n, m_n an "
    "alpha2-average of (lam/2) tr-coupled K^T K + (d_n/2) GK GK^T - I/2 "
    f"({SRC}:455-468), whose path is no eq. (6) root; only T never true "
    "(schedule.start_preconditioning_step = None, the SGD graft with heavy-ball momentum "
    "and direction weight decay) is expressible")

#: What a user must give besides the model: nothing (lr has a default, 0.001).
USER_KWARGS: dict[str, Any] = {}

#: Its constructor's defaults (:54-66).
DEFAULTS: dict[str, Any] = {"lr": 0.001, "beta2": 0.01, "alpha1": 0.9, "alpha2": 0.5,
                            "lam": 0.001, "kappa": 0.0, "T": 1, "structures": "dense",
                            "preconditioner_dtypes": None}


def never(step: int) -> bool:
    """``T`` that never updates the factors: they stay I (module docstring)."""
    return False


class _Model(torch.nn.Module):
    """The parameters as a model (its constructor's first argument), whose forward
    takes a batch and computes nothing: calling it lets the library's hook count the
    batch size, as a user's forward pass does."""

    def __init__(self, tensors: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList(tensors)

    def forward(self, batch: torch.Tensor) -> None:
        return None


class _UserLoop:
    """A user's loop: a forward pass of one sample, then ``step()``."""

    def __init__(self, model: _Model, optimizer: SIRFShampoo) -> None:
        self.model, self.optimizer = model, optimizer

    def step(self) -> None:
        self.model(torch.zeros(1, 1))
        self.optimizer.step()


def construct(tensors: list[torch.nn.Parameter], kwargs: dict[str, Any]) -> _UserLoop:
    """``SIRFShampoo(model, **kwargs)`` over the parameters wrapped as a model."""
    model = _Model(tensors)
    return _UserLoop(model, SIRFShampoo(model, **kwargs))


def from_kwargs(kwargs: dict[str, Any]) -> ShampooConfig:
    """The config ``SIRFShampoo(model, **kwargs)`` runs; :class:`Inexpressible` (the
    :data:`REASON`) unless ``T`` is :func:`never`."""
    k = {**DEFAULTS, **kwargs}
    unknown = set(k) - set(DEFAULTS) - {"batch_size", "verbose_init", "params"}
    if unknown:
        raise ValueError(f"SIRFShampoo has no argument {sorted(unknown)} (TypeError there)")
    if k["T"] is not never:
        raise Inexpressible(f"sirfshampoo: T = {k['T']!r}: {REASON}")
    return ShampooConfig(
        learning_rate=k["lr"],
        grafting=GraftingConfig(type="sgd"),
        momentum=MomentumConfig(momentum=k["alpha1"], dampening=0.0, nesterov=False,
                                learning_rate_placement="after_momentum"),
        weight_decay=WeightDecayConfig(value=k["kappa"], type="direction"),
        schedule=ScheduleConfig(start_preconditioning_step=None),
        factor_dtype="float64",
    )


def _kwargs_for(config: ShampooConfig) -> dict[str, Any]:
    return {"lr": config.learning_rate, "alpha1": config.momentum.momentum,
            "kappa": config.weight_decay.value, "T": never}


def expressible(config: ShampooConfig, dtype: Any = np.float64) -> str | None:
    """Why SIRFShampoo cannot run ``config``, or None (T never true, module docstring)."""
    if config.schedule.start_preconditioning_step is not None:
        return REASON
    try:
        image = from_kwargs(_kwargs_for(config))
    except (ValueError, Inexpressible) as err:
        return str(err)
    differences = config_differences(dataclasses.replace(image, factor_dtype=config.factor_dtype),
                                     config)
    return None if not differences else f"{differences}; {REASON}"


@st.composite
def _kwargs(draw: Any) -> dict[str, Any]:
    """Its kwargs with T never true (the one expressible setting)."""
    return {"lr": draw(st.sampled_from([0.01, 0.1, 0.5])),
            "alpha1": draw(st.sampled_from([0.0, 0.5, 0.9])),
            "kappa": draw(st.sampled_from([0.0, 0.01])), "T": never}


def configs() -> st.SearchStrategy[ShampooConfig]:
    """Configs it expresses: its kwargs with ``T`` = :func:`never`, imported."""
    return _kwargs().map(from_kwargs)


def base_config() -> ShampooConfig:
    """Its defaults with T never true and lr 0.1."""
    return from_kwargs({"lr": 0.1, "T": never})


#: Its own argument sets with T never true (K = I): defaults, no momentum, decay.
CASES: dict[str, ShampooConfig] = {
    "never_update_defaults": from_kwargs({"lr": 0.1, "T": never}),
    "never_update_no_momentum": from_kwargs({"lr": 0.1, "alpha1": 0.0, "T": never}),
    "never_update_weight_decay": from_kwargs({"lr": 0.1, "kappa": 0.01, "T": never}),
}

DEVIATIONS: tuple[Deviation, ...] = ()


def defaults_config() -> ShampooConfig:
    """Raises :class:`Inexpressible`: at its defaults (T = 1) it preconditions by its
    K update, which no config says (:data:`REASON`)."""
    return from_kwargs(USER_KWARGS)


def library_run(kwargs: dict[str, Any], params: dict[str, np.ndarray],
                grads: list[dict[str, np.ndarray]], dtype: Any = np.float64) -> LibraryRun:
    """``SIRFShampoo(model, **kwargs)`` stepped as a user steps it: one forward pass of
    one sample, then ``step()``, per step (its batch-size hook counts 1 each step)."""
    return torch_library_run(
        lambda tensors, kw: cast(torch.optim.Optimizer, construct(tensors, kw)),
        kwargs, params, grads, dtype)


def _optimizer(config: ShampooConfig, tensors: list[torch.nn.Parameter],
               dtype: Any) -> torch.optim.Optimizer:
    reason = expressible(config, dtype)
    if reason is not None:
        raise Inexpressible(f"backend 'sirfshampoo': {reason}")
    # T never true: K stays I whatever the batch size, so no forward pass is needed.
    optimizer: torch.optim.Optimizer = SIRFShampoo(_Model(tensors), **_kwargs_for(config))
    return optimizer


def run(config: ShampooConfig, params: dict[str, np.ndarray],
        grads: list[dict[str, np.ndarray]], dtype: Any = np.float64
        ) -> list[dict[str, np.ndarray]]:
    """The parameters (as ``dtype`` arrays) after each step of ``grads``."""
    return run_optimizer("sirfshampoo", _optimizer, config, params, grads, dtype)


def stepper(optimizer: str, params: dict[str, np.ndarray], *, lr: float,
            config: ShampooConfig | None = None, weight_decay: float = 0.0,
            dtype: Any = np.float64) -> Stepper:
    """A closed-loop Stepper: SIRFShampoo from ``config`` (default :func:`base_config`)
    with rate ``lr``, or torch's AdamW."""
    return make_stepper("sirfshampoo", _optimizer, optimizer, params, lr, config,
                        weight_decay, base_config(), dtype)
