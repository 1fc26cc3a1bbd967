"""The ``pytorch-optimizer-soap`` backend: pytorch-optimizer 4.1.0's ``SOAP`` as shipped.

``pytorch_optimizer.SOAP`` (``pytorch_optimizer/optimizer/soap.py``) is the
authors' SOAP (:mod:`.soap` has the algorithm in the spec's terms). Its own
rules, read from its source (line numbers in that file):

- step 1 builds the statistics and the first eigenbasis (``init_group``,
  :88-128; ``eigh(L + 1e-30 I)`` flipped to descending, :160-179) and moves
  nothing (:303-304);
- step t >= 2 (n = t - 1): the gradient rotated by the stored basis enters
  ``exp_avg_sq`` (D), ``exp_avg`` (F, in the parameter's basis) takes the
  gradient, the direction is ``F x_k Q_k^T / (sqrt(D) + eps)`` rotated back, and
  the step size ``lr sqrt(1 - b2^n) / (1 - b1^n)`` (``correct_bias``, :310-314,
  :326-347): epsilon is added to the uncorrected sqrt(D);
- ``W <- W - step_size P``, then ``W <- W (1 - lr weight_decay)`` (:352-361);
- then the statistics take G_t (``lerp_`` with weight 1 - shampoo_beta) and,
  when ``n % precondition_frequency == 0``, each factor's basis is one QR step
  ``QR(L_k Q_k)`` with the columns sorted by descending Rayleigh quotient, D
  permuted along (:181-223, :363-370), the QR in float32 (:205-211);
- ``merge_dims=True`` reshapes by pytorch-optimizer's ``merge_small_dims``,
  which makes a shape of at most ``max_precondition_dim`` elements ``[1]``: the
  reshape raises (``DEVIATIONS["merge_dims_crash"]``); a dim above
  ``max_precondition_dim`` is left unpreconditioned: this backend passes
  ``merge_dims=False`` (the default) and a ``max_precondition_dim`` no dim exceeds;
  ``normalize_gradient`` and ``maximize`` say nothing the spec says, so
  :func:`from_kwargs` refuses them.

In the spec's terms: :func:`.soap.soap_config` with ``period_anchor="start"``
(bases from the statistics of steps 1, 1 + f, 1 + 2f, ...), no ridge before
the QR step (``epsilon.placement = "floor"``, which eq. 17 does not read),
bias corrections of the filter and of D both ``correct_bias``.
:data:`DEVIATIONS` lists what no config says.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from pytorch_optimizer import SOAP

from shampoo_conformance.adapters.torch_user_run import torch_library_run
from shampoo_conformance.thirdparty.pytorch_optimizer_deviations import (
    grad_negated_by_maximize,
    unknown_arguments_swallowed,
)
from shampoo_conformance.thirdparty.pytorch_optimizer_kwargs import SRC
from shampoo_conformance.thirdparty.registry import Deviation, LibraryRun
from shampoo_conformance.thirdparty.soap import NO_DIM_LIMIT, first_step_skipped, soap_config
from shampoo_conformance.thirdparty.soap_backend import SoapBackend
from shampoo_spec import Inexpressible, ShampooConfig
from shampoo_spec.config import EpsilonConfig

#: Parameter dtypes this backend runs (its statistics, bases and moments follow them;
#: its QR is float32 whatever they are).
dtypes = (np.float64, np.float32)

BACKEND = "pytorch-optimizer-soap"

#: Its constructor's defaults (soap.py:33-50).
DEFAULTS: dict[str, Any] = {
    "lr": 3e-3, "betas": (0.95, 0.95), "shampoo_beta": None, "weight_decay": 1e-2,
    "precondition_frequency": 10, "max_precondition_dim": 10000, "merge_dims": False,
    "precondition_1d": False, "correct_bias": True, "normalize_gradient": False,
    "data_format": "channels_first", "eps": 1e-8, "maximize": False,
}

#: No ridge before its QR step (soap.py:198-210); eq. (17) reads no other epsilon.
EPSILON = EpsilonConfig(placement="floor")


def from_kwargs(kwargs: dict[str, Any]) -> ShampooConfig:
    """The config ``SOAP(**kwargs)`` runs (module docstring); raises :class:`Inexpressible`
    for the arguments no config says."""
    k = {**DEFAULTS, "max_precondition_dim": NO_DIM_LIMIT, **kwargs}
    bad = []
    if k["merge_dims"]:
        bad.append("merge_dims=True (its merge_small_dims rule, utils/shape.py:4-29; "
                   "a dim above max_precondition_dim is then left unpreconditioned)")
    if k["max_precondition_dim"] < NO_DIM_LIMIT:
        bad.append(f"max_precondition_dim = {k['max_precondition_dim']!r}: a dim above it "
                   "is left unpreconditioned (soap.py:236-249), a rule per dim the spec has "
                   "no field for")
    if k["normalize_gradient"]:
        bad.append("normalize_gradient=True (the direction divided by its rms, soap.py:349-350)")
    if k["maximize"]:
        bad.append("maximize=True")
    if bad:
        raise Inexpressible(f"{BACKEND} cannot express: " + "; ".join(bad))
    beta1, beta2 = k["betas"]
    return soap_config(
        lr=k["lr"], betas=(beta1, beta2),
        shampoo_beta=beta2 if k["shampoo_beta"] is None else k["shampoo_beta"],
        eps=k["eps"], weight_decay=k["weight_decay"], frequency=k["precondition_frequency"],
        precondition_1d=k["precondition_1d"], correct_bias=k["correct_bias"],
        period_anchor="start", epsilon=EPSILON, statistics_bias_correction=False,
    )


@st.composite
def _kwargs(draw: Any) -> dict[str, Any]:
    """``SOAP`` kwargs (merge_dims off, no dim limit: :func:`from_kwargs`)."""
    return {
        "lr": draw(st.sampled_from([0.01, 0.1])),
        "betas": (draw(st.sampled_from([0.0, 0.5, 0.9])),
                  draw(st.sampled_from([0.9, 0.95, 0.99]))),
        "shampoo_beta": draw(st.sampled_from([None, 0.5, 0.9])),
        "weight_decay": draw(st.sampled_from([0.0, 0.01])),
        "precondition_frequency": draw(st.integers(1, 3)),
        "precondition_1d": draw(st.booleans()),
        "correct_bias": draw(st.booleans()),
        "eps": draw(st.sampled_from([1e-8, 1e-6])),
    }


def _library_kwargs(config: ShampooConfig) -> dict[str, Any]:
    """What this backend passes besides the common SOAP kwargs: ``correct_bias``,
    nothing merged, no dim limit."""
    return {"correct_bias": config.gradient_filter.bias_correction,
            "merge_dims": False, "max_precondition_dim": NO_DIM_LIMIT}


def _construct(tensors: list[torch.nn.Parameter], kwargs: dict[str, Any], dtype: Any) -> SOAP:
    return SOAP(tensors, **kwargs)


_BACKEND = SoapBackend(BACKEND, from_kwargs, _library_kwargs, _construct, _kwargs)
#: The functions of a third-party adapter (:mod:`.registry`), as every SOAP backend has them.
soap_kwargs, expressible, configs, base_config, run, stepper = (
    _BACKEND.soap_kwargs, _BACKEND.expressible, _BACKEND.configs, _BACKEND.base_config,
    _BACKEND.run, _BACKEND.stepper)


#: Its own argument sets on the suite's named problem: its defaults (lr 0.1), without
#: bias correction, with vectors preconditioned, with weight decay, bases every 3 steps.
CASES: dict[str, ShampooConfig] = {
    "defaults": from_kwargs({"lr": 0.1}),
    "no_bias_correction": from_kwargs({"lr": 0.1, "correct_bias": False,
                                       "precondition_frequency": 1}),
    "precondition_1d": from_kwargs({"lr": 0.1, "precondition_1d": True, "shampoo_beta": 0.9,
                                    "precondition_frequency": 1}),
    "weight_decay": from_kwargs({"lr": 0.1, "weight_decay": 0.1, "betas": (0.9, 0.99),
                                 "precondition_frequency": 3}),
}

#: What a user gives ``SOAP`` besides the parameters: a learning rate (as the other
#: adapters' users), every other argument at its default (:data:`DEFAULTS`).
USER_KWARGS: dict[str, Any] = {"lr": 0.01}


def defaults_config() -> ShampooConfig:
    """The config ``SOAP(params, **USER_KWARGS)`` runs: its defaults (betas (0.95,
    0.95), shampoo_beta = betas[1], weight decay 0.01, a new basis every 10 steps,
    merge_dims=False, vectors not preconditioned, eps 1e-8) imported. Its
    ``max_precondition_dim=10000`` is read as no limit (:func:`from_kwargs` has no
    field for a per-dim limit): no dim of the problems its defaults run on exceeds it."""
    return from_kwargs(USER_KWARGS)


def library_run(kwargs: dict[str, Any], params: dict[str, np.ndarray],
                grads: list[dict[str, np.ndarray]], dtype: Any = np.float64) -> LibraryRun:
    """``SOAP(params, **kwargs)`` stepped as a user steps it (the registry's
    ``library_run``): exactly ``kwargs``, the caller's generators, nothing seeded."""
    return torch_library_run(lambda tensors, kw: SOAP(tensors, **kw), kwargs, params, grads,
                             dtype)


_SOAP = f"{SRC}/soap.py"

#: Where pytorch-optimizer's SOAP differs from the spec (docs/third-party.md has the
#: sizes measured by the model of conformance/tests/test_adapter_soap.py, each alone).
DEVIATIONS: tuple[Deviation, ...] = (
    first_step_skipped(from_kwargs({"lr": 0.1, "precondition_frequency": 1}),
                       f"{_SOAP}:88-128, :303-304",
                       ("test_library_defaults_float64", "test_library_defaults_float32")),
    Deviation(
        name="stale_basis",
        config=None,
        tests=(),
        cause=(f"the basis a step rotates with (for D and the direction) is computed from "
               f"the statistics through the step before: the statistics take G_t and the new "
               f"basis is computed after the parameter moved ({_SOAP}:326-347, then :363-370); "
               "eq. (17) refreshes the basis from this step's statistics first "
               "(roots_take_effect='next_step' is refused with eigenvalue correction)"),
        kind="design",
    ),
    Deviation(
        name="eigh_first_basis",
        config=None,
        tests=(),
        cause=(f"the first basis is a full eigendecomposition of the first statistics "
               f"({_SOAP}:160-179, :286-287), the later ones one QR step from it; eq. (17c) "
               "takes its QR step from the identity at the first root step too"),
        kind="design",
    ),
    Deviation(
        name="qr_column_order",
        config=None,
        tests=(),
        cause=(f"the QR step factors L Q with Q's columns sorted by descending Rayleigh "
               f"quotient (D permuted along, {_SOAP}:198-211), eq. (17c) (Meta's) the "
               "stored order, sorting ascending after: a QR step depends on the order "
               "of its columns"),
        kind="design",
    ),
    Deviation(
        name="float32_qr",
        config=None,
        tests=(),
        cause=(f"the QR step is computed in float32 whatever the parameters' dtype "
               f"(`torch.linalg.qr(power_iter.to(torch.float32))`, {_SOAP}:205-211; its "
               "comment's reason is bfloat16): float64 bases are float32-accurate"),
        kind="defect",
    ),
    Deviation(
        name="epsilon_before_bias_correction",
        config=None,
        tests=(),
        cause=(f"epsilon is added to the uncorrected sqrt(D) and the bias corrections go "
               f"into the step size ({_SOAP}:310-314, :335): in the spec's terms the "
               "epsilon of eq. (17) is eps / sqrt(1 - b2^n), not a constant"),
        kind="design",
    ),
    Deviation(
        name="decay_after_update",
        config=None,
        tests=(),
        cause=(f"the decoupled weight decay multiplies the parameter after the update "
               f"({_SOAP}:352-361), so it decays the update too: (W - s P)(1 - lr wd), "
               "eq. (21) W (1 - lr wd) - lr P"),
        kind="design",
    ),
    Deviation(
        name="merge_dims_crash",
        config=None,
        tests=(),
        cause=(f"merge_dims=True reshapes each gradient to merge_small_dims(shape, "
               f"max_precondition_dim) ({_SOAP}:81-86, :143-147, :243), and that rule "
               f"({SRC}/utils/shape.py:18-29) returns [1] for a shape whose elements all fit "
               "in max_precondition_dim (10000 by default): every such parameter ((7, 10), "
               "(5,), (3, 4, 5), (1, 6)) raises RuntimeError \"shape '[1]' is invalid for "
               "input of size N\" at its first step (the importer refuses merge_dims=True; "
               "the adapter tests demonstrate the crash)"),
        kind="defect",
    ),
    unknown_arguments_swallowed("SOAP", f"{_SOAP}:49"),
    grad_negated_by_maximize("SOAP", f"{_SOAP}:318-322"),
)

