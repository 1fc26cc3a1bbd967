"""shampoo_reference: the exact float64 NumPy/SciPy Shampoo, the oracle.

``run(config, params, grads)`` returns the parameters after each step;
:class:`ReferenceShampoo` steps one gradient at a time. Equation numbers in
docstrings refer to docs/spec.md.
"""

from .linalg import (
    EighResult,
    coupled_newton_iteration,
    eigenbasis_with_error,
    eigh_error,
    eigh_fails,
    factor_contraction,
    mode_product,
    root_inverse_coupled_newton,
    root_inverse_eigh,
    root_inverse_eigh_with_error,
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
    "EighResult",
    "Metrics",
    "NonFiniteGradientError",
    "ReferenceShampoo",
    "RootFailureError",
    "coupled_newton_iteration",
    "eigenbasis_with_error",
    "eigh_error",
    "eigh_fails",
    "factor_contraction",
    "mode_product",
    "root_inverse_coupled_newton",
    "root_inverse_eigh",
    "round_to",
    "root_inverse_eigh_with_error",
    "run",
]
