"""The exact float64 Shampoo step, in the order of docs/spec.md.

:class:`ReferenceShampoo` holds the state of a dict of named parameters and
applies eqs. (1)-(21) one step at a time. It favours clarity over speed:
one block at a time, plain NumPy, no batching. It is the oracle the fast
backends are tested against, so every rule is spelled out here once.

Failures leave the state whole (eqs. 3, 13): a refused block (non-finite
gradient, or one that could overflow float32 state,
:func:`shampoo_spec.block_overflows`) raises before anything changes, or is
skipped; a root failure beyond ``failure.max_consecutive_root_failures``
raises only after the step has completed for every parameter. Arguments are
checked (a ShampooConfig, real arrays) with ``ValueError``; a block dim above
``shampoo_spec.LARGE_BLOCK_DIM`` warns at construction, naming the parameter.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from shampoo_spec import (
    BlockPlan,
    CoupledNewtonConfig,
    EighConfig,
    EpsilonConfig,
    HigherOrderNewtonConfig,
    NonFiniteGradientError,
    ParameterPlan,
    RootFailureError,
    ShampooConfig,
    block_overflows,
    factor_limit,
    is_root_step,
    is_statistics_step,
    large_block_warnings,
    learning_rate_ratio,
    plan_parameter,
    uses_preconditioner,
)

from . import grafting
from .linalg import (
    Sketch,
    basis_still_fits,
    effective_epsilon,
    eigenbasis,
    eigenbasis_with_error,
    eigh_fails,
    factor_contraction,
    frequent_directions_root,
    mode_product,
    orthogonalize,
    qr_eigenbasis,
    root_inverse_coupled_newton,
    root_inverse_deflated_newton,
    root_inverse_eigh,
    root_inverse_eigh_stored,
    root_inverse_eigh_with_error,
    root_inverse_higher_order,
    root_inverse_qr,
    root_inverse_reusing_basis,
    round_to,
    symmetrize,
    tearfree_sketch_root,
)
from .quantization import (
    dequantize_columnwise,
    dequantize_with_diagonal,
    quantize_columnwise,
    quantize_with_diagonal,
)

Array = NDArray[np.float64]


@dataclass
class BlockState:
    """Per-block state: factors L_k, inverse roots X_k (or eigenbases Q_k)."""

    factors: list[Array | None]
    inverse_roots: list[Array | None]
    statistics_updates: int = 0
    consecutive_failures: int = 0
    corrected_second_moment: Array | None = None
    corrected_updates: int = 0
    #: Eq. (10d): the sketch of each sketched factor (None for the others).
    sketches: list[Sketch | None] = field(default_factory=list)
    #: Eqs. (10f), (10h): the eigenbasis each factor's root starts from (I before the
    #: first root step; None for the others and without a stored-basis root_inverse).
    eigenbases: list[Array | None] = field(default_factory=list)
    #: Eq. (20c), int16 storage: the stored (integers, scales, diagonal) of each factor
    #: ("factor", k) and inverse root ("root", k); ``factors``/``inverse_roots`` then
    #: hold their read-back values.
    stored: dict[tuple[str, int], tuple[NDArray[np.int16], NDArray[np.floating],
                                        NDArray[np.floating]]] = field(default_factory=dict)


@dataclass
class ParameterState:
    plan: ParameterPlan
    blocks: list[BlockState]
    #: Eq. (14b)'s elementwise V (merged shape), or eq. (14e)'s moments.
    graft: Array | grafting.FactoredMoments | None
    filtered: Array | None
    momentum: Array | None
    graft_momentum: Array | None
    #: Eq. (20b), int8 storage: the stored (integers, scales) of each buffer by name;
    #: ``momentum``/``graft_momentum`` then hold their read-back values fl_d(q s).
    stored: dict[str, tuple[NDArray[np.integer], NDArray[np.floating]]] = field(
        default_factory=dict
    )
    #: Eq. (16b): the diagonal preconditioner's state V_D (adagrad, rmsprop, adam).
    diagonal: Array | None = None
    #: Eq. (20d): the base sequence Z of iterate averaging (merged shape), from W.
    averaged: Array | None = None
    #: Eq. (6c), average_gradients: the gradients summed since the last statistics step.
    gradient_sum: Array | None = None


@dataclass
class Metrics:
    """Counters a user can read: root failures, skipped blocks, withheld updates (eq. 22)."""

    root_failures: int = 0
    skipped_blocks: int = 0
    withheld_updates: int = 0


def _scalar_in(x: float, dtype: str) -> float:
    """``c_s(x)`` of eq. (17a): a scalar as an operation on a tensor of ``dtype`` takes it
    (float64 as is; below float64 rounded to float32, torch's compute type there)."""
    return float(x) if dtype == "float64" else float(np.float32(x))


def _as_merged(x: Array, plan: ParameterPlan) -> Array:
    return np.asarray(x, dtype=np.float64).reshape(plan.merged_shape)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + f"... ({len(text)} characters)"


def _real_array(what: str, name: object, value: object) -> Array:
    """A float64 copy of ``value``: a real (bool, integer or float) array-like, else ValueError."""
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as err:  # ragged nesting, unconvertible objects
        raise ValueError(f"{what} {name!r} is invalid ({err}): allowed a real array.") from None
    if array.dtype.kind not in "biuf":
        raise ValueError(
            f"{what} {name!r} has dtype {array.dtype}: allowed a real (bool, integer or "
            "float) array."
        )
    return np.array(array, dtype=np.float64, copy=True)


def _max_abs(x: Array) -> float:
    return float(np.max(np.abs(x))) if x.size else 0.0


@dataclass
class _Admitted:
    """One parameter's gradient after eqs. (2)-(3), before any state changes.

    ``g``: merged, L2-decayed, zero on refused blocks; ``ok``: elementwise
    mask of the admitted blocks; ``refused``: how many blocks were refused.
    """

    g: Array
    ok: NDArray[np.bool_]
    refused: int


class ReferenceShampoo:
    """Float64 Shampoo over a dict of named NumPy parameters.

    >>> opt = ReferenceShampoo(config, {"w": w0})
    >>> params = opt.step({"w": g})      # new parameters after step 1
    """

    def __init__(self, config: ShampooConfig, params: dict[str, Array]) -> None:
        if not isinstance(config, ShampooConfig):
            raise ValueError(
                f"config = {_shown(config)} is invalid: allowed a shampoo_spec.ShampooConfig "
                "(ShampooConfig.from_dict reads a dict)."
            )
        if not isinstance(params, Mapping):
            raise ValueError(f"params = {_shown(params)} is invalid: allowed a dict name -> array.")
        self.config = config
        self.t = 0
        #: eq. (21)'s learning rate of the current step and of step 1 (eq. 8b's lr_1).
        self.learning_rate = config.learning_rate
        self.first_learning_rate: float | None = None
        self.metrics = Metrics()
        self._root_failures: list[str] = []  # eq. (13) blocks over the limit, this step
        self.params = {k: _real_array("parameter", k, v) for k, v in params.items()}
        for name, p in self.params.items():
            for message in large_block_warnings(str(name), plan_parameter(p.shape, config)):
                warnings.warn(message, stacklevel=2)  # eq. (5): before allocating the factors
        self.state = {k: self._init_parameter(p.shape) for k, p in self.params.items()}
        #: Eq. (20d): which sequence the parameters hold ("train": y, "eval": x), and
        #: Schedule-Free's sum of lr_i^p over the steps so far.
        self.mode = "train"
        self.lr_power_sum = 0.0
        if config.averaging is not None:
            for name, st in self.state.items():
                st.averaged = _as_merged(self.params[name], st.plan).copy()  # Z_0 = W_0

    # ----------------------------------------------------------------- init
    def _init_parameter(self, shape: tuple[int, ...]) -> ParameterState:
        cfg = self.config
        plan = plan_parameter(shape, cfg)
        init_eps = cfg.initial_factor_scale
        blocks = []
        for b in plan.blocks:
            factors: list[Array | None] = []
            inverse_roots: list[Array | None] = []
            sketches: list[Sketch | None] = []
            fd = cfg.frequent_directions
            for n, r in zip(b.shape, b.roots, strict=True):
                sketched = r != 0 and fd is not None and fd.compresses(n)
                sketches.append(Sketch.empty(n, fd.sketch_rank(n)) if sketched and fd else None)
                if r == 0:
                    factors.append(None)
                    inverse_roots.append(None)
                else:
                    factors.append(init_eps * np.eye(n))
                    # Identity before the first root (eq. 13); 0 for a compressed or
                    # sketched factor (eqs. 10c, 10d: Google's zero low-rank preconditioner).
                    lr = cfg.low_rank
                    compressed = sketched or (lr is not None and lr.compresses(n))
                    inverse_roots.append(np.zeros((n, n)) if compressed else np.eye(n))
            corrected = np.zeros(b.shape) if cfg.eigenvalue_correction is not None else None
            bs = BlockState(
                factors=factors,
                inverse_roots=inverse_roots,
                corrected_second_moment=corrected,
                sketches=sketches,
                eigenbases=[np.eye(f.shape[0])
                            if cfg.root_inverse_stores_basis and f is not None else None
                            for f in factors],
            )
            if cfg.statistics.quantized:  # eq. (20c): the initial eps I and I are stored too
                for k in range(len(factors)):
                    self._store_factor(bs, "factor", k)
                    self._store_factor(bs, "root", k)
            blocks.append(bs)
        size_shape = plan.merged_shape
        graft: Array | grafting.FactoredMoments | None = (
            np.zeros(size_shape) if cfg.grafting.has_state
            else grafting.adafactor_init(plan.shape, cfg.grafting) if cfg.grafting.factored
            else None)
        filtered = np.zeros(size_shape) if cfg.gradient_filter.enabled else None
        momentum = np.zeros(size_shape) if cfg.momentum.enabled else None
        graft_momentum = np.zeros(size_shape) if cfg.momentum.separate_buffers else None
        diagonal = (np.zeros(size_shape)
                    if cfg.diagonal is not None and cfg.diagonal.has_state else None)
        fd = cfg.frequent_directions
        gradient_sum = np.zeros(size_shape) if fd is not None and fd.average_gradients else None
        return ParameterState(plan, blocks, graft, filtered, momentum, graft_momentum,
                              diagonal=diagonal, gradient_sum=gradient_sum)

    # ----------------------------------------------------------------- step
    def step(
        self, grads: dict[str, Array], learning_rate: float | None = None
    ) -> dict[str, Array]:
        """Apply one step (eq. 1: t <- t + 1) and return copies of the parameters.

        ``learning_rate``: this step's lr_t (a schedule's value), else
        ``config.learning_rate``. It scales the update (eqs. 20-21) and, with
        ``schedule.precondition_frequency_growth``, sets the root period
        through lr_t / lr_1 (eq. 8b), lr_1 the rate of the first step.

        Every gradient is checked first (names, shapes, eq. 3): a ``ValueError``
        or :class:`NonFiniteGradientError` leaves the optimizer exactly as it
        was (t included). A :class:`RootFailureError` (eq. 13) is raised only
        after the step has completed for every parameter; the new parameters
        are then in :attr:`params`.
        """
        if not isinstance(grads, Mapping):
            raise ValueError(f"grads = {_shown(grads)} is invalid: allowed a dict name -> array.")
        if self.mode != "train":
            raise RuntimeError(
                "step() in eval mode: the parameters hold the averaged sequence x "
                "(eq. 20d); call train() before step()."
            )
        if set(grads) != set(self.params):
            raise ValueError(
                f"grads keys {sorted(grads)} do not match parameter names {sorted(self.params)}."
            )
        lr = self.config.learning_rate if learning_rate is None else learning_rate
        if not isinstance(lr, numbers.Real) or isinstance(lr, bool) or not math.isfinite(lr):
            raise ValueError(f"learning_rate = {_shown(lr)} is invalid: allowed a finite number.")
        arrays = {name: _real_array("gradient", name, g) for name, g in grads.items()}
        for name, g in arrays.items():
            if g.shape != self.params[name].shape:
                raise ValueError(
                    f"gradient of {name!r} has shape {g.shape}, parameter has "
                    f"{self.params[name].shape}."
                )
        # Eqs. (2)-(3) for every parameter before any state changes.
        admitted = {name: self._admit(name, g, self.t + 1) for name, g in arrays.items()}
        self.t += 1
        self.learning_rate = float(lr)
        if self.first_learning_rate is None:
            self.first_learning_rate = self.learning_rate
        self._root_failures = []
        av = self.config.averaging
        if av is not None and av.type == "schedule_free":
            self.lr_power_sum += self.learning_rate**av.eval_lr_power  # eq. (20d)
        for name, adm in admitted.items():
            self.metrics.skipped_blocks += adm.refused
            self.params[name] = self._step_parameter(name, self.params[name], adm)
        if self._root_failures:
            # Eq. (13): raised once the step is complete, never half-way.
            raise RootFailureError("; ".join(self._root_failures))
        return {k: v.copy() for k, v in self.params.items()}

    def _admit(self, name: str, g_orig: Array, t: int) -> _Admitted:
        """Eqs. (2)-(3) for one parameter at step t; changes nothing.

        A block is refused when its gradient (after L2 decay) holds NaN or
        inf, or when :func:`shampoo_spec.block_overflows` says its state could
        leave float32's range this step (m: the largest absolute entry of its
        factors, graft state on its slice and corrected moment, before the
        step). ``"raise"``: :class:`NonFiniteGradientError`; ``"skip_block"``:
        the block is masked out of this step.
        """
        cfg = self.config
        st = self.state[name]
        plan = st.plan
        g = _as_merged(g_orig, plan)

        # Eq. (2): L2 weight decay enters the gradient (and so the statistics).
        if cfg.weight_decay.applies("l2"):
            g = g + cfg.weight_decay.value * _as_merged(self.params[name], plan)

        # Eq. (3): a refused block never touches the state.
        ok = np.ones(plan.merged_shape, dtype=bool)
        refused = 0
        for i, (b, bs) in enumerate(zip(plan.blocks, st.blocks, strict=True)):
            gb = g[b.slices]
            if not np.all(np.isfinite(gb)):
                reason = "non-finite gradient"
            else:
                g_max, m = _max_abs(gb), self._state_max_abs(st, b.slices, bs)
                m_f = max((_max_abs(f) for f in bs.factors if f is not None), default=0.0)
                limit = factor_limit(cfg.factor_storage_dtype)
                if not block_overflows(g_max, gb.size, m, m_f, limit):
                    continue
                if block_overflows(g_max, gb.size, m):
                    reason = (
                        f"gradient too large for float32 state (max |G| = {g_max:.3g} over "
                        f"{gb.size} entries with state max {m:.3g}: m + |B| g^2 > 2^127, "
                        "shampoo_spec.block_overflows)"
                    )
                else:
                    reason = (
                        f"gradient too large for float16 factors (max |G| = {g_max:.3g} over "
                        f"{gb.size} entries with factor max {m_f:.3g}: m + |B| g^2 > 2^15, "
                        "factor_storage_dtype='float16', shampoo_spec.block_overflows)"
                    )
            if cfg.failure.nonfinite_gradient == "raise":
                raise NonFiniteGradientError(
                    f"{reason} in parameter {name!r} at step {t} (block {i} at offsets "
                    f"{b.offsets}); failure.nonfinite_gradient='raise' (no optimizer state "
                    "or parameter was changed by this step; 'skip_block' skips such blocks "
                    "instead)."
                )
            ok[b.slices] = False
            refused += 1
        if refused:
            g = np.where(ok, g, 0.0)
        return _Admitted(g, ok, refused)

    @staticmethod
    def _state_max_abs(st: ParameterState, slices: tuple[slice, ...], bs: BlockState) -> float:
        """m of eq. (3): max |entry| of the block's factors, graft state V (eq. 14e:
        the parameter's R, C, V), moment D, diagonal state V_D (0 if none)."""
        parts = [_max_abs(f) for f in bs.factors if f is not None]
        if isinstance(st.graft, grafting.FactoredMoments):
            parts.extend(_max_abs(x) for x in st.graft.arrays())
        for elementwise in (st.graft, st.diagonal):
            if isinstance(elementwise, np.ndarray):
                parts.append(_max_abs(elementwise[slices]))
        if bs.corrected_second_moment is not None:
            parts.append(_max_abs(bs.corrected_second_moment))
        return max(parts, default=0.0)

    def _step_parameter(self, name: str, w_orig: Array, adm: _Admitted) -> Array:
        """Eqs. (6)-(21) for one parameter whose gradient passed eqs. (2)-(3)."""
        cfg, t = self.config, self.t
        st = self.state[name]
        plan = st.plan
        w = _as_merged(w_orig, plan)
        g, finite = adm.g, adm.ok

        # Eq. (14b): graft state; eq. (15): gradient filter. Elementwise.
        if isinstance(st.graft, grafting.FactoredMoments):
            if finite.all():  # eq. (14e): means over the whole parameter, in its shape
                st.graft = grafting.adafactor_update(st.graft, g.reshape(plan.shape), t,
                                                     cfg.grafting)
        elif st.graft is not None:
            st.graft = np.where(finite, grafting.update_state(st.graft, g, cfg.grafting), st.graft)
        diagonal = None if cfg.diagonal is None else cfg.diagonal.as_graft()
        if st.diagonal is not None:  # eq. (16b): V_D as eq. (14b), every step
            assert diagonal is not None
            st.diagonal = np.where(finite, grafting.update_state(st.diagonal, g, diagonal),
                                   st.diagonal)
        filtered = self._filter(st, g, finite)

        # Eqs. (6)-(13): statistics and roots, block by block.
        admitted = [(b, bs) for b, bs in zip(plan.blocks, st.blocks, strict=True)
                    if finite[b.slices].all()]
        lagged = cfg.schedule.roots_take_effect == "next_step" and self._root_step()
        observed = self._statistics_gradient(st, g, finite)
        # Eq. (10g): every block's factors first, then the roots, which share a cutoff.
        per_parameter = cfg.epsilon.cuts_rank_per_parameter
        for b, bs in admitted:
            self._update_block(name, b.roots, bs, g[b.slices], observed[b.slices],
                               roots_now=not lagged and not per_parameter)
        if per_parameter and not lagged and self._root_step():
            self._refresh_parameter_roots(name, admitted)

        # Eq. (14c): the graft direction (whole parameter, elementwise); eq. (14e).
        graft_dir = self._graft_direction(st, filtered, w_orig)

        # Eqs. (16)-(18): Shampoo direction, rescaled to the graft norm.
        use_shampoo = uses_preconditioner(t, cfg.schedule)
        need_shampoo = use_shampoo or st.graft_momentum is not None
        # Eq. (16b): a diagonal preconditioner's blocks are D(F~) (eq. 14c with V_D);
        # every block root is 0, so eq. (16) passes them through unchanged.
        source = filtered if diagonal is None else grafting.direction(
            filtered, st.diagonal, t, diagonal)
        shampoo_dir = self._shampoo_direction(st, source, graft_dir) if need_shampoo else None
        if lagged:
            # Eq. (8), roots_take_effect="next_step": this step's direction used the
            # roots held before it; the roots refreshed now take effect from t + 1.
            if per_parameter:
                self._refresh_parameter_roots(name, admitted)
            else:
                for b, bs in admitted:
                    self._refresh_inverse_roots(name, b.roots, bs)

        # Eqs. (19)-(21): weight decay, momentum, update.
        buffers = (st.momentum, st.graft_momentum)
        lr = 1.0 if cfg.momentum.lr_before_momentum else self.learning_rate
        with np.errstate(over="ignore", invalid="ignore"):  # eq. (22) handles overflow
            step = self._momentum(st, shampoo_dir, graft_dir, w, use_shampoo, finite)
            new_z = None
            if cfg.averaging is not None:
                new_w, new_z = self._average(st, -(lr * step), w)
            elif cfg.update_dtype is None:
                new_w = w - lr * step
                if cfg.weight_decay.applies("update"):
                    new_w = new_w - self.learning_rate * cfg.weight_decay.value * w  # eq. (21)
            else:
                # Eq. (21a): the update Delta = -lr U, rounded to update_dtype, then added.
                delta = -(lr * step)
                if cfg.weight_decay.applies("update"):
                    delta = delta - self.learning_rate * cfg.weight_decay.value * w
                new_w = w + round_to(delta, cfg.update_dtype)
        # Eq. (22): an entry whose new value or new momentum is non-finite keeps
        # its old ones (the state before eq. 20 is finite by eq. 3).
        keep = np.isfinite(new_w)
        if new_z is not None:
            assert st.averaged is not None
            keep &= np.isfinite(new_z)
            st.averaged = np.where(finite & keep, new_z, st.averaged)
        quantized = cfg.momentum.quantizes(len(plan.shape))
        for new in (st.momentum, st.graft_momentum):
            if new is not None:
                keep &= np.isfinite(new)
                if quantized:  # eq. (20b) quantizes fl_d(M): it must be finite too
                    with np.errstate(over="ignore"):
                        keep &= np.isfinite(new.astype(cfg.momentum.scale_dtype))
        if not keep[finite].all():
            self.metrics.withheld_updates += 1
            if st.momentum is not None and buffers[0] is not None:
                st.momentum = np.where(keep, st.momentum, buffers[0])
            if st.graft_momentum is not None and buffers[1] is not None:
                st.graft_momentum = np.where(keep, st.graft_momentum, buffers[1])
        new_w = np.where(finite & keep, new_w, w)
        if quantized:
            self._store_quantized(st)
        return new_w.reshape(plan.shape)

    def _graft_direction(self, st: ParameterState, filtered: Array, w_orig: Array) -> Array:
        """Eq. (14c) (elementwise, merged shape) or eq. (14e) (in the parameter's own shape,
        with W = ``w_orig``) of the filtered gradient, returned in the merged shape."""
        graft = self.config.grafting
        if isinstance(st.graft, grafting.FactoredMoments):
            shape = st.plan.shape
            return grafting.adafactor_direction(
                filtered.reshape(shape), st.graft, w_orig, graft).reshape(filtered.shape)
        return grafting.direction(filtered, st.graft, self.t, graft)

    def _store_quantized(self, st: ParameterState) -> None:
        """Eq. (20b): each buffer stored as (q, s) in the parameter's shape, read back.

        The buffer after eqs. (20) and (22) (kept entries hold their read-back
        old values) is quantized in ``momentum.scale_dtype``; the next step
        reads ``fl_d(q s)``, which is what the buffer holds from here on.
        """
        d = self.config.momentum.scale_dtype
        shape = st.plan.shape
        if st.momentum is not None:
            st.stored["momentum"] = quantize_columnwise(st.momentum.reshape(shape), d)
            st.momentum = dequantize_columnwise(*st.stored["momentum"]).reshape(
                st.momentum.shape)
        if st.graft_momentum is not None:
            st.stored["graft_momentum"] = quantize_columnwise(
                st.graft_momentum.reshape(shape), d)
            st.graft_momentum = dequantize_columnwise(*st.stored["graft_momentum"]).reshape(
                st.graft_momentum.shape)

    # ------------------------------------------------------- eq. (15) filter
    def _filter(self, st: ParameterState, g: Array, finite: NDArray[np.bool_]) -> Array:
        """Stored ``F_t = beta1 F + (1 - beta1) G``; used ``beta3 F_{t-1} + (1 - beta3) G``."""
        f = self.config.gradient_filter
        if st.filtered is None:
            return g
        beta3 = f.direction_beta
        used = beta3 * st.filtered + (1.0 - beta3) * g
        if f.bias_correction:
            used = used / f.bias_correction_factor(self.t)
        st.filtered = np.where(finite, f.beta1 * st.filtered + (1.0 - f.beta1) * g, st.filtered)
        return used

    # --------------------------------------------------- eqs. (6)-(13) block
    def _root_step(self) -> bool:
        """Eq. (8): is this step a root step (eq. 8b: the period follows lr_t / lr_1)?"""
        assert self.first_learning_rate is not None
        ratio = learning_rate_ratio(self.learning_rate, self.first_learning_rate)
        return is_root_step(self.t, self.config.schedule, ratio)

    def _statistics_gradient(self, st: ParameterState, g: Array, finite: NDArray[np.bool_]
                             ) -> Array:
        """Eq. (6c): G^ of eqs. (6) and (6c), ``S / s`` with ``average_gradients``, else G.

        The sum S takes this step's admitted entries (0 elsewhere, eq. 3) and
        is emptied after a statistics step.
        """
        if st.gradient_sum is None:
            return g
        st.gradient_sum = st.gradient_sum + np.where(finite, g, 0.0)
        observed = st.gradient_sum / self.config.schedule.statistics_frequency
        if is_statistics_step(self.t, self.config.schedule):
            st.gradient_sum = np.zeros_like(st.gradient_sum)
        return observed

    def _update_block(
        self, name: str, roots: tuple[float, ...], bs: BlockState, gb: Array, observed: Array,
        roots_now: bool,
    ) -> None:
        """Eqs. (6), (6c) on the statistics gradient ``observed`` (G^ of eq. 6c), and
        eqs. (7), (9)-(13) and (17) on root steps when ``roots_now``."""
        cfg, t = self.config, self.t
        stats = cfg.statistics
        if is_statistics_step(t, cfg.schedule):
            w = stats.update_weight
            s = cfg.factor_storage_dtype
            for k, lk in enumerate(bs.factors):
                if lk is None:
                    continue
                if bs.sketches[k] is not None:  # eq. (6c): this step's observation only
                    bs.factors[k] = factor_contraction(observed, k)
                    continue
                if s is None:
                    decayed = stats.beta2 * lk if stats.decays else lk
                    gk = observed
                    if stats.kl:  # eq. (6b): G x_{j != k} X_j, the roots held so far
                        for j, xj in enumerate(bs.inverse_roots):
                            if j != k and xj is not None:
                                gk = mode_product(gk, xj, j)
                    bs.factors[k] = decayed + w * factor_contraction(gk, k)
                    if stats.quantized:
                        self._store_factor(bs, "factor", k)  # eq. (20c)
                    continue
                # Eq. (11b): the decay in float32 (c_s), rounded; the sum with the
                # working-precision w G G^T rounded once.
                decayed = round_to(_scalar_in(stats.beta2, s) * lk, s) if stats.decays else lk
                bs.factors[k] = round_to(decayed + w * factor_contraction(observed, k), s)
            bs.statistics_updates += 1
        if roots_now and self._root_step():
            self._refresh_inverse_roots(name, roots, bs)
        if cfg.eigenvalue_correction is not None:
            # Eq. (17): the corrected second moment sees this step's (refreshed) basis.
            self._update_corrected_moment(bs, gb)

    def _refresh_parameter_roots(self, name: str, admitted: list[tuple[BlockPlan, BlockState]]
                                 ) -> None:
        """Eq. (10g): the admitted blocks' roots, each factor's rank cutoff scaled by
        Lambda_k, the largest eigenvalue of dim k's finite factors over those blocks."""
        scales: dict[int, float] = {}
        for _, bs in admitted:
            for k, lk in enumerate(bs.factors):
                if lk is None:
                    continue
                a = self._root_input(bs, k)
                if not np.all(np.isfinite(a)):
                    continue
                try:
                    top = float(np.linalg.eigvalsh(symmetrize(a))[-1])
                except np.linalg.LinAlgError:
                    continue
                scales[k] = max(scales.get(k, -math.inf), top)
        for b, bs in admitted:
            self._refresh_inverse_roots(name, b.roots, bs, scales)

    def _root_input(self, bs: BlockState, k: int) -> Array:
        """A of eq. (10) for factor k: bias-corrected (eq. 7), eq. (7b) applied."""
        cfg = self.config
        lk = bs.factors[k]
        assert lk is not None
        bc = cfg.statistics.bias_correction_factor(bs.statistics_updates)  # eq. (7)
        s = cfg.factor_storage_dtype
        # Eq. (11b): in s the division takes bc in float32 and rounds.
        a = lk / bc if s is None else round_to(lk / _scalar_in(bc, s), s)
        tau = cfg.statistics.trace_scaling_exponent
        if tau > 0:  # eq. (7b)
            a = a * max(float(np.trace(a)), cfg.epsilon.value) ** -tau
        return a

    def _refresh_inverse_roots(self, name: str, roots: tuple[float, ...], bs: BlockState,
                               scales: dict[int, float] | None = None) -> None:
        """Eqs. (7), (9)-(13): recompute every factor's root; count block failures.

        ``scales`` (eq. 10g): Lambda_k per dim k, which scales the rank cutoff
        of factor k in place of its own lambda_max.
        A block over ``failure.max_consecutive_root_failures`` is recorded;
        :meth:`step` raises :class:`RootFailureError` once the step is complete.
        """
        cfg, t = self.config, self.t
        failed = []
        for k, lk in enumerate(bs.factors):
            if lk is None:
                continue
            a = self._root_input(bs, k)
            ec = cfg.eigenvalue_correction
            sketch = bs.sketches[k]
            new: Array | None
            if sketch is not None:
                bs.sketches[k], new = self._sketch_root(sketch, a, roots[k])
            elif ec is not None and ec.eigenbasis_method == "qr":
                new = self._qr_basis(bs.inverse_roots[k], a)  # eq. (17c)
            elif self._basis_still_fits(bs.inverse_roots[k], a):
                continue  # eq. (17b): the eigenbasis is kept (not a failure)
            elif bs.eigenbases[k] is not None:
                new, basis = self._stored_basis_root(bs.eigenbases[k], a, roots[k])
                if basis is not None and new is not None and np.all(np.isfinite(new)):
                    bs.eigenbases[k] = basis  # kept with its root (eq. 13)
            else:
                new = self._inverse_root(a, roots[k], None if scales is None else scales.get(k))
            stored = self._stored_root_dtype
            if new is not None and stored is not None:
                # Eq. (11a) (eq. 17a for eigenbases): the root is stored rounded;
                # eq. (13) judges the stored root (a float16 one can overflow
                # where X did not).
                with np.errstate(over="ignore"):
                    new = round_to(new, stored)
            if new is None or not np.all(np.isfinite(new)):
                # Eq. (13): keep the previous root, count the failure.
                self.metrics.root_failures += 1
                failed.append(k)
                continue
            bs.inverse_roots[k] = new
            if cfg.statistics.quantized:
                self._store_factor(bs, "root", k)  # eq. (20c): the accepted root
        bs.consecutive_failures = bs.consecutive_failures + 1 if failed else 0
        limit = cfg.failure.max_consecutive_root_failures
        if limit is not None and bs.consecutive_failures > limit:
            block = next(i for i, x in enumerate(self.state[name].blocks) if x is bs)
            self._root_failures.append(
                f"inverse roots of factors {failed} of block {block} of parameter {name!r} "
                f"failed on {bs.consecutive_failures} root steps in a row, the last at step {t} "
                f"(failure.max_consecutive_root_failures={limit}; the step was completed, "
                "failed roots kept their previous values)"
            )

    def _sketch_root(self, sketch: Sketch, c: Array, root: float) -> tuple[Sketch, Array]:
        """Eq. (10d) at step t: reset if due, then fold C into the sketch; its X.
        Eq. (10e) with ``frequent_directions.rule = "tearfree"``."""
        fd = self.config.frequent_directions
        assert fd is not None
        if fd.rule == "tearfree":
            e = self.config.epsilon
            return tearfree_sketch_root(
                sketch, c, root, self.config.statistics.beta2, e.value, e.scale == "relative",
                fd.zero_rtol(c.shape[0], self.config.factor_dtype))
        if fd.resets(self.t):
            sketch = Sketch.empty(*sketch.u.shape)
        e = self.config.epsilon
        eps = e.value
        if e.scale == "relative":
            eps *= max(float(sketch.lam[0]), fd.relative_floor)
        rtol = fd.zero_rtol(c.shape[0], self.config.factor_dtype)
        return frequent_directions_root(sketch, c, root, self.config.statistics.beta2, eps, rtol)

    def _store_factor(self, bs: BlockState, kind: str, k: int) -> None:
        """Eq. (20c): factor or inverse root k stored as (q, s, g) in
        ``statistics.scale_dtype``; from here on it holds its read-back value."""
        values = bs.factors if kind == "factor" else bs.inverse_roots
        x = values[k]
        if x is None:
            return
        if not np.all(np.isfinite(x.astype(self.config.statistics.scale_dtype))):
            # A non-finite factor (eq. 3 skips its block from here) is kept as it is.
            bs.stored.pop((kind, k), None)
            return
        stored = quantize_with_diagonal(x, self.config.statistics.scale_dtype)
        bs.stored[(kind, k)] = stored
        values[k] = dequantize_with_diagonal(*stored)

    def _basis_still_fits(self, basis: Array | None, a: Array) -> bool:
        """Eq. (17b): with ``basis_reuse_tolerance`` tau > 0, whether the stored eigenbasis
        still diagonalizes the finite factor ``a + eps I`` to tau (eps of eq. 9 with the
        ridge placement, else 0)."""
        ec = self.config.eigenvalue_correction
        if ec is None or ec.basis_reuse_tolerance == 0 or basis is None:
            return False
        if not np.all(np.isfinite(a)):
            return False
        eps = self.config.epsilon
        ridge = effective_epsilon(a, eps) if eps.placement == "ridge" else 0.0
        return basis_still_fits(basis, a, ridge, ec.basis_reuse_tolerance)

    def _qr_basis(self, basis: Array | None, a: Array) -> Array | None:
        """Eq. (17c): QR steps from the stored eigenbasis (identity before the first) on
        ``a + eps I`` (eps of eq. 9 with the ridge placement, else 0); None: failed."""
        ec = self.config.eigenvalue_correction
        assert ec is not None and basis is not None
        if not np.all(np.isfinite(a)):
            return None
        eps = self.config.epsilon
        ridge = effective_epsilon(a, eps) if eps.placement == "ridge" else 0.0
        return qr_eigenbasis(basis, a, ridge, ec.qr_max_iterations, ec.basis_reuse_tolerance)

    def _stored_basis_root(self, basis: Array | None, a: Array, root: float
                           ) -> tuple[Array | None, Array | None]:
        """Eq. (10f): eq. (10)'s root from eq. (17c)'s QR steps on ``a`` (plus eps I with the
        ridge) from the stored ``basis``; eq. (10h): from ``basis`` while it fits, else
        from eigh. ``(X, Q)``, ``(None, None)`` when it failed."""
        method = self.config.root_inverse
        assert isinstance(method, EighConfig) and basis is not None
        if not np.all(np.isfinite(a)):
            return None, None
        e = self.config.epsilon
        rank = self._rank_cutoff(a, e)
        if method.reuses_basis:
            try:
                result = root_inverse_reusing_basis(basis, a, root, effective_epsilon(a, e),
                                                    e.placement, method.basis_reuse_tolerance,
                                                    rank)
            except np.linalg.LinAlgError:
                return None, None
        else:
            result = root_inverse_qr(basis, a, root, effective_epsilon(a, e), e.placement,
                                     method.qr_max_iterations, method.qr_tolerance, rank)
        return (None, None) if result is None else result

    @property
    def _stored_root_dtype(self) -> str | None:
        """The dtype roots are stored rounded to: ``inverse_root_dtype`` (eq. 11a), or
        ``eigenvalue_correction.eigenvectors_dtype`` for eigenbases (eq. 17a); None: unrounded."""
        ec = self.config.eigenvalue_correction
        return self.config.inverse_root_dtype if ec is None else ec.eigenvectors_dtype

    def _inverse_root(self, a: Array, root: float, scale: float | None = None
                      ) -> Array | None:
        """Eq. (10) or (11) for one factor: ``A^(-1/root)`` (or its eigenbasis, eq. 17);
        ``scale``: eq. (10g)'s Lambda_k for the rank cutoff (None: lambda_max(A)).

        None when the method fails: a non-finite input, eq. (11)'s failure, or
        an eigendecomposition whose error e reaches ``EighConfig.failure_threshold``
        tau in float32 (eq. 10b: ``fl32(e) >= fl32(tau)``); e is computed only
        when tau is set.
        """
        cfg = self.config
        if not np.all(np.isfinite(a)):
            return None
        method = cfg.root_inverse
        tau = method.failure_threshold_float32 if isinstance(method, EighConfig) else None
        if cfg.eigenvalue_correction is not None:
            try:
                if tau is None:
                    return eigenbasis(a)
                basis = eigenbasis_with_error(a)
            except np.linalg.LinAlgError:
                return None
            return None if eigh_fails(basis.error, tau) else basis.root
        low_rank = cfg.low_rank
        if low_rank is not None and low_rank.compresses(a.shape[0]):  # eq. (10c)
            return self._eigh_root(a, root, low_rank.epsilon_for(cfg.epsilon),
                                   low_rank.eigh.failure_threshold_float32,
                                   (low_rank.rank, low_rank.keep))
        if isinstance(method, HigherOrderNewtonConfig):
            return root_inverse_higher_order(a, root, method)  # eq. (11c): its own ridge
        if isinstance(method, CoupledNewtonConfig):
            if method.deflates(a.shape[0]):  # eq. (11d)
                try:
                    result = root_inverse_deflated_newton(a, int(root), cfg.epsilon, method)
                except np.linalg.LinAlgError:
                    # A zero factor's Ritz vectors are 0/0 after one LOBPCG step: NaN,
                    # which eigh refuses (Google's JAX eigh returns NaN: a failed root).
                    return None
            else:
                # Eq. (20c): the read-back factor as it is, not symmetrized (Google's).
                eps = effective_epsilon(a, cfg.epsilon)
                result = root_inverse_coupled_newton(a, int(root), eps, method,
                                                     symmetric=not cfg.statistics.quantized)
            threshold = method.failure_threshold
            if not math.isfinite(result.error) or (
                threshold is not None and result.error >= threshold
            ):
                return None
            return result.root
        if cfg.factor_storage_dtype is not None:  # eq. (11b): the root in s
            return root_inverse_eigh_stored(a, root, effective_epsilon(a, cfg.epsilon),
                                            cfg.epsilon.placement, cfg.factor_storage_dtype)
        return self._eigh_root(a, root, cfg.epsilon, tau, scale=scale)

    def _eigh_root(self, a: Array, root: float, e: EpsilonConfig, tau: float | None,
                   low_rank: tuple[int, str] | None = None, scale: float | None = None
                   ) -> Array | None:
        """Eq. (10) with epsilon ``e`` (eq. 10c's ``low_rank`` when given) for the finite
        ``a``; None when eigh raises or, with ``tau`` = fl32(tau), eq. (10b) fails it
        (e is computed only then). ``scale``: eq. (10g)'s Lambda_k."""
        eps = effective_epsilon(a, e)
        rank = self._rank_cutoff(a, e, scale)
        try:
            if tau is None:
                return root_inverse_eigh(a, root, eps, e.placement, rank, low_rank)
            checked = root_inverse_eigh_with_error(a, root, eps, e.placement, rank, low_rank)
        except np.linalg.LinAlgError:
            return None
        return None if eigh_fails(checked.error, tau) else checked.root

    def _rank_cutoff(self, a: Array, e: EpsilonConfig, scale: float | None = None
                     ) -> tuple[float, float] | None:
        """``(rtol, atol)`` of eq. (10)'s ``"pseudo_inverse"`` rank cutoff for ``a``; else None.

        With eq. (10g)'s ``scale`` Lambda_k the cutoff is already known, and is
        returned as an absolute one: ``(0, max(rtol * max(Lambda_k, 0), atol))``.
        """
        if not e.pseudo_inverse:
            return None
        rtol = e.rank_cutoff_rtol(a.shape[0], self.config.factor_dtype)
        if scale is None:
            return rtol, e.rank_atol
        return 0.0, max(rtol * max(scale, 0.0), e.rank_atol)

    # -------------------------------------------- eq. (17) eigenvalue-corrected
    def _rotate(self, bs: BlockState, x: Array, transpose: bool) -> Array:
        """Eq. (17): ``x x_k Q_k^T`` (``transpose``) or ``x x_k Q_k`` over the preconditioned dims.

        With ``eigenvectors_dtype`` q (eq. 17a; Q_k already rounded to q) the
        rotation is Meta's in q: x rounded to q, then each mode product
        formed in float64 and rounded to q, in dim order (as eq. 16's
        products with ``inverse_root_dtype``). A block with no preconditioned
        dim is not rounded.
        """
        ec = self.config.eigenvalue_correction
        dtype = None if ec is None else ec.eigenvectors_dtype
        bases = [(k, q) for k, q in enumerate(bs.inverse_roots) if q is not None]
        if dtype is None or not bases:
            for k, q in bases:
                x = mode_product(x, q.T if transpose else q, k)
            return x
        with np.errstate(over="ignore", invalid="ignore"):  # float16 overflow: eq. (22)
            x = round_to(x, dtype)
            for k, q in bases:
                x = round_to(mode_product(x, q.T if transpose else q, k), dtype)
        return x

    def _update_corrected_moment(self, bs: BlockState, gb: Array) -> None:
        """Eq. (17): ``D <- beta2 D + w R^2``, R the gradient in the eigenbasis
        (w = ``ec.update_weight``: 1 - beta2, or 1 with ``ema_weight="one"``).

        With ``corrected_eigenvalues_dtype`` s (eq. 17a) Meta's order and
        roundings: ``round_s(c_s(beta2) D)`` (skipped for a sum), then
        ``+ (w R) R`` in float64, rounded to s once.
        """
        ec = self.config.eigenvalue_correction
        assert ec is not None and bs.corrected_second_moment is not None
        rotated = self._rotate(bs, gb, transpose=True)
        d = bs.corrected_second_moment
        s = ec.corrected_eigenvalues_dtype
        if s is not None:
            weight = ec.update_weight if ec.decays else 1.0
            with np.errstate(over="ignore", invalid="ignore"):
                decayed = round_to(_scalar_in(ec.beta2, s) * d, s) if ec.decays else d
                bs.corrected_second_moment = round_to(decayed + (weight * rotated) * rotated, s)
        elif not ec.decays:
            bs.corrected_second_moment = d + rotated**2
        else:
            bs.corrected_second_moment = ec.beta2 * d + ec.update_weight * rotated**2
        bs.corrected_updates += 1

    # ------------------------------------------------ eqs. (16)-(18) direction
    def _shampoo_direction(self, st: ParameterState, filtered: Array, graft_dir: Array) -> Array:
        cfg = self.config
        plan = st.plan
        if not plan.preconditioned:
            # Skipped parameters take the graft direction (eq. 18, skip rule).
            return graft_dir.copy()
        out = np.zeros(plan.merged_shape)
        scope_block = cfg.grafting.rescale_scope == "block"
        for b, bs in zip(plan.blocks, st.blocks, strict=True):
            fb = filtered[b.slices]
            if cfg.spectral is not None:
                pb = orthogonalize(fb, cfg.spectral)  # eq. (16c)
            elif cfg.eigenvalue_correction is not None:
                pb = self._corrected_direction(bs, fb)
            else:
                pb = self._kronecker_direction(bs, fb)
            if scope_block:
                pb = pb * np.linalg.norm(graft_dir[b.slices]) / (
                    np.linalg.norm(pb) + cfg.grafting.norm_epsilon
                )
            out[b.slices] = pb
        if cfg.grafting.rescale_scope == "parameter":
            scale = np.linalg.norm(graft_dir) / (np.linalg.norm(out) + cfg.grafting.norm_epsilon)
            out = out * scale
        return out

    def _kronecker_direction(self, bs: BlockState, fb: Array) -> Array:
        """Eq. (16): ``P_B = F~_B x_k1 X_k1 x_k2 X_k2 ...`` over the preconditioned dims.

        With ``inverse_root_dtype`` s (roots already rounded, eq. 11a) the
        products are Meta's in s: ``round_s(F~_B)``, then each mode product
        rounded to s, in dim order. Each product is formed in float64 (exact
        products of numbers of s; only the n-term sums round, at 2^-53) and
        rounded once, the most accurate result a product in s can have. A
        block with no preconditioned dim is not rounded (Meta's empty
        preconditioner list keeps the gradient's dtype).
        """
        dtype = self.config.inverse_root_dtype
        preconditioned = [(k, xk) for k, xk in enumerate(bs.inverse_roots) if xk is not None]
        if self.config.statistics.quantized:
            # Eq. (20c): a read-back root is not symmetric; Google contracts the
            # block's dim with the root's first index: X^T applied.
            preconditioned = [(k, xk.T) for k, xk in preconditioned]
        if dtype is None or not preconditioned:
            pb = fb
            for k, xk in preconditioned:
                pb = mode_product(pb, xk, k)
            return pb
        with np.errstate(over="ignore", invalid="ignore"):  # float16 overflow: eq. (22)
            pb = round_to(fb, dtype)
            for k, xk in preconditioned:
                pb = round_to(mode_product(pb, xk, k), dtype)
        return pb

    def _corrected_direction(self, bs: BlockState, fb: Array) -> Array:
        """Eq. (17): ``((F~ x_k Q_k^T) / ((D / bc)^(1/root) + epsilon)) x_k Q_k``.

        With ``corrected_eigenvalues_dtype`` s (eq. 17a) the denominator is
        Meta's, computed in s: ``round_s(round_s(round_s(D / c_s(bc))^(1/root))
        + c_s(epsilon))`` (each operation in float64, exact or correctly
        rounded for these operands, then rounded to s); the quotient is in
        float64.
        """
        ec = self.config.eigenvalue_correction
        assert ec is not None and bs.corrected_second_moment is not None
        bc = ec.bias_correction_factor(bs.corrected_updates)
        root = ec.root_for(fb.ndim)
        s = ec.corrected_eigenvalues_dtype
        rotated = self._rotate(bs, fb, transpose=True)
        if s is None:
            d = bs.corrected_second_moment / bc
            scaled = rotated / (d ** (1.0 / root) + ec.epsilon)
        else:
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                d = round_to(bs.corrected_second_moment / _scalar_in(bc, s), s)
                powered = round_to(np.sqrt(d) if root == 2 else d ** (1.0 / root), s)
                denominator = round_to(powered + _scalar_in(ec.epsilon, s), s)
                scaled = rotated / denominator
        return self._rotate(bs, scaled, transpose=False)

    # ------------------------------------------------ eq. (20d) averaging
    def _average(self, st: ParameterState, d: Array, w: Array) -> tuple[Array, Array]:
        """Eq. (20d): the new W and Z from ``d = -lr P``; Z decayed first (eq. 19's
        direction decay becomes ``Z <- Z (1 - lr_t alpha_t)``)."""
        cfg, av = self.config, self.config.averaging
        assert av is not None and st.averaged is not None
        z = st.averaged
        if cfg.weight_decay.applies("direction"):
            alpha = cfg.weight_decay.direction_value(self.learning_rate, cfg.learning_rate)
            z = z * (1.0 - self.learning_rate * alpha)
        mu_y = av.train_interp
        mu_x = av.eval_coefficient(self.learning_rate, self.lr_power_sum)
        delta = (1.0 - mu_x * mu_y) * d + (1.0 - mu_x) * (z - w)
        if cfg.update_dtype is not None:
            delta = round_to(delta, cfg.update_dtype)  # eq. (21a)
        return w + delta, z + d

    def eval(self) -> None:
        """Eq. (20d): put the averaged sequence ``x = (W - (1 - mu_y) Z) / mu_y`` in the
        parameters (``W <- W + (1 - 1 / mu_y) (Z - W)``); no-op without averaging or
        in eval mode already."""
        av = self.config.averaging
        if av is None or self.mode == "eval":
            return
        self._switch(1.0 - 1.0 / av.train_interp)
        self.mode = "eval"

    def train(self) -> None:
        """Eq. (20d): back to the training sequence ``y = mu_y x + (1 - mu_y) Z``
        (``W <- W + (1 - mu_y) (Z - W)``); no-op without averaging or in train mode."""
        av = self.config.averaging
        if av is None or self.mode == "train":
            return
        self._switch(1.0 - av.train_interp)
        self.mode = "train"

    def _switch(self, c: float) -> None:
        for name, st in self.state.items():
            assert st.averaged is not None
            w = _as_merged(self.params[name], st.plan)
            self.params[name] = (w + c * (st.averaged - w)).reshape(st.plan.shape)

    # ------------------------------------------------ eqs. (19)-(20) momentum
    def _momentum(
        self,
        st: ParameterState,
        shampoo_dir: Array | None,
        graft_dir: Array,
        w: Array,
        use_shampoo: bool,
        finite: NDArray[np.bool_],
    ) -> Array:
        cfg = self.config
        mom = cfg.momentum
        wd = cfg.weight_decay

        def prepare(p: Array) -> Array:
            if mom.lr_before_momentum:
                p = self.learning_rate * p
            if wd.applies("direction") and cfg.averaging is None:  # eq. (20d) decays Z
                p = p + wd.direction_value(self.learning_rate, cfg.learning_rate) * w  # eq. (19)
            return p

        chosen = shampoo_dir if use_shampoo else graft_dir
        assert chosen is not None
        p = prepare(chosen)
        if st.momentum is None:
            return p
        mu, damp = mom.momentum, mom.direction_weight
        if st.graft_momentum is None:
            st.momentum = np.where(finite, mu * st.momentum + damp * p, st.momentum)
            m = st.momentum
        else:
            assert shampoo_dir is not None
            st.momentum = np.where(
                finite, mu * st.momentum + damp * prepare(shampoo_dir), st.momentum
            )
            st.graft_momentum = np.where(
                finite, mu * st.graft_momentum + damp * prepare(graft_dir), st.graft_momentum
            )
            m = st.momentum if use_shampoo else st.graft_momentum
        return damp * p + mu * m if mom.nesterov else m


def run(
    config: ShampooConfig,
    params: dict[str, Array],
    grads: list[dict[str, Array]],
    learning_rates: list[float] | None = None,
) -> list[dict[str, Array]]:
    """Contract 8.2 for the reference: the parameters after each step.

    ``learning_rates``: one learning rate per step (a schedule), else
    ``config.learning_rate`` at every step.
    """
    opt = ReferenceShampoo(config, params)
    if learning_rates is None:
        return [opt.step(g) for g in grads]
    if len(learning_rates) != len(grads):
        raise ValueError(
            f"learning_rates has {len(learning_rates)} entries for {len(grads)} steps: "
            "allowed one per step."
        )
    return [opt.step(g, lr) for g, lr in zip(grads, learning_rates, strict=True)]
