"""Eq. (9b)'s start vector from the standard library, bit for bit NumPy's, and a
``shampoo_spec`` that loads nothing outside the standard library."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import shampoo_spec as ss


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 64, 311, 312, 623, 624, 625, 1000, 1249, 4096])
def test_start_vector_is_numpys_random_state_draw(n: int) -> None:
    """``RandomState(1729).uniform(-1, 1, n)``, equal bit for bit (state refills at 624
    words, and each double takes two of them, so the sizes cross refills)."""
    start = ss.power_iteration_start(n)
    assert isinstance(start, tuple) and all(type(x) is float for x in start)
    assert np.array_equal(np.asarray(start, dtype=np.float64),
                          np.random.RandomState(1729).uniform(-1.0, 1.0, n))


def test_start_vector_is_cached_and_a_prefix_of_longer_ones() -> None:
    assert ss.power_iteration_start(7) is ss.power_iteration_start(7)
    assert ss.power_iteration_start(9)[:7] == ss.power_iteration_start(7)


def test_import_loads_only_the_standard_library() -> None:
    """A fresh interpreter importing ``shampoo_spec`` gains no module outside the standard
    library and ``shampoo_spec`` (what the interpreter loaded before is not the spec's)."""
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import shampoo_spec\n"
        "print('\\n'.join(sorted(m for m in set(sys.modules) - before\n"
        "    if m.split('.')[0] not in sys.stdlib_module_names\n"
        "    and m.split('.')[0] != 'shampoo_spec')))\n"
    )
    # The test's own PYTHONPATH, led by the directory this shampoo_spec came from.
    source = os.path.dirname(os.path.dirname(os.path.abspath(ss.__file__)))
    paths = [source, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True)
    assert out.stdout.split() == [], f"import shampoo_spec loaded {out.stdout.split()}"
