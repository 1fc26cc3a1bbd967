"""Grafting, eq. (14), and its rescale, eq. (18): the whole graft of a step.

Same rules as ``shampoo_reference.grafting``; the state V is elementwise, so
it lives in the parameter's (merged) shape and never depends on blocking.
Which types keep a state is ``GraftingConfig.has_state``. Eq. (14e)'s
Adafactor graft (``GraftingConfig.factored``) is not elementwise: its
moments (:class:`FactoredMoments`) are row and column means of the whole
parameter in its own shape (not merged, not blocked).

Per leaf: :func:`update_state` (eq. 14b), :func:`direction` (eqs. 14a, 14c,
14d), the Adafactor moments and direction (eq. 14e). Per step, over every
leaf: :func:`update_states`, :func:`update_adafactor_moments`,
:func:`directions`, :func:`adafactor_directions`. Eq. (18)'s rescale of the
Shampoo direction to the graft's norm: per block (:func:`graft_blocks`,
:func:`rescale_blocks`) or per parameter (:func:`rescale_parameter`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array
from jax.typing import DTypeLike

from shampoo_spec import GraftingConfig

from . import blocks as B


def norm(x: Array) -> Array:
    """The Frobenius norm of a whole array (eq. 18's parameter scope), overflow-safe."""
    return B.frobenius(x)


def graft_input(x: Array, graft: GraftingConfig) -> Array:
    """Eq. (14a): ``x / (||x|| + normalize_epsilon)`` for ``*_normalized`` types, else x."""
    if graft.normalizes_input:
        return x / (norm(x) + graft.normalize_epsilon)
    return x


def update_state(state: Array, gradient: Array, graft: GraftingConfig) -> Array:
    """Eq. (14b): ``V <- V + g^2`` (beta2 = 1) or ``beta2 V + w g^2``, w = update_weight."""
    g = graft_input(gradient, graft)
    if graft.beta2 == 1.0:
        return state + g * g
    return graft.beta2 * state + graft.update_weight * (g * g)


def direction(x: Array, state: Array | None, t: Array, graft: GraftingConfig) -> Array:
    """Eq. (14c): ``graft(X)`` at (traced, 1-based) step t (epsilon after or inside the sqrt)."""
    kind = graft.type
    if kind in ("none", "sgd"):
        return x
    if kind == "sign":
        return jnp.sign(x)
    assert state is not None
    x = graft_input(x, graft)
    if graft.corrects_bias:
        # Eq. (14c)'s 1 - beta2^t on the traced step (GraftingConfig.bias_correction_factor).
        bc = 1.0 - jnp.asarray(graft.beta2, x.dtype) ** t.astype(x.dtype)
        state = state / bc
    if graft.epsilon_placement == "inside_sqrt":
        return clip(x / jnp.sqrt(state + graft.epsilon), graft)
    return clip(x / (jnp.sqrt(state) + graft.epsilon), graft)


def clip(u: Array, graft: GraftingConfig) -> Array:
    """Eq. (14d): ``u / max(1, rms(u) / clip_rms)``, ``rms(u) = ||u|| / sqrt(size)``; u if None.

    ``jnp.maximum`` keeps a NaN rms, as Google's ``clip_by_scaled_gradient_norm``.
    """
    c = graft.clip_rms
    if c is None:
        return u
    rms = norm(u) / math.sqrt(u.size)
    out: Array = u / jnp.maximum(1.0, rms / c)
    return out


# ------------------------------------------------------------- eq. (14e) Adafactor
class FactoredMoments(NamedTuple):
    """Eq. (14e)'s moments of one parameter, in the parameter's own shape.

    Factored (``GraftingConfig.factored_dims`` not None, ``(d0, d1)``): ``row`` is R
    (the shape without d0) and ``col`` is C (the shape without d1), ``full``
    None; otherwise ``full`` is V (the parameter's shape) and the others are
    None. A None field is an empty pytree node, so the state holds only the
    arrays in use (optax's ``FactoredState`` keeps ``(1,)`` placeholders
    instead); which case applies is static, from the shape.
    """

    row: Array | None = None
    col: Array | None = None
    full: Array | None = None


def adafactor_init(shape: tuple[int, ...], dtype: DTypeLike, graft: GraftingConfig
                   ) -> FactoredMoments:
    """Eq. (14e): R, C (or V) = 0 for a parameter of ``shape``, in ``dtype``."""
    dims = graft.factored_dims(shape)
    if dims is None:
        return FactoredMoments(full=jnp.zeros(shape, dtype))
    d0, d1 = dims
    return FactoredMoments(row=jnp.zeros(shape[:d0] + shape[d0 + 1:], dtype),
                           col=jnp.zeros(shape[:d1] + shape[d1 + 1:], dtype))


def adafactor_decay(t: Array, exponent: float) -> Array:
    """``beta_t = fl32(1 - fl32(t^(-c)))`` of eq. (14e) at the (traced, 1-based) step t.

    Under x64 the power is taken in float64 and rounded once to float32:
    XLA's float32 ``pow`` is not correctly rounded (for c = 0.999 it is one
    ulp off at t = 2), and eq. (14e) wants the correctly rounded value. A
    float64 power rounded to float32 is that value unless it lies within
    2^-53 relative of a float32 rounding boundary. Without x64 there is no
    float64: the float32 ``pow`` is used, as optax's ``_decay_rate_pow``
    does, so t^(-c) may then be one float32 ulp off at some t (beta_t off by
    at most 2^-24; a relative change of about 1e-7 t^(-c) in that step's
    moments, inside float32's tolerance).
    """
    if jax.dtypes.canonicalize_dtype(jnp.float64) == jnp.float64:
        power = (t.astype(jnp.float64) ** -exponent).astype(jnp.float32)
    else:
        power = t.astype(jnp.float32) ** jnp.float32(-exponent)
    out: Array = jnp.float32(1.0) - power
    return out


def adafactor_update(m: FactoredMoments, gradient: Array, beta: Array, graft: GraftingConfig
                     ) -> FactoredMoments:
    """Eq. (14e): ``R <- beta R + (1 - beta) mean_d0 Q``, ``C <- beta C + (1 - beta) mean_d1 Q``
    (unfactored: ``V <- beta V + (1 - beta) Q``), ``Q = G^2 + epsilon``.

    ``gradient`` in the parameter's own shape; ``beta`` from :func:`adafactor_decay`
    (float32). beta and 1 - beta are formed in the moments' dtype, as optax does
    in float32; in float64 both are exact (beta is a float32 number).
    """
    q = gradient * gradient + graft.epsilon
    b = beta.astype(q.dtype)
    w = 1.0 - b
    if m.full is not None:
        return FactoredMoments(full=b * m.full + w * q)
    dims = graft.factored_dims(tuple(gradient.shape))
    assert dims is not None and m.row is not None and m.col is not None
    d0, d1 = dims
    return FactoredMoments(row=b * m.row + w * jnp.mean(q, axis=d0),
                           col=b * m.col + w * jnp.mean(q, axis=d1))


def adafactor_direction(x: Array, m: FactoredMoments, parameter: Array | None,
                        graft: GraftingConfig) -> Array:
    """``graft(X)`` of eq. (14e), in the parameter's own shape.

    ``X (R / mean_d1 R)^(-1/2) C^(-1/2)`` (R broadcast back at d0, C at d1;
    unfactored ``X V^(-1/2)``), clipped by eq. (14d) (:func:`clip`, over the
    whole parameter), then times ``max(rms(W), parameter_scale_floor)`` with
    ``rms(W) = sqrt(mean(W^2))`` of the parameter before the step (when the
    floor is set; ``parameter`` must then be given). The products are in
    optax's order, so that float32 runs are optax's bit for bit where beta_t is.
    """
    if m.full is not None:
        u = x * m.full ** -0.5
    else:
        dims = graft.factored_dims(tuple(x.shape))
        assert dims is not None and m.row is not None and m.col is not None
        d0, d1 = dims
        r_axis = d1 - 1 if d1 > d0 else d1  # d1's axis in R, which lacks d0
        row = (m.row / jnp.mean(m.row, axis=r_axis, keepdims=True)) ** -0.5
        u = x * jnp.expand_dims(row, d0) * jnp.expand_dims(m.col ** -0.5, d1)
    u = clip(u, graft)
    floor = graft.parameter_scale_floor
    if floor is None:
        return u
    assert parameter is not None
    w = parameter.astype(u.dtype)
    # jnp.maximum keeps a NaN rms (optax's safe_root_mean_squares gives NaN too).
    scaled: Array = u * jnp.maximum(jnp.sqrt(jnp.mean(w * w)), floor)
    return scaled


def moments_max(m: FactoredMoments) -> Array:
    """The largest |entry| of R, C and V of one parameter: eq. (3)'s m counts it for every
    block of the parameter (the moments span it). At least float32."""
    parts = [jnp.max(jnp.abs(a), initial=0.0).astype(jnp.promote_types(a.dtype, jnp.float32))
             for a in jax.tree.leaves(m)]
    out: Array = parts[0] if len(parts) == 1 else jnp.maximum(parts[0], parts[1])
    return out


# ------------------------------------------------------ a step's graft, every leaf
def update_states(
    graft_state: Any, grads: list[Array], finite: list[Array], tree: B.ParameterTree,
    graft: GraftingConfig,
) -> list[Array] | None:
    """Eq. (14b): the graft state V of every leaf (merged, from the merged gradients
    ``grads``), left unchanged where the gradient was non-finite or refused (eq. 3's
    ``finite``); None without a state."""
    if graft_state is None:
        return None
    return [
        jnp.where(f, update_state(v, x, graft), v)
        for f, v, x in zip(finite, tree.merged(graft_state), grads, strict=False)
    ]


def update_adafactor_moments(
    moments: list[FactoredMoments] | None, grads: list[Array], finite: list[Array], t: Array,
    tree: B.ParameterTree, graft: GraftingConfig,
) -> list[FactoredMoments] | None:
    """Eq. (14e): each parameter's R, C (or V) at step t, from G in the parameter's own shape.

    The moments are means over the whole parameter, so a step in which eq. (3)
    refuses any block of the parameter leaves them unchanged (the refused
    gradient entries are zero in ``grads``, so the unused branch stays
    finite). None without the Adafactor graft.
    """
    if moments is None:
        return None
    beta = adafactor_decay(t, graft.decay_exponent)
    out = []
    for m, f, x, plan in zip(moments, finite, grads, tree.plans, strict=True):
        new = adafactor_update(m, x.reshape(plan.shape), beta, graft)
        admitted = jnp.all(f)
        out.append(jax.tree.map(lambda a, b, ok=admitted: jnp.where(ok, a, b), new, m))
    return out


def adafactor_directions(
    used: list[Array], moments: list[FactoredMoments], params: Any | None,
    tree: B.ParameterTree, graft: GraftingConfig,
) -> list[Array]:
    """Eq. (14e): ``graft(X)`` of every leaf from its new moments (merged shape, as eq. 14c's).

    X (the filtered gradient, eq. 15) is taken in the parameter's own shape;
    ``params`` (W before the step) only with ``parameter_scale_floor``.
    """
    p_leaves = tree.leaves(params) if params is not None else [None] * len(used)
    return [
        adafactor_direction(u.reshape(plan.shape), m, p, graft).reshape(u.shape)
        for u, m, p, plan in zip(used, moments, p_leaves, tree.plans, strict=True)
    ]


def directions(
    used: list[Array], graft_state: list[Array] | None, t: Array, graft: GraftingConfig
) -> list[Array]:
    """Eq. (14c): the graft direction of every leaf."""
    states: Sequence[Array | None] = graft_state if graft_state is not None else [None] * len(used)
    return [direction(u, v, t, graft) for u, v in zip(used, states, strict=True)]


# ------------------------------------------------------------- eq. (18)
def graft_blocks(graft_dir: list[Array], layout: B.Layout, fdt: Any, graft: GraftingConfig
                 ) -> list[Array] | None:
    """Eq. (18) with ``rescale_scope = "block"``: the blocks of the graft direction (each
    leaf's ``graft_dir``, merged) in ``fdt``, whose norms the Shampoo blocks take
    (:func:`rescale_blocks`); None for the other scopes (no rescale per block)."""
    if graft.rescale_scope == "block":
        return B.gather(graft_dir, layout, fdt)
    return None


def rescale_blocks(pb: Array, gd: Array, graft: GraftingConfig) -> Array:
    """Eq. (18), block scope: each block of the stack ``pb`` times
    ``||graft block|| / (||P_B|| + norm_epsilon)`` (``gd``: the graft direction's blocks)."""
    scale = B.block_norms(gd) / (B.block_norms(pb) + graft.norm_epsilon)
    out: Array = pb * B.expand(scale, pb)
    return out


def rescale_parameter(p: Array, gd: Array, graft: GraftingConfig) -> Array:
    """Eq. (18), parameter scope: ``P ||graft(X)|| / (||P|| + norm_epsilon)`` over the whole
    parameter (``gd``: its graft direction)."""
    out: Array = p * (norm(gd) / (norm(p) + graft.norm_epsilon))
    return out


__all__ = [
    "FactoredMoments",
    "adafactor_decay",
    "adafactor_direction",
    "adafactor_directions",
    "adafactor_init",
    "adafactor_update",
    "clip",
    "direction",
    "directions",
    "graft_blocks",
    "graft_input",
    "moments_max",
    "norm",
    "rescale_blocks",
    "rescale_parameter",
    "update_adafactor_moments",
    "update_state",
    "update_states",
]
