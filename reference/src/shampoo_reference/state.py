"""The optimizer's state: its records per parameter and per block, and their creation.

Eq. numbers refer to docs/spec.md. A parameter's state is held in its merged
shape (eq. 4); each block of its plan (eq. 5) has its factors, inverse roots
(or eigenbases, eq. 17) and what the chosen options add. With int storage
(eqs. 20b, 20c) a buffer, factor or root is stored quantized and holds its
read-back value from then on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from shampoo_spec import ParameterPlan, ShampooConfig, plan_parameter

from . import grafting
from .quantization import (
    dequantize_columnwise,
    dequantize_with_diagonal,
    quantize_columnwise,
    quantize_with_diagonal,
)
from .roots import Sketch

Array = NDArray[np.float64]


@dataclass
class BlockState:
    """Per-block state: factors L_k, inverse roots X_k (or eigenbases Q_k)."""

    factors: list[Array | None]
    inverse_roots: list[Array | None]
    statistics_updates: int = 0
    consecutive_failures: int = 0
    corrected_second_moment: Array | None = None
    corrected_updates: int = 0
    #: Eq. (10d): the sketch of each sketched factor (None for the others).
    sketches: list[Sketch | None] = field(default_factory=list)
    #: Eqs. (10f), (10h): the eigenbasis each factor's root starts from (I before the
    #: first root step; None for the others and without a stored-basis root_inverse).
    eigenbases: list[Array | None] = field(default_factory=list)
    #: Eq. (20c), int16 storage: the stored (integers, scales, diagonal) of each factor
    #: ("factor", k) and inverse root ("root", k); ``factors``/``inverse_roots`` then
    #: hold their read-back values.
    stored: dict[tuple[str, int], tuple[NDArray[np.int16], NDArray[np.floating],
                                        NDArray[np.floating]]] = field(default_factory=dict)


@dataclass
class ParameterState:
    """Per-parameter state: its plan (eqs. 4-5), blocks and elementwise buffers (merged shape)."""

    plan: ParameterPlan
    blocks: list[BlockState]
    #: Eq. (14b)'s elementwise V (merged shape), or eq. (14e)'s moments.
    graft: Array | grafting.FactoredMoments | None
    filtered: Array | None
    momentum: Array | None
    graft_momentum: Array | None
    #: Eq. (20b), int8 storage: the stored (integers, scales) of each buffer by name;
    #: ``momentum``/``graft_momentum`` then hold their read-back values fl_d(q s).
    stored: dict[str, tuple[NDArray[np.integer], NDArray[np.floating]]] = field(
        default_factory=dict
    )
    #: Eq. (16b): the diagonal preconditioner's state V_D (adagrad, rmsprop, adam).
    diagonal: Array | None = None
    #: Eq. (20d): the base sequence Z of iterate averaging (merged shape), from W.
    averaged: Array | None = None
    #: Eq. (6c), average_gradients: the gradients summed since the last statistics step.
    gradient_sum: Array | None = None


@dataclass
class Metrics:
    """Counters a user can read: root failures, skipped blocks, withheld updates (eq. 22)."""

    root_failures: int = 0
    skipped_blocks: int = 0
    withheld_updates: int = 0


def as_merged(x: Array, plan: ParameterPlan) -> Array:
    """``x`` in float64, in the parameter's merged shape (eq. 4)."""
    return np.asarray(x, dtype=np.float64).reshape(plan.merged_shape)


def init_parameter(config: ShampooConfig, shape: tuple[int, ...]) -> ParameterState:
    """The state before step 1 of a parameter of ``shape``: factors eps I (eq. 6), roots I
    (eq. 13; 0 when compressed or sketched), every buffer 0."""
    cfg = config
    plan = plan_parameter(shape, cfg)
    init_eps = cfg.initial_factor_scale
    blocks = []
    for b in plan.blocks:
        factors: list[Array | None] = []
        inverse_roots: list[Array | None] = []
        sketches: list[Sketch | None] = []
        fd = cfg.frequent_directions
        for n, r in zip(b.shape, b.roots, strict=True):
            sketched = r != 0 and fd is not None and fd.compresses(n)
            sketches.append(Sketch.empty(n, fd.sketch_rank(n)) if sketched and fd else None)
            if r == 0:
                factors.append(None)
                inverse_roots.append(None)
            else:
                factors.append(init_eps * np.eye(n))
                # Identity before the first root (eq. 13); 0 for a compressed or
                # sketched factor (eqs. 10c, 10d: Google's zero low-rank preconditioner).
                lr = cfg.low_rank
                compressed = sketched or (lr is not None and lr.compresses(n))
                inverse_roots.append(np.zeros((n, n)) if compressed else np.eye(n))
        corrected = np.zeros(b.shape) if cfg.eigenvalue_correction is not None else None
        bs = BlockState(
            factors=factors,
            inverse_roots=inverse_roots,
            corrected_second_moment=corrected,
            sketches=sketches,
            eigenbases=[np.eye(f.shape[0])
                        if cfg.root_inverse_stores_basis and f is not None else None
                        for f in factors],
        )
        if cfg.statistics.quantized:  # eq. (20c): the initial eps I and I are stored too
            for k in range(len(factors)):
                store_factor(config, bs, "factor", k)
                store_factor(config, bs, "root", k)
        blocks.append(bs)
    size_shape = plan.merged_shape
    graft: Array | grafting.FactoredMoments | None = (
        np.zeros(size_shape) if cfg.grafting.has_state
        else grafting.adafactor_init(plan.shape, cfg.grafting) if cfg.grafting.factored
        else None)
    filtered = np.zeros(size_shape) if cfg.gradient_filter.enabled else None
    momentum = np.zeros(size_shape) if cfg.momentum.enabled else None
    graft_momentum = np.zeros(size_shape) if cfg.momentum.separate_buffers else None
    diagonal = (np.zeros(size_shape)
                if cfg.diagonal is not None and cfg.diagonal.has_state else None)
    fd = cfg.frequent_directions
    gradient_sum = np.zeros(size_shape) if fd is not None and fd.average_gradients else None
    return ParameterState(plan, blocks, graft, filtered, momentum, graft_momentum,
                          diagonal=diagonal, gradient_sum=gradient_sum)


def store_factor(config: ShampooConfig, bs: BlockState, kind: str, k: int) -> None:
    """Eq. (20c): factor or inverse root k stored as (q, s, g) in
    ``statistics.scale_dtype``; from here on it holds its read-back value."""
    values = bs.factors if kind == "factor" else bs.inverse_roots
    x = values[k]
    if x is None:
        return
    if not np.all(np.isfinite(x.astype(config.statistics.scale_dtype))):
        # A non-finite factor (eq. 3 skips its block from here) is kept as it is.
        bs.stored.pop((kind, k), None)
        return
    stored = quantize_with_diagonal(x, config.statistics.scale_dtype)
    bs.stored[(kind, k)] = stored
    values[k] = dequantize_with_diagonal(*stored)


def store_momentum(config: ShampooConfig, st: ParameterState) -> None:
    """Eq. (20b): each buffer stored as (q, s) in the parameter's shape, read back.

    The buffer after eqs. (20) and (22) (kept entries hold their read-back
    old values) is quantized in ``momentum.scale_dtype``; the next step
    reads ``fl_d(q s)``, which is what the buffer holds from here on.
    """
    d = config.momentum.scale_dtype
    shape = st.plan.shape
    if st.momentum is not None:
        st.stored["momentum"] = quantize_columnwise(st.momentum.reshape(shape), d)
        st.momentum = dequantize_columnwise(*st.stored["momentum"]).reshape(
            st.momentum.shape)
    if st.graft_momentum is not None:
        st.stored["graft_momentum"] = quantize_columnwise(
            st.graft_momentum.reshape(shape), d)
        st.graft_momentum = dequantize_columnwise(*st.stored["graft_momentum"]).reshape(
            st.graft_momentum.shape)
