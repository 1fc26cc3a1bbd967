"""shampoo_reference: the exact float64 NumPy Shampoo, the oracle.

``run(config, params, grads)`` returns the parameters after each step;
:class:`ReferenceShampoo` steps one gradient at a time. Equation numbers in
docstrings refer to docs/spec.md.
"""

from shampoo_spec import NonFiniteGradientError, RootFailureError

from .linalg import factor_contraction, mode_product
from .optimizer import ReferenceShampoo, run
from .roots import (
    EighResult,
    coupled_newton_iteration,
    eigenbasis_with_error,
    eigh_error,
    eigh_fails,
    root_inverse_coupled_newton,
    root_inverse_eigh,
    root_inverse_eigh_with_error,
)
from .rounding import round_to
from .state import Metrics

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
