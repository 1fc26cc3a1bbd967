"""The pytorch-optimizer backends (ScalableShampoo, plain Shampoo): translation and one run.

Skipped where pytorch-optimizer is not installed (the normal test session);
``nox -s "thirdparty(library='pytorch-optimizer')"``-style venvs with
``pip install pytorch-optimizer==4.1.0`` run them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("pytorch_optimizer")

import shampoo_spec as ss  # noqa: E402
from shampoo_conformance.backends import get_backend  # noqa: E402
from shampoo_conformance.suite.cases import CASE_SHAPES, make_problem  # noqa: E402
from shampoo_conformance.suite.divergence import assert_matches_reference  # noqa: E402
from shampoo_conformance.thirdparty import pytorch_optimizer as po  # noqa: E402
from shampoo_conformance.thirdparty import pytorch_optimizer_shampoo as pos  # noqa: E402


def test_scalable_kwargs_round_trip_its_own_arguments() -> None:
    """Its kwargs -> config (Google's importer plus its own rules) -> the same kwargs."""
    kwargs = {"lr": 0.1, "betas": (0.9, 0.99), "moving_average_for_momentum": True,
              "weight_decay": 0.01, "decoupled_weight_decay": True,
              "decoupled_learning_rate": False, "inverse_exponent_override": 2,
              "start_preconditioning_step": 3, "preconditioning_compute_steps": 2,
              "statistics_compute_steps": 1, "block_size": 4, "skip_preconditioning_rank_lt": 2,
              "no_preconditioning_for_layers_with_dim_gt": 100, "shape_interpretation": False,
              "graft_type": 3, "pre_conditioner_type": 0, "nesterov": False,
              "diagonal_eps": 1e-8, "matrix_eps": 1e-3}
    config = po.from_kwargs(kwargs)
    assert config.root_inverse == po.NEWTON
    assert config.schedule.period_anchor == "end"
    assert config.schedule.start_preconditioning_step == 3
    assert config.momentum.buffers == "separate"
    assert config.momentum.learning_rate_placement == "before_momentum"
    assert config.grafting.type == "rmsprop" and config.grafting.norm_epsilon == 1e-16
    assert po.scalable_kwargs(config) == {**kwargs, "use_svd": False}


def test_scalable_refuses_what_it_cannot_say_naming_the_field() -> None:
    config = po.base_config()
    assert po.expressible(config) is None
    cases = {
        "root_inverse = eigh": dataclasses.replace(config, root_inverse=ss.EighConfig()),
        "gradient_filter.beta1": dataclasses.replace(
            config, gradient_filter=ss.GradientFilterConfig(beta1=0.9)),
        "period_anchor": dataclasses.replace(
            config, schedule=dataclasses.replace(config.schedule, period_anchor="start")),
        "grafting.type = 'adam'": dataclasses.replace(
            config, grafting=ss.GraftingConfig(type="adam", beta2=0.99, norm_scope="parameter")),
        "skip_rank_lt": dataclasses.replace(
            config, blocking=dataclasses.replace(config.blocking, skip_rank_lt=1)),
        "epsilon = absolute": dataclasses.replace(config, epsilon=ss.EpsilonConfig(value=1e-3)),
    }
    for field, bad in cases.items():
        reason = po.expressible(bad)
        assert reason is not None and field in reason, (field, reason)
        with pytest.raises(ss.Inexpressible, match=field.replace("(", r"\(")):
            po.run(bad, {"w": np.ones((2, 3))}, [{"w": np.ones((2, 3))}])
    # Google's own distributed_shampoo defaults are not ScalableShampoo's rules.
    google = ss.from_google({"learning_rate": 0.1, "block_size": 4})
    reason = po.expressible(google)
    assert reason is not None and "tolerance=0.001" in reason


def test_shampoo_kwargs_and_refusals() -> None:
    config = pos.from_kwargs({"lr": 0.1, "weight_decay": 0.01, "weight_decouple": True,
                              "preconditioning_compute_steps": 2, "matrix_eps": 1e-3})
    assert config.weight_decay == ss.WeightDecayConfig(value=0.01, type="update")
    assert config.epsilon.placement == "floor" and config.statistics.beta2 == 1.0
    assert pos.shampoo_kwargs(config) == {
        "lr": 0.1, "momentum": 0.0, "weight_decay": 0.01, "weight_decouple": True,
        "fixed_decay": False, "preconditioning_compute_steps": 2, "matrix_eps": 1e-3}
    with pytest.raises(ss.Inexpressible, match="momentum"):
        pos.from_kwargs({"momentum": 0.9})
    with_momentum = dataclasses.replace(config, momentum=ss.MomentumConfig(momentum=0.9))
    assert "momentum.momentum" in (pos.expressible(with_momentum) or "")
    blocked = dataclasses.replace(config, blocking=ss.BlockingConfig())
    assert "blocking" in (pos.expressible(blocked) or "")


@pytest.mark.parametrize("name", ["pytorch-optimizer", "pytorch-optimizer-shampoo"])
def test_a_library_case_matches_the_reference(name: str) -> None:
    backend = get_backend(name)
    config = next(iter(backend.cases.values()))  # type: ignore[attr-defined]
    params, grads = make_problem(CASE_SHAPES, 6, 0)
    assert_matches_reference(backend, config, params, grads, np.float64, seed=0)


def test_runs_are_reproducible_and_leave_the_callers_generator_alone() -> None:
    import torch

    config = po.CASES["no_graft"]
    params, grads = make_problem({"w": (6, 8)}, 4, 1)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    first = po.run(config, params, grads)
    assert torch.equal(torch.rand(1), before)
    second = po.run(config, params, grads)
    np.testing.assert_array_equal(first[-1]["w"], second[-1]["w"])


@pytest.mark.parametrize("name", ["pytorch-optimizer", "pytorch-optimizer-shampoo"])
def test_library_cases_float32(name: str) -> None:
    """Its own cases with float32 parameters (statistics and roots in float32 too)
    within the reference's float32 tolerance: the suite runs them in float64 only."""
    backend = get_backend(name)
    params, grads = make_problem(CASE_SHAPES, 10, 0)
    for config in backend.cases.values():  # type: ignore[attr-defined]
        assert_matches_reference(backend, config, params, grads, np.float32, seed=0)
