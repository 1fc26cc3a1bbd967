"""The ``pytorch-optimizer-shampoo`` backend: pytorch-optimizer's plain ``Shampoo``.

pytorch-optimizer 4.1.0's ``Shampoo`` (``pytorch_optimizer/optimizer/shampoo.py:12-156``)
is the original algorithm of Gupta et al. (2018) with one factor per dim of the
parameter as it is. Its update rule, read from the source, in the spec's terms:

- ``G <- G + weight_decay W`` before anything else (shampoo.py:118-125, coupled
  decay: ``weight_decay.type = "l2"``), or ``W <- W (1 - lr weight_decay)`` with
  ``weight_decouple=True`` (``"update"``; ``fixed_decay`` decays by weight_decay
  alone, which no config says);
- per dim k of the parameter (size-1 dims included, no blocking, no merging):
  ``L_k <- L_k + G_(k) G_(k)^T`` from ``matrix_eps I`` (:86-88, :134: sums,
  ``beta2 = 1``, ``initial_value = "epsilon_identity"``);
- every ``preconditioning_compute_steps`` steps (1-based, ``step % f == 0``,
  :142-143) ``X_k = L_k^(-1/(2 * order))`` by SVD, with no further epsilon
  (utils/matrix.py:268-282): for the symmetric L_k >= matrix_eps I this is
  eq. (10)'s eigendecomposition with ``epsilon.placement = "floor"`` (the floor
  ``max(lambda, matrix_eps)`` never binds), exponent ``2 * order``
  (``exponents.default = "block_order"``);
- ``W <- W - lr P``, P the Kronecker product of eq. (16) (:145-154); no graft.

``momentum > 0`` mixes the previous *preconditioned* direction into the next
gradient, ``G <- (1 - m) G + m P_{t-1}``, and that mixture enters the statistics
(:83-84, :115-116, :152): no config of the spec says that, so it is refused, as
``fixed_decay`` is. The inverse roots start at zero (:90), not at the identity:
:data:`DEVIATIONS`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from pytorch_optimizer import Shampoo

from shampoo_conformance.adapters.torch import Stepper
from shampoo_conformance.adapters.torch_user_run import torch_library_run
from shampoo_conformance.thirdparty.pytorch_optimizer_deviations import (
    grad_negated_by_maximize,
    unknown_arguments_swallowed,
)
from shampoo_conformance.thirdparty.pytorch_optimizer_kwargs import (
    SRC,
    common_refusals,
    refuse,
)
from shampoo_conformance.thirdparty.registry import Deviation, LibraryRun
from shampoo_conformance.thirdparty.torch_library import in_dtype, make_stepper, run_optimizer
from shampoo_spec import EighConfig, Inexpressible, ShampooConfig
from shampoo_spec.anchors._parse import UNBOUNDED
from shampoo_spec.config import (
    BlockingConfig,
    EpsilonConfig,
    ExponentConfig,
    GraftingConfig,
    MomentumConfig,
    ScheduleConfig,
    StatisticsConfig,
    WeightDecayConfig,
)

#: Parameter dtypes this backend runs (its statistics and roots follow them).
dtypes = (np.float64, np.float32)

#: The spec's sections that ``Shampoo``'s rule fixes (module docstring).
STATISTICS = StatisticsConfig(beta2=1.0, initial_value="epsilon_identity")
BLOCKING = BlockingConfig(max_preconditioner_dim=UNBOUNDED, merge_dims_up_to=None,
                          squeeze=False, skip_rank_lt=0, scalar_factor=False)
EXPONENTS = ExponentConfig(default="block_order")


def shampoo_kwargs(config: ShampooConfig) -> dict[str, Any]:
    """``Shampoo``'s keyword arguments for ``config`` (params aside).

    Raises :class:`Inexpressible` naming every field its arguments cannot say.
    """
    fields = common_refusals(config)
    if config.statistics != STATISTICS:
        fields.append(f"statistics = {config.statistics!r}: sums from matrix_eps I "
                      "(beta2 = 1, shampoo.py:86-88, :134)")
    eps = config.epsilon
    if not isinstance(config.root_inverse, EighConfig) or config.root_inverse != EighConfig():
        fields.append(f"root_inverse = {config.root_inverse!r}: an SVD, eq. (10) with no "
                      "failure test (utils/matrix.py:268-282)")
    if eps.scale != "absolute" or eps.placement != "floor":
        fields.append(f"epsilon = {eps.scale} {eps.placement}: the roots take no epsilon "
                      "beyond the statistics' initial matrix_eps I (placement 'floor', "
                      "absolute)")
    if config.exponents != EXPONENTS:
        fields.append(f"exponents = {config.exponents!r}: 2 * order (shampoo.py:143)")
    if config.blocking != BLOCKING:
        fields.append("blocking: one factor per dim of the parameter as it is, no blocks, "
                      "no merging, size-1 dims kept, a 0-d parameter unpreconditioned "
                      "(shampoo.py:86-90, :130-150)")
    if config.grafting != GraftingConfig():
        fields.append(f"grafting.type = {config.grafting.type!r} (no grafting)")
    if config.momentum.momentum != 0.0:
        fields.append(f"momentum.momentum = {config.momentum.momentum!r}: Shampoo's momentum "
                      "mixes the previous preconditioned direction into the gradient that "
                      "enters its statistics (shampoo.py:83-84, :115-116, :152)")
    if config.weight_decay.type == "direction" and config.weight_decay.value != 0.0:
        fields.append("weight_decay.type = 'direction' (decay enters before the statistics, "
                      "shampoo.py:118-125, or on the parameter)")
    s = config.schedule
    if (s.start_preconditioning_step != 1 or s.statistics_frequency != 1
            or s.period_anchor != "end" or s.precondition_frequency_growth is not None
            or s.roots_take_effect != "same_step"
            or not (s.roots_before_start or s.precondition_frequency == 1)):
        fields.append("schedule: statistics every step, Shampoo from step 1, roots at "
                      "step % preconditioning_compute_steps == 0 (shampoo.py:142)")
    refuse("Shampoo", fields)
    return {
        "lr": config.learning_rate,
        "momentum": 0.0,
        "weight_decay": config.weight_decay.value,
        "weight_decouple": config.weight_decay.type == "update",
        "fixed_decay": False,
        "preconditioning_compute_steps": s.precondition_frequency,
        "matrix_eps": eps.value,
    }


def expressible(config: ShampooConfig, dtype: Any = np.float64) -> str | None:
    """Why ``Shampoo`` cannot run ``config`` in ``dtype``, or None if it can."""
    try:
        shampoo_kwargs(in_dtype(config, dtype))
    except Inexpressible as err:
        return str(err)
    return None


def from_kwargs(kwargs: dict[str, Any]) -> ShampooConfig:
    """The config ``Shampoo(**kwargs)`` runs (the mapping of the module docstring)."""
    k = {"lr": 1e-3, "momentum": 0.0, "weight_decay": 0.0, "weight_decouple": False,
         "fixed_decay": False, "preconditioning_compute_steps": 1, "matrix_eps": 1e-6,
         **kwargs}
    if k["momentum"] != 0.0 or (k["fixed_decay"] and k["weight_decouple"]):
        raise Inexpressible(f"Shampoo: momentum = {k['momentum']!r}, fixed_decay = "
                            f"{k['fixed_decay']!r} (module docstring)")
    return ShampooConfig(
        learning_rate=k["lr"],
        statistics=STATISTICS,
        epsilon=EpsilonConfig(value=k["matrix_eps"], scale="absolute", placement="floor"),
        root_inverse=EighConfig(),
        exponents=EXPONENTS,
        grafting=GraftingConfig(),
        momentum=MomentumConfig(),
        weight_decay=WeightDecayConfig(value=k["weight_decay"],
                                       type="update" if k["weight_decouple"] else "l2"),
        blocking=BLOCKING,
        schedule=ScheduleConfig(precondition_frequency=k["preconditioning_compute_steps"],
                                start_preconditioning_step=1, period_anchor="end",
                                roots_before_start=True),
        factor_dtype="float64",
    )


@st.composite
def _kwargs(draw: Any) -> dict[str, Any]:
    """``Shampoo`` kwargs: roots every step (DEVIATIONS["zero_initial_roots"])."""
    return {
        "lr": draw(st.sampled_from([0.01, 0.1, 0.5])),
        "weight_decay": draw(st.sampled_from([0.0, 0.01])),
        "weight_decouple": draw(st.booleans()),
        "preconditioning_compute_steps": 1,
        # The suite's well-conditioned range (strategies.configs).
        "matrix_eps": draw(st.sampled_from([1e-3, 1e-2, 0.1])),
    }


def configs() -> st.SearchStrategy[ShampooConfig]:
    """Configs ``Shampoo`` expresses: its own kwargs, mapped by :func:`from_kwargs`."""
    return _kwargs().map(from_kwargs)


def base_config() -> ShampooConfig:
    """Its defaults with a larger learning rate: the config fixed laws start from."""
    return from_kwargs({"lr": 0.1})


#: Its own argument sets on the suite's named problem (its defaults, the two decays,
#: a larger epsilon).
CASES: dict[str, ShampooConfig] = {
    "defaults": from_kwargs({"lr": 0.1}),
    "l2_decay": from_kwargs({"lr": 0.1, "weight_decay": 0.01}),
    "decoupled_decay": from_kwargs({"lr": 0.1, "weight_decay": 0.01, "weight_decouple": True}),
    "large_epsilon": from_kwargs({"lr": 0.5, "matrix_eps": 0.1}),
}

#: What a user gives ``Shampoo`` besides the parameters: a learning rate (as the
#: other adapters' users), every other argument at its default (shampoo.py:29-41).
USER_KWARGS: dict[str, Any] = {"lr": 0.01}


def defaults_config() -> ShampooConfig:
    """The config ``Shampoo(params, **USER_KWARGS)`` runs: its defaults (no momentum,
    no weight decay, roots every step from matrix_eps 1e-6 I) imported exactly
    (:func:`from_kwargs`)."""
    return from_kwargs(USER_KWARGS)


_SHAMPOO = f"{SRC}/shampoo.py"

DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        name="zero_initial_roots",
        config=from_kwargs({"lr": 0.1, "preconditioning_compute_steps": 3}),
        tests=(),
        cause=("the inverse roots start at zero (torch.zeros, "
               f"{_SHAMPOO}:90), not at the identity (eq. 13): with "
               "preconditioning_compute_steps = f > 1 the first f - 1 steps precondition "
               "the gradient to zero and the parameters do not move"),
        kind="defect",
    ),
    Deviation(
        name="grad_overwritten",
        config=None,
        tests=(),
        cause=(f"step() works on p.grad itself (grad = p.grad, {_SHAMPOO}:109): with "
               f"momentum > 0 it lerps the previous preconditioned direction into the "
               f"caller's gradient in place (:115-116), and with coupled weight decay "
               f"(weight_decouple=False) it adds weight_decay * W to it in place (:118-125, "
               "pytorch_optimizer/base/optimizer.py:209): after the step p.grad is no longer "
               "the gradient the caller computed (gradient accumulation, clipping or logging "
               "after step() see the mixture); USER_KWARGS has neither, so the suite's grads "
               "property passes and the adapter tests demonstrate it"),
        kind="defect",
    ),
    unknown_arguments_swallowed("Shampoo", f"{_SHAMPOO}:40"),
    grad_negated_by_maximize("Shampoo", f"{_SHAMPOO}:109-111"),
)


def _optimizer(config: ShampooConfig, tensors: list[torch.nn.Parameter], dtype: Any) -> Shampoo:
    reason = expressible(config, dtype)
    if reason is not None:
        raise Inexpressible(f"backend 'pytorch-optimizer-shampoo': {reason}")
    return Shampoo(tensors, **shampoo_kwargs(in_dtype(config, dtype)))


def run(
    config: ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: Any = np.float64,
) -> list[dict[str, np.ndarray]]:
    """The parameters (as ``dtype`` arrays) after each step of ``grads``."""
    return run_optimizer("pytorch-optimizer-shampoo", _optimizer, config, params, grads, dtype)


def stepper(
    optimizer: str,
    params: dict[str, np.ndarray],
    *,
    lr: float,
    config: ShampooConfig | None = None,
    weight_decay: float = 0.0,
    dtype: Any = np.float64,
) -> Stepper:
    """A closed-loop :class:`~shampoo_conformance.adapters.torch.Stepper`: ``Shampoo``
    from ``config`` (default :func:`base_config`) with learning rate ``lr``, or
    ``torch.optim.AdamW`` (as the torch backend's)."""
    return make_stepper("pytorch-optimizer-shampoo", _optimizer, optimizer, params, lr, config,
                        weight_decay, base_config(), dtype)


def library_run(kwargs: dict[str, Any], params: dict[str, np.ndarray],
                grads: list[dict[str, np.ndarray]], dtype: Any = np.float64) -> LibraryRun:
    """``Shampoo(params, **kwargs)`` stepped as a user steps it (the registry's
    ``library_run``): exactly ``kwargs``, the caller's generators, nothing seeded."""
    return torch_library_run(lambda tensors, kw: Shampoo(tensors, **kw),
                             kwargs, params, grads, dtype)
