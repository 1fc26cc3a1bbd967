"""Eq. (20b): momentum buffers stored as int8 with one scale per column.

``MomentumConfig.storage = "int8_columnwise"`` (Google's
``best_effort_memory_usage_reduction``, its ``QuantizedValue`` with
``int8``). A buffer is quantized in the parameter's own shape (n0, n1, ...),
rank >= 2, in the scale dtype d (float32 or float64), every operation
rounded to d exactly as a backend computing in d rounds it:

    x   = fl_d(M),  0 where below d's smallest normal number
    a_j = max_i |x_ij|                    (over dim 0; j indexes dims 1..)
    s_j = fl_d(a_j * fl_d(1 / 127)),  0 where below d's smallest normal number
    q_ij = rint(fl_d(x_ij * fl_d(1 / s_j)))  where s_j > 0,  else 0
    read back:  M' = fl_d(q_ij * s_j)

The divisions are reciprocals times the dividend, two roundings, not one:
Google writes ``max_abs / num_buckets`` and ``fvalue / bucket_size`` with a
broadcast divisor, and XLA's algebraic simplifier rewrites ``x /
broadcast(y)`` as ``x * broadcast(1 / y)`` (measured: the scales and ratios
of precondition 239a8cd on XLA 0.10.2 equal these bit for bit, and differ
from a correctly rounded division in about one entry in 20 for the scales,
one in 4 for the ratios). The backends write the reciprocals out, so no
compiler rewrite can change them.

Subnormal numbers are flushed to zero (XLA on CPU reads and writes them as
0; torch does not, so its backend flushes explicitly). ``rint`` rounds to
the nearest integer, ties to even (``jnp.round``);
|q| <= 127 without clipping (``x / s <= 127 (1 + 2u)``). The float64
reference computes each line in d (NumPy's float32 operations are IEEE
correctly rounded, as XLA's and torch's are), so its integers and scales
are the ones a float32 backend stores for the same M.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

Array = NDArray[np.float64]

#: The largest integer stored (int8's -128 is never used: the map is symmetric).
INT8_LEVELS = 127
#: The same for eq. (20c)'s int16 factors and roots (-32768 is never used).
INT16_LEVELS = 32767


def quantize_columnwise(
    m: Array, scale_dtype: str, levels: int = INT8_LEVELS
) -> tuple[NDArray[np.integer], NDArray[np.floating]]:
    """``(q, s)`` of eq. (20b) for ``m`` in the parameter's shape (rank >= 2).

    ``q`` is int8 of ``m``'s shape, ``s`` has shape ``m.shape[1:]`` in
    ``scale_dtype`` (``"float32"`` or ``"float64"``). ``m`` must be finite
    in that dtype (eq. 22 keeps non-finite momentum out of the buffers).
    ``levels`` 32767 gives eq. (20c)'s int16 map (the same rule, 32767 for
    127 and int16 integers): :func:`quantize_with_diagonal`.
    """
    if m.ndim < 2:
        raise ValueError(f"eq. (20b) quantizes rank >= 2 buffers, got shape {m.shape}.")
    int_dtype = {INT8_LEVELS: np.int8, INT16_LEVELS: np.int16}[levels]
    dt = np.dtype(scale_dtype)
    x = np.asarray(m).astype(dt)
    x = np.where(np.abs(x) >= np.finfo(dt).tiny, x, dt.type(0))  # subnormals read as 0
    a = np.max(np.abs(x), axis=0, initial=dt.type(0))  # 0 over an empty dim 0
    s = a * (dt.type(1) / dt.type(levels))
    s = np.where(s >= np.finfo(dt).tiny, s, dt.type(0))  # flushed, as XLA on CPU
    safe = np.where(s > 0, s, dt.type(1))
    ratio = x * (dt.type(1) / safe)[np.newaxis, ...]
    q = np.where(s[np.newaxis, ...] > 0, np.rint(ratio), dt.type(0))
    assert np.all(np.abs(q) <= levels), "eqs. (20b), (20c): |q| <= levels for finite input"
    return q.astype(int_dtype), s.astype(dt)


def dequantize_columnwise(q: NDArray[np.integer], s: NDArray[np.floating]) -> Array:
    """``fl_d(q * s)`` of eq. (20b), d the dtype of ``s``, returned in float64."""
    back: Array = (q.astype(s.dtype) * s[np.newaxis, ...]).astype(np.float64)
    return back


def quantize_with_diagonal(
    a: Array, scale_dtype: str
) -> tuple[NDArray[np.int16], NDArray[np.floating], NDArray[np.floating]]:
    """``(q, s, g)`` of eq. (20c) for a square factor or inverse root ``a``.

    The diagonal is kept as floats, ``g_j = fl_d(a_jj)``; the off-diagonal
    part (``fl_d(a)`` with its diagonal set to 0) is quantized by eq. (20b)'s
    columnwise map with 32767 levels into int16 (``q_jj = 0``). ``s`` and
    ``g`` have shape ``(n,)`` in ``scale_dtype``. Google's
    ``QuantizedValue.from_float_value(a, jnp.int16, extract_diagonal=True)``.
    """
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"eq. (20c) quantizes square matrices, got shape {a.shape}.")
    dt = np.dtype(scale_dtype)
    x = np.asarray(a).astype(dt)
    g = np.diagonal(x).copy()
    off = x.copy()
    np.fill_diagonal(off, dt.type(0))
    q, s = quantize_columnwise(off, scale_dtype, INT16_LEVELS)
    return q.astype(np.int16), s, g


def dequantize_with_diagonal(
    q: NDArray[np.int16], s: NDArray[np.floating], g: NDArray[np.floating]
) -> Array:
    """The factor or root eq. (20c) reads back, in float64: ``fl_d(q_ij s_j)`` off the
    diagonal, ``g_j`` on it (``fl_d(0 s_j + g_j) = g_j``)."""
    back = dequantize_columnwise(q, s)
    np.fill_diagonal(back, g.astype(np.float64))
    return back
