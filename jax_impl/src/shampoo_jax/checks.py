"""Host-side checks: the arguments of :func:`shampoo_jax.shampoo` and its updates,
and :func:`check_state`, which raises between jitted steps what the reference
raises inside its step (eqs. 3 and 13).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax import Array

from shampoo_spec import NonFiniteGradientError, RootFailureError, ShampooConfig

from . import blocks as B
from .state import ParameterInfo, ShampooState, leaf_shapes


def check_learning_rate(lr: Any) -> None:
    """A schedule (callable), or a finite number >= 0; anything else is a ValueError."""
    if callable(lr) or isinstance(lr, jax.core.Tracer):
        return
    try:
        x = np.asarray(lr)
        ok = (x.ndim == 0 and x.dtype.kind in "fiu" and bool(np.isfinite(x)) and bool(x >= 0))
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ValueError(
            f"learning_rate = {lr!r} is invalid: allowed a finite number >= 0, "
            "a schedule (callable of the step count), or None (config.learning_rate)."
        )


def check_shapes(keyed: list[tuple[Any, Array]], info: ParameterInfo | None,
                  params: Any | None) -> None:
    """Every gradient leaf must have its parameter's shape (static: checked at trace time).

    Against the shapes recorded in the state at init (``state.info``), else
    against ``params``. A gradient of another shape with the same size (a
    transposed matrix) would otherwise be reshaped silently.
    """
    if info is not None:
        want, names = info.shapes, info.paths
    elif params is not None:
        p_keyed, _ = jax.tree_util.tree_flatten_with_path(params)
        want = leaf_shapes([x for _, x in p_keyed])
        names = tuple(jax.tree_util.keystr(k) for k, _ in p_keyed)
    else:
        return
    if len(keyed) != len(want):
        raise ValueError(
            f"updates have {len(keyed)} arrays; the parameters have {len(want)} "
            f"({list(names)}): pass the gradients of the parameters the state was made for."
        )
    for (path, x), shape, name in zip(keyed, want, names, strict=True):
        if tuple(int(d) for d in x.shape) != shape:
            raise ValueError(
                f"the gradient at {jax.tree_util.keystr(path)} has shape {tuple(x.shape)}; "
                f"the parameter {name} has shape {shape}: gradients must have their "
                "parameter's shape (a transposed gradient is refused)."
            )


def check_state(
    state: ShampooState, config: ShampooConfig, previous: ShampooState | None = None
) -> None:
    """Raise on the host what the reference raises inside its step.

    Call between jitted steps (it reads the counters, a device-to-host copy).
    ``"raise"`` policy: any block skipped since ``previous`` (or ever, without
    it; eq. 3: a non-finite gradient, or one that would overflow the state)
    raises :class:`NonFiniteGradientError`; ``max_consecutive_root_failures``:
    a block over the limit raises :class:`RootFailureError` (eq. 13). Both
    name the parameters by their pytree paths (``jax.tree_util.keystr``,
    recorded in the state at init).
    """
    if config.failure.nonfinite_gradient == "raise":
        before = 0 if previous is None else int(previous.skipped_blocks)
        now = int(state.skipped_blocks)
        if now > before:
            raise NonFiniteGradientError(
                f"{now - before} block(s) of parameter(s) {_skipped_names(state, previous)} "
                f"had a non-finite gradient, or one that would overflow the state, by step "
                f"{int(state.count)}; failure.nonfinite_gradient='raise' "
                "(inside jit they were skipped)."
            )
    limit = config.failure.max_consecutive_root_failures
    if limit is not None:
        for i, gs in enumerate(state.groups):
            counts = np.asarray(gs.consecutive_failures)
            worst = int(counts.max()) if counts.size else 0
            if worst > limit:
                where = _failed_blocks(state, config, i, np.flatnonzero(counts > limit))
                raise RootFailureError(
                    f"inverse roots of {where} failed on {worst} root steps in a row "
                    f"by step {int(state.count)} "
                    f"(failure.max_consecutive_root_failures={limit})."
                )


def _skipped_names(state: ShampooState, previous: ShampooState | None) -> str:
    """The paths of the parameters with blocks skipped since ``previous`` (host side)."""
    now = state.skipped_per_parameter
    if now is None:
        return "<unknown: state without per-parameter counters>"
    counts = np.asarray(now)
    if previous is not None and previous.skipped_per_parameter is not None:
        counts = counts - np.asarray(previous.skipped_per_parameter)
    bad = [int(i) for i in np.flatnonzero(counts > 0)]
    if not bad:
        return "<unknown: per-parameter counters unchanged>"
    paths = state.info.paths if state.info is not None else None
    return ", ".join(
        f"{paths[i]} ({int(counts[i])})" if paths is not None else f"#{i} ({int(counts[i])})"
        for i in bad
    )


def _failed_blocks(
    state: ShampooState, config: ShampooConfig, group: int, stack_positions: np.ndarray
) -> str:
    """The parameters (pytree paths) and block offsets at stack positions of a block group."""
    info = state.info
    fallback = f"block group {group}"
    if info is None:
        return fallback
    layout = B.make_layout(info.shapes, config)
    if group >= len(layout.groups):
        return fallback
    grp = layout.groups[group]
    index = (
        {q: j for j, q in enumerate(info.slots[group])}
        if info.slots is not None
        else {j: j for j in range(grp.size)}
    )
    names = []
    for q in stack_positions:
        j = index.get(int(q))
        if j is None:
            continue
        leaf, block = grp.members[j]
        offsets = layout.leaves[leaf].plan.blocks[block].offsets
        names.append(f"parameter {info.paths[leaf]} (block at offsets {offsets})")
    return ", ".join(names) if names else fallback
