"""The ``heavyball-klshampoo`` backend: heavyball 3.2.1's ``KLShampoo`` as shipped.

``heavyball.KLShampoo`` (heavyball/__init__.py:935-990) is KL-Shampoo (Lin et
al. 2025, arXiv 2509.03378) on SOAP's state: ``scale_by_kl_shampoo``
(heavyball/chainable.py:1342-1359). Per parameter W, read from the source:

- step 1 only initializes: ``GG_k = init_factor I`` per preconditioned dim and
  ``Q_k = eigh(GG_k)`` (``init_preconditioner``, heavyball/utils.py:1406-1434),
  or, with ``init_factor = 0``, ``GG_k = G_1 G_1^T`` as SOAP; W does not move
  and, with ``init_factor > 0``, G_1 enters nothing (``skip_first``,
  heavyball/chainable.py:366-377);
- step t >= 2: the momentum ``E <- b1 E + (1 - b1) G`` from zero, uncorrected
  (heavyball/chainable.py:1349: eq. 15's gradient filter), and the direction
  ``P = E x_k (Q_k diag(max(d_k, eps)^(-1/2)) Q_k^T)`` with ``d_k = diag(Q_k^T
  GG_k Q_k)`` from the factors before this step (``kl_shampoo_precondition``,
  heavyball/utils.py:1306-1322): eq. (16) with eq. (10f)'s roots, r = 2, held
  from the step before (eq. 13's ``roots_take_effect = "next_step"``);
- then the factors take the KL statistics of :mod:`.heavyball_kl` on ``G + noise``
  (``dampen_grad``, heavyball/utils.py:2818-2822: ``dampening`` (1e-9) plus
  2^-23 |G| times ``torch.randn``, drawn from torch's global generator), each
  refresh step refreshes the bases by one QR step, and the factors are rescaled
  to the geometric mean of their max-norms (``psgd_balance_Q``,
  heavyball/utils.py:2654-2661; ``factor_balance``: on a matrix, L c and R / c
  change no direction and no KL update but for eps's weight; the plain outer
  products of an order-3 tensor do not scale with it);
- ``W <- W (1 - lr wd) - lr P`` (``update_param_``).

This backend passes ``merge_dims=False``, a ``max_precond_dim`` no dim exceeds,
``storage_dtype`` = the parameters' dtype, ``dampening = 0`` (no noise: eq. 6b
takes the gradient) and ``init_factor = 0`` (statistics from G_1, eq. 6's
zero start); :func:`.heavyball_kl.kl_shampoo_config` is the config. What
no config says is :data:`DEVIATIONS`; conformance/tests/test_adapter_heavyball_kl.py
measures each one with a model of the library.
"""

from __future__ import annotations

from typing import Any

import heavyball
import numpy as np
import torch
from hypothesis import strategies as st

from shampoo_conformance.adapters.torch import Stepper
from shampoo_conformance.adapters.torch_user_run import torch_library_run
from shampoo_conformance.thirdparty import heavyball_kl as kl
from shampoo_conformance.thirdparty.registry import Deviation, LibraryRun
from shampoo_conformance.thirdparty.soap import FULL_RANK_SHAPES, NO_DIM_LIMIT
from shampoo_conformance.thirdparty.torch_library import in_dtype, make_stepper, run_optimizer
from shampoo_spec import Inexpressible, ShampooConfig, config_differences

#: Parameter dtypes this backend runs (its factors, bases and momentum follow them).
dtypes = (np.float64, np.float32)

BACKEND = "heavyball-klshampoo"
_KNOWN = set(kl.KL_SHAMPOO_DEFAULTS)

#: What a user must pass besides the parameters: nothing (every argument has a default).
USER_KWARGS: dict[str, Any] = {}


def from_kwargs(kwargs: dict[str, Any], *, strict: bool = True) -> ShampooConfig:
    """The config ``heavyball.KLShampoo(**kwargs)`` runs (module docstring); raises
    :class:`Inexpressible` for the arguments no config says (``strict=False``: the
    nearest config all the same, for :func:`defaults_config`)."""
    k = {**kl.KL_SHAMPOO_DEFAULTS, "max_precond_dim": NO_DIM_LIMIT, "merge_dims": False,
         "dampening": 0.0, "init_factor": 0.0, **kwargs}
    bad = kl.refuse_layout(k, _KNOWN, BACKEND)
    if k["dampening"] != 0:
        bad.append(f"dampening = {k['dampening']!r}: the statistics take G + (dampening + "
                   f"2^-23 |G|) * randn ({kl.UTILS}:2818-2822), noise eq. (6b) does not add")
    if not k["init_factor"] >= 0:
        bad.append(f"init_factor = {k['init_factor']!r} (>= 0)")
    if bad and strict:
        raise Inexpressible(f"{BACKEND} cannot express: " + "; ".join(bad))
    return kl.kl_shampoo_config(
        lr=k["lr"], betas=tuple(k["betas"]), shampoo_beta=k["shampoo_beta"], eps=k["eps"],
        weight_decay=k["weight_decay"], frequency=k["precondition_frequency"],
        precondition_1d=k["precondition_1d"])


def kl_kwargs(config: ShampooConfig) -> dict[str, Any]:
    """``heavyball.KLShampoo``'s arguments for ``config`` (params and storage_dtype
    aside); raises :class:`Inexpressible` naming every field they cannot say."""
    c = in_dtype(config, np.float64)
    override = {o.order: o.roots for o in c.exponents.overrides_by_order}
    kwargs = {
        "lr": c.learning_rate,
        "betas": (c.gradient_filter.beta1, kl.SOAP_DEFAULTS["betas"][1]),
        "shampoo_beta": c.statistics.beta2,
        "eps": c.epsilon.value,
        "weight_decay": c.weight_decay.value,
        "precondition_frequency": c.schedule.precondition_frequency,
        "precondition_1d": override.get(1, (2.0,)) != (0.0,),
        "merge_dims": False, "max_precond_dim": NO_DIM_LIMIT,
        "init_factor": 0.0, "dampening": 0.0,
    }
    try:
        nearest = from_kwargs(kwargs)
    except Inexpressible as err:  # e.g. beta2 = 1 sums
        raise Inexpressible(f"{BACKEND}: {err}") from err
    differences = config_differences(nearest, c)
    if differences:
        raise Inexpressible(f"{BACKEND} cannot express (field: what KLShampoo runs -> what "
                            "the config asks): " + "; ".join(differences))
    return kwargs


def expressible(config: ShampooConfig, dtype: Any = np.float64) -> str | None:
    """Why ``heavyball.KLShampoo`` cannot run ``config`` in ``dtype``, or None if it can."""
    try:
        kl_kwargs(config)
    except Inexpressible as err:
        return str(err)
    return None


@st.composite
def _kwargs(draw: Any) -> dict[str, Any]:
    """``heavyball.KLShampoo`` kwargs; periods whose 1 / f sums exactly to integers
    (DEVIATIONS["precondition_schedule_rounding"])."""
    return {
        "lr": draw(st.sampled_from([0.01, 0.1])),
        "betas": (draw(st.sampled_from([0.0, 0.5, 0.9])), 0.95),
        "shampoo_beta": draw(st.sampled_from([0.5, 0.9, 0.95])),
        "weight_decay": draw(st.sampled_from([0.0, 0.01])),
        "precondition_frequency": draw(st.sampled_from([1, 2, 4])),
        "precondition_1d": draw(st.booleans()),
        "eps": draw(st.sampled_from([1e-8, 1e-6])),
    }


def configs() -> st.SearchStrategy[ShampooConfig]:
    """Configs ``heavyball.KLShampoo`` expresses: its own kwargs, imported."""
    return _kwargs().map(from_kwargs)


def base_config() -> ShampooConfig:
    """Its defaults nearest ``ShampooConfig()``: lr 0.01, no weight decay, bases every
    step, nothing merged, no dim limit, no noise, statistics from G_1."""
    return from_kwargs({"lr": 0.01, "weight_decay": 0.0, "precondition_frequency": 1})


def defaults_config() -> ShampooConfig:
    """The config nearest ``heavyball.KLShampoo(params)`` at :data:`USER_KWARGS`: its
    defaults (lr 3e-3, weight decay 0.01, bases every 2 steps); merging, the noise and
    the identity start are deviations (:data:`DEVIATIONS`)."""
    return from_kwargs({**kl.KL_SHAMPOO_DEFAULTS, **USER_KWARGS}, strict=False)


def _construct(tensors: list[torch.nn.Parameter], kwargs: dict[str, Any],
               dtype: Any) -> heavyball.KLShampoo:
    return heavyball.KLShampoo(tensors, **kwargs, storage_dtype=kl.float64_storage(dtype))


def optimizer(config: ShampooConfig, tensors: list[torch.nn.Parameter],
              dtype: Any) -> heavyball.KLShampoo:
    """``heavyball.KLShampoo`` for ``config`` over ``tensors`` (refusing what it cannot say)."""
    reason = expressible(config, dtype)
    if reason is not None:
        raise Inexpressible(f"backend {BACKEND!r}: {reason}")
    return _construct(tensors, kl_kwargs(config), dtype)


def run(config: ShampooConfig, params: dict[str, np.ndarray],
        grads: list[dict[str, np.ndarray]], dtype: Any = np.float64) -> list[dict[str, np.ndarray]]:
    """The parameters (as ``dtype`` arrays) after each step of ``grads``."""
    return run_optimizer(BACKEND, optimizer, config, params, grads, dtype)


def stepper(optimizer_name: str, params: dict[str, np.ndarray], *, lr: float,
            config: ShampooConfig | None = None, weight_decay: float = 0.0,
            dtype: Any = np.float64) -> Stepper:
    """A closed-loop Stepper: KLShampoo from ``config`` (default :func:`base_config`) with
    learning rate ``lr``, or torch's AdamW."""
    return make_stepper(BACKEND, optimizer, optimizer_name, params, lr, config, weight_decay,
                        base_config(), dtype)


def library_run(kwargs: dict[str, Any], params: dict[str, np.ndarray],
                grads: list[dict[str, np.ndarray]], dtype: Any) -> LibraryRun:
    """A user's run: ``heavyball.KLShampoo(parameters, **kwargs)``, nothing added."""
    return torch_library_run(lambda ps, kw: heavyball.KLShampoo(ps, **kw),
                             kwargs, params, grads, dtype)


#: Its own argument sets on the suite's named problem: defaults at lr 0.1 (nothing
#: merged, no noise, statistics from G_1), vectors preconditioned, bases every 4 steps.
CASES: dict[str, ShampooConfig] = {
    "defaults": from_kwargs({"lr": 0.1}),
    "precondition_1d": from_kwargs({"lr": 0.1, "precondition_1d": True,
                                    "precondition_frequency": 1}),
    "weight_decay": from_kwargs({"lr": 0.1, "weight_decay": 0.1, "betas": (0.5, 0.95)}),
    "period_4": from_kwargs({"lr": 0.1, "precondition_frequency": 4, "shampoo_beta": 0.9}),
}

#: The defaults tests that fail: float64 (a crash, and every difference below); in float32
#: the bound of section 5 promises nothing on the problems' rank-deficient factors at
#: eps = 1e-8 (the suite skips it).
_DEFAULTS_TESTS = ("test_library_defaults_float64",)

_EVERY_STEP = from_kwargs({"lr": 0.1, "precondition_frequency": 1})

#: Where heavyball's KLShampoo differs from the spec (docs/third-party.md; sizes measured
#: by the model of conformance/tests/test_adapter_heavyball_kl.py, each alone).
DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        name="first_step_skipped",
        config=_EVERY_STEP,
        tests=("test_random_config_float64", "test_library_case_float64[*]",
               *_DEFAULTS_TESTS),
        cause=(f"step 1 only builds the factors and bases and returns without moving the "
               f"parameter (skip_first, {kl.CHAIN}:366-377, with init_preconditioner, "
               f"{kl.UTILS}:1406-1434); the momentum starts at step 2 and the statistics' "
               "bias correction counts step 1. Every trajectory differs from step 1 on, so "
               "this covers every property against the reference"),
        kind="design",
        shapes=FULL_RANK_SHAPES,
    ),
    Deviation(
        name="kl_dimension_scale",
        config=None,
        tests=(),
        cause=(f"each KL outer product is divided by the size of the other factor "
               f"(inv / grad.shape[idx + 1], {kl.UTILS}:1290), Lin et al.'s 1/d; eq. (6b) "
               "(Meta's) has no such scale"),
        kind="design",
    ),
    Deviation(
        name="kl_matrices_only",
        config=None,
        tests=(),
        cause=(f"only matrices take KL statistics: a parameter of order >= 3, or a vector "
               f"with precondition_1d, takes plain outer products ({kl.UTILS}:1275-1279); "
               "eq. (6b) applies to every block"),
        kind="design",
    ),
    Deviation(
        name="init_factor_identity",
        config=None,
        tests=_DEFAULTS_TESTS,
        cause=(f"init_factor = 0.1 (the default, {kl.INIT}:988) starts every factor at 0.1 I "
               f"and discards G_1 ({kl.UTILS}:1406-1434): with the bias-corrected lerp the "
               "start weighs like one update, which neither initial_value of eq. (6) says "
               "(eps I is decayed, not bias-corrected, and tied to epsilon.value)"),
        kind="design",
    ),
    Deviation(
        name="dampening_noise",
        config=None,
        tests=(*_DEFAULTS_TESTS, "test_side_effect_global_rng_unchanged"),
        cause=(f"dampening = 1e-9 (the default) adds (dampening + 2^-23 |G|) * "
               f"torch.randn_like(G) to the gradient the statistics take ({kl.CHAIN}:1351-1352, "
               f"{kl.UTILS}:2818-2822): a relative 1.2e-7 of noise in the factors, drawn "
               "from (and advancing) torch's global generator"),
        kind="design",
    ),
    Deviation(
        name="eigenvalues_every_step",
        config=None,
        tests=(),
        cause=(f"the eigenvalues d_k = diag(Q_k^T GG_k Q_k) are recomputed every step from "
               f"the current factors in the held basis ({kl.UTILS}:1306-1318, :1287), so "
               "between refreshes the roots follow the statistics; eq. (10f) holds X from "
               "the root step (differs for precondition_frequency > 1)"),
        kind="design",
    ),
    Deviation(
        name="epsilon_floor",
        config=None,
        tests=(),
        cause=(f"eigenvalues are floored, max(d, eps) ({kl.UTILS}:1312, :1288), not shifted "
               "by eps (eq. 10f allows no floor placement)"),
        kind="design",
    ),
    Deviation(
        name="qr_ridge",
        config=None,
        tests=(),
        cause=(f"the QR step factors (GG + lift I) Q, lift = eps times the largest Rayleigh "
               f"quotient of the held basis ({kl.UTILS}:886-898; floor=eps, {kl.CHAIN}:1298); "
               "eq. (10f) with 'shift_after' factors GG Q"),
        kind="design",
    ),
    Deviation(
        name="factor_balance",
        config=None,
        tests=(),
        cause=(f"after each update the factors are rescaled to the geometric mean of their "
               f"max-norms (psgd_balance_Q, {kl.CHAIN}:1354-1357, {kl.UTILS}:2654-2661): on a "
               "matrix only eps's weight changes (KL updates scale with the factors), but "
               "an order-3 tensor's plain outer products do not, so its EMA is reweighted; "
               "eq. (6) keeps the factors as accumulated"),
        kind="design",
    ),
    Deviation(
        name="qr_column_order",
        config=None,
        tests=(),
        cause=(f"the QR step factors the columns sorted by descending Rayleigh quotient, then "
               f"puts each back in its place ({kl.UTILS}:899-905); eq. (10f) factors the "
               "stored order: a QR step depends on the order of its columns"),
        kind="design",
    ),
    *kl.shared_deviations("KLShampoo", f"{kl.CHAIN}:1350 -> {kl.UTILS}:1322",
                          _DEFAULTS_TESTS),
)

