"""Shampoo on FSDP2 (``fully_shard``) and HSDP parameters, on gloo (CPU).

One process start per world size (2, 4) runs every scenario of
``fsdp2_scenarios.py`` (FSDP on a 1-D mesh; at world 4 also HSDP on a
2 x 2 mesh), both shard modes, parameters 0-d to 4-d with dim 0 not
divisible by the world size and smaller than it (empty pieces):

- ``"lossless"`` equals the single-process optimizer on the whole
  parameters and gradients bit for bit (one thread per process), with the
  factor state split over the shard group;
- ``"local"`` equals the single-process optimizer run on each rank's pieces
  bit for bit, and the float64 reference on those pieces (the shard-induced
  plan) within test_reference_equality's float64 bound.

Parameters are float32, float64 and bfloat16 (float32 state), and, lossless,
a param group of both bfloat16 and float32. Checkpoints resume across world
sizes and across modes (fully_shard -> DDP -> one process -> fully_shard).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shampoo_reference import ReferenceShampoo
from shampoo_torch import DistributedConfig
from shampoo_torch.processes import spawn

from .helpers import load_scenarios, spawn_ok

SCENARIOS = str(Path(__file__).with_name("fsdp2_scenarios.py"))
WORLDS = (2, 4)


@cache
def outcome(world: int) -> list[dict[str, Any]]:
    return spawn_ok(f"{SCENARIOS}:fsdp", world, timeout_s=400.0)


def _scenarios() -> Any:
    return load_scenarios(SCENARIOS, "fsdp2_scenarios")


def _cases(world: int, mode: str) -> list[str]:
    return [k for k in outcome(world)[0] if k.endswith("/" + mode)]


def _assert_identical(a: dict[str, np.ndarray], b: dict[str, np.ndarray], what: str) -> None:
    assert set(a) == set(b), what
    for n in a:
        assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, (what, n)
        if not np.array_equal(a[n], b[n]):
            diff = float(np.max(np.abs(a[n].astype(np.float64) - b[n])))
            raise AssertionError(f"{what}: parameter {n!r} differs (max |diff| {diff:.3g})")


@pytest.mark.parametrize("world", WORLDS)
def test_lossless_equals_one_process_bit_for_bit(world: int) -> None:
    ranks = outcome(world)
    for case in _cases(world, "lossless"):
        for rank, r in enumerate(ranks):
            got = r[case]
            _assert_identical(got["final_full"], got["single"], f"{case}, rank {rank}/{world}")
            _assert_identical(got["final_full"], ranks[0][case]["final_full"], case)
            moved = [n for n in got["start_full"]
                     if not np.array_equal(got["start_full"][n], got["final_full"][n])]
            assert set(moved) == set(got["start_full"]), case  # every parameter stepped
            assert got["forward_sees_update"], case  # FSDP2's forward reads the new values


@pytest.mark.parametrize("world", WORLDS)
def test_averaging_eval_equals_one_process(world: int) -> None:
    """Eq. (20d) under FSDP2: eval() puts x in every piece as one process does (lossless:
    the whole x, bit for bit; local: each piece's own), and train() puts W back."""
    ranks = outcome(world)
    cases = [k for k in ranks[0] if "schedule_free" in k]
    assert cases
    for case in cases:
        for rank, r in enumerate(ranks):
            got = r[case]
            mode_eval = got["eval_full"] if case.endswith("lossless") else got["eval_local"]
            _assert_identical(mode_eval, got["single_eval"], f"{case} eval(), rank {rank}")
            assert any(not np.array_equal(got["eval_full"][n], got["final_full"][n])
                       for n in got["final_full"]), case  # x differs from W


@pytest.mark.parametrize("world", WORLDS)
def test_lossless_splits_the_factor_state_over_the_shard_group(world: int) -> None:
    ranks = outcome(world)
    for case in _cases(world, "lossless"):
        per_rank = [r[case]["bytes"] for r in ranks]
        whole = ranks[0][case]["single_bytes"]
        group = world // 2 if case.startswith("hsdp") else world
        for start in range(0, world, group):  # each replica group holds every block once
            assert sum(per_rank[start:start + group]) == whole, case
        if group < world:  # the replica groups hold the same blocks
            assert per_rank[:group] == per_rank[group:], case
        assert max(per_rank) < whole, case
        assert all(r[case]["exchanged_bytes"] > 0 for r in ranks), case


@pytest.mark.parametrize("world", WORLDS)
def test_local_equals_one_process_on_each_piece(world: int) -> None:
    ranks = outcome(world)
    for case in _cases(world, "local"):
        empty = 0
        for rank, r in enumerate(ranks):
            got = r[case]
            assert got["exchanged_bytes"] == 0, case  # no optimizer communication
            assert got["forward_sees_update"], case
            _assert_identical(got["final_local"], got["single"], f"{case}, rank {rank}/{world}")
            for n, v in got["start_local"].items():
                if v.size == 0:
                    empty += 1
                    assert got["final_local"][n].size == 0
        assert empty > 0, case  # some ranks had empty pieces


@pytest.mark.parametrize("world", WORLDS)
def test_local_equals_the_reference_on_the_shard_plan(world: int) -> None:
    """Float64: ``||dW_torch - dW_ref|| <= 1e-9 ||dW_ref||`` per piece (the bound of
    test_reference_equality for float64, over fewer steps)."""
    scenarios = _scenarios()
    ranks = outcome(world)
    for case in _cases(world, "local"):
        name = case.split("/")[1]
        if not name.endswith("float64"):
            continue
        config = scenarios.CONFIGS[scenarios.CASES[name][0]]
        for rank, r in enumerate(ranks):
            got = r[case]
            live = [n for n, v in got["start_local"].items() if v.size]
            ref = ReferenceShampoo(config, {n: got["start_local"][n] for n in live})
            for step in got["local_grads"]:
                ref.step({n: step[n] for n in live})
            for n in live:
                d_ref = ref.params[n] - got["start_local"][n]
                d_torch = got["final_local"][n] - got["start_local"][n]
                err = float(np.linalg.norm(d_torch - d_ref))
                assert err <= 1e-9 * float(np.linalg.norm(d_ref)), (case, rank, n, err)


def test_local_and_lossless_differ_where_the_shard_plan_does() -> None:
    """The shard-induced plan is another algorithm: rank 0's piece of "e" (2 x 9) is
    1 x 9, a 9-vector cut in blocks of 4, 4, 1 with one factor each, where the whole
    parameter has 2 x 4, 2 x 4, 2 x 1 blocks with two factors each. ("m", 7 x 6,
    split 4 + 3 along the 4-row block boundary, has the same blocks in both.)"""
    r0 = outcome(2)[0]
    case = "fsdp/block_graft_l2_float64"
    for name, rows, same in (("e", 1, False), ("m", 4, True)):
        lossless = r0[case + "/lossless"]["final_full"][name][:rows]
        local = r0[case + "/local"]["final_local"][name]
        assert local.shape == lossless.shape
        assert np.array_equal(local, lossless) == same, name


def test_lossless_checkpoint_resumes_and_reshards(tmp_path: Path) -> None:
    """torch.distributed.checkpoint of the model and the distributed state dict after 3
    of 5 steps: resumed at 2 -> 2, 2 -> 4, 4 -> 2 ranks, bit for bit the uninterrupted
    single-process run; another config is refused naming the field."""
    target = f"{SCENARIOS}:checkpoint_"
    saved = {}
    for world in WORLDS:
        got = spawn(target + "save", world, args=(str(tmp_path / f"w{world}"),),
                    timeout_s=300.0, collective_timeout_s=120.0)
        assert not any(isinstance(r, BaseException) for r in got), got
        saved[world] = got
    expected = saved[2][0]["single"]  # one process, 5 steps (computed in a worker: 1 thread)
    for world in WORLDS:
        for r in saved[world]:
            _assert_identical(r["final"], expected, f"uninterrupted at {world}")
    plans = {2: [str(tmp_path / "w2"), str(tmp_path / "w4")], 4: [str(tmp_path / "w2")]}
    for world, dirs in plans.items():
        got = spawn(target + "load", world, args=(dirs,), timeout_s=300.0,
                    collective_timeout_s=120.0)
        assert not any(isinstance(r, BaseException) for r in got), got
        for rank, r in enumerate(got):
            for d in dirs:
                _assert_identical(r[d], expected, f"{d} -> {world}, rank {rank}")
            assert "fields that differ" in r["mismatch"]
            assert "epsilon.value: 1e-05 -> 0.0001" in r["mismatch"]
            assert "shard_mode = 'local' is invalid" in r["local"]


def test_hsdp_replica_groups_agree() -> None:
    ranks = outcome(4)
    for case in [k for k in ranks[0] if k.startswith("hsdp/")]:
        for rank in (0, 1):
            _assert_identical(ranks[rank][case]["final_local"],
                              ranks[rank + 2][case]["final_local"], f"{case}, replica {rank}")


def test_clear_errors() -> None:
    for r in outcome(2):
        e = r["errors"]
        assert "is a DTensor (FSDP2 fully_shard / HSDP)" in e["no_config"]
        assert "shard_mode" in e["no_config"]
        assert "placements [Shard(dim=1)]" in e["shard_dim_1"]
        assert "DistributedConfig.trainers_per_group = 1" in e["trainers"]
        assert "either plain tensors only or DTensors of one device mesh" in e["mixed"]


@pytest.mark.parametrize("world", WORLDS)
def test_a_nonfinite_gradient_makes_every_rank_raise(world: int) -> None:
    """Eq. (3) "raise" with a NaN in the last rank's piece only: lossless agrees as for
    DDP (the same error everywhere); local decides per rank, then one flag makes the
    other ranks raise too (none would be left waiting); no parameter moved."""
    ranks = [r["nonfinite"] for r in outcome(world)]
    lossless = {r["lossless"]["message"] for r in ranks}
    assert len(lossless) == 1 and "'m'" in lossless.pop()
    local = [r["local"]["message"] for r in ranks]
    assert "'m'" in local[-1]
    assert all("another rank's pieces" in m for m in local[:-1])
    assert all(r[mode]["unchanged"] for r in ranks for mode in ("lossless", "local"))


@pytest.mark.parametrize("world", WORLDS)
def test_local_ranks_raise_together_even_with_nothing_to_step(world: int) -> None:
    """"local": eq. (3) "raise" and the eq. (13) limit on rank 1's piece only; every
    rank raises the same kind of error, those holding no piece at all included."""
    got = [r["local_agreement"] for r in outcome(world)]
    for rank, r in enumerate(got):
        assert r["nonfinite"].startswith("NonFiniteGradientError"), (rank, r)
        assert r["root"].startswith("RootFailureError"), (rank, r)
        if rank != 1:
            assert "another rank's pieces" in r["nonfinite"] and "another rank's" in r["root"]
    assert "'p'" in got[1]["nonfinite"] and "'p'" in got[1]["root"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shard_mode": "sharded"}, "shard_mode = 'sharded'.*'lossless' or 'local'"),
        ({"shard_mode": None}, "shard_mode = None"),
        ({"shard_mode": "local", "communication_dtype": "float32"},
         "communication_dtype = 'float32'.*shard_mode='local'"),
        ({"shard_mode": "local", "trainers_per_group": 2}, "trainers_per_group = 2"),
    ],
)
def test_shard_mode_validation(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DistributedConfig(**kwargs)


@pytest.mark.parametrize("world", WORLDS)
def test_bfloat16_parameters_keep_float32_state(world: int) -> None:
    """bfloat16 parameters under ``fully_shard`` with the default float32 factor state:
    factors, roots and the elementwise state are float32, as in one process (the
    bit-for-bit equalities of both modes run over this case too), and the
    parameters stay bfloat16 (FSDP2 gathers and reduces them in bfloat16)."""
    ranks = outcome(world)
    cases = [k for k in ranks[0] if "/parameter_graft_bfloat16/" in k]
    assert len(cases) == (4 if world == 4 else 2), cases  # FSDP (and HSDP), both modes
    for case in cases:
        for r in ranks:
            got = r[case]
            assert got["state_dtypes"]["elementwise"] == ["torch.float32"], case
            if got["bytes"]:  # a rank holding blocks (local: a rank with pieces)
                assert got["state_dtypes"]["blocks"] == ["torch.float32"], case
            for n, v in got["final_full"].items():  # bfloat16 values, held as float32
                assert v.dtype == np.float32, (case, n)
                as_bf16 = torch.tensor(v).to(torch.bfloat16).float().numpy()
                assert np.array_equal(as_bf16, v), (case, n)


def test_checkpoints_across_modes(tmp_path: Path) -> None:
    """One distributed state dict for every mode, float32 and bfloat16 parameters:
    fully_shard "lossless" at 2 ranks (DCP, converted by ``dcp_to_torch_save``) ->
    DDP at 2 ranks (torch.save) -> one process, and one process -> fully_shard (the
    torch.save file read by every rank, or through ``torch_save_to_dcp``), each
    resumed bit for bit the uninterrupted one-process run."""
    target = f"{SCENARIOS}:modes_"
    legs = []
    for leg in ("start", "middle"):
        got = spawn(target + leg, 2, args=(str(tmp_path),), timeout_s=300.0,
                    collective_timeout_s=120.0)
        assert not any(isinstance(r, BaseException) for r in got), got
        legs.append(got)
    start, middle = legs
    for case in _scenarios().MODE_CASES:
        expected = start[0][case]["single"]
        for rank in range(2):
            _assert_identical(start[rank][case]["fsdp"], expected, f"{case}: fsdp, rank {rank}")
            for path in ("single_to_fsdp", "single_to_fsdp_dcp"):
                _assert_identical(middle[rank][case][path], expected,
                                  f"{case}: {path}, rank {rank}")
        _assert_identical(middle[0][case]["ddp_to_single"], expected,
                          f"{case}: fsdp -> ddp -> one process")


def _stringified(sd: dict[str, Any], key: str = "{}") -> dict[str, Any]:
    """``sd`` with its block and block-dim keys as strings (as DCP's flattening writes them)."""
    def block(b: dict[str, Any]) -> dict[str, Any]:
        return {k: ({key.format(d): t for d, t in v.items()}
                    if k in ("factors", "inverse_roots", "sketches") else v)
                for k, v in b.items()}
    state = {n: {**e, "blocks": {key.format(i): block(b) for i, b in e["blocks"].items()}}
             for n, e in sd["state"].items()}
    return {**sd, "state": state}


@pytest.mark.parametrize("sketched", [False, True], ids=["plain", "frequent_directions"])
def test_string_keys_of_a_dcp_file_load_and_others_are_refused(sketched: bool) -> None:
    """In one process: block indices and block dims as decimal strings load as the ints
    (bit for bit the same continuation; the dict itself unchanged); "01" is refused.
    With frequent directions (eqs. 6c, 10d) the sketches are keyed by block dim too."""
    from shampoo_spec import FrequentDirectionsConfig, ScheduleConfig, ShampooConfig
    from shampoo_torch import Shampoo

    config = ShampooConfig(learning_rate=0.1)
    if sketched:
        config = ShampooConfig(
            learning_rate=0.1, schedule=ScheduleConfig(precondition_frequency=2,
                                                       statistics_frequency=2),
            frequent_directions=FrequentDirectionsConfig(rank=1, average_gradients=True))

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(6, 5, generator=gen) for _ in range(4)]

    def run(load: dict[str, Any] | None) -> tuple[Shampoo, torch.nn.Parameter]:
        p = torch.nn.Parameter(torch.ones(6, 5))
        opt = Shampoo([("w", p)], config)
        steps = grads[:2] if load is None else grads[2:]
        if load is not None:
            with torch.no_grad():
                p.copy_(load["w"])
            opt.load_distributed_state_dict(load["optimizer"])
        for g in steps:
            p.grad = g.clone()
            opt.step()
        return opt, p

    opt, p = run(None)
    sd = opt.distributed_state_dict()
    blocks = sd["state"]["w"]["blocks"]
    assert blocks and all(isinstance(b, int) for b in blocks)
    assert ("sketches" in blocks[0]) == sketched
    as_strings = _stringified(sd)
    _, expected = run({"w": p.detach(), "optimizer": sd})
    _, got = run({"w": p.detach(), "optimizer": as_strings})
    assert torch.equal(got, expected)
    assert all(isinstance(b, str) for b in as_strings["state"]["w"]["blocks"])  # unchanged
    with pytest.raises(ValueError, match=r"block indices \['00'\] do not match the plan's \[0\]"):
        run({"w": p.detach(), "optimizer": _stringified(sd, "0{}")})


@pytest.mark.parametrize("world", WORLDS)
def test_lossless_mixed_dtypes_in_one_group(world: int) -> None:
    """float32 and bfloat16 DTensors in one param group: equal to one process bit for bit,
    one gather buffer per dtype, allocated on the first step and kept after it."""
    for rank, r in enumerate(outcome(world)):
        got = r["mixed_dtypes"]
        assert set(got["dtypes"].values()) == {"torch.float32", "torch.bfloat16"}
        _assert_identical(got["final"], got["single"], f"mixed dtypes, rank {rank}/{world}")
        first = got["buffers"][0]
        assert [d for d, _, _ in first] == ["torch.bfloat16", "torch.float32"], first
        assert all(b == first for b in got["buffers"]), got["buffers"]
