"""Batch invariance: a block's result must not depend on the other blocks in its batch.

The optimizer stacks equal-shape blocks into block groups (:mod:`shampoo_torch.blocks`)
and the distributed optimizer stacks only the blocks a rank owns, so the same
block sits at different batch positions in the two. Matmuls (``bmm``,
``baddbmm``), ``eigh`` and row reductions compute each batch row alone
(checked bit for bit with one thread per process). Elementwise CPU kernels
do not quite: they run vectorized over all but the tail of a call and the
tail in scalar code, and for ``pow`` (a non-special exponent) the two differ
in the last bit. :func:`rowwise` computes such a function one row per call
on CPU, so every block goes through the same code whatever its position.
On CUDA every element runs the same device code; there it is one call.

Two more traps, found by ``torch_impl/tests/test_distributed_invariance.py``
and handled in :mod:`shampoo_torch.preconditioner`: CPU ``baddbmm`` fuses a rank-1 update (the
statistics of a 1-d block) differently for one batch row than for several,
so that update is done elementwise; and ``bmm`` picks its kernel by the
operands' memory layout, and ``eigh`` returns column-major eigenvectors, so
stored inverse roots and eigenbases are made row-major. On CUDA, cuBLAS may choose
kernels by batch count, so bit-for-bit equality is only claimed (and
tested) on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

Out = TypeVar("Out", torch.Tensor, tuple[torch.Tensor, ...])


def rowwise(fn: Callable[[torch.Tensor], Out], x: torch.Tensor) -> Out:
    """``fn(x)``, with each row ``x[j:j+1]`` in its own call on CPU (outputs concatenated).

    ``fn`` maps a stack ``[B, ...]`` to a tensor or a tuple of tensors with
    leading dim B, and must treat rows independently.
    """
    # A property of the CPU's kernels, not a choice of path (device_path): the
    # accelerator path forced on a CPU runs these same kernels.
    if x.device.type != "cpu" or x.shape[0] <= 1:
        return fn(x)
    parts = [fn(x[j:j + 1]) for j in range(x.shape[0])]
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return tuple(torch.cat(col) for col in zip(*parts, strict=True))
