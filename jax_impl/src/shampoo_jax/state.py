"""The optimizer state pytree and its initialisation (docs/spec.md eqs. 6, 6c, 10d, 13-15, 16b,
17, 20, 20d).

:class:`ShampooState` is what ``shampoo(config).init(params)`` returns: a
NamedTuple of arrays (checkpoint it as is). Per-block state lives in one
:class:`BlockGroupState` per block group (equal-shape blocks stacked on a
leading axis, :class:`shampoo_jax.blocks.BlockGroupLayout`); elementwise
states have the structure and shapes of the parameters. Also here: the
dtype rules (:func:`factor_dtype`, :func:`block_dtype`, :func:`root_dtype`,
:func:`elementwise_dtype`) shared by every phase of the step.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from shampoo_spec import ShampooConfig

from . import blocks as B
from .grafting import adafactor_init
from .roots import Sketch


class BlockGroupState(NamedTuple):
    """State of one block group (leading axis: the blocks).

    ``factors[i]`` / ``inverse_roots[i]`` belong to the i-th preconditioned
    dim of the group's block shape. With eigenvalue correction
    ``inverse_roots`` hold the eigenbases Q_k and ``corrected_moment`` the D
    of eq. (17). Factors and D are in :func:`factor_dtype`, inverse roots in
    :func:`root_dtype` (``inverse_root_dtype`` when set, eq. 11a).
    With ``frequent_directions`` ``sketches[i]`` is the :class:`Sketch` of a
    sketched factor (:func:`sketched`; its ``factors[i]`` then holds the last
    observation C of eq. 6c, not a running sum) and None for the others;
    ``sketches`` is None without ``frequent_directions``. The field comes
    last, so the arrays of every state without sketches keep their
    positions (:mod:`shampoo_jax.checkpoint`). With
    ``root_inverse.eigenbasis_method="qr"`` ``eigenbases[i]`` is the
    eigenbasis Q_k the i-th factor's next QR root starts from (eq. 10f), and
    with ``root_inverse.basis_reuse_tolerance > 0`` the eigenbasis of its last
    root, kept while it fits (eq. 10h); in :func:`factor_dtype`, I before the
    first root step (``config.root_inverse_stores_basis``); None otherwise. It
    comes after ``sketches``, so every other state keeps its layout.
    """

    factors: tuple[Array, ...]
    inverse_roots: tuple[Array, ...]
    statistics_updates: Array  # [nb] int32, n of eq. (7)
    consecutive_failures: Array  # [nb] int32, eq. (13)
    corrected_moment: Array | None
    corrected_updates: Array | None
    sketches: tuple[Sketch | None, ...] | None = None
    eigenbases: tuple[Array, ...] | None = None

    def sketch(self, i: int) -> Sketch | None:
        """The sketch of the i-th preconditioned dim's factor (eq. 10d), None if not sketched."""
        return None if self.sketches is None else self.sketches[i]


#: The block state of every block group, in the layout's order.
Groups = tuple[BlockGroupState, ...]


@jax.tree_util.register_static
@dataclass(frozen=True)
class ParameterInfo:
    """Static (leafless) layout information carried in the state: which parameter is which.

    ``paths``: each parameter's pytree path (``jax.tree_util.keystr``), in
    ``jax.tree.leaves`` order; ``shapes``: their shapes. ``slots``: per block
    group, the slot of each real block in the padded stacks of a sharded
    state (:mod:`shampoo_jax.sharded`), None on one device. ``config``:
    the config the state was initialised under, as JSON
    (:func:`config_json`; a string, so the node stays hashable);
    :func:`shampoo_jax.state_to_arrays` stores it with the arrays and
    :func:`shampoo_jax.state_from_arrays` refuses a checkpoint saved under
    another. A pytree node with no leaves: the numerics do not see it;
    :func:`shampoo_jax.check_state` uses it to name parameters and
    ``update`` to check the gradients' shapes.
    """

    paths: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    slots: tuple[tuple[int, ...], ...] | None = None
    config: str | None = None


def config_json(config: ShampooConfig) -> str:
    """The config as the JSON text stored in the state and checkpoints (``config.to_dict()``)."""
    if not isinstance(config, ShampooConfig):
        raise ValueError(f"config = {config!r} is invalid: allowed a shampoo_spec.ShampooConfig.")
    return json.dumps(config.to_dict(), sort_keys=True)


class ShampooState(NamedTuple):
    """The whole optimizer state: a pytree of arrays (checkpoint it as is).

    Elementwise states (``graft``, ``filtered``, ``momentum``,
    ``graft_momentum``, ``diagonal``) have the structure and shapes of the parameters, or
    are None when the config does not use them. ``root_failures`` counts
    failed inverse roots (eq. 13), ``skipped_blocks`` blocks whose gradient
    was non-finite or would overflow the state (eq. 3), and
    ``skipped_per_parameter`` (``[number of parameters]``, int32) the same
    per parameter, ``withheld_updates`` the steps in which the update guard
    (eq. 22) kept some entries of an admitted block unchanged because their
    new value or momentum overflowed. ``info`` is static (no arrays,
    :class:`ParameterInfo`). With ``momentum.storage = "int8_columnwise"``
    (eq. 20b) the momentum leaves of parameters of rank >= 2 are int8, and
    ``momentum_scale`` / ``graft_momentum_scale`` hold their scales, a tuple
    with one entry per parameter leaf (flattening order; None for a buffer
    kept in float); both are None without int8 storage. ``diagonal`` is the
    state V_D of a diagonal preconditioner (eq. 16b, ``config.diagonal``
    with a state: adagrad, rmsprop, adam), elementwise like ``graft``; None
    otherwise. ``averaged`` and ``lr_power_sum`` are iterate averaging's
    (eq. 20d, ``config.averaging``): the base sequence Z, elementwise like
    ``graft`` and starting at the parameters W, and Schedule-Free's
    ``S_t = sum_{i<=t} lr_i^p`` (a scalar in the parameters' precision,
    :func:`power_sum_dtype`; None with ``type="gpa"``);
    both None without averaging. ``gradient_sum`` is eq. (6c)'s S with
    ``frequent_directions.average_gradients``: the gradients summed since
    the previous statistics step (refused entries add 0, eq. 3), elementwise
    like ``graft``; None otherwise. ``adafactor`` holds eq. (14e)'s moments
    with ``grafting.type="adafactor"`` (``graft`` is then None: they are not
    elementwise): the parameters' structure with one
    :class:`shampoo_jax.grafting.FactoredMoments` per parameter, R and C (or
    V) in the parameter's own shape less one dim (or in its shape), in the
    elementwise dtype; None otherwise. The fields added last (``diagonal``, then
    ``averaged`` and ``lr_power_sum``, then ``gradient_sum``, then
    ``adafactor``) come after every other, so the arrays of every state
    without them keep their positions (:mod:`shampoo_jax.checkpoint`).
    """

    # The field shadows tuple.count; the name is optax's convention (and public).
    count: Array  # type: ignore[assignment]
    groups: tuple[BlockGroupState, ...]
    graft: Any
    filtered: Any
    momentum: Any
    graft_momentum: Any
    root_failures: Array
    skipped_blocks: Array
    skipped_per_parameter: Any = None
    info: ParameterInfo | None = None
    withheld_updates: Any = None
    momentum_scale: Any = None
    graft_momentum_scale: Any = None
    diagonal: Any = None
    averaged: Any = None
    lr_power_sum: Any = None
    gradient_sum: Any = None
    adafactor: Any = None


def _x64_enabled() -> bool:
    return bool(jnp.zeros((), jnp.float64).dtype == jnp.float64)


def factor_dtype(config: ShampooConfig) -> Any:
    """The dtype of factors and inverse roots: ``config.factor_dtype`` (float64 needs x64)."""
    if config.factor_dtype == "float64":
        if not _x64_enabled():
            raise ValueError(
                "factor_dtype = 'float64' needs 64-bit JAX: call "
                "jax.config.update('jax_enable_x64', True) or use the "
                "`with jax.enable_x64(True):` context; allowed otherwise: 'float32'."
            )
        return jnp.float64
    return jnp.float32


def block_dtype(config: ShampooConfig, leaf_dtypes: Sequence[Any]) -> Any:
    """The dtype of the block stacks a step gathers (gradient, filtered gradient, graft).

    :func:`factor_dtype`, the dtype the factors are built and applied in;
    but with a diagonal preconditioner (eq. 16b) or spectral descent
    (eq. 16c) there are no factors, and ``factor_dtype`` has no effect: the
    block directions stay in the leaves' precision, the promoted dtype of
    ``leaf_dtypes`` and at least float32 (as torch's block groups), so that
    float64 parameters are not rounded to a float32 ``factor_dtype`` on the
    way through the blocks. ``factor_dtype(config)`` is still called for its
    check (float64 needs x64), as the state's initialisation calls it.
    """
    fdt = factor_dtype(config)
    if config.diagonal is None and config.spectral is None:
        return fdt
    out = jnp.dtype(jnp.float32)
    for d in leaf_dtypes:
        out = jnp.promote_types(out, d)
    return out


#: ``inverse_root_dtype`` -> JAX dtype (float64 also needs x64, :func:`root_dtype`).
_ROOT_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def scale_dtype(config: ShampooConfig) -> Any:
    """The dtype of eq. (20b)'s quantization: ``momentum.scale_dtype`` (float64 needs x64)."""
    if config.momentum.scale_dtype == "float64":
        if not _x64_enabled():
            raise ValueError(
                "momentum.scale_dtype = 'float64' needs 64-bit JAX: call "
                "jax.config.update('jax_enable_x64', True) or use the "
                "`with jax.enable_x64(True):` context; allowed otherwise: 'float32'."
            )
        return jnp.float64
    return jnp.float32


def statistics_scale_dtype(config: ShampooConfig) -> Any:
    """The dtype of eq. (20c)'s quantization: ``statistics.scale_dtype`` (float64 needs x64)."""
    if config.statistics.scale_dtype == "float64":
        if not _x64_enabled():
            raise ValueError(
                "statistics.scale_dtype = 'float64' needs 64-bit JAX: call "
                "jax.config.update('jax_enable_x64', True) or use the "
                "`with jax.enable_x64(True):` context; allowed otherwise: 'float32'."
            )
        return jnp.float64
    return jnp.float32


def _storage_dtype(config: ShampooConfig, field: str, dtype: str) -> Any:
    """The JAX dtype of one of the config's storage dtypes (``ShampooConfig.root_dtype``,
    ``.corrected_dtype``, which are ``field`` when set): :func:`factor_dtype` where it is
    the factor dtype; float64 needs x64, the error naming ``field``."""
    if dtype == config.factor_dtype:
        return factor_dtype(config)
    if dtype == "float64":
        if not _x64_enabled():
            raise ValueError(
                f"{field} = 'float64' needs 64-bit JAX: call "
                "jax.config.update('jax_enable_x64', True) or use the "
                "`with jax.enable_x64(True):` context; allowed otherwise: 'float32', "
                "'bfloat16', 'float16' or None."
            )
        return jnp.float64
    return _ROOT_DTYPES[dtype]


def stored_factor_dtype(config: ShampooConfig) -> Any:
    """The dtype the factors are stored in: ``config.factor_storage_dtype`` (eq. 11b), or
    :func:`factor_dtype` when None."""
    stored = config.factor_storage_dtype
    return factor_dtype(config) if stored is None else _ROOT_DTYPES[stored]


def root_dtype(config: ShampooConfig) -> Any:
    """The dtype inverse roots are stored in (eq. 11a): ``config.root_dtype``, that is
    ``inverse_root_dtype``, or with eigenvalue correction the eigenbases'
    ``eigenvectors_dtype`` (eq. 17a), or :func:`factor_dtype` when None. float64 needs
    x64, as for the factors."""
    field = ("inverse_root_dtype" if config.eigenvalue_correction is None
             else "eigenvalue_correction.eigenvectors_dtype")
    return _storage_dtype(config, field, config.root_dtype)


def corrected_dtype(config: ShampooConfig) -> Any:
    """The dtype the corrected moment D is stored in (eq. 17a): ``config.corrected_dtype``,
    that is ``eigenvalue_correction.corrected_eigenvalues_dtype``, or :func:`factor_dtype`
    when None."""
    return _storage_dtype(config, "eigenvalue_correction.corrected_eigenvalues_dtype",
                          config.corrected_dtype)


def elementwise_dtype(leaf_dtype: Any) -> Any:
    """Dtype of the elementwise state and arithmetic: at least float32 (bf16 params)."""
    return jnp.promote_types(leaf_dtype, jnp.float32)


def leaf_shapes(leaves: Sequence[Array]) -> tuple[tuple[int, ...], ...]:
    """The static shapes of the parameter leaves (the key of :func:`blocks.make_layout`)."""
    return tuple(tuple(int(d) for d in x.shape) for x in leaves)


def sketched(config: ShampooConfig, n: int) -> bool:
    """Whether a preconditioned factor of size n is sketched (eqs. 6c, 10d: ``n > rank + 2``)."""
    fd = config.frequent_directions
    return fd is not None and fd.compresses(n)


def init_sketch(nb: int, n: int, rank: int, fdt: Any) -> Sketch:
    """Eq. (10d): the empty sketch (U, lambda, rho all 0) of one factor of ``nb`` blocks."""
    return Sketch(jnp.zeros((nb, n, rank), fdt), jnp.zeros((nb, rank), fdt),
                  jnp.zeros((nb,), fdt))


def init_group(grp: B.BlockGroupLayout, config: ShampooConfig, fdt: Any) -> BlockGroupState:
    """A block group before the first step: factors ``c I`` (eq. 6), inverse roots I (eq. 13),
    empty sketches (eq. 10d) with ``frequent_directions``."""
    nb = grp.size
    init_scale = config.initial_factor_scale
    rdt = root_dtype(config)
    fd = config.frequent_directions
    factors, inverse_roots, sketches = [], [], []
    for k in grp.preconditioned_dims:
        n = grp.shape[k]
        eye = jnp.broadcast_to(jnp.eye(n, dtype=fdt), (nb, n, n))
        scale = jnp.asarray(init_scale, fdt)
        if config.statistics.quantized:  # eq. (20c): c I stored, read back as fl_d(c) I
            scale = jnp.asarray(init_scale, statistics_scale_dtype(config)).astype(fdt)
        factors.append((scale * eye).astype(stored_factor_dtype(config)))
        # Identity before the first root (eq. 13), exact in any storage dtype (eq. 11a);
        # 0 for a compressed or sketched factor (eqs. 10c, 10d: Google's zero
        # low-rank preconditioner).
        lr = config.low_rank
        compressed = sketched(config, n) or (lr is not None and lr.compresses(n))
        inverse_roots.append(jnp.array(0 * eye if compressed else eye, dtype=rdt))
        sketches.append(init_sketch(nb, n, fd.sketch_rank(n), fdt)
                        if fd is not None and sketched(config, n) else None)
    ec = config.eigenvalue_correction is not None

    def zeros_i() -> Array:  # a fresh buffer per field, so the state can be donated
        return jnp.zeros((nb,), jnp.int32)

    return BlockGroupState(
        factors=tuple(factors),
        inverse_roots=tuple(inverse_roots),
        statistics_updates=zeros_i(),
        consecutive_failures=zeros_i(),
        corrected_moment=jnp.zeros((nb, *grp.shape), corrected_dtype(config)) if ec else None,
        corrected_updates=zeros_i() if ec else None,
        sketches=None if fd is None else tuple(sketches),
        eigenbases=tuple(
            jnp.array(jnp.broadcast_to(jnp.eye(grp.shape[k], dtype=fdt),
                                       (nb, grp.shape[k], grp.shape[k])))
            for k in grp.preconditioned_dims) if config.root_inverse_stores_basis else None,
    )


def init_scales(
    shapes: tuple[tuple[int, ...], ...], config: ShampooConfig
) -> tuple[Array | None, ...] | None:
    """Eq. (20b): the scales of zero buffers (0), one entry per leaf (None: kept in float);
    None for the whole state when no leaf is quantized."""
    flags = [config.momentum.quantizes(len(shape)) for shape in shapes]
    if not any(flags):
        return None
    d = scale_dtype(config)
    return tuple(jnp.zeros(shape[1:], d) if f else None
                 for shape, f in zip(shapes, flags, strict=True))


def init_state(params: Any, config: ShampooConfig) -> ShampooState:
    """The single-device state for ``params`` (``sharded.shard_state`` places it on a mesh)."""
    fdt = factor_dtype(config)
    keyed, _ = jax.tree_util.tree_flatten_with_path(params)
    shapes = leaf_shapes([x for _, x in keyed])
    layout = B.make_layout(shapes, config)
    mom, av, fd = config.momentum, config.averaging, config.frequent_directions

    def zeros() -> Any:
        return jax.tree.map(lambda p: jnp.zeros(p.shape, elementwise_dtype(p.dtype)), params)

    def buffers() -> Any:  # eq. (20b): int8 where quantized
        return jax.tree.map(
            lambda p: jnp.zeros(p.shape, jnp.int8) if mom.quantizes(p.ndim)
            else jnp.zeros(p.shape, elementwise_dtype(p.dtype)), params)

    return ShampooState(
        count=jnp.zeros((), jnp.int32),
        groups=tuple(init_group(g, config, fdt) for g in layout.groups),
        graft=zeros() if config.grafting.has_state else None,
        filtered=zeros() if config.gradient_filter.enabled else None,
        momentum=buffers() if mom.enabled else None,
        graft_momentum=buffers() if mom.separate_buffers else None,
        root_failures=jnp.zeros((), jnp.int32),
        skipped_blocks=jnp.zeros((), jnp.int32),
        skipped_per_parameter=jnp.zeros((len(shapes),), jnp.int32),
        info=ParameterInfo(
            tuple(jax.tree_util.keystr(k) for k, _ in keyed), shapes, config=config_json(config)
        ),
        withheld_updates=jnp.zeros((), jnp.int32),
        momentum_scale=init_scales(shapes, config) if mom.enabled else None,
        graft_momentum_scale=init_scales(shapes, config) if mom.separate_buffers else None,
        # Eq. (16b): V_D starts at zero, as the graft state V (eq. 14b).
        diagonal=zeros() if config.diagonal is not None and config.diagonal.has_state else None,
        # Eq. (20d): Z_0 = W (a copy, so that donating the state never donates the
        # parameters), and S_0 = 0 for Schedule-Free's coefficient.
        averaged=None if av is None else jax.tree.map(
            lambda p: jnp.array(p, elementwise_dtype(p.dtype), copy=True), params),
        lr_power_sum=(jnp.zeros((), power_sum_dtype(jax.tree.leaves(params)))
                      if av is not None and av.type == "schedule_free" else None),
        # Eq. (6c): S starts at zero (average_gradients only).
        gradient_sum=zeros() if fd is not None and fd.average_gradients else None,
        # Eq. (14e): R, C (or V) start at zero, in each parameter's own shape.
        adafactor=jax.tree.map(
            lambda p: adafactor_init(tuple(p.shape), elementwise_dtype(p.dtype), config.grafting),
            params) if config.grafting.factored else None,
    )


def power_sum_dtype(leaves: Sequence[Any]) -> Any:
    """The dtype of Schedule-Free's ``S_t`` (eq. 20d): the leaves' elementwise dtypes
    promoted (float32 at least; float64 with a float64 parameter), so that float64
    runs keep the sum as the reference does, in float64."""
    out = jnp.dtype(jnp.float32)
    for x in leaves:
        out = jnp.promote_types(out, elementwise_dtype(x.dtype))
    return out


__all__ = [
    "BlockGroupState",
    "Groups",
    "ParameterInfo",
    "ShampooState",
    "block_dtype",
    "config_json",
    "corrected_dtype",
    "elementwise_dtype",
    "factor_dtype",
    "init_group",
    "init_scales",
    "init_sketch",
    "init_state",
    "leaf_shapes",
    "power_sum_dtype",
    "root_dtype",
    "scale_dtype",
    "sketched",
    "stored_factor_dtype",
]
