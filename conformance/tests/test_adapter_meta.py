"""The ``meta`` backend's own contract: what it expresses, how it runs Meta's library.

Runs where Meta's library is installed (``nox -s "thirdparty(library='meta')"``);
skipped elsewhere.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("distributed_shampoo", reason="needs Meta's torch-shampoo")

import torch  # noqa: E402
from distributed_shampoo import shampoo_types  # noqa: E402

import shampoo_spec as ss  # noqa: E402
from shampoo_conformance.backends import get_backend  # noqa: E402
from shampoo_conformance.suite.cases import CASE_SHAPES, make_problem  # noqa: E402
from shampoo_conformance.thirdparty import meta  # noqa: E402


def test_json_kwargs_become_metas_objects() -> None:
    kwargs = meta.meta_kwargs({
        "betas": [0.9, 1.0], "weight_decay_type": "WeightDecayType.DECOUPLED",
        "preconditioner_config": {"type": "RootInvShampooPreconditionerConfig",
                                  "factor_matrix_dtype": "torch.float64",
                                  "inverse_exponent_override": {"2": {"0": 0.25}}},
    })
    assert kwargs["betas"] == (0.9, 1.0)
    assert kwargs["weight_decay_type"] is shampoo_types.WeightDecayType.DECOUPLED
    pc = kwargs["preconditioner_config"]
    assert isinstance(pc, shampoo_types.RootInvShampooPreconditionerConfig)
    assert pc.factor_matrix_dtype is torch.float64
    assert pc.inverse_exponent_override == {2: {0: 0.25}}


def test_inexpressible_configs_name_the_field_and_are_refused_by_run() -> None:
    config = dataclasses.replace(meta.base_config(),
                                 epsilon=ss.EpsilonConfig(value=1e-3, scale="relative"))
    reason = meta.expressible(config)
    assert reason is not None and "epsilon.scale" in reason
    with pytest.raises(ss.Inexpressible, match="epsilon.scale"):
        meta.run(config, {"w": np.ones(3)}, [{"w": np.ones(3)}])
    ddp = dataclasses.replace(meta.base_config(), update_dtype="bfloat16")
    assert "process group" in (meta.expressible(ddp) or "")
    assert meta.expressible(meta.base_config()) is None


def test_base_config_run_equals_the_reference_to_rounding() -> None:
    """Meta's defaults nearest ShampooConfig(), float64 roots: exact up to rounding."""
    config = dataclasses.replace(meta.base_config(), inverse_root_dtype=None,
                                 epsilon=ss.EpsilonConfig(value=1e-3))
    params, grads = make_problem(CASE_SHAPES, 5, 0)
    ours = meta.run(config, params, grads, np.float64)
    ref = get_backend("reference").run(config, params, grads)
    for a, b in zip(ours, ref, strict=True):
        for name in b:
            np.testing.assert_allclose(a[name], b[name], rtol=0, atol=1e-11, err_msg=name)


def test_stepper_steps_as_run_does() -> None:
    config = meta.base_config()
    params, grads = make_problem({"w": (4, 3), "b": (3,)}, 3, 1)
    want = meta.run(config, params, grads, np.float32)
    stepper = meta.stepper("shampoo", params, lr=config.learning_rate, config=config,
                           dtype=np.float32)
    for step, expected in zip(grads, want, strict=True):
        got = stepper.step(step)
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name])
    assert stepper.state_bytes() > 0
