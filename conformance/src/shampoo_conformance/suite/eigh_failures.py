"""A stream on which the reference's eigh roots (eq. 10b) pass and fail far from the threshold.

torch and JAX are compared with the reference on such a stream; the
comparison means something only where no eigh error lies near the
threshold (eq. 10b compares in float32, and backends' errors are rounding
noise of their own), which :func:`reference_eigh_failures` checks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import shampoo_spec as ss


def reference_eigh_failures(
    config: ss.ShampooConfig, params: dict[str, Any], grads: list[dict[str, Any]], tau: float
) -> int:
    """The reference's root failures over ``grads``, after checking that every eigh error
    of every root step is at least 100x from ``tau`` (and that some roots pass, some fail)."""
    from shampoo_reference import ReferenceShampoo, eigh_error
    from shampoo_reference.roots.eigh import eigh_input

    opt = ReferenceShampoo(config, params)
    passed = 0
    for g in grads:
        opt.step(g)
        if not ss.is_root_step(opt.t, config.schedule):
            continue
        for a in (a for st in opt.state.values() for bs in st.blocks for a in bs.factors):
            if a is None:
                continue
            if config.eigenvalue_correction is None:
                b = eigh_input(a, config.epsilon.value, config.epsilon.placement)
            else:
                b = 0.5 * (a + a.T)
            lam, q = np.linalg.eigh(b)
            e = eigh_error(b, lam, q)
            assert e <= tau / 100 or e >= tau * 100, e
            passed += e < tau
    assert opt.metrics.root_failures > 0 and passed > 0
    return opt.metrics.root_failures


__all__ = ["reference_eigh_failures"]
