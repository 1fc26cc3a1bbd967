"""Keep a long test process under the kernel's limit on memory maps.

XLA's CPU compiler maps memory for every executable it builds (about 650
maps for one three-step run of ``optax.contrib.muon``), and JAX keeps each in
its caches as long as the function it compiled lives, which for a
transformation built per run is until the caches are cleared. A Hypothesis
session of a thousand examples then reaches ``vm.max_map_count`` (65,530
here): LLVM reports "Cannot allocate memory" and the process segfaults
inside ``backend_compile_and_load`` (the deep profile's parameter-order law
on optax-muon, example 1,423). Clearing JAX's caches releases the maps;
clearing them after every run would double such a session's time (a
transformation built again compiles again), so they are cleared only once
the process holds half the limit.
"""

from __future__ import annotations

import sys

_MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"
_OWN_MAPS = "/proc/self/maps"


def memory_maps() -> tuple[int, int] | None:
    """(maps this process holds, the kernel's limit), or None where /proc does not say."""
    try:
        with open(_MAX_MAP_COUNT) as f:
            limit = int(f.read())
        with open(_OWN_MAPS, "rb") as f:
            held = sum(1 for _ in f)
    except (OSError, ValueError):
        return None
    return held, limit


def release_jax_compilations_if_crowded(fraction: float = 0.5) -> bool:
    """Clear JAX's caches (and the executables they hold) when this process holds at
    least ``fraction`` of its allowed memory maps; whether it did. Nothing happens
    where JAX was never imported or /proc says nothing (not Linux)."""
    jax = sys.modules.get("jax")
    maps = memory_maps()
    if jax is None or maps is None or maps[0] < fraction * maps[1]:
        return False
    jax.clear_caches()
    return True
