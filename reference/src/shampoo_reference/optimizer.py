"""The exact float64 Shampoo step, in the order of docs/spec.md.

:class:`ReferenceShampoo` holds the state of a dict of named parameters and
applies eqs. (1)-(21) one step at a time. It favours clarity over speed:
one block at a time, plain NumPy, no batching. It is the oracle the fast
backends are tested against, so every rule is spelled out here once.

Its methods are the phases of a step, in order; the arithmetic of each is
a function of the module of its job: :mod:`.admission` (the arguments,
eqs. 2-3), :mod:`.state` (the records, their creation and int storage),
:mod:`.elementwise` (eqs. 14-15, 19-22), :mod:`.statistics` (eqs. 6-7),
:mod:`.roots` (eqs. 9-13, 17; :mod:`.roots.dispatch` picks each factor's
method) and :mod:`.directions` (eqs. 16-17). A method that only calls such
a function is a seam tests and mutants override
(``shampoo_conformance.mutants``).

Failures leave the state whole (eqs. 3, 13): a refused block (non-finite
gradient, or one that could overflow float32 state,
:func:`shampoo_spec.block_overflows`) raises before anything changes, or is
skipped; a root failure beyond ``failure.max_consecutive_root_failures``
raises only after the step has completed for every parameter. Arguments are
checked (a ShampooConfig, real arrays) with ``ValueError``; a block dim above
``shampoo_spec.LARGE_BLOCK_DIM`` warns at construction, naming the parameter.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import numpy as np
from numpy.typing import NDArray

from shampoo_spec import (
    BlockPlan,
    CoupledNewtonConfig,
    RootFailureError,
    ShampooConfig,
    is_root_step,
    is_statistics_step,
    large_block_warnings,
    learning_rate_ratio,
    plan_parameter,
    uses_preconditioner,
)

from .admission import Admitted, admit, checked_gradients, real_array, shown
from .directions import corrected_direction, kronecker_direction, update_corrected_moment
from .elementwise import (
    apply_update,
    filter_gradient,
    graft_direction,
    momentum_step,
    preconditioned_input,
    update_diagonal_state,
    update_graft_state,
    withhold_nonfinite,
)
from .linalg import orthogonalize
from .roots import (
    Sketch,
    eigenbasis_still_fits,
    inverse_root,
    qr_basis,
    sketch_root,
    stored_basis_root,
    stored_root_dtype,
    symmetrize,
)
from .rounding import round_to
from .state import (
    BlockState,
    Metrics,
    ParameterState,
    as_merged,
    init_parameter,
    store_factor,
)
from .statistics import root_input, statistics_gradient, update_factors

Array = NDArray[np.float64]


class ReferenceShampoo:
    """Float64 Shampoo over a dict of named NumPy parameters.

    >>> opt = ReferenceShampoo(config, {"w": w0})
    >>> params = opt.step({"w": g})      # new parameters after step 1
    """

    def __init__(self, config: ShampooConfig, params: dict[str, Array]) -> None:
        if not isinstance(config, ShampooConfig):
            raise ValueError(
                f"config = {shown(config)} is invalid: allowed a shampoo_spec.ShampooConfig "
                "(ShampooConfig.from_dict reads a dict)."
            )
        if not isinstance(params, Mapping):
            raise ValueError(f"params = {shown(params)} is invalid: allowed a dict name -> array.")
        self.config = config
        self.t = 0
        #: eq. (21)'s learning rate of the current step and of step 1 (eq. 8b's lr_1).
        self.learning_rate = config.learning_rate
        self.first_learning_rate: float | None = None
        self.metrics = Metrics()
        self._root_failures: list[str] = []  # eq. (13) blocks over the limit, this step
        self.params = {k: real_array("parameter", k, v) for k, v in params.items()}
        for name, p in self.params.items():
            for message in large_block_warnings(str(name), plan_parameter(p.shape, config)):
                warnings.warn(message, stacklevel=2)  # eq. (5): before allocating the factors
        self.state = {k: init_parameter(config, p.shape) for k, p in self.params.items()}
        #: Eq. (20d): which sequence the parameters hold ("train": y, "eval": x), and
        #: Schedule-Free's sum of lr_i^p over the steps so far.
        self.mode = "train"
        self.lr_power_sum = 0.0
        if config.averaging is not None:
            for name, st in self.state.items():
                st.averaged = as_merged(self.params[name], st.plan).copy()  # Z_0 = W_0

    # ----------------------------------------------------------------- step
    def step(
        self, grads: dict[str, Array], learning_rate: float | None = None
    ) -> dict[str, Array]:
        """Apply one step (eq. 1: t <- t + 1) and return copies of the parameters.

        ``learning_rate``: this step's lr_t (a schedule's value), else
        ``config.learning_rate``. It scales the update (eqs. 20-21) and, with
        ``schedule.precondition_frequency_growth``, sets the root period
        through lr_t / lr_1 (eq. 8b), lr_1 the rate of the first step.

        Every gradient is checked first (names, shapes, eq. 3): a ``ValueError``
        or :class:`NonFiniteGradientError` leaves the optimizer exactly as it
        was (t included). A :class:`RootFailureError` (eq. 13) is raised only
        after the step has completed for every parameter; the new parameters
        are then in :attr:`params`.
        """
        lr = self.config.learning_rate if learning_rate is None else learning_rate
        arrays = checked_gradients(grads, self.params, self.mode, lr)
        # Eqs. (2)-(3) for every parameter before any state changes.
        admitted = {
            name: admit(self.config, self.state[name], self.params[name], name, g, self.t + 1)
            for name, g in arrays.items()
        }
        self.t += 1
        self.learning_rate = float(lr)
        if self.first_learning_rate is None:
            self.first_learning_rate = self.learning_rate
        self._root_failures = []
        av = self.config.averaging
        if av is not None and av.type == "schedule_free":
            self.lr_power_sum = av.power_sum(self.lr_power_sum, self.learning_rate)  # (20d)
        for name, adm in admitted.items():
            self.metrics.skipped_blocks += adm.refused
            self.params[name] = self._step_parameter(name, self.params[name], adm)
        if self._root_failures:
            # Eq. (13): raised once the step is complete, never half-way.
            raise RootFailureError("; ".join(self._root_failures))
        return {k: v.copy() for k, v in self.params.items()}

    def _step_parameter(self, name: str, w_orig: Array, adm: Admitted) -> Array:
        """Eqs. (6)-(21) for one parameter whose gradient passed eqs. (2)-(3)."""
        cfg, t = self.config, self.t
        st = self.state[name]
        plan = st.plan
        w = as_merged(w_orig, plan)
        g, finite = adm.g, adm.ok

        # Eq. (14b): graft state; eq. (16b): diagonal state; eq. (15): filter. Elementwise.
        update_graft_state(cfg, t, st, g, finite)
        update_diagonal_state(cfg, st, g, finite)
        filtered = self._filter(st, g, finite)

        # Eqs. (6)-(13), (17): statistics, roots and corrected moment, block by block.
        admitted = [(b, bs) for b, bs in zip(plan.blocks, st.blocks, strict=True)
                    if finite[b.slices].all()]
        lagged = cfg.schedule.roots_take_effect == "next_step" and self._root_step()
        observed = statistics_gradient(cfg, t, st, g, finite)
        # Eq. (10g): every block's factors first, then the roots, which share a cutoff.
        per_parameter = cfg.epsilon.cuts_rank_per_parameter
        for b, bs in admitted:
            self._update_block(name, b.roots, bs, g[b.slices], observed[b.slices],
                               roots_now=not lagged and not per_parameter)
        if per_parameter and not lagged and self._root_step():
            self._refresh_parameter_roots(name, admitted)

        # Eq. (14c): the graft direction (whole parameter, elementwise); eq. (14e).
        graft_dir = self._graft_direction(st, filtered, w_orig)

        # Eqs. (16)-(18): Shampoo direction, rescaled to the graft norm.
        use_shampoo = uses_preconditioner(t, cfg.schedule)
        need_shampoo = use_shampoo or st.graft_momentum is not None
        source = preconditioned_input(cfg, t, st, filtered)  # eq. (16b): D(F~) or F~
        shampoo_dir = self._shampoo_direction(st, source, graft_dir) if need_shampoo else None
        if lagged:
            # Eq. (8), roots_take_effect="next_step": this step's direction used the
            # roots held before it; the roots refreshed now take effect from t + 1.
            if per_parameter:
                self._refresh_parameter_roots(name, admitted)
            else:
                for b, bs in admitted:
                    self._refresh_inverse_roots(name, b.roots, bs)

        # Eqs. (19)-(22): weight decay, momentum or averaging, update.
        return self._update(st, w, shampoo_dir, graft_dir, use_shampoo, finite).reshape(
            plan.shape)

    # ------------------------------------------------------- eq. (15) filter
    def _filter(self, st: ParameterState, g: Array, finite: NDArray[np.bool_]) -> Array:
        """Eq. (15), :func:`.elementwise.filter_gradient` at this step."""
        return filter_gradient(self.config, self.t, st, g, finite)

    # --------------------------------------------- eqs. (6)-(13), (17) block
    def _update_block(
        self, name: str, roots: tuple[float, ...], bs: BlockState, gb: Array, observed: Array,
        roots_now: bool,
    ) -> None:
        """Eqs. (6), (6c) on the statistics gradient ``observed`` (G^ of eq. 6c), and
        eqs. (7), (9)-(13) and (17) on root steps when ``roots_now``."""
        cfg, t = self.config, self.t
        if is_statistics_step(t, cfg.schedule):
            update_factors(cfg, bs, observed)
        if roots_now and self._root_step():
            self._refresh_inverse_roots(name, roots, bs)
        if cfg.eigenvalue_correction is not None:
            # Eq. (17): the corrected second moment sees this step's (refreshed) basis.
            update_corrected_moment(cfg, bs, gb)

    def _root_step(self) -> bool:
        """Eq. (8): is this step a root step (eq. 8b: the period follows lr_t / lr_1)?"""
        assert self.first_learning_rate is not None
        ratio = learning_rate_ratio(self.learning_rate, self.first_learning_rate)
        return is_root_step(self.t, self.config.schedule, ratio)

    def _refresh_parameter_roots(self, name: str, admitted: list[tuple[BlockPlan, BlockState]]
                                 ) -> None:
        """Eq. (10g): the admitted blocks' roots, each factor's rank cutoff scaled by
        Lambda_k, the largest eigenvalue of dim k's finite factors over those blocks."""
        scales: dict[int, float] = {}
        for _, bs in admitted:
            for k, lk in enumerate(bs.factors):
                if lk is None:
                    continue
                a = root_input(self.config, bs, k)
                if not np.all(np.isfinite(a)):
                    continue
                try:
                    top = float(np.linalg.eigvalsh(symmetrize(a))[-1])
                except np.linalg.LinAlgError:
                    continue
                scales[k] = max(scales.get(k, -math.inf), top)
        for b, bs in admitted:
            self._refresh_inverse_roots(name, b.roots, bs, scales)

    def _refresh_inverse_roots(self, name: str, roots: tuple[float, ...], bs: BlockState,
                               scales: dict[int, float] | None = None) -> None:
        """Eqs. (7), (9)-(13): recompute every factor's root; count block failures.

        ``scales`` (eq. 10g): Lambda_k per dim k, which scales the rank cutoff
        of factor k in place of its own lambda_max.
        A block over ``failure.max_consecutive_root_failures`` is recorded;
        :meth:`step` raises :class:`RootFailureError` once the step is complete.
        """
        cfg, t = self.config, self.t
        failed = []
        for k, lk in enumerate(bs.factors):
            if lk is None:
                continue
            a = root_input(cfg, bs, k)
            ec = cfg.eigenvalue_correction
            sketch = bs.sketches[k]
            new: Array | None
            if sketch is not None:
                bs.sketches[k], new = self._sketch_root(sketch, a, roots[k])
            elif ec is not None and ec.eigenbasis_method == "qr":
                new = qr_basis(cfg, bs.inverse_roots[k], a)  # eq. (17c)
            elif self._basis_still_fits(bs.inverse_roots[k], a):
                continue  # eq. (17b): the eigenbasis is kept (not a failure)
            elif bs.eigenbases[k] is not None:
                new, basis = self._stored_basis_root(bs.eigenbases[k], a, roots[k])
                if basis is not None and new is not None and np.all(np.isfinite(new)):
                    bs.eigenbases[k] = basis  # kept with its root (eq. 13)
            else:
                new = self._inverse_root(a, roots[k], None if scales is None else scales.get(k))
                method = cfg.root_inverse
                if isinstance(method, CoupledNewtonConfig) and method.fails_padded(
                        a.shape[0], self._largest_factor()):
                    new = None  # eq. (11d): Google's padded deflation fails this root
            stored = stored_root_dtype(cfg)
            if new is not None and stored is not None:
                # Eq. (11a) (eq. 17a for eigenbases): the root is stored rounded;
                # eq. (13) judges the stored root (a float16 one can overflow
                # where X did not).
                with np.errstate(over="ignore"):
                    new = round_to(new, stored)
            if new is None or not np.all(np.isfinite(new)):
                # Eq. (13): keep the previous root, count the failure.
                self.metrics.root_failures += 1
                failed.append(k)
                continue
            bs.inverse_roots[k] = new
            if cfg.statistics.quantized:
                store_factor(cfg, bs, "root", k)  # eq. (20c): the accepted root
        bs.consecutive_failures = bs.consecutive_failures + 1 if failed else 0
        limit = cfg.failure.max_consecutive_root_failures
        if limit is not None and bs.consecutive_failures > limit:
            block = next(i for i, x in enumerate(self.state[name].blocks) if x is bs)
            self._root_failures.append(
                f"inverse roots of factors {failed} of block {block} of parameter {name!r} "
                f"failed on {bs.consecutive_failures} root steps in a row, the last at step {t} "
                f"(failure.max_consecutive_root_failures={limit}; the step was completed, "
                "failed roots kept their previous values)"
            )

    # The methods of :mod:`.roots.dispatch` as the optimizer calls them (one seam each).
    def _sketch_root(self, sketch: Sketch, c: Array, root: float) -> tuple[Sketch, Array]:
        """Eqs. (10d), (10e) at this step: :func:`.roots.sketch_root` (with the largest
        factor of every parameter, which ``frequent_directions.packing = "google"`` reads)."""
        return sketch_root(self.config, self.t, sketch, c, root, self._largest_factor())

    def _largest_factor(self) -> int:
        """The largest factor of every parameter (eqs. 10d's and 11d's Google packing)."""
        return max((lk.shape[0] for st in self.state.values() for bs in st.blocks
                    for lk in bs.factors if lk is not None), default=0)

    def _basis_still_fits(self, basis: Array | None, a: Array) -> bool:
        """Eq. (17b): whether the stored eigenbasis is kept (a seam the basis-reuse tests count)."""
        return eigenbasis_still_fits(self.config, basis, a)

    def _stored_basis_root(self, basis: Array | None, a: Array, root: float
                           ) -> tuple[Array | None, Array | None]:
        """Eqs. (10f), (10h): :func:`.roots.stored_basis_root`."""
        return stored_basis_root(self.config, basis, a, root)

    def _inverse_root(self, a: Array, root: float, scale: float | None = None
                      ) -> Array | None:
        """Eqs. (10), (11), (17): :func:`.roots.inverse_root`."""
        return inverse_root(self.config, a, root, scale)

    # ------------------------------------------------ eqs. (14)-(18) direction
    def _graft_direction(self, st: ParameterState, filtered: Array, w_orig: Array) -> Array:
        """Eqs. (14c), (14e): :func:`.elementwise.graft_direction` at this step."""
        return graft_direction(self.config, self.t, st, filtered, w_orig)

    def _shampoo_direction(self, st: ParameterState, filtered: Array, graft_dir: Array) -> Array:
        """Eqs. (16)-(18): each block's direction (eq. 16, 16c or 17), rescaled to the graft
        direction's norm per block or per parameter."""
        cfg = self.config
        plan = st.plan
        if not plan.preconditioned:
            # Skipped parameters take the graft direction (eq. 18, skip rule).
            return graft_dir.copy()
        out = np.zeros(plan.merged_shape)
        scope_block = cfg.grafting.rescale_scope == "block"
        for b, bs in zip(plan.blocks, st.blocks, strict=True):
            fb = filtered[b.slices]
            if cfg.spectral is not None:
                pb = orthogonalize(fb, cfg.spectral)  # eq. (16c)
            elif cfg.eigenvalue_correction is not None:
                pb = corrected_direction(cfg, bs, fb)
            else:
                pb = kronecker_direction(cfg, bs, fb)
            if scope_block:
                pb = pb * np.linalg.norm(graft_dir[b.slices]) / (
                    np.linalg.norm(pb) + cfg.grafting.norm_epsilon
                )
            out[b.slices] = pb
        if cfg.grafting.rescale_scope == "parameter":
            scale = np.linalg.norm(graft_dir) / (np.linalg.norm(out) + cfg.grafting.norm_epsilon)
            out = out * scale
        return out

    # ---------------------------------------------- eqs. (19)-(22) update
    def _update(self, st: ParameterState, w: Array, shampoo_dir: Array | None, graft_dir: Array,
                use_shampoo: bool, finite: NDArray[np.bool_]) -> Array:
        """Eqs. (19)-(21), (20d): the new W in the merged shape; eq. (22) withholds the
        entries that are not finite, eq. (20b) stores the momentum buffers."""
        buffers = (st.momentum, st.graft_momentum)
        with np.errstate(over="ignore", invalid="ignore"):  # eq. (22) handles overflow
            step = self._momentum(st, shampoo_dir, graft_dir, w, use_shampoo, finite)
            new_w, new_z = apply_update(self.config, self.learning_rate, self.lr_power_sum,
                                        st, step, w)
        new_w, withheld = withhold_nonfinite(self.config, st, w, new_w, new_z, finite, buffers)
        if withheld:
            self.metrics.withheld_updates += 1
        return new_w

    def _momentum(
        self,
        st: ParameterState,
        shampoo_dir: Array | None,
        graft_dir: Array,
        w: Array,
        use_shampoo: bool,
        finite: NDArray[np.bool_],
    ) -> Array:
        """Eqs. (19)-(20): :func:`.elementwise.momentum_step` at this step's lr_t."""
        return momentum_step(self.config, self.learning_rate, st, shampoo_dir, graft_dir, w,
                             use_shampoo, finite)

    # ------------------------------------------------ eq. (20d) averaging
    def eval(self) -> None:
        """Eq. (20d): put the averaged sequence ``x = (W - (1 - mu_y) Z) / mu_y`` in the
        parameters (``W <- W + (1 - 1 / mu_y) (Z - W)``); no-op without averaging or
        in eval mode already."""
        av = self.config.averaging
        if av is None or self.mode == "eval":
            return
        self._switch(av.switch_coefficient("eval"))  # eqs. (20d), (20e)
        self.mode = "eval"

    def train(self) -> None:
        """Eq. (20d): back to the training sequence ``y = mu_y x + (1 - mu_y) Z``
        (``W <- W + (1 - mu_y) (Z - W)``); no-op without averaging or in train mode."""
        av = self.config.averaging
        if av is None or self.mode == "train":
            return
        self._switch(av.switch_coefficient("train"))
        self.mode = "train"

    def _switch(self, c: float) -> None:
        for name, st in self.state.items():
            assert st.averaged is not None
            w = as_merged(self.params[name], st.plan)
            self.params[name] = (w + c * (st.averaged - w)).reshape(st.plan.shape)


def run(
    config: ShampooConfig,
    params: dict[str, Array],
    grads: list[dict[str, Array]],
    learning_rates: list[float] | None = None,
) -> list[dict[str, Array]]:
    """Contract 8.2 for the reference: the parameters after each step.

    ``learning_rates``: one learning rate per step (a schedule), else
    ``config.learning_rate`` at every step.
    """
    opt = ReferenceShampoo(config, params)
    if learning_rates is None:
        return [opt.step(g) for g in grads]
    if len(learning_rates) != len(grads):
        raise ValueError(
            f"learning_rates has {len(learning_rates)} entries for {len(grads)} steps: "
            "allowed one per step."
        )
    return [opt.step(g, lr) for g, lr in zip(grads, learning_rates, strict=True)]
