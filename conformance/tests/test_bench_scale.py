"""The scale benchmark's bookkeeping (bench_scale): its amortization, its block plans,
and one child run's state against the closed form of what Shampoo must hold."""

from __future__ import annotations

import pytest

from shampoo_conformance.bench import scale as bs

torch = pytest.importorskip("torch")


def test_amortized_step_is_the_mean_over_one_period_with_one_root() -> None:
    period = [2.5] + [0.5] * (bs.AMORTIZE - 1)
    assert bs.amortized(2.5, 0.5) == pytest.approx(sum(period) / len(period), rel=1e-15)


def test_the_timed_run_has_roots_at_period_multiples_only() -> None:
    from shampoo_spec import from_meta, is_root_step

    schedule = from_meta(bs.meta_kwargs(256)).schedule
    roots = [t for t in range(1, bs.STEPS + 1) if is_root_step(t, schedule)]
    assert roots == [bs.PERIOD, 2 * bs.PERIOD]  # so steps 5-7 and 9-11 time no root


def _matrix_and_graft_bytes(width: int, block: int) -> tuple[int, int, int]:
    """Closed form: a factor and an inverse root of n x n float32 per preconditioned
    dim of every block (eqs. 6 and 10), each stored as one triangle of n (n + 1) / 2
    entries (``shampoo_torch.packed``), one AdaGrad accumulator per parameter entry;
    and the number of blocks."""
    from shampoo_spec import from_meta, plan_parameter
    from shampoo_torch.packed import PACKED_MIN, packed_size

    config = from_meta(bs.meta_kwargs(block))
    matrices = graft = blocks = 0
    for p in bs.make_model(width).parameters():
        graft += 4 * p.numel()
        plan = plan_parameter(tuple(p.shape), config)
        if plan.preconditioned:
            blocks += len(plan.blocks)
            for b in plan.blocks:
                matrices += sum(2 * 4 * (packed_size(n) if n >= PACKED_MIN else n * n)
                                for n, r in zip(b.shape, b.roots, strict=True) if r)
    return matrices, graft, blocks


@pytest.mark.parametrize(("width", "block"), [(48, 32), (64, 128)])
def test_ours_holds_its_matrices_and_graft_and_no_full_size_temporary(
    width: int, block: int
) -> None:
    run = bs.run_one(width, block, "ours", threads=1)
    matrices, graft, blocks = _matrix_and_graft_bytes(width, block)
    # Beyond them only the block bookkeeping: int64 row indices (one per parameter
    # row and column) and per-block counters (64 bytes a block bound them), less
    # than the largest weight, so no copy of a parameter or gradient outlives a step.
    model = bs.make_model(width)
    index = 8 * sum(sum(p.shape) for p in model.parameters())
    assert matrices + graft <= run.state_bytes <= matrices + graft + index + 64 * blocks
    assert max(4 * p.numel() for p in model.parameters()) > index + 64 * blocks
    assert run.opt_other > 0 and run.step_root >= run.opt_root > 0
