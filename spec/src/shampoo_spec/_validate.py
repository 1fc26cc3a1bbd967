"""Field validators shared by every config dataclass.

Each raises ``ValueError`` naming the field, the value received and what is
allowed, so a bad config fails at construction with an actionable message.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def fail(owner: str, field: str, value: Any, allowed: str) -> None:
    raise ValueError(f"{owner}.{field} = {value!r} is invalid: allowed {allowed}.")


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
    if not _is_real(value) or not math.isfinite(value):
        fail(owner, field, value, allowed)
    if low is not None and (value < low or (low_open and value == low)):
        fail(owner, field, value, allowed)
    if high is not None and (value > high or (high_open and value == high)):
        fail(owner, field, value, allowed)


def integer(owner: str, field: str, value: Any, *, low: int | None = None) -> None:
    """An int (not bool) >= low."""
    allowed = f"an integer >= {low}" if low is not None else "an integer"
    if not isinstance(value, int) or isinstance(value, bool):
        fail(owner, field, value, allowed)
    if low is not None and value < low:
        fail(owner, field, value, allowed)


def optional_integer(owner: str, field: str, value: Any, *, low: int, none_means: str) -> None:
    allowed = f"an integer >= {low}, or None ({none_means})"
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        fail(owner, field, value, allowed)


def choice(owner: str, field: str, value: Any, options: Iterable[str]) -> None:
    opts = tuple(options)
    if value not in opts:
        fail(owner, field, value, "one of " + ", ".join(repr(o) for o in opts))


def boolean(owner: str, field: str, value: Any) -> None:
    if not isinstance(value, bool):
        fail(owner, field, value, "True or False")


def instance(owner: str, field: str, value: Any, types: tuple[type, ...]) -> None:
    if not isinstance(value, types):
        names = " or ".join(t.__name__ for t in types)
        fail(owner, field, value, f"an instance of {names}")
