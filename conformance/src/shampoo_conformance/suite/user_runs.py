"""A user's run of a backend's library: the checks behind the side-effect and defaults
properties (test_side_effects.py, test_library_defaults.py), shared with
``test_documented_deviation``, which demonstrates a deviation shown only by them.

A backend offers the registry's hooks (thirdparty/registry.py): ``USER_KWARGS``
(what a user must pass), ``defaults_config()`` (the spec's config of the library at
those arguments) and ``library_run(kwargs, params, grads, dtype)`` (the library
built from exactly ``kwargs`` and stepped as a user steps it). Each check raises
AssertionError saying what happened, and skips on a backend without the hooks.

The defaults run compares, step by step, the parameters of eq. (2)'s update
W_t = W_{t-1} - lr U_t against the reference on ``defaults_config()``, within the
bound of docs/spec.md section 5 (suite/tolerances.py) for the precision the
library computes in: the coarser of the parameters' dtype and the config's
``factor_dtype``, since the factors and roots (eqs. 6, 10) of a library's
default are kept in ``factor_dtype`` whatever the parameters (the suite's other
comparisons run every backend with factors in the parameters' dtype).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from shampoo_conformance.protocol import Backend
from shampoo_conformance.suite.cases import make_problem
from shampoo_conformance.suite.divergence import first_divergence, reproduction
from shampoo_conformance.suite.tolerances import bound_and_reference
from shampoo_conformance.thirdparty.registry import Deviation, LibraryRun
from shampoo_spec import ShampooConfig, config_differences
from shampoo_spec.schedule import is_root_step

#: Small problems: a matrix, a vector, a 3-d tensor and a row with a size-1 dim.
SHAPES: dict[str, tuple[int, ...]] = {"w": (7, 10), "b": (5,), "t": (3, 4, 5), "r": (1, 6)}
#: Steps of the side-effect runs, and the bounds on a defaults run's (each test ~5 s).
SIDE_EFFECT_STEPS, MIN_STEPS, MAX_STEPS = 3, 5, 24
SEED = 0
#: Why our distributed backends have no hooks: each run is several processes.
_NO_HOOKS = ("its adapter has no USER_KWARGS / defaults_config / library_run "
             "(thirdparty/registry.py's user-run hooks; a distributed backend runs "
             "several processes, which these single-process probes cannot look into)")


def hooks(backend: Backend) -> tuple[dict[str, Any], Callable[[], ShampooConfig],
                                     Callable[..., LibraryRun]]:
    """The backend's ``USER_KWARGS``, ``defaults_config`` and ``library_run``, or a skip."""
    found = [getattr(backend, name, None)
             for name in ("USER_KWARGS", "defaults_config", "library_run")]
    if any(f is None for f in found):
        pytest.skip(f"backend {backend.name!r}: {_NO_HOOKS}")
    kwargs, defaults, run = found
    return dict(kwargs), defaults, run  # type: ignore[arg-type,return-value]


def supports(backend: Backend, dtype: Any) -> bool:
    return np.dtype(dtype) in [
        np.dtype(d) for d in getattr(backend, "dtypes", (np.float64, np.float32))]


def side_effect_dtype(backend: Backend) -> Any:
    """float32 where the backend runs it (most users' dtype; a float64 crash is the
    float64 property's), else float64."""
    return np.float32 if supports(backend, np.float32) else np.float64


def defaults_steps(config: ShampooConfig) -> int:
    """Steps enough that the defaults run preconditions: two past the first root step
    at or after ``start_preconditioning_step`` (eq. 8), within [MIN_STEPS, MAX_STEPS]."""
    schedule = config.schedule
    start = schedule.start_preconditioning_step
    if start is None:  # never preconditions: the grafted method throughout
        return MIN_STEPS
    first = next((t for t in range(start, MAX_STEPS + 1) if is_root_step(t, schedule)),
                 MAX_STEPS)
    return min(MAX_STEPS, max(MIN_STEPS, first + 2))


def _run(backend: Backend, kwargs: dict[str, Any], steps: int, dtype: Any
         ) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]], LibraryRun]:
    _, _, library_run = hooks(backend)
    params, grads = make_problem(SHAPES, steps, SEED)
    return params, grads, library_run(kwargs, params, grads, dtype)


def check_grads_unchanged(backend: Backend) -> None:
    """After each step the gradients the caller passed are bitwise what it passed."""
    kwargs, _, _ = hooks(backend)
    dtype = np.dtype(side_effect_dtype(backend))
    _, grads, run = _run(backend, kwargs, SIDE_EFFECT_STEPS, dtype)
    for t, (passed, seen) in enumerate(zip(grads, run.grads, strict=True), start=1):
        for name, value in passed.items():
            want = np.asarray(value, dtype=dtype)
            got = np.asarray(seen[name])
            if got.shape != want.shape:
                raise AssertionError(f"backend {backend.name!r} left the gradient of {name!r} "
                                     f"at step {t} of shape {got.shape}, not {want.shape}")
            change = np.abs(got.astype(np.float64) - want)
            finite = change[~np.isnan(change)]  # NaN: the library cleared p.grad
            biggest = float(finite.max()) if finite.size else float("nan")
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (
                f"backend {backend.name!r} changed the gradient of {name!r} it was given at "
                f"step {t} ({dtype.name}): max |change| {biggest:.3e} "
                f"(NaN: {bool(np.isnan(change).any())}), dtype {got.dtype}")


def check_unknown_argument_refused(backend: Backend) -> None:
    """``library_run(USER_KWARGS + {"not_an_argument": 1.0})`` raises TypeError or
    ValueError: a misspelled argument must not be dropped silently. An error that does
    not name the argument counts only where the same run without it succeeds (else
    the library refuses something else: these problems, say)."""
    kwargs, _, _ = hooks(backend)
    dtype = side_effect_dtype(backend)
    try:
        _run(backend, {**kwargs, "not_an_argument": 1.0}, 1, dtype)
    except (TypeError, ValueError) as err:
        print(f"{backend.name}: refused with {type(err).__name__}: {err}")
        if "not_an_argument" in str(err):
            return
        try:
            _run(backend, kwargs, 1, dtype)
        except Exception as other:  # noqa: BLE001  (the refusal was not about the argument)
            raise AssertionError(
                f"backend {backend.name!r} raises at USER_KWARGS alone too "
                f"({type(other).__name__}: {other}): the refusal of not_an_argument "
                "shows nothing") from other
        return
    except Exception as err:  # noqa: BLE001  (what it did instead is the finding)
        raise AssertionError(
            f"backend {backend.name!r} raised {type(err).__name__} (not TypeError or "
            f"ValueError) for the unknown argument not_an_argument=1.0: {err}") from err
    raise AssertionError(f"backend {backend.name!r} accepted the unknown argument "
                         "not_an_argument=1.0 silently (constructed and stepped)")


def _rng_states() -> dict[str, Any]:
    # The legacy global generator is the state under test (np.random.seed users).
    states: dict[str, Any] = {"numpy": np.random.get_state(),  # noqa: NPY002
                              "random": random.getstate()}
    try:
        import torch
    except ImportError:  # no torch: nothing of it to change
        return states
    states["torch"] = torch.get_rng_state().numpy().copy()
    return states


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    return bool(a == b)


def check_global_rng_unchanged(backend: Backend) -> None:
    """torch's, NumPy's and Python's global generators are as they were after a run."""
    kwargs, _, _ = hooks(backend)
    before = _rng_states()
    _run(backend, kwargs, SIDE_EFFECT_STEPS, side_effect_dtype(backend))
    after = _rng_states()
    changed = [name for name in before if not _same_state(before[name], after[name])]
    assert not changed, (f"backend {backend.name!r} changed the global random state of "
                         f"{', '.join(changed)} (a user's run draws from it or reseeds it)")


def check_float64_stays_float64(backend: Backend) -> None:
    """float64 parameters are float64 after every step (a crash fails, with its error)."""
    kwargs, _, _ = hooks(backend)
    try:
        _, _, run = _run(backend, kwargs, SIDE_EFFECT_STEPS, np.float64)
    except Exception as err:  # noqa: BLE001  (the crash is the finding)
        raise AssertionError(f"backend {backend.name!r} crashed on float64 parameters: "
                             f"{type(err).__name__}: {err}") from err
    bad = {f"{name} (step {t})": str(np.asarray(v).dtype)
           for t, step in enumerate(run.params, start=1) for name, v in step.items()
           if np.asarray(v).dtype != np.float64}
    assert not bad, f"backend {backend.name!r} returned float64 parameters as {bad}"


def check_defaults(backend: Backend, dtype: Any) -> None:
    """The library at ``USER_KWARGS`` against the reference on ``defaults_config()``."""
    kwargs, defaults, library_run = hooks(backend)
    if not supports(backend, dtype):
        pytest.skip(f"backend {backend.name!r} does not run {np.dtype(dtype).name}")
    config = defaults()
    steps = defaults_steps(config)
    params, grads = make_problem(SHAPES, steps, SEED)
    # The bound's u: the library computes its factors and roots in factor_dtype (module doc).
    work = np.float32 if "float32" in (np.dtype(dtype).name, config.factor_dtype) else dtype
    bound, ref = bound_and_reference(config, params, grads, work)
    try:
        run = library_run(kwargs, params, grads, dtype)
    except Exception as err:  # noqa: BLE001  (a crash at the defaults is the finding)
        raise AssertionError(f"backend {backend.name!r} crashed at its defaults "
                             f"({np.dtype(dtype).name}): {type(err).__name__}: {err}") from err
    div = first_divergence(run.params, ref, params, bound)
    if div is None and bound.rtol >= 1.0:
        # The allowed error is at least the whole displacement ||W_t - W_0||: the bound
        # cannot tell this run from one that did not step (a default epsilon far below
        # the factor dtype's resolution of rank-deficient factors, kappa ~ lambda / eps).
        pytest.skip(f"backend {backend.name!r}: finite and {steps} steps, but the bound of "
                    f"section 5 promises nothing at defaults_config() on these problems "
                    f"(kappa {bound.kappa:.3g}, rtol {bound.rtol:.3g} >= 1); measured "
                    f"max ||W - W_ref|| / ||W_ref - W_0|| = {_relative(run, ref, params):.3g}")
    assert div is None, (
        f"backend {backend.name!r} at its defaults {kwargs} leaves the reference on "
        f"defaults_config() (kappa <= {bound.kappa:.3g}, rtol {bound.rtol:.3g}).\n"
        f"{div.describe() if div else ''}\ndefaults_config() vs ShampooConfig(): "
        f"{config_differences(ShampooConfig(), config)}\n"
        + reproduction(config, SHAPES, steps, SEED, dtype, backend.name))


def _relative(run: LibraryRun, ref: list[dict[str, np.ndarray]],
              w0: dict[str, np.ndarray]) -> float:
    """The largest error relative to the reference's displacement, over steps and names."""
    return max(float(np.linalg.norm(np.asarray(got[n], np.float64) - want[n])
                     / max(float(np.linalg.norm(want[n] - w0[n])), 1e-300))
               for got, want in zip(run.params, ref, strict=True) for n in want)


#: The suite's test ids of these checks (the tests are backend-parametrized only).
CHECKS: dict[str, Callable[[Backend], None]] = {
    "test_side_effect_grads_unchanged": check_grads_unchanged,
    "test_side_effect_unknown_argument_refused": check_unknown_argument_refused,
    "test_side_effect_global_rng_unchanged": check_global_rng_unchanged,
    "test_side_effect_float64_stays_float64": check_float64_stays_float64,
    "test_library_defaults_float64": lambda b: check_defaults(b, np.float64),
    "test_library_defaults_float32": lambda b: check_defaults(b, np.float32),
}


def demonstrate(backend: Backend, deviation: Deviation) -> list[str]:
    """Run every check whose test ``deviation`` covers and assert that it still fails;
    what each failure said (empty: the deviation covers none of these tests)."""
    shown = []
    for test_id, check in CHECKS.items():
        if not deviation.covers(test_id):
            continue
        try:
            check(backend)
        except Exception as err:  # noqa: BLE001  (a library's crash shows it too)
            text = str(err).strip()
            first = text.splitlines()[0] if text else ""
            shown.append(f"{test_id}: {type(err).__name__}: {first}")
            continue
        raise AssertionError(
            f"documented deviation {deviation.name!r} of {backend.name!r} no longer fails "
            f"{test_id}: the library changed; update docs/third-party.md and DEVIATIONS")
    return shown
