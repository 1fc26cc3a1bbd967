"""The elementwise phases of a parameter's step, in its merged shape (or its own, eq. 14e).

Eq. numbers refer to docs/spec.md: the graft state (eqs. 14b, 14e) and the
diagonal preconditioner's state V_D (eq. 16b), the gradient filter
(eq. 15), the graft direction (eqs. 14c, 14e), momentum and weight decay
(eqs. 19-20), iterate averaging (eq. 20d), the update (eqs. 21, 21a) and
the withholding of non-finite entries (eq. 22). Entries of refused blocks
(``finite`` False, eq. 3) keep their state.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from shampoo_spec import ShampooConfig

from . import grafting
from .rounding import round_to
from .state import ParameterState, store_momentum

Array = NDArray[np.float64]


def update_graft_state(config: ShampooConfig, t: int, st: ParameterState, g: Array,
                       finite: NDArray[np.bool_]) -> None:
    """Eq. (14b): the graft state V from G (eq. 14e: Adafactor's moments, only when every
    block of the parameter was admitted)."""
    if isinstance(st.graft, grafting.FactoredMoments):
        if finite.all():  # eq. (14e): means over the whole parameter, in its shape
            st.graft = grafting.adafactor_update(st.graft, g.reshape(st.plan.shape), t,
                                                 config.grafting)
    elif st.graft is not None:
        st.graft = np.where(finite, grafting.update_state(st.graft, g, config.grafting),
                            st.graft)


def update_diagonal_state(config: ShampooConfig, st: ParameterState, g: Array,
                          finite: NDArray[np.bool_]) -> None:
    """Eq. (16b): the diagonal preconditioner's state V_D, as eq. (14b), every step."""
    diagonal = None if config.diagonal is None else config.diagonal.as_graft()
    if st.diagonal is not None:  # eq. (16b): V_D as eq. (14b), every step
        assert diagonal is not None
        st.diagonal = np.where(finite, grafting.update_state(st.diagonal, g, diagonal),
                               st.diagonal)


def filter_gradient(config: ShampooConfig, t: int, st: ParameterState, g: Array,
                    finite: NDArray[np.bool_]) -> Array:
    """Eq. (15): stored ``F_t = beta1 F + (1 - beta1) G``; used
    ``beta3 F_{t-1} + (1 - beta3) G``."""
    f = config.gradient_filter
    if st.filtered is None:
        return g
    beta3 = f.direction_beta
    used = beta3 * st.filtered + (1.0 - beta3) * g
    if f.bias_correction:
        used = used / f.bias_correction_factor(t)
    st.filtered = np.where(finite, f.beta1 * st.filtered + (1.0 - f.beta1) * g, st.filtered)
    return used


def graft_direction(config: ShampooConfig, t: int, st: ParameterState, filtered: Array,
                    w_orig: Array) -> Array:
    """Eq. (14c) (elementwise, merged shape) or eq. (14e) (in the parameter's own shape,
    with W = ``w_orig``) of the filtered gradient, returned in the merged shape."""
    graft = config.grafting
    if isinstance(st.graft, grafting.FactoredMoments):
        shape = st.plan.shape
        return grafting.adafactor_direction(
            filtered.reshape(shape), st.graft, w_orig, graft).reshape(filtered.shape)
    return grafting.direction(filtered, st.graft, t, graft)


def preconditioned_input(config: ShampooConfig, t: int, st: ParameterState, filtered: Array
                         ) -> Array:
    """What eq. (16) preconditions: the filtered gradient F~, or with a diagonal
    preconditioner D(F~), eq. (14c) with its state V_D (eq. 16b)."""
    # Eq. (16b): a diagonal preconditioner's blocks are D(F~) (eq. 14c with V_D);
    # every block root is 0, so eq. (16) passes them through unchanged.
    diagonal = None if config.diagonal is None else config.diagonal.as_graft()
    return filtered if diagonal is None else grafting.direction(
        filtered, st.diagonal, t, diagonal)


def momentum_step(
    config: ShampooConfig,
    learning_rate: float,
    st: ParameterState,
    shampoo_dir: Array | None,
    graft_dir: Array,
    w: Array,
    use_shampoo: bool,
    finite: NDArray[np.bool_],
) -> Array:
    """Eqs. (19)-(20) at lr_t = ``learning_rate``: the direction's weight decay, then the
    momentum buffers (one, or one per direction); the step U the update takes."""
    cfg = config
    mom = cfg.momentum
    wd = cfg.weight_decay

    def prepare(p: Array) -> Array:
        if mom.lr_before_momentum:
            p = learning_rate * p
        if wd.applies("direction") and cfg.averaging is None:  # eq. (20d) decays Z
            p = p + wd.direction_value(learning_rate, cfg.learning_rate) * w  # eq. (19)
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


def apply_update(config: ShampooConfig, learning_rate: float, lr_power_sum: float,
                 st: ParameterState, step: Array, w: Array) -> tuple[Array, Array | None]:
    """Eqs. (20)-(21): the new W from the step U at lr_t = ``learning_rate``, with the
    update's weight decay (eq. 21) and rounding (eq. 21a); with averaging (eq. 20d)
    also the new Z, else None."""
    cfg = config
    lr = 1.0 if cfg.momentum.lr_before_momentum else learning_rate
    new_z = None
    if cfg.averaging is not None:
        new_w, new_z = averaged_step(cfg, learning_rate, lr_power_sum, st, -(lr * step), w)
    elif cfg.update_dtype is None:
        new_w = w - lr * step
        if cfg.weight_decay.applies("update"):
            new_w = new_w - learning_rate * cfg.weight_decay.value * w  # eq. (21)
    else:
        # Eq. (21a): the update Delta = -lr U, rounded to update_dtype, then added.
        delta = -(lr * step)
        if cfg.weight_decay.applies("update"):
            delta = delta - learning_rate * cfg.weight_decay.value * w
        new_w = w + round_to(delta, cfg.update_dtype)
    return new_w, new_z


def averaged_step(config: ShampooConfig, learning_rate: float, lr_power_sum: float,
                  st: ParameterState, d: Array, w: Array) -> tuple[Array, Array]:
    """Eq. (20d): the new W and Z from ``d = -lr P``; Z decayed first (eq. 19's
    direction decay becomes ``Z <- Z (1 - lr_t alpha_t)``); the scalars by eq. (20e)."""
    cfg, av = config, config.averaging
    assert av is not None and st.averaged is not None
    z = st.averaged
    if cfg.weight_decay.applies("direction"):
        alpha = cfg.weight_decay.direction_value(learning_rate, cfg.learning_rate)
        z = z * av.decay_factor(learning_rate, alpha)
    # (1 - mu_x mu_y, 1 - mu_x), in float32 under eq. (20e)
    along_d, toward_z = av.step_coefficients(learning_rate, lr_power_sum)
    delta = along_d * d + toward_z * (z - w)
    if cfg.update_dtype is not None:
        delta = round_to(delta, cfg.update_dtype)  # eq. (21a)
    return w + delta, z + d


def withhold_nonfinite(
    config: ShampooConfig,
    st: ParameterState,
    w: Array,
    new_w: Array,
    new_z: Array | None,
    finite: NDArray[np.bool_],
    buffers: tuple[Array | None, Array | None],
) -> tuple[Array, bool]:
    """Eq. (22): the new W (merged shape) where it and the new buffers are finite, else
    the old one; ``buffers``: the momentum buffers before eq. (20). Then eq. (20b)'s
    storage of the buffers. Also whether an admitted entry was withheld."""
    cfg = config
    # Eq. (22): an entry whose new value or new momentum is non-finite keeps
    # its old ones (the state before eq. 20 is finite by eq. 3).
    keep = np.isfinite(new_w)
    if new_z is not None:
        assert st.averaged is not None
        keep &= np.isfinite(new_z)
        st.averaged = np.where(finite & keep, new_z, st.averaged)
    quantized = cfg.momentum.quantizes(len(st.plan.shape))
    for new in (st.momentum, st.graft_momentum):
        if new is not None:
            keep &= np.isfinite(new)
            if quantized:  # eq. (20b) quantizes fl_d(M): it must be finite too
                with np.errstate(over="ignore"):
                    keep &= np.isfinite(new.astype(cfg.momentum.scale_dtype))
    withheld = not keep[finite].all()
    if withheld:
        if st.momentum is not None and buffers[0] is not None:
            st.momentum = np.where(keep, st.momentum, buffers[0])
        if st.graft_momentum is not None and buffers[1] is not None:
            st.graft_momentum = np.where(keep, st.graft_momentum, buffers[1])
    new_w = np.where(finite & keep, new_w, w)
    if quantized:
        store_momentum(cfg, st)
    return new_w, withheld
