"""A block's result does not depend on which other blocks share its block group.

The distributed optimizer batches only the blocks a rank owns, so its
block groups differ from the single-process ones; bit-for-bit equality between
the two rests on this property (``shampoo_torch.invariance``). Checked in one
process: a parameter stepped alone (a block group of one row) against the same
parameter stepped with siblings of its block shape (several rows), with one
thread as in the distributed tests. Blocks are large enough (n * n * K >=
400) that torch's CPU kernels take their optimized, batch-size-dependent
paths rather than the naive loops.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shampoo_spec import (
    BlockingConfig,
    CoupledNewtonConfig,
    EigenvalueCorrectionConfig,
    EighConfig,
    EpsilonConfig,
    ExponentConfig,
    FrequentDirectionsConfig,
    GraftingConfig,
    LowRankRootConfig,
    ScheduleConfig,
    ShampooConfig,
    StatisticsConfig,
)
from shampoo_torch import Shampoo
from shampoo_torch.blocks import mode_product, mode_product_in

BASE = ShampooConfig(
    learning_rate=0.05,
    grafting=GraftingConfig(type="adagrad"),
    blocking=BlockingConfig(max_preconditioner_dim=32, merge_dims_up_to=None),
    schedule=ScheduleConfig(precondition_frequency=2, start_preconditioning_step=2),
)
CONFIGS = {
    "adagrad_sum": BASE,
    "ema_bias_corrected": dataclasses.replace(
        BASE, statistics=StatisticsConfig(beta2=0.9, bias_correction=True),
        exponents=ExponentConfig(override=6.0)),
    "eigenvalue_correction_root3": dataclasses.replace(
        BASE, eigenvalue_correction=EigenvalueCorrectionConfig(root=3.0, beta2=0.9)),
    # Eq. (17a): rotations in bfloat16, D's operations in float16.
    "eigenvalue_correction_stored_dtypes": dataclasses.replace(
        BASE, eigenvalue_correction=EigenvalueCorrectionConfig(
            beta2=0.9, epsilon=1e-4, eigenvectors_dtype="bfloat16",
            corrected_eigenvalues_dtype="float16")),
    "coupled_newton_relative_eps": dataclasses.replace(
        BASE, root_inverse=CoupledNewtonConfig(),
        epsilon=EpsilonConfig(value=1e-3, scale="relative")),
    # Eq. (10h): each row keeps its stored eigenbasis or takes eigh's by its own B.
    "eigh_basis_reuse": dataclasses.replace(BASE, root_inverse=EighConfig(
        basis_reuse_tolerance=0.3)),
    # Eq. (10c): the factors above 6 low-rank (the mean over a row's other eigenvalues).
    "low_rank": dataclasses.replace(BASE, low_rank=LowRankRootConfig(rank=4)),
    # Eqs. (6c), (10d): the factors above 6 sketched at rank 4 (relative eps, from the
    # sketches' largest values), the gradients averaged over the period of 2, the
    # sketches emptied at the root step 4.
    "frequent_directions": dataclasses.replace(
        BASE, frequent_directions=FrequentDirectionsConfig(rank=4, average_gradients=True,
                                                           reset_every=3),
        statistics=StatisticsConfig(beta2=0.95), epsilon=EpsilonConfig(scale="relative"),
        schedule=ScheduleConfig(precondition_frequency=2, statistics_frequency=2,
                                start_preconditioning_step=2)),
}
SHAPES = [(40,), (24, 30), (3, 8, 10)]


@pytest.fixture
def one_thread():  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.usefixtures("one_thread")
def test_block_result_independent_of_block_group(name: str, shape: tuple[int, ...]) -> None:
    config = CONFIGS[name]
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(shape, generator=gen) for _ in range(3)]
    grads = [[torch.randn(shape, generator=gen) for _ in range(3)] for _ in range(5)]
    crowd = [torch.nn.Parameter(x.clone()) for x in init]
    alone = torch.nn.Parameter(init[1].clone())
    opt_crowd, opt_alone = Shampoo(crowd, config), Shampoo([alone], config)
    assert len(opt_crowd._plans[0].block_groups[0]) == 3
    assert len(opt_alone._plans[0].block_groups[0]) == 1
    for step in grads:
        for p, g in zip(crowd, step, strict=True):
            p.grad = g
        alone.grad = step[1]
        opt_crowd.step()
        opt_alone.step()
    assert torch.equal(alone, crowd[1]), float((alone - crowd[1]).abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.usefixtures("one_thread")
def test_narrow_products_are_batch_invariant(dtype: torch.dtype) -> None:
    """Eqs. (16), (17a): a product in bfloat16/float16 (``mode_product_in``) is a float32
    GEMM rounded once, so a block's result is the same in any batch; torch's batched
    bfloat16 ``bmm`` is not (it rounded 3 of 460,800 entries otherwise here), and each
    block's result equals the exact product rounded once in all but a few entries."""
    gen = torch.Generator().manual_seed(0)
    differ = inexact = total = 0
    for _ in range(50):
        x = torch.randn(18, 8, 8, generator=gen, dtype=torch.float64).to(dtype)
        q = torch.linalg.qr(torch.randn(18, 8, 8, generator=gen, dtype=torch.float64))[0]
        q = q.to(dtype)
        for k in (0, 1):
            for transpose in (True, False):
                full = mode_product_in(x, q, k, dtype, transpose)
                one = torch.cat([mode_product_in(x[i:i + 1], q[i:i + 1], k, dtype, transpose)
                                 for i in range(18)])
                exact = mode_product(x.double(), q.double(), k, transpose).float().to(dtype)
                differ += int((full != one).sum())
                inexact += int((full != exact).sum())
                total += full.numel()
    assert differ == 0
    # A float32 sum of 8 exact products is within 8 u32 of the exact one: it rounds
    # otherwise only that close to a rounding boundary of s, 8 u32 / u_s per entry.
    u_s = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    assert inexact <= total * 2 * 8 * 2.0**-24 / u_s, (inexact, total)
