"""From direction to update: the gradient filter, momentum, averaging and weight decay.

:class:`GradientFilterConfig` (eq. 15), :class:`MomentumConfig` (eqs. 20, 20b),
:class:`IterateAveragingConfig` (eq. 20d) and :class:`WeightDecayConfig`
(eqs. 2, 19, 21).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .. import _validate as v
from . import allowed
from .allowed import check_fields
from .float32 import to_float32
from .options import MAX_EVAL_LR_POWER, MOMENTUM_STORAGES, SCALE_DTYPES, MomentumStorage


@dataclass(frozen=True, kw_only=True)
class GradientFilterConfig:
    """Exponential filtering of the gradient (Meta's betas[0], beta3), eq. (15).

    Stored ``F_t = beta1 F_{t-1} + (1 - beta1) G_t``; the direction uses
    ``beta3 F_{t-1} + (1 - beta3) G_t`` (``beta3=None`` means beta1, i.e.
    F_t), divided by ``1 - beta3 * beta1^(t-1)`` when ``bias_correction``.
    ``beta1 == 0`` disables filtering.
    """

    beta1: float = field(default=0.0, metadata=allowed.real(low=0.0, high=1.0, high_open=True))
    beta3: float | None = field(
        default=None, metadata=allowed.real(low=0.0, high=1.0, high_open=True, optional=True))
    bias_correction: bool = field(default=False, metadata=allowed.boolean())

    def __post_init__(self) -> None:
        check_fields(self, "gradient_filter")

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

    momentum: float = field(
        default=0.0, metadata=allowed.real(low=0.0, high=1.0, high_open=True))
    dampening: float = field(
        default=0.0, metadata=allowed.real(low=0.0, high=1.0, high_open=True))
    nesterov: bool = field(default=False, metadata=allowed.boolean())
    buffers: Literal["shared", "separate"] = field(
        default="shared", metadata=allowed.choice(("shared", "separate")))
    learning_rate_placement: Literal["after_momentum", "before_momentum"] = field(
        default="after_momentum", metadata=allowed.choice(("after_momentum", "before_momentum")))
    storage: MomentumStorage = field(default="float", metadata=allowed.choice(MOMENTUM_STORAGES))
    scale_dtype: Literal["float32", "float64"] = field(
        default="float32", metadata=allowed.choice(SCALE_DTYPES))

    def __post_init__(self) -> None:
        o = "momentum"
        check_fields(self, o)
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

    ``scalar_dtype``: None computes the scalars of eq. (20d) (S_t, mu_x,
    mu_y, ``1 - mu_x mu_y``, ``1 - mu_x``, Z's decay factor ``1 - lr_t alpha``
    and the switches' ``1 - 1/mu_y`` and ``1 - mu_y``) in float64;
    ``"float32"`` rounds every input and every operation's result to float32
    (eq. 20e; Meta keeps them in float32 tensors whatever the parameters'
    dtype). Either way they are then applied in the parameters' dtype.
    """

    type: Literal["gpa", "schedule_free"] = field(
        default="gpa", metadata=allowed.choice(("gpa", "schedule_free")))
    train_interp: float = field(
        default=0.8, metadata=allowed.real(low=0.0, high=1.0, low_open=True))
    eval_interp: float = field(
        default=0.9, metadata=allowed.real(low=0.0, high=1.0, high_open=True))
    eval_lr_power: int = field(
        default=2, metadata=allowed.integer(low=0, high=MAX_EVAL_LR_POWER))
    scalar_dtype: Literal["float32"] | None = field(
        default=None, metadata=allowed.choice(("float32",), none_means="float64"))

    def __post_init__(self) -> None:
        o = "averaging"
        check_fields(self, o)
        # The other type's coefficient is unused: only its default, so that a config
        # says what runs (and round-trips through Meta's two classes).
        if self.type == "gpa" and self.eval_lr_power != 2:
            v.fail(o, "eval_lr_power", self.eval_lr_power, "2 (the default; unused) with "
                   "type='gpa'")
        if self.type == "schedule_free" and self.eval_interp != 0.9:
            v.fail(o, "eval_interp", self.eval_interp, "0.9 (the default; unused) with "
                   "type='schedule_free' (mu_x follows the learning rates)")

    def _r(self, x: float) -> float:
        """One operation's result in ``scalar_dtype`` (eq. 20e)."""
        return to_float32(x) if self.scalar_dtype == "float32" else x

    def lr_power(self, lr_t: float) -> float:
        """``lr_t^p`` (eq. 20d); in float32 the rate's power in float64 rounded once
        (correctly rounded, where a float32 pow need not be; exact for p <= 2)."""
        return self._r(self._r(lr_t) ** self.eval_lr_power)

    def power_sum(self, lr_power_sum: float, lr_t: float) -> float:
        """Schedule-Free's ``S_t = S_{t-1} + lr_t^p`` (eq. 20d), before mu_x is formed."""
        return self._r(lr_power_sum + self.lr_power(lr_t))

    def eval_coefficient(self, lr_t: float, lr_power_sum: float) -> float:
        """``mu_x`` of eq. (20d) at a step whose ``sum_{i<=t} lr_i^p`` is ``lr_power_sum``."""
        if self.type == "gpa":
            return self._r(self.eval_interp)
        if lr_power_sum == 0.0:
            # Every rate so far 0 (a warm-up from 0): no step is taken (d = 0); mu_x = 1
            # keeps W, as Defazio et al.'s Schedule-Free does.
            return 1.0
        return self._r(1.0 - self._r(self.lr_power(lr_t) / lr_power_sum))

    @property
    def mu_y(self) -> float:
        """``mu_y = train_interp`` (eq. 20d; rounded by eq. 20e)."""
        return self._r(self.train_interp)

    def step_coefficients(self, lr_t: float, lr_power_sum: float) -> tuple[float, float]:
        """``(1 - mu_x mu_y, 1 - mu_x)``: Delta = the first d + the second (Z - W)."""
        mu_x = self.eval_coefficient(lr_t, lr_power_sum)
        return self._r(1.0 - self._r(mu_x * self.mu_y)), self._r(1.0 - mu_x)

    def decay_factor(self, lr_t: float, alpha: float) -> float:
        """Z's direction decay ``1 - lr_t alpha`` (eqs. 19, 20d)."""
        return self._r(1.0 - self._r(self._r(lr_t) * self._r(alpha)))

    def switch_coefficient(self, to: Literal["eval", "train"]) -> float:
        """``W <- W + c (Z - W)``: ``c = 1 - 1/mu_y`` to x (eval), ``1 - mu_y`` back."""
        mu_y = self.mu_y
        return self._r(1.0 - self._r(1.0 / mu_y)) if to == "eval" else self._r(1.0 - mu_y)


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

    value: float = field(default=0.0, metadata=allowed.real(low=0.0))
    type: Literal["l2", "direction", "update"] = field(
        default="direction", metadata=allowed.choice(("l2", "direction", "update")))
    scale_by_lr_ratio: bool = field(default=False, metadata=allowed.boolean())

    def __post_init__(self) -> None:
        o = "weight_decay"
        check_fields(self, o)
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
