"""pytorch-optimizer's ``ScalableShampoo`` arguments in the spec's terms (its import).

What :mod:`.pytorch_optimizer` (the backend) and :mod:`.pytorch_optimizer_deviations`
share: ScalableShampoo's constants (its fixed Newton iteration, ridge floor,
graft norm epsilon; the integer codes of its grafts and sides), the refusals
both of pytorch-optimizer's Shampoos share, :func:`from_kwargs` (its
constructor's arguments -> the config it runs) and its defaults
(:data:`USER_KWARGS`, :func:`defaults_config`). Source pointers are relative to
``pytorch_optimizer/optimizer/`` of the 4.1.0 wheel (:data:`SRC`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shampoo_spec import CoupledNewtonConfig, Inexpressible, ShampooConfig, from_google
from shampoo_spec.config import EpsilonConfig, GraftingConfig

#: Where pytorch-optimizer 4.1.0 lives, for the pointers below.
SRC = "pytorch_optimizer/optimizer"

#: ``ScalableShampoo``'s coupled Newton (utils/matrix.py:193-200 defaults,
#: never overridden by preconditioner.py:144-146): 100 iterations, stop at
#: max|M - I| <= 1e-3, keep the previous iterate when the error grows 1.2x;
#: no retries, and every root is used (no failure test).
NEWTON = CoupledNewtonConfig(max_iterations=100, tolerance=1e-3, error_growth_limit=1.2,
                             retries=0, failure_threshold=None)

#: Its ridge (matrix.py:111, :227): matrix_eps * max(lambda, 1e-16); lambda from
#: 100 power iterations (a random start, no tolerance): lambda_max to rounding.
RELATIVE_FLOOR = 1e-16

#: Its graft rescale shampoo * ||graft|| / (||shampoo|| + 1e-16) (shampoo.py:344).
NORM_EPSILON = 1e-16

#: ``LayerWiseGrafting`` (utils/graft.py:317-331) by ``grafting.type``.
GRAFTS = {"none": 0, "sgd": 1, "adagrad": 2, "rmsprop": 3, "sign": 4}
#: ... and by Google's ``GraftingType`` name (what ``from_google`` reads).
GOOGLE_GRAFTS = {0: "NONE", 1: "SGD", 2: "ADAGRAD", 3: "RMSPROP", 4: "SQRT_N"}

#: ``PreConditionerType`` (utils/partition.py:207-217) by ``blocking.preconditioned_dims``.
SIDES = {"all": 0, "all_but_last": 1, "last": 2}
GOOGLE_SIDES = {0: "ALL", 1: "INPUT", 2: "OUTPUT"}

#: A start step no run reaches (``schedule.start_preconditioning_step=None``) and
#: a dim limit no parameter exceeds (``blocking.skip_dim_size_gt=None``).
NEVER = 2**62

#: ``ScalableShampoo``'s constructor defaults (shampoo.py:193-218), those
#: :func:`from_kwargs` reads.
DEFAULTS: dict[str, Any] = {
    "lr": 1e-3, "betas": (0.9, 0.999), "moving_average_for_momentum": False,
    "weight_decay": 0.0, "decoupled_weight_decay": False, "decoupled_learning_rate": True,
    "inverse_exponent_override": 0, "start_preconditioning_step": 25,
    "preconditioning_compute_steps": 1000, "statistics_compute_steps": 1,
    "block_size": 512, "skip_preconditioning_rank_lt": 1,
    "no_preconditioning_for_layers_with_dim_gt": 8192, "shape_interpretation": True,
    "graft_type": 1, "pre_conditioner_type": 0, "nesterov": True, "diagonal_eps": 1e-10,
    "matrix_eps": 1e-6,
}

#: What a user gives ``ScalableShampoo`` besides the parameters: a learning rate
#: (its default 1e-3 is SGD's scale, and the graft is SGD's), every other argument
#: at its default.
USER_KWARGS: dict[str, Any] = {"lr": 0.01}

#: Why its eigendecomposition path (``use_svd=True``) is no config of the spec.
SVD_REFUSAL = ("use_svd=True takes the inverse root of the statistics with no epsilon at all "
               "(utils/matrix.py:268-282) while their initial matrix_eps I decays by beta2^t "
               "(beta2 < 1 is required, base/optimizer.py:665-675): no placement of "
               "eqs. (9)-(10) says that")


def refuse(backend: str, fields: list[str]) -> None:
    """Raise :class:`Inexpressible` naming every field ``backend``'s arguments cannot say."""
    if fields:
        raise Inexpressible(f"{backend} cannot express: " + "; ".join(fields))


def common_refusals(config: ShampooConfig) -> list[str]:
    """Sections neither of pytorch-optimizer's Shampoos has an argument for."""
    out = []
    if config.inverse_root_dtype is not None:
        out.append(f"inverse_root_dtype = {config.inverse_root_dtype!r} (roots are kept in "
                   "the statistics' dtype, the parameters')")
    if config.update_dtype is not None:
        out.append(f"update_dtype = {config.update_dtype!r} (no update dtype argument)")
    if config.eigenvalue_correction is not None:
        out.append("eigenvalue_correction (no eigenvalue-corrected Shampoo)")
    if config.diagonal is not None:
        out.append("diagonal (no diagonal preconditioner in place of Shampoo's, eq. 16b)")
    if config.spectral is not None:
        out.append("spectral (no spectral descent, eq. 16c)")
    if config.averaging is not None:
        out.append("averaging (no iterate averaging, eq. 20d)")
    if config.statistics.kl:
        out.append("statistics.kl (no KL-Shampoo statistics, eq. 6b)")
    if config.gradient_filter.beta1 != 0.0:
        out.append(f"gradient_filter.beta1 = {config.gradient_filter.beta1!r} (no gradient "
                   "filter before preconditioning)")
    if config.failure.nonfinite_gradient != "raise":
        out.append(f"failure.nonfinite_gradient = {config.failure.nonfinite_gradient!r} "
                   "(no per-block skip of non-finite gradients)")
    if config.failure.max_consecutive_root_failures is not None:
        out.append("failure.max_consecutive_root_failures (roots are never judged)")
    if config.statistics.trace_scaling_exponent != 0.0:
        out.append("statistics.trace_scaling_exponent (no trace scaling)")
    if config.statistics.bias_correction:
        out.append("statistics.bias_correction (the statistics are never bias-corrected)")
    if config.statistics.ema_weight != "one_minus_beta2":
        out.append("statistics.ema_weight = 'one' (weight 1 - beta2, or 1 when beta2 = 1)")
    if config.statistics.initial_value != "epsilon_identity":
        out.append("statistics.initial_value = 'zero' (statistics start at matrix_eps I)")
    if config.weight_decay.scale_by_lr_ratio:
        out.append("weight_decay.scale_by_lr_ratio (no corrected weight decay)")
    if config.momentum.storage != "float":
        out.append(f"momentum.storage = {config.momentum.storage!r} (float momentum only)")
    return out


def google_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Google's ``distributed_shampoo`` arguments of the same names and values as
    ``ScalableShampoo(**kwargs)`` (its defaults filled in), as a reader of its docstring
    would pass them to Google's: what :func:`from_kwargs` starts from, before the rules
    where the port differs (the deviations ``start_step_counted_from_one``,
    ``one_based_root_schedule``, ``vectors_never_preconditioned`` and the adapter tests
    run the library against the reference on this reading)."""
    k = {**DEFAULTS, **kwargs}
    return {
        "learning_rate": k["lr"], "block_size": k["block_size"],
        "beta1": k["betas"][0], "beta2": k["betas"][1],
        "diagonal_epsilon": k["diagonal_eps"], "matrix_epsilon": k["matrix_eps"],
        "weight_decay": k["weight_decay"],
        "start_preconditioning_step": k["start_preconditioning_step"],
        "preconditioning_compute_steps": k["preconditioning_compute_steps"],
        "statistics_compute_steps": k["statistics_compute_steps"],
        "best_effort_shape_interpretation": k["shape_interpretation"],
        "merge_small_dims_block_size": k["block_size"],
        "graft_type": GOOGLE_GRAFTS[k["graft_type"]],
        "nesterov": k["nesterov"],
        "exponent_override": k["inverse_exponent_override"],
        "moving_average_for_momentum": k["moving_average_for_momentum"],
        "skip_preconditioning_dim_size_gt": k["no_preconditioning_for_layers_with_dim_gt"],
        "skip_preconditioning_rank_lt": k["skip_preconditioning_rank_lt"],
        "preconditioner_type": GOOGLE_SIDES[k["pre_conditioner_type"]],
        # Google refuses NONE without it (it then applies no lr); set in from_kwargs.
        "decoupled_learning_rate": True,
        "decoupled_weight_decay": k["decoupled_weight_decay"],
        "relative_matrix_epsilon": True,
    }


def from_kwargs(kwargs: dict[str, Any]) -> ShampooConfig:
    """The config ``ScalableShampoo(**kwargs)`` runs: Google's arguments for it
    (:func:`google_kwargs`), imported with :func:`from_google`, then ScalableShampoo's
    own rules (module docstring of :mod:`.pytorch_optimizer`; each a deviation)."""
    k = {**DEFAULTS, **kwargs}
    if k.get("use_svd"):
        raise Inexpressible(f"ScalableShampoo cannot express: use_svd=True ({SVD_REFUSAL})")
    google = google_kwargs(k)
    # Google's count is 0-based: its start s is our step s + 1, ScalableShampoo's s
    # (DEVIATIONS["start_step_counted_from_one"]).
    google["start_preconditioning_step"] -= 1
    config = from_google(google, x64=True)
    b = config.blocking
    if not k["shape_interpretation"]:
        # Rank <= 1 is never preconditioned (preconditioner.py:64), whatever
        # skip_preconditioning_rank_lt says (DEVIATIONS["vectors_never_preconditioned"]).
        b = dataclasses.replace(b, skip_rank_lt=max(b.skip_rank_lt, 2))
    graft = config.grafting
    if graft.type != "none":
        graft = dataclasses.replace(graft, norm_epsilon=NORM_EPSILON,
                                    normalize_epsilon=GraftingConfig().normalize_epsilon)
    momentum = config.momentum
    if momentum.momentum > 0 and graft.type != "none":
        # Two buffers always (shampoo.py:278, utils/graft.py:338); without a graft the
        # shared one equals them only without a warm-up (scalable_kwargs refuses it).
        momentum = dataclasses.replace(momentum, buffers="separate")
    if not k["decoupled_learning_rate"]:
        momentum = dataclasses.replace(momentum, learning_rate_placement="before_momentum")
    return dataclasses.replace(
        config,
        epsilon=EpsilonConfig(value=k["matrix_eps"], scale="relative",
                              relative_floor=RELATIVE_FLOOR, placement="ridge",
                              lambda_max="exact"),
        root_inverse=NEWTON,
        grafting=graft,
        momentum=momentum,
        blocking=b,
        # DEVIATIONS["one_based_root_schedule"]: step % f == 0 on a 1-based step.
        schedule=dataclasses.replace(
            config.schedule, period_anchor="end",
            start_preconditioning_step=k["start_preconditioning_step"]),
    )


def case(**kwargs: Any) -> ShampooConfig:
    """Its defaults, preconditioning from the first step with roots every step, blocks
    of 8 and nothing merged (its own merge is a deviation): the base of its CASES."""
    base = {"lr": 0.1, "start_preconditioning_step": 1, "preconditioning_compute_steps": 1,
            "block_size": 8, "shape_interpretation": False}
    return from_kwargs({**base, **kwargs})


def defaults_config() -> ShampooConfig:
    """The spec's config nearest ``ScalableShampoo(params, **USER_KWARGS)``: its
    defaults imported (Google's best-effort shape interpretation with
    ``merge_small_dims_block_size = block_size = 512``, Shampoo from step 25 with
    roots at step % 1000 == 0, so the identity until step 1000, an SGD graft,
    Nesterov momentum 0.9, beta2 0.999, matrix_eps 1e-6 relative). What it
    computes differs where its merge does (DEVIATIONS["merge_small_dims"]: a
    parameter of at most 512 elements is not preconditioned at all); before step
    25 both are the SGD graft with momentum, so the suite's short runs agree."""
    return from_kwargs(USER_KWARGS)
