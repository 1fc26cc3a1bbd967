"""Shared fixtures and data for shampoo_jax tests.

XLA's CPU backend spends most of these tests compiling (the programs are
small, the runs short). The legacy (non-"fusion emitter") CPU codegen at a
low LLVM optimisation level compiles 3-5x faster; results change only by
rounding. Set before jax is imported; an XLA_FLAGS the user set wins.

The sharded tests (test_sharded*.py) need four host devices: the
``--xla_force_host_platform_device_count`` flag is appended unless the
user's XLA_FLAGS already sets it. It changes nothing for one-device
programs (they run on device 0).
"""

from __future__ import annotations

import os

os.environ.setdefault(
    "XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
)
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"
