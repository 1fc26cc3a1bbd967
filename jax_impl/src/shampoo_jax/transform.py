"""Shampoo as an ``optax.GradientTransformation``, in the order of docs/spec.md.

``update`` reads as the algorithm's outline, eqs. (1)-(21):

1. count and learning rate (eq. 1), L2 decay (eq. 2);
2. non-finite blocks are masked out of every state update (eq. 3);
3. graft state (eq. 14b) and gradient filter (eq. 15), elementwise;
4. per block group: statistics (eq. 6), roots under ``lax.cond`` (eqs.
   7, 9-13), the eigenvalue-corrected second moment (eq. 17);
5. graft direction (eq. 14c) and Shampoo direction with graft rescale
   (eqs. 16-18);
6. direction decay, momentum, learning rate, update decay (eqs. 19-21).

Steps 4-5's per-block work is one function, :func:`block_step`, so that the
sharded transformation (:mod:`shampoo_jax.sharded`) can run it on each
device's blocks; the single-device update calls it on all blocks.

Static structure (blocks, groups, which options are on) is decided at trace
time from ``shampoo_spec``; step-dependent decisions are traced booleans,
so ``jax.jit`` compiles the update once per config and parameter shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import Array, lax

from shampoo_spec import NonFiniteGradientError, RootFailureError, ShampooConfig

from . import blocks as B
from . import grafting, schedule
from .roots import compute_root
from .sharded import ShardingConfig, shard_state, sharded_block_step


class BlockGroupState(NamedTuple):
    """State of one group of equal-shape blocks (leading axis: the blocks).

    ``factors[i]`` / ``roots[i]`` belong to the i-th preconditioned dim of the
    group's block shape. With eigenvalue correction ``roots`` hold the
    eigenbases Q_k and ``corrected_moment`` the D of eq. (17).
    """

    factors: tuple[Array, ...]
    roots: tuple[Array, ...]
    statistics_updates: Array  # [nb] int32, n of eq. (7)
    consecutive_failures: Array  # [nb] int32, eq. (13)
    corrected_moment: Array | None
    corrected_updates: Array | None


class ShampooState(NamedTuple):
    """The whole optimizer state: a pytree of arrays (checkpoint it as is).

    Elementwise states (``graft``, ``filtered``, ``momentum``,
    ``graft_momentum``) have the structure and shapes of the parameters, or
    are None when the config does not use them. ``root_failures`` counts
    failed roots (eq. 13), ``skipped_blocks`` blocks whose gradient was
    non-finite (eq. 3).
    """

    count: Array
    groups: tuple[BlockGroupState, ...]
    graft: Any
    filtered: Any
    momentum: Any
    graft_momentum: Any
    root_failures: Array
    skipped_blocks: Array


def _x64_enabled() -> bool:
    return jnp.zeros((), jnp.float64).dtype == jnp.float64


def factor_dtype(config: ShampooConfig) -> Any:
    if config.factor_dtype == "float64":
        if not _x64_enabled():
            raise ValueError(
                "factor_dtype = 'float64' needs 64-bit JAX: call "
                "jax.config.update('jax_enable_x64', True) or use the "
                "`with jax.enable_x64(True):` context; allowed otherwise: 'float32'."
            )
        return jnp.float64
    return jnp.float32


def elementwise_dtype(leaf_dtype: Any) -> Any:
    """Dtype of the elementwise state and arithmetic: at least float32 (bf16 params)."""
    return jnp.promote_types(leaf_dtype, jnp.float32)


def _shapes(leaves: list[Array]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(d) for d in x.shape) for x in leaves)


def _init_group(grp: B.GroupLayout, config: ShampooConfig, fdt: Any) -> BlockGroupState:
    nb = grp.size
    from_eps = config.statistics.initial_value == "epsilon_identity"
    init_eps = config.epsilon.value if from_eps else 0.0
    factors, roots = [], []
    for k in grp.preconditioned_dims:
        eye = jnp.broadcast_to(jnp.eye(grp.shape[k], dtype=fdt), (nb, grp.shape[k], grp.shape[k]))
        factors.append(jnp.asarray(init_eps, fdt) * eye)
        roots.append(jnp.array(eye))  # identity before the first root (eq. 13)
    ec = config.eigenvalue_correction is not None

    def zeros_i() -> Array:  # a fresh buffer per field, so the state can be donated
        return jnp.zeros((nb,), jnp.int32)

    return BlockGroupState(
        factors=tuple(factors),
        roots=tuple(roots),
        statistics_updates=zeros_i(),
        consecutive_failures=zeros_i(),
        corrected_moment=jnp.zeros((nb, *grp.shape), fdt) if ec else None,
        corrected_updates=zeros_i() if ec else None,
    )


def shampoo(
    config: ShampooConfig,
    learning_rate: float | optax.Schedule | None = None,
    *,
    sharding: ShardingConfig | None = None,
) -> optax.GradientTransformation:
    """Shampoo (docs/spec.md, eqs. 1-21) as an optax transformation.

    ``learning_rate`` overrides ``config.learning_rate``; a schedule is called
    with the number of steps taken so far (0 at the first step, optax's
    convention). The returned updates are *added* to the parameters
    (``optax.apply_updates``): they already carry the minus sign and the
    learning rate. ``update`` needs ``params`` when weight decay is on.

    Failure policy inside ``jit`` (nothing can raise on a traced value): a
    block with a non-finite gradient is skipped (eq. 3) under both
    ``"skip_block"`` and ``"raise"``, and counted in
    ``state.skipped_blocks``; failed roots keep the previous root and are
    counted in ``state.root_failures`` and per block in
    ``consecutive_failures``. :func:`check_state` raises, on the host, the
    errors the reference raises (``"raise"``,
    ``max_consecutive_root_failures``).

    ``sharding`` (a :class:`shampoo_jax.ShardingConfig`) shards the block
    state over a mesh axis and has each device compute the statistics, roots
    and preconditioned blocks of its shard (:mod:`shampoo_jax.sharded`);
    the numerics are those of the single-device transformation, with no
    step of lag. None (default): one device.
    """
    if sharding is not None and not isinstance(sharding, ShardingConfig):
        raise ValueError(
            f"sharding = {sharding!r} is invalid: allowed None or a shampoo_jax.ShardingConfig."
        )
    lr = config.learning_rate if learning_rate is None else learning_rate
    sched = config.schedule
    graft_cfg = config.grafting
    filt = config.gradient_filter
    mom = config.momentum
    wd = config.weight_decay

    def init(params: Any) -> ShampooState:
        fdt = factor_dtype(config)
        leaves = jax.tree.leaves(params)
        layout = B.make_layout(_shapes(leaves), config)

        def zeros() -> Any:
            return jax.tree.map(lambda p: jnp.zeros(p.shape, elementwise_dtype(p.dtype)), params)

        uses_momentum = mom.momentum != 0.0
        state = ShampooState(
            count=jnp.zeros((), jnp.int32),
            groups=tuple(_init_group(g, config, fdt) for g in layout.groups),
            graft=zeros() if grafting.needs_state(graft_cfg) else None,
            filtered=zeros() if filt.beta1 != 0.0 else None,
            momentum=zeros() if uses_momentum else None,
            graft_momentum=zeros() if uses_momentum and mom.buffers == "separate" else None,
            root_failures=jnp.zeros((), jnp.int32),
            skipped_blocks=jnp.zeros((), jnp.int32),
        )
        if sharding is None:
            return state
        return shard_state(state, sharding, params)

    def update(
        updates: Any, state: ShampooState, params: Any | None = None
    ) -> tuple[Any, ShampooState]:
        fdt = factor_dtype(config)
        g_leaves, treedef = jax.tree.flatten(updates)
        layout = B.make_layout(_shapes(g_leaves), config)
        plans = [leaf.plan for leaf in layout.leaves]
        needs_w = wd.value != 0.0
        if needs_w and params is None:
            raise ValueError(
                f"params = None is invalid with weight_decay.value = {wd.value}: "
                "pass params to update()."
            )
        # Eq. (1): the 1-based step and the learning rate of this step.
        t = state.count + 1
        lr_t = lr(state.count) if callable(lr) else lr
        edts = [elementwise_dtype(g.dtype) for g in g_leaves]
        g = [x.astype(d).reshape(p.merged_shape)
             for x, d, p in zip(g_leaves, edts, plans, strict=True)]
        w: list[Array] = []
        if needs_w:
            w_leaves = treedef.flatten_up_to(params)
            w = [x.astype(d).reshape(p.merged_shape)
                 for x, d, p in zip(w_leaves, edts, plans, strict=True)]
        # Eq. (2): L2 weight decay enters the gradient.
        if wd.type == "l2" and needs_w:
            g = [gi + wd.value * wi for gi, wi in zip(g, w, strict=False)]

        # Eq. (3): per-block finiteness; bad blocks are zeroed and masked below.
        g_blocks = B.gather(g, layout)
        block_ok = [jnp.all(jnp.isfinite(x), axis=tuple(range(1, x.ndim))) for x in g_blocks]
        finite: list[Array] = []
        skipped = jnp.zeros((), jnp.int32)
        for i, leaf in enumerate(layout.leaves):
            if leaf.refs:
                finite.append(B.block_flags_to_leaf(block_ok, leaf))
            else:
                ok = jnp.all(jnp.isfinite(g[i]))
                finite.append(jnp.broadcast_to(ok, g[i].shape))
                skipped = skipped + (~ok).astype(jnp.int32)
        for ok in block_ok:
            skipped = skipped + jnp.sum(~ok).astype(jnp.int32)
        g = [jnp.where(f, x, 0.0) for f, x in zip(finite, g, strict=False)]
        g_blocks = [jnp.where(B.expand(ok, x), x, 0.0).astype(fdt)
                    for ok, x in zip(block_ok, g_blocks, strict=False)]

        def merged(tree: Any) -> list[Array]:
            leaves = treedef.flatten_up_to(tree)
            return [x.reshape(p.merged_shape) for x, p in zip(leaves, plans, strict=True)]

        # Eq. (14b): graft state.
        graft_state: list[Array] | None = None
        if state.graft is not None:
            graft_state = [
                jnp.where(f, grafting.update_state(v, x, graft_cfg), v)
                for f, v, x in zip(finite, merged(state.graft), g, strict=False)
            ]
        # Eq. (15): gradient filter.
        used = g
        new_filtered: list[Array] | None = None
        if state.filtered is not None:
            beta3 = filt.beta1 if filt.beta3 is None else filt.beta3
            old = merged(state.filtered)
            used = [beta3 * f_ + (1.0 - beta3) * x for f_, x in zip(old, g, strict=False)]
            if filt.bias_correction:
                used = [
                    u / (1.0 - beta3 * jnp.asarray(filt.beta1, u.dtype) ** (t - 1).astype(u.dtype))
                    for u in used
                ]
            new_filtered = [
                jnp.where(f, filt.beta1 * f_ + (1.0 - filt.beta1) * x, f_)
                for f, f_, x in zip(finite, old, g, strict=False)
            ]

        # Eq. (14c): graft direction.
        graft_dir = [
            grafting.direction(u, v, t, graft_cfg)
            for u, v in zip(
                used, graft_state if graft_state is not None else [None] * len(used), strict=True
            )
        ]
        use_shampoo = schedule.uses_preconditioner(t, sched)
        need_shampoo = use_shampoo is not False or state.graft_momentum is not None
        f_blocks = gd_blocks = None
        if need_shampoo:
            f_blocks = B.gather(used, layout, fdt)
            if config.grafting.type != "none" and config.grafting.norm_scope == "block":
                gd_blocks = B.gather(graft_dir, layout, fdt)

        # Eqs. (6)-(13), (16)-(17): the per-block work, on one device or on the
        # devices that own the blocks (sharded.py).
        inputs = BlockInputs(g_blocks, block_ok, f_blocks, gd_blocks)
        if sharding is None:
            groups, failures, stacks = block_step(state.groups, inputs, t, layout, config)
        else:
            groups, failures, stacks = sharded_block_step(
                block_step, state.groups, inputs, t, layout, config, sharding
            )
        # Eq. (18): reassemble the Shampoo direction.
        shampoo_dir = (
            _assemble_direction(stacks, layout, graft_dir, config) if stacks is not None else None
        )

        # Eqs. (19)-(21).
        lr_first = mom.learning_rate_placement == "before_momentum"

        def prepare(p: Array, wi: Array | None) -> Array:
            if lr_first:
                p = lr_t * p
            if wd.type == "direction" and needs_w:
                p = p + wd.value * wi  # eq. (19)
            return p

        def select(a: Array, b: Array) -> Array:
            if use_shampoo is True:
                return a
            if use_shampoo is False:
                return b
            return jnp.where(use_shampoo, a, b)

        new_mom = list(merged(state.momentum)) if state.momentum is not None else None
        new_gmom = list(merged(state.graft_momentum)) if state.graft_momentum is not None else None
        out = []
        mu, damp = mom.momentum, 1.0 - mom.dampening
        for i in range(len(g)):
            wi = w[i] if needs_w else None
            gd = graft_dir[i]
            sd = shampoo_dir[i] if shampoo_dir is not None else None
            chosen = select(sd, gd) if sd is not None else gd
            p = prepare(chosen, wi)
            if new_mom is None:
                step = p
            else:
                f = finite[i]
                if new_gmom is None:
                    new_mom[i] = jnp.where(f, mu * new_mom[i] + damp * p, new_mom[i])
                    m = new_mom[i]
                else:
                    assert sd is not None
                    new_mom[i] = jnp.where(f, mu * new_mom[i] + damp * prepare(sd, wi), new_mom[i])
                    new_gmom[i] = jnp.where(
                        f, mu * new_gmom[i] + damp * prepare(gd, wi), new_gmom[i]
                    )
                    m = select(new_mom[i], new_gmom[i])
                step = damp * p + mu * m if mom.nesterov else m
            u = -step if lr_first else -lr_t * step
            if wd.type == "update" and needs_w:
                u = u - lr_t * wd.value * wi  # eq. (21)
            u = jnp.where(finite[i], u, 0.0)
            out.append(u.reshape(g_leaves[i].shape).astype(g_leaves[i].dtype))

        def unmerged(xs: list[Array] | None, like: Any) -> Any:
            if xs is None:
                return None
            like_leaves = treedef.flatten_up_to(like)
            return treedef.unflatten(
                [x.reshape(ref.shape) for x, ref in zip(xs, like_leaves, strict=True)]
            )

        new_state = ShampooState(
            count=t,
            groups=groups,
            graft=unmerged(graft_state, state.graft),
            filtered=unmerged(new_filtered, state.filtered),
            momentum=unmerged(new_mom, state.momentum),
            graft_momentum=unmerged(new_gmom, state.graft_momentum),
            root_failures=state.root_failures + failures,
            skipped_blocks=state.skipped_blocks + skipped,
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init, update)


# ------------------------------------------------------ the block work
class BlockInputs(NamedTuple):
    """Per group, stacks ``[nb, *block_shape]`` (``[nb]`` for flags) in the factor dtype.

    ``grads``: the masked gradient blocks (eq. 6); ``ok``: finite-gradient
    flags (eq. 3); ``filtered``: the blocks of the (filtered) gradient to
    precondition (eq. 16), None when the Shampoo direction is not needed;
    ``graft``: the graft direction's blocks for ``norm_scope = "block"``
    (eq. 18), else None.
    """

    grads: list[Array]
    ok: list[Array]
    filtered: list[Array] | None
    graft: list[Array] | None


def block_step(
    groups: tuple[BlockGroupState, ...],
    inputs: BlockInputs,
    t: Array,
    layout: B.Layout,
    config: ShampooConfig,
) -> tuple[tuple[BlockGroupState, ...], Array, list[Array] | None]:
    """Everything that needs the block state: ``(groups, failed roots, preconditioned stacks)``.

    Statistics (eq. 6), roots (eqs. 7, 9-13), the corrected moment (eq. 17)
    and the preconditioned, block-rescaled stacks (eqs. 16-18). Every
    operation is per block, so the same function runs on any slice of the
    stacks: the sharded transformation calls it on each device's shard.
    """
    groups = _update_statistics(groups, layout, inputs.grads, inputs.ok, t, config)
    groups, failures = _refresh_roots(groups, layout, inputs.ok, t, config)
    if config.eigenvalue_correction is not None:
        groups = _update_corrected_moment(groups, layout, inputs.grads, inputs.ok, config)
    stacks = None
    if inputs.filtered is not None:
        stacks = _precondition_blocks(groups, layout, inputs.filtered, inputs.graft, config)
    return groups, failures, stacks


# --------------------------------------------------------------- eq. (6)
def _update_statistics(
    groups: tuple[BlockGroupState, ...],
    layout: B.Layout,
    g_blocks: list[Array],
    block_ok: list[Array],
    t: Array,
    config: ShampooConfig,
) -> tuple[BlockGroupState, ...]:
    """Eq. (6) on statistics steps, for blocks with a finite gradient."""
    stats = config.statistics
    weight = 1.0 if (stats.beta2 == 1.0 or stats.ema_weight == "one") else 1.0 - stats.beta2
    on = schedule.is_statistics_step(t, config.schedule)

    def run(groups: tuple[BlockGroupState, ...]) -> tuple[BlockGroupState, ...]:
        new = []
        for grp, gs, gb, ok in zip(layout.groups, groups, g_blocks, block_ok, strict=False):
            factors = []
            for k, lk in zip(grp.preconditioned_dims, gs.factors, strict=False):
                decayed = lk if stats.beta2 == 1.0 else stats.beta2 * lk
                updated = decayed + weight * B.factor_contraction(gb, k)
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
    return lax.cond(on, run, lambda gs: gs, groups)


# ------------------------------------------------------- eqs. (7), (9)-(13)
def _refresh_roots(
    groups: tuple[BlockGroupState, ...],
    layout: B.Layout,
    block_ok: list[Array],
    t: Array,
    config: ShampooConfig,
) -> tuple[tuple[BlockGroupState, ...], Array]:
    """On root steps (eq. 8), recompute every root; ``lax.cond`` so other steps pay nothing.

    A block skipped this step (eq. 3) keeps its roots and failure count. A
    failed root (eq. 13) keeps the previous one; the returned count adds up
    failed factors, and a block's ``consecutive_failures`` counts its root
    steps with any failure in a row.
    """
    stats = config.statistics
    on = schedule.is_root_step(t, config.schedule)
    zero = jnp.zeros((), jnp.int32)
    if on is False or not any(grp.preconditioned_dims for grp in layout.groups):
        return groups, zero

    def run(operand: tuple[tuple[BlockGroupState, ...], list[Array]]) -> tuple[Any, Array]:
        groups, block_ok = operand
        # Eq. (7): bias-corrected factors; then batch every factor of one size
        # and root, from every group and dim, into one decomposition.
        batches: dict[tuple[int, float], list[tuple[int, int, Array]]] = {}
        wanted: dict[tuple[int, float], list[Array]] = {}
        for gi, (grp, gs) in enumerate(zip(layout.groups, groups, strict=False)):
            n = gs.statistics_updates
            for i, (k, lk) in enumerate(zip(grp.preconditioned_dims, gs.factors, strict=False)):
                a = lk
                if stats.bias_correction and stats.beta2 < 1.0:
                    beta2 = jnp.asarray(stats.beta2, lk.dtype)
                    bc = jnp.where(n > 0, 1.0 - beta2 ** n.astype(lk.dtype), 1.0)
                    a = lk / bc[:, None, None]
                batches.setdefault((grp.shape[k], grp.roots[k]), []).append((gi, i, a))
                wanted.setdefault((grp.shape[k], grp.roots[k]), []).append(block_ok[gi])
        results: dict[tuple[int, int], tuple[Array, Array]] = {}
        token: Array | None = None
        for key, items in batches.items():
            root = key[1]
            a = jnp.concatenate([a for _, _, a in items])
            # Blocks masked this step (eq. 3; padding when sharded) keep their
            # roots below whatever comes out: not decomposed where skippable.
            active = jnp.concatenate(wanted[key])
            if token is not None:
                # One batched decomposition at a time: jaxlib's CPU LAPACK kernels
                # split a batch over the thread pool that also runs independent
                # ops and block waiting for it; two such calls at once can occupy
                # every thread of a small pool and deadlock (jaxlib 0.10.2, 2
                # cores). The barrier only orders them; it changes no value.
                token, a = lax.optimization_barrier((token, a))
            x, good = compute_root(a, root, config, active)
            token = x
            offset = 0
            for gi, i, a in items:
                nb = a.shape[0]
                results[(gi, i)] = (x[offset:offset + nb], good[offset:offset + nb])
                offset += nb
        # Eq. (13): keep the previous root where the new one failed.
        new, failures = [], []
        for gi, (gs, ok) in enumerate(zip(groups, block_ok, strict=False)):
            roots = []
            any_failed = jnp.zeros(ok.shape, bool)
            failed_factors = jnp.zeros(ok.shape, jnp.int32)
            for i, xk in enumerate(gs.roots):
                x, good = results[(gi, i)]
                failed = ok & ~good
                roots.append(jnp.where((ok & good)[:, None, None], x, xk))
                any_failed = any_failed | failed
                failed_factors = failed_factors + failed.astype(jnp.int32)
            consecutive = jnp.where(
                ok, jnp.where(any_failed, gs.consecutive_failures + 1, 0), gs.consecutive_failures
            )
            new.append(gs._replace(roots=tuple(roots), consecutive_failures=consecutive))
            failures.append(failed_factors)
        return tuple(new), failures

    def keep(operand: tuple[tuple[BlockGroupState, ...], list[Array]]) -> tuple[Any, list[Array]]:
        # Per-block zeros (not one scalar): under shard_map both branches then
        # vary over the mesh axis alike.
        return operand[0], [jnp.zeros_like(ok, jnp.int32) for ok in operand[1]]

    if on is True:
        groups, failed = run((groups, block_ok))
    else:
        groups, failed = lax.cond(on, run, keep, (groups, block_ok))
    return groups, sum((jnp.sum(f) for f in failed), zero)


# ------------------------------------------------------------- eq. (17)
def _rotate(x: Array, grp: B.GroupLayout, bases: tuple[Array, ...], transpose: bool) -> Array:
    for k, q in zip(grp.preconditioned_dims, bases, strict=False):
        x = B.mode_product(x, q, k, transpose=transpose)
    return x


def _update_corrected_moment(
    groups: tuple[BlockGroupState, ...],
    layout: B.Layout,
    g_blocks: list[Array],
    block_ok: list[Array],
    config: ShampooConfig,
) -> tuple[BlockGroupState, ...]:
    """Eq. (17): ``D <- beta2 D + (1 - beta2) (G x_k Q_k^T)^2`` in the refreshed basis."""
    ec = config.eigenvalue_correction
    assert ec is not None
    new = []
    for grp, gs, gb, ok in zip(layout.groups, groups, g_blocks, block_ok, strict=False):
        rotated = _rotate(gb, grp, gs.roots, transpose=True)
        d = gs.corrected_moment
        assert d is not None and gs.corrected_updates is not None
        upd = d + rotated**2 if ec.beta2 == 1.0 else ec.beta2 * d + (1.0 - ec.beta2) * rotated**2
        new.append(gs._replace(
            corrected_moment=jnp.where(B.expand(ok, d), upd, d),
            corrected_updates=gs.corrected_updates + ok.astype(jnp.int32),
        ))
    return tuple(new)


def _corrected_direction(gs: BlockGroupState, grp: B.GroupLayout, fb: Array,
                         config: ShampooConfig) -> Array:
    ec = config.eigenvalue_correction
    assert ec is not None and gs.corrected_moment is not None
    d = gs.corrected_moment
    if ec.bias_correction and ec.beta2 < 1.0:
        n = gs.corrected_updates
        bc = jnp.where(n > 0, 1.0 - jnp.asarray(ec.beta2, d.dtype) ** n.astype(d.dtype), 1.0)
        d = d / B.expand(bc.astype(d.dtype), d)
    rotated = _rotate(fb, grp, gs.roots, transpose=True)
    scaled = rotated / (d ** (1.0 / ec.root) + ec.epsilon)
    return _rotate(scaled, grp, gs.roots, transpose=False)


# ------------------------------------------------------- eqs. (16)-(18)
def _precondition_blocks(
    groups: tuple[BlockGroupState, ...],
    layout: B.Layout,
    f_blocks: list[Array],
    gd_blocks: list[Array] | None,
    config: ShampooConfig,
) -> list[Array]:
    """Eqs. (16)-(17) per block, and eq. (18)'s rescale to the graft norm of each block."""
    ne = config.grafting.norm_epsilon
    stacks = []
    for gi, (grp, gs, fb) in enumerate(zip(layout.groups, groups, f_blocks, strict=False)):
        if config.eigenvalue_correction is not None:
            pb = _corrected_direction(gs, grp, fb, config)
        else:
            pb = fb
            for k, xk in zip(grp.preconditioned_dims, gs.roots, strict=False):
                pb = B.mode_product(pb, xk, k)
        if gd_blocks is not None:
            scale = B.block_norms(gd_blocks[gi]) / (B.block_norms(pb) + ne)
            pb = pb * B.expand(scale, pb)
        stacks.append(pb)
    return stacks


def _assemble_direction(
    stacks: list[Array],
    layout: B.Layout,
    graft_dir: list[Array],
    config: ShampooConfig,
) -> list[Array]:
    """Eq. (18): reassemble each leaf from its blocks; parameter-scope graft rescale."""
    graft_on = config.grafting.type != "none"
    ne = config.grafting.norm_epsilon
    out = []
    for i, leaf in enumerate(layout.leaves):
        if not leaf.refs:
            out.append(graft_dir[i])  # not preconditioned: the graft direction (eq. 18)
            continue
        p = B.scatter(stacks, leaf).astype(graft_dir[i].dtype)
        if graft_on and config.grafting.norm_scope == "parameter":
            p = p * (grafting.norm(graft_dir[i]) / (grafting.norm(p) + ne))
        out.append(p)
    return out


# ------------------------------------------------------------ host side
def check_state(
    state: ShampooState, config: ShampooConfig, previous: ShampooState | None = None
) -> None:
    """Raise on the host what the reference raises inside its step.

    Call between jitted steps (it reads the counters, a device-to-host copy).
    ``"raise"`` policy: any block skipped since ``previous`` (or ever, without
    it) raises :class:`NonFiniteGradientError`; ``max_consecutive_root_failures``:
    a block over the limit raises :class:`RootFailureError`.
    """
    if config.failure.nonfinite_gradient == "raise":
        before = 0 if previous is None else int(previous.skipped_blocks)
        now = int(state.skipped_blocks)
        if now > before:
            raise NonFiniteGradientError(
                f"{now - before} block(s) had a non-finite gradient by step {int(state.count)}; "
                "failure.nonfinite_gradient='raise' (inside jit they were skipped)."
            )
    limit = config.failure.max_consecutive_root_failures
    if limit is not None:
        for i, gs in enumerate(state.groups):
            worst = int(jnp.max(gs.consecutive_failures)) if gs.consecutive_failures.size else 0
            if worst > limit:
                raise RootFailureError(
                    f"inverse roots of block group {i} failed on {worst} root steps in a row "
                    f"by step {int(state.count)} "
                    f"(failure.max_consecutive_root_failures={limit})."
                )


__all__ = [
    "BlockGroupState",
    "BlockInputs",
    "NonFiniteGradientError",
    "RootFailureError",
    "ShampooState",
    "block_step",
    "check_state",
    "shampoo",
]

_ = Callable
