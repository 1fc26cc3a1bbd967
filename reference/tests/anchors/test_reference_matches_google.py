"""The reference, fed ``from_google(kwargs)``, reproduces Google's trajectories.

``google_emulator`` is an independent float64 re-implementation of Google's
non-sharded ``distributed_shampoo`` written from its source (and checked
against precondition-opt 0.3.0 itself to 2e-11, see compare_google_library.py),
including the power iteration Google uses for the relative epsilon. We
require 1e-6 relative (the foundation issue's bar). Two documented
differences are switched off in the emulator: float32 rounding of the
initial eps*I (``f32_stat_init``) and 0.3.0's lr^2 decoupled decay
(``version="head"``).
"""

from __future__ import annotations

import numpy as np
import pytest
from google_emulator import emulate_google

from shampoo_conformance.thirdparty.anchor_cases import GOOGLE_CASES
from shampoo_reference import run
from shampoo_spec import from_google

SHAPES = {"m": (7, 10), "v": (7,), "t": (3, 4, 5), "u": (12,), "s": ()}

# Google's argument sets (shared with the anchors test and the google backend), with
# this test's values where they differ: the anchors' model needs lr 0.001 without a
# graft and skips its 16-wide dims; this problem's dims are at most 12.
CASES: dict[str, dict[str, object]] = {
    **GOOGLE_CASES,
    "no_graft": {"graft_type": "NONE", "start_preconditioning_step": 0},
    "absolute_epsilon": {"graft_type": "ADAGRAD", "relative_matrix_epsilon": False},
    "skip_large_dims": {"graft_type": "ADAGRAD", "skip_preconditioning_dim_size_gt": 6},
    # Eq. (13): Google judges eigh roots by inverse_failure_threshold too; at 1e-30 every
    # root fails (the errors are about 1e-16 ||B||) and the identity stays.
    "eigh_failure_threshold": {
        "graft_type": "ADAGRAD", "eigh": True, "inverse_failure_threshold": 1e-30,
    },
}


def _problem(seed: int, steps: int) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
    grads = [{k: rng.standard_normal(s) for k, s in SHAPES.items()} for _ in range(steps)]
    return params, grads


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_reproduces_google(name: str) -> None:
    kwargs = {"learning_rate": 0.1, "block_size": 128, **CASES[name]}
    params, grads = _problem(seed=len(name), steps=12)
    ours = run(from_google(kwargs), params, grads)
    theirs = emulate_google(kwargs, params, grads, version="head", f32_stat_init=False)
    for t, (a, b) in enumerate(zip(ours, theirs, strict=True), start=1):
        for k in SHAPES:
            err = np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-30)
            assert err <= 1e-6, f"{name}: param {k!r} step {t}: relative error {err:.2e}"
