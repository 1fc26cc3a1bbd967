"""What a step admits: its arguments, then L2 decay (eq. 2) and the refusal of eq. (3).

Eq. numbers refer to docs/spec.md. A block is refused when its gradient is
not finite or could take its float32 state (or float16 factors) out of
range (:func:`shampoo_spec.block_overflows`); the failure policy then
raises, with nothing changed, or masks the block out of the step.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from shampoo_spec import (
    NonFiniteGradientError,
    ShampooConfig,
    block_overflows,
    factor_limit,
)

from . import grafting
from .state import BlockState, ParameterState, as_merged

Array = NDArray[np.float64]


def shown(value: object) -> str:
    """``repr(value)`` for an error message, cut to about 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + f"... ({len(text)} characters)"


def real_array(what: str, name: object, value: object) -> Array:
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


def checked_gradients(grads: object, params: Mapping[str, Array], mode: str, lr: object
                      ) -> dict[str, Array]:
    """A step's gradients as float64 copies, once its arguments are checked: ``grads`` a
    dict with the names of ``params`` and their shapes, the optimizer in train ``mode``
    (eq. 20d), lr_t = ``lr`` a finite number. ValueError (RuntimeError for the mode)."""
    if not isinstance(grads, Mapping):
        raise ValueError(f"grads = {shown(grads)} is invalid: allowed a dict name -> array.")
    if mode != "train":
        raise RuntimeError(
            "step() in eval mode: the parameters hold the averaged sequence x "
            "(eq. 20d); call train() before step()."
        )
    if set(grads) != set(params):
        raise ValueError(
            f"grads keys {sorted(grads)} do not match parameter names {sorted(params)}."
        )
    if not isinstance(lr, numbers.Real) or isinstance(lr, bool) or not math.isfinite(lr):
        raise ValueError(f"learning_rate = {shown(lr)} is invalid: allowed a finite number.")
    arrays = {name: real_array("gradient", name, g) for name, g in grads.items()}
    for name, g in arrays.items():
        if g.shape != params[name].shape:
            raise ValueError(
                f"gradient of {name!r} has shape {g.shape}, parameter has "
                f"{params[name].shape}."
            )
    return arrays


@dataclass
class Admitted:
    """One parameter's gradient after eqs. (2)-(3), before any state changes.

    ``g``: merged, L2-decayed, zero on refused blocks; ``ok``: elementwise
    mask of the admitted blocks; ``refused``: how many blocks were refused.
    """

    g: Array
    ok: NDArray[np.bool_]
    refused: int


def admit(config: ShampooConfig, st: ParameterState, w_orig: Array, name: str, g_orig: Array,
          t: int) -> Admitted:
    """Eqs. (2)-(3) for the parameter ``name`` (state ``st``, value ``w_orig``) at step t;
    changes nothing.

    A block is refused when its gradient (after L2 decay) holds NaN or
    inf, or when :func:`shampoo_spec.block_overflows` says its state could
    leave float32's range this step (m: the largest absolute entry of its
    factors, graft state on its slice and corrected moment, before the
    step). ``"raise"``: :class:`NonFiniteGradientError`; ``"skip_block"``:
    the block is masked out of this step.
    """
    cfg = config
    plan = st.plan
    g = as_merged(g_orig, plan)

    # Eq. (2): L2 weight decay enters the gradient (and so the statistics).
    if cfg.weight_decay.applies("l2"):
        g = g + cfg.weight_decay.value * as_merged(w_orig, plan)

    # Eq. (3): a refused block never touches the state.
    ok = np.ones(plan.merged_shape, dtype=bool)
    refused = 0
    for i, (b, bs) in enumerate(zip(plan.blocks, st.blocks, strict=True)):
        gb = g[b.slices]
        if not np.all(np.isfinite(gb)):
            reason = "non-finite gradient"
        else:
            g_max, m = max_abs(gb), state_max_abs(st, b.slices, bs)
            m_f = max((max_abs(f) for f in bs.factors if f is not None), default=0.0)
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
    return Admitted(g, ok, refused)


def state_max_abs(st: ParameterState, slices: tuple[slice, ...], bs: BlockState) -> float:
    """m of eq. (3): max |entry| of the block's factors, graft state V (eq. 14e:
    the parameter's R, C, V), moment D, diagonal state V_D (0 if none)."""
    parts = [max_abs(f) for f in bs.factors if f is not None]
    if isinstance(st.graft, grafting.FactoredMoments):
        parts.extend(max_abs(x) for x in st.graft.arrays())
    for elementwise in (st.graft, st.diagonal):
        if isinstance(elementwise, np.ndarray):
            parts.append(max_abs(elementwise[slices]))
    if bs.corrected_second_moment is not None:
        parts.append(max_abs(bs.corrected_second_moment))
    return max(parts, default=0.0)


def max_abs(x: Array) -> float:
    """max |x| (0 for an empty x)."""
    return float(np.max(np.abs(x))) if x.size else 0.0
