"""torch's standard checkpoint path: ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``
(default, ``full_state_dict`` + ``cpu_offload``, ``flatten_optimizer_state_dict``), ``dcp.save``
/ ``dcp.load`` and the ``Stateful`` app-state pattern, in one process, DDP, FSDP2 lossless and
local, and HSDP; resharded 1 -> 4, 2 -> 4 -> 2 and 4 -> 1 across modes, every resume bit for
bit the uninterrupted run (the scenarios: ``dcp_scenarios.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from .helpers import load_scenarios, spawn_ok

SCENARIOS = str(Path(__file__).with_name("dcp_scenarios.py"))
#: DCP warns when it saves or loads without a process group (``no_dist=True``, intended here).
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


sc = load_scenarios(SCENARIOS, "dcp_scenarios")


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Bit-for-bit equality with the spawned ranks, which run one thread each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def stages(root: str) -> dict[str, Any]:
    """The three spawned stages over one directory, and the one-process saves before
    (one -> 4) and loads after (4 -> 1) them."""
    out: dict[str, Any] = {}
    for option in sc.OPTIONS:
        model, opt, _ = sc.build("one", 1)
        sc.run(model, opt, None, range(sc.FIRST))
        sc.save(model, opt, option, f"{root}/first-one-{option}", distributed=False)
    out["first"] = spawn_ok(f"{SCENARIOS}:first", 2, (root,), timeout_s=600.0)
    out["second"] = spawn_ok(f"{SCENARIOS}:second", 4, (root,), timeout_s=600.0)
    out["third"] = spawn_ok(f"{SCENARIOS}:third", 2, (root,), timeout_s=600.0)
    for option in sc.OPTIONS:
        model, opt, _ = sc.build("one", 1)
        sc.load(model, opt, option, f"{root}/second-hsdp-{option}", distributed=False)
        sc.run(model, opt, None, range(sc.SECOND, sc.STEPS))
        out[f"hsdp->one/{option}"] = sc.whole(model)
    return out


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return stages(str(tmp_path_factory.mktemp("dcp")))
    finally:
        torch.set_num_threads(threads)


def _equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_every_rank_of_a_stage_ends_alike(outcome: dict[str, Any]) -> None:
    for stage in ("first", "second", "third"):
        ranks = outcome[stage]
        for key in ranks[0]:
            if isinstance(ranks[0][key], dict):
                assert all(_equal(r[key], ranks[0][key]) for r in ranks), (stage, key)


def test_portable_modes_resume_bit_for_bit_across_world_sizes_and_modes(
        outcome: dict[str, Any]) -> None:
    """one -> 4 ranks, 2 -> 4 -> 2 and 4 -> one process, every option set, across DDP,
    fully_shard lossless and HSDP: each equals the uninterrupted one-process run."""
    single = outcome["first"][0]["uninterrupted"]
    resumed = {f"{stage}: {k}": v for stage in ("second", "third")
               for k, v in outcome[stage][0].items() if "->" in k and "local" not in k}
    resumed.update({k: v for k, v in outcome.items() if k.startswith("hsdp->one")})
    assert len(resumed) == 3 * 3 + 3 * 3 + 3  # 2 -> 4, 4 -> 2 (three sources), 4 -> 1
    for key, final in resumed.items():
        assert _equal(final, single), key
    for mode in ("ddp", "lossless"):  # and the saving runs themselves went on unchanged
        for option in sc.OPTIONS:
            assert _equal(outcome["first"][0][f"{mode}/{option}"], single), (mode, option)


def test_local_mode_resumes_bit_for_bit_at_the_same_shard_group_size(
        outcome: dict[str, Any]) -> None:
    """fully_shard "local" at 2 ranks (a later process group) and HSDP "local" at 4."""
    first, second, third = (outcome[stage][0] for stage in ("first", "second", "third"))
    for option in sc.OPTIONS:
        assert _equal(third[f"local->local/{option}"], first[f"local/{option}"]), option
        assert _equal(second[f"hsdp_local->hsdp_local/{option}"],
                      second[f"hsdp_local/{option}"]), option


def test_a_local_state_is_refused_by_a_lossless_optimizer_naming_why(
        outcome: dict[str, Any]) -> None:
    message = outcome["third"][0]["local->lossless"]
    assert "saved by shard_mode='local'" in message and "same shard group size" in message


def test_one_process_all_options_resume_bit_for_bit(tmp_path: Path, one_thread: None) -> None:
    """In one process, each option set: save at FIRST, load into fresh objects, continue."""
    model, opt, _ = sc.build("one", 1)
    sc.run(model, opt, None, range(sc.STEPS))
    single = sc.whole(model)
    for option in sc.OPTIONS:
        model, opt, _ = sc.build("one", 1)
        sc.run(model, opt, None, range(sc.FIRST))
        sc.save(model, opt, option, str(tmp_path / option), distributed=False)
        fresh, fresh_opt, _ = sc.build("one", 1)
        sc.load(fresh, fresh_opt, option, str(tmp_path / option), distributed=False)
        assert fresh_opt.metrics == opt.metrics
        sc.run(fresh, fresh_opt, None, range(sc.FIRST, sc.STEPS))
        assert _equal(sc.whole(fresh), single), option


def test_a_state_of_another_config_is_refused_by_name(tmp_path: Path) -> None:
    import dataclasses

    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from shampoo_spec import EpsilonConfig
    from shampoo_torch import Shampoo

    model, opt, _ = sc.build("one", 1)
    sc.run(model, opt, None, range(2))
    for option in sc.OPTIONS:
        saved = get_optimizer_state_dict(model, opt, options=sc.options(option))
        other = Shampoo(model.named_parameters(),
                        dataclasses.replace(sc.CONFIG, epsilon=EpsilonConfig(value=1e-3)))
        with pytest.raises(ValueError, match=r"different config.*epsilon\.value"):
            set_optimizer_state_dict(model, other, saved, options=sc.options(option))


def test_the_standard_path_needs_no_step_of_a_fresh_optimizer() -> None:
    """torch's ``_init_optim_state`` steps an optimizer whose state is empty (zero
    gradients, lr 0); ours holds its state from construction, so nothing is stepped."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, opt, _ = sc.build("one", 1)
    saved = get_optimizer_state_dict(model, opt)
    assert all(entry["step"] == 0 for entry in saved["state"].values())
    assert all(p.grad is None for p in model.parameters())
