"""Real trainers drive Shampoo, save it and resume it: the resumed run continues the
uninterrupted one bit for bit (docs/integrations.md).

- PyTorch Lightning (``configure_optimizers`` returns Shampoo): one CPU process, and
  ``strategy="ddp"`` on 2 CPU processes (a script Lightning relaunches per rank,
  ``lightning_scenarios.py``); ``trainer.save_checkpoint`` after one epoch, a fresh
  Trainer with ``ckpt_path`` (the scenario is in that module's docstring).
- Hugging Face Accelerate: ``accelerator.prepare(model, optimizer, loader)`` (it wraps
  the optimizer in an ``AcceleratedOptimizer`` and round-trips its state dict),
  ``save_state`` mid-epoch, fresh objects, ``load_state``, ``skip_first_batches``.
- torchtitan: not installed here (docs/integrations.md says why); its optimizer
  container's calls, ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` with
  ``flatten_optimizer_state_dict=True`` through ``torch.distributed.checkpoint``.

Every compared tensor is compared with ``torch.equal``. The trainers are imported
per test (skipped where not installed; the nox ``tests`` session installs them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from shampoo_spec import (
    GradientFilterConfig,
    GraftingConfig,
    MomentumConfig,
    ScheduleConfig,
    ShampooConfig,
)
from shampoo_spec.schedule import is_root_step
from shampoo_torch import Shampoo

HERE = Path(__file__).resolve().parent
#: What a distributed launch reads from the environment (kept out of the DDP script's).
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                    "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK")
#: Roots every 3 steps from step 2: the resumes below land between two root steps.
CONFIG = ShampooConfig(
    learning_rate=0.05,
    grafting=GraftingConfig(type="adagrad"),
    gradient_filter=GradientFilterConfig(beta1=0.9),
    momentum=MomentumConfig(momentum=0.5, nesterov=True),
    schedule=ScheduleConfig(precondition_frequency=3, start_preconditioning_step=2),
    factor_dtype="float64",
)
#: Steps of the uninterrupted runs, and the step the interrupted ones save at.
STEPS, SAVED_AT = 10, 7


def assert_trees_equal(a: object, b: object, where: str = "") -> None:
    """Nested dicts and lists of equal keys, equal plain values and bitwise equal tensors."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            assert_trees_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_trees_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def assert_resumed_equals_straight(straight: dict[str, Any], resumed: dict[str, Any]) -> None:
    assert resumed["global_step"] == straight["global_step"]
    assert_trees_equal(straight["params"], resumed["params"], "params")
    assert_trees_equal(straight["optimizer"], resumed["optimizer"], "optimizer")


def assert_resumed_between_root_steps(saved_at: int) -> None:
    """Roots were computed before the save, and the first resumed step computes none:
    the resumed run lives on restored roots and a restored position in the period."""
    roots = [t for t in range(1, STEPS + 3) if is_root_step(t, CONFIG.schedule)]  # 2, 3, 6, ...
    assert min(roots) <= saved_at and saved_at + 1 not in roots


# ----------------------------------------------------------------- Lightning
def test_lightning_one_process_resume_is_bit_identical(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from . import lightning_scenarios
    from .lightning_scenarios import BATCHES, EPOCHS, fit_and_resume

    assert lightning_scenarios.CONFIG == CONFIG

    straight, resumed, rank = fit_and_resume(tmp_path / "epoch1.ckpt")
    assert rank == 0 and straight["global_step"] == EPOCHS * BATCHES
    assert_resumed_equals_straight(straight, resumed)
    assert_resumed_between_root_steps(saved_at=BATCHES)
    assert {entry["step"] for entry in resumed["optimizer"]["state"].values()} == {EPOCHS * BATCHES}


def test_lightning_ddp_two_processes_resume_is_bit_identical(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from .lightning_scenarios import BATCHES, EPOCHS

    # A fresh launch: no rank or rendezvous from this process (Lightning picks a free port).
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    result = subprocess.run(
        [sys.executable, str(HERE / "lightning_scenarios.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for rank in ranks:
        assert rank["straight"]["global_step"] == EPOCHS * BATCHES
        assert_resumed_equals_straight(rank["straight"], rank["resumed"])
    # DDP's replicas: every rank stepped the same averaged gradients to the same bits.
    assert_trees_equal(ranks[0]["straight"], ranks[1]["straight"], "rank 0 vs rank 1")


# ----------------------------------------------------------------- Accelerate
def _dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=generator, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, torch.randint(0, 3, (32,), generator=generator))


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()


def test_accelerate_save_state_load_state_resume_is_bit_identical(tmp_path: Path) -> None:
    accelerate = pytest.importorskip("accelerate")

    def prepared(seed: int) -> tuple[Any, ...]:
        model = _mlp(seed)
        optimizer = Shampoo(model.named_parameters(), CONFIG)
        loader = torch.utils.data.DataLoader(_dataset(), batch_size=8)  # 4 batches an epoch
        accelerator = accelerate.Accelerator(cpu=True)
        return (accelerator, *accelerator.prepare(model, optimizer, loader))

    def train(accelerator: Any, model: torch.nn.Module, optimizer: Any, loader: Any,
              start: int, stop: int) -> None:
        step = start
        while step < stop:
            done = step % len(loader)  # batches of this epoch already trained on
            for x, y in accelerator.skip_first_batches(loader, done) if done else loader:
                optimizer.zero_grad()
                accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
                optimizer.step()
                step += 1
                if step == stop:
                    return

    accelerator, model, optimizer, loader = prepared(seed=0)
    assert isinstance(optimizer, accelerate.optimizer.AcceleratedOptimizer)
    train(accelerator, model, optimizer, loader, 0, STEPS)

    accelerator, first, first_optimizer, loader = prepared(seed=0)
    train(accelerator, first, first_optimizer, loader, 0, SAVED_AT)
    accelerator.save_state(tmp_path / "state")
    assert_resumed_between_root_steps(SAVED_AT)

    accelerator, resumed, resumed_optimizer, loader = prepared(seed=1)
    accelerator.load_state(tmp_path / "state")
    train(accelerator, resumed, resumed_optimizer, loader, SAVED_AT, STEPS)

    assert_trees_equal(list(model.parameters()), list(resumed.parameters()), "params")
    assert_trees_equal(optimizer.state_dict(), resumed_optimizer.state_dict(), "optimizer")
    assert resumed_optimizer.state_dict()["state"][0]["step"] == STEPS


# ----------------------------------------------------------------- torchtitan's calls
def _titan_stateful(model: torch.nn.Module, optimizer: Shampoo) -> dict[str, Any]:
    """The model and optimizer entries torchtitan's CheckpointManager hands to DCP: its
    ``ModelWrapper`` and ``OptimizersContainer`` (one model part), whose state dicts are
    ``get_model_state_dict`` and ``get_optimizer_state_dict(...,
    flatten_optimizer_state_dict=True)`` and whose loads are the ``set_`` calls."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.stateful import Stateful

    flat = StateDictOptions(flatten_optimizer_state_dict=True)

    class ModelWrapper(Stateful):
        def state_dict(self) -> dict[str, Any]:
            return get_model_state_dict(model)

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            set_model_state_dict(model, state_dict, options=StateDictOptions(strict=False))

    class OptimizersContainer(Stateful):
        def state_dict(self) -> dict[str, Any]:
            return get_optimizer_state_dict(model, optimizer, options=flat)

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            set_optimizer_state_dict(model, optimizer, optim_state_dict=state_dict, options=flat)

    return {"model": ModelWrapper(), "optimizer": OptimizersContainer()}


def test_torchtitan_calls_dcp_save_load_resume_is_bit_identical(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    def train(model: torch.nn.Module, optimizer: Shampoo, start: int, stop: int) -> None:
        x, y = _dataset().tensors
        for step in range(start, stop):
            batch = slice(8 * (step % 4), 8 * (step % 4) + 8)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()

    straight = _mlp(0)
    straight_optimizer = Shampoo(straight.named_parameters(), CONFIG)
    train(straight, straight_optimizer, 0, STEPS)

    first = _mlp(0)
    first_optimizer = Shampoo(first.named_parameters(), CONFIG)
    train(first, first_optimizer, 0, SAVED_AT)
    # No process group: DCP saves and loads as one rank (it warns so).
    dcp.save(_titan_stateful(first, first_optimizer), checkpoint_id=tmp_path / "step7")

    resumed = _mlp(1)
    resumed_optimizer = Shampoo(resumed.named_parameters(), CONFIG)  # no state yet
    dcp.load(_titan_stateful(resumed, resumed_optimizer), checkpoint_id=tmp_path / "step7")
    train(resumed, resumed_optimizer, SAVED_AT, STEPS)

    assert_trees_equal(list(straight.parameters()), list(resumed.parameters()), "params")
    assert_trees_equal(straight_optimizer.state_dict(), resumed_optimizer.state_dict(),
                       "optimizer")
