"""The per-block maths of Shampoo on stacks of equal-shape blocks, eqs. (6)-(13), (16)-(18).

:func:`block_step` is everything that needs the block state, in order:
statistics (eq. 6, :func:`update_statistics`; a sketched factor's
observation, eq. 6c), inverse roots on root steps (eqs. 7, 9-13,
:func:`shampoo_jax.refresh.refresh_inverse_roots`; a sketched factor's from
its sketch, eq. 10d), the eigenvalue-corrected second moment (eq. 17,
:mod:`shampoo_jax.eigenvalue_correction`) and the preconditioned,
block-rescaled stacks (eqs. 16-18, :func:`precondition_blocks`; spectral
descent's orthogonalized blocks, eq. 16c, :func:`orthogonalize`, in place of
eq. 16's). Every operation is per block, so the
same function runs on all blocks (:func:`shampoo_jax.shampoo` on one device)
or on each device's shard of them (:func:`shampoo_jax.sharded.sharded_block_step`).
:func:`assemble_direction` then puts each parameter's Shampoo direction
back together from its blocks (eq. 18; the graft's rescale is
:mod:`shampoo_jax.grafting`'s).

Vocabulary: *roots* are the exponents r_k (``BlockGroupLayout.roots``);
the matrices ``L_k^(-1/r_k)`` (or the eigenbases Q_k with eigenvalue
correction) are *inverse roots* (``BlockGroupState.inverse_roots``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import Array, lax

from shampoo_spec import ShampooConfig, SpectralDescentConfig

from . import blocks as B
from . import grafting, schedule
from .eigenvalue_correction import corrected_direction, update_corrected_moment
from .quantization import stored
from .refresh import refresh_inverse_roots
from .roots import rounded
from .state import Groups, factor_dtype, statistics_scale_dtype


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
        if gd_blocks is not None:  # eq. (18), block scope
            pb = grafting.rescale_blocks(pb, gd_blocks[gi], config.grafting)
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
    out = []
    for i, leaf in enumerate(layout.leaves):
        if not leaf.refs:
            out.append(graft_dir[i])  # not preconditioned: the graft direction (eq. 18)
            continue
        p = B.scatter(stacks, leaf).astype(graft_dir[i].dtype)
        if per_parameter:
            p = grafting.rescale_parameter(p, graft_dir[i], config.grafting)
        out.append(p)
    return out


__all__ = [
    "BlockInputs",
    "assemble_direction",
    "block_step",
    "orthogonalize",
    "precondition_blocks",
    "update_statistics",
]
