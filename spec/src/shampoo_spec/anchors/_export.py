"""What the three exporters share: the list of what a target cannot express, the exact
reciprocal of a root, and the round-trip check that closes every export.

Each ``to_x`` (``to_meta``, ``to_google``, ``to_tearfree``) writes one helper per
section of the anchor's arguments, each noting in a :class:`_Lacks` what it
cannot express; a final re-import (:func:`_check_round_trip`) notes whatever
they missed, so ``to_x`` never returns arguments that import to another config.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from ..config import (
    OrderOverride,
    ShampooConfig,
    config_to_dict,
    flatten,
)
from ..errors import Inexpressible


class _Lacks:
    """The fields a target cannot express: ``path -> "path = value (why)"``, first reason wins."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.items: dict[str, str] = {}

    def need(self, ok: bool, path: str, value: Any, why: str) -> None:
        """Notes ``path`` (holding ``value``) as inexpressible unless ``ok``."""
        if not ok and path not in self.items:
            self.items[path] = f"{path} = {value!r} ({why})"

    def same(self, path: str, value: Any, wanted: Any, why: str) -> None:
        """Notes ``path`` unless ``value == wanted`` (the only value the target gives)."""
        self.need(value == wanted, path, value, f"{why}; {self.target} gives {wanted!r}")

    def raise_if_any(self) -> None:
        if self.items:
            listed = "; ".join(self.items[k] for k in sorted(self.items))
            raise Inexpressible(
                f"{self.target} cannot express {len(self.items)} option(s) of this config: "
                f"{listed}."
            )


def _reciprocal(root: float) -> float | None:
    """An exponent e with ``1.0 / e == root`` exactly (Meta's exponents are 1 / root), or None."""
    if root == 0.0:
        return 0.0
    e = 1.0 / root
    candidates = [e]
    up = down = e
    for _ in range(4):
        up, down = math.nextafter(up, math.inf), math.nextafter(down, 0.0)
        candidates += [up, down]
    for candidate in candidates:
        if candidate > 0 and 1.0 / candidate == root:
            return candidate
    return None


def _canonical(config: ShampooConfig) -> ShampooConfig:
    """``config`` with single-root overrides of orders > 1 written one root per dim."""
    items = tuple(
        OrderOverride(order=item.order, roots=item.roots * item.order)
        if len(item.roots) == 1 and item.order > 1 else item
        for item in config.exponents.overrides_by_order
    )
    if items == config.exponents.overrides_by_order:
        return config
    exponents = dataclasses.replace(config.exponents, overrides_by_order=items)
    return dataclasses.replace(config, exponents=exponents)


def _check_round_trip(
    config: ShampooConfig, kwargs: dict[str, Any], lacks: _Lacks,
    importer: Callable[[dict[str, Any]], ShampooConfig],
) -> None:
    """Re-imports ``kwargs``; every field that comes back different is noted as lacking.

    A safety net under the section helpers: whatever they missed is still
    named, so ``to_x`` never returns kwargs that import to another config.
    """
    try:
        back = importer(kwargs)
    except (ValueError, NotImplementedError) as error:
        lacks.need(False, "(the exported arguments)", kwargs, f"re-import failed: {error}")
        return
    want: dict[str, Any] = {}
    got: dict[str, Any] = {}
    flatten("", config_to_dict(_canonical(config)), want)
    flatten("", config_to_dict(back), got)
    for key in sorted(set(want) | set(got)):
        if want.get(key, "<absent>") != got.get(key, "<absent>"):
            lacks.same(key, want.get(key, "<absent>"), got.get(key, "<absent>"),
                       "no argument gives it")
