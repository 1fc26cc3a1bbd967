"""Shampoo as an ``optax.GradientTransformation``, in the order of docs/spec.md.

``update`` reads as the algorithm's outline, eqs. (1)-(21), one named phase
after another:

1. :func:`_merged_inputs`: the count and learning rate (eq. 1), gradients
   and weights in their merged shapes, L2 decay (eq. 2);
2. :func:`shampoo_jax.refusal.refuse_blocks`: blocks with a non-finite gradient, or one that
   could overflow their state (``shampoo_spec.block_overflows``), are masked
   out of every state update (eq. 3); :func:`_statistics_gradient`: the
   gradient the statistics take (eq. 6c's G^, an averaged sum with
   ``frequent_directions.average_gradients``);
3. elementwise: :func:`_update_graft_state` (eq. 14b; eq. 14e's Adafactor
   moments of the whole parameter: :func:`_update_adafactor`),
   :func:`_update_diagonal_state` (eq. 16b's V_D, by eq. 14b's rule),
   :func:`_filter_gradient` (eq. 15), :func:`_graft_directions` (eq. 14c);
4. :func:`_shampoo_directions`: with a diagonal preconditioner (eq. 16b)
   the blocks are eq. (14c)'s ``D(F~)`` with V_D and hold no factors; per
   block group, statistics (eq. 6),
   inverse roots under ``lax.cond`` (eqs. 7, 9-13), the eigenvalue-corrected
   moment (eq. 17) and the preconditioned blocks (eqs. 16-18; with spectral
   descent, eq. 16c, the orthogonalized blocks ``orth(F~_B)``), all in
   :func:`shampoo_jax.preconditioner.block_step` (on one device, or on each
   device's blocks via :mod:`shampoo_jax.sharded`); then each parameter's
   direction with the graft rescale (eq. 18);
5. :func:`_momentum_step`: direction decay, momentum, learning rate, update
   decay (eqs. 19-21); with iterate averaging (eq. 20d) in place of
   momentum, the base sequence Z's step and the update Delta
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
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import Array

from shampoo_spec import (
    GradientFilterConfig,
    GraftingConfig,
    ParameterPlan,
    ShampooConfig,
    factor_limit,
    large_block_warnings,
)

from . import blocks as B
from . import grafting, quantization, schedule
from .averaging import averaged_step, eval_coefficient, power_sum
from .checks import check_learning_rate, check_shapes, check_state
from .preconditioner import BlockInputs, assemble_direction, block_step
from .refusal import Refused, masked_blocks, refuse_blocks
from .sharded import ShardingConfig, shard_state, sharded_block_step
from .state import (
    BlockGroupState,
    ShampooState,
    block_dtype,
    elementwise_dtype,
    init_state,
    leaf_shapes,
    scale_dtype,
)


class _Tree:
    """The parameters' tree structure and plans: leaves <-> merged-shape lists."""

    def __init__(self, treedef: Any, plans: Sequence[ParameterPlan]) -> None:
        # Any: jaxlib's PyTreeDef has no type stubs (mypy sees an unresolved type).
        self.treedef = treedef
        self.plans = plans

    def leaves(self, tree: Any) -> list[Any]:
        """The leaves of ``tree``, which must have the updates' structure."""
        leaves: list[Any] = self.treedef.flatten_up_to(tree)
        return leaves

    def merged(self, tree: Any) -> list[Array]:
        """The leaves of ``tree`` reshaped to their plans' merged shapes (eq. 4)."""
        return [x.reshape(p.merged_shape)
                for x, p in zip(self.leaves(tree), self.plans, strict=True)]

    def unmerged(self, xs: list[Array] | None, like: Any) -> Any:
        """Merged-shape arrays back into the structure and shapes of ``like`` (None: None)."""
        if xs is None:
            return None
        return jax.tree.unflatten(
            self.treedef,
            [x.reshape(ref.shape) for x, ref in zip(xs, self.leaves(like), strict=True)],
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
        tree = _Tree(treedef, [leaf.plan for leaf in layout.leaves])
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
        g, w = _merged_inputs(g_leaves, params, tree, config)
        # Eq. (3)'s m: the graft state V and the diagonal state V_D (eq. 16b) count.
        held = [tree.merged(x) for x in (state.graft, state.diagonal) if x is not None]
        # Eq. (14e)'s moments span their parameter: their max counts for all its blocks.
        moments = None if state.adafactor is None else tree.leaves(state.adafactor)
        masked = refuse_blocks(g, state, held, layout, fdt, sharding,
                               factor_limit(config.factor_storage_dtype),
                               None if moments is None else [grafting.moments_max(m)
                                                             for m in moments])
        # Eq. (6c): G^, the gradient blocks the statistics take, and the gradient sum S.
        observed, gradient_sum = _statistics_gradient(
            state.gradient_sum, masked, t, tree, layout, fdt, config)
        graft_state = _update_graft_state(state.graft, masked, tree, config.grafting)
        new_moments = _update_adafactor(moments, masked, t, tree, config.grafting)
        diagonal_state = _update_diagonal_state(state.diagonal, masked, tree, config)
        used, new_filtered = _filter_gradient(
            state.filtered, masked, t, tree, config.gradient_filter
        )
        if new_moments is None:
            graft_dir = _graft_directions(used, graft_state, t, config.grafting)
        else:
            graft_dir = _adafactor_directions(
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
        floats = _read_momentum(state, tree, g_leaves)
        out, new_mom, new_gmom, new_z, withheld = _momentum_step(
            shampoo_dir, graft_dir, w, masked.finite, floats, use_shampoo, lr_t, g_leaves,
            tree.leaves(params) if params is not None else None, tree, config, lr_0, mu_x,
        )
        new_mom_leaves, mom_scale = _write_momentum(
            tree, new_mom, floats.momentum, state.momentum_scale, config)
        new_gmom_leaves, gmom_scale = _write_momentum(
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


def _merged_inputs(
    g_leaves: list[Array], params: Any | None, tree: _Tree, config: ShampooConfig
) -> tuple[list[Array], list[Array]]:
    """Gradients and (when a decay needs them) weights, merged and in the elementwise dtype.

    Eq. (2): L2 weight decay enters the gradient. ``w`` is empty when no
    decay and no iterate averaging (eq. 20d) is on.
    """
    wd = config.weight_decay
    edts = [elementwise_dtype(g.dtype) for g in g_leaves]
    g = [x.astype(d).reshape(p.merged_shape)
         for x, d, p in zip(g_leaves, edts, tree.plans, strict=True)]
    w: list[Array] = []
    if wd.applies(wd.type) or config.averaging is not None:  # eq. (20d) also needs W
        w = [x.astype(d).reshape(p.merged_shape)
             for x, d, p in zip(tree.leaves(params), edts, tree.plans, strict=True)]
    if wd.applies("l2"):
        g = [gi + wd.value * wi for gi, wi in zip(g, w, strict=False)]
    return g, w


# ------------------------------------------------------------- eq. (6c)
def _statistics_gradient(
    gradient_sum: Any, masked: Refused, t: Array, tree: _Tree, layout: B.Layout, fdt: Any,
    config: ShampooConfig,
) -> tuple[list[Array], list[Array] | None]:
    """Eq. (6c): ``(the blocks of G^ for eqs. 6 and 6c, the new gradient sum S)``.

    Without ``frequent_directions.average_gradients`` (no S: ``gradient_sum``
    None), G^ = G, eq. (3)'s masked blocks. With it, ``S <- S + G`` (refused
    entries add 0: ``masked.grads`` is zero there), ``G^ = S / s`` (s =
    ``statistics_frequency``) in every block, sketched factor or not, and S
    is emptied after a statistics step.
    """
    if gradient_sum is None:
        return masked.blocks, None
    summed = [(old + g).astype(old.dtype)
              for old, g in zip(tree.merged(gradient_sum), masked.grads, strict=True)]
    frequency = config.schedule.statistics_frequency
    observed = masked_blocks(B.gather([x / frequency for x in summed], layout),
                             masked.block_ok, fdt)
    on = schedule.is_statistics_step(t, config.schedule)
    if on is False:
        return observed, summed
    return observed, [jnp.where(on, jnp.zeros_like(x), x) for x in summed]


# ------------------------------------------------------- eqs. (14), (15)
def _update_graft_state(
    graft_state: Any, masked: Refused, tree: _Tree, graft: GraftingConfig
) -> list[Array] | None:
    """Eq. (14b): the graft state V, left unchanged where the gradient was non-finite."""
    if graft_state is None:
        return None
    return [
        jnp.where(f, grafting.update_state(v, x, graft), v)
        for f, v, x in zip(masked.finite, tree.merged(graft_state), masked.grads, strict=False)
    ]


def _update_adafactor(
    moments: list[grafting.FactoredMoments] | None, masked: Refused, t: Array, tree: _Tree,
    graft: GraftingConfig,
) -> list[grafting.FactoredMoments] | None:
    """Eq. (14e): each parameter's R, C (or V) at step t, from G in the parameter's own shape.

    The moments are means over the whole parameter, so a step in which eq. (3)
    refuses any block of the parameter leaves them unchanged (the refused
    gradient entries are zero in ``masked.grads``, so the unused branch stays
    finite). None without the Adafactor graft.
    """
    if moments is None:
        return None
    beta = grafting.adafactor_decay(t, graft.decay_exponent)
    out = []
    for m, f, x, plan in zip(moments, masked.finite, masked.grads, tree.plans, strict=True):
        new = grafting.adafactor_update(m, x.reshape(plan.shape), beta, graft)
        admitted = jnp.all(f)
        out.append(jax.tree.map(lambda a, b, ok=admitted: jnp.where(ok, a, b), new, m))
    return out


def _adafactor_directions(
    used: list[Array], moments: list[grafting.FactoredMoments], params: Any | None,
    tree: _Tree, graft: GraftingConfig,
) -> list[Array]:
    """Eq. (14e): ``graft(X)`` of every leaf from its new moments (merged shape, as eq. 14c's).

    X (the filtered gradient, eq. 15) is taken in the parameter's own shape;
    ``params`` (W before the step) only with ``parameter_scale_floor``.
    """
    p_leaves = tree.leaves(params) if params is not None else [None] * len(used)
    return [
        grafting.adafactor_direction(u.reshape(plan.shape), m, p, graft).reshape(u.shape)
        for u, m, p, plan in zip(used, moments, p_leaves, tree.plans, strict=True)
    ]


def _update_diagonal_state(
    diagonal_state: Any, masked: Refused, tree: _Tree, config: ShampooConfig
) -> list[Array] | None:
    """Eq. (16b): the diagonal preconditioner's state V_D, by eq. (14b)'s rule.

    Updated every step (not only on statistics steps: it is an elementwise
    method's second moment, as the graft state V) with ``diagonal.as_graft()``,
    from the same gradient as V and with the same mask. None without a state
    (no ``config.diagonal``, or its sgd and sign types).
    """
    if diagonal_state is None:
        return None
    assert config.diagonal is not None  # the state exists only with a diagonal
    return _update_graft_state(diagonal_state, masked, tree, config.diagonal.as_graft())


def _filter_gradient(
    filtered: Any, masked: Refused, t: Array, tree: _Tree, filt: GradientFilterConfig
) -> tuple[list[Array], list[Array] | None]:
    """Eq. (15): ``(the gradient the directions use, the new filter state F)``.

    The direction uses ``beta3 F_{t-1} + (1 - beta3) G_t``
    (``filt.direction_beta``), bias corrected on the traced step; the stored
    ``F_t`` uses beta1 and is left unchanged where the gradient was non-finite.
    """
    g = masked.grads
    if filtered is None:
        return g, None
    beta3 = filt.direction_beta
    old = tree.merged(filtered)
    used = [beta3 * f_ + (1.0 - beta3) * x for f_, x in zip(old, g, strict=False)]
    if filt.bias_correction:
        # GradientFilterConfig.bias_correction_factor(t) on the traced step.
        used = [
            u / (1.0 - beta3 * jnp.asarray(filt.beta1, u.dtype) ** (t - 1).astype(u.dtype))
            for u in used
        ]
    new_filtered = [
        jnp.where(f, filt.beta1 * f_ + (1.0 - filt.beta1) * x, f_)
        for f, f_, x in zip(masked.finite, old, g, strict=False)
    ]
    return used, new_filtered


def _graft_directions(
    used: list[Array], graft_state: list[Array] | None, t: Array, graft: GraftingConfig
) -> list[Array]:
    """Eq. (14c): the graft direction of every leaf."""
    states: Sequence[Array | None] = graft_state if graft_state is not None else [None] * len(used)
    return [grafting.direction(u, v, t, graft) for u, v in zip(used, states, strict=True)]


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
            used = _graft_directions(used, diagonal_state, t, config.diagonal.as_graft())
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
        if config.grafting.rescale_scope == "block":
            gd_blocks = B.gather(graft_dir, layout, fdt)
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


# ----------------------------------------------------------- eqs. (19)-(21)
def _read_momentum(state: ShampooState, tree: _Tree, g_leaves: list[Array]) -> ShampooState:
    """``state`` with its momentum buffers as floats (eq. 20b's ``fl_d(q s)`` where int8)."""
    dtypes = [elementwise_dtype(x.dtype) for x in g_leaves]

    def floats(buffers: Any, scales: Any) -> Any:
        if buffers is None or scales is None:
            return buffers
        return jax.tree.unflatten(
            tree.treedef, quantization.read(tree.leaves(buffers), scales, dtypes))

    return state._replace(
        momentum=floats(state.momentum, state.momentum_scale),
        graft_momentum=floats(state.graft_momentum, state.graft_momentum_scale),
    )


def _write_momentum(
    tree: _Tree, new: list[Array] | None, like: Any, scales: Any, config: ShampooConfig
) -> tuple[Any, Any]:
    """The new buffers in the parameters' structure, int8 and new scales where quantized."""
    if new is None:
        return None, scales
    unmerged = tree.unmerged(new, like)
    if scales is None:
        return unmerged, None
    leaves, new_scales = quantization.write(
        tree.leaves(unmerged), scales, scale_dtype(config))
    return jax.tree.unflatten(tree.treedef, leaves), new_scales


def _momentum_step(
    shampoo_dir: list[Array] | None,
    graft_dir: list[Array],
    w: list[Array],
    finite: list[Array],
    state: ShampooState,
    use_shampoo: schedule.Flag,
    lr_t: Any,
    g_leaves: list[Array],
    p_leaves: list[Array] | None,
    tree: _Tree,
    config: ShampooConfig,
    lr_0: float,
    mu_x: float | Array | None = None,
) -> tuple[list[Array], list[Array] | None, list[Array] | None, list[Array] | None, Array]:
    """Eqs. (19)-(22): ``(updates per leaf, new momentum, new graft momentum, new Z, withheld)``.

    The direction (Shampoo's or the graft's, eq. 18's choice) is scaled by
    the learning rate first when ``momentum.lr_before_momentum``, takes the
    direction decay (eq. 19; ``value * lr_t / lr_0`` with ``scale_by_lr_ratio``),
    then momentum (eq. 20; with separate buffers
    both directions are accumulated every step), then the learning rate and
    the update decay (eq. 21), rounded to ``update_dtype`` when set (eq. 21a).
    Refused entries (eq. 3) get a zero update.
    Eq. (22), the update guard: an entry whose new value or new momentum is
    non-finite gets a zero update and keeps its momentum. The new value is
    ``param + update`` in the parameter's dtype (as ``optax.apply_updates``
    computes it) when ``params`` were passed (``p_leaves``), else the update
    itself. ``withheld`` (int32): the number of parameters in which the guard
    held back an entry of an admitted block.

    Iterate averaging (eq. 20d, ``config.averaging``; no momentum, no update
    decay, ``mu_x`` its coefficient this step): the direction decay shrinks
    Z instead of entering P, and the update is
    :func:`shampoo_jax.averaging.averaged_step`'s Delta from ``d = -lr_t P``,
    rounded by eq. (21a); eq. (22) keeps W and Z where the new W or the new
    Z is non-finite, and Z is kept on refused entries (eq. 3). New Z: None
    without averaging.
    """
    mom, wd = config.momentum, config.weight_decay
    lr_first = mom.lr_before_momentum
    averaging = config.averaging is not None
    # Eq. (20d) moves the direction decay onto Z (averaged_step), out of P.
    decay_direction = wd.applies("direction") and not averaging
    decay_update = wd.applies("update")

    def prepare(p: Array, wi: Array | None) -> Array:
        if lr_first:
            p = lr_t * p
        if decay_direction:
            assert wi is not None
            p = p + wd.direction_value(lr_t, lr_0) * wi  # eq. (19)
        return p

    def select(a: Array, b: Array) -> Array:
        if use_shampoo is True:
            return a
        if use_shampoo is False:
            return b
        return jnp.where(use_shampoo, a, b)

    old_mom = list(tree.merged(state.momentum)) if state.momentum is not None else None
    old_gmom = (
        list(tree.merged(state.graft_momentum)) if state.graft_momentum is not None else None
    )
    new_mom = None if old_mom is None else list(old_mom)
    new_gmom = None if old_gmom is None else list(old_gmom)
    old_z = list(tree.merged(state.averaged)) if averaging else None
    new_z = None if old_z is None else list(old_z)
    out = []
    withheld = jnp.zeros((), jnp.int32)
    mu, damp = mom.momentum, mom.direction_weight
    for i in range(len(graft_dir)):
        wi = w[i] if w else None
        gd = graft_dir[i]
        sd = shampoo_dir[i] if shampoo_dir is not None else None
        chosen = select(sd, gd) if sd is not None else gd
        p = prepare(chosen, wi)
        f = finite[i]
        buffers = []
        if new_mom is None:
            step = p
        else:
            if new_gmom is None:
                new_mom[i] = jnp.where(f, mu * new_mom[i] + damp * p, new_mom[i])
                m = new_mom[i]
                buffers = [new_mom[i]]
            else:
                assert sd is not None
                new_mom[i] = jnp.where(f, mu * new_mom[i] + damp * prepare(sd, wi), new_mom[i])
                new_gmom[i] = jnp.where(
                    f, mu * new_gmom[i] + damp * prepare(gd, wi), new_gmom[i]
                )
                m = select(new_mom[i], new_gmom[i])
                buffers = [new_mom[i], new_gmom[i]]
            step = damp * p + mu * m if mom.nesterov else m
        u = -step if lr_first else -lr_t * step
        z_i = None
        if old_z is not None:  # eq. (20d): u is d = -lr_t P; the update becomes Delta
            assert wi is not None and mu_x is not None
            u, z_i = averaged_step(u, wi, old_z[i], mu_x, lr_t, lr_0, config)
        if decay_update:
            assert wi is not None
            u = u - lr_t * wd.value * wi  # eq. (21)
        dtype = g_leaves[i].dtype if p_leaves is None else p_leaves[i].dtype
        if config.update_dtype is not None:  # eq. (21a): the update rounded to update_dtype
            u = u.astype(jnp.dtype(config.update_dtype))
        u_out = u.astype(dtype)
        if p_leaves is None:
            keep = jnp.isfinite(u_out)
        else:
            keep = jnp.isfinite((p_leaves[i].reshape(u.shape) + u_out).astype(dtype))
        if z_i is not None:  # eq. (22): a non-finite new Z holds W back too
            keep = keep & jnp.isfinite(z_i)
        for b in buffers:
            keep = keep & jnp.isfinite(b)
            if mom.quantizes(len(tree.plans[i].shape)):  # eq. (20b) quantizes fl_d(M)
                keep = keep & jnp.isfinite(b.astype(scale_dtype(config)))
        if old_mom is not None and new_mom is not None:  # eq. (22): keep the old momentum
            new_mom[i] = _restore(keep, new_mom[i], old_mom[i])
        if old_gmom is not None and new_gmom is not None:
            new_gmom[i] = _restore(keep, new_gmom[i], old_gmom[i])
        if old_z is not None and new_z is not None and z_i is not None:
            # Eqs. (3), (22): Z keeps its old entries where W does.
            new_z[i] = _restore(f & keep, z_i, old_z[i])
        withheld = withheld + jnp.any(f & ~keep).astype(jnp.int32)
        u_out = jnp.where(f & keep, u_out, jnp.zeros((), dtype))
        out.append(u_out.reshape(g_leaves[i].shape).astype(g_leaves[i].dtype))
    return out, new_mom, new_gmom, new_z, withheld


def _restore(keep: Array, new: Array, old: Array) -> Array:
    """``new`` where ``keep``, else ``old`` (eq. 22), in a branch taken only when needed.

    A plain ``where`` would join the buffer's fusion and change how XLA rounds
    it in some programs (the sharded ones differ from one device's).
    """
    out: Array = jax.lax.cond(jnp.all(keep), lambda: new, lambda: jnp.where(keep, new, old))
    return out


__all__ = ["check_state", "shampoo"]
