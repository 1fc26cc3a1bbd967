"""What each field of a config section allows, declared in its dataclass metadata.

A section declares every field as ``field(default=..., metadata=allowed.real(low=0.0))``:
its kind (real, integer, epsilon, normal, choice, boolean, instance, or a
tuple with a check of its own), its range or options, and its flags (None
allowed, and whether an epsilon divides, so that 0 is refused).
:func:`check_fields` validates every field of a section in field order with
the validators of :mod:`shampoo_spec._validate`, so a bad value raises
``ValueError`` naming ``section.field``, the value and what is allowed, and a
new field gets that error from its declaration alone. A section's
``__post_init__`` calls it first and then checks only the rules that tie
several fields together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

from .. import _validate as v

#: The metadata key of a field's :class:`Rule`.
RULE = "shampoo_spec.allowed"

Kind = Literal["real", "integer", "epsilon", "normal", "choice", "boolean", "instance", "items"]

#: Checks a tuple field: ``(section name, field name, value, section)``; raises ValueError.
ItemsCheck = Callable[[str, str, Any, Any], None]


class Rule(NamedTuple):
    """What one field allows. ``optional``: None is allowed (and not mentioned in the
    error); ``none_means``: None is allowed, and the error says what it means."""

    kind: Kind
    optional: bool = False
    none_means: str | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    options: tuple[str, ...] = ()
    types: tuple[type, ...] = ()
    #: ``epsilon``: whether it divides (so 0 is refused): a bool, or the name of a
    #: boolean attribute of the section that says so.
    divides: bool | str = False
    items: ItemsCheck | None = None


def _declare(rule: Rule) -> Mapping[str, Rule]:
    return {RULE: rule}


def real(
    *, low: float | None = None, high: float | None = None, low_open: bool = False,
    high_open: bool = False, optional: bool = False,
) -> Mapping[str, Rule]:
    """A finite real number (an int or float, not a bool) in [low, high], ends open as flagged."""
    return _declare(Rule("real", optional=optional, low=low, high=high, low_open=low_open,
                         high_open=high_open))


def integer(
    *, low: int, high: int = v.MAX_INTEGER, optional: bool = False, none_means: str | None = None,
) -> Mapping[str, Rule]:
    """An int (not a bool) in [low, high]."""
    return _declare(Rule("integer", optional=optional, none_means=none_means, low=low, high=high))


def epsilon(*, divides: bool | str = False, optional: bool = False) -> Mapping[str, Rule]:
    """0 (unless it divides) or a finite real >= 2^-126 (float32's smallest normal)."""
    return _declare(Rule("epsilon", optional=optional, divides=divides))


def normal(*, none_means: str) -> Mapping[str, Rule]:
    """None, or a finite real >= 2^-126 (a float32 normal when rounded)."""
    return _declare(Rule("normal", none_means=none_means))


def choice(options: tuple[str, ...], *, none_means: str | None = None) -> Mapping[str, Rule]:
    """One of ``options`` (a string), or None where ``none_means`` says what None means."""
    return _declare(Rule("choice", none_means=none_means, options=options))


def boolean() -> Mapping[str, Rule]:
    """True or False."""
    return _declare(Rule("boolean"))


def instance(*types: type, optional: bool = False) -> Mapping[str, Rule]:
    """An instance of one of ``types`` (a section), or None when ``optional``."""
    return _declare(Rule("instance", optional=optional, types=types))


def items(check: ItemsCheck) -> Mapping[str, Rule]:
    """A tuple whose entries ``check`` validates (it names the field in its errors)."""
    return _declare(Rule("items", items=check))


def rule_of(field: dataclasses.Field[Any]) -> Rule:
    """The rule ``field`` declares; TypeError when it declares none (every field must)."""
    rule = field.metadata.get(RULE)
    if not isinstance(rule, Rule):
        raise TypeError(f"field {field.name!r} declares no rule in its metadata "
                        f"(shampoo_spec.config.allowed)")
    return rule


def check_value(section: Any, owner: str, name: str, value: Any, rule: Rule) -> None:
    """Raises ValueError naming ``owner.name`` unless ``value`` is what ``rule`` allows."""
    if value is None and (rule.optional or rule.none_means is not None):
        return
    match rule.kind:
        case "real":
            v.real(owner, name, value, low=rule.low, high=rule.high, low_open=rule.low_open,
                   high_open=rule.high_open)
        case "integer":
            low, high = int(rule.low or 0), int(rule.high or v.MAX_INTEGER)
            if rule.none_means is not None:
                v.optional_integer(owner, name, value, low=low, high=high,
                                   none_means=rule.none_means)
            else:
                v.integer(owner, name, value, low=low, high=high)
        case "epsilon":
            divides = rule.divides
            if isinstance(divides, str):
                divides = bool(getattr(section, divides))
            v.epsilon(owner, name, value, zero=not divides)
        case "normal":
            v.optional_normal(owner, name, value, none_means=str(rule.none_means))
        case "choice":
            v.choice(owner, name, value, rule.options, none_means=rule.none_means)
        case "boolean":
            v.boolean(owner, name, value)
        case "instance":
            v.instance(owner, name, value, rule.types)
        case "items":
            assert rule.items is not None
            rule.items(owner, name, value, section)


def check_fields(section: Any, owner: str) -> None:
    """Validates every field of the dataclass ``section`` by its declared rule, in field
    order; errors name ``owner.field`` (owner: the section's name in a config)."""
    for field in dataclasses.fields(section):
        check_value(section, owner, field.name, getattr(section, field.name), rule_of(field))
