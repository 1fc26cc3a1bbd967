"""Tearfree's ``TearfreeOptions``: the fields of its nested option dataclasses, its enum
tables and the constants its code fixes (rank cutoff, Adafactor's scale floor)."""

from __future__ import annotations

OWNER = "from_tearfree"

#: ``TearfreeOptions`` fields.
KEYS = {"grafting_options", "second_order_options", "momentum_options"}
#: ``grafting.Options`` fields.
GRAFTING_KEYS = {
    "grafting_type",
    "second_moment_decay",
    "start_preconditioning_step",
    "epsilon",
    "skip_preconditioning_any_dim_gt",
    "skip_preconditioning_rank1",
    "min_dim_size_to_factor",
    "multiply_by_parameter_scale",
    "clipping_threshold",
}
#: ``second_order.Options`` fields.
SECOND_ORDER_KEYS = {"merge_dims", "second_order_type", "shampoo_options", "sketchy_options"}
#: ``shampoo.Options`` fields.
SHAMPOO_KEYS = {
    "block_size",
    "update_preconditioners_freq",
    "update_statistics_freq",
    "second_moment_decay",
}
#: ``sketchy.Options`` fields.
SKETCHY_KEYS = {
    "epsilon",
    "rank",
    "relative_epsilon",
    "second_moment_decay",
    "update_freq",
    "add_ggt",
    "memory_alloc",
    "ekfac_svd",
    "linear_approx_tail",
}
#: ``momentum.Options`` fields.
MOMENTUM_KEYS = {"ema", "nesterov", "momentum_decay", "weight_decay", "weight_decay_after_momentum"}

#: ``grafting.GraftingType``: member name -> value (tearfree's enums have string values).
GRAFTING_TYPES = {"NONE": "none", "SGD": "sgd", "RMSPROP": "rmsprop", "ADAFACTOR": "adafactor"}
#: ``second_order.SecondOrderType``: member name -> value.
SECOND_ORDER_TYPES = {"SHAMPOO": "shampoo", "SKETCHY": "sketchy"}

#: Tearfree's ``_pth_inv_root``: eigenvalues ``w <= 1e-6 * max(w)`` get a zero root.
RANK_RTOL = 1e-6
#: ``optax.scale_by_param_block_rms``'s ``min_scale``, which ``optax.adafactor`` leaves
#: at its default: the floor under rms(W) (eq. 14e).
ADAFACTOR_SCALE_FLOOR = 1e-3
