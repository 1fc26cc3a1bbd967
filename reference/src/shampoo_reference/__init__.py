"""shampoo_reference: the exact float64 NumPy/SciPy Shampoo, the oracle.

``run(config, params, grads)`` returns the parameters after each step;
:class:`ReferenceShampoo` steps one gradient at a time. Equation numbers in
docstrings refer to docs/spec.md.
"""

from .linalg import (
    coupled_newton_iteration,
    factor_contraction,
    mode_product,
    root_inverse_coupled_newton,
    root_inverse_eigh,
    round_to,
)
from .optimizer import (
    Metrics,
    NonFiniteGradientError,
    ReferenceShampoo,
    RootFailureError,
    run,
)

__all__ = [
    "Metrics",
    "NonFiniteGradientError",
    "ReferenceShampoo",
    "RootFailureError",
    "coupled_newton_iteration",
    "factor_contraction",
    "mode_product",
    "root_inverse_coupled_newton",
    "root_inverse_eigh",
    "round_to",
    "run",
]
