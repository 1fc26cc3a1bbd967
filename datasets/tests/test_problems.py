"""Every problem of shampoo_datasets: the record, exact gradients, determinism, targets."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import minimize

from shampoo_datasets import PROBLEMS, Problem, load_problem

from .helpers import SMALL_OPTIONS, flatten, random_point, unflatten


@pytest.fixture(scope="module", params=PROBLEMS)
def problem(request: pytest.FixtureRequest) -> Problem:
    return load_problem(request.param, seed=3, **SMALL_OPTIONS[request.param])


def test_registry_lists_every_problem() -> None:
    assert PROBLEMS == (
        "digits_softmax",
        "ill_conditioned_least_squares",
        "diabetes_least_squares",
        "breast_cancer_logistic",
        "digits_mlp",
        "markov_transformer",
    )
    assert set(SMALL_OPTIONS) == set(PROBLEMS)


def test_problem_record(problem: Problem) -> None:
    assert problem.name in PROBLEMS
    assert problem.description
    for value in problem.init_params.values():
        assert value.dtype == np.float64
        assert not value.flags.writeable
    copies = problem.copy_init_params()
    for key, value in copies.items():
        assert value.flags.writeable
        np.testing.assert_array_equal(value, problem.init_params[key])
    for value in problem.data.values():
        assert value.dtype == np.float64 and not value.flags.writeable
    start = problem.loss(problem.init_params)
    assert isinstance(start, float) and np.isfinite(start)
    assert problem.target_loss is not None and 0.0 <= problem.target_loss < start
    if problem.loss_floor is not None:
        assert problem.loss_floor < problem.target_loss or problem.name == "markov_transformer"
        assert problem.loss_floor < start
    assert problem.metrics is not None
    metrics = problem.metrics(problem.init_params)
    assert metrics and all(isinstance(v, float) and np.isfinite(v) for v in metrics.values())


def test_gradient_matches_central_differences_per_tensor(problem: Problem) -> None:
    """For each tensor k: <grad_k f(x), d> vs (f(x + h d) - f(x - h d)) / 2h, h = 1e-5.

    ``d`` (unit norm, only in tensor k) is the normalized analytic gradient
    plus half a random unit direction, so the derivative is about |grad_k|
    and never vanishes by accident. The error of the central difference is
    h^2 |f'''| / 6 + u |f| / h, below 1e-8 relative for these problems
    (|f| <= 2e4, unit directions), so 1e-6 leaves a margin and still catches
    a wrong term, factor or transpose.
    """
    rng = np.random.default_rng(0)
    x = random_point(problem, rng)
    grad = problem.grad(x)
    assert set(grad) == set(x)
    h = 1e-5
    for key in x:
        assert grad[key].shape == x[key].shape and grad[key].dtype == np.float64
        norm = float(np.linalg.norm(grad[key]))
        assert norm > 0.0, key
        noise = rng.standard_normal(x[key].shape)
        d = grad[key] / norm + 0.5 * noise / np.linalg.norm(noise)  # never 0
        d /= np.linalg.norm(d)
        plus = problem.loss({**x, key: x[key] + h * d})
        minus = problem.loss({**x, key: x[key] - h * d})
        numeric = (plus - minus) / (2 * h)
        analytic = float(np.sum(grad[key] * d))
        assert analytic == pytest.approx(numeric, rel=1e-6), key


def test_loss_and_grad_do_not_modify_params(problem: Problem) -> None:
    x = random_point(problem, np.random.default_rng(1))
    before = {k: v.copy() for k, v in x.items()}
    problem.loss(x)
    problem.grad(x)
    if problem.metrics is not None:
        problem.metrics(x)
    for key in x:
        np.testing.assert_array_equal(x[key], before[key])


@pytest.mark.parametrize("name", PROBLEMS)
def test_same_seed_same_problem_other_seed_other_problem(name: str) -> None:
    options = SMALL_OPTIONS[name]
    first, again, other = (load_problem(name, seed=s, **options) for s in (7, 7, 8))
    x = random_point(first, np.random.default_rng(2))
    for key in first.init_params:
        np.testing.assert_array_equal(first.init_params[key], again.init_params[key])
    for key in first.data:
        np.testing.assert_array_equal(first.data[key], again.data[key])
    assert first.loss(x) == again.loss(x)
    assert first.target_loss == again.target_loss and first.loss_floor == again.loss_floor
    # Seeded parts differ: the start, or (ill_conditioned_least_squares, start 0) the data.
    assert any(
        not np.array_equal(first.init_params[k], other.init_params[k]) for k in first.init_params
    ) or any(not np.array_equal(first.data[k], other.data[k]) for k in first.data)


def test_target_is_reached_by_lbfgs(problem: Problem) -> None:
    """scipy's L-BFGS from the start reaches ``target_loss`` (so the target is attainable)."""
    keys = sorted(problem.init_params)
    like = problem.init_params

    def fun(vector: np.ndarray) -> tuple[float, np.ndarray]:
        params = unflatten(vector, like, keys)
        return problem.loss(params), flatten(problem.grad(params), keys)

    result = minimize(
        fun,
        flatten(like, keys),
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": 400, "ftol": 0.0, "gtol": 1e-12},
    )
    final = problem.loss(unflatten(result.x, like, keys))
    assert problem.target_loss is not None
    assert final <= problem.target_loss
    if problem.loss_floor is not None and problem.name != "markov_transformer":
        assert final >= problem.loss_floor - 1e-9 * abs(problem.loss_floor)
