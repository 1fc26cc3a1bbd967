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

The start vector is NumPy's ``RandomState(1729).uniform(-1, 1, n)``, drawn
here with the standard library alone (``shampoo_spec`` loads no third-party
module): both generators are MT19937, seeded alike, and both draw a double as
``(a * 2^26 + b) / 2^53`` from two 32-bit outputs (``a = x >> 5``,
``b = y >> 6``), so ``random.Random`` set to NumPy's seeded state gives the
same doubles, and ``-1 + 2 * u`` is NumPy's ``low + (high - low) * u``.
"""

from __future__ import annotations

import functools
import random

#: Google's seed for the start vector (``np.random.RandomState(1729)``).
SEED = 1729

#: MT19937's state size (words) and the multiplier of its seeding recurrence.
_STATE_WORDS = 624
_SEED_MULTIPLIER = 1812433253


def _seeded_state(seed: int) -> tuple[int, ...]:
    """MT19937's ``init_genrand(seed)``: the state NumPy's ``RandomState(seed)`` starts
    from (an int seed below 2^32), then the index 624 (every word still to temper)."""
    mt = [seed & 0xFFFFFFFF]
    for i in range(1, _STATE_WORDS):
        prev = mt[i - 1]
        mt.append((_SEED_MULTIPLIER * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
    return (*mt, _STATE_WORDS)


@functools.lru_cache(maxsize=64)
def _start(n: int) -> tuple[float, ...]:
    generator = random.Random()
    generator.setstate((3, _seeded_state(SEED), None))
    return tuple(-1.0 + 2.0 * generator.random() for _ in range(n))


def power_iteration_start(n: int) -> tuple[float, ...]:
    """The start vector for an n x n factor: ``RandomState(1729).uniform(-1, 1, n)``.

    A tuple of n Python floats (float64), equal bit for bit to NumPy's draw;
    cached and immutable. A backend makes it an array of float64 and casts it
    to the factor's dtype, as Google does (``.astype(matrix.dtype)``). Google
    pads a factor to its batch's size and masks the start vector after n
    entries; the uniform draws are a sequence, so that masked vector begins
    with this one.
    """
    return _start(int(n))


__all__ = ["SEED", "power_iteration_start"]
