"""Hostile scalar values, and a strategy for any field of any config section.

:func:`field_values` reads a dataclass field's type hint and default, so a
field added to a section of ``shampoo_spec.config`` is fuzzed without a
change here: valid-looking values of its kind (the ``Literal`` options, the
bounds 0 and 1, the default) mixed with :data:`HUGE`, :data:`TINY` and
:data:`WRONG_TYPES`.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

from hypothesis import strategies as st

#: Out-of-range magnitudes: beyond float, beyond int64, beyond MAX_INTEGER, inf, NaN.
HUGE: tuple[Any, ...] = (
    10**400, -(10**400), 2**62, 2**31, 2**31 - 1, 2**63, 1e308, -1e308, 1e30, 1e20,
    math.inf, -math.inf, math.nan,
)
#: Tiny and boundary values: zeros of both signs, denormals, 1 - 1e-12, -1.
TINY: tuple[Any, ...] = (
    0, 0.0, -0.0, 5e-324, 1e-308, 1e-45, 1e-30, 1e-12, -1e-30, 1, 1.0, -1, -1.0,
    1.0 - 1e-12, 1.0 + 1e-12, 0.5, 2, 2.5,
)
#: Values of the wrong type for any field: strings (numeric-looking too), None,
#: containers (unhashable ones included), bools for numbers, bytes, complex.
WRONG_TYPES: tuple[Any, ...] = (
    "", "1", "0.5", "false", "true", "False", "nan", "inf", "eigh", None, [], [1], [0.5, 0.5],
    {}, {"a": 1}, set(), (), (1,), True, False, b"1", complex(1, 1), object(),
)
#: Every hostile scalar.
HOSTILE: tuple[Any, ...] = HUGE + TINY + WRONG_TYPES


def hostile_values() -> st.SearchStrategy[Any]:
    """Any hostile value, or an arbitrary float / int (NaN, inf and huge ints included)."""
    return st.one_of(
        st.sampled_from(HOSTILE),
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(min_value=-(2**70), max_value=2**70),
    )


def literal_options(hint: Any) -> tuple[Any, ...]:
    """The ``Literal[...]`` options anywhere in ``hint`` (unions and aliases included)."""
    if typing.get_origin(hint) is typing.Literal:
        return tuple(typing.get_args(hint))
    out: tuple[Any, ...] = ()
    for arg in typing.get_args(hint):
        out += literal_options(arg)
    return out


def _accepts_none(hint: Any) -> bool:
    return type(None) in typing.get_args(hint)


def _mentions(hint: Any, kind: type) -> bool:
    return hint is kind or any(_mentions(a, kind) for a in typing.get_args(hint))


def valid_looking(cls: type, field: dataclasses.Field[Any]) -> st.SearchStrategy[Any]:
    """Values of the right kind for ``field`` of ``cls`` (not necessarily in range)."""
    hint = typing.get_type_hints(cls)[field.name]
    default = (
        field.default if field.default is not dataclasses.MISSING
        else field.default_factory() if field.default_factory is not dataclasses.MISSING
        else None
    )
    options: list[st.SearchStrategy[Any]] = [st.just(default)]
    lits = literal_options(hint)
    if lits:
        options.append(st.sampled_from(lits))
        options.append(st.sampled_from([str(x).upper() for x in lits] + [f" {lits[0]}"]))
    if _accepts_none(hint):
        options.append(st.none())
    if _mentions(hint, bool):
        options.append(st.booleans())
    elif _mentions(hint, float):
        options.append(st.sampled_from([0.0, 0.5, 0.9, 0.999, 1.0, 1e-12, 1e-30, 2.0, 10.0]))
        options.append(st.floats(min_value=-2.0, max_value=2.0))
    elif _mentions(hint, int):
        options.append(st.integers(min_value=-2, max_value=10_000))
    if _mentions(hint, tuple):
        options.append(st.sampled_from([(), (2.0,), (0.0,), (2.0, 4.0), [2.0], (-1.0,)]))
    return st.one_of(*options)


#: Sentinel: leave a field out (its default applies).
OMIT: Any = object()


def field_values(cls: type, field: dataclasses.Field[Any]) -> st.SearchStrategy[Any]:
    """Mostly :data:`OMIT` or valid-looking, sometimes hostile: the drawn value of one field."""
    return st.sampled_from(["omit"] * 5 + ["valid"] * 3 + ["hostile"] * 2).flatmap(
        lambda mode: st.just(OMIT) if mode == "omit"
        else valid_looking(cls, field) if mode == "valid"
        else hostile_values()
    )
