"""Compressed roots of the large factors, eqs. (6c), (10c)-(10e).

:class:`LowRankRootConfig` (Google's ``compression_rank``, eq. 10c) and
:class:`FrequentDirectionsConfig` (Sketchy, eqs. 6c, 10d; tearfree's, 10e):
each replaces the root of the factors above a size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from .. import _validate as v
from . import allowed
from .allowed import check_fields
from .options import FREQUENT_DIRECTIONS_PACKINGS, FREQUENT_DIRECTIONS_RULES, MACHINE_EPSILON
from .roots import EighConfig
from .statistics import EpsilonConfig


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

    rank: int = field(metadata=allowed.integer(low=1))
    keep: Literal["largest", "smallest"] = field(
        default="largest", metadata=allowed.choice(("largest", "smallest")))
    failure_threshold: float | None = field(default=None, metadata=allowed.normal(
        none_means="a low-rank root fails only when non-finite"))
    relative_floor: float | None = field(
        default=None, metadata=allowed.epsilon(optional=True))

    def __post_init__(self) -> None:
        check_fields(self, "low_rank")

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

    ``packing = "google"`` reproduces how Google stores a sketch (eq. 10d's
    last paragraph): packed at the size N of the largest factor the config
    preconditions (every parameter's, sketched or not), the values lambda in
    its last r rows, then cut to the factor's own n rows. A sketched factor
    of n < N reads back only its first ``max(r - (N - n), 0)`` values at its
    next root step, the others 0 (:meth:`kept_values`); ``"own"`` (the
    default) keeps them all. Not with ``rule = "tearfree"``.
    """

    rank: int = field(metadata=allowed.integer(low=1))
    average_gradients: bool = field(default=False, metadata=allowed.boolean())
    reset_every: int | None = field(default=None, metadata=allowed.integer(
        low=1, none_means="the sketch is never emptied"))
    relative_floor: float = field(default=1e-6, metadata=allowed.epsilon())
    rule: Literal["google", "tearfree"] = field(
        default="google", metadata=allowed.choice(FREQUENT_DIRECTIONS_RULES))
    packing: Literal["own", "google"] = field(
        default="own", metadata=allowed.choice(FREQUENT_DIRECTIONS_PACKINGS))

    def __post_init__(self) -> None:
        o = "frequent_directions"
        check_fields(self, o)
        if self.rule == "tearfree":
            why = "with rule='tearfree' (eq. 10e has no such option)"
            if self.average_gradients:
                v.fail(o, "average_gradients", self.average_gradients, f"False {why}")
            if self.reset_every is not None:
                v.fail(o, "reset_every", self.reset_every, f"None {why}")
            if self.relative_floor != 1e-6:
                v.fail(o, "relative_floor", self.relative_floor, f"1e-6 (the default) {why}")
            if self.packing != "own":
                v.fail(o, "packing", self.packing, f"'own' (the default) {why}")

    def compresses(self, n: int) -> bool:
        """Whether an ``n x n`` factor is sketched: ``n > rank + 2`` (eq. 10d, as eq. 10c),
        every factor with ``rule = "tearfree"`` (eq. 10e)."""
        return self.rule == "tearfree" or n > self.rank + 2

    def sketch_rank(self, n: int) -> int:
        """The sketch's number of directions for an ``n x n`` factor: ``rank`` (eq. 10d),
        ``min(n, rank)`` with ``rule = "tearfree"`` (eq. 10e)."""
        return min(n, self.rank) if self.rule == "tearfree" else self.rank

    def kept_values(self, n: int, largest: int) -> int:
        """How many leading values of an ``n x n`` factor's sketch its next root step reads
        back (eq. 10d), ``largest`` the largest factor the config preconditions: all r
        with ``packing = "own"`` or n >= largest; else ``max(r - (largest - n), 0)``
        (Google's packing at the largest size, cut to n rows: the values lie in the last
        r rows of ``largest``)."""
        r = self.sketch_rank(n)
        if self.packing == "own" or n >= largest:
            return r
        return max(r - (largest - n), 0)

    @staticmethod
    def zero_rtol(n: int, factor_dtype: str) -> float:
        """Eq. (10d)'s rank cutoff for an ``n x n`` factor: ``n`` times the spacing at 1
        of ``factor_dtype`` (an eigenvalue of M at most this times the largest is 0)."""
        return n * MACHINE_EPSILON[factor_dtype]

    def resets(self, t: int) -> bool:
        """Whether a root step t empties the sketch first (``(t - 1) mod reset_every = 0``)."""
        return self.reset_every is not None and (t - 1) % self.reset_every == 0
