"""The preconditioners that replace the Kronecker roots, eqs. (16b), (16c) and (17).

:class:`EigenvalueCorrectionConfig` (eq. 17: SOAP's corrected eigenvalues),
:class:`DiagonalPreconditionerConfig` (eq. 16b: an elementwise method) and
:class:`SpectralDescentConfig` (eq. 16c: orthogonalized blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .. import _validate as v
from . import allowed
from .allowed import check_fields
from .grafting import GraftingConfig
from .options import (
    DIAGONAL_TYPES,
    EMA_WEIGHTS,
    GRAFTING_TYPES_WITH_STATE,
    INVERSE_ROOT_DTYPES,
    MAX_NEWTON_ITERATIONS,
    MAX_NEWTON_SCHULZ_ITERATIONS,
    SMALLEST_POSITIVE,
    DiagonalType,
    InverseRootDtype,
)
from .statistics import MovingAverage


def _check_roots_by_order(owner: str, name: str, pairs: Any, correction: Any) -> None:
    """``roots_by_order``: sorted ``(order, root)`` pairs, an integer order >= 1 (at most one
    root per order) and a root > 0."""
    allowed = "a tuple of (order, root) pairs: an integer order >= 1, a root > 0"
    if not isinstance(pairs, tuple):
        v.fail(owner, name, pairs, allowed)
    for item in pairs:
        if not isinstance(item, tuple) or len(item) != 2:
            v.fail(owner, name, pairs, allowed)
        v.integer(owner, f"{name}[].order", item[0], low=1)
        v.real(owner, f"{name}[].root", item[1], low=0.0, low_open=True)
    orders = [item[0] for item in pairs]
    if len(set(orders)) != len(orders) or orders != sorted(orders):
        v.fail(owner, name, pairs, "at most one root per order, sorted by order")


@dataclass(frozen=True, kw_only=True)
class EigenvalueCorrectionConfig(MovingAverage):
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

    beta2: float = field(default=0.999, metadata=allowed.real(low=0.0, high=1.0))
    ema_weight: Literal["one_minus_beta2", "one"] = field(
        default="one_minus_beta2", metadata=allowed.choice(EMA_WEIGHTS))
    # > 0: a zero second moment (a zero gradient) would divide 0 by 0.
    epsilon: float = field(default=1e-12, metadata=allowed.epsilon(divides=True))
    bias_correction: bool = field(default=True, metadata=allowed.boolean())
    root: float = field(default=2.0, metadata=allowed.real(low=0.0, low_open=True))
    roots_by_order: tuple[tuple[int, float], ...] = field(
        default=(), metadata=allowed.items(_check_roots_by_order))
    eigenvectors_dtype: InverseRootDtype | None = field(default=None, metadata=allowed.choice(
        INVERSE_ROOT_DTYPES, none_means="the eigenbases stay in factor_dtype"))
    corrected_eigenvalues_dtype: InverseRootDtype | None = field(
        default=None,
        metadata=allowed.choice(INVERSE_ROOT_DTYPES, none_means="D stays in factor_dtype"))
    basis_reuse_tolerance: float = field(default=0.0, metadata=allowed.real(low=0.0, high=1.0))
    eigenbasis_method: Literal["eigh", "qr"] = field(
        default="eigh", metadata=allowed.choice(("eigh", "qr")))
    qr_max_iterations: int = field(
        default=1, metadata=allowed.integer(low=0, high=MAX_NEWTON_ITERATIONS))

    def __post_init__(self) -> None:
        o = "eigenvalue_correction"
        check_fields(self, o)
        if self.eigenbasis_method == "eigh" and self.qr_max_iterations != 1:
            v.fail(o, "qr_max_iterations", self.qr_max_iterations,
                   "1 (the default) unless eigenbasis_method is 'qr'")
        if any(item[1] == self.root for item in self.roots_by_order):
            # One spelling per config (importers, exporters and checkpoints compare them).
            v.fail(o, "roots_by_order", self.roots_by_order,
                   f"only roots that differ from root = {self.root}")
        if self.corrected_eigenvalues_dtype is not None:
            smallest = SMALLEST_POSITIVE.get(self.corrected_eigenvalues_dtype)
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

    type: DiagonalType = field(default="adagrad", metadata=allowed.choice(DIAGONAL_TYPES))
    beta2: float = field(default=1.0, metadata=allowed.real(low=0.0, high=1.0, low_open=True))
    ema_weight: Literal["one_minus_beta2", "one"] = field(
        default="one_minus_beta2", metadata=allowed.choice(EMA_WEIGHTS))
    # An epsilon that divides must be > 0: a zero gradient would give 0 / 0 (eq. 14c).
    epsilon: float = field(default=1e-10, metadata=allowed.epsilon(divides="has_state"))
    bias_correction: bool = field(default=False, metadata=allowed.boolean())

    def __post_init__(self) -> None:
        check_fields(self, "diagonal")
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


def _check_coefficients(owner: str, name: str, coefficients: Any, spectral: Any) -> None:
    """``SpectralDescentConfig.coefficients``: three finite reals (not bools)."""
    if (not isinstance(coefficients, tuple) or len(coefficients) != 3
            or not all(isinstance(c, (int, float)) and not isinstance(c, bool)
                       and v.is_finite(c) for c in coefficients)):
        v.fail(owner, name, coefficients, "a tuple of three finite numbers "
               "(a, b, c) of X <- a X + b X X^T X + c (X X^T)^2 X")


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

    method: Literal["newton_schulz", "svd"] = field(
        default="newton_schulz", metadata=allowed.choice(("newton_schulz", "svd")))
    num_iterations: int = field(
        default=5, metadata=allowed.integer(low=0, high=MAX_NEWTON_SCHULZ_ITERATIONS))
    coefficients: tuple[float, float, float] = field(
        default=MUON_COEFFICIENTS, metadata=allowed.items(_check_coefficients))
    scale_by_nuclear_norm: bool = field(default=False, metadata=allowed.boolean())

    def __post_init__(self) -> None:
        o = "spectral"
        check_fields(self, o)
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
