"""The one configuration of Shampoo shared by every backend.

Every option of the two anchors (Meta's PyTorch ``DistributedShampoo`` and
Google's JAX ``distributed_shampoo``) is a named field here, never a hidden
quirk. Each sub-config documents the equation of docs/spec.md it governs.
All configs are frozen, keyword-only dataclasses validated in
``__post_init__``: a bad value raises ``ValueError`` naming the field, the
value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from dataclasses import dataclass, field
from typing import Literal

from . import _validate as v

#: Upper bound of ``CoupledNewtonConfig.max_iterations``.
MAX_NEWTON_ITERATIONS = 10_000
#: The largest order of eq. (11c): each step costs about order matrix products.
MAX_HIGHER_ORDER = 16

GraftingType = Literal[
    "none",
    "sgd",
    "adagrad",
    "rmsprop",
    "adam",
    "sign",
    "adagrad_normalized",
    "rmsprop_normalized",
    "adafactor",
]
GRAFTING_TYPES: tuple[str, ...] = (
    "none",
    "sgd",
    "adagrad",
    "rmsprop",
    "adam",
    "sign",
    "adagrad_normalized",
    "rmsprop_normalized",
    "adafactor",
)

#: The dtypes inverse roots may be stored in (``ShampooConfig.inverse_root_dtype``, eqs. 11a, 16).
InverseRootDtype = Literal["float64", "float32", "bfloat16", "float16"]
INVERSE_ROOT_DTYPES: tuple[str, ...] = ("float64", "float32", "bfloat16", "float16")

#: How momentum buffers are stored (``MomentumConfig.storage``, eq. 20b).
MomentumStorage = Literal["float", "int8_columnwise"]
MOMENTUM_STORAGES: tuple[str, ...] = ("float", "int8_columnwise")

#: How factors and their inverse roots are stored (``StatisticsConfig.storage``, eq. 20c).
FactorStorage = Literal["float", "int16_columnwise_diagonal"]
FACTOR_STORAGES: tuple[str, ...] = ("float", "int16_columnwise_diagonal")

#: The smallest positive number of a storage dtype (its smallest subnormal) where it is
#: above the least epsilon every section allows (2^-126): float16 only.
_SMALLEST_POSITIVE: dict[str, tuple[float, str]] = {"float16": (2.0**-24, "2^-24")}

#: The dtypes a step's update may be rounded to (``ShampooConfig.update_dtype``, eq. 21a).
UpdateDtype = Literal["float32", "bfloat16", "float16"]
UPDATE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")

#: The dtypes the factors may be stored in below ``factor_dtype``
#: (``ShampooConfig.factor_storage_dtype``, eq. 11b; Meta's ``factor_matrix_dtype``).
FactorStorageDtype = Literal["bfloat16", "float16"]
FACTOR_STORAGE_DTYPES: tuple[str, ...] = ("bfloat16", "float16")

#: Grafting types that keep a second-moment state V (eq. 14b).
GRAFTING_TYPES_WITH_STATE: tuple[str, ...] = (
    "adagrad",
    "rmsprop",
    "adam",
    "adagrad_normalized",
    "rmsprop_normalized",
)


class _MovingAverage:
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
class StatisticsConfig(_MovingAverage):
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

    beta2: float = 1.0
    ema_weight: Literal["one_minus_beta2", "one"] = "one_minus_beta2"
    bias_correction: bool = False
    initial_value: Literal["zero", "epsilon_identity"] = "zero"
    trace_scaling_exponent: float = 0.0
    storage: FactorStorage = "float"
    scale_dtype: Literal["float32", "float64"] = "float32"
    kl: bool = False

    def __post_init__(self) -> None:
        o = "statistics"
        v.boolean(o, "kl", self.kl)
        v.real(o, "beta2", self.beta2, low=0.0, high=1.0)
        v.choice(o, "ema_weight", self.ema_weight, ("one_minus_beta2", "one"))
        v.boolean(o, "bias_correction", self.bias_correction)
        v.choice(o, "initial_value", self.initial_value, ("zero", "epsilon_identity"))
        v.real(o, "trace_scaling_exponent", self.trace_scaling_exponent, low=0.0, high=1.0)
        v.choice(o, "storage", self.storage, FACTOR_STORAGES)
        v.choice(o, "scale_dtype", self.scale_dtype, ("float32", "float64"))
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


#: ``EpsilonConfig.placement``: the epsilon rules of eq. (10).
EPSILON_PLACEMENTS = ("ridge", "shift_after", "floor", "ridge_floor", "pseudo_inverse")


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

    value: float = 1e-12
    scale: Literal["absolute", "relative"] = "absolute"
    relative_floor: float = 1e-16
    placement: Literal["ridge", "shift_after", "floor", "ridge_floor", "pseudo_inverse"] = "ridge"
    lambda_max: Literal["exact", "power_iteration"] = "exact"
    power_iteration_steps: int = 100
    power_iteration_tolerance: float = 1e-6
    rank_rtol: float | None = 0.0
    rank_atol: float = 0.0
    rank_cutoff_scope: Literal["factor", "parameter"] = "factor"

    def __post_init__(self) -> None:
        o = "epsilon"
        v.epsilon(o, "value", self.value, zero=True)
        v.choice(o, "scale", self.scale, ("absolute", "relative"))
        v.epsilon(o, "relative_floor", self.relative_floor, zero=True)
        v.choice(o, "placement", self.placement, EPSILON_PLACEMENTS)
        v.choice(o, "lambda_max", self.lambda_max, ("exact", "power_iteration"))
        v.integer(o, "power_iteration_steps", self.power_iteration_steps, low=1,
                  high=MAX_NEWTON_ITERATIONS)
        v.real(o, "power_iteration_tolerance", self.power_iteration_tolerance, low=0.0)
        if self.rank_rtol is not None:
            v.real(o, "rank_rtol", self.rank_rtol, low=0.0)
        v.real(o, "rank_atol", self.rank_atol, low=0.0)
        v.choice(o, "rank_cutoff_scope", self.rank_cutoff_scope, ("factor", "parameter"))
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


#: The spacing at 1 of each factor dtype (the rank cutoffs of eqs. 10 and 10d).
MACHINE_EPSILON = {"float32": 2.0**-23, "float64": 2.0**-52}


@dataclass(frozen=True, kw_only=True)
class EighConfig:
    """Root inverse by exact symmetric eigendecomposition, eqs. (10), (10b) and (13).

    ``failure_threshold`` (Google's ``inverse_failure_threshold`` with
    ``eigh=True``): None, an eigh root fails only when non-finite (eq. 13);
    a float tau, it also fails when the eigendecomposition's error

        e = max_ij |(Q^T B Q - diag(lambda))_ij|

    reaches tau, compared in float32: ``fl32(e) >= fl32(tau)`` or e NaN
    (eq. 10b), as Google compares its float32 error metric. B is the
    symmetric matrix decomposed, ``B = Q diag(lambda) Q^T``: ``A + eps I``
    for the ridge placements, A otherwise (eq. 10), A for the eigenbasis of
    eq. (17); lambda before eq. (10)'s epsilon rule. A failed root keeps the
    previous one and is counted (eq. 13). tau is at least 2^-126 (float32's
    smallest normal, so no backend flushes it to 0).

    ``eigenbasis_method="qr"`` (Meta's Eigendecomposed Shampoo with
    ``QREigendecompositionConfig``, eq. 10f): the decomposition of eq. (10)
    is not eigh's but eq. (17c)'s QR algorithm, at most
    ``qr_max_iterations`` steps from the factor's stored eigenbasis (I
    before the first root step) on B of eq. (10), stopping early when
    ``sqrt(||B||_F^2 - ||diag B||^2) <= qr_tolerance ||B||_F``; lambda is the
    diagonal of the last B, sorted ascending with the basis, and eq. (10)'s
    epsilon rule and root follow. The basis is new per-factor state (kept
    between root steps, checkpointed). No ``failure_threshold`` (no
    eigendecomposition to judge).

    ``basis_reuse_tolerance`` tau > 0 with ``eigenbasis_method="eigh"`` (Meta's
    Eigendecomposed Shampoo with ``EighEigendecompositionConfig.tolerance``,
    eq. 10h): each factor keeps the eigenbasis of its last root (I before the
    first root step); a root step keeps it, with lambda = diag B, when B of
    eq. (10f) meets the same criterion at tau, and decomposes B's matrix by
    eigh otherwise (eq. 10), the new eigenvectors becoming the stored basis.
    0 (the default) always decomposes and stores nothing. No
    ``failure_threshold``.
    """

    method: Literal["eigh"] = "eigh"
    failure_threshold: float | None = None
    eigenbasis_method: Literal["eigh", "qr"] = "eigh"
    qr_max_iterations: int = 1
    qr_tolerance: float = 0.0
    basis_reuse_tolerance: float = 0.0

    def __post_init__(self) -> None:
        o = "root_inverse"
        v.choice(o, "method", self.method, ("eigh",))
        v.choice(o, "eigenbasis_method", self.eigenbasis_method, ("eigh", "qr"))
        v.integer(o, "qr_max_iterations", self.qr_max_iterations, low=0,
                  high=MAX_NEWTON_ITERATIONS)
        v.real(o, "qr_tolerance", self.qr_tolerance, low=0.0, high=1.0)
        v.real(o, "basis_reuse_tolerance", self.basis_reuse_tolerance, low=0.0, high=1.0)
        if self.eigenbasis_method == "qr" and self.basis_reuse_tolerance != 0.0:
            v.fail(o, "basis_reuse_tolerance", self.basis_reuse_tolerance,
                   "0.0 (the default) with eigenbasis_method='qr': its QR steps stop at "
                   "qr_tolerance, the same criterion (eq. 10f)")
        if self.eigenbasis_method == "eigh":
            if self.qr_max_iterations != 1:
                v.fail(o, "qr_max_iterations", self.qr_max_iterations,
                       "1 (the default) unless eigenbasis_method is 'qr'")
            if self.qr_tolerance != 0.0:
                v.fail(o, "qr_tolerance", self.qr_tolerance,
                       "0.0 (the default) unless eigenbasis_method is 'qr'")
        if self.stores_basis and self.failure_threshold is not None:
            # Eq. (10b) judges an eigendecomposition's error; eqs. (10f), (10h) may make none.
            which = ("eigenbasis_method='qr'" if self.qr
                     else f"basis_reuse_tolerance={self.basis_reuse_tolerance!r}")
            v.fail(o, "failure_threshold", self.failure_threshold,
                   f"None with {which} (no eigendecomposition to judge, eqs. 10f, 10h)")
        # >= 2^-126, not just > 0: tau is compared in float32 (eq. 10b), where a
        # smaller one is subnormal and XLA on CPU flushes it to 0.
        v.optional_normal(
            o, "failure_threshold", self.failure_threshold,
            none_means="an eigh root fails only when non-finite",
        )

    @property
    def qr(self) -> bool:
        """Whether eq. (10f)'s QR eigenbasis replaces eigh (a stored basis per factor)."""
        return self.eigenbasis_method == "qr"

    @property
    def reuses_basis(self) -> bool:
        """Whether eq. (10h) keeps an eigh root's eigenbasis while it still fits."""
        return self.eigenbasis_method == "eigh" and self.basis_reuse_tolerance > 0.0

    @property
    def stores_basis(self) -> bool:
        """Whether each factor keeps an eigenbasis beside its root (eqs. 10f, 10h)."""
        return self.qr or self.reuses_basis

    @property
    def failure_threshold_float32(self) -> float | None:
        """``fl32(tau)`` of eq. (10b): the threshold rounded to the nearest float32.

        A Python float holding a float32 value (inf above float32's range), so
        that every backend compares ``fl32(e)`` with the same number; None
        without a threshold.
        """
        if self.failure_threshold is None:
            return None
        try:
            packed = struct.pack("<f", self.failure_threshold)
        except OverflowError:  # rounds beyond float32's largest value
            return math.inf
        rounded: float = struct.unpack("<f", packed)[0]
        return rounded


@dataclass(frozen=True, kw_only=True)
class CoupledNewtonConfig:
    """Root inverse by the coupled Newton iteration, eq. (11).

    ``z = (1 + r) / (2 ||A||_F)``, ``X_0 = z^(1/r) I``, ``M_0 = z A``; repeat
    ``T = ((r + 1) I - M) / r``, ``X <- X T``, ``M <- T^r M`` until
    ``max|M - I| <= tolerance`` or ``max_iterations``. Optional Google rules:
    stop early (keeping the previous iterate) when the error grows by more
    than ``error_growth_limit``; retry up to ``retries`` times with the
    epsilon multiplied by ``retry_epsilon_factor`` while the final error
    exceeds ``retry_error_threshold``; declare failure (keep the previous
    root) when the final error is non-finite or >= ``failure_threshold``.

    ``deflation_rank`` k > 0 (Google's ``lobpcg_topk_precondition``):
    eq. (11d), the top-k eigenpairs of a factor of size n > 5k, estimated
    by ``deflation_iterations`` (None: k) LOBPCG iterations, are deflated
    before the iteration and restored after it; the failure test then
    judges the restored root against the undeflated factor.
    """

    method: Literal["coupled_newton"] = "coupled_newton"
    max_iterations: int = 100
    tolerance: float = 1e-6
    error_growth_limit: float | None = None
    retries: int = 0
    retry_epsilon_factor: float = 10.0
    retry_error_threshold: float = 0.05
    failure_threshold: float | None = None
    deflation_rank: int = 0
    deflation_iterations: int | None = None

    def __post_init__(self) -> None:
        o = "root_inverse"
        v.choice(o, "method", self.method, ("coupled_newton",))
        # Quadratic convergence: more iterations than this never help, and a
        # huge bound would only let a non-converging iteration run for ever.
        v.integer(o, "max_iterations", self.max_iterations, low=1, high=MAX_NEWTON_ITERATIONS)
        v.real(o, "tolerance", self.tolerance, low=0.0, low_open=True)
        if self.error_growth_limit is not None:
            v.real(o, "error_growth_limit", self.error_growth_limit, low=1.0)
        v.integer(o, "retries", self.retries, low=0)
        v.real(o, "retry_epsilon_factor", self.retry_epsilon_factor, low=1.0, low_open=True)
        v.real(o, "retry_error_threshold", self.retry_error_threshold, low=0.0, low_open=True)
        if self.failure_threshold is not None:
            v.real(o, "failure_threshold", self.failure_threshold, low=0.0, low_open=True)
        v.integer(o, "deflation_rank", self.deflation_rank, low=0)
        if self.deflation_iterations is not None:
            if self.deflation_rank == 0:
                v.fail(o, "deflation_iterations", self.deflation_iterations,
                       "None with deflation_rank=0 (no deflation to iterate for)")
            v.integer(o, "deflation_iterations", self.deflation_iterations, low=0,
                      high=MAX_NEWTON_ITERATIONS)

    def deflates(self, n: int) -> bool:
        """Whether an ``n x n`` factor is deflated (eq. 11d): ``n > 5 k``, LOBPCG's limit."""
        return self.deflation_rank > 0 and n > 5 * self.deflation_rank

    @property
    def lobpcg_iterations(self) -> int:
        """Eq. (11d)'s LOBPCG iteration bound m: ``deflation_iterations``, else k."""
        if self.deflation_iterations is None:
            return self.deflation_rank
        return self.deflation_iterations


@dataclass(frozen=True, kw_only=True)
class HigherOrderNewtonConfig:
    """Root inverse by Meta's coupled higher-order iteration, eq. (11c).

    Meta's ``CoupledHigherOrderConfig``: for root ``r = p / q`` (the exact
    fraction of the float r), a ridge ``max(rel_epsilon ||A||_inf,
    abs_epsilon)`` (not eq. 9's epsilon), one Newton step, then steps of
    order ``order`` (Horner's rule on Lakic's coefficients) until
    ``max|M - I| <= tolerance``, ``max_iterations``, or the error grows by
    more than 1.2 or stalls below 1e-3 (the last iterate kept); the root
    fails when ``max|(A + eps I) X^p - I| > 0.1`` or X is non-finite, and
    is raised to q at the end.
    """

    method: Literal["higher_order_newton"] = "higher_order_newton"
    order: int = 3
    rel_epsilon: float = 0.0
    abs_epsilon: float = 0.0
    max_iterations: int = 100
    tolerance: float = 1e-8

    def __post_init__(self) -> None:
        o = "root_inverse"
        v.choice(o, "method", self.method, ("higher_order_newton",))
        v.integer(o, "order", self.order, low=2, high=MAX_HIGHER_ORDER)
        v.real(o, "rel_epsilon", self.rel_epsilon, low=0.0)
        v.real(o, "abs_epsilon", self.abs_epsilon, low=0.0)
        v.integer(o, "max_iterations", self.max_iterations, low=1, high=MAX_NEWTON_ITERATIONS)
        v.real(o, "tolerance", self.tolerance, low=0.0)

    def coefficients(self, p: int) -> list[float]:
        """Lakic's b_0..b_{order-1} of eq. (11c) for root numerator p:
        ``b_i = prod_{j<i} (1 + j p) / (i! p^i)``, in Meta's order of operations."""
        b, num, den = [1.0], 1, 1
        for i in range(1, self.order):
            num *= 1 + (i - 1) * p
            den *= i * p
            b.append(num / den)
        return b


RootInverseConfig = EighConfig | CoupledNewtonConfig | HigherOrderNewtonConfig


@dataclass(frozen=True, kw_only=True)
class LowRankRootConfig:
    """Low-rank-plus-constant inverse roots of the large factors, eq. (10c).

    Google's ``compression_rank``: a factor of size ``n > rank + 2`` (where
    the ``n x (rank + 2)`` storage of its eigenvectors, eigenvalues and
    constant is smaller than the ``n x n`` root) takes its inverse root by
    eigendecomposition, eqs. (9)-(10) with ``ShampooConfig.epsilon`` (its
    ``relative_floor`` replaced by this one's when set), and then keeps only
    ``rank`` of its eigenvalues: those of the ``rank`` largest eigenvalues of
    B (``keep="largest"``; Google's ``compression_rank > 0``) or of the
    smallest (``keep="smallest"``; ``compression_rank < 0``). Every other
    eigenvalue's inverse root becomes their mean c:

        X = Q_K diag(x_K) Q_K^T + c (I - Q_K Q_K^T)

    The eigendecomposition is judged by eq. (10b) at ``failure_threshold``
    (None: only a non-finite root fails). Smaller factors use
    ``ShampooConfig.root_inverse``.
    """

    rank: int
    keep: Literal["largest", "smallest"] = "largest"
    failure_threshold: float | None = None
    relative_floor: float | None = None

    def __post_init__(self) -> None:
        o = "low_rank"
        v.integer(o, "rank", self.rank, low=1)
        v.choice(o, "keep", self.keep, ("largest", "smallest"))
        v.optional_normal(o, "failure_threshold", self.failure_threshold,
                          none_means="a low-rank root fails only when non-finite")
        if self.relative_floor is not None:
            v.epsilon(o, "relative_floor", self.relative_floor, zero=True)

    def compresses(self, n: int) -> bool:
        """Whether an ``n x n`` factor takes the low-rank root (``n > rank + 2``)."""
        return n > self.rank + 2

    @property
    def eigh(self) -> EighConfig:
        """The eigendecomposition's failure rule (eq. 10b) as an :class:`EighConfig`."""
        return EighConfig(failure_threshold=self.failure_threshold)

    def epsilon_for(self, epsilon: EpsilonConfig) -> EpsilonConfig:
        """Eq. (9)'s epsilon of the compressed factors: ``epsilon`` with this floor."""
        if self.relative_floor is None:
            return epsilon
        return dataclasses.replace(epsilon, relative_floor=self.relative_floor)


#: ``FrequentDirectionsConfig.rule``: Google's eq. (10d) or tearfree's Sketchy, eq. (10e).
FREQUENT_DIRECTIONS_RULES = ("google", "tearfree")


@dataclass(frozen=True, kw_only=True)
class FrequentDirectionsConfig:
    """Frequent-directions sketches of the large factors, eqs. (6c) and (10d).

    Google's ``frequent_directions`` with ``compression_rank`` (Sketchy,
    Feinberg et al. 2023, arXiv 2302.03764). A factor of size
    ``n > rank + 2`` keeps no statistic ``L_k``: on each statistics step its
    slot holds the step's observation ``C = G_(k) G_(k)^T`` (eq. 6c), and the
    root step folds C into a rank-``rank`` sketch ``(U, lambda, rho)``:

        M = beta2 U diag(lambda + eps) U^T + C,  sigma = eigenvalues of M (descending)
        lambda' = sigma_1..r - sigma_{r+1},  rho' = beta2 rho + sigma_{r+1}
        X = U' diag((lambda' + rho')^(-1/p)) U'^T + rho'^(-1/p) (I - U' U'^T)   (10d)

    and X = I while any lambda' or rho' is 0 (Google's ``has_zeros``: that
    dim is not preconditioned); an eigenvalue of M at most ``n eps_f sigma_1``
    counts as 0 (``zero_rtol``; eps_f the spacing of ``factor_dtype``). ``eps``
    is ``epsilon.value``, times ``max(lambda_1, relative_floor)`` with
    ``epsilon.scale = "relative"``
    (lambda_1 the sketch's largest value; Google's floor is 1e-6).
    ``average_gradients`` (Google's ``average_grad``): every factor's
    statistics (eqs. 6, 6c) take the sum of the gradients since the previous
    statistics step divided by ``statistics_frequency``, not this step's.
    ``reset_every`` (Google's ``reset_preconditioner``, every
    ``round(1 / (1 - beta2))`` steps with beta2 then 1): a root step t with
    ``(t - 1) mod reset_every = 0`` empties the sketch before its update.
    Smaller factors keep eq. (6) and ``root_inverse``.

    ``rule = "tearfree"`` is tearfree's Sketchy (``precondition/tearfree/
    sketchy.py``), eq. (10e) in place of (10d): EVERY factor is sketched, at
    rank ``k = min(n, rank)``; ``M = beta2 U diag(lambda) U^T + C`` (no eps in
    the sketch), ``lambda' = sigma_1..k - sigma_{k+1}`` (sigma_{n+1} = 0),
    ``rho' = sqrt(beta2) rho + sigma_{k+1}`` (tearfree decays its tail by
    sqrt(beta2)), ``eps = epsilon.value`` times ``sigma_1 + sqrt(beta2) rho``
    when relative, and ``X = U' diag((sigma_i + sqrt(beta2) rho + eps)^(-1/p))
    U'^T + (rho' + eps)^(-1/p) (I - U' U'^T)`` (0 for rho' = 0; directions
    with lambda' = 0 dropped from U'). It has no reset, no gradient averaging
    and no floor: ``reset_every``, ``average_gradients`` and ``relative_floor``
    must keep their defaults.
    """

    rank: int
    average_gradients: bool = False
    reset_every: int | None = None
    relative_floor: float = 1e-6
    rule: Literal["google", "tearfree"] = "google"

    def __post_init__(self) -> None:
        o = "frequent_directions"
        v.integer(o, "rank", self.rank, low=1)
        v.boolean(o, "average_gradients", self.average_gradients)
        v.optional_integer(o, "reset_every", self.reset_every, low=1,
                           none_means="the sketch is never emptied")
        v.epsilon(o, "relative_floor", self.relative_floor, zero=True)
        v.choice(o, "rule", self.rule, FREQUENT_DIRECTIONS_RULES)
        if self.rule == "tearfree":
            why = "with rule='tearfree' (eq. 10e has no such option)"
            if self.average_gradients:
                v.fail(o, "average_gradients", self.average_gradients, f"False {why}")
            if self.reset_every is not None:
                v.fail(o, "reset_every", self.reset_every, f"None {why}")
            if self.relative_floor != 1e-6:
                v.fail(o, "relative_floor", self.relative_floor, f"1e-6 (the default) {why}")

    def compresses(self, n: int) -> bool:
        """Whether an ``n x n`` factor is sketched: ``n > rank + 2`` (eq. 10d, as eq. 10c),
        every factor with ``rule = "tearfree"`` (eq. 10e)."""
        return self.rule == "tearfree" or n > self.rank + 2

    def sketch_rank(self, n: int) -> int:
        """The sketch's number of directions for an ``n x n`` factor: ``rank`` (eq. 10d),
        ``min(n, rank)`` with ``rule = "tearfree"`` (eq. 10e)."""
        return min(n, self.rank) if self.rule == "tearfree" else self.rank

    @staticmethod
    def zero_rtol(n: int, factor_dtype: str) -> float:
        """Eq. (10d)'s rank cutoff for an ``n x n`` factor: ``n`` times the spacing at 1
        of ``factor_dtype`` (an eigenvalue of M at most this times the largest is 0)."""
        return n * MACHINE_EPSILON[factor_dtype]

    def resets(self, t: int) -> bool:
        """Whether a root step t empties the sketch first (``(t - 1) mod reset_every = 0``)."""
        return self.reset_every is not None and (t - 1) % self.reset_every == 0


@dataclass(frozen=True, kw_only=True)
class OrderOverride:
    """Roots for every block of a given order (Meta's inverse_exponent_override).

    ``roots`` has one entry (used for every dim) or ``order`` entries; a root
    of 0 means that dim is not preconditioned.
    """

    order: int
    roots: tuple[float, ...]

    def __post_init__(self) -> None:
        o = "exponents.overrides_by_order[]"
        v.integer(o, "order", self.order, low=1)
        if not isinstance(self.roots, tuple) or len(self.roots) not in {1, self.order}:
            v.fail(o, "roots", self.roots, f"a tuple of 1 or {self.order} (=order) roots")
        for r in self.roots:
            v.real(o, "roots", r, low=0.0)


@dataclass(frozen=True, kw_only=True)
class ExponentConfig:
    """The inverse root r_k of each factor, eq. (12).

    Default ``r = 2 * n`` where n counts the block's dims
    (``"block_order"``, Meta: ``2 * max(order, 1)``) or the preconditioned
    dims of the whole parameter (``"preconditioned_dims"``, Google).
    ``override > 0`` sets every root (Google's exponent_override);
    ``overrides_by_order`` sets roots per block order (Meta).
    """

    default: Literal["block_order", "preconditioned_dims"] = "block_order"
    override: float = 0.0
    overrides_by_order: tuple[OrderOverride, ...] = ()

    def __post_init__(self) -> None:
        o = "exponents"
        v.choice(o, "default", self.default, ("block_order", "preconditioned_dims"))
        v.real(o, "override", self.override, low=0.0)
        if not isinstance(self.overrides_by_order, tuple):
            v.fail(o, "overrides_by_order", self.overrides_by_order, "a tuple of OrderOverride")
        for item in self.overrides_by_order:
            v.instance(o, "overrides_by_order", item, (OrderOverride,))
        orders = [item.order for item in self.overrides_by_order]
        if len(set(orders)) != len(orders):
            v.fail(o, "overrides_by_order", orders, "at most one override per order")
        if self.override > 0 and self.overrides_by_order:
            v.fail(o, "override", self.override, "0 when overrides_by_order is given")


@dataclass(frozen=True, kw_only=True)
class EigenvalueCorrectionConfig(_MovingAverage):
    """Eigenvalue-corrected Shampoo (SOAP family), eq. (17).

    The factors' eigenbases Q_k are refreshed on root steps; an Adam-style
    second moment ``D <- beta2 D + w (G x_k Q_k^T)^2`` is kept in
    that basis (``w = 1 - beta2``; ``beta2 == 1``: a sum, w = 1;
    ``ema_weight="one"``: w = 1, Meta's ``drop_weighting_factor_on_gsquare``),
    bias corrected when ``bias_correction``, and the direction is
    ``(F x_k Q_k^T) / (D^(1/root) + epsilon)`` rotated back by ``x_k Q_k``.
    ``roots_by_order`` gives blocks of some orders (number of block dims) their
    own root, ``((order, root), ...)``, as Meta's per-order
    ``inverse_exponent_override`` (root = 1 / exponent); other orders use ``root``.

    ``eigenvectors_dtype`` (Meta's ``factor_matrix_eigenvectors_dtype``) and
    ``corrected_eigenvalues_dtype`` (Meta's ``corrected_eigenvalues_dtype``)
    are rules, not precisions (eq. 17a): set to q, each Q_k is stored
    rounded to q and the rotations into and out of the eigenbasis are
    computed in q (the block rounded to q, each mode product rounded to q);
    set to s, D is stored in s, its decay ``beta2 D``, the quotient
    ``D / bc``, its root and ``+ epsilon`` each rounded to s, as Meta does.
    None (the default) keeps Q_k and D in ``factor_dtype`` and the reference
    unrounded: the numerics before these options, bit for bit.

    ``basis_reuse_tolerance`` tau (Meta's ``EighEigendecompositionConfig.tolerance``,
    eq. 17b): on a root step the stored Q_k is kept, without a new
    eigendecomposition, when ``B = Q_k^T (A + eps I) Q_k`` is nearly diagonal,
    ``sqrt(||B||_F^2 - ||diag B||^2) <= tau ||B||_F``; 0 (the default) always
    decomposes.

    ``eigenbasis_method="qr"`` (Meta's ``QREigendecompositionConfig``, eq.
    17c): the new Q_k is not an eigendecomposition but at most
    ``qr_max_iterations`` steps of the QR algorithm from the stored Q_k,
    stopping early under the same criterion at tau; then the columns are
    sorted by the diagonal of B.
    """

    beta2: float = 0.999
    ema_weight: Literal["one_minus_beta2", "one"] = "one_minus_beta2"
    epsilon: float = 1e-12
    bias_correction: bool = True
    root: float = 2.0
    roots_by_order: tuple[tuple[int, float], ...] = ()
    eigenvectors_dtype: InverseRootDtype | None = None
    corrected_eigenvalues_dtype: InverseRootDtype | None = None
    basis_reuse_tolerance: float = 0.0
    eigenbasis_method: Literal["eigh", "qr"] = "eigh"
    qr_max_iterations: int = 1

    def __post_init__(self) -> None:
        o = "eigenvalue_correction"
        v.choice(o, "eigenbasis_method", self.eigenbasis_method, ("eigh", "qr"))
        v.integer(o, "qr_max_iterations", self.qr_max_iterations, low=0,
                  high=MAX_NEWTON_ITERATIONS)
        if self.eigenbasis_method == "eigh" and self.qr_max_iterations != 1:
            v.fail(o, "qr_max_iterations", self.qr_max_iterations,
                   "1 (the default) unless eigenbasis_method is 'qr'")
        v.real(o, "beta2", self.beta2, low=0.0, high=1.0)
        v.choice(o, "ema_weight", self.ema_weight, ("one_minus_beta2", "one"))
        # > 0: a zero second moment (a zero gradient) would divide 0 by 0.
        v.epsilon(o, "epsilon", self.epsilon, zero=False)
        v.boolean(o, "bias_correction", self.bias_correction)
        v.real(o, "root", self.root, low=0.0, low_open=True)
        allowed = "a tuple of (order, root) pairs: an integer order >= 1, a root > 0"
        if not isinstance(self.roots_by_order, tuple):
            v.fail(o, "roots_by_order", self.roots_by_order, allowed)
        for item in self.roots_by_order:
            if not isinstance(item, tuple) or len(item) != 2:
                v.fail(o, "roots_by_order", self.roots_by_order, allowed)
            v.integer(o, "roots_by_order[].order", item[0], low=1)
            v.real(o, "roots_by_order[].root", item[1], low=0.0, low_open=True)
        orders = [item[0] for item in self.roots_by_order]
        if len(set(orders)) != len(orders) or orders != sorted(orders):
            v.fail(o, "roots_by_order", self.roots_by_order,
                   "at most one root per order, sorted by order")
        if any(item[1] == self.root for item in self.roots_by_order):
            # One spelling per config (importers, exporters and checkpoints compare them).
            v.fail(o, "roots_by_order", self.roots_by_order,
                   f"only roots that differ from root = {self.root}")
        v.real(o, "basis_reuse_tolerance", self.basis_reuse_tolerance, low=0.0, high=1.0)
        if self.eigenvectors_dtype is not None:
            v.choice(o, "eigenvectors_dtype", self.eigenvectors_dtype, INVERSE_ROOT_DTYPES,
                     none_means="the eigenbases stay in factor_dtype")
        if self.corrected_eigenvalues_dtype is not None:
            v.choice(o, "corrected_eigenvalues_dtype", self.corrected_eigenvalues_dtype,
                     INVERSE_ROOT_DTYPES, none_means="D stays in factor_dtype")
            smallest = _SMALLEST_POSITIVE.get(self.corrected_eigenvalues_dtype)
            if smallest is not None and self.epsilon < smallest[0]:
                # Eq. (17a): epsilon is added in s; one that rounds to 0 there
                # divides 0 by 0 wherever D is 0.
                v.fail(o, "epsilon", self.epsilon,
                       f"a number >= {smallest[1]} (the smallest positive "
                       f"{self.corrected_eigenvalues_dtype}) with corrected_eigenvalues_dtype="
                       f"{self.corrected_eigenvalues_dtype!r}: a smaller one is 0 there")

    @property
    def update_weight(self) -> float:
        """``w`` of eq. (17): 1 for a sum (beta2 = 1) or ``ema_weight="one"``, else 1 - beta2."""
        if self.beta2 == 1.0 or self.ema_weight == "one":
            return 1.0
        return 1.0 - self.beta2

    def root_for(self, order: int) -> float:
        """The root of eq. (17) for a block with ``order`` dims."""
        for item_order, root in self.roots_by_order:
            if item_order == order:
                return float(root)
        return float(self.root)


@dataclass(frozen=True, kw_only=True)
class GraftingConfig:
    """The first-order method whose step size Shampoo borrows, eqs. (14), (18).

    ``graft(X) = X / (sqrt(V / bc) + epsilon)`` (``epsilon_placement=
    "inside_sqrt"``: ``X / sqrt(V / bc + epsilon)``, tearfree's RMSProp) with
    ``V <- beta2 V + w G^2`` (adagrad: beta2 = w = 1; rmsprop/adam:
    w = 1 - beta2, or w = 1 with ``ema_weight="one"``, Meta's
    ``drop_weighting_factor_on_gsquare``; adam bias-corrects with
    ``bc = 1 - beta2^t``). ``sign``
    is sign(X); ``*_normalized`` variants first normalise G by
    ``||G|| + normalize_epsilon``. After preconditioning, the Shampoo
    direction P is rescaled: ``P * ||graft(F)|| / (||P|| + norm_epsilon)``,
    the norms taken per block or over the whole parameter (``norm_scope``).
    ``clip_rms`` = c (Google's ``clip_by_scaled_gradient_norm``; only for
    the adaptive types) divides the graft direction of the whole parameter
    by ``max(1, rms / c)``, ``rms = ||graft(X)|| / sqrt(size)`` (eq. 14d);
    None: no clipping.

    ``adafactor`` (eq. 14e, optax's Adafactor as tearfree grafts it): moments
    of ``G^2 + epsilon`` over the whole parameter in its own shape, an EMA
    with decay ``1 - t^(-decay_exponent)`` (float32), factored into row and
    column means over its two largest dims when the smaller of them is at
    least ``factor_min_dim``; ``graft(X) = X / sqrt(V^)`` with V^ the factored
    (or full) estimate, then eq. (14d), then times ``max(rms(W),
    parameter_scale_floor)`` (W the parameter; None: not scaled). Its epsilon
    is inside the moment (``epsilon_placement="inside_sqrt"``); ``beta2``,
    ``ema_weight`` and ``bias_correction`` are unused by it.
    """

    type: GraftingType = "none"
    beta2: float = 1.0
    ema_weight: Literal["one_minus_beta2", "one"] = "one_minus_beta2"
    epsilon: float = 1e-10
    bias_correction: bool = False
    norm_scope: Literal["block", "parameter"] = "block"
    norm_epsilon: float = 1e-16
    normalize_epsilon: float = 1e-16
    clip_rms: float | None = None
    epsilon_placement: Literal["after_sqrt", "inside_sqrt"] = "after_sqrt"
    decay_exponent: float = 0.8
    factor_min_dim: int = 128
    parameter_scale_floor: float | None = None

    def __post_init__(self) -> None:
        o = "grafting"
        v.choice(o, "type", self.type, GRAFTING_TYPES)
        v.real(o, "beta2", self.beta2, low=0.0, high=1.0, low_open=True)
        if self.type == "adagrad" or self.type == "adagrad_normalized":
            if self.beta2 != 1.0:
                v.fail(o, "beta2", self.beta2, f"1.0 for grafting type {self.type!r}")
        if self.type in ("rmsprop", "adam", "rmsprop_normalized") and self.beta2 == 1.0:
            v.fail(o, "beta2", self.beta2, f"a value in (0, 1) for grafting type {self.type!r}")
        v.choice(o, "ema_weight", self.ema_weight, ("one_minus_beta2", "one"))
        # Only an EMA has a weight to drop (a sum already adds g^2 with weight 1).
        if self.ema_weight == "one" and self.type not in ("rmsprop", "adam", "rmsprop_normalized"):
            v.fail(o, "ema_weight", self.ema_weight,
                   f"'one_minus_beta2' for grafting type {self.type!r} ('one' needs an EMA "
                   "graft: rmsprop, adam or rmsprop_normalized)")
        # An epsilon that divides must be > 0: a zero gradient (V = 0,
        # ||G|| = 0, P = 0) would otherwise give 0 / 0 (eqs. 14a, 14c, 14e, 18).
        v.epsilon(o, "epsilon", self.epsilon, zero=not self.adaptive)
        v.boolean(o, "bias_correction", self.bias_correction)
        v.choice(o, "norm_scope", self.norm_scope, ("block", "parameter"))
        v.epsilon(o, "norm_epsilon", self.norm_epsilon, zero=self.type == "none")
        v.epsilon(o, "normalize_epsilon", self.normalize_epsilon, zero=not self.normalizes_input)
        v.optional_normal(o, "clip_rms", self.clip_rms, none_means="no clipping")
        v.choice(o, "epsilon_placement", self.epsilon_placement, ("after_sqrt", "inside_sqrt"))
        adaptive = ", ".join((*GRAFTING_TYPES_WITH_STATE, "adafactor"))
        if self.epsilon_placement == "inside_sqrt" and not self.adaptive:
            v.fail(o, "epsilon_placement", self.epsilon_placement,
                   f"'after_sqrt' for grafting type {self.type!r} (eq. 14c places epsilon "
                   f"only for the adaptive types: {adaptive})")
        if self.clip_rms is not None and not self.adaptive:
            v.fail(o, "clip_rms", self.clip_rms,
                   f"None for grafting type {self.type!r} (eq. 14d clips the adaptive types: "
                   f"{adaptive})")
        self._check_adafactor()

    def _check_adafactor(self) -> None:
        """Eq. (14e)'s fields: set only for ``adafactor``, which leaves the EMA fields of
        eq. (14b) at their defaults."""
        o = "grafting"
        v.real(o, "decay_exponent", self.decay_exponent, low=0.0, high=1.0, low_open=True)
        v.integer(o, "factor_min_dim", self.factor_min_dim, low=1)
        v.optional_normal(o, "parameter_scale_floor", self.parameter_scale_floor,
                          none_means="no scaling by the parameter's rms")
        if not self.factored:
            for name, default in (("decay_exponent", 0.8), ("factor_min_dim", 128),
                                  ("parameter_scale_floor", None)):
                if getattr(self, name) != default:
                    v.fail(o, name, getattr(self, name),
                           f"{default!r} unless type is 'adafactor' (eq. 14e)")
            return
        why = "for grafting type 'adafactor' (eq. 14e"
        if self.beta2 != 1.0:
            v.fail(o, "beta2", self.beta2, f"1.0 {why}: its decay is 1 - t^(-decay_exponent))")
        if self.ema_weight != "one_minus_beta2":
            v.fail(o, "ema_weight", self.ema_weight, f"'one_minus_beta2' {why}: unused)")
        if self.bias_correction:
            v.fail(o, "bias_correction", self.bias_correction, f"False {why}: unused)")
        if self.epsilon_placement != "inside_sqrt":
            v.fail(o, "epsilon_placement", self.epsilon_placement,
                   f"'inside_sqrt' {why} adds epsilon to G^2 inside its moments)")

    @property
    def has_state(self) -> bool:
        """Whether the graft keeps a second-moment state V (eq. 14b): the adaptive types."""
        return self.type in GRAFTING_TYPES_WITH_STATE

    @property
    def factored(self) -> bool:
        """Whether the graft is eq. (14e)'s Adafactor (moments of the whole parameter)."""
        return self.type == "adafactor"

    def factored_dims(self, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """Eq. (14e): ``(d0, d1)``, the largest and second largest dim of ``shape`` (the
        last two of a stable ascending sort by size: on ties the later dim sorts last),
        when the rank is >= 2 and ``shape[d1] >= factor_min_dim``; else None (the full
        moment V). optax's ``_factored_dims`` takes numpy's ``argsort``, the same order
        where neither of the two largest sizes is shared (docs/spec.md, eq. 14e)."""
        if len(shape) < 2:
            return None
        order = sorted(range(len(shape)), key=lambda k: shape[k])
        d0, d1 = order[-1], order[-2]
        return (d0, d1) if shape[d1] >= self.factor_min_dim else None

    def adafactor_decay(self, t: int) -> float:
        """``beta_t = fl32(1 - fl32(t^(-c)))`` of eq. (14e) at step t >= 1: t^(-c) in
        float64 rounded to float32 (correctly, where a float32 ``pow`` need not be); the
        difference of two float32 numbers is exact in float64 (below 2^-25 it rounds to
        1 either way), so rounding it once is float32's subtraction."""
        power = _float32(float(t) ** -self.decay_exponent)
        return _float32(1.0 - power)

    @property
    def adaptive(self) -> bool:
        """Whether the graft divides by a second moment: eq. (14b)'s types or eq. (14e)."""
        return self.has_state or self.factored

    @property
    def normalizes_input(self) -> bool:
        """Whether eq. (14a) divides the gradient by its norm first (``*_normalized``)."""
        return self.type.endswith("_normalized")

    @property
    def update_weight(self) -> float:
        """``w`` of eq. (14b): 1 for a sum (``beta2 == 1``, AdaGrad) or
        ``ema_weight="one"``, else ``1 - beta2``."""
        return 1.0 if self.beta2 == 1.0 or self.ema_weight == "one" else 1.0 - self.beta2

    @property
    def corrects_bias(self) -> bool:
        """Whether eq. (14c) divides V by ``1 - beta2^t`` (only an EMA has a bias)."""
        return self.bias_correction and self.beta2 < 1.0

    def bias_correction_factor(self, t: int) -> float:
        """Eq. (14c): ``1 - beta2^t`` at step t, or 1 without bias correction."""
        return 1.0 - self.beta2**t if self.corrects_bias else 1.0

    @property
    def rescale_scope(self) -> Literal["block", "parameter"] | None:
        """Where eq. (18) takes the norms: per block, per parameter, or None (no graft)."""
        return None if self.type == "none" else self.norm_scope


def _float32(x: float) -> float:
    """x rounded to the nearest float32 (ties to even)."""
    out: float = struct.unpack("f", struct.pack("f", x))[0]
    return out


#: The elementwise methods a diagonal preconditioner may be (eq. 16b).
DiagonalType = Literal["sgd", "adagrad", "rmsprop", "adam", "sign"]
DIAGONAL_TYPES: tuple[str, ...] = ("sgd", "adagrad", "rmsprop", "adam", "sign")


@dataclass(frozen=True, kw_only=True)
class DiagonalPreconditionerConfig:
    """A diagonal preconditioner in place of the Kronecker one, eq. (16b).

    Meta's ``SGDPreconditionerConfig``, ``AdaGradPreconditionerConfig``,
    ``RMSpropPreconditionerConfig``, ``AdamPreconditionerConfig`` and
    ``SignDescentPreconditionerConfig`` (its default scale 1) given as
    ``preconditioner_config``. The block direction is eq. (14c)'s elementwise
    method applied to the filtered gradient with a state of its own,
    ``V_D <- beta2 V_D + w G^2`` (eq. 14b, every step):

    ``D(X) = X`` (sgd), ``sign(X)`` (sign), ``X / (sqrt(V_D / bc) + epsilon)``
    (adagrad: beta2 = w = 1; rmsprop, adam: w = 1 - beta2, or 1 with
    ``ema_weight="one"``; adam bias-corrects with ``bc = 1 - beta2^t``).

    Grafting (eq. 18), momentum and weight decay apply to it as to eq. (16)'s
    direction, so with ``grafting.type="none"`` and no filter or momentum the
    step is the first-order method itself (``torch.optim.Adagrad``,
    ``RMSprop``, ``Adam`` with the filter as its beta1, ``SGD``).
    """

    type: DiagonalType = "adagrad"
    beta2: float = 1.0
    ema_weight: Literal["one_minus_beta2", "one"] = "one_minus_beta2"
    epsilon: float = 1e-10
    bias_correction: bool = False

    def __post_init__(self) -> None:
        o = "diagonal"
        v.choice(o, "type", self.type, DIAGONAL_TYPES)
        # The same rules as the graft of the same type (eq. 14), checked there.
        try:
            self.as_graft()
        except ValueError as err:
            raise ValueError(str(err).replace("grafting", "diagonal")) from None

    def as_graft(self) -> GraftingConfig:
        """Eq. (14)'s method of the same type and values: the one rule both use."""
        return GraftingConfig(
            type=self.type, beta2=self.beta2, ema_weight=self.ema_weight,
            epsilon=self.epsilon, bias_correction=self.bias_correction,
        )

    @property
    def has_state(self) -> bool:
        """Whether the diagonal keeps a state V_D (eq. 14b): adagrad, rmsprop, adam."""
        return self.type in GRAFTING_TYPES_WITH_STATE


#: Meta's default quintic Newton-Schulz coefficients (Muon's), eq. (16c).
MUON_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
#: Upper bound of ``SpectralDescentConfig.num_iterations``.
MAX_NEWTON_SCHULZ_ITERATIONS = 1000


@dataclass(frozen=True, kw_only=True)
class SpectralDescentConfig:
    """Spectral descent in place of the Kronecker preconditioner, eq. (16c).

    Meta's ``SpectralDescentPreconditionerConfig``: every block is a matrix
    (2-D after eqs. 4-5; a parameter whose blocks are not is refused when it is
    planned) and its direction is the filtered gradient block orthogonalized,
    ``P_B = orth(F~_B)``:

    - ``method="svd"``: ``U_r V_r^T`` of the reduced SVD ``F~_B = U S V^T``
      over the singular values above ``max(m, n) eps s_max`` (eps of the
      working precision: the rank of F~_B; times ``sum(S)`` with
      ``scale_by_nuclear_norm``). Meta takes every pair, the arbitrary null
      vectors of a rank-deficient block included;
    - ``method="newton_schulz"``: ``X = F~_B / max(||F~_B||_F, 1e-8)``
      (transposed when it has fewer rows than columns), then
      ``num_iterations`` times ``A = X^T X; X = a X + X (b A + c A A)`` with
      ``(a, b, c) = coefficients`` (Meta's default: Muon's), transposed back.

    No state, no roots. Grafting (eq. 18), momentum and weight decay apply to
    it as to eq. (16)'s direction.
    """

    method: Literal["newton_schulz", "svd"] = "newton_schulz"
    num_iterations: int = 5
    coefficients: tuple[float, float, float] = MUON_COEFFICIENTS
    scale_by_nuclear_norm: bool = False

    def __post_init__(self) -> None:
        o = "spectral"
        v.choice(o, "method", self.method, ("newton_schulz", "svd"))
        v.integer(o, "num_iterations", self.num_iterations, low=0,
                  high=MAX_NEWTON_SCHULZ_ITERATIONS)
        if (not isinstance(self.coefficients, tuple) or len(self.coefficients) != 3
                or not all(isinstance(c, (int, float)) and not isinstance(c, bool)
                           and math.isfinite(c) for c in self.coefficients)):
            v.fail(o, "coefficients", self.coefficients, "a tuple of three finite numbers "
                   "(a, b, c) of X <- a X + b X X^T X + c (X X^T)^2 X")
        v.boolean(o, "scale_by_nuclear_norm", self.scale_by_nuclear_norm)
        if self.method == "svd":
            # Unused by the SVD: a value other than the default would be silently ignored.
            if self.num_iterations != 5:
                v.fail(o, "num_iterations", self.num_iterations,
                       "5 (the default; unused) with method='svd'")
            if self.coefficients != MUON_COEFFICIENTS:
                v.fail(o, "coefficients", self.coefficients,
                       "the default (unused) with method='svd'")
        elif self.scale_by_nuclear_norm:
            v.fail(o, "scale_by_nuclear_norm", True,
                   "False with method='newton_schulz' (only the SVD scales by sum(S))")


@dataclass(frozen=True, kw_only=True)
class GradientFilterConfig:
    """Exponential filtering of the gradient (Meta's betas[0], beta3), eq. (15).

    Stored ``F_t = beta1 F_{t-1} + (1 - beta1) G_t``; the direction uses
    ``beta3 F_{t-1} + (1 - beta3) G_t`` (``beta3=None`` means beta1, i.e.
    F_t), divided by ``1 - beta3 * beta1^(t-1)`` when ``bias_correction``.
    ``beta1 == 0`` disables filtering.
    """

    beta1: float = 0.0
    beta3: float | None = None
    bias_correction: bool = False

    def __post_init__(self) -> None:
        o = "gradient_filter"
        v.real(o, "beta1", self.beta1, low=0.0, high=1.0, high_open=True)
        if self.beta3 is not None:
            v.real(o, "beta3", self.beta3, low=0.0, high=1.0, high_open=True)
        v.boolean(o, "bias_correction", self.bias_correction)

    @property
    def enabled(self) -> bool:
        """Whether eq. (15) filters at all (``beta1 != 0``); otherwise F = G."""
        return self.beta1 != 0.0

    @property
    def direction_beta(self) -> float:
        """``beta3`` of eq. (15): the weight of ``F_{t-1}`` in the direction (beta1 if None)."""
        return self.beta1 if self.beta3 is None else self.beta3

    def bias_correction_factor(self, t: int) -> float:
        """Eq. (15): ``1 - beta3 * beta1^(t-1)`` at step t, or 1 without bias correction."""
        if self.bias_correction:
            return 1.0 - self.direction_beta * self.beta1 ** (t - 1)
        return 1.0


@dataclass(frozen=True, kw_only=True)
class MomentumConfig:
    """Momentum on the search direction, eq. (20).

    ``M <- momentum * M + (1 - dampening) P``; the step uses M, or with
    Nesterov ``(1 - dampening) P + momentum * M``. ``buffers="separate"``
    keeps one buffer for the Shampoo direction and one for the graft
    direction, both updated every step (Google; without a graft the graft
    direction is F~, the direction before the start step, as Google's SGD
    warm-up with graft NONE). ``learning_rate_placement``:
    ``"after_momentum"`` multiplies the momentum output by lr (Meta; Google's
    decoupled_learning_rate) and ``"before_momentum"`` scales P by lr first.

    ``storage`` (eq. 20b) is a rule, not a precision: ``"int8_columnwise"``
    stores every buffer of a parameter of rank >= 2 (its own shape, before
    squeezing and merging) as int8 integers with one scale per column (per
    index of dims 1..n-1, the maximum taken over dim 0), rounded to nearest
    with ties to even, and reads it back as integer * scale at the next step
    (Google's ``best_effort_memory_usage_reduction``, ``QuantizedValue``);
    buffers of rank-0 and rank-1 parameters stay in float. ``scale_dtype``
    is the dtype that quantization computes in and keeps its scales in
    (Google: its momentum's dtype, float32, float64 under 64-bit JAX); the
    reference emulates it exactly. ``"float"`` (the default) keeps the
    buffers unrounded: today's numerics, bit for bit.
    """

    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    buffers: Literal["shared", "separate"] = "shared"
    learning_rate_placement: Literal["after_momentum", "before_momentum"] = "after_momentum"
    storage: MomentumStorage = "float"
    scale_dtype: Literal["float32", "float64"] = "float32"

    def __post_init__(self) -> None:
        o = "momentum"
        v.real(o, "momentum", self.momentum, low=0.0, high=1.0, high_open=True)
        v.real(o, "dampening", self.dampening, low=0.0, high=1.0, high_open=True)
        v.boolean(o, "nesterov", self.nesterov)
        v.choice(o, "buffers", self.buffers, ("shared", "separate"))
        v.choice(
            o,
            "learning_rate_placement",
            self.learning_rate_placement,
            ("after_momentum", "before_momentum"),
        )
        v.choice(o, "storage", self.storage, MOMENTUM_STORAGES)
        v.choice(o, "scale_dtype", self.scale_dtype, ("float32", "float64"))
        if self.storage == "float" and self.scale_dtype != "float32":
            v.fail(o, "scale_dtype", self.scale_dtype,
                   "'float32' (the default) with storage='float' (no scales are kept)")

    @property
    def enabled(self) -> bool:
        """Whether eq. (20) keeps a momentum buffer (``momentum != 0``)."""
        return self.momentum != 0.0

    def quantizes(self, rank: int) -> bool:
        """Whether eq. (20b) stores the buffers of a parameter of this (original) rank as int8."""
        return self.enabled and self.storage == "int8_columnwise" and rank >= 2

    @property
    def separate_buffers(self) -> bool:
        """Whether eq. (20) keeps a Shampoo buffer and a graft buffer (Google)."""
        return self.enabled and self.buffers == "separate"

    @property
    def direction_weight(self) -> float:
        """``1 - dampening``: the weight of the new direction P in eq. (20)."""
        return 1.0 - self.dampening

    @property
    def lr_before_momentum(self) -> bool:
        """Whether P is scaled by the learning rate before momentum (eq. 19)."""
        return self.learning_rate_placement == "before_momentum"


#: The largest ``IterateAveragingConfig.eval_lr_power``.
MAX_EVAL_LR_POWER = 16


@dataclass(frozen=True, kw_only=True)
class IterateAveragingConfig:
    """Primal averaging of the iterates, eq. (20d), in place of momentum.

    Meta's ``GeneralizedPrimalAveragingConfig`` (``type="gpa"``; arXiv
    2512.17131, as Meta cites it) and ``ScheduleFreeConfig`` (``"schedule_free"``;
    Defazio et al. 2024, "The Road Less Scheduled"). The parameters W are the
    training sequence y, where gradients are taken; the optimizer keeps the
    base sequence Z (starting at W) and each step, with ``d = -lr_t P``:

        Delta = (1 - mu_x mu_y) d + (1 - mu_x) (Z - W),   Z <- Z + d,   W <- W + Delta

    ``mu_y = train_interp``; ``mu_x = eval_interp`` (gpa), or
    ``1 - lr_t^p / sum_{i<=t} lr_i^p`` with ``p = eval_lr_power``
    (schedule_free). The evaluation sequence ``x = (W - (1 - mu_y) Z) / mu_y``
    is what the backends' ``eval()`` puts in the parameters (``train()`` back).
    """

    type: Literal["gpa", "schedule_free"] = "gpa"
    train_interp: float = 0.8
    eval_interp: float = 0.9
    eval_lr_power: int = 2

    def __post_init__(self) -> None:
        o = "averaging"
        v.choice(o, "type", self.type, ("gpa", "schedule_free"))
        v.real(o, "train_interp", self.train_interp, low=0.0, high=1.0, low_open=True)
        v.real(o, "eval_interp", self.eval_interp, low=0.0, high=1.0, high_open=True)
        v.integer(o, "eval_lr_power", self.eval_lr_power, low=0, high=MAX_EVAL_LR_POWER)
        # The other type's coefficient is unused: only its default, so that a config
        # says what runs (and round-trips through Meta's two classes).
        if self.type == "gpa" and self.eval_lr_power != 2:
            v.fail(o, "eval_lr_power", self.eval_lr_power, "2 (the default; unused) with "
                   "type='gpa'")
        if self.type == "schedule_free" and self.eval_interp != 0.9:
            v.fail(o, "eval_interp", self.eval_interp, "0.9 (the default; unused) with "
                   "type='schedule_free' (mu_x follows the learning rates)")

    def eval_coefficient(self, lr_t: float, lr_power_sum: float) -> float:
        """``mu_x`` of eq. (20d) at a step whose ``sum_{i<=t} lr_i^p`` is ``lr_power_sum``."""
        if self.type == "gpa":
            return self.eval_interp
        if lr_power_sum == 0.0:
            # Every rate so far 0 (a warm-up from 0): no step is taken (d = 0); mu_x = 1
            # keeps W, as Defazio et al.'s Schedule-Free does.
            return 1.0
        return 1.0 - lr_t**self.eval_lr_power / lr_power_sum


@dataclass(frozen=True, kw_only=True)
class WeightDecayConfig:
    """Weight decay, eqs. (2) and (19).

    ``"l2"``: ``G <- G + value * W`` before statistics (enters the factors);
    ``"direction"``: ``P <- P + value * W`` after preconditioning and grafting,
    before momentum (Meta's DECOUPLED; Google's default coupled decay);
    ``"update"``: applied after momentum, ``W <- W - lr U - lr * value * W``
    (Google's decoupled_weight_decay): scaled by lr, never by momentum.
    With ``momentum.learning_rate_placement = "before_momentum"`` the
    ``"direction"`` term is added after P is scaled by lr (so it is not
    scaled by lr), as Google does with decoupled_learning_rate=False.

    ``scale_by_lr_ratio`` (``"direction"`` only; Meta's CORRECTED): the
    term is ``value * lr_t / lr_0`` W, lr_t this step's learning rate and
    lr_0 the one the optimizer was built with (``ShampooConfig.learning_rate``,
    or the backend's learning-rate argument when given), so that under a
    schedule the decay follows the rate (eq. 19).
    """

    value: float = 0.0
    type: Literal["l2", "direction", "update"] = "direction"
    scale_by_lr_ratio: bool = False

    def __post_init__(self) -> None:
        o = "weight_decay"
        v.real(o, "value", self.value, low=0.0)
        v.choice(o, "type", self.type, ("l2", "direction", "update"))
        v.boolean(o, "scale_by_lr_ratio", self.scale_by_lr_ratio)
        if self.scale_by_lr_ratio and self.type != "direction":
            v.fail(o, "scale_by_lr_ratio", True,
                   "False unless type is 'direction' (Meta's CORRECTED decay)")

    def direction_value(self, lr_t: float, lr_0: float) -> float:
        """Eq. (19)'s coefficient of W: ``value``, or ``value * lr_t / lr_0`` with
        ``scale_by_lr_ratio`` (in Meta's order: the product first)."""
        return self.value * lr_t / lr_0 if self.scale_by_lr_ratio else self.value

    def applies(self, kind: Literal["l2", "direction", "update"]) -> bool:
        """Whether decay of this ``kind`` is on: eq. (2) l2, (19) direction, (21) update."""
        return self.type == kind and self.value != 0.0


@dataclass(frozen=True, kw_only=True)
class BlockingConfig:
    """The shape plan: squeeze, merge, block, skip, eqs. (4)-(5).

    Size-1 dims are dropped (``squeeze``; False keeps them, each a 1 x 1
    factor that counts in its block's order, as Google's
    ``best_effort_shape_interpretation=False``). A 0-d parameter is one
    ``(1,)`` block with a 1 x 1 factor, or with no factor when
    ``scalar_factor`` is False (Meta's target dimensionality inf, Google's
    ``skip_preconditioning_rank_lt=0``). Dims are merged greedily while the product stays
    <= ``merge_dims_up_to`` (None: no merging), scanning from the last dim
    toward the first (Meta) or the first toward the last (Google), and only
    while more than ``merge_target_rank`` dims could remain (Meta's
    ``target_parameter_dimensionality``). Each dim is
    then split into chunks of ``max_preconditioner_dim`` (remainder last),
    blocks in row-major order. A parameter is not preconditioned (it takes the
    graft direction) when an original dim exceeds ``skip_dim_size_gt`` or its
    rank is below ``skip_rank_lt``. ``preconditioned_dims`` selects one-sided
    preconditioning: all dims, all but the last (``"all_but_last"``,
    Google's INPUT) or only the last (``"last"``, Google's OUTPUT).
    """

    max_preconditioner_dim: int = 1024
    merge_dims_up_to: int | None = 1024
    merge_direction: Literal["last_to_first", "first_to_last"] = "last_to_first"
    skip_dim_size_gt: int | None = None
    skip_rank_lt: int = 0
    preconditioned_dims: Literal["all", "all_but_last", "last"] = "all"
    squeeze: bool = True
    merge_target_rank: int = 1
    scalar_factor: bool = True

    def __post_init__(self) -> None:
        o = "blocking"
        v.boolean(o, "squeeze", self.squeeze)
        v.boolean(o, "scalar_factor", self.scalar_factor)
        v.integer(o, "merge_target_rank", self.merge_target_rank, low=1)
        v.integer(o, "max_preconditioner_dim", self.max_preconditioner_dim, low=1)
        v.optional_integer(o, "merge_dims_up_to", self.merge_dims_up_to, low=1, none_means="off")
        v.choice(o, "merge_direction", self.merge_direction, ("last_to_first", "first_to_last"))
        v.optional_integer(o, "skip_dim_size_gt", self.skip_dim_size_gt, low=1, none_means="off")
        v.integer(o, "skip_rank_lt", self.skip_rank_lt, low=0)
        v.choice(
            o, "preconditioned_dims", self.preconditioned_dims, ("all", "all_but_last", "last")
        )


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """When statistics, roots and the Shampoo direction happen, eq. (8).

    Steps are counted t = 1, 2, ... With ``period_anchor="end"`` amortized
    work happens when ``t % frequency == 0`` (Meta); with ``"start"`` when
    ``(t - 1) % frequency == 0`` (Google's 0-based count). The Shampoo
    direction is used from ``start_preconditioning_step`` on (None: never,
    the grafting method throughout). ``roots_before_start=False`` computes
    roots only from the start step, and always at it (Meta);
    ``True`` follows the frequency from step 1 (Google).

    ``roots_take_effect``: roots refreshed at a root step precondition that
    step's direction (``"same_step"``), or only the next step's on
    (``"next_step"``: the step's direction uses the roots held before it, as
    Google's ``shard_optimizer_states=True`` does). Not with
    ``eigenvalue_correction``.

    ``precondition_frequency_growth`` = g (Google's
    ``end_preconditioning_compute_steps`` with
    ``decay_preconditioning_compute_steps``) makes the root period follow the
    learning rate (eq. 8b): ``f_t = max(floor((f + (1 - lr_t / lr_1) g) / 10) * 10, 1)``,
    lr_1 the learning rate of the first step
    (:func:`shampoo_spec.schedule.root_period`). None: the period is
    ``precondition_frequency`` throughout.
    """

    precondition_frequency: int = 1
    statistics_frequency: int = 1
    start_preconditioning_step: int | None = 1
    period_anchor: Literal["end", "start"] = "end"
    roots_before_start: bool = False
    roots_take_effect: Literal["same_step", "next_step"] = "same_step"
    precondition_frequency_growth: int | None = None

    def __post_init__(self) -> None:
        o = "schedule"
        v.integer(o, "precondition_frequency", self.precondition_frequency, low=1)
        v.integer(o, "statistics_frequency", self.statistics_frequency, low=1)
        v.optional_integer(
            o, "start_preconditioning_step", self.start_preconditioning_step, low=1,
            none_means="never precondition",
        )
        v.choice(o, "period_anchor", self.period_anchor, ("end", "start"))
        v.boolean(o, "roots_before_start", self.roots_before_start)
        v.choice(o, "roots_take_effect", self.roots_take_effect, ("same_step", "next_step"))
        v.optional_integer(
            o, "precondition_frequency_growth", self.precondition_frequency_growth, low=1,
            none_means="a constant root period",
        )


@dataclass(frozen=True, kw_only=True)
class FailureConfig:
    """What happens on non-finite input or a failed root, eq. (3) and (13).

    ``nonfinite_gradient``: ``"raise"`` (naming the parameter) or
    ``"skip_block"`` (that block's statistics, graft state and parameter are
    left unchanged this step). A failed or non-finite root keeps the previous
    root and is counted; a block whose root steps fail (any factor) more than
    ``max_consecutive_root_failures`` times in a row raises (None: never).
    """

    nonfinite_gradient: Literal["raise", "skip_block"] = "raise"
    max_consecutive_root_failures: int | None = None

    def __post_init__(self) -> None:
        o = "failure"
        v.choice(o, "nonfinite_gradient", self.nonfinite_gradient, ("raise", "skip_block"))
        v.optional_integer(
            o, "max_consecutive_root_failures", self.max_consecutive_root_failures, low=0,
            none_means="never raise",
        )


@dataclass(frozen=True, kw_only=True)
class ShampooConfig:
    """The whole of Shampoo. See docs/spec.md for the numbered equations.

    ``eigenvalue_correction`` switches the Kronecker root preconditioner
    (eq. 16) for the eigenvalue-corrected one (eq. 17), ``diagonal`` for an
    elementwise one (eq. 16b) and ``spectral`` for orthogonalized blocks
    (eq. 16c); ``statistics.kl`` makes the factors KL-Shampoo's (eq. 6b) and
    ``averaging`` replaces momentum by iterate averaging (eq. 20d).
    ``factor_dtype`` is the precision fast backends keep factors and roots
    in; the reference always computes in float64.

    ``inverse_root_dtype`` (Meta's ``inv_factor_matrix_dtype``) is a rule,
    not a precision: when set to s, every inverse root is stored rounded to s
    (eq. 11a, ``X^ = round_s(X)``, X computed from the factor as before) and
    the Kronecker products of eq. (16) are computed in s (the filtered
    gradient block rounded to s, each mode product rounded to s), as Meta
    does; the reference emulates both roundings exactly. None (the default)
    keeps the roots in ``factor_dtype`` and the reference unrounded: today's
    numerics, bit for bit. Not with ``eigenvalue_correction`` (its Q_k are
    eigenbases, which Meta stores under other dtype arguments: see
    ``EigenvalueCorrectionConfig.eigenvectors_dtype`` and
    ``corrected_eigenvalues_dtype``, eq. 17a).

    ``update_dtype`` (Meta's ``DDPDistributedConfig.communication_dtype``)
    is a rule too: when set to c, each step's update ``Delta = -lr U``
    (eq. 21) is rounded to c entry by entry before it is added,
    ``W <- W + round_c(Delta)`` (eq. 21a), as Meta's DDP distributor
    rounds every block's update into its all-gather buffer, on every rank
    and at any world size. None (the default) adds the update unrounded.

    ``factor_storage_dtype`` (Meta's ``factor_matrix_dtype`` bfloat16 or
    float16) is a rule too: when set to s, the factors are stored in s and
    every operation Meta makes on them in s is rounded to s (eq. 11b: the
    decay, the sum with ``w G G^T``, the bias correction, the ridge, the
    eigenvalues and eigenvectors of the root, their shift and power, and the
    root's product ``Q diag(x) Q^T``); the eigendecomposition itself and the
    outer product ``G G^T`` stay in the working precision (``factor_dtype``
    in the backends, float64 in the reference), as Meta's float64 retry and
    gradient-dtype ``tensordot``. None (the default): the factors in
    ``factor_dtype``, today's numerics bit for bit. Only with what Meta's
    root offers in s: ``root_inverse`` eigh without ``failure_threshold``,
    ``epsilon`` absolute with placement ``ridge`` or ``shift_after``, no
    trace scaling, statistics starting at zero, no eigenvalue correction;
    with s = float16 ``epsilon.value`` >= 2^-24.
    """

    learning_rate: float = 1e-2
    statistics: StatisticsConfig = field(default_factory=StatisticsConfig)
    epsilon: EpsilonConfig = field(default_factory=EpsilonConfig)
    root_inverse: RootInverseConfig = field(default_factory=EighConfig)
    low_rank: LowRankRootConfig | None = None
    frequent_directions: FrequentDirectionsConfig | None = None
    exponents: ExponentConfig = field(default_factory=ExponentConfig)
    eigenvalue_correction: EigenvalueCorrectionConfig | None = None
    diagonal: DiagonalPreconditionerConfig | None = None
    spectral: SpectralDescentConfig | None = None
    grafting: GraftingConfig = field(default_factory=GraftingConfig)
    gradient_filter: GradientFilterConfig = field(default_factory=GradientFilterConfig)
    momentum: MomentumConfig = field(default_factory=MomentumConfig)
    averaging: IterateAveragingConfig | None = None
    weight_decay: WeightDecayConfig = field(default_factory=WeightDecayConfig)
    blocking: BlockingConfig = field(default_factory=BlockingConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)
    factor_dtype: Literal["float32", "float64"] = "float32"
    inverse_root_dtype: InverseRootDtype | None = None
    update_dtype: UpdateDtype | None = None
    factor_storage_dtype: FactorStorageDtype | None = None

    def __post_init__(self) -> None:
        o = "ShampooConfig"
        v.real(o, "learning_rate", self.learning_rate, low=0.0)
        v.instance(o, "statistics", self.statistics, (StatisticsConfig,))
        v.instance(o, "epsilon", self.epsilon, (EpsilonConfig,))
        v.instance(o, "root_inverse", self.root_inverse,
                   (EighConfig, CoupledNewtonConfig, HigherOrderNewtonConfig))
        if self.low_rank is not None:
            v.instance(o, "low_rank", self.low_rank, (LowRankRootConfig,))
        if self.frequent_directions is not None:
            v.instance(o, "frequent_directions", self.frequent_directions,
                       (FrequentDirectionsConfig,))
        v.instance(o, "exponents", self.exponents, (ExponentConfig,))
        if self.eigenvalue_correction is not None:
            v.instance(
                o, "eigenvalue_correction", self.eigenvalue_correction,
                (EigenvalueCorrectionConfig,),
            )
        if self.diagonal is not None:
            v.instance(o, "diagonal", self.diagonal, (DiagonalPreconditionerConfig,))
        if self.spectral is not None:
            v.instance(o, "spectral", self.spectral, (SpectralDescentConfig,))
        v.instance(o, "grafting", self.grafting, (GraftingConfig,))
        v.instance(o, "gradient_filter", self.gradient_filter, (GradientFilterConfig,))
        v.instance(o, "momentum", self.momentum, (MomentumConfig,))
        if self.averaging is not None:
            v.instance(o, "averaging", self.averaging, (IterateAveragingConfig,))
            self._check_averaging()
        v.instance(o, "weight_decay", self.weight_decay, (WeightDecayConfig,))
        v.instance(o, "blocking", self.blocking, (BlockingConfig,))
        v.instance(o, "schedule", self.schedule, (ScheduleConfig,))
        v.instance(o, "failure", self.failure, (FailureConfig,))
        v.choice(o, "factor_dtype", self.factor_dtype, ("float32", "float64"))
        if self.inverse_root_dtype is not None:
            v.choice(o, "inverse_root_dtype", self.inverse_root_dtype, INVERSE_ROOT_DTYPES,
                     none_means="the roots stay in factor_dtype")
        if self.update_dtype is not None:
            v.choice(o, "update_dtype", self.update_dtype, UPDATE_DTYPES,
                     none_means="the update is added unrounded")
        if self.factor_storage_dtype is not None:
            v.choice(o, "factor_storage_dtype", self.factor_storage_dtype, FACTOR_STORAGE_DTYPES,
                     none_means="the factors stay in factor_dtype")
            self._check_factor_storage()
        # Cross-field rules.
        if self.statistics.quantized and not isinstance(self.root_inverse, CoupledNewtonConfig):
            # Eq. (20c)'s read-back factors are not symmetric; Google runs its
            # coupled Newton iteration on them as they are (eq. 11), the only
            # root its quantized path has been checked with.
            v.fail("root_inverse", "method", self.root_inverse.method,
                   "'coupled_newton' with statistics.storage='int16_columnwise_diagonal' "
                   "(eq. 20c)")
        if (self.statistics.quantized and isinstance(self.root_inverse, CoupledNewtonConfig)
                and self.root_inverse.deflation_rank > 0):
            # Eq. (11d)'s LOBPCG assumes a symmetric factor; eq. (20c)'s are not.
            v.fail("root_inverse", "deflation_rank", self.root_inverse.deflation_rank,
                   "0 with statistics.storage='int16_columnwise_diagonal' (eq. 20c's "
                   "read-back factors are not symmetric; eq. 11d's LOBPCG needs them to be)")
        if self.statistics.quantized and self.inverse_root_dtype is not None:
            v.fail(o, "inverse_root_dtype", self.inverse_root_dtype,
                   "None with statistics.storage='int16_columnwise_diagonal' (the roots are "
                   "stored as int16 there, eq. 20c)")
        if self.eigenvalue_correction is not None and not isinstance(
            self.root_inverse, EighConfig
        ):
            v.fail(
                "root_inverse", "method", self.root_inverse.method,
                "'eigh' with eigenvalue_correction (it needs the eigenbasis)",
            )
        if self.eigenvalue_correction is not None and self.inverse_root_dtype is not None:
            # Eq. (17) stores eigenbases Q_k, not inverse roots: Meta's
            # EigenvalueCorrectedShampooPreconditionerConfig has no
            # inv_factor_matrix_dtype (its Q_k and D have dtypes of their own).
            v.fail(
                o, "inverse_root_dtype", self.inverse_root_dtype,
                "None with eigenvalue_correction (eq. 17 keeps eigenbases, not inverse roots)",
            )
        if (self.eigenvalue_correction is not None
                and self.schedule.roots_take_effect == "next_step"):
            # Eq. (17) updates its corrected moment in the basis refreshed this
            # step; a lagged basis would need a rule of its own, and neither
            # anchor has one (Google's lag has no eigenvalue correction).
            v.fail(
                "schedule", "roots_take_effect", "next_step",
                "'same_step' with eigenvalue_correction (eq. 17 uses this step's eigenbasis)",
            )
        if self.epsilon.pseudo_inverse and (
            not isinstance(self.root_inverse, EighConfig)
            or self.eigenvalue_correction is not None
        ):
            # Eqs. (11), (11c) need a positive definite A + eps I; eq. (17) keeps
            # eigenbases and regularizes with its own epsilon (Meta refuses both too).
            v.fail(
                "epsilon", "placement", "pseudo_inverse",
                "another placement with a Newton root_inverse.method or with "
                "eigenvalue_correction (the pseudo-inverse is an eigh inverse root, eq. 10)",
            )
        if self.diagonal is not None or self.spectral is not None:
            self._check_diagonal()
        if self.statistics.kl:
            self._check_kl()
        if self.low_rank is not None:
            self._check_low_rank()
        if isinstance(self.root_inverse, EighConfig) and self.root_inverse.stores_basis:
            self._check_stored_basis_root()
        if self.frequent_directions is not None:
            self._check_frequent_directions()
        if self.epsilon.cuts_rank_per_parameter:
            self._check_parameter_rank_cutoff()
        if self.weight_decay.scale_by_lr_ratio and not self.learning_rate > 0:
            v.fail(o, "learning_rate", self.learning_rate,
                   "a number > 0 with weight_decay.scale_by_lr_ratio (it divides by it)")
        ec = self.eigenvalue_correction
        if (ec is not None and ec.eigenbasis_method == "qr" and isinstance(
                self.root_inverse, EighConfig) and self.root_inverse.failure_threshold is not None):
            # Eq. (10b) judges an eigendecomposition's error; eq. (17c) makes none.
            v.fail("root_inverse", "failure_threshold", self.root_inverse.failure_threshold,
                   "None with eigenvalue_correction.eigenbasis_method='qr' (no "
                   "eigendecomposition to judge, eq. 17c)")
        if isinstance(self.root_inverse, CoupledNewtonConfig):
            # The coupled Newton iteration raises a matrix to the integer power r.
            if not float(self.exponents.override).is_integer():
                v.fail(
                    "exponents", "override", self.exponents.override,
                    "an integer root with root_inverse.method='coupled_newton'",
                )
            for item in self.exponents.overrides_by_order:
                if not all(float(r).is_integer() for r in item.roots):
                    v.fail(
                        "exponents.overrides_by_order[]", "roots", item.roots,
                        "integer roots with root_inverse.method='coupled_newton'",
                    )

    def _check_kl(self) -> None:
        """Eq. (6b) is specified for roots kept unrounded in the factor dtype."""
        self._require_plain_roots(
            "with statistics.kl (eq. 6b preconditions the statistics by the roots)")

    def _check_low_rank(self) -> None:
        """Eq. (10c) compresses an eigh inverse root of the factors, kept in ``factor_dtype``
        (Google turns its int16 storage off with it too)."""
        self._require_plain_roots("with low_rank (eq. 10c compresses eq. 10's inverse roots)")

    def _check_stored_basis_root(self) -> None:
        """Eqs. (10f), (10h) are specified for eq. (10)'s inverse roots with Meta's epsilon
        rules, stored unrounded in ``factor_dtype`` (the basis beside them)."""
        r = self.root_inverse
        assert isinstance(r, EighConfig)
        why = ("with root_inverse.eigenbasis_method='qr' (eq. 10f)" if r.qr else
               f"with root_inverse.basis_reuse_tolerance={r.basis_reuse_tolerance!r} (eq. 10h)")
        if self.eigenvalue_correction is not None:
            v.fail("ShampooConfig", "eigenvalue_correction", "set",
                   f"None {why}; eigenvalue correction's QR eigenbasis is "
                   "eigenvalue_correction.eigenbasis_method='qr' (eq. 17c)")
        self._require_plain_roots(why)
        for name in ("low_rank", "frequent_directions"):
            if getattr(self, name) is not None:
                v.fail("ShampooConfig", name, getattr(self, name), f"None {why}")
        if self.epsilon.placement not in ("ridge", "shift_after", "pseudo_inverse"):
            v.fail("epsilon", "placement", self.epsilon.placement,
                   f"'ridge', 'shift_after' or 'pseudo_inverse' {why}: Meta's rules")

    def _check_parameter_rank_cutoff(self) -> None:
        """Eq. (10g) is specified for eq. (10)'s eigh roots of whole factors, kept
        unrounded in ``factor_dtype`` (tearfree's only roots). With ``diagonal`` or
        ``spectral`` no root is taken and the epsilon section has no effect."""
        why = "with epsilon.rank_cutoff_scope='parameter' (eq. 10g)"
        for name in ("inverse_root_dtype", "factor_storage_dtype"):
            if getattr(self, name) is not None:
                v.fail("ShampooConfig", name, getattr(self, name), f"None {why}")
        if self.statistics.quantized:
            v.fail("statistics", "storage", self.statistics.storage, f"'float' {why}")
        if self.low_rank is not None:
            v.fail("ShampooConfig", "low_rank", self.low_rank, f"None {why}")
        if isinstance(self.root_inverse, EighConfig) and self.root_inverse.qr:
            v.fail("root_inverse", "eigenbasis_method", self.root_inverse.eigenbasis_method,
                   f"'eigh' {why}")
        if isinstance(self.root_inverse, EighConfig) and self.root_inverse.reuses_basis:
            v.fail("root_inverse", "basis_reuse_tolerance",
                   self.root_inverse.basis_reuse_tolerance, f"0.0 {why}")

    def _check_frequent_directions(self) -> None:
        """Eqs. (6c), (10d): the sketch replaces the large factors' statistics and roots.

        The sketch is updated where the roots are (statistics and root steps
        coincide, as Google requires), from plain statistics: no eq. 6b, 7 or
        7b on a sketched factor, and no other compression of its root.
        """
        why = "with frequent_directions (eqs. 6c and 10d sketch the large factors)"
        self._require_plain_roots(why)
        if self.low_rank is not None:
            v.fail("ShampooConfig", "low_rank", self.low_rank, f"None {why}")
        st = self.statistics
        if st.kl:
            v.fail("statistics", "kl", st.kl, f"False {why}")
        if st.bias_correction:
            v.fail("statistics", "bias_correction", st.bias_correction, f"False {why}")
        if st.trace_scaling_exponent != 0:
            v.fail("statistics", "trace_scaling_exponent", st.trace_scaling_exponent,
                   f"0 {why}")
        sc = self.schedule
        if sc.statistics_frequency != sc.precondition_frequency:
            v.fail("schedule", "statistics_frequency", sc.statistics_frequency,
                   f"precondition_frequency = {sc.precondition_frequency} {why} "
                   "(the sketch takes each observation at a root step)")
        if sc.precondition_frequency_growth is not None:
            v.fail("schedule", "precondition_frequency_growth",
                   sc.precondition_frequency_growth, f"None {why}")
        if self.epsilon.placement == "pseudo_inverse":
            v.fail("epsilon", "placement", "pseudo_inverse",
                   f"another placement {why} (the sketch adds eps to its values)")

    def _require_plain_roots(self, why: str) -> None:
        """Kronecker inverse roots (no eq. 16b/16c/17 in their place), stored unrounded in
        ``factor_dtype`` (no eq. 11a, 11b or 20c); else ValueError ending in ``why``."""
        for name in ("inverse_root_dtype", "factor_storage_dtype", "diagonal", "spectral",
                     "eigenvalue_correction"):
            if getattr(self, name) is not None:
                v.fail("ShampooConfig", name, getattr(self, name), f"None {why}")
        if self.statistics.quantized:
            v.fail("statistics", "storage", self.statistics.storage, f"'float' {why}")

    def _check_averaging(self) -> None:
        """Eq. (20d) takes the place of momentum and of the update's own decay."""
        why = "with averaging (eq. 20d replaces eqs. 20-21's momentum and update)"
        if self.momentum.enabled:
            v.fail("momentum", "momentum", self.momentum.momentum, f"0 {why}")
        if self.momentum.storage != "float":
            v.fail("momentum", "storage", self.momentum.storage, f"'float' {why}")
        if self.weight_decay.applies("update"):
            v.fail("weight_decay", "type", "update",
                   f"'l2' or 'direction' {why}: direction decay shrinks Z there")

    def _check_diagonal(self) -> None:
        """Eqs. (16b), (16c) replace the Kronecker factors: their storage rules may not be set.

        ``statistics``, ``epsilon``, ``root_inverse``, ``exponents``,
        ``factor_dtype`` and the root schedule then have no effect (a section
        always holds some value); eigenvalue correction (another direction) and
        the rules that store factors or roots rounded (which do not exist) are
        refused.
        """
        why = ("with diagonal (eq. 16b keeps no Kronecker factors or roots)"
               if self.spectral is None else
               "with spectral (eq. 16c keeps no Kronecker factors or roots)")
        b = self.blocking
        if self.spectral is not None and b.merge_dims_up_to is not None and (
                b.merge_target_rank != 2):
            # Merging down to fewer dims would leave vectors, which eq. (16c) cannot
            # orthogonalize (Meta sets target_parameter_dimensionality to 2).
            v.fail("blocking", "merge_target_rank", b.merge_target_rank,
                   "2 with spectral (eq. 16c orthogonalizes matrices), or "
                   "merge_dims_up_to=None")
        if self.diagonal is not None and self.spectral is not None:
            v.fail("ShampooConfig", "spectral", "set",
                   "None with diagonal (one preconditioner replaces the Kronecker one)")
        if self.eigenvalue_correction is not None:
            v.fail("ShampooConfig", "eigenvalue_correction", "set", f"None {why}")
        for name in ("inverse_root_dtype", "factor_storage_dtype"):
            if getattr(self, name) is not None:
                v.fail("ShampooConfig", name, getattr(self, name), f"None {why}")
        if self.statistics.quantized:
            v.fail("statistics", "storage", self.statistics.storage, f"'float' {why}")

    def _check_factor_storage(self) -> None:
        """Eq. (6a): the rest of the config must be what Meta's root computes in s."""
        s = self.factor_storage_dtype
        why = f"with factor_storage_dtype={s!r} (eq. 11b specifies Meta's eigh root in s only)"
        method = self.root_inverse
        if not isinstance(method, EighConfig):
            v.fail("root_inverse", "method", method.method, f"'eigh' {why}")
        elif method.failure_threshold is not None:
            v.fail("root_inverse", "failure_threshold", method.failure_threshold, f"None {why}")
        eps = self.epsilon
        if eps.scale != "absolute":
            v.fail("epsilon", "scale", eps.scale, f"'absolute' {why}")
        if eps.placement not in ("ridge", "shift_after"):
            v.fail("epsilon", "placement", eps.placement, f"'ridge' or 'shift_after' {why}")
        if self.statistics.trace_scaling_exponent != 0:
            v.fail("statistics", "trace_scaling_exponent",
                   self.statistics.trace_scaling_exponent, f"0 {why}")
        if self.statistics.initial_value != "zero":
            v.fail("statistics", "initial_value", self.statistics.initial_value,
                   f"'zero' {why}")
        if self.eigenvalue_correction is not None:
            v.fail("ShampooConfig", "factor_storage_dtype", s,
                   "None with eigenvalue_correction (eq. 11b specifies the inverse root only)")
        if s in _SMALLEST_POSITIVE and eps.value < _SMALLEST_POSITIVE[s][0]:
            # Eq. (6a): the shifted smallest eigenvalue becomes round_s(eps), 0 in
            # float16 below 2^-25: an infinite root (Meta raises on it).
            v.fail("epsilon", "value", eps.value,
                   f">= {_SMALLEST_POSITIVE[s][1]} with factor_storage_dtype={s!r} (a smaller "
                   "epsilon rounds to 0 in float16: an infinite root, eq. 11b)")

    @property
    def root_inverse_qr(self) -> bool:
        """Whether the inverse roots are eq. (10f)'s QR roots (a stored eigenbasis per
        factor beside each root)."""
        return isinstance(self.root_inverse, EighConfig) and self.root_inverse.qr

    @property
    def root_inverse_stores_basis(self) -> bool:
        """Whether each factor keeps an eigenbasis beside its root: eq. (10f)'s QR roots
        or eq. (10h)'s reused eigh bases."""
        return isinstance(self.root_inverse, EighConfig) and self.root_inverse.stores_basis

    @property
    def stores_factors_rounded(self) -> bool:
        """Whether eq. (11b) stores the factors, and computes their roots, in
        ``factor_storage_dtype``."""
        return self.factor_storage_dtype is not None

    @property
    def root_dtype(self) -> str:
        """The inverse roots' storage dtype: ``inverse_root_dtype`` (eq. 11a), or with
        eigenvalue correction the eigenbases' ``eigenvectors_dtype`` (eq. 17a); else
        ``factor_dtype``."""
        ec = self.eigenvalue_correction
        stored = self.inverse_root_dtype if ec is None else ec.eigenvectors_dtype
        return self.factor_dtype if stored is None else stored

    @property
    def corrected_dtype(self) -> str:
        """D's storage dtype (eq. 17a): ``eigenvalue_correction.corrected_eigenvalues_dtype``,
        else ``factor_dtype``."""
        ec = self.eigenvalue_correction
        stored = None if ec is None else ec.corrected_eigenvalues_dtype
        return self.factor_dtype if stored is None else stored

    @property
    def rounds_inverse_roots(self) -> bool:
        """Whether eqs. (11a) and (16) round roots and products to ``inverse_root_dtype``."""
        return self.inverse_root_dtype is not None

    @property
    def initial_factor_scale(self) -> float:
        """``c`` of the initial factor ``L_k = c I`` (eq. 6): the epsilon or zero."""
        if self.statistics.initial_value == "epsilon_identity":
            return self.epsilon.value
        return 0.0

    # JSON round trip -------------------------------------------------------
    def to_dict(self) -> dict[str, object]:
        from .serialization import config_to_dict

        return config_to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ShampooConfig:
        from .serialization import config_from_dict

        return config_from_dict(data)
