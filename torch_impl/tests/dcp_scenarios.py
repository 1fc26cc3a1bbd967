"""Per-rank scenarios of test_torch_checkpoint_path.py: torch's standard checkpoint path.

A model's optimizer state is saved with
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` (three
option sets: default, ``full_state_dict`` with ``cpu_offload``, and
``flatten_optimizer_state_dict``) and restored with
``set_optimizer_state_dict``: through ``dcp.save`` / ``dcp.load`` (the
default and flattened dicts; the default one in the ``Stateful`` app-state
pattern of torch's tutorial) or a ``torch.save`` file written by rank 0
(the full dict). Modes: DDP-style block distribution (``"ddp"``), FSDP2
``fully_shard`` ``"lossless"`` and ``"local"``, and HSDP (a 2 x 2 mesh) in both.

Stages, each continuing a run of :data:`STEPS` steps with the same whole
gradients: :func:`first` (world 2) saves every mode at step :data:`FIRST`;
:func:`second` (world 4) loads the portable checkpoints into another mode,
steps to :data:`SECOND` and saves again (and saves and reloads HSDP
``"local"``); :func:`third` (world 2) loads those, and the local ones of
:func:`first`, and runs to the end. Every rank returns
its whole parameters at the end and at each save.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shampoo_spec import (
    BlockingConfig,
    EpsilonConfig,
    GradientFilterConfig,
    GraftingConfig,
    MomentumConfig,
    ScheduleConfig,
    ShampooConfig,
)
from shampoo_torch import DistributedConfig, Shampoo

#: dim 0 uneven at 2 and 4 ranks, smaller than the world (empty pieces), blocked.
SHAPES = {"a": (5, 3), "b": (3,), "c": (2, 3, 4), "d": (1, 6), "e": (9, 5)}
STEPS, FIRST, SECOND = 7, 3, 5
#: Rich state: graft, filter, momentum, several blocks, mid-period resumes (roots every 2).
CONFIG = ShampooConfig(
    learning_rate=0.05,
    epsilon=EpsilonConfig(value=1e-5),
    grafting=GraftingConfig(type="adagrad"),
    gradient_filter=GradientFilterConfig(beta1=0.9),
    momentum=MomentumConfig(momentum=0.5),
    blocking=BlockingConfig(max_preconditioner_dim=4),
    schedule=ScheduleConfig(precondition_frequency=2),
)
OPTIONS = ("default", "full", "flat")
#: Modes whose checkpoint holds whole parameters' state (loadable in any of them).
PORTABLE = ("ddp", "lossless", "hsdp")


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.ps = torch.nn.ParameterDict({
            n: torch.nn.Parameter(torch.randn(s, generator=gen)) for n, s in SHAPES.items()})


def gradients(t: int) -> dict[str, torch.Tensor]:
    """Step t's whole gradients (the same at every world size and in one process)."""
    gen = torch.Generator().manual_seed(100 + t)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def options(name: str) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return {"default": StateDictOptions(),
            "full": StateDictOptions(full_state_dict=True, cpu_offload=True),
            "flat": StateDictOptions(flatten_optimizer_state_dict=True)}[name]


def build(mode: str, world: int) -> tuple[Model, Shampoo, Any]:
    """A fresh model and optimizer in ``mode`` ("one": a plain Shampoo, no process group)."""
    model = Model()
    mesh = None
    if mode in ("lossless", "local", "hsdp", "hsdp_local"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        hsdp = mode.startswith("hsdp")
        mesh = init_device_mesh("cpu", (2, world // 2) if hsdp else (world,),
                                mesh_dim_names=("replica", "shard") if hsdp else ("shard",))
        fully_shard(model, mesh=mesh)
    named = list(model.named_parameters())
    distributed = None if mode == "one" else DistributedConfig(
        shard_mode="local" if mode.endswith("local") else "lossless")
    return model, Shampoo(named, CONFIG, distributed=distributed), mesh


def run(model: Model, opt: Shampoo, mesh: Any, steps: range) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    for t in steps:
        whole = gradients(t)
        for n, p in model.named_parameters():
            g = whole[n.removeprefix("ps.")]
            p.grad = (distribute_tensor(g, mesh, p.placements) if isinstance(p, DTensor)
                      else g.clone())
        opt.step()


def whole(model: Model) -> dict[str, np.ndarray]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().numpy().copy()
            for n, p in model.named_parameters()}


class AppState:
    """The ``Stateful`` app state of torch's DCP tutorial: model and optimizer through
    ``get_state_dict`` / ``set_state_dict``."""

    def __init__(self, model: Model, opt: Shampoo) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.opt, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])


def save(model: Model, opt: Shampoo, option: str, path: str, distributed: bool = True
         ) -> None:
    """Save model and optimizer the way ``option`` does (a collective when distributed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    if option == "default":
        dcp.save({"app": AppState(model, opt)}, checkpoint_id=path, no_dist=not distributed)
        return
    model_sd = get_model_state_dict(model, options=options(option))
    optim_sd = get_optimizer_state_dict(model, opt, options=options(option))
    if option == "flat":
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path,
                 no_dist=not distributed)
    elif not distributed or dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        torch.save({"model": model_sd, "optim": optim_sd}, os.path.join(path, "full.pt"))
    if distributed:
        dist.barrier()


def load(model: Model, opt: Shampoo, option: str, path: str, distributed: bool = True
         ) -> None:
    """Restore what :func:`save` wrote with ``option`` into a fresh model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if option == "default":
        dcp.load({"app": AppState(model, opt)}, checkpoint_id=path, no_dist=not distributed)
        return
    if option == "flat":
        sd = {"model": get_model_state_dict(model, options=options(option)),
              "optim": get_optimizer_state_dict(model, opt, options=options(option))}
        dcp.load(sd, checkpoint_id=path, no_dist=not distributed)
    else:
        sd = torch.load(os.path.join(path, "full.pt"), weights_only=True)
    set_model_state_dict(model, sd["model"], options=options(option))
    set_optimizer_state_dict(model, opt, sd["optim"], options=options(option))


def _modes(world: int) -> tuple[str, ...]:
    return ("ddp", "lossless", "local") + (("hsdp", "hsdp_local") if world == 4 else ())


def _next(mode: str, world: int) -> str:
    """The portable mode a checkpoint of ``mode`` is loaded into at ``world`` ranks."""
    portable = [m for m in PORTABLE if m in _modes(world)]
    return portable[(portable.index(mode) + 1) % len(portable)] if mode in portable \
        else portable[0]


def first(rank: int, world: int, root: str) -> dict[str, Any]:
    """World 2: every mode and option runs FIRST steps and saves, then runs to the end."""
    out: dict[str, Any] = {}
    for mode in _modes(world):
        for option in OPTIONS:
            model, opt, mesh = build(mode, world)
            run(model, opt, mesh, range(FIRST))
            save(model, opt, option, os.path.join(root, f"first-{mode}-{option}"))
            run(model, opt, mesh, range(FIRST, STEPS))
            out[f"{mode}/{option}"] = whole(model)
    one, one_opt, _ = build("one", world)
    run(one, one_opt, None, range(STEPS))
    out["uninterrupted"] = whole(one)
    return out


def second(rank: int, world: int, root: str) -> dict[str, Any]:
    """World 4: each portable checkpoint of :func:`first` (and of one process) loads into
    the next portable mode, runs to SECOND, saves, and runs to the end."""
    out: dict[str, Any] = {}
    for source in ("one", *PORTABLE[:2]):
        for option in OPTIONS:
            mode = _next(source, world)
            model, opt, mesh = build(mode, world)
            load(model, opt, option, os.path.join(root, f"first-{source}-{option}"))
            run(model, opt, mesh, range(FIRST, SECOND))
            save(model, opt, option, os.path.join(root, f"second-{mode}-{option}"))
            run(model, opt, mesh, range(SECOND, STEPS))
            out[f"{source}->{mode}/{option}"] = whole(model)
    for option in OPTIONS:  # HSDP "local": saved and loaded at the same mesh
        model, opt, mesh = build("hsdp_local", world)
        run(model, opt, mesh, range(FIRST))
        path = os.path.join(root, f"second-hsdp_local-{option}")
        save(model, opt, option, path)
        run(model, opt, mesh, range(FIRST, STEPS))
        out[f"hsdp_local/{option}"] = whole(model)
        model, opt, mesh = build("hsdp_local", world)
        load(model, opt, option, path)
        run(model, opt, mesh, range(FIRST, STEPS))
        out[f"hsdp_local->hsdp_local/{option}"] = whole(model)
    return out


def third(rank: int, world: int, root: str) -> dict[str, Any]:
    """World 2: the checkpoints of :func:`second` load into the portable modes, and the
    local ones of :func:`first` into ``"local"`` (same shard group size), to the end.
    Also: a local checkpoint refused by a lossless optimizer, naming why."""
    out: dict[str, Any] = {}
    for saved in ("lossless", "hsdp", "ddp"):
        for option in OPTIONS:
            path = os.path.join(root, f"second-{saved}-{option}")
            if not os.path.isdir(path):
                continue
            mode = _next(saved, world)
            model, opt, mesh = build(mode, world)
            load(model, opt, option, path)
            run(model, opt, mesh, range(SECOND, STEPS))
            out[f"{saved}->{mode}/{option}"] = whole(model)
    for option in OPTIONS:
        model, opt, mesh = build("local", world)
        load(model, opt, option, os.path.join(root, f"first-local-{option}"))
        run(model, opt, mesh, range(FIRST, STEPS))
        out[f"local->local/{option}"] = whole(model)
    # Given as it was saved (default options: torch passes the entries on as they are);
    # with full_state_dict=True torch first merges them into this optimizer's own layout
    # and stops at the first key it lacks (a KeyError of torch's, before any check of ours).
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    model, opt, mesh = build("lossless", world)
    saved = torch.load(os.path.join(root, "first-local-full", "full.pt"), weights_only=True)
    try:
        set_optimizer_state_dict(model, opt, saved["optim"])
        out["local->lossless"] = ""
    except ValueError as err:
        out["local->lossless"] = str(err)
    return out
