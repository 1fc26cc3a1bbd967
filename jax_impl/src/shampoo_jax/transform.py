"""Shampoo as an ``optax.GradientTransformation``, in the order of docs/spec.md.

``update`` reads as the algorithm's outline, eqs. (1)-(21), one named phase
after another:

1. :func:`shampoo_jax.elementwise.merged_inputs`: the count and learning
   rate (eq. 1), gradients and weights in their merged shapes, L2 decay (eq. 2);
2. :func:`shampoo_jax.refusal.refuse_blocks`: blocks with a non-finite gradient, or one that
   could overflow their state (``shampoo_spec.block_overflows``), are masked
   out of every state update (eq. 3);
   :func:`shampoo_jax.elementwise.statistics_gradient`: the gradient the
   statistics take (eq. 6c's G^, an averaged sum with
   ``frequent_directions.average_gradients``);
3. elementwise: the graft state (eq. 14b,
   :func:`shampoo_jax.grafting.update_states`; eq. 14e's Adafactor moments of
   the whole parameter: :func:`shampoo_jax.grafting.update_adafactor_moments`),
   :func:`shampoo_jax.elementwise.update_diagonal_state` (eq. 16b's V_D, by
   eq. 14b's rule), :func:`shampoo_jax.elementwise.filter_gradient` (eq. 15),
   the graft direction (eq. 14c, :func:`shampoo_jax.grafting.directions`);
4. :func:`_shampoo_directions`: with a diagonal preconditioner (eq. 16b)
   the blocks are eq. (14c)'s ``D(F~)`` with V_D and hold no factors; per
   block group, statistics (eq. 6),
   inverse roots under ``lax.cond`` (eqs. 7, 9-13), the eigenvalue-corrected
   moment (eq. 17) and the preconditioned blocks (eqs. 16-18; with spectral
   descent, eq. 16c, the orthogonalized blocks ``orth(F~_B)``), all in
   :func:`shampoo_jax.preconditioner.block_step` (on one device, or on each
   device's blocks via :mod:`shampoo_jax.sharded`); then each parameter's
   direction with the graft rescale (eq. 18);
5. :func:`shampoo_jax.elementwise.momentum_step`: direction decay, momentum,
   learning rate, update decay (eqs. 19-21); with iterate averaging (eq. 20d)
   in place of momentum, the base sequence Z's step and the update Delta
   (:mod:`shampoo_jax.averaging`).

Static structure (blocks, block groups, which options are on) is decided at
trace time from ``shampoo_spec`` (the config's derived rules:
``GraftingConfig.rescale_scope``, ``MomentumConfig.separate_buffers``,
``WeightDecayConfig.applies``, ...); step-dependent decisions are traced
booleans, so ``jax.jit`` compiles the update once per config and parameter
shapes. The state is :mod:`shampoo_jax.state`'s.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import Array

from shampoo_spec import (
    ShampooConfig,
    factor_limit,
    large_block_warnings,
)

from . import blocks as B
from . import elementwise, grafting, schedule
from .averaging import eval_coefficient, power_sum
from .checks import check_learning_rate, check_shapes, check_state
from .placement import ShardingConfig
from .preconditioner import BlockInputs, assemble_direction, block_step
from .refusal import Refused, refuse_blocks
from .sharded import shard_state, sharded_block_step
from .state import (
    BlockGroupState,
    ShampooState,
    block_dtype,
    elementwise_dtype,
    init_state,
    leaf_shapes,
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
    convention). ``weight_decay.scale_by_lr_ratio`` scales the direction
    decay by lr_t / lr_0 (eq. 19), lr_0 this ``learning_rate`` when a
    number, else ``config.learning_rate``. With ``schedule.precondition_frequency_growth`` the root
    period follows ``lr(count) / lr(0)`` (eq. 8b, in the schedule's dtype);
    a constant rate gives the ratio 1. The returned updates are *added* to the parameters
    (``optax.apply_updates``): they already carry the minus sign and the
    learning rate. ``update`` needs ``params`` when weight decay,
    iterate averaging or the Adafactor graft's parameter scale
    (``grafting.parameter_scale_floor``, eq. 14e) is on.

    Iterate averaging (``config.averaging``, eq. 20d): the parameters are
    the training sequence y and the updates are eq. (20d)'s Delta; the state
    keeps the base sequence Z (and Schedule-Free's sum of ``lr_t^p``, with
    ``lr_t`` this step's rate, a schedule's included). Evaluate at
    :func:`shampoo_jax.averaged_params` ``(state, params)``, the averaged
    sequence x, and keep training from ``params``.

    ``config`` must be a ``ShampooConfig`` and ``learning_rate`` a finite
    number >= 0 or a callable (else ``ValueError``). ``init`` warns for
    blocks with a dim above ``shampoo_spec.LARGE_BLOCK_DIM``; ``update``
    refuses gradients whose shapes differ from the parameters' (ValueError
    naming the path, at trace time).

    Failure policy inside ``jit`` (nothing can raise on a traced value): a
    block with a non-finite gradient, or one whose state could overflow
    (eq. 3, ``shampoo_spec.block_overflows``), is skipped under both
    ``"skip_block"`` and ``"raise"``, and counted in
    ``state.skipped_blocks``; failed inverse roots keep the previous ones and
    are counted in ``state.root_failures`` and per block in
    ``consecutive_failures``. :func:`check_state` raises, on the host, the
    errors the reference raises (``"raise"``,
    ``max_consecutive_root_failures``).

    ``sharding`` (a :class:`shampoo_jax.ShardingConfig`) shards the block
    state over a mesh axis and has each device compute the statistics,
    inverse roots and preconditioned blocks of its shard
    (:mod:`shampoo_jax.sharded`); the numerics are those of the
    single-device transformation, with no step of lag. None (default): one
    device.
    """
    if not isinstance(config, ShampooConfig):
        raise ValueError(
            f"config = {config!r} is invalid: allowed a shampoo_spec.ShampooConfig."
        )
    if learning_rate is not None:
        check_learning_rate(learning_rate)
    if sharding is not None and not isinstance(sharding, ShardingConfig):
        raise ValueError(
            f"sharding = {sharding!r} is invalid: allowed None or a shampoo_jax.ShardingConfig."
        )
    lr = config.learning_rate if learning_rate is None else learning_rate
    if isinstance(lr, int) and not isinstance(lr, bool):
        # A Python int enters the traced arithmetic as a weak int32 (int64 under
        # x64): one beyond that range (2**62, valid for the config) would raise
        # OverflowError inside jit. As a float it is exact up to 2**53 and
        # otherwise rounded as any float learning rate.
        lr = float(lr)
    # Eq. (19)'s lr_0 (scale_by_lr_ratio): the rate given, the config's for a schedule.
    lr_0 = config.learning_rate if callable(lr) else lr
    wd = config.weight_decay
    # Any decay (eqs. 2, 19, 21) needs the weights W, and so does eq. (20d)'s Z - W.
    needs_w = wd.applies(wd.type) or config.averaging is not None
    # Eq. (14e) scales the Adafactor graft by max(rms(W), s).
    scales_by_w = config.grafting.factored and config.grafting.parameter_scale_floor is not None

    def init(params: Any) -> ShampooState:
        keyed, _ = jax.tree_util.tree_flatten_with_path(params)
        layout = B.make_layout(leaf_shapes([x for _, x in keyed]), config)
        for (path, _), leaf in zip(keyed, layout.leaves, strict=True):
            for message in large_block_warnings(jax.tree_util.keystr(path), leaf.plan):
                warnings.warn(message, stacklevel=2)
        state = init_state(params, config)
        if sharding is None:
            return state
        return shard_state(state, sharding, params)

    def update(
        updates: Any, state: ShampooState, params: Any | None = None
    ) -> tuple[Any, ShampooState]:
        keyed, treedef = jax.tree_util.tree_flatten_with_path(updates)
        g_leaves = [x for _, x in keyed]
        # The blocks' dtype: factor_dtype, or the leaves' own precision with
        # eqs. (16b), (16c), which keep no factors (factor_dtype has no effect).
        fdt = block_dtype(config, [elementwise_dtype(x.dtype) for x in g_leaves])
        check_shapes(keyed, state.info, params)
        layout = B.make_layout(leaf_shapes(g_leaves), config)
        tree = B.ParameterTree(treedef, [leaf.plan for leaf in layout.leaves])
        if (needs_w or scales_by_w) and params is None:
            why = ("averaging (eq. 20d needs W)" if config.averaging is not None
                   else f"weight_decay.value = {wd.value}" if wd.applies(wd.type)
                   else f"grafting.parameter_scale_floor = {config.grafting.parameter_scale_floor}"
                        " (eq. 14e scales the Adafactor graft by max(rms(W), s))")
            raise ValueError(f"params = None is invalid with {why}: pass params to update().")
        # Eq. (1): the 1-based step and the learning rate of this step.
        t = state.count + 1
        lr_t = lr(state.count) if callable(lr) else lr
        if isinstance(lr_t, (int, np.integer)):
            lr_t = float(lr_t)  # a Python int such as 2**62 overflows JAX's int32 arguments
        g, w = elementwise.merged_inputs(g_leaves, params, tree, config)
        # Eq. (3)'s m: the graft state V and the diagonal state V_D (eq. 16b) count.
        held = [tree.merged(x) for x in (state.graft, state.diagonal) if x is not None]
        # Eq. (14e)'s moments span their parameter: their max counts for all its blocks.
        moments = None if state.adafactor is None else tree.leaves(state.adafactor)
        masked = refuse_blocks(g, state, held, layout, fdt, sharding,
                               factor_limit(config.factor_storage_dtype),
                               None if moments is None else [grafting.moments_max(m)
                                                             for m in moments])
        # Eq. (6c): G^, the gradient blocks the statistics take, and the gradient sum S.
        observed, gradient_sum = elementwise.statistics_gradient(
            state.gradient_sum, masked, t, tree, layout, fdt, config)
        graft_state = grafting.update_states(state.graft, masked.grads, masked.finite, tree,
                                             config.grafting)
        new_moments = grafting.update_adafactor_moments(moments, masked.grads, masked.finite, t,
                                                        tree, config.grafting)
        diagonal_state = elementwise.update_diagonal_state(state.diagonal, masked, tree, config)
        used, new_filtered = elementwise.filter_gradient(
            state.filtered, masked, t, tree, config.gradient_filter
        )
        if new_moments is None:
            graft_dir = grafting.directions(used, graft_state, t, config.grafting)
        else:
            graft_dir = grafting.adafactor_directions(
                used, new_moments, params if scales_by_w else None, tree, config.grafting)
        use_shampoo = schedule.uses_preconditioner(t, config.schedule)
        groups, failures, shampoo_dir = _shampoo_directions(
            state, masked, observed, used, diagonal_state, graft_dir, use_shampoo, t, layout,
            fdt, config, sharding, _lr_ratio(lr, lr_t, config),
        )
        # Eq. (20d): S_t (Schedule-Free) includes this step's rate before mu_x is formed.
        av = config.averaging
        lr_power_sum = state.lr_power_sum
        if av is not None and av.type == "schedule_free":
            lr_power_sum = power_sum(state.lr_power_sum, lr_t, av)
        mu_x = None if av is None else eval_coefficient(lr_t, lr_power_sum, av)
        # Eq. (20b): int8 buffers are read back as floats, updated, then quantized.
        floats = elementwise.read_momentum(state, tree, g_leaves)
        out, new_mom, new_gmom, new_z, withheld = elementwise.momentum_step(
            shampoo_dir, graft_dir, w, masked.finite, floats, use_shampoo, lr_t, g_leaves,
            tree.leaves(params) if params is not None else None, tree, config, lr_0, mu_x,
        )
        new_mom_leaves, mom_scale = elementwise.write_momentum(
            tree, new_mom, floats.momentum, state.momentum_scale, config)
        new_gmom_leaves, gmom_scale = elementwise.write_momentum(
            tree, new_gmom, floats.graft_momentum, state.graft_momentum_scale, config)
        new_state = ShampooState(
            count=t,
            groups=groups,
            graft=tree.unmerged(graft_state, state.graft),
            filtered=tree.unmerged(new_filtered, state.filtered),
            momentum=new_mom_leaves,
            graft_momentum=new_gmom_leaves,
            root_failures=state.root_failures + failures,
            skipped_blocks=state.skipped_blocks + masked.skipped,
            skipped_per_parameter=(None if state.skipped_per_parameter is None
                                   else state.skipped_per_parameter + masked.per_parameter),
            info=state.info,
            withheld_updates=(None if state.withheld_updates is None
                              else state.withheld_updates + withheld),
            momentum_scale=mom_scale,
            graft_momentum_scale=gmom_scale,
            diagonal=tree.unmerged(diagonal_state, state.diagonal),
            averaged=tree.unmerged(new_z, state.averaged),
            lr_power_sum=lr_power_sum,
            gradient_sum=tree.unmerged(gradient_sum, state.gradient_sum),
            adafactor=(None if new_moments is None
                       else jax.tree.unflatten(treedef, new_moments)),
        )
        return jax.tree.unflatten(treedef, out), new_state

    return optax.GradientTransformation(init, update)


# ------------------------------------------------------------ eqs. (1)-(3)
def _lr_ratio(lr: Any, lr_t: Any, config: ShampooConfig) -> float | Array:
    """Eq. (8b)'s ``lr_t / lr_1``: with a schedule ``lr(count) / lr(0)`` (traced, in the
    schedule's dtype, IEEE: 0 / 0 is NaN), else 1.0 (static).

    Only with ``schedule.precondition_frequency_growth``; 1.0 otherwise (unused).
    ``lr(0)`` is called with the Python int 0, as Google's
    ``preconditioning_compute_steps_schedule`` calls it.
    """
    if config.schedule.precondition_frequency_growth is None or not callable(lr):
        return 1.0
    ratio: Array = jnp.asarray(lr_t) / jnp.asarray(lr(0))
    return ratio


# ----------------------------------------------------- eqs. (6)-(13), (16)-(18)
def _shampoo_directions(
    state: ShampooState,
    masked: Refused,
    observed: list[Array],
    used: list[Array],
    diagonal_state: list[Array] | None,
    graft_dir: list[Array],
    use_shampoo: schedule.Flag,
    t: Array,
    layout: B.Layout,
    fdt: Any,
    config: ShampooConfig,
    sharding: ShardingConfig | None,
    lr_ratio: float | Array,
) -> tuple[tuple[BlockGroupState, ...], Array, list[Array] | None]:
    """The block work and each leaf's Shampoo direction: ``(groups, failures, directions)``.

    Statistics (eq. 6, from ``observed``: the blocks of eq. 6c's G^), inverse
    roots (eqs. 7, 9-13) and the corrected moment (eq. 17) always; the
    preconditioned blocks (eqs. 16-18) when the Shampoo direction is used
    this step or feeds the separate Shampoo momentum buffer; the directions
    are None otherwise. On one device or on the devices that own the blocks
    (:mod:`shampoo_jax.sharded`).

    With a diagonal preconditioner (eq. 16b) the blocks fed to eq. (16) are
    ``D(F~)``, eq. (14c)'s direction of ``config.diagonal`` with its state
    V_D (``diagonal_state``, merged leaves); every root is then 0, so eq. (16)
    passes them through and eq. (18) rescales them as any Shampoo block.
    With spectral descent (eq. 16c) the blocks are the filtered gradient's,
    orthogonalized in :func:`shampoo_jax.preconditioner.precondition_blocks`.
    In both, ``fdt`` is the leaves' precision (:func:`shampoo_jax.state.block_dtype`).
    """
    need_shampoo = use_shampoo is not False or state.graft_momentum is not None
    f_blocks = gd_blocks = None
    if need_shampoo:
        if config.diagonal is not None:
            used = grafting.directions(used, diagonal_state, t, config.diagonal.as_graft())
        # With inverse_root_dtype (or eigenvectors_dtype) the blocks keep the
        # filtered gradient's dtype here: precondition_blocks rounds them to the
        # roots' dtype straight from it (eqs. 16, 17a), never through the factor
        # dtype (two roundings).
        ec = config.eigenvalue_correction
        stored = config.rounds_inverse_roots or (ec is not None and
                                                 ec.eigenvectors_dtype is not None)
        if used is masked.grads and not stored:
            # The gradient itself (no filter, no diagonal): eq. (3)'s masked
            # blocks are already these stacks (the same values, no second copy).
            f_blocks = masked.blocks
        else:
            f_blocks = B.gather(used, layout, None if stored else fdt)
        gd_blocks = grafting.graft_blocks(graft_dir, layout, fdt, config.grafting)
    inputs = BlockInputs(observed, masked.block_ok, f_blocks, gd_blocks)
    if sharding is None:
        groups, failures, stacks = block_step(state.groups, inputs, t, layout, config, lr_ratio)
    else:
        groups, failures, stacks = sharded_block_step(
            state.groups, inputs, t, layout, config, sharding, lr_ratio
        )
    # Eq. (18): reassemble the Shampoo direction.
    shampoo_dir = (
        assemble_direction(stacks, layout, graft_dir, config) if stacks is not None else None
    )
    return groups, failures, shampoo_dir


__all__ = ["check_state", "shampoo"]
