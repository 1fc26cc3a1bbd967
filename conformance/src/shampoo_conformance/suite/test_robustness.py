"""Bad input is rejected; non-finite gradients never poison the state."""

from __future__ import annotations

import numpy as np
import pytest

import shampoo_spec as ss
from shampoo_conformance.protocol import Backend

F64 = np.float64


def test_mismatched_gradient_shape_raises_value_error(backend: Backend) -> None:
    with pytest.raises(ValueError):
        backend.run(ss.ShampooConfig(), {"w": np.ones((2, 3))}, [{"w": np.ones((3, 2))}], dtype=F64)


def test_missing_gradient_name_raises_value_error(backend: Backend) -> None:
    with pytest.raises(ValueError):
        backend.run(ss.ShampooConfig(), {"w": np.ones(3)}, [{"v": np.ones(3)}], dtype=F64)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_gradient_is_skipped_and_state_stays_finite(backend: Backend, bad: float) -> None:
    """With ``skip_block``, the bad block keeps its value that step; later steps stay finite."""
    config = ss.ShampooConfig(
        learning_rate=0.1,
        epsilon=ss.EpsilonConfig(value=1e-3),
        grafting=ss.GraftingConfig(type="adagrad"),
        momentum=ss.MomentumConfig(momentum=0.9),
        blocking=ss.BlockingConfig(max_preconditioner_dim=2, merge_dims_up_to=None),
        failure=ss.FailureConfig(nonfinite_gradient="skip_block"),
    )
    rng = np.random.default_rng(0)
    grads = [{"w": rng.standard_normal((4, 2)), "b": rng.standard_normal(3)} for _ in range(6)]
    grads[2]["w"][0, 0] = bad
    params = {"w": rng.standard_normal((4, 2)), "b": rng.standard_normal(3)}
    out = backend.run(config, params, grads, dtype=F64)
    for t, step in enumerate(out, start=1):
        for name, value in step.items():
            assert np.all(np.isfinite(value)), f"{name} non-finite after step {t}"
    # The poisoned block (rows 0-1) did not move at step 3; the other block did.
    np.testing.assert_array_equal(out[2]["w"][:2], out[1]["w"][:2])
    assert not np.array_equal(out[2]["w"][2:], out[1]["w"][2:])
    assert not np.array_equal(out[2]["b"], out[1]["b"])
