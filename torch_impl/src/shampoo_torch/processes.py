"""Fresh gloo processes on this machine: what the distributed tests and benchmark run on.

:func:`spawn` runs ``target(rank, world_size, *args)`` on ``world_size`` new
processes joined by gloo on 127.0.0.1 (one thread each, so CPU results are
deterministic) and returns each rank's result or the exception it raised.
:func:`init_gloo`, :func:`free_port` and :func:`portable_exception` are its
parts, also used by the ``torch-ddp`` conformance adapter's worker pool.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import multiprocessing as std_mp
import pickle
import queue
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
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


def portable_exception(err: BaseException) -> BaseException:
    """The exception (with its worker traceback as a note) when it pickles, else a RuntimeError."""
    text = "".join(traceback.format_exception(err))
    try:
        err.add_note(f"worker traceback:\n{text}")
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(err).__name__} in a worker:\n{text}")


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
        value, ok = portable_exception(err), False
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
