"""Bounded workspaces: a block group's statistics (eq. 6), directions (eqs. 16-18)
and inverse roots (eqs. 9-13) go in chunks of rows (blocks.row_chunks). Every row
is its own problem, so any chunking gives the same bits as none."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shampoo_conformance.adapters.torch import run as torch_run
from shampoo_spec import (
    BlockingConfig,
    EigenvalueCorrectionConfig,
    EpsilonConfig,
    GraftingConfig,
    ScheduleConfig,
    ShampooConfig,
)
from shampoo_torch import blocks
from shampoo_torch.blocks import row_chunks


@pytest.mark.parametrize("rows", [None, torch.tensor([7, 1, 4, 2, 9])])
@pytest.mark.parametrize(("row_bytes", "budget", "sizes"), [
    (100, 250, [2, 2, 1]),  # two rows fit the budget
    (100, 50, [1, 1, 1, 1, 1]),  # a row over the budget still goes, alone
    (100, 10_000, [5]),  # one chunk: the rows themselves
])
def test_row_chunks_cover_the_rows_in_order(
    rows: torch.Tensor | None, row_bytes: int, budget: int, sizes: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(blocks, "WORKSPACE_BYTES", budget)
    monkeypatch.setattr(blocks, "ACCELERATOR_WORKSPACE_BYTES", budget)  # either path
    chunks = list(row_chunks(rows, 5, row_bytes, torch.device("cpu")))
    assert [c.stop - c.start for c, _ in chunks] == sizes
    assert [c.start for c, _ in chunks] == [sum(sizes[:i]) for i in range(len(sizes))]
    every = torch.arange(5) if rows is None else rows
    for part, part_rows in chunks:
        if len(chunks) == 1:
            assert part_rows is rows  # no copy of the index, None stays None
        elif rows is None:
            assert part_rows == part  # a run of all rows: take() gives views
        else:
            assert isinstance(part_rows, torch.Tensor) and torch.equal(part_rows, every[part])


CONFIGS = {
    "block_graft": ShampooConfig(
        learning_rate=0.1,
        blocking=BlockingConfig(max_preconditioner_dim=4),
        epsilon=EpsilonConfig(value=1e-3),
        schedule=ScheduleConfig(precondition_frequency=2),
        grafting=GraftingConfig(type="adagrad", norm_scope="block"),
    ),
    "eigenvalue_corrected": ShampooConfig(
        learning_rate=0.1,
        blocking=BlockingConfig(max_preconditioner_dim=4),
        epsilon=EpsilonConfig(value=1e-3),
        schedule=ScheduleConfig(precondition_frequency=2),
        eigenvalue_correction=EigenvalueCorrectionConfig(beta2=0.9),
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_directions_one_row_at_a_time_equal_one_whole_group(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A (12, 10) parameter in blocks of 4 (groups of 6 rows of 4 x 4 and 3 of 4 x 2)
    and a (12,) one (3 rows of 4): 6 float32 steps, roots every 2, bit for bit."""
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((12, 10)), "b": rng.standard_normal(12)}
    grads = [{k: rng.standard_normal(v.shape) for k, v in params.items()} for _ in range(6)]
    whole = torch_run(CONFIGS[name], params, grads, dtype=np.float32)
    monkeypatch.setattr(blocks, "WORKSPACE_BYTES", 1)  # one row per chunk
    monkeypatch.setattr(blocks, "ACCELERATOR_WORKSPACE_BYTES", 1)  # on either path
    chunked = torch_run(CONFIGS[name], params, grads, dtype=np.float32)
    moved = False
    for a, b in zip(whole, chunked, strict=True):
        for k in params:
            np.testing.assert_array_equal(a[k], b[k])
            moved = moved or not np.array_equal(a[k], params[k])
    assert moved
