"""Field validators shared by every config dataclass.

Each raises ``ValueError`` naming the field, the value received and what is
allowed, so a bad config fails at construction with an actionable message.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

#: The largest integer any count or size of the config may take: every
#: backend holds such values in a signed 32-bit integer (JAX's default int).
MAX_INTEGER = 2**31 - 1


def _shown(value: Any) -> str:
    """``repr(value)``, shortened: a hostile value must not make a huge message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + f"... ({len(text)} characters)"


def fail(owner: str, field: str, value: Any, allowed: str) -> None:
    raise ValueError(f"{owner}.{field} = {_shown(value)} is invalid: allowed {allowed}.")


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite(value: int | float) -> bool:
    """``math.isfinite`` for ints beyond float's range too (10**400 is not finite here)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def real(
    owner: str,
    field: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """A finite real number within [low, high] (or open ends as flagged)."""
    lo = "(" if low_open else "["
    hi = ")" if high_open else "]"
    allowed = f"a finite number in {lo}{low if low is not None else '-inf'}, "
    allowed += f"{high if high is not None else 'inf'}{hi}"
    if not _is_real(value) or not is_finite(value):
        fail(owner, field, value, allowed)
    if low is not None and (value < low or (low_open and value == low)):
        fail(owner, field, value, allowed)
    if high is not None and (value > high or (high_open and value == high)):
        fail(owner, field, value, allowed)


#: float32's smallest normal number, 2^-126 (about 1.18e-38): the least
#: nonzero epsilon. A subnormal one is flushed to zero by XLA on CPU and by
#: GPUs in flush-to-zero mode, so backends would not compute the same thing.
SMALLEST_EPSILON = 2.0**-126


_NORMAL = f"a finite number >= 2^-126 = {SMALLEST_EPSILON:.6g} (float32's smallest normal)"


def epsilon(owner: str, field: str, value: Any, *, zero: bool) -> None:
    """An epsilon: 0 (only when ``zero``, i.e. it never divides) or >= :data:`SMALLEST_EPSILON`."""
    allowed = "0 or " + _NORMAL if zero else _NORMAL
    if not _is_real(value) or not is_finite(value):
        fail(owner, field, value, allowed)
    if value < SMALLEST_EPSILON and not (zero and value == 0):
        fail(owner, field, value, allowed)


def optional_normal(owner: str, field: str, value: Any, *, none_means: str) -> None:
    """None, or a finite real >= :data:`SMALLEST_EPSILON` (a float32 normal when rounded)."""
    if value is None:
        return
    if not _is_real(value) or not is_finite(value) or value < SMALLEST_EPSILON:
        fail(owner, field, value, f"{_NORMAL}, or None ({none_means})")


def integer(
    owner: str, field: str, value: Any, *, low: int | None = None, high: int = MAX_INTEGER
) -> None:
    """An int (not bool) in [low, high] (high defaults to :data:`MAX_INTEGER`)."""
    allowed = f"an integer in [{low if low is not None else -high}, {high}]"
    if not isinstance(value, int) or isinstance(value, bool):
        fail(owner, field, value, allowed)
    if (low is not None and value < low) or value > high:
        fail(owner, field, value, allowed)


def optional_integer(
    owner: str, field: str, value: Any, *, low: int, none_means: str, high: int = MAX_INTEGER
) -> None:
    """None, or an int (not bool) in [low, high]."""
    allowed = f"an integer in [{low}, {high}], or None ({none_means})"
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        fail(owner, field, value, allowed)


def choice(
    owner: str, field: str, value: Any, options: Iterable[str], *, none_means: str | None = None
) -> None:
    """One of ``options`` (a string); ``none_means`` names what None would mean, if allowed."""
    opts = tuple(options)
    if not isinstance(value, str) or value not in opts:
        allowed = "one of " + ", ".join(repr(o) for o in opts)
        if none_means is not None:
            allowed += f", or None ({none_means})"
        fail(owner, field, value, allowed)


def boolean(owner: str, field: str, value: Any) -> None:
    if not isinstance(value, bool):
        fail(owner, field, value, "True or False")


def instance(owner: str, field: str, value: Any, types: tuple[type, ...]) -> None:
    if not isinstance(value, types):
        names = " or ".join(t.__name__ for t in types)
        fail(owner, field, value, f"an instance of {names}")
