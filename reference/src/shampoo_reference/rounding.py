"""Rounding to a dtype below float64: ``round_s`` of eq. (11a), ``c_s`` of eq. (17a).

Eq. numbers refer to docs/spec.md. Values stay float64; each is rounded as
the backends' casts to the dtype round it.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

Array = NDArray[np.float64]


def round_to(x: Array, dtype: str) -> Array:
    """``round_s(x)`` of eq. (11a): each entry rounded to ``dtype``, returned in float64.

    Round to nearest, ties to even, exactly as the backends' casts (and so
    Meta's ``.to(dtype)``) round a float64: ``"float64"`` leaves x alone;
    ``"float32"`` is NumPy's correctly rounded cast; ``"float16"`` and
    ``"bfloat16"`` round the float32 value again (torch, JAX/XLA and
    ml_dtypes all convert float64 to them through float32, so a float64
    within 2^-24 relative of a tie rounds as that tie: two roundings, not
    one). float16 overflows to inf above 65504 and keeps its subnormals;
    bfloat16 (:func:`round_to_bfloat16`) has float32's range. NaN stays NaN.
    """
    if dtype == "float64":
        return np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):  # beyond the dtype's range: inf, as the casts give
        f32 = np.asarray(x, dtype=np.float64).astype(np.float32)
        if dtype == "float32":
            return f32.astype(np.float64)
        if dtype == "float16":
            return f32.astype(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        return round_to_bfloat16(f32).astype(np.float64)
    raise ValueError(
        f"dtype = {dtype!r} is invalid: allowed one of 'float64', 'float32', 'bfloat16', "
        "'float16' (shampoo_spec.INVERSE_ROOT_DTYPES)."
    )


def round_to_bfloat16(x: NDArray[np.float32]) -> NDArray[np.float32]:
    """float32 values rounded to bfloat16 (its 8 significant bits), still as float32.

    bfloat16 is the top half of a float32's bits, so rounding to nearest even
    is integer arithmetic on them: add ``0x7FFF`` plus the lowest kept bit
    (a tie then carries into the kept half exactly when that bit is odd) and
    clear the low 16 bits. A carry out of the largest finite bfloat16 gives
    inf, as it should; subnormals round the same way. NaN is kept as NaN
    (the carry could turn a NaN payload into inf). Written out rather than
    taken from ``ml_dtypes`` so the reference needs only NumPy;
    reference/tests/test_rounding.py checks it against ml_dtypes where that
    is installed.
    """
    f32 = np.ascontiguousarray(x, dtype=np.float32)
    bits = f32.view(np.uint32)
    lowest_kept = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = (bits + np.uint32(0x7FFF) + lowest_kept) & np.uint32(0xFFFF0000)
    return np.where(np.isnan(f32), f32, rounded.view(np.float32))


def scalar_in(x: float, dtype: str) -> float:
    """``c_s(x)`` of eq. (17a): a scalar as an operation on a tensor of ``dtype`` takes it
    (float64 as is; below float64 rounded to float32, torch's compute type there)."""
    return float(x) if dtype == "float64" else float(np.float32(x))
