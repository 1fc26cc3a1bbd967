"""The elementwise phases of a step: inputs, gradient sum, filter, momentum, update (eqs. 1-2,
6c, 15, 16b, 19-22).

These run on every parameter in its merged shape (eq. 4, lists of leaves
through :class:`shampoo_jax.blocks.ParameterTree`), in the global view when
the block state is sharded; :func:`shampoo_jax.transform.shampoo`'s
``update`` calls them in the order of docs/spec.md:

- :func:`merged_inputs`: the gradients and weights in their merged shapes and
  the elementwise dtype, with L2 decay (eq. 2);
- :func:`statistics_gradient`: eq. (6c)'s G^ and the gradient sum S;
- :func:`update_diagonal_state`: a diagonal preconditioner's V_D (eq. 16b,
  by eq. 14b's rule);
- :func:`filter_gradient`: the gradient filter (eq. 15);
- :func:`read_momentum`, :func:`momentum_step`, :func:`write_momentum`:
  direction decay, momentum, learning rate and update decay (eqs. 19-21),
  eq. (20b)'s int8 buffers, eq. (20d)'s averaged step and eq. (22)'s guard.

The graft's state and direction (eq. 14) are :mod:`shampoo_jax.grafting`'s.
Entries that eq. (3) refuses (:mod:`shampoo_jax.refusal`) keep their state
and get a zero update.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from shampoo_spec import GradientFilterConfig, ShampooConfig

from . import blocks as B
from . import grafting, quantization, schedule
from .averaging import averaged_step
from .refusal import Refused, masked_blocks
from .state import ShampooState, elementwise_dtype, scale_dtype


def merged_inputs(
    g_leaves: list[Array], params: Any | None, tree: B.ParameterTree, config: ShampooConfig
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
def statistics_gradient(
    gradient_sum: Any, masked: Refused, t: Array, tree: B.ParameterTree, layout: B.Layout, fdt: Any,
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


def update_diagonal_state(
    diagonal_state: Any, masked: Refused, tree: B.ParameterTree, config: ShampooConfig
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
    return grafting.update_states(diagonal_state, masked.grads, masked.finite, tree,
                                   config.diagonal.as_graft())


def filter_gradient(
    filtered: Any, masked: Refused, t: Array, tree: B.ParameterTree, filt: GradientFilterConfig
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


# ----------------------------------------------------------- eqs. (19)-(21)
def read_momentum(state: ShampooState, tree: B.ParameterTree, g_leaves: list[Array]
                  ) -> ShampooState:
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


def momentum_step(
    shampoo_dir: list[Array] | None,
    graft_dir: list[Array],
    w: list[Array],
    finite: list[Array],
    state: ShampooState,
    use_shampoo: schedule.Flag,
    lr_t: Any,
    g_leaves: list[Array],
    p_leaves: list[Array] | None,
    tree: B.ParameterTree,
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


def write_momentum(
    tree: B.ParameterTree, new: list[Array] | None, like: Any, scales: Any, config: ShampooConfig
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


def _restore(keep: Array, new: Array, old: Array) -> Array:
    """``new`` where ``keep``, else ``old`` (eq. 22), in a branch taken only when needed.

    A plain ``where`` would join the buffer's fusion and change how XLA rounds
    it in some programs (the sharded ones differ from one device's).
    """
    out: Array = jax.lax.cond(jnp.all(keep), lambda: new, lambda: jnp.where(keep, new, old))
    return out


__all__ = [
    "filter_gradient",
    "merged_inputs",
    "momentum_step",
    "read_momentum",
    "statistics_gradient",
    "update_diagonal_state",
    "write_momentum",
]
