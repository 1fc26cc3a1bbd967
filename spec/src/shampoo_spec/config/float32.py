"""Rounding a Python float to float32, for the rules that name float32 scalars.

Adafactor's decay (eq. 14e, Google's float32 arithmetic) and the coefficients
of eq. (20d) under ``averaging.scalar_dtype = "float32"`` (Meta's float32
tensors) are float32 operations. Each operation's exact result rounded once
to float32 equals the IEEE float32 operation: for +, -, *, / of two float32
values the float64 result rounded to float32 is correctly rounded (53 >=
2 * 24 + 2 bits: double rounding is innocuous), so the rules compute in
Python floats and round after every operation.
"""

from __future__ import annotations

import math
import struct

#: The largest finite float32.
FLOAT32_MAX = 3.4028234663852886e38


def to_float32(x: float) -> float:
    """``x`` rounded to the nearest float32 (ties to even); beyond float32's range, +-inf
    (as a cast overflows), NaN stays NaN."""
    if math.isfinite(x) and abs(x) > FLOAT32_MAX:
        # struct refuses to pack these; a value past the largest float32 by at least half
        # its last unit rounds to inf, anything less to FLOAT32_MAX.
        edge = FLOAT32_MAX + 2.0 ** 103  # half an ulp of FLOAT32_MAX
        return math.copysign(math.inf if abs(x) >= edge else FLOAT32_MAX, x)
    out: float = struct.unpack("f", struct.pack("f", x))[0]
    return out


__all__ = ["FLOAT32_MAX", "to_float32"]
