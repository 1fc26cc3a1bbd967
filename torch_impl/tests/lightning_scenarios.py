"""PyTorch Lightning with Shampoo: an uninterrupted fit, and a fit stopped, saved and resumed.

A small float64 MLP whose ``configure_optimizers`` returns :class:`shampoo_torch.Shampoo`
(AdaGrad grafting, a gradient filter, Nesterov momentum, roots every 3 steps), on a
fixed dataset read in order (4 batches per process and epoch). :func:`fit_and_resume`
fits 3 epochs straight, then 1 epoch that ends in ``trainer.save_checkpoint``, then a
fresh module and Trainer resumed from that file (``ckpt_path``) to 3 epochs; the
resumed run starts at step 4, in the middle of a root period.

The checkpoint is taken at an epoch's end: Lightning 2.6 resumes an epoch it
stopped in (``max_steps``, a mid-epoch save) from the start of its data loader
unless that loader is stateful, so a mid-epoch resume replays batches, whatever the
optimizer.

Run as a script (``python lightning_scenarios.py OUT``) it fits with
``strategy="ddp"`` on 2 CPU processes (gloo; Lightning starts the second process by
running this script again) and writes each rank's results to ``OUT/rank{r}.pt``
(test_trainers.py). Imports nothing from the tests, so it runs as a file.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

from shampoo_spec import (
    GradientFilterConfig,
    GraftingConfig,
    MomentumConfig,
    ScheduleConfig,
    ShampooConfig,
)
from shampoo_torch import Shampoo

CONFIG = ShampooConfig(
    learning_rate=0.05,
    grafting=GraftingConfig(type="adagrad"),
    gradient_filter=GradientFilterConfig(beta1=0.9),
    momentum=MomentumConfig(momentum=0.5, nesterov=True),
    schedule=ScheduleConfig(precondition_frequency=3, start_preconditioning_step=2),
    factor_dtype="float64",
)
BATCH = 8
#: Batches per process and epoch; the checkpoint is taken after the first epoch.
BATCHES = 4
EPOCHS = 3


class ShampooMLP(L.LightningModule):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Shampoo:
        return Shampoo(self.named_parameters(), CONFIG)


def loader(processes: int) -> torch.utils.data.DataLoader:
    """The same samples in the same order every time (Lightning shards them over DDP)."""
    generator = torch.Generator().manual_seed(1)
    n = BATCH * BATCHES * processes
    x = torch.randn(n, 8, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def trainer(epochs: int, strategy: str, processes: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=processes, strategy=strategy, max_epochs=epochs,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,  # deterministic=True is not needed on CPU (and is global)
    )


def snapshot(module: ShampooMLP, fitted: L.Trainer) -> dict[str, Any]:
    """The parameters, the optimizer's state dict and the step count after a fit."""
    return {
        "params": [p.detach().clone() for p in module.parameters()],
        "optimizer": fitted.optimizers[0].state_dict(),
        "global_step": fitted.global_step,
    }


def fit_and_resume(checkpoint: Path, strategy: str = "auto",
                   processes: int = 1) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(straight, resumed, this process's rank): :func:`snapshot` of the uninterrupted fit
    and of the fit resumed from ``checkpoint`` (written after its first epoch)."""
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    straight = ShampooMLP()
    run = trainer(EPOCHS, strategy, processes)
    run.fit(straight, loader(processes))
    uninterrupted = snapshot(straight, run)

    first = ShampooMLP()
    run = trainer(1, strategy, processes)
    run.fit(first, loader(processes))
    run.save_checkpoint(checkpoint)

    resumed = ShampooMLP(seed=1)  # other weights: the checkpoint must restore them
    run = trainer(EPOCHS, strategy, processes)
    run.fit(resumed, loader(processes), ckpt_path=checkpoint)
    return uninterrupted, snapshot(resumed, run), run.global_rank


if __name__ == "__main__":
    out = Path(sys.argv[1])
    straight, resumed, rank = fit_and_resume(out / "epoch1.ckpt", strategy="ddp", processes=2)
    torch.save({"straight": straight, "resumed": resumed}, out / f"rank{rank}.pt")
