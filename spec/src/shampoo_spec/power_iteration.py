"""Google's power-iteration estimate of lambda_max for the relative epsilon (eq. 9b).

Every backend runs the same loop from the same start vector, so a config with
``epsilon.lambda_max = "power_iteration"`` reproduces Google's
``relative_matrix_epsilon`` (``precondition/distributed_shampoo.py``,
``power_iteration``) instead of the exact largest eigenvalue, from which it
can be far (docs/spec.md section 3). For a factor A of size n:

    v = power_iteration_start(n) (cast to A's dtype);  s = 0
    repeat at most `steps` times:
        u = v / ||v||;  w = A u;  s' = u . w
        v, s = w, s';  stop when not |s' - s_before| > tolerance
    lambda_max ~ s

A NaN quotient stops the loop (the comparison is false), as in Google's.
"""

from __future__ import annotations

import functools

import numpy as np
from numpy.typing import NDArray

#: Google's seed for the start vector (``np.random.RandomState(1729)``).
SEED = 1729


@functools.lru_cache(maxsize=64)
def _start(n: int) -> NDArray[np.float64]:
    v = np.random.RandomState(SEED).uniform(-1.0, 1.0, n)
    v.setflags(write=False)
    return v


def power_iteration_start(n: int) -> NDArray[np.float64]:
    """The start vector for an n x n factor: ``RandomState(1729).uniform(-1, 1, n)``.

    float64 and read-only; a backend casts it to the factor's dtype, as Google
    does (``.astype(matrix.dtype)``). Google pads a factor to its batch's size
    and masks the start vector after n entries; the uniform draws are a
    sequence, so that masked vector begins with this one.
    """
    return _start(int(n))


__all__ = ["SEED", "power_iteration_start"]
