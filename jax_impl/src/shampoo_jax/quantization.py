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


def quantize(m: Array, dtype: Any) -> tuple[Array, Array]:
    """``(q, s)`` of eq. (20b) for ``m`` in the parameter's shape (rank >= 2)."""
    d = np.dtype(dtype)
    tiny = jnp.asarray(np.finfo(d).tiny, d)
    zero = jnp.zeros((), d)
    x = m.astype(d)
    x = jnp.where(jnp.abs(x) >= tiny, x, zero)
    a = jnp.max(jnp.abs(x), axis=0, initial=zero)  # 0 over an empty dim 0
    s = a * jnp.asarray(d.type(1) / d.type(127), d)
    s = jnp.where(s >= tiny, s, zero)
    positive = s > 0
    inv = jnp.asarray(1, d) / jnp.where(positive, s, jnp.ones((), d))
    q = jnp.where(positive[None], jnp.round(x * inv[None]), zero)
    return q.astype(jnp.int8), s


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
