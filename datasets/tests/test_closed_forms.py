"""Known optima, floors and starts of the convex and real-data problems."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import minimize

from shampoo_datasets import load_problem

from .helpers import adam


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


def test_digits_softmax_gradient_descent_reaches_target_in_40_steps() -> None:
    """The documented calibration of DIGITS_TARGET_LOSS: gradient descent, step 8, 40 steps."""
    problem = load_problem("digits_softmax")
    x = problem.copy_init_params()
    losses = [problem.loss(x)]
    for _ in range(40):
        g = problem.grad(x)
        x = {k: x[k] - 8.0 * g[k] for k in x}
        losses.append(problem.loss(x))
    assert problem.target_loss is not None and losses[-1] <= problem.target_loss
    assert problem.metrics is not None and problem.metrics(x)["accuracy"] > 0.95


def test_digits_softmax_small_steps_decrease_the_loss() -> None:
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
    assert problem.metrics is not None
    assert problem.metrics(problem.optimum)["relative_error"] == 0.0
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


def test_diabetes_optimum_solves_the_normal_equations() -> None:
    """lstsq's solution has zero gradient: [X 1]^T r = 0 up to u * ||[X 1]|| ||y|| / n.

    ||[X 1]||_2 is about 21 (the ones column), ||y|| about 3.6e3, n = 442:
    the gradient is at round-off level, about 1e-16 * 21 * 3.6e3 / 442 = 2e-14;
    1e-11 leaves room for lstsq's own backward error (kappa([X 1]) is about 230).
    """
    problem = load_problem("diabetes_least_squares")
    features, target = problem.data["features"], problem.data["target"]
    assert features.shape == (442, 10) and target.shape == (442,)
    np.testing.assert_allclose(np.sum(features**2, axis=0), 1.0, rtol=1e-12)
    np.testing.assert_allclose(features.mean(axis=0), 0.0, atol=1e-15)
    assert problem.optimum is not None and problem.loss_floor is not None
    g = problem.grad(problem.optimum)
    assert np.max(np.abs(g["w"])) < 1e-11 and abs(float(g["b"][0])) < 1e-11
    # The intercept of centered features is the mean of y; the floor is the residual MSE / 2.
    assert float(problem.optimum["b"][0]) == pytest.approx(float(target.mean()), rel=1e-12)
    design = np.hstack([features, np.ones((442, 1))])
    normal = np.linalg.solve(design.T @ design, design.T @ target)  # independent route
    np.testing.assert_allclose(problem.optimum["w"], normal[:10], rtol=1e-9)
    assert problem.loss_floor == pytest.approx(1429.85, abs=0.01)
    assert problem.target_loss == pytest.approx(problem.loss_floor * 1.001, rel=1e-15)
    # Any other point is worse by exactly (1/2n) ||[X 1] (theta - theta*)||^2.
    rng = np.random.default_rng(0)
    delta = rng.standard_normal(11)
    point = {"w": problem.optimum["w"] + delta[:10], "b": problem.optimum["b"] + delta[10:]}
    excess = float(np.sum((design @ delta) ** 2)) / (2 * 442)
    assert problem.loss(point) - problem.loss_floor == pytest.approx(excess, rel=1e-8)
    hessian_eigenvalues = np.linalg.eigvalsh(design.T @ design / 442)
    assert 3e4 < hessian_eigenvalues.max() / hessian_eigenvalues.min() < 1e5
    assert problem.metrics is not None
    assert 0.5 < problem.metrics(problem.optimum)["r2"] < 0.52  # the well-known OLS R^2


def test_breast_cancer_optimum_is_stationary_and_matches_scipy() -> None:
    """Newton's minimizer has gradient ~1e-16 and agrees with an independent BFGS solve."""
    problem = load_problem("breast_cancer_logistic")
    assert problem.optimum is not None and problem.loss_floor is not None
    g = problem.grad(problem.optimum)
    assert float(np.linalg.norm(np.r_[g["w"], g["b"]])) < 1e-13
    features = problem.data["features"]
    assert features.shape == (569, 30)
    np.testing.assert_allclose(features.mean(axis=0), 0.0, atol=1e-14)
    np.testing.assert_allclose(features.std(axis=0), 1.0, rtol=1e-12)

    def fun(theta: np.ndarray) -> tuple[float, np.ndarray]:
        params = {"w": theta[:30], "b": theta[30:]}
        grad = problem.grad(params)
        return problem.loss(params), np.r_[grad["w"], grad["b"]]

    result = minimize(fun, np.zeros(31), jac=True, method="BFGS", options={"gtol": 1e-10})
    assert result.fun == pytest.approx(problem.loss_floor, rel=1e-12)
    assert result.fun >= problem.loss_floor - 1e-15  # nothing beats the Newton minimum
    np.testing.assert_allclose(result.x[:30], problem.optimum["w"], rtol=1e-5, atol=1e-6)
    assert problem.target_loss == pytest.approx(problem.loss_floor * 1.001, rel=1e-15)
    assert problem.metrics is not None
    assert problem.metrics(problem.optimum)["accuracy"] > 0.98


def test_breast_cancer_ridge_strength_moves_the_optimum() -> None:
    """Stationarity ``X^T r + l2 w = 0`` at each l2; larger l2: shorter w*, higher floor."""
    weak = load_problem("breast_cancer_logistic", l2=1e-4)
    strong = load_problem("breast_cancer_logistic", l2=1e-2)
    assert weak.optimum is not None and strong.optimum is not None
    assert weak.loss_floor is not None and strong.loss_floor is not None
    for problem in (weak, strong):
        assert problem.optimum is not None
        g = problem.grad(problem.optimum)
        assert float(np.linalg.norm(np.r_[g["w"], g["b"]])) < 1e-13
    assert np.linalg.norm(strong.optimum["w"]) < np.linalg.norm(weak.optimum["w"])
    assert weak.loss_floor < strong.loss_floor


@pytest.mark.parametrize(
    ("name", "learning_rate", "steps"),
    [
        ("digits_mlp", 0.1, 80),  # documented: 64 steps
        ("breast_cancer_logistic", 0.3, 160),  # measured: 138 steps
        ("diabetes_least_squares", 100.0, 170),  # measured: 149 steps
    ],
)
def test_default_target_reached_by_adam_as_documented(
    name: str, learning_rate: float, steps: int
) -> None:
    """The default-size targets need real work but are reached by tuned Adam."""
    problem = load_problem(name)
    losses = adam(problem, learning_rate, steps)
    assert problem.target_loss is not None
    assert min(losses) <= problem.target_loss
    assert losses[9] > problem.target_loss  # not reached in the first 10 steps


def test_digits_mlp_start_and_shapes() -> None:
    problem = load_problem("digits_mlp", hidden=16)
    shapes = {k: v.shape for k, v in problem.init_params.items()}
    assert shapes == {"W1": (64, 16), "b1": (16,), "W2": (16, 10), "b2": (10,)}
    features = problem.data["features"]
    assert features.shape == (1797, 64)
    np.testing.assert_allclose(features.mean(axis=0), 0.0, atol=1e-14)
    std = features.std(axis=0)
    assert np.all((np.abs(std - 1.0) < 1e-12) | (std == 0.0))
    # Zero second layer: uniform predictions, loss log 10 exactly, whatever W1.
    zero_out = {**problem.copy_init_params(), "W2": np.zeros((16, 10)), "b2": np.zeros(10)}
    assert problem.loss(zero_out) == pytest.approx(np.log(10.0), rel=1e-14)
