"""Invariant (e) of docs/reliability.md: a damaged checkpoint is refused with ValueError
and changes nothing (:func:`check_corrupt_checkpoint`, one damage of :data:`CORRUPTIONS`
at a time, on torch and JAX)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

import shampoo_spec as ss

from .data import Stream
from .drivers import Run, make_run
from .invariants import (
    Violation,
    count,
    describe,
    differences,
    show_keys,
    step_or_error,
)

CORRUPTIONS = ("shape", "missing", "extra", "nan", "inf", "config", "param_shape", "dtype",
               "lr", "step", "type")


def _other_shapes(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The same names, the first parameter with a different shape (transposed if it can be)."""
    out = dict(shapes)
    name = next(iter(out))
    s = out[name]
    # Transposed unless that is the same shape (a palindrome such as (1, 5, 1)).
    out[name] = s[::-1] if s[::-1] != s else (s[0] + 1, *s[1:]) if s else (2,)
    return out


def check_corrupt_checkpoint(backend: str, config: ss.ShampooConfig, other: ss.ShampooConfig,
                             params: dict[str, np.ndarray], stream: Stream, kind: str,
                             seed: int) -> None:
    """(e): a corrupted checkpoint is refused with ValueError and the target is unchanged."""
    rng = np.random.default_rng(seed)
    src = make_run(backend, config, params)
    for grads in stream:
        step_or_error(src, grads)
    target_config, target_params = config, params
    if kind == "config":
        if other == config or dataclasses.replace(other, factor_dtype=config.factor_dtype) == \
                dataclasses.replace(config, factor_dtype=other.factor_dtype):
            count("e_corrupt_checkpoint", backend, "same_config")
            return
        target_config = other
    if kind == "param_shape":
        shapes = _other_shapes({n: np.shape(v) for n, v in params.items()})
        target_params = {n: np.zeros(s) for n, s in shapes.items()}
    target = make_run(backend, target_config, target_params)
    if stream and kind != "param_shape":
        step_or_error(target, stream[0])
    if backend == "torch":
        _corrupt_torch(src, target, kind, rng)
    elif backend == "jax":
        _corrupt_jax(src, target, kind, rng)
    else:
        raise ValueError(f"backend {backend!r} has no checkpoint")


def _tensor_slots(tree: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths to every tensor under ``tree`` (dicts and lists)."""
    out = []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) \
        if isinstance(tree, list) else ()
    for k, v in items:
        if hasattr(v, "is_floating_point"):
            out.append((*path, k))
        else:
            out.extend(_tensor_slots(v, (*path, k)))
    return out


def _dict_slots(tree: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths to every key of every dict under ``tree``, but keys of an empty dict (removing
    one loses nothing: torch's flattened state dicts drop empty dicts, so a backend may read
    a missing one as empty, e.g. the blocks of a parameter with none)."""
    out = []
    if isinstance(tree, dict):
        for k, v in tree.items():
            if not (isinstance(v, dict) and not v):
                out.append((*path, k))
            out.extend(_dict_slots(v, (*path, k)))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out.extend(_dict_slots(v, (*path, i)))
    return out


def _get(tree: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _corrupt_torch(src: Run, target: Run, kind: str, rng: np.random.Generator) -> None:
    import torch

    from .drivers import TorchRun

    assert isinstance(src, TorchRun) and isinstance(target, TorchRun)
    sd = TorchRun.load(src.save()[0])
    state = sd["state"]
    tensors = _tensor_slots(state, ("state",))
    floats = [p for p in tensors if _get(sd, p).is_floating_point() and _get(sd, p).numel()]
    what = kind
    if kind in ("shape", "nan", "inf", "dtype", "type") and not floats:
        kind = "lr"
    if kind == "shape":
        path = floats[rng.integers(len(floats))]
        t = _get(sd, path)
        square = t.ndim == 2 and t.shape[0] == t.shape[1]
        _get(sd, path[:-1])[path[-1]] = (t.T.contiguous() if t.ndim == 2 and not square
                                         else torch.cat([t.reshape(-1), t.reshape(-1)[:1]]))
    elif kind in ("nan", "inf"):
        path = floats[rng.integers(len(floats))]
        t = _get(sd, path).clone()
        t.reshape(-1)[rng.integers(t.numel())] = math.nan if kind == "nan" else -math.inf
        _get(sd, path[:-1])[path[-1]] = t
    elif kind == "dtype":
        path = floats[rng.integers(len(floats))]
        _get(sd, path[:-1])[path[-1]] = _get(sd, path).to(torch.int64)
    elif kind == "type":
        path = floats[rng.integers(len(floats))]
        _get(sd, path[:-1])[path[-1]] = _get(sd, path).tolist()
    elif kind == "missing":
        slots = _dict_slots(state, ("state",))
        path = slots[rng.integers(len(slots))] if slots else ("param_groups", 0, "config")
        del _get(sd, path[:-1])[path[-1]]
    elif kind == "extra":
        slots = [p for p in _dict_slots(state, ("state",)) if isinstance(_get(sd, p), dict)]
        (_get(sd, slots[rng.integers(len(slots))]) if slots else state)["bogus"] = torch.zeros(1)
    elif kind == "lr":
        sd["param_groups"][0]["lr"] = [math.nan, -1.0, math.inf, "0.1", None][rng.integers(5)]
    elif kind == "step":
        steps = [p for p in _dict_slots(state, ("state",)) if p[-1] == "step"]
        if not steps:
            count("e_corrupt_checkpoint", "torch", "not_applicable")
            return
        path = steps[rng.integers(len(steps))]
        # Steps are int64 in torch (counts past 2**31 - 1 are valid): 2**63 is not.
        _get(sd, path[:-1])[path[-1]] = [-1, "3", 2.5, 2**63, None][rng.integers(5)]
    before = target.snapshot()
    try:
        target.opt.load_state_dict(sd)
    except ValueError:
        pass
    except Exception as err:  # noqa: BLE001
        raise Violation(f"torch: load_state_dict of a checkpoint with {what!r} damage raised "
                        f"{describe(err)}") from err
    else:
        raise Violation(f"torch: load_state_dict accepted a checkpoint with {what!r} damage")
    changed = differences(before, target.snapshot())
    if changed:
        raise Violation(f"torch: a refused load_state_dict ({what!r}) changed {show_keys(changed)}")
    count("e_corrupt_checkpoint", "torch", kind)


def _corrupt_jax(src: Run, target: Run, kind: str, rng: np.random.Generator) -> None:
    from .drivers import JaxRun, jax_load, jax_save

    assert isinstance(src, JaxRun) and isinstance(target, JaxRun)
    arrays = [a.copy() for a in jax_save(src.s, src.config)]
    floats = [i for i, a in enumerate(arrays) if a.dtype.kind == "f" and a.size]
    what = kind
    if kind in ("lr", "step", "type"):
        kind = "dtype"
    if kind in ("shape", "nan", "inf", "dtype") and not floats:
        kind = "missing"
    if kind == "shape":
        i = floats[rng.integers(len(floats))]
        a = arrays[i]
        arrays[i] = a.T.copy() if a.ndim == 2 and a.shape[0] != a.shape[1] else \
            np.concatenate([a.reshape(-1), a.reshape(-1)[:1]])
    elif kind in ("nan", "inf"):
        i = floats[rng.integers(len(floats))]
        arrays[i].reshape(-1)[rng.integers(arrays[i].size)] = (
            math.nan if kind == "nan" else -math.inf)
    elif kind == "dtype":
        i = floats[rng.integers(len(floats))]
        arrays[i] = arrays[i].astype(np.float64)
    elif kind == "missing":
        del arrays[rng.integers(len(arrays))]
    elif kind == "extra":
        arrays.append(np.zeros(3, np.float32))
    try:
        jax_load(arrays, target.s, target.config)
    except ValueError:
        pass
    except Exception as err:  # noqa: BLE001
        raise Violation(f"jax: state_from_arrays with {what!r} damage raised {describe(err)}"
                        ) from err
    else:
        raise Violation(f"jax: state_from_arrays accepted arrays with {what!r} damage "
                        f"({kind})")
    count("e_corrupt_checkpoint", "jax", kind)


__all__ = ["CORRUPTIONS", "check_corrupt_checkpoint"]
