"""Distributed Shampoo on gloo (CPU): equal to one process, resumable across world sizes.

One process start per world size (1, 2, 3) runs every scenario of
``distributed_scenarios.py`` and returns plain data; the tests below assert
on it. Bit-for-bit equality with the single-process optimizer is required
for float32/float64 communication (one thread per process on both sides: see
``shampoo_torch.invariance`` for why batch composition cannot change a
block's result); with bfloat16/float16 communication the parameters stay
within the rounding bound derived in ``test_lossy_communication_bound``.
Every spawn and collective has a timeout, so a hang fails instead of
blocking CI.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shampoo_torch import DistributedConfig, Shampoo

from .helpers import spawn_ok

SCENARIOS = str(Path(__file__).with_name("distributed_scenarios.py"))
WORLD_SIZES = (1, 2, 3)


@cache
def outcome(world: int) -> list[dict[str, Any]]:
    return spawn_ok(f"{SCENARIOS}:world_sizes_and_replicas", world, timeout_s=400.0)


def assert_identical(a: dict[str, np.ndarray], b: dict[str, np.ndarray], what: str) -> None:
    for n in a:
        assert a[n].dtype == b[n].dtype, what
        if not np.array_equal(a[n], b[n]):
            diff = float(np.max(np.abs(a[n].astype(np.float64) - b[n])))
            raise AssertionError(f"{what}: parameter {n!r} differs (max |diff| {diff:.3g})")


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_equal_to_single_process_bit_for_bit(world: int) -> None:
    ranks = outcome(world)
    for case, first in ranks[0]["equality"].items():
        if case.startswith("lossy_"):
            continue
        for rank, r in enumerate(ranks):
            got = r["equality"][case]
            assert_identical(got["distributed"], got["single"], f"{case}, rank {rank}/{world}")
            assert_identical(got["distributed"], first["distributed"], f"{case}: rank {rank}")


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_factor_state_is_split_over_ranks(world: int) -> None:
    ranks = outcome(world)
    for case in ranks[0]["equality"]:
        if case.startswith("lossy_"):
            continue
        per_rank = [r["equality"][case]["bytes"] for r in ranks]
        whole = ranks[0]["equality"][case]["single_bytes"]
        assert sum(per_rank) == whole, case  # every block held exactly once
        if world > 1:
            assert max(per_rank) < whole, case
        exchanged = {r["equality"][case]["exchanged_bytes"] for r in ranks}
        assert len(exchanged) == 1 and exchanged.pop() > 0
    # A model of one block: the other ranks own nothing and still step identically.
    one = [r["one_block"] for r in ranks]
    assert one[0]["bytes"] > 0 and all(o["bytes"] == 0 for o in one[1:])
    for o in one:
        assert_identical(o["distributed"], o["single"], "one block")


@pytest.mark.parametrize("world", [2, 3])
def test_lossy_communication_bound(world: int) -> None:
    """bfloat16/float16 directions: ``|w - w_single| <= sum_t |dw_t| 2.01 u + T eps32 |w|``.

    The config has no momentum and grafts per parameter, and statistics do
    not depend on the directions, so each step's update is the exact one
    with its direction rounded once (relative error <= u per entry) and
    rescaled by a norm ratio that the rounding moves by <= u: the update is
    off by at most (2u + u^2) |dw_t| per entry, plus float32 rounding of the
    parameter update itself.
    """
    ranks = outcome(world)
    for name, u in (("bfloat16", 2.0**-8), ("float16", 2.0**-11)):
        got = [r["equality"][f"lossy_{name}"] for r in ranks]
        for g in got[1:]:
            assert_identical(g["distributed"], got[0]["distributed"], name)  # ranks agree
        path = got[0]["path"]
        for n, w in got[0]["distributed"].items():
            steps = [np.abs(b[n] - a[n]) for a, b in zip(path[:-1], path[1:], strict=True)]
            bound = 2.01 * u * np.sum(steps, axis=0) + len(steps) * 2.0**-23 * (
                np.abs(path[-1][n]) + 1e-30)
            err = np.abs(w - path[-1][n])
            assert np.all(err <= bound), (name, n, float(np.max(err - bound)))
            assert np.any(err > 0)  # the rounding is real (the test could fail)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_resume_across_world_sizes(world: int) -> None:
    for r in outcome(world):
        for key in ("resume", "resume_frequent_directions"):  # the latter: eqs. 6c, 10d
            assert r[key] == {"uninterrupted": True, "w_to_1": True, "one_to_w": True,
                              "blocks_complete": True, "same_dict": True}, key


def test_replicated_trainer_groups_and_ddp() -> None:
    ranks = outcome(2)
    for r in ranks:
        rep = r["replicated"]  # trainers_per_group=1: each rank computes every block
        assert rep["bytes"] == rep["single_bytes"]
        assert_identical(rep["distributed"], rep["single"], "trainers_per_group=1")
        d = r["ddp"]
        for a, b in zip(d["distributed"], d["single"], strict=True):
            assert np.array_equal(a, b)
    for a, b in zip(ranks[0]["ddp"]["distributed"], ranks[1]["ddp"]["distributed"], strict=True):
        assert np.array_equal(a, b)


def test_two_trainer_groups_of_two() -> None:
    """World 4 as two groups of 2: each group splits the blocks like a world of 2,
    the groups replicate each other, and every rank equals one process."""
    results = spawn_ok(f"{SCENARIOS}:trainer_groups", 4, timeout_s=400.0)
    for rank, r in enumerate(results):
        assert_identical(r["distributed"], r["single"], f"two groups, rank {rank}")
    per_rank = [r["bytes"] for r in results]
    whole = results[0]["single_bytes"]
    assert per_rank[0] + per_rank[1] == whole and per_rank[2] + per_rank[3] == whole
    assert per_rank[:2] == per_rank[2:] and max(per_rank) < whole
    # Two ranks per group: the all-gather carries the segments of 2 ranks, as at world 2.
    assert results[0]["exchanged_bytes"] == outcome(2)[0]["equality"]["rich_float32"][
        "exchanged_bytes"]


@pytest.mark.cpu_path  # raised in its step on the CPU path; deferred: test_device_path.py
def test_every_rank_raises_the_same_error() -> None:
    ranks = [r["failures"] for r in outcome(2)]
    messages = {r["nonfinite"] for r in ranks}
    assert len(messages) == 1
    message = messages.pop()
    assert message is not None and "'b'" in message and "rank 1 of 2" in message
    assert all(r["unchanged"] for r in ranks)  # raised before any state changed
    roots = {r["root"] for r in ranks}
    assert len(roots) == 1
    root = roots.pop()
    owner = ranks[0]["owners"][(0, 0)]
    assert root is not None and "'p'" in root and f"owned by rank {owner}" in root


def test_trainers_per_group_must_divide_the_world() -> None:
    for r in outcome(3):
        assert "DistributedConfig.trainers_per_group = 2" in r["validation"]["error"]
        assert "divisor of the world size 3" in r["validation"]["error"]


def test_unsupported_dtensor_placements_are_rejected_clearly() -> None:
    """FSDP2 / HSDP placements are supported (test_fsdp2.py); others are refused."""
    message = outcome(1)[0]["dtensor"]
    assert "placements [Shard(dim=1)]" in message and "[Shard(dim=0)] (fully_shard)" in message


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"communication_dtype": "int8"}, "communication_dtype = 'int8'"),
        ({"trainers_per_group": 0}, "trainers_per_group = 0"),
        ({"trainers_per_group": True}, "trainers_per_group = True"),
        ({"process_group": "world"}, "process_group = 'world'"),
        ({"shard_mode": "replicated"}, "shard_mode = 'replicated'"),
    ],
)
def test_distributed_config_validation(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DistributedConfig(**kwargs)


def test_needs_an_initialized_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        Shampoo([torch.nn.Parameter(torch.zeros(2))], distributed=DistributedConfig())
    with pytest.raises(ValueError, match="distributed = 'yes'"):
        Shampoo([torch.nn.Parameter(torch.zeros(2))], distributed="yes")  # type: ignore[arg-type]
