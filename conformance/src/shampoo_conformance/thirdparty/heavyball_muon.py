"""The ``heavyball-muon`` backend: heavyball 3.2.1's ``Muon``, as shipped.

``heavyball.Muon`` (heavyball/__init__.py:684-737) chains a momentum transform
and ``orthogonalize_update`` (chainable.py:1163-1170), then
``W <- W (1 - lr wd) - lr U`` (``update_param_``, utils.py:2430-2446: eq. 21's
update decay). In the spec's terms (:mod:`.muon`):

- Nesterov (its default): ``nesterov_ema`` (chainable.py:1181-1182,
  utils.py:797-799): F_t = lerp(F_{t-1}, G, 1 - beta), U = G + F_t =
  2 (beta/2 F_{t-1} + (1 - beta/2) G): eq. (15)'s F~ with beta3 = beta / 2,
  times 2; without: ``exp_avg`` (chainable.py:696-697) with the debiased weight
  (utils.py:340-343): F_t / (1 - beta^t), eq. (15) bias-corrected; beta =
  ``betas[0]`` (utils.py:1095-1103);
- a parameter of rank >= 2 is flattened to (d_0, d_1 ... d_k) (chainable.py:1168:
  ``blocking.merge_dims_up_to`` unlimited, target rank 2), divided by
  ``max(||X||_F, 1e-7)`` and run through **five** Newton-Schulz iterations, each
  with its own (a, b, c) (``zeropower_via_newtonschulz5``, utils.py:581-609), in
  float64 for float64 and in bfloat16, stochastically rounded, otherwise
  (utils.py:586, :2398-2411), then times ``sqrt(max(1, rows / cols))``
  (utils.py:838-839); a vector or scalar is left as U (chainable.py:1164-1165:
  ``skip_rank_lt = 2``, P = F~).

No config says one triple per iteration: the config is Muon's coefficients with
5 iterations, the nearest (DEVIATIONS). :func:`run` passes ``storage_dtype`` =
the parameters' dtype (its float32 default would round the momentum of float64
parameters). torch.compile is off (``heavyball.utils.compile_mode = None``, as
:mod:`.heavyball_soap`).
"""

from __future__ import annotations

from typing import Any

import heavyball
import numpy as np
import torch
from hypothesis import strategies as st

from shampoo_conformance.adapters.torch import Stepper
from shampoo_conformance.adapters.torch_user_run import torch_library_run
from shampoo_conformance.thirdparty.muon import (
    MUON_COEFFICIENTS,
    kwargs_or_reason,
    muon_config,
    refuse_differences,
    update_decay,
)
from shampoo_conformance.thirdparty.registry import Deviation, LibraryRun
from shampoo_conformance.thirdparty.torch_library import make_stepper, run_optimizer
from shampoo_spec import Inexpressible, ShampooConfig

# Eager execution (as heavyball_soap): utils.decorator_knowngood compiles unless None.
heavyball.utils.compile_mode = None

BACKEND = "heavyball-muon"
_UTILS = "heavyball/utils.py"
_CHAIN = "heavyball/chainable.py"

dtypes = (np.float64, np.float32)

#: The arguments of ``heavyball.Muon`` this backend reads, at their defaults
#: (heavyball/__init__.py:694-719).
DEFAULTS: dict[str, Any] = {
    "lr": 0.0025, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0,
    "nesterov": True, "heavyball_momentum": False, "warmup_steps": 0,
    "cautious_weight_decay": False, "mars": False, "caution": False,
}
#: Arguments with no effect on this backend's numerics (beta2 and eps are not read by
#: Muon's transforms; storage_dtype is the parameters' dtype in run).
NEUTRAL = ("storage_dtype", "multi_tensor", "beta2_scale", "mars_gamma", "compile_step",
           "promote")

#: What a user must pass: nothing (lr defaults to 0.0025).
USER_KWARGS: dict[str, Any] = {}


def from_kwargs(kwargs: dict[str, Any]) -> ShampooConfig:
    """The config ``heavyball.Muon(params, **kwargs)`` runs, its coefficient schedule read
    as Muon's (DEVIATIONS); raises :class:`Inexpressible` for what no config says."""
    k = {**DEFAULTS, **kwargs}
    other = sorted(set(kwargs) - set(DEFAULTS) - set(NEUTRAL))
    bad = [f"{name} = {k[name]!r}" for name in ("heavyball_momentum", "cautious_weight_decay",
                                                   "mars", "caution") if k[name]]
    if k["warmup_steps"]:
        bad.append(f"warmup_steps = {k['warmup_steps']!r} (lr ramp, {_CHAIN}:2594)")
    if other:
        bad.append(f"{', '.join(other)} (left at heavyball's defaults here)")
    if bad:
        raise Inexpressible(f"{BACKEND} cannot express: " + "; ".join(bad))
    beta, nesterov = float(k["betas"][0]), bool(k["nesterov"])
    return muon_config(lr=k["lr"], beta1=beta, nesterov=nesterov,
                       beta3=beta / 2 if nesterov else None, bias_correction=not nesterov,
                       coefficients=MUON_COEFFICIENTS, steps=5,
                       weight_decay=k["weight_decay"], merge=True)


def muon_kwargs(config: ShampooConfig) -> dict[str, Any]:
    """``heavyball.Muon``'s kwargs for ``config``; raises :class:`Inexpressible` naming
    every field they cannot say."""
    f = config.gradient_filter
    kwargs = {"lr": config.learning_rate, "betas": (f.beta1, 0.99),
              "nesterov": f.beta1 > 0 and f.beta3 is not None,
              "weight_decay": update_decay(config, BACKEND)}
    refuse_differences(BACKEND, config, from_kwargs(kwargs))
    return kwargs


def expressible(config: ShampooConfig, dtype: Any = np.float64) -> str | None:
    """Why ``heavyball.Muon`` cannot run ``config``, or None."""
    return kwargs_or_reason(muon_kwargs, config)


@st.composite
def _kwargs(draw: Any) -> dict[str, Any]:
    return {
        "lr": draw(st.sampled_from([0.01, 0.02, 0.1])),
        "betas": (draw(st.sampled_from([0.0, 0.5, 0.9, 0.95])), 0.99),
        "nesterov": draw(st.booleans()),
        "weight_decay": draw(st.sampled_from([0.0, 0.1])),
    }


def configs() -> st.SearchStrategy[ShampooConfig]:
    """Configs ``heavyball.Muon`` expresses: its own kwargs, mapped."""
    return _kwargs().map(from_kwargs)


def base_config() -> ShampooConfig:
    """Its config nearest ``ShampooConfig()``: lr 0.01, no momentum, no weight decay."""
    return from_kwargs({"lr": 0.01, "betas": (0.0, 0.99), "nesterov": False})


def defaults_config() -> ShampooConfig:
    """The spec's config nearest ``heavyball.Muon(params)``."""
    return from_kwargs(USER_KWARGS)


def _construct(tensors: list[torch.nn.Parameter], kwargs: dict[str, Any]) -> heavyball.Muon:
    return heavyball.Muon(tensors, **kwargs)


def _optimizer(config: ShampooConfig, tensors: list[torch.nn.Parameter],
               dtype: Any) -> heavyball.Muon:
    return _construct(tensors, {**muon_kwargs(config),
                                "storage_dtype": np.dtype(dtype).name})


def run(config: ShampooConfig, params: dict[str, np.ndarray],
        grads: list[dict[str, np.ndarray]], dtype: Any = np.float64,
        ) -> list[dict[str, np.ndarray]]:
    """The parameters after each step of ``grads``."""
    muon_kwargs(config)
    return run_optimizer(BACKEND, _optimizer, config, params, grads, dtype)


def library_run(kwargs: dict[str, Any], params: dict[str, np.ndarray],
                grads: list[dict[str, np.ndarray]], dtype: Any = np.float64) -> LibraryRun:
    """``heavyball.Muon(params, **kwargs)`` stepped as a user steps it."""
    return torch_library_run(_construct, kwargs, params, grads, dtype)


def stepper(optimizer: str, params: dict[str, np.ndarray], *, lr: float,
            config: ShampooConfig | None = None, weight_decay: float = 0.0,
            dtype: Any = np.float64) -> Stepper:
    """A closed-loop Stepper: ``heavyball.Muon`` from ``config`` with rate ``lr``
    (default :func:`base_config`), or torch's AdamW."""
    return make_stepper(BACKEND, _optimizer, optimizer, params, lr, config, weight_decay,
                        base_config(), dtype)


CASES: dict[str, ShampooConfig] = {
    "defaults": from_kwargs({"lr": 0.02}),
    "no_nesterov": from_kwargs({"lr": 0.02, "nesterov": False, "weight_decay": 0.1}),
}

#: Problems that isolate one cause: vectors only (no Newton-Schulz), lr 2^-6 exact in
#: float32 (no float32_learning_rate).
VECTORS: dict[str, tuple[int, ...]] = {"b": (7,), "c": (12,)}

DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        name="coefficient_schedule",
        config=from_kwargs({"lr": 2.0 ** -6, "nesterov": False}),
        shapes={"w": (7, 10)},
        tests=("test_library_case_*", "test_library_defaults_*", "test_random_config_*",
               "test_spectral_descent_*"),
        cause=(f"five Newton-Schulz iterations, each with its own (a, b, c) "
               f"((4.0848, -6.8946, 2.9270), ... (2.8366, -3.0525, 1.2012), {_UTILS}:591-597), "
               "whatever ns_steps; eq. (16c) iterates one triple (imported as Muon's): every "
               "matrix's direction differs"),
        kind="design",
    ),
    Deviation(
        name="tall_matrix_scale",
        config=None,
        tests=(),
        cause=(f"the orthogonalized update is multiplied by sqrt(max(1, rows / cols)) "
               f"({_UTILS}:838-839, scale_mode 'scale' of orthogonalize_update, {_CHAIN}:1163): "
               "a tall matrix steps further; hidden here by coefficient_schedule"),
        kind="design",
    ),
    Deviation(
        name="nesterov_vector_doubled",
        config=from_kwargs({"lr": 2.0 ** -6}),
        shapes=VECTORS,
        tests=("test_library_case_*[[]defaults]",),
        cause=(f"its Nesterov direction G + F_t ({_UTILS}:797-799) is 2 (beta/2 F_(t-1) + "
               "(1 - beta/2) G): a matrix's Newton-Schulz does not see the 2, a vector or "
               "scalar (left unorthogonalized) steps twice eq. (15)'s F~"),
        kind="design",
    ),
    Deviation(
        name="float32_learning_rate",
        config=from_kwargs({"lr": 0.02, "betas": (0.0, 0.99), "nesterov": False}),
        shapes=VECTORS,
        tests=(),
        cause=(f"lr = base_lr * step / step.clamp(min=warmup_steps + 1) with the int64 step "
               f"tensor ({_CHAIN}:2594) is a float32 tensor: float64 parameters move by "
               "fl32(lr) U (as heavyball-soap's)"),
        kind="defect",
    ),
    Deviation(
        name="float32_debias_weight",
        config=from_kwargs({"lr": 2.0 ** -6, "nesterov": False}),
        shapes=VECTORS,
        tests=(),
        cause=(f"without Nesterov the EMA's weight 1 - (1 - beta) / (1 - beta^t) (beta_debias, "
               f"{_UTILS}:340-343, called with the int64 step tensor, {_CHAIN}:696-697) is a "
               "float32 tensor: float64 momentum is formed with a weight rounded to float32"),
        kind="defect",
    ),
    Deviation(
        name="grad_consumed",
        config=None,
        tests=("test_side_effect_grads_unchanged*",),
        cause=("each step sets p.grad = None (StatefulOptimizer.consume_grad = True, "
               f"{_UTILS}:1542, :1659-1660): the caller's gradient is released, not kept"),
        kind="design",
    ),
    Deviation(
        name="float32_storage_default",
        config=None,
        tests=("test_library_defaults_float64*",),
        cause=("storage_dtype = 'float32' by default: the momentum of float64 parameters is "
               "kept in float32 (run passes the parameters' dtype)"),
        kind="design",
    ),
    Deviation(
        name="bfloat16_stochastic_rounding",
        config=None,
        tests=("test_side_effect_global_rng_unchanged*",),
        cause=(f"for float32 (any dtype but float64) the normalized matrix is stochastically "
               f"rounded to bfloat16 ({_UTILS}:586, :2398-2411), with noise from torch's "
               "global generator (torch.randint_like): the run draws from the caller's "
               "stream and its bfloat16 iteration is off by about 2^-8"),
        kind="design",
    ),
)
