"""JSON round trip of :class:`ShampooConfig`: plain dicts, lists and scalars.

``config_from_dict(config_to_dict(c)) == c`` for every valid config. Unknown
keys are rejected with the list of known ones, so a typo never silently
falls back to a default.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .config import (
    BlockingConfig,
    CoupledNewtonConfig,
    DiagonalPreconditionerConfig,
    EigenvalueCorrectionConfig,
    EighConfig,
    EpsilonConfig,
    ExponentConfig,
    FailureConfig,
    FrequentDirectionsConfig,
    GradientFilterConfig,
    GraftingConfig,
    HigherOrderNewtonConfig,
    IterateAveragingConfig,
    LowRankRootConfig,
    MomentumConfig,
    OrderOverride,
    ScheduleConfig,
    ShampooConfig,
    SpectralDescentConfig,
    StatisticsConfig,
    WeightDecayConfig,
)

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


def config_to_dict(config: ShampooConfig) -> dict[str, Any]:
    """Nested plain dict of every field (JSON-serialisable)."""
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


def config_from_dict(data: dict[str, Any]) -> ShampooConfig:
    """Inverse of :func:`config_to_dict`; missing keys take our defaults."""
    kwargs = _check_keys("ShampooConfig", data, ShampooConfig)
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
    return ShampooConfig(**kwargs)


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{prefix}.{key}" if prefix else key, item, out)
    else:
        out[prefix] = value


def config_differences(saved: ShampooConfig, current: ShampooConfig) -> list[str]:
    """The fields where two configs differ, as ``"section.field: saved -> current"``.

    Empty when they are equal. Checkpoint loaders use it to refuse a state
    saved under another config, naming every field that differs.
    """
    before: dict[str, Any] = {}
    after: dict[str, Any] = {}
    _flatten("", config_to_dict(saved), before)
    _flatten("", config_to_dict(current), after)
    return [
        f"{key}: {before.get(key, '<absent>')!r} -> {after.get(key, '<absent>')!r}"
        for key in sorted(set(before) | set(after))
        if before.get(key, "<absent>") != after.get(key, "<absent>")
    ]
