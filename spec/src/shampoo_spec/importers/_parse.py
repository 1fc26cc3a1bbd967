"""Reading the anchors' JSON arguments: the helpers both importers share.

One reader per kind of value, each raising ``ValueError`` that names the key
and what is allowed:

- :class:`Args`: a kwargs dict; refuses unknown keys, reads a key with the
  anchor's default, refuses unsupported values with ``NotImplementedError``;
- :func:`type_of`: the ``"type"`` of a nested config dict (Meta's classes);
- :func:`number`, :func:`dim_limit`: numbers, ``"inf"`` included;
- :func:`choice`: an enum given by its member name.

Booleans are read with ``bool(...)`` by :meth:`Args.flag` (truthiness).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeVar

from .._validate import MAX_INTEGER

T = TypeVar("T")

#: Stand-in for an unbounded dim (``math.inf``): the config's largest integer,
#: above any tensor dim a backend can index with 32-bit sizes.
UNBOUNDED = MAX_INTEGER


class Args:
    """A kwargs dict of ``owner`` (an importer or a nested config), limited to ``known`` keys.

    Every key other than ``known`` and ``"type"`` is refused with ``ValueError``
    naming the unknown keys and listing the allowed ones.
    """

    def __init__(self, owner: str, data: Any, known: set[str]) -> None:
        if not isinstance(data, Mapping):
            raise ValueError(f"{owner} = {data!r} is invalid: allowed a JSON object (dict).")
        self.owner = owner
        self.data = dict(data)
        unknown = sorted(set(self.data) - known - {"type"})
        if unknown:
            raise ValueError(
                f"{owner} has unknown key(s) {unknown}: allowed keys are {sorted(known)}."
            )

    def __contains__(self, key: str) -> bool:
        return key in self.data

    def get(self, key: str, default: Any) -> Any:
        """The value of ``key``, or the anchor's ``default`` when it is missing."""
        return self.data.get(key, default)

    def number(self, key: str, default: Any) -> float:
        """``key`` as a float (see :func:`number`); errors name ``key``."""
        return number(key, self.get(key, default))

    def flag(self, key: str, default: bool) -> bool:
        """``key`` as a bool: its truthiness, ``default`` when missing."""
        return bool(self.get(key, default))

    def unsupported(self, key: str, ok: Any, what: str) -> None:
        """Raise NotImplementedError when ``key`` is present with a value other than ``ok``."""
        if key in self.data and self.data[key] != ok and self.data[key] is not None:
            raise NotImplementedError(
                f"{self.owner}.{key} = {self.data[key]!r} is not supported yet ({what})."
            )


def type_of(owner: str, cfg: Any) -> str | None:
    """The ``"type"`` (Meta class name) of the nested config ``cfg``; None for null."""
    if cfg is None:
        return None
    if not isinstance(cfg, Mapping) or not isinstance(cfg.get("type"), str):
        raise ValueError(
            f"{owner} = {cfg!r} is invalid: allowed null or an object with a 'type' key "
            "naming the Meta config class."
        )
    return str(cfg["type"])


def number(owner: str, value: Any) -> float:
    """``value`` as a float: an int or float (not a bool), or ``"inf"`` / ``"math.inf"``."""
    if isinstance(value, str) and value.lower() in ("inf", "infinity", "math.inf"):
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{owner} = {value!r} is invalid: allowed a number.")
    return float(value)


def dim_limit(owner: str, value: Any) -> int:
    """A bound on a dim: an integer >= 1, or inf as :data:`UNBOUNDED`."""
    x = number(owner, value)
    if x == math.inf:
        return UNBOUNDED
    if not x.is_integer() or x < 1:
        raise ValueError(f"{owner} = {value!r} is invalid: allowed an integer >= 1 or inf.")
    return int(x)


def choice(owner: str, value: Any, table: Mapping[str, T]) -> T:
    """The entry of ``table`` for the enum member name ``value``."""
    if value not in table:
        raise ValueError(f"{owner} = {value!r} is invalid: allowed one of {sorted(table)}.")
    return table[value]
