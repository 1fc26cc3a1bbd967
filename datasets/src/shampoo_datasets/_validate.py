"""Argument checks: every bad argument raises ``ValueError`` naming it and what is allowed."""

from __future__ import annotations

import math
import numbers


def seed(value: object) -> int:
    """A seed must be a non-negative Python or NumPy integer (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 0:
        raise ValueError(f"seed must be a non-negative int, got {value!r}")
    return int(value)


def size(name: str, value: object) -> int:
    """A size must be an integer >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def real_at_least(name: str, value: object, low: float) -> float:
    """A finite real number >= ``low`` (not a bool)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(float(value))
        or float(value) < low
    ):
        raise ValueError(f"{name} must be a finite real number >= {low:g}, got {value!r}")
    return float(value)


def positive_real(name: str, value: object) -> float:
    """A finite real number > 0 (not a bool)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(float(value))
        or float(value) <= 0.0
    ):
        raise ValueError(f"{name} must be a finite real number > 0, got {value!r}")
    return float(value)
