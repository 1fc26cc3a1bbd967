"""The Newton family of inverse roots (docs/spec.md eqs. 11, 11c, 11d).

Eq. (11)'s coupled Newton iteration with its retries at a larger ridge,
eq. (11c)'s coupled higher-order iteration (Meta's), and eq. (11d)'s Newton
root with LOBPCG's top-k eigenpairs deflated (Google's).

Host syncs: the iterations stop when every row has converged; they ask the
device whether any row is still running every :func:`check_every`
iterations (1 on CPU, where it is free); the results do not depend on that
interval because finished rows are frozen. Eq. (11d)'s LOBPCG reads which
rows still run once per iteration (at most m per root step).
"""

from __future__ import annotations

from fractions import Fraction

import torch

from shampoo_spec import CoupledNewtonConfig, EpsilonConfig, HigherOrderNewtonConfig

from ..device_path import on_cpu_path
from ..invariance import rowwise
from .lobpcg import lobpcg_top_k, pth_root_difference
from .regularize import effective_epsilon, finite_rows, sanitize, symmetrize


def check_interval(device: torch.device) -> int:
    """Iterations between host reads of "is any row still running?" (eqs. 11, 11c, 17c):
    1 on CPU, where a read costs nothing to wait for; 8 on an accelerator."""
    return 1 if on_cpu_path(device) else 8


def coupled_newton_iteration(
    a: torch.Tensor, root: int, config: CoupledNewtonConfig, symmetric: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """One run of eq. (11) on each row of ``a`` (ridge already added): (X, error).

    Row by row this is exactly reference ``linalg.coupled_newton_iteration``:
    rows stop independently (tolerance, ``max_iterations``, or error growth
    beyond ``error_growth_limit``, which keeps the previous iterate and
    reports the grown error); a zero or non-finite norm gives (I, nan).
    ``symmetric=False``: the matrices as they are (eq. 20c's read-back factors).
    """
    a = symmetrize(a) if symmetric else a
    n = a.shape[-1]
    eye = torch.eye(n, dtype=a.dtype, device=a.device)
    norm = torch.linalg.matrix_norm(a)
    bad = ~torch.isfinite(norm) | (norm == 0)
    z = (1.0 + root) / (2.0 * torch.where(bad, torch.ones_like(norm), norm))
    # pow per row (batch invariance, :mod:`.invariance`); the rest is matmuls, exactly
    # rounded elementwise operations and row reductions, each row computed alone.
    x = eye * rowwise(lambda v: v.pow(1.0 / root), z)[:, None, None]
    m = a * z[:, None, None]
    x = torch.where(bad[:, None, None], eye, x)
    m = torch.where(bad[:, None, None], eye, m)
    error = (m - eye).abs().flatten(1).amax(dim=1)
    error = torch.where(bad, torch.full_like(error, float("nan")), error)
    active = error > config.tolerance  # False for nan, as in the reference loop
    check_every = check_interval(a.device)
    growth = config.error_growth_limit
    for it in range(config.max_iterations):
        if it % check_every == 0 and not bool(active.any()):
            break
        t = ((root + 1.0) * eye - m) / root
        new_m = torch.matmul(torch.linalg.matrix_power(t, root), m)
        new_error = (new_m - eye).abs().flatten(1).amax(dim=1)
        if growth is not None:
            grown = active & ~(new_error < error * growth)
            error = torch.where(grown, new_error, error)
            active = active & ~grown
        act = active[:, None, None]
        x = torch.where(act, torch.matmul(x, t), x)
        m = torch.where(act, new_m, m)
        error = torch.where(active, new_error, error)
        active = active & (new_error > config.tolerance)
    return x, error


def root_inverse_coupled_newton(
    a: torch.Tensor, root: int, eps: EpsilonConfig, config: CoupledNewtonConfig,
    symmetric: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A + eps I)^(-1/root)`` by eq. (11) with retries at a larger ridge; (X, ok).

    While a row's error exceeds ``retry_error_threshold`` (or is not finite)
    and retries remain, its ridge is multiplied by ``retry_epsilon_factor``
    and the iteration rerun for it. A row fails when its final error is not
    finite or ``>= failure_threshold``. Retrying stops early once no ridge can
    grow (all inf), where a rerun would only repeat the result. Cost: at most
    ``(retries + 1) * max_iterations`` iterations (max_iterations <= 10000 by
    the spec: a non-converging 64 x 64 factor takes about 1 s of CPU at the
    bound).
    """
    a, ok = sanitize(a)
    x, error = _coupled_newton_with_retries(a, root, effective_epsilon(a, eps), config,
                                            symmetric)
    return x, ok & _newton_passes(error, config) & finite_rows(x)


def _newton_passes(error: torch.Tensor, config: CoupledNewtonConfig) -> torch.Tensor:
    """Eq. (11)'s failure test per row: the final error finite and ``< failure_threshold``."""
    good = torch.isfinite(error)
    if config.failure_threshold is not None:
        good = good & (error < config.failure_threshold)
    return good


def _coupled_newton_with_retries(
    a: torch.Tensor, root: int, ridge: torch.Tensor, config: CoupledNewtonConfig,
    symmetric: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (11) on ``A + ridge I`` per row (``ridge`` [B]) with the retries of
    :func:`root_inverse_coupled_newton`; (X, final error)."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    x, error = coupled_newton_iteration(a + ridge[:, None, None] * eye, root, config, symmetric)
    for _ in range(config.retries):
        retry = ~(torch.isfinite(error) & (error <= config.retry_error_threshold))
        if not bool(retry.any()):
            break
        grown = torch.where(retry, ridge * config.retry_epsilon_factor, ridge)
        if not bool((grown != ridge).any()):
            break  # every retrying ridge is inf already: reruns would repeat (I, nan)
        ridge = grown
        x2, e2 = coupled_newton_iteration(a + ridge[:, None, None] * eye, root, config,
                                          symmetric)
        x = torch.where(retry[:, None, None], x2, x)
        error = torch.where(retry, e2, error)
    return x, error


def root_inverse_higher_order(
    a: torch.Tensor, root: float, config: HigherOrderNewtonConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """``A^(-1/root)`` of each row by eq. (11c), Meta's coupled higher-order iteration; (X, ok).

    Row by row reference ``linalg.root_inverse_higher_order``: ``root = p/q``
    exactly, the ridge ``max(rel_epsilon ||A||_inf, abs_epsilon)``, one
    Newton step, then Horner steps of ``order`` while a row's error exceeds
    the tolerance (rows stop independently, keeping the iterate that grew
    or stalled); a row fails on a non-finite ``||A||_inf``, on
    ``max|(A + eps I) X^p - I| > 0.1`` or on a non-finite ``X^q``.
    """
    fraction = Fraction(root)
    p, q = fraction.numerator, fraction.denominator
    a, ok = sanitize(a)
    a = symmetrize(a)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    lam = a.abs().sum(dim=-1).amax(dim=-1)
    ok = ok & torch.isfinite(lam)
    eps = torch.clamp_min(lam * config.rel_epsilon, config.abs_epsilon)
    a = a + eps[:, None, None] * eye
    z = 1.0 / torch.diagonal(a, dim1=-2, dim2=-1).sum(-1)
    s = -1.0 / p
    x = z.pow(1.0 / p)[:, None, None] * eye
    m = z[:, None, None] * a
    t = s * m + (1.0 - s) * eye  # the Newton step first
    x = torch.matmul(x, t)
    m = torch.matmul(torch.linalg.matrix_power(t, p), m)
    error = (m - eye).abs().flatten(1).amax(dim=1)
    b = config.coefficients(p)
    active = error > config.tolerance  # False for NaN, as the reference's loop
    check_every = check_interval(a.device)
    for it in range(1, config.max_iterations):
        if (it - 1) % check_every == 0 and not bool(active.any()):
            break
        base = eye - m
        t = b[-1] * base + b[-2] * eye
        for coefficient in reversed(b[:-2]):
            t = coefficient * eye + torch.matmul(t, base)
        act = active[:, None, None]
        x = torch.where(act, torch.matmul(x, t), x)
        m = torch.where(act, torch.matmul(torch.linalg.matrix_power(t, p), m), m)
        new_error = (m - eye).abs().flatten(1).amax(dim=1)
        stop = (new_error > error * 1.2) | ((new_error == error) & (error < 1e-3))
        error = torch.where(active & ~stop, new_error, error)
        active = active & ~stop & (new_error > config.tolerance)
    true_error = (torch.matmul(a, torch.linalg.matrix_power(x, p)) - eye).abs().flatten(1)
    ok = ok & ~(true_error.amax(dim=1) > 0.1)  # NaN passes here, as Meta's test; X^q decides
    if q > 1:
        x = torch.linalg.matrix_power(x, q)
    return x, ok & finite_rows(x)


def root_inverse_deflated_newton(
    a: torch.Tensor, root: int, eps: EpsilonConfig, config: CoupledNewtonConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (11d): ``(A + eps I)^(-1/root)`` per row by eq. (11) with the top-k pairs
    deflated (Google's ``lobpcg_topk_precondition``); (X, ok).

    Row by row reference ``linalg.root_inverse_deflated_newton``: LOBPCG's
    top-k Ritz pairs (theta, V) of ``sym(A)`` (:func:`.lobpcg.lobpcg_top_k`,
    k = ``deflation_rank``, m = ``lobpcg_iterations``), lambda_max = max theta
    for a relative epsilon (instead of eq. 9b), then

        A_d = A - V diag(theta - min theta) V^T
        X   = Newton(A_d + eps I) - V diag(d) V^T,
        d_i = (eps + min theta)^(-1/r) - (eps + theta_i)^(-1/r)

    with eq. (11)'s retries on A_d. Where V holds exact eigenvectors this is
    the root of A + eps I itself; after fewer iterations it is not, so a row
    fails (eq. 13) when ``max|X^r (A + eps I) - I|``, on the undeflated
    factor, is not finite or ``>= failure_threshold``. Only for symmetric
    factors (the config refuses eq. 20c's read-back ones).
    """
    a, ok = sanitize(a)
    a = symmetrize(a)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    top = lobpcg_top_k(a, config.deflation_rank, config.lobpcg_iterations)
    low = top.values.amin(dim=-1)
    # theta - low >= 0: the Ritz values are the top k and low their least.
    shift = top.vectors * torch.sqrt(top.values - low[:, None])[:, None, :]
    deflated = a - shift @ shift.mT
    ridge = torch.full_like(low, eps.value)
    if eps.scale == "relative":  # max theta: LOBPCG's estimate of lambda_max
        ridge = ridge * torch.clamp_min(top.values.amax(dim=-1), eps.relative_floor)
    x, _ = _coupled_newton_with_retries(deflated, root, ridge, config)
    restore = top.vectors * torch.sqrt(
        pth_root_difference(ridge, low, top.values, root))[:, None, :]
    x = x - restore @ restore.mT
    check = torch.linalg.matrix_power(x, root) @ (a + ridge[:, None, None] * eye)
    error = (check - eye).abs().flatten(1).amax(dim=1)
    return x, ok & _newton_passes(error, config) & finite_rows(x)
