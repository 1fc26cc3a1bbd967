"""Invariant (f): every distributed mode of torch against one process.

:func:`check_modes` runs :func:`rank_cases` on ``world`` fresh gloo processes
(``shampoo_torch.processes.spawn``; all cases of one Hypothesis example in
one spawn, since starting processes costs seconds). Each case is a drawn
config, parameter shapes (0-d to 4-d, dims 1 to 7: uneven shards, dims
smaller than the world, empty pieces) and a hostile gradient stream, the
same on every rank, plus for ``"ddp"`` a NaN on one rank only. Modes:

- ``"ddp"``: plain parameters, ``DistributedConfig()``;
- ``"fsdp"``: DTensors ``[Shard(0)]`` on a 1-D mesh (0-d ones replicated), as
  ``fully_shard`` makes them, ``shard_mode="lossless"``;
- ``"fsdp_local"``: the same, ``shard_mode="local"``;
- ``"hsdp"``: a 2-D mesh ``(2, world / 2)``, ``[Replicate(), Shard(0)]``, lossless.

Each rank also runs the oracle, one process (no distribution) stepping the
whole parameters (lossless modes, DDP) or every rank's piece as a parameter
of its own (``"local"``), with the same gradients, poison included. The
invariants, per step: every rank raises what the oracle raises (or
nothing); every rank's weights equal the oracle's bit for bit (so replicas
never diverge, and a refused block is skipped on every rank as one process
skips it, which invariant (c) checks against omission); the ranks' skipped
blocks add up to the oracle's. Checkpoints: the distributed ``state_dict()``
at a drawn step ``k`` resumes a one-process optimizer (world W -> 1), and the
oracle's state dict at ``k`` resumes a fresh distributed one (1 -> W;
``"local"``: its own state dict into a fresh local optimizer); both continue
to the oracle's weights and errors bit for bit.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np

import shampoo_spec as ss

from .invariants import Violation, check_same_error, count

MODES = ("ddp", "fsdp", "fsdp_local", "hsdp")

#: (config, whole initial weights, stream of whole gradients, checkpoint step k,
#: DDP poison (step, rank, name, flat index) or None).
Case = tuple[ss.ShampooConfig, dict[str, np.ndarray], list[dict[str, np.ndarray]], int,
             tuple[int, int, str, int] | None]
#: Per step: (exception type name or None, weights as bytes, skipped blocks).
Trace = list[tuple[str | None, bytes, int]]


def _placements(mode: str, ndim: int) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    shard = Shard(0) if ndim else Replicate()
    return [Replicate(), shard] if mode == "hsdp" else [shard]


def _pieces(value: np.ndarray, world: int) -> list[np.ndarray]:
    """Dim 0 cut as DTensor's ``Shard(0)`` cuts it: ``torch.chunk``, then empty pieces."""
    import torch

    chunks = [c.numpy() for c in torch.chunk(torch.tensor(value), world, 0)]
    empty = np.zeros((0, *value.shape[1:]), value.dtype)
    return chunks + [empty] * (world - len(chunks))


def _oracle_inputs(mode: str, shard_size: int, params: dict[str, np.ndarray],
                   grads: list[dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray],
                                                                list[dict[str, np.ndarray]]]:
    """Whole parameters, or (``"local"``) each piece as a parameter ``name@r``."""
    if mode != "fsdp_local":
        return params, grads

    def split(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for n, v in values.items():
            if v.ndim == 0:
                out[n] = v
            else:
                out.update({f"{n}@{r}": p for r, p in enumerate(_pieces(v, shard_size))})
        return out

    return split(params), [split(g) for g in grads]


class _Run:
    """One optimizer (distributed, or the one-process oracle) and its parameters."""

    def __init__(self, config: ss.ShampooConfig, values: dict[str, np.ndarray],
                 mode: str | None, mesh: Any) -> None:
        import torch
        from torch.distributed.tensor import distribute_tensor

        from shampoo_torch import DistributedConfig, Shampoo

        self.mode, self.mesh = mode, mesh
        self.params: dict[str, Any] = {}
        for n, v in values.items():
            t = torch.tensor(v, dtype=torch.float32)
            if mode in ("fsdp", "fsdp_local", "hsdp"):
                t = distribute_tensor(t, mesh, _placements(mode, v.ndim), src_data_rank=None)
            self.params[n] = torch.nn.Parameter(t)
        if mode is None:
            self.opt = Shampoo(list(self.params.items()), config)
        else:
            shard_mode = "local" if mode == "fsdp_local" else "lossless"
            self.opt = Shampoo(list(self.params.items()), config,
                               distributed=DistributedConfig(shard_mode=shard_mode))

    def step(self, grads: dict[str, np.ndarray], piece: int | None = None
             ) -> tuple[str | None, bytes, int]:
        """One step; the weights as bytes (the oracle's: as rank ``piece`` sees them)."""
        import torch
        from torch.distributed.tensor import distribute_tensor

        for n, g in grads.items():
            t = torch.tensor(np.asarray(g, np.float32))
            if self.mode in ("fsdp", "fsdp_local", "hsdp"):
                t = distribute_tensor(t, self.mesh, list(self.params[n].placements),
                                      src_data_rank=None)
            self.params[n].grad = t
        try:
            self.opt.step()
            err = None
        except Exception as e:  # noqa: BLE001 - compared with the oracle's
            err = type(e).__name__
        values = self.values()
        if piece is not None:  # the oracle of "local": only that rank's pieces
            values = {n.split("@")[0]: v for n, v in values.items()
                      if "@" not in n or n.endswith(f"@{piece}")}
        weights = b"".join(values[n].tobytes() for n in sorted(values))
        return err, weights, int(self.opt.metrics["skipped_blocks"])

    def whole(self) -> dict[str, np.ndarray]:
        """The whole parameters (a collective for DTensors)."""
        sharded = self.mode not in (None, "ddp")
        return {n: (p.detach().full_tensor() if sharded else p.detach()).numpy().copy()
                for n, p in self.params.items()}

    def values(self) -> dict[str, np.ndarray]:
        """This rank's view: whole tensors (lossless), its own pieces (``"local"``)."""
        out = {}
        for n, p in self.params.items():
            d = p.detach()
            if self.mode in ("fsdp", "hsdp"):
                d = d.full_tensor()
            elif self.mode == "fsdp_local":
                d = d.to_local()
            out[n] = d.numpy().copy()
        return out

def _steps(run: _Run, grads: list[dict[str, np.ndarray]]) -> Trace:
    return [run.step(g) for g in grads]



def rank_cases(rank: int, world: int, modes: tuple[str, ...],
               cases: list[Case]) -> dict[str, list[dict[str, Any]]]:
    """Per mode, per case: this rank's traces and its oracle's (see the module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {"ddp": None, "fsdp": init_device_mesh("cpu", (world,)),
              "hsdp": init_device_mesh("cpu", (2, world // 2))}
    meshes["fsdp_local"] = meshes["fsdp"]
    out: dict[str, list[dict[str, Any]]] = {}
    for mode in modes:
        mesh = meshes[mode]
        shard_size = world // 2 if mode == "hsdp" else world
        piece = rank % shard_size
        results: list[dict[str, Any]] = []
        for config, params, grads, k, poison in cases:
            config = dataclasses.replace(config, factor_dtype="float32")
            grads = [dict(g) for g in grads]
            if poison is not None and mode == "ddp":  # a NaN that only one rank sees
                t, bad_rank, name, index = poison
                bad = np.array(grads[t][name], np.float32)
                bad.reshape(-1)[index] = np.nan
                if rank == bad_rank:
                    grads[t][name] = bad
                oracle_grads = [dict(s) for s in grads]
                oracle_grads[t][name] = bad
            else:
                oracle_grads = grads
            o_params, o_grads = _oracle_inputs(mode, shard_size, params, oracle_grads)
            oracle = _Run(config, o_params, None, None)
            trace: Trace = []
            o_trace: Trace = []
            try:
                run = _Run(config, params, mode, mesh)
            except ValueError as e:
                results.append({"refused": f"{type(e).__name__}: {e}"})
                continue
            saved: dict[str, Any] = {}
            o_state: dict[str, Any] = {}
            at_k: dict[str, np.ndarray] = {}
            o_at_k: dict[str, np.ndarray] = {}
            for t, g in enumerate(grads):
                if t == k:
                    saved, at_k = copy.deepcopy(run.opt.state_dict()), run.whole()
                    o_state, o_at_k = copy.deepcopy(oracle.opt.state_dict()), oracle.whole()
                trace.append(run.step(g))
                o_trace.append(oracle.step(o_grads[t], piece if mode == "fsdp_local" else None))
            # Resume W -> 1 (lossless) or local -> local, then 1 -> W (lossless).
            if mode == "fsdp_local":
                again = _Run(config, at_k, mode, mesh)
                again.opt.load_state_dict(saved)
                resumed = {"local": _steps(again, grads[k:])}
            else:
                one = _Run(config, at_k, None, None)
                one.opt.load_state_dict(saved)
                back = _Run(config, o_at_k, mode, mesh)
                back.opt.load_state_dict(o_state)
                resumed = {"to_one": _steps(one, o_grads[k:]),
                           "from_one": _steps(back, grads[k:])}
            results.append({"trace": trace, "oracle": o_trace, "resumed": resumed,
                            "piece": piece, "shard_size": shard_size})
        out[mode] = results
    return out


def _compare(where: str, got: Trace, want: Trace) -> None:
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        at = f"{where}, step {t + 1}"
        check_same_error(at, g[0], w[0], "one process")
        if g[1] != w[1]:
            raise Violation(f"{at}: the weights differ from one process's")


def check_modes(world: int, modes: tuple[str, ...], cases: list[Case],
                timeout_s: float = 600.0) -> None:
    """(f) on ``world`` gloo ranks for each mode: see the module docstring."""
    from shampoo_torch.processes import spawn

    results = spawn("shampoo_conformance.fuzz.distributed:rank_cases", world,
                    (modes, cases), timeout_s=timeout_s)
    for r in results:
        if isinstance(r, BaseException):
            raise Violation(f"torch-{world} ranks: a rank failed: {type(r).__name__}: {r}") from r
    for mode in modes:
        for i, case in enumerate(cases):
            policy = case[0].failure.nonfinite_gradient
            where = f"torch {mode} at {world} ranks, case {i} ({policy!r}, checkpoint at {case[3]})"
            per_rank = [r[mode][i] for r in results]
            refusals = {p.get("refused") for p in per_rank}
            if refusals != {None}:
                if len(refusals) != 1:
                    raise Violation(f"{where}: ranks disagree on construction: {refusals}")
                count(f"f_{mode}", "torch", "refused")
                continue
            for rank, p in enumerate(per_rank):
                _compare(f"{where}, rank {rank}", p["trace"], p["oracle"])
                for kind, trace in p["resumed"].items():
                    _compare(f"{where}, rank {rank}, resumed ({kind})", trace,
                             p["oracle"][case[3]:])
            # Lossless: every rank decides (and counts) every block alike; local: its pieces,
            # and each its copy of a replicated 0-d parameter (then no sum to compare).
            replicas = 1 if mode == "fsdp_local" else len(per_rank)
            replicated = mode == "fsdp_local" and any(v.ndim == 0 for v in case[1].values())
            for t, step in enumerate([] if replicated else per_rank[0]["oracle"]):
                total = sum(p["trace"][t][2] for p in per_rank)
                if total != replicas * step[2]:
                    raise Violation(f"{where}, step {t + 1}: ranks skipped {total} blocks in "
                                    f"all, one process {step[2]}")
            count(f"f_{mode}", "torch", policy)


__all__ = ["MODES", "check_modes", "rank_cases"]
