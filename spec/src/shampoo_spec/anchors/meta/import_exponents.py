"""Meta's ``inverse_exponent_override`` as the roots of eq. (12) (``ExponentConfig``) and
of eq. (17) (``EigenvalueCorrectionConfig``), for :mod:`.import_preconditioner`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ...config import (
    EigenvalueCorrectionConfig,
    EighConfig,
    ExponentConfig,
    OrderOverride,
    RootInverseConfig,
)
from .._parse import (
    Args,
    integer,
    number,
)
from .keys import (
    Placement,
    Shared,
)

#: The largest block order an override may name: no tensor has more dims
#: (NumPy's limit), and a scalar exponent expands to ``order`` roots.
MAX_ORDER = 64

_OVERRIDE = "preconditioner_config.inverse_exponent_override"
_IGNORED = "preconditioner_config.ignored_basis_change_dims"


def _int_key(owner: str, key: Any, *, high: int) -> int:
    """A JSON object key naming an order or a dim: an int, or a string of digits."""
    if isinstance(key, str) and key.strip().isdigit() and len(key) <= 20:
        key = int(key)
    return integer(f"{owner} key", key, low=0, high=high)


def _by_int_key(owner: str, data: Any, what: str, *, high: int) -> dict[int, Any]:
    """``data`` (a JSON object) with its keys read by :func:`_int_key`; duplicates refused."""
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{owner} = {data!r} is invalid: allowed an object mapping {what}.")
    out: dict[int, Any] = {}
    for key, value in data.items():
        k = _int_key(owner, key, high=high)
        if k in out:
            raise ValueError(f"{owner} names {k} twice (as {key!r} and another key).")
        out[k] = value
    return out


def _exponent(owner: str, value: Any, *, zero_ok: bool) -> float:
    """A Meta exponent e (root 1/e): finite, > 0, or 0 (= not preconditioned) when allowed."""
    e = number(owner, value)
    allowed = "an exponent >= 0 (0: not preconditioned)" if zero_ok else "an exponent > 0"
    if e < 0 or (e == 0 and not zero_ok) or (e != 0 and not math.isfinite(1.0 / e)):
        raise ValueError(f"{owner} = {value!r} is invalid: allowed {allowed} with 1/e finite.")
    return e


def _exponents(overrides: Any, ignored: Any = None) -> ExponentConfig:
    """Reads ``inverse_exponent_override`` and ``ignored_basis_change_dims``.

    Returns ``exponents`` (eq. 12): Meta's override maps order -> exponent e
    (or {dim: e}), root = 1/e, e = 0 -> root 0 (not preconditioned); an
    ignored dim gets root 0. Order 0 is skipped (0-d blocks only exist with
    ``target_parameter_dimensionality`` = inf). Orders and dims are integers
    (JSON keys: strings of digits), orders at most :data:`MAX_ORDER`.
    """
    if overrides in (None, {}) and ignored in (None, {}):
        return ExponentConfig()
    by_order = _by_int_key(
        _OVERRIDE, overrides, "order -> exponent or order -> {dim: exponent}", high=MAX_ORDER
    )
    skipped = _by_int_key(_IGNORED, ignored, "order -> [dim, ...]", high=MAX_ORDER)
    items: list[OrderOverride] = []
    for order in sorted(set(by_order) | set(skipped)):
        if order == 0:
            continue
        value = by_order.get(order, {})
        path = f"{_OVERRIDE}.{order}"
        default = 1.0 / (2.0 * order)
        if isinstance(value, Mapping):
            per_dim = {
                d: _exponent(f"{path}.{d}", e, zero_ok=True)
                for d, e in _by_int_key(path, value, "dim -> exponent", high=MAX_ORDER).items()
            }
            exps = [per_dim.get(d, default) for d in range(order)]
        else:
            exps = [_exponent(path, value, zero_ok=True)] * order
        dims = skipped.get(order, [])
        if not isinstance(dims, (list, tuple)):
            raise ValueError(
                f"{_IGNORED}.{order} = {dims!r} is invalid: allowed a list of dims."
            )
        skip = {integer(f"{_IGNORED}.{order}[]", d, low=0, high=MAX_ORDER) for d in dims}
        roots = tuple(0.0 if (e == 0 or d in skip) else 1.0 / e for d, e in enumerate(exps))
        items.append(OrderOverride(order=order, roots=roots))
    return ExponentConfig(overrides_by_order=tuple(items))


def _eigenvalue_correction(
    p: Args, shared: Shared, root_inverse: RootInverseConfig, placement: Placement,
    drop_weight: bool = False,
) -> EigenvalueCorrectionConfig:
    """Reads ``inverse_exponent_override`` of ``EigenvalueCorrectedShampooPreconditionerConfig``.

    Returns ``eigenvalue_correction`` (eq. 17): beta2 = betas[1], epsilon,
    bias correction = use_bias_correction. ``drop_weight``
    (``drop_weighting_factor_on_gsquare``): Meta also weighs the corrected
    eigenvalues' update by 1 (``ema_weight="one"``) and leaves their bias
    correction at 1, as the factors' (shampoo_preconditioner_list.py,
    ``update_preconditioners``: one ``_bias_correction2`` and one
    ``_weighting_factor`` for both). An order o the override maps to
    e > 0 gets root 1/e, every other order Meta's exponent 1/2 (root 2).
    Canonical form: a map naming every order 1..MAX_ORDER sets ``root`` from
    order MAX_ORDER; ``roots_by_order`` lists the orders whose root differs
    from ``root``. Needs eigh roots with the ridge placement.
    """
    if not isinstance(root_inverse, EighConfig) or placement != "ridge":
        raise NotImplementedError(
            "preconditioner_config.amortized_computation_config: eigenvalue-corrected "
            "Shampoo is supported with EighEigendecompositionConfig only."
        )
    overrides = _by_int_key(
        _OVERRIDE, p.get("inverse_exponent_override", {}), "order -> exponent", high=MAX_ORDER
    )
    roots = {
        order: 1.0 / _exponent(f"{_OVERRIDE}.{order}", e, zero_ok=False)
        for order, e in overrides.items()
    }
    every_order = set(roots) >= set(range(1, MAX_ORDER + 1))
    root = roots[MAX_ORDER] if every_order else 2.0
    return EigenvalueCorrectionConfig(
        beta2=shared.beta2,
        ema_weight="one" if drop_weight else "one_minus_beta2",
        epsilon=shared.epsilon,
        bias_correction=shared.bias_correction and not drop_weight,
        root=root,
        roots_by_order=tuple(sorted((o, r) for o, r in roots.items() if r != root)),
    )
