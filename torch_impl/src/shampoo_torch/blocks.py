"""Blocks of the shape plan, stacked across parameters (docs/spec.md eqs. 4-6, 16-17).

Every parameter of a param group is cut into the blocks of
``shampoo_spec.plan_parameter`` (eqs. 4-5). Blocks that share a shape, a
tuple of roots (eq. 12) and a device are grouped into one :class:`Bucket`
whatever parameter they come from; a bucket keeps its per-block state
stacked along a leading batch dim (factors ``[B, n_k, n_k]``, inverse roots
or eigenbases, the corrected second moment ``[B, *shape]``), so statistics,
roots and preconditioning run as batched matmuls over all of its blocks.

:func:`gather` stacks the blocks of per-parameter tensors into a bucket's
batch (a view, no copy, for a bucket of one whole-parameter block) and
:func:`assemble` puts per-block results back into per-parameter tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from shampoo_spec import ParameterPlan

Rows = torch.Tensor | None  # indices of the bucket rows taking part; None = all rows


@dataclass(frozen=True)
class ParamLayout:
    """Where the blocks of one parameter live: its plan, block slices, bucket rows."""

    plan: ParameterPlan
    block_slices: tuple[tuple[slice, ...], ...]
    #: (bucket index, row) of each block held here; empty when the parameter is not
    #: preconditioned (or, distributed, when this rank owns none of its blocks).
    rows: tuple[tuple[int, int], ...]

    @property
    def merged_shape(self) -> tuple[int, ...]:
        return self.plan.merged_shape

    @property
    def single_block(self) -> bool:
        return len(self.block_slices) == 1


@dataclass
class Bucket:
    """Stacked state of every block with one (shape, roots, device) in a param group.

    ``members[row] = (parameter position in the group, block index)``.
    ``factors[k]`` (eq. 6) and ``inverse_roots[k]`` (eqs. 10-11; the eigenbasis
    Q_k with eigenvalue correction, eq. 17) exist for each preconditioned dim k.
    """

    shape: tuple[int, ...]
    roots: tuple[float, ...]
    device: torch.device
    dtype: torch.dtype
    members: list[tuple[int, int]]
    factors: dict[int, torch.Tensor] = field(default_factory=dict)
    inverse_roots: dict[int, torch.Tensor] = field(default_factory=dict)
    statistics_updates: torch.Tensor | None = None  # [B] int64, n of eq. (7)
    consecutive_failures: torch.Tensor | None = None  # [B] int64, eq. (13)
    corrected: torch.Tensor | None = None  # [B, *shape], D of eq. (17)
    corrected_updates: torch.Tensor | None = None  # [B] int64

    @property
    def dims(self) -> tuple[int, ...]:
        """The preconditioned dims of the block (root != 0)."""
        return tuple(k for k, r in enumerate(self.roots) if r != 0)

    def __len__(self) -> int:
        return len(self.members)

    def allocate(self, initial_value: float, eigenvalue_correction: bool) -> None:
        """Zero (or eps * I) factors, identity roots (eq. 13), zero counters."""
        b, dev, dt = len(self.members), self.device, self.dtype
        for k in self.dims:
            n = self.shape[k]
            eye = torch.eye(n, dtype=dt, device=dev).expand(b, n, n)
            self.factors[k] = (initial_value * eye).contiguous()
            self.inverse_roots[k] = eye.clone()
        self.statistics_updates = torch.zeros(b, dtype=torch.int64, device=dev)
        self.consecutive_failures = torch.zeros(b, dtype=torch.int64, device=dev)
        if eigenvalue_correction:
            self.corrected = torch.zeros((b, *self.shape), dtype=dt, device=dev)
            self.corrected_updates = torch.zeros(b, dtype=torch.int64, device=dev)


def block_slices(plan: ParameterPlan) -> tuple[tuple[slice, ...], ...]:
    return tuple(b.slices for b in plan.blocks)


def build_buckets(
    plans: Sequence[ParameterPlan],
    devices: Sequence[torch.device],
    dtype: torch.dtype,
    owned: Callable[[int, int], bool] | None = None,
) -> tuple[list[ParamLayout], list[Bucket]]:
    """Group the blocks of all preconditioned parameters by (shape, roots, device).

    ``owned(position, block)``: only the blocks it accepts get a bucket row
    (the blocks this rank owns, :mod:`shampoo_torch.distributed`); None: all.
    """
    buckets: list[Bucket] = []
    index: dict[tuple[object, ...], int] = {}
    layouts = []
    for pos, (plan, device) in enumerate(zip(plans, devices, strict=True)):
        rows = []
        if plan.preconditioned:
            for bi, block in enumerate(plan.blocks):
                if owned is not None and not owned(pos, bi):
                    continue
                key = (block.shape, block.roots, device)
                if key not in index:
                    index[key] = len(buckets)
                    buckets.append(Bucket(block.shape, block.roots, device, dtype, []))
                bucket = buckets[index[key]]
                rows.append((index[key], len(bucket.members)))
                bucket.members.append((pos, bi))
        layouts.append(ParamLayout(plan, block_slices(plan), tuple(rows)))
    return layouts, buckets


def gather(
    bucket: Bucket,
    layouts: Sequence[ParamLayout],
    tensors: Mapping[int, torch.Tensor],
    members: Sequence[int],
) -> torch.Tensor:
    """Stack the blocks ``members`` (bucket rows) of per-parameter merged tensors.

    Returns ``[len(members), *bucket.shape]`` in the bucket dtype; a single
    whole-parameter block is returned as a view.
    """
    views = []
    for row in members:
        pos, bi = bucket.members[row]
        lay = layouts[pos]
        x = tensors[pos]
        views.append(x if lay.single_block else x[lay.block_slices[bi]])
    out = views[0].unsqueeze(0) if len(views) == 1 else torch.stack(views)
    return out.to(bucket.dtype)


def assemble(
    layout: ParamLayout, blocks: Sequence[torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """One parameter's merged tensor from its per-block results (row-major blocks)."""
    if layout.single_block:
        return blocks[0].reshape(layout.merged_shape).to(dtype)
    out = torch.empty(layout.merged_shape, dtype=dtype, device=blocks[0].device)
    for sl, blk in zip(layout.block_slices, blocks, strict=True):
        out[sl] = blk
    return out


def take(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Rows of a stacked bucket state (all of them when ``rows`` is None)."""
    return x if rows is None else x.index_select(0, rows)


def put(x: torch.Tensor, rows: Rows, value: torch.Tensor) -> torch.Tensor:
    """Write ``value`` into the rows of ``x``; returns the tensor to keep."""
    if rows is None:
        return value
    return x.index_copy_(0, rows, value)


def contraction_operands(g: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) with ``A @ B = G_(k) G_(k)^T`` for each block of a stack ``[B, *shape]`` (eq. 6).

    Returned as operands so the caller can fuse the update into one
    ``baddbmm`` (``beta2 L + w A B``).
    """
    b, n = g.shape[0], g.shape[k + 1]
    if k == g.dim() - 2:  # last block dim: contract the leading ones
        gk = g.reshape(b, -1, n)
        return gk.transpose(1, 2), gk
    gk = g.movedim(k + 1, 1).reshape(b, n, -1)
    return gk, gk.transpose(1, 2)


def mode_product(x: torch.Tensor, m: torch.Tensor, k: int, transpose: bool = False) -> torch.Tensor:
    """``X x_k M`` (or ``X x_k M^T``) for each block of a stack (eqs. 16-17).

    ``out[b, ..., i, ...] = sum_j M[b, i, j] X[b, ..., j, ...]`` along block dim k.
    """
    b, n = x.shape[0], x.shape[k + 1]
    mt = m if transpose else m.transpose(1, 2)  # the matrix applied from the right
    if k == x.dim() - 2:  # last dim: X_(rest, n) @ M^T
        return torch.bmm(x.reshape(b, -1, n), mt).reshape(x.shape)
    ml = mt.transpose(1, 2)  # M (or M^T) applied from the left
    if k == 0:
        return torch.bmm(ml, x.reshape(b, n, -1)).reshape(x.shape)
    moved = x.movedim(k + 1, 1)
    out = torch.bmm(ml, moved.reshape(b, n, -1)).reshape(moved.shape)
    return out.movedim(1, k + 1)
