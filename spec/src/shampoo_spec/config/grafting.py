"""The graft: the first-order method whose step size Shampoo borrows, eqs. (14), (18)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .. import _validate as v
from . import allowed
from .allowed import check_fields
from .float32 import to_float32
from .options import EMA_WEIGHTS, GRAFTING_TYPES, GRAFTING_TYPES_WITH_STATE, GraftingType


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

    type: GraftingType = field(default="none", metadata=allowed.choice(GRAFTING_TYPES))
    beta2: float = field(default=1.0, metadata=allowed.real(low=0.0, high=1.0, low_open=True))
    ema_weight: Literal["one_minus_beta2", "one"] = field(
        default="one_minus_beta2", metadata=allowed.choice(EMA_WEIGHTS))
    # An epsilon that divides must be > 0: a zero gradient (V = 0,
    # ||G|| = 0, P = 0) would otherwise give 0 / 0 (eqs. 14a, 14c, 14e, 18).
    epsilon: float = field(default=1e-10, metadata=allowed.epsilon(divides="adaptive"))
    bias_correction: bool = field(default=False, metadata=allowed.boolean())
    norm_scope: Literal["block", "parameter"] = field(
        default="block", metadata=allowed.choice(("block", "parameter")))
    norm_epsilon: float = field(default=1e-16, metadata=allowed.epsilon(divides="rescales"))
    normalize_epsilon: float = field(
        default=1e-16, metadata=allowed.epsilon(divides="normalizes_input"))
    clip_rms: float | None = field(
        default=None, metadata=allowed.normal(none_means="no clipping"))
    epsilon_placement: Literal["after_sqrt", "inside_sqrt"] = field(
        default="after_sqrt", metadata=allowed.choice(("after_sqrt", "inside_sqrt")))
    decay_exponent: float = field(
        default=0.8, metadata=allowed.real(low=0.0, high=1.0, low_open=True))
    factor_min_dim: int = field(default=128, metadata=allowed.integer(low=1))
    parameter_scale_floor: float | None = field(default=None, metadata=allowed.normal(
        none_means="no scaling by the parameter's rms"))

    def __post_init__(self) -> None:
        o = "grafting"
        check_fields(self, o)
        if self.type == "adagrad" or self.type == "adagrad_normalized":
            if self.beta2 != 1.0:
                v.fail(o, "beta2", self.beta2, f"1.0 for grafting type {self.type!r}")
        if self.type in ("rmsprop", "adam", "rmsprop_normalized") and self.beta2 == 1.0:
            v.fail(o, "beta2", self.beta2, f"a value in (0, 1) for grafting type {self.type!r}")
        # Only an EMA has a weight to drop (a sum already adds g^2 with weight 1).
        if self.ema_weight == "one" and self.type not in ("rmsprop", "adam", "rmsprop_normalized"):
            v.fail(o, "ema_weight", self.ema_weight,
                   f"'one_minus_beta2' for grafting type {self.type!r} ('one' needs an EMA "
                   "graft: rmsprop, adam or rmsprop_normalized)")
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
        power = to_float32(float(t) ** -self.decay_exponent)
        return to_float32(1.0 - power)

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
    def rescales(self) -> bool:
        """Whether eq. (18) rescales the direction by the graft's norm (any type but none)."""
        return self.type != "none"

    @property
    def rescale_scope(self) -> Literal["block", "parameter"] | None:
        """Where eq. (18) takes the norms: per block, per parameter, or None (no graft)."""
        return None if self.type == "none" else self.norm_scope
