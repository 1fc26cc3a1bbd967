"""The batched matrix products of eqs. (6) and (16): ``bmm`` and ``baddbmm_``, on CPU through
oneDNN where that is faster.

torch's CPU ``bmm`` calls the BLAS it was built with (MKL in the CPU
wheels), whose float32 GEMM runs its generic code on non-Intel CPUs:
measured on this project's 2-core AMD EPYC (AVX-512), a 1024 x 1024
product at 190-213 GFLOP/s, against 430-470 GFLOP/s from oneDNN, which
torch also ships (``torch.ops.mkldnn._linear_pointwise``, the float32
linear that Inductor calls) and which picks its kernels by the CPU's
instruction set. So a float32 product whose three dims are all at least
:data:`ONEDNN_MIN` is computed on CPU one matrix per oneDNN call; everything
else (float64, bfloat16, CUDA, small matrices, a torch without the op) stays
with ``torch.bmm`` / ``baddbmm``.

Numerics: both are IEEE float32 GEMMs (``_linear_pointwise`` ignores
torch's reduced-precision matmul settings, which only ``mm`` reads), so
each entry is a float32 dot product of the same terms with its partial
sums in another order; the rounding bounds of docs/spec.md section 5 do
not depend on the order. Each matrix is its own call, so a block's
product does not depend on the other blocks of its batch
(:mod:`.invariance`; ``torch_impl/tests/test_gemm.py``).

One layout is slow: oneDNN computes ``x @ w^T``, and a ``w`` whose rows
are strided apart (a column slice of a wider matrix) measured at 0.2
GFLOP/s, so such an operand is swapped to the other side (``(B^T A^T)^T``)
or copied. :func:`copy_` and :func:`contiguous` copy large stacks one matrix
at a time, which torch does faster than one 3-d copy of a transposed view.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .device_path import on_cpu_path

#: Smallest dim (rows, inner, columns) for which a float32 CPU product goes through
#: oneDNN: measured at 2 threads, 256^3 328 against 199 GFLOP/s (MKL), 128^3 133
#: against 127, where per-call overhead would also count for many small blocks.
ONEDNN_MIN = 256

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@functools.cache
def _onednn() -> Linear | None:
    """``(x, w) -> x @ w^T`` by oneDNN, or None where this torch lacks it."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        op = torch.ops.mkldnn._linear_pointwise
        probe = torch.eye(2)
        if not torch.equal(op(probe, probe, None, "none", [], ""), probe):
            return None
    except (AttributeError, RuntimeError):
        return None
    return lambda x, w: op(x, w, None, "none", [], "")


def uses_onednn(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a @ b`` (``[.., m, k] @ [.., k, n]``) goes through oneDNN (module doc)."""
    return (on_cpu_path(a.device) and a.dtype == torch.float32 and b.dtype == torch.float32
            and min(a.shape[-2], a.shape[-1], b.shape[-1]) >= ONEDNN_MIN
            and _onednn() is not None)


def _dense(x: torch.Tensor) -> bool:
    """Row-major or column-major without gaps: the weight layouts oneDNN runs fast."""
    return x.is_contiguous() or x.mT.is_contiguous()


def _unit_stride(x: torch.Tensor) -> bool:
    return x.stride(-1) == 1 or x.stride(-2) == 1


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for two matrices by oneDNN (a new tensor, perhaps a transposed view)."""
    linear = _onednn()
    assert linear is not None
    if _dense(b) and _unit_stride(a):
        return linear(a, b.mT)
    if _dense(a) and _unit_stride(b):
        return linear(b.mT, a).mT  # (B^T A^T)^T
    return linear(a if _unit_stride(a) else a.contiguous(), b.mT.contiguous())


def _per_matrix(x: torch.Tensor) -> bool:
    """Whether a CPU stack ``[B, r, c]`` is copied one matrix at a time: matrices of at
    least ``ONEDNN_MIN^2`` entries (for small ones a call per matrix would cost more
    than the copy)."""
    return on_cpu_path(x.device) and x.dim() == 3 and x.shape[1] * x.shape[2] >= ONEDNN_MIN**2


def copy_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` for stacks ``[B, r, c]``, large matrices one at a time on CPU:
    torch copies a transposed 3-d view several times slower than its 2-d
    matrices (1024 x 1024: 1.9 against 0.44 ms measured)."""
    if not _per_matrix(src):
        return dst.copy_(src)
    for i in range(src.shape[0]):
        dst[i].copy_(src[i])
    return dst


def contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x.contiguous()`` for a stack ``[B, r, c]``, by :func:`copy_`."""
    if x.is_contiguous():
        return x
    if not _per_matrix(x):
        return x.contiguous()
    return copy_(torch.empty(x.shape, dtype=x.dtype, device=x.device), x)


def gram_operands(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The operands of ``A B = G_(k) G_(k)^T`` (``b = a^T``) for products of their row and
    column slices: with ``a`` a transposed view (k the last block dim) the column
    slices of ``b`` would be oneDNN weights with strided rows, each copied by
    :func:`_product`; one transposed copy of ``a`` serves them all."""
    if uses_onednn(a, b) and not a.is_contiguous():
        a = contiguous(a)
        return a, a.mT
    return a, b


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)``: ``[B, m, k] @ [B, k, n]``, a new contiguous ``[B, m, n]``."""
    if not uses_onednn(a, b):
        return torch.bmm(a, b)
    if a.shape[0] == 1:
        return _product(a[0], b[0]).contiguous().unsqueeze(0)
    out = torch.empty((a.shape[0], a.shape[1], b.shape[2]), dtype=a.dtype, device=a.device)
    for i in range(a.shape[0]):
        out[i].copy_(_product(a[i], b[i]))
    return out


def baddbmm_(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float,
             alpha: float) -> torch.Tensor:
    """``c.baddbmm_(a, b, beta=beta, alpha=alpha)``: ``c <- beta c + alpha a b`` in place.

    Through oneDNN the product is formed whole and then added (``beta c``,
    then ``+ alpha P``); ``beta = 0`` ignores ``c``, as BLAS does.
    """
    if not uses_onednn(a, b):
        return c.baddbmm_(a, b, beta=beta, alpha=alpha)
    for i in range(c.shape[0]):
        p = _product(a[i], b[i])
        if beta == 0.0:
            torch.mul(p, alpha, out=c[i])
        else:
            (c[i].mul_(beta) if beta != 1.0 else c[i]).add_(p, alpha=alpha)
    return c
