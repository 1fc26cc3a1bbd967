"""Per-rank bodies of the distributed tests, run by ``shampoo_torch.processes.spawn``.

Each function runs on every rank of a gloo group (one thread per process)
and returns plain data (numpy arrays, strings) for the test to assert on.
Where a rank needs the single-process result it computes it itself, in the
same process and thread setting, with the plain ``Shampoo``.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shampoo_spec import (
    BlockingConfig,
    CoupledNewtonConfig,
    EigenvalueCorrectionConfig,
    EpsilonConfig,
    ExponentConfig,
    FailureConfig,
    FrequentDirectionsConfig,
    GradientFilterConfig,
    GraftingConfig,
    MomentumConfig,
    ScheduleConfig,
    ShampooConfig,
    StatisticsConfig,
    WeightDecayConfig,
)
from shampoo_torch import DistributedConfig, NonFiniteGradientError, RootFailureError, Shampoo

# "m": 20 blocks of one shape, so batched elementwise kernels run vectorized; "b*": with
# large blocks, a block group of three 24-vectors whose statistics take the MKL paths
# (shampoo_torch.invariance says why both matter).
SHAPES = {"w": (6, 9), "v": (9,), "t": (2, 3, 4), "s": (), "r": (1, 5), "m": (16, 20),
          "b1": (24,), "b2": (24,), "b3": (24,)}
STEPS = 7
RICH = ShampooConfig(
    learning_rate=0.02,
    statistics=StatisticsConfig(beta2=0.95, bias_correction=True),
    epsilon=EpsilonConfig(value=1e-5),
    grafting=GraftingConfig(type="adam", beta2=0.99, bias_correction=True),
    gradient_filter=GradientFilterConfig(beta1=0.9, bias_correction=True),
    momentum=MomentumConfig(momentum=0.5, nesterov=True, buffers="separate"),
    blocking=BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None),
    schedule=ScheduleConfig(precondition_frequency=3, start_preconditioning_step=2),
)
ADAFACTOR = dataclasses.replace(
    RICH, grafting=GraftingConfig(type="adafactor", epsilon_placement="inside_sqrt",
                                  epsilon=1e-8, factor_min_dim=3, clip_rms=1.0,
                                  parameter_scale_floor=1e-3),
    failure=FailureConfig(nonfinite_gradient="skip_block"))
Groups = Callable[[dict[str, torch.nn.Parameter]], list[dict[str, Any]]]
#: RICH's changes for frequent directions (eqs. 6c, 10d): the factors of 4 sketched at
#: rank 1, gradients averaged over the period of 3, the sketches emptied at step 6.
FREQUENT_DIRECTIONS: dict[str, Any] = {
    "statistics": StatisticsConfig(beta2=0.95), "factor_dtype": "float64",
    "frequent_directions": FrequentDirectionsConfig(rank=1, average_gradients=True,
                                                    reset_every=5),
    "schedule": ScheduleConfig(precondition_frequency=3, statistics_frequency=3,
                               start_preconditioning_step=2),
    "failure": FailureConfig(nonfinite_gradient="skip_block"),
}


def _one_group(config: ShampooConfig) -> Groups:
    return lambda ps: [{"params": list(ps.values()), "param_names": list(ps), "config": config}]


def _two_groups(ps: dict[str, torch.nn.Parameter]) -> list[dict[str, Any]]:
    first = dataclasses.replace(RICH, weight_decay=WeightDecayConfig(value=0.01, type="l2"))
    second = dataclasses.replace(
        RICH, factor_dtype="float64", epsilon=EpsilonConfig(value=1e-4, scale="relative"),
        exponents=ExponentConfig(override=6.0),
        grafting=GraftingConfig(type="rmsprop", beta2=0.9, norm_scope="parameter"),
    )
    names = list(ps)
    return [
        {"params": [ps[n] for n in names[:3]], "param_names": names[:3], "config": first},
        {"params": [ps[n] for n in names[3:]], "param_names": names[3:], "config": second,
         "lr": 0.05},
    ]


#: name -> (param groups, parameter dtype, DistributedConfig keywords).
CASES: dict[str, tuple[Groups, torch.dtype, dict[str, Any]]] = {
    "rich_float32": (_one_group(RICH), torch.float32, {}),
    "eigenvalue_correction_root3_float64": (
        _one_group(dataclasses.replace(
            RICH, eigenvalue_correction=EigenvalueCorrectionConfig(root=3.0),
            factor_dtype="float64", momentum=MomentumConfig(momentum=0.9))),
        torch.float64, {"communication_dtype": "float64"},
    ),
    "newton_skip_block_parameter_graft_float64_comm": (
        _one_group(dataclasses.replace(
            RICH, root_inverse=CoupledNewtonConfig(),
            failure=FailureConfig(nonfinite_gradient="skip_block"),
            grafting=GraftingConfig(type="adagrad", norm_scope="parameter"))),
        torch.float32, {"communication_dtype": "float64"},
    ),
    "two_groups_float32_and_float64_factors": (_two_groups, torch.float32, {}),
    # Eq. (20b): int8 momentum buffers (separate) with float32 scales, on every rank alike.
    "int8_momentum": (
        _one_group(dataclasses.replace(RICH, momentum=dataclasses.replace(
            RICH.momentum, storage="int8_columnwise"))),
        torch.float32, {},
    ),
    # Eq. (21a): every rank rounds the update of every block (its own too) to
    # bfloat16, as Meta's DDP all-gather buffer does: equal to one process.
    "update_bfloat16_float64": (
        _one_group(dataclasses.replace(RICH, factor_dtype="float64", update_dtype="bfloat16")),
        torch.float64, {},
    ),
    # Eq. (11b): factors stored in float16 on their owner ranks, eq. 3's float16 limit
    # decided on every rank alike (skip_block).
    "float16_factors_skip_block": (
        _one_group(dataclasses.replace(
            RICH, factor_storage_dtype="float16",
            failure=FailureConfig(nonfinite_gradient="skip_block"))),
        torch.float32, {},
    ),
    # Eqs. (6c), (10d): sketches on their owner ranks, the gradient sum on every rank.
    "frequent_directions_skip_block_float64": (
        _one_group(dataclasses.replace(RICH, **FREQUENT_DIRECTIONS)), torch.float64,
        {"communication_dtype": "float64"},
    ),
    # Eq. (14e): the Adafactor moments of whole parameters ("w", "m", "t" factored; "v",
    # "r", "s" not), updated alike on every rank; a refused block of "w" keeps them.
    "adafactor_skip_block": (_one_group(ADAFACTOR), torch.float32, {}),
    "large_blocks_adagrad_sum": (
        _one_group(dataclasses.replace(
            RICH, statistics=StatisticsConfig(),
            blocking=BlockingConfig(max_preconditioner_dim=32, merge_dims_up_to=None))),
        torch.float32, {},
    ),
}
#: Lossy communication: (dtype name, unit roundoff).
LOSSY = {"bfloat16": 2.0**-8, "float16": 2.0**-11}
LOSSY_CONFIG = dataclasses.replace(
    RICH, momentum=MomentumConfig(), gradient_filter=GradientFilterConfig(),
    grafting=GraftingConfig(type="adagrad", norm_scope="parameter"),
)


def make_params(dtype: torch.dtype, shapes: dict[str, tuple[int, ...]] = SHAPES,
                seed: int = 0) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype))
            for n, s in shapes.items()}


def make_grads(steps: int, shapes: dict[str, tuple[int, ...]] = SHAPES,
               seed: int = 1) -> list[dict[str, torch.Tensor | None]]:
    """Gradients, the same on every rank; parameter ``v`` (if any) misses step 3."""
    gen = torch.Generator().manual_seed(seed)
    out: list[dict[str, torch.Tensor | None]] = []
    for t in range(1, steps + 1):
        step: dict[str, torch.Tensor | None] = {
            n: torch.randn(s, generator=gen) for n, s in shapes.items()
        }
        if t == 3 and "v" in step:
            step["v"] = None
        out.append(step)
    return out


def _feed(ps: dict[str, torch.nn.Parameter], step: dict[str, torch.Tensor | None]) -> None:
    for n, p in ps.items():
        g = step[n]
        p.grad = None if g is None else g.to(p.dtype)


def _run(opt: Shampoo, ps: dict[str, torch.nn.Parameter],
         grads: list[dict[str, torch.Tensor | None]]) -> None:
    for step in grads:
        _feed(ps, step)
        opt.step()


def _numpy(ps: dict[str, torch.nn.Parameter]) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in ps.items()}


def _make(case: str, distributed: DistributedConfig | None,
          ) -> tuple[Shampoo, dict[str, torch.nn.Parameter]]:
    groups, dtype, _ = CASES[case]
    ps = make_params(dtype)
    return Shampoo(groups(ps), distributed=distributed), ps


def _with_nan(grads: list[dict[str, torch.Tensor | None]]) -> list[dict[str, torch.Tensor | None]]:
    out = [dict(s) for s in grads]
    w = out[4]["w"]
    assert w is not None
    w = w.clone()
    w[0, 0] = float("nan")
    out[4]["w"] = w
    return out


def _grads_for(case: str) -> list[dict[str, torch.Tensor | None]]:
    grads = make_grads(STEPS)
    return _with_nan(grads) if "skip_block" in case else grads


def _roundtrip(sd: dict[str, Any]) -> dict[str, Any]:
    """Through torch.save / torch.load(weights_only=True), as a real checkpoint."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded: dict[str, Any] = torch.load(buf, weights_only=True)
    return loaded


# ------------------------------------------------------------- equality
def equality(rank: int, world: int, trainers_per_group: int | None = None,
             only: str | None = None) -> dict[str, Any]:
    """Every case distributed and single-process: final parameters, factor bytes."""
    out: dict[str, Any] = {}
    for case, (_, _, kwargs) in CASES.items():
        if only is not None and case != only:
            continue
        grads = _grads_for(case)
        single, sps = _make(case, None)
        _run(single, sps, grads)
        cfg = DistributedConfig(trainers_per_group=trainers_per_group, **kwargs)
        opt, ps = _make(case, cfg)
        _run(opt, ps, grads)
        out[case] = {
            "distributed": _numpy(ps), "single": _numpy(sps), "metrics": opt.metrics,
            "bytes": opt.block_state_bytes(), "single_bytes": single.block_state_bytes(),
            "blocks": sum(1 for view in opt.blocks() if view.held),
            "exchanged_bytes": opt.exchange_bytes,
        }
    if only is not None:
        return out
    # Lossy communication: the rounded directions, identical on every rank.
    shapes = {"w": (6, 9), "t": (2, 3, 4)}
    grads = make_grads(STEPS, shapes)
    single_ps = make_params(torch.float32, shapes)
    single = Shampoo([(n, p) for n, p in single_ps.items()], LOSSY_CONFIG)
    path = [_numpy(single_ps)]
    for step in grads:
        _feed(single_ps, step)
        single.step()
        path.append(_numpy(single_ps))
    for name in LOSSY:
        ps = make_params(torch.float32, shapes)
        opt = Shampoo([(n, p) for n, p in ps.items()], LOSSY_CONFIG,
                      distributed=DistributedConfig(communication_dtype=name))
        _run(opt, ps, grads)
        out[f"lossy_{name}"] = {"distributed": _numpy(ps), "path": path}
    return out


def one_block_model(rank: int, world: int) -> dict[str, Any]:
    """A single block: every other rank owns nothing and holds no factor state."""
    config = ShampooConfig(learning_rate=0.1, grafting=GraftingConfig(type="adagrad"))
    grads = make_grads(4, {"w": (3, 4)})
    single_ps, ps = make_params(torch.float64, {"w": (3, 4)}), make_params(torch.float64,
                                                                          {"w": (3, 4)})
    single = Shampoo(list(single_ps.values()), config)
    opt = Shampoo(list(ps.values()), config, distributed=DistributedConfig())
    _run(single, single_ps, grads)
    _run(opt, ps, grads)
    return {"distributed": _numpy(ps), "single": _numpy(single_ps),
            "bytes": opt.block_state_bytes()}


# --------------------------------------------------------------- resume
def resume(rank: int, world: int, case: str = "rich_float32") -> dict[str, bool]:
    """W -> 1 and 1 -> W through the distributed state dict equal an uninterrupted run."""
    half = 4
    grads = _grads_for(case)
    whole, wps = _make(case, None)
    _run(whole, wps, grads)
    expected = _numpy(wps)

    # W -> 1: distributed for `half` steps, saved, continued by the plain optimizer.
    opt, ps = _make(case, DistributedConfig())
    _run(opt, ps, grads[:half])
    sd = _roundtrip(opt.distributed_state_dict())
    params_at_half = {n: p.detach().clone() for n, p in ps.items()}
    _run(opt, ps, grads[half:])  # and the distributed run goes on uninterrupted
    plain, pps = _make(case, None)
    with torch.no_grad():
        for n, p in pps.items():
            p.copy_(params_at_half[n])
    plain.load_distributed_state_dict(sd)
    _run(plain, pps, grads[half:])

    # 1 -> W: the plain optimizer saves, a fresh distributed one continues.
    first, fps = _make(case, None)
    _run(first, fps, grads[:half])
    sd1 = _roundtrip(first.distributed_state_dict())
    second, sps = _make(case, DistributedConfig())
    with torch.no_grad():
        for n, p in sps.items():
            p.copy_(fps[n])
    second.load_distributed_state_dict(sd1)
    _run(second, sps, grads[half:])

    def same(a: dict[str, np.ndarray]) -> bool:
        return all(np.array_equal(a[n], expected[n]) for n in expected)

    complete = all(
        len(sd["state"][n]["blocks"]) == len(sd1["state"][n]["blocks"]) for n in sd1["state"]
    )
    return {"uninterrupted": same(_numpy(ps)), "w_to_1": same(_numpy(pps)),
            "one_to_w": same(_numpy(sps)), "blocks_complete": complete,
            "same_dict": _trees_equal(sd, sd1)}


def _trees_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_trees_equal(a[k], b[k])
                                                                for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(
            _trees_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


# ------------------------------------------------------------------ DDP
def ddp(rank: int, world: int) -> dict[str, Any]:
    """A DistributedDataParallel model: Shampoo on its averaged gradients equals one process."""
    config = dataclasses.replace(RICH, blocking=BlockingConfig(max_preconditioner_dim=4))

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))

    net = torch.nn.parallel.DistributedDataParallel(model())
    opt = Shampoo(list(net.module.named_parameters()), config, distributed=DistributedConfig())
    gen = torch.Generator().manual_seed(100 + rank)  # different data on every rank
    seen = []
    for _ in range(5):
        x, y = torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        seen.append([p.grad.clone() for p in net.module.parameters()])
        opt.step()
    ref = model()
    single = Shampoo(list(ref.named_parameters()), config)
    for grads in seen:
        for p, g in zip(ref.parameters(), grads, strict=True):
            p.grad = g
        single.step()
    return {
        "distributed": [p.detach().numpy().copy() for p in net.module.parameters()],
        "single": [p.detach().numpy().copy() for p in ref.parameters()],
    }


# -------------------------------------------------------------- failures
def failures(rank: int, world: int) -> dict[str, Any]:
    """A NaN on rank 1 only, and a root that keeps failing: every rank raises alike."""
    out: dict[str, Any] = {}
    ps = make_params(torch.float32, {"a": (4, 3), "b": (5,)})
    opt = Shampoo(list(ps.items()), RICH, distributed=DistributedConfig())
    grads = make_grads(3, {"a": (4, 3), "b": (5,)})
    _run(opt, ps, grads[:2])
    before = _numpy(ps)
    state_before = opt.distributed_state_dict()
    step = dict(grads[2])
    if rank == 1:
        b = step["b"]
        assert b is not None
        step["b"] = torch.full_like(b, float("inf"))
    _feed(ps, step)
    try:
        opt.step()
        out["nonfinite"] = None
    except NonFiniteGradientError as err:
        out["nonfinite"] = str(err)
    unchanged = all(np.array_equal(before[n], v) for n, v in _numpy(ps).items())
    out["unchanged"] = unchanged and _trees_equal(state_before, opt.distributed_state_dict())

    # p's roots fail: its float32 factors are finite (eq. 3 accepts 2e18) but with
    # weight 1 and bias correction L / (1 - 0.999^n) overflows float32.
    config = ShampooConfig(epsilon=EpsilonConfig(value=1e-3),
                           statistics=StatisticsConfig(beta2=0.999, ema_weight="one",
                                                       bias_correction=True),
                           blocking=BlockingConfig(merge_dims_up_to=None),
                           failure=FailureConfig(max_consecutive_root_failures=1))
    qs = make_params(torch.float32, {"p": (2, 3), "q": (2, 3), "z": (4,)})
    opt = Shampoo(list(qs.items()), config, distributed=DistributedConfig())
    try:
        for _ in range(3):
            _feed(qs, {"p": torch.full((2, 3), 2e18), "q": torch.ones(2, 3),
                       "z": torch.ones(4)})
            opt.step()
        out["root"] = None
    except RootFailureError as err:
        out["root"] = str(err)
    out["owners"] = {(v.parameter, v.block): v.owner for v in opt.blocks()}
    return out


def validation(rank: int, world: int) -> dict[str, str]:
    """trainers_per_group must divide the world size (checked on every rank)."""
    try:
        Shampoo([torch.nn.Parameter(torch.zeros(2, 2))],
                distributed=DistributedConfig(trainers_per_group=2))
        return {"error": ""}
    except ValueError as err:
        return {"error": str(err)}


def dtensor_rejected(rank: int, world: int) -> str:
    """A DTensor placement other than fully_shard's / HSDP's: a clear ValueError."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(2, 2), mesh, [Shard(1)]))
    try:
        Shampoo([p], distributed=DistributedConfig())
    except ValueError as err:
        return str(err)
    return ""


def trainer_groups(rank: int, world: int) -> dict[str, Any]:
    """``trainers_per_group = world // 2``: two groups, blocks split within each."""
    out = equality(rank, world, trainers_per_group=world // 2, only="rich_float32")
    dist.barrier()
    return out["rich_float32"]


def adafactor(rank: int, world: int) -> dict[str, Any]:
    """Eq. (14e) alone: the distributed run equals one process, and resumes across
    world sizes through the distributed state dict (the moments on every rank)."""
    case = "adafactor_skip_block"
    out = {"equality": equality(rank, world, only=case)[case], "resume": resume(rank, world, case)}
    dist.barrier()
    return out


def world_sizes_and_replicas(rank: int, world: int) -> dict[str, Any]:
    """Everything a spawn at this world size checks, in one process start."""
    out: dict[str, Any] = {"equality": equality(rank, world),
                           "one_block": one_block_model(rank, world),
                           "resume": resume(rank, world),
                           "resume_frequent_directions": resume(
                               rank, world, "frequent_directions_skip_block_float64")}
    if world == 2:
        out["replicated"] = equality(rank, world, trainers_per_group=1,
                                    only="rich_float32")["rich_float32"]
        out["ddp"] = ddp(rank, world)
        out["failures"] = failures(rank, world)  # last: it raises on purpose
    if world == 1:
        out["dtensor"] = dtensor_rejected(rank, world)
    if world == 3:
        out["validation"] = validation(rank, world)
    dist.barrier()
    return out


# ------------------------------------------------------------- reliability
SKIP = dataclasses.replace(RICH, failure=FailureConfig(nonfinite_gradient="skip_block"))
RELIABILITY_SHAPES = {"w": (6, 9), "t": (2, 3, 4), "v": (9,)}


def _bad_on(grads: list[dict[str, torch.Tensor | None]], rank: int,
            ) -> list[dict[str, torch.Tensor | None]]:
    """Rank 1: a NaN in block 0 of "w" at step 3; rank 0: a finite 1e20 in "t" at step 5."""
    out = [dict(s) for s in grads]
    step, name, where, value = ((2, "w", (0, 0), float("nan")) if rank == 1
                                else (4, "t", (1, 2, 3), 1e20))
    g = out[step][name]
    assert g is not None
    g = g.clone()
    g[where] = value
    out[step][name] = g
    return out


def reliability(rank: int, world: int) -> dict[str, Any]:
    """Eq. (3) decided once for every rank; atomic distributed loading (test_reliability.py)."""
    import copy

    shapes = RELIABILITY_SHAPES
    grads = make_grads(STEPS, shapes)
    out: dict[str, Any] = {}
    # One process seeing every bad gradient: the blocks every rank must skip.
    sps = make_params(torch.float32, shapes)
    single = Shampoo(list(sps.items()), SKIP)
    _run(single, sps, _bad_on(_bad_on(grads, 0), 1))
    out["single"], out["single_metrics"] = _numpy(sps), single.metrics
    for label, k in (("shared", None), ("replicated", 1)):
        ps = make_params(torch.float32, shapes)
        opt = Shampoo(list(ps.items()), SKIP, distributed=DistributedConfig(trainers_per_group=k))
        _run(opt, ps, _bad_on(grads, rank))  # each rank sees one of the bad gradients only
        out[label] = {"params": _numpy(ps), "metrics": opt.metrics}

    # "raise": a finite but too large gradient on rank 1 only.
    ps = make_params(torch.float32, shapes)
    opt = Shampoo(list(ps.items()), RICH, distributed=DistributedConfig())
    _run(opt, ps, grads[:2])
    before, state = _numpy(ps), opt.distributed_state_dict()
    step = dict(grads[2])
    if rank == 1:
        step["t"] = torch.full(shapes["t"], 1e20)
    _feed(ps, step)
    try:
        opt.step()
        out["too_large"] = None
    except NonFiniteGradientError as err:
        out["too_large"] = str(err)
    out["unchanged"] = (all(np.array_equal(before[n], v) for n, v in _numpy(ps).items())
                        and _trees_equal(state, opt.distributed_state_dict()))

    # Loading: a block that only rank 1 holds is corrupt; every rank raises, none loads.
    bad = copy.deepcopy(state)
    for entry in bad["state"].values():
        entry["step"] = 99
    next(iter(bad["state"].values()))["metrics"] = {
        "root_failures": 5, "skipped_blocks": 5, "withheld_updates": 5}
    view = next(v for v in opt.blocks() if v.owner == 1)
    factors = bad["state"][view.name]["blocks"][view.block]["factors"]
    k = next(iter(factors))
    factors[k] = torch.zeros(factors[k].shape[0] + 1, factors[k].shape[0] + 1)
    now = opt.distributed_state_dict()
    try:
        opt.load_distributed_state_dict(bad)
        out["load_error"] = None
    except ValueError as err:
        out["load_error"] = str(err)
    out["load_unchanged"] = _trees_equal(now, opt.distributed_state_dict())
    out["bad_block"] = (view.name, view.block)
    return out
