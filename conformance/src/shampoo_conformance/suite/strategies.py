"""Hypothesis strategies: configs, shapes, gradient streams, SPD matrices, dtypes.

Configs range over every option of the spec within validated ranges; the
``well_conditioned`` flag keeps epsilons large enough (relative to unit
gradients) that comparisons with the reference have a meaningful tolerance.
Shapes hit 0-d to 4-d with dims at, just below and just above the block and
merge thresholds, and size-1 dims. Gradient streams include zeros,
rank-deficient and large-dynamic-range gradients.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

import numpy as np
from hypothesis import reject
from hypothesis import strategies as st
from numpy.typing import NDArray

import shampoo_spec as ss

#: Block size and merge threshold the shape strategy aims dims at.
BLOCK = 4
MERGE = 12


def dims() -> st.SearchStrategy[int]:
    """Dims around the thresholds: 1, BLOCK-1..BLOCK+1, MERGE-1..MERGE+1, and small ones."""
    return st.sampled_from([1, 2, 3, BLOCK - 1, BLOCK, BLOCK + 1, 6, MERGE - 1, MERGE, MERGE + 1])


def shapes(max_rank: int = 4, max_size: int = 400) -> st.SearchStrategy[tuple[int, ...]]:
    return (
        st.lists(dims(), min_size=0, max_size=max_rank)
        .map(tuple)
        .filter(lambda s: int(np.prod(s)) <= max_size)
    )


def named_shapes(max_params: int = 3) -> st.SearchStrategy[dict[str, tuple[int, ...]]]:
    return st.lists(shapes(), min_size=1, max_size=max_params).map(
        lambda ss_: {f"p{i}": s for i, s in enumerate(ss_)}
    )


def spd_matrix(n: int, condition_number: float, seed: int) -> NDArray[np.float64]:
    """Q diag(lambda) Q^T with eigenvalues log-spaced from 1 to 1/condition_number."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    lam = np.logspace(0, -np.log10(condition_number), n)
    out: NDArray[np.float64] = (q * lam) @ q.T
    return 0.5 * (out + out.T)


def gradient_stream(
    shapes_: dict[str, tuple[int, ...]], steps: int, seed: int, kind: str
) -> list[dict[str, NDArray[np.float64]]]:
    """Seeded gradients of one kind: normal, with zeros, rank-deficient, or wide range."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(steps):
        step = {}
        for name, shape in shapes_.items():
            g = rng.standard_normal(shape)
            if kind == "zeros" and t % 3 == 1:
                g = np.zeros(shape)
            elif kind == "rank_deficient" and len(shape) >= 2:
                u = rng.standard_normal(shape[:1] + (1,) * (len(shape) - 1))
                g = u * rng.standard_normal((1,) + shape[1:])
            elif kind == "wide_range":
                g = g * 10.0 ** rng.integers(-3, 4)
            step[name] = g
        out.append(step)
    return out


STREAM_KINDS = ("normal", "zeros", "rank_deficient", "wide_range")


@st.composite
def configs(draw: Any, well_conditioned: bool = True) -> ss.ShampooConfig:
    """Any valid config; ``well_conditioned`` keeps epsilon >= 1e-3 and roots eigh/Newton-tight."""
    eps_value = draw(st.sampled_from([1e-3, 1e-2, 0.1] if well_conditioned else [0.0, 1e-12, 1e-6]))
    epsilon = ss.EpsilonConfig(
        value=eps_value,
        scale=draw(st.sampled_from(["absolute", "relative"])),
        placement=draw(st.sampled_from(["ridge", "shift_after", "floor", "ridge_floor"])),
    )
    beta2 = draw(st.sampled_from([1.0, 0.99, 0.9, 0.0]))
    statistics_kwargs: dict[str, Any] = {
        "beta2": beta2,
        "bias_correction": draw(st.booleans()),
        "initial_value": draw(st.sampled_from(["zero", "epsilon_identity"])),
    }
    root_inverse = draw(
        st.sampled_from(
            [
                ss.EighConfig(),
                # Eq. (10b): the error test runs, and never fails here (e is at most about
                # n u ||B|| <= 1e4 on these streams, float32 included): a decision near
                # tau would depend on each backend's rounding, not on the spec.
                ss.EighConfig(failure_threshold=1e10),
                ss.CoupledNewtonConfig(tolerance=1e-12, max_iterations=300),
                ss.CoupledNewtonConfig(
                    tolerance=1e-12, max_iterations=300, error_growth_limit=1.2, retries=2
                ),
                # Eq. (11d) on the factors above 5 (k = 1 deflates nothing: theta_1 is the
                # relative epsilon's lambda_max and the error is judged on the factor).
                ss.CoupledNewtonConfig(tolerance=1e-12, max_iterations=300,
                                       deflation_rank=1, deflation_iterations=3),
                # Eq. (11c): its own ridge (the drawn epsilon section is unused by it).
                ss.HigherOrderNewtonConfig(rel_epsilon=1e-4, abs_epsilon=1e-4,
                                           tolerance=1e-12),
            ]
        )
    )
    newton = isinstance(root_inverse, ss.CoupledNewtonConfig)
    # Eq. (20c): int16 factors and roots (coupled Newton only) in a quarter of the
    # Newton draws, well conditioned and with a relative epsilon >= 1e-3: a block of
    # n <= 8 moves the symmetric part's eigenvalues by at most n / 65534 of lambda_max
    # (half a step per entry), far below the ridge, so every root converges.
    int16 = (well_conditioned and newton and epsilon.scale == "relative"
             and not (isinstance(root_inverse, ss.CoupledNewtonConfig)
                      and root_inverse.deflation_rank > 0)  # eq. (11d): symmetric factors
             and draw(st.sampled_from([False, False, False, True])))
    exponents = draw(
        st.sampled_from(
            [
                ss.ExponentConfig(),
                ss.ExponentConfig(default="preconditioned_dims"),
                ss.ExponentConfig(override=2.0),
                ss.ExponentConfig(
                    overrides_by_order=(ss.OrderOverride(order=2, roots=(4.0, 0.0)),)
                ),
            ]
            + ([] if newton else [ss.ExponentConfig(override=2.5)])
        )
    )
    statistics = ss.StatisticsConfig(
        **statistics_kwargs,
        # Eq. (6b): KL-Shampoo statistics in a fifth of the draws that allow them
        # (no stored or rounded roots and factors: set to False below otherwise).
        kl=not int16 and draw(st.sampled_from([False] * 4 + [True])),
        storage="int16_columnwise_diagonal" if int16 else "float",
        scale_dtype=draw(st.sampled_from(["float32", "float64"])) if int16 else "float32",
    )
    gtype = draw(st.sampled_from(ss.GRAFTING_TYPES))
    graft_beta2 = {"adagrad": 1.0, "adagrad_normalized": 1.0}.get(
        gtype,
        draw(st.sampled_from([0.9, 0.999]))
        if gtype in ("rmsprop", "adam", "rmsprop_normalized")
        else 1.0,
    )
    # Meta's drop_weighting_factor_on_gsquare: an EMA graft with weight 1 (eq. 14b).
    graft_weight: Literal["one_minus_beta2", "one"] = (
        draw(st.sampled_from(["one_minus_beta2", "one"])) if graft_beta2 < 1.0
        else "one_minus_beta2")
    grafting = ss.GraftingConfig(
        type=gtype,
        beta2=graft_beta2,
        ema_weight=graft_weight,
        bias_correction=gtype == "adam" and graft_weight == "one_minus_beta2",
        norm_scope=draw(st.sampled_from(["block", "parameter"])),
        # Eq. (14d): a clip of the adaptive grafts (rms of their steps is about 1 here).
        clip_rms=(draw(st.sampled_from([None, 0.5]))
                  if gtype in (*ss.GRAFTING_TYPES_WITH_STATE, "adafactor") else None),
        # Eq. (14e): factored when the two largest dims are >= factor_min_dim (3: the
        # suite's matrices and tensors; 128: none), scaled by rms(W) or not.
        **({"epsilon_placement": "inside_sqrt",
            "decay_exponent": draw(st.sampled_from([0.5, 0.8])),
            "factor_min_dim": draw(st.sampled_from([1, 3, 128])),
            "parameter_scale_floor": draw(st.sampled_from([None, 1e-3]))}
           if gtype == "adafactor" else {}),
    )
    beta1 = draw(st.sampled_from([0.0, 0.9]))
    gradient_filter = ss.GradientFilterConfig(
        beta1=beta1,
        beta3=draw(st.sampled_from([None, 0.5])),
        bias_correction=draw(st.booleans()),
    )
    mu = draw(st.sampled_from([0.0, 0.5, 0.9]))
    # Eq. (20b): int8 momentum storage in a quarter of the draws, either scale dtype.
    int8 = draw(st.sampled_from([False, False, False, True]))
    momentum = ss.MomentumConfig(
        momentum=mu,
        dampening=draw(st.sampled_from([0.0, 0.1])),
        nesterov=draw(st.booleans()),
        buffers="separate" if (gtype != "none" and draw(st.booleans())) else "shared",
        learning_rate_placement=draw(st.sampled_from(["after_momentum", "before_momentum"])),
        storage="int8_columnwise" if int8 else "float",
        scale_dtype=draw(st.sampled_from(["float32", "float64"])) if int8 else "float32",
    )
    weight_decay = ss.WeightDecayConfig(
        value=draw(st.sampled_from([0.0, 0.01])),
        type=draw(st.sampled_from(["l2", "direction", "update"])),
    )
    # Eq. (20d): iterate averaging in a third of the draws without momentum (it takes
    # momentum's place) and without update decay.
    averaging = None
    if (mu == 0.0 and not int8 and not weight_decay.applies("update")
            and draw(st.sampled_from([False, False, True]))):
        averaging = ss.IterateAveragingConfig(
            type=draw(st.sampled_from(["gpa", "schedule_free"])),
            train_interp=draw(st.sampled_from([0.5, 1.0])),
            scalar_dtype=draw(st.sampled_from([None, "float32"])))  # eq. (20e)
        if averaging.type == "gpa":
            averaging = replace(averaging, eval_interp=draw(st.sampled_from([0.0, 0.9])))
    blocking = ss.BlockingConfig(
        max_preconditioner_dim=draw(st.sampled_from([BLOCK, 1024])),
        merge_dims_up_to=draw(st.sampled_from([None, MERGE])),
        merge_direction=draw(st.sampled_from(["last_to_first", "first_to_last"])),
        skip_dim_size_gt=draw(st.sampled_from([None, MERGE])),
        skip_rank_lt=draw(st.sampled_from([0, 1])),
        preconditioned_dims=draw(st.sampled_from(["all", "all_but_last", "last"])),
        squeeze=draw(st.booleans()),
        scalar_factor=draw(st.booleans()),
    )
    schedule = ss.ScheduleConfig(
        precondition_frequency=draw(st.sampled_from([1, 2, 3])),
        statistics_frequency=draw(st.sampled_from([1, 2])),
        start_preconditioning_step=draw(st.sampled_from([1, 2, 4, None])),
        period_anchor=draw(st.sampled_from(["end", "start"])),
        roots_before_start=draw(st.booleans()),
        roots_take_effect=draw(st.sampled_from(["same_step", "next_step"])),
        # Eq. (8b) at the constant learning rate the backends run here (ratio 1):
        # f_t = max(floor(f / 10) * 10, 1) = 1. The backends' own tests run schedules.
        precondition_frequency_growth=draw(st.sampled_from([None, None, 20])),
    )
    # Factors stored in bfloat16/float16 (eq. 11b) where the config allows it (Meta's eigh
    # root in s: absolute ridge or shift_after epsilon, statistics from zero).
    storable = (well_conditioned and type(root_inverse) is ss.EighConfig
                and root_inverse.failure_threshold is None and epsilon.scale == "absolute"
                and epsilon.placement in ("ridge", "shift_after")
                and statistics.initial_value == "zero")
    factor_storage = (draw(st.sampled_from([None, None, None, "bfloat16", "float16"]))
                      if storable else None)
    # Eq. (16b): a diagonal preconditioner in place of the Kronecker one in a sixth of
    # the draws (no factors: none of their storage rules).
    diagonal = draw(st.sampled_from([None] * 5 + ["diagonal"])) if not int16 else None
    if diagonal is not None:
        dtype_ = draw(st.sampled_from(["sgd", "sign", "adagrad", "rmsprop", "adam"]))
        decays = dtype_ in ("rmsprop", "adam")
        diagonal = ss.DiagonalPreconditionerConfig(
            type=dtype_, beta2=draw(st.sampled_from([0.9, 0.999])) if decays else 1.0,
            ema_weight=draw(st.sampled_from(["one_minus_beta2", "one"])) if decays
            else "one_minus_beta2",
            epsilon=draw(st.sampled_from([1e-10, 1e-3])),
            bias_correction=dtype_ == "adam" and draw(st.booleans()),
        )
        factor_storage = None
    inverse_root_dtype = None if int16 or diagonal is not None else draw(
        st.sampled_from([None, None, "float32", "bfloat16"]))
    if statistics.kl and (diagonal is not None or inverse_root_dtype is not None
                          or factor_storage is not None):
        statistics = replace(statistics, kl=False)  # eq. (6b) needs unrounded roots
    # Eq. (10c): low-rank roots of the factors larger than rank + 2 in a sixth of the
    # draws that allow them. keep="largest" only: with "smallest" a rank-deficient
    # factor's kept vectors are an arbitrary part of its null space (docs/spec.md).
    low_rank = None
    if (well_conditioned and not int16 and diagonal is None and inverse_root_dtype is None
            and factor_storage is None and draw(st.sampled_from([False] * 5 + [True]))):
        low_rank = ss.LowRankRootConfig(
            rank=draw(st.sampled_from([1, 2])),
            failure_threshold=draw(st.sampled_from([None, 1e10])),
            relative_floor=draw(st.sampled_from([None, 1e-6])))
    # Eqs. (6c), (10d): frequent-directions sketches of the factors larger than rank + 2
    # (eq. 10e: of every factor) in a sixth of the draws that allow them (plain roots,
    # no eq. 6b, 7, 7b or 10c), statistics on the root steps.
    frequent_directions = None
    if (low_rank is None and well_conditioned and not int16 and diagonal is None
            and inverse_root_dtype is None and factor_storage is None and not statistics.kl
            and draw(st.sampled_from([False] * 5 + [True]))):
        # A third of them tearfree's Sketchy (eq. 10e: every factor, no reset or average).
        tearfree = draw(st.sampled_from([False, False, True]))
        frequent_directions = ss.FrequentDirectionsConfig(
            rank=draw(st.sampled_from([1, 2])),
            average_gradients=not tearfree and draw(st.booleans()),
            reset_every=None if tearfree else draw(st.sampled_from([None, 2])),
            rule="tearfree" if tearfree else "google")
        statistics = replace(statistics, bias_correction=False, trace_scaling_exponent=0.0)
        schedule = replace(schedule, statistics_frequency=schedule.precondition_frequency,
                           precondition_frequency_growth=None)
    return ss.ShampooConfig(
        learning_rate=draw(st.sampled_from([0.01, 0.1])),
        statistics=statistics,
        epsilon=epsilon,
        root_inverse=root_inverse,
        low_rank=low_rank,
        frequent_directions=frequent_directions,
        exponents=exponents,
        grafting=grafting,
        gradient_filter=gradient_filter,
        momentum=momentum,
        weight_decay=weight_decay,
        blocking=blocking,
        schedule=schedule,
        factor_dtype="float64",
        # Roots stored rounded (eqs. 11a, 16). Not float16: its 65504 range would
        # need configs drawn for it (tiny relative epsilons give roots near it);
        # the backends' own tests cover it.
        # (eq. 20c stores the roots as int16 instead).
        inverse_root_dtype=inverse_root_dtype,
        diagonal=diagonal,
        averaging=averaging,
        # The update rounded before it is added (eq. 21a, Meta's DDP communication_dtype).
        update_dtype=draw(st.sampled_from([None, None, "float32", "bfloat16", "float16"])),
        factor_storage_dtype=factor_storage,
    )


def configs_for(backend: object) -> st.SearchStrategy[ss.ShampooConfig]:
    """The configs the suite draws for ``backend``: :func:`configs`, or, for a backend
    that runs another library, the configs that library expresses (``backend.configs()``,
    its own arguments imported; :mod:`shampoo_conformance.thirdparty.registry`)."""
    own = getattr(backend, "configs", None)
    strategy: st.SearchStrategy[ss.ShampooConfig] = own() if callable(own) else configs()
    return strategy


def require_expressible(backend: object, config: ss.ShampooConfig, dtype: Any = np.float64) -> None:
    """Reject this Hypothesis example unless ``backend`` can run ``config``.

    A law changes sections of a drawn config; for a backend that runs another
    library the result may leave what that library expresses (Meta has no
    eigenvalue correction without a graft from a later step, for one). A law
    whose every example is rejected ends ``Unsatisfiable``, which the suite
    reports as a skip for that backend.
    """
    check = getattr(backend, "expressible", None)
    if callable(check) and check(config, dtype) is not None:
        reject()


def base_config_for(backend: object) -> ss.ShampooConfig:
    """The config a fixed law starts from: ``ShampooConfig()``, or the library's own
    defaults for a backend that runs another library (``backend.base_config()``), so
    a law changes only the sections it is about."""
    own = getattr(backend, "base_config", None)
    config: ss.ShampooConfig = own() if callable(own) else ss.ShampooConfig()
    return config


def dtypes() -> st.SearchStrategy[type]:
    return st.sampled_from([np.float64, np.float32])
