"""The root step on the block state, eqs. (7), (8), (9)-(13), (10d), (10f)-(10h), (17b), (17c).

:func:`refresh_inverse_roots` runs on root steps (under ``lax.cond``): each
factor bias-corrected (eqs. 7, 7b), the factors of one size and root batched
into one stack for :func:`shampoo_jax.roots.compute_inverse_root` (on CPU the
plain roots are written into the state one matrix at a time instead,
:func:`_roots_in_place`), a failed root replaced by the previous one and
counted (eq. 13). Beside it, the methods that read more state than a stack of
factors: the stored eigenbases (eqs. 10f, 10h, 17b, 17c), eq. (10g)'s rank
cutoff over a parameter's blocks (:func:`_parameter_cutoff_roots`) and the
frequent-directions sketches (eq. 10d, :func:`fold_sketch`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from shampoo_spec import CoupledNewtonConfig, EighConfig, ShampooConfig

from . import blocks as B
from . import schedule
from .quantization import stored
from .roots import (
    Sketch,
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
    select_sketch,
    sketch_epsilon,
    tearfree_sketch_root,
)
from .state import BlockGroupState, Groups, factor_dtype, statistics_scale_dtype


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
                folded, x, good = fold_sketch(stacked, a, root, t, config, active,
                                              largest_factor(layout))
            else:
                x, good = compute_inverse_root(a, root, config, active)
                if _fails_padded(config, key[0], largest_factor(layout)):
                    good = jnp.zeros_like(good)  # eq. (11d), Google's padded deflation
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
            x, good = _factor_roots_in_place(
                lk, gs.statistics_updates, xk, ok, grp.roots[k], config,
                _fails_padded(config, grp.shape[k], largest_factor(layout)))
            token = x
            failed = ok & ~good
            inverse_roots.append(x)
            any_failed = any_failed | failed
            failed_factors = failed_factors + failed.astype(jnp.int32)
        new.append(gs._replace(inverse_roots=tuple(inverse_roots),
                               consecutive_failures=_consecutive_failures(gs, ok, any_failed)))
        failures.append(failed_factors)
    return tuple(new), failures


def _fails_padded(config: ShampooConfig, n: int, largest: int) -> bool:
    """Eq. (11d), ``deflation_padding = "google"``: an ``n x n`` factor's root fails."""
    method = config.root_inverse
    return isinstance(method, CoupledNewtonConfig) and method.fails_padded(n, largest)


def _factor_roots_in_place(lk: Array, n: Array, xk: Array, ok: Array, root: float,
                           config: ShampooConfig, fails: bool = False
                           ) -> tuple[Array, Array]:
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
    ``fails``: every root fails (eq. 11d's ``deflation_padding = "google"``).
    """
    def body(b: Array, carry: tuple[Array, Array]) -> tuple[Array, Array]:
        xs, good = carry

        # The previous root is read in each branch, after the root is computed: read
        # before the cond, it would be one more matrix held through the workspace.
        def compute(b: Array) -> tuple[Array, Array]:
            a = _corrected_factor(lax.dynamic_index_in_dim(lk, b),
                                  lax.dynamic_index_in_dim(n, b), config)
            x, g = compute_inverse_root(a, root, config)
            if fails:  # eq. (11d), Google's padded deflation
                g = jnp.zeros_like(g)
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


def largest_factor(layout: B.Layout) -> int:
    """The largest factor the layout preconditions (every group's preconditioned dims);
    0 with none. Eq. (10d)'s ``packing = "google"`` reads a smaller sketch's values
    back by it (``FrequentDirectionsConfig.kept_values``)."""
    return max((grp.shape[k] for grp in layout.groups for k in grp.preconditioned_dims),
               default=0)


def fold_sketch(
    sketch: Sketch, c: Array, root: float, t: Array, config: ShampooConfig,
    active: Array | None = None, largest: int = 0,
) -> tuple[Sketch, Array, Array]:
    """Eq. (10d) at root step t for a stack of sketched factors: ``(sketch', X, ok)``.

    The sketch is emptied first where ``frequent_directions.reset_every``
    says so (``(t - 1) mod reset_every = 0``, traced t); eps_t is taken from
    the (emptied) sketch's lambda_1 (:func:`shampoo_jax.roots.sketch_epsilon`),
    the zero cutoff from the factor dtype (``FrequentDirectionsConfig.zero_rtol``);
    with ``packing = "google"`` only the first ``kept_values(n, largest)`` values
    are read back (``largest``: :func:`largest_factor` of the layout);
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
    kept = fd.kept_values(c.shape[-1], largest)
    if kept < sketch.lam.shape[-1]:  # packing "google": the values past ``kept`` read as 0
        sketch = sketch._replace(lam=sketch.lam.at[..., kept:].set(0.0))
    if fd.reset_every is not None:
        empty = Sketch(*(jnp.zeros_like(z) for z in sketch))
        sketch = select_sketch(schedule.on_period(t, fd.reset_every, "start"), empty, sketch)
    eps = sketch_epsilon(sketch.lam, config.epsilon, fd.relative_floor)
    return frequent_directions_root(sketch, c, root, beta, eps, rtol, active)


__all__ = ["fold_sketch", "largest_factor", "refresh_inverse_roots"]
