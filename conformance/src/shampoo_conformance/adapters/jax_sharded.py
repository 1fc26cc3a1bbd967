"""The ``jax-sharded`` backend: the backend contract on four host devices, NumPy in, NumPy out.

``run(config, params, grads, dtype)`` returns what
``shampoo_conformance.adapters.jax.run`` returns, computed by
``shampoo(config, sharding=ShardingConfig(mesh, "blocks"))``
over a mesh of four CPU devices (block state sharded, parameters
replicated). XLA reads ``--xla_force_host_platform_device_count`` only when
jax starts, so the work runs in ONE persistent worker process (started on
first use with that flag added to the parent's XLA_FLAGS, reused by every
run, closed at exit): the conformance suite calls ``run`` ~160 times.

Requests and replies cross the worker's stdin/stdout as length-prefixed
``numpy.savez`` archives (no pickle): the config as JSON
(``ShampooConfig.to_dict``), the arrays as arrays. An error raised in the
worker (``ValueError``, :class:`~shampoo_spec.NonFiniteGradientError`,
:class:`~shampoo_spec.RootFailureError`, ...) is raised here with the same
type and message. A worker that dies or gives no reply within
``SHAMPOO_JAX_SHARDED_TIMEOUT`` seconds (default 900) fails the call, is
killed, and the next call starts a new one.
"""

from __future__ import annotations

import atexit
import dataclasses
import io
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any, Literal

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from shampoo_conformance.adapters.inputs import check_run_inputs

# Imported in the parent too (it starts no computation there): without
# shampoo_jax the backend is unavailable (BackendUnavailable), not broken.
from shampoo_jax import ShardingConfig, check_state, shampoo
from shampoo_spec import (
    NonFiniteGradientError,
    RootFailureError,
    ShampooConfig,
    config_from_dict,
)

DEVICES = 4
AXIS = "blocks"
_DTYPES: dict[np.dtype[Any], Literal["float32", "float64"]] = {
    np.dtype(np.float32): "float32",
    np.dtype(np.float64): "float64",
}
_HEADER = 8  # bytes of the big-endian length before each message


# -------------------------------------------------------------- messages
def _encode(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    named: dict[str, Any] = {"__meta__": np.array(json.dumps(meta)), **arrays}
    np.savez(buf, **named)
    body = buf.getvalue()
    return len(body).to_bytes(_HEADER, "big") + body


def _decode(body: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    with np.load(io.BytesIO(body), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays.pop("__meta__")))
    return meta, arrays


def _read_exactly(stream: IO[bytes], n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# ------------------------------------------------------------ the worker
def run_local(
    config: ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: Any = np.float64,
    devices: int = DEVICES,
) -> list[dict[str, np.ndarray]]:
    """Contract 8.2 in this process, block state sharded over ``devices`` CPU devices."""
    dt = np.dtype(dtype)
    check_run_inputs("jax-sharded", params, grads, dt.name)
    names = sorted(params)
    cpus = jax.devices("cpu")
    if len(cpus) < devices:
        raise RuntimeError(
            f"{devices} CPU devices needed, {len(cpus)} found: start jax with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={devices}."
        )
    config = dataclasses.replace(config, factor_dtype=_DTYPES[dt])
    sharding = ShardingConfig(Mesh(np.array(cpus[:devices]), (AXIS,)), AXIS)
    with jax.enable_x64(dt == np.float64):
        opt = shampoo(config, sharding=sharding)

        @jax.jit
        def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        def place(tree: dict[str, np.ndarray]) -> Any:
            return jax.device_put(
                {k: np.asarray(tree[k], dtype=dt) for k in names}, sharding.replicated
            )

        p = place(params)
        s = opt.init(p)
        out = []
        for g in grads:
            p, s_new = step(p, s, place(g))
            check_state(s_new, config, previous=s)
            s = s_new
            out.append({k: np.array(v) for k, v in p.items()})
    return out


def _serve(requests: IO[bytes], replies: IO[bytes]) -> None:
    """The worker's loop: one request, one reply, until stdin closes."""
    while True:
        head = _read_exactly(requests, _HEADER)
        if head is None:
            return
        body = _read_exactly(requests, int.from_bytes(head, "big"))
        if body is None:
            return
        try:
            meta, arrays = _decode(body)
            config = config_from_dict(meta["config"])
            params = {k: arrays[f"p{i}"] for i, k in enumerate(meta["params"])}
            grads = [
                {k: arrays[f"g{t}_{i}"] for i, k in enumerate(keys)}
                for t, keys in enumerate(meta["grads"])
            ]
            out = run_local(config, params, grads, np.dtype(meta["dtype"]))
            reply = _encode(
                {"steps": len(out), "names": sorted(params)},
                {f"o{t}_{i}": p[k] for t, p in enumerate(out) for i, k in enumerate(sorted(p))},
            )
        except Exception as err:  # noqa: BLE001 - every error goes back to the caller
            reply = _encode({"error": {"type": type(err).__name__, "message": str(err)}}, {})
        replies.write(reply)
        replies.flush()


def _worker_main() -> None:
    # The protocol owns the original stdout; anything printed goes to stderr.
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    _serve(sys.stdin.buffer, replies)


# ------------------------------------------------------------ the parent
def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags.strip()} --xla_force_host_platform_device_count={DEVICES}".strip()
    env.setdefault("OPENBLAS_NUM_THREADS", "1")  # see shampoo_jax.roots.regularize.eigh
    env["JAX_PLATFORMS"] = "cpu"
    return env


class _Worker:
    """One worker process and its pipes; ``call`` sends a request and waits for the reply."""

    def __init__(self) -> None:
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from shampoo_conformance.adapters.jax_sharded import "
             "_worker_main; _worker_main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=_worker_env(),
        )

    def stderr_tail(self, chars: int = 3000) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-chars:]

    def _read(self, n: int, deadline: float) -> bytes:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        chunks, left = [], n
        while left:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError(
                    f"jax-sharded worker gave no reply within {TIMEOUT_S:.0f} s "
                    f"(SHAMPOO_JAX_SHARDED_TIMEOUT); its stderr ends:\n{self.stderr_tail()}"
                )
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                self.proc.wait(timeout=10)
                raise RuntimeError(
                    f"jax-sharded worker exited (code {self.proc.returncode}); "
                    f"its stderr ends:\n{self.stderr_tail()}"
                )
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def call(self, message: bytes) -> bytes:
        assert self.proc.stdin is not None
        deadline = time.monotonic() + TIMEOUT_S
        try:
            self.proc.stdin.write(message)
            self.proc.stdin.flush()
        except BrokenPipeError as err:
            raise RuntimeError(
                f"jax-sharded worker is gone; its stderr ends:\n{self.stderr_tail()}"
            ) from err
        size = int.from_bytes(self._read(_HEADER, deadline), "big")
        return self._read(size, deadline)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()


TIMEOUT_S = float(os.environ.get("SHAMPOO_JAX_SHARDED_TIMEOUT", "900"))
_lock = threading.Lock()
_worker: _Worker | None = None


def _close() -> None:
    global _worker
    if _worker is not None:
        _worker.close()
        _worker = None


atexit.register(_close)


def _errors() -> dict[str, type[Exception]]:
    return {
        "ValueError": ValueError,
        "TypeError": TypeError,
        "FloatingPointError": FloatingPointError,
        "NonFiniteGradientError": NonFiniteGradientError,
        "RootFailureError": RootFailureError,
    }


def run(
    config: ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: Any = np.float64,
) -> list[dict[str, np.ndarray]]:
    """Contract 8.2: the parameters after each step, computed on four host devices."""
    global _worker
    dt = np.dtype(dtype)
    names = list(params)
    arrays = {f"p{i}": np.asarray(params[k]) for i, k in enumerate(names)}
    grad_keys = []
    for t, g in enumerate(grads):
        keys = list(g)
        grad_keys.append(keys)
        arrays.update({f"g{t}_{i}": np.asarray(g[k]) for i, k in enumerate(keys)})
    meta = {"config": config.to_dict(), "params": names, "grads": grad_keys, "dtype": dt.str}
    message = _encode(meta, arrays)
    with _lock:
        if _worker is None or _worker.proc.poll() is not None:
            _close()
            _worker = _Worker()
        try:
            body = _worker.call(message)
        except (TimeoutError, RuntimeError):
            _close()  # a broken worker is replaced on the next call
            raise
    reply, out = _decode(body)
    if "error" in reply:
        kind = _errors().get(reply["error"]["type"])
        if kind is None:
            raise RuntimeError(f"{reply['error']['type']} in the jax-sharded worker: "
                               f"{reply['error']['message']}")
        raise kind(reply["error"]["message"])
    return [
        {k: out[f"o{t}_{i}"] for i, k in enumerate(reply["names"])}
        for t in range(reply["steps"])
    ]


__all__ = ["DEVICES", "run", "run_local"]
