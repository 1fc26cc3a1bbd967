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
    EpsilonConfig,
    ExponentConfig,
    GraftingConfig,
    ScheduleConfig,
    ShampooConfig,
    StatisticsConfig,
)
from shampoo_torch import Shampoo

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
