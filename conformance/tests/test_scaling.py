"""The scaling study (shampoo_conformance.studies.scaling): hand-computed cases, brute force,
the spec.

Every number of docs/scaling.md comes from this module; these tests check
its cost model on cases small enough to compute by hand or by enumerating
entries, and that the tables on the page are what the module computes today.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shampoo_conformance.studies.scaling.blocks import (
    assign_owners,
    block_table,
    lower_bound,
    lpt_makespan,
    shard_rows,
)
from shampoo_conformance.studies.scaling.loads import (
    BYTES_PER_ENTRY,
    ddp_loads,
    local_loads,
    lossless_loads,
)
from shampoo_conformance.studies.scaling.models import LLAMA2_7B, LLAMA2_70B
from shampoo_conformance.studies.scaling.rows import COLUMNS, scaling_rows
from shampoo_conformance.studies.scaling.tables import summary_rows, summary_tables
from shampoo_spec import (
    ROOT_FLOPS_PER_CUBE,
    BlockingConfig,
    ShampooConfig,
    plan_block_costs,
    plan_parameter,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "scaling.md"
CFG = ShampooConfig()


def test_llama2_parameter_counts_are_the_published_ones() -> None:
    """6,738,415,616 (7B) and 68,976,648,192 (70B) parameters, as Meta publishes them."""
    for model, count in ((LLAMA2_7B, 6_738_415_616), (LLAMA2_70B, 68_976_648_192)):
        params = model.parameters()
        assert sum(math.prod(s) for _, s in params) == count
        assert len({n for n, _ in params}) == len(params) == 9 * model.layers + 3
    shapes = dict(LLAMA2_70B.parameters())
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (1024, 8192)  # GQA: 8 x 128
    assert shapes["lm_head.weight"] == (32000, 8192)


def test_shard_rows_cut_as_torch_chunk() -> None:
    assert [n for _, n in shard_rows(10, 4)] == [3, 3, 3, 1]
    assert shard_rows(10, 6) == [(0, 2), (2, 2), (4, 2), (6, 2), (8, 2), (10, 0)]
    assert [n for _, n in shard_rows(3, 5)] == [1, 1, 1, 0, 0]


def test_local_shard_of_a_10x4_parameter_over_4_ranks() -> None:
    """Chunks of 3, 3, 3, 1 rows: blocks (3, 4) x 3 and (4,) (the 1 squeezed away)."""
    unmerged = replace(CFG, blocking=BlockingConfig(merge_dims_up_to=None))
    loads = local_loads([(10, 4)], unmerged, 4)
    assert loads.elementwise.tolist() == [12, 12, 12, 4]
    assert loads.blocks.tolist() == [1, 1, 1, 1]
    c = ROOT_FLOPS_PER_CUBE
    assert loads.root.tolist() == [c * (27 + 64)] * 3 + [c * 64]
    # step: |B| + per dim n, 2 n |B| (statistics, frequency 1) + 2 n |B| (eq. 16).
    assert loads.step.tolist() == [12 + 4 * 3 * 12 + 4 * 4 * 12] * 3 + [4 + 4 * 4 * 4]
    assert loads.memory.tolist() == [2 * (9 + 16)] * 3 + [2 * 16]
    assert loads.comm.tolist() == [0, 0, 0, 0]
    # The default merges dims while the product stays <= 1024: (3, 4) is one (12,) block.
    merged = local_loads([(10, 4)], CFG, 4)
    assert merged.root.tolist() == [c * 12**3] * 3 + [c * 64]
    assert merged.memory.tolist() == [2 * 144] * 3 + [2 * 16]


def test_two_parameters_on_two_ranks_by_hand() -> None:
    """A (4, 2) matrix and a (2,) vector over N = 2, every number by hand.

    A costs root 10 (4^3 + 2^3) = 720, memory 2 (16 + 4) = 40 entries; the
    vector root 80, memory 8. A goes to rank 0, the vector to rank 1.
    DDP: segments of 8 and 2 entries, padded to 8: each rank receives 8
    entries (32 bytes). Lossless: each rank holds 2 rows of A (4 entries)
    and 1 entry of the vector; rank 0 receives A's other half (4) and its
    slice of the vector's direction (1), rank 1 the vector's other entry (1)
    and its half of A's direction (4): 5 entries, 20 bytes each.
    """
    table = block_table([(4, 2), (2,)], replace(CFG, blocking=BlockingConfig(
        merge_dims_up_to=None)))  # the default would merge (4, 2) into one (8,) block
    owners = assign_owners(table.costs, 2)
    assert owners.tolist() == [0, 1]
    ddp = ddp_loads(table, owners, 2)
    assert ddp.root.tolist() == [720.0, 80.0]
    assert (ddp.memory * BYTES_PER_ENTRY).tolist() == [160.0, 32.0]
    assert ddp.comm.tolist() == [32.0, 32.0]
    assert ddp.elementwise.tolist() == [10.0, 10.0]
    lossless = lossless_loads(table, owners, 2)
    assert lossless.comm.tolist() == [20.0, 20.0]
    assert lossless.pieces.tolist() == [2, 2]  # A with rank 1; the vector with rank 0
    assert lossless.elementwise.tolist() == [5.0, 5.0]
    assert lossless.memory.tolist() == ddp.memory.tolist()


def _brute_lossless(shapes: list[tuple[int, ...]], config: ShampooConfig,
                    owners: list[int], world: int) -> tuple[list[int], list[int], list[int]]:
    """Entries each rank sends and receives, and its (block, other rank) pairs, by enumeration."""
    sent, received, pairs = [0] * world, [0] * world, [0] * world
    i = 0
    for shape in shapes:
        plan = plan_parameter(shape, config)
        if not plan.preconditioned or plan.size == 0:
            continue
        flat = np.arange(plan.size).reshape(plan.merged_shape)
        rows = shape[0] if shape else 1
        per_row = plan.size // rows
        holder = np.zeros(plan.size, dtype=np.int64)
        for r, (start, length) in enumerate(shard_rows(rows, world)):
            holder[start * per_row:(start + length) * per_row] = r
        for block in plan.blocks:
            owner = owners[i]
            i += 1
            holders = holder[flat[block.slices].ravel()].tolist()
            for r in set(holders) - {owner}:
                pairs[r] += 1
                pairs[owner] += 1
            for r in holders:
                if r != owner:  # r sends its gradient entry, the owner sends back the direction
                    sent[r] += 1
                    received[owner] += 1
                    sent[owner] += 1
                    received[r] += 1
    return sent, received, pairs


shapes_st = st.lists(
    st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple), min_size=1, max_size=4)


@settings(max_examples=80, deadline=None)
@given(shapes=shapes_st, world=st.integers(1, 7), block=st.integers(1, 6),
       merge=st.sampled_from([None, 8, 30]), squeeze=st.booleans())
def test_lossless_bytes_equal_entry_by_entry_count(
    shapes: list[tuple[int, ...]], world: int, block: int, merge: int | None, squeeze: bool
) -> None:
    """Overlap arithmetic (merged dims, squeezed dims, empty chunks) = enumerating entries."""
    config = replace(CFG, blocking=BlockingConfig(
        max_preconditioner_dim=block, merge_dims_up_to=merge, squeeze=squeeze))
    table = block_table(shapes, config)
    owners = assign_owners(table.costs, world)
    loads = lossless_loads(table, owners, world)
    sent, received, pairs = _brute_lossless(shapes, config, owners.tolist(), world)
    assert sent == received
    assert (loads.comm / BYTES_PER_ENTRY).tolist() == received
    assert loads.pieces.tolist() == pairs
    assert loads.elementwise.sum() == sum(math.prod(s) for s in shapes)


@settings(max_examples=60, deadline=None)
@given(shapes=shapes_st, world=st.integers(1, 9), block=st.integers(1, 6))
def test_factor_memory_sums_to_one_process(
    shapes: list[tuple[int, ...]], world: int, block: int
) -> None:
    """DDP and lossless only distribute the single-process blocks: sums over ranks match."""
    config = replace(CFG, blocking=BlockingConfig(max_preconditioner_dim=block))
    costs = plan_block_costs([plan_parameter(s, config) for s in shapes], config)
    table = block_table(shapes, config)
    owners = assign_owners(table.costs, world)
    for loads in (ddp_loads(table, owners, world), lossless_loads(table, owners, world)):
        assert loads.memory.sum() == sum(c.memory for c in costs)
        assert loads.root.sum() == pytest.approx(sum(c.root for c in costs), rel=1e-12)
        assert loads.blocks.sum() == len(costs)


@settings(max_examples=60, deadline=None)
@given(costs=st.lists(st.integers(0, 20), min_size=1, max_size=7), world=st.integers(1, 3))
def test_lower_bound_and_lpt_bracket_the_optimum(costs: list[int], world: int) -> None:
    best = min(
        max(sum(c for c, r in zip(costs, owners, strict=True) if r == k) for k in range(world))
        for owners in itertools.product(range(world), repeat=len(costs))
    )
    assert lower_bound(np.array(costs, float), world) <= best + 1e-9
    assert best <= lpt_makespan(np.array(costs, float), world) <= 4 / 3 * best + 1e-9


def test_lower_bound_of_equal_blocks_is_their_ceiling_share() -> None:
    assert lower_bound(np.ones(10), 4) == 3.0
    assert lower_bound(np.ones(3), 4) == 1.0


def test_hsdp_rows_are_lossless_over_the_shard_group() -> None:
    rows = scaling_rows([LLAMA2_7B], [4096], [8, 32], [8])
    get = {(r["mode"], r["world"]): r for r in rows}
    for key in ("root_max", "memory_max_bytes", "comm_max_bytes", "step_mean"):
        assert get[("hsdp-8", 32)][key] == get[("lossless", 8)][key]
    assert get[("hsdp-8", 32)]["replicas"] == 4
    assert get[("ddp", 32)]["comm_max_bytes"] >= 31 / 32 * 6_738_415_616 * 4


def test_cli_writes_csv_markdown_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from shampoo_conformance.__main__ import main

    assert main(["scaling", "--out", str(tmp_path), "--models", "llama-2-7b",
                 "--block-sizes", "4096", "--world-sizes", "8,16", "--shard-groups", "8"]) == 0
    header = (tmp_path / "scaling.csv").read_text().splitlines()[0]
    assert header.split(",") == list(COLUMNS)
    assert "| hsdp-8 | 16 |" in (tmp_path / "scaling.md").read_text()
    assert (tmp_path / "scaling.png").stat().st_size > 0


def _doc_tables() -> list[str]:
    """The markdown tables of docs/scaling.md (header line first), in order."""
    tables, current = [], []
    for line in DOCS.read_text().splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append("\n".join(current))
            current = []
    return tables + (["\n".join(current)] if current else [])


def test_the_tables_of_docs_scaling_are_computed_today() -> None:
    """Every summary table on the page equals the module's output now (no stale numbers)."""
    expected = [table for _, table in summary_tables(summary_rows())]
    on_page = [t for t in _doc_tables() if re.match(r"\| (mode \| N|model \| block size) \|", t)]
    assert on_page == expected
