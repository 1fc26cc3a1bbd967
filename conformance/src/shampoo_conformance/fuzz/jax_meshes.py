"""Invariant (f) for JAX: Shampoo sharded over meshes of host devices against one device.

:func:`check_meshes` starts one process with four host devices (XLA reads
``--xla_force_host_platform_device_count`` only when jax starts) and runs
:func:`main` there: Hypothesis draws cases, each one config of
:func:`mesh_configs` (compiled once per mode and failure policy), weights
for :data:`.configs.FIXED_SHAPES`, a hostile gradient stream of 2-4 steps
and a checkpoint step ``k``. Each case runs in every mode of :data:`MESHES`
(``shampoo(config, sharding=ShardingConfig(mesh, axis))``, parameters and
gradients replicated):

- ``"blocks_4"``, ``"blocks_2"``: the block state sharded over a 1-D mesh of 4
  or 2 devices;
- ``"product_2x2"``: over both axes of a 2 x 2 ``("data", "model")`` mesh;
- ``"replicas_2x2"``: over ``"model"`` only, so each block's state has a
  replica on both ``"data"`` rows.

The oracle is the same transformation on one device. A device's share of
blocks is a batch of another size than one device's, and XLA's CPU kernels
for a batch depend on its size, so weights agree within the float32
trajectory bound of docs/spec.md section 5 (measured by the reference on the
steps one device accepted), not bit for bit (jax_impl's test_sharded.py).
Invariants, after every step: the mode raises what one device raises
(``check_state`` on the host: eq. 3 "raise", eq. 13), or nothing, and skips
the blocks one device skips (so a refused block is skipped as one device
skips it, which invariant (c) checks against omission); its weights are
finite and within the bound of one device's; every replica of every
parameter and state array holds the same bytes (replicas never diverge).
Checkpoints: the mode's state at step ``k`` (``sharded_state_to_arrays``)
resumes the same mesh bit for bit (the same program), and resumes one device
and the next mode of :data:`RESUME_INTO` (another device count or layout),
and one device's state resumes the mode; those three decide as one device
and stay within the bound.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import threading
from typing import Any

import numpy as np

import shampoo_spec as ss

from ..suite.divergence import first_divergence
from ..suite.tolerances import Bound, bound_and_reference
from .invariants import COUNTS, Violation, check_same_error, count

#: mode -> (mesh shape, mesh axis names, the axis or axes the blocks are sharded over).
MESHES: dict[str, tuple[tuple[int, ...], tuple[str, ...], str | tuple[str, ...]]] = {
    "blocks_4": ((4,), ("blocks",), "blocks"),
    "blocks_2": ((2,), ("blocks",), "blocks"),
    "product_2x2": ((2, 2), ("data", "model"), ("data", "model")),
    "replicas_2x2": ((2, 2), ("data", "model"), "model"),
}
MODES = tuple(MESHES)
#: Where each mode's checkpoint resumes besides one device.
RESUME_INTO = {"blocks_4": "blocks_2", "blocks_2": "product_2x2",
               "product_2x2": "replicas_2x2", "replicas_2x2": "blocks_4"}
DEVICES = 4

#: Per step: the error raised (its type's name) or None, the weights, the skipped blocks.
Trace = list[tuple[str | None, dict[str, np.ndarray], int]]
#: (config, initial weights, gradient stream, checkpoint step k).
Case = tuple[ss.ShampooConfig, dict[str, np.ndarray], list[dict[str, np.ndarray]], int]


# ----------------------------------------------------------- in the worker
def mesh_configs() -> list[ss.ShampooConfig]:
    """:func:`.configs.fixed_configs` without coupled Newton roots: batched, XLA's CPU dot in
    Newton's loop depends on the batch size, so a device's share of blocks gets roots
    that differ in the last bits (within Newton's tolerance, jax_impl's test_sharded.py);
    every other step is the same program on each shard, bit for bit."""
    from .configs import fixed_configs

    return [c for c in fixed_configs() if not isinstance(c.root_inverse, ss.CoupledNewtonConfig)]


@functools.cache
def _program(config: ss.ShampooConfig, mode: str | None) -> tuple[Any, Any, Any]:
    """``(transformation, ShardingConfig or None, jitted step)``, compiled once."""
    import jax
    import optax
    from jax.sharding import Mesh

    from shampoo_jax import ShardingConfig, shampoo

    sharding = None
    if mode is not None:
        shape, names, axis = MESHES[mode]
        devices = np.array(jax.devices("cpu")[:int(np.prod(shape))]).reshape(shape)
        sharding = ShardingConfig(Mesh(devices, names), axis)
    opt = shampoo(config, sharding=sharding)

    def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
        u, s2 = opt.update(g, s, p)
        return optax.apply_updates(p, u), s2

    return opt, sharding, jax.jit(step)


class _Run:
    """One transformation on one device (``mode=None``) or a mesh, and its weights."""

    def __init__(self, config: ss.ShampooConfig, values: dict[str, np.ndarray],
                 mode: str | None, arrays: list[np.ndarray] | None = None) -> None:
        import jax

        from shampoo_jax import sharded_state_from_arrays, state_from_arrays

        self.config, self.mode = config, mode
        self.opt, self.sharding, self.program = _program(config, mode)
        self.p = self._place(values)
        self.like = jax.eval_shape(_program(config, None)[0].init, self._place(values, False))
        if arrays is None:
            self.s = self.opt.init(self.p)
        elif self.sharding is None:
            self.s = state_from_arrays(arrays, self.like, config=config)
        else:
            self.s = sharded_state_from_arrays(arrays, self.like, self.sharding, config=config)

    def _place(self, tree: dict[str, np.ndarray], placed: bool = True) -> Any:
        import jax
        import jax.numpy as jnp

        with np.errstate(all="ignore"):
            arrays = {n: jnp.asarray(np.asarray(v, np.float32)) for n, v in tree.items()}
        if placed and self.sharding is not None:
            return jax.device_put(arrays, self.sharding.replicated)
        return arrays

    def step(self, grads: dict[str, np.ndarray]) -> tuple[str | None, dict[str, np.ndarray], int]:
        """One step, checked on the host as ``fuzz.drivers.JaxRun.step`` checks it."""
        from shampoo_jax import check_state

        p2, s2 = self.program(self.p, self.s, self._place(grads))
        err = None
        try:
            check_state(s2, self.config, previous=self.s)
            self.p, self.s = p2, s2
        except ss.RootFailureError as e:  # the step completed, then it raised (eq. 13)
            self.p, self.s, err = p2, s2, type(e).__name__
        except Exception as e:  # noqa: BLE001 - compared with one device's
            err = type(e).__name__
        return err, self.weights(), int(self.s.skipped_blocks)

    def weights(self) -> dict[str, np.ndarray]:
        return {n: np.asarray(v) for n, v in self.p.items()}

    def save(self) -> list[np.ndarray]:
        from shampoo_jax import sharded_state_to_arrays, state_to_arrays

        if self.sharding is None:
            return state_to_arrays(self.s, self.config)
        return sharded_state_to_arrays(self.s, self.like, self.sharding, self.config)

    def diverged_replicas(self) -> str | None:
        """The first array whose copies of one index differ between devices, else None."""
        import jax

        for path, leaf in jax.tree_util.tree_leaves_with_path((self.p, self.s)):
            copies: dict[str, bytes] = {}
            for shard in getattr(leaf, "addressable_shards", []):
                key, data = str(shard.index), np.asarray(shard.data).tobytes()
                if copies.setdefault(key, data) != data:
                    return f"{jax.tree_util.keystr(path)} at {key}"
        return None


def _steps(run: _Run, grads: list[dict[str, np.ndarray]]) -> Trace:
    return [run.step(g) for g in grads]


def _bound(config: ss.ShampooConfig, params: dict[str, np.ndarray],
           grads: list[dict[str, np.ndarray]], want: Trace) -> Bound | None:
    """The float32 trajectory bound of docs/spec.md section 5 on the steps one device
    accepted (a refused step changes nothing, invariant b), or None where the float64
    reference refuses a step float32 accepted."""
    accepted = [g for g, w in zip(grads, want, strict=True) if w[0] != "NonFiniteGradientError"]
    try:
        with np.errstate(all="ignore"):
            return bound_and_reference(config, params, accepted, np.float32,
                                       hold_root_failures=True)[0]
    except ss.NonFiniteGradientError:
        return None


def _agrees(where: str, got: Trace, want: Trace, start: dict[str, np.ndarray],
            bound: Bound | None) -> None:
    """One device's errors and skipped blocks, step by step; weights finite and within
    ``bound`` of one device's (None: finite only)."""
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        at = f"{where}, step {t + 1}"
        check_same_error(at, g[0], w[0], "one device")
        if g[2] != w[2]:
            raise Violation(f"{at}: skipped {g[2]} blocks, one device {w[2]}")
    for t, g in enumerate(got):
        if not all(np.all(np.isfinite(v)) for v in g[1].values()):
            raise Violation(f"{where}, step {t + 1}: non-finite weights")
    if bound is not None:
        div = first_divergence([g[1] for g in got],
                               [{n: v.astype(np.float64) for n, v in w[1].items()} for w in want],
                               start, bound)
        if div is not None:
            raise Violation(f"{where}: {div.describe()}")


def _bitwise(where: str, got: Trace, want: Trace) -> None:
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        if g[0] != w[0] or any(g[1][n].tobytes() != w[1][n].tobytes() for n in w[1]):
            raise Violation(f"{where}, step {t + 1}: differs from the run it was saved from")


def check_case(case: Case, modes: tuple[str, ...] = MODES) -> None:
    """(f) for one case in every mode (see the module docstring); counts the cases run."""
    config, params, grads, k = case
    config = dataclasses.replace(config, factor_dtype="float32")
    oracle = _Run(config, params, None)
    want: Trace = []
    for t, g in enumerate(grads):
        if t == k:
            o_arrays, o_at_k = oracle.save(), oracle.weights()
        want.append(oracle.step(g))
    bound = _bound(config, params, grads, want)
    policy = config.failure.nonfinite_gradient
    for mode in modes:
        where = f"jax {mode}, {policy!r}, checkpoint at {k}"
        run = _Run(config, params, mode)
        got: Trace = []
        for t, g in enumerate(grads):
            if t == k:
                arrays, at_k = run.save(), run.weights()
            got.append(run.step(g))
            diverged = run.diverged_replicas()
            if diverged is not None:
                raise Violation(f"{where}, step {t + 1}: the replicas of {diverged} differ")
        _agrees(where, got, want, params, bound)
        # The same mesh resumes its own state with the same program: bit for bit.
        _bitwise(f"{where}, resumed on {mode}", _steps(_Run(config, at_k, mode, arrays),
                                                       grads[k:]), got[k:])
        for into, state, values in ((None, arrays, at_k), (RESUME_INTO[mode], arrays, at_k),
                                    (mode, o_arrays, o_at_k)):
            source = "one device" if state is o_arrays else mode
            resumed = f"{where}, resumed from {source} on {into or 'one device'}"
            _agrees(resumed, _steps(_Run(config, values, into, state), grads[k:]), want[k:],
                    params, bound)
        count(f"f_{mode}", "jax", f"{policy}, {'bounded' if bound else 'finite only'}")


def main(argv: list[str]) -> None:
    """The worker: ``argv`` = [cases, counts file]; Hypothesis draws and runs the cases."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from shampoo_conformance.suite.pytest_plugin import register_profiles

    from . import configs as fc
    from . import data as fd

    register_profiles()
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
    cases, counts_path = int(argv[0]), argv[1]

    @settings(max_examples=cases, suppress_health_check=list(HealthCheck), deadline=None)
    @given(st.data())
    def fuzz(data: st.DataObject) -> None:
        config = data.draw(fc.fixed_cases(configs=mesh_configs()))
        params = fd.initial_params(fc.FIXED_SHAPES, data.draw(st.integers(0, 2**16)))
        steps = data.draw(st.integers(2, 4))
        stream, _ = data.draw(fd.gradient_streams(fc.FIXED_SHAPES, steps, hostile=True))
        check_case((config, params, stream, data.draw(st.integers(1, steps - 1))))
        done[0] += 1
        if done[0] % 25 == 0:  # progress for the parent to show (one line per 25 cases)
            print(f"jax meshes: {done[0]} of {cases} cases", file=sys.stderr, flush=True)

    done = [0]
    try:
        fuzz()
    finally:
        with open(counts_path, "w", encoding="utf-8") as f:
            json.dump([[*key, n] for key, n in COUNTS.items()], f)


# ----------------------------------------------------------- in the parent
def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags.strip()} --xla_force_host_platform_device_count={DEVICES}"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def check_meshes(cases: int, counts_path: str, timeout_s: float = 3600.0) -> None:
    """Run :func:`main` in a process with four host devices, its progress lines echoed to
    stderr as they come; add its counts to COUNTS; raise :class:`Violation` with the end
    of the worker's output when it fails or outlives ``timeout_s``."""
    worker = subprocess.Popen(
        [sys.executable, "-m", "shampoo_conformance.fuzz.jax_meshes", str(cases), counts_path],
        env=_worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(timeout_s, worker.kill)
    timer.start()
    lines: collections.deque[str] = collections.deque(maxlen=200)
    try:
        assert worker.stdout is not None
        for line in worker.stdout:
            lines.append(line)
            if line.startswith("jax meshes: "):
                print(line, end="", file=sys.stderr, flush=True)
        code = worker.wait()
    finally:
        timer.cancel()
    if os.path.exists(counts_path):
        with open(counts_path, encoding="utf-8") as f:
            for invariant, backend, outcome, n in json.load(f):
                COUNTS[(invariant, backend, outcome)] += n
    if code != 0:
        raise Violation(f"jax meshes: the worker exited with {code} (killed after "
                        f"{timeout_s:.0f} s if negative):\n{''.join(lines)[-6000:]}")


if __name__ == "__main__":
    main(sys.argv[1:])


__all__ = ["MESHES", "MODES", "RESUME_INTO", "check_case", "check_meshes", "main"]
