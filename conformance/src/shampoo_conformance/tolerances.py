"""How close a backend must come to the reference: derived, never tuned.

docs/spec.md section 5 gives the derivation. In short, for a trajectory of
``steps`` steps whose factors (after epsilon, eq. 10) have condition numbers
at most kappa and sizes at most n, each root carries a relative error of
about n * u * kappa (backward-stable eigendecomposition; the statistics'
n-term inner products add n * u), and the errors of successive steps add:

    ||W_backend - W_ref|| <= C * n * u * kappa * steps * ||W_ref - W_0||
                             + C * steps * u * (||W_0|| + ||W_ref||)

with u the unit roundoff of the backend's dtype and C = 4 a safety factor
for the handful of operations per step. The second term is the rounding of
the parameters themselves. A coupled Newton root adds its stopping
tolerance (relative error of X about tolerance / r). Eigenvalue-corrected
Shampoo uses eigenvectors, whose error is u * ||A|| / gap (the smallest
eigenvalue gap), so kappa there also covers ||A|| / gap.

Inverse roots stored in ``inverse_root_dtype`` s (eqs. 11a, 16): the
reference emulates those roundings, so a backend differs from it only where
its unrounded root or product lies across a rounding boundary of s from the
reference's, one ulp of s in that entry; that enters the direction as a
root error does, so u is then the larger of the backend dtype's and s's
(:data:`STORAGE_UNIT_ROUNDOFF`; spec section 5). Updates rounded to
``update_dtype`` c (eq. 21a): the same argument, one ulp of c of an entry's
update where the unrounded updates straddle a boundary; u is also at
least c's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import DTypeLike, NDArray

from shampoo_reference import ReferenceShampoo
from shampoo_reference.linalg import effective_epsilon, regularized_eigenvalues
from shampoo_spec import CoupledNewtonConfig, ShampooConfig, is_root_step

SAFETY = 4.0


def unit_roundoff(dtype: DTypeLike) -> float:
    return float(np.finfo(np.dtype(dtype)).eps) / 2.0


#: u of each ``inverse_root_dtype`` (bfloat16 is no NumPy dtype): 2^-(significant bits).
STORAGE_UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8,
                         "float16": 2.0**-11}


def fraction_not_bitwise(ours: NDArray[np.float64], ref: NDArray[np.float64],
                         storage: str) -> float:
    """Fraction of entries of ``ours`` that differ from ``ref``; asserts each is within
    one ulp of the ``storage`` dtype (``inverse_root_dtype``) of ``ref``'s entry.

    One ulp at x is 2^floor(log2 |x|) * 2u, u from :data:`STORAGE_UNIT_ROUNDOFF`.
    """
    exponent = np.floor(np.log2(np.maximum(np.abs(ref), 1e-300)))
    ulp = np.exp2(exponent) * 2.0 * STORAGE_UNIT_ROUNDOFF[storage]
    assert np.all(np.abs(ours - ref) <= ulp), np.max(np.abs(ours - ref) / ulp)
    return float(np.mean(ours != ref))


def config_unit_roundoff(config: ShampooConfig, dtype: DTypeLike) -> float:
    """u of the bound: the backend dtype's, or the roots' storage dtype's or the
    update's (eq. 21a) when coarser."""
    u = unit_roundoff(dtype)
    if config.inverse_root_dtype is not None:
        u = max(u, STORAGE_UNIT_ROUNDOFF[config.inverse_root_dtype])
    if config.update_dtype is not None:
        u = max(u, STORAGE_UNIT_ROUNDOFF[config.update_dtype])
    return u


@dataclass(frozen=True)
class Bound:
    """The tolerance of one comparison and the quantities it was derived from."""

    rtol: float
    atol_scale: float
    kappa: float
    max_dim: int
    steps: int
    unit_roundoff: float

    def allowed(self, w0_norm: float, ref_norm: float, displacement: float) -> float:
        return self.rtol * displacement + self.atol_scale * (w0_norm + ref_norm)


def _factor_kappa(config: ShampooConfig, a: NDArray[np.float64]) -> float:
    a = 0.5 * (a + a.T)
    lam = np.asarray(np.linalg.eigvalsh(a), dtype=np.float64)
    if config.eigenvalue_correction is not None:
        gaps = np.diff(lam)
        gap = float(gaps.min()) if gaps.size else float("inf")
        return float(np.abs(lam).max() / gap) if gap > 0 else float("inf")
    eps = effective_epsilon(a, config.epsilon)
    if isinstance(config.root_inverse, CoupledNewtonConfig) or config.epsilon.placement in (
        "ridge",
        "ridge_floor",
    ):
        lam = lam + eps
    reg = regularized_eigenvalues(lam, eps, config.epsilon.placement)
    return float(reg.max() / reg.min()) if reg.min() > 0 else float("inf")


def trajectory_bound(
    config: ShampooConfig,
    params: dict[str, NDArray[np.float64]],
    grads: list[dict[str, NDArray[np.float64]]],
    dtype: DTypeLike,
) -> Bound:
    """The bound for running ``config`` on this stream in ``dtype`` (see module doc)."""
    return bound_and_reference(config, params, grads, dtype)[0]


def bound_and_reference(
    config: ShampooConfig,
    params: dict[str, NDArray[np.float64]],
    grads: list[dict[str, NDArray[np.float64]]],
    dtype: DTypeLike,
) -> tuple[Bound, list[dict[str, NDArray[np.float64]]]]:
    """The bound and the reference trajectory it was measured on (one reference run)."""
    opt = ReferenceShampoo(config, params)
    kappa, max_dim = 1.0, 1
    trajectory = []
    for t, g in enumerate(grads, start=1):
        trajectory.append(opt.step(g))
        if not is_root_step(t, config.schedule):
            continue
        for st in opt.state.values():
            for bs in st.blocks:
                for lk in bs.factors:
                    if lk is None:
                        continue
                    max_dim = max(max_dim, lk.shape[0])
                    n = bs.statistics_updates
                    beta2 = config.statistics.beta2
                    bc = (
                        1.0 - beta2**n
                        if (config.statistics.bias_correction and beta2 < 1 and n)
                        else 1.0
                    )
                    kappa = max(kappa, _factor_kappa(config, lk / bc))
    u = config_unit_roundoff(config, dtype)
    steps = len(grads)
    rtol = SAFETY * max_dim * u * kappa * steps
    if isinstance(config.root_inverse, CoupledNewtonConfig):
        rtol += SAFETY * config.root_inverse.tolerance * steps
    bound = Bound(
        rtol=rtol,
        atol_scale=SAFETY * steps * u,
        kappa=kappa,
        max_dim=max_dim,
        steps=steps,
        unit_roundoff=u,
    )
    return bound, trajectory
