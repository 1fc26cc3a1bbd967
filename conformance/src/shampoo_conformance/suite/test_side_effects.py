"""A user's run of the backend's library leaves the caller's things alone.

Each property runs ``library_run`` (thirdparty/registry.py) on a few small
problems (suite/user_runs.py): the gradients the caller passed are bitwise
unchanged after each step; an unknown constructor argument is refused
(TypeError or ValueError), never swallowed; torch's, NumPy's and Python's
global generators are as they were; float64 parameters stay float64 through
the update W_t = W_{t-1} - lr U_t of docs/spec.md eq. (2) (a crash fails). A
backend without the hooks skips, saying so; a library's documented deviation
(its DEVIATIONS) makes a property an expected failure.
"""

from __future__ import annotations

from shampoo_conformance.protocol import Backend
from shampoo_conformance.suite import user_runs


def test_side_effect_grads_unchanged(backend: Backend) -> None:
    user_runs.check_grads_unchanged(backend)


def test_side_effect_unknown_argument_refused(backend: Backend) -> None:
    user_runs.check_unknown_argument_refused(backend)


def test_side_effect_global_rng_unchanged(backend: Backend) -> None:
    user_runs.check_global_rng_unchanged(backend)


def test_side_effect_float64_stays_float64(backend: Backend) -> None:
    user_runs.check_float64_stays_float64(backend)
