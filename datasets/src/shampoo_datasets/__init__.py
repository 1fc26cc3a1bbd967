"""Small optimization problems for testing and benchmarking Shampoo backends.

Each problem is deterministic, full-batch, float64, with exact NumPy
gradients, and needs nothing from the network (real data comes bundled with
scikit-learn; the rest is generated from a seed)::

    from shampoo_datasets import PROBLEMS, load_problem

    problem = load_problem("ill_conditioned_least_squares", seed=0, condition_number=1e6)
    params = problem.copy_init_params()
    for _ in range(100):  # gradient descent; the Hessian's largest eigenvalue is 1
        grads = problem.grad(params)
        params = {k: params[k] - 1.0 * grads[k] for k in params}
    problem.loss(params)

This package imports no optimizer: the problems are the same for every backend.
"""

from ._problem import Problem
from .least_squares import ill_conditioned_least_squares
from .registry import PROBLEMS, load_problem, problem_options
from .softmax_regression import digits_softmax

__all__ = [
    "PROBLEMS",
    "Problem",
    "digits_softmax",
    "ill_conditioned_least_squares",
    "load_problem",
    "problem_options",
]
