"""What the adapters of Google's ``distributed_shampoo`` and of its 2022 copy on the
registry (``optax-shampoo``) share, without importing either library: a config in
the run's precision, the JAX precision of a run, and the library's arguments the
suite's random properties draw (JSON form, imported by ``from_google``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Literal

import jax
import numpy as np
from hypothesis import strategies as st

from shampoo_spec import ShampooConfig


def in_dtype(config: ShampooConfig, dtype: Any) -> ShampooConfig:
    """``config`` in the run's precision: Google's x64 sets its factor dtype, and the
    dtype its int8 momentum quantizes in (eq. 20b)."""
    name: Literal["float32", "float64"] = (
        "float64" if np.dtype(dtype) == np.float64 else "float32")
    momentum = config.momentum
    if momentum.storage != "float":
        momentum = dataclasses.replace(momentum, scale_dtype=name)
    return dataclasses.replace(config, factor_dtype=name, momentum=momentum)


def precision(dtype: np.dtype[Any]) -> contextlib.ExitStack:
    """64-bit JAX on exactly for float64 (Google's only dtype switch), arrays on the CPU."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.enable_x64(bool(dtype == np.float64)))
    stack.enter_context(jax.default_device(jax.devices("cpu")[0]))
    if dtype != np.float64:  # Google asks for float64 roots; 32-bit JAX warns, then truncates
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", "Explicitly requested dtype float64", UserWarning)
    return stack


@st.composite
def draw_kwargs(draw: Any) -> dict[str, Any]:
    """``distributed_shampoo`` kwargs (JSON form) that precondition within a few steps.

    Small blocks (2-8), roots every 1-3 steps from count 0, preconditioning
    from step 1-3, each graft type, both root methods (coupled Newton and
    eigh), absolute and relative epsilon, Nesterov or not, heavy-ball or
    moving-average momentum, coupled and decoupled learning rate and weight
    decay, statistics every 1-2 steps, each side (ALL, INPUT, OUTPUT), root
    overrides, shape interpretation on or off, skipping by rank, int8
    momentum, the RMSPROP grafts' clip and low-rank roots
    (``compression_rank``); Google's defaults where an argument is absent.
    Left out, each for a documented deviation (``google.DEVIATIONS``): epsilons
    not exact in float32, NONE with ``decoupled_learning_rate=False``,
    ``frequent_directions`` (on these small mixed blocks its sketches are
    smaller than the largest statistic, or of rank at most the rank; the
    anchors tests run it where neither holds) and ``lobpcg_topk_precondition``
    (blocks of at most 8 are at most 5k for every k >= 2, where Google's LOBPCG
    raises, and a smaller factor beside them has its roots rejected; the
    anchors tests run it on factors of one size).
    """
    graft = draw(st.sampled_from(["SGD", "ADAGRAD", "RMSPROP", "RMSPROP_NORMALIZED",
                                  "ADAGRAD_NORMALIZED", "SQRT_N", "NONE"]))
    kwargs: dict[str, Any] = {
        "learning_rate": draw(st.sampled_from([0.01, 0.1, 0.5])),
        "block_size": draw(st.integers(2, 8)),
        "beta1": draw(st.sampled_from([0.0, 0.5, 0.9])),
        "beta2": draw(st.sampled_from([0.9, 0.999, 1.0])),
        "diagonal_epsilon": draw(st.sampled_from([1e-10, 1e-6])),
        # Powers of 2, exact in float32: Google starts its float64 statistics from
        # float32(matrix_epsilon) * I (DEVIATIONS), which any other value would show.
        "matrix_epsilon": draw(st.sampled_from([2.0**-20, 2.0**-13, 2.0**-7])),
        "relative_matrix_epsilon": draw(st.booleans()),
        "eigh": draw(st.booleans()),
        "graft_type": graft,
        "nesterov": draw(st.booleans()),
        "moving_average_for_momentum": draw(st.booleans()),
        "decoupled_learning_rate": draw(st.booleans()),
        "weight_decay": draw(st.sampled_from([0.0, 0.01])),
        "decoupled_weight_decay": draw(st.booleans()),
        "preconditioning_compute_steps": draw(st.integers(1, 3)),
        "start_preconditioning_step": draw(st.integers(0, 2)),  # our step 1-3
        "merge_small_dims_block_size": draw(st.sampled_from([1, 4, 4096])),
        "statistics_compute_steps": draw(st.integers(1, 2)),
        "precondtioner_type": draw(st.sampled_from(["ALL", "INPUT", "OUTPUT"])),
        "exponent_override": draw(st.sampled_from([0, 2, 4])),
        "best_effort_shape_interpretation": draw(st.booleans()),
        "skip_preconditioning_rank_lt": draw(st.integers(0, 2)),
        "best_effort_memory_usage_reduction": draw(st.booleans()),  # int8 momentum (eq. 20b)
        # Low-rank roots (eq. 10c) of the blocks above rank + 2, the largest eigenvalues
        # kept (the smallest are ill-defined on these rank-deficient factors: docs/spec.md).
        "compression_rank": draw(st.sampled_from([0, 0, 0, 1, 2])),
    }
    if graft.startswith("RMSPROP"):
        kwargs["clip_by_scaled_gradient_norm"] = draw(st.sampled_from([None, 1.0]))
    if graft == "NONE":
        # With decoupled_learning_rate=False Google's ungrafted step takes no learning
        # rate at all (a defect, DEVIATIONS); from_google refuses it, so it is not drawn.
        kwargs["decoupled_learning_rate"] = True
    return kwargs
