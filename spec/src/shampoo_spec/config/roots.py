"""How the inverse roots of the factors are computed, eqs. (10)-(13).

The three root methods (:class:`EighConfig`, eqs. 10, 10b, 10f, 10h;
:class:`CoupledNewtonConfig`, eqs. 11, 11d; :class:`HigherOrderNewtonConfig`,
eq. 11c), one of which is ``ShampooConfig.root_inverse``, and the roots r_k
they take (:class:`ExponentConfig`, eq. 12).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any, Literal

from .. import _validate as v
from . import allowed
from .allowed import check_fields
from .options import MAX_HIGHER_ORDER, MAX_NEWTON_ITERATIONS


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

    method: Literal["eigh"] = field(default="eigh", metadata=allowed.choice(("eigh",)))
    # >= 2^-126, not just > 0: tau is compared in float32 (eq. 10b), where a
    # smaller one is subnormal and XLA on CPU flushes it to 0.
    failure_threshold: float | None = field(default=None, metadata=allowed.normal(
        none_means="an eigh root fails only when non-finite"))
    eigenbasis_method: Literal["eigh", "qr"] = field(
        default="eigh", metadata=allowed.choice(("eigh", "qr")))
    qr_max_iterations: int = field(
        default=1, metadata=allowed.integer(low=0, high=MAX_NEWTON_ITERATIONS))
    qr_tolerance: float = field(default=0.0, metadata=allowed.real(low=0.0, high=1.0))
    basis_reuse_tolerance: float = field(default=0.0, metadata=allowed.real(low=0.0, high=1.0))

    def __post_init__(self) -> None:
        o = "root_inverse"
        check_fields(self, o)
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
    ``deflation_padding = "google"`` reproduces Google's LOBPCG on its
    statistics padded to the largest, N: with N > 5k a factor of n < N is
    deflated there and judged over the padded matrix, whose padding rows give
    an error of 1, so its root always fails (:meth:`fails_padded`); it needs
    ``failure_threshold`` <= 1 (else Google keeps a root of the padded matrix,
    which no backend builds). ``"own"`` (the default): each factor by itself.
    """

    method: Literal["coupled_newton"] = field(
        default="coupled_newton", metadata=allowed.choice(("coupled_newton",)))
    # Quadratic convergence: more iterations than this never help, and a
    # huge bound would only let a non-converging iteration run for ever.
    max_iterations: int = field(
        default=100, metadata=allowed.integer(low=1, high=MAX_NEWTON_ITERATIONS))
    tolerance: float = field(default=1e-6, metadata=allowed.real(low=0.0, low_open=True))
    error_growth_limit: float | None = field(
        default=None, metadata=allowed.real(low=1.0, optional=True))
    retries: int = field(default=0, metadata=allowed.integer(low=0))
    retry_epsilon_factor: float = field(
        default=10.0, metadata=allowed.real(low=1.0, low_open=True))
    retry_error_threshold: float = field(
        default=0.05, metadata=allowed.real(low=0.0, low_open=True))
    failure_threshold: float | None = field(
        default=None, metadata=allowed.real(low=0.0, low_open=True, optional=True))
    deflation_rank: int = field(default=0, metadata=allowed.integer(low=0))
    deflation_iterations: int | None = field(
        default=None, metadata=allowed.integer(low=0, high=MAX_NEWTON_ITERATIONS, optional=True))
    deflation_padding: Literal["own", "google"] = field(
        default="own", metadata=allowed.choice(("own", "google")))

    def __post_init__(self) -> None:
        o = "root_inverse"
        check_fields(self, o)
        if self.deflation_iterations is not None and self.deflation_rank == 0:
            v.fail(o, "deflation_iterations", self.deflation_iterations,
                   "None with deflation_rank=0 (no deflation to iterate for)")
        if self.deflation_padding == "google":
            if self.deflation_rank == 0:
                v.fail(o, "deflation_padding", self.deflation_padding,
                       "'own' with deflation_rank=0 (no deflation to pad)")
            if self.failure_threshold is None or self.failure_threshold > 1:
                v.fail(o, "deflation_padding", self.deflation_padding,
                       f"'own' with failure_threshold={self.failure_threshold!r} (Google's "
                       "padded error 1 fails a root only at a threshold <= 1)")

    def fails_padded(self, n: int, largest: int) -> bool:
        """Eq. (11d) with ``deflation_padding = "google"``: whether an ``n x n`` factor's
        root fails because Google deflates it padded to ``largest`` (the largest factor
        the config preconditions) and judges the padding: n < largest, largest > 5k."""
        return (self.deflation_padding == "google" and n < largest
                and self.deflates(largest))

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

    method: Literal["higher_order_newton"] = field(
        default="higher_order_newton", metadata=allowed.choice(("higher_order_newton",)))
    order: int = field(default=3, metadata=allowed.integer(low=2, high=MAX_HIGHER_ORDER))
    rel_epsilon: float = field(default=0.0, metadata=allowed.real(low=0.0))
    abs_epsilon: float = field(default=0.0, metadata=allowed.real(low=0.0))
    max_iterations: int = field(
        default=100, metadata=allowed.integer(low=1, high=MAX_NEWTON_ITERATIONS))
    tolerance: float = field(default=1e-8, metadata=allowed.real(low=0.0))

    def __post_init__(self) -> None:
        check_fields(self, "root_inverse")

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


def _check_roots(owner: str, name: str, roots: Any, override: Any) -> None:
    """``OrderOverride.roots``: a tuple of 1 or ``order`` reals >= 0."""
    if not isinstance(roots, tuple) or len(roots) not in {1, override.order}:
        v.fail(owner, name, roots, f"a tuple of 1 or {override.order} (=order) roots")
    for r in roots:
        v.real(owner, name, r, low=0.0)


@dataclass(frozen=True, kw_only=True)
class OrderOverride:
    """Roots for every block of a given order (Meta's inverse_exponent_override).

    ``roots`` has one entry (used for every dim) or ``order`` entries; a root
    of 0 means that dim is not preconditioned.
    """

    order: int = field(metadata=allowed.integer(low=1))
    roots: tuple[float, ...] = field(metadata=allowed.items(_check_roots))

    def __post_init__(self) -> None:
        check_fields(self, "exponents.overrides_by_order[]")


def _check_overrides(owner: str, name: str, overrides: Any, exponents: Any) -> None:
    """``ExponentConfig.overrides_by_order``: a tuple of OrderOverride, one per order."""
    if not isinstance(overrides, tuple):
        v.fail(owner, name, overrides, "a tuple of OrderOverride")
    for item in overrides:
        v.instance(owner, name, item, (OrderOverride,))
    orders = [item.order for item in overrides]
    if len(set(orders)) != len(orders):
        v.fail(owner, name, orders, "at most one override per order")


@dataclass(frozen=True, kw_only=True)
class ExponentConfig:
    """The inverse root r_k of each factor, eq. (12).

    Default ``r = 2 * n`` where n counts the block's dims
    (``"block_order"``, Meta: ``2 * max(order, 1)``) or the preconditioned
    dims of the whole parameter (``"preconditioned_dims"``, Google).
    ``override > 0`` sets every root (Google's exponent_override);
    ``overrides_by_order`` sets roots per block order (Meta).
    """

    default: Literal["block_order", "preconditioned_dims"] = field(
        default="block_order", metadata=allowed.choice(("block_order", "preconditioned_dims")))
    override: float = field(default=0.0, metadata=allowed.real(low=0.0))
    overrides_by_order: tuple[OrderOverride, ...] = field(
        default=(), metadata=allowed.items(_check_overrides))

    def __post_init__(self) -> None:
        o = "exponents"
        check_fields(self, o)
        if self.override > 0 and self.overrides_by_order:
            v.fail(o, "override", self.override, "0 when overrides_by_order is given")
