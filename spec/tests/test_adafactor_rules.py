"""Eq. (14e)'s host-side rules in ``GraftingConfig``, which the reference and torch use:
the factored dims are a stable sort's (optax's, numpy's argsort, where no size of the
two largest is shared), and beta_t is
``1 - t^(-c)`` with t^(-c) correctly rounded to float32 (numpy's float64 power, rounded),
then float32's subtraction."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import shampoo_spec as ss


def _graft(c: float = 0.8, m: int = 3) -> ss.GraftingConfig:
    return ss.GraftingConfig(type="adafactor", epsilon_placement="inside_sqrt",
                             decay_exponent=c, factor_min_dim=m)


@pytest.mark.parametrize("m", [1, 3, 5])
def test_factored_dims_are_a_stable_sorts_and_optaxs_without_ties(m: int) -> None:
    """Every shape of rank 0-4 with dims 1-5: the last two of a stable ascending sort
    by size (on ties the later dim sorts last), when the second is >= m; where neither
    of the two largest sizes is shared, that is ``np.argsort(shape)``'s (optax's
    ``_factored_dims``), which numpy 2 does not sort stably for every shape."""
    graft = _graft(m=m)
    for rank in range(5):
        for shape in itertools.product(range(1, 6), repeat=rank):
            got = graft.factored_dims(shape)
            if rank < 2:
                assert got is None
                continue
            sizes = sorted(shape)
            d1_size = sizes[-2]
            if d1_size < m:
                assert got is None, shape
                continue
            assert got is not None
            d0, d1 = got
            assert shape[d0] == sizes[-1] and shape[d1] == d1_size, shape
            # Ties: the later of equal dims sorts last.
            assert d0 == max(k for k, n in enumerate(shape) if n == sizes[-1]), shape
            if sizes[-1] == d1_size:
                assert d1 == max(k for k, n in enumerate(shape) if n == d1_size and k != d0)
            else:
                assert d1 == max(k for k, n in enumerate(shape) if n == d1_size), shape
            if sizes[-1] > d1_size and (rank == 2 or sizes[-3] < d1_size):
                order = np.argsort(shape)
                assert got == (int(order[-1]), int(order[-2])), shape


@pytest.mark.parametrize("c", [1e-12, 0.5, 0.8, 0.999, 1.0])
def test_decay_is_float32_of_a_correctly_rounded_power(c: float) -> None:
    graft = _graft(c)
    t = np.arange(1, 5001, dtype=np.float64)
    want = np.float32(1.0) - np.power(t, -c).astype(np.float32)  # float32 subtraction
    got = np.array([graft.adafactor_decay(int(k)) for k in t], dtype=np.float32)
    np.testing.assert_array_equal(got, want)
    assert graft.adafactor_decay(1) == 0.0
