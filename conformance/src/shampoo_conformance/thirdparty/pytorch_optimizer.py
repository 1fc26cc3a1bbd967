"""The ``pytorch-optimizer`` backend: pytorch-optimizer's ``ScalableShampoo`` as shipped.

pytorch-optimizer 4.1.0 (``pip install pytorch-optimizer==4.1.0``, import
``pytorch_optimizer``) ships ``ScalableShampoo``, a port of Google's
``distributed_shampoo`` (its docstring links Google's optax file), and a plain
``Shampoo`` (the ``pytorch-optimizer-shampoo`` backend,
:mod:`.pytorch_optimizer_shampoo`). This adapter runs ``ScalableShampoo`` from
:func:`scalable_kwargs`: the constructor arguments it takes for the same
Shampoo. Nothing of the library is patched; parameters stay in the run's dtype
(its statistics and roots follow them: float64 for float64 parameters).

What ``ScalableShampoo`` computes, read from its source (paths under
``pytorch_optimizer/optimizer/``; docs/third-party.md):

- Google's rules where it ports them: statistics ``beta2 L + (1 - beta2) G G^T``
  from ``matrix_eps I`` (utils/preconditioner.py:47, :74-77, :121, :128), one
  root ``2 * (preconditioned dims)`` per parameter or ``inverse_exponent_override``
  (:56-58), one-sided preconditioning (:86-94), SGD / AdaGrad / RMSprop / sign
  grafts with ``diagonal_eps`` (utils/graft.py), the graft norm over the whole
  parameter (shampoo.py:340-344), two momentum buffers, Nesterov, moving-average
  momentum, the decoupled learning rate and weight decay (shampoo.py:310-382).
- Its own rules where they differ from Google's: a 1-based step with
  ``step % f == 0`` for statistics and roots (``period_anchor="end"``, roots
  before the start step, shampoo.py:327-330) and Shampoo from
  ``step >= start_preconditioning_step`` (:293-294); the coupled Newton
  iteration stops at ``error_tolerance=1e-3`` with no retries and no failure
  test (utils/matrix.py:193-264, called without them at preconditioner.py:144-146);
  its ridge is ``matrix_eps * max(lambda, 1e-16)`` with lambda from 100 power
  iterations (matrix.py:102-111, :227); the graft rescale divides by
  ``||P|| + 1e-16`` (shampoo.py:344); dims are merged up to ``block_size``
  (preconditioner.py:51, utils/shape.py:4-29) and a parameter whose merged shape
  has one dim is not preconditioned (preconditioner.py:64).

Capabilities: :func:`expressible` names what its arguments cannot say
(:class:`~shampoo_spec.Inexpressible`); :func:`configs` draws its own kwargs,
imported by :func:`.pytorch_optimizer_kwargs.from_kwargs` (Google's importer, then
the rules above; with :data:`USER_KWARGS` and :func:`defaults_config`);
:func:`library_run` is a user's run; :data:`DEVIATIONS`
(:mod:`.pytorch_optimizer_deviations`) lists where it differs from the spec.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from pytorch_optimizer import ScalableShampoo

from shampoo_conformance.adapters.torch import Stepper
from shampoo_conformance.adapters.torch_user_run import torch_library_run
from shampoo_conformance.thirdparty.pytorch_optimizer_deviations import DEVIATIONS
from shampoo_conformance.thirdparty.pytorch_optimizer_kwargs import (
    GRAFTS,
    NEVER,
    NEWTON,
    NORM_EPSILON,
    RELATIVE_FLOOR,
    SIDES,
    SRC,
    SVD_REFUSAL,
    USER_KWARGS,
    case,
    common_refusals,
    defaults_config,
    from_kwargs,
    refuse,
)
from shampoo_conformance.thirdparty.registry import LibraryRun
from shampoo_conformance.thirdparty.torch_library import in_dtype, make_stepper, run_optimizer
from shampoo_spec import EighConfig, Inexpressible, ShampooConfig
from shampoo_spec.config import (
    BlockingConfig,
    EpsilonConfig,
    ExponentConfig,
    ScheduleConfig,
    StatisticsConfig,
)

#: Parameter dtypes this backend runs (statistics and roots follow them).
dtypes = (np.float64, np.float32)

#: The names this module exports besides its own (the shared import, its deviations).
__all__ = ["DEVIATIONS", "GRAFTS", "NEVER", "NEWTON", "NORM_EPSILON", "RELATIVE_FLOOR",
           "SIDES", "SRC", "SVD_REFUSAL", "USER_KWARGS", "common_refusals",
           "defaults_config", "from_kwargs", "refuse", "CASES", "base_config", "configs",
           "expressible", "library_run", "run", "scalable_kwargs", "stepper"]


# ------------------------------------------------------------- config -> kwargs
def _root_refusals(config: ShampooConfig) -> list[str]:
    out = []
    root, eps = config.root_inverse, config.epsilon
    if isinstance(root, EighConfig):
        out.append(f"root_inverse = eigh: {SVD_REFUSAL}")
    elif root != NEWTON:
        out.append(f"root_inverse = {root!r}: ScalableShampoo's coupled Newton is fixed at "
                   f"{NEWTON!r} (utils/matrix.py:193-264)")
    if eps.scale != "relative" or eps.relative_floor != RELATIVE_FLOOR:
        out.append(f"epsilon = {eps.scale} with floor {eps.relative_floor!r}: the Newton ridge "
                   "is matrix_eps * max(lambda_max, 1e-16) (utils/matrix.py:111, :227)")
    if eps.lambda_max != "exact":
        out.append("epsilon.lambda_max = 'power_iteration' (Google's rule, eq. 9b: stops at "
                   "tolerance 1e-6; ScalableShampoo iterates 100 times, utils/matrix.py:102-111, "
                   "so lambda_max to rounding: 'exact')")
    if eps.placement not in ("ridge", "ridge_floor"):
        out.append(f"epsilon.placement = {eps.placement!r} (a ridge before Newton only)")
    ex = config.exponents
    if ex.default != "preconditioned_dims" or ex.overrides_by_order:
        out.append("exponents: the root is 2 * (preconditioned dims) or "
                   "inverse_exponent_override (utils/preconditioner.py:56-58)")
    elif ex.override != int(ex.override):
        out.append(f"exponents.override = {ex.override!r} (an integer: matrix_power, "
                   "utils/matrix.py:248)")
    return out


def _graft_refusals(config: ShampooConfig) -> list[str]:
    g = config.grafting
    out = []
    if g.type not in GRAFTS:
        out.append(f"grafting.type = {g.type!r} (LayerWiseGrafting has NONE, SGD, ADAGRAD, "
                   "RMSPROP, SQRTN: utils/graft.py:317-331)")
    if g.type != "none":
        if g.norm_scope != "parameter" or g.norm_epsilon != NORM_EPSILON:
            out.append(f"grafting.norm_scope = {g.norm_scope!r}, norm_epsilon = "
                       f"{g.norm_epsilon!r}: the rescale is over the whole parameter with "
                       "1e-16 (shampoo.py:340-344)")
        if g.clip_rms is not None:
            out.append("grafting.clip_rms (no graft clip)")
        if g.bias_correction or g.ema_weight != "one_minus_beta2":
            out.append("grafting.bias_correction / ema_weight (RMSprop weights g^2 by "
                       "1 - beta2, uncorrected: utils/graft.py:402-404)")
    if g.type == "rmsprop" and g.beta2 != config.statistics.beta2:
        out.append(f"grafting.beta2 = {g.beta2!r} != statistics.beta2 = "
                   f"{config.statistics.beta2!r} (one beta2 for both, shampoo.py:326)")
    return out


def _momentum_refusals(config: ShampooConfig) -> list[str]:
    m, s = config.momentum, config.schedule
    out = []
    if not 0.0 <= m.momentum < 1.0:
        out.append(f"momentum.momentum = {m.momentum!r} (beta1 in [0, 1))")
    if m.dampening not in (0.0, m.momentum):
        out.append(f"momentum.dampening = {m.dampening!r}: 0, or beta1 with "
                   "moving_average_for_momentum (shampoo.py:312)")
    # Two buffers always (shampoo.py:278, utils/graft.py:338): one buffer is the same
    # only when both see the same directions (no warm-up) or there is no momentum.
    if m.momentum > 0 and m.buffers == "shared" and s.start_preconditioning_step not in (1, None):
        out.append("momentum.buffers = 'shared' with a warm-up: ScalableShampoo keeps a "
                   "Shampoo and a graft buffer (shampoo.py:366-373), the graft's one "
                   "(identity without a graft) used before the start step")
    wd = config.weight_decay
    if wd.value != 0.0 and wd.type == "l2":
        out.append("weight_decay.type = 'l2' (decay enters after preconditioning and "
                   "grafting, shampoo.py:346-364)")
    return out


def _blocking(config: ShampooConfig) -> tuple[dict[str, Any], list[str]]:
    b = config.blocking
    out = []
    kwargs: dict[str, Any] = {
        "block_size": b.max_preconditioner_dim,
        "no_preconditioning_for_layers_with_dim_gt": (
            NEVER if b.skip_dim_size_gt is None else b.skip_dim_size_gt),
        "pre_conditioner_type": SIDES[b.preconditioned_dims],
        "skip_preconditioning_rank_lt": b.skip_rank_lt,
    }
    if not b.squeeze and b.merge_dims_up_to is None:
        kwargs["shape_interpretation"] = False
        # A parameter of rank <= 1 is never preconditioned (preconditioner.py:64).
        if b.skip_rank_lt < 2:
            out.append(f"blocking.skip_rank_lt = {b.skip_rank_lt!r} without squeezing: "
                       "ScalableShampoo preconditions no parameter of rank <= 1 "
                       "(utils/preconditioner.py:64): 2 or more")
    elif (b.squeeze and b.merge_dims_up_to == b.max_preconditioner_dim
          and b.merge_direction == "first_to_last" and b.merge_target_rank == 1):
        # Its own merge (utils/shape.py:4-29): DEVIATIONS["merge_small_dims"].
        kwargs["shape_interpretation"] = True
    else:
        out.append(f"blocking: squeeze = {b.squeeze}, merge_dims_up_to = {b.merge_dims_up_to!r}, "
                   f"merge_direction = {b.merge_direction!r}: shape_interpretation merges "
                   "first to last up to block_size (utils/preconditioner.py:51), or nothing "
                   "is merged or squeezed")
    return kwargs, out


def _schedule(config: ShampooConfig) -> tuple[dict[str, Any], list[str]]:
    s = config.schedule
    out = []
    if s.period_anchor != "end":
        out.append("schedule.period_anchor = 'start': ScalableShampoo counts steps from 1 "
                   "and acts at step % f == 0 (shampoo.py:305, :327-330)")
    start = NEVER if s.start_preconditioning_step is None else s.start_preconditioning_step
    # Roots every f steps from the first (shampoo.py:329), whatever the start step.
    if not s.roots_before_start and not (start == 1 and s.precondition_frequency == 1):
        out.append("schedule.roots_before_start = False: roots every f steps from the "
                   "first step (shampoo.py:329-330)")
    if s.precondition_frequency_growth is not None:
        out.append("schedule.precondition_frequency_growth (a fixed root period)")
    if s.roots_take_effect != "same_step":
        out.append("schedule.roots_take_effect = 'next_step'")
    kwargs = {"start_preconditioning_step": start,
              "preconditioning_compute_steps": s.precondition_frequency,
              "statistics_compute_steps": s.statistics_frequency}
    return kwargs, out


def _never_started(config: ShampooConfig) -> ShampooConfig:
    """``config`` with the sections that only the Shampoo direction reads replaced by
    ScalableShampoo's (the direction of a run that never starts preconditioning is
    the graft's, eq. 18, with the graft's momentum buffer, eq. 20)."""
    g = config.grafting
    beta2 = g.beta2 if g.type == "rmsprop" else 0.999
    return dataclasses.replace(
        config,
        statistics=StatisticsConfig(beta2=beta2, initial_value="epsilon_identity"),
        epsilon=EpsilonConfig(value=1e-6, scale="relative", relative_floor=RELATIVE_FLOOR,
                              lambda_max="exact"),
        root_inverse=NEWTON,
        exponents=ExponentConfig(default="preconditioned_dims"),
        eigenvalue_correction=None,
        inverse_root_dtype=None,
        grafting=(g if g.type == "none" else dataclasses.replace(
            g, norm_scope="parameter", norm_epsilon=NORM_EPSILON)),
        blocking=BlockingConfig(max_preconditioner_dim=1024, merge_dims_up_to=None,
                                squeeze=False, skip_rank_lt=2),
        schedule=ScheduleConfig(start_preconditioning_step=None, roots_before_start=True),
    )


def scalable_kwargs(config: ShampooConfig) -> dict[str, Any]:
    """``ScalableShampoo``'s keyword arguments for ``config`` (params aside).

    Raises :class:`Inexpressible` naming every field its arguments cannot say.
    With ``schedule.start_preconditioning_step = None`` (never) the Shampoo
    sections cannot reach the update (shampoo.py:373-380 take the graft's pair),
    so they are not read: ScalableShampoo runs with its own for them.
    """
    if config.schedule.start_preconditioning_step is None:
        config = _never_started(config)
    fields = common_refusals(config) + _root_refusals(config) + _graft_refusals(config)
    fields += _momentum_refusals(config)
    blocking, more = _blocking(config)
    schedule, even_more = _schedule(config)
    refuse("ScalableShampoo", fields + more + even_more)
    m, g = config.momentum, config.grafting
    return {
        "lr": config.learning_rate,
        "betas": (m.momentum, config.statistics.beta2),
        "moving_average_for_momentum": m.momentum > 0 and m.dampening == m.momentum,
        "weight_decay": config.weight_decay.value,
        "decoupled_weight_decay": config.weight_decay.type == "update",
        "decoupled_learning_rate": m.learning_rate_placement == "after_momentum",
        "inverse_exponent_override": int(config.exponents.override),
        **schedule,
        **blocking,
        "graft_type": GRAFTS[g.type],
        "nesterov": m.nesterov,
        "diagonal_eps": g.epsilon,
        "matrix_eps": config.epsilon.value,
        "use_svd": False,
    }


# ------------------------------------------------------------------- capabilities
def expressible(config: ShampooConfig, dtype: Any = np.float64) -> str | None:
    """Why ``ScalableShampoo`` cannot run ``config`` in ``dtype``, or None if it can."""
    try:
        scalable_kwargs(in_dtype(config, dtype))
    except Inexpressible as err:
        return str(err)
    return None


@st.composite
def _kwargs(draw: Any) -> dict[str, Any]:
    """``ScalableShampoo`` kwargs that precondition within a few steps."""
    freq = draw(st.integers(1, 3))
    beta1 = draw(st.sampled_from([0.0, 0.5, 0.9]))
    kwargs: dict[str, Any] = {
        "lr": draw(st.sampled_from([0.01, 0.1, 0.5])),
        "betas": (beta1, draw(st.sampled_from([0.9, 0.99, 0.999]))),
        "moving_average_for_momentum": draw(st.booleans()),
        "weight_decay": draw(st.sampled_from([0.0, 0.01])),
        "decoupled_weight_decay": draw(st.booleans()),
        "decoupled_learning_rate": draw(st.booleans()),
        "inverse_exponent_override": draw(st.sampled_from([0, 0, 2, 4])),
        "start_preconditioning_step": draw(st.sampled_from([1, freq, freq + 1, 3])),
        "preconditioning_compute_steps": freq,
        "statistics_compute_steps": draw(st.sampled_from([1, 1, 2])),
        "block_size": draw(st.sampled_from([2, 3, 4, 5, 7, 1024])),
        "skip_preconditioning_rank_lt": draw(st.sampled_from([1, 2, 3])),
        "no_preconditioning_for_layers_with_dim_gt": draw(st.sampled_from([8192, 12])),
        # Its own merge differs from Google's (DEVIATIONS["merge_small_dims"]).
        "shape_interpretation": False,
        "graft_type": draw(st.sampled_from([0, 1, 2, 3, 4])),
        "nesterov": draw(st.booleans()),
        "diagonal_eps": draw(st.sampled_from([1e-10, 1e-6])),
        # The suite's well-conditioned range (strategies.configs).
        "matrix_eps": draw(st.sampled_from([1e-3, 1e-2, 0.1])),
    }
    if kwargs["graft_type"] == 0 and beta1 > 0:
        # Without a graft the spec has one momentum buffer, ScalableShampoo two: the
        # same only without a warm-up (scalable_kwargs).
        kwargs["start_preconditioning_step"] = 1
    # One-sided preconditioning of blocked parameters can crash
    # (DEVIATIONS["one_sided_blocks_crash"]): one block per parameter then.
    kwargs["pre_conditioner_type"] = draw(st.sampled_from([0, 0, 1, 2]))
    if kwargs["pre_conditioner_type"] != 0:
        kwargs["block_size"] = 1024
    return kwargs


def configs() -> st.SearchStrategy[ShampooConfig]:
    """Configs ``ScalableShampoo`` expresses: its own kwargs, imported (:func:`from_kwargs`)."""
    return _kwargs().map(from_kwargs)


def base_config() -> ShampooConfig:
    """ScalableShampoo's config nearest ``ShampooConfig()``: no graft, momentum or
    warm-up, roots every step, nothing merged; its own Newton, ridge and epsilon."""
    return case(betas=(0.0, 0.999), graft_type=0, nesterov=False, block_size=1024)


#: Its own argument sets on the suite's named problem (conformance/cases.py
#: CASE_SHAPES): its defaults with small blocks (8: no block of those shapes is a
#: single row), each graft, one-sided preconditioning, the coupled learning rate
#: and weight decay, moving-average momentum, a warm-up and a root period.
CASES: dict[str, ShampooConfig] = {
    "defaults_small_blocks": case(block_size=4),
    "no_graft": case(graft_type=0, matrix_eps=1e-3),
    "adagrad_graft": case(graft_type=2, diagonal_eps=1e-6),
    "rmsprop_graft": case(graft_type=3, betas=(0.9, 0.99)),
    "sign_graft": case(graft_type=4),
    # One block per parameter: blocked one-sided preconditioning can crash
    # (DEVIATIONS["one_sided_blocks_crash"]).
    "input_side": case(pre_conditioner_type=1, matrix_eps=1e-3, block_size=1024),
    "output_side": case(pre_conditioner_type=2, matrix_eps=1e-3, block_size=1024),
    "coupled_lr_weight_decay": case(decoupled_learning_rate=False, weight_decay=0.01,
                                     moving_average_for_momentum=True),
    "decoupled_weight_decay": case(weight_decay=0.01, decoupled_weight_decay=True,
                                    nesterov=False),
    "warmup_and_period": case(start_preconditioning_step=4, preconditioning_compute_steps=3,
                               statistics_compute_steps=2, inverse_exponent_override=2),
}

# ---------------------------------------------------------------------- running
def _optimizer(config: ShampooConfig, tensors: list[torch.nn.Parameter],
               dtype: Any) -> ScalableShampoo:
    reason = expressible(config, dtype)
    if reason is not None:
        raise Inexpressible(f"backend 'pytorch-optimizer': {reason}")
    return ScalableShampoo(tensors, **scalable_kwargs(in_dtype(config, dtype)))


def run(
    config: ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: Any = np.float64,
) -> list[dict[str, np.ndarray]]:
    """The parameters (as ``dtype`` arrays) after each step of ``grads``."""
    return run_optimizer("pytorch-optimizer", _optimizer, config, params, grads, dtype)


def stepper(
    optimizer: str,
    params: dict[str, np.ndarray],
    *,
    lr: float,
    config: ShampooConfig | None = None,
    weight_decay: float = 0.0,
    dtype: Any = np.float64,
) -> Stepper:
    """A closed-loop :class:`~shampoo_conformance.adapters.torch.Stepper`:
    ``ScalableShampoo`` from ``config`` (default :func:`base_config`) with learning rate
    ``lr``, or ``torch.optim.AdamW`` (as the torch backend's)."""
    return make_stepper("pytorch-optimizer", _optimizer, optimizer, params, lr, config,
                        weight_decay, base_config(), dtype)



def library_run(kwargs: dict[str, Any], params: dict[str, np.ndarray],
                grads: list[dict[str, np.ndarray]], dtype: Any = np.float64) -> LibraryRun:
    """``ScalableShampoo(params, **kwargs)`` stepped as a user steps it (the registry's
    ``library_run``): exactly ``kwargs``, the caller's generators, nothing seeded."""
    return torch_library_run(lambda tensors, kw: ScalableShampoo(tensors, **kw),
                             kwargs, params, grads, dtype)
