"""The guard that keeps a long session under vm.max_map_count (compiled_code.py)."""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from shampoo_conformance.compiled_code import memory_maps, release_jax_compilations_if_crowded

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@linux_only
def test_memory_maps_counts_this_process_below_its_limit() -> None:
    maps = memory_maps()
    assert maps is not None
    held, limit = maps
    assert 0 < held < limit


def _compiled(jitted: Any) -> int:
    """How many executables a jitted function holds in JAX's cache."""
    return int(jitted._cache_size())


@linux_only
def test_crowded_process_releases_the_compiled_executables() -> None:
    step = jax.jit(lambda x: x + 1.0)
    step(jnp.ones(3))
    assert _compiled(step) == 1
    assert not release_jax_compilations_if_crowded(fraction=2.0)  # never that crowded
    assert _compiled(step) == 1
    assert release_jax_compilations_if_crowded(fraction=0.0)  # always crowded
    assert _compiled(step) == 0
