"""What the three Muon backends share (``torch-muon``, ``optax-muon``, ``heavyball-muon``).

Muon (Keller Jordan's "momentum orthogonalized by Newton-Schulz") is, in the
spec's terms, spectral descent (docs/spec.md eq. 16c) on the filtered
gradient (eq. 15) with decoupled weight decay (eq. 21):

    F_t = beta1 F_{t-1} + (1 - beta1) G_t                (eq. 15, the EMA "momentum buffer")
    F~  = beta3 F_{t-1} + (1 - beta3) G_t                (Nesterov: beta3 = beta1^2, below)
    X   = F~ / max(||F~||_F, 1e-8), k times X <- a X + X (b A + c A^2), A = X^T X   (eq. 16c)
    W  <- W - lr (X + wd W)                              (eqs. 21, update decay)

The Nesterov forms of torch and optax (``grad.lerp(buf, mu)``) are
``(1 - mu) G + mu F_t = mu^2 F_{t-1} + (1 - mu^2) G``: eq. (15)'s F~ with
beta3 = mu^2 exactly (in exact arithmetic). Newton-Schulz is invariant to a
positive scale of its input (up to the norm floor), so a filter that differs
from eq. (15)'s by a constant factor (heavyball's ``G + F_t``) is the same
direction for matrices.

Every library orthogonalizes 2-D matrices only: the spec says this with
``blocking.skip_rank_lt = 2`` (vectors and scalars are left to the graft:
with no graft, P = F~, eq. 18), ``squeeze = False`` (a (1, 6) stays a 1 x 6
matrix, as the libraries keep it) and no blocking limit (no library splits a
matrix). What each library does with other shapes, and its shape-dependent
learning-rate factors, are in its module.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import currently_in_test_context, reject

from shampoo_conformance.thirdparty.soap import NO_DIM_LIMIT
from shampoo_spec import Inexpressible, ShampooConfig, config_differences
from shampoo_spec.config import (
    BlockingConfig,
    GradientFilterConfig,
    ScheduleConfig,
    SpectralDescentConfig,
    WeightDecayConfig,
)

#: Keller Jordan's coefficients (every library's default but heavyball's).
MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def blocking(merge: bool) -> BlockingConfig:
    """Whole matrices, size-1 dims kept, non-matrices left unpreconditioned; with
    ``merge`` the dims after the first merged into one (heavyball's ``flatten(1, -1)``)."""
    return BlockingConfig(
        max_preconditioner_dim=NO_DIM_LIMIT,
        merge_dims_up_to=NO_DIM_LIMIT if merge else None,
        merge_direction="last_to_first",
        squeeze=False,
        merge_target_rank=2,
        skip_rank_lt=2,
    )


def muon_config(
    *,
    lr: float,
    beta1: float,
    nesterov: bool,
    coefficients: tuple[float, float, float],
    steps: int,
    weight_decay: float,
    bias_correction: bool = False,
    beta3: float | None = None,
    merge: bool = False,
) -> ShampooConfig:
    """The spec's config of a Muon step (module docstring): eq. (16c) with Newton-Schulz,
    eq. (15)'s filter beta1 (beta3 = beta1^2 with Nesterov unless given), update weight
    decay, from step 1, no graft."""
    if not 0.0 <= beta1 < 1.0:
        raise Inexpressible(f"momentum/beta {beta1!r}: eq. (15) needs 0 <= beta1 < 1")
    a, b, c = (float(x) for x in coefficients)
    if beta1 == 0.0:
        flt = GradientFilterConfig()
    else:
        b3 = beta3 if beta3 is not None else (beta1 * beta1 if nesterov else None)
        flt = GradientFilterConfig(beta1=beta1, beta3=b3, bias_correction=bias_correction)
    return ShampooConfig(
        learning_rate=lr,
        spectral=SpectralDescentConfig(num_iterations=steps, coefficients=(a, b, c)),
        gradient_filter=flt,
        weight_decay=(WeightDecayConfig(value=weight_decay, type="update") if weight_decay
                      else WeightDecayConfig()),
        blocking=blocking(True),
        schedule=ScheduleConfig(start_preconditioning_step=1),
        factor_dtype="float64",
    )


def refuse_differences(backend: str, config: ShampooConfig, nearest: ShampooConfig) -> None:
    """Raise :class:`Inexpressible` naming every field where ``nearest`` (what the
    library's kwargs run) differs from ``config``."""
    diffs = config_differences(config, nearest)
    if diffs:
        raise Inexpressible(f"{backend} cannot express: " + "; ".join(diffs))


def matrices_only(backend: str, params: dict[str, np.ndarray], rule: str) -> None:
    """Raise :class:`Inexpressible` for the first parameter that is not a 2-D matrix
    (``rule``: what the library does with it instead, with its source line); inside a
    Hypothesis example the example is discarded instead (a random property draws such
    shapes; Hypothesis would report the refusal as a failure)."""
    for name, value in params.items():
        if np.ndim(value) != 2:
            if currently_in_test_context():
                reject()
            raise Inexpressible(
                f"{backend}: parameter {name!r} of shape {np.shape(value)} is not a matrix: "
                f"{rule}")


def beta_of(config: ShampooConfig) -> tuple[float, bool]:
    """(beta1, nesterov) of ``config``'s filter: Nesterov when beta3 is set."""
    f = config.gradient_filter
    return f.beta1, f.beta1 > 0 and f.beta3 is not None


def update_decay(config: ShampooConfig, backend: str) -> float:
    """The update weight decay of ``config`` (eq. 21); other types are refused."""
    wd = config.weight_decay
    if wd.value and (wd.type != "update" or wd.scale_by_lr_ratio):
        raise Inexpressible(f"{backend} cannot express: weight_decay.type = {wd.type!r} "
                            f"(its decay is decoupled: W <- W (1 - lr wd), eq. 21's 'update')")
    return float(wd.value)


def kwargs_or_reason(make: Any, config: ShampooConfig) -> str | None:
    """None when ``make(config)`` (a kwargs builder that refuses) succeeds, else why."""
    try:
        make(config)
    except Inexpressible as err:
        return str(err)
    return None
