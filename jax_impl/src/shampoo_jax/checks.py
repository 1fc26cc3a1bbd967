"""Host-side checks: the arguments of :func:`shampoo_jax.shampoo` and its updates,
and :func:`check_state`, which raises between jitted steps what the reference
raises inside its step (eqs. 3 and 13).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from shampoo_spec import NonFiniteGradientError, RootFailureError, ShampooConfig

from . import blocks as B
from .grafting import FactoredMoments
from .state import ParameterInfo, ShampooState, leaf_shapes

#: The state kinds :func:`check_state` reads for non-finite entries: (name in the
#: error, ShampooState field(s)) for the elementwise states (the parameters'
#: structure, one entry per parameter leaf), and the block states' fields.
ELEMENTWISE_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("graft", ("graft", "adafactor")),
    ("filtered gradient", ("filtered",)),
    ("momentum", ("momentum", "momentum_scale")),
    ("graft momentum", ("graft_momentum", "graft_momentum_scale")),
    ("diagonal", ("diagonal",)),
    ("averaging", ("averaged",)),
    ("gradient sum", ("gradient_sum",)),
)
BLOCK_KINDS: tuple[tuple[str, str], ...] = (
    ("factors", "factors"),
    ("corrected eigenvalues", "corrected_moment"),
)


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

    Then every state kind that eq. (3) keeps finite is read for NaN or inf
    (:data:`ELEMENTWISE_KINDS`: graft (Adafactor's moments included), filtered
    gradient, momentum, graft momentum (their eq. 20b scales included),
    diagonal, averaging (Z and Schedule-Free's ``S_t``), gradient sum;
    :data:`BLOCK_KINDS`: factors and eigenvalue correction's corrected
    eigenvalues D): one host read per kind (a reduction per piece), the leaves
    searched only when one is not finite. A non-finite entry is a corrupt
    state (a bad checkpoint, a state edited by hand, a bug), not a refused
    gradient: it raises ``ValueError`` naming the kind and the parameter
    paths (and blocks).
    """
    _check_finite(state, config)
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


def _floating(leaves: list[Any]) -> list[Any]:
    return [x for x in leaves if x is not None and jnp.issubdtype(x.dtype, jnp.inexact)]


def _all_finite(leaves: list[Any]) -> bool:
    """One reduction per piece of ``leaves`` on its own device and one host read.

    Per addressable shard, not over a sharded array: an eager reduction over a
    sharded array is a cross-device program of its own, and many such programs
    dispatched between steps stalled XLA's CPU collectives (a rendezvous timeout
    with 4 host devices on 2 cores); a shard's reduction involves no other device.
    """
    leaves = _floating(leaves)
    if not leaves:
        return True
    flags = [jnp.all(jnp.isfinite(piece.data)) for x in leaves for piece in x.addressable_shards]
    return all(jax.device_get(flags))


def _per_parameter(field: Any, name: str) -> list[Any]:
    """An elementwise field as one subtree per parameter leaf (flattening order)."""
    if name.endswith("_scale"):  # eq. (20b)'s scales: a tuple, one entry (or None) per leaf
        return list(field)
    return jax.tree.leaves(field, is_leaf=lambda x: isinstance(x, FactoredMoments))


def _check_finite(state: ShampooState, config: ShampooConfig) -> None:
    """:func:`check_state`'s NaN/inf check of every state kind (host side)."""
    info = state.info
    bad: list[str] = []
    for kind, fields in ELEMENTWISE_KINDS:
        present = [(f, getattr(state, f)) for f in fields if getattr(state, f) is not None]
        extra = [state.lr_power_sum] if kind == "averaging" and state.lr_power_sum is not None \
            else []
        if _all_finite(jax.tree.leaves([v for _, v in present]) + extra):
            continue
        names: list[str] = []
        for f, value in present:
            for i, sub in enumerate(_per_parameter(value, f)):
                if not _all_finite(jax.tree.leaves(sub)):
                    name = info.paths[i] if info is not None else f"#{i}"
                    if name not in names:
                        names.append(name)
        if extra and not _all_finite(extra):
            names.append("lr_power_sum (S_t)")
        bad.append(f"{kind} state of parameter(s) {', '.join(names) or '<unknown>'}")
    for kind, field in BLOCK_KINDS:
        stacks = [(i, x) for i, gs in enumerate(state.groups)
                  for x in jax.tree.leaves(getattr(gs, field))]
        if _all_finite([x for _, x in stacks]):
            continue
        where = []
        for i, x in stacks:
            if not _all_finite([x]):
                rows = np.asarray(jnp.all(jnp.isfinite(x).reshape(x.shape[0], -1), axis=1))
                where.append(_failed_blocks(state, config, i, np.flatnonzero(~rows)))
        bad.append(f"{kind} of {', '.join(dict.fromkeys(where))}")
    if bad:
        raise ValueError(
            f"the optimizer state holds non-finite (NaN or inf) entries by step "
            f"{int(state.count)}: {'; '.join(bad)}. Eq. (3) keeps the state finite, so this "
            "state is corrupt (a bad checkpoint or an edited state): restore an earlier one."
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
