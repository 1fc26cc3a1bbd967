"""Reading the anchors' JSON arguments: the helpers the three importers share.

One reader per kind of value, each raising ``ValueError`` that names the key
path, the value and what is allowed (never a bare ``int()``, ``float()`` or
``bool()`` conversion, so a hostile value fails with a message, not an
``OverflowError`` or a silent truncation):

- :class:`Args`: a kwargs dict; refuses unknown keys, reads a key with the
  anchor's default, refuses unsupported values with ``NotImplementedError``;
- :func:`type_of`: the ``"type"`` of a nested config dict (Meta's classes);
- :func:`number`: a finite number (``"inf"`` only where asked for);
- :func:`integer`: an integral number (2.0 reads as 2, 2.5 is refused) in
  a range, at most :data:`~shampoo_spec.MAX_INTEGER`;
- :func:`dim_limit`: an integer >= 1, or ``"inf"`` (unbounded);
- :func:`boolean`: a real ``true``/``false`` (never a string, a number or null);
- :func:`choice`: an enum given by its member name, by ``"Enum.NAME"`` (any
  dotted prefix, e.g. ``"GraftingType.ADAGRAD"``), or by the enum's value
  where the anchor's enum has values other than its names (Google's
  ``GraftingType.ADAGRAD`` is 2);
- :func:`dtype`: a dtype as ``"float32"`` or ``"torch.float32"`` (the prefixes
  the anchor's framework uses).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from .._validate import MAX_INTEGER, _shown

T = TypeVar("T")

#: Stand-in for an unbounded dim (``math.inf``): the config's largest integer,
#: above any tensor dim a backend can index with 32-bit sizes.
UNBOUNDED = MAX_INTEGER

_INF_NAMES = ("inf", "infinity", "math.inf")


def _refuse(owner: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{owner} = {_shown(value)} is invalid: allowed {allowed}.")


class Args:
    """A kwargs dict of ``owner`` (an importer or a nested config), limited to ``known`` keys.

    Every key other than ``known`` and ``"type"`` is refused with ``ValueError``
    naming the unknown keys and listing the allowed ones.
    """

    def __init__(self, owner: str, data: Any, known: set[str]) -> None:
        if not isinstance(data, Mapping):
            raise ValueError(f"{owner} = {data!r} is invalid: allowed a JSON object (dict).")
        self.owner = owner
        #: How errors name a key: bare at the top level, ``owner.key`` when nested.
        self.prefix = "" if owner.startswith("from_") else owner + "."
        self.data = dict(data)
        #: The keys read so far, in order (see :meth:`section`).
        self.read: list[str] = []
        unknown = sorted(set(self.data) - known - {"type"})
        if unknown:
            raise ValueError(
                f"{owner} has unknown key(s) {unknown}: allowed keys are {sorted(known)}."
            )

    def __contains__(self, key: str) -> bool:
        return key in self.data

    def get(self, key: str, default: Any) -> Any:
        """The value of ``key``, or the anchor's ``default`` when it is missing."""
        self.read.append(key)
        return self.data.get(key, default)

    @contextmanager
    def section(self, *, since_start: bool = False) -> Iterator[None]:
        """Name the anchor's arguments in a config section's own ``ValueError``.

        A section's config dataclass refuses a value with our field's name
        (``root_inverse.failure_threshold = 0.0``); the user gave an anchor
        argument (``inverse_failure_threshold``). Around the reading and
        building of one section (or, ``since_start``, of the whole config),
        such an error is re-raised naming the given arguments read there (or,
        when none was given there, those read before it).
        """
        start = 0 if since_start else len(self.read)
        try:
            yield
        except ValueError as err:
            keys = [k for k in dict.fromkeys(self.read[start:]) if k in self.data]
            if not keys:  # a value read before the section (Meta's shared betas, ...)
                keys = [k for k in dict.fromkeys(self.read) if k in self.data]
            if keys and not any(self.prefix + k in str(err) for k in keys):
                given = ", ".join(f"{self.prefix}{k} = {_shown(self.data[k])}" for k in keys)
                raise ValueError(f"{self.owner}: {given}: {err}") from err
            raise

    def number(self, key: str, default: Any, *, inf_ok: bool = False) -> float:
        """``key`` as a finite float (see :func:`number`); errors name the key path."""
        return number(self.prefix + key, self.get(key, default), inf_ok=inf_ok)

    def integer(
        self, key: str, default: Any, *, low: int | None = None, high: int = MAX_INTEGER
    ) -> int:
        """``key`` as an int in [low, high] (see :func:`integer`); errors name the key path."""
        return integer(self.prefix + key, self.get(key, default), low=low, high=high)

    def flag(self, key: str, default: bool) -> bool:
        """``key`` as a bool (``true``/``false`` only), ``default`` when missing."""
        return boolean(self.prefix + key, self.get(key, default))

    def unsupported(self, key: str, ok: Any, what: str) -> None:
        """Raise NotImplementedError when ``key`` is present with a value other than ``ok``.

        When ``ok`` is a bool the value must be a bool too (``1`` is not
        ``true``): anything else is a ValueError.
        """
        if key not in self.data or self.data[key] is None:
            return
        if isinstance(ok, bool) and not isinstance(self.data[key], bool):
            raise _refuse(self.prefix + key, self.data[key], "true or false")
        if self.data[key] != ok:
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


def number(owner: str, value: Any, *, inf_ok: bool = False) -> float:
    """``value`` as a finite float: an int or float, not a bool.

    With ``inf_ok``, ``"inf"`` / ``"infinity"`` / ``"math.inf"`` (any case) or a
    float inf read as ``math.inf``. NaN, -inf and ints beyond float's range
    (10**400) are refused.
    """
    if inf_ok and isinstance(value, str) and value.lower() in _INF_NAMES:
        return math.inf
    allowed = "a finite number" + (' or "inf"' if inf_ok else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _refuse(owner, value, allowed)
    try:
        x = float(value)
    except OverflowError:
        raise _refuse(owner, value, allowed) from None
    if x == math.inf and inf_ok:
        return x
    if not math.isfinite(x):
        raise _refuse(owner, value, allowed)
    return x


def integer(owner: str, value: Any, *, low: int | None = None, high: int = MAX_INTEGER) -> int:
    """``value`` as an int in [low, high]: an int, or a float with an integral value.

    2.0 reads as 2; 2.5, a bool, a string, NaN, inf and anything out of range
    are refused (``high`` defaults to :data:`~shampoo_spec.MAX_INTEGER`).
    """
    lo = low if low is not None else -high
    allowed = f"an integer in [{lo}, {high}]"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _refuse(owner, value, allowed)
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise _refuse(owner, value, allowed)
        value = int(value)
    if not lo <= value <= high:
        raise _refuse(owner, value, allowed)
    return int(value)


def dim_limit(owner: str, value: Any) -> int:
    """A bound on a dim: an integer >= 1, or inf as :data:`UNBOUNDED`."""
    allowed = f"an integer >= 1 or inf (integers at most {MAX_INTEGER})"
    if isinstance(value, str) and value.lower() in _INF_NAMES:
        return UNBOUNDED
    if isinstance(value, float) and value == math.inf:
        return UNBOUNDED
    try:
        return integer(owner, value, low=1)
    except ValueError:
        raise _refuse(owner, value, allowed) from None


def boolean(owner: str, value: Any) -> bool:
    """``value`` if it is a bool; anything else (``"false"``, 0, null) is refused."""
    if not isinstance(value, bool):
        raise _refuse(owner, value, "true or false")
    return value


def choice(
    owner: str,
    value: Any,
    table: Mapping[str, T],
    *,
    enum: str | None = None,
    values: Mapping[int, str] | None = None,
) -> T:
    """The entry of ``table`` for an enum member given by name, ``"Enum.NAME"`` or value.

    ``value`` is the member name (``"ADAGRAD"``); with ``enum`` (the anchor's
    enum class name, e.g. ``"GraftingType"``) also ``"GraftingType.ADAGRAD"``
    with any dotted prefix (``"distributed_shampoo.GraftingType.ADAGRAD"``);
    with ``values`` (int value -> member name) also the member's int value
    (never a bool). Anything else is refused naming what is allowed.
    """
    name: Any = value
    if enum is not None and isinstance(value, str) and "." in value:
        parts = value.split(".")
        if len(parts) >= 2 and parts[-2] == enum and all(p.isidentifier() for p in parts):
            name = parts[-1]
    elif values is not None and isinstance(value, int) and not isinstance(value, bool):
        name = values.get(value)
    if isinstance(name, str) and name in table:
        return table[name]
    allowed = f"one of {sorted(table)}"
    if enum is not None:
        allowed += f" (or {enum}.NAME"
        if values is not None:
            shown = ", ".join(f"{v}={n}" for v, n in sorted(values.items()) if n in table)
            allowed += f", or the value: {shown}"
        allowed += ")"
    raise _refuse(owner, value, allowed)


#: Floating dtypes by name: the ones a framework can hold tensors in.
FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")


def dtype(owner: str, value: Any, prefixes: tuple[str, ...]) -> str:
    """A floating dtype given as its name (``"float32"``) or with a prefix (``"torch.float32"``).

    ``prefixes`` are the framework's spellings (``("torch.",)`` for Meta).
    Returns the bare name, one of :data:`FLOAT_DTYPES`; anything else (an
    integer dtype, another framework's prefix, a non-string) is refused.
    """
    if isinstance(value, str):
        name = value
        for prefix in prefixes:
            if value.startswith(prefix):
                name = value[len(prefix):]
                break
        if name in FLOAT_DTYPES:
            return name
    spelled = ", ".join(f'"{p}{FLOAT_DTYPES[2]}"' for p in ("", *prefixes))
    raise _refuse(owner, value, f"a floating dtype, one of {list(FLOAT_DTYPES)} (as {spelled})")


def schedule_start(schedule_fn: Callable[[Any], Any]) -> float:
    """``schedule_fn(0)`` of a callable learning rate (an optax schedule of the 0-based
    count), as a finite float; else ValueError naming ``learning_rate(0)``."""
    try:
        value = float(schedule_fn(0))
    except (TypeError, ValueError, ArithmeticError) as err:
        raise ValueError(
            f"learning_rate(0) failed ({err}): allowed a number or a callable of the "
            "0-based step count returning one (an optax schedule)."
        ) from None
    return number("learning_rate(0)", value)
