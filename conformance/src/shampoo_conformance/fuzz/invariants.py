"""The fuzzer's invariants (docs/reliability.md), each a function that raises :class:`Violation`.

(a) :func:`check_config_recipe`, :func:`check_importer`, :func:`check_construction`:
    construction succeeds or raises ValueError naming a field (importers may
    also raise NotImplementedError for options not implemented).
(b) :func:`check_stream`: a step succeeds with finite weights and state, or
    raises a project error: NonFiniteGradientError exactly when a block is
    refused under ``"raise"`` and then nothing changed (JAX: the returned
    state is finite and counts the block); RootFailureError only with a limit,
    after a completed step.
(c) :func:`check_skip_equals_omit`: under ``"skip_block"`` a refused block
    keeps its weights and state bit for bit, is counted, and (for configs
    whose blocks are independent) the rest of the step equals the step in
    which that block's gradient was zero.
(d) :func:`check_checkpoint`: save, load into a fresh optimizer, continue:
    bit-identical to never checkpointing.
(e) :func:`check_corrupt_checkpoint`: a damaged checkpoint is refused with
    ValueError and changes nothing.
(f) :func:`check_ddp`: two gloo ranks, a NaN on one rank only: the replicas
    stay equal (and raise together under ``"raise"``).

:data:`COUNTS` counts every case by (invariant, backend, outcome).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

import shampoo_spec as ss
from shampoo_spec import NonFiniteGradientError, RootFailureError

from .configs import GOOGLE_BOOLS, GOOGLE_INTS, META_BOOLS, META_INTS, Recipe
from .data import Stream, refused_blocks
from .drivers import Key, Run, Snapshot, counters, make_run

#: Cases run, by (invariant, backend, outcome).
COUNTS: collections.Counter[tuple[str, str, str]] = collections.Counter()
#: The errors a backend may raise (besides warnings).
PROJECT_ERRORS = (ValueError, NonFiniteGradientError, RootFailureError)


class Violation(AssertionError):
    """An invariant of docs/reliability.md does not hold."""


def count(invariant: str, backend: str, outcome: str) -> None:
    COUNTS[(invariant, backend, outcome)] += 1


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err)[:300]}"


# ------------------------------------------------------------ comparisons
def nonfinite(snap: Snapshot) -> list[Key]:
    return [k for k, v in snap.items()
            if v.dtype.kind in "fc" and not np.all(np.isfinite(v))]


def differences(a: Snapshot, b: Snapshot, bits: bool = False,
                skip: Callable[[Key], bool] = lambda k: False) -> list[Key]:
    """Keys whose arrays differ (NaN equal to NaN; ``bits``: byte for byte), or exist once."""
    out = []
    for k in sorted(set(a) | set(b)):
        if skip(k):
            continue
        if k not in a or k not in b:
            out.append(k)
            continue
        x, y = a[k], b[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            out.append(k)
        elif bits:
            if x.tobytes() != y.tobytes():
                out.append(k)
        elif not np.array_equal(x, y, equal_nan=x.dtype.kind in "fc"):
            out.append(k)
    return out


def _show(keys: list[Key], limit: int = 6) -> str:
    shown = ", ".join("/".join(k) for k in keys[:limit])
    return shown + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


def block_part(snap: Snapshot, run: Run, name: str, b: int) -> Snapshot:
    """The weights, elementwise state and block state of block ``b`` of ``name``."""
    slices = run.plans[name].blocks[b].slices
    out: Snapshot = {}
    for k, v in snap.items():
        if k[0] in ("param", "elem") and k[1] == name:
            out[k] = v[slices]
        elif k[0] == "block" and k[1] == name and k[2] == str(b):
            out[k] = v
    return out


def _masked(snap: Snapshot, run: Run, refused: Mapping[str, list[int]]) -> Snapshot:
    """``snap`` with the refused blocks' entries replaced by 0 (their state dropped)."""
    out: Snapshot = {}
    for k, v in snap.items():
        if k[0] == "counter":
            continue
        if k[0] == "block" and int(k[2]) in refused.get(k[1], []):
            continue
        if k[0] in ("param", "elem") and refused.get(k[1]):
            v = v.copy()
            for b in refused[k[1]]:
                v[run.plans[k[1]].blocks[b].slices] = 0
        out[k] = v
    return out


# ------------------------------------------------------------------- (a)
def _names_one_of(message: str, names: set[str]) -> bool:
    return any(n in message for n in names if n)


def check_config_recipe(recipe: Recipe) -> None:
    """(a) for ShampooConfig: constructors and ``from_dict`` build or raise a named ValueError."""
    names = recipe.names() | {"ShampooConfig"}
    try:
        config = recipe.build()
    except TypeError as err:
        # Python's own signature check: a required keyword (OrderOverride.order) left out
        # of a direct constructor call. from_dict, the path for data, must name it instead.
        if "required" not in str(err):
            raise Violation(f"constructing {recipe} raised {_describe(err)}") from err
        outcome = "missing_required"
    except ValueError as err:
        if not _names_one_of(str(err), names):
            raise Violation(f"ValueError names no field of the recipe: {_describe(err)}"
                            ) from err
        outcome = "refused"
    except Exception as err:  # noqa: BLE001
        raise Violation(f"constructing {recipe} raised {_describe(err)}") from err
    else:
        outcome = "built"
        plain = json.loads(json.dumps(config.to_dict()))
        if ss.ShampooConfig.from_dict(plain) != config:
            raise Violation(f"JSON round trip changed {config}")
    try:
        ss.ShampooConfig.from_dict(recipe.as_dict())
    except ValueError:
        pass
    except Exception as err:  # noqa: BLE001
        raise Violation(f"from_dict({recipe.as_dict()!r}) raised {_describe(err)}") from err
    count("a_construction", "spec", outcome)


def _keys(tree: Any) -> set[str]:
    out: set[str] = set()
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            out.add(str(k))
            out |= _keys(v)
    return out


def check_importer(which: str, kwargs: dict[str, Any]) -> None:
    """(a) for ``from_meta``/``from_google``: a config, a named ValueError or NotImplementedError.

    Strict reading: a non-bool for a flag, or a non-integral number for an
    integer argument, is refused (never read as truthy, never truncated).
    """
    fn = ss.from_meta if which == "meta" else ss.from_google
    bools, ints = (META_BOOLS, META_INTS) if which == "meta" else (GOOGLE_BOOLS, GOOGLE_INTS)
    try:
        config = fn(kwargs)
    except (ValueError, NotImplementedError) as err:
        if not _names_one_of(str(err), _keys(kwargs) | {"from_meta", "from_google"}):
            raise Violation(f"from_{which}: error names no argument: {_describe(err)}") from err
        count("a_construction", "spec", f"{which}_refused")
        return
    except Exception as err:  # noqa: BLE001
        raise Violation(f"from_{which}({kwargs!r}) raised {_describe(err)}") from err
    if not isinstance(config, ss.ShampooConfig):
        raise Violation(f"from_{which} returned {type(config).__name__}")
    for key in bools:
        if key in kwargs and not isinstance(kwargs[key], bool):
            raise Violation(f"from_{which} accepted {key}={kwargs[key]!r} (not a bool)")
    for key in ints:
        v = kwargs.get(key)
        if isinstance(v, float) and math.isfinite(v) and not v.is_integer():
            raise Violation(f"from_{which} accepted {key}={v!r} (not an integer)")
    count("a_construction", "spec", f"{which}_built")


def check_construction(backend: str, build: Callable[[], Any], after: Callable[[Any], None],
                       what: str) -> None:
    """(a) for a backend: ``build()`` succeeds or raises ValueError; then ``after(built)``
    (a bad gradient, an eval_shape update) raises nothing but project errors."""
    try:
        built = build()
    except ValueError:
        count("a_construction", backend, "refused")
        return
    except Exception as err:  # noqa: BLE001
        raise Violation(f"{backend}: constructing {what} raised {_describe(err)}") from err
    try:
        after(built)
    except PROJECT_ERRORS:
        count("a_construction", backend, "built_then_refused")
        return
    except Violation:
        raise
    except Exception as err:  # noqa: BLE001
        raise Violation(f"{backend}: after constructing {what}: {_describe(err)}") from err
    count("a_construction", backend, "built")


# ------------------------------------------------------------------- (b)
def _step(run: Run, grads: dict[str, np.ndarray]) -> BaseException | None:
    try:
        run.step(grads)
    except PROJECT_ERRORS as err:
        return err
    except Exception as err:  # noqa: BLE001
        raise Violation(f"{run.backend}: a step raised {_describe(err)}") from err
    return None


def check_stream(backend: str, config: ss.ShampooConfig, params: dict[str, np.ndarray],
                 stream: Stream, dtype: Any = None) -> None:
    """(b) over a whole stream."""
    run = make_run(backend, config, params, dtype)
    policy = config.failure.nonfinite_gradient
    limit = config.failure.max_consecutive_root_failures
    for t, grads in enumerate(stream, start=1):
        before = run.snapshot()
        refused = refused_blocks(run.config, run.params(), grads, run.dtype)
        n = sum(len(v) for v in refused.values())
        where = f"{backend}, step {t}, refused blocks {refused}"
        err = _step(run, grads)
        after = run.snapshot()
        if isinstance(err, NonFiniteGradientError):
            if policy != "raise" or not n:
                raise Violation(f"{where}: NonFiniteGradientError without a refused block under "
                                f"{policy!r}: {_describe(err)}")
            bad = [name for name, bs in refused.items() if bs]
            if not any(name in str(err) for name in bad):
                raise Violation(f"{where}: NonFiniteGradientError names none of {bad}: "
                                f"{_describe(err)}")
            changed = differences(before, after)
            if changed:
                raise Violation(f"{where}: raised NonFiniteGradientError but changed "
                                f"{_show(changed)}")
            if run.functional and run.returned is not None:
                _check_counted(where, before, run.returned, n)
            count("b_step", backend, "raised_nonfinite")
            continue
        if isinstance(err, RootFailureError):
            if limit is None:
                raise Violation(f"{where}: RootFailureError without a limit: {_describe(err)}")
            count("b_step", backend, "raised_root_failure")
        elif isinstance(err, ValueError):
            raise Violation(f"{where}: ValueError on valid input: {_describe(err)}")
        elif policy == "raise" and n and not run.functional:
            raise Violation(f"{where}: a refused block under 'raise' did not raise")
        elif policy == "raise" and n:
            raise Violation(f"{where}: check_state did not raise for a refused block")
        else:
            withheld = (counters(after).get("withheld_updates", 0)
                        > counters(before).get("withheld_updates", 0))  # eq. (22)
            count("b_step", backend, "skipped" if n else "withheld" if withheld else "ok")
        bad_keys = nonfinite(after)
        if bad_keys:
            raise Violation(f"{where}: non-finite after the step: {_show(bad_keys)}")
        if policy == "skip_block":
            _check_counted(where, before, after, n)


def _check_counted(where: str, before: Snapshot, after: Snapshot, n: int) -> None:
    got = counters(after).get("skipped_blocks", 0) - counters(before).get("skipped_blocks", 0)
    if got != n:
        raise Violation(f"{where}: skipped_blocks grew by {got}, expected {n}")
    bad_keys = nonfinite(after)
    if bad_keys:
        raise Violation(f"{where}: non-finite in the returned state: {_show(bad_keys)}")


# ------------------------------------------------------------------- (c)
def check_skip_equals_omit(backend: str, config: ss.ShampooConfig,
                           params: dict[str, np.ndarray], stream: Stream,
                           dtype: Any = None) -> None:
    """(c): refused blocks unchanged; with independent blocks, the rest equals a zero block."""
    assert config.failure.nonfinite_gradient == "skip_block"
    independent = (config.grafting.rescale_scope != "parameter"
                   and not config.grafting.normalizes_input)
    run = make_run(backend, config, params, dtype)
    history: list[dict[str, np.ndarray]] = []
    refusing = 0
    for t, grads in enumerate(stream, start=1):
        before = run.snapshot()
        refused = refused_blocks(run.config, run.params(), grads, run.dtype)
        where = f"{backend}, step {t}, refused blocks {refused}"
        _step(run, grads)
        after = run.snapshot()
        for name, bs in refused.items():
            for b in bs:
                changed = differences(block_part(before, run, name, b),
                                      block_part(after, run, name, b))
                if changed:
                    raise Violation(f"{where}: refused block {name}[{b}] changed "
                                    f"{_show(changed)}")
        if any(refused.values()):
            refusing += 1
            _check_counted(where, before, after, sum(len(v) for v in refused.values()))
            if independent:
                twin = make_run(backend, config, params, dtype)
                for g in history:
                    _step(twin, g)
                _step(twin, _zero_blocks(run, grads, refused))
                changed = differences(_masked(after, run, refused),
                                      _masked(twin.snapshot(), run, refused))
                if changed:
                    raise Violation(f"{where}: the other blocks differ from a step with the "
                                    f"refused blocks' gradients zero: {_show(changed)}")
        history.append(grads)
    count("c_skip_equals_omit", backend,
          ("refused_independent" if independent else "refused") if refusing else "none_refused")


def _zero_blocks(run: Run, grads: dict[str, np.ndarray],
                 refused: Mapping[str, list[int]]) -> dict[str, np.ndarray]:
    out = {}
    for name, g in grads.items():
        plan = run.plans[name]
        m = np.array(g, dtype=np.float64).reshape(plan.merged_shape)
        for b in refused.get(name, []):
            m[plan.blocks[b].slices] = 0.0
        out[name] = m.reshape(np.shape(g))
    return out


# ------------------------------------------------------------------- (d)
def check_checkpoint(backend: str, config: ss.ShampooConfig, params: dict[str, np.ndarray],
                     stream: Stream, at: int, dtype: Any = None) -> None:
    """(d): checkpoint after ``at`` steps, resume in a fresh optimizer: bit-identical."""
    run = make_run(backend, config, params, dtype)
    for grads in stream[:at]:
        _step(run, grads)
    try:
        resumed = run.restore(run.save())
    except Exception as err:  # noqa: BLE001
        raise Violation(f"{backend}: restoring a checkpoint after {at} steps raised "
                        f"{_describe(err)}") from err
    changed = differences(run.snapshot(), resumed.snapshot(), bits=True)
    if changed:
        raise Violation(f"{backend}: the restored state differs: {_show(changed)}")
    for t, grads in enumerate(stream[at:], start=at + 1):
        e1, e2 = _step(run, grads), _step(resumed, grads)
        if type(e1) is not type(e2):
            raise Violation(f"{backend}, step {t}: {e1!r} without checkpoint, {e2!r} with")
        changed = differences(run.snapshot(), resumed.snapshot(), bits=True)
        if changed:
            raise Violation(f"{backend}, step {t} after resuming at {at}: differs in "
                            f"{_show(changed)}")
    count("d_checkpoint", backend, "resumed")


# ------------------------------------------------------------------- (e)
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
        _step(src, grads)
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
        _step(target, stream[0])
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
    """Paths to every key of every dict under ``tree``."""
    out = []
    if isinstance(tree, dict):
        for k, v in tree.items():
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
                        f"{_describe(err)}") from err
    else:
        raise Violation(f"torch: load_state_dict accepted a checkpoint with {what!r} damage")
    changed = differences(before, target.snapshot())
    if changed:
        raise Violation(f"torch: a refused load_state_dict ({what!r}) changed {_show(changed)}")
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
        raise Violation(f"jax: state_from_arrays with {what!r} damage raised {_describe(err)}"
                        ) from err
    else:
        raise Violation(f"jax: state_from_arrays accepted arrays with {what!r} damage "
                        f"({kind})")
    count("e_corrupt_checkpoint", "jax", kind)


__all__ = [
    "CORRUPTIONS",
    "COUNTS",
    "PROJECT_ERRORS",
    "Violation",
    "block_part",
    "check_checkpoint",
    "check_config_recipe",
    "check_construction",
    "check_corrupt_checkpoint",
    "check_importer",
    "check_skip_equals_omit",
    "check_stream",
    "count",
    "differences",
    "nonfinite",
]
