"""Mutant backends: the reference with one realistic bug each.

The conformance suite must fail on every one of them (and pass on the
reference): that is how we know the suite can catch the bugs that
reimplementations of Shampoo actually ship. Each mutant is named
``mutant:<name>`` in :func:`shampoo_conformance.get_backend`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from shampoo_conformance.protocol import GradStream, Params, ParamsIn
from shampoo_reference import ReferenceShampoo, grafting
from shampoo_reference.roots.lobpcg import lobpcg_top_k
from shampoo_reference.roots.newton import root_inverse_coupled_newton
from shampoo_reference.roots.sketch import Sketch
from shampoo_reference.state import Array, BlockState, ParameterState
from shampoo_spec import CoupledNewtonConfig, EighConfig, ShampooConfig


class _WrongDefaultRoot(ReferenceShampoo):
    """Uses the square root for every factor (root 2), whatever the order."""

    def _inverse_root(self, a: Array, root: float, scale: float | None = None
                      ) -> Array | None:
        return super()._inverse_root(a, 2.0, scale)


class _EpsilonAfterRoot(ReferenceShampoo):
    """Adds epsilon after the root, X = (A^(1/r) + eps I)^(-1), not to A before."""

    def _inverse_root(self, a: Array, root: float, scale: float | None = None
                      ) -> Array | None:
        lam, q = np.linalg.eigh(0.5 * (a + a.T))
        lam = np.maximum(lam, 0.0) ** (1.0 / root) + self.config.epsilon.value
        out: Array = (q / lam) @ q.T
        return out


class _MomentumBeforeGrafting(ReferenceShampoo):
    """Heavy-ball momentum on the raw gradient, before preconditioning and grafting."""

    def _filter(self, st: ParameterState, g: Array, finite: NDArray[np.bool_]) -> Array:
        f = super()._filter(st, g, finite)
        mom = self.config.momentum
        if st.momentum is None:
            return f
        st.momentum = mom.momentum * st.momentum + (1.0 - mom.dampening) * f
        return st.momentum.copy()

    def _momentum(self, st, shampoo_dir, graft_dir, w, use_shampoo, finite):  # type: ignore[no-untyped-def]
        chosen = shampoo_dir if use_shampoo else graft_dir
        wd = self.config.weight_decay
        if wd.applies("direction"):
            chosen = chosen + wd.value * w
        return chosen


class _FilterBiasCorrectionOffByOne(ReferenceShampoo):
    """Divides the filtered gradient by 1 - beta1^(t+1) instead of 1 - beta1^t."""

    def _filter(self, st: ParameterState, g: Array, finite: NDArray[np.bool_]) -> Array:
        self.t += 1
        try:
            return super()._filter(st, g, finite)
        finally:
            self.t -= 1


class _BlocksInWrongOrder(ReferenceShampoo):
    """Pairs each block's state with another equal-shaped block's slice when preconditioning."""

    def _shampoo_direction(self, st: ParameterState, filtered: Array, graft_dir: Array) -> Array:
        plan = st.plan
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, b in enumerate(plan.blocks):
            groups.setdefault(b.shape, []).append(i)
        order = list(range(len(plan.blocks)))
        for members in groups.values():
            for i, j in zip(members, reversed(members), strict=True):
                order[i] = j
        st.plan = replace(plan, blocks=tuple(plan.blocks[j] for j in order))
        try:
            return super()._shampoo_direction(st, filtered, graft_dir)
        finally:
            st.plan = plan


class _Float32Factors(ReferenceShampoo):
    """Accumulates the factors in float32 although float64 was asked for."""

    def _update_block(
        self, name: str, roots: tuple[float, ...], bs: BlockState, gb: Array, observed: Array,
        roots_now: bool,
    ) -> None:
        super()._update_block(name, roots, bs, gb, observed, roots_now)
        bs.factors = [
            None if f is None else f.astype(np.float32).astype(np.float64) for f in bs.factors
        ]


def _same(config: ShampooConfig) -> ShampooConfig:
    return config


def _graft_norm_per_parameter(config: ShampooConfig) -> ShampooConfig:
    return replace(config, grafting=replace(config.grafting, norm_scope="parameter"))


def _schedule_off_by_one(config: ShampooConfig) -> ShampooConfig:
    anchor: Literal["end", "start"] = "start" if config.schedule.period_anchor == "end" else "end"
    return replace(config, schedule=replace(config.schedule, period_anchor=anchor))


def _no_nesterov(config: ShampooConfig) -> ShampooConfig:
    return replace(config, momentum=replace(config.momentum, nesterov=False))


class _SketchValuesLost(ReferenceShampoo):
    """Forgets each sketch's values after its root step (Google's defect on the sketched
    factors smaller than its largest statistic, docs/third-party.md)."""

    def _sketch_root(self, sketch: Sketch, c: Array, root: float) -> tuple[Sketch, Array]:
        new, x = super()._sketch_root(sketch, c, root)
        return replace(new, lam=np.zeros_like(new.lam)), x


class _TearfreeTailDecayedByBeta2(ReferenceShampoo):
    """Eq. (10e) with the tail decayed by beta2, not tearfree's sqrt(beta2) (the rule of
    eq. 10d's tail): the sketch comes in with rho scaled by sqrt(beta2) once more."""

    def _sketch_root(self, sketch: Sketch, c: Array, root: float) -> tuple[Sketch, Array]:
        fd = self.config.frequent_directions
        if fd is not None and fd.rule == "tearfree":
            sketch = replace(sketch, rho=sketch.rho * float(np.sqrt(self.config.statistics.beta2)))
        return super()._sketch_root(sketch, c, root)


class _RankCutoffPerFactor(ReferenceShampoo):
    """Eq. (10g) ignored: every factor's rank cutoff scales by its own lambda_max, also
    with ``rank_cutoff_scope="parameter"`` (a block's small directions are kept)."""

    def _refresh_inverse_roots(self, name: str, roots: tuple[float, ...], bs: BlockState,
                               scales: dict[int, float] | None = None) -> None:
        super()._refresh_inverse_roots(name, roots, bs, None)


class _AdafactorRowsUnnormalized(ReferenceShampoo):
    """Eq. (14e) with the row moment R used as it is: ``X (R C)^(-1/2)``, not
    ``X (R C / mean(R))^(-1/2)`` (the factored estimate off by the factor mean(R))."""

    def _graft_direction(self, st: ParameterState, filtered: Array, w_orig: Array) -> Array:
        m, graft = st.graft, self.config.grafting
        if not (isinstance(m, grafting.FactoredMoments) and m.dims is not None
                and m.row is not None and m.col is not None):
            return super()._graft_direction(st, filtered, w_orig)
        d0, d1 = m.dims
        x = filtered.reshape(st.plan.shape)
        u = x * np.expand_dims(m.row ** -0.5, d0) * np.expand_dims(m.col ** -0.5, d1)
        u = grafting.clip(u, graft)
        if graft.parameter_scale_floor is not None:
            u = u * max(float(np.sqrt(np.mean(w_orig * w_orig))), graft.parameter_scale_floor)
        out: Array = u.reshape(filtered.shape)
        return out


class _DeflationNotRestored(ReferenceShampoo):
    """Eq. (11d) without its last step: the Newton root of the deflated factor is kept
    as it is, the top-k pairs' root never put back (their directions over-amplified)."""

    def _inverse_root(self, a: Array, root: float, scale: float | None = None
                      ) -> Array | None:
        method = self.config.root_inverse
        if not (isinstance(method, CoupledNewtonConfig) and method.deflates(a.shape[0])
                and np.all(np.isfinite(a))):
            return super()._inverse_root(a, root, scale)
        sym = 0.5 * (a + a.T)
        top = lobpcg_top_k(sym, method.deflation_rank, method.lobpcg_iterations)
        shift = top.vectors * np.sqrt(top.values - top.values.min())
        deflated = sym - shift @ shift.T
        eps = self.config.epsilon
        ridge = eps.value * (max(float(top.values.max()), eps.relative_floor)
                             if eps.scale == "relative" else 1.0)
        result = root_inverse_coupled_newton(deflated, int(root), ridge, method)
        return result.root if np.isfinite(result.error) else None


class _RefreshedBasisNotStored(ReferenceShampoo):
    """Eq. (10h) with the stored eigenbasis never replaced: an eigh refresh's
    eigenvectors make its root, but the basis kept for the next root step's test stays
    the old one (I, from the first root step on)."""

    def _stored_basis_root(self, basis: Array | None, a: Array, root: float
                           ) -> tuple[Array | None, Array | None]:
        x, q = super()._stored_basis_root(basis, a, root)
        method = self.config.root_inverse
        if isinstance(method, EighConfig) and method.reuses_basis and q is not None:
            return x, basis
        return x, q


@dataclass(frozen=True)
class Mutant:
    """A reference with one bug: an optimizer class and/or a config rewrite."""

    name: str
    description: str
    optimizer: type[ReferenceShampoo] = ReferenceShampoo
    rewrite: Callable[[ShampooConfig], ShampooConfig] = _same


MUTANTS: tuple[Mutant, ...] = (
    Mutant("wrong_default_root", "root 2 for every factor", _WrongDefaultRoot),
    Mutant("epsilon_after_root", "epsilon added after the root", _EpsilonAfterRoot),
    Mutant(
        "graft_norm_per_parameter",
        "graft norm per parameter, not per block",
        rewrite=_graft_norm_per_parameter,
    ),
    Mutant(
        "momentum_before_grafting",
        "momentum on the gradient before grafting",
        _MomentumBeforeGrafting,
    ),
    Mutant(
        "bias_correction_off_by_one",
        "filter bias correction one step ahead",
        _FilterBiasCorrectionOffByOne,
    ),
    Mutant("schedule_off_by_one", "amortized roots one step off", rewrite=_schedule_off_by_one),
    Mutant("missing_nesterov", "Nesterov term dropped", rewrite=_no_nesterov),
    Mutant("blocks_wrong_order", "block states paired with the wrong blocks", _BlocksInWrongOrder),
    Mutant("float32_factors", "factors accumulated in float32", _Float32Factors),
    Mutant("sketch_values_lost", "frequent-directions sketch values forgotten",
           _SketchValuesLost),
    Mutant("deflation_not_restored", "LOBPCG-deflated root never restored",
           _DeflationNotRestored),
    Mutant("tearfree_tail_decayed_by_beta2", "tearfree's sketch tail decayed by beta2",
           _TearfreeTailDecayedByBeta2),
    Mutant("rank_cutoff_per_factor", "a parameter's rank cutoff taken per factor",
           _RankCutoffPerFactor),
    Mutant("adafactor_rows_unnormalized", "Adafactor's row moment not divided by its mean",
           _AdafactorRowsUnnormalized),
    Mutant("refreshed_basis_not_stored", "an eigh refresh's eigenbasis not stored (eq. 10h)",
           _RefreshedBasisNotStored),
)


class MutantBackend:
    """A backend (the backend contract) running one mutant of the reference."""

    def __init__(self, mutant: Mutant) -> None:
        self.mutant = mutant
        self.name = f"mutant:{mutant.name}"

    def run(self, config: ShampooConfig, params: ParamsIn, grads: GradStream,
            dtype: Any = np.float64) -> list[Params]:
        opt = self.mutant.optimizer(self.mutant.rewrite(config), dict(params))
        out = [opt.step(dict(g)) for g in grads]
        if np.dtype(dtype) != np.float64:
            out = [{k: v.astype(dtype) for k, v in p.items()} for p in out]
        return out


def mutant_backend(name: str) -> MutantBackend:
    for m in MUTANTS:
        if m.name == name:
            return MutantBackend(m)
    raise ValueError(f"mutant = {name!r} is invalid: allowed one of {[m.name for m in MUTANTS]}.")
