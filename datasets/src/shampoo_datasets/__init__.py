"""Small optimization problems for testing and benchmarking Shampoo backends.

Each problem is deterministic, full-batch, float64, with exact NumPy
gradients, and needs nothing from the network (real data comes bundled with
scikit-learn; the rest is generated from a seed). The registry
(:data:`PROBLEMS`):

* ``digits_softmax``: softmax regression on digits (convex, no finite minimum).
* ``ill_conditioned_least_squares``: seeded Kronecker-structured least squares
  with a chosen Hessian condition number and known optimum.
* ``diabetes_least_squares``: linear regression on diabetes (condition number
  about 5e4), optimum from ``lstsq``.
* ``breast_cancer_logistic``: ridge logistic regression on breast cancer,
  optimum from Newton's method.
* ``digits_mlp``: a 64 -> 32 -> 10 tanh network on digits (non-convex).
* ``markov_transformer``: a small transformer language model on text from a
  seeded Markov source of known entropy rate.

Usage::

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
from .language_model import markov_transformer
from .least_squares import ill_conditioned_least_squares
from .linear_regression import diabetes_least_squares
from .logistic_regression import breast_cancer_logistic
from .mlp_classifier import digits_mlp
from .registry import PROBLEMS, load_problem, problem_options
from .softmax_regression import digits_softmax

__all__ = [
    "PROBLEMS",
    "Problem",
    "breast_cancer_logistic",
    "diabetes_least_squares",
    "digits_mlp",
    "digits_softmax",
    "ill_conditioned_least_squares",
    "load_problem",
    "markov_transformer",
    "problem_options",
]
