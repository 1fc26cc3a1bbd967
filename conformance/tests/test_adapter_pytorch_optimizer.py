"""The pytorch-optimizer backends (ScalableShampoo, plain Shampoo): translation and one run.

Skipped where pytorch-optimizer is not installed (the normal test session);
``nox -s "thirdparty(library='pytorch-optimizer')"``-style venvs with
``pip install pytorch-optimizer==4.1.0`` run them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

pytest.importorskip("pytorch_optimizer")

import torch  # noqa: E402
from pytorch_optimizer import ScalableShampoo  # noqa: E402

import shampoo_spec as ss  # noqa: E402
from shampoo_conformance.backends import get_backend  # noqa: E402
from shampoo_conformance.suite.cases import CASE_SHAPES, make_problem  # noqa: E402
from shampoo_conformance.suite.divergence import (  # noqa: E402
    assert_matches_reference,
    first_divergence,
)
from shampoo_conformance.suite.tolerances import bound_and_reference  # noqa: E402
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


# ------------------------------------------------------------ a user's run (library_run)
#: The shapes of the suite's defaults properties.
USER_SHAPES = {"a": (7, 10), "b": (5,), "c": (3, 4, 5), "d": (1, 6)}
#: The three pytorch-optimizer adapters, by backend.
ADAPTERS = {"pytorch-optimizer": po, "pytorch-optimizer-shampoo": pos,
            "pytorch-optimizer-soap": pytest.importorskip(
                "shampoo_conformance.thirdparty.pytorch_optimizer_soap")}


def _size(ours: list[dict[str, np.ndarray]], ref: list[dict[str, np.ndarray]],
          w0: dict[str, np.ndarray]) -> float:
    """max over parameters of max_t |ours_t - ref_t| / max_t |ref_t - w0| (the docs' size)."""
    worst = 0.0
    for k in w0:
        moved = max(float(np.linalg.norm(b[k] - w0[k])) for b in ref)
        err = max(float(np.linalg.norm(a[k] - b[k])) for a, b in zip(ours, ref, strict=True))
        worst = max(worst, err / moved)
    return worst


def _against(kwargs: dict[str, Any], config: ss.ShampooConfig,
             shapes: dict[str, tuple[int, ...]], steps: int = 10) -> float | None:
    """ScalableShampoo(**kwargs) against the reference on ``config``: None within the
    tolerance, else the size of the difference."""
    params, grads = make_problem(shapes, steps, 0)
    bound, ref = bound_and_reference(config, params, grads, np.float64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ours = po.library_run(kwargs, params, grads, np.float64).params
    if first_divergence(ours, ref, params, bound) is None:
        return None
    return _size(ours, ref, params)


def _replace(config: ss.ShampooConfig, section: str, **values: Any) -> ss.ShampooConfig:
    return dataclasses.replace(
        config, **{section: dataclasses.replace(getattr(config, section), **values)})


#: ScalableShampoo's arguments read as Google's distributed_shampoo reads them, one rule
#: at a time: (kwargs, shapes, the spec's config with Google's rule for that argument).
GOOGLE_READINGS: dict[str, tuple[dict[str, Any], dict[str, tuple[int, ...]],
                                  Callable[[ss.ShampooConfig], ss.ShampooConfig]]] = {
    "start_step_counted_from_one": (
        {"lr": 0.1, "start_preconditioning_step": 3, "preconditioning_compute_steps": 1,
         "block_size": 1024, "shape_interpretation": False, "matrix_eps": 1e-3},
        {"w": (6, 8)}, lambda c: _replace(c, "schedule", start_preconditioning_step=4)),
    "one_based_root_schedule": (
        {"lr": 0.1, "start_preconditioning_step": 1, "preconditioning_compute_steps": 3,
         "block_size": 1024, "shape_interpretation": False, "matrix_eps": 1e-3},
        {"w": (6, 8)}, lambda c: _replace(c, "schedule", period_anchor="start")),
    "vectors_never_preconditioned": (
        {"lr": 0.1, "start_preconditioning_step": 1, "preconditioning_compute_steps": 1,
         "block_size": 1024, "shape_interpretation": False, "matrix_eps": 1e-3,
         "skip_preconditioning_rank_lt": 1},
        {"v": (6,)}, lambda c: _replace(c, "blocking", skip_rank_lt=1)),
}


@pytest.mark.parametrize("name", sorted(GOOGLE_READINGS))
def test_google_reading_of_its_arguments_differs(name: str) -> None:
    """Each rule where the port reads an argument of Google's name its own way is a
    deviation: the library leaves the tolerance of the reference on Google's reading,
    and is within it on the importer's (which maps the rule)."""
    kwargs, shapes, google = GOOGLE_READINGS[name]
    assert name in {d.name for d in po.DEVIATIONS}
    config = po.from_kwargs(kwargs)
    assert _against(kwargs, config, shapes) is None
    size = _against(kwargs, google(config), shapes)
    assert size is not None
    print(f"{name}: {size:.2g}")


def test_skip_rank_lt_below_two_acts_as_two() -> None:
    """skip_preconditioning_rank_lt=0 or 1 (its default) runs as 2: a vector is never
    preconditioned (DEVIATIONS["skip_rank_lt_below_two_ignored"])."""
    params, grads = make_problem({"v": (6,)}, 5, 0)
    runs = [po.library_run({**GOOGLE_READINGS["vectors_never_preconditioned"][0],
                            "skip_preconditioning_rank_lt": k}, params, grads).params[-1]["v"]
            for k in (0, 1, 2)]
    np.testing.assert_array_equal(runs[0], runs[2])
    np.testing.assert_array_equal(runs[1], runs[2])


def test_svd_path_has_no_epsilon() -> None:
    """use_svd=True on a fixed rank-1 gradient with beta2 0.5: the statistics' null
    directions keep only matrix_eps * 0.5^t, below float64's resolution of the factor
    by step 29, and the SVD root takes no ridge: the parameters become NaN there, where
    the Newton path's relative ridge keeps them finite (DEVIATIONS["svd_without_epsilon"])."""
    a, b = np.arange(1.0, 5.0), np.arange(4.0, 0.0, -1.0)
    grads, params = [{"w": np.outer(a, b)}] * 30, {"w": np.zeros((4, 4))}
    kwargs = {"lr": 0.01, "start_preconditioning_step": 1, "preconditioning_compute_steps": 1,
              "shape_interpretation": False, "graft_type": 0, "betas": (0.0, 0.5)}
    with torch.random.fork_rng(devices=[]):
        newton = po.library_run(kwargs, params, grads).params
        svd = po.library_run({**kwargs, "use_svd": True}, params, grads).params
    assert all(np.all(np.isfinite(step["w"])) for step in newton)
    assert np.all(np.isfinite(svd[20]["w"])) and not np.all(np.isfinite(svd[-1]["w"]))
    assert "svd_without_epsilon" in {d.name for d in po.DEVIATIONS}


def test_defaults_never_precondition_a_small_matrix() -> None:
    """At USER_KWARGS (block_size 512, shape_interpretation on) a (7, 10) parameter
    merges to [1]: no statistics, no root, ever (DEVIATIONS["merge_small_dims"]);
    Google's merge (defaults_config) gives one 70 x 70 factor, whose first root comes
    at step 1000, so within the suite's runs both are the SGD graft with momentum."""
    p = torch.nn.Parameter(torch.zeros(7, 10, dtype=torch.float64))
    opt = ScalableShampoo([p], **po.USER_KWARGS)
    p.grad = torch.ones(7, 10, dtype=torch.float64)
    opt.step()
    assert opt.state[p]["pre_conditioner"].transformed_shape == [1]
    assert len(opt.state[p]["pre_conditioner"].statistics) == 0
    assert _against(po.USER_KWARGS, po.defaults_config(), {"a": (7, 10)}, steps=10) is None


def test_power_iteration_draws_from_the_global_generator() -> None:
    """Each root step draws torch.randn from the caller's generator; USER_KWARGS computes
    no root within the suite's runs (DEVIATIONS["global_rng_draws"])."""
    params, grads = make_problem({"w": (6, 8)}, 3, 0)
    before = torch.get_rng_state()
    po.library_run(po.USER_KWARGS, params, grads)
    assert torch.equal(before, torch.get_rng_state())
    po.library_run(GOOGLE_READINGS["start_step_counted_from_one"][0], params, grads)
    assert not torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_user_run_side_effects(name: str) -> None:
    """What a user's run does besides moving the parameters, asserted so that the
    DEVIATIONS cannot go stale: unknown arguments swallowed, maximize=True negates
    p.grad, float64 kept; at USER_KWARGS the gradients are left alone."""
    adapter = ADAPTERS[name]
    names = {d.name for d in adapter.DEVIATIONS}
    params, grads = make_problem(USER_SHAPES, 3, 0)
    run = adapter.library_run(adapter.USER_KWARGS, params, grads, np.float64)
    assert all(v.dtype == np.float64 for step in run.params for v in step.values())
    for seen, given in zip(run.grads, grads, strict=True):
        for k in USER_SHAPES:
            np.testing.assert_array_equal(seen[k], given[k])
    adapter.library_run({**adapter.USER_KWARGS, "not_an_argument": 1.0}, params, grads)
    assert "unknown_arguments_swallowed" in names
    run = adapter.library_run({**adapter.USER_KWARGS, "maximize": True}, params, grads)
    # (step 2: SOAP's first step returns before it reads the gradient)
    np.testing.assert_array_equal(run.grads[1]["a"], -grads[1]["a"])
    assert "grad_negated_by_maximize" in names


@pytest.mark.parametrize("kwargs", [{"momentum": 0.9}, {"weight_decay": 0.1}])
def test_plain_shampoo_writes_into_the_gradient(kwargs: dict[str, Any]) -> None:
    """Momentum and coupled weight decay are applied to p.grad in place
    (pytorch_optimizer_shampoo.DEVIATIONS["grad_overwritten"])."""
    params, grads = make_problem(USER_SHAPES, 2, 0)
    run = pos.library_run({**pos.USER_KWARGS, **kwargs}, params, grads)
    assert not np.array_equal(run.grads[1]["a"], grads[1]["a"])
    assert "grad_overwritten" in {d.name for d in pos.DEVIATIONS}


def test_soap_merge_dims_crashes() -> None:
    """pytorch-optimizer's SOAP with merge_dims=True reshapes a (7, 10) gradient to [1]
    (DEVIATIONS["merge_dims_crash"])."""
    pos_soap = ADAPTERS["pytorch-optimizer-soap"]
    params, grads = make_problem({"a": (7, 10)}, 1, 0)
    with pytest.raises(RuntimeError, match=r"shape '\[1\]' is invalid for input of size 70"):
        pos_soap.library_run({**pos_soap.USER_KWARGS, "merge_dims": True}, params, grads)
    assert "merge_dims_crash" in {d.name for d in pos_soap.DEVIATIONS}


@pytest.mark.parametrize("name", ["pytorch-optimizer", "pytorch-optimizer-shampoo"])
def test_defaults_config_is_what_it_runs(name: str) -> None:
    """library_run at USER_KWARGS within the reference's tolerance on defaults_config
    (10 steps, both dtypes' parameters in float64)."""
    adapter = ADAPTERS[name]
    params, grads = make_problem(USER_SHAPES, 10, 0)
    bound, ref = bound_and_reference(adapter.defaults_config(), params, grads, np.float64)
    ours = adapter.library_run(adapter.USER_KWARGS, params, grads, np.float64).params
    assert first_divergence(ours, ref, params, bound) is None
