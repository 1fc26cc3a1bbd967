"""Stacks of symmetric matrices stored as one triangle (the factors L_k of eq. 6 and the
inverse roots X_k of eqs. 10-11).

A factor or an inverse root is symmetric, so its lower triangle (diagonal
included) determines it: :class:`SymmetricStack` keeps ``n (n + 1) / 2``
entries per matrix instead of ``n^2``, about half the block state, as
Meta's ``use_symmetric_packing`` does. The statistics update (eq. 6) and a
1-d block's direction (eq. 16, a matrix-vector product) work on the stored
triangle; every other use unpacks the rows it needs into a full ``[b, n, n]``
tensor (in chunks of ``blocks.WORKSPACE_BYTES``), and a new value is packed
from its lower triangle, which is all LAPACK's ``eigh`` reads; the upper
triangle becomes the mirror of the lower one.
Packing and unpacking copy entries and compute nothing (docs/spec.md,
"Symmetric storage").

Layout of one matrix A (``h = n // 2``, ``m = n - h``; ``A11`` is ``A[:h, :h]``,
``A21`` is ``A[h:, :h]``, ``A22`` is ``A[h:, h:]``)::

    [ A21 (m x h, row-major) | Y ((h + 1) x m, row-major) ]
    Y[r, c] = A22[c, r]      for r <= c < m   (the lower triangle of A22, transposed)
    Y[i + 1, j] = A11[i, j]  for j <= i < h   (the lower triangle of A11)

The two triangles of Y are disjoint, and ``m h + (h + 1) m = n (n + 1) / 2``
(LAPACK's rectangular full packed format, up to the order of the pieces):
unpacking is a copy of ``A21`` and its transpose and two masked copies of
whole square blocks, strided like the matrix, not an entry-by-entry gather.
"""

from __future__ import annotations

import torch

from . import gemm

#: Factor size from which factors and inverse roots are stored packed (smaller
#: ones stay full: a 1 x 1 matrix has nothing to save).
PACKED_MIN = 2

_MASKS: dict[tuple[int, str], torch.Tensor] = {}


def packed_size(n: int) -> int:
    """Entries of one packed ``n x n`` symmetric matrix: ``n (n + 1) / 2``."""
    return n * (n + 1) // 2


def _lower(n: int, device: torch.device) -> torch.Tensor:
    """The ``[n, n]`` boolean mask of the lower triangle, diagonal included (cached:
    the masks are used every step)."""
    key = (n, str(device))
    mask = _MASKS.get(key)
    if mask is None:
        mask = torch.ones((n, n), dtype=torch.bool, device=device).tril_()
        _MASKS[key] = mask
    return mask


class SymmetricStack:
    """``B`` symmetric ``n x n`` matrices, each stored as its lower triangle (module doc).

    ``data`` is ``[B, n (n + 1) / 2]``. :meth:`unpack` and :meth:`pack_`
    move rows between this and full ``[b, n, n]`` tensors;
    :func:`shampoo_torch.blocks.take` and :func:`~shampoo_torch.blocks.put`
    call them, so the optimizer's phases read and write a packed stack as a
    full one (each read a fresh tensor, each write a copy into the triangle).
    """

    def __init__(self, data: torch.Tensor, n: int) -> None:
        if data.dim() != 2 or data.shape[1] != packed_size(n):
            raise ValueError(f"packed data of shape {tuple(data.shape)} does not hold "
                             f"{n} x {n} symmetric matrices ({packed_size(n)} entries each)")
        self.data = data
        self.n = n
        self.h = n // 2  # A11 is h x h, A22 m x m, A21 m x h
        self.m = n - self.h

    @classmethod
    def from_full(cls, full: torch.Tensor) -> SymmetricStack:
        """Pack ``[B, n, n]`` (its lower triangles) into a new stack."""
        b, n = full.shape[0], full.shape[-1]
        out = cls(torch.empty((b, packed_size(n)), dtype=full.dtype, device=full.device), n)
        out.pack_(None, full)
        return out

    @property
    def shape(self) -> torch.Size:
        """The unpacked shape ``[B, n, n]``."""
        return torch.Size((self.data.shape[0], self.n, self.n))

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def __len__(self) -> int:
        return int(self.data.shape[0])

    def _pieces(self, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A21 [b, m, h], Y [b, h + 1, m])`` as views of packed rows ``data``."""
        h, m = self.h, self.m
        return (data[:, : m * h].unflatten(1, (m, h)),
                data[:, m * h:].unflatten(1, (h + 1, m)))

    def _rows(self, rows: torch.Tensor | slice | None) -> torch.Tensor:
        if rows is None:
            return self.data
        if isinstance(rows, slice):
            return self.data[rows]
        return self.data.index_select(0, rows)

    def unpack(self, rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """The full matrices of ``rows`` (None: all), a new ``[b, n, n]`` tensor whose
        upper triangle mirrors the stored lower one."""
        data = self._rows(rows)
        n, h, m = self.n, self.h, self.m
        a21, y = self._pieces(data)
        out = torch.empty((data.shape[0], n, n), dtype=data.dtype, device=data.device)
        out[:, h:, :h] = a21
        gemm.copy_(out[:, :h, h:], a21.mT)
        y11, y22 = y[:, 1:, :h], y[:, :m, :]
        torch.where(_lower(h, data.device), y11, y11.mT, out=out[:, :h, :h])
        torch.where(_lower(m, data.device), y22.mT, y22, out=out[:, h:, h:])
        return out

    def pack_(self, rows: torch.Tensor | slice | None, full: torch.Tensor) -> None:
        """Store the lower triangles of ``full`` ``[b, n, n]`` into ``rows`` (None: all)."""
        if full.shape[1:] != (self.n, self.n):
            raise ValueError(f"cannot pack matrices of shape {tuple(full.shape[1:])} into "
                             f"{self.n} x {self.n} storage")
        full = full.to(self.data.dtype)
        direct = not isinstance(rows, torch.Tensor)
        data = self._rows(rows) if direct else torch.empty(
            (full.shape[0], self.data.shape[1]), dtype=self.data.dtype, device=self.data.device)
        h, m = self.h, self.m
        a21, y = self._pieces(data)
        a21.copy_(full[:, h:, :h])
        y11, y22 = y[:, 1:, :h], y[:, :m, :]
        # Disjoint triangles of Y: each masked copy keeps the other's entries.
        torch.where(_lower(h, data.device), full[:, :h, :h], y11, out=y11)
        torch.where(_lower(m, data.device).mT, full[:, h:, h:].mT, y22, out=y22)
        if not direct:
            assert isinstance(rows, torch.Tensor)
            self.data.index_copy_(0, rows, data)

    def gram_update_(self, rows: slice | None, a: torch.Tensor, b: torch.Tensor, beta: float,
                     alpha: float) -> None:
        """Eq. (6) on the stored triangles of ``rows`` (None: all): ``L <- beta L +
        alpha A B`` with ``A B = G_(k) G_(k)^T`` (``a`` ``[b, n, c]``, ``b = a^T`` ``[b, c, n]``).

        Three GEMMs, 3/4 of the whole product's FLOPs (as
        :func:`~shampoo_torch.blocks.gram_update_`), nothing ``[n, n]`` formed:
        ``A21 <- beta A21 + alpha P21`` in place, and the diagonal blocks'
        products ``P11`` and ``P22`` added into Y, whose two triangles tile it:
        Y is scaled by ``beta`` once, then each product is added with its other
        triangle zeroed (``tril_`` / ``triu_``; adding 0 leaves an entry as it
        was), every entry ``beta L_ij + alpha P_ij`` as the whole update forms
        it. Y holds A22's lower triangle transposed, its upper one, so P22's
        upper triangle is added where it lies: ``P_rc`` for ``P_cr``, the same
        products summed perhaps in another order (spec section 5). No masked
        select and no transposed read: each costs several passes of a copy.
        """
        data = self._rows(rows)
        h, m = self.h, self.m
        a21, y = self._pieces(data)
        a, b = gemm.gram_operands(a, b)
        gemm.baddbmm_(a21, a[:, h:], b[..., :h], beta, alpha)
        p11 = gemm.bmm(a[:, :h], b[..., :h]).tril_()
        p22 = gemm.bmm(a[:, h:], b[..., h:]).triu_()
        if beta == 0.0:  # as BLAS: the old value is not read
            y.zero_()
        elif beta != 1.0:
            y.mul_(beta)
        y[:, 1:, :h].add_(p11, alpha=alpha)
        y[:, :m, :].add_(p22, alpha=alpha)

    def rank1_update_(self, rows: slice | None, g: torch.Tensor, beta: float | None,
                      weight: float) -> None:
        """Eq. (6) for a 1-d block on the stored triangles of ``rows`` (None: all):
        ``L <- beta L + w g g^T`` (``beta`` None: no decay), entry by entry as the
        whole update (``beta L_ij``, then ``+ g_i g_j``, or ``+ w (g_i g_j)``),
        ``g`` ``[b, n]``. The products of Y's two triangles come from two outer
        products of halves of g, one masked choice between them.
        """
        data = self._rows(rows)
        h, m = self.h, self.m
        a21, y = self._pieces(data)
        lo, hi = g[:, :h], g[:, h:]
        o21 = hi[:, :, None] * lo[:, None, :]
        # Y[r, c] = g[h + r] g[h + c] (r <= c < m), Y[i + 1, j] = g[i] g[j] (j <= i < h).
        pad = (0, h + 1 - m)
        upper = torch.nn.functional.pad(hi, pad)[:, :, None] * hi[:, None, :]
        lower = torch.nn.functional.pad(lo, (1, 0))[:, :, None] \
            * torch.nn.functional.pad(lo, (0, m - h))[:, None, :]
        # The triangles tile Y: each outer product with the other one zeroed, summed
        # (adding 0 is exact), as a masked select would choose but in one cheap pass.
        oy = upper.triu_().add_(lower.tril_(-1))
        if weight != 1.0:
            o21, oy = weight * o21, weight * oy
        for stored, outer in ((a21, o21), (y, oy)):
            (stored.mul_(beta) if beta is not None else stored).add_(outer)

    def matvec(self, rows: torch.Tensor | slice | None, v: torch.Tensor) -> torch.Tensor:
        """``X v`` for each matrix of ``rows`` (None: all) and vector of ``v`` ``[b, n]``
        (eq. 16 for a 1-d block), read from the stored triangle without unpacking.

        With ``X = [[A11, A21^T], [A21, A22]]`` and ``v = (v1, v2)``: the top is
        ``A11 v1 + A21^T v2``, the bottom ``A21 v1 + A22 v2``, and a diagonal
        block as ``S v + S^T v + d * v`` from its strict triangle ``S`` (copied out
        of Y, half the block) and its diagonal ``d``: each entry the dot product
        of X's row with v, its terms summed in another order (spec section 5).
        A product of X reads each stored entry twice, where unpacking first
        would write and read all ``n^2``: the matrix-vector product is bound by
        memory, not arithmetic.
        """
        data = self._rows(rows)
        h, m = self.h, self.m
        a21, y = self._pieces(data)
        y11, y22 = y[:, 1:, :h], y[:, :m, :]
        v1, v2 = v[:, None, :h], v[:, None, h:]  # rows: X w = (w^T X^T)^T

        def diagonal_block(stored: torch.Tensor, strict: torch.Tensor,
                           w: torch.Tensor) -> torch.Tensor:
            return (torch.bmm(w, strict.mT) + torch.bmm(w, strict)
                    + w * stored.diagonal(dim1=1, dim2=2)[:, None, :])

        top = diagonal_block(y11, torch.tril(y11, -1), v1) + torch.bmm(v2, a21)
        bottom = torch.bmm(v1, a21.mT) + diagonal_block(y22, torch.triu(y22, 1), v2)
        return torch.cat((top, bottom), dim=2)[:, 0]

    def row(self, row: int) -> torch.Tensor:
        """One full matrix, a new ``[n, n]`` tensor."""
        return self.unpack(slice(row, row + 1))[0]
