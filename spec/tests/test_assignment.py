"""Block-to-rank assignment: every block once, LPT balance, determinism, empty ranks."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shampoo_spec import (
    ROOT_FLOPS_PER_CUBE,
    BlockingConfig,
    ScheduleConfig,
    ShampooConfig,
    assign_blocks,
    block_cost,
    plan_block_costs,
    plan_parameter,
)

costs_lists = st.lists(st.floats(min_value=0.0, max_value=1e6, allow_nan=False), max_size=40)


@settings(max_examples=60, deadline=None)
@given(costs=costs_lists, world=st.integers(1, 6))
def test_every_block_once_and_loads_sum(costs: list[float], world: int) -> None:
    a = assign_blocks(costs, world)
    assert len(a.owners) == len(costs)
    assert all(0 <= r < world for r in a.owners)
    assert sorted(i for r in range(world) for i in a.blocks_of(r)) == list(range(len(costs)))
    for r in range(world):
        assert math.isclose(a.loads[r][0], sum(costs[i] for i in a.blocks_of(r)), abs_tol=1e-6)
    # List-scheduling bound: makespan <= average load + largest block.
    biggest = max(costs, default=0.0)
    assert max(v[0] for v in a.loads) <= sum(costs) / world + biggest + 1e-6


@settings(max_examples=60, deadline=None)
@given(
    costs=st.lists(st.tuples(*[st.floats(0.0, 1e6, allow_nan=False)] * 3), max_size=30),
    world=st.integers(1, 5),
)
def test_vector_loads_bound(costs: list[tuple[float, float, float]], world: int) -> None:
    """Every normalized load of every rank <= d/m + the largest normalized load of a block."""
    a = assign_blocks(costs, world)
    assert sorted(i for r in range(world) for i in a.blocks_of(r)) == list(range(len(costs)))
    for k in range(3):
        total = sum(c[k] for c in costs)
        if total == 0.0:
            continue
        biggest = max(c[k] for c in costs) / total
        for r in range(world):
            assert a.loads[r][k] / total <= 3 / world + biggest + 1e-9


@settings(max_examples=40, deadline=None)
@given(costs=st.lists(st.integers(0, 50), min_size=1, max_size=7), world=st.integers(2, 3))
def test_lpt_within_graham_bound_of_the_optimum(costs: list[int], world: int) -> None:
    """Makespan <= (4/3 - 1/(3m)) OPT, OPT by exhaustive search over all assignments."""
    a = assign_blocks(costs, world)
    best = min(
        max(sum(c for c, r in zip(costs, owners, strict=True) if r == k) for k in range(world))
        for owners in itertools.product(range(world), repeat=len(costs))
    )
    assert max(v[0] for v in a.loads) <= (4 / 3 - 1 / (3 * world)) * best + 1e-9


def _assign_by_scan(costs: list[tuple[float, ...]], world: int) -> tuple[int, ...]:
    """The module doc's rule read literally: every block scans every rank (O(blocks x ranks))."""
    totals = [sum(c[k] for c in costs) for k in range(len(costs[0]))]
    scale = [1.0 / t if t > 0.0 else 0.0 for t in totals]

    def normalized(v: tuple[float, ...] | list[float]) -> list[float]:
        return [x * s for x, s in zip(v, scale, strict=True)]

    loads = [[0.0] * len(totals) for _ in range(world)]
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda j: (-sum(normalized(costs[j])), j)):
        def after(r: int, c: tuple[float, ...] = costs[i]) -> tuple[float, float, int]:
            new = normalized([a + b for a, b in zip(loads[r], c, strict=True)])
            return (max(new), sum(new), r)

        rank = min(range(world), key=after)
        owners[i] = rank
        loads[rank] = [a + b for a, b in zip(loads[rank], costs[i], strict=True)]
    return tuple(owners)


repeated_vectors = st.lists(
    st.sampled_from([(0.0, 0.0, 0.0), (1.0, 2.0, 3.0), (3.0, 2.0, 1.0), (2.0, 2.0, 2.0),
                     (1e6, 1.0, 7e-3), (0.5, 0.0, 0.5)]),
    min_size=1, max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    costs=repeated_vectors | st.lists(st.tuples(*[st.floats(0.0, 1e9, allow_nan=False)] * 3),
                                      min_size=1, max_size=40),
    world=st.integers(1, 9),
)
def test_heap_gives_the_owners_of_the_literal_scan(
    costs: list[tuple[float, float, float]], world: int
) -> None:
    """assign_blocks's heap (runs of equal blocks) = scanning every rank for every block."""
    assert assign_blocks(costs, world).owners == _assign_by_scan(costs, world)


def test_heap_gives_the_owners_of_the_literal_scan_on_llama_shapes() -> None:
    """Llama-2-7B-like blocks (one layer, embedding, norm; block size 1024) over 24 and 64 ranks."""
    config = ShampooConfig()
    shapes = [(32000, 4096)] + [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)] \
        + [(4096,)] * 3
    costs = [c.vector() for c in plan_block_costs([plan_parameter(s, config) for s in shapes],
                                                  config)]
    for world in (24, 64):
        assert assign_blocks(costs, world).owners == _assign_by_scan(costs, world)


def test_deterministic_tie_breaking_and_empty_ranks() -> None:
    a = assign_blocks([1.0, 1.0, 1.0], 2)
    assert a.owners == (0, 1, 0)  # equal costs: block order; equal loads: rank order
    assert assign_blocks([1.0, 1.0, 1.0], 2) == a
    b = assign_blocks([5.0, 2.0], 4)
    assert b.owners == (0, 1) and b.blocks_of(2) == () and b.blocks_of(3) == ()
    assert assign_blocks([], 3).loads == ((0.0,), (0.0,), (0.0,))
    # The largest block goes first, to the least loaded rank.
    assert assign_blocks([1.0, 9.0, 4.0, 4.0], 2).owners == (1, 0, 1, 1)
    # initial_loads continue an earlier assignment.
    assert assign_blocks([3.0, 1.0], 2, initial_loads=[0.0, 2.5]).owners == (0, 1)
    # Vectors: two heavy-step blocks split, then the root-heavy blocks balance the roots.
    blocks = [(10.0, 2.0, 4.0), (10.0, 2.0, 4.0), (0.0, 1.0, 2.0), (0.0, 1.0, 2.0)]
    v = assign_blocks(blocks, 2)
    assert v.owners == (0, 1, 0, 1)
    assert v.loads == ((10.0, 3.0, 6.0), (10.0, 3.0, 6.0))


def test_block_cost_formula() -> None:
    config = ShampooConfig(
        blocking=BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None),
        schedule=ScheduleConfig(precondition_frequency=5, statistics_frequency=2),
    )
    plan = plan_parameter((6, 3), config)
    costs = plan_block_costs([plan], config)
    first = plan.blocks[0]  # shape (4, 3)
    assert first.shape == (4, 3)
    assert costs[0].step == pytest.approx(12 + sum(2 * n * 12 / 2 + 2 * n * 12 for n in (4, 3)))
    assert costs[0].root == pytest.approx(ROOT_FLOPS_PER_CUBE * (4**3 + 3**3))
    assert costs[0].memory == 2 * (16 + 9)
    assert costs[0].vector() == (costs[0].step, costs[0].root, 50.0)
    assert costs == [block_cost(b, config) for b in plan.blocks]
    skipped = plan_parameter((3,), ShampooConfig(blocking=BlockingConfig(skip_rank_lt=2)))
    assert plan_block_costs([skipped], config) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"costs": [1.0], "world_size": 0}, "world_size = 0"),
        ({"costs": [1.0], "world_size": True}, "world_size = True"),
        ({"costs": [-1.0], "world_size": 2}, r"costs\[0\] = -1.0"),
        ({"costs": [float("nan")], "world_size": 2}, r"costs\[0\] = nan"),
        ({"costs": [1.0], "world_size": 2, "initial_loads": [0.0]}, "initial_loads"),
        ({"costs": [(1.0, 2.0), (1.0,)], "world_size": 2}, r"costs\[1\] = \(1.0,\)"),
    ],
)
def test_invalid_arguments_name_the_field(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        assign_blocks(**kwargs)  # type: ignore[arg-type]
