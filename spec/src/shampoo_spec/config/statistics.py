"""The statistics of the factors and the epsilon of their roots, eqs. (6)-(10).

:class:`StatisticsConfig` (eqs. 6-7, 20c) and :class:`EpsilonConfig` (eqs. 9-10),
and the moving-average rules statistics share with eigenvalue correction (eq. 17).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .. import _validate as v
from . import allowed
from .allowed import check_fields
from .options import (
    EMA_WEIGHTS,
    EPSILON_PLACEMENTS,
    FACTOR_STORAGES,
    MACHINE_EPSILON,
    MAX_NEWTON_ITERATIONS,
    SCALE_DTYPES,
    FactorStorage,
)


class MovingAverage:
    """The rules of a second moment kept as a sum (beta2 = 1) or an EMA (eqs. 6-7, 17).

    Shared by :class:`StatisticsConfig` and :class:`EigenvalueCorrectionConfig`,
    whose fields ``beta2`` and ``bias_correction`` they read.
    """

    beta2: float
    bias_correction: bool

    @property
    def decays(self) -> bool:
        """Whether the old value is multiplied by ``beta2`` (an EMA; skipped for a sum)."""
        return self.beta2 != 1.0

    @property
    def corrects_bias(self) -> bool:
        """Whether the value is divided by ``1 - beta2^n`` (only an EMA has a bias)."""
        return self.bias_correction and self.beta2 < 1.0

    def bias_correction_factor(self, updates: int) -> float:
        """``1 - beta2^n`` after ``n = updates`` updates (1 when none, or uncorrected)."""
        if self.corrects_bias and updates:
            return 1.0 - self.beta2**updates
        return 1.0


@dataclass(frozen=True, kw_only=True)
class StatisticsConfig(MovingAverage):
    """Kronecker factor statistics, eqs. (6)-(7) of docs/spec.md.

    ``L_k <- beta2 * L_k + w * G_(k) G_(k)^T`` with ``w = 1`` when
    ``beta2 == 1`` (a sum, AdaGrad-style) and otherwise ``1 - beta2`` (an EMA)
    unless ``ema_weight == "one"``. With ``bias_correction`` the factor used
    for roots is ``L_k / (1 - beta2^n)``, n the number of updates so far.
    ``initial_value`` is the factor before the first update: zero (Meta) or
    ``epsilon * I`` (Google, with the epsilon of :class:`EpsilonConfig`).
    ``trace_scaling_exponent`` tau > 0 (Meta's ``use_trace_scaling``) scales
    the factor the roots see: ``A * max(tr A, epsilon.value)^(-tau)`` (eq. 7b);
    0 leaves it.

    ``storage`` (eq. 20c) is a rule, not a precision:
    ``"int16_columnwise_diagonal"`` stores every factor after each update, and
    every inverse root after it is computed, as its diagonal in float plus
    its off-diagonal part as int16 integers with one scale per column (the
    maximum over the rows), rounded to nearest with ties to even, and reads
    them back as integer * scale (plus the diagonal) wherever they are used:
    Google's ``best_effort_memory_usage_reduction`` with ``batch_axis_name``
    (``QuantizedValue`` with ``int16`` and ``extract_diagonal``). The read-back
    factors are not symmetric: eq. (11) takes them as they are, and eq. (16)
    applies a read-back root X as Google does, ``X^T`` on its dim. Only with
    ``root_inverse.method = "coupled_newton"`` (Google's root with
    quantized statistics) and no ``inverse_root_dtype``. ``scale_dtype`` is
    the dtype the map computes in and keeps its scales and diagonals in
    (Google: its statistics' dtype, float32, float64 under 64-bit JAX).
    ``"float"`` (the default) keeps them unrounded: today's numerics.

    ``kl`` (KL-Shampoo, Lin et al. 2025, arXiv 2509.03378; Meta's
    ``RootInvKLShampooPreconditionerConfig``): eq. (6b), each factor's update
    takes the gradient preconditioned on the block's other preconditioned
    dims by their current inverse roots, ``G~_k = G x_{j != k} X_j``, and
    ``L_k <- beta2 L_k + w G~_(k) G~_(k)^T`` (the roots held before this
    step's refresh: identity before the first).
    """

    beta2: float = field(default=1.0, metadata=allowed.real(low=0.0, high=1.0))
    ema_weight: Literal["one_minus_beta2", "one"] = field(
        default="one_minus_beta2", metadata=allowed.choice(EMA_WEIGHTS))
    bias_correction: bool = field(default=False, metadata=allowed.boolean())
    initial_value: Literal["zero", "epsilon_identity"] = field(
        default="zero", metadata=allowed.choice(("zero", "epsilon_identity")))
    trace_scaling_exponent: float = field(default=0.0, metadata=allowed.real(low=0.0, high=1.0))
    storage: FactorStorage = field(default="float", metadata=allowed.choice(FACTOR_STORAGES))
    scale_dtype: Literal["float32", "float64"] = field(
        default="float32", metadata=allowed.choice(SCALE_DTYPES))
    kl: bool = field(default=False, metadata=allowed.boolean())

    def __post_init__(self) -> None:
        o = "statistics"
        check_fields(self, o)
        if self.storage == "float" and self.scale_dtype != "float32":
            v.fail(o, "scale_dtype", self.scale_dtype,
                   "'float32' (the default) with storage='float' (no scales are kept)")

    @property
    def quantized(self) -> bool:
        """Whether eq. (20c) stores factors and inverse roots as int16 plus a diagonal."""
        return self.storage == "int16_columnwise_diagonal"

    @property
    def update_weight(self) -> float:
        """``w`` of eq. (6): 1 for a sum (beta2 = 1) or ``ema_weight="one"``, else 1 - beta2."""
        if self.beta2 == 1.0 or self.ema_weight == "one":
            return 1.0
        return 1.0 - self.beta2


@dataclass(frozen=True, kw_only=True)
class EpsilonConfig:
    """Regularisation of a factor before its inverse root, eqs. (9)-(10).

    ``scale``: ``"absolute"`` uses ``value``; ``"relative"`` uses
    ``value * max(lambda_max(A), relative_floor)`` (Google's
    relative_matrix_epsilon).
    ``placement`` (eigendecomposition roots only; coupled Newton always adds
    a ridge ``A + eps I``):

    - ``"ridge"``: eigh(A + eps I), then shift every eigenvalue up by
      ``max(0, eps - lambda_min)`` so none is below eps (Meta's default);
    - ``"shift_after"``: eigh(A), then ``lambda - min(lambda_min, 0) + eps``
      (Meta's epsilon-after variant);
    - ``"floor"``: eigh(A), then ``max(lambda, eps)``;
    - ``"ridge_floor"``: eigh(A + eps I), then ``max(lambda, eps)`` (Google's
      eigh path);
    - ``"pseudo_inverse"`` (``value`` must be 0; Meta's PseudoInverseConfig):
      eigh(A), and an eigenvalue at or below the rank cutoff
      ``max(rank_rtol * max(lambda_max, 0), rank_atol)`` gets a zero inverse
      root instead of ``lambda^(-1/r)``. ``rank_rtol=None``: ``n * eps_f``,
      n the factor's size and eps_f the machine epsilon (spacing at 1) of
      ``factor_dtype``, as ``torch.linalg.matrix_rank``. The two tolerances
      are 0 with every other placement. ``rank_cutoff_scope`` says whose
      lambda_max scales ``rank_rtol``: ``"factor"`` (its own; Meta's) or
      ``"parameter"`` (eq. 10g: the largest over the same dim's factors of
      every block of the parameter whose roots the root step computes;
      tearfree's, which decomposes a parameter's blocks as one batch).

    ``lambda_max`` (relative scale only): ``"exact"`` (the largest
    eigenvalue) or ``"power_iteration"``, Google's estimate (eq. 9b): from
    :func:`shampoo_spec.power_iteration_start`, at most
    ``power_iteration_steps`` steps, stopping when the Rayleigh quotient moves
    by at most ``power_iteration_tolerance``.
    """

    value: float = field(default=1e-12, metadata=allowed.epsilon())
    scale: Literal["absolute", "relative"] = field(
        default="absolute", metadata=allowed.choice(("absolute", "relative")))
    relative_floor: float = field(default=1e-16, metadata=allowed.epsilon())
    placement: Literal["ridge", "shift_after", "floor", "ridge_floor", "pseudo_inverse"] = field(
        default="ridge", metadata=allowed.choice(EPSILON_PLACEMENTS))
    lambda_max: Literal["exact", "power_iteration"] = field(
        default="exact", metadata=allowed.choice(("exact", "power_iteration")))
    power_iteration_steps: int = field(
        default=100, metadata=allowed.integer(low=1, high=MAX_NEWTON_ITERATIONS))
    power_iteration_tolerance: float = field(default=1e-6, metadata=allowed.real(low=0.0))
    rank_rtol: float | None = field(default=0.0, metadata=allowed.real(low=0.0, optional=True))
    rank_atol: float = field(default=0.0, metadata=allowed.real(low=0.0))
    rank_cutoff_scope: Literal["factor", "parameter"] = field(
        default="factor", metadata=allowed.choice(("factor", "parameter")))

    def __post_init__(self) -> None:
        o = "epsilon"
        check_fields(self, o)
        if self.pseudo_inverse:
            if self.value != 0:
                v.fail(o, "value", self.value,
                       "0 with placement 'pseudo_inverse' (eigenvalues at or below the rank "
                       "cutoff get a zero inverse root instead of a regularization)")
        else:
            for name in ("rank_rtol", "rank_atol"):
                if getattr(self, name) != 0.0:
                    v.fail(o, name, getattr(self, name),
                           "0.0 unless placement is 'pseudo_inverse' (the rank cutoff)")
            if self.rank_cutoff_scope != "factor":
                v.fail(o, "rank_cutoff_scope", self.rank_cutoff_scope,
                       "'factor' unless placement is 'pseudo_inverse' (the rank cutoff)")

    @property
    def pseudo_inverse(self) -> bool:
        """Eq. (10) by the pseudo-inverse rule: no epsilon, a rank cutoff instead."""
        return self.placement == "pseudo_inverse"

    @property
    def cuts_rank_per_parameter(self) -> bool:
        """Eq. (10g): the rank cutoff scales by the largest eigenvalue over a
        parameter's blocks (one dim at a time), not each factor's own."""
        return self.pseudo_inverse and self.rank_cutoff_scope == "parameter"

    def rank_cutoff_rtol(self, n: int, factor_dtype: str) -> float:
        """The relative rank tolerance for an ``n x n`` factor: ``rank_rtol``, or, when
        None, ``n`` times the machine epsilon of ``factor_dtype`` (eq. 10)."""
        if self.rank_rtol is not None:
            return self.rank_rtol
        return n * MACHINE_EPSILON[factor_dtype]
