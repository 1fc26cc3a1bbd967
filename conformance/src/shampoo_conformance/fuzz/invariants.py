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
(e) :func:`.corruption.check_corrupt_checkpoint`: a damaged checkpoint is
    refused with ValueError and changes nothing.
(f) :func:`.distributed.check_modes`: DDP, fully_shard lossless and local and
    HSDP at 2 and 4 gloo ranks equal one process (errors and weights, bit for
    bit), and resume across world sizes.

:data:`COUNTS` counts every case by (invariant, backend, outcome).
"""

from __future__ import annotations

import collections
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


#: What a distributed or sharded run may raise in a step (invariant f), the same as one
#: process: eq. (3)'s "raise" and eq. (13)'s limit.
ALLOWED_ERRORS = (None, "NonFiniteGradientError", "RootFailureError")


def check_same_error(at: str, got: str | None, want: str | None, oracle: str) -> None:
    """Invariant (f): a step raised (the error type's name) what the ``oracle`` raised, and
    that is one of :data:`ALLOWED_ERRORS`."""
    if got != want:
        raise Violation(f"{at}: raised {got}, {oracle} raised {want}")
    if got not in ALLOWED_ERRORS:
        raise Violation(f"{at}: raised {got}")


def describe(err: BaseException) -> str:
    """An error's type and the start of its message, for a violation's text."""
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


def show_keys(keys: list[Key], limit: int = 6) -> str:
    """The first ``limit`` state keys, joined, and how many more."""
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
            raise Violation(f"constructing {recipe} raised {describe(err)}") from err
        outcome = "missing_required"
    except ValueError as err:
        if not _names_one_of(str(err), names):
            raise Violation(f"ValueError names no field of the recipe: {describe(err)}"
                            ) from err
        outcome = "refused"
    except Exception as err:  # noqa: BLE001
        raise Violation(f"constructing {recipe} raised {describe(err)}") from err
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
        raise Violation(f"from_dict({recipe.as_dict()!r}) raised {describe(err)}") from err
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
            raise Violation(f"from_{which}: error names no argument: {describe(err)}") from err
        count("a_construction", "spec", f"{which}_refused")
        return
    except Exception as err:  # noqa: BLE001
        raise Violation(f"from_{which}({kwargs!r}) raised {describe(err)}") from err
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
        raise Violation(f"{backend}: constructing {what} raised {describe(err)}") from err
    try:
        after(built)
    except PROJECT_ERRORS:
        count("a_construction", backend, "built_then_refused")
        return
    except Violation:
        raise
    except Exception as err:  # noqa: BLE001
        raise Violation(f"{backend}: after constructing {what}: {describe(err)}") from err
    count("a_construction", backend, "built")


# ------------------------------------------------------------------- (b)
def step_or_error(run: Run, grads: dict[str, np.ndarray]) -> BaseException | None:
    """One step: the project error it raised, or None; any other error is a violation."""
    try:
        run.step(grads)
    except PROJECT_ERRORS as err:
        return err
    except Exception as err:  # noqa: BLE001
        raise Violation(f"{run.backend}: a step raised {describe(err)}") from err
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
        err = step_or_error(run, grads)
        after = run.snapshot()
        if isinstance(err, NonFiniteGradientError):
            if policy != "raise" or not n:
                raise Violation(f"{where}: NonFiniteGradientError without a refused block under "
                                f"{policy!r}: {describe(err)}")
            bad = [name for name, bs in refused.items() if bs]
            if not any(name in str(err) for name in bad):
                raise Violation(f"{where}: NonFiniteGradientError names none of {bad}: "
                                f"{describe(err)}")
            changed = differences(before, after)
            if changed:
                raise Violation(f"{where}: raised NonFiniteGradientError but changed "
                                f"{show_keys(changed)}")
            if run.functional and run.returned is not None:
                _check_counted(where, before, run.returned, n)
            count("b_step", backend, "raised_nonfinite")
            continue
        if isinstance(err, RootFailureError):
            if limit is None:
                raise Violation(f"{where}: RootFailureError without a limit: {describe(err)}")
            count("b_step", backend, "raised_root_failure")
        elif isinstance(err, ValueError):
            raise Violation(f"{where}: ValueError on valid input: {describe(err)}")
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
            raise Violation(f"{where}: non-finite after the step: {show_keys(bad_keys)}")
        if policy == "skip_block":
            _check_counted(where, before, after, n)


def _check_counted(where: str, before: Snapshot, after: Snapshot, n: int) -> None:
    got = counters(after).get("skipped_blocks", 0) - counters(before).get("skipped_blocks", 0)
    if got != n:
        raise Violation(f"{where}: skipped_blocks grew by {got}, expected {n}")
    bad_keys = nonfinite(after)
    if bad_keys:
        raise Violation(f"{where}: non-finite in the returned state: {show_keys(bad_keys)}")


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
        step_or_error(run, grads)
        after = run.snapshot()
        for name, bs in refused.items():
            for b in bs:
                changed = differences(block_part(before, run, name, b),
                                      block_part(after, run, name, b))
                if changed:
                    raise Violation(f"{where}: refused block {name}[{b}] changed "
                                    f"{show_keys(changed)}")
        if any(refused.values()):
            refusing += 1
            _check_counted(where, before, after, sum(len(v) for v in refused.values()))
            if independent:
                twin = make_run(backend, config, params, dtype)
                for g in history:
                    step_or_error(twin, g)
                step_or_error(twin, _zero_blocks(run, grads, refused))
                changed = differences(_masked(after, run, refused),
                                      _masked(twin.snapshot(), run, refused))
                if changed:
                    raise Violation(f"{where}: the other blocks differ from a step with the "
                                    f"refused blocks' gradients zero: {show_keys(changed)}")
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
        step_or_error(run, grads)
    try:
        resumed = run.restore(run.save())
    except Exception as err:  # noqa: BLE001
        raise Violation(f"{backend}: restoring a checkpoint after {at} steps raised "
                        f"{describe(err)}") from err
    changed = differences(run.snapshot(), resumed.snapshot(), bits=True)
    if changed:
        raise Violation(f"{backend}: the restored state differs: {show_keys(changed)}")
    for t, grads in enumerate(stream[at:], start=at + 1):
        e1, e2 = step_or_error(run, grads), step_or_error(resumed, grads)
        if type(e1) is not type(e2):
            raise Violation(f"{backend}, step {t}: {e1!r} without checkpoint, {e2!r} with")
        changed = differences(run.snapshot(), resumed.snapshot(), bits=True)
        if changed:
            raise Violation(f"{backend}, step {t} after resuming at {at}: differs in "
                            f"{show_keys(changed)}")
    count("d_checkpoint", backend, "resumed")


__all__ = [
    "ALLOWED_ERRORS",
    "COUNTS",
    "PROJECT_ERRORS",
    "Violation",
    "block_part",
    "check_checkpoint",
    "check_config_recipe",
    "check_construction",
    "check_importer",
    "check_same_error",
    "check_skip_equals_omit",
    "check_stream",
    "count",
    "describe",
    "differences",
    "nonfinite",
    "show_keys",
    "step_or_error",
]
