"""Blocks of the shape plan, stacked across parameters (docs/spec.md eqs. 4-6, 16-17).

Every parameter of a param group is cut into the blocks of
``shampoo_spec.plan_parameter`` (eqs. 4-5). Blocks that share a shape, a
tuple of roots r_k (eq. 12) and a device form one :class:`BlockGroup`
whatever parameter they come from; a block group keeps its per-block state
stacked along a leading batch dim (factors ``[B, n_k, n_k]``, inverse roots
or eigenbases, the corrected second moment ``[B, *shape]``), so statistics,
inverse roots and preconditioning run as batched matmuls over all of its
blocks (:mod:`shampoo_torch.preconditioner`).

:func:`gather` stacks the blocks of per-parameter tensors into a block
group's batch (a view, no copy, for a group of one whole-parameter block)
and :func:`assemble` puts per-block results back into per-parameter tensors.
One parameter's blocks as a grid (eq. 3's per-block reductions) are
:mod:`shampoo_torch.block_grid`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import torch

from shampoo_spec import FrequentDirectionsConfig, ParameterPlan

from . import gemm
from .device_path import moved, on_cpu_path
from .packed import PACKED_MIN, SymmetricStack

#: The block-group rows taking part: their indices, a consecutive run of them (a
#: chunk of all rows, :func:`row_chunks`: :func:`take` gives views of it), or None
#: for all rows.
Rows = torch.Tensor | slice | None
#: A stacked ``[B, n, n]`` state: a tensor, or symmetric matrices stored as one
#: triangle (:class:`~shampoo_torch.packed.SymmetricStack`), read with :func:`take`
#: and written with :func:`put` alike.
Stack = torch.Tensor | SymmetricStack


@dataclass(frozen=True)
class ParamLayout:
    """Where the blocks of one parameter live: its plan and its block slices."""

    plan: ParameterPlan
    block_slices: tuple[tuple[slice, ...], ...]

    @property
    def merged_shape(self) -> tuple[int, ...]:
        return self.plan.merged_shape

    @property
    def single_block(self) -> bool:
        return len(self.block_slices) == 1

    @property
    def num_blocks(self) -> int:
        """Blocks that carry Kronecker state: 0 when the parameter is not preconditioned."""
        return len(self.block_slices) if self.plan.preconditioned else 0


@dataclass
class Sketch:
    """Eq. (10d): the frequent-directions sketches of one sketched dim, stacked over rows.

    ``u`` ``[B, n, r]`` (orthonormal or zero columns), ``lam`` ``[B, r]``
    (descending, >= 0), ``rho`` ``[B]`` (the tail), all 0 at first, in the
    factor dtype.
    """

    u: torch.Tensor
    lam: torch.Tensor
    rho: torch.Tensor

    @classmethod
    def zeros(cls, b: int, n: int, rank: int, dtype: torch.dtype,
              device: torch.device) -> Sketch:
        return cls(torch.zeros((b, n, rank), dtype=dtype, device=device),
                   torch.zeros((b, rank), dtype=dtype, device=device),
                   torch.zeros(b, dtype=dtype, device=device))

    def take(self, rows: Rows) -> Sketch:
        """The sketches of ``rows`` (all of them when None)."""
        return Sketch(take(self.u, rows), take(self.lam, rows), take(self.rho, rows))

    def put(self, rows: Rows, new: Sketch) -> None:
        """Write ``new`` into ``rows`` (replace the stacks when ``rows`` is None)."""
        self.u = put(self.u, rows, new.u)
        self.lam = put(self.lam, rows, new.lam)
        self.rho = put(self.rho, rows, new.rho)

    def where(self, keep_new: torch.Tensor, new: Sketch) -> Sketch:
        """Per row: ``new`` where ``keep_new``, else this one."""
        return Sketch(torch.where(keep_new[:, None, None], new.u, self.u),
                      torch.where(keep_new[:, None], new.lam, self.lam),
                      torch.where(keep_new, new.rho, self.rho))

    def row(self, row: int) -> dict[str, torch.Tensor]:
        """One row's sketch as views (a copy into them writes)."""
        return {"u": self.u[row], "lam": self.lam[row], "rho": self.rho[row]}

    def tensors(self) -> list[torch.Tensor]:
        return [self.u, self.lam, self.rho]


@dataclass
class BlockGroup:
    """Stacked state of every block with one (shape, roots, device) in a param group.

    ``members[row] = (parameter position in the param group, block index)``.
    ``factors[k]`` (eq. 6) and ``inverse_roots[k]`` (eqs. 10-11; the
    eigenbasis Q_k with eigenvalue correction, eq. 17) exist for each
    preconditioned dim k, i.e. each dim whose root r_k is not 0. Factors and
    the corrected moment are in ``dtype`` (``factor_dtype``; the factors in
    ``storage_dtype`` when set, eq. 11b); inverse roots
    in ``root_dtype`` (``config.root_dtype``: ``inverse_root_dtype``, eq. 11a,
    or the eigenbases' ``eigenvectors_dtype``, eq. 17a, else the factor dtype;
    None here means ``dtype``); the corrected moment D in ``corrected_dtype``
    (``config.corrected_dtype``, eq. 17a; None: ``dtype``). ``sketches[k]``
    (eq. 10d) exists for each dim k whose factor is sketched (eq. 6c): its
    factor slot then holds this statistics step's observation C_k only.
    With ``packed`` (:meth:`allocate`), factors and symmetric inverse roots of
    at least :data:`~shampoo_torch.packed.PACKED_MIN` rows are stored as one
    triangle (:class:`~shampoo_torch.packed.SymmetricStack`).
    """

    shape: tuple[int, ...]
    roots: tuple[float, ...]  # the exponents r_k of eq. (12)
    device: torch.device
    dtype: torch.dtype
    members: list[tuple[int, int]]
    factors: dict[int, Stack] = field(default_factory=dict)
    inverse_roots: dict[int, Stack] = field(default_factory=dict)
    statistics_updates: torch.Tensor | None = None  # [B] int64, n of eq. (7)
    consecutive_failures: torch.Tensor | None = None  # [B] int64, eq. (13)
    corrected: torch.Tensor | None = None  # [B, *shape], D of eq. (17)
    corrected_updates: torch.Tensor | None = None  # [B] int64
    root_dtype: torch.dtype | None = None  # None: ``dtype``
    corrected_dtype: torch.dtype | None = None  # D's (eq. 17a); None: ``dtype``
    #: the factors' storage dtype (``factor_storage_dtype``, eq. 11b); None: ``dtype``.
    storage_dtype: torch.dtype | None = None
    #: eq. (10d): the sketch of each sketched dim k (``frequent_directions``).
    sketches: dict[int, Sketch] = field(default_factory=dict)
    #: eqs. (10f), (10h): the eigenbasis Q_k each dim's root starts from (in ``dtype``; I
    #: before the first root step), with ``config.root_inverse_stores_basis`` only.
    eigenbases: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.root_dtype is None:
            self.root_dtype = self.dtype
        if self.corrected_dtype is None:
            self.corrected_dtype = self.dtype

    @property
    def stored_factor_dtype(self) -> torch.dtype:
        """The factors' dtype: ``storage_dtype`` (eq. 11b) or ``dtype``."""
        return self.dtype if self.storage_dtype is None else self.storage_dtype

    @property
    def rounds_roots(self) -> bool:
        """Whether inverse roots and eq. (16)'s products are in another dtype than the factors."""
        return self.root_dtype != self.dtype

    @property
    def dims(self) -> tuple[int, ...]:
        """The preconditioned dims of the block (root != 0)."""
        return tuple(k for k, r in enumerate(self.roots) if r != 0)

    def __len__(self) -> int:
        return len(self.members)

    def allocate(self, initial_value: float, eigenvalue_correction: bool,
                 compresses: Callable[[int], bool] | None = None,
                 sketch: FrequentDirectionsConfig | None = None,
                 stored_bases: bool = False, packed: bool = False,
                 packed_roots: bool = False) -> None:
        """``c I`` factors (eq. 6), identity inverse roots (eq. 13), zero counters.

        ``compresses(n)``: whether eq. (10c) compresses an ``n x n`` factor, whose
        inverse root starts at 0 (Google's zero low-rank preconditioner).
        ``sketch``: eq. (10d)'s config; a factor it sketches (``sketch.compresses(n)``)
        gets a zero :class:`Sketch` and, as a compressed one, a zero inverse root.
        ``stored_bases``: eqs. (10f), (10h)'s identity eigenbasis per dim.
        ``packed``: factors (but sketched ones, whose slot holds eq. 6c's
        observation) of at least :data:`~shampoo_torch.packed.PACKED_MIN` rows
        are stored as one triangle; ``packed_roots``: inverse roots alike (but
        eigenbases, eq. 17, which are not symmetric).
        """
        b, dev, dt = len(self.members), self.device, self.dtype
        for k in self.dims:
            n = self.shape[k]
            eye = torch.eye(n, dtype=dt, device=dev).expand(b, n, n)
            factor = (initial_value * eye).to(self.stored_factor_dtype).contiguous()
            root = eye.to(self.root_dtype, copy=True)  # exact in any dtype
            if stored_bases:
                self.eigenbases[k] = eye.contiguous()
            sketched = sketch is not None and sketch.compresses(n)
            if sketched:
                assert sketch is not None
                self.sketches[k] = Sketch.zeros(b, n, sketch.sketch_rank(n), dt, dev)
            if sketched or (compresses is not None and compresses(n)):
                root.zero_()
            large = n >= PACKED_MIN
            self.factors[k] = (SymmetricStack.from_full(factor)
                               if packed and large and not sketched else factor)
            self.inverse_roots[k] = (SymmetricStack.from_full(root)
                                     if packed_roots and large and not eigenvalue_correction
                                     else root)
        self.statistics_updates = torch.zeros(b, dtype=torch.int64, device=dev)
        self.consecutive_failures = torch.zeros(b, dtype=torch.int64, device=dev)
        if eigenvalue_correction:
            self.corrected = torch.zeros((b, *self.shape), dtype=self.corrected_dtype, device=dev)
            self.corrected_updates = torch.zeros(b, dtype=torch.int64, device=dev)

    def row_state(self, row: int) -> dict[str, Any]:
        """One block's state as views into the stacks (no copy; a copy into them writes),
        but packed matrices, which are new full tensors (:meth:`store_row_state` writes
        them back).

        Keys: ``factors`` and ``inverse_roots`` (dicts by dim), the counters
        ``statistics_updates`` and ``consecutive_failures``, with eigenvalue
        correction ``corrected`` and ``corrected_updates``, with sketched
        dims ``sketches`` (by dim: ``{"u", "lam", "rho"}``, eq. 10d), and with
        a stored-basis root (eqs. 10f, 10h) ``eigenbases`` (by dim).
        """
        out: dict[str, Any] = {
            "factors": {k: _row(f, row) for k, f in self.factors.items()},
            "inverse_roots": {k: _row(x, row) for k, x in self.inverse_roots.items()},
        }
        if self.sketches:
            out["sketches"] = {k: s.row(row) for k, s in self.sketches.items()}
        if self.eigenbases:
            out["eigenbases"] = {k: q[row] for k, q in self.eigenbases.items()}
        for name in ("statistics_updates", "consecutive_failures", "corrected_updates",
                     "corrected"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value[row]
        return out

    def store_row_state(self, row: int, state: Mapping[str, Any]) -> None:
        """Write back the packed matrices of a :meth:`row_state` of ``row`` (the rest
        of it are views, already written)."""
        for name in ("factors", "inverse_roots"):
            stacks: dict[int, Stack] = getattr(self, name)
            for k, x in stacks.items():
                if isinstance(x, SymmetricStack):
                    x.pack_(slice(row, row + 1), state[name][k].unsqueeze(0))

    def tensors(self) -> list[torch.Tensor]:
        """Every stacked tensor of the group (factors, inverse roots, sketches, moments,
        counters; a packed stack's data)."""
        extra = (self.statistics_updates, self.consecutive_failures, self.corrected,
                 self.corrected_updates)
        return [*map(_data, self.factors.values()), *map(_data, self.inverse_roots.values()),
                *self.eigenbases.values(),
                *(t for s in self.sketches.values() for t in s.tensors()),
                *(t for t in extra if t is not None)]


def _row(x: Stack, row: int) -> torch.Tensor:
    """Row ``row`` of a stack: a view, or a packed stack's full matrix (a new tensor)."""
    return x.row(row) if isinstance(x, SymmetricStack) else x[row]


def _data(x: Stack) -> torch.Tensor:
    """The tensor that holds a stack."""
    return x.data if isinstance(x, SymmetricStack) else x


def build_block_groups(
    plans: Sequence[ParameterPlan],
    devices: Sequence[torch.device],
    dtype: torch.dtype,
    owned: Callable[[int, int], bool] | None = None,
    root_dtype: torch.dtype | None = None,
    corrected_dtype: torch.dtype | None = None,
    storage_dtype: torch.dtype | None = None,
) -> tuple[list[ParamLayout], list[BlockGroup]]:
    """Group the blocks of all preconditioned parameters by (shape, roots, device).

    ``owned(position, block)``: only the blocks it accepts get a block-group
    row (the blocks this rank owns, :mod:`shampoo_torch.distributed`); None: all.
    ``dtype`` is the factor dtype, ``root_dtype`` the inverse roots',
    ``corrected_dtype`` the corrected moment's and ``storage_dtype`` the
    factors' storage (eq. 11b) (None: ``dtype``).
    """
    groups: list[BlockGroup] = []
    index: dict[tuple[object, ...], int] = {}
    layouts = []
    for pos, (plan, device) in enumerate(zip(plans, devices, strict=True)):
        if plan.preconditioned:
            for bi, block in enumerate(plan.blocks):
                if owned is not None and not owned(pos, bi):
                    continue
                key = (block.shape, block.roots, device)
                if key not in index:
                    index[key] = len(groups)
                    groups.append(BlockGroup(block.shape, block.roots, device, dtype, [],
                                             root_dtype=root_dtype,
                                             corrected_dtype=corrected_dtype,
                                             storage_dtype=storage_dtype))
                groups[index[key]].members.append((pos, bi))
        layouts.append(ParamLayout(plan, tuple(b.slices for b in plan.blocks)))
    return layouts, groups


def select_rows(
    groups: Sequence[BlockGroup],
    flat_rows: Sequence[torch.Tensor],
    positions: Sequence[int],
    ok: torch.Tensor | None,
) -> dict[int, tuple[list[int], Rows, torch.Tensor | None]]:
    """Per block group (by index): the rows of the parameters ``positions``.

    Each entry is ``(rows as a list, their index tensor or None for all rows,
    their eq. (3) flags or None when ok is None)``; ``ok`` is the param
    group's flag per block in its flat block order and ``flat_rows[index]``
    the flat block index of each row of a block group. Block groups without
    such rows are left out.
    """
    chosen = set(positions)
    out: dict[int, tuple[list[int], Rows, torch.Tensor | None]] = {}
    for index, bg in enumerate(groups):
        members = [r for r, (pos, _) in enumerate(bg.members) if pos in chosen]
        if not members:
            continue
        rows = None
        if len(members) != len(bg):
            rows = torch.tensor(members, dtype=torch.int64, device=bg.device)
        ok_rows = None
        if ok is not None:
            ok_rows = moved(ok, bg.device).index_select(0, take(flat_rows[index], rows))
        out[index] = (members, rows, ok_rows)
    return out


def gather(
    bg: BlockGroup,
    layouts: Sequence[ParamLayout],
    tensors: Mapping[int, torch.Tensor],
    members: Sequence[int],
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Stack the blocks ``members`` (block-group rows) of per-parameter merged tensors.

    Returns ``[len(members), *bg.shape]`` in ``dtype`` (None: the block
    group's factor dtype), cast straight from the tensors' own dtype; a
    single whole-parameter block in that dtype is returned as a view.
    """
    views = []
    for row in members:
        pos, bi = bg.members[row]
        lay = layouts[pos]
        x = tensors[pos]
        views.append(x if lay.single_block else x[lay.block_slices[bi]])
    out = views[0].unsqueeze(0) if len(views) == 1 else torch.stack(views)
    return moved(out, dtype=bg.dtype if dtype is None else dtype)


def assemble(
    layout: ParamLayout, blocks: Sequence[torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """One parameter's merged tensor from its per-block results (row-major blocks)."""
    if layout.single_block:
        whole = blocks[0]
        if tuple(whole.shape) != tuple(layout.merged_shape):
            whole = whole.reshape(layout.merged_shape)
        return moved(whole, dtype=dtype)
    out = torch.empty(layout.merged_shape, dtype=dtype, device=blocks[0].device)
    for sl, blk in zip(layout.block_slices, blocks, strict=True):
        out[sl] = blk
    return out


#: Bytes of stacked block rows that a chunked phase (inverse roots, directions)
#: holds at once: its temporaries are a few times this, not the block group's size.
#: Every row is its own problem (batch invariance), so no chunking changes a bit.
#: One float32 1024 x 1024 factor: an eigh root holds about four such temporaries
#: (its input, eigenvectors, LAPACK's workspace, the product), so 16 MiB chunks
#: made the root step the step's peak (docs/results.md, "Side by side"), while
#: one row per call costs nothing measurable at that size.
WORKSPACE_BYTES = 4 * 2**20
#: The same bound on the accelerator path (:mod:`.device_path`): there each call is a
#: kernel launch and the device has the memory, so a phase takes up to 64 such factors
#: per call (a single call for the groups of most models).
ACCELERATOR_WORKSPACE_BYTES = 256 * 2**20


def row_chunks(
    rows: Rows, count: int, row_bytes: int, device: torch.device
) -> Iterator[tuple[slice, Rows]]:
    """The ``count`` rows ``rows`` (None: all of the group) in consecutive chunks of
    at most :data:`WORKSPACE_BYTES` of ``row_bytes`` each (one row at least): each
    chunk's positions among them and its :data:`Rows` (``rows`` itself for a single
    chunk)."""
    bound = WORKSPACE_BYTES if on_cpu_path(device) else ACCELERATOR_WORKSPACE_BYTES
    step = max(1, bound // max(1, row_bytes))
    for j0 in range(0, count, step):
        j1 = min(count, j0 + step)
        if j0 == 0 and j1 == count:
            part: Rows = rows
        elif rows is None:
            part = slice(j0, j1)  # a run: the state's rows as views, nothing copied
        elif isinstance(rows, slice):  # a run within a run
            start = rows.start or 0
            part = slice(start + j0, start + j1)
        else:
            part = rows[j0:j1]
        yield slice(j0, j1), part


def row_count(rows: Rows, total: int) -> int:
    """How many rows ``rows`` names in a block group of ``total`` rows."""
    if rows is None:
        return total
    if isinstance(rows, slice):
        return len(range(*rows.indices(total)))
    return int(rows.shape[0])


def take(x: Stack, rows: Rows) -> torch.Tensor:
    """Rows of a stacked block-group state: all of them (None) or a run (a slice), as the
    state itself or a view of it, which its callers never write; indices, as a copy. A
    packed stack's rows are unpacked into a new tensor, which its caller may write and
    :func:`put` back."""
    if isinstance(x, SymmetricStack):
        return x.unpack(rows)
    if rows is None:
        return x
    if isinstance(rows, slice):
        return x[rows]
    return x.index_select(0, rows)


@overload
def put(x: torch.Tensor, rows: Rows, value: torch.Tensor) -> torch.Tensor: ...
@overload
def put(x: SymmetricStack, rows: Rows, value: torch.Tensor) -> SymmetricStack: ...
@overload
def put(x: Stack, rows: Rows, value: torch.Tensor) -> Stack: ...
def put(x: Stack, rows: Rows, value: torch.Tensor) -> Stack:
    """Write ``value`` into the rows of ``x``; returns the tensor to keep (``x`` written
    in place; ``value`` itself for all rows of another shape or dtype; a run's view
    already holding ``value`` is left as it is). State written in place keeps its
    storage: state replaced every step lands among the step's temporaries and pins
    the allocator's heap. A packed stack stores the lower triangles of ``value``."""
    if isinstance(x, SymmetricStack):
        x.pack_(rows, value)
        return x
    if rows is None:
        if value is x or value.shape != x.shape or value.dtype != x.dtype:
            return value
        return x.copy_(value)
    if isinstance(rows, slice):
        view = x[rows]
        if not (view.data_ptr() == value.data_ptr() and view.shape == value.shape
                and view.stride() == value.stride()):
            view.copy_(value)
        return x
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


#: Factor size from which :func:`gram_update_` forms one triangle (below it the two
#: smaller GEMMs run no faster than one: measured at 512 on 2 CPU threads).
SYMMETRIC_GRAM_MIN = 768


def gram_on_triangle(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether eq. (6) for a packed factor (``a @ b = G_(k) G_(k)^T``, ``a`` ``[B, n, c]``)
    runs on its stored triangle (:meth:`~shampoo_torch.packed.SymmetricStack.gram_update_`):
    factors of :data:`SYMMETRIC_GRAM_MIN` or more, or smaller ones whose halves'
    products go through oneDNN. Below the size, torch picks a small GEMM's kernel by
    its operands' layout, which slices of them change between one batch row and
    several (:mod:`.invariance`), so the factor takes one whole GEMM; oneDNN's
    calls are one matrix each, and there the triangle is the faster (512: 1.3 ms
    against 1.8 ms for unpacking, one GEMM and packing, caches cold)."""
    h = a.shape[1] // 2
    return a.shape[1] >= SYMMETRIC_GRAM_MIN or gemm.uses_onednn(a[:, :h], b[..., :h])


def gram_update_(
    c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float, alpha: float
) -> torch.Tensor:
    """``c <- beta c + alpha A B`` in place for ``A B = G_(k) G_(k)^T`` (eq. 6), ``c``
    symmetric: the lower half of the rows by GEMM, the upper right block mirrored.

    With rows split at ``h = m // 2``: ``c[:h, :h]`` from ``A[:h] B[:, :h]`` and
    ``c[h:, :]`` from ``A[h:] B``, then ``c[:h, h:] = c[h:, :h]^T``: 3/4 of the
    FLOPs of the whole product (a symmetric rank-k update's other half is
    its mirror). Each computed entry is the dot product the whole GEMM forms,
    its partial sums perhaps in another order (measured on this project's
    CPU: the lower triangle bit for bit the whole float32 GEMM's, which is
    all ``eigh`` reads; within 3e-15 relative in float64). The upper right
    block becomes the mirror of the lower left (the whole float32 GEMM's
    entries (i, j) and (j, i) differ by up to 1.3e-8 relative; the two
    diagonal blocks keep their GEMM's asymmetry). Factors smaller than
    :data:`SYMMETRIC_GRAM_MIN` take the whole GEMM. The same for every batch
    row, so a block's factor does not depend on its group.

    The accelerator path (:mod:`.device_path`) takes the whole GEMM at every size:
    one launch, where the halves take two and the mirror a third and one more
    pass over the factor (the 1/4 of the FLOPs saved is a CPU measurement).
    """
    m = c.shape[-1]
    if m < SYMMETRIC_GRAM_MIN or not on_cpu_path(c.device):
        return gemm.baddbmm_(c, a, b, beta, alpha)
    h = m // 2
    a, b = gemm.gram_operands(a, b)
    gemm.baddbmm_(c[:, :h, :h], a[:, :h], b[..., :h], beta, alpha)
    gemm.baddbmm_(c[:, h:], a[:, h:], b, beta, alpha)
    c[:, :h, h:] = c[:, h:, :h].mT
    return c


#: Storage dtypes whose products are formed as float32 GEMMs (:func:`mode_product_in`).
_NARROW = (torch.bfloat16, torch.float16)


def mode_product_in(
    x: torch.Tensor, m: torch.Tensor, k: int, dtype: torch.dtype, transpose: bool = False
) -> torch.Tensor:
    """:func:`mode_product` computed in ``dtype`` and rounded to it (eqs. 16, 17a).

    For bfloat16 and float16 the operands (numbers of ``dtype``) are multiplied
    by a float32 GEMM (each product exact, the sum accumulated in float32) and
    the result rounded once to ``dtype``, as torch's own bfloat16/float16 GEMM
    on CPU does for one block; torch's batched bfloat16 ``bmm`` instead rounds
    an entry otherwise for some batch sizes (measured: 3 entries in 460,800
    with 18 blocks of 8 x 8), which would make a block's result depend on its
    block group. Other dtypes: the GEMM in ``dtype``.
    """
    if dtype in _NARROW:
        return mode_product(x.float(), m.float(), k, transpose).to(dtype)
    return mode_product(x.to(dtype), m.to(dtype), k, transpose)


def mode_product(x: torch.Tensor, m: torch.Tensor, k: int, transpose: bool = False) -> torch.Tensor:
    """``X x_k M`` (or ``X x_k M^T``) for each block of a stack (eqs. 16-17).

    ``out[b, ..., i, ...] = sum_j M[b, i, j] X[b, ..., j, ...]`` along block dim k.
    """
    b, n = x.shape[0], x.shape[k + 1]
    mt = m if transpose else m.transpose(1, 2)  # the matrix applied from the right
    if k == x.dim() - 2:  # last dim: X_(rest, n) @ M^T
        return gemm.bmm(x.reshape(b, -1, n), mt).reshape(x.shape)
    ml = mt.transpose(1, 2)  # M (or M^T) applied from the left
    if k == 0:
        return gemm.bmm(ml, x.reshape(b, n, -1)).reshape(x.shape)
    moved = x.movedim(k + 1, 1)
    out = gemm.bmm(ml, moved.reshape(b, n, -1)).reshape(moved.shape)
    return out.movedim(1, k + 1)
