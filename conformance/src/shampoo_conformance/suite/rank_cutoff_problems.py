"""The config and streams every backend's tests of eq. (10g) share.

Tearfree's Shampoo rules with eq. (10g)'s cutoff over a parameter's blocks
(or eq. 10's per factor, the control), and a vector whose two blocks sum to
diag(1e4, ...) and diag(1, 1, 1, 1e-5): there eq. (10)'s own cutoff keeps
the 1e-5 direction and eq. (10g)'s drops it. The reference's, torch's and
JAX's ``test_parameter_rank_cutoff.py`` all check their backend on these,
so a change here moves all three together.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

import shampoo_spec as ss

#: Tearfree's relative rank cutoff (``_pth_inv_root``).
RTOL = 1e-6


def tearfree_shampoo(scope: Literal["factor", "parameter"], *, block: int = 4,
                     precondition_frequency: int = 1,
                     roots_take_effect: Literal["same_step", "next_step"] = "same_step",
                     **changes: Any) -> ss.ShampooConfig:
    """Sums from zero, pseudo-inverse roots at rtol 1e-6 with the cutoff of ``scope``,
    root 2 x the rank, blocks of ``block``, no graft, no momentum, learning rate 1 (the
    step is the direction), float64; ``changes`` replace whole sections."""
    config = ss.ShampooConfig(
        learning_rate=1.0,
        statistics=ss.StatisticsConfig(beta2=1.0, initial_value="zero"),
        epsilon=ss.EpsilonConfig(value=0.0, placement="pseudo_inverse", rank_rtol=RTOL,
                                 rank_cutoff_scope=scope),
        exponents=ss.ExponentConfig(default="preconditioned_dims"),
        grafting=ss.GraftingConfig(type="none"),
        momentum=ss.MomentumConfig(momentum=0.0),
        blocking=ss.BlockingConfig(max_preconditioner_dim=block, merge_dims_up_to=None),
        schedule=ss.ScheduleConfig(precondition_frequency=precondition_frequency,
                                   period_anchor="start", roots_before_start=True,
                                   roots_take_effect=roots_take_effect),
        factor_dtype="float64",
    )
    return replace(config, **changes)


def diagonal_stream() -> list[NDArray[np.float64]]:
    """Four gradients of an 8-vector: block 0 (entries 0-3) sums to diag(1e4, ...),
    block 1 to diag(1, 1, 1, 1e-5). The last is sqrt(1e-5) on entry 7, whose step is
    (1e-5)^(-1/2) sqrt(1e-5) = 1 under eq. (10) and 0 under eq. (10g) (1e-5 <= 1e-6 * 1e4)."""
    scales = [1.0, 1.0, 1.0, np.sqrt(1e-5)]
    grads = []
    for i in range(4):
        g = np.zeros(8)
        g[i], g[4 + i] = 100.0, scales[i]
        grads.append(g)
    return grads
