"""The per-block maths of Shampoo on stacks of equal-shape blocks, eqs. (6)-(13), (16)-(18).

:func:`block_step` is everything that needs the block state, in order:
statistics (eq. 6; a sketched factor's observation, eq. 6c), inverse roots on
root steps (eqs. 7, 9-13; a sketched factor's from its sketch, eq. 10d), the
eigenvalue-corrected second moment (eq. 17) and the preconditioned,
block-rescaled stacks (eqs. 16-18; spectral descent's orthogonalized
blocks, eq. 16c, :func:`orthogonalize`, in place of eq. 16's). Every
operation is per block, so the
same function runs on all blocks (:func:`shampoo_jax.shampoo` on one device)
or on each device's shard of them (:func:`shampoo_jax.sharded.sharded_block_step`).
:func:`assemble_direction` then puts each parameter's Shampoo direction
back together from its blocks (eq. 18).

Vocabulary: *roots* are the exponents r_k (``BlockGroupLayout.roots``);
the matrices ``L_k^(-1/r_k)`` (or the eigenbases Q_k with eigenvalue
correction) are *inverse roots* (``BlockGroupState.inverse_roots``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from shampoo_spec import EighConfig, ShampooConfig, SpectralDescentConfig

from . import blocks as B
from . import grafting, schedule
from .quantization import stored
from .roots import (
    all_finite,
    basis_still_fits,
    compute_inverse_root,
    eigh_for_parameter_cutoff,
    frequent_directions_root,
    qr_eigenbasis,
    root_at_cutoff,
    root_inverse_qr,
    root_inverse_reusing_basis,
    rounded,
    sketch_epsilon,
    tearfree_sketch_root,
)
from .state import (
    BlockGroupState,
    Sketch,
    factor_dtype,
    select_sketch,
    statistics_scale_dtype,
)

Groups = tuple[BlockGroupState, ...]


class BlockInputs(NamedTuple):
    """Per block group, stacks ``[nb, *block_shape]`` (``[nb]`` for flags) in the factor dtype
    (``filtered`` in the filtered gradient's own dtype when ``inverse_root_dtype`` is set;
    all in the leaves' precision with eqs. 16b, 16c, :func:`shampoo_jax.state.block_dtype`).

    ``grads``: the masked blocks of G^ (eqs. 6, 6c: the gradient, or with
    ``frequent_directions.average_gradients`` the averaged gradient sum; the
    gradient wherever eq. 17 reads them, eq. 6c being refused with it);
    ``ok``: finite-gradient flags (eq. 3); ``filtered``: the blocks of the
    (filtered) gradient to precondition (eq. 16), None when the Shampoo
    direction is not needed; ``graft``: the graft direction's blocks for ``rescale_scope = "block"``
    (eq. 18), else None; ``owners``: with eq. (10g) on a shard of the stacks,
    each block's parameter (leaf index, ``[nb]`` int32; padding any), which
    the shard cannot know from the layout; None: the layout's order.
    """

    grads: list[Array]
    ok: list[Array]
    filtered: list[Array] | None
    graft: list[Array] | None
    owners: list[Array] | None = None


def block_step(
    groups: Groups,
    inputs: BlockInputs,
    t: Array,
    layout: B.Layout,
    config: ShampooConfig,
    lr_ratio: float | Array = 1.0,
    axis_names: tuple[str, ...] = (),
) -> tuple[Groups, Array, list[Array] | None]:
    """Everything that needs the block state: ``(groups, failures, preconditioned stacks)``.

    ``failures``: the number of failed inverse roots (eq. 13), a scalar.
    ``lr_ratio``: lr_t / lr_1 of eq. (8b) (read only with
    ``schedule.precondition_frequency_growth``). ``axis_names``: inside
    ``shard_map``, the mesh axes the blocks are split over (eq. 10g's max
    over a parameter's blocks reduces over them); () on one device.

    Statistics (eq. 6; KL-Shampoo's eq. 6b with the roots held before this
    step), inverse roots (eqs. 7, 9-13), the corrected moment
    (eq. 17) and the preconditioned, block-rescaled stacks (eqs. 16-18); the
    roots after the stacks with ``schedule.roots_take_effect="next_step"``.
    Every operation is per block, so the same function runs on any slice of
    the stacks: the sharded transformation calls it on each device's shard.
    """
    lag = config.schedule.roots_take_effect == "next_step"
    groups = update_statistics(groups, layout, inputs.grads, inputs.ok, t, config)
    if not lag:
        groups, failures = refresh_inverse_roots(groups, layout, inputs.ok, t, config, lr_ratio,
                                                 inputs.owners, axis_names)
    if config.eigenvalue_correction is not None:
        groups = update_corrected_moment(groups, layout, inputs.grads, inputs.ok, config)
    stacks = None
    if inputs.filtered is not None:
        stacks = precondition_blocks(groups, layout, inputs.filtered, inputs.graft, config)
    if lag:
        # Eq. (8), roots_take_effect="next_step": this step's directions used the
        # roots held before it; the refreshed ones take effect from t + 1.
        groups, failures = refresh_inverse_roots(groups, layout, inputs.ok, t, config, lr_ratio,
                                                 inputs.owners, axis_names)
    return groups, failures, stacks


# --------------------------------------------------------------- eq. (6)
def update_statistics(
    groups: Groups,
    layout: B.Layout,
    g_blocks: list[Array],
    block_ok: list[Array],
    t: Array,
    config: ShampooConfig,
) -> Groups:
    """Eq. (6) on statistics steps, for blocks with a finite gradient.

    ``g_blocks`` are eq. (6c)'s G^: the gradient blocks, or with
    ``frequent_directions.average_gradients`` the averaged sum's
    (:func:`shampoo_jax.transform`). A sketched factor (eq. 6c) takes
    ``C = G^_(k) G^_(k)^T`` in place of its running sum.
    With ``statistics.kl`` (eq. 6b, KL-Shampoo) each factor's update takes
    ``G~_k = G_B x_{j != k} X_j``, the block preconditioned on its other
    preconditioned dims by the inverse roots it holds now: :func:`block_step`
    runs this before the step's root refresh, so they are the previous root
    step's (the identity of eq. 13 before the first).
    """
    stats = config.statistics
    weight = stats.update_weight
    on = schedule.is_statistics_step(t, config.schedule)

    def run(groups: Groups) -> Groups:
        new = []
        for grp, gs, gb, ok in zip(layout.groups, groups, g_blocks, block_ok, strict=False):
            factors = []
            for i, (k, lk) in enumerate(zip(grp.preconditioned_dims, gs.factors, strict=False)):
                if gs.sketch(i) is not None:
                    # Eq. (6c): a sketched factor's slot holds this step's observation
                    # only (no decay, no weight); eq. (10d) folds it into the sketch.
                    observed = B.factor_contraction(gb, k)
                    factors.append(jnp.where(ok[:, None, None], observed, lk))
                    continue
                # Eq. (6b): the roots held before this step's refresh (KL-Shampoo).
                gk = _kl_preconditioned(gb, grp, gs.inverse_roots, k) if stats.kl else gb
                if config.factor_storage_dtype is not None:
                    # Eq. (11b): the decay in float32 rounded to s, the sum with
                    # w G G^T in the factor dtype rounded once to s.
                    decayed = (rounded(lk.astype(jnp.float32) * jnp.float32(stats.beta2),
                                       lk.dtype) if stats.decays else lk)
                    contraction = B.factor_contraction(gk, k)
                    updated = rounded(decayed.astype(contraction.dtype) + weight * contraction,
                                      lk.dtype)
                else:
                    decayed = stats.beta2 * lk if stats.decays else lk
                    updated = decayed + weight * B.factor_contraction(gk, k)
                if stats.quantized:  # eq. (20c): stored, read back from here on
                    updated = stored(updated, statistics_scale_dtype(config))
                factors.append(jnp.where(ok[:, None, None], updated, lk))
            new.append(gs._replace(
                factors=tuple(factors),
                statistics_updates=gs.statistics_updates + ok.astype(jnp.int32),
            ))
        return tuple(new)

    if on is True:
        return run(groups)
    if on is False:
        return groups
    out: Groups = lax.cond(on, run, lambda gs: gs, groups)
    return out


def _kl_preconditioned(
    gb: Array, grp: B.BlockGroupLayout, inverse_roots: tuple[Array, ...], k: int
) -> Array:
    """Eq. (6b): ``G_B x_{j != k} X_j`` over the group's preconditioned dims j other than k.

    In increasing j, the reference's order; the roots are in the factor dtype
    (``inverse_root_dtype`` is refused with eq. 6b), as the blocks.
    """
    out = gb
    for j, xj in zip(grp.preconditioned_dims, inverse_roots, strict=True):
        if j != k:
            out = B.mode_product(out, xj, j)
    return out


# ------------------------------------------------------- eqs. (7), (9)-(13)
def _stored_basis_root(gs: BlockGroupState, i: int, a: Array, root: float, ok: Array,
                       config: ShampooConfig, eigenbases: list[Array]) -> tuple[Array, Array]:
    """Eqs. (10f), (10h) for the i-th factor ``a`` (bias corrected, eq. 7b applied) of a
    block group, from its stored eigenbasis: the QR root (eq. 10f), or the basis kept
    while it fits and eigh's otherwise (eq. 10h); the new basis is appended to
    ``eigenbases`` where the root is accepted (good and ``ok``, eq. 13). (X, good)."""
    method = config.root_inverse
    assert isinstance(method, EighConfig) and gs.eigenbases is not None
    prev = gs.eigenbases[i]
    if method.reuses_basis:
        # ok: a block masked this step (eq. 3) is not decomposed where that can be skipped.
        x, q, good = root_inverse_reusing_basis(prev, a, root, config.epsilon,
                                                method.basis_reuse_tolerance, ok)
    else:
        x, q, good = root_inverse_qr(prev, a, root, config.epsilon,
                                     method.qr_max_iterations, method.qr_tolerance)
    eigenbases.append(jnp.where((ok & good)[:, None, None], q, prev))
    return x, good


def refresh_inverse_roots(
    groups: Groups,
    layout: B.Layout,
    block_ok: list[Array],
    t: Array,
    config: ShampooConfig,
    lr_ratio: float | Array = 1.0,
    owners: list[Array] | None = None,
    axis_names: tuple[str, ...] = (),
) -> tuple[Groups, Array]:
    """On root steps (eqs. 8, 8b at ``lr_ratio``), recompute every inverse root.

    ``lax.cond`` so other steps pay nothing. On CPU the plain roots are written
    into the state one matrix at a time (:func:`_writes_roots_in_place`); elsewhere
    the factors of one size are batched.

    Roots are computed in the factor dtype; with ``inverse_root_dtype`` they
    are stored rounded to it (eq. 11a, XLA's round-to-nearest-even convert,
    through float32 for bfloat16/float16 like torch's), and a root that is
    not finite after the rounding fails (eq. 13).
    A block skipped this step (eq. 3) keeps its inverse roots and failure
    count. A failed inverse root (eq. 13) keeps the previous one; the
    returned count adds up failed factors, and a block's
    ``consecutive_failures`` counts its root steps with any failure in a row.
    A sketched factor (eq. 10d, :func:`fold_sketch`) folds its observation
    into its sketch and takes the sketch's X; the new sketch is kept for
    every admitted block, whether X failed or not.

    With ``epsilon.rank_cutoff_scope = "parameter"`` the rank cutoff of
    factor k of block b is eq. (10g)'s (:func:`_parameter_cutoff_roots`),
    from the largest eigenvalue of dim k over the parameter's blocks:
    ``owners`` gives each block's parameter where the stacks are a shard
    (None: the layout's order) and the max is also taken over the mesh
    ``axis_names`` (``lax.pmax``; () on one device).
    """
    stats = config.statistics
    on = schedule.is_root_step(t, config.schedule, lr_ratio)
    zero = jnp.zeros((), jnp.int32)
    if on is False or not any(grp.preconditioned_dims for grp in layout.groups):
        return groups, zero

    in_place = _writes_roots_in_place(config, groups)

    def run(operand: tuple[Groups, list[Array]]) -> tuple[Groups, list[Array]]:
        groups, block_ok = operand
        if in_place:
            return _roots_in_place(groups, layout, block_ok, config)
        # Eq. (7): bias-corrected factors; then batch every factor of one size
        # and root r, from every block group and dim, into one decomposition.
        # A sketched factor (eq. 10d) is batched apart from the eq. (10)-(11) roots of its size.
        batches: dict[tuple[int, float, bool], list[tuple[int, int, Array]]] = {}
        wanted: dict[tuple[int, float, bool], list[Array]] = {}
        for gi, (grp, gs) in enumerate(zip(layout.groups, groups, strict=False)):
            n = gs.statistics_updates
            for i, (k, lk) in enumerate(zip(grp.preconditioned_dims, gs.factors, strict=False)):
                a = _corrected_factor(lk, n, config)
                key = (grp.shape[k], grp.roots[k], gs.sketch(i) is not None)
                batches.setdefault(key, []).append((gi, i, a))
                wanted.setdefault(key, []).append(block_ok[gi])
        factors_in: dict[tuple[int, int], Array] = {
            (gi, i): a for items in batches.values() for gi, i, a in items
        }
        results: dict[tuple[int, int], tuple[Array, Array]] = {}
        sketches: dict[tuple[int, int], Sketch] = {}
        token: Array | None = None
        ec = config.eigenvalue_correction
        qr = ec is not None and ec.eigenbasis_method == "qr"  # eq. (17c): below, per factor
        # Eqs. (10f), (10h): below, per factor, with its stored basis.
        stored_basis = config.root_inverse_stores_basis
        per_parameter = config.epsilon.cuts_rank_per_parameter  # eq. (10g): its own pass
        if per_parameter:
            # Eq. (10g)'s config refuses what the loop below adds to eq. (10):
            # sketches (eq. 10d), eigenbases (eqs. 10f, 10h, 17) and other root methods.
            results = _parameter_cutoff_roots(
                batches, wanted, layout,
                _owners(layout) if owners is None else owners, config, axis_names)
        for key, items in ({} if qr or stored_basis or per_parameter else batches).items():
            root = key[1]
            a = jnp.concatenate([a for _, _, a in items])
            # Blocks masked this step (eq. 3; padding when sharded) keep their
            # inverse roots below whatever comes out: not decomposed where skippable.
            active = jnp.concatenate(wanted[key])
            if token is not None:
                # One batched decomposition at a time: jaxlib's CPU LAPACK kernels
                # split a batch over the thread pool that also runs independent
                # ops and block waiting for it; two such calls at once can occupy
                # every thread of a small pool and deadlock (jaxlib 0.10.2, 2
                # cores). The barrier only orders them; it changes no value.
                token, a = lax.optimization_barrier((token, a))
            folded: Sketch | None = None
            if key[2]:
                held = [groups[gi].sketch(i) for gi, i, _ in items]
                stacked = Sketch(*(jnp.concatenate(z) for z in zip(*held, strict=True)))
                folded, x, good = fold_sketch(stacked, a, root, t, config, active)
            else:
                x, good = compute_inverse_root(a, root, config, active)
            token = x
            offset = 0
            for gi, i, a in items:
                nb = a.shape[0]
                results[(gi, i)] = (x[offset:offset + nb], good[offset:offset + nb])
                if folded is not None:
                    sketches[(gi, i)] = Sketch(*(z[offset:offset + nb] for z in folded))
                offset += nb
        # Eq. (13): keep the previous inverse root where the new one failed.
        new, failures = [], []
        for gi, (gs, ok) in enumerate(zip(groups, block_ok, strict=False)):
            inverse_roots: list[Array] = []
            eigenbases: list[Array] = []
            # zeros_like(ok): under shard_map they then vary over the mesh axis as
            # ok does, also for a group without factors (as keep's zeros do).
            any_failed = jnp.zeros_like(ok, bool)
            failed_factors = jnp.zeros_like(ok, jnp.int32)
            for i, xk in enumerate(gs.inverse_roots):
                if qr:
                    assert ec is not None
                    a = factors_in[(gi, i)]
                    x, good = qr_eigenbasis(xk.astype(a.dtype), a, config.epsilon,
                                            ec.qr_max_iterations, ec.basis_reuse_tolerance)
                elif stored_basis:
                    grp = layout.groups[gi]
                    x, good = _stored_basis_root(gs, i, factors_in[(gi, i)],
                                                 grp.roots[grp.preconditioned_dims[i]], ok,
                                                 config, eigenbases)
                else:
                    x, good = results[(gi, i)]
                if x.dtype != xk.dtype:  # eq. (11a): stored rounded to inverse_root_dtype
                    x = x.astype(xk.dtype)
                    good = good & jnp.all(jnp.isfinite(x), axis=(1, 2))
                if ec is not None and ec.basis_reuse_tolerance > 0 and not qr:
                    # Eq. (17b): a block whose stored eigenbasis still fits keeps it.
                    a = factors_in[(gi, i)]
                    fits = basis_still_fits(xk.astype(a.dtype), a, config.epsilon,
                                            ec.basis_reuse_tolerance) & all_finite(a)
                    x = jnp.where(fits[:, None, None], xk, x.astype(xk.dtype))
                    good = good | fits
                failed = ok & ~good
                if stats.quantized:  # eq. (20c): the accepted root is stored
                    x = stored(x, statistics_scale_dtype(config))
                inverse_roots.append(jnp.where((ok & good)[:, None, None], x, xk))
                any_failed = any_failed | failed
                failed_factors = failed_factors + failed.astype(jnp.int32)
            consecutive = _consecutive_failures(gs, ok, any_failed)
            new_sketches = gs.sketches
            if gs.sketches is not None:
                # Eq. (10d): an admitted block keeps its folded sketch whatever
                # eq. (13) said of its X.
                new_sketches = tuple(
                    None if old is None else select_sketch(ok, sketches[(gi, i)], old)
                    for i, old in enumerate(gs.sketches))
            new.append(gs._replace(inverse_roots=tuple(inverse_roots),
                                   consecutive_failures=consecutive, sketches=new_sketches,
                                   eigenbases=tuple(eigenbases) if stored_basis
                                   else gs.eigenbases))
            failures.append(failed_factors)
        return tuple(new), failures

    def keep(operand: tuple[Groups, list[Array]]) -> tuple[Groups, list[Array]]:
        # Per-block zeros (not one scalar): under shard_map both branches then
        # vary over the mesh axis alike.
        return operand[0], [jnp.zeros_like(ok, jnp.int32) for ok in operand[1]]

    failed: list[Array]
    if on is True:
        groups, failed = run((groups, block_ok))
    else:
        groups, failed = lax.cond(on, run, keep, (groups, block_ok))
    return groups, sum((jnp.sum(f, dtype=jnp.int32) for f in failed), zero)  # int32 under x64


def _consecutive_failures(gs: BlockGroupState, ok: Array, any_failed: Array) -> Array:
    """Eq. (13)'s count per block: root steps with any failed factor in a row (0 after
    one without); a block masked this step (``ok`` False, eq. 3) keeps its count."""
    out: Array = jnp.where(
        ok, jnp.where(any_failed, gs.consecutive_failures + 1, 0), gs.consecutive_failures)
    return out


def _writes_roots_in_place(config: ShampooConfig, groups: Groups) -> bool:
    """Whether :func:`refresh_inverse_roots` writes each root into the state in place
    (:func:`_roots_in_place`) rather than batching the factors of one size.

    On CPU, where every root goes one matrix at a time anyway
    (:func:`compute_inverse_root`), the plain roots of eqs. (10), (11): no stack of
    the factors of one size and none of their roots, so the temporaries are one
    matrix's workspace. The methods that read other state or whole stacks keep
    the batches: eigenbases (eqs. 10f, 10h, 17), sketches (eq. 10d), eq. (10g)'s
    parameter maxima and eq. (20c)'s quantization.
    """
    return (jax.default_backend() == "cpu" and config.eigenvalue_correction is None
            and not config.root_inverse_stores_basis and not config.statistics.quantized
            and not config.epsilon.cuts_rank_per_parameter
            and all(gs.sketches is None or all(x is None for x in gs.sketches)
                    for gs in groups))


def _corrected_factor(lk: Array, n: Array, config: ShampooConfig) -> Array:
    """Eqs. (7), (7b): a stack of stored factors ``[nb, m, m]`` as their roots take them,
    bias-corrected after ``n`` (``[nb]``) statistics updates and trace-scaled, per block."""
    stats = config.statistics
    a = lk
    if stats.corrects_bias and config.factor_storage_dtype is not None:
        # Eq. (11b): bc in the factor dtype, the division in float32, rounded.
        work = factor_dtype(config)
        beta2 = jnp.asarray(stats.beta2, work)
        bc = jnp.where(n > 0, 1.0 - beta2 ** n.astype(work), 1.0)
        a = rounded(lk.astype(jnp.float32) / bc.astype(jnp.float32)[:, None, None], lk.dtype)
    elif stats.corrects_bias:
        beta2 = jnp.asarray(stats.beta2, lk.dtype)
        bc = jnp.where(n > 0, 1.0 - beta2 ** n.astype(lk.dtype), 1.0)
        a = lk / bc[:, None, None]
    tau = stats.trace_scaling_exponent
    if tau > 0:  # eq. (7b), per block
        trace = jnp.trace(a, axis1=-2, axis2=-1)
        a = a * (jnp.maximum(trace, config.epsilon.value) ** -tau)[:, None, None]
    return a


def _roots_in_place(groups: Groups, layout: B.Layout, block_ok: list[Array],
                    config: ShampooConfig) -> tuple[Groups, list[Array]]:
    """:func:`refresh_inverse_roots`'s eqs. (7), (10), (11), (13) one matrix at a time,
    each accepted root written into the stored stack in place
    (:func:`_factor_roots_in_place`). Returns the groups and each group's failed
    factors per block."""
    token: Array | None = None
    new, failures = [], []
    for grp, gs, ok in zip(layout.groups, groups, block_ok, strict=False):
        inverse_roots: list[Array] = []
        any_failed = jnp.zeros_like(ok, bool)
        failed_factors = jnp.zeros_like(ok, jnp.int32)
        for k, lk, xk in zip(grp.preconditioned_dims, gs.factors, gs.inverse_roots,
                             strict=True):
            if token is not None:
                # One root loop after another (the batched path's order; one workspace).
                token, xk = lax.optimization_barrier((token, xk))
            x, good = _factor_roots_in_place(lk, gs.statistics_updates, xk, ok,
                                             grp.roots[k], config)
            token = x
            failed = ok & ~good
            inverse_roots.append(x)
            any_failed = any_failed | failed
            failed_factors = failed_factors + failed.astype(jnp.int32)
        new.append(gs._replace(inverse_roots=tuple(inverse_roots),
                               consecutive_failures=_consecutive_failures(gs, ok, any_failed)))
        failures.append(failed_factors)
    return tuple(new), failures


def _factor_roots_in_place(lk: Array, n: Array, xk: Array, ok: Array, root: float,
                           config: ShampooConfig) -> tuple[Array, Array]:
    """One factor of every block of a group: ``(inverse roots, good)``, ``[nb, m, m]``, ``[nb]``.

    A ``lax.fori_loop`` over the blocks carries the stored inverse roots ``xk``
    and writes each accepted root into it (XLA updates the carried buffer in
    place). Block b's factor ``lk[b]``, after ``n[b]`` statistics updates, is
    corrected (eqs. 7, 7b) and rooted by :func:`compute_inverse_root` on a stack
    of one, the batched path's per-matrix operations, so the same bits; rounded
    to ``inverse_root_dtype`` where set (eq. 11a, a non-finite rounded root
    failing). A block masked this step (``ok`` False, eq. 3) is not decomposed
    and, like a failed root (eq. 13), keeps its previous inverse root; its
    ``good`` is False (not counted: the caller counts ``ok & ~good``).
    """
    def body(b: Array, carry: tuple[Array, Array]) -> tuple[Array, Array]:
        xs, good = carry

        # The previous root is read in each branch, after the root is computed: read
        # before the cond, it would be one more matrix held through the workspace.
        def compute(b: Array) -> tuple[Array, Array]:
            a = _corrected_factor(lax.dynamic_index_in_dim(lk, b),
                                  lax.dynamic_index_in_dim(n, b), config)
            x, g = compute_inverse_root(a, root, config)
            old = lax.dynamic_index_in_dim(xs, b)
            if x.dtype != old.dtype:  # eq. (11a): stored rounded to inverse_root_dtype
                x = x.astype(old.dtype)
                g = g & jnp.all(jnp.isfinite(x), axis=(1, 2))
            return jnp.where(g[:, None, None], x, old), g

        def skip(b: Array) -> tuple[Array, Array]:
            return (lax.dynamic_index_in_dim(xs, b),
                    jnp.zeros_like(lax.dynamic_index_in_dim(ok, b)))

        x, g = lax.cond(ok[b], compute, skip, b)
        return (lax.dynamic_update_index_in_dim(xs, x, b, 0),
                lax.dynamic_update_index_in_dim(good, g, b, 0))

    out: tuple[Array, Array] = lax.fori_loop(0, ok.shape[0], body, (xk, jnp.zeros_like(ok)))
    return out


def _owners(layout: B.Layout) -> list[Array]:
    """Per block group, each block's parameter (leaf index): a constant ``[nb]`` int32."""
    return [jnp.asarray(np.asarray([i for i, _ in grp.members], np.int32))
            for grp in layout.groups]


def _parameter_cutoff_roots(
    batches: dict[tuple[int, float, bool], list[tuple[int, int, Array]]],
    wanted: dict[tuple[int, float, bool], list[Array]],
    layout: B.Layout,
    owners: list[Array],
    config: ShampooConfig,
    axis_names: tuple[str, ...],
) -> dict[tuple[int, int], tuple[Array, Array]]:
    """Eq. (10g): every batch's inverse roots, the rank cutoff shared over a parameter's blocks.

    ``batches`` (stacks of A, eq. 7 and 7b applied, keyed by size and root)
    and ``wanted`` (eq. 3's admitted blocks) as :func:`refresh_inverse_roots`
    builds them; ``(X, ok)`` per ``(block group, factor)``. Two passes, since
    one parameter's dim k can sit in several batches (a remainder block has
    another size, a block of another order another root):

    1. every batch is decomposed (:func:`shampoo_jax.roots.eigh_for_parameter_cutoff`)
       and its rows' lambda_max (eigh's last eigenvalue) goes to segment
       ``(parameter, dim k)``; ``Lambda_k = max over blocks b'`` of it, over
       the rows that are admitted (not masked, not padding) with a finite A
       (a row failing eq. 10b still counts, as in the reference), then over
       the mesh ``axis_names`` (one ``pmax`` of the whole segment vector);
    2. each row's cutoff ``c_{b,k} = max(rtol_{b,k} max(Lambda_k, 0), rank_atol)``
       (``rtol_{b,k}`` eq. 10's for its size, ``EpsilonConfig.rank_cutoff_rtol``)
       and its root from its own decomposition
       (:func:`shampoo_jax.roots.root_at_cutoff`).

    A segment no row contributes to is -inf: only non-finite or masked rows
    read it, and their roots are discarded (eq. 13, eq. 3).
    """
    eps = config.epsilon
    dims = max(len(grp.shape) for grp in layout.groups)
    count = len(layout.leaves) * dims
    decomposed = []
    lambda_k: Array | None = None
    token: Array | None = None
    for key, items in batches.items():
        a = jnp.concatenate([a for _, _, a in items])
        active = jnp.concatenate(wanted[key])
        if token is not None:
            # One batched decomposition at a time (refresh_inverse_roots says why).
            token, a = lax.optimization_barrier((token, a))
        lam, q, ok, finite = eigh_for_parameter_cutoff(a, config, active)
        token = q
        segment = jnp.concatenate([
            owners[gi] * dims + layout.groups[gi].preconditioned_dims[i] for gi, i, _ in items])
        top = lam[:, -1]
        counts = active & finite & jnp.isfinite(top)
        top = jnp.where(counts, top, -jnp.inf)
        batch_max = jax.ops.segment_max(top, segment, num_segments=count)
        lambda_k = batch_max if lambda_k is None else jnp.maximum(lambda_k, batch_max)
        decomposed.append((key, items, lam, q, ok, segment))
    assert lambda_k is not None
    if axis_names:
        # A parameter's blocks can be on other devices: the max over all of them,
        # the same on every device whatever the placement (a max has no order).
        lambda_k = lax.pmax(lambda_k, axis_names)
    results: dict[tuple[int, int], tuple[Array, Array]] = {}
    dtype = "float64" if lambda_k.dtype == jnp.float64 else "float32"
    for key, items, lam, q, ok, segment in decomposed:
        rtol = eps.rank_cutoff_rtol(key[0], dtype)
        cutoff = jnp.maximum(rtol * jnp.maximum(lambda_k[segment], 0.0), eps.rank_atol)
        x, good = root_at_cutoff(lam, q, ok, key[1], cutoff)
        offset = 0
        for gi, i, a in items:
            nb = a.shape[0]
            results[(gi, i)] = (x[offset:offset + nb], good[offset:offset + nb])
            offset += nb
    return results


def fold_sketch(
    sketch: Sketch, c: Array, root: float, t: Array, config: ShampooConfig,
    active: Array | None = None,
) -> tuple[Sketch, Array, Array]:
    """Eq. (10d) at root step t for a stack of sketched factors: ``(sketch', X, ok)``.

    The sketch is emptied first where ``frequent_directions.reset_every``
    says so (``(t - 1) mod reset_every = 0``, traced t); eps_t is taken from
    the (emptied) sketch's lambda_1 (:func:`shampoo_jax.roots.sketch_epsilon`),
    the zero cutoff from the factor dtype (``FrequentDirectionsConfig.zero_rtol``);
    then :func:`shampoo_jax.roots.frequent_directions_root` folds the
    observation ``c`` (eq. 6c) in. With ``frequent_directions.rule = "tearfree"``
    :func:`shampoo_jax.roots.tearfree_sketch_root` (eq. 10e) does, with
    ``epsilon.value`` and its scale (no reset).
    """
    fd = config.frequent_directions
    assert fd is not None
    rtol = fd.zero_rtol(c.shape[-1], config.factor_dtype)
    beta = config.statistics.beta2
    if fd.rule == "tearfree":
        e = config.epsilon
        return tearfree_sketch_root(sketch, c, root, beta, e.value, e.scale == "relative",
                                    rtol, active)
    if fd.reset_every is not None:
        empty = Sketch(*(jnp.zeros_like(z) for z in sketch))
        sketch = select_sketch(schedule.on_period(t, fd.reset_every, "start"), empty, sketch)
    eps = sketch_epsilon(sketch.lam, config.epsilon, fd.relative_floor)
    return frequent_directions_root(sketch, c, root, beta, eps, rtol, active)


# ------------------------------------------------------------- eq. (17)
def rotate(
    x: Array, grp: B.BlockGroupLayout, bases: tuple[Array, ...], transpose: bool,
    config: ShampooConfig,
) -> Array:
    """``x x_k Q_k`` (or ``Q_k^T`` with ``transpose``) over the preconditioned dims, eq. (17).

    With ``eigenvectors_dtype`` q (eq. 17a) the rotation is Meta's in q:
    ``x`` rounded to q, each mode product rounded to q (:func:`rounded`, so
    XLA cannot keep it wider), the result in the factor dtype. A block with
    no preconditioned dim is not rounded.
    """
    ec = config.eigenvalue_correction
    if ec is not None and ec.eigenvectors_dtype is not None and bases:
        qdt = bases[0].dtype
        x = rounded(x, qdt)
        for k, q in zip(grp.preconditioned_dims, bases, strict=False):
            x = rounded(B.mode_product(x, rounded(q, qdt), k, transpose=transpose), qdt)
        return x.astype(factor_dtype(config))
    for k, q in zip(grp.preconditioned_dims, bases, strict=False):
        x = B.mode_product(x, q, k, transpose=transpose)
    return x


def _compute_dtype(stored: Any) -> Any:
    """c_s of eq. (17a): the precision an operation on D in ``stored`` is computed in."""
    return jnp.float64 if stored == jnp.float64 else jnp.float32


def update_corrected_moment(
    groups: Groups,
    layout: B.Layout,
    g_blocks: list[Array],
    block_ok: list[Array],
    config: ShampooConfig,
) -> Groups:
    """Eq. (17): ``D <- beta2 D + w (G x_k Q_k^T)^2`` in the refreshed basis (w = update_weight).

    With ``corrected_eigenvalues_dtype`` s (eq. 17a) Meta's operations:
    ``round_s(c_s(beta2) D)`` (in c_s: float32 below float64, as torch), then
    ``+ (w R) R`` in the factor dtype, rounded to s once.
    """
    ec = config.eigenvalue_correction
    assert ec is not None
    new = []
    for grp, gs, gb, ok in zip(layout.groups, groups, g_blocks, block_ok, strict=False):
        rotated = rotate(gb, grp, gs.inverse_roots, transpose=True, config=config)
        d, n = gs.corrected_moment, gs.corrected_updates
        assert d is not None and n is not None
        if ec.corrected_eigenvalues_dtype is not None:
            c = _compute_dtype(d.dtype)
            decayed = (rounded(d.astype(c) * jnp.asarray(ec.beta2, c), d.dtype) if ec.decays
                       else d)
            weight = ec.update_weight if ec.decays else 1.0
            upd = rounded(decayed.astype(rotated.dtype) + (weight * rotated) * rotated, d.dtype)
        elif ec.decays:
            upd = ec.beta2 * d + ec.update_weight * rotated**2
        else:
            upd = d + rotated**2
        new.append(gs._replace(
            corrected_moment=jnp.where(B.expand(ok, d), upd, d),
            corrected_updates=n + ok.astype(jnp.int32),
        ))
    return tuple(new)


def corrected_direction(
    gs: BlockGroupState, grp: B.BlockGroupLayout, fb: Array, config: ShampooConfig
) -> Array:
    """Eq. (17): ``(F x_k Q_k^T) / (D^(1/root) + epsilon)`` rotated back by ``x_k Q_k``.

    With ``corrected_eigenvalues_dtype`` s (eq. 17a) the denominator is
    Meta's in s: ``D / c_s(bc)``, its root and ``+ c_s(epsilon)`` each
    computed in c_s and rounded to s; the quotient in the factor dtype.
    """
    ec = config.eigenvalue_correction
    assert ec is not None and gs.corrected_moment is not None
    d = gs.corrected_moment
    work = factor_dtype(config)
    bc = None
    if ec.corrects_bias:
        n = gs.corrected_updates
        assert n is not None
        bc = jnp.where(n > 0, 1.0 - jnp.asarray(ec.beta2, work) ** n.astype(work), 1.0)
    rotated = rotate(fb, grp, gs.inverse_roots, transpose=True, config=config)
    root = ec.root_for(len(grp.shape))  # the block order
    if ec.corrected_eigenvalues_dtype is None:
        if bc is not None:
            d = d / B.expand(bc.astype(d.dtype), d)
        scaled = rotated / (d ** (1.0 / root) + ec.epsilon)
    else:
        c = _compute_dtype(d.dtype)
        if bc is not None:
            d = rounded(d.astype(c) / B.expand(bc.astype(c), d), d.dtype)
        powered = jnp.sqrt(d.astype(c)) if root == 2 else d.astype(c) ** (1.0 / root)
        powered = rounded(powered, d.dtype)
        den = rounded(powered.astype(c) + jnp.asarray(ec.epsilon, c), d.dtype)
        wide = jnp.promote_types(rotated.dtype, den.dtype)
        scaled = (rotated.astype(wide) / den.astype(wide)).astype(rotated.dtype)
    return rotate(scaled, grp, gs.inverse_roots, transpose=False, config=config)


# ------------------------------------------------------------ eq. (16c)
def orthogonalize(fb: Array, spectral: SpectralDescentConfig) -> Array:
    """Eq. (16c), spectral descent: every matrix of the stack ``fb`` ``[nb, m, n]`` orthogonalized.

    ``P_B = orth(F~_B)`` of each filtered gradient block:

    - ``"svd"``: ``U_r V_r^T`` of the batched reduced SVD ``F~_B = U S V^T``
      over the singular values above ``max(m, n) eps s_max`` (times
      ``sum(S)``, the nuclear norm, with ``scale_by_nuclear_norm``);
    - ``"newton_schulz"``: ``X = F~_B / max(||F~_B||_F, 1e-8)``, transposed
      when m < n (the block shape is static, so the whole stack is) so that
      the Gram matrix ``A = X^T X`` is the smaller one, then
      ``num_iterations`` times ``X <- a X + X (b A + c A A)`` with
      ``(a, b, c) = coefficients``, transposed back. Dividing by the
      Frobenius norm puts every singular value in (0, 1], where each step
      maps s to ``a s + b s^3 + c s^5`` (towards 1 for Muon's coefficients).

    The products are at ``Precision.HIGHEST`` (as every block product here:
    an accelerator's default would round them to bfloat16) and the
    operations in the reference's order. The norm is
    :func:`shampoo_jax.blocks.block_norms` (overflow-safe, else the plain one).
    Computed in ``fb``'s dtype: the leaves' precision (:func:`shampoo_jax.state.block_dtype`).
    """
    if spectral.method == "svd":
        u, sv, vt = jnp.linalg.svd(fb, full_matrices=False)
        # The pairs above the rank tolerance max(m, n) eps s_max only: the others'
        # vectors are arbitrary (shampoo_reference.linalg.svd_rank_tolerance).
        tol = max(fb.shape[1:]) * jnp.finfo(fb.dtype).eps * jnp.max(sv, axis=-1, keepdims=True)
        out = _matmul(u * (sv > tol).astype(u.dtype)[:, None, :], vt)
        if spectral.scale_by_nuclear_norm:
            out = out * jnp.sum(sv, axis=-1)[:, None, None]
        return out
    x = fb / jnp.maximum(B.block_norms(fb), 1e-8)[:, None, None]
    transpose = fb.shape[1] < fb.shape[2]
    if transpose:
        x = jnp.swapaxes(x, 1, 2)
    a, b, c = spectral.coefficients

    def iteration(_: Any, x: Array) -> Array:
        gram = _matmul(jnp.swapaxes(x, 1, 2), x)
        out: Array = a * x + _matmul(x, b * gram + c * _matmul(gram, gram))
        return out

    # A loop, not unrolled: num_iterations may be up to 1000 (compile time).
    x = lax.fori_loop(0, spectral.num_iterations, iteration, x)
    return jnp.swapaxes(x, 1, 2) if transpose else x


def _matmul(a: Array, b: Array) -> Array:
    out: Array = jnp.matmul(a, b, precision=lax.Precision.HIGHEST)
    return out


# ------------------------------------------------------- eqs. (16)-(18)
def precondition_blocks(
    groups: Groups,
    layout: B.Layout,
    f_blocks: list[Array],
    gd_blocks: list[Array] | None,
    config: ShampooConfig,
) -> list[Array]:
    """Eqs. (16)-(17) (or 16c) per block, and eq. (18)'s rescale to the graft norm of each block.

    ``gd_blocks``: the graft direction's blocks when the rescale is per block
    (``grafting.rescale_scope == "block"``), else None (no rescale here).
    With ``inverse_root_dtype`` s, ``f_blocks`` arrive in the filtered
    gradient's own dtype (:func:`shampoo_jax.transform`): a block with
    preconditioned dims is rounded to s straight from it (as Meta's
    ``grad.to(...)``), its mode products are in s (each rounded to s), and P
    returns to the factor dtype for eq. (18); a block with none goes to the
    factor dtype unrounded (Meta's empty preconditioner list).

    With spectral descent (eq. 16c) every block is a matrix with no factors
    and P is :func:`orthogonalize` of its filtered gradient block, in the
    blocks' dtype (the leaves' precision); eq. (18) then rescales it as any P.
    """
    ne = config.grafting.norm_epsilon
    stacks = []
    token: Array | None = None
    for gi, (grp, gs, fb) in enumerate(zip(layout.groups, groups, f_blocks, strict=False)):
        if config.spectral is not None:
            if token is not None and config.spectral.method == "svd":
                # One batched decomposition at a time, as the inverse roots'
                # (refresh_inverse_roots): two batched LAPACK calls at once can
                # deadlock jaxlib's CPU thread pool. Orders them; changes no value.
                token, fb = lax.optimization_barrier((token, fb))
            pb = orthogonalize(fb, config.spectral)
            token = pb
        elif config.eigenvalue_correction is not None:
            pb = corrected_direction(gs, grp, fb, config)
        elif config.rounds_inverse_roots and gs.inverse_roots:
            rdt = gs.inverse_roots[0].dtype
            pb = rounded(fb, rdt)
            for k, xk in zip(grp.preconditioned_dims, gs.inverse_roots, strict=False):
                pb = rounded(B.mode_product(pb, rounded(xk, rdt), k), rdt)
            pb = pb.astype(factor_dtype(config))
        elif config.rounds_inverse_roots:
            pb = fb.astype(factor_dtype(config))  # no preconditioned dim: not rounded
        else:
            pb = fb
            # Eq. (20c): a read-back root is applied as Google does, X^T on its dim.
            quantized = config.statistics.quantized
            for k, xk in zip(grp.preconditioned_dims, gs.inverse_roots, strict=False):
                pb = B.mode_product(pb, xk, k, transpose=quantized)
        if gd_blocks is not None:
            scale = B.block_norms(gd_blocks[gi]) / (B.block_norms(pb) + ne)
            pb = pb * B.expand(scale, pb)
        stacks.append(pb)
    return stacks


def assemble_direction(
    stacks: list[Array],
    layout: B.Layout,
    graft_dir: list[Array],
    config: ShampooConfig,
) -> list[Array]:
    """Eq. (18): reassemble each leaf from its blocks; parameter-scope graft rescale."""
    per_parameter = config.grafting.rescale_scope == "parameter"
    ne = config.grafting.norm_epsilon
    out = []
    for i, leaf in enumerate(layout.leaves):
        if not leaf.refs:
            out.append(graft_dir[i])  # not preconditioned: the graft direction (eq. 18)
            continue
        p = B.scatter(stacks, leaf).astype(graft_dir[i].dtype)
        if per_parameter:
            p = p * (grafting.norm(graft_dir[i]) / (grafting.norm(p) + ne))
        out.append(p)
    return out


__all__ = [
    "BlockInputs",
    "assemble_direction",
    "block_step",
    "corrected_direction",
    "fold_sketch",
    "orthogonalize",
    "precondition_blocks",
    "refresh_inverse_roots",
    "rotate",
    "update_corrected_moment",
    "update_statistics",
]
