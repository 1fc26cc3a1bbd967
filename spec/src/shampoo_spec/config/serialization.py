"""JSON round trip of a :class:`ShampooConfig`: plain dicts, lists and scalars.

``ShampooConfig.from_dict(config_to_dict(c)) == c`` for every valid config
(``config_from_dict`` beside the class says the same). Unknown keys are
rejected with the list of known ones, so a typo never silently falls back to
a default. :func:`flatten` gives the ``"section.field"`` view that
:func:`config_differences`, the exporters' round-trip check and the
checkpoint loaders compare.

The sections are read here; the config itself is built by its class
(``ShampooConfig.from_dict``), so this module needs only the sections.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .execution import BlockingConfig, FailureConfig, ScheduleConfig
from .grafting import GraftingConfig
from .preconditioners import (
    DiagonalPreconditionerConfig,
    EigenvalueCorrectionConfig,
    SpectralDescentConfig,
)
from .roots import (
    CoupledNewtonConfig,
    EighConfig,
    ExponentConfig,
    HigherOrderNewtonConfig,
    OrderOverride,
)
from .sketches import FrequentDirectionsConfig, LowRankRootConfig
from .statistics import EpsilonConfig, StatisticsConfig
from .update import GradientFilterConfig, IterateAveragingConfig, MomentumConfig, WeightDecayConfig

_SECTIONS: dict[str, type[Any]] = {
    "statistics": StatisticsConfig,
    "epsilon": EpsilonConfig,
    "low_rank": LowRankRootConfig,
    "frequent_directions": FrequentDirectionsConfig,
    "exponents": ExponentConfig,
    "eigenvalue_correction": EigenvalueCorrectionConfig,
    "diagonal": DiagonalPreconditionerConfig,
    "spectral": SpectralDescentConfig,
    "grafting": GraftingConfig,
    "gradient_filter": GradientFilterConfig,
    "momentum": MomentumConfig,
    "averaging": IterateAveragingConfig,
    "weight_decay": WeightDecayConfig,
    "blocking": BlockingConfig,
    "schedule": ScheduleConfig,
    "failure": FailureConfig,
}
_ROOT_METHODS: dict[str, type[Any]] = {
    "eigh": EighConfig,
    "coupled_newton": CoupledNewtonConfig,
    "higher_order_newton": HigherOrderNewtonConfig,
}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_plain(x) for x in value]
    return value


def config_to_dict(config: Any) -> dict[str, Any]:
    """Nested plain dict of every field of a :class:`ShampooConfig` (JSON-serialisable)."""
    out = _plain(config)
    assert isinstance(out, dict)
    return out


def _check_keys(owner: str, data: Any, cls: type[Any]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ValueError(f"{owner} = {data!r} is invalid: allowed a JSON object (dict).")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(
            f"{owner} has unknown key(s) {unknown}: allowed keys are {sorted(known)}."
        )
    required = sorted(
        f.name for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        and f.name not in data
    )
    if required:
        raise ValueError(f"{owner} lacks the required key(s) {required}.")
    return dict(data)


def _section(name: str, cls: type[Any], data: Any) -> Any:
    kwargs = _check_keys(name, data, cls)
    if cls is ExponentConfig and "overrides_by_order" in kwargs:
        items = kwargs["overrides_by_order"]
        if not isinstance(items, (list, tuple)):
            raise ValueError(
                f"exponents.overrides_by_order = {items!r} is invalid: allowed a list of "
                "{'order': int, 'roots': [float, ...]} objects."
            )
        overrides = []
        for item in items:
            fields = _check_keys("exponents.overrides_by_order[]", item, OrderOverride)
            roots = fields.get("roots", ())
            if isinstance(roots, (list, tuple)):
                fields["roots"] = tuple(roots)
            overrides.append(OrderOverride(**fields))
        kwargs["overrides_by_order"] = tuple(overrides)
    if cls is SpectralDescentConfig and isinstance(kwargs.get("coefficients"), list):
        kwargs["coefficients"] = tuple(kwargs["coefficients"])  # JSON has no tuples
    if cls is EigenvalueCorrectionConfig and isinstance(kwargs.get("roots_by_order"), list):
        # JSON has no tuples: [[order, root], ...] back to pairs.
        kwargs["roots_by_order"] = tuple(
            tuple(item) if isinstance(item, list) else item for item in kwargs["roots_by_order"]
        )
    return cls(**kwargs)


def config_kwargs_from_dict(data: dict[str, Any], config_class: type[Any]) -> dict[str, Any]:
    """The keyword arguments of ``config_class`` (:class:`ShampooConfig`) that
    :func:`config_to_dict` wrote as ``data``, each section built; missing keys are left
    out (the class's defaults)."""
    kwargs = _check_keys(config_class.__name__, data, config_class)
    for name, cls in _SECTIONS.items():
        if name in kwargs and kwargs[name] is not None:
            kwargs[name] = _section(name, cls, kwargs[name])
    if "root_inverse" in kwargs:
        root = kwargs["root_inverse"]
        method = root.get("method", "eigh") if isinstance(root, dict) else None
        if not isinstance(method, str) or method not in _ROOT_METHODS:
            raise ValueError(
                f"root_inverse.method = {method!r} is invalid: allowed one of "
                f"{sorted(_ROOT_METHODS)}."
            )
        kwargs["root_inverse"] = _section("root_inverse", _ROOT_METHODS[method], root)
    return kwargs


def flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """Writes the leaves of the nested dict ``value`` into ``out`` as ``"prefix.key.key"``
    (``config_to_dict``'s output becomes ``{"section.field": value}``)."""
    if isinstance(value, dict):
        for key, item in value.items():
            flatten(f"{prefix}.{key}" if prefix else key, item, out)
    else:
        out[prefix] = value


def config_differences(saved: Any, current: Any) -> list[str]:
    """The fields where two configs differ, as ``"section.field: saved -> current"``.

    Empty when they are equal. Checkpoint loaders use it to refuse a state
    saved under another config, naming every field that differs.
    """
    before: dict[str, Any] = {}
    after: dict[str, Any] = {}
    flatten("", config_to_dict(saved), before)
    flatten("", config_to_dict(current), after)
    return [
        f"{key}: {before.get(key, '<absent>')!r} -> {after.get(key, '<absent>')!r}"
        for key in sorted(set(before) | set(after))
        if before.get(key, "<absent>") != after.get(key, "<absent>")
    ]
