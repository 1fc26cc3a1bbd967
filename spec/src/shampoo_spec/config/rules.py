"""The rules that tie the sections of a :class:`ShampooConfig` together.

Each section checks its own fields (:mod:`.allowed`) and the rules among them;
these are the rules where one section's value constrains another's.
``ShampooConfig.__post_init__`` calls :func:`check_rules` once every field is
valid. The rules run in a fixed order, so a config that breaks several is
told of the same one each time: iterate averaging and the rounded factor
storage first, then the rest as listed in :func:`check_rules`.
"""

from __future__ import annotations

from typing import Protocol

from .. import _validate as v
from .execution import BlockingConfig, ScheduleConfig
from .options import SMALLEST_POSITIVE
from .preconditioners import (
    DiagonalPreconditionerConfig,
    EigenvalueCorrectionConfig,
    SpectralDescentConfig,
)
from .roots import CoupledNewtonConfig, EighConfig, ExponentConfig, RootInverseConfig
from .sketches import FrequentDirectionsConfig, LowRankRootConfig
from .statistics import EpsilonConfig, StatisticsConfig
from .update import IterateAveragingConfig, MomentumConfig, WeightDecayConfig


class ConfigSections(Protocol):
    """The fields of a :class:`ShampooConfig` the rules read (the config calls the rules,
    so they take it by its shape rather than import it)."""

    @property
    def learning_rate(self) -> float: ...
    @property
    def statistics(self) -> StatisticsConfig: ...
    @property
    def epsilon(self) -> EpsilonConfig: ...
    @property
    def root_inverse(self) -> RootInverseConfig: ...
    @property
    def low_rank(self) -> LowRankRootConfig | None: ...
    @property
    def frequent_directions(self) -> FrequentDirectionsConfig | None: ...
    @property
    def exponents(self) -> ExponentConfig: ...
    @property
    def eigenvalue_correction(self) -> EigenvalueCorrectionConfig | None: ...
    @property
    def diagonal(self) -> DiagonalPreconditionerConfig | None: ...
    @property
    def spectral(self) -> SpectralDescentConfig | None: ...
    @property
    def momentum(self) -> MomentumConfig: ...
    @property
    def averaging(self) -> IterateAveragingConfig | None: ...
    @property
    def weight_decay(self) -> WeightDecayConfig: ...
    @property
    def blocking(self) -> BlockingConfig: ...
    @property
    def schedule(self) -> ScheduleConfig: ...
    @property
    def inverse_root_dtype(self) -> str | None: ...
    @property
    def factor_storage_dtype(self) -> str | None: ...


def check_rules(c: ConfigSections) -> None:
    """Raises ValueError naming the first field of ``c`` that another section's value
    rules out, with its value and what is allowed."""
    o = "ShampooConfig"
    if c.averaging is not None:
        _check_averaging(c)
    if c.factor_storage_dtype is not None:
        _check_factor_storage(c)
    if c.statistics.quantized and not isinstance(c.root_inverse, CoupledNewtonConfig):
        # Eq. (20c)'s read-back factors are not symmetric; Google runs its
        # coupled Newton iteration on them as they are (eq. 11), the only
        # root its quantized path has been checked with.
        v.fail("root_inverse", "method", c.root_inverse.method,
               "'coupled_newton' with statistics.storage='int16_columnwise_diagonal' "
               "(eq. 20c)")
    if (c.statistics.quantized and isinstance(c.root_inverse, CoupledNewtonConfig)
            and c.root_inverse.deflation_rank > 0):
        # Eq. (11d)'s LOBPCG assumes a symmetric factor; eq. (20c)'s are not.
        v.fail("root_inverse", "deflation_rank", c.root_inverse.deflation_rank,
               "0 with statistics.storage='int16_columnwise_diagonal' (eq. 20c's "
               "read-back factors are not symmetric; eq. 11d's LOBPCG needs them to be)")
    if c.statistics.quantized and c.inverse_root_dtype is not None:
        v.fail(o, "inverse_root_dtype", c.inverse_root_dtype,
               "None with statistics.storage='int16_columnwise_diagonal' (the roots are "
               "stored as int16 there, eq. 20c)")
    if c.eigenvalue_correction is not None and not isinstance(
        c.root_inverse, EighConfig
    ):
        v.fail(
            "root_inverse", "method", c.root_inverse.method,
            "'eigh' with eigenvalue_correction (it needs the eigenbasis)",
        )
    if c.eigenvalue_correction is not None and c.inverse_root_dtype is not None:
        # Eq. (17) stores eigenbases Q_k, not inverse roots: Meta's
        # EigenvalueCorrectedShampooPreconditionerConfig has no
        # inv_factor_matrix_dtype (its Q_k and D have dtypes of their own).
        v.fail(
            o, "inverse_root_dtype", c.inverse_root_dtype,
            "None with eigenvalue_correction (eq. 17 keeps eigenbases, not inverse roots)",
        )
    if (c.eigenvalue_correction is not None
            and c.schedule.roots_take_effect == "next_step"):
        # Eq. (17) updates its corrected moment in the basis refreshed this
        # step; a lagged basis would need a rule of its own, and neither
        # anchor has one (Google's lag has no eigenvalue correction).
        v.fail(
            "schedule", "roots_take_effect", "next_step",
            "'same_step' with eigenvalue_correction (eq. 17 uses this step's eigenbasis)",
        )
    if c.epsilon.pseudo_inverse and (
        not isinstance(c.root_inverse, EighConfig)
        or c.eigenvalue_correction is not None
    ):
        # Eqs. (11), (11c) need a positive definite A + eps I; eq. (17) keeps
        # eigenbases and regularizes with its own epsilon (Meta refuses both too).
        v.fail(
            "epsilon", "placement", "pseudo_inverse",
            "another placement with a Newton root_inverse.method or with "
            "eigenvalue_correction (the pseudo-inverse is an eigh inverse root, eq. 10)",
        )
    if c.diagonal is not None or c.spectral is not None:
        _check_diagonal(c)
    if c.statistics.kl:
        _check_kl(c)
    if c.low_rank is not None:
        _check_low_rank(c)
    if isinstance(c.root_inverse, EighConfig) and c.root_inverse.stores_basis:
        _check_stored_basis_root(c)
    if c.frequent_directions is not None:
        _check_frequent_directions(c)
    if c.epsilon.cuts_rank_per_parameter:
        _check_parameter_rank_cutoff(c)
    if c.weight_decay.scale_by_lr_ratio and not c.learning_rate > 0:
        v.fail(o, "learning_rate", c.learning_rate,
               "a number > 0 with weight_decay.scale_by_lr_ratio (it divides by it)")
    ec = c.eigenvalue_correction
    if (ec is not None and ec.eigenbasis_method == "qr" and isinstance(
            c.root_inverse, EighConfig) and c.root_inverse.failure_threshold is not None):
        # Eq. (10b) judges an eigendecomposition's error; eq. (17c) makes none.
        v.fail("root_inverse", "failure_threshold", c.root_inverse.failure_threshold,
               "None with eigenvalue_correction.eigenbasis_method='qr' (no "
               "eigendecomposition to judge, eq. 17c)")
    if isinstance(c.root_inverse, CoupledNewtonConfig):
        # The coupled Newton iteration raises a matrix to the integer power r.
        if not float(c.exponents.override).is_integer():
            v.fail(
                "exponents", "override", c.exponents.override,
                "an integer root with root_inverse.method='coupled_newton'",
            )
        for item in c.exponents.overrides_by_order:
            if not all(float(r).is_integer() for r in item.roots):
                v.fail(
                    "exponents.overrides_by_order[]", "roots", item.roots,
                    "integer roots with root_inverse.method='coupled_newton'",
                )


def _check_kl(c: ConfigSections) -> None:
    """Eq. (6b) is specified for roots kept unrounded in the factor dtype."""
    _require_plain_roots(c,
        "with statistics.kl (eq. 6b preconditions the statistics by the roots)")


def _check_low_rank(c: ConfigSections) -> None:
    """Eq. (10c) compresses an eigh inverse root of the factors, kept in ``factor_dtype``
    (Google turns its int16 storage off with it too)."""
    _require_plain_roots(c, "with low_rank (eq. 10c compresses eq. 10's inverse roots)")


def _check_stored_basis_root(c: ConfigSections) -> None:
    """Eqs. (10f), (10h) are specified for eq. (10)'s inverse roots with Meta's epsilon
    rules, stored unrounded in ``factor_dtype`` (the basis beside them)."""
    r = c.root_inverse
    assert isinstance(r, EighConfig)
    why = ("with root_inverse.eigenbasis_method='qr' (eq. 10f)" if r.qr else
           f"with root_inverse.basis_reuse_tolerance={r.basis_reuse_tolerance!r} (eq. 10h)")
    if c.eigenvalue_correction is not None:
        v.fail("ShampooConfig", "eigenvalue_correction", "set",
               f"None {why}; eigenvalue correction's QR eigenbasis is "
               "eigenvalue_correction.eigenbasis_method='qr' (eq. 17c)")
    _require_plain_roots(c, why)
    for name in ("low_rank", "frequent_directions"):
        if getattr(c, name) is not None:
            v.fail("ShampooConfig", name, getattr(c, name), f"None {why}")
    if c.epsilon.placement not in ("ridge", "shift_after", "pseudo_inverse"):
        v.fail("epsilon", "placement", c.epsilon.placement,
               f"'ridge', 'shift_after' or 'pseudo_inverse' {why}: Meta's rules")


def _check_parameter_rank_cutoff(c: ConfigSections) -> None:
    """Eq. (10g) is specified for eq. (10)'s eigh roots of whole factors, kept
    unrounded in ``factor_dtype`` (tearfree's only roots). With ``diagonal`` or
    ``spectral`` no root is taken and the epsilon section has no effect."""
    why = "with epsilon.rank_cutoff_scope='parameter' (eq. 10g)"
    for name in ("inverse_root_dtype", "factor_storage_dtype"):
        if getattr(c, name) is not None:
            v.fail("ShampooConfig", name, getattr(c, name), f"None {why}")
    if c.statistics.quantized:
        v.fail("statistics", "storage", c.statistics.storage, f"'float' {why}")
    if c.low_rank is not None:
        v.fail("ShampooConfig", "low_rank", c.low_rank, f"None {why}")
    if isinstance(c.root_inverse, EighConfig) and c.root_inverse.qr:
        v.fail("root_inverse", "eigenbasis_method", c.root_inverse.eigenbasis_method,
               f"'eigh' {why}")
    if isinstance(c.root_inverse, EighConfig) and c.root_inverse.reuses_basis:
        v.fail("root_inverse", "basis_reuse_tolerance",
               c.root_inverse.basis_reuse_tolerance, f"0.0 {why}")


def _check_frequent_directions(c: ConfigSections) -> None:
    """Eqs. (6c), (10d): the sketch replaces the large factors' statistics and roots.

    The sketch is updated where the roots are (statistics and root steps
    coincide, as Google requires), from plain statistics: no eq. 6b, 7 or
    7b on a sketched factor, and no other compression of its root.
    """
    why = "with frequent_directions (eqs. 6c and 10d sketch the large factors)"
    _require_plain_roots(c, why)
    if c.low_rank is not None:
        v.fail("ShampooConfig", "low_rank", c.low_rank, f"None {why}")
    st = c.statistics
    if st.kl:
        v.fail("statistics", "kl", st.kl, f"False {why}")
    if st.bias_correction:
        v.fail("statistics", "bias_correction", st.bias_correction, f"False {why}")
    if st.trace_scaling_exponent != 0:
        v.fail("statistics", "trace_scaling_exponent", st.trace_scaling_exponent,
               f"0 {why}")
    sc = c.schedule
    if sc.statistics_frequency != sc.precondition_frequency:
        v.fail("schedule", "statistics_frequency", sc.statistics_frequency,
               f"precondition_frequency = {sc.precondition_frequency} {why} "
               "(the sketch takes each observation at a root step)")
    if sc.precondition_frequency_growth is not None:
        v.fail("schedule", "precondition_frequency_growth",
               sc.precondition_frequency_growth, f"None {why}")
    if c.epsilon.placement == "pseudo_inverse":
        v.fail("epsilon", "placement", "pseudo_inverse",
               f"another placement {why} (the sketch adds eps to its values)")


def _require_plain_roots(c: ConfigSections, why: str) -> None:
    """Kronecker inverse roots (no eq. 16b/16c/17 in their place), stored unrounded in
    ``factor_dtype`` (no eq. 11a, 11b or 20c); else ValueError ending in ``why``."""
    for name in ("inverse_root_dtype", "factor_storage_dtype", "diagonal", "spectral",
                 "eigenvalue_correction"):
        if getattr(c, name) is not None:
            v.fail("ShampooConfig", name, getattr(c, name), f"None {why}")
    if c.statistics.quantized:
        v.fail("statistics", "storage", c.statistics.storage, f"'float' {why}")


def _check_averaging(c: ConfigSections) -> None:
    """Eq. (20d) takes the place of momentum and of the update's own decay."""
    why = "with averaging (eq. 20d replaces eqs. 20-21's momentum and update)"
    if c.momentum.enabled:
        v.fail("momentum", "momentum", c.momentum.momentum, f"0 {why}")
    if c.momentum.storage != "float":
        v.fail("momentum", "storage", c.momentum.storage, f"'float' {why}")
    if c.weight_decay.applies("update"):
        v.fail("weight_decay", "type", "update",
               f"'l2' or 'direction' {why}: direction decay shrinks Z there")


def _check_diagonal(c: ConfigSections) -> None:
    """Eqs. (16b), (16c) replace the Kronecker factors: their storage rules may not be set.

    ``statistics``, ``epsilon``, ``root_inverse``, ``exponents``,
    ``factor_dtype`` and the root schedule then have no effect (a section
    always holds some value); eigenvalue correction (another direction) and
    the rules that store factors or roots rounded (which do not exist) are
    refused.
    """
    why = ("with diagonal (eq. 16b keeps no Kronecker factors or roots)"
           if c.spectral is None else
           "with spectral (eq. 16c keeps no Kronecker factors or roots)")
    b = c.blocking
    if c.spectral is not None and b.merge_dims_up_to is not None and (
            b.merge_target_rank != 2):
        # Merging down to fewer dims would leave vectors, which eq. (16c) cannot
        # orthogonalize (Meta sets target_parameter_dimensionality to 2).
        v.fail("blocking", "merge_target_rank", b.merge_target_rank,
               "2 with spectral (eq. 16c orthogonalizes matrices), or "
               "merge_dims_up_to=None")
    if c.diagonal is not None and c.spectral is not None:
        v.fail("ShampooConfig", "spectral", "set",
               "None with diagonal (one preconditioner replaces the Kronecker one)")
    if c.eigenvalue_correction is not None:
        v.fail("ShampooConfig", "eigenvalue_correction", "set", f"None {why}")
    for name in ("inverse_root_dtype", "factor_storage_dtype"):
        if getattr(c, name) is not None:
            v.fail("ShampooConfig", name, getattr(c, name), f"None {why}")
    if c.statistics.quantized:
        v.fail("statistics", "storage", c.statistics.storage, f"'float' {why}")


def _check_factor_storage(c: ConfigSections) -> None:
    """Eq. (6a): the rest of the config must be what Meta's root computes in s."""
    s = c.factor_storage_dtype
    why = f"with factor_storage_dtype={s!r} (eq. 11b specifies Meta's eigh root in s only)"
    method = c.root_inverse
    if not isinstance(method, EighConfig):
        v.fail("root_inverse", "method", method.method, f"'eigh' {why}")
    elif method.failure_threshold is not None:
        v.fail("root_inverse", "failure_threshold", method.failure_threshold, f"None {why}")
    eps = c.epsilon
    if eps.scale != "absolute":
        v.fail("epsilon", "scale", eps.scale, f"'absolute' {why}")
    if eps.placement not in ("ridge", "shift_after"):
        v.fail("epsilon", "placement", eps.placement, f"'ridge' or 'shift_after' {why}")
    if c.statistics.trace_scaling_exponent != 0:
        v.fail("statistics", "trace_scaling_exponent",
               c.statistics.trace_scaling_exponent, f"0 {why}")
    if c.statistics.initial_value != "zero":
        v.fail("statistics", "initial_value", c.statistics.initial_value,
               f"'zero' {why}")
    if c.eigenvalue_correction is not None:
        v.fail("ShampooConfig", "factor_storage_dtype", s,
               "None with eigenvalue_correction (eq. 11b specifies the inverse root only)")
    if s in SMALLEST_POSITIVE and eps.value < SMALLEST_POSITIVE[s][0]:
        # Eq. (6a): the shifted smallest eigenvalue becomes round_s(eps), 0 in
        # float16 below 2^-25: an infinite root (Meta raises on it).
        v.fail("epsilon", "value", eps.value,
               f">= {SMALLEST_POSITIVE[s][1]} with factor_storage_dtype={s!r} (a smaller "
               "epsilon rounds to 0 in float16: an infinite root, eq. 11b)")
