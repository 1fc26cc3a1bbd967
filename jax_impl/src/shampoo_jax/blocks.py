"""Static block layout: from the shape plan to stacks of equal-shape blocks.

``shampoo_spec.plan_parameter`` (eqs. 4-5, 12) cuts every parameter into
blocks. Blocks with the same shape *and* the same roots (the exponents r_k),
from any parameter, form one block group, :class:`BlockGroupLayout`; their
factors, inverse roots and gradient pieces are stacked along a leading axis
so that statistics (eq. 6), inverse roots (eqs. 10-11) and preconditioning
(eqs. 16-17) run as one batched operation per block group.
Remainder blocks (a dim not divisible by ``max_preconditioner_dim``) form
their own block group rather than being padded: grouping by exact shape changes no
result, and keeps ``lambda_min`` of eq. (10), ``lambda_max`` of eq. (9) and
the Frobenius norm of eq. (11) free of padding.

:class:`ParameterTree` maps the parameter tree to its leaves in their merged
shapes (eq. 4) and back, for the elementwise phases of a step.

Everything here runs at trace time on static shapes except the array
helpers (:func:`gather`, :func:`scatter`, :func:`factor_contraction`,
:func:`mode_product`), which emit slicing, stacking and ``dot_general``.
"""

from __future__ import annotations

import functools
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.typing import DTypeLike

from shampoo_spec import ParameterPlan, ShampooConfig, plan_parameter

_HIGHEST = lax.Precision.HIGHEST


@dataclass(frozen=True)
class BlockGroupLayout:
    """A block group: blocks of one shape and one tuple of roots, stacked in ``members`` order.

    ``roots`` are the exponents r_k of eq. (12), one per dim of ``shape``
    (0: that dim is not preconditioned).
    """

    shape: tuple[int, ...]
    roots: tuple[float, ...]
    members: tuple[tuple[int, int], ...]  # (leaf index, block index in its plan)

    @property
    def preconditioned_dims(self) -> tuple[int, ...]:
        return tuple(k for k, r in enumerate(self.roots) if r != 0)

    @property
    def size(self) -> int:
        return len(self.members)


@dataclass(frozen=True)
class LeafLayout:
    """One parameter: its plan and, per block, ``(block group index, position in it)``."""

    plan: ParameterPlan
    refs: tuple[tuple[int, int], ...]

    @property
    def chunks(self) -> tuple[int, ...]:
        """Number of chunks along each merged dim (blocks are their row-major product)."""
        return tuple(len({b.offsets[k] for b in self.plan.blocks})
                     for k in range(len(self.plan.merged_shape)))


@dataclass(frozen=True)
class Layout:
    """Every parameter's blocks and the block groups they are stacked into."""

    leaves: tuple[LeafLayout, ...]
    groups: tuple[BlockGroupLayout, ...]

    @property
    def num_blocks(self) -> int:
        return sum(len(leaf.plan.blocks) for leaf in self.leaves)


@functools.lru_cache(maxsize=256)
def make_layout(shapes: tuple[tuple[int, ...], ...], config: ShampooConfig) -> Layout:
    """Plan every parameter and put its blocks into block groups (trace time, cached)."""
    plans = [plan_parameter(s, config) for s in shapes]
    keys: dict[tuple[tuple[int, ...], tuple[float, ...]], list[tuple[int, int]]] = {}
    for i, plan in enumerate(plans):
        if not plan.preconditioned:
            continue
        for j, b in enumerate(plan.blocks):
            keys.setdefault((b.shape, b.roots), []).append((i, j))
    groups = tuple(
        BlockGroupLayout(shape, roots, tuple(members)) for (shape, roots), members in keys.items()
    )
    position = {m: (g, p) for g, grp in enumerate(groups) for p, m in enumerate(grp.members)}
    leaves = tuple(
        LeafLayout(plan, tuple(position[(i, j)] for j in range(len(plan.blocks)))
                   if plan.preconditioned else ())
        for i, plan in enumerate(plans)
    )
    return Layout(leaves, groups)


class ParameterTree:
    """The parameters' tree structure and plans: leaves <-> merged-shape lists (eq. 4)."""

    def __init__(self, treedef: Any, plans: Sequence[ParameterPlan]) -> None:
        # Any: jaxlib's PyTreeDef has no type stubs (mypy sees an unresolved type).
        self.treedef = treedef
        self.plans = plans

    def leaves(self, tree: Any) -> list[Any]:
        """The leaves of ``tree``, which must have the updates' structure."""
        leaves: list[Any] = self.treedef.flatten_up_to(tree)
        return leaves

    def merged(self, tree: Any) -> list[Array]:
        """The leaves of ``tree`` reshaped to their plans' merged shapes (eq. 4)."""
        return [x.reshape(p.merged_shape)
                for x, p in zip(self.leaves(tree), self.plans, strict=True)]

    def unmerged(self, xs: list[Array] | None, like: Any) -> Any:
        """Merged-shape arrays back into the structure and shapes of ``like`` (None: None)."""
        if xs is None:
            return None
        return jax.tree.unflatten(
            self.treedef,
            [x.reshape(ref.shape) for x, ref in zip(xs, self.leaves(like), strict=True)],
        )


def gather(
    merged: Sequence[Array], layout: Layout, dtype: DTypeLike | None = None
) -> list[Array]:
    """Per block group, the stack ``[nb, *block_shape]`` of the blocks of ``merged`` leaves."""
    out = []
    for grp in layout.groups:
        pieces = []
        for i, j in grp.members:
            x = merged[i][layout.leaves[i].plan.blocks[j].slices]
            pieces.append(x if dtype is None else x.astype(dtype))
        out.append(jnp.stack(pieces))
    return out


def scatter(stacks: Sequence[Array], leaf: LeafLayout) -> Array:
    """Reassemble one preconditioned leaf (merged shape) from its block groups' stacks."""
    pieces = [stacks[g][p] for g, p in leaf.refs]
    if len(pieces) == 1:
        return pieces[0]
    return assemble(pieces, leaf.chunks)


def assemble(pieces: Sequence[Array], chunks: tuple[int, ...]) -> Array:
    """Blocks listed in row-major chunk order -> the whole tensor (``jnp.block``)."""

    def nest(offset: int, dim: int) -> object:
        if dim == len(chunks):
            return pieces[offset]
        stride = 1
        for c in chunks[dim + 1:]:
            stride *= c
        return [nest(offset + i * stride, dim + 1) for i in range(chunks[dim])]

    return jnp.block(nest(0, 0))  # type: ignore[arg-type]


def block_flags_to_leaf(flags: Sequence[Array], leaf: LeafLayout) -> Array:
    """Per-block boolean scalars -> an elementwise mask of the merged leaf."""
    pieces = [
        jnp.broadcast_to(flags[g][p], b.shape)
        for (g, p), b in zip(leaf.refs, leaf.plan.blocks, strict=True)
    ]
    if len(pieces) == 1:
        return pieces[0]
    return assemble(pieces, leaf.chunks)


def _letters(rank: int) -> str:
    return string.ascii_lowercase[:rank]


def factor_contraction(blocks: Array, k: int) -> Array:
    """Eq. (6): ``G_(k) G_(k)^T`` for every block of the stack, ``[nb, n_k, n_k]``."""
    rank = blocks.ndim - 1
    a = _letters(rank)
    b = a[:k] + "Z" + a[k + 1:]
    return jnp.einsum(f"Y{a},Y{b}->Y{a[k]}Z", blocks, blocks, precision=_HIGHEST)


def mode_product(blocks: Array, matrices: Array, k: int, transpose: bool = False) -> Array:
    """Eq. (16): ``T x_k M`` per block: ``out[.., i, ..] = sum_j M[i, j] T[.., j, ..]``.

    With ``transpose`` the matrix is ``M^T`` (eq. 17's rotation into the
    eigenbasis, ``x_k Q^T``).
    """
    rank = blocks.ndim - 1
    a = _letters(rank)
    t = a[:k] + "Z" + a[k + 1:]
    m = f"YZ{a[k]}" if transpose else f"Y{a[k]}Z"
    return jnp.einsum(f"{m},Y{t}->Y{a}", matrices, blocks, precision=_HIGHEST)


def frobenius(x: Array, axes: tuple[int, ...] | None = None) -> Array:
    """``sqrt(sum x^2)`` over ``axes`` (None: all), safe from overflow of the squares.

    Where the plain sum of squares overflows (float32 entries above about
    1e19, which eq. 3 lets through for small blocks), the norm is
    ``s sqrt(sum (x / s)^2)`` with ``s = max |x|`` instead, so eq. (18)'s
    rescale never divides inf by inf. Everywhere else it is the plain
    expression, bit for bit.
    """
    plain = jnp.sqrt(jnp.sum(x * x, axis=axes))
    s = jnp.max(jnp.abs(x), axis=axes, keepdims=True, initial=0.0)
    s = jnp.where((s > 0) & jnp.isfinite(s), s, jnp.ones_like(s))
    y = x / s
    scaled = jnp.squeeze(s, axis=axes) * jnp.sqrt(jnp.sum(y * y, axis=axes))
    out: Array = jnp.where(jnp.isinf(plain), scaled, plain)
    return out


def block_norms(blocks: Array) -> Array:
    """Frobenius norm of each block of a stack, shape ``[nb]`` (:func:`frobenius`)."""
    return frobenius(blocks, tuple(range(1, blocks.ndim)))


def expand(flags: Array, like: Array) -> Array:
    """``[nb]`` -> broadcastable against ``[nb, ...]``."""
    return flags.reshape(flags.shape + (1,) * (like.ndim - flags.ndim))


__all__ = [
    "BlockGroupLayout",
    "Layout",
    "LeafLayout",
    "ParameterTree",
    "assemble",
    "block_flags_to_leaf",
    "block_norms",
    "expand",
    "factor_contraction",
    "frobenius",
    "gather",
    "make_layout",
    "mode_product",
    "scatter",
]
