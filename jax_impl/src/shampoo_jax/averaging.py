"""Iterate averaging, eq. (20d) of docs/spec.md (``ShampooConfig.averaging``).

Meta's ``GeneralizedPrimalAveragingConfig`` (``type="gpa"``) and
``ScheduleFreeConfig`` (``"schedule_free"``). The parameters W are the
training sequence y, where gradients are taken; the state keeps the base
sequence Z (``ShampooState.averaged``, starting at W) and, for
Schedule-Free, ``S_t = sum_{i<=t} lr_i^p`` (``ShampooState.lr_power_sum``).
Each step, with ``d = -lr_t P``:

    Z <- Z (1 - lr_t alpha_t)          (direction decay, in place of P + alpha W)
    Delta = (1 - mu_x mu_y) d + (1 - mu_x) (Z - W)
    Z <- Z + d,    W <- W + Delta

:func:`averaged_step` is that step for one leaf (:func:`shampoo_jax.shampoo`
returns Delta as the update, so ``optax.apply_updates`` gives ``W + Delta``);
:func:`averaged_params` is the evaluation sequence
``x = (W - (1 - mu_y) Z) / mu_y``, computed from the state and the
parameters without changing either: the functional form of the other
backends' ``eval()`` / ``train()`` pair, which overwrite the parameters.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from shampoo_spec import IterateAveragingConfig, ShampooConfig, config_differences, to_float32

from .state import ShampooState, config_json


def power_sum(
    previous: Array, lr_t: Any, averaging: IterateAveragingConfig
) -> Array:
    """Schedule-Free's ``S_t = S_{t-1} + lr_t^p`` (eq. 20d), in ``previous``'s dtype."""
    out: Array = _rounded(previous + _lr_power(lr_t, averaging, previous.dtype), averaging)
    return out


def _rounded(x: Any, averaging: IterateAveragingConfig) -> Any:
    """One operation's result in ``averaging.scalar_dtype`` (eq. 20e): a float64 result
    rounded to float32 is float32's own operation (double rounding is innocuous for +,
    -, *, /); a float32 one is left as it is; a Python float by the spec's rounding.

    ``reduce_precision``, not a float32 round trip: XLA may drop a convert pair
    (excess precision is allowed by default), which moved Meta's Schedule-Free case
    by 3.5e-9; it keeps reduce_precision. That flushes a float32 subnormal (below
    1.2e-38) to zero, as XLA's own float32 arithmetic does, where eq. (20e) keeps it:
    a scalar that small needs a rate below 1e-19 (p = 2)."""
    if averaging.scalar_dtype != "float32":
        return x
    if isinstance(x, (int, float)):
        return to_float32(float(x))
    x = jnp.asarray(x)
    if x.dtype == jnp.float32:
        return x
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=23)


def _lr_power(lr_t: Any, averaging: IterateAveragingConfig, dtype: Any) -> Array:
    """``lr_t^p`` in ``dtype``: a Python rate by the spec's rule (float64, rounded once),
    a traced one (a schedule's value) raised in ``dtype`` (eq. 20e: from the rounded rate,
    then rounded)."""
    if isinstance(lr_t, (int, float)):
        return jnp.asarray(averaging.lr_power(float(lr_t)), dtype)
    lr = _rounded(jnp.asarray(lr_t).astype(dtype), averaging)
    out: Array = _rounded(lr**averaging.eval_lr_power, averaging)
    return out


def eval_coefficient(
    lr_t: Any, lr_power_sum: Array | None, averaging: IterateAveragingConfig
) -> float | Array:
    """``mu_x`` of eq. (20d): ``eval_interp`` (gpa, static), or ``1 - lr_t^p / S_t``
    (schedule_free, traced, in ``S_t``'s dtype; ``S_t`` already includes this step);
    eq. (20e) rounds each operation in float32.

    Where ``S_t = 0`` (every rate so far 0, as at a warmup's first step) the
    ratio is taken as 0 (mu_x = 1: then d = 0 and Z = W, so Delta = 0), as
    Defazio et al.'s reference implementation does; the float64 reference
    divides by zero there. (Inside jit nothing can raise.)
    """
    if averaging.type == "gpa":
        return averaging.eval_coefficient(0.0, 0.0)
    assert lr_power_sum is not None  # init_state keeps S_t with schedule_free
    s = lr_power_sum
    positive = s > 0
    lrp = _lr_power(lr_t, averaging, s.dtype)
    ratio = jnp.where(positive, _rounded(lrp / jnp.where(positive, s, 1), averaging), 0)
    mu_x: Array = _rounded(1.0 - ratio, averaging)
    return mu_x


def averaged_step(
    d: Array,
    w: Array,
    z: Array,
    mu_x: float | Array,
    lr_t: Any,
    lr_0: float,
    config: ShampooConfig,
) -> tuple[Array, Array]:
    """Eq. (20d) for one leaf: ``(Delta, new Z)`` from ``d = -lr_t P``, W and the old Z.

    The direction decay (eq. 19's alpha_t, ``weight_decay.direction_value``)
    shrinks Z first, ``Z (1 - lr_t alpha_t)``, in place of ``P + alpha W``
    (``elementwise.momentum_step`` leaves it out of P under averaging). The caller rounds
    Delta (eq. 21a) and applies eq. (22)'s guard to W and Z alike. A traced
    ``mu_x`` (Schedule-Free, in ``S_t``'s dtype, the widest leaf's) is cast
    to this leaf's dtype, and the new Z keeps the old one's. The scalars follow
    eq. (20e) (static ones by the spec's own functions).
    """
    av, wd = config.averaging, config.weight_decay
    assert av is not None
    dtype = z.dtype
    if wd.applies("direction"):
        alpha = wd.direction_value(lr_t, lr_0)
        if isinstance(lr_t, (int, float)) and isinstance(alpha, (int, float)):
            z = z * av.decay_factor(float(lr_t), float(alpha))
        else:  # a schedule's traced rate
            product = _rounded(_rounded(lr_t, av) * _rounded(alpha, av), av)
            z = z * _rounded(1.0 - product, av)
    if isinstance(mu_x, jax.Array):  # Schedule-Free
        mu_x = mu_x.astype(d.dtype)
        along_d = _rounded(1.0 - _rounded(mu_x * av.mu_y, av), av)
        toward_z = _rounded(1.0 - mu_x, av)
    else:  # gpa: static
        along_d, toward_z = av.step_coefficients(0.0, 0.0)
    delta = along_d * d + toward_z * (z - w)
    # A traced lr_t wider than the leaf (a float64 schedule beside float32
    # parameters) must not widen the stored Z.
    return delta, (z + d).astype(dtype)


def averaged_params(state: Any, params: Any, config: ShampooConfig | None = None) -> Any:
    """The evaluation sequence of eq. (20d), ``x = (W - (1 - mu_y) Z) / mu_y``.

    Computed as ``W + (1 - 1 / mu_y) (Z - W)`` (the reference's ``eval()``)
    in the elementwise dtype and returned in the parameters' dtypes and
    structure. Pure: neither ``state`` nor ``params`` changes. Evaluate the
    model at the returned parameters and keep training from ``params``
    (the training sequence y, where the gradients are taken); there is no
    train/eval mode to switch back, as there is with the other backends'
    ``eval()`` / ``train()``, which overwrite the parameters in place. The
    JAX counterpart of ``optax.contrib.schedule_free_eval_params(state,
    params)``, and like it jit-compatible.

    ``state``: the transformation's state, or a pytree holding exactly one
    :class:`ShampooState` (an ``optax.chain``'s state). ``config``: optional;
    by default the config the state carries (``state.info.config``, set by
    ``init``); when given it must equal that one. Without
    ``config.averaging`` the evaluation sequence is the parameters
    themselves: ``params`` is returned as is. ``ValueError`` for a state
    without Z under an averaging config, or a config that differs from the
    state's (naming the fields).
    """
    s = _shampoo_state(state)
    config = _config_of(s, config)
    av = config.averaging
    if av is None:
        return params
    if s.averaged is None:
        raise ValueError(
            "state.averaged = None is invalid with config.averaging set: the state was not "
            "made by shampoo(config).init under this config (eq. 20d keeps Z there)."
        )
    c = av.switch_coefficient("eval")  # eq. (20e) in float32

    def x(w: Array, z: Array) -> Array:
        we = jnp.asarray(w).astype(z.dtype).reshape(z.shape)
        out: Array = (we + c * (z - we)).astype(jnp.asarray(w).dtype).reshape(jnp.shape(w))
        return out

    return jax.tree.map(x, params, s.averaged)


def _shampoo_state(tree: Any) -> ShampooState:
    """The one :class:`ShampooState` of ``tree`` (the tree itself, or inside a chain's state)."""
    found = [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, ShampooState))
             if isinstance(x, ShampooState)]
    if len(found) != 1:
        raise ValueError(
            f"state holds {len(found)} ShampooStates: allowed a pytree with exactly one "
            "(shampoo(config).init's state, or a chain's state holding it)."
        )
    return found[0]


def _config_of(state: ShampooState, config: ShampooConfig | None) -> ShampooConfig:
    """``config``, checked against the one the state carries; else the carried one."""
    carried = None if state.info is None else state.info.config
    if config is None:
        if carried is None:
            raise ValueError(
                "config = None is invalid for a state that carries no config (not made by "
                "shampoo(config).init): pass config=."
            )
        return ShampooConfig.from_dict(json.loads(carried))
    given = config_json(config)  # ValueError unless a ShampooConfig
    if carried is not None and carried != given:
        diffs = config_differences(ShampooConfig.from_dict(json.loads(carried)), config)
        raise ValueError(
            "config is not the config the state was initialised under; fields that differ "
            f"(state -> config): {'; '.join(diffs)}."
        )
    return config


__all__ = ["averaged_params", "averaged_step", "eval_coefficient", "power_sum"]
