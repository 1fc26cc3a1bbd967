"""How close a backend must come to the reference: derived, never tuned.

docs/spec.md section 5 gives the derivation. In short, for a trajectory of
``steps`` steps whose factors (after epsilon, eq. 10) have condition numbers
at most kappa and sizes at most n, each root carries a relative error of
about n * u * kappa (backward-stable eigendecomposition; the statistics'
n-term inner products add n * u), and the errors of successive steps add:

    ||W_backend - W_ref|| <= C * n * u * kappa * steps * sum_s ||W_ref,s - W_ref,s-1||
                             + C * steps * u * (||W_0|| + max_s ||W_ref,s||)

with u the unit roundoff of the backend's dtype and C = 4 a safety factor
for the handful of operations per step. The second term is the rounding of
the parameters themselves. Each step errs at its own scale, so the first term
takes the path length (the net displacement where the steps go one way) and
the second the largest parameter on the way
(:func:`.divergence.first_divergence`). A coupled Newton root adds its stopping
tolerance (relative error of X about tolerance / r; the higher-order one
of eq. 11c too, with kappa of A + its own ridge) and its asymmetry
||X - X^T|| / sigma_min(X), measured on the reference's roots (a Newton
iterate is symmetric only in exact arithmetic; applying X, X^T or a
mirrored triangle is equally valid, spec section 5). A pseudo-inverse root
(eq. 10) inverts only the eigenvalues above its rank cutoff: kappa is over
those (the cut ones are rounding noise; a backend agrees only while none
is near the cutoff, which the cases ensure). Eigenvalue-corrected
Shampoo uses eigenvectors, whose error is u * ||A|| / gap (the smallest
eigenvalue gap), and divides by (D / bc)^(1/root) + eps >= eps (eq. 17), which
amplifies rounding noise along barely excited entries by up to
sqrt(||A|| / w) / eps: kappa there is the larger of the two.

A QR-eigenbasis root (eq. 10f) weighs the columns of an unconverged basis by their
Rayleigh quotients: the basis error u * ||A|| / gap enters it as it does eq. (17),
and kappa is the larger of ||A|| / gap and the root's own.

Spectral descent by Newton-Schulz (eq. 16c) adds, per step, k n u (|a| + 3|b|
+ 5|c|): each of its k iterations rounds n-term products and passes the error
on through the polynomial's derivative, at most |a| + 3|b| + 5|c| on the
singular values in [0, 1] the iteration starts from.

Inverse roots stored in ``inverse_root_dtype`` s (eqs. 11a, 16): the
reference emulates those roundings, so a backend differs from it only where
its unrounded root or product lies across a rounding boundary of s from the
reference's, one ulp of s in that entry; that enters the direction as a
root error does, so u is then the larger of the backend dtype's and s's
(:data:`STORAGE_UNIT_ROUNDOFF`; spec section 5). Likewise the eigenbases
and the corrected moment of eigenvalue correction stored in their dtypes
(eq. 17a): u is the coarsest of the set storage dtypes' (:func:`storage_dtypes`);
and int8 momentum (eq. 20b) for backends below float64 (:data:`INT8_UNIT_ROUNDOFF`),
int16 factors and roots (eq. 20c) likewise (:data:`INT16_UNIT_ROUNDOFF`).
Updates rounded to
``update_dtype`` c (eq. 21a): the same argument, one ulp of c of an entry's
update where the unrounded updates straddle a boundary; u is also at
least c's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import DTypeLike, NDArray

from shampoo_reference import ReferenceShampoo
from shampoo_reference.roots.regularize import effective_epsilon, regularized_eigenvalues
from shampoo_spec import (
    CoupledNewtonConfig,
    EighConfig,
    HigherOrderNewtonConfig,
    RootFailureError,
    ShampooConfig,
    is_root_step,
)

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


#: u of eq. (20b)'s int8 momentum: a flipped integer moves an entry by s = max|M_col| / 127,
#: a relative change of up to 2 / 254 ~ 2 * 2^-8, as a rounding at u = 2^-8 does.
INT8_UNIT_ROUNDOFF = 2.0**-8


#: u of eq. (20c)'s int16 factors and roots: a flipped integer moves an entry by
#: s = max|A_col| / 32767, a relative change of up to 2 / 65534 ~ 2 * 2^-16 of the column.
INT16_UNIT_ROUNDOFF = 2.0**-15


def storage_dtypes(config: ShampooConfig) -> tuple[str, ...]:
    """The storage dtypes whose roundings the reference emulates: ``inverse_root_dtype``
    (eqs. 11a, 16), ``factor_storage_dtype`` (eq. 11b) and eigenvalue correction's
    ``eigenvectors_dtype`` and ``corrected_eigenvalues_dtype`` (eq. 17a), those that
    are set."""
    ec = config.eigenvalue_correction
    named: list[str | None] = [config.inverse_root_dtype, config.factor_storage_dtype]
    if ec is not None:
        named += [ec.eigenvectors_dtype, ec.corrected_eigenvalues_dtype]
    return tuple(d for d in named if d is not None)


def coarsest_storage(config: ShampooConfig) -> str | None:
    """The set storage dtype with the largest unit roundoff (None: none is set)."""
    named = storage_dtypes(config)
    return max(named, key=STORAGE_UNIT_ROUNDOFF.__getitem__) if named else None


def config_unit_roundoff(config: ShampooConfig, dtype: DTypeLike) -> float:
    """u of the bound: the backend dtype's, or the coarsest storage dtype's (the roots',
    eigenbases', corrected moment's, or the update's, eq. 21a) when coarser.

    With int8 momentum (eq. 20b) and a backend below float64, also 2^-8: such a
    backend's M differs from the reference's by its own rounding, so an integer
    flips with probability about 127 kappa u per entry and step (a float64
    backend's flips, at u = 2^-53, are too rare to count: it keeps its own u).
    """
    u = unit_roundoff(dtype)
    for stored in storage_dtypes(config):
        u = max(u, STORAGE_UNIT_ROUNDOFF[stored])
    if config.update_dtype is not None:
        u = max(u, STORAGE_UNIT_ROUNDOFF[config.update_dtype])
    if config.momentum.storage != "float" and u > 2.0**-53:
        u = max(u, INT8_UNIT_ROUNDOFF)
    if config.statistics.quantized and u > 2.0**-53:
        # Eq. (20c) likewise: an int16 integer of a factor or root flips with
        # probability about 32767 kappa u per entry on such a backend.
        u = max(u, INT16_UNIT_ROUNDOFF)
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

    def allowed(self, w0_norm: float, ref_norm: float, path: float) -> float:
        """The error allowed at a step: ``path`` the reference's path length so far,
        ``ref_norm`` its largest parameter norm so far (module docstring)."""
        return self.rtol * path + self.atol_scale * (w0_norm + ref_norm)


def _basis_condition(lam: NDArray[np.float64]) -> float:
    """||A|| / gap, gap the smallest distance between two eigenvalues of A: a computed
    eigenbasis's relative error per unit roundoff (infinite for a repeated eigenvalue,
    whose basis rounding picks)."""
    gaps = np.diff(lam)
    gap = float(gaps.min()) if gaps.size else float("inf")
    return float(np.abs(lam).max()) / gap if gap > 0 else float("inf")


def _factor_kappa(config: ShampooConfig, a: NDArray[np.float64]) -> float:
    a = 0.5 * (a + a.T)
    lam = np.asarray(np.linalg.eigvalsh(a), dtype=np.float64)
    ec = config.eigenvalue_correction
    if ec is not None:
        # Rounding noise along a barely excited entry, divided by (D / bc)^(1/root) + eps,
        # which is at least eps (eq. 17; spec section 5): relative to the direction,
        # n u ||G|| / eps, where ||G||^2 <= ||A|| / w, w the weight of the newest
        # gradient in A (eq. 6).
        w = config.statistics.update_weight
        top = float(np.abs(lam).max())
        noise = (float(np.sqrt(top / w)) / ec.epsilon if ec.epsilon > 0 and w > 0
                 else float("inf"))
        return max(_basis_condition(lam), noise)
    method = config.root_inverse
    if isinstance(method, HigherOrderNewtonConfig):  # eq. (11c): its own ridge
        ridge = max(method.rel_epsilon * float(np.abs(a).sum(axis=1).max()), method.abs_epsilon)
        reg = lam + ridge
        return float(reg.max() / reg.min()) if reg.min() > 0 else float("inf")
    # Eq. (10f): a root from k QR steps weighs each column of an unconverged basis by its
    # Rayleigh quotient, which a rotation inside a cluster of eigenvalues changes: the
    # basis's error enters the root as eq. (17)'s does (spec section 5).
    basis = _basis_condition(lam) if isinstance(method, EighConfig) and method.qr else 1.0
    eps = effective_epsilon(a, config.epsilon)
    if config.epsilon.pseudo_inverse:
        # Eq. (10): only the eigenvalues above the rank cutoff are inverted.
        rtol = config.epsilon.rank_cutoff_rtol(a.shape[0], config.factor_dtype)
        kept = lam[lam > max(rtol * max(float(lam.max()), 0.0), config.epsilon.rank_atol)]
        return max(basis, float(kept.max() / kept.min()) if kept.size else 1.0)
    if isinstance(method, CoupledNewtonConfig) or config.epsilon.placement in (
        "ridge",
        "ridge_floor",
    ):
        lam = lam + eps
    reg = regularized_eigenvalues(lam, eps, config.epsilon.placement)
    return max(basis, float(reg.max() / reg.min()) if reg.min() > 0 else float("inf"))


def _root_asymmetry(roots: list[NDArray[np.float64] | None]) -> float:
    """Sum over a block's Newton roots of ||X - X^T||_2 / sigma_min(X) (spec section 5).

    A Newton iterate is a polynomial in A, symmetric only in exact arithmetic;
    X, X^T or either triangle mirrored (Meta's packed storage) are equally
    valid, and differ in the direction by up to this much relative to it.
    """
    total = 0.0
    for x in roots:
        if x is None or x.ndim != 2 or x.shape[0] < 2:
            continue
        sigma = np.linalg.svd(x, compute_uv=False)
        spread = float(np.linalg.norm(x - x.T, 2))
        if spread > 0.0:
            total += spread / float(sigma.min()) if sigma.min() > 0 else float("inf")
    return total


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
    hold_root_failures: bool = False,
) -> tuple[Bound, list[dict[str, NDArray[np.float64]]]]:
    """The bound and the reference trajectory it was measured on (one reference run).

    ``hold_root_failures``: a :class:`RootFailureError` (eq. 13, raised once the
    step is complete) does not end the run; the trajectory goes on.
    """
    opt = ReferenceShampoo(config, params)
    kappa, max_dim = 1.0, 1
    newton = isinstance(config.root_inverse, (CoupledNewtonConfig, HigherOrderNewtonConfig))
    # Eq. (20c)'s read-back roots are non-symmetric by the rule (the reference emulates it).
    free_symmetry = (newton and config.eigenvalue_correction is None
                     and not config.statistics.quantized)
    asymmetry = 0.0
    trajectory = []
    for t, g in enumerate(grads, start=1):
        try:
            trajectory.append(opt.step(g))
        except RootFailureError:
            if not hold_root_failures:
                raise
            trajectory.append({k: v.copy() for k, v in opt.params.items()})
        if not is_root_step(t, config.schedule):
            continue
        for st in opt.state.values():
            for bs in st.blocks:
                if free_symmetry:
                    asymmetry = max(asymmetry, _root_asymmetry(bs.inverse_roots))
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
    if newton:
        assert isinstance(config.root_inverse, (CoupledNewtonConfig, HigherOrderNewtonConfig))
        rtol += SAFETY * (config.root_inverse.tolerance + asymmetry) * steps
    sd = config.spectral
    if sd is not None and sd.method == "newton_schulz":
        # Eq. (16c): each of k iterations rounds its n-term products (n u) and passes
        # the error on through p'(s) = a + 3 b s^2 + 5 c s^4, |p'| <= |a| + 3|b| + 5|c|
        # on the singular values in [0, 1] it starts from.
        n = max((max(p.shape) for p in params.values() if p.ndim), default=1)
        a, b, c = (abs(x) for x in sd.coefficients)
        rtol += SAFETY * sd.num_iterations * n * u * (a + 3 * b + 5 * c) * steps
    bound = Bound(
        rtol=rtol,
        atol_scale=SAFETY * steps * u,
        kappa=kappa,
        max_dim=max_dim,
        steps=steps,
        unit_roundoff=u,
    )
    return bound, trajectory
