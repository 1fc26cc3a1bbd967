"""Problems of shampoo_datasets: exact gradients, determinism, known optima."""

from __future__ import annotations

import numpy as np
import pytest

from shampoo_datasets import PROBLEMS, Problem, load_problem

SMALL_OPTIONS: dict[str, dict[str, object]] = {
    "digits_softmax": {},
    "ill_conditioned_least_squares": {"rows": 5, "cols": 3, "condition_number": 100.0},
}


def _random_point(problem: Problem, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {k: v + 0.1 * rng.standard_normal(v.shape) for k, v in problem.init_params.items()}


@pytest.fixture(scope="module", params=PROBLEMS)
def problem(request: pytest.FixtureRequest) -> Problem:
    return load_problem(request.param, seed=3, **SMALL_OPTIONS[request.param])


def test_registry_lists_every_problem() -> None:
    assert PROBLEMS == ("digits_softmax", "ill_conditioned_least_squares")
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
    start = problem.loss(problem.init_params)
    assert isinstance(start, float) and np.isfinite(start)
    assert problem.target_loss is not None and 0.0 <= problem.target_loss < start


def test_gradient_matches_central_differences(problem: Problem) -> None:
    """Directional derivative <grad f(x), d> vs (f(x + h d) - f(x - h d)) / 2h, h = 1e-5.

    The central difference has error O(h^2 |f'''|) + O(u |f| / h), about 1e-9
    relative here, so 1e-6 leaves a wide margin and still catches any wrong term.
    """
    rng = np.random.default_rng(0)
    x = _random_point(problem, rng)
    grad = problem.grad(x)
    assert set(grad) == set(x)
    for key in x:
        assert grad[key].shape == x[key].shape and grad[key].dtype == np.float64
    h = 1e-5
    for _ in range(3):
        d = {k: rng.standard_normal(v.shape) for k, v in x.items()}
        plus = problem.loss({k: x[k] + h * d[k] for k in x})
        minus = problem.loss({k: x[k] - h * d[k] for k in x})
        numeric = (plus - minus) / (2 * h)
        analytic = sum(float(np.sum(grad[k] * d[k])) for k in x)
        assert analytic == pytest.approx(numeric, rel=1e-6, abs=1e-10)


def test_loss_and_grad_do_not_modify_params(problem: Problem) -> None:
    x = _random_point(problem, np.random.default_rng(1))
    before = {k: v.copy() for k, v in x.items()}
    problem.loss(x)
    problem.grad(x)
    for key in x:
        np.testing.assert_array_equal(x[key], before[key])


@pytest.mark.parametrize("name", PROBLEMS)
def test_same_seed_same_problem_other_seed_other_problem(name: str) -> None:
    options = SMALL_OPTIONS[name]
    first, again, other = (load_problem(name, seed=s, **options) for s in (7, 7, 8))
    x = _random_point(first, np.random.default_rng(2))
    for key in first.init_params:
        np.testing.assert_array_equal(first.init_params[key], again.init_params[key])
    assert first.loss(x) == again.loss(x)
    differs = any(
        not np.array_equal(first.init_params[k], other.init_params[k]) for k in first.init_params
    ) or first.loss(x) != other.loss(x)
    assert differs


def test_digits_softmax_shapes_and_start() -> None:
    problem = load_problem("digits_softmax")
    assert problem.init_params["W"].shape == (64, 10)
    assert problem.init_params["b"].shape == (10,)
    features = problem.data["features"]
    assert features.shape == (1797, 64)
    assert features.min() == 0.0 and features.max() == 1.0
    # Nearly zero logits: the loss starts close to log(10).
    assert problem.loss(problem.init_params) == pytest.approx(np.log(10.0), abs=0.05)
    zero = {"W": np.zeros((64, 10)), "b": np.zeros(10)}
    assert problem.loss(zero) == pytest.approx(np.log(10.0), rel=1e-14)


def test_digits_softmax_gradient_descent_decreases_loss() -> None:
    problem = load_problem("digits_softmax")
    x = problem.copy_init_params()
    losses = [problem.loss(x)]
    for _ in range(5):
        g = problem.grad(x)
        x = {k: x[k] - 0.5 * g[k] for k in x}
        losses.append(problem.loss(x))
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False))


@pytest.mark.parametrize(("rows", "cols"), [(8, 6), (5, 1), (1, 4)])
@pytest.mark.parametrize("condition_number", [1.0, 1e3, 1e6])
def test_least_squares_hessian_condition_and_optimum(
    rows: int, cols: int, condition_number: float
) -> None:
    """The Hessian (B^T B) kron (A^T A) has eigenvalues in [1/kappa, 1] and f(X*) = 0.

    eigvalsh is backward stable, so the extreme eigenvalues are exact to about
    u * ||H|| = 1e-16; relative 1e-8 on kappa <= 1e6 is loose enough.
    """
    problem = load_problem(
        "ill_conditioned_least_squares",
        seed=1,
        rows=rows,
        cols=cols,
        condition_number=condition_number,
    )
    a, b = problem.data["A"], problem.data["B"]
    hessian = np.kron(b.T @ b, a.T @ a)
    eigenvalues = np.linalg.eigvalsh(hessian)
    assert eigenvalues.max() == pytest.approx(1.0, rel=1e-12)
    assert eigenvalues.max() / eigenvalues.min() == pytest.approx(condition_number, rel=1e-8)
    assert problem.optimum is not None and problem.loss_floor == 0.0
    assert problem.optimum["X"].shape == (rows, cols)
    assert problem.loss(problem.optimum) == pytest.approx(0.0, abs=1e-20)
    np.testing.assert_allclose(problem.grad(problem.optimum)["X"], 0.0, atol=1e-14)
    # The gradient is the Hessian applied to X - X* (column-major vec).
    x = np.random.default_rng(0).standard_normal((rows, cols))
    expected = (hessian @ (x - problem.optimum["X"]).ravel(order="F")).reshape(
        (rows, cols), order="F"
    )
    np.testing.assert_allclose(problem.grad({"X": x})["X"], expected, rtol=1e-10, atol=1e-12)


def test_least_squares_target_is_relative_to_start() -> None:
    problem = load_problem("ill_conditioned_least_squares")
    assert problem.init_params["X"].shape == (8, 6)
    np.testing.assert_array_equal(problem.init_params["X"], 0.0)
    start = problem.loss(problem.init_params)
    assert problem.target_loss == pytest.approx(1e-6 * start)
