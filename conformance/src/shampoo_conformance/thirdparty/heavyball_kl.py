"""What the heavyball KL backends share: heavyball 3.2.1's KL statistics in the spec's terms.

``heavyball.KLShampoo`` (:mod:`.heavyball_klshampoo`) and ``heavyball.KLSOAP``
(:mod:`.heavyball_klsoap`) keep SOAP's state (heavyball/__init__.py:838-858,
:912-990): per preconditioned dim a factor ``GG_k`` and a basis ``Q_k``; on
steps t >= 2 (step 1 only initializes, ``general_guard``'s ``skip_first``,
heavyball/chainable.py:366-377) the factors take KL-Shampoo's statistics
(``update_ggt_kl``, heavyball/utils.py:1273-1303) for a matrix W (m x n):

    GG_L <- lerp(GG_L, G Q_R diag(1 / max(d_R, eps)) Q_R^T G^T / n, w_t)
    GG_R <- lerp(GG_R, G^T Q_L diag(1 / max(d_L, eps)) Q_L^T G / m, w_t)

with ``d_k = diag(Q_k^T GG_k Q_k)`` (``_kl_eigvals``, utils.py:1268-1270) read
before the update and ``w_t = (1 - b) / (1 - b^t)`` (``beta_debias``,
utils.py:340-343, b = ``shampoo_beta``): the spec's eq. (6b) with root 2 for
every factor (``G~_L G~_L^T = G X_R X_R^T G^T``, X_R = R^(-1/2)) and the bias
correction of eq. (7) kept in the factor, except the division by the other
factor's size (``inv / grad.shape[idx + 1]``, utils.py:1290), which no field
of the spec says (``kl_dimension_scale``). A parameter that is not a matrix
(order 3 or more, or a vector with ``precondition_1d``) takes plain outer
products (utils.py:1278-1279: ``kl_matrices_only``). On refresh steps
(``psgd_should_update``, utils.py:3558-3565) each basis is one QR step of
``(GG_k + lift I) Q_k`` (``get_orthogonal_matrix_QR``, utils.py:860-944, the
floor of its lift = ``eps``, chainable.py:1298): eq. (10f) with one iteration.

The spec's config validation refuses ``statistics.kl`` together with
``eigenvalue_correction`` (``_check_kl`` -> ``_require_plain_roots``,
spec/src/shampoo_spec/config/rules.py: eq. 6b is specified for Kronecker
inverse roots only), so KLSOAP has no config (:data:`KLSOAP_REFUSAL`).
"""

from __future__ import annotations

from typing import Any

import heavyball
import numpy as np

from shampoo_conformance.thirdparty.registry import Deviation
from shampoo_conformance.thirdparty.soap import BLOCKING, NO_DIM_LIMIT
from shampoo_spec import EighConfig, Inexpressible, ShampooConfig
from shampoo_spec.config import (
    EpsilonConfig,
    ExponentConfig,
    GradientFilterConfig,
    OrderOverride,
    ScheduleConfig,
    StatisticsConfig,
    WeightDecayConfig,
)

# Eager execution: utils.decorator_knowngood compiles unless None (as heavyball_soap).
heavyball.utils.compile_mode = None

CHAIN = "heavyball/chainable.py"
UTILS = "heavyball/utils.py"
INIT = "heavyball/__init__.py"

#: The arguments of ``heavyball.SOAP`` / ``KLSOAP`` this backend reads, at their
#: defaults (heavyball/__init__.py:872-904; KLSOAP inherits SOAP's constructor).
SOAP_DEFAULTS: dict[str, Any] = {
    "lr": 3e-3, "betas": (0.9, 0.95), "shampoo_beta": 0.95, "eps": 1e-8,
    "weight_decay": 0.01, "precondition_frequency": 2, "max_precond_dim": 2048,
    "merge_dims": True, "precondition_1d": False,
}

#: ``heavyball.KLShampoo``'s, with its two more (heavyball/__init__.py:954-990).
KL_SHAMPOO_DEFAULTS: dict[str, Any] = {**SOAP_DEFAULTS, "init_factor": 0.1, "dampening": 1e-9}

#: The highest parameter order the roots are written for (one override per order).
MAX_ORDER = 8


def roots(precondition_1d: bool) -> ExponentConfig:
    """Root 2 on every preconditioned dim (``rsqrt``, utils.py:1312), whatever the
    parameter's order; vectors unpreconditioned (root 0) without ``precondition_1d``."""
    return ExponentConfig(overrides_by_order=tuple(
        OrderOverride(order=o, roots=(0.0 if o == 1 and not precondition_1d else 2.0,))
        for o in range(1, MAX_ORDER + 1)))


def kl_shampoo_config(*, lr: float, betas: tuple[float, float], shampoo_beta: float,
                      eps: float, weight_decay: float, frequency: int,
                      precondition_1d: bool) -> ShampooConfig:
    """The spec's config nearest ``heavyball.KLShampoo`` (module docstrings):

    eq. (6b) statistics with beta2 = ``shampoo_beta``, bias-corrected (eq. 7),
    from zero; eq. (10f)'s QR root (one iteration) with the absolute epsilon
    ``eps`` added after (``"shift_after"``; heavyball floors at it instead,
    ``epsilon_floor``), root 2; the gradient filter of eq. (15) with ``beta1 =
    betas[0]``, uncorrected (``stochastic_lerp_``, chainable.py:1349), in place of
    momentum; the direction from the roots held before the step
    (``roots_take_effect = "next_step"``: heavyball preconditions first, then
    updates its factors, chainable.py:1349-1353); decoupled weight decay; bases
    at f, 2f, ... (eq. 8, ``period_anchor = "end"``). ``betas[1]`` is unused.
    """
    b1 = betas[0]
    bad = []
    if not 0.0 <= shampoo_beta < 1.0:
        bad.append(f"shampoo_beta = statistics.beta2 = {shampoo_beta!r} (the spec's beta2 = 1 "
                   "sums the statistics; heavyball's lerp with weight 0 keeps them)")
    if not 0.0 <= b1 < 1.0:
        bad.append(f"betas[0] = gradient_filter.beta1 = {b1!r} (in [0, 1))")
    if not eps > 0.0:
        bad.append(f"eps = epsilon.value = {eps!r} (heavyball's clamp_min(eps) then rsqrt "
                   "divides by 0 where an eigenvalue is 0)")
    if bad:
        raise Inexpressible("heavyball KLShampoo cannot express: " + "; ".join(bad))
    return ShampooConfig(
        learning_rate=lr,
        statistics=StatisticsConfig(beta2=shampoo_beta, initial_value="zero",
                                    bias_correction=True, kl=True),
        epsilon=EpsilonConfig(value=eps, placement="shift_after"),
        root_inverse=EighConfig(eigenbasis_method="qr", qr_max_iterations=1),
        exponents=roots(precondition_1d),
        gradient_filter=GradientFilterConfig(beta1=b1, bias_correction=False),
        weight_decay=WeightDecayConfig(value=weight_decay, type="update"),
        blocking=BLOCKING,
        schedule=ScheduleConfig(precondition_frequency=frequency, period_anchor="end",
                                start_preconditioning_step=1, roots_take_effect="next_step"),
        factor_dtype="float64",
    )


def refuse_layout(k: dict[str, Any], known: set[str], name: str) -> list[str]:
    """The refusals the KL backends share: merging, a dim limit, unknown arguments."""
    bad = []
    if k["merge_dims"]:
        bad.append(f"merge_dims=True (its dim_merger, {UTILS}:243-290, keeps dim 0 and "
                   "merges the others: (3, 4, 5) becomes (3, 20), a rule of its own)")
    if k["max_precond_dim"] < NO_DIM_LIMIT:
        bad.append(f"max_precond_dim = {k['max_precond_dim']!r}: a dim above it is left "
                   f"unpreconditioned ({UTILS}:1418-1421), a rule per dim the spec has no "
                   "field for")
    other = sorted(set(k) - known - {"storage_dtype"})
    if other:
        bad.append(f"{', '.join(other)} (arguments {name} leaves at heavyball's defaults)")
    return bad


#: Why no config of the spec is KLSOAP (heavyball-klsoap's ``expressible``).
KLSOAP_REFUSAL = (
    "heavyball-klsoap cannot express any config: KLSOAP is eigenvalue-corrected Shampoo "
    "(eq. 17, SOAP's Adam in the factors' eigenbases) whose factors take KL statistics "
    f"(eq. 6b; {CHAIN}:1327-1339 -> update_ggt_kl, {UTILS}:1273-1303), and the spec's "
    "config validation refuses statistics.kl with eigenvalue_correction "
    "(ShampooConfig.eigenvalue_correction: allowed None with statistics.kl; "
    "shampoo_spec/config/rules.py _check_kl -> _require_plain_roots): eq. (6b) "
    "preconditions the statistics by the inverse roots X_j, and eq. (17) computes none "
    "(heavyball uses diag(Q^T GG Q)^-1 in the stored basis, the roots of eq. 10f)")


def float64_storage(dtype: Any) -> str:
    """``storage_dtype`` = the parameters' dtype (heavyball's float32 default crashes
    float64 parameters at step 2: ``float32_storage_crash``)."""
    return str(np.dtype(dtype).name)


def shared_deviations(cls: str, crash_line: str,
                      defaults_tests: tuple[str, ...]) -> tuple[Deviation, ...]:
    """The deviations both KL classes have as a user meets them (``library_run``):
    float64 at the defaults, consumed gradients, heavyball's float32 scalars;
    ``defaults_tests``: the defaults tests that fail (the float32 bound may promise
    nothing)."""
    return (
        Deviation(
            name="float32_storage_crash",
            config=None,
            tests=("test_library_defaults_float64", "test_side_effect_float64_stays_float64"),
            cause=(f"heavyball.{cls}'s default storage_dtype='float32' ({INIT}:979) keeps "
                   f"the momentum in float32 while the factors and bases follow the float64 "
                   f"gradient: step 2 raises RuntimeError 'expected scalar type Float but "
                   f"found Double' ({crash_line}). The backend passes storage_dtype = the "
                   "parameters' dtype"),
            kind="defect",
        ),
        Deviation(
            name="gradients_consumed",
            config=None,
            tests=("test_side_effect_grads_unchanged",),
            cause=(f"step() sets p.grad = None for every parameter it reads ({UTILS}:1659-1660, "
                   "consume_grad): the caller's gradients are gone after a step (heavyball's "
                   "design, a zero_grad built in)"),
            kind="design",
        ),
        Deviation(
            name="merge_dims_default",
            config=None,
            tests=defaults_tests,
            cause=(f"merge_dims=True by default: its dim_merger ({UTILS}:243-290) keeps dim 0 "
                   "and merges the others, (3, 4, 5) into (3, 20), a rule the spec's "
                   "blocking.merge_dims_up_to does not say (it merges by a size limit)"),
            kind="design",
        ),
        Deviation(
            name="scalar_parameter_crash",
            config=None,
            tests=(),
            cause=(f"a 0-d parameter at the default merge_dims=True raises IndexError "
                   f"('tuple index out of range') in dim_merger ({UTILS}:272, "
                   f"grad.shape[0]); heavyball.SOAP too. The backend passes merge_dims=False, "
                   "with which a 0-d parameter runs (no factor)"),
            kind="defect",
        ),
        Deviation(
            name="float32_learning_rate",
            config=None,
            tests=(),
            cause=(f"the step's learning rate is base_lr * step / step.clamp(min=warmup_steps "
                   f"+ 1) with the int64 step tensor ({CHAIN}:2594), a float32 tensor whatever "
                   "the parameters' dtype: float64 parameters move by about fl32(lr) P"),
            kind="defect",
        ),
        Deviation(
            name="float32_statistics_weight",
            config=None,
            tests=(),
            cause=(f"the statistics' weight (1 - b) / (1 - b^t) (beta_debias, {UTILS}:340-343, "
                   f"called with the int64 step tensor at {CHAIN}:1288) is a float32 tensor: "
                   "each KL outer product enters the float64 factors with a weight rounded to "
                   "float32"),
            kind="defect",
        ),
        Deviation(
            name="precondition_schedule_rounding",
            config=None,
            tests=(),
            cause=(f"a refresh step is one where the running float sum of 1 / f passes an "
                   f"integer ({UTILS}:3558-3565): for f = 3, 5, 6, 7, 9, 10, ... some refreshes "
                   "come a step late (f = 10: steps 11, 20, 30, 40, 51); eq. (8) is "
                   "t % f == 0"),
            kind="defect",
        ),
    )
