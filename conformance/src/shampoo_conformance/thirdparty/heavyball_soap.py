"""The ``heavyball-soap`` backend: heavyball 3.2.1's ``SOAP`` as shipped.

``heavyball.SOAP`` (``pip install heavyball==3.2.1``, HomebrewML/HeavyBall) is
the authors' SOAP (:mod:`.soap` has the algorithm in the spec's terms) built
from heavyball's chainable transforms: ``scale_by_soap`` (chainable.py) and
the helpers of utils.py. Its own rules, read from its source (line numbers in
those files):

- step 1 builds the first statistics ``G_1 G_1^T`` and the first eigenbasis
  (``_init_soap``, chainable.py:1279-1282; utils.py:1406-1434, ``eigh(L +
  1e-30 I)`` flipped to descending, :1030-1083) and moves nothing
  (``general_guard``'s ``skip_first``, chainable.py:366-377);
- step t >= 2 (n = t - 1): the gradient rotated by the stored basis enters
  Adam's moments, kept bias-corrected (``adam_``, utils.py:1909-1941, lerp
  weights ``(1 - b) / (1 - b^n)``, utils.py:340-343), the direction is
  ``F / max(sqrt(D), eps)`` rotated back (``eps_sqrt``, utils.py:420-421);
- then the statistics take G_t, kept bias-corrected (weight ``(1 - b) / (1 -
  b^t)``), and on refresh steps each factor's basis is one QR step of
  ``(L + lift I) Q`` with the columns sorted by descending Rayleigh quotient
  and put back in their places, lift = ``max(1e-8, 64 n u)`` times the largest
  Rayleigh quotient; the first moment is rotated into the new basis
  (``_apply_soap_preconditioner``, chainable.py:1285-1301;
  ``get_orthogonal_matrix_QR``, utils.py:860-944);
- ``W <- W (1 - lr wd) - lr P`` (``update_param_``, utils.py:2430-2463);
- a refresh step is one where the running sum of ``1 / precondition_frequency``
  passes an integer (``psgd_should_update``, utils.py:3558-3565).

This backend passes ``merge_dims=False`` (its ``dim_merger`` keeps the first
dim and merges the others, utils.py:243-290: (5, 1) becomes a vector that is
not preconditioned, (1, 5) stays a matrix that is), a ``max_precond_dim`` no
dim exceeds (a dim above it is left unpreconditioned), ``storage_dtype`` =
the parameters' dtype (with its default float32, float64 parameters crash at
the first refresh step: ``DEVIATIONS["float32_storage_crash"]``) and
heavyball's defaults otherwise (no warm-up, MARS,
caution, PaLM beta2, clipping, error correction). torch.compile is off
(``heavyball.utils.compile_mode = None``, set on import): it needs a C
compiler on the CPU, and the eager numerics are the same operations.

In the spec's terms: :func:`.soap.soap_config` with ``period_anchor="end"``
(bases at step 1, the start step, then at f, 2f, ...: eq. 8),
Adam's bias corrections on, and a ridge of ``1e-8 lambda_max`` before the QR
step (eq. 17c with ``epsilon`` relative 1e-8, placement ``"ridge"``).
In float32 the lift is ``max(1e-8, 64 n 2^-23)``, a ridge that grows with the
factor's size n, which no epsilon of the spec says; the suite derives no
float32 bound for eq. (17), so this is measured nowhere but stated here.
:data:`DEVIATIONS` lists what no config says.
"""

from __future__ import annotations

from typing import Any

import heavyball
import numpy as np
import torch
from hypothesis import currently_in_test_context, reject
from hypothesis import strategies as st

from shampoo_conformance.adapters.torch_user_run import torch_library_run
from shampoo_conformance.thirdparty.registry import Deviation, LibraryRun
from shampoo_conformance.thirdparty.soap import NO_DIM_LIMIT, first_step_skipped, soap_config
from shampoo_conformance.thirdparty.soap_backend import SoapBackend
from shampoo_spec import Inexpressible, ShampooConfig
from shampoo_spec.config import EpsilonConfig

# Eager execution (module docstring): utils.decorator_knowngood compiles unless None.
heavyball.utils.compile_mode = None

#: Parameter dtypes this backend runs (its statistics, bases and moments follow them).
dtypes = (np.float64, np.float32)

BACKEND = "heavyball-soap"

#: The arguments of ``heavyball.SOAP`` this backend reads, at their defaults
#: (heavyball/__init__.py:873-904); the others stay heavyball's.
DEFAULTS: dict[str, Any] = {
    "lr": 3e-3, "betas": (0.9, 0.95), "shampoo_beta": 0.95, "eps": 1e-8,
    "weight_decay": 0.01, "precondition_frequency": 2, "max_precond_dim": 2048,
    "merge_dims": True, "precondition_1d": False,
}

#: The QR step's ridge: 1e-8 (its ``floor``, utils.py:866, left at 1e-8 by
#: chainable.py:1318) times the largest Rayleigh quotient; lambda_max exactly where the
#: basis is an eigenbasis (the qr_ridge deviation measures the rest).
EPSILON = EpsilonConfig(value=1e-8, scale="relative", placement="ridge", lambda_max="exact")

_CHAIN = "heavyball/chainable.py"
_UTILS = "heavyball/utils.py"


def from_kwargs(kwargs: dict[str, Any]) -> ShampooConfig:
    """The config ``heavyball.SOAP(**kwargs)`` runs (module docstring); raises
    :class:`Inexpressible` for the arguments no config says."""
    k = {**DEFAULTS, "max_precond_dim": NO_DIM_LIMIT, "merge_dims": False, **kwargs}
    bad = []
    if k["merge_dims"]:
        bad.append(f"merge_dims=True (its dim_merger, {_UTILS}:243-290, keeps dim 0 and "
                   "merges the others: a (5, 1) becomes an unpreconditioned vector, a "
                   "(1, 5) stays a preconditioned matrix)")
    if k["max_precond_dim"] < NO_DIM_LIMIT:
        bad.append(f"max_precond_dim = {k['max_precond_dim']!r}: a dim above it is left "
                   f"unpreconditioned ({_UTILS}:1418-1421), a rule per dim the spec has no "
                   "field for")
    other = sorted(set(k) - set(DEFAULTS) - {"storage_dtype"})
    if other:
        bad.append(f"{', '.join(other)} (arguments this backend leaves at heavyball's "
                   "defaults)")
    if bad:
        raise Inexpressible(f"{BACKEND} cannot express: " + "; ".join(bad))
    return soap_config(
        lr=k["lr"], betas=tuple(k["betas"]), shampoo_beta=k["shampoo_beta"], eps=k["eps"],
        weight_decay=k["weight_decay"], frequency=k["precondition_frequency"],
        precondition_1d=k["precondition_1d"], correct_bias=True, period_anchor="end",
        epsilon=EPSILON, statistics_bias_correction=True,
    )


@st.composite
def _kwargs(draw: Any) -> dict[str, Any]:
    """``heavyball.SOAP`` kwargs; periods whose 1 / f sums exactly to integers
    (DEVIATIONS["precondition_schedule_rounding"])."""
    return {
        "lr": draw(st.sampled_from([0.01, 0.1])),
        "betas": (draw(st.sampled_from([0.0, 0.5, 0.9])),
                  draw(st.sampled_from([0.9, 0.95, 0.99]))),
        "shampoo_beta": draw(st.sampled_from([0.5, 0.9, 0.95])),
        "weight_decay": draw(st.sampled_from([0.0, 0.01])),
        "precondition_frequency": draw(st.sampled_from([1, 2, 4])),
        "precondition_1d": draw(st.booleans()),
        "eps": draw(st.sampled_from([1e-8, 1e-6])),
    }


def _library_kwargs(config: ShampooConfig) -> dict[str, Any]:
    """What this backend passes besides the common SOAP kwargs: nothing merged, no dim
    limit."""
    return {"merge_dims": False, "max_precond_dim": NO_DIM_LIMIT}


def _construct(tensors: list[torch.nn.Parameter], kwargs: dict[str, Any],
               dtype: Any) -> heavyball.SOAP:
    return heavyball.SOAP(tensors, **kwargs, storage_dtype=np.dtype(dtype).name)


_BACKEND = SoapBackend(BACKEND, from_kwargs, _library_kwargs, _construct, _kwargs)
#: The functions of a third-party adapter (:mod:`.registry`), as every SOAP backend has
#: them; :func:`run` first discards the inputs heavyball crashes on.
soap_kwargs, expressible, configs, base_config, stepper = (
    _BACKEND.soap_kwargs, _BACKEND.expressible, _BACKEND.configs, _BACKEND.base_config,
    _BACKEND.stepper)


#: Its own argument sets on the suite's named problem: its defaults (lr 0.1, nothing
#: merged), vectors preconditioned, weight decay, bases every 4 steps.
CASES: dict[str, ShampooConfig] = {
    "defaults": from_kwargs({"lr": 0.1}),
    "precondition_1d": from_kwargs({"lr": 0.1, "precondition_1d": True,
                                    "precondition_frequency": 1}),
    "weight_decay": from_kwargs({"lr": 0.1, "weight_decay": 0.1, "betas": (0.5, 0.99)}),
    "period_4": from_kwargs({"lr": 0.1, "precondition_frequency": 4, "shampoo_beta": 0.9}),
}

#: What a user gives ``heavyball.SOAP`` besides the parameters: a learning rate (as the
#: other adapters' users), every other argument at its default (merge_dims=True,
#: storage_dtype="float32", max_precond_dim=2048, ...).
USER_KWARGS: dict[str, Any] = {"lr": 0.01}


def defaults_config() -> ShampooConfig:
    """The spec's config nearest ``heavyball.SOAP(params, **USER_KWARGS)``: its defaults
    (betas (0.9, 0.95), shampoo_beta 0.95, weight decay 0.01, a new basis every 2 steps,
    vectors not preconditioned, eps 1e-8) with nothing merged and no dim limit. Its
    default ``merge_dims=True`` (``DEVIATIONS["merge_dims_default"]``: (3, 4, 5) is
    preconditioned as (3, 20)) and its float32 storage (float64 parameters crash,
    ``DEVIATIONS["float32_storage_crash"]``) are no config of the spec."""
    return from_kwargs(USER_KWARGS)


def library_run(kwargs: dict[str, Any], params: dict[str, np.ndarray],
                grads: list[dict[str, np.ndarray]], dtype: Any = np.float64) -> LibraryRun:
    """``heavyball.SOAP(params, **kwargs)`` stepped as a user steps it (the registry's
    ``library_run``): exactly ``kwargs`` (no ``storage_dtype`` added), eager (module
    docstring), the caller's generators, nothing seeded."""
    return torch_library_run(lambda tensors, kw: heavyball.SOAP(tensors, **kw), kwargs,
                             params, grads, dtype)


#: Where heavyball's SOAP differs from the spec (docs/third-party.md has the sizes
#: measured by the model of conformance/tests/test_adapter_soap.py, each alone).
DEVIATIONS: tuple[Deviation, ...] = (
    first_step_skipped(from_kwargs({"lr": 0.1, "precondition_frequency": 1}),
                       f"general_guard's skip_first, {_CHAIN}:366-377, "
                       "with _init_soap, :1279-1282", ("test_library_defaults_float32",)),
    Deviation(
        name="stale_basis",
        config=None,
        tests=(),
        cause=(f"the basis a step rotates with (for D and the direction) is computed from "
               f"the statistics through the step before: scale_by_soap projects and runs "
               f"Adam first, then the statistics take G_t and the basis is refreshed "
               f"({_CHAIN}:1306-1318, :1285-1301); eq. (17) refreshes the basis from this "
               "step's statistics first"),
        kind="design",
    ),
    Deviation(
        name="eigh_first_basis",
        config=None,
        tests=(),
        cause=(f"the first basis (step 1) is a full eigendecomposition of the first "
               f"statistics ({_UTILS}:1406-1434, :1030-1083), the later ones one QR step from "
               "it; eq. (17c) takes its QR step from the identity at the first root step too"),
        kind="design",
    ),
    Deviation(
        name="qr_column_order",
        config=None,
        tests=(),
        cause=(f"the QR step factors (L + lift I) Q with Q's columns sorted by descending "
               f"Rayleigh quotient, then puts each column back in its place ({_UTILS}:899-905); "
               "eq. (17c) (Meta's) factors the stored order and sorts ascending after: a QR "
               "step depends on the order of its columns"),
        kind="design",
    ),
    Deviation(
        name="qr_ridge",
        config=None,
        tests=(),
        cause=(f"the ridge of the QR step is 1e-8 times the largest Rayleigh quotient "
               f"|q^T L q| of the stored basis ({_UTILS}:886-898), not of lambda_max(L) "
               "(eq. 9's relative epsilon)"),
        kind="design",
    ),
    Deviation(
        name="epsilon_floor",
        config=None,
        tests=(),
        cause=(f"the denominator is max(sqrt(D / bc), eps) ({_UTILS}:420-421, :435), "
               "eq. (17) sqrt(D / bc) + eps"),
        kind="design",
    ),
    Deviation(
        name="float32_learning_rate",
        config=None,
        tests=(),
        cause=(f"the step's learning rate is base_lr * step / step.clamp(min=warmup_steps + 1) "
               f"with the int64 step tensor ({_CHAIN}:2594), so a float32 tensor whatever the "
               "parameters' dtype: float64 parameters move by about fl32(lr) P"),
        kind="defect",
    ),
    Deviation(
        name="float32_statistics_weight",
        config=None,
        tests=(),
        cause=(f"the statistics' weight (1 - b) / (1 - b^t) (utils.beta_debias, "
               f"{_UTILS}:340-343, called with the int64 step tensor at {_CHAIN}:1288) is "
               "a float32 tensor: each outer product enters the float64 statistics with a "
               "weight rounded to float32, which moves the bases by about 1e-8"),
        kind="defect",
    ),
    Deviation(
        name="precondition_schedule_rounding",
        config=None,
        tests=(),
        cause=(f"a refresh step is one where the running float sum of 1 / f passes an "
               f"integer ({_UTILS}:3558-3565): for f = 3, 5, 6, 7, 9, 10, ... rounding moves "
               "some refreshes a step late (f = 10: steps 11, 20, 30, 40, 51, not 10, 20, "
               "30, 40, 50); "
               "eq. (8) is t % f == 0"),
        kind="defect",
    ),
    Deviation(
        name="single_element_matrix_crash",
        config=from_kwargs({"lr": 0.1, "precondition_frequency": 1}),
        shapes={"w": (1, 1)},
        # No pattern: the random properties discard such examples (see run).
        tests=(),
        cause=(f"with merge_dims=False (its default merge makes such a shape a vector), a "
               f"parameter of rank >= 2 with one element ((1, 1), (1, 1, 1)) gets one "
               f"factor slot, not one per dim ({_UTILS}:1416-1431: the numel() > 1 test), and "
               f"the first refresh step raises ValueError ('ref dim ... does not match Q "
               f"length', {_UTILS}:876-877). The suite's random properties discard such "
               "examples (hypothesis.reject, predicted by known_crash); "
               "test_adapter_soap.py::test_heavyball_crashes_on_a_single_element_matrix "
               "demonstrates it"),
        kind="defect",
    ),
    Deviation(
        name="float32_storage_crash",
        config=None,
        tests=("test_library_defaults_float64", "test_side_effect_float64_stays_float64"),
        cause=(f"its default storage_dtype='float32' keeps Adam's moments in float32 "
               f"(_storage_dtype and zero_guard, {_CHAIN}:177-179, :273-286) while the "
               f"statistics and bases follow the float64 gradient, and the first refresh step "
               f"(step 2 by default) rotates the first moment into the new basis with a "
               f"mixed-dtype einsum ({_UTILS}:929, from {_CHAIN}:1298): float64 parameters "
               "raise RuntimeError 'expected scalar type Float but found Double' (its "
               "documentation promises float32 storage, not a crash; the backend passes the "
               "parameters' dtype)"),
        kind="defect",
    ),
    Deviation(
        name="merge_dims_default",
        config=None,
        # The defaults property skips on its rank-deficient problems (its bound promises
        # nothing there); test_adapter_soap.py demonstrates the merge.
        tests=(),
        cause=(f"merge_dims=True by default: its dim_merger ({_UTILS}:243-290) keeps dim 0 "
               "and merges the others up to max_precond_dim, so (3, 4, 5) is preconditioned "
               "as (3, 20) (2 factors, not 3) and (6, 1) as an unpreconditioned vector; no "
               "config of the spec merges that way (the importer refuses merge_dims=True; "
               "defaults_config merges nothing)"),
        kind="design",
    ),
    Deviation(
        name="scalar_parameter_crash",
        config=None,
        # The backend passes merge_dims=False; test_adapter_heavyball_kl.py's
        # test_scalar_parameter_crashes_with_merge_dims demonstrates it for SOAP too.
        tests=(),
        cause=(f"a 0-d parameter at the default merge_dims=True raises IndexError ('tuple "
               f"index out of range') in dim_merger ({_UTILS}:272, grad.shape[0]); with "
               "merge_dims=False it runs (no factor)"),
        kind="defect",
    ),
    Deviation(
        name="grads_consumed",
        config=None,
        tests=("test_side_effect_grads_unchanged",),
        cause=(f"step() sets each p.grad to None after reading it (consume_grad = True, "
               f"{_UTILS}:1542, :1659-1660): after a step the caller's gradients are gone "
               "(no logging, clipping or accumulation of them after step()). heavyball's "
               "choice, to free memory"),
        kind="design",
    ),
)


def refresh_steps(frequency: int, steps: int) -> list[int]:
    """The steps >= 2 on which heavyball refreshes the bases (its running sum of 1 / f,
    utils.psgd_should_update)."""
    out, total = [], 0.0
    for t in range(1, steps + 1):
        before = total
        total += 1 / frequency
        if t >= 2 and int(total) > int(before):
            out.append(t)
    return out


def known_crash(config: ShampooConfig, params: dict[str, np.ndarray], steps: int) -> str | None:
    """Why ``heavyball.SOAP`` crashes within ``steps`` steps on ``params``, or None
    (DEVIATIONS["single_element_matrix_crash"])."""
    ones = [name for name, value in params.items()
            if np.ndim(value) >= 2 and np.size(value) == 1]
    if ones and refresh_steps(config.schedule.precondition_frequency, steps):
        return (f"parameter {ones[0]!r} of shape {np.shape(params[ones[0]])}: one element, "
                "rank >= 2 (ValueError at its first refresh step, utils.py:877)")
    return None


def run(
    config: ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: Any = np.float64,
) -> list[dict[str, np.ndarray]]:
    """The parameters (as ``dtype`` arrays) after each step of ``grads``."""
    if known_crash(config, params, len(grads)) and currently_in_test_context():
        # heavyball crashes on this input (DEVIATIONS): a property drawing it skips the
        # example; anywhere else heavyball runs, and crashes, as its users see it.
        reject()
    return _BACKEND.run(config, params, grads, dtype)
