"""The products of eqs. (6) and (16) through oneDNN (``shampoo_torch.gemm``): float32 GEMMs
within the GEMM rounding bound of the float64 product, each matrix independent
of its batch, and the optimizer as close to the reference as with torch's own
``bmm``."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from shampoo_conformance.adapters.torch import run as torch_run
from shampoo_reference import run as reference_run
from shampoo_spec import BlockingConfig, EpsilonConfig, ScheduleConfig, ShampooConfig
from shampoo_torch import gemm
from shampoo_torch.blocks import SYMMETRIC_GRAM_MIN, contraction_operands
from shampoo_torch.packed import SymmetricStack

N = gemm.ONEDNN_MIN
ONEDNN = torch.backends.mkldnn.is_available()

Layout = Callable[[torch.Tensor], torch.Tensor]
# Each makes a [B, r, c] operand with the values of ``x`` in another memory layout.
LAYOUTS: dict[str, Layout] = {
    "row-major": lambda x: x.contiguous(),
    "column-major": lambda x: x.mT.contiguous().mT,
    # A column slice of a wider matrix: rows strided apart (oneDNN's slow weight
    # layout, which gemm swaps or copies).
    "column slice": lambda x: torch.cat([x, torch.zeros_like(x[..., :7])], -1)[..., :x.shape[-1]],
    "row slice of column-major": lambda x: torch.cat(
        [x, torch.zeros_like(x[:, :5])], 1).mT.contiguous().mT[:, :x.shape[1]],
}


def _bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per entry, a float32 dot product of K terms: ``|error| <= K u sum_k |a_ik b_kj|``
    (each product and each partial sum rounded once; K + 2 for margin)."""
    unit = torch.finfo(torch.float32).eps / 2
    return (a.shape[-1] + 2) * unit * (a.double().abs() @ b.double().abs())


@pytest.mark.cpu_path  # oneDNN and packed factors: CPU path only
def test_large_float32_products_go_through_onednn() -> None:
    a, b = torch.ones(1, N, N), torch.ones(1, N, N)
    assert gemm.uses_onednn(a, b) == ONEDNN
    assert not gemm.uses_onednn(a[:, :, : N - 1], b[:, : N - 1])  # a dim below the minimum
    assert not gemm.uses_onednn(a.double(), b.double())


@pytest.mark.parametrize("layout_b", LAYOUTS)
@pytest.mark.parametrize("layout_a", LAYOUTS)
def test_bmm_is_the_product_within_the_gemm_bound(layout_a: str, layout_b: str) -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2, N + 3, N + 1, generator=gen)
    b = torch.randn(2, N + 1, N + 2, generator=gen)
    out = gemm.bmm(LAYOUTS[layout_a](a), LAYOUTS[layout_b](b))
    assert out.shape == (2, N + 3, N + 2) and out.is_contiguous()
    exact = a.double() @ b.double()
    assert bool(((out.double() - exact).abs() <= _bound(a, b)).all())


@pytest.mark.parametrize(("beta", "alpha"), [(0.9, 0.1), (1.0, 1.0), (0.0, 0.5)])
@pytest.mark.parametrize("layout_a", ["row-major", "column-major", "column slice"])
def test_baddbmm_is_the_closed_form(beta: float, alpha: float, layout_a: str) -> None:
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(2, N, N + 5, generator=gen)
    a, b = LAYOUTS[layout_a](g), g.mT
    c = torch.randn(2, N, N, generator=gen)
    if beta == 0.0:
        c[0, 0, 0] = float("nan")  # ignored, as BLAS ignores C with beta = 0
    start = c.clone()
    out = gemm.baddbmm_(c, a, b, beta, alpha)
    assert out is c
    kept = torch.zeros_like(start.double()) if beta == 0.0 else beta * start.double()
    exact = kept + alpha * (g.double() @ g.double().mT)
    unit = torch.finfo(torch.float32).eps / 2
    # The product's bound scaled by alpha, then the two roundings of the sum.
    bound = alpha * _bound(g, g.mT) + 4 * unit * (kept.abs() + alpha * (g.double().abs() @
                                                                        g.double().abs().mT))
    assert bool(((c.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("threads", [1, 2])
def test_each_matrix_is_independent_of_its_batch(threads: int) -> None:
    """:mod:`shampoo_torch.invariance`: one oneDNN call per matrix, so row i of a batched
    product is bit for bit that row's product alone (as the distributed optimizer
    and the block groups need)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(2)
        a, b = torch.randn(3, N, N + 4, generator=gen), torch.randn(3, N + 4, N, generator=gen)
        whole = gemm.bmm(a, b)
        c = torch.randn(3, N, N, generator=gen)
        c_whole = gemm.baddbmm_(c.clone(), a, a.mT, 0.9, 0.1)
        for i in range(3):
            assert torch.equal(whole[i:i + 1], gemm.bmm(a[i:i + 1], b[i:i + 1]))
            assert torch.equal(c_whole[i:i + 1],
                               gemm.baddbmm_(c[i:i + 1].clone(), a[i:i + 1], a[i:i + 1].mT,
                                             0.9, 0.1))
    finally:
        torch.set_num_threads(before)


def _run(config: ShampooConfig, params: dict[str, np.ndarray],
         grads: list[dict[str, np.ndarray]]) -> np.ndarray:
    return np.asarray(torch_run(config, params, grads, dtype=np.float32)[-1]["w"], np.float64)


@pytest.mark.cpu_path  # oneDNN and packed factors: CPU path only
@pytest.mark.parametrize("rows", [N, 2 * N])
def test_the_optimizer_is_as_close_to_the_reference_as_with_torch_bmm(
    rows: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A (rows, N + 8) float32 parameter (both factors and every product through
    oneDNN), 6 steps: its displacement from the reference's is within twice that of
    the same run with oneDNN off (torch's bmm), and small (float32 rounding, spec
    section 5). With 2N rows the left factor, below SYMMETRIC_GRAM_MIN, is updated on
    its stored triangle, its halves' products through oneDNN."""
    rng = np.random.default_rng(0)
    shape = (rows, N + 8)
    params = {"w": rng.standard_normal(shape)}
    grads = [{"w": rng.standard_normal(shape)} for _ in range(6)]
    on_triangle = []
    direct = SymmetricStack.gram_update_
    monkeypatch.setattr(SymmetricStack, "gram_update_", lambda self, *a: (
        on_triangle.append(self.n), direct(self, *a))[1])
    config = ShampooConfig(
        learning_rate=0.1,
        blocking=BlockingConfig(max_preconditioner_dim=max(shape)),
        epsilon=EpsilonConfig(value=1e-1),
        schedule=ScheduleConfig(precondition_frequency=2),
    )
    ref = np.asarray(reference_run(config, params, grads)[-1]["w"])
    start = params["w"]
    scale = np.abs(ref - start).max()
    onednn = np.abs(_run(config, params, grads) - ref).max() / scale
    assert set(on_triangle) == ({2 * N} if rows == 2 * N and ONEDNN else set())
    monkeypatch.setattr(gemm, "ONEDNN_MIN", 10**9)
    blas = np.abs(_run(config, params, grads) - ref).max() / scale
    assert onednn <= max(2 * blas, 1e-6), (onednn, blas)
    assert onednn < 1e-3


@pytest.mark.parametrize("shape", [(3, N, N + 1), (5, 4, 3)])  # per matrix; one call
def test_stack_copies_are_exact(shape: tuple[int, int, int]) -> None:
    x = torch.randn(shape)
    for view in (x, x.mT, x[:, 1:, 2:], x.mT[:, :, :2]):
        out = gemm.contiguous(view)
        assert out.is_contiguous() and torch.equal(out, view)
        dst = torch.empty(view.shape)
        assert gemm.copy_(dst, view) is dst and torch.equal(dst, view)


@pytest.mark.cpu_path  # oneDNN and packed factors: CPU path only
@pytest.mark.parametrize("k", [0, 1])
def test_packed_triangle_update_is_the_closed_form(k: int) -> None:
    """Eq. (6) on a packed factor of SYMMETRIC_GRAM_MIN rows through oneDNN, from both
    layouts of G_(k) (k = 1, the last block dim: a transposed view, copied once)."""
    gen = torch.Generator().manual_seed(3)
    n = SYMMETRIC_GRAM_MIN
    shape = (2, n, N + 44) if k == 0 else (2, N + 44, n)
    g = torch.randn(shape, generator=gen)
    a, b = contraction_operands(g, k)
    assert gemm.uses_onednn(a, b) == ONEDNN and a.is_contiguous() == (k == 0)
    start = torch.randn(2, n, n, generator=gen, dtype=torch.float64)
    start = (start @ start.mT).float()
    stack = SymmetricStack.from_full(start)
    stack.gram_update_(None, a, b, 0.9, 0.1)
    gk = g.double().movedim(k + 1, 1).flatten(2)
    exact = 0.9 * start.double() + 0.1 * (gk @ gk.mT)
    unit = torch.finfo(torch.float32).eps / 2
    bound = (0.1 * _bound(gk.float(), gk.mT.float())
             + 4 * unit * (0.9 * start.double().abs() + 0.1 * (gk.abs() @ gk.abs().mT)))
    assert bool(((stack.unpack().double() - exact).abs() <= bound).all())
