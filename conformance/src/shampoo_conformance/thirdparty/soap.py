"""What the two SOAP backends share: SOAP in the spec's terms (docs/third-party.md).

SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using
Adam") is eigenvalue-corrected Shampoo, the spec's eq. (17): Adam's moments
kept in the eigenbases of Shampoo's factors. heavyball 3.2.1
(``heavyball.SOAP``, :mod:`.heavyball_soap`) and pytorch-optimizer 4.1.0
(``pytorch_optimizer.SOAP``, :mod:`.pytorch_optimizer_soap`) both follow
the authors' reference implementation. What one SOAP step computes, read
from their sources, for a parameter W with gradient G (t = 1, 2, ...):

- statistics ``L_k <- b L_k + (1 - b) G_(k) G_(k)^T`` from zero (eq. 6, b =
  ``shampoo_beta``), one factor per dim of the parameter as it is (no
  blocks); a parameter of rank <= 1 has none unless ``precondition_1d``;
- step 1 only initializes: L_k from G_1 and the first eigenbasis
  ``Q_k = eigh(L_k)`` (descending); the parameter does not move;
- steps t >= 2, with n = t - 1 the steps that moved: the gradient in the
  stored eigenbasis ``R = G x_k Q_k^T`` enters ``D <- b2 D + (1 - b2) R^2``
  (eq. 17's D), the first moment ``F <- b1 F + (1 - b1) G`` (eq. 15's filter,
  kept rotated by heavyball, in the parameter's basis by pytorch-optimizer:
  the same numbers in exact arithmetic), and the direction is eq. (17)'s
  ``((F x_k Q_k^T) / (sqrt(D) + eps)) x_k Q_k`` with Adam's bias corrections
  (each library places epsilon its own way); W moves, with decoupled weight
  decay;
- then L_k takes G_t, and on refresh steps the new basis is one step of
  power iteration from the stored one, ``QR(L_k Q_k)`` with the columns
  ordered by descending Rayleigh quotient (eq. 17c's QR step, in another
  column order): the basis a step uses was computed from the statistics
  through the step before.

In the spec's terms (:func:`soap_config`): ``eigenvalue_correction`` with
``beta2 = b2``, ``epsilon = eps``, root 2 and ``eigenbasis_method = "qr"``
(one QR step, eq. 17c); ``gradient_filter.beta1 = b1``; statistics with
``beta2 = shampoo_beta`` from zero; no graft, no momentum (the filter is
SOAP's first moment); ``"update"`` weight decay; no blocks, nothing merged or
squeezed (size-1 dims are 1 x 1 factors, whose basis is 1); rank <= 1
parameters keep D in the identity basis (``exponents.overrides_by_order``:
order 1, root 0) unless ``precondition_1d``. What no config of the spec says
(the skipped first step, the basis from the statistics of the step before,
the first basis by eigh, the QR column order, each library's epsilon and
float32 roundings) are the backends' documented deviations; the model in
``conformance/tests/test_adapter_soap.py`` computes SOAP with each of them
switchable to the spec's rule, equals each library with all of them on and
the reference with all of them off, and measures each alone.
"""

from __future__ import annotations

from typing import Any, Literal

from shampoo_conformance.thirdparty.registry import Deviation
from shampoo_spec import EighConfig, Inexpressible, ShampooConfig, config_differences
from shampoo_spec.anchors._parse import UNBOUNDED
from shampoo_spec.config import (
    BlockingConfig,
    EigenvalueCorrectionConfig,
    EpsilonConfig,
    ExponentConfig,
    GradientFilterConfig,
    OrderOverride,
    ScheduleConfig,
    StatisticsConfig,
    WeightDecayConfig,
)

#: One factor per dim of the parameter as it is: no blocks, no merging, no squeezing
#: (a size-1 dim is a 1 x 1 factor, basis 1, as SOAP's identity), a 0-d parameter
#: without a factor.
BLOCKING = BlockingConfig(max_preconditioner_dim=UNBOUNDED, merge_dims_up_to=None,
                          squeeze=False, skip_rank_lt=0, scalar_factor=False)

#: Rank <= 1 parameters without ``precondition_1d``: no factor, D in the identity
#: basis (Adam on the vector).
NO_VECTOR_BASIS = ExponentConfig(overrides_by_order=(OrderOverride(order=1, roots=(0.0,)),))

#: The largest ``max_precondition_dim``: no dim of any parameter exceeds it (SOAP
#: leaves a dim above it unpreconditioned, a rule per dim the spec has no field for).
NO_DIM_LIMIT = UNBOUNDED


#: Shapes whose factors have full rank from one gradient (every dim at most the product
#: of the others), and the two without factors. Eq. (17)'s eigenbasis of a factor with a
#: repeated eigenvalue is not determined, and the suite's bound is then infinite (spec
#: section 5): a rank-deficient first factor, such as the (7, 10) of the named problem,
#: makes a comparison with the reference say nothing.
FULL_RANK_SHAPES: dict[str, tuple[int, ...]] = {
    "square": (5, 5), "tensor": (3, 4, 5), "vector": (7,), "scalar": ()}


def first_step_skipped(config: ShampooConfig, where: str,
                       more_tests: tuple[str, ...] = ()) -> Deviation:
    """The deviation every SOAP has: step 1 only builds the statistics and the first
    basis (``where``: the library's lines that do it), ``config`` showing it;
    ``more_tests``: the library's other tests it fails (its defaults' runs)."""
    return Deviation(
        name="first_step_skipped",
        config=config,
        tests=("test_random_config_float64", "test_library_case_float64[*]", *more_tests),
        cause=(f"step 1 only builds the statistics and the first eigenbasis and returns "
               f"without moving the parameter ({where}); every later step counts from step 2 "
               "(bias corrections 1 - beta^(t-1)): SOAP's design, after the authors' code. "
               "Every trajectory differs from step 1 on, so this covers every property "
               "against the reference"),
        kind="design",
        shapes=FULL_RANK_SHAPES,
    )


def soap_config(
    *,
    lr: float,
    betas: tuple[float, float],
    shampoo_beta: float,
    eps: float,
    weight_decay: float,
    frequency: int,
    precondition_1d: bool,
    correct_bias: bool,
    period_anchor: Literal["end", "start"],
    epsilon: EpsilonConfig,
    statistics_bias_correction: bool,
) -> ShampooConfig:
    """The spec's config nearest a SOAP run (module docstring).

    Raises :class:`Inexpressible` for the arguments no config says: a second
    moment or statistics that never decay (SOAP's lerp with weight 0 keeps them
    at 0, the spec's beta2 = 1 sums them) and epsilon 0 (eq. 17 divides by it
    where D is 0).
    """
    beta1, beta2 = betas
    bad = []
    if not 0.0 <= beta2 < 1.0:
        bad.append(f"betas[1] = eigenvalue_correction.beta2 = {beta2!r} (the spec's beta2 = 1 "
                   "sums D; SOAP's lerp with weight 0 keeps it at 0)")
    if not 0.0 <= shampoo_beta < 1.0:
        bad.append(f"shampoo_beta = statistics.beta2 = {shampoo_beta!r} (the spec's beta2 = 1 "
                   "sums the statistics; SOAP's lerp with weight 0 keeps them at 0)")
    if not 0.0 <= beta1 < 1.0:
        bad.append(f"betas[0] = gradient_filter.beta1 = {beta1!r} (in [0, 1))")
    if not eps > 0.0:
        bad.append(f"eps = eigenvalue_correction.epsilon = {eps!r} (eq. 17 needs epsilon > 0: "
                   "D is 0 for a zero gradient)")
    if bad:
        raise Inexpressible("SOAP cannot express: " + "; ".join(bad))
    return ShampooConfig(
        learning_rate=lr,
        statistics=StatisticsConfig(beta2=shampoo_beta, initial_value="zero",
                                    bias_correction=statistics_bias_correction),
        epsilon=epsilon,
        root_inverse=EighConfig(),
        exponents=ExponentConfig() if precondition_1d else NO_VECTOR_BASIS,
        eigenvalue_correction=EigenvalueCorrectionConfig(
            beta2=beta2, epsilon=eps, bias_correction=correct_bias, root=2.0,
            eigenbasis_method="qr", qr_max_iterations=1),
        gradient_filter=GradientFilterConfig(beta1=beta1, bias_correction=correct_bias),
        weight_decay=WeightDecayConfig(value=weight_decay, type="update"),
        blocking=BLOCKING,
        schedule=ScheduleConfig(precondition_frequency=frequency, period_anchor=period_anchor,
                                start_preconditioning_step=1),
        factor_dtype="float64",
    )


def common_kwargs(config: ShampooConfig, backend: str) -> dict[str, Any]:
    """The SOAP arguments ``config`` would be run with (the inverse of :func:`soap_config`
    where it has one); raises :class:`Inexpressible` without eigenvalue correction."""
    ec = config.eigenvalue_correction
    if ec is None:
        raise Inexpressible(f"{backend} cannot express: eigenvalue_correction = None (SOAP is "
                            "eigenvalue-corrected Shampoo, eq. 17)")
    return {
        "lr": config.learning_rate,
        "betas": (config.gradient_filter.beta1, ec.beta2),
        "shampoo_beta": config.statistics.beta2,
        "eps": ec.epsilon,
        "weight_decay": config.weight_decay.value,
        "precondition_frequency": config.schedule.precondition_frequency,
        "precondition_1d": config.exponents != NO_VECTOR_BASIS,
    }


def refuse_differences(backend: str, config: ShampooConfig, nearest: ShampooConfig) -> None:
    """Raise :class:`Inexpressible` naming every field where ``config`` differs from the
    config the library runs for the same arguments (``nearest``)."""
    differences = config_differences(nearest, config)
    if differences:
        raise Inexpressible(f"{backend} cannot express (field: what SOAP runs -> what the "
                            "config asks): " + "; ".join(differences))
