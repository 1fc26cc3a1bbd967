"""Numpy in, numpy out over 2 gloo processes: the ``torch-ddp`` conformance adapter.

``run(config, params, grads, dtype)`` has the contract of
:func:`shampoo_torch.testing.run` (DESIGN.md 8.2): it steps
``Shampoo(..., distributed=DistributedConfig())`` on two CPU processes joined
by gloo, every rank fed the same gradients (as after DistributedDataParallel's
averaging), and returns rank 0's parameters after each step; it also checks
that rank 1's parameters are identical and fails if they are not.

The two worker processes form a persistent pool: started on the first call
(spawn and ``import torch`` take seconds), reused by every later call, shut
down at exit. Every wait has a timeout, so a broken or hung worker fails the
call (and the pool is restarted on the next) instead of hanging the caller.

:func:`spawn` is the general tool the tests and the benchmark use: it runs
``target(rank, world_size, *args)`` on ``world_size`` fresh gloo processes and
returns each rank's result (or the exception it raised).
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import importlib
import importlib.util
import multiprocessing as std_mp
import os
import queue
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shampoo_conformance.adapters.inputs import check_run_inputs
from shampoo_spec import ShampooConfig

from .distributed import DistributedConfig
from .optimizer import Shampoo

WORLD_SIZE = 2
#: Seconds a call waits for the pool (first call: also its start) before failing.
CALL_TIMEOUT_S = float(os.environ.get("SHAMPOO_DDP_TIMEOUT", "300"))
#: gloo's own timeout for a collective (a rank that never arrives).
COLLECTIVE_TIMEOUT_S = 120.0

_DTYPES: dict[Any, tuple[torch.dtype, str]] = {
    np.dtype(np.float64): (torch.float64, "float64"),
    np.dtype(np.float32): (torch.float32, "float32"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_gloo(rank: int, world_size: int, port: int, timeout_s: float) -> None:
    """Join a gloo group on 127.0.0.1 with one thread per process (deterministic)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def factor_state_bytes(opt: Shampoo) -> int:
    """Bytes of the block state this rank holds: factors, roots, corrected moments, counters."""
    total = 0
    for gp in opt._plans:
        for bucket in gp.buckets:
            tensors = [*bucket.factors.values(), *bucket.inverse_roots.values()]
            tensors += [t for t in (bucket.corrected, bucket.statistics_updates,
                                    bucket.consecutive_failures, bucket.corrected_updates)
                        if t is not None]
            total += sum(t.numel() * t.element_size() for t in tensors)
    return total


# ------------------------------------------------------------------ run()
def _check_inputs(
    params: dict[str, np.ndarray], grads: list[dict[str, np.ndarray]], dtype: Any
) -> None:
    """The errors of :func:`shampoo_torch.testing.run`, raised here before any worker runs."""
    arrays = [{k: np.asarray(v) for k, v in tree.items()} for tree in (params, *grads)]
    check_run_inputs("torch-ddp", arrays[0], arrays[1:], np.dtype(dtype).name)


def run_rank(
    config: ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: Any = np.float64,
    distributed: DistributedConfig | None = None,
) -> list[dict[str, np.ndarray]]:
    """One rank's part of :func:`run` (torch.distributed already initialized)."""
    tdtype, factor_dtype = _DTYPES[np.dtype(dtype)]
    config = dataclasses.replace(config, factor_dtype=factor_dtype)
    names = list(params)
    tensors = {
        n: torch.nn.Parameter(torch.tensor(np.asarray(params[n]), dtype=tdtype)) for n in names
    }
    opt = Shampoo([(n, tensors[n]) for n in names], config,
                  distributed=distributed or DistributedConfig())
    out = []
    for step in grads:
        for n in names:
            tensors[n].grad = torch.tensor(np.asarray(step[n]), dtype=tdtype)
        opt.step()
        out.append({n: tensors[n].detach().numpy().copy() for n in names})
    return out


def _pool_worker(rank: int, port: int) -> None:
    """``python -m shampoo_torch.testing_distributed RANK PORT``: one rank of the pool.

    Jobs arrive pickled on stdin and results leave on stdout (the real
    stdout is moved to stderr first, so prints cannot corrupt the channel);
    stdin closing (the parent exited) ends the worker.
    """
    reader = Connection(os.dup(0), writable=False)
    writer = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    try:
        init_gloo(rank, WORLD_SIZE, port, COLLECTIVE_TIMEOUT_S)
        writer.send(("ready", True, None))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        writer.send(("ready", False, _portable(err)))
        return
    while True:
        try:
            job = reader.recv()
        except EOFError:
            break
        if job is None:
            break
        job_id, config_dict, params, grads, dtype = job
        try:
            value: Any = run_rank(ShampooConfig.from_dict(config_dict), params, grads, dtype)
            ok = True
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            value, ok = _portable(err), False
        writer.send((job_id, ok, value))
    dist.destroy_process_group()


def _portable(err: BaseException) -> BaseException:
    """The exception (with its worker traceback as a note) when it pickles, else a RuntimeError."""
    import pickle

    text = "".join(traceback.format_exception(err))
    try:
        err.add_note(f"worker traceback:\n{text}")
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(err).__name__} in a worker:\n{text}")


class _Pool:
    """Two persistent gloo worker processes, each with a pickled-object pipe.

    Started with ``subprocess`` (not multiprocessing), so the caller's main
    module is never re-imported and needs no ``if __name__ == "__main__"``.
    """

    def __init__(self) -> None:
        port = free_port()
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "shampoo_torch.testing_distributed", str(r), str(port)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            )
            for r in range(WORLD_SIZE)
        ]
        self.writers = [Connection(os.dup(p.stdin.fileno()), readable=False)  # type: ignore[union-attr]
                        for p in self.procs]
        self.readers = [Connection(os.dup(p.stdout.fileno()), writable=False)  # type: ignore[union-attr]
                        for p in self.procs]
        for rank in range(WORLD_SIZE):
            _, ok, value = self._receive(rank, "start")
            if not ok:
                self.close()
                raise RuntimeError(f"torch-ddp worker {rank} failed to start: {value!r}")
        self.next_id = 0

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def _receive(self, rank: int, what: str) -> tuple[Any, bool, Any]:
        reader = self.readers[rank]
        try:
            if not reader.poll(CALL_TIMEOUT_S):
                raise TimeoutError(
                    f"torch-ddp worker {rank} gave no {what} result within {CALL_TIMEOUT_S:.0f} "
                    "s (SHAMPOO_DDP_TIMEOUT); the pool is restarted on the next call."
                )
            message: tuple[Any, bool, Any] = reader.recv()
        except (EOFError, OSError) as err:
            raise RuntimeError(
                f"torch-ddp worker {rank} died (exit code {self.procs[rank].poll()})."
            ) from err
        return message

    def submit(self, payload: tuple[Any, ...]) -> list[tuple[bool, Any]]:
        job_id = self.next_id
        self.next_id += 1
        for w in self.writers:
            w.send((job_id, *payload))
        out = []
        for rank in range(WORLD_SIZE):
            jid, ok, value = self._receive(rank, "job")
            if jid != job_id:
                raise RuntimeError(f"torch-ddp worker {rank} answered job {jid}, not {job_id}.")
            out.append((ok, value))
        return out

    def close(self) -> None:
        for w in self.writers:
            try:
                w.send(None)
                w.close()
            except (OSError, ValueError):
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        for r in self.readers:
            r.close()
        for p in self.procs:
            for f in (p.stdin, p.stdout):
                if f is not None:
                    f.close()


_POOL: _Pool | None = None


def _pool() -> _Pool:
    global _POOL
    if _POOL is None or not _POOL.alive():
        if _POOL is not None:
            _POOL.close()
        _POOL = _Pool()
    return _POOL


def close_pool() -> None:
    """Stop the worker processes (also done at interpreter exit)."""
    global _POOL
    if _POOL is not None:
        _POOL.close()
        _POOL = None


atexit.register(close_pool)


def run(
    config: ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: Any = np.float64,
) -> list[dict[str, np.ndarray]]:
    """Rank 0's parameters (as ``dtype`` arrays) after each step of ``grads``, on 2 gloo ranks."""
    global _POOL
    _check_inputs(params, grads, dtype)
    payload = (config.to_dict(), {k: np.asarray(v) for k, v in params.items()},
               [{k: np.asarray(v) for k, v in g.items()} for g in grads], np.dtype(dtype).name)
    pool = _pool()
    try:
        outcomes = pool.submit(payload)
    except BaseException:
        close_pool()
        raise
    failures = [value for ok, value in outcomes if not ok]
    if failures:
        if len(failures) != WORLD_SIZE or len({type(f) for f in failures}) != 1:
            close_pool()  # the ranks disagree: their process group may be out of step
        raise failures[0]
    first, second = (value for _, value in outcomes)
    for t, (a, b) in enumerate(zip(first, second, strict=True)):
        for n in a:
            if not np.array_equal(a[n], b[n], equal_nan=True):
                raise AssertionError(
                    f"torch-ddp: rank 1's parameter {n!r} differs from rank 0's after step "
                    f"{t + 1} (max |diff| {np.nanmax(np.abs(a[n] - b[n]))})."
                )
    out: list[dict[str, np.ndarray]] = first
    return out


# ---------------------------------------------------------------- spawn()
def _load_target(target: str) -> Callable[..., Any]:
    where, _, name = target.rpartition(":")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"_spawned_{abs(hash(where))}", where)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    fn: Callable[..., Any] = getattr(module, name)
    return fn


def _spawned(rank: int, world_size: int, port: int, target: str, args: tuple[Any, ...],
             results: Any, collective_timeout_s: float) -> None:
    try:
        init_gloo(rank, world_size, port, collective_timeout_s)
        value, ok = _load_target(target)(rank, world_size, *args), True
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        value, ok = _portable(err), False
    results.put((rank, ok, value))
    if dist.is_initialized():
        dist.destroy_process_group()


def spawn(
    target: str,
    world_size: int,
    args: tuple[Any, ...] = (),
    timeout_s: float = 180.0,
    collective_timeout_s: float = 60.0,
) -> list[Any]:
    """``target(rank, world_size, *args)`` on ``world_size`` new gloo processes (1 thread each).

    ``target`` is ``"package.module:function"`` or ``"/path/to/file.py:function"``.
    Processes start with multiprocessing's "spawn", so a calling script needs
    the ``if __name__ == "__main__":`` guard (pytest and ``python -m`` are fine).
    Returns each rank's return value, or the exception it raised (as an
    object, so callers can check that every rank failed alike). Raises
    TimeoutError (after killing the processes) when not all ranks report
    within ``timeout_s``.
    """
    ctx = std_mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_spawned, args=(r, world_size, port, target, args, results,
                                           collective_timeout_s), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        while len(got) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(
                    f"{target}: ranks {sorted(set(range(world_size)) - set(got))} gave no "
                    f"result within {timeout_s} s."
                ) from None
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return [got[r] for r in range(world_size)]


if __name__ == "__main__":
    _pool_worker(int(sys.argv[1]), int(sys.argv[2]))
