"""Eq. (20b): momentum buffers stored as int8 with one scale per column.

With ``momentum.storage = "int8_columnwise"`` the momentum leaf of a
parameter of rank >= 2 is an int8 array of the parameter's shape and its
scales (shape ``shape[1:]``, in ``momentum.scale_dtype``) live in
``ShampooState.momentum_scale`` (one entry per parameter leaf, None where
the buffer stays in float). Every operation is written as the spec states
it: the divisions are reciprocals times the dividend (what XLA makes of
Google's ``x / broadcast(y)``), so no compiler rewrite can change them;
subnormals are flushed explicitly (XLA on CPU does it anyway, GPUs need not).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import Array


def quantize(m: Array, dtype: Any, levels: int = 127, axis: int = 0) -> tuple[Array, Array]:
    """``(q, s)`` of eq. (20b) for ``m`` in the parameter's shape (rank >= 2).

    ``levels`` 32767 and ``axis`` -2 give eq. (20c)'s map of a stack of
    matrices ``[..., n, n]`` (int16, one scale per column of each matrix).
    """
    d = np.dtype(dtype)
    tiny = jnp.asarray(np.finfo(d).tiny, d)
    zero = jnp.zeros((), d)
    x = m.astype(d)
    x = jnp.where(jnp.abs(x) >= tiny, x, zero)
    a = jnp.max(jnp.abs(x), axis=axis, initial=zero)  # 0 over an empty dim 0
    s = a * jnp.asarray(d.type(1) / d.type(levels), d)
    s = jnp.where(s >= tiny, s, zero)
    positive = jnp.expand_dims(s > 0, axis)
    inv = jnp.asarray(1, d) / jnp.where(positive, jnp.expand_dims(s, axis), jnp.ones((), d))
    q = jnp.where(positive, jnp.round(x * inv), zero)
    return q.astype({127: jnp.int8, 32767: jnp.int16}[levels]), s


def quantize_with_diagonal(a: Array, dtype: Any) -> tuple[Array, Array, Array]:
    """``(q, s, g)`` of eq. (20c) for a stack of square matrices ``[..., n, n]``."""
    d = np.dtype(dtype)
    x = a.astype(d)
    g = jnp.diagonal(x, axis1=-2, axis2=-1)
    eye = jnp.eye(x.shape[-1], dtype=bool)
    off = jnp.where(eye, jnp.zeros((), d), x)
    q, s = quantize(off, d, levels=32767, axis=-2)
    return q, s, g


def dequantize_with_diagonal(q: Array, s: Array, g: Array) -> Array:
    """Eq. (20c)'s read-back matrices in d: ``fl_d(q_ij s_j)`` off the diagonal, ``g_j`` on it."""
    back = q.astype(s.dtype) * s[..., None, :]
    eye = jnp.eye(q.shape[-1], dtype=bool)
    out: Array = jnp.where(eye, g[..., None, :], back)
    return out


def stored(a: Array, dtype: Any) -> Array:
    """Eq. (20c): a stack of factors or inverse roots as stored and read back, in
    ``a``'s dtype (the backends keep the read-back values, not the integers)."""
    return dequantize_with_diagonal(*quantize_with_diagonal(a, dtype)).astype(a.dtype)


def dequantize(q: Array, s: Array) -> Array:
    """``fl_d(q s)`` of eq. (20b), in the scales' dtype d."""
    out: Array = q.astype(s.dtype) * s[None]
    return out


def read(leaves: list[Array], scales: tuple[Array | None, ...] | None, dtypes: list[Any]
         ) -> list[Array]:
    """The buffers as floats in the elementwise dtypes: ``fl_d(q s)`` where quantized."""
    if scales is None:
        return leaves
    return [x if s is None else dequantize(x, s).astype(dt)
            for x, s, dt in zip(leaves, scales, dtypes, strict=True)]


def write(leaves: list[Array], scales: tuple[Array | None, ...] | None, dtype: Any
          ) -> tuple[list[Array], tuple[Array | None, ...] | None]:
    """Quantize the float buffers whose leaves are quantized (``scales`` not None)."""
    if scales is None:
        return leaves, None
    out: list[Array] = []
    new_scales: list[Array | None] = []
    for x, s in zip(leaves, scales, strict=True):
        if s is None:
            out.append(x)
            new_scales.append(None)
        else:
            q, s_new = quantize(x, dtype)
            out.append(q)
            new_scales.append(s_new)
    return out, tuple(new_scales)
