r"""Seeded, ill-conditioned matrix least squares with a known optimum.

The parameter is one matrix ``X`` of shape (rows, cols) and the loss is::

    f(X) = 1/2 || A X B^T - Y ||_F^2,     Y = A X* B^T,

with square ``A`` (rows x rows) and ``B`` (cols x cols) built from seeded
Haar-random orthogonal matrices and prescribed singular values::

    A = U_A diag(alpha) V_A^T,   B = U_B diag(beta) V_B^T,
    alpha_i = kappa_A^(-(i-1)/(2(rows-1))),  beta_j = kappa_B^(-(j-1)/(2(cols-1))),

so ``kappa(A^T A) = kappa_A`` and ``kappa(B^T B) = kappa_B`` with
``kappa_A * kappa_B = condition_number`` (split evenly when both sides
have more than one row; a side of size 1 takes none of it).

Gradient and Hessian (``vec`` stacks columns, ``vec(A X B^T) = (B kron A) vec X``)::

    df/dX = A^T (A X B^T - Y) B
    d^2 f / d vec(X)^2 = (B^T B) kron (A^T A),

whose eigenvalues ``alpha_i^2 beta_j^2`` lie in ``[1/condition_number, 1]``:
the Hessian's condition number is exactly ``condition_number`` and its
largest eigenvalue is 1 (so gradient descent is stable for step < 2).
The minimizer is ``X*`` (entries i.i.d. N(0, 1) from ``seed``), unique, and
the minimum is 0. The start is ``X_0 = 0``. ``metrics`` gives the relative
error ``||X - X*||_F / ||X*||_F``.

The Hessian is a Kronecker product, which is the structure Shampoo's left
(rows x rows) and right (cols x cols) factors model: Shampoo should beat
gradient descent here by a margin that grows with ``condition_number``.
"""

from __future__ import annotations

import numpy as np

from . import _validate
from ._problem import Array, Params, Problem, check_params, read_only

#: Solved when the loss is this fraction of the starting loss ``f(X_0)``.
RELATIVE_TARGET = 1e-6


def _haar_orthogonal(rng: np.random.Generator, n: int) -> Array:
    """A Haar-distributed n x n orthogonal matrix (QR of a Gaussian, signs fixed)."""
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    signs = np.sign(np.diag(r))
    signs[signs == 0] = 1.0
    return np.asarray(q * signs, dtype=np.float64)


def _with_singular_values(rng: np.random.Generator, values: Array) -> Array:
    """``U diag(values) V^T`` with independent Haar-random ``U`` and ``V``."""
    n = values.size
    return _haar_orthogonal(rng, n) @ np.diag(values) @ _haar_orthogonal(rng, n).T


def _geometric_singular_values(n: int, kappa_gram: float) -> Array:
    """n values from 1 down to ``kappa_gram ** -0.5``, geometric (so the Gram matrix has kappa)."""
    if n == 1:
        return np.ones(1)
    return np.asarray(kappa_gram ** (-0.5 * np.arange(n) / (n - 1)), dtype=np.float64)


def ill_conditioned_least_squares(
    *, seed: int = 0, rows: int = 8, cols: int = 6, condition_number: float = 1e4
) -> Problem:
    """``1/2 ||A X B^T - Y||_F^2`` with Hessian condition number ``condition_number``."""
    seed = _validate.seed(seed)
    rows = _validate.size("rows", rows)
    cols = _validate.size("cols", cols)
    condition_number = _validate.real_at_least("condition_number", condition_number, 1.0)
    if rows == 1 and cols == 1 and condition_number != 1.0:
        raise ValueError(
            f"condition_number must be 1 when rows == cols == 1 (a 1x1 problem has "
            f"condition number 1), got {condition_number!r}"
        )
    if rows > 1 and cols > 1:
        kappa_a = kappa_b = float(np.sqrt(condition_number))
    elif rows > 1:
        kappa_a, kappa_b = condition_number, 1.0
    else:
        kappa_a, kappa_b = 1.0, condition_number

    rng = np.random.default_rng(seed)
    a = read_only(_with_singular_values(rng, _geometric_singular_values(rows, kappa_a)))
    b = read_only(_with_singular_values(rng, _geometric_singular_values(cols, kappa_b)))
    x_star = read_only(rng.standard_normal((rows, cols)))
    y = read_only(a @ x_star @ b.T)
    shapes = {"X": (rows, cols)}
    name = "ill_conditioned_least_squares"

    def residual(params: Params) -> Array:
        check_params(name, params, shapes)
        x = np.asarray(params["X"], dtype=np.float64)
        return np.asarray(a @ x @ b.T - y, dtype=np.float64)

    def loss(params: Params) -> float:
        r = residual(params)
        return 0.5 * float(np.sum(r * r))

    def grad(params: Params) -> dict[str, Array]:
        return {"X": a.T @ residual(params) @ b}

    optimum_norm = float(np.linalg.norm(x_star))

    def metrics(params: Params) -> dict[str, float]:
        check_params(name, params, shapes)
        error = np.asarray(params["X"], dtype=np.float64) - x_star
        return {"relative_error": float(np.linalg.norm(error)) / optimum_norm}

    init = {"X": read_only(np.zeros((rows, cols)))}
    return Problem(
        name=name,
        init_params=init,
        loss=loss,
        grad=grad,
        target_loss=RELATIVE_TARGET * loss(init),
        description=(
            f"1/2 ||A X B^T - Y||_F^2 with X of shape ({rows}, {cols}), Hessian "
            f"(B^T B) kron (A^T A) of condition number {condition_number:g}, "
            "known optimum X* and minimum 0, start X_0 = 0"
        ),
        optimum={"X": x_star},
        loss_floor=0.0,
        data={"A": a, "B": b, "Y": y},
        metrics=metrics,
    )
