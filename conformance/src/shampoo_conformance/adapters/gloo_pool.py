"""The two gloo worker processes the ``torch-ddp`` and ``torch-fsdp2`` backends run on.

The two processes form a persistent pool: started on the first call (spawn
and ``import torch`` take seconds), reused by every later call, shut down at
exit. Every wait has a timeout, so a broken or hung worker fails the call
(and the pool is restarted on the next) instead of hanging the caller. A
job is one rank function (:data:`RankRun`, the backend's ``run_rank``) run
on both ranks with the same inputs; rank 0's result is returned and rank 1's
must be identical.

The gloo plumbing (:func:`shampoo_torch.processes.init_gloo` and friends) is
shampoo_torch's own; its :func:`~shampoo_torch.processes.spawn` runs the
distributed tests and benchmark in fresh processes.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch.distributed as dist

from shampoo_spec import ShampooConfig
from shampoo_torch.processes import free_port, init_gloo, portable_exception

WORLD_SIZE = 2
#: Seconds a call waits for the pool (first call: also its start) before failing.
CALL_TIMEOUT_S = float(os.environ.get("SHAMPOO_DDP_TIMEOUT", "300"))
#: gloo's own timeout for a collective (a rank that never arrives).
COLLECTIVE_TIMEOUT_S = 120.0

#: One rank's part of a backend's ``run``: ``(config, params, grads, dtype)`` to the
#: parameters after each step, torch.distributed already initialized.
RankRun = Callable[
    [ShampooConfig, dict[str, np.ndarray], list[dict[str, np.ndarray]], Any],
    list[dict[str, np.ndarray]],
]


def _pool_worker(rank: int, port: int) -> None:
    """``python -m shampoo_conformance.adapters.gloo_pool RANK PORT``: one rank of the pool.

    Jobs arrive pickled on stdin and results leave on stdout (the real
    stdout is moved to stderr first, so prints cannot corrupt the channel);
    stdin closing (the parent exited) ends the worker. A job names the
    function each rank runs (``run_rank`` of :mod:`.torch_ddp` or
    :mod:`.torch_fsdp2`, pickled by reference, so unpickling imports it).
    """
    reader = Connection(os.dup(0), writable=False)
    writer = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    try:
        init_gloo(rank, WORLD_SIZE, port, COLLECTIVE_TIMEOUT_S)
        writer.send(("ready", True, None))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        writer.send(("ready", False, portable_exception(err)))
        return
    while True:
        try:
            job = reader.recv()
        except EOFError:
            break
        if job is None:
            break
        job_id, config_dict, params, grads, dtype, run_rank = job
        try:
            config = ShampooConfig.from_dict(config_dict)
            value: Any = run_rank(config, params, grads, dtype)
            ok = True
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            value, ok = portable_exception(err), False
        writer.send((job_id, ok, value))
    dist.destroy_process_group()


class _Pool:
    """Two persistent gloo worker processes, each with a pickled-object pipe.

    Started with ``subprocess`` (not multiprocessing), so the caller's main
    module is never re-imported and needs no ``if __name__ == "__main__"``.
    """

    def __init__(self) -> None:
        port = free_port()
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "shampoo_conformance.adapters.gloo_pool", str(r), str(port)],
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


def run_on_pool(
    name: str,
    run_rank: RankRun,
    config: ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: Any,
) -> list[dict[str, np.ndarray]]:
    """``run_rank`` (a module-level function, ``run_rank`` of :mod:`.torch_ddp` or
    :mod:`.torch_fsdp2`) on both ranks of the pool; rank 0's parameters after each
    step, rank 1's checked equal."""
    payload = (config.to_dict(), {k: np.asarray(v) for k, v in params.items()},
               [{k: np.asarray(v) for k, v in g.items()} for g in grads], np.dtype(dtype).name,
               run_rank)
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
                    f"{name}: rank 1's parameter {n!r} differs from rank 0's after step "
                    f"{t + 1} (max |diff| {np.nanmax(np.abs(a[n] - b[n]))})."
                )
    out: list[dict[str, np.ndarray]] = first
    return out




if __name__ == "__main__":
    _pool_worker(int(sys.argv[1]), int(sys.argv[2]))
