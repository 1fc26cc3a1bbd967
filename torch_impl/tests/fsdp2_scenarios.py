"""Per-rank bodies of the FSDP2 / HSDP tests (test_fsdp2.py), run by ``processes.spawn``.

A module of parameters of mixed shapes is wrapped by ``fully_shard`` on a
1-D mesh (FSDP) or a 2-D mesh ``(replica, shard)`` (HSDP, world 4 as 2 x 2);
a 0-d parameter (which ``fully_shard`` cannot shard) is a DTensor replicated
on the same mesh. Gradients come from a real backward pass with different
data on every rank (FSDP2 averages them); each rank records the gradients
it saw so the test can replay them on one process or on the reference.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shampoo_spec import (
    BlockingConfig,
    EpsilonConfig,
    FrequentDirectionsConfig,
    GradientFilterConfig,
    GraftingConfig,
    IterateAveragingConfig,
    MomentumConfig,
    ScheduleConfig,
    ShampooConfig,
    StatisticsConfig,
    WeightDecayConfig,
)
from shampoo_torch import DistributedConfig, Shampoo

# 1-d to 4-d, dim 0 not divisible by 2 or 4, smaller than the world (empty pieces),
# blocked (max_preconditioner_dim 4), and merged dims.
SHAPES = {"a": (5,), "b": (1, 3), "c": (3, 2, 2, 2), "m": (7, 6), "e": (2, 9), "big": (10, 8)}
SCALAR = "s"
STEPS = 5
CONFIGS = {
    "parameter_graft": ShampooConfig(
        learning_rate=0.02,
        statistics=StatisticsConfig(beta2=0.95, bias_correction=True),
        epsilon=EpsilonConfig(value=1e-5),
        grafting=GraftingConfig(type="adam", beta2=0.99, bias_correction=True,
                                norm_scope="parameter"),
        gradient_filter=GradientFilterConfig(beta1=0.9, bias_correction=True),
        momentum=MomentumConfig(momentum=0.5, nesterov=True, buffers="separate"),
        weight_decay=WeightDecayConfig(value=0.01, type="direction"),
        blocking=BlockingConfig(max_preconditioner_dim=4),
        schedule=ScheduleConfig(precondition_frequency=2, start_preconditioning_step=2),
    ),
    "block_graft_l2": ShampooConfig(
        learning_rate=0.05,
        factor_dtype="float64",
        epsilon=EpsilonConfig(value=1e-6),
        grafting=GraftingConfig(type="adagrad"),
        weight_decay=WeightDecayConfig(value=0.01, type="l2"),
        blocking=BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None),
    ),
    # Eq. (20d): Schedule-Free averaging (Z elementwise, decayed), eval() and train().
    "schedule_free": ShampooConfig(
        learning_rate=0.05,
        factor_dtype="float64",
        epsilon=EpsilonConfig(value=1e-6),
        grafting=GraftingConfig(type="adagrad"),
        weight_decay=WeightDecayConfig(value=0.01, type="direction"),
        averaging=IterateAveragingConfig(type="schedule_free", train_interp=0.75),
        blocking=BlockingConfig(max_preconditioner_dim=4),
    ),
    # Eqs. (6c), (10d): factors of 4 sketched at rank 1 on their owners, the gradient sum
    # of average_gradients on every rank (lossless) or per piece (local).
    "frequent_directions": ShampooConfig(
        learning_rate=0.05,
        factor_dtype="float64",
        statistics=StatisticsConfig(beta2=0.95),
        epsilon=EpsilonConfig(value=1e-5, scale="relative"),
        grafting=GraftingConfig(type="adagrad"),
        frequent_directions=FrequentDirectionsConfig(rank=1, average_gradients=True,
                                                     reset_every=3),
        blocking=BlockingConfig(max_preconditioner_dim=4),
        schedule=ScheduleConfig(precondition_frequency=2, statistics_frequency=2),
    ),
}
#: case -> (config, parameter dtype). bfloat16 parameters keep float32 state (the
#: config's factor_dtype; elementwise state in the wider of the two), as in one process.
CASES = {
    "parameter_graft_float32": ("parameter_graft", torch.float32),
    "block_graft_l2_float64": ("block_graft_l2", torch.float64),
    "parameter_graft_bfloat16": ("parameter_graft", torch.bfloat16),
    "schedule_free_float64": ("schedule_free", torch.float64),
    "frequent_directions_float64": ("frequent_directions", torch.float64),
}


class Model(torch.nn.Module):
    """``loss = sum_n <p_n, c_n>``: gradient c_n, different on every rank."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.ps = torch.nn.ParameterDict({
            n: torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype))
            for n, s in SHAPES.items()
        })

    def forward(self, cs: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((p * cs[n]).sum() for n, p in self.ps.items())  # type: ignore[return-value]


def _mesh(world: int, hsdp: bool) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if hsdp:
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replica", "shard"))
    return init_device_mesh("cpu", (world,))


def _sharded_model(mesh: Any, dtype: torch.dtype) -> tuple[Model, torch.nn.Parameter]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    model = Model(dtype)
    fully_shard(model, mesh=mesh)
    scalar = torch.nn.Parameter(distribute_tensor(torch.tensor(0.7, dtype=dtype), mesh,
                                                  [Replicate()] * mesh.ndim))
    return model, scalar


def _params(model: Model, scalar: torch.nn.Parameter) -> list[tuple[str, torch.nn.Parameter]]:
    return [*model.ps.items(), (SCALAR, scalar)]


def _as_numpy(ps: list[tuple[str, torch.Tensor]]) -> dict[str, np.ndarray]:
    """bfloat16 (which numpy lacks) as float32: exact, and :func:`_tensor` restores it."""
    return {n: _numpy(p) for n, p in ps}


def _numpy(p: torch.Tensor) -> np.ndarray:
    p = p.detach()
    return (p.float() if p.dtype == torch.bfloat16 else p).numpy().copy()


def _tensor(v: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`_numpy` for a tensor of ``dtype`` (exact)."""
    t = torch.tensor(v)
    assert t.dtype == dtype or (dtype == torch.bfloat16 and t.dtype == torch.float32)
    return t.to(dtype)


def _run_sharded(rank: int, world: int, mesh: Any, case: str, mode: str) -> dict[str, Any]:
    """Steps a fully_shard model; returns whole and local values, gradients, bytes."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    config, dtype = CONFIGS[CASES[case][0]], CASES[case][1]
    model, scalar = _sharded_model(mesh, dtype)
    named = _params(model, scalar)
    opt = Shampoo([{"params": [p for _, p in named], "param_names": [n for n, _ in named],
                    "config": config}], distributed=DistributedConfig(shard_mode=mode))
    start_local = _as_numpy([(n, p.to_local()) for n, p in named])
    start_full = _as_numpy([(n, p.full_tensor()) for n, p in named])
    gen = torch.Generator().manual_seed(100 + rank)
    full_grads, local_grads = [], []
    for t in range(STEPS):
        opt.zero_grad()
        cs = {n: torch.randn(s, generator=gen).to(dtype) for n, s in SHAPES.items()}
        model(cs).backward()
        g = torch.tensor(0.3 * (t + 1) - 0.5, dtype=dtype)  # the scalar's, alike on every rank
        scalar.grad = distribute_tensor(g, mesh, [Replicate()] * mesh.ndim)
        full_grads.append(_as_numpy([(n, p.grad.full_tensor()) for n, p in named]))
        local_grads.append(_as_numpy([(n, p.grad.to_local()) for n, p in named]))
        opt.step()
    averaged: dict[str, Any] = {}
    if config.averaging is not None:  # eq. (20d): x in the parameters, then W back
        opt.eval()
        averaged["eval_full"] = _as_numpy([(n, p.full_tensor()) for n, p in named])
        averaged["eval_local"] = _as_numpy([(n, p.to_local()) for n, p in named])
        opt.train()
    # FSDP2's next forward all-gathers the parameters the optimizer wrote into the pieces.
    direct = float(sum(p.detach().full_tensor().sum() for p in model.ps.values()))
    loss = model({n: torch.ones(s, dtype=dtype) for n, s in SHAPES.items()})
    forward = float(loss.detach())
    loss.backward()  # FSDP2 reshards after the backward pass
    return {
        "forward_sees_update": forward == direct,
        "start_full": start_full, "start_local": start_local,
        "full_grads": full_grads, "local_grads": local_grads,
        "final_full": _as_numpy([(n, p.full_tensor()) for n, p in named]),
        "final_local": _as_numpy([(n, p.to_local()) for n, p in named]),
        "bytes": opt.block_state_bytes(),
        "exchanged_bytes": opt.exchange_bytes,
        "state_dtypes": _state_dtypes(opt),
        **averaged,
    }


def _state_dtypes(opt: Shampoo) -> dict[str, list[str]]:
    """The dtypes of the state held here: factors and roots, and the elementwise state."""
    held = [t for b in opt.blocks() for ts in (b.factors, b.inverse_roots) if ts
            for t in ts if t is not None]
    elementwise = [v for st in opt.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and v.dtype.is_floating_point]
    return {"blocks": sorted({str(t.dtype) for t in held}),
            "elementwise": sorted({str(t.dtype) for t in elementwise})}


def _plain_run(case: str, start: dict[str, np.ndarray], grads: list[dict[str, np.ndarray]],
               evaluated: dict[str, np.ndarray] | None = None,
               ) -> tuple[dict[str, np.ndarray], int]:
    """One process (no distribution) on plain tensors: final values, block bytes; with
    averaging (eq. 20d) ``evaluated`` receives the values after ``eval()``, and the
    final values are taken after the ``train()`` that follows, as the sharded run's.

    Empty tensors (empty pieces) are left out: they take no step.
    """
    config, dtype = CONFIGS[CASES[case][0]], CASES[case][1]
    ps = {n: torch.nn.Parameter(_tensor(v, dtype)) for n, v in start.items() if v.size}
    opt = Shampoo([{"params": list(ps.values()), "param_names": list(ps), "config": config}])
    for step in grads:
        for n, p in ps.items():
            p.grad = _tensor(step[n], dtype)
        opt.step()
    if evaluated is not None and config.averaging is not None:  # as _run_sharded does
        opt.eval()
        evaluated.update({n: (_numpy(ps[n]) if n in ps else v) for n, v in start.items()})
        opt.train()
    out = {n: (_numpy(ps[n]) if n in ps else v) for n, v in start.items()}
    return out, opt.block_state_bytes()


def fsdp(rank: int, world: int) -> dict[str, Any]:
    """Every case in both modes, FSDP (1-D mesh) and, at world 4, HSDP (2 x 2)."""
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    layouts = [("fsdp", False)] + ([("hsdp", True)] if world == 4 else [])
    for layout, hsdp in layouts:
        mesh = _mesh(world, hsdp)
        for case in CASES:
            for mode in ("lossless", "local"):
                got = _run_sharded(rank, world, mesh, case, mode)
                got["single_eval"] = {}
                if mode == "lossless":
                    got["single"], got["single_bytes"] = _plain_run(
                        case, got["start_full"], got["full_grads"], got["single_eval"])
                else:  # the same optimizer on this rank's pieces, as plain tensors
                    got["single"], got["single_bytes"] = _plain_run(
                        case, got["start_local"], got["local_grads"], got["single_eval"])
                out[f"{layout}/{case}/{mode}"] = got
    out["mixed_dtypes"] = mixed_dtypes(rank, world)
    out["errors"] = errors(rank, world)
    out["nonfinite"] = {mode: nonfinite(rank, world, mode) for mode in ("lossless", "local")}
    out["local_agreement"] = local_agreement(rank, world)
    dist.barrier()
    return out


MIXED = {"m": torch.float32, "big": torch.bfloat16, "c": torch.float32, "e": torch.bfloat16}


def mixed_dtypes(rank: int, world: int) -> dict[str, Any]:
    """"lossless", one param group of float32 and bfloat16 DTensors (Shard(0), as
    fully_shard places them): one gather per dtype, each buffer kept between steps."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(world, False)
    gen = torch.Generator().manual_seed(3)
    start = {n: torch.randn(SHAPES[n], generator=gen).to(dt) for n, dt in MIXED.items()}
    named = [(n, torch.nn.Parameter(distribute_tensor(v, mesh, [Shard(0)])))
             for n, v in start.items()]
    opt = Shampoo(named, CONFIGS["parameter_graft"], distributed=DistributedConfig())
    pieces = opt._plans[0].pieces
    buffers = []
    for t in range(STEPS):
        _set_grads(named, mesh, t)
        opt.step()
        buffers.append(sorted((str(k[1]), v[0].data_ptr(), v[1].data_ptr())
                              for k, v in pieces._buffers.items()))
    plain = {n: torch.nn.Parameter(v.clone()) for n, v in start.items()}
    plain_opt = Shampoo(list(plain.items()), CONFIGS["parameter_graft"])
    for t in range(STEPS):
        for n, q in plain.items():
            q.grad = torch.tensor(checkpoint_grads()[t][n]).to(q.dtype)
        plain_opt.step()
    return {"final": _as_numpy([(n, p.full_tensor()) for n, p in named]),
            "single": _as_numpy(list(plain.items())), "buffers": buffers,
            "dtypes": {n: str(p.dtype) for n, p in named}}


def nonfinite(rank: int, world: int, mode: str) -> dict[str, Any]:
    """A NaN in the last row of "m" (the last rank's piece): every rank raises, nothing moves."""
    from torch.distributed.tensor import distribute_tensor

    from shampoo_spec import NonFiniteGradientError

    mesh = _mesh(world, False)
    model, scalar = _sharded_model(mesh, torch.float32)
    named = _params(model, scalar)
    opt = Shampoo(named, CONFIGS["parameter_graft"], distributed=DistributedConfig(shard_mode=mode))
    _set_grads(named, mesh, 0)
    opt.step()
    before = _as_numpy([(n, p.to_local()) for n, p in named])
    _set_grads(named, mesh, 1)
    m = dict(named)["m"]
    bad = torch.tensor(checkpoint_grads()[1]["m"])
    bad[-1, 0] = float("nan")
    m.grad = distribute_tensor(bad, mesh, m.placements)
    try:
        opt.step()
        message = ""
    except NonFiniteGradientError as err:
        message = str(err)
    after = _as_numpy([(n, p.to_local()) for n, p in named])
    return {"message": message,
            "unchanged": all(np.array_equal(before[n], after[n]) for n in before)}


def errors(rank: int, world: int) -> dict[str, str]:
    """Clear ValueErrors: no distributed config, a bad placement, a conflicting field."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(world, False)
    model, scalar = _sharded_model(mesh, torch.float32)
    named = _params(model, scalar)
    found: dict[str, str] = {}
    attempts: dict[str, Any] = {
        "no_config": lambda: Shampoo(named),
        "shard_dim_1": lambda: Shampoo(
            [("x", torch.nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh, [Shard(1)])))],
            distributed=DistributedConfig()),
        "trainers": lambda: Shampoo(named, distributed=DistributedConfig(trainers_per_group=1)),
        "mixed": lambda: Shampoo([*named, ("plain", torch.nn.Parameter(torch.zeros(3)))],
                                 distributed=DistributedConfig()),
    }
    for key, attempt in attempts.items():
        try:
            attempt()
            found[key] = ""
        except ValueError as err:
            found[key] = str(err)
    return found


# ---------------------------------------------------------- checkpoints
HALF = 3
CHECKPOINT_CASE = "parameter_graft"
CASES_OF_CHECKPOINT = "parameter_graft_float32"  # its CASES entry (float32 parameters)


def checkpoint_grads() -> list[dict[str, np.ndarray]]:
    """Whole gradients per step, the same at any world size (and for one process)."""
    shapes = {**SHAPES, SCALAR: ()}
    out = []
    for t in range(STEPS):
        gen = torch.Generator().manual_seed(1000 + t)
        out.append({n: torch.randn(s, generator=gen).numpy() for n, s in shapes.items()})
    return out


def _set_grads(named: list[tuple[str, torch.nn.Parameter]], mesh: Any, t: int) -> None:
    """Step t's gradients of :func:`checkpoint_grads` as DTensors."""
    from torch.distributed.tensor import distribute_tensor

    whole = checkpoint_grads()[t]
    for n, p in named:
        p.grad = distribute_tensor(torch.tensor(whole[n]).to(p.dtype), mesh, p.placements)


def _checkpoint_optimizer(world: int, config: ShampooConfig = CONFIGS[CHECKPOINT_CASE],
                          ) -> tuple[Any, list[tuple[str, torch.nn.Parameter]], Shampoo]:
    mesh = _mesh(world, False)
    model, scalar = _sharded_model(mesh, torch.float32)
    named = _params(model, scalar)
    opt = Shampoo([{"params": [p for _, p in named], "param_names": [n for n, _ in named],
                    "config": config}], distributed=DistributedConfig())
    return mesh, named, opt


def checkpoint_save(rank: int, world: int, directory: str) -> dict[str, Any]:
    """HALF steps, a torch.distributed.checkpoint save, then on uninterrupted."""
    import torch.distributed.checkpoint as dcp

    mesh, named, opt = _checkpoint_optimizer(world)
    start = _as_numpy([(n, p.full_tensor()) for n, p in named])
    for t in range(HALF):
        _set_grads(named, mesh, t)
        opt.step()
    dcp.save({"model": dict(named), "optimizer": opt.distributed_state_dict()},
             checkpoint_id=directory)
    for t in range(HALF, STEPS):
        _set_grads(named, mesh, t)
        opt.step()
    single, _ = _plain_run(CASES_OF_CHECKPOINT, start, checkpoint_grads())  # one thread here
    return {"final": _as_numpy([(n, p.full_tensor()) for n, p in named]), "single": single}


def checkpoint_load(rank: int, world: int, directories: list[str]) -> dict[str, Any]:
    """Each checkpoint loaded into a fresh model and optimizer, continued to STEPS."""
    import torch.distributed.checkpoint as dcp

    out: dict[str, Any] = {}
    for directory in directories:
        mesh, named, opt = _checkpoint_optimizer(world)
        sd = {"model": dict(named), "optimizer": opt.distributed_state_dict()}
        dcp.load(sd, checkpoint_id=directory)
        opt.load_distributed_state_dict(sd["optimizer"])
        for t in range(HALF, STEPS):
            _set_grads(named, mesh, t)
            opt.step()
        out[directory] = _as_numpy([(n, p.full_tensor()) for n, p in named])
    # A state saved under another config is refused, naming the fields (the
    # template's config is this optimizer's: the saved one replaces it).
    other = dataclasses.replace(CONFIGS[CHECKPOINT_CASE], epsilon=EpsilonConfig(value=1e-4))
    _, named, opt = _checkpoint_optimizer(world, other)
    sd = {"model": dict(named), "optimizer": opt.distributed_state_dict()}
    dcp.load(sd, checkpoint_id=directories[0])
    try:
        opt.load_distributed_state_dict(sd["optimizer"])
        out["mismatch"] = ""
    except ValueError as err:
        out["mismatch"] = str(err)
    # shard_mode="local": the pieces' state depends on the world size; refused.
    mesh = _mesh(world, False)
    model, scalar = _sharded_model(mesh, torch.float32)
    local_opt = Shampoo(_params(model, scalar), distributed=DistributedConfig(shard_mode="local"))
    try:
        local_opt.distributed_state_dict()
        out["local"] = ""
    except ValueError as err:
        out["local"] = str(err)
    dist.barrier()
    return out


def local_agreement(rank: int, world: int) -> dict[str, str]:
    """"local", one (2, 3) parameter: rank 1 holds row 1, ranks >= 2 nothing at all.

    A NaN in row 1, then gradients of 2e18 in row 1 whose float32 roots fail
    (eq. 13 limit 1): every rank raises each error, the empty ranks too.
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    from shampoo_spec import FailureConfig, NonFiniteGradientError, RootFailureError

    mesh = _mesh(world, False)
    config = ShampooConfig(epsilon=EpsilonConfig(value=1e-3),
                           statistics=StatisticsConfig(beta2=0.999, ema_weight="one",
                                                       bias_correction=True),
                           blocking=BlockingConfig(merge_dims_up_to=None),
                           failure=FailureConfig(max_consecutive_root_failures=1))
    out = {}
    for what, value in (("nonfinite", float("nan")), ("root", 2e18)):
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(2, 3), mesh, [Shard(0)]))
        opt = Shampoo([("p", p)], config, distributed=DistributedConfig(shard_mode="local"))
        g = torch.ones(2, 3)
        g[1] = value
        try:
            for _ in range(3):
                p.grad = distribute_tensor(g, mesh, [Shard(0)])
                opt.step()
            out[what] = ""
        except (NonFiniteGradientError, RootFailureError) as err:
            out[what] = f"{type(err).__name__}: {err}"
    return out


# ------------------------------------------------- checkpoints across modes
#: The distributed state dict is one format for every mode: FSDP2 "lossless" (2
#: ranks) -> DDP (2 ranks) -> one process, and one process -> FSDP2.
MODE_CASES = ("parameter_graft_float32", "parameter_graft_bfloat16")
FSDP_END, DDP_END = 2, 4  # FSDP2 steps 0-1, DDP 2-3, one process 4; back: one process 0-1


def _plain_params(case: str, values: dict[str, torch.Tensor] | None = None,
                  ) -> list[tuple[str, torch.nn.Parameter]]:
    """Plain parameters: the model's initial values, or ``values`` (a checkpoint's)."""
    dtype = CASES[case][1]
    model = Model(dtype)  # its order (ParameterDict sorts the names) is the sharded one's
    if values is None:
        values = {**{n: p.detach() for n, p in model.ps.items()},
                  SCALAR: torch.tensor(0.7, dtype=dtype)}
    return [(n, torch.nn.Parameter(values[n].clone())) for n in [*model.ps, SCALAR]]


def _optimizer(case: str, named: list[tuple[str, torch.nn.Parameter]],
               distributed: DistributedConfig | None) -> Shampoo:
    return Shampoo([{"params": [p for _, p in named], "param_names": [n for n, _ in named],
                     "config": CONFIGS[CASES[case][0]]}], distributed=distributed)


def _plain_steps(named: list[tuple[str, torch.nn.Parameter]], opt: Shampoo, steps: range,
                 ) -> None:
    for t in steps:
        whole = checkpoint_grads()[t]
        for n, p in named:
            p.grad = torch.tensor(whole[n]).to(p.dtype)
        opt.step()


def _sharded_steps(named: list[tuple[str, torch.nn.Parameter]], mesh: Any, opt: Shampoo,
                   steps: range) -> None:
    for t in steps:
        _set_grads(named, mesh, t)
        opt.step()


def _fsdp_optimizer(case: str, world: int,
                    ) -> tuple[Any, list[tuple[str, torch.nn.Parameter]], Shampoo]:
    mesh = _mesh(world, False)
    named = _params(*_sharded_model(mesh, CASES[case][1]))
    return mesh, named, _optimizer(case, named, DistributedConfig(shard_mode="lossless"))


def modes_start(rank: int, world: int, directory: str) -> dict[str, Any]:
    """FSDP2 steps 0-1 saved by DCP (then on to STEPS, uninterrupted), converted to a
    torch.save file; one process (rank 0, no distribution) steps 0-1 saved by torch.save;
    the uninterrupted one-process run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    out: dict[str, Any] = {}
    for case in MODE_CASES:
        mesh, named, opt = _fsdp_optimizer(case, world)
        start = _as_numpy([(n, p.full_tensor()) for n, p in named])
        _sharded_steps(named, mesh, opt, range(FSDP_END))
        dcp.save({"model": dict(named), "optimizer": opt.distributed_state_dict()},
                 checkpoint_id=f"{directory}/{case}/fsdp")
        _sharded_steps(named, mesh, opt, range(FSDP_END, STEPS))
        out[case] = {"fsdp": _as_numpy([(n, p.full_tensor()) for n, p in named])}
        if rank == 0:
            out[case]["single"], _ = _plain_run(case, start, checkpoint_grads())
            plain = _plain_params(case)
            plain_opt = _optimizer(case, plain, None)
            _plain_steps(plain, plain_opt, range(FSDP_END))
            torch.save({"model": {n: p.detach() for n, p in plain},
                        "optimizer": plain_opt.distributed_state_dict()},
                       f"{directory}/{case}/single.pt")
            torch_save_to_dcp(f"{directory}/{case}/single.pt", f"{directory}/{case}/single")
        dist.barrier()  # the DCP checkpoint is complete
        if rank == 0:
            dcp_to_torch_save(f"{directory}/{case}/fsdp", f"{directory}/{case}/fsdp.pt")
    dist.barrier()
    return out


def modes_middle(rank: int, world: int, directory: str) -> dict[str, Any]:
    """DDP (plain tensors, DistributedConfig()) from the FSDP2 file, steps 2-3, saved by
    rank 0; FSDP2 from the one-process checkpoint (torch.load on every rank, and through
    DCP), steps 2-4; then on rank 0 a plain Shampoo (one process, no distribution) from
    the DDP file, step 4."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import distribute_tensor

    out: dict[str, Any] = {}
    for case in MODE_CASES:
        saved = torch.load(f"{directory}/{case}/fsdp.pt", weights_only=True)
        named = _plain_params(case, saved["model"])
        opt = _optimizer(case, named, DistributedConfig())
        opt.load_distributed_state_dict(saved["optimizer"])
        _plain_steps(named, opt, range(FSDP_END, DDP_END))
        sd = opt.distributed_state_dict()  # a collective: every rank
        if rank == 0:
            torch.save({"model": {n: p.detach() for n, p in named}, "optimizer": sd},
                       f"{directory}/{case}/ddp.pt")
        out[case] = {}
        # One process -> FSDP2, (a) every rank reads the torch.save file itself.
        mesh, named, opt = _fsdp_optimizer(case, world)
        saved = torch.load(f"{directory}/{case}/single.pt", weights_only=True)
        with torch.no_grad():
            for n, p in named:
                p.copy_(distribute_tensor(saved["model"][n], mesh, p.placements))
        opt.load_distributed_state_dict(saved["optimizer"])
        _sharded_steps(named, mesh, opt, range(FSDP_END, STEPS))
        out[case]["single_to_fsdp"] = _as_numpy([(n, p.full_tensor()) for n, p in named])
        # (b) through DCP (torch_save_to_dcp of the same file), as an FSDP2 run loads.
        mesh, named, opt = _fsdp_optimizer(case, world)
        loaded = {"model": dict(named), "optimizer": opt.distributed_state_dict()}
        dcp.load(loaded, checkpoint_id=f"{directory}/{case}/single")
        opt.load_distributed_state_dict(loaded["optimizer"])
        _sharded_steps(named, mesh, opt, range(FSDP_END, STEPS))
        out[case]["single_to_fsdp_dcp"] = _as_numpy([(n, p.full_tensor()) for n, p in named])
    dist.barrier()  # ddp.pt is written
    if rank == 0:  # one process (no distribution) from the DDP file: the last step
        for case in MODE_CASES:
            saved = torch.load(f"{directory}/{case}/ddp.pt", weights_only=True)
            named = _plain_params(case, saved["model"])
            opt = _optimizer(case, named, None)
            opt.load_distributed_state_dict(saved["optimizer"])
            _plain_steps(named, opt, range(DDP_END, STEPS))
            out[case]["ddp_to_single"] = _as_numpy(named)
    return out


