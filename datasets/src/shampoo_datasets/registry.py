"""The problem registry: ``load_problem(name, seed=..., **options)``."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from ._problem import Problem
from .language_model import markov_transformer
from .least_squares import ill_conditioned_least_squares
from .linear_regression import diabetes_least_squares
from .logistic_regression import breast_cancer_logistic
from .mlp_classifier import digits_mlp
from .softmax_regression import digits_softmax

_BUILDERS: dict[str, Callable[..., Problem]] = {
    "digits_softmax": digits_softmax,
    "ill_conditioned_least_squares": ill_conditioned_least_squares,
    "diabetes_least_squares": diabetes_least_squares,
    "breast_cancer_logistic": breast_cancer_logistic,
    "digits_mlp": digits_mlp,
    "markov_transformer": markov_transformer,
}

#: Names accepted by :func:`load_problem`, in a stable order.
PROBLEMS: tuple[str, ...] = tuple(_BUILDERS)


def problem_options(name: str) -> tuple[str, ...]:
    """The keyword options (besides ``seed``) that problem ``name`` accepts."""
    builder = _builder(name)
    return tuple(p for p in inspect.signature(builder).parameters if p != "seed")


def load_problem(name: str, *, seed: int = 0, **options: object) -> Problem:
    """Build problem ``name`` (one of :data:`PROBLEMS`) deterministically from ``seed``.

    ``options`` are the problem's own keyword arguments (for example
    ``rows``, ``cols``, ``condition_number`` of
    ``ill_conditioned_least_squares``); see :func:`problem_options`.
    Every call returns a new :class:`Problem`; equal arguments give equal
    arrays. A bad argument raises ``ValueError`` naming it and what is allowed.
    """
    builder = _builder(name)
    allowed = problem_options(name)
    for key in options:
        if key not in allowed:
            raise ValueError(
                f"{key!r} is not an option of problem {name!r}; "
                f"allowed: seed, {', '.join(allowed) if allowed else '(no others)'}"
            )
    return builder(seed=seed, **options)


def _builder(name: object) -> Callable[..., Problem]:
    if not isinstance(name, str) or name not in _BUILDERS:
        raise ValueError(f"name must be one of {', '.join(PROBLEMS)}; got {name!r}")
    return _BUILDERS[name]
