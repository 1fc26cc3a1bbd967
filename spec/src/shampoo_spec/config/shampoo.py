"""The whole of Shampoo: :class:`ShampooConfig`, its sections and what follows from them.

Each section validates its own fields; :mod:`.rules` checks how they constrain
one another. The properties say what the sections imply for the backends
(dtypes of roots and corrected eigenvalues, stored bases, initial factors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from . import allowed
from .allowed import check_fields
from .execution import BlockingConfig, FailureConfig, ScheduleConfig
from .grafting import GraftingConfig
from .options import (
    FACTOR_STORAGE_DTYPES,
    INVERSE_ROOT_DTYPES,
    UPDATE_DTYPES,
    FactorStorageDtype,
    InverseRootDtype,
    UpdateDtype,
)
from .preconditioners import (
    DiagonalPreconditionerConfig,
    EigenvalueCorrectionConfig,
    SpectralDescentConfig,
)
from .roots import (
    CoupledNewtonConfig,
    EighConfig,
    ExponentConfig,
    HigherOrderNewtonConfig,
    RootInverseConfig,
)
from .rules import check_rules
from .serialization import config_kwargs_from_dict, config_to_dict
from .sketches import FrequentDirectionsConfig, LowRankRootConfig
from .statistics import EpsilonConfig, StatisticsConfig
from .update import (
    GradientFilterConfig,
    IterateAveragingConfig,
    MomentumConfig,
    WeightDecayConfig,
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

    learning_rate: float = field(default=1e-2, metadata=allowed.real(low=0.0))
    statistics: StatisticsConfig = field(
        default_factory=StatisticsConfig, metadata=allowed.instance(StatisticsConfig))
    epsilon: EpsilonConfig = field(
        default_factory=EpsilonConfig, metadata=allowed.instance(EpsilonConfig))
    root_inverse: RootInverseConfig = field(default_factory=EighConfig, metadata=allowed.instance(
        EighConfig, CoupledNewtonConfig, HigherOrderNewtonConfig))
    low_rank: LowRankRootConfig | None = field(
        default=None, metadata=allowed.instance(LowRankRootConfig, optional=True))
    frequent_directions: FrequentDirectionsConfig | None = field(
        default=None, metadata=allowed.instance(FrequentDirectionsConfig, optional=True))
    exponents: ExponentConfig = field(
        default_factory=ExponentConfig, metadata=allowed.instance(ExponentConfig))
    eigenvalue_correction: EigenvalueCorrectionConfig | None = field(
        default=None, metadata=allowed.instance(EigenvalueCorrectionConfig, optional=True))
    diagonal: DiagonalPreconditionerConfig | None = field(
        default=None, metadata=allowed.instance(DiagonalPreconditionerConfig, optional=True))
    spectral: SpectralDescentConfig | None = field(
        default=None, metadata=allowed.instance(SpectralDescentConfig, optional=True))
    grafting: GraftingConfig = field(
        default_factory=GraftingConfig, metadata=allowed.instance(GraftingConfig))
    gradient_filter: GradientFilterConfig = field(
        default_factory=GradientFilterConfig, metadata=allowed.instance(GradientFilterConfig))
    momentum: MomentumConfig = field(
        default_factory=MomentumConfig, metadata=allowed.instance(MomentumConfig))
    averaging: IterateAveragingConfig | None = field(
        default=None, metadata=allowed.instance(IterateAveragingConfig, optional=True))
    weight_decay: WeightDecayConfig = field(
        default_factory=WeightDecayConfig, metadata=allowed.instance(WeightDecayConfig))
    blocking: BlockingConfig = field(
        default_factory=BlockingConfig, metadata=allowed.instance(BlockingConfig))
    schedule: ScheduleConfig = field(
        default_factory=ScheduleConfig, metadata=allowed.instance(ScheduleConfig))
    failure: FailureConfig = field(
        default_factory=FailureConfig, metadata=allowed.instance(FailureConfig))
    factor_dtype: Literal["float32", "float64"] = field(
        default="float32", metadata=allowed.choice(("float32", "float64")))
    inverse_root_dtype: InverseRootDtype | None = field(default=None, metadata=allowed.choice(
        INVERSE_ROOT_DTYPES, none_means="the roots stay in factor_dtype"))
    update_dtype: UpdateDtype | None = field(default=None, metadata=allowed.choice(
        UPDATE_DTYPES, none_means="the update is added unrounded"))
    factor_storage_dtype: FactorStorageDtype | None = field(default=None, metadata=allowed.choice(
        FACTOR_STORAGE_DTYPES, none_means="the factors stay in factor_dtype"))

    def __post_init__(self) -> None:
        check_fields(self, "ShampooConfig")
        check_rules(self)

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
        """Nested plain dict of every field (JSON-serialisable): :func:`config_to_dict`."""
        return config_to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ShampooConfig:
        """Inverse of :meth:`to_dict`; missing keys take our defaults."""
        return cls(**config_kwargs_from_dict(data, cls))


def config_from_dict(data: dict[str, Any]) -> ShampooConfig:
    """Inverse of :func:`config_to_dict`; missing keys take our defaults."""
    return ShampooConfig.from_dict(data)
