"""Where, when and what on failure: the shape plan, the schedule and the failure rules.

:class:`BlockingConfig` (eqs. 4-5), :class:`ScheduleConfig` (eqs. 8, 8b) and
:class:`FailureConfig` (eqs. 3, 13).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from . import allowed
from .allowed import check_fields


@dataclass(frozen=True, kw_only=True)
class BlockingConfig:
    """The shape plan: squeeze, merge, block, skip, eqs. (4)-(5).

    Size-1 dims are dropped (``squeeze``; False keeps them, each a 1 x 1
    factor that counts in its block's order, as Google's
    ``best_effort_shape_interpretation=False``). A 0-d parameter is one
    ``(1,)`` block with a 1 x 1 factor, or with no factor when
    ``scalar_factor`` is False (Meta's target dimensionality inf, Google's
    ``skip_preconditioning_rank_lt=0``). Dims are merged greedily while the product stays
    <= ``merge_dims_up_to`` (None: no merging), scanning from the last dim
    toward the first (Meta) or the first toward the last (Google), and only
    while more than ``merge_target_rank`` dims could remain (Meta's
    ``target_parameter_dimensionality``). Each dim is
    then split into chunks of ``max_preconditioner_dim`` (remainder last),
    blocks in row-major order. A parameter is not preconditioned (it takes the
    graft direction) when an original dim exceeds ``skip_dim_size_gt`` or its
    rank is below ``skip_rank_lt``. ``preconditioned_dims`` selects one-sided
    preconditioning: all dims, all but the last (``"all_but_last"``,
    Google's INPUT) or only the last (``"last"``, Google's OUTPUT).
    """

    max_preconditioner_dim: int = field(default=1024, metadata=allowed.integer(low=1))
    merge_dims_up_to: int | None = field(
        default=1024, metadata=allowed.integer(low=1, none_means="off"))
    merge_direction: Literal["last_to_first", "first_to_last"] = field(
        default="last_to_first", metadata=allowed.choice(("last_to_first", "first_to_last")))
    skip_dim_size_gt: int | None = field(
        default=None, metadata=allowed.integer(low=1, none_means="off"))
    skip_rank_lt: int = field(default=0, metadata=allowed.integer(low=0))
    preconditioned_dims: Literal["all", "all_but_last", "last"] = field(
        default="all", metadata=allowed.choice(("all", "all_but_last", "last")))
    squeeze: bool = field(default=True, metadata=allowed.boolean())
    merge_target_rank: int = field(default=1, metadata=allowed.integer(low=1))
    scalar_factor: bool = field(default=True, metadata=allowed.boolean())

    def __post_init__(self) -> None:
        check_fields(self, "blocking")


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """When statistics, roots and the Shampoo direction happen, eq. (8).

    Steps are counted t = 1, 2, ... With ``period_anchor="end"`` amortized
    work happens when ``t % frequency == 0`` (Meta); with ``"start"`` when
    ``(t - 1) % frequency == 0`` (Google's 0-based count). The Shampoo
    direction is used from ``start_preconditioning_step`` on (None: never,
    the grafting method throughout). ``roots_before_start=False`` computes
    roots only from the start step, and always at it (Meta);
    ``True`` follows the frequency from step 1 (Google).

    ``roots_take_effect``: roots refreshed at a root step precondition that
    step's direction (``"same_step"``), or only the next step's on
    (``"next_step"``: the step's direction uses the roots held before it, as
    Google's ``shard_optimizer_states=True`` does). Not with
    ``eigenvalue_correction``.

    ``precondition_frequency_growth`` = g (Google's
    ``end_preconditioning_compute_steps`` with
    ``decay_preconditioning_compute_steps``) makes the root period follow the
    learning rate (eq. 8b): ``f_t = max(floor((f + (1 - lr_t / lr_1) g) / 10) * 10, 1)``,
    lr_1 the learning rate of the first step
    (:func:`shampoo_spec.schedule.root_period`). None: the period is
    ``precondition_frequency`` throughout.
    """

    precondition_frequency: int = field(default=1, metadata=allowed.integer(low=1))
    statistics_frequency: int = field(default=1, metadata=allowed.integer(low=1))
    start_preconditioning_step: int | None = field(
        default=1, metadata=allowed.integer(low=1, none_means="never precondition"))
    period_anchor: Literal["end", "start"] = field(
        default="end", metadata=allowed.choice(("end", "start")))
    roots_before_start: bool = field(default=False, metadata=allowed.boolean())
    roots_take_effect: Literal["same_step", "next_step"] = field(
        default="same_step", metadata=allowed.choice(("same_step", "next_step")))
    precondition_frequency_growth: int | None = field(
        default=None, metadata=allowed.integer(low=1, none_means="a constant root period"))

    def __post_init__(self) -> None:
        check_fields(self, "schedule")


@dataclass(frozen=True, kw_only=True)
class FailureConfig:
    """What happens on non-finite input or a failed root, eq. (3) and (13).

    ``nonfinite_gradient``: ``"raise"`` (naming the parameter) or
    ``"skip_block"`` (that block's statistics, graft state and parameter are
    left unchanged this step). A failed or non-finite root keeps the previous
    root and is counted; a block whose root steps fail (any factor) more than
    ``max_consecutive_root_failures`` times in a row raises (None: never).
    """

    nonfinite_gradient: Literal["raise", "skip_block"] = field(
        default="raise", metadata=allowed.choice(("raise", "skip_block")))
    max_consecutive_root_failures: int | None = field(
        default=None, metadata=allowed.integer(low=0, none_means="never raise"))

    def __post_init__(self) -> None:
        check_fields(self, "failure")
