"""A block's statistics, eqs. (6)-(7): the factors and the root input A of eq. (10).

Eq. numbers refer to docs/spec.md: the gradient the statistics observe
(eq. 6c's average over a statistics period, or G), the factor update of
eq. (6) (with eq. 6b's KL form, eq. 6c's sketched observation, eq. 11b's
storage dtype and eq. 20c's int16 storage), and the bias correction and
trace scaling (eqs. 7, 7b) that make a factor the input of its root.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from shampoo_spec import ShampooConfig, is_statistics_step

from .linalg import factor_contraction, mode_product
from .rounding import round_to, scalar_in
from .state import BlockState, ParameterState, store_factor

Array = NDArray[np.float64]


def statistics_gradient(config: ShampooConfig, t: int, st: ParameterState, g: Array,
                        finite: NDArray[np.bool_]) -> Array:
    """Eq. (6c): G^ of eqs. (6) and (6c), ``S / s`` with ``average_gradients``, else G.

    The sum S takes this step's admitted entries (0 elsewhere, eq. 3) and
    is emptied after a statistics step.
    """
    if st.gradient_sum is None:
        return g
    st.gradient_sum = st.gradient_sum + np.where(finite, g, 0.0)
    observed = st.gradient_sum / config.schedule.statistics_frequency
    if is_statistics_step(t, config.schedule):
        st.gradient_sum = np.zeros_like(st.gradient_sum)
    return observed


def update_factors(config: ShampooConfig, bs: BlockState, observed: Array) -> None:
    """Eqs. (6), (6b), (6c) on a statistics step, on the statistics gradient ``observed``
    (G^ of eq. 6c): each factor decayed and added ``w G_(k) G_(k)^T``."""
    stats = config.statistics
    w = stats.update_weight
    s = config.factor_storage_dtype
    for k, lk in enumerate(bs.factors):
        if lk is None:
            continue
        if bs.sketches[k] is not None:  # eq. (6c): this step's observation only
            bs.factors[k] = factor_contraction(observed, k)
            continue
        if s is None:
            decayed = stats.beta2 * lk if stats.decays else lk
            gk = observed
            if stats.kl:  # eq. (6b): G x_{j != k} X_j, the roots held so far
                for j, xj in enumerate(bs.inverse_roots):
                    if j != k and xj is not None:
                        gk = mode_product(gk, xj, j)
            bs.factors[k] = decayed + w * factor_contraction(gk, k)
            if stats.quantized:
                store_factor(config, bs, "factor", k)  # eq. (20c)
            continue
        # Eq. (11b): the decay in float32 (c_s), rounded; the sum with the
        # working-precision w G G^T rounded once.
        decayed = round_to(scalar_in(stats.beta2, s) * lk, s) if stats.decays else lk
        bs.factors[k] = round_to(decayed + w * factor_contraction(observed, k), s)
    bs.statistics_updates += 1


def root_input(config: ShampooConfig, bs: BlockState, k: int) -> Array:
    """A of eq. (10) for factor k: bias-corrected (eq. 7), eq. (7b) applied."""
    cfg = config
    lk = bs.factors[k]
    assert lk is not None
    bc = cfg.statistics.bias_correction_factor(bs.statistics_updates)  # eq. (7)
    s = cfg.factor_storage_dtype
    # Eq. (11b): in s the division takes bc in float32 and rounds.
    a = lk / bc if s is None else round_to(lk / scalar_in(bc, s), s)
    tau = cfg.statistics.trace_scaling_exponent
    if tau > 0:  # eq. (7b)
        a = a * max(float(np.trace(a)), cfg.epsilon.value) ** -tau
    return a
