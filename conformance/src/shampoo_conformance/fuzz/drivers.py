"""One fuzzing interface over the reference, torch and JAX: step, snapshot, checkpoint.

A :class:`Run` holds one optimizer over named NumPy parameters. Its
:meth:`~Run.snapshot` flattens parameters and every piece of state into
arrays keyed by tuples, so invariants compare backends alike:

- ``("param", name)``: the weights, in the merged shape (eq. 4);
- ``("elem", name, field)``: elementwise state (graft, filter, momentum), merged shape;
- ``("block", name, b, field, ...)``: the state of block b of the parameter's plan (eq. 5);
- ``("scalar", ...)``, ``("counter", field)``: step counts; skipped blocks and root failures.

Only public APIs are used: ``ReferenceShampoo``'s attributes, torch
``state_dict``/``load_state_dict``, JAX ``ShampooState`` and
``state_to_arrays``/``state_from_arrays`` (the block-group layout comes from
``shampoo_jax.blocks.make_layout``). JAX programs are compiled once per
(config, shapes) and cached, so many gradient streams share one compile.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import io
from collections.abc import Callable
from typing import Any

import numpy as np

import shampoo_spec as ss

Key = tuple[str, ...]
Snapshot = dict[Key, np.ndarray]
#: The backends the fuzzer drives.
BACKENDS = ("reference", "torch", "jax")


def _numpy(x: Any) -> Any:
    if hasattr(x, "detach"):  # torch
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":  # inverse_root_dtype: NumPy has no bfloat16
            x = x.float()  # exact
        return x.numpy().copy()
    if hasattr(x, "__array__") and not isinstance(x, np.ndarray):
        return np.array(x)
    return x


def flatten(prefix: Key, value: Any, out: Snapshot) -> None:
    """Every array and number in ``value`` (nested dicts, lists, dataclasses) into ``out``."""
    value = _numpy(value)
    if isinstance(value, np.ndarray):
        out[prefix] = value.copy()
    elif isinstance(value, (bool, int, float, np.generic)):
        out[prefix] = np.asarray(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            flatten((*prefix, str(k)), v, out)
    elif isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        for i, v in enumerate(value):
            flatten((*prefix, str(i)), v, out)
    elif hasattr(value, "_fields"):  # NamedTuple
        for f in value._fields:
            flatten((*prefix, f), getattr(value, f), out)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            if f.name != "plan":
                flatten((*prefix, f.name), getattr(value, f.name), out)


class Run:
    """One optimizer over named parameters, stepped with NumPy gradients."""

    backend = ""
    #: Whether a failed step returns a new state the caller may discard (JAX).
    functional = False

    def __init__(self, config: ss.ShampooConfig, params: dict[str, np.ndarray],
                 dtype: Any) -> None:
        self.config = config
        self.names = list(params)
        self.dtype = np.dtype(dtype)
        self.shapes = {n: tuple(np.shape(v)) for n, v in params.items()}
        self.plans = {n: ss.plan_parameter(s, config) for n, s in self.shapes.items()}
        #: JAX: the snapshot of what the last step returned (even when it raised).
        self.returned: Snapshot | None = None

    def step(self, grads: dict[str, np.ndarray]) -> None:
        raise NotImplementedError

    def snapshot(self) -> Snapshot:
        raise NotImplementedError

    def params(self) -> dict[str, np.ndarray]:
        snap = self.snapshot()
        return {n: snap[("param", n)].reshape(self.shapes[n]) for n in self.names}

    def save(self) -> Any:
        """A checkpoint (None: this backend has none)."""
        return None

    def restore(self, checkpoint: Any) -> Run:
        """A new run from the weights and optimizer state of ``checkpoint``."""
        raise NotImplementedError

    def _merged(self, name: str, x: Any) -> np.ndarray:
        return np.array(_numpy(x)).reshape(self.plans[name].merged_shape)


def counters(snap: Snapshot) -> dict[str, int]:
    """The totals: ``skipped_blocks``, ``root_failures`` and ``withheld_updates``."""
    return {k[1]: int(v) for k, v in snap.items()
            if k[0] == "counter" and len(k) == 2 and v.ndim == 0}


# ---------------------------------------------------------------- reference
class ReferenceRun(Run):
    backend = "reference"

    def __init__(self, config: ss.ShampooConfig, params: dict[str, np.ndarray],
                 dtype: Any = np.float64) -> None:
        super().__init__(config, params, np.float64)
        from shampoo_reference import ReferenceShampoo

        self.opt = ReferenceShampoo(config, {k: np.array(v) for k, v in params.items()})

    def step(self, grads: dict[str, np.ndarray]) -> None:
        self.opt.step({k: np.array(v) for k, v in grads.items()})

    def snapshot(self) -> Snapshot:
        out: Snapshot = {}
        opt = self.opt
        for name in self.names:
            merged = self.plans[name].merged_shape
            out[("param", name)] = self._merged(name, opt.params[name])
            st = opt.state[name]
            for f in dataclasses.fields(st):
                value = getattr(st, f.name)
                if f.name == "plan" or value is None:
                    continue
                if f.name == "blocks":
                    for b, bs in enumerate(value):
                        flatten(("block", name, str(b)), bs, out)
                elif isinstance(value, np.ndarray) and value.shape == merged:
                    out[("elem", name, f.name)] = value.copy()
                else:
                    flatten(("other", name, f.name), value, out)
        out[("scalar", "t")] = np.asarray(opt.t)
        for f in dataclasses.fields(opt.metrics):
            out[("counter", f.name)] = np.asarray(getattr(opt.metrics, f.name))
        return out

    def save(self) -> Any:
        return copy.deepcopy(self.opt)

    def restore(self, checkpoint: Any) -> Run:
        run = ReferenceRun(self.config, self.params())
        run.opt = copy.deepcopy(checkpoint)
        return run


# -------------------------------------------------------------------- torch
class TorchRun(Run):
    backend = "torch"

    def __init__(self, config: ss.ShampooConfig, params: dict[str, np.ndarray],
                 dtype: Any = np.float32) -> None:
        import torch

        from shampoo_torch import Shampoo

        dt = np.dtype(dtype)
        config = dataclasses.replace(config, factor_dtype="float64" if dt == np.float64
                                     else "float32")
        super().__init__(config, params, dt)
        self.tdtype = torch.float64 if dt == np.float64 else torch.float32
        self.tensors = {n: torch.nn.Parameter(torch.tensor(np.asarray(v), dtype=self.tdtype))
                        for n, v in params.items()}
        self.opt = Shampoo([(n, self.tensors[n]) for n in self.names], config)

    def step(self, grads: dict[str, np.ndarray]) -> None:
        import torch

        with np.errstate(all="ignore"):
            for n in self.names:
                self.tensors[n].grad = torch.tensor(np.asarray(grads[n]), dtype=self.tdtype)
        self.opt.step()

    def snapshot(self) -> Snapshot:
        out: Snapshot = {}
        sd = self.opt.state_dict()
        for i, name in enumerate(self.names):
            out[("param", name)] = self._merged(name, self.tensors[name])
            size = int(np.prod(self.shapes[name]))
            for k, v in sd["state"].get(i, {}).items():
                if k == "blocks":
                    for b, blk in v.items():
                        flatten(("block", name, str(b)), blk, out)
                elif k == "metrics":  # the optimizer's counters travel in its first entry
                    out.update({("counter", c): np.asarray(n) for c, n in v.items()})
                elif k == "param_shape":
                    continue
                elif (k != "step" and hasattr(v, "is_floating_point") and v.is_floating_point()
                      and v.numel() == size):
                    out[("elem", name, k)] = self._merged(name, v)
                else:
                    flatten(("scalar", name, k), v, out)
        return out

    def save(self) -> Any:
        import torch

        buf = io.BytesIO()
        torch.save(self.opt.state_dict(), buf)
        return (buf.getvalue(), self.params())

    @staticmethod
    def load(data: bytes) -> Any:
        import torch

        return torch.load(io.BytesIO(data), weights_only=True)

    def restore(self, checkpoint: Any) -> Run:
        data, params = checkpoint
        run = TorchRun(self.config, params, self.dtype)
        run.opt.load_state_dict(self.load(data))
        return run


# ---------------------------------------------------------------------- jax
@functools.lru_cache(maxsize=64)
def jax_program(config: ss.ShampooConfig,
                shapes: tuple[tuple[str, tuple[int, ...]], ...]) -> tuple[Any, Any, Any]:
    """``(transformation, jitted init, jitted step)`` for one config and parameter shapes."""
    import jax
    import optax

    from shampoo_jax import shampoo

    opt = shampoo(config)

    def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
        u, s2 = opt.update(g, s, p)
        return optax.apply_updates(p, u), s2

    return opt, jax.jit(opt.init), jax.jit(step)


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def jax_save(state: Any, config: ss.ShampooConfig) -> list[np.ndarray]:
    """``state_to_arrays`` (with the config where the API stores it), via ``np.savez``."""
    from shampoo_jax import state_to_arrays

    arrays = (state_to_arrays(state, config=config) if _accepts(state_to_arrays, "config")
              else state_to_arrays(state))
    buf = io.BytesIO()
    np.savez(buf, *arrays)
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as f:
        return [f[f"arr_{i}"] for i in range(len(arrays))]


def jax_load(arrays: list[np.ndarray], like: Any, config: ss.ShampooConfig) -> Any:
    from shampoo_jax import state_from_arrays

    if _accepts(state_from_arrays, "config"):
        return state_from_arrays(arrays, like, config=config)
    return state_from_arrays(arrays, like)


class JaxRun(Run):
    backend = "jax"
    functional = True

    def __init__(self, config: ss.ShampooConfig, params: dict[str, np.ndarray],
                 dtype: Any = np.float32, state: Any = None) -> None:
        import jax.numpy as jnp

        config = dataclasses.replace(config, factor_dtype="float32")
        super().__init__(config, params, np.float32)
        self.names = sorted(params)  # jax.tree.leaves order of a dict
        self.program = jax_program(config, tuple((n, self.shapes[n]) for n in self.names))
        self.p = {n: jnp.asarray(np.asarray(params[n], dtype=np.float32)) for n in self.names}
        self.s = self.program[1](self.p) if state is None else state

    def step(self, grads: dict[str, np.ndarray]) -> None:
        import jax.numpy as jnp

        from shampoo_jax import check_state
        from shampoo_spec import RootFailureError

        with np.errstate(all="ignore"):
            g = {n: jnp.asarray(np.asarray(grads[n], dtype=np.float32)) for n in self.names}
        p2, s2 = self.program[2](self.p, self.s, g)
        self.returned = self._snapshot(p2, s2)
        try:
            check_state(s2, self.config, previous=self.s)
        except RootFailureError:
            self.p, self.s = p2, s2  # the step completed, then it raised (eq. 13)
            raise
        self.p, self.s = p2, s2

    def snapshot(self) -> Snapshot:
        return self._snapshot(self.p, self.s)

    def _snapshot(self, p: Any, s: Any) -> Snapshot:
        from shampoo_jax.blocks import make_layout

        out: Snapshot = {}
        for n in self.names:
            out[("param", n)] = self._merged(n, p[n])
        layout = make_layout(tuple(self.shapes[n] for n in self.names), self.config)
        for field in s._fields:
            value = getattr(s, field)
            if value is None:
                continue
            if field == "groups" and len(value) == len(layout.groups):
                for gs, grp in zip(value, layout.groups, strict=True):
                    for row, (leaf, block) in enumerate(grp.members):
                        rows: Snapshot = {}
                        flatten((), gs, rows)
                        for k, arr in rows.items():
                            out[("block", self.names[leaf], str(block), *k)] = arr[row]
            elif field in ("root_failures", "skipped_blocks", "withheld_updates"):
                out[("counter", field)] = np.asarray(value)
            elif field.startswith(("skipped", "root_failures")):  # per-parameter counters
                flatten(("counter", field), value, out)
            elif isinstance(value, dict) and set(value) == set(self.names):
                for n in self.names:
                    out[("elem", n, field)] = self._merged(n, value[n])
            else:
                flatten(("scalar", field), value, out)
        return out

    def save(self) -> Any:
        return (jax_save(self.s, self.config), self.params())

    def restore(self, checkpoint: Any) -> Run:
        arrays, params = checkpoint
        like = JaxRun(self.config, params)
        return JaxRun(self.config, params, state=jax_load(arrays, like.s, self.config))


RUNS: dict[str, type[Run]] = {"reference": ReferenceRun, "torch": TorchRun, "jax": JaxRun}


def make_run(backend: str, config: ss.ShampooConfig, params: dict[str, np.ndarray],
             dtype: Any = None) -> Run:
    cls = RUNS[backend]
    return cls(config, params, dtype if dtype is not None else
               (np.float64 if backend == "reference" else np.float32))


def available(backend: str) -> str | None:
    """None when ``backend`` can run here, else why not (its framework is missing)."""
    modules = {"reference": ("shampoo_reference",), "torch": ("torch", "shampoo_torch"),
               "jax": ("jax", "optax", "shampoo_jax")}[backend]
    for m in modules:
        try:
            __import__(m)
        except ImportError as err:
            return f"{backend}: {m} is not installed ({err})"
    return None


__all__ = [
    "BACKENDS",
    "JaxRun",
    "ReferenceRun",
    "Run",
    "Snapshot",
    "TorchRun",
    "available",
    "counters",
    "flatten",
    "jax_load",
    "jax_program",
    "jax_save",
    "make_run",
]
