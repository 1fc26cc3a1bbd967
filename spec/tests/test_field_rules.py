"""The declared field rules (``shampoo_spec.config.allowed``): every section found in
``shampoo_spec.config``, however many there are, refuses hostile numbers with a
ValueError naming ``section.field``, and a new field needs only its declaration."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import pkgutil
import types
import typing
from typing import Any

import pytest

import shampoo_spec.config
from shampoo_spec.config import allowed


def _sections() -> list[type]:
    """Every dataclass defined in a module of ``shampoo_spec.config``."""
    found: dict[str, type] = {}
    for info in pkgutil.iter_modules(shampoo_spec.config.__path__):
        module = importlib.import_module(f"shampoo_spec.config.{info.name}")
        for cls in vars(module).values():
            if (inspect.isclass(cls) and dataclasses.is_dataclass(cls)
                    and cls.__module__ == module.__name__):
                found[cls.__qualname__] = cls
    return [found[name] for name in sorted(found)]


SECTIONS = _sections()

#: Valid values for the fields a section has no default for.
REQUIRED: dict[tuple[str, str], Any] = {
    ("LowRankRootConfig", "rank"): 2,
    ("FrequentDirectionsConfig", "rank"): 2,
    ("OrderOverride", "order"): 1,
    ("OrderOverride", "roots"): (2.0,),
}


def _is_number(hint: Any) -> bool:
    """Whether ``hint`` is float, int, or one of them or None."""
    kinds = set(typing.get_args(hint)) - {type(None)} if isinstance(
        hint, types.UnionType) else {hint}
    return kinds in ({float}, {int})


def _required(cls: type) -> dict[str, Any]:
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            assert (cls.__name__, f.name) in REQUIRED, (
                f"add a valid value for {cls.__name__}.{f.name} to REQUIRED")
            kwargs[f.name] = REQUIRED[cls.__name__, f.name]
    return kwargs


NUMBER_FIELDS = [
    (cls, f.name)
    for cls in SECTIONS
    for f in dataclasses.fields(cls)
    if _is_number(typing.get_type_hints(cls)[f.name])
]


def test_the_sections_are_found() -> None:
    names = {cls.__name__ for cls in SECTIONS}
    assert {"ShampooConfig", "StatisticsConfig", "LowRankRootConfig", "OrderOverride",
            "SpectralDescentConfig", "FailureConfig"} <= names
    assert len(NUMBER_FIELDS) > 50


@pytest.mark.parametrize("cls", SECTIONS, ids=lambda c: c.__name__)
def test_every_field_declares_what_it_allows(cls: type) -> None:
    for f in dataclasses.fields(cls):
        assert isinstance(allowed.rule_of(f), allowed.Rule)
    cls(**_required(cls))  # the defaults are valid


@pytest.mark.parametrize(("cls", "name"), NUMBER_FIELDS,
                         ids=[f"{c.__name__}.{n}" for c, n in NUMBER_FIELDS])
@pytest.mark.parametrize("bad", [10**400, math.nan, "1"], ids=["10**400", "nan", "str"])
def test_every_number_field_refuses_hostile_values_naming_it(
        cls: type, name: str, bad: Any) -> None:
    with pytest.raises(ValueError) as err:
        cls(**{**_required(cls), name: bad})
    assert f".{name} = " in str(err.value) and "is invalid: allowed" in str(err.value)


def test_a_new_field_is_validated_from_its_declaration_alone() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class NewSection:
        rate: float = dataclasses.field(default=0.5, metadata=allowed.real(low=0.0, high=1.0))
        count: int | None = dataclasses.field(
            default=None, metadata=allowed.integer(low=1, none_means="unbounded"))
        floor: float = dataclasses.field(default=0.0, metadata=allowed.epsilon(divides=False))

        def __post_init__(self) -> None:
            allowed.check_fields(self, "new")

    NewSection(count=3)
    with pytest.raises(ValueError, match=r"^new\.rate = 2 is invalid: allowed a finite number "
                       r"in \[0\.0, 1\.0\]\.$"):
        NewSection(rate=2)
    with pytest.raises(ValueError, match=r"^new\.count = 0 is invalid: allowed an integer in "
                       r"\[1, 2147483647\], or None \(unbounded\)\.$"):
        NewSection(count=0)
    with pytest.raises(ValueError, match=r"^new\.floor = 1e-40 is invalid"):
        NewSection(floor=1e-40)

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Undeclared:
        rate: float = 0.5

        def __post_init__(self) -> None:
            allowed.check_fields(self, "undeclared")

    with pytest.raises(TypeError, match="declares no rule"):
        Undeclared()
