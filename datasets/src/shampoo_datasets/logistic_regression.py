r"""L2-regularized logistic regression on scikit-learn's bundled breast cancer data.

Data: the 569 samples of ``sklearn.datasets.load_breast_cancer`` (bundled, not
downloaded), each of the 30 feature columns standardized to mean 0 and
standard deviation 1, giving ``X`` of shape (n, 30), n = 569, and labels
``y_i`` in {0, 1} (1 = benign).

Model and loss (mean log-loss plus a ridge term on the weights only)::

    z = X w + b 1                              w: (30,),  b: (1,)
    f(w, b) = (1/n) sum_i [ log(1 + exp(z_i)) - y_i z_i ] + (l2 / 2) ||w||^2

Gradient and Hessian (``sigma`` is the logistic function)::

    r      = (sigma(z) - y) / n
    df/dw  = X^T r + l2 w,         df/db = 1^T r
    d^2 f  = [X 1]^T diag(sigma(z) (1 - sigma(z)) / n) [X 1] + l2 diag(1, ..., 1, 0)

The standardized data are linearly separable, so without the ridge term
(``l2 = 0``) the loss has no minimizer (it decreases towards 0 along a
separating direction); ``l2`` must be > 0. With ``l2 > 0`` the loss is
strictly convex and coercive, so it has a unique minimizer. It is computed
once per process and per ``l2`` by Newton's method with backtracking, run
until the gradient norm stops decreasing (about 1e-16 here): ``optimum`` is
that point and ``loss_floor`` its loss. ``target_loss`` is
``loss_floor * (1 + RELATIVE_GAP)``. The start is ``w_0 ~ N(0, init_scale^2)``
from ``seed`` and ``b_0 = 0``. ``metrics`` gives the training accuracy.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from . import _bundled, _validate
from ._problem import Array, Params, Problem, check_params, linear_model_start, read_only

N_FEATURES = 30
#: Solved when the loss is within this relative gap of the minimum. Measured
#: (defaults, seed 0): Adam reaches it in 138 steps at step 0.3 and 312 at 0.1;
#: gradient descent in 314 steps at step 4.
RELATIVE_GAP = 1e-3
#: Default ridge strength: small enough that the fit is close to the
#: separable limit, large enough that the minimizer is well inside float64.
DEFAULT_L2 = 1e-3
#: Newton stops after this many iterations without a smaller gradient norm.
_NEWTON_PATIENCE = 3


@lru_cache(maxsize=1)
def _standardized() -> tuple[Array, Array]:
    features, labels = _bundled.breast_cancer()
    return read_only(_bundled.standardize(features)), read_only(labels)


def _sigmoid(z: Array) -> Array:
    """``1 / (1 + exp(-z))`` without overflow for either sign of ``z``."""
    return np.asarray(np.exp(-np.logaddexp(0.0, -z)), dtype=np.float64)


def _loss(features: Array, labels: Array, l2: float, w: Array, b: Array) -> float:
    z = features @ w + b
    return float(np.mean(np.logaddexp(0.0, z) - labels * z) + 0.5 * l2 * np.dot(w, w))


def _grad(features: Array, labels: Array, l2: float, w: Array, b: Array) -> tuple[Array, Array]:
    r = (_sigmoid(features @ w + b) - labels) / labels.size
    return features.T @ r + l2 * w, np.array([r.sum()])


@lru_cache(maxsize=8)
def _minimizer(l2: float) -> tuple[Array, Array]:
    """The unique minimizer ``(w*, b*)`` by damped Newton from zero.

    Each step solves the (positive definite) Newton system exactly and halves
    the step until the loss does not increase (or, within round-off of it, the
    gradient norm decreases); the loop ends when the gradient norm has not
    improved for a few iterations, i.e. at float64 round-off, and returns the
    iterate with the smallest gradient norm.
    """
    features, labels = _standardized()
    n, d = features.shape
    design = np.hstack([features, np.ones((n, 1))])
    theta = np.zeros(d + 1)
    ridge = l2 * np.diag(np.r_[np.ones(d), 0.0])

    def parts(t: Array) -> tuple[float, Array]:
        gw, gb = _grad(features, labels, l2, t[:d], t[d:])
        return _loss(features, labels, l2, t[:d], t[d:]), np.r_[gw, gb]

    value, gradient = parts(theta)
    best, best_norm, stalled = theta, np.inf, 0
    for _ in range(200):
        s = _sigmoid(design @ theta)
        hessian = design.T @ (design * (s * (1.0 - s) / n)[:, None]) + ridge
        step = np.linalg.solve(hessian, gradient)
        scale = 1.0
        while True:
            trial = theta - scale * step
            trial_value, trial_gradient = parts(trial)
            # Near the minimum the loss is flat to round-off: a step whose loss is
            # equal within a few ulps is taken when it shrinks the gradient (halving
            # it there stalled the gradient norm at 1.3e-13 with l2 = 1e-2).
            flat = trial_value <= value + 4 * np.finfo(np.float64).eps * abs(value)
            shrinks = np.linalg.norm(trial_gradient) < np.linalg.norm(gradient)
            if trial_value <= value or (flat and shrinks) or scale < 1e-12:
                break
            scale *= 0.5
        theta, value, gradient = trial, trial_value, trial_gradient
        norm = float(np.linalg.norm(gradient))
        if norm < best_norm:
            best, best_norm, stalled = theta, norm, 0
        else:
            stalled += 1
            if stalled >= _NEWTON_PATIENCE:
                break
    # The point of smallest gradient norm, not the last: the iterations after it only
    # wander in round-off.
    return read_only(best[:d].copy()), read_only(best[d:].copy())


def breast_cancer_logistic(
    *, seed: int = 0, l2: float = DEFAULT_L2, init_scale: float = 0.01
) -> Problem:
    """Ridge logistic regression on standardized breast cancer data; minimum known."""
    seed = _validate.seed(seed)
    l2 = _validate.positive_real("l2", l2)
    init_scale = _validate.real_at_least("init_scale", init_scale, 0.0)
    features, labels = _standardized()
    n = labels.size
    shapes = {"w": (N_FEATURES,), "b": (1,)}
    name = "breast_cancer_logistic"

    def unpack(params: Params) -> tuple[Array, Array]:
        check_params(name, params, shapes)
        return (
            np.asarray(params["w"], dtype=np.float64),
            np.asarray(params["b"], dtype=np.float64),
        )

    def loss(params: Params) -> float:
        return _loss(features, labels, l2, *unpack(params))

    def grad(params: Params) -> dict[str, Array]:
        gw, gb = _grad(features, labels, l2, *unpack(params))
        return {"w": gw, "b": gb}

    def metrics(params: Params) -> dict[str, float]:
        w, b = unpack(params)
        return {"accuracy": float(np.mean((features @ w + b > 0.0) == (labels == 1.0)))}

    w_star, b_star = _minimizer(l2)
    optimum = {"w": w_star, "b": b_star}
    floor = loss(optimum)
    return Problem(
        name=name,
        init_params=linear_model_start(seed, N_FEATURES, init_scale),
        loss=loss,
        grad=grad,
        target_loss=floor * (1.0 + RELATIVE_GAP),
        description=(
            f"logistic regression on scikit-learn breast cancer (n={n}, 30 standardized "
            f"features), mean log-loss + ({l2:g}/2)||w||^2; params w (30,), b (1,); "
            f"minimum {floor:.6g} (Newton), target = minimum * (1 + {RELATIVE_GAP:g})"
        ),
        optimum=optimum,
        loss_floor=floor,
        data={"features": features, "labels": labels},
        metrics=metrics,
    )
