"""A block's preconditioned direction: eq. (16) by its inverse roots, eq. (17) eigenvalue-corrected.

Eq. numbers refer to docs/spec.md: the Kronecker product of the roots
applied by mode products (eq. 16, in the roots' dtype with eq. 11a), and
the eigenvalue-corrected direction with its second moment D in the
eigenbasis (eq. 17, in the dtypes of eq. 17a).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from shampoo_spec import ShampooConfig

from .linalg import mode_product
from .rounding import round_to, scalar_in
from .state import BlockState

Array = NDArray[np.float64]


def update_corrected_moment(config: ShampooConfig, bs: BlockState, gb: Array) -> None:
    """Eq. (17): ``D <- beta2 D + w R^2``, R the gradient in the eigenbasis
    (w = ``ec.update_weight``: 1 - beta2, or 1 with ``ema_weight="one"``).

    With ``corrected_eigenvalues_dtype`` s (eq. 17a) Meta's order and
    roundings: ``round_s(c_s(beta2) D)`` (skipped for a sum), then
    ``+ (w R) R`` in float64, rounded to s once.
    """
    ec = config.eigenvalue_correction
    assert ec is not None and bs.corrected_second_moment is not None
    rotated = rotate(config, bs, gb, transpose=True)
    d = bs.corrected_second_moment
    s = ec.corrected_eigenvalues_dtype
    if s is not None:
        weight = ec.update_weight if ec.decays else 1.0
        with np.errstate(over="ignore", invalid="ignore"):
            decayed = round_to(scalar_in(ec.beta2, s) * d, s) if ec.decays else d
            bs.corrected_second_moment = round_to(decayed + (weight * rotated) * rotated, s)
    elif not ec.decays:
        bs.corrected_second_moment = d + rotated**2
    else:
        bs.corrected_second_moment = ec.beta2 * d + ec.update_weight * rotated**2
    bs.corrected_updates += 1


def kronecker_direction(config: ShampooConfig, bs: BlockState, fb: Array) -> Array:
    """Eq. (16): ``P_B = F~_B x_k1 X_k1 x_k2 X_k2 ...`` over the preconditioned dims.

    With ``inverse_root_dtype`` s (roots already rounded, eq. 11a) the
    products are Meta's in s: ``round_s(F~_B)``, then each mode product
    rounded to s, in dim order. Each product is formed in float64 (exact
    products of numbers of s; only the n-term sums round, at 2^-53) and
    rounded once, the most accurate result a product in s can have. A
    block with no preconditioned dim is not rounded (Meta's empty
    preconditioner list keeps the gradient's dtype).
    """
    dtype = config.inverse_root_dtype
    preconditioned = [(k, xk) for k, xk in enumerate(bs.inverse_roots) if xk is not None]
    if config.statistics.quantized:
        # Eq. (20c): a read-back root is not symmetric; Google contracts the
        # block's dim with the root's first index: X^T applied.
        preconditioned = [(k, xk.T) for k, xk in preconditioned]
    if dtype is None or not preconditioned:
        pb = fb
        for k, xk in preconditioned:
            pb = mode_product(pb, xk, k)
        return pb
    with np.errstate(over="ignore", invalid="ignore"):  # float16 overflow: eq. (22)
        pb = round_to(fb, dtype)
        for k, xk in preconditioned:
            pb = round_to(mode_product(pb, xk, k), dtype)
    return pb


def corrected_direction(config: ShampooConfig, bs: BlockState, fb: Array) -> Array:
    """Eq. (17): ``((F~ x_k Q_k^T) / ((D / bc)^(1/root) + epsilon)) x_k Q_k``.

    With ``corrected_eigenvalues_dtype`` s (eq. 17a) the denominator is
    Meta's, computed in s: ``round_s(round_s(round_s(D / c_s(bc))^(1/root))
    + c_s(epsilon))`` (each operation in float64, exact or correctly
    rounded for these operands, then rounded to s); the quotient is in
    float64.
    """
    ec = config.eigenvalue_correction
    assert ec is not None and bs.corrected_second_moment is not None
    bc = ec.bias_correction_factor(bs.corrected_updates)
    root = ec.root_for(fb.ndim)
    s = ec.corrected_eigenvalues_dtype
    rotated = rotate(config, bs, fb, transpose=True)
    if s is None:
        d = bs.corrected_second_moment / bc
        scaled = rotated / (d ** (1.0 / root) + ec.epsilon)
    else:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            d = round_to(bs.corrected_second_moment / scalar_in(bc, s), s)
            powered = round_to(np.sqrt(d) if root == 2 else d ** (1.0 / root), s)
            denominator = round_to(powered + scalar_in(ec.epsilon, s), s)
            scaled = rotated / denominator
    return rotate(config, bs, scaled, transpose=False)


def rotate(config: ShampooConfig, bs: BlockState, x: Array, transpose: bool) -> Array:
    """Eq. (17): ``x x_k Q_k^T`` (``transpose``) or ``x x_k Q_k`` over the preconditioned dims.

    With ``eigenvectors_dtype`` q (eq. 17a; Q_k already rounded to q) the
    rotation is Meta's in q: x rounded to q, then each mode product
    formed in float64 and rounded to q, in dim order (as eq. 16's
    products with ``inverse_root_dtype``). A block with no preconditioned
    dim is not rounded.
    """
    ec = config.eigenvalue_correction
    dtype = None if ec is None else ec.eigenvectors_dtype
    bases = [(k, q) for k, q in enumerate(bs.inverse_roots) if q is not None]
    if dtype is None or not bases:
        for k, q in bases:
            x = mode_product(x, q.T if transpose else q, k)
        return x
    with np.errstate(over="ignore", invalid="ignore"):  # float16 overflow: eq. (22)
        x = round_to(x, dtype)
        for k, q in bases:
            x = round_to(mode_product(x, q.T if transpose else q, k), dtype)
    return x
